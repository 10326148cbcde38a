// kvscore/contract.hpp — the method contract as C++20 concepts (docs/design/architecture.md "The
// contract"). Every method in the tree satisfies one of them, and tests/test_contract.cpp
// checks each with static_assert; a new method is added by satisfying one.
//
//   Scorer        score(keys) -> Scores [heads][tokens] (higher = keep) for fp32/fp16/bf16 key
//                 views, score(keys, out) into caller memory, a `name`, ScorerOptions (threads,
//                 ISA). KNorm, KeyDiff, ManifoldL2, WindowedManifoldL2, QFilter, SnapKV,
//                 ProtoKV, OjaResidual. Their scores go to kvscore::select.
//   QueryScorer   a Scorer whose window queries sit in the cache: protected_recent() is the
//                 number of last tokens the selector must protect (SelectOptions::recent).
//                 SnapKV, ProtoKV, OjaResidual. protected_recent(s) answers for any Scorer.
//   Retriever     a decode-time index over one KV head: append(k, v, n) rows, select(q) ->
//                 the positions one query attends (ascending), attend(q, out, ws). ParisKVCache.
//   HybridStore   a store holding most tokens in another form (codes) and some exactly:
//                 tokens(), reconstruct_keys/values(h), attention(h, q), memory(h, bytes), and
//                 append(projectors, k, v, q, q_heads) during generation. OjaHybridCache.
#pragma once

#include <concepts>
#include <cstdint>
#include <vector>

#include "kvscore/core/dtype.hpp"
#include "kvscore/core/scorer_options.hpp"
#include "kvscore/core/selection.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore {

template <class S>
concept Scorer = std::derived_from<S, ScorerOptions> &&
    requires(const S& s, const KeysView<float>& f32, const KeysView<half>& f16, const KeysView<bfloat16>& bf16,
             ScoresView out) {
      { S::name } -> std::convertible_to<const char*>;
      { s.score(f32) } -> std::same_as<Scores>;
      { s.score(f16) } -> std::same_as<Scores>;
      { s.score(bf16) } -> std::same_as<Scores>;
      s.score(f32, out);
    };

template <class S>
concept QueryScorer = Scorer<S> && requires(const S& s) {
  { s.protected_recent() } -> std::convertible_to<std::int64_t>;
};

/// The last tokens the selector must protect for scores of `s` (SelectOptions::recent): a
/// QueryScorer's in-cache window, 0 for every other scorer.
template <Scorer S>
std::int64_t protected_recent(const S& s) noexcept {
  if constexpr (QueryScorer<S>)
    return std::int64_t(s.protected_recent());
  else
    return 0;
}

template <class R>
concept Retriever = requires(R& r, const R& cr, const typename R::value_type* rows, const float* q, float* out,
                             typename R::Workspace& ws) {
  r.append(rows, rows, std::int64_t{1});
  { cr.size() } -> std::convertible_to<std::int64_t>;
  { cr.select(q) } -> std::same_as<std::vector<std::int64_t>>;
  cr.attend(q, out, ws);
};

template <class S, class Projector>
concept HybridStore = requires(S& s, const S& cs, std::vector<Projector>& proj, const float* row, std::int64_t h) {
  { cs.heads() } -> std::convertible_to<std::int64_t>;
  { cs.tokens() } -> std::convertible_to<std::int64_t>;
  cs.reconstruct_keys(h);
  cs.reconstruct_values(h);
  cs.attention(h, row);
  cs.memory(h, std::int64_t{2});
  s.append(proj, row, row, row, std::int64_t{1});
};

}  // namespace kvscore
