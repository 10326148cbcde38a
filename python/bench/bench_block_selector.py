"""The cost of sparse decode's block choice (docs/reference/block_sparse.md#the-block-scores): kvscore's
PagedBlockSelector (kvscore.vllm's, through the binding) on a vLLM-CPU-layout pool with SmolLM2's
shapes (30 layers, 9 query and 3 KV heads, head_dim 64, blocks of 32 tokens), B requests of
~7.6K tokens, 10 % of the blocks attended; per decode step, against the dense attention it
replaces, measured in the same run: torch's scaled_dot_product_attention of each request's query
over all its keys and values, every layer. Random keys (the speed, not the choice). A benchmark,
never a test.

    python python/bench/bench_block_selector.py [--batch 8] [--refresh 1] [--steps 41] [--score int4]
                                                [--prefilter 0] [--threads N]   (defaults: the library's)
"""
import argparse
import time

import numpy as np
import torch

from kvscore import _kvscore as _k

L, KH, QH, D, BS = 30, 3, 9, 64, 32


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=7680)
    ap.add_argument("--attend", type=float, default=0.1)
    dflt = _k.struct_defaults["BlockSparseOptions"]
    ap.add_argument("--refresh", type=int, default=dflt["refresh"])
    ap.add_argument("--steps", type=int, default=41, help="decode steps after the first (which makes every summary)")
    ap.add_argument("--score", default="int4")
    ap.add_argument("--prefilter", type=int, default=dflt["prefilter"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--group", default="heads", help="query group: heads or mean")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time (all threads), steadier on a machine shared with other work")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    B = a.batch
    per = (a.tokens + a.steps) // BS + 2
    nb = B * per
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(nb, KH, BS, 2 * D, generator=g)        # vLLM CPU's [blocks, kv_heads, block, 2·head_dim]
    sel = _k.PagedBlockSelector(L, nb, KH, D, BS, score=a.score, refresh=a.refresh, prefilter=a.prefilter,
                                threads=a.threads, group=a.group)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    sel.register_caches([kv] * L)  # every layer reads the same pool here (the speed, not the choice)
    src = torch.arange(nb, dtype=torch.int32).view(B, per)
    dst = src.clone().numpy()
    rows = np.arange(B, dtype=np.int64)
    first = src[:, 0].numpy().astype(np.int64)
    tok = np.full(B, a.tokens, dtype=np.int64)
    # dense attention over the same number of keys per request (SDPA, GQA expanded as vLLM's kernel reads it)
    keys = torch.randn(B, KH, a.tokens, D, generator=g).repeat_interleave(QH // KH, dim=1)
    vals = torch.randn_like(keys)
    times, fresh = [], []
    for s in range(a.steps + 1):
        slots = (first + tok // BS) * BS + tok % BS
        tok += 1
        attend = np.ceil(a.attend * tok / BS).astype(np.int64)
        q = torch.randn(B, QH, D, generator=g)
        t0 = clock()
        sel.begin_step(slots, first)
        sel.plan(rows, src, rows, tok, attend, dst)  # as kvscore.vllm drives it: the rows once per step
        f = 0
        for layer in range(L):
            f += sel.select_planned(layer, kv, q)
        times.append(clock() - t0)
        fresh.append(f > 0)
    t = np.array(times[1:]) * 1e3
    fr = np.array(fresh[1:])
    qd = torch.randn(B, QH, 1, D, generator=g)
    dense = []
    for _ in range(5):
        t0 = clock()
        for layer in range(L):
            torch.nn.functional.scaled_dot_product_attention(qd, keys, vals)
        dense.append(clock() - t0)
    dense_ms = 1e3 * float(np.median(dense))
    print(f"batch {B}, {a.tokens} tokens, attend {a.attend}, {a.score} prefilter {a.prefilter}, refresh {a.refresh}, "
          f"group {a.group}, {a.threads} threads, {a.clock} time: first step {times[0] * 1e3:.0f} ms (every summary), then {t.mean():.2f} ms/step "
          f"(scoring steps {t[fr].mean():.2f} ms = {t[fr].mean() / (B * L):.3f} ms per request and layer; "
          f"the others {t[~fr].mean() if (~fr).any() else float('nan'):.2f} ms); dense attention (torch SDPA, "
          f"same keys) {dense_ms:.2f} ms/step: selection {100 * t.mean() / dense_ms:.1f} % of it")


if __name__ == "__main__":
    main()
