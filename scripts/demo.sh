#!/usr/bin/env bash
# The demo: train the GPT example on real English text, fully sharded over 2 ranks (CPU,
# Gloo), saving sharded checkpoints in the background and printing the loss on held-out
# text; resume from the newest checkpoint and finish; consolidate the sharded checkpoint
# offline into one HDF5 file and into safetensors; generate text from them.
#
# The text: quotations from Debian's `fortunes` package (BSD licence, see
# /usr/share/doc/fortunes/copyright), installed by scripts/install-deps.sh. Without it the
# demo trains on the synthetic task instead and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-800}
HALF=$((STEPS / 2))
B="${FSDP_BUILD_DIR:-build}"   # scripts/ci/in-debian13.sh sets its own
OUT="$B/demo"
rm -rf "$OUT"
mkdir -p "$OUT"

FORTUNES=/usr/share/games/fortunes
DATA=()
if [ -r "$FORTUNES/wisdom" ]; then
  # Plain quotations, without the % lines that separate them: about 700 KB of English.
  for f in wisdom people science work art humorists education love platitudes tao; do
    if [ -r "$FORTUNES/$f" ]; then grep -v '^%$' "$FORTUNES/$f"; fi
  done > "$OUT/fortunes.txt"
  DATA=(--data "$OUT/fortunes.txt")
  echo "[demo] text: $(wc -c < "$OUT/fortunes.txt") bytes of quotations from Debian's fortunes package;" \
       "the last 10% held out for validation"
else
  echo "[demo] $FORTUNES is missing (apt-get install fortunes); training on the synthetic task instead"
fi
MODEL=(--n-layer 4 --n-head 4 --d-model 128 --block-size 64 --batch-size 16)
COMMON=(--steps "$STEPS" "${MODEL[@]}" "${DATA[@]}" --warmup-steps 50 --save-dir "$OUT/checkpoints" --save-every 200 --keep 2
        --async-save --log-every 100)

echo "[demo] 1/5 training a GPT fully sharded over 2 ranks; stopping at step $HALF as if the job were preempted"
# --stop-at ends the run after that step (with a checkpoint); the learning-rate schedule
# still spans --steps, so the resumed run continues exactly where this one stopped.
"./$B/bin/fsdp-run" --nproc 2 -- "./$B/bin/train_gpt" "${COMMON[@]}" --stop-at "$HALF" \
  --log-jsonl "$OUT/log_part1.jsonl"

echo "[demo] 2/5 resuming from the newest sharded checkpoint and finishing"
"./$B/bin/fsdp-run" --nproc 2 -- "./$B/bin/train_gpt" "${COMMON[@]}" --resume \
  --log-jsonl "$OUT/log_part2.jsonl"

echo "[demo] 3/5 consolidating the sharded checkpoint offline (no process group): HDF5 and safetensors"
"./$B/bin/fsdp-inspect" "$OUT/checkpoints" | head -4
"./$B/bin/fsdp-consolidate" "$OUT/checkpoints" "$OUT/gpt.h5"
"./$B/bin/fsdp-consolidate" "$OUT/checkpoints" "$OUT/gpt-safetensors" --format safetensors

echo "[demo] 4/5 generating from the consolidated weights (greedy, then sampled)"
PROMPT="The "
echo "prompt: '$PROMPT'"
printf 'greedy : %s\n' "$("./$B/bin/generate" --weights "$OUT/gpt.h5" --prompt "$PROMPT" --max-new-tokens 200 --greedy)"
printf 'sampled: %s\n' "$("./$B/bin/generate" --weights "$OUT/gpt-safetensors" --prompt "$PROMPT" \
  --max-new-tokens 200 --temperature 0.8 --top-k 20 --seed 1)"

echo "[demo] 5/5 reading the safetensors export from Python"
ST="$OUT/gpt-safetensors/model.safetensors"
# The Python of the build (scripts/lib/python-env.sh: .venv's, with PyPI's safetensors).
PY="${FSDP_PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo /usr/bin/python3)}"
if "$PY" -c "import safetensors" 2>/dev/null; then
  ONE_LINER="from safetensors.numpy import load_file; w = load_file('$ST'); print(len(w), 'tensors;', 'wte.weight', w['wte.weight'].shape, w['wte.weight'].dtype)"
else
  # Without the safetensors package, the format is simple enough for the standard library.
  ONE_LINER="import json, struct; f = open('$ST', 'rb'); h = json.loads(f.read(struct.unpack('<Q', f.read(8))[0])); print(len(h) - 1, 'tensors;', h['__metadata__'])"
fi
echo "\$ $PY -c \"$ONE_LINER\""
"$PY" -c "$ONE_LINER"
echo "[demo] done: logs in $OUT/log_part*.jsonl, checkpoints in $OUT/checkpoints, weights in $OUT/gpt.h5 and $OUT/gpt-safetensors"
