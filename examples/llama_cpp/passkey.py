"""Passkey retrieval through kvscore_llama (docs/methods/kvzip.md): a pass key hidden at several depths of
filler text (Mohtashami & Jaggi's passkey prompt) inside SmolLM2's chat template; the context is
prefilled, compressed by --method at each --keep, and the question is decoded after the compressed
cache and answered greedily. A cell's accuracy: the share of depths whose answer holds the key.
For kvzip the reconstruction skips the template's opening (--kvzip-prefix, measured by tokenizing
it) and puts the template's end of the user turn before each chunk (--kvzip-suffix), as kvpress.

  python examples/llama_cpp/passkey.py --bin build/examples/llama_cpp/kvscore_llama \\
      --model SmolLM2-135M-Instruct.Q4_1.gguf [--tokens 1000] [--depths 0.1,0.3,0.5,0.7,0.9] \\
      [--keeps 0.5,0.25,0.1] [--methods kvzip,knorm,keydiff] [--hard] [--out passkey.json]

--question-in-prompt: the question is part of the prompt and prefilled with it, as a llama.cpp user's
prompt is, and the answer is what the model generates after it (the way to judge sparse decode:
only the generated tokens attend sparsely). Each case's prompt is prefilled once, by the full-cache
run (--save-session); the --attend runs decode from that session (--load-session). Takes no
--methods (nothing is evicted).

--hard: a harder needle. The filler is running prose (the GPL-3 text or --prose, from a random sentence on)
instead of five repeated sentences, and four distractors — other 5-digit numbers under other
labels ("The locker code is 48213.") — sit at random depths beside the pass key, which is said
once. A score that keeps "unusual" tokens keeps the distractors too; only the right one answers.
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
OPEN = "<|im_start|>user\n"
CLOSE = "<|im_end|>\n<|im_start|>assistant\n"
QUESTION = "\nWhat is the pass key? Answer with the number only." + CLOSE + "The pass key is"
PROSE = "/usr/share/common-licenses/GPL-3"
DISTRACTORS = ["locker code", "order number", "room number", "ticket code"]


def prose_words(files):
    """The words of the --prose files, in order."""
    return [w for f in files.split(",") for w in open(f).read().split()]


def hard_text(rng, words, n_tokens, per_word, key, depth):
    """Prose of about n_tokens tokens from `words` with the pass key at `depth` and the distractors elsewhere."""
    n = int(n_tokens / per_word)
    if n >= len(words):
        sys.exit(f"passkey.py: --tokens {n_tokens} needs about {n} words of prose, --prose has {len(words)}: "
                 "name more files")
    start = rng.randrange(0, len(words) - n)
    body = words[start:start + n]
    inserts = [(depth, f"The pass key is {key}. Remember it.")]
    for label in DISTRACTORS:
        inserts.append((rng.uniform(0.05, 0.95), f"The {label} is {rng.randrange(10000, 100000)}."))
    for at, sentence in sorted(inserts, reverse=True):  # from the end: earlier positions stay put
        i = int(at * len(body))
        while i < len(body) and not body[i - 1].endswith("."):  # after a sentence's end
            i += 1
        body[i:i] = sentence.split()
    return " ".join(body) + " "


def table(first, columns, rows):
    """A markdown table: `first` and `columns` for a header, rows of (name, cells); a short row's
    missing cells are left empty."""
    lines = [f"| {first} | " + " | ".join(columns) + " |", "| --- | " + " | ".join("---:" for _ in columns) + " |"]
    lines += [f"| {name} | " + " | ".join(cells + [""] * (len(columns) - len(cells))) + " |" for name, cells in rows]
    return "\n".join(lines)


def run(binary, model, args):
    r = subprocess.run([binary, "--model", model, "--threads", "1", "--special", *args], capture_output=True,
                       text=True)
    if r.returncode != 0:
        sys.exit(f"passkey.py: {binary} {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def tokens_of(binary, model, text, tmp):
    """The prompt's token count as kvscore_llama tokenizes it (its first output line)."""
    path = os.path.join(tmp, "probe.txt")
    with open(path, "w") as f:
        f.write(text)
    out = run(binary, model, ["--prompt-file", path, "--keep", "1", "--n-predict", "1", "--recent", "1",
                              "--no-text"])
    return int(re.search(r"prompt: (\d+) tokens", out).group(1))


def attend_args(spec, dense_below):
    """kvscore_llama's flags for an --attend entry X or X:SCORE."""
    x, _, score = spec.partition(":")
    return ["--attend", x, "--dense-below", str(dense_below)] + (["--block-score", score] if score else [])


def in_prompt_runs(a, prompt, session, attends, depth, key):
    """--question-in-prompt: the full cache's run prefills the prompt (question included), saves it and
    generates the answer; each --attend run generates from the saved session."""
    base = ["--prompt-file", prompt, "--keep", "1", "--n-predict", "8", "-fa", "on"]
    runs = [("full", base + ["--save-session", session])]
    runs += [(f"attend {x}", base + ["--load-session", session] + attend_args(x, a.dense_below)) for x in attends]
    records = []
    for method, args in runs:
        out = run(a.bin, a.model, args)
        answer = re.search(r"^text: (.*)$", out, re.M).group(1)
        rec = {"method": method, "keep": 1.0, "question": "in prompt", "depth": depth, "key": key, "answer": answer,
               "correct": key in answer, "tokens": int(re.search(r"prompt: (\d+) tokens", out).group(1))}
        t = re.search(r"timing: prefill ([\d.]+) ms", out)
        rec["prefill_ms" if method == "full" else "load_ms"] = float(t.group(1))
        s = re.search(r"attending ([\d.]+) % of the visible cells", out)
        if s:
            rec["attended_pct"] = float(s.group(1))
        records.append(rec)
        print(json.dumps(rec), flush=True)
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="kvscore_llama")
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--tokens", type=int, default=1000, help="about this many context tokens (default 1000)")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--keeps", default="0.5,0.25,0.1", help="--keep values (compression 0.5 / 0.75 / 0.9)")
    ap.add_argument("--methods", default="kvzip,knorm,keydiff")
    ap.add_argument("--recent", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hard", action="store_true", help="prose filler and four distractor numbers (see above)")
    ap.add_argument("--prose", default=PROSE,
                    help=f"--hard: the prose, comma-separated files read in order (default {PROSE}, ~7.6K tokens: "
                         "name more for longer prompts)")
    ap.add_argument("--aggregate", default="max", choices=["max", "mean", "vote"],
                    help="kvscore_llama's joint selection over heads and layers (default max)")
    ap.add_argument("--alloc", default="joint", choices=["joint", "per_head"],
                    help="kvscore_llama's --alloc: one set of positions for every head and layer, or each KV "
                         "head its own tokens (default joint)")
    ap.add_argument("--chunk", type=int, help="kvzip: context tokens per reconstruction pass (default: kvscore_llama's)")
    ap.add_argument("--attend", default="",
                    help="comma-separated kvscore_llama --attend values (sparse decode, -fa on; the question is then "
                         "decoded a token a step, unless --question-in-prompt): each is one more run per depth, on "
                         "the full cache; X:SCORE also sets --block-score (0.1:exact)")
    ap.add_argument("--question-in-prompt", action="store_true",
                    help="the question prefilled with the context, the answer generated (see above)")
    ap.add_argument("--dense-below", type=int, default=1024, help="kvscore_llama's --dense-below with --attend")
    ap.add_argument("--out", help="write the records as JSON")
    a = ap.parse_args()
    depths = [float(x) for x in a.depths.split(",")]
    keeps = [float(x) for x in a.keeps.split(",")]
    methods = [m for m in a.methods.split(",") if m]
    attends = [x for x in a.attend.split(",") if x]
    if a.question_in_prompt and methods:
        ap.error("--question-in-prompt takes no --methods (pass --methods '')")
    rng = random.Random(a.seed)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = tokens_of(a.bin, a.model, OPEN, tmp)
        per = tokens_of(a.bin, a.model, FILLER * 20, tmp) / 20
        if a.hard:
            words = prose_words(a.prose)
            sample = " ".join(words[:400])
            per_word = tokens_of(a.bin, a.model, sample, tmp) / 400
        n_fill = max(1, int(a.tokens / per))
        q = os.path.join(tmp, "question.txt")
        with open(q, "w") as f:
            f.write(QUESTION)
        for depth in depths:
            key = str(rng.randrange(10000, 100000))
            needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
            at = int(depth * n_fill)
            text = OPEN + FILLER * at + needle + FILLER * (n_fill - at)
            if a.hard:
                text = OPEN + hard_text(rng, words, a.tokens, per_word, key, depth)
            p = os.path.join(tmp, "prompt.txt")
            with open(p, "w") as f:
                f.write(text + QUESTION if a.question_in_prompt else text)
            if a.question_in_prompt:
                records += in_prompt_runs(a, p, os.path.join(tmp, "case.session"), attends, depth, key)
                continue
            runs = [("full", 1.0)] + [(m, k) for m in methods for k in keeps]
            runs += [(f"attend {x}", 1.0) for x in attends]
            for method, keep in runs:
                args = ["--prompt-file", p, "--question-file", q, "--keep", str(keep), "--recent", str(a.recent),
                        "--n-predict", "8", "--no-text", "--method", "knorm" if method == "full" or method.startswith("attend") else method,
                        "--aggregate", a.aggregate, "--alloc", a.alloc]
                if attends:  # every run with flash attention, so that the dense and sparse runs differ only by --attend
                    args += ["-fa", "on"]
                if method.startswith("attend"):
                    args += attend_args(method.split()[1], a.dense_below)
                if method == "kvzip":
                    args += ["--kvzip-prefix", str(prefix), "--kvzip-suffix", CLOSE]
                    if a.chunk:
                        args += ["--chunk", str(a.chunk)]
                out = run(a.bin, a.model, args)
                answer = re.search(r"answer 0:[^|]*\| (.*)", out).group(1)
                rec = {"method": method, "keep": keep, "aggregate": a.aggregate, "alloc": a.alloc, "depth": depth, "key": key,
                       "answer": answer,
                       "correct": key in answer,
                       "tokens": int(re.search(r"prompt: (\d+) tokens", out).group(1))}
                t = re.search(r"timing: prefill ([\d.]+) ms .*?score\+select\+evict ([\d.]+) ms", out)
                rec["prefill_ms"], rec["kv_ms"] = float(t.group(1)), float(t.group(2))
                z = re.search(r"kvzip: .*?forward ([\d.]+) ms .*?scoring ([\d.]+) ms", out)
                if z:
                    rec["kvzip_forward_ms"], rec["kvzip_scoring_ms"] = float(z.group(1)), float(z.group(2))
                records.append(rec)
                print(json.dumps(rec), flush=True)
    full = [r["correct"] for r in records if r["method"] == "full"]
    rows = [("full cache", [f"{sum(full) / len(full):.2f}"])]
    agree = []
    for m in methods:
        cells = [[r["correct"] for r in records if r["method"] == m and r["keep"] == k] for k in keeps]
        rows.append((m, [f"{sum(c) / len(c):.2f}" for c in cells]))
    for x in attends:
        c = [r["correct"] for r in records if r["method"] == f"attend {x}"]
        same = [r["correct"] == f for r, f in zip([r for r in records if r["method"] == f"attend {x}"], full)]
        rows.append((f"sparse decode, attend {x}", [f"{sum(c) / len(c):.2f}"]))
        agree.append(f"attend {x}: {sum(c)}/{len(c)} answered (full cache {sum(full)}/{len(full)}), the same outcome "
                     f"as the full cache in {sum(same)}/{len(same)} cases")
    print("\n" + table("method", ["accuracy"] if a.question_in_prompt else [f"keep {k}" for k in keeps], rows))
    if agree:
        print("\n" + "\n".join(agree))
    z = [r for r in records if "kvzip_forward_ms" in r]
    if z:
        fwd = sum(r["kvzip_forward_ms"] / r["prefill_ms"] for r in z) / len(z)
        sc = sum(r["kvzip_scoring_ms"] / r["kvzip_forward_ms"] for r in z) / len(z)
        print(f"\nkvzip: reconstruction forward {100 * fwd:.0f} % of the prefill, scoring {100 * sc:.1f} % of that "
              f"forward (mean of {len(z)} runs; {records[0]['tokens']} prompt tokens)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
