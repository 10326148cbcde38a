// kvscore/block_sparse/summary_store.hpp — the block summaries a scorer reads instead of the keys
// (quest: min and max per dimension; meanstd: mean and spread; int4: min, max, step and 4-bit
// codes), per (layer, block, KV head), in the scorer's format: `floats` fp32 and `code_bytes`
// bytes each. A summary is made when its block is first needed and made again after a write to
// the block (BlockWrites): the store remembers, per layer and block, the write it summarised.
// The blocks are whatever the key source numbers them (physical ids of a paged pool, logical
// blocks of one sequence, blocks of cells of a token-major cache).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvscore/block_sparse/keys.hpp"
#include "kvscore/block_sparse/state.hpp"
#include "kvscore/core/parallel.hpp"

namespace kvscore::detail {

class SummaryStore {
 public:
  SummaryStore() = default;
  /// No memory when `floats` is 0 (a scorer that reads no summary).
  SummaryStore(std::int64_t layers, std::int64_t blocks, std::int64_t kv_heads, std::int64_t floats,
               std::int64_t code_bytes)
      : nb_(blocks), kh_(kv_heads), nf_(floats), nc_(code_bytes) {
    if (nf_ == 0) return;
    made_at_.assign(std::size_t(layers), std::vector<std::int64_t>(std::size_t(nb_), -1));
    sums_.resize(std::size_t(layers));
    for (auto& s : sums_) s.reset(new float[std::size_t(nb_ * kh_ * nf_)]);
    if (nc_ > 0) {
      codes_.resize(std::size_t(layers));
      for (auto& c : codes_) c.reset(new std::uint8_t[std::size_t(nb_ * kh_ * nc_)]);
    }
  }

  bool empty() const noexcept { return nf_ == 0; }
  std::int64_t floats() const noexcept { return nf_; }
  std::int64_t code_bytes() const noexcept { return nc_; }
  std::int64_t bytes() const noexcept {
    return std::int64_t(sums_.size()) * nb_ * kh_ * (nf_ * std::int64_t(sizeof(float)) + nc_);
  }
  /// Summaries made since construction.
  std::int64_t made() const noexcept { return made_; }

  /// Layer l's summaries [blocks][kv_heads][floats] and codes [blocks][kv_heads][code_bytes].
  float* sums(std::int64_t l) const noexcept { return sums_[std::size_t(l)].get(); }
  std::uint8_t* codes(std::int64_t l) const noexcept { return nc_ > 0 ? codes_[std::size_t(l)].get() : nullptr; }

  /// Block p of layer l needs its summary made (none yet, or its block was written since):
  /// true once per write; the caller then makes it (make()). Serial.
  bool claim(std::int64_t l, std::int64_t p, const BlockWrites& writes) {
    std::int64_t& at = made_at_[std::size_t(l)][std::size_t(p)];
    if (at >= writes.written(p)) return false;
    at = writes.written(p);
    return true;
  }

  /// Makes the summaries of `blocks` (claimed) in layer l from `keys`, a block per task over
  /// `threads`: summarize(tile, floats*, codes*) for each KV head (codes null without codes).
  template <BlockKeySource Keys, class Summarize>
  void make(std::int64_t l, const Keys& keys, std::span<const std::int64_t> blocks, int threads, Summarize&& summarize) {
    float* S = sums(l);
    std::uint8_t* C = codes(l);
    parallel_for(std::int64_t(blocks.size()), threads, [&](std::int64_t i) {
      const std::int64_t p = blocks[std::size_t(i)];
      for (std::int64_t h = 0; h < kh_; ++h)
        summarize(keys.tile(h, p), S + (p * kh_ + h) * nf_, C ? C + (p * kh_ + h) * nc_ : nullptr);
    });
    made_ += std::int64_t(blocks.size());
  }

 private:
  std::int64_t nb_ = 0, kh_ = 0, nf_ = 0, nc_ = 0, made_ = 0;
  std::vector<std::unique_ptr<float[]>> sums_;
  std::vector<std::unique_ptr<std::uint8_t[]>> codes_;
  std::vector<std::vector<std::int64_t>> made_at_;  // per layer and block: the write summarised (-1: none)
};

}  // namespace kvscore::detail
