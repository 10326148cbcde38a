// kvscore/ojakv/ojakv.hpp — OjaKV (ojakv.txt): an online low-rank projector per KV head plus a
// hybrid cache that keeps the tokens with the largest query-weighted residual at full rank.
//
//   OjaBasis      one orthonormal basis U (d x r): seeded random start or calibration (SVD),
//                 prefill update (average pooling over p tokens, then Oja's batch rule
//                 U <- U + eta (C U - U U^T C U), C = X^T X / m, QR after every step), decode
//                 buffer with an update every T tokens.
//   OjaProjector  U_k and U_v of one KV head (two OjaBasis).
//   OjaResidual   the full-rank score e_t = mean_{q in W_t} |q^T (k_t - U U^T k_t)| / sqrt(d)
//                 [heads][tokens] (higher = keep full rank); pass it to kvscore::select.
//   OjaHybridCache  (kvscore/ojakv/cache.hpp) codes K~ = K U_k, V~ = V U_v for most tokens,
//                 full rows for the selected ones; reconstruction, reference attention,
//                 memory accounting; append() during generation.
//   residual_energy_ratio / subspace_overlap: RER and SO of ojakv.txt §4.
//
// Decisions (docs/methods/ojakv.md): eta is relative to lambda1(C) (power iteration), so the same
// value works for keys of any magnitude; the prefill runs up to 32 steps at eta 1.5 and stops
// early when the step is below 1e-7; decode runs one step at eta 0.1 every T = 128 tokens on
// the pooled buffer. Invalid rows (fp32 squared norm not finite, the project-wide rule) are
// left out of every covariance and pooled mean, score -inf, and are masked out of the
// reference attention. Numerics: covariances, bases and updates in fp64; the stored bases
// and codes are fp32.
// Errors: std::invalid_argument naming the offending value.
// Why this file is long (~520 lines): the projectors (build, Oja update, rebase) and the
// residual rule are one method's maths; the store lives apart (ojakv/cache.hpp), the fp64
// definitions in ojakv_impl.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Dense>

#include "kvscore/detail/compiled.hpp"
#include "kvscore/core/splitmix.hpp"
#include "kvscore/scorers/scorer_base.hpp"
#include "kvscore/select.hpp"
#include "kvscore/core/selection.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore {

namespace oja {

// ------------------------------------------------------------------ random numbers

/// The library's splitmix64 (kvscore/core/splitmix.hpp) with OjaKV's conversions
/// (std::normal_distribution is implementation-defined).
struct SplitMix64 : kvscore::detail::SplitMix64 {
  using kvscore::detail::SplitMix64::SplitMix64;
  /// Uniform in (0, 1]: the top 53 bits, +1, times 2^-53 (never 0, so log() is finite).
  double uniform() noexcept { return uniform_nonzero(); }
  /// Standard normal by Box–Muller (both values of a pair are used).
  double gaussian() noexcept {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = uniform(), u2 = uniform();
    const double rad = std::sqrt(-2.0 * std::log(u1)), ang = 6.283185307179586476925 * u2;
    spare_ = rad * std::sin(ang);
    has_spare_ = true;
    return rad * std::cos(ang);
  }

 private:
  double spare_ = 0;
  bool has_spare_ = false;
};

using Mat = Eigen::MatrixXd;  ///< fp64 matrix of the numerics (bases, covariances)
/// An fp32 row-major matrix (codes and rows of the store).
using RowMajorF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// \cond INTERNAL
inline std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}
/// \endcond

/// Thin Q of A (d x r, r <= d) by Householder QR, each column's sign chosen so that
/// diag(R) >= 0: the factorisation is then unique, and an orthonormal A comes back as itself.
Mat orthonormalize(const Mat& a);

/// \cond INTERNAL
inline void check_rank(const char* who, std::int64_t d, std::int64_t r) {
  if (d <= 0 || d > kMaxHeadDim)
    detail::throw_invalid(std::string(who) + ": head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " +
                          std::to_string(d) + ")");
  if (r < 1 || r > d)
    detail::throw_invalid(std::string(who) + ": rank must be in [1, head_dim = " + std::to_string(d) + "] (got " +
                          std::to_string(r) + ")");
}
/// \endcond

/// A seeded random orthonormal d x r matrix: QR of an i.i.d. N(0, 1) matrix (filled column
/// by column from splitmix64 + Box–Muller), signs as in orthonormalize().
Mat random_orthonormal(std::int64_t d, std::int64_t r, std::uint64_t seed);

/// max |U^T U - I| (0 for an exactly orthonormal U).
double orthonormality_error(const Mat& u);

/// Estimate of lambda1 of a symmetric PSD matrix: the largest Rayleigh quotient of 32 power
/// iterations from a seeded random start, never below max diag(C) nor, when a basis U is
/// given, max_j u_j^T C u_j (every one a lower bound of lambda1). 0 for C = 0. (A start on a
/// coordinate axis — e.g. the column of the largest diagonal — is an eigenvector of a small
/// eigenvalue when that channel is isolated, and the estimate then stays there: docs/methods/ojakv.md.)
double top_eigenvalue(const Mat& c, const Mat* u = nullptr);

/// Oja's batch rule, `iterations` times: U <- orth(U + (eta/lambda1(C)) (C U - U U^T C U)).
/// Stops early when max |step| <= tol. Returns the steps taken. C = 0 leaves U unchanged.
int oja_steps(Mat& u, const Mat& c, double eta, int iterations, double tol);

/// Which rank a calibration keeps: a fixed r, or the smallest r whose top-r singular values
/// hold at least a fraction `energy` of the squared Frobenius norm (ojakv.txt A.3).
struct RankRule {
  std::int64_t rank = 0;  ///< > 0: fixed rank
  double energy = 0;      ///< used when rank == 0: threshold in (0, 1]
  static RankRule fixed(std::int64_t r) noexcept { return {r, 0.0}; }  ///< a fixed rank r
  /// The smallest rank holding `eps` of the energy.
  static RankRule energy_fraction(double eps) noexcept { return {0, eps}; }
};

/// Rank chosen by `rule` from squared singular values s2 (descending).
std::int64_t rank_from_energy(const Eigen::VectorXd& s2, double eps);

/// Top right singular vectors of the stacked sample rows (each block [n_i][d] row-major fp32),
/// rank chosen by `rule`. Non-finite samples throw.
Mat calibrate(const std::vector<std::pair<const float*, std::int64_t>>& blocks, std::int64_t d,
              RankRule rule, const char* who);

/// The project-wide validity rule: a row's squared norm (accumulated in fp64) is finite and fits
/// fp32 (<= FLT_MAX).
inline bool row_ok(double squared_norm) noexcept {
  return std::isfinite(squared_norm) && squared_norm <= double(std::numeric_limits<float>::max());
}

/// Widens a row to fp64 into `out`; true when it is valid (row_ok).
template <class T>
inline bool widen_row(const T* row, std::int64_t d, double* out) noexcept {
  double s = 0;
  for (std::int64_t j = 0; j < d; ++j) {
    out[j] = double(to_float(row[j]));
    s += out[j] * out[j];
  }
  return row_ok(s);
}

/// \cond INTERNAL
/// Accumulates rows into the pooled covariance: rows of the same window of p consecutive
/// tokens are averaged (invalid rows left out), then C += X_b^T X_b per block of 128 pooled
/// rows (a rank-128 update is a GEMM; rank-1 updates would be memory-bound).
struct PooledCovariance {
  static constexpr Eigen::Index kBlock = 128;
  std::int64_t d, p;
  Mat c;
  Mat block;  // [kBlock][d] pooled rows waiting for the rank-k update
  Eigen::VectorXd acc;
  Eigen::Index in_block = 0;
  std::int64_t window = -1, in_window = 0, pooled = 0, valid = 0;
  PooledCovariance(std::int64_t d_, std::int64_t p_)
      : d(d_), p(p_), c(Mat::Zero(d_, d_)), block(kBlock, d_), acc(Eigen::VectorXd::Zero(d_)) {}
  void flush_block();
  void flush();
  /// Row of token t (tokens arrive in increasing order).
  void add(std::int64_t t, const double* row, bool ok);
  /// C = X^T X / m over the pooled rows (full symmetric); zero when no row was valid.
  Mat finish();
};
/// \endcond

}  // namespace oja

// ------------------------------------------------------------------ metrics

/// RER = ||X - X U U^T||_F^2 / ||X||_F^2 (ojakv.txt §4). X: n x d rows, U: d x r orthonormal.
double residual_energy_ratio(const Eigen::MatrixXd& x, const Eigen::MatrixXd& u);

/// SO(U1, U2) = tr(U1^T U2 U2^T U1) / r, r = columns of U1 (ojakv.txt §4); 1 = same subspace.
double subspace_overlap(const Eigen::MatrixXd& u1, const Eigen::MatrixXd& u2);

// ------------------------------------------------------------------ one basis

/// Parameters of the online updates (docs/methods/ojakv.md lists the source of every default).
struct OjaOptions {
  double eta_prefill = 1.5;     ///< prefill step, relative to lambda1 of the pooled covariance
  int prefill_iterations = 32;  ///< most prefill steps (each followed by QR)
  double tolerance = 1e-7;      ///< prefill stops once max |step| <= tolerance
  double eta_decode = 0.1;      ///< decode step, relative to lambda1 of the buffer's covariance
  int decode_iterations = 1;    ///< steps per decode update
  std::int64_t pool = 4;        ///< p: average pooling window (tokens), prefill and decode buffer
  std::int64_t period = 128;    ///< T: decode tokens per update

  /// The paper's prefill (ojakv.txt Alg. 1, lines 3-4; η = 0.10 in its Table of settings): one
  /// step at η = 0.10 from a calibrated start, instead of converging to the prompt's principal
  /// subspace (the default: up to 32 steps at 1.5). η stays relative to λ̂1, kvscore's
  /// normalisation, so the step does not depend on the keys' scale. docs/methods/ojakv.md compares them.
  static OjaOptions paper() noexcept {
    OjaOptions o;
    o.eta_prefill = 0.10;
    o.prefill_iterations = 1;
    return o;
  }

  /// Throws std::invalid_argument (naming `who`) for an option out of range.
  void validate(const char* who) const {
    auto bad = [&](const std::string& what) { detail::throw_invalid(std::string(who) + ": " + what); };
    if (!(eta_prefill > 0 && std::isfinite(eta_prefill))) bad("eta_prefill must be > 0 and finite (got " + oja::num(eta_prefill) + ")");
    if (!(eta_decode > 0 && std::isfinite(eta_decode))) bad("eta_decode must be > 0 and finite (got " + oja::num(eta_decode) + ")");
    if (prefill_iterations < 1) bad("prefill_iterations must be >= 1 (got " + std::to_string(prefill_iterations) + ")");
    if (decode_iterations < 1) bad("decode_iterations must be >= 1 (got " + std::to_string(decode_iterations) + ")");
    if (!(tolerance >= 0)) bad("tolerance must be >= 0 (got " + oja::num(tolerance) + ")");
    if (pool < 1) bad("pool must be >= 1 (got " + std::to_string(pool) + ")");
    if (period < 1) bad("period must be >= 1 (got " + std::to_string(period) + ")");
  }
};

/// One orthonormal basis U (d x r) tracked with Oja's rule.
class OjaBasis {
 public:
  /// From a given d x r basis (e.g. offline PCA); must be finite and orthonormal to 1e-6.
  explicit OjaBasis(Eigen::MatrixXd u, OjaOptions opt = {}) : u_(std::move(u)), opt_(opt) {
    const char* who = "kvscore::OjaBasis";
    opt_.validate(who);
    oja::check_rank(who, u_.rows(), u_.cols());
    if (!u_.allFinite()) detail::throw_invalid(std::string(who) + ": basis holds a NaN or Inf");
    const double e = oja::orthonormality_error(u_);
    if (!(e <= 1e-6))
      detail::throw_invalid(std::string(who) + ": basis is not orthonormal (max |U^T U - I| = " + oja::num(e) + " > 1e-6)");
    buffer_.reserve(std::size_t(opt_.period * u_.rows()));
  }

  /// Seeded random start (ojakv.txt leaves the start open when no calibration data exists).
  static OjaBasis random(std::int64_t d, std::int64_t r, std::uint64_t seed, OjaOptions opt = {}) {
    return OjaBasis(oja::random_orthonormal(d, r, seed), opt);
  }

  /// Calibration (ojakv.txt A.3): top right singular vectors of the stacked sample rows
  /// `blocks` (each {pointer to [n][d] row-major fp32, n}); for keys pass {queries, keys}.
  static OjaBasis calibrate(const std::vector<std::pair<const float*, std::int64_t>>& blocks, std::int64_t d,
                            oja::RankRule rule, OjaOptions opt = {}) {
    return OjaBasis(oja::calibrate(blocks, d, rule, "kvscore::OjaBasis::calibrate"), opt);
  }

  std::int64_t head_dim() const noexcept { return std::int64_t(u_.rows()); }  ///< d, rows of U
  std::int64_t rank() const noexcept { return std::int64_t(u_.cols()); }  ///< r, columns of U
  const Eigen::MatrixXd& basis() const noexcept { return u_; }  ///< U, d x r, orthonormal
  Eigen::MatrixXf basis_f32() const { return u_.cast<float>(); }  ///< U in fp32
  const OjaOptions& options() const noexcept { return opt_; }  ///< the basis's options
  /// Decode tokens waiting in the buffer (< period).
  std::int64_t buffered() const noexcept { return buffered_; }
  /// Decode updates done so far.
  std::int64_t decode_updates() const noexcept { return updates_; }

  /// Prefill update from head h of `rows` (a KeysView over keys or values, any layout and
  /// element type): pool over p tokens, C = X^T X / m, Oja steps at eta_prefill, QR.
  /// Returns the number of valid rows used; with none (all rows invalid) U is unchanged.
  /// An empty view (0 tokens) throws: there is nothing to learn from.
  template <KeyCacheView View>
  std::int64_t prefill(const View& rows, std::int64_t h) {
    const char* who = "kvscore::OjaBasis::prefill";
    check_view(rows, h, who);
    oja::PooledCovariance pc(head_dim(), opt_.pool);
    std::vector<double> tmp(static_cast<std::size_t>(head_dim()));
    rows.for_each_run(h, [&](const typename View::value_type* first, std::int64_t t0, std::int64_t n,
                             std::int64_t stride) {
      for (std::int64_t i = 0; i < n; ++i) {
        const bool ok = oja::widen_row(first + i * stride, head_dim(), tmp.data());
        pc.add(t0 + i, tmp.data(), ok);
      }
    });
    const Eigen::MatrixXd c = pc.finish();
    last_steps_ = oja::oja_steps(u_, c, opt_.eta_prefill, opt_.prefill_iterations, opt_.tolerance);
    return pc.valid;
  }

  /// Decode: append one row (d elements) to the buffer; every `period` calls the buffer is
  /// pooled, one update at eta_decode runs, and the buffer clears. Returns true when this
  /// call updated U. Invalid rows count towards the period but are left out of the update.
  template <class T>
  bool push(const T* row) {
    static_assert(is_element_type_v<T>, "OjaBasis::push: T must be float, half or bfloat16");
    if (row == nullptr) detail::throw_invalid("kvscore::OjaBasis::push: row is null");
    const std::size_t at = buffer_.size();
    buffer_.resize(at + std::size_t(head_dim()));
    valid_.push_back(oja::widen_row(row, head_dim(), buffer_.data() + at) ? 1 : 0);
    ++buffered_;
    if (buffered_ < opt_.period) return false;
    update_from_buffer();
    return true;
  }

  /// Runs the decode update on what is buffered now (fewer than `period` rows) and clears
  /// the buffer. Throws when the buffer is empty.
  void flush() {
    if (buffered_ == 0) detail::throw_invalid("kvscore::OjaBasis::flush: the decode buffer is empty (0 rows)");
    update_from_buffer();
  }

  /// Keeps the first `keep` buffered rows, keep in [0, buffered()]: the rows of decode tokens
  /// a generation drops again (OjaHybridCache::crop) leave the next update too.
  void drop_buffered(std::int64_t keep) {
    if (keep < 0 || keep > buffered_)
      detail::throw_invalid("kvscore::OjaBasis::drop_buffered: keep " + std::to_string(keep) + " out of range [0, " +
                            std::to_string(buffered_) + "]");
    buffer_.resize(std::size_t(keep * head_dim()));
    valid_.resize(std::size_t(keep));
    buffered_ = keep;
  }

  /// Steps taken by the last update (prefill: early stop may make it < prefill_iterations).
  int last_steps() const noexcept { return last_steps_; }

 private:
  template <class View>
  void check_view(const View& rows, std::int64_t h, const char* who) const {
    if (rows.head_dim() != head_dim())
      detail::throw_invalid(std::string(who) + ": rows have head_dim " + std::to_string(rows.head_dim()) +
                            " but the basis has head_dim " + std::to_string(head_dim()));
    if (h < 0 || h >= rows.heads())
      detail::throw_invalid(std::string(who) + ": head " + std::to_string(h) + " out of range [0, " +
                            std::to_string(rows.heads()) + ")");
    if (rows.tokens() == 0) detail::throw_invalid(std::string(who) + ": no rows (0 tokens)");
  }

  void update_from_buffer() {
    oja::PooledCovariance pc(head_dim(), opt_.pool);
    for (std::int64_t i = 0; i < buffered_; ++i)
      pc.add(i, buffer_.data() + i * head_dim(), valid_[std::size_t(i)] != 0);
    const Eigen::MatrixXd c = pc.finish();
    last_steps_ = oja::oja_steps(u_, c, opt_.eta_decode, opt_.decode_iterations, 0.0);
    buffer_.clear();
    valid_.clear();
    buffered_ = 0;
    ++updates_;
  }

  Eigen::MatrixXd u_;
  OjaOptions opt_;
  std::vector<double> buffer_;
  std::vector<unsigned char> valid_;
  std::int64_t buffered_ = 0, updates_ = 0;
  int last_steps_ = 0;
};

/// U_k and U_v of one KV head.
class OjaProjector {
 public:
  /// The projector of a key basis and a value basis of the same head_dim (std::invalid_argument otherwise).
  OjaProjector(OjaBasis key, OjaBasis value) : k_(std::move(key)), v_(std::move(value)) {
    if (k_.head_dim() != v_.head_dim())
      detail::throw_invalid("kvscore::OjaProjector: key basis has head_dim " + std::to_string(k_.head_dim()) +
                            " but value basis has " + std::to_string(v_.head_dim()));
  }
  /// Seeded random starts (the value basis uses seed + 1).
  static OjaProjector random(std::int64_t d, std::int64_t rk, std::int64_t rv, std::uint64_t seed, OjaOptions opt = {}) {
    return OjaProjector(OjaBasis::random(d, rk, seed, opt), OjaBasis::random(d, rv, seed + 1, opt));
  }
  /// Calibration (ojakv.txt A.3): U_k from the stacked query and key rows, U_v from the value rows.
  static OjaProjector calibrate(const float* queries, std::int64_t nq, const float* keys, std::int64_t nk,
                                const float* values, std::int64_t nv, std::int64_t d, oja::RankRule key_rank,
                                oja::RankRule value_rank, OjaOptions opt = {}) {
    return OjaProjector(OjaBasis::calibrate({{queries, nq}, {keys, nk}}, d, key_rank, opt),
                        OjaBasis::calibrate({{values, nv}}, d, value_rank, opt));
  }

  OjaBasis& key() noexcept { return k_; }  ///< the key basis U_k
  OjaBasis& value() noexcept { return v_; }  ///< the value basis U_v
  const OjaBasis& key() const noexcept { return k_; }  ///< the key basis U_k
  const OjaBasis& value() const noexcept { return v_; }  ///< the value basis U_v
  std::int64_t head_dim() const noexcept { return k_.head_dim(); }  ///< dimensions of a key and a value

  /// Prefill update of both bases from head h of the keys and values.
  template <KeyCacheView KView, KeyCacheView VView>
  void prefill(const KView& keys, const VView& values, std::int64_t h) {
    k_.prefill(keys, h);
    v_.prefill(values, h);
  }
  /// Decode: one new (k, v); true when the bases were updated.
  template <class T>
  bool push(const T* k, const T* v) {
    const bool a = k_.push(k);
    const bool b = v_.push(v);
    return a || b;
  }

 private:
  OjaBasis k_, v_;
};

// ------------------------------------------------------------------ full-rank score

/// e_t = 1/|W_t| Σ_{(g,i) ∈ W_t} |q_{g,i}^T (k_t − U_k U_k^T k_t)| / √d (ojakv.txt §5.1), higher =
/// keep at full rank. W_t: the group's window queries that see t (query i of w sits at position
/// N − w + i, causal; with `placement = QueryPlacement::after_cache` every query sees every t). Invalid keys score −inf. Feed it to kvscore::select (sinks, recent,
/// budgets, AdaKV work as for any scorer). A full-rank basis (r = head_dim) loses nothing:
/// k − UUᵀk is 0, so every valid key of that head scores exactly 0 (not the rounding noise the
/// product would give, which differs between CPU and GPU) and the selector's tie rule keeps the
/// lowest positions.
class OjaResidual : public ScorerOptions, public detail::AllocatingScore<OjaResidual> {
 public:
  using detail::AllocatingScore<OjaResidual>::score;

  static constexpr const char* name = "ojakv-residual";  ///< the name benchmarks and errors use

  /// queries: [q_heads][window][head_dim] row-major fp32 (copied); bases: U_k per KV head
  /// (d x r, orthonormal). GQA group = q_heads / kv_heads (contiguous, HF repeat_kv order).
  OjaResidual(const float* queries, std::int64_t q_heads, std::int64_t window, std::int64_t head_dim,
              std::vector<Eigen::MatrixXd> bases)
      : bases_(std::move(bases)), q_heads_(q_heads), window_(window), dim_(head_dim) {
    const std::string who = "kvscore::OjaResidual: ";
    if (head_dim <= 0 || head_dim > kMaxHeadDim)
      detail::throw_invalid(who + "head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " +
                            std::to_string(head_dim) + ")");
    if (q_heads <= 0) detail::throw_invalid(who + "q_heads must be > 0 (got " + std::to_string(q_heads) + ")");
    if (window <= 0) detail::throw_invalid(who + "window must be > 0 (got " + std::to_string(window) + ")");
    if (queries == nullptr) detail::throw_invalid(who + "queries is null");
    const std::int64_t kv = std::int64_t(bases_.size());
    if (kv == 0 || q_heads % kv != 0)
      detail::throw_invalid(who + "q_heads " + std::to_string(q_heads) + " is not a multiple of the " +
                            std::to_string(kv) + " bases (one per KV head)");
    for (std::size_t h = 0; h < bases_.size(); ++h) {
      const auto& u = bases_[h];
      if (u.rows() != head_dim || u.cols() < 1 || u.cols() > head_dim)
        detail::throw_invalid(who + "basis " + std::to_string(h) + " is " + std::to_string(u.rows()) + " x " +
                              std::to_string(u.cols()) + ", expected head_dim " + std::to_string(head_dim) +
                              " x rank in [1, head_dim]");
      if (!u.allFinite()) detail::throw_invalid(who + "basis " + std::to_string(h) + " holds a NaN or Inf");
    }
    const std::int64_t total = detail::checked_mul(detail::checked_mul(q_heads, window, name), head_dim, name);
    q_.resize(Eigen::Index(q_heads * window), Eigen::Index(head_dim));
    for (std::int64_t k = 0; k < total; ++k) {
      const float x = queries[k];
      if (!std::isfinite(x))
        detail::throw_invalid(who + "query value " + oja::num(x) + " at [head " + std::to_string(k / (window * head_dim)) +
                              ", query " + std::to_string((k / head_dim) % window) + ", dim " +
                              std::to_string(k % head_dim) + "] is not finite");
      q_(Eigen::Index(k / head_dim), Eigen::Index(k % head_dim)) = double(x);
    }
  }

  std::int64_t window() const noexcept { return window_; }  ///< queries per head
  /// The window to protect in the selector (`SelectOptions::recent`), as SnapKV and ProtoKV: the
  /// in-cache window's tokens are scored only by the queries after them; 0 after the cache.
  std::int64_t protected_recent() const noexcept { return placement == QueryPlacement::in_cache ? window_ : 0; }

  /// The queries are the cache's last `window` positions (default: causal, query i sees
  /// t <= N - w + i) or follow the cache (every query sees every key; any window size).
  QueryPlacement placement = QueryPlacement::in_cache;

  /// Throws std::invalid_argument unless score(keys) can run on these keys.
  template <KeyCacheView View>
  void check(const View& keys) const {
    const std::string who = "kvscore::OjaResidual: ";
    if (keys.heads() != std::int64_t(bases_.size()))
      detail::throw_invalid(who + "keys have " + std::to_string(keys.heads()) + " heads but there are " +
                            std::to_string(bases_.size()) + " bases");
    if (keys.head_dim() != dim_)
      detail::throw_invalid(who + "keys have head_dim " + std::to_string(keys.head_dim()) + ", queries " +
                            std::to_string(dim_));
    if (placement == QueryPlacement::in_cache && window_ > keys.tokens())
      detail::throw_invalid(who + "window " + std::to_string(window_) + " > tokens " + std::to_string(keys.tokens()) +
                            " (the window's queries sit at the last positions of the cache; set placement = "
                            "QueryPlacement::after_cache for queries that follow the cache)");
  }

  /// Scores `keys` into `out` ([kv_heads][tokens]): e_t, the query-weighted residual of each key off its head's
  /// basis.
  template <KeyCacheView View>
  void score(const View& keys, ScoresView out) const {
    detail::check_scores_shape(keys, out, name);
    check(keys);
    if (keys.heads() == 0 || keys.tokens() == 0) return;
    detail::for_each_head(keys.heads(), num_threads, [&](std::int64_t h) { score_head(keys, h, out.head(h)); });
  }

 private:
  static constexpr std::int64_t kChunk = 256;

  template <class View>
  void score_head(const View& keys, std::int64_t h, float* out) const noexcept {
    using T = typename View::value_type;
    const std::int64_t d = dim_, n = keys.tokens(), w = window_;
    const std::int64_t G = q_heads_ / std::int64_t(bases_.size());
    const std::int64_t P = placement == QueryPlacement::in_cache ? n - w : n;  // query i at P + i
    const Eigen::MatrixXd& u = bases_[std::size_t(h)];
    const auto qh = q_.middleRows(Eigen::Index(h * G * w), Eigen::Index(G * w));  // rows g*w + i
    const double inv_sqrt_d = 1.0 / std::sqrt(double(d));
    Eigen::MatrixXd k(kChunk, d);
    std::vector<unsigned char> ok(kChunk);
    const bool full_rank = u.cols() == d;  // the residual is 0 by definition
    keys.for_each_run(h, [&](const T* first, std::int64_t t0, std::int64_t len, std::int64_t stride) {
      for (std::int64_t c0 = 0; c0 < len; c0 += kChunk) {
        const std::int64_t m = std::min(kChunk, len - c0);
        std::vector<double> row(static_cast<std::size_t>(d));
        if (full_rank) {
          for (std::int64_t i = 0; i < m; ++i)
            out[t0 + c0 + i] = oja::widen_row(first + (c0 + i) * stride, d, row.data()) ? 0.f : kInvalidScore;
          continue;
        }
        for (std::int64_t i = 0; i < m; ++i) {
          ok[std::size_t(i)] = oja::widen_row(first + (c0 + i) * stride, d, row.data()) ? 1 : 0;
          for (std::int64_t j = 0; j < d; ++j) k(i, j) = ok[std::size_t(i)] ? row[std::size_t(j)] : 0.0;
        }
        const auto kb = k.topRows(m);
        // Stays in Eigen fp64 (not the fp32 project kernel): r_t is a difference of nearly equal
        // vectors when the basis fits, and fp32 would lose the residual the rule ranks by.
        const Eigen::MatrixXd res = kb - (kb * u) * u.transpose();  // r_t = k_t - U U^T k_t
        const Eigen::MatrixXd s = res * qh.transpose();            // [m][G*w]
        for (std::int64_t i = 0; i < m; ++i) {
          const std::int64_t t = t0 + c0 + i;
          if (!ok[std::size_t(i)]) {
            out[t] = kInvalidScore;
            continue;
          }
          const std::int64_t first_q = std::max<std::int64_t>(0, t - P);  // query i sees t iff P + i >= t
          double acc = 0;
          for (std::int64_t g = 0; g < G; ++g)
            for (std::int64_t qi = first_q; qi < w; ++qi) acc += std::abs(s(i, g * w + qi));
          out[t] = float(acc / double(G * (w - first_q)) * inv_sqrt_d);
        }
      }
    });
  }

  std::vector<Eigen::MatrixXd> bases_;
  Eigen::MatrixXd q_;
  std::int64_t q_heads_, window_, dim_;
};

}  // namespace kvscore

#if !defined(KVSCORE_COMPILED)
#include "kvscore/ojakv/ojakv_impl.hpp"
#endif

// The hybrid cache built on the projectors; included here so that `#include "kvscore/ojakv/ojakv.hpp"`
// gives the whole method, as it did before the split.
#include "kvscore/ojakv/cache.hpp"
