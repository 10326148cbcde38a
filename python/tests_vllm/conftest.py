"""python/tests_vllm: kvscore inside vLLM's CPU build (docs/vllm.md), run by scripts/test_vllm.sh in
.venv-vllm. Every test skips with a clear message where vLLM cannot be imported; the engine tests
need SmolLM2 as safetensors (KVSCORE_VLLM_MODEL, made by scripts/smollm2_safetensors.sh)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except Exception as e:  # noqa: BLE001 (any import failure means: no vLLM here)
    HAVE_VLLM = False
    WHY = f"vLLM is not importable here ({type(e).__name__}: {e}); scripts/test_vllm.sh installs it"

HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    if not HAVE_VLLM:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=WHY))


@pytest.fixture(scope="session")
def model_dir():
    d = os.environ.get("KVSCORE_VLLM_MODEL")
    if not d or not pathlib.Path(d, "config.json").exists():
        pytest.skip("KVSCORE_VLLM_MODEL is not a model folder (scripts/smollm2_safetensors.sh makes one)")
    return d


def run_engine(spec, timeout=900):
    """One engine in its own process (engine_run.py); returns its JSON result."""
    p = subprocess.run([sys.executable, str(HERE / "engine_run.py"), json.dumps(spec)], capture_output=True,
                       text=True, timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"engine_run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")


def engine_error(spec, timeout=600):
    """The stderr of an engine that must fail to start."""
    p = subprocess.run([sys.executable, str(HERE / "engine_run.py"), json.dumps(spec)], capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode != 0, "the engine started"
    return p.stdout + p.stderr
