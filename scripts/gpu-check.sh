#!/usr/bin/env bash
# Builds against the CUDA LibTorch of this machine's Python torch (2.x) and runs the
# GPU checks (tests/test_cuda.cpp: sharded GPT vs plain LibTorch on the GPU over NCCL,
# CPU offload with pinned host shards, checkpoint round trip with the CUDA RNG), then
# the CPU-side suites that must still pass there, and bench_gpu. Needs GoogleTest and,
# for checkpoints, HDF5 headers; without HDF5 the build still succeeds (checkpoints then
# say so).
set -euo pipefail
cd "$(dirname "$0")/.."
# The LibTorch of the python3 on PATH that has the CUDA torch (on a GPU machine, its own
# Python, not Debian's CPU one at /usr/bin/python3); TORCH_PREFIX overrides it.
PREFIX="${TORCH_PREFIX:-$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')}"
cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PREFIX" "$@"
cmake --build build-cuda -j"$(nproc)"
ctest --test-dir build-cuda --output-on-failure -R 'Cuda|FusedAdamW|Offload|Parity' -j4
# The GPU metrics of issue 7 (tokens/s, peak memory and MFU against plain LibTorch,
# largest model with offload), as JSON lines like scripts/bench.sh writes.
mkdir -p build-cuda/bench
./build-cuda/bin/bench_gpu | tee build-cuda/bench/gpu.txt
