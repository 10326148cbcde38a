// Tests of kvscore::select_joint (kvscore/joint.hpp): one set of kept positions for every
// (layer, head) row.
//
//  * hand-worked cases whose answers differ between max, mean and vote (values in the comments,
//    computed with numpy);
//  * a brute-force reference written here: per-row z-scores from the documented sums, the
//    aggregate, then a full sort of all positions under the documented order (vote: every
//    row's top-m by a full sort) -- on random layer/head/token shapes, budgets, protection,
//    tied integer scores, NaN and +-inf, every aggregate, thread count and kernel set;
//  * an exhaustive check on tiny caches: no other subset of the same size with the protected
//    positions has a larger sum of the aggregate (an answer that does not depend on any order);
//  * every error path.
#include <catch2/catch.hpp>

#include <kvscore/joint.hpp>
#include <kvscore/slots.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace {

using kvscore::JointAggregate;
using kvscore::JointOptions;
using kvscore::Scores;
using kvscore::ScoresView;
using test_support::error_of;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

Scores make_scores(std::int64_t heads, const std::vector<float>& v) {
  const std::int64_t n = heads == 0 ? 0 : std::int64_t(v.size()) / heads;
  Scores s(heads, n);
  std::copy(v.begin(), v.end(), s.data());
  return s;
}

std::vector<std::int64_t> joint(const std::vector<Scores>& layers, std::int64_t budget, JointAggregate a,
                                std::int64_t sinks = 0, std::int64_t recent = 0, int threads = 1) {
  JointOptions o;
  o.aggregate = a;
  o.sinks = sinks;
  o.recent = recent;
  o.num_threads = threads;
  return kvscore::select_joint(layers, budget, o);
}

// ------------------------------------------------------------------ the reference

/// mean and 1/std of a row as documented: finite values only, double sums in 8 lanes
/// (lane = position % 8) combined ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)), population std, std 0 -> 0.
void ref_znorm(const float* x, std::int64_t n, double* mean, double* inv) {
  double l[8] = {}, q[8] = {};
  std::int64_t c = 0;
  for (std::int64_t i = 0; i < n; ++i)
    if (std::isfinite(x[i])) {
      l[i % 8] += double(x[i]);
      ++c;
    }
  auto comb = [](const double* a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); };
  const double mu = c ? comb(l) / double(c) : 0.0;
  for (std::int64_t i = 0; i < n; ++i)
    if (std::isfinite(x[i])) {
      volatile double d = (double(x[i]) - mu) * (double(x[i]) - mu);  // rounded on its own
      q[i % 8] += d;
    }
  const double sd = c ? std::sqrt(comb(q) / double(c)) : 0.0;
  *mean = mu;
  *inv = sd > 0 ? 1.0 / sd : 0.0;
}

/// "a ranks above b" for (primary, position): higher first, NaN last, then lower position.
bool above(float a, float b, std::int64_t pa, std::int64_t pb) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na != nb) return nb;
  if (!na && a != b) return a > b;
  return pa < pb;
}

std::vector<std::int64_t> reference(const std::vector<Scores>& layers, std::int64_t budget, JointAggregate how,
                                    std::int64_t sinks, std::int64_t recent) {
  const std::int64_t T = layers[0].tokens();
  std::vector<std::vector<float>> z;  // z-scores of every row
  for (const Scores& s : layers)
    for (std::int64_t h = 0; h < s.heads(); ++h) {
      double mu, inv;
      ref_znorm(s.head(h), T, &mu, &inv);
      std::vector<float> row(std::size_t(T), 0.f);
      for (std::int64_t t = 0; t < T; ++t) {
        const float x = s(h, t);
        row[std::size_t(t)] = std::isfinite(x) ? float((double(x) - mu) * inv) : x;
      }
      z.push_back(std::move(row));
    }
  const std::int64_t s0 = std::min(sinks, T), e0 = std::max(s0, T - std::min(recent, T));
  auto is_protected = [&](std::int64_t t) { return t < s0 || t >= e0; };
  const std::int64_t protect = s0 + (T - e0), m = budget - protect;

  std::vector<float> mx(std::size_t(T), kNaN), mean(std::size_t(T), kNaN);
  for (std::int64_t t = 0; t < T; ++t) {
    double sum = 0;
    int c = 0;
    for (const auto& row : z) {
      const float v = row[std::size_t(t)];
      if (std::isnan(v)) continue;
      if (std::isnan(mx[std::size_t(t)]) || v > mx[std::size_t(t)]) mx[std::size_t(t)] = v;
      sum += v;
      ++c;
    }
    if (c) mean[std::size_t(t)] = float(sum / c);
  }
  std::vector<int> votes(std::size_t(T), 0);
  if (how == JointAggregate::vote) {
    std::size_t r = 0;
    for (const Scores& s : layers)
      for (std::int64_t h = 0; h < s.heads(); ++h, ++r) {
        std::vector<std::int64_t> c;
        for (std::int64_t t = 0; t < T; ++t)
          if (!is_protected(t)) c.push_back(t);
        std::sort(c.begin(), c.end(), [&](std::int64_t a, std::int64_t b) { return above(s(h, a), s(h, b), a, b); });
        for (std::int64_t i = 0; i < m; ++i) ++votes[std::size_t(c[std::size_t(i)])];
      }
  }
  std::vector<std::int64_t> c;
  for (std::int64_t t = 0; t < T; ++t)
    if (!is_protected(t)) c.push_back(t);
  std::sort(c.begin(), c.end(), [&](std::int64_t a, std::int64_t b) {
    if (how == JointAggregate::vote) {
      if (votes[std::size_t(a)] != votes[std::size_t(b)]) return votes[std::size_t(a)] > votes[std::size_t(b)];
      return above(mean[std::size_t(a)], mean[std::size_t(b)], a, b);
    }
    const auto& J = how == JointAggregate::max ? mx : mean;
    return above(J[std::size_t(a)], J[std::size_t(b)], a, b);
  });
  std::vector<std::int64_t> out;
  for (std::int64_t t = 0; t < T; ++t)
    if (is_protected(t)) out.push_back(t);
  out.insert(out.end(), c.begin(), c.begin() + m);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("select_joint: hand-worked cases tell max, mean and vote apart", "[joint]") {
  // One layer, rows [1,0,0], [0,1,0], [0,1,0]: z = [1.414, -0.707, -0.707] for the first and
  // [-0.707, 1.414, -0.707] for the others.
  //   max  [1.414, 1.414, -0.707]: tokens 0 and 1 tie exactly -> the lower position, 0
  //   mean [0, 0.471, -0.707] -> 1;   vote: the rows keep 0, 1, 1 -> 1
  const std::vector<Scores> a{make_scores(3, {1, 0, 0, 0, 1, 0, 0, 1, 0})};
  CHECK(joint(a, 1, JointAggregate::max) == std::vector<std::int64_t>{0});
  CHECK(joint(a, 1, JointAggregate::mean) == std::vector<std::int64_t>{1});
  CHECK(joint(a, 1, JointAggregate::vote) == std::vector<std::int64_t>{1});

  // Two layers of one head: [1, 0, 0.9] -> z [0.815, -1.408, 0.593]; [0, 1, 0.2] -> z
  // [-0.926, 1.389, -0.463].  max [0.815, 1.389, 0.593] -> 1;  mean [-0.055, -0.010, 0.065]
  // -> 2;  vote: the rows keep 0 and 1 (one vote each), the tie goes to the higher mean -> 1
  // (the position rule alone would give 0).
  const std::vector<Scores> b{make_scores(1, {1, 0, 0.9f}), make_scores(1, {0, 1, 0.2f})};
  CHECK(joint(b, 1, JointAggregate::max) == std::vector<std::int64_t>{1});
  CHECK(joint(b, 1, JointAggregate::mean) == std::vector<std::int64_t>{2});
  CHECK(joint(b, 1, JointAggregate::vote) == std::vector<std::int64_t>{1});
  CHECK(joint(b, 2, JointAggregate::mean) == std::vector<std::int64_t>{1, 2});

  // Scale does not matter: a row multiplied by 1000 has the same z-scores.
  const std::vector<Scores> c{make_scores(1, {1000, 0, 900}), make_scores(1, {0, 1, 0.2f})};
  CHECK(joint(c, 1, JointAggregate::mean) == std::vector<std::int64_t>{2});
}

TEST_CASE("select_joint: protection, whole budgets and the default", "[joint]") {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> v(2 * 40);
  for (float& x : v) x = nd(rng);
  const std::vector<Scores> L{make_scores(2, v)};
  for (JointAggregate a : {JointAggregate::max, JointAggregate::mean, JointAggregate::vote}) {
    // sinks 3 + recent 5 always kept, inside the budget
    const auto k = joint(L, 12, a, 3, 5);
    REQUIRE(k.size() == 12);
    CHECK(std::is_sorted(k.begin(), k.end()));
    for (std::int64_t t : {0, 1, 2, 35, 36, 37, 38, 39}) CHECK(std::count(k.begin(), k.end(), t) == 1);
    // budget == protected tokens: exactly those; budget == tokens: all; budget 0: none
    CHECK(joint(L, 8, a, 3, 5) == std::vector<std::int64_t>{0, 1, 2, 35, 36, 37, 38, 39});
    std::vector<std::int64_t> all(40);
    std::iota(all.begin(), all.end(), 0);
    CHECK(joint(L, 40, a, 3, 5) == all);
    CHECK(joint(L, 0, a).empty());
    // protection wider than the cache is clipped, overlap counted once
    CHECK(joint(L, 40, a, 30, 30) == all);
  }
  CHECK(JointOptions{}.aggregate == JointAggregate::max);
  // evicted_ranges turns the keep list into llama_memory_seq_rm calls
  const auto k = joint(L, 8, JointAggregate::max, 3, 5);
  CHECK(kvscore::evicted_ranges(k, 40) == std::vector<kvscore::PositionRange>{{3, 35}});
}

TEST_CASE("select_joint: NaN and infinities", "[joint]") {
  // Row 0 is all NaN (no opinion), row 1 decides; a token NaN in every row ranks last.
  const std::vector<Scores> L{make_scores(2, {kNaN, kNaN, kNaN, kNaN, 3, 1, kNaN, 2})};
  for (JointAggregate a : {JointAggregate::max, JointAggregate::mean, JointAggregate::vote}) {
    CHECK(joint(L, 1, a) == std::vector<std::int64_t>{0});
    CHECK(joint(L, 2, a) == std::vector<std::int64_t>{0, 3});
    CHECK(joint(L, 4, a) == std::vector<std::int64_t>{0, 1, 2, 3});
    CHECK(joint(L, 3, a) == std::vector<std::int64_t>{0, 1, 3});
  }
  // +inf wins under max; under mean +inf and -inf cancel to NaN (ranks last)
  const std::vector<Scores> M{make_scores(2, {kInf, 0, 1, 2, -kInf, 0, 1, 2})};
  CHECK(joint(M, 1, JointAggregate::max) == std::vector<std::int64_t>{0});
  CHECK(joint(M, 3, JointAggregate::mean) == std::vector<std::int64_t>{1, 2, 3});
}

TEST_CASE("select_joint: matches a brute-force reference (random shapes, ties, NaN, threads, kernels)",
          "[joint]") {
  std::mt19937_64 rng(20261126);
  auto uni = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };
  std::vector<kvscore::SelectKernels> kernels{kvscore::SelectKernels::portable};
  if (kvscore::select_kernels_supported(kvscore::SelectKernels::best)) kernels.push_back(kvscore::SelectKernels::best);
  for (int it = 0; it < 300; ++it) {
    const std::int64_t T = uni(1, it % 10 == 0 ? 5000 : 300);
    const int n_layers = int(uni(1, 4));
    const int dist = int(uni(0, 3));  // 0 gaussian, 1 small integers (ties), 2 with NaN/inf, 3 constant rows
    std::vector<Scores> layers;
    for (int l = 0; l < n_layers; ++l) {
      const std::int64_t H = uni(1, 4);
      Scores s(H, T);
      for (std::int64_t i = 0; i < H * T; ++i) {
        float x = std::normal_distribution<float>()(rng) * float(l + 1);
        if (dist == 1) x = float(uni(0, 4));
        if (dist == 2) {
          const auto r = uni(0, 20);
          x = r == 0 ? kNaN : r == 1 ? kInf : r == 2 ? -kInf : x;
        }
        if (dist == 3) x = (i / T) % 2 ? 1.5f : x;
        s.data()[i] = x;
      }
      layers.push_back(std::move(s));
    }
    const std::int64_t sinks = uni(0, 2) ? uni(0, 8) : 0, recent = uni(0, 2) ? uni(0, 40) : 0;
    const std::int64_t protect = std::min(T, std::min(sinks, T) + std::min(recent, T));
    const std::int64_t budget = uni(protect, T);
    for (JointAggregate a : {JointAggregate::max, JointAggregate::mean, JointAggregate::vote}) {
      const auto expect = reference(layers, budget, a, sinks, recent);
      for (int threads : {1, 3})
        for (auto k : kernels) {
          JointOptions o;
          o.aggregate = a;
          o.sinks = sinks;
          o.recent = recent;
          o.num_threads = threads;
          o.kernels = k;
          const auto got = kvscore::select_joint(layers, budget, o);
          INFO("it " << it << " T " << T << " layers " << n_layers << " dist " << dist << " budget " << budget
                     << " sinks " << sinks << " recent " << recent << " aggregate "
                     << kvscore::joint_aggregate_name(a) << " threads " << threads);
          REQUIRE(got == expect);
        }
    }
  }
}

TEST_CASE("select_joint: no other subset has a larger aggregate (exhaustive, tiny caches)", "[joint]") {
  // For max and mean the kept unprotected tokens maximise the sum of the aggregate over all
  // subsets of that size: checked by enumerating every subset (the aggregate computed here in
  // double from the reference z-scores; gaussian scores, so no ties).
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd;
  for (int it = 0; it < 60; ++it) {
    const std::int64_t T = 2 + it % 9;
    std::vector<Scores> layers{Scores(2, T), Scores(3, T)};
    for (auto& s : layers)
      for (std::int64_t i = 0; i < s.heads() * T; ++i) s.data()[i] = nd(rng);
    const std::int64_t sinks = it % 3 == 0 ? 1 : 0, recent = it % 4 == 0 ? 1 : 0;
    const std::int64_t protect = std::min(T, sinks + recent);
    const std::int64_t budget = protect + (it % std::max<std::int64_t>(1, T - protect));
    for (JointAggregate a : {JointAggregate::max, JointAggregate::mean}) {
      std::vector<double> J(std::size_t(T), 0.0);
      std::vector<double> mx(std::size_t(T), -1e300);
      int rows = 0;
      for (const auto& s : layers)
        for (std::int64_t h = 0; h < s.heads(); ++h, ++rows) {
          double mu, inv;
          ref_znorm(s.head(h), T, &mu, &inv);
          for (std::int64_t t = 0; t < T; ++t) {
            const double z = float((double(s(h, t)) - mu) * inv);
            J[std::size_t(t)] += z;
            mx[std::size_t(t)] = std::max(mx[std::size_t(t)], z);
          }
        }
      if (a == JointAggregate::max) J = mx;
      const auto got = joint(layers, budget, a, sinks, recent);
      auto sum_of = [&](std::uint32_t mask) {
        double v = 0;
        for (std::int64_t t = 0; t < T; ++t)
          if (mask >> t & 1) v += J[std::size_t(t)];
        return v;
      };
      std::uint32_t got_mask = 0;
      for (auto t : got) got_mask |= 1u << t;
      REQUIRE(std::int64_t(got.size()) == budget);
      for (std::uint32_t mask = 0; mask < (1u << T); ++mask) {
        if (std::popcount(mask) != budget) continue;
        if (sinks && !(mask & 1)) continue;
        if (recent && !(mask >> (T - 1) & 1)) continue;
        CHECK(sum_of(mask) <= sum_of(got_mask) + 1e-6);
      }
    }
  }
}

TEST_CASE("select_joint: errors name the offending value", "[joint]") {
  const std::vector<Scores> L{make_scores(2, {1, 2, 3, 4, 5, 6})};
  CHECK(error_of([&] { joint(L, 4, JointAggregate::max); }).find("budget of 4 tokens exceeds the 3 tokens") !=
        std::string::npos);
  CHECK(error_of([&] { joint(L, -1, JointAggregate::max); }).find("budget must be >= 0 (got -1)") !=
        std::string::npos);
  const std::string prot = error_of([&] { joint(L, 1, JointAggregate::vote, 1, 1); });
  CHECK(prot.find("kvscore::select_joint: sinks 1 and recent 1 protect 2 tokens") != std::string::npos);
  CHECK(error_of([&] { joint(L, 1, JointAggregate::max, -2); }).find("sinks must be >= 0 (got -2)") !=
        std::string::npos);
  CHECK(error_of([&] { joint(L, 1, JointAggregate::max, 0, 0, -1); }).find("num_threads must be >= 0 (got -1)") !=
        std::string::npos);
  const std::vector<Scores> mismatch{make_scores(1, {1, 2, 3}), make_scores(1, {1, 2})};
  CHECK(error_of([&] { joint(mismatch, 1, JointAggregate::max); }).find("layer 1 has 2 tokens, layer 0 has 3") !=
        std::string::npos);
  CHECK(error_of([&] { joint({}, 0, JointAggregate::max); }).find("no layers") != std::string::npos);
  const std::vector<Scores> headless{Scores(0, 5)};
  CHECK(error_of([&] { joint(headless, 0, JointAggregate::max); }).find("no heads") != std::string::npos);
  JointOptions o;
  o.aggregate = JointAggregate(7);
  CHECK(error_of([&] { kvscore::select_joint(L, 1, o); }).find("unknown JointAggregate") != std::string::npos);
  CHECK(kvscore::parse_joint_aggregate("vote") == JointAggregate::vote);
  CHECK(error_of([] { kvscore::parse_joint_aggregate("median"); }).find("'median' must be 'max', 'mean' or 'vote'") !=
        std::string::npos);
}

// ------------------------------------------------------------------ whole blocks (paged caches)

namespace {

using kvscore::BlockAggregate;
using kvscore::BlockJointOptions;

/// The block reference: J from the reference z-scores (max, or double mean over the rows in
/// order), B per block (mean in double in position order, or max; NaN skipped), protection from
/// the documented rule, then a full sort of the other blocks.
std::vector<std::int64_t> block_reference(const std::vector<Scores>& layers, std::int64_t bs, std::int64_t budget,
                                          const BlockJointOptions& o) {
  const std::int64_t T = layers[0].tokens();
  std::vector<float> J(std::size_t(T), kNaN);
  std::vector<double> sum(std::size_t(T), 0.0);
  std::vector<int> cnt(std::size_t(T), 0);
  for (const Scores& s : layers)
    for (std::int64_t h = 0; h < s.heads(); ++h) {
      double mu, inv;
      ref_znorm(s.head(h), T, &mu, &inv);
      for (std::int64_t t = 0; t < T; ++t) {
        const float x = s(h, t), z = std::isfinite(x) ? float((double(x) - mu) * inv) : x;
        if (std::isnan(z)) continue;
        if (std::isnan(J[std::size_t(t)]) || z > J[std::size_t(t)]) J[std::size_t(t)] = z;
        sum[std::size_t(t)] += z;
        ++cnt[std::size_t(t)];
      }
    }
  if (o.aggregate == JointAggregate::mean)
    for (std::int64_t t = 0; t < T; ++t) J[std::size_t(t)] = cnt[std::size_t(t)] ? float(sum[std::size_t(t)] / cnt[std::size_t(t)]) : kNaN;
  const std::int64_t nb = (T + bs - 1) / bs;
  std::vector<float> B(std::size_t(nb), kNaN);
  for (std::int64_t b = 0; b < nb; ++b) {
    double s = 0;
    int c = 0;
    float m = kNaN;
    for (std::int64_t t = b * bs; t < std::min(T, (b + 1) * bs); ++t) {
      const float x = J[std::size_t(t)];
      if (std::isnan(x)) continue;
      s += x;
      ++c;
      m = std::isnan(m) ? x : std::max(m, x);
    }
    if (c) B[std::size_t(b)] = o.block_aggregate == BlockAggregate::max ? m : float(s / c);
  }
  std::vector<std::int64_t> keep, cand;
  for (std::int64_t b = 0; b < nb; ++b) {
    bool prot = false;
    for (std::int64_t t = b * bs; t < std::min(T, (b + 1) * bs); ++t) prot = prot || t < o.sinks || t >= T - o.recent;
    prot = prot || (b == nb - 1 && T % bs != 0);
    (prot ? keep : cand).push_back(b);
  }
  std::sort(cand.begin(), cand.end(),
            [&](std::int64_t a, std::int64_t b) { return above(B[std::size_t(a)], B[std::size_t(b)], a, b); });
  const std::int64_t m = budget - std::int64_t(keep.size());
  keep.insert(keep.end(), cand.begin(), cand.begin() + m);
  std::sort(keep.begin(), keep.end());
  return keep;
}

}  // namespace

TEST_CASE("select_joint_blocks: matches a brute-force reference (shapes, ties, NaN, threads, aggregates)",
          "[joint][blocks]") {
  std::mt19937_64 rng(20261127);
  auto uni = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };
  for (int it = 0; it < 300; ++it) {
    const std::int64_t T = uni(1, it % 10 == 0 ? 5000 : 300), bs = uni(1, 40);
    const int n_layers = int(uni(1, 4)), dist = int(uni(0, 2));  // gaussian, small integers, NaN/inf
    std::vector<Scores> layers;
    for (int l = 0; l < n_layers; ++l) {
      Scores s(uni(1, 4), T);
      for (std::int64_t i = 0; i < s.heads() * T; ++i) {
        float x = std::normal_distribution<float>()(rng) * float(l + 1);
        if (dist == 1) x = float(uni(0, 4));
        if (dist == 2) {
          const auto r = uni(0, 20);
          x = r == 0 ? kNaN : r == 1 ? kInf : r == 2 ? -kInf : x;
        }
        s.data()[i] = x;
      }
      layers.push_back(std::move(s));
    }
    BlockJointOptions o;
    o.sinks = uni(0, 2) ? uni(0, 8) : 0;
    o.recent = uni(0, 2) ? uni(0, 40) : 0;
    const std::int64_t nb = (T + bs - 1) / bs, prot = kvscore::protected_blocks(T, bs, o.sinks, o.recent);
    const std::int64_t budget = uni(prot, nb);
    for (JointAggregate a : {JointAggregate::max, JointAggregate::mean})
      for (BlockAggregate ba : {BlockAggregate::mean, BlockAggregate::max})
        for (int threads : {1, 3}) {
          o.aggregate = a;
          o.block_aggregate = ba;
          o.num_threads = threads;
          INFO("it " << it << " T " << T << " bs " << bs << " budget " << budget << " sinks " << o.sinks << " recent "
                     << o.recent << " " << kvscore::joint_aggregate_name(a) << "/"
                     << kvscore::block_aggregate_name(ba) << " threads " << threads);
          REQUIRE(kvscore::select_joint_blocks(layers, bs, budget, o) == block_reference(layers, bs, budget, o));
        }
  }
}

TEST_CASE("select_joint_blocks: block size 1 is select_joint, budget counts whole blocks", "[joint][blocks]") {
  std::mt19937_64 rng(7);
  std::vector<Scores> layers;
  for (int l = 0; l < 3; ++l) {
    Scores s(2, 97);
    for (std::int64_t i = 0; i < s.heads() * s.tokens(); ++i) s.data()[i] = std::normal_distribution<float>()(rng);
    layers.push_back(std::move(s));
  }
  for (JointAggregate a : {JointAggregate::max, JointAggregate::mean}) {
    BlockJointOptions bo;
    bo.aggregate = a;
    bo.sinks = 3;
    bo.recent = 5;
    JointOptions jo;
    jo.aggregate = a;
    jo.sinks = 3;
    jo.recent = 5;
    CHECK(kvscore::select_joint_blocks(layers, 1, 40, bo) == kvscore::select_joint(layers, 40, jo));
  }
  // 97 tokens in blocks of 16: 7 blocks, the last one (position 96) partial and always kept;
  // sinks 3 -> block 0, recent 5 (positions 92..96) -> blocks 5 and 6: 3 protected, budget 4
  // keeps 1 more.
  BlockJointOptions o;
  o.sinks = 3;
  o.recent = 5;
  CHECK(kvscore::protected_blocks(97, 16, 3, 5) == 3);
  CHECK(kvscore::protected_blocks(97, 16, 3, 1) == 2);
  CHECK(kvscore::protected_blocks(96, 16, 0, 17) == 2);  // recent 17 reaches into block 4
  CHECK(kvscore::protected_blocks(96, 16, 0, 0) == 0);   // full last block: not protected
  const auto kept = kvscore::select_joint_blocks(layers, 16, 4, o);
  REQUIRE(kept.size() == 4);
  CHECK(kept.front() == 0);
  CHECK(kept.back() == 6);
  CHECK(std::is_sorted(kept.begin(), kept.end()));
  CHECK(kvscore::select_joint_blocks(layers, 16, 7, o) == std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6});
}

TEST_CASE("joint_partial/combine_partials: any split of the rows over ranks decides as one process",
          "[joint][blocks]") {
  // Tensor parallelism: each rank holds some kv heads of every layer. Max is exact for any
  // split; mean equals up to double rounding, so it is checked on the decision with well
  // separated block scores and on J within 1e-6.
  std::mt19937_64 rng(42);
  auto uni = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };
  for (int it = 0; it < 50; ++it) {
    const std::int64_t T = uni(1, 600), bs = uni(1, 32), L = uni(1, 5), H = uni(2, 6), ranks = uni(2, H);
    std::vector<Scores> all;
    auto per_rank = std::vector<std::vector<Scores>>(static_cast<std::size_t>(ranks));
    for (std::int64_t l = 0; l < L; ++l) {
      Scores s(H, T);
      for (std::int64_t i = 0; i < H * T; ++i) s.data()[i] = std::normal_distribution<float>()(rng) * float(l + 1);
      // rank r holds heads [r*H/ranks, (r+1)*H/ranks) of this layer
      for (std::int64_t r = 0; r < ranks; ++r) {
        const std::int64_t h0 = r * H / ranks, h1 = (r + 1) * H / ranks;
        Scores part(h1 - h0, T);
        std::copy(s.data() + h0 * T, s.data() + h1 * T, part.data());
        per_rank[std::size_t(r)].push_back(std::move(part));
      }
      all.push_back(std::move(s));
    }
    for (JointAggregate a : {JointAggregate::max, JointAggregate::mean}) {
      BlockJointOptions o;
      o.aggregate = a;
      o.sinks = uni(0, 4);
      o.recent = uni(0, 40);
      std::vector<kvscore::JointPartial> parts;
      for (const auto& rows : per_rank) parts.push_back(kvscore::joint_partial(rows, o));
      const kvscore::JointPartial whole = kvscore::joint_partial(all, o);
      const std::vector<float> J = kvscore::combine_partials(parts, o);
      const std::vector<float> J1 = kvscore::combine_partials(std::span<const kvscore::JointPartial>(&whole, 1), o);
      REQUIRE(J.size() == std::size_t(T));
      for (std::int64_t t = 0; t < T; ++t) {
        if (a == JointAggregate::max)
          REQUIRE(std::bit_cast<std::uint32_t>(J[std::size_t(t)]) == std::bit_cast<std::uint32_t>(J1[std::size_t(t)]));
        else
          REQUIRE(std::abs(J[std::size_t(t)] - J1[std::size_t(t)]) <= 1e-6f);
      }
      const std::int64_t nb = (T + bs - 1) / bs, prot = kvscore::protected_blocks(T, bs, o.sinks, o.recent);
      const std::int64_t budget = uni(prot, nb);
      if (a == JointAggregate::max)
        REQUIRE(kvscore::select_blocks(kvscore::block_scores(J, bs, o), T, bs, budget, o) ==
                kvscore::select_joint_blocks(all, bs, budget, o));
    }
  }
}

TEST_CASE("select_joint_blocks: errors name the offending value", "[joint][blocks][errors]") {
  const std::vector<Scores> L{make_scores(1, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10})};
  BlockJointOptions o;
  CHECK(error_of([&] { kvscore::select_joint_blocks(L, 0, 1, o); }).find("block_size must be > 0 (got 0)") !=
        std::string::npos);
  CHECK(error_of([&] { kvscore::select_joint_blocks(L, 4, 4, o); }).find("budget of 4 blocks out of range [0, 3]") !=
        std::string::npos);
  o.recent = 5;  // blocks 1 and 2 (positions 5..9) + partial last block (2): 2 protected
  CHECK(error_of([&] { kvscore::select_joint_blocks(L, 4, 1, o); }).find("below the 2 protected blocks") !=
        std::string::npos);
  o.recent = -1;
  CHECK(error_of([&] { kvscore::select_joint_blocks(L, 4, 1, o); }).find("recent must be >= 0 (got -1)") !=
        std::string::npos);
  o.recent = 0;
  o.aggregate = JointAggregate::vote;
  CHECK(error_of([&] { kvscore::select_joint_blocks(L, 4, 1, o); }).find("'max' or 'mean' for blocks (got 'vote')") !=
        std::string::npos);
  o.aggregate = JointAggregate::max;
  CHECK(error_of([&] { kvscore::select_blocks(std::vector<float>{1.f, 2.f}, 10, 4, 1, o); })
            .find("2 block scores for 10 tokens in blocks of 4 (needs 3)") != std::string::npos);
  kvscore::JointPartial a = kvscore::joint_partial(L, o), b = a;
  b.tokens = 9;
  CHECK(error_of([&] { kvscore::combine_partials(std::vector<kvscore::JointPartial>{a, b}, o); })
            .find("partial 1 has 9 tokens, partial 0 has 10") != std::string::npos);
  CHECK(error_of([&] { kvscore::combine_partials(std::vector<kvscore::JointPartial>{}, o); }).find("no partials") !=
        std::string::npos);
  CHECK(kvscore::parse_block_aggregate("max") == BlockAggregate::max);
  CHECK(error_of([] { kvscore::parse_block_aggregate("sum"); }).find("'sum' must be 'mean' or 'max'") !=
        std::string::npos);
}
