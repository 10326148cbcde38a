// kvscore/block_sparse/refresh.hpp — when a sequence's last scored choice stands instead of a new
// scoring (docs/reference/block_sparse.md). Per (layer, sequence) the policy keeps the last choice scored
// (KeptChoice); at a step it stands when
//
//   - the row has blocks to choose, and a choice was scored before;
//   - it is younger than `refresh` steps (BlockSparseOptions::refresh; 1: never kept);
//   - its blocks are still the sequence's and unwritten since (a correctness rule, not a choice);
//   - no trigger fires (RefreshTrigger: a reason to score again early).
//
// A standing choice keeps its blocks that are not protected now, the oldest dropped or the
// blocks the local window let go since added to make the count (carry()).
//
// Triggers: a RefreshTrigger sees the kept choice, its own per-(layer, sequence) data kept beside
// it (KeptChoice::data, filled by its scored() when the row is scored: e.g. the query the choice
// was scored with) and the row with this step's query; fires() says the row must be scored this
// step. Add one with RefreshPolicy::add (PagedBlockSelector::refresh_policy()), or, for one
// driven by an option, in RefreshPolicy's constructor.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "kvscore/block_sparse/options.hpp"
#include "kvscore/block_sparse/state.hpp"

namespace kvscore {

/// A sequence's last scored choice in one layer, and what the refresh triggers keep beside it.
struct KeptChoice {
  std::int64_t step = -1;            ///< the step it was scored (-1: none yet)
  std::vector<std::int64_t> blocks;  ///< the chosen logical blocks beyond the protected ones, ascending
  std::vector<std::int64_t> ids;     ///< their physical ids then
  std::vector<std::vector<float>> data;  ///< per trigger, in the order added: its data for this (layer, sequence)
};

/// What the policy and its triggers see of one row in one layer.
struct RefreshRow {
  const BlockSparseRow& row;  ///< its table, length and this step's query [q_heads][head_dim] (fp32)
  std::int64_t layer = 0, q_heads = 0, head_dim = 0;
  std::int64_t step = 0;       ///< this step (begin_step's count, from 1)
  detail::ProtectedBlocks pb;  ///< the row's protected blocks now
};

/// A reason to score a row again before its kept choice is `refresh` steps old.
class RefreshTrigger {
 public:
  virtual ~RefreshTrigger() = default;
  /// true: score the row this step although its kept choice is young enough and still held.
  /// `data` is this trigger's entry of kept.data (empty until scored() filled it). Called
  /// serially, before any row of the layer is scored.
  virtual bool fires(const KeptChoice& kept, const std::vector<float>& data, const RefreshRow& r) const = 0;
  /// The row was scored this step, its new choice in `kept`: keep in `data` what later steps'
  /// fires() compare with. Runs on the row's thread (rows are distinct sequences): it may touch
  /// only `data`.
  virtual void scored(const KeptChoice& kept, std::vector<float>& data, const RefreshRow& r) const {
    (void)kept, (void)data, (void)r;
  }
};

class RefreshPolicy {
 public:
  RefreshPolicy(const BlockSparseOptions& o, std::int64_t layers) : refresh_(o.refresh), kept_(layers) {}

  /// Choices are kept between steps at all (refresh > 1).
  bool keeps() const noexcept { return refresh_ > 1; }
  std::int64_t interval() const noexcept { return refresh_; }
  void add(std::unique_ptr<RefreshTrigger> t) {
    if (!t) detail::throw_invalid("kvscore::RefreshPolicy::add: the trigger is null");
    triggers_.push_back(std::move(t));
  }
  std::size_t triggers() const noexcept { return triggers_.size(); }

  /// A step's sequences: the kept choices of the others go.
  void begin_step(const detail::LiveSequences& live) { kept_.keep_only(live); }
  /// Before a layer's rows run (serially): the row's sequence has a kept-choice slot.
  void prepare(std::int64_t layer, std::int64_t first) {
    if (keeps()) kept_.ensure(layer, first);
  }
  /// The kept choice of (layer, first) if any (prepare made its slot), for tests and triggers.
  const KeptChoice* kept(std::int64_t layer, std::int64_t first) const {
    return keeps() ? &kept_.at(layer, first) : nullptr;
  }

  /// The row's kept choice stands this step (the file comment). Serial, before any row is scored.
  bool stands(const RefreshRow& r, const detail::BlockWrites& writes) const {
    if (!keeps() || r.row.attend <= r.pb.count()) return false;
    const KeptChoice& k = kept_.at(r.layer, row_sequence(r.row));
    if (k.step < 0 || r.step - k.step >= refresh_ || !still_held(k, r, writes)) return false;
    static const std::vector<float> none;
    for (std::size_t i = 0; i < triggers_.size(); ++i)
      if (triggers_[i]->fires(k, i < k.data.size() ? k.data[i] : none, r)) return false;
    return true;
  }

  /// The standing choice as this step's: its blocks that are not protected now, topped up (or
  /// cut) to k with the newest candidates (the blocks the local window let go since), ascending.
  void carry(const RefreshRow& r, std::int64_t k, std::vector<std::int64_t>& chosen) const {
    const detail::ProtectedBlocks& pb = r.pb;
    chosen.clear();
    for (const std::int64_t b : kept_.at(r.layer, row_sequence(r.row)).blocks)
      if (!pb.contains(b)) chosen.push_back(b);
    while (std::int64_t(chosen.size()) > k) chosen.erase(chosen.begin());  // the oldest go
    for (std::int64_t b = pb.local_begin - 1; std::int64_t(chosen.size()) < k && b >= pb.sink_end; --b)
      if (!std::binary_search(chosen.begin(), chosen.end(), b)) chosen.insert(std::lower_bound(chosen.begin(), chosen.end(), b), b);
  }

  /// The row was scored this step: its choice is kept, and each trigger keeps its data. On the
  /// row's thread.
  void record(const RefreshRow& r, const std::vector<std::int64_t>& chosen) {
    if (!keeps()) return;
    KeptChoice& k = kept_.at(r.layer, row_sequence(r.row));
    k.step = r.step;
    k.blocks = chosen;
    k.ids.clear();
    for (const std::int64_t b : chosen) k.ids.push_back(r.row.table[std::size_t(b)]);
    k.data.resize(triggers_.size());
    for (std::size_t i = 0; i < triggers_.size(); ++i) triggers_[i]->scored(k, k.data[i], r);
  }

 private:
  /// A kept choice's blocks are still the sequence's, unwritten since it was scored.
  static bool still_held(const KeptChoice& k, const RefreshRow& r, const detail::BlockWrites& writes) noexcept {
    for (std::size_t i = 0; i < k.blocks.size(); ++i) {
      const std::int64_t b = k.blocks[i];
      if (b >= r.pb.blocks || r.row.table[std::size_t(b)] != k.ids[i] || writes.written(k.ids[i]) > k.step) return false;
    }
    return true;
  }

  std::int64_t refresh_;
  std::vector<std::unique_ptr<RefreshTrigger>> triggers_;
  detail::SequenceStates<KeptChoice> kept_;  // per (layer, sequence) when keeps()
};

}  // namespace kvscore
