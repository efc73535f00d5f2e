#!/usr/bin/env python3
"""The round trip with Hugging Face: transformers makes a small random Llama and saves it,
train_llama loads it sharded, trains it and exports it, and transformers loads the export.

  llama_roundtrip.py --train-llama build/bin/train_llama --fsdp-run build/bin/fsdp-run
                     [--world 2] [--steps 6] [--tied] [--dtype fp32|bf16] [--shard-files] [--keep DIR]

1. transformers: LlamaConfig (vocab 256, hidden 64, 2 layers, 4 heads, 2 key/value heads
   (grouped-query attention), intermediate 176, rope_theta 50000, not the default 10000),
   LlamaForCausalLM from seed 0, save_pretrained (safetensors; --dtype bf16 saves bf16;
   --tied ties the embeddings, and transformers then leaves lm_head.weight out of the file;
   --shard-files writes shards and model.safetensors.index.json).
2. Its loss on a fixed batch (the bytes of eval.txt cut into rows of 33: 32 positions and
   their next tokens), in fp32.
3. train_llama at --world ranks: --init-from that directory, --eval-text eval.txt (its loss
   on the same rows before the first step and after the last), --steps N sharded,
   --export-hf (fp32).
4. transformers: from_pretrained(export), no missing or unexpected keys, and its loss on the
   rows against train_llama's after training.
5. With --fsdp-consolidate: the same for train_llama's last checkpoint consolidated offline
   (fsdp-consolidate --format safetensors; the checkpoint carries config.json).

Both losses must agree within 1e-5 relative (before: the imported weights; after: the
exported ones). With --steps 0 (a conversion: train_llama trains nothing), the exports'
logits on the rows must equal the original model's exactly, and so must their weights. Prints every figure. Exit status 1 on a mismatch, 77 when transformers
cannot be imported (the ctest then counts as skipped).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

try:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:  # the project's .venv has them (scripts/requirements.txt)
    print(f"llama_roundtrip.py: skipped: {e}")
    sys.exit(77)

BLOCK = 32
TOLERANCE = 1e-5


def eval_rows(path):
    data = open(path, "rb").read()
    rows = min(64, len(data) // (BLOCK + 1))
    return torch.tensor(list(data[: rows * (BLOCK + 1)]), dtype=torch.long).view(rows, BLOCK + 1)


def hf_loss(model, rows):
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits.float()
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1)).item()


def logits_of(model, rows):
    with torch.no_grad():
        return model(input_ids=rows[:, :-1]).logits.float()


def same_as_original(name, model, reference, rows):
    """--steps 0: `model` (an export) must hold the original's weights and give its logits,
    bit for bit. Prints the largest differences; True when both are 0."""
    theirs = reference.state_dict()
    ours = model.state_dict()
    weight_diff = max((ours[k].float() - theirs[k].float()).abs().max().item() for k in theirs)
    logit_diff = (logits_of(model, rows) - logits_of(reference, rows)).abs().max().item()
    print(f"   {name}: largest weight difference from the original {weight_diff:.3e}, "
          f"largest logit difference {logit_diff:.3e} ({rows.shape[0]} rows x {BLOCK} "
          f"positions x {reference.config.vocab_size} logits)")
    if weight_diff != 0 or logit_diff != 0:
        print(f"llama_roundtrip.py: FAILED: {name} after --steps 0 differs from the original")
        return False
    return True


def rel(a, b):
    return abs(a - b) / abs(b)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-llama", required=True)
    ap.add_argument("--fsdp-run", required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6,
                    help="0: a conversion; the exports must equal the original exactly")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--shard-files", action="store_true",
                    help="transformers saves shards of at most 100 KB and an index")
    ap.add_argument("--keep", default="", help="work in this directory and keep it")
    ap.add_argument("--fsdp-consolidate", default="",
                    help="also export offline: fsdp-consolidate of train_llama's checkpoint "
                         "(--format safetensors), which transformers must load the same way")
    args = ap.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="llama_roundtrip_")
    os.makedirs(work, exist_ok=True)
    src, out = os.path.join(work, "hf_in"), os.path.join(work, "hf_out")
    text = os.path.join(work, "eval.txt")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; work in {work}")

    # 1. A random Llama from transformers.
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, rms_norm_eps=1e-5,
                      tie_word_embeddings=args.tied,
                      rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(src, **({"max_shard_size": "100KB"} if args.shard_files else {}))
    saved = sorted(os.listdir(src))
    print(f"1. transformers saved a Llama ({args.dtype}, {'tied' if args.tied else 'untied'} "
          f"embeddings, rope_theta 50000, 4 heads / 2 key-value heads) to {src}: {saved}")

    # 2. Its loss on the fixed rows (fp32 compute, from the saved values).
    with open(text, "wb") as f:
        g = torch.Generator().manual_seed(1)
        f.write(bytes(torch.randint(32, 127, (8 * (BLOCK + 1),), generator=g).tolist()))
    rows = eval_rows(text)
    reference = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    before_hf = hf_loss(reference, rows)
    print(f"2. transformers' loss on {rows.shape[0]} rows of {BLOCK + 1} bytes: {before_hf:.9f}")

    # 3. train_llama, sharded: import, evaluate, train, evaluate, export.
    log = os.path.join(work, "train.jsonl")
    cmd = [args.fsdp_run, "--nproc", str(args.world), "--", args.train_llama,
           "--init-from", src, "--eval-text", text, "--block-size", str(BLOCK),
           "--batch-size", str(4 * args.world), "--steps", str(args.steps), "--lr", "1e-3",
           "--warmup-steps", "0", "--export-hf", out, "--log-jsonl", log, "--device", "cpu",
           "--save-dir", os.path.join(work, "ck")]
    print("3. " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write("".join("   " + l + "\n" for l in p.stdout.splitlines()
                             if "eval loss" in l or "wrote" in l or "parameters," in l))
    if p.returncode != 0:
        print(p.stdout[-4000:] + p.stderr[-4000:])
        print(f"llama_roundtrip.py: FAILED: train_llama exited {p.returncode}")
        return 1
    evals = {int(s): float(v) for s, v in
             re.findall(r"eval loss at step (\d+): ([0-9.eE+-]+)", p.stdout)}
    losses = [json.loads(l)["loss"] for l in open(log) if l.strip()]
    print(f"   training losses ({args.world} ranks): " + ", ".join(f"{x:.6f}" for x in losses))
    if sorted(evals) != sorted({0, args.steps}):
        print(f"llama_roundtrip.py: FAILED: expected eval losses at steps 0 and {args.steps}, "
              f"got {evals}")
        return 1
    if args.steps == 0 and "--steps 0: no training" not in p.stdout:
        print("llama_roundtrip.py: FAILED: train_llama did not say it trains nothing")
        return 1

    # 4. transformers loads the export.
    exported, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True,
                                                      dtype=torch.float32)
    exported.eval()
    keys = {k: sorted(v) if not isinstance(v, list) else v for k, v in info.items()}
    after_hf = hf_loss(exported, rows)
    print(f"4. transformers loaded {out} ({sorted(os.listdir(out))}): missing keys "
          f"{keys.get('missing_keys')}, unexpected keys {keys.get('unexpected_keys')}, "
          f"mismatched {keys.get('mismatched_keys')}")
    print(f"   its loss on the rows: {after_hf:.9f}")
    ok = True
    if args.steps == 0:
        ok &= same_as_original("the --export-hf model", exported, reference, rows)

    offline_hf = None
    if args.fsdp_consolidate:
        # 5. Offline: the checkpoint (which carries config.json) consolidated with no
        # process group, and loaded by transformers.
        off = os.path.join(work, "hf_offline")
        c = subprocess.run([args.fsdp_consolidate, os.path.join(work, "ck"), off, "--format",
                            "safetensors"], capture_output=True, text=True)
        if c.returncode != 0:
            print(c.stdout[-2000:] + c.stderr[-2000:])
            print("llama_roundtrip.py: FAILED: fsdp-consolidate exited", c.returncode)
            return 1
        offline, off_info = LlamaForCausalLM.from_pretrained(off, output_loading_info=True,
                                                            dtype=torch.float32)
        offline.eval()
        offline_hf = hf_loss(offline, rows)
        print(f"5. fsdp-consolidate {os.path.join(work, 'ck')} {off} --format safetensors: "
              f"{sorted(os.listdir(off))}; transformers: missing keys "
              f"{off_info.get('missing_keys')}, unexpected keys {off_info.get('unexpected_keys')}"
              f"; its loss on the rows: {offline_hf:.9f}")
        for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            if off_info.get(k):
                print(f"llama_roundtrip.py: FAILED: offline export {k}: {off_info[k]}")
                return 1
        if args.steps == 0:
            ok &= same_as_original("the consolidated checkpoint", offline, reference, rows)

    print("\n| stage | train_llama | transformers | relative difference |")
    print("|---|---|---|---|")
    stages = [("imported (step 0)", evals[0], before_hf),
              (f"exported (step {args.steps})", evals[args.steps], after_hf)]
    if offline_hf is not None:
        stages.append((f"consolidated offline (step {args.steps})", evals[args.steps], offline_hf))
    for stage, ours, theirs in stages:
        d = rel(ours, theirs)
        print(f"| {stage} | {ours:.9f} | {theirs:.9f} | {d:.2e} |")
        ok &= d <= TOLERANCE
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(k):
            print(f"llama_roundtrip.py: FAILED: {k}: {info[k]}")
            ok = False
    if args.steps > 0 and rel(evals[args.steps], evals[0]) < 1e-4:
        print("llama_roundtrip.py: FAILED: training left the loss on the rows unchanged")
        ok = False
    print("llama_roundtrip.py: " + ("PASSED" if ok else "FAILED") +
          f" (tolerance {TOLERANCE} relative)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
