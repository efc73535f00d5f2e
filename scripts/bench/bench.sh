#!/usr/bin/env bash
# Builds and runs every benchmark; prints their tables and appends one JSON line per
# metric ({"metric", "value", "unit", "baseline", "machine"}) to build/bench/results.jsonl.
# Every figure is a ratio against a baseline measured in the same run (these machines
# are shared and noisy). Takes a few minutes on 2 cores and needs ~3 GB of disk.
set -euo pipefail
cd "$(dirname "$0")/../.."
BENCHES=(bench_adamw bench_nvme bench_world1_overhead bench_activation_checkpoint bench_checkpoint bench_model_state bench_trace bench_attention)
. scripts/lib/python-env.sh
. scripts/lib/build.sh
fsdp_torch_setup
fsdp_configure release build >/dev/null
cmake --build build --target "${BENCHES[@]}" fsdp-run fsdp-consolidate
mkdir -p build/bench
machine="$(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
results=build/bench/results.jsonl
touch "$results"
first=$(($(wc -l < "$results") + 1))
run() {
  echo "== $*"
  out=$("$@")
  echo "$out" | grep -v '^{'
  echo "$out" | grep '^{' | sed "s/}\$/, \"machine\": \"$machine\"}/" | tee -a "$results"
  echo
}
run ./build/bin/bench_adamw
run ./build/bin/bench_world1_overhead
run ./build/bin/bench_activation_checkpoint
run ./build/bin/bench_checkpoint --gb 1.0 --dir build/bench/ckpt
mkdir -p build/bench/nvme
run ./build/bin/bench_nvme --dir build/bench/nvme
for n in 1 2 4; do run ./build/bin/fsdp-run --nproc "$n" -- ./build/bin/bench_model_state; done
run ./build/bin/fsdp-run --nproc 2 -- ./build/bin/bench_trace
run ./build/bin/bench_attention
echo "== summary (this run)"
tail -n +"$first" "$results" | sed 's/, "machine".*//' | awk -F'"' '{printf "  %-48s %s\n", $4, $7}' | sed 's/: //; s/, $//'
