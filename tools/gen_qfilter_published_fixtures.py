#!/usr/bin/env python3
"""Writes tests/data/qfilters_published_{f32,f16,bf16}.safetensors: a Q-Filter file in the
authors' published format (safetensors, tensor `q_filters` [layers, kv_heads, head_dim]) and
their sign convention (score = -<f, k>), for tests/test_safetensors.cpp.

The values are multiples of 1/8 in [-2, 2], exact in F32, F16 and BF16, so the three files hold
the same filters and every dot product with the test's keys (also multiples of 1/8) is exact in
fp32: the test compares scores bit for bit with -<f, k> computed in fp64. Plain Python (struct,
json); no numpy needed. qfilters_published_values.txt lists the values (C order) for the test.
"""
import json
import random
import struct
import sys
from pathlib import Path

import fixtures  # tools/fixtures.py: the shared write / --check command line

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 8


def values():
    rng = random.Random(20261124)
    return [rng.randint(-16, 16) / 8.0 for _ in range(LAYERS * KV_HEADS * HEAD_DIM)]


def encode(vals, dtype):
    if dtype == "F32":
        return b"".join(struct.pack("<f", v) for v in vals)
    if dtype == "F16":
        return b"".join(struct.pack("<e", v) for v in vals)
    # BF16: the upper 16 bits of the fp32 pattern (exact for these values)
    return b"".join(struct.pack("<f", v)[2:] for v in vals)


def safetensors(dtype, vals):
    data = encode(vals, dtype)
    header = {
        "__metadata__": {"format": "pt", "note": "kvscore test fixture, published Q-Filters convention (-<f, k>)"},
        "q_filters": {"dtype": dtype, "shape": [LAYERS, KV_HEADS, HEAD_DIM], "data_offsets": [0, len(data)]},
    }
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the writers pad the header to 8 bytes
    return struct.pack("<Q", len(h)) + h + data


def build():
    vals = values()
    files = {f"qfilters_published_{dt.lower()}.safetensors": safetensors(dt, vals) for dt in ("F32", "F16", "BF16")}
    files["qfilters_published_values.txt"] = (" ".join(repr(v) for v in vals) + "\n").encode()
    return files


if __name__ == "__main__":
    sys.exit(fixtures.main(__doc__, str(Path(__file__).resolve().parent.parent / "tests" / "data"), build))
