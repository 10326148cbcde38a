"""A passkey benchmark that can tell what sparse decode costs in answers (never a test).

    python -m kvscore.vllm.bench --workload needle --model DIR [--lengths 2048,4096,7168]
        [--cases 64] [--batch 8] [--configs vllm,attend=0.1,attend=0.05] [--probe] [--out FILE]

Each case is a chat-template prompt of about `length` tokens: running prose (Debian's licence
texts, a different offset per case) with a pass key (5 random digits) said twice in one sentence
at a depth spread evenly over the cases, and, in every other case, a distractor — another 5-digit
number under another label ("The locker code is 48213.") at another depth. The question comes last
("What is the pass key? Answer with the number only.") with the assistant's turn opened and **no
answer prefix**: the model writes its own answer ("The pass key is 29681."), greedily, up to
`--max-tokens` tokens. A case is answered when the first run of digits in the answer is the key:
an answer that breaks off ("29.") or runs on ("2968111") or gives the distractor is wrong.

Every configuration runs the same cases in its own engine (vLLM's connector agent is process-wide) or,
written `attend=0.1@subset=2`, on every 2nd pair of them (a case and its distractor twin), compared
with plain's answers on the same cases; at `--batch` concurrent requests. Reported per configuration and length: the
accuracy with its 95 % Wilson interval, and per case against plain vLLM's answers: both right,
lost (plain right, this wrong), gained, both wrong; the accuracy ratio to plain's. With `--probe`,
every layer's choice at every sparse decode step is compared with the exact score's choice for
that step's query (`block_sparse_reference(score="exact")` on the keys read back from vLLM's
cache): the recall of the exact top blocks per decode step of the answer, so a lost answer shows
the step where the choice went wrong. The probe only reads: the choices are the same with it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import subprocess
import sys
import time

TEXTS = ("GPL-3", "LGPL-2.1", "GFDL-1.3", "MPL-1.1", "GPL-2", "Apache-2.0", "MPL-2.0", "LGPL-3", "GPL-1")
LABELS = ("locker code", "order number", "room number", "ticket code", "flight number", "door code",
          "account number", "parcel code")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
DISTRACTOR = "The {label} is {number}."
QUESTION = "What is the pass key? Answer with the number only."
LENGTHS = (2048, 4096, 7168)


@dataclasses.dataclass
class Case:
    length: int             # nominal prompt length (tokens, chat template included)
    index: int
    depth: float            # the key's depth in the prose, in [0, 1]
    key: str
    distractor: tuple | None  # (label, number, depth)
    ids: list               # the prompt's token ids

    @property
    def name(self) -> str:
        return f"{self.length}:{self.index}"


def _prose_words() -> list[str]:
    from kvscore import quality as Q
    return Q.license_text(TEXTS).split()


def _insert(words: list[str], sentences: list[tuple[float, str]]) -> list[str]:
    """The sentences put into the prose at their depths, each after a sentence's end."""
    body = list(words)
    for at, sentence in sorted(sentences, reverse=True):  # from the end: earlier positions stay put
        i = max(1, int(at * len(body)))
        while i < len(body) and not body[i - 1].endswith("."):
            i += 1
        body[i:i] = sentence.split()
    return body


def make_cases(tok, length: int, n: int, seed: int = 0) -> list[Case]:
    """n cases of about `length` tokens: depths (i + u)/n for u uniform in [0.1, 0.9] (every part of
    the context), a distractor in every odd case. Deterministic for (length, n, seed)."""
    words = _prose_words()
    rng = random.Random(f"needle:{seed}:{length}:{n}")
    per_word = len(tok.encode(" ".join(words[:2000]), add_special_tokens=False)) / 2000
    wrap = len(_prompt_ids(tok, ""))
    out = []
    for i in range(n):
        key = str(rng.randrange(10000, 100000))
        depth = (i + rng.uniform(0.1, 0.9)) / n
        distractor = None
        sentences = [(depth, NEEDLE.format(key=key))]
        if i % 2 == 1:
            number = str(rng.randrange(10000, 100000))
            while number == key:
                number = str(rng.randrange(10000, 100000))
            d = rng.uniform(0.02, 0.98)
            while abs(d - depth) < 0.1:
                d = rng.uniform(0.02, 0.98)
            distractor = (rng.choice(LABELS), number, d)
            sentences.append((d, DISTRACTOR.format(label=distractor[0], number=number)))
        n_words = int((length - wrap - 30) / per_word)
        start = rng.randrange(0, len(words) - n_words)
        ids = None
        for _ in range(4):  # fit the length: the prose's token count per word varies by offset
            body = _insert(words[start:start + n_words], sentences)
            ids = _prompt_ids(tok, " ".join(body))
            if abs(len(ids) - length) <= 16:
                break
            n_words = max(100, int(n_words * (length - wrap) / max(1, len(ids) - wrap)))
        out.append(Case(length, i, depth, key, distractor, ids))
    return out


def _prompt_ids(tok, prose: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": f"{prose}\n\n{QUESTION}"}],
                                   add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def answer_of(text: str) -> str | None:
    """The first run of digits in the model's answer (None if it wrote none)."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


# ---------------------------------------------------------------------- one engine (subprocess)

class _Probe:
    """SPARSE_OBSERVER: per (request, sparse decode step, layer) the recall of the exact score's
    choice (the blocks beyond the protected ones) by the blocks the selector wrote; with a trace,
    also both choices and the cosines of the step's query with the layer's last QUERIES queries
    (the least over query heads), from which a refresh policy can be replayed offline."""

    QUERIES = 16

    def __init__(self, sched, names, trace: bool = False):
        self.sched = sched
        self.names = {n: n for n in names}
        self.trace = trace
        self.step_id = None
        self.owner: dict[int, str] = {}
        self.recall: dict[str, list[list[float]]] = {}  # request -> per step -> per layer
        self.fresh: dict[str, list[int]] = {}           # request -> per step: layers scored
        self.steps: dict[str, list[list]] = {}          # trace: request -> per step -> per layer record
        self.past: dict[tuple, list] = {}               # trace: (request, layer) -> its last queries
        self.seconds = 0.0

    def __call__(self, worker, layer_name, kv_cache, query, step) -> None:
        import numpy as np

        from kvscore import _kvscore as _k
        from kvscore.vllm import internals as V
        t0 = time.perf_counter()
        cfg, bs = worker.cfg, worker.block_size
        if self.step_id != id(step):  # a new engine step: who holds which first block
            self.step_id = id(step)
            # the scheduler's request ids carry a suffix of the engine's ("2048:0-1a2b3c4d")
            self.owner = {blocks[0].block_id: self.names.get(rid, rid.rsplit("-", 1)[0])
                          for rid, blocks in V.all_request_blocks(self.sched.kv_cache_manager).items() if blocks}
            for i in range(len(step.rows)):
                rid = self.owner.get(int(step.src[int(step.rows[i]), 0]))
                if rid is not None:
                    self.recall.setdefault(rid, []).append([])
                    self.fresh.setdefault(rid, []).append(0)
                    if self.trace:
                        self.steps.setdefault(rid, []).append([])
        src, dst = step.src.numpy(), step.dst.numpy()
        for i, (r, ti, n, a) in enumerate(zip(step.rows, step.token_index, step.tokens, step.attend)):
            r, n, a = int(r), int(n), int(a)
            rid = self.owner.get(int(src[r, 0]))
            if rid is None:
                continue
            nb = -(-n // bs)
            ids = src[r, :nb].astype(np.int64)
            keys = _k.vllm_cpu_keys(kv_cache, ids, n, isa=worker._isa)
            q = query[int(ti)].float().contiguous().numpy()
            exact = _k.block_sparse_reference(keys, q, bs, a, score="exact", sinks=cfg.sinks, local=cfg.local,
                                              scale=worker._selector_scale, group=cfg.query_group)
            sink_end = min(nb, -(-min(cfg.sinks, n) // bs))
            local_begin = min(nb, max(0, n - max(cfg.local, 1)) // bs)
            pos = {int(p): b for b, p in enumerate(ids)}
            want = sorted(int(b) for b in exact if not (b < sink_end or b >= local_begin))
            got = sorted(pos[int(x)] for x in dst[r, :a] if not (pos[int(x)] < sink_end or pos[int(x)] >= local_begin))
            hit = len(set(want) & set(got))
            self.recall[rid][-1].append(hit / len(want) if want else 1.0)
            fresh = bool(step.fresh[i]) if step.fresh is not None else True
            self.fresh[rid][-1] += int(fresh)
            if self.trace:
                qn = q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-30)
                past = self.past.setdefault((rid, layer_name), [])
                cos = [round(float((qn * p).sum(axis=1).min()), 4) for p in reversed(past)]
                past.append(qn)
                del past[: -self.QUERIES]
                self.steps[rid][-1].append({"got": got, "exact": want, "fresh": int(fresh), "cos": cos,
                                            "local_begin": local_begin, "sink_end": sink_end})
        self.seconds += time.perf_counter() - t0


def _run(spec: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # batch 8 of 7.2K-token requests: 2.7 GB of fp32 K and V
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_space", 3)))
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if spec.get("plugin"):
        from kvscore.vllm import kv_transfer_config
        kw["kv_transfer_config"] = kv_transfer_config(**spec["plugin"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    cases = [c for L in spec["lengths"] for c in make_cases(tok, L, spec["cases"], spec.get("seed", 0))
             if in_subset(c.index, spec.get("subset", 1))]
    longest = max(len(c.ids) for c in cases)
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
              max_model_len=longest + spec["max_tokens"] + 8, block_size=32, enable_prefix_caching=False, seed=0,
              max_num_seqs=spec["batch"], max_num_batched_tokens=max(8192, longest + 8), **kw)
    eng = llm.llm_engine
    probe = None
    if spec.get("plugin") and spec.get("probe"):
        from kvscore.vllm import worker as W
        probe = _Probe(eng.engine_core.engine_core.scheduler, [c.name for c in cases], trace=bool(spec.get("trace")))
        W.SPARSE_OBSERVER = probe
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    t0 = time.perf_counter()
    for c in cases:
        eng.add_request(c.name, TokensPrompt(prompt_token_ids=c.ids), sp)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    res = {"wall_s": wall, "cases": []}
    for c in cases:
        text = tok.decode(outs[c.name], skip_special_tokens=True)
        rec = {"case": c.name, "length": c.length, "tokens": len(c.ids), "depth": round(c.depth, 4), "key": c.key,
               "distractor": c.distractor[1] if c.distractor else None, "answer": text, "output_ids": outs[c.name],
               "correct": answer_of(text) == c.key}
        if probe is not None and c.name in probe.recall:
            rec["recall_per_step"] = [sum(x) / len(x) if x else None for x in probe.recall[c.name]]
            rec["min_recall_per_step"] = [min(x) if x else None for x in probe.recall[c.name]]
            rec["layers_scored_per_step"] = probe.fresh[c.name]
        res["cases"].append(rec)
    if probe is not None:
        res["probe_s"] = probe.seconds
        if spec.get("trace"):
            with open(spec["trace"], "w") as f:
                json.dump({c.name: probe.steps.get(c.name, []) for c in cases}, f)
    return res


def _spawn(spec: dict) -> dict:
    p = subprocess.run([sys.executable, "-m", "kvscore.vllm.needle", "--run", json.dumps(spec)], capture_output=True,
                       text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"needle run failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


# ---------------------------------------------------------------------- replaying a refresh policy

def replay(trace: dict, refresh: int, cosine: float, first: int = 0) -> dict:
    """A refresh policy replayed on a trace of a run that scored every step (refresh 1): per
    (case, layer) a kept choice stands while it is younger than `refresh` steps and the query's
    cosine with the query that chose it (least over heads) is >= `cosine`; else the step's own
    choice. Returns the mean recall of the exact blocks and the share of (step, layer)s scored,
    over the steps from `first` on. Approximate: the tokens are the traced run's."""
    hits = total = scored = n = 0
    for steps in trace.values():
        layers = len(steps[0]) if steps else 0
        for layer in range(layers):
            kept, since = None, 0
            for t, st in enumerate(steps):
                if layer >= len(st):
                    continue
                rec = st[layer]
                age = t - since
                stands = (kept is not None and age < refresh and
                          (cosine <= 0 or (age - 1 < len(rec["cos"]) and rec["cos"][age - 1] >= cosine)))
                if not stands:
                    kept, since = rec["got"], t
                if t < first:
                    continue
                choice = set(b for b in kept if rec["sink_end"] <= b < rec["local_begin"])
                want = rec["exact"]
                hits += len(choice & set(want))
                total += len(want)
                scored += int(not stands)
                n += 1
    return {"recall": hits / max(1, total), "scored": scored / max(1, n)}


# ---------------------------------------------------------------------- the report

def in_subset(index: int, subset: int) -> bool:
    """Case `index` is in every `subset`-th pair of cases (a case without a distractor and the next,
    with one): a subset of 1/subset of the cases over all depths, half of them with a distractor."""
    return (index // 2) % subset == 0


def split_subset(entry: str) -> tuple[str, int]:
    """("attend=0.1@subset=2") -> ("attend=0.1", 2): a configuration run on a subset of the cases."""
    parts = [kv for kv in entry.split("@") if not kv.startswith("subset=")]
    sub = [int(kv.split("=", 1)[1]) for kv in entry.split("@") if kv.startswith("subset=")]
    if sub and sub[0] < 1:
        raise ValueError(f"needle: subset {sub[0]} must be >= 1")
    return "@".join(parts), (sub[0] if sub else 1)


def parse_config(entry: str, method: str = "knorm") -> dict | None:
    """"vllm" (plain) or kvscore settings joined by '@' ("attend=0.1@refresh=1"): the plugin's."""
    if entry == "vllm":
        return None
    plugin = {"method": method, "ratio": 0.0}
    for kv in entry.split("@"):
        k, v = kv.split("=", 1)
        if k in ("method", "block_score", "query_group"):
            plugin[k] = v
        elif k == "probe":
            plugin[k] = v == "True"
        elif k in ("local", "dense_below", "sinks", "prefilter", "refresh", "threads"):
            plugin[k] = int(v)
        else:
            plugin[k] = float(v)
    return plugin


def summarize(runs: dict, lengths) -> dict:
    """Per configuration and length (and "all"): accuracy, its interval, agreement with plain."""
    plain = runs.get("vllm")
    out = {}
    for name, r in runs.items():
        by = {}
        for L in list(lengths) + ["all"]:
            cs = [c for c in r["cases"] if L == "all" or c["length"] == L]
            k, n = sum(c["correct"] for c in cs), len(cs)
            s = {"correct": k, "n": n, "accuracy": k / max(1, n), "ci95": wilson(k, n),
                 "with_distractor": [sum(c["correct"] for c in cs if c["distractor"]),
                                     sum(1 for c in cs if c["distractor"])]}
            if plain is not None and name != "vllm":
                pc = {c["case"]: c for c in plain["cases"]}
                both = sum(1 for c in cs if c["correct"] and pc[c["case"]]["correct"])
                lost = sum(1 for c in cs if not c["correct"] and pc[c["case"]]["correct"])
                gained = sum(1 for c in cs if c["correct"] and not pc[c["case"]]["correct"])
                same = sum(1 for c in cs if c["output_ids"] == pc[c["case"]]["output_ids"])
                kp = sum(pc[c["case"]]["correct"] for c in cs)
                s.update({"both": both, "lost": lost, "gained": gained, "same_tokens": same,
                          "vs_plain": k / max(1, kp)})
            rec = [x for c in cs for x in (c.get("recall_per_step") or []) if x is not None]
            if rec:
                s["recall_mean"] = sum(rec) / len(rec)
                steps = max(len(c.get("recall_per_step") or []) for c in cs)
                s["recall_by_step"] = [
                    sum(v) / len(v) for v in ([c["recall_per_step"][j] for c in cs
                                               if len(c.get("recall_per_step") or []) > j] for j in range(steps)) if v]
            by[str(L)] = s
        out[name] = by
    return out


def table(summary: dict, lengths) -> str:
    cols = [str(L) for L in lengths] + ["all"]
    lines = ["| configuration | " + " | ".join(f"{c} tokens" if c != "all" else "all" for c in cols)
             + " | lost / gained vs plain | same tokens as plain |",
             "| --- | " + " | ".join("---:" for _ in cols) + " | ---: | ---: |"]
    for name, by in summary.items():
        cells = []
        for c in cols:
            s = by[c]
            lo, hi = s["ci95"]
            cells.append(f"{s['correct']}/{s['n']} ({100 * s['accuracy']:.0f} %, {100 * lo:.0f}–{100 * hi:.0f})")
        a = by["all"]
        lg = f"{a['lost']} / {a['gained']}" if "lost" in a else ""
        same = f"{a['same_tokens']}/{a['n']}" if "same_tokens" in a else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {lg} | {same} |")
    return "\n".join(lines)


def main(a) -> int:
    lengths = [int(x) for x in a.lengths.split(",")]
    base = {"model": a.model, "lengths": lengths, "cases": a.cases, "batch": a.batch, "max_tokens": a.max_tokens,
            "seed": a.seed}
    report = {"workload": "needle", "config": {k: v for k, v in base.items() if k != "model"}, "runs": {}}
    if getattr(a, "resume", False) and a.out and os.path.exists(a.out):
        with open(a.out) as f:
            old = json.load(f)
        if old.get("config") == report["config"]:  # the same cases: the configurations run already stand
            report["runs"] = old.get("runs", {})
    print(f"vLLM CPU needle bench: {a.cases} cases at each of {lengths} tokens, batch {a.batch}, "
          f"up to {a.max_tokens} tokens written", flush=True)
    for entry in (e for e in a.configs.split(",") if e):
        config, subset = split_subset(entry)
        plugin = parse_config(config, a.method)
        if entry in report["runs"]:
            print(f"  {entry:40s} (from {a.out})", flush=True)
            continue
        t0 = time.perf_counter()
        trace = f"{a.out}.{entry}.trace.json" if a.probe and a.out and plugin else None
        r = _spawn({**base, "plugin": plugin, "probe": a.probe, "trace": trace, "subset": subset})
        report["runs"][entry] = r
        ok = sum(c["correct"] for c in r["cases"])
        print(f"  {entry:40s} {ok}/{len(r['cases'])} answered ({time.perf_counter() - t0:.0f} s)", flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(report, f, indent=1)
    report["summary"] = summarize(report["runs"], lengths)
    print(table(report["summary"], lengths), flush=True)
    for name, by in report["summary"].items():
        if "recall_by_step" in by["all"]:
            steps = " ".join(f"{x:.2f}" for x in by["all"]["recall_by_step"][:16])
            print(f"  {name}: recall of the exact blocks {by['all']['recall_mean']:.3f}; by answer step: {steps}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _replay_main(argv) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="replay refresh policies on a needle trace (refresh 1, --probe)")
    ap.add_argument("trace")
    ap.add_argument("--refresh", default="1,2,4,8,16")
    ap.add_argument("--cosine", default="0,0.8,0.9,0.95,0.98")
    ap.add_argument("--first", type=int, default=0, help="count from this answer step on")
    a = ap.parse_args(argv)
    with open(a.trace) as f:
        trace = json.load(f)
    cos = [float(x) for x in a.cosine.split(",")]
    print("| refresh | " + " | ".join(f"cosine {c:g}: recall, scored" for c in cos) + " |")
    print("| ---: | " + " | ".join("---:" for _ in cos) + " |")
    for R in (int(x) for x in a.refresh.split(",")):
        cells = []
        for c in cos:
            r = replay(trace, R, c, a.first)
            cells.append(f"{r['recall']:.3f}, {r['scored']:.2f}")
        print(f"| {R} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--replay":
        sys.exit(_replay_main(sys.argv[2:]))
    if len(sys.argv) == 3 and sys.argv[1] == "--run":
        print("RESULT " + json.dumps(_run(json.loads(sys.argv[2]))), flush=True)
        sys.exit(0)
    print("run it as python -m kvscore.vllm.bench --workload needle", file=sys.stderr)
    sys.exit(2)
