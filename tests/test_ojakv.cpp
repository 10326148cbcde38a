// OjaKV (include/kvscore/ojakv/ojakv.hpp, docs/methods/ojakv.md): the generator against its published
// reference values, closed forms (RER, SO, energy rank, one Oja step recomputed with an
// eigen-solver and Gram–Schmidt, memory), planted structure (a subspace, a drift, high-residual
// tokens), a brute-force fp64 reference of the residual score, invalid rows and error paths.
#include <catch2/catch.hpp>

#include <kvscore/ojakv/ojakv.hpp>
#include <kvscore/io/npy.hpp>
#include <kvscore/select.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Catch::Matchers::Contains;
using kvscore::KeysView;
using kvscore::OjaBasis;
using kvscore::OjaOptions;
using kvscore::OjaProjector;
using Mat = Eigen::MatrixXd;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Mat gaussian(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed) {
  kvscore::oja::SplitMix64 g(seed);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < rows; ++i)
    for (Eigen::Index j = 0; j < cols; ++j) m(i, j) = g.gaussian();
  return m;
}

/// Orthonormal columns by modified Gram–Schmidt (independent of the library's Householder QR).
Mat gram_schmidt(Mat a) {
  for (Eigen::Index j = 0; j < a.cols(); ++j) {
    for (Eigen::Index i = 0; i < j; ++i) a.col(j) -= a.col(i).dot(a.col(j)) * a.col(i);
    a.col(j).normalize();
  }
  return a;
}

/// n rows from span(B) with per-direction scales `w` (Gaussian coefficients) plus isotropic noise.
Mat planted(Eigen::Index n, const Mat& b, const Eigen::VectorXd& w, double noise, std::uint64_t seed) {
  const Mat z = gaussian(n, b.cols(), seed) * w.asDiagonal();
  return z * b.transpose() + noise * gaussian(n, b.rows(), seed + 1000);
}

std::vector<float> to_f32(const Mat& x) {  // row-major
  std::vector<float> v(std::size_t(x.size()));
  for (Eigen::Index i = 0; i < x.rows(); ++i)
    for (Eigen::Index j = 0; j < x.cols(); ++j) v[std::size_t(i * x.cols() + j)] = float(x(i, j));
  return v;
}

template <class T>
std::vector<T> as(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = kvscore::from_float<T>(v[i]);
  return out;
}

template <class T>
KeysView<T> one_head(const std::vector<T>& v, std::int64_t n, std::int64_t d) {
  return KeysView<T>(v.data(), 1, n, d, n * d, d);
}

Eigen::VectorXd linspace(double hi, double lo, Eigen::Index r) { return Eigen::VectorXd::LinSpaced(r, hi, lo); }

}  // namespace

TEST_CASE("ojakv: splitmix64 gives the published reference sequence, Box-Muller the N(0,1) moments", "[ojakv]") {
  kvscore::oja::SplitMix64 g(0);  // reference values of Vigna's splitmix64.c for seed 0
  CHECK(g.next() == 0xe220a8397b1dcdafull);
  CHECK(g.next() == 0x6e789e6aa1b965f4ull);
  CHECK(g.next() == 0x06c45d188009454full);
  kvscore::oja::SplitMix64 n(42);
  double s = 0, s2 = 0, s4 = 0;
  const int m = 200000;
  for (int i = 0; i < m; ++i) {
    const double x = n.gaussian();
    s += x;
    s2 += x * x;
    s4 += x * x * x * x;
  }
  CHECK(std::abs(s / m) < 0.01);        // sd of the mean 0.0022
  CHECK(std::abs(s2 / m - 1) < 0.015);  // sd 0.0032
  CHECK(std::abs(s4 / m - 3) < 0.1);    // 4th moment 3, sd 0.022
}

TEST_CASE("ojakv: random_orthonormal is orthonormal and reproducible per seed", "[ojakv]") {
  const Mat a = kvscore::oja::random_orthonormal(64, 16, 7);
  const Mat b = kvscore::oja::random_orthonormal(64, 16, 7);
  const Mat c = kvscore::oja::random_orthonormal(64, 16, 8);
  CHECK(kvscore::oja::orthonormality_error(a) < 1e-12);
  CHECK(a == b);
  CHECK((a - c).cwiseAbs().maxCoeff() > 0.1);
  // A random 16-dim subspace of R^64 overlaps another by about r/d = 0.25.
  CHECK(kvscore::subspace_overlap(a, c) == Approx(0.25).margin(0.1));
}

TEST_CASE("ojakv: orthonormalize returns an orthonormal basis unchanged and spans the input", "[ojakv]") {
  const Mat u = gram_schmidt(gaussian(32, 5, 3));
  Mat fixed = u;
  for (Eigen::Index j = 0; j < u.cols(); ++j)  // Gram–Schmidt gives diag(R) > 0; flip half of the signs
    if (j % 2) fixed.col(j) = -fixed.col(j);
  const Mat q = kvscore::oja::orthonormalize(u);
  CHECK((q - u).cwiseAbs().maxCoeff() < 1e-12);
  const Mat q2 = kvscore::oja::orthonormalize(fixed);  // columns negated: R's diagonal would be negative
  CHECK((q2 - fixed).cwiseAbs().maxCoeff() < 1e-12);
  const Mat a = gaussian(32, 5, 4);
  const Mat qa = kvscore::oja::orthonormalize(a);
  CHECK(kvscore::oja::orthonormality_error(qa) < 1e-12);
  CHECK(kvscore::subspace_overlap(qa, gram_schmidt(a)) == Approx(1.0).epsilon(1e-12));
}

TEST_CASE("ojakv: RER and SO closed forms", "[ojakv]") {
  const Eigen::Index d = 8;
  const Mat e = Mat::Identity(d, d);
  // Rows a*e0 + b*e1 with U = e0: RER = b^2 / (a^2 + b^2).
  Mat x(3, d);
  x.setZero();
  x(0, 0) = 3, x(0, 1) = 4;
  x(1, 0) = 1, x(1, 1) = 0;
  x(2, 0) = 0, x(2, 1) = 2;
  CHECK(kvscore::residual_energy_ratio(x, e.leftCols(1)) == Approx((16.0 + 0 + 4) / (25.0 + 1 + 4)).epsilon(1e-14));
  CHECK(kvscore::residual_energy_ratio(x, e.leftCols(2)) == Approx(0.0).margin(1e-15));
  CHECK(kvscore::residual_energy_ratio(x, e.rightCols(3)) == Approx(1.0).epsilon(1e-15));
  // SO: same subspace 1, orthogonal 0, one column rotated by theta: (r - 1 + cos^2 theta) / r.
  const double th = 0.3;
  Mat u1 = e.leftCols(2), u2 = e.leftCols(2);
  u2.col(1) = std::cos(th) * e.col(1) + std::sin(th) * e.col(5);
  CHECK(kvscore::subspace_overlap(u1, u1) == Approx(1.0).epsilon(1e-15));
  CHECK(kvscore::subspace_overlap(u1, e.rightCols(2)) == Approx(0.0).margin(1e-15));
  CHECK(kvscore::subspace_overlap(u1, u2) == Approx((1 + std::cos(th) * std::cos(th)) / 2).epsilon(1e-14));
  CHECK(kvscore::subspace_overlap(u2, u1) == Approx((1 + std::cos(th) * std::cos(th)) / 2).epsilon(1e-14));
}

TEST_CASE("ojakv: calibration stacks query and key rows and picks the rank by energy", "[ojakv]") {
  // X = A diag(3, 2, 1) B^T with orthonormal A (n x 3), B (d x 3): squared singular values
  // 9, 4, 1, energies 9/14, 13/14, 1. Split the rows into "queries" and "keys".
  const Eigen::Index n = 40, d = 16;
  const Mat a = gram_schmidt(gaussian(n, 3, 11)), b = gram_schmidt(gaussian(d, 3, 12));
  const Mat x = a * Eigen::Vector3d(3, 2, 1).asDiagonal() * b.transpose();
  const std::vector<float> q = to_f32(x.topRows(15)), k = to_f32(x.bottomRows(n - 15));
  auto rank_for = [&](double eps) {
    return OjaBasis::calibrate({{q.data(), 15}, {k.data(), n - 15}}, d, kvscore::oja::RankRule::energy_fraction(eps)).rank();
  };
  CHECK(rank_for(0.5) == 1);
  CHECK(rank_for(9.0 / 14 - 1e-6) == 1);
  CHECK(rank_for(9.0 / 14 + 1e-6) == 2);
  CHECK(rank_for(0.9) == 2);
  CHECK(rank_for(13.0 / 14) == 2);
  CHECK(rank_for(0.95) == 3);
  CHECK(rank_for(1.0) == 3);
  const OjaBasis two = OjaBasis::calibrate({{q.data(), 15}, {k.data(), n - 15}}, d, kvscore::oja::RankRule::fixed(2));
  CHECK(kvscore::subspace_overlap(two.basis(), b.leftCols(2)) == Approx(1.0).epsilon(1e-6));
  // Keys alone span the same 3-dim space; queries alone would too, but the stacking is used:
  // a query block along b0 only changes the top direction.
  const OjaProjector p = OjaProjector::calibrate(q.data(), 15, k.data(), n - 15, k.data(), n - 15, d,
                                                 kvscore::oja::RankRule::fixed(3), kvscore::oja::RankRule::fixed(1));
  CHECK(p.key().rank() == 3);
  CHECK(p.value().rank() == 1);
  CHECK(kvscore::subspace_overlap(p.key().basis(), b) == Approx(1.0).epsilon(1e-6));
}

TEST_CASE("ojakv: one prefill step equals the formula (eigen-solver lambda1, Gram-Schmidt QR)", "[ojakv]") {
  const Eigen::Index n = 64, d = 12, r = 3;
  const Mat x = planted(n, gram_schmidt(gaussian(d, 4, 21)), linspace(4, 1, 4), 0.3, 22);
  const std::vector<float> xf = to_f32(x);
  OjaOptions o;
  o.pool = 2;
  o.prefill_iterations = 1;
  o.eta_prefill = 0.7;
  OjaBasis basis = OjaBasis::random(d, r, 5, o);
  const Mat u0 = basis.basis();
  REQUIRE(basis.prefill(one_head(xf, n, d), 0) == n);
  // Expected: pooled rows = means of (2i, 2i+1) (of the fp32 data), C = X^T X / (n/2).
  Mat xp(n / 2, d);
  for (Eigen::Index i = 0; i < n / 2; ++i)
    for (Eigen::Index j = 0; j < d; ++j)
      xp(i, j) = (double(xf[std::size_t(2 * i * d + j)]) + double(xf[std::size_t((2 * i + 1) * d + j)])) / 2;
  const Mat c = xp.transpose() * xp / double(n / 2);
  const double lam = Eigen::SelfAdjointEigenSolver<Mat>(c).eigenvalues().maxCoeff();
  const Mat step = u0 + (0.7 / lam) * (c * u0 - u0 * u0.transpose() * c * u0);
  const Mat expect = gram_schmidt(step);
  CHECK((basis.basis() - expect).cwiseAbs().maxCoeff() < 1e-9);
  CHECK(basis.last_steps() == 1);
}

TEST_CASE("ojakv: the paper prefill is one step at 0.10 / lambda1 (ojakv.txt Alg. 1)", "[ojakv]") {
  const Eigen::Index n = 64, d = 12, r = 3;
  const Mat x = planted(n, gram_schmidt(gaussian(d, 4, 31)), linspace(4, 1, 4), 0.3, 32);
  const std::vector<float> xf = to_f32(x);
  const OjaOptions o = OjaOptions::paper();
  CHECK(o.eta_prefill == 0.10);
  CHECK(o.prefill_iterations == 1);
  OjaBasis basis = OjaBasis::random(d, r, 6, o);
  const Mat u0 = basis.basis();
  REQUIRE(basis.prefill(one_head(xf, n, d), 0) == n);
  Mat xp(n / 4, d);  // pool = 4
  for (Eigen::Index i = 0; i < n / 4; ++i)
    for (Eigen::Index j = 0; j < d; ++j) {
      double acc = 0;
      for (Eigen::Index k = 0; k < 4; ++k) acc += double(xf[std::size_t((4 * i + k) * d + j)]);
      xp(i, j) = acc / 4;
    }
  const Mat c = xp.transpose() * xp / double(n / 4);
  const double lam = Eigen::SelfAdjointEigenSolver<Mat>(c).eigenvalues().maxCoeff();
  const Mat expect = gram_schmidt(u0 + (0.10 / lam) * (c * u0 - u0 * u0.transpose() * c * u0));
  CHECK((basis.basis() - expect).cwiseAbs().maxCoeff() < 1e-9);
  CHECK(basis.last_steps() == 1);
}

TEMPLATE_TEST_CASE("ojakv: prefill recovers a planted subspace from a random start", "[ojakv]", float, kvscore::half,
                   kvscore::bfloat16) {
  const std::int64_t n = 4096, d = 64, r = 8;
  const Mat b = gram_schmidt(gaussian(d, r, 31));
  const Mat x = planted(n, b, linspace(3, 1, r), 0.05, 32);
  const std::vector<TestType> keys = as<TestType>(to_f32(x));
  for (std::int64_t pool : {1, 4}) {
    OjaOptions o;
    o.pool = pool;
    OjaBasis basis = OjaBasis::random(d, r, 33, o);
    REQUIRE(kvscore::subspace_overlap(basis.basis(), b) < 0.3);  // a random start: about r/d
    basis.prefill(one_head(keys, n, d), 0);
    INFO("pool " << pool << " steps " << basis.last_steps());
    CHECK(kvscore::subspace_overlap(basis.basis(), b) >= 0.95);
    CHECK(kvscore::oja::orthonormality_error(basis.basis()) < 1e-12);
    // RER within 1% (absolute) of the optimum of the same data: the top eigenvectors of x^T x (a
    // symmetric eigensolver, not the library's SVD), eigenvalues ascending
    const Eigen::SelfAdjointEigenSolver<Mat> eig(x.transpose() * x);
    const double best = kvscore::residual_energy_ratio(x, eig.eigenvectors().rightCols(r));
    CHECK(kvscore::residual_energy_ratio(x, basis.basis()) <= best + 0.01);
  }
}

// Issue 18, defect 3: an isolated channel whose variance is the largest diagonal but not lambda1.
// C = blockdiag(A, 1.01, 0.05 I), A 8 x 8 with unit diagonal and 0.9 off it: lambda1 = 1 + 7 * 0.9
// = 7.3 (eigenvector 1/sqrt(8) on the first 8 channels), lambda2 = 1.01 (channel 8), then 0.1
// and 0.05. A power iteration started at the column of the largest diagonal (channel 8) never
// leaves it (lambda^ = 1.01), and 32 steps at 1.5 / 1.01 overshoot the top space (SO ~ 0.6 at r = 1).
TEST_CASE("ojakv: lambda1 and the Oja steps are right when the largest diagonal is an isolated channel", "[ojakv]") {
  const Eigen::Index d = 16;
  Mat c = Mat::Zero(d, d);
  c.topLeftCorner(8, 8).setConstant(0.9);
  for (Eigen::Index i = 0; i < 8; ++i) c(i, i) = 1.0;
  c(8, 8) = 1.01;
  for (Eigen::Index i = 9; i < d; ++i) c(i, i) = 0.05;
  CHECK(std::abs(kvscore::oja::top_eigenvalue(c) - 7.3) < 1e-9);
  const double lam1 = Eigen::SelfAdjointEigenSolver<Mat>(c).eigenvalues().maxCoeff();  // 7.3
  for (Eigen::Index r : {1, 2}) {
    INFO("rank " << r);
    const Mat u0 = kvscore::oja::random_orthonormal(d, r, 61);
    Mat u = u0;
    const int steps = kvscore::oja::oja_steps(u, c, 1.5, 32, 1e-7);  // the prefill's defaults
    // Reference: the same rule with the exact lambda1 and Gram–Schmidt, the same early stop.
    Mat ref = u0;
    int ref_steps = 0;
    for (; ref_steps < 32; ++ref_steps) {
      const Mat g = c * ref - ref * (ref.transpose() * c * ref);
      if (g.cwiseAbs().maxCoeff() * (1.5 / lam1) <= 1e-7) break;
      ref = gram_schmidt(ref + (1.5 / lam1) * g);
    }
    CHECK(steps == ref_steps);
    CHECK((u - ref).cwiseAbs().maxCoeff() < 1e-9);
    CHECK(kvscore::oja::orthonormality_error(u) < 1e-12);
    if (r == 1) {  // the top eigenvector, 1/sqrt(8) on the first 8 channels
      Mat top = Mat::Zero(d, 1);
      top.col(0).head(8).setConstant(1.0 / std::sqrt(8.0));
      CHECK(kvscore::subspace_overlap(u, top) > 0.999);
    }
  }
}

TEST_CASE("ojakv: the learning rate is scale-free", "[ojakv]") {
  const std::int64_t n = 512, d = 32, r = 4;
  const Mat x = planted(n, gram_schmidt(gaussian(d, r, 41)), linspace(2, 1, r), 0.1, 42);
  const std::vector<float> small = to_f32(x * (1.0 / 1024)), large = to_f32(x * 1024.0);
  OjaOptions o;
  o.prefill_iterations = 3;
  OjaBasis a = OjaBasis::random(d, r, 43, o), b = OjaBasis::random(d, r, 43, o);
  a.prefill(one_head(small, n, d), 0);
  b.prefill(one_head(large, n, d), 0);  // powers of two: the same data up to exact scaling
  CHECK((a.basis() - b.basis()).cwiseAbs().maxCoeff() < 1e-12);
  CHECK(kvscore::subspace_overlap(a.basis(), OjaBasis::random(d, r, 43, o).basis()) < 0.99);  // it moved
}

TEST_CASE("ojakv: periodic decode updates track a drifting subspace (ojakv.txt Table 1 effect)", "[ojakv]") {
  const std::int64_t d = 64, r = 8, n1 = 2048, n2 = 4096;
  const Mat b1 = gram_schmidt(gaussian(d, r, 51));
  // The second half: half of the directions rotated 60 degrees into new, orthogonal ones.
  const Mat extra = gram_schmidt((Mat::Identity(d, d) - b1 * b1.transpose()) * gaussian(d, r, 52));
  Mat b2 = b1;
  for (Eigen::Index j = 0; j < r; j += 2) b2.col(j) = 0.5 * b1.col(j) + std::sqrt(0.75) * extra.col(j);
  const Mat x1 = planted(n1, b1, linspace(3, 1, r), 0.05, 53), x2 = planted(n2, b2, linspace(3, 1, r), 0.05, 54);
  const std::vector<float> f1 = to_f32(x1), f2 = to_f32(x2);

  OjaBasis basis = OjaBasis::random(d, r, 55);
  basis.prefill(one_head(f1, n1, d), 0);
  const Mat frozen = basis.basis();
  REQUIRE(kvscore::subspace_overlap(frozen, b1) > 0.95);
  const Mat test = planted(1024, b2, linspace(3, 1, r), 0.05, 56);  // fresh data of the new distribution
  const double rer_frozen = kvscore::residual_energy_ratio(test, frozen);

  std::int64_t updates = 0;
  for (std::int64_t t = 0; t < n2; ++t) {
    const bool up = basis.push(f2.data() + t * d);
    CHECK(up == ((t + 1) % 128 == 0));
    updates += up;
  }
  CHECK(updates == n2 / 128);
  CHECK(basis.decode_updates() == n2 / 128);
  CHECK(basis.buffered() == 0);
  const double rer_adapted = kvscore::residual_energy_ratio(test, basis.basis());
  INFO("RER frozen " << rer_frozen << " adapted " << rer_adapted);
  CHECK(rer_adapted < 0.5 * rer_frozen);
  CHECK(kvscore::subspace_overlap(basis.basis(), b2) > kvscore::subspace_overlap(frozen, b2) + 0.1);
  // QR keeps the fp32 copy orthonormal to 1e-5 after 32 updates.
  const Eigen::MatrixXf uf = basis.basis_f32();
  CHECK((uf.transpose() * uf - Eigen::MatrixXf::Identity(r, r)).cwiseAbs().maxCoeff() < 1e-5f);
  CHECK(kvscore::oja::orthonormality_error(basis.basis()) < 1e-12);
}

TEST_CASE("ojakv: flush runs the decode update on a partial buffer", "[ojakv]") {
  const std::int64_t d = 16, r = 2;
  const Mat x = planted(50, gram_schmidt(gaussian(d, r, 61)), linspace(2, 1, r), 0.05, 62);
  const std::vector<float> f = to_f32(x);
  OjaBasis a = OjaBasis::random(d, r, 63);
  const Mat u0 = a.basis();
  for (int t = 0; t < 50; ++t) CHECK_FALSE(a.push(f.data() + t * d));
  CHECK(a.buffered() == 50);
  a.flush();
  CHECK(a.buffered() == 0);
  CHECK(a.decode_updates() == 1);
  CHECK((a.basis() - u0).cwiseAbs().maxCoeff() > 1e-6);
  CHECK_THROWS_WITH(a.flush(), Contains("decode buffer is empty"));
}

TEST_CASE("ojakv: logit equivalence (QU)(KU)^T == Q Khat^T and output equivalence (ojakv.txt A.4)", "[ojakv]") {
  const std::int64_t n = 200, d = 32, r = 8;
  const std::vector<float> k = to_f32(gaussian(n, d, 71)), v = to_f32(gaussian(n, d, 72));
  const std::vector<OjaProjector> proj{OjaProjector::random(d, r, 12, 73)};
  kvscore::Selection none;
  none.heads = 1;
  none.tokens = n;
  none.offsets = {0, 0};
  const auto cache = kvscore::OjaHybridCache::build(proj, one_head(k, n, d), one_head(v, n, d), none);
  const Eigen::MatrixXf uk = proj[0].key().basis_f32(), uv = proj[0].value().basis_f32();
  const kvscore::oja::RowMajorF khat = cache.reconstruct_keys(0);
  const Eigen::MatrixXf q = gaussian(5, d, 74).cast<float>();
  const Eigen::MatrixXf kt = Eigen::Map<const kvscore::oja::RowMajorF>(k.data(), n, d);
  const Eigen::MatrixXf low = (q * uk) * (kt * uk).transpose();
  const Eigen::MatrixXf rec = q * khat.transpose();
  // Both are fp32 products of the same exact quantities: |diff| <= ~(2d + r) u sum|terms|.
  const double bound = 1e-5 * (q.cwiseAbs() * kt.cwiseAbs().transpose()).maxCoeff();
  CHECK((low - rec).cwiseAbs().maxCoeff() <= bound);
  CHECK(cache.head(0).codes_k.rows() == n);
  // Output: softmax(Q~ K~^T/sqrt d) V~ U_v^T == attention over the reconstruction.
  for (int i = 0; i < 5; ++i) {
    const Eigen::VectorXf qi = q.row(i).transpose();
    const std::vector<double> o = cache.attention(0, qi.data());
    Eigen::VectorXd z = ((kt * uk) * (uk.transpose() * qi)).cast<double>() / std::sqrt(double(d));
    z = (z.array() - z.maxCoeff()).exp();
    z /= z.sum();
    const Eigen::MatrixXd vt = Eigen::Map<const kvscore::oja::RowMajorF>(v.data(), n, d).cast<double>();
    const Eigen::VectorXd expect = uv.cast<double>() * ((vt * uv.cast<double>()).transpose() * z);
    for (std::int64_t j = 0; j < d; ++j) CHECK(o[std::size_t(j)] == Approx(expect(j)).margin(1e-5));
  }
}

namespace {

/// e_t straight from its definition, fp64, keys widened from T.
template <class T>
std::vector<double> ref_residual(const std::vector<T>& keys, std::int64_t H, std::int64_t N, std::int64_t d,
                                 const std::vector<float>& q, std::int64_t Hq, std::int64_t w, const std::vector<Mat>& u,
                                 bool after_cache = false) {
  std::vector<double> out(std::size_t(H * N));
  const std::int64_t G = Hq / H;
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t) {
      Eigen::VectorXd k(d);
      bool ok = true;
      for (std::int64_t j = 0; j < d; ++j) {
        k(j) = double(kvscore::to_float(keys[std::size_t((h * N + t) * d + j)]));
        ok = ok && std::isfinite(k(j));
      }
      if (!ok) {
        out[std::size_t(h * N + t)] = -std::numeric_limits<double>::infinity();
        continue;
      }
      const Eigen::VectorXd res = k - u[std::size_t(h)] * (u[std::size_t(h)].transpose() * k);
      double s = 0;
      int cnt = 0;
      for (std::int64_t g = 0; g < G; ++g)
        for (std::int64_t i = 0; i < w; ++i) {
          if (!after_cache && N - w + i < t) continue;  // causal: query i sits at N - w + i
          double dot = 0;
          for (std::int64_t j = 0; j < d; ++j) dot += double(q[std::size_t(((h * G + g) * w + i) * d + j)]) * res(j);
          s += std::abs(dot) / std::sqrt(double(d));
          ++cnt;
        }
      out[std::size_t(h * N + t)] = s / cnt;
    }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("ojakv: residual score matches its definition (GQA, causal window, invalid rows)", "[ojakv]", float,
                   kvscore::half, kvscore::bfloat16) {
  const std::int64_t H = 3, N = 70, d = 24, Hq = 6, w = 5;
  std::vector<float> kf = to_f32(gaussian(H * N, d, 81));
  kf[std::size_t((1 * N + 10) * d + 3)] = kNaN;                                // head 1, token 10
  kf[std::size_t((2 * N + 67) * d + 0)] = std::numeric_limits<float>::infinity();  // head 2, in the window
  const std::vector<TestType> keys = as<TestType>(kf);
  const std::vector<float> q = to_f32(gaussian(Hq * w, d, 82));
  std::vector<Mat> u;
  for (int h = 0; h < H; ++h) u.push_back(kvscore::oja::random_orthonormal(d, 4 + h, 83 + h));
  kvscore::OjaResidual scorer(q.data(), Hq, w, d, u);
  const KeysView<TestType> view(keys.data(), H, N, d, N * d, d);
  scorer.num_threads = 1;
  const kvscore::Scores s1 = scorer.score(view);
  scorer.num_threads = 3;
  const kvscore::Scores s3 = scorer.score(view);
  CHECK(s1.values() == s3.values());
  const std::vector<double> ref = ref_residual(keys, H, N, d, q, Hq, w, u);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t) {
      const double e = ref[std::size_t(h * N + t)];
      INFO("head " << h << " token " << t);
      if (std::isinf(e)) CHECK(s1(h, t) == kvscore::kInvalidScore);
      else CHECK(double(s1(h, t)) == Approx(e).epsilon(1e-6).margin(1e-12));
    }
  CHECK(s1(1, 10) == kvscore::kInvalidScore);
  CHECK(s1(2, 67) == kvscore::kInvalidScore);
  // A token-major layout gives the same scores.
  std::vector<TestType> tm(keys.size());
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t j = 0; j < d; ++j) tm[std::size_t((t * H + h) * d + j)] = keys[std::size_t((h * N + t) * d + j)];
  CHECK(scorer.score(KeysView<TestType>::token_major(tm.data(), N, H, d)).values() == s1.values());
}

TEST_CASE("ojakv: after_cache residual - every query sees every token, a window longer than the cache accepted",
          "[ojakv][placement]") {
  const std::int64_t H = 2, N = 40, d = 16, Hq = 4;
  const std::vector<float> keys = to_f32(gaussian(H * N, d, 181));
  std::vector<Mat> u;
  for (int h = 0; h < H; ++h) u.push_back(kvscore::oja::random_orthonormal(d, 3, 183 + h));
  const KeysView<float> view(keys.data(), H, N, d, N * d, d);
  for (const std::int64_t w : {std::int64_t(6), N + 10}) {
    INFO("window " << w);
    const std::vector<float> q = to_f32(gaussian(Hq * w, d, 182));
    kvscore::OjaResidual scorer(q.data(), Hq, w, d, u);
    scorer.placement = kvscore::QueryPlacement::after_cache;
    const kvscore::Scores s = scorer.score(view);
    const std::vector<double> ref = ref_residual(keys, H, N, d, q, Hq, w, u, true);
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < N; ++t) {
        INFO("head " << h << " token " << t);
        CHECK(double(s(h, t)) == Approx(ref[std::size_t(h * N + t)]).epsilon(1e-6).margin(1e-12));
      }
    scorer.placement = kvscore::QueryPlacement::in_cache;
    if (w > N) {
      CHECK_THROWS_WITH(scorer.score(view), Contains("window 50 > tokens 40"));
    } else {  // the causal window changes the last w - 1 tokens' scores, and only those
      const kvscore::Scores c = scorer.score(view);
      for (std::int64_t t = 0; t < N; ++t) CHECK((c(0, t) == s(0, t)) == (t <= N - w));
    }
  }
}

TEST_CASE("ojakv: a full-rank basis scores every valid key exactly 0, and the selector keeps the lowest positions",
          "[ojakv]") {
  // r = d: k - UU^T k is 0, and the product would rank rounding noise (CPU and GPU disagreed on
  // it, issue 30). Head 0 full rank, head 1 rank d - 1 (a real one-dimensional residual).
  const std::int64_t H = 2, N = 50, d = 16, w = 4;
  std::vector<float> kf = to_f32(gaussian(H * N, d, 91));
  kf[std::size_t(7 * d + 2)] = kNaN;  // head 0, token 7
  const std::vector<float> q = to_f32(gaussian(H * w, d, 92));
  const std::vector<Mat> u = {kvscore::oja::random_orthonormal(d, d, 93), kvscore::oja::random_orthonormal(d, d - 1, 94)};
  const kvscore::OjaResidual scorer(q.data(), H, w, d, u);
  const kvscore::Scores s = scorer.score(KeysView<float>(kf.data(), H, N, d, N * d, d));
  const std::vector<double> ref = ref_residual(kf, H, N, d, q, H, w, u);
  for (std::int64_t t = 0; t < N; ++t) {
    INFO("token " << t);
    if (t == 7) {
      CHECK(s(0, t) == kvscore::kInvalidScore);
    } else {
      CHECK(s(0, t) == 0.f);
      CHECK(std::abs(ref[std::size_t(t)]) < 1e-12);  // the product in fp64: noise only
    }
    CHECK(double(s(1, t)) == Approx(ref[std::size_t(N + t)]).epsilon(1e-6));  // rank d - 1: a real score
    CHECK(s(1, t) > 1e-4f);
  }
  kvscore::SelectOptions o;
  o.recent = 0;
  const kvscore::Selection kept = kvscore::select(s, kvscore::Budget::per_head(5), o);
  CHECK(std::vector<std::int64_t>(kept.head(0).begin(), kept.head(0).end()) == std::vector<std::int64_t>{0, 1, 2, 3, 4});
}

TEST_CASE("ojakv: planted high-residual tokens are the ones kept at full rank", "[ojakv]") {
  const std::int64_t N = 300, d = 32, r = 6;
  const Mat b = gram_schmidt(gaussian(d, r, 91));
  Mat x = planted(N, b, linspace(3, 1, r), 0.01, 92);
  const Mat perp = (Mat::Identity(d, d) - b * b.transpose()) * gaussian(d, 1, 93);
  const std::vector<std::int64_t> planted_pos{17, 80, 81, 150, 222};
  for (std::int64_t t : planted_pos) x.row(t) += 3.0 * perp.col(0).normalized().transpose();
  const std::vector<float> k = to_f32(x), v = to_f32(gaussian(N, d, 94));
  OjaProjector p(OjaBasis(b), OjaBasis::random(d, d, 95));  // values at full rank: only the keys err
  const std::int64_t w = 8;
  Mat qm = gaussian(w, d, 96);
  for (Eigen::Index i = 0; i < w; ++i) qm.row(i) += 2.0 * perp.col(0).normalized().transpose();  // queries see it
  const std::vector<float> q = to_f32(qm);
  const kvscore::OjaResidual scorer(q.data(), 1, w, d, {p.key().basis()});
  const kvscore::Scores s = scorer.score(one_head(k, N, d));
  const kvscore::Selection sel = kvscore::select(s, kvscore::Budget::per_head(5));
  CHECK(std::vector<std::int64_t>(sel.head(0).begin(), sel.head(0).end()) == planted_pos);
  // With protection, sinks and recent come on top inside the budget (the generic selector).
  kvscore::SelectOptions opt;
  opt.sinks = 2;
  opt.recent = 3;
  const kvscore::Selection sel2 = kvscore::select(s, kvscore::Budget::per_head(10), opt);
  std::vector<std::int64_t> want{0, 1};
  want.insert(want.end(), planted_pos.begin(), planted_pos.end());
  for (std::int64_t t = N - 3; t < N; ++t) want.push_back(t);
  CHECK(std::vector<std::int64_t>(sel2.head(0).begin(), sel2.head(0).end()) == want);

  const auto cache = kvscore::OjaHybridCache::build(std::vector<OjaProjector>{p}, one_head(k, N, d), one_head(v, N, d), sel);
  const kvscore::oja::RowMajorF khat = cache.reconstruct_keys(0);
  for (std::int64_t t : planted_pos)
    for (std::int64_t j = 0; j < d; ++j) CHECK(khat(t, j) == k[std::size_t(t * d + j)]);  // stored as is
  CHECK(cache.head(0).codes_k.rows() == N - 5);
  CHECK(cache.head(0).full_k.rows() == 5);
  // Anchors make the attention of a window query closer to the exact one than no anchors.
  kvscore::Selection none = sel;
  none.offsets = {0, 0};
  none.positions.clear();
  const auto plain = kvscore::OjaHybridCache::build(std::vector<OjaProjector>{p}, one_head(k, N, d), one_head(v, N, d), none);
  kvscore::Selection all = sel;
  all.offsets = {0, N};
  all.positions.resize(std::size_t(N));
  for (std::int64_t t = 0; t < N; ++t) all.positions[std::size_t(t)] = t;
  const auto exact = kvscore::OjaHybridCache::build(std::vector<OjaProjector>{p}, one_head(k, N, d), one_head(v, N, d), all);
  const std::vector<float> q0(q.begin(), q.begin() + d);
  const auto oe = exact.attention(0, q0.data()), oh = cache.attention(0, q0.data()), op = plain.attention(0, q0.data());
  double eh = 0, ep = 0;
  for (std::int64_t j = 0; j < d; ++j) {
    eh += (oh[std::size_t(j)] - oe[std::size_t(j)]) * (oh[std::size_t(j)] - oe[std::size_t(j)]);
    ep += (op[std::size_t(j)] - oe[std::size_t(j)]) * (op[std::size_t(j)] - oe[std::size_t(j)]);
  }
  INFO("error with anchors " << std::sqrt(eh) << ", without " << std::sqrt(ep));
  CHECK(std::sqrt(eh) < 0.5 * std::sqrt(ep));
}

TEST_CASE("ojakv: invalid rows are left out of the update, score -inf and are masked in attention", "[ojakv]") {
  const std::int64_t n = 100, d = 16, r = 3;
  const Mat x = planted(n, gram_schmidt(gaussian(d, r, 101)), linspace(2, 1, r), 0.1, 102);
  std::vector<float> with = to_f32(x);
  with[std::size_t(37 * d + 5)] = kNaN;
  with[std::size_t(60 * d + 0)] = 3e19f;  // finite but the squared norm overflows fp32
  std::vector<float> without;
  for (std::int64_t t = 0; t < n; ++t)
    if (t != 37 && t != 60) without.insert(without.end(), with.begin() + t * d, with.begin() + (t + 1) * d);
  OjaOptions o;
  o.pool = 1;  // with pooling, removing rows would shift the windows
  OjaBasis a = OjaBasis::random(d, r, 103, o), b = OjaBasis::random(d, r, 103, o);
  CHECK(a.prefill(one_head(with, n, d), 0) == n - 2);
  CHECK(b.prefill(one_head(without, n - 2, d), 0) == n - 2);
  CHECK(a.basis().allFinite());
  CHECK((a.basis() - b.basis()).cwiseAbs().maxCoeff() < 1e-12);
  // Pooling: a window's mean is over its valid rows only.
  OjaOptions o4;
  o4.pool = 4;
  o4.prefill_iterations = 1;
  std::vector<float> dup;  // every row 4 times: pooled rows = the rows themselves
  std::vector<float> dup_nan;
  for (std::int64_t t = 0; t < 20; ++t)
    for (int c = 0; c < 4; ++c) {
      dup.insert(dup.end(), with.begin() + t * d, with.begin() + (t + 1) * d);
      dup_nan.insert(dup_nan.end(), with.begin() + t * d, with.begin() + (t + 1) * d);
      if (c == 2) dup_nan[dup_nan.size() - std::size_t(d)] = kNaN;
    }
  OjaBasis p1 = OjaBasis::random(d, r, 104, o4), p2 = OjaBasis::random(d, r, 104, o4);
  p1.prefill(one_head(dup, 80, d), 0);
  p2.prefill(one_head(dup_nan, 80, d), 0);
  CHECK((p1.basis() - p2.basis()).cwiseAbs().maxCoeff() < 1e-12);
  // All rows invalid: nothing learned, U unchanged.
  const std::vector<float> bad(std::size_t(4 * d), kNaN);
  OjaBasis c = OjaBasis::random(d, r, 105);
  const Mat u0 = c.basis();
  CHECK(c.prefill(one_head(bad, 4, d), 0) == 0);
  CHECK(c.basis() == u0);
  // Decode: an invalid row counts towards T but not into C.
  OjaOptions od;
  od.period = 4;
  od.pool = 1;
  OjaBasis e = OjaBasis::random(d, r, 106, od), f = OjaBasis::random(d, r, 106, od);
  for (int t = 0; t < 3; ++t) CHECK_FALSE(e.push(without.data() + t * d));
  CHECK(e.push(bad.data()));
  for (int t = 0; t < 3; ++t) f.push(without.data() + t * d);
  f.flush();
  CHECK((e.basis() - f.basis()).cwiseAbs().maxCoeff() < 1e-12);
  // Attention: the invalid row is masked; the output equals the cache without it.
  const std::vector<float> vals = to_f32(gaussian(n, d, 107));
  std::vector<float> vals_without;
  for (std::int64_t t = 0; t < n; ++t)
    if (t != 37 && t != 60) vals_without.insert(vals_without.end(), vals.begin() + t * d, vals.begin() + (t + 1) * d);
  const std::vector<OjaProjector> proj{OjaProjector::random(d, r, r, 108)};
  auto empty_sel = [](std::int64_t tokens) {
    kvscore::Selection s;
    s.heads = 1;
    s.tokens = tokens;
    s.offsets = {0, 0};
    return s;
  };
  const auto c1 = kvscore::OjaHybridCache::build(proj, one_head(with, n, d), one_head(vals, n, d), empty_sel(n));
  const auto c2 =
      kvscore::OjaHybridCache::build(proj, one_head(without, n - 2, d), one_head(vals_without, n - 2, d), empty_sel(n - 2));
  const std::vector<float> q(without.begin(), without.begin() + d);
  const auto o1 = c1.attention(0, q.data()), o2 = c2.attention(0, q.data());
  for (std::int64_t j = 0; j < d; ++j) {
    CHECK(std::isfinite(o1[std::size_t(j)]));
    CHECK(o1[std::size_t(j)] == Approx(o2[std::size_t(j)]).margin(1e-12));
  }
}

TEST_CASE("ojakv: memory accounting", "[ojakv]") {
  // 1000 tokens, 10 full rank, d 128, r 64/64, fp16: full 1000*256*2; hybrid 990*128*2 + 10*(512+4) + 128*128*2.
  const kvscore::OjaMemory m = kvscore::ojakv_memory(1000, 10, 128, 64, 64, 2);
  CHECK(m.full_bytes == 512000);
  CHECK(m.hybrid_bytes == 253440 + 5160 + 32768);
  CHECK(m.ratio == Approx(291368.0 / 512000.0));
  // Saving 1 - (rk + rv) / 2d when nothing is full rank and the bases are negligible.
  const kvscore::OjaMemory big = kvscore::ojakv_memory(1 << 20, 0, 128, 96, 64, 2);
  CHECK(big.ratio == Approx(160.0 / 256.0).epsilon(1e-3));
  CHECK(kvscore::ojakv_memory(0, 0, 128, 64, 64, 2).ratio == 0.0);
  CHECK_THROWS_WITH(kvscore::ojakv_memory(10, 11, 128, 64, 64, 2), Contains("full-rank tokens 11"));
  CHECK_THROWS_WITH(kvscore::ojakv_memory(10, 1, 128, 129, 64, 2), Contains("got 129"));
}

TEST_CASE("ojakv: error paths", "[ojakv]") {
  using kvscore::oja::RankRule;
  const std::int64_t d = 8;
  CHECK_THROWS_AS(OjaBasis::random(d, 9, 1), std::invalid_argument);
  CHECK_THROWS_WITH(OjaBasis::random(d, 9, 1), Contains("rank must be in [1, head_dim = 8] (got 9)"));
  CHECK_THROWS_WITH(OjaBasis::random(d, 0, 1), Contains("(got 0)"));
  CHECK_THROWS_WITH(OjaBasis::random(0, 1, 1), Contains("head_dim"));
  Mat nan_u = kvscore::oja::random_orthonormal(d, 2, 1);
  nan_u(3, 1) = std::nan("");
  CHECK_THROWS_WITH(OjaBasis(nan_u), Contains("NaN"));
  CHECK_THROWS_WITH(OjaBasis(Mat::Ones(d, 2)), Contains("not orthonormal"));
  OjaOptions o;
  o.pool = 0;
  CHECK_THROWS_WITH(OjaBasis::random(d, 2, 1, o), Contains("pool must be >= 1 (got 0)"));
  o = {};
  o.period = -1;
  CHECK_THROWS_WITH(OjaBasis::random(d, 2, 1, o), Contains("period"));
  o = {};
  o.eta_prefill = std::nan("");
  CHECK_THROWS_WITH(OjaBasis::random(d, 2, 1, o), Contains("eta_prefill"));
  o = {};
  o.eta_decode = 0;
  CHECK_THROWS_WITH(OjaBasis::random(d, 2, 1, o), Contains("eta_decode"));
  o = {};
  o.prefill_iterations = 0;
  CHECK_THROWS_WITH(OjaBasis::random(d, 2, 1, o), Contains("prefill_iterations"));

  // Empty buffers / empty data.
  OjaBasis b = OjaBasis::random(d, 2, 1);
  const std::vector<float> none;
  CHECK_THROWS_WITH(b.prefill(KeysView<float>(nullptr, 1, 0, d, 0, d), 0), Contains("no rows (0 tokens)"));
  CHECK_THROWS_WITH(b.flush(), Contains("decode buffer is empty"));
  const std::vector<float> rows(std::size_t(4 * d), 1.f);
  CHECK_THROWS_WITH(b.prefill(KeysView<float>(rows.data(), 1, 4, 4, 16, 4), 0), Contains("head_dim 4"));
  CHECK_THROWS_WITH(b.prefill(one_head(rows, 4, d), 1), Contains("head 1 out of range"));
  CHECK_THROWS_WITH(b.push(static_cast<const float*>(nullptr)), Contains("null"));

  // Calibration.
  std::vector<float> cal = to_f32(gaussian(20, d, 2));
  CHECK_THROWS_WITH(OjaBasis::calibrate({{cal.data(), 20}}, d, RankRule::energy_fraction(0.0)), Contains("(0, 1]"));
  CHECK_THROWS_WITH(OjaBasis::calibrate({{cal.data(), 20}}, d, RankRule::energy_fraction(1.5)), Contains("got 1.5"));
  CHECK_THROWS_WITH(OjaBasis::calibrate({{cal.data(), 20}}, d, RankRule::fixed(9)), Contains("got 9"));
  CHECK_THROWS_WITH(OjaBasis::calibrate({{cal.data(), 0}}, d, RankRule::fixed(2)), Contains("0 rows"));
  CHECK_THROWS_WITH(OjaBasis::calibrate({{cal.data(), 3}}, d, RankRule::fixed(4)), Contains("exceeds the 3 singular vectors"));
  cal[13] = kNaN;
  CHECK_THROWS_WITH(OjaBasis::calibrate({{cal.data(), 20}}, d, RankRule::fixed(2)), Contains("[row 1, dim 5]"));

  // Residual scorer.
  std::vector<float> q = to_f32(gaussian(4, d, 3));
  const std::vector<Mat> u1{kvscore::oja::random_orthonormal(d, 2, 4)};
  const std::vector<Mat> u2{u1[0], u1[0]};
  CHECK_THROWS_WITH(kvscore::OjaResidual(q.data(), 3, 1, d, u2), Contains("q_heads 3 is not a multiple of the 2 bases"));
  q[9] = kNaN;
  CHECK_THROWS_WITH(kvscore::OjaResidual(q.data(), 1, 4, d, u1), Contains("query value nan at [head 0, query 1, dim 1]"));
  q[9] = 0;
  CHECK_THROWS_WITH(kvscore::OjaResidual(q.data(), 1, 4, d, {}), Contains("0 bases"));
  CHECK_THROWS_WITH(kvscore::OjaResidual(q.data(), 1, 4, d, {Mat::Zero(d + 1, 2)}), Contains("basis 0 is 9 x 2"));
  const kvscore::OjaResidual sc(q.data(), 1, 4, d, u1);
  CHECK_THROWS_WITH(sc.score(one_head(rows, 3, d)), Contains("window 4 > tokens 3"));
  CHECK_THROWS_WITH(sc.score(KeysView<float>(rows.data(), 2, 2, d, 2 * d, d)), Contains("2 heads but there are 1 bases"));

  // Metrics.
  CHECK_THROWS_WITH(kvscore::residual_energy_ratio(Mat::Zero(3, d), u1[0]), Contains("zero energy"));
  CHECK_THROWS_WITH(kvscore::residual_energy_ratio(Mat::Ones(3, d + 1), u1[0]), Contains("9 columns"));
  Mat xn = Mat::Ones(3, d);
  xn(1, 1) = std::nan("");
  CHECK_THROWS_WITH(kvscore::residual_energy_ratio(xn, u1[0]), Contains("NaN"));
  CHECK_THROWS_WITH(kvscore::subspace_overlap(u1[0], Mat::Identity(d + 1, 2)), Contains("8 and 9 rows"));

  // Hybrid cache.
  const std::vector<OjaProjector> proj{OjaProjector::random(d, 2, 2, 5)};
  kvscore::Selection sel;
  sel.heads = 1;
  sel.tokens = 4;
  sel.offsets = {0, 2};
  sel.positions = {2, 1};
  CHECK_THROWS_WITH(kvscore::OjaHybridCache::build(proj, one_head(rows, 4, d), one_head(rows, 4, d), sel),
                    Contains("position 1 is out of range or not ascending"));
  sel.tokens = 5;
  CHECK_THROWS_WITH(kvscore::OjaHybridCache::build(proj, one_head(rows, 4, d), one_head(rows, 4, d), sel),
                    Contains("selection is for (1 heads, 5 tokens)"));
  CHECK_THROWS_WITH(kvscore::OjaHybridCache::build(proj, one_head(rows, 4, d), one_head(rows, 3, d), sel),
                    Contains("do not match keys"));
  CHECK_THROWS_WITH(OjaProjector(OjaBasis::random(d, 2, 1), OjaBasis::random(d + 1, 2, 1)), Contains("head_dim 8"));
}

TEST_CASE("ojakv: numpy goldens (one pooled Oja step, residual scores, RER, SO)", "[ojakv]") {
  // tests/data/ojakv/ from tools/gen_ojakv_fixtures.py (see its docstring for the definitions).
  namespace npy = kvscore::npy;
  const std::string dir = std::string(KVSCORE_TEST_DATA_DIR) + "/ojakv/";
  const npy::Array keys = npy::load(dir + "keys.npy"), u0 = npy::load(dir + "u0.npy"), u1 = npy::load(dir + "u1.npy");
  const npy::Array q = npy::load(dir + "queries.npy"), sc = npy::load(dir + "scores.npy");
  const npy::Array rer = npy::load(dir + "rer.npy"), so = npy::load(dir + "so.npy");
  const std::int64_t H = 2, N = 48, d = 16, r = 4, Hq = 4, w = 6;  // params.json
  REQUIRE(keys.shape == std::vector<std::int64_t>{H, N, d});
  REQUIRE(u0.shape == std::vector<std::int64_t>{H, d, r});
  REQUIRE(q.shape == std::vector<std::int64_t>{Hq, w, d});
  const KeysView<float> view(keys.as<float>(), H, N, d, N * d, d);
  auto basis = [&](const npy::Array& a, std::int64_t h) {
    return Mat(Eigen::Map<const Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
        a.as<double>() + h * d * r, d, r));
  };
  OjaOptions o;
  o.pool = 2;
  o.eta_prefill = 0.7;
  o.prefill_iterations = 1;
  std::vector<Mat> start;
  for (std::int64_t h = 0; h < H; ++h) {
    start.push_back(basis(u0, h));
    OjaBasis b(start.back(), o);
    CHECK(b.prefill(view, h) == (h == 1 ? N - 1 : N));  // one NaN row in head 1
    CHECK((b.basis() - basis(u1, h)).cwiseAbs().maxCoeff() < 1e-9);
    Mat x(0, d);
    for (std::int64_t t = 0; t < N; ++t) {
      if (h == 1 && t == 5) continue;
      x.conservativeResize(x.rows() + 1, d);
      for (std::int64_t j = 0; j < d; ++j) x(x.rows() - 1, j) = keys.as<float>()[(h * N + t) * d + j];
    }
    CHECK(kvscore::residual_energy_ratio(x, basis(u1, h)) == Approx(rer.as<double>()[h]).epsilon(1e-12));
    CHECK(kvscore::subspace_overlap(basis(u1, h), basis(u0, h)) == Approx(so.as<double>()[h]).epsilon(1e-12));
  }
  const kvscore::Scores s = kvscore::OjaResidual(q.as<float>(), Hq, w, d, start).score(view);
  for (std::int64_t i = 0; i < H * N; ++i) {
    const double e = sc.as<double>()[i];
    INFO("flat index " << i);
    if (std::isinf(e)) CHECK(s.data()[i] == kvscore::kInvalidScore);
    else CHECK(double(s.data()[i]) == Approx(e).epsilon(2e-7));
  }
}

TEST_CASE("ojakv: rebase re-expresses the codes in an updated basis", "[ojakv]") {
  const std::int64_t n = 120, d = 24, r = 6;
  const std::vector<float> k = to_f32(gaussian(n, d, 111)), v = to_f32(gaussian(n, d, 112));
  const OjaProjector p0 = OjaProjector::random(d, r, r, 113);
  kvscore::Selection sel;
  sel.heads = 1;
  sel.tokens = n;
  sel.offsets = {0, 2};
  sel.positions = {3, 50};
  auto cache = kvscore::OjaHybridCache::build(std::vector<OjaProjector>{p0}, one_head(k, n, d), one_head(v, n, d), sel);
  const kvscore::oja::RowMajorF k0 = cache.reconstruct_keys(0), v0 = cache.reconstruct_values(0);
  // A basis that contains the old subspace (old columns + 2 new ones): nothing is lost.
  const Mat extra = gram_schmidt((Mat::Identity(d, d) - p0.key().basis() * p0.key().basis().transpose()) * gaussian(d, 2, 114));
  Mat wider(d, r + 2);
  wider << p0.key().basis(), extra;
  OjaProjector p1(OjaBasis(wider), p0.value());
  cache.rebase(0, p1);
  CHECK(cache.head(0).codes_k.cols() == r + 2);
  const kvscore::oja::RowMajorF k1 = cache.reconstruct_keys(0);
  CHECK((k1 - k0).cwiseAbs().maxCoeff() < 1e-5f);
  CHECK((cache.reconstruct_values(0) - v0).cwiseAbs().maxCoeff() < 1e-5f);
  // An unrelated basis: the reconstruction becomes the projection of the old one onto it.
  const OjaProjector p2 = OjaProjector::random(d, r, r, 115);
  cache.rebase(0, p2);
  const kvscore::oja::RowMajorF k2 = cache.reconstruct_keys(0);
  const Eigen::MatrixXd u2 = p2.key().basis();
  for (std::int64_t t = 0; t < n; ++t) {
    Eigen::VectorXd expect = k0.row(t).transpose().cast<double>();
    if (t != 3 && t != 50) expect = u2 * (u2.transpose() * expect);  // anchors stay exact
    for (std::int64_t j = 0; j < d; ++j) CHECK(double(k2(t, j)) == Approx(expect(j)).margin(1e-5));
  }
  CHECK_THROWS_WITH(cache.rebase(1, p2), Contains("head 1 out of range"));
  CHECK_THROWS_WITH(cache.rebase(0, OjaProjector::random(d + 1, r, r, 1)), Contains("head_dim 25"));
}

TEST_CASE("ojakv: codes and reconstructions run on the pinned kernel table (every table, the unpinned run)",
          "[ojakv][simd]") {
  namespace simd = kvscore::simd;
  const std::int64_t n = 45, d = 33, r = 5, T = 6;  // odd d, n % 4 != 0, blocks that close and one left open
  OjaOptions oo;
  oo.period = T;
  const std::vector<float> k = to_f32(gaussian(n + 16, d, 91)), v = to_f32(gaussian(n + 16, d, 92));
  const std::vector<OjaProjector> proj0{OjaProjector::random(d, r, r + 2, 93, oo)};
  const kvscore::Selection sel = [&] {  // every 7th token at full rank
    kvscore::Selection s;
    s.heads = 1;
    s.tokens = n;
    s.offsets = {0};
    for (std::int64_t t = 3; t < n; t += 7) s.positions.push_back(t);
    s.offsets.push_back(std::int64_t(s.positions.size()));
    return s;
  }();
  struct Run {
    kvscore::oja::RowMajorF khat, vhat, codes_k;
    std::vector<double> att;
  };
  auto run = [&] {
    std::vector<OjaProjector> proj = proj0;
    auto c = kvscore::OjaHybridCache::build(proj, one_head(k, n, d), one_head(v, n, d), sel);
    Run out{{}, {}, c.head(0).codes_k, {}};
    for (std::int64_t s = 0; s < 16; ++s)  // 2 closed blocks + 4 open tokens
      c.append(proj, k.data() + (n + s) * d, v.data() + (n + s) * d, k.data() + (n + s) * d, 1);
    out.khat = c.reconstruct_keys(0);
    out.vhat = c.reconstruct_values(0);
    out.att = c.attention(0, k.data() + 5 * d);
    return out;
  };
  // the build's codes against an fp64 product of the low-rank rows with the fp32 basis
  const Run ref = run();
  const Eigen::MatrixXd uk = proj0[0].key().basis_f32().cast<double>();
  for (std::int64_t t = 0, b = 0; t < n; ++t) {
    if ((t - 3) % 7 == 0 && t >= 3) continue;
    const Eigen::RowVectorXd x = Eigen::Map<const kvscore::oja::RowMajorF>(k.data() + t * d, 1, d).cast<double>();
    const Eigen::RowVectorXd want = x * uk;
    for (std::int64_t j = 0; j < r; ++j) CHECK(std::abs(double(ref.codes_k(b, j)) - want(j)) < 1e-5);
    ++b;
  }
  REQUIRE(ref.codes_k.rows() == n - std::int64_t(sel.positions.size()));
  const std::string before = simd::active_table().name;
  for (const simd::KernelTable* t : simd::available_tables()) {
    INFO("table " << t->name);
    simd::set_active_isa(t->name);
    const Run got = run();
    REQUIRE(got.khat.rows() == ref.khat.rows());
    CHECK((got.codes_k - ref.codes_k).cwiseAbs().maxCoeff() < 2e-5);
    CHECK((got.khat - ref.khat).cwiseAbs().maxCoeff() < 2e-5);
    CHECK((got.vhat - ref.vhat).cwiseAbs().maxCoeff() < 2e-5);
    for (std::int64_t j = 0; j < d; ++j) CHECK(std::abs(got.att[std::size_t(j)] - ref.att[std::size_t(j)]) < 2e-5);
  }
  simd::set_active_isa(before);
}
