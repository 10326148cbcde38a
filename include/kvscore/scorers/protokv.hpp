// kvscore/scorers/protokv.hpp — ProtoKV (ICLR 2026, "Knowledge in Long Context is Already
// Organized Before You Query"): prototype-guided cluster retention.
//
// Per KV head h (docs/methods/protokv.md has every choice and its reason):
//   1. S(i) = mean cos(k_i, k_j) over the valid j in [i-κ, i+κ], j != i (clipped at the ends);
//      Θ(i) = (E[S] - S(i)) / sd[S]: LOW neighbourhood similarity = HIGH local deviation.
//   2. SAT candidates: the p tokens of highest Θ (ties: lower position), zero keys excluded.
//      Their unit keys are hashed with random Fourier features, bit_i = [cos(w_i·x/σ + b_i) >= 0]
//      (w_i ~ N(0, I) from splitmix64 + Box–Muller, b_i ~ U[0, 2π), σ = median pairwise
//      distance of the candidates), bucket = Σ bit_i 2^(r-1-i); SAT prototype = normalised
//      sum of a bucket's keys.
//   3. PDT prototypes: the other valid tokens in position order cut into v chunks whose
//      lengths differ by at most one; prototype = normalised sum.
//   4. Every valid token joins the prototype of highest cosine (an Eigen GEMM over blocks of
//      32 tokens; ties: lower prototype index, PDT chunks first, then SAT buckets).
//   5. ψ(C) = Σ_{i∈C} q̄·k_i with q̄ = Σ over the group's query heads and the window of q
//      (Psi::sum, the seed summary's formula) or that sum / |C| (Psi::mean); or Psi::attention:
//      the attention mass of C, mean over the group's window queries of Σ_{i∈C}
//      softmax_i(q·k_i/√d) over the head's valid keys (no causal mask) — free of the logit
//      offset a head shares across all keys, which makes a raw sum follow cluster size.
// Scores encode the cluster-granular order so that the generic selector reproduces it: the
// valid tokens sorted by (cluster ψ desc, cluster index asc, q̄·k desc, position asc) get
// scores M, M-1, ..., 1 (M = valid tokens; exact integers in fp32, hence N <= 2^24). Any
// budget then keeps whole clusters in decreasing ψ and fills the rest from the next cluster by
// q̄·k; protected tokens (sinks, the window) are masked by the selector, so a cluster's size
// is its unprotected members. Invalid keys (fp32 squared norm not finite) take no part and
// score -inf. The budget never enters the scores.
//
// Why this file is long (~600 lines): one scorer whose assignment, cluster statistics, ψ and
// rank scores share ProtoKV's per-head state (ProtoKV::analyze exposes it to the tests); its
// heavy non-template parts are already compiled once (detail/compiled.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <Eigen/Dense>

#include "kvscore/core/splitmix.hpp"
#include "kvscore/core/dtype.hpp"
#include "kvscore/core/names.hpp"
#include "kvscore/methods.hpp"
#include "kvscore/scorers/scorer_base.hpp"

namespace kvscore {

namespace detail::proto {

/// The library's splitmix64 (kvscore/core/splitmix.hpp), identical on every platform.
struct SplitMix64 : kvscore::detail::SplitMix64 {
  using kvscore::detail::SplitMix64::SplitMix64;
  /// Uniform in [0, 1) with 53 random bits.
  double uniform() noexcept { return uniform_from_zero(); }
};

/// Stream of head h: its own state, so heads can run in any order.
inline SplitMix64 head_stream(std::uint64_t seed, std::int64_t h) noexcept {
  return SplitMix64{SplitMix64::mix(seed ^ SplitMix64::mix(std::uint64_t(h) + 1))};
}

/// RFF parameters of one head: W [r][d] standard normal (Box–Muller on pairs of uniforms,
/// both outputs used, row-major fill), then b [r] uniform in [0, 2π).
inline void rff_params(std::uint64_t seed, std::int64_t h, int r, std::int64_t d, std::vector<double>& W,
                       std::vector<double>& b) {
  SplitMix64 g = head_stream(seed, h);
  const double two_pi = 6.283185307179586;
  const std::size_t n = std::size_t(r) * std::size_t(d);
  W.resize(n);
  for (std::size_t i = 0; i < n; i += 2) {
    const double u1 = 1.0 - g.uniform(), u2 = g.uniform();  // u1 in (0, 1]: log is finite
    const double rad = std::sqrt(-2.0 * std::log(u1));
    W[i] = rad * std::cos(two_pi * u2);
    if (i + 1 < n) W[i + 1] = rad * std::sin(two_pi * u2);
  }
  b.resize(std::size_t(r));
  for (int i = 0; i < r; ++i) b[std::size_t(i)] = two_pi * g.uniform();
}

}  // namespace detail::proto

/// Everything ProtoKV computed for one KV head (ProtoKV::analyze), for tests and diagnostics.
struct ProtoKVHead {
  std::int64_t tokens = 0;    ///< N, tokens of the head
  std::int64_t head_dim = 0;  ///< d, dimensions of a key
  std::vector<unsigned char> valid;           ///< [N] fp32 squared norm finite
  std::vector<double> similarity;             ///< [N] S_κ(i); NaN for invalid keys
  std::vector<double> deviation;              ///< [N] Θ(i); NaN for invalid keys
  std::vector<float> qk;                      ///< [N] q̄·k_i (fp32 dot); 0 for invalid keys
  std::vector<std::int64_t> candidates;       ///< SAT candidates, highest deviation first
  std::vector<int> candidate_bucket;          ///< LSH bucket of each candidate
  double bandwidth = 0;                       ///< σ used by the LSH
  std::int64_t pdt_prototypes = 0;            ///< prototypes [0, pdt) are PDT chunks
  std::int64_t sat_prototypes = 0;            ///< prototypes [pdt, pdt + sat) are SAT buckets
  std::vector<int> sat_bucket_id;             ///< bucket id of each SAT prototype (ascending)
  std::vector<std::int64_t> chunk_begin;      ///< [pdt + 1] PDT chunk c = non-candidates [chunk_begin[c], chunk_begin[c+1]) (ranks)
  std::vector<float> prototypes;              ///< [P][d] unit vectors (0 for a zero sum)
  std::vector<std::int32_t> cluster;          ///< [N] prototype of each token; -1 for invalid keys
  std::vector<std::int64_t> cluster_size;     ///< [P]
  std::vector<double> psi;                    ///< [P] ψ (sum, mean or attention mass); 0 for empty clusters
  std::vector<std::int32_t> cluster_order;    ///< non-empty clusters, best first
};

/// ProtoKV (prototype-guided cluster retention): the head's keys are grouped around semantic-anchor and
/// position-chunk prototypes, and the clusters ranked by what the last `window` queries give them (ψ); each token's
/// score is its cluster's rank, then q̄·k inside it.
class ProtoKV : public ScorerOptions, public detail::AllocatingScore<ProtoKV> {
 public:
  using detail::AllocatingScore<ProtoKV>::score;

  static constexpr const char* name = "protokv";  ///< the registry's CLI spelling
  static constexpr int passes = 1;  ///< reads of the keys per score() (then fp32 unit copies, docs/methods/protokv.md)

  /// The defaults of kvscore/methods.hpp: κ, p, r, v (docs/methods/protokv.md).
  static constexpr std::int64_t kDefaultKappa = kDefaultProtoKVKappa;
  /// P, SAT candidates per head (kvscore/methods.hpp).
  static constexpr std::int64_t kDefaultSatCandidates = kDefaultProtoKVSatCandidates;
  static constexpr int kDefaultLshBits = kDefaultProtoKVLshBits;  ///< r, LSH hyperplanes per SAT hash
  static constexpr std::int64_t kDefaultChunks = kDefaultProtoKVChunks;  ///< v, PDT chunks per head
  /// Largest cache: scores are exact integers in fp32.
  static constexpr std::int64_t kMaxTokens = std::int64_t(1) << 24;

  /// How a cluster's queries' view becomes its ψ.
  enum class Psi {
    sum,        ///< Σ over the cluster of q̄·k
    mean,       ///< the sum over the cluster's size
    attention,  ///< the cluster's softmax attention mass under the window queries (default)
  };

  std::int64_t kappa = kDefaultKappa;                   ///< >= 1
  std::int64_t sat_candidates = kDefaultSatCandidates;  ///< p in [0, N]
  int lsh_bits = kDefaultLshBits;                       ///< r in [0, 16]
  std::int64_t chunks = kDefaultChunks;                 ///< v >= 0 (clipped to the non-candidates)
  double bandwidth = 0;                                 ///< σ > 0 fixed, 0 = median heuristic
  std::uint64_t seed = 0;                               ///< RFF seed
  /// Cluster score ψ. Default attention: measured better than the sum on a real model's dump and
  /// on synthetic data (docs/methods/protokv.md); the GPU path has sum and mean only.
  Psi psi = Psi::attention;
  /// The queries are the cache's last `window` positions (default: the window is protected and
  /// must fit the cache) or follow the cache (nothing protected). ψ uses no causal mask either way.
  QueryPlacement placement = QueryPlacement::in_cache;

  /// queries: [q_heads][window][head_dim] row-major fp32, the post-RoPE queries of the last
  /// `window` positions; GQA groups contiguous (query heads h*G .. h*G+G-1 serve KV head h).
  /// Only their sum per query head is kept. `group` = q_heads / kv_heads, 0 = derive it.
  ProtoKV(const float* queries, std::int64_t q_heads, std::int64_t window, std::int64_t head_dim,
          std::int64_t group = 0)
      : q_heads_(q_heads), window_(window), dim_(head_dim), group_(group) {
    const std::string who = "kvscore::ProtoKV: ";
    detail::check_query_window("kvscore::ProtoKV", queries, q_heads, window, head_dim, group);
    qsum_.assign(std::size_t(q_heads * head_dim), 0.0);
    for (std::int64_t hq = 0; hq < q_heads; ++hq)
      for (std::int64_t m = 0; m < window; ++m)
        for (std::int64_t j = 0; j < head_dim; ++j) {
          const float x = queries[(hq * window + m) * head_dim + j];
          if (!std::isfinite(x))
            detail::throw_invalid(who + "query value " + std::to_string(x) + " at [head " + std::to_string(hq) +
                                  ", query " + std::to_string(m) + ", dim " + std::to_string(j) + "] is not finite");
          qsum_[std::size_t(hq * head_dim + j)] += double(x);
        }
    queries_.assign(queries, queries + q_heads * window * head_dim);  // Psi::attention reads them
  }

  /// q̄ of KV head h of a cache with kv_heads heads (kv_heads divides q_heads()): the sum over
  /// the group's query heads and the window, in fp64, rounded once to fp32 — the vector every
  /// q̄·k and ψ uses (the CUDA path reads it from here).
  std::vector<float> query_sum(std::int64_t h, std::int64_t kv_heads) const {
    const std::int64_t d = dim_, G = q_heads_ / kv_heads;
    std::vector<float> qbar(static_cast<std::size_t>(d));
    for (std::int64_t j = 0; j < d; ++j) {
      double s = 0;
      for (std::int64_t g = 0; g < G; ++g) s += qsum_[std::size_t((h * G + g) * d + j)];
      qbar[std::size_t(j)] = float(s);
    }
    return qbar;
  }
  std::int64_t q_heads() const noexcept { return q_heads_; }  ///< query heads of the window queries
  std::int64_t window() const noexcept { return window_; }  ///< queries per head (the observation window)
  std::int64_t head_dim() const noexcept { return dim_; }  ///< dimensions of a query
  std::int64_t group() const noexcept { return group_; }  ///< q_heads / kv_heads
  /// The observation window, to protect in the selector (`SelectOptions::recent`); 0 when the
  /// queries follow the cache.
  std::int64_t protected_recent() const noexcept { return placement == QueryPlacement::in_cache ? window_ : 0; }

  /// Throws std::invalid_argument unless these keys can be scored with these parameters.
  template <class View>
  void check(const View& keys) const {
    const std::string who = "kvscore::ProtoKV: ";
    const std::int64_t kv = keys.heads(), n = keys.tokens();
    detail::check_queries_match_keys(who, q_heads_, group_, dim_, kv, keys.head_dim());
    if (placement == QueryPlacement::in_cache && window_ > n)
      detail::throw_invalid(who + "window " + std::to_string(window_) + " > tokens " + std::to_string(n) +
                            " (the window's queries sit at the last positions of the cache; set placement = "
                            "QueryPlacement::after_cache for queries that follow the cache)");
    if (n > kMaxTokens)
      detail::throw_invalid(who + "tokens " + std::to_string(n) + " > " + std::to_string(kMaxTokens) +
                            " (scores are exact integer ranks in fp32)");
    if (kappa < 1) detail::throw_invalid(who + "kappa must be >= 1 (got " + std::to_string(kappa) + ")");
    if (sat_candidates < 0 || sat_candidates > n)
      detail::throw_invalid(who + "sat_candidates " + std::to_string(sat_candidates) + " must be in [0, tokens " +
                            std::to_string(n) + "]");
    if (lsh_bits < 0 || lsh_bits > 16)
      detail::throw_invalid(who + "lsh_bits " + std::to_string(lsh_bits) + " must be in [0, 16]");
    if (chunks < 0) detail::throw_invalid(who + "chunks must be >= 0 (got " + std::to_string(chunks) + ")");
    if (chunks == 0 && sat_candidates == 0)
      detail::throw_invalid(who + "chunks 0 and sat_candidates 0 leave no prototypes");
    if (!(bandwidth >= 0) || !std::isfinite(bandwidth))
      detail::throw_invalid(who + "bandwidth " + std::to_string(bandwidth) + " must be finite and >= 0 (0 = median)");
    if (psi != Psi::sum && psi != Psi::mean && psi != Psi::attention)
      detail::throw_invalid(who + "psi must be Psi::sum, Psi::mean or Psi::attention");
    detail::checked_mul(n, dim_, "kvscore::ProtoKV");
  }

  /// Scores `keys` into `out` ([kv_heads][tokens]): integers M..1 by cluster rank and q̄·k (exact in fp32).
  template <KeyCacheView View>
  void score(const View& keys, ScoresView out) const {
    detail::check_scores_shape(keys, out, name);
    check(keys);
    const simd::KernelTable& table = isa != nullptr ? *isa : simd::active_table();
    // only std::bad_alloc can escape run_head; parallel_for rethrows it after the region
    detail::for_each_head(keys.heads(), num_threads,
                          [&](std::int64_t h) { run_head(table, keys, h, out.head(h), nullptr); });
  }

  /// Every intermediate of KV head h (same computation as score()).
  template <KeyCacheView View>
  ProtoKVHead analyze(const View& keys, std::int64_t h) const {
    check(keys);
    if (h < 0 || h >= keys.heads())
      detail::throw_invalid("kvscore::ProtoKV::analyze: head " + std::to_string(h) + " out of range [0, " +
                            std::to_string(keys.heads()) + ")");
    ProtoKVHead a;
    std::vector<float> scores(std::size_t(keys.tokens()));
    run_head(isa != nullptr ? *isa : simd::active_table(), keys, h, scores.data(), &a);
    return a;
  }

 private:
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  // At most 32 rows at compile time: Eigen's GEMM then never splits the product over
  // OpenMP threads (Parallelizer.h), so the result cannot depend on the thread count.
  static constexpr int kBlockRows = 32;
  using BlockMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor, kBlockRows, Eigen::Dynamic>;

  /// One KV head on its way through the stages (the top of this file), each stage a function
  /// below that reads the fields of the ones before it.
  struct Head {
    std::int64_t h = 0, N = 0, d = 0;
    // pass over the keys
    std::vector<float> U;              ///< [N][d] fp32 unit rows (0 for zero and invalid keys)
    std::vector<float> qk, norm;       ///< q̄·k (0 for invalid keys), ‖k‖
    std::vector<unsigned char> valid;  ///< fp32 squared norm finite
    // 1. neighbourhood similarity
    std::vector<double> S;             ///< S_κ(i), NaN for invalid keys
    std::vector<std::int64_t> elig;    ///< eligible keys (valid, non-zero), for Θ
    double mean = 0, sd = 0;           ///< of S over the eligible keys
    // 2. SAT candidates
    std::vector<std::int64_t> cand;    ///< highest deviation first
    std::vector<unsigned char> is_cand;
    double sigma = 0;                  ///< LSH bandwidth
    std::vector<int> bucket;           ///< of each candidate
    // 3. prototypes
    std::int64_t v = 0, ns = 0, P = 0; ///< PDT chunks, SAT buckets, prototypes
    std::vector<std::int64_t> cb;      ///< PDT chunk boundaries (ranks among the non-candidates)
    std::vector<int> ids;              ///< SAT bucket ids, ascending
    std::vector<float> protos;         ///< [P][d]
    // 4., 5. clusters
    std::vector<std::int32_t> cl;      ///< prototype of each token, -1 for invalid keys
    std::vector<double> psi;           ///< ψ per cluster
    std::vector<std::int64_t> size;    ///< members per cluster
    std::vector<std::int32_t> corder;  ///< non-empty clusters, best first
  };

  template <class View>
  void run_head(const simd::KernelTable& table, const View& keys, std::int64_t h, float* out,
                ProtoKVHead* a) const {
    Head w;
    read_keys(table, keys, h, w);
    similarity(table, w);
    choose_candidates(w);
    build_prototypes(w);
    assign_clusters(w);
    score_clusters(table, w, keys.heads());
    rank_tokens(w, out);
    if (a != nullptr) *a = analysis(std::move(w));
  }

  /// The pass over the keys: q̄·k, ‖k‖², and the fp32 unit rows U (zero rows for zero and invalid keys).
  template <class View>
  void read_keys(const simd::KernelTable& table, const View& keys, std::int64_t h, Head& w) const {
    using T = typename View::value_type;
    const simd::RowOps<T>& ops = table.ops<T>();
    const std::int64_t N = keys.tokens(), d = dim_;
    const std::size_t Nz = std::size_t(N);
    w.h = h;
    w.N = N;
    w.d = d;
    const std::vector<float> qbar = query_sum(h, keys.heads());
    std::vector<float>&U = w.U, &qk = w.qk, &norm = w.norm;
    std::vector<unsigned char>& valid = w.valid;
    U.resize(Nz * std::size_t(d));
    qk.resize(Nz);
    norm.resize(Nz);
    valid.resize(Nz);
    std::vector<float> sq(Nz);
    keys.for_each_run(h, [&](const T* first, std::int64_t t0, std::int64_t len, std::int64_t stride) {
      ops.dot_sqnorm(first, len, stride, d, qbar.data(), qk.data() + t0, sq.data() + t0);
      for (std::int64_t i = 0; i < len; ++i) {
        const std::int64_t t = t0 + i;
        const float s2 = sq[std::size_t(t)];
        float* u = U.data() + t * d;
        valid[std::size_t(t)] = std::isfinite(s2) ? 1 : 0;
        if (!valid[std::size_t(t)] || s2 == 0.f) {
          std::fill(u, u + d, 0.f);
          norm[std::size_t(t)] = 0.f;
          if (!valid[std::size_t(t)]) qk[std::size_t(t)] = 0.f;
          continue;
        }
        convert(first + i * stride, u, std::size_t(d));
        const double nrm = std::sqrt(double(s2)), inv = 1.0 / nrm;
        norm[std::size_t(t)] = float(nrm);
        for (std::int64_t j = 0; j < d; ++j) u[j] = float(double(u[j]) * inv);
        if (!std::isfinite(qk[std::size_t(t)])) {  // |q̄|·|k| beyond fp32 (or Inf-Inf lanes): redo in double
          double s = 0;
          for (std::int64_t j = 0; j < d; ++j) s += double(u[j]) * nrm * double(qbar[std::size_t(j)]);
          qk[std::size_t(t)] = float(std::clamp(s, -double(std::numeric_limits<float>::max()),
                                                double(std::numeric_limits<float>::max())));
        }
      }
    });
  }

  /// 1. Neighbourhood similarity, each pair (i, i+δ), 1 <= δ <= κ, computed once; then the mean
  /// and standard deviation of S over the eligible keys (valid, non-zero), which define Θ.
  void similarity(const simd::KernelTable& table, Head& w) const {
    const std::int64_t N = w.N, d = w.d;
    const std::size_t Nz = std::size_t(N);
    const std::vector<unsigned char>& valid = w.valid;
    std::vector<double>& S = w.S;
    S.assign(Nz, 0.0);
    std::vector<std::int64_t> cnt(Nz, 0);
    float c[64];
    for (std::int64_t i = 0; i < N; ++i) {
      if (!valid[std::size_t(i)]) continue;
      for (std::int64_t j0 = i + 1; j0 <= std::min(N - 1, i + kappa); j0 += 64) {
        const std::int64_t m = std::min<std::int64_t>(64, std::min(N - 1, i + kappa) - j0 + 1);
        table.f32.dot(w.U.data() + j0 * d, m, d, d, w.U.data() + i * d, c);
        for (std::int64_t k = 0; k < m; ++k) {
          const std::size_t j = std::size_t(j0 + k);
          if (!valid[j]) continue;
          S[std::size_t(i)] += double(c[k]);
          S[j] += double(c[k]);
          ++cnt[std::size_t(i)];
          ++cnt[j];
        }
      }
    }
    for (std::size_t i = 0; i < Nz; ++i)
      S[i] = !valid[i] ? std::numeric_limits<double>::quiet_NaN() : cnt[i] > 0 ? S[i] / double(cnt[i]) : 1.0;

    // Local deviation Θ over the eligible keys (valid, non-zero).
    w.elig.reserve(Nz);
    for (std::int64_t t = 0; t < N; ++t)
      if (valid[std::size_t(t)] && w.norm[std::size_t(t)] > 0.f) w.elig.push_back(t);
    double mean = 0, var = 0;
    for (std::int64_t t : w.elig) mean += S[std::size_t(t)];
    if (!w.elig.empty()) mean /= double(w.elig.size());
    for (std::int64_t t : w.elig) var += (S[std::size_t(t)] - mean) * (S[std::size_t(t)] - mean);
    w.mean = mean;
    w.sd = w.elig.empty() ? 0.0 : std::sqrt(var / double(w.elig.size()));
  }

  /// 2. SAT candidates: top-p deviation = lowest S (Θ is a decreasing affine map of S), ties
  /// lower position; the bandwidth; the RFF-LSH bucket of each candidate.
  void choose_candidates(Head& w) const {
    const std::int64_t d = w.d;
    const std::vector<double>& S = w.S;
    std::vector<std::int64_t> elig = w.elig;  // reordered by nth_element; w.elig keeps position order
    const std::int64_t p = std::min<std::int64_t>(sat_candidates, std::int64_t(elig.size()));
    auto by_dev = [&](std::int64_t x, std::int64_t y) {
      return S[std::size_t(x)] != S[std::size_t(y)] ? S[std::size_t(x)] < S[std::size_t(y)] : x < y;
    };
    if (p > 0 && p < std::int64_t(elig.size()))
      std::nth_element(elig.begin(), elig.begin() + (p - 1), elig.end(), by_dev);
    std::vector<std::int64_t>& cand = w.cand;
    cand.assign(elig.begin(), elig.begin() + p);
    std::sort(cand.begin(), cand.end(), by_dev);
    w.is_cand.assign(std::size_t(w.N), 0);
    for (std::int64_t t : cand) w.is_cand[std::size_t(t)] = 1;

    // Bandwidth: fixed, or the median pairwise distance of the candidates' unit keys.
    double sigma = bandwidth;
    if (sigma == 0) {
      std::vector<double> dist;
      dist.reserve(std::size_t(p * (p - 1) / 2 > 0 ? p * (p - 1) / 2 : 0));
      for (std::int64_t x = 0; x < p; ++x)
        for (std::int64_t y = x + 1; y < p; ++y) {
          const float* ux = w.U.data() + cand[std::size_t(x)] * d;
          const float* uy = w.U.data() + cand[std::size_t(y)] * d;
          double s = 0;
          for (std::int64_t j = 0; j < d; ++j) s += (double(ux[j]) - uy[j]) * (double(ux[j]) - uy[j]);
          dist.push_back(std::sqrt(s));
        }
      if (!dist.empty()) {
        const std::size_t mid = (dist.size() - 1) / 2;  // lower median
        std::nth_element(dist.begin(), dist.begin() + std::ptrdiff_t(mid), dist.end());
        sigma = dist[mid];
      }
      if (!(sigma > 0)) sigma = 1.0;
    }
    w.sigma = sigma;

    // RFF-LSH buckets of the candidates.
    const int r = lsh_bits;
    std::vector<double> W, b;
    detail::proto::rff_params(seed, w.h, r, d, W, b);
    w.bucket.resize(static_cast<std::size_t>(p));
    for (std::int64_t x = 0; x < p; ++x) {
      const float* u = w.U.data() + cand[std::size_t(x)] * d;
      int id = 0;
      for (int i = 0; i < r; ++i) {
        double z = 0;
        for (std::int64_t j = 0; j < d; ++j) z += W[std::size_t(i) * std::size_t(d) + std::size_t(j)] * double(u[j]);
        const bool bit = std::cos(z / sigma + b[std::size_t(i)]) >= 0.0;
        id = (id << 1) | (bit ? 1 : 0);
      }
      w.bucket[std::size_t(x)] = id;
    }
  }

  /// 3. Prototypes: the PDT chunks of the other valid tokens in position order first, then the
  /// non-empty SAT buckets by ascending id; each the normalised sum of its keys.
  void build_prototypes(Head& w) const {
    const std::int64_t N = w.N, d = w.d;
    std::vector<std::int64_t> rest;
    rest.reserve(std::size_t(N));
    for (std::int64_t t = 0; t < N; ++t)
      if (w.valid[std::size_t(t)] && !w.is_cand[std::size_t(t)]) rest.push_back(t);
    const std::int64_t nr = std::int64_t(rest.size());
    const std::int64_t v = std::min(chunks, nr);
    w.v = v;
    w.cb.resize(std::size_t(v + 1));
    for (std::int64_t c = 0; c <= v; ++c) w.cb[std::size_t(c)] = v > 0 ? c * nr / v : 0;

    w.ids.assign(w.bucket.begin(), w.bucket.end());
    std::sort(w.ids.begin(), w.ids.end());
    w.ids.erase(std::unique(w.ids.begin(), w.ids.end()), w.ids.end());
    w.ns = std::int64_t(w.ids.size());
    w.P = v + w.ns;
    w.protos.assign(std::size_t(w.P) * std::size_t(d), 0.f);
    std::vector<double> acc(static_cast<std::size_t>(d));
    auto finish = [&](std::int64_t c) {  // normalise acc into prototype c
      double s = 0;
      for (double x : acc) s += x * x;
      const double inv = s > 0 ? 1.0 / std::sqrt(s) : 0.0;
      for (std::int64_t j = 0; j < d; ++j) w.protos[std::size_t(c * d + j)] = float(acc[std::size_t(j)] * inv);
    };
    auto add_key = [&](std::int64_t t) {  // k = ‖k‖·u, in double
      const float* u = w.U.data() + t * d;
      const double nrm = w.norm[std::size_t(t)];
      for (std::int64_t j = 0; j < d; ++j) acc[std::size_t(j)] += nrm * double(u[j]);
    };
    for (std::int64_t c = 0; c < v; ++c) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t k = w.cb[std::size_t(c)]; k < w.cb[std::size_t(c + 1)]; ++k) add_key(rest[std::size_t(k)]);
      finish(c);
    }
    // SAT buckets: members summed in position order
    const std::int64_t p = std::int64_t(w.cand.size());
    std::vector<std::pair<int, std::int64_t>> members(static_cast<std::size_t>(p));
    for (std::int64_t x = 0; x < p; ++x) members[std::size_t(x)] = {w.bucket[std::size_t(x)], w.cand[std::size_t(x)]};
    std::sort(members.begin(), members.end());
    std::size_t k = 0;
    for (std::int64_t s = 0; s < w.ns; ++s) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (; k < members.size() && members[k].first == w.ids[std::size_t(s)]; ++k) add_key(members[k].second);
      finish(v + s);
    }
  }

  /// 4. Nearest prototype by cosine: GEMM over blocks of 32 unit rows, first maximum wins.
  void assign_clusters(Head& w) const {
    const std::int64_t N = w.N, d = w.d, P = w.P;
    w.cl.assign(std::size_t(N), -1);
    if (P == 0) return;
    const Eigen::Map<const RowMat> M(w.protos.data(), Eigen::Index(P), Eigen::Index(d));
    BlockMat C(kBlockRows, Eigen::Index(P));
    for (std::int64_t t0 = 0; t0 < N; t0 += kBlockRows) {
      const std::int64_t m = std::min<std::int64_t>(kBlockRows, N - t0);
      const Eigen::Map<const RowMat> A(w.U.data() + t0 * d, Eigen::Index(m), Eigen::Index(d));
      if (C.rows() != m) C.resize(Eigen::Index(m), Eigen::Index(P));
      C.noalias() = A * M.transpose();
      for (std::int64_t i = 0; i < m; ++i) {
        if (!w.valid[std::size_t(t0 + i)]) continue;
        std::int32_t best = 0;
        float bv = C(Eigen::Index(i), 0);
        for (std::int64_t c = 1; c < P; ++c)
          if (C(Eigen::Index(i), Eigen::Index(c)) > bv) {
            bv = C(Eigen::Index(i), Eigen::Index(c));
            best = std::int32_t(c);
          }
        w.cl[std::size_t(t0 + i)] = best;
      }
    }
  }

  /// 5. ψ per cluster (fp64 sums in position order) and the cluster order, best first.
  void score_clusters(const simd::KernelTable& table, Head& w, std::int64_t kv_heads) const {
    const std::int64_t N = w.N, d = w.d, P = w.P;
    const std::size_t Nz = std::size_t(N);
    std::vector<double>& psi_c = w.psi;
    std::vector<std::int64_t>& size = w.size;
    psi_c.assign(std::size_t(P), 0.0);
    size.assign(std::size_t(P), 0);
    for (std::int64_t t = 0; t < N; ++t)
      if (w.cl[std::size_t(t)] >= 0) {
        psi_c[std::size_t(w.cl[std::size_t(t)])] += double(w.qk[std::size_t(t)]);
        ++size[std::size_t(w.cl[std::size_t(t)])];
      }
    if (psi == Psi::mean)
      for (std::int64_t c = 0; c < P; ++c)
        if (size[std::size_t(c)] > 0) psi_c[std::size_t(c)] /= double(size[std::size_t(c)]);
    if (psi == Psi::attention) {
      // Attention mass per cluster: softmax over the valid keys for each of the group's window
      // queries (logits ‖k‖·(u·q)/√d, fp64 exp and sums), averaged over those queries.
      const std::int64_t G = q_heads_ / kv_heads, rows = G * window_;
      const double inv_sqrt_d = 1.0 / std::sqrt(double(d));
      std::vector<double> mass(Nz, 0.0), e(Nz, 0.0);
      std::vector<float> dots(Nz);
      for (std::int64_t r = 0; r < rows; ++r) {
        const float* q = queries_.data() + (w.h * rows + r) * d;
        table.f32.dot(w.U.data(), N, d, d, q, dots.data());
        double mx = -std::numeric_limits<double>::infinity(), sum = 0;
        for (std::size_t t = 0; t < Nz; ++t)
          if (w.valid[t]) mx = std::max(mx, double(w.norm[t]) * double(dots[t]) * inv_sqrt_d);
        for (std::size_t t = 0; t < Nz; ++t)
          if (w.valid[t]) sum += (e[t] = std::exp(double(w.norm[t]) * double(dots[t]) * inv_sqrt_d - mx));
        if (!(sum > 0)) continue;
        for (std::size_t t = 0; t < Nz; ++t)
          if (w.valid[t]) mass[t] += e[t] / sum;
      }
      std::fill(psi_c.begin(), psi_c.end(), 0.0);
      for (std::size_t t = 0; t < Nz; ++t)
        if (w.cl[t] >= 0) psi_c[std::size_t(w.cl[t])] += mass[t] / double(rows);
    }
    for (std::int64_t c = 0; c < P; ++c)
      if (size[std::size_t(c)] > 0) w.corder.push_back(std::int32_t(c));
    std::sort(w.corder.begin(), w.corder.end(), [&](std::int32_t x, std::int32_t y) {
      return psi_c[std::size_t(x)] != psi_c[std::size_t(y)] ? psi_c[std::size_t(x)] > psi_c[std::size_t(y)] : x < y;
    });
  }

  /// The scores: the valid tokens sorted by (cluster rank, q̄·k desc, position) get M, M-1, ..., 1.
  void rank_tokens(const Head& w, float* out) const {
    const std::int64_t N = w.N;
    std::vector<std::int64_t> rank(std::size_t(w.P), 0);
    for (std::size_t k = 0; k < w.corder.size(); ++k) rank[std::size_t(w.corder[k])] = std::int64_t(k);
    std::vector<std::int64_t> order;
    order.reserve(std::size_t(N));
    for (std::int64_t t = 0; t < N; ++t)
      if (w.cl[std::size_t(t)] >= 0) order.push_back(t);
    std::sort(order.begin(), order.end(), [&](std::int64_t x, std::int64_t y) {
      const std::int64_t rx = rank[std::size_t(w.cl[std::size_t(x)])], ry = rank[std::size_t(w.cl[std::size_t(y)])];
      if (rx != ry) return rx < ry;
      if (w.qk[std::size_t(x)] != w.qk[std::size_t(y)]) return w.qk[std::size_t(x)] > w.qk[std::size_t(y)];
      return x < y;
    });
    const std::int64_t M = std::int64_t(order.size());
    for (std::int64_t t = 0; t < N; ++t) out[t] = kInvalidScore;
    for (std::int64_t o = 0; o < M; ++o) out[order[std::size_t(o)]] = float(M - o);
  }

  /// ProtoKV::analyze's record of a finished head.
  static ProtoKVHead analysis(Head&& w) {
    const std::size_t Nz = std::size_t(w.N);
    std::vector<double> dev(Nz, std::numeric_limits<double>::quiet_NaN());
    for (std::int64_t t : w.elig) dev[std::size_t(t)] = w.sd > 0 ? (w.mean - w.S[std::size_t(t)]) / w.sd : 0.0;
    for (std::size_t t = 0; t < Nz; ++t)  // zero keys: Θ from their S too (they are just not eligible)
      if (w.valid[t] && w.norm[t] == 0.f) dev[t] = w.sd > 0 ? (w.mean - w.S[t]) / w.sd : 0.0;
    return ProtoKVHead{.tokens = w.N, .head_dim = w.d, .valid = std::move(w.valid), .similarity = std::move(w.S),
                       .deviation = std::move(dev), .qk = std::move(w.qk), .candidates = std::move(w.cand),
                       .candidate_bucket = std::move(w.bucket), .bandwidth = w.sigma, .pdt_prototypes = w.v,
                       .sat_prototypes = w.ns, .sat_bucket_id = std::move(w.ids), .chunk_begin = std::move(w.cb),
                       .prototypes = std::move(w.protos), .cluster = std::move(w.cl),
                       .cluster_size = std::move(w.size), .psi = std::move(w.psi), .cluster_order = std::move(w.corder)};
  }

  std::vector<double> qsum_;  ///< Σ over the window of each query head, [q_heads][head_dim]
  std::vector<float> queries_;  ///< the window queries as given, [q_heads][window][head_dim]
  std::int64_t q_heads_, window_, dim_, group_;
};

/// Every ProtoKV::Psi (parse_psi reads these).
inline constexpr ProtoKV::Psi kPsis[] = {ProtoKV::Psi::sum, ProtoKV::Psi::mean, ProtoKV::Psi::attention};

/// "sum", "mean" or "attention".
inline const char* to_string(ProtoKV::Psi p) noexcept {
  return p == ProtoKV::Psi::sum ? "sum" : p == ProtoKV::Psi::mean ? "mean" : "attention";
}

/// "sum" / "mean" / "attention"; anything else throws std::invalid_argument naming it.
inline ProtoKV::Psi parse_psi(std::string_view s) { return detail::parse_enum(s, kPsis, "psi"); }

}  // namespace kvscore
