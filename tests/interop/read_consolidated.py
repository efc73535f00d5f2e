#!/usr/bin/env python3
"""Reads a consolidated fsdp checkpoint with h5py alone and checks it against what the
C++ side wrote (expected.txt: per line, name ndim dims... numel values...).

usage: read_consolidated.py FILE.h5 EXPECTED.txt   (exit 0 when everything matches)
"""
import sys

import h5py
import numpy as np


def main() -> int:
    path, expected_path = sys.argv[1], sys.argv[2]
    expected = {}
    with open(expected_path) as f:
        for line in f:
            parts = line.split()
            name, ndim = parts[0], int(parts[1])
            shape = tuple(int(x) for x in parts[2:2 + ndim])
            numel = int(parts[2 + ndim])
            values = np.array([float(x) for x in parts[3 + ndim:]], dtype=np.float32)
            assert values.size == numel, name
            expected[name] = values.reshape(shape)
    problems = []
    with h5py.File(path, "r") as f:
        if f.attrs["format"] != "fsdp.consolidated":
            problems.append(f"format attribute is {f.attrs['format']!r}")
        for key in ("format_version", "dtype", "step", "n_layer", "n_head", "d_model", "block_size", "vocab_size"):
            if key not in f.attrs:
                problems.append(f"root attribute {key} is missing")
        model = f["model"]
        names = set(model.keys())
        if names != set(expected):
            problems.append(f"names differ: only in file {sorted(names - set(expected))}, "
                            f"only in C++ {sorted(set(expected) - names)}")
        for name, want in expected.items():
            if name not in model:
                continue
            got = model[name][()]
            if got.shape != want.shape:
                problems.append(f"{name}: shape {got.shape} vs {want.shape}")
            elif not np.array_equal(got.astype(np.float32), want):
                problems.append(f"{name}: values differ (max {np.abs(got - want).max()})")
    for p in problems:
        print("mismatch:", p)
    if problems:
        return 1
    print(f"ok: {len(expected)} tensors, names, shapes and values match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
