#!/usr/bin/env bash
# kvscore inside vLLM, the benchmark (docs/guides/vllm.md; never part of the tests): vLLM CPU serving 32
# needle prompts of ~2K tokens, 64 generated tokens each, in a pool of 540 KV blocks (too small
# for all of them at once), plain and with kvscore (KeyDiff and K-norm at ratio 0.5), in one run:
# peak concurrent requests, blocks in use, generated tokens/s, needle accuracy, and the time of
# scoring + selection + freeing against the prefill time of the same prompts. ~20 min on 2 cores.
#   bash scripts/vllm_bench.sh [python -m kvscore.vllm.bench options]   (report: build/vllm_bench.json)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh
step vllm-env "the vLLM environment (scripts/vllm_env.sh) and SmolLM2 as safetensors"
PY=$(bash scripts/vllm_env.sh | tail -1)
MODEL=$(bash scripts/smollm2_safetensors.sh "$PY")
mkdir -p build
step vllm-bench "python -m kvscore.vllm.bench (4 engines one after another)"
lscpu | grep -E "Model name|^CPU\(s\)" || true
(cd /tmp && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} \
  "$PY" -m kvscore.vllm.bench --model "$MODEL" --out "$OLDPWD/build/vllm_bench.json" "$@")
