"""kvscore: KV-cache token scorers and selectors for numpy and PyTorch (docs/reference/python.md).

    import kvscore
    scores = kvscore.ManifoldL2().score(keys)          # keys [kv_heads, tokens, head_dim] or [1, ...]
    keep = kvscore.select(scores, 512, sinks=4, recent=64)   # int64 [kv_heads, 512], rows ascending
    n = kvscore.compact(keys, values, keep)            # in place; then keys[..., :n, :]

Arrays are read in place (numpy through the buffer protocol, torch tensors through DLPack):
fp32, fp16 and bf16 keys in any layout a strided view can express. A layout it cannot express
(the head_dim stride is not 1, negative strides) is a ValueError naming the stride, never a
silent copy. Results come back as the kind of array that went in (numpy in, numpy out; torch
in, torch out; a CUDA tensor in, a tensor on its device out), scores always float32. Bad values
raise ValueError carrying the C++ message, wrong kinds of argument TypeError. Heavy calls
release the GIL. CUDA tensors run on kvscore::cuda when the package was built with it
(KVSCORE_CUDA=1 pip install .; cuda_available(), cuda_status(); docs/reference/python.md "CUDA tensors").

Every method name and every default comes from the C++ registry (include/kvscore/methods.hpp,
make_scorer.hpp, make_method.hpp) through the module kvscore._kvscore: REGISTRY is its list,
METHODS its scorers, and each signature's defaults are its constants and option structs.
"""

from __future__ import annotations

import json as _json
import operator as _operator
from typing import Literal

import numpy as _np

from . import _cuda
from . import _kvscore as _k

__version__ = _k.__version__

__all__ = [
    "KNorm", "KeyDiff", "ManifoldL2", "WindowedManifoldL2", "QFilter", "SnapKV", "ProtoKV", "KVzip",
    "calibrate_qfilters", "select", "select_joint", "select_joint_blocks", "compact", "budget_from_ratio", "evaluate", "synth", "ParisKV",
    "ParisKVCache", "OjaProjector", "METHODS", "ALIASES", "REGISTRY", "make_scorer", "method_name", "isa", "isas", "set_isa",
    "StreamingLLM", "make_selection_rule", "cuda_available", "cuda_status",
]

# The values of the string options, for type checkers (docs/reference/api.md#python). Each is the
# C++ option enum's spelling (kvscore/core/names.hpp: to_string); python/tests/test_tree.py holds
# every list equal to the one the C++ parser accepts. The CLI's spellings ("per-head") are accepted too.
Alloc = Literal["per_head", "adakv"]
"""`select(alloc=)`, the presses' `alloc=`, `evaluate(alloc=)`: per-head budgets or AdaKV's."""
Tail = Literal["keep", "zero"]
"""`compact(tail=)`: the rows past each head's kept count are kept as they were or zero-filled."""
Rounding = Literal["nearest", "floor"]
"""`budget_from_ratio(rounding=)`, `evaluate(budget_rounding=)`."""
Placement = Literal["in_cache", "after_cache"]
"""Where a query-aware scorer's queries sit: the cache's last rows, or after the cache."""
Aggregate = Literal["max", "mean"]
"""`KVzip(aggregate=)`: a key's score over the queries and the group's heads."""
WindowTail = Literal["own", "merge"]
"""`WindowedManifoldL2(tail=)`, `evaluate(window_tail=)`: the final partial window."""
JointAggregate = Literal["max", "mean", "vote"]
"""`select_joint(aggregate=)`, `select_joint_blocks(aggregate=)` (not "vote")."""
BlockAggregate = Literal["mean", "max"]
"""`select_joint_blocks(block_aggregate=)`: a block's score over its positions."""
Psi = Literal["sum", "mean", "attention"]
"""`ProtoKV(psi=)`: the cluster score."""
Protocol = Literal["leak_free", "shared"]
"""`evaluate(protocol=)`: which queries the methods see."""
MixMetric = Literal["recall", "error", "overlap"]
"""`evaluate(mix_metric=)`: what per_layer_best maximises."""
SynthKind = Literal["mixed", "sinks", "anisotropic", "lowrank", "drift", "radial-needles", "angular-needles",
                    "multikey-needles", "anchors"]
"""`synth(kind=)`: the planted structure."""
DType = Literal["float32", "float16", "bfloat16"]
"""`ParisKVCache(dtype=)`: the element type of the stored rows."""

isa = _k.isa
isas = _k.isas
set_isa = _k.set_isa
budget_from_ratio = _k.budget_from_ratio

def cuda_available() -> bool:
    """Whether CUDA tensors can run here: the CUDA module was built, a driver and a device are
    present, and the device runs the architectures built. Never raises, never imports torch."""
    return _cuda.available()


def cuda_status() -> dict:
    """Why CUDA tensors can or cannot run here: ``{'available', 'reason', 'message', ...}`` with
    reason 'available', 'not_built' (no kvscore._kvscore_cuda: build with KVSCORE_CUDA=1 pip
    install .), 'no_driver', 'driver_too_old', 'no_device', 'arch_not_built' (no device runs the
    architectures built) or 'error'; also the driver and runtime versions, the architectures
    built and each device (name, capability, supported). Asks the driver only; never raises,
    never imports torch."""
    return _cuda.status()


#: The registry's defaults (kvscore::ScorerArgs{}) and the option structs' (SelectOptions{}, ...).
_ARGS = _k.ScorerArgs()
_DEF = _k.struct_defaults


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


def _arg(x, name: str, writable: bool = False, who: str = "this kvscore function"):
    """(array for the C++ core, converter of results back to the caller's kind).

    What the core cannot read in place is named here, before nanobind's generic "incompatible
    function arguments": a tensor on another device, a sparse tensor, a non-native byte order.
    The functions with a CUDA path (the scorers, select, compact) dispatch CUDA tensors before
    they get here, so a CUDA tensor here is one `who` cannot take: a ValueError, never a copy.
    """
    if _is_torch(x):
        import torch

        if x.device.type != "cpu":
            if x.device.type == "cuda":
                _cuda.cpu_only(name, x, who)
            raise ValueError(f"{name}: tensor on device '{x.device}': kvscore reads CPU memory only "
                             f"('{x.device.type}' tensors are not supported); move it with .cpu()")
        if x.layout != torch.strided:
            raise ValueError(f"{name}: a {x.layout} tensor: kvscore reads dense strided tensors in place; "
                             "convert it with .to_dense()")
        return x.detach(), _to_torch
    if isinstance(x, _np.ndarray):
        if not x.dtype.isnative:
            raise ValueError(f"{name}: dtype {x.dtype.str} is not in this machine's byte order (big-endian?): "
                             f"kvscore reads arrays in place; convert with .astype(x.dtype.newbyteorder('='))")
        if writable and not x.flags.writeable:
            raise ValueError(f"{name}: the numpy array is read-only; compaction writes in place")
        return x, _identity
    raise ValueError(f"{name}: expected a numpy array or a torch tensor (got {type(x).__name__})")


def _index(x, name: str) -> int:
    """An integer argument: ints, numpy and torch integers; TypeError for a float (never truncated)."""
    try:
        return _operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an integer (got {x!r} of type {type(x).__name__})") from None


# ------------------------------------------------------------------ scorers

class _Scorer:
    """Common shell: ``score(keys) -> float32 [kv_heads, tokens]``, higher = keep.

    Every scorer is built by the registry's constructor (kvscore::make_scorer) from
    kvscore::ScorerArgs; ``name`` is the class's registry name (REGISTRY, set below).
    """

    name = ""
    protected_recent = 0  # tokens at the end of the cache the selector must keep (SnapKV, ProtoKV)

    def __init__(self, impl=None, threads: int = 0, **build):
        self._impl = impl if impl is not None else _make(type(self).name, **build)
        self._build = build  # what kvscore._kvscore_cuda builds its own from (_on_cuda)
        self._cuda_impl = None
        self.num_threads = threads

    @property
    def num_threads(self) -> int:
        """Threads over heads: 0 = OpenMP's default, 1 = serial; the scores are the same for any value."""
        return self._impl.num_threads if self._impl is not None else self._threads

    @num_threads.setter
    def num_threads(self, n: int) -> None:
        n = _index(n, "threads")
        if n < 0:
            raise ValueError(f"threads {n} must be >= 0 (0 = OpenMP default)")
        self._threads = n
        if self._impl is not None:
            self._impl.num_threads = n

    def score(self, keys, queries=None):
        """Scores of every cached token.

        Parameters
        ----------
        keys : numpy.ndarray or torch.Tensor
            ``[kv_heads, tokens, head_dim]`` or ``[1, kv_heads, tokens, head_dim]``, float32,
            float16 or bfloat16, any layout whose head_dim stride is 1 (read in place). A CUDA
            tensor is scored on its device by kvscore::cuda (the CUDA build: cuda_status()).
        queries : None
            Query-agnostic scorers take none (a ValueError otherwise).

        Returns
        -------
        numpy.ndarray or torch.Tensor
            float32 ``[kv_heads, tokens]``, higher = keep; the kind of array ``keys`` was (a
            CUDA tensor on the keys' device for CUDA keys).
        """
        if queries is not None:
            raise ValueError(f"{type(self).__name__}.score: this scorer takes no queries")
        if _cuda.is_cuda(keys):
            return _cuda.score(self._on_cuda(keys), keys)
        a, back = _arg(keys, "keys")
        return back(self._impl.score(a))

    def _on_cuda(self, keys):
        """This scorer for CUDA keys: kvscore._kvscore_cuda's, built once from the same arguments
        (its queries and filters stay on the host, as the C++ kvscore::cuda::score takes them)."""
        _cuda.require("keys", keys)
        if self._cuda_impl is None:
            b = dict(self._build)
            queries, last, filters = b.pop("queries", None), b.pop("last", 0), b.pop("filters", None)
            q = None if queries is None else _arg(queries, "queries")[0]
            f = None if filters is None else _arg(filters, "filters")[0]
            self._cuda_impl = _cuda.make_scorer(type(self).name, b, queries=q, last=last, filters=f)
        return self._cuda_impl

    def __repr__(self) -> str:
        return f"kvscore.{type(self).__name__}()"


def _make(name: str, *, queries=None, last: int = 0, filters=None, **fields):
    """kvscore::make_scorer(name, ScorerArgs) with the given ScorerArgs fields set."""
    args = _k.ScorerArgs()
    for k, v in fields.items():
        setattr(args, k, v)
    q = None if queries is None else _arg(queries, "queries")[0]
    f = None if filters is None else _arg(filters, "filters")[0]
    return _k.make_scorer(name, args, q, last, f)


class KNorm(_Scorer):
    """K-norm (Devoto et al.): score = -||k||, keeps low-norm keys.

    Parameters
    ----------
    threads : int, optional
        Threads over heads (0 = OpenMP's default).
    """

    def __init__(self, *, threads: int = 0):
        super().__init__(threads=threads)


class KeyDiff(_Scorer):
    """KeyDiff: score = -cos(k, mean key direction).

    Parameters
    ----------
    threads : int, optional
        Threads over heads (0 = OpenMP's default).
    """

    def __init__(self, *, threads: int = 0):
        super().__init__(threads=threads)


class ManifoldL2(_Scorer):
    """ManifoldKV: score = ||k - centroid||_2 over the head's keys.

    Parameters
    ----------
    threads : int, optional
        Threads over heads (0 = OpenMP's default).
    """

    def __init__(self, *, threads: int = 0):
        super().__init__(threads=threads)


class WindowedManifoldL2(_Scorer):
    """Windowed ManifoldKV: L2 distance to the centroid of the key's window of ``window`` tokens
    (docs/methods/windowed-manifoldkv.md).

    Parameters
    ----------
    window : int, optional
        W, tokens per window (the registry's kDefaultWindow).
    tail : {'merge', 'own'}, optional
        'merge' (default): a final partial window shorter than W/2 joins the window before it;
        'own' (the paper's Alg. 2): it is its own window.
    threads : int, optional
        Threads over heads (0 = OpenMP's default).
    """

    def __init__(self, window: int = _ARGS.window, tail: WindowTail = _ARGS.window_tail, *, threads: int = 0):
        super().__init__(threads=threads, window=window, window_tail=tail)
        self.window = window
        self.tail = tail


class QFilter(_Scorer):
    """Q-Filters: score = <k, f_h> (docs/methods/qfilters.md).

    Parameters
    ----------
    filters : array_like
        ``[kv_heads, head_dim]`` in kvscore's convention (as calibrate_qfilters returns them);
        copied to float32.
    threads : int, optional
        Threads over heads (0 = OpenMP's default).

    Notes
    -----
    ``QFilter.from_published(path, layer)`` reads the authors' safetensors files, whose sign is
    the opposite (score = -<f, k>, the same ranking); ``QFilter.load`` reads either.
    """

    def __init__(self, filters, *, threads: int = 0):
        if _cuda.is_cuda(filters):  # the filters live on the host (copied to fp32 here, to the device per call)
            filters = filters.detach().cpu()
        super().__init__(threads=threads, filters=filters)

    @classmethod
    def from_published(cls, path: str, layer: int, *, threads: int = 0) -> "QFilter":
        """One layer of a published .safetensors filter file (the authors' sign convention)."""
        return cls(_k.load_qfilters(str(path), layer, "published"), threads=threads)

    @classmethod
    def load(cls, path: str, layer: int, convention: str = "", *, threads: int = 0) -> "QFilter":
        """.npy (kvscore convention) or .safetensors (published convention) unless ``convention``
        is 'kvscore' or 'published'."""
        return cls(_k.load_qfilters(str(path), layer, convention), threads=threads)

    @property
    def filters(self):
        """float32 ``[kv_heads, head_dim]``, kvscore's convention (a new array)."""
        return self._impl.filters


def calibrate_qfilters(queries, kv_heads: int):
    """Q-Filter calibration from query samples.

    Parameters
    ----------
    queries : array_like
        ``[q_heads, n, head_dim]`` (or ``[1, ...]``), any float dtype kvscore reads.
    kv_heads : int
        KV heads; q_heads / kv_heads query heads share a filter (GQA).

    Returns
    -------
    numpy.ndarray or torch.Tensor
        float32 ``[kv_heads, head_dim]`` in kvscore's convention.
    """
    a, back = _arg(queries, "queries", who="calibrate_qfilters")
    return back(_k.calibrate_qfilters(a, kv_heads))


class _QueryScorer(_Scorer):
    """Scorers built from the post-RoPE queries of an observation window [q_heads, n, head_dim]
    (or [1, q_heads, n, head_dim]); score(keys, queries) rebuilds it with new queries."""

    def score(self, keys, queries=None):
        """Scores of every cached token.

        Parameters
        ----------
        keys : numpy.ndarray or torch.Tensor
            ``[kv_heads, tokens, head_dim]`` or ``[1, ...]``, read in place.
        queries : array_like, optional
            New window queries: the scorer is rebuilt with them and the same options.

        Returns
        -------
        numpy.ndarray or torch.Tensor
            float32 ``[kv_heads, tokens]``, higher = keep.
        """
        if queries is not None:
            return type(self)(queries, **self._options).score(keys)
        if self._impl is None:  # window queries in CUDA memory (SnapKV): CUDA keys only
            q = self._device_queries
            if not _cuda.is_cuda(keys):
                where = keys.device if hasattr(keys, "device") else f"the host ({type(keys).__name__})"
                raise ValueError(f"{type(self).__name__}.score: the queries are on {q.device} but the keys are on "
                                 f"{where}: pass both on one device")
            o = self._options
            return _cuda.score_snapkv(keys, q, o["window"], o["kernel"], o["placement"])
        if _cuda.is_cuda(keys):
            return _cuda.score(self._on_cuda(keys), keys)
        a, back = _arg(keys, "keys")
        return back(self._impl.score(a))

    def _device_init(self, queries, threads: int) -> None:
        """SnapKV from window queries in CUDA memory: kept there and read in place at every
        score (kvscore::cuda::DeviceSnapKV); shapes and options checked now, the values checked
        for finite numbers once (the CPU constructor's check: one synchronisation)."""
        _cuda.require("queries", queries)
        o = self._options
        self._device_queries = queries.detach()
        self._recent = _cuda.snapkv_protected_recent(self._device_queries, o["window"], o["kernel"], o["placement"])
        _cuda.check_finite_queries(self._device_queries, o["window"])
        self._impl = self._build = self._cuda_impl = None
        self.num_threads = threads

    @property
    def protected_recent(self) -> int:
        """Tokens at the end of the cache select() must keep (``recent=``): the window when the
        queries sit in the cache, 0 after it."""
        return self._impl.protected_recent if self._impl is not None else self._recent


class SnapKV(_QueryScorer):
    """SnapKV (Li et al.): attention of the observation window's queries, average-pooled.

    Parameters
    ----------
    queries : array_like
        ``[q_heads, n, head_dim]`` (or ``[1, ...]``) post-RoPE queries; GQA from the shapes.
    window : int, optional
        At most the last ``window`` of the given queries are used (the registry's
        kDefaultSnapKVWindow, kvpress's window_size).
    kernel : int, optional
        Average-pooling kernel, odd (the registry's kDefaultSnapKVKernel).
    placement : {'in_cache', 'after_cache'}, optional
        'in_cache': the queries are the cache's last positions (causal, the window protected:
        pass ``recent=protected_recent`` to select). 'after_cache': they follow the cache (a
        decode step, held-out queries): no causal mask, nothing protected.
    threads : int, optional
        Threads over heads (0 = OpenMP's default).
    """

    def __init__(self, queries, window: int = _k.kDefaultSnapKVWindow, kernel: int = _ARGS.kernel_size, *,
                 placement: Placement = _ARGS.placement, threads: int = 0):
        if _index(window, "window") < 1:
            raise ValueError(f"SnapKV: window {window} must be >= 1")
        self._options = {"window": window, "kernel": kernel, "placement": placement, "threads": threads}
        if _cuda.is_cuda(queries):  # scores CUDA keys with the queries where they are
            self._device_init(queries, threads)
            return
        super().__init__(threads=threads, queries=queries, last=window, kernel_size=kernel, placement=placement)


class ProtoKV(_QueryScorer):
    """ProtoKV: prototype clusters (SAT + PDT) scored by the window queries (docs/methods/protokv.md).

    Parameters
    ----------
    queries : array_like
        ``[q_heads, n, head_dim]`` (or ``[1, ...]``) post-RoPE queries.
    window : int, optional
        The last ``window`` of the given queries; 0 (default) uses every one.
    kappa, sat_candidates, lsh_bits, chunks : int, optional
        κ, p, r and v of the paper (the registry's kDefaultProtoKV* constants).
    bandwidth : float, optional
        RFF bandwidth σ; 0 = the median heuristic.
    seed : int, optional
        RFF seed.
    psi : {'attention', 'sum', 'mean'}, optional
        The cluster score ψ.
    placement : {'in_cache', 'after_cache'}, optional
        As SnapKV's: 'in_cache' protects the window, 'after_cache' nothing (the window may then
        exceed the cache).
    threads : int, optional
        Threads over heads (0 = OpenMP's default).
    """

    def __init__(self, queries, window: int = 0, *, kappa: int = _ARGS.kappa, sat_candidates: int = _ARGS.sat_candidates,
                 lsh_bits: int = _ARGS.lsh_bits, chunks: int = _ARGS.chunks, bandwidth: float = _ARGS.bandwidth,
                 seed: int = _ARGS.seed, psi: Psi = _ARGS.psi, placement: Placement = _ARGS.placement, threads: int = 0):
        if _cuda.is_cuda(queries):
            # ProtoKV's GPU path computes q̄ and the RFF directions on the host (kvscore/cuda/protokv.hpp):
            # the window's queries are copied to the host once, here (they score CPU or CUDA keys)
            _cuda.require("queries", queries)
            queries = queries.detach().cpu()
        super().__init__(threads=threads, queries=queries, last=window, kappa=kappa, sat_candidates=sat_candidates,
                         lsh_bits=lsh_bits, chunks=chunks, bandwidth=bandwidth, seed=seed, psi=psi,
                         placement=placement)
        self._options = {"window": window, "kappa": kappa, "sat_candidates": sat_candidates, "lsh_bits": lsh_bits,
                         "chunks": chunks, "bandwidth": bandwidth, "seed": seed, "psi": psi, "placement": placement,
                         "threads": threads}


class KVzip(_QueryScorer):
    """KVzip (Kim et al. 2025): the attention each key receives from a set of queries, max over the
    queries and the query heads of its group (docs/methods/kvzip.md). KVzip's queries are those of a
    context-reconstruction pass; kvscore.presses.KvscorePress("kvzip") runs that pass inside
    kvpress's pipeline, and score_span() scores one pass of it.

    Parameters
    ----------
    queries : array_like
        ``[q_heads, n, head_dim]`` (or ``[1, ...]``) post-RoPE queries.
    aggregate : {'max', 'mean'}, optional
        A key's score: the largest probability any query gives it (KVzip) or their mean.
    placement : {'in_cache', 'after_cache'}, optional
        'in_cache': the queries are the cache's last n rows (causal; the window protected: pass
        ``recent=protected_recent`` to select). 'after_cache': they follow the cache.
    threads : int, optional
        Threads over heads (0 = OpenMP's default).
    """

    def __init__(self, queries, *, aggregate: Aggregate = _ARGS.aggregate, placement: Placement = _ARGS.placement,
                 threads: int = 0):
        super().__init__(threads=threads, queries=queries, aggregate=aggregate, placement=placement)
        self._options = {"aggregate": aggregate, "placement": placement, "threads": threads}

    @staticmethod
    def score_span(cache, own, queries, out, begin: int, end: int = -1, *, sinks: int = 0,
                   aggregate: Aggregate = _ARGS.aggregate, query_weights=None, key_weights=None, threads: int = 0,
                   query_block: int = 0):
        """One reconstruction pass (kvscore::KVzip::score_span): the attention the cache rows
        ``[begin, end)`` receive from ``queries`` ``[q_heads, m, head_dim]``, whose own keys are
        ``own`` ``[kv_heads, m, head_dim]`` (query i sees own rows up to i), over the softmax of the
        first ``min(sinks, begin)`` cache rows, the span and the own rows. Writes
        ``out[:, begin:end]`` in place (float32 ``[kv_heads, tokens]``, numpy or torch);
        ``query_weights`` ``[m]`` and ``key_weights`` ``[q_heads, end - begin]`` are KVzip+'s
        1/||h|| and ||W_O v||."""
        c, own_a, q, o = (_arg(cache, "cache")[0], _arg(own, "own")[0], _arg(queries, "queries")[0],
                          _arg(out, "out", writable=True)[0])
        qw = None if query_weights is None else _arg(query_weights, "query_weights")[0]
        kw = None if key_weights is None else _arg(key_weights, "key_weights")[0]
        _k.kvzip_score_span(c, own_a, q, o, _index(begin, "begin"), _index(end, "end"), _index(sinks, "sinks"),
                            aggregate, qw, kw, _index(threads, "threads"), _index(query_block, "query_block"))
        return out

    @staticmethod
    def attend_span(cache, own, values, own_values, queries, out, attn_out, begin: int, end: int = -1, *,
                    sinks: int = 0, aggregate: Aggregate = _ARGS.aggregate, query_weights=None, key_weights=None,
                    threads: int = 0, query_block: int = 0):
        """One reconstruction pass with its attention computed from the same logits
        (kvscore::KVzip::attend_span, docs/methods/kvzip.md#the-fused-pass): score_span's scores into
        ``out`` (to ~1e-6 relative), and into ``attn_out`` (float32 ``[m, q_heads, head_dim]``,
        C-contiguous) each query's causal attention output: the softmax over every cache row and
        its own rows up to itself, times ``values`` / ``own_values`` (``[kv_heads, rows,
        head_dim]``, the keys' dtype). Returns ``attn_out``."""
        arrays = [_arg(x, name)[0] for x, name in ((cache, "cache"), (own, "own"), (values, "values"),
                                                   (own_values, "own_values"), (queries, "queries"))]
        o, a = _arg(out, "out", writable=True)[0], _arg(attn_out, "attn_out", writable=True)[0]
        qw = None if query_weights is None else _arg(query_weights, "query_weights")[0]
        kw = None if key_weights is None else _arg(key_weights, "key_weights")[0]
        _k.kvzip_attend_span(*arrays, o, a, _index(begin, "begin"), _index(end, "end"), _index(sinks, "sinks"),
                             aggregate, qw, kw, _index(threads, "threads"), _index(query_block, "query_block"))
        return attn_out


# ------------------------------------------------------------------ selection rules

class StreamingLLM:
    """StreamingLLM (Xiao et al.) as kvscore::StreamingLLM: every head keeps the first ``sinks``
    tokens and the most recent ones, no scores needed.

    Parameters
    ----------
    sinks : int, optional
        Attention sinks kept at the start (the registry's kDefaultSinks).
    """

    def __init__(self, sinks: int = _k.kDefaultSinks, *, _impl=None):
        self._impl = _impl if _impl is not None else _k.make_selection_rule(type(self).name, _index(sinks, "sinks"))

    name = ""

    @property
    def sinks(self) -> int:
        return self._impl.sinks

    def select(self, heads: int, tokens: int, budget: int):
        """The kept positions of a ``heads x tokens`` cache, ``budget`` per head.

        Returns
        -------
        numpy.ndarray
            int64 ``[heads, budget]``: ``[0, s)`` and the last ``budget - s`` positions, with
            ``s = min(sinks, tokens)``, ascending.

        Raises
        ------
        ValueError
            When ``s`` exceeds the budget or the budget the tokens (kvscore::StreamingLLM's rule).
        """
        return self._impl.select(_index(heads, "heads"), _index(tokens, "tokens"), _index(budget, "budget"))

    def __repr__(self) -> str:
        return f"kvscore.StreamingLLM(sinks={self.sinks})"


# ------------------------------------------------------------------ the method registry

#: kvscore/methods.hpp, the one list of methods (dicts: name, cli, aliases, kind, cls, header, doc,
#: summary, options).
REGISTRY = _k.methods()

_KIND = {m["name"]: m["kind"] for m in REGISTRY}
_SCORER_KINDS = ("scorer", "query_scorer")


def _classes(kinds):
    """The Python class of every registry entry of these kinds, named by its C++ class (``cls``)."""
    out = {}
    for m in REGISTRY:
        if m["kind"] in kinds:
            cls = globals().get(m["cls"])
            if cls is None:  # as make_scorer.hpp's static_assert: the registry lists a method Python lacks
                raise ImportError(f"kvscore: include/kvscore/methods.hpp lists {m['kind']} '{m['name']}' "
                                  f"(class {m['cls']}) but python/kvscore has no class {m['cls']}")
            cls.name = m["name"]
            out[m["name"]] = cls
    return out


#: Canonical method names -> scorer class (query-agnostic ones take no arguments): the scorers of REGISTRY.
METHODS = _classes(_SCORER_KINDS)
_SELECTION_RULES = _classes(("selection_rule",))
#: Other spellings (the CLI's and evaluator's, and the registry's aliases) -> canonical name,
#: for the scorers and the selection rules.
ALIASES = {s: m["name"] for m in REGISTRY if m["kind"] in _SCORER_KINDS + ("selection_rule",)
           for s in [m["cli"], *m["aliases"]] if s != m["name"]}


def method_name(name: str) -> str:
    """The canonical name of a scorer or selection rule, by any spelling of the registry.

    Raises
    ------
    ValueError
        For any other name, listing the known ones.
    """
    n = ALIASES.get(name, name)
    if n not in METHODS and n not in _SELECTION_RULES:
        known = ", ".join(sorted(set(METHODS) | set(_SELECTION_RULES) | set(ALIASES)))
        raise ValueError(f"unknown method '{name}' (expected one of: {known})")
    return n


def make_scorer(method: str, *args, **options) -> _Scorer:
    """A scorer by registry name or alias, e.g. ``make_scorer('windowed_manifold_l2', window=2048)``:
    ``METHODS[method_name(method)](*args, **options)``."""
    n = method_name(method)
    if n not in METHODS:
        raise ValueError(f"'{method}' is a {_KIND[n].replace('_', ' ')}, not a scorer: "
                         f"kvscore.make_selection_rule('{method}') builds it")
    return METHODS[n](*args, **options)


def make_selection_rule(method: str, *, sinks: int = _k.kDefaultSinks) -> StreamingLLM:
    """A selection rule by registry name or alias (kvscore::make_selection_rule)."""
    n = method_name(method)
    if n not in _SELECTION_RULES:
        raise ValueError(f"'{method}' is a {_KIND[n].replace('_', ' ')}, not a selection rule: "
                         f"kvscore.make_scorer('{method}') builds it")
    return _SELECTION_RULES[n](sinks)


# ------------------------------------------------------------------ selection, compaction

_SEL = _DEF["SelectOptions"]


def select(scores, budget: int, *, sinks: int = _SEL["sinks"], recent: int = _SEL["recent"],
           alloc: Alloc = _SEL["alloc"], alpha: float = _SEL["alpha"], normalize: bool = _SEL["normalize"],
           threads: int = _SEL["threads"]):
    """Tokens to keep from scores, per head (kvscore::select).

    Parameters
    ----------
    scores : numpy.ndarray or torch.Tensor
        float32 ``[kv_heads, tokens]``, higher = keep (read in place; a CUDA tensor is selected
        on its device, the same positions as on the CPU).
    budget : int
        Tokens kept per head (an integer: a float is a TypeError, never truncated).
    sinks, recent : int, optional
        The first ``sinks`` and last ``recent`` positions are always kept (inside the budget).
    alloc : {'per_head', 'adakv'}, optional
        'adakv': the layer keeps ``budget * kv_heads`` tokens spread over the heads (AdaKV).
    alpha : float, optional
        AdaKV's safeguard: every head keeps at least ``alpha * budget``.
    normalize : bool, optional
        AdaKV: z-normalise each head's scores first.
    threads : int, optional
        Threads over heads (0 = OpenMP's default); the result is the same for any value.

    Returns
    -------
    numpy.ndarray or torch.Tensor, or a list of them
        int64 ``[kv_heads, budget]``, each row ascending (alloc='per_head'); for 'adakv' a list
        of kv_heads int64 arrays (for CUDA scores, views of one device tensor; their lengths are
        read back). Ties keep the lower position.
    """
    budget = _index(budget, "select: budget")
    if _cuda.is_cuda(scores):
        _cuda.require("scores", scores)
        return _cuda.select(scores, budget, sinks=sinks, recent=recent, alloc=alloc, alpha=alpha, normalize=normalize,
                            threads=threads)
    a, back = _arg(scores, "scores")
    return back(_k.select(a, budget, sinks=sinks, recent=recent, alloc=alloc, alpha=alpha,
                          normalize=normalize, threads=threads))



def _score_layers(scores, who: str):
    """(one array per layer, back) of select_joint's score forms: [layers, kv_heads, tokens],
    [rows, tokens], or a list of [kv_heads, tokens] (views, no copy). CPU only."""
    if isinstance(scores, (list, tuple)):
        layers = list(scores)
    else:
        _arg(scores, "scores", who=who)  # a numpy array or a CPU torch tensor, else ValueError
        nd = len(scores.shape)
        if nd not in (2, 3):
            raise ValueError(f"{who}: scores must be [layers, kv_heads, tokens] or [rows, tokens] (got {nd} dimensions)")
        layers = [scores] if nd == 2 else list(scores)  # views of each layer, no copy
    arrays, back = [], _identity
    for i, s in enumerate(layers):
        a, b = _arg(s, f"scores[{i}]", who=who)
        arrays.append(a)
        if i == 0:
            back = b
    return arrays, back

def select_joint(scores, budget: int, *, sinks: int = 0, recent: int = 0, aggregate: JointAggregate | None = None,
                 threads: int = 0):
    """ONE set of kept positions for every head of every layer, for caches that drop a token
    everywhere at once (llama.cpp's cells, paged blocks holding all heads; docs/reference/joint.md).
    `scores`: float32 [layers, kv_heads, tokens], [rows, tokens] (one layer, or all rows
    stacked), or a list of [kv_heads, tokens] arrays, one per layer. Each row is z-normalised,
    then aggregated per token: 'max' (the default), 'mean' or 'vote'; then select()'s rules
    (budget counts every kept token, sinks/recent always kept, ties keep the lower position).
    Returns int64 [budget], ascending."""
    arrays, back = _score_layers(scores, "select_joint")
    kw = {} if aggregate is None else {"aggregate": aggregate}
    return back(_k.select_joint(arrays, _index(budget, "budget"), sinks=_index(sinks, "sinks"),
                                recent=_index(recent, "recent"), threads=_index(threads, "threads"), **kw))


def select_joint_blocks(scores, block_size: int, budget: int, *, sinks: int = 0, recent: int = 0,
                        aggregate: JointAggregate | None = None, block_aggregate: BlockAggregate | None = None,
                        threads: int = 0):
    """ONE set of kept BLOCKS of `block_size` positions for every head of every layer, for paged
    caches that free whole blocks (vLLM; docs/reference/joint.md, "Whole blocks"). `scores` as select_joint's
    (max or mean aggregate over rows; vote is refused). A block's score is the mean (default) or
    max of its positions' joint scores; the blocks holding the first `sinks` or last `recent`
    positions and a partial last block are always kept, inside `budget` (blocks). Returns int64
    logical block indices, ascending."""
    arrays, back = _score_layers(scores, "select_joint_blocks")
    kw = {} if aggregate is None else {"aggregate": aggregate}
    if block_aggregate is not None:
        kw["block_aggregate"] = block_aggregate
    return back(_k.select_joint_blocks(arrays, _index(block_size, "block_size"), _index(budget, "budget"),
                                       sinks=_index(sinks, "sinks"), recent=_index(recent, "recent"),
                                       threads=_index(threads, "threads"), **kw))


def _numpy_view(a):
    """A numpy array over the same memory as `a` (numpy, or a CPU torch tensor; for a CUDA tensor
    one with its bounds and strides only, never read), for overlap tests."""
    if isinstance(a, _np.ndarray):
        return a
    if _cuda.is_cuda(a):
        return _cuda.bounds_view(a)
    import torch

    if a.dtype in (torch.float16, torch.bfloat16):
        return a.view(torch.int16).numpy()  # same element size and strides; numpy has no bfloat16
    return a.numpy()


_TOO_HARD = getattr(_np, "exceptions", _np).TooHardError


def _share_memory(a, b) -> bool:
    """Whether two arrays share an element (numpy's exact test; when it gives up, their byte ranges)."""
    x, y = _numpy_view(a), _numpy_view(b)
    try:
        return bool(_np.shares_memory(x, y, max_work=1 << 20))
    except _TOO_HARD:
        return bool(_np.may_share_memory(x, y))


_COMPACT = _DEF["CompactOptions"]


def compact(keys, values, selection, *, tail: Tail = _COMPACT["tail"], require_equal_lengths: bool = True) -> int:
    """Moves the kept rows of keys and values to the front of each head, in place (kvscore::compact).

    Parameters
    ----------
    keys, values : numpy.ndarray or torch.Tensor
        ``[kv_heads, tokens, d]`` (or ``[1, ...]``, HF layout), writable, sharing no element with
        each other (a ValueError otherwise: moving one would overwrite the other).
    selection : array or list of arrays
        select()'s result (numpy or torch; for CUDA keys and values, on their device: it is
        checked there with the CPU's rules, one synchronisation, before anything moves).
    tail : {'keep', 'zero'}, optional
        What is left after the kept rows: the old rows, or zeros.
    require_equal_lengths : bool, optional
        Every head keeps the same count, then returned as one int (True here, unlike C++'s
        CompactOptions: select()'s per-head result always has equal counts).

    Returns
    -------
    int or list of int
        The kept length n (slice ``[..., :n, :]`` afterwards), or each head's when
        ``require_equal_lengths=False``.
    """
    overlap = ("compact: keys and values overlap in memory (they share elements): compacting one would "
               "overwrite the other; pass separate buffers")
    if _cuda.is_cuda(keys) or _cuda.is_cuda(values):
        _cuda.require("keys" if _cuda.is_cuda(keys) else "values", keys if _cuda.is_cuda(keys) else values)
        if _cuda.is_cuda(keys) and _cuda.is_cuda(values) and _share_memory(keys, values):
            raise ValueError(overlap)
        lengths = _cuda.compact(keys, values, selection, tail=tail, require_equal_lengths=require_equal_lengths)
        return int(lengths[0]) if require_equal_lengths and lengths else lengths
    k, _ = _arg(keys, "keys", writable=True)
    v, _ = _arg(values, "values", writable=True)
    if _share_memory(k, v):
        raise ValueError(overlap)
    if isinstance(selection, (list, tuple)):
        sel = [_arg(s, "selection")[0] for s in selection]
    else:
        sel = _arg(selection, "selection")[0]
    lengths = _k.compact(k, v, sel, tail=tail, require_equal_lengths=require_equal_lengths)
    return int(lengths[0]) if require_equal_lengths and lengths else lengths


# ------------------------------------------------------------------ evaluator, synthetic data

def _f32_4d(x, name):
    if _is_torch(x):
        if x.device.type != "cpu":
            _arg(x, name, who="evaluate")  # never a silent copy from a device: ValueError
        x = x.detach().float().numpy()
    x = _np.ascontiguousarray(_np.asarray(x, dtype=_np.float32))
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4:
        raise ValueError(f"{name}: expected [kv_heads, tokens, d] or [layers, kv_heads, tokens, d] (got {x.ndim} dims)")
    return x


_EVAL, _METHOD_OPTS = _DEF["EvalOptions"], _DEF["MethodOptions"]


def evaluate(K, V, Q, *, methods="all", keep=tuple(_EVAL["keep"]), sinks: int = _SEL["sinks"],
             recent: int = _SEL["recent"], alloc: Alloc = _SEL["alloc"], alpha: float = _SEL["alpha"],
             window: int = _METHOD_OPTS["window"], window_tail: WindowTail = _METHOD_OPTS["window_tail"],
             budget_rounding: Rounding = _EVAL["rounding"], query_placement: Placement = _METHOD_OPTS["placement"],
             threads: int = 1, window_queries=None, calib_queries=None, protocol: Protocol | None = None,
             mix_metric: MixMetric = _EVAL["mix_metric"]) -> dict:
    """``kvscore eval`` as a function: the same report, as a dict.

    Parameters
    ----------
    K, V : array_like
        ``[layers, kv_heads, tokens, d]`` (3-D: one layer); converted to fp32 (the evaluator's
        precision).
    Q : array_like
        ``[layers, q_heads, n_q, d]``: the queries after the cache, which measure every method
        (and, under the shared protocol, are also what the query-aware methods see).
    methods : str or list of str, optional
        Registry names or aliases, or 'all'.
    keep : sequence of float, optional
        Fractions of the tokens kept, each in (0, 1].
    sinks, recent, alloc, alpha : optional
        As select()'s.
    window, window_tail : optional
        Windowed ManifoldKV's W and tail rule.
    budget_rounding : {'nearest', 'floor'}, optional
        'floor' gives the papers' n = floor(keep * N).
    query_placement : {'after_cache', 'in_cache'}, optional
        Shared protocol only: Q follows the cache ('after_cache': snapkv, protokv and ojakv see
        every key, nothing protected beyond ``recent``) or is the cache's last n_q positions
        ('in_cache').
    threads : int, optional
        Threads (0 = OpenMP's default).
    window_queries : array_like, optional
        ``[layers, q_heads, n_w, d]``: the queries of the cache's own last n_w tokens, what
        snapkv, protokv and ojakv see under the leak-free protocol (in the cache, the window
        protected). Given, the leak-free protocol is the default.
    calib_queries : array_like, optional
        ``[layers, q_heads, n_c, d]``: queries of other text, Q-Filters' calibration under the
        leak-free protocol (qfilter is skipped without them).
    protocol : {'leak_free', 'shared'}, optional
        Which queries the methods see (docs/reference/evaluate.md "Protocols"): 'leak_free' (as in an
        engine; needs window_queries) or 'shared' (every method sees Q: an upper bound). Default:
        'leak_free' when window_queries is given, else 'shared'.
    mix_metric : {'recall', 'error', 'overlap'}, optional
        What the report's per_layer_best optimises (error: minimises).

    Returns
    -------
    dict
        Attention-mass recall, output error, top-k overlap and time per method and keep fraction,
        and per_layer_best (the best press-able method per layer at each keep).
    """
    if not isinstance(methods, str):
        methods = ",".join(methods)
    if protocol is None:
        protocol = "leak_free" if window_queries is not None else _METHOD_OPTS["protocol"]
    protocol = protocol.replace("-", "_")  # any other spelling: the library's parse_protocol names it
    if protocol == "leak_free" and window_queries is None:
        raise ValueError("protocol 'leak_free' needs window_queries (the queries of the cache's last tokens)")
    Kf, Vf, Qf = _f32_4d(K, "K"), _f32_4d(V, "V"), _f32_4d(Q, "Q")
    Wf = _f32_4d(window_queries, "window_queries") if protocol == "leak_free" else None
    Cf = _f32_4d(calib_queries, "calib_queries") if protocol == "leak_free" and calib_queries is not None else None
    return _json.loads(_k.evaluate_json(Kf, Vf, Qf, methods, [float(f) for f in keep], sinks, recent, alloc, alpha,
                                        window, window_tail, budget_rounding, query_placement, threads,
                                        window_queries=Wf, calib_queries=Cf, protocol=protocol,
                                        mix_metric=mix_metric))


_SYNTH = _DEF["synth.Spec"]


def synth(kind: SynthKind = _SYNTH["kind"], *, layers: int = _SYNTH["layers"], kv_heads: int = _SYNTH["kv_heads"],
          group: int = _SYNTH["group"], tokens: int = _SYNTH["tokens"], head_dim: int = _SYNTH["head_dim"],
          queries: int = _SYNTH["queries"], segment: int = _SYNTH["segment"], seed: int = _SYNTH["seed"]) -> dict:
    """``kvscore synth`` as a function (docs/reference/synth.md).

    Returns
    -------
    dict
        ``{'K', 'V', 'Q'}`` (float32 numpy, ``[layers, heads, tokens or queries, head_dim]``) and
        ``'planted': {name: [int64 positions per (layer, head)]}``.
    """
    return _k.synth(kind, layers, kv_heads, group, tokens, head_dim, queries, segment, seed)


# ------------------------------------------------------------------ ParisKV, OjaKV

_PARIS, _PARIS_SEARCH, _PARIS_CACHE = _DEF["ParisKVConfig"], _DEF["ParisKVSearch"], _DEF["ParisKVCacheConfig"]


class ParisKV:
    """ParisKV retrieval index of one KV head (docs/methods/pariskv.md).

    Parameters
    ----------
    head_dim : int
    m : int, optional
        Subspace dimension (a power of two in [2, 16]).
    seed : int, optional
        Rotation seed (None: the C++ default).
    center : bool, optional
        Subtract the prefill's key mean before encoding.

    ``append(keys [n, head_dim])`` streams keys in; ``search(queries [n_q, head_dim], k)`` returns
    (positions int64 [n_q, k] ascending, RSQ-IP scores).
    """

    def __init__(self, head_dim: int, *, m: int = _PARIS["m"], seed: int | None = None,
                 center: bool = _PARIS["center"]):
        self._impl = _k.ParisKV(head_dim, m, center=center) if seed is None else _k.ParisKV(head_dim, m, seed, center)

    @property
    def size(self) -> int:
        return self._impl.size

    @property
    def memory_bytes(self) -> int:
        return self._impl.memory_bytes

    def append(self, keys) -> None:
        """Appends keys ``[n, head_dim]`` (float32, float16 or bfloat16, head_dim stride 1)."""
        a, _ = _arg(keys, "keys", who="ParisKV")
        self._impl.append(a)

    def search(self, queries, k: int = _PARIS_SEARCH["k"], *, beta: float = _PARIS_SEARCH["beta"],
               rho: float = _PARIS_SEARCH["rho"]):
        """Top-k positions per query.

        Parameters
        ----------
        queries : array_like
            ``[n_q, head_dim]`` or one ``[head_dim]``.
        k : int, optional
            Results per query.
        beta, rho : float, optional
            Candidate and collision ratios in (0, 1]; 0 = length-adaptive defaults.

        Returns
        -------
        (positions, scores)
            int64 ``[n_q, k]`` ascending and their float32 RSQ-IP estimates (1-D for one query).
        """
        a, back = _arg(queries, "queries", who="ParisKV")
        one = a.ndim == 1
        if one:
            a = a[None]
        pos, sc = self._impl.search(a, k, beta, rho)
        if one:
            pos, sc = pos[0], sc[0]
        return back(pos), back(sc)


class ParisKVCache:
    """ParisKV's decode-time cache of one KV head (docs/methods/pariskv.md "Decode-time cache").

    The first ``sinks`` tokens, a ParisKV index over the middle and the last ``local`` tokens;
    dense attention below max(dense_min, sinks + local + 2k) tokens. ``append(keys, values)``
    takes ``[n, head_dim]`` rows of the cache's dtype (row-contiguous, read in place);
    ``select(query)`` -> int64 positions (sinks, the top-k of the index, the local window;
    ascending); ``attend(query)`` -> (float32 ``[head_dim]`` output, positions).

    Parameters
    ----------
    head_dim : int
    dtype : {'float16', 'float32', 'bfloat16'}, optional
    sinks, local, update_interval, dense_min, k, rerank_exact : int, optional
        kvscore::ParisKVCacheConfig's fields (its defaults).
    """

    _impls = {"float32": "ParisKVCacheF32", "float16": "ParisKVCacheF16", "bfloat16": "ParisKVCacheBF16"}

    def __init__(self, head_dim: int, *, dtype: DType = "float16", sinks: int = _PARIS_CACHE["sinks"],
                 local: int = _PARIS_CACHE["local"], update_interval: int = _PARIS_CACHE["update_interval"],
                 dense_min: int = _PARIS_CACHE["dense_min"], k: int = _PARIS_CACHE["k"],
                 rerank_exact: int = _PARIS_CACHE["rerank_exact"]):
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
        """Appends rows ``[n, head_dim]`` of the cache's dtype."""
        k, _ = _arg(keys, "keys", who="ParisKVCache")
        v, _ = _arg(values, "values", who="ParisKVCache")
        self._impl.append(k, v)

    def select(self, query):
        """int64 positions one query ``[head_dim]`` attends, ascending."""
        q, back = _arg(query, "query", who="ParisKVCache")
        return back(self._impl.select(q))

    def attend(self, query):
        """(float32 ``[head_dim]`` attention output, positions) for one query."""
        q, back = _arg(query, "query", who="ParisKVCache")
        out, pos = self._impl.attend(q)
        return back(out), back(pos)


class OjaProjector:
    """OjaKV's low-rank key/value bases of one head.

    ``OjaProjector.random(d, rk, rv, seed)``, then ``prefill(keys, values)`` (``[tokens, d]`` or
    ``[1, tokens, d]``); ``key_basis`` / ``value_basis`` are float32 ``[d, r]``.
    """

    def __init__(self, impl):
        self._impl = impl

    @classmethod
    def random(cls, head_dim: int, key_rank: int, value_rank: int, seed: int = 0) -> "OjaProjector":
        """Random orthonormal starting bases of the given ranks, seeded."""
        return cls(_k.OjaProjector.random(head_dim, key_rank, value_rank, seed))

    def prefill(self, keys, values) -> None:
        """Fits the bases to a prefill's keys and values."""
        k, _ = _arg(keys, "keys", who="OjaProjector")
        v, _ = _arg(values, "values", who="OjaProjector")
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
