"""What travels between the connector's two halves every step (docs/design/vllm-internals.md#the-code):
KvscoreMeta from the scheduler (kvscore.vllm.scheduler) to the workers (kvscore.vllm.worker),
KvscoreWorkerMeta back. vLLM's public connector metadata classes; pickled between processes
under tensor parallelism."""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


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
