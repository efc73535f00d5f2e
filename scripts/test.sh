#!/usr/bin/env bash
# Builds everything into build/ and runs the whole test suite (ctest over GoogleTest).
set -euo pipefail
cd "$(dirname "$0")/.."
B="${FSDP_BUILD_DIR:-build}"   # scripts/in-debian13.sh builds into its own directory
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$B" -j2
ctest --test-dir "$B" --output-on-failure -j2 "$@"
