"""Why an engine wants kvscore (docs/guides/vllm.md, scripts/vllm_bench.sh): vLLM CPU serving many long
requests with a KV cache too small to hold them all, with and without kvscore, in one run; and
(--workload decode) how fast decoding is with sparse decode and eviction.

    python -m kvscore.vllm.bench --model DIR [--prompts 32] [--length 2048] [--max-tokens 64]
                                 [--blocks 540] [--methods keydiff,knorm] [--ratio 0.5] [--out FILE]
    python -m kvscore.vllm.bench --model DIR --workload decode [--length 8192] [--max-tokens 256]
                                 [--batches 1,8,16] [--configs vllm,attend=0.1,attend=0.05,ratio=0.5,...]
                                 [--shape llama-3.2-3b [--prefix-caching]]
    python -m kvscore.vllm.bench --model DIR --workload needle [--lengths 2048,4096,7168] [--cases 64]
                                 [--batch 8] [--configs vllm,attend=0.1,attend=0.05] [--probe]
    python -m kvscore.vllm.bench --model DIR --workload shared-prefix [--length 6144] [--prompts 8]
                                 [--max-tokens 64] [--configs vllm,attend=0.1]

--workload shared-prefix: one document of --length tokens (a needle context), --prompts requests
each asking its own question about it, all submitted at once; every configuration runs with
prefix caching off and on (vLLM's enable_prefix_caching). Reported: decode tokens/s (steps where
every request decodes) and vLLM's attention time within those steps, time to first token per
request (from submission), and the prefix-cache hit rate (vLLM's num_cached_tokens over the prompt
tokens).

--workload needle: passkey prompts the model answers in its own words (kvscore.vllm.needle).

--workload decode: for each configuration one engine (max_num_seqs = the largest batch) runs the
batches one after another (batch B: the first B prompts, all at once); every step is timed, and a
step whose requests all decode (one token each) counts towards that batch's decode tokens/s (the
JSON keeps each such step's seconds, decode_step_s, and with sparse decode its selection's,
decode_step_select_s: the selection per decode step is theirs, not the steps' where some requests
still prefill). The
CPU attention kernel's own time is measured in every run (its class method wrapped in this
process), so the selection's cost compares with the dense attention it replaces. --shape runs a
published architecture with random weights in bf16 (kvscore.vllm.shapes) and prints the bytes bound
beside each figure; with --prefix-caching the prompts share one document (all but their last 64
tokens), which is prefilled once, and each batch reports its prefix-cache hit rate (the needle is
then checked on the first prompt only: the others' facts are not in the shared document).

The prompts are the quality benchmark's needle contexts (kvscore.quality.make_contexts: licence
texts with 4 planted facts), each asking for one fact with the answer prefix given; greedy, each
request generates exactly --max-tokens tokens. Every configuration runs in its own process
(vLLM's connector agent is process-wide) with the same pool of --blocks KV blocks
(num_gpu_blocks_override), all requests submitted at once; the engine is stepped and after each
step the scheduler's running requests and the pool's blocks in use are read. Reported per
configuration: peak and mean concurrent requests, peak blocks in use, wall time of the whole
batch and generated tokens/s, needle accuracy, and for kvscore the blocks freed and the time
spent scoring, selecting and freeing, against the prefill time of the same prompts (a
max_tokens=1 run of plain vLLM, also in this run). Timings are wall-clock on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


DECODE_CONFIGS = "vllm,attend=0.1,attend=0.05,ratio=0.5,attend=0.1@ratio=0.5"  # --configs' default


def _prompts(model: str, n: int, length: int):
    from transformers import AutoTokenizer

    from kvscore import quality as Q
    tok = AutoTokenizer.from_pretrained(model)
    ctxs = Q.make_contexts(tok, [length], {length: n}, seed=0)
    out = []
    for i, c in enumerate(ctxs):
        question, prefix, expected = Q.questions(c)[i % len(c.needles)]
        text = tok.apply_chat_template([{"role": "user", "content": f"{c.text}\n\n{question}"}],
                                       add_generation_prompt=True, tokenize=False) + prefix
        out.append((tok.encode(text, add_special_tokens=False), expected))
    return out


def _time_attention() -> dict:
    """Wraps vLLM CPU's attention kernel call (the backend class's forward) to add up its time."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl

    acc = {"s": 0.0}
    orig = Impl.forward

    def forward(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return orig(self, *args, **kwargs)
        finally:
            acc["s"] += time.perf_counter() - t0

    Impl.forward = forward
    return acc


def _attention_isa(llm) -> str | None:
    """The CPU attention ISA vLLM picked (vec, vec16, amx, neon), read from the first layer."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
        ex = llm.llm_engine.engine_core.engine_core.model_executor
        cfg = ex.driver_worker.worker.model_runner.vllm_config
        layers = get_layers_from_vllm_config(cfg, Attention)
        return str(getattr(next(iter(layers.values())), "isa", None))
    except Exception:  # noqa: BLE001 (only a label for the report)
        return None


def _decode_run(spec: dict) -> dict:
    """--workload decode, one configuration: batches one after another in one engine."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "7")  # 16 requests of ~7.8K tokens: 5.8 GB at fp32
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    att = _time_attention()
    kw = {}
    if spec.get("plugin"):
        from kvscore.vllm import kv_transfer_config
        kw["kv_transfer_config"] = kv_transfer_config(**spec["plugin"])
    if spec.get("blocks"):
        kw["num_gpu_blocks_override"] = spec["blocks"]
    batches = spec["batches"]
    if spec.get("shape"):  # a published architecture with random weights (kvscore.vllm.shapes)
        kw["load_format"] = "dummy"
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
              max_model_len=spec["max_model_len"], block_size=32,
              enable_prefix_caching=bool(spec.get("prefix_caching")), seed=0,
              max_num_seqs=max(batches), max_num_batched_tokens=spec.get("max_num_batched_tokens", 8192), **kw)
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    last = {}
    orig_schedule = sched.schedule

    def schedule(*a, **k):
        out = orig_schedule(*a, **k)
        last["n"] = dict(out.num_scheduled_tokens)
        return out

    sched.schedule = schedule
    worker = None
    if spec.get("plugin"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        worker = get_kv_transfer_group()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    prompts = _prompts(spec["model"], max(batches), spec["length"])
    if spec.get("shape"):  # random weights: any text of the length will do; the needle says nothing
        prompts = [(p * (-(-spec["length"] // len(p))))[: spec["length"]] for p, _ in prompts]
        prompts = [(p, "") for p in prompts]
    if spec.get("prefix_caching"):  # one document, a question each: all but the last 64 tokens shared
        doc = prompts[0][0][:-64]  # (the other prompts' needles are not in it: no answers to check)
        prompts = prompts[:1] + [(doc + p[-64:], "") for p, _ in prompts[1:]]
    res = {"batches": {}, "prompt_tokens_mean": sum(len(p) for p, _ in prompts) / len(prompts),
           "isa": _attention_isa(llm)}
    for B in batches:
        st0 = dict(worker.sparse_stats) if worker is not None else None
        probe0 = worker._selector.probe if worker is not None and worker._selector is not None else (0, 0)
        for i, (ids, _) in enumerate(prompts[:B]):
            eng.add_request(f"b{B}q{i}", TokensPrompt(prompt_token_ids=ids), sp)
        outs, dec_s, dec_tok, dec_att, all_s, steps, running = {}, 0.0, 0, 0.0, 0.0, 0, []
        cached_tokens, step_s, step_select_s = {}, [], []
        t_all = time.perf_counter()
        while eng.has_unfinished_requests():
            sel0 = worker.sparse_stats["select_s"] if worker is not None else 0.0
            a0, t0 = att["s"], time.perf_counter()
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = list(o.outputs[0].token_ids)
                    cached_tokens[o.request_id] = o.num_cached_tokens or 0
            dt = time.perf_counter() - t0
            n = last.get("n", {})
            if n and all(v == 1 for v in n.values()):  # every request decodes one token
                dec_s += dt
                dec_tok += len(n)
                dec_att += att["s"] - a0
                steps += 1
                running.append(len(n))
                step_s.append(dt)
                if worker is not None:
                    step_select_s.append(worker.sparse_stats["select_s"] - sel0)
        wall = time.perf_counter() - t_all
        correct = 0
        cached = sum(cached_tokens.get(f"b{B}q{i}", 0) for i in range(B))
        for i, (_, expected) in enumerate(prompts[:B]):
            text = tok.decode(outs[f"b{B}q{i}"], skip_special_tokens=True)
            correct += int(bool(expected) and text.strip()[: len(expected) + 2].startswith(expected))
        r = {"wall_s": wall, "decode_steps": steps, "decode_s": dec_s, "decode_tokens": dec_tok,
             "decode_tokens_per_s": dec_tok / max(dec_s, 1e-9), "decode_attention_s": dec_att,
             "mean_decode_batch": sum(running) / max(1, len(running)), "needle_correct": correct,
             "needle_total": sum(1 for _, e in prompts[:B] if e), "prefix_hit_rate": cached / max(1, sum(len(p) for p, _ in prompts[:B])),
             "decode_step_s": step_s}
        if step_select_s:
            r["decode_step_select_s"] = step_select_s
        if worker is not None:
            st = {k: worker.sparse_stats[k] - st0[k] for k in st0}
            r["sparse"] = st
            # the decode steps' own selection (steps where some requests still prefill select too)
            r["select_s_per_decode_step"] = sum(step_select_s) / max(1, steps) + st["plan_s"] / max(1, st["steps"])
            if st["blocks_total"]:
                r["blocks_attended_fraction"] = st["blocks_attended"] / st["blocks_total"]
            if worker._selector is not None:
                p1 = worker._selector.probe
                if p1[0] > probe0[0]:
                    r["recall_of_exact_blocks"] = (p1[1] - probe0[1]) / (p1[0] - probe0[0])
        res["batches"][str(B)] = r
    return res


def _shared_prefix_run(spec: dict) -> dict:
    """--workload shared-prefix, one configuration: every prompt submitted at once, stepped to the end."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    att = _time_attention()
    kw = {}
    if spec.get("plugin"):
        from kvscore.vllm import kv_transfer_config
        kw["kv_transfer_config"] = kv_transfer_config(**spec["plugin"])
    prompts = spec["prompts"]
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec["max_model_len"],
              block_size=32, enable_prefix_caching=spec["prefix_caching"], seed=0, max_num_seqs=len(prompts),
              max_num_batched_tokens=spec.get("max_num_batched_tokens", 8192), **kw)
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    last = {}
    orig_schedule = sched.schedule

    def schedule(*a, **k):
        out = orig_schedule(*a, **k)
        last["n"] = dict(out.num_scheduled_tokens)
        return out

    sched.schedule = schedule
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    t_add = {}
    for i, ids in enumerate(prompts):
        eng.add_request(f"q{i}", TokensPrompt(prompt_token_ids=ids), sp)
        t_add[f"q{i}"] = time.perf_counter()
    ttft, cached, outs = {}, {}, {}
    dec_s, dec_tok, dec_att = 0.0, 0, 0.0
    t_all = time.perf_counter()
    while eng.has_unfinished_requests():
        a0, t0 = att["s"], time.perf_counter()
        step_outs = eng.step()
        t1 = time.perf_counter()
        for o in step_outs:
            if o.request_id not in ttft and o.outputs and o.outputs[0].token_ids:
                ttft[o.request_id] = t1 - t_add[o.request_id]
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
                cached[o.request_id] = o.num_cached_tokens or 0
        n = last.get("n", {})
        if n and all(v == 1 for v in n.values()):
            dec_s += t1 - t0
            dec_tok += len(n)
            dec_att += att["s"] - a0
    wall = time.perf_counter() - t_all
    ids = [f"q{i}" for i in range(len(prompts))]
    prompt_tokens = sum(len(p) for p in prompts)
    return {"wall_s": wall, "decode_tokens_per_s": dec_tok / max(dec_s, 1e-9), "decode_steps_s": dec_s,
            "decode_attention_s": dec_att,
            "ttft_s": [ttft[r] for r in ids], "ttft_mean_s": sum(ttft.values()) / len(ttft),
            "cached_tokens": [cached[r] for r in ids], "prompt_tokens": prompt_tokens,
            "prefix_hit_rate": sum(cached.values()) / prompt_tokens, "tokens": [outs[r] for r in ids]}


def _shared_prefix_main(a) -> int:
    from transformers import AutoTokenizer

    from kvscore import quality as Q
    tok = AutoTokenizer.from_pretrained(a.model)
    ctx = Q.make_contexts(tok, [a.length], {a.length: 1}, seed=0)[0]
    qs = Q.questions(ctx)
    prompts = []
    for i in range(a.prompts):  # one document, a question each (the needles' questions, then numbered)
        question, prefix, _ = qs[i % len(qs)]
        if i >= len(qs):
            question = f"{question} (Question {i + 1}.)"
        text = tok.apply_chat_template([{"role": "user", "content": f"{ctx.text}\n\n{question}"}],
                                       add_generation_prompt=True, tokenize=False) + prefix
        prompts.append(tok.encode(text, add_special_tokens=False))
    base = {"model": a.model, "prompts": prompts, "max_tokens": a.max_tokens,
            "max_model_len": max(len(p) for p in prompts) + a.max_tokens + 64}
    report = {"workload": "shared-prefix", "config": {"length": a.length, "prompts": a.prompts,
                                                      "max_tokens": a.max_tokens,
                                                      "prompt_tokens": [len(p) for p in prompts]}, "runs": {}}
    configs = a.configs if a.configs != DECODE_CONFIGS else "vllm,attend=0.1"
    print(f"vLLM CPU shared-prefix bench: {a.prompts} requests on one ~{a.length}-token document, "
          f"{a.max_tokens} generated each", flush=True)
    for entry in (e for e in configs.split(",") if e):
        plugin = None
        if entry != "vllm":
            plugin = {"method": a.method, "ratio": 0.0}
            for kv in entry.split("@"):
                k, v = kv.split("=", 1)
                plugin[k] = v if k in ("method", "block_score", "query_group") else float(v)
            for k in ("local", "dense_below", "sinks", "prefilter", "refresh", "threads"):
                if k in plugin:
                    plugin[k] = int(plugin[k])
        for pc in (False, True):
            name = f"{entry} prefix_caching={'on' if pc else 'off'}"
            r = _spawn({**base, "plugin": plugin, "prefix_caching": pc, "shared_prefix": True})
            report["runs"][name] = r
            print(f"  {name:36s} decode {r['decode_tokens_per_s']:.2f} tok/s (attention {r['decode_attention_s']:.1f} "
                  f"of {r['decode_steps_s']:.1f} s)  TTFT mean {r['ttft_mean_s']:.2f} s "
                  f"(first {r['ttft_s'][0]:.2f} s, last {max(r['ttft_s']):.2f} s)  prefix hit rate "
                  f"{r['prefix_hit_rate']:.3f}  wall {r['wall_s']:.1f} s", flush=True)
    runs = report["runs"]
    for entry in (e for e in configs.split(",") if e):
        off, on = runs.get(f"{entry} prefix_caching=off"), runs.get(f"{entry} prefix_caching=on")
        if off and on:
            same = sum(x == y for x, y in zip(off["tokens"], on["tokens"]))
            print(f"  {entry}: prefix caching on vs off: TTFT mean x{on['ttft_mean_s'] / off['ttft_mean_s']:.2f}, "
                  f"decode x{on['decode_tokens_per_s'] / off['decode_tokens_per_s']:.2f}, "
                  f"{same}/{len(on['tokens'])} requests' tokens identical", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _decode_main(a) -> int:
    batches = [int(x) for x in a.batches.split(",")]
    model, dtype = a.model, "float32"
    if a.shape:
        from . import shapes
        model = shapes.model_dir(a.shape, os.path.join(os.path.dirname(os.path.abspath(a.model)), "shapes", a.shape),
                                 a.model, dtype="bfloat16")
        dtype = "bfloat16"
    base = {"model": model, "length": a.length, "max_tokens": a.max_tokens, "batches": batches,
            "max_model_len": a.length + a.max_tokens + 64, "dtype": dtype, "shape": a.shape,
            "prefix_caching": a.prefix_caching}
    if a.blocks_decode:
        base["blocks"] = a.blocks_decode
    base["max_num_batched_tokens"] = a.max_num_batched_tokens
    report = {"workload": "decode", "config": {k: v for k, v in base.items() if k != "model"}, "runs": {}}
    if a.shape:
        from . import shapes
        report["config"]["shape_params"] = shapes.params(a.shape)
    print(f"vLLM CPU decode bench: prompts of ~{a.length} tokens, {a.max_tokens} generated each, batches {batches}",
          flush=True)
    for entry in (e for e in a.configs.split(",") if e):
        # "vllm" (plain) or "attend=0.1@ratio=0.5@block_score=meanstd" (kvscore settings; method knorm)
        plugin = None
        if entry != "vllm":
            plugin = {"method": a.method, "ratio": 0.0}
            for kv in entry.split("@"):
                k, v = kv.split("=", 1)
                plugin[k] = v if k in ("method", "block_score", "query_group") else (v == "True" if k == "probe" else float(v))
            for k in ("local", "dense_below", "sinks", "prefilter", "refresh", "threads"):
                if k in plugin:
                    plugin[k] = int(plugin[k])
        r = _spawn({**base, "plugin": plugin, "decode": True})
        report["runs"][entry] = r
        for B, x in r["batches"].items():
            extra = ""
            if "sparse" in x:
                sp = x["sparse"]
                other = sp["calls"] - sp["scoring_calls"]
                extra = (f"  selection {1e3 * x['select_s_per_decode_step']:.1f} ms/step (per layer call: scoring "
                         f"{1e3 * sp['scoring_s'] / max(1, sp['scoring_calls']):.3f} ms x {sp['scoring_calls']}, "
                         f"kept choices {1e3 * (sp['select_s'] - sp['scoring_s']) / max(1, other):.3f} ms x {other})"
                         + (f", blocks attended {x['blocks_attended_fraction']:.3f}" if "blocks_attended_fraction" in x else "")
                         + (f", recall of exact blocks {x['recall_of_exact_blocks']:.3f}" if "recall_of_exact_blocks" in x else ""))
            print(f"  {entry:32s} batch {B:>2s}: decode {x['decode_tokens_per_s']:.2f} tok/s ({x['decode_steps']} steps, "
                  f"attention {x['decode_attention_s']:.1f} of {x['decode_s']:.1f} s)  needle "
                  + (f"{x['needle_correct']}/{x['needle_total']}" if x["needle_total"] else "n/a")
                  + (f"  prefix hit rate {x['prefix_hit_rate']:.3f}" if a.prefix_caching else "") + extra, flush=True)
    if a.shape:  # the bytes bound beside every figure
        from . import shapes
        for entry, r in report["runs"].items():
            for B, x in r["batches"].items():
                n = int(r["prompt_tokens_mean"] + a.max_tokens / 2)  # a decode step's mean length
                plain_b = shapes.step_bytes(a.shape, [n] * int(B))
                x["bytes_per_step_plain"] = plain_b
                x["bytes_per_step"] = plain_b
                if "blocks_attended_fraction" in x:
                    d = shapes.SHAPES[a.shape]["head_dim"]
                    from . import DEFAULT_PREFILTER, DEFAULT_REFRESH
                    opts = dict(kv.split("=", 1) for kv in entry.split("@") if "=" in kv)
                    refresh = float(opts.get("refresh", DEFAULT_REFRESH))
                    prefilter = int(opts.get("prefilter", DEFAULT_PREFILTER))
                    # int4's reads per (block, KV head) when a row scores: the per-dimension min and step
                    # (fp32) and the 4-bit codes of every candidate; with a prefilter, Quest's min and max
                    # of every candidate and the step and codes of about prefilter x the chosen share
                    if prefilter == 0:
                        summ = int((2 * d * 4 + d * 16) / refresh)
                    else:
                        share = min(1.0, prefilter * x["blocks_attended_fraction"])
                        summ = int((2 * d * 4 + share * (d * 4 + d * 16)) / refresh)
                    att = [int(n * x["blocks_attended_fraction"])] * int(B)
                    x["bytes_per_step"] = shapes.step_bytes(a.shape, [n] * int(B), att, summary_bytes_per_block_head=summ)
                x["bound_x"] = plain_b / x["bytes_per_step"]
                x["bytes_per_s"] = x["bytes_per_step"] * x["decode_steps"] / max(x["decode_s"], 1e-9)
    plain = report["runs"].get("vllm")
    if plain:
        for entry, r in report["runs"].items():
            for B, x in r["batches"].items():
                p = plain["batches"][B]
                x["x_decode_tokens_per_s"] = x["decode_tokens_per_s"] / p["decode_tokens_per_s"]
                if "select_s_per_decode_step" in x:
                    x["selection_vs_dense_attention"] = x["select_s_per_decode_step"] / max(
                        p["decode_attention_s"] / max(1, p["decode_steps"]), 1e-9)
            if entry != "vllm":
                print(f"  {entry}: " + ", ".join(
                    f"batch {B} x{x['x_decode_tokens_per_s']:.2f}"
                    + (f" (bound x{x['bound_x']:.2f}: {x['bytes_per_step'] / 1e9:.2f} of "
                       f"{x['bytes_per_step_plain'] / 1e9:.2f} GB per step)" if "bound_x" in x else "")
                    + (f" (selection {100 * x['selection_vs_dense_attention']:.1f} % of dense attention)"
                       if "selection_vs_dense_attention" in x else "") for B, x in r["batches"].items()), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _run(spec: dict) -> dict:
    """One engine (this process): submit every prompt, step to the end, watch the scheduler."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # the pool is num_gpu_blocks_override blocks (GiB here only bounds it); CI mode: no memory-
    # utilisation check against a machine shared with other work
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if spec.get("plugin"):
        from kvscore.vllm import kv_transfer_config
        kw["kv_transfer_config"] = kv_transfer_config(**spec["plugin"])
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec["max_model_len"],
              block_size=32, enable_prefix_caching=False, seed=0, num_gpu_blocks_override=spec["blocks"],
              watermark=spec.get("watermark", 0.0), **kw)
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    tok = AutoTokenizer.from_pretrained(spec["model"])
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    prompts = _prompts(spec["model"], spec["prompts"], spec["length"])
    total = pool.num_gpu_blocks - 1  # less vLLM's null block
    preempted = []  # vLLM preempts (and later recomputes) a running request when the pool runs dry
    orig_preempt = sched._preempt_request

    def _preempt(*args, **kwargs):
        preempted.append(1)
        return orig_preempt(*args, **kwargs)

    sched._preempt_request = _preempt
    running, used = [], []
    import resource
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for i, (ids, _) in enumerate(prompts):
        eng.add_request(f"q{i}", TokensPrompt(prompt_token_ids=ids), sp)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        running.append(len(sched.running))
        used.append(total - pool.get_num_free_blocks())
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)  # every thread of this process
    gen = sum(len(v) for v in outs.values())
    correct = 0
    for i, (_, expected) in enumerate(prompts):
        text = tok.decode(outs[f"q{i}"], skip_special_tokens=True)
        correct += int(text.strip()[: len(expected) + 2].startswith(expected))
    res = {"wall_s": wall, "cpu_s": cpu, "generated": gen, "tokens_per_s": gen / wall, "tokens_per_cpu_s": gen / cpu, "peak_running": max(running),
           "mean_running": sum(running) / len(running), "peak_blocks_used": max(used), "blocks_total": total,
           "blocks_per_running_request": sum(u / r for u, r in zip(used, running) if r) / max(1, sum(1 for r in running if r)),
           "needle_correct": correct, "needle_total": len(prompts), "steps": len(running),
           "prompt_tokens": sum(len(p) for p, _ in prompts), "torch_threads": torch.get_num_threads(),
           "preemptions": len(preempted), "watermark": spec.get("watermark", 0.0)}
    conn = sched.connector
    if conn is not None:
        res["blocks_freed"] = conn._freed_total
        res["score_select_free_s"] = conn._score_seconds
    return res


def _spawn(spec: dict) -> dict:
    arg = json.dumps(spec)
    if len(arg) > 65536:  # a command-line argument holds at most 128 KiB: a file instead ("@path")
        import tempfile
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            f.write(arg)
        arg = "@" + f.name
    p = subprocess.run([sys.executable, "-m", "kvscore.vllm.bench", "--run", arg], capture_output=True, text=True)
    if arg.startswith("@"):
        os.unlink(arg[1:])
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"bench run failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="SmolLM2 safetensors folder (scripts/smollm2_safetensors.sh)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--length", type=int, default=2048, help="nominal context length (kvscore.quality)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens generated (default 64; needle: 24)")
    ap.add_argument("--blocks", type=int, default=540, help="KV blocks of 32 tokens in the pool (all layers)")
    ap.add_argument("--methods", default="keydiff,knorm",
                    help="comma-separated; an entry may add plugin settings: knorm@aggregate=mean")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--block-aggregate", default=None, help="kvscore.vllm setting (default: the plugin's)")
    ap.add_argument("--aggregate", default=None, help="kvscore.vllm setting (default: the plugin's)")
    ap.add_argument("--watermark", type=float, default=0.0,
                    help="vLLM's scheduler watermark (fraction of blocks kept free when admitting), every run")
    ap.add_argument("--skip-plain", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", choices=("concurrency", "decode", "needle", "shared-prefix"), default="concurrency")
    ap.add_argument("--lengths", default=",".join(str(x) for x in (2048, 4096, 7168)),
                    help="needle workload: prompt lengths in tokens (chat template included)")
    ap.add_argument("--cases", type=int, default=64, help="needle workload: cases per length")
    ap.add_argument("--batch", type=int, default=8, help="needle workload: concurrent requests")
    ap.add_argument("--seed", type=int, default=0, help="needle workload: the cases' seed")
    ap.add_argument("--resume", action="store_true",
                    help="needle workload: keep the configurations --out already holds (the same cases)")
    ap.add_argument("--probe", action="store_true",
                    help="needle workload: the recall of the exact blocks per layer and decode step (slower)")
    ap.add_argument("--batches", default="1,8,16", help="decode workload: batch sizes, run one after another")
    ap.add_argument("--configs", default=DECODE_CONFIGS,
                    help="decode workload: 'vllm' (plain) or kvscore settings joined by '@'")
    ap.add_argument("--method", default="knorm", help="decode workload: the eviction scorer")
    ap.add_argument("--shape", default=None, choices=("llama-3.2-1b", "llama-3.2-3b", "qwen3-1.7b", "llama-3.1-8b"),
                    help="decode workload: a published architecture with random weights (load_format=dummy), bf16 "
                         "weights and KV cache, SmolLM2's tokenizer; --model names SmolLM2's folder")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="decode workload: vLLM's prefix caching on, and the prompts share all but their last 64 "
                         "tokens (one document, a question each): the document is prefilled once")
    ap.add_argument("--blocks-decode", type=int, default=0,
                    help="decode workload: KV blocks in the pool (0: VLLM_CPU_KVCACHE_SPACE decides)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="decode workload: vLLM's tokens per scheduler step (default 8192); a prompt "
                         "longer than it is prefilled in chunks (chunked prefill)")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.run is not None:
        if a.run.startswith("@"):
            with open(a.run[1:]) as f:
                spec = json.load(f)
        else:
            spec = json.loads(a.run)
        run = _shared_prefix_run if spec.get("shared_prefix") else _decode_run if spec.get("decode") else _run
        print("RESULT " + json.dumps(run(spec)), flush=True)
        return 0
    if not a.model:
        ap.error("--model is required")
    if a.workload == "needle":
        from . import needle
        if a.max_tokens is None:
            a.max_tokens = 24
        if a.configs == ap.get_default("configs"):
            a.configs = "vllm,attend=0.1,attend=0.05"
        return needle.main(a)
    if a.max_tokens is None:
        a.max_tokens = 64
    if a.max_num_batched_tokens < 1:
        ap.error(f"--max-num-batched-tokens {a.max_num_batched_tokens}: must be at least 1")
    if a.workload == "decode":
        return _decode_main(a)
    if a.workload == "shared-prefix":
        if a.length == ap.get_default("length"):
            a.length = 6144
        if a.prompts == ap.get_default("prompts"):
            a.prompts = 8
        return _shared_prefix_main(a)
    base = {"model": a.model, "prompts": a.prompts, "length": a.length, "max_tokens": a.max_tokens,
            "blocks": a.blocks, "max_model_len": a.length + a.max_tokens + 64, "watermark": a.watermark}
    extra = {k: v for k, v in (("block_aggregate", a.block_aggregate), ("aggregate", a.aggregate)) if v is not None}
    report = {"config": {k: v for k, v in base.items() if k != "model"}, "ratio": a.ratio, "runs": {}}
    print(f"vLLM CPU bench: {a.prompts} prompts of ~{a.length} tokens, {a.max_tokens} generated each, "
          f"{a.blocks} blocks of 32 tokens", flush=True)
    runs = [] if a.skip_plain else [("vllm", None)]
    for entry in (e for e in a.methods.split(",") if e):  # "knorm" or "knorm@aggregate=mean@..."
        method, *kv = entry.split("@")
        settings = dict(x.split("=", 1) for x in kv)
        runs.append((entry, {"method": method, "ratio": a.ratio, **extra, **settings}))
    for name, plugin in runs:
        r = _spawn({**base, "plugin": plugin})
        report["runs"][name] = r
        print(f"  {name:20s} peak running {r['peak_running']:3d} (mean {r['mean_running']:.1f})  peak blocks "
              f"{r['peak_blocks_used']}/{r['blocks_total']} ({r['blocks_per_running_request']:.1f} per running request)  "
              f"{r['tokens_per_s']:.1f} tok/s ({r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s CPU)  "
              f"needle {r['needle_correct']}/{r['needle_total']}  preemptions {r['preemptions']}", flush=True)
    if a.skip_plain:
        return 0
    pre = _spawn({**base, "max_tokens": 1, "plugin": None})
    report["prefill_only"] = pre
    print(f"  prefill only (plain vLLM, max_tokens=1): {pre['wall_s']:.1f} s", flush=True)
    plain = report["runs"]["vllm"]
    for name, r in report["runs"].items():
        # generated tokens per second of the time left after the prefill work (the prefill-only
        # run's wall time, this run): the decode throughput, derived
        r["decode_tokens_per_s"] = r["generated"] / max(r["wall_s"] - pre["wall_s"], 1e-9)
        if name == "vllm":
            continue
        r["x_peak_running"] = r["peak_running"] / plain["peak_running"]
        r["x_tokens_per_s"] = r["tokens_per_s"] / plain["tokens_per_s"]
        r["x_tokens_per_cpu_s"] = r["tokens_per_cpu_s"] / plain["tokens_per_cpu_s"]
        r["needle_vs_plain"] = r["needle_correct"] / max(plain["needle_correct"], 1)
        r["overhead_vs_prefill"] = r["score_select_free_s"] / pre["wall_s"]
        r["x_decode_tokens_per_s"] = r["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        print(f"  {name}: x{r['x_peak_running']:.2f} concurrent, x{r['x_tokens_per_s']:.2f} tokens/s "
              f"(x{r['x_tokens_per_cpu_s']:.2f} per CPU second) "
              f"(x{r['x_decode_tokens_per_s']:.2f} after the prefill time), needle "
              f"{r['needle_vs_plain']:.2f} of plain's, score+select+free {r['score_select_free_s']:.2f} s = "
              f"{100 * r['overhead_vs_prefill']:.2f} % of the prefill time", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
