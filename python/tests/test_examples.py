"""The Python snippets of README.md and docs/python.md are marked regions of examples/python/*.py,
and those programs run here: a snippet cannot use a name it does not define (issue 35, D5)."""

import pathlib
import re
import runpy
import textwrap

import pytest

ROOT = pathlib.Path(__file__).parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "python.md", ROOT / "docs" / "generation.md"]
# <!-- example: examples/python/FILE.py#REGION --> right above the fenced block it shows
MARKED = re.compile(r"<!-- example: (\S+?)#([\w-]+) -->\n```python\n(.*?)```", re.S)


def region(path: pathlib.Path, name: str) -> str:
    """The lines between `# [name:begin]` and `# [name:end]`, dedented."""
    m = re.search(rf"^[ \t]*# \[{name}:begin\]\n(.*?)^[ \t]*# \[{name}:end\]", path.read_text(), re.S | re.M)
    assert m, f"{path.name} has no region '{name}'"
    return textwrap.dedent(m.group(1))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_python_snippet_of_the_docs_is_an_example_region(doc):
    text = doc.read_text()
    marked = MARKED.findall(text)
    assert len(marked) == text.count("```python"), f"{doc.name}: a ```python block without an example marker"
    assert marked
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
