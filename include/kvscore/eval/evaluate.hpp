// kvscore/eval/evaluate.hpp — run methods × budgets over dumped layers and measure quality
// against full attention (metrics.hpp), the engine of `kvscore eval` (docs/reference/evaluate.md).
//
//   std::vector<kvscore::eval::LayerInput> layers = {...};   // fp32 K, V, Q per layer
//   kvscore::eval::EvalOptions opt;
//   opt.methods = kvscore::eval::resolve_methods("all");
//   opt.keep = {0.1, 0.25, 0.5};
//   kvscore::eval::Report r = kvscore::eval::evaluate(layers, opt);
//
// For each method and keep fraction f: per-head budget n = budget_from_ratio(N, f, rounding) (nearest
// integer to f·N, halves up, at least 1), the method runs once per layer (timed: scoring +
// selection, wall clock), then every row (query head, query) of every KV head is measured.
// A result averages rows equally: per head over its G·n_q rows, overall over all layers,
// heads and rows. time_ms is the mean over layers. A method that rejects a budget
// (std::invalid_argument, e.g. protected tokens above the budget) is recorded in `skipped`
// with the reason, and the others still run.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/eval/inputs.hpp"
#include "kvscore/eval/methods.hpp"
#include "kvscore/eval/metrics.hpp"

namespace kvscore::eval {

/// The metric a per-layer choice maximises (output error: minimises).
enum class MixMetric { recall, output_error, overlap };

/// Every MixMetric (parse_mix_metric reads these).
inline constexpr MixMetric kMixMetrics[] = {MixMetric::recall, MixMetric::output_error, MixMetric::overlap};

/// "recall", "error" or "overlap": the option's spelling (--mix-metric, mix_metric=).
inline const char* to_string(MixMetric m) noexcept {
  return m == MixMetric::recall ? "recall" : m == MixMetric::output_error ? "error" : "overlap";
}
/// "recall", "error" or "overlap"; anything else is std::invalid_argument naming it.
inline MixMetric parse_mix_metric(std::string_view s) {
  return kvscore::detail::parse_enum(s, kMixMetrics, "mix_metric");
}
/// The report's name of the metric: "attention_mass_recall", "output_rel_error", "topk_overlap".
inline const char* metric_name(MixMetric m) noexcept {
  return m == MixMetric::recall ? "attention_mass_recall" : m == MixMetric::output_error ? "output_rel_error" : "topk_overlap";
}

/// Options of evaluate(): the methods, the keep fractions, the methods' shared options.
struct EvalOptions {
  std::vector<std::string> methods;      ///< registry names (resolve_methods)
  std::vector<double> keep = {0.1, 0.25, 0.5};  ///< fractions of the tokens kept, each in (0, 1]
  MethodOptions method;                  ///< protection, allocation, window, threads
  BudgetRounding rounding = BudgetRounding::nearest;  ///< n from keep: nearest, or floor (the papers')
  int threads = 0;                       ///< threads over heads for the metrics (0 = OpenMP default)
  MixMetric mix_metric = MixMetric::recall;  ///< what the report's per_layer_best maximises
};

/// One KV head's figures for one (method, keep).
struct HeadResult {
  std::int64_t layer = 0;  ///< the layer
  std::int64_t head = 0;   ///< the KV head
  std::int64_t kept = 0;  ///< tokens kept by this KV head (retrieval: by its first query)
  double attention_mass_recall = 0;  ///< softmax mass of the evaluation queries on the kept tokens
  double output_rel_error = 0;       ///< ‖o_kept − o_full‖ / ‖o_full‖
  double topk_overlap = 0;           ///< |S ∩ T_k| / k, k = |S|: the share of the k most attended keys kept
};

/// One (method, keep) over every layer: the metrics averaged over layers, KV heads and queries.
struct Result {
  std::string method;  ///< the method's report name
  double keep = 0;                ///< as given
  std::int64_t budget = 0;        ///< per-head budget n = budget_from_ratio(tokens, keep)
  double attention_mass_recall = 0;  ///< mean over the heads
  double output_rel_error = 0;       ///< mean over the heads
  double topk_overlap = 0;           ///< mean over the heads
  double time_ms = 0;             ///< scoring + selection, mean per layer
  std::vector<HeadResult> per_head;  ///< every (layer, KV head)'s own figures
};

/// A (method, keep) the evaluator could not run, and why (e.g. Q-Filters without calibration queries).
struct Skipped {
  std::string method;  ///< the method's report name
  double keep = 0;  ///< the keep fraction
  std::string reason;  ///< why it was skipped
};

/// What evaluate() returns (to_json writes it): the inputs' shapes, the options and every result.
struct Report {
  std::int64_t layers = 0;     ///< layers of the inputs
  std::int64_t kv_heads = 0;   ///< KV heads per layer
  std::int64_t q_heads = 0;    ///< query heads per layer
  std::int64_t tokens = 0;     ///< tokens of the cache
  std::int64_t head_dim = 0;   ///< dimensions of a key
  std::int64_t value_dim = 0;  ///< dimensions of a value
  std::int64_t n_queries = 0;  ///< evaluation queries per query head
  EvalOptions options;  ///< the options it ran with
  std::vector<Result> results;  ///< one per (method, keep), in the methods' order
  std::vector<Skipped> skipped;  ///< what could not run
  std::int64_t n_window = 0;  ///< leak-free inputs: window queries per head
  std::int64_t n_calib = 0;   ///< leak-free inputs: calibration queries per head
};

namespace detail {

inline std::string num17(double v) { return kvscore::detail::num(v); }

inline void check_finite(const float* p, std::int64_t count, const std::string& what) {
  for (std::int64_t i = 0; i < count; ++i)
    if (!std::isfinite(p[i]))
      invalid(what + ": value " + num17(double(p[i])) + " at flat index " + std::to_string(i) + " is not finite");
}

inline void validate(const std::vector<LayerInput>& layers, const EvalOptions& opt) {
  const std::string who = "kvscore::eval::evaluate: ";
  if (layers.empty()) invalid(who + "no layers");
  const LayerInput& a = layers[0];
  if (a.kv_heads < 1) invalid(who + "kv_heads must be >= 1 (got " + std::to_string(a.kv_heads) + ")");
  if (a.tokens < 1) invalid(who + "tokens must be >= 1 (got " + std::to_string(a.tokens) + ")");
  if (a.n_queries < 1) invalid(who + "queries per head must be >= 1 (got " + std::to_string(a.n_queries) + ")");
  if (a.head_dim < 1 || a.head_dim > kMaxHeadDim)
    invalid(who + "head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " + std::to_string(a.head_dim) + ")");
  if (a.value_dim < 1) invalid(who + "value_dim must be >= 1 (got " + std::to_string(a.value_dim) + ")");
  if (a.q_heads < 1 || a.q_heads % a.kv_heads != 0)
    invalid(who + "q_heads " + std::to_string(a.q_heads) + " must be a positive multiple of kv_heads " +
            std::to_string(a.kv_heads));
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const LayerInput& b = layers[l];
    if (b.kv_heads != a.kv_heads || b.tokens != a.tokens || b.head_dim != a.head_dim || b.value_dim != a.value_dim ||
        b.q_heads != a.q_heads || b.n_queries != a.n_queries)
      invalid(who + "layer " + std::to_string(l) + " has a different shape than layer 0");
    if (b.keys == nullptr || b.values == nullptr || b.queries == nullptr)
      invalid(who + "layer " + std::to_string(l) + ": null keys, values or queries");
    const std::string L = "layer " + std::to_string(l);
    check_finite(b.keys, b.kv_heads * b.tokens * b.head_dim, who + L + " keys");
    check_finite(b.values, b.kv_heads * b.tokens * b.value_dim, who + L + " values");
    check_finite(b.queries, b.q_heads * b.n_queries * b.head_dim, who + L + " queries");
    if (b.n_window != a.n_window || b.n_calib != a.n_calib || (b.window_queries == nullptr) != (a.window_queries == nullptr) ||
        (b.calib_queries == nullptr) != (a.calib_queries == nullptr))
      invalid(who + "layer " + std::to_string(l) + " has other window or calibration queries than layer 0");
    if (b.window_queries != nullptr) {
      if (b.n_window < 1) invalid(who + L + ": n_window must be >= 1 (got " + std::to_string(b.n_window) + ")");
      if (b.n_window > b.tokens)
        invalid(who + L + ": the " + std::to_string(b.n_window) + " window queries are the cache's last positions, " +
                "so at most its " + std::to_string(b.tokens) + " tokens");
      check_finite(b.window_queries, b.q_heads * b.n_window * b.head_dim, who + L + " window queries");
    }
    if (b.calib_queries != nullptr) {
      if (b.n_calib < 1) invalid(who + L + ": n_calib must be >= 1 (got " + std::to_string(b.n_calib) + ")");
      check_finite(b.calib_queries, b.q_heads * b.n_calib * b.head_dim, who + L + " calibration queries");
    }
  }
  if (opt.method.protocol == Protocol::leak_free && a.window_queries == nullptr)
    invalid(who + "the leak-free protocol needs the cache's last-window queries (LayerInput::window_queries; "
                  "kvscore eval --window-queries, dump_kv.py --following)");
  if (opt.methods.empty()) invalid(who + "no methods");
  for (const std::string& m : opt.methods) find_method(m);
  if (opt.keep.empty()) invalid(who + "no keep fractions");
  for (const double f : opt.keep)
    if (!(f > 0.0 && f <= 1.0)) invalid(who + "keep fraction " + num17(f) + " must be in (0, 1]");
  if (opt.threads < 0) invalid(who + "threads must be >= 0 (got " + std::to_string(opt.threads) + ")");
}

/// Checks a method's output against the layer (a method bug must not become silent garbage).
inline void check_compressed(const Compressed& c, const LayerInput& in, const std::string& name) {
  const std::string who = "kvscore::eval: method '" + name + "' ";
  if (c.per_query.empty()) {
    if (c.kept.heads != in.kv_heads || std::int64_t(c.kept.offsets.size()) != in.kv_heads + 1)
      invalid(who + "returned a selection of " + std::to_string(c.kept.heads) + " heads, expected " +
              std::to_string(in.kv_heads));
    for (std::int64_t h = 0; h < in.kv_heads; ++h)
      kvscore::detail::require_ascending(c.kept.head(h), in.tokens, (who + "head " + std::to_string(h)).c_str());
  } else {
    if (std::int64_t(c.per_query.size()) != in.q_heads * in.n_queries)
      invalid(who + "returned " + std::to_string(c.per_query.size()) + " per-query sets, expected " +
              std::to_string(in.q_heads * in.n_queries));
    for (const auto& s : c.per_query) kvscore::detail::require_ascending(s, in.tokens, (who + "per-query set").c_str());
  }
}

}  // namespace detail

/// Every method of `opt` at every keep fraction on `layers`, against full attention (see the top of this file);
/// std::invalid_argument for inconsistent inputs or options.
Report evaluate(const std::vector<LayerInput>& layers, const EvalOptions& opt);

/// Best method per layer at one keep fraction (per_layer_best).
struct LayerChoice {
  double keep = 0;  ///< the keep fraction chosen at
  MixMetric metric = MixMetric::recall;  ///< the metric maximised (output error: minimised)
  std::vector<std::string> methods;  ///< [layer]: the chosen method's report name
  std::vector<double> values;        ///< [layer]: its metric, mean over the layer's KV heads
};

/// Whether a method can be one layer's choice in a per-layer mix: a selection method a press
/// can run during prefill (scorers, query scorers, StreamingLLM). Retrieval (ParisKV) and
/// hybrid (OjaKV) methods keep other things than a per-head token set, and the oracle sees the
/// evaluation queries.
inline bool mixable(const std::string& name) {
  const MethodInfo* info = find_method_info(name);
  return info != nullptr && (info->kind == MethodKind::scorer || info->kind == MethodKind::query_scorer ||
                             info->kind == MethodKind::selection_rule);
}

/// Per keep fraction of the report, the mixable method (mixable()) with the best metric in
/// each layer, averaged over the layer's KV heads; ties go to the method listed first. Run it on
/// a leak-free report: under the shared protocol the query-aware methods saw the evaluation
/// queries and win for that reason. A keep with no mixable result gives no entry.
inline std::vector<LayerChoice> per_layer_best(const Report& r, MixMetric metric = MixMetric::recall) {
  std::vector<LayerChoice> out;
  std::vector<double> keeps;
  for (const Result& res : r.results)
    if (std::find(keeps.begin(), keeps.end(), res.keep) == keeps.end()) keeps.push_back(res.keep);
  const double sign = metric == MixMetric::output_error ? -1.0 : 1.0;
  for (const double keep : keeps) {
    LayerChoice c;
    c.keep = keep;
    c.metric = metric;
    c.methods.assign(std::size_t(r.layers), "");
    c.values.assign(std::size_t(r.layers), 0.0);
    std::vector<double> best(std::size_t(r.layers), -INFINITY);
    for (const Result& res : r.results) {
      if (res.keep != keep || !mixable(res.method)) continue;
      std::vector<double> sum(std::size_t(r.layers), 0.0);
      std::vector<std::int64_t> count(std::size_t(r.layers), 0);
      for (const HeadResult& h : res.per_head) {
        const double v = metric == MixMetric::recall         ? h.attention_mass_recall
                         : metric == MixMetric::output_error ? h.output_rel_error
                                                             : h.topk_overlap;
        sum[std::size_t(h.layer)] += v;
        ++count[std::size_t(h.layer)];
      }
      for (std::size_t l = 0; l < sum.size(); ++l) {
        if (count[l] == 0) continue;
        const double mean = sum[l] / double(count[l]);
        if (sign * mean > best[l]) {  // strict: the first listed keeps a tie
          best[l] = sign * mean;
          c.methods[l] = res.method;
          c.values[l] = mean;
        }
      }
    }
    if (std::find(c.methods.begin(), c.methods.end(), std::string()) == c.methods.end()) out.push_back(std::move(c));
  }
  return out;
}

}  // namespace kvscore::eval

#if !defined(KVSCORE_COMPILED)
#include "kvscore/eval/evaluate_impl.hpp"
#endif
