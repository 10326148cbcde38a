// The method contract (include/kvscore/contract.hpp): every method satisfies its concept
// (static_assert, so a broken shape fails the build), things that are not methods do not, and
// protected_recent(s) gives the selector what each scorer needs protected.
#include <catch2/catch.hpp>

#include <kvscore/contract.hpp>
#include <kvscore/kvscore.hpp>
#include <kvscore/methods.hpp>

#include <cstdint>
#include <string_view>
#include <vector>

namespace {

// ---------------------------------------------------------------- scorers
static_assert(kvscore::Scorer<kvscore::KNorm>);
static_assert(kvscore::Scorer<kvscore::KeyDiff>);
static_assert(kvscore::Scorer<kvscore::ManifoldL2>);
static_assert(kvscore::Scorer<kvscore::WindowedManifoldL2>);
static_assert(kvscore::Scorer<kvscore::QFilter>);
static_assert(kvscore::Scorer<kvscore::SnapKV>);
static_assert(kvscore::Scorer<kvscore::ProtoKV>);
static_assert(kvscore::Scorer<kvscore::KVzip>);
static_assert(kvscore::Scorer<kvscore::OjaResidual>);
// query-aware scorers tell the selector what to protect; the others need nothing
static_assert(kvscore::QueryScorer<kvscore::SnapKV>);
static_assert(kvscore::QueryScorer<kvscore::ProtoKV>);
static_assert(kvscore::QueryScorer<kvscore::KVzip>);
static_assert(kvscore::QueryScorer<kvscore::OjaResidual>);
static_assert(!kvscore::QueryScorer<kvscore::KNorm>);
static_assert(!kvscore::QueryScorer<kvscore::QFilter>);

// ---------------------------------------------------------------- retrievers and stores
static_assert(kvscore::Retriever<kvscore::ParisKVCache<float>>);
static_assert(kvscore::Retriever<kvscore::ParisKVCache<kvscore::half>>);
static_assert(kvscore::Retriever<kvscore::ParisKVCache<kvscore::bfloat16>>);
static_assert(kvscore::HybridStore<kvscore::OjaHybridCache, kvscore::OjaProjector>);

// ---------------------------------------------------------------- the registry (kvscore/methods.hpp)
// Each scorer's S::name is its registry entry's CLI spelling, the entry names the type, and the
// entry's kind agrees with the concept it satisfies.
template <class S>
constexpr bool registered_as(std::string_view cls) {
  const int i = kvscore::method_index(S::name);
  if (i < 0) return false;
  const kvscore::MethodInfo& m = kvscore::kMethods[std::size_t(i)];
  return m.cli == std::string_view(S::name) && m.cls == cls &&
         (m.kind == kvscore::MethodKind::query_scorer) == kvscore::QueryScorer<S> && kvscore::is_scorer(m);
}
static_assert(registered_as<kvscore::KNorm>("KNorm"));
static_assert(registered_as<kvscore::KeyDiff>("KeyDiff"));
static_assert(registered_as<kvscore::ManifoldL2>("ManifoldL2"));
static_assert(registered_as<kvscore::WindowedManifoldL2>("WindowedManifoldL2"));
static_assert(registered_as<kvscore::QFilter>("QFilter"));
static_assert(registered_as<kvscore::SnapKV>("SnapKV"));
static_assert(registered_as<kvscore::ProtoKV>("ProtoKV"));
static_assert(registered_as<kvscore::KVzip>("KVzip"));
static_assert(kvscore::kMethods[std::size_t(kvscore::method_index("pariskv"))].kind == kvscore::MethodKind::retriever);
static_assert(kvscore::kMethods[std::size_t(kvscore::method_index("ojakv"))].kind == kvscore::MethodKind::hybrid);
// OjaResidual is a part of ojakv (its full-rank rule), not a method of its own
static_assert(kvscore::method_index(kvscore::OjaResidual::name) == -1);

// ---------------------------------------------------------------- not methods
struct NoName : kvscore::ScorerOptions {  // the right calls but no `name`
  template <class V>
  kvscore::Scores score(const V&) const;
  template <class V>
  void score(const V&, kvscore::ScoresView) const;
};
struct NoOptions {  // a name and the calls, but no threads / ISA options
  static constexpr const char* name = "x";
  template <class V>
  kvscore::Scores score(const V&) const;
  template <class V>
  void score(const V&, kvscore::ScoresView) const;
};
static_assert(!kvscore::Scorer<NoName>);
static_assert(!kvscore::Scorer<NoOptions>);
static_assert(!kvscore::Scorer<kvscore::Selection>);
static_assert(!kvscore::Scorer<int>);
static_assert(!kvscore::Retriever<kvscore::ParisKV>);  // the index alone: no values, no select(q)
static_assert(!kvscore::HybridStore<kvscore::OjaHybridCache, int>);

}  // namespace

TEST_CASE("contract: protected_recent follows each scorer's query placement", "[contract]") {
  const std::int64_t qh = 4, w = 8, d = 16;
  const std::vector<float> q(static_cast<std::size_t>(qh * w * d), 0.5f);
  kvscore::SnapKV snap(q.data(), qh, w, d);
  kvscore::ProtoKV proto(q.data(), qh, w, d);
  kvscore::KVzip zip(q.data(), qh, w, d);
  const std::vector<Eigen::MatrixXd> bases(2, kvscore::oja::random_orthonormal(d, 4, 1));
  kvscore::OjaResidual oja(q.data(), qh, w, d, bases);
  CHECK(kvscore::protected_recent(kvscore::KNorm{}) == 0);
  CHECK(kvscore::protected_recent(kvscore::KeyDiff{}) == 0);
  CHECK(kvscore::protected_recent(snap) == w);
  CHECK(kvscore::protected_recent(proto) == w);
  CHECK(kvscore::protected_recent(oja) == w);
  CHECK(kvscore::protected_recent(zip) == w);
  snap.placement = proto.placement = oja.placement = zip.placement = kvscore::QueryPlacement::after_cache;
  CHECK(kvscore::protected_recent(zip) == 0);
  CHECK(kvscore::protected_recent(snap) == 0);
  CHECK(kvscore::protected_recent(proto) == 0);
  CHECK(kvscore::protected_recent(oja) == 0);
}
