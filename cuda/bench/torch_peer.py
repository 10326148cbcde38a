#!/usr/bin/env python3
"""kvscore::cuda against PyTorch on the same GPU, the same shapes, in the same run (the torch column).

Runs `kvscore_cuda_bench` (JSON) for K-norm, L2 (ManifoldKV), windowed L2, KeyDiff, SnapKV and the
batched top-k, then times torch's own version of each on the same shapes (fp16 keys [H][N][128]
drawn on the GPU; fp32 scores) with CUDA events, median of 20 after a warm-up, and prints one
table: kvscore time, torch time, speed-up (torch / kvscore) and kvscore's bandwidth_fraction.

torch's versions compute the same scores as kvscore (docs/reference/scorers.md), in fp32 from fp16 keys:
  knorm        -‖k‖                                   torch.linalg.vector_norm(k, dtype=float32)
  l2           ‖k − mean_t k‖
  windowed-l2  ‖k − mean of its 4096-token window‖     (a view [H][N/W][W][d])
  keydiff      −cos(k, mean_t k/‖k‖)
  snapkv       mean softmax attention of the last 64 queries (GQA group 4), avg-pooled (kernel 5)
  topk         torch.topk(x, k, sorted=False) over rows × N random fp32 scores
These formulas were checked against kvscore's CPU scores on the same fp16 keys (2 × 8192 × 128, on the
CPU): largest difference 1.4e-7 (K-norm, L2, windowed L2), 3.2e-7 (KeyDiff), 2.2e-7 (SnapKV) of the
largest score.

Only where PyTorch with CUDA is present; otherwise prints why and exits 0.

    python3 cuda/bench/torch_peer.py build-cuda/cuda/kvscore_cuda_bench [--filter REGEX] [--min-time S]
        [--json FILE]   (kvscore's times from a --benchmark_out file instead of a new run)
"""
import argparse
import json
import math
import re
import subprocess
import sys

UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
CASES = "BM_cuda_(knorm|l2|windowed_l2|keydiff|snapkv|topk)/"


def kvscore_times(binary, flt, min_time, json_file=None):
    """{(name, args...): (seconds, bandwidth_fraction)} from the bench's JSON output (run now, or
    read from a `--benchmark_out` file of a run made just before on the same GPU)."""
    if json_file:
        with open(json_file) as f:
            out = f.read()
    else:
        out = subprocess.run([binary, f"--benchmark_filter={flt}", "--benchmark_format=json",
                              f"--benchmark_min_time={min_time}"], check=True, capture_output=True, text=True).stdout
    res = {}
    for b in json.loads(out[out.index("{"):])["benchmarks"]:
        if not re.match(flt, b["name"]):
            continue
        parts = b["name"].split("/")  # BM_cuda_knorm/N:65536/heads:8/manual_time
        args = dict(p.split(":") for p in parts[1:] if ":" in p)
        res[(parts[0][len("BM_cuda_"):], tuple(sorted((k, int(v)) for k, v in args.items())))] = (
            b["real_time"] * UNITS[b["time_unit"]], b.get("bandwidth_fraction", float("nan")))
    return res


def median_seconds(torch, f, n=20):
    f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return sorted(ts)[len(ts) // 2]


def torch_case(torch, name, a):
    """torch's version of one bench case (its arguments as the bench names them)."""
    F = torch.nn.functional
    if name == "topk":
        x = torch.randn(a["rows"], a["N"], device="cuda")
        k = a["N"] // a["N_over_k"]
        return median_seconds(torch, lambda: torch.topk(x, k, dim=1, sorted=False))
    H, N, d = a["heads"], a["N"], 128
    keys = torch.randn(H, N, d, device="cuda", dtype=torch.float16)
    if name == "knorm":
        f = lambda: -torch.linalg.vector_norm(keys, dim=-1, dtype=torch.float32)
    elif name == "l2":
        def f():
            k = keys.float()
            return torch.linalg.vector_norm(k - k.mean(1, keepdim=True), dim=-1)
    elif name == "windowed_l2":
        W = 4096
        def f():
            k = keys.float().view(H, N // W, W, d)
            return torch.linalg.vector_norm(k - k.mean(2, keepdim=True), dim=-1).view(H, N)
    elif name == "keydiff":
        def f():
            k = keys.float()
            anchor = (k / torch.linalg.vector_norm(k, dim=-1, keepdim=True)).mean(1, keepdim=True)
            return -F.cosine_similarity(k, anchor, dim=-1)
    elif name == "snapkv":  # kvscore's definition (scorers/snapkv.hpp): causal window, prefix pooled
        G, w = 4, 64
        q = torch.randn(H, G * w, d, device="cuda", dtype=torch.float16)
        causal = torch.arange(N, device="cuda")[None, :] > (N - w + torch.arange(w, device="cuda"))[:, None]
        step = max(1, (1 << 28) // (G * w * N))  # heads per matmul: fp32 logits <= 1 GiB (32 x 1M fits)
        def part(h0):
            h1 = min(H, h0 + step)
            logits = (torch.matmul(q[h0:h1], keys[h0:h1].transpose(1, 2)).float() / math.sqrt(d)).view(h1 - h0, G, w, N)
            return logits.masked_fill(causal, float("-inf")).softmax(-1).sum(2).sum(1) / (G * w)
        def f():
            x = torch.cat([part(h0) for h0 in range(0, H, step)], 0)
            return torch.cat([F.avg_pool1d(x[:, None, : N - w], 5, 1, 2)[:, 0], x[:, N - w:]], 1)
    else:
        raise ValueError(name)
    t = median_seconds(torch, f, 20 if N * H < (1 << 24) else 5)
    del keys
    torch.cuda.empty_cache()
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bench", help="path to kvscore_cuda_bench")
    ap.add_argument("--filter", default=CASES, help=f"benchmark filter (default {CASES})")
    ap.add_argument("--min-time", default="0.1", help="--benchmark_min_time for kvscore's side")
    ap.add_argument("--json", help="read kvscore's times from this --benchmark_out JSON instead of running")
    o = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch_peer.py: PyTorch is not installed -- skipping the torch column")
        return 0
    if not torch.cuda.is_available():
        print("torch_peer.py: no CUDA device for PyTorch -- skipping the torch column")
        return 0
    ours = kvscore_times(o.bench, o.filter, o.min_time, o.json)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':<44} {'kvscore_us':>11} {'torch_us':>10} {'speedup':>8} {'bw_frac':>8}")
    for (name, args), (t_ours, bw) in sorted(ours.items()):
        a = dict(args)
        label = name + " " + " ".join(f"{k}={v}" for k, v in args)
        try:
            t_torch = torch_case(torch, name, a)
        except torch.cuda.OutOfMemoryError:  # torch's version needs more memory than this GPU has
            torch.cuda.empty_cache()
            print(f"{label:<44} {t_ours * 1e6:>11.1f} {'OOM':>10} {'-':>8} {bw:>8.3f}", flush=True)
            continue
        print(f"{label:<44} {t_ours * 1e6:>11.1f} {t_torch * 1e6:>10.1f} {t_torch / t_ours:>8.2f} {bw:>8.3f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
