#!/usr/bin/env bash
# ZeRO++'s accuracy (issue: ZeRO++ for slow links): train_gpt at world 4 on the demo's text
# (Debian's fortunes, as scripts/demo.sh), 300 steps in bf16, with the communication
# unquantized (the reference) and with qwZ, qgZ, both, both with hpZ, and both with int4
# gradients and hpZ. Every run sees the same weights and batches, so the curves differ only
# by quantization. Prints a Markdown table (the mean training loss of the last 20 steps and
# the held-out loss at the end, each against the reference's) and draws the curves.
#   scripts/bench/zeropp-loss-curves.sh [BIN_DIR] [PNG]   (defaults: build/bin,
#                                                         docs/img/zeropp-loss-curves.png)
# STEPS overrides the steps (300).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="$(cd "${1:-build/bin}" && pwd)"
PNG="${2:-docs/img/zeropp-loss-curves.png}"
PY="${FSDP_PYTHON:-}"
[ -n "$PY" ] || PY="$(command -v python3)"
[ -x .venv/bin/python ] && [ -z "${FSDP_PYTHON:-}" ] && PY=.venv/bin/python
STEPS="${STEPS:-300}"
OUT="${OUT:-build/zeropp-loss}"
rm -rf "$OUT"
mkdir -p "$OUT"
FORTUNES=/usr/share/games/fortunes
[ -r "$FORTUNES/wisdom" ] || { echo "zeropp-loss-curves: $FORTUNES is missing (apt-get install fortunes)" >&2; exit 2; }
for f in wisdom people science work art humorists education love platitudes tao; do
  if [ -r "$FORTUNES/$f" ]; then grep -v '^%$' "$FORTUNES/$f"; fi
done >"$OUT/fortunes.txt"
MODEL=(--n-layer 4 --n-head 4 --d-model 128 --block-size 64 --batch-size 16 --warmup-steps 50
  --precision bf16 --data "$OUT/fortunes.txt" --steps "$STEPS" --log-every 50)
RUNS=(
  "bf16 (unquantized)|"
  "qwZ (int8 weights)|--quantize-weights"
  "qgZ (int8 gradients)|--quantize-gradients"
  "qwZ + qgZ|--quantize-weights --quantize-gradients"
  "qwZ + qgZ + hpZ 2|--quantize-weights --quantize-gradients --hpz-group-size 2"
  "qwZ + qgZ int4 + hpZ 2|--quantize-weights --quantize-gradients --quantize-gradient-bits 4 --hpz-group-size 2"
)
: >"$OUT/runs.txt"
i=0
for run in "${RUNS[@]}"; do
  name="${run%%|*}"
  echo "[zeropp-loss-curves] $name" >&2
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 "$BIN/fsdp-run" --nproc 4 -- "$BIN/train_gpt" "${MODEL[@]}" ${run#*|} \
    --log-jsonl "$OUT/run$i.jsonl" >"$OUT/run$i.log" 2>&1 ||
    { echo "zeropp-loss-curves: '$name' failed:" >&2; tail -5 "$OUT/run$i.log" >&2; exit 1; }
  echo "$name|$OUT/run$i.jsonl" >>"$OUT/runs.txt"
  i=$((i + 1))
done

"$PY" - "$OUT/runs.txt" "$PNG" "$STEPS" <<'PY'
import json, sys
runs = [l.rstrip("\n").split("|") for l in open(sys.argv[1]) if l.strip()]
png, steps = sys.argv[2], int(sys.argv[3])
data = []
for name, path in runs:
    rows = [json.loads(l) for l in open(path)]
    loss = [r["loss"] for r in rows if "loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    wire = [r["wire_bytes"] for r in rows if "wire_bytes" in r]
    data.append((name, loss, val[-1] if val else float("nan"), wire[-1] if wire else 0))
ref_train = sum(data[0][1][-20:]) / 20
ref_val = data[0][2]
print(f"train_gpt --n-layer 4 --d-model 128 --block-size 64 --batch-size 16 --precision bf16, "
      f"world 4 (fsdp-run --nproc 4, one host), {steps} steps of the demo's text; block 2048\n")
print("| communication | train loss, mean of the last 20 steps | vs bf16 | held-out loss at the end | vs bf16 | sent per step (rank 0, MB) |")
print("|---|---:|---:|---:|---:|---:|")
for name, loss, val, wire in data:
    t = sum(loss[-20:]) / 20
    print(f"| {name} | {t:.4f} | {(t / ref_train - 1) * 100:+.2f}% | {val:.4f} | "
          f"{(val / ref_val - 1) * 100:+.2f}% | {wire / 1e6:.2f} |")
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
for name, loss, _, _ in data:
    k = 10  # a moving mean over 10 steps
    smooth = [sum(loss[max(0, i - k + 1):i + 1]) / len(loss[max(0, i - k + 1):i + 1]) for i in range(len(loss))]
    a.plot(range(1, len(loss) + 1), smooth, label=name, linewidth=1)
    rel = [(s / r - 1) * 100 for s, r in zip(smooth, [sum(data[0][1][max(0, i - k + 1):i + 1]) / len(data[0][1][max(0, i - k + 1):i + 1]) for i in range(len(loss))])]
    b.plot(range(1, len(loss) + 1), rel, label=name, linewidth=1)
a.set_xlabel("step"); a.set_ylabel("training loss (mean of 10 steps)"); a.set_yscale("log")
a.set_title("train_gpt at world 4, demo text, bf16")
b.set_xlabel("step"); b.set_ylabel("vs bf16 unquantized (%)"); b.axhline(0, color="grey", linewidth=0.5)
b.axhline(1, color="grey", linewidth=0.5, linestyle=":"); b.axhline(-1, color="grey", linewidth=0.5, linestyle=":")
b.set_ylim(-6, 4); b.legend(fontsize=7)
fig.tight_layout()
fig.savefig(png, dpi=110)
print(f"\n(picture: {png})")
PY
