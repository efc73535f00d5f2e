#!/usr/bin/env python3
"""The 1.3B GPT in bf16 on one GPU: this library, plain LibTorch and PyTorch FSDP2,
alternating. scripts/gpu/gpu-check.sh runs it as its phase large_model; --device cpu runs the
same rounds on a small GPT, so that the phase is rehearsed where no GPU is.

  large_model.py --bench-gpu BUILD/bin/bench_gpu [--python PY] [--device cuda|cpu]
                 [--rounds 3] [--reps 8] [--n-layer 26 --d-model 2048 --n-head 16
                 --block-size 1024 --batch-size 8]

Each round runs two processes, one after the other, in alternating order (round 1: ours
first, round 2: FSDP2 first, ...): bench_gpu --model large (this library, then plain
LibTorch, or the reverse: --order alternates too), and tests/interop/fsdp2_bench.py
--large --fused (FSDP2 with F.scaled_dot_product_attention and fused AdamW) on the same
GPT, batch and device. Every process builds its model fresh and times --reps steps after
3 warm-up steps. Prints each process's JSON lines as they come, one line per round
({"metric": "large_model_round", "round", "ours", "plain", "fsdp2", "ours_over_fsdp2",
"ours_over_plain"}: tokens/s and ratios of that round) and a summary line
({"metric": "large_model", "gpu_mfu", "ours_over_fsdp2": {"tokens_per_s_bf16": median,
"min", "max", "pairs"}, "ours_over_plain": {...}, medians and spreads of tokens/s, MFU and
peak memory}). Exit status 1 when a process fails or prints no figure.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FSDP2 = os.path.join(HERE, "..", "interop", "fsdp2_bench.py")


def run(cmd, timeout):
    print("$ " + " ".join(cmd), flush=True)
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out + f"\nlarge_model.py: timed out after {timeout} s", flush=True)
        return None
    print(p.stdout, end="", flush=True)
    if p.returncode != 0:
        print(f"large_model.py: exit status {p.returncode}", flush=True)
        return None
    metrics = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            m = json.loads(line)
            metrics[m["metric"]] = m
    return metrics


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench-gpu", required=True)
    ap.add_argument("--python", default=sys.executable, help="the Python whose torch runs FSDP2")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--n-layer", type=int, default=26)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=240, help="seconds per process")
    args = ap.parse_args()
    if args.rounds < 1 or args.reps < 1:
        sys.exit("large_model.py: --rounds and --reps must be at least 1")
    if not os.access(args.bench_gpu, os.X_OK):
        sys.exit(f"large_model.py: --bench-gpu {args.bench_gpu} is not an executable; build "
                 "bench_gpu first (a CUDA LibTorch builds it)")
    ours_cmd = [args.bench_gpu, "--device", args.device, "--model", "large", "--reps",
                str(args.reps), "--large-layers", str(args.n_layer), "--large-d-model",
                str(args.d_model), "--large-heads", str(args.n_head), "--large-block-size",
                str(args.block_size), "--large-batch", str(args.batch_size)]
    fsdp2_cmd = [args.python, FSDP2, "--device", args.device, "--large", "--fused", "--reps",
                 str(args.reps), "--n-layer", str(args.n_layer), "--d-model", str(args.d_model),
                 "--n-head", str(args.n_head), "--block-size", str(args.block_size),
                 "--batch-size", str(args.batch_size)]
    print(f"large model: GPT {args.n_layer}x{args.d_model}, batch {args.batch_size}x"
          f"{args.block_size}, bf16, {args.rounds} rounds of {args.reps} steps, on {args.device}",
          flush=True)
    rounds, failed = [], 0
    for r in range(1, args.rounds + 1):
        ours_first = r % 2 == 1
        order = ["ours", "plain"] if ours_first else ["plain", "ours"]
        got = {}
        for who in (["ours", "fsdp2"] if ours_first else ["fsdp2", "ours"]):
            cmd = ours_cmd + ["--order", order[0]] if who == "ours" else fsdp2_cmd
            got[who] = run(cmd, args.timeout)
        o, f = got["ours"], got["fsdp2"]
        if not o or "gpu_large_bf16_tokens_per_s" not in o or not f or \
                "fsdp2_large_bf16_tokens_per_s" not in f:
            failed += 1
            print(f"large_model.py: round {r}: a process failed or printed no tokens/s", flush=True)
            continue
        row = {"metric": "large_model_round", "round": r, "order": "ours first" if ours_first else "fsdp2 first",
               "ours": o["gpu_large_bf16_tokens_per_s"]["value"],
               "plain": o["gpu_large_plain_bf16_tokens_per_s"]["value"],
               "fsdp2": f["fsdp2_large_bf16_tokens_per_s"]["value"]}
        row["ours_over_fsdp2"] = row["ours"] / row["fsdp2"]
        row["ours_over_plain"] = row["ours"] / row["plain"]
        for key, src, name in (("ours_mfu", o, "gpu_mfu"), ("plain_mfu", o, "gpu_large_plain_mfu"),
                               ("fsdp2_mfu", f, "fsdp2_large_bf16_mfu"),
                               ("ours_peak_bytes", o, "gpu_large_peak_memory_bytes"),
                               ("plain_peak_bytes", o, "gpu_large_plain_peak_memory_bytes"),
                               ("fsdp2_peak_bytes", f, "fsdp2_large_bf16_peak_memory_bytes")):
            if name in src:
                row[key] = src[name]["value"]
        row["params"] = o["gpu_large_bf16_tokens_per_s"].get("params")
        if "gpu_mfu" in o:
            row["flops_per_token"] = o["gpu_mfu"].get("flops_per_token")
        print(json.dumps(row), flush=True)
        rounds.append(row)
    if not rounds:
        print("large_model.py: no round completed", flush=True)
        return 1
    summary = {"metric": "large_model", "device": args.device, "rounds": len(rounds),
               "model": f"GPT {args.n_layer}x{args.d_model}, {args.n_head} heads, batch "
                        f"{args.batch_size}x{args.block_size}, bf16",
               "params": rounds[0]["params"], "flops_per_token": rounds[0].get("flops_per_token"),
               "formula": "6N + 12 L d T",
               "tokens_per_s": {k: spread([x[k] for x in rounds]) for k in ("ours", "plain", "fsdp2")},
               "ours_over_fsdp2": {"tokens_per_s_bf16": statistics.median(x["ours_over_fsdp2"] for x in rounds),
                                   **spread([x["ours_over_fsdp2"] for x in rounds])},
               "ours_over_plain": spread([x["ours_over_plain"] for x in rounds]),
               "every_pair_ours_at_least_fsdp2": all(x["ours_over_fsdp2"] >= 1.0 for x in rounds)}
    for k in ("ours_mfu", "plain_mfu", "fsdp2_mfu", "ours_peak_bytes", "plain_peak_bytes",
              "fsdp2_peak_bytes"):
        vals = [x[k] for x in rounds if k in x]
        if len(vals) == len(rounds):
            summary[k] = spread(vals)
    if "ours_mfu" in summary:
        summary["gpu_mfu"] = summary["ours_mfu"]["median"]
    print(json.dumps(summary), flush=True)
    print("\n| round | order | ours tokens/s | plain LibTorch | FSDP2 | ours / FSDP2 | ours / plain | MFU ours |")
    print("|---|---|---|---|---|---|---|---|")
    for x in rounds:
        mfu = f"{x['ours_mfu']:.3f}" if "ours_mfu" in x else ""
        print(f"| {x['round']} | {x['order']} | {x['ours']:.0f} | {x['plain']:.0f} | {x['fsdp2']:.0f} | "
              f"{x['ours_over_fsdp2']:.3f} | {x['ours_over_plain']:.3f} | {mfu} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
