"""kvscore.vllm on a bf16 SmolLM2 (dtype bfloat16: model and KV cache), in the CPU attention ISA vLLM
picks for it: `amx` on a CPU with AMX tiles (the block size 32 is a multiple of 32), `vec`
elsewhere. Keep-all is token-identical to plain vLLM in bf16; eviction's kept blocks are exactly
select_joint_blocks' on the keys read back from vLLM's bf16 cache (through the layer's ISA's
layout), and every sparse decode step's blocks, in every layer, are kvscore's stateless
reference's (kvscore.vllm.check), in the same engine. (The amx layout itself, written by vLLM's
op on any x86 CPU: test_layout.py.)"""
import os

import pytest
from conftest import run_engine
from test_engine import prompts


def _expected_isa():
    import torch
    return "amx" if torch.cpu._is_amx_tile_supported() else "vec"


@pytest.mark.skipif(not os.environ.get("KVSCORE_VLLM_BF16_PLAIN"),
                    reason="two more engine starts, by hand (CI's budget): KVSCORE_VLLM_BF16_PLAIN=1")
def test_bf16_keep_all_is_token_identical_to_plain_vllm(model_dir):
    ps = prompts(model_dir, [40, 500])
    spec = {"model": model_dir, "prompts": ps, "max_tokens": 16, "dtype": "bfloat16"}
    plain = run_engine(spec)  # one engine at a time
    keep = run_engine({**spec, "plugin": {"method": "knorm", "ratio": 0.0, "attend": 1.0}})
    assert plain["isa"] == keep["isa"] == _expected_isa()
    assert keep["wrapped"] == keep["layers"] == 30
    assert all(len(t) == 16 for t in plain["tokens"])
    assert keep["tokens"] == plain["tokens"]
    assert keep["freed_total"] == 0


def test_bf16_eviction_and_sparse_decode_choose_the_references_blocks(model_dir):
    # A (900 tokens) and B (640) lose half their blocks at ratio 0.5 and decode sparsely; C stays
    # below dense_below
    ps = prompts(model_dir, [900, 100, 640])
    plugin = {"method": "keydiff", "ratio": 0.5, "attend": 0.25, "dense_below": 256, "block_score": "int4",
              "refresh": 1}
    r = run_engine({"model": model_dir, "prompts": ps, "max_tokens": 10, "stepwise": True, "capture": True,
                    "check": True, "plugin": plugin, "dtype": "bfloat16"})
    assert r["isa"] == _expected_isa()
    assert all(len(t) == 10 for t in r["tokens"])
    dec = {d[0]: d for d in r["decisions"]}
    assert dec["b3r0"][2] and dec["b3r2"][2]  # A and B lost blocks
    for rid, (_, kept, evicted, parts) in dec.items():
        assert parts == 1
        assert kept == r["reference"][rid]  # select_joint_blocks on the bf16 keys read back
    recs = r["check"]
    rows = [row for rec in recs for row in rec["rows"]]
    assert len({rec["layer"] for rec in recs}) == 30
    assert rows and all(row["match"] for row in rows), [row for row in rows if not row["match"]][:2]
    assert all(row["protected_in"] and row["seq_len_ok"] for row in rows)
    assert all(rec["others_untouched"] for rec in recs)
    assert len({row["first"] for row in rows}) == 2  # A and B decoded sparsely, after eviction's holes
    assert all(row["attend"] < row["blocks"] for row in rows)
