"""The Python package against the C++ registry: python/kvscore and python/src name no method and
write no default of their own; both come from include/kvscore/methods.hpp, make_scorer.hpp,
make_method.hpp and the option structs, through kvscore._kvscore (as tests/test_tree.cpp checks
for tools/ and the evaluator)."""

import ast
import inspect
import pathlib
import re

import pytest

import kvscore
from kvscore import _kvscore

ROOT = pathlib.Path(__file__).parents[2]
PACKAGE = sorted((ROOT / "python" / "kvscore").glob("*.py"))
BINDINGS = sorted((ROOT / "python" / "src").glob("*.cpp"))
ALLOWED = {0, 1, -1}  # 0 or 1 (off, serial, all, ...) and -1 (the last axis) are no method's choice


def _name_pattern():
    spellings = []
    for m in kvscore.REGISTRY:
        spellings += [m["name"], m["cli"], *m["aliases"]]
    alternatives = "|".join(re.escape(s) for s in sorted(set(spellings), key=len, reverse=True))
    # a spelling as a word: not part of an identifier, a path ("docs/methods/ojakv.md") or a flag
    return re.compile(r"(^|[^A-Za-z0-9_./-])(" + alternatives + r")(?![A-Za-z0-9_/-]|\.[a-z])")


NAME = _name_pattern()


# ------------------------------------------------------------------ Python sources

def _docstrings(tree):
    """The docstring nodes of a module, its classes and functions (documentation, not code)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _numbers(node):
    """The numeric literals of a default: a number, a negated one, or a tuple / list of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return [node.value]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return [-v for v in _numbers(node.operand)]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [v for e in node.elts for v in _numbers(e)]
    return []


def scan_python(src: str):
    """(method names in string literals, written defaults) of a Python source, as 'line: what'.

    Defaults: a number other than 0 or 1 as a parameter's default, as the fallback of
    .get(key, N) / .pop(key, N) / getattr(x, name, N), as a keyword argument or as a class
    attribute."""
    tree = ast.parse(src)
    docs = _docstrings(tree)
    names, defaults = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            for m in NAME.finditer(node.value):
                names.append(f"{node.lineno}: {m.group(2)} in {node.value!r}")
        found = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found += [d for d in node.args.defaults + node.args.kw_defaults if d is not None]
        elif isinstance(node, ast.Call):
            fn = node.func
            attr = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if attr in ("get", "pop", "setdefault") and len(node.args) >= 2:
                found.append(node.args[1])
            if attr == "getattr" and len(node.args) >= 3:
                found.append(node.args[2])
            found += [k.value for k in node.keywords]
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                    found.append(stmt.value)
        for d in found:
            for v in _numbers(d):
                if v not in ALLOWED:
                    defaults.append((d.lineno, d.col_offset, f"{d.lineno}: {ast.unparse(d)}"))
    return names, [text for _, _, text in sorted(defaults)]


# ------------------------------------------------------------------ C++ bindings

def string_literals(src: str):
    """Every "..." literal of a C++ source with its line (comments and character literals skipped)."""
    out, line, i = [], 1, 0
    while i < len(src):
        c = src[i]
        if c == "\n":
            line += 1
        elif src.startswith("//", i):
            i = src.find("\n", i) - 1 if "\n" in src[i:] else len(src)
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            line += src.count("\n", i, j)
            i = j + 1
        elif c == "'":
            i += 1
            while src[i] != "'":
                i += 2 if src[i] == "\\" else 1
        elif c == '"':
            j, lit = i + 1, []
            while src[j] != '"':
                lit.append(src[j:j + 2] if src[j] == "\\" else src[j])
                j += 2 if src[j] == "\\" else 1
            out.append((line, "".join(lit)))
            i = j
        i += 1
    return out


ARG_DEFAULT = re.compile(r'"(\w+)"_a\s*=\s*(-?[0-9][0-9.eE+]*)')


def scan_cpp(src: str):
    """(method names in string literals, written argument defaults "name"_a = N) of a binding source."""
    names = [f"{line}: {m.group(2)} in {lit!r}" for line, lit in string_literals(src) for m in NAME.finditer(lit)]
    defaults = [m.group(0) for m in ARG_DEFAULT.finditer(src) if float(m.group(2)) not in ALLOWED]
    return names, defaults


# ------------------------------------------------------------------ the checks

@pytest.mark.parametrize("path", PACKAGE + BINDINGS, ids=lambda p: p.name)
def test_the_package_names_no_method_and_writes_no_default(path):
    assert PACKAGE and BINDINGS
    scan = scan_python if path.suffix == ".py" else scan_cpp
    names, defaults = scan(path.read_text())
    assert names == [], f"{path.name} names methods outside the registry (kvscore.REGISTRY)"
    assert defaults == [], f"{path.name} writes defaults the registry or the option structs hold"


def test_the_scan_finds_a_method_name_and_a_written_default():
    py = '''"""Docstring: knorm and window=4096 are documentation."""
METHODS = {"knorm": 1, "l2": 2}
def f(window=4096, *, sinks=4, threads=0, tail="merge", keep=(0.1, 1)):
    """snapkv here is fine."""
    return opts.get("window", 64), opts.get("n", 1), g(kernel=5), f"use {x} or windowed-l2"
class P:
    window: int = 64
    name = "docs/methods/ojakv.md"
'''
    names, defaults = scan_python(py)
    assert names == ["2: knorm in 'knorm'", "2: l2 in 'l2'", "5: windowed-l2 in ' or windowed-l2'"]
    assert defaults == ["3: 4096", "3: 4", "3: (0.1, 1)", "5: 64", "5: 5", "7: 64"]
    cpp = '''// "knorm" in a comment
m.def("f", [] {}, "window"_a = 4096, "threads"_a = 0, "alpha"_a = 0.2, "k"_a = def.k);
const char* a = "use snapkv, l2 or windowed-l2."; /* "l2" */ char c = '"';
'''
    names, defaults = scan_cpp(cpp)
    assert names == ["3: snapkv in 'use snapkv, l2 or windowed-l2.'", "3: l2 in 'use snapkv, l2 or windowed-l2.'",
                     "3: windowed-l2 in 'use snapkv, l2 or windowed-l2.'"]
    assert defaults == ['"window"_a = 4096', '"alpha"_a = 0.2']


def test_python_defaults_are_the_registrys():
    # the values behind the signatures: what the grep above forces them to be read from
    sig = lambda f, p: inspect.signature(f).parameters[p].default  # noqa: E731
    assert sig(kvscore.WindowedManifoldL2, "window") == _kvscore.kDefaultWindow
    assert sig(kvscore.SnapKV, "window") == _kvscore.kDefaultSnapKVWindow
    assert sig(kvscore.SnapKV, "kernel") == _kvscore.kDefaultSnapKVKernel
    assert sig(kvscore.ProtoKV, "kappa") == _kvscore.kDefaultProtoKVKappa
    assert sig(kvscore.ProtoKV, "sat_candidates") == _kvscore.kDefaultProtoKVSatCandidates
    assert sig(kvscore.ProtoKV, "lsh_bits") == _kvscore.kDefaultProtoKVLshBits
    assert sig(kvscore.ProtoKV, "chunks") == _kvscore.kDefaultProtoKVChunks
    assert sig(kvscore.StreamingLLM, "sinks") == _kvscore.kDefaultSinks
    assert sig(kvscore.ParisKVCache, "local") == _kvscore.kDefaultParisKVLocal
    assert sig(kvscore.ParisKVCache, "sinks") == _kvscore.kDefaultSinks
    # and the headers' values, read from include/kvscore/methods.hpp
    hdr = (ROOT / "include/kvscore/methods.hpp").read_text()
    for name in ("kDefaultWindow", "kDefaultSnapKVWindow", "kDefaultSnapKVKernel", "kDefaultProtoKVKappa",
                 "kDefaultProtoKVSatCandidates", "kDefaultProtoKVLshBits", "kDefaultProtoKVChunks", "kDefaultSinks",
                 "kDefaultParisKVLocal"):
        m = re.search(rf"constexpr (?:std::int64_t|int) {name} = (\d+);", hdr)
        assert m and int(m.group(1)) == getattr(_kvscore, name), name


# ------------------------------------------------------------------ one version

def test_the_package_version_is_the_cpp_version():
    """kvscore.__version__ (the C++ string), the installed distribution's version (pyproject.toml's
    regex over the same header) and include/kvscore/version.hpp agree."""
    import importlib.metadata

    header = (ROOT / "include" / "kvscore" / "version.hpp").read_text()
    want = re.search(r'#define KVSCORE_VERSION_STRING "([^"]+)"', header).group(1)
    assert kvscore.__version__ == want
    assert importlib.metadata.version("kvscore") == want


# ------------------------------------------------------------------ the string options' Literal types

def _accepted(call) -> set:
    """The values the C++ parser lists in its error for a bad value ('a', 'b' or 'c'; or the
    synth kinds' comma list)."""
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value)
    if "expected one of" in msg:
        return set(msg.split("expected one of ")[1].rstrip(")").split(", "))
    tail = msg.split(" must be ")[1]
    quoted = re.findall(r"'([^']+)'", tail)
    return set(quoted) if quoted else set(re.split(r", | or ", tail))


def test_the_literal_types_are_the_values_the_cpp_parsers_accept():
    import typing

    import numpy as np

    s = np.random.default_rng(0).random((2, 10), dtype=np.float32)
    k = np.random.default_rng(1).random((2, 10, 8), dtype=np.float32)
    q = np.random.default_rng(2).random((2, 4, 8), dtype=np.float32)
    calls = {
        "Alloc": lambda: kvscore.select(s, 2, alloc="x"),
        "Tail": lambda: kvscore.compact(k.copy(), k.copy(), kvscore.select(s, 2), tail="x"),
        "Rounding": lambda: kvscore.budget_from_ratio(10, 0.5, rounding="x"),
        "Placement": lambda: kvscore.SnapKV(q, placement="x"),
        "Aggregate": lambda: kvscore.KVzip(q, aggregate="x"),
        "WindowTail": lambda: kvscore.WindowedManifoldL2(tail="x"),
        "JointAggregate": lambda: kvscore.select_joint(s, 2, aggregate="x"),
        "BlockAggregate": lambda: kvscore.select_joint_blocks(s, 2, 2, block_aggregate="x"),
        "Psi": lambda: kvscore.ProtoKV(q, psi="x"),
        "Protocol": lambda: kvscore.evaluate(k[None], k[None], q[None], protocol="x"),
        "MixMetric": lambda: kvscore.evaluate(k[None], k[None], q[None], mix_metric="x"),
        "SynthKind": lambda: kvscore.synth(kind="x"),
        "DType": lambda: kvscore.ParisKVCache(8, dtype="x"),
    }
    for name, call in calls.items():
        assert set(typing.get_args(getattr(kvscore, name))) == _accepted(call), name
