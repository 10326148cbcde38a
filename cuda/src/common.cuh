// cuda/src/common.cuh — what every kernel file of kvscore::cuda shares: error checks, element
// loads (fp32/fp16/bf16 widened exactly to fp32), order-preserving keys, workspace carving.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kvscore/cuda/kernels.hpp"

namespace kvscore::cuda::detail {

[[noreturn]] void throw_cuda(cudaError_t e, const char* call, const char* file, int line);

/// Throws kvscore::cuda::Error for a failed CUDA call of kvscore's own. The failure is also the
/// thread's last error: it is taken (cudaGetLastError) before throwing, so that no later launch
/// check -- kvscore's or the caller's -- reports it again. (A sticky error, one that corrupts the
/// context, cannot be taken: every later call reports it, as CUDA documents.)
#define KVSCORE_CUDA_CHECK(call)                                                          \
  do {                                                                                    \
    const cudaError_t kvscore_e_ = (call);                                                \
    if (kvscore_e_ != cudaSuccess) {                                                      \
      (void)cudaGetLastError();                                                           \
      ::kvscore::cuda::detail::throw_cuda(kvscore_e_, #call, __FILE__, __LINE__);         \
    }                                                                                     \
  } while (0)
// After a launch: configuration errors now (asynchronous faults surface at the next sync). It
// reports this launch's error only because every entry point began with require_no_pending_error.
#define KVSCORE_CUDA_LAUNCHED() KVSCORE_CUDA_CHECK(cudaGetLastError())

/// First line of every entry point that launches: an error already pending on this host thread
/// was left by an earlier CUDA call of the caller's, so it is neither reported as a kvscore launch
/// failure nor taken from its owner: kvscore throws an Error that says so, launches nothing, and
/// leaves the error pending (docs/reference/cuda.md, "Errors").
void require_no_pending_error(const char* who);

/// f(std::integral_constant<dtype, D>{}) for the element type t: the one switch over the
/// element types of every host entry point (`for_dtype(keys.type, [&](auto D) { run<decltype(D)::value>(...); })`).
template <class F>
void for_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::f32: f(std::integral_constant<dtype, dtype::f32>{}); break;
    case dtype::f16: f(std::integral_constant<dtype, dtype::f16>{}); break;
    case dtype::bf16: f(std::integral_constant<dtype, dtype::bf16>{}); break;
  }
}

inline constexpr float kNegInf = -__builtin_huge_valf();

// Storage types on the device: raw bits for the 16-bit formats.
template <dtype D> struct Storage;
template <> struct Storage<dtype::f32> { using type = float; };
template <> struct Storage<dtype::f16> { using type = std::uint16_t; };
template <> struct Storage<dtype::bf16> { using type = std::uint16_t; };

template <dtype D>
__device__ __forceinline__ float widen(typename Storage<D>::type v) {
  if constexpr (D == dtype::f32) return v;
  else if constexpr (D == dtype::f16) return __half2float(__ushort_as_half(v));  // exact
  else return __uint_as_float(std::uint32_t(v) << 16);                              // exact
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;  // every lane holds the same value (butterfly: the same order on every lane)
}

/// The CPU selector's order-preserving key (kvscore/select/radix_portable.hpp key_of): -0 == +0, NaN = 1.
__host__ __device__ __forceinline__ std::uint32_t key_of_bits(std::uint32_t u) {
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 1u;
  return (u >> 31) != 0 ? 0u - u : u | 0x80000000u;
}
inline constexpr std::uint32_t kForcedKey = 0xFFFFFFFFu;

/// Hands out 256-byte-aligned pieces of a workspace; with data == nullptr it only counts.
class Carver {
 public:
  explicit Carver(void* base = nullptr) : base_(static_cast<std::byte*>(base)) {
    if (base_ != nullptr) pad_ = (256 - reinterpret_cast<std::uintptr_t>(base_) % 256) % 256;
  }
  template <class T>
  T* take(std::size_t count) {
    const std::size_t off = used_;
    used_ += (count * sizeof(T) + 255) / 256 * 256;
    return base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + pad_ + off);
  }
  /// Bytes needed so that every piece fits whatever the alignment of the base.
  std::size_t bytes() const noexcept { return used_ + 256; }

 private:
  std::byte* base_ = nullptr;
  std::size_t pad_ = 0, used_ = 0;
};

void require_workspace(const Workspace& ws, std::size_t need, const char* who);

inline unsigned grid_dim(std::int64_t n) { return unsigned(n); }

}  // namespace kvscore::cuda::detail
