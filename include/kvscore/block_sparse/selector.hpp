// kvscore/block_sparse/selector.hpp — PagedBlockSelector: the block choice of every decode row of
// a paged cache, and what it keeps between steps. It composes the room's parts:
//
//   the scorer       one per BlockScore (scorers.hpp), chosen once from the options
//   SummaryStore     its summaries per (layer, block, KV head), remade after a write (BlockWrites)
//   RefreshPolicy    whether a row's kept choice stands this step (refresh.hpp: triggers plug in)
//   the chooser      kept choice or scored top k (chooser.hpp), wrapped by the probe (probe.hpp)
//                    when BlockSparseOptions::probe is on
//
// Driven by one engine worker: begin_step() once per step (the slots written since, and the
// step's live sequences: both required), then select() per layer, which runs the rows in
// parallel, or splits a row's scoring over the threads when fewer rows score than there are
// threads. Determinism: each value is computed by one thread in a fixed order; the result does
// not depend on the thread count. Errors: std::invalid_argument naming the value; select()
// validates every row before it writes any.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvscore/block_sparse/chooser.hpp"
#include "kvscore/block_sparse/keys.hpp"
#include "kvscore/block_sparse/options.hpp"
#include "kvscore/block_sparse/probe.hpp"
#include "kvscore/block_sparse/refresh.hpp"
#include "kvscore/block_sparse/scorers.hpp"
#include "kvscore/block_sparse/state.hpp"
#include "kvscore/block_sparse/summary_store.hpp"
#include "kvscore/core/parallel.hpp"

namespace kvscore {

class PagedBlockSelector {
 public:
  PagedBlockSelector(std::int64_t layers, std::int64_t num_blocks, std::int64_t kv_heads, std::int64_t head_dim,
                     std::int64_t block_size, const BlockSparseOptions& opt = {})
      : L_(checked(layers, num_blocks, kv_heads, head_dim, block_size, opt)), nb_(num_blocks), kh_(kv_heads),
        d_(head_dim), bs_(block_size), opt_(opt), scorer_(detail::make_block_scorer(opt, layers, head_dim, block_size)),
        refresh_(opt, layers), writes_(num_blocks, block_size) {
    detail::visit_scorer(scorer_, [&](const auto& s) {
      store_ = detail::SummaryStore(L_, nb_, kh_, s.summary_floats(), s.code_bytes());
    });
    if (opt_.probe) probe_.emplace(detail::BlockChoiceProbe{detail::ExactScorer(opt, layers, head_dim, block_size)});
  }

  // it owns per-layer summaries and indexes: movable, not copyable
  PagedBlockSelector(const PagedBlockSelector&) = delete;
  PagedBlockSelector& operator=(const PagedBlockSelector&) = delete;
  PagedBlockSelector(PagedBlockSelector&&) = default;
  PagedBlockSelector& operator=(PagedBlockSelector&&) = default;

  const BlockSparseOptions& options() const noexcept { return opt_; }
  std::int64_t layers() const noexcept { return L_; }
  std::int64_t num_blocks() const noexcept { return nb_; }
  std::int64_t kv_heads() const noexcept { return kh_; }
  std::int64_t head_dim() const noexcept { return d_; }
  std::int64_t block_size() const noexcept { return bs_; }
  /// Steps begun (begin_step calls).
  std::int64_t step() const noexcept { return writes_.step(); }
  /// Bytes of the per-block summaries (quest, meanstd, int4): 2·head_dim floats per block, head
  /// and layer (int4: 3·head_dim and its codes).
  std::int64_t summary_bytes() const noexcept { return store_.bytes(); }
  /// Summaries made since construction (quest, meanstd, int4), for tests and benchmarks.
  std::int64_t summaries_made() const noexcept { return store_.made(); }
  /// ParisKV indexes held (one per layer and sequence), for tests.
  std::int64_t indexes() const noexcept {
    return detail::visit_scorer(scorer_, [](const auto& s) { return s.indexes(); });
  }
  /// With options().probe: (blocks the exact score chose beyond the protected ones, how many of
  /// them this score chose too), summed over every row and layer since construction. With
  /// refresh, a step whose kept choice stands counts too: the kept blocks against that step's
  /// exact choice (what the choice lost by being kept).
  std::pair<std::int64_t, std::int64_t> probe() const noexcept {
    return probe_ ? std::pair<std::int64_t, std::int64_t>{probe_->chosen, probe_->held} : std::pair<std::int64_t, std::int64_t>{0, 0};
  }
  /// When a row's kept choice stands (refresh.hpp); add a RefreshTrigger here.
  RefreshPolicy& refresh_policy() noexcept { return refresh_; }
  const RefreshPolicy& refresh_policy() const noexcept { return refresh_; }

  /// Once per engine step, before its first select(). `slots`: the physical slots written since
  /// the last step (vLLM's slot_mapping; negative entries are padding): the summaries, indexes
  /// and kept choices holding their blocks go stale. `live`: the key (row_sequence: its seq, or
  /// its first block) of every sequence in the step (every row select() will see this step among them): the indexes and kept
  /// choices of the others go. Both are required: an empty `live` drops every kept choice, and
  /// select() refuses a row whose sequence `live` does not name.
  void begin_step(std::span<const std::int64_t> slots, std::span<const std::int64_t> live) {
    writes_.begin_step(slots, "kvscore::PagedBlockSelector::begin_step");
    live_.assign(live);
    detail::visit_scorer(scorer_, [&](auto& s) { s.begin_step(live_); });
    refresh_.begin_step(live_);
  }

  /// Chooses the blocks of every row for one layer from the layer's keys: `keys` is a paged view
  /// of the pool (PagedKeysView, TransposedPagedKeysView or AmxPagedKeysView over any table: only its data, strides
  /// and shape are read), each row's query [q_heads][head_dim]. Every row is validated first.
  template <class View>
  void select(std::int64_t layer, const View& keys, std::int64_t q_heads, std::span<const BlockSparseRow> rows) {
    run("kvscore::PagedBlockSelector::select", layer, PagedBlockKeys<View>{keys}, q_heads, rows);
  }

  /// The same over any block key source (keys.hpp: a token-major cell cache, ...): block ids in
  /// the rows' tables are the source's blocks.
  template <BlockKeySource Keys>
  void select_blocks(std::int64_t layer, const Keys& keys, std::int64_t q_heads, std::span<const BlockSparseRow> rows) {
    run("kvscore::PagedBlockSelector::select_blocks", layer, keys, q_heads, rows);
  }

 private:
  static std::int64_t checked(std::int64_t layers, std::int64_t num_blocks, std::int64_t kv_heads, std::int64_t head_dim,
                              std::int64_t block_size, const BlockSparseOptions& opt) {
    const std::string who = "kvscore::PagedBlockSelector";
    auto need = [&](bool ok, const char* what, std::int64_t v) {
      if (!ok) detail::throw_invalid(who + ": " + what + " (got " + std::to_string(v) + ")");
    };
    need(layers >= 1, "layers must be >= 1", layers);
    need(num_blocks >= 1, "num_blocks must be >= 1", num_blocks);
    need(kv_heads >= 1, "kv_heads must be >= 1", kv_heads);
    need(head_dim >= 1 && head_dim <= kMaxHeadDim, "head_dim must be in [1, 4096]", head_dim);
    need(block_size >= 1, "block_size must be >= 1", block_size);
    detail::check_block_sparse(opt, who.c_str());
    return layers;
  }

  float scale() const noexcept { return opt_.scale > 0 ? opt_.scale : 1.f / std::sqrt(float(d_)); }

  void check_row(const BlockSparseRow& r, std::size_t i, std::int64_t q_heads, const std::string& who) const {
    const std::string at = who + ": row " + std::to_string(i);
    if (r.tokens < 1) detail::throw_invalid(at + ": tokens must be >= 1 (got " + std::to_string(r.tokens) + ")");
    const std::int64_t nb = blocks_for(r.tokens, bs_);
    if (std::int64_t(r.table.size()) < nb)
      detail::throw_invalid(at + ": the table has " + std::to_string(r.table.size()) + " entries, " +
                            std::to_string(r.tokens) + " tokens need " + std::to_string(nb));
    for (std::int64_t b = 0; b < nb; ++b)
      if (r.table[std::size_t(b)] < 0 || r.table[std::size_t(b)] >= nb_)
        detail::throw_invalid(at + ": table[" + std::to_string(b) + "] = " + std::to_string(r.table[std::size_t(b)]) +
                              " out of range [0, " + std::to_string(nb_) + ")");
    const std::int64_t prot = detail::protected_blocks_of(r.tokens, bs_, opt_).count();
    if (r.attend < prot || r.attend > nb)
      detail::throw_invalid(at + ": attend " + std::to_string(r.attend) + " blocks out of range [" +
                            std::to_string(prot) + ", " + std::to_string(nb) + "] (protected .. all)");
    detail::check_query(r.query, q_heads * d_, at);
    if (r.out == nullptr) detail::throw_invalid(at + ": out is null");
  }

  template <class Keys>
  void run(const std::string& who, std::int64_t layer, const Keys& keys, std::int64_t q_heads,
           std::span<const BlockSparseRow> rows) {
    if (layer < 0 || layer >= L_)
      detail::throw_invalid(who + ": layer " + std::to_string(layer) + " out of range [0, " + std::to_string(L_) + ")");
    if (keys.heads() != kh_ || keys.head_dim() != d_ || keys.block_size() != bs_ || keys.num_blocks() != nb_)
      detail::throw_invalid(who + ": the keys' (kv_heads, head_dim, block_size, num_blocks) = (" +
                            std::to_string(keys.heads()) + ", " + std::to_string(keys.head_dim()) + ", " +
                            std::to_string(keys.block_size()) + ", " + std::to_string(keys.num_blocks()) +
                            ") differ from the selector's (" + std::to_string(kh_) + ", " + std::to_string(d_) + ", " +
                            std::to_string(bs_) + ", " + std::to_string(nb_) + ")");
    if (q_heads < kh_ || q_heads % kh_ != 0)
      detail::throw_invalid(who + ": q_heads " + std::to_string(q_heads) + " must be a positive multiple of kv_heads " +
                            std::to_string(kh_));
    for (std::size_t i = 0; i < rows.size(); ++i) check_row(rows[i], i, q_heads, who);
    const std::vector<std::int64_t> firsts = sequences(who, rows);
    const Prepared p = prepare(layer, q_heads, rows, firsts);
    detail::visit_scorer(scorer_, [&](auto& scorer) { choose_rows(scorer, layer, keys, q_heads, rows, p); });
  }

  /// Each row's sequence key (row_sequence: BlockSparseRow::seq, or its first block): rows are
  /// distinct sequences (their state is found by it), each one begin_step named.
  std::vector<std::int64_t> sequences(const std::string& who, std::span<const BlockSparseRow> rows) const {
    std::vector<std::int64_t> firsts;
    std::unordered_set<std::int64_t> seen;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const std::int64_t f = row_sequence(rows[i]);
      if (!seen.insert(f).second)
        detail::throw_invalid(who + ": row " + std::to_string(i) + " has the sequence key " + std::to_string(f) +
                              " of an earlier row (one sequence per row; rows sharing a first block need their own seq)");
      firsts.push_back(f);
    }
    for (std::size_t i = 0; i < rows.size(); ++i)
      if (!live_.contains(firsts[i]))
        detail::throw_invalid(who + ": row " + std::to_string(i) + "'s sequence (key " + std::to_string(firsts[i]) +
                              ") is not among the live sequences begin_step named this step");
    return firsts;
  }

  struct Prepared {
    std::vector<detail::ProtectedBlocks> pbs;
    std::vector<std::uint8_t> stands;  // per row: its kept choice stands
    std::vector<std::int64_t> todo;    // the blocks whose summaries to make, each once
  };

  /// Serially, before any row runs: each row's sequence state (made here; each row's thread then
  /// uses its own), which rows' kept choices stand, and the candidate blocks whose summary is
  /// missing or stale. Which rows' kept choices stand is known before anything is read: those
  /// rows touch only their kept blocks (no summary scan: at batch 1 that scan over cold memory
  /// was most of a call).
  Prepared prepare(std::int64_t layer, std::int64_t q_heads, std::span<const BlockSparseRow> rows,
                   const std::vector<std::int64_t>& firsts) {
    for (const std::int64_t f : firsts) {
      detail::visit_scorer(scorer_, [&](auto& s) { s.prepare(layer, f); });
      refresh_.prepare(layer, f);
    }
    Prepared p;
    p.pbs.resize(rows.size());
    p.stands.assign(rows.size(), 0);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      p.pbs[i] = detail::protected_blocks_of(rows[i].tokens, bs_, opt_);
      p.stands[i] = refresh_.stands(RefreshRow{rows[i], layer, q_heads, d_, writes_.step(), p.pbs[i]}, writes_);
    }
    if (store_.empty()) return p;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const BlockSparseRow& r = rows[i];
      const detail::ProtectedBlocks& pb = p.pbs[i];
      if (r.attend == pb.count() || p.stands[i]) continue;  // nothing to choose, or nothing to score
      for (std::int64_t b = 0; b < pb.blocks; ++b) {
        const std::int64_t id = r.table[std::size_t(b)];
        if (!pb.contains(b) && store_.claim(layer, id, writes_)) p.todo.push_back(id);
      }
    }
    return p;
  }

  template <class Scorer, class Keys>
  void choose_rows(Scorer& scorer, std::int64_t layer, const Keys& keys, std::int64_t q_heads,
                   std::span<const BlockSparseRow> rows, const Prepared& p) {
    if constexpr (Scorer::kSummaries)  // the stale summaries, made in parallel
      store_.make(layer, keys, p.todo, opt_.num_threads,
                  [&](const auto& tile, float* s, std::uint8_t* c) { scorer.summarize(tile, s, c); });
    const detail::LayerCall<Keys> call{keys, layer, q_heads, kh_, d_, bs_, scale(), writes_};
    const detail::ScoredChooser<Scorer> scored{scorer, store_, refresh_, opt_.group};
    const auto chooser = [&](const detail::RowTask& t, detail::BlockChoiceScratch& w) { scored(call, t, w); };
    if (!probe_) return run_rows(rows, p, chooser);
    std::vector<std::pair<std::int64_t, std::int64_t>> counts(rows.size(), {0, 0});
    run_rows(rows, p, detail::Probed<Keys>{chooser, probe_->exact, call, counts.data()});
    for (const auto& [k, held] : counts) {
      probe_->chosen += k;
      probe_->held += held;
    }
  }

  /// Every row's choice, written to its out. Fewer rows to score than threads (batch 1; or, with
  /// refresh, a step where most rows' kept choices stand): each scoring row's work is split over
  /// the threads; the others are cheap.
  void run_rows(std::span<const BlockSparseRow> rows, const Prepared& p,
                detail::FunctionRef<void(const detail::RowTask&, detail::BlockChoiceScratch&)> choose) const {
    const int threads = detail::resolve_threads(opt_.num_threads);
    auto one = [&](detail::BlockChoiceScratch& w, std::size_t i, int t) {
      const BlockSparseRow& r = rows[i];
      const detail::RowTask task{i, r, p.pbs[i], r.attend - p.pbs[i].count(), p.stands[i] != 0, t};
      choose(task, w);
      detail::write_choice(p.pbs[i], w.chosen, r.table, r.out);
    };
    const auto scoring = std::int64_t(std::count(p.stands.begin(), p.stands.end(), std::uint8_t(0)));
    if (scoring < threads) {
      detail::BlockChoiceScratch w;
      for (std::size_t i = 0; i < rows.size(); ++i) one(w, i, threads);
    } else {
      detail::parallel_for_state<detail::BlockChoiceScratch>(
          std::int64_t(rows.size()), threads,
          [&](detail::BlockChoiceScratch& w, std::int64_t i) { one(w, std::size_t(i), 1); });
    }
  }

  std::int64_t L_, nb_, kh_, d_, bs_;
  BlockSparseOptions opt_;
  detail::AnyBlockScorer scorer_;
  RefreshPolicy refresh_;
  detail::BlockWrites writes_;
  detail::LiveSequences live_;
  detail::SummaryStore store_;
  std::optional<detail::BlockChoiceProbe> probe_;
};

}  // namespace kvscore
