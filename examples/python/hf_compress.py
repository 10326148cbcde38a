#!/usr/bin/env python3
"""Compress a Hugging Face model's DynamicCache after prefill with kvscore; generate continues.

    python examples/python/hf_compress.py                       # a small random Llama (no download)
    python examples/python/hf_compress.py --model DIR --text prompt.txt --keep 0.25 --method snapkv

Per layer of the prefilled cache (keys/values [1, kv_heads, N, head_dim], any dtype, read in place):

    scores = scorer.score(keys)                                  # fp32 [kv_heads, N]
    keep   = kvscore.select(scores, n, sinks=4, recent=16)      # int64 [kv_heads, n], ascending
    kvscore.compact(keys, values, keep)                          # in place: kept rows first
    layer.keys, layer.values = keys[:, :, :n], values[:, :, :n]

The prompt's last token is held back from the prefill and fed to `generate`, with its true
position (`position_ids`), so RoPE sees the original positions although the cache is shorter.
"""

from __future__ import annotations

import argparse
import sys

import torch

import kvscore


def window_queries(model, ids, window: int):
    """Post-RoPE queries of the last `window` prompt positions per layer, [1, q_heads, window, d],
    captured with forward hooks during the prefill (for snapkv / protokv)."""
    import transformers.models.llama.modeling_llama as llama

    captured, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def hook(module, args, kwargs, i=i):
            hs = kwargs["hidden_states"]
            cos, sin = kwargs["position_embeddings"]
            b, t, _ = hs.shape
            q = module.q_proj(hs).view(b, t, -1, module.head_dim).transpose(1, 2)
            q, _ = llama.apply_rotary_pos_emb(q, q, cos, sin)
            captured[i] = q[:, :, -window:].detach().float()

        hooks.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    return captured, hooks


def needs_queries(method: str) -> bool:
    """Whether a method is scored by the window's queries (the registry's query scorers)."""
    return any(m["name"] == kvscore.method_name(method) and m["kind"] == "query_scorer" for m in kvscore.REGISTRY)


def compress_cache(cache, method: str, keep: float, sinks: int = 4, recent: int = 16, queries=None, **opts):
    """Compresses every layer of a DynamicCache in place; returns the kept length per layer."""
    lengths = []
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys, layer.values
        if k.shape[0] != 1:
            raise ValueError("this example compresses one sequence (batch 1)")
        n = kvscore.budget_from_ratio(k.shape[2], keep)
        if needs_queries(method):
            scorer = kvscore.make_scorer(method, queries[i], **opts)
        else:
            scorer = kvscore.make_scorer(method, **opts)
        protect = max(recent, scorer.protected_recent)
        sel = kvscore.select(scorer.score(k), n, sinks=sinks, recent=protect)
        kvscore.compact(k, v, sel)
        layer.keys, layer.values = k[:, :, :n], v[:, :, :n]
        lengths.append(n)
    return lengths


def prefill_compress_generate(model, ids, *, method="manifold_l2", keep=0.5, sinks=4, recent=16, window=16,
                              max_new_tokens=16, **opts):
    """Prefill ids[:, :-1], compress the cache, generate from the last prompt token. Returns
    (generated token ids [1, max_new_tokens], kept length per layer)."""
    from transformers import DynamicCache

    N = ids.shape[1]
    cache = DynamicCache()
    queries, hooks = (window_queries(model, ids[:, :-1], window) if needs_queries(method) else ({}, []))
    try:
        with torch.no_grad():
            model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    if needs_queries(method) or kvscore.method_name(method) == kvscore.WindowedManifoldL2.name:
        opts["window"] = window  # the observation window / ManifoldKV's window
    lengths = compress_cache(cache, method, keep, sinks, recent, queries, **opts)
    n = lengths[0]
    # input_ids: n placeholders (already in the cache; generate feeds only what follows them) + the
    # last prompt token; position_ids: its true position N - 1 (generate advances them).
    gen_ids = torch.cat([ids[:, :n], ids[:, -1:]], 1)
    pos = torch.arange(N - 1 - n, N).unsqueeze(0)
    with torch.no_grad():
        out = model.generate(input_ids=gen_ids, past_key_values=cache, position_ids=pos,
                             attention_mask=torch.ones_like(gen_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[:, gen_ids.shape[1]:], lengths


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="eager").eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local Hugging Face causal LM directory (default: a small random Llama)")
    ap.add_argument("--text", help="prompt file (default: random tokens)")
    ap.add_argument("--method", default="manifold_l2", help="a kvscore method (kvscore.METHODS)")
    ap.add_argument("--keep", type=float, default=0.5, help="fraction of the cache kept (default 0.5)")
    ap.add_argument("--tokens", type=int, default=256, help="random prompt length without --text")
    ap.add_argument("--new", type=int, default=16, help="tokens to generate")
    a = ap.parse_args()
    if a.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation="eager").eval()
        ids = tok(open(a.text).read() if a.text else "Hello " * 200, return_tensors="pt").input_ids
    else:
        model = tiny_llama()
        ids = torch.randint(0, 256, (1, a.tokens), generator=torch.Generator().manual_seed(0))
    full, _ = prefill_compress_generate(model, ids, method=a.method, keep=1.0, max_new_tokens=a.new)
    comp, lengths = prefill_compress_generate(model, ids, method=a.method, keep=a.keep, max_new_tokens=a.new)
    same = int((full == comp).sum())
    print(f"{a.method}: cache {ids.shape[1] - 1} -> {lengths[0]} tokens per head; "
          f"{same}/{a.new} generated tokens equal the uncompressed run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
