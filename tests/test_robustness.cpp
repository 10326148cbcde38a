// Robustness (issue 10): determinism across threads, runs and kernel tables for every CPU
// scorer and the selector; limits (head_dim range, heads, 2^31+ tokens, int64 overflow of
// sizes) — huge views are built over small buffers and must be rejected before any access,
// or (2^31+ tokens) work through a sparse read-only mapping. See docs/contributing/robustness.md.
#include <sys/mman.h>

#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/core/parallel.hpp"
#include "kvscore/eval/evaluate.hpp"
#include "kvscore/ojakv/ojakv.hpp"
#include "kvscore/pariskv/pariskv.hpp"
#include "kvscore/scorers/keydiff.hpp"
#include "kvscore/scorers/knorm.hpp"
#include "kvscore/scorers/manifold_l2.hpp"
#include "kvscore/scorers/protokv.hpp"
#include "kvscore/scorers/qfilter.hpp"
#include "kvscore/scorers/snapkv.hpp"
#include "kvscore/scorers/windowed_manifold_l2.hpp"
#include "kvscore/select.hpp"

namespace {

using i64 = std::int64_t;

std::vector<float> gaussian(std::size_t n, unsigned seed, float scale = 1.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = nd(g);
  return v;
}

// Every CPU scorer, by name, on the same keys/queries: H = 4 KV heads, G = 2, window 16.
constexpr i64 kH = 4, kN = 700, kD = 96, kG = 2, kW = 16;

struct Fixture {
  std::vector<float> keys = gaussian(std::size_t(kH * kN * kD), 11);
  std::vector<float> queries = gaussian(std::size_t(kH * kG * kW * kD), 12);
  std::vector<float> filters = gaussian(std::size_t(kH * kD), 13);
  kvscore::KeysView<float> view{keys.data(), kH, kN, kD, kN * kD, kD};

  kvscore::Scores score(const std::string& m, const kvscore::simd::KernelTable* isa, int threads) const {
    kvscore::Scores s(kH, kN);
    auto go = [&](auto sc) {
      sc.isa = isa;
      sc.num_threads = threads;
      sc.score(view, s.view());
    };
    if (m == "knorm") go(kvscore::KNorm{});
    else if (m == "keydiff") go(kvscore::KeyDiff{});
    else if (m == "manifold-l2") go(kvscore::ManifoldL2{});
    else if (m == "windowed-l2") go(kvscore::WindowedManifoldL2(256));
    else if (m == "qfilter") go(kvscore::QFilter(filters, kH, kD));
    else if (m == "snapkv") go(kvscore::SnapKV(queries.data(), kH * kG, kW, kD));
    else if (m == "protokv") {
      kvscore::ProtoKV p(queries.data(), kH * kG, kW, kD);
      p.chunks = 40;
      go(p);
    } else if (m == "ojakv-residual") {
      std::vector<Eigen::MatrixXd> bases;
      for (i64 h = 0; h < kH; ++h) bases.push_back(kvscore::oja::random_orthonormal(kD, 16, 100 + h));
      kvscore::OjaResidual r(queries.data(), kH * kG, kW, kD, bases);
      r.num_threads = threads;
      r.score(view, s.view());  // no kernel table: its GEMMs are Eigen's
    }
    return s;
  }
};

const char* const kMethods[] = {"knorm", "keydiff", "manifold-l2", "windowed-l2",
                                "qfilter", "snapkv", "protokv", "ojakv-residual"};

bool same_bits(const kvscore::Scores& a, const kvscore::Scores& b) {
  return a.values().size() == b.values().size() &&
         std::memcmp(a.data(), b.data(), a.values().size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("robustness: every scorer is bit-identical across 1..4 threads and two runs", "[robustness][determinism][threads]") {
  const Fixture f;
  for (const char* m : kMethods) {
    INFO("method " << m);
    const kvscore::Scores ref = f.score(m, nullptr, 1);
    for (int t = 1; t <= 4; ++t) {
      INFO("threads " << t);
      CHECK(same_bits(f.score(m, nullptr, t), ref));
      CHECK(same_bits(f.score(m, nullptr, t), ref));  // second run
    }
    CHECK(same_bits(f.score(m, nullptr, 0), ref));  // OpenMP default
    for (float x : ref.values()) REQUIRE(std::isfinite(x));  // tie-free gaussian data: all valid
  }
}

TEST_CASE("robustness: every SIMD table scores within 1e-6 relative of scalar and selects the same tokens", "[robustness][determinism][simd]") {
  const Fixture f;
  const auto tables = kvscore::simd::available_tables();
  REQUIRE(tables.size() >= 2);  // scalar + at least one vector table
  for (const char* m : kMethods) {
    if (std::string(m) == "ojakv-residual") continue;  // no kernel table
    const kvscore::Scores ref = f.score(m, tables[0], 1);
    const kvscore::Selection sref = kvscore::select(ref, kvscore::Budget::per_head(kN / 5));
    for (const auto* tb : tables) {
      INFO("method " << m << " table " << tb->name);
      const kvscore::Scores s = f.score(m, tb, 2);
      double worst = 0;
      for (i64 h = 0; h < kH; ++h) {
        double scale = 0;  // relative to the head's largest |score| (cosines cross 0)
        for (i64 t = 0; t < kN; ++t) scale = std::max(scale, std::abs(double(ref(h, t))));
        for (i64 t = 0; t < kN; ++t) worst = std::max(worst, std::abs(double(s(h, t)) - ref(h, t)) / scale);
      }
      CHECK(worst <= 1e-6);
      const kvscore::Selection sel = kvscore::select(s, kvscore::Budget::per_head(kN / 5));
      CHECK(sel.positions == sref.positions);
    }
  }
}

TEST_CASE("robustness: select is identical across 1..N threads, runs and kernel sets (per_head and AdaKV)", "[robustness][determinism][threads]") {
  // Ties on purpose: scores rounded to 1/8 make many equal values; NaN and -inf sprinkled in.
  std::vector<float> v = gaussian(std::size_t(8 * 5000), 21);
  for (std::size_t i = 0; i < v.size(); ++i) {
    v[i] = std::round(v[i] * 8) / 8;
    if (i % 97 == 0) v[i] = std::numeric_limits<float>::quiet_NaN();
    if (i % 101 == 0) v[i] = -std::numeric_limits<float>::infinity();
  }
  const kvscore::ScoresView sv(v.data(), 8, 5000);
  for (auto alloc : {kvscore::Alloc::per_head, kvscore::Alloc::adakv})
    for (bool norm : {false, true}) {
      kvscore::SelectOptions o;
      o.alloc = alloc;
      o.normalize = norm;
      o.sinks = 4;
      o.recent = 32;
      o.num_threads = 1;
      o.kernels = kvscore::SelectKernels::portable;
      const kvscore::Selection ref = kvscore::select(sv, kvscore::Budget::per_head(700), o);
      for (auto k : {kvscore::SelectKernels::portable, kvscore::SelectKernels::avx2, kvscore::SelectKernels::avx512,
                     kvscore::SelectKernels::best}) {
        if (!kvscore::select_kernels_supported(k)) continue;
        for (int t : {0, 1, 2, 3, 5, 8, 16}) {
          INFO("alloc " << int(alloc) << " normalize " << norm << " kernels " << kvscore::select_kernels_name(k)
                        << " threads " << t);
          o.kernels = k;
          o.num_threads = t;
          const kvscore::Selection s = kvscore::select(sv, kvscore::Budget::per_head(700), o);
          CHECK(s.offsets == ref.offsets);
          CHECK(s.positions == ref.positions);
        }
      }
    }
}

TEST_CASE("robustness: ParisKV retrieval is identical across 1..4 threads and two runs", "[robustness][determinism][threads]") {
  const std::vector<float> keys = gaussian(std::size_t(4 * 3000 * 64), 31);
  const std::vector<float> q = gaussian(std::size_t(8 * 3 * 64), 32);
  const kvscore::KeysView<float> view(keys.data(), 4, 3000, 64, 3000 * 64, 64);
  kvscore::ParisKVSearch opt;
  opt.k = 50;
  const auto ref = kvscore::pariskv_retrieve(view, q.data(), 8, 3, 1, opt, {}, 1);
  for (int t = 1; t <= 4; ++t) {
    INFO("threads " << t);
    CHECK(kvscore::pariskv_retrieve(view, q.data(), 8, 3, 1, opt, {}, t) == ref);
  }
}

TEST_CASE("robustness: head_dim limits [1, 4096] for every constructor that takes one", "[robustness][limits][errors]") {
  std::vector<float> buf(4096 * 3, 1.f);
  using KV = kvscore::KeysView<float>;
  for (i64 d : {i64(0), i64(-1), kvscore::kMaxHeadDim + 1}) {
    INFO("head_dim " << d);
    CHECK_THROWS_WITH(KV(buf.data(), 1, 1, d, 0, 0), Catch::Contains("head_dim must be in [1, 4096]") &&
                                                          Catch::Contains(std::to_string(d)));
    CHECK_THROWS_AS(kvscore::SnapKV(buf.data(), 1, 1, d), std::invalid_argument);
    CHECK_THROWS_AS(kvscore::ProtoKV(buf.data(), 1, 1, d), std::invalid_argument);
    CHECK_THROWS_AS(kvscore::ParisKV(d), std::invalid_argument);
    CHECK_THROWS_AS(kvscore::QFilter(std::vector<float>(4096 * 2), 1, d), std::invalid_argument);
  }
  // Both ends of the range work: a d = 4096 key of ones has norm 64, d = 1 of 1.
  for (i64 d : {i64(1), i64(3), i64(97), kvscore::kMaxHeadDim}) {
    INFO("head_dim " << d);
    const kvscore::Scores s = kvscore::KNorm{}.score(KV(buf.data(), 1, 3, d, 0, d));
    for (i64 t = 0; t < 3; ++t) CHECK(s(0, t) == Approx(-std::sqrt(double(d))).epsilon(1e-6));
    if (d == 1) {
      // ParisKV pads d to P = 1: no subspace size m in [2, 16] divides it (finding F2).
      CHECK_THROWS_WITH(kvscore::ParisKV(1), Catch::Contains("padded head_dim 1"));
      continue;
    }
    kvscore::ParisKVConfig cfg;
    cfg.m = d < 8 ? 2 : 8;
    kvscore::ParisKV idx(d, cfg);  // non-power-of-two d: zero-padded to the next power of two
    idx.append(buf.data(), 3, d);
    CHECK(idx.size() == 3);
  }
}

TEST_CASE("robustness: many heads, and sizes whose product overflows int64 are rejected before any access", "[robustness][limits][errors]") {
  std::vector<float> buf(4096, 0.5f);
  using KV = kvscore::KeysView<float>;
  // 4096 heads x 1 token x d 1: works, one score per head.
  const kvscore::Scores s = kvscore::KNorm{}.score(KV(buf.data(), 4096, 1, 1, 1, 1));
  CHECK(s.heads() == 4096);
  for (float x : s.values()) CHECK(x == -0.5f);
  const i64 big = i64(1) << 40;
  // Strides whose span overflows: the constructor checks, nothing is read.
  CHECK_THROWS_WITH(KV(buf.data(), big, big, 128, big * 128, 128), Catch::Contains("overflows int64"));
  CHECK_THROWS_WITH(KV::token_major(buf.data(), big, big, 128), Catch::Contains("overflows int64"));
  CHECK_THROWS_WITH(KV::hf(buf.data(), 1, 2, big, big, 128), Catch::Contains("overflows int64"));
  CHECK_THROWS_WITH(kvscore::Scores(big, big), Catch::Contains("overflows int64"));
  // Overlapping rows from a stride of 0 or less than head_dim.
  CHECK_THROWS_WITH(KV(buf.data(), 1, 2, 8, 0, 4), Catch::Contains("token_stride 4") && Catch::Contains("overlap"));
  CHECK_THROWS_WITH(KV(buf.data(), 2, 1, 8, 0, 8), Catch::Contains("head_stride 0") && Catch::Contains("overlap"));
  CHECK_THROWS_WITH(KV(buf.data(), 1, 2, 8, 0, -8), Catch::Contains("token_stride must be >= 0 (got -8)"));
  // The selector: heads x tokens and budget x heads overflow int64.
  kvscore::SelectOptions ada;
  ada.alloc = kvscore::Alloc::adakv;
  CHECK_THROWS_WITH(kvscore::select_total(big, big, kvscore::Budget::per_head(1), ada), Catch::Contains("overflows"));
  CHECK_THROWS_WITH(kvscore::select_total(big, big, kvscore::Budget::per_head(big), {}), Catch::Contains("overflows"));
}

TEST_CASE("robustness: 2^31+ tokens — 64-bit sizes in the selector, rejection of unbacked huge views", "[robustness][limits]") {
  const i64 n = (i64(1) << 31) + 5;
  // Budgets and workspace for a 2^31+5-token head are computed in 64 bits (nothing allocated).
  CHECK(kvscore::select_total(1, n, kvscore::Budget::per_head(n - 1)) == n - 1);
  CHECK(kvscore::select_total(3, n, kvscore::Budget::per_head(n)) == 3 * n);
  CHECK(kvscore::select_workspace_bytes(1, n, kvscore::Budget::per_head(7)) >= std::size_t(4) * std::size_t(n));
  CHECK_THROWS_WITH(kvscore::select_total(1, n, kvscore::Budget::per_head(n + 1)),
                    Catch::Contains(std::to_string(n + 1)) && Catch::Contains(std::to_string(n)));
  // ProtoKV's ranks are exact fp32 integers only up to 2^24 tokens: a bigger view is rejected
  // by the shape check, before its (unbacked) rows are touched.
  std::vector<float> q(4, 1.f), tiny(4, 1.f);
  const kvscore::KeysView<float> huge(tiny.data(), 1, (i64(1) << 24) + 1, 4, 0, 4);
  const kvscore::ScoresView out(tiny.data(), 1, (i64(1) << 24) + 1);
  CHECK_THROWS_WITH(kvscore::ProtoKV(q.data(), 1, 1, 4).score(huge, out), Catch::Contains("16777216"));
  // A SnapKV window longer than an unbacked 2^31+ view's… shape mismatch first: scores of
  // another shape are rejected before anything is read.
  const kvscore::KeysView<float> h2(tiny.data(), 1, n, 4, 0, 4);
  const kvscore::ScoresView small(tiny.data(), 1, 4);
  CHECK_THROWS_WITH(kvscore::KNorm{}.score(h2, small), Catch::Contains(std::to_string(n)));
}

TEST_CASE("robustness: a 2^31+64-token fp16 view over a sparse mapping is sliced and scored with 64-bit offsets", "[robustness][limits]") {
  // 2^31+64 tokens x d 1 x fp16 = 4 GiB of address space, read-only zero pages except the
  // last page (written below): only ~8 KiB of memory is touched.
  const i64 n = (i64(1) << 31) + 64;
  const std::size_t bytes = std::size_t(n) * 2;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    WARN("skipped: cannot reserve 4 GiB of address space here");
    return;
  }
  auto* base = static_cast<kvscore::half*>(p);
  for (i64 t = n - 64; t < n; ++t) base[t] = kvscore::from_float<kvscore::half>(float(t - (n - 64) + 1));
  const kvscore::KeysView<kvscore::half> view(base, 1, n, 1, 0, 1);
  CHECK(view.tokens() == n);
  const auto tail = view.tokens_slice(n - 64, n);
  CHECK(tail.data() == base + (n - 64));  // no 32-bit wrap of the offset
  const kvscore::Scores s = kvscore::KNorm{}.score(tail);
  for (i64 t = 0; t < 64; ++t) CHECK(s(0, t) == -float(t + 1));
  // Across 2^31: 8 zero keys (untouched zero page; norm 0, valid) then the first 8 written.
  const kvscore::Scores z = kvscore::KNorm{}.score(view.tokens_slice((i64(1) << 31) - 8, (i64(1) << 31) + 8));
  for (i64 t = 0; t < 16; ++t) CHECK(z(0, t) == (t < 8 ? 0.f : -float(t - 7)));
  munmap(p, bytes);
}

// ---- No exception crosses an OpenMP region (std::terminate). Every parallel loop of the
// library is detail::parallel_for_tid: the thrown exception of the lowest failing index is
// rethrown after the region. One case per region that can throw.

namespace {

/// The message of the exception `f` throws ("no throw" when it throws none).
std::string thrown(const std::function<void()>& f) { return test_support::error_of<std::exception>(f); }

/// A scorer whose heads >= 2 fail (ScorerBase's loop over heads, which every scorer and
/// ProtoKV / OjaResidual use).
struct FailingScorer : kvscore::ScorerBase<FailingScorer> {
  static constexpr const char* name = "failing";
  template <class View>
  void score_head(const kvscore::simd::KernelTable&, const View&, i64 h, float* out) const {
    if (h >= 2) throw std::runtime_error("head " + std::to_string(h) + " failed");
    out[0] = 0.f;
  }
};

}  // namespace

TEST_CASE("robustness: parallel_for rethrows the lowest failing index after every index ran", "[robustness][errors][threads]") {
  for (int threads : {1, 2, 4}) {
    INFO("threads " << threads);
    std::vector<int> ran(64, 0);
    const std::string msg = thrown([&] {
      kvscore::detail::parallel_for(64, threads, [&](i64 i) {
        ran[std::size_t(i)] = 1;
        if (i == 9 || i == 40) throw std::invalid_argument("index " + std::to_string(i));
      });
    });
    CHECK(msg == "index 9");
    if (threads > 1) CHECK(std::count(ran.begin(), ran.end(), 1) == 64);  // the region ran to its end
  }
}

TEST_CASE("robustness: an exception in a scorer's head loop leaves score() as an exception", "[robustness][errors][threads]") {
  const std::vector<float> k(std::size_t(8 * 4 * 2), 1.f);
  const kvscore::KeysView<float> view(k.data(), 8, 4, 2, 4 * 2, 2);
  for (int threads : {1, 4}) {
    FailingScorer sc;
    sc.num_threads = threads;
    CHECK(thrown([&] { sc.score(view); }) == "head 2 failed");
  }
}

TEST_CASE("robustness: an exception in the selector's head loop is rethrown", "[robustness][errors][threads]") {
  for (int threads : {1, 4}) {
    INFO("threads " << threads);
    CHECK(thrown([&] {
            kvscore::detail::sel::parallel_heads(8, threads, [](i64 h, int) {
              if (h >= 5) throw std::runtime_error("select head " + std::to_string(h));
            });
          }) == "select head 5");
  }
}

TEST_CASE("robustness: pariskv_retrieve rejects a finite query whose squared norm overflows, on any thread count", "[robustness][errors][threads]") {
  const std::vector<float> keys = gaussian(std::size_t(2 * 500 * 32), 41);
  std::vector<float> q = gaussian(std::size_t(4 * 3 * 32), 42);
  q[std::size_t((1 * 3 + 2) * 32 + 7)] = 3e19f;  // finite; its square is not (fp32)
  const kvscore::KeysView<float> view(keys.data(), 2, 500, 32, 500 * 32, 32);
  kvscore::ParisKVSearch opt;
  opt.k = 10;
  for (int threads : {1, 4})
    for (i64 group : {1, 2}) {
      INFO("threads " << threads << " group " << group);
      CHECK(thrown([&] { kvscore::pariskv_retrieve(view, q.data(), 4, 3, group, opt, {}, threads); }) ==
            "kvscore::pariskv_retrieve: query head 1, query 2 has a squared norm that overflows fp32 (magnitude "
            "above ~1.8e19)");
    }
}

TEST_CASE("robustness: an exception in the evaluator's loop over heads is rethrown", "[robustness][errors][threads]") {
  namespace eval = kvscore::eval;
  static const bool registered = [] {
    eval::register_method({"test-failing-output", "hybrid whose output fails for query head 3",
                           [](const eval::LayerInput& in, i64 n, const eval::MethodOptions& o) {
                             eval::Compressed c = eval::select_scores(kvscore::KNorm{}.score(in.key_view()), n, o);
                             c.output = [](i64 hq, i64, double* out) {
                               if (hq == 3) throw std::invalid_argument("output of query head 3 failed");
                               out[0] = 0.0;
                             };
                             return c;
                           }});
    return true;
  }();
  (void)registered;
  const i64 H = 2, N = 64, d = 8, HQ = 4, NQ = 2;
  const std::vector<float> K = gaussian(std::size_t(H * N * d), 51), V = gaussian(std::size_t(H * N * d), 52);
  const std::vector<float> Q = gaussian(std::size_t(HQ * NQ * d), 53);
  const std::vector<eval::LayerInput> layers = {{K.data(), V.data(), Q.data(), H, N, d, d, HQ, NQ}};
  for (int threads : {1, 4}) {
    eval::EvalOptions opt;
    opt.methods = {"test-failing-output"};
    opt.keep = {0.5};
    opt.threads = threads;
    CHECK(thrown([&] { eval::evaluate(layers, opt); }) == "output of query head 3 failed");
  }
}
