#!/usr/bin/python3
"""The safetensors exports, read by the reference implementation (Debian's
python3-safetensors): every export that fsdp-consolidate --format safetensors writes
(one file and split over files with an index; fp32, bf16, fp16) loads with
safetensors.torch.load_file and safe_open, holds exactly the values of the HDF5 export of
the same checkpoint, and a GPT built in Python from its tensors (the architecture of
docs/design.md, "Contracts") writes the same greedy text as `generate`.

usage: read_safetensors.py --bin-dir BUILD/bin   (exit 0: all good; 77: skipped, with why)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

SKIP = 77


def run(cmd, **kw):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)} exited {r.returncode}:\n{r.stdout}")
    return r.stdout


def load_all(path):
    """Every tensor of an export directory through the reference reader, and the metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, ["model.safetensors"]
    tensors, metadata = {}, None
    for name in files:
        full = os.path.join(path, name)
        loaded = load_file(full)
        with safe_open(full, framework="pt") as f:
            metadata = metadata or f.metadata()
            for k in f.keys():
                assert k in loaded, f"{full}: safe_open lists {k}, load_file lacks it"
                assert loaded[k].equal(f.get_tensor(k)), f"{full}: {k} differs between the readers"
        for k, v in loaded.items():
            if weight_map is not None:
                assert weight_map[k] == name, f"{k}: index says {weight_map[k]}, found in {name}"
            tensors[k] = v
    if weight_map is not None:
        assert set(weight_map) == set(tensors), "the index and the files list other tensors"
    return tensors, metadata


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    args = ap.parse_args()
    try:
        import h5py  # noqa: F401
        import numpy as np
        import safetensors.torch  # noqa: F401
        import torch
    except Exception as e:  # the reason, then skip
        print(f"skipped: the reference safetensors reader does not import here: {type(e).__name__}: {e}")
        return SKIP

    import h5py
    b = args.bin_dir
    with tempfile.TemporaryDirectory(prefix="fsdp_st_interop_") as d:
        ck = os.path.join(d, "ck")
        run([f"{b}/fsdp-run", "--nproc", "2", "--", f"{b}/train_gpt", "--steps", "8", "--n-layer", "2",
             "--n-head", "2", "--d-model", "32", "--block-size", "32", "--batch-size", "8", "--save-dir", ck])
        split = 20000  # bytes: the fp32 export spans several files
        ref = os.path.join(d, "ref.h5")
        run([f"{b}/fsdp-consolidate", ck, ref, "-q"])
        with h5py.File(ref, "r") as h:
            want32 = {k: torch.from_numpy(np.asarray(h["model"][k])) for k in h["model"]}
        for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            for variant, extra in (("one", []), ("split", ["--max-shard-size", str(split)])):
                out = os.path.join(d, f"st_{tag}_{variant}")
                run([f"{b}/fsdp-consolidate", ck, out, "--format", "safetensors", "--dtype", tag, "-q"] + extra)
                n_files = len([f for f in os.listdir(out) if f.endswith(".safetensors")])
                if variant == "split" and tag == "fp32":
                    assert n_files > 1, f"{out}: expected several files, found {n_files}"
                got, meta = load_all(out)
                assert meta["format"] == "pt" and meta["step"] == "8" and meta["n_layer"] == "2", meta
                assert set(got) == set(want32), f"{out}: names differ from the HDF5 export"
                for k, v in got.items():
                    w = want32[k].to(dtype)  # the HDF5 export's fp32 values, rounded by torch
                    assert v.dtype == dtype and v.shape == w.shape, f"{out}: {k} is {v.dtype} {tuple(v.shape)}"
                    bits = torch.int32 if dtype == torch.float32 else torch.int16
                    assert torch.equal(v.view(bits), w.view(bits)), f"{out}: {k} differs from the HDF5 export"
                print(f"ok: {tag} {variant}: {len(got)} tensors in {n_files} file(s) equal the HDF5 export")

        # A Python GPT from the fp32 tensors writes generate's greedy text.
        sys.dont_write_bytecode = True  # no __pycache__ in the source tree
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import fsdp_gpt

        cfg = argparse.Namespace(n_layer=2, n_head=2, d_model=32, block_size=32)
        model, _ = fsdp_gpt.build_model(cfg)
        tensors, _ = load_all(os.path.join(d, "st_fp32_split"))
        model.load_state_dict(tensors, strict=True)
        model.eval()
        tokens = list(b"abc")
        with torch.no_grad():
            for _ in range(40):
                ctx = torch.tensor([tokens[-cfg.block_size:]], dtype=torch.long)
                tokens.append(int(model(ctx)[0, -1].float().argmax()))
        ours = bytes(tokens[3:])
        theirs = subprocess.run([f"{b}/generate", "--weights", os.path.join(d, "st_fp32_split"), "--prompt", "abc",
                                 "--max-new-tokens", "40", "--greedy"], stdout=subprocess.PIPE, check=True).stdout
        assert ours == theirs, f"Python greedy text {ours!r} differs from generate's {theirs!r}"
        print(f"ok: a Python GPT from the safetensors writes generate's greedy text: {ours!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
