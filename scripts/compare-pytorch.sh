#!/usr/bin/env bash
# train_gpt against PyTorch FSDP1 on the same LibTorch: the same weights, batches and
# schedule (tests/interop/fsdp_gpt.py), losses checked to agree, then median step time and
# the largest rank's peak RSS compared. Runs where python3-torch's FSDP imports, i.e. in
# the Debian 13 root (LibTorch 2.6 for both sides):
#
#   scripts/in-debian13.sh ./scripts/compare-pytorch.sh           # full run, ~15-20 min on 2 cores
#   scripts/in-debian13.sh ./scripts/compare-pytorch.sh --quick   # smaller model, one repetition, ~3 min
#   ./scripts/compare-pytorch.sh --plot-only build-debian13/bench/vs_pytorch/vs_pytorch.json [OUTDIR]
#   ./scripts/compare-pytorch.sh --perf [W] [P]   # perf profiles of one row, both sides (below)
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
# --perf [W] [P] (default 1 fp32), from this (Debian 12) host: perf profiles of the large
# GPT at world W and precision P, trained 13 steps by train_gpt and by
# tests/interop/fsdp_gpt.py (PyTorch FSDP1) in the Debian 13 root, each under
# `perf record -F 499 -e cpu-clock`. Needs build-debian13 (a full run builds it). Writes
# build-debian13/prof/{cpp,py}_w{W}_{P}.data and prints samples by shared object.
if [ "${1:-}" = --perf ]; then
  W=${2:-1}
  P=${3:-fp32}
  ROOT=/var/cache/fsdp-libtorch/debian13-cpu
  OUT=build-debian13/prof
  SIZE="--n-layer 4 --n-head 8 --d-model 512 --block-size 128 --batch-size 8 --steps 13 --seed 1337 --warmup-steps 3 --lr 5e-4"
  command -v perf >/dev/null || { echo "compare-pytorch: perf is missing (apt-get install linux-perf)" >&2; exit 2; }
  mkdir -p "$OUT"
  scripts/in-debian13.sh bash -c "test -f $OUT/init.h5 || /usr/bin/python3 tests/interop/fsdp_gpt.py --write-init $OUT/init.h5 $SIZE"
  for impl in cpp py; do
    if [ $impl = cpp ]; then PROG="build-debian13/bin/train_gpt $SIZE --log-every 13"; else PROG="/usr/bin/python3 tests/interop/fsdp_gpt.py $SIZE"; fi
    perf record -q -F 499 -e cpu-clock -o "$OUT/${impl}_w${W}_${P}.data" -- scripts/in-debian13.sh bash -c \
      "OMP_NUM_THREADS=1 USE_LIBUV=0 build-debian13/bin/fsdp-run --nproc $W -- $PROG --precision $P --init-from $OUT/init.h5 --log-jsonl $OUT/${impl}_w${W}_${P}.jsonl" \
      > "$OUT/${impl}_w${W}_${P}.out" 2>&1
    echo "== $impl, world $W, $P: samples by shared object"
    perf report -i "$OUT/${impl}_w${W}_${P}.data" --symfs="$ROOT" --sort dso -n --stdio 2>/dev/null | grep -v '^#' | grep . | head -8
  done
  exit 0
fi
if [ "${1:-}" = --plot-only ]; then
  [ $# -ge 2 ] || { echo "compare-pytorch: --plot-only needs the vs_pytorch.json of a run" >&2; exit 2; }
  exec /usr/bin/python3 tests/interop/compare_fsdp.py plot "$2" "${3:-$(dirname "$2")}"
fi
B="${FSDP_BUILD_DIR:-build}"   # build-debian13 inside scripts/in-debian13.sh
. scripts/lib/python-env.sh
. scripts/lib/build.sh
fsdp_torch_setup
fsdp_configure "$([ -n "${FSDP_IN_DEBIAN13:-}" ] && echo debian13 || echo release)" "$B" >/dev/null
cmake --build "$B" --target train_gpt fsdp-run
mkdir -p "$B/bench"
echo "== train_gpt vs PyTorch FSDP1 ($(/usr/bin/python3 -c 'import torch; print("torch", torch.__version__)' 2>/dev/null || echo 'no python3-torch'))"
exec /usr/bin/python3 tests/interop/compare_fsdp.py bench --bin-dir "$B/bin" --out "$B/bench/vs_pytorch" \
  --results "$B/bench/results.jsonl" "$@"
