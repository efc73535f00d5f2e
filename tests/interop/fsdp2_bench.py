#!/usr/bin/env python3
"""PyTorch FSDP2 (fully_shard) on the GPT of bench_gpu, one device, world 1: the anchor
that scripts/gpu/gpu-check.sh sets beside bench_gpu's figures for this library.

The same model (tests/interop/fsdp_gpt.py's build_model: the GPT of docs/design.md,
"Contracts"), the same shape, batch and optimizer as tests/bench/bench_gpu.cpp: each
block and the root are FSDP2 units, torch.optim.AdamW(lr=1e-4). Prints JSON lines like
bench_gpu's ({"metric", "value", "unit", "baseline"}):

  fsdp2_tokens_per_s        fp32, median of --reps steps after 3 warm-up steps
  fsdp2_bf16_tokens_per_s   MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)
  fsdp2_peak_memory_bytes   peak allocated bytes of an fp32 step (CUDA only), the model
                            alone on the device, as bench_gpu measures its own
  fsdp2_bf16_mfu            bf16 model FLOPs/s (6N + 12 L d T per token, as bench_gpu)
                            over the GPU's dense bf16 peak (the table of bench_gpu, or
                            FSDP_GPU_PEAK_TFLOPS, which also gives it on the CPU)

  fsdp2_bench.py [--device cuda|cpu] [--reps N] [--n-layer L --d-model D --n-head H
                 --block-size T --batch-size B] [--attention sdpa|math]
                 [--large [--fused]]

--large: bf16 only, as bench_gpu --model large measures its 1.3B GPT: the model built on
the device, --reps steps after 3 warm-up steps (median, min and max), the peak allocated
bytes of a bf16 step, MFU; metric names fsdp2_large_bf16_tokens_per_s,
fsdp2_large_bf16_peak_memory_bytes, fsdp2_large_bf16_mfu. --fused: AdamW(fused=True)
(ATen's fused kernel, which bench_gpu's FusedAdamW also runs).

--device cpu (Gloo) runs the same code without a GPU, so that the ctest
Interop.Fsdp2BenchRunsOnTheCpu keeps it working where no GPU is.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def peak_bf16_flops(torch, device):
    env = os.environ.get("FSDP_GPU_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    if "H100" in name and "PCIe" in name:
        return 756e12
    if any(s in name for s in ("H100", "H200", "H800", "GH200")):
        return 989e12
    if "A100" in name or "A800" in name:
        return 312e12
    if "L40S" in name:
        return 362e12
    return None


def emit(metric, value, unit, baseline, **extra):
    print(json.dumps({"metric": metric, "value": value, "unit": unit, "baseline": baseline, **extra}),
          flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--attention", choices=["sdpa", "math"], default="sdpa",
                   help="F.scaled_dot_product_attention (is_causal), or the explicit softmax")
    p.add_argument("--large", action="store_true",
                   help="bf16 only, built on the device, fsdp2_large_* metrics (bench_gpu --model large)")
    p.add_argument("--fused", action="store_true", help="torch.optim.AdamW(fused=True)")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps {args.reps} must be at least 1")

    try:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as e:
        print(f"SKIPPED: PyTorch FSDP2 does not import here ({e}); it comes with PyPI's torch 2.6 or later")
        return 77

    from fsdp_gpt import build_model

    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if args.device == "cpu" and version < (2, 7):
        # torch 2.6's FSDP2 records an event on its all-gather stream, which the CPU's
        # stream lacks ("'Stream' object has no attribute 'record_event'").
        print(f"SKIPPED: FSDP2 on the CPU needs torch 2.7 or later; this is torch {torch.__version__}")
        return 77

    if args.device == "cuda" and not torch.cuda.is_available():
        print("fsdp2_bench.py: --device cuda but no CUDA device is visible; use --device cpu", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # The env rendezvous asks for a libuv TCPStore unless USE_LIBUV=0, and Debian's
    # python3-torch (the debian13 CI leg) is built without libuv: one rank needs no libuv.
    os.environ.setdefault("USE_LIBUV", "0")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    device = torch.device(args.device)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(args.device, (1,))
    tokens = args.batch_size * args.block_size
    rows = torch.randint(0, 256, (args.batch_size, args.block_size + 1), device=device)
    x, y = rows[:, :-1], rows[:, 1:]

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def make(bf16):
        torch.manual_seed(0)
        if args.large:
            with torch.device(device):  # initialised on the device: no host copy of 1.3B
                model, Block = build_model(args)
        else:
            model, Block = build_model(args)
        model.to(device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else \
            MixedPrecisionPolicy()
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt_args = {"fused": True} if args.fused else {}
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, **opt_args)

    def step(model, opt):
        sync()
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    where = f"{args.device}, GPT {args.n_layer}x{args.d_model}, batch {args.batch_size}x{args.block_size}, " \
            f"attention {args.attention}, torch {torch.__version__}"

    def flops_per_token(n_params):
        return 6.0 * n_params + 12.0 * args.n_layer * args.d_model * args.block_size

    if args.large:
        if args.device == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        model, opt = make(True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"fsdp2 large: built on {args.device} in {time.perf_counter() - t0:.1f} s, "
              f"{n_params} parameters", flush=True)
        step(model, opt)  # the optimizer state exists from here on
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            step(model, opt)
        secs = [step(model, opt) for _ in range(args.reps)]
        tps = tokens / statistics.median(secs)
        extra = {"params": n_params, "reps": args.reps, "min": tokens / max(secs),
                 "max": tokens / min(secs)}
        print(f"fsdp2 large: {tps:.1f} tokens/s (median of {args.reps} steps; "
              f"{extra['min']:.1f} to {extra['max']:.1f})", flush=True)
        emit("fsdp2_large_bf16_tokens_per_s", tps, "tokens/s",
             "PyTorch FSDP2 bf16" + (", fused AdamW, " if args.fused else ", ") + where, **extra)
        if args.device == "cuda":
            emit("fsdp2_large_bf16_peak_memory_bytes", torch.cuda.max_memory_allocated() - base,
                 "bytes", "PyTorch FSDP2 bf16 step, the model alone on the GPU, " + where)
        peak = peak_bf16_flops(torch, args.device)
        if peak:
            emit("fsdp2_large_bf16_mfu", tps * flops_per_token(n_params) / peak, "fraction",
                 f"dense bf16 peak of {peak / 1e12:g} TFLOP/s, " + where,
                 flops_per_token=flops_per_token(n_params), formula="6N + 12 L d T")
        dist.destroy_process_group()
        return 0

    n_params = None
    results = {}
    for bf16 in (False, True):
        model, opt = make(bf16)
        n_params = sum(p.numel() for p in model.parameters())
        for _ in range(3):
            step(model, opt)
        results[bf16] = tokens / statistics.median(step(model, opt) for _ in range(args.reps))
        del model, opt
    emit("fsdp2_tokens_per_s", results[False], "tokens/s", "PyTorch FSDP2 fp32, " + where)
    emit("fsdp2_bf16_tokens_per_s", results[True], "tokens/s", "PyTorch FSDP2 bf16, " + where)

    if args.device == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        model, opt = make(False)
        step(model, opt)  # the optimizer state exists from here on
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            step(model, opt)
        emit("fsdp2_peak_memory_bytes", torch.cuda.max_memory_allocated() - base, "bytes",
             "PyTorch FSDP2 fp32 step, " + where)
    peak = peak_bf16_flops(torch, args.device)
    if peak:
        emit("fsdp2_bf16_mfu", results[True] * flops_per_token(n_params) / peak, "fraction",
             f"dense bf16 peak of {peak / 1e12:g} TFLOP/s, " + where)
    elif args.device == "cuda":
        print("fsdp2_bf16_mfu: unknown GPU peak; set FSDP_GPU_PEAK_TFLOPS", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
