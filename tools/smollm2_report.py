#!/usr/bin/env python3
"""docs/reference/evaluate.md's SmolLM2 tables and per-layer figure from scripts/eval_smollm2.sh's reports.

    python3 tools/smollm2_report.py DIR      # DIR/{leak-free,shared}-{2048,8192}.json

Writes DIR/tables.md (also printed): per dump length and protocol, every method's attention-mass
recall, output relative error and top-k overlap at keep 0.1 / 0.25 / 0.5, and the per-layer
choice (per_layer_best) of the leak-free reports; DIR/per_layer.svg: recall per layer at keep
0.25 under the leak-free protocol, one line per method (the oracle dashed), 2K and 8K side by side.
"""

from __future__ import annotations

import json
import pathlib
import sys

KEEPS = (0.1, 0.25, 0.5)
LENGTHS = (2048, 8192)
PROTOCOLS = ("leak-free", "shared")


def load(d: pathlib.Path, protocol: str, n: int):
    p = d / f"{protocol}-{n}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def table(rep) -> str:
    res = {(r["method"], r["keep"]): r for r in rep["results"]}
    methods = list(dict.fromkeys(r["method"] for r in rep["results"]))
    h = ("| method | " + " | ".join(f"recall {k:g}" for k in KEEPS) + " | " + " | ".join(f"error {k:g}" for k in KEEPS)
         + " | " + " | ".join(f"overlap {k:g}" for k in KEEPS) + " |\n| --- |" + " ---: |" * (3 * len(KEEPS)) + "\n")
    rows = []
    for m in methods:
        cells = []
        for key in ("attention_mass_recall", "output_rel_error", "topk_overlap"):
            for k in KEEPS:
                r = res.get((m, k))
                cells.append(f"{r[key]:.3f}" if r else "—")
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    skipped = "".join(f"\nskipped: {s['method']} at keep {s['keep']:g}: {s['reason']}" for s in rep["skipped"])
    return h + "\n".join(rows) + "\n" + skipped


def runs(methods):
    """'snapkv (0-9), l2 (10, 12-29), ...': each method with its layers as ranges."""
    by = {}
    for i, m in enumerate(methods):
        by.setdefault(m, []).append(i)
    out = []
    for m, ls in by.items():
        parts, start = [], ls[0]
        for a, b in zip(ls, ls[1:] + [None]):
            if b != a + 1:
                parts.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        out.append(f"{m} ({', '.join(parts)})")
    return "; ".join(out)


def per_layer(rep, keep):
    """{method: [(layer, mean recall over the layer's heads)]} at `keep`."""
    out = {}
    for r in rep["results"]:
        if r["keep"] != keep:
            continue
        acc = {}
        for h in r["per_head"]:
            acc.setdefault(h["layer"], []).append(h["attention_mass_recall"])
        out[r["method"]] = [(l, sum(v) / len(v)) for l, v in sorted(acc.items())]
    return out


def main(argv) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    d = pathlib.Path(argv[1])
    parts = []
    for n in LENGTHS:
        for p in PROTOCOLS:
            rep = load(d, p, n)
            if rep is None:
                continue
            i = rep["input"]
            parts.append(f"### SmolLM2-135M-Instruct, {i['tokens']} cache tokens ({n} with the {i['queries']} that follow), "
                         f"{p} protocol\n\n" + table(rep))
            if p == "leak-free":
                parts.append("Per-layer choice (per_layer_best, recall): " + "\n".join(
                    f"\n- keep {b['keep']:g}: {runs(b['methods'])}" for b in rep["per_layer_best"]) + "\n")
    md = "\n\n".join(parts) + "\n"
    (d / "tables.md").write_text(md)
    print(md)
    from kvscore.quality import svg_plot  # the installed package (scripts/test_python.sh's environment)
    series, panels = {}, []
    for n in LENGTHS:
        rep = load(d, "leak-free", n)
        if rep is None:
            continue
        key = f"n{n}"
        panels.append((f"{rep['input']['tokens']} cache tokens: recall per layer, keep 0.25", "layer", key, (0, 1)))
        for m, pts in per_layer(rep, 0.25).items():
            if m in ("pariskv-flat", "windowed-l2"):  # pariskv-flat ~ pariskv; windowed-l2 = l2 below 4096 tokens
                continue
            s = series.setdefault(m, {"points": {}, "dash": m in ("oracle", "pariskv", "ojakv")})
            s["points"][key] = pts
    svg = svg_plot(series, "SmolLM2-135M-Instruct, leak-free: recall per layer at keep 0.25 (dashed: oracle, "
                   "pariskv, ojakv)", panels)
    (d / "per_layer.svg").write_text(svg)
    print(f"smollm2_report: wrote {d}/tables.md and {d}/per_layer.svg")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
