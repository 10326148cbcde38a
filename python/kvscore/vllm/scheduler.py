"""KvscoreScheduler: the scheduler half of KvscoreConnector (kvscore.vllm.connector; docs/design/vllm-internals.md#the-code).

It decides what the workers do each step (KvscoreMeta: the prompts to score, every request's holes,
the decoding requests' written blocks, the swap orders), makes each eviction decision from the
ranks' partials (kvscore.vllm.plan.decide_eviction) and frees the evicted blocks to vLLM's pool,
and keeps the bookkeeping of preemption (snapshots, host swaps). vLLM's KV cache manager is
reached only through kvscore.vllm.internals.
"""
from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

from . import Config
from . import internals as V
from .metadata import KvscoreMeta, KvscoreWorkerMeta
from .plan import block_runs, decide_eviction

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class KvscoreScheduler:
    """The scheduler side's state and hooks (the connector's role SCHEDULER)."""

    def __init__(self, cfg: Config, block_size: int, kv_cache_config, prefix_caching: bool):
        self.cfg = cfg
        self.block_size = block_size
        self._kv_cache_config = kv_cache_config
        self._prefix_caching = prefix_caching
        self._km = None  # vLLM's KVCacheManager (bind_kv_cache_manager)
        self._reqs: dict[str, "Request"] = {}
        self._scoring: dict[str, tuple[list[int], int]] = {}  # req_id -> (block ids, tokens) sent to score
        self._done: set[str] = set()
        self._holes_by_req: dict[str, tuple[int, list[int]]] = {}
        self._freed_total = 0
        self._score_seconds = 0.0
        # preemption: snapshots (block ids, -1 for a hole; tokens computed) of requests a recompute
        # would not reproduce; the swapped-out ones; the orders for the next step's metadata
        self._snap: dict[str, tuple[list[int], int]] = {}
        self._swapped: dict[str, dict] = {}
        self._swap_bytes = 0
        self._sparse_decoded: set[str] = set()
        self._seq: dict[str, int] = {}  # sparse decode: each decoding request's sequence key (never reused)
        self._next_seq = 0
        # the eviction pass (ratio 0 without sparse decode only scores; with prefix caching,
        # where ratio > 0 is refused, it has nothing to decide and does not run)
        self._scores = cfg.evicts and not prefix_caching
        self._orders = KvscoreMeta()
        self.swaps = {"saved": 0, "restored": 0, "recomputed": 0}
        # the last decisions (req_id, kept logical blocks, evicted logical blocks, ranks' partials), for tests
        self.decisions: collections.deque = collections.deque(maxlen=1024)
        from . import check
        self._audit = check.audit_from_env()  # KVSCORE_VLLM_AUDIT: decisions and pool checks to a file

    def bind_kv_cache_manager(self, km) -> None:
        self._km = km

    # ------------------------------------------------------------------ admission (preemption's swap-in)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        sw = self._swapped.get(request.request_id)
        if sw is None or num_computed_tokens != 0:
            return 0, False
        return min(sw["tokens"], request.num_tokens - 1), False  # loaded in the step that admits it

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        self._reqs[rid] = request
        sw = self._swapped.pop(rid, None)
        if sw is None:
            return
        if num_external_tokens != min(sw["tokens"], request.num_tokens - 1):  # not taken: drop the copy
            self._orders.drop.append(rid)
            self._swap_bytes -= sw["bytes"]
            self._done.discard(rid)  # recomputed: scored again
            return
        ids = blocks.get_block_ids()[0]
        self._orders.load.append((rid, [ids[b] for b in sw["kept"]]))
        self._swap_bytes -= sw["bytes"]
        self._free_runs(rid, sw["evicted"])  # the same holes again
        if sw["evicted"]:
            self._holes_by_req[rid] = (ids[0], sw["evicted"])
        self._done.add(rid)  # its prompt is computed: not scored again
        self.swaps["restored"] += 1
        if self._audit is not None:
            self._audit.swap("restored", rid, len(sw["kept"]))

    def on_new_request(self, request: "Request") -> None:
        self._reqs[request.request_id] = request

    # ------------------------------------------------------------------ every step

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvscoreMeta:
        meta, self._orders = self._orders, KvscoreMeta()  # loads and drops ordered since the last step
        km = self._km
        for req_id in scheduler_output.preempted_req_ids or ():
            # vLLM freed all its blocks: swap its kept blocks out (its snapshot), or its prefill
            # runs again and is scored again
            lossy = req_id in self._holes_by_req or req_id in self._sparse_decoded  # a recompute would differ
            self._holes_by_req.pop(req_id, None)
            self._scoring.pop(req_id, None)
            self._sparse_decoded.discard(req_id)
            self._seq.pop(req_id, None)  # its state on the workers goes: recomputed, it decodes anew
            snap = self._snap.pop(req_id, None)
            if self._audit is not None:
                self._audit.preempted(req_id)
            if snap is not None and self._swap_out(req_id, snap, meta):
                continue
            self._done.discard(req_id)
            if lossy:
                self.swaps["recomputed"] += 1
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self._reqs.get(req_id)
            if req is None:
                continue
            if self.cfg.sparse and n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                table = V.request_table(km, req_id)
                at = req.num_computed_tokens // self.block_size  # the block this step's token goes to
                if table and at < len(table) and table[at] >= 0:
                    seq = self._seq.get(req_id)
                    if seq is None:
                        seq = self._seq[req_id] = self._next_seq
                        self._next_seq += 1
                    meta.decoding[table[at]] = seq
                    self._sparse_decoded.add(req_id)
            if self._swap_limit and (req_id in self._holes_by_req or req_id in self._sparse_decoded):
                # what a swap-out after this step would save: the table, the tokens computed by then
                self._snap[req_id] = (V.request_table(km, req_id) or [], req.num_computed_tokens + n)
            if req_id in self._done or not self._scores:
                continue
            done_before = req.num_computed_tokens
            P = req.num_prompt_tokens
            if not (done_before < P <= done_before + n):
                continue
            self._done.add(req_id)
            nblocks = -(-P // self.block_size)
            if self.cfg.budget(P, self.block_size) >= nblocks and self.cfg.ratio > 0:
                continue  # shorter than the protected window: left whole (keep-all, ratio 0, still scores)
            ids = V.block_ids(km, req_id)[:nblocks]
            self._scoring[req_id] = (ids, P)
            meta.score.append((req_id, ids, P))
        meta.holes = {first: (rid, ev) for rid, (first, ev) in self._holes_by_req.items()}
        if self._audit is not None:
            self._audit.step(V.all_request_blocks(km), V.block_pool(km), meta.holes, shared=self._prefix_caching)
        return meta

    def update_connector_output(self, connector_output) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KvscoreWorkerMeta):
            return
        self._score_seconds += wm.seconds
        for req_id, parts in wm.partials.items():
            ids, P = self._scoring.pop(req_id, (None, 0))
            table = V.request_table(self._km, req_id)
            if ids is None or table is None:
                continue  # finished (or preempted) meanwhile: its blocks went back whole
            t0 = time.perf_counter()
            keep, evicted = decide_eviction(parts, P, len(ids), self.block_size, self.cfg)
            if table[: len(ids)] != ids:
                continue  # not the blocks that were scored (cannot happen without preemption)
            freed_ids = [ids[b] for b in evicted]
            self._free_runs(req_id, evicted)
            self._score_seconds += time.perf_counter() - t0
            self._freed_total += len(evicted)
            if evicted:
                self._holes_by_req[req_id] = (ids[0], evicted)
            self.decisions.append((req_id, keep, evicted, len(parts)))
            if self._audit is not None:
                self._audit.decision(self._reqs.get(req_id), keep, evicted, freed_ids)

    def _free_runs(self, req_id: str, evicted: list[int]) -> None:
        """Frees each run [a, e) of the evicted logical blocks (vLLM's sliding-window path)."""
        for a, e in block_runs(evicted):
            V.free_block_range(self._km, req_id, a, e)

    # ------------------------------------------------------------------ preemption's swap-out

    @property
    def _swap_limit(self) -> int:
        # prefix caching: no swap (a readmitted request's prompt comes from the prefix cache, its
        # generated tokens are recomputed densely: vLLM's recompute)
        return 0 if self._prefix_caching else int(self.cfg.swap_space * (1 << 30))

    def _swap_out(self, req_id: str, snap: tuple[list[int], int], meta: KvscoreMeta) -> bool:
        """Orders the preempted request's kept blocks to host memory; False beyond swap_space."""
        ids, tokens = snap
        n = -(-tokens // self.block_size)
        kept = [b for b in range(min(n, len(ids))) if ids[b] >= 0]
        nbytes = len(kept) * V.block_bytes(self._kv_cache_config)
        if not kept or self._swap_bytes + nbytes > self._swap_limit:
            return False
        evicted = [b for b in range(min(n, len(ids))) if ids[b] < 0]
        meta.save.append((req_id, [ids[b] for b in kept]))
        self._swapped[req_id] = {"tokens": tokens, "kept": kept, "evicted": evicted, "bytes": nbytes}
        self._swap_bytes += nbytes
        self.swaps["saved"] += 1
        if self._audit is not None:
            self._audit.swap("saved", req_id, len(kept))
        return True

    # ------------------------------------------------------------------ the end of a request

    def request_finished(self, request: "Request", block_ids: list[int]):
        rid = request.request_id
        self._snap.pop(rid, None)
        self._sparse_decoded.discard(rid)
        self._seq.pop(rid, None)
        sw = self._swapped.pop(rid, None)
        if sw is not None:  # finished (aborted) while swapped out: the workers drop its copy
            self._orders.drop.append(rid)
            self._swap_bytes -= sw["bytes"]
        if self._audit is not None:
            self._audit.finished(request, rid in self._holes_by_req)
        self._reqs.pop(rid, None)
        self._done.discard(rid)
        self._scoring.pop(rid, None)
        self._holes_by_req.pop(rid, None)
        return False, None
