// kvscore/pariskv/pariskv.hpp — ParisKV (pariskv.txt §4, App. B): a per-KV-head top-k retrieval
// index over the keys, built by streaming append, searched once per decoding step.
//
// [snippet pariskv-header: tests/test_snippets.cpp]
//   kvscore::ParisKV index(head_dim);              // m = 8, fixed seed, converged Lloyd–Max codebook
//   index.append(keys_of_head, n, row_stride);     // prefill, then any number of decoded keys at a time
//   kvscore::ParisKVResult r = index.search(q);    // top-100 positions (ascending) + estimated scores
//
// Encoding of a key k (data independent, so keys appended late are coded exactly as if they
// had been there from the start — no stale centroids):
//   centring (default on): k ← k − μ with μ the mean of the first append (the prefill), frozen;
//   ⟨k − μ, q⟩ ranks keys exactly like ⟨k, q⟩ for any fixed μ, and reported scores add ⟨μ, q⟩;
//   k̂ = k/‖k‖, k̃ = R k̂ with R = H·D/√P (D: seeded ±1 signs, H: Walsh–Hadamard, P = the next
//   power of two ≥ head_dim; k̂ is zero-padded to P, which keeps R orthonormal on R^d);
//   k̃ splits into B = P/m subspaces of m dims; per subspace b: r_b = ‖k̃_b‖, u_b = k̃_b/r_b,
//   centroid id = bit-pack of (k̃_b,j ≥ 0), 4-bit code per coordinate = sign bit (bit 3 set =
//   negative) + 3-bit magnitude bin t_j of |u_j| (Lloyd–Max thresholds τ), v_j = ±a[t_j],
//   α_b = ⟨v_b, u_b⟩ = Σ_j a[t_j]|u_j|, w_b = ‖k‖·r_b/α_b (r_b = 0 → w_b = 0).
// Search for a query q (pariskv.txt App. B.2):
//   Stage I  per subspace, rank the 2^m sign patterns s by ⟨q̃_b, s⟩ (best-first enumeration of
//            flip sets of sign(q̃_b) by cost Σ 2|q̃_j|, fp32 in sorted order; ties: lower id);
//            with R = ⌈ρN⌉ and tiers r = 5/15/30/50/75/100 %, a pattern whose better-ranked
//            patterns hold `before` keys gets weight #{t : before < ⌈R·r_t⌉} ∈ 0..6; the
//            collision score S_i = Σ_b weight_b(id_{i,b}) ∈ [0, 6B]. The C = ⌈βN⌉ keys with the
//            largest S (ties: lower position) are the candidates (histogram, no sort).
//   Stage II RSQ-IP estimate ‖q‖·Σ_b w_b⟨v_b, q̃_b⟩ for every candidate; the top k (ties: lower
//            position, via kvscore::select) are returned in ascending position order.
//   Optional exact rerank (rerank_exact = k' ≥ k, needs the full-precision keys): the top k'
//            by RSQ-IP are rescored exactly with the library's SIMD dot kernel, top k of those.
// (β, ρ) default by length N: N<5K (0.50, 0.50); <10K (0.25, 0.30); <30K (0.20, 0.25); else
// (0.10, 0.20). C is never below the number of results asked for (max(k, k')), and with the
// default β never below min(N, 2·max(k, k')) (candidate_count).
//
// Determinism: one query runs on one thread; every step is a fixed sequence of fp32/fp64 and
// integer operations, so results are identical across runs and thread counts (the multi-head
// helper parallelises over heads only). The kernel sets (portable, AVX2, AVX-512: see
// kvscore/pariskv/kernels.hpp; Kernels::best follows the KVSCORE_ISA pin) give bit-identical
// collision scores, estimates and results.
// Errors: std::invalid_argument naming the value — keys or queries with a NaN/Inf element or
// a squared norm that overflows fp32 (the library's invalid-row rule; an append is atomic, a
// rejected batch leaves the index unchanged), head_dim outside [1, 4096], m not a power of two
// in [2, 16] dividing P, k > N, β or ρ outside (0, 1], k' < k. A zero key is valid: its ids are
// the all-ones pattern, w = 0, so its estimate is exactly its inner product, 0. A zero query
// returns the first k positions with score 0 (every inner product ties at 0).
// See docs/methods/pariskv.md.
//
// Why this file is long (~800 lines): the ParisKV class is one index whose append (encoding,
// records) and search (Stage I patterns, Stage II estimates, rerank) share its private layout;
// the encoding primitives and the SIMD kernels already live apart (encoding.hpp,
// kernels.hpp), and the decode-time cache in cache.hpp.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/core/splitmix.hpp"
#include "kvscore/pariskv/encoding.hpp"
#include "kvscore/scorers/scorer_base.hpp"
#include "kvscore/select.hpp"
#include "kvscore/simd/dispatch.hpp"
#include "kvscore/pariskv/kernels.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore {

// The encoding primitives (codebook, rotation, length-adaptive ratios, tiers) are in
// kvscore/pariskv/encoding.hpp.

/// Index configuration (fixed at construction).
struct ParisKVConfig {
  std::int64_t m = 8;                          ///< subspace dimension: a power of two in [2, 16] dividing P
  std::uint64_t seed = pariskv::kDefaultSeed;  ///< rotation signs
  int codebook_iterations = 0;                 ///< Lloyd steps; 0 = converged optimum (default), 100 = public table
  /// Subtract a fixed key mean μ before encoding (μ = mean of the first non-empty append, i.e.
  /// the prefill, frozen; or set_center()). Rankings by ⟨k − μ, q⟩ and ⟨k, q⟩ are identical for
  /// any fixed μ, so this cannot make the index stale; it stops a shared key mean from packing
  /// every key into the same sign patterns. false = the paper's encoding of raw keys.
  bool center = true;
};

/// Options of one search.
struct ParisKVSearch {
  std::int64_t k = 100;            ///< results per query, 0 <= k <= N
  double beta = 0;                 ///< candidate ratio in (0, 1]; 0 = length-adaptive default
  double rho = 0;                  ///< collision ratio in (0, 1]; 0 = length-adaptive default
  std::int64_t rerank_exact = 0;   ///< k' >= k: rescore the top k' exactly (needs the keys); 0 = off
  pariskv::Kernels kernels = pariskv::Kernels::best;  ///< the kernel set (every set gives the same results)
};

/// Result of one search: positions ascending, scores[i] belongs to positions[i] (RSQ-IP
/// estimates; exact inner products when rerank_exact is on).
struct ParisKVResult {
  std::vector<std::int64_t> positions;  ///< the positions found, ascending
  std::vector<float> scores;  ///< scores[i] belongs to positions[i]
  std::int64_t candidates = 0;  ///< Stage I candidate count C
};

/// How the queries of a GQA group are combined.
enum class ParisKVGroup {
  mean,   ///< one search with the mean of the group's queries (default)
  union_  ///< one search per query; the union of their positions (score: the largest)
};

/// ParisKV's retrieval index of one KV head (see the top of this file): append() encodes keys (streaming), search()
/// returns the top k positions of a query by collision voting and RSQ-IP estimates.
class ParisKV {
 public:
  /// Scratch buffers of search(); one per thread, reused (grows, never shrinks).
  struct Workspace {
    /// \cond INTERNAL
    std::vector<float> qrot, qt, x, est, exact;
    std::vector<std::uint8_t> tbl, s8, lists;
    std::vector<std::uint16_t> s16;
    std::vector<std::int64_t> hist, cand, top, offsets, sel;
    std::vector<unsigned char> select_ws;
    std::vector<pariskv::detail::PatternNode> heap, group;
    /// \endcond
    std::vector<std::uint64_t> keys;     ///< m <= 8: (cost, id) keys of the patterns to order
  };

  /// An empty index for keys of `head_dim` dimensions; std::invalid_argument for a bad head_dim or option.
  explicit ParisKV(std::int64_t head_dim, const ParisKVConfig& cfg = {}) : cfg_(cfg) {
    const std::string who = "kvscore::ParisKV";
    if (head_dim < 1 || head_dim > kMaxHeadDim)
      pariskv::detail::fail(who + ": head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " +
                            std::to_string(head_dim) + ")");
    rot_ = pariskv::Rotation(head_dim, cfg.seed);
    d_ = head_dim;
    p_ = rot_.padded_dim();
    m_ = cfg.m;
    if (m_ < 2 || m_ > 16 || (m_ & (m_ - 1)) != 0 || p_ % m_ != 0)
      pariskv::detail::fail(who + ": m must be a power of two in [2, 16] that divides the padded head_dim " +
                            std::to_string(p_) + " (got " + std::to_string(m_) + ")");
    if (cfg.codebook_iterations < 0)
      pariskv::detail::fail(who + ": codebook_iterations must be >= 0 (got " + std::to_string(cfg.codebook_iterations) + ")");
    B_ = p_ / m_;
    nc_ = std::int64_t(1) << m_;
    pc_ = (p_ + 31) / 32 * 32;
    // Stage II records (kernels.hpp, "Record of one key"): segments of len coordinates
    // inside one subspace, 16 segments per lane group
    len_ = p_ >= 16 ? std::min(m_, p_ / 16) : 1;
    groups_ = std::max<std::int64_t>(1, (p_ / len_) / 16);
    cb_ = groups_ * ((len_ + 1) / 2) * 16;
    stride_ = cb_ + 4 * B_;
    for (std::int64_t l = 0; l < 16; ++l)
      wlane_[std::size_t(l)] = std::int32_t(std::min(l * len_ / m_, B_ - 1));  // lane -> subspace in group 0
    codebook_ = pariskv::lloyd_max(int(m_), cfg.codebook_iterations);
    for (int t = 0; t < 7; ++t) tau_[std::size_t(t)] = float(codebook_.thresholds[std::size_t(t)]);
    for (int t = 0; t < 8; ++t) {
      value_[std::size_t(t)] = float(codebook_.centres[std::size_t(t)]);
      value_[std::size_t(t + 8)] = -float(codebook_.centres[std::size_t(t)]);
    }
    pop_.assign(std::size_t(B_ * nc_), 0);
    rec_.assign(kRecPad, 0);
  }

  std::int64_t head_dim() const noexcept { return d_; }  ///< dimensions of a key
  std::int64_t padded_dim() const noexcept { return p_; }  ///< P, head_dim padded to a power of two
  std::int64_t m() const noexcept { return m_; }  ///< m, dimensions per subspace
  std::int64_t subspaces() const noexcept { return B_; }  ///< B, subspaces (P / m)
  std::int64_t size() const noexcept { return n_; }  ///< keys indexed
  /// The Lloyd–Max quantiser of the subspaces.
  const pariskv::Codebook& codebook() const noexcept { return codebook_; }
  /// The random rotation applied to every key and query.
  const pariskv::Rotation& rotation() const noexcept { return rot_; }
  const ParisKVConfig& config() const noexcept { return cfg_; }  ///< the options it was built with

  /// Index bytes per key: B centroid ids (1 byte each for m ≤ 8, else 2) and the Stage II
  /// record: P/2 bytes of 4-bit codes (at least 16) and B fp32 weights.
  std::int64_t key_bytes() const noexcept { return B_ * id_bytes() + stride_; }
  /// Bytes of one key's Stage II record (codes, then weights).
  std::int64_t record_bytes() const noexcept { return stride_; }
  /// Bytes of one fp16 key (the cache the index summarises): 2·head_dim.
  std::int64_t fp16_key_bytes() const noexcept { return 2 * d_; }
  /// All index memory in use: per-key data (ids padded to blocks of 64 keys) plus the fixed
  /// part (cluster populations, rotation, tables).
  std::size_t memory_bytes() const noexcept {
    return ids8_.size() + 2 * ids16_.size() + rec_.size() + 8 * pop_.size() + 4 * rot_.scaled_signs().size() +
           4 * mu_.size() + sizeof(*this);
  }

  // ---- read access to the encoding (tests, tools)
  /// Stage I centroid id of key i in subspace b (tests, tools).
  std::uint32_t centroid_id(std::int64_t i, std::int64_t b) const noexcept {
    const std::size_t at = std::size_t((i / 64) * B_ * 64 + b * 64 + i % 64);
    return m_ <= 8 ? ids8_[at] : ids16_[at];
  }
  /// 4-bit code of rotated coordinate j of key i: bit 3 = negative, bits 0-2 = magnitude bin.
  std::uint8_t code(std::int64_t i, std::int64_t j) const noexcept {
    const std::uint8_t byte = rec_[std::size_t(i * stride_ + code_byte(j))];
    return (j % len_) % 2 == 0 ? byte & 15 : byte >> 4;
  }
  /// Stage II weight of key i in subspace b (tests, tools).
  float weight(std::int64_t i, std::int64_t b) const noexcept {
    float w;
    std::memcpy(&w, rec_.data() + i * stride_ + cb_ + 4 * b, sizeof(float));
    return w;
  }
  /// Keys whose centroid in subspace b is `id` (tests, tools).
  std::int64_t population(std::int64_t b, std::uint32_t id) const noexcept { return pop_[std::size_t(b * nc_ + id)]; }
  /// Value of a 4-bit code (±a[t]).
  float code_value(std::uint8_t c) const noexcept { return value_[c & 15]; }

  /// The key mean μ subtracted before encoding (empty: none yet / centering off).
  const std::vector<float>& center() const noexcept { return mu_; }
  /// Fixes μ (head_dim finite values) before the first append; needs config().center.
  void set_center(const float* mu) {
    const std::string who = "kvscore::ParisKV::set_center";
    if (!cfg_.center) pariskv::detail::fail(who + ": centering is off in this index's config");
    if (n_ > 0) pariskv::detail::fail(who + ": the index already holds " + std::to_string(n_) + " keys");
    if (mu == nullptr) pariskv::detail::fail(who + ": mu is null");
    check_row(mu, "center", 0, who);
    mu_.assign(mu, mu + d_);
  }

  // ---- building

  /// Appends n keys; key i is rows[i*row_stride .. +head_dim). Positions continue from size().
  /// Atomic: every key is validated first, a rejected batch changes nothing.
  template <class T>
  void append(const T* rows, std::int64_t n, std::int64_t row_stride) {
    static_assert(is_element_type_v<T>, "ParisKV::append: T must be float, half or bfloat16");
    const std::string who = "kvscore::ParisKV::append";
    if (n < 0) pariskv::detail::fail(who + ": n must be >= 0 (got " + std::to_string(n) + ")");
    if (n == 0) return;
    if (rows == nullptr) pariskv::detail::fail(who + ": rows is null but n = " + std::to_string(n));
    if (n > 1 && row_stride < d_)
      pariskv::detail::fail(who + ": row_stride " + std::to_string(row_stride) + " < head_dim " + std::to_string(d_) +
                            " makes rows overlap");
    for (std::int64_t i = 0; i < n; ++i) check_row(rows + i * row_stride, "key", n_ + i, who);
    if (cfg_.center && mu_.empty()) {
      std::vector<double> acc(static_cast<std::size_t>(d_), 0.0);
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t j = 0; j < d_; ++j) acc[std::size_t(j)] += double(to_float(rows[i * row_stride + j]));
      set_mean(acc, n);
    }
    reserve_more(n);
    std::vector<float> x(static_cast<std::size_t>(d_)), y(static_cast<std::size_t>(p_));
    for (std::int64_t i = 0; i < n; ++i) encode(rows + i * row_stride, x.data(), y.data());
  }

  /// Appends every token of head h of a view (a KeysView or a paged view).
  template <KeyCacheView View>
  void append(const View& keys, std::int64_t h) {
    if (keys.head_dim() != d_)
      pariskv::detail::fail("kvscore::ParisKV::append: keys have head_dim " + std::to_string(keys.head_dim()) +
                            ", the index " + std::to_string(d_));
    if (h < 0 || h >= keys.heads())
      pariskv::detail::fail("kvscore::ParisKV::append: head " + std::to_string(h) + " out of range [0, " +
                            std::to_string(keys.heads()) + ")");
    // validate every run first so the append stays atomic across runs
    const std::int64_t base = n_;
    keys.for_each_run(h, [&](const typename View::value_type* first, std::int64_t t0, std::int64_t n, std::int64_t stride) {
      for (std::int64_t i = 0; i < n; ++i) check_row(first + i * stride, "key", base + t0 + i, "kvscore::ParisKV::append");
    });
    if (cfg_.center && mu_.empty() && keys.tokens() > 0) {
      std::vector<double> acc(static_cast<std::size_t>(d_), 0.0);
      keys.for_each_run(h, [&](const typename View::value_type* first, std::int64_t, std::int64_t n, std::int64_t stride) {
        for (std::int64_t i = 0; i < n; ++i)
          for (std::int64_t j = 0; j < d_; ++j) acc[std::size_t(j)] += double(to_float(first[i * stride + j]));
      });
      set_mean(acc, keys.tokens());
    }
    reserve_more(keys.tokens());
    std::vector<float> x(static_cast<std::size_t>(d_)), y(static_cast<std::size_t>(p_));
    keys.for_each_run(h, [&](const typename View::value_type* first, std::int64_t, std::int64_t n, std::int64_t stride) {
      for (std::int64_t i = 0; i < n; ++i) encode(first + i * stride, x.data(), y.data());
    });
  }

  /// Removes the keys at positions >= n, n in [0, size()]: the index then holds exactly what
  /// appending its first n keys gave (ids, records, cluster populations), with the centre μ
  /// kept (frozen; any fixed μ ranks the same). What a generation that drops a question and
  /// its answer from the cache needs (transformers' Cache.crop, kvpress's question loop).
  void truncate(std::int64_t n) {
    if (n < 0 || n > n_)
      pariskv::detail::fail("kvscore::ParisKV::truncate: n " + std::to_string(n) + " out of range [0, " +
                            std::to_string(n_) + "]");
    for (std::int64_t i = n; i < n_; ++i)
      for (std::int64_t b = 0; b < B_; ++b) {
        const std::size_t at = std::size_t((i / 64) * B_ * 64 + b * 64 + i % 64);
        --pop_[std::size_t(b * nc_ + centroid_id(i, b))];
        if (m_ <= 8) ids8_[at] = 0;  // as a fresh index leaves the rest of its last block
        else ids16_[at] = 0;
      }
    const std::size_t blocks = std::size_t((n + 63) / 64);
    if (m_ <= 8) ids8_.resize(blocks * std::size_t(B_ * 64));
    else ids16_.resize(blocks * std::size_t(B_ * 64));
    rec_.resize(std::size_t(n * stride_));
    rec_.resize(std::size_t(n * stride_) + kRecPad, 0);  // the zero padding after the last record
    n_ = n;
  }

  // ---- search

  /// Throws std::invalid_argument for options search() would reject (k, ratios, rerank,
  /// kernel set); `has_rows`: the full-precision keys are given, with this row stride.
  void check_options(const ParisKVSearch& opt, bool has_rows, std::int64_t row_stride) const {
    const std::string who = "kvscore::ParisKV::search";
    if (opt.k < 0 || opt.k > n_)
      pariskv::detail::fail(who + ": k " + std::to_string(opt.k) + " out of range [0, " + std::to_string(n_) +
                            "] (the index holds " + std::to_string(n_) + " keys)");
    if (opt.beta != 0) check_ratio(opt.beta, "beta", who);
    if (opt.rho != 0) check_ratio(opt.rho, "rho", who);
    if (opt.rerank_exact != 0 && opt.rerank_exact < opt.k)
      pariskv::detail::fail(who + ": rerank_exact " + std::to_string(opt.rerank_exact) + " must be 0 (off) or >= k " +
                            std::to_string(opt.k));
    if (opt.rerank_exact > 0 && !has_rows && n_ > 0)
      pariskv::detail::fail(who + ": rerank_exact " + std::to_string(opt.rerank_exact) +
                            " needs the full-precision keys (rows is null)");
    if (opt.rerank_exact > 0 && n_ > 1 && row_stride < d_)
      pariskv::detail::fail(who + ": row_stride " + std::to_string(row_stride) + " < head_dim " + std::to_string(d_));
    pariskv::detail::resolve_kernels(opt.kernels, who);
  }

  /// The paper's pipeline (no exact rerank; opt.rerank_exact must be 0).
  void search(const float* q, const ParisKVSearch& opt, Workspace& ws, ParisKVResult& out) const {
    if (opt.rerank_exact != 0)
      pariskv::detail::fail("kvscore::ParisKV::search: rerank_exact " + std::to_string(opt.rerank_exact) +
                            " needs the full-precision keys (use the overload that takes them)");
    search_impl<float>(q, opt, nullptr, 0, ws, out);
  }
  /// With the full-precision keys resident (rows[t*row_stride .. +head_dim) is key t, t < size()),
  /// so opt.rerank_exact may be set.
  template <class T>
  void search(const float* q, const ParisKVSearch& opt, const T* rows, std::int64_t row_stride, Workspace& ws,
              ParisKVResult& out) const {
    if (rows == nullptr && n_ > 0 && opt.rerank_exact > 0) pariskv::detail::fail("kvscore::ParisKV::search: rows is null");
    search_impl<T>(q, opt, rows, row_stride, ws, out);
  }
  /// Allocating convenience form of the paper's pipeline.
  ParisKVResult search(const float* q, const ParisKVSearch& opt = {}) const {
    Workspace ws;
    ParisKVResult r;
    search(q, opt, ws, r);
    return r;
  }

  /// GQA: `queries` [group][head_dim]; mean (one search with the mean query, accumulated in
  /// fp64) or union (one search per query; union of positions, ascending; score = the largest
  /// of the searches that found the position).
  template <class T = float>
  void search_group(const float* queries, std::int64_t group, ParisKVGroup mode, const ParisKVSearch& opt, Workspace& ws,
                    ParisKVResult& out, const T* rows = nullptr, std::int64_t row_stride = 0) const {
    if (group < 1) pariskv::detail::fail("kvscore::ParisKV::search_group: group must be >= 1 (got " + std::to_string(group) + ")");
    if (queries == nullptr) pariskv::detail::fail("kvscore::ParisKV::search_group: queries is null");
    if (mode == ParisKVGroup::mean || group == 1) {
      std::vector<double> acc(std::size_t(d_), 0.0);
      for (std::int64_t g = 0; g < group; ++g) {
        check_row(queries + g * d_, "query", g, "kvscore::ParisKV::search_group");
        for (std::int64_t j = 0; j < d_; ++j) acc[std::size_t(j)] += double(queries[g * d_ + j]);
      }
      std::vector<float> q(static_cast<std::size_t>(d_));
      for (std::int64_t j = 0; j < d_; ++j) q[std::size_t(j)] = float(acc[std::size_t(j)] / double(group));
      search_impl<T>(q.data(), opt, rows, row_stride, ws, out);
      return;
    }
    std::vector<std::pair<std::int64_t, float>> all;
    ParisKVResult one;
    std::int64_t cand = 0;
    for (std::int64_t g = 0; g < group; ++g) {
      search_impl<T>(queries + g * d_, opt, rows, row_stride, ws, one);
      cand = std::max(cand, one.candidates);
      for (std::size_t i = 0; i < one.positions.size(); ++i) all.emplace_back(one.positions[i], one.scores[i]);
    }
    std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
      return a.first < b.first || (a.first == b.first && a.second > b.second);
    });
    out.positions.clear();
    out.scores.clear();
    for (const auto& [pos, s] : all)
      if (out.positions.empty() || out.positions.back() != pos) {
        out.positions.push_back(pos);
        out.scores.push_back(s);
      }
    out.candidates = cand;
  }

  /// RSQ-IP estimates of ⟨k_t, q⟩ for every key (out[size()]): the index as a query-aware
  /// scorer, e.g. for kvscore::select.
  void estimate(const float* q, float* out, pariskv::Kernels kernels = pariskv::Kernels::best) const {
    Workspace ws;
    const float qn = prepare_query(q, ws, "kvscore::ParisKV::estimate");
    if (n_ == 0) return;
    if (out == nullptr) pariskv::detail::fail("kvscore::ParisKV::estimate: out is null");
    if (qn == 0.f) {
      std::fill(out, out + n_, 0.f);
      return;
    }
    pariskv::detail::rsq_ip(pariskv::detail::resolve_kernels(kernels, "kvscore::ParisKV::estimate"), plan(ws, qn), nullptr,
                            n_, out);
    if (!mu_.empty()) {
      const float c = float(center_dot(q));
      for (std::int64_t i = 0; i < n_; ++i) out[i] += c;
    }
  }

  /// Stage I collision scores S_i of every key for a query and collision ratio ρ (tests, tools).
  std::vector<std::int32_t> collision_scores(const float* q, double rho,
                                             pariskv::Kernels kernels = pariskv::Kernels::best) const {
    Workspace ws;
    const float qn = prepare_query(q, ws, "kvscore::ParisKV::collision_scores");
    check_ratio(rho, "rho", "kvscore::ParisKV::collision_scores");
    std::vector<std::int32_t> s(std::size_t(n_), 0);
    if (n_ == 0 || qn == 0.f) return s;
    const auto set = pariskv::detail::resolve_kernels(kernels, "kvscore::ParisKV::collision_scores");
    if (collide(ws, pariskv::ratio_count(rho, n_), set))
      for (std::int64_t i = 0; i < n_; ++i) s[std::size_t(i)] = ws.s8[std::size_t(i)];
    else
      for (std::int64_t i = 0; i < n_; ++i) s[std::size_t(i)] = ws.s16[std::size_t(i)];
    return s;
  }

 private:
  // bytes after the last record: the vector kernels read 16 weights per lane group (B < 16)
  static constexpr std::size_t kRecPad = 64;

  std::int64_t id_bytes() const noexcept { return m_ <= 8 ? 1 : 2; }

  template <class T>
  void check_row(const T* r, const char* what, std::int64_t index, const std::string& who) const {
    float sq = 0.f;
    for (std::int64_t j = 0; j < d_; ++j) {
      const float v = to_float(r[j]);
      if (!std::isfinite(v))
        pariskv::detail::fail(who + ": " + what + " " + std::to_string(index) + " has a non-finite value " +
                              std::to_string(v) + " at element " + std::to_string(j));
      sq += v * v;
    }
    if (!std::isfinite(sq))
      pariskv::detail::fail(who + ": " + what + " " + std::to_string(index) +
                            " has a squared norm that overflows fp32 (magnitude above ~1.8e19)");
  }

  void set_mean(const std::vector<double>& acc, std::int64_t n) {
    mu_.resize(std::size_t(d_));
    for (std::int64_t j = 0; j < d_; ++j) mu_[std::size_t(j)] = float(acc[std::size_t(j)] / double(n));
  }

  /// ⟨μ, q⟩ in fp64 (0 without centering): added to estimates of ⟨k − μ, q⟩.
  double center_dot(const float* q) const noexcept {
    double c = 0;
    for (std::size_t j = 0; j < mu_.size(); ++j) c += double(mu_[j]) * double(q[j]);
    return c;
  }

  void reserve_more(std::int64_t n) {
    const std::int64_t total = n_ + n;
    const std::int64_t blocks = (total + 63) / 64;
    if (m_ <= 8) ids8_.resize(std::size_t(blocks * B_ * 64), 0);
    else ids16_.resize(std::size_t(blocks * B_ * 64), 0);
    rec_.reserve(std::size_t(total * stride_) + kRecPad);
  }

  template <class T>
  void encode(const T* r, float* x, float* y) {
    double sq = 0;
    for (std::int64_t j = 0; j < d_; ++j) {
      const double v = double(to_float(r[j])) - (mu_.empty() ? 0.0 : double(mu_[std::size_t(j)]));
      sq += v * v;
    }
    const double norm = std::sqrt(sq);
    for (std::int64_t j = 0; j < d_; ++j) {
      const double v = double(to_float(r[j])) - (mu_.empty() ? 0.0 : double(mu_[std::size_t(j)]));
      x[j] = norm > 0 ? float(v / norm) : 0.f;
    }
    rot_.apply(x, y);
    const std::int64_t i = n_;
    const std::size_t id_base = std::size_t((i / 64) * B_ * 64 + i % 64);
    rec_.resize(rec_.size() + std::size_t(stride_), 0);  // the padding moves to the end
    std::uint8_t* code = rec_.data() + i * stride_;
    for (std::int64_t b = 0; b < B_; ++b) {
      const float* u = y + b * m_;
      double r2 = 0;
      for (std::int64_t j = 0; j < m_; ++j) r2 += double(u[j]) * double(u[j]);
      const double rb = std::sqrt(r2);
      std::uint32_t id = 0;
      double alpha = 0;
      for (std::int64_t j = 0; j < m_; ++j) {
        const float v = u[j];
        if (v >= 0.f) id |= std::uint32_t(1) << j;
        const float au = rb > 0 ? float(std::fabs(double(v)) / rb) : 0.f;
        int t = 0;
        while (t < 7 && au >= tau_[std::size_t(t)]) ++t;
        alpha += double(value_[std::size_t(t)]) * double(au);
        const std::uint8_t c = std::uint8_t(t | (v < 0.f ? 8 : 0));
        const std::int64_t jj = b * m_ + j;
        code[code_byte(jj)] |= (jj % len_) % 2 == 0 ? c : std::uint8_t(c << 4);
      }
      if (m_ <= 8) ids8_[id_base + std::size_t(b * 64)] = std::uint8_t(id);
      else ids16_[id_base + std::size_t(b * 64)] = std::uint16_t(id);
      ++pop_[std::size_t(b * nc_ + id)];
      const float w = rb > 0 ? float(norm * rb / alpha) : 0.f;
      std::memcpy(code + cb_ + 4 * b, &w, sizeof(float));
    }
    ++n_;
  }

  static void check_ratio(double x, const char* name, const std::string& who) {
    if (!(x > 0 && x <= 1))
      pariskv::detail::fail(who + ": " + name + " must be in (0, 1] (got " + std::to_string(x) + ")");
  }

  /// Byte of rotated coordinate j in a record (its nibble: low for even j % len).
  std::int64_t code_byte(std::int64_t j) const noexcept {
    const std::int64_t seg = j / len_;
    return (seg / 16) * ((len_ + 1) / 2) * 16 + ((j % len_) / 2) * 16 + seg % 16;
  }

  /// Validates q, writes the rotated unit query (pc floats, zero tail) into ws.qrot; returns ‖q‖.
  float prepare_query(const float* q, Workspace& ws, const std::string& who) const {
    if (q == nullptr) pariskv::detail::fail(who + ": query is null");
    check_row(q, "query", 0, who);
    double sq = 0;
    for (std::int64_t j = 0; j < d_; ++j) sq += double(q[j]) * double(q[j]);
    const double qn = std::sqrt(sq);
    ws.x.resize(std::size_t(d_));
    ws.qrot.assign(std::size_t(pc_), 0.f);
    ws.qt.assign(std::size_t(groups_ * len_ * 16), 0.f);
    if (qn == 0) return 0.f;
    for (std::int64_t j = 0; j < d_; ++j) ws.x[std::size_t(j)] = float(double(q[j]) / qn);
    rot_.apply(ws.x.data(), ws.qrot.data());
    // Stage II's transposed copy: qt[g][t][l] = coordinate t of segment 16g + l
    for (std::int64_t j = 0; j < p_; ++j) {
      const std::int64_t seg = j / len_;
      ws.qt[std::size_t(((seg / 16) * len_ + j % len_) * 16 + seg % 16)] = ws.qrot[std::size_t(j)];
    }
    return float(qn);
  }

  pariskv::detail::RerankPlan plan(const Workspace& ws, float qn) const noexcept {
    return {rec_.data(), stride_, groups_, len_, cb_, ws.qt.data(), value_.data(), wlane_.data(), qn};
  }

  /// m <= 8: the weights of subspace b's patterns but the best one (already emitted, `before`
  /// keys covered) into tb, as the emission in (cost, id) order gives them. The costs of all
  /// 2^m flip sets by rank mask M (bit r: the r-th cheapest coordinate) come from M without its
  /// highest bit plus that bit's cost: the same fp32 sums in sorted order that the best-first
  /// enumeration forms. The sets are bucketed by a monotone function of the cost. A pattern's
  /// weight is the number of tier limits above the keys of the patterns before it, so every
  /// pattern of a bucket that no limit falls inside gets the same weight without ordering the
  /// bucket; only the buckets a limit falls inside (at most the 6 tiers) are sorted on (cost,
  /// id). Patterns that hold no key may get any weight (no key reads it).
  void weight_table_small(Workspace& ws, std::int64_t b, const float* cost, const std::int64_t* ord,
                          std::uint32_t best, const std::int64_t* limit, std::int64_t before) const {
    constexpr int kBuckets = 128;
    constexpr int T = pariskv::kTiers;
    const std::int64_t n = std::int64_t(1) << m_;
    const std::int64_t* pop = pop_.data() + b * nc_;
    std::uint8_t* tb = ws.tbl.data() + b * nc_;
    float cm[256];
    std::uint32_t id[256];
    cm[0] = 0.f;
    id[0] = best;
    for (std::int64_t h = 0; h < m_; ++h) {
      const float c = cost[ord[h]];
      const std::uint32_t bit = std::uint32_t(1) << ord[h];
      for (std::int64_t M = 0; M < (std::int64_t(1) << h); ++M) {
        cm[M | (std::int64_t(1) << h)] = cm[M] + c;
        id[M | (std::int64_t(1) << h)] = id[M] ^ bit;
      }
    }
    const float top = cm[n - 1];  // the largest cost (adding a cost >= 0 never lowers a rounded sum)
    const float inv = top > 1e-30f ? float(kBuckets) / top : 0.f;
    std::int64_t bpop[kBuckets] = {};
    std::uint8_t bk[256];
    for (std::int64_t M = 1; M < n; ++M) {
      const float x = cm[M] * inv;  // monotone in the cost
      const int k = x >= float(kBuckets - 1) ? kBuckets - 1 : int(x);
      bk[M] = std::uint8_t(k);
      bpop[k] += pop[id[M]];
    }
    // per bucket: the weight its patterns share, or kSplit when a tier limit falls inside it
    constexpr std::uint8_t kSplit = 0xff;
    std::uint8_t wk[kBuckets];
    std::int64_t start[kBuckets];
    bool any_split = false;
    int below = 0;  // limits at or below `before` (the limits ascend)
    for (int k = 0; k < kBuckets; ++k) {
      while (below < T && limit[below] <= before) ++below;
      start[k] = before;
      const bool inside = below < T && limit[below] < before + bpop[k];
      wk[k] = inside ? kSplit : std::uint8_t(T - below);  // 0 once every limit is reached
      any_split |= inside;
      before += bpop[k];
    }
    for (std::int64_t M = 1; M < n; ++M)
      if (wk[bk[M]] != kSplit) tb[id[M]] = wk[bk[M]];
    if (!any_split) return;
    // the buckets a limit falls inside, in (cost, id) order: exact emission from their start
    ws.keys.clear();
    for (std::int64_t M = 1; M < n; ++M)
      if (wk[bk[M]] == kSplit) {
        std::uint32_t bits;
        std::memcpy(&bits, &cm[M], sizeof(float));  // >= +0: the bits order as the values
        ws.keys.push_back((std::uint64_t(bits) << 32) | id[M]);
      }
    std::sort(ws.keys.begin(), ws.keys.end());
    int cur = -1;
    for (std::uint64_t key : ws.keys) {
      const std::uint32_t p = std::uint32_t(key & 0xffffffffu);
      float c;
      const std::uint32_t bits = std::uint32_t(key >> 32);
      std::memcpy(&c, &bits, sizeof(float));
      const float x = c * inv;
      const int k = x >= float(kBuckets - 1) ? kBuckets - 1 : int(x);
      if (k != cur) {
        cur = k;
        before = start[k];
      }
      int w = 0;
      for (int t = 0; t < T; ++t) w += before < limit[t];
      tb[p] = std::uint8_t(w);
      before += pop[p];
    }
  }

  /// Stage I's weight table ws.tbl [B][2^m]: each subspace's patterns best-first by inner product
  /// with the query, tier weights until ⌈ρN⌉ = `collided` keys are covered.
  void weight_table(Workspace& ws, std::int64_t collided) const {
    // tier limits: tier t holds the clusters whose better-ranked clusters hold < ⌈collided·r_t⌉ keys
    std::int64_t limit[pariskv::kTiers];
    for (int t = 0; t < pariskv::kTiers; ++t) limit[t] = (collided * pariskv::kTierPercent[t] + 99) / 100;
    ws.tbl.assign(std::size_t(B_ * nc_), 0);
    if (m_ <= 8)  // the populations the emission reads (2 KB per subspace): requested at once, not miss by miss
      for (std::int64_t o = 0; o < B_ * nc_; o += 8) pariskv::detail::prefetch_line(reinterpret_cast<const char*>(pop_.data() + o));
    for (std::int64_t b = 0; b < B_; ++b) {
      const float* qb = ws.qrot.data() + b * m_;
      // ⟨q̃_b, s⟩ = Σ|q̃_j| − Σ_{j∈F} 2|q̃_j| for the pattern that flips the set F of the best
      // pattern sign(q̃_b) (q̃_j = 0 counts as +, like the keys). So the patterns in descending
      // score are the flip sets in ascending cost, a set's cost being its costs summed in sorted
      // order (a fixed fp32 value per set); equal costs go by the lower pattern id, after the
      // best pattern (the empty set). Emitted in that order until ⌈ρN⌉ keys are covered.
      std::int64_t ord[16];
      float cost[16];
      std::uint32_t best = 0;
      for (std::int64_t j = 0; j < m_; ++j) {
        cost[j] = 2.f * std::fabs(qb[j]);
        if (qb[j] >= 0.f) best |= std::uint32_t(1) << j;
        ord[j] = j;
      }
      std::sort(ord, ord + m_, [&](std::int64_t x, std::int64_t y) { return cost[x] < cost[y] || (cost[x] == cost[y] && x < y); });
      std::int64_t before = 0;
      std::uint8_t* tb = ws.tbl.data() + b * nc_;
      auto emit = [&](std::uint32_t id) {
        int wgt = 0;
        for (int t = 0; t < pariskv::kTiers; ++t) wgt += before < limit[t];
        tb[id] = std::uint8_t(wgt);
        before += pop_[std::size_t(b * nc_ + id)];
      };
      emit(best);
      if (m_ <= 8) {
        weight_table_small(ws, b, cost, ord, best, limit, before);
        continue;
      }
      // m > 8 (up to 2^16 patterns): best-first enumeration of the flip sets with a small heap
      // (successors of a set whose largest sorted index is i: add i+1, or replace i by i+1),
      // only until the keys are covered.
      auto& heap = ws.heap;
      heap.clear();
      if (before < limit[pariskv::kTiers - 1])
        heap.push_back({0.f + cost[ord[0]], 0.f, best ^ (std::uint32_t(1) << ord[0]), 0});
      // Patterns leave the heap in groups of equal cost. A group also takes equal-cost
      // successors (a replaced coordinate of the same cost, or a cost absorbed by fp32
      // rounding), which the heap has not seen yet, so a group is every pattern of that cost;
      // it is emitted by id, which makes the order exactly (cost, id) after the best pattern.
      auto& group = ws.group;
      auto expand = [&](const pariskv::detail::PatternNode& nd, float c0) {
        if (std::int64_t(nd.last) + 1 >= m_) return;
        // cost = prefix (the set without its last element) + the last cost: the same fp32
        // value as summing the set from scratch in sorted order
        const std::uint32_t l = nd.last + 1;
        const float c = cost[ord[l]];
        const std::uint32_t bit = std::uint32_t(1) << ord[l];
        const pariskv::detail::PatternNode kids[2] = {
            {nd.cost + c, nd.cost, nd.id ^ bit, l},
            {nd.prefix + c, nd.prefix, nd.id ^ bit ^ (std::uint32_t(1) << ord[nd.last]), l}};
        for (const auto& k : kids) {
          if (k.cost == c0) {
            group.push_back(k);
          } else {
            heap.push_back(k);
            std::push_heap(heap.begin(), heap.end(), std::greater<>());
          }
        }
      };
      while (!heap.empty() && before < limit[pariskv::kTiers - 1]) {
        const float c0 = heap.front().cost;
        group.clear();
        for (std::size_t gi = 0;;) {
          if (gi < group.size()) {
            expand(group[gi++], c0);
          } else if (!heap.empty() && heap.front().cost == c0) {
            std::pop_heap(heap.begin(), heap.end(), std::greater<>());
            group.push_back(heap.back());
            heap.pop_back();
          } else {
            break;
          }
        }
        std::sort(group.begin(), group.end(), [](const auto& x, const auto& y) { return x.id < y.id; });
        for (const auto& g : group) {
          if (before >= limit[pariskv::kTiers - 1]) break;
          emit(g.id);
        }
      }
    }
  }

  /// Stage I into ws.s8 (returns true) or ws.s16 (false), for `collided` = ⌈ρN⌉ keys per
  /// subspace: the weight table (weight_table), then the collision sums on `set`'s kernel
  /// (pariskv/kernels.hpp).
  bool collide(Workspace& ws, std::int64_t collided, pariskv::detail::KernelSet set) const {
    weight_table(ws, collided);
    return pariskv::detail::collide_scores(set, ids8_.data(), ids16_.data(), n_, B_, m_, nc_, ws.tbl.data(), ws.s8,
                                           ws.s16, ws.lists);
  }

  /// Top `take` of vals[0..n) (ties: lower index), ascending indices into ws.top.
  void top_of(const float* vals, std::int64_t n, std::int64_t take, Workspace& ws) const {
    SelectOptions so;
    so.num_threads = 1;
    const Budget bud = Budget::per_head(take);
    const std::size_t bytes = select_workspace_bytes(1, n, bud, so);
    if (ws.select_ws.size() < bytes) ws.select_ws.resize(bytes);
    ws.offsets.resize(2);
    ws.top.resize(std::size_t(take));
    select_into(ConstScoresView(vals, 1, n), bud, so, ws.select_ws.data(), ws.select_ws.size(),
                ws.offsets.data(), ws.top.data(), ws.top.size());
  }

  template <class T>
  void search_impl(const float* q, const ParisKVSearch& opt, const T* rows, std::int64_t row_stride, Workspace& ws,
                   ParisKVResult& out) const {
    const std::string who = "kvscore::ParisKV::search";
    check_options(opt, rows != nullptr, row_stride);
    const auto set = pariskv::detail::resolve_kernels(opt.kernels, who);
    const float qn = prepare_query(q, ws, who);
    out.positions.clear();
    out.scores.clear();
    out.candidates = 0;
    const std::int64_t k = opt.k;
    if (k == 0) return;
    if (qn == 0.f) {  // every inner product is 0: the first k positions by the tie rule
      for (std::int64_t t = 0; t < k; ++t) out.positions.push_back(t);
      out.scores.assign(std::size_t(k), 0.f);
      out.candidates = k;
      return;
    }
    const double rho = opt.rho != 0 ? opt.rho : pariskv::default_ratios(n_).rho;
    const std::int64_t kk = std::min(n_, std::max(k, opt.rerank_exact));
    const std::int64_t C = pariskv::candidate_count(opt.beta, n_, kk);

    // Stage I: collision scores and the C best keys (ties: lower position)
    ws.cand.resize(std::size_t(C));
    if (collide(ws, pariskv::ratio_count(rho, n_), set)) {
      pariskv::detail::bucket_top_u8(set, ws.s8.data(), n_, C, 6 * B_, ws.hist, ws.cand.data());
    } else {
      std::int64_t thr = 0, need_eq = 0;
      pariskv::detail::bucket_threshold_portable(ws.s16.data(), n_, C, 6 * B_, ws.hist, &thr, &need_eq);
      pariskv::detail::bucket_collect_portable(ws.s16.data(), n_, thr, need_eq, ws.cand.data());
    }
    out.candidates = C;

    // Stage II: RSQ-IP on the candidates, top kk
    ws.est.resize(std::size_t(C));
    pariskv::detail::rsq_ip(set, plan(ws, qn), ws.cand.data(), C, ws.est.data());
    top_of(ws.est.data(), C, kk, ws);
    if (opt.rerank_exact == 0) {
      // ranked on the estimates of ⟨k − μ, q⟩; the reported scores add the constant ⟨μ, q⟩
      const double c = center_dot(q);
      out.positions.resize(std::size_t(k));
      out.scores.resize(std::size_t(k));
      for (std::int64_t i = 0; i < k; ++i) {
        out.positions[std::size_t(i)] = ws.cand[std::size_t(ws.top[std::size_t(i)])];
        out.scores[std::size_t(i)] = float(double(ws.est[std::size_t(ws.top[std::size_t(i)])]) + c);
      }
      return;
    }
    // Exact rerank of the kk best estimates with the library's dot kernel (fp32 accumulation).
    const simd::RowOps<T>& ops = simd::active_table().template ops<T>();
    ws.sel.resize(std::size_t(kk));
    ws.exact.resize(std::size_t(kk));
    // the kk rows are scattered over the cache: request them all first so the misses overlap
    for (std::int64_t i = 0; i < kk; ++i) {
      const char* row = reinterpret_cast<const char*>(rows + ws.cand[std::size_t(ws.top[std::size_t(i)])] * row_stride);
      for (std::int64_t b = 0; b < d_ * std::int64_t(sizeof(T)); b += 64) __builtin_prefetch(row + b, 0, 3);
    }
    for (std::int64_t i = 0; i < kk; ++i) {
      const std::int64_t pos = ws.cand[std::size_t(ws.top[std::size_t(i)])];
      ws.sel[std::size_t(i)] = pos;
      ops.dot(rows + pos * row_stride, 1, row_stride, d_, q, &ws.exact[std::size_t(i)]);
    }
    top_of(ws.exact.data(), kk, k, ws);
    out.positions.resize(std::size_t(k));
    out.scores.resize(std::size_t(k));
    for (std::int64_t i = 0; i < k; ++i) {
      out.positions[std::size_t(i)] = ws.sel[std::size_t(ws.top[std::size_t(i)])];
      out.scores[std::size_t(i)] = ws.exact[std::size_t(ws.top[std::size_t(i)])];
    }
  }

  ParisKVConfig cfg_;
  pariskv::Rotation rot_;
  pariskv::Codebook codebook_;
  std::int64_t d_ = 0, p_ = 0, m_ = 0, B_ = 0, nc_ = 0, pc_ = 0, n_ = 0;
  std::int64_t len_ = 0, groups_ = 0, cb_ = 0, stride_ = 0;  ///< Stage II record layout
  std::array<std::int32_t, 16> wlane_{};                    ///< lane -> weight within its group
  std::array<float, 7> tau_{};
  std::array<float, 16> value_{};  ///< code -> ±a[t] (bit 3 = negative)
  std::vector<std::uint8_t> ids8_;     ///< [block][B][64] for m <= 8
  std::vector<std::uint16_t> ids16_;   ///< [block][B][64] for m > 8
  /// [N][stride] records (codes, weights) + kRecPad, 64-byte aligned
  std::vector<std::uint8_t, xsimd::aligned_allocator<std::uint8_t, 64>> rec_;
  std::vector<std::int64_t> pop_;      ///< [B][2^m] keys per cluster
  std::vector<float> mu_;              ///< key mean subtracted before encoding (empty: none)
};

/// Retrieval for a whole layer: one index per KV head of `keys` (built in parallel over heads),
/// queries [q_heads][n_queries][head_dim] fp32 (q_heads = H_kv·G for GQA). Query heads are
/// searched in sets of `group` consecutive heads of the same KV head (1 ≤ group, dividing
/// q_heads/H_kv): the set's mean query is searched once and every head of the set gets the
/// result (group = 1: every query head on its own). Returns positions [q_heads][n_queries][k],
/// ascending per row. Identical for every num_threads (0 = OpenMP default).
template <class T>
std::vector<std::int64_t> pariskv_retrieve(const KeysView<T>& keys, const float* queries, std::int64_t q_heads,
                                           std::int64_t n_queries, std::int64_t group, const ParisKVSearch& opt,
                                           const ParisKVConfig& cfg = {}, int num_threads = 0) {
  const std::string who = "kvscore::pariskv_retrieve";
  const std::int64_t H = keys.heads();
  if (H < 1) pariskv::detail::fail(who + ": keys have no heads");
  if (q_heads < 1 || q_heads % H != 0)
    pariskv::detail::fail(who + ": query heads " + std::to_string(q_heads) + " must be a positive multiple of the " +
                          std::to_string(H) + " KV heads");
  const std::int64_t G = q_heads / H;
  if (group < 1 || G % group != 0)
    pariskv::detail::fail(who + ": group " + std::to_string(group) + " must divide the GQA group size " + std::to_string(G) +
                          " (query heads " + std::to_string(q_heads) + " / KV heads " + std::to_string(H) + ")");
  if (n_queries < 0) pariskv::detail::fail(who + ": n_queries must be >= 0 (got " + std::to_string(n_queries) + ")");
  if (queries == nullptr && n_queries > 0) pariskv::detail::fail(who + ": queries is null");
  const std::int64_t d = keys.head_dim(), k = opt.k;
  std::vector<ParisKV> index;
  index.reserve(std::size_t(H));
  for (std::int64_t h = 0; h < H; ++h) index.emplace_back(d, cfg);
  // validate everything serially, so the error names the input (detail::parallel_for would
  // carry an exception out of the region too, but with the index's message)
  for (std::int64_t h = 0; h < H; ++h) index[std::size_t(h)].append(keys, h);
  for (std::int64_t i = 0; i < q_heads * n_queries; ++i) {
    const std::string at = "query head " + std::to_string(i / n_queries) + ", query " + std::to_string(i % n_queries);
    float sq = 0.f;  // the same fp32 sum as the index's own row check
    for (std::int64_t j = 0; j < d; ++j) {
      const float v = queries[i * d + j];
      if (!std::isfinite(v))
        pariskv::detail::fail(who + ": query value " + std::to_string(v) + " at " + at + " is not finite");
      sq += v * v;
    }
    if (!std::isfinite(sq))
      pariskv::detail::fail(who + ": " + at + " has a squared norm that overflows fp32 (magnitude above ~1.8e19)");
  }
  index[0].check_options(opt, true, keys.token_stride());
  std::vector<std::int64_t> out(std::size_t(q_heads * n_queries * k));
  const std::int64_t sets = q_heads / group;
  auto run = [&](std::int64_t s, ParisKV::Workspace& ws, ParisKVResult& r, std::vector<float>& qg) {
    const std::int64_t h0 = s * group, kvh = h0 / G;
    for (std::int64_t qi = 0; qi < n_queries; ++qi) {
      for (std::int64_t g = 0; g < group; ++g)
        std::copy(queries + ((h0 + g) * n_queries + qi) * d, queries + ((h0 + g) * n_queries + qi + 1) * d,
                  qg.begin() + g * d);
      index[std::size_t(kvh)].search_group<T>(qg.data(), group, ParisKVGroup::mean, opt, ws, r, keys.head(kvh),
                                              keys.token_stride());
      for (std::int64_t g = 0; g < group; ++g)
        std::copy(r.positions.begin(), r.positions.end(), out.begin() + ((h0 + g) * n_queries + qi) * k);
    }
  };
  struct Scratch {
    ParisKV::Workspace ws;
    ParisKVResult r;
    std::vector<float> qg;
  };
  kvscore::detail::parallel_for_state<Scratch>(sets, num_threads, [&](Scratch& t, std::int64_t s) {
    t.qg.resize(std::size_t(group * d));
    run(s, t.ws, t.r, t.qg);
  });
  return out;
}

}  // namespace kvscore
