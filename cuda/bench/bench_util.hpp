// cuda/bench/bench_util.hpp — what every kvscore_cuda_bench file shares: CUDA error checks,
// GPU timing with events, the device-to-device copy rate that bandwidth_fraction divides by, and
// random fp16 key caches on the device. main() is in main.cpp (exits 0 without a device).
#pragma once

#include <benchmark/benchmark.h>

#include <cuda_runtime.h>

#include <kvscore/cuda/device.hpp>
#include <kvscore/core/dtype.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
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

/// Random fp16 keys [heads][N][128] on the device (HF layout), generated on the host once per shape.
inline const kc::DeviceBuffer& device_keys(std::int64_t heads, std::int64_t N, std::int64_t d) {
  static std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t>, kc::DeviceBuffer> cache;
  auto key = std::make_tuple(heads, N, d);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  std::vector<kvscore::half> h(std::size_t(heads * N * d));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : h) x = kvscore::from_float<kvscore::half>(nd(rng));
  kc::DeviceBuffer b(h.size() * sizeof(kvscore::half));
  kc::copy_to_device(b.get(), h.data(), h.size() * sizeof(kvscore::half));
  return cache[key] = std::move(b);
}

}  // namespace
