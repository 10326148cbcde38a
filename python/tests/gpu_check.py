#!/usr/bin/env python3
"""The GPU check of kvscore's CUDA tensors (issue 48; docs/reference/python.md "CUDA tensors").

Run on a machine with an NVIDIA GPU after ``KVSCORE_CUDA=1 pip install .`` (scripts/gpu-python-kit.sh
builds kvscore there and runs this). Prints one table, one row per check:

  PASS / FAIL   asserted: exit status 1 if any FAIL
  INFO          reported, not asserted (speed: the press overhead against kvpress's own press,
                kvscore.select against torch.topk)

Checks (tolerances of docs/reference/cuda.md):
  status          cuda_available() and cuda_status() on this machine
  scores:<m>      GPU vs CPU scores of every scorer x fp32/fp16/bf16 x HF / token-major layouts
                  (-inf where the CPU has -inf; 1e-5 relative, + 1e-5 x the head's max for the
                  dot-product scores; SnapKV (3(d+2)L + 8)·2^-24; ProtoKV's integer ranks: equal
                  but at near-exact ties), SnapKV from device and from host queries, both placements
  select          GPU select == CPU select on the same scores (per-head with protection, AdaKV,
                  AdaKV normalize, ties, NaN/±inf), and a batch of layers in one call
  compact         GPU compact byte-identical to the CPU's (both tails, per-head and AdaKV
                  selections, batch 2 row by row); a bad selection is the CPU's ValueError
  stream          everything on a non-default stream: kvscore's kernels run on torch's current stream
  device          a tensor on cuda:1 while cuda:0 is current (needs 2 GPUs; else N/A)
  press:<model>   kvscore presses on a tiny Llama / Qwen2 on the GPU (batch 2) keep kvpress's rows
                  at fp32 (K-norm: near-ties at the budget boundary counted, as on the CPU) and the
                  rows the same press keeps on the CPU; AdaKV masks = kvpress's AdaKVPress; PerLayerPress
  overhead        INFO: what each press's compress() takes per prefill, kvscore vs kvpress, at 8K / 32K
  topk            INFO: kvscore.select on CUDA vs torch.topk(sorted=False) on the bench shapes

    python python/tests/gpu_check.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import numpy as np

try:
    import torch
except ImportError:  # pragma: no cover
    print("gpu_check: torch is missing")
    sys.exit(2)

import kvscore
from kvscore import _cuda

ROWS: list[tuple[str, str, str]] = []


def row(name: str, status: str, detail: str) -> None:
    ROWS.append((name, status, detail))
    print(f"  {status:5s} {name}: {detail}", flush=True)


def check(name: str, info: bool = False):
    """Runs the check; PASS (INFO for a measurement) with its returned detail, FAIL with the
    assertion or exception."""
    def wrap(fn):
        def run(*a, **k):
            t0 = time.time()
            try:
                detail = fn(*a, **k) or ""
                row(name, "INFO" if info else "PASS", f"{detail} ({time.time() - t0:.1f} s)")
            except Exception as e:  # noqa: BLE001 - every failure is a row
                tb = traceback.format_exc().strip().splitlines()
                where = next((line.strip() for line in reversed(tb) if "gpu_check.py" in line), "")
                row(name, "FAIL", f"{type(e).__name__}: {str(e)[:400]} [{where}]")
        return run
    return wrap


DEV = torch.device("cuda")
# the measured shapes (INFO rows); --dry-run-on-cpu shrinks them
OVERHEAD_TOKENS = (8192, 32768)
OVERHEAD_MODEL = dict(vocab_size=1024, hidden_size=2048, intermediate_size=4096, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=40000)
TOPK_SHAPES = ((256, 65536), (32, 1 << 20))
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ------------------------------------------------------------------ data

def make_keys(H, N, d, dtype, seed, invalid=True):
    """float keys [H, N, d] on the host: a shared direction + noise, one NaN row, one inf row, one zero row."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=g) * 0.7
    k = torch.randn(H, N, d, generator=g) + base
    if invalid:
        k[0, 3, 1] = float("nan")
        k[H - 1, 7, 0] = float("inf")
        k[0, 5] = 0
    return k.to(dtype)


def on_device(k, layout):
    """(device keys, host keys) in a layout: 'hf' [1, H, N, d] or 'token-major' [N, H, d] seen as [H, N, d]."""
    if layout == "hf":
        return k[None].to(DEV), k[None].clone()
    tm = k.permute(1, 0, 2).contiguous()
    return tm.to(DEV).permute(1, 0, 2), tm.clone().permute(1, 0, 2)


def compare(cpu, gpu, rel, floor=False):
    """max err / tol over finite scores (<= 1 passes); -inf and NaN placement exact."""
    c = torch.as_tensor(np.asarray(cpu)).double() if not torch.is_tensor(cpu) else cpu.double()
    g = gpu.detach().cpu().double()
    assert g.shape == c.shape, (g.shape, c.shape)
    assert not torch.isnan(g).any(), "NaN score on the GPU"
    inf = torch.isinf(c)
    assert torch.equal(inf, torch.isinf(g)) and torch.equal(c[inf], g[inf]), "-inf placement differs"
    fin = ~inf
    mx = torch.where(fin, c.abs(), torch.zeros_like(c)).amax(dim=-1, keepdim=True)
    tol = rel * c.abs() + (rel * mx if floor else 0) + 1e-30
    r = ((g - c).abs() / tol)[fin]
    return float(r.max()) if r.numel() else 0.0


# ------------------------------------------------------------------ checks

@check("status")
def check_status():
    s = kvscore.cuda_status()
    assert kvscore.cuda_available() and s["reason"] == "available", s
    return f"{s['message']}"


def _scorer_combos(quick):
    return [(dn, layout) for dn in DTYPES for layout in (("hf",) if quick else ("hf", "token-major"))]


def scores_check(name, make, floor, quick, H=4, N=2000, d=128):
    @check(f"scores:{name}")
    def run():
        worst, n = 0.0, 0
        for dn, layout in _scorer_combos(quick):
            kd, kh = on_device(make_keys(H, N, d, DTYPES[dn], seed=H * N + d), layout)
            sc = make(d)
            r = compare(sc.score(kh), sc.score(kd), 1e-5, floor)
            assert r <= 1, f"{dn} {layout}: err/tol {r:.3g}"
            again = sc.score(kd)
            assert torch.equal(again, sc.score(kd)), f"{dn} {layout}: not bit-identical across runs"
            worst, n = max(worst, r), n + 1
        return f"{n} dtype x layout combos, worst err/tol {worst:.3g}"
    run()


def snapkv_bound(qh, kh, d):
    """(3(d+2)L + 8)·2^-24 with L = max over valid keys of Σ_j |q_j k_j| / √d (test_snapkv.cpp's)."""
    q = qh.float().abs() / math.sqrt(d)        # [Hq, w, d]
    k = kh.float()
    k = torch.where(torch.isfinite(k), k, torch.zeros_like(k)).abs()  # [H, N, d]
    H, Hq = k.shape[0], q.shape[0]
    G = Hq // H
    L = max(float((q[h * G:(h + 1) * G].reshape(-1, d) @ k[h].T).max()) for h in range(H))
    return (3 * (d + 2) * L + 8) / 2 ** 24


@check("scores:snapkv")
def check_snapkv(quick):
    H, G, N, d, w = 4, 2, 2000, 128, 32
    worst, n = 0.0, 0
    for dn, layout in _scorer_combos(quick):
        k = make_keys(H, N, d, DTYPES[dn], seed=7)
        kd, kh = on_device(k, layout)
        q = (torch.randn(H * G, 48, d, generator=torch.Generator().manual_seed(8)) * 0.3).to(DTYPES[dn])
        for placement in ("in_cache", "after_cache"):
            cpu = kvscore.SnapKV(q, window=w, placement=placement)
            want = cpu.score(kh)
            rel = snapkv_bound(q[:, -w:], k, d)
            dev = kvscore.SnapKV(q.to(DEV), window=w, placement=placement)   # queries in device memory
            assert dev.protected_recent == cpu.protected_recent
            got = dev.score(kd)
            r = compare(want, got, rel)
            assert r <= 1, f"{dn} {layout} {placement} device queries: err/tol {r:.3g}"
            host = cpu.score(kd)  # host queries, device keys
            assert torch.equal(got, host), f"{dn} {layout} {placement}: device and host queries differ"
            worst, n = max(worst, r), n + 1
    return f"{n} combos x (device, host) queries, worst err/tol {worst:.3g} of the derived bound"


@check("scores:protokv")
def check_protokv(quick):
    H, G, N, d = 4, 2, 1500, 64
    same = total = 0
    for dn, layout in _scorer_combos(quick):
        kd, kh = on_device(make_keys(H, N, d, DTYPES[dn], seed=9), layout)
        q = (torch.randn(H * G, 32, d, generator=torch.Generator().manual_seed(10)) * 0.3).to(DTYPES[dn])
        for psi in ("sum", "mean"):
            sc = kvscore.ProtoKV(q, window=32, psi=psi)
            c, g = torch.as_tensor(sc.score(kh)), sc.score(kd).cpu()
            assert torch.equal(torch.isinf(c), torch.isinf(g)), f"{dn} {layout} {psi}: -inf placement"
            same += int((c == g).sum())
            total += c.numel()
    frac = same / total
    assert frac >= 0.99, f"only {frac:.4f} of the rank scores equal the CPU's"
    return f"{same}/{total} rank scores equal the CPU's (fp32 dots in another order: near-exact ties may swap)"


def make_scores(H, N, seed, distinct=0, specials=False):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(H, N, generator=g)
    if distinct:
        s = torch.randint(0, distinct, (H, N), generator=g).float()
    if specials:
        vals = torch.tensor([float("nan"), -float("nan"), -float("inf"), float("inf"), 0.0, -0.0, 1.0, -1.0])
        s = vals[torch.randint(0, 8, (H, N), generator=g)]
    s = s * torch.arange(1, H + 1).float()[:, None] + torch.arange(H).float()[:, None]  # heads on other scales
    return s


def same_selection(a, b):
    if isinstance(a, list):
        return len(a) == len(b) and all(torch.equal(x.cpu(), torch.as_tensor(y)) for x, y in zip(a, b))
    return torch.equal(a.cpu(), torch.as_tensor(b))


@check("select")
def check_select(quick):
    cases = 0
    for H, N in ((8, 5000), (3, 70000)):
        for kind in ("distinct", "ties", "specials"):
            s = make_scores(H, N, H + N, distinct=3 if kind == "ties" else 0, specials=kind == "specials")
            sd = s.to(DEV)
            for budget, kw in ((N // 10, {}), (N // 2, {"sinks": 4, "recent": 64}), (N // 4, {"alloc": "adakv"}),
                               (N // 4, {"alloc": "adakv", "alpha": 0.0, "recent": 16}),
                               (N // 4, {"alloc": "adakv", "normalize": True}),
                               (N // 3, {"alloc": "adakv", "normalize": True, "alpha": 1.0, "sinks": 2})):
                got, want = kvscore.select(sd, budget, **kw), kvscore.select(s, budget, **kw)
                assert same_selection(got, want), f"H {H} N {N} {kind} budget {budget} {kw}"
                cases += 1
    # a batch of layers in one call (the presses'), each layer as select does it
    B, H, N = 3, 4, 3000
    s = make_scores(B * H, N, 5)
    for alloc in ("per_head", "adakv"):
        off, pos, _ = _cuda.select_csr(s.to(DEV), 300, sinks=2, recent=16, alloc=alloc, alpha=0.2, normalize=False,
                                       threads=0, batch=B)
        rows = list(pos.cpu().split(off.diff().cpu().tolist()))
        want = []
        for b in range(B):
            w = kvscore.select(s[b * H:(b + 1) * H], 300, sinks=2, recent=16, alloc=alloc)
            want += list(w) if isinstance(w, list) else list(w)
        assert all(torch.equal(a, torch.as_tensor(b)) for a, b in zip(rows, want)), f"batched {alloc}"
        cases += 1
    return f"{cases} cases identical to the CPU's positions"


def _bytes(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).cpu()


@check("compact")
def check_compact(quick):
    cases = 0
    H, N, d = 4, 3000, 128
    for dn in DTYPES:
        for tail in ("keep", "zero"):
            for alloc in ("per_head", "adakv"):
                k = make_keys(H, N, d, DTYPES[dn], 11, invalid=False)[None]
                v = make_keys(H, N, d, DTYPES[dn], 12, invalid=False)[None]
                s = make_scores(H, N, 13)
                sel = kvscore.select(s, N // 3, sinks=2, recent=8, alloc=alloc)
                kd, vd = k.to(DEV), v.to(DEV)
                seld = [x.to(DEV) for x in sel] if isinstance(sel, list) else sel.to(DEV)
                eq = alloc == "per_head"
                a = kvscore.compact(k, v, sel, tail=tail, require_equal_lengths=eq)
                b = kvscore.compact(kd, vd, seld, tail=tail, require_equal_lengths=eq)
                assert a == b, (a, b)
                assert torch.equal(_bytes(kd), _bytes(k)) and torch.equal(_bytes(vd), _bytes(v)), \
                    f"{dn} {tail} {alloc}: not byte-identical"
                cases += 1
    # batch 2: each row of one [2, H, N, d] cache compacted in place with its own selection
    k = make_keys(2 * H, N, d, torch.float16, 14, invalid=False).view(2, H, N, d)
    v = make_keys(2 * H, N, d, torch.float16, 15, invalid=False).view(2, H, N, d)
    kd, vd = k.to(DEV), v.to(DEV)
    for b in range(2):
        sel = kvscore.select(make_scores(H, N, 16 + b), 1000)
        assert kvscore.compact(k[b], v[b], sel) == kvscore.compact(kd[b], vd[b], sel.to(DEV)) == 1000
    assert torch.equal(_bytes(kd), _bytes(k)) and torch.equal(_bytes(vd), _bytes(v)), "batch 2: not byte-identical"
    # a bad selection: the CPU's error, nothing written
    bad = torch.tensor([[3, 2, 5], [1, 2, 3]], dtype=torch.int64)
    kd0 = kd[0].clone()
    try:
        kvscore.compact(kd[0], vd[0], bad.to(DEV))
        raise AssertionError("a descending selection was accepted")
    except ValueError as e:
        try:
            kvscore.compact(k[0].clone(), v[0].clone(), bad)
        except ValueError as c:
            assert str(e) == str(c), (str(e), str(c))
    assert torch.equal(kd[0], kd0), "a rejected selection wrote to the cache"
    return f"{cases + 1} cases byte-identical (batch 2 included); a bad selection: the CPU's ValueError"


def kvscore_kernel_streams(fn):
    """(CUDA stream ids of kvscore's kernels, of torch's kernels) while fn() runs, from the profiler (CUPTI sees
    every kernel of the process, kvscore's own runtime's included)."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    ours, theirs = set(), set()
    for e in events:
        if e.get("cat") != "kernel":
            continue
        (ours if "kvscore" in e.get("name", "") else theirs).add(e.get("args", {}).get("stream"))
    return ours, theirs


@check("stream")
def check_stream(quick):
    H, N, d = 8, 4096, 128
    k = make_keys(H, N, d, torch.float16, 17, invalid=False)[None].to(DEV)
    v = make_keys(H, N, d, torch.float16, 18, invalid=False)[None].to(DEV)
    q = (torch.randn(2 * H, 64, d) * 0.3).half().to(DEV)
    ref_scores = kvscore.KeyDiff().score(k)
    ref_sel = kvscore.select(ref_scores, 1024, recent=64)
    ref_snap = kvscore.SnapKV(q).score(k)
    kk, vv = k.clone(), v.clone()
    ref_n = kvscore.compact(kk, vv, ref_sel)
    side = torch.cuda.Stream()
    out = {}

    def work():
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # keeps the side stream busy: work on another stream would finish first
            marker = k.float().sum()        # a torch kernel on the side stream: its stream id
            out["scores"] = kvscore.KeyDiff().score(k)
            out["sel"] = kvscore.select(out["scores"], 1024, recent=64)
            out["snap"] = kvscore.SnapKV(q).score(k)
            k2, v2 = k.clone(), v.clone()
            out["n"] = kvscore.compact(k2, v2, out["sel"])
            out["k"], out["v"] = k2, v2
            del marker
        side.synchronize()

    ours, theirs = kvscore_kernel_streams(work)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert torch.equal(out["scores"], ref_scores) and torch.equal(out["sel"], ref_sel)
    assert torch.equal(out["snap"], ref_snap) and out["n"] == ref_n
    assert torch.equal(out["k"], kk) and torch.equal(out["v"], vv)
    assert ours, "the profiler saw no kvscore kernel"
    assert len(ours) == 1 and ours <= theirs, f"kvscore's kernels ran on streams {ours}, torch's on {theirs}"
    return f"results equal the default stream's; every kvscore kernel on torch's current stream ({ours.pop()})"


@check("device")
def check_device(quick):
    if torch.cuda.device_count() < 2:
        return "N/A: one GPU (the guard's host and single-device tests ran in kvscore_cuda_tests)"
    k = make_keys(4, 1000, 64, torch.float16, 19, invalid=False)
    with torch.cuda.device(0):
        got = kvscore.ManifoldL2().score(k.to("cuda:1"))
        assert torch.cuda.current_device() == 0
    assert got.device == torch.device("cuda:1")
    assert compare(kvscore.ManifoldL2().score(k), got, 1e-5) <= 1
    return "a cuda:1 tensor scored while cuda:0 was current: on cuda:1, current device restored"


# ------------------------------------------------------------------ presses

def tiny_model(kind, attn="eager"):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    return cls._from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()


def prefill(model, press, ids):
    import transformers

    cache = transformers.DynamicCache()
    with torch.no_grad():
        if press is None:
            model(input_ids=ids, past_key_values=cache)
        else:
            with press(model):
                model(input_ids=ids, past_key_values=cache)
    masks = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
    return [(layer.keys.detach().float().cpu(), layer.values.detach().float().cpu()) for layer in cache.layers], masks


def kept(full, comp):
    """Kept positions [batch][head] of a compressed cache, by matching rows with the full cache's."""
    out = []
    for b in range(full.shape[0]):
        heads = []
        for h in range(full.shape[1]):
            rows = {full[b, h, t].numpy().tobytes(): t for t in range(full.shape[2])}
            heads.append(sorted(rows[comp[b, h, i].numpy().tobytes()] for i in range(comp.shape[2])))
        out.append(heads)
    return out


def near_tie_diffs(a, b, score, tol):
    """Positions kept by one of a, b only; each must score within tol of the boundary (the n-th best)."""
    n = 0
    for bi in range(len(a)):
        for h in range(len(a[bi])):
            diff = set(a[bi][h]) ^ set(b[bi][h])
            if not diff:
                continue
            s = score[bi][h]
            boundary = sorted(s.tolist(), reverse=True)[len(a[bi][h]) - 1]
            bad = [t for t in diff if abs(float(s[t]) - boundary) > tol * max(abs(boundary), 1e-30)]
            assert not bad, f"row {bi} head {h}: {sorted(diff)} differ, not near-ties ({bad[:4]})"
            n += len(diff) // 2
    return n


def neg_norms(fk):
    """K-norm's scores (-||k||, fp64) of full keys [batch, heads, N, d], per row and head."""
    return [[-torch.linalg.vector_norm(fk[bi, h].double(), dim=-1) for h in range(fk.shape[1])]
            for bi in range(fk.shape[0])]


def press_check(kind, quick):
    @check(f"press:{kind}")
    def run():
        import kvpress

        from kvscore.presses import KvscorePress, PerLayerPress

        model_cpu = tiny_model(kind)
        model = tiny_model(kind).to(DEV)
        ids = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(1))
        full, _ = prefill(model, None, ids.to(DEV))
        full_cpu, _ = prefill(model_cpu, None, ids)
        details = []
        pairs = [("knorm", {}, lambda r: kvpress.KnormPress(compression_ratio=r)),
                 ("keydiff", {}, lambda r: kvpress.KeyDiffPress(compression_ratio=r)),
                 ("snapkv", {"window": 16}, lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=16)),
                 ("streaming_llm", {"n_sink": 4}, lambda r: kvpress.StreamingLLMPress(compression_ratio=r, n_sink=4))]
        for method, opts, peer in pairs:
            for ratio in ((0.5,) if quick else (0.3, 0.75)):
                ours, _ = prefill(model, KvscorePress(method, ratio, **opts), ids.to(DEV))
                theirs, _ = prefill(model, peer(ratio), ids.to(DEV))
                on_cpu, _ = prefill(model_cpu, KvscorePress(method, ratio, **opts), ids)
                ties = 0
                for layer in range(len(full)):
                    fk = full[layer][0]
                    a, b = kept(fk, ours[layer][0]), kept(fk, theirs[layer][0])
                    c = kept(full_cpu[layer][0], on_cpu[layer][0])
                    norms = neg_norms(fk)
                    if method == "knorm":  # fp32 norms a few ulp apart (docs/reference/python.md): boundary near-ties
                        ties += near_tie_diffs(a, b, norms, 1e-6) + near_tie_diffs(a, c, norms, 1e-6)
                    elif method == "keydiff":
                        mean = [[fk[bi, h] / fk[bi, h].norm(dim=-1, keepdim=True) for h in range(fk.shape[1])]
                                for bi in range(fk.shape[0])]
                        cos = [[-torch.nn.functional.cosine_similarity(m, m.mean(0, keepdim=True), dim=-1).double()
                                for m in rows] for rows in mean]
                        ties += near_tie_diffs(a, b, cos, 1e-5) + near_tie_diffs(a, c, cos, 1e-5)
                    else:  # StreamingLLM: identical; SnapKV: scores to rounding, so a swap at the boundary is
                        # possible in principle (none on the CPU): counted, at most 0.5 % of the kept positions
                        diff = sum(len(set(x) ^ set(y)) // 2 for ra, rb in zip(a, b) for x, y in zip(ra, rb))
                        diff_cpu = sum(len(set(x) ^ set(y)) // 2 for ra, rc in zip(a, c) for x, y in zip(ra, rc))
                        allowed = 0 if method == "streaming_llm" else int(0.005 * ours[layer][0][..., 0].numel())
                        assert max(diff, diff_cpu) <= allowed, f"{method} {ratio} layer {layer}: {diff}/{diff_cpu} differ"
                        ties += diff + diff_cpu
                    n = int(200 * (1 - ratio))
                    assert ours[layer][0].shape[2] == n
                details.append(f"{method}@{ratio}: {ties} near-ties (vs kvpress + vs CPU)")
        # AdaKV: masks of kvpress's AdaKVPress around the same scorer (sdpa), batch 1 as kvpress's test
        model_s = tiny_model(kind, "sdpa").to(DEV)
        for method, peer in (("knorm", lambda r: kvpress.KnormPress(compression_ratio=r)),
                             ("keydiff", lambda r: kvpress.KeyDiffPress(compression_ratio=r))):
            _, m_ours = prefill(model_s, KvscorePress(method, 0.6, alloc="adakv"), ids[:1].to(DEV))
            _, m_theirs = prefill(model_s, kvpress.AdaKVPress(peer(0.6)), ids[:1].to(DEV))
            for lo, lt in zip(m_ours, m_theirs):
                so = set(zip(lo[1].tolist(), lo[2].tolist()))
                st = set(zip(lt[1].tolist(), lt[2].tolist()))
                assert len(so ^ st) <= 2, f"AdaKV {method}: {len(so ^ st)} masked pairs differ from kvpress's"
        details.append("AdaKV masks = kvpress's")
        # PerLayerPress (K-norm, then SnapKV): the GPU keeps the CPU's rows (K-norm: boundary near-ties)
        plan = ["knorm", "snapkv"]
        g, _ = prefill(model, PerLayerPress(plan, 0.5, window=16), ids.to(DEV))
        c, _ = prefill(model_cpu, PerLayerPress(plan, 0.5, window=16), ids)
        a0, c0 = kept(full[0][0], g[0][0]), kept(full_cpu[0][0], c[0][0])
        ties = near_tie_diffs(a0, c0, neg_norms(full[0][0]), 1e-6)
        assert kept(full[1][0], g[1][0]) == kept(full_cpu[1][0], c[1][0]), "PerLayerPress: SnapKV layer differs"
        details.append(f"PerLayerPress = CPU ({ties} near-ties)")
        return "; ".join(details)
    run()


# ------------------------------------------------------------------ reported, not asserted

def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps=5):
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


@check("overhead", info=True)
def check_overhead(quick):
    """Each press's compress() per prefill (all layers), kvscore vs kvpress's own press for the method."""
    import kvpress
    import transformers

    from kvscore.presses import KvscorePress

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**OVERHEAD_MODEL)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa",
                                                       dtype=torch.bfloat16).to(DEV).eval()
    methods = [("knorm", {}, lambda r: kvpress.KnormPress(compression_ratio=r)),
               ("keydiff", {}, lambda r: kvpress.KeyDiffPress(compression_ratio=r)),
               ("snapkv", {"window": 64}, lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=64)),
               ("streaming_llm", {}, lambda r: kvpress.StreamingLLMPress(compression_ratio=r))]
    out = []
    for n in (OVERHEAD_TOKENS[:1] if quick else OVERHEAD_TOKENS):
        ids = torch.randint(0, OVERHEAD_MODEL["vocab_size"], (1, n), device=DEV)
        for method, opts, peer in methods:
            times = {}
            for who, press in (("kvscore", KvscorePress(method, 0.5, **opts)), ("kvpress", peer(0.5))):
                spent = []
                inner = press.compress

                def compress(*a, _inner=inner, _spent=spent, **k):
                    sync()
                    t0 = time.perf_counter()
                    r = _inner(*a, **k)
                    sync()
                    _spent.append(time.perf_counter() - t0)
                    return r

                press.compress = compress
                best = float("inf")
                for _ in range(3):
                    spent.clear()
                    prefill(model, press, ids)
                    best = min(best, sum(spent))
                times[who] = best
            ratio = times["kvscore"] / times["kvpress"]
            out.append(f"{method}@{n / 1024:g}K {times['kvscore'] * 1e3:.2f}/{times['kvpress'] * 1e3:.2f} ms "
                       f"({ratio:.2f}x)")
    return (f"kvscore/kvpress compress() per prefill, {OVERHEAD_MODEL['num_hidden_layers']} layers, bf16: "
            + "; ".join(out))


@check("topk", info=True)
def check_topk(quick):
    out = []
    for R, N in TOPK_SHAPES:
        s = torch.randn(R, N, device=DEV)
        for k in (N // 10, N // 2):
            t_ours = timed(lambda: kvscore.select(s, k))
            t_torch = timed(lambda: torch.topk(s, k, dim=-1, sorted=False))
            out.append(f"{R}x{N / 1024:g}K k=N/{N // k}: {t_ours * 1e6:.0f} vs {t_torch * 1e6:.0f} us "
                       f"({t_torch / t_ours:.2f}x)")
    return "kvscore.select vs torch.topk(sorted=False), best of 5, wall incl. launch: " + "; ".join(out)


# ------------------------------------------------------------------ main

def _host_select_csr(scores, budget, *, sinks, recent, alloc, alpha, normalize, threads, batch=1):
    """--dry-run-on-cpu: kvscore._cuda.select_csr done by the CPU select, layer by layer."""
    heads = scores.shape[0] // batch
    offsets, positions = [0], []
    for b in range(batch):
        sel = kvscore.select(scores[b * heads:(b + 1) * heads], budget, sinks=sinks, recent=recent, alloc=alloc,
                             alpha=alpha, normalize=normalize, threads=threads)
        for r in list(sel):
            positions.append(torch.as_tensor(r))
            offsets.append(offsets[-1] + len(r))
    return torch.tensor(offsets), torch.cat(positions), alloc == "per_head"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one layout, one ratio, 8K only")
    ap.add_argument("--json", help="write the table as JSON here")
    ap.add_argument("--only", default="", help="comma-separated check names (prefixes) to run")
    ap.add_argument("--dry-run-on-cpu", action="store_true",
                    help="run this script's own code with CPU tensors and small shapes (to develop it without a "
                         "GPU): compares the CPU path with itself, checks nothing of the CUDA path; status, stream "
                         "and device skipped")
    a = ap.parse_args()
    if a.dry_run_on_cpu:
        global DEV, OVERHEAD_TOKENS, OVERHEAD_MODEL, TOPK_SHAPES
        DEV = torch.device("cpu")
        _cuda.select_csr = _host_select_csr
        OVERHEAD_TOKENS, TOPK_SHAPES = (256, 512), ((4, 4096),)
        OVERHEAD_MODEL = dict(OVERHEAD_MODEL, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=2)
        only = [x for x in a.only.split(",") if x] or ["scores", "select", "compact", "press", "overhead", "topk"]
        a.only = ",".join(o for o in only if o not in ("status", "stream", "device"))
    elif not torch.cuda.is_available():
        print(f"gpu_check: torch sees no GPU; kvscore.cuda_status(): {kvscore.cuda_status()}")
        return 2
    device = "CPU DRY RUN (nothing of the CUDA path checked)" if a.dry_run_on_cpu else torch.cuda.get_device_name()
    print(f"gpu_check: {device} | torch {torch.__version__} | kvscore {kvscore.__version__} | "
          f"{kvscore.cuda_status()['message']}", flush=True)
    only = [x for x in a.only.split(",") if x]
    want = lambda name: not only or any(name.startswith(o) for o in only)  # noqa: E731
    if want("status"):
        check_status()
    geometric = [("knorm", lambda d: kvscore.KNorm(), False), ("keydiff", lambda d: kvscore.KeyDiff(), True),
                 ("manifold_l2", lambda d: kvscore.ManifoldL2(), False),
                 ("windowed_manifold_l2", lambda d: kvscore.WindowedManifoldL2(window=256), False),
                 ("windowed_manifold_l2/own", lambda d: kvscore.WindowedManifoldL2(window=256, tail="own"), False),
                 ("qfilter", lambda d: kvscore.QFilter(np.random.default_rng(3).standard_normal((4, d), np.float32)),
                  True)]
    for name, make, floor in geometric:
        if want(f"scores:{name}"):
            scores_check(name, make, floor, a.quick)
    for name, fn in (("scores:snapkv", check_snapkv), ("scores:protokv", check_protokv), ("select", check_select),
                     ("compact", check_compact), ("stream", check_stream), ("device", check_device)):
        if want(name):
            fn(a.quick)
    for kind in ("llama", "qwen2"):
        if want(f"press:{kind}"):
            press_check(kind, a.quick)
    for name, fn in (("overhead", check_overhead), ("topk", check_topk)):
        if want(name):
            fn(a.quick)
    fails = [r for r in ROWS if r[1] == "FAIL"]
    print("\n| check | result | detail |\n| --- | --- | --- |")
    for name, status, detail in ROWS:
        print(f"| {name} | {status} | {detail} |")
    passed = sum(1 for r in ROWS if r[1] == "PASS")
    print(f"\ngpu_check: {passed} passed, {len(fails)} failed")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"check": n, "result": s, "detail": d} for n, s, d in ROWS], f, indent=1)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
