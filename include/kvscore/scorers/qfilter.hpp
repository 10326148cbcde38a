// kvscore/scorers/qfilter.hpp — Q-Filters (qfilters.txt §2.2): score = ⟨k, f_h⟩
// with one context-agnostic filter per KV head, plus the filters' calibration.
//
// Calibration, per query head: f = the top right singular vector v₁ of the
// uncentred [n × d] matrix of query samples, sign chosen so that most samples
// project positively (an exact half/half split is settled by the sign of the sum
// of projections). GQA: the plain mean over each contiguous group of H_q/H_kv
// query heads (not renormalised, as the paper says "average"). One pass.
//
// Sign conventions of filter files (docs/methods/qfilters.md). kvscore's: score = +⟨k, f⟩, f as
// calibrate_qfilters returns it (most queries project positively), stored as .npy. The
// authors' published files (safetensors, tensor `q_filters` [layers, kv_heads, head_dim], the
// ones kvpress loads) store f = −v₁⁺ and score −⟨f, k⟩: scoring them as +⟨k, f⟩ reverses the
// ranking. QFilter::load() (kvscore/io/qfilter_file.hpp) reads either; the published convention negates
// the filters on load, which makes every score exactly −⟨f, k⟩ (negation is exact in floating point).
#pragma once

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "kvscore/detail/compiled.hpp"
#include "kvscore/scorers/scorer_base.hpp"

namespace kvscore {

/// How a filter file's values turn into scores (see the top of this file).
enum class FilterConvention {
  kvscore,   ///< score = +⟨k, f⟩ (calibrate_qfilters, .npy files)
  published  ///< score = −⟨f, k⟩ (the Q-Filters authors' safetensors files, kvpress)
};

/// Q-Filters: score = ⟨k, f_h⟩ with one filter per KV head, calibrated on queries (calibrate_qfilters) or read from
/// a filter file (kvscore/io/qfilter_file.hpp) in either sign convention.
class QFilter : public ScorerBase<QFilter> {
 public:
  static constexpr const char* name = "qfilter";  ///< the registry's CLI spelling
  static constexpr int passes = 1;  ///< reads of the keys per score()

  /// filters: [kv_heads][head_dim], row-major.
  QFilter(std::vector<float> filters, std::int64_t kv_heads, std::int64_t head_dim)
      : filters_(std::move(filters)), kv_heads_(kv_heads), dim_(head_dim) {
    const char* who = "kvscore::QFilter";
    if (kv_heads <= 0) detail::throw_invalid(std::string(who) + ": kv_heads must be > 0 (got " + std::to_string(kv_heads) + ")");
    if (head_dim <= 0 || head_dim > kMaxHeadDim)
      detail::throw_invalid(std::string(who) + ": head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " +
                            std::to_string(head_dim) + ")");
    if (std::int64_t(filters_.size()) != kv_heads * head_dim)
      detail::throw_invalid(std::string(who) + ": filters hold " + std::to_string(filters_.size()) +
                            " values, expected kv_heads*head_dim = " + std::to_string(kv_heads * head_dim));
    for (std::size_t i = 0; i < filters_.size(); ++i)
      if (!std::isfinite(filters_[i]))
        detail::throw_invalid(std::string(who) + ": filter value " + std::to_string(filters_[i]) + " at index " +
                              std::to_string(i) + " is not finite");
  }

  // Filter files (the top of this file): defined in kvscore/io/qfilter_file.hpp, which a caller
  // that reads files includes; the scorer itself reads no file format.

  /// Layer `layer` of a filter file: `.safetensors` (tensor `q_filters`, F32/F16/BF16) or
  /// `.npy` (float32), shape (layers, kv_heads, head_dim), scored in `convention`.
  static inline QFilter load(const std::string& path, std::int64_t layer, FilterConvention convention);
  /// The authors' published filters (safetensors `q_filters`, layer `layer`), scored −⟨f, k⟩:
  /// the ranking of Q-Filters / kvpress's QFilterPress.
  static inline QFilter from_published(const std::string& path, std::int64_t layer);
  /// Layer `layer` of a .npy of shape (layers, kv_heads, head_dim), float32, kvscore's convention.
  static inline QFilter from_npy(const std::string& path, std::int64_t layer);
  /// Layer `layer` of a safetensors tensor `q_filters` (layers, kv_heads, head_dim) as stored
  /// (no sign change; load() applies the convention).
  static inline QFilter from_safetensors(const std::string& path, std::int64_t layer);

  /// Whether `path` names a .safetensors file (else .npy).
  static bool is_safetensors(const std::string& path) {
    const std::string ext = ".safetensors";
    return path.size() >= ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0;
  }
  /// The convention a file type implies: published for .safetensors, kvscore for .npy.
  static FilterConvention file_convention(const std::string& path) {
    return is_safetensors(path) ? FilterConvention::published : FilterConvention::kvscore;
  }

  std::int64_t kv_heads() const noexcept { return kv_heads_; }  ///< KV heads the filters cover
  std::int64_t head_dim() const noexcept { return dim_; }  ///< dimensions of a filter
  /// The filters, [kv_heads][head_dim] row-major, kvscore's sign.
  const std::vector<float>& filters() const noexcept { return filters_; }
  const float* filter(std::int64_t h) const noexcept { return filters_.data() + h * dim_; }  ///< head h's filter

  /// ScorerBase's check: the keys have the filters' heads and head_dim (std::invalid_argument otherwise).
  template <class View>
  void check(const View& keys) const {
    if (keys.heads() != kv_heads_ || keys.head_dim() != dim_)
      detail::throw_invalid("kvscore::QFilter: filters are (kv_heads " + std::to_string(kv_heads_) + ", head_dim " +
                            std::to_string(dim_) + ") but keys are (heads " + std::to_string(keys.heads()) +
                            ", head_dim " + std::to_string(keys.head_dim()) + ")");
  }

  /// ScorerBase's step for head h: out[t] = ⟨k_t, f_h⟩.
  template <class View>
  void score_head(const simd::KernelTable& table, const View& keys, std::int64_t h, float* out) const {
    // Squared norms come with the dots (one read of each row) for the validity rule of scorer_base.hpp.
    using T = typename View::value_type;
    const simd::RowOps<T>& ops = table.ops<T>();
    float sq[detail::kChunkTokens];
    keys.for_each_run(h, [&](const T* first, std::int64_t t0, std::int64_t n, std::int64_t stride) {
      for (std::int64_t i0 = 0; i0 < n; i0 += detail::kChunkTokens) {
        const std::int64_t m = std::min(detail::kChunkTokens, n - i0);
        float* o = out + t0 + i0;
        ops.dot_sqnorm(first + i0 * stride, m, stride, dim_, filter(h), o, sq);
        for (std::int64_t i = 0; i < m; ++i)
          if (!std::isfinite(sq[i]) || !std::isfinite(o[i])) o[i] = kInvalidScore;
      }
    });
  }

 private:
  std::vector<float> filters_;
  std::int64_t kv_heads_, dim_;
};

/// Q-Filter calibration. queries: [q_heads][n][head_dim] row-major (post-RoPE query
/// samples); returns filters [kv_heads][head_dim].
std::vector<float> calibrate_qfilters(const float* queries, std::int64_t q_heads, std::int64_t n,
                                      std::int64_t head_dim, std::int64_t kv_heads);

}  // namespace kvscore

#if !defined(KVSCORE_COMPILED)
#include "kvscore/scorers/qfilter_impl.hpp"
#endif
