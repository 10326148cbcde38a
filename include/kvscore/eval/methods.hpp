// kvscore/eval/methods.hpp — the evaluator's method registry: what `kvscore eval --methods`
// can name, and how each method turns one layer's cache into the tokens it keeps.
//
// A method is a name plus a function (layer, per-head budget n, options) -> Compressed:
//   * selection methods (scorers + the selector, StreamingLLM) fill `kept`, one set per
//     KV head shared by the head's queries;
//   * retrieval methods (ParisKV) fill `per_query`, one set per (query head, query);
//   * hybrid methods (OjaKV: kept tokens full rank, the rest low rank) fill `kept` and
//     `output`, which returns the method's own attention output for a query (the
//     evaluator then measures recall/overlap on `kept` and the error of `output`).
// The evaluator times the whole call (scoring + selection), so a method should do all its
// work inside it. `output` is called from several threads at once and must be const-safe.
//
// The built-in methods are kvscore/methods.hpp's list, in its order, under their CLI spelling
// (every alias resolves too); builtin_run() gives each its function. A method outside the
// library is added at run time: register_method({"mine", "summary", fn}) before evaluate().
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvscore/detail/compiled.hpp"
#include "kvscore/core/view.hpp"
#include "kvscore/make_method.hpp"
#include "kvscore/methods.hpp"
#include "kvscore/select.hpp"

namespace kvscore::eval {

/// One layer of the evaluator's input, fp32, C order:
/// keys [kv_heads][tokens][head_dim], values [kv_heads][tokens][value_dim],
/// queries [q_heads][n_queries][head_dim]; query head hq belongs to KV head hq / group().
/// The leak-free protocol (Protocol::leak_free) adds the queries an engine has when it
/// compresses: window_queries [q_heads][n_window][head_dim], the cache's own last n_window
/// positions, and calib_queries [q_heads][n_calib][head_dim] from other text (Q-Filters'
/// calibration; optional). `queries` then only measure (they follow the cache).
struct LayerInput {
  const float* keys = nullptr;  ///< [kv_heads][tokens][head_dim] fp32
  const float* values = nullptr;  ///< [kv_heads][tokens][value_dim] fp32
  const float* queries = nullptr;  ///< [q_heads][n_queries][head_dim] fp32, the evaluation queries
  std::int64_t kv_heads = 0;   ///< KV heads
  std::int64_t tokens = 0;     ///< tokens of the cache
  std::int64_t head_dim = 0;   ///< dimensions of a key and a query
  std::int64_t value_dim = 0;  ///< dimensions of a value
  std::int64_t q_heads = 0;    ///< query heads (a multiple of kv_heads)
  std::int64_t n_queries = 0;  ///< evaluation queries per query head
  /// Leak-free: [q_heads][n_window][head_dim], the cache's last-window queries (or null).
  const float* window_queries = nullptr;
  std::int64_t n_window = 0;  ///< window queries per query head
  const float* calib_queries = nullptr;  ///< leak-free: [q_heads][n_calib][head_dim] from other text (or null)
  std::int64_t n_calib = 0;  ///< calibration queries per query head

  std::int64_t group() const noexcept { return kv_heads > 0 ? q_heads / kv_heads : 0; }  ///< q_heads / kv_heads
  /// The keys as a view.
  KeysView<float> key_view() const { return KeysView<float>(keys, kv_heads, tokens, head_dim, tokens * head_dim, head_dim); }
  /// Query i of query head hq.
  const float* query(std::int64_t hq, std::int64_t i) const noexcept {
    return queries + (hq * n_queries + i) * head_dim;
  }
};

/// Which queries a method may see (docs/reference/evaluate.md "Protocols").
///  * shared: every method sees the evaluation queries (query-aware methods are scored on the
///    very queries that measure them; Q-Filters are calibrated on them): an upper bound.
///  * leak_free: as in an engine. snapkv, protokv and ojakv see only the cache's last-window
///    queries (LayerInput::window_queries, in the cache: causal mask, window protected), qfilter
///    is calibrated on LayerInput::calib_queries (other text; skipped without them), and the
///    evaluation queries only measure. pariskv retrieves per decode query (it sees the query
///    it answers, as at decode time); the oracle stays the ceiling on the evaluation queries.
enum class Protocol { shared, leak_free };

/// Every Protocol (parse_protocol reads these).
inline constexpr Protocol kProtocols[] = {Protocol::leak_free, Protocol::shared};

/// "leak_free" (the CLI and the report: "leak-free") or "shared".
inline const char* to_string(Protocol p) noexcept { return p == Protocol::leak_free ? "leak_free" : "shared"; }
/// "leak_free" (or "leak-free") or "shared"; anything else is std::invalid_argument naming it.
inline Protocol parse_protocol(std::string_view s) { return kvscore::detail::parse_enum(s, kProtocols, "protocol"); }

/// Options shared by every method (from the command line).
struct MethodOptions {
  SelectOptions select;        ///< sinks, recent, alloc (per_head / adakv), threads
  std::int64_t window = kDefaultWindow;  ///< windowed-l2: window W (manifoldkv.txt Alg. 2 default)
  WindowTail window_tail = WindowTail::merge;  ///< windowed-l2: the final partial window (--window-tail)
  std::int64_t streaming_sinks = kDefaultSinks;  ///< streaming_llm sinks when select.sinks is 0 (Xiao et al.)
  /// snapkv, protokv, ojakv: where the evaluation queries sit (--query-placement). A dump's
  /// queries follow its cache (tools/dump_kv.py, kvscore synth), hence after_cache: no causal
  /// mask, no protection beyond --recent. in_cache treats them as the cache's last n_q positions.
  QueryPlacement placement = QueryPlacement::after_cache;
  Protocol protocol = Protocol::shared;  ///< which queries the methods see (leak_free: the window's, in-cache)
  int threads = 0;             ///< scorer threads (0 = OpenMP default)
};

/// What a method keeps for one layer (see the top of this file).
struct Compressed {
  Selection kept;  ///< retention, scoring and rules: the kept positions per KV head
  std::vector<std::vector<std::int64_t>> per_query;  ///< retrieval: [hq * n_queries + i], ascending
  std::function<void(std::int64_t hq, std::int64_t i, double* out)> output;  ///< hybrid: value_dim outputs
};

/// A method as the evaluator runs it: one layer and a per-head budget in, what it keeps out.
using MethodFn = std::function<Compressed(const LayerInput&, std::int64_t per_head_budget, const MethodOptions&)>;

/// A registered method: its name, summary and function.
struct Method {
  std::string name;     ///< as given to --methods
  std::string summary;  ///< one line for --help and docs
  MethodFn run;  ///< what it keeps for one layer
};

/// Selection from scores with the command line's protection and allocation.
inline Compressed select_scores(const Scores& s, std::int64_t n, const MethodOptions& o, std::int64_t min_recent = 0) {
  SelectOptions so = o.select;
  so.recent = std::max(so.recent, min_recent);
  Compressed c;
  c.kept = select(s, Budget::per_head(n), so);
  return c;
}

/// The oracle: keeps the tokens with the largest mean full-attention probability over the
/// head's evaluation queries — the ceiling a query-agnostic eviction could reach (it sees
/// the very queries it is scored on).
Compressed oracle_method(const LayerInput& in, std::int64_t n, const MethodOptions& o);

/// Ranks of OjaKV's bases in the evaluator: r = max(1, head_dim / 4) for keys and values
/// (32 of 128), seeded random start + prefill (docs/methods/ojakv.md defaults), so the low-rank part
/// costs a quarter of the full cache and the budget n is the number of full-rank tokens.
inline std::int64_t ojakv_eval_rank(std::int64_t head_dim) noexcept { return std::max<std::int64_t>(1, head_dim / 4); }

/// OjaKV as hybrid attention (make_hybrid): per KV head a projector (seeded random start,
/// prefill on the layer's keys and values), the n tokens with the largest query-weighted
/// residual (the evaluation queries as the window) kept full rank through the selector, every
/// other token as low-rank codes; `output` is the hybrid cache's reference attention.
Compressed hybrid_method(std::string_view spelling, const LayerInput& in, std::int64_t n, const MethodOptions& o);

/// A retriever of the registry (make_retriever<float> with RetrieverArgs::budget = n): one
/// index per KV head (built inside the timed call), one search per (query head, query) with
/// the paper's length-adaptive (beta, rho); no protection. `pariskv` keeps its zones
/// (pariskv_zones(n): sinks min(4, n), local window min(256, ⌊(n − sinks)/2⌋), the rest
/// retrieved per query; docs/reference/evaluate.md), `pariskv_flat` retrieves all n.
Compressed retriever_method(std::string_view spelling, const LayerInput& in, std::int64_t n);
using kvscore::ParisKVZones;
using kvscore::pariskv_zones;

/// The evaluator's function for a method of kvscore/methods.hpp (by its canonical name);
/// empty for a name it does not know.
MethodFn builtin_run(std::string_view name);

/// The methods `--methods all` runs, in report order: kMethods under their CLI spelling.
std::vector<Method> builtin_methods();

/// The registry (built-ins first); register_method() appends to it.
inline std::vector<Method>& registry() {
  static std::vector<Method> r = builtin_methods();
  return r;
}

/// The registered method a spelling names: its registered name, or any spelling of a
/// built-in (kvscore/methods.hpp: `manifold_l2`, `l2` and `manifoldkv` are one method).
/// nullptr when none.
inline const Method* lookup_method(const std::string& name) {
  for (const Method& m : registry())
    if (m.name == name) return &m;
  if (const MethodInfo* info = find_method_info(name))
    for (const Method& m : registry())
      if (m.name == info->cli) return &m;
  return nullptr;
}

/// Adds a method; a name already registered (or a spelling of a built-in) is an error.
inline void register_method(Method m) {
  if (m.name.empty() || m.name.find(',') != std::string::npos || !m.run)
    throw std::invalid_argument("kvscore::eval::register_method: method name '" + m.name +
                                "' must be non-empty without ',' and have a run function");
  if (lookup_method(m.name))
    throw std::invalid_argument("kvscore::eval::register_method: method '" + m.name + "' is already registered");
  registry().push_back(std::move(m));
}

/// The registered methods' names, comma-separated (for --help and errors).
inline std::string method_names() {
  std::string s;
  for (const Method& m : registry()) s += (s.empty() ? "" : ", ") + m.name;
  return s;
}

/// The registered method called `name`; std::invalid_argument naming the known ones otherwise.
inline const Method& find_method(const std::string& name) {
  if (const Method* m = lookup_method(name)) return *m;
  throw std::invalid_argument("kvscore::eval: unknown method '" + name + "' (expected all or a comma list of " +
                              method_names() + ")");
}

/// "all" -> every registered method; "a,b" -> those, spelled as given (each known, no method
/// twice under any spelling).
inline std::vector<std::string> resolve_methods(const std::string& spec) {
  std::vector<std::string> out;
  if (spec == "all") {
    for (const Method& m : registry()) out.push_back(m.name);
    return out;
  }
  std::vector<const Method*> seen;
  std::size_t b = 0;
  for (;;) {
    const std::size_t e = spec.find(',', b);
    const std::string name = spec.substr(b, e == std::string::npos ? std::string::npos : e - b);
    const Method* m = &find_method(name);
    if (std::find(seen.begin(), seen.end(), m) != seen.end())
      throw std::invalid_argument("kvscore::eval: method '" + name + "' is listed twice" +
                                  (name == m->name ? std::string() : " (it is '" + m->name + "')"));
    seen.push_back(m);
    out.push_back(name);
    if (e == std::string::npos) break;
    b = e + 1;
  }
  return out;
}

}  // namespace kvscore::eval

#if !defined(KVSCORE_COMPILED)
#include "kvscore/eval/methods_impl.hpp"
#endif
