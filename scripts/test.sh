#!/usr/bin/env bash
# Builds everything into build/ and runs the whole test suite (ctest over GoogleTest).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2
ctest --test-dir build --output-on-failure -j2 "$@"
