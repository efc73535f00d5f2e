#!/usr/bin/env bash
# train_gpt against PyTorch FSDP1 on the same LibTorch: the same weights, batches and
# schedule (tests/interop/fsdp_gpt.py), losses checked to agree, then median step time and
# the largest rank's peak RSS compared. Runs where python3-torch's FSDP imports, i.e. in
# the Debian 13 root (LibTorch 2.6 for both sides):
#
#   scripts/in-debian13.sh ./scripts/compare-pytorch.sh           # full run, ~15-20 min on 2 cores
#   scripts/in-debian13.sh ./scripts/compare-pytorch.sh --quick   # smaller model, one repetition, ~3 min
#   ./scripts/compare-pytorch.sh --plot-only build-debian13/bench/vs_pytorch/vs_pytorch.json [OUTDIR]
#
# Two sizes (small: 4 layers, d_model 128, block 64; large: 4 layers, d_model 512, block
# 128), worlds 1, 2 and 4, fp32 and bf16; one thread per rank (OMP_NUM_THREADS=1, the
# same for both; world 4 oversubscribes 2 cores; why not 2 at world 1: THREADS in
# tests/interop/compare_fsdp.py). Each pair
# runs alternately (PyTorch, this library, PyTorch, this library; 2 repetitions), warm-up
# steps left out. Appends vs_pytorch_step_time_{size}_w{world}_{precision} and
# vs_pytorch_peak_rss_... (ratios, this library / PyTorch, with the raw figures) to
# $BUILD/bench/results.jsonl, prints a table, and draws PNGs (loss curves, step-time and
# RSS bars) into $BUILD/bench/vs_pytorch/ when python3-matplotlib is installed.
# Then checkpoints (--parts ckpt; --ckpt-worlds 1,2,4): an 8-layer d_model 1024 GPT
# (~101 M parameters, 1.2 GB with AdamW state) after one step, saved sharded against DCP's
# FileSystemWriter, loaded cold (files evicted from the page cache) against DCP's
# FileSystemReader, exported whole against FULL_STATE_DICT + torch.save, each beside the
# disk's raw write + fsync and cold read of the same bytes: vs_dcp_save, vs_dcp_load,
# vs_fsdp_full_state_export (speed-ups, PyTorch seconds / this library's).
# Further flags go to tests/interop/compare_fsdp.py bench (--reps N, --worlds 1,2,
# --precisions fp32, --parts train|ckpt).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --plot-only ]; then
  [ $# -ge 2 ] || { echo "compare-pytorch: --plot-only needs the vs_pytorch.json of a run" >&2; exit 2; }
  exec /usr/bin/python3 tests/interop/compare_fsdp.py plot "$2" "${3:-$(dirname "$2")}"
fi
B="${FSDP_BUILD_DIR:-build}"   # build-debian13 inside scripts/in-debian13.sh
. scripts/lib/python-env.sh
. scripts/lib/build.sh
fsdp_torch_setup
fsdp_configure "$([ -n "${FSDP_IN_DEBIAN13:-}" ] && echo debian13 || echo release)" "$B" >/dev/null
fsdp_build "$B" --target train_gpt fsdp-run
mkdir -p "$B/bench"
echo "== train_gpt vs PyTorch FSDP1 ($(/usr/bin/python3 -c 'import torch; print("torch", torch.__version__)' 2>/dev/null || echo 'no python3-torch'))"
exec /usr/bin/python3 tests/interop/compare_fsdp.py bench --bin-dir "$B/bin" --out "$B/bench/vs_pytorch" \
  --results "$B/bench/results.jsonl" "$@"
