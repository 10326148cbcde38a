// kvscore/block_sparse/options.hpp — what block-sparse decode is asked to do (docs/reference/block_sparse.md):
// the score, the protected blocks (sinks, local window), the refresh interval, the threads; how
// many blocks a decode step attends (attended_blocks) and the row a step hands the selector
// (BlockSparseRow). Every default the vLLM plugin shows is a constant here (the binding exports
// them: kvscore._kvscore.struct_defaults["BlockSparseOptions"] and kDefaultDenseBelow).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "kvscore/core/names.hpp"
#include "kvscore/core/view.hpp"
#include "kvscore/methods.hpp"
#include "kvscore/paged.hpp"

namespace kvscore {

/// How a block is scored for a query (block_sparse/scorers.hpp: one scorer per score).
enum class BlockScore { quest, meanstd, int4, pariskv, exact };

inline constexpr BlockScore kBlockScores[] = {BlockScore::quest, BlockScore::meanstd, BlockScore::int4,
                                              BlockScore::pariskv, BlockScore::exact};

inline const char* to_string(BlockScore s) noexcept {
  switch (s) {
    case BlockScore::quest: return "quest";
    case BlockScore::meanstd: return "meanstd";
    case BlockScore::int4: return "int4";
    case BlockScore::pariskv: return "pariskv";
    case BlockScore::exact: return "exact";
  }
  return "?";
}

inline BlockScore parse_block_score(std::string_view s) { return detail::parse_enum(s, kBlockScores, "block score"); }

/// Which queries score the blocks of a KV head: each of its query heads (GQA: G of them), or one,
/// their mean (G times less scoring; the group's shares of attention are then estimated as one).
enum class QueryGroup { heads, mean };

inline constexpr QueryGroup kQueryGroups[] = {QueryGroup::heads, QueryGroup::mean};

inline const char* to_string(QueryGroup g) noexcept { return g == QueryGroup::mean ? "mean" : "heads"; }

inline QueryGroup parse_query_group(std::string_view s) { return detail::parse_enum(s, kQueryGroups, "query group"); }

/// The defaults of block-sparse decode, the library's and the vLLM plugin's (one value each).
inline constexpr BlockScore kDefaultBlockScore = BlockScore::int4;
inline constexpr std::int64_t kDefaultBlockSparseLocal = 64;
/// int4 scores every candidate: Quest's prefilter lost answers (its bound is loose on 32-token
/// blocks) and cost more than the int4 pass it saved (docs/results/block-sparse.md).
inline constexpr std::int64_t kDefaultBlockSparsePrefilter = 0;
/// A sequence's blocks are scored at every step: a choice kept even one step lost answers on
/// the needle benchmark (docs/results/vllm.md#sparse-decode-answers).
inline constexpr std::int64_t kDefaultBlockSparseRefresh = 1;
/// Sequences shorter than this decode densely (BlockSparsePlanner, the vLLM plugin's dense_below).
inline constexpr std::int64_t kDefaultDenseBelow = 1024;

struct BlockSparseOptions {
  BlockScore score = kDefaultBlockScore;
  std::int64_t sinks = kDefaultSinks;             ///< positions [0, sinks): their blocks are always attended, >= 0
  std::int64_t local = kDefaultBlockSparseLocal;  ///< positions [tokens − local, tokens): their blocks too (the last block always), >= 0
  /// The attention's softmax scale (0: 1/√head_dim), which turns block scores into each query
  /// head's estimated share of attention per block (docs/reference/block_sparse.md).
  float scale = 0.f;
  /// int4: each query head scores exactly (on the codes) its best prefilter·k blocks by Quest's
  /// bound, k being the blocks still to choose (0: every candidate)
  std::int64_t prefilter = kDefaultBlockSparsePrefilter;
  QueryGroup group = QueryGroup::heads;  ///< the queries that score a KV head's blocks
  /// A sequence's blocks are scored every `refresh` steps (per layer); in between its last choice
  /// stands (the protected blocks follow the sequence's end; a block the window let go fills in
  /// for one it took). 1 = every step. (block_sparse/refresh.hpp: the policy and its triggers.)
  std::int64_t refresh = kDefaultBlockSparseRefresh;
  int num_threads = 0;      ///< threads over rows (0 = OpenMP's default); the result is the same for any
  /// Also choose with `exact` and count how many of its chosen blocks the score chose
  /// (PagedBlockSelector::probe()): the recall of the exact block choice, for benchmarks.
  bool probe = false;
};

namespace detail {

inline void check_block_sparse(const BlockSparseOptions& o, const char* who) {
  if (o.sinks < 0) throw_invalid(std::string(who) + ": sinks must be >= 0 (got " + std::to_string(o.sinks) + ")");
  if (o.local < 0) throw_invalid(std::string(who) + ": local must be >= 0 (got " + std::to_string(o.local) + ")");
  if (o.refresh < 1)
    throw_invalid(std::string(who) + ": refresh must be >= 1 (got " + std::to_string(o.refresh) + ")");
  if (o.prefilter < 0)
    throw_invalid(std::string(who) + ": prefilter must be >= 0 (got " + std::to_string(o.prefilter) + ")");
  if (!(o.scale >= 0) || !std::isfinite(o.scale))
    throw_invalid(std::string(who) + ": scale must be >= 0 and finite (got " + std::to_string(o.scale) + ")");
}

/// Logical blocks [0, sink_end) and [local_begin, blocks) of a sequence are protected.
struct ProtectedBlocks {
  std::int64_t blocks = 0, sink_end = 0, local_begin = 0;
  std::int64_t count() const noexcept { return std::min(sink_end, local_begin) + (blocks - local_begin); }
  bool contains(std::int64_t b) const noexcept { return b < sink_end || b >= local_begin; }
};

inline ProtectedBlocks protected_blocks_of(std::int64_t tokens, std::int64_t bs, const BlockSparseOptions& o) {
  ProtectedBlocks p;
  p.blocks = blocks_for(tokens, bs);
  p.sink_end = std::min(p.blocks, blocks_for(std::min(o.sinks, tokens), bs));
  const std::int64_t first_local_token = std::max<std::int64_t>(0, tokens - std::max<std::int64_t>(o.local, 1));
  p.local_begin = std::min(p.blocks, first_local_token / bs);
  return p;
}

inline void check_query(const float* q, std::int64_t n, const std::string& at) {
  if (q == nullptr) throw_invalid(at + ": query is null");
  for (std::int64_t j = 0; j < n; ++j)
    if (!std::isfinite(q[j]))
      throw_invalid(at + ": query element " + std::to_string(j) + " is not finite (" + std::to_string(q[j]) + ")");
}

}  // namespace detail

/// Blocks a decode step of a sequence of `tokens` attends: `attend` is a fraction of its tokens
/// in (0, 1] or, above 1, a whole count of tokens; ⌈attend·tokens⌉ (or the count) tokens rounded
/// up to whole blocks, never fewer than the protected blocks (sinks, local, last), never more
/// than the sequence's blocks. Equal to blocks_for(tokens) means: attend densely.
inline std::int64_t attended_blocks(std::int64_t tokens, std::int64_t block_size, double attend,
                                    const BlockSparseOptions& opt = {}) {
  const std::string who = "kvscore::attended_blocks";
  if (block_size <= 0) detail::throw_invalid(who + ": block_size must be > 0 (got " + std::to_string(block_size) + ")");
  if (tokens < 0) detail::throw_invalid(who + ": tokens must be >= 0 (got " + std::to_string(tokens) + ")");
  if (!(attend > 0) || !std::isfinite(attend) || (attend > 1 && attend != std::floor(attend)))
    detail::throw_invalid(who + ": attend " + std::to_string(attend) +
                          " must be a fraction in (0, 1] or a whole count of tokens > 1");
  detail::check_block_sparse(opt, who.c_str());
  const std::int64_t blocks = blocks_for(tokens, block_size);
  // ⌈x·N·(1 − 1e−12)⌉: float fuzz in attend·tokens (0.1·8000 = 800.0000000000001) adds no token
  const double want = attend <= 1 ? std::ceil(attend * double(tokens) * (1.0 - 1e-12)) : attend;
  const std::int64_t want_blocks = blocks_for(std::int64_t(std::min(want, double(tokens))), block_size);
  const std::int64_t prot = detail::protected_blocks_of(tokens, block_size, opt).count();
  return std::min(blocks, std::max(want_blocks, prot));
}

/// One decode row of a step: its block table (compacted: every entry a block it holds, in
/// logical order), its length, its query heads, how many blocks to attend, where to write them.
struct BlockSparseRow {
  std::span<const std::int32_t> table;  ///< >= blocks_for(tokens) physical ids
  std::int64_t tokens = 0;              ///< the sequence's length (its last block may be partial)
  const float* query = nullptr;         ///< [q_heads][head_dim] this step's query (post-RoPE), fp32
  std::int64_t attend = 0;              ///< blocks to attend: attended_blocks(...), in [protected, blocks]
  std::int32_t* out = nullptr;          ///< [attend] chosen physical ids, ascending logical order
  std::uint8_t* fresh = nullptr;        ///< optional: set to 1 when scored this step, 0 when a kept choice stood
  /// The sequence's key (its kept choice and ParisKV index are found by it); -1: its first block,
  /// table[0]. An engine whose sequences share blocks (prefix caching: a shared first block) gives
  /// each sequence its own key; the rows of a call need distinct keys.
  std::int64_t seq = -1;
};

/// The key a row's sequence state is found by: BlockSparseRow::seq, or its first block.
inline std::int64_t row_sequence(const BlockSparseRow& r) noexcept {
  return r.seq >= 0 ? r.seq : std::int64_t(r.table[0]);
}

}  // namespace kvscore
