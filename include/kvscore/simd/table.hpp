// kvscore/simd/table.hpp — the set of row kernels every scorer is written against.
//
// One KernelTable per instruction set (scalar, sse2, avx2, avx512, or the consumer's
// own xsimd::default_arch in header-only mode). Scorers call through the table, so
// the same scorer code runs on every path and tests can compare the paths.
#pragma once

#include <cstdint>

#include "kvscore/core/cpu.hpp"
#include "kvscore/core/dtype.hpp"

namespace kvscore::simd {

/// Kernels over n rows of d elements; row i starts at base + i*stride (elements).
/// Every kernel widens to fp32 and accumulates in fp32 lanes (rows) or fp64 (sums over rows).
template <class T>
struct RowOps {
  /// out[i] = ‖row_i‖².
  void (*sqnorm)(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, float* out);
  /// out[i] = ⟨row_i, v⟩; non-finite (NaN or ±Inf) whenever row_i holds a NaN or Inf element.
  void (*dot)(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, const float* v, float* out);
  /// out[i] = ⟨row_i, v⟩ and sq_out[i] = ‖row_i‖², from one read of each row.
  void (*dot_sqnorm)(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, const float* v, float* out,
                     float* sq_out);
  /// out[i] = ‖row_i − v‖².
  void (*sqdist)(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, const float* v, float* out);
  /// sqnorm_out[i] = ‖row_i‖²; acc[j] += Σ_i row_i[j] over the rows whose ‖row_i‖² is finite.
  /// Returns the number of rows added.
  std::int64_t (*sum)(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, double* acc,
                      float* sqnorm_out);
  /// norm_out[i] = ‖row_i‖; acc[j] += Σ_i row_i[j]/‖row_i‖ over rows with finite non-zero norm.
  /// Returns the number of rows added.
  std::int64_t (*sum_normalized)(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, double* acc,
                                 float* norm_out);
  /// out[i*r + j] = ⟨row_i, u_j⟩ for i < n, j < r (OjaKV's codes K U). basis: r contiguous fp32
  /// rows u_j of d elements (Uᵀ row-major = a column-major d×r U); out: n×r row-major. fp32
  /// accumulation; an entry does not depend on how rows are grouped into calls. Every entry of a
  /// row holding a NaN or Inf is non-finite.
  void (*project)(const T* base, std::int64_t n, std::int64_t stride, std::int64_t d, const float* basis,
                  std::int64_t r, float* out);
};

/// Rows per packed panel of gemm_panels' right-hand side (every table): panel p holds rows
/// [16p, 16p + 16) transposed, [d][16], zero-padded past the last row.
inline constexpr std::int64_t kGemmPanel = 16;

struct KernelTable {
  const char* name;  ///< "scalar", "sse2", "avx2", "avx512", or an xsimd arch name
  int width;         ///< fp32 lanes per vector (1 for scalar)
  IsaLevel level;    ///< the level it pins the other kernel families to (set_active_isa)
  RowOps<float> f32;
  RowOps<half> f16;
  RowOps<bfloat16> bf16;
  /// Σ p[i] — the read-bandwidth baseline the benchmarks compare against.
  double (*reduce_f32)(const float* p, std::int64_t n);
  /// e[j] = exp(x[j] - shift) for j < n (SnapKV's softmax). std::exp on the scalar table,
  /// xsimd::exp (within 2 ulp of std::exp on finite input) on the vector tables.
  void (*exp_shifted)(const float* x, float shift, std::int64_t n, float* e);
  /// out[i*d + k] = Σ_j codes[i*r + j]·u_j[k] for i < n, k < d (OjaKV's reconstruction K~ Uᵀ);
  /// codes n×r row-major, basis as in RowOps::project, out n×d row-major; each output is one
  /// fp32 sum over j in order. Here rather than in RowOps<T>: its input is always fp32 codes,
  /// whatever the type of the rows they came from.
  void (*unproject)(const float* codes, std::int64_t n, std::int64_t r, const float* basis, std::int64_t d,
                    float* out);
  /// max_j x[j] over finite or -inf values (-inf for n = 0): a softmax row's max (KVzip).
  float (*max_f32)(const float* x, std::int64_t n);
  /// e[j] = exp(x[j] - shift), each value as exp_shifted computes it; returns Σ e[j] (fp32 lanes
  /// over blocks of kSumBlockRows vectors, the blocks added in fp64): a softmax row (KVzip).
  double (*exp_sum)(const float* x, float shift, std::int64_t n, float* e);
  /// acc[j] = max(acc[j], e[j]·w·kw[j]) (kw = nullptr: 1), fp32: KVzip's max over queries.
  void (*max_scaled)(const float* e, float w, const float* kw, std::int64_t n, float* acc);
  /// out = the panels of n fp32 rows of d elements (row i at k + i·ld): ceil(n/16)·16·d floats,
  /// see kGemmPanel.
  void (*pack_panels)(const float* k, std::int64_t n, std::int64_t ld, std::int64_t d, float* out);
  /// out[i·ldo + t] = Σ_j q[i·d + j]·k_t[j] for i < nq, t < nk, the rows k_t packed by pack_panels
  /// (KVzip's logits: a block of queries against every key, query-major). Each value is one fp32
  /// chain of fused multiply-adds over j in order, so it does not depend on where its query or
  /// key falls in a tile or a call (SSE2 and scalar tables: a multiply and an add).
  void (*gemm_panels)(const float* q, std::int64_t nq, const float* kpack, std::int64_t nk, std::int64_t d, float* out,
                      std::int64_t ldo);
  /// acc[k·2h + t] = Σ_j w[k·d + j]·code(j, t) for k < g queries and t < 2h tokens, the codes in
  /// pairs of dimensions: code(j, t) is the low nibble of codes[(j/2)·2h + 2t + j%2] for t < h and
  /// the high nibble of codes[(j/2)·2h + 2(t − h) + j%2] otherwise; ⌈d/2⌉·2h bytes (block_sparse.hpp's
  /// int4 block score). Integer sums: the same on every table.
  void (*int4_dots)(const std::int16_t* w, std::int64_t g, std::int64_t d, const std::uint8_t* codes, std::int64_t h,
                    std::int32_t* acc);
  /// block_sparse.hpp's int4 block score, per block (RowKernels::int4_quest, int4_summarize,
  /// int4_block): Quest's bound's 16 lanes for g queries; a block's summary and codes; a block's
  /// integer scores and q·min's lanes. Elementwise fp32 (no product fused into an add), integer
  /// sums and min/max only: the same on every table.
  void (*int4_quest)(const float* q, std::int64_t g, std::int64_t d, const float* lo, const float* hi, float* lanes);
  void (*int4_summarize)(const float* x, std::int64_t ld, std::int64_t n, std::int64_t d, float* lo, float* st,
                         float* hi, std::uint8_t* codes);
  void (*int4_block)(const float* q, std::int64_t g, std::int64_t d, const float* lo, const float* st,
                     const std::uint8_t* codes, std::int64_t n, std::int16_t* w, std::int32_t* acc, std::int32_t* best,
                     float* scale, float* lanes);

  template <class T>
  const RowOps<T>& ops() const noexcept {
    if constexpr (std::is_same_v<T, float>) return f32;
    else if constexpr (std::is_same_v<T, half>) return f16;
    else return bf16;
  }
};

}  // namespace kvscore::simd
