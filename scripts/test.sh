#!/usr/bin/env bash
# Builds everything into build/ and runs the whole test suite (ctest over GoogleTest).
# FSDP_CMAKE_ARGS adds CMake options (CI's Debian 13 leg: -DFSDP_BUILD_BENCHMARKS=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
B="${FSDP_BUILD_DIR:-build}"   # scripts/in-debian13.sh builds into its own directory
read -ra EXTRA <<<"${FSDP_CMAKE_ARGS:-}"
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release "${EXTRA[@]}"
cmake --build "$B" -j2
ctest --test-dir "$B" --output-on-failure -j2 "$@"
