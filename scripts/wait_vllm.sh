#!/usr/bin/env bash
# Waits for the vLLM tests that `KVSCORE_VLLM_DETACH=1 scripts/test.sh` left running (CI: beside
# its next steps), prints their log and exits with their status (10: the Python tests, 11: vLLM's
# environment, 12: the vLLM tests failed; the logs name the test).
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-build}
t0=$(date +%s)
# the job writes its status as it ends; a job killed before that (its process group gone) must not
# leave CI waiting until its time limit
PG=$(cat "$B/.python-pgid")
while [ ! -e "$B/.python-rc" ] && kill -0 -- "-$PG" 2>/dev/null; do sleep 2; done
[ -e "$B/.python-rc" ] || { echo "wait_vllm.sh: the vLLM tests' job ($PG) ended without a status"; exit 1; }
rc=$(cat "$B/.python-rc")
[ "$rc" = 11 ] && cat "$B/vllm-env.log"
[ -e "$B/vllm.log" ] && sed 's/^/    /' "$B/vllm.log"
echo "    (waited $(($(date +%s) - t0)) s for the vLLM tests; exit status $rc)"
[ "$rc" = 0 ] || { echo "wait_vllm.sh: the vLLM tests failed (rc $rc; log: $B/vllm.log)"; exit 1; }
