// Evaluator metrics (include/kvscore/eval/metrics.hpp, docs/reference/evaluate.md): golden values from
// numpy (tools/gen_eval_fixtures.py, tests/data/eval/), closed forms and error paths.
//
// Tolerance: the reference and the C++ both work in fp64 from the same fp32 inputs; they
// differ only in summation order (GEMM blocking vs numpy's pairwise sums), a few ulps of
// logits of magnitude < 30, so 1e-10 relative (+1e-12 absolute for near-zero errors) is
// loose for rounding and tight for any formula mistake (wrong scale, renormalised p vs
// kept softmax, missing shift) — each of those moves some value by > 1e-3.
#include <catch2/catch.hpp>

#include <kvscore/eval/metrics.hpp>
#include <kvscore/io/npy.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using kvscore::eval::HeadReference;
using Catch::Matchers::Contains;

std::string eval_data(const std::string& f) { return std::string(KVSCORE_TEST_DATA_DIR) + "/eval/" + f; }

bool eval_close(double a, double b) { return std::abs(a - b) <= 1e-10 * std::abs(b) + 1e-12; }

}  // namespace

TEST_CASE("eval metrics: golden values against numpy", "[eval]") {
  const auto K = kvscore::npy::load(eval_data("keys.npy"));
  const auto V = kvscore::npy::load(eval_data("values.npy"));
  const auto Q = kvscore::npy::load(eval_data("queries.npy"));
  const auto S = kvscore::npy::load(eval_data("kept.npy"));
  const auto E = kvscore::npy::load(eval_data("expected.npy"));
  const auto LSE = kvscore::npy::load(eval_data("lse.npy"));
  const auto O = kvscore::npy::load(eval_data("full_out.npy"));
  const std::int64_t N = K.shape[0], d = K.shape[1], dv = V.shape[1], R = Q.shape[0];
  REQUIRE(N == 37);
  const HeadReference ref(K.as<float>(), d, V.as<float>(), dv, Q.as<float>(), d, R, N, d, dv);
  const std::span<const std::int64_t> kept(S.as<std::int64_t>(), std::size_t(S.shape[0]));
  for (std::int64_t r = 0; r < R; ++r) {
    INFO("row " << r);
    CHECK(eval_close(ref.lse(r), LSE.as<double>()[r]));
    for (std::int64_t j = 0; j < dv; ++j) CHECK(eval_close(ref.full_output(r)[j], O.as<double>()[r * dv + j]));
    const auto m = ref.row_metrics(r, kept);
    CHECK(eval_close(m.recall, E.as<double>()[r * 3 + 0]));
    CHECK(eval_close(m.rel_error, E.as<double>()[r * 3 + 1]));
    CHECK(m.overlap == E.as<double>()[r * 3 + 2]);  // a ratio of small integers
  }
}

TEST_CASE("eval metrics: keeping everything is exact, probabilities sum to 1", "[eval]") {
  const auto K = kvscore::npy::load(eval_data("keys.npy"));
  const auto V = kvscore::npy::load(eval_data("values.npy"));
  const auto Q = kvscore::npy::load(eval_data("queries.npy"));
  const std::int64_t N = K.shape[0], d = K.shape[1], dv = V.shape[1], R = Q.shape[0];
  const HeadReference ref(K.as<float>(), d, V.as<float>(), dv, Q.as<float>(), d, R, N, d, dv);
  std::vector<std::int64_t> all(static_cast<std::size_t>(N));
  for (std::int64_t t = 0; t < N; ++t) all[std::size_t(t)] = t;
  for (std::int64_t r = 0; r < R; ++r) {
    double s = 0;
    for (std::int64_t t = 0; t < N; ++t) s += ref.prob(r, t);
    CHECK(s == Approx(1.0).margin(1e-14));
    const auto m = ref.row_metrics(r, all);
    CHECK(m.recall == Approx(1.0).margin(1e-14));
    CHECK(m.rel_error < 1e-14);
    CHECK(m.overlap == 1.0);
  }
}

TEST_CASE("eval metrics: closed forms on two tokens", "[eval]") {
  // d = 1, keys 0 and 2, query 1 → logits 0 and 2 (scale 1/√1); p = (1, e²)/(1 + e²).
  const float keys[] = {0.f, 2.f}, values[] = {1.f, 3.f}, q[] = {1.f};
  const HeadReference ref(keys, 1, values, 1, q, 1, 1, 2, 1, 1);
  const double e2 = std::exp(2.0), p0 = 1 / (1 + e2), p1 = e2 / (1 + e2);
  CHECK(ref.prob(0, 0) == Approx(p0).epsilon(1e-14));
  CHECK(ref.full_output(0)[0] == Approx(p0 * 1 + p1 * 3).epsilon(1e-14));
  const std::vector<std::int64_t> only1 = {1}, only0 = {0}, none = {};
  // keeping token 1: mass p1, output 3 (softmax over one token), overlap 1 (it is the top-1)
  auto m = ref.row_metrics(0, only1);
  CHECK(m.recall == Approx(p1).epsilon(1e-14));
  const double full = p0 + 3 * p1;
  CHECK(m.rel_error == Approx((3 - full) / full).epsilon(1e-12));
  CHECK(m.overlap == 1.0);
  m = ref.row_metrics(0, only0);
  CHECK(m.recall == Approx(p0).epsilon(1e-14));
  CHECK(m.rel_error == Approx((full - 1) / full).epsilon(1e-12));
  CHECK(m.overlap == 0.0);
  // the empty set: recall 0, output 0 → error 1, overlap 1 (documented convention)
  m = ref.row_metrics(0, none);
  CHECK(m.recall == 0.0);
  CHECK(m.rel_error == Approx(1.0));
  CHECK(m.overlap == 1.0);
}

TEST_CASE("eval metrics: zero full output gives the absolute error", "[eval]") {
  const float keys[] = {1.f, 1.f}, values[] = {0.f, 0.f}, q[] = {1.f};
  const HeadReference ref(keys, 1, values, 1, q, 1, 1, 2, 1, 1);
  const std::vector<std::int64_t> one = {0};
  CHECK(ref.row_metrics(0, one).rel_error == 0.0);
  const double a[] = {3.0, 4.0}, z[] = {0.0, 0.0};
  CHECK(kvscore::eval::relative_error(a, z, 2) == 5.0);
}

TEST_CASE("eval metrics: large logit gaps do not underflow the kept output", "[eval]") {
  // logits 0 and -2000: p of token 1 underflows to 0, yet keeping only token 1 must give its
  // value exactly (softmax over the kept logits with their own max), not 0/0.
  const float keys[] = {0.f, -2000.f}, values[] = {1.f, 7.f}, q[] = {1.f};
  const HeadReference ref(keys, 1, values, 1, q, 1, 1, 2, 1, 1);
  const std::vector<std::int64_t> one = {1};
  const auto m = ref.row_metrics(0, one);
  CHECK(m.recall == 0.0);
  CHECK(m.rel_error == Approx(6.0).epsilon(1e-14));  // |7 - 1| / 1
}

TEST_CASE("eval metrics: ranks break ties by lower position", "[eval]") {
  const double l[] = {1.0, 3.0, 1.0, 3.0, 2.0};
  std::int32_t rank[5];
  kvscore::eval::attention_ranks(l, 5, rank);
  CHECK(rank[1] == 0);
  CHECK(rank[3] == 1);
  CHECK(rank[4] == 2);
  CHECK(rank[0] == 3);
  CHECK(rank[2] == 4);
  const std::vector<std::int64_t> s = {1, 4};  // k = 2: top-2 is {1, 3}
  CHECK(kvscore::eval::topk_overlap(rank, s) == 0.5);
}

TEST_CASE("eval metrics: bad kept sets and shapes are rejected", "[eval]") {
  const float keys[] = {0.f, 1.f, 2.f}, values[] = {1.f, 2.f, 3.f}, q[] = {1.f};
  const HeadReference ref(keys, 1, values, 1, q, 1, 1, 3, 1, 1);
  const std::vector<std::int64_t> out_of_range = {0, 3}, unsorted = {2, 1}, dup = {1, 1}, neg = {-1};
  CHECK_THROWS_WITH(ref.row_metrics(0, out_of_range), Contains("kept position 3") && Contains("[0, 3)"));
  CHECK_THROWS_WITH(ref.row_metrics(0, unsorted), Contains("ascend") && Contains("1 after 2"));
  CHECK_THROWS_WITH(ref.row_metrics(0, dup), Contains("1 after 1"));
  CHECK_THROWS_WITH(ref.row_metrics(0, neg), Contains("kept position -1"));
  CHECK_THROWS_WITH(HeadReference(keys, 1, values, 1, q, 1, 1, 0, 1, 1), Contains("at least one token (got 0)"));
  CHECK_THROWS_WITH(HeadReference(keys, 1, values, 1, q, 1, 0, 3, 1, 1), Contains("at least one query (got 0)"));
  CHECK_THROWS_AS(HeadReference(keys, 1, values, 1, q, 1, 1, 3, 0, 1), std::invalid_argument);
}
