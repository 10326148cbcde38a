"""A self-check of sparse decode inside a running engine (docs/guides/vllm.md#checking-it-in-your-engine).

With KVSCORE_VLLM_CHECK=<prefix> in the engine's environment, every worker checks every layer's
block choice of every step against kvscore's stateless reference: each sparse row's keys are read
back from vLLM's cache (its blocks after the holes), its query taken from the layer's input, and
`kvscore._kvscore.block_sparse_reference` must choose the same blocks that PagedBlockSelector
(with its summaries and indexes kept across steps) wrote into the kernel's block table. It also
checks that the protected blocks (sinks, local window, the last block) are in, and that rows that
do not decode sparsely reach the kernel unchanged. One JSON line per (step, layer) goes to
<prefix>.rank<R>.jsonl. Slow (every key of every sparse row is read at every layer): for tests
and for trying the plugin on a new model, not for serving.
"""
from __future__ import annotations

import json
import os

import numpy as np

from .. import _kvscore as _k
from . import internals as V

ENV = "KVSCORE_VLLM_CHECK"


class Checker:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.file = None
        self.step_id = None
        self.steps = 0

    def _open(self):
        if self.file is None:
            self.rank = V.tensor_parallel_rank()
            self.file = open(f"{self.prefix}.rank{self.rank}.jsonl", "a", buffering=1)
        return self.file

    def __call__(self, worker, layer_name, kv_cache, query, step) -> None:
        f = self._open()
        if self.step_id != id(step):
            self.step_id = id(step)
            self.steps += 1
        cfg, bs = worker.cfg, worker.block_size
        impl_scale = worker._selector_scale
        src = step.src.numpy()
        dst = step.dst.numpy()
        _, qsl, seq_lens = V.step_fields(step.md)[:3]  # the metadata the kernel gets
        num_reqs = qsl.shape[0] - 1
        rows = []
        sparse = set(int(r) for r in step.rows)
        seqs = step.seqs if step.seqs is not None else [-1] * len(step.rows)
        for r, ti, n, a, seq in zip(step.rows, step.token_index, step.tokens, step.attend, seqs):
            r, n, a = int(r), int(n), int(a)
            nb = -(-n // bs)
            ids = src[r, :nb].astype(np.int64)
            keys = _k.vllm_cpu_keys(kv_cache, ids, n, isa=worker._isa)
            q = query[int(ti)].float().contiguous().numpy()
            ref = _k.block_sparse_reference(keys, q, bs, a, score=cfg.block_score, sinks=cfg.sinks, local=cfg.local,
                                            scale=impl_scale, prefilter=cfg.prefilter, group=cfg.query_group)
            got = [int(x) for x in dst[r, :a]]
            # a kept choice (refresh > 1) is the reference's of an earlier step: checked when scored
            fresh = bool(step.fresh[len(rows)]) if step.fresh is not None else True
            want = [int(ids[b]) for b in ref] if fresh else got
            # protected: the sinks' blocks, the local window's and the last block
            sink_end = min(nb, -(-min(cfg.sinks, n) // bs))
            local_begin = min(nb, max(0, n - max(cfg.local, 1)) // bs)
            protected = [int(ids[b]) for b in range(nb) if b < sink_end or b >= local_begin]
            qlen = int(qsl[r + 1] - qsl[r])
            rows.append({"row": r, "first": int(ids[0]), "seq": int(seq), "ids": [int(x) for x in ids], "qlen": qlen,
                         "fresh": fresh, "sinks_end": sink_end, "local_begin": local_begin,
                         "tokens": n, "attend": a, "blocks": nb, "got": got,
                         "match": got == want, "want": None if got == want else want,
                         "protected_in": all(p in got for p in protected),
                         "seq_len": int(seq_lens[r]), "seq_len_ok": int(seq_lens[r]) == (a - 1) * bs + n - (nb - 1) * bs})
        others_untouched = all((dst[i] == src[i]).all() for i in range(num_reqs) if i not in sparse)
        starts = qsl.tolist()
        prefill_rows = sum(1 for i in range(num_reqs) if starts[i + 1] - starts[i] > 1)
        f.write(json.dumps({"rank": self.rank, "step": self.steps, "layer": layer_name, "rows": rows,
                            "kv_heads": int(kv_cache.shape[1]), "q_heads": int(query.shape[1]),
                            "others_untouched": bool(others_untouched), "prefill_rows": prefill_rows,
                            "num_reqs": num_reqs, "made": int(worker._selector.summaries_made)}) + "\n")


def install_from_env(worker_module) -> None:
    """Sets kvscore.vllm.worker's SPARSE_OBSERVER when KVSCORE_VLLM_CHECK is set (worker start)."""
    prefix = os.environ.get(ENV)
    if prefix and worker_module.SPARSE_OBSERVER is None:
        worker_module.SPARSE_OBSERVER = Checker(prefix)


def read(prefix: str) -> list[dict]:
    """Every rank's records of a run (tests)."""
    import glob
    out = []
    for path in sorted(glob.glob(f"{prefix}.rank*.jsonl")):
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


# ---------------------------------------------------------------------- the scheduler's audit

AUDIT_ENV = "KVSCORE_VLLM_AUDIT"


class Audit:
    """With KVSCORE_VLLM_AUDIT=<file> the connector's scheduler half (kvscore.vllm.scheduler) writes a JSON line for
    every decision (the request, a hash of its prompt, kept/evicted logical blocks, the physical
    ids freed), preemption and finished request, and checks the KV pool at every step: no
    physical block in two requests' tables, every block held by a request has one reference and
    every other usable block is free (nothing leaked, nothing freed twice; with prefix caching a
    block may be in several tables, its reference count then being their number), and the holes sent to
    the workers belong to the requests that hold those first blocks. A step that breaks one of
    these writes a "violation" line. For tests and load runs (docs/design/vllm-internals.md#under-load-and-faults)."""

    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)
        self.steps = 0
        self.violations = 0

    def _write(self, **rec) -> None:
        self.f.write(json.dumps(rec) + "\n")

    @staticmethod
    def prompt_hash(req) -> str:
        import hashlib
        return hashlib.sha1(np.asarray(req.prompt_token_ids, dtype=np.int64).tobytes()).hexdigest()[:16]

    def decision(self, req, kept, evicted, freed_ids) -> None:
        self._write(event="decision", req=req.request_id, prompt=self.prompt_hash(req), tokens=req.num_prompt_tokens,
                    kept=[int(b) for b in kept], evicted=[int(b) for b in evicted], freed=[int(b) for b in freed_ids])

    def preempted(self, req_id: str) -> None:
        self._write(event="preempted", req=req_id)

    def swap(self, what: str, req_id: str, blocks: int) -> None:
        self._write(event=what, req=req_id, blocks=blocks)

    def finished(self, req, had_holes: bool) -> None:
        self._write(event="finished", req=req.request_id, status=str(req.status), holes=had_holes,
                    output_tokens=len(req.output_token_ids))

    def step(self, req_to_blocks: dict, pool, holes: dict, shared: bool = False) -> None:
        """req_to_blocks: req_id -> its vLLM blocks (internals.all_request_blocks); pool: vLLM's
        BlockPool (internals.block_pool)."""
        self.steps += 1
        owner: dict[int, str] = {}
        tables: dict[int, int] = {}
        refs: dict[int, int] = {}
        bad = []
        for rid, blocks in req_to_blocks.items():
            for b in blocks:
                if b.is_null:
                    continue
                if b.block_id in owner and not shared:
                    bad.append(f"block {b.block_id} in the tables of {owner[b.block_id]} and {rid}")
                owner.setdefault(b.block_id, rid)
                tables[b.block_id] = tables.get(b.block_id, 0) + 1
                refs[b.block_id] = b.ref_cnt
        for bid, n in tables.items():
            if refs[bid] != n:
                bad.append(f"block {bid} of {owner[bid]} has ref_cnt {refs[bid]}, in {n} tables")
        usable = pool.num_gpu_blocks - 1  # less vLLM's null block
        free = pool.get_num_free_blocks()
        if free + len(owner) != usable:
            bad.append(f"{free} free + {len(owner)} held != {usable} usable blocks")
        for first, (rid, _) in holes.items():
            if owner.get(first) != rid:
                bad.append(f"holes of {rid} sent under first block {first}, held by {owner.get(first)}")
        rec = {"event": "step", "step": self.steps, "requests": len(req_to_blocks), "held": len(owner),
               "free": free, "holes": len(holes)}
        if bad:
            self.violations += 1
            rec["violations"] = bad[:8]
        self._write(**rec)


def audit_from_env():
    path = os.environ.get(AUDIT_ENV)
    return Audit(path) if path else None


def read_audit(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
