"""kvscore.vllm.plan without an engine: one step's plan (holes removed from the block table, the
sparse decode rows, the lengths the kernel sees) on hand-made and random batches against a
brute-force computation, one eviction decision from split partials against kvscore's
select_joint_blocks, the freed runs; and that the connector's modules reach vLLM only through
kvscore.vllm.internals (docs/design/vllm-internals.md#the-code)."""
import ast
import math
import pathlib

import numpy as np
import pytest

import kvscore
from kvscore import _kvscore as _k
from kvscore.vllm import Config
from kvscore.vllm.plan import block_runs, decide_eviction, plan_step

BS = 32


def batch(rows, width=72, seed=0):
    """vLLM CPU's step metadata as numpy arrays from (query tokens, sequence length) per row: every
    row its own physical blocks (distinct ids), slot_mapping the slots of each row's new tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(10 * width * len(rows))[: width * len(rows)].astype(np.int32).reshape(len(rows), width)
    qsl = np.zeros(len(rows) + 1, np.int32)
    slots = []
    for i, (q, n) in enumerate(rows):
        qsl[i + 1] = qsl[i] + q
        slots += [int(ids[i, p // BS]) * BS + p % BS for p in range(n - q, n)]
    return ids, qsl, np.array([n for _, n in rows], np.int32), np.array(slots, np.int64)


def attended_blocks(n, attend, sinks, local):
    """kvscore::attended_blocks, written out (docs/reference/block_sparse.md)."""
    blocks = -(-n // BS)
    want = math.ceil(attend * n * (1 - 1e-12)) if attend <= 1 else int(attend)
    want_blocks = -(-min(want, n) // BS)
    sink_end = min(blocks, -(-min(sinks, n) // BS))
    local_begin = min(blocks, max(0, n - max(local, 1)) // BS)
    return min(blocks, max(want_blocks, min(sink_end, local_begin) + blocks - local_begin))


def brute_force(bt, qsl, seq_lens, slots, holes, decoding, attend, dense_below, sinks, local):
    """Row by row, the plan's definition: (table, lengths, [(row, token, tokens, attend, seq)])."""
    table, lens, sparse = bt.copy(), [int(x) for x in seq_lens], []
    for i in range(len(lens)):
        ev = holes.get(int(bt[i, 0]))
        if ev is not None and ev[-1] < -(-lens[i] // BS):
            kept = [int(bt[i, j]) for j in range(-(-lens[i] // BS)) if j not in ev]
            table[i, : len(kept)] = kept
            lens[i] -= len(ev) * BS
        q = int(qsl[i + 1] - qsl[i])
        seq = decoding.get(int(slots[qsl[i]]) // BS)
        if q != 1 or seq is None:
            continue
        n = lens[i]
        a = attended_blocks(n, attend, sinks, local)
        if n < dense_below or a >= -(-n // BS):
            continue
        sparse.append((i, int(qsl[i]), n, a, seq))
        lens[i] = (a - 1) * BS + n - (-(-n // BS) - 1) * BS
    return table, lens, sparse


def test_a_step_with_a_prefill_holes_sparse_short_and_dense_rows():
    rows = [(5, 300), (1, 1287), (1, 2000), (1, 100), (1, 1500), (1, 64 * 32 + 1)]
    bt, qsl, sl, slots = batch(rows)
    before = (bt.copy(), qsl.copy(), sl.copy(), slots.copy())
    holes = {int(bt[1, 0]): [2, 3, 5],   # row 1: 3 holes, then sparse
             int(bt[4, 0]): [1, 47],     # row 4: 47 blocks (0-46), not up to block 47 yet: left alone
             int(bt[5, 0]): [10]}        # row 5: one hole, its written block not decoding: dense
    written = lambda i: int(slots[qsl[i]]) // BS  # noqa: E731
    decoding = {written(1): 7, written(2): 3, written(3): 9, written(0): 5}
    p = plan_step(bt, qsl, sl, slots, BS, holes=holes, decoding=decoding, attend=0.1, dense_below=256,
                  sinks=4, local=64)
    for a, b in zip((bt, qsl, sl, slots), before):
        assert np.array_equal(a, b)  # never written
    # row 1: 41 logical blocks less 2, 3, 5 -> 38 kept, 1287 - 96 = 1191 tokens; 10 % of them is
    # 120 tokens = 4 blocks = the protected ones (sink block, blocks 35-37): 3 whole + 7 tokens
    assert p.table[1, :38].tolist() == [int(bt[1, j]) for j in range(41) if j not in (2, 3, 5)]
    assert p.table[1, 38:].tolist() == bt[1, 38:].tolist()
    # row 5: 65 blocks less block 10; dense
    assert p.table[5, :64].tolist() == [int(bt[5, j]) for j in range(65) if j != 10]
    for i in (0, 2, 3, 4):
        assert p.table[i].tolist() == bt[i].tolist()
    # row 2: 2000 tokens (63 blocks, the last 16 tokens): ceil(200 / 32) = 7 blocks -> 6 * 32 + 16
    assert p.seq_lens == [300, 3 * 32 + 7, 6 * 32 + 16, 100, 1500, 64 * 32 + 1 - 32]
    assert p.rows.tolist() == [1, 2] and p.seqs.tolist() == [7, 3]
    assert p.token_index.tolist() == [5, 6] and p.tokens.tolist() == [1191, 2000] and p.attend.tolist() == [4, 7]
    assert p.changed


def test_a_step_with_nothing_to_change_hands_back_the_table_itself():
    bt, qsl, sl, slots = batch([(7, 500), (1, 2000)])
    p = plan_step(bt, qsl, sl, slots, BS, holes={}, decoding=None, attend=0.1, dense_below=256, sinks=4, local=64)
    assert p.table is bt and not p.changed and p.rows.size == 0 and p.seq_lens == [500, 2000]
    # decode row whose request is below dense_below, hole not reached: still nothing
    p = plan_step(bt, qsl, sl, slots, BS, holes={int(bt[1, 0]): [3, 63]},
                  decoding={int(slots[qsl[1]]) // BS: 0}, attend=0.1, dense_below=4096, sinks=4, local=64)
    assert p.table is bt and not p.changed and p.rows.size == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_equal_the_brute_force_plan(seed):
    rng = np.random.default_rng(seed)
    R = int(rng.integers(1, 12))
    rows = []
    for _ in range(R):  # decode rows (one query token) and prefill chunks
        q = 1 if rng.random() < 0.7 else int(rng.integers(2, 200))
        rows.append((q, int(rng.integers(q, 47 * BS))))
    bt, qsl, sl, slots = batch(rows, seed=seed)
    holes, decoding = {}, {}
    for i, (q, n) in enumerate(rows):
        nb = -(-n // BS)
        if nb > 3 and rng.random() < 0.5:
            k = int(rng.integers(1, nb - 1))
            holes[int(bt[i, 0])] = sorted(int(x) for x in rng.choice(np.arange(1, nb + 2), size=min(k, nb), replace=False))
        if rng.random() < 0.8:
            decoding[int(slots[qsl[i]]) // BS] = int(rng.integers(0, 1000))
    attend = [0.05, 0.25, 0.5, 300.0, 1.0, 0.1][seed]
    dense_below, sinks, local = int(rng.integers(0, 600)), int(rng.integers(1, 80)), int(rng.integers(0, 200))
    p = plan_step(bt, qsl, sl, slots, BS, holes=holes, decoding=decoding, attend=attend, dense_below=dense_below,
                  sinks=sinks, local=local)
    table, lens, sparse = brute_force(bt, qsl, sl, slots, holes, decoding, attend, dense_below, sinks, local)
    assert np.array_equal(p.table, table) and p.seq_lens == lens
    assert list(zip(p.rows.tolist(), p.token_index.tolist(), p.tokens.tolist(), p.attend.tolist(),
                    p.seqs.tolist())) == sparse
    assert p.changed == (lens != [int(x) for x in sl])


def planted_scores(layers=3, heads=4, blocks=10, low=4, seed=0):
    rng = np.random.default_rng(seed)
    s = [rng.standard_normal((heads, blocks * BS)).astype(np.float32) for _ in range(layers)]
    for x in s:
        x[:, low * BS:(low + 1) * BS] -= 6.0  # every row scores block `low` lowest
    return s


def test_an_eviction_decision_evicts_the_planted_low_block():
    scores = planted_scores()
    cfg = Config("knorm", 0.1, sinks=4, recent=64)  # 10 blocks: budget 9; blocks 0, 8, 9 protected
    keep, evicted = decide_eviction([_k.joint_partial(scores)], 320, 10, BS, cfg)
    assert evicted == [4] and keep == [0, 1, 2, 3, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("aggregate,block_aggregate,tokens,ratio", [
    ("max", "mean", 1000, 0.5), ("max", "max", 2049, 0.7), ("mean", "mean", 777, 0.3), ("max", "mean", 90, 0.9)])
def test_an_eviction_decision_from_split_partials_is_select_joint_blocks(aggregate, block_aggregate, tokens, ratio):
    rng = np.random.default_rng(tokens)
    scores = [rng.standard_normal((6, tokens)).astype(np.float32) for _ in range(4)]
    cfg = Config("keydiff", ratio, sinks=4, recent=64, aggregate=aggregate, block_aggregate=block_aggregate)
    nb = -(-tokens // BS)
    want = kvscore.select_joint_blocks(scores, BS, cfg.budget(tokens, BS), sinks=4, recent=64, aggregate=aggregate,
                                       block_aggregate=block_aggregate).tolist()
    # max: any split of the heads over ranks decides as all heads together; mean: one rank
    splits = [[0, 6]] if aggregate == "mean" else [[0, 6], [0, 2, 6], [0, 1, 3, 6]]
    for cuts in splits:
        parts = [_k.joint_partial([np.ascontiguousarray(s[a:b]) for s in scores]) for a, b in zip(cuts, cuts[1:])]
        keep, evicted = decide_eviction(parts, tokens, nb, BS, cfg)
        assert keep == want and len(keep) == cfg.budget(tokens, BS)
        assert evicted == [b for b in range(nb) if b not in want]
        assert 0 in keep and nb - 1 in keep  # the sink block and the last block


def test_block_runs():
    assert block_runs([]) == []
    assert block_runs([2, 3, 5]) == [(2, 4), (5, 6)]
    assert block_runs([1, 2, 3, 4]) == [(1, 5)]
    assert block_runs([0, 7, 9, 10, 11, 20]) == [(0, 1), (7, 8), (9, 12), (20, 21)]


def test_the_connector_reaches_vllm_only_through_internals():
    """The connector's modules import vLLM's public connector API, its logger and types for
    annotations alone; every other vLLM module is internals.py's (docs/design/vllm-internals.md)."""
    allowed = {"vllm", "vllm.distributed.kv_transfer.kv_connector.v1.base", "vllm.logger", "vllm.config",
               "vllm.v1.core.sched.output", "vllm.v1.request"}
    d = pathlib.Path(kvscore.__file__).parent / "vllm"
    seen = {}
    for name in ("connector.py", "scheduler.py", "worker.py", "metadata.py", "plan.py", "check.py"):
        for node in ast.walk(ast.parse((d / name).read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for m in mods:
                if m == "vllm" or m.startswith("vllm."):
                    seen.setdefault(m, []).append(name)
    assert set(seen) <= allowed, {m: f for m, f in seen.items() if m not in allowed}
    assert "vllm.distributed.kv_transfer.kv_connector.v1.base" in seen
    assert seen.get("vllm") == ["connector.py"]  # vllm.__version__: the pin, checked at start
    assert not any("plan.py" in f for f in seen.values())  # plan.py: neither vLLM nor torch
    src = (d / "plan.py").read_text()
    assert "import torch" not in src and "from torch" not in src
