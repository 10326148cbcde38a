// kvscore/eval/metrics_impl.hpp — the evaluator's full-attention reference (an Eigen
// GEMM): inline in header-only use, compiled once into kvscore::dispatch otherwise
// (kvscore/detail/compiled.hpp).
#pragma once

#include <Eigen/Dense>

#include "kvscore/eval/metrics.hpp"

namespace kvscore::eval {

KVSCORE_IMPL_INLINE HeadReference::HeadReference(const float* keys, std::int64_t key_stride, const float* values,
                                                 std::int64_t value_stride, const float* queries,
                                                 std::int64_t query_stride, std::int64_t rows, std::int64_t n,
                                                 std::int64_t d, std::int64_t dv)
    : rows_(rows), n_(n), dv_(dv), values_(values), value_stride_(value_stride) {
  const char* who = "kvscore::eval::HeadReference";
  if (n < 1) detail::invalid(std::string(who) + ": needs at least one token (got " + std::to_string(n) + ")");
  if (n > INT32_MAX) detail::invalid(std::string(who) + ": " + std::to_string(n) + " tokens exceed the int32 ranks");
  if (rows < 1) detail::invalid(std::string(who) + ": needs at least one query (got " + std::to_string(rows) + ")");
  if (d < 1 || dv < 1)
    detail::invalid(std::string(who) + ": head_dim " + std::to_string(d) + " / value dim " + std::to_string(dv) +
                    " must be >= 1");
  using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Mat K(n, d), Q(rows, d);
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t j = 0; j < d; ++j) K(t, j) = double(keys[t * key_stride + j]);
  const double scale = 1.0 / std::sqrt(double(d));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < d; ++j) Q(r, j) = double(queries[r * query_stride + j]) * scale;
  logits_.resize(std::size_t(rows * n));
  Eigen::Map<Mat> L(logits_.data(), rows, n);
  L.noalias() = Q * K.transpose();
  lse_.resize(std::size_t(rows));
  ranks_.resize(std::size_t(rows * n));
  out_.assign(std::size_t(rows * dv), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    const double* l = logit_row(r);
    lse_[std::size_t(r)] = log_sum_exp(l, n);
    attention_ranks(l, n, ranks_.data() + r * n);
    double* o = out_.data() + r * dv;
    for (std::int64_t t = 0; t < n; ++t) {
      const double p = std::exp(l[t] - lse_[std::size_t(r)]);
      const float* v = values + t * value_stride;
      for (std::int64_t j = 0; j < dv; ++j) o[j] += p * double(v[j]);
    }
  }
}

}  // namespace kvscore::eval
