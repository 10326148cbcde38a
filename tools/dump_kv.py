#!/usr/bin/env python3
"""Dump a Hugging Face causal LM's KV cache and queries for `kvscore eval` (docs/evaluate.md).

    python3 tools/dump_kv.py --model MODEL --text prompt.txt --window 32 --out DIR [--layers 0,4,8]
    python3 tools/dump_kv.py --self-test      # tiny random Llama from a config, no download

Runs the model once over the text (truncated to --max-tokens). The last `w = --window` tokens
are the "queries"; the tokens before them are the cache. Writes to DIR (float16, C order):

    K.npy      [layers, kv_heads, N - w, head_dim]   post-RoPE keys of the cache tokens
    V.npy      [layers, kv_heads, N - w, head_dim]   their values
    Q.npy      [layers, q_heads, w, head_dim]        post-RoPE queries of the last w positions
    meta.json  model, layers, sizes, the window

Keys and values come from the model's own cache (past_key_values); queries are captured by
a forward pre-hook on every attention module that recomputes q_proj (+ q_norm where the
model has one) and applies the model's own apply_rotary_pos_emb to the position embeddings
the module receives. The window tokens are not in K/V, so the queries attend to a cache
that does not contain them, the evaluator's "queries after compression" (no causal mask).

Needs torch, transformers and numpy (not needed by kvscore itself). Exit codes: 0 ok,
2 bad input, 77 self-test skipped (torch/transformers missing), 1 self-test failed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile


def _need_libs(self_test: bool):
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        msg = f"dump_kv: needs torch, transformers and numpy ({e})"
        if self_test:
            print(msg + "; self-test skipped", file=sys.stderr)
            sys.exit(77)
        print(msg, file=sys.stderr)
        sys.exit(2)


def _attention_modules(model):
    """(layer index, attention module) for every decoder layer."""
    layers = None
    for path in ("model.layers", "model.decoder.layers", "transformer.h"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            layers = obj
            break
        except AttributeError:
            continue
    if layers is None:
        raise SystemExit("dump_kv: cannot find the decoder layers of this model")
    out = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
        if attn is None or not hasattr(attn, "q_proj"):
            raise SystemExit(f"dump_kv: layer {i} has no self_attn.q_proj (only Llama-style attention is supported)")
        out.append((i, attn))
    return out


def _cache_kv(pkv, layer):
    """(keys, values) [batch, kv_heads, N, d] of one layer from any transformers cache type."""
    if hasattr(pkv, "layers"):  # transformers >= 4.56
        return pkv.layers[layer].keys, pkv.layers[layer].values
    if hasattr(pkv, "key_cache"):
        return pkv.key_cache[layer], pkv.value_cache[layer]
    return pkv[layer][0], pkv[layer][1]


def dump(model, input_ids, window: int, out: pathlib.Path, layers=None, keep_full=False):
    """Runs the model and writes K, V, Q (+ meta.json). Returns the arrays (fp32) when keep_full."""
    import numpy as np
    import torch

    n = input_ids.shape[1]
    if not 1 <= window < n:
        raise SystemExit(f"dump_kv: --window {window} must be in [1, {n - 1}] for {n} tokens")
    attn_mods = _attention_modules(model)
    wanted = list(range(len(attn_mods))) if layers is None else layers
    for l in wanted:
        if not 0 <= l < len(attn_mods):
            raise SystemExit(f"dump_kv: layer {l} out of range [0, {len(attn_mods)})")
    cfg = model.config
    q_heads = cfg.num_attention_heads
    captured = {}

    def make_hook(idx, attn):
        mod = sys.modules[type(attn).__module__]
        rope = getattr(mod, "apply_rotary_pos_emb")

        def hook(module, args, kwargs):
            hs = kwargs.get("hidden_states", args[0] if args else None)
            pe = kwargs.get("position_embeddings")
            if pe is None:
                raise SystemExit("dump_kv: the attention module got no position_embeddings "
                                 "(needs transformers >= 4.45 and a RoPE model)")
            d = getattr(module, "head_dim", cfg.hidden_size // q_heads)
            b, t, _ = hs.shape
            q = module.q_proj(hs).view(b, t, -1, d)
            if hasattr(module, "q_norm"):
                q = module.q_norm(q)
            q = q.transpose(1, 2)
            cos, sin = pe
            q, _ = rope(q, q, cos, sin)
            captured[idx] = q[0, :, -window:, :].detach().float().cpu().numpy()

        return hook

    handles = [attn.register_forward_pre_hook(make_hook(i, attn), with_kwargs=True)
               for i, attn in attn_mods if i in wanted]
    try:
        with torch.no_grad():
            res = model(input_ids=input_ids, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    pkv = res.past_key_values
    K, V, Q, full = [], [], [], []
    for l in wanted:
        k, v = _cache_kv(pkv, l)
        k = k[0].float().cpu().numpy()
        v = v[0].float().cpu().numpy()
        full.append((k, v))
        K.append(k[:, : n - window, :])
        V.append(v[:, : n - window, :])
        Q.append(captured[l])
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "K.npy", np.ascontiguousarray(np.stack(K)).astype(np.float16))
    np.save(out / "V.npy", np.ascontiguousarray(np.stack(V)).astype(np.float16))
    np.save(out / "Q.npy", np.ascontiguousarray(np.stack(Q)).astype(np.float16))
    meta = {"model": getattr(cfg, "_name_or_path", ""), "layers": wanted, "tokens": n - window, "window": window,
            "kv_heads": int(K[0].shape[0]), "q_heads": int(Q[0].shape[0]), "head_dim": int(K[0].shape[2])}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return (full, Q) if keep_full else None


def self_test() -> int:
    _need_libs(True)
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    try:
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    except TypeError:
        model = LlamaForCausalLM(cfg)
    model.eval()
    n, w = 40, 8
    ids = torch.randint(0, 128, (1, n))
    # the attention output before o_proj of the last position, per layer
    outs = {}
    hooks = [attn.o_proj.register_forward_pre_hook(
        (lambda i: lambda m, a: outs.__setitem__(i, a[0][0, -1].detach().float().numpy()))(i))
        for i, attn in _attention_modules(model)]
    with tempfile.TemporaryDirectory() as tmp:
        full, Q = dump(model, ids, w, pathlib.Path(tmp), keep_full=True)
        for h in hooks:
            h.remove()
        K = np.load(pathlib.Path(tmp) / "K.npy")
        Qf = np.load(pathlib.Path(tmp) / "Q.npy")
        ok = K.shape == (2, 2, n - w, 16) and Qf.shape == (2, 4, w, 16) and K.dtype == np.float16
        if not ok:
            print(f"dump_kv self-test: unexpected shapes K {K.shape} Q {Qf.shape} {K.dtype}", file=sys.stderr)
            return 1
        d, G = 16, 2
        worst = 0.0
        for l in range(2):
            k, v = full[l]
            for hq in range(4):
                q = Q[l][hq, -1]  # the last position sees every token (causal)
                logits = k[hq // G] @ q / np.sqrt(d)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                o = p @ v[hq // G]
                ref = outs[l][hq * d:(hq + 1) * d]
                worst = max(worst, float(np.abs(o - ref).max() / (np.abs(ref).max() + 1e-12)))
        if worst > 1e-4:
            print(f"dump_kv self-test: attention from the dump differs from the model's by {worst:.2e}", file=sys.stderr)
            return 1
    print(f"dump_kv self-test: ok (max relative difference {worst:.1e})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="Hugging Face model id or local path")
    ap.add_argument("--text", help="text file to run the model on")
    ap.add_argument("--window", type=int, default=32, help="last tokens used as queries (default 32)")
    ap.add_argument("--out", help="output directory")
    ap.add_argument("--layers", default="all", help="'all' or a comma list of layer indices")
    ap.add_argument("--max-tokens", type=int, default=4096, help="truncate the text to this many tokens")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu)")
    ap.add_argument("--self-test", action="store_true", help="check the dump on a tiny random model and exit")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not (a.model and a.text and a.out):
        ap.error("--model, --text and --out are required (or --self-test)")
    _need_libs(False)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = pathlib.Path(a.text).read_text()
    tok = AutoTokenizer.from_pretrained(a.model)
    ids = tok(text, return_tensors="pt").input_ids[:, : a.max_tokens].to(a.device)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32).to(a.device).eval()
    layers = None if a.layers == "all" else [int(x) for x in a.layers.split(",")]
    dump(model, ids, a.window, pathlib.Path(a.out), layers)
    print(f"dump_kv: wrote {a.out}/K.npy, V.npy, Q.npy, meta.json ({ids.shape[1]} tokens, window {a.window})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
