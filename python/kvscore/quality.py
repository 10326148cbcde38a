"""Generation-level quality benchmark of KV-cache presses on a real decoder (docs/results/quality.md).

    bash scripts/fetch_smollm2.sh                       # SmolLM2-135M-Instruct (GGUF) into .models/
    python -m kvscore.quality --out quality-out         # the full run (docs/results/quality.md: ~2 h on 2 cores)
    python -m kvscore.quality --quick --out /tmp/q      # the CI smoke run (1 context, 2 ratios, <= 3 min)

SmolLM2-135M-Instruct runs through kvpress's own text-generation pipeline, as kvpress's
benchmarks run it (evaluation/evaluate.py: the context compressed during prefill, each question
answered after it from the compressed cache, greedy decoding, the answer removed from the cache
before the next question). Two tasks, on distracting text (Debian's license texts):

  needle        4 facts ("The blue safe opens with the combination 731.", 4 of 8 templates,
                random 3-digit numbers) planted at depths 10/35/60/85 % of a context of 1K-8K
                tokens; question "Which combination opens the blue safe?", answer prefix "The
                blue safe opens with the combination "; correct when the greedy answer (3 new
                tokens: SmolLM2 writes one token per digit) is the number.
  continuation  the mean negative log-likelihood (nats/token) of the 64 tokens of the text that
                follow the context, read from the compressed cache (teacher forced, positions
                after the full context as the pipeline numbers them); reported as the increase
                over the full cache.

Methods: every kvscore press (kvscore.presses; Q-Filters calibrated on other text, the
per-layer mix of `kvscore eval` with --mix) and kvpress's presses, ExpectedAttentionPress as
kvpress's benchmark registry builds it (AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))) and
alone. Compression ratios 0.25 / 0.5 / 0.75 / 0.9 (kvpress's: the fraction removed). Left out:
PyramidKVPress (its per-layer cache lengths break the pipeline's question forward with
transformers' one causal mask: "size of tensor a (811) must match ... b (837)"; kvpress needs
flash-attention for it), ObservedAttentionPress (eager attention: a 9 x N x N matrix per
layer), QFilterPress (downloads its filters; kvscore's qfilter is calibrated here instead).

Configurations that keep the same tokens (e.g. kvscore's and kvpress's StreamingLLM;
windowed-l2 is l2 below its 4096-token window) are answered once per context: attention does not depend on the order of the cache's rows (up to
float rounding). Their records say so ("same_as").

Shared prefill: the pipeline runs the press inside the prefill, through a forward hook on
every attention layer that compresses the layer's cache after the layer has attended, so the
prefill's hidden states do not depend on the press. The benchmark therefore runs the prefill
once per context, records what each hook receives, and replays each press's own forward_hook
on it (kvpress's code, the same arguments) before answering with the pipeline's own
generate_answer / _remove_answer_from_cache. tests/test_smollm2.py checks that this gives the
pipeline's answers and caches exactly; --no-shared-prefill calls the pipeline itself per
question (slow: one prefill per press, ratio and question).

Writes to --out: results.json (every record; a rerun with the same options resumes),
table.md (printed), plot.svg (accuracy and NLL increase against compression, per method).
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    # torch's OpenMP threads spin while they wait; on a shared, busy machine a 2-thread decode
    # step then took 10-12 s instead of 0.25 s (measured here). Sleeping waits cost little.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import dataclasses
import json
import math
import pathlib
import random
import time

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSES = pathlib.Path("/usr/share/common-licenses")
# Three disjoint sets of texts: the benchmark's haystack, Q-Filters' calibration, and what
# scripts/eval_smollm2.sh dumps for the evaluator (and the per-layer mix is chosen on).
HAYSTACK_TEXTS = ("GPL-3", "LGPL-2.1", "GFDL-1.3", "MPL-1.1", "GPL-2", "LGPL-2", "GFDL-1.2")
CALIB_TEXTS = ("Artistic", "CC0-1.0")
DUMP_TEXTS = ("Apache-2.0", "MPL-2.0", "LGPL-3", "GPL-1", "BSD")
RATIOS = (0.25, 0.5, 0.75, 0.9)
# Needle templates (fact, question, answer prefix), each with its own wording: a 135M model
# confused four facts that differed only in a name (the full cache answered 75 % of them,
# measured), and an engine's compression, not the model, is what the benchmark measures.
NEEDLES = (
    ("The secret code of the red door is {x}.", "What is the secret code of the red door?",
     "The secret code of the red door is "),
    ("Alice's lucky number is {x}.", "What is Alice's lucky number?", "Alice's lucky number is "),
    ("The train to Oslo leaves from platform {x}.", "From which platform does the train to Oslo leave?",
     "The train to Oslo leaves from platform "),
    ("The museum on Elm Street owns {x} paintings.", "How many paintings does the museum on Elm Street own?",
     "The museum on Elm Street owns "),
    ("Bob's apartment number is {x}.", "What is Bob's apartment number?", "Bob's apartment number is "),
    ("The old lighthouse is {x} feet tall.", "How tall is the old lighthouse?", "The old lighthouse is "),
    ("The blue safe opens with the combination {x}.", "Which combination opens the blue safe?",
     "The blue safe opens with the combination "),
    ("The village library keeps {x} rare maps.", "How many rare maps does the village library keep?",
     "The village library keeps "),
)
# Other templates for the dumps a per-layer mix is chosen on (workload_texts): the same kind of
# task, none of the benchmark's wording.
WORKLOAD_NEEDLES = (
    ("The green bicycle costs {x} dollars.", "How much does the green bicycle cost?", "The green bicycle costs "),
    ("Carol's flight number is {x}.", "What is Carol's flight number?", "Carol's flight number is "),
    ("The harbour crane lifts {x} tons.", "How many tons does the harbour crane lift?", "The harbour crane lifts "),
    ("The silver key opens locker {x}.", "Which locker does the silver key open?", "The silver key opens locker "),
)
DEPTHS = (0.10, 0.35, 0.60, 0.85)
CONTINUATION = 64        # tokens of the continuation task
MAX_NEW_TOKENS = 3       # the 3 digits ("... is " ends the prefix; SmolLM2 has one token per digit)
RESERVE = 128            # positions kept free after the context (question + answer, or the continuation)
QFILTER_CALIB_TOKENS = 1024
SINKS = 4                # first tokens every kvscore press keeps (the attention sink)
# kvpress's benchmark registry (evaluation/evaluate_registry.py) builds ExpectedAttentionPress
# with this epsilon inside AdaKVPress
EXPECTED_ATTENTION_EPSILON = 1e-2
THREADS = 1              # torch threads: on 2 shared cores 1 thread decoded 1.7x faster than 2 (measured)
# Retrieval rows (kvscore.generation.RetrievalCache): also these compressions (keys attended per
# step 5 % and 2 %), and a local window of min(RETRIEVAL_LOCAL, (budget - SINKS) // 2) tokens.
RETRIEVAL_RATIOS = (0.95, 0.98)
RETRIEVAL_LOCAL = 64
# OjaKV rows (kvscore.generation.OjaKVCache): key and value ranks (head_dim 64); the anchors'
# share is what brings the store to the row's memory (ojakv_anchor_share), where it can.
OJAKV_RANKS = (8, 16, 24, 32)
KVZIP_SCORING_RATIO = 0.5  # any ratio > 0 makes KVzipPress compute its scores, which do not depend on it
# kvscore's KVzip with AdaKV's safeguard: every head keeps at least this share of the average head's budget
KVZIP_SAFEGUARD = 0.2

# --- full / quick designs (docs/results/quality.md explains the choice: ~2 h on this 2-core machine)
FULL = {"lengths": (1024, 2048, 4096, 8192), "contexts": {1024: 3, 2048: 3, 4096: 3, 8192: 3}, "ratios": RATIOS,
        "calib_tokens": QFILTER_CALIB_TOKENS}
QUICK = {"lengths": (1024,), "contexts": {1024: 1}, "ratios": (0.5, 0.9), "calib_tokens": 512}


# ------------------------------------------------------------------ model

def find_model(path=None) -> pathlib.Path:
    """The SmolLM2 GGUF file: `path`, else $KVSCORE_SMOLLM2, else ./.models/<name>; a clear
    FileNotFoundError naming scripts/fetch_smollm2.sh otherwise."""
    cands = [path] if path else [os.environ.get("KVSCORE_SMOLLM2"), pathlib.Path(".models") / MODEL_NAME]
    for c in cands:
        if c and pathlib.Path(c).is_file():
            return pathlib.Path(c).resolve()
    raise FileNotFoundError(f"SmolLM2 GGUF not found ({', '.join(str(c) for c in cands if c)}): run "
                            "`bash scripts/fetch_smollm2.sh` (writes .models/" + MODEL_NAME + ") or pass --model")


@contextlib.contextmanager
def quiet_transformers():
    """No transformers warnings or progress bars while loading (the GGUF loader's tqdm too); also
    tools/dump_kv.py's."""
    from transformers.utils import logging as hf_logging

    level, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gguf_utils = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_utils is None:
        try:
            import transformers.modeling_gguf_pytorch_utils as gguf_utils
        except ImportError:
            gguf_utils = None
    bar_fn = getattr(gguf_utils, "tqdm", None)
    if bar_fn is not None:  # the GGUF loader's own tqdm bar (TQDM_DISABLE is read once, at import)
        gguf_utils.tqdm = lambda it, *a, **k: it
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()
        if bar_fn is not None:
            gguf_utils.tqdm = bar_fn


def load_model(path=None):
    """(model fp32 eval, tokenizer) of SmolLM2-135M-Instruct from its GGUF file
    (transformers' from_pretrained(dir, gguf_file=name); needs the gguf package)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = find_model(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True,
                                                     dtype=torch.float32)
    return model.eval(), tok


def license_text(names) -> str:
    missing = [n for n in names if not (LICENSES / n).is_file()]
    if missing:
        raise FileNotFoundError(f"the benchmark's texts are Debian's license texts: {LICENSES}/{missing[0]} is missing "
                                "(package base-files)")
    return "\n\n".join((LICENSES / n).read_text(errors="replace") for n in names)


# ------------------------------------------------------------------ tasks

@dataclasses.dataclass
class Context:
    length: int                    # nominal length (tokens)
    index: int                     # context number at this length
    text: str                      # the context (haystack with the needles)
    needles: list                  # [((fact, question, answer prefix) template, number, depth)]
    continuation: str              # the text that follows the context

    @property
    def key(self) -> str:
        return f"{self.length}:{self.index}"


def make_contexts(tok, lengths, contexts, seed: int = 0, depths=DEPTHS, texts=HAYSTACK_TEXTS, needles=NEEDLES):
    """The benchmark's contexts: for each nominal length L and i < contexts[L], a slice of the
    haystack token stream (a different offset per context) of L - RESERVE - needle tokens, the 4
    needles (distinct templates of `needles`, distinct random 3-digit numbers) inserted at DEPTHS, and the
    CONTINUATION tokens that follow the slice in the stream. Deterministic for a seed."""
    stream = tok.encode(license_text(texts), add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for L in lengths:
        for i in range(contexts[L]):
            kinds = rng.sample(range(len(needles)), len(depths))
            numbers = rng.sample(range(100, 1000), len(depths))
            planted = [(needles[k], x, d) for k, x, d in zip(kinds, numbers, depths)]
            facts = [" " + t[0].format(x=x) + " " for t, x, _ in planted]
            budget = L - RESERVE - sum(len(tok.encode(f, add_special_tokens=False)) for f in facts) - 40
            need = budget + CONTINUATION
            if need > len(stream):
                raise ValueError(f"the haystack has {len(stream)} tokens, fewer than the {need} a context of {L} needs")
            start = (rng.randrange(len(stream)) + i * 7919) % len(stream)
            ids = (stream + stream)[start:start + need]  # wraps around the end of the stream
            hay, cont = ids[:budget], ids[budget:]
            pieces, last = [], 0
            for (_, _, d), fact in zip(planted, facts):
                pos = int(len(hay) * d)
                pieces += [tok.decode(hay[last:pos]), fact]
                last = pos
            pieces.append(tok.decode(hay[last:]))
            out.append(Context(L, i, "".join(pieces), planted, tok.decode(cont)))
    return out


def questions(ctx: Context):
    """[(question, answer_prefix, expected)] of a context's needles."""
    return [(t[1], t[2], str(x)) for t, x, _ in ctx.needles]


def workload_texts(tok, length: int, seed: int = 1):
    """(context, following) of the benchmark's kind on other text, for choosing a per-layer mix
    on a dump (scripts/eval_smollm2.sh: dump_kv.py --text context --following-text following
    --no-special-tokens): a context of DUMP_TEXTS with the 4 WORKLOAD_NEEDLES, wrapped in the chat
    template exactly as kvpress's pipeline wraps it, and the 4 questions, each with the
    pipeline's question suffix, the answer prefix and the right answer (whose queries are the
    ones that must find the needle)."""
    c = make_contexts(tok, [length], {length: 1}, seed=seed, texts=DUMP_TEXTS, needles=WORKLOAD_NEEDLES)[0]
    sep = "#" * (len(c.text) + 10)  # KVPressTextGenerationPipeline.preprocess's split of the template
    full = tok.apply_chat_template([{"role": "user", "content": c.text + sep}], add_generation_prompt=True,
                                   tokenize=False)
    context, suffix = full.split(sep)
    following = "".join(f"{q}{suffix}{prefix}{expected}.\n" for q, prefix, expected in questions(c))
    return context, following


# ------------------------------------------------------------------ methods

def post_rope_queries(module, hidden_states, position_embeddings):
    """The post-RoPE queries [batch, q_heads, n, head_dim] an attention layer computes from its
    input (what the layer attends with)."""
    import torch
    from kvpress.utils import get_prerope_query_states

    q = get_prerope_query_states(module, hidden_states)
    cos, sin = position_embeddings
    half = q.shape[-1] // 2
    return q * cos.unsqueeze(1) + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin.unsqueeze(1)


def qfilter_filters(model, tok, tokens: int = QFILTER_CALIB_TOKENS):
    """Q-Filters [layers, kv_heads, head_dim] (kvscore convention) calibrated on other text
    (CALIB_TEXTS, never the haystack): the post-RoPE queries of every position, per layer,
    through kvscore.calibrate_qfilters."""
    import torch

    import kvscore

    lm = model.model
    ids = tok.encode(license_text(CALIB_TEXTS), add_special_tokens=False, return_tensors="pt")[:, :tokens]
    qs = {}

    def hook(module, args, kwargs):
        q = post_rope_queries(module, kwargs["hidden_states"], kwargs["position_embeddings"])
        qs[module.layer_idx] = q[0].float().contiguous()

    hs = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in lm.layers]
    try:
        with torch.inference_mode():
            lm(input_ids=ids)
    finally:
        for h in hs:
            h.remove()
    kv_heads = model.config.num_key_value_heads
    return torch.stack([kvscore.calibrate_qfilters(qs[i], kv_heads) for i in range(len(lm.layers))])


def method_table(filters=None, mix=None):
    """name -> (family, factory(ratio) -> press). kvscore presses keep the first SINKS tokens
    (SmolLM2's first token takes over half the attention in layers 10-29; ExpectedAttention and
    StreamingLLM keep 4 too) and use kvscore's tie rule and positional order; kvscore:l2-nosinks
    is ManifoldKV as the paper runs it. kvpress's K-norm, KeyDiff and SnapKV are kvscore's
    without sinks (the same kept tokens, tests/test_smollm2.py). kvpress presses are configured
    as its benchmark registry does (evaluation/evaluate_registry.py) where it lists them."""
    import kvpress as kp

    import kvscore as kv
    from kvscore import _kvscore
    from kvscore import presses as ks

    # labels are the registry's CLI spellings (kvscore eval's report names), as docs/results/quality.md prints them
    cli = {m["name"]: m["cli"] for m in kv.REGISTRY}
    knorm, keydiff, l2, wl2 = kv.KNorm.name, kv.KeyDiff.name, kv.ManifoldL2.name, kv.WindowedManifoldL2.name
    snap, proto, stream, qf = kv.SnapKV.name, kv.ProtoKV.name, kv.StreamingLLM.name, kv.QFilter.name
    zip_ = kv.KVzip.name
    ours = lambda m, tail="": "kvscore:" + cli[m] + tail  # noqa: E731
    theirs = lambda m: "kvpress:" + cli[m]  # noqa: E731
    s, w = SINKS, _kvscore.kDefaultSnapKVWindow
    t = {
        ours(knorm): ("kvscore", lambda r: ks.KvscorePress(knorm, r, sinks=s)),
        ours(keydiff): ("kvscore", lambda r: ks.KvscorePress(keydiff, r, sinks=s)),
        ours(l2): ("kvscore", lambda r: ks.ManifoldKVPress(r, sinks=s)),
        ours(l2, "-nosinks"): ("kvscore", lambda r: ks.ManifoldKVPress(r)),
        ours(wl2): ("kvscore", lambda r: ks.WindowedManifoldKVPress(r, sinks=s)),
        ours(snap): ("kvscore", lambda r: ks.KvscorePress(snap, r, window=w, sinks=s)),
        ours(proto): ("kvscore", lambda r: ks.ProtoKVPress(r, window=w, sinks=s)),
        ours(stream): ("kvscore", lambda r: ks.KvscorePress(stream, r, sinks=s)),
        ours(keydiff, "-adakv"): ("kvscore", lambda r: ks.KvscorePress(keydiff, r, sinks=s, alloc="adakv")),
        ours(l2, "-adakv"): ("kvscore", lambda r: ks.ManifoldKVPress(r, sinks=s, alloc="adakv")),
        # KVzip (docs/methods/kvzip.md): kvpress's KVzipPress's kept rows (tested), KVzip+, and what kvscore's
        # version adds: AdaKV's safeguard, the chat template's prefix scored, one set of positions for
        # every head and layer (llama.cpp's cells; the rows are removed: memory 1 - ratio)
        ours(zip_): ("kvscore", lambda r: ks.KVzipPress(r)),
        ours(zip_, "_plus"): ("kvscore", lambda r: ks.KVzipPress(r, kvzip_plus=True)),
        ours(zip_, "-safeguard"): ("kvscore", lambda r: ks.KVzipPress(r, alpha=KVZIP_SAFEGUARD)),
        ours(zip_, "-prefix"): ("kvscore", lambda r: ks.KVzipPress(r, score_prefix=True)),
        ours(zip_, "-joint"): ("kvscore", lambda r: ks.KVzipPress(r, alloc="joint")),
    }
    if filters is not None:
        t[ours(qf)] = ("kvscore", lambda r: ks.KvscorePress(qf, r, filters=filters, sinks=s))
    mixes = {"mix": mix} if isinstance(mix, (str, pathlib.Path)) else dict(mix or {})
    for name, path in mixes.items():  # the report's own sinks / recent / alloc
        t[f"kvscore:{name}"] = ("kvscore", lambda r, path=path: ks.PerLayerPress.from_report(path, r, filters=filters,
                                                                                             window=w))
    t.update({
        "kvpress:random": ("kvpress", lambda r: kp.RandomPress(compression_ratio=r, seed=0)),
        theirs(knorm): ("kvpress", lambda r: kp.KnormPress(compression_ratio=r)),
        theirs(keydiff): ("kvpress", lambda r: kp.KeyDiffPress(compression_ratio=r)),
        theirs(stream): ("kvpress", lambda r: kp.StreamingLLMPress(compression_ratio=r)),
        theirs(snap): ("kvpress", lambda r: kp.SnapKVPress(compression_ratio=r)),
        "kvpress:tova": ("kvpress", lambda r: kp.TOVAPress(compression_ratio=r)),
        "kvpress:adakv_keydiff": ("kvpress", lambda r: kp.AdaKVPress(kp.KeyDiffPress(compression_ratio=r))),
        "kvpress:expected_attention": (
            "kvpress", lambda r: kp.AdaKVPress(kp.ExpectedAttentionPress(compression_ratio=r,
                                                                         epsilon=EXPECTED_ATTENTION_EPSILON))),
        "kvpress:expected_attention_plain": ("kvpress", lambda r: kp.ExpectedAttentionPress(compression_ratio=r)),
        # KVzip (context reconstruction) and KVzip+ (its normalisation), kvpress's strongest presses by its
        # maintainers; Compactor (leverage scores + non-causal chunked attention). FastKVzipPress and
        # KVzapPress load weights trained per model from the model hub, which is unreachable here.
        theirs(zip_): ("kvpress", lambda r: KVzipRow(False, r)),
        theirs(zip_) + "_plus": ("kvpress", lambda r: KVzipRow(True, r)),
        "kvpress:compactor": ("kvpress", lambda r: kp.CompactorPress(compression_ratio=r)),
    })
    # Decode-time caches (kvscore.generation): per-query retrieval and OjaKV's low-rank store.
    paris = next(m["name"] for m in kv.REGISTRY if m["kind"] == "retriever")
    t[ours(paris)] = ("kvscore", lambda r: CacheRow("retrieval", r, method=paris))
    t["kvscore:exact-topk"] = ("kvscore", lambda r: CacheRow("retrieval", r, method="exact"))
    oja = next(m["name"] for m in kv.REGISTRY if m["kind"] == "hybrid")
    for rank in OJAKV_RANKS:
        t[ours(oja, f"-r{rank}")] = ("kvscore", lambda r, rank=rank: CacheRow("hybrid", r, rank=rank))
    return t


# ------------------------------------------------------------------ rows that are not presses

def _retrieval_row(factory) -> bool:
    """Whether a method_table factory builds a retrieval row (which runs RETRIEVAL_RATIOS too)."""
    x = factory(RATIOS[0])
    return isinstance(x, CacheRow) and x.kind == "retrieval"


@dataclasses.dataclass
class CacheRow:
    """A configuration answered from a kvscore.generation cache instead of a press: the prompt's
    exact prefill loaded into the cache (or run through it), then the pipeline's own
    generate_answer per question, the answer cropped off after each (Cache.crop).

    retrieval: RetrievalCache(method), budget_from_ratio(n, 1 - ratio) keys attended per step
    (SINKS sinks, a local window of min(RETRIEVAL_LOCAL, (budget - SINKS) // 2), the rest
    retrieved per query); memory stays the full cache plus the index. hybrid: OjaKVCache at key
    and value rank `rank` with as many anchors as bring its memory to 1 - ratio of the full
    cache (ojakv_anchors; None where no count can); every key attended."""

    kind: str
    ratio: float
    method: str = ""
    rank: int = 0

    def make(self, model, n: int):
        """The empty cache for a context of n tokens, or None when the row cannot reach its ratio."""
        from . import generation as kg

        from . import budget_from_ratio

        if self.kind == "retrieval":
            budget = budget_from_ratio(n, 1 - self.ratio)
            local = min(RETRIEVAL_LOCAL, (budget - SINKS) // 2)
            # dense_below=0: every step retrieves, also below the speed threshold (a quality row)
            return kg.RetrievalCache(model, self.method, attend=budget, sinks=SINKS, local=local, dense_below=0)
        d = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
        count = ojakv_anchors(n, 1 - self.ratio, d, self.rank, model.dtype.itemsize, SINKS + kg.OJAKV_WINDOW)
        if count is None:
            return None
        return kg.OjaKVCache(model, rank=self.rank, anchors=count, sinks=SINKS)

    def attended(self, n: int) -> float:
        """Keys attended per decode step, as a fraction of the context."""
        from . import budget_from_ratio

        return budget_from_ratio(n, 1 - self.ratio) / n if self.kind == "retrieval" else 1.0

    def build(self, model, context_ids, prefill=None):
        """The cache holding the context: loaded from a SharedPrefill (the same keys, values and
        queries the prefill computed), or prefilled through the cache itself without one."""
        import torch

        cache = self.make(model, int(context_ids.shape[1]))
        if cache is None:
            return None
        for layer in model.model.layers:  # no head-wise mask of an earlier kvpress press applies
            layer.self_attn.masked_key_indices = None
        if prefill is None:
            model.model(input_ids=context_ids, past_key_values=cache)
            return cache
        from . import generation as kg

        for i in range(len(model.model.layers)):
            module, kw, _, k, v = prefill.records[i]
            q = post_rope_queries(module, kw["hidden_states"][:, -kg.OJAKV_WINDOW:],
                                  tuple(x[:, -kg.OJAKV_WINDOW:] for x in kw["position_embeddings"]))
            cache.prefill(i, k, v, q.to(torch.float32))
        return cache


def ojakv_anchors(n: int, memory: float, head_dim: int, rank: int, bytes_per_scalar: int, protected: int):
    """Full-rank anchors per KV head that bring an OjaKV store of n tokens at key and value rank
    `rank` to at most `memory` of the full cache (docs/methods/ojakv.md, Definitions 11: (n - a)·2r·b +
    a·(2d·b + 4) + d·2r·b <= memory·n·2d·b), the largest such count; None when even the
    protected tokens (sinks and the residual rule's window) exceed it."""
    d, r, b = head_dim, rank, bytes_per_scalar
    a = (memory * n * 2 * d * b - n * 2 * r * b - d * 2 * r * b) // (2 * d * b + 4 - 2 * r * b)
    a = min(n, int(a))
    return a if a >= min(n, protected) else None


@dataclasses.dataclass
class KVzipRow:
    """kvpress's KVzipPress at one ratio. KVzip scores every context token by how much the model
    attends to it while reconstructing the context (a second forward of the whole context,
    chunked), then masks the lowest scores over all layers and heads (kvpress's fake
    compression, as AdaKV). The scores do not depend on the ratio: run_context computes them
    once per context and variant through the press's own code (kvzip_scores), and each ratio
    applies the press's own compress_post to the shared prefill's cache."""

    plus: bool
    ratio: float


@contextlib.contextmanager
def _kvzip_tokenizer(tok):
    """KVzipPress loads the tokenizer by the model's name_or_path, which a GGUF-loaded model
    does not resolve to tokenizer files: hand it the loaded one."""
    import logging

    from kvpress.presses import kvzip_press

    class _Tok:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return tok

    old, log = kvzip_press.AutoTokenizer, logging.getLogger(kvzip_press.__name__)
    level = log.level
    kvzip_press.AutoTokenizer = _Tok
    log.setLevel(logging.ERROR)  # its "2-3 times the prefilling cost" warning, once per press
    try:
        yield
    finally:
        kvzip_press.AutoTokenizer = old
        log.setLevel(level)


def kvzip_scores(model, tok, context_ids, plus: bool):
    """KVzip's scores [layers, 1, kv_heads, n] of a context: the press's own prefill and
    reconstruction, stopped before its compress_post."""
    import torch
    from kvpress import KVzipPress
    from transformers import DynamicCache

    got = {}

    class _Scores(KVzipPress):
        def compress_post(self, model):
            got["scores"] = self.score_val.clone()

    with _kvzip_tokenizer(tok):
        press = _Scores(compression_ratio=KVZIP_SCORING_RATIO, kvzip_plus_normalization=plus)
        with torch.inference_mode(), press(model):
            model.model(input_ids=context_ids, past_key_values=DynamicCache())
    return got["scores"]


def kvzip_apply(model, scores, plus: bool, ratio: float):
    """KVzipPress(ratio)'s compress_post on given scores: the masks it leaves on the modules."""
    from kvpress import KVzipPress

    with _kvzip_tokenizer(None):
        press = KVzipPress(compression_ratio=ratio, kvzip_plus_normalization=plus)
    press.score_val = scores.clone()
    press.compress_post(model)


# ------------------------------------------------------------------ one prefill, replayed per press

class SharedPrefill:
    """The context's prefill without a press, with what kvpress's forward hook receives on each
    attention layer recorded (module, kwargs, output, the layer's full keys and values), so that
    any press's forward_hook can be replayed on it: replay(press) returns the cache the pipeline's
    prefill `with press(model): model.model(context_ids, past_key_values=cache)` leaves."""

    def __init__(self, model, context_ids):
        import torch
        from transformers import DynamicCache

        self.model = model
        lm = model.model
        self.records = []

        def record(module, args, kwargs, output):
            layer = kwargs["past_key_values"].layers[module.layer_idx]
            kw = {k: v for k, v in kwargs.items() if k != "past_key_values"}
            self.records.append((module, kw, output, layer.keys, layer.values))

        hooks = [layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in lm.layers]
        try:
            with torch.inference_mode():
                lm(input_ids=context_ids, past_key_values=DynamicCache())
        finally:
            for h in hooks:
                h.remove()
        self.context_length = int(context_ids.shape[1])
        self.context_ids = context_ids

    def replay(self, press):
        import torch
        from transformers import DynamicCache

        cache = DynamicCache()
        lm = self.model.model
        if press is not None:  # what BasePress.__call__ does before the forward
            press.post_init_from_model(self.model)
            for layer in lm.layers:
                layer.self_attn.rotary_emb = lm.rotary_emb
        with torch.inference_mode():
            for module, kw, output, k, v in self.records:
                module.masked_key_indices = None  # kvpress's attention patch resets it at every prefill
                cache.update(k, v, module.layer_idx)
                if press is not None:
                    press.forward_hook(module, (), dict(kw, past_key_values=cache), output)
        return cache


def kept_tokens(model, cache) -> float:
    """Mean tokens per (layer, KV head) the cache really attends to: its length, less the keys
    AdaKV-style presses mask (module.masked_key_indices)."""
    lens = []
    for i, layer in enumerate(model.model.layers):
        n = cache.layers[i].keys.shape[2]
        heads = cache.layers[i].keys.shape[0] * cache.layers[i].keys.shape[1]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        lens.append(n - (len(masked[0]) / heads if masked is not None else 0))
    return sum(lens) / len(lens)


def cache_fingerprint(model, cache) -> str:
    """A hash of the set of (layer, head, key row) the cache attends to, independent of the
    rows' order (kvscore keeps positions ascending, kvpress in score order) and without the keys
    AdaKV-style presses mask."""
    import hashlib

    import torch

    h = hashlib.sha1()
    for i, layer in enumerate(model.model.layers):
        k = cache.layers[i].keys[0].contiguous()  # [H, n, d]
        w = torch.arange(1, k.shape[-1] + 1, dtype=torch.int64) * 1000003
        sig = (k.view(torch.int32).to(torch.int64) * w).sum(-1)  # a row signature (wraps: a hash)
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        keep = torch.ones_like(sig, dtype=torch.bool)
        if masked is not None:
            keep[masked[1], masked[2]] = False
        for hh in range(sig.shape[0]):
            h.update(torch.sort(sig[hh][keep[hh]]).values.numpy().tobytes())
            h.update(b"|")
    return h.hexdigest()


def continuation_nll(model, cache, context_length: int, cont_ids) -> float:
    """Mean NLL (nats/token) of cont_ids[1:] given the cache and cont_ids, at the positions
    after the full context (as the pipeline numbers the question); the cache is restored."""
    import torch

    lens = [cache.get_seq_length(i) for i in range(len(cache))]
    pos = torch.arange(context_length, context_length + cont_ids.shape[1]).unsqueeze(0)
    with torch.inference_mode():
        logits = model(input_ids=cont_ids, past_key_values=cache, position_ids=pos).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, cont_ids[0, 1:], reduction="mean").item()
    restore(cache, lens)
    return nll


def restore(cache, lens):
    """Drops what a question, its answer or the continuation added: kvscore.generation's caches
    crop (Cache.crop), the others as kvpress's pipeline does (_remove_answer_from_cache)."""
    if hasattr(cache, "prefill"):  # a kvscore.generation cache
        cache.crop(lens[0])
        return
    for i, n in enumerate(lens):
        cache.layers[i].keys = cache.layers[i].keys[:, :, :n]
        cache.layers[i].values = cache.layers[i].values[:, :, :n]


def run_context(pipe, ctx: Context, configs, shared: bool = True, progress=None, dedupe: bool = True):
    """Records of one context for every (method, ratio) in configs (plus the full cache,
    method "none"): per needle {task: needle, correct, answer}, and one {task: continuation, nll},
    each with the two axes: memory (the fraction of the full cache's K/V bytes the configuration
    holds) and attended (keys attended per decode step, as a fraction of the context).
    dedupe: a press whose cache keeps the same tokens as an earlier one (same cache_fingerprint)
    reuses its answers (record "same_as")."""
    import torch

    model, tok = pipe.model, pipe.tokenizer
    qs = questions(ctx)
    maxlen = model.config.max_position_embeddings
    inputs = [pipe.preprocess(ctx.text, [q], prefix, maxlen) for q, prefix, _ in qs]
    context_ids = inputs[0]["context_ids"]
    n = int(context_ids.shape[1])
    cont_ids = tok.encode(ctx.continuation, add_special_tokens=False, return_tensors="pt")[:, :CONTINUATION]
    if n + max(CONTINUATION, max(i["questions_ids"][0].shape[1] for i in inputs) + MAX_NEW_TOKENS) > maxlen:
        raise ValueError(f"context {ctx.key}: {n} tokens leave too few of the model's {maxlen} positions")
    t_pre = time.perf_counter()
    prefill = SharedPrefill(model, context_ids) if shared else None
    t_pre = time.perf_counter() - t_pre
    records, seen, kvzip, timing = [], {}, {}, {}
    for method, ratio, make in [("none", 0.0, lambda: None)] + list(configs):
        t0 = time.perf_counter()
        spec = make()
        extra = {"prefill_s": t_pre} if method == "none" and shared else {}
        if getattr(spec, "_kvzip", None) is not None:  # kvscore's KVzip: the loaded model's tokenizer
            spec._kvzip["tokenizer"] = spec._kvzip["tokenizer"] or tok
        with torch.inference_mode():
            if isinstance(spec, CacheRow):
                cache = spec.build(model, context_ids, prefill)
                if cache is None:  # the row cannot reach this ratio (OjaKV's protected anchors)
                    if progress is not None:
                        progress(method, ratio)
                    continue
                memory, attended = cache.memory_bytes() / cache.full_memory_bytes(), spec.attended(n)
            elif isinstance(spec, KVzipRow) and shared:
                if spec.plus not in kvzip:
                    t1 = time.perf_counter()
                    kvzip[spec.plus] = kvzip_scores(model, tok, context_ids, spec.plus)
                    timing[("kvpress", spec.plus)] = {"kvzip_total_s": time.perf_counter() - t1}
                cache = prefill.replay(None)
                kvzip_apply(model, kvzip[spec.plus], spec.plus, spec.ratio)
                extra = timing[("kvpress", spec.plus)]
            elif shared and getattr(spec, "_kvzip", None) is not None:  # kvscore's KVzip: scores once per variant
                from . import presses as ks

                o = spec._kvzip
                key = ("kvscore", o["plus"], o["score_prefix"], o["chunk_size"], spec.sinks)
                if key not in kvzip:
                    t = {}
                    kvzip[key] = ks.kvzip_scores(spec, model, context_ids, prefill.replay(None), t)
                    timing[key] = {"reconstruct_s": t["forward"] - t["scoring"], "scoring_s": t["scoring"]}
                cache = prefill.replay(None)
                ks.kvzip_apply(spec, model, cache, ks.kvzip_select(spec, kvzip[key]))
                extra = timing[key]
            elif shared:
                cache = prefill.replay(spec)
                fp = cache_fingerprint(model, cache) if dedupe else None
                if fp in seen:  # the same kept tokens as an earlier configuration: its answers
                    first = seen[fp]
                    for r in first:
                        records.append(dict(r, method=method, ratio=ratio, same_as=f"{r['method']}@{r['ratio']:g}",
                                            seconds=time.perf_counter() - t0))
                    if progress is not None:
                        progress(method, ratio)
                    continue
            if shared or isinstance(spec, CacheRow):
                answers = []
                for inp in inputs:  # KVPressTextGenerationPipeline._forward's loop
                    lens = [cache.get_seq_length(i) for i in range(len(cache))]
                    answers.append(pipe.generate_answer(inp["questions_ids"][0], cache, n, MAX_NEW_TOKENS))
                    restore(cache, lens)
            else:  # the pipeline itself, one prefill per question (KVzip: its own press, its whole algorithm)
                answers = []
                for q, prefix, _ in qs:
                    from kvpress import KVzipPress
                    from transformers import DynamicCache

                    cache = DynamicCache()
                    with _kvzip_tokenizer(tok):
                        press = KVzipPress(compression_ratio=spec.ratio, kvzip_plus_normalization=spec.plus) \
                            if isinstance(spec, KVzipRow) else spec
                        answers.append(pipe(ctx.text, question=q, answer_prefix=prefix, press=press,
                                            max_new_tokens=MAX_NEW_TOKENS, cache=cache)["answer"])
            if not isinstance(spec, CacheRow):
                kept = kept_tokens(model, cache)
                memory = attended = kept / n
            nll = continuation_nll(model, cache, n, cont_ids)
        secs = time.perf_counter() - t0
        base = {"method": method, "ratio": ratio, "length": ctx.length, "context": ctx.index, "tokens": n,
                "kept": attended * n, "memory": memory, "attended": attended, "seconds": secs, **extra}
        mine = [dict(base, task="needle", depth=depth, expected=expected, answer=a, correct=expected in a)
                for (q, _, expected), (_, _, depth), a in zip(qs, ctx.needles, answers)]
        mine.append(dict(base, task="continuation", nll=nll))
        records += mine
        if shared and dedupe and not isinstance(spec, (CacheRow, KVzipRow)):
            seen[fp] = mine
        if progress is not None:
            progress(method, ratio)
    return records


# ------------------------------------------------------------------ summary, table, plot

def summarize(records):
    """{method: {ratio: {"accuracy", "n", "dnll", "memory", "attended", "by_length": {L: accuracy}}}};
    dnll is the mean NLL increase over the full cache of the same context, memory and attended the
    mean fractions of the full cache held and of the context attended per step (records before
    these fields: the kept fraction, both)."""
    base = {(r["length"], r["context"]): r["nll"] for r in records if r["task"] == "continuation" and r["method"] == "none"}
    out = {}
    for r in records:
        s = out.setdefault(r["method"], {}).setdefault(r["ratio"], {"ok": 0, "n": 0, "d": [], "len": {}, "mem": [],
                                                                     "att": []})
        if r["task"] == "needle":
            s["mem"].append(r.get("memory", r["kept"] / r["tokens"]))
            s["att"].append(r.get("attended", r["kept"] / r["tokens"]))
            s["ok"] += r["correct"]
            s["n"] += 1
            a = s["len"].setdefault(r["length"], [0, 0])
            a[0] += r["correct"]
            a[1] += 1
        elif (r["length"], r["context"]) in base:
            s["d"].append(r["nll"] - base[(r["length"], r["context"])])
    res = {}
    for m, by_ratio in out.items():
        for ratio, s in by_ratio.items():
            res.setdefault(m, {})[ratio] = {
                "accuracy": s["ok"] / s["n"] if s["n"] else float("nan"), "n": s["n"],
                "dnll": sum(s["d"]) / len(s["d"]) if s["d"] else float("nan"),
                "memory": sum(s["mem"]) / len(s["mem"]) if s["mem"] else float("nan"),
                "attended": sum(s["att"]) / len(s["att"]) if s["att"] else float("nan"),
                "by_length": {L: a[0] / a[1] for L, a in sorted(s["len"].items())}}
    return res


def _order(summary):
    """Methods: none first, then kvscore, then kvpress, each by mean accuracy (best first)."""
    def mean_acc(m):
        v = [x["accuracy"] for r, x in summary[m].items() if r > 0]
        return -sum(v) / len(v) if v else 0.0
    ms = [m for m in summary if m != "none"]
    return (["none"] if "none" in summary else []) + sorted(ms, key=lambda m: (not m.startswith("kvscore"), mean_acc(m), m))


def table(summary, ratios) -> str:
    """Markdown: needle accuracy per method and compression ratio, then the NLL increase."""
    ms = _order(summary)
    head = "| method | " + " | ".join(f"acc @ {r:g}" for r in ratios) + " | " + \
        " | ".join(f"ΔNLL @ {r:g}" for r in ratios) + " |\n"
    head += "| --- |" + " ---: |" * (2 * len(ratios)) + "\n"
    rows = []
    for m in ms:
        cells = []
        for key in ("accuracy", "dnll"):
            for r in ratios:
                x = summary[m].get(r if m != "none" else 0.0)
                v = x[key] if x else float("nan")
                cells.append("—" if math.isnan(v) else (f"{v:.3f}" if key == "accuracy" else f"{v:+.3f}"))
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    n = next(iter(summary.values()), {})
    nq = next(iter(n.values()), {}).get("n", 0)
    return head + "\n".join(rows) + f"\n\n({nq} needle questions per cell; ΔNLL: nats/token over the full cache)\n"


def table_axes(summary, ratios) -> str:
    """Markdown: the two axes per method and compression ratio, "memory / attended" (fractions of
    the full cache's K/V bytes held, and of the context's keys attended per decode step)."""
    ms = _order(summary)
    out = "| method | " + " | ".join(f"mem / att @ {r:g}" for r in ratios) + " |\n"
    out += "| --- |" + " ---: |" * len(ratios) + "\n"
    for m in ms:
        if m == "none":
            continue
        cells = []
        for r in ratios:
            x = summary[m].get(r)
            cells.append("—" if not x or math.isnan(x["memory"]) else f"{x['memory']:.2f} / {x['attended']:.2f}")
        out += f"| {m} | " + " | ".join(cells) + " |\n"
    return out


def best_by_axis(summary, ratios) -> str:
    """Markdown: per ratio, the most accurate kvscore and kvpress configuration on each axis,
    comparing like with like: on the memory axis what holds at most 1 - ratio of the full cache
    (eviction, OjaKV), on the attention axis what attends at most 1 - ratio of the context per
    step (eviction and retrieval)."""
    def best(prefix, r, key):
        c = [(x["accuracy"], m) for m in summary if m.startswith(prefix) for rr, x in summary[m].items()
             if rr == r and x[key] <= 1 - r + 0.01 and not math.isnan(x["accuracy"])]
        return max(c) if c else None

    out = "| compression | axis | kvscore's best | kvpress's best |\n| ---: | --- | --- | --- |\n"
    for r in ratios:
        for key, axis in (("memory", "memory"), ("attended", "keys attended")):
            a, b = best("kvscore:", r, key), best("kvpress:", r, key)
            fmt = lambda x: "—" if x is None else f"{x[1][8:]} {x[0]:.3f}"  # noqa: E731
            out += f"| {r:g} | {axis} | {fmt(a)} | {fmt(b)} |\n"
    return out


def table_by_length(summary, ratio) -> str:
    """Markdown: needle accuracy per method and context length at one compression ratio."""
    lengths = sorted({L for m in summary.values() for x in m.values() for L in x["by_length"]})
    out = f"| method (compression {ratio:g}) | " + " | ".join(f"{L} tok" for L in lengths) + " |\n"
    out += "| --- |" + " ---: |" * len(lengths) + "\n"
    for m in _order(summary):
        x = summary[m].get(ratio if m != "none" else 0.0)
        if not x:
            continue
        out += f"| {m} | " + " | ".join(f"{x['by_length'][L]:.2f}" if L in x["by_length"] else "—"
                                        for L in lengths) + " |\n"
    return out


def svg_plot(series, title, panels) -> str:
    """A small standalone SVG line plot: panels = [(title, xlabel, key, (lo, hi))], series =
    {name: {"points": {panel key: [(x, y)]}, "dash": bool}}. Every point has a tooltip."""
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
               "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
               "#e6550d", "#31a354", "#756bb1", "#636363", "#fd8d3c", "#74c476"]
    pw, ph, top, left, gap = 420, 300, 50, 70, 90
    names = list(series)
    W = left + len(panels) * (pw + gap)
    cols = max(1, (W - left) // 250)
    legend_rows = (len(names) + cols - 1) // cols
    H = top + ph + 70 + 18 * legend_rows
    esc = lambda s: str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
         '<rect width="100%" height="100%" fill="white"/>',
         f'<text x="{W / 2:.0f}" y="22" text-anchor="middle" font-size="15">{esc(title)}</text>']
    for p, (ptitle, xlabel, key, (lo, hi)) in enumerate(panels):
        x0, y0 = left + p * (pw + gap), top
        xs = sorted({x for s in series.values() for x, _ in s["points"].get(key, [])}) or [0, 1]
        xmin, xmax = xs[0], xs[-1]
        if xmax - xmin < 1e-9:
            xmin, xmax = xmin - 0.5, xmax + 0.5
        X = lambda x: x0 + (x - xmin) / (xmax - xmin) * pw
        Y = lambda y: y0 + ph - (min(max(y, lo), hi) - lo) / (hi - lo) * ph
        o.append(f'<text x="{x0 + pw / 2:.0f}" y="{y0 - 10}" text-anchor="middle">{esc(ptitle)}</text>')
        o.append(f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
        for t in range(5):
            v = lo + (hi - lo) * t / 4
            o.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="#ddd"/>')
            o.append(f'<text x="{x0 - 5}" y="{Y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
        step = 1 if len(xs) <= 12 else 5  # many x values (layers): every 5th labelled
        for i, x in enumerate(xs):
            if i % step == 0 or i == len(xs) - 1 and step == 1:
                o.append(f'<text x="{X(x):.1f}" y="{y0 + ph + 16}" text-anchor="middle">{x:g}</text>')
        o.append(f'<text x="{x0 + pw / 2:.0f}" y="{y0 + ph + 34}" text-anchor="middle">{esc(xlabel)}</text>')
        for i, name in enumerate(names):
            pts = sorted(series[name]["points"].get(key, []))
            if not pts:
                continue
            c = colours[i % len(colours)]
            dash = ' stroke-dasharray="6,3"' if series[name].get("dash") else ""
            o.append(f'<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="'
                     + " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in pts) + '"/>')
            for x, y in pts:
                o.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="3" fill="{c}"><title>{esc(name)} '
                         f'{x:g}: {y:.3f}</title></circle>')
    for i, name in enumerate(names):
        lx, ly = left + (i % cols) * 250, top + ph + 60 + 18 * (i // cols)
        c = colours[i % len(colours)]
        dash = ' stroke-dasharray="6,3"' if series[name].get("dash") else ""
        o.append(f'<line x1="{lx}" x2="{lx + 26}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="3"{dash}/>')
        o.append(f'<text x="{lx + 32}" y="{ly + 4}">{esc(name)}</text>')
    return "\n".join(o + ["</svg>"]) + "\n"


def plot(summary, ratios, title) -> str:
    series = {}
    base = summary.get("none", {}).get(0.0)
    for m in _order(summary):
        if m == "none":
            continue
        acc = [(r, summary[m][r]["accuracy"]) for r in ratios if r in summary[m]]
        dn = [(r, summary[m][r]["dnll"]) for r in ratios if r in summary[m] and not math.isnan(summary[m][r]["dnll"])]
        if base:
            acc = [(0.0, base["accuracy"])] + acc
            dn = [(0.0, 0.0)] + dn
        series[m] = {"points": {"acc": acc, "dnll": dn}, "dash": m.startswith("kvpress")}
    hi = max([y for s in series.values() for _, y in s["points"]["dnll"]] + [0.1])
    return svg_plot(series, title, [("needle accuracy (higher is better)", "compression ratio", "acc", (0, 1)),
                                    ("continuation NLL increase, nats/token (lower is better)", "compression ratio",
                                     "dnll", (0, hi * 1.05))])


# ------------------------------------------------------------------ driver

def run(out, *, quick=False, model_path=None, methods=None, ratios=None, lengths=None, contexts=None, mix=None,
        shared=True, model=None, tok=None, threads=THREADS, log=print, progress_bar=True):
    """Runs the benchmark into `out` (see the module doc) and returns the summary. model/tok:
    an already loaded SmolLM2 (the tests pass theirs). Existing records of the same design in
    out/results.json are kept (resume)."""
    import torch
    from kvpress import KVPressTextGenerationPipeline

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    design = QUICK if quick else FULL
    lengths = tuple(lengths or design["lengths"])
    ratios = tuple(ratios or design["ratios"])
    if threads:
        torch.set_num_threads(int(threads))
    per = dict(design["contexts"])
    if contexts is not None:
        per = {L: int(contexts) for L in lengths}
    for L in lengths:
        per.setdefault(L, 1)
    t0 = time.perf_counter()
    if model is None:
        model, tok = load_model(model_path)
        log(f"quality: SmolLM2-135M-Instruct loaded in {time.perf_counter() - t0:.0f} s "
            f"({torch.get_num_threads()} threads)")
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok)
    fpath = out / "qfilters.npy"
    if fpath.exists():
        import numpy as np

        filters = torch.from_numpy(np.load(fpath))
    else:
        import numpy as np

        filters = qfilter_filters(model, tok, design["calib_tokens"])
        np.save(fpath, filters.numpy())
    table_ = method_table(filters=filters, mix=mix)
    names = list(table_) if not methods else list(methods)
    for m in names:
        if m not in table_:
            raise ValueError(f"unknown method '{m}' (known: {', '.join(table_)})")
    # retrieval rows add RETRIEVAL_RATIOS (2-5 % attended) to the design's ratios, except --quick's
    extra = () if quick else tuple(r for r in RETRIEVAL_RATIOS if r not in ratios)
    configs = [(m, r, (lambda m=m, r=r: table_[m][1](r))) for m in names
               for r in ratios + (extra if _retrieval_row(table_[m][1]) else ())]
    ctxs = make_contexts(tok, lengths, per)
    rpath = out / "results.json"
    done = json.loads(rpath.read_text()) if rpath.exists() else {"records": []}
    records = done["records"]
    have = {(r["method"], r["ratio"], r["length"], r["context"]) for r in records}
    total = sum(1 + sum((m, r, c.length, c.index) not in have for m, r, _ in configs) for c in ctxs)
    bar = None
    if progress_bar:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="quality", unit="cfg", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            bar = None
    count = [0]

    def tick(method, ratio):
        count[0] += 1
        if bar is not None:
            bar.set_postfix_str(f"{method} @ {ratio:g}", refresh=False)
            bar.update(1)
        elif count[0] % 20 == 0:
            log(f"quality: {count[0]}/{total} configurations")

    for ctx in ctxs:
        todo = [c for c in configs if (c[0], c[1], ctx.length, ctx.index) not in have]
        if not todo and ("none", 0.0, ctx.length, ctx.index) in have:
            continue
        recs = run_context(pipe, ctx, todo, shared=shared, progress=tick)
        if ("none", 0.0, ctx.length, ctx.index) in have:
            recs = [r for r in recs if r["method"] != "none"]
        records += recs
        have |= {(r["method"], r["ratio"], r["length"], r["context"]) for r in recs}
        tmp = rpath.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model": MODEL_NAME, "records": records}) + "\n")
        tmp.replace(rpath)
    if bar is not None:
        bar.close()
    summary = summarize([r for r in records if r["method"] in names + ["none"] and r["length"] in lengths])
    ratios = sorted(set(ratios) | {r for m in summary.values() for r in m if r > 0})
    md = table(summary, ratios)
    md += "\n" + table_axes(summary, ratios) + "\n" + best_by_axis(summary, ratios)
    for r in (0.5, 0.75):
        if r in ratios and len(lengths) > 1:
            md += "\n" + table_by_length(summary, r)
    title = (f"SmolLM2-135M-Instruct, needles + continuation, contexts "
             f"{', '.join(f'{per[L]}x{L}' for L in lengths)} tokens")
    (out / "table.md").write_text(md)
    (out / "plot.svg").write_text(plot(summary, ratios, title))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    log(md)
    log(f"quality: wrote {out}/results.json, table.md, plot.svg, summary.json "
        f"({time.perf_counter() - t0:.0f} s)")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvscore.quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="quality-out", help="output directory (default quality-out)")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: one context of 1K tokens, every method "
                    "at compression 0.5 and 0.9 (<= 3 min on 2 cores)")
    ap.add_argument("--model", help=f"the GGUF file (default $KVSCORE_SMOLLM2 or .models/{MODEL_NAME})")
    ap.add_argument("--methods", help="comma list (default: all; see --list)")
    ap.add_argument("--ratios", help="compression ratios (default 0.25,0.5,0.75,0.9; quick 0.5,0.9)")
    ap.add_argument("--lengths", help="context lengths in tokens (default 1024,2048,4096,8192; quick 1024)")
    ap.add_argument("--contexts", type=int, help="contexts per length (default: the design's, see docs/results/quality.md)")
    ap.add_argument("--mix", help="leak-free `kvscore eval` reports (JSON), comma list of [NAME=]PATH: adds "
                    "kvscore:NAME (default mix), the report's per-layer choice (per_layer_best) as a press")
    ap.add_argument("--threads", type=int, default=THREADS, help=f"torch threads (default {THREADS}; 0: torch's "
                    "default)")
    ap.add_argument("--no-shared-prefill", action="store_true", help="call the pipeline per press and question "
                    "(slow; the default replays each press's hook on one prefill, identical results)")
    ap.add_argument("--list", action="store_true", help="list the methods and exit")
    ap.add_argument("--workload-texts", metavar="DIR", help="write DIR/context.txt and DIR/following.txt (a "
                    "benchmark-like context of other text and its questions, --lengths' first length) for "
                    "dump_kv.py, and exit")
    a = ap.parse_args(argv)
    if a.workload_texts:
        from transformers import AutoTokenizer

        p = find_model(a.model)
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
        n = int(a.lengths.split(",")[0]) if a.lengths else 2048
        ctx, fol = workload_texts(tok, n)
        d = pathlib.Path(a.workload_texts)
        d.mkdir(parents=True, exist_ok=True)
        (d / "context.txt").write_text(ctx)
        (d / "following.txt").write_text(fol)
        print(f"quality: wrote {d}/context.txt and following.txt")
        return 0
    if a.list:
        for m, (fam, _) in method_table(filters=True, mix={"mix": "report.json"}).items():
            print(f"{m:34s} {fam}")
        return 0
    try:
        ratios = [float(x) for x in a.ratios.split(",")] if a.ratios else None
        lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else None
    except ValueError as e:
        ap.error(f"--ratios / --lengths: {e}")
    for r in ratios or []:
        if not 0 < r < 1:
            ap.error(f"--ratios: {r} is not in (0, 1)")
    if a.contexts is not None and a.contexts < 1:
        ap.error(f"--contexts {a.contexts} must be >= 1")
    mix = None
    if a.mix:
        mix = {}
        for item in a.mix.split(","):
            name, _, path = item.rpartition("=")
            mix[name or "mix"] = path
    try:
        run(a.out, quick=a.quick, model_path=a.model, methods=a.methods.split(",") if a.methods else None,
            ratios=ratios, lengths=lengths, contexts=a.contexts, mix=mix, shared=not a.no_shared_prefill,
            threads=a.threads)
    except (FileNotFoundError, ValueError) as e:
        print(f"kvscore.quality: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
