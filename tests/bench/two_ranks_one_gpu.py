#!/usr/bin/env python3
"""Two ranks on one GPU over Gloo against one rank on the same GPU: the multi-rank GPU
path (streams, events, prefetch while computing, pinned offload copies) without NCCL,
which refuses two ranks on one device. scripts/gpu/gpu-check.sh runs it on a GPU as the phase
two_ranks_one_gpu; --device cpu rehearses it where no GPU is (ctest
Bench.TwoRanksOneGpuRehearsedOnTheCpu), with FSDP_GLOO_STAGE_THROUGH_HOST=1 so that the
two ranks' tensors go through the host buffers that CUDA tensors take.

  two_ranks_one_gpu.py --bin-dir build/bin [--device cuda|cpu] [--steps N]
                       [--tolerance REL] [--only NAME,NAME]

For each mode, train_gpt --device DEVICE at world 1 (no collectives) and at world 2
(fsdp-run --nproc 2, --backend gloo: both ranks on the one GPU), the same global batch,
seed and data, prefetch on. Prints one JSON line per mode ({"metric": "two_ranks_one_gpu",
"mode", "flags", "world1_losses", "world2_losses", "max_rel_diff", "ok"}) and a table.
Exit status 1 when a run fails or a loss differs by more than --tolerance (relative; the
world sizes sum the gradients in other orders, so the losses agree to fp32 rounding, not
bit for bit).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

MODES = [
    ("FULL_SHARD", ["--sharding", "full"]),
    ("SHARD_GRAD_OP", ["--sharding", "grad_op"]),
    ("ZeRO-2", ["--sharding", "zero2"]),
    ("cpu offload", ["--sharding", "full", "--cpu-offload"]),
]


def run(args, world, flags, env_extra):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        train = [os.path.join(args.bin_dir, "train_gpt"), "--device", args.device, "--steps",
                 str(args.steps), "--n-layer", str(args.n_layer), "--d-model", str(args.d_model),
                 "--n-head", str(args.n_head), "--block-size", str(args.block_size),
                 "--batch-size", str(args.batch_size), "--seed", "7", "--log-jsonl", log] + flags
        if world > 1:
            cmd = [os.path.join(args.bin_dir, "fsdp-run"), "--nproc", str(world), "--"] + train + \
                ["--backend", "gloo"]
        else:
            cmd = train
        env = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT"):
            env.pop(k, None)
        env.update(env_extra)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        out = p.stdout + p.stderr
        if p.returncode != 0:
            return None, " ".join(cmd) + "\n" + out[-3000:]
        if world > 1 and "collectives over gloo" not in out:
            return None, " ".join(cmd) + ": the summary does not say 'collectives over gloo'\n" + \
                out[-2000:]
        return [json.loads(line)["loss"] for line in open(log) if line.strip()], None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True, help="the folder of train_gpt and fsdp-run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--only", default="", help="comma-separated mode names (default: all)")
    args = ap.parse_args()
    for exe in ("train_gpt", "fsdp-run"):
        if not os.access(os.path.join(args.bin_dir, exe), os.X_OK):
            sys.exit(f"two_ranks_one_gpu.py: no {exe} in --bin-dir {args.bin_dir}; build it first")
    if args.steps < 1:
        sys.exit(f"two_ranks_one_gpu.py: --steps {args.steps} must be at least 1")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - {m[0] for m in MODES}
    if unknown:
        sys.exit(f"two_ranks_one_gpu.py: --only {sorted(unknown)} unknown; the modes are "
                 f"{[m[0] for m in MODES]}")
    # On the CPU the ranks' tensors are host tensors already: stage them anyway, so that
    # the rehearsal runs the path CUDA tensors take (Note [Gloo with CUDA tensors]).
    staging = {} if args.device.startswith("cuda") else {"FSDP_GLOO_STAGE_THROUGH_HOST": "1"}
    print(f"two ranks on one {args.device} over Gloo against one rank: GPT {args.n_layer}x"
          f"{args.d_model}, batch {args.batch_size}x{args.block_size}, {args.steps} steps, "
          f"tolerance {args.tolerance:g} relative", flush=True)
    failed = 0
    rows = []
    for name, flags in MODES:
        if only and name not in only:
            continue
        one, err1 = run(args, 1, flags, {})
        two, err2 = run(args, 2, flags, staging)
        if one is None or two is None:
            failed += 1
            print(f"two ranks on one GPU: {name}: FAILED\n{err1 or err2}", flush=True)
            continue
        diff = max((abs(a - b) / abs(a) for a, b in zip(one, two)), default=float("inf"))
        ok = len(one) == len(two) == args.steps and diff <= args.tolerance
        failed += 0 if ok else 1
        out = {"metric": "two_ranks_one_gpu", "mode": name, "flags": " ".join(flags),
               "device": args.device, "world1_losses": one, "world2_losses": two,
               "max_rel_diff": diff, "ok": ok}
        print(json.dumps(out), flush=True)
        rows.append(out)
    print("\n| mode | world 1: first → last loss | world 2 on one device | max relative difference |")
    print("|---|---|---|---|")
    for o in rows:
        print(f"| {o['mode']} | {o['world1_losses'][0]:.6f} → {o['world1_losses'][-1]:.6f} | "
              f"{o['world2_losses'][0]:.6f} → {o['world2_losses'][-1]:.6f} | "
              f"{o['max_rel_diff']:.2e}{'' if o['ok'] else ' FAIL'} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
