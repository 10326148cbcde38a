// kvscore/block_sparse/cells.hpp — block-sparse decode over a token-major cell cache (llama.cpp's
// K cache: row c is cell c's [kv_heads][head_dim] keys, f32, f16 or q8_0). Blocks are 32
// consecutive cells (cell block b = cells [32·b, 32·b + 32)), whatever positions they hold.
//
//   CellKeys            one layer's K cache (the type, the base pointer, the cells, the row stride);
//                       a block key source (keys.hpp): tile(h, b) reads block b's rows at column h·head_dim
//   CellBlockSelector   per layer and query: the cells one decode step attends — the sinks (positions
//                       < sinks), the newest `local` cells, every cell of a block that is not full (a cell
//                       in it not visible: empty, removed) or in flight (written by the latest write(): its
//                       K may not be in the cache yet when the step selects), and the top-scoring full
//                       blocks. The block scores are the block_sparse room's scorers (scorers.hpp; int4 by
//                       default, exact, quest, meanstd), with its summaries (SummaryStore: made when a full
//                       block is first a candidate, made again after a write to one of its cells) and its
//                       choice (choose_top: each query head's softmax share per block, summed over heads).
//   cell_block_reference  the same choice from the keys alone (every summary made afresh), for tests
//
// One choice per layer for every head (llama.cpp's KQ mask is one row per query for all heads).
// ParisKV (stateful per sequence) is not offered here. Errors: std::invalid_argument naming the value.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvscore/block_sparse/choice.hpp"
#include "kvscore/block_sparse/keys.hpp"
#include "kvscore/block_sparse/options.hpp"
#include "kvscore/block_sparse/scorers.hpp"
#include "kvscore/block_sparse/state.hpp"
#include "kvscore/block_sparse/summary_store.hpp"
#include "kvscore/core/dtype.hpp"
#include "kvscore/core/parallel.hpp"

namespace kvscore {

/// Cells per block of a cell cache.
inline constexpr std::int64_t kCellBlockSize = 32;

/// The element type of a cell K cache: ggml's f32, f16 or q8_0 (blocks of 32 values: an fp16 scale
/// d, then 32 int8 q; value = d·q; 34 bytes).
enum class CellKeyType { f32, f16, q8_0 };

inline constexpr CellKeyType kCellKeyTypes[] = {CellKeyType::f32, CellKeyType::f16, CellKeyType::q8_0};

inline const char* to_string(CellKeyType t) noexcept {
  return t == CellKeyType::f32 ? "f32" : t == CellKeyType::f16 ? "f16" : "q8_0";
}

inline CellKeyType parse_cell_key_type(std::string_view s) {
  return detail::parse_enum(s, kCellKeyTypes, "cell key type");
}

namespace detail {

inline constexpr std::int64_t kQ8Block = 32, kQ8Bytes = 34;

/// Bytes of `n` values of type t (q8_0: n a multiple of 32).
inline std::int64_t cell_row_bytes(CellKeyType t, std::int64_t n) noexcept {
  return t == CellKeyType::f32 ? 4 * n : t == CellKeyType::f16 ? 2 * n : n / kQ8Block * kQ8Bytes;
}

/// Block b's keys of KV head h: element (t, j) = cell b·32 + t, column col0 + j.
template <CellKeyType T>
struct CellTile {
  const std::uint8_t* p = nullptr;  ///< the block's first row
  std::int64_t row = 0, col0 = 0;   ///< row stride in bytes, the head's first column
  float at(std::int64_t t, std::int64_t j) const noexcept {
    const std::uint8_t* r = p + t * row;
    const std::int64_t c = col0 + j;
    if constexpr (T == CellKeyType::f32) {
      float v;
      std::memcpy(&v, r + 4 * c, 4);
      return v;
    } else if constexpr (T == CellKeyType::f16) {
      std::uint16_t h;
      std::memcpy(&h, r + 2 * c, 2);
      return half_bits_to_float(h);
    } else {
      const std::uint8_t* blk = r + (c / kQ8Block) * kQ8Bytes;
      std::uint16_t d;
      std::memcpy(&d, blk, 2);
      return half_bits_to_float(d) * float(static_cast<std::int8_t>(blk[2 + c % kQ8Block]));
    }
  }
};

}  // namespace detail

/// One layer's K cache of cells: row c (at data + c·row_bytes) holds cell c's keys, [kv_heads][head_dim].
struct CellKeys {
  CellKeyType type = CellKeyType::f16;
  const void* data = nullptr;
  std::int64_t cells = 0, kv_heads = 0, head_dim = 0;
  std::int64_t row_bytes = 0;  ///< bytes from one cell's row to the next (0: packed, kv_heads·head_dim values)
  std::int64_t stride() const noexcept {
    return row_bytes > 0 ? row_bytes : detail::cell_row_bytes(type, kv_heads * head_dim);
  }
};

namespace detail {

/// CellKeys as a block key source (keys.hpp) of element type T.
template <CellKeyType T>
struct CellBlockKeys {
  const CellKeys& k;
  std::int64_t heads() const noexcept { return k.kv_heads; }
  std::int64_t head_dim() const noexcept { return k.head_dim; }
  std::int64_t block_size() const noexcept { return kCellBlockSize; }
  std::int64_t num_blocks() const noexcept { return (k.cells + kCellBlockSize - 1) / kCellBlockSize; }
  CellTile<T> tile(std::int64_t h, std::int64_t b) const noexcept {
    return {static_cast<const std::uint8_t*>(k.data) + b * kCellBlockSize * k.stride(), k.stride(), h * k.head_dim};
  }
};

template <class F>
decltype(auto) visit_cell_keys(const CellKeys& k, F&& f) {
  switch (k.type) {
    case CellKeyType::f32: return f(CellBlockKeys<CellKeyType::f32>{k});
    case CellKeyType::f16: return f(CellBlockKeys<CellKeyType::f16>{k});
    case CellKeyType::q8_0: break;
  }
  return f(CellBlockKeys<CellKeyType::q8_0>{k});
}

inline void check_cell_keys(const CellKeys& k, const std::string& who) {
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) throw_invalid(who + ": " + what);
  };
  need(k.data != nullptr, "the keys are null");
  need(k.cells >= 1, "cells must be >= 1 (got " + std::to_string(k.cells) + ")");
  need(k.kv_heads >= 1, "kv_heads must be >= 1 (got " + std::to_string(k.kv_heads) + ")");
  need(k.head_dim >= 1 && k.head_dim <= kMaxHeadDim, "head_dim must be in [1, 4096] (got " + std::to_string(k.head_dim) + ")");
  if (k.type == CellKeyType::q8_0)
    need(k.kv_heads * k.head_dim % kQ8Block == 0, "q8_0 rows need kv_heads·head_dim a multiple of 32 (got " +
                                                      std::to_string(k.kv_heads * k.head_dim) + ")");
  const std::int64_t packed = cell_row_bytes(k.type, k.kv_heads * k.head_dim);
  need(k.row_bytes == 0 || k.row_bytes >= packed, "row_bytes " + std::to_string(k.row_bytes) + " is less than a " +
                                                      std::string(to_string(k.type)) + " row of " +
                                                      std::to_string(k.kv_heads * k.head_dim) + " values (" +
                                                      std::to_string(packed) + " bytes)");
}

/// A fraction in (0, 1] or a whole count of tokens > 1 (the rule of attended_blocks).
inline void check_attend(double attend, const std::string& who) {
  if (!(attend > 0) || !std::isfinite(attend) || (attend > 1 && attend != std::floor(attend)))
    throw_invalid(who + ": attend " + std::to_string(attend) + " must be a fraction in (0, 1] or a whole count of tokens > 1");
}

/// One layer's plan of a cell choice: which cells are attended in any case and which full
/// blocks compete, and how many of them to take.
struct CellPlan {
  std::vector<std::uint8_t> attend;   ///< [cells] 1: attended in any case (protected, or in a block that does not compete)
  std::vector<std::int64_t> cand;     ///< the competing blocks, ascending
  std::int64_t k = 0;                 ///< blocks to take among them
  std::int64_t visible = 0;           ///< cells visible to the query
};

/// pos[c] >= 0: cell c is visible with that position. `in_flight[b]`: block b was just written.
inline CellPlan plan_cells(std::span<const std::int32_t> pos, std::span<const std::uint8_t> in_flight, double attend,
                           const BlockSparseOptions& o) {
  const auto n = std::int64_t(pos.size());
  const std::int64_t nb = (n + kCellBlockSize - 1) / kCellBlockSize;
  CellPlan p;
  p.attend.assign(std::size_t(n), 0);
  std::vector<std::int32_t> vis;
  vis.reserve(std::size_t(n));
  for (const std::int32_t x : pos)
    if (x >= 0) vis.push_back(x);
  p.visible = std::int64_t(vis.size());
  if (p.visible == 0) return p;
  // the newest `local` positions (at least the newest one): those >= the local-th largest
  const std::int64_t loc = std::min<std::int64_t>(std::max<std::int64_t>(o.local, 1), p.visible);
  std::nth_element(vis.begin(), vis.begin() + (loc - 1), vis.end(), std::greater<>());
  const std::int32_t newest_from = vis[std::size_t(loc - 1)];
  std::int64_t fixed = 0;
  for (std::int64_t b = 0; b < nb; ++b) {
    const std::int64_t c0 = b * kCellBlockSize, c1 = std::min(n, c0 + kCellBlockSize);
    bool full = c1 - c0 == kCellBlockSize && !in_flight[std::size_t(b)], open = false;
    for (std::int64_t c = c0; c < c1; ++c) {
      const std::int32_t x = pos[std::size_t(c)];
      if (x < 0) {
        full = false;
        continue;
      }
      if (x < o.sinks || x >= newest_from) p.attend[std::size_t(c)] = 1;
      else open = true;
    }
    if (full && open) {
      p.cand.push_back(b);
      continue;
    }
    for (std::int64_t c = c0; c < c1; ++c)
      if (pos[std::size_t(c)] >= 0) p.attend[std::size_t(c)] = 1;
  }
  for (const std::uint8_t a : p.attend) fixed += a;
  const auto C = std::int64_t(p.cand.size());
  if (!(attend < 1) && !(attend > 1)) {
    p.k = C;  // attend = 1: everything
  } else {
    const double want = attend < 1 ? std::ceil(attend * double(p.visible) * (1.0 - 1e-12)) : attend;
    const std::int64_t target = std::int64_t(std::min(want, double(p.visible)));
    p.k = target >= p.visible ? C : std::min(C, (std::max<std::int64_t>(0, target - fixed) + kCellBlockSize - 1) / kCellBlockSize);
  }
  return p;
}

/// The top k of plan.cand by `scorer` (summaries in `store`, made there first when `claim` says so),
/// ascending, into `chosen`.
template <class Scorer, class Keys, class Claim>
void choose_cell_blocks(const Scorer& scorer, const Keys& keys, SummaryStore& store, Claim&& claim, std::int64_t layer,
                        const float* query, std::int64_t q_heads, const CellPlan& plan, const BlockSparseOptions& o,
                        int threads, const BlockWrites& writes, BlockChoiceScratch& w, std::vector<std::int64_t>& chosen) {
  chosen.clear();
  if (plan.k <= 0) return;
  const std::int64_t kh = keys.heads(), d = keys.head_dim();
  if constexpr (Scorer::kSummaries) {
    std::vector<std::int64_t> todo;
    for (const std::int64_t b : plan.cand)
      if (claim(b)) todo.push_back(b);
    store.make(layer, keys, todo, threads, [&](const auto& tile, float* s, std::uint8_t* c) { scorer.summarize(tile, s, c); });
  }
  std::int64_t q = q_heads;
  const float* qs = scoring_queries(query, q_heads, kh, d, o.group, w.meanq, q);
  w.cand = plan.cand;
  w.ids = plan.cand;
  const bool sums = !store.empty();
  const BlockReader<Keys> rd{keys,           sums ? store.sums(layer) : nullptr, sums ? store.codes(layer) : nullptr, kh,
                             store.floats(), store.code_bytes(),                  w.ids.data()};
  BlockScoreJob job;
  job.query = qs;
  job.q = q;
  job.kv_heads = kh;
  job.head_dim = d;
  job.block_size = kCellBlockSize;
  job.k = plan.k;
  job.layer = layer;
  job.writes = &writes;
  job.threads = threads;
  scorer.score(job, rd, w);
  const float scale = o.scale > 0 ? o.scale : 1.f / std::sqrt(float(d));
  choose_top(q, plan.k, scale, w, chosen);
}

inline void check_cell_options(const BlockSparseOptions& o, const std::string& who) {
  check_block_sparse(o, who.c_str());
  if (o.score == BlockScore::pariskv)
    throw_invalid(who + ": score pariskv keeps per-sequence indexes; the cell selector takes quest, meanstd, int4 or exact");
}

inline void check_cell_query(const CellKeys& keys, std::span<const std::int32_t> pos, const float* query,
                             std::int64_t q_heads, double attend, const std::string& who) {
  check_cell_keys(keys, who);
  if (std::int64_t(pos.size()) != keys.cells)
    throw_invalid(who + ": pos has " + std::to_string(pos.size()) + " entries for " + std::to_string(keys.cells) + " cells");
  if (q_heads < keys.kv_heads || q_heads % keys.kv_heads != 0)
    throw_invalid(who + ": q_heads " + std::to_string(q_heads) + " must be a positive multiple of kv_heads " +
                  std::to_string(keys.kv_heads));
  check_attend(attend, who);
  check_query(query, q_heads * keys.head_dim, who);
}

/// The plan's attended cells, and those of the chosen blocks, into out[cells] (1: attended).
inline std::int64_t write_cells(const CellPlan& p, const std::vector<std::int64_t>& chosen,
                                std::span<const std::int32_t> pos, std::span<std::uint8_t> out) {
  std::copy(p.attend.begin(), p.attend.end(), out.begin());
  for (const std::int64_t b : chosen)
    for (std::int64_t c = b * kCellBlockSize; c < (b + 1) * kCellBlockSize; ++c)
      if (pos[std::size_t(c)] >= 0) out[std::size_t(c)] = 1;
  std::int64_t n = 0;
  for (const std::uint8_t a : out) n += a;
  return n;
}

}  // namespace detail

/// The cells of one layer's decode step, kept across steps: the summaries of full blocks.
class CellBlockSelector {
 public:
  CellBlockSelector(std::int64_t layers, std::int64_t cells, std::int64_t kv_heads, std::int64_t head_dim,
                    const BlockSparseOptions& opt = {})
      : L_(layers), n_(cells), kh_(kv_heads), d_(head_dim), nb_((cells + kCellBlockSize - 1) / kCellBlockSize), opt_(opt),
        scorer_(detail::make_block_scorer(checked(layers, cells, kv_heads, head_dim, opt), layers, head_dim, kCellBlockSize)),
        writes_(nb_, kCellBlockSize), in_flight_(std::size_t(nb_), 0) {
    detail::visit_scorer(scorer_, [&](const auto& s) {
      store_ = detail::SummaryStore(L_, nb_, kh_, s.summary_floats(), s.code_bytes());
    });
  }

  const BlockSparseOptions& options() const noexcept { return opt_; }
  std::int64_t layers() const noexcept { return L_; }
  std::int64_t cells() const noexcept { return n_; }
  /// Summaries made since construction (each a block of one layer, every KV head).
  std::int64_t summaries_made() const noexcept { return store_.made(); }
  std::int64_t summary_bytes() const noexcept { return store_.bytes(); }

  /// The cells written or removed since the last call (a ubatch's cells; a removal's; negative
  /// entries are ignored): every layer's summaries of their blocks are stale. The blocks of this
  /// call's cells are in flight until the next call: attended whole, never summarized (the step
  /// that writes a cell may select before the cell's K is in the cache).
  void write(std::span<const std::int64_t> cells) {
    const std::string who = "kvscore::CellBlockSelector::write";
    for (std::size_t i = 0; i < cells.size(); ++i)
      if (cells[i] >= n_)
        detail::throw_invalid(who + ": cell " + std::to_string(cells[i]) + " at " + std::to_string(i) +
                              " is past the cache's " + std::to_string(n_) + " cells");
    writes_.begin_step(cells, who);
    std::fill(in_flight_.begin(), in_flight_.end(), std::uint8_t(0));
    for (const std::int64_t c : cells)
      if (c >= 0) in_flight_[std::size_t(c / kCellBlockSize)] = 1;
  }

  /// Layer `layer`'s attended cells for one query [q_heads][head_dim] (fp32, post-RoPE): out[c] = 1
  /// for an attended cell. pos[c] is cell c's position, or < 0 when the query does not see it
  /// (empty, another sequence, a future position). attend: a fraction of the visible cells in
  /// (0, 1] or a whole count (the protected cells and the non-full blocks are attended whatever
  /// it says; 1: every visible cell). Returns the attended cells.
  std::int64_t select(std::int64_t layer, const CellKeys& keys, std::span<const std::int32_t> pos, const float* query,
                      std::int64_t q_heads, double attend, std::span<std::uint8_t> out) {
    const std::string who = "kvscore::CellBlockSelector::select";
    if (layer < 0 || layer >= L_)
      detail::throw_invalid(who + ": layer " + std::to_string(layer) + " out of range [0, " + std::to_string(L_) + ")");
    detail::check_cell_query(keys, pos, query, q_heads, attend, who);
    if (keys.cells != n_ || keys.kv_heads != kh_ || keys.head_dim != d_)
      detail::throw_invalid(who + ": the keys' (cells, kv_heads, head_dim) = (" + std::to_string(keys.cells) + ", " +
                            std::to_string(keys.kv_heads) + ", " + std::to_string(keys.head_dim) +
                            ") differ from the selector's (" + std::to_string(n_) + ", " + std::to_string(kh_) + ", " +
                            std::to_string(d_) + ")");
    if (std::int64_t(out.size()) != n_)
      detail::throw_invalid(who + ": out has " + std::to_string(out.size()) + " entries for " + std::to_string(n_) + " cells");
    const detail::CellPlan plan = detail::plan_cells(pos, in_flight_, attend, opt_);
    detail::visit_cell_keys(keys, [&](const auto& src) {
      detail::visit_scorer(scorer_, [&](const auto& scorer) {
        detail::choose_cell_blocks(scorer, src, store_, [&](std::int64_t b) { return store_.claim(layer, b, writes_); },
                                   layer, query, q_heads, plan, opt_, detail::resolve_threads(opt_.num_threads), writes_,
                                   w_, chosen_);
      });
    });
    return detail::write_cells(plan, chosen_, pos, out);
  }

 private:
  static BlockSparseOptions checked(std::int64_t layers, std::int64_t cells, std::int64_t kv_heads, std::int64_t head_dim,
                                    const BlockSparseOptions& opt) {
    const std::string who = "kvscore::CellBlockSelector";
    auto need = [&](bool ok, const char* what, std::int64_t v) {
      if (!ok) detail::throw_invalid(who + ": " + what + " (got " + std::to_string(v) + ")");
    };
    need(layers >= 1, "layers must be >= 1", layers);
    need(cells >= 1, "cells must be >= 1", cells);
    need(kv_heads >= 1, "kv_heads must be >= 1", kv_heads);
    need(head_dim >= 1 && head_dim <= kMaxHeadDim, "head_dim must be in [1, 4096]", head_dim);
    detail::check_cell_options(opt, who);
    return opt;
  }

  std::int64_t L_, n_, kh_, d_, nb_;
  BlockSparseOptions opt_;
  detail::AnyBlockScorer scorer_;
  detail::BlockWrites writes_;
  std::vector<std::uint8_t> in_flight_;
  detail::SummaryStore store_;
  detail::BlockChoiceScratch w_;
  std::vector<std::int64_t> chosen_;
};

/// The cells CellBlockSelector::select attends, from the keys alone: every candidate block's
/// summary made afresh, serially. `in_flight`: the cells of the latest write() (their blocks are
/// attended whole). Returns out[cells] (1: attended).
inline std::vector<std::uint8_t> cell_block_reference(const CellKeys& keys, std::span<const std::int32_t> pos,
                                                      std::span<const std::int64_t> in_flight, const float* query,
                                                      std::int64_t q_heads, double attend,
                                                      const BlockSparseOptions& opt = {}) {
  const std::string who = "kvscore::cell_block_reference";
  detail::check_cell_options(opt, who);
  detail::check_cell_query(keys, pos, query, q_heads, attend, who);
  const std::int64_t nb = (keys.cells + kCellBlockSize - 1) / kCellBlockSize;
  std::vector<std::uint8_t> flight(std::size_t(nb), 0);
  for (const std::int64_t c : in_flight) {
    if (c >= keys.cells) detail::throw_invalid(who + ": in-flight cell " + std::to_string(c) + " is past the cache's " +
                                               std::to_string(keys.cells) + " cells");
    if (c >= 0) flight[std::size_t(c / kCellBlockSize)] = 1;
  }
  const detail::CellPlan plan = detail::plan_cells(pos, flight, attend, opt);
  const detail::BlockWrites writes(nb, kCellBlockSize);
  detail::AnyBlockScorer any = detail::make_block_scorer(opt, 1, keys.head_dim, kCellBlockSize);
  detail::BlockChoiceScratch w;
  std::vector<std::int64_t> chosen;
  detail::visit_cell_keys(keys, [&](const auto& src) {
    detail::visit_scorer(any, [&](const auto& scorer) {
      detail::SummaryStore store(1, nb, keys.kv_heads, scorer.summary_floats(), scorer.code_bytes());
      detail::choose_cell_blocks(scorer, src, store, [](std::int64_t) { return true; }, 0, query, q_heads, plan, opt, 1,
                                 writes, w, chosen);
    });
  });
  std::vector<std::uint8_t> out(std::size_t(keys.cells));
  detail::write_cells(plan, chosen, pos, out);
  return out;
}

}  // namespace kvscore
