"""Model shapes people serve, for speed work without their weights (no model hub here).

`model_dir(shape, out)` writes a model folder vLLM loads with `load_format="dummy"` (random
weights): the published architecture's config.json and SmolLM2's tokenizer (its ids are below every
shape's vocabulary size). Random weights say nothing of quality; they are exact about bytes and
time. `step_bytes` is the bound beside every figure: what one decode step must read.
"""
from __future__ import annotations

import json
import os
import shutil

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# The published configs (hidden size, layers, heads, KV heads, head_dim, MLP width, vocabulary,
# tied embeddings, RoPE), as released by Meta and Qwen.
SHAPES = {
    "llama-3.2-1b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
                     "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
                     "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu"},
    "llama-3.2-3b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072,
                     "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": True,
                     "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu"},
    "qwen3-1.7b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
                   "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
                   "rope_theta": 1000000.0, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                   "hidden_act": "silu", "attention_bias": False},
    "llama-3.1-8b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False,
                     "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu"},
}

# chat_template.jinja: where recent transformers save a tokenizer's chat template (the bench's
# prompts apply it); without it the copied tokenizer has none
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                    "chat_template.jinja")


def model_dir(shape: str, out: str, tokenizer_dir: str, dtype: str = "bfloat16") -> str:
    """A folder with `shape`'s config.json and the tokenizer of `tokenizer_dir` (SmolLM2's)."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: one of {', '.join(SHAPES)}")
    os.makedirs(out, exist_ok=True)
    cfg = {**SHAPES[shape], "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2, "attention_dropout": 0.0,
           "initializer_range": 0.02, "use_cache": True}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    for name in _TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(out, name))
    return out


def params(shape: str) -> dict:
    """Parameter counts: the layers', the embedding's and the output head's (tied: the same matrix)."""
    c = SHAPES[shape]
    h, d, L = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
    q, kv, m, V = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"], c["vocab_size"]
    attn = h * q * d + 2 * h * kv * d + q * d * h
    layer = attn + 3 * h * m + 2 * h + (2 * d if c["model_type"] == "qwen3" else 0)
    return {"layers": L * layer, "embedding": V * h, "head": V * h, "tied": c["tie_word_embeddings"]}


def kv_bytes_per_token(shape: str, elem: int = 2) -> int:
    """K and V of one token in every layer."""
    c = SHAPES[shape]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * elem


def step_bytes(shape: str, tokens: list[int], attended: list[int] | None = None, elem: int = 2,
               block_size: int = 32, summary_bytes_per_block_head: int = 0) -> int:
    """Bytes one decode step of a batch must read: the layers' weights and the output head once,
    one embedding row per request, every request's K and V (or only its `attended` tokens), and
    with sparse decode the block summaries its choice reads (per layer, block and KV head)."""
    c = SHAPES[shape]
    p = params(shape)
    w = (p["layers"] + p["head"]) * elem + len(tokens) * c["hidden_size"] * elem
    kv = kv_bytes_per_token(shape, elem) * sum(attended if attended is not None else tokens)
    summ = 0
    if attended is not None and summary_bytes_per_block_head:
        blocks = sum(-(-n // block_size) for n in tokens)
        summ = blocks * c["num_hidden_layers"] * c["num_key_value_heads"] * summary_bytes_per_block_head
    return w + kv + summ
