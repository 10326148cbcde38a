"""kvpress-compatible presses backed by kvscore (docs/reference/python.md).

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
KVzip (method "kvzip", or KVzipPress with kvpress's KVzipPress defaults) scores in a pass of its
own after the prefill: the model reconstructs the context from the cache and each context token is
scored by the attention it receives (kvscore::KVzip::score_span); see KvscorePress's kvzip options
and docs/methods/kvzip.md.
Every default is the registry's (include/kvscore/methods.hpp) or the option structs'.
kvpress is optional for kvscore; this module needs it.

A model on the GPU (CUDA keys) is compressed on the GPU when kvscore was built with its CUDA
module (KVSCORE_CUDA=1 pip install .; kvscore.cuda_available()): one kvscore::cuda call per
layer for the whole batch — scores, selection (per head or AdaKV, its mask built on the device)
and kvpress's gather — on torch's current stream, the window queries of SnapKV read where the
model left them; without the module, a CUDA cache is a ValueError naming that switch.
"""

from __future__ import annotations

import contextlib as _contextlib
import weakref as _weakref

try:
    import torch
    from kvpress.presses.decoding_press import DecodingPress
    from kvpress.presses.scorer_press import ScorerPress
    from kvpress.utils import compute_n_kept, get_prerope_query_states  # noqa: F401 (kvzip uses both)
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
        The method's options (see the module doc). KVzip ("kvzip"; docs/methods/kvzip.md): ``chunk_size``
        (context tokens per reconstruction pass, the registry's kDefaultKVzipChunk), ``kvzip_plus``
        (KVzip+'s normalization), ``layerwise`` (alloc='adakv' per layer instead of one top-k over
        every layer and head), ``tokenizer`` (the model's; default: AutoTokenizer of the model's name,
        as kvpress), ``score_prefix`` (score the chat template's prefix too), ``fused`` (default True:
        on CPU the pass's attention and the scores come from one set of logits,
        KVzip.attend_span, where the model allows it; False: the model's own attention, then
        score_span). ``sinks`` are then also
        the reconstruction's softmax sinks (kvpress's n_sink); alloc 'joint' keeps one set of
        positions for every head and layer (select_joint).

    Raises
    ------
    ValueError
        An unknown method, a ratio outside [0, 1), negative protection, an unknown alloc or an
        alpha outside [0, 1], missing Q-Filters; when compressing, StreamingLLM's sinks above the
        kept count (kvscore::StreamingLLM's rule; kvpress's StreamingLLMPress keeps part of its
        sinks there).
    """

    def __init__(self, method: str = _kv.ManifoldL2.name, compression_ratio: float = 0.0, *, sinks: int = 0,
                 recent: int = 0, threads: int = 0, alloc: _kv.Alloc = _SEL["alloc"], alpha: float = _SEL["alpha"],
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
        if self.alloc not in ("per_head", "adakv") and not (self.alloc == "joint" and self.method == _KVZIP):
            raise ValueError(f"alloc '{alloc}' must be 'per_head' or 'adakv'" +
                             (" or 'joint'" if self.method == _KVZIP else ""))
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha {alpha} must be in [0, 1]")
        if not 0 <= compression_ratio < 1:
            raise ValueError(f"compression_ratio {compression_ratio} must be in [0, 1)")
        kind = _KIND[self.method]
        self._filters = None
        self._rule = None
        self._scorer = None
        self._kvzip = None
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
        elif self.method == _KVZIP:
            self._kvzip = _kvzip_options(self.method_options)
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

    def __call__(self, model):
        """kvpress's context manager (`with press(model): model.model(context_ids, past_key_values=cache)`);
        for KVzip, the prefill runs untouched and the reconstruction pass, scoring and eviction follow it."""
        if self._kvzip is not None:
            return _kvzip_context(self, model)
        return super().__call__(model)

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
        if self._kvzip is not None:
            raise ValueError(f"{self.method} scores in a reconstruction pass after the prefill, not per layer: use the "
                             "press as kvpress does, `with press(model): model.model(input_ids=..., past_key_values=cache)`")
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


# ------------------------------------------------------------------ KVzip: scoring by context reconstruction

_KVZIP = _kv.KVzip.name
#: The registry's KVzip defaults (kvpress KVzipPress's): context tokens reconstructed per pass, the
#: last tokens of the previous chunk a later pass's prompt repeats, and the two prompts.
KVZIP_CHUNK_SIZE = _k.kDefaultKVzipChunk
KVZIP_PREV_POSTFIX = _k.kDefaultKVzipRepeat
KVZIP_PROMPT_FIRST = _k.kKVzipPromptFirst
KVZIP_PROMPT_NEXT = _k.kKVzipPromptNext


def _kvzip_options(opts: dict) -> dict:
    """KVzip's options out of KvscorePress's method options (ValueError / TypeError naming them)."""
    o = {"chunk_size": opts.pop("chunk_size", KVZIP_CHUNK_SIZE), "plus": bool(opts.pop("kvzip_plus", False)),
         "layerwise": bool(opts.pop("layerwise", False)), "tokenizer": opts.pop("tokenizer", None),
         "score_prefix": bool(opts.pop("score_prefix", False)), "fused": bool(opts.pop("fused", True))}
    o["chunk_size"] = _int(o["chunk_size"], "chunk_size")
    if o["chunk_size"] < 1:
        raise ValueError(f"{_KVZIP}: chunk_size {o['chunk_size']} must be >= 1 (context tokens reconstructed per "
                         "pass)")
    if opts:
        raise ValueError(f"{_KVZIP}: unknown option(s) {sorted(opts)} ({_KVZIP} takes chunk_size, kvzip_plus, "
                         "layerwise, tokenizer, score_prefix, fused and KvscorePress's sinks, recent, alloc, alpha, "
                         "threads)")
    return o


def kvzip_template(tokenizer):
    """(prefix_length, suffix_ids) of the tokenizer's chat template, as kvpress's KVzipPress finds them:
    the user turn's opening tokens before the context and the tokens after it up to the assistant's
    turn ("\\n" without a chat template)."""
    if tokenizer.chat_template is None:
        prefix_text, suffix_text = "", "\n"
    else:
        dummy = "dummy context"
        sep = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + sep}], add_generation_prompt=True,
                                             tokenize=False, enable_thinking=False)
        context, suffix_text = text.split(sep)
        prefix_text = context.split(dummy)[0]
    prefix = tokenizer.encode(prefix_text, return_tensors="pt", add_special_tokens=False).shape[-1]
    return prefix, tokenizer.encode(suffix_text, return_tensors="pt", add_special_tokens=False)


def kvzip_passes(tokenizer, context_ids, prefix_length: int, chunk_size: int, suffix_ids):
    """The reconstruction passes of a context [1, n] (kvpress KVzipPress.prepare): per chunk of at most
    chunk_size tokens after the prefix, (begin, end, input ids) with input ids = the prompt ("Repeat the
    previous context exactly." for the first chunk, "... the part ... starting with" + the previous chunk's
    last 8 tokens for the others) + the chat template's suffix + the chunk."""
    ctx = context_ids[:, prefix_length:].cpu()
    first = tokenizer.encode(KVZIP_PROMPT_FIRST, return_tensors="pt", add_special_tokens=False)
    nxt = tokenizer.encode(KVZIP_PROMPT_NEXT, return_tensors="pt", add_special_tokens=False)
    out, prev = [], None
    for b in range(0, ctx.shape[1], chunk_size):
        a = ctx[:, b:b + chunk_size]
        q = first if prev is None else torch.cat([nxt, prev[:, -KVZIP_PREV_POSTFIX:]], 1)
        out.append((prefix_length + b, prefix_length + b + a.shape[1], torch.cat([q, suffix_ids, a], 1)))
        prev = a
    return out


def _rope(q, position_embeddings):
    """q [b, heads, n, d] rotated as Llama's apply_rotary_pos_emb."""
    cos, sin = position_embeddings
    half = q.shape[-1] // 2
    rot = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return q * cos.unsqueeze(1) + rot * sin.unsqueeze(1)


#: o_proj (the module: tensors compare elementwise) -> (its weight's storage and version, the fp32
#: Gram matrices W_gᵀ W_g): made once per weight, not per pass.
_GRAMS = _weakref.WeakKeyDictionary()


def _wov_norms(module, values):
    """||W_O^{(g)} v_t|| [q_heads, n] for values [kv_heads, n, d] (KVzip+): the signal each value writes
    into the residual stream through query head g's block of o_proj, from the Gram matrices
    W_gᵀ W_g (d × d per query head, summed in fp64 once per weight, kept in fp32) instead of the
    [n, hidden] products; the quadratic forms vᵀ G v in fp32, as kvpress computes the products."""
    cfg = module.config
    kv, qh, d = cfg.num_key_value_heads, cfg.num_attention_heads, module.head_dim
    weight = module.o_proj.weight
    key = (weight.data_ptr(), weight._version)
    hit = _GRAMS.get(module.o_proj)
    if hit is None or hit[0] != key:
        w = weight.detach().double().view(-1, qh, d)                    # [hidden, q_heads, d]
        hit = (key, torch.einsum("jgi,jgk->gik", w, w).float())         # [q_heads, d, d]
        _GRAMS[module.o_proj] = hit
    gram = hit[1].to(values.device)
    v = values.detach().float().repeat_interleave(qh // kv, dim=0)      # [q_heads, n, d]
    sq = (torch.bmm(v, gram) * v).sum(-1)
    return sq.clamp_min(0).sqrt()


@_contextlib.contextmanager
def _kvzip_context(press, model):
    """KvscorePress("kvzip") around the pipeline's prefill: remember the context ids and the cache,
    let the prefill run, then reconstruct, score and evict (_kvzip_compress)."""
    lm = model.model
    seen = {}
    original = lm.forward

    def forward(*args, **kwargs):
        seen["ids"], seen["cache"] = kwargs.get("input_ids"), kwargs.get("past_key_values")
        return original(*args, **kwargs)

    lm.forward = forward
    try:
        yield
    finally:
        lm.forward = original
    if press.compression_ratio > 0 and seen.get("ids") is not None:
        _kvzip_compress(press, model, seen["ids"], seen["cache"])


def _kvzip_tokenizer(press, model):
    tok = press._kvzip["tokenizer"]
    if tok is None:  # as kvpress's KVzipPress: the model's own tokenizer files
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model.config.name_or_path)
    return tok


def kvzip_scores(press, model, context_ids, cache, timings=None):
    """KVzip's scores [layers, kv_heads, n] (fp32) of the context in `cache` (its first n =
    context_ids.shape[1] rows per layer): the reconstruction passes run through the model with the
    cache, and in each attention layer's forward hook kvscore::KVzip::score_span scores the pass's
    chunk by the attention it receives from the pass's post-RoPE queries (captured from q_proj's
    output, not recomputed); the pass's own rows are then cut from the cache. Positions before the
    chunks (the chat template's prefix) keep 0, as in kvpress, unless score_prefix. timings: a dict that receives
    the seconds of the passes ("forward", hooks included) and of the hooks' work ("scoring").
    score_prefix: the first pass scores the prefix's tokens after the sinks too (the same passes; the
    prefix then joins that pass's softmax), so they compete instead of going first."""
    import time

    o = press._kvzip
    tok = _kvzip_tokenizer(press, model)
    n = int(context_ids.shape[1])
    prefix, suffix = kvzip_template(tok)
    passes = kvzip_passes(tok, context_ids, prefix, o["chunk_size"], suffix)
    if passes and o["score_prefix"]:  # the first pass also scores the template's prefix after the sinks
        passes[0] = (min(press.sinks, prefix), *passes[0][1:])
    if not passes:
        raise ValueError(f"{_KVZIP}: the context of {n} tokens has nothing after the chat template's {prefix}-token "
                         "prefix to reconstruct")
    lm = model.model
    longest = max(ids.shape[1] for _, _, ids in passes)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and n + longest > limit:
        raise ValueError(f"{_KVZIP}: the context of {n} tokens and a reconstruction pass of {longest} leave no room in "
                         f"the model's {limit} positions (use a smaller chunk_size, {o['chunk_size']} now)")
    layers = list(lm.layers)
    kv = model.config.num_key_value_heads
    scores = torch.zeros(len(layers), kv, n, dtype=torch.float32)
    state = {"span": (0, 0), "q": {}, "t": 0.0, "n": n, "scores": scores, "press": press, "qw": {}}
    fused = o["fused"] and _fusable(model, cache)

    def q_hook(module, args, output):
        state["q"][module] = output

    def pre_hook(module, args, kwargs):  # KVzip+'s 1/||h_i|| for the fused attention, before it runs
        state["qw"][module] = (1.0 / kwargs["hidden_states"][0].float().norm(dim=-1)).contiguous()

    def attn_hook(module, args, kwargs, output):
        t0 = time.perf_counter()
        hs = kwargs["hidden_states"]
        cache_layer = kwargs["past_key_values"].layers[module.layer_idx]
        keys, values = cache_layer.keys, cache_layer.values
        if fused:  # scored inside the attention (_fused_attention): only the pass's rows to cut
            cache_layer.keys, cache_layer.values = keys[:, :, :n], values[:, :, :n]
            state["t"] += time.perf_counter() - t0
            return output
        m = hs.shape[1]
        q = state["q"].pop(module.q_proj, None)
        if q is None:
            q = get_prerope_query_states(module, hs)
        else:
            q = q.view(hs.shape[0], m, -1, module.head_dim).transpose(1, 2)
            if hasattr(module, "q_norm"):  # Qwen3 / Gemma3: the norm before RoPE, as kvpress
                q = module.q_norm(q)
        q = _rope(q, kwargs["position_embeddings"])[0].float().contiguous()
        b, e = state["span"]
        qw = kw = None
        if o["plus"]:
            qw = (1.0 / hs[0].float().norm(dim=-1)).contiguous()
            kw = _wov_norms(module, values[0, :, b:e])
        if keys.device.type != "cpu":  # score_span runs on the host: the layer's keys copied there
            keys_h, q, qw, kw = keys[0].cpu(), q.cpu(), None if qw is None else qw.cpu(), None if kw is None else kw.cpu()
        else:
            keys_h = keys[0]
        _kv.KVzip.score_span(keys_h[:, :n], keys_h[:, n:], q, scores[module.layer_idx], b, e,
                             sinks=press.sinks, query_weights=qw, key_weights=kw, threads=press.threads)
        cache_layer.keys, cache_layer.values = keys[:, :, :n], values[:, :, :n]
        state["t"] += time.perf_counter() - t0
        return output

    hooks = []
    attn_impl = model.config._attn_implementation
    try:
        for layer in layers:
            attn = layer.self_attn
            if fused:
                attn._kvscore_kvzip = state
                if o["plus"]:
                    hooks.append(attn.register_forward_pre_hook(pre_hook, with_kwargs=True))
            elif hasattr(attn, "q_proj"):
                hooks.append(attn.q_proj.register_forward_hook(q_hook))
            hooks.append(attn.register_forward_hook(attn_hook, with_kwargs=True))
        if fused:
            model.config._attn_implementation = _FUSED_ATTENTION
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b, e, ids in passes:
                state["span"] = (b, e)
                lm(input_ids=ids.to(context_ids.device), past_key_values=cache)
        if timings is not None:
            timings["forward"] = time.perf_counter() - t0
            timings["scoring"] = state["t"]
            timings["fused"] = fused
    finally:
        for h in hooks:
            h.remove()
        if fused:
            model.config._attn_implementation = attn_impl
            for layer in layers:
                layer.self_attn.__dict__.pop("_kvscore_kvzip", None)
    return scores


#: The attention implementation kvzip_scores names for its passes when fused (registered in
#: transformers' AttentionInterface; no mask function: the pass's causal mask is built in).
_FUSED_ATTENTION = "kvscore_kvzip_pass"


def _fusable(model, cache) -> bool:
    """Whether the pass's attention can be kvscore's (KVzip.attend_span): a CPU cache, transformers'
    attention interface, the plain softmax(q·k/√d) of every layer (no sliding window, no soft-capping,
    no other scaling)."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    cfg = model.config
    if getattr(cfg, "sliding_window", None) or getattr(cfg, "attn_logit_softcapping", None):
        return False
    for layer in model.model.layers:
        a = getattr(layer, "self_attn", None)
        if a is None or not hasattr(a, "scaling") or not hasattr(a, "head_dim") or not hasattr(a, "layer_idx"):
            return False
        if abs(float(a.scaling) - float(a.head_dim) ** -0.5) > 1e-6 * float(a.head_dim) ** -0.5:
            return False
    layers = getattr(cache, "layers", None)
    if not layers or getattr(layers[0], "keys", None) is None or layers[0].keys.device.type != "cpu":
        return False
    if _FUSED_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(_FUSED_ATTENTION, _fused_attention)
    return True


def _fused_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The reconstruction pass's attention (kvzip_scores, fused): the output and the KVzip scores
    of the layer from one set of logits (KVzip.attend_span). query [1, q_heads, m, d] post-RoPE;
    key / value [1, kv_heads, n + m, d]: the context's n rows, then the pass's own."""
    import time

    t0 = time.perf_counter()
    st = module._kvscore_kvzip
    press, n = st["press"], st["n"]
    b, e = st["span"]
    q, k, v = query[0], key[0], value[0]
    qw = st["qw"].pop(module, None) if press._kvzip["plus"] else None
    kw = _wov_norms(module, v[:, b:e]) if press._kvzip["plus"] else None
    out = torch.empty(q.shape[1], q.shape[0], v.shape[-1], dtype=torch.float32)
    _kv.KVzip.attend_span(k[:, :n], k[:, n:], v[:, :n], v[:, n:], q, st["scores"][module.layer_idx], out, b, e,
                          sinks=press.sinks, query_weights=qw, key_weights=kw, threads=press.threads)
    st["t"] += time.perf_counter() - t0
    return out.to(query.dtype).unsqueeze(0), None


def kvzip_select(press, scores):
    """The kept positions of KVzip scores [layers, kv_heads, n] under the press's allocation: per layer
    a list of kv_heads int64 arrays (ascending). alloc='adakv': one top-k over every layer and head
    (kvpress's KVzipPress; per layer with layerwise=True) keeping total - int(total * ratio), each head
    at least floor(alpha * budget / heads) and its sinks / recent; 'per_head': every head of every layer
    keeps compute_n_kept(n, ratio); 'joint': the same compute_n_kept(n, ratio) positions in every head
    and layer (kvscore.select_joint: what llama.cpp's cells allow)."""
    L, H, n = scores.shape
    if press.alloc == "joint":  # one set of positions for every head and layer (llama.cpp's cells)
        k = compute_n_kept(n, press.compression_ratio)
        idx = _kv.select_joint(scores, k, sinks=press.sinks, recent=press.recent, threads=press.threads)
        return [[idx] * H for _ in range(L)]
    if press.alloc == "per_head":
        k = compute_n_kept(n, press.compression_ratio)
        return [list(_kv.select(scores[i], k, sinks=press.sinks, recent=press.recent)) for i in range(L)]
    if press._kvzip["layerwise"]:
        total = H * n - int(H * n * press.compression_ratio)
        return [_k.select_total(scores[i].numpy(), total, sinks=press.sinks, recent=press.recent, alpha=press.alpha)
                for i in range(L)]
    total = L * H * n - int(L * H * n * press.compression_ratio)
    rows = _k.select_total(scores.reshape(L * H, n).numpy(), total, sinks=press.sinks, recent=press.recent,
                           alpha=press.alpha)
    return [rows[i * H:(i + 1) * H] for i in range(L)]


def kvzip_apply(press, model, cache, kept):
    """Evict all but `kept` (kvzip_select): alloc='adakv' masks the others (module.masked_key_indices,
    kvpress's attention patch, the cache keeps its length, as KVzipPress); 'per_head' and 'joint' remove
    them from the cache (every head keeps the same count)."""
    for i, layer in enumerate(model.model.layers):
        layer_cache = cache.layers[i]
        n = layer_cache.keys.shape[2]
        if press.alloc in ("per_head", "joint"):
            idx = torch.stack([torch.as_tensor(x) for x in kept[i]]).to(layer_cache.keys.device)
            g = idx.unsqueeze(0).unsqueeze(-1)
            layer_cache.keys = layer_cache.keys.gather(2, g.expand(-1, -1, -1, layer_cache.keys.shape[-1])).contiguous()
            layer_cache.values = layer_cache.values.gather(2, g.expand(-1, -1, -1, layer_cache.values.shape[-1])).contiguous()
            continue
        keep = torch.zeros(len(kept[i]), n, dtype=torch.bool)
        for h, idx in enumerate(kept[i]):
            keep[h, torch.as_tensor(idx)] = True
        h_idx, s_idx = (~keep).nonzero(as_tuple=True)
        dev = layer_cache.keys.device
        layer.self_attn.masked_key_indices = (torch.zeros_like(h_idx).to(dev), h_idx.to(dev), s_idx.to(dev))


def _kvzip_compress(press, model, context_ids, cache):
    if press.alloc == "adakv" and getattr(model.config, "_attn_implementation", None) == "eager":
        raise ValueError(f"{_KVZIP} with alloc='adakv' masks through kvpress's attention patch, which eager "
                         "attention does not use: load the model with attn_implementation='sdpa' (or alloc='per_head')")
    if context_ids.shape[0] != 1:
        raise ValueError(f"{_KVZIP}: batch {context_ids.shape[0]} must be 1 (as kvpress's KVzipPress)")
    scores = kvzip_scores(press, model, context_ids, cache)
    kvzip_apply(press, model, cache, kvzip_select(press, scores))


class KVzipPress(KvscorePress):
    """KVzip with kvpress KVzipPress's defaults (4 sinks, one top-k over every layer and head, no
    safeguard, chunks of 2048): its kept rows equal kvpress's at fp32 (python/tests/test_kvzip.py).
    kvzip_plus=True is KVzip+'s normalization; any KvscorePress option changes the rest."""

    def __init__(self, compression_ratio: float = 0.0, *, kvzip_plus: bool = False, layerwise: bool = False,
                 chunk_size: int = KVZIP_CHUNK_SIZE, sinks: int = _k.kDefaultSinks, alloc: _kv.Alloc = "adakv",
                 alpha: float = 0.0, **options):
        super().__init__(_KVZIP, compression_ratio, kvzip_plus=kvzip_plus, layerwise=layerwise, chunk_size=chunk_size,
                         sinks=sinks, alloc=alloc, alpha=alpha, **options)
