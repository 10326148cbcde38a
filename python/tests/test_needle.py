"""kvscore.vllm.needle (the sparse-decode needle benchmark) and kvscore.vllm.shapes, without an
engine: the cases, the scoring of an answer, the interval, the policy replay, the shapes' sizes."""
import math
import random

import pytest

from kvscore.vllm import needle as N
from kvscore.vllm import shapes as S


class WordTokenizer:
    """One token per whitespace-separated word; a fixed chat template."""

    def encode(self, text, add_special_tokens=False):
        return [hash(w) & 0xFFFF for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "<user> " + messages[0]["content"] + " <assistant>"


def test_cases_have_the_length_the_key_and_half_a_distractor():
    tok = WordTokenizer()
    cases = N.make_cases(tok, 2048, 16, seed=3)
    assert len(cases) == 16
    again = N.make_cases(tok, 2048, 16, seed=3)
    assert [c.ids for c in cases] == [c.ids for c in again]  # deterministic
    assert [c.key for c in N.make_cases(tok, 2048, 16, seed=4)] != [c.key for c in cases]
    for c in cases:
        assert abs(len(c.ids) - 2048) <= 16
        assert len(c.key) == 5 and c.key.isdigit()
        assert c.index / 16 <= c.depth <= (c.index + 1) / 16  # depths spread over the context
        assert (c.distractor is not None) == (c.index % 2 == 1)
        if c.distractor:
            label, number, d = c.distractor
            assert number != c.key and abs(d - c.depth) >= 0.1 and label in N.LABELS


def test_the_needle_and_the_distractor_sit_after_a_sentence_end():
    words = ["a.", "b", "c.", "d", "e."]
    assert N._insert(words, [(0.5, "X Y")]) == ["a.", "b", "c.", "X", "Y", "d", "e."]
    assert N._insert(words, [(0.0, "X"), (0.99, "Z")]) == ["a.", "X", "b", "c.", "d", "e.", "Z"]


@pytest.mark.parametrize("text,answer", [("The pass key is 29681.", "29681"), ("The pass key is 29.", "29"),
                                         ("2968111", "2968111"), ("I do not know", None),
                                         ("The pass key is 2022-01-01", "2022")])
def test_an_answer_is_its_first_run_of_digits(text, answer):
    assert N.answer_of(text) == answer


def test_wilson_interval_against_the_closed_form():
    # Wilson (1927): for k = n the interval is [n / (n + z^2), 1]; for k = 0, [0, z^2 / (n + z^2)]
    z = 1.96
    lo, hi = N.wilson(16, 16)
    assert hi == 1.0 and lo == pytest.approx(16 / (16 + z * z))
    lo, hi = N.wilson(0, 64)
    assert lo == 0.0 and hi == pytest.approx(z * z / (64 + z * z))
    lo, hi = N.wilson(50, 100)  # symmetric about 0.5
    assert lo + hi == pytest.approx(1.0) and lo == pytest.approx(0.4038, abs=1e-4)


def test_replay_of_a_refresh_policy_against_brute_force():
    rng = random.Random(1)
    trace = {}
    for case in range(3):
        steps = []
        for t in range(12):
            layers = []
            for _ in range(2):
                exact = sorted(rng.sample(range(1, 20), 4))
                got = sorted(rng.sample(range(1, 20), 4))
                layers.append({"got": got, "exact": exact, "fresh": 1, "sink_end": 1, "local_begin": 20,
                               "cos": [round(rng.uniform(0.5, 1.0), 3) for _ in range(min(t, 16))]})
            steps.append(layers)
        trace[str(case)] = steps
    # refresh 1: every step its own choice
    want = sum(len(set(r["got"]) & set(r["exact"])) for s in trace.values() for st in s for r in st)
    assert N.replay(trace, 1, 0.0) == {"recall": want / (3 * 12 * 2 * 4), "scored": 1.0}
    # refresh 4 without the cosine: scored at steps 0, 4, 8; the kept choice is the scoring step's
    hits = 0
    for s in trace.values():
        for layer in range(2):
            for t in range(12):
                hits += len(set(s[t - t % 4][layer]["got"]) & set(s[t][layer]["exact"]))
    r = N.replay(trace, 4, 0.0)
    assert r["recall"] == hits / (3 * 12 * 2 * 4) and r["scored"] == pytest.approx(3 / 12)
    # a cosine above every traced one scores every step, as refresh 1
    assert N.replay(trace, 4, 1.0) == N.replay(trace, 1, 0.0)


def test_shapes_parameter_counts_are_the_published_ones():
    # the model cards: Llama-3.2-1B 1.24B, 3B 3.21B, Llama-3.1-8B 8.03B, Qwen3-1.7B 1.7B (1.4B without
    # the embedding); tied embeddings count once
    published = {"llama-3.2-1b": 1.236e9, "llama-3.2-3b": 3.213e9, "llama-3.1-8b": 8.03e9, "qwen3-1.7b": 1.72e9}
    for shape, n in published.items():
        p = S.params(shape)
        total = p["layers"] + p["embedding"] + (0 if p["tied"] else p["head"])
        assert total == pytest.approx(n, rel=0.01), shape
    assert S.params("qwen3-1.7b")["layers"] == pytest.approx(1.4e9, rel=0.02)
    # K and V of a token: 2 * layers * kv_heads * head_dim * 2 bytes (bf16)
    assert S.kv_bytes_per_token("llama-3.2-3b") == 2 * 28 * 8 * 128 * 2
    with pytest.raises(ValueError, match="llama-9"):
        S.model_dir("llama-9", "/tmp/x", "/tmp")


def test_step_bytes_bound():
    n = [16384] * 4
    plain = S.step_bytes("llama-3.2-3b", n)
    sparse = S.step_bytes("llama-3.2-3b", n, [t // 10 for t in n])
    w = S.step_bytes("llama-3.2-3b", [0] * 4)
    assert plain - w == 4 * 16384 * S.kv_bytes_per_token("llama-3.2-3b")
    assert sparse - w == 4 * 1638 * S.kv_bytes_per_token("llama-3.2-3b")
    # the bound for this shape at 16K, batch 4, 10 % attended: about 1.9x
    assert 1.8 < plain / sparse < 2.0
    assert math.isclose(S.step_bytes("llama-3.2-3b", n, [t // 10 for t in n], summary_bytes_per_block_head=100),
                        sparse + 4 * 512 * 28 * 8 * 100)


def test_a_subset_is_every_kth_pair_of_cases_with_and_without_distractor():
    kept = [i for i in range(16) if N.in_subset(i, 2)]
    assert kept == [0, 1, 4, 5, 8, 9, 12, 13]  # half the cases, over every depth, half with a distractor
    assert [i for i in range(6) if N.in_subset(i, 1)] == list(range(6))
    assert N.split_subset("attend=0.1@subset=2@refresh=1") == ("attend=0.1@refresh=1", 2)
    assert N.split_subset("vllm") == ("vllm", 1)
    with pytest.raises(ValueError, match="subset 0"):
        N.split_subset("attend=0.1@subset=0")
