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
any method. Every default is the registry's (include/kvscore/methods.hpp).
kvpress is optional for kvscore; this module needs it.
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
from kvscore import _kvscore as _k

# The registry's kinds and options (include/kvscore/methods.hpp), by canonical name.
_KIND = {m["name"]: m["kind"] for m in _kv.REGISTRY}
_OPTIONS = {m["name"]: m["options"] for m in _kv.REGISTRY}
#: Scorers built from the prompt's window queries: the registry's query scorers.
_QUERY_METHODS = tuple(n for n, k in _KIND.items() if k == "query_scorer")
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
    **method_options
        The method's options (see the module doc).

    Raises
    ------
    ValueError
        An unknown method, a ratio outside [0, 1), negative protection, missing Q-Filters; when
        compressing, StreamingLLM's sinks above the kept count (kvscore::StreamingLLM's rule;
        kvpress's StreamingLLMPress keeps part of its sinks there).
    """

    def __init__(self, method: str = _kv.ManifoldL2.name, compression_ratio: float = 0.0, *, sinks: int = 0,
                 recent: int = 0, threads: int = 0, **method_options):
        self.method = _kv.method_name(method)
        self.compression_ratio = compression_ratio
        self.sinks = _int(sinks, "sinks")
        self.recent = _int(recent, "recent")
        self.threads = _int(threads, "threads")
        self.method_options = dict(method_options)
        if self.sinks < 0 or self.recent < 0:
            raise ValueError(f"sinks {sinks} and recent {recent} must be >= 0")
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
        return (f"KvscorePress(method={self.method!r}, compression_ratio={self.compression_ratio}, "
                f"sinks={self.sinks}, recent={self.recent}, **{self.method_options!r})")

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

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        """kvscore's fp32 scores [batch, kv_heads, tokens] (higher = keep); zeros for a
        selection rule, which needs none."""
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
