#!/usr/bin/env python3
"""Python-side benchmark (docs/reference/python.md): one run, ratios measured in the same run.

1. Call overhead: ManifoldL2 score + select of a 32-head x 4K fp16 cache from Python vs the same
   work timed inside C++ (kvscore._kvscore._bench_score_select), best of R, one thread.
2. kvscore.select vs torch.topk (per head, k = N/8) on the same fp32 scores [32, N], N = 4K .. 1M,
   one thread each (torch.set_num_threads(1)), best of R.
Prints a Markdown table and the ISA kvscore dispatched to. Timings, not tests.
"""
import argparse
import time

import numpy as np
import torch

import kvscore
from kvscore import _kvscore


def best(f, reps):
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t.append(time.perf_counter() - t0)
    return min(t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-n", type=int, default=1 << 20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"kvscore {kvscore.__version__}, ISA {kvscore.isa()} (available: {', '.join(kvscore.isas())}), "
          f"torch {torch.__version__}, 1 thread\n")

    K = torch.from_numpy(rng.standard_normal((32, 4096, 128)).astype(np.float16))
    n = 512
    cpp = _kvscore._bench_score_select(K, n, a.reps, 1)
    scorer = kvscore.ManifoldL2(threads=1)
    py = best(lambda: kvscore.select(scorer.score(K), n, threads=1), a.reps)
    print("| call (32 heads x 4096 tokens x 128, fp16, keep 512) | ms | vs C++ |")
    print("| --- | ---: | ---: |")
    print(f"| C++ score + select (timed inside C++) | {cpp * 1e3:.3f} | 1.00 |")
    print(f"| Python kvscore.select(ManifoldL2().score(K), 512) (torch in/out) | {py * 1e3:.3f} | {py / cpp:.3f} |\n")

    print("| N (32 heads, k = N/8) | kvscore.select ms | torch.topk ms | topk / select |")
    print("| ---: | ---: | ---: | ---: |")
    N = 4096
    while N <= a.max_n:
        s = torch.from_numpy(rng.standard_normal((32, N)).astype(np.float32))
        k = N // 8
        reps = max(3, a.reps if N <= 65536 else a.reps // 4)
        ts = best(lambda: kvscore.select(s, k, threads=1), reps)
        tt = best(lambda: torch.topk(s, k, dim=-1, sorted=False), reps)
        print(f"| {N} | {ts * 1e3:.3f} | {tt * 1e3:.3f} | {tt / ts:.1f} |")
        N *= 4


if __name__ == "__main__":
    main()
