#!/usr/bin/env python3
"""Generate the selector fixtures read by tests/test_select.cpp.

Usage (from the repository root; needs numpy, nothing else):

    python3 tools/gen_select_fixtures.py            # writes tests/data/select/
    python3 tools/gen_select_fixtures.py --check    # regenerate in memory, compare with what is on disk

Deterministic (numpy.random.default_rng with fixed seeds); the fixtures are committed and
CI never runs this script.

Layout of tests/data/select/:

    manifest.txt                      one configuration per line (see CONFIG_FIELDS)
    <case>/scores.npy                 '<f4' [H, N]
    <case>/<config>.positions.npy     '<i8' [total]   kept positions, CSR, ascending per head
    <case>/<config>.offsets.npy       '<i8' [H + 1]

The reference below is written from the rules in docs/reference/select.md with numpy sorts
(np.lexsort), independently of the C++ radix select:

  order      higher score first; equal scores -> lower position first; NaN below every
             number (-inf included); -0.0 == +0.0. AdaKV global step: equal (normalised)
             scores -> lower position, then lower head.
  protect    P = [0, min(sinks, N)) U [max(that, N - min(recent, N)), N); p = |P|.
  per-head   each head keeps P + its top (n - p) positions outside P.
  adakv      B = n * H (budget "head") or the given total (budget "layer");
             s = floor(alpha * B / H) in double arithmetic; g = max(min(s, N), p);
             each head keeps P + its top (g - p) outside P by raw score; the remaining
             B - H*g tokens are one global top-k over every head's other tokens, ranked by
             the raw score, or with normalize by z = f32((f64(x) - mean) * (1 / std)), mean
             and population std over the head's finite scores from double sums in 8 lanes
             (lane = position % 8, combined ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)));
             std 0 -> 1/std taken as 0; +-inf and NaN pass through unchanged.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np

import fixtures  # tools/fixtures.py: the shared write / --check command line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "tests", "data", "select")
CONFIG_FIELDS = "case config alloc budget_kind budget sinks recent alpha normalize"
SIZE_LIMIT = 500_000  # bytes, all fixtures together


# ----------------------------------------------------------------------------- reference

def order(values: np.ndarray, pos: np.ndarray, head: np.ndarray | None = None) -> np.ndarray:
    """Indices of `values` from best to worst under the selector's total order."""
    v = values.astype(np.float64)
    nan = np.isnan(v)
    neg = np.where(nan, 0.0, -v)
    # lexsort: last key is primary. Primary: NaN last; then -value; then pos; then head.
    if head is None:
        return np.lexsort((pos, neg, nan))
    return np.lexsort((head, pos, neg, nan))


def protected_range(n_tokens: int, sinks: int, recent: int) -> tuple[int, int]:
    s0 = min(sinks, n_tokens)
    e0 = max(s0, n_tokens - min(recent, n_tokens))
    return s0, e0


def top_positions(x: np.ndarray, s0: int, e0: int, m: int) -> np.ndarray:
    """Positions (absolute) of the m best scores of x[s0:e0]."""
    if m <= 0:
        return np.zeros(0, dtype=np.int64)
    pos = np.arange(s0, e0, dtype=np.int64)
    idx = order(x[s0:e0], pos)[:m]
    return pos[idx]


def lane_sum(lanes: list[float]) -> float:
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))


def znorm(x: np.ndarray) -> np.ndarray:
    """z-scores as the C++ defines them: double sums in 8 lanes (lane = position % 8)."""
    vals = x.tolist()
    lanes = [0.0] * 8
    c = 0
    for i, v in enumerate(vals):
        if math.isfinite(v):
            lanes[i % 8] += v
            c += 1
    mu = lane_sum(lanes) / c if c > 0 else 0.0
    sq = [0.0] * 8
    for i, v in enumerate(vals):
        if math.isfinite(v):
            d = v - mu
            sq[i % 8] += d * d
    sd = math.sqrt(lane_sum(sq) / c) if c > 0 else 0.0
    inv = 1.0 / sd if sd > 0 else 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        z = ((x.astype(np.float64) - mu) * inv).astype(np.float32)
    return np.where(np.isfinite(x), z, x)


def select_ref(scores: np.ndarray, alloc: str, budget_kind: str, budget: int, sinks: int, recent: int,
               alpha: float, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    H, N = scores.shape
    s0, e0 = protected_range(N, sinks, recent)
    p = s0 + (N - e0)
    prot = np.concatenate([np.arange(0, s0), np.arange(e0, N)]).astype(np.int64)
    kept = []
    if alloc == "per-head":
        n = budget if budget_kind == "head" else budget // H
        assert budget_kind == "head" or budget % H == 0
        assert p <= n <= N
        for h in range(H):
            kept.append(np.sort(np.concatenate([prot, top_positions(scores[h], s0, e0, n - p)])))
    else:
        B = budget * H if budget_kind == "head" else budget
        assert p * H <= B <= H * N
        s = math.floor(alpha * B / H)
        g = max(min(s, N), p)
        base = []
        for h in range(H):
            base.append(np.concatenate([prot, top_positions(scores[h], s0, e0, g - p)]))
        cv, cp, ch = [], [], []
        for h in range(H):
            mask = np.ones(N, dtype=bool)
            mask[base[h]] = False
            vals = znorm(scores[h]) if normalize else scores[h]
            cv.append(vals[mask])
            cp.append(np.arange(N, dtype=np.int64)[mask])
            ch.append(np.full(int(mask.sum()), h, dtype=np.int64))
        cv, cp, ch = np.concatenate(cv), np.concatenate(cp), np.concatenate(ch)
        R = B - H * g
        take = order(cv, cp, ch)[:R]
        for h in range(H):
            extra = cp[take][ch[take] == h]
            kept.append(np.sort(np.concatenate([base[h], extra])))
    offsets = np.zeros(H + 1, dtype=np.int64)
    for h in range(H):
        offsets[h + 1] = offsets[h] + len(kept[h])
    positions = np.concatenate(kept).astype(np.int64) if kept else np.zeros(0, dtype=np.int64)
    return positions, offsets


# ----------------------------------------------------------------------------- cases

def scores_basic(rng) -> np.ndarray:
    H, N = 3, 40
    x = rng.normal(size=(H, N)).astype(np.float32)
    x[0, 5] = x[0, 17] = x[0, 30] = x[0, 2]          # ties inside a head
    x[1, 7] = x[0, 7]                                 # tie across heads, same position
    x[2, 3] = x[1, 9]                                 # tie across heads, other positions
    x[0, 11] = np.nan
    x[1, 0] = np.nan
    x[1, 20] = -np.inf
    x[2, 25] = np.inf
    x[2, 26] = -0.0
    x[2, 27] = 0.0
    x[0, 39] = np.float32(-np.nan)                    # a negative NaN ranks like every NaN
    return x


def scores_ties(rng) -> np.ndarray:
    H, N = 4, 33
    x = rng.integers(0, 4, size=(H, N)).astype(np.float32)  # 4 distinct values: ties everywhere
    x[3, 10:14] = np.nan
    x[2, :] = 2.0                                             # a constant head
    return x


def scores_special(rng) -> np.ndarray:
    H, N = 2, 12
    x = np.array([[np.nan, -np.inf, np.inf, 0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, np.nan, 1.0, 1.0],
                  [np.nan] * 12], dtype=np.float32)
    return x


def scores_long(rng) -> np.ndarray:
    # Long enough for the sampled-window path of the C++ selector (>= 16384 tokens per range).
    H, N = 2, 16500
    x = np.empty((H, N), dtype=np.float32)
    x[0] = rng.normal(size=N).astype(np.float32)
    x[1] = rng.integers(0, 16, size=N).astype(np.float32) * np.float32(0.5)  # 16 values
    x[0, ::997] = np.nan
    return x


# (case, config, alloc, budget_kind, budget, sinks, recent, alpha, normalize)
CONFIGS = [
    ("basic", "k0", "per-head", "head", 0, 0, 0, 0.2, False),
    ("basic", "k1", "per-head", "head", 1, 0, 0, 0.2, False),
    ("basic", "k7", "per-head", "head", 7, 0, 0, 0.2, False),
    ("basic", "kN", "per-head", "head", 40, 0, 0, 0.2, False),
    ("basic", "kN_protected", "per-head", "head", 40, 3, 5, 0.2, False),
    ("basic", "k12_s2_r4", "per-head", "head", 12, 2, 4, 0.2, False),
    ("basic", "k6_s2_r4_full", "per-head", "head", 6, 2, 4, 0.2, False),
    ("basic", "layer21", "per-head", "layer", 21, 1, 1, 0.2, False),
    ("basic", "ada_k8", "adakv", "head", 8, 0, 0, 0.2, False),
    ("basic", "ada_k8_norm", "adakv", "head", 8, 0, 0, 0.2, True),
    ("basic", "ada_k8_s1_r2", "adakv", "head", 8, 1, 2, 0.2, False),
    ("basic", "ada_k10_s2_r2_a05_norm", "adakv", "head", 10, 2, 2, 0.5, True),
    ("basic", "ada_alpha0", "adakv", "head", 5, 0, 0, 0.0, False),
    ("basic", "ada_alpha1", "adakv", "head", 5, 0, 0, 1.0, False),
    ("basic", "ada_layer50", "adakv", "layer", 50, 0, 3, 0.3, True),
    ("basic", "ada_layer0", "adakv", "layer", 0, 0, 0, 0.2, False),
    ("basic", "ada_all", "adakv", "head", 40, 0, 0, 0.2, True),
    ("ties", "k0", "per-head", "head", 0, 0, 0, 0.2, False),
    ("ties", "k5", "per-head", "head", 5, 0, 0, 0.2, False),
    ("ties", "k16_s3", "per-head", "head", 16, 3, 0, 0.2, False),
    ("ties", "k33", "per-head", "head", 33, 0, 0, 0.2, False),
    ("ties", "k30_r29", "per-head", "head", 30, 0, 29, 0.2, False),
    ("ties", "ada_k6", "adakv", "head", 6, 0, 0, 0.2, False),
    ("ties", "ada_k6_norm", "adakv", "head", 6, 0, 0, 0.2, True),
    ("ties", "ada_k9_s1_r1", "adakv", "head", 9, 1, 1, 0.25, False),
    ("ties", "ada_layer37_norm", "adakv", "layer", 37, 0, 0, 0.1, True),
    ("special", "k3", "per-head", "head", 3, 0, 0, 0.2, False),
    ("special", "k9", "per-head", "head", 9, 0, 0, 0.2, False),
    ("special", "k11_s1", "per-head", "head", 11, 1, 0, 0.2, False),
    ("special", "ada_k6", "adakv", "head", 6, 0, 0, 0.2, False),
    ("special", "ada_k6_norm", "adakv", "head", 6, 0, 0, 0.5, True),
    ("long", "k1650", "per-head", "head", 1650, 0, 0, 0.2, False),
    ("long", "k6000_s4_r64", "per-head", "head", 6000, 4, 64, 0.2, False),
    ("long", "ada_k1650_norm", "adakv", "head", 1650, 4, 16, 0.2, True),
]

CASES = {
    "basic": (scores_basic, 2001),
    "ties": (scores_ties, 2002),
    "special": (scores_special, 2003),
    "long": (scores_long, 2004),
}


def npy_bytes(a: np.ndarray) -> bytes:
    return fixtures.npy_bytes(a)


def build() -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    scores = {}
    for name, (fn, seed) in CASES.items():
        s = fn(np.random.default_rng(seed))
        assert s.dtype == np.float32
        scores[name] = s
        files[f"{name}/scores.npy"] = npy_bytes(np.ascontiguousarray(s))
    lines = ["# " + CONFIG_FIELDS]
    for (case, config, alloc, kind, budget, sinks, recent, alpha, normalize) in CONFIGS:
        pos, off = select_ref(scores[case], alloc, kind, budget, sinks, recent, alpha, normalize)
        H, N = scores[case].shape
        B = budget * H if kind == "head" else budget
        assert off[-1] == B, (case, config)
        files[f"{case}/{config}.positions.npy"] = npy_bytes(pos)
        files[f"{case}/{config}.offsets.npy"] = npy_bytes(off)
        lines.append(f"{case} {config} {alloc} {kind} {budget} {sinks} {recent} {alpha!r} {int(normalize)}")
    files["manifest.txt"] = ("\n".join(lines) + "\n").encode()
    total = sum(len(v) for v in files.values())
    assert total <= SIZE_LIMIT, f"fixtures are {total} bytes, limit {SIZE_LIMIT}"
    return files


def self_test() -> None:
    # The NaN / tie / protection rules on a hand-checked example.
    x = np.array([[1.0, np.nan, 3.0, 3.0, -np.inf, 2.0]], dtype=np.float32)
    pos, off = select_ref(x, "per-head", "head", 3, 0, 0, 0.2, False)
    assert pos.tolist() == [2, 3, 5], pos
    pos, off = select_ref(x, "per-head", "head", 5, 0, 0, 0.2, False)
    assert pos.tolist() == [0, 2, 3, 4, 5], pos          # -inf before NaN
    pos, off = select_ref(x, "per-head", "head", 3, 1, 1, 0.2, False)
    assert pos.tolist() == [0, 2, 5], pos                 # sink 0, recent 5, then best of 1..4 = 2
    y = np.array([[1.0, 1.0], [1.0, 1.0]], dtype=np.float32)
    pos, off = select_ref(y, "adakv", "layer", 3, 0, 0, 0.0, False)
    assert pos.tolist() == [0, 1, 0] and off.tolist() == [0, 2, 3], (pos, off)  # position, then head


def main() -> int:
    return fixtures.main(__doc__, OUT_DIR, build, self_check=self_test)

if __name__ == "__main__":
    sys.exit(main())
