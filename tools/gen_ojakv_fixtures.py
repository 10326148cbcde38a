#!/usr/bin/env python3
"""Generate the OjaKV golden fixtures read by tests/test_ojakv.cpp.

Usage (from the repository root; needs numpy only):

    python3 tools/gen_ojakv_fixtures.py            # writes tests/data/ojakv/
    python3 tools/gen_ojakv_fixtures.py --check    # regenerate in memory, compare with the files on disk

Deterministic (fixed seed). Files in tests/data/ojakv/:

    params.json        {"heads", "tokens", "head_dim", "rank", "pool", "eta", "q_heads", "window", "invalid"}
    keys.npy           '<f4' [heads, tokens, head_dim]; row `invalid` = [head, token] holds a NaN
    u0.npy             '<f8' [heads, head_dim, rank]   orthonormal start bases
    queries.npy        '<f4' [q_heads, window, head_dim]
    u1.npy             '<f8' [heads, head_dim, rank]   after ONE prefill step (docs/methods/ojakv.md):
                       pool windows of `pool` tokens (mean of the valid rows), C = Xp^T Xp / m,
                       U1 = orth(U0 + eta / lambda1(C) * (C U0 - U0 U0^T C U0)), orth = QR with diag(R) >= 0
    scores.npy         '<f8' [heads, tokens]  e_t = mean over the group's causal window queries of
                       |q . (k_t - U0 U0^T k_t)| / sqrt(d); -inf for the invalid row
    rer.npy            '<f8' [heads]  RER of each head's valid keys under U1
    so.npy             '<f8' [heads]  SO(U1, U0)

lambda1 comes from numpy.linalg.eigvalsh; the generator makes lambda2/lambda1 < 0.5 so that the
library's power-iteration estimate agrees to ~1e-15.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

import fixtures  # tools/fixtures.py: the shared write / --check command line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "tests", "data", "ojakv")
H, N, D, R, POOL, ETA, HQ, W = 2, 48, 16, 4, 2, 0.7, 4, 6
INVALID = (1, 5)


def orth(a: np.ndarray) -> np.ndarray:
    q, r = np.linalg.qr(a)
    s = np.sign(np.diag(r))
    s[s == 0] = 1
    return q * s


def build() -> dict[str, bytes]:
    rng = np.random.default_rng(5005)
    keys = np.empty((H, N, D), np.float32)
    u0 = np.empty((H, D, R))
    u1 = np.empty((H, D, R))
    scores = np.empty((H, N))
    rer = np.empty(H)
    so = np.empty(H)
    for h in range(H):
        scale = np.concatenate([[5.0], np.linspace(2.0, 0.5, D - 1)])  # one dominant direction
        basis = orth(rng.standard_normal((D, D)))
        keys[h] = ((rng.standard_normal((N, D)) * scale) @ basis.T).astype(np.float32)
        u0[h] = orth(rng.standard_normal((D, R)))
    keys[INVALID[0], INVALID[1], 3] = np.nan
    queries = rng.standard_normal((HQ, W, D)).astype(np.float32)

    G = HQ // H
    for h in range(H):
        x = keys[h].astype(np.float64)
        valid = np.isfinite((x * x).sum(1))
        pooled = []
        for w0 in range(0, N, POOL):
            rows = [x[t] for t in range(w0, min(N, w0 + POOL)) if valid[t]]
            if rows:
                pooled.append(np.mean(rows, axis=0))
        xp = np.array(pooled)
        c = xp.T @ xp / len(xp)
        ev = np.linalg.eigvalsh(c)
        assert ev[-2] / ev[-1] < 0.5, ev[-2:] / ev[-1]
        u = u0[h]
        u1[h] = orth(u + ETA / ev[-1] * (c @ u - u @ (u.T @ c @ u)))
        xv = x[valid]
        rer[h] = ((xv - xv @ u1[h] @ u1[h].T) ** 2).sum() / (xv ** 2).sum()
        so[h] = np.trace(u1[h].T @ u0[h] @ u0[h].T @ u1[h]) / R
        q = queries[h * G:(h + 1) * G].astype(np.float64)  # [G, W, D]
        for t in range(N):
            if not valid[t]:
                scores[h, t] = -np.inf
                continue
            res = x[t] - u @ (u.T @ x[t])
            sees = [i for i in range(W) if N - W + i >= t]
            vals = np.abs(q[:, sees, :] @ res) / np.sqrt(D)
            scores[h, t] = vals.mean()
        # The step is not a no-op and the score is not the plain residual norm.
        assert np.abs(u1[h] - u0[h]).max() > 0.05

    files = {}

    def put(name, arr):
        files[name] = fixtures.npy_bytes(arr)

    put("keys.npy", keys)
    put("u0.npy", u0)
    put("queries.npy", queries)
    put("u1.npy", u1)
    put("scores.npy", scores)
    put("rer.npy", rer)
    put("so.npy", so)
    files["params.json"] = (json.dumps(dict(heads=H, tokens=N, head_dim=D, rank=R, pool=POOL, eta=ETA, q_heads=HQ,
                                            window=W, invalid=list(INVALID)), sort_keys=True) + "\n").encode()
    return files


def main() -> int:
    return fixtures.main(__doc__.splitlines()[0], OUT_DIR, build)

if __name__ == "__main__":
    sys.exit(main())
