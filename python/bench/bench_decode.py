#!/usr/bin/env python3
"""Decode-step speed of kvscore.generation's RetrievalCache (docs/guides/generation.md): a benchmark, not a test.

Every figure is the best of --reps steps, interleaved with the steps it is compared with in the
same run (the machine is shared: read the ratios, not the absolute times), --threads for torch
and the C++ calls alike. A layer's step is one decoded token: its key and value appended, then
every query head attended. "C++ dense" is ParisKVLayerCache below its threshold (each KV head's
keys and values read once for its G query heads, pariskv/attention.hpp); "sdpa grouped" is
torch's scaled_dot_product_attention with a KV head's G queries as G rows against it (K and V
read once, the fastest dense baseline); "sdpa enable_gqa" is what transformers' sdpa path runs.
Retrieval: 4 sinks, a local window of 64, ParisKV's length-adaptive beta / rho.

1. --crossover: the dense threshold per head_dim. Synthetic drift layers (`kvscore synth --kind
   drift`, fp32; --crossover-layers distinct layers summed, so that the caches are as cold as
   in a model) at head_dim 64 with GQA 3:1 (3 KV heads, SmolLM2-135M's shape) and head_dim 128
   with GQA 4:1 (8 KV heads, Llama-3-8B's), lengths --crossover-lengths, 10 % of the keys
   attended: ParisKV's step against the C++ dense step and both sdpa steps. The crossover is
   where ParisKV's step becomes faster than the C++ dense one for good (interpolated between
   the two lengths around it): kvscore::retrieval_dense_below, RetrievalCache's default.
2. --lengths: long synthetic layers (32K, 128K), k = 100 retrieved per query head: ParisKV as
   the paper's pipeline and "wide" (beta = --beta, rho = --rho, an exact rerank of --rerank * k
   candidates), exact top-k, C++ dense, sdpa; recall@k against the exact top k of the same zone.
3. SmolLM2-135M-Instruct at --smol-lengths of a license text, from one prefill of the longest
   (a prefix's keys are the shorter prompt's: the model is causal): every layer's step summed on
   the model's own keys, values and next-token queries (ParisKV, wide, exact, C++ dense,
   RetrievalCache's step as its default threshold picks, sdpa), recall@k; then the model's whole
   decode step: DynamicCache against RetrievalCache(attend=0.1) with its default threshold and
   with dense_below=0 (never dense: always retrieving), each step cropped back so that every rep decodes the
   same token after the same prompt.
Prints Markdown tables and writes --json.
"""
import argparse
import json
import platform
import time

import numpy as np
import torch

import kvscore
from kvscore import _kvscore

SINKS, LOCAL = 4, 64
NEVER, ALWAYS = 0, 1 << 40  # dense_below: never dense / always dense


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def layer_cache(K, V, k, threads, dense_below=NEVER, exact=False, rerank=0, beta=0.0, rho=0.0, scale=None):
    """A ParisKVLayerCacheF32 holding K, V [1, H, N, d] but their last token (the step appends it)."""
    H, d = K.shape[1], K.shape[-1]
    impl = _kvscore.ParisKVLayerCacheF32(1, H, d, sinks=SINKS, local=LOCAL, update_interval=1, k=k, exact=exact,
                                         scale=scale or d ** -0.5, rerank_exact=rerank, beta=beta, rho=rho,
                                         dense_below=dense_below)
    impl.num_threads = threads
    impl.append(K[:, :, :-1], V[:, :, :-1])
    return impl


class Layer:
    """One layer's step in every form: C++ layer caches and torch's sdpa over the same K, V, q."""

    def __init__(self, K, V, q, impls, scale):
        self.K, self.V, self.q, self.impls, self.scale = K, V, q, impls, scale
        self.kn, self.vn = K[:, :, -1:].clone(), V[:, :, -1:].clone()
        self.out = torch.empty(1, 1, q.shape[1], q.shape[-1])

    def step(self, name):
        if name in self.impls:
            impl = self.impls[name]
            impl.forward(self.kn, self.vn, self.q, self.out.permute(0, 2, 1, 3))
            impl.crop(impl.size - 1)  # the same cache for every rep (crop is outside nothing: cheap)
        elif name == "sdpa_grouped":  # a KV head's G queries as G rows: K and V read once
            b, H, _, d = self.K.shape
            torch.nn.functional.scaled_dot_product_attention(self.q.view(b, H, -1, d), self.K, self.V, scale=self.scale)
        else:
            torch.nn.functional.scaled_dot_product_attention(self.q, self.K, self.V, enable_gqa=True, scale=self.scale)

    def positions(self, name, j):
        return set(self.impls[name].positions(0, j).tolist())


def time_layers(layers, names, reps):
    """{name: best over reps of the summed step of all layers (s)}, the names interleaved."""
    best = {n: float("inf") for n in names}
    for _ in range(reps):
        for n in names:
            t0 = time.perf_counter()
            for lay in layers:
                lay.step(n)
            best[n] = min(best[n], time.perf_counter() - t0)
    return best


def recall(layers, name, qh):
    """Mean over layers and query heads of |retrieved ∩ exact top k| / k at the last step."""
    r = []
    for lay in layers:
        for j in range(qh):
            a, b = lay.positions(name, j), lay.positions("exact", j)
            r.append(len(a & b) / len(b))
    return float(np.mean(r))


def crossover_point(lengths, paris, dense):
    """The length from which ParisKV's step stays faster than the dense one, linearly
    interpolated on (time difference) between the last length dense wins and the next; None
    when dense wins at the longest length, the shortest length when ParisKV always wins."""
    diff = [p - q for p, q in zip(paris, dense)]
    if diff[-1] >= 0:
        return None
    i = len(diff) - 1
    while i > 0 and diff[i - 1] < 0:
        i -= 1
    if i == 0:
        return lengths[0]
    a, b = diff[i - 1], diff[i]  # a >= 0 > b
    return int(round(lengths[i - 1] + (lengths[i] - lengths[i - 1]) * a / (a - b)))


def crossover(args, out):
    print(f"\n### Crossover: one decode step, {args.crossover_layers} synthetic drift layers summed, 10 % attended\n")
    print("| head_dim, GQA | tokens | ParisKV ms | C++ dense ms | sdpa grouped ms | sdpa enable_gqa ms | "
          "C++ dense / ParisKV | sdpa grouped / C++ dense | sdpa enable_gqa / C++ dense |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for d, H, G in ((64, 3, 3), (128, 8, 4)):
        Nmax = max(args.crossover_lengths)
        s = kvscore.synth("drift", layers=args.crossover_layers, kv_heads=H, group=G, tokens=Nmax, head_dim=d, queries=1)
        Ks, Vs, Qs = torch.from_numpy(s["K"]), torch.from_numpy(s["V"]), torch.from_numpy(s["Q"])
        Ks, Vs, Qs = (x.view(args.crossover_layers, 1, *x.shape[-3:]) for x in (Ks, Vs, Qs))
        paris_t, dense_t = [], []
        for N in args.crossover_lengths:
            k = kvscore.budget_from_ratio(N, 0.1) - SINKS - LOCAL
            layers = []
            for li in range(args.crossover_layers):
                K, V = Ks[li, :, :, :N].contiguous(), Vs[li, :, :, :N].contiguous()
                q = Qs[li, :, :, :1].contiguous()
                layers.append(Layer(K, V, q, {"pariskv": layer_cache(K, V, k, args.threads),
                                             "dense": layer_cache(K, V, k, args.threads, dense_below=ALWAYS)},
                                    d ** -0.5))
            t = time_layers(layers, ("pariskv", "dense", "sdpa_grouped", "sdpa_gqa"), args.reps)
            paris_t.append(t["pariskv"])
            dense_t.append(t["dense"])
            row = dict(head_dim=d, kv_heads=H, group=G, tokens=N, layers=args.crossover_layers,
                       **{f"{n}_ms": v * 1e3 / args.crossover_layers for n, v in t.items()})
            out.append(row)
            print(f"| {d}, {G}:1 | {N} | {row['pariskv_ms']:.3f} | {row['dense_ms']:.3f} | {row['sdpa_grouped_ms']:.3f} | "
                  f"{row['sdpa_gqa_ms']:.3f} | {t['dense'] / t['pariskv']:.2f} | {t['sdpa_grouped'] / t['dense']:.2f} | "
                  f"{t['sdpa_gqa'] / t['dense']:.2f} |", flush=True)
            del layers
        x = crossover_point(args.crossover_lengths, paris_t, dense_t)
        out.append(dict(head_dim=d, group=G, crossover=x, default=_kvscore.retrieval_dense_below(d)))
        print(f"| {d}, {G}:1 | **crossover ≈ {x}** (kvscore::retrieval_dense_below({d}) = "
              f"{_kvscore.retrieval_dense_below(d)}) | | | | | | | |", flush=True)
        del Ks, Vs, Qs, s


def long_synthetic(args, out):
    print(f"\n### Long synthetic layers, k = {args.k} retrieved per query head\n")
    print(f"| layer | tokens | ParisKV ms | ParisKV β {args.beta:g} ρ {args.rho:g} + rerank {args.rerank}k ms | "
          "exact top-k ms | C++ dense ms | sdpa enable_gqa ms | sdpa grouped ms | grouped / ParisKV | grouped / wide | "
          "recall@k | recall@k wide |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for d, H, G in ((64, 3, 3), (128, 8, 4)):
        for N in args.lengths:
            s = kvscore.synth("drift", layers=1, kv_heads=H, group=G, tokens=N, head_dim=d, queries=16)
            K, V, Q = torch.from_numpy(s["K"]), torch.from_numpy(s["V"]), torch.from_numpy(s["Q"])
            impls = {"pariskv": layer_cache(K, V, args.k, args.threads),
                     "wide": layer_cache(K, V, args.k, args.threads, rerank=args.rerank * args.k, beta=args.beta,
                                         rho=args.rho),
                     "exact": layer_cache(K, V, args.k, args.threads, exact=True),
                     "dense": layer_cache(K, V, args.k, args.threads, dense_below=ALWAYS)}
            t = time_layers([Layer(K, V, Q[:, :, :1].contiguous(), impls, d ** -0.5)],
                            ("pariskv", "wide", "exact", "dense", "sdpa_gqa", "sdpa_grouped"), args.reps)
            rec, rec_w = [], []
            for r in range(16):  # recall over 16 queries (the retrieval depends on the query only)
                lay = Layer(K, V, Q[:, :, r:r + 1].contiguous(), impls, d ** -0.5)
                for n in ("pariskv", "wide", "exact"):
                    lay.step(n)
                rec.append(recall([lay], "pariskv", H * G))
                rec_w.append(recall([lay], "wide", H * G))
            row = dict(case=f"synth drift d{d} GQA {G}:1 ({H} KV heads)", tokens=N, attended=(SINKS + LOCAL + args.k) / N,
                       **{f"{n}_ms": v * 1e3 for n, v in t.items()}, recall=float(np.mean(rec)),
                       recall_wide=float(np.mean(rec_w)))
            out.append(row)
            print(f"| {row['case']} | {N} | {row['pariskv_ms']:.3f} | {row['wide_ms']:.3f} | {row['exact_ms']:.3f} | "
                  f"{row['dense_ms']:.3f} | {row['sdpa_gqa_ms']:.3f} | {row['sdpa_grouped_ms']:.3f} | "
                  f"{t['sdpa_grouped'] / t['pariskv']:.2f} | {t['sdpa_grouped'] / t['wide']:.2f} | {row['recall']:.3f} | "
                  f"{row['recall_wide']:.3f} |", flush=True)
            del impls, K, V, Q, s


def smollm2(args, layer_rows, step_rows):
    import transformers

    import kvscore.generation as kg
    from kvscore import quality

    model, tok = quality.load_model(args.model)
    ids_all = tok.encode(quality.license_text(quality.HAYSTACK_TEXTS), add_special_tokens=False, return_tensors="pt")
    Nmax = max(args.smol_lengths)
    prefill = quality.SharedPrefill(model, ids_all[:, :Nmax])
    L = len(prefill.records)
    default_below = _kvscore.retrieval_dense_below(model.config.head_dim)
    print(f"\n### SmolLM2-135M-Instruct, all {L} layers summed (head_dim 64, GQA 3:1), 10 % attended\n")
    print("| tokens | ParisKV ms | ParisKV wide ms | exact top-k ms | C++ dense ms | RetrievalCache step ms | "
          "sdpa enable_gqa ms | sdpa grouped ms | grouped / ParisKV | grouped / RetrievalCache | recall@k | recall@k wide |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for N in args.smol_lengths:
        budget = kvscore.budget_from_ratio(N, 0.1)
        k = budget - SINKS - LOCAL
        layers = []
        for module, kw, _, K, V in prefill.records:
            K, V = K[:, :, :N].contiguous(), V[:, :, :N].contiguous()
            with torch.no_grad():
                q = quality.post_rope_queries(module, kw["hidden_states"][:, N - 1:N],
                                              tuple(x[:, N - 1:N] for x in kw["position_embeddings"])).float()
            sc = float(module.scaling)
            impls = {"pariskv": layer_cache(K, V, k, args.threads, scale=sc),
                     "wide": layer_cache(K, V, k, args.threads, rerank=args.rerank * k, beta=args.beta, rho=args.rho,
                                         scale=sc),
                     "exact": layer_cache(K, V, k, args.threads, exact=True, scale=sc),
                     "dense": layer_cache(K, V, k, args.threads, dense_below=ALWAYS, scale=sc)}
            layers.append(Layer(K, V, q.contiguous(), impls, sc))
        t = time_layers(layers, ("pariskv", "wide", "exact", "dense", "sdpa_gqa", "sdpa_grouped"), args.reps)
        cache_step = t["dense"] if N < max(default_below, SINKS + LOCAL + 2 * k) else t["pariskv"]
        qh = layers[0].q.shape[1]
        row = dict(tokens=N, attended=budget / N, **{f"{n}_ms": v * 1e3 for n, v in t.items()},
                   retrieval_cache_ms=cache_step * 1e3, recall=recall(layers, "pariskv", qh),
                   recall_wide=recall(layers, "wide", qh))
        layer_rows.append(row)
        print(f"| {N} | {row['pariskv_ms']:.2f} | {row['wide_ms']:.2f} | {row['exact_ms']:.2f} | {row['dense_ms']:.2f} | "
              f"{row['retrieval_cache_ms']:.2f} | {row['sdpa_gqa_ms']:.2f} | {row['sdpa_grouped_ms']:.2f} | "
              f"{t['sdpa_grouped'] / t['pariskv']:.2f} | {t['sdpa_grouped'] / cache_step:.2f} | {row['recall']:.3f} | "
              f"{row['recall_wide']:.3f} |", flush=True)
        del layers

    print("\n### SmolLM2-135M-Instruct, the model's decode step (best of the reps, interleaved)\n")
    print("| tokens | DynamicCache ms | RetrievalCache ms | RetrievalCache(dense_below=0) ms | "
          "DynamicCache / RetrievalCache | DynamicCache / dense_below=0 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for N in args.smol_lengths:
        kv = [(K[:, :, :N], V[:, :, :N]) for _, _, _, K, V in prefill.records]

        def dynamic():
            c = transformers.DynamicCache()
            for i, (K, V) in enumerate(kv):
                c.update(K.clone(), V.clone(), i)
            return c

        def retrieval(**kw):
            c = kg.RetrievalCache(model, attend=0.1, sinks=SINKS, local=LOCAL, threads=args.threads, **kw)
            for i, (K, V) in enumerate(kv):
                c.prefill(i, K, V)
            return c

        caches = {"DynamicCache": dynamic(), "RetrievalCache": retrieval(),
                  "RetrievalCache(dense_below=0)": retrieval(dense_below=0)}
        nxt = ids_all[:, N:N + 1] if ids_all.shape[1] > N else ids_all[:, :1]
        pos = torch.tensor([[N]])
        best = {n: float("inf") for n in caches}
        with torch.inference_mode():
            for _ in range(args.step_reps):
                for n, c in caches.items():
                    t0 = time.perf_counter()
                    model(input_ids=nxt, past_key_values=c, position_ids=pos)
                    best[n] = min(best[n], time.perf_counter() - t0)
                    c.crop(N)
        d, r, r0 = best["DynamicCache"], best["RetrievalCache"], best["RetrievalCache(dense_below=0)"]
        step_rows.append(dict(tokens=N, dynamic_ms=d * 1e3, retrieval_ms=r * 1e3, retrieval_always_ms=r0 * 1e3,
                              speedup=d / r, speedup_always=d / r0))
        print(f"| {N} | {d * 1e3:.1f} | {r * 1e3:.1f} | {r0 * 1e3:.1f} | {d / r:.2f} | {d / r0:.2f} |", flush=True)
        del caches


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20, help="interleaved steps per layer measurement")
    ap.add_argument("--step-reps", type=int, default=8, help="interleaved model decode steps per cache")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=100, help="retrieved keys per query head (long synthetic layers)")
    ap.add_argument("--rerank", type=int, default=10, help="the wide ParisKV reranks rerank*k candidates exactly")
    ap.add_argument("--beta", type=float, default=0.3, help="the wide ParisKV's Stage-I candidate fraction")
    ap.add_argument("--rho", type=float, default=0.5, help="the wide ParisKV's collision fraction")
    ap.add_argument("--crossover-lengths", default="1024,2048,3072,4096,6144,8192",
                    help="lengths of the threshold sweep ('' skips it)")
    ap.add_argument("--crossover-layers", type=int, default=8, help="distinct synthetic layers per sweep step")
    ap.add_argument("--lengths", default="32768,131072", help="long synthetic lengths ('' skips them)")
    ap.add_argument("--smol-lengths", default="1024,2048,4096,8192", help="SmolLM2 lengths ('' skips SmolLM2)")
    ap.add_argument("--model", help="SmolLM2 GGUF (default $KVSCORE_SMOLLM2 or .models/)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    for name in ("crossover_lengths", "lengths", "smol_lengths"):
        setattr(a, name, [int(x) for x in getattr(a, name).split(",") if x])
    torch.set_num_threads(a.threads)
    print(f"kvscore {kvscore.__version__}, {cpu_name()}, ISA {kvscore.isa()}, torch {torch.__version__}, "
          f"{a.threads} thread(s), best of {a.reps} interleaved steps")
    res = {"cpu": cpu_name(), "isa": kvscore.isa(), "threads": a.threads, "crossover": [], "long": [],
           "smollm2_layers": [], "smollm2_step": []}
    if a.crossover_lengths:
        crossover(a, res["crossover"])
    if a.lengths:
        long_synthetic(a, res["long"])
    if a.smol_lengths:
        smollm2(a, res["smollm2_layers"], res["smollm2_step"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
