#!/usr/bin/env bash
# This library's checkpoints against PyTorch DCP's (FSDP2 on a CPU mesh) and DeepSpeed
# ZeRO-3's, on the same GPT (tests/interop/compare_ckpt.py; its doc says what each part
# times), each beside the disk's own write + fsync and cold read of the same bytes. Runs on
# the host with the project's Python (.venv: PyPI torch, deepspeed) and build/bin:
#
#   ./scripts/bench/compare-checkpoints.sh                       # 8 layers, d_model 1024 (~101 M parameters,
#                                                          # 1.2 GB with AdamW), worlds 1, 2, 4, 2 repetitions
#   ./scripts/bench/compare-checkpoints.sh --quick               # 2 layers, d_model 512, one repetition
#   ./scripts/bench/compare-checkpoints.sh --parts save --worlds 1,2     # a part at a time (save first:
#                                                          # load, export and deepspeed use its checkpoints)
#   ./scripts/bench/compare-checkpoints.sh --table               # the table of the results so far
#
# Builds train_gpt, fsdp-run and fsdp-consolidate in $FSDP_BUILD_DIR (default build)
# unless FSDP_BIN_DIR names binaries to use as they are. Results merge into
# $B/bench/ckpt/results.json (rows by part and world); the table is printed at the end.
# Further flags go to tests/interop/compare_ckpt.py bench (--reps N, --work DIR).
set -euo pipefail
cd "$(dirname "$0")/../.."
B="${FSDP_BUILD_DIR:-build}"
. scripts/lib/python-env.sh
if [ "${1:-}" = --table ]; then
  exec "${FSDP_VENV}/bin/python" tests/interop/compare_ckpt.py table "$B/bench/ckpt/results.json"
fi
if [ -n "${FSDP_BIN_DIR:-}" ]; then
  BIN="$FSDP_BIN_DIR"
  FSDP_PY="$FSDP_VENV/bin/python"
else
  . scripts/lib/build.sh
  fsdp_torch_setup
  fsdp_configure release "$B" >/dev/null
  cmake --build "$B" --target train_gpt fsdp-run fsdp-consolidate
  BIN="$B/bin"
fi
"$FSDP_PY" -c 'import deepspeed' >/dev/null 2>&1 ||
  echo "compare-checkpoints: deepspeed does not import in $FSDP_PY: the deepspeed part will fail (pip install deepspeed with DS_BUILD_OPS=0)" >&2
mkdir -p "$B/bench/ckpt"
exec env DS_ACCELERATOR=cpu "$FSDP_PY" tests/interop/compare_ckpt.py bench --bin-dir "$BIN" \
  --work "$B/bench/ckpt" --results "$B/bench/ckpt/results.json" "$@"
