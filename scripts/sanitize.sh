#!/usr/bin/env bash
# Builds with AddressSanitizer + UndefinedBehaviorSanitizer (GCC, -DFSDP_SANITIZE=ON)
# into build-sanitize/ and runs the test suite there: an invalid access, a leak or
# undefined behaviour in this project's code fails the test that ran it.
#
#   scripts/sanitize.sh                          # the whole suite
#   scripts/sanitize.sh --engine-and-checkpoint  # what CI runs: the engine's and the
#                                                # checkpoints' test binaries only
#   scripts/sanitize.sh -R Desync                # extra arguments go to ctest
#
# Not run here: the Consumer.* tests, which build separate projects against the
# installed package with their own (unsanitized) flags and so cannot link an
# instrumented libfsdp; scripts/test.sh runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
B="${FSDP_SANITIZE_BUILD_DIR:-build-sanitize}"
targets=()
labels=()
if [ "${1:-}" = "--engine-and-checkpoint" ]; then
  shift
  targets=(test_parity test_memory_comm test_desync test_fully_shard test_offload
           test_checkpoint_sharded test_checkpoint_async test_checkpoint_crash test_checkpoint_consolidated
           test_checkpoint_safetensors test_checkpoint_errors test_checkpoint_integrity test_safetensors
           test_reshard_plan)
  labels=(-L "^($(IFS='|'; echo "${targets[*]}"))\$")
fi
# -O1 with line tables: what the sanitizers' documentation advises (readable reports,
# modest slowdown), and faster to compile than -O2 with full debug information.
# The LibTorch and Python of scripts/test.sh (scripts/lib/python-env.sh).
. scripts/lib/python-env.sh
fsdp_torch_setup
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DFSDP_SANITIZE=ON "${TORCH_CMAKE_ARGS[@]}" >/dev/null
if [ ${#targets[@]} -gt 0 ]; then
  cmake --build "$B" -j2 --target "${targets[@]}"
else
  cmake --build "$B" -j2
fi
# Every child process (ranks, tools) inherits these through the environment.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
ctest --test-dir "$B" --output-on-failure -j2 -E '^Consumer\.' "${labels[@]}" "$@"
