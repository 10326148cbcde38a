// kvscore/make_scorer.hpp — the registry's constructors for its scorers: every method
// of kvscore/methods.hpp whose kind is scorer or query_scorer, built by name from one argument
// struct and held by one type.
//
// [snippet make-scorer-header: tests/test_snippets.cpp]
//   ScorerArgs args;  args.queries = q;  args.q_heads = 32;  args.n_queries = 64;  args.head_dim = 128;
//   const AnyScorer snap = make_scorer("snapkv", args);      // any spelling kMethods accepts
//   Scores scores = snap.score(keys);                         // fp32, fp16 or bf16 keys
//   Selection top = select(scores, budget, {.recent = snap.protected_recent()});
//
// The CLI (`kvscore score`) and the evaluator's scorer methods build scorers here (Python
// keeps one class per scorer, named from the same registry). Adding a scorer: its kMethods entry, its type in
// ScorerTypes and one build() overload below; the static_asserts at the bottom fail until the
// three agree, so no front end can miss it.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "kvscore/contract.hpp"
#include "kvscore/methods.hpp"
#include "kvscore/scorers/keydiff.hpp"
#include "kvscore/scorers/knorm.hpp"
#include "kvscore/scorers/kvzip.hpp"
#include "kvscore/scorers/manifold_l2.hpp"
#include "kvscore/scorers/protokv.hpp"
#include "kvscore/scorers/qfilter.hpp"
#include "kvscore/scorers/snapkv.hpp"
#include "kvscore/scorers/windowed_manifold_l2.hpp"

namespace kvscore {

/// Every scorer type of the registry, in kMethods' order.
using ScorerTypes = std::tuple<KNorm, KeyDiff, ManifoldL2, WindowedManifoldL2, QFilter, SnapKV, ProtoKV, KVzip>;

/// What a scorer may need beyond the keys; each scorer reads its part (its registry entry's
/// `options`, kvscore/methods.hpp) and ignores the rest. The defaults are the registry's.
struct ScorerArgs {
  int threads = 0;                          ///< ScorerOptions::num_threads (0 = OpenMP default)
  const simd::KernelTable* isa = nullptr;   ///< ScorerOptions::isa (nullptr = the active table)
  std::int64_t window = kDefaultWindow;     ///< windowed_manifold_l2: W
  WindowTail window_tail = WindowTail::merge;  ///< windowed_manifold_l2: the final partial window
  /// qfilter: filters [kv_heads][head_dim] in kvscore's convention (QFilter::filters()); empty =
  /// calibrate_qfilters on `queries` (the evaluator's choice).
  std::vector<float> filters;
  std::int64_t kv_heads = 0;                ///< qfilter: filter rows
  /// snapkv, protokv, kvzip (and qfilter's calibration): [q_heads][n_queries][head_dim] fp32, row-major.
  const float* queries = nullptr;
  std::int64_t q_heads = 0;    ///< snapkv, protokv, kvzip: query heads of `queries`
  std::int64_t n_queries = 0;  ///< queries per head
  std::int64_t head_dim = 0;   ///< dimensions of a query
  std::int64_t group = 0;                   ///< snapkv, protokv, kvzip: q_heads / kv_heads, 0 = from the keys
  QueryPlacement placement = QueryPlacement::in_cache;  ///< snapkv, protokv, kvzip
  QueryAggregate aggregate = QueryAggregate::max;       ///< kvzip: max (KVzip) or mean over the queries
  std::int64_t kernel_size = kDefaultSnapKVKernel;      ///< snapkv: pooling kernel, odd >= 1
  // protokv (docs/methods/protokv.md)
  std::uint64_t seed = 0;                                   ///< RFF seed
  std::int64_t kappa = kDefaultProtoKVKappa;                ///< neighbourhood radius κ >= 1
  std::int64_t sat_candidates = kDefaultProtoKVSatCandidates;  ///< SAT candidates p in [0, tokens]
  int lsh_bits = kDefaultProtoKVLshBits;                    ///< LSH bits r in [0, 16]
  std::int64_t chunks = kDefaultProtoKVChunks;              ///< PDT chunks v >= 0
  double bandwidth = 0;                                     ///< RFF bandwidth σ > 0, 0 = median
  ProtoKV::Psi psi = ProtoKV::Psi::attention;               ///< cluster score ψ
};

namespace detail {

template <class Tuple>
struct variant_of;
template <class... S>
struct variant_of<std::tuple<S...>> {
  using type = std::variant<S...>;
};

inline void need_queries(const ScorerArgs& a, const char* method) {
  if (a.queries == nullptr)
    throw std::invalid_argument(std::string("kvscore::make_scorer: method '") + method +
                                "' needs queries (ScorerArgs::queries is null)");
}

// One build() per scorer: how ScorerArgs become that scorer.
inline KNorm build(std::type_identity<KNorm>, const ScorerArgs&) { return {}; }
inline KeyDiff build(std::type_identity<KeyDiff>, const ScorerArgs&) { return {}; }
inline ManifoldL2 build(std::type_identity<ManifoldL2>, const ScorerArgs&) { return {}; }
inline WindowedManifoldL2 build(std::type_identity<WindowedManifoldL2>, const ScorerArgs& a) {
  return WindowedManifoldL2(a.window, a.window_tail);
}
inline QFilter build(std::type_identity<QFilter>, const ScorerArgs& a) {
  if (!a.filters.empty()) return QFilter(a.filters, a.kv_heads, a.head_dim);
  if (a.queries == nullptr)
    throw std::invalid_argument("kvscore::make_scorer: method 'qfilter' needs filters or queries to calibrate on");
  return QFilter(calibrate_qfilters(a.queries, a.q_heads, a.n_queries, a.head_dim, a.kv_heads), a.kv_heads,
                 a.head_dim);
}
inline SnapKV build(std::type_identity<SnapKV>, const ScorerArgs& a) {
  need_queries(a, "snapkv");
  SnapKV s(a.queries, a.q_heads, a.n_queries, a.head_dim, a.group);
  s.placement = a.placement;
  s.kernel_size = a.kernel_size;
  return s;
}
inline ProtoKV build(std::type_identity<ProtoKV>, const ScorerArgs& a) {
  need_queries(a, "protokv");
  ProtoKV s(a.queries, a.q_heads, a.n_queries, a.head_dim, a.group);
  s.placement = a.placement, s.seed = a.seed, s.kappa = a.kappa, s.sat_candidates = a.sat_candidates;
  s.lsh_bits = a.lsh_bits, s.chunks = a.chunks, s.bandwidth = a.bandwidth, s.psi = a.psi;
  return s;
}

inline KVzip build(std::type_identity<KVzip>, const ScorerArgs& a) {
  need_queries(a, "kvzip");
  KVzip s(a.queries, a.q_heads, a.n_queries, a.head_dim, a.group);
  s.placement = a.placement;
  s.aggregate = a.aggregate;
  return s;
}

}  // namespace detail

/// One scorer of the registry, whichever it is: the Scorer contract behind one type.
class AnyScorer {
 public:
  /// A std::variant of every scorer type (ScorerTypes).
  using Variant = typename detail::variant_of<ScorerTypes>::type;

  /// Holds scorer `s`.
  template <Scorer S>
  explicit AnyScorer(S s) : s_(std::move(s)) {}

  /// The scorer's score(keys): fp32 [heads][tokens].
  template <KeyCacheView View>
  Scores score(const View& keys) const {
    return std::visit([&](const auto& s) { return s.score(keys); }, s_);
  }
  /// The scorer's score(keys, out), into the caller's scores.
  template <KeyCacheView View>
  void score(const View& keys, ScoresView out) const {
    std::visit([&](const auto& s) { s.score(keys, out); }, s_);
  }
  /// The last tokens the selector must protect (SelectOptions::recent); 0 for query-agnostic scorers.
  std::int64_t protected_recent() const noexcept {
    return std::visit([](const auto& s) { return kvscore::protected_recent(s); }, s_);
  }
  /// The scorer's registry spelling (S::name).
  const char* name() const noexcept {
    return std::visit([](const auto& s) { return std::decay_t<decltype(s)>::name; }, s_);
  }
  /// The scorer itself when it is an S, else nullptr.
  template <class S>
  const S* get() const noexcept { return std::get_if<S>(&s_); }
  /// \overload
  template <class S>
  S* get() noexcept { return std::get_if<S>(&s_); }
  /// Execution options common to every scorer.
  ScorerOptions& options() noexcept {
    return std::visit([](auto& s) -> ScorerOptions& { return s; }, s_);
  }

 private:
  Variant s_;
};

namespace detail {

template <std::size_t I>
using scorer_type = std::tuple_element_t<I, ScorerTypes>;

/// The registry entry of scorer type S.
template <class S>
constexpr const MethodInfo& entry_of() noexcept {
  return kMethods[std::size_t(method_index(S::name))];
}

template <std::size_t... I>
std::optional<AnyScorer> build_named(std::string_view name, const ScorerArgs& a, std::index_sequence<I...>) {
  std::optional<AnyScorer> out;
  ((!out && entry_of<scorer_type<I>>().name == name ? void(out.emplace(build(std::type_identity<scorer_type<I>>{}, a)))
                                                    : void()),
   ...);
  return out;
}

// The type list and kMethods agree: each type satisfies its concept, names a kMethods entry of
// its kind, and there are as many types as kMethods has scorers.
template <std::size_t... I>
constexpr bool scorer_types_match_registry(std::index_sequence<I...>) {
  std::size_t scorers = 0;
  for (const MethodInfo& m : kMethods) scorers += is_scorer(m) ? 1 : 0;
  return sizeof...(I) == scorers &&
         ((Scorer<scorer_type<I>> && method_index(scorer_type<I>::name) >= 0 &&
           entry_of<scorer_type<I>>().kind ==
               (QueryScorer<scorer_type<I>> ? MethodKind::query_scorer : MethodKind::scorer)) &&
          ...);
}
static_assert(scorer_types_match_registry(std::make_index_sequence<std::tuple_size_v<ScorerTypes>>{}),
              "ScorerTypes and kMethods disagree: a scorer is in one list only, or of another kind");

}  // namespace detail

/// The scorer a spelling of kvscore/methods.hpp names, built from `a`. std::invalid_argument for
/// an unknown name (listing the known ones), for a method that is not a scorer, and for
/// arguments the scorer rejects (its own message).
inline AnyScorer make_scorer(std::string_view spelling, const ScorerArgs& a) {
  const MethodInfo& m = method_info(spelling);
  std::optional<AnyScorer> s =
      detail::build_named(m.name, a, std::make_index_sequence<std::tuple_size_v<ScorerTypes>>{});
  if (!s)
    throw std::invalid_argument("kvscore::make_scorer: method '" + std::string(spelling) + "' is a " +
                                std::string(kind_name(m.kind)) + ", not a scorer (scorers: " +
                                method_list(is_scorer) + ")");
  ScorerOptions& o = s->options();
  o.num_threads = a.threads;
  o.isa = a.isa;
  return std::move(*s);
}

}  // namespace kvscore
