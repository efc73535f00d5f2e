#!/usr/bin/env bash
# Step time of two builds of train_gpt, in alternating runs on this machine (the
# renovation's "no slower" check): a 4-layer GPT of width 256, T 128, batch 8, world 2 on
# the CPU, 30 steps; each run's mean step_s over steps 6-30, and its last loss (the two
# builds must agree to the bit).
#
#   compare_step_time.sh OLD_BIN_DIR NEW_BIN_DIR [ROUNDS]
#
# OLD_BIN_DIR needs train_gpt only; both runs use NEW_BIN_DIR's fsdp-run.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 OLD_BIN_DIR NEW_BIN_DIR [ROUNDS]" >&2; exit 2; }
OLD="$1" NEW="$2" ROUNDS="${3:-3}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
for label in "fp32:" "bf16:--precision bf16"; do
  name="${label%%:*}" extra="${label#*:}"
  for round in $(seq "$ROUNDS"); do
    for who in old new; do
      bin="$OLD"; [ "$who" = new ] && bin="$NEW"
      log="$TMP/${name}_${who}_$round.jsonl"
      # shellcheck disable=SC2086
      "$NEW/fsdp-run" --nproc 2 -- "$bin/train_gpt" --device cpu --n-layer 4 --d-model 256 \
        --n-head 8 --block-size 128 --batch-size 8 --steps 30 --warmup-steps 0 --lr 1e-4 \
        $extra --log-jsonl "$log" >/dev/null
      python3 - "$log" "$name" "$who" "$round" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][5:]
print(sys.argv[2], sys.argv[3], sys.argv[4],
      "%.2f ms" % (1000 * statistics.mean(r["step_s"] for r in rows)), "loss", rows[-1]["loss"])
PY
    done
  done
done
