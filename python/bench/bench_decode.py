#!/usr/bin/env python3
"""Decode-step speed of kvscore.generation's retrieval (docs/generation.md): a benchmark, not a test.

1. Synthetic layers (`kvscore synth --kind drift`, fp32): N = 32K and 128K tokens, head_dim 64
   with GQA 3:1 (3 KV heads, 9 query heads) and head_dim 128 with GQA 4:1 (8 KV / 32 query
   heads). Per decode step of one layer, interleaved in the same run: the C++ layer cache's
   forward (the token's append + every query head's retrieval and attention) for ParisKV and for
   the exact top-k retriever, against torch's scaled_dot_product_attention over the full keys and
   values, two ways: with enable_gqa (K and V expanded per query head, as transformers' sdpa path
   does with repeat_kv) and grouped (a KV head's G queries as G rows: K and V read once, the
   faster one, which the speed-ups are against). recall@k of ParisKV's retrieved keys
   against the exact top k of the same zone, same queries.
2. SmolLM2-135M-Instruct (30 layers, 9/3 heads, head_dim 64) at 2K / 4K / 8K tokens of a license
   text: the same per-layer step on the model's own keys, values and next-token queries (every
   layer, summed), and end-to-end greedy decode tokens/s at 8K: DynamicCache against
   RetrievalCache (pariskv and exact, 10 % of the keys attended).
Retrieval: 4 sinks, a local window of 64, k = 100 retrieved keys per query head (synthetic) or
10 % of the context attended (SmolLM2), ParisKV's length-adaptive beta / rho: the paper's pipeline
(no rerank) and a wider search: beta = --beta, rho = --rho and an exact rerank of --rerank * k
candidates (the keys are resident), which reaches recall@k >= 0.9 on the drift data.
Best of --reps interleaved steps; --threads for torch and the C++ calls alike. Prints Markdown
and writes --json.
"""
import argparse
import json
import time

import numpy as np
import torch

import kvscore
from kvscore import _kvscore


def step_pair(impl, K, V, Q, reps, threads):
    """(best retrieval step s, best sdpa step s with enable_gqa, best grouped sdpa step s) of one layer."""
    b, H, N, d = K.shape
    qh = Q.shape[1]
    out = torch.empty(1, 1, qh, d)
    k_new, v_new = K[:, :, -1:].clone(), V[:, :, -1:].clone()
    tr, td, tg = [], [], []
    for r in range(reps):
        q = Q[:, :, r % Q.shape[2]: r % Q.shape[2] + 1].contiguous()
        t0 = time.perf_counter()
        impl.forward(k_new, v_new, q, out.permute(0, 2, 1, 3))
        tr.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(q, K, V, enable_gqa=True)
        td.append(time.perf_counter() - t0)
        # the same dense attention without expanding K/V per query head: a group's G queries as
        # G rows against its KV head (what a GQA-aware dense kernel reads: K and V once)
        t0 = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(q.view(b, H, qh // H, d), K, V)
        tg.append(time.perf_counter() - t0)
        impl.crop(impl.size - 1)  # the same cache for every step
    return min(tr), min(td), min(tg)


def recall(paris, exact, qh):
    """Mean |ParisKV ∩ exact| / |exact| over the query heads of the last step."""
    r = []
    for j in range(qh):
        a, b = set(paris.positions(0, j).tolist()), set(exact.positions(0, j).tolist())
        r.append(len(a & b) / len(b))
    return float(np.mean(r))


def make(cls, H, d, K, V, k, exact, threads, local=64, sinks=4, rerank=0, beta=0.0, rho=0.0):
    impl = getattr(_kvscore, cls)(1, H, d, sinks=sinks, local=local, update_interval=1, k=k, exact=exact,
                                  scale=d ** -0.5, rerank_exact=rerank, beta=beta, rho=rho)
    impl.num_threads = threads
    impl.append(K, V)
    return impl


def synthetic(args, rows):
    for d, H, G in ((64, 3, 3), (128, 8, 4)):
        for N in args.lengths:
            s = kvscore.synth("drift", layers=1, kv_heads=H, group=G, tokens=N, head_dim=d, queries=args.reps)
            K, V = torch.from_numpy(s["K"]), torch.from_numpy(s["V"])  # [1, H, N, d]
            Q = torch.from_numpy(s["Q"])  # [1, H*G, reps, d]
            paris = make("ParisKVLayerCacheF32", H, d, K, V, args.k, False, args.threads)
            rr = make("ParisKVLayerCacheF32", H, d, K, V, args.k, False, args.threads, rerank=args.rerank * args.k, beta=args.beta, rho=args.rho)
            exact = make("ParisKVLayerCacheF32", H, d, K, V, args.k, True, args.threads)
            tp, td, tg = step_pair(paris, K, V, Q, args.reps, args.threads)
            tr, _, _ = step_pair(rr, K, V, Q, args.reps, args.threads)
            te, _, _ = step_pair(exact, K, V, Q, args.reps, args.threads)
            # recall on one step of every query (the retrieval depends on the query only)
            rec, rec_rr = [], []
            out = torch.empty(1, 1, H * G, d)
            for r in range(min(args.reps, 16)):
                q = Q[:, :, r:r + 1].contiguous()
                for impl in (paris, rr, exact):
                    impl.forward(K[:, :, -1:].clone(), V[:, :, -1:].clone(), q, out.permute(0, 2, 1, 3))
                rec.append(recall(paris, exact, H * G))
                rec_rr.append(recall(rr, exact, H * G))
                for impl in (paris, rr, exact):
                    impl.crop(impl.size - 1)
            rows.append(dict(case=f"synth drift d{d} GQA {G}:1 ({H} KV heads)", tokens=N, pariskv_ms=tp * 1e3,
                             rerank_ms=tr * 1e3, exact_ms=te * 1e3, sdpa_ms=td * 1e3, grouped_ms=tg * 1e3,
                             speedup=tg / tp, speedup_rerank=tg / tr, recall=float(np.mean(rec)),
                             recall_rerank=float(np.mean(rec_rr)), attended=(4 + 64 + args.k) / N))
            print_row(rows[-1])
            del paris, rr, exact, K, V, s


def smollm2_layers(args, rows, model, ids_all):
    from kvscore import quality

    L = len(model.model.layers)
    for N in args.smol_lengths:
        ids = ids_all[:, :N]
        prefill = quality.SharedPrefill(model, ids)
        budget = kvscore.budget_from_ratio(N, 0.1)
        tp = tr = te = td = tg = 0.0
        rec, rec_rr = [], []
        for i in range(L):
            module, kw, _, K, V = prefill.records[i]
            q = quality.post_rope_queries(module, kw["hidden_states"][:, -1:],
                                          tuple(x[:, -1:] for x in kw["position_embeddings"])).float()
            Q = q.expand(-1, -1, args.reps, -1).contiguous()
            d, H = K.shape[-1], K.shape[1]
            k = budget - 68
            paris = make("ParisKVLayerCacheF32", H, d, K, V, k, False, args.threads)
            rr = make("ParisKVLayerCacheF32", H, d, K, V, k, False, args.threads, rerank=args.rerank * k, beta=args.beta, rho=args.rho)
            exact = make("ParisKVLayerCacheF32", H, d, K, V, k, True, args.threads)
            a, dn, dg = step_pair(paris, K, V, Q, args.reps, args.threads)
            c, _, _ = step_pair(rr, K, V, Q, args.reps, args.threads)
            b, _, _ = step_pair(exact, K, V, Q, args.reps, args.threads)
            tp, tr, te, td, tg = tp + a, tr + c, te + b, td + dn, tg + dg
            out = torch.empty(1, 1, q.shape[1], d)
            for impl in (paris, rr, exact):
                impl.forward(K[:, :, -1:].clone(), V[:, :, -1:].clone(), q, out.permute(0, 2, 1, 3))
            rec.append(recall(paris, exact, q.shape[1]))
            rec_rr.append(recall(rr, exact, q.shape[1]))
        rows.append(dict(case=f"SmolLM2, all {L} layers summed (d64 GQA 3:1)", tokens=N, pariskv_ms=tp * 1e3,
                         rerank_ms=tr * 1e3, exact_ms=te * 1e3, sdpa_ms=td * 1e3, grouped_ms=tg * 1e3,
                         speedup=tg / tp, speedup_rerank=tg / tr, recall=float(np.mean(rec)),
                         recall_rerank=float(np.mean(rec_rr)), attended=budget / N))
        print_row(rows[-1])


def smollm2_e2e(args, e2e, model, ids_all):
    import kvscore.generation as kg

    N = max(args.smol_lengths)
    ids = ids_all[:, :N]
    for name, make_cache in (("DynamicCache", lambda: __import__("transformers").DynamicCache()),
                             ("RetrievalCache pariskv 10 %", lambda: kg.RetrievalCache(model, attend=0.1, sinks=4,
                                                                                       local=64, threads=args.threads)),
                             ("RetrievalCache exact 10 %", lambda: kg.RetrievalCache(model, "exact", attend=0.1,
                                                                                     sinks=4, local=64,
                                                                                     threads=args.threads))):
        cache = make_cache()
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            t1 = time.perf_counter()
            nxt = out.logits[:, -1:].argmax(-1)
            pos = N
            steps = args.decode_tokens
            t2 = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=nxt, past_key_values=cache, position_ids=torch.tensor([[pos]]))
                nxt = out.logits[:, -1:].argmax(-1)
                pos += 1
            t3 = time.perf_counter()
        e2e.append(dict(cache=name, tokens=N, prefill_s=t1 - t0, decode_tok_s=steps / (t3 - t2)))
        print(f"| {name} | {N} | {t1 - t0:.2f} s | {steps / (t3 - t2):.2f} tok/s |")


def print_row(r):
    print(f"| {r['case']} | {r['tokens']} | {r['attended']:.3f} | {r['pariskv_ms']:.3f} | {r['rerank_ms']:.3f} | "
          f"{r['exact_ms']:.3f} | {r['sdpa_ms']:.3f} | {r['grouped_ms']:.3f} | {r['speedup']:.2f} | {r['speedup_rerank']:.2f} | "
          f"{r['recall']:.3f} | {r['recall_rerank']:.3f} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=100, help="retrieved keys per query head (synthetic)")
    ap.add_argument("--rerank", type=int, default=10, help="the second ParisKV row reranks rerank*k candidates "
                    "exactly (rerank_exact; docs/pariskv.md's benchmark mode)")
    ap.add_argument("--beta", type=float, default=0.3, help="the second ParisKV row's Stage-I candidate fraction")
    ap.add_argument("--rho", type=float, default=0.5, help="the second ParisKV row's Stage-II fraction")
    ap.add_argument("--lengths", default="32768,131072", help="synthetic lengths")
    ap.add_argument("--smol-lengths", default="2048,4096,8192", help="SmolLM2 lengths ('' skips SmolLM2)")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--model", help="SmolLM2 GGUF (default $KVSCORE_SMOLLM2 or .models/)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",") if x]
    a.smol_lengths = [int(x) for x in a.smol_lengths.split(",") if x]
    torch.set_num_threads(a.threads)
    print(f"kvscore {kvscore.__version__}, ISA {kvscore.isa()}, torch {torch.__version__}, {a.threads} thread(s), "
          f"best of {a.reps} interleaved steps\n")
    print(f"| layer | tokens | attended | ParisKV step ms | ParisKV β {a.beta:g} ρ {a.rho:g} + rerank {a.rerank}k ms | exact top-k step ms | "
          f"sdpa (enable_gqa) ms | sdpa grouped ms | dense / ParisKV | dense / ParisKV wide | recall@k | "
          f"recall@k wide |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows, e2e = [], []
    synthetic(a, rows)
    if a.smol_lengths:
        from kvscore import quality

        model, tok = quality.load_model(a.model)
        ids_all = tok.encode(quality.license_text(quality.HAYSTACK_TEXTS), add_special_tokens=False,
                             return_tensors="pt")
        smollm2_layers(a, rows, model, ids_all)
        print("\n(end to end, greedy decode after the prefill)\n\n| cache | tokens | prefill | decode |\n"
              "| --- | ---: | ---: | ---: |")
        smollm2_e2e(a, e2e, model, ids_all)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"isa": kvscore.isa(), "threads": a.threads, "layers": rows, "end_to_end": e2e}, f, indent=1)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
