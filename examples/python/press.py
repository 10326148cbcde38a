#!/usr/bin/env python3
"""docs/reference/python.md's "Presses" snippet, run as a program on a small random Llama (no download):
the doc shows exactly the marked region (python/tests/test_examples.py compares them)."""

import torch
import transformers

torch.manual_seed(0)
model = transformers.LlamaForCausalLM._from_config(
    transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=2), attn_implementation="eager").eval()
input_ids = torch.randint(0, 256, (1, 200))
cache = transformers.DynamicCache()

with torch.no_grad():
    # [press:begin]
    from kvscore.presses import KvscorePress
    press = KvscorePress(method="manifold_l2", compression_ratio=0.5)   # or "knorm", "snapkv", ...
    with press(model):
        model(input_ids, past_key_values=cache)
    # [press:end]

assert all(layer.keys.shape[2] == 100 for layer in cache.layers), "every layer keeps half of 200 tokens"
print("press: ok")
