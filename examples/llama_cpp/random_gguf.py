"""A GGUF file with RANDOM weights in the shapes of a published Llama model, for measuring llama.cpp's
decode speed on the sizes people run. Random weights are exact about bytes and time (every layer's
matrices have the published shapes and the chosen type, so a decode step's layers read and multiply
what the real model's would; the vocabulary is smaller, see below) and say nothing of quality: the
text such a model writes is noise.

  python examples/llama_cpp/random_gguf.py --shape llama-3.2-1b|llama-3.2-3b|llama-3.1-8b \\
      --type f16|q4_0 --tokenizer-from SmolLM2-135M-Instruct.Q4_1.gguf --out OUT.gguf \\
      [--seed N] [--layers N] [--ctx N]

Shapes (the published config.json of each model; GGUF architecture "llama"):

  shape          layers  hidden  heads  kv heads  head_dim  FFN     rope     embeddings
  llama-3.2-1b   16      2048    32     8         64        8192    llama3   tied (no output.weight)
  llama-3.2-3b   28      3072    24     8         128       8192    llama3   tied (no output.weight)
  llama-3.1-8b   32      4096    32     8         128       14336   llama3   untied (output.weight)

  all: rope_theta 500000, RMS norm eps 1e-5; the llama3 RoPE scaling (low/high frequency factors 1
  and 4, 8192 original positions; factor 32 for Llama-3.2, 8 for Llama-3.1) is written as
  rope_freqs.weight, the per-frequency factors llama.cpp's convert_hf_to_gguf.py computes.

Vocabulary: not Llama-3's (128256 tokens) but SmolLM2's (49152): every `tokenizer.*` key of
--tokenizer-from is copied, and token_embd (and output) have that many rows, so the file tokenizes
and detokenizes like SmolLM2. The embedding and output matrices are 49152 rows instead of 128256,
which makes them smaller than the real model's (1B: 100.7M instead of 262.7M parameters); every
other tensor is the published size.

Types: --type f16: every 2-D weight f16 (token_embd and output too). --type q4_0: every 2-D weight
Q4_0, token_embd and output too (as llama.cpp's `llama-quantize --pure`; plain llama-quantize Q4_0
would make output.weight Q6_K). Norms and rope_freqs are f32 in both. Q4_0 is gguf's own numpy
quantizer (gguf.quants.quantize), F16 a numpy cast.

Values: normal with std 0.02 (norm weights 1.0) from numpy's default_rng(--seed), drawn tensor by
tensor in file order; each tensor is made, converted and written before the next is drawn
(GGUFWriter's add_tensor_info, then write_tensor_data one tensor at a time), and a tensor is drawn
4M values at a time, so memory holds one converted tensor, not the model (the 8B's largest,
token_embd and output, are 403 MB in f16, 113 MB in Q4_0; the 8B in f16 peaks at 0.5 GB).

--layers N overrides the layer count (a small file for tests); --ctx N is llama.context_length
(default 32768; the published models say 131072). The file is written to OUT.part and renamed.

Time (a 2-vCPU AMD EPYC guest with AVX-512, other builds running beside it; one core used): the
full llama-3.2-1b (1.074B parameters: the published 1.236B less the vocabulary rows not written)
in q4_0, 0.61 GB, 34 s (19 s of CPU); in f16, 2.15 GB, 31 s (16 s of CPU). Drawing the values
takes most of it; gguf's numpy Q4_0 quantizer costs ~3 s of CPU more than f16's cast. Memory
peaks at 0.2 GB (q4_0) and 0.3 GB (f16).
Reading --tokenizer-from takes ~2 s of each run (its 49152 tokens and 48900 merges).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

try:
    import gguf
    from gguf import GGMLQuantizationType, GGUFValueType
except ImportError:  # pragma: no cover - the error says what to install
    sys.exit("random_gguf.py needs the `gguf` package: pip install gguf")

# The published configs (config.json of meta-llama/Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B).
SHAPES = {
    "llama-3.2-1b": dict(name="Llama-3.2-1B", layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64,
                         ffn=8192, rope_theta=500000.0, rms_eps=1e-5, rope_factor=32.0, tied=True),
    "llama-3.2-3b": dict(name="Llama-3.2-3B", layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128,
                         ffn=8192, rope_theta=500000.0, rms_eps=1e-5, rope_factor=32.0, tied=True),
    "llama-3.1-8b": dict(name="Llama-3.1-8B", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                         ffn=14336, rope_theta=500000.0, rms_eps=1e-5, rope_factor=8.0, tied=False),
}
# llama3 RoPE scaling, the same in all three configs
ROPE_LOW_FREQ_FACTOR = 1.0
ROPE_HIGH_FREQ_FACTOR = 4.0
ROPE_ORIGINAL_CONTEXT = 8192
STD = 0.02
TYPES = {"f16": GGMLQuantizationType.F16, "q4_0": GGMLQuantizationType.Q4_0}
FILE_TYPES = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
CHUNK = 1 << 22  # values drawn (and quantised) at a time: 16 MB of f32


def rope_factors(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors), for rope_type llama3."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen = ROPE_ORIGINAL_CONTEXT / ROPE_LOW_FREQ_FACTOR
    high_wavelen = ROPE_ORIGINAL_CONTEXT / ROPE_HIGH_FREQ_FACTOR
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = ((ROPE_ORIGINAL_CONTEXT / wavelen - ROPE_LOW_FREQ_FACTOR)
                      / (ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR))
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def plan(shape: dict, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape (rows, columns), kind) of every tensor in file order; kind: 'matrix' (random,
    the chosen type), 'norm' (ones, f32) or 'rope' (rope_freqs, f32)."""
    h, f = shape["hidden"], shape["ffn"]
    q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    out = [("token_embd.weight", (vocab, h), "matrix"), ("rope_freqs.weight", (shape["head_dim"] // 2,), "rope")]
    for i in range(layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), "norm"), (b + "attn_q.weight", (q, h), "matrix"),
                (b + "attn_k.weight", (kv, h), "matrix"), (b + "attn_v.weight", (kv, h), "matrix"),
                (b + "attn_output.weight", (h, q), "matrix"), (b + "ffn_norm.weight", (h,), "norm"),
                (b + "ffn_gate.weight", (f, h), "matrix"), (b + "ffn_up.weight", (f, h), "matrix"),
                (b + "ffn_down.weight", (h, f), "matrix")]
    out.append(("output_norm.weight", (h,), "norm"))
    if not shape["tied"]:
        out.append(("output.weight", (vocab, h), "matrix"))
    return out


def matrix(rng: np.random.Generator, rows: int, cols: int, qtype: GGMLQuantizationType) -> np.ndarray:
    """A (rows, cols) matrix of N(0, STD^2) values in qtype, drawn CHUNK values at a time."""
    if qtype == GGMLQuantizationType.F16:
        out = np.empty((rows, cols), dtype=np.float16)
    else:
        out = np.empty(gguf.quant_shape_to_byte_shape((rows, cols), qtype), dtype=np.uint8)
    step = max(1, CHUNK // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        x = rng.standard_normal((n, cols), dtype=np.float32)
        x *= STD
        out[r:r + n] = x if qtype == GGMLQuantizationType.F16 else gguf.quants.quantize(x, qtype)
    return out


def copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> int:
    """Copies every tokenizer.* key/value; returns the vocabulary size (the token list's length)."""
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ValueError("has no tokenizer.ggml.tokens")
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, choices=list(SHAPES))
    ap.add_argument("--type", required=True, choices=list(TYPES))
    ap.add_argument("--tokenizer-from", required=True, metavar="GGUF",
                    help="a GGUF whose tokenizer.* keys are copied (SmolLM2's: scripts/fetch_smollm2.sh)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (small files for tests)")
    ap.add_argument("--ctx", type=int, default=32768, help="llama.context_length (default 32768)")
    a = ap.parse_args(argv)
    shape = SHAPES[a.shape]
    layers = shape["layers"] if a.layers is None else a.layers
    if layers < 1:
        ap.error(f"--layers must be at least 1 (got {a.layers})")
    if a.ctx < 1:
        ap.error(f"--ctx must be at least 1 (got {a.ctx})")
    if a.seed < 0:
        ap.error(f"--seed must be non-negative (got {a.seed})")
    if not os.path.isfile(a.tokenizer_from):
        ap.error(f"--tokenizer-from {a.tokenizer_from!r} is not a file (scripts/fetch_smollm2.sh fetches SmolLM2's)")
    qtype = TYPES[a.type]

    t0 = time.perf_counter()
    try:
        reader = gguf.GGUFReader(a.tokenizer_from)
    except Exception as e:  # not a GGUF file
        ap.error(f"--tokenizer-from {a.tokenizer_from!r} cannot be read as GGUF: {e}")
    part = a.out + ".part"
    writer = gguf.GGUFWriter(part, "llama")
    try:
        vocab = copy_tokenizer(reader, writer)
    except ValueError as e:
        ap.error(f"--tokenizer-from {a.tokenizer_from!r} {e}")
    del reader

    writer.add_name(f"{shape['name']} random weights (seed {a.seed})")
    writer.add_description(f"Random weights (normal, std {STD}) in the shapes of {shape['name']} with SmolLM2's "
                           "vocabulary, for speed measurements only: the model's text is noise.")
    writer.add_type("model")
    writer.add_block_count(layers)
    writer.add_context_length(a.ctx)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_rope_dimension_count(shape["head_dim"])
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(shape["rms_eps"])
    writer.add_vocab_size(vocab)
    writer.add_file_type(FILE_TYPES[a.type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tensors = plan(shape, layers, vocab)
    for name, shp, kind in tensors:
        if kind == "matrix":
            if qtype == GGMLQuantizationType.F16:
                writer.add_tensor_info(name, shp, np.dtype(np.float16), shp[0] * shp[1] * 2)
            else:
                bshape = gguf.quant_shape_to_byte_shape(shp, qtype)
                writer.add_tensor_info(name, bshape, np.dtype(np.uint8), bshape[0] * bshape[1], raw_dtype=qtype)
        else:
            writer.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    rng = np.random.default_rng(a.seed)
    n_params = 0
    for name, shp, kind in tensors:
        if kind == "matrix":
            data = matrix(rng, shp[0], shp[1], qtype)
        elif kind == "norm":
            data = np.ones(shp, dtype=np.float32)
        else:
            data = rope_factors(shape["head_dim"], shape["rope_theta"], shape["rope_factor"])
            assert data.shape == shp
        n_params += math.prod(shp)
        writer.write_tensor_data(data)
        del data
    writer.close()
    os.replace(part, a.out)
    dt = time.perf_counter() - t0
    size = os.path.getsize(a.out)
    print(f"{a.out}: {shape['name']} shape, {layers} layers, {a.type}, vocab {vocab}, "
          f"{n_params / 1e9:.3f}B parameters, {size / 1e9:.3f} GB, {dt:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
