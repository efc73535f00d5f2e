#!/usr/bin/env bash
# One command on a fresh Debian 12 (or 13) machine: install the dependencies (Debian's
# build packages; PyPI's torch, pinned in scripts/requirements.txt, into .venv/), build
# the library, its tools and the examples against that LibTorch (the target `programs`;
# scripts/test.sh builds the tests), and run the demo (a GPT trained fully sharded over 2
# ranks on this CPU). FSDP_TORCH=system builds against the LibTorch CMake finds instead
# (scripts/lib/python-env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
B="${FSDP_BUILD_DIR:-build}"   # scripts/ci/in-debian13.sh builds into its own directory
./scripts/install-deps.sh
. scripts/lib/python-env.sh
. scripts/lib/build.sh
fsdp_torch_setup
echo "[setup] configuring and building the library, its tools and the examples (the tests are scripts/test.sh's)"
fsdp_configure release "$B" | grep -E '^-- fsdp:|Warning|Error' || true
T0=$SECONDS
cmake --build "$B" --target programs
echo "[setup] built in $((SECONDS - T0)) s"
./scripts/demo.sh
