#!/usr/bin/env python3
"""Batched top-k: kvscore::cuda against torch.topk on the same GPU, in the same run.

Runs `kvscore_cuda_bench --benchmark_filter=BM_cuda_topk` (JSON) and times torch.topk on the
same shapes (rows x N random fp32, k = N/10 and N/2) with CUDA events, best of 20 after a
warm-up. torch.topk is called with sorted=False (kvscore does not sort either: it returns the
kept positions in ascending order). Prints one line per shape with both times and the speed-up
(goal of issue 7: >= 3x), plus kvscore's bandwidth_fraction.

Runs only where PyTorch with CUDA is present; otherwise prints why and exits 0.

    python3 cuda/bench/torch_topk.py build-cuda/cuda/kvscore_cuda_bench
"""
import json
import subprocess
import sys


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    try:
        import torch
    except ImportError:
        print("torch_topk.py: PyTorch is not installed -- skipping the torch.topk comparison")
        return 0
    if not torch.cuda.is_available():
        print("torch_topk.py: no CUDA device for PyTorch -- skipping the torch.topk comparison")
        return 0

    out = subprocess.run([sys.argv[1], "--benchmark_filter=BM_cuda_topk", "--benchmark_format=json"],
                         check=True, capture_output=True, text=True).stdout
    ours = {}
    for b in json.loads(out[out.index("{"):])["benchmarks"]:
        # name: BM_cuda_topk/rows:R/N:N/N_over_k:Q/path:P/manual_time
        f = dict(p.split(":") for p in b["name"].split("/")[1:] if ":" in p)
        key = (int(f["rows"]), int(f["N"]), int(f["N_over_k"]), int(f["path"]))
        ours[key] = (b["real_time"] * {"us": 1e-6, "ms": 1e-3, "ns": 1e-9, "s": 1.0}[b["time_unit"]],
                     b.get("bandwidth_fraction", float("nan")))

    print(f"device: {torch.cuda.get_device_name()}")
    print(f"{'rows':>5} {'N':>8} {'k':>8} {'path':>4} {'kvscore_us':>11} {'torch_us':>9} {'speedup':>8} {'bw_frac':>8}")
    for (rows, n, q, path), (t_ours, bw) in sorted(ours.items()):
        k = n // q
        g = torch.Generator(device="cuda").manual_seed(2)
        x = torch.randn(rows, n, device="cuda", generator=g)
        torch.topk(x, k, dim=1, sorted=False)
        best = float("inf")
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.topk(x, k, dim=1, sorted=False)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) * 1e-3)
        print(f"{rows:>5} {n:>8} {k:>8} {path:>4} {t_ours * 1e6:>11.1f} {best * 1e6:>9.1f} {best / t_ours:>8.2f} {bw:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
