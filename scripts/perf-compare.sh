#!/usr/bin/env bash
# perf profiles of one configuration of scripts/compare-pytorch.sh, both sides: the large
# GPT (4 layers, d_model 512) at world W and precision P, trained 13 steps by train_gpt and
# by tests/interop/fsdp_gpt.py (PyTorch FSDP1) in the Debian 13 root, each under
# `perf record -F 499 -e cpu-clock` run from this (Debian 12) host.
#
#   scripts/perf-compare.sh [W] [P]     # default: 1 fp32; needs build-debian13 (compare-pytorch.sh builds it)
#
# Writes build-debian13/prof/{cpp,py}_w{W}_{P}.data and prints samples by shared object.
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-1}
P=${2:-fp32}
ROOT=/var/cache/fsdp-libtorch/debian13-cpu
OUT=build-debian13/prof
SIZE="--n-layer 4 --n-head 8 --d-model 512 --block-size 128 --batch-size 8 --steps 13 --seed 1337 --warmup-steps 3 --lr 5e-4"
command -v perf >/dev/null || { echo "perf-compare: perf is missing (apt-get install linux-perf)" >&2; exit 2; }
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
