"""examples/llama_cpp/random_gguf.py: GGUF files with random weights in published Llama shapes and
SmolLM2's tokenizer (docs/guides/llama-cpp-sparse-decode.md, "Random-weight models for speed").

The expected shapes are computed here from the published configs' numbers, not taken from the script.
What is asserted (each can fail):
- a one-layer llama-3.2-1b file in Q4_0, read back with gguf.GGUFReader: architecture, block count,
  context length, head counts, embedding and FFN lengths, RoPE and norm keys; every tensor's name,
  shape and type (tied embeddings: no output.weight; every 2-D weight Q4_0, token_embd too; norms and
  rope_freqs f32); the weights' spread (std 0.02), the norms (ones) and rope_freqs (Llama-3's
  factors); every tokenizer.* key equal to SmolLM2's, its 49152 tokens the rows (~10 s: the script
  draws 161M values, and each GGUFReader of SmolLM2's vocabulary takes ~2 s; an F16 file would
  double it, so F16 is checked by loading the files in llama.cpp, not here);
- the script's tensor list for all three shapes at their full layer counts (writing a 3B or 8B file
  takes minutes): the 8B's untied output.weight, the 3B's 128-wide heads;
- bad arguments exit 2 naming the value: an unknown --shape, --type, --layers 0, a missing
  --tokenizer-from.
SmolLM2's GGUF is found through $KVSCORE_SMOLLM2 or <repo>/.models/ (scripts/fetch_smollm2.sh
fetches it); without it the file tests are skipped with the reason.
"""

import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import pytest

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")

ROOT = pathlib.Path(__file__).parents[2]
SCRIPT = ROOT / "examples" / "llama_cpp" / "random_gguf.py"
VOCAB = 49152  # SmolLM2's
CTX = 4096

# (layers, hidden, heads, kv heads, head_dim, FFN, tied embeddings, llama3 RoPE factor): the
# config.json of meta-llama/Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B
PUBLISHED = {
    "llama-3.2-1b": (16, 2048, 32, 8, 64, 8192, True, 32.0),
    "llama-3.2-3b": (28, 3072, 24, 8, 128, 8192, True, 32.0),
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, False, 8.0),
}
THETA = 500000.0


def _smollm2():
    for c in (os.environ.get("KVSCORE_SMOLLM2"), ROOT / ".models" / "SmolLM2-135M-Instruct.Q4_1.gguf"):
        if c and pathlib.Path(c).is_file():
            return pathlib.Path(c)
    return None


SMOLLM2 = _smollm2()


def expected_tensors(shape, layers, matrix_type):
    """name -> (ggml shape: ne0 = columns first, type) for a file of `layers` layers."""
    _, h, heads, kv, hd, ffn, tied, _ = PUBLISHED[shape]
    F32 = gguf.GGMLQuantizationType.F32
    out = {"token_embd.weight": ((h, VOCAB), matrix_type), "output_norm.weight": ((h,), F32),
           "rope_freqs.weight": ((hd // 2,), F32)}
    if not tied:
        out["output.weight"] = ((h, VOCAB), matrix_type)
    for i in range(layers):
        out.update({
            f"blk.{i}.attn_norm.weight": ((h,), F32), f"blk.{i}.ffn_norm.weight": ((h,), F32),
            f"blk.{i}.attn_q.weight": ((h, heads * hd), matrix_type),
            f"blk.{i}.attn_k.weight": ((h, kv * hd), matrix_type),
            f"blk.{i}.attn_v.weight": ((h, kv * hd), matrix_type),
            f"blk.{i}.attn_output.weight": ((heads * hd, h), matrix_type),
            f"blk.{i}.ffn_gate.weight": ((h, ffn), matrix_type), f"blk.{i}.ffn_up.weight": ((h, ffn), matrix_type),
            f"blk.{i}.ffn_down.weight": ((ffn, h), matrix_type),
        })
    return out


def llama3_rope_factors(head_dim, factor):
    """Meta's llama3 RoPE scaling (low 1, high 4, 8192 original positions) per frequency."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * THETA ** (i / head_dim)
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192 / 1:
            out.append(factor)
        else:
            s = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out)


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    if SMOLLM2 is None:
        pytest.skip("SmolLM2 GGUF not found: run `bash scripts/fetch_smollm2.sh` or set KVSCORE_SMOLLM2")
    out = tmp_path_factory.mktemp("random_gguf") / "tiny-q4_0.gguf"
    r = run("--shape", "llama-3.2-1b", "--type", "q4_0", "--tokenizer-from", SMOLLM2, "--out", out,
            "--layers", 1, "--ctx", CTX, "--seed", 3)
    assert r.returncode == 0, r.stderr
    assert not out.with_name(out.name + ".part").exists()
    return gguf.GGUFReader(out)


def _value(reader, key):
    return reader.fields[key].contents()


def test_metadata_is_the_published_1b_config(written):
    r = written
    assert _value(r, "general.architecture") == "llama"
    want = {"llama.block_count": 1, "llama.context_length": CTX, "llama.embedding_length": 2048,
            "llama.feed_forward_length": 8192, "llama.attention.head_count": 32, "llama.attention.head_count_kv": 8,
            "llama.attention.key_length": 64, "llama.attention.value_length": 64, "llama.rope.dimension_count": 64,
            "llama.vocab_size": VOCAB, "general.file_type": 2}  # MOSTLY_Q4_0
    assert {k: _value(r, k) for k in want} == want
    assert _value(r, "llama.rope.freq_base") == THETA
    assert _value(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)


def test_every_tensor_has_the_published_shape_and_type(written):
    r = written
    want = expected_tensors("llama-3.2-1b", 1, gguf.GGMLQuantizationType.Q4_0)
    got = {t.name: (tuple(int(n) for n in t.shape), t.tensor_type) for t in r.tensors}
    assert got == want
    assert "output.weight" not in got  # Llama-3.2 ties the output to token_embd


def test_weights_are_random_norms_ones_rope_llama3(written):
    r = written
    T = gguf.GGMLQuantizationType
    by = {t.name: t for t in r.tensors}
    for name in ("token_embd.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight"):
        t = by[name]
        assert t.data.size == t.n_elements // 32 * 18  # Q4_0: 18 bytes per 32 values
        w = gguf.quants.dequantize(np.asarray(t.data[-256:]), t.tensor_type)  # the last 256 rows
        assert abs(float(w.mean())) < 1e-3 and float(w.std()) == pytest.approx(0.02, rel=0.1), name
    # different tensors are different draws
    q, k = (gguf.quants.dequantize(np.asarray(by[n].data[:8]), by[n].tensor_type) for n in ("blk.0.attn_q.weight",
                                                                                            "blk.0.attn_k.weight"))
    assert not np.array_equal(q, k)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        assert by[name].tensor_type == T.F32 and np.all(np.asarray(by[name].data) == 1.0), name
    rope = np.asarray(by["rope_freqs.weight"].data)
    np.testing.assert_allclose(rope, llama3_rope_factors(64, 32.0), rtol=1e-5)
    assert rope[0] == 1.0 and rope[-1] == 32.0


def test_tokenizer_is_smollm2s(written):
    r = written
    src = gguf.GGUFReader(SMOLLM2)
    keys = sorted(k for k in src.fields if k.startswith("tokenizer."))
    assert "tokenizer.ggml.tokens" in keys and "tokenizer.ggml.merges" in keys
    assert sorted(k for k in r.fields if k.startswith("tokenizer.")) == keys
    tokens = _value(r, "tokenizer.ggml.tokens")
    assert len(tokens) == VOCAB and tokens == src.fields["tokenizer.ggml.tokens"].contents()
    for k in keys:
        assert r.fields[k].types == src.fields[k].types, k
        assert _value(r, k) == src.fields[k].contents(), k


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("random_gguf", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shape", list(PUBLISHED))
def test_full_size_tensor_lists_are_the_published_shapes(script, shape):
    """The tensors the script would write at the full layer count (without drawing them)."""
    layers = PUBLISHED[shape][0]
    T = gguf.GGMLQuantizationType
    got = {}
    for name, shp, kind in script.plan(script.SHAPES[shape], layers, VOCAB):
        got[name] = (tuple(reversed(shp)), T.Q4_0 if kind == "matrix" else T.F32)
    assert got == expected_tensors(shape, layers, T.Q4_0)
    n_matrix = sum(math.prod(s) for s, t in got.values() if t == T.Q4_0)
    # the published parameter counts less the 128256 - 49152 vocabulary rows not written
    _, h, *_ = PUBLISHED[shape]
    published = {"llama-3.2-1b": 1235814400, "llama-3.2-3b": 3212749824, "llama-3.1-8b": 8030261248}[shape]
    rows_not_written = (128256 - VOCAB) * h * (1 if PUBLISHED[shape][6] else 2)
    norms = h * (2 * layers + 1)
    assert n_matrix == published - rows_not_written - norms
    np.testing.assert_allclose(script.rope_factors(PUBLISHED[shape][4], THETA, PUBLISHED[shape][7]),
                               llama3_rope_factors(PUBLISHED[shape][4], PUBLISHED[shape][7]), rtol=1e-5)


@pytest.mark.parametrize("args, needle", [
    (["--shape", "llama-9b"], "'llama-9b'"),
    (["--type", "q8_0"], "'q8_0'"),
    (["--layers", "0"], "--layers must be at least 1 (got 0)"),
    (["--tokenizer-from", "/nonexistent/tok.gguf"], "/nonexistent/tok.gguf"),
])
def test_bad_arguments_exit_2_naming_the_value(tmp_path, args, needle):
    base = {"--shape": "llama-3.2-1b", "--type": "q4_0", "--tokenizer-from": str(SMOLLM2 or SCRIPT),
            "--out": str(tmp_path / "x.gguf")}
    extra = []
    for k, v in zip(args[::2], args[1::2]):
        if k in base:
            base[k] = v
        else:
            extra += [k, v]
    r = run(*[x for kv in base.items() for x in kv], *extra)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.part").exists()
