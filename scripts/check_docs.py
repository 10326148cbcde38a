#!/usr/bin/env python3
"""The documentation's own checks (stdlib only; CI runs it: .ci/run, lane b).

  python3 scripts/check_docs.py          # exit 1 and one line per finding, 0 when clean

1. Every relative link of a Markdown page (README.md, CHANGELOG.md, docs/**, cuda/README.md, ...)
   names a file or folder of the repository, and its #anchor a heading of that page (GitHub's
   slugs) or an explicit <a id="...">.
2. Every `docs/...` path that a source file, script or page names (a comment, a docstring, a
   string) exists, and its #anchor too; a glob (`docs/results/logs/vllm/2026-11-28-decode-b.*`)
   matches at least one file.
3. No page refers to what only its authors' set-up has: `../shared/...`, "issue N" (no tracker
   ships with the repository), "this task".
4. Every page under docs/ is reachable from docs/index.md by links (the way in).
5. README.md fits one screen before its set-up section (at most README_SCREEN lines).
6. docs/reference/api.md's internal headers are scripts/doxygen/Doxyfile's EXCLUDE list, and
   every other header of include/kvscore is named in its stable list.

The C++ and Python snippets of the pages are compiled and run by the tests (tests/test_tree.cpp
with tests/test_snippets.cpp, python/tests/test_examples.py), not here.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_SCREEN = 60
SETUP_HEADING = "## Set-up commands"

# Files of a parallel branch that still name pages by paths docs/ no longer has, while that branch
# is open (the old -> new paths: docs/index.md, "Where a page moved"): their findings are printed,
# not counted. None now.
PENDING: set[str] = set()
PENDING_PREFIXES: tuple[str, ...] = ()

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!\!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
MENTION = re.compile(r"(?<![\w/.-])docs/[\w./*{},-]*[\w*}/](?:#[\w-]+)?")
OUTSIDE = [
    (re.compile(r"\.\./shared\b"), "a path outside the repository (../shared)"),
    (re.compile(r"\b[Ii]ssues? \d+"), "an issue number (no tracker ships with the repository)"),
    (re.compile(r"\bthis task\b", re.I), "'this task'"),
]


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    return sorted(f for f in out if f and (ROOT / f).is_file())


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


_anchors: dict[Path, set[str]] = {}


def anchors(page: Path) -> set[str]:
    if page not in _anchors:
        text = FENCE.sub("", page.read_text(encoding="utf-8"))
        seen: dict[str, int] = {}
        found = set(EXPLICIT_ANCHOR.findall(text))
        for m in HEADING.finditer(text):
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
        _anchors[page] = found
    return _anchors[page]


def check_target(source: Path, target: str, base: Path) -> str | None:
    """None if `target` (relative to `base`) exists with its anchor; else what is wrong."""
    path, _, anchor = target.partition("#")
    dest = (base / path).resolve() if path else source
    if path and ("*" in path or "{" in path):
        pattern = re.sub(r"\{[^}]*\}", "*", str(base / path))
        return None if glob.glob(pattern) else f"no file matches {target}"
    try:
        dest.relative_to(ROOT)
    except ValueError:
        return f"{target} leaves the repository"
    if not dest.exists():
        return f"{target}: no such file"
    if anchor:
        if dest.is_dir() or dest.suffix != ".md":
            return f"{target}: an anchor into a file that is not a page"
        if anchor not in anchors(dest):
            return f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}"
    return None


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def blank_code(text: str) -> str:
    """The text with fenced blocks and inline code blanked (same length: positions keep their lines)."""
    def keep_newlines(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))
    return INLINE_CODE.sub(keep_newlines, FENCE.sub(keep_newlines, text))


def check_api_lists() -> list[str]:
    """api.md's stable / internal blocks against the Doxyfile and the headers on disk."""
    api = (ROOT / "docs/reference/api.md").read_text(encoding="utf-8")
    doxy = (ROOT / "scripts/doxygen/Doxyfile").read_text(encoding="utf-8")
    m = re.search(r"^EXCLUDE\s*=(.*?)(?=^\S)", doxy, re.M | re.S)
    excluded = set(m.group(1).replace("\\", " ").split()) if m else set()
    block = lambda name: (re.search(rf"<!-- {name}: begin -->(.*?)<!-- {name}: end -->", api, re.S) or [None, ""])[1]
    internal = set(re.findall(r"`(include/kvscore/[\w/.]+)`", block("internal")))
    out = []
    if internal != excluded:
        out.append(f"docs/reference/api.md: the internal list and scripts/doxygen/Doxyfile's EXCLUDE differ: "
                   f"only in the page {sorted(internal - excluded)}, only in the Doxyfile {sorted(excluded - internal)}")
    stable = block("stable")
    for h in sorted((ROOT / "include/kvscore").rglob("*.hpp")):
        rel = h.relative_to(ROOT).as_posix()
        if h.name.endswith("_impl.hpp") or any(rel == x or rel.startswith(x + "/") for x in internal):
            continue
        if h.name not in stable:
            out.append(f"docs/reference/api.md: {rel} is neither in the stable list nor internal")
    return out


def main() -> int:
    files = tracked()
    pages = [f for f in files if f.endswith(".md")]
    errors: list[str] = []
    pending: list[str] = []

    for rel in pages:
        page = ROOT / rel
        text = page.read_text(encoding="utf-8")
        prose = blank_code(text)
        for m in LINK.finditer(prose):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            why = check_target(page, target, page.parent)
            if why:
                errors.append(f"{rel}:{line_of(text, m.start())}: link {why}")
        for rx, what in OUTSIDE:
            for m in rx.finditer(prose):
                if rel.startswith("docs/results/logs/"):
                    continue
                errors.append(f"{rel}:{line_of(text, m.start())}: {what}: '{m.group(0)}'")

    for rel in files:
        if rel.startswith("docs/results/logs/") or rel == "scripts/check_docs.py":
            continue
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for m in MENTION.finditer(text):
            target = m.group(0).rstrip(".,;:")
            why = check_target(ROOT / rel, target, ROOT)
            if why:
                msg = f"{rel}:{line_of(text, m.start())}: names {why}"
                (pending if rel in PENDING or rel.startswith(PENDING_PREFIXES) else errors).append(msg)

    # the way in: every page reachable from docs/index.md
    index = ROOT / "docs" / "index.md"
    if not index.exists():
        errors.append("docs/index.md: missing (the way in)")
    else:
        seen, todo = set(), [index]
        while todo:
            page = todo.pop()
            if page in seen:
                continue
            seen.add(page)
            for m in LINK.finditer(blank_code(page.read_text(encoding="utf-8"))):
                target = (m.group(1) or m.group(2)).partition("#")[0]
                if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):
                    continue
                dest = (page.parent / target).resolve()
                if dest.suffix == ".md" and dest.is_file() and "docs" in dest.relative_to(ROOT).parts[:1]:
                    todo.append(dest)
        for rel in pages:
            if rel.startswith("docs/") and not rel.startswith("docs/results/logs/") and (ROOT / rel).resolve() not in seen:
                errors.append(f"{rel}: not reachable from docs/index.md")

    readme = (ROOT / "README.md").read_text(encoding="utf-8").split("\n")
    first = next((i for i, line in enumerate(readme) if line.startswith(SETUP_HEADING)), None)
    if first is None:
        errors.append(f"README.md: no '{SETUP_HEADING}' section")
    elif first > README_SCREEN:
        errors.append(f"README.md: {first} lines before '{SETUP_HEADING}' (one screen: at most {README_SCREEN})")

    errors += check_api_lists()

    for e in errors:
        print(e)
    for p in pending:
        print(f"pending (a parallel branch's file): {p}")
    print(f"check_docs: {len(pages)} pages, {len(errors)} findings, {len(pending)} pending")
    return 1 if errors else 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
