#!/usr/bin/env bash
# ZeRO++ over shaped links (issue: ZeRO++ for slow links): the rows bench-links.sh lacked.
# Two network-namespace hosts joined by a veth link (tests/multihost/lib.sh; needs root),
# 2 ranks each, train_gpt at world 4 in bf16:
#   FULL_SHARD 4: bf16 communication; qwZ; qwZ + qgZ; qwZ + qgZ + hpZ (groups of 2 = a host,
#     so backward gathers and the first half of the reduction stay inside each host);
#   HYBRID 2 x 2 (sharded inside each host, replicated across): bf16; qwZ; qwZ + qgZ (the
#     cross-host all-reduce then quantized too);
# and the anchors on the same hosts and link, with their defaults in bf16: PyTorch FSDP2
# and DeepSpeed ZeRO-3 (tests/interop/fsdp_gpt.py; DeepSpeed's ZeRO++ needs CUDA, so its
# plain ZeRO-3 runs). Links: unshaped, 10 Gbit/s, 1 Gbit/s (tc's token bucket, or netem
# with 1 ms each way where the kernel has it) and 100 Mbit/s. Columns: the median step
# (all but the first 3), exposed communication per step from the trace (our rows:
# fsdp-trace summary's "wait" spans, the mean of the ranks), and the bytes across the link
# per step, both ways, from the veth's counters between the end of step 3 and the end of
# the last step (polled every 20 ms on the log; so setup is left out), and the bytes rank 0
# sent per step by its own count (CommStats' wire bytes).
#   sudo scripts/bench/bench-zeropp-links.sh [BIN_DIR]   (default build/bin)
# BENCH_ARGS overrides the model flags; BENCH_STEPS the steps per run (15); BENCH_LINKS the
# shapes (veth 10gbit 1gbit 100mbit); BENCH_ROWS=ours leaves the anchors out.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="$(cd "${1:-build/bin}" && pwd)"
PY="${FSDP_PYTHON:-}"
[ -n "$PY" ] || PY="$(command -v python3)"
[ -x .venv/bin/python ] && [ -z "${FSDP_PYTHON:-}" ] && PY=.venv/bin/python
STEPS="${BENCH_STEPS:-15}"
LINKS="${BENCH_LINKS:-veth 10gbit 1gbit 100mbit}"
read -ra MODEL <<<"${BENCH_ARGS:---n-layer 4 --d-model 256 --n-head 8 --block-size 64 --batch-size 16}"
. tests/multihost/lib.sh
mh_setup bench-zeropp 10.9.7
RESULTS="$OUT/results.txt"
: >"$RESULTS"

link_bytes() {  # bytes sent both ways over the link so far (host 1's end)
  local tx rx
  tx=$(ip netns exec "$H1" cat "/sys/class/net/$L1/statistics/tx_bytes")
  rx=$(ip netns exec "$H1" cat "/sys/class/net/$L1/statistics/rx_bytes")
  echo $((tx + rx))
}

# Waits until JSONL has N step lines (or rank 0 of run LABEL ended), then prints the
# link's bytes.
bytes_at_step() {  # JSONL N LABEL
  local n
  while :; do
    n=$(grep -c '"step_s"' "$1" 2>/dev/null) || n=0
    [ "${n:-0}" -ge "$2" ] && break
    [ -e "$OUT/$3.0.log.exit" ] && break
    sleep 0.02
  done
  link_bytes
}

ranks_ok() {
  local r rc
  for r in 0 1 2 3; do
    read -r rc _ _ <"$OUT/$1.$r.log.exit"
    [ "$rc" = 0 ] || { echo "bench-zeropp-links: $1 rank $r failed:" >&2; tail -5 "$OUT/$1.$r.log" >&2; return 1; }
  done
}

# LABEL KIND FLAGS...: runs 4 ranks (KIND ours or an --impl of fsdp_gpt.py) and prints
# "median_step_s link_bytes_per_step wait_ms_per_step sent_bytes_per_step".
run_row() {
  local label="$1" kind="$2" r h dev a b
  shift 2
  rm -rf "$OUT/$label.trace" "$OUT/$label.jsonl"
  for r in 0 1 2 3; do
    h="$H1" dev="$L1"
    [ "$r" -ge 2 ] && h="$H2" dev="$L2"
    if [ "$kind" = ours ]; then
      # shellcheck disable=SC2046
      mh_run "$h" "$OUT/$label.$r.log" env -u GLOO_SOCKET_IFNAME $(mh_rank_env "$r" 4) \
        MASTER_ADDR="$A1" MASTER_PORT=29695 FSDP_TIMEOUT_S=300 OMP_NUM_THREADS=1 \
        "$BIN/train_gpt" "${MODEL[@]}" --precision bf16 --steps "$STEPS" --log-every 0 \
        --log-jsonl "$OUT/$label.jsonl" --trace "$OUT/$label.trace" "$@"
    else
      # PyTorch's Gloo takes the address its hostname resolves to unless told the device.
      # shellcheck disable=SC2046
      mh_run "$h" "$OUT/$label.$r.log" env $(mh_rank_env "$r" 4) GLOO_SOCKET_IFNAME="$dev" \
        MASTER_ADDR="$A1" MASTER_PORT=29696 OMP_NUM_THREADS=1 timeout 900 \
        "$PY" tests/interop/fsdp_gpt.py --impl "$kind" "${MODEL[@]}" --precision bf16 \
        --steps "$STEPS" --init-from "$OUT/init.h5" --log-jsonl "$OUT/$label.jsonl"
    fi
  done
  a=$(bytes_at_step "$OUT/$label.jsonl" 3 "$label")
  b=$(bytes_at_step "$OUT/$label.jsonl" "$STEPS" "$label")
  mh_wait_all
  ranks_ok "$label" || { echo "- - - -"; return; }
  if [ "$kind" = ours ]; then
    "$BIN/fsdp-trace" merge "$OUT/$label.trace" >/dev/null
    "$BIN/fsdp-trace" summary "$OUT/$label.trace/trace.json" >"$OUT/$label.summary.txt"
  else
    : >"$OUT/$label.summary.txt"
  fi
  "$PY" - "$OUT/$label.jsonl" "$OUT/$label.summary.txt" "$((b - a))" "$STEPS" <<'PY'
import json, re, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_s"' in l]
steps = [r["step_s"] for r in rows]
text = open(sys.argv[2]).read()
n = int(sys.argv[4])
ms = [float(w) for w in re.findall(r"^  wait\s+([0-9.]+) ms", text, re.M)]
wait = f"{statistics.mean(ms) / n:.1f}" if ms else "-"
sent = [r["wire_bytes"] for r in rows if "wire_bytes" in r]
print(f"{statistics.median(steps[3:]):.4f} {int(sys.argv[3]) // (n - 3)} {wait} "
      f"{int(statistics.median(sent[3:])) if sent else '-'}")
PY
}

if [ "${BENCH_ROWS:-all}" != ours ]; then
  # shellcheck disable=SC2046
  "$PY" tests/interop/fsdp_gpt.py --write-init "$OUT/init.h5" $(printf '%s ' "${MODEL[@]}" | sed 's/--batch-size [0-9]*//')
fi
SLOW="tbf rate 1gbit burst 256kb latency 50ms"
SLOW_NAME="1 Gbit/s"
if ip netns exec "$H1" tc qdisc add dev "$L1" root netem delay 1ms 2>/dev/null; then
  SLOW="netem rate 1gbit delay 1ms"
  SLOW_NAME="1 Gbit/s, 1 ms"
fi
ip netns exec "$H1" tc qdisc del dev "$L1" root 2>/dev/null || true
ROWS=(
  "FULL_SHARD 4|bf16|ours|--sharding full"
  "FULL_SHARD 4|qwZ|ours|--sharding full --quantize-weights"
  "FULL_SHARD 4|qwZ + qgZ|ours|--sharding full --quantize-weights --quantize-gradients"
  "FULL_SHARD 4|qwZ + qgZ + hpZ 2|ours|--sharding full --quantize-weights --quantize-gradients --hpz-group-size 2"
  "HYBRID 2 x 2|bf16|ours|--sharding hybrid --hybrid-group-size 2"
  "HYBRID 2 x 2|qwZ|ours|--sharding hybrid --hybrid-group-size 2 --quantize-weights"
  "HYBRID 2 x 2|qwZ + qgZ|ours|--sharding hybrid --hybrid-group-size 2 --quantize-weights --quantize-gradients"
)
if [ "${BENCH_ROWS:-all}" != ours ]; then
  ROWS+=("PyTorch FSDP2 (fully_shard)|bf16, defaults|fsdp2|" "DeepSpeed ZeRO-3|bf16, defaults (no ZeRO++ on CPU)|deepspeed|")
fi
for link in $LINKS; do
  case "$link" in
    veth) name="veth (unshaped)" && mh_shape none ;;
    10gbit) name="10 Gbit/s" && mh_shape "tbf rate 10gbit burst 1mb latency 50ms" ;;
    1gbit) name="$SLOW_NAME" && mh_shape "$SLOW" ;;
    100mbit) name="100 Mbit/s" && mh_shape "tbf rate 100mbit burst 64kb latency 200ms" ;;
    *) echo "bench-zeropp-links: unknown link '$link' (veth, 10gbit, 1gbit, 100mbit)" >&2 && exit 2 ;;
  esac
  for row in "${ROWS[@]}"; do
    IFS='|' read -r layout comm kind flags <<<"$row"
    label="$(echo "$link-$layout-$comm" | tr -c 'a-zA-Z0-9\n' _)"
    # shellcheck disable=SC2086
    read -r step bytes waited sent <<<"$(run_row "$label" "$kind" $flags)"
    echo "$name / $layout / $comm: step ${step} s, ${bytes} B across the link per step, waited ${waited} ms, sent ${sent} B per step (rank 0)" >&2
    echo "$name|$layout|$comm|$step|$bytes|$waited|$sent" >>"$RESULTS"
  done
done
mh_shape none
mkdir -p build/bench && cp "$RESULTS" build/bench/zeropp-links-results.txt

"$PY" - "$RESULTS" "${MODEL[*]}" "$STEPS" <<'PY'
import sys
rows = [l.rstrip("\n").split("|") for l in open(sys.argv[1]) if l.strip()]
print(f"train_gpt {sys.argv[2]} --precision bf16, 4 ranks on 2 namespace hosts (2 each); median "
      f"step of {sys.argv[3]} (first 3 dropped); exposed communication: the trace's wait spans per "
      f"step, mean of the ranks; across the link: the veth's bytes both ways from step 3 to the "
      f"end, per step; sent: rank 0's CommStats wire bytes per step.\n")
print("| link | layout | communication | step (ms) | exposed comm (ms) | across the link per step (MB) | sent by rank 0 per step (MB) | step / bf16's | exposed / bf16's | across / bf16's |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
base = {}
for link, layout, comm, step, b, wait, sent in rows:
    key = (link, layout)
    if comm == "bf16":
        base[key] = (step, wait, b)
    ref = base.get(key)
    def ratio(v, r):
        try:
            return f"{float(v) / float(r):.2f}"
        except (ValueError, ZeroDivisionError, TypeError):
            return "-"
    ms = lambda v: f"{float(v) * 1000:.0f}" if v != "-" else "-"
    mb = lambda v: f"{float(v) / 1e6:.1f}" if v not in ("-", "") else "-"
    print(f"| {link} | {layout} | {comm} | {ms(step)} | {wait} | {mb(b)} | {mb(sent)} | "
          f"{ratio(step, ref[0]) if ref else '-'} | {ratio(wait, ref[1]) if ref else '-'} | "
          f"{ratio(b, ref[2]) if ref else '-'} |")
PY
