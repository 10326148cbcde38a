"""Sparse decode in a real vLLM CPU engine (docs/design/vllm-internals.md#sparse-decode-step-by-step): every decode step's blocks,
read back per layer and request through kvscore.vllm.check, equal kvscore's stateless reference on
the keys and queries read back from vLLM's cache — across mixed prefill + decode steps, eviction's
holes, and blocks freed by one request and reused by another in a small pool; the protected blocks
are always in and other rows reach the kernel unchanged. (Dense equivalence: test_engine.py's
keep-all test; tensor parallelism: test_tp.py.)"""
import pytest

from conftest import run_engine
from test_engine import prompts


@pytest.mark.parametrize("score", ["int4", "pariskv"])
def test_every_layers_choice_is_the_references_across_reuse_and_mixed_steps(model_dir, score):
    # wave 1: A and B (B arrives while A decodes: a mixed prefill + decode step), C too short to
    # decode sparsely; wave 2 (after wave 1 ends): D, whose blocks must come from wave 1's (the
    # pool holds 80 blocks; A and B alone held ~75)
    ps = prompts(model_dir, [1400, 900, 100, 1200])
    plugin = {"method": "knorm", "ratio": 0.5, "attend": 0.25, "dense_below": 256, "block_score": score,
              "refresh": 1 if score == "pariskv" else 3}  # int4: scored every third step, kept between
    r = run_engine({"model": model_dir, "prompts": ps, "max_tokens": 12, "stepwise": True, "arrive": [0, 3, 0, 40],
                    "plugin": plugin, "check": True, "blocks": 80, "max_model_len": 2048})
    assert all(len(t) == 12 for t in r["tokens"])
    recs = r["check"]
    rows = [row for rec in recs for row in rec["rows"]]
    assert len({rec["layer"] for rec in recs}) == 30               # every layer checked
    assert rows and all(row["match"] for row in rows), [row for row in rows if not row["match"]][:2]
    assert all(row["protected_in"] and row["seq_len_ok"] and row["qlen"] == 1 for row in rows)
    assert sum(row["fresh"] for row in rows) < len(rows) if score == "int4" else all(row["fresh"] for row in rows)
    assert all(rec["others_untouched"] for rec in recs)            # prefill and short rows: unchanged
    assert any(rec["prefill_rows"] > 0 and rec["rows"] for rec in recs)  # a mixed step was sparse
    # three requests decoded sparsely (A, B, D; C is below dense_below), each attending 25 % of
    # its blocks (rounded up, at least the protected ones) of what eviction left
    firsts = {row["first"] for row in rows}
    assert len(firsts) == 3
    assert all(row["attend"] < row["blocks"] for row in rows)
    # D reused blocks that A or B held (and whose summaries they had made)
    first_wave = {b for row in rows if row["first"] != rows[-1]["first"] for b in row["ids"]}
    assert set(rows[-1]["ids"]) & first_wave
