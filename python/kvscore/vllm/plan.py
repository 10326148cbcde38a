"""What the connector computes from plain arrays and ints: one step's plan on a worker, one
eviction decision on the scheduler (docs/design/vllm-internals.md#the-code). Neither vLLM nor
torch is imported here: the worker hands plan_step numpy views of the step's attention metadata
(block table, query_start_loc, seq_lens, slot_mapping), the scheduler hands decide_eviction the
ranks' partials; python/tests_vllm/test_plan.py calls both without an engine.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .. import _kvscore as _k


@dataclasses.dataclass
class StepPlan:
    """One step's plan over its num_reqs rows (row i: query tokens query_start_loc[i:i+2])."""
    table: np.ndarray        # block table with each row's holes removed (the input itself when none is)
    seq_lens: list[int]      # per row: the length the kernel sees (less the holes; a sparse row's attended)
    changed: bool            # seq_lens differ from the step's: the kernel needs other metadata
    rows: np.ndarray         # int64: the rows that decode sparsely (empty: none) and, per such row:
    token_index: np.ndarray  # its query's token (its query_start_loc)
    tokens: np.ndarray       # its length after the holes
    attend: np.ndarray       # the blocks it attends (kvscore::sparse_attend)
    seqs: np.ndarray         # its request's sequence key (the scheduler's)


def plan_step(block_table: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray,
              slot_mapping: np.ndarray, block_size: int, *, holes: dict[int, list[int]] | None = None,
              decoding: dict[int, int] | None = None, attend: float = 1.0, dense_below: int = 0,
              sinks: int = 1, local: int = 0) -> StepPlan:
    """One step's plan; the inputs are never written.

    holes: first physical block of a request -> its evicted logical blocks (ascending); a row is
    that request's when its first block-table entry is that block. Each such row's entries become
    its kept blocks in logical order (the rest of the row is left as it was) and its length drops by
    the evicted blocks' tokens; a row whose table does not reach its last evicted block yet is left
    alone.
    decoding: the physical block each decoding request writes this step -> its sequence key; a
    row with one query token whose slot_mapping entry falls in such a block decodes sparsely when
    kvscore::sparse_attend(its length after the holes, ...) is not 0, its length then being
    kvscore::attended_tokens(...).
    """
    bs = int(block_size)
    num_reqs = int(query_start_loc.shape[0]) - 1
    lens = [int(x) for x in seq_lens[:num_reqs]]
    new_len = list(lens)
    table = block_table
    for i in range(num_reqs) if holes else ():
        evicted = holes.get(int(block_table[i, 0]))
        if evicted is None:
            continue
        n_log = -(-lens[i] // bs)
        if evicted[-1] >= n_log:
            continue
        if table is block_table:
            table = block_table.copy()
        ev = set(evicted)
        keep = [j for j in range(n_log) if j not in ev]
        table[i, : len(keep)] = block_table[i, keep]
        new_len[i] = lens[i] - len(evicted) * bs
    rows, tix, toks, att, seqs = [], [], [], [], []
    if decoding and num_reqs:
        starts = [int(x) for x in query_start_loc[: num_reqs + 1]]
        # each row's request: the block its first token is written to (a decoding request's own,
        # even when prefix caching shares its first blocks with other requests)
        wblock = [int(x) // bs for x in slot_mapping[np.asarray(starts[:num_reqs], dtype=np.int64)]]
        for i in range(num_reqs):
            seq = decoding.get(wblock[i])
            if seq is None or starts[i + 1] - starts[i] != 1:
                continue
            n = new_len[i]
            a = _k.sparse_attend(n, bs, attend, dense_below=dense_below, sinks=sinks, local=local)
            if a == 0:  # dense: shorter than dense_below, or attending every block anyway
                continue
            rows.append(i)
            tix.append(starts[i])
            toks.append(n)
            att.append(a)
            seqs.append(seq)
            new_len[i] = _k.attended_tokens(n, bs, a)  # the last block may be partial

    def arr(v):
        return np.asarray(v, dtype=np.int64)

    return StepPlan(table, new_len, new_len != lens, arr(rows), arr(tix), arr(toks), arr(att), arr(seqs))


def decide_eviction(partials: list[tuple], tokens: int, blocks: int, block_size: int, cfg) -> tuple[list[int], list[int]]:
    """One request's eviction decision from every rank's joint_partial (kvscore._kvscore.
    vllm_cpu_partial / joint_partial: (max, sum, count) per prompt position) of its `tokens`
    prompt keys in `blocks` logical blocks: (kept, evicted) logical blocks, ascending.
    cfg: a kvscore.vllm.Config (budget, sinks, recent, aggregate, block_aggregate)."""
    kept = _k.select_blocks_from_partials(partials, block_size, cfg.budget(tokens, block_size), sinks=cfg.sinks,
                                          recent=cfg.recent, aggregate=cfg.aggregate,
                                          block_aggregate=cfg.block_aggregate)
    keep = sorted(set(int(b) for b in kept))
    ks = set(keep)
    return keep, [b for b in range(blocks) if b not in ks]


def block_runs(blocks: list[int]) -> list[tuple[int, int]]:
    """The runs [a, e) of ascending logical blocks ([2, 3, 5] -> [(2, 4), (5, 6)]): vLLM frees a range."""
    out = []
    i = 0
    while i < len(blocks):
        j = i
        while j + 1 < len(blocks) and blocks[j + 1] == blocks[j] + 1:
            j += 1
        out.append((int(blocks[i]), int(blocks[j]) + 1))
        i = j + 1
    return out
