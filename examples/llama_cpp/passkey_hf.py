"""passkey.py's harder needle (--hard) in Python, to tell what llama.cpp's cells cost KVzip from what
the method itself loses (docs/results/kvzip.md#passkey-inside-llamacpp): the same prompts (same seeds, the
same prose, keys and distractors), SmolLM2-135M-Instruct from the same GGUF file dequantized to fp32
(kvscore.quality.load_model), kvpress's pipeline with kvscore's KVzipPress under three allocations:
`adakv` with alpha 0 (kvpress KVzipPress's one top-k over every layer and head), `per_head` (every
KV head of every layer the same count: what `kvscore_llama --alloc per_head` keeps) and `joint` (one
set of positions for every head and layer: llama.cpp's default). The pipeline applies the model's
chat template to the context (SmolLM2's adds its default system line) and asks the question after
the compressed cache, the answer starting "The pass key is". Each record also has `widest_head`, the
largest share of the context one (layer, KV head) keeps: the cells llama.cpp would need for that
allocation.

`--allocs full_heads` (with `--full-heads M`) asks what a cache with a length per head would answer at
the same memory: the M (layer, KV head) rows to which the global allocation gives the most keep the
whole context, every other row the same count, the total the global allocation's (through the adakv
press's masks; no llama.cpp cache can hold it). Each record has `full_rows`, the rows the global
allocation gives the most, widest first, as [layer, head].

  python examples/llama_cpp/passkey_hf.py [--seeds 0,1] [--ratios 0.5,0.75] [--out hf.json]
"""
import argparse
import json
import pathlib
import random
import sys
import time

import torch

import kvscore
from kvscore import _kvscore

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import passkey  # noqa: E402  (the prompts: hard_text, PROSE)

QUESTION = "\nWhat is the pass key? Answer with the number only."
ALLOCS = ("adakv", "per_head", "joint")


def full_heads_select(press, scores, m):
    """The global allocation's total kept (layer, head, token) entries spread as: the m rows it gives
    the most keep every token, the others share the rest equally (each its own top tokens, the
    lowest positions first on ties); also the rows, widest first."""
    L, H, n = scores.shape
    rows = scores.reshape(L * H, n).numpy()
    total = L * H * n - int(L * H * n * press.compression_ratio)
    counts = [len(x) for x in _kvscore.select_total(rows, total, sinks=press.sinks, recent=press.recent,
                                                    alpha=press.alpha)]
    order = sorted(range(L * H), key=lambda r: (-counts[r], r))
    full = set(order[:m])
    rest = max(0, (total - m * n) // (L * H - m))
    kept = [list(range(n)) if r in full else kvscore.select(rows[r][None], max(rest, press.sinks + press.recent),
                                                             sinks=press.sinks, recent=press.recent)[0]
            for r in range(L * H)]
    return [[torch.as_tensor(kept[i * H + h], dtype=torch.int64) for h in range(H)] for i in range(L)], \
        [list(divmod(r, H)) for r in order[:max(m, 6)]]


def prompts(tok, seed, tokens, depths):
    """(depth, key, text) as `passkey.py --hard --seed seed` draws them (its tokenizer's count per
    word: SmolLM2's, the same vocabulary here)."""
    rng = random.Random(seed)
    sample = " ".join(open(passkey.PROSE).read().split()[:400])
    per_word = len(tok.encode(sample, add_special_tokens=False)) / 400
    out = []
    for depth in depths:
        key = str(rng.randrange(10000, 100000))
        out.append((depth, key, passkey.hard_text(rng, tokens, per_word, key, depth)))
    return out


def summary(records, ratios, allocs):
    """The table: answers holding the key per allocation and compression ratio."""
    count = lambda c: f"{sum(c)}/{len(c)}"  # noqa: E731
    rows = [("full cache", [count([x["correct"] for x in records if x["alloc"] == "full"])])]
    rows += [(al, [count([x["correct"] for x in records if x["alloc"] == al and x["ratio"] == r]) for r in ratios])
             for al in allocs]
    return passkey.table("allocation", [f"compression {r:g}" for r in ratios], rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the SmolLM2 GGUF file (default: kvscore.quality's search)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--ratios", default="0.5,0.75", help="compression ratios (keep 0.5 / 0.25)")
    ap.add_argument("--allocs", default=",".join(ALLOCS), help="of " + ", ".join(ALLOCS) + ", full_heads")
    ap.add_argument("--full-heads", type=int, default=3, help="full_heads: the rows that keep everything")
    ap.add_argument("--out", help="write the records as JSON")
    a = ap.parse_args()
    import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)
    from transformers import pipeline

    from kvscore import presses
    from kvscore.presses import KVzipPress
    from kvscore.quality import load_model

    # the largest share of the context any (layer, KV head) keeps: the cells llama.cpp would need
    # to hold the allocation (one cell array for every layer, a slot in every head)
    widest, full_rows = [], []
    select = presses.kvzip_select

    def kvzip_select(press, scores):
        if getattr(press, "full_heads", None) is not None:
            kept, rows = full_heads_select(press, scores, press.full_heads)
            full_rows.append(rows)
        else:
            kept = select(press, scores)
        widest.append(max(len(h) for layer in kept for h in layer) / scores.shape[-1])
        return kept

    presses.kvzip_select = kvzip_select

    model, tok = load_model(a.model)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    depths = [float(x) for x in a.depths.split(",")]
    ratios = [float(x) for x in a.ratios.split(",")]
    allocs = a.allocs.split(",")
    records = []
    for seed in (int(s) for s in a.seeds.split(",")):
        for depth, key, text in prompts(tok, seed, a.tokens, depths):
            runs = [("full", 0.0)] + [(al, r) for r in ratios for al in allocs]
            for alloc, ratio in runs:
                press = None if alloc == "full" else \
                    KVzipPress(ratio, alloc="adakv" if alloc == "full_heads" else alloc, tokenizer=tok)
                if alloc == "full_heads":
                    press.full_heads = a.full_heads
                t0 = time.perf_counter()
                answer = pipe(text, question=QUESTION, answer_prefix="The pass key is", press=press,
                              max_new_tokens=8)["answer"]
                rec = {"seed": seed, "depth": depth, "key": key, "alloc": alloc, "ratio": ratio, "answer": answer,
                       "correct": key in answer, "seconds": round(time.perf_counter() - t0, 2)}
                if press is not None:
                    rec["widest_head"] = round(widest.pop(), 3)
                if alloc == "full_heads":
                    rec["full_rows"] = full_rows.pop()
                records.append(rec)
                print(json.dumps(rec), flush=True)
    print("\n" + summary(records, ratios, allocs))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
