#!/usr/bin/env bash
# The demo: train the GPT example on 2 ranks (CPU, Gloo) until its loss falls well
# below the synthetic task's unigram entropy.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-300}
echo "[demo] training a GPT fully sharded over 2 ranks for $STEPS steps"
./build/bin/fsdp-run --nproc 2 -- ./build/bin/train_gpt --steps "$STEPS" --log-jsonl build/demo_log.jsonl
echo "[demo] per-step log (JSON lines): build/demo_log.jsonl"
