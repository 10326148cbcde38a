#!/usr/bin/env bash
# Prepares the GPU check of kvscore's CUDA tensors in Python (issue 48; python/tests/gpu_check.py)
# for a GPU machine with Python 3.12, torch, nvcc, nanobind and scikit-build-core but no network
# and no kvscore build tools (docs/reference/cuda.md "A GPU run from a machine without one"):
#   * builds here, for ARCH (default 90: H100/H200), the static libraries the Python modules link
#     (libkvscore_cuda.a, the static CUDA runtime inside; libkvscore_dispatch.a) and the C++ test
#     binary kvscore_cuda_tests, so the GPU machine compiles only the two nanobind modules;
#   * downloads the Debian packages of the header-only dependencies (Eigen, xsimd, nlohmann-json:
#     unpacked there with dpkg -x, relocatable CMake configs) and the wheels the check needs that
#     the GPU image lacks (kvpress and what `import kvpress` imports; transformers 5.2 and its
#     tokenizers, the versions the CPU tests run with);
#   * gathers them in KIT (default build-gpu-python-kit, ignored by git: pass it in `carry`).
# On the GPU machine, from the repository root:  bash scripts/gpu-python-check.sh KIT
# (pip install . with KVSCORE_CUDA=1 over the prebuilt libraries, kvscore_cuda_tests, gpu_check.py,
# memcheck over a quick gpu_check; logs and the PASS/FAIL table in KIT/logs; < 7 minutes).
#   bash scripts/gpu-python-kit.sh [KIT] [ARCH]
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${1:-build-gpu-python-kit}
ARCH=${2:-90}
BUILD=${KVSCORE_GPU_KIT_BUILD:-build-gpu-python}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
JOBS=${JOBS:-$(nproc)}
PY=${PYTHON:-python3}

cmake -S . -B "$BUILD" -G Ninja -DKVSCORE_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  -DCMAKE_BUILD_TYPE=Release -DKVSCORE_BUILD_EXAMPLES=OFF -DKVSCORE_BUILD_TOOLS=OFF -DKVSCORE_BUILD_BENCH=OFF \
  -DKVSCORE_BUILD_TESTS=ON >/dev/null
cmake --build "$BUILD" -j"$JOBS" --target kvscore_cuda kvscore_dispatch kvscore_cuda_tests

rm -rf "$KIT" && mkdir -p "$KIT/lib" "$KIT/bin" "$KIT/deb" "$KIT/whl"
cp "$BUILD/cuda/libkvscore_cuda.a" "$BUILD/libkvscore_dispatch.a" "$KIT/lib/"
cp "$BUILD/cuda/kvscore_cuda_tests" "$KIT/bin/"
# the test binary's shared libraries outside a bare machine's base set (the CUDA runtime is static)
ldd "$KIT/bin/kvscore_cuda_tests" | awk '/=> \// {print $3}' | grep -E 'libgomp' | xargs -r -I{} cp -L {} "$KIT/lib/"

# Debian's header-only dependencies (dpkg -x on the GPU machine; their CMake configs are relocatable)
chmod 777 "$KIT/deb"  # apt downloads as its own user
(cd "$KIT/deb" && apt-get download libeigen3-dev libxsimd-dev nlohmann-json3-dev >/dev/null)

# wheels for Python 3.12 (the GPU image's), exact versions, no dependencies resolved here
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$KIT/whl" kvpress==0.5.5 cachetools==5.5.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  fire==0.7.1 termcolor==3.3.0 transformers==5.2.0 tokenizers==0.22.2

git rev-parse --short HEAD > "$KIT/COMMIT" 2>/dev/null || true
git status --porcelain | grep -q . && echo "+ uncommitted changes" >> "$KIT/COMMIT" || true
echo "$ARCH" > "$KIT/ARCH"
du -sh "$KIT"
