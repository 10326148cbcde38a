// kvscore/paged.hpp — views over paged KV caches (vLLM-style block tables).
//
// The physical cache of one layer is a pool of `num_blocks` blocks of `block_size` token rows
// for every kv head; one sequence owns the blocks listed in its block table, in logical order:
// token t of the sequence lives in physical block block_table[t / block_size], at row
// t % block_size of that block. The views here are non-owning (neither the pool nor the block
// table is copied; both must outlive the view) and validated on construction.
//
//   NHD  [num_blocks, block_size, kv_heads, head_dim]   (vLLM FlashAttention, SGLang pages)
//   HND  [num_blocks, kv_heads, block_size, head_dim]   (vLLM FlashInfer HND, TensorRT-LLM blocks)
//   any other nesting through the general constructor (block, head and token strides).
//   vLLM CPU [num_blocks, kv_heads, block_size, 2 * head_dim] with the keys of each (block, head)
//   stored transposed, [head_dim][block_size]: TransposedPagedKeysView (layout "vllm_cpu", ISAs
//   vec/vec16); the same tensor with the keys packed for AMX (ISA amx, bf16): AmxPagedKeysView;
//   vllm_cpu_key_layout(isa, dtype) says which a layer's ISA wrote.
//
// Scorers read a PagedKeysView through for_each_run (one call per run of evenly strided rows;
// runs end at block boundaries unless the next block happens to follow in memory).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvscore/detail/selection_check.hpp"
#include "kvscore/core/dtype.hpp"
#include "kvscore/core/selection.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore {

/// Where one token row of a sequence lives in the paged pool.
struct PhysicalSlot {
  std::int64_t block = 0;   ///< physical block id, in [0, num_blocks)
  std::int64_t offset = 0;  ///< row inside the block, in [0, block_size)

  /// vLLM's flat slot index (`slot_mapping`): block * block_size + offset.
  constexpr std::int64_t linear(std::int64_t block_size) const noexcept { return block * block_size + offset; }
  friend constexpr bool operator==(const PhysicalSlot&, const PhysicalSlot&) = default;
};

/// Number of blocks of `block_size` rows that hold `tokens` rows: ceil(tokens / block_size).
constexpr std::int64_t blocks_for(std::int64_t tokens, std::int64_t block_size) noexcept {
  return tokens <= 0 ? 0 : (tokens + block_size - 1) / block_size;
}

/// One sequence's block table: logical block i -> physical block id. Non-owning; int32 (vLLM)
/// or int64 ids. Only the first blocks_for(tokens, block_size) entries are read (vLLM pads its
/// rows to max_blocks_per_seq); each of them must be in [0, num_blocks).
class BlockTable {
 public:
  BlockTable() = default;
  BlockTable(std::span<const std::int32_t> block_ids, std::int64_t block_size, std::int64_t num_blocks,
             std::int64_t tokens)
      : ids32_(block_ids.data()) {
    init(block_ids, block_size, num_blocks, tokens);
  }
  BlockTable(std::span<const std::int64_t> block_ids, std::int64_t block_size, std::int64_t num_blocks,
             std::int64_t tokens)
      : ids64_(block_ids.data()) {
    init(block_ids, block_size, num_blocks, tokens);
  }

  std::int64_t block_size() const noexcept { return bs_; }
  std::int64_t num_blocks() const noexcept { return num_blocks_; }
  std::int64_t tokens() const noexcept { return tokens_; }
  /// Entries of the table in use: blocks_for(tokens, block_size).
  std::int64_t blocks_used() const noexcept { return blocks_for(tokens_, bs_); }
  bool int64_ids() const noexcept { return ids64_ != nullptr; }

  /// Physical id of logical block i (i < blocks_used(); not checked).
  std::int64_t block(std::int64_t i) const noexcept {
    return ids64_ != nullptr ? ids64_[i] : std::int64_t(ids32_[i]);
  }
  /// Physical slot of token t (t < tokens(); not checked).
  PhysicalSlot slot(std::int64_t t) const noexcept { return {block(t / bs_), t % bs_}; }

  /// Logical index of the first entry in use that repeats an earlier one, or -1 when the
  /// blocks in use are pairwise distinct (required to compact in place). O(n log n).
  std::int64_t first_repeated_block() const {
    const std::int64_t n = blocks_used();
    std::vector<std::pair<std::int64_t, std::int64_t>> ids(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) ids[std::size_t(i)] = {block(i), i};
    std::sort(ids.begin(), ids.end());
    std::int64_t first = -1;
    for (std::size_t i = 1; i < ids.size(); ++i)
      if (ids[i].first == ids[i - 1].first && (first < 0 || ids[i].second < first)) first = ids[i].second;
    return first;
  }

 private:
  template <class I>
  void init(std::span<const I> ids, std::int64_t block_size, std::int64_t num_blocks, std::int64_t tokens) {
    const std::string ctx = "kvscore::BlockTable";
    if (block_size <= 0)
      detail::throw_invalid(ctx + ": block_size must be > 0 (got " + std::to_string(block_size) + ")");
    if (num_blocks < 0)
      detail::throw_invalid(ctx + ": num_blocks must be >= 0 (got " + std::to_string(num_blocks) + ")");
    if (tokens < 0) detail::throw_invalid(ctx + ": tokens must be >= 0 (got " + std::to_string(tokens) + ")");
    const std::int64_t need = blocks_for(tokens, block_size);
    if (std::int64_t(ids.size()) < need)
      detail::throw_invalid(ctx + ": the block table has " + std::to_string(ids.size()) + " entries but " +
                            std::to_string(tokens) + " tokens need " + std::to_string(need) + " blocks of " +
                            std::to_string(block_size));
    for (std::int64_t i = 0; i < need; ++i) {
      const std::int64_t b = std::int64_t(ids[std::size_t(i)]);
      if (b < 0 || b >= num_blocks)
        detail::throw_invalid(ctx + ": block_table[" + std::to_string(i) + "] = " + std::to_string(b) +
                              " out of range [0, " + std::to_string(num_blocks) + ")");
    }
    bs_ = block_size;
    num_blocks_ = num_blocks;
    tokens_ = tokens;
  }

  const std::int32_t* ids32_ = nullptr;
  const std::int64_t* ids64_ = nullptr;
  std::int64_t bs_ = 1, num_blocks_ = 0, tokens_ = 0;
};

/// Memory order of a block: NHD = [block_size, kv_heads, head_dim], HND = [kv_heads, block_size, head_dim].
enum class PagedLayout { nhd, hnd };

namespace detail {

// Rows (b, h, o) occupy [b*bst + h*hs + o*ts, +d). Disjoint when the three strides nest (as in
// check_strides: sorted by stride, ignoring extents of 1, each covers the span inside it).
inline void check_paged_strides(const std::string& ctx, std::int64_t num_blocks, std::int64_t heads,
                                std::int64_t block_size, std::int64_t d, std::int64_t bst, std::int64_t hs,
                                std::int64_t ts) {
  struct Dim { std::int64_t stride, extent; const char* name; };
  Dim dims[3] = {{ts, block_size, "token_stride"}, {hs, heads, "head_stride"}, {bst, num_blocks, "block_stride"}};
  for (const Dim& dim : dims)
    if (dim.stride < 0)
      throw_invalid(ctx + ": " + dim.name + " must be >= 0 (got " + std::to_string(dim.stride) + ")");
  if (num_blocks == 0 || heads == 0) return;
  std::sort(std::begin(dims), std::end(dims), [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  std::int64_t span = d;
  for (const Dim& dim : dims) {
    if (dim.extent <= 1) continue;
    if (dim.stride < span)
      throw_invalid(ctx + ": " + dim.name + " " + std::to_string(dim.stride) + " makes rows overlap (needs >= " +
                    std::to_string(span) + ")");
    span = checked_add(checked_mul(dim.stride, dim.extent - 1, ctx.c_str()), span, ctx.c_str());
  }
}

/// heads >= 0, head_dim in [1, kMaxHeadDim], data present when there is a row to read.
inline void check_paged_view_args(const std::string& ctx, bool has_data, std::int64_t heads, std::int64_t head_dim,
                                  std::int64_t tokens) {
  if (heads < 0) throw_invalid(ctx + ": heads must be >= 0 (got " + std::to_string(heads) + ")");
  if (head_dim <= 0 || head_dim > kMaxHeadDim)
    throw_invalid(ctx + ": head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " +
                  std::to_string(head_dim) + ")");
  if (!has_data && heads > 0 && tokens > 0)
    throw_invalid(ctx + ": data is null but the view has " + std::to_string(heads) + " heads x " +
                  std::to_string(tokens) + " tokens");
}

}  // namespace detail

// The class preamble below (element check, value_type, default constructor, general form)
// mirrors KeysView's in view.hpp on purpose: a paged view is a drop-in for a strided one.
/// Read-only view of one sequence's keys (or values) in a paged pool: heads x tokens x head_dim.
/// Row (h, t) is at data + block(t / bs) * block_stride + h * head_stride + (t % bs) * token_stride.
template <class T>
class PagedKeysView {
  static_assert(is_element_type_v<T>, "PagedKeysView<T>: T must be float, kvscore::half or kvscore::bfloat16");

 public:
  using value_type = T;

  PagedKeysView() = default;

  /// General form. `data` is the start of the pool (block 0); the pool holds table.num_blocks() blocks.
  PagedKeysView(const T* data, const BlockTable& table, std::int64_t heads, std::int64_t head_dim,
                std::int64_t block_stride, std::int64_t head_stride, std::int64_t token_stride)
      : data_(data), table_(table), heads_(heads), dim_(head_dim), bst_(block_stride), hs_(head_stride),
        ts_(token_stride) {
    const std::string ctx = "kvscore::PagedKeysView";
    detail::check_paged_view_args(ctx, data != nullptr, heads, head_dim, table.tokens());
    detail::check_paged_strides(ctx, table.num_blocks(), heads, table.block_size(), head_dim, block_stride,
                                head_stride, token_stride);
    // With one row per block the token stride is free: take the block stride, so that rows of
    // consecutive block ids form a single run (SGLang's slot pool viewed with block_size 1).
    if (table.block_size() == 1) ts_ = bst_;
  }

  /// Pool [num_blocks, block_size, kv_heads, head_dim] (C order).
  static PagedKeysView nhd(const T* pool, std::int64_t kv_heads, std::int64_t head_dim, const BlockTable& table) {
    return make(pool, kv_heads, head_dim, table, PagedLayout::nhd);
  }
  /// Pool [num_blocks, kv_heads, block_size, head_dim] (C order).
  static PagedKeysView hnd(const T* pool, std::int64_t kv_heads, std::int64_t head_dim, const BlockTable& table) {
    return make(pool, kv_heads, head_dim, table, PagedLayout::hnd);
  }
  /// Either layout, from the raw block table (int32 or int64 ids) and the sequence length.
  static PagedKeysView paged(const T* pool, PagedLayout layout, std::int64_t num_blocks, std::int64_t block_size,
                             std::int64_t kv_heads, std::int64_t head_dim, std::span<const std::int32_t> block_table,
                             std::int64_t seq_len) {
    return make(pool, kv_heads, head_dim, BlockTable(block_table, block_size, num_blocks, seq_len), layout);
  }
  static PagedKeysView paged(const T* pool, PagedLayout layout, std::int64_t num_blocks, std::int64_t block_size,
                             std::int64_t kv_heads, std::int64_t head_dim, std::span<const std::int64_t> block_table,
                             std::int64_t seq_len) {
    return make(pool, kv_heads, head_dim, BlockTable(block_table, block_size, num_blocks, seq_len), layout);
  }

  const T* data() const noexcept { return data_; }
  const BlockTable& table() const noexcept { return table_; }
  std::int64_t heads() const noexcept { return heads_; }
  std::int64_t tokens() const noexcept { return table_.tokens(); }
  std::int64_t head_dim() const noexcept { return dim_; }
  std::int64_t block_size() const noexcept { return table_.block_size(); }
  std::int64_t num_blocks() const noexcept { return table_.num_blocks(); }
  std::int64_t block_stride() const noexcept { return bst_; }
  std::int64_t head_stride() const noexcept { return hs_; }
  /// Stride between consecutive rows of one block (equal to block_stride() when block_size is 1).
  std::int64_t token_stride() const noexcept { return ts_; }
  bool empty() const noexcept { return heads_ == 0 || tokens() == 0; }

  /// Physical slot of token t.
  PhysicalSlot slot(std::int64_t t) const noexcept { return table_.slot(t); }
  /// Row of head h, token t (not checked).
  const T* row(std::int64_t h, std::int64_t t) const noexcept { return data_ + offset(h, t); }

  /// Calls f(const T* first_row, std::int64_t t0, std::int64_t n, std::int64_t token_stride) for the maximal
  /// runs of token rows of head h that are evenly strided in memory, in token order, covering [0, tokens()).
  /// One run per block (the last one partial), except that a block that starts exactly one token
  /// stride after the previous block's last row extends that run (consecutive NHD block ids).
  template <class F>
  void for_each_run(std::int64_t h, F&& f) const {
    const std::int64_t n_tok = table_.tokens(), bs = table_.block_size();
    if (n_tok == 0) return;
    const std::int64_t head_off = h * hs_;
    std::int64_t run_off = table_.block(0) * bst_ + head_off, run_t0 = 0, run_n = std::min(bs, n_tok);
    for (std::int64_t i = 1, t0 = bs; t0 < n_tok; ++i, t0 += bs) {
      const std::int64_t off = table_.block(i) * bst_ + head_off, n = std::min(bs, n_tok - t0);
      if (off == run_off + run_n * ts_) {
        run_n += n;
        continue;
      }
      f(data_ + run_off, run_t0, run_n, ts_);
      run_off = off;
      run_t0 = t0;
      run_n = n;
    }
    f(data_ + run_off, run_t0, run_n, ts_);
  }

 private:
  static PagedKeysView make(const T* pool, std::int64_t kv_heads, std::int64_t head_dim, const BlockTable& table,
                            PagedLayout layout) {
    const char* ctx = "kvscore::PagedKeysView";
    const std::int64_t bs = table.block_size();
    const std::int64_t row = detail::checked_mul(std::max<std::int64_t>(kv_heads, 0), head_dim, ctx);
    const std::int64_t block = detail::checked_mul(row, bs, ctx);
    if (layout == PagedLayout::nhd) return PagedKeysView(pool, table, kv_heads, head_dim, block, head_dim, row);
    return PagedKeysView(pool, table, kv_heads, head_dim, block, detail::checked_mul(bs, head_dim, ctx), head_dim);
  }

  std::int64_t offset(std::int64_t h, std::int64_t t) const noexcept {
    const std::int64_t bs = table_.block_size();
    return table_.block(t / bs) * bst_ + h * hs_ + (t % bs) * ts_;
  }

  const T* data_ = nullptr;
  BlockTable table_;
  std::int64_t heads_ = 0, dim_ = 1, bst_ = 0, hs_ = 0, ts_ = 0;
};

/// Mutable paged view (for kvscore::compact): the same geometry and checks as PagedKeysView,
/// over memory the caller may write.
template <class T>
class MutPagedKeysView {
 public:
  using value_type = T;

  MutPagedKeysView() = default;
  MutPagedKeysView(T* data, const BlockTable& table, std::int64_t heads, std::int64_t head_dim,
                   std::int64_t block_stride, std::int64_t head_stride, std::int64_t token_stride)
      : view_(data, table, heads, head_dim, block_stride, head_stride, token_stride), data_(data) {}
  static MutPagedKeysView nhd(T* pool, std::int64_t kv_heads, std::int64_t head_dim, const BlockTable& table) {
    return MutPagedKeysView(PagedKeysView<T>::nhd(pool, kv_heads, head_dim, table), pool);
  }
  static MutPagedKeysView hnd(T* pool, std::int64_t kv_heads, std::int64_t head_dim, const BlockTable& table) {
    return MutPagedKeysView(PagedKeysView<T>::hnd(pool, kv_heads, head_dim, table), pool);
  }
  static MutPagedKeysView paged(T* pool, PagedLayout layout, std::int64_t num_blocks, std::int64_t block_size,
                                std::int64_t kv_heads, std::int64_t head_dim,
                                std::span<const std::int32_t> block_table, std::int64_t seq_len) {
    return MutPagedKeysView(
        PagedKeysView<T>::paged(pool, layout, num_blocks, block_size, kv_heads, head_dim, block_table, seq_len), pool);
  }
  static MutPagedKeysView paged(T* pool, PagedLayout layout, std::int64_t num_blocks, std::int64_t block_size,
                                std::int64_t kv_heads, std::int64_t head_dim,
                                std::span<const std::int64_t> block_table, std::int64_t seq_len) {
    return MutPagedKeysView(
        PagedKeysView<T>::paged(pool, layout, num_blocks, block_size, kv_heads, head_dim, block_table, seq_len), pool);
  }

  /// The read-only view (to score it).
  const PagedKeysView<T>& view() const noexcept { return view_; }
  T* data() const noexcept { return data_; }
  const BlockTable& table() const noexcept { return view_.table(); }
  std::int64_t heads() const noexcept { return view_.heads(); }
  std::int64_t tokens() const noexcept { return view_.tokens(); }
  std::int64_t head_dim() const noexcept { return view_.head_dim(); }
  std::int64_t block_size() const noexcept { return view_.block_size(); }
  bool empty() const noexcept { return view_.empty(); }
  PhysicalSlot slot(std::int64_t t) const noexcept { return view_.slot(t); }
  T* row(std::int64_t h, std::int64_t t) const noexcept { return data_ + (view_.row(h, t) - view_.data()); }
  template <class F>
  void for_each_run(std::int64_t h, F&& f) const {
    view_.for_each_run(h, std::forward<F>(f));
  }

 private:
  MutPagedKeysView(const PagedKeysView<T>& v, T* data) : view_(v), data_(data) {}
  PagedKeysView<T> view_;
  T* data_ = nullptr;
};

/// vLLM's CPU attention backend (vLLM 0.32, vllm/v1/attention/backends/cpu_attn.py, ISAs "vec"
/// and "vec16"): one layer's cache is [num_blocks, kv_heads, block_size, 2 * head_dim]; each
/// (block, head) holds block_size * head_dim key elements followed by as many value elements,
/// and the keys are stored TRANSPOSED: element j of the key of row o is at
/// data + block * block_stride + h * head_stride + j * block_size + o. (Checked against
/// vLLM's own cpu_attn_reshape_and_cache: python/tests_vllm/test_layout.py.)
///
/// A key row is therefore not contiguous. The view gives scorers contiguous rows all the same:
/// for_each_run transposes one block of one head (block_size x head_dim elements, in T, bit
/// for bit) into a scratch buffer of its own and calls f(buffer, t0, n, head_dim) with it; the
/// pointer is valid only during that call (every scorer reads a run inside its callback).
/// Nothing else is copied: the cache is read in place, a block at a time. (The class preamble
/// mirrors PagedKeysView's on purpose: a drop-in view.)
template <class T>
class TransposedPagedKeysView {
  static_assert(is_element_type_v<T>, "TransposedPagedKeysView<T>: T must be float, kvscore::half or kvscore::bfloat16");

 public:
  using value_type = T;

  TransposedPagedKeysView() = default;

  /// General form: the (block, head) key tiles [head_dim][block_size] at data + block *
  /// block_stride + h * head_stride. The tiles of different (block, head) must not overlap.
  TransposedPagedKeysView(const T* data, const BlockTable& table, std::int64_t heads, std::int64_t head_dim,
                          std::int64_t block_stride, std::int64_t head_stride)
      : data_(data), table_(table), heads_(heads), dim_(head_dim), bst_(block_stride), hs_(head_stride) {
    const std::string ctx = "kvscore::TransposedPagedKeysView";
    detail::check_paged_view_args(ctx, data != nullptr, heads, head_dim, table.tokens());
    // A tile is one "row" of head_dim * block_size elements; tiles nest like rows of a paged view
    // whose blocks hold one row per head.
    detail::check_paged_strides(ctx, table.num_blocks(), heads, 1,
                                detail::checked_mul(head_dim, table.block_size(), ctx.c_str()), block_stride,
                                head_stride, 0);
  }

  /// vLLM CPU: one layer's cache tensor [num_blocks, kv_heads, block_size, 2 * head_dim] (C order).
  static TransposedPagedKeysView vllm_cpu(const T* kv_cache, std::int64_t kv_heads, std::int64_t head_dim,
                                          const BlockTable& table) {
    const char* ctx = "kvscore::TransposedPagedKeysView";
    const std::int64_t tile = detail::checked_mul(detail::checked_mul(2, head_dim, ctx), table.block_size(), ctx);
    return TransposedPagedKeysView(kv_cache, table, kv_heads, head_dim,
                                   detail::checked_mul(std::max<std::int64_t>(kv_heads, 0), tile, ctx), tile);
  }

  const T* data() const noexcept { return data_; }
  const BlockTable& table() const noexcept { return table_; }
  std::int64_t heads() const noexcept { return heads_; }
  std::int64_t tokens() const noexcept { return table_.tokens(); }
  std::int64_t head_dim() const noexcept { return dim_; }
  std::int64_t block_size() const noexcept { return table_.block_size(); }
  std::int64_t num_blocks() const noexcept { return table_.num_blocks(); }
  std::int64_t block_stride() const noexcept { return bst_; }
  std::int64_t head_stride() const noexcept { return hs_; }
  bool empty() const noexcept { return heads_ == 0 || tokens() == 0; }
  PhysicalSlot slot(std::int64_t t) const noexcept { return table_.slot(t); }

  /// Element j of the key of head h, token t (not checked).
  T at(std::int64_t h, std::int64_t t, std::int64_t j) const noexcept {
    const std::int64_t bs = table_.block_size();
    return data_[table_.block(t / bs) * bst_ + h * hs_ + j * bs + t % bs];
  }

  /// Calls f(const T* rows, t0, n, head_dim) once per block of head h, in token order, with the
  /// block's n key rows transposed into a contiguous [n][head_dim] buffer (valid during the call).
  template <class F>
  void for_each_run(std::int64_t h, F&& f) const {
    const std::int64_t n_tok = table_.tokens(), bs = table_.block_size();
    if (n_tok == 0) return;
    std::vector<T> buf(static_cast<std::size_t>(std::min(bs, n_tok) * dim_));
    for (std::int64_t i = 0, t0 = 0; t0 < n_tok; ++i, t0 += bs) {
      const std::int64_t n = std::min(bs, n_tok - t0);
      const T* tile = data_ + table_.block(i) * bst_ + h * hs_;
      for (std::int64_t j = 0; j < dim_; ++j) {
        const T* col = tile + j * bs;
        for (std::int64_t o = 0; o < n; ++o) buf[std::size_t(o * dim_ + j)] = col[o];
      }
      f(static_cast<const T*>(buf.data()), t0, n, dim_);
    }
  }

 private:
  const T* data_ = nullptr;
  BlockTable table_;
  std::int64_t heads_ = 0, dim_ = 1, bst_ = 0, hs_ = 0;
};

/// vLLM's CPU attention backend, ISA "amx" (vLLM 0.32 picks it for bf16 caches on CPUs with AMX
/// tiles when the block size is a multiple of 32; csrc/cpu/cpu_attn_amx.hpp, reshape_and_cache):
/// the same [num_blocks, kv_heads, block_size, 2 * head_dim] tensor and the same (block, head)
/// tiles of block_size * head_dim key elements followed by the values, but the keys are packed
/// for AMX's B matrices: in groups of 16 tokens (one 64-byte tile row holds 16 four-byte
/// "quadwords"), each group [head_dim / P][16][P] with P = 4 / sizeof(T) elements per quadword
/// (2 for bf16 and fp16, 1 for fp32). Element j of the key of row o is at
///   tile + (o / 16) * 16 * head_dim + (j / P) * 16 * P + (o % 16) * P + j % P.
/// (vLLM writes this layout for every dtype through cpu_attn_reshape_and_cache(..., "amx"), but
/// its attention kernel only runs it for bf16. Checked against that op:
/// python/tests_vllm/test_layout.py.) Requires block_size % 16 == 0 and head_dim % P == 0.
///
/// for_each_run unpacks one block of one head into a scratch buffer (T, bit for bit) and calls
/// f(buffer, t0, n, head_dim), as TransposedPagedKeysView does; the pointer is valid only during
/// that call.
template <class T>
class AmxPagedKeysView {
  static_assert(is_element_type_v<T>, "AmxPagedKeysView<T>: T must be float, kvscore::half or kvscore::bfloat16");

 public:
  using value_type = T;
  /// Tokens per packed group (a 64-byte AMX tile row of 4-byte quadwords).
  static constexpr std::int64_t kGroup = 16;
  /// Elements per quadword: 4 / sizeof(T).
  static constexpr std::int64_t kPack = std::int64_t(4 / sizeof(T));

  AmxPagedKeysView() = default;

  /// General form: the (block, head) key tiles at data + block * block_stride + h * head_stride,
  /// each block_size * head_dim elements packed as above. The tiles must not overlap.
  AmxPagedKeysView(const T* data, const BlockTable& table, std::int64_t heads, std::int64_t head_dim,
                   std::int64_t block_stride, std::int64_t head_stride)
      : data_(data), table_(table), heads_(heads), dim_(head_dim), bst_(block_stride), hs_(head_stride) {
    const std::string ctx = "kvscore::AmxPagedKeysView";
    detail::check_paged_view_args(ctx, data != nullptr, heads, head_dim, table.tokens());
    if (table.block_size() % kGroup != 0)
      detail::throw_invalid(ctx + ": block_size must be a multiple of " + std::to_string(kGroup) + " (got " +
                            std::to_string(table.block_size()) + ")");
    if (head_dim % kPack != 0)
      detail::throw_invalid(ctx + ": head_dim must be a multiple of " + std::to_string(kPack) + " for " +
                            std::to_string(sizeof(T)) + "-byte elements (got " + std::to_string(head_dim) + ")");
    detail::check_paged_strides(ctx, table.num_blocks(), heads, 1,
                                detail::checked_mul(head_dim, table.block_size(), ctx.c_str()), block_stride,
                                head_stride, 0);
  }

  /// vLLM CPU, ISA "amx": one layer's cache tensor [num_blocks, kv_heads, block_size, 2 * head_dim] (C order).
  static AmxPagedKeysView vllm_cpu(const T* kv_cache, std::int64_t kv_heads, std::int64_t head_dim,
                                   const BlockTable& table) {
    const char* ctx = "kvscore::AmxPagedKeysView";
    const std::int64_t tile = detail::checked_mul(detail::checked_mul(2, head_dim, ctx), table.block_size(), ctx);
    return AmxPagedKeysView(kv_cache, table, kv_heads, head_dim,
                            detail::checked_mul(std::max<std::int64_t>(kv_heads, 0), tile, ctx), tile);
  }

  /// Offset of element j of row o inside a (block, head) key tile of a head_dim-wide cache.
  static constexpr std::int64_t tile_offset(std::int64_t o, std::int64_t j, std::int64_t head_dim) noexcept {
    return (o / kGroup) * kGroup * head_dim + (j / kPack) * kGroup * kPack + (o % kGroup) * kPack + j % kPack;
  }

  const T* data() const noexcept { return data_; }
  const BlockTable& table() const noexcept { return table_; }
  std::int64_t heads() const noexcept { return heads_; }
  std::int64_t tokens() const noexcept { return table_.tokens(); }
  std::int64_t head_dim() const noexcept { return dim_; }
  std::int64_t block_size() const noexcept { return table_.block_size(); }
  std::int64_t num_blocks() const noexcept { return table_.num_blocks(); }
  std::int64_t block_stride() const noexcept { return bst_; }
  std::int64_t head_stride() const noexcept { return hs_; }
  bool empty() const noexcept { return heads_ == 0 || tokens() == 0; }
  PhysicalSlot slot(std::int64_t t) const noexcept { return table_.slot(t); }

  /// Element j of the key of head h, token t (not checked).
  T at(std::int64_t h, std::int64_t t, std::int64_t j) const noexcept {
    const std::int64_t bs = table_.block_size();
    return data_[table_.block(t / bs) * bst_ + h * hs_ + tile_offset(t % bs, j, dim_)];
  }

  /// Calls f(const T* rows, t0, n, head_dim) once per block of head h, in token order, with the
  /// block's n key rows unpacked into a contiguous [n][head_dim] buffer (valid during the call).
  template <class F>
  void for_each_run(std::int64_t h, F&& f) const {
    const std::int64_t n_tok = table_.tokens(), bs = table_.block_size();
    if (n_tok == 0) return;
    std::vector<T> buf(static_cast<std::size_t>(std::min(bs, n_tok) * dim_));
    for (std::int64_t i = 0, t0 = 0; t0 < n_tok; ++i, t0 += bs) {
      const std::int64_t n = std::min(bs, n_tok - t0);
      const T* tile = data_ + table_.block(i) * bst_ + h * hs_;
      // a group of 16 rows is [head_dim / P][16][P]: row o's P elements of quadword q are contiguous
      for (std::int64_t g0 = 0; g0 < n; g0 += kGroup) {
        const T* group = tile + g0 * dim_;
        const std::int64_t rows = std::min(kGroup, n - g0);
        for (std::int64_t q = 0; q < dim_ / kPack; ++q) {
          const T* src = group + q * kGroup * kPack;
          for (std::int64_t r = 0; r < rows; ++r)
            for (std::int64_t p = 0; p < kPack; ++p)
              buf[std::size_t((g0 + r) * dim_ + q * kPack + p)] = src[r * kPack + p];
        }
      }
      f(static_cast<const T*>(buf.data()), t0, n, dim_);
    }
  }

 private:
  const T* data_ = nullptr;
  BlockTable table_;
  std::int64_t heads_ = 0, dim_ = 1, bst_ = 0, hs_ = 0;
};

/// The key layouts of vLLM CPU's cache ([num_blocks, kv_heads, block_size, 2 * head_dim]).
enum class VllmCpuKeyLayout {
  transposed,  ///< [head_dim][block_size] per (block, head): TransposedPagedKeysView
  amx,         ///< AMX-packed groups of 16 tokens: AmxPagedKeysView
};

/// The key layout vLLM 0.32's CPU attention ISA `isa` (a layer's `isa`, from _get_attn_isa in
/// vllm/v1/attention/backends/cpu_attn.py) stores keys of element type `dt` in: "vec" and "vec16"
/// -> transposed; "amx" -> amx; "neon" -> transposed for fp32 and fp16 (vLLM's source: "similar
/// to ISA::VEC", keys [head_dim][block_size]; not run on Arm here). Any other ISA (neon bf16's
/// BFMMLA packing, vsx, vxe, rvv) throws std::invalid_argument naming it.
inline VllmCpuKeyLayout vllm_cpu_key_layout(std::string_view isa, dtype dt) {
  if (isa == "vec" || isa == "vec16") return VllmCpuKeyLayout::transposed;
  if (isa == "amx") return VllmCpuKeyLayout::amx;
  if (isa == "neon" && dt != dtype::bf16) return VllmCpuKeyLayout::transposed;
  detail::throw_invalid("kvscore::vllm_cpu_key_layout: CPU attention ISA '" + std::string(isa) + "' with " +
                        std::string(dtype_name(dt)) +
                        " keys stores them in a layout kvscore does not read (reads vec, vec16, amx; neon for "
                        "fp32/fp16)");
}

/// f(view) with the keys of one layer of vLLM CPU's cache in `layout` (TransposedPagedKeysView or
/// AmxPagedKeysView); returns what f returns.
template <class T, class F>
decltype(auto) visit_vllm_cpu_keys(VllmCpuKeyLayout layout, const T* kv_cache, std::int64_t kv_heads,
                                   std::int64_t head_dim, const BlockTable& table, F&& f) {
  if (layout == VllmCpuKeyLayout::amx) return f(AmxPagedKeysView<T>::vllm_cpu(kv_cache, kv_heads, head_dim, table));
  return f(TransposedPagedKeysView<T>::vllm_cpu(kv_cache, kv_heads, head_dim, table));
}

/// Physical slots of the kept rows, per head (CSR like Selection): head h's kept token
/// positions[i] lives at slots[offsets[h] + i].
struct PhysicalSlots {
  std::int64_t heads = 0;
  std::int64_t block_size = 1;
  std::vector<std::int64_t> offsets{0};
  std::vector<PhysicalSlot> slots;

  std::span<const PhysicalSlot> head(std::int64_t h) const noexcept {
    return {slots.data() + offsets[std::size_t(h)],
            std::size_t(offsets[std::size_t(h + 1)] - offsets[std::size_t(h)])};
  }
  /// Head h's kept slots as vLLM flat slot indices (block * block_size + offset).
  std::vector<std::int64_t> slot_mapping(std::int64_t h) const {
    std::vector<std::int64_t> out;
    out.reserve(head(h).size());
    for (const PhysicalSlot& s : head(h)) out.push_back(s.linear(block_size));
    return out;
  }
};

/// Selection -> physical (block, offset) of every kept row. sel.tokens must equal table.tokens().
inline PhysicalSlots physical_slots(const BlockTable& table, const Selection& sel) {
  detail::require_valid_selection(sel, -1, table.tokens(), "kvscore::physical_slots");
  PhysicalSlots out;
  out.heads = sel.heads;
  out.block_size = table.block_size();
  out.offsets = sel.offsets;
  out.slots.resize(sel.positions.size());
  for (std::size_t i = 0; i < sel.positions.size(); ++i) out.slots[i] = table.slot(sel.positions[i]);
  return out;
}

/// Same, checking the selection's shape against the view (heads and tokens).
template <class T>
PhysicalSlots physical_slots(const PagedKeysView<T>& view, const Selection& sel) {
  detail::require_valid_selection(sel, view.heads(), view.tokens(), "kvscore::physical_slots");
  return physical_slots(view.table(), sel);
}

}  // namespace kvscore
