#!/usr/bin/env bash
# How much of a step is communication across a shaped link between two hosts, and how
# much of it prefetching hides. Two network-namespace hosts joined by a veth link
# (tests/multihost/lib.sh; needs root), 2 ranks each, train_gpt --sharding full (every
# all-gather and reduce-scatter crosses the link). For each link shape (unshaped veth;
# 10 Gbit/s; 1 Gbit/s, with tc's token bucket, tbf, on both ends; netem's delay is used
# for "1gbit + 1 ms" where the kernel has sch_netem), train_gpt runs with prefetch on and
# off (--no-prefetch). Compute-only: the same 4 processes at world 1 each, a quarter of
# the batch, at once (the same forward and backward per rank, the same CPU contention,
# no communication). Exposed communication is step - compute-only, and prefetch hides
# (off - on) / (off - compute-only) of it. Caveats, on a machine with fewer cores than
# ranks: ranks waiting on the network free the cores for the others, and each world-1
# process steps the whole optimizer (4x a shard's), so compute-only is approximate (the
# script says when it exceeds a step). Prints a Markdown table of median step times and
# writes an SVG bar chart (grey: compute-only; coloured: exposed communication).
# ZeRO++'s rows (quantized gathers and reductions, hpZ; FSDP2 and DeepSpeed beside, four
# link shapes) are scripts/bench/bench-zeropp-links.sh's.
#   sudo scripts/bench/bench-links.sh [BIN_DIR] [SVG]   (defaults: build/bin, docs/bench-links.svg)
# BENCH_ARGS overrides the model flags; BENCH_STEPS the steps per run (median over all but
# the first 3).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="$(cd "${1:-build/bin}" && pwd)"
SVG="${2:-docs/bench-links.svg}"
PY="${FSDP_PYTHON:-}"
[ -n "$PY" ] || PY="$(command -v python3)"
[ -x .venv/bin/python ] && [ -z "${FSDP_PYTHON:-}" ] && PY=.venv/bin/python
STEPS="${BENCH_STEPS:-15}"
read -ra MODEL <<<"${BENCH_ARGS:---n-layer 4 --d-model 256 --n-head 8 --block-size 64 --batch-size 16}"
. tests/multihost/lib.sh
mh_setup bench-links 10.9.9
RESULTS="$OUT/results.txt"
: >"$RESULTS"

# median STEP_S of a --log-jsonl file, all but the first 3 steps
median_step() {
  "$PY" - "$1" <<'PY'
import json, statistics, sys
s = [json.loads(l)["step_s"] for l in open(sys.argv[1]) if '"step_s"' in l]
print(f"{statistics.median(s[3:]):.4f}")
PY
}

run_world4() {  # LABEL EXTRA...
  local label="$1" r h
  shift
  for r in 0 1 2 3; do
    h="$H1"
    [ "$r" -ge 2 ] && h="$H2"
    # shellcheck disable=SC2046
    mh_run "$h" "$OUT/$label.$r.log" env -u GLOO_SOCKET_IFNAME $(mh_rank_env "$r" 4) \
      MASTER_ADDR="$A1" MASTER_PORT=29691 FSDP_TIMEOUT_S=120 OMP_NUM_THREADS=1 \
      "$BIN/train_gpt" "${MODEL[@]}" --steps "$STEPS" --log-every 0 --sharding full \
      --log-jsonl "$OUT/$label.jsonl" "$@"
  done
  mh_wait_all
  for r in 0 1 2 3; do
    read -r rc _ _ <"$OUT/$label.$r.log.exit"
    [ "$rc" = 0 ] || { echo "bench-links: $label rank $r failed:"; tail -5 "$OUT/$label.$r.log"; exit 1; }
  done
  median_step "$OUT/$label.jsonl"
}

# Compute-only: 4 world-1 processes, 2 a host, each with a quarter of the global batch.
BATCH=16
for ((i = 0; i < ${#MODEL[@]}; i++)); do
  [ "${MODEL[$i]}" = --batch-size ] && BATCH="${MODEL[$((i + 1))]}"
done
ONE=()
for ((i = 0; i < ${#MODEL[@]}; i++)); do
  if [ "${MODEL[$i]}" = --batch-size ]; then
    ONE+=(--batch-size $((BATCH / 4)))
    i=$((i + 1))
  else
    ONE+=("${MODEL[$i]}")
  fi
done
for r in 0 1 2 3; do
  h="$H1"
  [ "$r" -ge 2 ] && h="$H2"
  mh_run "$h" "$OUT/compute.$r.log" env -u RANK -u WORLD_SIZE OMP_NUM_THREADS=1 \
    "$BIN/train_gpt" "${ONE[@]}" --steps "$STEPS" --log-every 0 --log-jsonl "$OUT/compute.$r.jsonl"
done
mh_wait_all
COMPUTE="$(median_step "$OUT/compute.0.jsonl")"
echo "compute-only (4 x world 1, batch $((BATCH / 4)) each, concurrently): median step ${COMPUTE} s" >&2

# 1 Gbit/s with 1 ms each way where netem exists; else the token bucket alone.
SLOW="1gbit|tbf rate 1gbit burst 256kb latency 50ms"
if ip netns exec "$H1" tc qdisc add dev "$L1" root netem delay 1ms 2>/dev/null; then
  SLOW="1gbit, 1 ms|netem rate 1gbit delay 1ms"
fi
ip netns exec "$H1" tc qdisc del dev "$L1" root 2>/dev/null || true
for s in "veth (unshaped)|none" "10gbit|tbf rate 10gbit burst 1mb latency 50ms" "$SLOW"; do
  name="${s%%|*}"
  mh_shape "${s#*|}"
  on="$(run_world4 on)"
  off="$(run_world4 off --no-prefetch)"
  echo "$name: prefetch on ${on} s, off ${off} s" >&2
  echo "$name|$on|$off" >>"$RESULTS"
done
mh_shape none

"$PY" - "$RESULTS" "$COMPUTE" "$SVG" "${MODEL[*]}" "$STEPS" <<'PY'
import sys
rows = [l.strip().split("|") for l in open(sys.argv[1]) if l.strip()]
compute, svg, model, steps = float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
rows = [(n, float(a), float(b)) for n, a, b in rows]
print(f"train_gpt {model} --sharding full, 4 ranks on 2 namespace hosts (2 each); "
      f"median step of {steps} (first 3 dropped). Compute-only: 4 x world 1 at once, batch/4 "
      f"each: {compute*1000:.0f} ms\n")
print("| link | step, prefetch on (ms) | step, prefetch off (ms) | exposed comm, on (ms) "
      "| exposed comm, off (ms) | prefetch hides |")
print("|---|---:|---:|---:|---:|---:|")
for name, on, off in rows:
    e_on, e_off = on - compute, off - compute
    hides = f"{(off - on) / e_off * 100:.0f}%" if e_off > 0.005 else "-"
    print(f"| {name} | {on*1000:.0f} | {off*1000:.0f} | {e_on*1000:.0f} | {e_off*1000:.0f} "
          f"| {hides} |")
if compute > min(min(r[1], r[2]) for r in rows):
    print("\nThe compute-only run was slower than a step with communication: on this machine "
          "it is no lower bound here (see the header); compare the step times only.")
# A small SVG: per link, a bar for prefetch on and one for off; grey up to the
# compute-only step, coloured beyond it (exposed communication).
W, H, left, top, bh = 640, 40 + 64 * len(rows), 120, 30, 22
scale = (W - left - 150) / max(max(r[1], r[2]) for r in rows)
out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
       f'font-family="sans-serif" font-size="12">',
       f'<text x="4" y="18">median step (ms), 4 ranks on 2 hosts, --sharding full; grey: '
       f'compute-only ({compute*1000:.0f} ms)</text>']
for i, (name, on, off) in enumerate(rows):
    y = top + 64 * i
    out.append(f'<text x="4" y="{y + bh + 4}">{name}</text>')
    for j, (label, t, colour) in enumerate((("prefetch on", on, "#3b7dd8"),
                                            ("prefetch off", off, "#d8703b"))):
        yy = y + j * (bh + 4)
        c = min(compute, t)
        out.append(f'<rect x="{left}" y="{yy}" width="{c*scale:.1f}" height="{bh}" fill="#bbb"/>')
        out.append(f'<rect x="{left + c*scale:.1f}" y="{yy}" width="{(t-c)*scale:.1f}" '
                   f'height="{bh}" fill="{colour}"/>')
        out.append(f'<text x="{left + t*scale + 4:.1f}" y="{yy + 15}">{label}: '
                   f'{t*1000:.0f}</text>')
out.append("</svg>")
open(svg, "w").write("\n".join(out) + "\n")
print(f"\n(chart: {svg})")
PY
