#!/usr/bin/env python3
"""Generate the ProtoKV golden fixtures read by tests/test_protokv.cpp.

Usage (from the repository root; needs numpy, nothing else):

    python3 tools/gen_protokv_fixtures.py            # writes tests/data/protokv/
    python3 tools/gen_protokv_fixtures.py --check    # regenerate in memory, compare with the files on disk

Deterministic, so re-running leaves the committed files byte-identical. CI never runs it.

Layout of tests/data/protokv/:

    manifest.txt                 one case directory name per line
    <case>/params.json           shapes and every ProtoKV parameter of the case; "keys_from" names the
                                 case whose keys_*.npy and queries.npy it uses (itself, or the case
                                 with the same data it shares them with)
    <case>/queries.npy           '<f4' [q_heads, window, head_dim]
    <case>/keys_<t>.npy          t in f32 ('<f4'), f16 ('<f2'): [kv_heads, tokens, head_dim]
    <case>/<t>_scores.npy        '<f8' [kv_heads, tokens]  expected scores (integer ranks, -inf invalid)
    <case>/<t>_similarity.npy    '<f8' [kv_heads, tokens]  S_kappa (NaN for invalid keys)
    <case>/<t>_candidates.npy    '<i8' [kv_heads, p]       SAT candidates, highest deviation first
    <case>/<t>_buckets.npy       '<i8' [kv_heads, p]       their LSH bucket ids
    <case>/<t>_cluster.npy       '<i8' [kv_heads, tokens]  prototype of each token (-1 invalid)
    <case>/<t>_psi.npy           '<f8' [kv_heads, P]       psi per prototype (0 when empty), P padded with NaN
    <case>/<t>_bandwidth.npy     '<f8' [kv_heads]
    <case>/rff_W.npy, rff_b.npy  '<f8' RFF parameters of heads 0 and 1 for the case's seed and lsh_bits

The reference below is an independent float64 implementation of docs/methods/protokv.md. The random
numbers are reproduced bit for bit in pure Python (splitmix64, Box–Muller with math.log/cos/sin).
Every discrete decision the C++ code makes in fp32 (the p-th candidate, each LSH sign, each
argmax, the order of cluster psi and of q.k inside a cluster) is asserted here to have a margin
far above fp32 rounding, so the expected ranks are exact.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

import fixtures  # tools/fixtures.py: the shared write / --check command line

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_fixtures import valid_rows  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "tests", "data", "protokv")
M64 = (1 << 64) - 1
DTYPES = ["f32", "f16"]

CASES = [
    dict(name="g2_n300_d32", kv_heads=2, group=2, tokens=300, head_dim=32, window=8, kappa=5, sat_candidates=12,
         lsh_bits=2, chunks=20, bandwidth=0.0, seed=7, psi="sum", data_seed=4001, invalid=[(1, 41)], zero=[(0, 77)]),
    dict(name="g2_n300_d32_mean", kv_heads=2, group=2, tokens=300, head_dim=32, window=8, kappa=5, sat_candidates=12,
         lsh_bits=2, chunks=20, bandwidth=0.0, seed=7, psi="mean", data_seed=4001, invalid=[(1, 41)], zero=[(0, 77)]),
    dict(name="g1_n160_d17_k3", kv_heads=2, group=1, tokens=160, head_dim=17, window=16, kappa=3, sat_candidates=20,
         lsh_bits=3, chunks=9, bandwidth=0.9, seed=12345, psi="sum", data_seed=4002, invalid=[], zero=[]),
    dict(name="g4_n96_d64_w96", kv_heads=1, group=4, tokens=96, head_dim=64, window=96, kappa=5, sat_candidates=8,
         lsh_bits=1, chunks=40, bandwidth=0.0, seed=99, psi="sum", data_seed=4003, invalid=[(0, 5)], zero=[]),
]


# ----------------------------------------------------------------- RNG (bit-exact with the C++)

def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class SplitMix64:
    def __init__(self, state):
        self.state = state & M64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & M64
        return mix(self.state)

    def uniform(self):
        return (self.next() >> 11) * 2.0 ** -53


def rff_params(seed, h, r, d):
    g = SplitMix64(mix(seed ^ mix(h + 1)))
    two_pi = 6.283185307179586
    n = r * d
    W = [0.0] * n
    for i in range(0, n, 2):
        u1 = 1.0 - g.uniform()
        u2 = g.uniform()
        rad = math.sqrt(-2.0 * math.log(u1))
        W[i] = rad * math.cos(two_pi * u2)
        if i + 1 < n:
            W[i + 1] = rad * math.sin(two_pi * u2)
    b = [two_pi * g.uniform() for _ in range(r)]
    return np.array(W).reshape(r, d), np.array(b)


# ----------------------------------------------------------------- reference (float64)

class Margin(Exception):
    pass


def need(cond, what):
    if not cond:
        raise Margin(what)


def ref_head(k, qbar, c, h):
    """ProtoKV on one head, float64. Returns a dict of every intermediate."""
    N, d = k.shape
    valid = valid_rows(k)
    norm = np.where(valid, np.linalg.norm(np.where(valid[:, None], k, 0.0), axis=1), 0.0)
    U = np.zeros_like(k)
    nz = valid & (norm > 0)
    U[nz] = k[nz] / norm[nz, None]
    qk = np.where(valid, np.where(valid[:, None], k, 0.0) @ qbar, 0.0)
    # 1. neighbourhood similarity without the token itself, over valid neighbours
    kap = c["kappa"]
    S = np.full(N, np.nan)
    for i in range(N):
        if not valid[i]:
            continue
        js = [j for j in range(max(0, i - kap), min(N, i + kap + 1)) if j != i and valid[j]]
        S[i] = np.mean([U[i] @ U[j] for j in js]) if js else 1.0
    elig = np.nonzero(nz)[0]
    # 2. candidates: lowest S first, ties by position
    p = min(c["sat_candidates"], len(elig))
    order = sorted(elig, key=lambda t: (S[t], t))
    cand = order[:p]
    if 0 < p < len(elig):
        need(S[order[p]] - S[order[p - 1]] > 1e-5, f"candidate boundary gap {S[order[p]] - S[order[p - 1]]}")
    # bandwidth
    sigma = c["bandwidth"]
    if sigma == 0:
        dist = sorted(np.linalg.norm(U[x] - U[y]) for i, x in enumerate(cand) for y in cand[i + 1:])
        sigma = dist[(len(dist) - 1) // 2] if dist else 0.0
        if not sigma > 0:
            sigma = 1.0
    W, b = rff_params(c["seed"], h, c["lsh_bits"], d)
    buckets = []
    for t in cand:
        bid = 0
        for i in range(c["lsh_bits"]):
            v = math.cos(float(W[i] @ U[t]) / sigma + b[i])
            need(abs(v) > 1e-4, f"LSH sign margin {v}")
            bid = (bid << 1) | (1 if v >= 0 else 0)
        buckets.append(bid)
    # 3. PDT chunks over the other valid tokens
    cset = set(cand)
    rest = [t for t in range(N) if valid[t] and t not in cset]
    v = min(c["chunks"], len(rest))
    bounds = [ci * len(rest) // v for ci in range(v + 1)] if v > 0 else [0]
    protos = []

    def unit_sum(ts):
        s = np.sum([k[t] for t in ts], axis=0) if ts else np.zeros(d)
        n = np.linalg.norm(s)
        return s / n if n > 0 else np.zeros(d)

    for ci in range(v):
        protos.append(unit_sum(rest[bounds[ci]:bounds[ci + 1]]))
    ids = sorted(set(buckets))
    for bid in ids:
        protos.append(unit_sum([t for t, bb in zip(cand, buckets) if bb == bid]))
    Pm = np.array(protos).reshape(len(protos), d)
    P = len(protos)
    # 4. nearest prototype
    cl = np.full(N, -1)
    if P > 0:
        sims = U @ Pm.T
        for t in range(N):
            if not valid[t]:
                continue
            row = sims[t]
            best = int(np.argmax(row))  # first maximum
            if norm[t] > 0 and P > 1:
                srt = np.sort(row)
                need(srt[-1] - srt[-2] > 1e-4, f"argmax margin {srt[-1] - srt[-2]} at token {t}")
            cl[t] = best
    # 5. psi and the order
    size = np.array([np.sum(cl == ci) for ci in range(P)])
    psi = np.array([qk[cl == ci].sum() for ci in range(P)])
    if c["psi"] == "mean":
        psi = np.where(size > 0, psi / np.maximum(size, 1), 0.0)
    scale = np.abs(qk).max() * max(1, size.max()) + 1e-30
    corder = sorted([ci for ci in range(P) if size[ci] > 0], key=lambda ci: (-psi[ci], ci))
    for x, y in zip(corder, corder[1:]):
        need(psi[x] - psi[y] > 1e-4 * scale / max(1, size.max()) or psi[x] == psi[y] == 0,
             f"psi gap {psi[x] - psi[y]}")
    rank = {ci: r for r, ci in enumerate(corder)}
    toks = [t for t in range(N) if cl[t] >= 0]
    toks.sort(key=lambda t: (rank[cl[t]], -qk[t], t))
    qscale = np.abs(qk).max() + 1e-30
    for x, y in zip(toks, toks[1:]):
        if cl[x] == cl[y]:
            need(qk[x] - qk[y] > 1e-4 * qscale, f"q.k gap {qk[x] - qk[y]} in cluster {cl[x]}")
    scores = np.full(N, -np.inf)
    M = len(toks)
    for o, t in enumerate(toks):
        scores[t] = float(M - o)
    return dict(scores=scores, S=S, cand=np.array(cand, dtype=np.int64), buckets=np.array(buckets, dtype=np.int64),
                cl=cl.astype(np.int64), psi=psi, sigma=sigma, P=P)


# ----------------------------------------------------------------- data

def make_case(rng, c):
    """Keys: contiguous topics (a direction per segment, neighbours alike), a sink at token 0,
    a compact group of anchors scattered over the positions (far from their neighbours), a
    few isolated outliers; queries lean towards the anchors."""
    H, G, N, d, w = c["kv_heads"], c["group"], c["tokens"], c["head_dim"], c["window"]
    keys = np.empty((H, N, d))
    queries = np.empty((H * G, w, d))
    for h in range(H):
        mu = rng.normal(size=d)
        mu *= 1.5 / np.linalg.norm(mu)
        ntop = max(3, N // 25)
        cuts = np.sort(rng.choice(np.arange(1, N), size=ntop - 1, replace=False))
        topic = np.searchsorted(cuts, np.arange(N), side="right")
        tdir = rng.normal(size=(ntop, d))
        tdir /= np.linalg.norm(tdir, axis=1, keepdims=True)
        k = mu + 2.0 * tdir[topic] + 0.35 * rng.normal(size=(N, d))
        anchor = rng.normal(size=d)
        anchor /= np.linalg.norm(anchor)
        na = max(4, c["sat_candidates"] // 2)
        apos = rng.choice(np.arange(2, N), size=na, replace=False)
        k[apos] = 4.0 * anchor + 0.25 * rng.normal(size=(na, d))
        k[0] = 6.0 * rng.normal(size=d) / np.sqrt(d)
        for hq in range(G):
            queries[h * G + hq] = 0.6 * anchor + 0.25 * mu / 1.5 + 0.5 * rng.normal(size=(w, d)) / np.sqrt(d)
        keys[h] = k
    for (h, t) in c["invalid"]:
        keys[h, t, d // 2] = np.nan
    for (h, t) in c["zero"]:
        keys[h, t] = 0.0
    return keys.astype(np.float32), queries.astype(np.float32)


def build() -> dict:
    files = {}

    def npy(rel, arr):
        files[rel] = fixtures.npy_bytes(arr)

    for c in CASES:
        # the first data seed (from data_seed on) whose every decision has a clear margin
        for attempt in range(200):
            rng = np.random.default_rng(c["data_seed"] + 1000 * attempt)
            keys, queries = make_case(rng, c)
            try:
                results = {}
                f16 = keys.astype("<f2")  # IEEE RNE, as kvscore::half
                for t, (stored, k64) in {"f32": (keys.astype("<f4"), keys.astype(np.float64)),
                                         "f16": (f16, f16.astype(np.float64))}.items():
                    H, G = c["kv_heads"], c["group"]
                    q64 = queries.astype(np.float64)
                    heads = []
                    for h in range(H):
                        qbar = q64[h * G:(h + 1) * G].sum(axis=(0, 1)).astype(np.float32).astype(np.float64)
                        heads.append(ref_head(k64[h], qbar, c, h))
                    results[t] = (stored, heads)
                break
            except Margin as e:
                last = str(e)
                continue
        else:
            raise SystemExit(f"{c['name']}: no data seed with clear margins ({last})")
        base = c["name"]
        params = {k: v for k, v in c.items() if k not in ("name", "invalid", "zero")}
        params["q_heads"] = c["kv_heads"] * c["group"]
        params["data_attempt"] = attempt
        shared = next((o["name"] for o in CASES if o is not c and o["data_seed"] == c["data_seed"]
                       and CASES.index(o) < CASES.index(c)), None)
        if shared is not None:  # the same data only if the same attempt was taken
            assert json.loads(files[f"{shared}/params.json"])["data_attempt"] == attempt, base
        params["keys_from"] = shared or base  # the mean case reads the keys of the sum case
        files[f"{base}/params.json"] = (json.dumps(params, indent=1, sort_keys=True) + "\n").encode()
        if shared is None:
            npy(f"{base}/queries.npy", queries)
        for t, (stored, heads) in results.items():
            if shared is None:
                npy(f"{base}/keys_{t}.npy", stored)
            npy(f"{base}/{t}_scores.npy", np.array([x["scores"] for x in heads]).astype("<f8"))
            npy(f"{base}/{t}_similarity.npy", np.array([x["S"] for x in heads]).astype("<f8"))
            npy(f"{base}/{t}_candidates.npy", np.array([x["cand"] for x in heads]).astype("<i8"))
            npy(f"{base}/{t}_buckets.npy", np.array([x["buckets"] for x in heads]).astype("<i8"))
            npy(f"{base}/{t}_cluster.npy", np.array([x["cl"] for x in heads]).astype("<i8"))
            Pmax = max(x["P"] for x in heads)
            psi = np.full((len(heads), Pmax), np.nan)
            for h, x in enumerate(heads):
                psi[h, :x["P"]] = x["psi"]
            npy(f"{base}/{t}_psi.npy", psi.astype("<f8"))
            npy(f"{base}/{t}_bandwidth.npy", np.array([x["sigma"] for x in heads]).astype("<f8"))
        Ws, bs = zip(*(rff_params(c["seed"], h, c["lsh_bits"], c["head_dim"]) for h in range(2)))
        npy(f"{base}/rff_W.npy", np.array(Ws).astype("<f8"))
        npy(f"{base}/rff_b.npy", np.array(bs).astype("<f8"))
    files["manifest.txt"] = ("\n".join(c["name"] for c in CASES) + "\n").encode()
    return files


def self_check():
    # splitmix64 reference values (seed 1234567, from the published C reference implementation)
    g = SplitMix64(1234567)
    assert [g.next() for _ in range(3)] == [6457827717110365317, 3203168211198807973, 9817491932198370423]
    W, _ = rff_params(0, 0, 64, 64)
    assert abs(W.mean()) < 0.05 and abs(W.std() - 1.0) < 0.05  # Box–Muller gives N(0, 1)


def main() -> int:
    return fixtures.main(__doc__.split("\n")[0], OUT_DIR, build, self_check=self_check, max_bytes=400 * 1024)

if __name__ == "__main__":
    sys.exit(main())
