#!/usr/bin/env bash
# One command on a fresh Debian 12 (or Ubuntu) machine: install the dependencies,
# build, and run the demo (a GPT trained fully sharded over 2 ranks on this CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
B="${FSDP_BUILD_DIR:-build}"   # scripts/in-debian13.sh builds into its own directory
./scripts/install-deps.sh
echo "[setup] configuring and building (first build takes a few minutes on 2 cores)"
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$B" -j2
./scripts/demo.sh
