// kvscore/core/dtype.hpp — element types of a key cache: float, IEEE half, bfloat16.
//
// half and bfloat16 are storage types (16 bits, no arithmetic): kvscore only ever
// reads them, widens to fp32 and accumulates in fp32 or wider. Conversions are
// exact round-to-nearest-even, NaN stays NaN (quietened), Inf stays Inf.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kvscore/core/cpu.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVSCORE_X86 1
#endif

namespace kvscore {

/// IEEE 754 binary16 storage (1 sign, 5 exponent, 10 mantissa bits).
struct half {
  std::uint16_t bits = 0;  ///< the binary16 bit pattern
  friend constexpr bool operator==(half a, half b) { return a.bits == b.bits; }
};
/// bfloat16 storage: the upper 16 bits of an fp32.
struct bfloat16 {
  std::uint16_t bits = 0;  ///< the upper 16 bits of the fp32 value
  friend constexpr bool operator==(bfloat16 a, bfloat16 b) { return a.bits == b.bits; }
};
static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2);

/// The element type of a cache at run time (visit_dtype turns it into the C++ type).
enum class dtype {
  f32,   ///< float
  f16,   ///< kvscore::half
  bf16,  ///< kvscore::bfloat16
};

/// True for the element types a cache may hold: float, kvscore::half, kvscore::bfloat16.
template <class T>
inline constexpr bool is_element_type_v =
    std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

/// The dtype of element type T (a compile-time error for any other type).
template <class T>
constexpr dtype dtype_of() {
  static_assert(is_element_type_v<T>, "kvscore element types are float, half, bfloat16");
  if constexpr (std::is_same_v<T, float>) return dtype::f32;
  else if constexpr (std::is_same_v<T, half>) return dtype::f16;
  else return dtype::bf16;
}

/// f(std::type_identity<T>{}) for the element type T of `t` (float, half, bfloat16): the one
/// switch from a run-time dtype to a compile-time type, for every front end.
/// `visit_dtype(dt, [&]<class T>(std::type_identity<T>) { return run<T>(...); });`
template <class F>
constexpr decltype(auto) visit_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::f16: return std::forward<F>(f)(std::type_identity<half>{});
    case dtype::bf16: return std::forward<F>(f)(std::type_identity<bfloat16>{});
    case dtype::f32: break;
  }
  return std::forward<F>(f)(std::type_identity<float>{});
}

/// "float32", "float16" or "bfloat16" (numpy's and torch's names).
constexpr const char* dtype_name(dtype t) {
  switch (t) {
    case dtype::f32: return "float32";
    case dtype::f16: return "float16";
    case dtype::bf16: return "bfloat16";
  }
  return "?";
}

// ---------------------------------------------------------------- scalar, exact

// always_inline: the SIMD translation units of kvscore::dispatch include this header with
// wider -m flags; an out-of-line copy from one of them must never be the one the linker keeps.
/// The fp32 value of a binary16 bit pattern (exact: every half is an fp32).
[[gnu::always_inline]] constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t out;
  if (exp == 0x1f) {  // Inf / NaN: widen payload
    out = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {  // normal
    out = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {  // signed zero
    out = sign;
  } else {  // subnormal: value = mant * 2^-24, renormalise
    std::uint32_t e = 113;  // biased fp32 exponent of 2^-14
    while ((mant & 0x400u) == 0) { mant <<= 1; --e; }
    out = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(out);
}

/// The binary16 bit pattern nearest to `f` (round to nearest even; overflow to Inf, NaN kept quiet).
constexpr std::uint16_t float_to_half_bits(float f) noexcept {
  const std::uint32_t x0 = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = std::uint16_t((x0 >> 16) & 0x8000u);
  const std::uint32_t x = x0 & 0x7fffffffu;
  if (x >= 0x7f800000u) {  // Inf or NaN
    if (x > 0x7f800000u) return std::uint16_t(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
    return std::uint16_t(sign | 0x7c00u);
  }
  if (x >= 0x477ff000u) return std::uint16_t(sign | 0x7c00u);  // >= 65520 rounds to Inf
  const std::uint32_t e = x >> 23;
  if (e >= 113) {  // half normal range
    std::uint32_t h = ((e - 112u) << 10) | ((x & 0x7fffffu) >> 13);
    const std::uint32_t rem = x & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry may bump the exponent: correct
    return std::uint16_t(sign | h);
  }
  // half subnormal (or zero): k = M * 2^(e-150) / 2^-24 = M >> (126 - e)
  const std::uint32_t M = (e == 0) ? (x & 0x7fffffu) : ((x & 0x7fffffu) | 0x800000u);
  const std::uint32_t shift = (e == 0) ? 125u : 126u - e;  // fp32 subnormals use exponent 1
  if (shift > 24) return sign;                              // below half the smallest subnormal
  std::uint32_t k = M >> shift;
  const std::uint32_t rem = M & ((1u << shift) - 1u);
  const std::uint32_t mid = 1u << (shift - 1u);
  if (rem > mid || (rem == mid && (k & 1u))) ++k;
  return std::uint16_t(sign | k);
}

/// The fp32 value of a bfloat16 bit pattern (exact).
[[gnu::always_inline]] constexpr float bf16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(std::uint32_t(b) << 16);
}

/// The bfloat16 bit pattern nearest to `f` (round to nearest even; NaN kept quiet).
constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((x >> 16) | 0x0040u);  // quiet NaN
  return std::uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

[[gnu::always_inline]] constexpr float to_float(float v) noexcept { return v; }  ///< the value itself
/// The exact fp32 value of a half.
[[gnu::always_inline]] constexpr float to_float(half v) noexcept { return half_bits_to_float(v.bits); }
/// The exact fp32 value of a bfloat16.
[[gnu::always_inline]] constexpr float to_float(bfloat16 v) noexcept { return bf16_bits_to_float(v.bits); }

/// `f` as element type T, rounded to nearest even (the identity for float).
template <class T>
constexpr T from_float(float f) noexcept {
  static_assert(is_element_type_v<T>);
  if constexpr (std::is_same_v<T, float>) return f;
  else if constexpr (std::is_same_v<T, half>) return half{float_to_half_bits(f)};
  else return bfloat16{float_to_bf16_bits(f)};
}

// ---------------------------------------------------------------- vector conversion
// F16C when the CPU has it (checked at run time) and the ISA pin allows AVX2-level code
// (KVSCORE_ISA / simd::set_active_isa at avx2 or above, or no pin), exact scalar otherwise.
// Both give bit-identical results (F16C uses RNE with the default MXCSR).

namespace detail {
#if defined(KVSCORE_X86) && (defined(__GNUC__) || defined(__clang__))
#define KVSCORE_HAVE_F16C_PATH 1
/// F16C is in reach: the CPU has it and the ISA pin is at AVX2 level or above.
inline bool f16c_allowed() noexcept {
  return cpu().f16c && isa_cap_slot().load(std::memory_order_relaxed) >= IsaLevel::avx2;
}
__attribute__((target("avx,f16c"))) inline void half_to_float_f16c(const half* src, float* dst,
                                                                 std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  if (i == n) return;
  // The last n - i < 8 values through one padded vector, as in float_to_half_f16c.
  std::uint16_t in[8] = {};
  float out[8];
  std::memcpy(in, src + i, (n - i) * sizeof(half));
  _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in))));
  std::memcpy(dst + i, out, (n - i) * sizeof(float));
}
__attribute__((target("avx,f16c"))) inline void float_to_half_f16c(const float* src, half* dst,
                                                                 std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  if (i == n) return;
  // The last n - i < 8 values through one padded vector, not a scalar tail loop: when n is a
  // constant multiple of 8 (convert(row, dst, 128) inlined into a caller), GCC -O3 rotates the
  // then-empty tail loop into one whose exit test `i != n` fails for ever, and warns about the
  // pointer overflow of its (dead) iteration 2^62 - 1 (-Waggressive-loop-optimizations). Same
  // bits either way: F16C rounds to nearest even, as float_to_half_bits does.
  float in[8] = {};
  std::uint16_t out[8];
  std::memcpy(in, src + i, (n - i) * sizeof(float));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(_mm256_loadu_ps(in), _MM_FROUND_TO_NEAREST_INT));
  std::memcpy(dst + i, out, (n - i) * sizeof(half));
}
#endif
}  // namespace detail

/// Which path convert() takes on this CPU under the current ISA pin: "f16c" or "scalar".
inline const char* convert_path() noexcept {
#ifdef KVSCORE_HAVE_F16C_PATH
  return detail::f16c_allowed() ? "f16c" : "scalar";
#else
  return "scalar";
#endif
}

/// Scalar reference conversion, exposed so tests can compare it with the fast path.
template <class S, class D>
inline void convert_scalar(const S* src, D* dst, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] = from_float<D>(to_float(src[i]));
}

/// dst[i] = src[i] converted to D (rounded to nearest even), i < n; F16C for half <-> float where the ISA pin
/// allows it, otherwise the scalar path (the same bits).
template <class S, class D>
inline void convert(const S* src, D* dst, std::size_t n) noexcept {
  static_assert(is_element_type_v<S> && is_element_type_v<D>);
#ifdef KVSCORE_HAVE_F16C_PATH
  if constexpr (std::is_same_v<S, half> && std::is_same_v<D, float>) {
    if (detail::f16c_allowed()) return detail::half_to_float_f16c(src, dst, n);
  } else if constexpr (std::is_same_v<S, float> && std::is_same_v<D, half>) {
    if (detail::f16c_allowed()) return detail::float_to_half_f16c(src, dst, n);
  }
#endif
  // bf16 <-> f32 is a shift plus integer rounding: the compiler vectorises this loop.
  convert_scalar(src, dst, n);
}

}  // namespace kvscore
