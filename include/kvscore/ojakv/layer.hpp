// kvscore/ojakv/layer.hpp — OjaKV's hybrid store for a whole layer during generation (the
// paper's OjaKV-PF: full-rank attention in the prefill, the compressed store from the first
// decoded token on; ojakv.txt §4, "Practical variant"): per batch row, one OjaProjector per KV
// head and one OjaHybridCache, so that an engine (or kvscore.generation inside Hugging Face
// `generate`) makes one call per layer per forward.
//
// [snippet ojakv-layer-header: tests/test_snippets.cpp]
//   kvscore::OjaLayerCache layer(batch, kv_heads, head_dim, cfg);  // ranks, anchors, sinks, window
//   layer.prefill(prompt_k, prompt_v, n, ks, vs, last_q, q_heads, w, ws);  // bases, anchors, codes
//   layer.forward(k, v, q, q_heads, 1, ks, vs, qs, out.data(), qs);  // one decode step, every query head
//
// prefill: each head's bases start from a seeded random orthonormal pair (seed + 2h, key and
// value; every row alike) and converge on the prompt (OjaOptions' prefill); the anchors are the
// top `anchors` tokens of the residual rule e_t (OjaResidual, the prompt's last w queries in the
// cache) with the first `sinks` and the w window tokens protected; the rest become codes.
// forward(n tokens): token i is appended (its block held at full rank until T tokens close it:
// Oja update, rebase, the block's own residual rule; OjaDecodeOptions), then every query head j
// attends with its query i over its KV head's store (j / G, HF repeat_kv order) by the low-rank
// kernel (OjaHybridCache::attend). OpenMP over (row, query head); results do not depend on the
// thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "kvscore/core/parallel.hpp"
#include "kvscore/core/view.hpp"
#include "kvscore/methods.hpp"
#include "kvscore/ojakv/cache.hpp"
#include "kvscore/ojakv/ojakv.hpp"
#include "kvscore/select.hpp"

namespace kvscore {

/// Options of OjaLayerCache (the Python OjaKVCache's keywords).
struct OjaLayerConfig {
  std::int64_t rank_k = 0;        ///< key basis rank r_k in [1, head_dim]; 0 = max(1, head_dim / 4)
  std::int64_t rank_v = 0;        ///< value basis rank r_v; 0 = rank_k
  std::int64_t anchors = 0;       ///< prompt tokens per head kept at full rank (sinks and window included)
  std::int64_t sinks = kDefaultSinks;  ///< first tokens always among the anchors
  std::int64_t window = 32;       ///< queries of the residual rule: the prompt's last w (its tokens are anchors)
  std::uint64_t seed = 0;         ///< head h: key basis seed + 2h, value basis seed + 2h + 1
  double scale = 0;               ///< softmax scale on q·k; 0 = 1/√head_dim
  OjaOptions options{};           ///< η, prefill iterations, pool, period T (the decode block)
  OjaDecodeOptions decode{};      ///< full-rank share of each closed block, adapt (false: frozen bases)
};

/// OjaKV's hybrid store for a whole layer during generation: per batch row, one OjaProjector per KV head and one
/// OjaHybridCache; prefill() builds it from the prompt, forward() appends tokens and attends every query head (see
/// the top of this file).
class OjaLayerCache {
 public:
  /// An empty layer cache for `batch` rows of `kv_heads` heads of `head_dim`; std::invalid_argument for a bad shape
  /// or option.
  OjaLayerCache(std::int64_t batch, std::int64_t kv_heads, std::int64_t head_dim, const OjaLayerConfig& cfg = {})
      : cfg_(cfg), batch_(batch), heads_(kv_heads), d_(head_dim) {
    const std::string who = "kvscore::OjaLayerCache: ";
    auto need = [&](bool ok, const std::string& what) {
      if (!ok) detail::throw_invalid(who + what);
    };
    need(batch >= 1, "batch must be >= 1 (got " + std::to_string(batch) + ")");
    need(kv_heads >= 1, "kv_heads must be >= 1 (got " + std::to_string(kv_heads) + ")");
    need(head_dim >= 1 && head_dim <= kMaxHeadDim,
         "head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " + std::to_string(head_dim) + ")");
    if (cfg_.rank_k == 0) cfg_.rank_k = std::max<std::int64_t>(1, head_dim / 4);
    if (cfg_.rank_v == 0) cfg_.rank_v = cfg_.rank_k;
    oja::check_rank("kvscore::OjaLayerCache", head_dim, cfg_.rank_k);
    oja::check_rank("kvscore::OjaLayerCache", head_dim, cfg_.rank_v);
    need(cfg_.anchors >= 0, "anchors must be >= 0 (got " + std::to_string(cfg_.anchors) + ")");
    need(cfg_.sinks >= 0, "sinks must be >= 0 (got " + std::to_string(cfg_.sinks) + ")");
    need(cfg_.window >= 1, "window must be >= 1 (got " + std::to_string(cfg_.window) + ")");
    need(cfg_.scale >= 0 && std::isfinite(cfg_.scale),
         "scale must be finite and >= 0, 0 = 1/sqrt(head_dim) (got " + oja::num(cfg_.scale) + ")");
    cfg_.options.validate("kvscore::OjaLayerCache");
    cfg_.decode.validate("kvscore::OjaLayerCache");
    rows_.resize(std::size_t(batch));
  }

  const OjaLayerConfig& config() const noexcept { return cfg_; }  ///< the options it was built with
  std::int64_t batch() const noexcept { return batch_; }  ///< batch rows
  std::int64_t kv_heads() const noexcept { return heads_; }  ///< KV heads per row
  std::int64_t head_dim() const noexcept { return d_; }  ///< dimensions of a key and a value
  bool prefilled() const noexcept { return rows_.front().store.heads() > 0; }  ///< true once prefill() ran
  /// Tokens held (every row and head alike): committed + the open block.
  std::int64_t size() const noexcept { return prefilled() ? rows_.front().store.tokens() : 0; }
  const OjaHybridCache& store(std::int64_t b) const { return row(b, "store").store; }  ///< row b's store
  /// Row b's projectors, one per KV head.
  const std::vector<OjaProjector>& projectors(std::int64_t b) const { return row(b, "projectors").proj; }
  /// The hybrid store's memory by the paper's formula (docs/methods/ojakv.md, Definitions 11) at
  /// bytes_per_scalar bytes per element, summed over rows and heads; .ratio against full rank.
  OjaMemory memory(std::int64_t bytes_per_scalar) const {
    OjaMemory m;
    for (const Row& r : rows_)
      for (std::int64_t h = 0; h < r.store.heads(); ++h) {
        const OjaMemory x = r.store.memory(h, bytes_per_scalar);
        m.full_bytes += x.full_bytes;
        m.hybrid_bytes += x.hybrid_bytes;
      }
    m.ratio = m.full_bytes > 0 ? double(m.hybrid_bytes) / double(m.full_bytes) : 0.0;
    return m;
  }
  /// Bytes the stores hold now (OjaHybridCache::stored_bytes, summed).
  std::int64_t stored_bytes() const {
    std::int64_t s = 0;
    for (const Row& r : rows_)
      for (std::int64_t h = 0; h < r.store.heads(); ++h) s += r.store.stored_bytes(h);
    return s;
  }
  int num_threads = 0;  ///< OpenMP threads (0 = OpenMP's default)

  /// The prompt: keys/values [batch][kv_heads][n][head_dim] (strides ks/vs), queries
  /// [batch][q_heads][w][head_dim] fp32: the prompt's last w queries (w = min(window, n) is
  /// typical; 1 <= w <= n). Bases, anchors (select: budget min(anchors, n), sinks and the last w
  /// protected), codes. Once per cache.
  template <class T>
  void prefill(const T* keys, const T* values, std::int64_t n, const LayerStrides& ks, const LayerStrides& vs,
               const float* queries, std::int64_t q_heads, std::int64_t w, const LayerStrides& qs) {
    static_assert(is_element_type_v<T>, "OjaLayerCache::prefill: T must be float, half or bfloat16");
    const std::string who = "kvscore::OjaLayerCache::prefill: ";
    if (prefilled()) detail::throw_invalid(who + "the cache is prefilled already (" + std::to_string(size()) + " tokens)");
    if (n < 1) detail::throw_invalid(who + "n must be >= 1 (got " + std::to_string(n) + ")");
    if (keys == nullptr || values == nullptr || queries == nullptr)
      detail::throw_invalid(who + "keys, values or queries is null");
    if (q_heads < 1 || q_heads % heads_ != 0)
      detail::throw_invalid(who + "q_heads " + std::to_string(q_heads) + " is not a positive multiple of the " +
                            std::to_string(heads_) + " KV heads");
    if (w < 1 || w > n) detail::throw_invalid(who + "w " + std::to_string(w) + " out of range [1, n = " + std::to_string(n) + "]");
    const std::int64_t budget = std::min(cfg_.anchors, n);
    const std::int64_t protect = std::min(n, std::min(cfg_.sinks, n) + w);
    if (budget < protect)
      detail::throw_invalid(who + "anchors " + std::to_string(cfg_.anchors) + " < the " + std::to_string(protect) +
                            " protected tokens (sinks " + std::to_string(cfg_.sinks) + " + the window's " +
                            std::to_string(w) + "): raise anchors or lower sinks / window");
    for (const LayerStrides* s : {&ks, &vs, &qs})
      if (s->batch < 0 || s->head < 0 || s->token < 0) detail::throw_invalid(who + "strides must be >= 0");
    // Every row is built into a new Row first: a failure leaves the cache empty.
    std::vector<Row> built(rows_.size());
    std::vector<float> qw(std::size_t(q_heads * w * d_));
    for (std::int64_t b = 0; b < batch_; ++b) {
      const KeysView<T> K(keys + b * ks.batch, heads_, n, d_, ks.head, ks.token);
      const KeysView<T> V(values + b * vs.batch, heads_, n, d_, vs.head, vs.token);
      Row& r = built[std::size_t(b)];
      r.proj.reserve(std::size_t(heads_));
      for (std::int64_t h = 0; h < heads_; ++h)
        r.proj.push_back(OjaProjector(OjaBasis::random(d_, cfg_.rank_k, cfg_.seed + 2 * std::uint64_t(h), cfg_.options),
                                      OjaBasis::random(d_, cfg_.rank_v, cfg_.seed + 2 * std::uint64_t(h) + 1, cfg_.options)));
      detail::parallel_for(heads_, num_threads, [&](std::int64_t h) { r.proj[std::size_t(h)].prefill(K, V, h); });
      for (std::int64_t j = 0; j < q_heads; ++j)
        for (std::int64_t i = 0; i < w; ++i)
          std::copy_n(queries + b * qs.batch + j * qs.head + i * qs.token, d_, qw.data() + (j * w + i) * d_);
      std::vector<Eigen::MatrixXd> uk;
      for (const OjaProjector& p : r.proj) uk.push_back(p.key().basis());
      OjaResidual rule(qw.data(), q_heads, w, d_, std::move(uk));
      rule.num_threads = num_threads;
      SelectOptions so;
      so.sinks = std::min(cfg_.sinks, n);
      so.recent = rule.protected_recent();
      so.num_threads = num_threads;
      const Selection full = select(rule.score(K), Budget::per_head(budget), so);
      r.store = OjaHybridCache::build(r.proj, K, V, full);
    }
    rows_ = std::move(built);
  }

  /// n new tokens, in order: append token i to every row (OjaHybridCache::append with the
  /// step's queries), then attend every query head with its query i. keys/values
  /// [batch][kv_heads][n][d], queries [batch][q_heads][n][d] fp32, out [batch][q_heads][n][d]
  /// fp32. Checked before anything changes.
  template <class T>
  void forward(const T* keys, const T* values, const float* queries, std::int64_t q_heads, std::int64_t n,
               const LayerStrides& ks, const LayerStrides& vs, const LayerStrides& qs, float* out,
               const LayerStrides& os) {
    static_assert(is_element_type_v<T>, "OjaLayerCache::forward: T must be float, half or bfloat16");
    const std::string who = "kvscore::OjaLayerCache::forward: ";
    if (!prefilled()) detail::throw_invalid(who + "prefill first");
    if (n < 0) detail::throw_invalid(who + "n must be >= 0 (got " + std::to_string(n) + ")");
    if (n == 0) return;
    if (keys == nullptr || values == nullptr || queries == nullptr || out == nullptr)
      detail::throw_invalid(who + "keys, values, queries or out is null");
    if (q_heads < 1 || q_heads % heads_ != 0)
      detail::throw_invalid(who + "q_heads " + std::to_string(q_heads) + " is not a positive multiple of the " +
                            std::to_string(heads_) + " KV heads");
    const std::int64_t G = q_heads / heads_;
    for (std::int64_t b = 0; b < batch_; ++b)
      for (std::int64_t j = 0; j < q_heads; ++j)
        for (std::int64_t i = 0; i < n; ++i)
          for (std::int64_t x = 0; x < d_; ++x)
            if (!std::isfinite(queries[b * qs.batch + j * qs.head + i * qs.token + x]))
              detail::throw_invalid(who + "query [row " + std::to_string(b) + ", head " + std::to_string(j) +
                                    ", token " + std::to_string(i) + "] has a non-finite value at element " +
                                    std::to_string(x));
    std::vector<T> kr(std::size_t(heads_ * d_)), vr(std::size_t(heads_ * d_));
    std::vector<float> qr(std::size_t(q_heads * d_));
    ws_.resize(std::size_t(batch_ * q_heads));
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t b = 0; b < batch_; ++b) {
        for (std::int64_t h = 0; h < heads_; ++h) {
          std::copy_n(keys + b * ks.batch + h * ks.head + i * ks.token, d_, kr.data() + h * d_);
          std::copy_n(values + b * vs.batch + h * vs.head + i * vs.token, d_, vr.data() + h * d_);
        }
        for (std::int64_t j = 0; j < q_heads; ++j)
          std::copy_n(queries + b * qs.batch + j * qs.head + i * qs.token, d_, qr.data() + j * d_);
        Row& r = rows_[std::size_t(b)];
        r.store.append(r.proj, kr.data(), vr.data(), qr.data(), q_heads, cfg_.decode);
      }
      detail::parallel_for(batch_ * q_heads, num_threads, [&](std::int64_t x) {
        const std::int64_t b = x / q_heads, j = x % q_heads;
        rows_[std::size_t(b)].store.attend(j / G, queries + b * qs.batch + j * qs.head + i * qs.token,
                                           out + b * os.batch + j * os.head + i * os.token, cfg_.scale,
                                           ws_[std::size_t(x)]);
      });
    }
  }

  /// Keeps the first n tokens (OjaHybridCache::crop: only tokens of the open block can go).
  void crop(std::int64_t n) {
    if (!prefilled()) {
      if (n != 0) detail::throw_invalid("kvscore::OjaLayerCache::crop: n " + std::to_string(n) + " > 0 tokens held");
      return;
    }
    for (Row& r : rows_) r.store.crop(r.proj, n, cfg_.decode);
  }

 private:
  struct Row {
    std::vector<OjaProjector> proj;
    OjaHybridCache store;
  };
  const Row& row(std::int64_t b, const char* what) const {
    if (b < 0 || b >= batch_)
      detail::throw_invalid(std::string("kvscore::OjaLayerCache::") + what + ": row " + std::to_string(b) +
                            " out of range [0, " + std::to_string(batch_) + ")");
    return rows_[std::size_t(b)];
  }

  OjaLayerConfig cfg_;
  std::int64_t batch_ = 0, heads_ = 0, d_ = 0;
  std::vector<Row> rows_;
  std::vector<OjaHybridCache::AttendWorkspace> ws_;
};

}  // namespace kvscore
