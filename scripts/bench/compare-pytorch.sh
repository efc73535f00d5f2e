#!/usr/bin/env bash
# train_gpt against its anchors, PyTorch FSDP2, PyTorch FSDP1 and DeepSpeed ZeRO-3, on the
# same weights, batches and schedule (tests/interop/fsdp_gpt.py --impl): losses checked to
# agree, then median step time, the largest rank's peak RSS and bytes communicated per
# rank per step, each against the best anchor. Runs on the host with the project's .venv
# (PyPI torch, deepspeed from scripts/requirements.txt) and build/bin:
#
#   ./scripts/bench/compare-pytorch.sh                    # full run (2 repetitions), ~1 h on 2 cores
#   ./scripts/bench/compare-pytorch.sh --quick            # smaller model, one repetition, ~15 min
#   ./scripts/bench/compare-pytorch.sh --quick --link 1gbit   # world 4 = 2 hosts x 2 ranks over a shaped link
#   ./scripts/bench/compare-pytorch.sh --bin-dir DIR ...  # those binaries, no build (Python: $FSDP_PY or .venv;
#                                                   # results still in build/bench)
#   scripts/ci/in-debian13.sh ./scripts/bench/compare-pytorch.sh   # Debian 13's torch 2.6: FSDP1 alone
#   ./scripts/bench/compare-pytorch.sh --plot-only build/bench/vs_pytorch/vs_anchors.json [OUTDIR]
#   ./scripts/bench/compare-pytorch.sh --perf [W] [P]   # perf profiles of one row, FSDP1 (below)
#
# Two sizes (small: 4 layers, d_model 128, block 64; large: 4 layers, d_model 512, block
# 128), worlds 1, 2 and 4, fp32 and bf16; one thread per rank (OMP_NUM_THREADS=1, the
# same for all; world 4 oversubscribes 2 cores; why not 2 at world 1: THREADS in
# tests/interop/compare_fsdp.py). Per configuration the anchors run, then this library
# (reversed on the next repetition), warm-up steps left out. Targets for this library,
# against the best anchor of each column: step time <= 0.9x the fastest, peak RSS <= 0.8x
# the smallest, bytes <= the fewest. Appends vs_anchors_{step_time,peak_rss,comm_bytes}_
# {size}_w{world}_{precision}[_{link}] (ratios, with every implementation's figures) and
# FSDP1's vs_pytorch_* series to $BUILD/bench/results.jsonl, prints a Markdown table and
# draws PNGs into $BUILD/bench/vs_pytorch/. Then (loopback only) checkpoints (--parts ckpt;
# --ckpt-worlds 1,2,4): an 8-layer d_model 1024 GPT (~101 M parameters, 1.2 GB with AdamW
# state) after one step, saved sharded against DCP's FileSystemWriter, loaded cold against
# DCP's FileSystemReader, exported whole against FULL_STATE_DICT + torch.save:
# vs_dcp_save, vs_dcp_load, vs_fsdp_full_state_export.
#
# --link SHAPE (needs root, iproute2 and tc): two network-namespace hosts joined by a veth
# link (tests/multihost/lib.sh, as scripts/bench/bench-links.sh), world 4 = 2 hosts x 2 ranks,
# every collective crossing the link. SHAPE: veth (unshaped), 10gbit, 1gbit (tc tbf on both
# ends), or a root qdisc of your own ("tbf rate 100mbit burst 64kb latency 50ms").
# Further flags go to tests/interop/compare_fsdp.py bench (--reps N, --worlds 1,2,
# --precisions fp32, --sizes small, --impls cpp,fsdp2,fsdp1,deepspeed, --parts train|ckpt,
# --lock FILE: hold flock(FILE) over each configuration's runs on a shared machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
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
  scripts/ci/in-debian13.sh bash -c "test -f $OUT/init.h5 || /usr/bin/python3 tests/interop/fsdp_gpt.py --write-init $OUT/init.h5 $SIZE"
  for impl in cpp py; do
    if [ $impl = cpp ]; then PROG="build-debian13/bin/train_gpt $SIZE --log-every 13"; else PROG="/usr/bin/python3 tests/interop/fsdp_gpt.py $SIZE"; fi
    perf record -q -F 499 -e cpu-clock -o "$OUT/${impl}_w${W}_${P}.data" -- scripts/ci/in-debian13.sh bash -c \
      "OMP_NUM_THREADS=1 USE_LIBUV=0 build-debian13/bin/fsdp-run --nproc $W -- $PROG --precision $P --init-from $OUT/init.h5 --log-jsonl $OUT/${impl}_w${W}_${P}.jsonl" \
      > "$OUT/${impl}_w${W}_${P}.out" 2>&1
    echo "== $impl, world $W, $P: samples by shared object"
    perf report -i "$OUT/${impl}_w${W}_${P}.data" --symfs="$ROOT" --sort dso -n --stdio 2>/dev/null | grep -v '^#' | grep . | head -8
  done
  exit 0
fi
if [ "${1:-}" = --plot-only ]; then
  [ $# -ge 2 ] || { echo "compare-pytorch: --plot-only needs the vs_anchors.json of a run" >&2; exit 2; }
  PY="${FSDP_PY:-${FSDP_VENV:-$PWD/.venv}/bin/python}"
  [ -x "$PY" ] || PY=/usr/bin/python3
  exec "$PY" tests/interop/compare_fsdp.py plot "$2" "${3:-$(dirname "$2")}"
fi
BIN=""
LINK=""
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bin-dir) BIN="${2:?--bin-dir needs a folder with train_gpt and fsdp-run}"; shift 2 ;;
    --link) LINK="${2:?--link needs a shape: veth, 10gbit, 1gbit or a root qdisc}"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [ -n "$BIN" ]; then  # those binaries as they are; the Python that has the anchors
  PY="${FSDP_PY:-}"
  [ -n "$PY" ] || PY="${FSDP_VENV:-$PWD/.venv}/bin/python"
  [ -x "$PY" ] || PY=/usr/bin/python3
fi
B="${FSDP_BUILD_DIR:-build}"   # build-debian13 inside scripts/ci/in-debian13.sh; results in $B/bench
if [ -z "$BIN" ]; then
  . scripts/lib/python-env.sh
  . scripts/lib/build.sh
  fsdp_torch_setup
  fsdp_configure "$([ -n "${FSDP_IN_DEBIAN13:-}" ] && echo debian13 || echo release)" "$B" >/dev/null
  cmake --build "$B" --target train_gpt fsdp-run
  BIN="$B/bin"
  PY="$FSDP_PY"
fi
mkdir -p "$B/bench"
IMPLS=()
if [ -n "${FSDP_IN_DEBIAN13:-}" ]; then
  IMPLS=(--impls "cpp,fsdp1")  # torch 2.6: FSDP2 does not run on the CPU, no deepspeed
fi
BENCH=("$PY" tests/interop/compare_fsdp.py bench --bin-dir "$BIN" --out "$B/bench/vs_pytorch"
       --results "$B/bench/results.jsonl" "${IMPLS[@]}")
echo "== train_gpt vs its anchors ($("$PY" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null || echo "no torch in $PY"))"
[ -n "$LINK" ] || exec "${BENCH[@]}" "${ARGS[@]}"

case "$LINK" in
  veth) QDISC=none ;;
  10gbit) QDISC="tbf rate 10gbit burst 1mb latency 50ms" ;;
  1gbit) QDISC="tbf rate 1gbit burst 256kb latency 50ms" ;;
  *) QDISC="$LINK" ;;
esac
BIN="$(cd "$BIN" && pwd)"
. tests/multihost/lib.sh
mh_setup compare-pytorch 10.9.12
if [ "$QDISC" != none ]; then
  for h in 1 2; do
    if [ "$h" = 1 ]; then dev="$L1" ns="$H1"; else dev="$L2" ns="$H2"; fi
    # shellcheck disable=SC2086
    ip netns exec "$ns" tc qdisc add dev "$dev" root $QDISC ||
      { echo "compare-pytorch: tc qdisc add dev $dev root $QDISC failed (--link $LINK)" >&2; exit 2; }
  done
fi
NAME="$(echo "$LINK" | tr -c 'A-Za-z0-9\n' _)"
rc=0
"${BENCH[@]}" --parts train --hosts "$H1:$L1:$A1,$H2:$L2:$A2" --link "$NAME" "${ARGS[@]}" || rc=$?
exit "$rc"
