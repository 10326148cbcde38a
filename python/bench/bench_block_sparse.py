"""Which block score (docs/results/block-sparse.md#which-score): on a model's own keys and
queries dumped by tools/dump_kv.py (leak-free: a context, then its following tokens), for every
layer and query head, the share of the full attention's mass that the blocks a decode step
attends hold, and the share of the attention on chosen `--needle` tokens (e.g. the number a
question asks for) they hold whole. Every score through kvscore's block_sparse_reference (the
choice PagedBlockSelector makes), plus the protected blocks alone and the exact score with a
block table per KV head (what per-head tables would gain). A benchmark, never a test.

    python python/bench/bench_block_sparse.py DUMP_DIR --context-text ctx.txt --needle 365 [--attend 0.1]
"""
import argparse
import json

import numpy as np

from kvscore import _kvscore as _k


def needle_positions(tokenizer_dir, text, needle):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    pos = text.find(" " + needle)
    if pos < 0:
        raise SystemExit(f"the needle {needle!r} is not in the context")
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < pos + len(needle) + 1 and b > pos]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump")
    ap.add_argument("--context-text", required=True, help="the dumped context's text (dump_kv.py --text)")
    ap.add_argument("--tokenizer", default=".models/smollm2-safetensors")
    ap.add_argument("--needle", required=True)
    ap.add_argument("--attend", type=float, default=0.1)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    K = np.load(f"{a.dump}/K.npy").astype(np.float32)        # [L, H, T, D] post-RoPE
    Qw = np.load(f"{a.dump}/Qwin.npy").astype(np.float32)    # the context's last queries
    L, H, T, D = K.shape
    QH = Qw.shape[1]
    G, bs, scale = QH // H, a.block_size, 1 / np.sqrt(D)
    span = needle_positions(a.tokenizer, open(a.context_text).read(), a.needle)
    att = int(_k.attended_blocks(T, bs, a.attend))
    q = Qw[:, :, -1]  # the query that generates the answer's first token
    probs = []
    for l in range(L):
        s = np.einsum("hgd,htd->hgt", q[l].reshape(H, G, D), K[l]).reshape(QH, T) * scale
        p = np.exp(s - s.max(1, keepdims=True))
        probs.append(p / p.sum(1, keepdims=True))

    def measure(masks):  # masks[l]: [QH, T] bool
        mass = np.mean([(probs[l] * np.broadcast_to(m, (QH, T))).sum() / QH for l, m in enumerate(masks)])
        tot = sum(probs[l][:, span].sum() for l in range(L))
        cov = 0.0
        for l, m in enumerate(masks):
            mm = np.broadcast_to(m, (QH, T))
            cov += sum(probs[l][j, span].sum() for j in range(QH) if mm[j, span].all())
        return float(mass), float(cov / tot)

    def mask_of(blocks):
        m = np.zeros(T, bool)
        for b in blocks:
            m[b * bs:(b + 1) * bs] = True
        return m

    rows = {}
    nb = -(-T // bs)
    prot = [0] + list(range(max(0, T - 64) // bs, nb))
    rows["sinks + local only"] = measure([mask_of(prot)] * L)
    for score in ("quest", "meanstd", "int4", "pariskv", "exact"):
        rows[score] = measure([mask_of(_k.block_sparse_reference(np.ascontiguousarray(K[l]), np.ascontiguousarray(q[l]),
                                                                 bs, att, score=score)) for l in range(L)])
    per_head = []
    for l in range(L):
        m = np.zeros((QH, T), bool)
        for h in range(H):
            blocks = _k.block_sparse_reference(np.ascontiguousarray(K[l, h:h + 1]),
                                               np.ascontiguousarray(q[l, h * G:(h + 1) * G]), bs, att, score="exact")
            m[h * G:(h + 1) * G] = mask_of(blocks)
        per_head.append(m)
    rows["exact, a table per KV head"] = measure(per_head)
    print(f"{T} tokens, {att} of {nb} blocks attended, needle tokens {span[0]}..{span[-1]}")
    for k, (m, c) in rows.items():
        print(f"  {k:28s} attention mass {m:.3f}   needle's attention covered {c:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tokens": T, "attended_blocks": att, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
