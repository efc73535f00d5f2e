#!/usr/bin/python3
"""train_gpt against its anchors, PyTorch FSDP1, PyTorch FSDP2 and DeepSpeed ZeRO-3
(tests/interop/fsdp_gpt.py --impl fsdp1|fsdp2|deepspeed): same weights, same batches,
same schedule; losses compared at every step, final weights compared, step time, peak
RSS and bytes communicated per rank per step measured in the same run.

  compare_fsdp.py parity --bin-dir build/bin [--impl fsdp1|fsdp2|deepspeed]
                                                  # the ctest cases (exit 0/1; 77: skipped)
  compare_fsdp.py bench --bin-dir build/bin [--quick] [--results FILE] [--out DIR]
                        [--impls cpp,fsdp2,fsdp1,deepspeed] [--hosts NS:IF:ADDR,NS:IF:ADDR]
  compare_fsdp.py plot RUNS.json OUTDIR                     # pictures from a bench run

Both sides run under fsdp-run (one process per rank, the torchrun environment, the same
OMP_NUM_THREADS per rank). A run's peak RSS is the largest rank's ru_maxrss, which
fsdp-run --peak-rss-json collects with wait4 on each rank. (Not os.wait4 on fsdp-run: the
kernel carries a process's maximum RSS across exec, so fsdp-run's own figure starts at
this driver's, ~330 MiB once torch is imported, and hid every rank below it.) Step time is what each side logs per step
(train_gpt: batch, forward, backward, clip, AdamW, loss all-reduce; fsdp_gpt.py the same,
its batches made before training); warm-up steps are left out and the median is taken.
Bytes per rank per step: train_gpt's comm_bytes (CommStats::total_bytes()), and for the
anchors fsdp_gpt.py's count at the torch.distributed functions, by the same convention
(see CommCounter there); the median over the post-warm-up steps, rank 0's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "fsdp_gpt.py")
SKIP = 77  # ctest's SKIP_RETURN_CODE

FP32_TOL = 1e-5
BF16_TOL = 2e-2


def probe(impl="fsdp1"):
    """Why the anchor cannot run here, or None. Tried, not guessed from versions (except
    FSDP2 on the CPU, whose import works on torch 2.6 but whose first step does not)."""
    try:
        import h5py  # noqa: F401
        import torch
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_gloo_available():
            return "torch.distributed with Gloo is not available"
        if impl == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401
        elif impl == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
            version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
            if version < (2, 7):
                # torch 2.6's FSDP2 records an event on its all-gather stream, which the
                # CPU's stream lacks ("'Stream' object has no attribute 'record_event'").
                return f"FSDP2 on the CPU needs torch 2.7 or later; this is torch {torch.__version__}"
        elif impl == "deepspeed":
            import importlib.util

            if importlib.util.find_spec("deepspeed") is None:
                return ("deepspeed is not installed (scripts/requirements.txt pins it; "
                        "DS_BUILD_OPS=0 pip install deepspeed==0.19.8)")
    except Exception as e:  # a Python without torch, or a torch without FSDP
        return f"{type(e).__name__}: {e}"
    return None


ANCHORS = ("fsdp2", "fsdp1", "deepspeed")
NAMES = {"cpp": "fsdp-libtorch", "fsdp1": "PyTorch FSDP1", "fsdp2": "PyTorch FSDP2", "deepspeed": "DeepSpeed ZeRO-3",
         "pytorch": "PyTorch FSDP1"}


def run_tree(cmd, env, log_path, timeout):
    """Runs cmd; returns (exit code, output, ru_maxrss of cmd's process tree in KiB: not a
    rank's peak when cmd is fsdp-run, see the module's doc)."""
    with open(log_path, "w") as out:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.time() > deadline:
                p.kill()
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)
    with open(log_path) as f:
        return p.returncode, f.read(), ru.ru_maxrss


def read_jsonl(path):
    steps, final = [], {}
    with open(path) as f:
        for line in f:
            if line.strip():
                j = json.loads(line)
                if j.get("final"):
                    final = j
                else:
                    steps.append(j)
    return steps, final


def model_args(m):
    return ["--n-layer", str(m["n_layer"]), "--n-head", str(m["n_head"]), "--d-model", str(m["d_model"]),
            "--block-size", str(m["block_size"]), "--batch-size", str(m["batch_size"]), "--steps", str(m["steps"]),
            "--seed", str(m["seed"]), "--warmup-steps", str(m["warmup"]), "--lr", str(m["lr"])]


class Runner:
    def __init__(self, bin_dir, work, verbose=True, hosts=()):
        self.bin_dir, self.work, self.verbose, self.hosts = bin_dir, work, verbose, list(hosts)
        self.port = 29750
        self.retry = verbose  # the benchmark retries a failed run once; the test does not
        self.inits = {}
        for tool in ("train_gpt", "fsdp-run"):
            if not os.access(os.path.join(bin_dir, tool), os.X_OK):
                sys.exit(f"compare_fsdp.py: {bin_dir}/{tool} is missing; build it first (cmake --build ... --target {tool})")

    def init_file(self, m):
        key = (m["n_layer"], m["n_head"], m["d_model"], m["block_size"], m["seed"])
        if key not in self.inits:
            path = os.path.join(self.work, "init_%d_%d_%d_%d_%d.h5" % key)
            cmd = [sys.executable, TRAINER, "--write-init", path] + model_args(m)
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if r.returncode:
                raise RuntimeError("writing the initial weights failed:\n" + r.stdout)
            self.inits[key] = path
        return self.inits[key]

    def run(self, impl, m, world, precision, threads, tag, extra=()):
        """One training run; returns {"losses", "step_s", "rss_kb", "weights", "comm_bytes",
        "comm_calls"}. impl: cpp (train_gpt) or an anchor (fsdp1, fsdp2, deepspeed; pytorch =
        fsdp1). With hosts (Runner.hosts), world 2 x len(hosts) runs 2 ranks a host."""
        impl = "fsdp1" if impl == "pytorch" else impl
        init = self.init_file(m)
        log = os.path.join(self.work, f"{tag}_{impl}.jsonl")
        weights = os.path.join(self.work, f"{tag}_{impl}.h5")
        common = model_args(m) + ["--precision", precision, "--init-from", init, "--log-jsonl", log]
        if impl == "cpp":
            # The anchors decay every parameter (fsdp_gpt.py): so does train_gpt here.
            prog = [os.path.join(self.bin_dir, "train_gpt")] + common + ["--no-decay-recipe", "none",
                                                                          "--consolidate-to", weights,
                                                                          "--log-every", str(m["steps"])]
        else:
            prog = [sys.executable, TRAINER] + common + ["--impl", impl, "--full-state-to", weights]
        prog += list(extra)
        rss_json = os.path.join(self.work, f"{tag}_{impl}.rss.json")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), USE_LIBUV="0", DS_ACCELERATOR="cpu")
        out_path = os.path.join(self.work, f"{tag}_{impl}.out")
        t0 = time.time()
        multi = bool(self.hosts) and world == 2 * len(self.hosts)
        go = (lambda: self.run_hosts(prog, world, env, rss_json, out_path)) if multi else (
            lambda: run_tree([os.path.join(self.bin_dir, "fsdp-run"), "--nproc", str(world), "--peak-rss-json",
                              rss_json, "--"] + prog, env, out_path, timeout=600))
        rc, out, _ = go()
        if rc and self.retry:  # e.g. an abort at teardown: once more
            print(f"  {tag} {impl} failed (exit {rc}); running it again", flush=True)
            rc, out, _ = go()
        if rc:
            raise RuntimeError(f"{impl} run {tag} failed (exit {rc}): {' '.join(prog)}\n{out[-4000:]}")
        with open(rss_json) as f:
            rss = max(json.load(f)["peak_rss_kb"])
        steps, _ = read_jsonl(log)
        if len(steps) != m["steps"]:
            raise RuntimeError(f"{impl} run {tag}: {len(steps)} steps logged, expected {m['steps']}\n{out[-2000:]}")
        kept = steps[m["warmup_skip"]:] or steps
        res = {"losses": [s["loss"] for s in steps], "step_s": [s["step_s"] for s in steps], "rss_kb": rss,
               "weights": weights, "comm_bytes": statistics.median(s.get("comm_bytes", 0) for s in kept),
               "comm_calls": steps[-1].get("comm_calls", {})}
        if self.verbose:
            print(f"  {tag:<24} {impl:<9} {time.time() - t0:6.1f} s wall, "
                  f"median step {statistics.median(s['step_s'] for s in kept) * 1e3:8.1f} ms, "
                  f"peak RSS {rss / 1024:7.1f} MiB, {res['comm_bytes'] / 1e6:8.3f} MB/step "
                  f"{json.dumps(res['comm_calls']) if res['comm_calls'] else ''}", flush=True)
        return res

    def run_hosts(self, prog, world, env, rss_json, out_path):
        """World 2 x len(hosts) over the namespace hosts (scripts/bench/compare-pytorch.sh
        --link): ranks 2h and 2h+1 on host h, the rendezvous on host 0's address, Gloo on
        each host's end of the link. Each rank under its own fsdp-run --nproc 1 (whose
        variables env then overrides) for its peak RSS (see the module's doc)."""
        self.port += 1
        procs, rss_files = [], []
        for r in range(world):
            ns, ifname, _ = self.hosts[r // 2]
            f = f"{rss_json}.{r}"
            rss_files.append(f)
            cmd = ["ip", "netns", "exec", ns, os.path.join(self.bin_dir, "fsdp-run"), "--nproc", "1",
                   "--peak-rss-json", f, "--", "env", f"RANK={r}", f"WORLD_SIZE={world}", f"LOCAL_RANK={r % 2}",
                   "LOCAL_WORLD_SIZE=2", f"GROUP_RANK={r // 2}", f"MASTER_ADDR={self.hosts[0][2]}",
                   f"MASTER_PORT={self.port}", f"GLOO_SOCKET_IFNAME={ifname}"] + prog
            out = open(f"{out_path}.{r}", "w")
            procs.append((subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT), out))
        deadline, rc = time.time() + 900, 0
        for p, out in procs:
            try:
                code = p.wait(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                for q, _ in procs:
                    q.kill()
                code = p.wait()
            out.close()
            rc = rc or code
        text = ""
        for r in range(world):
            with open(f"{out_path}.{r}") as f:
                text += f"--- rank {r}\n" + f.read()[-3000:]
        if not rc:
            every = []
            for f in rss_files:
                with open(f) as fh:
                    every += json.load(fh)["peak_rss_kb"]
            with open(rss_json, "w") as fh:
                json.dump({"peak_rss_kb": every}, fh)
        return rc, text, 0

    def io_run(self, impl, m, world, tag, phase, ckpt, export):
        """A checkpoint run (fp32): phase "save" trains m["steps"] steps, then saves model and
        optimizer sharded (train_gpt --save-dir / DCP FileSystemWriter) and exports the
        full weights (--consolidate-to / FULL_STATE_DICT + torch.save); phase "load"
        builds the model and optimizer afresh and loads that checkpoint (--resume / DCP
        FileSystemReader), after its files were evicted from the page cache. Returns the
        events of --io-log: {"save": s, "export": s} or {"load": s}."""
        init = self.init_file(m)
        io_log = os.path.join(self.work, f"{tag}_{impl}_{phase}.io.jsonl")
        if os.path.exists(io_log):
            os.remove(io_log)
        common = model_args(m) + ["--precision", "fp32", "--init-from", init, "--io-log", io_log,
                                  "--log-jsonl", os.path.join(self.work, f"{tag}_{impl}_{phase}.jsonl")]
        if impl == "cpp":
            prog = [os.path.join(self.bin_dir, "train_gpt")] + common + ["--no-decay-recipe", "none",
                                                                          "--save-dir", ckpt, "--keep", "1"]
            prog += ["--consolidate-to", export] if phase == "save" else ["--resume"]
        else:
            prog = [sys.executable, TRAINER] + common
            prog += ["--dcp-save", ckpt, "--torch-save-to", export] if phase == "save" else ["--dcp-load", ckpt,
                                                                                             "--steps", "0"]
        if phase == "load":
            evict(ckpt)
        cmd = [os.path.join(self.bin_dir, "fsdp-run"), "--nproc", str(world), "--"] + prog
        env = dict(os.environ, OMP_NUM_THREADS="1", USE_LIBUV="0")
        rc, out, _ = run_tree(cmd, env, os.path.join(self.work, f"{tag}_{impl}_{phase}.out"), timeout=900)
        if rc:
            raise RuntimeError(f"{impl} {phase} run {tag} failed (exit {rc}): {' '.join(cmd)}\n{out[-4000:]}")
        events = {}
        with open(io_log) as f:
            for line in f:
                j = json.loads(line)
                events[j["event"]] = j["seconds"]
        want = {"save", "export"} if phase == "save" else {"load"}
        if set(events) != want:
            raise RuntimeError(f"{impl} {phase} run {tag}: --io-log has {sorted(events)}, expected {sorted(want)}")
        return events


def evict(path):
    """Drops a checkpoint's files from the page cache (they are fsynced, so their pages are
    clean and POSIX_FADV_DONTNEED frees them): the next read comes from the disk, cold."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_io(ckpt, scratch):
    """The disk's own speed for a checkpoint's bytes, as its ranks would move them: one
    thread per rank file (os.write/os.read release the GIL), 64 MiB calls. Write: fresh
    files of the same sizes, each fsynced; read: the checkpoint's files, evicted first.
    Returns (write seconds, read seconds)."""
    import threading

    files = sorted(os.path.join(r, n) for r, _, fs in os.walk(ckpt) for n in fs if n.endswith((".h5", ".distcp")))
    chunk = bytes(64 << 20)
    os.makedirs(scratch, exist_ok=True)

    def write(i, n):
        fd = os.open(os.path.join(scratch, f"raw_{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while n > 0:
                n -= os.write(fd, memoryview(chunk)[:min(n, len(chunk))])
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.read(fd, 64 << 20):
                pass
        finally:
            os.close(fd)

    def timed(jobs):
        threads = [threading.Thread(target=f, args=a) for f, a in jobs]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t

    w = timed([(write, (i, os.path.getsize(f))) for i, f in enumerate(files)])
    import shutil

    shutil.rmtree(scratch)
    evict(ckpt)
    r = timed([(read, (f,)) for f in files])
    return w, r


def tree_bytes(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, fs in os.walk(path) for n in fs)


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def weight_diff(path_a, path_b):
    import h5py
    import numpy as np

    with h5py.File(path_a, "r") as fa, h5py.File(path_b, "r") as fb:
        na, nb = set(fa["model"].keys()), set(fb["model"].keys())
        if na != nb:
            raise RuntimeError(f"parameter names differ: {sorted(na ^ nb)}")
        worst = 0.0
        for n in na:
            a = fa["model"][n][()].astype(np.float64)
            b = fb["model"][n][()].astype(np.float64)
            if a.shape != b.shape:
                raise RuntimeError(f"{n}: shape {a.shape} vs {b.shape}")
            worst = max(worst, float(np.abs(a - b).max()))
        return worst


# ---- parity (the ctest case) --------------------------------------------------------

PARITY_MODEL = dict(n_layer=2, n_head=2, d_model=32, block_size=16, batch_size=8, steps=20, seed=7, warmup=5,
                    lr=3e-3, warmup_skip=0)


# What each anchor's ctest case runs: FSDP1 as before (fp32 at worlds 1, 2, 4, bf16 at 2);
# the newer anchors every world in both precisions, fewer steps to stay near a minute.
PARITY_CONFIGS = {
    "fsdp1": ((1, "fp32"), (2, "fp32"), (4, "fp32"), (2, "bf16")),
    "fsdp2": ((1, "fp32"), (2, "fp32"), (4, "fp32"), (1, "bf16"), (2, "bf16"), (4, "bf16")),
    "deepspeed": ((1, "fp32"), (2, "fp32"), (4, "fp32"), (1, "bf16"), (2, "bf16"), (4, "bf16")),
}
PARITY_STEPS = {"fsdp1": 20, "fsdp2": 12, "deepspeed": 10}


def parity(args):
    impl = args.impl
    why = probe(impl)
    if why:
        print(f"SKIPPED: {NAMES[impl]} does not run here ({why}); this case runs where it does "
              f"(the project's .venv: PyPI torch, deepspeed from scripts/requirements.txt)")
        return SKIP
    work = tempfile.mkdtemp(prefix=f"fsdp_vs_{impl}_")
    r = Runner(args.bin_dir, work, verbose=False)
    ok = True
    extra = args.python_args.split() if args.python_args else []
    m = dict(PARITY_MODEL, steps=args.steps or PARITY_STEPS[impl])
    configs = PARITY_CONFIGS[impl]
    if args.worlds:
        configs = [c for c in configs if c[0] in args.worlds]
    t_all = time.time()
    for world, precision in configs:
        tag = f"parity_w{world}_{precision}"
        cpp = r.run("cpp", m, world, precision, 1, tag)
        py = r.run(impl, m, world, precision, 1, tag, extra=extra)
        tol = FP32_TOL if precision == "fp32" else BF16_TOL
        rel = [abs(a - b) / abs(b) for a, b in zip(cpp["losses"], py["losses"])]
        wd = weight_diff(cpp["weights"], py["weights"])
        bad = [i for i, x in enumerate(rel) if not x <= tol]
        calls = ", ".join(f"{k} x{v}" for k, v in sorted(py["comm_calls"].items())) or "none"
        print(f"{NAMES[impl]} world {world} {precision}: {len(rel)} steps, max relative loss difference "
              f"{max(rel):.2e} (tolerance {tol:g}), final weights max abs difference {wd:.2e}; bytes/step "
              f"train_gpt {cpp['comm_bytes']:.0f}, {impl} {py['comm_bytes']:.0f} ({calls})", flush=True)
        for i in bad:
            print(f"  step {i + 1}: train_gpt {cpp['losses'][i]:.8f} vs {NAMES[impl]} {py['losses'][i]:.8f} "
                  f"(relative {rel[i]:.2e})")
        ok = ok and not bad
    print(f"({time.time() - t_all:.0f} s)")
    print("PASSED" if ok else "FAILED: the losses differ beyond the tolerance")
    if ok:
        import shutil

        shutil.rmtree(work)
    else:
        print(f"(logs kept in {work})")
    return 0 if ok else 1


# ---- bench (scripts/bench/compare-pytorch.sh) ----------------------------------------------

SIZES = {
    # per-step overhead shows
    "small": dict(n_layer=4, n_head=4, d_model=128, block_size=64, batch_size=16, steps=30, warmup=5, warmup_skip=5,
                  lr=1e-3),
    # compute dominates
    "large": dict(n_layer=4, n_head=8, d_model=512, block_size=128, batch_size=8, steps=13, warmup=3, warmup_skip=3,
                  lr=5e-4),
}
# One thread per rank at every world (w4 oversubscribes the 2 cores). Two threads at
# world 1 were tried: on this shared 2-core machine under load, OpenMP/OpenBLAS spinning
# made a small fp32 step 27x slower (2.67 s vs 0.10 s) for both implementations alike.
THREADS = {1: 1, 2: 1, 4: 1}


TARGETS = {"step_s": 0.9, "rss_mib": 0.8, "comm_bytes": 1.0}  # this library / the best anchor


class Lock:
    """--lock FILE: each configuration's runs hold flock(FILE), as scripts/ and the other
    timing runs on a shared machine do; none without it."""

    def __init__(self, path):
        self.path, self.fd = path, None

    def __enter__(self):
        if self.path:
            import fcntl

            self.fd = open(self.path, "a")
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd:
            self.fd.close()  # releases the lock
            self.fd = None


def bench(args):
    impls = args.impls
    unknown = [i for i in impls if i not in ("cpp",) + ANCHORS]
    if unknown or "cpp" not in impls or len(impls) < 2:
        sys.exit(f"compare_fsdp.py: --impls {','.join(impls)}: name cpp and at least one of {','.join(ANCHORS)}")
    for impl in sorted({i for i in impls if i != "cpp"} | ({"fsdp1"} if "ckpt" in args.parts else set())):
        why = probe(impl)
        if why:
            sys.exit(f"compare_fsdp.py: {NAMES[impl]} does not run here: {why}; leave it out with --impls")
    anchors = [i for i in impls if i != "cpp"]
    # Learning rates low enough that neither size spikes: in a loss spike, rounding-level
    # differences grow chaotically (lr 3e-3 spiked the larger model at step 6).
    sizes = {k: dict(v, seed=1337) for k, v in SIZES.items()}
    reps = args.reps
    if args.quick:
        reps = 1
        sizes["small"].update(steps=12, warmup_skip=3)
        sizes["large"].update(d_model=256, n_head=4, steps=6, warmup_skip=2)
    sizes = {k: v for k, v in sizes.items() if k in args.sizes}
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="runs_", dir=args.out)
    hosts = [tuple(h.split(":")) for h in args.hosts.split(",")] if args.hosts else []
    if hosts and any(len(h) != 3 for h in hosts):
        sys.exit(f"compare_fsdp.py: --hosts {args.hosts}: expected NAMESPACE:INTERFACE:ADDRESS,... "
                 f"(scripts/bench/compare-pytorch.sh --link makes them)")
    worlds = args.worlds if not hosts else [2 * len(hosts)]
    r = Runner(args.bin_dir, work, hosts=hosts)
    rows = []
    for size, m in (sizes.items() if "train" in args.parts else ()):
        for world in worlds:
            for precision in args.precisions:
                tag = f"{size}_w{world}_{precision}"
                runs = {i: [] for i in impls}
                with Lock(args.lock):
                    for rep in range(reps):  # the anchors first, then this library; reversed next time
                        order = anchors + ["cpp"] if rep % 2 == 0 else ["cpp"] + anchors[::-1]
                        for impl in order:
                            runs[impl].append(r.run(impl, m, world, precision, THREADS[world], f"{tag}_r{rep}"))
                rows.append(bench_row(size, m, world, precision, reps, runs, anchors, args.link))
                print(table(rows[-1:]).split("\n", 2)[2], flush=True)  # its lines, as it ends
                for x in (x for rs in runs.values() for x in rs):
                    os.remove(x["weights"])
    ckpt_rows = []
    if "ckpt" in args.parts:
        with Lock(args.lock):
            ckpt_rows = ckpt_bench(r, args)
    machine = describe_machine()
    versions = anchor_versions(anchors)
    runs_json = os.path.join(args.out, "vs_anchors.json")
    with open(runs_json, "w") as f:
        json.dump({"machine": machine, "versions": versions, "date": time.strftime("%Y-%m-%d"), "quick": args.quick,
                   "link": args.link, "rows": rows, "ckpt_rows": ckpt_rows}, f, indent=1)
    with open(args.results, "a") as f:
        metric = {"save": "vs_dcp_save", "load": "vs_dcp_load", "export": "vs_fsdp_full_state_export"}
        what = {"save": "DCP FileSystemWriter (model + optimizer, each rank its shard, fsynced, fresh directory)",
                "load": "DCP FileSystemReader + set_state_dict (files evicted from the page cache first)",
                "export": "FSDP FULL_STATE_DICT (rank0_only) + torch.save, fsynced"}
        for row in ckpt_rows:
            for op in ("save", "load", "export"):
                rec = {"metric": metric[op], "world": row["world"], "value": round(row[op]["speedup"], 4),
                       "unit": "speed-up (PyTorch seconds / this library's; target >= 2)",
                       "baseline": f"{what[op]}, torch {torch_version()}",
                       "fsdp_s": round(row[op]["fsdp_s"], 4), "pytorch_s": round(row[op]["pytorch_s"], 4),
                       "model": row["model"], "machine": machine}
                if op != "export":  # the disk's own time for the same bytes (raw_io)
                    rec["raw_disk_s"] = round(row["raw_write_s" if op == "save" else "raw_read_s"], 4)
                f.write(json.dumps(rec) + "\n")
        for row in rows:
            for rec in result_records(row, versions, machine):
                f.write(json.dumps(rec) + "\n")
    print()
    if rows:
        print(table(rows))
    if ckpt_rows:
        m = ckpt_rows[0]["model"]
        print(f"\ncheckpoints of a {m['n_layer']}-layer d_model {m['d_model']} GPT after one step (fp32):")
        print(ckpt_table(ckpt_rows))
    print(f"\n{machine}; {versions}")
    print(f"rows appended to {args.results}; runs in {runs_json}")
    if rows:
        plot(runs_json, args.out)
    bad = [f"{r['size']} w{r['world']} {r['precision']} {i}" for r in rows for i in anchors
           if not r["impls"][i]["losses_agree"]]
    if bad:
        print("LOSSES DISAGREE in: " + ", ".join(bad))
        return 1
    import shutil

    shutil.rmtree(work)
    return 0


def bench_row(size, m, world, precision, reps, runs, anchors, link):
    """One configuration: each implementation's medians, and this library's ratios to the
    best anchor of each column."""
    row = {"size": size, "world": world, "precision": precision, "threads": THREADS[world], "link": link,
           "model": {k: m[k] for k in ("n_layer", "n_head", "d_model", "block_size", "batch_size")},
           "steps": m["steps"], "warmup_skip": m["warmup_skip"], "reps": reps, "impls": {}}
    tol = FP32_TOL if precision == "fp32" else BF16_TOL
    for impl, rs in runs.items():
        x = {"step_s": statistics.median(s for x in rs for s in x["step_s"][m["warmup_skip"]:]),
             "rss_mib": statistics.median(x["rss_kb"] for x in rs) / 1024,
             "comm_bytes": statistics.median(x["comm_bytes"] for x in rs),
             "comm_calls": rs[0]["comm_calls"], "losses": rs[0]["losses"], "final_loss": rs[0]["losses"][-1]}
        if impl != "cpp":
            x["max_rel_loss_diff"] = max(max_rel(a["losses"], b["losses"]) for a, b in zip(runs["cpp"], rs))
            x["losses_agree"] = x["max_rel_loss_diff"] <= tol
            x["max_abs_weight_diff"] = weight_diff(runs["cpp"][0]["weights"], rs[0]["weights"])
        row["impls"][impl] = x
    row["best"], row["ratio"] = {}, {}
    for key in TARGETS:
        best = min(anchors, key=lambda i: row["impls"][i][key])
        row["best"][key] = best
        b = row["impls"][best][key]
        row["ratio"][key] = {i: (row["impls"][i][key] / b if b else (1.0 if not row["impls"][i][key] else None))
                             for i in row["impls"]}
    row["met"] = {k: row["ratio"][k]["cpp"] is not None and row["ratio"][k]["cpp"] <= t for k, t in TARGETS.items()}
    return row


def result_records(row, versions, machine):
    name = f"{row['size']}_w{row['world']}_{row['precision']}" + (f"_{row['link']}" if row["link"] else "")
    me = row["impls"]["cpp"]
    base = f"best of {', '.join(NAMES[i] for i in row['impls'] if i != 'cpp')} ({versions}; same batches, " \
           "weights, threads per rank)"
    units = {"step_s": ("step_time", "median step time"), "rss_mib": ("peak_rss", "largest rank's peak RSS"),
             "comm_bytes": ("comm_bytes", "bytes communicated per rank per step")}
    out = []
    for key, (metric, what) in units.items():
        ratio = row["ratio"][key]["cpp"]
        out.append({"metric": f"vs_anchors_{metric}_{name}", "value": None if ratio is None else round(ratio, 4),
                    "unit": f"ratio ({what}, this library / the best anchor, {NAMES[row['best'][key]]}; "
                            f"target <= {TARGETS[key]})",
                    "baseline": base, "fsdp": me[key], "anchors": {i: x[key] for i, x in row["impls"].items()
                                                                   if i != "cpp"},
                    "losses_agree": all(x["losses_agree"] for i, x in row["impls"].items() if i != "cpp"),
                    "machine": machine})
    if "fsdp1" in row["impls"] and not row["link"]:  # the FSDP1 series of earlier runs, continued
        f1 = row["impls"]["fsdp1"]
        b1 = f"PyTorch FSDP1 {torch_version()} (same batches, weights, threads per rank)"
        out.append({"metric": f"vs_pytorch_step_time_{name}", "value": round(me["step_s"] / f1["step_s"], 4),
                    "unit": "ratio (median step time, this library / PyTorch; target <= 0.85)", "baseline": b1,
                    "fsdp_s": round(me["step_s"], 5), "pytorch_s": round(f1["step_s"], 5),
                    "losses_agree": f1["losses_agree"], "machine": machine})
        out.append({"metric": f"vs_pytorch_peak_rss_{name}", "value": round(me["rss_mib"] / f1["rss_mib"], 4),
                    "unit": "ratio (largest rank's peak RSS, this library / PyTorch; target <= 0.8)",
                    "baseline": b1, "fsdp_mib": round(me["rss_mib"], 1), "pytorch_mib": round(f1["rss_mib"], 1),
                    "machine": machine})
    return out


def anchor_versions(anchors):
    v = [f"torch {torch_version()}"]
    if "deepspeed" in anchors:
        try:
            import importlib.metadata

            v.append(f"deepspeed {importlib.metadata.version('deepspeed')}")
        except Exception:
            v.append("deepspeed ?")
    return ", ".join(v)


# The checkpoint comparison: a model big enough that the disk, not start-up, sets the time
# (~101 M parameters: 0.4 GB of fp32 weights, 1.2 GB with AdamW's two moments), trained one
# step so that the optimizer state exists.
CKPT_MODEL = dict(n_layer=8, n_head=16, d_model=1024, block_size=64, batch_size=4, steps=1, warmup=1, lr=1e-4,
                  seed=1337)
CKPT_QUICK = dict(CKPT_MODEL, n_layer=2, d_model=512, n_head=8)


def ckpt_bench(r, args):
    """Save, cold load and full-weights export against DCP and FULL_STATE_DICT + torch.save,
    alternately (PyTorch, then this library), each pair on the same training state."""
    m = CKPT_QUICK if args.quick else CKPT_MODEL
    rows = []
    for world in args.ckpt_worlds:
        times = {"cpp": [], "pytorch": []}
        sizes = {}
        for rep in range(1 if args.quick else args.reps):
            for impl in ("pytorch", "cpp"):
                tag = f"ckpt_w{world}_r{rep}"
                ckpt = os.path.join(r.work, f"{tag}_{impl}_ckpt")
                export = os.path.join(r.work, f"{tag}_{impl}_full" + (".h5" if impl == "cpp" else ".pt"))
                ev = r.io_run(impl, m, world, tag, "save", ckpt, export)
                if impl == "cpp":  # the disk's limit for these bytes, between save and load
                    ev["raw_write"], ev["raw_read"] = raw_io(ckpt, os.path.join(r.work, "raw"))
                ev.update(r.io_run(impl, m, world, tag, "load", ckpt, export))
                sizes[impl] = {"ckpt_bytes": tree_bytes(ckpt), "export_bytes": tree_bytes(export)}
                times[impl].append(ev)
                raw = (f"; raw write {ev['raw_write']:.2f} s, raw cold read {ev['raw_read']:.2f} s"
                       if "raw_write" in ev else "")
                print(f"  {tag:<24} {impl:<7} save {ev['save']:6.2f} s ({sizes[impl]['ckpt_bytes'] / 1e6:.0f} MB), "
                      f"cold load {ev['load']:6.2f} s, export {ev['export']:6.2f} s "
                      f"({sizes[impl]['export_bytes'] / 1e6:.0f} MB){raw}", flush=True)
                import shutil

                shutil.rmtree(ckpt)
                os.remove(export)
        row = {"world": world, "model": {k: m[k] for k in ("n_layer", "n_head", "d_model")}, "sizes": sizes,
               "raw_write_s": statistics.median(e["raw_write"] for e in times["cpp"]),
               "raw_read_s": statistics.median(e["raw_read"] for e in times["cpp"])}
        for op in ("save", "load", "export"):
            mine = statistics.median(e[op] for e in times["cpp"])
            theirs = statistics.median(e[op] for e in times["pytorch"])
            row[op] = {"fsdp_s": mine, "pytorch_s": theirs, "speedup": theirs / mine}
        rows.append(row)
    return rows


def ckpt_table(rows):
    out = ["| world | op | fsdp-libtorch | PyTorch | speed-up (PyTorch s / ours) | raw disk, same bytes | "
           "bytes ours / PyTorch |", "|---|---|---|---|---|---|---|"]
    names = {"save": "sharded save (model + AdamW) vs DCP FileSystemWriter",
             "load": "cold sharded load vs DCP FileSystemReader",
             "export": "consolidated export vs FULL_STATE_DICT + torch.save"}
    for r in rows:
        for op in ("save", "load", "export"):
            key = "export_bytes" if op == "export" else "ckpt_bytes"
            raw = {"save": f"write + fsync {r['raw_write_s']:.2f} s", "load": f"cold read {r['raw_read_s']:.2f} s",
                   "export": ""}[op]
            out.append(f"| {r['world']} | {names[op]} | {r[op]['fsdp_s']:.2f} s | {r[op]['pytorch_s']:.2f} s "
                       f"| {r[op]['speedup']:.2f} | {raw} | {r['sizes']['cpp'][key] / 1e6:.0f} / "
                       f"{r['sizes']['pytorch'][key] / 1e6:.0f} MB |")
    return "\n".join(out)


def torch_version():
    try:
        import torch

        return torch.__version__
    except Exception:
        return "?"


def describe_machine():
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) / 1048576
    return f"{os.cpu_count()} cores, {mem:.0f} GiB, {model}"


def table(rows):
    """One line per implementation and configuration; ratios against the best anchor of
    each column (the best anchor reads 1.00); this library's line marks each target
    (step time <= 0.9x the fastest anchor, RSS <= 0.8x the smallest, bytes <= the fewest)."""
    head = ("| size | world | precision | implementation | median step | x fastest anchor | peak RSS (largest rank) "
            "| x smallest anchor | bytes / rank / step | x fewest anchor | final loss | max rel loss diff vs "
            "fsdp-libtorch |")
    out = [head, "|" + "---|" * 12]

    def ratio(r, key, impl):
        v = r["ratio"][key][impl]
        text = "-" if v is None else f"{v:.2f}"
        if impl == "cpp":
            text += " ✓" if r["met"][key] else " ✗"
        return text

    for r in rows:
        m = r["model"]
        cfg = f"{r['size']} ({m['n_layer']}L d{m['d_model']} T{m['block_size']} B{m['batch_size']})"
        if r["link"]:
            cfg += f", {r['link']}"
        for impl, x in r["impls"].items():
            diff = "" if impl == "cpp" else f"{x['max_rel_loss_diff']:.1e}" + ("" if x["losses_agree"] else " (!)")
            name = f"**{NAMES[impl]}**" if impl == "cpp" else NAMES[impl]
            out.append(f"| {cfg} | {r['world']} | {r['precision']} | {name} | {x['step_s'] * 1e3:.1f} ms "
                       f"| {ratio(r, 'step_s', impl)} | {x['rss_mib']:.0f} MiB | {ratio(r, 'rss_mib', impl)} "
                       f"| {human(x['comm_bytes'])} | {ratio(r, 'comm_bytes', impl)} | {x['final_loss']:.4f} | {diff} |")
    return "\n".join(out)


def human(n):
    return "0" if not n else f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def plot(runs_json, out_dir):
    """PNGs: loss curves overlaid, step-time and RSS bars. matplotlib needed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("pictures skipped: matplotlib is not installed (it is in scripts/requirements.txt; "
              f"or draw them later with: {sys.argv[0]} plot {runs_json} OUTDIR)")
        return
    with open(runs_json) as f:
        data = json.load(f)
    rows = data["rows"]
    os.makedirs(out_dir, exist_ok=True)
    impls = list(rows[0]["impls"])
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4), squeeze=False)
    styles = {"cpp": "--", "fsdp1": "-", "fsdp2": "-.", "deepspeed": ":"}
    for ax, size in zip(axes[0], sizes):
        for r in (x for x in rows if x["size"] == size):
            colour = None
            for impl in impls:
                ls = r["impls"][impl]["losses"]
                line, = ax.plot(range(1, len(ls) + 1), ls, styles.get(impl, "-"), lw=1.2, color=colour,
                                label=f"{NAMES[impl]} w{r['world']} {r['precision']}")
                colour = line.get_color()
        m = next(x for x in rows if x["size"] == size)["model"]
        ax.set_title(f"{size}: {m['n_layer']} layers, d_model {m['d_model']}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "vs_anchors_loss.png"), dpi=80)
    plt.close(fig)
    labels = [f"{r['size']}\nw{r['world']} {r['precision']}" for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(max(8, len(rows) * 1.2), 10))
    width = 0.8 / len(impls)
    for ax, key, unit, scale in ((axes[0], "step_s", "median step time (ms)", 1e3),
                                 (axes[1], "rss_mib", "largest rank's peak RSS (MiB)", 1),
                                 (axes[2], "comm_bytes", "bytes / rank / step (MB)", 1e-6)):
        xs = range(len(rows))
        for k, impl in enumerate(impls):
            ax.bar([x - 0.4 + width * (k + 0.5) for x in xs], [r["impls"][impl][key] * scale for r in rows], width,
                   label=NAMES[impl])
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel(unit)
        ax.set_yscale("log" if key == "step_s" else "linear")
        ax.legend(fontsize=7)
    axes[0].set_title(f"{data['machine']}, {data.get('versions', '')}, {data['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "vs_anchors_bars.png"), dpi=80)
    plt.close(fig)
    print(f"pictures: {out_dir}/vs_anchors_loss.png, {out_dir}/vs_anchors_bars.png")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("parity", help="the ctest cases: losses agree with an anchor's at worlds 1, 2, 4")
    a.add_argument("--bin-dir", required=True)
    a.add_argument("--impl", choices=ANCHORS, default="fsdp1", help="the anchor (default: fsdp1)")
    a.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="only these worlds of the anchor's configurations")
    a.add_argument("--steps", type=int, default=0, help="steps per run (default: the anchor's, PARITY_STEPS)")
    a.add_argument("--python-args", default="", help="extra flags for the PyTorch side (to show the check fails)")
    b = sub.add_parser("bench", help="the comparison of scripts/bench/compare-pytorch.sh")
    b.add_argument("--bin-dir", required=True)
    b.add_argument("--out", required=True, help="folder for runs and pictures")
    b.add_argument("--results", required=True, help="results.jsonl to append to")
    b.add_argument("--quick", action="store_true", help="smaller model, fewer steps, one repetition")
    b.add_argument("--impls", type=lambda s: s.split(","), default=["cpp", "fsdp2", "fsdp1", "deepspeed"],
                   help="cpp (this library) and the anchors to compare with")
    b.add_argument("--sizes", type=lambda s: s.split(","), default=["small", "large"])
    b.add_argument("--lock", default="", help="hold flock(FILE) over each configuration's runs (and over "
                   "the checkpoint part)")
    b.add_argument("--hosts", default="", help="NS:IF:ADDR,NS:IF:ADDR: run world 2 x hosts over these "
                   "network-namespace hosts, 2 ranks each (scripts/bench/compare-pytorch.sh --link makes them)")
    b.add_argument("--link", default="", help="a name for the link the hosts are joined by (tables, metrics)")
    b.add_argument("--reps", type=int, default=2)
    b.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    b.add_argument("--precisions", type=lambda s: s.split(","), default=["fp32", "bf16"])
    b.add_argument("--parts", type=lambda s: s.split(","), default=["train", "ckpt"],
                   help="train (step time, RSS), ckpt (save, load, export against DCP and torch.save)")
    b.add_argument("--ckpt-worlds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    c = sub.add_parser("plot", help="pictures from a bench run's vs_anchors.json")
    c.add_argument("runs_json")
    c.add_argument("out_dir")
    args = p.parse_args()
    if args.mode == "parity":
        return parity(args)
    if args.mode == "bench":
        return bench(args)
    plot(args.runs_json, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
