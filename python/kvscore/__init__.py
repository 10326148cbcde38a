"""kvscore: KV-cache token scorers and selectors for numpy and PyTorch (docs/python.md).

    import kvscore
    scores = kvscore.ManifoldL2().score(keys)          # keys [kv_heads, tokens, head_dim] or [1, ...]
    keep = kvscore.select(scores, 512, sinks=4, recent=64)   # int64 [kv_heads, 512], rows ascending
    n = kvscore.compact(keys, values, keep)            # in place; then keys[..., :n, :]

Arrays are read in place (numpy through the buffer protocol, torch CPU tensors through DLPack):
fp32, fp16 and bf16 keys in any layout a strided view can express. A layout it cannot express
(the head_dim stride is not 1, negative strides) is a ValueError naming the stride, never a
silent copy. Results come back as the kind of array that went in (numpy in, numpy out; torch
in, torch out), scores always float32. Bad input raises ValueError carrying the C++ message.
Heavy calls release the GIL.
"""

from __future__ import annotations

import json as _json

import numpy as _np

from . import _kvscore as _k

__version__ = _k.__version__

__all__ = [
    "KNorm", "KeyDiff", "ManifoldL2", "WindowedManifoldL2", "QFilter", "SnapKV", "ProtoKV",
    "calibrate_qfilters", "select", "compact", "budget_from_ratio", "evaluate", "synth", "ParisKV",
    "ParisKVCache", "OjaProjector", "METHODS", "ALIASES", "REGISTRY", "make_scorer", "method_name", "isa", "isas", "set_isa",
]

isa = _k.isa
isas = _k.isas
set_isa = _k.set_isa
budget_from_ratio = _k.budget_from_ratio


# ------------------------------------------------------------------ arrays in and out

def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _identity(x):
    return x


def _to_torch(x):
    import torch

    if isinstance(x, list):
        return [torch.from_numpy(a) for a in x]
    return torch.from_numpy(x)


def _arg(x, name: str, writable: bool = False):
    """(array for the C++ core, converter of results back to the caller's kind)."""
    if _is_torch(x):
        if x.device.type != "cpu":
            raise ValueError(
                f"{name}: tensor on device '{x.device}': this kvscore module was built without the CUDA "
                "path (docs/cuda.md); move it with .cpu()")
        return x.detach(), _to_torch
    if isinstance(x, _np.ndarray):
        if writable and not x.flags.writeable:
            raise ValueError(f"{name}: the numpy array is read-only; compaction writes in place")
        return x, _identity
    raise ValueError(f"{name}: expected a numpy array or a torch tensor (got {type(x).__name__})")


# ------------------------------------------------------------------ scorers

class _Scorer:
    """Common shell: `score(keys) -> float32 [kv_heads, tokens]`, higher = keep."""

    name = ""
    protected_recent = 0  # tokens at the end of the cache the selector must keep (SnapKV, ProtoKV)

    def __init__(self, impl, threads: int = 0):
        self._impl = impl
        self.num_threads = threads

    @property
    def num_threads(self) -> int:
        return self._impl.num_threads

    @num_threads.setter
    def num_threads(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"threads {n} must be >= 0 (0 = OpenMP default)")
        self._impl.num_threads = n

    def score(self, keys, queries=None):
        if queries is not None:
            raise ValueError(f"{type(self).__name__}.score: this scorer takes no queries")
        a, back = _arg(keys, "keys")
        return back(self._impl.score(a))

    def __repr__(self) -> str:
        return f"kvscore.{type(self).__name__}()"


class KNorm(_Scorer):
    """K-norm (Devoto et al.): score = -||k||, keeps low-norm keys."""

    name = "knorm"

    def __init__(self, *, threads: int = 0):
        super().__init__(_k.KNorm(), threads)


class KeyDiff(_Scorer):
    """KeyDiff: score = -cos(k, mean key direction)."""

    name = "keydiff"

    def __init__(self, *, threads: int = 0):
        super().__init__(_k.KeyDiff(), threads)


class ManifoldL2(_Scorer):
    """ManifoldKV: score = ||k - centroid||_2 over the head's keys."""

    name = "manifold_l2"

    def __init__(self, *, threads: int = 0):
        super().__init__(_k.ManifoldL2(), threads)


class WindowedManifoldL2(_Scorer):
    """Windowed ManifoldKV: L2 distance to the centroid of the key's window of `window` tokens.
    tail='merge' (default): a final partial window shorter than window/2 joins the window before
    it; 'own' (the paper's Alg. 2): it is its own window (docs/windowed-manifoldkv.md)."""

    name = "windowed_manifold_l2"

    def __init__(self, window: int = 4096, tail: str = "merge", *, threads: int = 0):
        super().__init__(_k.WindowedManifoldL2(window, tail), threads)
        self.window = window
        self.tail = tail


class QFilter(_Scorer):
    """Q-Filters: score = <k, f_h> with filters [kv_heads, head_dim] (kvscore convention, as
    calibrate_qfilters returns them); QFilter.from_published(path, layer) reads the authors'
    safetensors files, whose sign is the opposite (score = -<f, k>, the same ranking)."""

    name = "qfilter"

    def __init__(self, filters, *, threads: int = 0):
        if isinstance(filters, _k.QFilter):
            impl = filters
        else:
            a, _ = _arg(filters, "filters")
            impl = _k.QFilter(a)
        super().__init__(impl, threads)

    @classmethod
    def from_published(cls, path: str, layer: int, *, threads: int = 0) -> "QFilter":
        return cls(_k.QFilter.from_published(str(path), layer), threads=threads)

    @classmethod
    def load(cls, path: str, layer: int, convention: str = "", *, threads: int = 0) -> "QFilter":
        """.npy (kvscore convention) or .safetensors (published convention) unless `convention`."""
        return cls(_k.QFilter.load(str(path), layer, convention), threads=threads)

    @property
    def filters(self):
        return self._impl.filters


def calibrate_qfilters(queries, kv_heads: int):
    """Q-Filter calibration from query samples [q_heads, n, head_dim] -> float32 [kv_heads, head_dim]."""
    a, back = _arg(queries, "queries")
    return back(_k.calibrate_qfilters(a, kv_heads))


class _QueryScorer(_Scorer):
    """Scorers built from the post-RoPE queries of an observation window [q_heads, n, head_dim]
    (or [1, q_heads, n, head_dim]); score(keys, queries) rebuilds it with new queries."""

    def score(self, keys, queries=None):
        if queries is not None:
            return type(self)(queries, **self._options).score(keys)
        a, back = _arg(keys, "keys")
        return back(self._impl.score(a))

    @property
    def protected_recent(self) -> int:
        return self._impl.protected_recent


class SnapKV(_QueryScorer):
    """SnapKV (Li et al.): attention of the last `window` queries (the observation window, the
    last tokens of the cache), average-pooled with `kernel`; keep `protected_recent` recent tokens
    in select(). At most the last `window` of the given queries are used.
    placement='after_cache': the queries follow the cache (a decode step, held-out queries): no
    causal mask, the whole cache pooled, protected_recent = 0."""

    name = "snapkv"

    def __init__(self, queries, window: int = 64, kernel: int = 5, *, placement: str = "in_cache",
                 threads: int = 0):
        a, _ = _arg(queries, "queries")
        super().__init__(_k.SnapKV(a, window, kernel, placement=placement), threads)
        self._options = {"window": window, "kernel": kernel, "placement": placement, "threads": threads}


class ProtoKV(_QueryScorer):
    """ProtoKV: prototype clusters (SAT + PDT) scored by the window queries (docs/protokv.md).
    `window` = 0 uses every given query. placement='after_cache': the queries follow the cache
    (nothing protected, the window may exceed the cache); 'in_cache' (default) protects it."""

    name = "protokv"

    def __init__(self, queries, window: int = 0, *, kappa: int = 5, sat_candidates: int = 32, lsh_bits: int = 2,
                 chunks: int = 496, bandwidth: float = 0.0, seed: int = 0, psi: str = "attention",
                 placement: str = "in_cache", threads: int = 0):
        a, _ = _arg(queries, "queries")
        super().__init__(_k.ProtoKV(a, window, kappa, sat_candidates, lsh_bits, chunks, bandwidth, seed, psi,
                                    placement=placement), threads)
        self._options = {"window": window, "kappa": kappa, "sat_candidates": sat_candidates, "lsh_bits": lsh_bits,
                         "chunks": chunks, "bandwidth": bandwidth, "seed": seed, "psi": psi, "placement": placement,
                         "threads": threads}


# ------------------------------------------------------------------ the method registry

#: kvscore/methods.hpp, the one list of methods (dicts: name, cli, aliases, kind, cls, header, doc, summary).
REGISTRY = _k.methods()

#: Canonical method names -> scorer class (query-agnostic ones take no arguments): the scorers of REGISTRY.
METHODS = {
    "knorm": KNorm,
    "keydiff": KeyDiff,
    "manifold_l2": ManifoldL2,
    "windowed_manifold_l2": WindowedManifoldL2,
    "qfilter": QFilter,
    "snapkv": SnapKV,
    "protokv": ProtoKV,
}
#: Other spellings (the CLI's and evaluator's, and the registry's aliases) -> canonical name,
#: for the scorers and streaming_llm.
ALIASES = {s: m["name"] for m in REGISTRY if m["kind"] in ("scorer", "query_scorer", "selection_rule")
           for s in [m["cli"], *m["aliases"]] if s != m["name"]}


def method_name(name: str) -> str:
    """The canonical name of a method or alias; ValueError naming the known ones otherwise."""
    n = ALIASES.get(name, name)
    if n not in METHODS and n != "streaming_llm":
        known = ", ".join(sorted(set(METHODS) | set(ALIASES) | {"streaming_llm"}))
        raise ValueError(f"unknown method '{name}' (expected one of: {known})")
    return n


def make_scorer(method: str, *args, **options) -> _Scorer:
    """A scorer by registry name, e.g. make_scorer('windowed_manifold_l2', window=2048)."""
    n = method_name(method)
    if n == "streaming_llm":
        raise ValueError("streaming_llm is a selection rule (select(zeros, n, sinks=S, recent=n-S)), not a scorer")
    return METHODS[n](*args, **options)


# ------------------------------------------------------------------ selection, compaction

def select(scores, budget: int, *, sinks: int = 0, recent: int = 0, alloc: str = "per_head", alpha: float = 0.2,
           normalize: bool = False, threads: int = 0):
    """Tokens to keep from float32 scores [kv_heads, tokens]: int64 [kv_heads, budget] with each row
    ascending (alloc='per_head'), or for alloc='adakv' (per-layer budget budget*kv_heads spread
    over heads, AdaKV) a list of kv_heads int64 arrays. Ties keep the lower position."""
    a, back = _arg(scores, "scores")
    return back(_k.select(a, int(budget), sinks=sinks, recent=recent, alloc=alloc, alpha=alpha, normalize=normalize,
                          threads=threads))


def compact(keys, values, selection, *, tail: str = "keep", require_equal_lengths: bool = True) -> int:
    """Moves the kept rows of keys and values [kv_heads, tokens, d] (or [1, ...], HF layout) to the
    front of each head, in place; returns the kept length n (slice [..., :n, :] afterwards).
    `selection` is select()'s result (array or list of arrays, numpy or torch)."""
    k, _ = _arg(keys, "keys", writable=True)
    v, _ = _arg(values, "values", writable=True)
    if isinstance(selection, (list, tuple)):
        sel = [_arg(s, "selection")[0] for s in selection]
    else:
        sel = _arg(selection, "selection")[0]
    lengths = _k.compact(k, v, sel, tail=tail, require_equal_lengths=require_equal_lengths)
    return int(lengths[0]) if require_equal_lengths and lengths else lengths


# ------------------------------------------------------------------ evaluator, synthetic data

def _f32_4d(x, name):
    if _is_torch(x):
        x = x.detach().cpu().float().numpy()
    x = _np.ascontiguousarray(_np.asarray(x, dtype=_np.float32))
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4:
        raise ValueError(f"{name}: expected [kv_heads, tokens, d] or [layers, kv_heads, tokens, d] (got {x.ndim} dims)")
    return x


def evaluate(K, V, Q, *, methods="all", keep=(0.1, 0.25, 0.5), sinks: int = 0, recent: int = 0,
             alloc: str = "per_head", alpha: float = 0.2, window: int = 4096, window_tail: str = "merge",
             budget_rounding: str = "nearest", query_placement: str = "after_cache", threads: int = 1,
             window_queries=None, calib_queries=None, protocol: str | None = None, mix_metric: str = "recall") -> dict:
    """`kvscore eval` as a function: the same report (attention-mass recall, output error, top-k
    overlap, time per method and keep fraction, per_layer_best), as a dict. K, V [layers, kv_heads,
    tokens, d], Q [layers, q_heads, n_q, d] (3-D: one layer); converted to fp32 (the evaluator's
    precision). budget_rounding='floor' gives the papers' n = floor(keep * N) instead of the nearest
    integer. query_placement (shared protocol): Q follows the cache ('after_cache', default: snapkv,
    protokv and ojakv see every key, nothing protected beyond `recent`) or is the cache's last n_q
    positions ('in_cache').

    The leak-free protocol (docs/evaluate.md; the default when window_queries is given):
    window_queries [layers, q_heads, n_w, d] are the queries of the cache's own last n_w tokens
    (what snapkv, protokv and ojakv see, in the cache, the window protected), calib_queries
    [layers, q_heads, n_c, d] other text's (Q-Filters' calibration; qfilter is skipped without
    them), and Q only measures. protocol: 'leak_free' or 'shared' (every method sees Q).
    mix_metric: 'recall', 'error' or 'overlap', what per_layer_best optimises."""
    if not isinstance(methods, str):
        methods = ",".join(methods)
    if protocol is None:
        protocol = "leak_free" if window_queries is not None else "shared"
    protocol = protocol.replace("-", "_")
    if protocol not in ("leak_free", "shared"):
        raise ValueError(f"protocol '{protocol}' must be 'leak_free' or 'shared'")
    if protocol == "leak_free" and window_queries is None:
        raise ValueError("protocol 'leak_free' needs window_queries (the queries of the cache's last tokens)")
    Kf, Vf, Qf = _f32_4d(K, "K"), _f32_4d(V, "V"), _f32_4d(Q, "Q")
    Wf = _f32_4d(window_queries, "window_queries") if protocol == "leak_free" else None
    Cf = _f32_4d(calib_queries, "calib_queries") if protocol == "leak_free" and calib_queries is not None else None
    return _json.loads(_k.evaluate_json(Kf, Vf, Qf, methods, [float(f) for f in keep], sinks, recent, alloc, alpha,
                                        window, window_tail, budget_rounding, query_placement, threads,
                                        window_queries=Wf, calib_queries=Cf, protocol=protocol,
                                        mix_metric=mix_metric))


def synth(kind: str = "mixed", *, layers: int = 1, kv_heads: int = 4, group: int = 2, tokens: int = 2048,
          head_dim: int = 64, queries: int = 16, segment: int = 256, seed: int = 0) -> dict:
    """`kvscore synth` as a function: {'K', 'V', 'Q' (float32 numpy), 'planted': {name: [per
    (layer, head) int64 positions]}} (docs/synth.md)."""
    return _k.synth(kind, layers, kv_heads, group, tokens, head_dim, queries, segment, seed)


# ------------------------------------------------------------------ ParisKV, OjaKV

class ParisKV:
    """ParisKV retrieval index of one KV head: append(keys [n, head_dim]) streams keys in,
    search(queries [n_q, head_dim], k) -> (positions int64 [n_q, k] ascending, RSQ-IP scores)."""

    def __init__(self, head_dim: int, *, m: int = 8, seed: int | None = None, center: bool = True):
        self._impl = _k.ParisKV(head_dim, m, center=center) if seed is None else _k.ParisKV(head_dim, m, seed, center)

    @property
    def size(self) -> int:
        return self._impl.size

    @property
    def memory_bytes(self) -> int:
        return self._impl.memory_bytes

    def append(self, keys) -> None:
        a, _ = _arg(keys, "keys")
        self._impl.append(a)

    def search(self, queries, k: int = 100, *, beta: float = 0.0, rho: float = 0.0):
        a, back = _arg(queries, "queries")
        one = a.ndim == 1
        if one:
            a = a[None]
        pos, sc = self._impl.search(a, k, beta, rho)
        if one:
            pos, sc = pos[0], sc[0]
        return back(pos), back(sc)


class ParisKVCache:
    """ParisKV's decode-time cache of one KV head (docs/pariskv.md "Decode-time cache"): the first
    `sinks` tokens, a ParisKV index over the middle and the last `local` tokens. append(keys,
    values) takes [n, head_dim] rows of the cache's dtype (row-contiguous, read in place);
    select(query) -> int64 positions (sinks, the top-k of the index, the local window; ascending);
    attend(query) -> (float32 [head_dim] output, positions). Dense attention below
    max(dense_min, sinks + local + 2k) tokens."""

    _impls = {"float32": "ParisKVCacheF32", "float16": "ParisKVCacheF16", "bfloat16": "ParisKVCacheBF16"}

    def __init__(self, head_dim: int, *, dtype: str = "float16", sinks: int = 4, local: int = 256,
                 update_interval: int = 128, dense_min: int = 2000, k: int = 100, rerank_exact: int = 0):
        if dtype not in self._impls:
            raise ValueError(f"ParisKVCache: dtype '{dtype}' must be float32, float16 or bfloat16")
        self.dtype = dtype
        self._impl = getattr(_k, self._impls[dtype])(head_dim, sinks, local, update_interval, dense_min, k,
                                                     rerank_exact)

    size = property(lambda self: self._impl.size)
    indexed = property(lambda self: self._impl.indexed)
    retrieval_begin = property(lambda self: self._impl.retrieval_begin)
    local_begin = property(lambda self: self._impl.local_begin)
    memory_bytes = property(lambda self: self._impl.memory_bytes)

    def append(self, keys, values) -> None:
        k, _ = _arg(keys, "keys")
        v, _ = _arg(values, "values")
        self._impl.append(k, v)

    def select(self, query):
        q, back = _arg(query, "query")
        return back(self._impl.select(q))

    def attend(self, query):
        q, back = _arg(query, "query")
        out, pos = self._impl.attend(q)
        return back(out), back(pos)


class OjaProjector:
    """OjaKV's low-rank key/value bases of one head: OjaProjector.random(d, rk, rv, seed), then
    prefill(keys, values) ([tokens, d] or [1, tokens, d]); key_basis / value_basis [d, r]."""

    def __init__(self, impl):
        self._impl = impl

    @classmethod
    def random(cls, head_dim: int, key_rank: int, value_rank: int, seed: int = 0) -> "OjaProjector":
        return cls(_k.OjaProjector.random(head_dim, key_rank, value_rank, seed))

    def prefill(self, keys, values) -> None:
        k, _ = _arg(keys, "keys")
        v, _ = _arg(values, "values")
        if k.ndim == 2:
            k = k[None]
        if v.ndim == 2:
            v = v[None]
        self._impl.prefill(k, v)

    @property
    def key_basis(self):
        return self._impl.key_basis

    @property
    def value_basis(self):
        return self._impl.value_basis
