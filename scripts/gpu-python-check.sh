#!/usr/bin/env bash
# The GPU check of kvscore's CUDA tensors in Python, on the GPU machine, from a kit made by
# scripts/gpu-python-kit.sh (issue 48; docs/reference/python.md "CUDA tensors"). From the repository root:
#   bash scripts/gpu-python-check.sh [KIT]       (QUICK=1: gpu_check --quick; OUT=DIR for the logs)
# Stages, each under its own time limit (the whole run: < 7 minutes on an H100):
#   env       GPU, driver, python3, torch, nvcc, Python.h
#   deps      dpkg -x of the Debian headers, the wheels into KIT/site (PYTHONPATH)
#   build     KVSCORE_CUDA=1 pip install . into KIT/site over the prebuilt libkvscore_cuda.a and
#             libkvscore_dispatch.a: only the two nanobind modules compile here
#   import    cuda_available(), cuda_status()
#   cxx       kvscore_cuda_tests (every [gpu] test: the kernels against the CPU path)
#   gpu_check python/tests/gpu_check.py: the PASS/FAIL table
#   pytest    python/tests/test_cuda.py (the no-GPU checks, now with a GPU)
#   memcheck  compute-sanitizer memcheck over a quick gpu_check of the kernels (scores, select, compact)
# Then the stage summary and gpu_check's table. Exit status: 0 only if every stage passed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KIT=$(cd "${1:-build-gpu-python-kit}" && pwd)
O=${OUT:-$KIT/logs}
mkdir -p "$O"
S=$O/summary.txt
: >"$S"
FAILED=0
stage() {
  local name=$1 lim=$2
  shift 2
  local t0 rc
  t0=$(date +%s)
  timeout "$lim" "$@" >"$O/$name.log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && FAILED=1
  echo "$name rc=$rc $(($(date +%s) - t0))s (limit ${lim}s)" | tee -a "$S"
  return $rc
}
PY=${PYTHON:-python3}
SITE=$KIT/site
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export LD_LIBRARY_PATH=$KIT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

stage env 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; cat '$KIT/COMMIT' '$KIT/ARCH';
  $PY -c 'import sys, sysconfig, os, torch; inc = sysconfig.get_paths()[\"include\"];
print(sys.version); print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.get_device_name());
print(\"Python.h\", os.path.exists(os.path.join(inc, \"Python.h\")), inc)'; (nvcc --version || /usr/local/cuda/bin/nvcc --version) | tail -2"

stage deps 60 bash -c "mkdir -p '$KIT/root' '$SITE' && for f in '$KIT'/deb/*.deb; do dpkg -x \"\$f\" '$KIT/root'; done &&
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target '$SITE' '$KIT'/whl/*.whl"

# the modules only: the CUDA kernels and the CPU kernels are the prebuilt static libraries
stage build 240 env KVSCORE_CUDA=1 CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install -v --no-deps \
  --no-build-isolation --no-index --target "$SITE" --upgrade \
  --config-settings=cmake.define.KVSCORE_PREBUILT_DISPATCH="$KIT/lib/libkvscore_dispatch.a" \
  --config-settings=cmake.define.KVSCORE_PREBUILT_CUDA="$KIT/lib/libkvscore_cuda.a" \
  --config-settings=cmake.define.CMAKE_PREFIX_PATH="$KIT/root/usr" \
  --config-settings=build-dir="$KIT/pybuild" "$ROOT"

stage import 60 bash -c "cd /tmp && $PY -c 'import kvscore, json; print(kvscore.__file__); print(kvscore.cuda_available());
print(json.dumps(kvscore.cuda_status(), indent=1)); assert kvscore.cuda_available()'"

stage cxx 120 "$KIT/bin/kvscore_cuda_tests" -d yes

QUICKARG=()
[ "${QUICK:-0}" = 1 ] && QUICKARG=(--quick)
stage gpu_check 240 bash -c "cd /tmp && $PY '$ROOT/python/tests/gpu_check.py' ${QUICKARG[*]} --json '$O/gpu_check.json'"

stage pytest 90 bash -c "cd /tmp && $PY -m pytest -q -rs -p no:cacheprovider '$ROOT/python/tests/test_cuda.py' -k 'not gpu_check'"

CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ]; then
  # no caching allocator under memcheck: an access past a tensor is past an allocation
  stage memcheck 120 bash -c "cd /tmp && PYTORCH_NO_CUDA_MEMORY_CACHING=1 exec '$CS' --tool memcheck \
    --report-api-errors no --target-processes all --error-exitcode 9 $PY '$ROOT/python/tests/gpu_check.py' --quick \
    --only scores:knorm,scores:keydiff,scores:manifold_l2,scores:qfilter,scores:snapkv,select,compact"
else
  echo "memcheck: no compute-sanitizer" | tee -a "$S"
fi

echo
echo "==== stages ===="
cat "$S"
echo
echo "==== gpu_check ===="
sed -n '/^| check |/,$p' "$O/gpu_check.log" 2>/dev/null || tail -40 "$O/gpu_check.log"
grep -E "ERROR SUMMARY" "$O/memcheck.log" 2>/dev/null
grep -E "test cases|FAILED" "$O/cxx.log" 2>/dev/null | head -20
exit $FAILED
