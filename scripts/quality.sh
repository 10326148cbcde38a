#!/usr/bin/env bash
# docs/results/quality.md, reproduced: the generation-level quality benchmark (python -m kvscore.quality)
# on SmolLM2-135M-Instruct, in the Python environment of scripts/test_python.sh (made here when
# missing) with the model from scripts/fetch_smollm2.sh.
#   bash scripts/quality.sh                    # docs/results/quality.md: the full run into quality-out/
#   bash scripts/quality.sh --quick --out DIR  # the CI smoke run (<= 3 min)
# The full run first makes the per-layer mix (scripts/eval_smollm2.sh --mix-only: a dump of the
# benchmark's kind of workload on other text, `kvscore eval` leak-free, build/smollm2/mix-qa.json)
# and adds it as kvscore:mix. Other arguments go to python -m kvscore.quality (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${KVSCORE_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PY="$VENV/bin/python"
if ! "$PY" -c "import kvscore, kvpress, gguf" 2>/dev/null; then
  KVSCORE_PYTHON_SETUP_ONLY=1 bash scripts/test_python.sh
fi
MODEL=$(PYTHON="$PY" bash scripts/fetch_smollm2.sh)
MIX=()
case " $* " in
  *" --quick "* | *" --mix "* | *" --list "* | *" --help "* | *" -h "*) ;;
  *)
    [ -s build/smollm2/mix-qa-agnostic.json ] || bash scripts/eval_smollm2.sh --mix-only build/smollm2
    MIX=(--mix "mix=build/smollm2/mix-qa.json,mix-agnostic=build/smollm2/mix-qa-agnostic.json")
    ;;
esac
HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} exec "$PY" -m kvscore.quality --model "$MODEL" "${MIX[@]}" "$@"
