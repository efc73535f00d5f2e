#!/usr/bin/env python3
"""fsdp-estimate beside DeepSpeed's own estimators (PyPI's deepspeed):
estimate_zero3_model_states_mem_needs_all_cold and estimate_zero2_model_states_mem_needs_all_cold,
on three shapes (GPT-like 163M on 1 GPU, 1.4B on 1 node x 8, 13B on 4 nodes x 8).

  compare_estimate.py --estimate build/bin/fsdp-estimate      # the ctest case (0 / 1; 77: skipped)
  compare_estimate.py --estimate build/bin/fsdp-estimate --markdown   # also the README's table

Three checks per shape and stage:
1. The DeepSpeed columns that `fsdp-estimate --deepspeed-table` prints are DeepSpeed's: its
   helpers (estimate_zero3_model_states_mem_needs, estimate_zero2_model_states_mem_needs)
   give the same bytes, and all_cold prints the same "%.2fGB" figures, row by row.
2. Where both count the same quantity, the figures are equal: the 16 bytes per parameter of
   fp32 model state (master, gradient, AdamW's two moments) divided over the GPUs, the
   2-byte parameter shard a GPU keeps with offload_optimizer alone, ZeRO-2's full 2-byte
   parameters, and the fp32 model every process builds without zero.Init (4 B x params per
   GPU, on the host).
3. Where they differ by design, DeepSpeed's figure equals this engine's plus the stated
   difference, to the byte (DESIGN below; the README says the same).
The shapes are chosen so that every unit divides by the GPU count (no padding) and
DeepSpeed's largest layer is this engine's largest unit.
"""
import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile

SKIP = 77

# Design differences, each a formula in the row's figures (P: total parameters, N: GPUs,
# nodes, gpn: GPUs per node, L: largest layer = largest unit, G: this engine's gathered
# units in bytes, param_dtype 2 bytes).
DESIGN = {
    "factor": "DeepSpeed multiplies every host figure by additional_buffer_factor = 1.5",
    "largest_layer": "DeepSpeed's GPU adds 4 B x the largest layer (its fp16 parameters and "
                     "gradients); this engine's gathered units are 2 B x (the root unit + "
                     "max_gathered_units = 2 largest other units), its unit gradients transient",
    "fp16_shard_gpu": "without offload, DeepSpeed keeps a 2 B fp16 copy of each GPU's shard "
                      "(18 B/N per parameter); this engine casts the fp32 shard as it gathers "
                      "(16 B/N)",
    "fp16_shard_host": "with offload_param, DeepSpeed keeps the 2 B fp16 shard on the host too "
                       "(18 B per parameter per node); this engine casts the fp32 master on its "
                       "way to the GPU (16 B)",
    "zero_init_layer": "zero.Init holds the largest layer in fp32 on the host per GPU; "
                       "make_sharded holds the root unit and the largest other unit",
    "zero2_grads": "DeepSpeed's stage-2 GPU figure counts 2 B/N of fp16 gradient partitions; "
                   "this engine reduce-scatters straight into the fp32 gradient shards",
    "zero2_nodes": "DeepSpeed's stage-2 host figure with offload is the whole job's "
                   "(P x max(4 N, 16)), not one node's",
    "zero1_full_grads": "stage 1 (DeepSpeed has no estimator; its stage-2 formula): this "
                        "engine's ZeRO-1 keeps full 2 B gradients on every GPU (on one GPU without "
                        "offload they go straight into the fp32 gradient shard)",
}

# (name, fsdp-estimate model flags, nodes, GPUs per node). 13B's units come from a file.
GPT_13B_UNITS = [2 * 50304 * 5120 + 2048 * 5120 + 2 * 5120] + [12 * 5120 * 5120 + 13 * 5120] * 40
SHAPES = [
    ("GPT 163M (12 x 768)", ["--n-layer", "12", "--n-head", "12", "--d-model", "768",
                             "--block-size", "1024", "--vocab-size", "50304"], 1, 1),
    ("GPT 1.4B (24 x 2048)", ["--unit-sizes", ",".join(str(n) for n in
                              [2 * 50304 * 2048 + 2048 * 2048 + 2 * 2048] +
                              [12 * 2048 * 2048 + 13 * 2048] * 24)], 1, 8),
    ("GPT 13B (40 x 5120)", None, 4, 8),
]


def gb(b):
    return f"{b / 2**30:.2f}"


def printed_rows(fn, *args, **kwargs):
    """all_cold's printed table: (per CPU, per GPU) strings in row order."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args, **kwargs)
    return re.findall(r"^\s*([\d.]+)GB \|\s*([\d.]+)GB \|", out.getvalue(), re.M), out.getvalue()


def run_estimate(exe, model, nodes, gpn, strategy):
    cmd = [exe, *model, "--nodes", str(nodes), "--gpus-per-node", str(gpn), "--sharding", strategy,
           "--precision", "fp16", "--deepspeed-table", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return json.loads(r.stdout)


class Checker:
    def __init__(self):
        self.failures = 0
        self.checks = 0

    def eq(self, what, got, want):
        self.checks += 1
        if got != want:
            self.failures += 1
            print(f"FAIL {what}: {got} != {want} (difference {got - want})")


def check_stage3(c, shape, j, ds):
    P, N = j["params"], j["world_size"]
    nodes, gpn = j["nodes"], j["gpus_per_node"]
    units = j["units"]
    L = max(units)
    root, others = units[0], sorted(units[1:], reverse=True)
    assert all(u % N == 0 for u in units), "a shape whose units divide by N"
    S = P // N                       # elements per GPU: no padding
    G = 2 * (root + sum(others[:2]))  # gathered units, fp16
    rows = j["deepspeed_table"]["rows"]
    printed, text = printed_rows(ds.estimate_zero3_model_states_mem_needs_all_cold, P, L, gpn, nodes)
    c.eq(f"{shape} stage 3: rows printed by DeepSpeed", len(printed), len(rows))
    for i, row in enumerate(rows):
        key = (row["offload_param"], row["offload_optimizer"], row["zero_init"])
        what = f"{shape} stage 3 {key}"
        cpu_mem, gpu_mem, _ = ds.estimate_zero3_model_states_mem_needs(
            total_params=P, largest_layer_params=L, num_gpus_per_node=gpn, num_nodes=nodes,
            cpu_offload=row["offload_optimizer"] == "cpu",
            cpu_offload_params=row["offload_param"] == "cpu", zero_init=row["zero_init"])
        # 1. fsdp-estimate's DeepSpeed columns are DeepSpeed's.
        c.eq(what + " DeepSpeed cpu bytes", row["deepspeed_cpu_bytes"], cpu_mem)
        c.eq(what + " DeepSpeed gpu bytes", row["deepspeed_gpu_bytes"], gpu_mem)
        if i < len(printed):
            c.eq(what + " printed cpu", printed[i][0], gb(cpu_mem))
            c.eq(what + " printed gpu", printed[i][1], gb(gpu_mem))
        ours_gpu, states, built = (row["device_per_gpu_bytes"], row["host_states_per_node_bytes"],
                                   row["host_construction_per_node_bytes"])
        eager = 4 * P * gpn  # the fp32 model on every GPU's process: the same quantity
        if not row["zero_init"]:
            c.eq(what + " eager construction = 4 B x P per GPU", built, eager)
        # 2./3. Per row: DeepSpeed = ours + the design differences.
        if key[1] == "cpu":
            c.eq(what + " our host model states = 16 B x P / nodes", states, 16 * P // nodes)
            host_extra = 2 * P // nodes if key[0] == "cpu" else 0  # fp16_shard_host
            host = states + host_extra if row["zero_init"] else max(eager, states + host_extra)
            c.eq(what + " cpu = 1.5 x (ours + fp16 host shard)", cpu_mem, 3 * host // 2)
            shard_copy = 0 if key[0] == "cpu" else 2 * S  # the same quantity on both sides
            c.eq(what + " our gpu = fp16 shard copy + gathered units", ours_gpu, shard_copy + G)
            c.eq(what + " gpu = ours + (4 L - gathered)", gpu_mem, ours_gpu + 4 * L - G)
        else:
            c.eq(what + " our gpu = 16 B x P / N + gathered units", ours_gpu, 16 * S + G)
            c.eq(what + " gpu = ours + 2 P / N + (4 L - gathered)", gpu_mem,
                 ours_gpu + 2 * S + 4 * L - G)
            if row["zero_init"]:
                layer_diff = 4 * gpn * (L - root - others[0])  # zero_init_layer
                c.eq(what + " cpu = 1.5 x (make_sharded's peak + layer difference)", cpu_mem,
                     3 * (built + layer_diff) // 2)
            else:
                c.eq(what + " cpu = 1.5 x eager construction", cpu_mem, 3 * built // 2)
    return text


def check_stage2(c, shape, j, ds, strategy):
    P, N = j["params"], j["world_size"]
    nodes, gpn = j["nodes"], j["gpus_per_node"]
    S = P // N
    rows = j["deepspeed_table"]["rows"]
    printed, text = printed_rows(ds.estimate_zero2_model_states_mem_needs_all_cold, P, gpn, nodes)
    c.eq(f"{shape} {strategy}: rows printed by DeepSpeed", len(printed), len(rows))
    for i, row in enumerate(rows):
        what = f"{shape} {strategy} offload_optimizer={row['offload_optimizer']}"
        offload = row["offload_optimizer"] == "cpu"
        # zero1_full_grads: none at world size 1 without offload (Note [Gradients in the shard])
        full_grads = 2 * P if strategy == "zero1" and (offload or N > 1) else 0
        cpu_mem, gpu_mem = ds.estimate_zero2_model_states_mem_needs(
            total_params=P, num_gpus_per_node=gpn, num_nodes=nodes, cpu_offload=offload)
        c.eq(what + " DeepSpeed cpu bytes", row["deepspeed_cpu_bytes"], cpu_mem)
        c.eq(what + " DeepSpeed gpu bytes", row["deepspeed_gpu_bytes"], gpu_mem)
        if i < len(printed):
            c.eq(what + " printed cpu", printed[i][0], gb(cpu_mem))
            c.eq(what + " printed gpu", printed[i][1], gb(gpu_mem))
        ours_gpu, host = row["device_per_gpu_bytes"], row["host_per_node_bytes"]
        eager = 4 * P * gpn
        c.eq(what + " eager construction = 4 B x P per GPU", row["host_construction_per_node_bytes"],
             eager)
        if offload:
            c.eq(what + " our gpu = full fp16 parameters (+ full grads)", ours_gpu,
                 2 * P + full_grads)
            c.eq(what + " gpu = ours (- full grads)", gpu_mem, ours_gpu - full_grads)
            c.eq(what + " cpu = 1.5 x nodes x ours per node", cpu_mem, 3 * nodes * host // 2)
        else:
            c.eq(what + " our gpu = full fp16 parameters + 16 B x P / N (+ full grads)", ours_gpu,
                 2 * P + 16 * S + full_grads)
            c.eq(what + " gpu = ours + fp16 gradient partitions (- full grads)", gpu_mem,
                 ours_gpu + 2 * S - full_grads)
            c.eq(what + " cpu = 1.5 x eager construction", cpu_mem, 3 * host // 2)
    return text


def markdown(results):
    lines = ["| Shape | Nodes x GPUs | Stage | Options | DeepSpeed per CPU | DeepSpeed per GPU "
             "| fsdp per CPU (node) | fsdp per GPU |", "|---|---|---|---|---:|---:|---:|---:|"]
    for shape, nodes, gpn, strategy, j in results:
        for row in j["deepspeed_table"]["rows"]:
            opts = f"offload_optimizer={row['offload_optimizer']}"
            if j["deepspeed_table"]["stage"] == 3:
                opts = (f"offload_param={row['offload_param']}, {opts}, "
                        f"zero_init={int(row['zero_init'])}")
            lines.append(f"| {shape} | {nodes} x {gpn} | {strategy} | {opts} | "
                         f"{gb(row['deepspeed_cpu_bytes'])} GB | {gb(row['deepspeed_gpu_bytes'])} GB | "
                         f"{gb(row['host_per_node_bytes'])} GB | {gb(row['device_per_gpu_bytes'])} GB |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--estimate", required=True, help="the fsdp-estimate binary")
    ap.add_argument("--markdown", action="store_true", help="print the comparison as Markdown")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.runtime.zero import stage3, stage_1_and_2  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure: skip, with the reason)
        print(f"SKIP: deepspeed does not import in {sys.executable}: {e!r}")
        return SKIP

    class DS:
        estimate_zero3_model_states_mem_needs = staticmethod(stage3.estimate_zero3_model_states_mem_needs)
        estimate_zero3_model_states_mem_needs_all_cold = staticmethod(
            stage3.estimate_zero3_model_states_mem_needs_all_cold)
        estimate_zero2_model_states_mem_needs = staticmethod(
            stage_1_and_2.estimate_zero2_model_states_mem_needs)
        estimate_zero2_model_states_mem_needs_all_cold = staticmethod(
            stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold)

    import deepspeed
    print(f"deepspeed {deepspeed.__version__}; fsdp-estimate {args.estimate}")
    c = Checker()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        units_file = os.path.join(tmp, "units_13b.txt")
        with open(units_file, "w") as f:
            f.write("# GPT 13B: root (wte, wpe, ln_f, lm_head), then 40 blocks\n")
            f.write("\n".join(str(n) for n in GPT_13B_UNITS) + "\n")
        for shape, model, nodes, gpn in SHAPES:
            model = model or ["--unit-sizes-file", units_file]
            for strategy in ("zero3", "zero2", "zero1"):
                j = run_estimate(args.estimate, model, nodes, gpn, strategy)
                results.append((shape, nodes, gpn, strategy, j))
                if strategy == "zero3":
                    text = check_stage3(c, shape, j, DS)
                else:
                    text = check_stage2(c, shape, j, DS, strategy)
                if strategy != "zero1":
                    print(f"--- {shape}: DeepSpeed's all_cold printed:\n{text}", end="")
    if args.markdown:
        print(markdown(results))
    for k, v in DESIGN.items():
        print(f"design difference {k}: {v}")
    print(f"{c.checks} checks, {c.failures} failed")
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
