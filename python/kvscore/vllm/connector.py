"""KvscoreConnector: kvscore as a vLLM V1 KV connector (docs/guides/vllm.md). Pinned to vLLM 0.32 (CPU).

Flow of one request (R):

1. Scheduler, the step whose tokens finish R's prompt (build_connector_meta): R's block ids and
   prompt length go to the workers in the step's connector metadata.
2. Worker, after that step's forward (wait_for_save): every layer's prompt keys are scored in
   place in vLLM CPU's paged cache and reduced to this rank's joint_partial (C++,
   kvscore._kvscore.vllm_cpu_partial); build_connector_worker_meta sends it back. With tensor
   parallelism vLLM's output aggregator joins every rank's metadata (KvscoreWorkerMeta.aggregate):
   the scheduler receives one partial per rank.
3. Scheduler (update_connector_output): ONE decision from all ranks' partials
   (select_blocks_from_partials: combine, block scores, select), then the evicted blocks are
   freed to vLLM's pool through the single-type KV cache manager's _remove_blocks_in_range (the
   sliding-window path: the block becomes vLLM's null block in R's table, its id is free for
   any request).
4. Every later step: the holes of every live request travel in the connector metadata; on the
   worker, the CPU attention impl of each layer (wrapped by this connector only) hands the
   kernel R's block-table row without the evicted blocks and R's sequence length less their
   tokens. Keys carry their RoPE positions already, so attention over the kept blocks is
   attention over the same keys with holes; new tokens keep their true positions and slots.

Preemption: vLLM frees every block of a preempted request and recomputes it later with a dense
prefill, which would not give back the cache R had (its evicted positions were not attended, its
generated tokens' keys came from sparse steps). So the scheduler keeps a snapshot of the block
table of every request with holes or sparse steps; when vLLM preempts one, the workers copy its
kept blocks to host memory (swap_space GiB at most, before the step's forward can reuse them), and
when vLLM admits it again the connector reports those tokens as already computed
(get_num_new_matched_tokens), the workers copy the blocks back into the new ones, and the same
holes are made again: R goes on with the cache it had. Beyond swap_space, vLLM's recompute (R is
scored again).

For eviction a worker identifies R's row in the batch by the physical id of R's first block: the
block of position 0 is always kept (sinks >= 1 is required) and owned by R alone (eviction refuses
prefix caching).

Sparse decode (`attend` < 1, docs/reference/block_sparse.md): the scheduler also sends, every step, for each
request that decodes in it, the block its token is written to (R's own, even when prefix caching
shares R's first blocks with other requests) and R's sequence key; on the worker a row is R's when
its slot_mapping entry falls in that block, and the first attention call of a step plans the step
once (kvscore::BlockSparsePlanner::begin_step with the step's written slots and live sequence keys;
which rows decode sparsely and how many blocks each attends, kvscore::sparse_attend; their sequence
lengths and one attention schedule for every layer; the planner's plan), then every layer's call
chooses that layer's blocks of every sparse row in one C++ call (select_planned) into a scratch
block table the kernel reads. Summaries are kept per physical block (made again after a write):
with prefix caching a shared block is summarised once for every request that reads it.

vLLM internals are reached through kvscore.vllm.internals (one named function each).
"""
from __future__ import annotations

import collections
import dataclasses
import re
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from .. import SnapKV as _SnapKV
from .. import _kvscore as _k
from .. import make_scorer
from . import VLLM_VERSION, Config
from . import internals as V

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

# CPU attention ISAs: the key layout each writes is kvscore._kvscore.vllm_cpu_key_layout's (vec, vec16:
# transposed; amx: AMX-packed; neon fp32/fp16: transposed); every call that reads a cache gets the ISA


class KvscoreMeta(KVConnectorMetadata):
    """Scheduler -> workers, every step: the requests to score and every request's holes."""

    def __init__(self) -> None:
        self.score: list[tuple[str, list[int], int]] = []    # (req_id, block ids, prompt tokens)
        self.holes: dict[int, tuple[str, list[int]]] = {}     # first block id -> (req_id, evicted logical blocks)
        # sparse decode: the block each decoding request writes this step (its own even when its
        # first blocks are shared: prefix caching) -> the request's sequence key
        self.decoding: dict[int, int] = {}
        self.save: list[tuple[str, list[int]]] = []          # preempted: (req_id, kept physical blocks) to host
        self.load: list[tuple[str, list[int]]] = []          # readmitted: (req_id, new physical blocks) from host
        self.drop: list[str] = []                            # finished while swapped out


class KvscoreWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: each scored request's partial, one per rank after aggregate()."""

    def __init__(self, partials: dict[str, list[tuple]], seconds: float) -> None:
        self.partials = partials
        self.seconds = seconds

    def aggregate(self, other: "KvscoreWorkerMeta") -> "KvscoreWorkerMeta":
        for req_id, parts in other.partials.items():
            self.partials.setdefault(req_id, []).extend(parts)
        self.seconds = max(self.seconds, other.seconds)  # ranks score at the same time
        return self


def _layer_index(name: str) -> tuple:
    """Sort key of a layer name ("model.layers.12.self_attn.attn" -> (12, name))."""
    m = re.search(r"\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


class KvscoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.cfg = Config.from_extra(extra)
        self._check_engine(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        if role == KVConnectorRole.WORKER:
            self._window = self.cfg.query_window  # SnapKV: queries of the prompt's last positions
            self._scorer = None if self._window else make_scorer(self.cfg.method)._impl
            self._layer_names: list[str] = []
            self._want_queries: dict[int, str] = {}               # first block id -> req_id (this step)
            self._queries: dict[str, dict[str, torch.Tensor]] = {}  # req_id -> layer -> [n, q_heads, D]
            self._caches: list[torch.Tensor] = []
            self._pending: dict[str, list[tuple]] = {}
            self._seconds = 0.0
            self._holes: dict[int, tuple[str, list[int]]] = {}
            self._holes_version = 0
            self._swap: dict[str, list[torch.Tensor]] = {}      # preempted requests' kept blocks, per layer
            self._loaded_blocks: list[int] = []                 # blocks written by a load since the last step
            self._selector = None                               # sparse decode: kvscore's PagedBlockSelector
            self._decoding: dict[int, int] = {}                  # written block -> sequence key (this step)
            self._layer_index: dict[str, int] = {}
            # select_s: every layer's select call; scoring_s / scoring_calls: the calls that scored a row
            # (the others reused kept choices: refresh)
            self.sparse_stats = {"steps": 0, "rows": 0, "blocks_attended": 0, "blocks_total": 0, "plan_s": 0.0,
                                 "select_s": 0.0, "calls": 0, "scoring_s": 0.0, "scoring_calls": 0}
        else:
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
            self._scores = self.cfg.evicts and not self._prefix_caching
            self._orders = KvscoreMeta()
            self.swaps = {"saved": 0, "restored": 0, "recomputed": 0}
            # the last decisions (req_id, kept logical blocks, evicted logical blocks, ranks' partials), for tests
            self.decisions: collections.deque = collections.deque(maxlen=1024)
            from . import check
            self._audit = check.audit_from_env()  # KVSCORE_VLLM_AUDIT: decisions and pool checks to a file

    # ------------------------------------------------------------------ engine checks

    def _check_engine(self, c: "VllmConfig") -> None:
        import vllm
        from vllm.platforms import current_platform

        if vllm.__version__.split("+")[0] != VLLM_VERSION:
            raise ValueError(f"kvscore.vllm: vLLM {vllm.__version__} is not the {VLLM_VERSION} it is pinned to "
                             f"(it relies on vLLM internals, docs/guides/vllm.md)")
        if not current_platform.is_cpu():
            raise ValueError("kvscore.vllm: only vLLM's CPU build is supported (the paged view reads the CPU "
                             "attention backend's layout; CUDA vLLM is untested, docs/guides/vllm.md)")
        self._prefix_caching = bool(c.cache_config.enable_prefix_caching)
        if self._prefix_caching and self.cfg.ratio > 0:
            raise ValueError(f"kvscore.vllm: ratio {self.cfg.ratio} (eviction) needs enable_prefix_caching=False: "
                             f"with prefix caching a prompt block may be shared by several requests and stays in "
                             f"vLLM's prefix cache under its hash, so it cannot be freed for one of them "
                             f"(docs/guides/vllm.md#prefix-caching-and-chunked-prefill); sparse decode alone "
                             f"(ratio 0, attend < 1) works with prefix caching")
        dt = str(c.cache_config.cache_dtype)
        if dt != "auto":
            raise ValueError(f"kvscore.vllm: kv_cache_dtype {dt!r}: the view reads float32/float16/bfloat16 "
                             f"caches only (kv_cache_dtype='auto')")
        bs = c.cache_config.block_size
        if bs is None or bs <= 0 or bs % 32 != 0:
            raise ValueError(f"kvscore.vllm: block_size {bs!r}: the view reads the CPU backend's blocks, whose size "
                             f"is a multiple of 32")
        if self.cfg.sinks < 1:
            raise ValueError(f"kvscore.vllm: sinks {self.cfg.sinks} must be >= 1 (the block of position 0 is always "
                             f"kept: it identifies the request's row on the workers)")
        if c.speculative_config is not None:
            raise ValueError("kvscore.vllm: speculative decoding is not supported")
        groups = V.kv_cache_groups(self._kv_cache_config)
        if groups is not None and len(groups) != 1:
            raise ValueError(f"kvscore.vllm: {len(groups)} KV cache groups (a hybrid model); the plugin frees the "
                             f"blocks of one group whose layers all use full attention")

    # ------------------------------------------------------------------ worker side

    def _threads(self) -> int:
        """The worker's threads for kvscore's C++ calls: `threads`, or 0 -> the worker's torch thread
        count. 0 is never passed on: OpenMP's default asked from vLLM's forward is 1."""
        return self.cfg.threads or max(1, torch.get_num_threads())

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        names = sorted(kv_caches, key=_layer_index)
        for n in names:
            t = kv_caches[n]
            if t.dim() != 4 or t.shape[2] != self.block_size or not t.is_contiguous():
                raise ValueError(f"kvscore.vllm: layer {n}: KV cache of shape {tuple(t.shape)} is not vLLM CPU's "
                                 f"[num_blocks, kv_heads, {self.block_size}, 2 * head_dim]")
        self._caches = [kv_caches[n] for n in names]
        self._layer_names = names
        self._layer_index = {n: i for i, n in enumerate(names)}
        layers = get_layers_from_vllm_config(self._vllm_config, Attention, names)
        self._isa = None
        for n, layer in layers.items():
            impl = layer.impl
            if not isinstance(impl, CPUAttentionBackendImpl):
                raise ValueError(f"kvscore.vllm: layer {n} uses {type(impl).__name__}, not vLLM's CPU attention")
            isa = str(getattr(layer, "isa", None))
            try:
                _k.vllm_cpu_key_layout(isa, kv_caches[n])
            except ValueError as e:
                raise ValueError(f"kvscore.vllm: layer {n}: {e}") from None
            if self._isa not in (None, isa):
                raise ValueError(f"kvscore.vllm: layer {n}: CPU attention ISA {isa!r}, another layer's is {self._isa!r}")
            self._isa = isa
            if impl.sliding_window not in (None, -1):
                raise ValueError(f"kvscore.vllm: layer {n} has a sliding window; not supported")
            _wrap_impl(impl, self)
        if self.cfg.sparse and names:
            c0, impl0 = self._caches[0], layers[names[0]].impl
            self._selector_scale = float(impl0.scale)
            from . import check
            check.install_from_env(sys.modules[__name__])
            self._selector = _k.PagedBlockSelector(
                len(names), c0.shape[0], c0.shape[1], c0.shape[3] // 2, self.block_size, score=self.cfg.block_score,
                sinks=self.cfg.sinks, local=self.cfg.local, scale=float(impl0.scale), prefilter=self.cfg.prefilter,
                group=self.cfg.query_group, refresh=self.cfg.refresh, threads=self._threads(), probe=self.cfg.probe,
                isa=self._isa)
            self._selector.register_caches(self._caches)  # read in place by every step, never converted again

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvscoreMeta):
            self._move_swapped(connector_metadata)  # before this step's forward can write the blocks
            if connector_metadata.holes != self._holes:
                self._holes = dict(connector_metadata.holes)
                self._holes_version += 1
            if self._window:
                self._want_queries = {ids[0]: rid for rid, ids, _ in connector_metadata.score}
            self._decoding = dict(connector_metadata.decoding)

    def _move_swapped(self, meta: KvscoreMeta) -> None:
        """Preempted requests' kept blocks to host memory (save) and back into their new blocks
        (load), every layer; in bind_connector_metadata, before the step's forward."""
        for req_id, ids in meta.save:
            idx = torch.tensor(ids, dtype=torch.long)
            self._swap[req_id] = [c.index_select(0, idx) for c in self._caches]
        for req_id, ids in meta.load:
            saved = self._swap.pop(req_id, None)
            if saved is None or saved[0].shape[0] != len(ids):
                raise RuntimeError(f"kvscore.vllm: no saved blocks of request {req_id} to load")
            idx = torch.tensor(ids, dtype=torch.long)
            for c, t in zip(self._caches, saved):
                c.index_copy_(0, idx, t)
            self._loaded_blocks += ids  # written outside a forward: the selector must know
        for req_id in meta.drop:
            self._swap.pop(req_id, None)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvscoreMeta) or not meta.score:
            return
        t0 = time.perf_counter()
        for req_id, block_ids, tokens in meta.score:
            ids = np.asarray(block_ids, dtype=np.int64)
            scorer = self._scorer
            if self._window:  # each layer's SnapKV from its window queries [q_heads, n, D]
                q = self._queries.pop(req_id, {})
                if len(q) != len(self._layer_names):
                    logger.warning("kvscore.vllm: no window queries for request %s; left whole", req_id)
                    continue
                scorer = [_SnapKV(q[n].permute(1, 0, 2).contiguous(), window=self._window)._impl
                          for n in self._layer_names]
            part = _k.vllm_cpu_partial(scorer, self._caches, ids, tokens, self._threads(), isa=self._isa)
            self._pending.setdefault(req_id, []).append(part)
        self._seconds += time.perf_counter() - t0

    def build_connector_worker_meta(self):
        if not self._pending:
            return None
        out = KvscoreWorkerMeta(self._pending, self._seconds)
        self._pending, self._seconds = {}, 0.0
        return out

    def get_finished(self, finished_req_ids: set[str]):
        return None, None

    # ------------------------------------------------------------------ scheduler side

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

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta, self._orders = self._orders, KvscoreMeta()  # loads and drops ordered since the last step
        km = self._kv_cache_manager
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
                blocks = V.request_blocks(km, req_id)
                at = req.num_computed_tokens // self.block_size  # the block this step's token goes to
                if blocks and at < len(blocks) and not blocks[at].is_null:
                    seq = self._seq.get(req_id)
                    if seq is None:
                        seq = self._seq[req_id] = self._next_seq
                        self._next_seq += 1
                    meta.decoding[blocks[at].block_id] = seq
                    self._sparse_decoded.add(req_id)
            if self._swap_limit and (req_id in self._holes_by_req or req_id in self._sparse_decoded):
                # what a swap-out after this step would save: the table, the tokens computed by then
                self._snap[req_id] = ([-1 if b.is_null else b.block_id for b in V.request_blocks(km, req_id) or ()],
                                      req.num_computed_tokens + n)
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
        km = self._kv_cache_manager
        for req_id, parts in wm.partials.items():
            ids, P = self._scoring.pop(req_id, (None, 0))
            blocks = V.request_blocks(km, req_id)
            if ids is None or blocks is None:
                continue  # finished (or preempted) meanwhile: its blocks went back whole
            nblocks = len(ids)
            budget = self.cfg.budget(P, self.block_size)
            t0 = time.perf_counter()
            kept = _k.select_blocks_from_partials(parts, self.block_size, budget, sinks=self.cfg.sinks,
                                                  recent=self.cfg.recent, aggregate=self.cfg.aggregate,
                                                  block_aggregate=self.cfg.block_aggregate)
            keep = set(int(b) for b in kept)
            evicted = [b for b in range(nblocks) if b not in keep]
            if [b.block_id for b in blocks[:nblocks]] != ids:
                continue  # not the blocks that were scored (cannot happen without preemption)
            freed_ids = [ids[b] for b in evicted]
            self._free_runs(req_id, evicted)
            self._score_seconds += time.perf_counter() - t0
            self._freed_total += len(evicted)
            if evicted:
                self._holes_by_req[req_id] = (ids[0], evicted)
            self.decisions.append((req_id, sorted(keep), evicted, len(parts)))
            if self._audit is not None:
                self._audit.decision(self._reqs.get(req_id), sorted(keep), evicted, freed_ids)

    def _free_runs(self, req_id: str, evicted: list[int]) -> None:
        """Frees each run [a, e) of the evicted logical blocks (vLLM's sliding-window path)."""
        i = 0
        while i < len(evicted):
            j = i
            while j + 1 < len(evicted) and evicted[j + 1] == evicted[j] + 1:
                j += 1
            V.free_block_range(self._kv_cache_manager, req_id, evicted[i], evicted[j] + 1)
            i = j + 1

    @property
    def _swap_limit(self) -> int:
        # prefix caching: no swap (a readmitted request's prompt comes from the prefix cache, its
        # generated tokens are recomputed densely: vLLM's recompute)
        return 0 if self._prefix_caching else int(self.cfg.swap_space * (1 << 30))

    def _block_bytes(self) -> int:
        return V.block_bytes(self._kv_cache_config)

    def _swap_out(self, req_id: str, snap: tuple[list[int], int], meta: KvscoreMeta) -> bool:
        """Orders the preempted request's kept blocks to host memory; False beyond swap_space."""
        ids, tokens = snap
        n = -(-tokens // self.block_size)
        kept = [b for b in range(min(n, len(ids))) if ids[b] >= 0]
        nbytes = len(kept) * self._block_bytes()
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


# ---------------------------------------------------------------------- the attention wrapper

# Tests and the benchmark may set this to observe every layer's sparse choice:
# f(connector, layer_name, kv_cache, query, step) after the layer's PagedBlockSelector.select.
SPARSE_OBSERVER = None


def _wrap_impl(impl, connector: KvscoreConnector) -> None:
    """impl.forward of this layer (an instance attribute; vLLM's class is untouched) hands the CPU
    kernel the batch's block table and sequence lengths without the evicted blocks, and with
    sparse decode only the blocks each decode row attends in this layer."""
    V.wrap_forward(impl, lambda orig: _sparse_forward(orig, impl, connector))


def _sparse_forward(orig, impl, connector: KvscoreConnector):
    def forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if attn_metadata is not None and connector._want_queries:
            _capture_queries(layer, query, attn_metadata, connector)
        if attn_metadata is not None and (connector._holes or connector._selector is not None):
            step = _step(impl, layer, query, attn_metadata, connector)
            if step.rows is not None:
                t0 = time.perf_counter()
                scored = connector._selector.select_planned(connector._layer_index[layer.layer_name], kv_cache, query)
                dt, st = time.perf_counter() - t0, connector.sparse_stats
                st["select_s"] += dt
                st["calls"] += 1
                if scored:
                    st["scoring_s"] += dt
                    st["scoring_calls"] += 1
                if SPARSE_OBSERVER is not None:
                    step.fresh = connector._selector.fresh
                    SPARSE_OBSERVER(connector, layer.layer_name, kv_cache, query, step)
            attn_metadata = step.md
        return orig(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)

    return forward


def _capture_queries(layer, query, md, connector: KvscoreConnector) -> None:
    """SnapKV: the post-RoPE queries of the last `window` prompt positions of each request whose
    prompt this step finishes (its last chunk; fewer when the chunk is shorter)."""
    bt, qsl = V.step_fields(md)[:2]
    for i in range(qsl.shape[0] - 1):
        rid = connector._want_queries.get(int(bt[i, 0]))
        if rid is None:
            continue
        a, b = int(qsl[i]), int(qsl[i + 1])
        q = query[max(a, b - connector._window):b].float().clone()   # [n, q_heads, D]
        connector._queries.setdefault(rid, {})[layer.layer_name] = q


@dataclasses.dataclass
class _Step:
    """One engine step's plan, shared by its layers (cached on the step's metadata object)."""
    version: int
    md: Any                              # the metadata the kernel gets (md itself when nothing changes)
    src: torch.Tensor | None = None      # block table with holes removed
    dst: torch.Tensor | None = None      # src with each sparse row's chosen blocks (rewritten per layer)
    rows: np.ndarray | None = None       # sparse rows (None: none this step) and, per row:
    token_index: np.ndarray | None = None  # its query's token
    tokens: np.ndarray | None = None     # its length after the holes
    attend: np.ndarray | None = None     # blocks it attends
    seqs: np.ndarray | None = None       # its sequence key (the scheduler's, per request)
    fresh: np.ndarray | None = None      # for SPARSE_OBSERVER, the layer's: 1 where scored, 0 where a kept choice stood


def _step(impl, layer, query, md, connector: KvscoreConnector) -> _Step:
    """The step's plan, made by its first attention call: the holes of evicted blocks removed from
    each row, which decode rows attend sparsely and their shorter sequence lengths, one attention
    schedule for every layer (the counts do not depend on the layer). Every layer of the step
    shares one metadata object, which is never edited."""
    cached = V.step_cached(md)
    if cached is not None and cached.version == connector._holes_version:
        return cached
    t0 = time.perf_counter()
    cfg, bs, sel = connector.cfg, connector.block_size, connector._selector
    bt, qsl, seq_lens, slot_mapping, num_actual = V.step_fields(md)
    num_reqs = qsl.shape[0] - 1
    firsts = bt[:num_reqs, 0]
    if sel is not None:  # every step: the blocks written since the last one lose their summaries
        written = slot_mapping[:num_actual]
        if connector._loaded_blocks:  # and the blocks a swap-in wrote
            written = torch.cat([written.to(torch.int64),
                                 torch.tensor(connector._loaded_blocks, dtype=torch.int64) * bs])
            connector._loaded_blocks = []
        # the live sequences: the keys of the requests decoding in this step (their kept choices
        # and indexes stay; the others' go)
        sel.begin_step(written, np.fromiter(connector._decoding.values(), np.int64, len(connector._decoding)))
    firsts = firsts.tolist()
    lens = seq_lens[:num_reqs].tolist()
    src, new_len = bt, list(lens)
    for i, first in enumerate(firsts):
        hole = connector._holes.get(first)
        if hole is None:
            continue
        evicted = hole[1]
        n_log = -(-lens[i] // bs)
        if evicted[-1] >= n_log:
            continue
        if src is bt:
            src = bt.clone()
        ev = set(evicted)
        keep = [j for j in range(n_log) if j not in ev]
        src[i, : len(keep)] = bt[i, keep]
        new_len[i] = lens[i] - len(evicted) * bs
    step = _Step(connector._holes_version, md, src)
    if sel is not None and connector._decoding:
        starts = qsl[: num_reqs + 1].tolist()
        # each row's request: the block its first token is written to (a decoding request's own,
        # even when prefix caching shares its first blocks with other requests)
        wblock = (slot_mapping[qsl[:num_reqs].long()] // bs).tolist()
        rows, tix, toks, att, seqs = [], [], [], [], []
        for i in range(num_reqs):
            n = new_len[i]
            seq = connector._decoding.get(wblock[i])
            if seq is None or starts[i + 1] - starts[i] != 1:
                continue
            # 0: dense (shorter than dense_below, or attending every block anyway)
            a = _k.sparse_attend(n, bs, cfg.attend, dense_below=cfg.dense_below, sinks=cfg.sinks, local=cfg.local)
            if a == 0:
                continue
            rows.append(i)
            tix.append(starts[i])
            toks.append(n)
            att.append(a)
            seqs.append(seq)
            new_len[i] = _k.attended_tokens(n, bs, a)  # the last block may be partial
        if rows:
            st = connector.sparse_stats
            st["steps"] += 1
            st["rows"] += len(rows)
            st["blocks_attended"] += sum(att)
            st["blocks_total"] += sum(-(-n // bs) for n in toks)
            step.dst = src.clone()
            step.rows, step.token_index = np.asarray(rows, np.int64), np.asarray(tix, np.int64)
            step.tokens, step.attend = np.asarray(toks, np.int64), np.asarray(att, np.int64)
            step.seqs = np.asarray(seqs, np.int64)
            # the rows once for every layer (each layer's call then passes only its query)
            sel.plan(step.token_index, src, step.rows, step.tokens, step.attend, step.dst, step.seqs)
    if new_len != lens:
        new_sl = seq_lens.clone()
        new_sl[:num_reqs] = torch.tensor(new_len, dtype=new_sl.dtype)
        sched = V.attention_schedule(impl, layer.isa, md, new_sl, query.dtype)
        table = step.dst if step.dst is not None else src
        step.md = V.metadata_with(md, block_table=table, seq_lens=new_sl, scheduler_metadata=sched,
                                  max_seq_len=max(new_len) if num_reqs else md.max_seq_len)
    V.step_cache(md, step)
    connector.sparse_stats["plan_s"] += time.perf_counter() - t0
    return step
