#!/usr/bin/env python3
"""Reduce-scatter variants over PyTorch's own ProcessGroupGloo (Note [Gloo reduce-scatter]):
the bytes each rank writes (its sockets: /proc/self/io's wchar around the call, all
threads) and the time of one call (median of ITERS after a warm-up, slowest rank), each
result checked against the exact sum. Variants:

  allreduce  SUM all_reduce of the flat gradient (bf16 widened to fp32), then the chunk:
             the backend's former path, and what FSDP2 gets on Gloo
  native     dist.reduce_scatter_tensor (ProcessGroupGloo's reduce_scatter_single in 2.15,
             _reduce_scatter_base in 2.6)
  ring       N-1 steps over isend/irecv, each sending one chunk to the next rank and adding
             the received one (partial sums travel: fp32 for bf16)
  direct     every rank sends chunk j to rank j at once and sums the N parts of its own
             chunk in rank order (fp32 for bf16): the backend's path

  torchrun --nproc-per-node N tests/interop/gloo_reduce_scatter.py   (Debian's torch 2.6:
  scripts/torchrun.py --nproc_per_node N ...)
  environment: SIZES_MIB=1,16,64 (of fp32; bf16 gets the same element count), DTYPE=fp32|bf16,
  ITERS=5
"""
import os
import statistics
import time

import torch
import torch.distributed as dist

# The store by hand, without libuv, which Debian's python3-torch 2.6 lacks (under torchrun,
# a client of the agent's store): USE_LIBUV=0 does not reach every store in 2.6.
kw = {"use_libuv": False} if "use_libuv" in (dist.TCPStore.__init__.__doc__ or "") else {}
r, N = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
serve = r == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), N, serve, **kw)
dist.init_process_group("gloo", store=store, rank=r, world_size=N)
torch.set_num_threads(1)


def io():
    d = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return int(d["wchar"])


def allreduce(x, out):
    buf = x if x.dtype == torch.float32 else x.float()
    dist.all_reduce(buf)
    out.copy_(buf.chunk(N)[r])


def native(x, out):
    dist.reduce_scatter_tensor(out, x)


def ring(x, out):
    buf = x if x.dtype == torch.float32 else x.float()
    ch = buf.chunk(N)
    tmp = torch.empty_like(ch[0])
    for s in range(N - 1):
        sw = dist.isend(ch[(r - s - 1) % N], (r + 1) % N)
        rw = dist.irecv(tmp, (r - 1) % N)
        rw.wait()
        sw.wait()
        ch[(r - s - 2) % N].add_(tmp)
    out.copy_(ch[r])


def direct(x, out):
    ch = x.chunk(N)
    works, parts = [], {}
    for k in range(1, N):
        j = (r + k) % N
        works.append(dist.isend(ch[j], j))
        i = (r - k) % N
        parts[i] = torch.empty_like(ch[r])
        works.append(dist.irecv(parts[i], i))
    for w in works:
        w.wait()
    parts[r] = ch[r]
    acc = parts[0].float() if x.dtype != torch.float32 else out.copy_(parts[0])
    for i in range(1, N):
        acc.add_(parts[i])
    if acc is not out:
        out.copy_(acc)


variants = dict(allreduce=allreduce, native=native, ring=ring, direct=direct)
sizes = [int(s) for s in os.environ.get("SIZES_MIB", "1,16,64").split(",")]
dname = os.environ.get("DTYPE", "fp32")
dtype = dict(fp32=torch.float32, bf16=torch.bfloat16)[dname]
iters = int(os.environ.get("ITERS", "5"))
for mib in sizes:
    numel = mib * (1 << 20) // 4
    x0 = (torch.arange(numel) % 7 + r).to(dtype)
    want = sum(torch.arange(numel) % 7 + q for q in range(N)).chunk(N)[r].to(dtype)
    for name, f in variants.items():
        ts, ws = [], []
        for it in range(iters + 1):
            x = x0.clone()
            out = torch.empty(numel // N, dtype=dtype)
            dist.barrier()
            w0 = io()
            t0 = time.perf_counter()
            try:
                f(x, out)
            except Exception as e:  # a variant this torch lacks
                if r == 0:
                    print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
                break
            t1 = time.perf_counter()
            w1 = io()
            assert torch.equal(out, want), name
            if it:
                ts.append(t1 - t0)
                ws.append(w1 - w0)
        if not ts:
            continue
        t = torch.tensor([statistics.median(ts), statistics.median(ws)], dtype=torch.float64)
        g = [torch.empty_like(t) for _ in range(N)]
        dist.all_gather(g, t)
        if r == 0:
            flat = numel * x0.element_size()
            sent = statistics.mean(float(v[1]) for v in g)
            print(f"torch {torch.__version__.split('+')[0]}  world {N}  {name:9s}  {dname}  "
                  f"{flat / 2**20:6.2f} MiB  {max(float(v[0]) for v in g) * 1e3:8.2f} ms  "
                  f"sent/rank {sent / flat:.3f} x flat ((N-1)/N = {(N - 1) / N:.3f})", flush=True)
dist.destroy_process_group()
