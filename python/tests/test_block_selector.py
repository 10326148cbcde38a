"""kvscore._kvscore.PagedBlockSelector, the binding kvscore.vllm's sparse decode drives
(docs/reference/block_sparse.md): the planned calls (register_caches + plan once, select_planned per layer)
choose what select does, every row's choice is the stateless reference's when scored, and misuse
is a ValueError naming the value. No vLLM needed: a pool in vLLM CPU's layout."""
import numpy as np
import pytest
import torch

from kvscore import _kvscore as _k

L, KH, QH, D, BS = 3, 2, 4, 16, 8


def _pool(blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    # vLLM CPU's [num_blocks, kv_heads, block_size, 2 * head_dim] (keys, then values), one per layer
    return [torch.randn(blocks, KH, BS, 2 * D, generator=g).to(torch.bfloat16) for _ in range(L)]


def _selectors(nb, refresh):
    kw = dict(score="int4", sinks=4, local=8, refresh=refresh, threads=2)
    return _k.PagedBlockSelector(L, nb, KH, D, BS, **kw), _k.PagedBlockSelector(L, nb, KH, D, BS, **kw)


@pytest.mark.parametrize("refresh", [1, 3])
def test_planned_calls_choose_what_select_does_and_the_reference_when_scored(refresh):
    nb, rows_n, per = 96, 3, 30
    caches = _pool(nb)
    planned, plain = _selectors(nb, refresh)
    planned.register_caches(caches)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    src = perm[: rows_n * per].view(rows_n, per).contiguous()
    first = src[:, 0].numpy().astype(np.int64)
    rows = np.array([0, 2], np.int64)          # row 1 is not sparse this step (prefill, short): untouched
    tokens = np.array([170, 0, 201], np.int64)
    g = torch.Generator().manual_seed(2)
    scored_total = 0
    for step in range(7):
        toks = tokens[rows]
        attend = np.array([_k.attended_blocks(int(n), BS, 0.25, sinks=4, local=8) for n in toks], np.int64)
        slots = np.array([int(src[r, n // BS]) * BS + n % BS for r, n in zip(rows, toks)], np.int64)
        for sel in (planned, plain):
            sel.begin_step(slots, first)
        dst_a, dst_b = src.clone(), src.clone()
        ti = np.array([1, 0], np.int64)        # each row's query token in the layer's [tokens, q_heads, D]
        planned.plan(ti, src, rows, toks, attend, dst_a)
        for layer in range(L):
            query = torch.randn(2, QH, D, generator=g).to(torch.bfloat16)
            # layer 1's cache as another tensor object over the same memory: converted, same answer
            kv = caches[layer] if layer != 1 else caches[layer][:]
            n = planned.select_planned(layer, kv, query)
            fresh = plain.select(layer, caches[layer], query, ti, src, rows, toks, attend, dst_b)
            np.testing.assert_array_equal(planned.fresh, fresh)
            assert n == int(fresh.sum())
            assert torch.equal(dst_a, dst_b), (step, layer)
            assert torch.equal(dst_a[1], src[1])   # a row not planned is never written
            scored_total += n
            for i, r in enumerate(rows):
                if not fresh[i]:
                    continue
                ids = src[r, : -(-int(toks[i]) // BS)].numpy().astype(np.int64)
                keys = _k.vllm_cpu_keys(caches[layer], ids, int(toks[i]))
                ref = _k.block_sparse_reference(keys, query[ti[i]].float().numpy(), BS, int(attend[i]), score="int4",
                                                sinks=4, local=8)
                assert dst_a[r, : attend[i]].tolist() == [int(ids[b]) for b in ref]
        tokens[rows] += 1
    # refresh 3: rows are scored on steps 0, 3 and 6 only (nothing is written to their kept blocks)
    assert scored_total == (7 if refresh == 1 else 3) * L * len(rows)


def test_planned_calls_refuse_misuse_naming_the_value():
    nb = 32
    caches = _pool(nb)
    sel, _ = _selectors(nb, 1)
    q = torch.zeros(1, QH, D)
    with pytest.raises(ValueError, match="2 given, the selector has 3 layers"):
        sel.register_caches(caches[:2])
    sel.register_caches(caches)
    with pytest.raises(ValueError, match="no plan for this step"):
        sel.select_planned(0, caches[0], q)
    src = torch.arange(20, dtype=torch.int32).view(1, 20)
    one = np.zeros(1, np.int64)
    sel.begin_step(np.zeros(0, np.int64), one)
    with pytest.raises(ValueError, match=r"rows\[0\] = 5 out of range \[0, 1\)"):
        sel.plan(one, src, np.array([5]), np.array([150]), np.array([6]), src.clone())
    with pytest.raises(ValueError, match="one entry per decode row"):
        sel.plan(one, src, one, np.array([150, 151]), np.array([6]), src.clone())
    sel.plan(one, src, one, np.array([150]), np.array([6]), src.clone())
    with pytest.raises(ValueError, match=r"token_index\[0\] = 0 out of range \[0, 0\)"):
        sel.select_planned(0, caches[0], torch.zeros(0, QH, D))
    assert sel.select_planned(0, caches[0], q) == 1
    sel.begin_step(np.zeros(0, np.int64), one)      # a plan is one step's
    with pytest.raises(ValueError, match="no plan for this step"):
        sel.select_planned(0, caches[0], q)


def test_the_plugins_sparse_defaults_are_the_librarys():
    """kvscore.vllm's sparse-decode defaults are read from C++ (kvscore::BlockSparseOptions,
    kvscore::kDefaultDenseBelow): the plugin's Config and the binding's selector agree, refresh included."""
    import inspect

    import kvscore.vllm as kv

    d = _k.struct_defaults["BlockSparseOptions"]
    assert d["refresh"] == 1 and d["score"] == "int4" and d["local"] == 64 and d["prefilter"] == 0
    sig = inspect.signature(kv.Config).parameters
    for plugin, cpp in (("block_score", "score"), ("local", "local"), ("prefilter", "prefilter"),
                        ("refresh", "refresh"), ("query_group", "group"), ("sinks", "sinks"), ("probe", "probe")):
        assert sig[plugin].default == d[cpp], plugin
    assert sig["dense_below"].default == _k.kDefaultDenseBelow
    assert kv.BLOCK_SCORES == tuple(_k.block_scores) == ("quest", "meanstd", "int4", "pariskv", "exact")
    # the binding's selector defaults: refresh 1 (every step scored); refresh 8: a row scored once in three steps
    for kw, want in (({}, 3), ({"refresh": 8}, 1)):
        caches = _pool(32)
        s = _k.PagedBlockSelector(L, 32, KH, D, BS, local=8, **kw)
        s.register_caches(caches)
        src = torch.arange(20, dtype=torch.int32).view(1, 20)
        one = np.zeros(1, np.int64)
        scored = 0
        for _ in range(3):
            s.begin_step(np.zeros(0, np.int64), one)
            s.plan(one, src, one, np.array([150]), np.array([6]), src.clone())
            scored += s.select_planned(0, caches[0], torch.zeros(1, QH, D))
        assert scored == want, kw
    # which rows decode sparsely: the same rule the connector applies
    assert _k.sparse_attend(1000, 32, 0.1) == 0                      # below dense_below
    assert _k.sparse_attend(2000, 32, 0.1) == _k.attended_blocks(2000, 32, 0.1)
    assert _k.attended_tokens(1000, 32, 4) == 3 * 32 + 8


def test_rows_sharing_a_first_block_need_their_own_keys_and_each_chooses_its_own():
    # prefix caching: two requests whose tables start with the same 14 physical blocks
    nb = 48
    caches = _pool(nb, seed=3)
    sel, alone = _selectors(nb, 3)
    sel.register_caches(caches)
    alone.register_caches(caches)
    src = torch.zeros(2, 20, dtype=torch.int32)
    src[0] = torch.arange(20, dtype=torch.int32)
    src[1, :14] = torch.arange(14, dtype=torch.int32)
    src[1, 14:] = torch.arange(30, 36, dtype=torch.int32)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, QH, D, generator=g)
    ti, rows, toks, att = np.array([0, 1]), np.array([0, 1]), np.array([155, 155]), np.array([6, 6])
    keys = np.array([11, 12], np.int64)
    sel.begin_step(np.zeros(0, np.int64), keys)
    dst = src.clone()
    with pytest.raises(ValueError, match="sequence key 0 of an earlier row"):  # keyed by their first block
        sel.plan(ti, src, rows, toks, att, dst)
        sel.select_planned(0, caches[0], q)
    with pytest.raises(ValueError, match="seqs: 1 entries, one per decode row"):
        sel.plan(ti, src, rows, toks, att, dst, np.array([11]))
    with pytest.raises(ValueError, match=r"seqs\[1\] = -2 must be >= 0"):
        sel.plan(ti, src, rows, toks, att, dst, np.array([11, -2]))
    sel.plan(ti, src, rows, toks, att, dst, keys)
    assert sel.select_planned(0, caches[0], q) == 2
    for r in (0, 1):  # each row alone, under its own key: the same blocks
        one = src[r:r + 1].clone()
        alone.begin_step(np.zeros(0, np.int64), keys[r:r + 1])
        alone.plan(np.array([0]), src[r:r + 1], np.array([0]), toks[:1], att[:1], one, keys[r:r + 1])
        alone.select_planned(0, caches[0], q[r:r + 1])
        assert one[0, :6].tolist() == dst[r, :6].tolist()
