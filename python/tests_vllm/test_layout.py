"""The key layout of vLLM CPU's cache as vLLM itself writes it (ops.cpu_attn_reshape_and_cache, the
op the CPU attention backend stores keys with) read back through kvscore's TransposedPagedKeysView
(kvscore._kvscore.vllm_cpu_keys): every dtype and readable ISA, scattered blocks, a partial block."""
import numpy as np
import pytest

from kvscore import _kvscore as _k


@pytest.mark.parametrize("isa", ["vec", "vec16"])
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
    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa)
    got = _k.vllm_cpu_keys(kv, table, N)                       # float32 [H, N, D]
    want = key.float().permute(1, 0, 2).numpy()
    np.testing.assert_array_equal(got, want)
    got64 = _k.vllm_cpu_keys(kv, table.astype(np.int64), N)
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
