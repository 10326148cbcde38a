"""Per-query retrieval and OjaKV's low-rank store inside Hugging Face ``generate`` (docs/guides/generation.md).

    import kvscore.generation as kg
    cache = kg.RetrievalCache(model, method="pariskv", attend=0.1, sinks=4, local=64)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
    cache = kg.OjaKVCache(model, rank=16, anchors=0.2)          # half the K/V memory at head_dim 64

Both are ``transformers.Cache`` subclasses. The prompt (the first forward through the cache)
runs the model's own attention (sdpa or eager) over the exact keys and values; the layer's
C++ cache is built from them, and the torch copies are dropped. Every later forward (a decode
step, or a chunk such as a question after a context) runs token by token inside one C++ call
per layer: the token's keys and values join the cache, then each query head attends:

- ``RetrievalCache``: to the first ``sinks`` tokens, the ``k`` keys of its KV head that the
  retriever finds for *this* query (``method="pariskv"``: ParisKV's index; ``"exact"``: the
  exact top k by q·k, the ceiling the index approximates) and the last ``local`` tokens
  (kvscore::ParisKVLayerCache; the index is updated as tokens leave the local window). Nothing is
  evicted: memory stays the full cache (plus the index); what shrinks is the keys read per step.
  Below ``dense_below`` tokens (default: the measured crossover for the head_dim) a step
  attends every key instead, each KV head read once for its query heads: faster there.
- ``OjaKVCache``: to OjaKV's hybrid store, low-rank codes in bases that Oja's rule keeps adapted
  plus full-rank anchors (kvscore::OjaLayerCache, the low-rank attention kernel of ojakv.txt
  A.4). Memory shrinks; every token is attended.

The model's attention implementation is switched to a kvscore wrapper of the one it had
("kvscore_sdpa" or "kvscore_eager", registered with transformers' AttentionInterface and
AttentionMaskInterface): for any cache that is not a kvscore cache it *is* the original function
with the original mask, so the model behaves as before with a DynamicCache.

``attend`` (RetrievalCache): the keys attended per step as a fraction of the prompt's length
(float in (0, 1]), or their number (int >= 1); sinks + k + local = that budget. ``attend=1.0``
attends every key through the model's own dense attention: the tokens are a DynamicCache's,
exactly. Models the caches cannot serve are refused with the reason (no RoPE'd keys reachable
through the attention interface, sliding-window or chunked layers, logit soft-capping,
encoder-decoder models, another attention implementation than sdpa/eager); padded batches too.

kvpress's pipeline takes either cache (``pipe(context, question=q, cache=RetrievalCache(...))``):
while the C++ cache holds a layer, its ``keys`` / ``values`` read a stand-in whose only index is
``[:, :, :n]``, and assigning that back (the pipeline's way to drop an answer) is ``crop(n)``.
"""

from __future__ import annotations

import operator as _operator
import sys as _sys
import weakref as _weakref

import numpy as _np
import torch as _torch
from transformers import AttentionInterface as _AttentionInterface
from transformers.cache_utils import Cache as _Cache
from transformers.cache_utils import CacheLayerMixin as _CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward as _sdpa_forward
from transformers.masking_utils import AttentionMaskInterface as _AttentionMaskInterface
from transformers.masking_utils import eager_mask as _eager_mask
from transformers.masking_utils import sdpa_mask as _sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as _ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward as _eager_forward

from . import _kvscore as _k
from . import budget_from_ratio as _budget_from_ratio

__all__ = ["RetrievalCache", "OjaKVCache", "RETRIEVAL_METHODS", "attention_name"]

_PARIS_CACHE = _k.struct_defaults["ParisKVCacheConfig"]
_OJA = _k.generation_defaults["OjaLayerConfig"]
#: OjaKVCache's default window: the prompt's last queries its residual rule reads.
OJAKV_WINDOW = _OJA["window"]
#: method -> whether the zone is searched exactly (no index): the names RetrievalCache takes.
# ParisKV with zones: the registry's first retriever (kvscore::kMethods; its other one has no zones)
_PARISKV = next(m["name"] for m in _k.methods() if m["kind"] == "retriever")
RETRIEVAL_METHODS = {_PARISKV: False, "exact": True}
_LAYER_IMPLS = {"float32": "ParisKVLayerCacheF32", "float16": "ParisKVLayerCacheF16", "bfloat16": "ParisKVLayerCacheBF16"}
_WRAPS = ("sdpa", "eager")
_TOKENS = 2  # the token axis of [batch, heads, tokens, head_dim]
_PREFIX = "kvscore_"
# id(key tensor returned by a kvscore layer's update) -> the layer, until the attention call takes it
_PENDING: dict = {}


def attention_name(implementation: str) -> str:
    """The name kvscore registers for a wrapped attention implementation ('sdpa' -> 'kvscore_sdpa')."""
    return _PREFIX + implementation


def _index(x, name: str) -> int:
    try:
        return _operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an integer (got {x!r} of type {type(x).__name__})") from None


# ------------------------------------------------------------------ attention functions

def _mask_function(implementation: str):
    return _sdpa_mask if implementation == "sdpa" else _eager_mask


def _original(implementation: str, module):
    """The attention function the model would call without kvscore, looked up at call time (so
    that what wraps it, e.g. kvpress's head-wise masking patch, stays in force): the registered
    sdpa, or the eager function of the module's own modeling file."""
    if implementation == "sdpa":
        return _ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", _sdpa_forward)
    return getattr(_sys.modules.get(type(module).__module__), "eager_attention_forward", _eager_forward)


def _make_attention(implementation: str):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        forward = _original(implementation, module)
        layer = _PENDING.pop(id(key), None)
        layer = layer() if layer is not None else None
        if layer is None or layer._returned is not key:  # not a kvscore cache's layer: the original, unchanged
            return forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        layer._returned = None
        if layer._prefill is not None:  # the prompt: exact attention, then the C++ cache is built
            out = forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
            layer._finish_prefill(query, attention_mask, module, scaling)
            return out
        return layer._forward(query, key, value, scaling), None

    attention.__name__ = attention_name(implementation)
    return attention


for _impl in _WRAPS:
    _AttentionInterface.register(attention_name(_impl), _make_attention(_impl))
    _AttentionMaskInterface.register(attention_name(_impl), _mask_function(_impl))


# ------------------------------------------------------------------ the model check

def _check_model(model, who: str):
    """(config, layers, kv_heads, q_heads, head_dim, implementation) of a model the caches can
    serve; ValueError with the reason otherwise."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "num_hidden_layers"):
        raise ValueError(f"{who}: expected a transformers causal LM (a model with a config), got {type(model).__name__}")
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"{who}: {cfg.model_type} is an encoder-decoder model; kvscore caches serve decoder-only models")
    impl = cfg._attn_implementation
    base = impl[len(_PREFIX):] if impl and impl.startswith(_PREFIX) else impl
    if base not in _WRAPS:
        raise ValueError(f"{who}: the model's attention implementation is '{impl}'; kvscore wraps 'sdpa' or 'eager' "
                         "(load the model with attn_implementation='sdpa')")
    types = getattr(cfg, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        bad = sorted({t for t in types if t != "full_attention"})
        raise ValueError(f"{who}: {cfg.model_type} has {', '.join(bad)} layers; kvscore caches serve full-attention "
                         "layers only (a sliding window would evict what retrieval keeps)")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", types is None):
        raise ValueError(f"{who}: {cfg.model_type} uses a sliding window of {cfg.sliding_window} tokens; kvscore "
                         "caches serve full-attention layers only")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise ValueError(f"{who}: {cfg.model_type} soft-caps its attention logits; kvscore's attention does not")
    inner = getattr(model, "model", None)
    attns = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
    if inner is None or not hasattr(inner, "rotary_emb") or len(attns) != cfg.num_hidden_layers:
        raise ValueError(f"{who}: {cfg.model_type}: no RoPE'd keys reachable (kvscore caches need decoder layers that "
                         "apply rotary embeddings and call transformers' AttentionInterface with a layer_idx)")
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg, cfg.num_hidden_layers, kv, cfg.num_attention_heads, d, base


# ------------------------------------------------------------------ the layers

def _token_stop(idx, n: int, who: str) -> int:
    """The tokens kept by ``idx`` on a [batch, kv_heads, n, head_dim] store, if it only cuts the
    token axis's tail ([:, :, :m], [..., :m, :]); TypeError otherwise."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if sum(x is Ellipsis for x in idx) > 1:
        raise TypeError(f"{who}: an index with two ellipses")
    if Ellipsis in idx:
        at = idx.index(Ellipsis)
        idx = idx[:at] + (slice(None),) * (4 - len(idx) + 1) + idx[at + 1:]
    idx = idx + (slice(None),) * (4 - len(idx))
    ok = len(idx) == 4 and all(isinstance(x, slice) for x in idx)
    ok = ok and all(x == slice(None) for i, x in enumerate(idx) if i != _TOKENS)
    if ok:
        t = idx[_TOKENS]
        ok = t.start in (None, 0) and t.step in (None, 1)
    if not ok:
        raise TypeError(f"{who}: the keys and values are held by the C++ layer cache; the only index they take is "
                        f"[:, :, :n] (keep the first n tokens, as kvpress's pipeline does), got {idx!r}")
    return len(range(n)[t])


class _Held:
    """What a kvscore layer's ``keys`` / ``values`` read while the C++ layer cache holds them: the
    shape, dtype and device of the [batch, kv_heads, tokens, head_dim] tensor a DynamicLayer would
    hold, and ``[:, :, :n]``. Assigning such a slice back to the layer keeps the first n tokens
    (Cache.crop), which is how kvpress's pipeline drops each question and its answer
    (``_remove_answer_from_cache``). Anything else (torch operations, a press that reads the keys)
    is a TypeError that says so."""

    __slots__ = ("layer", "what", "shape")

    def __init__(self, layer, what: str, n: int):
        impl = layer.impl
        self.layer, self.what = layer, what
        self.shape = _torch.Size((impl.batch, impl.kv_heads, n, impl.head_dim))

    ndim = property(lambda self: len(self.shape))
    dtype = property(lambda self: self.layer.dtype)
    device = property(lambda self: self.layer.device)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def __getitem__(self, idx):
        return _Held(self.layer, self.what, _token_stop(idx, self.shape[_TOKENS], self._who()))

    def _who(self) -> str:
        return f"{type(self.layer._owner()).__name__} layer {self.layer.idx} {self.what}"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        held = next(a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, _Held))
        raise TypeError(f"{held._who()}: held by kvscore's C++ layer cache, not a tensor ({getattr(func, '__name__', func)} "
                        "cannot read it); kvpress presses cannot compress a kvscore cache")

    def __repr__(self):
        return f"<{self._who()}: {tuple(self.shape)} held in C++>"


class _Layer(_CacheLayerMixin):
    """One attention layer's state: the prompt's keys and values until its attention ran, then
    the C++ layer cache (``impl``); with ``attend=1.0`` a DynamicLayer's keys and values.
    ``keys`` / ``values`` read a _Held stand-in while the C++ cache holds them."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner, idx: int):
        self._owner = _weakref.ref(owner)
        self.idx = idx
        self.impl = None
        self._prefill = None  # (keys, values) of the prompt while its attention runs
        self._returned = None  # the key tensor update() returned, for the attention function
        super().__init__()

    def _held(self) -> bool:
        return self.impl is not None and not self._owner()._dense

    @property
    def keys(self):
        return _Held(self, "keys", int(self.impl.size)) if self._held() else self._keys

    @keys.setter
    def keys(self, value):
        self._store("keys", value)

    @property
    def values(self):
        return _Held(self, "values", int(self.impl.size)) if self._held() else self._values

    @values.setter
    def values(self, value):
        self._store("values", value)

    def _store(self, what: str, value) -> None:
        if value is None or self._owner()._dense:  # CacheLayerMixin's None; attend=1.0's tensors
            setattr(self, "_" + what, value)
            return
        who = f"{type(self._owner()).__name__} layer {self.idx} {what}"
        if not isinstance(value, _Held) or value.layer is not self:
            raise TypeError(f"{who}: held by kvscore's C++ layer cache; only its own [:, :, :n] can be assigned back "
                            f"(keep the first n tokens, Cache.crop), got {type(value).__name__}")
        n = int(value.shape[_TOKENS])
        if n > self.get_seq_length():
            raise ValueError(f"{who}: {n} tokens assigned back, the layer holds {self.get_seq_length()} (a slice "
                             "taken before a crop)")
        self.crop(n)  # keys and values are one store: both keep n tokens

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, cache_kwargs=None):
        owner = self._owner()
        if key_states.device.type != "cpu":
            raise ValueError(f"{type(owner).__name__}: keys on device '{key_states.device}': kvscore.generation runs "
                             "on CPU tensors")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if owner._dense:  # attend=1.0: a DynamicLayer, through the model's own attention
            self.keys = key_states if self.keys is None else _torch.cat([self.keys, key_states], _TOKENS)
            self.values = value_states if self.values is None else _torch.cat([self.values, value_states], _TOKENS)
            return self.keys, self.values
        if self.impl is None:
            if self._prefill is not None:
                raise ValueError(f"{type(owner).__name__}: layer {self.idx} got a second prompt before the first one's "
                                 "attention ran (the model does not call transformers' AttentionInterface)")
            self._prefill = (key_states, value_states)
        self._returned = key_states
        _PENDING[id(key_states)] = _weakref.ref(self)
        return key_states, value_states

    def get_mask_sizes(self, cache_position):
        return self.get_seq_length() + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        if self._owner()._dense:
            return 0 if self.keys is None else int(self.keys.shape[-2])
        return int(self.impl.size) if self.impl is not None else 0

    def get_max_cache_shape(self) -> int:
        return -1

    def crop(self, max_length: int) -> None:
        n = self.get_seq_length()
        if max_length < 0:
            max_length = n + max_length
        if max_length >= n:
            return
        if self._owner()._dense:
            self.keys = self.keys[..., :max_length, :]
            self.values = self.values[..., :max_length, :]
        else:
            self._owner()._crop(self.impl, max_length)

    def reset(self) -> None:
        raise ValueError(f"{type(self._owner()).__name__}: reset is not supported; make a new cache")

    def reorder_cache(self, beam_idx) -> None:
        raise ValueError(f"{type(self._owner()).__name__}: beam search is not supported (greedy or sampling)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError(f"{type(self._owner()).__name__}: expanding the batch (num_return_sequences, beams) is not "
                         "supported")

    def batch_select_indices(self, indices) -> None:
        self.batch_repeat_interleave(0)

    def _finish_prefill(self, query, attention_mask, module, scaling):
        keys, values = self._prefill
        self._prefill = None
        owner = self._owner()
        if attention_mask is not None and attention_mask.dtype == _torch.bool and \
                not bool(attention_mask[:, :, -1, :].all()):
            raise ValueError(f"{type(owner).__name__}: a padded batch (the attention mask hides prompt tokens); "
                             "generate one prompt per call, or prompts of one length")
        if keys.dtype not in (_torch.float32, _torch.float16, _torch.bfloat16):
            raise ValueError(f"{type(owner).__name__}: keys of dtype {keys.dtype}; expected float32, float16 or bfloat16")
        scale = float(scaling if scaling is not None else module.scaling)
        self.impl = owner._make_layer(keys.detach(), values.detach(), query.detach(), scale)

    def _forward(self, query, key, value, scaling):
        b, qh, n, d = query.shape
        out = _torch.empty(b, n, qh, d, dtype=_torch.float32)
        self.impl.forward(key.detach(), value.detach(), query.detach().float(), out.permute(0, 2, 1, 3))
        return out.to(query.dtype)


class _KvscoreCache(_Cache):
    """The shared shell of kvscore's caches: the model check, the attention switch, one _Layer
    per layer. Subclasses build a layer's C++ cache from its prompt (``_make_layer``)."""

    def __init__(self, model, who: str):
        cfg, layers, kv, qh, d, base = _check_model(model, who)
        self.kv_heads, self.q_heads, self.head_dim, self.num_layers = kv, qh, d, layers
        attns = sorted((m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")),
                       key=lambda m: m.layer_idx)
        self._scaling = [float(getattr(m, "scaling", d ** -0.5)) for m in attns]
        if cfg._attn_implementation != attention_name(base):
            model.set_attn_implementation(attention_name(base))
        self._dense = False
        super().__init__(layers=[_Layer(self, i) for i in range(layers)])

    def prefill(self, layer: int, keys, values, queries=None) -> None:
        """Loads a prompt into one layer as its first forward would: keys and values
        ``[batch, kv_heads, n, head_dim]`` (post-RoPE, as the model caches them) and the prompt's
        post-RoPE queries ``[batch, q_heads, >= 1, head_dim]`` (their last tokens; OjaKV's residual
        rule reads the last ``window``). For a prompt already run (kvscore.quality replays one
        prefill for many caches)."""
        lay = self.layers[layer]
        if lay.impl is not None or lay._prefill is not None or lay._keys is not None:
            raise ValueError(f"{type(self).__name__}.prefill: layer {layer} holds a prompt already")
        if not lay.is_initialized:
            lay.lazy_initialization(keys, values)
        if self._dense:
            lay.keys, lay.values = keys, values
            return
        if queries is None:
            queries = _torch.zeros(keys.shape[0], self.q_heads, 1, keys.shape[-1], dtype=_torch.float32)
        lay._prefill = (keys, values)
        lay._finish_prefill(queries, None, None, self._scaling[layer])

    def _crop(self, impl, n: int) -> None:
        impl.crop(n)

    def _impls(self):
        return [lay.impl for lay in self.layers if lay.impl is not None]

    def full_memory_bytes(self) -> int:
        """Bytes a DynamicCache holds for the same tokens: 2 · layers · batch · kv_heads ·
        tokens · head_dim · element size."""
        total = 0
        for lay in self.layers:
            if lay._keys is not None:
                total += 2 * lay._keys.numel() * lay._keys.element_size()
            elif lay.impl is not None:
                i = lay.impl
                total += 2 * i.batch * i.kv_heads * i.size * i.head_dim * lay.dtype.itemsize
        return total


def _kind(x, name: str, who: str):
    """'fraction' or 'count' of a float-or-int argument; TypeError for anything else."""
    if isinstance(x, bool):
        raise TypeError(f"{who}: {name} must be a float fraction or an int count (got {x!r})")
    if isinstance(x, float):
        return "fraction"
    try:
        _operator.index(x)
    except TypeError:
        raise TypeError(f"{who}: {name} must be a float fraction or an int count (got {x!r})") from None
    return "count"


# ------------------------------------------------------------------ RetrievalCache

class RetrievalCache(_KvscoreCache):
    """Per-query retrieval at every decode step (the module doc; docs/guides/generation.md).

    Parameters
    ----------
    model : transformers causal LM (sdpa or eager attention, full-attention RoPE layers)
    method : {'pariskv', 'exact'}
        ParisKV's index, or the exact top k by q·k (the ceiling the index approximates).
    attend : float or int
        Keys attended per step: a fraction of the prompt's length in (0, 1] or a count >= 1
        (sinks + retrieved + local); 1.0: every key, through the model's own attention.
    sinks, local : int
        The first and the last tokens every query attends (tokens leaving the local window are
        indexed at once). local None (the default): ParisKV's zones for the budget, at most half
        of what the sinks leave, min(kDefaultParisKVLocal = 256, (budget − sinks) // 2)
        (kvscore::pariskv_zones), so that any budget above the sinks retrieves; a local window
        given that leaves no key to retrieve is a ValueError naming it.
    dense_below : int or None
        A decode step attends every key while the cache holds fewer than
        max(dense_below, sinks + local + 2k) tokens (one read of each KV head's keys and values
        for its query heads, in C++: below the crossover that is faster than a search), and
        retrieves from there on. None: the measured crossover for the model's head_dim
        (``kvscore._kvscore.retrieval_dense_below``, docs/guides/generation.md); 0: never dense (every
        step attends sinks + k + local keys).
    beta, rho, rerank_exact : ParisKV's search options (0: the length-adaptive defaults; off).
    threads : OpenMP threads of the C++ layer calls (0: OpenMP's default).
    """

    def __init__(self, model, method: str = _PARISKV, *, attend, sinks: int = _PARIS_CACHE["sinks"],
                 local: int | None = None, dense_below: int | None = None, beta: float = 0.0,
                 rho: float = 0.0, rerank_exact: int = 0, threads: int = 0):
        who = "RetrievalCache"
        if method not in RETRIEVAL_METHODS:
            raise ValueError(f"{who}: method '{method}' must be one of {', '.join(RETRIEVAL_METHODS)}")
        if _kind(attend, "attend", who) == "fraction":
            if not 0 < attend <= 1:
                raise ValueError(f"{who}: attend {attend} must be in (0, 1] as a fraction of the prompt (or an int count)")
        else:
            attend = _index(attend, "attend")
            if attend < 1:
                raise ValueError(f"{who}: attend {attend} must be >= 1 keys per step")
        sinks, local = _index(sinks, "sinks"), None if local is None else _index(local, "local")
        if sinks < 0 or (local is not None and local < 0):
            raise ValueError(f"{who}: sinks {sinks} and local {local} must be >= 0")
        for name, v in (("beta", beta), ("rho", rho)):
            if not 0 <= v <= 1:
                raise ValueError(f"{who}: {name} {v} must be in (0, 1] (0: the length-adaptive default)")
        rerank_exact = _index(rerank_exact, "rerank_exact")
        if rerank_exact < 0:
            raise ValueError(f"{who}: rerank_exact {rerank_exact} must be >= 0 (0: off)")
        if RETRIEVAL_METHODS[method] and (beta or rho or rerank_exact):
            raise ValueError(f"{who}: beta, rho and rerank_exact are ParisKV's search options; method 'exact' takes none")
        if dense_below is not None:
            dense_below = _index(dense_below, "dense_below")
            if dense_below < 0:
                raise ValueError(f"{who}: dense_below {dense_below} must be >= 0 tokens (0: never dense; None: the "
                                 "measured default)")
        self.method, self.attend, self.sinks, self.local = method, attend, sinks, local
        self._search = (float(beta), float(rho), rerank_exact)
        self.threads = _index(threads, "threads")
        super().__init__(model, who)
        self._dense = isinstance(attend, float) and attend == 1.0
        #: cache length below which a step attends densely (see dense_below)
        self.dense_below = _k.retrieval_dense_below(self.head_dim) if dense_below is None else dense_below

    def budget(self, n: int) -> int:
        """Keys attended per step after a prompt of n tokens (sinks + retrieved + local)."""
        return _budget_from_ratio(n, self.attend) if isinstance(self.attend, float) else self.attend

    def local_for(self, n: int) -> int:
        """The local window after a prompt of n tokens: `local`, or by default ParisKV's zones for
        the budget, min(kDefaultParisKVLocal, (budget − sinks) // 2)."""
        if self.local is not None:
            return self.local
        return min(_k.kDefaultParisKVLocal, max(0, (self.budget(n) - self.sinks) // 2))

    def retrieved(self, n: int) -> int:
        """Keys retrieved per query after a prompt of n tokens (the budget less sinks and local)."""
        return self.budget(n) - self.sinks - self.local_for(n)

    def _make_layer(self, keys, values, query, scale):
        b, kv, n, d = keys.shape
        k, local = self.retrieved(n), self.local_for(n)
        if k < 1:
            given = f"local {local}" if self.local is not None else f"local {local} (the default)"
            raise ValueError(f"RetrievalCache: attend={self.attend!r} gives {self.budget(n)} keys per step for a prompt "
                             f"of {n} tokens, not more than sinks {self.sinks} + {given}: lower them or attend more")
        beta, rho, rerank = self._search
        impl = getattr(_k, _LAYER_IMPLS[str(keys.dtype).replace("torch.", "")])(
            b, kv, d, sinks=self.sinks, local=local, update_interval=1, k=k, exact=RETRIEVAL_METHODS[self.method],
            scale=scale, beta=beta, rho=rho, rerank_exact=rerank, dense_below=self.dense_below)
        impl.num_threads = self.threads
        impl.append(keys, values)
        return impl

    def memory_bytes(self) -> int:
        """Bytes held: the keys and values at full precision plus the indexes (a DynamicCache's
        keys and values with attend=1.0)."""
        if self._dense:
            return self.full_memory_bytes()
        return sum(int(i.memory_bytes) for i in self._impls())

    def attended(self, layer: int, row: int = 0):
        """int64 [q_heads, n]: the positions each query head of a layer attended at the last
        step (ascending)."""
        impl = self.layers[layer].impl
        if impl is None:
            raise ValueError(f"RetrievalCache.attended: layer {layer} has no retrieval state (no prompt yet, or "
                             "attend=1.0)")
        return _np.stack([impl.positions(row, j) for j in range(self.q_heads)])


# ------------------------------------------------------------------ OjaKVCache

class OjaKVCache(_KvscoreCache):
    """OjaKV's hybrid store during generation (the module doc; docs/methods/ojakv.md "In generation").

    Parameters
    ----------
    model : transformers causal LM (sdpa or eager attention, full-attention RoPE layers)
    rank : int
        Key basis rank r_k in [1, head_dim] (value_rank: r_v, default the same).
    anchors : float or int
        Prompt tokens per KV head kept at full rank: a fraction of the prompt in [0, 1] or a
        count; the first ``sinks`` tokens and the last ``window`` ones (the residual rule's
        queries) are among them.
    period, pool, full_rank_fraction, adapt, seed : the decode block T, the pooling window, the
        share of each closed block kept at full rank, whether the bases adapt, their seed.
    threads : OpenMP threads of the C++ layer calls (0: OpenMP's default).
    """

    def __init__(self, model, *, rank: int, anchors, value_rank: int | None = None, sinks: int = _OJA["sinks"],
                 window: int = _OJA["window"], period: int = _OJA["period"], pool: int = _OJA["pool"],
                 full_rank_fraction: float = _OJA["full_rank_fraction"], adapt: bool = _OJA["adapt"],
                 seed: int = _OJA["seed"], threads: int = 0):
        who = "OjaKVCache"
        rank = _index(rank, "rank")
        value_rank = rank if value_rank is None else _index(value_rank, "value_rank")
        if _kind(anchors, "anchors", who) == "fraction":
            if not 0 <= anchors <= 1:
                raise ValueError(f"{who}: anchors {anchors} must be in [0, 1] as a fraction of the prompt (or an int "
                                 "count)")
        else:
            anchors = _index(anchors, "anchors")
            if anchors < 0:
                raise ValueError(f"{who}: anchors {anchors} must be >= 0")
        self.rank, self.value_rank, self.anchors = rank, value_rank, anchors
        self._opts = dict(sinks=_index(sinks, "sinks"), window=_index(window, "window"), period=_index(period, "period"),
                          pool=_index(pool, "pool"), full_rank_fraction=float(full_rank_fraction), adapt=bool(adapt),
                          seed=_index(seed, "seed"))
        self.threads = _index(threads, "threads")
        super().__init__(model, who)
        for name, r in (("rank", rank), ("value_rank", value_rank)):
            if not 1 <= r <= self.head_dim:
                raise ValueError(f"{who}: {name} {r} must be in [1, head_dim = {self.head_dim}]")
        # the other options are checked by the C++ constructor now, not at the first prompt
        _k.OjaLayerCache(1, self.kv_heads, self.head_dim, rank_k=rank, rank_v=value_rank, **self._opts)

    def _make_layer(self, keys, values, query, scale):
        b, kv, n, d = keys.shape
        count = _budget_from_ratio(n, self.anchors) if isinstance(self.anchors, float) else min(n, self.anchors)
        w = min(self._opts["window"], n)
        if query.shape[2] < w:
            raise ValueError(f"OjaKVCache: {query.shape[2]} prompt queries given, the residual rule reads the last {w}")
        impl = _k.OjaLayerCache(b, kv, d, rank_k=self.rank, rank_v=self.value_rank, anchors=count, scale=scale,
                                **self._opts)
        impl.num_threads = self.threads
        impl.prefill(keys, values, query[:, :, query.shape[2] - w:, :].float())
        return impl

    def _crop(self, impl, n: int) -> None:
        try:
            impl.crop(n)
        except ValueError as e:
            raise ValueError(f"OjaKVCache: cannot keep the first {n} of {impl.size} tokens: {e}. A block of "
                             f"period={self._opts['period']} decoded tokens is committed when it fills; what follows "
                             "a prompt (kvpress's pipeline: a question and its answer) can be dropped while it is "
                             "shorter than that: raise period or lower max_new_tokens") from None

    def memory_bytes(self) -> int:
        """K/V bytes of the hybrid store by the paper's formula at the model's element size
        (docs/methods/ojakv.md, Definitions 11): codes, full-rank rows with a 4-byte position, the bases."""
        return sum(int(lay.impl.memory(lay.dtype.itemsize)["hybrid_bytes"]) for lay in self.layers
                   if lay.impl is not None)

    def full_rank_positions(self, layer: int, row: int = 0, kv_head: int = 0):
        """int64 positions a layer's KV head keeps at full rank (closed blocks, ascending)."""
        impl = self.layers[layer].impl
        if impl is None:
            raise ValueError(f"OjaKVCache.full_rank_positions: layer {layer} holds no prompt yet")
        return impl.full_rank_positions(row, kv_head)
