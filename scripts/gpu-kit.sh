#!/usr/bin/env bash
# Prepares one GPU run of the CUDA path for a machine that has a GPU but no build tools or network:
# builds kvscore_cuda_tests and kvscore_cuda_bench here (nvcc, -DCMAKE_CUDA_ARCHITECTURES, default
# 90 = H100/H200), and gathers into one folder the binaries, the shared libraries they need, the
# torch comparison script and scripts/gpu-checks.sh, which runs every check with its own time limit
# and writes the logs. Reading the resource usage and the SASS costs no GPU time: do it here first
# (cuobjdump --dump-resource-usage / --dump-sass build-cuda/cuda/libkvscore_cuda.a).
#   bash scripts/gpu-kit.sh [KIT_DIR] [ARCH]      (default build-gpu-kit, 90)
#   then, on the GPU machine, from the kit:  OUT=logs bash gpu-checks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${1:-build-gpu-kit}
ARCH=${2:-90}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
cmake -S . -B build-cuda -DKVSCORE_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  -DCMAKE_BUILD_TYPE=Release -DKVSCORE_BUILD_EXAMPLES=OFF -DKVSCORE_BUILD_TOOLS=OFF >/dev/null
cmake --build build-cuda -j"$(nproc)" --target kvscore_cuda_tests kvscore_cuda_bench
rm -rf "$KIT" && mkdir -p "$KIT/lib"
cp build-cuda/cuda/kvscore_cuda_tests build-cuda/cuda/kvscore_cuda_bench cuda/bench/torch_peer.py \
  scripts/gpu-checks.sh "$KIT/"
# the shared libraries outside the system's base set (cudart, benchmark, gomp): a bare GPU machine
# may have the driver but not these
for b in "$KIT/kvscore_cuda_tests" "$KIT/kvscore_cuda_bench"; do
  ldd "$b" | awk '/=> \// {print $3}' | grep -E 'libcudart|libbenchmark|libgomp' | xargs -r -I{} cp -L {} "$KIT/lib/"
done
git rev-parse --short HEAD > "$KIT/COMMIT" 2>/dev/null || true
du -sh "$KIT"
