"""python/tests_vllm: kvscore inside vLLM's CPU build (docs/guides/vllm.md), run by scripts/test_vllm.sh in
.venv-vllm. Every test skips with a clear message where vLLM cannot be imported; the engine tests
need SmolLM2 as safetensors (KVSCORE_VLLM_MODEL, made by scripts/smollm2_safetensors.sh)."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

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


class Zygote:
    """engine_run.py --zygote: one process that imported vLLM and torch forks each engine (their
    imports were ~17 s of CPU per engine process, most of a test engine's start)."""

    def __init__(self):
        self.log = tempfile.TemporaryFile("w+")
        self.p = subprocess.Popen([sys.executable, str(HERE / "engine_run.py"), "--zygote"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self.next_id = 0
        self.ready = False  # its imports go on while the first tests run

    def read(self, done, timeout):
        """Protocol lines until done(message) holds; returns that message."""
        import select
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.p.stdout], [], [], left)[0]:
                raise TimeoutError
            line = self.p.stdout.readline()
            if not line:
                self.log.seek(0)
                raise AssertionError(f"the engine zygote exited ({self.p.poll()}):\n{self.log.read()[-6000:]}")
            if line.startswith("ZYGOTE "):
                m = json.loads(line[len("ZYGOTE "):])
                if done(m):
                    return m

    def run(self, specs, files, timeout):
        """Each spec's engine in its own forked child at once; their exit codes in order."""
        if not self.ready:
            self.ready = bool(self.read(lambda m: m.get("ready"), timeout=300))
        ids = list(range(self.next_id, self.next_id + len(specs)))
        self.next_id += len(specs)
        for i, s, (o, e) in zip(ids, specs, files):
            self.p.stdin.write(json.dumps({"id": i, "spec": s, "out": o, "err": e}) + "\n")
        self.p.stdin.flush()
        pids, rcs = {}, {}
        deadline = time.monotonic() + timeout
        try:
            while len(rcs) < len(ids):
                m = self.read(lambda m: m.get("id") in ids, timeout=max(deadline - time.monotonic(), 0.01))
                if "pid" in m:
                    pids[m["id"]] = m["pid"]
                else:
                    rcs[m["id"]] = m["rc"]
        except TimeoutError:
            for i, pid in pids.items():
                if i not in rcs:
                    os.kill(pid, signal.SIGKILL)
            while len(rcs) < len(pids):
                m = self.read(lambda m: m.get("id") in ids and "rc" in m, timeout=60)
                rcs[m["id"]] = m["rc"]
            raise AssertionError(f"an engine ran past {timeout} s") from None
        return [rcs[i] for i in ids]

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=120)


_ZYGOTE = []


def _zygote():
    if os.environ.get("KVSCORE_VLLM_ZYGOTE", "1") == "0":
        return None
    if not _ZYGOTE or _ZYGOTE[0].p.poll() is not None:
        _ZYGOTE[:] = [Zygote()]
    return _ZYGOTE[0]


def pytest_sessionstart(session):
    if HAVE_VLLM:
        _zygote()


def pytest_sessionfinish(session, exitstatus):
    for z in _ZYGOTE:
        z.close()


def _run(specs, timeout):
    """Each spec's engine in a process of its own, all at once: [(exit code, stdout, stderr)]."""
    # output into files, not pipes: a pipe left unread while the first engine is waited for
    # would stall the others once it fills (vLLM logs much)
    with tempfile.TemporaryDirectory(prefix="kvscore-engines-") as d:
        files = [(os.path.join(d, f"{i}.out"), os.path.join(d, f"{i}.err")) for i in range(len(specs))]
        z = _zygote()
        if z is not None:
            rcs = z.run(specs, files, timeout)
        else:
            procs = []
            for s, (o, e) in zip(specs, files):
                with open(o, "w") as fo, open(e, "w") as fe:
                    procs.append(subprocess.Popen([sys.executable, str(HERE / "engine_run.py"), json.dumps(s)],
                                                  stdout=fo, stderr=fe, text=True))
            try:
                for p in procs:
                    p.wait(timeout=timeout)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            rcs = [p.returncode for p in procs]
        return [(rc, pathlib.Path(o).read_text(), pathlib.Path(e).read_text()) for rc, (o, e) in zip(rcs, files)]


def run_engines(*specs, timeout=900):
    """Engines in their own processes, all at once; their JSON results in order. An engine's
    result depends only on its own steps (stepwise, greedy), not on the others beside it: run
    together, their start-ups (one-threaded model loads) and small-batch steps fill both cores
    instead of one."""
    results = []
    for rc, out, err in _run(specs, timeout):
        r = next((json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")), None)
        if r is None:
            raise AssertionError(f"engine_run.py failed (exit {rc}):\n{out[-3000:]}\n{err[-6000:]}")
        results.append(r)
    return results


def engine_error(spec, timeout=600):
    """The stderr of an engine that must fail to start."""
    rc, out, err = _run([spec], timeout)[0]
    assert rc != 0, "the engine started"
    return out + err


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
