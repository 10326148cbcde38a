#!/usr/bin/env python3
"""Generate the golden fixtures read by tests/test_golden.cpp.

Usage (from the repository root; needs numpy, nothing else):

    python3 tools/gen_fixtures.py            # writes tests/data/golden/
    python3 tools/gen_fixtures.py --check    # regenerate in memory, compare with what is on disk

The output is deterministic (numpy.random.default_rng with fixed seeds, no
dependence on the clock or on the machine), so re-running it leaves the committed
files byte-identical. The fixtures are committed; CI never runs this script and
does not need numpy.

Layout of tests/data/golden/:

    manifest.txt                  one case directory name per line
    <case>/params.json            {"heads", "tokens", "head_dim", "window", "qfilter_layer"}
    <case>/keys_f32.npy           '<f4' [H, N, d]
    <case>/keys_f16.npy           '<f2' [H, N, d]   keys_f32 rounded to IEEE half (RNE)
    <case>/keys_bf16.npy          '<u2' [H, N, d]   raw bfloat16 bits of keys_f32 (RNE)
    <case>/filters.npy            '<f4' [2, H, d]   Q-Filters for 2 layers
    <case>/expected_<m>_<t>.npy   '<f8' [H, N]      m in knorm keydiff l2 windowed-l2 qfilter,
                                                    t in f32 f16 bf16
    calib/calib_queries.npy       '<f4' [4, 200, 16]
    calib/calib_expected_filters.npy '<f8' [2, 16]
    calib/params.json             {"q_heads", "n", "head_dim", "kv_heads"}

Expected scores are computed in float64 from the keys *as rounded to the element
type* (the scorer only ever sees the rounded values), following the definitions
in docs/contributing/testing.md: per KV head h, "higher score = keep",

    knorm        -||k||
    keydiff      -cos(k, abar), abar = mean of k/||k|| over valid non-zero rows;
                 zero-norm key -> 0, abar == 0 -> every valid key 0
    l2           ||k - mu||, mu = mean of the valid rows
    windowed-l2  ||k - mu_w||, windows of `window` tokens (kvscore::WindowTail::merge, the default); a tail shorter than
                 half a window is merged into the last full window
    qfilter      <k, f_h>, f_h = filters[qfilter_layer, h]

A row is valid iff its fp32 squared norm is finite; invalid rows score -inf and
are excluded from every mean. (The fixtures contain no invalid rows: NaN/Inf
handling is covered by tests/test_scorer_properties.cpp.)

Calibration (kvscore::calibrate_qfilters): per query head the top right singular
vector v1 of the uncentred n x d query matrix (numpy.linalg.svd), sign chosen so
that the majority of the samples project positively (tie: the sum of the
projections is positive), then the plain mean over each contiguous GQA group.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import fixtures  # tools/fixtures.py: the shared write / --check command line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "tests", "data", "golden")
QFILTER_LAYERS = 2
QFILTER_LAYER = 1  # expected_qfilter_* use this layer of filters.npy

# name, heads, tokens, head_dim, window, seed, options
#   windows: 37/16 -> [0,16) [16,37) (tail 5 merged: 2*5 < 16)
#            130/48 -> [0,48) [48,96) [96,130) (tail 34 own window: 2*34 >= 48)
#            5/16 -> one global window (N < W)
#            23/10 -> [0,10) [10,23) (tail 3 merged)
#            19/6 -> [0,6) [6,12) [12,19) (tail 1 merged)
CASES = [
    dict(name="h2_n37_d64", heads=2, tokens=37, head_dim=64, window=16, seed=1001, zero_row=None),
    dict(name="h3_n130_d128", heads=3, tokens=130, head_dim=128, window=48, seed=1002, zero_row=None),
    dict(name="h1_n5_d8", heads=1, tokens=5, head_dim=8, window=16, seed=1003, zero_row=None),
    dict(name="h2_n23_d20", heads=2, tokens=23, head_dim=20, window=10, seed=1004, zero_row=(0, 4)),
    dict(name="h4_n19_d33", heads=4, tokens=19, head_dim=33, window=6, seed=1005, zero_row=None),
]
METHODS = ["knorm", "keydiff", "l2", "windowed-l2", "qfilter"]
DTYPES = ["f32", "f16", "bf16"]


# ----------------------------------------------------------------- element types

def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bfloat16, as raw uint16 bits (no NaN in input)."""
    x = np.ascontiguousarray(x, dtype="<f4")
    assert np.all(np.isfinite(x)), "bf16 rounding here does not handle NaN/Inf"
    u = x.view("<u4").astype(np.uint64)  # 64-bit so x + 0x7fff cannot wrap
    b = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return b.astype("<u2")


def bf16_bits_to_f64(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view("<f4").astype(np.float64)


def rounded_keys(keys_f32: np.ndarray) -> dict:
    """Per dtype: (array written to disk, float64 values the scorer sees)."""
    f16 = keys_f32.astype("<f2")  # numpy: IEEE RNE
    bf16 = f32_to_bf16_bits(keys_f32)
    return {
        "f32": (keys_f32.astype("<f4"), keys_f32.astype(np.float64)),
        "f16": (f16, f16.astype(np.float64)),
        "bf16": (bf16, bf16_bits_to_f64(bf16)),
    }


# ----------------------------------------------------------------- reference scorers (float64)

def valid_rows(k: np.ndarray) -> np.ndarray:
    """[N] bool: fp32 squared norm is finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        sq = np.sum(k.astype(np.float32) ** 2, axis=-1, dtype=np.float32)
    return np.isfinite(sq)


def ref_knorm(k):
    out = -np.linalg.norm(k, axis=-1)
    out[~valid_rows(k)] = -np.inf
    return out


def ref_keydiff(k):
    valid = valid_rows(k)
    out = np.full(k.shape[0], -np.inf)
    kv = k[valid]
    norms = np.linalg.norm(kv, axis=-1)
    nz = norms > 0
    if nz.any():
        abar = (kv[nz] / norms[nz, None]).mean(axis=0)
    else:
        abar = np.zeros(k.shape[1])
    an = np.linalg.norm(abar)
    s = np.zeros(kv.shape[0])
    if an > 0:
        s[nz] = -(kv[nz] @ abar) / (norms[nz] * an)
    out[valid] = s
    return out


def ref_l2(k):
    valid = valid_rows(k)
    out = np.full(k.shape[0], -np.inf)
    if valid.any():
        mu = k[valid].mean(axis=0)
        out[valid] = np.linalg.norm(k[valid] - mu, axis=-1)
    return out


def windows(n: int, w: int) -> list:
    """[(t0, t1)] per the tail rule (docs/contributing/testing.md)."""
    if n == 0:
        return []
    if n < w:
        return [(0, n)]
    n_full, tail = divmod(n, w)
    bounds = [(i * w, (i + 1) * w) for i in range(n_full)]
    if tail > 0:
        if n_full >= 1 and 2 * tail < w:
            bounds[-1] = (bounds[-1][0], n)
        else:
            bounds.append((n_full * w, n))
    return bounds


def ref_windowed_l2(k, w):
    out = np.empty(k.shape[0])
    for t0, t1 in windows(k.shape[0], w):
        out[t0:t1] = ref_l2(k[t0:t1])
    return out


def ref_qfilter(k, f):
    out = k @ f.astype(np.float64)
    out[~valid_rows(k)] = -np.inf
    return out


def score_all(keys64: np.ndarray, method: str, window: int, filters_layer: np.ndarray) -> np.ndarray:
    heads = keys64.shape[0]
    res = []
    for h in range(heads):
        k = keys64[h]
        if method == "knorm":
            res.append(ref_knorm(k))
        elif method == "keydiff":
            res.append(ref_keydiff(k))
        elif method == "l2":
            res.append(ref_l2(k))
        elif method == "windowed-l2":
            res.append(ref_windowed_l2(k, window))
        elif method == "qfilter":
            res.append(ref_qfilter(k, filters_layer[h]))
        else:
            raise ValueError(method)
    return np.stack(res).astype("<f8")


# ----------------------------------------------------------------- data

def make_keys(rng, heads, tokens, d, zero_row):
    """Structured keys per head: an anisotropic cloud around a mean direction mu
    (like real K caches, which have a large shared component), plus radial outliers
    k = alpha*mu (same direction, large norm) and angular outliers (typical norm,
    direction orthogonal to mu)."""
    keys = np.empty((heads, tokens, d), dtype=np.float64)
    for h in range(heads):
        mu = rng.normal(size=d)
        mu *= rng.uniform(2.0, 4.0) / np.linalg.norm(mu)
        # anisotropic noise: a few strong principal axes, the rest weak
        scales = 0.15 + 1.2 * np.exp(-np.arange(d) / max(2.0, d / 8))
        basis, _ = np.linalg.qr(rng.normal(size=(d, d)))
        noise = (rng.normal(size=(tokens, d)) * scales) @ basis.T
        k = mu + noise
        idx = rng.permutation(tokens)
        n_rad = 1 if tokens < 10 else max(2, tokens // 20)
        n_ang = 1 if tokens < 10 else max(2, tokens // 25)
        for t in idx[:n_rad]:
            k[t] = rng.uniform(4.0, 9.0) * mu
        for t in idx[n_rad:n_rad + n_ang]:
            v = rng.normal(size=d)
            v -= (v @ mu) / (mu @ mu) * mu
            k[t] = v / np.linalg.norm(v) * np.linalg.norm(mu) * rng.uniform(0.8, 1.5)
        keys[h] = k
    if zero_row is not None:
        keys[zero_row[0], zero_row[1]] = 0.0
    # values stay well inside the float16 range (|x| < 65504) and away from subnormals mostly
    assert np.abs(keys).max() < 1000.0
    return keys.astype("<f4")


def make_filters(rng, heads, d):
    f = rng.normal(size=(QFILTER_LAYERS, heads, d))
    f /= np.linalg.norm(f, axis=-1, keepdims=True)
    return f.astype("<f4")


def top_singular_vector(q: np.ndarray) -> np.ndarray:
    _, _, vt = np.linalg.svd(q, full_matrices=False)
    v = vt[0].copy()
    p = q @ v
    pos, neg = int(np.sum(p > 0)), int(np.sum(p < 0))
    if neg > pos or (neg == pos and p.sum() < 0):
        v = -v
    return v


def make_calibration(rng):
    q_heads, n, d, kv_heads = 4, 200, 16, 2
    queries = np.empty((q_heads, n, d), dtype=np.float64)
    planted = np.empty((q_heads, d))
    # planted dominant direction per head; head 2's coefficient has negative mean,
    # so the SVD sign has to be flipped to make the majority project positively.
    coef_mean = [3.0, 2.5, -3.0, 2.0]
    for h in range(q_heads):
        u = rng.normal(size=d)
        u /= np.linalg.norm(u)
        planted[h] = u
        c = rng.normal(loc=coef_mean[h], scale=0.7, size=n)
        queries[h] = c[:, None] * u + 0.3 * rng.normal(size=(n, d))
    queries = queries.astype("<f4")
    q64 = queries.astype(np.float64)
    v1 = np.stack([top_singular_vector(q64[h]) for h in range(q_heads)])
    # v1 recovers the planted direction, and for head 2 the sign rule turns it around
    align = np.sum(v1 * planted, axis=1)
    assert np.all(np.abs(align) > 0.99), align
    assert align[2] < 0 and np.all(np.delete(align, 2) > 0), align
    g = q_heads // kv_heads
    expected = v1.reshape(kv_heads, g, d).mean(axis=1).astype("<f8")
    params = dict(q_heads=q_heads, n=n, head_dim=d, kv_heads=kv_heads)
    return queries, expected, params


# ----------------------------------------------------------------- output

def build() -> dict:
    """{relative path: bytes} of every fixture file."""
    files = {}

    def npy(rel, arr):
        files[rel] = fixtures.npy_bytes(arr)

    for c in CASES:
        rng = np.random.default_rng(c["seed"])
        keys = make_keys(rng, c["heads"], c["tokens"], c["head_dim"], c["zero_row"])
        filters = make_filters(rng, c["heads"], c["head_dim"])
        base = c["name"]
        params = dict(heads=c["heads"], tokens=c["tokens"], head_dim=c["head_dim"], window=c["window"],
                      qfilter_layer=QFILTER_LAYER)
        files[f"{base}/params.json"] = (json.dumps(params, indent=1, sort_keys=True) + "\n").encode()
        npy(f"{base}/filters.npy", filters)
        for t, (stored, k64) in rounded_keys(keys).items():
            npy(f"{base}/keys_{t}.npy", stored)
            for m in METHODS:
                npy(f"{base}/expected_{m}_{t}.npy", score_all(k64, m, c["window"], filters[QFILTER_LAYER]))

    rng = np.random.default_rng(2001)
    queries, expected, params = make_calibration(rng)
    npy("calib/calib_queries.npy", queries)
    npy("calib/calib_expected_filters.npy", expected)
    files["calib/params.json"] = (json.dumps(params, indent=1, sort_keys=True) + "\n").encode()

    files["manifest.txt"] = ("\n".join(c["name"] for c in CASES) + "\n").encode()
    return files


def self_check():
    """Sanity checks of the reference itself (cheap; run on every generation)."""
    assert windows(37, 16) == [(0, 16), (16, 37)]
    assert windows(130, 48) == [(0, 48), (48, 96), (96, 130)]
    assert windows(5, 16) == [(0, 5)]
    assert windows(23, 10) == [(0, 10), (10, 23)]
    assert windows(19, 6) == [(0, 6), (6, 12), (12, 19)]
    assert windows(32, 16) == [(0, 16), (16, 32)]
    assert windows(16, 16) == [(0, 16)]
    # bf16 rounding: ties to even, carries into the exponent
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -2.5, 3.3895314e38, 3.4028235e38], dtype="<f4")
    b = f32_to_bf16_bits(x)
    assert list(b) == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC020, 0x7F7F, 0x7F80], [hex(v) for v in b]


def main() -> int:
    return fixtures.main(__doc__.split("\n")[0], OUT_DIR, build, self_check=self_check, max_bytes=2 * 1024 * 1024)

if __name__ == "__main__":
    sys.exit(main())
