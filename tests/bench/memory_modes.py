#!/usr/bin/env python3
"""Every memory mode of train_gpt on one device, side by side: tokens/s, peak memory, and
the model states the formulas give (docs/guide/memory.md, "Memory modes and the estimator"), against fp32 ZeRO-3
measured in the same run. scripts/gpu/gpu-check.sh runs it on a GPU; --device cpu runs a small
GPT so that the ctest Bench.MemoryModesRunOnTheCpu keeps it working where no GPU is.

  memory_modes.py --train-gpt build/bin/train_gpt [--device cuda|cpu] [--steps N]
                  [--n-layer L --d-model D --n-head H --block-size T --batch-size B]
                  [--only NAME,NAME]

Each mode is one train_gpt run at world 1 (--steps N, 3 of them warm-up). Prints one JSON
line per mode ({"metric": "memory_mode", "mode", "flags", "tokens_per_s",
"peak_allocated_mib" (CUDA: the caching allocator's peak; CPU: the peak RSS),
"model_states_mib" (the formula: on the device, or all on --device cpu), "first_loss", "last_loss", "vs_fp32_peak",
"vs_fp32_tokens_per_s"}) and a table. Exit status 1 when a mode fails.

At world 1 the ZeRO stages shard nothing, so zero1, zero2 and zero3 hold the same model
states (16 bytes per parameter with fp32 masters); their differences appear at world 2 and
more (tests/test_zero_stages.cpp counts them). Offload and pure bf16 change the device's
bytes at any world size.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# name, flags, and the model states' bytes per parameter at the optimizer step at world 1
# (device, host), as the engine's counters hold them (tests/test_zero_stages.cpp,
# tests/test_pure_bf16.cpp): fp32 shard 4 + gradient 4 + AdamW's moments 8; zero1 and zero2
# also keep the gathered bf16 parameters (2); offload_optimizer keeps a bf16 copy of each
# shard on the device (MemoryStats::device_param_shards) and the rest on the host;
# offload_param keeps nothing there; pure bf16 is 2 + 2 + 4. Activations come on top.
MODES = [
    ("fp32 zero3", ["--precision", "fp32"], (16, 0)),
    ("bf16 zero3", ["--precision", "bf16"], (16, 0)),
    ("bf16 zero2", ["--precision", "bf16", "--sharding", "zero2"], (18, 0)),
    ("bf16 zero1", ["--precision", "bf16", "--sharding", "zero1"], (18, 0)),
    ("bf16 offload_optimizer=cpu", ["--precision", "bf16", "--offload-optimizer", "cpu"],
     (2, 16)),
    ("bf16 offload_optimizer+param=cpu",
     ["--precision", "bf16", "--offload-optimizer", "cpu", "--offload-param", "cpu"], (0, 16)),
    ("pure bf16", ["--precision", "bf16", "--master-dtype", "bf16"], (8, 0)),
    ("pure bf16 offload_optimizer=cpu (stochastic)",
     ["--precision", "bf16", "--master-dtype", "bf16", "--offload-optimizer", "cpu"], (2, 8)),
    ("bf16 checkpointing", ["--precision", "bf16", "--activation-checkpointing", "all"],
     (16, 0)),
    ("bf16 checkpointing + offload_activations",
     ["--precision", "bf16", "--activation-checkpointing", "all", "--offload-activations"],
     (16, 0)),
]


def run_mode(args, flags):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [args.train_gpt, "--device", args.device, "--steps", str(args.steps),
               "--n-layer", str(args.n_layer), "--d-model", str(args.d_model),
               "--n-head", str(args.n_head), "--block-size", str(args.block_size),
               "--batch-size", str(args.batch_size), "--log-jsonl", log, "--lr", "1e-4",
               "--warmup-steps", "0"] + flags
        env = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT"):
            env.pop(k, None)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            return None, " ".join(cmd) + "\n" + (p.stdout + p.stderr)[-3000:]
        rows = [json.loads(line) for line in open(log) if line.strip()]
    params = peak = None
    for line in p.stdout.splitlines():
        if line.startswith("train_gpt: ") and " parameters, " in line:
            params = int(line.split()[1])
        if line.startswith("train_gpt: peak GPU memory of rank 0: "):
            peak = float(line.split(": ")[2].split()[0])
        if line.startswith("train_gpt: peak RSS of rank 0: ") and args.device == "cpu":
            peak = float(line.split(": ")[2].split()[0])
    timed = [r["tokens_per_s"] for r in rows[3:]] or [r["tokens_per_s"] for r in rows]
    return {"params": params, "peak_mib": peak, "tokens_per_s": statistics.median(timed),
            "losses": [r["loss"] for r in rows], "first_loss": rows[0]["loss"],
            "last_loss": rows[-1]["loss"]}, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--only", default="", help="comma-separated mode names (default: all)")
    ap.add_argument("--expect-learning", action="store_true",
                    help="exit 1 unless every mode's last loss is below 0.99 of its first (a "
                         "mode whose updates do not reach the gathered parameters stays flat: "
                         "ZeRO-1/2 on a GPU before the fused AdamW's version-counter fix; at "
                         "initialisation every batch's loss is near ln 256, so 1%% is learning, "
                         "whatever the seed draws: 4 steps at lr 1e-4 fall by about 2%%)")
    ap.add_argument("--expect-parity", action="store_true",
                    help="exit 1 unless the modes of one precision (bf16 with fp32 masters; "
                         "pure bf16) give bit-identical losses, as they do on the CPU")
    args = ap.parse_args()
    if args.steps < 1:
        sys.exit(f"memory_modes.py: --steps {args.steps} must be at least 1")
    if not os.access(args.train_gpt, os.X_OK):
        sys.exit(f"memory_modes.py: --train-gpt {args.train_gpt} is not an executable; build "
                 "train_gpt first (cmake --build build --target train_gpt)")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - {m[0] for m in MODES}
    if unknown:
        sys.exit(f"memory_modes.py: --only {sorted(unknown)} unknown; the modes are "
                 f"{[m[0] for m in MODES]}")
    unit = "MiB GPU peak allocated" if args.device.startswith("cuda") else "MiB peak RSS"
    states_label = "device model states" if args.device.startswith("cuda") else "model states"
    print(f"memory modes: GPT {args.n_layer}x{args.d_model}, batch {args.batch_size}x"
          f"{args.block_size}, {args.steps} steps each, --device {args.device}", flush=True)
    base = None
    failed = 0
    table = []
    losses_by_precision = {}
    on_gpu = args.device.startswith("cuda")
    for name, flags, (device_bytes, host_bytes) in MODES:
        if only and name not in only:
            continue
        r, err = run_mode(args, flags)
        if r is None:
            failed += 1
            print(f"memory modes: {name}: FAILED\n{err}", flush=True)
            continue
        if base is None and name == "fp32 zero3":
            base = r
        # On the CPU the device is the host: every byte is in the peak RSS.
        per_param = device_bytes if on_gpu else device_bytes + host_bytes
        states = r["params"] * per_param / 1048576 if r["params"] else None
        out = {"metric": "memory_mode", "mode": name, "flags": " ".join(flags),
               "tokens_per_s": round(r["tokens_per_s"], 1), "peak_allocated_mib": r["peak_mib"],
               "unit": unit, "model_states_mib": states and round(states, 1),
               "first_loss": r["first_loss"], "last_loss": r["last_loss"],
               "learned": r["last_loss"] < 0.99 * r["first_loss"]}
        if base:
            if base["peak_mib"] and r["peak_mib"]:
                out["vs_fp32_peak"] = round(r["peak_mib"] / base["peak_mib"], 4)
            out["vs_fp32_tokens_per_s"] = round(r["tokens_per_s"] / base["tokens_per_s"], 4)
        print(json.dumps(out), flush=True)
        table.append(out)
        precision = "pure" if "--master-dtype" in flags else flags[1]
        losses_by_precision.setdefault(precision, []).append((name, r["losses"]))
    print(f"\n| mode | tokens/s | {unit} | {states_label} (formula), MiB | peak / fp32 | "
          "tokens/s / fp32 | first → last loss |")
    print("|---|---|---|---|---|---|---|")
    for o in table:
        print(f"| {o['mode']} | {o['tokens_per_s']:.0f} | {o['peak_allocated_mib']} | "
              f"{o['model_states_mib']} | {o.get('vs_fp32_peak', '')} | "
              f"{o.get('vs_fp32_tokens_per_s', '')} | {o['first_loss']:.4f} → "
              f"{o['last_loss']:.4f} |")
    if args.expect_learning:
        for o in table:
            if not o["learned"]:
                failed += 1
                print(f"memory modes: {o['mode']} did not learn: loss {o['first_loss']:.4f} -> "
                      f"{o['last_loss']:.4f} (must fall below 0.99 of the first)", flush=True)
    if args.expect_parity:
        for precision, runs in losses_by_precision.items():
            first_name, first = runs[0]
            for name, losses in runs[1:]:
                if losses != first:
                    failed += 1
                    print(f"memory modes: {name} lost {losses}, {first_name} {first}: the "
                          "same precision must train bit-identically", flush=True)
                else:
                    print(f"memory modes: {name}: the same {len(losses)} losses as "
                          f"{first_name}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
