#!/usr/bin/env python3
"""train_gpt --export-hf as transformers' GPT2LMHeadModel: train_gpt trains sharded and
exports; transformers loads the export with no missing or unexpected keys, and its loss on
a fixed batch equals train_gpt's (--eval-text) within 1e-5 relative.

  gpt2_export.py --train-gpt build/bin/train_gpt --fsdp-run build/bin/fsdp-run [--world 2]

Exit status 1 on a mismatch, 77 when transformers cannot be imported (ctest: skipped).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

try:
    import torch
    import transformers
    from transformers import GPT2LMHeadModel
except ImportError as e:
    print(f"gpt2_export.py: skipped: {e}")
    sys.exit(77)

BLOCK = 32


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-gpt", required=True)
    ap.add_argument("--fsdp-run", required=True)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="gpt2_export_")
    text, out = os.path.join(work, "eval.txt"), os.path.join(work, "gpt2")
    g = torch.Generator().manual_seed(1)
    with open(text, "wb") as f:
        f.write(bytes(torch.randint(32, 127, (8 * (BLOCK + 1),), generator=g).tolist()))
    cmd = [args.fsdp_run, "--nproc", str(args.world), "--", args.train_gpt, "--steps", "6",
           "--block-size", str(BLOCK), "--batch-size", str(4 * args.world), "--eval-text", text,
           "--export-hf", out, "--device", "cpu"]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}\n" + " ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-4000:] + p.stderr[-4000:])
        return 1
    evals = {int(s): float(v) for s, v in re.findall(r"eval loss at step (\d+): ([0-9.eE+-]+)", p.stdout)}
    ours = evals[6]
    model, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    model.eval()
    data = open(text, "rb").read()
    rows = torch.tensor(list(data), dtype=torch.long).view(-1, BLOCK + 1)
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits
        theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                   rows[:, 1:].reshape(-1)).item()
    d = abs(ours - theirs) / theirs
    print(f"files: {sorted(os.listdir(out))}")
    print(f"missing keys {info['missing_keys']}, unexpected keys {info['unexpected_keys']}, "
          f"mismatched {info['mismatched_keys']}")
    print(f"loss on {rows.shape[0]} rows after 6 steps: train_gpt {ours:.9f}, "
          f"GPT2LMHeadModel {theirs:.9f}, relative difference {d:.2e}")
    ok = d <= 1e-5 and not info["missing_keys"] and not info["unexpected_keys"] \
        and not info["mismatched_keys"]
    print("gpt2_export.py: " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
