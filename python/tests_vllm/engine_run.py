"""Runs one vLLM engine (CPU, in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0) on SmolLM2 and prints a
JSON line with what the tests compare; one process per engine, since vLLM's KV-connector agent
is a process-wide global. Used by python/tests_vllm/conftest.py's run_engines: through one
`--zygote` process that imports vLLM and torch once and forks a child per engine (a fork of a
process that has started no engine is a fresh one for vLLM; KVSCORE_VLLM_ZYGOTE=0: a new
interpreter per engine instead).

    python engine_run.py --zygote
    python engine_run.py SPEC_JSON       (SPEC: model, prompts [[ids]], max_tokens, batch, plugin {...} | null,
                                          capture: bool, block_size, stepwise: bool, arrive: [step per prompt],
                                          blocks: pool size, check: bool (kvscore.vllm.check's records),
                                          prefix_caching: bool, max_num_batched_tokens: chunked prefill's chunk,
                                          dtype: the model's and the cache's, float32 unless given)
"""
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")


def external(req_id: str) -> str:
    """The id a request was added with (vLLM 0.32 appends "-<random>" internally)."""
    return req_id.rsplit("-", 1)[0]


def main(spec):
    os.environ.update(spec.get("env", {}))
    if spec.get("check"):  # sparse decode's self-check in every worker (kvscore.vllm.check)
        import tempfile
        check_prefix = os.path.join(tempfile.mkdtemp(prefix="kvscore-check-"), "check")
        os.environ["KVSCORE_VLLM_CHECK"] = check_prefix
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import kvscore
    from kvscore import _kvscore as _k

    plugin = spec.get("plugin")
    kw = {}
    if plugin is not None:
        from kvscore.vllm import kv_transfer_config
        kw["kv_transfer_config"] = kv_transfer_config(**plugin)
        if spec.get("by_name"):  # the name the vllm.general_plugins entry point registers, no module path
            del kw["kv_transfer_config"]["kv_connector_module_path"]
    if spec.get("raw_extra") is not None:  # unvalidated settings: the engine must refuse them
        kw["kv_transfer_config"] = {"kv_connector": "KvscoreConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "kvscore.vllm.connector",
                                    "kv_connector_extra_config": spec["raw_extra"]}
    captured = []
    if spec.get("capture"):
        # the keys each worker scored, read back from vLLM's cache at the moment of scoring (the
        # worker half's score, which the connector's wait_for_save calls with the step's metadata)
        from kvscore.vllm import worker as W
        orig = W.KvscoreWorker.score

        def score(self, meta):
            for req_id, ids, tokens in meta.score:
                keys = [_k.vllm_cpu_keys(c, np.asarray(ids, dtype=np.int64), tokens, isa=self._isa) for c in self._caches]
                q = self._queries.get(req_id, {})  # SnapKV's window queries, per layer
                captured.append((req_id, tokens, keys, [q[n].permute(1, 0, 2).numpy() for n in q]))
            return orig(self, meta)

        W.KvscoreWorker.score = score
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True, max_model_len=spec.get("max_model_len", 2048),
              block_size=spec.get("block_size", 32), enable_prefix_caching=spec.get("prefix_caching", False), seed=0,
              max_num_seqs=spec.get("max_num_seqs", 256), tensor_parallel_size=spec.get("tp", 1),
              **({"num_gpu_blocks_override": spec["blocks"]} if spec.get("blocks") else {}),
              **({"max_num_batched_tokens": spec["max_num_batched_tokens"], "enable_chunked_prefill": True}
                 if spec.get("max_num_batched_tokens") else {}), **kw)
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    out = {"tokens": [], "decisions": [], "blocks": [], "preemptions": 0, "cached": [], "scheduled": []}
    orig_schedule = sched.schedule

    def _schedule(*a, **k):  # every step's scheduled tokens per request (chunks, mixed steps)
        so = orig_schedule(*a, **k)
        out["scheduled"].append({external(r): n for r, n in so.num_scheduled_tokens.items()})
        return so

    sched.schedule = _schedule
    orig_preempt = sched._preempt_request

    def _preempt(*a, **k):
        out["preemptions"] += 1
        return orig_preempt(*a, **k)

    sched._preempt_request = _preempt
    prompts = spec["prompts"]
    for batch, s in [(b, s) for b in spec.get("batches", [len(prompts)]) for s in range(0, len(prompts), b)]:
        chunk = prompts[s:s + batch]
        if spec.get("stepwise"):
            eng = llm.llm_engine
            arrive = spec.get("arrive", [0] * len(prompts))[s:s + batch]  # the step each prompt is added at
            ids = [f"b{batch}r{s + j}" for j in range(len(chunk))]
            added = set()
            res, cached = {}, {}
            step = 0
            while len(added) < len(chunk) or eng.has_unfinished_requests():
                for j, p in enumerate(chunk):
                    if j not in added and arrive[j] <= step:
                        eng.add_request(ids[j], TokensPrompt(prompt_token_ids=p), sp)
                        added.add(j)
                if not eng.has_unfinished_requests():
                    step += 1
                    continue
                free_before = pool.get_num_free_blocks()
                outs = eng.step()
                step += 1
                per_req = {}
                for internal, blocks in mgr.req_to_blocks.items():  # vLLM appends "-<random>" to ids
                    rid = external(internal)
                    per_req[rid] = {"held": sum(1 for b in blocks if not b.is_null), "table": len(blocks),
                                    "ids": [b.block_id for b in blocks if not b.is_null]}
                out["blocks"].append({"step": step, "free_before": free_before,
                                      "free_after": pool.get_num_free_blocks(), "per_req": per_req})
                for o in outs:
                    if o.finished:
                        res[o.request_id] = list(o.outputs[0].token_ids)
                        cached[o.request_id] = o.num_cached_tokens  # prefix-cache hits
            out["tokens"] += [res[r] for r in ids]
            out["cached"] += [cached[r] for r in ids]
        else:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in chunk], sp, use_tqdm=False)
            out["tokens"] += [list(o.outputs[0].token_ids) for o in outs]
            out["cached"] += [o.num_cached_tokens for o in outs]
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    layers = get_layers_from_vllm_config(llm.llm_engine.vllm_config, Attention)
    out["wrapped"] = sum(1 for l in layers.values() if getattr(l.impl, "_kvscore_wrapped", False))
    out["layers"] = len(layers)
    # the CPU attention ISA vLLM picked; with tensor parallelism the layers live in the workers, not here
    out["isa"] = str(getattr(next(iter(layers.values())), "isa", None)) if layers else None
    conn = sched.connector
    if conn is not None:
        out["decisions"] = [[external(d[0]), d[1], d[2], d[3]] for d in getattr(conn, "decisions", [])]
        out["freed_total"] = conn._freed_total
        out["swaps"] = dict(conn.swaps)
    if captured:
        # kvscore's own decision on the keys read back: scores per layer, select_joint_blocks
        from kvscore.vllm import Config
        cfg = Config(**plugin)
        bs = spec.get("block_size", 32)
        out["reference"] = {}
        for req_id, tokens, keys, queries in captured:
            if cfg.query_window:
                scores = [kvscore.SnapKV(q, window=cfg.query_window).score(k) for k, q in zip(keys, queries)]
            else:
                scores = [kvscore.make_scorer(cfg.method).score(k) for k in keys]
            kept = kvscore.select_joint_blocks(scores, bs, cfg.budget(tokens, bs), sinks=cfg.sinks, recent=cfg.recent,
                                               aggregate=cfg.aggregate, block_aggregate=cfg.block_aggregate)
            out["reference"][external(req_id)] = [int(b) for b in kept]
    if spec.get("check"):
        from kvscore.vllm import check
        out["check"] = check.read(check_prefix)
    print("RESULT " + json.dumps(out), flush=True)


def preload():
    """What every engine imports first, imported once in the zygote (vLLM and torch: ~17 s of CPU a
    process on this machine, most of a test engine's start). Nothing that reads the settings a spec
    changes: vLLM's environment is read at engine start (vllm.envs caches it only then), and
    kvscore reads KVSCORE_VLLM_CHECK / KVSCORE_VLLM_AUDIT when its worker and scheduler start."""
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import vllm.model_executor.models.llama  # noqa: F401
    import vllm.v1.attention.backends.cpu_attn  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401


def _child(req):
    """In the forked child: the spec's engine, its output into the request's files, then exit."""
    import atexit
    import gc
    import traceback
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["out"]), (2, req["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        # new file objects over the new descriptors (the zygote's own carry its protocol lines)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        main(req["spec"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 (reported in the engine's stderr, like an uncaught one)
        traceback.print_exc()
    finally:
        try:
            gc.collect()              # the engine's finalizers (its executor's workers) ...
            atexit._run_exitfuncs()   # ... and vLLM's exit hooks, as a normal exit runs them
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def zygote():
    """`engine_run.py --zygote`: imports what every engine needs once (preload), then forks one
    child per request. Requests on stdin, a JSON line each: {"id", "spec", "out", "err"} (the
    child's stdout and stderr go to the files out and err). Replies on stdout, a line each:
    `ZYGOTE {"id", "pid"}` once a child runs, `ZYGOTE {"id", "rc"}` when it has exited. One
    thread: no fork beside other Python threads (python/tests_vllm/conftest.py drives it)."""
    import select
    preload()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    out.write("ZYGOTE {\"ready\": true}\n")
    ids, buf, open_ = {}, b"", True
    while open_ or ids:
        if open_ and select.select([0], [], [], 0.1)[0]:
            data = os.read(0, 1 << 16)
            open_ = bool(data)
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                req = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req)
                ids[pid] = req["id"]
                out.write("ZYGOTE " + json.dumps({"id": req["id"], "pid": pid}) + "\n")
        elif not open_:
            import time
            time.sleep(0.1)
        while ids:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in ids:
                out.write("ZYGOTE " + json.dumps({"id": ids.pop(pid), "rc": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        zygote()
    else:
        main(json.loads(sys.argv[1]))
