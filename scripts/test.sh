#!/usr/bin/env bash
# Builds everything into build/ and runs the test suite (ctest over GoogleTest), against
# the same LibTorch and Python as scripts/setup.sh (scripts/lib/python-env.sh: PyPI's torch
# in .venv/ by default). The build is CMakePresets.json's "release" (scripts/lib/build.sh).
#
#   scripts/test.sh          every test that checks behaviour: all but the label `long`
#   scripts/test.sh --all    the long tier too (CI runs it): the memory-cgroup proofs,
#                            the benchmarks run as tests, the consumer builds from source
#                            (add_subdirectory, FetchContent) and the comparisons with
#                            PyTorch FSDP and DeepSpeed (tests/CMakeLists.txt, "Tiers")
#
# Other arguments go to ctest (e.g. -R parity, -L interop): each test file is one entry, its
# cases run in one process (tests/CMakeLists.txt, FSDP_TEST_EACH_CASE). FSDP_CMAKE_ARGS adds
# CMake options.
set -euo pipefail
cd "$(dirname "$0")/.."
TIER=(-LE '^long$')
if [ "${1:-}" = --all ]; then
  TIER=()
  shift
fi
B="${FSDP_BUILD_DIR:-build}"   # scripts/ci/in-debian13.sh builds into its own directory
read -ra EXTRA <<<"${FSDP_CMAKE_ARGS:-}"
. scripts/lib/python-env.sh
. scripts/lib/build.sh
fsdp_torch_setup
fsdp_configure release "$B" "${EXTRA[@]}"
cmake --build "$B"
[ "${FSDP_TEST_BUILD_ONLY:-0}" = 1 ] && exit 0   # CI times the build and the tests apart
if [ ${#TIER[@]} -gt 0 ]; then
  echo "[test] the default tier: every test but the label 'long' (scripts/test.sh --all runs those too)"
else
  echo "[test] every tier, the label 'long' included"
fi
fsdp_ctest "$B" "${TIER[@]}" "$@"
