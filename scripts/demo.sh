#!/usr/bin/env bash
# The demo: train the GPT example fully sharded over 2 ranks (CPU, Gloo), saving sharded
# checkpoints; resume from the newest one and finish; consolidate the sharded checkpoint
# offline into one HDF5 file; generate text from it.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-300}
HALF=$((STEPS / 2))
B="${FSDP_BUILD_DIR:-build}"   # scripts/in-debian13.sh sets its own
OUT="$B/demo"
rm -rf "$OUT"
mkdir -p "$OUT"
COMMON=(--steps "$STEPS" --save-dir "$OUT/checkpoints" --save-every 50 --keep 2)

echo "[demo] 1/4 training a GPT fully sharded over 2 ranks; stopping at step $HALF as if the job were preempted"
# --stop-at ends the run after that step (with a checkpoint); the learning-rate schedule
# still spans --steps, so the resumed run continues exactly where this one stopped.
"./$B/bin/fsdp-run" --nproc 2 -- "./$B/bin/train_gpt" "${COMMON[@]}" --stop-at "$HALF" \
  --log-jsonl "$OUT/log_part1.jsonl"

echo "[demo] 2/4 resuming from the newest sharded checkpoint and finishing"
"./$B/bin/fsdp-run" --nproc 2 -- "./$B/bin/train_gpt" "${COMMON[@]}" --resume \
  --log-jsonl "$OUT/log_part2.jsonl"

echo "[demo] 3/4 consolidating the sharded checkpoint offline (no process group)"
"./$B/bin/fsdp-inspect" "$OUT/checkpoints" | head -4
"./$B/bin/fsdp-consolidate" "$OUT/checkpoints" "$OUT/gpt.h5"

echo "[demo] 4/4 generating from the consolidated weights (greedy, then sampled)"
PROMPT="the "
echo "prompt: '$PROMPT'"
printf 'greedy : %s\n' "$("./$B/bin/generate" --weights "$OUT/gpt.h5" --prompt "$PROMPT" --max-new-tokens 120 --greedy)"
printf 'sampled: %s\n' "$("./$B/bin/generate" --weights "$OUT/gpt.h5" --prompt "$PROMPT" --max-new-tokens 120 \
  --temperature 0.8 --top-k 20 --seed 1)"
echo "[demo] done: logs in $OUT/log_part*.jsonl, checkpoints in $OUT/checkpoints, weights in $OUT/gpt.h5"
echo "[demo] read the weights from Python: /usr/bin/python3 -c \"import h5py; f = h5py.File('$OUT/gpt.h5'); print(list(f['model'])[:5])\""
