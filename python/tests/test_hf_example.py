"""examples/python/hf_compress.py: prefill -> kvscore score/select/compact on a DynamicCache ->
generate continues, on small Llama and Qwen2 models built from configs (GQA, RoPE)."""

import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvscore  # noqa: E402

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples/python/hf_compress.py"


def load_example():
    spec = importlib.util.spec_from_file_location("hf_compress", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny(kind):
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    if kind == "llama":
        return transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**common),
                                                          attn_implementation="eager").eval()
    return transformers.Qwen2ForCausalLM._from_config(transformers.Qwen2Config(**common),
                                                      attn_implementation="eager").eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_keeping_everything_generates_exactly_what_plain_generate_does(kind):
    ex = load_example()
    model = tiny(kind)
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                               pad_token_id=0)[:, ids.shape[1]:]
    got, lengths = ex.prefill_compress_generate(model, ids, keep=1.0, max_new_tokens=8)
    assert lengths == [119, 119]
    torch.testing.assert_close(got, plain, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["manifold_l2", "knorm", "snapkv", "windowed_manifold_l2"])
def test_compressed_cache_holds_the_selected_rows_and_generation_continues(method):
    ex = load_example()
    model = tiny("qwen2")
    ids = torch.randint(0, 256, (1, 161), generator=torch.Generator().manual_seed(6))
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=cache)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    opts = {"window": 32} if method == "windowed_manifold_l2" else {}
    queries = None
    if method == "snapkv":
        queries, hooks = ex.window_queries(model, ids[:, :-1], 16)
        with torch.no_grad():
            model(input_ids=ids[:, :-1])
        for h in hooks:
            h.remove()
        opts = {"window": 16}
    lengths = ex.compress_cache(cache, method, 0.25, 4, 16, queries, **opts)
    n = kvscore.budget_from_ratio(160, 0.25)
    assert lengths == [n, n]
    for i, layer in enumerate(cache.layers):
        k0, v0 = before[i]
        scorer = (kvscore.make_scorer(method, queries[i], **opts) if queries is not None
                  else kvscore.make_scorer(method, **opts))
        sel = kvscore.select(scorer.score(k0), n, sinks=4, recent=max(16, scorer.protected_recent))
        for h in range(k0.shape[1]):
            torch.testing.assert_close(layer.keys[0, h], k0[0, h, sel[h]], rtol=0, atol=0)
            torch.testing.assert_close(layer.values[0, h], v0[0, h, sel[h]], rtol=0, atol=0)
    out, lengths = ex.prefill_compress_generate(model, ids, method=method, keep=0.25, max_new_tokens=6,
                                                window=32 if method == "windowed_manifold_l2" else 16)
    assert out.shape == (1, 6)
