// kvscore/simd/kernels.hpp — the shared row kernels, written once over a vector policy.
//
// RowKernels<P> holds every kernel body; P is either ScalarPolicy (one float per
// "vector", the reference path) or XsimdPolicy<Arch> (xsimd batches). A policy only
// knows how to load/widen one vector of float, half or bfloat16 and do lane math,
// so scalar and SIMD paths share the same summation structure.
//
// fp16/bf16 widening: xsimd 8 has no 16-bit float batches, so loads use F16C /
// AVX-512 conversions (or the SSE2 unpack trick for bf16) when the translation unit
// is compiled for them, and convert element by element otherwise.
#pragma once

#include <cstdint>
#include <type_traits>

#include <xsimd/xsimd.hpp>

#include "kvscore/dtype.hpp"
#include "kvscore/simd/table.hpp"
#include "kvscore/view.hpp"

namespace kvscore::simd {

/// Rows per fp32 block in the row-sum kernels; blocks are then added in fp64, so a
/// mean over 10^6 tokens keeps ~1e-7 relative accuracy instead of drifting in fp32.
inline constexpr std::int64_t kSumBlockRows = 64;

struct ScalarPolicy {
  using V = float;
  static constexpr std::int64_t W = 1;
  template <class T>
  static V load(const T* p) noexcept { return to_float(*p); }
  static V loadf(const float* p) noexcept { return *p; }
  static void store(float* p, V a) noexcept { *p = a; }
  static V zero() noexcept { return 0.f; }
  static V splat(float x) noexcept { return x; }
  static V add(V a, V b) noexcept { return a + b; }
  static V sub(V a, V b) noexcept { return a - b; }
  static V mul(V a, V b) noexcept { return a * b; }
  static V fma(V a, V b, V c) noexcept { return a * b + c; }
  static float hsum(V a) noexcept { return a; }
};

template <class Arch>
struct XsimdPolicy {
  using V = xsimd::batch<float, Arch>;
  static constexpr std::int64_t W = std::int64_t(V::size);

  template <class T>
  static V load(const T* p) noexcept {
    // The register width identifies the instruction set (x86 macros guard the intrinsics).
    constexpr std::size_t bytes = V::size * sizeof(float);
    if constexpr (std::is_same_v<T, float>) {
      return V::load_unaligned(p);
    } else if constexpr (std::is_same_v<T, half>) {
#if defined(__AVX512F__)
      if constexpr (bytes == 64)
        return V(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#endif
#if defined(__F16C__) && defined(__AVX__)
      if constexpr (bytes == 32)
        return V(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
      return load_generic(p);
    } else {  // bfloat16: the fp32 bit pattern is the 16 bits shifted up
#if defined(__AVX512F__)
      if constexpr (bytes == 64)
        return V(_mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)));
#endif
#if defined(__AVX2__)
      if constexpr (bytes == 32)
        return V(_mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16)));
#endif
#if defined(__SSE2__)
      if constexpr (bytes == 16)
        return V(_mm_castsi128_ps(
            _mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#endif
      return load_generic(p);
    }
  }
  template <class T>
  static V load_generic(const T* p) noexcept {
    alignas(64) float tmp[V::size];
    for (std::size_t k = 0; k < V::size; ++k) tmp[k] = to_float(p[k]);
    return V::load_aligned(tmp);
  }
  static V loadf(const float* p) noexcept { return V::load_unaligned(p); }
  static void store(float* p, V a) noexcept { a.store_unaligned(p); }
  static V zero() noexcept { return V(0.f); }
  static V splat(float x) noexcept { return V(x); }
  static V add(V a, V b) noexcept { return a + b; }
  static V sub(V a, V b) noexcept { return a - b; }
  static V mul(V a, V b) noexcept { return a * b; }
  static V fma(V a, V b, V c) noexcept { return xsimd::fma(a, b, c); }
  static float hsum(V a) noexcept { return xsimd::hadd(a); }
};

template <class P>
struct RowKernels {
  using V = typename P::V;
  static constexpr std::int64_t W = P::W;

  static bool finite(float x) noexcept { return __builtin_isfinite(x); }

  template <class T>
  static float row_sqnorm(const T* r, std::int64_t d) noexcept {
    V a0 = P::zero(), a1 = P::zero();
    std::int64_t j = 0;
    for (; j + 2 * W <= d; j += 2 * W) {
      const V x = P::load(r + j), y = P::load(r + j + W);
      a0 = P::fma(x, x, a0);
      a1 = P::fma(y, y, a1);
    }
    for (; j + W <= d; j += W) {
      const V x = P::load(r + j);
      a0 = P::fma(x, x, a0);
    }
    float s = P::hsum(P::add(a0, a1));
    for (; j < d; ++j) {
      const float x = to_float(r[j]);
      s += x * x;
    }
    return s;
  }

  template <class T>
  static float row_dot(const T* r, const float* v, std::int64_t d) noexcept {
    // poison = Σ x·0 is 0 for finite rows and NaN when any element is NaN/Inf, so the
    // result is NaN for such rows even where the filter coefficient is 0.
    V a0 = P::zero(), a1 = P::zero(), poison = P::zero();
    const V z = P::zero();
    std::int64_t j = 0;
    for (; j + 2 * W <= d; j += 2 * W) {
      const V x = P::load(r + j), y = P::load(r + j + W);
      a0 = P::fma(x, P::loadf(v + j), a0);
      a1 = P::fma(y, P::loadf(v + j + W), a1);
      poison = P::fma(P::add(x, y), z, poison);
    }
    for (; j + W <= d; j += W) {
      const V x = P::load(r + j);
      a0 = P::fma(x, P::loadf(v + j), a0);
      poison = P::fma(x, z, poison);
    }
    float s = P::hsum(P::add(P::add(a0, a1), poison));
    for (; j < d; ++j) {
      const float x = to_float(r[j]);
      s += x * v[j] + x * 0.f;
    }
    return s;
  }

  template <class T>
  static float row_sqdist(const T* r, const float* v, std::int64_t d) noexcept {
    V a0 = P::zero(), a1 = P::zero();
    std::int64_t j = 0;
    for (; j + 2 * W <= d; j += 2 * W) {
      const V x = P::sub(P::load(r + j), P::loadf(v + j));
      const V y = P::sub(P::load(r + j + W), P::loadf(v + j + W));
      a0 = P::fma(x, x, a0);
      a1 = P::fma(y, y, a1);
    }
    for (; j + W <= d; j += W) {
      const V x = P::sub(P::load(r + j), P::loadf(v + j));
      a0 = P::fma(x, x, a0);
    }
    float s = P::hsum(P::add(a0, a1));
    for (; j < d; ++j) {
      const float x = to_float(r[j]) - v[j];
      s += x * x;
    }
    return s;
  }

  // blk[0..d) += scale * row, vector part then tail.
  template <class T>
  static void row_axpy(const T* r, float scale, float* blk, std::int64_t d) noexcept {
    const V s = P::splat(scale);
    std::int64_t j = 0;
    for (; j + W <= d; j += W) P::store(blk + j, P::fma(P::load(r + j), s, P::loadf(blk + j)));
    for (; j < d; ++j) blk[j] += to_float(r[j]) * scale;
  }

  template <class T>
  static void sqnorm(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, float* out) noexcept {
    for (std::int64_t i = 0; i < n; ++i) out[i] = row_sqnorm(base + i * stride, d);
  }
  template <class T>
  static void dot(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, const float* v,
                  float* out) noexcept {
    for (std::int64_t i = 0; i < n; ++i) out[i] = row_dot(base + i * stride, v, d);
  }
  template <class T>
  static void sqdist(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, const float* v,
                     float* out) noexcept {
    for (std::int64_t i = 0; i < n; ++i) out[i] = row_sqdist(base + i * stride, v, d);
  }

  template <class T>
  static std::int64_t sum(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, double* acc,
                          float* sq) noexcept {
    alignas(64) float blk[kMaxHeadDim];
    std::int64_t added = 0;
    for (std::int64_t i0 = 0; i0 < n; i0 += kSumBlockRows) {
      const std::int64_t i1 = i0 + kSumBlockRows < n ? i0 + kSumBlockRows : n;
      for (std::int64_t j = 0; j < d; ++j) blk[j] = 0.f;
      bool bad = false;
      for (std::int64_t i = i0; i < i1; ++i) {  // fused: one read of the row feeds both outputs
        const T* r = base + i * stride;
        V a = P::zero();
        std::int64_t j = 0;
        for (; j + W <= d; j += W) {
          const V x = P::load(r + j);
          a = P::fma(x, x, a);
          P::store(blk + j, P::add(P::loadf(blk + j), x));
        }
        float s = P::hsum(a);
        for (; j < d; ++j) {
          const float x = to_float(r[j]);
          s += x * x;
          blk[j] += x;
        }
        sq[i] = s;
        bad |= !finite(s);
      }
      if (bad) {  // rare: rebuild this block without the non-finite rows
        for (std::int64_t j = 0; j < d; ++j) blk[j] = 0.f;
        for (std::int64_t i = i0; i < i1; ++i)
          if (finite(sq[i])) row_axpy(base + i * stride, 1.f, blk, d);
      }
      for (std::int64_t i = i0; i < i1; ++i) added += finite(sq[i]) ? 1 : 0;
      for (std::int64_t j = 0; j < d; ++j) acc[j] += double(blk[j]);
    }
    return added;
  }

  template <class T>
  static std::int64_t sum_normalized(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d,
                                     double* acc, float* norm_out) noexcept {
    alignas(64) float blk[kMaxHeadDim];
    std::int64_t added = 0;
    for (std::int64_t i0 = 0; i0 < n; i0 += kSumBlockRows) {
      const std::int64_t i1 = i0 + kSumBlockRows < n ? i0 + kSumBlockRows : n;
      for (std::int64_t j = 0; j < d; ++j) blk[j] = 0.f;
      for (std::int64_t i = i0; i < i1; ++i) {
        const T* r = base + i * stride;
        const float s = row_sqnorm(r, d);
        const float nrm = __builtin_sqrtf(s);
        norm_out[i] = nrm;
        if (finite(s) && s > 0.f) {  // second read of the row hits L1
          row_axpy(r, 1.f / nrm, blk, d);
          ++added;
        }
      }
      for (std::int64_t j = 0; j < d; ++j) acc[j] += double(blk[j]);
    }
    return added;
  }

  static double reduce_f32(const float* p, std::int64_t n) noexcept {
    V a0 = P::zero(), a1 = P::zero(), a2 = P::zero(), a3 = P::zero();
    std::int64_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W) {
      a0 = P::add(a0, P::loadf(p + i));
      a1 = P::add(a1, P::loadf(p + i + W));
      a2 = P::add(a2, P::loadf(p + i + 2 * W));
      a3 = P::add(a3, P::loadf(p + i + 3 * W));
    }
    double s = P::hsum(P::add(P::add(a0, a1), P::add(a2, a3)));
    for (; i < n; ++i) s += p[i];
    return s;
  }

  template <class T>
  static constexpr RowOps<T> ops() noexcept {
    return RowOps<T>{&sqnorm<T>, &dot<T>, &sqdist<T>, &sum<T>, &sum_normalized<T>};
  }
};

/// The table of one policy; `name` is fixed by the first call for that policy.
template <class P>
const KernelTable& make_table(const char* name) noexcept {
  static const KernelTable table{name,
                                 int(P::W),
                                 RowKernels<P>::template ops<float>(),
                                 RowKernels<P>::template ops<half>(),
                                 RowKernels<P>::template ops<bfloat16>(),
                                 &RowKernels<P>::reduce_f32};
  return table;
}

inline const KernelTable& scalar_table() noexcept { return make_table<ScalarPolicy>("scalar"); }

}  // namespace kvscore::simd
