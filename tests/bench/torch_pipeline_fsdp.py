#!/usr/bin/env python3
"""PyTorch's own pipeline parallelism with FSDP2 inside each stage (torchtitan's PP x FSDP),
on the CPU over Gloo: the anchor of scripts/bench/bench-pipeline-links.sh.

The GPT of tests/interop/fsdp_gpt.py (train_gpt's) split in two stages by blocks: stage 0
the embeddings and the first half of the blocks, stage 1 the rest with ln_f and lm_head;
each stage fully_shard-ed (each block, then the stage) over its data-parallel ranks
(a 2-D DeviceMesh, pp x dp, rank r in stage r // dp as train_gpt's); torch.distributed
.pipelining's PipelineStage and Schedule1F1B (or ScheduleGPipe) with --micro-batches;
AdamW. Random tokens (the timing does not depend on the text). One JSON line per step
({"step", "step_s", "loss"}) to --log-jsonl, as train_gpt writes it.

  (--no-reshard-after-forward: FSDP2 keeps each stage gathered from forward to backward,
  torchtitan's default under pipeline parallelism.)

  RANK=.. WORLD_SIZE=4 MASTER_ADDR=.. MASTER_PORT=.. torch_pipeline_fsdp.py --stages 2 \
      --n-layer 4 --d-model 256 --n-head 8 --block-size 64 --batch-size 16 --steps 15 \
      --micro-batches 4 --log-jsonl FILE
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "interop"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--log-jsonl", default="")
    ap.add_argument("--no-reshard-after-forward", action="store_true",
                    help="fully_shard(reshard_after_forward=False), torchtitan's choice with PP")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from fsdp_gpt import build_model, init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = init_distributed()
    S = args.stages
    if world % S:
        raise SystemExit(f"--stages {S} does not divide the world size {world}")
    dp = world // S
    mesh = init_device_mesh("cpu", (S, dp), mesh_dim_names=("pp", "dp"))
    stage = rank // dp
    if args.batch_size % (dp * args.micro_batches):
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by {dp} data-parallel "
                         f"ranks x --micro-batches {args.micro_batches}")
    torch.manual_seed(0)
    gpt, Block = build_model(args)
    half = (args.n_layer + S - 1) // S
    mine = list(range(stage * half, min(args.n_layer, (stage + 1) * half)))

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.last = stage == 0, stage == S - 1
            if self.first:
                self.wte, self.wpe = gpt.wte, gpt.wpe
            self.blocks = nn.ModuleList([gpt.blocks[i] for i in mine])
            if self.last:
                self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

        def forward(self, x):
            if self.first:
                pos = torch.arange(x.size(1), dtype=torch.long)
                x = self.wte(x) + self.wpe(pos)
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x)) if self.last else x

    model = Stage()
    reshard = not args.no_reshard_after_forward
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp"], reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    pipe = PipelineStage(model, stage, S, torch.device("cpu"), group=mesh["pp"].get_group())

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))

    sched = (Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe)(
        pipe, n_microbatches=args.micro_batches, loss_fn=loss_fn)
    per = args.batch_size // dp
    log = open(args.log_jsonl, "a") if args.log_jsonl and rank == 0 else None
    g = torch.Generator().manual_seed(1234)
    for step in range(args.steps):
        rows = torch.randint(0, 256, (args.batch_size, args.block_size + 1), generator=g)
        mine_rows = rows[(rank % dp) * per:(rank % dp + 1) * per]
        x, y = mine_rows[:, :-1], mine_rows[:, 1:]
        t0 = time.perf_counter()
        losses = []
        if stage == 0:
            sched.step(x)
        elif stage == S - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        # The loss lives on the last stage: its first rank tells rank 0.
        loss = torch.tensor([torch.stack(losses).mean().item() if losses else 0.0])
        dist.all_reduce(loss, op=dist.ReduceOp.MAX)
        if log:
            log.write(json.dumps({"step": step + 1, "step_s": dt, "loss": loss.item()}) + "\n")
            log.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
