// cuda/tests/cuda_harness.hpp — what every kvscore_cuda_tests file shares: Catch2, the
// namespace alias and host <-> device copies of std::vectors. main() is in main.cpp: without a
// device it says so and runs only the [host] tests (every GPU test is tagged [gpu]).
#pragma once

#include <catch2/catch.hpp>

#include <kvscore/cuda/device.hpp>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace kc = kvscore::cuda;

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
