"""The plugin where users serve (docs/guides/vllm.md#prefix-caching-and-chunked-prefill): vLLM's
prefix caching with sparse decode, and chunked prefill with eviction and with sparse decode.

- prefix caching on, attend 1: the same greedy tokens as plain vLLM with prefix caching on;
- prefix caching on, attend 0.1, chunked prefill: requests sharing a long document hit its
  cached blocks, decode sparsely (in steps that also run another request's chunk), every
  layer's choice of every row equals kvscore's stateless reference, each request keeps its own
  state although they share their first blocks, and a shared block's summary is made once;
- prefix caching with eviction (ratio > 0) is refused at engine start (test_engine.py);
- chunked prefill with eviction: the decision waits for the prompt's last chunk and is
  select_joint_blocks' on the whole prompt's keys; the tokens are transformers' with the same
  holes (what the unchunked engine produces: test_engine.py);
- a 16K-token prompt in 2,048-token chunks (tiny_llama: SmolLM2's positions stop at 8K), with
  eviction and sparse decode, beside the same prompt in one step: the same decisions, every sparse
  choice the reference's in both."""
import pytest

from conftest import run_engine, run_engines
from test_engine import LICENSES, TOKENS_VS_HF, _tokenizer, chat_ids, hf_greedy_with_holes, prompts

BS = 32
DOC_TOKENS = 1400
QUESTIONS = ("What is this text about? Answer in one sentence.", "Who may copy this text?",
             "Does it give any warranty?", "Name one thing it forbids.")
SPARSE = {"method": "knorm", "ratio": 0.0, "attend": 0.1, "dense_below": 256,
          "refresh": 3}  # a kept choice stands two steps in three: each request keeps its own


def shared_prefix_prompts(model_dir):
    """One document, several questions: the prompts share the document's blocks."""
    tok = _tokenizer(model_dir)
    doc = tok.decode(tok.encode((LICENSES / "GPL-3").read_text(), add_special_tokens=False)[:DOC_TOKENS])
    return [chat_ids(model_dir, doc, q) for q in QUESTIONS]


def shared_prefix(ps):
    n = 0
    while all(len(p) > n and p[n] == ps[0][n] for p in ps):
        n += 1
    return n


@pytest.fixture(scope="module")
def spec(model_dir):
    # the first request alone, the others once it decodes: their prompts come from the prefix cache
    # but for the last blocks, computed in steps where the first one decodes
    ps = shared_prefix_prompts(model_dir)
    assert shared_prefix(ps) > 40 * BS
    return {"model": model_dir, "prompts": ps, "max_tokens": 12, "stepwise": True, "arrive": [0, 6, 6, 7],
            "prefix_caching": True, "max_model_len": 2048}


@pytest.fixture(scope="module")
def sparse_run(spec):
    return run_engine({**spec, "plugin": SPARSE, "check": True, "max_num_batched_tokens": 512})


def test_prefix_caching_with_attend_1_is_token_identical_to_plain_vllm(spec):
    plain, keep = run_engines(spec, {**spec, "plugin": {**SPARSE, "attend": 1.0}})
    assert plain["cached"][0] == 0 and all(c >= 40 * BS for c in plain["cached"][1:])  # the prefix was hit
    assert keep["cached"] == plain["cached"]
    assert keep["wrapped"] == keep["layers"] == 30
    assert all(len(t) == 12 for t in plain["tokens"])
    assert keep["tokens"] == plain["tokens"]
    assert keep["decisions"] == [] and keep["freed_total"] == 0  # nothing to decide with prefix caching


def test_prefix_caching_with_sparse_decode_hits_the_prefix_and_chooses_as_the_reference(sparse_run, spec):
    r = sparse_run
    assert all(len(t) == 12 for t in r["tokens"])
    assert r["cached"][0] == 0 and all(c >= 40 * BS for c in r["cached"][1:])
    # chunked: the first prompt in chunks of at most 512 tokens; a later prompt's rest of the
    # prompt shared steps with the first one's decode rows
    n0 = len(spec["prompts"][0])
    assert max(s.get("b4r0", 0) for s in r["scheduled"]) <= 512 < n0
    recs = r["check"]
    rows = [row for rec in recs for row in rec["rows"]]
    assert len({rec["layer"] for rec in recs}) == 30
    assert rows and all(row["match"] for row in rows), [row for row in rows if not row["match"]][:2]
    assert all(row["protected_in"] and row["seq_len_ok"] and row["qlen"] == 1 for row in rows)
    assert all(rec["others_untouched"] for rec in recs)
    assert any(rec["prefill_rows"] > 0 and rec["rows"] for rec in recs)  # a mixed step was sparse
    assert sum(row["fresh"] for row in rows) < len(rows)                  # kept choices stood (refresh)
    # four requests decoded sparsely, each under its own key, all of them starting with the same
    # (cached) physical blocks
    seqs = {row["seq"] for row in rows}
    assert len(seqs) == 4
    firsts = {row["first"] for row in rows}
    assert len(firsts) == 1
    shared = (shared_prefix(spec["prompts"]) // BS)
    prefix_ids = {tuple(row["ids"][:shared]) for row in rows}
    assert len(prefix_ids) == 1
    by_step_seq = {}
    for rec in recs:
        for row in rec["rows"]:
            by_step_seq.setdefault((rec["step"], rec["layer"]), set()).add(row["seq"])
    assert max(len(s) for s in by_step_seq.values()) >= 2  # rows sharing blocks in one call
    # a block's summary is made once (keyed by the physical block, none was written again): at
    # most one per (layer, candidate block) over every row, fewer than one per (request, block)
    per_layer, per_seq = {}, {}
    for rec in recs:
        for row in rec["rows"]:
            cand = {b for i, b in enumerate(row["ids"]) if row["sinks_end"] <= i < row["local_begin"]}
            per_layer.setdefault(rec["layer"], set()).update(cand)
            per_seq.setdefault((rec["layer"], row["seq"]), set()).update(cand)
    made = max(rec["made"] for rec in recs)
    assert 0 < made <= sum(len(s) for s in per_layer.values()) < sum(len(s) for s in per_seq.values())


def test_chunked_prefill_decides_once_the_last_chunk_is_in_with_the_unchunked_decision(model_dir):
    # as test_engine's ratio-0.5 test, the prompts in chunks of 256 tokens; the third arrives while
    # the first decodes with its holes, and its chunks share steps with that decode row
    ps = prompts(model_dir, [900, 25, 640])
    r = run_engine({"model": model_dir, "prompts": ps, "max_tokens": 24, "stepwise": True, "capture": True,
                    "arrive": [0, 0, 6], "plugin": {"method": "keydiff", "ratio": 0.5},
                    "max_num_batched_tokens": 256})
    assert all(len(t) == 24 for t in r["tokens"])
    sched = r["scheduled"]
    assert max(s.get("b3r0", 0) for s in sched) <= 256 < len(ps[0])
    assert any(s.get("b3r0") == 1 and s.get("b3r2", 0) > 1 for s in sched)  # a chunk beside a decode row
    dec = {d[0]: d for d in r["decisions"]}
    assert sorted(dec) == ["b3r0", "b3r2"]
    for rid, p in (("b3r0", ps[0]), ("b3r2", ps[2])):
        _, kept, evicted, parts = dec[rid]
        nblocks = -(-len(p) // BS)
        assert kept == r["reference"][rid]          # select_joint_blocks on the whole prompt's keys
        assert len(evicted) == nblocks // 2 and len(kept) + len(evicted) == nblocks
    # held after the decision: the kept blocks (the step after the last chunk)
    last_chunk = max(i for i, s in enumerate(sched) if s.get("b3r0", 0) > 1)
    assert r["blocks"][last_chunk]["per_req"]["b3r0"]["held"] == len(dec["b3r0"][1])
    assert r["tokens"][0][:TOKENS_VS_HF] == hf_greedy_with_holes(model_dir, ps[0], dec["b3r0"][2], TOKENS_VS_HF)


def test_a_16k_prompt_in_2048_token_chunks_decides_and_decodes_as_unchunked(model_dir, tiny_llama):
    # the 16K prompt on tiny_llama (random weights, 4 layers, positions to 20K; SmolLM2 stops at 8K),
    # eviction and sparse decode on: in 2,048-token chunks (a short request ahead of it decodes while
    # its chunks run: chunks share steps with a decode row) and unchunked (one 16K-token step), side
    # by side (the unchunked step holds both prompts)
    tok = _tokenizer(model_dir)
    text = "\n\n".join((LICENSES / n).read_text() for n in ("GPL-3", "GFDL-1.3", "Apache-2.0", "MPL-2.0"))
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 16384
    small, big = ids[-300:], ids[:16384]
    spec = {"model": tiny_llama, "prompts": [small, big], "max_tokens": 8, "stepwise": True,
            "plugin": {"method": "keydiff", "ratio": 0.5, "attend": 0.1, "dense_below": 128}, "check": True,
            "max_model_len": 16384 + 64}
    chunked, whole = run_engines({**spec, "max_num_batched_tokens": 2048}, {**spec, "max_num_batched_tokens": 17408})
    sched = chunked["scheduled"]
    assert max(s.get("b2r1", 0) for s in sched) <= 2048 < len(big)        # in chunks
    assert any(s.get("b2r0") == 1 and s.get("b2r1", 0) > 1 for s in sched)  # a chunk beside a decode row
    assert max(s.get("b2r1", 0) for s in whole["scheduled"]) == len(big)     # in one step
    # one decision per request, made once the last chunk is in: the unchunked run's
    by = lambda r: {d[0]: (d[1], d[2]) for d in r["decisions"]}  # noqa: E731
    assert sorted(by(chunked)) == ["b2r0", "b2r1"]
    assert by(chunked) == by(whole)
    kept, evicted = by(chunked)["b2r1"]
    assert len(kept) + len(evicted) == len(big) // BS and len(evicted) == len(big) // BS // 2
    assert chunked["freed_total"] == whole["freed_total"] > 0
    # sparse decode in both: every layer's choice is the reference's, the 16K request's a tenth of its blocks
    for r in (chunked, whole):
        rows = [row for rec in r["check"] for row in rec["rows"]]
        assert rows and all(row["match"] and row["protected_in"] for row in rows)
        big_rows = [row for row in rows if row["blocks"] > 200]  # the 16K request's (~257 blocks after eviction)
        assert big_rows and all(row["attend"] <= row["blocks"] // 5 for row in big_rows)
        assert all(len(t) == 8 for t in r["tokens"])
