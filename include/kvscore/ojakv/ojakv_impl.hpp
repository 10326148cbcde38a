// kvscore/ojakv/ojakv_impl.hpp — definitions of OjaKV's non-template numerics (QR, SVD,
// power iteration, Oja steps, covariance, metrics; the hybrid cache's are in cache_impl.hpp): inline in
// header-only use, compiled once into kvscore::dispatch otherwise (kvscore/detail/compiled.hpp).
#pragma once

#include "kvscore/ojakv/ojakv.hpp"

namespace kvscore {
namespace oja {

KVSCORE_IMPL_INLINE Mat orthonormalize(const Mat& a) {
  const Eigen::HouseholderQR<Mat> qr(a);
  Mat q = qr.householderQ() * Mat::Identity(a.rows(), a.cols());
  for (Eigen::Index j = 0; j < a.cols(); ++j)
    if (qr.matrixQR()(j, j) < 0) q.col(j) = -q.col(j);
  return q;
}

KVSCORE_IMPL_INLINE Mat random_orthonormal(std::int64_t d, std::int64_t r, std::uint64_t seed) {
  check_rank("kvscore::oja::random_orthonormal", d, r);
  SplitMix64 g(seed);
  Mat a(d, r);
  for (Eigen::Index j = 0; j < a.cols(); ++j)
    for (Eigen::Index i = 0; i < a.rows(); ++i) a(i, j) = g.gaussian();
  return orthonormalize(a);
}

KVSCORE_IMPL_INLINE double orthonormality_error(const Mat& u) {
  return (u.transpose() * u - Mat::Identity(u.cols(), u.cols())).cwiseAbs().maxCoeff();
}

KVSCORE_IMPL_INLINE double top_eigenvalue(const Mat& c, const Mat* u) {
  const double dmax = c.diagonal().maxCoeff();
  if (!(dmax > 0)) return 0.0;
  double lam = dmax;
  if (u != nullptr)
    for (Eigen::Index j = 0; j < u->cols(); ++j) lam = std::max(lam, u->col(j).dot(c * u->col(j)));
  SplitMix64 g(0x0DA1A5EEDull);  // fixed: the estimate is deterministic
  Eigen::VectorXd v(c.rows());
  for (Eigen::Index i = 0; i < v.size(); ++i) v(i) = g.gaussian();
  for (int it = 0; it < 32; ++it) {
    const double nv = v.norm();
    if (!(nv > 0)) break;
    v /= nv;
    const Eigen::VectorXd w = c * v;
    lam = std::max(lam, v.dot(w));
    v = w;
  }
  return lam;
}

KVSCORE_IMPL_INLINE int oja_steps(Mat& u, const Mat& c, double eta, int iterations, double tol) {
  const double lam = top_eigenvalue(c, &u);
  if (!(lam > 0) || !std::isfinite(lam)) return 0;
  const double step = eta / lam;
  int done = 0;
  for (; done < iterations; ++done) {
    const Mat cu = c * u;
    const Mat g = cu - u * (u.transpose() * cu);  // (I - U U^T) C U: the part of C U outside U
    const double gmax = g.cwiseAbs().maxCoeff() * step;
    if (gmax <= tol) break;
    u = orthonormalize(u + step * g);
  }
  return done;
}

KVSCORE_IMPL_INLINE std::int64_t rank_from_energy(const Eigen::VectorXd& s2, double eps) {
  const double total = s2.sum();
  if (!(total > 0)) return 1;
  double acc = 0;
  for (Eigen::Index i = 0; i < s2.size(); ++i) {
    acc += s2(i);
    // Relative slack of 1e-12: an exact threshold (e.g. 13/14 asked as 13.0/14) is reached.
    if (acc >= eps * total * (1.0 - 1e-12)) return std::int64_t(i + 1);
  }
  return std::int64_t(s2.size());
}

KVSCORE_IMPL_INLINE Mat calibrate(const std::vector<std::pair<const float*, std::int64_t>>& blocks, std::int64_t d,
                     RankRule rule, const char* who) {
  if (d <= 0 || d > kMaxHeadDim)
    detail::throw_invalid(std::string(who) + ": head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " +
                          std::to_string(d) + ")");
  if (rule.rank == 0 && !(rule.energy > 0.0 && rule.energy <= 1.0))
    detail::throw_invalid(std::string(who) + ": energy threshold must be in (0, 1] (got " + num(rule.energy) + ")");
  if (rule.rank != 0) check_rank(who, d, rule.rank);
  std::int64_t n = 0;
  for (const auto& b : blocks) {
    if (b.second < 0) detail::throw_invalid(std::string(who) + ": negative sample count " + std::to_string(b.second));
    if (b.second > 0 && b.first == nullptr) detail::throw_invalid(std::string(who) + ": sample data is null");
    n += b.second;
  }
  if (n == 0) detail::throw_invalid(std::string(who) + ": no calibration samples (0 rows)");
  Mat x(n, d);
  Eigen::Index row = 0;
  for (const auto& b : blocks)
    for (std::int64_t i = 0; i < b.second; ++i, ++row)
      for (std::int64_t j = 0; j < d; ++j) {
        const float v = b.first[i * d + j];
        if (!std::isfinite(v))
          detail::throw_invalid(std::string(who) + ": calibration value " + num(v) + " at [row " + std::to_string(i) +
                                ", dim " + std::to_string(j) + "] is not finite");
        x(row, j) = double(v);
      }
  // Jacobi (after Eigen's column-pivoting QR of the n x d rows), not BDCSVD: the same singular values
  // to 1e-13 (relative) at d = 64 and 128, no slower there, and 20-30 s less CPU to compile
  const Eigen::JacobiSVD<Mat> svd(x, Eigen::ComputeThinV);
  const Eigen::VectorXd s2 = svd.singularValues().array().square();
  const std::int64_t r = rule.rank != 0 ? rule.rank : rank_from_energy(s2, rule.energy);
  if (r > std::int64_t(svd.matrixV().cols()))
    detail::throw_invalid(std::string(who) + ": rank " + std::to_string(r) + " exceeds the " +
                          std::to_string(svd.matrixV().cols()) + " singular vectors of " + std::to_string(n) +
                          " samples");
  return orthonormalize(svd.matrixV().leftCols(Eigen::Index(r)));
}

KVSCORE_IMPL_INLINE void PooledCovariance::flush_block() {
    if (in_block > 0) c.selfadjointView<Eigen::Lower>().rankUpdate(block.topRows(in_block).transpose());
    in_block = 0;
  }

KVSCORE_IMPL_INLINE void PooledCovariance::flush() {
    if (in_window > 0) {
      block.row(in_block++) = (acc / double(in_window)).transpose();
      if (in_block == kBlock) flush_block();
      ++pooled;
    }
    acc.setZero();
    in_window = 0;
  }

KVSCORE_IMPL_INLINE void PooledCovariance::add(std::int64_t t, const double* row, bool ok) {
    if (t / p != window) {
      flush();
      window = t / p;
    }
    if (!ok) return;
    ++valid;
    ++in_window;
    acc += Eigen::Map<const Eigen::VectorXd>(row, d);
  }

KVSCORE_IMPL_INLINE Mat PooledCovariance::finish() {
    flush();
    flush_block();
    Mat full = c.selfadjointView<Eigen::Lower>();
    if (pooled > 0) full /= double(pooled);
    return full;
  }

/// `m` (named `what` in the message) holds only finite values.
inline void require_finite(const char* who, const char* what, const Eigen::MatrixXd& m) {
  if (!m.allFinite()) detail::throw_invalid(std::string(who) + ": " + what + " holds a NaN or Inf");
}

}  // namespace oja

// residual_energy_ratio and subspace_overlap open alike (a name, a dimension check, an empty
// check, finite inputs): two metrics with the same kind of inputs, not one function twice.
KVSCORE_IMPL_INLINE double residual_energy_ratio(const Eigen::MatrixXd& x, const Eigen::MatrixXd& u) {
  const char* who = "kvscore::residual_energy_ratio";
  if (x.cols() != u.rows())
    detail::throw_invalid(std::string(who) + ": data has " + std::to_string(x.cols()) + " columns but the basis has " +
                          std::to_string(u.rows()) + " rows");
  if (x.rows() == 0) detail::throw_invalid(std::string(who) + ": no data rows");
  oja::require_finite(who, "data", x);
  oja::require_finite(who, "basis", u);
  const double total = x.squaredNorm();
  if (!(total > 0)) detail::throw_invalid(std::string(who) + ": data has zero energy (every row is zero)");
  return (x - (x * u) * u.transpose()).squaredNorm() / total;
}

KVSCORE_IMPL_INLINE double subspace_overlap(const Eigen::MatrixXd& u1, const Eigen::MatrixXd& u2) {
  const char* who = "kvscore::subspace_overlap";
  if (u1.rows() != u2.rows())
    detail::throw_invalid(std::string(who) + ": bases have " + std::to_string(u1.rows()) + " and " +
                          std::to_string(u2.rows()) + " rows (head_dim differs)");
  if (u1.cols() == 0) detail::throw_invalid(std::string(who) + ": U1 has rank 0");
  for (const Eigen::MatrixXd* u : {&u1, &u2}) oja::require_finite(who, "basis", *u);
  return (u2.transpose() * u1).squaredNorm() / double(u1.cols());
}

}  // namespace kvscore
