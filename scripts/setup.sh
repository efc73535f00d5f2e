#!/usr/bin/env bash
# One command on a fresh Debian 12 (or Ubuntu) machine: install the dependencies,
# build, and run the demo (a GPT trained fully sharded over 2 ranks on this CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
echo "[setup] configuring and building (first build takes a few minutes on 2 cores)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j2
./scripts/demo.sh
