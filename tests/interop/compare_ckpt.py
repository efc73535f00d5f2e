#!/usr/bin/env python3
"""train_gpt's checkpoints against PyTorch DCP's (FSDP2) and DeepSpeed ZeRO-3's, on the same
GPT (tests/interop/fsdp_gpt.py: the same initial weights and batches), each beside the disk's
own time for the same bytes (fresh files written and fsynced; the checkpoint's files read
cold, evicted from the page cache first).

  compare_ckpt.py bench --bin-dir build/bin [--quick] [--worlds 1,2,4] [--parts save,load,export,deepspeed]
                        [--work DIR] [--results FILE.json]   # results merge into FILE.json
  compare_ckpt.py table FILE.json                            # the markdown table of docs/benchmarks.md
  compare_ckpt.py check --bin-dir build/bin                  # the ctest case (0 / 1; 77: skipped)

Parts (each can run alone, e.g. one per hold of the build lock; later parts use the
checkpoints that earlier ones left in --work):
  save       DCP save (FileSystemWriter, sync_files) and async_save with the THREAD and the
             PROCESS executor and with cached pinned staging (FileSystemWriter's
             cache_staged_state_dict), each called twice (first call, then the steady one);
             train_gpt --save-dir, and --async-save. Blocked: the call's return (largest
             rank); durable: the future done (files fsynced), barrier to barrier.
  load       cold loads at the same world, and from 2 ranks to 3 (resharding): dcp.load +
             set_state_dict into a fresh FSDP2 model and AdamW, against train_gpt --resume.
  export     DCP's consolidation to Hugging Face safetensors (HuggingFaceStorageWriter with
             save_distributed and enable_consolidation, in the job; then
             consolidate_safetensors_files offline on its sharded files) against
             fsdp-consolidate --format safetensors on our sharded checkpoint; time, peak RSS.
  deepspeed  DeepSpeed ZeRO-3 (DS_ACCELERATOR=cpu, Gloo, torch AdamW as client optimizer)
             save_checkpoint (+ fsync of its files), and zero_to_fp32's
             convert_zero_checkpoint_to_fp32_state_dict (safetensors), time and peak RSS,
             against our sharded save and fsdp-consolidate.

Every job runs under fsdp-run (one process per rank, the torchrun environment,
OMP_NUM_THREADS=1); its peak RSS is each rank's own ru_maxrss (fsdp-run --peak-rss-json).
Every side saves twice in its job and nothing is deleted until the job ends: on a virtual
machine a page-cache page freed a moment ago is much cheaper to write into than one unused
for seconds (prime()), so a deletion just before a save would favour it. The raw write is
measured in both states ("fresh", "recycled"). The save part leaves its checkpoints (~11 GB
at full size) in --work for the other parts; remove them when done.
"""
import argparse
import datetime
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fsdp_gpt as G  # noqa: E402  (stdlib-only at import)
from compare_fsdp import describe_machine, evict, run_tree, tree_bytes  # noqa: E402

SKIP = 77
# The GPT of compare_fsdp.py's checkpoint part: 8 layers, d_model 1024 (~101 M parameters,
# 0.4 GB fp32, 1.2 GB with AdamW's moments). The batch (batch_for) only has to divide by the
# world: it does not change the checkpoint.
MODEL = dict(n_layer=8, n_head=16, d_model=1024, block_size=64, seed=1337, lr=1e-4, steps=1, warmup=1)
QUICK = dict(MODEL, n_layer=2, n_head=8, d_model=512)
CHECK = dict(n_layer=2, n_head=2, d_model=32, block_size=16, seed=7, lr=3e-3, steps=3, warmup=2)
CHECK_TOL = 1e-4  # fp32 weights after 3 AdamW steps of lr 3e-3: a step more or less moves them ~3e-3


def batch_for(world):
    return 8 if world == 4 else 6  # 6: worlds 1, 2, 3; 8: world 4


def model_flags(m, world):
    return ["--n-layer", str(m["n_layer"]), "--n-head", str(m["n_head"]), "--d-model", str(m["d_model"]),
            "--block-size", str(m["block_size"]), "--batch-size", str(m.get("batch_size", batch_for(world))),
            "--steps", str(m["steps"]), "--seed", str(m["seed"]), "--warmup-steps", str(m["warmup"]),
            "--lr", str(m["lr"])]


# ---- the ranks (run under fsdp-run) ----------------------------------------------------------


def worker_parse(argv):
    p = argparse.ArgumentParser(prog="compare_ckpt.py worker")
    a = p.add_argument
    a("op", choices=["dcp-save", "dcp-load", "dcp-hf", "dcp-consolidate", "ds-save", "ds-to-fp32", "check-dcp",
                     "check-ds"])
    a("--n-layer", type=int, default=2)
    a("--n-head", type=int, default=2)
    a("--d-model", type=int, default=32)
    a("--block-size", type=int, default=16)
    a("--batch-size", type=int, default=4)
    a("--steps", type=int, default=1)
    a("--lr", type=float, default=1e-3)
    a("--weight-decay", type=float, default=0.01)
    a("--warmup-steps", type=int, default=1)
    a("--lr-schedule", default="cosine")
    a("--clip-grad", type=float, default=1.0)
    a("--seed", type=int, default=1337)
    a("--init-from", default="")
    a("--dir", default="", help="the checkpoint directory (written or read)")
    a("--out", default="", help="an output (consolidated weights)")
    a("--variants", default="sync,thread,process,pinned")
    a("--io-log", default="")
    return p.parse_args(argv)


def max_rss_kb():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def fsync_tree(path):
    for root, _, files in os.walk(path):
        for n in files:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class Log:
    """Rank 0 appends one JSON object per event to --io-log."""

    def __init__(self, path, rank):
        self.f = open(path, "a") if (path and rank == 0) else None

    def put(self, **kw):
        if self.f:
            self.f.write(json.dumps(kw) + "\n")
            self.f.flush()


def local_batches(a, rank, world):
    import torch

    if a.batch_size % world:
        sys.exit(f"compare_ckpt.py: --batch-size {a.batch_size} is not divisible by world {world}")
    per = a.batch_size // world
    s = G.Sampler(a.seed)
    return [torch.tensor(s.batch(i, a.batch_size, a.block_size)[rank * per:(rank + 1) * per], dtype=torch.long)
            for i in range(a.steps)]


def fsdp2_model(a, world):
    """The GPT from --init-from, each Block and then the root fully_shard-ed (FSDP2) over a
    CPU mesh, and AdamW as fsdp_gpt.py makes it."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(a.seed)
    model, _ = G.build_model(a)
    G.load_init(model, a.init_from, a)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=a.weight_decay)
    return model, opt


def train_fsdp2(a, model, opt, rank, world):
    import torch
    import torch.nn.functional as F

    for step, rows in enumerate(local_batches(a, rank, world)):
        for g in opt.param_groups:
            g["lr"] = G.lr_at(step, a)
        x, y = rows[:, :-1], rows[:, 1:]
        logits = model(x).float()
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
        if a.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad)
        opt.step()
        opt.zero_grad()


def timed(dist, fn):
    """Barrier, fn(), barrier: seconds, and fn's result."""
    dist.barrier()
    t = time.perf_counter()
    r = fn()
    dist.barrier()
    return time.perf_counter() - t, r


def allmax(dist, x):
    import torch

    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def op_dcp_save(a, rank, world, log):
    """Trains, then saves the same state with each variant twice (the first call pays what
    is made once: process start, pinned buffers); keeps --dir/sync_2 for the loads."""
    import torch.distributed as dist

    model, opt = fsdp2_model(a, world)
    train_fsdp2(a, model, opt, rank, world)
    dcp_save_variants(a, model, opt, rank, world, log)
    log.put(event="rss", peak_rss_kb=allmax(dist, max_rss_kb()))


def dcp_save_variants(a, model, opt, rank, world, log):
    """Each variant of a.variants twice into a.dir/VARIANT_CALL; the dirs are removed
    after their call but sync_2. Blocked: the call's return, the largest rank's; durable:
    barrier to barrier around the call and its future's result (FileSystemWriter fsyncs)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    pinned_writer = None
    for variant in a.variants.split(","):
        for call in (1, 2):
            path = os.path.join(a.dir, f"{variant}_{call}")
            dist.barrier()
            t0 = time.perf_counter()
            try:
                msd, osd = get_state_dict(model, opt)
                sd = {"model": msd, "optim": osd}
                if variant == "sync":
                    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True))
                    fut = None
                elif variant in ("thread", "process"):
                    kind = AsyncCheckpointerType.THREAD if variant == "thread" else AsyncCheckpointerType.PROCESS
                    fut = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                                         async_checkpointer_type=kind)
                elif variant == "pinned":  # one writer for both calls: its pinned copy is reused
                    if pinned_writer is None:
                        pinned_writer = dcp.FileSystemWriter(path, sync_files=True, cache_staged_state_dict=True)
                    fut = dcp.async_save(sd, checkpoint_id=path, storage_writer=pinned_writer)
                else:
                    raise ValueError(f"unknown variant {variant!r} (sync, thread, process, pinned)")
                blocked = time.perf_counter() - t0
                if fut is not None:
                    fut.result()
                err = ""
            except Exception as e:  # e.g. pinned memory without CUDA: reported, not fatal
                blocked, err = float("nan"), f"{type(e).__name__}: {e}"
            dist.barrier()
            durable = time.perf_counter() - t0
            blocked = allmax(dist, blocked)
            log.put(event="dcp_save", variant=variant, call=call, blocked=blocked, durable=durable,
                    bytes=tree_bytes(path) if os.path.exists(path) else 0, error=err[:500])
            if err:
                break
    # Removed only now: a removal frees page-cache pages that the next write would reuse,
    # and on this virtual machine a recycled page costs far less than one unused for a few
    # seconds (see prime() in the driver), which would favour every call after the first.
    dist.barrier()
    if rank == 0:
        for d in glob.glob(os.path.join(a.dir, "*_[12]")):
            if os.path.basename(d) != "sync_2":
                shutil.rmtree(d)


def op_dcp_load(a, rank, world, log):
    """A fresh model and AdamW loaded from --dir (written at any world): what fsdp_gpt.py's
    dcp_load does (get_state_dict makes the optimizer state to fill, set_state_dict puts
    it in place)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = fsdp2_model(a, world)

    def load():
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(a.dir))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    s, _ = timed(dist, load)
    steps = sorted({float(v["step"]) for v in opt.state.values() if "step" in v})
    if steps != [float(a.steps)]:
        raise RuntimeError(f"loaded optimizer steps {steps}, expected [{a.steps}]")
    log.put(event="dcp_load", seconds=s, world=world)


def op_dcp_hf(a, rank, world, log):
    """The model's weights to Hugging Face safetensors from the sharded job: each rank its
    shard (--dir/sharded), then rank 0 consolidates them into --dir (HuggingFaceStorageWriter's
    enable_consolidation)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, opt = fsdp2_model(a, world)
    train_fsdp2(a, model, opt, rank, world)
    before = max_rss_kb()

    def save():
        w = dcp.HuggingFaceStorageWriter(a.dir, save_distributed=True, enable_consolidation=True)
        dcp.save(get_model_state_dict(model), storage_writer=w)
        if rank == 0:
            for f in glob.glob(os.path.join(a.dir, "*.safetensors")):
                fsync_tree_file(f)

    s, _ = timed(dist, save)
    log.put(event="dcp_hf", seconds=s, bytes=sum(os.path.getsize(f) for f in
                                                  glob.glob(os.path.join(a.dir, "*.safetensors"))),
            rss_before_kb=allmax(dist, before), rss_after_kb=allmax(dist, max_rss_kb()))


def fsync_tree_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def op_dcp_consolidate(a, log):
    """consolidate_safetensors_files on the sharded safetensors in --dir into --out, one
    output file (all names to index 1), fsynced."""
    from safetensors import safe_open
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    names = set()
    for f in glob.glob(os.path.join(a.dir, "*.safetensors")):
        with safe_open(f, "pt") as h:
            names.update(h.keys())
    if not names:
        raise RuntimeError(f"no safetensors with tensors in {a.dir}")
    os.makedirs(a.out, exist_ok=True)
    rss0 = max_rss_kb()  # the interpreter, torch and safetensors, before the work
    t = time.perf_counter()
    consolidate_safetensors_files(a.dir, a.out, {n: 1 for n in names})
    for f in glob.glob(os.path.join(a.out, "*.safetensors")):
        fsync_tree_file(f)
    log.put(event="dcp_consolidate", seconds=time.perf_counter() - t, peak_rss_kb=max_rss_kb(), rss_before_kb=rss0,
            bytes=tree_bytes(a.out))


def ds_engine(a, rank, world):
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(a.seed)
    model, _ = G.build_model(a)
    G.load_init(model, a.init_from, a)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay)
    cfg = {"train_micro_batch_size_per_gpu": a.batch_size // world, "gradient_accumulation_steps": 1,
           "gradient_clipping": a.clip_grad, "zero_optimization": {"stage": 3},
           "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def train_ds(a, engine, rank, world):
    import torch.nn.functional as F

    for step, rows in enumerate(local_batches(a, rank, world)):
        for g in engine.optimizer.param_groups:
            g["lr"] = G.lr_at(step, a)
        x, y = rows[:, :-1], rows[:, 1:]
        logits = engine(x).float()
        engine.backward(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)))
        engine.step()


def op_ds_save(a, rank, world, log):
    """DeepSpeed ZeRO-3's save_checkpoint twice (tags ckpt1, ckpt2 under --dir; the second
    is the steady state); after each, every rank fsyncs what it wrote (DeepSpeed's
    torch.save does not), timed apart: durable = both."""
    import torch.distributed as dist

    engine = ds_engine(a, rank, world)
    train_ds(a, engine, rank, world)
    before = max_rss_kb()
    got = []
    for tag in ("ckpt1", "ckpt2"):
        s, _ = timed(dist, lambda: engine.save_checkpoint(a.dir, tag=tag))

        def sync():
            # each rank its own files (zero_pp_rank_R_*); rank 0 also the model states and `latest`
            for f in glob.glob(os.path.join(a.dir, tag, f"*zero_pp_rank_{rank}_*")):
                fsync_tree_file(f)
            if rank == 0:
                for f in glob.glob(os.path.join(a.dir, "latest")) + glob.glob(os.path.join(a.dir, tag, "mp_rank_*")):
                    fsync_tree_file(f)

        f, _ = timed(dist, sync)
        got.append((s, f))
    after = max_rss_kb()
    log.put(event="ds_save", seconds=got[1][0], fsync_s=got[1][1], first_seconds=got[0][0], first_fsync_s=got[0][1],
            bytes=tree_bytes(os.path.join(a.dir, "ckpt2")),
            rss_before_kb=allmax(dist, before), rss_after_kb=allmax(dist, after))


def op_ds_to_fp32(a, log):
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    rss0 = max_rss_kb()  # the interpreter, torch and deepspeed, before the work
    t = time.perf_counter()
    # max_shard_size None: one file (the sharded path needs huggingface_hub)
    convert_zero_checkpoint_to_fp32_state_dict(a.dir, a.out, max_shard_size=None, safe_serialization=True)
    for f in glob.glob(os.path.join(a.out, "*.safetensors")):
        fsync_tree_file(f)
    log.put(event="ds_to_fp32", seconds=time.perf_counter() - t, peak_rss_kb=max_rss_kb(), rss_before_kb=rss0,
            bytes=tree_bytes(a.out))


def full_state(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def op_check_dcp(a, rank, world, log):
    """ctest: FSDP2 trained --steps steps, DCP save, a fresh model and AdamW loaded from it:
    every weight and optimizer tensor equal to the saved ones; rank 0 writes the full weights
    (safetensors, --out) for the cross-check against ours and DeepSpeed's."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = fsdp2_model(a, world)
    train_fsdp2(a, model, opt, rank, world)
    want_m = full_state(model)
    want = local_state(model, opt)
    dcp_save_variants(argparse.Namespace(**dict(vars(a), variants="sync")), model, opt, rank, world, Log("", rank))
    model2, opt2 = fsdp2_model(a, world)
    msd, osd = get_state_dict(model2, opt2)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(a.dir, "sync_2")))
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = local_state(model2, opt2)
    bad = sorted(k for k in want if k not in got or not torch.equal(want[k], got[k]))
    n = torch.tensor([len(bad)])
    dist.all_reduce(n)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in want_m.items()}, a.out)
    log.put(event="check_dcp", mismatched=bad, mismatched_all_ranks=int(n.item()), n_tensors=len(want))


def local_state(model, opt):
    """This rank's shards of every weight and optimizer tensor, by name (copies)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {}
    for k, v in msd.items():
        out["model." + k] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            v = torch.as_tensor(v)
            out[f"optim.{fqn}.{k}"] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
    return out


def op_check_ds(a, rank, world, log):
    engine = ds_engine(a, rank, world)
    train_ds(a, engine, rank, world)
    engine.save_checkpoint(a.dir, tag="ckpt")
    log.put(event="check_ds")


def worker(argv):
    a = worker_parse(argv)
    if a.op in ("dcp-consolidate", "ds-to-fp32"):  # one process, no process group
        log = Log(a.io_log, 0)
        (op_dcp_consolidate if a.op == "dcp-consolidate" else op_ds_to_fp32)(a, log)
        return
    if a.op.startswith("ds") or a.op == "check-ds":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        rank, world = G.init_distributed()
    log = Log(a.io_log, rank)
    {"dcp-save": op_dcp_save, "dcp-load": op_dcp_load, "dcp-hf": op_dcp_hf, "ds-save": op_ds_save,
     "check-dcp": op_check_dcp, "check-ds": op_check_ds}[a.op](a, rank, world, log)
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as fsdp_gpt.py: no Gloo teardown at exit


# ---- the driver -------------------------------------------------------------------------------


class Jobs:
    def __init__(self, bin_dir, work, verbose=True):
        self.bin_dir, self.work, self.verbose = bin_dir, work, verbose
        for tool in ("train_gpt", "fsdp-run", "fsdp-consolidate"):
            if not os.access(os.path.join(bin_dir, tool), os.X_OK):
                sys.exit(f"compare_ckpt.py: {bin_dir}/{tool} is missing; build it first "
                         f"(cmake --build BUILD --target {tool})")
        self.n = 0

    def init_file(self, m):
        path = os.path.join(self.work, "init_%d_%d_%d_%d_%d.h5" % (m["n_layer"], m["n_head"], m["d_model"],
                                                                   m["block_size"], m["seed"]))
        if not os.path.exists(path):
            r = subprocess.run([sys.executable, G.__file__, "--write-init", path] + model_flags(m, 1),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if r.returncode:
                raise RuntimeError("writing the initial weights failed:\n" + r.stdout)
        return path

    def run(self, world, prog, tag, timeout=900, env_extra=None):
        """prog under fsdp-run at `world`; returns (wall s, largest rank's peak RSS KiB, io-log events)."""
        self.n += 1
        base = os.path.join(self.work, f"{self.n:03d}_{tag}")
        io_log, rss_json = base + ".io.jsonl", base + ".rss.json"
        for p in (io_log, rss_json):
            if os.path.exists(p):
                os.remove(p)
        cmd = [os.path.join(self.bin_dir, "fsdp-run"), "--nproc", str(world), "--peak-rss-json", rss_json, "--"]
        cmd += [c.replace("{IO_LOG}", io_log) for c in prog]
        env = dict(os.environ, OMP_NUM_THREADS="1", USE_LIBUV="0", DS_ACCELERATOR="cpu", **(env_extra or {}))
        t = time.perf_counter()
        rc, out, _ = run_tree(cmd, env, base + ".out", timeout)
        wall = time.perf_counter() - t
        if rc:
            raise RuntimeError(f"{tag} failed (exit {rc}): {' '.join(cmd)}\n{out[-4000:]}")
        with open(rss_json) as f:
            rss = max(json.load(f)["peak_rss_kb"])
        events = []
        if os.path.exists(io_log):
            with open(io_log) as f:
                events = [json.loads(line) for line in f if line.strip()]
        if self.verbose:
            print(f"  {tag:<34} {wall:6.1f} s wall, peak RSS {rss / 1024:7.0f} MiB: "
                  + "; ".join(short(e) for e in events), flush=True)
        return wall, rss, events

    def py(self, op, m, world, extra=()):
        return [sys.executable, os.path.abspath(__file__), "worker", op] + model_flags(m, world) + [
            "--init-from", self.init_file(m), "--io-log", "{IO_LOG}"] + list(extra)

    def ours(self, m, world, extra=()):
        return [os.path.join(self.bin_dir, "train_gpt")] + model_flags(m, world) + [
            "--precision", "fp32", "--init-from", self.init_file(m), "--io-log", "{IO_LOG}", "--log-every", "1",
            "--device", "cpu", "--no-decay-recipe", "none"] + list(extra)  # the others decay every parameter


def short(e):
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in e.items()
                     if k not in ("path",) and v not in ("", [], None))


def ev(events, name, **match):
    got = [e for e in events if e.get("event") == name and all(e.get(k) == v for k, v in match.items())]
    if not got:
        raise RuntimeError(f"no {name} {match} event in {events}")
    return got[-1]


def data_files(path):
    return sorted(os.path.join(r, n) for r, _, fs in os.walk(path) for n in fs
                  if os.path.getsize(os.path.join(r, n)) > 0 and not n.startswith("."))


def source_buffer():
    """256 MiB of distinct non-zero bytes to write from: a buffer of zeros (bytes(n)) maps
    the kernel's zero page, which the copy into the page cache reads for free."""
    global _SOURCE
    if _SOURCE is None:
        import numpy as np

        _SOURCE = memoryview(np.arange(64 << 20, dtype=np.float32)).cast("B")
    return _SOURCE


_SOURCE = None


def write_file(path, n):
    src = source_buffer()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while n > 0:
            n -= os.write(fd, src[:min(n, len(src))])
        os.fsync(fd)
    finally:
        os.close(fd)


def prime(work, nbytes):
    """Writes, fsyncs and deletes a scratch file of nbytes: on this virtual machine the
    first use of a page the guest has not used lately costs several times a recycled
    one's (1.2 GB into the page cache: 3.0 s fresh, 0.6 s right after a deletion), so
    every timed job starts from the same state, pages just freed."""
    path = os.path.join(work, "prime.tmp")
    write_file(path, nbytes)
    os.remove(path)


def raw_write(sizes, scratch):
    """The disk's own time to write and fsync fresh files of these sizes, one thread each
    (os.write releases the GIL), 256 MiB calls from real (non-zero) memory."""
    os.makedirs(scratch, exist_ok=True)
    source_buffer()
    s = run_threads([(write_file, (os.path.join(scratch, f"raw_{i}"), n)) for i, n in enumerate(sizes)])
    shutil.rmtree(scratch)
    return s


DIRECT_CHUNK = 16 << 20  # bytes per O_DIRECT call of the raw baselines


def aligned_source(n):
    """n page-aligned bytes (an anonymous map) holding source_buffer()'s bytes."""
    import mmap

    buf = mmap.mmap(-1, n)
    src = source_buffer()
    for off in range(0, n, len(src)):
        buf[off:off + min(len(src), n - off)] = src[:min(len(src), n - off)]
    return buf


def write_file_direct(path, n):
    """n bytes written with O_DIRECT in 16 MiB calls (the last one rounded up to a page,
    then truncated back), fsynced: the disk's own write, without the page cache."""
    buf = aligned_source(DIRECT_CHUNK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        off = 0
        while off < n:
            k = min(DIRECT_CHUNK, (n - off + 4095) // 4096 * 4096)
            off += os.pwritev(fd, [memoryview(buf)[:k]], off)
        os.ftruncate(fd, n)
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write_direct(sizes, scratch):
    """raw_write with O_DIRECT: one thread a file."""
    os.makedirs(scratch, exist_ok=True)
    source_buffer()
    s = run_threads([(write_file_direct, (os.path.join(scratch, f"raw_{i}"), n)) for i, n in enumerate(sizes)])
    shutil.rmtree(scratch)
    return s


def raw_read_direct(files, threads):
    """raw_read with O_DIRECT: 16 MiB preads into page-aligned buffers, two in flight for
    each of `threads` threads (the files shared round-robin)."""
    import mmap

    for f in files:
        evict_file(f)
    jobs = [(p, off) for p in files for off in range(0, os.path.getsize(p), DIRECT_CHUNK)]
    lock = threading.Lock()
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in files}

    def read():
        buf = mmap.mmap(-1, DIRECT_CHUNK)
        while True:
            with lock:
                if not jobs:
                    return
                p, off = jobs.pop(0)
            os.preadv(fds[p], [buf], off)

    try:
        return run_threads([(read, ()) for _ in range(2 * threads)])
    finally:
        for fd in fds.values():
            os.close(fd)


def median_rows(reps):
    """The median of every number over the repetitions (the first one's other values)."""
    first = reps[0]
    if isinstance(first, dict):
        return {k: median_rows([r[k] for r in reps if k in r]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool) and all(x == x for x in reps):
        return statistics.median(reps)
    return first


def raw_read(files, threads):
    """The disk's own time to read these files cold (evicted first), `threads` threads
    sharing them round-robin."""
    for f in files:
        evict_file(f)
    groups = [files[i::threads] for i in range(threads)]

    def read(paths):
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                while os.read(fd, 64 << 20):
                    pass
            finally:
                os.close(fd)

    return run_threads([(read, (g,)) for g in groups if g])


def evict_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_threads(jobs):
    ts = [threading.Thread(target=f, args=a) for f, a in jobs]
    t = time.perf_counter()
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    return time.perf_counter() - t


def rank_files(path, world):
    """The files of a checkpoint as its ranks write them: sizes per rank (for raw_write).
    Ours: one rank_NNNNN.h5 each; DCP: __R_0.distcp each (+ .metadata, rank 0); DeepSpeed:
    zero_pp_rank_R_* each (+ model states, rank 0)."""
    per = [0] * world
    for f in data_files(path):
        n, sz = os.path.basename(f), os.path.getsize(f)
        r = 0
        for w in range(world):
            if (n.startswith(f"rank_{w:05d}") or n.startswith(f"__{w}_") or f"zero_pp_rank_{w}_" in n):
                r = w
        per[r] += sz
    return per


PRIME = 4 << 30  # bytes written and deleted for the "recycled pages" raw write (prime())


def latest_step(d):
    """The newest step_NNNNNNNN directory of one of our --save-dir directories."""
    steps = sorted(glob.glob(os.path.join(d, "step_*")))
    if not steps:
        raise RuntimeError(f"no step_* checkpoint in {d}")
    return steps[-1]


def disk_write(work, sizes):
    """The disk's own time to write + fsync these rank files, in two states of the page
    cache: 'fresh' (nothing freed for the last seconds, as inside a job after its start-up
    and training) and 'recycled' (right after a same-size file was deleted, the best case)."""
    time.sleep(5)
    fresh = raw_write(sizes, os.path.join(work, "raw"))
    prime(work, PRIME)
    recycled = raw_write(sizes, os.path.join(work, "raw"))
    return fresh, recycled


def disk_write_direct(work, sizes):
    """The disk's own time to write + fsync these rank files with O_DIRECT (no page cache:
    its state does not matter)."""
    return raw_write_direct(sizes, os.path.join(work, "raw"))


def step_times(path, steps):
    """step_s of `steps` from a --log-jsonl file."""
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    got = {r["step"]: r["step_s"] for r in recs if r.get("step") in steps}
    if len(got) != len(steps):
        raise RuntimeError(f"{path}: no step_s for every step of {steps}: {recs}")
    return [got[s] for s in steps]


def part_save(j, m, worlds, reps):
    """Each side saves twice in one job: DCP's variants call after call, ours at steps 1
    and 2 (--save-every 1, a training step between), and a third time at step 3; nothing
    is removed until the job ends. Call 2 is the steady state that the targets use. Our
    async save leaves its copy to the background thread (SaveOptions::background_staging),
    which the next backward waits for: its blocked time is the call and that wait. Steps 2
    and 3, each run beside a save's staging in the async job and after a finished save in
    the sync one, show what the copy costs the step."""
    rows = {}
    m3 = dict(m, steps=3)
    for w in worlds:
        runs = []
        for rep in range(reps):
            r = {}
            d_dcp = os.path.join(j.work, f"dcp_w{w}")
            d_ours = os.path.join(j.work, f"ours_w{w}")
            d_async = os.path.join(j.work, f"ours_async_w{w}")

            def dcp():
                shutil.rmtree(d_dcp, ignore_errors=True)
                _, r["dcp_rss_kb"], e = j.run(w, j.py("dcp-save", m, w, ["--dir", d_dcp]), f"dcp_save_w{w}")
                r["dcp"] = {}
                for x in e:
                    if x["event"] == "dcp_save":
                        r["dcp"].setdefault(x["variant"], {})[str(x["call"])] = x

            def ours():
                shutil.rmtree(d_ours, ignore_errors=True)
                steps_log = os.path.join(j.work, f"ours_w{w}_steps.jsonl")
                _, r["ours_rss_kb"], e = j.run(w, j.ours(m3, w, [
                    "--save-dir", d_ours, "--save-every", "1", "--keep", "2", "--log-jsonl", steps_log,
                    "--consolidate-to", os.path.join(j.work, f"ours_w{w}_full.h5")]), f"ours_save_w{w}")
                saves = [x["seconds"] for x in e if x["event"] == "save"]
                if len(saves) != 3:
                    raise RuntimeError(f"ours_save_w{w}: {len(saves)} save events, expected 3: {e}")
                r["ours_sync_1"], r["ours_sync"] = saves[:2]
                r["ours_sync_steps"] = statistics.mean(step_times(steps_log, [2, 3]))
                r["ours_export_h5"] = ev(e, "export")["seconds"]
                shutil.rmtree(d_async, ignore_errors=True)
                _, r["ours_async_rss_kb"], e = j.run(w, j.ours(m3, w, [
                    "--save-dir", d_async, "--save-every", "1", "--keep", "2", "--async-save",
                    "--log-jsonl", steps_log]), f"ours_async_save_w{w}")
                saves = [x["seconds"] for x in e if x["event"] == "save"]
                waits = [x["seconds"] for x in e if x["event"] == "save_staging_wait"]
                if len(saves) != 3 or len(waits) != 3:
                    raise RuntimeError(f"ours_async_save_w{w}: {len(saves)} save and {len(waits)} "
                                       f"save_staging_wait events, expected 3 each: {e}")
                r["ours_async_call_1"], r["ours_async_call"] = saves[:2]
                r["ours_async_wait_1"], r["ours_async_wait"] = waits[:2]
                r["ours_async_blocked_1"], r["ours_async_blocked"] = saves[0] + waits[0], saves[1] + waits[1]
                r["ours_async_durable"] = saves[2] + ev(e, "save_wait")["seconds"]  # the last call's
                r["ours_async_steps"] = statistics.mean(step_times(steps_log, [2, 3]))
                os.remove(steps_log)
                shutil.rmtree(d_async)

            for f in ((dcp, ours) if rep % 2 == 0 else (ours, dcp)):  # alternately first
                f()
            sizes = rank_files(latest_step(d_ours), w)
            r["raw_write"], r["raw_write_recycled"] = disk_write(j.work, sizes)
            r["raw_write_direct"] = disk_write_direct(j.work, sizes)
            r["raw_write_bytes"], r["ours_bytes"] = sum(sizes), tree_bytes(latest_step(d_ours))
            print(f"  raw write + fsync of {sum(sizes) / 1e6:.0f} MB in {w} file(s): {r['raw_write']:.2f} s fresh, "
                  f"{r['raw_write_recycled']:.2f} s recycled, {r['raw_write_direct']:.2f} s with O_DIRECT",
                  flush=True)
            runs.append(r)
        rows[str(w)] = dict(median_rows(runs), reps=runs)
    return rows


def part_load(j, m, worlds, reps):
    rows = {}
    pairs = [(w, w) for w in worlds] + ([(2, 3)] if 2 in worlds else [])
    for src, dst in pairs:
        d_dcp = os.path.join(j.work, f"dcp_w{src}", "sync_2")
        d_ours = os.path.join(j.work, f"ours_w{src}")
        for d in (d_dcp, d_ours):
            if not os.path.isdir(d):
                raise RuntimeError(f"{d} is missing: run --parts save (with world {src}) first")
        mm = dict(m, batch_size=batch_for(dst))
        runs = []
        for rep in range(reps):
            r = {}

            def dcp():
                evict(d_dcp)
                _, r["dcp_rss_kb"], e = j.run(dst, j.py("dcp-load", mm, dst, ["--dir", d_dcp]),
                                              f"dcp_load_{src}to{dst}")
                r["dcp"] = ev(e, "dcp_load")["seconds"]

            def ours():
                evict(d_ours)
                _, r["ours_rss_kb"], e = j.run(dst, j.ours(dict(mm, steps=2), dst, ["--save-dir", d_ours, "--resume"]),
                                               f"ours_load_{src}to{dst}")
                r["ours"] = ev(e, "load")["seconds"]

            for f in ((dcp, ours) if rep % 2 == 0 else (ours, dcp)):
                f()
            files = data_files(latest_step(d_ours))
            time.sleep(5)
            r["raw_read"] = raw_read(files, src)
            time.sleep(2)
            r["raw_read_direct"] = raw_read_direct(files, src)
            r["bytes_ours"], r["bytes_dcp"] = tree_bytes(latest_step(d_ours)), tree_bytes(d_dcp)
            print(f"  raw cold read of {r['bytes_ours'] / 1e6:.0f} MB ({len(files)} files, {src} threads): "
                  f"{r['raw_read']:.2f} s, {r['raw_read_direct']:.2f} s with O_DIRECT", flush=True)
            runs.append(r)
        rows[f"{src}to{dst}"] = dict(median_rows(runs), reps=runs)
    return rows


def part_export(j, m, worlds, reps):
    rows = {}
    for w in worlds:
        d_ours = os.path.join(j.work, f"ours_w{w}")
        if not os.path.isdir(d_ours):
            raise RuntimeError(f"{d_ours} is missing: run --parts save first")
        d_hf = os.path.join(j.work, f"dcp_hf_w{w}")
        shutil.rmtree(d_hf, ignore_errors=True)
        _, rss_hf, e_hf = j.run(w, j.py("dcp-hf", m, w, ["--dir", d_hf]), f"dcp_hf_w{w}")
        d_cons = os.path.join(j.work, f"dcp_cons_w{w}")
        shutil.rmtree(d_cons, ignore_errors=True)
        evict(os.path.join(d_hf, "sharded"))
        wall_c, rss_c, e_c = j.run(1, j.py("dcp-consolidate", m, 1, ["--dir", os.path.join(d_hf, "sharded"),
                                                                     "--out", d_cons]), f"dcp_consolidate_w{w}")
        d_st = os.path.join(j.work, f"ours_st_w{w}")
        shutil.rmtree(d_st, ignore_errors=True)
        evict(d_ours)
        wall_o, rss_o, _ = j.run(1, [os.path.join(j.bin_dir, "fsdp-consolidate"), "-q", "--format", "safetensors",
                                     d_ours, d_st], f"ours_consolidate_w{w}")
        c = ev(e_c, "dcp_consolidate")
        hf = ev(e_hf, "dcp_hf")
        rows[str(w)] = {"dcp_hf_in_job": hf["seconds"], "dcp_hf_rss_before_kb": hf["rss_before_kb"],
                        "dcp_hf_rss_after_kb": hf["rss_after_kb"],
                        "dcp_consolidate": c["seconds"], "dcp_consolidate_wall": wall_c,
                        "dcp_consolidate_rss_kb": rss_c, "dcp_bytes": c["bytes"],
                        "ours_consolidate_wall": wall_o, "ours_consolidate_rss_kb": rss_o,
                        "ours_bytes": tree_bytes(d_st)}
        shutil.rmtree(d_cons)
        shutil.rmtree(d_st)
        shutil.rmtree(d_hf)
    return rows


def part_deepspeed(j, m, worlds, reps):
    rows = {}
    for w in worlds:
        d_ours = os.path.join(j.work, f"ours_w{w}")
        if not os.path.isdir(d_ours):
            raise RuntimeError(f"{d_ours} is missing: run --parts save first")
        d_ds = os.path.join(j.work, f"ds_w{w}")
        shutil.rmtree(d_ds, ignore_errors=True)
        _, rss_s, e_s = j.run(w, j.py("ds-save", m, w, ["--dir", d_ds]), f"ds_save_w{w}")
        sizes = rank_files(os.path.join(d_ds, "ckpt2"), w)
        raw_w, raw_rec = disk_write(j.work, sizes)
        d_out = os.path.join(j.work, f"ds_fp32_w{w}")
        shutil.rmtree(d_out, ignore_errors=True)
        evict(d_ds)
        wall_c, rss_c, e_c = j.run(1, j.py("ds-to-fp32", m, 1, ["--dir", d_ds, "--out", d_out]), f"ds_to_fp32_w{w}")
        d_st = os.path.join(j.work, f"ours_st_w{w}")
        shutil.rmtree(d_st, ignore_errors=True)
        evict(d_ours)
        wall_o, rss_o, _ = j.run(1, [os.path.join(j.bin_dir, "fsdp-consolidate"), "-q", "--format", "safetensors",
                                     d_ours, d_st], f"ours_consolidate_w{w}")
        s = ev(e_s, "ds_save")
        c = ev(e_c, "ds_to_fp32")
        rows[str(w)] = {"ds_save": s["seconds"], "ds_fsync": s["fsync_s"], "ds_bytes": s["bytes"],
                        "ds_save_rss_before_kb": s["rss_before_kb"], "ds_save_rss_after_kb": s["rss_after_kb"],
                        "ds_job_rss_kb": rss_s, "raw_write": raw_w, "raw_write_recycled": raw_rec,
                        "ds_save_1": s["first_seconds"], "ds_fsync_1": s["first_fsync_s"], "raw_write_bytes": sum(sizes),
                        "ds_to_fp32": c["seconds"], "ds_to_fp32_wall": wall_c, "ds_to_fp32_rss_kb": rss_c,
                        "ds_fp32_bytes": c["bytes"], "ours_consolidate_wall": wall_o,
                        "ours_consolidate_rss_kb": rss_o, "ours_st_bytes": tree_bytes(d_st)}
        shutil.rmtree(d_out)
        shutil.rmtree(d_st)
        shutil.rmtree(d_ds)
    return rows


PARTS = {"save": part_save, "load": part_load, "export": part_export, "deepspeed": part_deepspeed}


def versions():
    out = {}
    for mod in ("torch", "deepspeed", "safetensors"):
        r = subprocess.run([sys.executable, "-c", f"import {mod}; print({mod}.__version__)"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           env=dict(os.environ, DS_ACCELERATOR="cpu"))
        out[mod] = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else "missing"
    return out


def bench(args):
    m = QUICK if args.quick else MODEL
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    j = Jobs(args.bin_dir, work)
    results = {}
    if os.path.exists(args.results):
        with open(args.results) as f:
            results = json.load(f)
    if results and results.get("model") != m:
        results = {}  # another size: start afresh
    results.update(model=m, machine=describe_machine(), versions=versions(), bin_dir=os.path.abspath(args.bin_dir))
    for part in args.parts:
        print(f"== {part} (worlds {args.worlds}, {'quick' if args.quick else 'full'} size)", flush=True)
        t = time.time()
        results.setdefault(part, {}).update(PARTS[part](j, m, args.worlds, 1 if args.quick else args.reps))  # rows by world
        results.setdefault("dates", {})[part] = datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC")
        print(f"== {part}: {time.time() - t:.0f} s", flush=True)
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)
    print(make_table(results))


# ---- the table --------------------------------------------------------------------------------


def fmt_s(x):
    return "n/a" if x is None or x != x else f"{x:.2f} s"


def mib(kb):
    return f"{kb / 1024:.0f} MiB"


def mark(ok):
    return "**yes**" if ok else "no"


def make_table(r):
    out = []
    if "save" in r:
        out += ["| world | save (model + AdamW, 1.2 GB) | blocked, call 1 / 2 | durable, call 1 / 2 | "
                "call 2 / raw write (fresh) | target (call 2) |", "|---|---|---|---|---|---|"]
        for w, row in r["save"].items():
            raw = row["raw_write"]
            for v, name in (("sync", "DCP save"), ("thread", "DCP async_save, THREAD"),
                            ("process", "DCP async_save, PROCESS"),
                            ("pinned", "DCP async_save, cached pinned staging")):
                calls = row["dcp"].get(v, {})
                errs = [e["error"] for e in calls.values() if e.get("error")]
                if errs:
                    out.append(f"| {w} | {name} | fails on the CPU: {errs[0].split('.')[0][:80]} | | | |")
                    continue
                if "1" not in calls or "2" not in calls:
                    continue
                e1, e2 = calls["1"], calls["2"]
                out.append(f"| {w} | {name} | {e1['blocked']:.2f} / {e2['blocked']:.2f} s | "
                           f"{e1['durable']:.2f} / {e2['durable']:.2f} s | {e2['durable'] / raw:.2f} | |")
            ds = r.get("deepspeed", {}).get(w)
            if ds:
                d1, d2 = ds["ds_save_1"] + ds["ds_fsync_1"], ds["ds_save"] + ds["ds_fsync"]
                out.append(f"| {w} | DeepSpeed ZeRO-3 save_checkpoint (+ fsync) | {ds['ds_save_1']:.2f} / "
                           f"{ds['ds_save']:.2f} s | {d1:.2f} / {d2:.2f} s | {d2 / raw:.2f} | |")
            # The disk's limit: the fastest raw write + fsync of the same bytes, any way.
            limit = min(x for x in (raw, row["raw_write_recycled"], row.get("raw_write_direct", raw)))
            s1, s2 = row["ours_sync_1"], row["ours_sync"]
            out.append(f"| {w} | **train_gpt --save-dir** | {s1:.2f} / {s2:.2f} s | {s1:.2f} / {s2:.2f} s | "
                       f"{s2 / raw:.2f} | {mark(limit / s2 >= 0.9)}: raw limit / save = {limit / s2:.2f} (>= 0.9) |")
            b1, b, d = row["ours_async_blocked_1"], row["ours_async_blocked"], row["ours_async_durable"]
            split = (f" (call {row['ours_async_call']:.3f} + backward's wait {row['ours_async_wait']:.3f})"
                     if "ours_async_call" in row else "")
            out.append(f"| {w} | **train_gpt --async-save** | {b1:.2f} / {b:.3f} s{split} | - / {d:.2f} s "
                       f"(call 3) | {d / raw:.2f} | {mark(b <= 0.1 * s2)}: blocked / sync = {b / s2:.3f} (<= 0.1) |")
            if "ours_async_steps" in row:
                a, sy = row["ours_async_steps"], row["ours_sync_steps"]
                out.append(f"| {w} | steps 2-3, mean: beside an async save (its copy, checksums and write); "
                           f"after a sync save | {a:.2f} s; {sy:.2f} s | | | the background save costs the step "
                           f"{a - sy:+.3f} s ({(a - sy) / s2:+.3f} of a sync save) |")
            direct = row.get("raw_write_direct")
            out.append(f"| {w} | raw write + fsync, a file per rank ({row['raw_write_bytes'] / 1e6:.0f} MB): fresh; "
                       f"recycled; O_DIRECT | | {raw:.2f} s; {row['raw_write_recycled']:.2f} s; "
                       f"{fmt_s(direct)} | 1.00 | the limit: {limit:.2f} s |")
        out.append("")
    if "load" in r:
        out += ["| ranks saved -> loading | DCP load + set_state_dict | train_gpt --resume | speed-up | raw cold read "
                "| ours / raw limit | target: raw limit / load >= 0.9 (same world) |", "|---|---|---|---|---|---|---|"]

        def each(row, k):
            reps = row.get("reps", [])
            return f"{fmt_s(row[k])}" + (f" ({', '.join(f'{x[k]:.2f}' for x in reps)})" if len(reps) > 1 else "")

        for k, row in r["load"].items():
            src, dst = k.split("to")
            limit = min(row["raw_read"], row.get("raw_read_direct", row["raw_read"]))
            direct = f"; O_DIRECT {each(row, 'raw_read_direct')}" if "raw_read_direct" in row else ""
            target = f"{mark(limit / row['ours'] >= 0.9)}: {limit / row['ours']:.2f}" if src == dst else "-"
            out.append(f"| {src} -> {dst} | {each(row, 'dcp')} | {each(row, 'ours')} | "
                       f"{row['dcp'] / row['ours']:.2f} | {each(row, 'raw_read')}{direct}, {row['bytes_ours'] / 1e6:.0f} MB "
                       f"| {row['ours'] / limit:.2f} | {target} |")
        out.append("")
    if "export" in r:
        out += ["| world saved | DCP HuggingFaceStorageWriter + consolidation, in the job | train_gpt --consolidate-to "
                "(HDF5), in the job | DCP consolidate_safetensors_files, offline | its peak RSS | fsdp-consolidate "
                "--format safetensors, offline (wall) | its peak RSS | bytes DCP / ours |",
                "|---|---|---|---|---|---|---|---|"]
        for w, row in r["export"].items():
            h5 = r.get("save", {}).get(w, {}).get("ours_export_h5")
            out.append(f"| {w} | {fmt_s(row['dcp_hf_in_job'])} | {fmt_s(h5)} | {fmt_s(row['dcp_consolidate'])} "
                       f"({fmt_s(row['dcp_consolidate_wall'])} wall) | {mib(row['dcp_consolidate_rss_kb'])} | "
                       f"{fmt_s(row['ours_consolidate_wall'])} | {mib(row['ours_consolidate_rss_kb'])} | "
                       f"{row['dcp_bytes'] / 1e6:.0f} / {row['ours_bytes'] / 1e6:.0f} MB |")
        out.append("")
    if "deepspeed" in r:  # its save_checkpoint is in the save table
        out += ["| world saved | DeepSpeed zero_to_fp32 -> safetensors (in the process; wall) | its peak RSS | "
                "fsdp-consolidate --format safetensors (wall) | its peak RSS | bytes DeepSpeed / ours |",
                "|---|---|---|---|---|---|"]
        for w, row in r["deepspeed"].items():
            out.append(f"| {w} | {fmt_s(row['ds_to_fp32'])}; {fmt_s(row['ds_to_fp32_wall'])} | "
                       f"{mib(row['ds_to_fp32_rss_kb'])} | {fmt_s(row['ours_consolidate_wall'])} | "
                       f"{mib(row['ours_consolidate_rss_kb'])} | {row['ds_fp32_bytes'] / 1e6:.0f} / "
                       f"{row['ours_st_bytes'] / 1e6:.0f} MB |")
    return "\n".join(out)


# ---- check (the ctest case) -------------------------------------------------------------------


def probe_check():
    """Why the check cannot run here (a reason), or None."""
    try:
        import torch

        v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        if v < (2, 7):
            return f"torch {torch.__version__}: FSDP2 on the CPU needs torch >= 2.7"
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        import safetensors  # noqa: F401
        import h5py  # noqa: F401

        if not dist.is_gloo_available():
            return "torch.distributed has no Gloo"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    r = subprocess.run([sys.executable, "-c", "import deepspeed"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    if r.returncode:
        return "deepspeed does not import: " + r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "no deepspeed"
    return None


def load_any(path):
    """name -> float64 numpy array from an HDF5 consolidated file or a safetensors file/dir."""
    import numpy as np

    if path.endswith(".h5"):
        import h5py

        with h5py.File(path, "r") as f:
            return {k: f["model"][k][()].astype(np.float64) for k in f["model"].keys()}
    from safetensors.numpy import load_file

    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    out = {}
    for f in files:
        out.update({k: v.astype(np.float64) for k, v in load_file(f).items()})
    return out


def diff(a, b, what):
    if set(a) != set(b):
        raise AssertionError(f"{what}: names differ: {sorted(set(a) ^ set(b))}")
    worst, at = 0.0, ""
    for k in a:
        if a[k].shape != b[k].shape:
            raise AssertionError(f"{what}: {k} has shape {a[k].shape} against {b[k].shape}")
        d = float(abs(a[k] - b[k]).max()) if a[k].size else 0.0
        if d > worst:
            worst, at = d, k
    return worst, at


def check(args):
    why = probe_check()
    if why:
        print(f"compare_ckpt.py check: SKIPPED: {why}")
        return SKIP
    import tempfile

    world = 2
    m = dict(CHECK, batch_size=4)
    with tempfile.TemporaryDirectory(prefix="compare_ckpt_") as work:
        j = Jobs(args.bin_dir, work, verbose=True)
        t = time.time()
        fsdp2 = os.path.join(work, "fsdp2.safetensors")
        _, _, e = j.run(world, j.py("check-dcp", m, world, ["--dir", os.path.join(work, "dcp"), "--out", fsdp2]),
                        "check_dcp", timeout=240)
        c = ev(e, "check_dcp")
        if c["mismatched_all_ranks"] or not c["n_tensors"]:
            print(f"FAILED: after DCP save and load, {c['mismatched_all_ranks']} tensors (over both ranks) differ "
                  f"from the saved ones (of {c['n_tensors']} on rank 0; rank 0's: {c['mismatched'][:8]})")
            return 1
        ours = os.path.join(work, "ours.h5")
        j.run(world, j.ours(m, world, ["--save-dir", os.path.join(work, "ours"), "--consolidate-to", ours]),
              "check_ours", timeout=120)
        st = os.path.join(work, "ours_st")
        j.run(1, [os.path.join(args.bin_dir, "fsdp-consolidate"), "-q", "--format", "safetensors",
                  os.path.join(work, "ours"), st], "check_ours_safetensors", timeout=60)
        j.run(world, j.py("check-ds", m, world, ["--dir", os.path.join(work, "ds")]), "check_ds", timeout=240)
        ds = os.path.join(work, "ds_fp32")
        j.run(1, j.py("ds-to-fp32", m, 1, ["--dir", os.path.join(work, "ds"), "--out", ds]), "check_ds_to_fp32",
              timeout=120)
        w_ours, w_st, w_fsdp2, w_ds, w_init = (load_any(p) for p in (ours, st, fsdp2, ds, j.init_file(m)))
        moved, _ = diff(w_ours, w_init, "ours vs init")
        d_st, at_st = diff(w_st, w_ours, "ours: safetensors vs HDF5 export")
        d_f, at_f = diff(w_ours, w_fsdp2, "ours vs FSDP2 (DCP round trip)")
        d_ds, at_ds = diff(w_ours, w_ds, "ours vs DeepSpeed zero_to_fp32")
        print(f"after {m['steps']} steps at world {world} (weights moved up to {moved:.2e} from the start):\n"
              f"  ours safetensors vs ours HDF5 export: {d_st:.2e} {at_st}\n"
              f"  ours vs FSDP2 after DCP save + load:  {d_f:.2e} {at_f}\n"
              f"  ours vs DeepSpeed ZeRO-3 zero_to_fp32: {d_ds:.2e} {at_ds}\n"
              f"  tolerance {CHECK_TOL:g}; {time.time() - t:.0f} s")
        if moved < 10 * CHECK_TOL:
            print(f"FAILED: training moved the weights only {moved:.2e}: the check could not tell")
            return 1
        if d_st != 0.0 or d_f > CHECK_TOL or d_ds > CHECK_TOL:
            print("FAILED: the checkpoints do not hold the same weights")
            return 1
    print("OK")
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--bin-dir", required=True)
    b.add_argument("--quick", action="store_true", help="2 layers, d_model 512 (~10 M parameters)")
    b.add_argument("--worlds", default="1,2,4", type=lambda s: [int(x) for x in s.split(",")])
    b.add_argument("--parts", default="save,load,export,deepspeed", type=lambda s: s.split(","))
    b.add_argument("--reps", type=int, default=2, help="save and load: repetitions, alternately first (median)")
    b.add_argument("--work", default="build/bench/ckpt")
    b.add_argument("--results", default="build/bench/ckpt/results.json")
    t = sub.add_parser("table")
    t.add_argument("results")
    c = sub.add_parser("check")
    c.add_argument("--bin-dir", required=True)
    args = p.parse_args()
    if args.cmd == "bench":
        bad = [x for x in args.parts if x not in PARTS]
        if bad:
            p.error(f"--parts {','.join(bad)}: not a part (save, load, export, deepspeed)")
        return bench(args)
    if args.cmd == "table":
        with open(args.results) as f:
            print(make_table(json.load(f)))
        return 0
    return check(args)


if __name__ == "__main__":
    sys.exit(main() or 0)
