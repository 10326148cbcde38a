// Tests of kvscore::select / select_into / budget_from_ratio (StreamingLLM, a selector
// configuration: test_streaming_llm.cpp).
//
//  * numpy fixtures (tests/data/select/, tools/gen_select_fixtures.py): per-head and AdaKV
//    selections computed with numpy sorts under the documented tie / NaN / protection rules;
//  * properties: random shapes (1 to 1e5 tokens), budgets, protection, allocations and
//    score distributions against a sort-based reference written here, on every kernel path
//    (AVX-512 / portable) and thread count;
//  * every error path, with the values named in the message.
#include <catch2/catch.hpp>

#include <kvscore/kvscore.hpp>
#include <kvscore/io/npy.hpp>
#include <kvscore/select.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace {

using kvscore::Alloc;
using kvscore::Budget;
using kvscore::Scores;
using kvscore::ScoresView;
using kvscore::Selection;
using kvscore::SelectOptions;

using test_support::check_valid;
using test_support::diff;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------ reference (sort-based)

/// a ranks before b: non-NaN first, higher value first (-0 == +0), then lower position,
/// then lower head.
struct Cand {
  float v;
  std::int64_t t, h;
};
bool better(const Cand& a, const Cand& b) {
  const bool na = std::isnan(a.v), nb = std::isnan(b.v);
  if (na != nb) return nb;
  if (!na && a.v != b.v) return a.v > b.v;
  if (a.t != b.t) return a.t < b.t;
  return a.h < b.h;
}

std::vector<float> ref_znorm(const float* x, std::int64_t n) {
  // double sums in 8 lanes (lane = position % 8), combined pairwise (docs/reference/select.md)
  auto combine = [](const double* l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); };
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sq[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t c = 0;
  for (std::int64_t i = 0; i < n; ++i)
    if (std::isfinite(x[i])) lanes[i % 8] += x[i], ++c;
  const double mu = c ? combine(lanes) / double(c) : 0.0;
  for (std::int64_t i = 0; i < n; ++i)
    if (std::isfinite(x[i])) {
      const double d = double(x[i]) - mu;
      volatile double s = d * d;  // no FMA contraction: the same sums as the library
      sq[i % 8] += s;
    }
  const double sd = c ? std::sqrt(combine(sq) / double(c)) : 0.0;
  const double inv = sd > 0 ? 1.0 / sd : 0.0;
  std::vector<float> z(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) z[std::size_t(i)] = std::isfinite(x[i]) ? float((double(x[i]) - mu) * inv) : x[i];
  return z;
}

struct Input {
  std::int64_t H = 0, N = 0, stride = 0;
  std::vector<float> data;  // [H][stride]
  const float* head(std::int64_t h) const { return data.data() + h * stride; }
  ScoresView view() { return ScoresView(data.data(), H, N, stride); }
};

Selection reference(const Input& in, Budget budget, const SelectOptions& o) {
  const std::int64_t H = in.H, N = in.N;
  const std::int64_t s0 = std::min(o.sinks, N), e0 = std::max(s0, N - std::min(o.recent, N));
  const std::int64_t p = s0 + (N - e0);
  std::vector<std::vector<std::int64_t>> kept(static_cast<std::size_t>(H));
  auto top = [&](std::int64_t h, std::int64_t m, std::vector<std::int64_t>& out) {
    std::vector<Cand> c;
    for (std::int64_t t = s0; t < e0; ++t) c.push_back({in.head(h)[t], t, h});
    std::sort(c.begin(), c.end(), better);
    for (std::int64_t i = 0; i < m; ++i) out.push_back(c[std::size_t(i)].t);
  };
  auto prot = [&](std::vector<std::int64_t>& out) {
    for (std::int64_t t = 0; t < s0; ++t) out.push_back(t);
    for (std::int64_t t = e0; t < N; ++t) out.push_back(t);
  };
  std::int64_t B;
  if (o.alloc == Alloc::per_head) {
    const std::int64_t n = budget.kind() == Budget::Kind::per_head ? budget.count() : budget.count() / std::max<std::int64_t>(H, 1);
    B = n * H;
    for (std::int64_t h = 0; h < H; ++h) {
      prot(kept[std::size_t(h)]);
      top(h, n - p, kept[std::size_t(h)]);
    }
  } else {
    B = budget.kind() == Budget::Kind::per_head ? budget.count() * H : budget.count();
    if (H > 0) {
      const auto s = std::int64_t(std::floor(o.alpha * double(B) / double(H)));
      const std::int64_t g = std::max(std::min(s, N), p);
      std::vector<char> taken(std::size_t(H * N), 0);
      for (std::int64_t h = 0; h < H; ++h) {
        auto& k = kept[std::size_t(h)];
        prot(k);
        top(h, g - p, k);
        for (auto t : k) taken[std::size_t(h * N + t)] = 1;
      }
      std::vector<Cand> c;
      for (std::int64_t h = 0; h < H; ++h) {
        const std::vector<float> z = o.normalize ? ref_znorm(in.head(h), N) : std::vector<float>(in.head(h), in.head(h) + N);
        for (std::int64_t t = 0; t < N; ++t)
          if (!taken[std::size_t(h * N + t)]) c.push_back({z[std::size_t(t)], t, h});
      }
      std::sort(c.begin(), c.end(), better);
      for (std::int64_t i = 0; i < B - H * g; ++i) kept[std::size_t(c[std::size_t(i)].h)].push_back(c[std::size_t(i)].t);
    }
  }
  Selection sel;
  sel.heads = H;
  sel.tokens = N;
  sel.offsets.assign(std::size_t(H + 1), 0);
  for (std::int64_t h = 0; h < H; ++h) {
    auto& k = kept[std::size_t(h)];
    std::sort(k.begin(), k.end());
    sel.offsets[std::size_t(h + 1)] = sel.offsets[std::size_t(h)] + std::int64_t(k.size());
    sel.positions.insert(sel.positions.end(), k.begin(), k.end());
  }
  REQUIRE(sel.total() == B);
  return sel;
}

std::string alloc_name(Alloc a) { return a == Alloc::per_head ? "per-head" : "adakv"; }

/// Every kernel set this CPU runs (AVX-512, AVX2, portable): all must give the same result.
std::vector<kvscore::SelectKernels> kernel_sets() {
  std::vector<kvscore::SelectKernels> out;
  for (auto k : {kvscore::SelectKernels::avx512, kvscore::SelectKernels::avx2, kvscore::SelectKernels::portable})
    if (kvscore::select_kernels_supported(k)) out.push_back(k);
  return out;
}

// ------------------------------------------------------------------ fixtures

std::string select_dir() { return std::string(KVSCORE_TEST_DATA_DIR) + "/select"; }

struct FixtureConfig {
  std::string case_name, config, alloc, kind;
  std::int64_t budget = 0, sinks = 0, recent = 0;
  double alpha = 0.2;
  bool normalize = false;
};

std::vector<FixtureConfig> manifest() {
  std::ifstream f(select_dir() + "/manifest.txt");
  REQUIRE(f);
  std::vector<FixtureConfig> out;
  for (std::string line; std::getline(f, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    FixtureConfig c;
    std::string alpha;
    int norm = 0;
    in >> c.case_name >> c.config >> c.alloc >> c.kind >> c.budget >> c.sinks >> c.recent >> alpha >> norm;
    REQUIRE(!in.fail());
    c.alpha = std::stod(alpha);
    c.normalize = norm != 0;
    out.push_back(c);
  }
  return out;
}

}  // namespace

TEST_CASE("select: numpy fixtures", "[select][fixtures]") {
  const auto configs = manifest();
  REQUIRE(configs.size() >= 30);
  for (const auto& c : configs) {
    const auto scores = kvscore::npy::load(select_dir() + "/" + c.case_name + "/scores.npy");
    REQUIRE(scores.descr == "<f4");
    REQUIRE(scores.shape.size() == 2);
    Input in;
    in.H = scores.shape[0];
    in.N = scores.shape[1];
    in.stride = in.N;
    in.data = scores.to_vector<float>();
    Selection want;
    want.heads = in.H;
    want.tokens = in.N;
    want.positions = kvscore::npy::load(select_dir() + "/" + c.case_name + "/" + c.config + ".positions.npy").to_vector<std::int64_t>();
    want.offsets = kvscore::npy::load(select_dir() + "/" + c.case_name + "/" + c.config + ".offsets.npy").to_vector<std::int64_t>();
    SelectOptions o;
    o.alloc = c.alloc == "adakv" ? Alloc::adakv : Alloc::per_head;
    o.sinks = c.sinks;
    o.recent = c.recent;
    o.alpha = c.alpha;
    o.normalize = c.normalize;
    const Budget b = c.kind == "head" ? Budget::per_head(c.budget) : Budget::per_layer(c.budget);
    for (kvscore::SelectKernels simd : kernel_sets())
      for (int threads : {1, 3}) {
        o.kernels = simd;
        o.num_threads = threads;
        INFO(c.case_name << "/" << c.config << " kernels " << kvscore::select_kernels_name(simd) << " threads " << threads);
        const Selection got = kvscore::select(in.view(), b, o);
        check_valid(got);
        CHECK(diff(got, want) == "");
        CHECK(diff(reference(in, b, o), want) == "");  // the C++ reference agrees with numpy too
      }
  }
}

TEST_CASE("select: k > N is an error, k = N keeps all, k = 0 keeps none", "[select]") {
  Scores s(2, 5);
  for (int i = 0; i < 10; ++i) s.data()[i] = float((i * 7) % 10);
  try {
    (void)kvscore::select(s, Budget::per_head(6));
    FAIL("no exception");
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    CHECK(m.find("budget of 6 tokens per head exceeds the 5 tokens") != std::string::npos);
    CHECK(m.find("k > N") != std::string::npos);
  }
  SelectOptions ada;
  ada.alloc = Alloc::adakv;
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_head(6), ada), Catch::Contains("exceeds the 5 tokens"));
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_layer(11), ada),
                    Catch::Contains("layer budget 11 exceeds heads 2 x tokens 5 = 10"));
  const Selection all = kvscore::select(s, Budget::per_head(5));
  CHECK(all.positions == std::vector<std::int64_t>{0, 1, 2, 3, 4, 0, 1, 2, 3, 4});
  const Selection none = kvscore::select(s, Budget::per_head(0));
  CHECK(none.positions.empty());
  CHECK(none.offsets == std::vector<std::int64_t>{0, 0, 0});
  const Selection all_ada = kvscore::select(s, Budget::per_layer(10), ada);
  CHECK(all_ada.positions == all.positions);
  const Selection none_ada = kvscore::select(s, Budget::per_layer(0), ada);
  CHECK(none_ada.offsets == std::vector<std::int64_t>{0, 0, 0});
}

TEST_CASE("select: ties, NaN, infinities and signed zeros", "[select]") {
  // position:         0     1     2     3     4      5     6     7     8     9
  std::vector<float> v{kNaN, 1.f, -0.f, 0.f, -kInf, kInf, 1.f, kNaN, 2.f, -1.f};
  Scores s(1, 10);
  std::copy(v.begin(), v.end(), s.data());
  auto keep = [&](std::int64_t n) {
    const Selection r = kvscore::select(s, Budget::per_head(n));
    return std::vector<std::int64_t>(r.positions.begin(), r.positions.end());
  };
  CHECK(keep(1) == std::vector<std::int64_t>{5});            // +inf
  CHECK(keep(3) == std::vector<std::int64_t>{1, 5, 8});      // inf, 2, first 1
  CHECK(keep(4) == std::vector<std::int64_t>{1, 5, 6, 8});   // both 1s
  CHECK(keep(5) == std::vector<std::int64_t>{1, 2, 5, 6, 8});  // -0 == +0: lower position (2) first
  CHECK(keep(6) == std::vector<std::int64_t>{1, 2, 3, 5, 6, 8});
  CHECK(keep(8) == std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 8, 9});  // -inf above NaN
  CHECK(keep(9) == std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 8, 9});  // NaN: lower position first
  // Every NaN is one value: a negative NaN or another payload ranks the same.
  s.data()[7] = -std::numeric_limits<float>::quiet_NaN();
  CHECK(keep(9) == std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 8, 9});
  // An all-NaN head still keeps exactly n tokens, first positions first.
  std::fill(s.data(), s.data() + 10, kNaN);
  CHECK(keep(3) == std::vector<std::int64_t>{0, 1, 2});
}

TEST_CASE("select: protection is a mask inside the budget", "[select]") {
  Scores s(1, 12);
  for (int t = 0; t < 12; ++t) s.data()[t] = float(t % 5);  // 0 1 2 3 4 0 1 2 3 4 0 1
  SelectOptions o;
  o.sinks = 2;
  o.recent = 3;
  const Selection r = kvscore::select(s, Budget::per_head(7), o);
  // protected 0 1 | 9 10 11; best two of 2..8: 4 (pos 4) and 4? no: values 2..8 -> 2 3 4 0 1 2 3: 4 (4), 3 (3), 3 (8)
  CHECK(r.positions == std::vector<std::int64_t>{0, 1, 3, 4, 9, 10, 11});
  // Protected tokens with the lowest possible score are kept (no sentinel can lose a tie).
  s.data()[0] = kNaN;
  s.data()[11] = -kInf;
  CHECK(kvscore::select(s, Budget::per_head(7), o).positions == r.positions);
  // Overlapping and oversized protection is clipped and counted once.
  o.sinks = 8;
  o.recent = 8;
  CHECK(kvscore::select(s, Budget::per_head(12), o).total() == 12);
  try {
    (void)kvscore::select(s, Budget::per_head(11), o);
    FAIL("no exception");
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    CHECK(m.find("sinks 8 and recent 8 protect 12 tokens per head") != std::string::npos);
    CHECK(m.find("overlap counted once") != std::string::npos);
    CHECK(m.find("budget of 11 tokens per head") != std::string::npos);
  }
  o.sinks = 3;
  o.recent = 4;
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_head(6), o),
                    Catch::Contains("sinks 3 and recent 4 protect 7 tokens per head") &&
                        Catch::Contains("budget of 6 tokens per head"));
  CHECK_NOTHROW(kvscore::select(s, Budget::per_head(7), o));
  // budget 0 is valid only without protection
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_head(0), o), Catch::Contains("budget of 0 tokens per head"));
  o.alloc = Alloc::adakv;
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_layer(6), o),
                    Catch::Contains("protect 7 tokens per head") && Catch::Contains("7 x 1 heads = 7 exceeds the layer budget of 6"));
}

TEST_CASE("select: AdaKV safeguard and protection", "[select][adakv]") {
  // Head 0 has all the high scores; head 1 low ones. alpha = 0.5, n = 4, H = 2: B = 8,
  // safeguard floor(0.5 * 8 / 2) = 2 per head, the global step fills 4 more (all head 0).
  Scores s(2, 10);
  for (int t = 0; t < 10; ++t) {
    s.data()[t] = 100.f + float(t);
    s.data()[10 + t] = float(t);
  }
  SelectOptions o;
  o.alloc = Alloc::adakv;
  o.alpha = 0.5;
  Selection r = kvscore::select(s, Budget::per_head(4), o);
  CHECK(r.offsets == std::vector<std::int64_t>{0, 6, 8});
  CHECK(std::vector<std::int64_t>(r.head(0).begin(), r.head(0).end()) == std::vector<std::int64_t>{4, 5, 6, 7, 8, 9});
  CHECK(std::vector<std::int64_t>(r.head(1).begin(), r.head(1).end()) == std::vector<std::int64_t>{8, 9});
  // Protected tokens count towards the safeguard: sinks 1 + recent 1 = 2 = safeguard, so
  // head 1 keeps only its protected tokens 0 and 9; head 0 gets 0, 9 + the global 4.
  o.sinks = 1;
  o.recent = 1;
  r = kvscore::select(s, Budget::per_head(4), o);
  CHECK(r.offsets == std::vector<std::int64_t>{0, 6, 8});
  CHECK(std::vector<std::int64_t>(r.head(0).begin(), r.head(0).end()) == std::vector<std::int64_t>{0, 5, 6, 7, 8, 9});
  CHECK(std::vector<std::int64_t>(r.head(1).begin(), r.head(1).end()) == std::vector<std::int64_t>{0, 9});
  // alpha = 1: safeguard = n, i.e. per-head selection.
  o.alpha = 1.0;
  o.sinks = o.recent = 0;
  SelectOptions ph;
  CHECK(diff(kvscore::select(s, Budget::per_head(4), o), kvscore::select(s, Budget::per_head(4), ph)) == "");
  // alpha = 0: one global top-k.
  o.alpha = 0.0;
  r = kvscore::select(s, Budget::per_head(4), o);
  CHECK(r.offsets == std::vector<std::int64_t>{0, 8, 8});
  // normalize: head 1's z-scores equal head 0's, so the global step splits by position then head.
  o.normalize = true;
  r = kvscore::select(s, Budget::per_head(3), o);
  CHECK(r.offsets == std::vector<std::int64_t>{0, 3, 6});
}

TEST_CASE("select: budget_from_ratio rounding", "[select][budget]") {
  using kvscore::budget_from_ratio;
  CHECK(budget_from_ratio(10, 0.1) == 1);
  CHECK(budget_from_ratio(10, 1.0 - 0.9) == 1);  // kvpress: int(10 * (1 - 0.9)) = 0 tokens
  CHECK(budget_from_ratio(10, 0.01) == 1);       // never 0 for a non-empty cache and ratio > 0
  CHECK(budget_from_ratio(1, 1e-300) == 1);
  CHECK(budget_from_ratio(10, 0.25) == 3);       // 2.5: halves round up
  CHECK(budget_from_ratio(10, 0.24) == 2);
  CHECK(budget_from_ratio(10, 0.26) == 3);
  CHECK(budget_from_ratio(3, 0.5) == 2);
  CHECK(budget_from_ratio(10, 0.3) == 3);        // 0.3 * 10 is 3.0000000000000004 in double
  CHECK(budget_from_ratio(7, 1.0) == 7);
  CHECK(budget_from_ratio(7, 0.9999999) == 7);   // never more than N
  CHECK(budget_from_ratio(10, 0.0) == 0);
  CHECK(budget_from_ratio(0, 0.5) == 0);
  CHECK(budget_from_ratio(0, 0.0) == 0);
  CHECK(budget_from_ratio(std::int64_t(1) << 40, 0.5) == std::int64_t(1) << 39);
  for (std::int64_t n : {1, 2, 3, 7, 100, 4097}) {
    for (double r = 0.0; r <= 1.0; r += 0.01) {
      const std::int64_t k = budget_from_ratio(n, r);
      CHECK(k >= (r > 0 ? 1 : 0));
      CHECK(k <= n);
      CHECK(std::fabs(double(k) - r * double(n)) <= std::max(0.5 + 1e-9, r > 0 ? 1.0 : 0.0));
    }
  }
  // The papers' rounding, M = floor((1 - rho) N), as kvpress's compute_n_kept max(1, int(N (1 - rho))).
  using kvscore::BudgetRounding;
  CHECK(budget_from_ratio(10, 0.25, BudgetRounding::floor) == 2);
  CHECK(budget_from_ratio(10, 0.29, BudgetRounding::floor) == 2);
  CHECK(budget_from_ratio(10, 1.0 - 0.9, BudgetRounding::floor) == 1);  // 0.999... -> 0 -> at least 1
  CHECK(budget_from_ratio(4096, 0.8, BudgetRounding::floor) == 3276);  // ManifoldKV's 20% compression
  for (std::int64_t n : {1, 2, 3, 7, 100, 4097})
    for (int i = 0; i <= 100; ++i) {
      const double rho = i / 100.0;  // compression ratio as kvpress takes it
      const std::int64_t kvpress = rho >= 1.0 ? 0 : std::max<std::int64_t>(1, std::int64_t(double(n) * (1.0 - rho)));
      CAPTURE(n, rho);
      CHECK(budget_from_ratio(n, 1.0 - rho, BudgetRounding::floor) == kvpress);
    }
  CHECK_THROWS_WITH(budget_from_ratio(10, 1.5), Catch::Contains("keep_ratio must be in [0, 1] (got 1.5)"));
  CHECK_THROWS_WITH(budget_from_ratio(10, -0.1), Catch::Contains("(got -0.10000000000000001)"));
  CHECK_THROWS_WITH(budget_from_ratio(10, std::nan("")), Catch::Contains("(got nan)"));
  CHECK_THROWS_WITH(budget_from_ratio(10, kInf), Catch::Contains("(got inf)"));
  CHECK_THROWS_WITH(budget_from_ratio(-1, 0.5), Catch::Contains("tokens must be >= 0 (got -1)"));
}

TEST_CASE("select: error messages name the values", "[select][errors]") {
  Scores s(3, 8);
  SelectOptions o;
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_head(-1)), Catch::Contains("budget must be >= 0 (got -1)"));
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_layer(-3)), Catch::Contains("budget must be >= 0 (got -3)"));
  o.sinks = -2;
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_head(2), o), Catch::Contains("sinks must be >= 0 (got -2)"));
  o.sinks = 0;
  o.recent = -5;
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_head(2), o), Catch::Contains("recent must be >= 0 (got -5)"));
  o.recent = 0;
  for (double a : {-0.5, 1.25, double(kNaN)}) {
    o.alpha = a;
    CHECK_THROWS_WITH(kvscore::select(s, Budget::per_head(2), o), Catch::Contains("alpha must be in [0, 1] (got"));
  }
  o.alpha = 1.25;
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_head(2), o), Catch::Contains("(got 1.25)"));
  o.alpha = 0.2;
  o.num_threads = -1;
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_head(2), o), Catch::Contains("num_threads must be >= 0 (got -1)"));
  o.num_threads = 0;
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_layer(7), o),
                    Catch::Contains("per-layer budget 7 is not a multiple of the 3 heads"));
  CHECK_THROWS_WITH(kvscore::select(s, Budget::per_layer(27), o),
                    Catch::Contains("per-layer budget 27 = 9 tokens per head exceeds the 8 tokens"));
  CHECK_NOTHROW(kvscore::select(s, Budget::per_layer(6), o));
  CHECK_THROWS_WITH(kvscore::select_total(-1, 4, Budget::per_head(1)), Catch::Contains("negative shape (-1, 4)"));
  CHECK_THROWS_WITH(kvscore::select_workspace_bytes(2, 4, Budget::per_head(5)), Catch::Contains("k > N"));
  // int64 overflow of the layer budget
  o.alloc = Alloc::adakv;
  CHECK_THROWS_WITH(kvscore::select_total(std::int64_t(1) << 40, std::int64_t(1) << 40, Budget::per_head(1), o),
                    Catch::Contains("overflows"));
  o.alloc = Alloc::per_head;
  CHECK(kvscore::select_total(std::int64_t(1) << 40, std::int64_t(1) << 40, Budget::per_head(1), o) ==
        std::int64_t(1) << 40);
  CHECK_THROWS_WITH(kvscore::select_workspace_bytes(1, std::int64_t(1) << 61, Budget::per_head(1), o),
                    Catch::Contains("workspace size overflows (heads 1, tokens 2305843009213693952)"));
}

TEST_CASE("select_into: caller memory, workspace and capacity checks", "[select][into]") {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  const std::int64_t H = 4, N = 3000;
  Scores s(H, N);
  for (auto i = 0; i < H * N; ++i) s.data()[i] = nd(rng);
  for (Alloc alloc : {Alloc::per_head, Alloc::adakv}) {
    SelectOptions o;
    o.alloc = alloc;
    o.sinks = 4;
    o.recent = 16;
    o.num_threads = 4;
    const Budget b = Budget::per_head(300);
    const Selection want = kvscore::select(s, b, o);
    const std::int64_t total = kvscore::select_total(H, N, b, o);
    REQUIRE(total == 1200);
    const std::size_t need = kvscore::select_workspace_bytes(H, N, b, o);
    o.num_threads = 1;
    const std::size_t need1 = kvscore::select_workspace_bytes(H, N, b, o);
    CHECK(need1 <= need);
    o.num_threads = 4;
    INFO(alloc_name(alloc));
    // Misaligned workspace, exact size, smaller sizes (fewer threads): same result.
    for (std::size_t bytes : {need, need1, need1 + 1000}) {
      std::vector<unsigned char> ws(bytes + 1, 0xAB);
      std::vector<std::int64_t> off(std::size_t(H + 1), -7), pos(std::size_t(total) + 3, -7);
      const std::int64_t wrote = kvscore::select_into(s, b, o, ws.data() + 1, bytes, off.data(), pos.data(), pos.size());
      CHECK(wrote == total);
      CHECK(off == want.offsets);
      CHECK(std::vector<std::int64_t>(pos.begin(), pos.begin() + total) == want.positions);
      CHECK(pos[std::size_t(total)] == -7);  // nothing past the selection
    }
    std::vector<std::int64_t> off(std::size_t(H + 1), 0), pos(std::size_t(total), 0);
    std::vector<unsigned char> ws(need);
    CHECK_THROWS_WITH(kvscore::select_into(s, b, o, ws.data(), need1 - 1, off.data(), pos.data(), pos.size()),
                      Catch::Contains("workspace of " + std::to_string(need1 - 1) + " bytes is smaller than the " +
                                      std::to_string(need1) + " bytes needed"));
    CHECK_THROWS_WITH(kvscore::select_into(s, b, o, nullptr, need, off.data(), pos.data(), pos.size()),
                      Catch::Contains("workspace of 0 bytes"));
    CHECK_THROWS_WITH(kvscore::select_into(s, b, o, ws.data(), need, off.data(), pos.data(), pos.size() - 1),
                      Catch::Contains("positions capacity 1199 is smaller than the 1200 positions"));
    CHECK_THROWS_WITH(kvscore::select_into(s, b, o, ws.data(), need, nullptr, pos.data(), pos.size()),
                      Catch::Contains("offsets_out is null"));
    CHECK_THROWS_WITH(kvscore::select_into(s, b, o, ws.data(), need, off.data(), nullptr, pos.size()),
                      Catch::Contains("positions_out is null"));
  }
}

TEST_CASE("select: strided scores view and empty shapes", "[select]") {
  const std::int64_t H = 3, N = 50, stride = 64;
  std::vector<float> buf(std::size_t(H * stride), kInf);  // padding would win every comparison
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  Scores dense(H, N);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t) buf[std::size_t(h * stride + t)] = dense.data()[h * N + t] = u(rng);
  for (Alloc alloc : {Alloc::per_head, Alloc::adakv}) {
    SelectOptions o;
    o.alloc = alloc;
    o.normalize = alloc == Alloc::adakv;
    CHECK(diff(kvscore::select(ScoresView(buf.data(), H, N, stride), Budget::per_head(9), o),
               kvscore::select(dense, Budget::per_head(9), o)) == "");
    const Selection e0 = kvscore::select(Scores(0, 10), Budget::per_head(3), o);
    CHECK(e0.heads == 0);
    CHECK(e0.offsets == std::vector<std::int64_t>{0});
    const Selection e1 = kvscore::select(Scores(2, 0), Budget::per_head(0), o);
    CHECK(e1.offsets == std::vector<std::int64_t>{0, 0, 0});
    CHECK_THROWS_WITH(kvscore::select(Scores(2, 0), Budget::per_head(1), o), Catch::Contains("k > N"));
  }
}

namespace {

enum class Dist { normal, few, equal, special, adversarial, runs };

void fill(std::vector<float>& v, std::int64_t H, std::int64_t N, std::int64_t stride, Dist d, std::mt19937_64& rng) {
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> small(0, 5);
  for (std::int64_t h = 0; h < H; ++h) {
    float* x = v.data() + h * stride;
    for (std::int64_t t = 0; t < N; ++t) {
      switch (d) {
        case Dist::normal: x[t] = nd(rng); break;
        case Dist::few: x[t] = float(small(rng)) * 0.25f; break;
        case Dist::equal: x[t] = 1.5f; break;
        case Dist::special: {
          const int r = int(rng() % 12);
          x[t] = r == 0 ? kNaN : r == 1 ? -kInf : r == 2 ? kInf : r == 3 ? -0.f : r == 4 ? 0.f
               : r == 5 ? -kNaN : float(small(rng));
          break;
        }
        case Dist::runs:  // long runs of one value (whole SIMD blocks equal), 2 or 5 values
          x[t] = float((t * (h % 2 ? 5 : 2)) / std::max<std::int64_t>(N, 1)) * (h % 3 == 2 ? -1.f : 1.f);
          break;
        case Dist::adversarial: {
          // Every 16th token (and so any strided sample) holds one value; the rest are
          // spread out: a sampled guess of the threshold is wrong and must be caught.
          x[t] = (t % 16 == 8 || (rng() % 64) == 0) ? 7.f : nd(rng);
          break;
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("select: property test against a sort-based reference", "[select][properties]") {
  std::mt19937_64 rng(12345);
  const Dist dists[] = {Dist::normal, Dist::few, Dist::equal, Dist::special, Dist::adversarial, Dist::runs};
  int runs = 0;
  for (int iter = 0; iter < 300; ++iter) {
    // Mostly small shapes, a tail up to 1e5 tokens (the sampled-window path needs >= 16384).
    const int size_class = int(rng() % 10);
    const std::int64_t N = size_class < 6 ? std::int64_t(1 + rng() % 200)
                           : size_class < 9 ? std::int64_t(1 + rng() % 20000)
                                            : std::int64_t(16384 + rng() % 83617);
    const std::int64_t H = N > 20000 ? std::int64_t(1 + rng() % 2) : std::int64_t(1 + rng() % 5);
    const std::int64_t stride = N + std::int64_t(rng() % 3);
    const Dist dist = dists[rng() % 6];
    Input in;
    in.H = H;
    in.N = N;
    in.stride = stride;
    in.data.assign(std::size_t(H * stride), kInf);
    fill(in.data, H, N, stride, dist, rng);
    SelectOptions o;
    o.alloc = rng() % 2 ? Alloc::adakv : Alloc::per_head;
    o.sinks = rng() % 3 == 0 ? 0 : std::int64_t(rng() % std::uint64_t(std::min<std::int64_t>(N, 64) + 1));
    o.recent = rng() % 3 == 0 ? 0 : std::int64_t(rng() % std::uint64_t(std::min<std::int64_t>(N, 128) + 1));
    if (rng() % 20 == 0) o.sinks = N + 5;  // clipped
    const std::int64_t s0 = std::min(o.sinks, N), p = s0 + (N - std::max(s0, N - std::min(o.recent, N)));
    const double frac[] = {0.0, 0.01, 0.1, 0.5, 0.9, 1.0};
    std::int64_t n = rng() % 2 ? std::int64_t(rng() % std::uint64_t(N + 1))
                               : std::int64_t(std::llround(frac[rng() % 6] * double(N)));
    n = std::max(n, p);
    o.alpha = rng() % 4 == 0 ? 0.0 : rng() % 4 == 0 ? 1.0 : double(rng() % 1000) / 1000.0;
    o.normalize = rng() % 2 == 0;
    Budget b = Budget::per_head(n);
    if (o.alloc == Alloc::adakv && rng() % 3 == 0) {
      const std::int64_t lo = p * H, hi = H * N;
      b = Budget::per_layer(lo + std::int64_t(rng() % std::uint64_t(hi - lo + 1)));
    } else if (rng() % 4 == 0) {
      b = Budget::per_layer(n * H);
    }
    INFO("iter " << iter << " H " << H << " N " << N << " stride " << stride << " dist " << int(dist) << " alloc "
                 << alloc_name(o.alloc) << " budget " << b.count() << (b.kind() == Budget::Kind::per_head ? "/head" : "/layer")
                 << " sinks " << o.sinks << " recent " << o.recent << " alpha " << o.alpha << " normalize " << o.normalize);
    const Selection want = reference(in, b, o);
    for (kvscore::SelectKernels simd : kernel_sets()) {
      for (int threads : {1, 0}) {
        o.kernels = simd;
        o.num_threads = threads;
        const Selection got = kvscore::select(in.view(), b, o);
        check_valid(got);
        REQUIRE(diff(got, want) == "");
        ++runs;
      }
    }
  }
  CHECK(runs == 300 * 2 * int(kernel_sets().size()));
}

TEST_CASE("select: long ranges on every path (sampled window, fallback, tally)", "[select][properties]") {
  std::mt19937_64 rng(99);
  for (std::int64_t N : {16384, 16385, 70001}) {
    for (Dist d : {Dist::normal, Dist::few, Dist::equal, Dist::special, Dist::adversarial, Dist::runs}) {
      Input in;
      in.H = 1;
      in.N = N;
      in.stride = N;
      in.data.resize(std::size_t(N));
      fill(in.data, 1, N, N, d, rng);
      for (std::int64_t k : {std::int64_t(1), N / 100, N / 10, N / 2 - 3, N / 2, N / 2 + 5, N - N / 16, N - 1}) {
        SelectOptions o;
        INFO("N " << N << " dist " << int(d) << " k " << k);
        const Selection want = reference(in, Budget::per_head(k), o);
        for (kvscore::SelectKernels simd : kernel_sets()) {
          o.kernels = simd;
          REQUIRE(diff(kvscore::select(in.view(), Budget::per_head(k), o), want) == "");
        }
      }
    }
  }
}

TEST_CASE("select: sampled window guesses that miss are caught", "[select][properties]") {
  // The selector guesses the threshold from a strided sample (kvscore/select/radix.hpp);
  // these inputs put chosen values exactly at the sampled positions.
  std::mt19937_64 rng(2024);
  std::normal_distribution<float> nd;
  for (std::int64_t N : {16384, 40000}) {
    const int S = kvscore::detail::sel::sample_size(N);
    const std::int64_t stride = N / S;
    auto sampled = [&](std::int64_t t) { return t % stride == stride / 2 && t / stride < S; };
    Input in;
    in.H = 1;
    in.N = N;
    in.stride = N;
    in.data.resize(std::size_t(N));
    // (a) distinct large values at the sampled positions, small ones elsewhere: for m <= S
    //     the kept tokens are the last m sampled positions; for every m the window either
    //     holds the threshold or must be detected as a miss.
    for (std::int64_t t = 0; t < N; ++t) in.data[std::size_t(t)] = sampled(t) ? 1000.f + float(t / stride) : nd(rng);
    for (std::int64_t m = 1; m <= S; m += N > 20000 ? 3 : 1) {
      for (kvscore::SelectKernels simd : kernel_sets()) {
        SelectOptions o;
        o.kernels = simd;
        const Selection got = kvscore::select(in.view(), Budget::per_head(m), o);
        bool ok = got.total() == m;
        for (std::int64_t i = 0; ok && i < m; ++i)
          ok = got.positions[std::size_t(i)] == (S - m + i) * stride + stride / 2;
        INFO("N " << N << " m " << m << " kernels " << kvscore::select_kernels_name(simd));
        REQUIRE(ok);
      }
    }
    // (b) the sample sees only 7 and 8, the data also holds 7.5 between them.
    // (c) the sample sees only 7.
    for (int variant = 0; variant < 2; ++variant) {
      for (std::int64_t t = 0; t < N; ++t)
        in.data[std::size_t(t)] = sampled(t) ? (variant == 0 && (t / stride) % 2 ? 8.f : 7.f)
                                              : (rng() % 2 ? 7.5f : nd(rng));
      for (std::int64_t m : {N / 8, N / 4, N / 3, N / 2 - 1, N / 2, N / 2 + 7, 2 * N / 3, N - 3}) {
        const Selection want = reference(in, Budget::per_head(m), SelectOptions{});
        for (kvscore::SelectKernels simd : kernel_sets()) {
          SelectOptions o;
          o.kernels = simd;
          INFO("N " << N << " variant " << variant << " m " << m << " kernels " << kvscore::select_kernels_name(simd));
          REQUIRE(diff(kvscore::select(in.view(), Budget::per_head(m), o), want) == "");
        }
      }
    }
  }
}

TEST_CASE("select: the ISA pin governs SelectKernels::best", "[select][simd]") {
  namespace simd = kvscore::simd;
  const std::string before = simd::active_table().name;
  for (const simd::KernelTable* t : simd::available_tables()) {
    simd::set_active_isa(t->name);
    const std::string got = kvscore::select_kernels_name();
    INFO("table " << t->name);
    const kvscore::IsaLevel level = t->level;
    if (level <= kvscore::IsaLevel::baseline) CHECK(got == "portable");
    if (level == kvscore::IsaLevel::avx2) CHECK(got != "avx512");
  }
  simd::set_active_isa(before);
}

TEST_CASE("select: kernel sets", "[select]") {
  using kvscore::SelectKernels;
  CHECK(kvscore::select_kernels_supported(SelectKernels::best));
  CHECK(kvscore::select_kernels_supported(SelectKernels::portable));
  const std::string best = kvscore::select_kernels_name();
  CHECK((best == "avx512" || best == "avx2" || best == "portable"));
  INFO("best kernels on this CPU: " << best);
  Scores s(1, 4);
  for (auto k : {SelectKernels::avx512, SelectKernels::avx2}) {
    SelectOptions o;
    o.kernels = k;
    if (kvscore::select_kernels_supported(k))
      CHECK_NOTHROW(kvscore::select(s, Budget::per_head(1), o));
    else
      CHECK_THROWS_WITH(kvscore::select(s, Budget::per_head(1), o), Catch::Contains("are not supported on this CPU"));
  }
}

TEST_CASE("select: key mapping preserves the order", "[select]") {
  using kvscore::detail::sel::key_of;
  const float ordered[] = {-kInf, -3.4e38f, -1.f, -1e-30f, -1e-45f, 0.f, 1e-45f, 1e-30f, 1.f, 3.4e38f, kInf};
  for (std::size_t i = 0; i + 1 < std::size(ordered); ++i) CHECK(key_of(ordered[i]) < key_of(ordered[i + 1]));
  CHECK(key_of(-0.f) == key_of(0.f));
  CHECK(key_of(kNaN) == key_of(-kNaN));
  CHECK(key_of(kNaN) < key_of(-kInf));
  std::uint32_t nan_bits = 0x7F800001u;
  float odd_nan;
  std::memcpy(&odd_nan, &nan_bits, 4);
  CHECK(key_of(odd_nan) == key_of(kNaN));
  CHECK(key_of(kInf) < kvscore::detail::sel::kForcedKey);
}

TEST_CASE("select: identical results for any thread count and run", "[select]") {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> few(0, 9);
  const std::int64_t H = 8, N = 20000;
  Scores s(H, N);
  for (std::int64_t i = 0; i < H * N; ++i) s.data()[i] = float(few(rng));  // heavy ties
  for (Alloc alloc : {Alloc::per_head, Alloc::adakv}) {
    SelectOptions o;
    o.alloc = alloc;
    o.normalize = true;
    o.sinks = 4;
    o.recent = 32;
    o.num_threads = 1;
    const Selection base = kvscore::select(s, Budget::per_head(2000), o);
    for (int t : {0, 2, 3, 8, 16}) {
      o.num_threads = t;
      for (int rep = 0; rep < 2; ++rep) CHECK(diff(kvscore::select(s, Budget::per_head(2000), o), base) == "");
    }
  }
}
