// Every kernel table the machine supports against the scalar table, on the same data.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
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

TEST_CASE("KVzip's row kernels on every table: max_f32, exp_sum (exp_shifted's values and their sum), max_scaled",
          "[simd][kvzip]") {
  for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(15), std::size_t(203), std::size_t(3000)}) {
    std::vector<float> x(n), e(n), ref(n), acc(n), acc0(n), kw(n);
    for (std::size_t i = 0; i < n; ++i) {
      x[i] = -30.f + 0.37f * float((i * 7919) % 101);
      acc0[i] = 0.001f * float(i % 17);
      kw[i] = 0.5f + 0.01f * float(i % 29);
    }
    if (n > 4) x[3] = -std::numeric_limits<float>::infinity();  // an excluded key
    const float mx = n ? *std::max_element(x.begin(), x.end()) : -std::numeric_limits<float>::infinity();
    for (const auto* t : simd::available_tables()) {
      INFO("isa " << t->name << " n " << n);
      CHECK(t->max_f32(x.data(), std::int64_t(n)) == mx);
      const double z = t->exp_sum(x.data(), mx, std::int64_t(n), e.data());
      t->exp_shifted(x.data(), mx, std::int64_t(n), ref.data());
      double want = 0;
      for (std::size_t i = 0; i < n; ++i) {
        CHECK(e[i] == ref[i]);  // the same values as exp_shifted
        want += double(ref[i]);
      }
      CHECK(z == Approx(want).epsilon(1e-6));
      for (const float* w : {static_cast<const float*>(nullptr), static_cast<const float*>(kw.data())}) {
        acc = acc0;
        t->max_scaled(e.data(), 0.75f, w, std::int64_t(n), acc.data());
        for (std::size_t i = 0; i < n; ++i) {
          float v = e[i] * 0.75f;
          if (w) v *= w[i];
          CHECK(acc[i] == std::max(acc0[i], v));
        }
      }
    }
  }
}

TEST_CASE("gemm_panels on every table: the dot products of queries and packed keys, independent of the tiling",
          "[simd][kvzip]") {
  const std::int64_t nk = 53, d = 37, nq = 29;  // partial panels, partial query tiles, odd head_dim
  std::vector<float> k(std::size_t(nk * d)), q(std::size_t(nq * d));
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::sin(0.37f * float(i));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.11f * float(i));
  for (const auto* t : simd::available_tables()) {
    INFO("isa " << t->name);
    std::vector<float> kp(std::size_t(((nk + simd::kGemmPanel - 1) / simd::kGemmPanel) * simd::kGemmPanel * d), -1.f);
    t->pack_panels(k.data(), nk, d, d, kp.data());
    std::vector<float> out(std::size_t(nq * (nk + 3)), 9.f);
    t->gemm_panels(q.data(), nq, kp.data(), nk, d, out.data(), nk + 3);
    for (std::int64_t i = 0; i < nq; ++i) {
      for (std::int64_t c = 0; c < nk; ++c) {
        double want = 0, mag = 0;
        for (std::int64_t j = 0; j < d; ++j) {
          want += double(q[std::size_t(i * d + j)]) * double(k[std::size_t(c * d + j)]);
          mag += std::abs(double(q[std::size_t(i * d + j)]) * double(k[std::size_t(c * d + j)]));
        }
        CHECK(std::abs(double(out[std::size_t(i * (nk + 3) + c)]) - want) <= 1e-6 * mag);
      }
      for (std::int64_t c = nk; c < nk + 3; ++c) CHECK(out[std::size_t(i * (nk + 3) + c)] == 9.f);  // untouched
    }
    // one query at a time, and the keys from panel 1 on: the same values
    std::vector<float> one(static_cast<std::size_t>(nk));
    for (std::int64_t i = 0; i < nq; i += 5) {
      t->gemm_panels(q.data() + i * d, 1, kp.data(), nk, d, one.data(), nk);
      for (std::int64_t c = 0; c < nk; ++c) CHECK(one[std::size_t(c)] == out[std::size_t(i * (nk + 3) + c)]);
      t->gemm_panels(q.data() + i * d, 1, kp.data() + simd::kGemmPanel * d, nk - simd::kGemmPanel, d, one.data(), nk);
      for (std::int64_t c = simd::kGemmPanel; c < nk; ++c)
        CHECK(one[std::size_t(c - simd::kGemmPanel)] == out[std::size_t(i * (nk + 3) + c)]);
    }
  }
}

TEST_CASE("int4_dots on every table: the exact integer sums of int16 weights and packed 4-bit codes",
          "[simd][block_sparse]") {
  // brute force in int64 against every table, at the weights' extremes (±32767, -32768) and codes
  // 0..15: 32-token blocks (h = 16: the paired-dimension path on AVX2 / AVX-512), other block
  // sizes, odd head_dim, 1..9 queries (partial query groups)
  std::mt19937 rng(7);
  for (const std::int64_t h : {std::int64_t(16), std::int64_t(8), std::int64_t(3)}) {
    for (const std::int64_t d : {std::int64_t(64), std::int64_t(37), std::int64_t(1), std::int64_t(2)}) {
      for (const std::int64_t g : {std::int64_t(1), std::int64_t(3), std::int64_t(4), std::int64_t(9)}) {
        std::vector<std::int16_t> w(std::size_t(g * d));
        std::vector<std::uint8_t> codes(std::size_t((d + 1) / 2 * 2 * h));  // pairs of dimensions
        for (std::size_t i = 0; i < w.size(); ++i)
          w[i] = i % 5 == 0 ? std::int16_t(i % 2 ? 32767 : -32768) : std::int16_t(int(rng() % 65535) - 32767);
        for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = i % 7 == 0 ? 0xff : std::uint8_t(rng() & 0xff);
        std::vector<std::int64_t> want(std::size_t(g * 2 * h));
        for (std::int64_t k = 0; k < g; ++k)
          for (std::int64_t t = 0; t < 2 * h; ++t) {
            std::int64_t s = 0;
            for (std::int64_t j = 0; j < d; ++j) {
              const std::uint8_t c = codes[std::size_t((j / 2) * 2 * h + 2 * (t % h) + j % 2)];
              s += std::int64_t(w[std::size_t(k * d + j)]) * (t < h ? c & 15 : c >> 4);
            }
            want[std::size_t(k * 2 * h + t)] = s;
          }
        for (const auto* tb : simd::available_tables()) {
          INFO("isa " << tb->name << " h " << h << " d " << d << " g " << g);
          std::vector<std::int32_t> acc(std::size_t(g * 2 * h), 12345);
          tb->int4_dots(w.data(), g, d, codes.data(), h, acc.data());
          for (std::size_t i = 0; i < acc.size(); ++i) REQUIRE(std::int64_t(acc[i]) == want[i]);
        }
      }
    }
  }
}

TEST_CASE("int4_quest, int4_summarize, int4_block on every table: their definitions, bit for bit on every table",
          "[simd][block_sparse]") {
  // each table against the definitions written out here (plain loops, no table), and every table's
  // bits equal (the block choice must not depend on the ISA): odd lengths (vector tails), blocks
  // of 32 and others, non-finite keys and queries
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  auto bits = [](float x) { return std::bit_cast<std::uint32_t>(x); };
  for (const std::int64_t d : {std::int64_t(64), std::int64_t(37), std::int64_t(16), std::int64_t(3)}) {
    for (const std::int64_t n : {std::int64_t(32), std::int64_t(17), std::int64_t(1), std::int64_t(600)}) {
      for (int trial = 0; trial < 4; ++trial) {
        const std::int64_t h = (n + 1) / 2, g = 3;
        std::vector<float> x(std::size_t(d * (n + 5))), q(std::size_t(g * d));
        for (auto& v : x) v = nd(rng) * (trial == 1 ? 1e-3f : 2.f) + 0.5f;
        for (auto& v : q) v = nd(rng);
        if (trial == 2) {  // non-finite keys: a NaN first in a row, one later, an infinity
          x[0] = nan;
          x[std::size_t(1 * (n + 5) + n / 2)] = nan;
          x[std::size_t(2 % d * (n + 5) + n - 1)] = inf;
        }
        if (trial == 3) x[std::size_t((d - 1) * (n + 5))] = x[std::size_t((d - 1) * (n + 5) + 1)];  // equal keys: step 0 when n = 1
        // int4_summarize: min, max, step and nearest-even codes per dimension
        std::vector<float> lo0(d), st0(d), hi0(d);
        const std::int64_t cb = (d + 1) / 2 * 2 * h;  // codes in pairs of dimensions (table.hpp)
        auto at = [&](std::int64_t j, std::int64_t t) { return std::size_t((j / 2) * 2 * h + 2 * (t % h) + j % 2); };
        std::vector<std::uint8_t> c0(static_cast<std::size_t>(cb));
        for (std::int64_t j = 0; j < d; ++j) {
          const float* r = x.data() + j * (n + 5);
          float a = r[0], b = r[0];
          for (std::int64_t t = 1; t < n; ++t) {
            a = std::min(a, r[t]);
            b = std::max(b, r[t]);
          }
          lo0[j] = a;
          hi0[j] = b;
          st0[j] = (b - a) / 15.f;
          const float inv = st0[j] > 0.f ? 1.f / st0[j] : 0.f;
          for (std::int64_t t = 0; t < n; ++t) {
            const float u = (r[t] - a) * inv;
            const int c = u <= 16.f ? std::clamp(int(std::nearbyint(u)), 0, 15) : 0;
            c0[at(j, t)] |= std::uint8_t(t < h ? c : c << 4);
          }
        }
        // int4_quest: 16 lanes of max(q·lo, q·hi), lane l over j ≡ l (mod 16)
        std::vector<float> lanes0(std::size_t(g * 16), 0.f);
        for (std::int64_t k = 0; k < g; ++k)
          for (std::int64_t j = 0; j < d; ++j)
            lanes0[std::size_t(k * 16 + j % 16)] += std::max(q[std::size_t(k * d + j)] * lo0[j], q[std::size_t(k * d + j)] * hi0[j]);
        // int4_block: weights from the largest |q·step|, the best token's integer sum, q·lo in 16
        // lanes (each product rounded before its add: volatile keeps a compiler that may use FMA
        // here from fusing them, as no table may)
        std::vector<float> qlo0(std::size_t(g * 16), 0.f);
        for (std::int64_t k = 0; k < g; ++k)
          for (std::int64_t j = 0; j < d; ++j) {
            volatile float p = q[std::size_t(k * d + j)] * lo0[j];
            qlo0[std::size_t(k * 16 + j % 16)] += p;
          }
        std::vector<std::int32_t> best0(g);
        std::vector<float> scale0(g);
        for (std::int64_t k = 0; k < g; ++k) {
          float top = 0.f;
          bool nonfinite = false;
          for (std::int64_t j = 0; j < d; ++j) {
            const float a = std::fabs(q[std::size_t(k * d + j)] * st0[j]);
            if (std::isnan(a)) nonfinite = true;
            else top = std::max(top, a);
          }
          if (nonfinite) top = nan;
          scale0[k] = top / 32767.f;
          const float inv = top > 0.f && std::isfinite(top) ? 32767.f / top : 0.f;
          std::int64_t best = std::numeric_limits<std::int64_t>::min();
          for (std::int64_t t = 0; t < n; ++t) {
            std::int64_t s = 0;
            for (std::int64_t j = 0; j < d; ++j) {
              const int w = inv == 0.f ? 0 : int(std::nearbyint((q[std::size_t(k * d + j)] * st0[j]) * inv));
              const std::uint8_t c = c0[at(j, t)];
              s += std::int64_t(w) * (t < h ? c & 15 : c >> 4);
            }
            best = std::max(best, s);
          }
          best0[k] = std::int32_t(best);
        }
        for (const auto* tb : simd::available_tables()) {
          INFO("isa " << tb->name << " d " << d << " n " << n << " trial " << trial);
          std::vector<float> lo(d), st(d), hi(d), lanes(std::size_t(g * 16));
          std::vector<std::uint8_t> c(std::size_t(cb), 0xaa);
          tb->int4_summarize(x.data(), n + 5, n, d, lo.data(), st.data(), hi.data(), c.data());
          for (std::int64_t j = 0; j < d; ++j) {
            REQUIRE(bits(lo[j]) == bits(lo0[j]));
            REQUIRE(bits(hi[j]) == bits(hi0[j]));
            REQUIRE(bits(st[j]) == bits(st0[j]));
          }
          REQUIRE(c == c0);
          tb->int4_quest(q.data(), g, d, lo0.data(), hi0.data(), lanes.data());
          for (std::size_t i = 0; i < lanes.size(); ++i) REQUIRE(bits(lanes[i]) == bits(lanes0[i]));
          std::vector<std::int16_t> w(std::size_t(g * d));
          std::vector<std::int32_t> acc(std::size_t(g * 2 * h)), best(g);
          std::vector<float> scale(g), qlo(std::size_t(g * 16), -1.f);
          tb->int4_block(q.data(), g, d, lo0.data(), st0.data(), c0.data(), n, w.data(), acc.data(), best.data(),
                         scale.data(), qlo.data());
          for (std::size_t i = 0; i < qlo.size(); ++i) REQUIRE(bits(qlo[i]) == bits(qlo0[i]));
          for (std::int64_t k = 0; k < g; ++k) {
            REQUIRE(bits(scale[k]) == bits(scale0[k]));
            if (std::isfinite(scale0[k])) REQUIRE(best[k] == best0[k]);
          }
        }
      }
    }
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

TEST_CASE("each table carries its ISA level - pinning it caps every kernel family at that level", "[simd]") {
  using kvscore::IsaLevel;
  CHECK(kvscore::detail::isa_level("scalar") == IsaLevel::scalar);
  CHECK(kvscore::detail::isa_level("sse2") == IsaLevel::baseline);
  CHECK(kvscore::detail::isa_level("neon") == IsaLevel::baseline);
  CHECK(kvscore::detail::isa_level("fma3+avx2") == IsaLevel::avx2);
  CHECK(kvscore::detail::isa_level("avx512bw") == IsaLevel::avx512);
  const simd::KernelTable& before = simd::active_table();
  for (const simd::KernelTable* t : simd::available_tables()) {
    INFO("table " << t->name);
    CHECK(t->level == kvscore::detail::isa_level(t->name));
    simd::set_active_isa(t->name);
    CHECK(simd::isa_cap() == t->level);
  }
  simd::set_active_isa(before.name);
}

namespace {

// project / unproject (OjaKV's codes and reconstructions) on table t against the scalar table,
// the row's `dot` on the same table, and a plain fp64 loop. Tolerances are the fp32 summation
// bound: (terms + 2) · 2^-23 · Σ|term| (the kernels sum terms in fp32 in some order).
template <class T>
void check_projection(const simd::KernelTable& t, std::int64_t d, std::int64_t r) {
  const std::int64_t n = 37, stride = d + 5;  // n % 4 != 0, padded rows
  const std::int64_t bad_nan = 5, bad_inf = 22;
  std::mt19937 rng(static_cast<unsigned>(d * 131 + r));
  std::normal_distribution<float> g(0.25f, 1.5f);
  std::vector<T> rows(std::size_t(n * stride), from_float<T>(1e30f));  // the padding must not be read
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t k = 0; k < d; ++k) rows[std::size_t(i * stride + k)] = from_float<T>(g(rng));
  rows[std::size_t(bad_nan * stride + d / 3)] = from_float<T>(NAN);
  rows[std::size_t(bad_inf * stride + d - 1)] = from_float<T>(-INFINITY);
  std::vector<float> basis(std::size_t(r * d)), codes(std::size_t(n * r));
  for (auto& x : basis) x = g(rng);
  for (auto& x : codes) x = g(rng);
  codes[std::size_t(bad_nan * r + r / 2)] = NAN;
  codes[std::size_t(bad_inf * r)] = INFINITY;
  const float eps = 0x1p-23f;
  const float sentinel = 7.5e33f;

  INFO("isa " << t.name << " dtype " << dtype_name(dtype_of<T>()) << " d " << d << " r " << r);
  // project: n x r, one extra slot that must stay untouched
  std::vector<float> p(std::size_t(n * r + 1), sentinel), ps(std::size_t(n * r + 1), sentinel), dots(static_cast<std::size_t>(n));
  t.ops<T>().project(rows.data(), n, stride, d, basis.data(), r, p.data());
  simd::scalar_table().ops<T>().project(rows.data(), n, stride, d, basis.data(), r, ps.data());
  REQUIRE(p.back() == sentinel);
  for (std::int64_t j = 0; j < r; ++j) {
    t.ops<T>().dot(rows.data(), n, stride, d, basis.data() + j * d, dots.data());
    for (std::int64_t i = 0; i < n; ++i) {
      INFO("row " << i << " basis row " << j);
      const float got = p[std::size_t(i * r + j)], ref = ps[std::size_t(i * r + j)];
      if (i == bad_nan || i == bad_inf) {  // a row holding NaN/Inf: every code of it is non-finite
        REQUIRE(!std::isfinite(got));
        REQUIRE(!std::isfinite(ref));
        continue;
      }
      double exact = 0, mag = 0;
      for (std::int64_t k = 0; k < d; ++k) {
        const double term = double(to_float(rows[std::size_t(i * stride + k)])) * double(basis[std::size_t(j * d + k)]);
        exact += term;
        mag += std::fabs(term);
      }
      const double tol = double(d + 2) * eps * mag;
      REQUIRE(std::fabs(double(got) - exact) <= tol);
      REQUIRE(std::fabs(double(ref) - exact) <= tol);
      REQUIRE(std::fabs(double(got) - double(dots[std::size_t(i)])) <= tol);  // the table's own dot
    }
  }
  // unproject: n x d from the codes
  std::vector<float> u(std::size_t(n * d + 1), sentinel), us(std::size_t(n * d + 1), sentinel);
  t.unproject(codes.data(), n, r, basis.data(), d, u.data());
  simd::scalar_table().unproject(codes.data(), n, r, basis.data(), d, us.data());
  REQUIRE(u.back() == sentinel);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t k = 0; k < d; ++k) {
      INFO("row " << i << " dim " << k);
      const float got = u[std::size_t(i * d + k)], ref = us[std::size_t(i * d + k)];
      if (i == bad_nan || i == bad_inf) {  // a code row holding NaN/Inf: its whole row is non-finite
        REQUIRE(!std::isfinite(got));
        REQUIRE(!std::isfinite(ref));
        continue;
      }
      double exact = 0, mag = 0;
      for (std::int64_t j = 0; j < r; ++j) {
        const double term = double(codes[std::size_t(i * r + j)]) * double(basis[std::size_t(j * d + k)]);
        exact += term;
        mag += std::fabs(term);
      }
      const double tol = double(r + 2) * eps * mag;
      REQUIRE(std::fabs(double(got) - exact) <= tol);
      REQUIRE(std::fabs(double(ref) - exact) <= tol);
    }
  // Deterministic and independent of grouping: the same rows projected from row 3 on (other
  // groups of four, another tail) and a second call give the same codes, bit for bit.
  std::vector<float> p2(std::size_t(n * r), sentinel);
  t.ops<T>().project(rows.data() + 3 * stride, n - 3, stride, d, basis.data(), r, p2.data());
  for (std::int64_t i = 3; i < n; ++i)
    for (std::int64_t j = 0; j < r; ++j) {
      const float a = p[std::size_t(i * r + j)], b = p2[std::size_t((i - 3) * r + j)];
      REQUIRE((a == b || (std::isnan(a) && std::isnan(b))));
    }
  std::vector<float> u2(std::size_t(n * d), sentinel);
  t.unproject(codes.data() + r, n - 1, r, basis.data(), d, u2.data());
  for (std::int64_t i = 1; i < n; ++i)
    for (std::int64_t k = 0; k < d; ++k) {
      const float a = u[std::size_t(i * d + k)], b = u2[std::size_t((i - 1) * d + k)];
      REQUIRE((a == b || (std::isnan(a) && std::isnan(b))));
    }
}

}  // namespace

TEST_CASE("project / unproject (OjaKV) agree on every table with scalar and an fp64 loop", "[simd][ojakv]") {
  for (const simd::KernelTable* t : simd::available_tables())
    for (std::int64_t d : {1, 7, 16, 33, 128})
      for (std::int64_t r : {1, 3, 32}) {
        check_projection<float>(*t, d, r);
        check_projection<half>(*t, d, r);
        check_projection<bfloat16>(*t, d, r);
      }
}
