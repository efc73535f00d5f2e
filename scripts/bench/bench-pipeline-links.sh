#!/usr/bin/env bash
# Pipeline stages against sharding over a slow link between two hosts (issue: pipeline
# parallelism). Two network-namespace hosts joined by a veth link (tests/multihost/lib.sh;
# needs root), 2 ranks each, train_gpt at world 4 in three layouts:
#   FULL_SHARD 4       --sharding full: every all-gather and reduce-scatter crosses the link;
#   HYBRID 2 x 2       --sharding hybrid --hybrid-group-size 2: sharded inside each host,
#                      the gradients all-reduced across;
#   PP 2 x FULL_SHARD 2  --pipeline-stages 2: stage 0 on host 1, stage 1 on host 2 (rank r
#                      in stage r / 2), each sharded inside its host; only the activations
#                      and their gradients cross, point to point;
#   PP 2 x SHARD_GRAD_OP 2  the same with --sharding grad_op (each stage kept gathered
#                      from forward to backward, as torchtitan's FSDP2 under PP).
# each unshaped and at 1 Gbit/s (tc's token bucket, or netem with 1 ms each way where the
# kernel has it). Per row: the median step (all but the first 3), the bytes across the link
# per step (the veth's counters over the run, setup included, over the steps), and from the
# trace (--trace, fsdp-trace summary), per step and the mean of the ranks, what each rank's
# compute track spent in "wait" spans: exposed communication (collective waits, and a
# pipeline receive's time after the sender posted the message), and in "bubble" spans: a
# pipeline receive's time before the sender posted, waiting on the neighbour's compute
# (Note [Pipeline schedules]). The schedule's bubble, (S - 1) / (M + S - 1), is printed
# beside.
# PyTorch's torch.distributed.pipelining with FSDP2 (tests/bench/torch_pipeline_fsdp.py)
# runs the same layout on the same hosts: its step and bytes (no trace).
#   sudo scripts/bench/bench-pipeline-links.sh [BIN_DIR]   (default build/bin)
# BENCH_ARGS overrides the model flags; BENCH_STEPS the steps per run; BENCH_LINKS the
# shapes ("veth" and/or "1gbit").
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="$(cd "${1:-build/bin}" && pwd)"
PY="${FSDP_PYTHON:-}"
[ -n "$PY" ] || PY="$(command -v python3)"
[ -x .venv/bin/python ] && [ -z "${FSDP_PYTHON:-}" ] && PY=.venv/bin/python
STEPS="${BENCH_STEPS:-15}"
LINKS="${BENCH_LINKS:-veth 1gbit}"
read -ra MODEL <<<"${BENCH_ARGS:---n-layer 4 --d-model 256 --n-head 8 --block-size 64 --batch-size 16}"
MICRO=4
. tests/multihost/lib.sh
mh_setup bench-pp 10.9.8
RESULTS="$OUT/results.txt"
: >"$RESULTS"

link_bytes() {  # bytes sent both ways over the link so far (host 1's end)
  local tx rx
  tx=$(ip netns exec "$H1" cat "/sys/class/net/$L1/statistics/tx_bytes")
  rx=$(ip netns exec "$H1" cat "/sys/class/net/$L1/statistics/rx_bytes")
  echo $((tx + rx))
}

ranks_ok() {  # LABEL: whether the 4 ranks of run LABEL exited 0; else says which did not
  local r rc
  for r in 0 1 2 3; do
    read -r rc _ _ <"$OUT/$1.$r.log.exit"
    [ "$rc" = 0 ] || { echo "bench-pipeline-links: $1 rank $r failed:" >&2; tail -5 "$OUT/$1.$r.log" >&2; return 1; }
  done
}

run_layout() {  # LABEL FLAGS...: prints "median_step_s bytes_per_step wait_ms bubble_ms" (per step)
  local label="$1" r h before after
  shift
  rm -rf "$OUT/$label.trace"
  before=$(link_bytes)
  for r in 0 1 2 3; do
    h="$H1"
    [ "$r" -ge 2 ] && h="$H2"
    # shellcheck disable=SC2046
    mh_run "$h" "$OUT/$label.$r.log" env -u GLOO_SOCKET_IFNAME $(mh_rank_env "$r" 4) \
      MASTER_ADDR="$A1" MASTER_PORT=29693 FSDP_TIMEOUT_S=120 OMP_NUM_THREADS=1 \
      "$BIN/train_gpt" "${MODEL[@]}" --steps "$STEPS" --log-every 0 \
      --log-jsonl "$OUT/$label.jsonl" --trace "$OUT/$label.trace" "$@"
  done
  mh_wait_all
  after=$(link_bytes)
  ranks_ok "$label" || exit 1
  "$BIN/fsdp-trace" merge "$OUT/$label.trace" >/dev/null
  "$BIN/fsdp-trace" summary "$OUT/$label.trace/trace.json" >"$OUT/$label.summary.txt"
  "$PY" - "$OUT/$label.jsonl" "$OUT/$label.summary.txt" "$((after - before))" "$STEPS" <<'PY'
import json, re, statistics, sys
steps = [json.loads(l)["step_s"] for l in open(sys.argv[1]) if '"step_s"' in l]
text = open(sys.argv[2]).read()
n = int(sys.argv[4])
def per_step(cat):  # the mean over the ranks of the category's time, per step
    ms = [float(w) for w in re.findall(r"^  " + cat + r"\s+([0-9.]+) ms", text, re.M)]
    return statistics.mean(ms) / n if ms else 0.0
print(f"{statistics.median(steps[3:]):.4f} {int(sys.argv[3]) // n} "
      f"{per_step('wait'):.1f} {per_step('bubble'):.1f}")
PY
}

run_torch() {  # LABEL [FLAGS]: PyTorch's pipelining + FSDP2, the layout of PP 2 x FULL_SHARD 2
  local label="$1" r h dev before after
  shift
  before=$(link_bytes)
  for r in 0 1 2 3; do
    h="$H1" dev="$L1"
    [ "$r" -ge 2 ] && h="$H2" dev="$L2"
    # PyTorch's Gloo takes the address its hostname resolves to (loopback in a namespace)
    # unless told the device.
    # shellcheck disable=SC2046
    mh_run "$h" "$OUT/$label.$r.log" env $(mh_rank_env "$r" 4) GLOO_SOCKET_IFNAME="$dev" \
      MASTER_ADDR="$A1" MASTER_PORT=29694 OMP_NUM_THREADS=1 timeout 300 \
      "$PY" tests/bench/torch_pipeline_fsdp.py --stages 2 "${MODEL[@]}" --steps "$STEPS" \
      --micro-batches "$MICRO" --log-jsonl "$OUT/$label.jsonl" "$@"
  done
  mh_wait_all
  after=$(link_bytes)
  ranks_ok "$label" || { echo "- - - -" && return; }
  "$PY" - "$OUT/$label.jsonl" "$((after - before))" "$STEPS" <<'PY'
import json, statistics, sys
steps = [json.loads(l)["step_s"] for l in open(sys.argv[1]) if '"step_s"' in l]
print(f"{statistics.median(steps[3:]):.4f} {int(sys.argv[2]) // int(sys.argv[3])} - -")
PY
}

SLOW="tbf rate 1gbit burst 256kb latency 50ms"
SLOW_NAME="1 Gbit/s"
if ip netns exec "$H1" tc qdisc add dev "$L1" root netem delay 1ms 2>/dev/null; then
  SLOW="netem rate 1gbit delay 1ms"
  SLOW_NAME="1 Gbit/s, 1 ms"
fi
ip netns exec "$H1" tc qdisc del dev "$L1" root 2>/dev/null || true
for link in $LINKS; do
  case "$link" in
    veth) name="veth (unshaped)" && mh_shape none ;;
    1gbit) name="$SLOW_NAME" && mh_shape "$SLOW" ;;
    *) echo "bench-pipeline-links: unknown link '$link' (veth, 1gbit)" >&2 && exit 2 ;;
  esac
  for layout in "FULL_SHARD 4|--sharding full" \
    "HYBRID 2 x 2|--sharding hybrid --hybrid-group-size 2" \
    "PP 2 x FULL_SHARD 2 (1F1B, $MICRO micro-batches)|--sharding full --pipeline-stages 2 --micro-batches $MICRO" \
    "PP 2 x SHARD_GRAD_OP 2 (1F1B, $MICRO micro-batches)|--sharding grad_op --pipeline-stages 2 --micro-batches $MICRO"; do
    label="${layout%%|*}"
    # shellcheck disable=SC2086
    read -r step bytes waited bubble <<<"$(run_layout "$(echo "$link-$label" | tr -c 'a-zA-Z0-9\n' _)" ${layout#*|})"
    echo "$name / $label: step ${step} s, ${bytes} B across the link per step, waited ${waited} ms, bubble ${bubble} ms per step" >&2
    echo "$name|$label|$step|$bytes|$waited|$bubble" >>"$RESULTS"
  done
  for t in "FSDP2 defaults|" "reshard_after_forward=False, torchtitan's with PP|--no-reshard-after-forward"; do
    label="PyTorch pipelining + FSDP2, PP 2 x 2 (1F1B, $MICRO micro-batches; ${t%%|*})"
    # shellcheck disable=SC2086
    read -r step bytes waited bubble <<<"$(run_torch "$link-torch${t#*|}" ${t#*|})"
    echo "$name / $label: step ${step} s, ${bytes} B across the link per step" >&2
    echo "$name|$label|$step|$bytes|$waited|$bubble" >>"$RESULTS"
  done
done
mh_shape none

"$PY" - "$RESULTS" "${MODEL[*]}" "$STEPS" "$MICRO" <<'PY'
import sys
rows = [l.strip().split("|") for l in open(sys.argv[1]) if l.strip()]
model, steps, micro = sys.argv[2], sys.argv[3], int(sys.argv[4])
print(f"train_gpt {model}, 4 ranks on 2 namespace hosts (2 each); median step of {steps} "
      f"(first 3 dropped); exposed communication and bubble: the compute track's wait and bubble spans per step, mean of the ranks "
      f"(fsdp-trace summary). The pipeline's schedule bubble at 2 stages and {micro} "
      f"micro-batches: 1/{micro + 1} = {1 / (micro + 1):.0%} of a step.\n")
print("| link | layout | step (ms) | across the link per step (MB) | exposed communication per step (ms) | exposed / FULL_SHARD's | bubble per step (ms) | bubble / step |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
base = {}
for link, layout, step, b, w, bub in rows:
    if layout.startswith("FULL_SHARD") and w != "-":
        base[link] = float(w)
for link, layout, step, b, w, bub in rows:
    if step == "-":
        print(f"| {link} | {layout} | failed (see the log above) | | | | | |")
        continue
    if w == "-":
        print(f"| {link} | {layout} | {float(step) * 1000:.0f} | {int(b) / 1e6:.1f} | - (no trace) | - | - | - |")
        continue
    ratio = f"{float(w) / base[link]:.2f}" if base.get(link) else "-"
    share = f"{float(bub) / (float(step) * 1000):.2f}"
    print(f"| {link} | {layout} | {float(step) * 1000:.0f} | {int(b) / 1e6:.1f} | {float(w):.0f} | {ratio} | {float(bub):.0f} | {share} |")
PY
