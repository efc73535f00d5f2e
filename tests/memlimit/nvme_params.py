#!/usr/bin/env python3
"""Parameters on NVMe, proved under a memory limit (Note [NVMe parameters] in
src/engine/flat_param.cpp): a GPT whose training state (16 bytes per parameter) is at least
three times the memory the job is given beyond LibTorch's own trains at world 2 inside a
memory cgroup with offload_optimizer and offload_param on NVMe, with the same losses, bit
for bit, as the same run in memory without a limit; the same run without NVMe, under the
same limit, is killed.

  nvme_params.py --bin-dir build/bin [--n-layer 64] [--d-model 512] [--n-head 8]
                 [--block-size 64] [--world 2] [--steps 3] [--nvme-path DIR]

1. LibTorch's own memory: the job's peak for a one-block GPT of width 64, the smaller of
   two runs (the first to read the libraries' pages is charged for them);
2. the limit: own + 16 * params / 3, so that 16 * params >= 3 * (limit - own);
3. three runs of train_gpt (tests/memlimit/construction.sh): with NVMe under the limit,
   in memory without one (a 20 GiB cgroup, for its peak and its time), in memory under
   the limit, which must not fit. Its decision rule (construction.sh --expect-oom): the
   OOM killer ended it, or it reached the limit and was still running at a deadline of
   3 times the unlimited run's time (at least 60 s): a job over its limit may thrash,
   its code pages read back from disk, instead of being killed.
The runs compute in fp32 (--precision fp32; the bytes per parameter are the same 16): on a
CPU without native bf16 (no AVX-512 BF16 or AMX) LibTorch emulates bf16 matmuls, 10 to 20
times slower, and this test is about memory, not bf16. No allocator variable is set: the
library bounds glibc's heap itself (Note [Host heap]).
The files go to --nvme-path (default: a new directory under /var/tmp), which must be on a
disk: a tmpfs's pages are memory. Needs root and a memory controller (exit 77 otherwise).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONSTRUCTION = os.path.join(HERE, "construction.sh")
MIB = 1 << 20


def run(args, flags, limit_mib, layers, d_model, n_head, expect_oom=False, deadline_s=0):
    """One train_gpt run in a cgroup; its exit, peaks, losses and seconds."""
    with tempfile.TemporaryDirectory(prefix="fsdp_nvme_params_") as tmp:
        log = os.path.join(tmp, "log.jsonl")
        train = flags + ["--n-layer", str(layers), "--d-model", str(d_model), "--n-head",
                         str(n_head), "--block-size", str(args.block_size), "--batch-size",
                         str(args.world), "--steps", str(args.steps), "--warmup-steps", "0",
                         "--lr", "1e-4", "--log-jsonl", log, "--device", "cpu"]
        cmd = ["bash", CONSTRUCTION] + (["--expect-oom"] if expect_oom else []) + (
            ["--deadline-s", str(deadline_s)] if deadline_s else []) + [
            args.bin_dir, str(limit_mib), "sharded", str(args.world)] + train
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        seconds = time.monotonic() - t0
        out = p.stdout + p.stderr
        if p.returncode == 77:
            print(out)
            sys.exit(77)
        m = re.search(r"exit (\d+), job peak (\d+) MiB, OOM kills ([^,\s]+)", out)
        ranks = re.search(r"peak RSS per rank \(MiB\): ([0-9 ]+)", out)
        params = re.search(r"train_gpt: (\d+) parameters", out)
        rows = [json.loads(l) for l in open(log)] if os.path.exists(log) else []
        return {"rc": p.returncode, "exit": int(m.group(1)) if m else None,
                "peak_mib": int(m.group(2)) if m else None,
                "oom_kills": m.group(3) if m else None,
                "rank_peaks_mib": [int(x) for x in ranks.group(1).split()] if ranks else [],
                "params": int(params.group(1)) if params else None,
                "losses": [r["loss"] for r in rows], "step_s": [r["step_s"] for r in rows],
                "seconds": seconds,
                "tail": "\n".join(out.strip().splitlines()[-6:])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True)
    # 202M parameters in 64 blocks of width 512: in fp32 a block's gathered parameters and
    # gradients (12.6 MB each) leave the NVMe run far below the limit (942 MiB of 1413
    # measured); 16 blocks of width 1024 (the same parameters, 50 MB a block) did not fit.
    ap.add_argument("--n-layer", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nvme-path", default="")
    ap.add_argument("--timeout", type=int, default=600)
    args = ap.parse_args()
    for name in ("n_layer", "d_model", "n_head", "block_size", "world", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    made = not args.nvme_path
    nvme = args.nvme_path or tempfile.mkdtemp(prefix="fsdp_nvme_params_", dir="/var/tmp")
    if not os.path.isdir(nvme):
        ap.error(f"--nvme-path {nvme} is not a directory; create it on a disk (not a tmpfs)")
    fs = subprocess.run(["stat", "-f", "-c", "%T", nvme], capture_output=True, text=True).stdout.strip()
    if fs in ("tmpfs", "ramfs"):
        ap.error(f"--nvme-path {nvme} is on a {fs}, whose pages are memory: the limit would count "
                 "the files. Point it at a directory on a disk")
    try:
        own_runs = [run(args, ["--precision", "fp32"], 20480, 1, 64, 4) for _ in range(2)]
        for r in own_runs:
            if r["rc"] != 0:
                print(f"nvme_params: the baseline run failed (exit {r['rc']}):\n{r['tail']}")
                return 1
        own = min(r["peak_mib"] for r in own_runs)
        mem_flags = ["--precision", "fp32"]
        nvme_flags = mem_flags + ["--offload-optimizer", "nvme", "--offload-param", "nvme",
                                  "--nvme-path", nvme]
        # The parameters, from fsdp-estimate (the same count train_gpt prints).
        est = json.loads(subprocess.run(
            [os.path.join(args.bin_dir, "fsdp-estimate"), "--n-layer", str(args.n_layer),
             "--n-head", str(args.n_head), "--d-model", str(args.d_model), "--block-size",
             str(args.block_size), "--world-size", str(args.world), "--json"],
            capture_output=True, text=True, check=True).stdout)
        psi = est["params"]
        given = 16 * psi // 3 // MIB
        limit = own + given
        print(f"nvme_params: LibTorch's own {own} MiB (runs: {[r['peak_mib'] for r in own_runs]}); "
              f"{psi} parameters, 16 x params = {16 * psi / MIB:.0f} MiB; limit {limit} MiB = own + "
              f"{given} MiB; 16 x params / given = {16 * psi / MIB / given:.2f}")
        layers = (args.n_layer, args.d_model, args.n_head)
        files = run(args, nvme_flags, limit, *layers)
        memory = run(args, mem_flags, 20480, *layers)
        deadline = max(60, int(3 * memory["seconds"]))
        killed = run(args, mem_flags, limit, *layers, expect_oom=True, deadline_s=deadline)
        failed = []
        for name, r in (("NVMe, limited", files), ("memory, unlimited", memory),
                        ("memory, limited", killed)):
            print(f"nvme_params: {name}: exit {r['exit']}, job peak {r['peak_mib']} MiB, rank peaks "
                  f"{r['rank_peaks_mib']} MiB, OOM kills {r['oom_kills']}, losses {r['losses']}, "
                  f"step s {[round(s, 2) for s in r['step_s']]}, {r['seconds']:.0f} s in all")
        print(f"nvme_params: the run that must not fit: {killed['tail'].splitlines()[-1]}")
        if files["rc"] != 0 or len(files["losses"]) != args.steps:
            failed.append(f"the NVMe run under the limit did not train {args.steps} steps:\n{files['tail']}")
        if memory["rc"] != 0 or len(memory["losses"]) != args.steps:
            failed.append(f"the run in memory did not train:\n{memory['tail']}")
        if files["params"] != psi:
            failed.append(f"train_gpt trained {files['params']} parameters, fsdp-estimate counts {psi}")
        if files["losses"] != memory["losses"]:
            failed.append(f"losses differ: NVMe {files['losses']} against memory {memory['losses']}")
        if killed["rc"] != 0:
            failed.append(f"the run without NVMe under the limit did fit, or failed otherwise "
                          f"(deadline {deadline} s):\n{killed['tail']}")
        if 16 * psi < 3 * given * MIB:
            failed.append("16 x params is less than 3 x the memory given beyond LibTorch's own")
        for f in failed:
            print(f"nvme_params: FAILED: {f}")
        if not failed:
            print(f"nvme_params: OK: {psi} parameters ({16 * psi / MIB:.0f} MiB of training state, "
                  f"{16 * psi / MIB / given:.2f}x the {given} MiB given) trained under {limit} MiB "
                  f"with NVMe, losses bit-identical to memory; without NVMe it did not fit")
        return 1 if failed else 0
    finally:
        if made:
            shutil.rmtree(nvme, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
