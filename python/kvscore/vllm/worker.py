"""KvscoreWorker: the worker half of KvscoreConnector (kvscore.vllm.connector; docs/design/vllm-internals.md#the-code).

It holds this rank's view of vLLM CPU's KV caches (register_kv_caches: every layer's cache, its
CPU attention ISA, kvscore's PagedBlockSelector for sparse decode), takes each step's KvscoreMeta
(bind: holes, decoding rows, swap orders), scores the prompts the scheduler names after the
step's forward (score: C++ vllm_cpu_partial, SnapKV with the queries captured in the forward) and
sends the partials back (build_worker_meta). Each layer's CPU attention impl is wrapped
(_sparse_forward): the step's first call plans the step (kvscore.vllm.plan.plan_step over numpy
views of vLLM's metadata, then the selector's plan and one attention schedule), every call
chooses its layer's blocks. vLLM's layers, impls and metadata are reached only through
kvscore.vllm.internals.
"""
from __future__ import annotations

import dataclasses
import re
import sys
import time
from typing import Any

import numpy as np
import torch

from vllm.logger import init_logger

from .. import SnapKV as _SnapKV
from .. import _kvscore as _k
from .. import make_scorer
from . import Config
from . import internals as V
from .metadata import KvscoreMeta, KvscoreWorkerMeta
from .plan import plan_step

logger = init_logger(__name__)

# Tests and the benchmark may set this to observe every layer's sparse choice:
# f(worker, layer_name, kv_cache, query, step) after the layer's PagedBlockSelector.select
# (worker: this module's KvscoreWorker; step: its _Step). kvscore.vllm.check sets it from the
# environment (KVSCORE_VLLM_CHECK).
SPARSE_OBSERVER = None


def _layer_index(name: str) -> tuple:
    """Sort key of a layer name ("model.layers.12.self_attn.attn" -> (12, name))."""
    m = re.search(r"\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


class KvscoreWorker:
    """The worker side's state and hooks (the connector's role WORKER, one per rank)."""

    def __init__(self, cfg: Config, block_size: int, vllm_config):
        self.cfg = cfg
        self.block_size = block_size
        self._vllm_config = vllm_config
        self._window = cfg.query_window  # SnapKV: queries of the prompt's last positions
        self._scorer = None if self._window else make_scorer(cfg.method)._impl
        self._layer_names: list[str] = []
        self._want_queries: dict[int, str] = {}               # first block id -> req_id (this step)
        self._queries: dict[str, dict[str, torch.Tensor]] = {}  # req_id -> layer -> [n, q_heads, D]
        self._caches: list[torch.Tensor] = []
        self._isa: str | None = None                            # every layer's CPU attention ISA
        self._pending: dict[str, list[tuple]] = {}
        self._seconds = 0.0
        self._holes: dict[int, tuple[str, list[int]]] = {}
        self._evicted: dict[int, list[int]] = {}               # the holes as plan_step takes them
        self._holes_version = 0
        self._swap: dict[str, list[torch.Tensor]] = {}      # preempted requests' kept blocks, per layer
        self._loaded_blocks: list[int] = []                 # blocks written by a load since the last step
        self._selector = None                               # sparse decode: kvscore's PagedBlockSelector
        self._selector_scale = None
        self._decoding: dict[int, int] = {}                  # written block -> sequence key (this step)
        self._layer_index: dict[str, int] = {}
        # select_s: every layer's select call; scoring_s / scoring_calls: the calls that scored a row
        # (the others reused kept choices: refresh)
        self.sparse_stats = {"steps": 0, "rows": 0, "blocks_attended": 0, "blocks_total": 0, "plan_s": 0.0,
                             "select_s": 0.0, "calls": 0, "scoring_s": 0.0, "scoring_calls": 0}

    def _threads(self) -> int:
        """The worker's threads for kvscore's C++ calls: `threads`, or 0 -> the worker's torch thread
        count. 0 is never passed on: OpenMP's default asked from vLLM's forward is 1."""
        return self.cfg.threads or max(1, torch.get_num_threads())

    # ------------------------------------------------------------------ start

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_index)
        for n in names:
            t = kv_caches[n]
            if t.dim() != 4 or t.shape[2] != self.block_size or not t.is_contiguous():
                raise ValueError(f"kvscore.vllm: layer {n}: KV cache of shape {tuple(t.shape)} is not vLLM CPU's "
                                 f"[num_blocks, kv_heads, {self.block_size}, 2 * head_dim]")
        self._caches = [kv_caches[n] for n in names]
        self._layer_names = names
        self._layer_index = {n: i for i, n in enumerate(names)}
        layers = V.attention_layers(self._vllm_config, names)
        cpu_impl = V.cpu_attention_impl_class()
        self._isa = None
        impls = {}
        for n, layer in layers.items():
            impl = impls[n] = V.layer_impl(layer)
            if not isinstance(impl, cpu_impl):
                raise ValueError(f"kvscore.vllm: layer {n} uses {type(impl).__name__}, not vLLM's CPU attention")
            isa = V.layer_isa(layer)
            try:
                _k.vllm_cpu_key_layout(isa, kv_caches[n])
            except ValueError as e:
                raise ValueError(f"kvscore.vllm: layer {n}: {e}") from None
            if self._isa not in (None, isa):
                raise ValueError(f"kvscore.vllm: layer {n}: CPU attention ISA {isa!r}, another layer's is {self._isa!r}")
            self._isa = isa
            if V.has_sliding_window(impl):
                raise ValueError(f"kvscore.vllm: layer {n} has a sliding window; not supported")
            _wrap_impl(impl, self)
        if self.cfg.sparse and names:
            c0 = self._caches[0]
            self._selector_scale = V.attention_scale(impls[names[0]])
            from . import check
            check.install_from_env(sys.modules[__name__])
            self._selector = _k.PagedBlockSelector(
                len(names), c0.shape[0], c0.shape[1], c0.shape[3] // 2, self.block_size, score=self.cfg.block_score,
                sinks=self.cfg.sinks, local=self.cfg.local, scale=self._selector_scale, prefilter=self.cfg.prefilter,
                group=self.cfg.query_group, refresh=self.cfg.refresh, threads=self._threads(), probe=self.cfg.probe,
                isa=self._isa)
            self._selector.register_caches(self._caches)  # read in place by every step, never converted again

    # ------------------------------------------------------------------ every step

    def bind(self, meta: KvscoreMeta) -> None:
        """The step's metadata, before its forward (bind_connector_metadata)."""
        self._move_swapped(meta)  # before this step's forward can write the blocks
        if meta.holes != self._holes:
            self._holes = dict(meta.holes)
            self._evicted = {first: ev for first, (_, ev) in self._holes.items()}
            self._holes_version += 1
        if self._window:
            self._want_queries = {ids[0]: rid for rid, ids, _ in meta.score}
        self._decoding = dict(meta.decoding)

    def _move_swapped(self, meta: KvscoreMeta) -> None:
        """Preempted requests' kept blocks to host memory (save) and back into their new blocks
        (load), every layer; in bind, before the step's forward."""
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

    def score(self, meta: KvscoreMeta) -> None:
        """After the step's forward (wait_for_save): every prompt the scheduler named is scored in
        every layer of this rank's cache and reduced to this rank's partial."""
        if not meta.score:
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

    def build_worker_meta(self) -> KvscoreWorkerMeta | None:
        """The partials scored since the last call, for the scheduler (build_connector_worker_meta)."""
        if not self._pending:
            return None
        out = KvscoreWorkerMeta(self._pending, self._seconds)
        self._pending, self._seconds = {}, 0.0
        return out


# ---------------------------------------------------------------------- the attention wrapper

def _wrap_impl(impl, worker: KvscoreWorker) -> None:
    """impl.forward of this layer (an instance attribute; vLLM's class is untouched) hands the CPU
    kernel the batch's block table and sequence lengths without the evicted blocks, and with
    sparse decode only the blocks each decode row attends in this layer."""
    V.wrap_forward(impl, lambda orig: _sparse_forward(orig, impl, worker))


def _sparse_forward(orig, impl, worker: KvscoreWorker):
    def forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if attn_metadata is not None and worker._want_queries:
            _capture_queries(layer, query, attn_metadata, worker)
        if attn_metadata is not None and (worker._holes or worker._selector is not None):
            step = _step(impl, layer, query, attn_metadata, worker)
            if step.rows is not None:
                name = V.layer_name(layer)
                t0 = time.perf_counter()
                scored = worker._selector.select_planned(worker._layer_index[name], kv_cache, query)
                dt, st = time.perf_counter() - t0, worker.sparse_stats
                st["select_s"] += dt
                st["calls"] += 1
                if scored:
                    st["scoring_s"] += dt
                    st["scoring_calls"] += 1
                if SPARSE_OBSERVER is not None:
                    step.fresh = worker._selector.fresh
                    SPARSE_OBSERVER(worker, name, kv_cache, query, step)
            attn_metadata = step.md
        return orig(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)

    return forward


def _capture_queries(layer, query, md, worker: KvscoreWorker) -> None:
    """SnapKV: the post-RoPE queries of the last `window` prompt positions of each request whose
    prompt this step finishes (its last chunk; fewer when the chunk is shorter)."""
    bt, qsl = V.step_fields(md)[:2]
    for i in range(qsl.shape[0] - 1):
        rid = worker._want_queries.get(int(bt[i, 0]))
        if rid is None:
            continue
        a, b = int(qsl[i]), int(qsl[i + 1])
        q = query[max(a, b - worker._window):b].float().clone()   # [n, q_heads, D]
        worker._queries.setdefault(rid, {})[V.layer_name(layer)] = q


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


def _step(impl, layer, query, md, worker: KvscoreWorker) -> _Step:
    """The step's plan, made by its first attention call: the selector told which blocks were
    written, then kvscore.vllm.plan.plan_step on numpy views of the step's metadata (holes
    removed, sparse rows and their lengths), the sparse rows handed to the selector once, one
    attention schedule for every layer (the counts do not depend on the layer). Every layer of
    the step shares one metadata object, which is never edited."""
    cached = V.step_cached(md)
    if cached is not None and cached.version == worker._holes_version:
        return cached
    t0 = time.perf_counter()
    cfg, bs, sel = worker.cfg, worker.block_size, worker._selector
    bt, qsl, seq_lens, slot_mapping, num_actual = V.step_fields(md)
    if sel is not None:  # every step: the blocks written since the last one lose their summaries
        written = slot_mapping[:num_actual]
        if worker._loaded_blocks:  # and the blocks a swap-in wrote
            written = torch.cat([written.to(torch.int64),
                                 torch.tensor(worker._loaded_blocks, dtype=torch.int64) * bs])
            worker._loaded_blocks = []
        # the live sequences: the keys of the requests decoding in this step (their kept choices
        # and indexes stay; the others' go)
        sel.begin_step(written, np.fromiter(worker._decoding.values(), np.int64, len(worker._decoding)))
    # CPU tensors: their numpy views share the memory (nothing is copied; plan_step writes none)
    bt_np = bt.numpy()
    p = plan_step(bt_np, qsl.numpy(), seq_lens.numpy(), slot_mapping.numpy(), bs, holes=worker._evicted,
                  decoding=worker._decoding if sel is not None else None, attend=cfg.attend,
                  dense_below=cfg.dense_below, sinks=cfg.sinks, local=cfg.local)
    src = bt if p.table is bt_np else torch.from_numpy(p.table)  # the table with holes removed
    step = _Step(worker._holes_version, md, src)
    if p.rows.size:
        st = worker.sparse_stats
        st["steps"] += 1
        st["rows"] += int(p.rows.size)
        st["blocks_attended"] += int(p.attend.sum())
        st["blocks_total"] += sum(-(-int(n) // bs) for n in p.tokens)
        step.dst = src.clone()
        step.rows, step.token_index, step.tokens, step.attend, step.seqs = (
            p.rows, p.token_index, p.tokens, p.attend, p.seqs)
        # the rows once for every layer (each layer's call then passes only its query)
        sel.plan(step.token_index, src, step.rows, step.tokens, step.attend, step.dst, step.seqs)
    if p.changed:
        new_sl = seq_lens.clone()
        num_reqs = len(p.seq_lens)
        new_sl[:num_reqs] = torch.tensor(p.seq_lens, dtype=new_sl.dtype)
        sched = V.attention_schedule(impl, V.layer_isa(layer), md, new_sl, query.dtype)
        table = step.dst if step.dst is not None else src
        step.md = V.metadata_with(md, block_table=table, seq_lens=new_sl, scheduler_metadata=sched,
                                  max_seq_len=max(p.seq_lens))
    V.step_cache(md, step)
    worker.sparse_stats["plan_s"] += time.perf_counter() - t0
    return step
