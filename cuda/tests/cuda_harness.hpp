// cuda/tests/cuda_harness.hpp — what every kvscore_cuda_tests file shares: Catch2, the
// namespace alias and host <-> device copies of std::vectors. main() is in main.cpp: without a
// device it says so and runs only the [host] tests (every GPU test is tagged [gpu]).
#pragma once

#include <catch2/catch.hpp>

#include <kvscore/cuda/device.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kc = kvscore::cuda;

/// A layer of keys [heads][tokens][head_dim] in one of the engine layouts: element (h, t, j) at
/// h*hs + t*ts + j of a buffer of `elems` elements.
struct Layout {
  const char* name;
  std::int64_t hs, ts, elems;
};
inline Layout hf(std::int64_t H, std::int64_t N, std::int64_t d) { return {"hf", N * d, d, H * N * d}; }
inline Layout token_major(std::int64_t H, std::int64_t N, std::int64_t d) {
  return {"token-major", d, H * d, H * N * d};
}
/// Rows padded by `pad` elements (3 by default: misaligned for the vector paths).
inline Layout padded(std::int64_t H, std::int64_t N, std::int64_t d, std::int64_t pad = 3) {
  return {"padded", N * (d + pad), d + pad, H * N * (d + pad)};
}

template <class T>
kc::DeviceBuffer upload(const std::vector<T>& v) {
  kc::DeviceBuffer b(std::max<std::size_t>(v.size() * sizeof(T), 1));
  kc::copy_to_device(b.get(), v.data(), v.size() * sizeof(T));
  return b;
}
template <class T>
std::vector<T> download(const kc::DeviceBuffer& b, std::size_t n) {
  std::vector<T> v(n);
  kc::copy_to_host(v.data(), b.get(), n * sizeof(T));
  return v;
}
template <class T>
std::vector<T> download(const T* device_ptr, std::size_t n) {
  std::vector<T> v(n);
  kc::copy_to_host(v.data(), device_ptr, n * sizeof(T));
  return v;
}
