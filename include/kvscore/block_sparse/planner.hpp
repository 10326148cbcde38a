// kvscore/block_sparse/planner.hpp — what an engine drives per step (kvscore.vllm's binding is a
// thin wrapper of it): BlockSparsePlanner holds a PagedBlockSelector, every layer's key cache
// (registered once: caches do not move), and the step's plan (its decode rows, once per step), so
// that each layer's call passes only that layer's query:
//
//   planner.register_caches(caches);                      // once: one KeyCache per layer
//   per step:  planner.begin_step(written_slots, live);    // the selector's begin_step
//              planner.plan(token_index, src, rows, tokens, attend, dst);
//   per layer: planner.select_planned(layer, query);       // dst's planned rows rewritten
//
// Which rows decode sparsely, and the length the attention kernel then sees, are sparse_attend()
// and attended_tokens() (the vLLM plugin's dense_below and attend).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvscore/block_sparse/options.hpp"
#include "kvscore/block_sparse/selector.hpp"
#include "kvscore/core/dtype.hpp"
#include "kvscore/paged.hpp"

namespace kvscore {

/// Blocks a decode step of a sequence of `tokens` attends sparsely: attended_blocks(), or 0 when
/// it decodes densely (shorter than `dense_below` tokens, or attending every block anyway).
inline std::int64_t sparse_attend(std::int64_t tokens, std::int64_t block_size, double attend,
                                  std::int64_t dense_below = kDefaultDenseBelow, const BlockSparseOptions& opt = {}) {
  if (dense_below < 0)
    detail::throw_invalid("kvscore::sparse_attend: dense_below must be >= 0 (got " + std::to_string(dense_below) + ")");
  const std::int64_t a = attended_blocks(tokens, block_size, attend, opt);
  return tokens < dense_below || a >= blocks_for(tokens, block_size) ? 0 : a;
}

/// The sequence length the attention kernel sees for a row of `tokens` that attends `attend`
/// blocks: attend − 1 whole blocks and the last (maybe partial) one.
inline std::int64_t attended_tokens(std::int64_t tokens, std::int64_t block_size, std::int64_t attend) noexcept {
  return (attend - 1) * block_size + (tokens - (blocks_for(tokens, block_size) - 1) * block_size);
}

/// The layout of one layer's key cache.
enum class KeyCacheLayout {
  vllm_cpu,  ///< vLLM CPU's [num_blocks, kv_heads, block_size, 2 * head_dim], keys transposed (TransposedPagedKeysView)
  vllm_cpu_amx,  ///< the same tensor, keys AMX-packed (vLLM's ISA amx, bf16: AmxPagedKeysView)
  nhd,       ///< [num_blocks, block_size, kv_heads, head_dim]
  hnd,       ///< [num_blocks, kv_heads, block_size, head_dim]
};

/// The KeyCacheLayout of a vLLM CPU layer whose keys vllm_cpu_key_layout() reads.
constexpr KeyCacheLayout key_cache_layout(VllmCpuKeyLayout l) noexcept {
  return l == VllmCpuKeyLayout::amx ? KeyCacheLayout::vllm_cpu_amx : KeyCacheLayout::vllm_cpu;
}

/// One layer's key cache, type-erased (element type, layout, shape): registered once, viewed in
/// place by each call.
struct KeyCache {
  dtype dt = dtype::f32;
  KeyCacheLayout layout = KeyCacheLayout::vllm_cpu;
  const void* data = nullptr;
  std::int64_t num_blocks = 0, kv_heads = 0, block_size = 0, head_dim = 0;
};

/// f(view) with `c` as its paged view (over an empty table: only the pool is read).
template <class F>
void visit_key_cache(const KeyCache& c, F&& f) {
  static const std::vector<std::int32_t> none;
  const BlockTable t(std::span<const std::int32_t>(none), c.block_size, c.num_blocks, 0);
  visit_dtype(c.dt, [&]<class T>(std::type_identity<T>) {
    const T* p = static_cast<const T*>(c.data);
    if (c.layout == KeyCacheLayout::vllm_cpu) f(TransposedPagedKeysView<T>::vllm_cpu(p, c.kv_heads, c.head_dim, t));
    else if (c.layout == KeyCacheLayout::vllm_cpu_amx) f(AmxPagedKeysView<T>::vllm_cpu(p, c.kv_heads, c.head_dim, t));
    else if (c.layout == KeyCacheLayout::nhd) f(PagedKeysView<T>::nhd(p, c.kv_heads, c.head_dim, t));
    else f(PagedKeysView<T>::hnd(p, c.kv_heads, c.head_dim, t));
  });
}

/// One layer's queries of a step: [tokens][heads][head_dim] of any element type, the strides in
/// elements (a torch tensor's).
struct QueryTensor {
  dtype dt = dtype::f32;
  const void* data = nullptr;
  std::int64_t tokens = 0, heads = 0, head_dim = 0;
  std::int64_t stride[3] = {0, 0, 1};
};

/// A step's block table: `rows` rows of `cols` int32 ids, row r at data + r·stride (vLLM's
/// [num_reqs, max_blocks], evicted holes removed). `dst` tables are the same, writable.
template <class Id>
struct BlockTableRowsOf {
  Id* data = nullptr;
  std::int64_t rows = 0, cols = 0, stride = 0;
  Id* row(std::int64_t r) const noexcept { return data + r * stride; }
};
using BlockTableRows = BlockTableRowsOf<const std::int32_t>;
using MutableBlockTableRows = BlockTableRowsOf<std::int32_t>;

class BlockSparsePlanner {
 public:
  BlockSparsePlanner(std::int64_t layers, std::int64_t num_blocks, std::int64_t kv_heads, std::int64_t head_dim,
                     std::int64_t block_size, const BlockSparseOptions& opt = {})
      : sel_(layers, num_blocks, kv_heads, head_dim, block_size, opt) {}

  PagedBlockSelector& selector() noexcept { return sel_; }
  const PagedBlockSelector& selector() const noexcept { return sel_; }

  /// Every layer's cache, in layer order, once (an engine's caches do not move); each is
  /// checked against the selector's shape here.
  void register_caches(std::vector<KeyCache> caches) {
    if (std::int64_t(caches.size()) != sel_.layers())
      detail::throw_invalid("caches: " + std::to_string(caches.size()) + " given, the selector has " +
                            std::to_string(sel_.layers()) + " layers");
    for (std::size_t l = 0; l < caches.size(); ++l) check_cache(caches[l], "caches[" + std::to_string(l) + "]");
    caches_ = std::move(caches);
  }
  bool registered() const noexcept { return !caches_.empty(); }

  /// The selector's begin_step (both arguments required); the last step's plan goes.
  void begin_step(std::span<const std::int64_t> slots, std::span<const std::int64_t> live) {
    plan_ = Plan{};
    sel_.begin_step(slots, live);
  }

  /// The step's decode rows (after begin_step): rows `rows[i]` of `src`, each row's query token
  /// (its index in a layer's queries), length and blocks to attend; every layer's choice is
  /// written into the same rows of `dst` (the rest of dst is never written). src and dst must
  /// outlive the step. `seqs`: each row's sequence key (BlockSparseRow::seq; the keys begin_step's
  /// `live` named), or empty: each row's first block (sequences that share no block).
  void plan(std::span<const std::int64_t> token_index, BlockTableRows src, std::span<const std::int64_t> rows,
            std::span<const std::int64_t> tokens, std::span<const std::int64_t> attend, MutableBlockTableRows dst,
            std::span<const std::int64_t> seqs = {}) {
    if (dst.rows < src.rows || dst.cols < src.cols)
      detail::throw_invalid("dst: shape (" + std::to_string(dst.rows) + ", " + std::to_string(dst.cols) +
                            ") is smaller than src's (" + std::to_string(src.rows) + ", " + std::to_string(src.cols) + ")");
    if (token_index.size() != rows.size() || tokens.size() != rows.size() || attend.size() != rows.size())
      detail::throw_invalid("token_index, rows, tokens and attend must have one entry per decode row (" +
                            std::to_string(rows.size()) + ")");
    if (!seqs.empty() && seqs.size() != rows.size())
      detail::throw_invalid("seqs: " + std::to_string(seqs.size()) + " entries, one per decode row (" +
                            std::to_string(rows.size()) + ") or none");
    for (std::size_t i = 0; i < seqs.size(); ++i)
      if (seqs[i] < 0)
        detail::throw_invalid("seqs[" + std::to_string(i) + "] = " + std::to_string(seqs[i]) + " must be >= 0");
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (rows[i] < 0 || rows[i] >= src.rows)
        detail::throw_invalid("rows[" + std::to_string(i) + "] = " + std::to_string(rows[i]) + " out of range [0, " +
                              std::to_string(src.rows) + ")");
      if (attend[i] > src.cols)
        detail::throw_invalid("attend[" + std::to_string(i) + "] = " + std::to_string(attend[i]) +
                              " is more than a table row holds");
    }
    Plan p;
    p.src = src;
    p.dst = dst;
    p.token_index.assign(token_index.begin(), token_index.end());
    p.rows.assign(rows.begin(), rows.end());
    p.tokens.assign(tokens.begin(), tokens.end());
    p.attend.assign(attend.begin(), attend.end());
    p.seqs.assign(seqs.begin(), seqs.end());
    p.set = true;
    plan_ = std::move(p);
  }
  bool planned() const noexcept { return plan_.set; }

  /// One layer of the planned step on its registered cache: returns how many rows were scored
  /// (the others' kept choices stood); fresh() has the per-row flags.
  std::int64_t select_planned(std::int64_t layer, const QueryTensor& query) {
    if (layer < 0 || std::size_t(layer) >= caches_.size())
      detail::throw_invalid("select_planned: layer " + std::to_string(layer) + " has no registered cache (" +
                            std::to_string(caches_.size()) + " registered)");
    return select_planned(layer, caches_[std::size_t(layer)], query);
  }
  /// The same on a cache given with the call.
  std::int64_t select_planned(std::int64_t layer, const KeyCache& cache, const QueryTensor& query) {
    check_cache(cache, "kv_cache");
    std::int64_t scored = 0;
    visit_key_cache(cache, [&](const auto& v) { scored = select_planned_view(layer, v, query); });
    return scored;
  }
  /// The same on any paged view of the layer's pool.
  template <class View>
  std::int64_t select_planned_view(std::int64_t layer, const View& keys, const QueryTensor& query) {
    if (!plan_.set) detail::throw_invalid("select_planned: no plan for this step (plan() after begin_step())");
    gather(query);
    sel_.select(layer, keys, query.heads, rows_);
    std::int64_t scored = 0;
    for (const std::uint8_t f : fresh_) scored += f;
    return scored;
  }

  /// The last call's per planned row: 1 when scored, 0 when its kept choice stood.
  std::span<const std::uint8_t> fresh() const noexcept { return fresh_; }

 private:
  struct Plan {
    bool set = false;
    BlockTableRows src;
    MutableBlockTableRows dst;
    std::vector<std::int64_t> token_index, rows, tokens, attend, seqs;
  };

  void check_cache(const KeyCache& c, const std::string& what) const {
    if (c.data == nullptr) detail::throw_invalid(what + ": no data");
    if (c.kv_heads != sel_.kv_heads() || c.head_dim != sel_.head_dim() || c.block_size != sel_.block_size() ||
        c.num_blocks != sel_.num_blocks())
      detail::throw_invalid(what + ": (kv_heads, head_dim, block_size, num_blocks) = (" + std::to_string(c.kv_heads) +
                            ", " + std::to_string(c.head_dim) + ", " + std::to_string(c.block_size) + ", " +
                            std::to_string(c.num_blocks) + ") differ from the selector's (" +
                            std::to_string(sel_.kv_heads()) + ", " + std::to_string(sel_.head_dim()) + ", " +
                            std::to_string(sel_.block_size()) + ", " + std::to_string(sel_.num_blocks()) + ")");
  }

  /// Each planned row's query as fp32 [heads][head_dim], and the selector's rows over them.
  void gather(const QueryTensor& q) {
    const Plan& p = plan_;
    if (q.head_dim != sel_.head_dim())
      detail::throw_invalid("query: head_dim " + std::to_string(q.head_dim) + " differs from the cache's " +
                            std::to_string(sel_.head_dim()));
    for (std::size_t i = 0; i < p.rows.size(); ++i)
      if (p.token_index[i] < 0 || p.token_index[i] >= q.tokens)
        detail::throw_invalid("token_index[" + std::to_string(i) + "] = " + std::to_string(p.token_index[i]) +
                              " out of range [0, " + std::to_string(q.tokens) + ")");
    const std::int64_t n = q.heads * q.head_dim;
    q_.resize(p.rows.size() * std::size_t(n));
    visit_dtype(q.dt, [&]<class T>(std::type_identity<T>) {
      const T* base = static_cast<const T*>(q.data);
      for (std::size_t i = 0; i < p.rows.size(); ++i)
        for (std::int64_t h = 0; h < q.heads; ++h)
          for (std::int64_t j = 0; j < q.head_dim; ++j)
            q_[i * std::size_t(n) + std::size_t(h * q.head_dim + j)] =
                to_float(base[p.token_index[i] * q.stride[0] + h * q.stride[1] + j * q.stride[2]]);
    });
    fresh_.assign(p.rows.size(), 0);
    rows_.resize(p.rows.size());
    for (std::size_t i = 0; i < p.rows.size(); ++i)
      rows_[i] = {std::span<const std::int32_t>(p.src.row(p.rows[i]), std::size_t(p.src.cols)), p.tokens[i],
                  q_.data() + i * std::size_t(n), p.attend[i], p.dst.row(p.rows[i]), fresh_.data() + i,
                  p.seqs.empty() ? std::int64_t(-1) : p.seqs[i]};
  }

  PagedBlockSelector sel_;
  Plan plan_;
  std::vector<KeyCache> caches_;
  std::vector<float> q_;  // reused between calls
  std::vector<BlockSparseRow> rows_;
  std::vector<std::uint8_t> fresh_;
};

}  // namespace kvscore
