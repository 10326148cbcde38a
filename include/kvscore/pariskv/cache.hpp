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
// selected positions (fp32 logits, fp64 sums).
//
// Defaults (docs/pariskv.md, "Decode-time cache"): S = 4, L = 256, U = 128, k = 100, dense below
// 2000 tokens; the authors' code uses sink 4, local 64…512, updates every 128 or 512 tokens,
// top-k 100 (2048 for Qwen3-8B). Inputs are post-RoPE keys and queries, as an engine holds them.
// Errors: std::invalid_argument naming the value (bad configuration, a key or value with a
// NaN/Inf element, a key whose squared norm overflows fp32); a rejected append leaves the cache
// unchanged.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/core/dtype.hpp"
#include "kvscore/methods.hpp"
#include "kvscore/pariskv/pariskv.hpp"

namespace kvscore {

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
};

template <class T>
class ParisKVCache {
  static_assert(is_element_type_v<T>, "ParisKVCache: T must be float, half or bfloat16");

 public:
  using value_type = T;  ///< element type of the stored keys and values
  struct Workspace {
    ParisKV::Workspace search;
    ParisKVResult result;
    std::vector<std::int64_t> positions;
    std::vector<double> logits;
  };

  explicit ParisKVCache(std::int64_t head_dim, const ParisKVCacheConfig& cfg = {})
      : cfg_(cfg), d_(head_dim), index_(head_dim, cfg.index) {
    const std::string who = "kvscore::ParisKVCache";
    auto need = [&](bool ok, const char* name, std::int64_t v, const char* rule) {
      if (!ok) throw std::invalid_argument(who + ": " + name + " must be " + rule + " (got " + std::to_string(v) + ")");
    };
    need(cfg.sinks >= 0, "sinks", cfg.sinks, ">= 0");
    need(cfg.local >= 0, "local", cfg.local, ">= 0");
    need(cfg.update_interval >= 1, "update_interval", cfg.update_interval, ">= 1");
    need(cfg.dense_min >= 0, "dense_min", cfg.dense_min, ">= 0");
    need(cfg.search.k >= 0, "search.k", cfg.search.k, ">= 0");
    ParisKVSearch probe = cfg.search;  // the index checks β, ρ and k' once, on an empty index
    probe.k = 0;
    index_.check_options(probe, true, head_dim);
    if (cfg.search.rerank_exact != 0 && cfg.search.rerank_exact < cfg.search.k)
      throw std::invalid_argument(who + ": search.rerank_exact " + std::to_string(cfg.search.rerank_exact) +
                                  " must be 0 (off) or >= search.k " + std::to_string(cfg.search.k));
  }

  std::int64_t head_dim() const noexcept { return d_; }
  const ParisKVCacheConfig& config() const noexcept { return cfg_; }
  std::int64_t size() const noexcept { return n_; }
  /// First position of the retrieval zone (min(S, N)) and of the local zone (E).
  std::int64_t retrieval_begin() const noexcept { return std::min(cfg_.sinks, n_); }
  std::int64_t local_begin() const noexcept { return e_; }
  /// Tokens in the index (E − S).
  std::int64_t indexed() const noexcept { return index_.size(); }
  /// N below which select() returns every position (0 without the dense fallback).
  std::int64_t dense_threshold() const noexcept {
    if (!cfg_.dense_fallback) return 0;
    return std::max(cfg_.dense_min, cfg_.sinks + cfg_.local + 2 * cfg_.search.k);
  }
  bool dense() const noexcept { return n_ < dense_threshold(); }
  const ParisKV& index() const noexcept { return index_; }
  const T* keys() const noexcept { return k_.data(); }
  const T* values() const noexcept { return v_.data(); }
  /// Bytes held: full-precision keys and values (2·N·head_dim·sizeof(T)) plus the index.
  std::size_t memory_bytes() const noexcept { return 2 * k_.size() * sizeof(T) + index_.memory_bytes(); }

  /// Reserves room for `tokens` tokens of keys and values, so appends up to there never move
  /// the cache (an engine knows its context limit; growth would copy the whole cache).
  void reserve(std::int64_t tokens) {
    if (tokens < 0) throw std::invalid_argument("kvscore::ParisKVCache::reserve: tokens must be >= 0 (got " + std::to_string(tokens) + ")");
    k_.reserve(std::size_t(tokens * d_));
    v_.reserve(std::size_t(tokens * d_));
  }

  /// Appends n tokens (rows of head_dim elements, contiguous) and indexes the tokens that leave
  /// the local zone. Atomic: every row is checked before anything changes.
  void append(const T* keys, const T* values, std::int64_t n = 1) {
    const std::string who = "kvscore::ParisKVCache::append";
    if (n < 0) throw std::invalid_argument(who + ": n must be >= 0 (got " + std::to_string(n) + ")");
    if (n == 0) return;
    if (keys == nullptr || values == nullptr) throw std::invalid_argument(who + ": keys or values is null");
    for (std::int64_t i = 0; i < n; ++i) {
      check_row(keys + i * d_, "key", n_ + i, true, who);
      check_row(values + i * d_, "value", n_ + i, false, who);
    }
    k_.insert(k_.end(), keys, keys + n * d_);
    v_.insert(v_.end(), values, values + n * d_);
    n_ += n;
    e_ = std::max(e_, std::min(cfg_.sinks, n_));  // tokens before S are sinks, never indexed
    if (n_ - e_ >= cfg_.local + cfg_.update_interval) {
      const std::int64_t to = n_ - cfg_.local;  // index [E, N − L)
      index_.append(k_.data() + e_ * d_, to - e_, d_);
      e_ = to;
    }
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
      index_.search(q, opt, k_.data() + S * d_, d_, ws.search, ws.result);
      for (std::int64_t p : ws.result.positions) ws.positions.push_back(S + p);
    }
    for (std::int64_t t = e_; t < n_; ++t) ws.positions.push_back(t);
  }
  std::vector<std::int64_t> select(const float* q) const {
    Workspace ws;
    select(q, ws);
    return ws.positions;
  }

  /// out[head_dim] = Σ_i softmax_i(q·k_i/√d) v_i over select(q) (fp64 sums, fp32 output).
  /// An empty cache writes zeros.
  void attend(const float* q, float* out, Workspace& ws) const {
    select(q, ws);
    attend_over(q, ws.positions, out, ws.logits);
  }

  /// The same attention over any set of positions (e.g. all of them: the exact reference).
  /// Logits with the active kernel table's dot (fp32, as the exact rerank), softmax and the
  /// value sum in fp64.
  void attend_over(const float* q, const std::vector<std::int64_t>& positions, float* out,
                   std::vector<double>& logits) const {
    const auto& dot = simd::active_table().template ops<T>().dot;
    const double scale = 1.0 / std::sqrt(double(d_));
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
  ParisKV index_;
  std::vector<T> k_, v_;
};

}  // namespace kvscore
