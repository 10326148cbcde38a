// kvscore/pariskv/layer.hpp — ParisKV's decode-time cache for a whole layer: every batch row and
// KV head of one attention layer, one ParisKVCache<T> each, so that an engine (or
// kvscore.generation inside Hugging Face `generate`) makes one call per layer per forward.
//
// [snippet pariskv-layer-header: tests/test_snippets.cpp]
//   kvscore::ParisKVLayerCache<float> layer(batch, kv_heads, head_dim, cfg);  // cfg: zones, k, exact or index
//   layer.append(prompt_k, prompt_v, prompt_len, ks, vs);  // prefill: [batch][kv_heads][n][head_dim], any strides
//   layer.forward(k, v, q, q_heads, 1, ks, vs, qs, out.data(), qs);  // one decode step, every query head
//
// forward(k, v, q, q_heads, n, ...) runs n new tokens in order: token i's keys and values are
// appended to every (row, KV head), then every query head attends with its own query i to the
// positions its KV head's cache selects for it (GQA: query head j reads KV head j / G, G =
// q_heads / kv_heads, HF's repeat_kv order; each query retrieves for itself, never a group
// mean). Token i therefore sees positions ≤ its own (causal), and a prompt chunk after the
// prefill (a question) is retrieved token by token. OpenMP over (row, KV head) for the appends
// and over (row, query head) for the attention; the outputs do not depend on the thread count.
// The positions each query head attended last are kept (positions(b, j)), for tests and tools.
#pragma once

#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/core/parallel.hpp"
#include "kvscore/core/view.hpp"
#include "kvscore/pariskv/cache.hpp"

namespace kvscore {

/// Cache length below which a decode step attends densely by default (kvscore.generation's
/// RetrievalCache(dense_below=None); ParisKVCacheConfig::dense_min): where a step retrieving 10 %
/// of the keys (4 sinks, a local window of 64) became faster than ParisKVLayerCache's dense step
/// (each KV head's keys and values read once for its query heads, faster than torch's sdpa).
/// Measured by python/bench/bench_decode.py on this project's 2-core Intel Xeon (AVX-512), one
/// thread, 30 (SmolLM2) or 8 (synthetic) layers: head_dim 64 (SmolLM2-135M's keys, GQA 3:1;
/// synthetic drift keys) between 5.5K and 8K tokens across runs, head_dim 128 (synthetic, GQA
/// 4:1) about 5.3K; docs/guides/generation.md "The dense threshold". Around the crossover the two steps
/// are within ~10 % of each other. Other head dims take the nearer measured value.
inline std::int64_t retrieval_dense_below(std::int64_t head_dim) noexcept { return head_dim <= 96 ? 6144 : 5120; }

/// Every batch row and KV head of one layer as ParisKVCache<T>s: one call per layer per decoded token, each query
/// head retrieving for itself (kvscore.generation's RetrievalCache).
template <class T>
class ParisKVLayerCache {
 public:
  using value_type = T;  ///< element type of the stored keys and values
  using Head = ParisKVCache<T>;  ///< one (row, KV head)'s cache

  /// Empty caches for `batch` rows of `kv_heads` heads; std::invalid_argument for a bad shape or option.
  ParisKVLayerCache(std::int64_t batch, std::int64_t kv_heads, std::int64_t head_dim, const ParisKVCacheConfig& cfg = {})
      : batch_(batch), heads_(kv_heads), d_(head_dim) {
    const std::string who = "kvscore::ParisKVLayerCache";
    if (batch < 1) throw std::invalid_argument(who + ": batch must be >= 1 (got " + std::to_string(batch) + ")");
    if (kv_heads < 1) throw std::invalid_argument(who + ": kv_heads must be >= 1 (got " + std::to_string(kv_heads) + ")");
    cache_.reserve(std::size_t(batch * kv_heads));
    for (std::int64_t i = 0; i < batch * kv_heads; ++i) cache_.emplace_back(head_dim, cfg);  // checks head_dim, cfg
  }

  std::int64_t batch() const noexcept { return batch_; }  ///< batch rows
  std::int64_t kv_heads() const noexcept { return heads_; }  ///< KV heads per row
  std::int64_t head_dim() const noexcept { return d_; }  ///< dimensions of a key and a value
  /// Tokens held (the same in every row and head).
  std::int64_t size() const noexcept { return cache_.front().size(); }
  /// The options every head was built with.
  const ParisKVCacheConfig& config() const noexcept { return cache_.front().config(); }
  /// Row b, KV head h's cache (std::out_of_range for a bad index).
  const Head& head(std::int64_t b, std::int64_t h) const { return cache_.at(std::size_t(at(b, h, "head"))); }
  /// Bytes held by every (row, KV head): keys, values and indexes.
  std::size_t memory_bytes() const noexcept {
    std::size_t s = 0;
    for (const Head& c : cache_) s += c.memory_bytes();
    return s;
  }
  /// OpenMP threads of append/forward (0 = OpenMP's default).
  int num_threads = 0;

  /// Appends n tokens to every (row, KV head): keys and values [batch][kv_heads][n][head_dim]
  /// with the given strides. Atomic per call: every row is checked before anything changes.
  void append(const T* keys, const T* values, std::int64_t n, const LayerStrides& ks, const LayerStrides& vs) {
    const std::string who = "kvscore::ParisKVLayerCache::append";
    check_layout(keys, values, n, ks, vs, who);
    if (n == 0) return;
    // A bad row anywhere must leave every head unchanged: check all heads, then append.
    check_rows(keys, values, n, ks, vs, who);
    detail::parallel_for(batch_ * heads_, num_threads, [&](std::int64_t i) {
      const std::int64_t b = i / heads_, h = i % heads_;
      cache_[std::size_t(i)].append(keys + b * ks.batch + h * ks.head, values + b * vs.batch + h * vs.head, n, ks.token,
                                    vs.token);
    });
  }

  /// n new tokens, in order: append token i's keys and values, then attend every query head with
  /// its query i. queries [batch][q_heads][n][head_dim] fp32 (qs: their strides); out[b][j][i]
  /// (os: its strides, fp32) = softmax(scale·q·k)·v over the positions head (b, j / G) selects for
  /// q. q_heads must be a multiple of kv_heads. Checked before anything changes.
  void forward(const T* keys, const T* values, const float* queries, std::int64_t q_heads, std::int64_t n,
               const LayerStrides& ks, const LayerStrides& vs, const LayerStrides& qs, float* out,
               const LayerStrides& os) {
    const std::string who = "kvscore::ParisKVLayerCache::forward";
    check_layout(keys, values, n, ks, vs, who);
    if (q_heads < 1 || q_heads % heads_ != 0)
      throw std::invalid_argument(who + ": q_heads " + std::to_string(q_heads) + " is not a positive multiple of the " +
                                  std::to_string(heads_) + " KV heads");
    if (n > 0 && (queries == nullptr || out == nullptr)) throw std::invalid_argument(who + ": queries or out is null");
    for (std::int64_t b = 0; b < batch_; ++b)
      for (std::int64_t j = 0; j < q_heads; ++j)
        for (std::int64_t i = 0; i < n; ++i) {
          const float* q = queries + b * qs.batch + j * qs.head + i * qs.token;
          for (std::int64_t x = 0; x < d_; ++x)
            if (!std::isfinite(q[x]))
              throw std::invalid_argument(who + ": query [row " + std::to_string(b) + ", head " + std::to_string(j) +
                                          ", token " + std::to_string(i) + "] has a non-finite value at element " +
                                          std::to_string(x));
        }
    check_rows(keys, values, n, ks, vs, who);
    const std::int64_t G = q_heads / heads_;
    ws_.resize(std::size_t(batch_ * q_heads));
    q_heads_ = q_heads;
    for (std::int64_t i = 0; i < n; ++i) {
      detail::parallel_for(batch_ * heads_, num_threads, [&](std::int64_t x) {
        const std::int64_t b = x / heads_, h = x % heads_;
        cache_[std::size_t(x)].append(keys + b * ks.batch + h * ks.head + i * ks.token,
                                      values + b * vs.batch + h * vs.head + i * vs.token, 1, d_, d_);
      });
      if (cache_.front().dense()) {  // every head holds as many tokens: all dense or none
        // a KV head's G queries together: its keys and values read once
        detail::parallel_for(batch_ * heads_, num_threads, [&](std::int64_t x) {
          const std::int64_t b = x / heads_, h = x % heads_;
          typename Head::Workspace& w = ws_[std::size_t(b * q_heads + h * G)];
          w.qptr.resize(std::size_t(G));
          w.optr.resize(std::size_t(G));
          for (std::int64_t g = 0; g < G; ++g) {
            const std::int64_t j = h * G + g;
            w.qptr[std::size_t(g)] = queries + b * qs.batch + j * qs.head + i * qs.token;
            w.optr[std::size_t(g)] = out + b * os.batch + j * os.head + i * os.token;
          }
          cache_[std::size_t(x)].attend_dense_group(w.qptr.data(), G, w.optr.data(), w.attend);
        });
        dense_n_ = size();  // positions() lists them on demand: 0..n-1 for every query head
        continue;
      }
      dense_n_ = -1;
      detail::parallel_for(batch_ * q_heads, num_threads, [&](std::int64_t x) {
        const std::int64_t b = x / q_heads, j = x % q_heads;
        cache_[std::size_t(b * heads_ + j / G)].attend(queries + b * qs.batch + j * qs.head + i * qs.token,
                                                        out + b * os.batch + j * os.head + i * os.token,
                                                        ws_[std::size_t(x)]);
      });
    }
  }

  /// The positions query head j of row b attended in the last forward (ascending).
  const std::vector<std::int64_t>& positions(std::int64_t b, std::int64_t j) const {
    if (b < 0 || b >= batch_ || j < 0 || j >= q_heads_)
      throw std::invalid_argument("kvscore::ParisKVLayerCache::positions: (row " + std::to_string(b) + ", query head " +
                                  std::to_string(j) + ") out of range [0, " + std::to_string(batch_) + ") x [0, " +
                                  std::to_string(q_heads_) + ") (no forward yet?)");
    std::vector<std::int64_t>& p = ws_[std::size_t(b * q_heads_ + j)].positions;
    if (dense_n_ >= 0) {  // the last step was dense
      p.resize(std::size_t(dense_n_));
      std::iota(p.begin(), p.end(), std::int64_t(0));
    }
    return p;
  }

  /// Keeps the first n tokens of every row and head (ParisKVCache::crop).
  void crop(std::int64_t n) {
    if (n < 0 || n > size())
      throw std::invalid_argument("kvscore::ParisKVLayerCache::crop: n " + std::to_string(n) + " out of range [0, " +
                                  std::to_string(size()) + "]");
    for (Head& c : cache_) c.crop(n);
  }

 private:
  std::int64_t at(std::int64_t b, std::int64_t h, const char* what) const {
    if (b < 0 || b >= batch_ || h < 0 || h >= heads_)
      throw std::invalid_argument(std::string("kvscore::ParisKVLayerCache::") + what + ": (row " + std::to_string(b) +
                                  ", KV head " + std::to_string(h) + ") out of range [0, " + std::to_string(batch_) +
                                  ") x [0, " + std::to_string(heads_) + ")");
    return b * heads_ + h;
  }

  void check_layout(const T* keys, const T* values, std::int64_t n, const LayerStrides& ks, const LayerStrides& vs,
                    const std::string& who) const {
    if (n < 0) throw std::invalid_argument(who + ": n must be >= 0 (got " + std::to_string(n) + ")");
    if (n > 0 && (keys == nullptr || values == nullptr)) throw std::invalid_argument(who + ": keys or values is null");
    for (const LayerStrides* s : {&ks, &vs})
      if (s->batch < 0 || s->head < 0 || s->token < 0)
        throw std::invalid_argument(who + ": strides must be >= 0 (got " + std::to_string(s->batch) + ", " +
                                    std::to_string(s->head) + ", " + std::to_string(s->token) + ")");
    if (n > 1 && (ks.token < d_ || vs.token < d_))
      throw std::invalid_argument(who + ": token strides " + std::to_string(ks.token) + "/" + std::to_string(vs.token) +
                                  " (key/value) < head_dim " + std::to_string(d_) + " make rows overlap");
  }

  // Every key and value row finite (the cache's own rule, checked for all heads up front so that
  // an append is atomic across heads).
  void check_rows(const T* keys, const T* values, std::int64_t n, const LayerStrides& ks, const LayerStrides& vs,
                  const std::string& who) const {
    for (std::int64_t b = 0; b < batch_; ++b)
      for (std::int64_t h = 0; h < heads_; ++h)
        for (std::int64_t i = 0; i < n; ++i) {
          const T* k = keys + b * ks.batch + h * ks.head + i * ks.token;
          const T* v = values + b * vs.batch + h * vs.head + i * vs.token;
          float sq = 0.f;
          for (std::int64_t x = 0; x < d_; ++x) {
            const float a = to_float(k[x]), c = to_float(v[x]);
            if (!std::isfinite(a) || !std::isfinite(c))
              throw std::invalid_argument(who + ": " + (std::isfinite(a) ? "value" : "key") + " [row " +
                                          std::to_string(b) + ", KV head " + std::to_string(h) + ", token " +
                                          std::to_string(size() + i) + "] has a non-finite value at element " +
                                          std::to_string(x));
            sq += a * a;
          }
          if (!std::isfinite(sq))
            throw std::invalid_argument(who + ": key [row " + std::to_string(b) + ", KV head " + std::to_string(h) +
                                        ", token " + std::to_string(size() + i) +
                                        "] has a squared norm that overflows fp32 (magnitude above ~1.8e19)");
        }
  }

  std::int64_t batch_ = 0, heads_ = 0, d_ = 0, q_heads_ = 0;
  std::vector<Head> cache_;                          ///< [batch][kv_heads]
  /// [batch][q_heads]: scratch and last positions (mutable: a dense step's are listed on demand)
  mutable std::vector<typename Head::Workspace> ws_;
  std::int64_t dense_n_ = -1;  ///< the last step was dense over this many positions (-1: retrieval)
};

}  // namespace kvscore
