#!/usr/bin/env python3
"""Generate the golden fixtures read by tests/test_eval_metrics.cpp and tests/test_synth.cpp.

Usage (from the repository root; needs numpy, nothing else):

    python3 tools/gen_eval_fixtures.py            # writes tests/data/eval/
    python3 tools/gen_eval_fixtures.py --check    # regenerate in memory, compare with the files on disk

Deterministic (fixed seeds). The fixtures are committed; CI never runs this script.

tests/data/eval/:
    keys.npy       '<f4' [N, d]      one KV head's keys (N = 37, d = 16)
    values.npy     '<f4' [N, dv]     its values (dv = 12)
    queries.npy    '<f4' [R, d]      R = 5 query rows
    kept.npy       '<i8' [m]         a kept set (ascending)
    expected.npy   '<f8' [R, 3]      per row: attention-mass recall, output relative error, top-k overlap
    lse.npy        '<f8' [R]         log-sum-exp of the logits q.k/sqrt(d)
    full_out.npy   '<f8' [R, dv]     full attention output
    splitmix.npy   '<u8' [2, 8]      first 8 splitmix64 outputs for seeds 0 and 0xDEADBEEF
    normals.npy    '<f8' [9]         first 9 Box-Muller normals of kvscore::synth::Normal(42)
    stream_seeds.npy '<u8' [3]       synth::stream_seed for (7,0,0,0), (7,2,3,1), (2**64-1, 5, 1023, 2)

The reference computes each quantity directly from its definition (docs/reference/evaluate.md), not
in the order the C++ does: p = exp(l) / sum(exp(l)) with a max shift, o_kept as a
softmax over the kept logits alone (not by renormalising p), the top-k set with
numpy's stable argsort of -p.
"""

from __future__ import annotations

import math
import pathlib
import sys

import numpy as np

import fixtures  # tools/fixtures.py: the shared write / --check command line

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "eval"
MASK = (1 << 64) - 1


def splitmix64(state: int):
    while True:
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        yield z ^ (z >> 31)


def first(seed: int, n: int) -> list[int]:
    g = splitmix64(seed)
    return [next(g) for _ in range(n)]


def normals(seed: int, n: int) -> list[float]:
    g = splitmix64(seed)
    out: list[float] = []
    while len(out) < n:
        u1 = ((next(g) >> 11) + 1) * 2.0**-53
        u2 = ((next(g) >> 11) + 1) * 2.0**-53
        r = math.sqrt(-2.0 * math.log(u1))
        th = 6.283185307179586 * u2
        out += [r * math.cos(th), r * math.sin(th)]
    return out[:n]


def stream_seed(seed: int, layer: int, head: int, stream: int) -> int:
    s = first(seed, 1)[0]
    s = first(s ^ layer, 1)[0]
    s = first(s ^ (head + 0x100000000), 1)[0]
    return first(s ^ (stream + 0x200000000), 1)[0]


def build() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20261122)
    N, d, dv, R = 37, 16, 12, 5
    keys = rng.normal(0, 1, (N, d)).astype(np.float32)
    keys[5] *= 3.0  # a few strongly attended tokens, so the metrics are far from uniform
    keys[20] *= 2.5
    values = rng.normal(0, 1, (N, dv)).astype(np.float32)
    queries = (rng.normal(0, 1, (R, d)) * 1.5).astype(np.float32)
    queries[2] = keys[5] * 0.8  # a query that attends mostly one token
    kept = np.array([0, 3, 5, 6, 11, 17, 20, 28, 36], dtype=np.int64)

    k64, v64, q64 = keys.astype(np.float64), values.astype(np.float64), queries.astype(np.float64)
    logits = (q64 @ k64.T) / math.sqrt(d)
    exp = np.empty((R, 3))
    lse = np.empty(R)
    full = np.empty((R, dv))
    k = len(kept)
    for r in range(R):
        l = logits[r]
        m = l.max()
        e = np.exp(l - m)
        p = e / e.sum()
        lse[r] = m + math.log(e.sum())
        full[r] = p @ v64
        lk = l[kept]
        ek = np.exp(lk - lk.max())
        o = (ek / ek.sum()) @ v64[kept]
        top = np.argsort(-p, kind="stable")[:k]
        assert len(np.unique(p)) == N, "fixture must not contain tied probabilities"
        exp[r] = [p[kept].sum(), np.linalg.norm(o - full[r]) / np.linalg.norm(full[r]),
                  len(np.intersect1d(top, kept)) / k]
    # the metrics must not be trivial on this fixture
    assert exp[:, 0].min() < 0.9 and exp[:, 0].max() > 0.5
    assert exp[:, 2].min() < 1.0 and exp[2, 0] > 0.9

    return {
        "keys.npy": keys,
        "values.npy": values,
        "queries.npy": queries,
        "kept.npy": kept,
        "expected.npy": exp,
        "lse.npy": lse,
        "full_out.npy": full,
        "splitmix.npy": np.array([first(0, 8), first(0xDEADBEEF, 8)], dtype=np.uint64),
        "normals.npy": np.array(normals(42, 9), dtype=np.float64),
        "stream_seeds.npy": np.array([stream_seed(7, 0, 0, 0), stream_seed(7, 2, 3, 1),
                                      stream_seed(MASK, 5, 1023, 2)], dtype=np.uint64),
    }


def to_bytes(a: np.ndarray) -> bytes:
    return fixtures.npy_bytes(a)


def self_check() -> None:
    # splitmix64 reference value (Vigna's splitmix64.c, seed 0)
    assert first(0, 1)[0] == 0xE220A8397B1DCDAF


def main() -> int:
    return fixtures.main(__doc__, str(OUT), lambda: {n: to_bytes(a) for n, a in build().items()},
                         self_check=self_check)

if __name__ == "__main__":
    sys.exit(main())
