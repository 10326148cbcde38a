// kvscore/pariskv/attention.hpp — the attention of ParisKV's decode-time cache: softmax(scale·q·k)·v
// over the positions a query attends, one body per kernel set (portable, AVX2, AVX-512; the
// set is pariskv/kernels.hpp's, so the KVSCORE_ISA pin governs it as it governs the search).
//
//   attend_rows        one query over rows given by position (retrieval: scattered rows, read
//                      with software prefetch) or over the first n rows (dense)
//   attend_dense_group the G queries of one KV head over all its rows, K and V read once (GQA)
//
// On AVX-512, head_dim 64 and 128 (and 16, 32 for the dense group) take register-resident
// bodies: 16 rows' dot products reduced at once (tree16x16_avx512, kernels.hpp) and the value
// sums held in registers; the same operations in the same order as the generic loops.
//
// One order of operations on every set, so outputs are bit-identical across sets, thread
// counts and the two entry points (a query of attend_dense_group gets exactly attend_rows's
// output over positions 0..n-1):
//   dot(q, k)  16 lanes: lane l = fma chain over chunks c of k[16c + l]·q[16c + l] (zero past
//              head_dim), then the tree ((l, l+8), then +4, +2, +1) of rsq_ip_tree
//   logit_i    dot · scale (fp32);  m = max_i logit_i
//   p_i        exp_neg(logit_i − m): a fixed fp32 polynomial (Cephes' expf with fused
//              multiply-adds; below −87.3 it clamps, ~1e-38)
//   z          16 lanes: lane l sums p_i for i ≡ l (mod 16) in order, then the tree
//   out[j]     (fma chain over i of p_i·v_i[j]) / z
// fp32 throughout, as torch's CPU attention; ParisKVCache::attend_over keeps the fp64 reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kvscore/core/dtype.hpp"
#include "kvscore/pariskv/kernels.hpp"

namespace kvscore::pariskv::detail {

/// Scratch of the attention kernels (one per thread, grows, never shrinks).
struct AttendScratch {
  std::vector<float> logits;  ///< [G][n]
  std::vector<float> qpad;    ///< [G][d rounded up to 16], zero-padded queries
  std::vector<float> acc;     ///< [G][d rounded up to 16]
  std::vector<float> z;       ///< [G] softmax sums
};

inline constexpr float kExpClamp = -87.3365f;  // e^x stays a normal fp32 (2^-126) above it

inline std::int64_t padded16(std::int64_t d) noexcept { return (d + 15) / 16 * 16; }

/// Requests the lines of row `r` (`bytes` long): into L1 (Hint 3) or L2 (Hint 2). On x86 the
/// instructions are written out, as kernels.hpp's prefetch_line (GCC may drop a builtin prefetch
/// in a helper it does not inline into the target-attribute kernels).
template <int Hint>
inline void prefetch_row(const void* r, std::int64_t bytes) noexcept {
  const char* p = static_cast<const char*>(r);
  for (std::int64_t o = 0; o < bytes; o += 64) {
#if defined(KVSCORE_PARISKV_X86) && defined(__GNUC__)
    if constexpr (Hint == 3) __asm__ volatile("prefetcht0 %0" : : "m"(*(p + o)));
    else __asm__ volatile("prefetcht1 %0" : : "m"(*(p + o)));
#elif defined(__GNUC__)
    __builtin_prefetch(p + o, 0, Hint);
#else
    (void)p;
#endif
  }
}

inline constexpr std::int64_t kRowPrefetch = 8;  // rows ahead whose lines are requested

// ------------------------------------------------------------------ portable (the reference order)

template <class T>
inline void load16_portable(const T* p, std::int64_t count, float* out) noexcept {
  for (std::int64_t l = 0; l < 16; ++l) out[l] = l < count ? to_float(p[l]) : 0.f;
}

inline float tree16(const float* s) noexcept {
  float t8[8], t4[4];
  for (int l = 0; l < 8; ++l) t8[l] = s[l] + s[l + 8];
  for (int l = 0; l < 4; ++l) t4[l] = t8[l] + t8[l + 4];
  return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

inline float exp_neg_portable(float x) noexcept {
  x = std::max(x, kExpClamp);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.f;
  std::uint32_t bits = std::uint32_t(std::int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return y * scale;
}

template <class T>
inline float dot_portable(const T* k, const float* qpad, std::int64_t d) noexcept {
  float s[16] = {}, kv[16];
  for (std::int64_t c = 0; c < d; c += 16) {
    load16_portable(k + c, std::min<std::int64_t>(16, d - c), kv);
    for (int l = 0; l < 16; ++l) s[l] = std::fma(kv[l], qpad[c + l], s[l]);
  }
  return tree16(s);
}

/// p[i] = exp_neg(p[i] − max) in place; returns z (lanes i mod 16, then the tree).
inline float softmax_portable(float* p, std::int64_t n) noexcept {
  float m = -INFINITY;
  for (std::int64_t i = 0; i < n; ++i) m = std::max(m, p[i]);
  float z[16] = {};
  for (std::int64_t i = 0; i < n; ++i) {
    p[i] = exp_neg_portable(p[i] - m);
    z[i % 16] += p[i];
  }
  return tree16(z);
}

template <class T>
inline void axpy_portable(float w, const T* v, std::int64_t d, float* acc) noexcept {
  float vv[16];
  for (std::int64_t c = 0; c < d; c += 16) {
    load16_portable(v + c, std::min<std::int64_t>(16, d - c), vv);
    for (int l = 0; l < 16; ++l) acc[c + l] = std::fma(w, vv[l], acc[c + l]);
  }
}

#if defined(KVSCORE_PARISKV_X86)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#define KVSCORE_ATTEND_AVX2 __attribute__((target("avx2,fma,f16c")))
// the search's AVX-512 set plus F16C (kernels.hpp's AVX-512 functions inline into these)
#define KVSCORE_ATTEND_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,popcnt,bmi,bmi2,f16c")))

// ------------------------------------------------------------------ AVX-512: one zmm = 16 lanes

template <class T>
KVSCORE_ATTEND_AVX512 inline __m512 load16_avx512(const T* p, std::int64_t count) noexcept {
  const __mmask16 m = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else if constexpr (std::is_same_v<T, half>) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  }
}

KVSCORE_ATTEND_AVX512 inline float tree16_avx512(__m512 s) noexcept {
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

KVSCORE_ATTEND_AVX512 inline __m512 exp_neg_avx512(__m512 x) noexcept {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpClamp));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

KVSCORE_ATTEND_AVX512 inline float softmax_avx512(float* p, std::int64_t n) noexcept {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(p + i));
  float m = _mm512_reduce_max_ps(mv);
  for (; i < n; ++i) m = std::max(m, p[i]);
  const __m512 mm = _mm512_set1_ps(m);
  __m512 z = _mm512_setzero_ps();
  for (i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512 e = exp_neg_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + i), mm));
    _mm512_mask_storeu_ps(p + i, k, e);
    z = _mm512_add_ps(z, _mm512_maskz_mov_ps(k, e));
  }
  return tree16_avx512(z);
}

template <class T>
KVSCORE_ATTEND_AVX512 inline float dot_avx512(const T* k, const float* qpad, std::int64_t d) noexcept {
  __m512 s = _mm512_setzero_ps();
  for (std::int64_t c = 0; c < d; c += 16) s = _mm512_fmadd_ps(load16_avx512(k + c, d - c), _mm512_loadu_ps(qpad + c), s);
  return tree16_avx512(s);
}

template <class T>
KVSCORE_ATTEND_AVX512 inline void axpy_avx512(float w, const T* v, std::int64_t d, float* acc) noexcept {
  const __m512 wv = _mm512_set1_ps(w);
  for (std::int64_t c = 0; c < d; c += 16)
    _mm512_storeu_ps(acc + c, _mm512_fmadd_ps(wv, load16_avx512(v + c, d - c), _mm512_loadu_ps(acc + c)));
}

/// Dense logits of G queries, DC = head_dim / 16 chunks: 16 rows at a time, each query's 16
/// dot-product lane vectors reduced together.
template <int DC, class T>
KVSCORE_ATTEND_AVX512 inline void dense_logits_avx512(const T* K, std::int64_t n, std::int64_t G, const float* qpad,
                                                      float scale, float* logits) noexcept {
  constexpr std::int64_t d = 16 * DC;
  const __m512 sc = _mm512_set1_ps(scale);
  std::int64_t i0 = 0;
  for (; i0 + 16 <= n; i0 += 16) {
    for (std::int64_t g = 0; g < G; ++g) {
      __m512 q[DC], s[16];
      KVSCORE_PARISKV_UNROLL
      for (int c = 0; c < DC; ++c) q[c] = _mm512_loadu_ps(qpad + g * d + 16 * c);
      KVSCORE_PARISKV_UNROLL
      for (int r = 0; r < 16; ++r) {
        const T* k = K + (i0 + r) * d;
        s[r] = _mm512_setzero_ps();
        KVSCORE_PARISKV_UNROLL
        for (int c = 0; c < DC; ++c) s[r] = _mm512_fmadd_ps(load16_avx512(k + 16 * c, 16), q[c], s[r]);
      }
      _mm512_storeu_ps(logits + g * n + i0, _mm512_mul_ps(tree16x16_avx512(s), sc));
    }
  }
  for (; i0 < n; ++i0)
    for (std::int64_t g = 0; g < G; ++g) logits[g * n + i0] = dot_avx512(K + i0 * d, qpad + g * d, d) * scale;
}

/// acc[g] = Σ_i p[g][i]·v_i for GB queries from g0, DC chunks, the accumulators in registers.
template <int DC, int GB, class T>
KVSCORE_ATTEND_AVX512 inline void dense_values_avx512(const T* V, std::int64_t n, const float* p, float* acc) noexcept {
  __m512 a[GB][DC];
  KVSCORE_PARISKV_UNROLL
  for (int g = 0; g < GB; ++g)
    KVSCORE_PARISKV_UNROLL
    for (int c = 0; c < DC; ++c) a[g][c] = _mm512_setzero_ps();
  for (std::int64_t i = 0; i < n; ++i) {
    __m512 v[DC];
    KVSCORE_PARISKV_UNROLL
    for (int c = 0; c < DC; ++c) v[c] = load16_avx512(V + i * 16 * DC + 16 * c, 16);
    KVSCORE_PARISKV_UNROLL
    for (int g = 0; g < GB; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * n + i]);
      KVSCORE_PARISKV_UNROLL
      for (int c = 0; c < DC; ++c) a[g][c] = _mm512_fmadd_ps(w, v[c], a[g][c]);
    }
  }
  KVSCORE_PARISKV_UNROLL
  for (int g = 0; g < GB; ++g)
    KVSCORE_PARISKV_UNROLL
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + g * 16 * DC + 16 * c, a[g][c]);
}

/// One query over scattered rows pos[0..n) on AVX-512 for head_dim = 16·DC: logits 16 rows at a
/// time (tree16x16), the value sums in registers; rows requested kRowPrefetch ahead (K into
/// L1, V into L2 for the second pass, then into L1).
template <int DC, class T>
KVSCORE_ATTEND_AVX512 inline void attend_rows_fixed_avx512(const T* K, const T* V, const std::int64_t* pos,
                                                           std::int64_t n, const float* qpad, float scale, float* out,
                                                           AttendScratch& ws) {
  constexpr std::int64_t d = 16 * DC, bytes = d * std::int64_t(sizeof(T));
  float* lg = ws.logits.data();
  __m512 q[DC];
  KVSCORE_PARISKV_UNROLL
  for (int c = 0; c < DC; ++c) q[c] = _mm512_loadu_ps(qpad + 16 * c);
  const __m512 sc = _mm512_set1_ps(scale);
  std::int64_t i0 = 0;
  for (; i0 + 16 <= n; i0 += 16) {
    __m512 s[16];
    KVSCORE_PARISKV_UNROLL
    for (int r = 0; r < 16; ++r) {
      const std::int64_t i = i0 + r;
      if (i + kRowPrefetch < n) {
        prefetch_row<3>(K + pos[i + kRowPrefetch] * d, bytes);
        prefetch_row<2>(V + pos[i + kRowPrefetch] * d, bytes);
      }
      const T* k = K + pos[i] * d;
      s[r] = _mm512_setzero_ps();
      KVSCORE_PARISKV_UNROLL
      for (int c = 0; c < DC; ++c) s[r] = _mm512_fmadd_ps(load16_avx512(k + 16 * c, 16), q[c], s[r]);
    }
    _mm512_storeu_ps(lg + i0, _mm512_mul_ps(tree16x16_avx512(s), sc));
  }
  for (; i0 < n; ++i0) {
    if (i0 + kRowPrefetch < n) {
      prefetch_row<3>(K + pos[i0 + kRowPrefetch] * d, bytes);
      prefetch_row<2>(V + pos[i0 + kRowPrefetch] * d, bytes);
    }
    lg[i0] = dot_avx512(K + pos[i0] * d, qpad, d) * scale;
  }
  const float z = softmax_avx512(lg, n);
  __m512 a[DC];
  KVSCORE_PARISKV_UNROLL
  for (int c = 0; c < DC; ++c) a[c] = _mm512_setzero_ps();
  for (std::int64_t i = 0; i < n; ++i) {
    if (i + kRowPrefetch < n) prefetch_row<3>(V + pos[i + kRowPrefetch] * d, bytes);
    const T* v = V + pos[i] * d;
    const __m512 w = _mm512_set1_ps(lg[i]);
    KVSCORE_PARISKV_UNROLL
    for (int c = 0; c < DC; ++c) a[c] = _mm512_fmadd_ps(w, load16_avx512(v + 16 * c, 16), a[c]);
  }
  KVSCORE_PARISKV_UNROLL
  for (int c = 0; c < DC; ++c) _mm512_storeu_ps(ws.acc.data() + 16 * c, a[c]);
  for (std::int64_t j = 0; j < d; ++j) out[j] = ws.acc[std::size_t(j)] / z;
}

/// The dense group on AVX-512 for head_dim = 16·DC: registers hold GB = 24/DC queries' sums.
template <int DC, class T>
KVSCORE_ATTEND_AVX512 inline void attend_group_fixed_avx512(const T* K, const T* V, std::int64_t n, std::int64_t G,
                                                            float scale, float* const* out, AttendScratch& ws) {
  constexpr std::int64_t d = 16 * DC;
  constexpr int GB = 24 / DC;
  float* lg = ws.logits.data();
  dense_logits_avx512<DC>(K, n, G, ws.qpad.data(), scale, lg);
  for (std::int64_t g = 0; g < G; ++g) ws.z[std::size_t(g)] = softmax_avx512(lg + g * n, n);
  for (std::int64_t g0 = 0; g0 < G; g0 += GB) {
    const float* p = lg + g0 * n;
    float* acc = ws.acc.data() + g0 * d;
    switch (std::min<std::int64_t>(GB, G - g0)) {  // a fixed count per instantiation keeps the sums in registers
#define KVSCORE_GB(X) \
  case X:             \
    if constexpr (X <= GB) dense_values_avx512<DC, X>(V, n, p, acc); \
    break;
      KVSCORE_GB(1) KVSCORE_GB(2) KVSCORE_GB(3) KVSCORE_GB(4) KVSCORE_GB(5) KVSCORE_GB(6) KVSCORE_GB(7) KVSCORE_GB(8)
      KVSCORE_GB(9) KVSCORE_GB(10) KVSCORE_GB(11) KVSCORE_GB(12) KVSCORE_GB(13) KVSCORE_GB(14) KVSCORE_GB(15)
      KVSCORE_GB(16) KVSCORE_GB(17) KVSCORE_GB(18) KVSCORE_GB(19) KVSCORE_GB(20) KVSCORE_GB(21) KVSCORE_GB(22)
      KVSCORE_GB(23) KVSCORE_GB(24)
#undef KVSCORE_GB
      default:
        break;
    }
  }
  for (std::int64_t g = 0; g < G; ++g)
    for (std::int64_t j = 0; j < d; ++j) out[g][j] = ws.acc[std::size_t(g * d + j)] / ws.z[std::size_t(g)];
}

// ------------------------------------------------------------------ AVX2: two ymm = 16 lanes

template <class T>
KVSCORE_ATTEND_AVX2 inline void load16_avx2(const T* p, std::int64_t count, __m256& lo, __m256& hi) noexcept {
  if (count < 16) {
    alignas(32) float buf[16];
    load16_portable(p, count, buf);
    lo = _mm256_load_ps(buf);
    hi = _mm256_load_ps(buf + 8);
  } else if constexpr (std::is_same_v<T, float>) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
  } else if constexpr (std::is_same_v<T, half>) {
    lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  } else {
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    hi = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))), 16));
  }
}

KVSCORE_ATTEND_AVX2 inline float tree16_avx2(__m256 lo, __m256 hi) noexcept {
  const __m256 t8 = _mm256_add_ps(lo, hi);
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

KVSCORE_ATTEND_AVX2 inline __m256 exp_neg_avx2(__m256 x) noexcept {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpClamp));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

KVSCORE_ATTEND_AVX2 inline float softmax_avx2(float* p, std::int64_t n) noexcept {
  float m = -INFINITY;
  for (std::int64_t i = 0; i < n; ++i) m = std::max(m, p[i]);
  const __m256 mm = _mm256_set1_ps(m);
  __m256 z0 = _mm256_setzero_ps(), z1 = _mm256_setzero_ps();
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 e0 = exp_neg_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + i), mm));
    const __m256 e1 = exp_neg_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + i + 8), mm));
    _mm256_storeu_ps(p + i, e0);
    _mm256_storeu_ps(p + i + 8, e1);
    z0 = _mm256_add_ps(z0, e0);
    z1 = _mm256_add_ps(z1, e1);
  }
  if (i < n) {  // the tail through a zero-padded buffer: lanes past n add 0
    alignas(32) float buf[16] = {};
    for (std::int64_t t = i; t < n; ++t) buf[t - i] = p[t];
    __m256 e0 = exp_neg_avx2(_mm256_sub_ps(_mm256_load_ps(buf), mm));
    __m256 e1 = exp_neg_avx2(_mm256_sub_ps(_mm256_load_ps(buf + 8), mm));
    _mm256_store_ps(buf, e0);
    _mm256_store_ps(buf + 8, e1);
    for (std::int64_t t = i; t < n; ++t) p[t] = buf[t - i];
    for (std::int64_t t = n - i; t < 16; ++t) buf[t] = 0.f;
    z0 = _mm256_add_ps(z0, _mm256_load_ps(buf));
    z1 = _mm256_add_ps(z1, _mm256_load_ps(buf + 8));
  }
  return tree16_avx2(z0, z1);
}

template <class T>
KVSCORE_ATTEND_AVX2 inline float dot_avx2(const T* k, const float* qpad, std::int64_t d) noexcept {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), lo, hi;
  for (std::int64_t c = 0; c < d; c += 16) {
    load16_avx2(k + c, d - c, lo, hi);
    s0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(qpad + c), s0);
    s1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(qpad + c + 8), s1);
  }
  return tree16_avx2(s0, s1);
}

template <class T>
KVSCORE_ATTEND_AVX2 inline void axpy_avx2(float w, const T* v, std::int64_t d, float* acc) noexcept {
  const __m256 wv = _mm256_set1_ps(w);
  __m256 lo, hi;
  for (std::int64_t c = 0; c < d; c += 16) {
    load16_avx2(v + c, d - c, lo, hi);
    _mm256_storeu_ps(acc + c, _mm256_fmadd_ps(wv, lo, _mm256_loadu_ps(acc + c)));
    _mm256_storeu_ps(acc + c + 8, _mm256_fmadd_ps(wv, hi, _mm256_loadu_ps(acc + c + 8)));
  }
}
#endif  // KVSCORE_PARISKV_X86

// ------------------------------------------------------------------ the loops, once per set


#define KVSCORE_ATTEND_LOOPS(SET, ATTR)                                                                              \
  template <class T>                                                                                                 \
  ATTR inline void attend_rows_##SET(const T* K, const T* V, std::int64_t d, const std::int64_t* pos, std::int64_t n, \
                                     const float* qpad, float scale, float* out, AttendScratch& ws) {                \
    const std::int64_t dp = padded16(d), bytes = d * std::int64_t(sizeof(T));                                      \
    float* lg = ws.logits.data();                                                                                    \
    for (std::int64_t i = 0; i < n; ++i) {                                                                           \
      if (pos != nullptr && i + kRowPrefetch < n) {                                                                  \
        prefetch_row<3>(K + pos[i + kRowPrefetch] * d, bytes);                                                       \
        prefetch_row<2>(V + pos[i + kRowPrefetch] * d, bytes);                                                       \
      }                                                                                                              \
      lg[i] = dot_##SET(K + (pos != nullptr ? pos[i] : i) * d, qpad, d) * scale;                                     \
    }                                                                                                                \
    const float z = softmax_##SET(lg, n);                                                                            \
    float* acc = ws.acc.data();                                                                                      \
    std::fill(acc, acc + dp, 0.f);                                                                                   \
    for (std::int64_t i = 0; i < n; ++i) {                                                                           \
      if (pos != nullptr && i + kRowPrefetch < n) prefetch_row<3>(V + pos[i + kRowPrefetch] * d, bytes);             \
      axpy_##SET(lg[i], V + (pos != nullptr ? pos[i] : i) * d, d, acc);                                              \
    }                                                                                                                \
    for (std::int64_t j = 0; j < d; ++j) out[j] = acc[j] / z;                                                        \
  }                                                                                                                  \
  template <class T>                                                                                                 \
  ATTR inline void attend_group_##SET(const T* K, const T* V, std::int64_t d, std::int64_t n, std::int64_t G,        \
                                      float scale, float* const* out, AttendScratch& ws) {                           \
    const std::int64_t dp = padded16(d);                                                                             \
    for (std::int64_t i = 0; i < n; ++i)                                                                             \
      for (std::int64_t g = 0; g < G; ++g)                                                                           \
        ws.logits[std::size_t(g * n + i)] = dot_##SET(K + i * d, ws.qpad.data() + g * dp, d) * scale;                \
    float* z = ws.z.data();                                                                                          \
    for (std::int64_t g = 0; g < G; ++g) z[g] = softmax_##SET(ws.logits.data() + g * n, n);                          \
    std::fill(ws.acc.begin(), ws.acc.begin() + G * dp, 0.f);                                                         \
    for (std::int64_t i = 0; i < n; ++i)                                                                             \
      for (std::int64_t g = 0; g < G; ++g)                                                                           \
        axpy_##SET(ws.logits[std::size_t(g * n + i)], V + i * d, d, ws.acc.data() + g * dp);                         \
    for (std::int64_t g = 0; g < G; ++g)                                                                             \
      for (std::int64_t j = 0; j < d; ++j) out[g][j] = ws.acc[std::size_t(g * dp + j)] / z[g];                       \
  }

KVSCORE_ATTEND_LOOPS(portable, )
#if defined(KVSCORE_PARISKV_X86)
KVSCORE_ATTEND_LOOPS(avx2, KVSCORE_ATTEND_AVX2)
KVSCORE_ATTEND_LOOPS(avx512, KVSCORE_ATTEND_AVX512)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
#undef KVSCORE_ATTEND_LOOPS

/// out[0..d) = softmax(scale·q·k)·v over rows pos[0..n) of K and V (row-contiguous, head_dim d),
/// or over rows 0..n-1 when pos is null; n = 0 writes zeros.
template <class T>
void attend_rows(KernelSet set, const T* K, const T* V, std::int64_t d, const std::int64_t* pos, std::int64_t n,
                 const float* q, float scale, float* out, AttendScratch& ws) {
  if (n == 0) {
    std::fill(out, out + d, 0.f);
    return;
  }
  const std::int64_t dp = padded16(d);
  ws.qpad.assign(std::size_t(dp), 0.f);
  std::copy(q, q + d, ws.qpad.begin());
  if (ws.logits.size() < std::size_t(n)) ws.logits.resize(std::size_t(n));
  if (ws.acc.size() < std::size_t(dp)) ws.acc.resize(std::size_t(dp));
#if defined(KVSCORE_PARISKV_X86)
  if (set == KernelSet::avx512 && pos != nullptr) {
    switch (d) {  // head_dims with the registers-resident kernel; the others take the generic loop
      case 64: return attend_rows_fixed_avx512<4>(K, V, pos, n, ws.qpad.data(), scale, out, ws);
      case 128: return attend_rows_fixed_avx512<8>(K, V, pos, n, ws.qpad.data(), scale, out, ws);
      default: break;
    }
  }
  if (set == KernelSet::avx512) return attend_rows_avx512(K, V, d, pos, n, ws.qpad.data(), scale, out, ws);
  if (set == KernelSet::avx2) return attend_rows_avx2(K, V, d, pos, n, ws.qpad.data(), scale, out, ws);
#endif
  (void)set;
  attend_rows_portable(K, V, d, pos, n, ws.qpad.data(), scale, out, ws);
}

/// The G queries q[g] (d floats each) of one KV head over all its n rows: out[g] =
/// attend_rows(q[g], positions 0..n-1), bit for bit, from one read of K and V.
template <class T>
void attend_dense_group(KernelSet set, const T* K, const T* V, std::int64_t d, std::int64_t n,
                        const float* const* q, std::int64_t G, float scale, float* const* out, AttendScratch& ws) {
  if (n == 0) {
    for (std::int64_t g = 0; g < G; ++g) std::fill(out[g], out[g] + d, 0.f);
    return;
  }
  const std::int64_t dp = padded16(d);
  ws.qpad.assign(std::size_t(G * dp), 0.f);
  for (std::int64_t g = 0; g < G; ++g) std::copy(q[g], q[g] + d, ws.qpad.begin() + g * dp);
  if (ws.logits.size() < std::size_t(G * n)) ws.logits.resize(std::size_t(G * n));
  if (ws.acc.size() < std::size_t(G * dp)) ws.acc.resize(std::size_t(G * dp));
  if (ws.z.size() < std::size_t(G)) ws.z.resize(std::size_t(G));
#if defined(KVSCORE_PARISKV_X86)
  if (set == KernelSet::avx512) {
    switch (d) {  // head_dims with the registers-resident kernel; the others take the generic loop
      case 16: return attend_group_fixed_avx512<1>(K, V, n, G, scale, out, ws);
      case 32: return attend_group_fixed_avx512<2>(K, V, n, G, scale, out, ws);
      case 64: return attend_group_fixed_avx512<4>(K, V, n, G, scale, out, ws);
      case 128: return attend_group_fixed_avx512<8>(K, V, n, G, scale, out, ws);
      default: return attend_group_avx512(K, V, d, n, G, scale, out, ws);
    }
  }
  if (set == KernelSet::avx2) return attend_group_avx2(K, V, d, n, G, scale, out, ws);
#endif
  (void)set;
  attend_group_portable(K, V, d, n, G, scale, out, ws);
}

}  // namespace kvscore::pariskv::detail
