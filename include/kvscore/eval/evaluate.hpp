// kvscore/eval/evaluate.hpp — run methods × budgets over dumped layers and measure quality
// against full attention (metrics.hpp), the engine of `kvscore eval` (docs/evaluate.md).
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

#include <chrono>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/eval/methods.hpp"
#include "kvscore/eval/metrics.hpp"

namespace kvscore::eval {

struct EvalOptions {
  std::vector<std::string> methods;      ///< registry names (resolve_methods)
  std::vector<double> keep = {0.1, 0.25, 0.5};  ///< fractions of the tokens kept, each in (0, 1]
  MethodOptions method;                  ///< protection, allocation, window, threads
  BudgetRounding rounding = BudgetRounding::nearest;  ///< n from keep: nearest, or floor (the papers')
  int threads = 0;                       ///< threads over heads for the metrics (0 = OpenMP default)
};

struct HeadResult {
  std::int64_t layer = 0, head = 0;
  std::int64_t kept = 0;  ///< tokens kept by this KV head (retrieval: by its first query)
  double attention_mass_recall = 0, output_rel_error = 0, topk_overlap = 0;
};

struct Result {
  std::string method;
  double keep = 0;                ///< as given
  std::int64_t budget = 0;        ///< per-head budget n = budget_from_ratio(tokens, keep)
  double attention_mass_recall = 0, output_rel_error = 0, topk_overlap = 0;
  double time_ms = 0;             ///< scoring + selection, mean per layer
  std::vector<HeadResult> per_head;
};

struct Skipped {
  std::string method;
  double keep = 0;
  std::string reason;
};

struct Report {
  std::int64_t layers = 0, kv_heads = 0, q_heads = 0, tokens = 0, head_dim = 0, value_dim = 0, n_queries = 0;
  EvalOptions options;
  std::vector<Result> results;
  std::vector<Skipped> skipped;
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
  }
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

Report evaluate(const std::vector<LayerInput>& layers, const EvalOptions& opt);

}  // namespace kvscore::eval

#if !defined(KVSCORE_COMPILED)
#include "kvscore/eval/evaluate_impl.hpp"
#endif
