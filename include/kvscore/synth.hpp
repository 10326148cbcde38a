// kvscore/synth.hpp — synthetic KV caches with the planted structure real caches show
// and that each scorer's claim depends on (docs/reference/synth.md).
//
// [snippet synth-header: tests/test_snippets.cpp]
//   kvscore::synth::Spec spec;                 // kind mixed, 1 layer, 4 KV heads, G = 2, 2048 tokens, d = 64
//   spec.kind = kvscore::synth::Kind::drift;
//   kvscore::synth::Data data = kvscore::synth::generate(spec);
//   // data.keys / data.values [layers][kv_heads][tokens][d], data.queries [layers][q_heads][queries][d]
//   // data.planted: positions of the planted tokens per (layer, kv head)
//
// Randomness: splitmix64 (Steele et al. 2014) → uniform doubles (53 bits) → Box–Muller
// normals, no std::*_distribution, so the stream is specified here and not by the standard
// library. Every (layer, KV head) draws from its own stream seeded by mix(seed, layer, head),
// so heads do not depend on each other or on generation order. The integer stream is
// identical everywhere; the normals use std::log / std::sqrt / std::cos / std::sin in double
// and are rounded to fp32 once at the end, so two platforms agree to fp32 rounding (a value
// may differ in its last fp32 bit where the libm or FMA contraction differ in double).
//
// Geometry (per KV head, all vectors in R^d; logits are q·k/√d). Let s = d^{1/4}; every key
// is s·k̂ and every query s·q̂, so a logit is exactly q̂·k̂ and the magnitudes below read as
// logit units independent of d:
//   u       a random unit "mean direction" shared by queries and keys (anisotropy)
//   B       r random orthonormal directions ⟂ u (low intrinsic dimension, r = 8)
//   bulk    k̂ = a·u + B(c_seg + z) + σ_e·ε,  z ~ N(0, I_r), ε ~ N(0, I_d)
//   c_seg   a topic centre per segment of `segment` tokens (drift), 0 without drift
//   query   q̂ = m_q·u + σ_w·B w + σ_q·ε + γ·(direction of its target)
// Planted tokens (kinds choose which; positions drawn without collision, recorded in planted):
//   sink      token 0: k̂ = λ·u with λ large (huge first-token key), small value
//   radial    k̂ = (m_k + Δ)·u + bulk noise: on the mean direction, far along it — cosine sees
//             nothing unusual (it is *more* aligned than the bulk), L2 to the centroid sees Δ
//   angular   k̂ = δ·v (v ⟂ u, B): typical norm, off-manifold direction; targeted by queries
//   local     drift only: a segment's bulk + δ_l·v — an outlier in its segment, not globally
//   multikey  M = 4 consecutive tokens sharing one direction v_g (+ jitter); targeted as a group
//   anchor    two tight clusters of tokens scattered over positions (SAT-like: each deviates
//             from its neighbours, all of a cluster are alike); targeted as clusters
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvscore/core/splitmix.hpp"

namespace kvscore::synth {

/// The library's splitmix64 (kvscore/core/splitmix.hpp) with the generator's conversions.
class SplitMix64 : public kvscore::detail::SplitMix64 {
 public:
  using kvscore::detail::SplitMix64::SplitMix64;
  /// Uniform in (0, 1]: ((x >> 11) + 1) · 2^-53 (never 0, so log() is finite).
  constexpr double uniform() noexcept { return uniform_nonzero(); }
  /// Uniform integer in [0, n) by 128-bit multiply-high (n > 0; bias < n / 2^64).
  constexpr std::uint64_t below(std::uint64_t n) noexcept {
    return std::uint64_t((unsigned __int128)next() * n >> 64);
  }
};

/// Standard normals by Box–Muller: from u1, u2 = uniform(), uniform():
/// r = √(−2 ln u1), θ = 2π·u2; returns r·cos θ, then r·sin θ, then draws the next pair.
class Normal {
 public:
  explicit Normal(std::uint64_t seed) noexcept : rng_(seed) {}  ///< seeds the SplitMix64 stream
  /// The next standard normal.
  double operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = rng_.uniform(), u2 = rng_.uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double th = 6.283185307179586 * u2;
    spare_ = r * std::sin(th);
    has_spare_ = true;
    return r * std::cos(th);
  }
  SplitMix64& rng() noexcept { return rng_; }  ///< the uniform stream underneath

 private:
  SplitMix64 rng_;
  double spare_ = 0;
  bool has_spare_ = false;
};

/// Seed of the stream of (layer, head, stream): splitmix64 outputs chained over the parts.
inline std::uint64_t stream_seed(std::uint64_t seed, std::uint64_t layer, std::uint64_t head,
                                 std::uint64_t stream) noexcept {
  std::uint64_t s = SplitMix64(seed).next();
  s = SplitMix64(s ^ layer).next();
  s = SplitMix64(s ^ (head + 0x100000000ULL)).next();
  return SplitMix64(s ^ (stream + 0x200000000ULL)).next();
}

/// What a generated cache plants. `mixed` plants everything at moderate strength (the
/// built-in benchmark data); every other kind isolates one structure at full strength.
enum class Kind { mixed, sinks, anisotropic, lowrank, drift, radial_needles, angular_needles, multikey_needles, anchors };

/// Every Kind with its name, in order.
inline const std::vector<std::pair<Kind, const char*>>& kinds() {
  static const std::vector<std::pair<Kind, const char*>> k = {
      {Kind::mixed, "mixed"},
      {Kind::sinks, "sinks"},
      {Kind::anisotropic, "anisotropic"},
      {Kind::lowrank, "lowrank"},
      {Kind::drift, "drift"},
      {Kind::radial_needles, "radial-needles"},
      {Kind::angular_needles, "angular-needles"},
      {Kind::multikey_needles, "multikey-needles"},
      {Kind::anchors, "anchors"},
  };
  return k;
}

/// The name of kind `k` ("mixed", "radial-needles", ...).
inline const char* kind_name(Kind k) {
  for (const auto& [kind, name] : kinds())
    if (kind == k) return name;
  throw std::invalid_argument("kvscore::synth: unknown Kind value " + std::to_string(int(k)));
}

/// Every kind's name, comma-separated.
inline std::string kind_list() {
  std::string s;
  for (const auto& [kind, name] : kinds()) s += (s.empty() ? "" : ", ") + std::string(name);
  return s;
}

/// The Kind named `s`; std::invalid_argument naming the known kinds otherwise.
inline Kind parse_kind(const std::string& s) {
  for (const auto& [kind, name] : kinds())
    if (s == name) return kind;
  throw std::invalid_argument("kvscore::synth: unknown kind '" + s + "' (expected one of " + kind_list() + ")");
}

/// What to generate: the kind of structure, the cache's shape and the seed.
struct Spec {
  Kind kind = Kind::mixed;  ///< the structure planted
  std::int64_t layers = 1;  ///< layers
  std::int64_t kv_heads = 4;  ///< KV heads per layer
  std::int64_t group = 2;       ///< query heads per KV head (GQA); q_heads = kv_heads * group
  std::int64_t tokens = 2048;  ///< tokens per head
  std::int64_t head_dim = 64;  ///< dimensions of a key, a value and a query
  std::int64_t queries = 16;    ///< queries per query head
  std::int64_t segment = 256;   ///< drift / mixed: tokens per topic segment
  std::uint64_t seed = 0;  ///< the seed (the same seed gives the same data, on every machine)
};

/// A generated cache. Planted positions ascend per (layer, head).
struct Data {
  Spec spec;  ///< what it was generated from
  std::vector<float> keys;     ///< [layers][kv_heads][tokens][head_dim]
  std::vector<float> values;   ///< [layers][kv_heads][tokens][head_dim]
  std::vector<float> queries;  ///< [layers][kv_heads*group][queries][head_dim]
  /// (name, positions[layer * kv_heads + head]) for every planted structure of the kind.
  std::vector<std::pair<std::string, std::vector<std::vector<std::int64_t>>>> planted;

  std::int64_t q_heads() const noexcept { return spec.kv_heads * spec.group; }  ///< query heads: kv_heads × group
  /// Positions planted as `name` in (layer, head); empty when the kind plants none.
  const std::vector<std::int64_t>& planted_at(const std::string& name, std::int64_t layer, std::int64_t head) const {
    static const std::vector<std::int64_t> none;
    for (const auto& [n, pos] : planted)
      if (n == name) return pos[std::size_t(layer * spec.kv_heads + head)];
    return none;
  }
};

namespace detail {

/// Strength of each structure; a kind is a preset of these (see params()).
struct Params {
  double m_k = 3.0, m_q = 0.5;        // key / query component along u
  double a_sd = 0.3;                  // per-token spread of the key component along u
  double z_sd = 1.0;                  // spread inside the r-dim subspace
  double orth_lognormal = 0.0;        // anisotropic: per-token log-scale spread of B z
  double eps = 0.1;                   // isotropic key noise per coordinate
  double w_sd = 0.3, q_eps = 0.05;    // query subspace / isotropic noise
  double topic_sd = 0.0;              // drift: topic centre spread (0 = no drift)
  bool sink = false;
  double sink_boost = 7.0;            // logit of the sink above the bulk mean
  std::int64_t radial = 0, angular = 0, local_per_segment = 0, multikey_groups = 0, anchors_per_cluster = 0;
  double radial_delta = 10.0, angular_norm = 3.0, local_delta = 4.0, multikey_delta = 3.0, anchor_norm = 3.0;
  double target_logit = 8.0;          // γ·δ: logit a targeted query adds to its target
};

inline Params params(const Spec& s) {
  Params p;
  const std::int64_t N = s.tokens;
  switch (s.kind) {
    case Kind::mixed:
      p.sink = true;
      p.topic_sd = 2.0;
      p.radial = std::max<std::int64_t>(1, N / 256);
      p.angular = std::max<std::int64_t>(1, N / 512);
      p.local_per_segment = 1;
      p.multikey_groups = std::max<std::int64_t>(1, N / 1024);
      p.anchors_per_cluster = std::max<std::int64_t>(2, N / 512);
      break;
    case Kind::sinks: p.sink = true; break;
    case Kind::anisotropic:
      p.m_k = 0.0;
      p.a_sd = 1.0;
      p.m_q = 1.5;
      p.orth_lognormal = 0.5;
      p.w_sd = 0.1;
      break;
    case Kind::lowrank: p.eps = 0.05; break;
    case Kind::drift:
      p.topic_sd = 3.0;
      p.local_per_segment = 2;
      break;
    case Kind::radial_needles: p.radial = std::max<std::int64_t>(1, N / 128); break;
    case Kind::angular_needles: p.angular = std::max<std::int64_t>(1, N / 256); break;
    case Kind::multikey_needles: p.multikey_groups = std::max<std::int64_t>(1, N / 256); break;
    case Kind::anchors: p.anchors_per_cluster = std::max<std::int64_t>(2, N / 128); break;
  }
  return p;
}

inline constexpr std::int64_t kRank = 8;      // intrinsic dimension of the bulk
inline constexpr std::int64_t kMultikeyRun = 4;  // tokens per multi-key needle

/// n orthonormal directions: Gram–Schmidt (twice) of normal vectors, also ⟂ to `against`.
inline std::vector<std::vector<double>> orthonormal(Normal& g, std::int64_t n, std::int64_t d,
                                                    std::vector<std::vector<double>> against) {
  std::vector<std::vector<double>> out;
  for (std::int64_t i = 0; i < n; ++i) {
    std::vector<double> v(static_cast<std::size_t>(d));
    for (auto& x : v) x = g();
    for (int pass = 0; pass < 2; ++pass)
      for (const auto& b : against) {
        double dot = 0;
        for (std::int64_t j = 0; j < d; ++j) dot += v[std::size_t(j)] * b[std::size_t(j)];
        for (std::int64_t j = 0; j < d; ++j) v[std::size_t(j)] -= dot * b[std::size_t(j)];
      }
    double nn = 0;
    for (const double x : v) nn += x * x;
    nn = std::sqrt(nn);
    for (auto& x : v) x /= nn;
    against.push_back(v);
    out.push_back(std::move(v));
  }
  return out;
}

/// Draws `count` runs of `len` free consecutive positions in [lo, hi), marks them taken.
inline std::vector<std::int64_t> draw_positions(SplitMix64& rng, std::vector<char>& taken, std::int64_t lo,
                                                std::int64_t hi, std::int64_t count, std::int64_t len) {
  std::vector<std::int64_t> starts;
  for (std::int64_t c = 0; c < count; ++c) {
    for (int attempt = 0;; ++attempt) {
      if (attempt > 100000 || hi - lo < len)
        throw std::invalid_argument("kvscore::synth: no room for the planted tokens in [" + std::to_string(lo) +
                                    ", " + std::to_string(hi) + ")");
      const std::int64_t t = lo + std::int64_t(rng.below(std::uint64_t(hi - lo - len + 1)));
      bool free = true;
      for (std::int64_t i = 0; i < len; ++i) free = free && !taken[std::size_t(t + i)];
      if (!free) continue;
      for (std::int64_t i = 0; i < len; ++i) taken[std::size_t(t + i)] = 1;
      starts.push_back(t);
      break;
    }
  }
  return starts;
}

/// What a position plants: none, or one of the structures (the names of Data::planted).
enum Planted : int { kNone = -1, kSink = 0, kRadial, kAngular, kLocal, kMultikey, kAnchor, kPlantedKinds };
inline constexpr const char* kPlantedNames[kPlantedKinds] = {"sink", "radial", "angular", "local", "multikey", "anchor"};

/// Which structures a kind plants (the tokens of `local` need topic drift to stand out).
inline std::array<bool, kPlantedKinds> planted_by(const Params& P) {
  return {P.sink, P.radial > 0, P.angular > 0, P.local_per_segment > 0 && P.topic_sd > 0, P.multikey_groups > 0,
          P.anchors_per_cluster > 0};
}

/// The directions of one (layer, head): u (the keys' mean direction) and the bulk's subspace B
/// (ub[0] = u, ub[1..kRank] = B), then one direction off both per query target.
struct Directions {
  std::vector<std::vector<double>> ub, dirs;
  std::int64_t free_dims = 0;
  const std::vector<double>& u() const { return ub[0]; }
  // More targets than free dimensions: directions are reused cyclically (still ⟂ u, B).
  const std::vector<double>& dir(std::int64_t i) const { return dirs[std::size_t(i % free_dims)]; }
};

/// Where one head's planted tokens sit: the structure and the target direction of every
/// position, and the direction of every query target (in planting order).
struct Layout {
  std::vector<std::int64_t> kind_of, target_of, target_dir;
  std::int64_t n_local = 0;  ///< local targets (drift): local_per_segment per segment
};

/// Draws the positions: the sink first, then runs for multikey, then single tokens.
inline Layout plant(const Params& P, const Spec& spec, const std::array<bool, kPlantedKinds>& has, SplitMix64& rng) {
  const std::int64_t N = spec.tokens, segments = (N + spec.segment - 1) / spec.segment;
  Layout out;
  out.n_local = has[kLocal] ? P.local_per_segment * segments : 0;
  std::vector<char> taken(std::size_t(N), 0);
  out.kind_of.assign(std::size_t(N), kNone);
  out.target_of.assign(std::size_t(N), -1);
  if (P.sink) {
    taken[0] = 1;
    out.kind_of[0] = kSink;
  }
  std::int64_t next_dir = 0;
  // `count` runs of `len` tokens of structure k in [lo, hi); each run aims at its own new
  // direction (dir_per_run < 0) or all at dir_per_run
  auto runs = [&](int k, std::int64_t count, std::int64_t lo, std::int64_t hi, std::int64_t len,
                  std::int64_t dir_per_run) {
    const auto starts = draw_positions(rng, taken, lo, hi, count, len);
    for (std::size_t c = 0; c < starts.size(); ++c)
      for (std::int64_t i = 0; i < len; ++i) {
        const std::int64_t t = starts[c] + i;
        out.kind_of[std::size_t(t)] = k;
        out.target_of[std::size_t(t)] = dir_per_run >= 0 ? dir_per_run : next_dir + std::int64_t(c);
      }
  };
  // a target per run, each with its own direction
  auto targets = [&](std::int64_t count) {
    for (std::int64_t c = 0; c < count; ++c) out.target_dir.push_back(next_dir + c);
    next_dir += count;
  };
  if (P.multikey_groups > 0) {  // one direction per group
    runs(kMultikey, P.multikey_groups, 1, N, kMultikeyRun, -1);
    targets(P.multikey_groups);
  }
  if (out.n_local > 0)
    for (std::int64_t sgi = 0; sgi < segments; ++sgi) {
      const std::int64_t lo = std::max<std::int64_t>(1, sgi * spec.segment), hi = std::min(N, (sgi + 1) * spec.segment);
      runs(kLocal, P.local_per_segment, lo, hi, 1, -1);
      targets(P.local_per_segment);
    }
  if (P.angular > 0) {
    runs(kAngular, P.angular, 1, N, 1, -1);
    targets(P.angular);
  }
  if (P.anchors_per_cluster > 0)  // two clusters, each around one direction
    for (int c = 0; c < 2; ++c) {
      runs(kAnchor, P.anchors_per_cluster, 1, N, 1, next_dir);
      targets(1);
    }
  if (P.radial > 0) runs(kRadial, P.radial, 1, N, 1, -1);  // attended through u by every query
  return out;
}

/// Keys K [N][d] and values V [N][d] of one head; s scales keys so that logit = q̂·k̂.
inline void write_keys_values(const Params& P, const Spec& spec, const Directions& D, const std::vector<double>& topic,
                              const Layout& at, Normal& g, Normal& gv, double s, float* K, float* V) {
  const std::int64_t N = spec.tokens, d = spec.head_dim;
  const std::vector<double>& u = D.u();
  std::vector<double> k(static_cast<std::size_t>(d));
  double zc[kRank];
  for (std::int64_t t = 0; t < N; ++t) {
    const std::int64_t kind = at.kind_of[std::size_t(t)];
    const double* c = topic.data() + (t / spec.segment) * kRank;
    const double scale = P.orth_lognormal > 0 ? std::exp(P.orth_lognormal * g()) : 1.0;
    for (std::int64_t r = 0; r < kRank; ++r) zc[r] = c[r] + P.z_sd * scale * g();
    double a = P.m_k + P.a_sd * g();
    for (std::int64_t j = 0; j < d; ++j) k[std::size_t(j)] = P.eps * g();
    double off = 0;  // coefficient along the token's own direction
    switch (kind) {
      case kSink: a = P.m_k + P.sink_boost / std::max(P.m_q, 0.1); break;
      case kRadial: a = P.m_k + P.radial_delta; break;
      case kAngular: a = 0.3 * P.m_k; off = P.angular_norm; for (auto& x : zc) x *= 0.3; break;
      case kLocal: off = P.local_delta; break;
      case kMultikey: off = P.multikey_delta; break;
      case kAnchor: a = 0.3 * P.m_k; off = P.anchor_norm; for (auto& x : zc) x *= 0.1; break;
      default: break;
    }
    for (std::int64_t j = 0; j < d; ++j) {
      double x = k[std::size_t(j)] + a * u[std::size_t(j)];
      for (std::int64_t r = 0; r < kRank; ++r) x += zc[r] * D.ub[std::size_t(1 + r)][std::size_t(j)];
      if (off != 0) x += off * D.dir(at.target_of[std::size_t(t)])[std::size_t(j)];
      K[t * d + j] = float(s * x);
    }
    const double vs = kind == kSink ? 0.1 : 1.0;
    for (std::int64_t j = 0; j < d; ++j) V[t * d + j] = float(vs * gv());
  }
}

/// Queries Q [G][nq][d] of the group's G query heads: the mean direction, subspace noise, and a
/// target (the targets in turn).
inline void write_queries(const Params& P, const Spec& spec, const Directions& D, const Layout& at, Normal& g, double s,
                          float* Q) {
  const std::int64_t G = spec.group, nq = spec.queries, d = spec.head_dim;
  const std::int64_t n_targets = std::int64_t(at.target_dir.size());
  for (std::int64_t gi = 0; gi < G; ++gi) {
    float* Qh = Q + gi * nq * d;
    for (std::int64_t i = 0; i < nq; ++i) {
      double w[kRank];
      for (auto& x : w) x = P.w_sd * g();
      const std::int64_t tgt = n_targets > 0 ? (i * G + gi) % n_targets : -1;
      double gamma = 0;
      if (tgt >= 0) {  // the norm its tokens carry along the direction (planting order)
        const std::int64_t di = at.target_dir[std::size_t(tgt)];
        const double norm = di < P.multikey_groups ? P.multikey_delta
                            : di < P.multikey_groups + at.n_local ? P.local_delta
                            : di < P.multikey_groups + at.n_local + P.angular ? P.angular_norm
                                                                               : P.anchor_norm;
        gamma = P.target_logit / norm;
      }
      for (std::int64_t j = 0; j < d; ++j) {
        double x = P.m_q * D.u()[std::size_t(j)] + P.q_eps * g();
        for (std::int64_t r = 0; r < kRank; ++r) x += w[r] * D.ub[std::size_t(1 + r)][std::size_t(j)];
        if (tgt >= 0) x += gamma * D.dir(at.target_dir[std::size_t(tgt)])[std::size_t(j)];
        Qh[i * d + j] = float(s * x);
      }
    }
  }
}

}  // namespace detail

/// Throws std::invalid_argument naming the first bad field.
inline void validate(const Spec& s) {
  auto bad = [](const std::string& f, std::int64_t v, const std::string& need) {
    throw std::invalid_argument("kvscore::synth: " + f + " must be " + need + " (got " + std::to_string(v) + ")");
  };
  if (s.layers < 1 || s.layers > 1024) bad("layers", s.layers, "in [1, 1024]");
  if (s.kv_heads < 1 || s.kv_heads > 1024) bad("kv_heads", s.kv_heads, "in [1, 1024]");
  if (s.group < 1 || s.group > 64) bad("group", s.group, "in [1, 64]");
  if (s.tokens < 64 || s.tokens > (std::int64_t(1) << 24)) bad("tokens", s.tokens, "in [64, 16777216]");
  if (s.head_dim < detail::kRank + 8 || s.head_dim > 1024)
    bad("head_dim", s.head_dim, "in [" + std::to_string(detail::kRank + 8) + ", 1024]");
  if (s.queries < 1 || s.queries > 65536) bad("queries", s.queries, "in [1, 65536]");
  if (s.segment < 16 || s.segment > s.tokens) bad("segment", s.segment, "in [16, tokens]");
  const double cells = double(s.layers) * double(s.kv_heads) * double(s.group) * double(s.tokens) * double(s.head_dim);
  if (cells > double(std::int64_t(1) << 31))
    throw std::invalid_argument("kvscore::synth: layers x kv_heads x group x tokens x head_dim = " +
                                std::to_string(std::int64_t(cells)) + " exceeds 2^31 values");
}

/// Generates the cache of `spec` (deterministic in spec; see the top of this file).
inline Data generate(const Spec& spec) {
  validate(spec);
  using namespace detail;
  const Params P = params(spec);
  const std::int64_t L = spec.layers, H = spec.kv_heads, G = spec.group, N = spec.tokens, d = spec.head_dim,
                     nq = spec.queries;
  Data out;
  out.spec = spec;
  out.keys.resize(std::size_t(L * H * N * d));
  out.values.resize(std::size_t(L * H * N * d));
  out.queries.resize(std::size_t(L * H * G * nq * d));
  const std::array<bool, kPlantedKinds> has = planted_by(P);
  std::vector<std::vector<std::vector<std::int64_t>>*> slot(kPlantedKinds, nullptr);
  out.planted.reserve(kPlantedKinds);
  for (int i = 0; i < kPlantedKinds; ++i)
    if (has[std::size_t(i)]) {
      out.planted.emplace_back(kPlantedNames[i], std::vector<std::vector<std::int64_t>>(std::size_t(L * H)));
      slot[std::size_t(i)] = &out.planted.back().second;
    }
  const double s = std::sqrt(std::sqrt(double(d)));  // keys s·k̂, queries s·q̂: logit = q̂·k̂
  const std::int64_t segments = (N + spec.segment - 1) / spec.segment;

  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) {
      Normal g(stream_seed(spec.seed, std::uint64_t(l), std::uint64_t(h), 0));
      Normal gv(stream_seed(spec.seed, std::uint64_t(l), std::uint64_t(h), 1));  // values
      SplitMix64 pos_rng(stream_seed(spec.seed, std::uint64_t(l), std::uint64_t(h), 2));
      const std::size_t lh = std::size_t(l * H + h);

      // Positions (their own stream), then directions: u, the subspace B, one off-manifold
      // direction per target.
      const Layout at = plant(P, spec, has, pos_rng);
      for (std::int64_t t = 0; t < N; ++t)
        if (const std::int64_t k = at.kind_of[std::size_t(t)]; k >= 0) (*slot[std::size_t(k)])[lh].push_back(t);
      Directions D;
      D.ub = orthonormal(g, 1 + kRank, d, {});
      const std::int64_t n_dirs = P.angular + at.n_local + P.multikey_groups + (P.anchors_per_cluster > 0 ? 2 : 0);
      D.free_dims = d - 1 - kRank;
      D.dirs = orthonormal(g, std::min(n_dirs, D.free_dims), d, D.ub);

      // Topic centres (drift), in subspace coordinates.
      std::vector<double> topic(std::size_t(segments * kRank), 0.0);
      if (P.topic_sd > 0)
        for (auto& x : topic) x = P.topic_sd * g();

      write_keys_values(P, spec, D, topic, at, g, gv, s, out.keys.data() + lh * std::size_t(N * d),
                        out.values.data() + lh * std::size_t(N * d));
      write_queries(P, spec, D, at, g, s, out.queries.data() + lh * std::size_t(G * nq * d));
    }
  return out;
}

}  // namespace kvscore::synth
