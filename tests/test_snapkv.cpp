// SnapKV (include/kvscore/scorers/snapkv.hpp, docs/methods/snapkv.md): golden values against the
// numpy fixtures in tests/data/snapkv/ (tools/gen_snapkv_fixtures.py), a float64
// brute-force reference for random shapes, closed forms, invariants, invalid rows,
// error paths and determinism.
//
// Tolerance. A score is a positive combination of probabilities p = exp(l - m)/s with
// fp32 logits l = q̃·k (q̃ = q/√d rounded to fp32 once, the dot summed in fp32 lanes,
// any order). The dot's error is at most γ_d·Σ_j|q̃_j k_j| <= (d+1)u·L with u = 2^-24
// and L = max over the head's queries and valid keys of Σ_j|q_j k_j|/√d; p inherits
// the error of l, of the max m (the same rounding, no new error) and of the sum s (a
// weighted mean of the same errors), so |δp|/p <= 3(d+2)u·L, plus a few u for expf,
// the fp64 sums and the final rounding to fp32. Means and pooling add positive terms,
// which keeps the relative bound. So
//
//     |actual - expected| <= (3(d+2)·L + 8)·u · |expected| + 1e-30
//
// per KV head (1e-30 covers exp underflow in fp32). On the fixtures L is 10-40, so the
// bound is 1e-5..1e-4 relative, while each plausible mistake (no causal mask, pooling
// over the window too, no pooling, one head of the group only) moves some score by more
// than 2% (the generator asserts it).
#include <catch2/catch.hpp>

#include <kvscore/kvscore.hpp>
#include <kvscore/io/npy.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using kvscore::SnapKV;
using Catch::Matchers::Contains;
using namespace test_support;  // randn, kernel_tables, BlockView, fixtures, ...

constexpr double kU = 1.0 / 16777216.0;  // 2^-24

// ----------------------------------------------------------------- float64 reference

/// Keys widened to double, [H][N][d] (any memory layout is copied into this order first).
struct Ref {
  std::int64_t H = 0, N = 0, d = 0;
  std::vector<double> k;
  double at(std::int64_t h, std::int64_t t, std::int64_t j) const { return k[std::size_t((h * N + t) * d + j)]; }
  bool valid(std::int64_t h, std::int64_t t) const {
    double s = 0;
    for (std::int64_t j = 0; j < d; ++j) {
      const double x = at(h, t, j);
      if (!std::isfinite(x)) return false;
      s += x * x;
    }
    return s <= double(std::numeric_limits<float>::max());
  }
};

template <class T>
Ref widen(const std::vector<T>& keys, std::int64_t H, std::int64_t N, std::int64_t d) {
  Ref r{H, N, d, std::vector<double>(keys.size())};
  for (std::size_t i = 0; i < keys.size(); ++i) r.k[i] = double(kvscore::to_float(keys[i]));
  return r;
}

/// SnapKV in float64, straight from the definition (docs/methods/snapkv.md). after_cache: the queries
/// follow the cache, so every one sees all N keys and the whole cache is the pooled prefix.
std::vector<double> ref_snapkv(const Ref& r, const std::vector<float>& q, std::int64_t Hq, std::int64_t w,
                               std::int64_t kernel, bool after_cache = false) {
  const std::int64_t H = r.H, N = r.N, d = r.d, G = Hq / H, P = after_cache ? N : N - w;
  std::vector<double> out(std::size_t(H * N));
  for (std::int64_t h = 0; h < H; ++h) {
    std::vector<char> valid(static_cast<std::size_t>(N));
    for (std::int64_t t = 0; t < N; ++t) valid[std::size_t(t)] = r.valid(h, t);
    std::vector<double> x(static_cast<std::size_t>(N), 0.0), l(static_cast<std::size_t>(N));
    for (std::int64_t g = 0; g < G; ++g)
      for (std::int64_t i = 0; i < w; ++i) {
        const float* qi = q.data() + ((h * G + g) * w + i) * d;
        const std::int64_t seen = std::min(N, P + i + 1);
        double m = -INFINITY;
        for (std::int64_t t = 0; t < seen; ++t) {
          if (!valid[std::size_t(t)]) continue;
          double s = 0;
          for (std::int64_t j = 0; j < d; ++j) s += double(qi[j]) * r.at(h, t, j);
          l[std::size_t(t)] = s / std::sqrt(double(d));
          m = std::max(m, l[std::size_t(t)]);
        }
        if (m == -INFINITY) continue;  // a query that sees no valid key contributes nothing
        double z = 0;
        for (std::int64_t t = 0; t < seen; ++t)
          if (valid[std::size_t(t)]) z += std::exp(l[std::size_t(t)] - m);
        for (std::int64_t t = 0; t < seen; ++t)
          if (valid[std::size_t(t)]) x[std::size_t(t)] += std::exp(l[std::size_t(t)] - m) / z;
      }
    for (double& v : x) v /= double(G * w);
    const std::int64_t rad = kernel / 2;
    for (std::int64_t t = 0; t < N; ++t) {
      double s;
      if (t < P) {
        s = 0;
        for (std::int64_t u = t - rad; u <= t + rad; ++u)
          if (u >= 0 && u < P) s += x[std::size_t(u)];
        s /= double(kernel);
      } else {
        s = x[std::size_t(t)];
      }
      out[std::size_t(h * N + t)] = valid[std::size_t(t)] ? s : -INFINITY;
    }
  }
  return out;
}

/// Per KV head relative tolerance (see the top of the file).
std::vector<double> rel_tol(const Ref& r, const std::vector<float>& q, std::int64_t Hq, std::int64_t w) {
  const std::int64_t G = Hq / r.H;
  std::vector<double> tol(std::size_t(r.H));
  for (std::int64_t h = 0; h < r.H; ++h) {
    double L = 0;
    for (std::int64_t t = 0; t < r.N; ++t) {
      if (!r.valid(h, t)) continue;
      for (std::int64_t qi = 0; qi < G * w; ++qi) {
        const float* qv = q.data() + (h * G * w + qi) * r.d;
        double s = 0;
        for (std::int64_t j = 0; j < r.d; ++j) s += std::fabs(double(qv[j]) * r.at(h, t, j));
        L = std::max(L, s / std::sqrt(double(r.d)));
      }
    }
    tol[std::size_t(h)] = (3.0 * double(r.d + 2) * L + 8.0) * kU;
  }
  return tol;
}

/// Empty when every score matches; otherwise the first mismatches.
std::string compare(const float* actual, std::int64_t head_stride, const std::vector<double>& expected,
                    std::int64_t H, std::int64_t N, const std::vector<double>& tol) {
  std::ostringstream msg;
  int bad = 0;
  double worst = 0;
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t) {
      const double e = expected[std::size_t(h * N + t)], a = actual[h * head_stride + t];
      bool ok;
      if (std::isinf(e)) {
        ok = a == e;
      } else {
        const double err = std::fabs(a - e), lim = tol[std::size_t(h)] * std::fabs(e) + 1e-30;
        worst = std::max(worst, std::isnan(err) ? 1e300 : err / std::max(std::fabs(e), 1e-300));
        ok = err <= lim;
      }
      if (!ok && bad++ < 8) msg << "  [h=" << h << " t=" << t << "] actual " << a << " expected " << e << "\n";
    }
  if (bad == 0) return {};
  std::ostringstream out;
  out << bad << " of " << H * N << " scores out of tolerance (worst relative error " << worst << "):\n" << msg.str();
  return out.str();
}

// ----------------------------------------------------------------- fixtures

struct Case {
  std::string name, dir;
  std::int64_t kv = 0, hq = 0, group = 0, N = 0, d = 0, w = 0, kernel = 0;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const std::string& line : manifest("snapkv")) {
    Case c;
    c.name = line;
    c.dir = fixture_dir("snapkv") + "/" + line;
    const std::string p = read_text(c.dir + "/params.json");
    c.kv = json_int(p, "kv_heads"), c.hq = json_int(p, "q_heads"), c.group = json_int(p, "group");
    c.N = json_int(p, "tokens"), c.d = json_int(p, "head_dim"), c.w = json_int(p, "window");
    c.kernel = json_int(p, "kernel");
    out.push_back(c);
  }
  return out;
}

template <class T>
void run_golden(const Case& c) {
  const auto ka = kvscore::npy::load(c.dir + "/keys_" + type_tag<T>() + ".npy");
  REQUIRE(ka.shape == std::vector<std::int64_t>{c.kv, c.N, c.d});
  const std::vector<T> keys = ka.template to_vector<T>();
  const auto qa = kvscore::npy::load(c.dir + "/queries.npy");
  REQUIRE(qa.shape == std::vector<std::int64_t>{c.hq, c.w, c.d});
  const std::vector<float> q = qa.template to_vector<float>();
  const auto ea = kvscore::npy::load(c.dir + "/expected_" + type_tag<T>() + ".npy");
  REQUIRE(ea.shape == std::vector<std::int64_t>{c.kv, c.N});
  const std::vector<double> expected = ea.template to_vector<double>();
  const Ref r = widen(keys, c.kv, c.N, c.d);
  const std::vector<double> tol = rel_tol(r, q, c.hq, c.w);
  for (double t : tol) CHECK(t < 3e-4);  // the bound stays far below the 2% of a real mistake

  // The fixture agrees with this file's own float64 reference (the two definitions match).
  const std::vector<double> mine = ref_snapkv(r, q, c.hq, c.w, c.kernel);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (std::isinf(expected[i])) CHECK(mine[i] == expected[i]);
    else CHECK(std::fabs(mine[i] - expected[i]) <= 1e-12 * std::fabs(expected[i]));
  }

  const std::int64_t H = c.kv, N = c.N, d = c.d;
  const T junk = kvscore::from_float<T>(kNaN);
  const KeysView<T> hf(keys.data(), H, N, d, N * d, d);
  const std::int64_t cap = N + 3, batch = 2;  // static cache, our rows in batch row 1, NaN everywhere else
  std::vector<T> padded(std::size_t(batch * H * cap * d), junk);
  for (std::int64_t h = 0; h < H; ++h)
    std::memcpy(&padded[std::size_t((1 * H + h) * cap * d)], &keys[std::size_t(h * N * d)],
                std::size_t(N * d) * sizeof(T));
  const auto hf_cap = KeysView<T>::hf(padded.data(), 1, batch, H, N, d, cap);
  const std::vector<T> tm = test_support::token_major(keys, H, N, d);
  const auto token_major = KeysView<T>::token_major(tm.data(), N, H, d);
  const std::vector<T> blk = to_blocks(keys, H, N, d, 7);
  const BlockView<T> blocks{blk.data(), H, N, d, 7};

  SnapKV snap(q.data(), c.hq, c.w, d, c.group);
  REQUIRE(snap.kernel_size == c.kernel);
  REQUIRE(snap.protected_recent() == c.w);
  for (const auto* isa : kernel_tables()) {
    snap.isa = isa;
    const std::string isa_name = isa ? isa->name : "active";
    INFO("case " << c.name << ", dtype " << type_tag<T>() << ", isa " << isa_name);
    const Scores a = snap.score(hf);
    CHECK(compare(a.data(), N, expected, H, N, tol) == "");
    // Same rows, same chunks: bit-identical across these layouts.
    const Scores b = snap.score(hf_cap), e = snap.score(token_major);
    CHECK(std::memcmp(a.data(), b.data(), sizeof(float) * std::size_t(H * N)) == 0);
    CHECK(std::memcmp(a.data(), e.data(), sizeof(float) * std::size_t(H * N)) == 0);
    // Runs of 7 rows (a paged cache): other chunk boundaries, same scores within tolerance.
    const Scores f = snap.score(blocks);
    CHECK(compare(f.data(), N, expected, H, N, tol) == "");
    // Caller-owned output with a padded head stride: the gaps stay untouched.
    const std::int64_t os = N + 2;
    std::vector<float> buf(std::size_t(H * os), -12345.5f);
    snap.score(hf, ScoresView(buf.data(), H, N, os));
    CHECK(compare(buf.data(), os, expected, H, N, tol) == "");
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = N; t < os; ++t) CHECK(buf[std::size_t(h * os + t)] == -12345.5f);
  }
  // group = 0 derives the group from the keys: same scores.
  SnapKV derived(q.data(), c.hq, c.w, d);
  CHECK(derived.score(hf).values() == snap.score(hf).values());
}

}  // namespace

TEST_CASE("SnapKV golden: fixtures present (GQA 1/2/4, d 8/33/64, w 8/12/64)", "[snapkv]") {
  const auto cs = cases();
  REQUIRE(cs.size() >= 4);
  bool g2 = false, g4 = false, w8 = false, w64 = false, odd_d = false, invalid = false;
  for (const Case& c : cs) {
    CHECK(c.hq == c.kv * c.group);
    CHECK(c.kernel == 5);
    g2 |= c.group == 2;
    g4 |= c.group == 4;
    w8 |= c.w == 8;
    w64 |= c.w == 64;
    odd_d |= c.d % 2 == 1;
    const auto e = kvscore::npy::load(c.dir + "/expected_f32.npy").to_vector<double>();
    invalid |= std::any_of(e.begin(), e.end(), [](double x) { return std::isinf(x); });
  }
  CHECK((g2 && g4 && w8 && w64 && odd_d && invalid));
}

TEST_CASE("SnapKV golden: float32 keys", "[snapkv]") {
  for (const Case& c : cases()) run_golden<float>(c);
}

TEST_CASE("SnapKV golden: float16 keys", "[snapkv]") {
  for (const Case& c : cases()) run_golden<half>(c);
}

TEST_CASE("SnapKV golden: bfloat16 keys", "[snapkv]") {
  for (const Case& c : cases()) run_golden<bfloat16>(c);
}

TEMPLATE_TEST_CASE("SnapKV matches the float64 reference on random shapes", "[snapkv]", float, half, bfloat16) {
  struct Shape {
    std::int64_t H, G, N, d, w, kernel;
  };
  // N > chunk rows (several chunks, window across a chunk boundary), w = N, w = 1, kernels 1..7,
  // head_dim 1 and 130 (scalar tails).
  const Shape shapes[] = {{2, 2, 700, 64, 64, 5}, {1, 4, 37, 33, 8, 3}, {3, 1, 20, 130, 20, 5},
                          {2, 3, 50, 1, 1, 7},    {1, 2, 9, 16, 4, 1},   {2, 1, 300, 17, 31, 5}};
  std::uint32_t seed = 7;
  for (const Shape& s : shapes) {
    INFO("H " << s.H << " G " << s.G << " N " << s.N << " d " << s.d << " w " << s.w << " kernel " << s.kernel
              << " " << type_tag<TestType>());
    const std::vector<TestType> keys = convert_to<TestType>(randn(std::size_t(s.H * s.N * s.d), seed++));
    const std::vector<float> q = randn(std::size_t(s.H * s.G * s.w * s.d), seed++, 1.5f);
    const Ref r = widen(keys, s.H, s.N, s.d);
    SnapKV snap(q.data(), s.H * s.G, s.w, s.d, s.G);
    snap.kernel_size = s.kernel;
    const std::vector<double> e = ref_snapkv(r, q, s.H * s.G, s.w, s.kernel);
    const std::vector<double> tol = rel_tol(r, q, s.H * s.G, s.w);
    for (const auto* isa : kvscore::simd::available_tables()) {
      INFO("isa " << isa->name);
      snap.isa = isa;
      const Scores a = snap.score(KeysView<TestType>(keys.data(), s.H, s.N, s.d, s.N * s.d, s.d));
      CHECK(compare(a.data(), s.N, e, s.H, s.N, tol) == "");
      const std::vector<TestType> blk = to_blocks(keys, s.H, s.N, s.d, 5);
      const Scores b = snap.score(BlockView<TestType>{blk.data(), s.H, s.N, s.d, 5});
      CHECK(compare(b.data(), s.N, e, s.H, s.N, tol) == "");
    }
  }
}

TEMPLATE_TEST_CASE("SnapKV after_cache matches the float64 reference: no mask, the whole cache pooled, nothing "
                   "protected, a window longer than the cache accepted",
                   "[snapkv][placement]", float, half, bfloat16) {
  struct Shape {
    std::int64_t H, G, N, d, w, kernel;
  };
  const Shape shapes[] = {{2, 2, 700, 64, 64, 5}, {1, 4, 37, 33, 8, 3}, {2, 1, 20, 16, 50, 5}, {1, 2, 9, 8, 9, 1}};
  std::uint32_t seed = 101;
  for (const Shape& s : shapes) {
    INFO("H " << s.H << " G " << s.G << " N " << s.N << " d " << s.d << " w " << s.w << " " << type_tag<TestType>());
    const std::vector<TestType> keys = convert_to<TestType>(randn(std::size_t(s.H * s.N * s.d), seed++));
    const std::vector<float> q = randn(std::size_t(s.H * s.G * s.w * s.d), seed++, 1.5f);
    const Ref r = widen(keys, s.H, s.N, s.d);
    SnapKV snap(q.data(), s.H * s.G, s.w, s.d, s.G);
    snap.kernel_size = s.kernel;
    snap.placement = kvscore::QueryPlacement::after_cache;
    CHECK(snap.protected_recent() == 0);
    const std::vector<double> e = ref_snapkv(r, q, s.H * s.G, s.w, s.kernel, true);
    const std::vector<double> tol = rel_tol(r, q, s.H * s.G, s.w);
    const KeysView<TestType> view(keys.data(), s.H, s.N, s.d, s.N * s.d, s.d);
    for (const auto* isa : kvscore::simd::available_tables()) {
      INFO("isa " << isa->name);
      snap.isa = isa;
      CHECK(compare(snap.score(view).data(), s.N, e, s.H, s.N, tol) == "");
    }
    // The in-cache scores differ (causal mask, an unpooled window): the mode is not a no-op.
    if (s.w <= s.N) {
      snap.placement = kvscore::QueryPlacement::in_cache;
      CHECK(snap.protected_recent() == s.w);
      CHECK(compare(snap.score(view).data(), s.N, e, s.H, s.N, tol) != "");
    } else {
      snap.placement = kvscore::QueryPlacement::in_cache;
      CHECK_THROWS_WITH(snap.score(view), Contains("window " + std::to_string(s.w) + " > tokens"));
    }
  }
}

TEST_CASE("SnapKV closed form: identical keys give uniform causal attention", "[snapkv]") {
  // Every logit equal: query i spreads 1/(P+i+1) over keys 0..P+i. x(t) = (1/w)·Σ_{i: P+i >= t} 1/(P+i+1).
  const std::int64_t H = 1, N = 30, d = 8, w = 6, P = N - w;
  std::vector<float> keys(std::size_t(N * d));
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t j = 0; j < d; ++j) keys[std::size_t(t * d + j)] = 0.25f * float(j + 1);
  const std::vector<float> q = randn(std::size_t(w * d), 11);
  std::vector<double> x(std::size_t(N), 0.0);
  for (std::int64_t i = 0; i < w; ++i)
    for (std::int64_t t = 0; t <= P + i; ++t) x[std::size_t(t)] += 1.0 / double(P + i + 1) / double(w);
  for (std::int64_t kernel : {1, 5}) {
    SnapKV snap(q.data(), 1, w, d);
    snap.kernel_size = kernel;
    const Scores s = snap.score(KeysView<float>(keys.data(), H, N, d, N * d, d));
    const double c = x[0];  // the same for every prefix token
    for (std::int64_t t = 0; t < P; ++t) {
      // zero padding, divisor `kernel`: the edges see fewer prefix tokens
      const std::int64_t r = kernel / 2, cover = std::min(P - 1, t + r) - std::max<std::int64_t>(0, t - r) + 1;
      CHECK(s(0, t) == Approx(c * double(cover) / double(kernel)).epsilon(1e-6));
    }
    for (std::int64_t t = P; t < N; ++t) CHECK(s(0, t) == Approx(x[std::size_t(t)]).epsilon(1e-6));
  }
  // Zero keys are valid keys (logit 0): the same uniform attention.
  std::vector<float> zeros(std::size_t(N * d), 0.f);
  SnapKV snap(q.data(), 1, w, d);
  snap.kernel_size = 1;
  const Scores z = snap.score(KeysView<float>(zeros.data(), H, N, d, N * d, d));
  for (std::int64_t t = 0; t < N; ++t) CHECK(z(0, t) == Approx(x[std::size_t(t)]).epsilon(1e-6));
}

TEST_CASE("SnapKV closed form: one key along every query takes the mass - pooling spreads it 1/5 over 5 tokens",
          "[snapkv]") {
  const std::int64_t N = 40, d = 16, w = 8, P = N - w, spike = 17;
  const std::vector<float> u = randn(std::size_t(d), 3);
  std::vector<float> q(std::size_t(2 * w * d));  // 2 query heads (GQA group 2), all along u
  for (std::int64_t i = 0; i < 2 * w; ++i)
    for (std::int64_t j = 0; j < d; ++j) q[std::size_t(i * d + j)] = u[std::size_t(j)] * (1.f + 0.01f * float(i));
  std::vector<float> keys = randn(std::size_t(N * d), 4, 0.1f);
  for (std::int64_t j = 0; j < d; ++j) keys[std::size_t(spike * d + j)] = 20.f * u[std::size_t(j)];
  const KeysView<float> v(keys.data(), 1, N, d, N * d, d);

  SnapKV snap(q.data(), 2, w, d, 2);
  snap.kernel_size = 1;
  const Scores raw = snap.score(v);
  CHECK(raw(0, spike) > 0.999f);
  for (std::int64_t t = 0; t < N; ++t)
    if (t != spike) CHECK(raw(0, t) < raw(0, spike));

  snap.kernel_size = 5;
  const Scores pooled = snap.score(v);
  for (std::int64_t t = 0; t < P; ++t) {
    if (std::abs(t - spike) <= 2) CHECK(pooled(0, t) == Approx(raw(0, spike) / 5.0).epsilon(1e-5));
    else CHECK(pooled(0, t) < 1e-3f);
  }
  CHECK(pooled(0, spike) == Approx(0.2).margin(2e-4));
}

TEST_CASE("SnapKV invariant: unpooled prefix scores of one query head sum to the mass outside the window",
          "[snapkv]") {
  const std::int64_t N = 90, d = 24, w = 16, P = N - w;
  const std::vector<float> keys = randn(std::size_t(N * d), 21);
  const std::vector<float> q = randn(std::size_t(w * d), 22, 1.3f);
  SnapKV snap(q.data(), 1, w, d);
  snap.kernel_size = 1;
  const Scores s = snap.score(KeysView<float>(keys.data(), 1, N, d, N * d, d));
  // Mass of query i on the keys before the window, in float64.
  double outside = 0;
  for (std::int64_t i = 0; i < w; ++i) {
    std::vector<double> l(std::size_t(P + i + 1));
    for (std::int64_t t = 0; t <= P + i; ++t) {
      double dot = 0;
      for (std::int64_t j = 0; j < d; ++j) dot += double(q[std::size_t(i * d + j)]) * keys[std::size_t(t * d + j)];
      l[std::size_t(t)] = dot / std::sqrt(double(d));
    }
    const double m = *std::max_element(l.begin(), l.end());
    double z = 0, pre = 0;
    for (std::int64_t t = 0; t <= P + i; ++t) {
      z += std::exp(l[std::size_t(t)] - m);
      if (t < P) pre += std::exp(l[std::size_t(t)] - m);
    }
    outside += pre / z / double(w);
  }
  double prefix = 0, total = 0;
  for (std::int64_t t = 0; t < N; ++t) (t < P ? prefix : total) += s(0, t);
  total += prefix;
  CHECK(prefix == Approx(outside).epsilon(1e-5));
  CHECK(total == Approx(1.0).epsilon(1e-5));
  CHECK(outside < 0.99);  // the window does hold some mass, so the check is not vacuous
}

TEST_CASE("SnapKV invariant: the GQA group score is the mean of its heads' scores", "[snapkv]") {
  const std::int64_t N = 60, d = 32, w = 8;
  const std::vector<float> keys = randn(std::size_t(N * d), 31);
  const std::vector<float> q = randn(std::size_t(2 * w * d), 32, 1.2f);
  const KeysView<float> v(keys.data(), 1, N, d, N * d, d);
  const Scores both = SnapKV(q.data(), 2, w, d, 2).score(v);
  const Scores a = SnapKV(q.data(), 1, w, d).score(v);
  const Scores b = SnapKV(q.data() + w * d, 1, w, d).score(v);
  for (std::int64_t t = 0; t < N; ++t) CHECK(both(0, t) == Approx(0.5 * (a(0, t) + b(0, t))).epsilon(1e-5));
  // Two identical heads in a group are the same as one.
  std::vector<float> twice(q.begin(), q.begin() + w * d);
  twice.insert(twice.end(), q.begin(), q.begin() + w * d);
  const Scores same = SnapKV(twice.data(), 2, w, d).score(v);
  for (std::int64_t t = 0; t < N; ++t) CHECK(same(0, t) == Approx(a(0, t)).epsilon(1e-6));
}

TEST_CASE("SnapKV: the window is scored, not pooled, and protected through protected_recent()", "[snapkv]") {
  const std::int64_t N = 50, d = 16, w = 10, P = N - w;
  const std::vector<float> keys = randn(std::size_t(N * d), 41);
  const std::vector<float> q = randn(std::size_t(w * d), 42);
  const KeysView<float> v(keys.data(), 1, N, d, N * d, d);
  SnapKV snap(q.data(), 1, w, d);
  CHECK(snap.protected_recent() == w);
  const Scores pooled = snap.score(v);
  snap.kernel_size = 1;
  const Scores raw = snap.score(v);
  for (std::int64_t t = P; t < N; ++t) {
    CHECK(pooled(0, t) == raw(0, t));
    CHECK(std::isfinite(pooled(0, t)));
    CHECK(pooled(0, t) > 0.f);
  }
  // The last prefix tokens pool only prefix values (zero padding at the window boundary).
  CHECK(pooled(0, P - 1) == Approx((raw(0, P - 3) + double(raw(0, P - 2)) + raw(0, P - 1)) / 5.0).epsilon(1e-6));
}

TEMPLATE_TEST_CASE("SnapKV: invalid rows score -inf and take no part in any softmax", "[snapkv]", float, bfloat16) {
  const std::int64_t H = 2, N = 40, d = 12, w = 6;
  std::vector<float> kf = randn(std::size_t(H * N * d), 51);
  const std::vector<float> q = randn(std::size_t(2 * H * w * d), 52, 1.5f);
  auto poison = [&](std::int64_t h, std::int64_t t, float x) { kf[std::size_t((h * N + t) * d + 3)] = x; };
  poison(0, 5, kNaN);       // prefix
  poison(0, 6, kInf);       // its neighbour
  poison(1, 0, -kInf);      // first token
  poison(1, 20, 1e20f);     // fp32 squared norm overflows
  poison(0, 37, kNaN);      // inside the window
  const std::vector<TestType> keys = convert_to<TestType>(kf);
  const Ref r = widen(keys, H, N, d);
  SnapKV snap(q.data(), 2 * H, w, d);
  const KeysView<TestType> v(keys.data(), H, N, d, N * d, d);
  for (const auto* isa : kvscore::simd::available_tables()) {
    INFO("isa " << isa->name);
    snap.isa = isa;
    for (std::int64_t kernel : {1, 5}) {
      snap.kernel_size = kernel;
      const Scores s = snap.score(v);
      for (float x : s.values()) CHECK(!std::isnan(x));
      CHECK(s(0, 5) == -kInf);
      CHECK(s(0, 6) == -kInf);
      CHECK(s(1, 0) == -kInf);
      CHECK(s(1, 20) == -kInf);
      CHECK(s(0, 37) == -kInf);
      // The others equal the reference in which the invalid rows have probability 0.
      CHECK(compare(s.data(), N, ref_snapkv(r, q, 2 * H, w, kernel), H, N, rel_tol(r, q, 2 * H, w)) == "");
    }
  }
}

TEST_CASE("SnapKV: all rows invalid, or a query that sees no valid key", "[snapkv]") {
  const std::int64_t N = 20, d = 4, w = 4, P = N - w;
  const std::vector<float> q = randn(std::size_t(w * d), 61);
  std::vector<float> keys(std::size_t(N * d), kNaN);
  const KeysView<float> v(keys.data(), 1, N, d, N * d, d);
  const Scores all_bad = SnapKV(q.data(), 1, w, d).score(v);
  for (float x : all_bad.values()) CHECK(x == -kInf);

  // Keys 0..P invalid: query 0 sees none and contributes nothing; the divisor stays w.
  keys = randn(std::size_t(N * d), 62);
  for (std::int64_t t = 0; t <= P; ++t) keys[std::size_t(t * d)] = kNaN;
  SnapKV snap(q.data(), 1, w, d);
  snap.kernel_size = 1;
  const Scores s = snap.score(KeysView<float>(keys.data(), 1, N, d, N * d, d));
  double total = 0;
  for (std::int64_t t = 0; t < N; ++t) {
    CHECK(!std::isnan(s(0, t)));
    if (t <= P) CHECK(s(0, t) == -kInf);
    else total += s(0, t);
  }
  CHECK(total == Approx(double(w - 1) / double(w)).epsilon(1e-6));
  const Ref r = widen(keys, 1, N, d);
  CHECK(compare(s.data(), N, ref_snapkv(r, q, 1, w, 1), 1, N, rel_tol(r, q, 1, w)) == "");
}

TEST_CASE("SnapKV: a logit beyond fp32 is clamped (+inf takes the mass, NaN is dropped), never NaN", "[snapkv]") {
  // ‖k‖² = 2e38 is finite (a valid key) but q·k overflows fp32. d = 32 puts the two big
  // elements in different SIMD lanes of every kernel (and in the scalar kernel in sequence).
  const std::int64_t N = 6, d = 32, w = 1;
  std::vector<float> keys = randn(std::size_t(N * d), 101, 0.2f);
  for (std::int64_t j = 0; j < d; ++j) keys[std::size_t(1 * d + j)] = 0.f;
  keys[std::size_t(1 * d + 0)] = 1e19f;
  keys[std::size_t(1 * d + 1)] = 1e19f;
  const KeysView<float> v(keys.data(), 1, N, d, N * d, d);
  std::vector<float> up(std::size_t(d), 0.f), mixed(std::size_t(d), 0.f);
  up[0] = up[1] = 1e20f;  // q/√d · 1e19 = 1.8e38 per term, 3.5e38 summed: +inf
  mixed[0] = 4e20f;       // +7e38 and -7e38: +inf + -inf = NaN in a SIMD kernel
  mixed[1] = -4e20f;      // (a fused multiply-add in sequence gives +inf instead)
  for (const auto* isa : kvscore::simd::available_tables()) {
    INFO("isa " << isa->name);
    for (std::int64_t kernel : {1, 5}) {
      SnapKV snap(up.data(), 1, w, d);
      snap.isa = isa;
      snap.kernel_size = kernel;
      const Scores s = snap.score(v);
      for (float x : s.values()) CHECK(std::isfinite(x));
      if (kernel == 1) CHECK(s(0, 1) == 1.f);  // the clamped +inf logit is the max: all the mass
    }
    SnapKV snap(mixed.data(), 1, w, d);
    snap.isa = isa;
    snap.kernel_size = 1;
    const Scores s = snap.score(v);
    for (float x : s.values()) CHECK(std::isfinite(x));
    CHECK((s(0, 1) == 0.f || s(0, 1) == 1.f));  // NaN: dropped; +inf: all the mass
    double total = 0;
    for (float x : s.values()) total += x;
    CHECK(total == Approx(1.0).epsilon(1e-6));
  }
}

TEST_CASE("SnapKV: window = N scores every token as the window - N < window is an error", "[snapkv]") {
  const std::int64_t N = 10, d = 8;
  const std::vector<float> keys = randn(std::size_t(N * d), 71);
  const std::vector<float> q = randn(std::size_t(N * d), 72);
  const KeysView<float> v(keys.data(), 1, N, d, N * d, d);
  SnapKV full(q.data(), 1, N, d);
  full.kernel_size = 1;
  const Scores a = full.score(v);
  full.kernel_size = 5;  // no prefix, so no pooling
  CHECK(full.score(v).values() == a.values());
  double total = 0;
  for (float x : a.values()) total += x;
  CHECK(total == Approx(1.0).epsilon(1e-6));

  const std::vector<float> q11 = randn(std::size_t(11 * d), 73);
  CHECK_THROWS_WITH(SnapKV(q11.data(), 1, 11, d).score(v), Contains("window 11 > tokens 10"));
  // An empty cache is N = 0 < w: an error too (not the silent no-op of the geometric scorers).
  const KeysView<float> empty(keys.data(), 1, 0, d, d, d);
  CHECK_THROWS_WITH(SnapKV(q.data(), 1, 1, d).score(empty), Contains("window 1 > tokens 0"));
}

TEST_CASE("SnapKV: bad arguments throw std::invalid_argument naming the values", "[snapkv]") {
  const std::int64_t N = 20, d = 8;
  const std::vector<float> keys = randn(std::size_t(2 * N * d), 81);
  const std::vector<float> q = randn(std::size_t(6 * 4 * d), 82);
  const KeysView<float> v(keys.data(), 2, N, d, N * d, d);

  CHECK_THROWS_AS(SnapKV(q.data(), 3, 4, d).score(v), std::invalid_argument);
  CHECK_THROWS_WITH(SnapKV(q.data(), 3, 4, d).score(v), Contains("q_heads 3 is not a multiple of the keys' kv_heads 2"));
  CHECK_THROWS_WITH(SnapKV(q.data(), 4, 4, d, 4).score(v),
                    Contains("group 4 does not match q_heads / kv_heads = 4 / 2 = 2"));
  CHECK_THROWS_WITH(SnapKV(q.data(), 6, 4, d, 4), Contains("group 4 must be >= 0 and divide q_heads 6"));
  CHECK_THROWS_WITH(SnapKV(q.data(), 4, 4, d, -1), Contains("group -1"));
  CHECK_THROWS_WITH(SnapKV(q.data(), 2, 4, 4).score(v), Contains("queries have head_dim 4 but keys have head_dim 8"));
  CHECK_THROWS_WITH(SnapKV(q.data(), 2, 0, d), Contains("window must be > 0 (got 0)"));
  CHECK_THROWS_WITH(SnapKV(q.data(), 2, -3, d), Contains("window must be > 0 (got -3)"));
  CHECK_THROWS_WITH(SnapKV(q.data(), 0, 4, d), Contains("q_heads must be > 0 (got 0)"));
  CHECK_THROWS_WITH(SnapKV(q.data(), 2, 4, 0), Contains("head_dim must be in [1, 4096] (got 0)"));
  CHECK_THROWS_WITH(SnapKV(nullptr, 2, 4, d), Contains("queries is null"));
  const std::vector<float> q30 = randn(std::size_t(2 * 30 * d), 83);
  CHECK_THROWS_WITH(SnapKV(q30.data(), 2, 30, d).score(v), Contains("window 30 > tokens 20"));

  std::vector<float> bad = q;
  bad[std::size_t((1 * 4 + 2) * d + 5)] = kNaN;  // head 1, query 2, dim 5
  CHECK_THROWS_WITH(SnapKV(bad.data(), 2, 4, d), Contains("[head 1, query 2, dim 5] is not finite"));
  bad[std::size_t((1 * 4 + 2) * d + 5)] = -kInf;
  CHECK_THROWS_WITH(SnapKV(bad.data(), 2, 4, d), Contains("-inf at [head 1, query 2, dim 5]"));

  SnapKV snap(q.data(), 2, 4, d);
  for (std::int64_t k : {0, 2, -1}) {
    snap.kernel_size = k;
    CHECK_THROWS_WITH(snap.score(v), Contains("kernel_size must be odd and >= 1 (got " + std::to_string(k) + ")"));
  }
  snap.kernel_size = 5;
  std::vector<float> out(std::size_t(2 * N));
  CHECK_THROWS_WITH(snap.score(v, ScoresView(out.data(), 2, N - 1)), Contains("does not match keys (2, 20)"));
  // No keys heads: the group cannot be formed.
  const KeysView<float> none(keys.data(), 0, N, d, N * d, d);
  CHECK_THROWS_WITH(snap.score(none), Contains("kv_heads 0"));
  // The scorer keeps its own copy of the queries.
  std::vector<float> q2 = q;
  SnapKV copy(q2.data(), 2, 4, d);
  const Scores before = copy.score(v);
  std::fill(q2.begin(), q2.end(), kNaN);
  CHECK(copy.score(v).values() == before.values());
  CHECK(copy.queries() == std::vector<float>(q.begin(), q.begin() + 2 * 4 * d));
}

TEMPLATE_TEST_CASE("SnapKV: bit-identical for any num_threads and across runs", "[snapkv]", float, half, bfloat16) {
  const std::int64_t H = 8, G = 2, N = 600, d = 64, w = 32;
  std::vector<float> kf = randn(std::size_t(H * N * d), 91);
  kf[std::size_t((3 * N + 100) * d)] = kNaN;
  const std::vector<TestType> keys = convert_to<TestType>(kf);
  const std::vector<float> q = randn(std::size_t(H * G * w * d), 92, 0.3f);
  const KeysView<TestType> v(keys.data(), H, N, d, N * d, d);
  SnapKV snap(q.data(), H * G, w, d, G);
  for (const auto* isa : kvscore::simd::available_tables()) {
    INFO("isa " << isa->name);
    snap.isa = isa;
    snap.num_threads = 1;
    const Scores ref = snap.score(v);
    CHECK(snap.score(v).values() == ref.values());
#if defined(NDEBUG)
    for (int nt : {2, 3, 8, 0}) {
#else  // the Debug sanitizer build: an odd split and the default (~35 s less CPU at -O0)
    for (int nt : {3, 0}) {
#endif
      CAPTURE(nt);
      snap.num_threads = nt;
      const Scores s = snap.score(v);
      CHECK(std::memcmp(ref.data(), s.data(), sizeof(float) * ref.values().size()) == 0);
    }
  }
}
