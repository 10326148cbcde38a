// cuda/bench/fill.cu — random benchmark data generated on the device (issue 30: drawing the 32 × 1M
// key cache on one host thread took minutes). Counter-based: element i of a fill is a function of
// (seed, i) only, so the data is the same on every GPU and run, whatever the launch shape.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "bench_fill.hpp"

namespace kvbench {

namespace {

__device__ __forceinline__ std::uint64_t mix(std::uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// A standard normal draw for counter c (Box–Muller on two 24-bit uniforms of one hash).
__device__ __forceinline__ float normal(std::uint64_t seed, std::uint64_t c) {
  const std::uint64_t h = mix(seed * 0x9e3779b97f4a7c15ull + c);
  const float u1 = (float((h >> 40) & 0xFFFFFF) + 0.5f) * 0x1.0p-24f;  // (0, 1)
  const float u2 = float((h >> 16) & 0xFFFFFF) * 0x1.0p-24f;
  return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}

template <class T>
__device__ __forceinline__ T narrow(float x);
template <>
__device__ __forceinline__ float narrow<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half narrow<__half>(float x) { return __float2half_rn(x); }

template <class T>
__global__ void fill_normal_kernel(T* out, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n; i += std::size_t(gridDim.x) * blockDim.x)
    out[i] = narrow<T>(normal(seed, i));
}

/// key(h, t, j) = off_h[j] + scale_h[j]·g + 0.4 Σ_r z_r(h, t)·basis_h[r][j], g, z ~ N(0, 1).
__global__ void fill_structured_kernel(__half* out, long long H, long long N, long long d, const float* off,
                                       const float* scale, const float* basis, int rank, std::uint64_t seed) {
  const std::size_t total = std::size_t(H * N * d);
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < total;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const long long j = (long long)(i % std::size_t(d)), row = (long long)(i / std::size_t(d));
    const long long h = row / N;
    float v = off[h * d + j] + scale[h * d + j] * normal(seed, i);
    for (int r = 0; r < rank; ++r)  // z depends on the row only: every j of a row sees the same z
      v += 0.4f * normal(seed ^ 0x5a5a5a5aull, std::uint64_t(row) * 64u + std::uint64_t(r)) * basis[(h * rank + r) * d + j];
    out[i] = __float2half_rn(v);
  }
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::abort();
  }
}

constexpr int kThreads = 256, kBlocks = 4096;

}  // namespace

void fill_normal_f32(float* out, std::size_t n, std::uint64_t seed) {
  fill_normal_kernel<float><<<kBlocks, kThreads>>>(out, n, seed);
  check(cudaGetLastError(), "fill_normal_f32");
  check(cudaDeviceSynchronize(), "fill_normal_f32");
}

void fill_normal_f16(void* out, std::size_t n, std::uint64_t seed) {
  fill_normal_kernel<__half><<<kBlocks, kThreads>>>(static_cast<__half*>(out), n, seed);
  check(cudaGetLastError(), "fill_normal_f16");
  check(cudaDeviceSynchronize(), "fill_normal_f16");
}

void fill_structured_f16(void* out, long long H, long long N, long long d, const float* off, const float* scale,
                         const float* basis, int rank, std::uint64_t seed) {
  fill_structured_kernel<<<kBlocks, kThreads>>>(static_cast<__half*>(out), H, N, d, off, scale, basis, rank, seed);
  check(cudaGetLastError(), "fill_structured_f16");
  check(cudaDeviceSynchronize(), "fill_structured_f16");
}

}  // namespace kvbench
