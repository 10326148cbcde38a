"""KVzip in kvscore (docs/methods/kvzip.md): the C++ scorer of attention received against torch (kvpress's
own arithmetic: the softmax over sinks + chunk + the pass's own tokens, max over the group and the
queries), and the press inside kvpress's pipeline against kvpress's KVzipPress on a tiny random Llama
(fp32, sdpa): the same masked (layer, head, position) triples, for KVzip and KVzip+, global and
layerwise allocation, one and several reconstruction chunks. SmolLM2 (a real chat template) is in
test_smollm2.py."""

import contextlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

import kvscore  # noqa: E402
from kvscore import presses  # noqa: E402
from kvscore.presses import KvscorePress, KVzipPress  # noqa: E402
from kvpress.utils import compute_n_kept  # noqa: E402
from byte_tokenizer import ByteTokenizer  # noqa: E402  (no chat template: the prompt is the plain text, "\n" its suffix)


# ------------------------------------------------------------------ the scorer against torch

def torch_kvzip(cache, own, q, b, e, sinks, qw=None, kw=None):
    """kvpress KVzipPress._compute_cross_attention + score_kvzip on plain tensors, in float64:
    cache [H, N, d], own [H, m, d], q [Hq, m, d] -> scores [H, e - b]."""
    H, _, d = cache.shape
    Hq, m, _ = q.shape
    G = Hq // H
    s = min(sinks, b)
    keys = torch.cat([cache[:, :s], cache[:, b:e], own], 1).double()          # [H, s + nb + m, d]
    att = torch.einsum("hgid,htd->hgit", q.double().view(H, G, m, d), keys) / d ** 0.5
    mask = torch.full((m, m), float("-inf")).triu(1).double()                # own rows: causal
    att[..., -m:] += mask
    p = att.softmax(-1)
    if qw is not None:
        p = p * qw.double().view(1, 1, m, 1)
    p = p[..., s:s + (e - b)]
    if kw is not None:
        p = p * kw.double().view(H, G, 1, e - b)
    return p.amax(dim=(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_span_matches_torch_reference_and_any_query_block(dtype):
    g = torch.Generator().manual_seed(0)
    H, G, N, m, d = 2, 3, 120, 37, 64
    cache = torch.randn(H, N, d, generator=g).to(dtype)
    own = torch.randn(H, m, d, generator=g).to(dtype)
    q = torch.randn(H * G, m, d, generator=g) * 1.5
    qw = torch.rand(m, generator=g) + 0.5
    for b, e, sinks, weights in [(0, N, 4, False), (10, 90, 4, False), (10, 90, 4, True), (100, 120, 0, True)]:
        kw = torch.rand(H * G, e - b, generator=g) if weights else None
        want = torch_kvzip(cache.float(), own.float(), q, b, e, sinks, qw if weights else None, kw)
        outs = []
        for block in (0, 1, 5, m):
            out = torch.full((H, N), -7.0)
            kvscore.KVzip.score_span(cache, own, q, out, b, e, sinks=sinks, query_weights=qw if weights else None,
                                     key_weights=kw, query_block=block)
            torch.testing.assert_close(out[:, b:e].double(), want, rtol=2e-5, atol=1e-12)
            assert (out[:, :b] == -7).all() and (out[:, e:] == -7).all()  # only the span is written
            outs.append(out)
        for o in outs[1:]:  # chunking over queries: bit-identical
            assert torch.equal(o, outs[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_span_scores_are_score_spans_and_its_output_is_causal_sdpa(dtype):
    """The fused pass (KVzip.attend_span): score_span's scores (to 1e-5: the same logits, the scored
    subset's softmax from the attention's exponentials), and as output the pass's
    own causal attention over the whole cache, as torch's sdpa computes it (GQA, the pass's rows
    after the cache's)."""
    g = torch.Generator().manual_seed(7)
    H, G, N, m, d = 2, 3, 120, 37, 64
    k = torch.randn(H, N + m, d, generator=g).to(dtype)
    v = torch.randn(H, N + m, d, generator=g).to(dtype)
    q = torch.randn(H * G, m, d, generator=g) * 1.5
    for b, e, sinks in [(0, N, 4), (10, 90, 4), (100, 120, 0)]:
        want = torch.full((H, N), -7.0)
        kvscore.KVzip.score_span(k[:, :N], k[:, N:], q, want, b, e, sinks=sinks)
        got = torch.full((H, N), -7.0)
        out = torch.empty(m, H * G, d)
        for block in (0, 5):
            kvscore.KVzip.attend_span(k[:, :N], k[:, N:], v[:, :N], v[:, N:], q, got, out, b, e, sinks=sinks,
                                      query_block=block)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
            mask = torch.ones(m, N + m, dtype=torch.bool).tril(N)        # query i sees the cache and own rows <= i
            sdpa = torch.nn.functional.scaled_dot_product_attention(
                q.double()[None], k.double().repeat_interleave(G, 0)[None], v.double().repeat_interleave(G, 0)[None],
                attn_mask=mask)[0]                                       # [Hq, m, d]
            torch.testing.assert_close(out.double(), sdpa.transpose(0, 1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="values: its dtype differs from the cache's"):
        kvscore.KVzip.attend_span(k[:, :N], k[:, N:], v[:, :N].float() if dtype != torch.float32 else v[:, :N].half(),
                                  v[:, N:], q, got, out, 0, N)
    with pytest.raises(ValueError, match=r"attn_out: expected float32 \[n_queries, q_heads, head_dim"):
        kvscore.KVzip.attend_span(k[:, :N], k[:, N:], v[:, :N], v[:, N:], q, got, torch.empty(m, H, d), 0, N)


def test_registry_scorer_is_attention_received():
    # in the cache, max: the window's causal attention; mean: SnapKV without pooling
    g = torch.Generator().manual_seed(1)
    K, Q = torch.randn(2, 50, 16, generator=g), torch.randn(4, 6, 16, generator=g)
    s = kvscore.KVzip(Q).score(K)
    want = torch_kvzip(K[:, :44], K[:, 44:], Q, 0, 44, 0)
    torch.testing.assert_close(s[:, :44].double(), want, rtol=2e-5, atol=1e-12)
    mean = kvscore.KVzip(Q, aggregate="mean").score(K)
    snap = kvscore.SnapKV(Q, window=6, kernel=1).score(K)
    torch.testing.assert_close(mean, snap, rtol=1e-5, atol=1e-9)
    assert kvscore.make_scorer("kvzip", Q, placement="after_cache").protected_recent == 0
    assert kvscore.KVzip(Q).protected_recent == 6
    with pytest.raises(ValueError, match="query aggregate 'median' must be 'max' or 'mean'"):
        kvscore.KVzip(Q, aggregate="median")


def test_score_span_errors():
    c, o, q = torch.randn(1, 10, 8), torch.randn(1, 3, 8), torch.randn(2, 3, 8)
    out = torch.zeros(1, 10)
    with pytest.raises(ValueError, match=r"span \[4, 12\) is not inside the cache's 10 rows"):
        kvscore.KVzip.score_span(c, o, q, out, 4, 12)
    with pytest.raises(ValueError, match="own keys have 2 rows, expected one per query"):
        kvscore.KVzip.score_span(c, o[:, :2], q, out, 0, 10)
    with pytest.raises(ValueError, match="query_block must be >= 0"):
        kvscore.KVzip.score_span(c, o, q, out, 0, 10, query_block=-2)
    with pytest.raises(ValueError, match="query_weights"):
        kvscore.KVzip.score_span(c, o, q, out, 0, 10, query_weights=torch.tensor([1.0, 0.0, 1.0]))
    with pytest.raises(TypeError, match="begin must be an integer"):
        kvscore.KVzip.score_span(c, o, q, out, 0.5, 10)


# ------------------------------------------------------------------ the press against KVzipPress

def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


@contextlib.contextmanager
def kvpress_tokenizer(tok):
    """kvpress's KVzipPress loads its tokenizer by the model's name; a random model has none."""
    from kvpress.presses import kvzip_press

    old = kvzip_press.AutoTokenizer

    class _Tok:
        @staticmethod
        def from_pretrained(*a, **k):
            return tok

    kvzip_press.AutoTokenizer = _Tok
    try:
        yield
    finally:
        kvzip_press.AutoTokenizer = old


def masked(model, press, ids):
    cache = transformers.DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    out = []
    for layer in model.model.layers:
        mk = layer.self_attn.masked_key_indices
        out.append(set(zip(mk[1].tolist(), mk[2].tolist())))
    return out, cache


@pytest.mark.parametrize("plus,layerwise,chunk,ratio", [(False, False, 2048, 0.5), (True, False, 2048, 0.75),
                                                        (False, True, 64, 0.6), (True, False, 70, 0.3)],
                         ids=["kvzip", "kvzip+", "layerwise-chunked", "kvzip+-chunked"])
def test_kept_rows_equal_kvpress_kvzip_on_a_tiny_llama(plus, layerwise, chunk, ratio):
    model, tok = tiny_llama(), ByteTokenizer()
    ids = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(1))
    with kvpress_tokenizer(tok):
        theirs, _ = masked(model, kvpress.KVzipPress(compression_ratio=ratio, kvzip_plus_normalization=plus,
                                                     layerwise=layerwise, chunk_size=chunk), ids)
    ours, cache = masked(model, KVzipPress(ratio, kvzip_plus=plus, layerwise=layerwise, chunk_size=chunk,
                                           tokenizer=tok), ids)
    total = 2 * 2 * 200
    pruned = int(total * ratio) if not layerwise else 2 * int(2 * 200 * ratio)
    assert sum(len(x) for x in ours) == sum(len(x) for x in theirs) == pruned
    for layer in range(2):
        assert ours[layer] == theirs[layer], f"layer {layer}"
        assert cache.layers[layer].keys.shape[2] == 200  # the reconstruction's rows are gone; masked, not removed
        assert not any(t < 4 for _, t in ours[layer])      # the sinks are kept
    with torch.no_grad():  # the masked cache answers through kvpress's attention patch
        out = model(input_ids=ids[:, :3], past_key_values=cache, position_ids=torch.arange(200, 203)[None])
    assert torch.isfinite(out.logits).all()


def test_kvzip_scores_and_per_head_alloc():
    """The scores are the press's own definition per pass (score_span on the reconstruction's keys and
    queries); alloc='per_head' removes rows: every head keeps compute_n_kept, chosen by kvscore.select."""
    model, tok = tiny_llama(), ByteTokenizer()
    ids = torch.randint(3, 256, (1, 150), generator=torch.Generator().manual_seed(2))
    press = KvscorePress("kvzip", 0.6, sinks=4, tokenizer=tok, chunk_size=100)
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=cache)
        timings = {}
        scores = presses.kvzip_scores(press, model, ids, cache, timings)
    assert scores.shape == (2, 2, 150) and (scores > 0).all() and (scores <= 1).all()
    assert timings["forward"] > timings["scoring"] > 0
    assert all(layer.keys.shape[2] == 150 for layer in cache.layers)

    _, cache2 = None, transformers.DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache2)
    n = compute_n_kept(150, 0.6)
    for i, layer in enumerate(cache2.layers):
        assert layer.keys.shape == (1, 2, n, 16)
        kept = kvscore.select(scores[i], n, sinks=4)
        full = cache.layers[i].keys[0]
        for h in range(2):
            torch.testing.assert_close(layer.keys[0, h], full[h, kept[h]], rtol=0, atol=0)


@pytest.mark.parametrize("plus", [False, True], ids=["kvzip", "kvzip+"])
def test_the_fused_pass_scores_as_the_unfused_one(plus):
    """fused=True (the default on CPU): the pass's attention is KVzip.attend_span's instead of the
    model's sdpa, and the scores come from the same logits. The pass's outputs differ from sdpa's in
    the last bits only, so the scores of every layer equal the unfused pass's to ~1e-5, the first
    layer's (which sees no earlier attention output) to 1e-5 relative; the pass leaves the cache as
    it found it and the model's attention implementation restored."""
    model, tok = tiny_llama(), ByteTokenizer()
    ids = torch.randint(3, 256, (1, 150), generator=torch.Generator().manual_seed(4))
    out = {}
    for fused in (True, False):
        press = KVzipPress(0.5, kvzip_plus=plus, tokenizer=tok, chunk_size=100, fused=fused)
        cache = transformers.DynamicCache()
        with torch.no_grad():
            model.model(input_ids=ids, past_key_values=cache)
            t = {}
            out[fused] = presses.kvzip_scores(press, model, ids, cache, t)
        assert t["fused"] is fused
        assert model.config._attn_implementation == "sdpa"
        assert all(layer.keys.shape[2] == 150 for layer in cache.layers)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=0)
    torch.testing.assert_close(out[True], out[False], rtol=1e-4, atol=1e-7)


def test_kvzip_press_errors():
    with pytest.raises(ValueError, match="chunk_size 0 must be >= 1"):
        KVzipPress(0.5, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size must be an integer"):
        KVzipPress(0.5, chunk_size=1.5)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['window'\]"):
        KvscorePress("kvzip", 0.5, window=8)
    model, tok = tiny_llama(), ByteTokenizer()
    ids = torch.randint(3, 256, (1, 900), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="leave no room in the model's 1024 positions"):  # 900 + a 900-token pass
        masked(model, KVzipPress(0.5, tokenizer=tok), ids)
    with pytest.raises(ValueError, match="reconstruction pass after the prefill"):
        KVzipPress(0.5).score(None, None, torch.zeros(1, 1, 4, 8), None, None, {})
    eager = transformers.LlamaForCausalLM._from_config(model.config, attn_implementation="eager").eval()
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        masked(eager, KVzipPress(0.5, tokenizer=tok), ids[:, :50])
