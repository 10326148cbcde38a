// cuda/bench/bench_util.hpp — what every kvscore_cuda_bench file shares: CUDA error checks,
// GPU timing with events, the device-to-device copy rate that bandwidth_fraction divides by, and
// random fp16 key caches drawn on the device. main() is in main.cpp (exits 0 without a device).
#pragma once

#include <benchmark/benchmark.h>

#include <cuda_runtime.h>

#include "bench_fill.hpp"

#include <kvscore/cuda/device.hpp>
#include <kvscore/core/dtype.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <tuple>
#include <vector>

namespace kc = kvscore::cuda;

namespace {

#define CHECK(x)                                                                                          \
  do {                                                                                                    \
    const cudaError_t e_ = (x);                                                                           \
    if (e_ != cudaSuccess) {                                                                              \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                                       \
      std::abort();                                                                                       \
    }                                                                                                     \
  } while (0)

/// Seconds of f() on the GPU (CUDA events on the default stream).
template <class F>
inline double gpu_seconds(F&& f) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  f();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return double(ms) * 1e-3;
}

/// Bytes per second (read + write) of a device-to-device copy of `bytes`, best of 10; per size.
inline double copy_bytes_per_second(std::size_t bytes) {
  static std::map<std::size_t, double> cache;
  if (auto it = cache.find(bytes); it != cache.end()) return it->second;
  kc::DeviceBuffer src(bytes), dst(bytes);
  CHECK(cudaMemset(src.get(), 1, bytes));
  double best = 1e30;
  for (int i = 0; i < 11; ++i) {
    const double s = gpu_seconds([&] { CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice)); });
    if (i > 0) best = std::min(best, s);  // the first is a warm-up
  }
  return cache[bytes] = 2.0 * double(bytes) / best;
}

/// Random fp16 keys [heads][N][d] on the device (HF layout), N(0, 1), drawn on the device once per
/// shape (bench_fill.hpp: seconds for 32 × 1M, where a host generator took minutes).
inline const kc::DeviceBuffer& device_keys(std::int64_t heads, std::int64_t N, std::int64_t d) {
  static std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t>, kc::DeviceBuffer> cache;
  auto key = std::make_tuple(heads, N, d);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  const std::size_t n = std::size_t(heads * N * d);
  kc::DeviceBuffer b(n * sizeof(kvscore::half));
  kvbench::fill_normal_f16(b.get(), n, 1);
  return cache[key] = std::move(b);
}

}  // namespace
