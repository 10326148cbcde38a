#!/usr/bin/env bash
# docs/reference/evaluate.md's SmolLM2 section, reproduced: SmolLM2-135M-Instruct dumped at 2K and 8K tokens
# (tools/dump_kv.py --following: the context's cache, the queries of the 64 tokens that follow it,
# the context's last 64 queries, Q-Filters' calibration queries from other text), `kvscore eval`
# on each dump under both protocols (leak-free, the default for these dumps, and shared), then
# tools/smollm2_report.py: the tables (stdout and $OUT/tables.md) and the per-layer figure. Last,
# the per-layer mix of the quality benchmark ($OUT/mix-qa.json, see below).
#   bash scripts/eval_smollm2.sh [OUT]        (default build/smollm2; ~25 min on 2 cores)
#   bash scripts/eval_smollm2.sh --mix-only [OUT]   only the per-layer mix's dump and report
#                                                   (scripts/quality.sh runs this)
# Uses the Python environment of scripts/test_python.sh ($KVSCORE_VENV, default .venv) and the
# CLI of build/ (built here when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MIX_ONLY=0
if [ "${1:-}" = --mix-only ]; then MIX_ONLY=1; shift; fi
OUT=${1:-build/smollm2}
VENV=${KVSCORE_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PY="$VENV/bin/python"
if ! "$PY" -c "import kvscore, kvpress, gguf" 2>/dev/null; then
  KVSCORE_PYTHON_SETUP_ONLY=1 bash scripts/test_python.sh
fi
CLI=${KVSCORE_CLI:-build/tools/kvscore}
if [ ! -x "$CLI" ]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" >/dev/null
  cmake --build build -j"$(nproc)" --target kvscore_cli
fi
MODEL=$(PYTHON="$PY" bash scripts/fetch_smollm2.sh)
L=/usr/share/common-licenses
# the same three disjoint text sets as the quality benchmark (python/kvscore/quality.py)
DUMP_TEXTS=("$L/Apache-2.0" "$L/MPL-2.0" "$L/LGPL-3" "$L/GPL-1" "$L/BSD")
CALIB_TEXTS=("$L/Artistic" "$L/CC0-1.0")
mkdir -p "$OUT"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
for N in 2048 8192; do
  [ "$MIX_ONLY" = 1 ] && break
  D="$OUT/dump-$N"
  if [ ! -s "$D/Qcal.npy" ]; then
    "$PY" tools/dump_kv.py --model "$MODEL" --text "${DUMP_TEXTS[@]}" --max-tokens "$N" --following 64 \
      --window 64 --calib-text "${CALIB_TEXTS[@]}" --calib-tokens 512 --out "$D"
  fi
  "$CLI" eval --dump "$D" --keep 0.1,0.25,0.5 --threads 2 --out "$OUT/leak-free-$N.json" >/dev/null
  "$CLI" eval --dump "$D" --keep 0.1,0.25,0.5 --threads 2 --protocol shared --out "$OUT/shared-$N.json" >/dev/null
done
# The per-layer mix for the quality benchmark (docs/results/quality.md): a dump of the benchmark's kind of
# workload on other text (needles in DUMP_TEXTS, chat template, the questions and answers as the
# following tokens), evaluated leak-free with the presses' 4 sinks; its per_layer_best is the mix.
W="$OUT/workload"
"$PY" -m kvscore.quality --model "$MODEL" --workload-texts "$W" --lengths 2048
if [ ! -s "$OUT/dump-qa/Qcal.npy" ]; then
  "$PY" tools/dump_kv.py --model "$MODEL" --text "$W/context.txt" --following-text "$W/following.txt" \
    --no-special-tokens --max-tokens 8192 --window 64 --calib-text "${CALIB_TEXTS[@]}" --calib-tokens 512 \
    --out "$OUT/dump-qa"
fi
"$CLI" eval --dump "$OUT/dump-qa" --keep 0.1,0.25,0.5,0.75 --sinks 4 --threads 2 --out "$OUT/mix-qa.json" >/dev/null
# the same choice among the query-agnostic methods only, with AdaKV allocation (kvscore:mix-agnostic)
"$CLI" eval --dump "$OUT/dump-qa" --keep 0.1,0.25,0.5,0.75 --sinks 4 --alloc adakv --threads 2 \
  --methods knorm,keydiff,l2,windowed-l2,qfilter,streaming_llm --out "$OUT/mix-qa-agnostic.json" >/dev/null
echo "eval_smollm2: the per-layer mixes are $OUT/mix-qa.json and $OUT/mix-qa-agnostic.json (per_layer_best)"
[ "$MIX_ONLY" = 1 ] && exit 0
"$PY" tools/smollm2_report.py "$OUT"
cp "$OUT/per_layer.svg" docs/results/smollm2_per_layer.svg  # the figure of docs/reference/evaluate.md
