#!/usr/bin/env bash
# CI's Debian 13 leg: the suite's tests of the code that meets LibTorch APIs which differ
# between 2.x versions, built and run against Debian 13's LibTorch 2.6 (the oldest
# supported). Run it in the Debian 13 root:
#
#   scripts/ci/in-debian13.sh ./scripts/ci/test-debian13.sh      (extra arguments go to ctest)
#
# The whole suite runs against PyPI's newest torch in leg 1; the same sources compiled
# against 2.6 differ only where LibTorch's API or numerics do, so the cases of these test files run here
# (each file is its cases' label; tests/CMakeLists.txt, "Test binaries"):
#   test_process_group   c10d: ProcessGroupGloo, TCPStore (Debian's has no libuv), splits
#   test_parity          autograd: gradient accumulator hooks, the post-backward callback
#   test_grad_accum      the same hooks across micro-batches, no_sync
#   test_activation_checkpoint  custom autograd Functions, RNG state
#   test_attention       at::scaled_dot_product_attention (its CPU kernels, enable_gqa,
#                        dropout_p) against the explicit softmax
#   test_mixed_precision bf16/fp16 CPU kernels and Gloo's reductions of them
#   test_memory_comm     the CPU allocator interface (the counting allocator), exact bytes
#   test_fused_adamw     bit-equality with this LibTorch's torch::optim::AdamW
#   test_checkpoint_*    optimizer state keys, dtype conversions (NaN bits), HDF5 1.14
#                        (every checkpoint file: sharded, async, crash, consolidated,
#                        safetensors, errors, integrity)
#   test_safetensors     the same conversions into safetensors
#   Interop.*            PyTorch FSDP1 and safetensors of Debian's python3-torch 2.6
# and, of test_examples, only TrainGpt.TorchrunGivesTheSameLossesAsFsdpRun: torchrun of
# Debian's torch has no libuv and goes through scripts/torchrun.py (its other cases test
# the programs' own flags and errors, run against 2.15 in leg 1)
# and the scratch configure of the build variants (Build.*). The other files
# (policies, strategies, errors, estimates, offload, reshard planning, desync, the CUDA
# test) exercise this project's own logic over the same LibTorch calls; the
# tests/consumer builds are the .deb leg's (scripts/release/deb-check.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
B="${FSDP_BUILD_DIR:-build-debian13}"
FILES=(test_process_group test_parity test_grad_accum test_activation_checkpoint test_attention test_mixed_precision test_memory_comm
          test_fused_adamw test_checkpoint_sharded test_checkpoint_async test_checkpoint_crash
          test_checkpoint_consolidated test_checkpoint_safetensors test_checkpoint_errors
          test_checkpoint_integrity test_safetensors)
. scripts/lib/python-env.sh
. scripts/lib/build.sh
fsdp_torch_setup
# Only these files are built (FSDP_TEST_FILES; test_examples for the torchrun case), in
# the binaries that hold them (tests/CMakeLists.txt, "Test binaries"), with the programs
# the tests run (test_programs and test_checkpoint depend on most).
fsdp_configure debian13 "$B" "-DFSDP_TEST_FILES=$(IFS=';'; echo "${FILES[*]}");test_examples"
cmake --build "$B" --target test_comm test_engine test_training test_checkpoint test_programs generate \
  fsdp-consolidate fsdp-inspect
fsdp_ctest "$B" --no-tests=error -L "^($(IFS='|'; echo "${FILES[*]}")|interop|build)\$" "$@"
# test_examples' one case: its binary with a filter (ctest's entry is the whole file).
out="$(OPENBLAS_NUM_THREADS=1 "$B/bin/test_programs" --gtest_filter=TrainGpt.TorchrunGivesTheSameLossesAsFsdpRun 2>&1)" ||
  { echo "$out"; exit 1; }
grep -q '^\[  PASSED  \] 1 test\.' <<<"$out" || { echo "$out"; echo "test-debian13: TrainGpt.TorchrunGivesTheSameLossesAsFsdpRun did not run" >&2; exit 1; }
echo "test-debian13: TrainGpt.TorchrunGivesTheSameLossesAsFsdpRun passed"
