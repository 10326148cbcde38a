"""kvscore.vllm in a real vLLM CPU engine on SmolLM2-135M-Instruct (one engine per process,
engine_run.py): keep-all is token-identical to plain vLLM, ratio 0.5 frees the evicted blocks
(and exactly select_joint_blocks' on the keys read back from vLLM's cache) while generation
goes on, several requests in flight keep their blocks apart, a short request is left whole,
and a bad configuration stops the engine at start."""
import functools
import pathlib

from conftest import engine_error, run_engine, run_engines

LICENSES = pathlib.Path("/usr/share/common-licenses")


@functools.lru_cache(maxsize=None)
def _tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def chat_ids(model_dir, text, question):
    tok = _tokenizer(model_dir)
    msgs = [{"role": "user", "content": f"{text}\n\n{question}"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def prompts(model_dir, lengths):
    """Chat prompts whose context is the first `n` tokens of a licence text, then a question."""
    tok = _tokenizer(model_dir)
    texts = [(LICENSES / n).read_text() for n in ("GPL-3", "Apache-2.0", "GFDL-1.3", "MPL-2.0")]
    out = []
    for i, n in enumerate(lengths):
        ids = tok.encode(texts[i % len(texts)], add_special_tokens=False)[:n]
        out.append(chat_ids(model_dir, tok.decode(ids), "What is this text about? Answer in one sentence."))
    return out


KEYDIFF = {"method": "keydiff", "ratio": 0.0}
TOKENS_VS_HF = 16  # greedy tokens compared with transformers (fp32 both; later ones may part on a near-tie)


def test_plugin_off_leaves_vllm_untouched_and_keep_all_is_token_identical(model_dir):
    ps = prompts(model_dir, [20, 300, 700])
    spec = {"model": model_dir, "prompts": ps, "max_tokens": 24, "batches": [1, 3]}
    plain, keep, dense = run_engines(
        spec,
        {**spec, "plugin": {**KEYDIFF, "attend": 1.0}, "by_name": True},  # found through the entry point
        # sparse decode on, every request below its threshold: every step plans, none is sparse
        {**spec, "plugin": {"method": "knorm", "ratio": 0.0, "attend": 0.1, "dense_below": 4096}})
    assert plain["wrapped"] == 0 and plain["layers"] == 30  # no connector: no layer touched
    assert keep["wrapped"] == keep["layers"] == 30
    assert len(plain["tokens"]) == 6 and all(len(t) == 24 for t in plain["tokens"])
    assert keep["tokens"] == plain["tokens"]
    assert dense["tokens"] == plain["tokens"]
    assert dense["decisions"] == []  # ratio 0 with sparse decode: no eviction pass at all
    # ratio 0 scored every prompt longer than nothing and freed nothing
    assert keep["freed_total"] == 0
    assert len(keep["decisions"]) == 6 and all(ev == [] and parts == 1 for _, _, ev, parts in keep["decisions"])


def test_ratio_half_frees_the_evicted_blocks_of_each_request_apart(model_dir):
    # SnapKV here (its query window); KeyDiff in test_prefix.py, the same prompts in chunks; K-norm
    # in the benchmark (docs/guides/vllm.md): one engine start each
    method = "snapkv"
    # three requests in flight together: two long ones and one shorter than the protected window
    ps = prompts(model_dir, [900, 25, 640])
    plugin = {"method": method, "ratio": 0.5}
    r = run_engine({"model": model_dir, "prompts": ps, "max_tokens": 40, "stepwise": True, "capture": True,
                    "plugin": plugin})
    assert all(len(t) == 40 for t in r["tokens"])          # generation went on and finished
    dec = {d[0]: d for d in r["decisions"]}
    long_ids = ["b3r0", "b3r2"]
    assert sorted(dec) == long_ids                        # the short request was left whole
    first = r["blocks"][0]                                # the step that ran the three prefills
    for rid, n in zip(["b3r0", "b3r1", "b3r2"], [len(p) for p in ps]):
        nblocks = -(-n // 32)
        held = first["per_req"][rid]["held"]
        if rid in dec:
            _, kept, evicted, parts = dec[rid]
            assert parts == 1                             # one rank: one partial
            assert kept == r["reference"][rid]            # select_joint_blocks on the keys read back
            assert len(evicted) == nblocks // 2           # floor(0.5 * blocks) evicted
            assert held == nblocks - len(evicted)         # vLLM holds the kept blocks only
        else:
            assert held == nblocks
    assert r["freed_total"] == sum(len(d[2]) for d in r["decisions"])
    # each request's blocks stay its own: the blocks held after the decisions are pairwise disjoint
    held = [set(first["per_req"][rid]["ids"]) for rid in ["b3r0", "b3r1", "b3r2"]]
    assert sum(len(h) for h in held) == len(set().union(*held))
    # in that step the pool gave out every prompt's blocks and got the evicted ones back
    allocated = sum(-(-len(p) // 32) for p in ps)
    assert first["free_after"] == first["free_before"] - allocated + r["freed_total"]
    # attention over the kept blocks only, positions unchanged: transformers with the evicted
    # positions masked after the prefill generates the same greedy tokens
    assert r["tokens"][0][:TOKENS_VS_HF] == hf_greedy_with_holes(model_dir, ps[0], dec["b3r0"][2], TOKENS_VS_HF)


def test_bad_configuration_fails_at_engine_start(model_dir):
    ps = prompts(model_dir, [20])
    base = {"model": model_dir, "prompts": ps, "max_tokens": 2}
    # One failing start (each is a whole engine start, ~1 minute here): the extra config reaches the
    # plugin's checks at start, which name the setting and the reason; every setting's own error
    # (an unknown method, bad ratios, ...) is the same check, run without an engine by test_config.py.
    # raw_extra: the settings as `vllm serve --kv-transfer-config` passes them, unchecked before start
    err = engine_error({**base, "raw_extra": {"method": "keydiff", "ratio": 0.5}, "prefix_caching": True})
    assert "kvscore.vllm: ratio 0.5 (eviction) needs enable_prefix_caching=False" in err
    assert "shared by several requests" in err  # the reason (test_prefix.py: sparse decode alone works)


def hf_greedy_with_holes(model_dir, ids, evicted_blocks, steps, block_size=32):
    """transformers' greedy continuation of `ids` when the positions of `evicted_blocks` are
    masked out of attention after the prefill (positions unchanged): what vLLM with holes must
    produce. The prefill sees every position, as vLLM's does (eviction follows the prefill)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    n = len(ids)
    keep = torch.ones(n + steps, dtype=torch.long)
    for b in evicted_blocks:
        keep[b * block_size:(b + 1) * block_size] = 0
    out = []
    with torch.no_grad():
        r = model(torch.tensor([ids]), use_cache=True)
        past, tok = r.past_key_values, int(r.logits[0, -1].argmax())
        for t in range(steps):
            out.append(tok)
            if t == steps - 1:
                break
            r = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True,
                      attention_mask=keep[: n + t + 1][None], position_ids=torch.tensor([[n + t]]))
            past, tok = r.past_key_values, int(r.logits[0, -1].argmax())
    return out
