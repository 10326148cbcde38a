"""python/tests_vllm: kvscore inside vLLM's CPU build (docs/guides/vllm.md), run by scripts/test_vllm.sh in
.venv-vllm. Every test skips with a clear message where vLLM cannot be imported; the engine tests
need SmolLM2 as safetensors (KVSCORE_VLLM_MODEL, made by scripts/smollm2_safetensors.sh)."""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except Exception as e:  # noqa: BLE001 (any import failure means: no vLLM here)
    HAVE_VLLM = False
    WHY = f"vLLM is not importable here ({type(e).__name__}: {e}); scripts/test_vllm.sh installs it"

HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    # the serving tests last: in README command (2) the vLLM tests start beside the C++ build and
    # ctest, and the serving test's two servers, each bound to one core, lose the most to them
    items.sort(key=lambda item: item.path.name == "test_serve.py")
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
    return run_engines(spec, timeout=timeout)[0]


def run_engines(*specs, timeout=900):
    """Engines in their own processes, all at once; their JSON results in order. An engine's
    result depends only on its own steps (stepwise, greedy), not on the others beside it: run
    together, their start-ups (one-threaded imports and model loads) and small-batch steps fill
    both cores instead of one."""
    # output into files, not pipes: a pipe left unread while the first engine is waited for
    # would stall the others once it fills (vLLM logs much)
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in specs]
    procs = [subprocess.Popen([sys.executable, str(HERE / "engine_run.py"), json.dumps(s)], stdout=o, stderr=e,
                              text=True) for s, (o, e) in zip(specs, files)]
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = []
    for o, e in files:
        o.seek(0)
        e.seek(0)
        outs.append((o.read(), e.read()))
        o.close()
        e.close()
    results = []
    for p, (out, err) in zip(procs, outs):
        r = next((json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")), None)
        if r is None:
            raise AssertionError(f"engine_run.py failed (exit {p.returncode}):\n{out[-3000:]}\n{err[-6000:]}")
        results.append(r)
    return results


def engine_error(spec, timeout=600):
    """The stderr of an engine that must fail to start."""
    p = subprocess.run([sys.executable, str(HERE / "engine_run.py"), json.dumps(spec)], capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode != 0, "the engine started"
    return p.stdout + p.stderr


@pytest.fixture(scope="session")
def tiny_llama(model_dir, tmp_path_factory):
    """A random-weight Llama whose heads split over 2 ranks (4 query, 2 KV heads, head_dim 64, 4
    layers; SmolLM2's 9 query heads cannot be split in 2) and whose positions reach 20K (SmolLM2's
    stop at 8K: the 16K chunked-prefill test): made here with transformers, SmolLM2's tokenizer;
    safetensors."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=20480,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, torch_dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    d = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)
