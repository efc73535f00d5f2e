#!/usr/bin/env bash
# Builds and runs every benchmark; prints a table and appends JSON lines to
# build/bench/results.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j2 --target bench_world1_overhead bench_activation_checkpoint bench_checkpoint
mkdir -p build/bench
machine="$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
for b in bench_world1_overhead bench_activation_checkpoint bench_checkpoint; do
  out=$(./build/bin/$b)
  echo "$out" | grep -v '^{'
  echo "$out" | grep '^{' | sed "s/}\$/, \"machine\": \"$machine\"}/" | tee -a build/bench/results.jsonl
  echo
done
