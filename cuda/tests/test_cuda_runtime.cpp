// cuda/tests/test_cuda_runtime.cpp — what kvscore.cuda_status() reads (kvscore::cuda::runtime_status,
// architecture_supported) and the device guard the Python module takes for a tensor's device.
#include "cuda_harness.hpp"

#include <cuda_runtime.h>

#include <string>

using Catch::Matchers::Contains;

TEST_CASE("cuda runtime: which architectures run on which device", "[cuda][host]") {
  // CMAKE_CUDA_ARCHITECTURES items: "80" = sm_80 machine code + compute_80 PTX
  REQUIRE(kc::architecture_supported("80,90", 9, 0));
  REQUIRE(kc::architecture_supported("80,90", 8, 6));    // sm_80 code runs on 8.6
  REQUIRE(kc::architecture_supported("80;90", 10, 0));   // compute_90 PTX is compiled for 10.0
  REQUIRE(!kc::architecture_supported("80,90", 7, 5));
  REQUIRE(kc::architecture_supported("90-real", 9, 0));
  REQUIRE(!kc::architecture_supported("90-real", 10, 0));  // machine code only: no later major
  REQUIRE(!kc::architecture_supported("80-real", 9, 0));
  REQUIRE(kc::architecture_supported("80-real", 8, 9));
  REQUIRE(kc::architecture_supported("90a", 9, 0));
  REQUIRE(!kc::architecture_supported("90a", 10, 0));       // arch-specific: that GPU only
  REQUIRE(!kc::architecture_supported("90-virtual", 8, 0));
  REQUIRE(kc::architecture_supported("90-virtual", 12, 0));
  REQUIRE(kc::architecture_supported("native", 7, 5));
  REQUIRE(kc::architecture_supported("75 , 90", 7, 5));
  REQUIRE(!kc::architecture_supported("", 9, 0));
  REQUIRE(!kc::architecture_supported("junk", 9, 0));
}

TEST_CASE("cuda runtime: the status names why the CUDA path cannot run", "[cuda][host]") {
  const kc::RuntimeStatus s = kc::runtime_status();
  INFO(s.reason << ": " << s.message);
  REQUIRE(!s.built_architectures.empty());  // cuda/CMakeLists.txt passes CMAKE_CUDA_ARCHITECTURES
  REQUIRE(s.runtime_version >= 12000);
  REQUIRE(!s.message.empty());
  if (kc::device_count() == 0) {
    // (without a driver every CUDA call, the peek at the last error too, returns the init error)
    REQUIRE((s.reason == "no_driver" || s.reason == "driver_too_old" || s.reason == "no_device"));
    REQUIRE(s.devices.empty());
    if (s.reason == "no_driver") {
      REQUIRE(s.driver_version == 0);
      REQUIRE_THAT(s.message, Contains("no NVIDIA driver"));
    }
    // and the guard cannot set a device
    REQUIRE_THROWS_WITH(kc::DeviceGuard(0), Contains("CUDA is not usable in this process"));
  } else {
    REQUIRE((s.reason == "available" || s.reason == "arch_not_built"));
    REQUIRE(s.devices.size() == std::size_t(kc::device_count()));
    REQUIRE(s.driver_version >= s.runtime_version);
    REQUIRE(cudaPeekAtLastError() == cudaSuccess);  // asking leaves nothing pending
  }
}

TEST_CASE("cuda runtime: the device guard sets a device and restores the caller's", "[cuda][gpu]") {
  int before = -1;
  REQUIRE(cudaGetDevice(&before) == cudaSuccess);
  {
    const kc::DeviceGuard same(before);  // already current: nothing set
    int now = -1;
    REQUIRE(cudaGetDevice(&now) == cudaSuccess);
    REQUIRE(now == before);
  }
  const int other = kc::device_count() > 1 ? (before + 1) % kc::device_count() : before;
  {
    const kc::DeviceGuard g(other);
    int now = -1;
    REQUIRE(cudaGetDevice(&now) == cudaSuccess);
    REQUIRE(now == other);
  }
  int after = -1;
  REQUIRE(cudaGetDevice(&after) == cudaSuccess);
  REQUIRE(after == before);
  REQUIRE_THROWS_AS(kc::DeviceGuard(kc::device_count() + 3), kc::Error);
  REQUIRE(cudaPeekAtLastError() == cudaSuccess);
}
