"""CUDA tensors in kvscore without a GPU (issue 48; docs/reference/python.md "CUDA tensors").

What can be checked on a machine with no GPU, and is, in every build:
  * kvscore.cuda_available() / cuda_status() never raise and never import torch; the reason is
    the right one (checked against an independent look for the driver);
  * a CPU-only build (no kvscore._kvscore_cuda: the default wheel, or the module hidden) names
    the build switch for every CUDA tensor it is given; the CPU-only functions (select_joint,
    evaluate, calibrate_qfilters, ...) name the device and never copy;
  * with the CUDA module built (CI builds it in its CUDA step), every argument is checked before
    any CUDA call, with the messages of the CPU module: fake CUDA arrays (DLPack capsules that
    point at no memory) get the CPU's ValueErrors for the same faults, and valid ones reach the
    CUDA runtime, which says it is not usable here.
What needs a GPU is python/tests/gpu_check.py (scripts/gpu-python-kit.sh runs it on a GPU machine).
"""

import ctypes
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import kvscore
from kvscore import _cuda
from kvscore import _kvscore as _k

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

REASONS = {"available", "not_built", "no_driver", "driver_too_old", "no_device", "arch_not_built", "error"}
BUILT = _cuda._kc is not None
needs_module = pytest.mark.skipif(not BUILT, reason="kvscore._kvscore_cuda not built (KVSCORE_CUDA=1 pip install .)")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=pathlib.Path(__file__).parent.parent.parent.parent)


def _libcuda_loads() -> bool:
    """An independent look for the driver: can this process load libcuda?"""
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def fake_cuda(*shape, dtype=torch.float32):
    with FakeTensorMode():
        return torch.empty(*shape, dtype=dtype, device="cuda")


# ------------------------------------------------------------------ status

def test_cuda_status_never_raises_never_imports_torch_and_names_a_reason():
    r = _run("import sys, kvscore\n"
             "a = kvscore.cuda_available(); s = kvscore.cuda_status()\n"
             "assert 'torch' not in sys.modules, 'cuda_status imported torch'\n"
             "print(a, s['reason'])")
    assert r.returncode == 0, r.stderr
    available, reason = r.stdout.split()
    assert reason in REASONS
    assert (available == "True") == (reason == "available")
    s = kvscore.cuda_status()
    assert set(s) >= {"available", "reason", "message", "driver_version", "runtime_version", "built_architectures",
                      "devices"}
    assert s["message"]
    s["devices"].append("mutated")  # a copy: the cached status is not the caller's to change
    assert "mutated" not in kvscore.cuda_status()["devices"]


def test_cuda_status_gives_the_right_reason_here():
    s = kvscore.cuda_status()
    if not BUILT:
        assert s["reason"] == "not_built" and not kvscore.cuda_available()
        assert "KVSCORE_CUDA=1 pip install ." in s["message"]
        return
    assert s["runtime_version"] >= 12000
    assert s["built_architectures"]
    if not _libcuda_loads():
        assert s["reason"] == "no_driver", s
        assert s["driver_version"] == 0 and s["devices"] == []
        assert not kvscore.cuda_available()
    elif s["reason"] == "available":
        assert any(d["supported"] for d in s["devices"])
    else:
        assert s["reason"] in {"driver_too_old", "no_device", "arch_not_built"}, s


def test_a_module_that_does_not_load_is_an_error_not_a_missing_build(tmp_path):
    pkg = pathlib.Path(kvscore.__file__).parent
    # a broken kvscore._kvscore_cuda (a library it needs is missing): a module that raises ImportError
    (tmp_path / "kvscore").mkdir()
    for f in pkg.iterdir():
        if f.suffix == ".py" or f.name.startswith("_kvscore."):
            (tmp_path / "kvscore" / f.name).symlink_to(f)
    (tmp_path / "kvscore" / "_kvscore_cuda.py").write_text("raise ImportError('libfoo.so: cannot open')\n")
    r = subprocess.run([sys.executable, "-c", "import kvscore; s = kvscore.cuda_status(); print(s['reason']); "
                        "print(s['message'])"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    reason, message = r.stdout.splitlines()[:2]
    assert reason == "error" and "does not load" in message and "libfoo.so" in message


# ------------------------------------------------------------------ a CPU-only build

def test_a_cpu_only_build_names_the_build_switch_for_a_cuda_tensor(monkeypatch):
    # as if built without KVSCORE_CUDA (what kvscore/_cuda.py sets when the module is not there)
    monkeypatch.setattr(_cuda, "_kc", None)
    monkeypatch.setattr(_cuda, "_IMPORT_ERROR", None)
    monkeypatch.setattr(_cuda, "_STATUS", None)
    assert kvscore.cuda_status()["reason"] == "not_built" and not kvscore.cuda_available()
    k, v = fake_cuda(2, 64, 8, dtype=torch.float16), fake_cuda(2, 64, 8, dtype=torch.float16)
    with FakeTensorMode():
        sel = torch.zeros(2, 8, dtype=torch.int64, device="cuda")
    calls = {"score": lambda: kvscore.KNorm().score(k),
             "score_query": lambda: kvscore.SnapKV(fake_cuda(4, 16, 8), window=16),
             "select": lambda: kvscore.select(fake_cuda(2, 64), 8),
             "compact": lambda: kvscore.compact(k, v, sel)}
    for name, f in calls.items():
        with pytest.raises(ValueError) as e:
            f()
        assert "KVSCORE_CUDA=1 pip install ." in str(e.value) and "'cuda:0'" in str(e.value), (name, str(e.value))


def test_cpu_only_functions_name_the_device_and_never_copy():
    k = fake_cuda(2, 64, 8)
    s = fake_cuda(2, 64)
    with pytest.raises(ValueError, match=r"scores: tensor on device 'cuda:0': select_joint runs on the CPU only"):
        kvscore.select_joint(s, 8)
    with pytest.raises(ValueError, match=r"scores\[0\]: tensor on device 'cuda:0': select_joint runs on the CPU"):
        kvscore.select_joint([s, s], 8)
    with pytest.raises(ValueError, match=r"select_joint_blocks runs on the CPU only"):
        kvscore.select_joint_blocks(s, 16, 2)
    with pytest.raises(ValueError, match=r"queries: tensor on device 'cuda:0': calibrate_qfilters runs on the CPU"):
        kvscore.calibrate_qfilters(fake_cuda(4, 16, 8), 2)
    with pytest.raises(ValueError, match=r"K: tensor on device 'cuda:0': evaluate runs on the CPU only"):
        kvscore.evaluate(k, k, k)
    with pytest.raises(ValueError, match=r"keys: tensor on device 'cuda:0': ParisKV runs on the CPU only"):
        kvscore.ParisKV(8).append(fake_cuda(16, 8))


def test_python_argument_checks_come_before_the_device():
    s = fake_cuda(2, 64)
    with pytest.raises(TypeError, match="budget must be an integer"):
        kvscore.select(s, 1.5)
    with pytest.raises(ValueError, match="window 0 must be >= 1"):
        kvscore.SnapKV(fake_cuda(4, 16, 8), window=0)
    with pytest.raises(ValueError, match="this scorer takes no queries"):
        kvscore.KNorm().score(fake_cuda(2, 64, 8), queries=fake_cuda(4, 16, 8))


# ------------------------------------------------------------------ the CUDA module, no GPU

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManaged(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DTYPES = {"float32": (2, 32), "float16": (2, 16), "bfloat16": (4, 16), "float64": (2, 64), "int64": (0, 64),
           "uint8": (1, 8)}


class FakeDeviceArray:
    """A DLPack producer of an array "in CUDA memory" at a made-up address: the module reads its
    shape, strides and dtype (enough for every argument check) and never its memory, since
    without a driver the first CUDA call fails."""

    def __init__(self, shape, dtype="float32", strides=None, device=(2, 0), address=1 << 20):
        self.shape = tuple(shape)
        if strides is None:
            strides, acc = [], 1
            for n in reversed(self.shape):
                strides.insert(0, acc)
                acc *= n
        self._shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self._strides = (ctypes.c_int64 * max(len(shape), 1))(*strides)
        code, bits = _DTYPES[dtype]
        self._m = _DLManaged(_DLTensor(address, _DLDevice(*device), len(shape), _DLDataType(code, bits, 1),
                                       self._shape, self._strides, 0), None, None)

    def __dlpack__(self, **kwargs):
        return _PyCapsule_New(ctypes.addressof(self._m), b"dltensor", None)

    def __dlpack_device__(self):
        return (self._m.dl_tensor.device.device_type, self._m.dl_tensor.device.device_id)


def _cpu_error(f) -> str:
    with pytest.raises(ValueError) as e:
        f()
    return str(e.value)


@needs_module
def test_keys_checks_give_the_cpu_messages_before_any_cuda_call():
    sc = _cuda.make_scorer(kvscore.KNorm.name, {})
    cpu = _k.make_scorer(kvscore.KNorm.name, _k.ScorerArgs())
    cases = [  # (fake device keys, the same fault on the host)
        (FakeDeviceArray((2, 64, 8), "float64"), np.zeros((2, 64, 8), np.float64)),
        (FakeDeviceArray((2, 64, 8), strides=(1024, 16, 2)), np.zeros((2, 64, 16), np.float32)[:, :, ::2]),
        (FakeDeviceArray((3, 2, 64, 8)), np.zeros((3, 2, 64, 8), np.float32)),
        (FakeDeviceArray((64, 8)), np.zeros((64, 8), np.float32)),
    ]
    for dev, host in cases:
        want = _cpu_error(lambda: cpu.score(host))
        assert _cpu_error(lambda: sc.workspace_bytes(dev)) == want
        assert _cpu_error(lambda: sc.score(dev, FakeDeviceArray((2, 64)), FakeDeviceArray((0,), "uint8"), 0)) == want
    neg = FakeDeviceArray((2, 64, 8), strides=(512, -8, 1))
    assert "stride -8 of dimension 1 is negative" in _cpu_error(lambda: sc.workspace_bytes(neg))
    host_keys = FakeDeviceArray((2, 64, 8), device=(1, 0))
    assert "expected an array in CUDA memory" in _cpu_error(lambda: sc.workspace_bytes(host_keys))
    # the policy's own checks (Q-Filters: kv_heads) before any CUDA call too
    qf = _cuda.make_scorer(kvscore.QFilter.name, {}, filters=np.ones((3, 8), np.float32))
    assert "kv_heads 3" in _cpu_error(lambda: qf.workspace_bytes(FakeDeviceArray((2, 64, 8))))
    # valid arguments reach CUDA, which is not usable here: an error, not a crash
    if not kvscore.cuda_available():
        with pytest.raises(RuntimeError, match="CUDA is not usable in this process"):
            sc.score(FakeDeviceArray((2, 64, 8)), FakeDeviceArray((2, 64)), FakeDeviceArray((0,), "uint8"), 0)
    # and a batch of rows is a batched call's (the presses'), one view when the strides allow it
    assert sc.workspace_bytes(FakeDeviceArray((3, 2, 64, 8)), True) == 0  # K-norm needs no workspace


@needs_module
def test_snapkv_device_queries_checks_give_the_cpu_messages():
    kc = _cuda._kc
    keys = FakeDeviceArray((2, 10, 8))
    q = FakeDeviceArray((4, 16, 8))
    host_q = np.ones((4, 16, 8), np.float32)
    cpu_keys = np.zeros((2, 10, 8), np.float32)
    want = _cpu_error(lambda: kvscore.SnapKV(host_q, window=16).score(cpu_keys))
    assert "window 16 > tokens 10" in want
    assert _cpu_error(lambda: kc.snapkv_workspace_bytes(keys, q, 16, 5, "in_cache")) == want
    assert kc.snapkv_workspace_bytes(keys, q, 16, 5, "after_cache") > 0  # after the cache: any window
    assert kc.snapkv_protected_recent(q, 16, 5, "in_cache") == 16
    assert kc.snapkv_protected_recent(q, 64, 5, "after_cache") == 0
    want = _cpu_error(lambda: kvscore.SnapKV(np.ones((3, 16, 8), np.float32), window=8).score(cpu_keys))
    assert _cpu_error(lambda: kc.snapkv_workspace_bytes(keys, FakeDeviceArray((3, 16, 8)), 8, 5, "in_cache")) == want
    want = _cpu_error(lambda: kvscore.SnapKV(host_q, window=8, kernel=4).score(cpu_keys))
    assert _cpu_error(lambda: kc.snapkv_workspace_bytes(keys, q, 8, 4, "in_cache")) == want
    want = _cpu_error(lambda: kvscore.SnapKV(np.ones((4, 16, 8), np.float64), window=8))
    assert _cpu_error(lambda: kc.snapkv_workspace_bytes(keys, FakeDeviceArray((4, 16, 8), "float64"), 8, 5,
                                                        "in_cache")) == want
    assert "placement" in _cpu_error(lambda: kc.snapkv_workspace_bytes(keys, q, 8, 5, "nowhere"))
    # the batched form: queries [batch, q_heads, n, d] with the keys' batch
    assert kc.snapkv_workspace_bytes(FakeDeviceArray((3, 2, 40, 8)), FakeDeviceArray((3, 4, 16, 8)), 8, 5,
                                     "in_cache", True) > 0
    assert "batch 2 but the keys have batch 3" in _cpu_error(
        lambda: kc.snapkv_workspace_bytes(FakeDeviceArray((3, 2, 40, 8)), FakeDeviceArray((2, 4, 16, 8)), 8, 5,
                                          "in_cache", True))
    if not kvscore.cuda_available():
        with pytest.raises(RuntimeError, match="CUDA is not usable"):
            kc.score_snapkv(FakeDeviceArray((2, 40, 8)), q, 8, 5, "in_cache", FakeDeviceArray((2, 40)),
                            FakeDeviceArray((1 << 20,), "uint8"), 0)


@needs_module
def test_select_and_compact_checks_give_the_cpu_messages():
    kc = _cuda._kc
    s = FakeDeviceArray((2, 10))
    host = np.zeros((2, 10), np.float32)
    for budget, kw in [(11, {}), (5, {"sinks": 4, "recent": 4}), (5, {"alloc": "sideways"}),
                       (5, {"alloc": "adakv", "alpha": 2.0}), (-1, {})]:
        want = _cpu_error(lambda: kvscore.select(host, budget, **kw))
        args = dict(sinks=0, recent=0, alloc="per_head", alpha=0.2, normalize=False, threads=0)
        args.update(kw)
        assert _cpu_error(lambda: kc.select_plan(s, budget, **args)) == want, (budget, kw)
    assert _cpu_error(lambda: kc.select_plan(FakeDeviceArray((2, 10), "float16"), 5)) == \
        _cpu_error(lambda: kvscore.select(host.astype(np.float16), 5))
    assert _cpu_error(lambda: kc.select_plan(FakeDeviceArray((2, 10), strides=(20, 2)), 5)) == \
        _cpu_error(lambda: kvscore.select(np.zeros((2, 20), np.float32)[:, ::2], 5))
    # AdaKV z-scores run on the GPU now; a batch of layers plans each layer
    assert kc.select_plan(s, 5, alloc="adakv", normalize=True)[1:] == (10, False)
    assert kc.select_plan(FakeDeviceArray((6, 10)), 4, batch=3)[1:] == (24, True)
    assert "not batch 4 x heads" in _cpu_error(lambda: kc.select_plan(FakeDeviceArray((6, 10)), 4, batch=4))
    # compact: the CPU's checks of keys and values, then the selection (which needs the device)
    ws = FakeDeviceArray((kc.selection_check_workspace_bytes(),), "uint8")
    off, pos = FakeDeviceArray((3,), "int64"), FakeDeviceArray((4,), "int64")
    k, v = FakeDeviceArray((2, 10, 8)), FakeDeviceArray((2, 9, 8), address=1 << 24)
    want = _cpu_error(lambda: kvscore.compact(np.zeros((2, 10, 8), np.float32), np.zeros((2, 9, 8), np.float32),
                                              np.zeros((2, 2), np.int64)))
    assert _cpu_error(lambda: kc.compact(k, v, off, pos, "keep", True, ws, 0)) == want
    assert "tail 'middle'" in _cpu_error(lambda: kc.compact(k, k, off, pos, "middle", True, ws, 0))
    assert "same memory" in _cpu_error(lambda: kc.compact(k, k, off, pos, "keep", True, ws, 0))
    v = FakeDeviceArray((2, 10, 8), address=1 << 24)
    assert "selection has 3 heads but the cache has 2" in _cpu_error(
        lambda: kc.compact(k, v, FakeDeviceArray((4,), "int64"), pos, "keep", True, ws, 0))
    if not kvscore.cuda_available():
        with pytest.raises(RuntimeError, match="CUDA is not usable"):
            kc.compact(k, v, off, pos, "keep", True, ws, 0)


@needs_module
def test_device_arrays_of_one_call_must_share_a_device():
    kc = _cuda._kc
    sc = _cuda.make_scorer(kvscore.KNorm.name, {})
    with pytest.raises(ValueError, match="scores is on cuda:1 but the keys are on cuda:0"):
        sc.score(FakeDeviceArray((2, 64, 8)), FakeDeviceArray((2, 64), device=(2, 1)), FakeDeviceArray((0,), "uint8"),
                 0)
    with pytest.raises(ValueError, match="queries is on cuda:1"):
        kc.score_snapkv(FakeDeviceArray((2, 40, 8)), FakeDeviceArray((4, 16, 8), device=(2, 1)), 8, 5, "in_cache",
                        FakeDeviceArray((2, 40)), FakeDeviceArray((1 << 20,), "uint8"), 0)


def test_the_gpu_check_runs_where_a_gpu_is():
    if not kvscore.cuda_available():
        pytest.skip(f"no usable GPU here ({kvscore.cuda_status()['reason']}): python/tests/gpu_check.py runs on a "
                    "GPU machine (scripts/gpu-python-kit.sh)")
    r = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("gpu_check.py")), "--quick"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------ the presses' CUDA path, emulated on the host

class HostBackend:
    """kvscore._cuda's entry points done by the CPU module on CPU tensors, every torch tensor
    taken for a CUDA one: the presses' device path (one call per layer for the whole batch, the
    batched selection's CSR, kvpress's gather, AdaKV's mask built from the CSR with torch ops,
    SnapKV's queries kept where the model left them) runs in kvpress's pipeline and must leave
    the cache, or the mask, the CPU path leaves. The kernels themselves: gpu_check.py, on a GPU."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("is_cuda", "require", "make_scorer", "score", "score_snapkv", "snapkv_protected_recent",
                     "select_csr"):
            monkeypatch.setattr(_cuda, name, getattr(self, name))

    @staticmethod
    def is_cuda(x):
        return isinstance(x, torch.Tensor)

    @staticmethod
    def require(name, x):
        pass

    @staticmethod
    def make_scorer(name, fields, *, queries=None, last=0, filters=None):
        args = _k.ScorerArgs()
        for f, v in fields.items():
            setattr(args, f, v)
        return _k.make_scorer(name, args, queries, last, filters)

    def score(self, impl, keys, *, batched=False):
        self.calls.append(("score", tuple(keys.shape)))
        rows = [keys[b] for b in range(keys.shape[0])] if batched and keys.dim() == 4 else [keys]
        out = [torch.from_numpy(impl.score(k.detach())) for k in rows]
        return torch.stack(out) if batched and keys.dim() == 4 else out[0]

    @staticmethod
    def _snap(q, window, kernel, placement):
        args = _k.ScorerArgs()
        args.kernel_size, args.placement = kernel, placement
        return _k.make_scorer(kvscore.SnapKV.name, args, q.detach().float(), window, None)

    def score_snapkv(self, keys, queries, window, kernel, placement, *, batched=False):
        self.calls.append(("score_snapkv", tuple(keys.shape), tuple(queries.shape)))
        assert batched and queries.dim() == 4 and queries.shape[0] == keys.shape[0]  # one call for the batch
        return torch.stack([torch.from_numpy(self._snap(queries[b], window, kernel, placement).score(keys[b].detach()))
                            for b in range(keys.shape[0])])

    def snapkv_protected_recent(self, queries, window, kernel, placement, *, batched=False):
        return self._snap(queries, window, kernel, placement).protected_recent

    def select_csr(self, scores, budget, *, sinks, recent, alloc, alpha, normalize, threads, batch=1):
        self.calls.append(("select", tuple(scores.shape), batch, alloc))
        heads = scores.shape[0] // batch
        offsets, positions = [0], []
        for b in range(batch):
            sel = _k.select(scores[b * heads:(b + 1) * heads].detach(), budget, sinks=sinks, recent=recent,
                            alloc=alloc, alpha=alpha, normalize=normalize, threads=threads)
            for row in (list(sel) if isinstance(sel, (list, tuple)) else list(sel)):
                positions.append(torch.as_tensor(np.asarray(row)))
                offsets.append(offsets[-1] + len(row))
        return torch.tensor(offsets), torch.cat(positions), alloc == "per_head"


def _model(attn="eager"):  # the tiny Llama of test_presses.py (GQA 8/2, RoPE)
    torch.manual_seed(0)
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn).eval()


def _prefill(model, press, ids):
    transformers = pytest.importorskip("transformers")
    cache = transformers.DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=ids, past_key_values=cache)
    masks = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers], masks


@pytest.mark.parametrize("method,opts", [("knorm", {}), ("keydiff", {}), ("snapkv", {"window": 16}),
                                         ("streaming_llm", {"n_sink": 4}), ("manifold_l2", {"sinks": 2, "recent": 8}),
                                         ("protokv", {"window": 16, "psi": "sum"})])
@pytest.mark.parametrize("alloc", ["per_head", "adakv"])
def test_presses_device_path_leaves_what_the_cpu_path_leaves(monkeypatch, method, opts, alloc):
    pytest.importorskip("kvpress")
    from kvscore.presses import KvscorePress

    model = _model("sdpa" if alloc == "adakv" else "eager")
    ids = torch.randint(0, 256, (2, 120), generator=torch.Generator().manual_seed(3))  # batch 2
    want, want_masks = _prefill(model, KvscorePress(method, 0.6, alloc=alloc, **opts), ids)
    with monkeypatch.context() as m:
        backend = HostBackend(m)
        got, got_masks = _prefill(model, KvscorePress(method, 0.6, alloc=alloc, **opts), ids)
    for (wk, wv), (gk, gv) in zip(want, got):
        torch.testing.assert_close(gk, wk, rtol=0, atol=0)
        torch.testing.assert_close(gv, wv, rtol=0, atol=0)
    for w, g in zip(want_masks, got_masks):
        if alloc == "adakv":
            assert all(torch.equal(a, b) for a, b in zip(w, g))
        else:
            assert w is None and g is None
    calls = [c[0] for c in backend.calls]
    if method != "streaming_llm":  # a selection rule needs no scores
        assert calls.count("select") == 2, backend.calls  # one per layer, the whole batch in one call
        assert all(c[2] == 2 for c in backend.calls if c[0] == "select")
    if method in ("knorm", "keydiff", "manifold_l2"):
        assert calls.count("score") == 2 and all(c[1][0] == 2 for c in backend.calls if c[0] == "score")
    if method == "snapkv":
        assert calls.count("score_snapkv") == 2
