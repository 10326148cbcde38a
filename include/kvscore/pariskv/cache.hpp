// kvscore/pariskv/cache.hpp — ParisKV's decode-time cache for one KV head (pariskv.txt §4.2.1,
// "Buffer update"): the keys and values in full precision, split into three zones,
//
//   sinks [0, S)  |  retrieval [S, E): indexed by a kvscore::ParisKV  |  local [E, N)
//
// [snippet pariskv-cache-header: tests/test_snippets.cpp]
//   kvscore::ParisKVCache<kvscore::half> cache(head_dim);   // S = 4, L = 256, U = 128, k = 100
//   cache.append(prompt_k, prompt_v, prompt_len);           // prefill
//   cache.append(k, v); cache.attend(q, out.data(), cws);   // one decode step
//
// The local zone holds the last L..L+U−1 tokens: when an append makes it reach L + U tokens,
// its oldest tokens down to L are encoded into the index (the paper's update buffer of U
// tokens, flushed every U decode steps; a prefill flushes everything but the last L at once).
// select(q) returns, ascending, the sinks, the top k of the retrieval zone by the index's
// search (ParisKVSearch: β, ρ, exact rerank on the resident keys), and the local zone; while
// the cache is short (N < max(dense_min, S + L + 2k), the authors' fallback, unless
// dense_fallback is off) it returns every position. attend(q) is softmax(q·k/√d)·v over the
// selected positions in fp32 (pariskv/attention.hpp: the same bits on every kernel set).
//
// Defaults (docs/methods/pariskv.md, "Decode-time cache"): S = 4, L = 256, U = 128, k = 100, dense below
// 2000 tokens; the authors' code uses sink 4, local 64…512, updates every 128 or 512 tokens,
// top-k 100 (2048 for Qwen3-8B). Inputs are post-RoPE keys and queries, as an engine holds them.
// ParisKVRetrieval::exact keeps the zones but retrieves the exact top k of the retrieval zone
// (every q·k, no index): the ceiling the index approximates. crop(n) drops the tokens from n on
// (a question and its answer), the index with them.
// Errors: std::invalid_argument naming the value (bad configuration, a key or value with a
// NaN/Inf element, a key whose squared norm overflows fp32); a rejected append leaves the cache
// unchanged.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/core/dtype.hpp"
#include "kvscore/methods.hpp"
#include "kvscore/pariskv/attention.hpp"
#include "kvscore/pariskv/pariskv.hpp"

namespace kvscore {

/// How the retrieval zone is searched.
enum class ParisKVRetrieval {
  index,  ///< ParisKV's index (collision votes + RSQ-IP, ParisKVSearch's options)
  exact,  ///< the exact top k by q·k over every key of the zone (the SIMD dot kernel; no index)
};

/// Options of ParisKVCache: the zones, the index and its search, the dense fallback.
struct ParisKVCacheConfig {
  std::int64_t sinks = kDefaultSinks;         ///< S: first tokens always attended
  std::int64_t local = kDefaultParisKVLocal;  ///< L: last tokens always attended
  std::int64_t update_interval = 128;  ///< U: local tokens beyond L are indexed in batches of U
  std::int64_t dense_min = 2000;       ///< dense attention while N < max(dense_min, S + L + 2k)
  /// false: never dense, so a query attends at most S + k + the local zone (a fixed budget;
  /// make_retriever with RetrieverArgs::budget, the evaluator)
  bool dense_fallback = true;
  ParisKVConfig index{};               ///< the retrieval index (m, seed, centring)
  ParisKVSearch search{};              ///< k = 100 retrieved tokens per query, β, ρ, exact rerank
  ParisKVRetrieval retrieval = ParisKVRetrieval::index;  ///< exact: search.k by exact q·k, no index
  double scale = 0;                    ///< attend()'s softmax scale on q·k; 0 = 1/√head_dim
};

/// ParisKV's decode-time cache of one KV head (see the top of this file): sinks, a retrieval zone (the index, or
/// exact top k) and a local window; append() keys and values, select(q) the positions a query attends, attend(q)
/// its attention output.
template <class T>
class ParisKVCache {
  static_assert(is_element_type_v<T>, "ParisKVCache: T must be float, half or bfloat16");

 public:
  using value_type = T;  ///< element type of the stored keys and values
  /// Scratch of select() and attend(); one per thread, reused (no allocation once warm).
  struct Workspace {
    /// \cond INTERNAL
    ParisKV::Workspace search;
    ParisKVResult result;
    std::vector<std::int64_t> positions;
    std::vector<double> logits;
    std::vector<float> dots;               ///< exact retrieval: q·k over the zone
    std::vector<unsigned char> select_ws;  ///< exact retrieval: the selector's workspace
    pariskv::detail::AttendScratch attend;  ///< attend()'s logits and accumulators
    std::vector<const float*> qptr;         ///< ParisKVLayerCache: a KV head's queries (dense)
    std::vector<float*> optr;               ///< ... and their outputs
  /// \endcond
  };

  /// An empty cache for rows of `head_dim` elements; std::invalid_argument for a bad head_dim or option.
  explicit ParisKVCache(std::int64_t head_dim, const ParisKVCacheConfig& cfg = {})
      : cfg_(cfg), d_(head_dim) {
    const std::string who = "kvscore::ParisKVCache";
    if (head_dim < 1 || head_dim > kMaxHeadDim)
      throw std::invalid_argument(who + ": head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " +
                                  std::to_string(head_dim) + ")");
    auto need = [&](bool ok, const char* name, std::int64_t v, const char* rule) {
      if (!ok) throw std::invalid_argument(who + ": " + name + " must be " + rule + " (got " + std::to_string(v) + ")");
    };
    need(cfg.sinks >= 0, "sinks", cfg.sinks, ">= 0");
    need(cfg.local >= 0, "local", cfg.local, ">= 0");
    need(cfg.update_interval >= 1, "update_interval", cfg.update_interval, ">= 1");
    need(cfg.dense_min >= 0, "dense_min", cfg.dense_min, ">= 0");
    need(cfg.search.k >= 0, "search.k", cfg.search.k, ">= 0");
    if (!(cfg.scale >= 0) || !std::isfinite(cfg.scale))
      throw std::invalid_argument(who + ": scale must be finite and >= 0, 0 = 1/sqrt(head_dim) (got " +
                                  std::to_string(cfg.scale) + ")");
    if (cfg.retrieval != ParisKVRetrieval::index && cfg.retrieval != ParisKVRetrieval::exact)
      throw std::invalid_argument(who + ": retrieval must be index or exact (got " + std::to_string(int(cfg.retrieval)) + ")");
    if (cfg.retrieval == ParisKVRetrieval::index) {
      index_.emplace(head_dim, cfg.index);
      ParisKVSearch probe = cfg.search;  // the index checks β, ρ and k' once, on an empty index
      probe.k = 0;
      index_->check_options(probe, true, head_dim);
    }
    if (cfg.search.rerank_exact != 0 && cfg.search.rerank_exact < cfg.search.k)
      throw std::invalid_argument(who + ": search.rerank_exact " + std::to_string(cfg.search.rerank_exact) +
                                  " must be 0 (off) or >= search.k " + std::to_string(cfg.search.k));
  }

  std::int64_t head_dim() const noexcept { return d_; }  ///< dimensions of a key and a value
  const ParisKVCacheConfig& config() const noexcept { return cfg_; }  ///< the options it was built with
  std::int64_t size() const noexcept { return n_; }  ///< tokens held
  /// First position of the retrieval zone (min(S, N)) and of the local zone (E).
  std::int64_t retrieval_begin() const noexcept { return std::min(cfg_.sinks, n_); }
  std::int64_t local_begin() const noexcept { return e_; }  ///< E, the first position of the local window
  /// Tokens in the retrieval zone (E − S): in the index, or searched exactly.
  std::int64_t indexed() const noexcept { return exact() ? zone_ : index_->size(); }
  /// True when the retrieval zone is searched exactly (no index).
  bool exact() const noexcept { return cfg_.retrieval == ParisKVRetrieval::exact; }
  /// The softmax scale attend() applies to q·k.
  double scale() const noexcept { return cfg_.scale > 0 ? cfg_.scale : 1.0 / std::sqrt(double(d_)); }
  /// N below which select() returns every position (0 without the dense fallback).
  std::int64_t dense_threshold() const noexcept {
    if (!cfg_.dense_fallback) return 0;
    return std::max(cfg_.dense_min, cfg_.sinks + cfg_.local + 2 * cfg_.search.k);
  }
  bool dense() const noexcept { return n_ < dense_threshold(); }  ///< true while select() returns every position
  /// The retrieval index (std::invalid_argument with exact retrieval, which has none).
  const ParisKV& index() const {
    if (!index_) throw std::invalid_argument("kvscore::ParisKVCache::index: exact retrieval keeps no index");
    return *index_;
  }
  const T* keys() const noexcept { return k_.data(); }  ///< the held keys, [size][head_dim] row-major
  const T* values() const noexcept { return v_.data(); }  ///< the held values, [size][head_dim] row-major
  /// Bytes held: full-precision keys and values (2·N·head_dim·sizeof(T)) plus the index (none
  /// when the zone is searched exactly).
  std::size_t memory_bytes() const noexcept {
    return 2 * k_.size() * sizeof(T) + (exact() ? std::size_t(0) : index_->memory_bytes());
  }

  /// Reserves room for `tokens` tokens of keys and values, so appends up to there never move
  /// the cache (an engine knows its context limit; growth would copy the whole cache).
  void reserve(std::int64_t tokens) {
    if (tokens < 0) throw std::invalid_argument("kvscore::ParisKVCache::reserve: tokens must be >= 0 (got " + std::to_string(tokens) + ")");
    k_.reserve(std::size_t(tokens * d_));
    v_.reserve(std::size_t(tokens * d_));
  }

  /// Appends n tokens (rows of head_dim elements, contiguous) and indexes the tokens that leave
  /// the local zone. Atomic: every row is checked before anything changes.
  void append(const T* keys, const T* values, std::int64_t n = 1) { append(keys, values, n, d_, d_); }

  /// The same with row strides (elements between consecutive tokens' rows, >= head_dim): a KV
  /// head's slice of an engine's [heads][tokens][head_dim] cache, read without a copy.
  void append(const T* keys, const T* values, std::int64_t n, std::int64_t key_stride, std::int64_t value_stride) {
    const std::string who = "kvscore::ParisKVCache::append";
    if (n < 0) throw std::invalid_argument(who + ": n must be >= 0 (got " + std::to_string(n) + ")");
    if (n == 0) return;
    if (keys == nullptr || values == nullptr) throw std::invalid_argument(who + ": keys or values is null");
    if (n > 1 && (key_stride < d_ || value_stride < d_))
      throw std::invalid_argument(who + ": row strides " + std::to_string(key_stride) + "/" + std::to_string(value_stride) +
                                  " (key/value) < head_dim " + std::to_string(d_) + " make rows overlap");
    for (std::int64_t i = 0; i < n; ++i) {
      check_row(keys + i * key_stride, "key", n_ + i, true, who);
      check_row(values + i * value_stride, "value", n_ + i, false, who);
    }
    for (std::int64_t i = 0; i < n; ++i) {
      k_.insert(k_.end(), keys + i * key_stride, keys + i * key_stride + d_);
      v_.insert(v_.end(), values + i * value_stride, values + i * value_stride + d_);
    }
    n_ += n;
    e_ = std::max(e_, std::min(cfg_.sinks, n_));  // tokens before S are sinks, never indexed
    if (n_ - e_ >= cfg_.local + cfg_.update_interval) {
      const std::int64_t to = n_ - cfg_.local;  // index [E, N − L)
      if (exact()) zone_ += to - e_;
      else index_->append(k_.data() + e_ * d_, to - e_, d_);
      e_ = to;
    }
  }

  /// Keeps the first n tokens, n in [0, size()] (transformers' Cache.crop: a question and its
  /// answer leave the cache). Tokens from n on leave the index too; the local zone becomes the
  /// last min(L, n − S) tokens again (a flush is due when it next reaches L + U), so after
  /// crop(n) the cache selects exactly as one that holds the first n tokens with U = 1.
  void crop(std::int64_t n) {
    if (n < 0 || n > n_)
      throw std::invalid_argument("kvscore::ParisKVCache::crop: n " + std::to_string(n) + " out of range [0, " +
                                  std::to_string(n_) + "]");
    const std::int64_t S = std::min(cfg_.sinks, n);
    const std::int64_t e = std::max(S, std::min(e_, n - cfg_.local));
    if (exact()) zone_ = e - S;
    else index_->truncate(e - S);
    e_ = n == 0 ? 0 : e;
    n_ = n;
    k_.resize(std::size_t(n * d_));
    v_.resize(std::size_t(n * d_));
  }

  /// The attended positions for query q (head_dim floats), ascending, into ws.positions.
  void select(const float* q, Workspace& ws) const {
    ws.positions.clear();
    if (dense()) {
      for (std::int64_t t = 0; t < n_; ++t) ws.positions.push_back(t);
      return;
    }
    const std::int64_t S = retrieval_begin();
    for (std::int64_t t = 0; t < S; ++t) ws.positions.push_back(t);
    const std::int64_t R = indexed();
    if (R > 0 && cfg_.search.k > 0) {
      ParisKVSearch opt = cfg_.search;
      opt.k = std::min(opt.k, R);
      if (opt.rerank_exact != 0) opt.rerank_exact = std::max(opt.k, std::min(opt.rerank_exact, R));
      if (exact()) exact_top(q, opt.k, S, R, ws);
      else index_->search(q, opt, k_.data() + S * d_, d_, ws.search, ws.result);
      for (std::int64_t p : ws.result.positions) ws.positions.push_back(S + p);
    }
    for (std::int64_t t = e_; t < n_; ++t) ws.positions.push_back(t);
  }
  /// \overload
  std::vector<std::int64_t> select(const float* q) const {
    Workspace ws;
    select(q, ws);
    return ws.positions;
  }

  /// out[head_dim] = Σ_i softmax_i(scale·q·k_i) v_i over select(q), fp32 (pariskv/attention.hpp:
  /// one order of operations on every kernel set, rows read in place, the selected ones with
  /// prefetch). An empty cache writes zeros.
  void attend(const float* q, float* out, Workspace& ws) const {
    select(q, ws);
    const auto set = pariskv::detail::resolve_kernels(cfg_.search.kernels, "kvscore::ParisKVCache::attend");
    if (dense())  // every row, in order: no gather
      pariskv::detail::attend_rows(set, k_.data(), v_.data(), d_, nullptr, n_, q, float(scale()), out, ws.attend);
    else
      pariskv::detail::attend_rows(set, k_.data(), v_.data(), d_, ws.positions.data(),
                                   std::int64_t(ws.positions.size()), q, float(scale()), out, ws.attend);
  }

  /// G queries q[g] of this KV head over every position (the dense case, dense() true): out[g]
  /// is attend(q[g])'s output bit for bit, from one read of the keys and values; ws.positions
  /// is left alone (every position).
  void attend_dense_group(const float* const* q, std::int64_t G, float* const* out,
                          pariskv::detail::AttendScratch& ws) const {
    const auto set = pariskv::detail::resolve_kernels(cfg_.search.kernels, "kvscore::ParisKVCache::attend_dense_group");
    pariskv::detail::attend_dense_group(set, k_.data(), v_.data(), d_, n_, q, G, float(scale()), out, ws);
  }

  /// The same attention over any set of positions in fp64 (the reference the tests hold
  /// attend() to): logits with the active kernel table's dot (fp32, as the exact rerank),
  /// softmax and the value sum in fp64.
  void attend_over(const float* q, const std::vector<std::int64_t>& positions, float* out,
                   std::vector<double>& logits) const {
    const auto& dot = simd::active_table().template ops<T>().dot;
    const double scale = this->scale();
    logits.resize(positions.size());
    double mx = -std::numeric_limits<double>::infinity();
    for (std::size_t i = 0; i < positions.size(); ++i) {
      float s = 0.f;
      dot(k_.data() + positions[i] * d_, 1, d_, d_, q, &s);
      logits[i] = double(s) * scale;
      mx = std::max(mx, logits[i]);
    }
    std::vector<double> acc(std::size_t(d_), 0.0);
    std::vector<float> row(static_cast<std::size_t>(d_));
    double z = 0;
    for (std::size_t i = 0; i < positions.size(); ++i) {
      const double p = std::exp(logits[i] - mx);
      z += p;
      convert(v_.data() + positions[i] * d_, row.data(), std::size_t(d_));
      for (std::int64_t j = 0; j < d_; ++j) acc[std::size_t(j)] += p * double(row[std::size_t(j)]);
    }
    for (std::int64_t j = 0; j < d_; ++j) out[j] = z > 0 ? float(acc[std::size_t(j)] / z) : 0.f;
  }

 private:
  /// The exact top k of the R keys from position S on: q·k by the active table's dot kernel (fp32
  /// accumulation, as the exact rerank), kvscore::select's top k (ties: lower position),
  /// ws.result.positions ascending and relative to S.
  void exact_top(const float* q, std::int64_t k, std::int64_t S, std::int64_t R, Workspace& ws) const {
    ws.dots.resize(std::size_t(R));
    simd::active_table().template ops<T>().dot(k_.data() + S * d_, R, d_, d_, q, ws.dots.data());
    SelectOptions so;
    so.num_threads = 1;
    const Budget bud = Budget::per_head(k);
    const std::size_t bytes = select_workspace_bytes(1, R, bud, so);
    if (ws.select_ws.size() < bytes) ws.select_ws.resize(bytes);
    std::int64_t offsets[2];
    ws.result.positions.resize(std::size_t(k));
    select_into(ConstScoresView(ws.dots.data(), 1, R), bud, so, ws.select_ws.data(), ws.select_ws.size(), offsets,
                ws.result.positions.data(), ws.result.positions.size());
  }

  void check_row(const T* r, const char* what, std::int64_t index, bool key, const std::string& who) const {
    float sq = 0.f;
    for (std::int64_t j = 0; j < d_; ++j) {
      const float v = to_float(r[j]);
      if (!std::isfinite(v))
        throw std::invalid_argument(who + ": " + what + " " + std::to_string(index) + " has a non-finite value " +
                                    std::to_string(v) + " at element " + std::to_string(j));
      sq += v * v;
    }
    if (key && !std::isfinite(sq))
      throw std::invalid_argument(who + ": key " + std::to_string(index) +
                                  " has a squared norm that overflows fp32 (magnitude above ~1.8e19)");
  }

  ParisKVCacheConfig cfg_;
  std::int64_t d_ = 0, n_ = 0, e_ = 0;
  std::int64_t zone_ = 0;  ///< exact retrieval: tokens of the zone [S, E)
  std::optional<ParisKV> index_;  ///< none with exact retrieval
  std::vector<T> k_, v_;
};

}  // namespace kvscore
