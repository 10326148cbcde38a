// kvscore/block_sparse/state.hpp — what block-sparse decode keeps between steps, apart from the
// summaries: the write log (the step each physical block was last written: summaries, indexes
// and kept choices made before it are stale), the step's live sequences, and per-(layer,
// sequence) state (a ParisKV index, a kept choice), keyed by the sequence's first block.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvscore/core/view.hpp"

namespace kvscore::detail {

/// Per physical block: the step it was last written (0: never). Steps count begin_step calls.
class BlockWrites {
 public:
  BlockWrites() = default;
  BlockWrites(std::int64_t num_blocks, std::int64_t block_size)
      : bs_(block_size), written_(std::size_t(num_blocks), 0) {}

  std::int64_t step() const noexcept { return step_; }
  std::int64_t written(std::int64_t block) const noexcept { return written_[std::size_t(block)]; }

  /// A new step: `slots` (vLLM's slot_mapping; negative entries are padding) were written since
  /// the last one. Validated before anything changes.
  void begin_step(std::span<const std::int64_t> slots, const std::string& who) {
    const std::int64_t n = std::int64_t(written_.size()) * bs_;
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (slots[i] >= n)
        throw_invalid(who + ": slot " + std::to_string(slots[i]) + " at " + std::to_string(i) + " is past the pool's " +
                      std::to_string(n) + " slots");
    ++step_;
    for (const std::int64_t s : slots)
      if (s >= 0) written_[std::size_t(s / bs_)] = step_;
  }

 private:
  std::int64_t bs_ = 1, step_ = 0;
  std::vector<std::int64_t> written_;
};

/// The sequences of a step, by first block (begin_step's `live`).
class LiveSequences {
 public:
  void assign(std::span<const std::int64_t> firsts) {
    firsts_.assign(firsts.begin(), firsts.end());
    std::sort(firsts_.begin(), firsts_.end());
  }
  bool contains(std::int64_t first) const noexcept {
    return std::binary_search(firsts_.begin(), firsts_.end(), first);
  }

 private:
  std::vector<std::int64_t> firsts_;
};

/// One S per (layer, sequence), made on first use and dropped when its sequence is no longer
/// live. Made and dropped serially; a row's thread then uses its own (rows are distinct sequences).
template <class S>
class SequenceStates {
 public:
  SequenceStates() = default;
  explicit SequenceStates(std::int64_t layers) : m_(std::size_t(layers)) {}

  S& ensure(std::int64_t layer, std::int64_t first) {
    auto& p = m_[std::size_t(layer)][first];
    if (!p) p = std::make_unique<S>();
    return *p;
  }
  /// The state of a sequence ensure() made (not checked).
  S& at(std::int64_t layer, std::int64_t first) const { return *m_[std::size_t(layer)].at(first); }
  void keep_only(const LiveSequences& live) {
    for (auto& m : m_)
      for (auto it = m.begin(); it != m.end();) it = live.contains(it->first) ? std::next(it) : m.erase(it);
  }
  std::int64_t size() const noexcept {
    std::int64_t n = 0;
    for (const auto& m : m_) n += std::int64_t(m.size());
    return n;
  }

 private:
  std::vector<std::unordered_map<std::int64_t, std::unique_ptr<S>>> m_;
};

}  // namespace kvscore::detail
