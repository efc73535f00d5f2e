#!/usr/bin/env bash
# Builds everything into build/ and runs the whole test suite (ctest over GoogleTest),
# against the same LibTorch and Python as scripts/setup.sh (scripts/lib/python-env.sh:
# PyPI's torch in .venv/ by default). FSDP_CMAKE_ARGS adds CMake options; arguments go
# to ctest (e.g. -R Parity). The build is CMakePresets.json's "release" (scripts/lib/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
B="${FSDP_BUILD_DIR:-build}"   # scripts/ci/in-debian13.sh builds into its own directory
read -ra EXTRA <<<"${FSDP_CMAKE_ARGS:-}"
. scripts/lib/python-env.sh
. scripts/lib/build.sh
fsdp_torch_setup
fsdp_configure release "$B" "${EXTRA[@]}"
cmake --build "$B"
[ "${FSDP_TEST_BUILD_ONLY:-0}" = 1 ] && exit 0   # CI times the build and the tests apart
fsdp_ctest "$B" "$@"
