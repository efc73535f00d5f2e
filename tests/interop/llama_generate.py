"""generate_llama against transformers' LlamaForCausalLM on the same weights.

transformers builds a small random Llama (seed 0: vocab 256, hidden 64, 2 layers, 4 heads,
2 key/value heads, intermediate 176, rope_theta 50000, max_position_embeddings 128) and
save_pretrained writes it; generate_llama --dump-logits --max-new-tokens 20 runs on that
directory. The logits of one forward over the prompt must agree within 1e-5 (max |ours -
theirs| / max |theirs|), and the 20 greedy tokens must equal model.generate(do_sample=False)'s.
Four directories: fp32 untied, fp32 tied (save_pretrained leaves lm_head.weight out), the
untied model saved in bf16 (both sides then compute in fp32 on the same rounded weights)
and the tied one in shards of at most 100 KB (model.safetensors.index.json).

Each directory is compared twice, kernel against kernel: generate_llama's default
--attention sdpa (at::scaled_dot_product_attention) against transformers'
attn_implementation="sdpa" (the same ATen kernel), and --attention math (the explicit
softmax in fp32) against attn_implementation="eager", which it follows operation by
operation.

usage: llama_generate.py --generate-llama BUILD/bin/generate_llama
(exit 0: all good; 1: a mismatch; 77: skipped, with why)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

SKIP = 77
TOLERANCE = 1e-5
NEW_TOKENS = 20
PROMPT = b"The KV cache keeps each position's keys"


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


def build_model(tied):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        # Larger than the default 0.02, so that the random model's greedy tokens vary.
        initializer_range=0.2,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).eval()


# (generate_llama --attention, transformers' attn_implementation)
PAIRS = (("sdpa", "sdpa"), ("math", "eager"))


def run_ours(exe, model_dir, logits_file, attention):
    cmd = [exe, "--model", model_dir, "--device", "cpu", "--attention", attention, "--prompt-ids",
           ",".join(str(b) for b in PROMPT), "--max-new-tokens", str(NEW_TOKENS),
           "--dump-logits", logits_file]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout + r.stderr)
        raise SystemExit(f"generate_llama failed ({r.returncode}): {' '.join(cmd)}")
    for line in r.stdout.splitlines():
        if line.startswith("tokens: "):
            return [int(t) for t in line[len("tokens: "):].split(",")]
    raise SystemExit(f"no 'tokens: ' line in generate_llama's output:\n{r.stdout}")


def compare(exe, name, model_dir, files, ours_attention, theirs_impl, work):
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM

    # transformers' reference: the saved directory loaded back in fp32.
    ref = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                           attn_implementation=theirs_impl).eval()
    ids = torch.tensor([list(PROMPT)], dtype=torch.long)
    with torch.no_grad():
        theirs = ref(ids).logits[0].float().numpy()
        gen = ref.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, attention_mask=torch.ones_like(ids))
    their_tokens = gen[0, ids.shape[1]:].tolist()

    logits_file = os.path.join(work, "logits")
    our_tokens = run_ours(exe, model_dir, logits_file, ours_attention)
    with open(logits_file + ".json") as f:
        shape = json.load(f)["shape"]
    ours = np.fromfile(logits_file, dtype="<f4").reshape(shape)

    ok = True
    if list(ours.shape) != list(theirs.shape):
        print(f"{name}: logits shape {list(ours.shape)}, transformers' {list(theirs.shape)}")
        return False
    rel = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    print(f"{name} ({', '.join(files)}): logits {shape[0]}x{shape[1]}, max relative "
          f"difference {rel:.3e} (max |ours - transformers'| / max |transformers'|, "
          f"tolerance {TOLERANCE:g})")
    if not rel <= TOLERANCE:
        ok = False
        print(f"{name}: FAIL logits differ by {rel:.3e} > {TOLERANCE:g}")
    print(f"{name}: generate_llama tokens {our_tokens}")
    print(f"{name}: transformers   tokens {their_tokens}")
    if our_tokens != their_tokens:
        ok = False
        print(f"{name}: FAIL the greedy tokens differ")
    if len(set(their_tokens)) < 2:
        ok = False
        print(f"{name}: FAIL the reference repeats one token; the comparison shows nothing")
    return ok


def check(exe, name, model, save_dtype, work, max_shard_size=None):
    model_dir = os.path.join(work, name)
    if save_dtype is not None:
        model = model.to(save_dtype)
    if max_shard_size is None:
        model.save_pretrained(model_dir)
    else:
        model.save_pretrained(model_dir, max_shard_size=max_shard_size)
    files = sorted(os.listdir(model_dir))
    ok = True
    for ours_attention, theirs_impl in PAIRS:
        ok &= compare(exe, f"{name} ({ours_attention} vs {theirs_impl})", model_dir, files,
                      ours_attention, theirs_impl, work)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generate-llama", required=True)
    args = ap.parse_args()
    try:
        import numpy  # noqa: F401
        import torch
        import transformers
        from transformers import LlamaForCausalLM  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: cannot run here
        skip(f"transformers does not import with {sys.executable}: {e}")
    torch.set_num_threads(1)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; "
          f"--attention against attn_implementation: {', '.join(a + ' vs ' + b for a, b in PAIRS)}")
    ok = True
    with tempfile.TemporaryDirectory(prefix="fsdp_llama_generate_") as work:
        ok &= check(args.generate_llama, "fp32-untied", build_model(False), None, work)
        ok &= check(args.generate_llama, "fp32-tied", build_model(True), None, work)
        ok &= check(args.generate_llama, "bf16-untied", build_model(False), torch.bfloat16, work)
        ok &= check(args.generate_llama, "fp32-tied-sharded", build_model(True), None, work,
                    max_shard_size="100KB")
    if not ok:
        sys.exit(1)
    print("OK: generate_llama's logits and greedy tokens equal transformers'")


if __name__ == "__main__":
    main()
