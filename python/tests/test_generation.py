"""kvscore.generation inside transformers' generate (docs/guides/generation.md), on small GQA + RoPE
Llama / Qwen2 models built from a config (random weights):

- attend=1.0 gives a DynamicCache's greedy tokens exactly (and the kvscore attention wrapper
  leaves DynamicCache generation untouched);
- with a budget, every step's attended positions are what the C++ layer cache selects for the
  model's own keys and queries (read back through a hook), and for method="exact" the
  brute-force top k of q·k over the retrieval zone (ties: lower position) plus sinks and local;
- OjaKVCache at full rank generates a DynamicCache's tokens; its memory_bytes is the formula of
  docs/methods/ojakv.md; crop of the open block;
- every bad argument and every model the caches cannot serve raise with the reason.
SmolLM2 (the real model) is in test_smollm2.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvscore  # noqa: E402
import kvscore.generation as kg  # noqa: E402
from kvscore import _kvscore  # noqa: E402

PARISKV = next(iter(kg.RETRIEVAL_METHODS))


def tiny(kind="llama", impl="sdpa", **over):
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=1024)
    common.update(over)
    cfg, cls = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if kind == "llama" else
                (transformers.Qwen2Config, transformers.Qwen2ForCausalLM))
    return cls._from_config(cfg(**common), attn_implementation=impl, dtype=torch.float32).eval()


def prompt(n, seed=1, batch=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (batch, n), generator=g)


def greedy(model, ids, cache, new=12):
    with torch.no_grad():
        return model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False, min_new_tokens=new,
                              pad_token_id=0)[:, ids.shape[1]:]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_attend_everything_gives_the_dynamic_cache_tokens(kind, impl):
    model = tiny(kind, impl)
    ids = prompt(80)
    want = greedy(model, ids, transformers.DynamicCache())
    cache = kg.RetrievalCache(model, attend=1.0)
    assert model.config._attn_implementation == kg.attention_name(impl)
    got = greedy(model, ids, cache)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == 80 + 11  # the last generated token is never fed back
    # the wrapper is the original attention for every other cache
    assert torch.equal(greedy(model, ids, transformers.DynamicCache()), want)


def _record_forwards(monkeypatch):
    """Wraps the layers' C++ forward: [(layer, keys, values, queries, positions after)]."""
    seen = []
    real = kg._Layer._forward

    def spy(self, query, key, value, scaling):
        out = real(self, query, key, value, scaling)
        pos = [self.impl.positions(0, j) for j in range(query.shape[1])]
        seen.append((self.idx, key.detach().clone(), value.detach().clone(), query.detach().float().clone(), pos))
        return out

    monkeypatch.setattr(kg._Layer, "_forward", spy)
    return seen


def _prefill_keys(model, ids):
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    return [(lay.keys.clone(), lay.values.clone()) for lay in cache.layers]


@pytest.mark.parametrize("method", list(kg.RETRIEVAL_METHODS))
def test_each_step_attends_what_the_layer_cache_selects(monkeypatch, method):
    model = tiny()
    n, sinks, local, budget = 120, 4, 8, 30
    ids = prompt(n, seed=2)
    seen = _record_forwards(monkeypatch)
    cache = kg.RetrievalCache(model, method, attend=budget, sinks=sinks, local=local, dense_below=0)
    assert cache.retrieved(n) == budget - sinks - local
    greedy(model, ids, cache, new=6)
    assert len(seen) == 2 * 5  # 2 layers x 5 decode steps (the first token comes from the prompt)
    pre = _prefill_keys(model, ids)  # the prompt's keys: the same as a DynamicCache's (exact prefill)
    G = model.config.num_attention_heads // model.config.num_key_value_heads
    k = budget - sinks - local
    scale = model.model.layers[0].self_attn.scaling
    for layer in range(2):
        K, V = pre[layer]
        ref = getattr(_kvscore, "ParisKVLayerCacheF32")(1, 2, K.shape[-1], sinks=sinks, local=local, update_interval=1,
                                                        k=k, exact=kg.RETRIEVAL_METHODS[method], scale=scale)
        ref.append(K, V)
        for idx, key, value, q, pos in [s for s in seen if s[0] == layer]:
            out = torch.empty(1, q.shape[2], q.shape[1], q.shape[-1])
            ref.forward(key, value, q, out.permute(0, 2, 1, 3))
            K, V = torch.cat([K, key], dim=2), torch.cat([V, value], dim=2)
            N = K.shape[2]
            for j in range(q.shape[1]):
                assert np.array_equal(pos[j], ref.positions(0, j)), (layer, j)
                assert len(pos[j]) == budget
                if kg.RETRIEVAL_METHODS[method]:  # exact: brute force in float64
                    s = (K[0, j // G, sinks:N - local].double() @ q[0, j, 0].double()).numpy()
                    order = np.lexsort((np.arange(s.size), -s))[:k]
                    want = np.concatenate([np.arange(sinks), np.sort(order) + sinks, np.arange(N - local, N)])
                    srt = np.sort(s)[::-1]
                    if srt[k - 1] - srt[k] > 1e-5 * max(1.0, abs(srt[k])):  # no fp32 near-tie at the edge
                        assert np.array_equal(pos[j], want), (layer, j)
    # the query heads of a group retrieve for themselves
    assert any(not np.array_equal(seen[-1][4][0], seen[-1][4][j]) for j in range(1, G))
    assert cache.attended(1).shape == (model.config.num_attention_heads, budget)


def test_dense_below_the_threshold_then_retrieval(monkeypatch):
    """While the cache holds fewer than dense_below tokens a step attends every position (the
    C++ grouped kernel: softmax(q·k)·v over all keys, against float64 here); from there on it
    retrieves the budget. The default is the C++ crossover for the model's head_dim."""
    model = tiny()
    d = model.config.hidden_size // model.config.num_attention_heads
    assert kg.RetrievalCache(model, attend=0.1).dense_below == _kvscore.retrieval_dense_below(d) > 0
    n, budget, G = 100, 30, model.config.num_attention_heads // model.config.num_key_value_heads
    seen = []
    real = kg._Layer._forward

    def spy(self, query, key, value, scaling):
        out = real(self, query, key, value, scaling)
        pos = [self.impl.positions(0, j) for j in range(query.shape[1])]
        seen.append((self.idx, key.clone(), value.clone(), query.double(), out.double(), pos, scaling))
        return out

    monkeypatch.setattr(kg._Layer, "_forward", spy)
    ids = prompt(n, seed=12)
    cache = kg.RetrievalCache(model, attend=budget, sinks=4, local=8, dense_below=n + 3)
    greedy(model, ids, cache, new=7)  # 6 decode steps through the cache: N = 101 .. 106
    K, V = _prefill_keys(model, ids)[0]
    steps = [x for x in seen if x[0] == 0]
    assert len(steps) == 6
    for i, (_, key, value, q, out, pos, scale) in enumerate(steps):
        K, V = torch.cat([K, key], 2), torch.cat([V, value], 2)
        N = n + 1 + i
        for j in range(q.shape[1]):
            if N < n + 3:
                assert np.array_equal(pos[j], np.arange(N)), (N, j)
                p = torch.softmax((K[0, j // G].double() @ q[0, j, 0]) * scale, 0)
                want = p @ V[0, j // G].double()
                assert torch.allclose(out[0, 0, j], want, rtol=1e-5, atol=1e-6), (N, j)
            else:
                assert len(pos[j]) == budget, (N, j)
    with pytest.raises(ValueError, match="dense_below -1 must be >= 0"):
        kg.RetrievalCache(model, attend=0.1, dense_below=-1)
    with pytest.raises(TypeError, match="dense_below must be an integer"):
        kg.RetrievalCache(model, attend=0.1, dense_below=0.5)


def test_the_default_zones_fit_any_budget_above_the_sinks():
    """RetrievalCache(model, "pariskv", attend=0.1) on a 2,048-token prompt: 205 keys per step,
    fewer than sinks 4 + a local window of 256. The default local window is ParisKV's zones for the
    budget, min(256, (205 − 4) // 2) = 100, so 101 are retrieved; below dense_below (the default)
    the steps attend densely anyway. A local window given that leaves nothing to retrieve is an
    error naming it."""
    model = tiny(max_position_embeddings=4096)
    ids = prompt(2048, seed=5)
    cache = kg.RetrievalCache(model, PARISKV, attend=0.1)
    assert cache.dense_below > 2048 + 3  # dense here
    assert greedy(model, ids, cache, new=3).shape == (1, 3)
    assert (cache.budget(2048), cache.local_for(2048), cache.retrieved(2048)) == (205, 100, 101)
    # retrieving from the first step (dense_below=0): 4 + 101 + 100 = 205 keys per step
    cache = kg.RetrievalCache(model, PARISKV, attend=0.1, dense_below=0)
    greedy(model, ids, cache, new=2)
    assert cache.attended(0).shape == (model.config.num_attention_heads, 205)
    # a long prompt keeps the default window of 256 (min(256, (820 − 4) // 2))
    assert kg.RetrievalCache(model, PARISKV, attend=0.1).local_for(8192) == _kvscore.kDefaultParisKVLocal
    with pytest.raises(ValueError, match=r"gives 205 keys per step for a prompt of 2048 tokens, not more than sinks 4 "
                                         r"\+ local 256: lower them"):
        greedy(model, ids, kg.RetrievalCache(model, PARISKV, attend=0.1, local=256), new=2)
    with pytest.raises(ValueError, match=r"gives 4 keys per step .* sinks 4 \+ local 0 \(the default\)"):
        greedy(model, prompt(50), kg.RetrievalCache(model, PARISKV, attend=4), new=2)


def test_fraction_budget_memory_and_crop():
    model = tiny()
    ids = prompt(200, seed=3)
    cache = kg.RetrievalCache(model, PARISKV, attend=0.25, sinks=2, local=16, dense_below=0)
    assert cache.budget(200) == 50 and cache.retrieved(200) == 32
    first = greedy(model, ids, cache, new=8)
    d = model.config.hidden_size // model.config.num_attention_heads
    full = 2 * 2 * 2 * 207 * d * 4  # K and V, 2 layers, 2 KV heads, 207 tokens, fp32
    assert cache.full_memory_bytes() == full
    assert cache.memory_bytes() > full  # nothing evicted: the keys, the values and the index
    # the exact retriever holds no index
    ex = kg.RetrievalCache(model, "exact", attend=0.25, sinks=2, local=16)
    greedy(model, ids, ex, new=8)
    assert ex.memory_bytes() == ex.full_memory_bytes() == full
    # crop back to the prompt, generate again: the same tokens
    cache.crop(200)
    assert cache.get_seq_length() == 200
    with torch.no_grad():
        again = model.generate(torch.cat([ids, first[:, :1]], dim=1), past_key_values=cache, max_new_tokens=7,
                               do_sample=False, min_new_tokens=7, pad_token_id=0)[:, 201:]
    assert torch.equal(again, first[:, 1:])


def test_batch_rows_match_single_rows():
    model = tiny()
    ids = torch.cat([prompt(90, seed=4), prompt(90, seed=5)])
    for dense_below in (0, None):  # retrieval, and the dense steps below the default threshold
        both = greedy(model, ids, kg.RetrievalCache(model, "exact", attend=24, sinks=4, local=8,
                                                    dense_below=dense_below), new=6)
        for b in range(2):
            one = greedy(model, ids[b:b + 1], kg.RetrievalCache(model, "exact", attend=24, sinks=4, local=8,
                                                                dense_below=dense_below), new=6)
            assert torch.equal(both[b:b + 1], one)


def test_ojakv_full_rank_gives_the_dynamic_cache_tokens_and_the_formula():
    model = tiny()
    d = model.config.hidden_size // model.config.num_attention_heads
    ids = prompt(100, seed=6)
    want = greedy(model, ids, transformers.DynamicCache(), new=10)
    cache = kg.OjaKVCache(model, rank=d, anchors=0.2, window=8, period=4)  # blocks close during the answer
    assert torch.equal(greedy(model, ids, cache, new=10), want)
    # memory: per layer and KV head (N - m)(r_k + r_v)·b + m(2d·b + 4) + d(r_k + r_v)·b, b = 4 (fp32)
    small = kg.OjaKVCache(model, rank=4, anchors=20, window=8, period=1000)
    greedy(model, ids, small, new=3)  # the 2 fed-back decode tokens stay in the open block (full rank)
    m = 20 + 2
    per_head = (102 - m) * (4 + 4) * 4 + m * (2 * d * 4 + 4) + d * (4 + 4) * 4
    assert small.memory_bytes() == 2 * 2 * per_head
    assert small.full_memory_bytes() == 2 * 2 * 2 * 102 * d * 4
    assert small.memory_bytes() < small.full_memory_bytes()
    assert list(small.full_rank_positions(0, 0, 1))[:4] == [0, 1, 2, 3]  # the sinks
    assert list(small.full_rank_positions(0, 0, 1))[-8:] == list(range(92, 100))  # the residual rule's window


def test_ojakv_crop_drops_the_answer():
    model = tiny()
    ids = prompt(64, seed=7)
    cache = kg.OjaKVCache(model, rank=8, anchors=0.25, window=8)
    first = greedy(model, ids, cache, new=5)
    cache.crop(64)
    with torch.no_grad():
        again = model.generate(torch.cat([ids, first[:, :1]], dim=1), past_key_values=cache, max_new_tokens=4,
                               do_sample=False, min_new_tokens=4, pad_token_id=0)[:, 65:]
    assert torch.equal(again, first[:, 1:])
    with pytest.raises(ValueError, match="closed blocks"):
        cache.crop(10)


def test_bad_arguments_name_the_value():
    model = tiny()
    with pytest.raises(ValueError, match="method 'flat' must be one of"):
        kg.RetrievalCache(model, "flat", attend=0.1)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=f"attend {bad}"):
            kg.RetrievalCache(model, attend=bad)
    with pytest.raises(ValueError, match="attend 0 must be >= 1"):
        kg.RetrievalCache(model, attend=0)
    with pytest.raises(TypeError, match="attend must be a float fraction or an int count"):
        kg.RetrievalCache(model, attend="10%")
    with pytest.raises(TypeError):
        kg.RetrievalCache(model)  # attend is required
    with pytest.raises(ValueError, match="sinks -1 and local 4"):
        kg.RetrievalCache(model, attend=0.1, sinks=-1, local=4)
    with pytest.raises(ValueError, match="beta 2"):
        kg.RetrievalCache(model, attend=0.1, beta=2)
    with pytest.raises(ValueError, match="method 'exact' takes none"):
        kg.RetrievalCache(model, "exact", attend=0.1, rerank_exact=300)
    # a budget that leaves nothing to retrieve is named at the prompt
    cache = kg.RetrievalCache(model, attend=10, sinks=4, local=8)
    with pytest.raises(ValueError, match="gives 10 keys per step for a prompt of 50 tokens"):
        greedy(model, prompt(50), cache, new=2)
    d = model.config.hidden_size // model.config.num_attention_heads
    for r in (0, d + 1):
        with pytest.raises(ValueError, match=f"rank {r} must be in \\[1, head_dim = {d}\\]"):
            kg.OjaKVCache(model, rank=r, anchors=0.1)
    with pytest.raises(ValueError, match="anchors 1.5"):
        kg.OjaKVCache(model, rank=4, anchors=1.5)
    with pytest.raises(ValueError, match="period must be >= 1"):
        kg.OjaKVCache(model, rank=4, anchors=0.1, period=0)
    with pytest.raises(ValueError, match="anchors 5 < the 12 protected tokens"):
        greedy(model, prompt(50), kg.OjaKVCache(model, rank=4, anchors=5, window=8), new=2)


def test_models_the_caches_cannot_serve_are_refused():
    with pytest.raises(ValueError, match="sliding window"):
        kg.RetrievalCache(tiny("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=0), attend=0.1)
    m = tiny()
    m.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attention implementation is 'flex_attention'"):
        kg.OjaKVCache(m, rank=4, anchors=0.1)
    with pytest.raises(ValueError, match="expected a transformers causal LM"):
        kg.RetrievalCache(torch.nn.Linear(2, 2), attend=0.1)
    m = tiny()
    del m.model.rotary_emb
    with pytest.raises(ValueError, match="no RoPE'd keys reachable"):
        kg.RetrievalCache(m, attend=0.1)
    # a padded batch
    m = tiny()
    ids = torch.cat([prompt(40, seed=8), prompt(40, seed=9)])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with pytest.raises(ValueError, match="padded batch"):
        with torch.no_grad():
            m.generate(ids, attention_mask=mask, past_key_values=kg.RetrievalCache(m, attend=20, sinks=2, local=4),
                       max_new_tokens=2, pad_token_id=0)


# ------------------------------------------------------------------ kvpress's pipeline

_CONTEXT = "".join(chr(65 + (i * 7) % 26) for i in range(150))
_QUESTIONS = ["Which letter comes next?", "Q: repeat the start"]
_CACHES = {
    "retrieval-pariskv": lambda m: kg.RetrievalCache(m, PARISKV, attend=40, sinks=4, local=8, dense_below=0),
    "retrieval-exact": lambda m: kg.RetrievalCache(m, "exact", attend=40, sinks=4, local=8, dense_below=0),
    "retrieval-dense": lambda m: kg.RetrievalCache(m, PARISKV, attend=40, sinks=4, local=8),  # the threshold's
    "ojakv": lambda m: kg.OjaKVCache(m, rank=8, anchors=0.3, window=8),
}


def _sharp(kind="llama"):
    """A tiny model whose answers depend on the question (at the default init they depend on the
    last token only)."""
    return tiny(kind, initializer_range=0.3)


def _pipeline(model):
    from byte_tokenizer import ByteTokenizer

    pytest.importorskip("kvpress")  # registers the "kv-press-text-generation" task
    return transformers.pipeline("kv-press-text-generation", model=model, tokenizer=ByteTokenizer(), device="cpu")


def _by_hand(model, tok, cache, question, new):
    """What the pipeline does for one question, driven by hand on a fresh cache: the context
    through the base model, then the question and the greedy answer through generate."""
    ctx = tok.encode(tok.bos_token + _CONTEXT, add_special_tokens=False, return_tensors="pt")
    q = tok.encode(question + "\n", add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        model.model(input_ids=ctx, past_key_values=cache)
        out = model.generate(torch.cat([ctx, q], 1), past_key_values=cache, max_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return tok.decode(out[0, ctx.shape[1] + q.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("name", list(_CACHES))
def test_kvpress_pipeline_answers_as_the_cache_driven_by_hand(name):
    """kvpress's pipeline drops each answer by slicing layer.keys / .values and assigning them
    back: a crop of the C++ store, so every question after the first is answered from the
    context alone, as by a fresh cache."""
    model = _sharp()
    pipe = _pipeline(model)
    cache = _CACHES[name](model)
    got = pipe(_CONTEXT, questions=_QUESTIONS, cache=cache, max_new_tokens=8)["answers"]
    n = len(_CONTEXT) + 1  # the bos token
    assert [cache.get_seq_length(i) for i in range(2)] == [n, n]  # the last answer dropped too
    want = [_by_hand(model, pipe.tokenizer, _CACHES[name](model), q, 8) for q in _QUESTIONS]
    assert got == want and got[0] != got[1]
    one = pipe(_CONTEXT, question=_QUESTIONS[1], cache=_CACHES[name](model), max_new_tokens=8)["answer"]
    assert one == want[1]


def test_kvpress_pipeline_attend_everything_is_the_pipeline_without_a_cache():
    model = _sharp("qwen2")
    pipe = _pipeline(model)
    want = pipe(_CONTEXT, questions=_QUESTIONS, max_new_tokens=8)["answers"]
    assert len(set(want)) == 2  # the questions get different answers: a missed crop would show
    assert pipe(_CONTEXT, questions=_QUESTIONS, cache=kg.RetrievalCache(model, attend=1.0),
                max_new_tokens=8)["answers"] == want


def test_held_keys_take_only_a_crop():
    model = tiny()
    cache = kg.RetrievalCache(model, attend=40, sinks=4, local=8, dense_below=0)
    greedy(model, prompt(100), cache, new=4)
    lay = cache.layers[0]
    d = model.config.hidden_size // model.config.num_attention_heads
    assert tuple(lay.keys.shape) == (1, 2, 103, d) and lay.keys.dtype == torch.float32
    assert tuple(lay.values[..., :-3, :].shape) == (1, 2, 100, d)
    with pytest.raises(TypeError, match="held by kvscore's C\\+\\+ layer cache, not a tensor"):
        torch.linalg.vector_norm(lay.keys, dim=-1)
    with pytest.raises(TypeError, match="the only index they take is \\[:, :, :n\\]"):
        lay.keys[:, 1]
    with pytest.raises(TypeError, match="got Tensor"):
        lay.keys = torch.zeros(1, 2, 100, d)
    stale = lay.keys[:, :, :102]
    lay.values = lay.values[:, :, :101]  # values and keys are one store: both keep 101
    assert cache.get_seq_length() == 101 and cache.layers[0].impl.size == 101
    with pytest.raises(ValueError, match="102 tokens assigned back, the layer holds 101"):
        lay.keys = stale
    # OjaKV: a committed block cannot be dropped; the error names the way out
    oja = kg.OjaKVCache(model, rank=8, anchors=0.3, window=8, period=3)
    with pytest.raises(ValueError, match="raise period or lower max_new_tokens"):
        _pipeline(model)(_CONTEXT, questions=_QUESTIONS, cache=oja, max_new_tokens=4)
