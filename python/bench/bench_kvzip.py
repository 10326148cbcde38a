#!/usr/bin/env python3
"""What KVzip's scoring costs against its reconstruction pass (docs/results/kvzip.md#what-it-costs): a
benchmark, not a test. A licence text cut to --tokens tokens in SmolLM2's chat template is
prefilled; then, interleaved --reps times on copies of that cache:

- plain: the reconstruction pass(es) alone — the model's forward with its own attention (sdpa),
  nothing scored: what the pass costs in any case;
- score_span: kvscore.presses.kvzip_scores with fused=False — the model's attention, then each
  layer's hook scores the pass (KVzip::score_span recomputes its logits); the hooks' time split
  into score_span, the queries' RoPE and the rest;
- fused: kvzip_scores with fused=True (the default on CPU) — the pass's attention is
  KVzip::attend_span, which writes the output and the scores from one set of logits.

Printed: each one's seconds and its cost over plain (the scoring's cost against the pass's
forward). --threads is torch's and the scorer's.

  python python/bench/bench_kvzip.py --model .models/smollm2-safetensors [--tokens 1024] [--plus]
"""
import argparse
import copy
import time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a transformers model folder (SmolLM2 as safetensors)")
    ap.add_argument("--tokens", type=int, default=1024, help="context tokens before the template (default 1024)")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--plus", action="store_true", help="KVzip+'s normalization")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    import kvscore.presses as P

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    text = tok.decode(tok.encode(open(a.text).read())[: a.tokens])
    chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(chat, add_special_tokens=False)])
    acc = {}

    def timed(name, f):
        def g(*args, **kw):
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                acc[name] += time.perf_counter() - t
        return g

    cache0 = DynamicCache()
    t = time.perf_counter()
    with torch.inference_mode():
        model.model(input_ids=ids, past_key_values=cache0)
    print(f"{ids.shape[1]} tokens, {a.threads} thread(s), KVzip{'+' if a.plus else ''}: prefill "
          f"{time.perf_counter() - t:.2f} s", flush=True)
    prefix, suffix = P.kvzip_template(tok)
    passes = P.kvzip_passes(tok, ids, prefix, P.KVZIP_CHUNK_SIZE, suffix)
    span, rope = P._kv.KVzip.score_span, P._rope
    P._kv.KVzip.score_span, P._rope = timed("span", span), timed("rope", rope)
    rows = {"plain": [], "score_span": [], "fused": []}
    try:
        for _ in range(a.reps):
            cache = copy.deepcopy(cache0)
            t = time.perf_counter()
            with torch.inference_mode():
                for _, _, p in passes:
                    model.model(input_ids=p, past_key_values=cache)
                    for layer in cache.layers:
                        layer.keys, layer.values = layer.keys[:, :, :ids.shape[1]], layer.values[:, :, :ids.shape[1]]
            rows["plain"].append(time.perf_counter() - t)
            for fused in (False, True):
                acc.update(span=0.0, rope=0.0)
                press = P.KVzipPress(0.5, kvzip_plus=a.plus, threads=a.threads, fused=fused, tokenizer=tok)
                tm = {}
                P.kvzip_scores(press, model, ids, copy.deepcopy(cache0), tm)
                assert tm["fused"] is fused
                rows["fused" if fused else "score_span"].append((tm["forward"], tm["scoring"], acc["span"], acc["rope"]))
    finally:
        P._kv.KVzip.score_span, P._rope = span, rope
    plain = min(rows["plain"])
    print(f"  plain pass (sdpa, nothing scored): {plain:.2f} s (best of {a.reps})")
    f, h, sp, ro = min(rows["score_span"])
    print(f"  score_span path: {f:.2f} s, +{100 * (f - plain) / plain:.1f} % over plain (hooks {h:.2f} s: score_span "
          f"{sp:.2f}, RoPE {ro:.2f}, rest {h - sp - ro:.2f}; {100 * h / (f - h):.1f} % of its own forward)")
    f, h, _, _ = min(rows["fused"])
    print(f"  fused path: {f:.2f} s, {100 * (f - plain) / plain:+.1f} % over plain (attend_span and the rows' cut "
          f"{h:.2f} s)")


if __name__ == "__main__":
    main()
