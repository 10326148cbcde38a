// kvscore/block_sparse/score_meanstd.hpp — q·μ + z_n·sqrt(Σ_j q_j²σ_j²): the block's mean score
// plus z_n spreads, σ_j the keys' per-dimension standard deviation and z_n the expected maximum
// of n = block_size standard normals (2.07 at 32) — what the max of q·k over the block would be
// if the keys' coordinates were independent Gaussians. Summary: [mean | spread], 2·head_dim floats.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvscore/block_sparse/scorer.hpp"

namespace kvscore::detail {

/// E[max of n independent standard normals] (n >= 1), by the trapezoid rule on
/// ∫ x·n·φ(x)·Φ(x)^(n−1) dx over [−12, 12]: 0 at n = 1, 1/√π at 2, 2.07 at 32.
inline double expected_max_normal(std::int64_t n) {
  if (n <= 1) return 0.0;
  const double h = 1e-3, inv_sqrt2pi = 0.3989422804014327;
  double acc = 0;
  for (int i = -12000; i <= 12000; ++i) {
    const double x = i * h;
    const double phi = inv_sqrt2pi * std::exp(-0.5 * x * x);
    const double Phi = 0.5 * std::erfc(-x / std::sqrt(2.0));
    acc += x * double(n) * phi * std::pow(Phi, double(n - 1));
  }
  return acc * h;
}

/// Per dimension j < d, the mean (a) and population standard deviation (b) of n keys: two
/// passes in double (the spread of near-equal keys is small).
template <BlockKeyTile Tile>
void meanstd_summary(const Tile& x, std::int64_t n, std::int64_t d, float* a, float* b) {
  for (std::int64_t j = 0; j < d; ++j) {
    double s = 0;
    for (std::int64_t t = 0; t < n; ++t) s += double(x.at(t, j));
    const double mu = s / double(n);
    double ss = 0;
    for (std::int64_t t = 0; t < n; ++t) ss += (double(x.at(t, j)) - mu) * (double(x.at(t, j)) - mu);
    a[j] = float(mu);
    b[j] = float(std::sqrt(ss / double(n)));
  }
}

/// q·μ + z·sqrt(Σ_j q_j²σ_j²) over a summary (dimension order).
inline float meanstd_score(const float* q, const float* a, const float* b, std::int64_t d, float z) noexcept {
  float m = 0.f, var = 0.f;
  for (std::int64_t j = 0; j < d; ++j) {
    m += q[j] * a[j];
    var += q[j] * q[j] * b[j] * b[j];
  }
  return m + z * std::sqrt(var);
}

class MeanStdScorer : public StatelessBlockScorer {
 public:
  static constexpr BlockScore kind = BlockScore::meanstd;
  static constexpr bool kSummaries = true;  ///< reads a SummaryStore
  MeanStdScorer(const BlockSparseOptions&, std::int64_t /*layers*/, std::int64_t head_dim, std::int64_t block_size)
      : d_(head_dim), bs_(block_size), z_(float(expected_max_normal(block_size))) {}
  std::int64_t summary_floats() const noexcept { return 2 * d_; }
  template <BlockKeyTile Tile>
  void summarize(const Tile& x, float* s, std::uint8_t*) const {
    meanstd_summary(x, bs_, d_, s, s + d_);
  }
  template <class Keys>
  void score(const BlockScoreJob& job, const BlockReader<Keys>& rd, BlockChoiceScratch& w) const {
    score_each(job, w, [&](std::int64_t c, std::int64_t h, const float* q) {
      const float* a = rd.summary(c, h);
      return meanstd_score(q, a, a + d_, d_, z_);
    });
  }

 private:
  std::int64_t d_, bs_;
  float z_;
};

}  // namespace kvscore::detail
