// tests/test_support.hpp — small helpers several test files share: synthetic heads, RoPE,
// error messages, the key caches of the scorer tests (test_scorer_properties.cpp and the
// per-method files test_knorm.cpp … test_qfilter.cpp), paged-style views, the numpy fixtures
// of tests/data/ and selection comparisons.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <kvscore/core/dtype.hpp>
#include <kvscore/scorers/windowed_manifold_l2.hpp>
#include <kvscore/core/selection.hpp>
#include <kvscore/core/splitmix.hpp>
#include <kvscore/simd/dispatch.hpp>
#include <kvscore/synth.hpp>
#include <kvscore/core/view.hpp>

namespace test_support {

// The library's types and the non-finite values most tests name (`using namespace test_support`).
using kvscore::bfloat16;
using kvscore::half;
using kvscore::KeysView;
using kvscore::Scores;
using kvscore::ScoresView;
inline constexpr float kInf = std::numeric_limits<float>::infinity();
inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

/// One KV head of `kvscore synth --kind drift` keys/values (one query head, one query): the
/// long-generation data of the decode-time tests.
inline kvscore::synth::Data drift_head(std::int64_t tokens, std::int64_t head_dim, std::uint64_t seed,
                                      std::int64_t kv_heads = 1) {
  kvscore::synth::Spec spec;
  spec.kind = kvscore::synth::Kind::drift;
  spec.kv_heads = kv_heads;
  spec.group = 1;
  spec.queries = 1;
  spec.head_dim = head_dim;
  spec.tokens = tokens;
  spec.seed = seed;
  return kvscore::synth::generate(spec);
}

/// RoPE as an engine applies it (post-RoPE caches): pairs (2i, 2i+1) of x rotated by
/// pos·10000^(−2i/d), in double, rounded to fp32 once.
inline void rope_rotate(float* x, std::int64_t d, std::int64_t pos) {
  for (std::int64_t i = 0; i < d / 2; ++i) {
    const double th = double(pos) * std::pow(10000.0, -2.0 * double(i) / double(d));
    const double a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = float(a * std::cos(th) - b * std::sin(th));
    x[2 * i + 1] = float(a * std::sin(th) + b * std::cos(th));
  }
}

/// The message of the exception of type E (default: the library's std::invalid_argument) that
/// `f` throws, "no throw" when it throws none; any other exception propagates.
template <class E = std::invalid_argument>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "no throw";
}


// ------------------------------------------------------------------ scorer tests: key caches
//
// Tolerances: the scorers widen to fp32 and accumulate rows in fp32 lanes, so a score carries
// a relative error of a few 1e-7 against the size of the quantities entering it (see
// test_golden.cpp for the derivation). close() compares |a - e| <= tol * (|e| + scale) with
// tol 1e-5 and `scale` the largest key norm involved (or 1 for cosines).

// n values uniform in (lo, hi) from SplitMix64(seed): the layer caches' test data.
inline std::vector<float> uniform_noise(std::int64_t n, std::uint64_t seed, double lo = -1, double hi = 1) {
  kvscore::detail::SplitMix64 rng(seed);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = float(lo + (hi - lo) * rng.uniform_nonzero());
  return v;
}

// Strides of a contiguous [batch][heads][tokens][d] tensor (HF's layout).
inline kvscore::LayerStrides hf_strides(std::int64_t heads, std::int64_t tokens, std::int64_t d) {
  return {heads * tokens * d, tokens * d, d};
}

inline constexpr double kTol = 1e-5;

/// Keys [heads][tokens][dim] held as fp32 values; converted to T on demand.
struct Cache {
  std::int64_t heads = 0, tokens = 0, dim = 0;
  std::vector<float> v;

  Cache() = default;
  Cache(std::int64_t h, std::int64_t n, std::int64_t d) : heads(h), tokens(n), dim(d), v(std::size_t(h * n * d), 0.f) {}
  float* row(std::int64_t h, std::int64_t t) { return v.data() + (h * tokens + t) * dim; }
  const float* row(std::int64_t h, std::int64_t t) const { return v.data() + (h * tokens + t) * dim; }

  template <class T>
  std::vector<T> as() const {
    std::vector<T> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = kvscore::from_float<T>(v[i]);
    return out;
  }
  /// Tokens [t0, t1) of head h only, as a one-head cache.
  Cache head_slice(std::int64_t h, std::int64_t t0, std::int64_t t1) const {
    Cache c(1, t1 - t0, dim);
    std::copy(row(h, t0), row(h, t0) + (t1 - t0) * dim, c.v.begin());
    return c;
  }
  /// Head h without the rows in `drop`, as a one-head cache.
  Cache head_without(std::int64_t h, const std::vector<std::int64_t>& drop, std::int64_t t0 = 0,
                     std::int64_t t1 = -1) const {
    if (t1 < 0) t1 = tokens;
    std::vector<std::int64_t> keep;
    for (std::int64_t t = t0; t < t1; ++t)
      if (std::find(drop.begin(), drop.end(), t) == drop.end()) keep.push_back(t);
    Cache c(1, std::int64_t(keep.size()), dim);
    for (std::size_t i = 0; i < keep.size(); ++i) std::copy(row(h, keep[i]), row(h, keep[i]) + dim, c.row(0, std::int64_t(i)));
    return c;
  }
};

template <class T>
kvscore::KeysView<T> view_of(const std::vector<T>& data, const Cache& c) {
  return kvscore::KeysView<T>(data.data(), c.heads, c.tokens, c.dim, c.tokens * c.dim, c.dim);
}

/// Scores of `scorer` on cache c stored as T.
template <class T = float, class S>
kvscore::Scores run(const S& scorer, const Cache& c) {
  const std::vector<T> data = c.as<T>();
  return scorer.score(view_of(data, c));
}

/// Scores of `scorer` on c with row (h, t) multiplied by k (scaling properties).
template <class S>
kvscore::Scores run_scaled_row(const S& scorer, Cache c, std::int64_t h, std::int64_t t, float k) {
  for (std::int64_t j = 0; j < c.dim; ++j) c.row(h, t)[j] *= k;
  return run(scorer, c);
}

inline Cache random_cache(std::uint32_t seed, std::int64_t h, std::int64_t n, std::int64_t d, float mean = 0.f,
                          float sigma = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  Cache c(h, n, d);
  std::vector<float> mu(static_cast<std::size_t>(d));
  for (auto& x : mu) x = mean * nd(rng);
  for (std::int64_t hh = 0; hh < h; ++hh)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t j = 0; j < d; ++j) c.row(hh, t)[j] = mu[std::size_t(j)] + sigma * nd(rng);
  return c;
}

inline std::vector<float> random_filters(std::uint32_t seed, std::int64_t h, std::int64_t d) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> f(std::size_t(h * d));
  for (auto& x : f) x = nd(rng) / std::sqrt(float(d));
  return f;
}

inline double norm(const float* x, std::int64_t d) {
  double s = 0;
  for (std::int64_t j = 0; j < d; ++j) s += double(x[j]) * x[j];
  return std::sqrt(s);
}

inline double max_row_norm(const Cache& c) {
  double m = 0;
  for (std::int64_t h = 0; h < c.heads; ++h)
    for (std::int64_t t = 0; t < c.tokens; ++t) {
      const double n = norm(c.row(h, t), c.dim);
      if (std::isfinite(n)) m = std::max(m, n);
    }
  return m;
}

inline bool close(double a, double e, double scale, double tol = kTol) {
  if (std::isinf(e) || std::isinf(a)) return a == e;
  return std::fabs(a - e) <= tol * (std::fabs(e) + scale);
}

/// The window partition the documentation specifies (independent of the library's own):
/// merge (default) = a tail shorter than W/2 joins the window before; own = the paper's K[t:min(t+W, N)].
inline std::vector<std::pair<std::int64_t, std::int64_t>> spec_windows(
    std::int64_t n, std::int64_t w, kvscore::WindowTail rule = kvscore::WindowTail::merge) {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  if (rule == kvscore::WindowTail::own) {
    for (std::int64_t t = 0; t < n; t += w) out.emplace_back(t, std::min(t + w, n));
    return out;
  }
  if (n == 0) return out;
  if (n < w) return {{0, n}};
  const std::int64_t full = n / w, tail = n % w;
  for (std::int64_t k = 0; k < full; ++k) out.emplace_back(k * w, (k + 1) * w);
  if (tail > 0) {
    if (full >= 1 && 2 * tail < w) out.back().second = n;
    else out.emplace_back(full * w, n);
  }
  return out;
}

template <class T>
constexpr const char* tname() {
  if constexpr (std::is_same_v<T, float>) return "float32";
  else if constexpr (std::is_same_v<T, kvscore::half>) return "float16";
  else return "bfloat16";
}

/// "f32", "f16" or "bf16": the element type in the fixtures' file names.
template <class T>
constexpr const char* type_tag() {
  if constexpr (std::is_same_v<T, float>) return "f32";
  else if constexpr (std::is_same_v<T, kvscore::half>) return "f16";
  else return "bf16";
}

/// n values of N(0, sigma²) (std::mt19937: test data only, no cross-platform claim).
inline std::vector<float> randn(std::size_t n, std::uint32_t seed, float sigma = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

/// n values of T with random bit patterns (every row distinct, so memcmp catches a misplaced one).
template <class T>
std::vector<T> random_bits(std::size_t n, std::mt19937_64& rng) {
  std::vector<T> v(n);
  std::vector<unsigned char> bytes(n * sizeof(T));
  for (auto& b : bytes) b = static_cast<unsigned char>(rng());
  if (n > 0) std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

/// x as T (rounded to nearest).
template <class T>
std::vector<T> convert_to(const std::vector<float>& x) {
  std::vector<T> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = kvscore::from_float<T>(x[i]);
  return out;
}

/// The kernel tables to run: nullptr (the active one) and every table this CPU supports.
inline std::vector<const kvscore::simd::KernelTable*> kernel_tables() {
  std::vector<const kvscore::simd::KernelTable*> out{nullptr};
  for (const auto* t : kvscore::simd::available_tables()) out.push_back(t);
  return out;
}

// ------------------------------------------------------------------ views

/// Token-major copy [N][H][d] of [H][N][d] keys.
template <class T>
std::vector<T> token_major(const std::vector<T>& k, std::int64_t H, std::int64_t N, std::int64_t d) {
  std::vector<T> out(k.size());
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t)
      std::memcpy(&out[std::size_t((t * H + h) * d)], &k[std::size_t((h * N + t) * d)], std::size_t(d) * sizeof(T));
  return out;
}

/// Paged-style view for the tests: blocks of B tokens, stored in reverse block order,
/// each block token-major [B][heads][d] — several runs per head with their own bases.
template <class T>
struct BlockView {
  using value_type = T;
  const T* data = nullptr;
  std::int64_t H = 0, N = 0, d = 0, B = 1;
  std::int64_t heads() const { return H; }
  std::int64_t tokens() const { return N; }
  std::int64_t head_dim() const { return d; }
  std::int64_t blocks() const { return (N + B - 1) / B; }
  template <class F>
  void for_each_run(std::int64_t h, F&& f) const {
    for (std::int64_t b = 0; b < blocks(); ++b) {
      const std::int64_t slot = blocks() - 1 - b;
      f(data + (slot * B * H + h) * d, b * B, std::min(B, N - b * B), H * d);
    }
  }
};

/// Storage for BlockView from [H][N][d] keys (NaN in the unused rows of the last block).
template <class T>
std::vector<T> to_blocks(const std::vector<T>& keys, std::int64_t H, std::int64_t N, std::int64_t d, std::int64_t B) {
  const std::int64_t nb = (N + B - 1) / B;
  std::vector<T> out(std::size_t(nb * B * H * d), kvscore::from_float<T>(std::numeric_limits<float>::quiet_NaN()));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t) {
      const std::int64_t slot = nb - 1 - t / B;
      std::memcpy(&out[std::size_t(((slot * B + t % B) * H + h) * d)], &keys[std::size_t((h * N + t) * d)],
                  std::size_t(d) * sizeof(T));
    }
  return out;
}

// ------------------------------------------------------------------ fixtures
//
// tests/data/<set>/: manifest.txt (one case per line) and per case a directory with
// params.json (a flat object the tools/gen_*.py generators write) and .npy arrays.

/// tests/data/<set>
inline std::string fixture_dir(const std::string& set) { return std::string(KVSCORE_TEST_DATA_DIR) + "/" + set; }

inline std::string read_text(const std::string& path) {
  std::ifstream f(path);
  if (!f) FAIL("cannot open " << path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// The value of `key` in a flat params.json, as text (quotes and spaces trimmed).
inline std::string json_value(const std::string& text, const std::string& key) {
  const std::string quoted = "\"" + key + "\"";
  const auto k = text.find(quoted);
  if (k == std::string::npos) FAIL("params.json has no key " << key);
  const auto colon = text.find(':', k + quoted.size());
  REQUIRE(colon != std::string::npos);
  const auto end = text.find_first_of(",\n}", colon);
  std::string v = text.substr(colon + 1, end - colon - 1);
  v.erase(0, v.find_first_not_of(" \""));
  v.erase(v.find_last_not_of(" \"") + 1);
  return v;
}
inline std::int64_t json_int(const std::string& text, const std::string& key) { return std::stoll(json_value(text, key)); }

/// The case names of a fixture set's manifest.txt.
inline std::vector<std::string> manifest(const std::string& set) {
  std::istringstream in(read_text(fixture_dir(set) + "/manifest.txt"));
  std::vector<std::string> names;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) names.push_back(line);
  return names;
}

// ------------------------------------------------------------------ selections

/// Empty when equal, else the first difference.
inline std::string diff(const kvscore::Selection& a, const kvscore::Selection& b) {
  std::ostringstream m;
  if (a.heads != b.heads || a.tokens != b.tokens) m << "shape " << a.heads << "x" << a.tokens << " vs " << b.heads << "x" << b.tokens;
  else if (a.offsets != b.offsets) {
    m << "offsets differ:";
    for (std::size_t i = 0; i < std::min<std::size_t>(a.offsets.size(), 12); ++i) m << " " << a.offsets[i] << "/" << b.offsets[i];
  } else if (a.positions != b.positions) {
    for (std::size_t i = 0; i < a.positions.size(); ++i)
      if (a.positions[i] != b.positions[i]) {
        m << "position " << i << ": " << a.positions[i] << " vs " << b.positions[i];
        break;
      }
  }
  return m.str();
}

/// A well-formed selection: offsets from 0 to total(), each head's positions in range and
/// strictly ascending.
inline void check_valid(const kvscore::Selection& s) {
  REQUIRE(s.offsets.size() == std::size_t(s.heads + 1));
  CHECK(s.offsets[0] == 0);
  CHECK(std::size_t(s.total()) == s.positions.size());
  for (std::int64_t h = 0; h < s.heads; ++h) {
    const auto p = s.head(h);
    bool ok = true;
    for (std::size_t i = 0; i < p.size(); ++i) ok = ok && p[i] >= 0 && p[i] < s.tokens && (i == 0 || p[i - 1] < p[i]);
    INFO("head " << h);
    REQUIRE(ok);  // in range, strictly ascending
  }
}

}  // namespace test_support
