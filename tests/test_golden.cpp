// Golden tests: every scorer against float64 reference scores computed by numpy.
//
// Fixtures live in tests/data/golden/ and are produced by tools/gen_fixtures.py
// (see docs/contributing/testing.md). For every case x method x element type x memory layout x
// SIMD kernel table the scores must match the reference within
//
//     |actual - expected| <= kRelTol * (|expected| + scale)
//
// Why this tolerance: the expected values are exact (float64) functions of the keys
// *as rounded to the element type*, so the only error left is the library's fp32
// arithmetic. Every kernel widens to fp32 and sums d <= 128 products per row in fp32
// lanes (error <= d*u*Σ|terms| with u = 2^-24 ~ 6e-8 in the worst case, ~sqrt(d)*u
// typically); centroids are summed in fp64 and rounded to fp32 once (u*‖mu‖); the
// final sqrt / division adds a few u. Relative to the size of the quantities that
// enter the sums (`scale`: the largest ‖k‖ of the head for the norm / distance
// scores, 1 for the cosine of KeyDiff, max‖k‖*‖f‖ for QFilter) that is <= 128*u
// ~ 7.6e-6 even in the worst case, so 1e-5 passes any correct fp32 implementation and
// still catches real mistakes (a wrong centroid, a wrong window, a dropped row, a
// bf16 rounding mismatch all move scores by >= 1e-3 relative on these fixtures).
// Cancellation (‖k - mu‖ small for a key near the centroid) is why the bound is
// relative to `scale` and not only to |expected|.
#include <catch2/catch.hpp>

#include <kvscore/kvscore.hpp>
#include <kvscore/io/npy.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace test_support;  // fixtures, kernel_tables, ...

constexpr double kRelTol = 1e-5;

struct Case {
  std::string name, dir;
  std::int64_t heads = 0, tokens = 0, dim = 0, window = 0, qfilter_layer = 0;
};

Case load_case(const std::string& name) {
  Case c;
  c.name = name;
  c.dir = fixture_dir("golden") + "/" + name;
  const std::string p = read_text(c.dir + "/params.json");
  c.heads = json_int(p, "heads"), c.tokens = json_int(p, "tokens"), c.dim = json_int(p, "head_dim");
  c.window = json_int(p, "window"), c.qfilter_layer = json_int(p, "qfilter_layer");
  return c;
}

template <class T>
std::vector<T> load_keys(const Case& c) {
  const auto a = kvscore::npy::load(c.dir + "/keys_" + type_tag<T>() + ".npy");
  REQUIRE(a.shape == std::vector<std::int64_t>{c.heads, c.tokens, c.dim});
  return a.template to_vector<T>();
}

std::vector<double> load_expected(const Case& c, const std::string& method, const char* t) {
  const auto a = kvscore::npy::load(c.dir + "/expected_" + method + "_" + t + ".npy");
  REQUIRE(a.shape == std::vector<std::int64_t>{c.heads, c.tokens});
  return a.to_vector<double>();
}

/// The Q-Filters of one layer, [kv_heads][head_dim], straight from filters.npy.
std::vector<float> filters_of_layer(const Case& c, std::int64_t layer) {
  const auto a = kvscore::npy::load(c.dir + "/filters.npy");
  REQUIRE(a.shape.size() == 3);
  REQUIRE(a.shape[1] == c.heads);
  REQUIRE(a.shape[2] == c.dim);
  REQUIRE(layer < a.shape[0]);
  const float* p = a.as<float>() + layer * c.heads * c.dim;
  return std::vector<float>(p, p + c.heads * c.dim);
}

/// Per-head `scale` of the tolerance (see the comment at the top).
std::vector<double> scales(const Case& c, const std::vector<double>& keys64, const std::string& method,
                           const std::vector<float>& filters) {
  std::vector<double> out(std::size_t(c.heads), 1.0);
  if (method == "keydiff") return out;
  for (std::int64_t h = 0; h < c.heads; ++h) {
    double m = 0;
    for (std::int64_t t = 0; t < c.tokens; ++t) {
      double s = 0;
      for (std::int64_t j = 0; j < c.dim; ++j) {
        const double x = keys64[std::size_t((h * c.tokens + t) * c.dim + j)];
        s += x * x;
      }
      m = std::max(m, std::sqrt(s));
    }
    if (method == "qfilter") {
      double f = 0;
      for (std::int64_t j = 0; j < c.dim; ++j) f += double(filters[std::size_t(h * c.dim + j)]) * filters[std::size_t(h * c.dim + j)];
      m *= std::sqrt(f);
    }
    out[std::size_t(h)] = std::max(m, 1e-30);
  }
  return out;
}

/// Empty string when every score matches; otherwise a description of the first mismatches.
std::string compare(const Case& c, const float* actual, std::int64_t head_stride, const std::vector<double>& expected,
                    const std::vector<double>& scale) {
  std::ostringstream msg;
  int bad = 0;
  double worst = 0;
  for (std::int64_t h = 0; h < c.heads; ++h) {
    for (std::int64_t t = 0; t < c.tokens; ++t) {
      const double e = expected[std::size_t(h * c.tokens + t)];
      const double a = actual[h * head_stride + t];
      bool ok;
      if (std::isinf(e)) {
        ok = a == e;
      } else {
        const double err = std::fabs(a - e) / (std::fabs(e) + scale[std::size_t(h)]);
        worst = std::max(worst, std::isnan(err) ? 1e300 : err);
        ok = err <= kRelTol;
      }
      if (!ok && bad++ < 8) msg << "  [h=" << h << " t=" << t << "] actual " << a << " expected " << e << "\n";
    }
  }
  if (bad == 0) return {};
  std::ostringstream out;
  out << bad << " of " << c.heads * c.tokens << " scores out of tolerance (worst relative error " << worst
      << ", tolerance " << kRelTol << "):\n"
      << msg.str();
  return out.str();
}

template <class T>
std::vector<double> widen(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = double(kvscore::to_float(v[i]));
  return out;
}

/// Calls f(method_name, scorer) for every scorer configured for case c.
template <class F>
void for_each_scorer(const Case& c, F&& f) {
  f(std::string("knorm"), kvscore::KNorm{});
  f(std::string("keydiff"), kvscore::KeyDiff{});
  f(std::string("l2"), kvscore::ManifoldL2{});
  // tools/gen_fixtures.py writes windowed-l2 with the merge rule, the default
  // (test_scorer_properties checks both rules against ManifoldL2 on each window's slice).
  f(std::string("windowed-l2"), kvscore::WindowedManifoldL2(c.window, kvscore::WindowTail::merge));
  f(std::string("qfilter"), kvscore::QFilter::from_npy(c.dir + "/filters.npy", c.qfilter_layer));
}

template <class T>
void run_golden_case(const Case& c) {
  const std::vector<T> keys = load_keys<T>(c);
  const std::vector<double> keys64 = widen(keys);
  const std::int64_t H = c.heads, N = c.tokens, d = c.dim;
  const T junk = kvscore::from_float<T>(std::numeric_limits<float>::quiet_NaN());

  // (a) Hugging Face layout [H, N, d], contiguous.
  const KeysView<T> hf_view(keys.data(), H, N, d, N * d, d);

  // (b) HF static cache [batch=2, H, capacity=N+3, d], our keys in batch row 1; every
  //     other element (batch row 0, the 3 padding tokens per head) is NaN: reading any
  //     of them would turn scores into NaN / -inf or poison the centroids.
  const std::int64_t cap = N + 3, batch = 2;
  std::vector<T> padded(std::size_t(batch * H * cap * d), junk);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t)
      std::memcpy(&padded[std::size_t(((1 * H + h) * cap + t) * d)], &keys[std::size_t((h * N + t) * d)],
                  std::size_t(d) * sizeof(T));
  const KeysView<T> padded_view = KeysView<T>::hf(padded.data(), 1, batch, H, N, d, cap);

  // (c) token-major [N, H, d].
  std::vector<T> tm(keys.size());
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t)
      std::memcpy(&tm[std::size_t((t * H + h) * d)], &keys[std::size_t((h * N + t) * d)], std::size_t(d) * sizeof(T));
  const KeysView<T> tm_view = KeysView<T>::token_major(tm.data(), N, H, d);

  const std::vector<float> qf = filters_of_layer(c, c.qfilter_layer);
  const struct {
    const char* name;
    const KeysView<T>* view;
  } layouts[] = {{"hf", &hf_view}, {"hf-capacity", &padded_view}, {"token-major", &tm_view}};

  for_each_scorer(c, [&](const std::string& method, auto scorer) {
    const std::vector<double> expected = load_expected(c, method, type_tag<T>());
    const std::vector<double> scale = scales(c, keys64, method, qf);
    for (const auto* isa : kernel_tables()) {
      scorer.isa = isa;
      const std::string isa_name = isa ? isa->name : "active";
      for (const auto& layout : layouts) {
        INFO("case " << c.name << ", method " << method << ", dtype " << type_tag<T>() << ", layout " << layout.name
                     << ", isa " << isa_name);
        const Scores s = scorer.score(*layout.view);
        REQUIRE(s.heads() == H);
        REQUIRE(s.tokens() == N);
        CHECK(compare(c, s.data(), N, expected, scale) == "");
      }
      // Caller-owned output with a padded head stride: the gaps must stay untouched.
      {
        INFO("case " << c.name << ", method " << method << ", dtype " << type_tag<T>() << ", strided output, isa "
                     << isa_name);
        const std::int64_t os = N + 2;
        const float sentinel = -12345.5f;
        std::vector<float> buf(std::size_t(H * os), sentinel);
        scorer.score(hf_view, ScoresView(buf.data(), H, N, os));
        CHECK(compare(c, buf.data(), os, expected, scale) == "");
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t t = N; t < os; ++t) CHECK(buf[std::size_t(h * os + t)] == sentinel);
      }
    }
  });
}

}  // namespace

TEST_CASE("golden fixtures are present and consistent", "[golden]") {
  const auto names = manifest("golden");
  REQUIRE(names.size() >= 4);
  for (const auto& name : names) {
    const Case c = load_case(name);
    INFO("case " << name);
    const auto f32 = load_keys<float>(c);
    const auto f16 = load_keys<half>(c);
    const auto bf16 = load_keys<bfloat16>(c);
    // The stored half / bfloat16 keys are exactly kvscore's own RNE rounding of the
    // fp32 keys: numpy's float16 cast and the generator's integer bf16 rounding agree
    // with dtype.hpp, so the expected scores describe what the scorer really sees.
    std::size_t f16_diff = 0, bf16_diff = 0;
    for (std::size_t i = 0; i < f32.size(); ++i) {
      f16_diff += kvscore::float_to_half_bits(f32[i]) != f16[i].bits;
      bf16_diff += kvscore::float_to_bf16_bits(f32[i]) != bf16[i].bits;
    }
    CHECK(f16_diff == 0);
    CHECK(bf16_diff == 0);
  }
}

TEST_CASE("golden scores: float32 keys", "[golden]") {
  for (const auto& name : manifest("golden")) run_golden_case<float>(load_case(name));
}

TEST_CASE("golden scores: float16 keys", "[golden]") {
  for (const auto& name : manifest("golden")) run_golden_case<half>(load_case(name));
}

TEST_CASE("golden scores: bfloat16 keys", "[golden]") {
  for (const auto& name : manifest("golden")) run_golden_case<bfloat16>(load_case(name));
}

TEST_CASE("golden: every SIMD path is listed and named", "[golden]") {
  const auto tables = kvscore::simd::available_tables();
  REQUIRE_FALSE(tables.empty());
  for (const auto* t : tables) {
    REQUIRE(t != nullptr);
    REQUIRE(t->name != nullptr);
    CHECK(std::strlen(t->name) > 0);
  }
  const char* active = kvscore::simd::active_table().name;
  CAPTURE(active);
  CHECK(std::any_of(tables.begin(), tables.end(), [&](const auto* t) { return std::strcmp(t->name, active) == 0; }));
}

TEST_CASE("golden: QFilter::from_npy and the filters vector agree", "[golden]") {
  for (const auto& name : manifest("golden")) {
    const Case c = load_case(name);
    INFO("case " << name);
    const auto keys = load_keys<float>(c);
    const KeysView<float> v(keys.data(), c.heads, c.tokens, c.dim, c.tokens * c.dim, c.dim);
    const auto expected = load_expected(c, "qfilter", "f32");
    const auto qf = filters_of_layer(c, c.qfilter_layer);
    const auto scale = scales(c, widen(keys), "qfilter", qf);

    const kvscore::QFilter from_vec(qf, c.heads, c.dim);
    const Scores a = from_vec.score(v);
    CHECK(compare(c, a.data(), c.tokens, expected, scale) == "");

    // Layer 0 is a different filter set: must not give the layer-1 scores.
    const Scores l0 = kvscore::QFilter::from_npy(c.dir + "/filters.npy", 0).score(v);
    CHECK(compare(c, l0.data(), c.tokens, expected, scale) != "");

    // A layer past the end of the file is an error, not a silent read.
    CHECK_THROWS(kvscore::QFilter::from_npy(c.dir + "/filters.npy", 2));
    CHECK_THROWS(kvscore::QFilter::from_npy(c.dir + "/filters.npy", -1));
  }
}

TEST_CASE("golden: calibrate_qfilters matches numpy SVD", "[golden]") {
  const std::string dir = fixture_dir("golden") + "/calib";
  const std::string p = read_text(dir + "/params.json");
  const std::int64_t hq = json_int(p, "q_heads"), n = json_int(p, "n"), d = json_int(p, "head_dim"),
                     hkv = json_int(p, "kv_heads");
  const auto q = kvscore::npy::load(dir + "/calib_queries.npy");
  REQUIRE(q.shape == std::vector<std::int64_t>{hq, n, d});
  const auto e = kvscore::npy::load(dir + "/calib_expected_filters.npy");
  REQUIRE(e.shape == std::vector<std::int64_t>{hkv, d});
  const std::vector<double> expected = e.to_vector<double>();

  const std::vector<float> f = kvscore::calibrate_qfilters(q.as<float>(), hq, n, d, hkv);
  REQUIRE(f.size() == std::size_t(hkv * d));
  for (std::int64_t h = 0; h < hkv; ++h) {
    INFO("kv head " << h);
    double dot = 0;
    for (std::int64_t j = 0; j < d; ++j) {
      const double a = f[std::size_t(h * d + j)], x = expected[std::size_t(h * d + j)];
      dot += a * x;
      INFO("element " << j << ": actual " << a << " expected " << x);
      // The planted directions have a large spectral gap, so v1 is well conditioned:
      // fp32 input and any SVD / power iteration in >= fp32 lands within ~1e-6; 1e-4
      // leaves room for an iterative solver's stopping criterion.
      CHECK(std::fabs(a - x) <= 1e-4);
      if (std::fabs(x) > 1e-3) CHECK(std::signbit(a) == std::signbit(x));
    }
    CHECK(dot > 0);  // the sign rule picked the same orientation (head 2 needs the flip)
  }

  // Round trip through save_qfilters_npy / QFilter::from_npy.
  const std::string tmp = (std::filesystem::temp_directory_path() / "kvscore_golden_qfilters.npy").string();
  kvscore::save_qfilters_npy(tmp, f, 1, hkv, d);
  const auto back = kvscore::npy::load(tmp);
  CHECK(back.shape == std::vector<std::int64_t>{1, hkv, d});
  CHECK(back.to_vector<float>() == f);
  const kvscore::QFilter qf = kvscore::QFilter::from_npy(tmp, 0);
  const kvscore::QFilter direct(f, hkv, d);
  std::vector<float> keys(std::size_t(hkv * 7 * d));
  for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = float(std::sin(0.37 * double(i)));
  const KeysView<float> v(keys.data(), hkv, 7, d, 7 * d, d);
  const Scores s1 = qf.score(v), s2 = direct.score(v);
  CHECK(s1.values() == s2.values());
  std::remove(tmp.c_str());
}
