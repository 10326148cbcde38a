"""CUDA tensors in kvscore's functions: the dispatch to kvscore._kvscore_cuda (docs/reference/python.md,
"CUDA tensors").

The module is built only by ``KVSCORE_CUDA=1 pip install .``; without it a CUDA tensor given to
kvscore is a ValueError naming that switch. With it, score / select / compact and the presses
read CUDA tensors in place (DLPack), launch on torch's current stream of the tensor's device,
and take every output and workspace from torch's caching allocator (``torch.empty`` on that
device: no cudaMalloc per call). Nothing is copied to the host except what a result needs on
the host: AdaKV's per-head counts (select returns a list), compact's check of the selection it
is given (one synchronisation), a SnapKV's device queries checked for finite values once.
This file imports torch only inside the functions that are given torch tensors.
"""

from __future__ import annotations

import importlib.util as _importlib_util

try:
    from . import _kvscore_cuda as _kc
    _IMPORT_ERROR = None
except ImportError as e:
    _kc = None
    # None: not built (the default wheel); else the module is there but does not load
    _IMPORT_ERROR = None if _importlib_util.find_spec(f"{__package__}._kvscore_cuda") is None else e

#: How to build the CUDA module; every error of a CPU-only build names it.
BUILD_SWITCH = "KVSCORE_CUDA=1 pip install . (or pip install . --config-settings=cmake.define.KVSCORE_CUDA=ON)"

_STATUS = None


def status() -> dict:
    """kvscore.cuda_status(): never raises, never imports torch (docs/reference/python.md)."""
    global _STATUS
    if _STATUS is None:
        if _kc is None:
            none = {"driver_version": 0, "runtime_version": 0, "built_architectures": "", "devices": []}
            if _IMPORT_ERROR is None:
                _STATUS = {"available": False, "reason": "not_built",
                           "message": f"kvscore was built without its CUDA module kvscore._kvscore_cuda: build it "
                                      f"with {BUILD_SWITCH}", **none}
            else:
                _STATUS = {"available": False, "reason": "error",
                           "message": f"kvscore._kvscore_cuda is installed but does not load: {_IMPORT_ERROR}", **none}
        else:
            try:
                _STATUS = dict(_kc.status())
            except Exception as e:  # noqa: BLE001 - status never raises
                _STATUS = {"available": False, "reason": "error", "message": f"{type(e).__name__}: {e}",
                           "driver_version": 0, "runtime_version": 0, "built_architectures": "", "devices": []}
    return {k: (list(v) if isinstance(v, list) else v) for k, v in _STATUS.items()}


def available() -> bool:
    """kvscore.cuda_available()."""
    try:
        return bool(status()["available"])
    except Exception:  # noqa: BLE001 - never raises
        return False


def is_cuda(x) -> bool:
    """A torch tensor in CUDA memory (the only device arrays kvscore's Python functions take)."""
    return type(x).__module__.split(".")[0] == "torch" and getattr(x, "device", None) is not None \
        and x.device.type == "cuda"


def require(name: str, x) -> None:
    """ValueError naming the build switch when this kvscore has no CUDA module."""
    if _kc is None:
        if _IMPORT_ERROR is not None:
            raise ValueError(f"{name}: tensor on device '{x.device}': kvscore._kvscore_cuda does not load "
                             f"({_IMPORT_ERROR}); move it with .cpu()")
        raise ValueError(f"{name}: tensor on device '{x.device}': this kvscore was built without CUDA "
                         f"(kvscore._kvscore_cuda is missing): rebuild with {BUILD_SWITCH}, or move it with .cpu()")


def cpu_only(name: str, x, who: str) -> None:
    """ValueError for a CUDA tensor given to a function that runs on the CPU only (never a silent copy)."""
    raise ValueError(f"{name}: tensor on device '{x.device}': {who} runs on the CPU only (kvscore's CUDA path "
                     f"covers the scorers, select and compact); move it with .cpu()")


# ------------------------------------------------------------------ torch: memory and streams

def _torch():
    import torch

    return torch


def _stream(t) -> int:
    return _torch().cuda.current_stream(t.device).cuda_stream


def _scratch(nbytes: int, device):
    """Device scratch from torch's caching allocator."""
    torch = _torch()
    return torch.empty(int(nbytes), dtype=torch.uint8, device=device)


def _same_device(name: str, x, ref) -> None:
    if not is_cuda(x) or x.device != ref.device:
        where = x.device if hasattr(x, "device") else type(x).__name__
        raise ValueError(f"{name}: on {where} but the keys are on {ref.device}: pass both on one device")


# ------------------------------------------------------------------ scorers

def make_scorer(name: str, fields: dict, *, queries=None, last: int = 0, filters=None):
    """kvscore._kvscore_cuda.Scorer: the registry scorer `name` with ScorerArgs `fields` and host
    queries / filters (numpy or CPU torch; as kvscore._kvscore.make_scorer takes them)."""
    args = _kc.ScorerArgs()
    for k, v in fields.items():
        setattr(args, k, v)
    return _kc.make_scorer(name, args, queries, last, filters)


def _scores_shape(keys, batched: bool):
    s = tuple(keys.shape)
    if batched and len(s) == 4:
        return s[:3]
    return s[-3:-1]


def score(impl, keys, *, batched: bool = False):
    """float32 scores [kv_heads, tokens] (batched: [batch, kv_heads, tokens]) of CUDA keys."""
    require("keys", keys)
    k = keys.detach()
    nbytes = impl.workspace_bytes(k, batched)  # every check, before any allocation or launch
    out = _torch().empty(_scores_shape(k, batched), dtype=_torch().float32, device=k.device)
    impl.score(k, out, _scratch(nbytes, k.device), _stream(k), batched)
    return out


def check_finite_queries(queries, window: int) -> None:
    """The CPU SnapKV's check of its window queries (the last `window`), with its message: one
    reduction on the device and one synchronisation."""
    torch = _torch()
    q = queries.detach()
    q = q.reshape(-1, *q.shape[-3:]) if q.dim() == 4 else q[None]
    w = q[:, :, -window:] if window > 0 else q
    bad = (~torch.isfinite(w)).nonzero()  # one synchronisation
    if bad.shape[0] == 0:
        return
    b, h, i, j = (int(v) for v in bad[0])
    raise ValueError(f"kvscore::SnapKV: query value {float(w[b, h, i, j]):f} at [head {h}, query {i}, dim {j}] "
                     "is not finite")


def score_snapkv(keys, queries, window: int, kernel: int, placement: str, *, batched: bool = False):
    """SnapKV scores of CUDA keys from CUDA window queries (kvscore::cuda::DeviceSnapKV)."""
    require("keys", keys)
    _same_device("queries", queries, keys)
    k, q = keys.detach(), queries.detach()
    nbytes = _kc.snapkv_workspace_bytes(k, q, window, kernel, placement, batched)
    out = _torch().empty(_scores_shape(k, batched), dtype=_torch().float32, device=k.device)
    _kc.score_snapkv(k, q, window, kernel, placement, out, _scratch(nbytes, k.device), _stream(k), batched)
    return out


def snapkv_protected_recent(queries, window: int, kernel: int, placement: str, *, batched: bool = False) -> int:
    return _kc.snapkv_protected_recent(queries.detach(), window, kernel, placement, batched)


# ------------------------------------------------------------------ selection and compaction

def select_csr(scores, budget: int, *, sinks: int, recent: int, alloc: str, alpha: float, normalize: bool,
               threads: int, batch: int = 1):
    """(offsets int64 [rows + 1], positions int64, dense) on the scores' device: kvscore::cuda's
    select of `batch` layers of rows / batch heads each; dense when every row keeps the same count."""
    require("scores", scores)
    torch = _torch()
    s = scores.detach()
    nbytes, total, dense = _kc.select_plan(s, budget, sinks, recent, alloc, alpha, normalize, threads, batch)
    rows = s.shape[0]
    off = torch.empty(rows + 1, dtype=torch.int64, device=s.device)
    pos = torch.empty(total, dtype=torch.int64, device=s.device)
    _kc.select(s, budget, sinks, recent, alloc, alpha, normalize, threads, batch, off, pos,
               _scratch(nbytes, s.device), _stream(s))
    return off, pos, dense


def select(scores, budget: int, *, sinks: int, recent: int, alloc: str, alpha: float, normalize: bool,
           threads: int):
    """kvscore.select on CUDA scores: int64 [kv_heads, budget] (per-head), or a list of per-head
    int64 tensors (AdaKV: their counts are read back, one synchronisation), on the scores' device."""
    off, pos, dense = select_csr(scores, budget, sinks=sinks, recent=recent, alloc=alloc, alpha=alpha,
                                 normalize=normalize, threads=threads)
    rows = int(off.shape[0]) - 1
    if dense:
        return pos.view(rows, pos.shape[0] // rows if rows else 0)
    counts = off.diff().tolist()
    return list(pos.split(counts)) if rows else []


def _selection_csr(selection, keys):
    """(offsets, positions) of select()'s result on the keys' device: int64 [heads, n] or a list of 1-D."""
    torch = _torch()
    msg = "selection: expected an int64 array [heads, kept] or a list of 1-D int64 arrays (one per head)"
    if isinstance(selection, (list, tuple)):
        rows = list(selection)
        for r in rows:
            _same_device("selection", r, keys)
            if r.dtype != torch.int64 or r.dim() != 1:
                raise ValueError("selection: every entry of the list must be a 1-D int64 array of kept positions")
        pos = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64, device=keys.device)
        lengths = torch.tensor([0] + [int(r.shape[0]) for r in rows], dtype=torch.int64)
        return lengths.cumsum(0).to(keys.device), pos
    if not (type(selection).__module__.split(".")[0] == "torch") or selection.dim() != 2 \
            or selection.dtype != torch.int64:
        raise ValueError(msg)
    _same_device("selection", selection, keys)
    h, n = selection.shape
    return torch.arange(h + 1, dtype=torch.int64, device=keys.device) * n, selection.reshape(-1).contiguous()


def compact(keys, values, selection, *, tail: str, require_equal_lengths: bool):
    """kvscore.compact of CUDA keys and values in place; the kept length of each head."""
    require("keys", keys)
    _same_device("values", values, keys)
    off, pos = _selection_csr(selection, keys)
    return _kc.compact(keys.detach(), values.detach(), off, pos, tail, require_equal_lengths,
                       _scratch(_kc.selection_check_workspace_bytes(), keys.device), _stream(keys))


def bounds_view(t):
    """A numpy array with the shape, strides and address of a CUDA tensor, for numpy's exact
    overlap test (np.shares_memory reads only the bounds and strides, never the memory)."""
    import numpy as np

    class _Bounds:
        __array_interface__ = {"shape": tuple(t.shape), "typestr": f"<u{t.element_size()}",
                               "strides": tuple(s * t.element_size() for s in t.stride()),
                               "data": (t.data_ptr(), False), "version": 3}

    return np.asarray(_Bounds())
