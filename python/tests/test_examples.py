"""The Python snippets of README.md and docs/ are marked regions of examples/python/*.py, and those
programs run here: a snippet cannot use a name it does not define. A ```python block that is not
one says why (`<!-- not an example: ... -->` right above it), as tests/test_tree.cpp asks of C++."""

import pathlib
import re
import runpy
import textwrap

import pytest

ROOT = pathlib.Path(__file__).parents[2]
DOCS = [ROOT / "README.md", ROOT / "python" / "README.md",
        *sorted(p for p in (ROOT / "docs").rglob("*.md") if "logs" not in p.relative_to(ROOT).parts)]
# <!-- example: examples/python/FILE.py#REGION --> right above the fenced block it shows
MARKED = re.compile(r"<!-- example: (\S+?)#([\w-]+) -->\n```python\n(.*?)```", re.S)
EXEMPT = re.compile(r"<!-- not an example: [^\n]+ -->\n```python\n")


def region(path: pathlib.Path, name: str) -> str:
    """The lines between `# [name:begin]` and `# [name:end]`, dedented."""
    m = re.search(rf"^[ \t]*# \[{name}:begin\]\n(.*?)^[ \t]*# \[{name}:end\]", path.read_text(), re.S | re.M)
    assert m, f"{path.name} has no region '{name}'"
    return textwrap.dedent(m.group(1))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_snippet_of_the_docs_is_an_example_region(doc):
    text = doc.read_text()
    marked = MARKED.findall(text)
    fences = re.findall(r"^```python$", text, re.M)
    assert len(marked) + len(EXEMPT.findall(text)) == len(fences), \
        f"{doc.name}: a ```python block without an example marker or a reason"
    for path, name, code in marked:
        assert code == region(ROOT / path, name), f"{doc.name}: the snippet differs from {path}#{name}"


def test_quickstart_example_runs():
    pytest.importorskip("torch")
    pytest.importorskip("kvpress")  # README's quickstart ends with a press
    runpy.run_path(str(ROOT / "examples/python/quickstart.py"), run_name="__main__")


def test_press_example_runs():
    pytest.importorskip("transformers")
    pytest.importorskip("kvpress")
    runpy.run_path(str(ROOT / "examples/python/press.py"), run_name="__main__")


def test_passkey_hf_full_heads_select_matches_numpy():
    """examples/llama_cpp/passkey_hf.py's full_heads allocation (docs/methods/kvzip.md, "How few heads need the
    whole context") against a numpy brute force: the global top-k's widest rows keep every token, the
    others their own top tokens, the first `sinks` positions kept everywhere."""
    torch = pytest.importorskip("torch")
    import sys
    import types

    import numpy as np

    sys.path.insert(0, str(ROOT / "examples/llama_cpp"))
    try:
        from passkey_hf import full_heads_select
    finally:
        sys.path.pop(0)
    L, H, n, m, sinks, ratio = 4, 3, 50, 2, 4, 0.75
    scores = torch.from_numpy(np.random.default_rng(7).random((L, H, n), dtype=np.float32))
    kept, rows = full_heads_select(types.SimpleNamespace(compression_ratio=ratio, sinks=sinks, recent=0, alpha=0.0),
                                   scores, m)
    s = scores.numpy().reshape(L * H, n)
    total = L * H * n - int(L * H * n * ratio)
    free = s[:, sinks:]  # the global top-k over the unprotected entries (random floats: no ties)
    threshold = np.sort(free, axis=None)[::-1][total - L * H * sinks - 1]
    counts = sinks + (free >= threshold).sum(1)
    order = sorted(range(L * H), key=lambda r: (-counts[r], r))
    assert rows[:m] == [list(divmod(r, H)) for r in order[:m]]
    rest = (total - m * n) // (L * H - m)
    for r in range(L * H):
        got = kept[r // H][r % H].numpy()
        if r in order[:m]:
            want = np.arange(n)
        else:
            want = np.sort(np.concatenate([np.arange(sinks), sinks + np.argsort(-s[r, sinks:])[:rest - sinks]]))
        np.testing.assert_array_equal(got, want)
    assert sum(len(h) for layer in kept for h in layer) <= total
