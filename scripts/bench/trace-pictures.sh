#!/usr/bin/env bash
# The per-unit trace's picture for docs/benchmarks.md: train_gpt at world 2 (fsdp-run,
# loopback Gloo, one thread per rank) traced with prefetch on and with --no-prefetch,
# each merged by fsdp-trace and summarised, and one step of both rendered to one PNG
# (scripts/bench/trace-png.py) to show how much communication prefetching overlaps.
#
#   scripts/bench/trace-pictures.sh [BIN_DIR] [PNG] [MD]
#     defaults: build/bin, docs/img/trace-prefetch.png, build/bench/md/trace.md
# TRACE_ARGS overrides the model flags; the traces stay in build/bench/trace/{on,off}/
# (open trace.json there in https://ui.perfetto.dev).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="$(cd "${1:-build/bin}" && pwd)"
PNG="${2:-docs/img/trace-prefetch.png}"
MD="${3:-build/bench/md/trace.md}"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
read -ra MODEL <<<"${TRACE_ARGS:---n-layer 4 --d-model 256 --n-head 8 --block-size 64 --batch-size 16}"
STEPS=6
SHOW=5  # the step drawn (the first ones record the order and warm up)
OUT=build/bench/trace
rm -rf "$OUT"
mkdir -p "$OUT" "$(dirname "$PNG")" "$(dirname "$MD")"
for mode in on off; do
  extra=()
  [ "$mode" = off ] && extra=(--no-prefetch)
  echo "trace-pictures: train_gpt world 2, prefetch $mode"
  OMP_NUM_THREADS=1 "$BIN/fsdp-run" --nproc 2 -- "$BIN/train_gpt" "${MODEL[@]}" --steps "$STEPS" \
    --log-every 0 --trace "$OUT/$mode" --log-jsonl "$OUT/$mode.jsonl" "${extra[@]}" >"$OUT/$mode.log" 2>&1 ||
    { tail -5 "$OUT/$mode.log"; exit 1; }
  "$BIN/fsdp-trace" merge "$OUT/$mode" >/dev/null
  "$BIN/fsdp-trace" summary "$OUT/$mode/trace.json" >"$OUT/$mode.summary.txt"
done
"$PY" scripts/bench/trace-png.py "$PNG" "$OUT/on/trace.json:prefetch on" "$OUT/off/trace.json:prefetch off (--no-prefetch)" \
  --step "$SHOW" --title "train_gpt ${MODEL[*]}, world 2 (Gloo, loopback), step $SHOW of each run"
{
  echo "Command: \`scripts/bench/trace-pictures.sh\` (train_gpt ${MODEL[*]}, world 2, $STEPS steps, traced). Step $SHOW of each run:"
  echo
  echo "![trace, prefetch on against off]($(realpath --relative-to=docs "$PNG"))"
  echo
  echo "| prefetch | median step (ms, steps 4-$STEPS) | communication (ms, rank 0, whole run) | waited for by compute | hidden |"
  echo "|---|---|---|---|---|"
  for mode in on off; do
    "$PY" - "$OUT/$mode.jsonl" "$OUT/$mode.summary.txt" "$mode" <<'PY'
import json, re, statistics, sys
steps = [json.loads(l)["step_s"] for l in open(sys.argv[1]) if '"step_s"' in l]
text = open(sys.argv[2]).read()
m = re.search(r"rank 0:.*?communication ([0-9.]+) ms, of which the compute track waited ([0-9.]+) ms: ([0-9.]+)% hidden", text, re.S)
print(f"| {sys.argv[3]} | {statistics.median(steps[3:]) * 1e3:.1f} | {m.group(1)} | {m.group(2)} ms | {m.group(3)}% |")
PY
  done
  echo
  echo "\`fsdp-trace summary\` of rank 0, prefetch on:"
  echo
  echo '```'
  sed -n '/^rank 0:/,/^rank 1:/p' "$OUT/on.summary.txt" | sed '$d'
  echo '```'
} >"$MD"
cat "$MD"
