// kvscore/block_sparse/keys.hpp — where the block scorers and the summary store read keys: a
// block key source gives the key tile of (KV head h, block b), element (t, j) = token t of the
// block, dimension j, as fp32. Any cache layout plugs in by giving its tiles:
//
//   PagedBlockKeys<View>  a paged pool (PagedKeysView NHD/HND, vLLM CPU's TransposedPagedKeysView
//                         and AmxPagedKeysView); b is a physical block id
//   DenseBlockKeys        one sequence's [kv_heads][tokens][head_dim] fp32 keys (block_sparse_reference);
//                         b is a logical block
//   CellBlockKeys<T>      (cells.hpp) a token-major cell cache (llama.cpp's K: [cell][n_embd_k_gqa]
//                         rows, f32, f16 or q8_0): blocks of 32 consecutive cells, tile(h, b) = the
//                         rows of cells [32·b, 32·b + 32) at column h·head_dim (CellTile<T>: q8_0's
//                         blocks of 32 values and a scale read through `float at(t, j)`)
//
// A source has heads(), head_dim(), block_size(), num_blocks() and tile(h, b); a tile has
// `float at(t, j) const`. KeyTile<T> (strided elements of T) is the tile the sources here make,
// AmxKeyTile<T> that of vLLM's AMX-packed keys (AmxPagedKeysView: not two strides);
// int4's summaries read a KeyTile<float> whose tokens are contiguous (vLLM CPU's fp32 tiles) in
// place, any other tile through at().
#pragma once

#include <concepts>
#include <cstdint>

#include "kvscore/core/dtype.hpp"
#include "kvscore/paged.hpp"

namespace kvscore {

namespace detail {

/// One (block, KV head)'s keys: element (t, j) at p[t * ts + j * js].
template <class T>
struct KeyTile {
  using value_type = T;
  const T* p = nullptr;
  std::int64_t ts = 0, js = 1;
  float at(std::int64_t t, std::int64_t j) const noexcept { return to_float(p[t * ts + j * js]); }
};

/// One (block, KV head)'s keys packed as vLLM's AMX layout (AmxPagedKeysView::tile_offset).
template <class T>
struct AmxKeyTile {
  using value_type = T;
  const T* p = nullptr;
  std::int64_t d = 1;
  float at(std::int64_t t, std::int64_t j) const noexcept {
    return to_float(p[AmxPagedKeysView<T>::tile_offset(t, j, d)]);
  }
};

/// Tile of physical block `p`, head h, in a paged view (PagedKeysView rows, or
/// TransposedPagedKeysView's [head_dim][block_size] tiles).
template <class View>
KeyTile<typename View::value_type> paged_tile(const View& v, std::int64_t h, std::int64_t p) noexcept {
  if constexpr (requires { v.token_stride(); })
    return {v.data() + p * v.block_stride() + h * v.head_stride(), v.token_stride(), 1};
  else
    return {v.data() + p * v.block_stride() + h * v.head_stride(), 1, v.block_size()};
}
/// AmxPagedKeysView's AMX-packed tiles.
template <class T>
AmxKeyTile<T> paged_tile(const AmxPagedKeysView<T>& v, std::int64_t h, std::int64_t p) noexcept {
  return {v.data() + p * v.block_stride() + h * v.head_stride(), v.head_dim()};
}

}  // namespace detail

/// A tile: `float at(t, j)`, token t of the block, dimension j.
template <class X>
concept BlockKeyTile = requires(const X& x, std::int64_t t, std::int64_t j) {
  { x.at(t, j) } -> std::convertible_to<float>;
};

/// A block key source (the file comment).
template <class S>
concept BlockKeySource = requires(const S& s, std::int64_t h, std::int64_t b) {
  { s.heads() } -> std::convertible_to<std::int64_t>;
  { s.head_dim() } -> std::convertible_to<std::int64_t>;
  { s.block_size() } -> std::convertible_to<std::int64_t>;
  { s.num_blocks() } -> std::convertible_to<std::int64_t>;
  { s.tile(h, b) } -> BlockKeyTile;
};

/// The blocks of a paged pool (only the view's data, strides and shape are read, never its table).
template <class View>
struct PagedBlockKeys {
  const View& view;
  std::int64_t heads() const noexcept { return view.heads(); }
  std::int64_t head_dim() const noexcept { return view.head_dim(); }
  std::int64_t block_size() const noexcept { return view.block_size(); }
  std::int64_t num_blocks() const noexcept { return view.num_blocks(); }
  auto tile(std::int64_t h, std::int64_t p) const noexcept {
    return detail::paged_tile(view, h, p);
  }
};

/// The logical blocks of one sequence's keys [kv_heads][tokens][head_dim] fp32 (C order).
struct DenseBlockKeys {
  const float* keys = nullptr;
  std::int64_t kv_heads = 0, tokens = 0, dim = 0, bs = 0;
  std::int64_t heads() const noexcept { return kv_heads; }
  std::int64_t head_dim() const noexcept { return dim; }
  std::int64_t block_size() const noexcept { return bs; }
  std::int64_t num_blocks() const noexcept { return (tokens + bs - 1) / bs; }
  detail::KeyTile<float> tile(std::int64_t h, std::int64_t b) const noexcept {
    return {keys + (h * tokens + b * bs) * dim, dim, 1};
  }
};

}  // namespace kvscore
