// kvscore/core/view.hpp — non-owning views over one layer's keys and over fp32 scores.
//
// A KeysView is heads x tokens x head_dim with element strides for head and token
// and an inner stride of 1 (fixed in the type, so kernels vectorise over head_dim).
// It wraps engine caches in place; a layout it cannot express is rejected with
// std::invalid_argument, never copied. MutKeysView is its writable twin (what compact() moves
// rows in).
#pragma once

#include <concepts>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvscore/core/dtype.hpp"

namespace kvscore {

/// Largest head_dim the scorers accept (the fp32 row buffers live on the stack).
inline constexpr std::int64_t kMaxHeadDim = 4096;

namespace detail {

[[noreturn]] inline void throw_invalid(const std::string& what) { throw std::invalid_argument(what); }

inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* ctx) {
  std::int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw_invalid(std::string(ctx) + ": size overflows int64");
  return r;
}
inline std::int64_t checked_add(std::int64_t a, std::int64_t b, const char* ctx) {
  std::int64_t r;
  if (__builtin_add_overflow(a, b, &r)) throw_invalid(std::string(ctx) + ": size overflows int64");
  return r;
}

/// A double as messages print it: %.17g, every bit of the value.
inline std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}

// Rows (h, t) occupy [h*hs + t*ts, +d). They are disjoint when the strides nest:
// sorted by stride (ignoring extents of 1), each stride covers the span of the
// dimensions inside it. Interleaved-but-disjoint layouts are rejected too: no
// engine uses them and accepting them would cost every kernel a check.
// Also checks that the span of the rows, in bytes (elem_size), fits int64, so every
// row pointer and every slice offset computed from the strides is free of overflow.
inline void check_strides(const char* ctx, std::int64_t heads, std::int64_t tokens, std::int64_t d,
                          std::int64_t hs, std::int64_t ts, std::int64_t elem_size = 1) {
  if (hs < 0) throw_invalid(std::string(ctx) + ": head_stride must be >= 0 (got " + std::to_string(hs) + ")");
  if (ts < 0) throw_invalid(std::string(ctx) + ": token_stride must be >= 0 (got " + std::to_string(ts) + ")");
  if (heads == 0 || tokens == 0) return;  // no rows, nothing can overlap
  struct Dim { std::int64_t stride, extent; const char* name; };
  Dim dims[2] = {{ts, tokens, "token_stride"}, {hs, heads, "head_stride"}};
  if (dims[1].stride < dims[0].stride) std::swap(dims[0], dims[1]);
  std::int64_t span = d;  // elements covered by one row
  for (const Dim& dim : dims) {
    if (dim.extent <= 1) continue;
    if (dim.stride < span)
      throw_invalid(std::string(ctx) + ": " + dim.name + " " + std::to_string(dim.stride) +
                    " makes rows overlap (needs >= " + std::to_string(span) + ")");
    span = checked_add(checked_mul(dim.stride, dim.extent - 1, ctx), span, ctx);
  }
  checked_mul(span, elem_size, ctx);  // the span in bytes
}

}  // namespace detail

/// Read-only view of keys [heads][tokens][head_dim] with inner stride 1.
template <class T>
class KeysView {
  static_assert(is_element_type_v<T>, "KeysView<T>: T must be float, kvscore::half or kvscore::bfloat16");

 public:
  using value_type = T;  ///< the element type: float, kvscore::half or kvscore::bfloat16

  KeysView() = default;

  /// General form: element (h, t, j) lives at data[h*head_stride + t*token_stride + j].
  KeysView(const T* data, std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
           std::int64_t head_stride, std::int64_t token_stride)
      : data_(data), heads_(heads), tokens_(tokens), dim_(head_dim), hs_(head_stride), ts_(token_stride) {
    constexpr const char* ctx = "kvscore::KeysView";
    if (heads < 0) detail::throw_invalid(std::string(ctx) + ": heads must be >= 0 (got " + std::to_string(heads) + ")");
    if (tokens < 0) detail::throw_invalid(std::string(ctx) + ": tokens must be >= 0 (got " + std::to_string(tokens) + ")");
    if (head_dim <= 0 || head_dim > kMaxHeadDim)
      detail::throw_invalid(std::string(ctx) + ": head_dim must be in [1, " + std::to_string(kMaxHeadDim) +
                            "] (got " + std::to_string(head_dim) + ")");
    if (data == nullptr && heads > 0 && tokens > 0)
      detail::throw_invalid(std::string(ctx) + ": data is null but the view has " + std::to_string(heads) +
                            " heads x " + std::to_string(tokens) + " tokens");
    detail::check_strides(ctx, heads, tokens, head_dim, head_stride, token_stride, std::int64_t(sizeof(T)));
  }

  /// One batch row of a Hugging Face cache [batch, kv_heads, seq, head_dim] (C order).
  /// `capacity` is the allocated sequence length (static caches); -1 means seq.
  static KeysView hf(const T* layer, std::int64_t batch_index, std::int64_t batch, std::int64_t kv_heads,
                     std::int64_t seq, std::int64_t head_dim, std::int64_t capacity = -1) {
    if (capacity < 0) capacity = seq;
    if (batch_index < 0 || batch_index >= batch)
      detail::throw_invalid("kvscore::KeysView::hf: batch_index " + std::to_string(batch_index) +
                            " out of range [0, " + std::to_string(batch) + ")");
    if (capacity < seq)
      detail::throw_invalid("kvscore::KeysView::hf: capacity " + std::to_string(capacity) + " < seq " +
                            std::to_string(seq));
    const char* ctx = "kvscore::KeysView::hf";
    // The shape is validated before any pointer is formed from it.
    if (kv_heads < 0) detail::throw_invalid(std::string(ctx) + ": kv_heads must be >= 0 (got " + std::to_string(kv_heads) + ")");
    if (seq < 0) detail::throw_invalid(std::string(ctx) + ": seq must be >= 0 (got " + std::to_string(seq) + ")");
    if (head_dim <= 0 || head_dim > kMaxHeadDim)
      detail::throw_invalid(std::string(ctx) + ": head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " +
                            std::to_string(head_dim) + ")");
    const std::int64_t hs = detail::checked_mul(capacity, head_dim, ctx);
    const std::int64_t bs = detail::checked_mul(hs, kv_heads, ctx);
    const std::int64_t offset = detail::checked_mul(bs, batch_index, ctx);
    detail::checked_mul(detail::checked_add(offset, bs, ctx), std::int64_t(sizeof(T)), ctx);  // end of the row, in bytes
    const T* base = layer == nullptr ? nullptr : layer + offset;
    return KeysView(base, kv_heads, seq, head_dim, hs, head_dim);
  }

  /// Token-major cache [tokens, kv_heads, head_dim] (llama.cpp cells, SGLang slots).
  static KeysView token_major(const T* data, std::int64_t tokens, std::int64_t kv_heads, std::int64_t head_dim) {
    const std::int64_t ts = detail::checked_mul(kv_heads, head_dim, "kvscore::KeysView::token_major");
    return KeysView(data, kv_heads, tokens, head_dim, head_dim, ts);
  }

  const T* data() const noexcept { return data_; }  ///< the first element (head 0, token 0, dimension 0)
  std::int64_t heads() const noexcept { return heads_; }  ///< heads of the view
  std::int64_t tokens() const noexcept { return tokens_; }  ///< tokens of each head
  std::int64_t head_dim() const noexcept { return dim_; }  ///< elements per key row (contiguous)
  std::int64_t head_stride() const noexcept { return hs_; }  ///< elements between two heads
  std::int64_t token_stride() const noexcept { return ts_; }  ///< elements between two tokens of a head
  bool empty() const noexcept { return heads_ == 0 || tokens_ == 0; }  ///< true when there is no key to read

  const T* head(std::int64_t h) const noexcept { return data_ + h * hs_; }  ///< head h's first key row
  /// The key row of head h, token t.
  const T* row(std::int64_t h, std::int64_t t) const noexcept { return data_ + h * hs_ + t * ts_; }

  /// Calls f(first_row, t0, n, token_stride) for the runs of evenly strided rows of head h,
  /// in token order — one run here; a paged view has one per block (see paged.hpp). Scorers
  /// read every view through this, so they work on any layout that provides it.
  template <class F>
  void for_each_run(std::int64_t h, F&& f) const {
    if (tokens_ > 0) f(head(h), std::int64_t(0), tokens_, ts_);
  }

  /// The sub-view of tokens [t0, t1) (windows, chunked prefill).
  KeysView tokens_slice(std::int64_t t0, std::int64_t t1) const {
    if (t0 < 0 || t1 < t0 || t1 > tokens_)
      detail::throw_invalid("kvscore::KeysView::tokens_slice: [" + std::to_string(t0) + ", " + std::to_string(t1) +
                            ") out of range [0, " + std::to_string(tokens_) + "]");
    KeysView v = *this;
    // t0 * ts_ is inside the checked span only for a non-empty slice of a non-empty view.
    v.data_ = (data_ == nullptr || t0 == t1 || heads_ == 0) ? data_ : data_ + t0 * ts_;
    v.tokens_ = t1 - t0;
    return v;
  }

 private:
  const T* data_ = nullptr;
  std::int64_t heads_ = 0, tokens_ = 0, dim_ = 1, hs_ = 0, ts_ = 0;
};

/// View of fp32 scores [heads][tokens] (token stride 1), caller-owned memory: writable
/// (`ScoresView`, what a scorer writes) or read-only (`ConstScoresView`, what the selectors
/// read), as KeysView / MutKeysView. A ScoresView converts to a ConstScoresView.
template <class F>
class BasicScoresView {
  static_assert(std::is_same_v<std::remove_const_t<F>, float>, "scores are fp32");

 public:
  BasicScoresView() = default;
  /// A view of `heads` rows of `tokens` fp32 scores each, `head_stride` elements apart (-1: `tokens`, contiguous
  /// rows); throws std::invalid_argument for a negative shape, a null pointer with a non-empty shape or overlapping
  /// rows.
  BasicScoresView(F* data, std::int64_t heads, std::int64_t tokens, std::int64_t head_stride = -1)
      : data_(data), heads_(heads), tokens_(tokens), hs_(head_stride < 0 ? tokens : head_stride) {
    constexpr const char* ctx = std::is_const_v<F> ? "kvscore::ConstScoresView" : "kvscore::ScoresView";
    if (heads < 0 || tokens < 0)
      detail::throw_invalid(std::string(ctx) + ": negative shape (" + std::to_string(heads) + ", " +
                            std::to_string(tokens) + ")");
    if (data == nullptr && heads > 0 && tokens > 0)
      detail::throw_invalid(std::string(ctx) + ": data is null but shape is (" + std::to_string(heads) + ", " +
                            std::to_string(tokens) + ")");
    if (heads > 1 && hs_ < tokens)
      detail::throw_invalid(std::string(ctx) + ": head_stride " + std::to_string(hs_) + " < tokens " +
                            std::to_string(tokens) + " makes heads overlap");
  }
  /// A writable view read as a read-only one (already validated).
  template <class G>
    requires(std::is_const_v<F> && std::is_same_v<G, float>)
  BasicScoresView(const BasicScoresView<G>& v) noexcept  // NOLINT(google-explicit-constructor)
      : data_(v.data()), heads_(v.heads()), tokens_(v.tokens()), hs_(v.head_stride()) {}

  F* data() const noexcept { return data_; }  ///< the first score
  std::int64_t heads() const noexcept { return heads_; }  ///< rows (heads)
  std::int64_t tokens() const noexcept { return tokens_; }  ///< scores per row (tokens)
  std::int64_t head_stride() const noexcept { return hs_; }  ///< elements between two rows
  F* head(std::int64_t h) const noexcept { return data_ + h * hs_; }  ///< head h's row of scores
  /// The score of head h, token t.
  F& operator()(std::int64_t h, std::int64_t t) const noexcept { return data_[h * hs_ + t]; }

 private:
  F* data_ = nullptr;
  std::int64_t heads_ = 0, tokens_ = 0, hs_ = 0;
};

/// Writable fp32 scores [heads][tokens]: what a scorer writes.
using ScoresView = BasicScoresView<float>;
/// Read-only fp32 scores [heads][tokens]: what select(), select_into() and select_joint() read.
using ConstScoresView = BasicScoresView<const float>;

/// Owning fp32 scores [heads][tokens], contiguous.
class Scores {
 public:
  Scores() = default;
  /// `heads` × `tokens` zero scores (std::invalid_argument for a negative shape).
  Scores(std::int64_t heads, std::int64_t tokens)
      : data_(std::size_t(detail::checked_mul(heads < 0 ? 0 : heads, tokens < 0 ? 0 : tokens, "kvscore::Scores"))),
        heads_(heads),
        tokens_(tokens) {
    if (heads < 0 || tokens < 0)
      detail::throw_invalid("kvscore::Scores: negative shape (" + std::to_string(heads) + ", " +
                            std::to_string(tokens) + ")");
  }
  std::int64_t heads() const noexcept { return heads_; }  ///< rows (heads)
  std::int64_t tokens() const noexcept { return tokens_; }  ///< scores per row (tokens)
  float* data() noexcept { return data_.data(); }  ///< the scores, row-major
  const float* data() const noexcept { return data_.data(); }  ///< the scores, row-major
  const float* head(std::int64_t h) const noexcept { return data_.data() + h * tokens_; }  ///< head h's row of scores
  /// The score of head h, token t.
  float operator()(std::int64_t h, std::int64_t t) const noexcept { return data_[std::size_t(h * tokens_ + t)]; }
  /// A writable view of all the scores (what a scorer writes into).
  ScoresView view() noexcept { return ScoresView(data_.data(), heads_, tokens_, tokens_); }
  /// A read-only view of all the scores (what the selectors read).
  ConstScoresView view() const noexcept { return ConstScoresView(data_.data(), heads_, tokens_, tokens_); }
  const std::vector<float>& values() const noexcept { return data_; }  ///< the scores, row-major [heads × tokens]

 private:
  std::vector<float> data_;
  std::int64_t heads_ = 0, tokens_ = 0;
};

/// What every cache view has: an element type of kvscore's and a [heads][tokens][head_dim]
/// shape. KeyCacheView (what a scorer reads) and MutableCacheView (what compact writes) refine it.
template <class V>
concept CacheShape = requires(const V& v) {
  typename V::value_type;
  requires is_element_type_v<typename V::value_type>;
  { v.heads() } -> std::convertible_to<std::int64_t>;
  { v.tokens() } -> std::convertible_to<std::int64_t>;
  { v.head_dim() } -> std::convertible_to<std::int64_t>;
};

namespace detail {
/// The shell of a writable view over a read-only one (MutKeysView here, cuda's
/// DeviceMutKeysView): the read-only view to score, the writable pointer, the shape.
template <class View>
class WritableShell {
 public:
  using value_type = typename View::value_type;

  /// The read-only view (to score it).
  const View& view() const noexcept { return view_; }
  value_type* data() const noexcept { return data_; }
  std::int64_t heads() const noexcept { return view_.heads(); }
  std::int64_t tokens() const noexcept { return view_.tokens(); }
  std::int64_t head_dim() const noexcept { return view_.head_dim(); }
  std::int64_t head_stride() const noexcept { return view_.head_stride(); }
  std::int64_t token_stride() const noexcept { return view_.token_stride(); }

 protected:
  WritableShell() = default;
  // `v` was built from the non-const `data`, so writing through it is well defined.
  WritableShell(const View& v, value_type* data) : view_(v), data_(data) {}
  View view_;
  value_type* data_ = nullptr;
};
}  // namespace detail

/// Mutable strided view of one layer's keys or values [heads][tokens][head_dim], inner stride 1.
/// Same constructors and validation as KeysView (it builds one from the same numbers); the
/// memory must be writable.
template <class T>
class MutKeysView : public detail::WritableShell<KeysView<T>> {
  using Shell = detail::WritableShell<KeysView<T>>;

 public:
  MutKeysView() = default;
  /// Element (h, t, j) at data[h*head_stride + t*token_stride + j].
  MutKeysView(T* data, std::int64_t heads, std::int64_t tokens, std::int64_t head_dim, std::int64_t head_stride,
              std::int64_t token_stride)
      : Shell(KeysView<T>(data, heads, tokens, head_dim, head_stride, token_stride), data) {}

  /// One batch row of an HF cache [batch, kv_heads, seq, head_dim]; `capacity` = allocated length (static cache).
  static MutKeysView hf(T* layer, std::int64_t batch_index, std::int64_t batch, std::int64_t kv_heads,
                        std::int64_t seq, std::int64_t head_dim, std::int64_t capacity = -1) {
    return MutKeysView(KeysView<T>::hf(layer, batch_index, batch, kv_heads, seq, head_dim, capacity));
  }
  /// Token-major cache [tokens, kv_heads, head_dim] (llama.cpp K cells, SGLang slots).
  static MutKeysView token_major(T* data, std::int64_t tokens, std::int64_t kv_heads, std::int64_t head_dim) {
    return MutKeysView(KeysView<T>::token_major(data, tokens, kv_heads, head_dim));
  }

  bool empty() const noexcept { return this->view_.empty(); }  ///< true when there is no row to write
  /// The writable key row of head h, token t.
  T* row(std::int64_t h, std::int64_t t) const noexcept {
    return this->data_ + h * this->view_.head_stride() + t * this->view_.token_stride();
  }

 private:
  // The view was built from a non-const pointer, so writing through it is well defined.
  explicit MutKeysView(const KeysView<T>& v) : Shell(v, const_cast<T*>(v.data())) {}
};

/// Element strides of one layer's [batch][heads][tokens][head_dim] tensor (head_dim contiguous;
/// a torch tensor's strides): what the layer-level decode caches (ParisKVLayerCache,
/// OjaLayerCache) read their rows and queries with, and write their outputs with.
struct LayerStrides {
  std::int64_t batch = 0;  ///< elements between two batch rows
  std::int64_t head = 0;   ///< elements between two heads
  std::int64_t token = 0;  ///< elements between two tokens
};

}  // namespace kvscore
