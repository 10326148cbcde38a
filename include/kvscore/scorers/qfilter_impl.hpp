// kvscore/scorers/qfilter_impl.hpp — Q-Filter calibration (an SVD per query head): inline in
// header-only use, compiled once into kvscore::dispatch otherwise (kvscore/detail/compiled.hpp).
#pragma once

#include <Eigen/Dense>

#include "kvscore/scorers/qfilter.hpp"

namespace kvscore {

KVSCORE_IMPL_INLINE std::vector<float> calibrate_qfilters(const float* queries, std::int64_t q_heads,
                                                          std::int64_t n, std::int64_t head_dim,
                                                          std::int64_t kv_heads) {
  const std::string who = "kvscore::calibrate_qfilters";
  if (q_heads <= 0 || kv_heads <= 0 || q_heads % kv_heads != 0)
    detail::throw_invalid(who + ": q_heads (" + std::to_string(q_heads) + ") must be a positive multiple of kv_heads (" +
                          std::to_string(kv_heads) + ")");
  if (n <= 0) detail::throw_invalid(who + ": need at least one query sample (got n = " + std::to_string(n) + ")");
  if (head_dim <= 0 || head_dim > kMaxHeadDim)
    detail::throw_invalid(who + ": head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " +
                          std::to_string(head_dim) + ")");
  if (queries == nullptr) detail::throw_invalid(who + ": queries is null");
  const std::int64_t total = detail::checked_mul(detail::checked_mul(q_heads, n, "calibrate_qfilters"), head_dim,
                                                 "calibrate_qfilters");
  for (std::int64_t i = 0; i < total; ++i)
    if (!std::isfinite(queries[i]))
      detail::throw_invalid(who + ": query value " + std::to_string(queries[i]) + " at flat index " +
                            std::to_string(i) + " is not finite");

  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const std::int64_t group = q_heads / kv_heads;
  std::vector<float> filters(std::size_t(kv_heads * head_dim), 0.f);
  for (std::int64_t hq = 0; hq < q_heads; ++hq) {
    const Eigen::Map<const RowMajor> q(queries + hq * n * head_dim, Eigen::Index(n), Eigen::Index(head_dim));
    const Eigen::MatrixXd m = q.cast<double>();
    Eigen::JacobiSVD<Eigen::MatrixXd> svd(m, Eigen::ComputeThinV);  // as OjaKV's calibration (ojakv_impl.hpp)
    Eigen::VectorXd v = svd.matrixV().col(0);
    const Eigen::VectorXd proj = m * v;
    const std::int64_t pos = (proj.array() > 0.0).count(), neg = (proj.array() < 0.0).count();
    if (neg > pos || (neg == pos && proj.sum() < 0.0)) v = -v;
    float* f = filters.data() + (hq / group) * head_dim;
    for (std::int64_t j = 0; j < head_dim; ++j) f[j] += float(v(Eigen::Index(j)) / double(group));
  }
  return filters;
}

}  // namespace kvscore
