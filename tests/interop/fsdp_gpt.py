#!/usr/bin/python3
"""The GPT of docs/design.md ("Contracts") trained with PyTorch FSDP1: the peer that
train_gpt is compared with (scripts/bench/compare-pytorch.sh, tests/interop/compare_fsdp.py).

It computes what train_gpt computes, step for step:
  - weights: --init-from FILE.h5, a consolidated file (h5py), the file train_gpt
    --init-from loads too; --write-init FILE.h5 writes one (GPT-2 init, from --seed);
  - batches: train_gpt's sampler (std::mt19937_64, libstdc++'s uniform_int_distribution),
    reproduced exactly below; rank r of W takes rows [r*B/W, (r+1)*B/W) of the global batch;
  - loss: mean next-token cross-entropy of this rank's rows; FSDP averages gradients over
    ranks; the logged loss is the mean over ranks;
  - AdamW (betas 0.9/0.999, eps 1e-8, decay on every parameter), linear warm-up then
    cosine to 0.1 x lr (or constant), FSDP's clip_grad_norm_;
  - --precision bf16: MixedPrecision(param_dtype=bf16, reduce_dtype=bf16), fp32 master
    weights, logits cast to fp32 before the loss (train_gpt's output_dtype=fp32).
FSDP1: FULL_SHARD, each Block a unit (ModuleWrapPolicy), device_id=cpu, use_orig_params.

Launch: one process per rank with the torchrun environment (fsdp-run --nproc N -- ...);
with no RANK set it runs alone (world 1). Writes --log-jsonl (rank 0: per step
{"step", "loss", "lr", "step_s"}, then {"final": true, "peak_rss_kb": [per rank]}) and,
with --full-state-to, FSDP's FULL_STATE_DICT (rank0_only; on offload_to_cpu see train()) as a
consolidated-format HDF5 file. Uses Debian's python3-torch, python3-h5py, python3-numpy.
"""
import argparse
import json
import math
import os
import resource
import sys
import time

ALPHABET = b"abcdefghijklmnopqrstuvwxyz .,;!?"
MASK64 = (1 << 64) - 1


class MT19937_64:
    """std::mt19937_64, bit for bit."""

    def __init__(self, seed):
        mt = [0] * 312
        mt[0] = seed & MASK64
        for i in range(1, 312):
            mt[i] = (6364136223846793005 * (mt[i - 1] ^ (mt[i - 1] >> 62)) + i) & MASK64
        self.mt = mt
        self.i = 312

    def _twist(self):
        mt = self.mt
        for i in range(312):
            x = (mt[i] & 0xFFFFFFFF80000000) | (mt[(i + 1) % 312] & 0x7FFFFFFF)
            xa = x >> 1
            if x & 1:
                xa ^= 0xB5026F5AA96619E9
            mt[i] = mt[(i + 156) % 312] ^ xa
        self.i = 0

    def __call__(self):
        if self.i >= 312:
            self._twist()
        x = self.mt[self.i]
        self.i += 1
        x ^= (x >> 29) & 0x5555555555555555
        x ^= (x << 17) & 0x71D67FFFEDA60000
        x ^= (x << 37) & 0xFFF7EEE000000000
        x ^= x >> 43
        return x & MASK64


class Sampler:
    """train_gpt's synthetic Markov task (class Data in examples/gpt/data.cpp)."""

    def __init__(self, seed):
        self.seed = seed
        g = MT19937_64(seed ^ 0x5EED)
        # uniform_int_distribution<int>(0, 31) over a 64-bit engine: libstdc++ (GCC 11+)
        # uses Lemire's method, (g() * 32) >> 64, which never rejects for a power of two.
        self.next = [((g() * 32) >> 64, (g() * 32) >> 64) for _ in ALPHABET]

    def batch(self, step, rows, block):
        """(rows, block + 1) token ids for `step`, as a list of lists."""
        g = MT19937_64((self.seed * 1000003 + step) & MASK64)
        n = len(ALPHABET)
        out = []
        for _ in range(rows):
            s = g() % n
            row = []
            for _ in range(block + 1):
                row.append(ALPHABET[s])
                s = self.next[s][0] if g() % 10 < 7 else self.next[s][1]
            out.append(row)
        return out


def lr_at(step, args):
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_schedule == "cosine":
        progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    return args.lr


def build_model(args):
    """The GPT of docs/design.md, "Contracts", with the FQNs of examples/gpt/gpt_model.h."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    d, h = args.d_model, args.n_head
    # How attention is computed, as train_gpt's --attention: sdpa (F.scaled_dot_product_attention,
    # is_causal) unless the caller's arguments say math.
    attention = getattr(args, "attention", "sdpa")
    if attention not in ("sdpa", "math"):
        raise SystemExit(f"--attention {attention}: use sdpa or math")

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            B, T, C = x.shape
            hd = C // h
            q, k, v = self.qkv(x).split(C, dim=2)
            q, k, v = (t.view(B, T, h, hd).transpose(1, 2) for t in (q, k, v))
            if attention == "sdpa":  # train_gpt's default: the same ATen kernel
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # --attention math: the explicit softmax
                att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                att = att.masked_fill(mask.logical_not(), float("-inf"))
                att = torch.softmax(att, -1)  # dropout 0: identity
                y = torch.matmul(att, v)
            return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(d, 4 * d)
            self.proj = nn.Linear(4 * d, d)

        def forward(self, x):
            return self.proj(F.gelu(self.fc(x)))  # exact (erf) GELU

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d, eps=1e-5)
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(d, eps=1e-5)
            self.mlp = Mlp()

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(256, d)
            self.wpe = nn.Embedding(args.block_size, d)
            self.blocks = nn.ModuleList([Block() for _ in range(args.n_layer)])
            self.ln_f = nn.LayerNorm(d, eps=1e-5)
            self.lm_head = nn.Linear(d, 256, bias=False)

        def forward(self, idx):
            pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    return GPT(), Block


def model_attrs(args):
    return {"n_layer": args.n_layer, "n_head": args.n_head, "d_model": args.d_model,
            "block_size": args.block_size, "vocab_size": 256}


def write_consolidated(path, tensors, attrs, step):
    """A consolidated file in the contract format (docs/design.md, "Contracts"), fp32."""
    import h5py
    import numpy as np

    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        f.attrs["format"] = "fsdp.consolidated"
        f.attrs["format_version"] = np.int64(1)
        f.attrs["dtype"] = "float32"
        f.attrs["step"] = np.int64(step)
        for k, v in attrs.items():
            f.attrs[k] = np.int64(v)
        g = f.create_group("model")
        for name, t in tensors.items():
            g.create_dataset(name, data=t.detach().float().cpu().numpy())
    os.replace(tmp, path)


def write_init(args):
    """GPT-2 style initial weights from --seed, as train_gpt's init_weights does."""
    import torch

    torch.manual_seed(args.seed)
    model, _ = build_model(args)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "ln" in n:
                continue
            if n.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    write_consolidated(args.write_init, dict(model.named_parameters()), model_attrs(args), 0)


def load_init(model, path, args):
    import h5py
    import torch

    with h5py.File(path, "r") as f:
        for key, want in model_attrs(args).items():
            got = int(f.attrs[key])
            if got != want:
                sys.exit(f"fsdp_gpt.py: --{key.replace('_', '-')} {want} but {path} has {key} {got}")
        params = dict(model.named_parameters())
        names = set(f["model"].keys())
        if names != set(params):
            sys.exit(f"fsdp_gpt.py: {path}: names differ from the model's: {sorted(names ^ set(params))}")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(torch.from_numpy(f["model"][n][()]).to(p.dtype))


def init_distributed():
    import torch.distributed as dist

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # PyTorch 2.4+ asks for a libuv TCPStore server by default, which Debian's build lacks
    # (see scripts/torchrun.py): make the store ourselves without it.
    kw = {"use_libuv": False} if "use_libuv" in (dist.TCPStore.__init__.__doc__ or "") else {}
    from datetime import timedelta

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timedelta(seconds=120), **kw)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return rank, world


class CommCounter:
    """Bytes each rank puts into collectives, counted at the process group: the
    torch.distributed functions (and the functional collectives DTensor uses) are wrapped,
    so whatever FSDP1, FSDP2 or DeepSpeed calls is seen, by name. The convention is the one
    of this library's CommStats (include/fsdp/stats.h), which train_gpt logs as comm_bytes:
    a collective counts the size of its full (unsharded) buffer: an all-gather its output,
    a reduce-scatter its input, an all-reduce, a broadcast and a reduce their tensor. As
    there, nothing is counted at world 1 (no bytes leave the process); the calls are still
    listed. A collective that another wrapped one calls (torch's own fallbacks) counts once,
    as the outer one."""

    def __init__(self, world):
        import threading

        self.world = world
        self.local = threading.local()
        self.enabled = True
        self.reset()

    def reset(self):
        self.bytes, self.calls = {}, {}

    @staticmethod
    def nbytes(x):
        if isinstance(x, (list, tuple)):
            return sum(CommCounter.nbytes(t) for t in x)
        return x.numel() * x.element_size() if hasattr(x, "element_size") else 0

    def install(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        def arg(a, k, i, name):
            return k[name] if name in k else (a[i] if len(a) > i else None)

        def out0(name):
            return lambda a, k: self.nbytes(arg(a, k, 0, name))

        def in1(name):
            return lambda a, k: self.nbytes(arg(a, k, 1, name))

        sizes = {  # function: its full buffer, by the convention above
            "all_gather_into_tensor": out0("output_tensor"),
            "_all_gather_base": out0("output_tensor"),
            "all_gather_single": out0("output_tensor"),
            "all_gather": out0("tensor_list"),
            "all_gather_coalesced": out0("output_tensor_lists"),
            "reduce_scatter_tensor": in1("input"),
            "_reduce_scatter_base": in1("input"),
            "reduce_scatter_single": in1("input"),
            "reduce_scatter": in1("input_list"),
            "all_reduce": out0("tensor"),
            "all_reduce_coalesced": out0("tensors"),
            "broadcast": out0("tensor"),
            "reduce": out0("tensor"),
            "all_to_all_single": in1("input"),
            "all_to_all": in1("input_tensor_list"),
            "send": out0("tensor"),
            "isend": out0("tensor"),
            "barrier": lambda a, k: 0,
        }
        for mod in (dist, c10d):
            for name, size in sizes.items():
                if hasattr(mod, name):
                    setattr(mod, name, self.wrap(name, getattr(c10d, name, getattr(mod, name)), size))
        try:  # DTensor's collectives (FSDP2's gradient norm)
            import torch.distributed._functional_collectives as funcol

            world = self.world
            fsizes = {"all_reduce": lambda a, k: self.nbytes(a[0]),
                      "all_gather_tensor": lambda a, k: self.nbytes(a[0]) * world,
                      "reduce_scatter_tensor": lambda a, k: self.nbytes(a[0])}
            for name, size in fsizes.items():
                if hasattr(funcol, name):
                    setattr(funcol, name, self.wrap("functional." + name, getattr(funcol, name), size))
        except ImportError:
            pass

    def wrap(self, name, fn, size):
        if getattr(fn, "_comm_counted", False):
            return fn

        def counted(*a, **k):
            depth = getattr(self.local, "depth", 0)
            if depth == 0 and self.enabled:
                self.calls[name] = self.calls.get(name, 0) + 1
                if self.world > 1:
                    self.bytes[name] = self.bytes.get(name, 0) + size(a, k)
            self.local.depth = depth + 1
            try:
                return fn(*a, **k)
            finally:
                self.local.depth = depth

        counted._comm_counted = True
        counted.__wrapped__ = fn
        return counted


def ds_config(args, per_rank):
    """DeepSpeed's configuration: ZeRO-3, set so that what can compute as FSDP does.
    stage3_param_persistence_threshold 0: by default ZeRO-3 keeps every parameter under
    1e5 elements whole on every rank (not sharded, never gathered; at these sizes most
    of the model); 0 shards them all, as FSDP does. bf16: DeepSpeed's bf16 mode (module
    weights in bf16, fp32 master partitions in the optimizer, gradients reduced in bf16
    (communication_data_type defaults to the model's) and accumulated in bf16
    (grad_accum_dtype), then cast to fp32 for the optimizer: as FSDP1's reduce_dtype bf16);
    no loss scaling in bf16. gradient_clipping: the global norm over the fp32 gradient
    partitions, scaled by max_norm / (norm + 1e-6) when above: torch's clip_grad_norm_."""
    return {
        "train_batch_size": args.batch_size,
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip_grad if args.clip_grad > 0 else 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": args.precision == "bf16"},
        "fp16": {"enabled": False},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def ds_set_fp32_masters(engine, model, init):
    """DeepSpeed makes its fp32 master partitions from the module's weights after casting
    them to bf16, so in bf16 training would start from bf16-rounded weights; FSDP keeps the
    fp32 ones. Writes the fp32 initial weights into the master partitions (each rank its
    own, padded at the end as ZeRO-3 pads), so both start alike."""
    import torch

    opt = engine.optimizer
    for n, p in model.named_parameters():
        part, _ = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False)
        rank = opt._get_param_partition_rank(p)
        full = init[n].flatten().float()
        pad = part.numel() * engine.dp_world_size - full.numel()
        if pad:
            full = torch.cat([full, full.new_zeros(pad)])
        part.data.copy_(full.narrow(0, part.numel() * rank, part.numel()))


def train(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    if args.impl == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
    rank, world = init_distributed()
    if args.batch_size % world:
        sys.exit(f"fsdp_gpt.py: --batch-size {args.batch_size} must be divisible by world size {world}")
    if args.impl != "fsdp1" and (args.dcp_save or args.dcp_load or args.torch_save_to):
        sys.exit(f"fsdp_gpt.py: --dcp-save, --dcp-load and --torch-save-to are written for --impl fsdp1; "
                 f"drop them or use --impl fsdp1 (not {args.impl})")
    counter = CommCounter(world)
    counter.install()
    torch.manual_seed(args.seed)
    model, Block = build_model(args)
    load_init(model, args.init_from, args)
    bf16 = args.precision == "bf16"
    engine = None
    if args.impl == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                     use_orig_params=True, sharding_strategy=ShardingStrategy.FULL_SHARD, mixed_precision=mp)
        clip = model.clip_grad_norm_
    elif args.impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16
              else MixedPrecisionPolicy())
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        clip = lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # noqa: E731
    if args.impl != "deepspeed":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=args.weight_decay)
    else:
        # Its CPU backend JIT-compiles a shared-memory all-reduce (a C++ extension, minutes
        # and a compiler) used by inference_all_reduce alone; training calls Gloo's.
        import deepspeed.comm.torch

        deepspeed.comm.torch.build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo")
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        client = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                   weight_decay=args.weight_decay)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=client,
                                                 config=ds_config(args, args.batch_size // world))
        ds_set_fp32_masters(engine, model, init)
        del init

    # Batches are made before training (pure Python is slow; train_gpt's C++ sampler
    # costs microseconds inside its step time).
    sampler = Sampler(args.seed)
    per = args.batch_size // world
    batches = [torch.tensor(sampler.batch(s, args.batch_size, args.block_size)[rank * per:(rank + 1) * per],
                            dtype=torch.long) for s in range(args.steps)]

    io_log = open(args.io_log, "a") if (rank == 0 and args.io_log) else None

    def timed(event, path, op):
        """Like train_gpt --io-log: from a barrier to a barrier, rank 0 records the time."""
        dist.barrier()
        t = time.perf_counter()
        extra = op() or {}
        dist.barrier()
        if io_log:
            io_log.write(json.dumps(dict({"event": event, "path": path, "seconds": time.perf_counter() - t},
                                         **extra)) + "\n")
            io_log.flush()

    if args.dcp_load:
        timed("load", args.dcp_load, lambda: dcp_load(model, opt, args.dcp_load))

    log = open(args.log_jsonl, "w") if (rank == 0 and args.log_jsonl) else None
    model.train()
    for step in range(args.steps):
        step_lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = step_lr
        counter.reset()
        t0 = time.perf_counter()
        rows = batches[step]
        x, y = rows[:, :-1], rows[:, 1:]
        if engine is not None:  # clipping and the optimizer step are engine.step's
            logits = engine(x).float()
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            engine.backward(loss)
            engine.step()
        else:
            logits = model(x).float()
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
            if args.clip_grad > 0:
                clip(args.clip_grad)
            opt.step()
            opt.zero_grad()
        counter.enabled = False  # the logged loss's all-reduce is not training's (as train_gpt)
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        counter.enabled = True
        mean = total.item() / world
        dt = time.perf_counter() - t0
        if log:
            log.write(json.dumps({"step": step + 1, "loss": mean, "lr": step_lr, "step_s": dt,
                                  "comm_bytes": sum(counter.bytes.values()), "comm_bytes_by": counter.bytes,
                                  "comm_calls": counter.calls}) + "\n")
            log.flush()
    counter.enabled = False

    if args.dcp_save:
        timed("save", args.dcp_save, lambda: dcp_save(model, opt, args.dcp_save))
    if args.torch_save_to:
        timed("export", args.torch_save_to, lambda: full_state_torch_save(model, rank, args.torch_save_to))
    if args.full_state_to:
        sd = full_state(args.impl, model, engine)
        if rank == 0:
            write_consolidated(args.full_state_to, sd, model_attrs(args), args.steps)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss], dtype=torch.int64)
    every = [torch.zeros_like(rss) for _ in range(world)]
    dist.all_gather(every, rss)
    if log:
        log.write(json.dumps({"final": True, "impl": args.impl, "torch": torch.__version__,
                              "peak_rss_kb": [int(t.item()) for t in every]}) + "\n")
        log.close()
    dist.barrier()
    # Leave without tearing down: torch 2.6's Gloo threads at interpreter exit sometimes
    # abort a rank ("terminate called without an active exception") after all is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def full_state(impl, model, engine):
    """The fp32 weights by name, whole on rank 0 (other ranks: whatever they get)."""
    if impl == "fsdp1":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # offload_to_cpu=True would be a no-op here (the model is in host memory) and FSDP1
        # 2.6 on a CPU device segfaults with it at world >= 2 (handle.to_cpu() on a CPU
        # flat parameter frees what the clone then reads), and refuses it under NO_SHARD
        # (world 1). rank0_only still keeps the full copy on rank 0 alone.
        cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            return model.state_dict()
    if impl == "fsdp2":  # DTensor parameters, gathered one at a time
        return {n: p.full_tensor() for n, p in model.named_parameters()}
    from deepspeed.utils import safe_get_full_fp32_param  # the fp32 masters, not the bf16 copies

    return {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}


def dcp_save(model, opt, path):
    """Model and optimizer state, each rank its shard, with torch.distributed.checkpoint:
    what a PyTorch user calls (get_state_dict: SHARDED_STATE_DICT for FSDP), every file
    fsynced (FileSystemWriter's sync_files, its default)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(path, sync_files=True))


def dcp_load(model, opt, path):
    """The inverse of dcp_save into a freshly built model and optimizer (get_state_dict
    makes the optimizer's state to load into, then set_state_dict puts it in place)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    steps = {float(v["step"]) for v in opt.state.values() if "step" in v}
    return {"optimizer_step": sorted(steps)}


def full_state_torch_save(model, rank, path):
    """FSDP's FULL_STATE_DICT gathered to rank 0 and written with torch.save, fsynced: the
    PyTorch counterpart of the consolidated export."""
    import torch
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):
        sd = model.state_dict()
    if rank == 0:
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--n-layer", type=int, default=2)
    a("--n-head", type=int, default=4)
    a("--d-model", type=int, default=64)
    a("--block-size", type=int, default=32)
    a("--batch-size", type=int, default=16)
    a("--steps", type=int, default=200)
    a("--lr", type=float, default=3e-3)
    a("--weight-decay", type=float, default=0.01)
    a("--warmup-steps", type=int, default=10)
    a("--lr-schedule", choices=["constant", "cosine"], default="cosine")
    a("--clip-grad", type=float, default=1.0)
    a("--seed", type=int, default=1337)
    a("--precision", choices=["fp32", "bf16"], default="fp32")
    a("--attention", choices=["sdpa", "math"], default="sdpa",
      help="as train_gpt's --attention: F.scaled_dot_product_attention, or the explicit softmax")
    a("--impl", choices=["fsdp1", "fsdp2", "deepspeed"], default="fsdp1",
      help="the anchor: PyTorch FSDP1, PyTorch FSDP2 (fully_shard) or DeepSpeed ZeRO-3")
    a("--init-from", help="consolidated HDF5 file with the initial weights")
    a("--write-init", help="write GPT-2 style initial weights from --seed to this file and exit")
    a("--log-jsonl", default="")
    a("--full-state-to", default="", help="write FSDP's FULL_STATE_DICT here at the end (HDF5)")
    a("--dcp-save", default="", help="at the end, save model and optimizer with torch.distributed.checkpoint here")
    a("--dcp-load", default="", help="before training, load model and optimizer from this DCP checkpoint")
    a("--torch-save-to", default="", help="at the end, FULL_STATE_DICT + torch.save (fsynced) to this file")
    a("--io-log", default="", help="rank 0 appends {event, path, seconds} per save, load and export here")
    args = p.parse_args(argv)
    if not args.write_init and not args.init_from:
        p.error("give --init-from FILE (or --write-init FILE)")
    return args


if __name__ == "__main__":
    a = parse()
    if a.write_init:
        write_init(a)
    else:
        train(a)
