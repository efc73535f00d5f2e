#!/usr/bin/env bash
# Builds with AddressSanitizer + UndefinedBehaviorSanitizer (GCC, -DFSDP_SANITIZE=ON)
# into build-sanitize/ and runs the test suite there: an invalid access, a leak or
# undefined behaviour in this project's code fails the test that ran it.
#
#   scripts/ci/sanitize.sh                          # the whole suite
#   scripts/ci/sanitize.sh --engine-and-checkpoint  # what CI runs: the engine's, the
#                                                # checkpoints', the pipeline's and the
#                                                # quantization's test binaries only
#   scripts/ci/sanitize.sh -R desync                # extra arguments go to ctest (a test
#                                                # file is an entry: test_desync)
#
# Not run here: the Consumer.* tests, which build separate projects against the
# installed package with their own (unsanitized) flags and so cannot link an
# instrumented libfsdp; scripts/test.sh runs them.
set -euo pipefail
cd "$(dirname "$0")/../.."
B="${FSDP_SANITIZE_BUILD_DIR:-build-sanitize}"
targets=()
labels=()
files=()
if [ "${1:-}" = "--engine-and-checkpoint" ]; then
  shift
  # The test files (each is its cases' label) and the binaries that hold them
  # (tests/CMakeLists.txt, "Test binaries").
  files=(test_parity test_memory_comm test_desync test_fully_shard test_construction
         test_fsdp2_options test_offload test_nvme_params test_trace test_process_group
         test_checkpoint_sharded test_checkpoint_async test_checkpoint_crash test_checkpoint_consolidated
         test_checkpoint_safetensors test_checkpoint_errors test_checkpoint_integrity test_checkpoint_direct test_safetensors
         test_reshard_plan test_pipeline test_checkpoint_pipeline test_quantize test_wire_bytes
         test_zero_plus_plus)
  targets=(test_engine test_comm test_checkpoint)
  labels=(-L "^($(IFS='|'; echo "${files[*]}"))\$")
fi
# The preset "sanitize" (CMakePresets.json: -O1 with line tables), with the LibTorch and
# Python of scripts/test.sh (scripts/lib/python-env.sh).
. scripts/lib/python-env.sh
. scripts/lib/build.sh
fsdp_torch_setup
# Only the files run here are built (FSDP_TEST_FILES; empty: the whole suite).
fsdp_configure sanitize "$B" "-DFSDP_TEST_FILES=$(IFS=';'; echo "${files[*]}")" >/dev/null
if [ ${#targets[@]} -gt 0 ]; then
  cmake --build "$B" --target "${targets[@]}"
else
  cmake --build "$B"
fi
# Every child process (ranks, tools) inherits these through the environment.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
fsdp_ctest "$B" -E '^Consumer\.' "${labels[@]}" "$@"
