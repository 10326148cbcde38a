"""KvscoreConnector: kvscore as a vLLM V1 KV connector (docs/guides/vllm.md). Pinned to vLLM 0.32 (CPU).

A thin facade, as vLLM's own connectors are (NixlConnector): vLLM makes one connector per role;
the scheduler's delegates every scheduler hook to a KvscoreScheduler (kvscore.vllm.scheduler),
each worker's every worker hook to a KvscoreWorker (kvscore.vllm.worker). What they send each
other is kvscore.vllm.metadata's; what a step's plan and an eviction decision compute from plain
arrays is kvscore.vllm.plan's; every vLLM internal they reach is a function of
kvscore.vllm.internals. Here: the engine checks both roles run at start, and the delegation.

Flow of one request (R):

1. Scheduler half, the step whose tokens finish R's prompt (build_connector_meta): R's block ids and
   prompt length go to the workers in the step's connector metadata.
2. Worker half, after that step's forward (wait_for_save -> KvscoreWorker.score): every layer's
   prompt keys are scored in place in vLLM CPU's paged cache and reduced to this rank's
   joint_partial (C++, kvscore._kvscore.vllm_cpu_partial); build_connector_worker_meta sends it back. With tensor
   parallelism vLLM's output aggregator joins every rank's metadata (KvscoreWorkerMeta.aggregate):
   the scheduler receives one partial per rank.
3. Scheduler half (update_connector_output): ONE decision from all ranks' partials
   (plan.decide_eviction: combine, block scores, select), then the evicted blocks are
   freed to vLLM's pool through the single-type KV cache manager's _remove_blocks_in_range (the
   sliding-window path: the block becomes vLLM's null block in R's table, its id is free for
   any request).
4. Every later step: the holes of every live request travel in the connector metadata; on the
   worker, the CPU attention impl of each layer (wrapped by the worker half only) hands the
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
plan.plan_step: which rows decode sparsely and how many blocks each attends, kvscore::sparse_attend,
and their sequence lengths; one attention schedule for every layer; the planner's plan), then every layer's call
chooses that layer's blocks of every sparse row in one C++ call (select_planned) into a scratch
block table the kernel reads. Summaries are kept per physical block (made again after a write):
with prefix caching a shared block is summarised once for every request that reads it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import VLLM_VERSION, Config
from . import internals as V
from .metadata import KvscoreMeta, KvscoreWorkerMeta
from .scheduler import KvscoreScheduler
from .worker import KvscoreWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["KvscoreConnector", "KvscoreMeta", "KvscoreScheduler", "KvscoreWorker", "KvscoreWorkerMeta",
           "check_engine"]


def check_engine(cfg: Config, c: "VllmConfig", kv_cache_config) -> bool:
    """Refuses (ValueError naming the value) an engine the plugin does not run in; returns whether
    prefix caching is on."""
    import vllm

    if vllm.__version__.split("+")[0] != VLLM_VERSION:
        raise ValueError(f"kvscore.vllm: vLLM {vllm.__version__} is not the {VLLM_VERSION} it is pinned to "
                         f"(it relies on vLLM internals, docs/guides/vllm.md)")
    if not V.is_cpu_platform():
        raise ValueError("kvscore.vllm: only vLLM's CPU build is supported (the paged view reads the CPU "
                         "attention backend's layout; CUDA vLLM is untested, docs/guides/vllm.md)")
    prefix_caching = bool(c.cache_config.enable_prefix_caching)
    if prefix_caching and cfg.ratio > 0:
        raise ValueError(f"kvscore.vllm: ratio {cfg.ratio} (eviction) needs enable_prefix_caching=False: "
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
    if cfg.sinks < 1:
        raise ValueError(f"kvscore.vllm: sinks {cfg.sinks} must be >= 1 (the block of position 0 is always "
                         f"kept: it identifies the request's row on the workers)")
    if c.speculative_config is not None:
        raise ValueError("kvscore.vllm: speculative decoding is not supported")
    groups = V.kv_cache_groups(kv_cache_config)
    if groups is not None and len(groups) != 1:
        raise ValueError(f"kvscore.vllm: {len(groups)} KV cache groups (a hybrid model); the plugin frees the "
                         f"blocks of one group whose layers all use full attention")
    return prefix_caching


class KvscoreConnector(KVConnectorBase_V1):
    """vLLM's connector object: connector_scheduler (role SCHEDULER) or connector_worker (role
    WORKER) does the work; the other is None."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.cfg = Config.from_extra(extra)
        prefix_caching = check_engine(self.cfg, vllm_config, self._kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.connector_scheduler: KvscoreScheduler | None = None
        self.connector_worker: KvscoreWorker | None = None
        if role == KVConnectorRole.WORKER:
            self.connector_worker = KvscoreWorker(self.cfg, self.block_size, vllm_config)
        else:
            self.connector_scheduler = KvscoreScheduler(self.cfg, self.block_size, self._kv_cache_config,
                                                        prefix_caching)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.connector_worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvscoreMeta):
            self.connector_worker.bind(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return  # preemption's loads are made in bind_connector_metadata, before the forward

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvscoreMeta):
            self.connector_worker.score(meta)

    def build_connector_worker_meta(self):
        return self.connector_worker.build_worker_meta()

    def get_finished(self, finished_req_ids: set[str]):
        return None, None

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.connector_scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def on_new_request(self, request: "Request") -> None:
        self.connector_scheduler.on_new_request(request)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]):
        return self.connector_scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------------ what tests and tools read

    # the scheduler's (python/tests_vllm/engine_run.py, kvscore.vllm.bench: vLLM's scheduler.connector)
    @property
    def decisions(self):
        return self.connector_scheduler.decisions

    @property
    def swaps(self) -> dict:
        return self.connector_scheduler.swaps

    @property
    def _freed_total(self) -> int:
        return self.connector_scheduler._freed_total

    @property
    def _score_seconds(self) -> float:
        return self.connector_scheduler._score_seconds

    # a worker's (kvscore.vllm.bench: get_kv_transfer_group() in an in-process engine)
    @property
    def sparse_stats(self) -> dict:
        return self.connector_worker.sparse_stats

    @property
    def _selector(self):
        return self.connector_worker._selector
