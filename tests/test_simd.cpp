// Every kernel table the machine supports against the scalar table, on the same data.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kvscore/simd/dispatch.hpp"

using namespace kvscore;

namespace {

template <class T>
void compare_tables(std::int64_t d) {
  const std::int64_t n = 200, stride = d + 3;  // padded rows: the kernels must honour the stride
  std::mt19937 rng(static_cast<unsigned>(d));
  std::normal_distribution<float> g(0.5f, 2.f);
  std::vector<T> rows(std::size_t(n * stride));
  for (auto& x : rows) x = from_float<T>(g(rng));
  std::vector<float> v(static_cast<std::size_t>(d));
  for (auto& x : v) x = g(rng);
  // row 17 holds a NaN, row 50 an Inf: dot must come out non-finite for both
  rows[std::size_t(17 * stride + d / 2)] = from_float<T>(NAN);
  rows[std::size_t(50 * stride)] = from_float<T>(INFINITY);

  const simd::KernelTable& ref = simd::scalar_table();
  std::vector<float> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n)), na(static_cast<std::size_t>(n)), nb(static_cast<std::size_t>(n));
  std::vector<double> acc_a(static_cast<std::size_t>(d)), acc_b(static_cast<std::size_t>(d));
  auto close = [](float x, float y, float scale) {
    if (std::isnan(x) || std::isnan(y)) return std::isnan(x) && std::isnan(y);
    if (std::isinf(x) || std::isinf(y)) return x == y;
    return std::fabs(x - y) <= 1e-5f * (std::fabs(y) + scale);
  };
  for (const simd::KernelTable* t : simd::available_tables()) {
    INFO("isa " << t->name << " dtype " << dtype_name(dtype_of<T>()) << " d " << d);
    const auto& o = t->ops<T>();
    const auto& r = ref.ops<T>();
    const float scale = float(d);
    o.sqnorm(rows.data(), n, stride, d, a.data());
    r.sqnorm(rows.data(), n, stride, d, b.data());
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(close(a[std::size_t(i)], b[std::size_t(i)], scale));
    o.dot(rows.data(), n, stride, d, v.data(), a.data());
    r.dot(rows.data(), n, stride, d, v.data(), b.data());
    REQUIRE(!std::isfinite(a[17]));
    REQUIRE(!std::isfinite(a[50]));
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(close(a[std::size_t(i)], b[std::size_t(i)], scale));
    o.dot_sqnorm(rows.data(), n, stride, d, v.data(), na.data(), nb.data());
    for (std::int64_t i = 0; i < n; ++i) {
      REQUIRE(close(na[std::size_t(i)], b[std::size_t(i)], scale));  // b still holds the scalar dots
      REQUIRE(std::isfinite(nb[std::size_t(i)]) == (i != 17 && i != 50));
    }
    r.sqnorm(rows.data(), n, stride, d, a.data());
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(close(nb[std::size_t(i)], a[std::size_t(i)], scale));
    o.sqdist(rows.data(), n, stride, d, v.data(), a.data());
    r.sqdist(rows.data(), n, stride, d, v.data(), b.data());
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(close(a[std::size_t(i)], b[std::size_t(i)], scale));

    std::fill(acc_a.begin(), acc_a.end(), 0.0);
    std::fill(acc_b.begin(), acc_b.end(), 0.0);
    REQUIRE(o.sum(rows.data(), n, stride, d, acc_a.data(), na.data()) == n - 2);
    REQUIRE(r.sum(rows.data(), n, stride, d, acc_b.data(), nb.data()) == n - 2);
    // independent check of the sum: plain double loop over the finite rows
    for (std::int64_t j = 0; j < d; ++j) {
      double s = 0;
      for (std::int64_t i = 0; i < n; ++i)
        if (i != 17 && i != 50) s += double(to_float(rows[std::size_t(i * stride + j)]));
      REQUIRE(acc_a[std::size_t(j)] == Approx(s).margin(1e-3));
      REQUIRE(acc_b[std::size_t(j)] == Approx(s).margin(1e-3));
    }
    std::fill(acc_a.begin(), acc_a.end(), 0.0);
    std::fill(acc_b.begin(), acc_b.end(), 0.0);
    REQUIRE(o.sum_normalized(rows.data(), n, stride, d, acc_a.data(), na.data()) == n - 2);
    r.sum_normalized(rows.data(), n, stride, d, acc_b.data(), nb.data());
    for (std::int64_t j = 0; j < d; ++j) REQUIRE(acc_a[std::size_t(j)] == Approx(acc_b[std::size_t(j)]).margin(1e-4));
  }
}

}  // namespace

TEST_CASE("every SIMD table agrees with the scalar table", "[simd]") {
  std::string names;
  for (const auto* t : simd::available_tables()) names += std::string(t->name) + " ";
  WARN("kernel tables on this machine: " << names);
  REQUIRE(simd::available_tables().front() == &simd::scalar_table());
  for (std::int64_t d : {1, 7, 8, 16, 20, 64, 96, 128, 256}) {
    compare_tables<float>(d);
    compare_tables<half>(d);
    compare_tables<bfloat16>(d);
  }
}

TEST_CASE("reduce_f32 (bandwidth baseline) sums correctly on every table", "[simd]") {
  std::vector<float> x(10007);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = float(i % 13) - 6.f;
  double ref = 0;
  for (float f : x) ref += f;
  for (const auto* t : simd::available_tables()) REQUIRE(t->reduce_f32(x.data(), std::int64_t(x.size())) == Approx(ref));
}

TEST_CASE("exp_shifted matches std::exp on every table - a value does not depend on its offset", "[simd]") {
  std::vector<float> x(203);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = -87.f + 0.43f * float(i);  // exp range incl. underflow
  x[5] = -std::numeric_limits<float>::infinity();                              // an excluded logit -> 0
  const float shift = 3.25f;
  for (const auto* t : simd::available_tables()) {
    INFO("isa " << t->name);
    std::vector<float> e(x.size(), -1.f), e2(x.size(), -1.f);
    t->exp_shifted(x.data(), shift, std::int64_t(x.size()), e.data());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double want = std::exp(double(x[i] - shift));  // the fp32 difference, as the kernel forms it
      INFO("i " << i << " x " << x[i]);
      CHECK(std::abs(double(e[i]) - want) <= 1e-6 * want + 1e-37);
    }
    CHECK(e[5] == 0.f);
    // The same element computed in a call that starts 7 elements later (a different tail).
    t->exp_shifted(x.data() + 7, shift, std::int64_t(x.size()) - 7, e2.data());
    for (std::size_t i = 7; i < x.size(); ++i) CHECK(e2[i - 7] == e[i]);
  }
}

TEST_CASE("set_active_isa pins a table - unknown names throw with the list", "[simd][errors]") {
  const simd::KernelTable& before = simd::active_table();
  simd::set_active_isa("scalar");
  REQUIRE(&simd::active_table() == &simd::scalar_table());
  try {
    simd::set_active_isa("avx9000");
    FAIL("no throw");
  } catch (const std::invalid_argument& e) {
    REQUIRE_THAT(e.what(), Catch::Contains("avx9000") && Catch::Contains("scalar"));
  }
  simd::set_active_isa(before.name);
  REQUIRE(&simd::active_table() == &before);
}
