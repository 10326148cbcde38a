"""kvpress-compatible presses backed by kvscore (docs/python.md).

    from kvscore.presses import KvscorePress
    press = KvscorePress(method="manifold_l2", compression_ratio=0.5)
    with press(model):
        model(input_ids, past_key_values=cache)        # prefill; every layer's cache is compressed

`KvscorePress` is a kvpress `ScorerPress`: `score()` returns kvscore's fp32 scores
[batch, kv_heads, tokens] (GQA handled by kvscore), and `compress()` keeps
`compute_n_kept(tokens, compression_ratio)` tokens per head (kvpress's count, ⌊(1−ρ)N⌋, at
least 1) chosen by `kvscore.select` — kvscore's tie rule (the lower position wins) and kept
positions in ascending order — so it works in kvpress's pipeline, `with press(model):`, and
inside kvpress wrappers (DecodingPress, PerLayerCompressionPress, ...).

Methods: every scorer and selection rule of the registry (kvscore.METHODS and its
StreamingLLM, by any spelling of kvscore.ALIASES); the method's options as keywords
(WindowedManifoldL2's window=, Q-Filters' filters=[layers, kv_heads, head_dim] in kvscore's
convention or filters_path= a published .safetensors file, SnapKV's and ProtoKV's window=
(the prompt's last `window` queries, recomputed like kvpress's SnapKVPress, window kept),
kernel= and ProtoKV's options, StreamingLLM's n_sink=). `sinks=` / `recent=` protect tokens for
any method. `alloc="adakv"` (`alpha=`, SelectOptions' default): kvscore's AdaKV allocation across
the heads of a layer, applied by masking as kvpress's AdaKVPress does. PerLayerPress: one
method per layer (PerLayerPress.from_report: a leak-free `kvscore eval` report's choice).
Every default is the registry's (include/kvscore/methods.hpp) or the option structs'.
kvpress is optional for kvscore; this module needs it.

A model on the GPU (CUDA keys) is compressed on the GPU when kvscore was built with its CUDA
module (KVSCORE_CUDA=1 pip install .; kvscore.cuda_available()): one kvscore::cuda call per
layer for the whole batch — scores, selection (per head or AdaKV, its mask built on the device)
and kvpress's gather — on torch's current stream, the window queries of SnapKV read where the
model left them; without the module, a CUDA cache is a ValueError naming that switch.
"""

from __future__ import annotations

try:
    import torch
    from kvpress.presses.decoding_press import DecodingPress
    from kvpress.presses.scorer_press import ScorerPress
    from kvpress.utils import compute_n_kept, get_prerope_query_states
except ImportError as e:  # pragma: no cover - exercised only without kvpress
    raise ImportError(
        f"kvscore.presses needs kvpress and torch (pip install kvpress): {e}. "
        "The rest of kvscore works without them.") from e

import numpy as _np

import kvscore as _kv
from kvscore import _cuda
from kvscore import _kvscore as _k

# The registry's kinds and options (include/kvscore/methods.hpp), by canonical name.
_KIND = {m["name"]: m["kind"] for m in _kv.REGISTRY}
_OPTIONS = {m["name"]: m["options"] for m in _kv.REGISTRY}
#: Scorers built from the prompt's window queries: the registry's query scorers.
_QUERY_METHODS = tuple(n for n, k in _KIND.items() if k == "query_scorer")
# kvscore::SelectOptions' defaults (alloc, alpha).
_SEL = _k.struct_defaults["SelectOptions"]
# kvpress's DecodingPress defaults, for the decoding variant's signature.
_DECODING = {f: DecodingPress.__dataclass_fields__[f].default
             for f in ("compression_interval", "target_size", "hidden_states_buffer_size")}


def _window_queries(module, hidden_states, window: int, position_embeddings):
    """Post-RoPE queries of the last `window` positions, [batch, q_heads, window, head_dim]
    (as kvpress's SnapKVPress.compute_window_attention computes them)."""
    q = get_prerope_query_states(module, hidden_states[:, -window:])
    if position_embeddings is not None:
        cos, sin = position_embeddings
        cos, sin = cos[:, -window:], sin[:, -window:]
        half = q.shape[-1] // 2
        rot = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        q = q * cos.unsqueeze(1) + rot * sin.unsqueeze(1)
    return q


def _int(x, name: str) -> int:
    """An integer option (a float is a TypeError, never truncated)."""
    return _kv._index(x, name)


class KvscorePress(ScorerPress):
    """A kvpress ScorerPress whose scores and selection come from kvscore (see the module doc).

    Parameters
    ----------
    method : str, optional
        A scorer or selection rule of the registry, by any spelling (default: ManifoldKV).
    compression_ratio : float, optional
        kvpress's ratio in [0, 1): each head keeps ``compute_n_kept(tokens, ratio)`` tokens.
    sinks, recent : int, optional
        Tokens always kept at the start and the end (StreamingLLM: its sinks, by default the
        registry's kDefaultSinks or ``n_sink=``).
    threads : int, optional
        kvscore's threads over heads (0 = OpenMP's default).
    alloc : {'per_head', 'adakv'}, optional
        'per_head': every head keeps ``compute_n_kept`` tokens (removed from the cache).
        'adakv': kvscore's AdaKV allocation across the layer's heads (select(alloc='adakv')),
        applied by masking as kvpress's AdaKVPress does; needs sdpa attention.
    alpha : float, optional
        AdaKV's safeguard share in [0, 1] (SelectOptions' default).
    **method_options
        The method's options (see the module doc).

    Raises
    ------
    ValueError
        An unknown method, a ratio outside [0, 1), negative protection, an unknown alloc or an
        alpha outside [0, 1], missing Q-Filters; when compressing, StreamingLLM's sinks above the
        kept count (kvscore::StreamingLLM's rule; kvpress's StreamingLLMPress keeps part of its
        sinks there).
    """

    def __init__(self, method: str = _kv.ManifoldL2.name, compression_ratio: float = 0.0, *, sinks: int = 0,
                 recent: int = 0, threads: int = 0, alloc: str = _SEL["alloc"], alpha: float = _SEL["alpha"],
                 **method_options):
        self.method = _kv.method_name(method)
        self.compression_ratio = compression_ratio
        self.sinks = _int(sinks, "sinks")
        self.recent = _int(recent, "recent")
        self.threads = _int(threads, "threads")
        self.alloc = str(alloc).replace("-", "_")
        self.alpha = float(alpha)
        self.method_options = dict(method_options)
        if self.sinks < 0 or self.recent < 0:
            raise ValueError(f"sinks {sinks} and recent {recent} must be >= 0")
        if self.alloc not in ("per_head", "adakv"):
            raise ValueError(f"alloc '{alloc}' must be 'per_head' or 'adakv'")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha {alpha} must be in [0, 1]")
        if not 0 <= compression_ratio < 1:
            raise ValueError(f"compression_ratio {compression_ratio} must be in [0, 1)")
        kind = _KIND[self.method]
        self._filters = None
        self._rule = None
        self._scorer = None
        if "filters" in _OPTIONS[self.method]:  # Q-Filters: one filter set per layer
            f = self.method_options.get("filters")
            path = self.method_options.get("filters_path")
            if (f is None) == (path is None):
                raise ValueError(f"method '{self.method}' needs exactly one of filters=[layers, kv_heads, head_dim] "
                                 "(kvscore convention) or filters_path=F.safetensors (published convention)")
            self._filters = f
        elif kind == "selection_rule":
            n_sink = self.method_options.pop("n_sink", _k.kDefaultSinks)
            self.sinks = self.sinks or _int(n_sink, "n_sink")
            self._rule = _kv.make_selection_rule(self.method, sinks=self.sinks)
        elif self.method in _QUERY_METHODS:
            w = _int(self.method_options.get("window", _k.kDefaultSnapKVWindow), "window")
            if w < 1:
                raise ValueError(f"window {w} must be >= 1")
        else:
            self._scorer = _kv.make_scorer(self.method, threads=self.threads, **self.method_options)
        self.__post_init__()

    def __repr__(self) -> str:
        alloc = f", alloc='adakv', alpha={self.alpha}" if self.alloc == "adakv" else ""
        return (f"KvscorePress(method={self.method!r}, compression_ratio={self.compression_ratio}, "
                f"sinks={self.sinks}, recent={self.recent}{alloc}, **{self.method_options!r})")

    # --- scoring
    def _scorer_for(self, module, hidden_states, kwargs, b: int):
        if self._scorer is not None:
            return self._scorer
        cls = _kv.METHODS[self.method]
        if "filters" in _OPTIONS[self.method]:
            layer = int(module.layer_idx)
            if self._filters is not None:
                f = self._filters[layer]
                f = f.detach().float().cpu().numpy() if torch.is_tensor(f) else _np.asarray(f, _np.float32)
                return cls(_np.ascontiguousarray(f), threads=self.threads)
            return cls.from_published(self.method_options["filters_path"], layer, threads=self.threads)
        opts = {k: v for k, v in self.method_options.items()}
        window = _int(opts.pop("window", _k.kDefaultSnapKVWindow), "window")
        if hidden_states.shape[1] <= window:
            raise ValueError(f"{self.method}: the prompt of {hidden_states.shape[1]} tokens must be longer than the "
                             f"window of {window} queries")
        q = _window_queries(module, hidden_states, window, kwargs.get("position_embeddings"))
        q = q[b].detach().float().cpu().contiguous()
        return cls(q, window, threads=self.threads, **opts)

    def _protected(self, scorer) -> int:
        return max(self.recent, getattr(scorer, "protected_recent", 0) if scorer is not None else 0)

    def _scores_cuda(self, module, hidden_states, keys, kwargs):
        """(fp32 scores [batch, kv_heads, tokens] on the keys' device, tokens to protect) of a
        CUDA cache: one kvscore::cuda call for the whole batch (ProtoKV: one per row, its host step)."""
        _cuda.require("keys", keys)
        if self._rule is not None:
            return torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device), 0
        if self._scorer is not None or "filters" in _OPTIONS[self.method]:
            sc = self._scorer_for(module, hidden_states, kwargs, 0)  # Q-Filters: the layer's (host) filters
            return _cuda.score(sc._on_cuda(keys), keys, batched=True), self._protected(sc)
        window = _int(self.method_options.get("window", _k.kDefaultSnapKVWindow), "window")
        if hidden_states.shape[1] <= window:
            raise ValueError(f"{self.method}: the prompt of {hidden_states.shape[1]} tokens must be longer than the "
                             f"window of {window} queries")
        q = _window_queries(module, hidden_states, window, kwargs.get("position_embeddings"))  # on the device
        opts = {k: v for k, v in self.method_options.items() if k != "window"}
        cls = _kv.METHODS[self.method]
        if cls is _kv.SnapKV:  # the batch's window queries read in place, one launch sequence
            sc = cls(q[0], window, threads=self.threads, **opts)  # its options and row 0's queries checked
            if q.shape[0] > 1:
                _cuda.check_finite_queries(q[1:], window)
            o = sc._options
            return (_cuda.score_snapkv(keys, q, o["window"], o["kernel"], o["placement"], batched=True),
                    self._protected(sc))
        rows = [cls(q[b], window, threads=self.threads, **opts) for b in range(keys.shape[0])]
        return torch.stack([sc.score(keys[b]) for b, sc in enumerate(rows)]), self._protected(rows[0])

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        """kvscore's fp32 scores [batch, kv_heads, tokens] (higher = keep); zeros for a
        selection rule, which needs none."""
        if _cuda.is_cuda(keys):
            return self._scores_cuda(module, hidden_states, keys, kwargs)[0]
        out = []
        for b in range(keys.shape[0]):
            if self._rule is not None:
                out.append(torch.zeros(keys.shape[1], keys.shape[2], dtype=torch.float32))
                continue
            sc = self._scorer_for(module, hidden_states, kwargs, b)
            out.append(sc.score(keys[b]))
        return torch.stack(out).to(keys.device)

    # --- selection with kvscore's tie rule, kept positions ascending
    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        bsz, heads, k_len, d = keys.shape
        n_kept = compute_n_kept(k_len, self.compression_ratio)
        if self.alloc == "adakv":
            return self._compress_adakv(module, hidden_states, keys, values, kwargs, n_kept)
        if _cuda.is_cuda(keys):
            idx = self._select_cuda(module, hidden_states, keys, kwargs, n_kept, "per_head")[1]
            idx = idx.view(bsz, heads, n_kept).unsqueeze(-1)
            return (keys.gather(2, idx.expand(-1, -1, -1, d)).contiguous(),
                    values.gather(2, idx.expand(-1, -1, -1, values.shape[-1])).contiguous())
        kept_k, kept_v = [], []
        for b in range(bsz):
            if self._rule is not None:
                idx = torch.from_numpy(self._rule.select(heads, k_len, n_kept))  # kvscore::StreamingLLM
            else:
                sc = self._scorer_for(module, hidden_states, kwargs, b)
                idx = _kv.select(sc.score(keys[b]), n_kept, sinks=self.sinks, recent=self._protected(sc))
            idx = idx.to(keys.device).unsqueeze(-1).expand(-1, -1, d)
            kept_k.append(keys[b].gather(1, idx))
            kept_v.append(values[b].gather(1, idx.expand(-1, -1, values.shape[-1])))
        return torch.stack(kept_k).contiguous(), torch.stack(kept_v).contiguous()

    def _compress_adakv(self, module, hidden_states, keys, values, kwargs, n_kept):
        """AdaKV allocation (kvscore.select(alloc="adakv"): per-head safeguard of ⌊alpha·n⌋
        tokens, the rest of the layer's n·kv_heads by one global top-k; sinks / recent protected).
        Heads keep different numbers of tokens, which a rectangular cache cannot hold, so, like
        kvpress's AdaKVPress, the evicted keys are masked (module.masked_key_indices, applied by
        kvpress's attention patch) instead of removed. A selection rule (StreamingLLM) masks the
        same way (its sinks + recent in every head), so that every layer of a PerLayerPress keeps
        the cache's length: transformers builds one causal mask for all layers."""
        if getattr(module.config, "_attn_implementation", None) == "eager":
            raise ValueError("alloc='adakv' masks through kvpress's attention patch, which eager attention "
                             "does not use: load the model with attn_implementation='sdpa'")
        bsz, heads, k_len, _ = keys.shape
        if _cuda.is_cuda(keys):  # the mask built on the device from kvscore::cuda's CSR selection
            off, pos = self._select_cuda(module, hidden_states, keys, kwargs, n_kept, "adakv")
            row = torch.repeat_interleave(torch.arange(bsz * heads, device=keys.device), off.diff(),
                                          output_size=pos.shape[0])
            keep = torch.zeros(bsz * heads * k_len, dtype=torch.bool, device=keys.device)
            keep[row * k_len + pos] = True
            module.masked_key_indices = (~keep.view(bsz, heads, k_len)).nonzero(as_tuple=True)
            return keys, values
        bi, hi, si = [], [], []
        for b in range(bsz):
            keep = torch.zeros(heads, k_len, dtype=torch.bool)
            if self._rule is not None:
                # kvscore::StreamingLLM's tokens in every head, masked too: every layer of a mix
                # keeps its length
                idx = torch.from_numpy(self._rule.select(heads, k_len, n_kept))
                keep.scatter_(1, idx, True)
            else:
                sc = self._scorer_for(module, hidden_states, kwargs, b)
                sel = _kv.select(sc.score(keys[b]), n_kept, sinks=self.sinks, recent=self._protected(sc),
                                 alloc="adakv", alpha=self.alpha)
                for h, idx in enumerate(sel):
                    keep[h, idx] = True
            h_idx, s_idx = (~keep).nonzero(as_tuple=True)
            bi.append(torch.full_like(h_idx, b))
            hi.append(h_idx)
            si.append(s_idx)
        dev = keys.device
        module.masked_key_indices = (torch.cat(bi).to(dev), torch.cat(hi).to(dev), torch.cat(si).to(dev))
        return keys, values

    def _select_cuda(self, module, hidden_states, keys, kwargs, n_kept, alloc):
        """(offsets [batch*kv_heads + 1], positions) of kvscore::cuda's selection of a CUDA cache:
        `alloc` 'per_head' (n_kept per head) or 'adakv' (per layer of each batch row); a
        selection rule's positions (the same in every head and row) uploaded."""
        bsz, heads, k_len, _ = keys.shape
        if self._rule is not None:
            idx = torch.from_numpy(self._rule.select(heads, k_len, n_kept)).to(keys.device)  # kvscore::StreamingLLM
            pos = idx.reshape(1, -1).expand(bsz, -1).reshape(-1)
            off = torch.arange(bsz * heads + 1, dtype=torch.int64, device=keys.device) * n_kept
            return off, pos
        scores, protect = self._scores_cuda(module, hidden_states, keys, kwargs)
        off, pos, _ = _cuda.select_csr(scores.view(bsz * heads, k_len), n_kept, sinks=self.sinks, recent=protect,
                                       alloc=alloc, alpha=self.alpha, normalize=False, threads=self.threads, batch=bsz)
        return off, pos


class ManifoldKVPress(KvscorePress):
    """ManifoldKV (L2 distance to the head's key centroid), which kvpress lacks."""

    def __init__(self, compression_ratio: float = 0.0, **options):
        super().__init__(_kv.ManifoldL2.name, compression_ratio, **options)


class WindowedManifoldKVPress(KvscorePress):
    """Windowed ManifoldKV (L2 to the centroid of the key's window), which kvpress lacks."""

    def __init__(self, compression_ratio: float = 0.0, window: int = _k.kDefaultWindow, **options):
        super().__init__(_kv.WindowedManifoldL2.name, compression_ratio, window=window, **options)


class ProtoKVPress(KvscorePress):
    """ProtoKV (prototype clusters scored by the prompt's last `window` queries), which kvpress lacks."""

    def __init__(self, compression_ratio: float = 0.0, window: int = _k.kDefaultSnapKVWindow, **options):
        super().__init__(_kv.ProtoKV.name, compression_ratio, window=window, **options)


class KvscoreDecodingPress(DecodingPress):
    """The decoding variant: every `compression_interval` generated tokens, compress each layer's
    cache back to `target_size` tokens with a kvscore method (kvpress's DecodingPress around a
    KvscorePress, with DecodingPress's defaults)."""

    def __init__(self, method: str = _kv.ManifoldL2.name, compression_interval: int = _DECODING["compression_interval"],
                 target_size: int = _DECODING["target_size"],
                 hidden_states_buffer_size: int = _DECODING["hidden_states_buffer_size"], **options):
        super().__init__(base_press=KvscorePress(method, 0.0, **options), compression_interval=compression_interval,
                         target_size=target_size, hidden_states_buffer_size=hidden_states_buffer_size)


class PerLayerPress(KvscorePress):
    """A per-layer mix of kvscore methods: layer l is compressed by `methods[l]` (a list, one
    method per layer), or, with a dict {keep fraction: [method per layer]}, by the list whose
    keep is nearest to 1 - compression_ratio (ties: the larger keep). Each method runs as a
    KvscorePress with the shared options (sinks, recent, alloc, alpha, filters= for Q-Filters,
    window= for the query scorers, SnapKV and ProtoKV). PerLayerPress.from_report() builds it
    from a leak-free `kvscore eval` report (its per_layer_best: the best press-able method per
    layer at each keep)."""

    def __init__(self, methods, compression_ratio: float = 0.0, *, sinks: int = 0, recent: int = 0,
                 threads: int = 0, window: int = _k.kDefaultSnapKVWindow, filters=None, **options):
        if isinstance(methods, dict):
            plans = {float(k): list(v) for k, v in methods.items()}
        else:
            plans = {None: list(methods)}
        if not plans or any(not v for v in plans.values()):
            raise ValueError("PerLayerPress: methods must be a non-empty list (one method per layer) or a dict "
                             "{keep: [method per layer]}")
        n = {len(v) for v in plans.values()}
        if len(n) != 1:
            raise ValueError(f"PerLayerPress: every plan must cover the same layers (got lengths {sorted(n)})")
        canon = {m: _kv.method_name(m) for v in plans.values() for m in v}  # ValueError for an unknown name
        calibrated = sorted({c for c in canon.values() if "filters" in _OPTIONS[c]})
        if calibrated and filters is None:
            raise ValueError(f"PerLayerPress: a layer uses {', '.join(calibrated)}: give filters=[layers, kv_heads, "
                             "head_dim]")
        self.plans = {k: [canon[m] for m in v] for k, v in plans.items()}
        self._shared = dict(sinks=sinks, recent=recent, threads=threads, **options)
        self._window, self._filters_all = _int(window, "window"), filters
        self._subs = {}
        # the parent's options stay neutral: compress() hands each layer to its method's press
        super().__init__(_kv.KNorm.name, compression_ratio, sinks=sinks, recent=recent, threads=threads)

    def __repr__(self) -> str:
        return f"PerLayerPress(plans={self.plans!r}, compression_ratio={self.compression_ratio})"

    @classmethod
    def from_report(cls, report, compression_ratio: float = 0.0, *, allow_shared: bool = False, **options):
        """From a `kvscore eval` report (a dict, or the path of its JSON) made under the
        leak-free protocol: {keep: methods} of its per_layer_best, and by default the report's
        own selection options (sinks, recent, alloc: the choice was made with them). A
        shared-protocol report is a ValueError unless allow_shared (there the query-aware
        methods saw the evaluation queries and win the choice for that reason)."""
        if not isinstance(report, dict):
            import json
            import pathlib

            report = json.loads(pathlib.Path(report).read_text())
        ropt = report.get("options", {})
        options.setdefault("sinks", int(ropt.get("sinks", 0)))
        options.setdefault("recent", int(ropt.get("recent", 0)))
        options.setdefault("alloc", str(ropt.get("alloc", _SEL["alloc"])).replace("-", "_"))
        protocol = ropt.get("protocol", "shared")
        if protocol != "leak-free" and not allow_shared:
            raise ValueError(f"PerLayerPress.from_report: the report's protocol is '{protocol}'; choose per layer on a "
                             "leak-free report (kvscore eval --dump DIR of a dump_kv.py --following dump)")
        best = report.get("per_layer_best") or []
        if not best:
            raise ValueError("PerLayerPress.from_report: the report has no per_layer_best (no press-able method ran)")
        return cls({b["keep"]: b["methods"] for b in best}, compression_ratio, **options)

    def plan(self):
        """The methods per layer used at this compression ratio."""
        if None in self.plans:
            return self.plans[None]
        keep = 1.0 - self.compression_ratio
        k = min(self.plans, key=lambda x: (abs(x - keep), -x))
        return self.plans[k]

    def _sub(self, method: str) -> KvscorePress:
        p = self._subs.get(method)
        if p is None:
            opts = dict(self._shared)
            if "filters" in _OPTIONS[method]:
                opts["filters"] = self._filters_all
            elif method in _QUERY_METHODS:
                opts["window"] = self._window
            p = self._subs[method] = KvscorePress(method, 0.0, **opts)
        p.compression_ratio = self.compression_ratio
        return p

    def _layer_press(self, module) -> KvscorePress:
        plan = self.plan()
        layer = int(module.layer_idx)
        if not 0 <= layer < len(plan):
            raise ValueError(f"PerLayerPress: layer {layer} has no method (the plan covers {len(plan)} layers)")
        return self._sub(plan[layer])

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return self._layer_press(module).score(module, hidden_states, keys, values, attentions, kwargs)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        return self._layer_press(module).compress(module, hidden_states, keys, values, attentions, kwargs)
