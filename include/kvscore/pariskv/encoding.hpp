// kvscore/pariskv/encoding.hpp — ParisKV's encoding primitives (pariskv.txt §4, App. B): the
// Lloyd–Max magnitude codebook, the seeded Walsh–Hadamard rotation, the length-adaptive
// (β, ρ) ratios and the collision tiers. The index that uses them is in kvscore/pariskv/pariskv.hpp.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/core/splitmix.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore {

namespace pariskv {

/// Default rotation seed: every index built with it shares one rotation (as the public code
/// shares one sign vector across heads).
inline constexpr std::uint64_t kDefaultSeed = 0x9A815C0DE5EEDull;

/// The rotation signs come from the library's splitmix64 (kvscore/core/splitmix.hpp).
using SplitMix64 = kvscore::detail::SplitMix64;

// ------------------------------------------------------------------ Lloyd–Max quantiser

/// The 3-bit magnitude quantiser of |u_j|, u uniform on S^{m-1}.
struct Codebook {
  int m = 0;  ///< m, dimensions per subspace
  int iterations = 0;                     ///< Lloyd steps taken
  std::array<double, 7> thresholds{};     ///< τ_1 < … < τ_7; bin t = #{τ ≤ |u_j|}
  std::array<double, 8> centres{};        ///< a[0] < … < a[7]
};

namespace detail {

/// ∫_0^φ sin^n(t) dt by the reduction formula I_n = −sin^{n−1}φ cosφ / n + (n−1)/n · I_{n−2}.
inline double sin_pow_integral(int n, double phi) noexcept {
  const double s = std::sin(phi), c = std::cos(phi);
  double I = (n % 2 == 0) ? phi : 1.0 - c;
  double sp = (n % 2 == 0) ? s : s * s;  // sin^{k-1} for the next k
  for (int k = (n % 2 == 0) ? 2 : 3; k <= n; k += 2) {
    I = -sp * c / double(k) + double(k - 1) / double(k) * I;
    sp *= s * s;
  }
  return I;
}

// X = |u_j| has density ∝ (1 − x²)^((m−3)/2) on [0, 1]; with x = cos φ that is ∝ sin^{m−2}φ dφ,
// which is smooth for every m ≥ 2 (m = 2 has an integrable pole at x = 1 in x).
/// Unnormalised mass of X in [a, b].
inline double x_mass(int m, double a, double b) noexcept {
  return sin_pow_integral(m - 2, std::acos(a)) - sin_pow_integral(m - 2, std::acos(b));
}
/// Unnormalised ∫_a^b x·density: ∫ cosφ sin^{m−2}φ dφ = sin^{m−1}φ/(m−1), sin(acos x) = √(1−x²).
inline double x_moment(int m, double a, double b) noexcept {
  const double e = 0.5 * double(m - 1);
  return (std::pow(1.0 - a * a, e) - std::pow(1.0 - b * b, e)) / double(m - 1);
}

inline void check_codebook_m(int m, const char* who) {
  if (m < 2 || m > 64)
    throw std::invalid_argument(std::string(who) + ": m must be in [2, 64] (got " + std::to_string(m) + ")");
}

}  // namespace detail

/// P(|u_j| ≤ x) for u uniform on S^{m−1}, i.e. the CDF of √Beta(1/2, (m−1)/2).
inline double abs_coord_cdf(int m, double x) {
  detail::check_codebook_m(m, "kvscore::pariskv::abs_coord_cdf");
  if (!(x > 0)) return 0;
  if (x >= 1) return 1;
  return detail::x_mass(m, 0, x) / detail::x_mass(m, 0, 1);
}

/// Lloyd–Max 8-level quantiser of |u_j| (pariskv.txt App. B.1.2) from a quantile start
/// (thresholds at the CDF quantiles 1/8 … 7/8). Each step: centres = conditional means of the
/// cells, thresholds = midpoints of adjacent centres. iterations = 0 runs to convergence (no
/// threshold moves by more than 1e-14); iterations = 100 reproduces the public table to 2e-4.
/// Integrals are exact (reduction formula), so the result is deterministic.
inline Codebook lloyd_max(int m, int iterations = 0) {
  const char* who = "kvscore::pariskv::lloyd_max";
  detail::check_codebook_m(m, who);
  if (iterations < 0)
    throw std::invalid_argument(std::string(who) + ": iterations must be >= 0 (got " + std::to_string(iterations) + ")");
  Codebook cb;
  cb.m = m;
  const double total = detail::x_mass(m, 0, 1);
  for (int i = 0; i < 7; ++i) {  // quantile start by bisection on the CDF
    double lo = 0, hi = 1;
    for (int it = 0; it < 100; ++it) {
      const double mid = 0.5 * (lo + hi);
      (detail::x_mass(m, 0, mid) / total < double(i + 1) / 8.0 ? lo : hi) = mid;
    }
    cb.thresholds[std::size_t(i)] = 0.5 * (lo + hi);
  }
  const int cap = iterations > 0 ? iterations : 1000000;
  int it = 0;
  for (; it < cap; ++it) {
    for (int t = 0; t < 8; ++t) {
      const double a = t == 0 ? 0.0 : cb.thresholds[std::size_t(t - 1)];
      const double b = t == 7 ? 1.0 : cb.thresholds[std::size_t(t)];
      cb.centres[std::size_t(t)] = detail::x_moment(m, a, b) / detail::x_mass(m, a, b);
    }
    double moved = 0;
    for (int t = 0; t < 7; ++t) {
      const double nt = 0.5 * (cb.centres[std::size_t(t)] + cb.centres[std::size_t(t + 1)]);
      moved = std::max(moved, std::fabs(nt - cb.thresholds[std::size_t(t)]));
      cb.thresholds[std::size_t(t)] = nt;
    }
    if (iterations == 0 && moved < 1e-14) {
      ++it;
      break;
    }
  }
  cb.iterations = it;
  return cb;
}

// ------------------------------------------------------------------ rotation

/// R = H·D/√P on the zero-padded vector: D = diag(±1) from splitmix64(seed) (bit 63 of each
/// draw), H the unnormalised Walsh–Hadamard matrix (in-place butterflies, O(P log P)).
/// H/√P is orthonormal and zero padding is an isometry R^d → R^P, so ⟨Rx, Ry⟩ = ⟨x, y⟩.
class Rotation {
 public:
  Rotation() = default;
  /// The rotation of `head_dim`-dimensional vectors drawn from `seed`; std::invalid_argument for a bad head_dim.
  Rotation(std::int64_t head_dim, std::uint64_t seed) : d_(head_dim) {
    if (head_dim < 1 || head_dim > kMaxHeadDim)
      throw std::invalid_argument("kvscore::pariskv::Rotation: head_dim must be in [1, " + std::to_string(kMaxHeadDim) +
                                  "] (got " + std::to_string(head_dim) + ")");
    p_ = 1;
    while (p_ < head_dim) p_ *= 2;
    signs_.resize(std::size_t(p_));
    SplitMix64 rng(seed);
    const float scale = float(1.0 / std::sqrt(double(p_)));
    for (auto& s : signs_) s = (rng.next() >> 63) ? -scale : scale;
  }
  std::int64_t dim() const noexcept { return d_; }  ///< d, dimensions of the input
  std::int64_t padded_dim() const noexcept { return p_; }  ///< P, d padded to a power of two
  /// Signs times 1/√P, one per padded coordinate.
  const std::vector<float>& scaled_signs() const noexcept { return signs_; }

  /// y[0..P) = R·pad(x); x has dim() values.
  void apply(const float* x, float* y) const noexcept {
    for (std::int64_t j = 0; j < p_; ++j) y[j] = j < d_ ? x[j] * signs_[std::size_t(j)] : 0.f;
    fwht(y, p_);
  }

  /// In-place unnormalised Walsh–Hadamard transform of y[0, p), p a power of two.
  static void fwht(float* y, std::int64_t p) noexcept {
    for (std::int64_t h = 1; h < p; h *= 2)
      for (std::int64_t i = 0; i < p; i += 2 * h)
        for (std::int64_t j = i; j < i + h; ++j) {
          const float a = y[j], b = y[j + h];
          y[j] = a + b;
          y[j + h] = a - b;
        }
  }

 private:
  std::int64_t d_ = 0, p_ = 0;
  std::vector<float> signs_;
};

/// Length-adaptive (β, ρ) from the public code: N<5K (0.50, 0.50); <10K (0.25, 0.30);
/// <30K (0.20, 0.25); ≥30K (0.10, 0.20). (K = 1000 tokens.)
struct Ratios {
  double beta;  ///< Stage I candidate ratio β
  double rho;   ///< collision ratio ρ
};
/// The length-adaptive (β, ρ) for an index of n keys.
inline Ratios default_ratios(std::int64_t n) noexcept {
  if (n < 5000) return {0.50, 0.50};
  if (n < 10000) return {0.25, 0.30};
  if (n < 30000) return {0.20, 0.25};
  return {0.10, 0.20};
}

/// ⌈x·N⌉ for a ratio x in (0, 1], computed so that float fuzz in x·N (0.2·100 =
/// 20.000000000000004) does not add a key: ⌈x·N·(1 − 1e−12)⌉, clipped to [1, N].
inline std::int64_t ratio_count(double x, std::int64_t n) noexcept {
  if (n <= 0) return 0;
  const double c = std::ceil(x * double(n) * (1.0 - 1e-12));
  return std::max<std::int64_t>(1, std::min<std::int64_t>(n, std::int64_t(c)));
}

/// Stage I candidate count C for `results` = max(k, k') <= N results. An explicit β (> 0):
/// max(⌈βN⌉, results). The length-adaptive default: at least min(N, 2·results) as well, so the
/// RSQ-IP rerank always has candidates beyond the results it returns (below 5K tokens the default
/// β = 0.5 would give C = k at keep 0.5: no rerank at all; docs/methods/pariskv.md).
inline std::int64_t candidate_count(double beta, std::int64_t n, std::int64_t results) noexcept {
  if (beta != 0) return std::max(ratio_count(beta, n), results);
  return std::max(ratio_count(default_ratios(n).beta, n), std::min(n, 2 * results));
}

/// Score tiers of the collision votes (Stage I).
inline constexpr int kTiers = 6;
/// The share of candidates in each tier, in percent.
inline constexpr int kTierPercent[kTiers] = {5, 15, 30, 50, 75, 100};

namespace detail {

/// A flip set in the best-first enumeration of sign patterns (Stage I); ordered by cost, then id.
struct PatternNode {
  float cost, prefix;  ///< Σ of the set's sorted costs, and the same without its last element
  std::uint32_t id, last;
  friend bool operator>(const PatternNode& a, const PatternNode& b) noexcept {
    return a.cost > b.cost || (a.cost == b.cost && a.id > b.id);
  }
};

[[noreturn]] inline void fail(const std::string& what) { throw std::invalid_argument(what); }

}  // namespace detail
}  // namespace pariskv

}  // namespace kvscore
