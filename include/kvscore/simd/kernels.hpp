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
// Just over 500 lines: every row kernel of the table is here once, over the policy, so that
// the scalar and vector paths cannot drift apart.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <xsimd/xsimd.hpp>

#include "kvscore/core/dtype.hpp"
#include "kvscore/simd/table.hpp"
#include "kvscore/core/view.hpp"

// Full unrolling of the register-tile loops (constant trip counts of 1..4): at -O2 GCC keeps
// them as loops and the accumulator arrays in memory.
#if defined(__clang__)
#define KVSCORE_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define KVSCORE_UNROLL _Pragma("GCC unroll 16")
#else
#define KVSCORE_UNROLL
#endif

// The register class of a float or vector operand in RowKernels::opaque's empty asm.
#if defined(__x86_64__) || defined(__i386__)
#define KVSCORE_OPAQUE_REG "+x"
#elif defined(__aarch64__)
#define KVSCORE_OPAQUE_REG "+w"
#else
#define KVSCORE_OPAQUE_REG "+m"
#endif

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
  static V vmax(V a, V b) noexcept { return a < b ? b : a; }
  static float hmax(V a) noexcept { return a; }
  /// W vectors -> one vector of their horizontal sums (here: one value).
  static V hsum_many(const V* a) noexcept { return a[0]; }
  static V exp(V a) noexcept { return std::exp(a); }
  // max/min that keep `a` when either is NaN, as std::max(a, b) / std::min(a, b) do on every table
  static V maxl(V a, V b) noexcept { return a < b ? b : a; }
  static V minl(V a, V b) noexcept { return b < a ? b : a; }
  /// out[0] = a rounded to the nearest integer, ties to even (finite, in int32's range).
  static void round_store(std::int32_t* out, V a) noexcept { *out = std::int32_t(std::nearbyint(a)); }
};

/// `Ext` tells apart tables of one xsimd arch compiled with more instructions (src/isa_avx512vnni.cpp:
/// the same code but for `#if`s on the extra flags), so that their kernels are distinct symbols.
template <class Arch, class Ext = void>
struct XsimdPolicy {
  using V = xsimd::batch<float, Arch>;
  static constexpr std::int64_t W = std::int64_t(V::size);

  template <class T>
  static V load(const T* p) noexcept {
    // The register width identifies the instruction set (x86 macros guard the intrinsics).
    [[maybe_unused]] constexpr std::size_t bytes = V::size * sizeof(float);
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
#if defined(__aarch64__) && defined(__ARM_NEON)
      if constexpr (bytes == 16)  // FCVTL: exact, as the scalar conversion
        return V(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p)))));
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
#if defined(__aarch64__) && defined(__ARM_NEON)
      if constexpr (bytes == 16)
        return V(vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const std::uint16_t*>(p)), 16)));
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
  static V vmax(V a, V b) noexcept { return xsimd::max(a, b); }
  static float hmax(V a) noexcept {
    alignas(64) float t[V::size];
    a.store_aligned(t);
    float m = t[0];
    for (std::size_t k = 1; k < V::size; ++k) m = m < t[k] ? t[k] : m;
    return m;
  }
  /// W batches -> lane k = Σ lanes of a[k], by one tree for every k (a lane-symmetric transpose).
  static V hsum_many(const V* a) noexcept {
#if defined(__AVX512F__)
    // xsimd 8.1's AVX-512 haddp returns lanes 2-5 and 10-13 permuted, so this one is ours.
    if constexpr (V::size == 16) {
      __m512 x[8], y[4];
      for (int k = 0; k < 8; ++k)  // lane j of x[k]: a[2k] (j < 8) or a[2k+1], lanes j and j + 8 added
        x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
      for (int k = 0; k < 4; ++k)  // 128-bit block b of y[k]: four partial sums of a[4k + b]
        y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
      const __m512 z0 = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
      const __m512 z1 = _mm512_add_ps(_mm512_shuffle_ps(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
      // lane 4b + e now holds the sum of a[4e + b]
      const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
      return V(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t));
    }
#endif
    return xsimd::haddp(a);  // SSE2, AVX and NEON versions checked against plain sums (tests/test_simd.cpp)
  }
  static V exp(V a) noexcept { return xsimd::exp(a); }
  static V maxl(V a, V b) noexcept { return xsimd::select(a < b, b, a); }
  static V minl(V a, V b) noexcept { return xsimd::select(b < a, b, a); }
  // cvtps2dq / fcvtns: the current rounding mode, nearest-even as std::nearbyint's
  static void round_store(std::int32_t* out, V a) noexcept { xsimd::nearbyint_as_int(a).store_unaligned(out); }
};

template <class P>
struct RowKernels {
  using V = typename P::V;
  static constexpr std::int64_t W = P::W;

  static bool finite(float x) noexcept { return __builtin_isfinite(x); }

  // Per-element reductions over one row into up to two accumulators (a, b), as a
  // vector step and a scalar-tail step; `v` is the query vector, j the offset into it.
  // kTwo says whether b is an output (dot_sqnorm) or dead (the compiler drops it).
  struct SqNorm {
    static constexpr bool kTwo = false;
    static void vec(V& a, V&, V x, const float*, std::int64_t) noexcept { a = P::fma(x, x, a); }
    static void one(float& a, float&, float x, const float*, std::int64_t) noexcept { a += x * x; }
  };
  // A NaN/Inf element makes the dot non-finite: Inf*0 = NaN, and an Inf or NaN
  // accumulator never returns to a finite value.
  struct Dot {
    static constexpr bool kTwo = false;
    static void vec(V& a, V&, V x, const float* v, std::int64_t j) noexcept { a = P::fma(x, P::loadf(v + j), a); }
    static void one(float& a, float&, float x, const float* v, std::int64_t j) noexcept { a += x * v[j]; }
  };
  struct DotSqNorm {
    static constexpr bool kTwo = true;
    static void vec(V& a, V& b, V x, const float* v, std::int64_t j) noexcept {
      a = P::fma(x, P::loadf(v + j), a);
      b = P::fma(x, x, b);
    }
    static void one(float& a, float& b, float x, const float* v, std::int64_t j) noexcept {
      a += x * v[j];
      b += x * x;
    }
  };
  struct SqDist {
    static constexpr bool kTwo = false;
    static void vec(V& a, V&, V x, const float* v, std::int64_t j) noexcept {
      const V t = P::sub(x, P::loadf(v + j));
      a = P::fma(t, t, a);
    }
    static void one(float& a, float&, float x, const float* v, std::int64_t j) noexcept {
      const float t = x - v[j];
      a += t * t;
    }
  };

  static constexpr std::int64_t kRows = 4;  // rows in flight: hides FMA latency and the horizontal sums

  // Software prefetch (into all cache levels) of the group kPrefetchGroups ahead: the
  // four rows in lockstep touch four cache lines at once, an order the hardware
  // streamers follow less well. Addresses are formed as integers, never as pointers
  // past the cache, and a prefetch beyond the mapping is a no-op on x86.
  static constexpr std::int64_t kPrefetchGroups = 8;
  template <class T>
  static void prefetch_rows(const T* first, std::int64_t stride, std::int64_t d) noexcept {
    const std::uintptr_t row_bytes = std::uintptr_t(stride) * sizeof(T);
    const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(first) + std::uintptr_t(kPrefetchGroups * kRows) * row_bytes;
    const std::int64_t bytes = d * std::int64_t(sizeof(T));
    for (std::int64_t k = 0; k < kRows; ++k)
      for (std::int64_t b = 0; b < bytes; b += 64)
        __builtin_prefetch(reinterpret_cast<const void*>(base + std::uintptr_t(k) * row_bytes + std::uintptr_t(b)), 0, 3);
  }

  // out[i] (and out2[i] when Op::kTwo) = reduce(row_i) for n rows: four rows in
  // lockstep, then the remainder one by one.
  template <class Op, class T>
  static void reduce_rows(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, const float* v,
                          float* out, float* out2 = nullptr) noexcept {
    std::int64_t i = 0;
    for (; i + kRows <= n; i += kRows) {
      const T* r[kRows];
      for (std::int64_t k = 0; k < kRows; ++k) r[k] = base + (i + k) * stride;
      prefetch_rows(r[0], stride, d);
      V a[kRows], b[kRows];
      for (std::int64_t k = 0; k < kRows; ++k) a[k] = b[k] = P::zero();
      std::int64_t j = 0;
      for (; j + W <= d; j += W)
        for (std::int64_t k = 0; k < kRows; ++k) Op::vec(a[k], b[k], P::load(r[k] + j), v, j);
      float sa[kRows], sb[kRows];
      for (std::int64_t k = 0; k < kRows; ++k) {
        sa[k] = P::hsum(a[k]);
        sb[k] = Op::kTwo ? P::hsum(b[k]) : 0.f;
      }
      for (; j < d; ++j)
        for (std::int64_t k = 0; k < kRows; ++k) Op::one(sa[k], sb[k], to_float(r[k][j]), v, j);
      for (std::int64_t k = 0; k < kRows; ++k) {
        out[i + k] = sa[k];
        if constexpr (Op::kTwo) out2[i + k] = sb[k];
      }
    }
    for (; i < n; ++i) {
      const T* r = base + i * stride;
      V a = P::zero(), b = P::zero();
      std::int64_t j = 0;
      for (; j + W <= d; j += W) Op::vec(a, b, P::load(r + j), v, j);
      float sa = P::hsum(a), sb = Op::kTwo ? P::hsum(b) : 0.f;
      for (; j < d; ++j) Op::one(sa, sb, to_float(r[j]), v, j);
      out[i] = sa;
      if constexpr (Op::kTwo) out2[i] = sb;
    }
  }

  template <class T>
  static void sqnorm(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, float* out) noexcept {
    reduce_rows<SqNorm>(base, n, stride, d, nullptr, out);
  }
  template <class T>
  static void dot(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, const float* v,
                  float* out) noexcept {
    reduce_rows<Dot>(base, n, stride, d, v, out);
  }
  template <class T>
  static void dot_sqnorm(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, const float* v,
                         float* out, float* sq_out) noexcept {
    reduce_rows<DotSqNorm>(base, n, stride, d, v, out, sq_out);
  }
  template <class T>
  static void sqdist(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, const float* v,
                     float* out) noexcept {
    reduce_rows<SqDist>(base, n, stride, d, v, out);
  }

  // blk[0..d) += Σ_k scale[k] * row_k over m <= kRows rows (scale 0 drops a row).
  template <class T>
  static void rows_axpy(const T* const* r, const float* scale, std::int64_t m, float* blk, std::int64_t d) noexcept {
    // fast path only when every row is used: 0 * NaN would poison the block
    if (m == kRows && scale[0] != 0.f && scale[1] != 0.f && scale[2] != 0.f && scale[3] != 0.f) {
      const V s0 = P::splat(scale[0]), s1 = P::splat(scale[1]), s2 = P::splat(scale[2]), s3 = P::splat(scale[3]);
      std::int64_t j = 0;
      for (; j + W <= d; j += W) {
        const V x = P::add(P::fma(P::load(r[0] + j), s0, P::mul(P::load(r[1] + j), s1)),
                           P::fma(P::load(r[2] + j), s2, P::mul(P::load(r[3] + j), s3)));
        P::store(blk + j, P::add(P::loadf(blk + j), x));
      }
      for (; j < d; ++j)
        blk[j] += (to_float(r[0][j]) * scale[0] + to_float(r[1][j]) * scale[1]) +
                  (to_float(r[2][j]) * scale[2] + to_float(r[3][j]) * scale[3]);
      return;
    }
    for (std::int64_t k = 0; k < m; ++k) {
      if (scale[k] == 0.f) continue;
      const V s = P::splat(scale[k]);
      std::int64_t j = 0;
      for (; j + W <= d; j += W) P::store(blk + j, P::fma(P::load(r[k] + j), s, P::loadf(blk + j)));
      for (; j < d; ++j) blk[j] += to_float(r[k][j]) * scale[k];
    }
  }

  // Shared body of sum / sum_normalized: rows go through in groups of kRows, their
  // squared norms first (the group is then hot in L1), then one weighted add into an
  // fp32 block accumulator that is flushed to fp64 every kSumBlockRows rows.
  // A row with a non-finite squared norm gets weight 0 — it is left out.
  template <bool Normalize, class T>
  static std::int64_t sum_rows(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, double* acc,
                               float* row_out) noexcept {
    alignas(64) float blk[kMaxHeadDim];
    std::int64_t added = 0;
    for (std::int64_t i0 = 0; i0 < n; i0 += kSumBlockRows) {
      const std::int64_t i1 = i0 + kSumBlockRows < n ? i0 + kSumBlockRows : n;
      for (std::int64_t j = 0; j < d; ++j) blk[j] = 0.f;
      for (std::int64_t i = i0; i < i1; i += kRows) {
        const std::int64_t m = i1 - i < kRows ? i1 - i : kRows;
        reduce_rows<SqNorm>(base + i * stride, m, stride, d, nullptr, row_out + i);
        const T* r[kRows];
        float w[kRows];
        for (std::int64_t k = 0; k < kRows; ++k) {
          const std::int64_t row = k < m ? i + k : i;  // pad a short group with weight 0
          r[k] = base + row * stride;
          const float s = row_out[row];
          const bool use = k < m && finite(s) && (!Normalize || s > 0.f);
          w[k] = use ? (Normalize ? 1.f / __builtin_sqrtf(s) : 1.f) : 0.f;
          added += use ? 1 : 0;
          if (Normalize && k < m) row_out[i + k] = __builtin_sqrtf(s);
        }
        rows_axpy(r, w, m < kRows ? m : kRows, blk, d);
      }
      for (std::int64_t j = 0; j < d; ++j) acc[j] += double(blk[j]);
    }
    return added;
  }

  template <class T>
  static std::int64_t sum(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, double* acc,
                          float* sq) noexcept {
    return sum_rows<false>(base, n, stride, d, acc, sq);
  }
  template <class T>
  static std::int64_t sum_normalized(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d,
                                     double* acc, float* norm_out) noexcept {
    return sum_rows<true>(base, n, stride, d, acc, norm_out);
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

  /// e[j] = exp(x[j] - shift), j < n. Every element goes through the same vector code (the
  /// tail is padded to a full vector), so a value does not depend on where a chunk starts.
  static void exp_shifted(const float* x, float shift, std::int64_t n, float* e) noexcept {
    const V s = P::splat(shift);
    std::int64_t j = 0;
    for (; j + W <= n; j += W) P::store(e + j, P::exp(P::sub(P::loadf(x + j), s)));
    if (j < n) {
      alignas(64) float t[W];
      for (std::int64_t k = 0; k < W; ++k) t[k] = j + k < n ? x[j + k] : shift;
      P::store(t, P::exp(P::sub(P::loadf(t), s)));
      for (std::int64_t k = 0; j + k < n; ++k) e[j + k] = t[k];
    }
  }

  // ---- KVzip's softmax rows: the max, exp with its sum, the running max of the probabilities
  static float max_f32(const float* x, std::int64_t n) noexcept {
    V m = P::splat(-__builtin_inff());
    std::int64_t j = 0;
    for (; j + W <= n; j += W) m = P::vmax(m, P::loadf(x + j));
    float r = P::hmax(m);
    for (; j < n; ++j) r = r < x[j] ? x[j] : r;
    return r;
  }

  static double exp_sum(const float* x, float shift, std::int64_t n, float* e) noexcept {
    const V s = P::splat(shift);
    double total = 0;
    V acc = P::zero();
    std::int64_t j = 0, vecs = 0;
    for (; j + W <= n; j += W) {
      const V v = P::exp(P::sub(P::loadf(x + j), s));
      P::store(e + j, v);
      acc = P::add(acc, v);
      if (++vecs == kSumBlockRows) {
        total += double(P::hsum(acc));
        acc = P::zero();
        vecs = 0;
      }
    }
    total += double(P::hsum(acc));
    if (j < n) {  // the tail as exp_shifted computes it (padded with `shift`: exp(0), not summed)
      exp_shifted(x + j, shift, n - j, e + j);
      for (; j < n; ++j) total += double(e[j]);
    }
    return total;
  }

  static void max_scaled(const float* e, float w, const float* kw, std::int64_t n, float* acc) noexcept {
    const V ws = P::splat(w);
    std::int64_t j = 0;
    for (; j + W <= n; j += W) {
      V v = P::mul(P::loadf(e + j), ws);
      if (kw != nullptr) v = P::mul(v, P::loadf(kw + j));
      P::store(acc + j, P::vmax(P::loadf(acc + j), v));
    }
    for (; j < n; ++j) {
      float v = e[j] * w;
      if (kw != nullptr) v *= kw[j];
      acc[j] = acc[j] < v ? v : acc[j];
    }
  }

  // ---- Query-key logits from packed key panels (KVzip): a register tile of QT queries × one
  // panel of kGemmPanel keys (VP vectors), one broadcast-FMA chain per value over j.
  static constexpr std::int64_t kVP = kGemmPanel / W;  // vectors per panel
  static constexpr int kQT = kVP >= 12 ? 1 : int(12 / kVP);  // queries per tile: 12 accumulators

  static void pack_panels(const float* k, std::int64_t n, std::int64_t ld, std::int64_t d, float* out) noexcept {
    for (std::int64_t p = 0; p * kGemmPanel < n; ++p) {
      float* dst = out + p * kGemmPanel * d;
      for (std::int64_t c = 0; c < kGemmPanel; ++c) {
        const std::int64_t row = p * kGemmPanel + c;
        for (std::int64_t j = 0; j < d; ++j) dst[j * kGemmPanel + c] = row < n ? k[row * ld + j] : 0.f;
      }
    }
  }

  static void gemm_tile(const float* const* q, std::int64_t d, const float* panel, float* const* out,
                        std::int64_t qv, std::int64_t kv) noexcept {
    V acc[kQT][kVP];
    KVSCORE_UNROLL
    for (int i = 0; i < kQT; ++i)
      KVSCORE_UNROLL
      for (std::int64_t v = 0; v < kVP; ++v) acc[i][v] = P::zero();
    for (std::int64_t j = 0; j < d; ++j) {
      V b[kVP];
      KVSCORE_UNROLL
      for (std::int64_t v = 0; v < kVP; ++v) b[v] = P::loadf(panel + j * kGemmPanel + v * W);
      KVSCORE_UNROLL
      for (int i = 0; i < kQT; ++i) {
        const V a = P::splat(q[i][j]);
        KVSCORE_UNROLL
        for (std::int64_t v = 0; v < kVP; ++v) acc[i][v] = P::fma(a, b[v], acc[i][v]);
      }
    }
    alignas(64) float tmp[kGemmPanel];
    for (std::int64_t i = 0; i < qv; ++i) {
      if (kv == kGemmPanel) {
        for (std::int64_t v = 0; v < kVP; ++v) P::store(out[i] + v * W, acc[i][v]);
      } else {
        for (std::int64_t v = 0; v < kVP; ++v) P::store(tmp + v * W, acc[i][v]);
        for (std::int64_t c = 0; c < kv; ++c) out[i][c] = tmp[c];
      }
    }
  }

  static void gemm_panels(const float* q, std::int64_t nq, const float* kpack, std::int64_t nk, std::int64_t d,
                          float* out, std::int64_t ldo) noexcept {
    for (std::int64_t i0 = 0; i0 < nq; i0 += kQT) {
      const std::int64_t qv = nq - i0 < kQT ? nq - i0 : kQT;
      const float* qr[kQT];
      for (int i = 0; i < kQT; ++i) qr[i] = q + (i0 + (i < qv ? i : qv - 1)) * d;  // a short tile repeats its last row
      for (std::int64_t p = 0; p * kGemmPanel < nk; ++p) {
        const std::int64_t kv = nk - p * kGemmPanel < kGemmPanel ? nk - p * kGemmPanel : kGemmPanel;
        float* o[kQT];
        for (int i = 0; i < kQT; ++i) o[i] = out + (i0 + (i < qv ? i : qv - 1)) * ldo + p * kGemmPanel;
        gemm_tile(qr, d, kpack + p * kGemmPanel * d, o, qv, kv);
      }
    }
  }

  // ---- Low-rank projection (OjaKV): codes = rows · U and rows = codes · Uᵀ, U given as r
  // contiguous rows u_j of d floats. A group of kRows rows stays in L1 (and in registers, one
  // vector at a time) while the r basis rows stream past it kCols at a time; the basis itself
  // (r·d floats, 16 KiB at d = 128, r = 32) stays in L1/L2 across the groups.

  /// Basis rows per project tile: kRows × kCols accumulators in registers (16 on the
  /// 32-register W >= 16 path, 8 where there are 16 vector registers or fewer).
  static constexpr std::int64_t kCols = W >= 16 ? 4 : 2;

  // out[m*r + c] = ⟨row_m, u_c⟩ for m < mv, c < cv, from kRows rows and kCols basis rows (the
  // caller pads a short tile by repeating its last row / basis row). Every code goes through the
  // same instructions: fp32 lanes, one transposing horizontal add (hsum_many: W accumulators
  // into one vector of sums, a lane-symmetric tree), then the scalar tail of d in order. So a
  // code does not depend on where its row or basis row falls in a tile.
  template <class T>
  static void project_tile(const T* const* rows, const float* const* u, std::int64_t d, float* out, std::int64_t r,
                           std::int64_t mv, std::int64_t cv) noexcept {
    constexpr int M = int(kRows), C = int(kCols), MC = M * C;
    static_assert(MC % W == 0, "project_tile reduces W accumulators at a time");
    V a[MC];
    KVSCORE_UNROLL
    for (int q = 0; q < MC; ++q) a[q] = P::zero();
    std::int64_t j = 0;
    for (; j + W <= d; j += W) {
      V b[C];
      KVSCORE_UNROLL
      for (int c = 0; c < C; ++c) b[c] = P::loadf(u[c] + j);
      KVSCORE_UNROLL
      for (int m = 0; m < M; ++m) {
        const V x = P::load(rows[m] + j);
        KVSCORE_UNROLL
        for (int c = 0; c < C; ++c) a[m * C + c] = P::fma(x, b[c], a[m * C + c]);
      }
    }
    alignas(64) float s[MC];
    KVSCORE_UNROLL
    for (int q = 0; q < MC; q += int(W)) P::store(s + q, P::hsum_many(a + q));
    for (; j < d; ++j)
      KVSCORE_UNROLL
      for (int m = 0; m < M; ++m) {
        const float x = to_float(rows[m][j]);
        KVSCORE_UNROLL
        for (int c = 0; c < C; ++c) s[m * C + c] += x * u[c][j];
      }
    for (std::int64_t m = 0; m < mv; ++m)
      for (std::int64_t c = 0; c < cv; ++c) out[m * r + c] = s[m * C + c];
  }

  template <class T>
  static void project(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, const float* basis,
                      std::int64_t r, float* out) noexcept {
    for (std::int64_t i = 0; i < n; i += kRows) {
      const std::int64_t mv = n - i < kRows ? n - i : kRows;
      const T* rows[kRows];
      for (std::int64_t k = 0; k < kRows; ++k) rows[k] = base + (k < mv ? i + k : n - 1) * stride;
      if (mv == kRows) prefetch_rows(rows[0], stride, d);
      for (std::int64_t c = 0; c < r; c += kCols) {
        const std::int64_t cv = r - c < kCols ? r - c : kCols;
        const float* u[kCols];
        for (std::int64_t q = 0; q < kCols; ++q) u[q] = basis + (q < cv ? c + q : r - 1) * d;
        project_tile(rows, u, d, out + i * r + c, r, mv, cv);
      }
    }
  }

  // out[m*d + q*W ...] for M code rows and Q output vectors: per output one fp32 chain over j.
  template <int M, int Q>
  static void unproject_tile(const float* codes, std::int64_t r, const float* u, std::int64_t d,
                             float* out) noexcept {
    V a[M][Q];
    KVSCORE_UNROLL
    for (int m = 0; m < M; ++m)
      KVSCORE_UNROLL
      for (int q = 0; q < Q; ++q) a[m][q] = P::zero();
    for (std::int64_t j = 0; j < r; ++j) {
      V s[M];
      KVSCORE_UNROLL
      for (int m = 0; m < M; ++m) s[m] = P::splat(codes[m * r + j]);
      KVSCORE_UNROLL
      for (int q = 0; q < Q; ++q) {
        const V b = P::loadf(u + j * d + q * W);
        KVSCORE_UNROLL
        for (int m = 0; m < M; ++m) a[m][q] = P::fma(s[m], b, a[m][q]);
      }
    }
    KVSCORE_UNROLL
    for (int m = 0; m < M; ++m)
      KVSCORE_UNROLL
      for (int q = 0; q < Q; ++q) P::store(out + m * d + q * W, a[m][q]);
  }

  template <int M>
  static void unproject_rows(const float* codes, std::int64_t r, const float* basis, std::int64_t d,
                             float* out) noexcept {
    constexpr int kVecs = 4;  // output vectors per tile: M·4 accumulators
    std::int64_t k = 0;
    for (; k + kVecs * W <= d; k += kVecs * W) unproject_tile<M, kVecs>(codes, r, basis + k, d, out + k);
    for (; k + W <= d; k += W) unproject_tile<M, 1>(codes, r, basis + k, d, out + k);
    for (; k < d; ++k)
      KVSCORE_UNROLL
      for (int m = 0; m < M; ++m) {
        float a = 0.f;
        for (std::int64_t j = 0; j < r; ++j) a += codes[m * r + j] * basis[j * d + k];
        out[m * d + k] = a;
      }
  }

  static void unproject(const float* codes, std::int64_t n, std::int64_t r, const float* basis, std::int64_t d,
                        float* out) noexcept {
    std::int64_t i = 0;
    for (; i + 2 <= n; i += 2) unproject_rows<2>(codes + i * r, r, basis, d, out + i * d);
    for (; i < n; ++i) unproject_rows<1>(codes + i * r, r, basis, d, out + i * d);
  }

  // Codes in pairs of dimensions (table.hpp): byte (j/2)·2h + 2t + j%2 holds dimension j's code of
  // token t (low nibble) and of token h + t (high nibble). Plain loops, vectorised by each
  // table's compile flags (src/isa_*.cpp); integers, so every table gives the same sums. On x86
  // with 256/512-bit vectors the 32-token case widens a pair's 32 bytes to int16 lanes
  // [c_tj, c_t,j+1] (low nibbles: tokens 0-15, high: 16-31) and adds them times (w_j, w_j+1) in
  // pairs with (v)pmaddwd into int32 — exact (|w| <= 32767, codes <= 15), the same sums.
  static void int4_dots(const std::int16_t* w, std::int64_t g, std::int64_t d, const std::uint8_t* codes,
                        std::int64_t h, std::int32_t* acc) noexcept {
    [[maybe_unused]] constexpr std::int64_t bytes = W * std::int64_t(sizeof(float));
#if defined(__AVX2__)
    if constexpr (bytes >= 32) {
      if (h == 16) {
        std::int64_t k = 0;
        for (; k + 4 <= g; k += 4) int4_dots_pairs<4>(w + k * d, d, codes, acc + k * 32);
        const std::int64_t r = g - k;
        if (r == 3) int4_dots_pairs<3>(w + k * d, d, codes, acc + k * 32);
        if (r == 2) int4_dots_pairs<2>(w + k * d, d, codes, acc + k * 32);
        if (r == 1) int4_dots_pairs<1>(w + k * d, d, codes, acc + k * 32);
        return;
      }
    }
#endif
    for (std::int64_t k = 0; k < g; ++k) {
      std::int32_t* a = acc + k * 2 * h;
      for (std::int64_t t = 0; t < 2 * h; ++t) a[t] = 0;
      for (std::int64_t j = 0; j < d; j += 2) {
        const std::uint8_t* c = codes + (j / 2) * 2 * h;
        const std::int32_t w0 = w[k * d + j], w1 = j + 1 < d ? w[k * d + j + 1] : 0;
        for (std::int64_t t = 0; t < h; ++t) {
          a[t] += w0 * std::int32_t(c[2 * t] & 15) + w1 * std::int32_t(c[2 * t + 1] & 15);
          a[h + t] += w0 * std::int32_t(c[2 * t] >> 4) + w1 * std::int32_t(c[2 * t + 1] >> 4);
        }
      }
    }
  }

#if defined(__AVX2__)
  // int4_dots for 32-token blocks, K queries (rows of d weights) at once, the accumulators in
  // registers; each query's (w_j, w_j+1) broadcast from memory as one int32.
  template <int K>
  static void int4_dots_pairs(const std::int16_t* w, std::int64_t d, const std::uint8_t* codes,
                              std::int32_t* acc) noexcept {
#if defined(__AVX512BW__)
    constexpr int V = 2;  // 16 tokens per vector
    using R = __m512i;
#else
    constexpr int V = 4;  // 8 tokens per vector
    using R = __m256i;
#endif
    R a[K][V];
    KVSCORE_UNROLL
    for (int k = 0; k < K; ++k)
      KVSCORE_UNROLL
      for (int v = 0; v < V; ++v) a[k][v] = R{};
    auto step = [&](const std::uint8_t* c, const std::int32_t* pairs) {
      R x[V];
#if defined(__AVX512BW__)
      const __m256i m4 = _mm256_set1_epi8(0x0f), y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
      x[0] = _mm512_cvtepu8_epi16(_mm256_and_si256(y, m4));
      x[1] = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(y, 4), m4));
#else
      const __m128i m4 = _mm_set1_epi8(0x0f), y0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)),
                    y1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16));
      x[0] = _mm256_cvtepu8_epi16(_mm_and_si128(y0, m4));
      x[1] = _mm256_cvtepu8_epi16(_mm_and_si128(y1, m4));
      x[2] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(y0, 4), m4));
      x[3] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(y1, 4), m4));
#endif
      KVSCORE_UNROLL
      for (int k = 0; k < K; ++k) {
#if defined(__AVX512BW__)
        const R b = _mm512_set1_epi32(pairs[k]);
        KVSCORE_UNROLL
#if defined(__AVX512VNNI__)
        for (int v = 0; v < V; ++v) a[k][v] = _mm512_dpwssd_epi32(a[k][v], x[v], b);  // the same sums, one op
#else
        for (int v = 0; v < V; ++v) a[k][v] = _mm512_add_epi32(a[k][v], _mm512_madd_epi16(x[v], b));
#endif
#else
        const R b = _mm256_set1_epi32(pairs[k]);
        KVSCORE_UNROLL
        for (int v = 0; v < V; ++v) a[k][v] = _mm256_add_epi32(a[k][v], _mm256_madd_epi16(x[v], b));
#endif
      }
    };
    std::int32_t pr[K];
    std::int64_t j = 0;
    for (; j + 2 <= d; j += 2) {
      KVSCORE_UNROLL
      for (int k = 0; k < K; ++k) std::memcpy(&pr[k], w + k * d + j, 4);  // (w_j, w_j+1), little-endian
      step(codes + j * 16, pr);
    }
    if (j < d) {  // odd head_dim: the last dimension alone
      KVSCORE_UNROLL
      for (int k = 0; k < K; ++k) pr[k] = std::int32_t(std::uint16_t(w[k * d + j]));
      step(codes + j * 16, pr);
    }
    KVSCORE_UNROLL
    for (int k = 0; k < K; ++k)
      KVSCORE_UNROLL
      for (int v = 0; v < V; ++v)
#if defined(__AVX512BW__)
        _mm512_storeu_si512(acc + k * 32 + v * 16, a[k][v]);
#else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + k * 32 + v * 8), a[k][v]);
#endif
  }
#endif

  // The int4 block score's per-block work (block_sparse.hpp). Every value is elementwise fp32
  // arithmetic with no product added to anything (GCC contracts a·b + c under -mfma), integer
  // sums, or a min/max: the same bits on every table.

  /// Quest's bound for g queries over one block: lanes[k·16 + l] = Σ_{j ≡ l (mod 16)}
  /// max(q_kj·lo_j, q_kj·hi_j), j ascending (pariskv::detail::tree16 then sums the lanes).
  static void int4_quest(const float* q, std::int64_t g, std::int64_t d, const float* lo, const float* hi,
                         float* lanes) noexcept {
    constexpr std::int64_t NV = 16 / W;  // vectors per 16 lanes
    const std::int64_t d16 = d - d % 16;
    for (std::int64_t k = 0; k < g; ++k) {
      const float* qk = q + k * d;
      V a[NV];
      KVSCORE_UNROLL
      for (std::int64_t v = 0; v < NV; ++v) a[v] = P::zero();
      for (std::int64_t j = 0; j < d16; j += 16)
        KVSCORE_UNROLL
        for (std::int64_t v = 0; v < NV; ++v) {
          const V x = P::loadf(qk + j + v * W);
          a[v] = P::add(a[v], P::maxl(P::mul(x, P::loadf(lo + j + v * W)), P::mul(x, P::loadf(hi + j + v * W))));
        }
      float* out = lanes + k * 16;
      KVSCORE_UNROLL
      for (std::int64_t v = 0; v < NV; ++v) P::store(out + v * W, a[v]);
      for (std::int64_t j = d16, l = 0; j < d; ++j, ++l) {
        const float x = qk[j] * lo[j], y = qk[j] * hi[j];
        out[l] += x < y ? y : x;
      }
    }
  }

  /// One block's int4 summary from n fp32 keys per dimension (row j: x + j·ld): lo[j] and hi[j]
  /// their min and max, st[j] = (hi[j] − lo[j])/15 and the codes (int4_dots' layout, h = ⌈n/2⌉,
  /// 0 past n and for an odd head_dim's absent last dimension): c = (x − lo)·(1/st) rounded to
  /// nearest-even in [0, 15] (0 where that is not finite, or st is 0).
  static void int4_summarize(const float* x, std::int64_t ld, std::int64_t n, std::int64_t d, float* lo, float* st,
                             float* hi, std::uint8_t* codes) noexcept {
    const std::int64_t h = (n + 1) / 2;
    if (2 * h > 512) return int4_summarize_long(x, ld, n, d, lo, st, hi, codes);
    // two dimensions at a time: their codes as int32, then packed into the pair's 2h bytes
    alignas(64) std::int32_t cr[2][512];
    for (std::int64_t j = 0; j < d; j += 2) {
      for (std::int64_t e = 0; e < 2; ++e) {
        std::int32_t* o = cr[e];
        if (j + e == d) {  // odd head_dim: the absent dimension codes 0
          for (std::int64_t t = 0; t < 2 * h; ++t) o[t] = 0;
          continue;
        }
        const float* r = x + (j + e) * ld;
        const float inv = int4_range(r, n, lo[j + e], hi[j + e], st[j + e]);
        int4_row_codes(r, n, lo[j + e], inv, o);
        for (std::int64_t t = n; t < 2 * h; ++t) o[t] = 0;
      }
      std::uint8_t* c = codes + j * h;  // the pair's bytes: (j/2)·2h
      for (std::int64_t t = 0; t < h; ++t) {
        const std::uint32_t v = code4(cr[0][t]) | code4(cr[0][h + t]) << 4 | code4(cr[1][t]) << 8 | code4(cr[1][h + t]) << 12;
        c[2 * t] = std::uint8_t(v);
        c[2 * t + 1] = std::uint8_t(v >> 8);
      }
    }
  }

  /// o[t] = (r[t] − a)·inv rounded to nearest-even for t < m, 0 where that is above 16 or not
  /// finite (code4 then clamps to [0, 15]).
  static void int4_row_codes(const float* r, std::int64_t m, float a, float inv, std::int32_t* o) noexcept {
    const std::int64_t mw = m - m % W;
    const V va = P::splat(a), vi = P::splat(inv), cap = P::splat(16.f), zero = P::zero();
    for (std::int64_t t = 0; t < mw; t += W)
      P::round_store(o + t, select_le(P::mul(P::sub(P::loadf(r + t), va), vi), cap, zero));  // NaN, ±inf -> 0
    for (std::int64_t t = mw; t < m; ++t) {
      const float u = (r[t] - a) * inv;
      o[t] = u <= 16.f ? std::int32_t(std::nearbyint(u)) : 0;
    }
  }

  static std::uint32_t code4(std::int32_t v) noexcept { return std::uint32_t(v < 0 ? 0 : (v > 15 ? 15 : v)); }

  /// One dimension's min, max and step over r[0, n); returns 1/step (0 when step is not > 0).
  static float int4_range(const float* r, std::int64_t n, float& lo, float& hi, float& st) noexcept {
    // min/max from the first key in every lane: a NaN counts only as the first key (std::min's
    // order), so any lane order gives one answer
    const std::int64_t nw = n - n % W;
    alignas(64) float lanes[2][W > 1 ? W : 1];
    V mn = P::splat(r[0]), mx = mn;
    for (std::int64_t t = 0; t < nw; t += W) {
      const V v = P::loadf(r + t);
      mn = P::minl(mn, v);
      mx = P::maxl(mx, v);
    }
    P::store(lanes[0], mn);
    P::store(lanes[1], mx);
    float a = lanes[0][0], b = lanes[1][0];
    for (std::int64_t l = 1; l < W; ++l) {
      a = lanes[0][l] < a ? lanes[0][l] : a;
      b = b < lanes[1][l] ? lanes[1][l] : b;
    }
    for (std::int64_t t = nw; t < n; ++t) {
      a = r[t] < a ? r[t] : a;
      b = b < r[t] ? r[t] : b;
    }
    lo = a;
    hi = b;
    st = (b - a) / 15.f;
    return st > 0.f ? 1.f / st : 0.f;
  }

  // blocks of more than 512 tokens: one dimension at a time, the codes in pieces of 512
  static void int4_summarize_long(const float* x, std::int64_t ld, std::int64_t n, std::int64_t d, float* lo,
                                  float* st, float* hi, std::uint8_t* codes) noexcept {
    const std::int64_t h = (n + 1) / 2;
    std::int32_t cbuf[512];  // one dimension's codes, in pieces of 512 tokens
    for (std::int64_t j = 0; j < d; ++j) {
      const float* r = x + j * ld;
      const float inv = int4_range(r, n, lo[j], hi[j], st[j]), a = lo[j];
      std::uint8_t* c = codes + (j / 2) * 2 * h + j % 2;  // every other byte (table.hpp's layout)
      for (std::int64_t t = 0; t < h; ++t) c[2 * t] = 0;
      if (j + 1 == d && j % 2 == 0)  // odd head_dim: the last pair's absent dimension codes 0
        for (std::int64_t t = 0; t < h; ++t) c[2 * t + 1] = 0;
      for (std::int64_t t0 = 0; t0 < n; t0 += 512) {
        const std::int64_t m = n - t0 < 512 ? n - t0 : 512;
        int4_row_codes(r + t0, m, a, inv, cbuf);
        for (std::int64_t t = 0; t < m; ++t) {
          const std::int64_t tt = t0 + t;
          const std::uint32_t v = code4(cbuf[t]);
          if (tt < h) c[2 * tt] = std::uint8_t(c[2 * tt] | v);
          else c[2 * (tt - h)] = std::uint8_t(c[2 * (tt - h)] | (v << 4));
        }
      }
    }
  }

  /// One block's int4 scores for g queries: top_k = max_j |q_kj·st_j|, the weights w_kj =
  /// (q_kj·st_j)·(32767/top_k) rounded to nearest-even as int16 (all 0 when top_k is 0 or not
  /// finite), best[k] = max_{t<n} Σ_j w_kj·code(j, t) (exact int32, int4_dots), scale[k] =
  /// top_k/32767, and q_k·lo in 16 lanes as int4_quest's (lanes[k·16 + l] = Σ_{j ≡ l (mod 16)}
  /// q_kj·lo_j, j ascending, each product rounded before its add): the block's score is
  /// tree16(lanes[k]) + scale[k]·best[k]. Scratch: w g·d int16, acc g·2h int32.
  static void int4_block(const float* q, std::int64_t g, std::int64_t d, const float* lo, const float* st,
                         const std::uint8_t* codes, std::int64_t n, std::int16_t* w, std::int32_t* acc,
                         std::int32_t* best, float* scale, float* lanes) noexcept {
    constexpr std::int64_t NV = 16 / W;  // vectors per 16 lanes
    const std::int64_t h = (n + 1) / 2, dw = d - d % W, d16 = d - d % 16;
    for (std::int64_t k = 0; k < g; ++k) {
      const float* qk = q + k * d;
      std::int16_t* wk = w + k * d;
      V a[NV];
      KVSCORE_UNROLL
      for (std::int64_t v = 0; v < NV; ++v) a[v] = P::zero();
      for (std::int64_t j = 0; j < d16; j += 16)
        KVSCORE_UNROLL
        for (std::int64_t v = 0; v < NV; ++v)
          a[v] = P::add(a[v], opaque(P::mul(P::loadf(qk + j + v * W), P::loadf(lo + j + v * W))));
      float* out = lanes + k * 16;
      KVSCORE_UNROLL
      for (std::int64_t v = 0; v < NV; ++v) P::store(out + v * W, a[v]);
      for (std::int64_t j = d16, l = 0; j < d; ++j, ++l) out[l] += opaque(qk[j] * lo[j]);
      const float top = std::bit_cast<float>(max_abs_bits(qk, st, d));
      scale[k] = top / 32767.f;
      const float inv = top > 0.f && top <= 3.4028235e38f ? 32767.f / top : 0.f;
      if (inv == 0.f) {
        for (std::int64_t j = 0; j < d; ++j) wk[j] = 0;
        continue;
      }
      const V vi = P::splat(inv);
      for (std::int64_t j = 0; j < dw; j += W) round_store16(wk + j, P::mul(P::mul(P::loadf(qk + j), P::loadf(st + j)), vi));
      for (std::int64_t j = dw; j < d; ++j) wk[j] = std::int16_t(std::nearbyint((qk[j] * st[j]) * inv));
    }
    int4_dots(w, g, d, codes, h, acc);
    for (std::int64_t k = 0; k < g; ++k) best[k] = max_i32(acc + k * 2 * h, n);
  }

  /// The value unchanged, opaque to the optimiser: a product passed through it is never fused
  /// with the add that follows (GCC contracts a·b + c into an FMA where the table's flags
  /// allow one, and only there), so every table rounds the product as the scalar one does.
  template <class T>
  static T opaque(T v) noexcept {
#if defined(__GNUC__) || defined(__clang__)
    if constexpr (std::is_same_v<T, float>) {
      __asm__("" : KVSCORE_OPAQUE_REG(v));
    } else {
      typename T::register_type r = v;
      __asm__("" : KVSCORE_OPAQUE_REG(r));
      v = T(r);
    }
#endif
    return v;
  }

  /// out[0, W) = a's lanes rounded to nearest-even, as int16; |a| < 32767.5 (int4_block's
  /// weights), where narrowing with saturation (packssdw) and by truncation (vpmovdw) agree.
  static void round_store16(std::int16_t* out, V a) noexcept {
    if constexpr (W == 1) {
      *out = std::int16_t(std::nearbyint(a));
    } else {
      [[maybe_unused]] constexpr std::int64_t bytes = W * std::int64_t(sizeof(float));
      [[maybe_unused]] const auto i = xsimd::nearbyint_as_int(a);
#if defined(__AVX512F__)
      if constexpr (bytes == 64) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(i));
        return;
      }
#endif
#if defined(__AVX2__)
      if constexpr (bytes == 32) {
        const __m256i v = i;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                         _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
        return;
      }
#endif
#if defined(__SSE2__)
      if constexpr (bytes == 16) {
        const __m128i v = i;
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi32(v, v));
        return;
      }
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
      if constexpr (bytes == 16) {
        vst1_s16(out, vmovn_s32(i));
        return;
      }
#endif
      alignas(64) std::int32_t t[W];
      i.store_aligned(t);
      for (std::int64_t l = 0; l < W; ++l) out[l] = std::int16_t(t[l]);
    }
  }

  /// max_j of the bits of |a_j·b_j|: non-negative floats order as their bits do (a NaN above
  /// every number), so an integer max, the same in any order.
  static std::uint32_t max_abs_bits(const float* a, const float* b, std::int64_t d) noexcept {
    std::uint32_t m = 0;
    std::int64_t j = 0;
    if constexpr (W > 1) {
      using U = xsimd::batch<std::uint32_t, typename V::arch_type>;
      U mv(0u);
      for (; j + W <= d; j += W)
        mv = xsimd::max(mv, xsimd::bitwise_cast<U>(P::mul(P::loadf(a + j), P::loadf(b + j))) & U(0x7fffffffu));
      alignas(64) std::uint32_t l[W];
      mv.store_aligned(l);
      for (std::int64_t i = 0; i < W; ++i) m = l[i] > m ? l[i] : m;
    }
    for (; j < d; ++j) {
      const std::uint32_t v = std::bit_cast<std::uint32_t>(a[j] * b[j]) & 0x7fffffffu;
      m = v > m ? v : m;
    }
    return m;
  }

  /// max_{t<n} a[t] (n >= 1).
  static std::int32_t max_i32(const std::int32_t* a, std::int64_t n) noexcept {
    std::int32_t m = a[0];
    std::int64_t t = 0;
    if constexpr (W > 1) {
      using I = xsimd::batch<std::int32_t, typename V::arch_type>;
      if (n >= W) {
        I mv = I::load_unaligned(a);
        for (t = W; t + W <= n; t += W) mv = xsimd::max(mv, I::load_unaligned(a + t));
        alignas(64) std::int32_t l[W];
        mv.store_aligned(l);
        for (std::int64_t i = 0; i < W; ++i) m = l[i] > m ? l[i] : m;
      }
    }
    for (; t < n; ++t) m = a[t] > m ? a[t] : m;
    return m;
  }

  // u where u <= cap, else z (NaN: z)
  static V select_le(V u, V cap, V z) noexcept {
    if constexpr (W == 1) return u <= cap ? u : z;
    else return xsimd::select(u <= cap, u, z);
  }

  template <class T>
  static constexpr RowOps<T> ops() noexcept {
    return RowOps<T>{&sqnorm<T>, &dot<T>, &dot_sqnorm<T>, &sqdist<T>, &sum<T>, &sum_normalized<T>, &project<T>};
  }
};

/// The table of one policy; `name` is fixed by the first call for that policy.
template <class P>
const KernelTable& make_table(const char* name) noexcept {
  static const KernelTable table{name,
                                 int(P::W),
                                 kvscore::detail::isa_level(name),
                                 RowKernels<P>::template ops<float>(),
                                 RowKernels<P>::template ops<half>(),
                                 RowKernels<P>::template ops<bfloat16>(),
                                 &RowKernels<P>::reduce_f32,
                                 &RowKernels<P>::exp_shifted,
                                 &RowKernels<P>::unproject,
                                 &RowKernels<P>::max_f32,
                                 &RowKernels<P>::exp_sum,
                                 &RowKernels<P>::max_scaled,
                                 &RowKernels<P>::pack_panels,
                                 &RowKernels<P>::gemm_panels,
                                 &RowKernels<P>::int4_dots,
                                 &RowKernels<P>::int4_quest,
                                 &RowKernels<P>::int4_summarize,
                                 &RowKernels<P>::int4_block};
  return table;
}

inline const KernelTable& scalar_table() noexcept { return make_table<ScalarPolicy>("scalar"); }

}  // namespace kvscore::simd
