"""tools/dump_kv.py's self-test (`--self-test`) where torch is: in README command 2's venv, never
skipped (ctest ran it with the system python3, which has no torch, so it always skipped there;
issue 35, N4). In-process: the torch and transformers the other tests imported are reused."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[2]


def test_dump_kv_self_test_runs_for_real(monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = importlib.util.spec_from_file_location("dump_kv", ROOT / "tools/dump_kv.py")
    dump_kv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dump_kv)
    # 0 = ok (1 failed, 77 skipped): this environment has torch and transformers, so no skip
    assert dump_kv.self_test() == 0
