"""The key layout of vLLM CPU's cache as vLLM itself writes it (ops.cpu_attn_reshape_and_cache, the
op the CPU attention backend stores keys with) read back through kvscore's TransposedPagedKeysView
and AmxPagedKeysView (kvscore._kvscore.vllm_cpu_keys, isa=): every dtype and readable ISA,
scattered blocks, a partial block; over an `amx` cache eviction's partial and sparse decode's
choice equal the `vec` layout's on the same keys (the op writes either layout on any x86 CPU with
AVX-512 BF16: only the amx attention kernel needs AMX tiles)."""
import numpy as np
import pytest

from kvscore import _kvscore as _k


def _write(ops, key, val, kc, vc, slots, isa):
    """vLLM's own cache write. On a CPU without AVX-512 BF16 vLLM loads its `_C_AVX512` or `_C_AVX2`
    extension, which have no `amx` layout ('Unsupported CPU attention configuration'): there the amx cases
    skip saying so (tests/test_paged_amx.cpp checks the layout in C++ on every CPU)."""
    try:
        ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa)
    except RuntimeError as e:
        if isa == "amx" and "Unsupported CPU attention configuration" in str(e):
            pytest.skip(f"vLLM on this CPU does not write the amx layout ({e})")
        raise


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_keys_written_by_vllm_read_back_by_kvscore(isa, dtype):
    import torch
    from vllm import _custom_ops as ops

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(7)
    NB, H, BS, D, N = 9, 3, 32, 64, 100  # 100 tokens: 3 full blocks and a partial one
    kv = torch.full((NB, H, BS, 2 * D), -7.0, dtype=dt)
    kc, vc = kv.view(NB, H, 2 * BS, D).chunk(2, dim=2)
    table = np.array([5, 2, 8, 0], dtype=np.int32)  # unordered, non-contiguous
    key = torch.randn(N, H, D, generator=g).to(dt)
    val = torch.randn(N, H, D, generator=g).to(dt)
    slots = torch.tensor([int(table[t // BS]) * BS + t % BS for t in range(N)], dtype=torch.int64)
    _write(ops, key, val, kc, vc, slots, isa)
    got = _k.vllm_cpu_keys(kv, table, N, isa=isa)              # float32 [H, N, D]
    want = key.float().permute(1, 0, 2).numpy()
    np.testing.assert_array_equal(got, want)
    got64 = _k.vllm_cpu_keys(kv, table.astype(np.int64), N, isa=isa)
    np.testing.assert_array_equal(got64, want)


def test_bad_caches_and_tables_are_value_errors_naming_the_value():
    import torch

    kv = torch.zeros(4, 3, 32, 128)
    with pytest.raises(ValueError, match=r"block_table\[1\] = 4 out of range \[0, 4\)"):
        _k.vllm_cpu_keys(kv, np.array([0, 4], dtype=np.int32), 40)
    with pytest.raises(ValueError, match="expected vLLM CPU's"):
        _k.vllm_cpu_keys(torch.zeros(4, 32, 128), np.array([0], dtype=np.int32), 10)
    with pytest.raises(ValueError, match="C-contiguous"):
        _k.vllm_cpu_keys(torch.zeros(4, 32, 3, 128).transpose(1, 2), np.array([0], dtype=np.int32), 10)
    with pytest.raises(ValueError, match="fp8"):
        _k.vllm_cpu_keys(torch.zeros(4, 3, 32, 128, dtype=torch.float8_e4m3fn), np.array([0], dtype=np.int32), 10)


def _two_layouts(dtype="bfloat16", NB=12, H=3, BS=32, D=64, N=300, seed=3):
    """The same keys and values written by vLLM's op into a `vec` and an `amx` cache."""
    import torch
    from vllm import _custom_ops as ops

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    table = np.array([7, 0, 11, 3, 5, 9, 2, 10, 1, 4][: -(-N // BS)], dtype=np.int32)
    key = torch.randn(N, H, D, generator=g).to(dt)
    val = torch.randn(N, H, D, generator=g).to(dt)
    slots = torch.tensor([int(table[t // BS]) * BS + t % BS for t in range(N)], dtype=torch.int64)
    caches = {}
    for isa in ("vec", "amx"):
        kv = torch.zeros((NB, H, BS, 2 * D), dtype=dt)
        kc, vc = kv.view(NB, H, 2 * BS, D).chunk(2, dim=2)
        _write(ops, key, val, kc, vc, slots, isa)
        caches[isa] = kv
    return caches, table, key


def test_amx_caches_score_and_select_as_the_vec_layout_does():
    # eviction's partial and sparse decode's choice over an amx cache vLLM wrote equal the same
    # keys' in the vec layout, and the stateless reference on the keys read back
    import torch

    from kvscore import make_scorer

    NB, H, BS, D, N, QH = 12, 3, 32, 64, 300, 9
    caches, table, key = _two_layouts(NB=NB, H=H, BS=BS, D=D, N=N)
    assert not torch.equal(caches["vec"], caches["amx"])  # the layouts differ
    ids = table.astype(np.int64)
    for method in ("knorm", "keydiff"):
        s = make_scorer(method)._impl
        pv = _k.vllm_cpu_partial(s, [caches["vec"]] * 2, ids, N, 1, isa="vec")
        pa = _k.vllm_cpu_partial(s, [caches["amx"]] * 2, ids, N, 1, isa="amx")
        for a, b in zip(pv, pa):
            np.testing.assert_array_equal(a, b)
    keys = _k.vllm_cpu_keys(caches["amx"], ids, N, isa="amx")
    np.testing.assert_array_equal(keys, key.float().permute(1, 0, 2).numpy())
    g = torch.Generator().manual_seed(5)
    query = torch.randn(1, QH, D, generator=g).to(torch.bfloat16)
    src = table[None, :].copy()
    for score in _k.block_scores:
        att = _k.attended_blocks(N, BS, 0.4)
        dst = {}
        for isa in ("vec", "amx"):
            sel = _k.PagedBlockSelector(1, NB, H, D, BS, score=score, isa=isa)
            sel.begin_step(np.zeros(0, np.int64), np.array([table[0]], np.int64))
            d = src.copy()
            sel.select(0, caches[isa], query, np.array([0]), src, np.array([0]), np.array([N]), np.array([att]), d)
            dst[isa] = d[0, :att].tolist()
        ref = _k.block_sparse_reference(keys, query[0].float().numpy(), BS, att, score=score)
        assert dst["amx"] == dst["vec"] == [int(table[b]) for b in ref], score


def test_isas_whose_layout_is_not_read_and_bad_amx_geometries_are_value_errors():
    import torch

    kv = torch.zeros(4, 3, 32, 128, dtype=torch.bfloat16)
    t = np.array([0, 1], dtype=np.int32)
    assert _k.vllm_cpu_key_layout("vec16", kv) == "transposed"
    assert _k.vllm_cpu_key_layout("amx", kv) == "amx"
    assert _k.vllm_cpu_key_layout("neon", kv.float()) == "transposed"
    with pytest.raises(ValueError, match="ISA 'neon' with bfloat16 keys"):
        _k.vllm_cpu_keys(kv, t, 40, isa="neon")
    with pytest.raises(ValueError, match="ISA 'vsx'"):
        _k.vllm_cpu_key_layout("vsx", kv)
    with pytest.raises(ValueError, match=r"kv_cache: kvscore::AmxPagedKeysView: block_size must be a multiple of 16 \(got 24\)"):
        _k.vllm_cpu_keys(torch.zeros(4, 3, 24, 128, dtype=torch.bfloat16), t, 40, isa="amx")
    with pytest.raises(ValueError, match="ISA 'rvv'"):
        _k.vllm_cpu_partial(_k_knorm(), [kv], t, 40, 1, isa="rvv")
    sel = _k.PagedBlockSelector(1, 4, 3, 64, 32, isa="neon")
    with pytest.raises(ValueError, match=r"caches\[0\]: kvscore::vllm_cpu_key_layout: CPU attention ISA 'neon'"):
        sel.register_caches([kv])


def _k_knorm():
    from kvscore import make_scorer
    return make_scorer("knorm")._impl
