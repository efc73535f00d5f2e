#!/usr/bin/env python3
"""The largest GPT each memory mode trains under a memory budget, found by memory, not by
time: fsdp-estimate predicts the largest size for each mode, then at most three short
real runs around it, inside a memory cgroup of the budget, confirm it.

  max_model.py --bin-dir build/bin [--budget-mib 6144] [--world 2] [--d-model 512]
               [--n-head 8] [--block-size 64] [--steps 2] [--nvme-path DIR] [--runs 3]
               [--only NAME,NAME | --only "NAME|NAME"] [--json-out FILE]
  max_model.py --bin-dir build/bin --device cuda [--gpu-mib N] [--budget-mib HOST] ...
               (the GPU and its host: no cgroup, device and host budgets apart; a run
               too large ends with CUDA's out-of-memory error; --no-cgroup rehearses it on
               the CPU; scripts/gpu/gpu-check.sh's phase max_model)

Each mode is a train_gpt configuration (bf16 compute unless it says otherwise). For each:
  1. LibTorch's own memory: the job's peak for a one-block GPT of width 64 (the runtime,
     the launcher, the allocator's arenas), the smaller of two runs in the same cgroup
     setup (the first to read the libraries' pages is charged for them);
  2. the estimate: the largest --n-layer whose fsdp-estimate per-node total (device and
     host: on the CPU both are this machine's memory) plus LibTorch's own fits the budget;
  3. the runs: train_gpt --steps N at that size under the budget (tests/memlimit/
     construction.sh: a cgroup with memory.limit_in_bytes); if it trained, the largest
     size whose estimate, moved onto the peak it measured, fits (at least a block more);
     if it was killed, a twentieth of the blocks fewer; at most three runs.
It reports, per mode: the parameters reached, the physical bound (the budget less
LibTorch's own, over the mode's bytes per parameter on this machine: model states per
node from fsdp-estimate; for + offload_param=nvme, whose model states are all in files,
the free space of its disk, an ext4 file system of --disk-mib on a loop device, over their
bytes per parameter: a model whose files do not fit is refused there), their ratio, the estimate against the measured peak of the
largest run that trained, tokens/s and TFLOP/s (6N + 12 L d T per token) there. One JSON
line per mode and a table. Needs root and a memory controller (exit 77 otherwise).
"""
import argparse
import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CONSTRUCTION = os.path.join(HERE, "..", "memlimit", "construction.sh")
NVME = "@NVME@"

# name, train_gpt flags, fsdp-estimate flags (None: the mode cannot run here; the flags
# then show the refusal).
MODES = [
    ("plain (no sharding, fp32)", ["--sharding", "none"], ["--sharding", "none"]),
    ("ZeRO-3 bf16", ["--precision", "bf16"], ["--precision", "bf16"]),
    ("offload_optimizer=cpu", ["--precision", "bf16", "--offload-optimizer", "cpu"],
     ["--precision", "bf16", "--offload-optimizer", "cpu"]),
    ("+ offload_param=cpu",
     ["--precision", "bf16", "--offload-optimizer", "cpu", "--offload-param", "cpu"],
     ["--precision", "bf16", "--offload-optimizer", "cpu", "--offload-param", "cpu"]),
    ("pure bf16 + offload_optimizer=cpu",
     ["--precision", "bf16", "--master-dtype", "bf16", "--offload-optimizer", "cpu"],
     ["--precision", "bf16", "--master-dtype", "bf16", "--offload-optimizer", "cpu"]),
    ("offload_optimizer=nvme",
     ["--precision", "bf16", "--offload-optimizer", "nvme", "--nvme-path", NVME],
     ["--precision", "bf16", "--offload-optimizer", "nvme"]),
    ("+ offload_param=nvme",
     ["--precision", "bf16", "--offload-optimizer", "nvme", "--offload-param", "nvme",
      "--nvme-path", NVME],
     ["--precision", "bf16", "--offload-optimizer", "nvme", "--offload-param", "nvme"]),
]


def fp32_compute(flags):
    """The flags with bf16 compute turned into fp32 (--compute fp32)."""
    out = list(flags)
    for i in range(len(out) - 1):
        if out[i] == "--precision" and out[i + 1] == "bf16":
            out[i + 1] = "fp32"
    return out


def disk_bound(flags):
    """Whether the mode's model states all leave memory (offload_param=nvme): its bound is
    the disk, not the budget (Note [NVMe parameters])."""
    return "--offload-param" in flags and flags[flags.index("--offload-param") + 1] == "nvme"


class Disk:
    """A file system of `mib` MiB (ext4 in a file under /var/tmp, mounted through a loop
    device) for the disk-bound mode's files: its free space is the disk budget, and a model
    whose files do not fit is refused by the free-space check before training."""

    def __init__(self, mib):
        self.dir = tempfile.mkdtemp(prefix="fsdp_maxmodel_disk_", dir="/var/tmp")
        self.image = self.dir + ".img"
        self.mounted = False
        subprocess.run(["truncate", "-s", f"{mib}M", self.image], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", self.image], check=True,
                       capture_output=True)
        # The loop device reads and writes its image with O_DIRECT (--direct-io=on), as a
        # disk would: a buffered loop device keeps the image's pages in the page cache and
        # charges them to the cgroup of the job whose O_DIRECT I/O it serves (Linux 5.13+),
        # which a real disk does not.
        self.loop = None
        r = subprocess.run(["losetup", "--direct-io=on", "--find", "--show", self.image],
                           capture_output=True, text=True)
        if r.returncode != 0:
            self.close()
            raise RuntimeError(f"losetup --direct-io=on failed: {r.stderr.strip()}")
        self.loop = r.stdout.strip()
        r = subprocess.run(["mount", self.loop, self.dir], capture_output=True, text=True)
        if r.returncode != 0:
            self.close()
            raise RuntimeError(f"mount {self.loop} failed: {r.stderr.strip()}")
        self.mounted = True
        st = os.statvfs(self.dir)
        self.available = st.f_bavail * st.f_frsize

    def close(self):
        if self.mounted:
            subprocess.run(["umount", self.dir], check=False)
            self.mounted = False
        if self.loop:
            subprocess.run(["losetup", "--detach", self.loop], check=False)
            self.loop = None
        if os.path.isdir(self.dir):
            os.rmdir(self.dir)
        if os.path.exists(self.image):
            os.unlink(self.image)


def estimate(args, layers, est_flags):
    cmd = [os.path.join(args.bin_dir, "fsdp-estimate"), "--n-layer", str(layers), "--n-head",
           str(args.n_head), "--d-model", str(args.d_model), "--block-size", str(args.block_size),
           "--world-size", str(args.world), "--micro-batch", "1", "--json"] + est_flags
    r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    node = r["per_node"]
    return {"params": r["params"], "total": node["device_total_bytes"] + node["host_total_bytes"],
            "states": node["model_states_device_bytes"] + node["model_states_host_bytes"],
            "device": node["device_total_bytes"], "host": node["host_total_bytes"],
            "device_states": node["model_states_device_bytes"],
            "host_states": node["model_states_host_bytes"],
            "nvme": node.get("nvme_total_bytes", 0)}


def run(args, layers, flags, limit_mib, d_model=None, n_head=None):
    with tempfile.TemporaryDirectory(prefix="fsdp_maxmodel_") as tmp:
        log = os.path.join(tmp, "log.jsonl")
        nvme = os.path.join(tmp, "nvme") if not args.nvme_path else args.nvme_path
        if disk_bound(flags) and args.disk is not None:
            nvme = args.disk.dir
        os.makedirs(nvme, exist_ok=True)
        train = [a.replace(NVME, nvme) for a in flags] + [
            "--n-layer", str(layers), "--d-model", str(d_model or args.d_model), "--n-head",
            str(n_head or args.n_head), "--block-size", str(args.block_size), "--batch-size",
            str(args.world), "--steps", str(args.steps), "--warmup-steps", "0", "--lr", "1e-4",
            "--log-jsonl", log, "--device", args.device]
        if args.split:
            return run_split(args, layers, train, log)
        # A run too large for the budget may thrash instead of being killed (its code pages
        # read back from disk): construction.sh ends it at the deadline and counts it as
        # not fitting only if it reached the limit.
        cmd = ["bash", CONSTRUCTION, "--deadline-s", str(args.deadline_s), args.bin_dir, str(limit_mib),
               "sharded", str(args.world)] + train
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        out = p.stdout + p.stderr
        if p.returncode == 77:
            print(out)
            sys.exit(77)
        m = re.search(r"exit (\d+), job peak (\d+) MiB, OOM kills ([^,\s]+)", out)
        rows = [json.loads(l) for l in open(log)] if os.path.exists(log) else []
        res = {"layers": layers, "exit": p.returncode, "peak_mib": int(m.group(2)) if m else None,
               "oom_kills": m.group(3) if m else None, "trained": p.returncode == 0 and len(rows) == args.steps,
               "tokens_per_s": rows[-1]["tokens_per_s"] if rows else None}
        return finish(res, out)


def finish(res, out):
    """The error or the tail of a run that did not train, and the parameters it built."""
    if not res["trained"]:
        res["tail"] = "\n".join(out.strip().splitlines()[-4:])
        errors = [l for l in out.splitlines() if ": error: " in l]
        if errors:
            res["error"] = errors[0][errors[0].index(": error: ") + 9:]
    params = re.search(r"train_gpt: (\d+) parameters", out)
    res["params"] = int(params.group(1)) if params else None
    return res


def run_split(args, layers, train, log):
    """A run without a memory cgroup (--device cuda, or --no-cgroup): the device (the GPU,
    whose memory is the limit that ends a run too large, with CUDA's out-of-memory error)
    and the host apart. The peak is rank 0's device memory (the caching allocator's
    reserved bytes) times the ranks, plus every rank's peak RSS (fsdp-run --peak-rss-json)."""
    rss = log + ".rss"
    cmd = [os.path.join(args.bin_dir, "fsdp-run"), "--nproc", str(args.world), "--peak-rss-json",
           rss, "--", os.path.join(args.bin_dir, "train_gpt"), "--construction", "sharded"] + train
    # In a session of its own, so that a run past --timeout goes with its ranks: on a GPU a
    # rank left behind would hold its memory through the next run.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=args.timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        rc = 124
    rows = [json.loads(l) for l in open(log)] if os.path.exists(log) else []
    host = [int(x) // 1024 for x in re.findall(r"\d+", open(rss).read())] if os.path.exists(rss) else []
    dev = re.search(r"peak GPU memory of rank 0: (\d+) MiB allocated, (\d+) MiB reserved", out)
    device_mib = int(dev.group(2)) * args.world if dev else 0
    res = {"layers": layers, "exit": rc, "trained": rc == 0 and len(rows) == args.steps,
           "oom_kills": "cuda" if "out of memory" in out.lower() else "0",
           "device_peak_mib": device_mib, "host_peak_mib": sum(host),
           "peak_mib": device_mib + sum(host) if host else None,
           "tokens_per_s": rows[-1]["tokens_per_s"] if rows else None}
    return finish(res, out)


def search(args, predicted, flags, corrected=None):
    """At most --runs real runs around the predicted block count.

    With corrected (the cgroup runs): corrected(n, offset) says whether n blocks fit when
    the estimate is moved by offset bytes. A run that trained measured its peak, so the
    next size is the largest that fits the estimate moved onto that peak (at least one
    block more, to find the edge); a run that was killed measured nothing, so the next is
    a twentieth of the blocks fewer (at least one). The estimate then resolves the edge to
    a block, where steps of a fixed fraction resolve only to that fraction.
    Without it (the GPU's runs, whose peaks are per memory): steps of a tenth of the
    prediction (at least one block), and the third run halves the bracket."""
    runs = [run(args, predicted, flags, args.budget_mib)]
    step = max(1, predicted // 10) * (1 if runs[0]["trained"] else -1)
    layers = predicted
    while len(runs) < args.runs:
        ok = [r for r in runs if r["trained"]]
        killed = [r["layers"] for r in runs if not r["trained"]]
        hi = min(killed) if killed else None
        if corrected is not None and ok:
            lo = max(ok, key=lambda r: r["layers"])
            layers = lo["layers"] + 1
            if lo.get("peak_mib"):
                offset = lo["peak_mib"] * 1048576 - corrected(lo["layers"], None)
                n = layers
                while (hi is None or n + 1 < hi) and corrected(n + 1, offset):
                    n += 1
                layers = max(layers, n)
            if hi is not None and layers >= hi:
                break
        elif corrected is not None:
            layers = min(killed) - max(1, -(-min(killed) // 20))
        elif ok and killed:
            lo = max(r["layers"] for r in ok)
            if hi - lo <= 1:
                break
            layers = (lo + hi) // 2
        else:
            layers += step
        if layers < 1 or any(r["layers"] == layers for r in runs):
            break
        runs.append(run(args, layers, flags, args.budget_mib))
    return runs


def largest(args, fits):
    """The largest block count whose estimate fits (the totals grow with the blocks)."""
    lo, hi = 0, args.max_layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def main_split(args, only):
    """Device and host budgets apart, no cgroup: --device cuda (the GPU phase), or its
    rehearsal on the CPU (--no-cgroup, where device and host are one memory)."""
    cuda = args.device == "cuda"
    host_mib = args.budget_mib or int(mem_available_mib() * 0.9)
    dev_mib = (args.gpu_mib or gpu_total_mib() - 1024) if cuda else 0
    base = run(args, 1, [], host_mib, d_model=64, n_head=4)
    if not base["trained"]:
        sys.exit(f"max_model.py: the baseline run failed:\n{base.get('tail')}")
    own = base["host_peak_mib"] if cuda else base["peak_mib"]
    print(f"max model ({args.device}, no cgroup): " +
          (f"device {dev_mib} MiB per rank, host {host_mib} MiB less LibTorch's own {own} MiB"
           if cuda else f"budget {host_mib} MiB less LibTorch's own {own} MiB (not enforced)") +
          f"; world {args.world}; GPT d_model {args.d_model}, {args.n_head} heads, T "
          f"{args.block_size}, {args.steps} steps per run, at most {args.runs} runs per mode", flush=True)
    host_bytes = (host_mib - own) * 1048576
    dev_bytes = dev_mib * 1048576 * args.world
    results = []
    for name, flags, est_flags in MODES:
        if (only and name not in only) or est_flags is None:
            continue
        nvme_dir = args.nvme_path or tempfile.gettempdir()
        disk = shutil.disk_usage(nvme_dir).free if "--nvme-path" in flags else 0

        def fits(layers):
            e = estimate(args, layers, est_flags)
            if disk and e["nvme"] > disk:
                return False
            if cuda:
                return e["device"] <= dev_bytes and e["host"] <= host_bytes
            return e["total"] <= host_bytes

        predicted = largest(args, fits)
        out = {"metric": "max_model", "device": args.device, "mode": name, "flags": " ".join(flags),
               "predicted_layers": predicted}
        if predicted < 1:
            out["error"] = "not even one block fits the estimate"
            print(json.dumps(out), flush=True)
            results.append(out)
            continue
        runs = search(args, predicted, flags)
        out["runs"] = [{k: r.get(k) for k in ("layers", "exit", "trained", "device_peak_mib",
                                              "host_peak_mib", "oom_kills")} for r in runs]
        trained = [r for r in runs if r["trained"]]
        if not trained:
            out["error"] = "no run trained; the last: " + (runs[-1].get("tail") or "")
            print(json.dumps(out), flush=True)
            results.append(out)
            continue
        best = max(trained, key=lambda r: r["layers"])
        e = estimate(args, best["layers"], est_flags)
        p = e["params"]
        bounds = []  # what each memory holds of the model states, over its bytes per parameter
        if cuda and e["device_states"]:
            bounds.append(("device", dev_bytes / (e["device_states"] / p)))
        if cuda and e["host_states"]:
            bounds.append(("host", host_bytes / (e["host_states"] / p)))
        if not cuda:
            bounds.append(("memory", host_bytes / (e["states"] / p)))
        if disk and e["nvme"]:
            bounds.append(("disk", disk / (e["nvme"] / p)))
        by, bound = min(bounds, key=lambda b: b[1])
        est_mib = e["total"] / 1048576 + own
        flops = 6.0 * p + 12.0 * best["layers"] * args.d_model * args.block_size
        out.update({"layers": best["layers"], "params": p, "bound_by": by, "bound_params": int(bound),
                    "ratio_to_bound": round(p / bound, 4),
                    "estimated_device_mib": round(e["device"] / 1048576, 1),
                    "measured_device_mib": best["device_peak_mib"],
                    "estimated_peak_mib": round(est_mib, 1), "measured_peak_mib": best["peak_mib"],
                    "estimate_error": round(est_mib / best["peak_mib"] - 1, 4) if best["peak_mib"] else None,
                    "tokens_per_s": best["tokens_per_s"],
                    "tflops": best["tokens_per_s"] * flops / 1e12 if best["tokens_per_s"] else None})
        print(json.dumps(out), flush=True)
        results.append(out)
    print(f"\n| mode | parameters reached | bound (by) | ratio | estimate / measured peak (MiB) | device estimate / measured (MiB) | tokens/s | runs (blocks: trained?) |")
    print("|---|---|---|---|---|---|---|---|")
    for o in results:
        if "params" not in o:
            print(f"| {o['mode']} | {o.get('error')} | | | | | | |")
            continue
        runs = ", ".join(f"{r['layers']}: {'yes' if r['trained'] else 'oom' if r['oom_kills'] == 'cuda' else 'exit %d' % r['exit']}" for r in o["runs"])
        err = f" ({o['estimate_error']:+.1%})" if o["estimate_error"] is not None else ""
        print(f"| {o['mode']} | {o['params'] / 1e6:.1f}M ({o['layers']} blocks) | {o['bound_params'] / 1e6:.1f}M "
              f"({o['bound_by']}) | {o['ratio_to_bound']:.3f} | {o['estimated_peak_mib']:.0f} / "
              f"{o['measured_peak_mib']}{err} | {o['estimated_device_mib']:.0f} / {o['measured_device_mib']} | "
              f"{(o['tokens_per_s'] or 0):.0f} | {runs} |")
    plain = [o for o in results if o["mode"].startswith("plain") and "params" in o]
    for o in results:
        if plain and "params" in o and o is not plain[0]:
            print(f"max model: {o['mode']}: {o['params'] / plain[0]['params']:.2f}x plain's parameters")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": args.device, "host_budget_mib": host_mib, "device_budget_mib": dev_mib,
                       "world": args.world, "libtorch_own_mib": own, "modes": results}, f, indent=2)
    bad = [o for o in results if "params" not in o]
    return 1 if bad else 0


def gpu_total_mib():
    r = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                        "-i", "0"], capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        sys.exit("max_model.py: --device cuda needs nvidia-smi for the GPU's memory, or --gpu-mib")
    return int(r.stdout.split()[0])


def mem_available_mib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    sys.exit("max_model.py: no MemAvailable in /proc/meminfo; give --budget-mib")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--budget-mib", type=int, default=None,
                    help="the job's memory (default 6144; --device cuda: the host's, default 90%% of MemAvailable)")
    ap.add_argument("--world", type=int, default=2)
    # Width 512: a block is 1.7% of plain's bound in 6 GiB, so the edge resolves finely.
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-layers", type=int, default=512)
    ap.add_argument("--nvme-path", default="", help="a directory for the NVMe modes (default: a temporary one)")
    ap.add_argument("--disk-mib", type=int, default=8192,
                    help="the disk of the mode whose model states all go to files (offload_param=nvme): "
                         "an ext4 file system of this size on a loop device")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--deadline-s", type=int, default=600,
                    help="a run in the memory cgroup still going after this long is ended: it did "
                         "not fit if it reached the limit, else it failed (tests/memlimit/construction.sh)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the budget is the GPU's memory and the host's, apart, and the "
                         "runs need no cgroup (scripts/gpu/gpu-check.sh's phase max_model)")
    ap.add_argument("--no-cgroup", action="store_true",
                    help="on the CPU, run as on a GPU: no cgroup, device and host budgets apart "
                         "(the GPU phase's rehearsal; a run is not stopped by the budget)")
    ap.add_argument("--gpu-mib", type=int, default=0,
                    help="--device cuda: the device budget (default: the GPU's memory less 1024 "
                         "MiB for the CUDA context and libraries, from nvidia-smi)")
    ap.add_argument("--runs", type=int, default=3, help="real runs per mode, at most (1-3)")
    ap.add_argument("--only", default="")
    ap.add_argument("--compute", default="bf16", choices=["bf16", "fp32"],
                    help="fp32: the modes that compute in bf16 compute in fp32 instead (the same "
                         "model states; the gathers and activations twice the bytes), for a CPU "
                         "without native bf16, which emulates bf16 matmuls 10 to 50 times slower; "
                         "the pure bf16 mode is then skipped")
    ap.add_argument("--json-out", default="")
    ap.add_argument("--expect-within", type=float, default=0.0,
                    help="exit 1 unless every mode that can run trained at some size and the "
                         "estimate is within this fraction of its measured peak (e.g. 0.15)")
    args = ap.parse_args()
    args.disk = None
    args.split = args.device == "cuda" or args.no_cgroup
    if not 1 <= args.runs <= 3:
        ap.error(f"--runs {args.runs}: give 1, 2 or 3")
    # Names are separated by "|" (a name may hold a comma), or by commas where no "|" is.
    only = {s.strip() for s in args.only.split("|" if "|" in args.only else ",") if s.strip()}
    unknown = only - {m[0] for m in MODES}
    if unknown:
        sys.exit(f"max_model.py: --only {sorted(unknown)} unknown; the modes are {[m[0] for m in MODES]}")
    if args.compute == "fp32":
        MODES[:] = [(name, fp32_compute(flags), fp32_compute(est) if est is not None else None)
                    for name, flags, est in MODES if "--master-dtype" not in flags]
        print("max model: --compute fp32: the bf16 modes compute in fp32; pure bf16 skipped", flush=True)
    if args.split:
        return main_split(args, only)
    args.budget_mib = args.budget_mib or 6144
    atexit.register(lambda: args.disk.close() if args.disk is not None else None)
    if args.disk_mib < 64:
        ap.error(f"--disk-mib {args.disk_mib} is too small; give the disk-bound mode at least 64 MiB")
    # Twice, and the smaller: the cgroup charges a job for the library pages it is the
    # first to read, and the later runs find them cached (charged elsewhere) as the
    # second baseline run does.
    own = None
    for _ in range(2):
        base = run(args, 1, [], args.budget_mib, d_model=64, n_head=4)
        if not base["trained"] or not base["peak_mib"]:
            sys.exit(f"max_model.py: the baseline run failed under {args.budget_mib} MiB:\n{base.get('tail')}")
        own = base["peak_mib"] if own is None else min(own, base["peak_mib"])
    usable = args.budget_mib - own
    print(f"max model: budget {args.budget_mib} MiB at world {args.world}; LibTorch's own "
          f"(a one-block GPT of width 64): {own} MiB, so {usable} MiB for the model; GPT "
          f"d_model {args.d_model}, {args.n_head} heads, T {args.block_size}, batch "
          f"{args.world}x{args.block_size}, {args.steps} steps per run", flush=True)
    results = []
    for name, flags, est_flags in MODES:
        if only and name not in only:
            continue
        if est_flags is None:
            r = run(args, 1, flags, args.budget_mib)
            out = {"metric": "max_model", "mode": name, "flags": " ".join(flags),
                   "refused": r.get("error") or ("trained" if r["trained"] else r.get("tail"))}
            print(json.dumps(out), flush=True)
            results.append(out)
            continue
        # The disk-bound mode gets its disk (Disk) for its runs.
        if args.disk is not None:
            args.disk.close()
            args.disk = None
        disk = 0
        if disk_bound(flags):
            try:
                args.disk = Disk(args.disk_mib)
            except (RuntimeError, subprocess.CalledProcessError) as e:
                out = {"metric": "max_model", "mode": name, "error": f"no disk of {args.disk_mib} MiB: {e}"}
                print(json.dumps(out), flush=True)
                results.append(out)
                continue
            disk = args.disk.available
        # 2. the estimate: the largest block count that fits (the totals grow with it), in
        # memory and, for the disk-bound mode, on its disk.
        budget = args.budget_mib * 1048576 - own * 1048576

        def fits(e):
            return e["total"] <= budget and (not disk or e["nvme"] <= disk)

        predicted = largest(args, lambda n: fits(estimate(args, n, est_flags)))

        def corrected(n, offset):
            """With offset None: the estimated job peak of n blocks, in bytes. Otherwise
            whether n blocks fit with the estimate moved by offset (a measured peak less
            the estimate there)."""
            e = estimate(args, n, est_flags)
            if offset is None:
                return e["total"] + own * 1048576
            return e["total"] + offset <= budget and (not disk or e["nvme"] <= disk)

        if predicted < 1:
            out = {"metric": "max_model", "mode": name, "error": "not even one block fits the estimate"}
            print(json.dumps(out), flush=True)
            results.append(out)
            continue
        runs = search(args, predicted, flags, corrected)
        trained = [r for r in runs if r["trained"]]
        best = max(trained, key=lambda r: r["layers"]) if trained else None
        out = {"metric": "max_model", "mode": name, "flags": " ".join(flags),
               "predicted_layers": predicted,
               "runs": [{k: r[k] for k in ("layers", "exit", "peak_mib", "oom_kills", "trained")} for r in runs]}
        if best:
            e = estimate(args, best["layers"], est_flags)
            per_param = e["states"] / e["params"]
            bound = usable * 1048576 / per_param
            if disk:  # the model states are on the disk: its free space over their bytes
                per_param = e["nvme"] / e["params"]
                bound = disk / per_param
            flops = 6.0 * e["params"] + 12.0 * best["layers"] * args.d_model * args.block_size
            out.update({"layers": best["layers"], "params": e["params"],
                        "bytes_per_param_node": round(per_param, 3),
                        "bound_params": int(bound), "ratio_to_bound": round(e["params"] / bound, 4),
                        "estimated_peak_mib": round(e["total"] / 1048576 + own, 1),
                        "measured_peak_mib": best["peak_mib"],
                        "estimate_error": round((e["total"] / 1048576 + own) / best["peak_mib"] - 1, 4),
                        "nvme_mib": round(e["nvme"] / 1048576, 1),
                        "bound_by": f"disk ({disk / 1048576:.0f} MiB free)" if disk else "memory",
                        "tokens_per_s": best["tokens_per_s"],
                        "tflops": best["tokens_per_s"] * flops / 1e12 if best["tokens_per_s"] else None})
        else:
            out["error"] = "no run trained; the last: " + (runs[-1].get("tail") or "")
        print(json.dumps(out), flush=True)
        results.append(out)
    if args.disk is not None:
        args.disk.close()
    print(f"\n| mode | parameters reached | physical bound (bytes/param) | ratio | estimate / measured peak (MiB) | tokens/s | TFLOP/s | runs (blocks: trained?) |")
    print("|---|---|---|---|---|---|---|---|")
    for o in results:
        if "refused" in o:
            print(f"| {o['mode']} | refused: {o['refused']} | | | | | | |")
        elif "params" in o:
            runs = ", ".join(f"{r['layers']}: {'yes' if r['trained'] else 'killed' if r['exit'] == 137 else 'exit %d' % r['exit']}" for r in o["runs"])
            print(f"| {o['mode']} | {o['params'] / 1e6:.1f}M ({o['layers']} blocks) | "
                  f"{o['bound_params'] / 1e6:.1f}M ({o['bytes_per_param_node']}, {o['bound_by']}) | {o['ratio_to_bound']:.3f} | "
                  f"{o['estimated_peak_mib']:.0f} / {o['measured_peak_mib']} ({o['estimate_error']:+.1%}) | "
                  f"{o['tokens_per_s']:.0f} | {o['tflops']:.4f} | {runs} |")
        else:
            print(f"| {o['mode']} | {o.get('error')} | | | | | | |")
    failed = []
    if args.expect_within > 0:
        for o in results:
            if "refused" in o:
                continue
            if "params" not in o:
                failed.append(f"{o['mode']}: {o.get('error')}")
            elif abs(o["estimate_error"]) > args.expect_within:
                failed.append(f"{o['mode']}: the estimate is {o['estimate_error']:+.1%} off the measured peak")
        for f in failed:
            print("max_model.py: FAIL " + f)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"budget_mib": args.budget_mib, "world": args.world, "libtorch_own_mib": own,
                       "modes": results}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
