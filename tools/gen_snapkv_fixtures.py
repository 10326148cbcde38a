#!/usr/bin/env python3
"""Generate the SnapKV golden fixtures read by tests/test_snapkv.cpp.

Usage (from the repository root; needs numpy, nothing else):

    python3 tools/gen_snapkv_fixtures.py            # writes tests/data/snapkv/
    python3 tools/gen_snapkv_fixtures.py --check    # regenerate in memory, compare with the files on disk

Deterministic (fixed seeds), so re-running leaves the committed files byte-identical.
The fixtures are committed; CI never runs this script and does not need numpy.

Layout of tests/data/snapkv/:

    manifest.txt               one case directory name per line
    <case>/params.json         {"kv_heads", "q_heads", "group", "tokens", "head_dim", "window", "kernel"}
    <case>/queries.npy         '<f4' [q_heads, window, head_dim]   post-RoPE queries of the last `window` positions
    <case>/keys_f32.npy        '<f4' [kv_heads, tokens, head_dim]
    <case>/keys_f16.npy        '<f2'  keys_f32 rounded to IEEE half (RNE)
    <case>/keys_bf16.npy       '<u2'  raw bfloat16 bits of keys_f32 (RNE)
    <case>/expected_<t>.npy    '<f8' [kv_heads, tokens]   t in f32 f16 bf16

Expected scores are float64 functions of the keys *as rounded to the element type*
and of the float32 queries (docs/methods/snapkv.md). Per KV head h, with G = q_heads/kv_heads,
its query heads h*G .. h*G+G-1, P = N - w:

    p[g,i,t] = softmax over t <= P+i of q[g,i].k[t] / sqrt(d)   (invalid keys excluded)
    x[t]     = mean over g and i of p[g,i,t]
    score[t] = avg_pool1d(x[:P], kernel 5, stride 1, padding 2, count_include_pad) for t < P
             = x[t]                                                              for t >= P
    score[t] = -inf for an invalid key (fp32 squared norm not finite)

The reference is cross-checked against a second formulation in the order kvpress
uses (pool each query head, then average the group), and the generator asserts
that the plausible wrong variants (no causal mask, pooling over the whole
sequence, no pooling, no GQA mean) differ from it by far more than the test
tolerance.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import fixtures  # tools/fixtures.py: the shared write / --check command line

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_fixtures import rounded_keys, valid_rows  # noqa: E402  (same rounding as the other fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "tests", "data", "snapkv")
KERNEL = 5

# name, kv heads, group, tokens, head_dim, window, seed, invalid rows [(head, token)]
CASES = [
    dict(name="g2_n40_d64_w8", kv_heads=2, group=2, tokens=40, head_dim=64, window=8, seed=3001, invalid=[]),
    dict(name="g4_n50_d33_w8", kv_heads=2, group=4, tokens=50, head_dim=33, window=8, seed=3002,
         invalid=[(1, 17), (0, 44)]),  # one in the prefix, one in the window
    dict(name="g2_n80_d64_w64", kv_heads=1, group=2, tokens=80, head_dim=64, window=64, seed=3003, invalid=[]),
    dict(name="g1_n12_d8_w12", kv_heads=2, group=1, tokens=12, head_dim=8, window=12, seed=3004, invalid=[]),
]
DTYPES = ["f32", "f16", "bf16"]


# ----------------------------------------------------------------- reference (float64)

def probs(q, k, valid, P):
    """[w, N] causal softmax of q.k/sqrt(d); query i sees keys t <= P + i; invalid keys get 0."""
    w, d = q.shape
    n = k.shape[0]
    kk = np.where(valid[:, None], k, 0.0)
    logits = q @ kk.T / np.sqrt(d)
    seen = np.arange(n)[None, :] <= (P + np.arange(w))[:, None]
    logits = np.where(seen & valid[None, :], logits, -np.inf)
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    return e / e.sum(axis=1, keepdims=True)


def pool_prefix(x, P, kernel):
    """torch avg_pool1d(kernel, stride 1, padding kernel//2, count_include_pad=True) of x[:P]."""
    r = kernel // 2
    padded = np.concatenate([np.zeros(r), x[:P], np.zeros(r)])
    return np.array([padded[t:t + kernel].sum() / kernel for t in range(P)])


def ref_snapkv(keys64, q64, kernel=KERNEL, causal=True, pool_all=False, group_mean=True):
    H, N, d = keys64.shape
    Hq, w, _ = q64.shape
    G = Hq // H
    P = N - w
    out = np.empty((H, N))
    for h in range(H):
        k = keys64[h]
        valid = valid_rows(k)
        x = np.zeros(N)
        heads = range(G) if group_mean else range(1)
        for g in heads:
            p = probs(q64[h * G + g], k, valid, P if causal else N)  # P = N: every query sees every key
            x += p.sum(axis=0)
        x /= len(heads) * w
        if pool_all:
            out[h] = pool_prefix(x, N, kernel)
        else:
            out[h, :P] = pool_prefix(x, P, kernel)
            out[h, P:] = x[P:]
        out[h, ~valid] = -np.inf
    return out


def ref_kvpress_order(keys64, q64, kernel=KERNEL):
    """Second formulation: per query head mean over the window, pool, then the group mean
    (the order of kvpress' SnapKVPress); window scores taken unpooled."""
    H, N, d = keys64.shape
    Hq, w, _ = q64.shape
    G = Hq // H
    P = N - w
    per_q = np.empty((Hq, N))
    for hq in range(Hq):
        k = keys64[hq // G]
        valid = valid_rows(k)
        x = probs(q64[hq], k, valid, P).mean(axis=0)
        r = kernel // 2
        # np.convolve with zero padding ('same' for odd kernel) / kernel
        pooled = np.convolve(np.pad(x[:P], r), np.ones(kernel), mode="valid") / kernel if P > 0 else np.zeros(0)
        per_q[hq, :P] = pooled
        per_q[hq, P:] = x[P:]
    out = per_q.reshape(H, G, N).mean(axis=1)
    for h in range(H):
        out[h, ~valid_rows(keys64[h])] = -np.inf
    return out


# ----------------------------------------------------------------- data

def make_case(rng, kv_heads, group, tokens, d, window, invalid):
    """Keys: anisotropic cloud around a shared mean (like real K caches) plus an attention
    sink at token 0 and a few heavy hitters aligned with some queries. Queries: a shared
    direction per group plus per-head and per-position noise, scaled so that the logits
    spread over a few units (softmax neither flat nor one-hot)."""
    Hq = kv_heads * group
    keys = np.empty((kv_heads, tokens, d))
    queries = np.empty((Hq, window, d))
    for h in range(kv_heads):
        mu = rng.normal(size=d)
        mu *= rng.uniform(1.0, 2.0) / np.linalg.norm(mu)
        scales = 0.3 + 1.0 * np.exp(-np.arange(d) / max(2.0, d / 8))
        basis, _ = np.linalg.qr(rng.normal(size=(d, d)))
        k = mu + (rng.normal(size=(tokens, d)) * scales) @ basis.T
        u = rng.normal(size=d)
        u /= np.linalg.norm(u)
        for g in range(group):
            v = u + 0.6 * rng.normal(size=d) / np.sqrt(d)
            queries[h * group + g] = v + 0.125 * rng.normal(size=(window, d))
        qg = queries[h * group:(h + 1) * group]
        # attention sink: token 0 along the group's mean query
        qm = qg.reshape(-1, d).mean(axis=0)
        k[0] = 1.2 * np.sqrt(d) * qm / (qm @ qm)
        # heavy hitters in the prefix, each aligned with one query of the group
        P = tokens - window
        if P > 4:
            for t in rng.choice(np.arange(1, P), size=min(3, P - 1), replace=False):
                g, i = rng.integers(group), rng.integers(window)
                qq = qg[g, i]
                k[t] = rng.uniform(1.5, 3.0) * np.sqrt(d) * qq / (qq @ qq) + 0.2 * rng.normal(size=d)
        keys[h] = k
    # scale the queries so the logits q.k/sqrt(d) have a standard deviation ~1.5 per head
    for hq in range(Hq):
        lg = queries[hq] @ keys[hq // group].T / np.sqrt(d)
        queries[hq] *= 1.5 / max(lg.std(), 1e-3)
    for h, t in invalid:
        keys[h, t] = 0.5
        keys[h, t, d // 2] = 1e20  # fp32 squared norm overflows: invalid in every dtype
    assert np.abs(queries).max() < 100
    return keys.astype("<f4"), queries.astype("<f4")


# ----------------------------------------------------------------- output

def rel_diff(a, b):
    fin = np.isfinite(a) & np.isfinite(b)
    assert np.array_equal(np.isfinite(a), np.isfinite(b))
    return np.max(np.abs(a[fin] - b[fin]) / np.maximum(np.abs(b[fin]), 1e-300))


def build() -> dict:
    files = {}

    def npy(rel, arr):
        files[rel] = fixtures.npy_bytes(arr)

    for c in CASES:
        rng = np.random.default_rng(c["seed"])
        keys, queries = make_case(rng, c["kv_heads"], c["group"], c["tokens"], c["head_dim"], c["window"],
                                  c["invalid"])
        base = c["name"]
        params = dict(kv_heads=c["kv_heads"], q_heads=c["kv_heads"] * c["group"], group=c["group"],
                      tokens=c["tokens"], head_dim=c["head_dim"], window=c["window"], kernel=KERNEL)
        files[f"{base}/params.json"] = (json.dumps(params, indent=1, sort_keys=True) + "\n").encode()
        npy(f"{base}/queries.npy", queries)
        q64 = queries.astype(np.float64)
        with np.errstate(over="ignore"):  # the 1e20 element becomes inf in float16
            variants = rounded_keys(keys)
        for t, (stored, k64) in variants.items():
            npy(f"{base}/keys_{t}.npy", stored)
            with np.errstate(over="ignore", invalid="ignore"):
                exp = ref_snapkv(k64, q64)
                other = ref_kvpress_order(k64, q64)
            assert rel_diff(other, exp) < 1e-12, (base, t, rel_diff(other, exp))
            assert np.isfinite(exp).sum() == exp.size - len(c["invalid"]), (base, t)
            assert np.all(exp[np.isfinite(exp)] > 0)
            npy(f"{base}/expected_{t}.npy", exp.astype("<f8"))
            check_variants_differ(base, k64, q64, exp, c)
    files["manifest.txt"] = ("\n".join(c["name"] for c in CASES) + "\n").encode()
    return files


def check_variants_differ(base, k64, q64, exp, c):
    """Each plausible mistake moves some score by > 2% relative (test tolerance is ~1e-4)."""
    P = c["tokens"] - c["window"]
    with np.errstate(over="ignore", invalid="ignore"):
        wrong = {}
        if P > 0:
            wrong["no causal mask"] = ref_snapkv(k64, q64, causal=False)
            wrong["pool over the whole sequence"] = ref_snapkv(k64, q64, pool_all=True)
            wrong["no pooling"] = ref_snapkv(k64, q64, kernel=1)
        if c["group"] > 1:
            wrong["first head of the group only"] = ref_snapkv(k64, q64, group_mean=False)
    for what, v in wrong.items():
        d = rel_diff(v, exp)
        assert d > 0.02, (base, what, d)


def self_check():
    x = np.zeros(9)
    x[4] = 1.0
    assert np.allclose(pool_prefix(x, 9, 5), [0, 0, .2, .2, .2, .2, .2, 0, 0])
    x = np.ones(6)
    assert np.allclose(pool_prefix(x, 6, 5), [.6, .8, 1, 1, .8, .6])  # zero padding, divisor 5
    assert np.allclose(pool_prefix(x, 6, 1), x)


def main() -> int:
    return fixtures.main(__doc__.split("\n")[0], OUT_DIR, build, self_check=self_check, max_bytes=300 * 1024)

if __name__ == "__main__":
    sys.exit(main())
