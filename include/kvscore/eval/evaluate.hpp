// kvscore/eval/evaluate.hpp — run methods × budgets over dumped layers and measure quality
// against full attention (metrics.hpp), the engine of `kvscore eval` (docs/evaluate.md).
//
//   std::vector<kvscore::eval::LayerInput> layers = {...};   // fp32 K, V, Q per layer
//   kvscore::eval::EvalOptions opt;
//   opt.methods = kvscore::eval::resolve_methods("all");
//   opt.keep = {0.1, 0.25, 0.5};
//   kvscore::eval::Report r = kvscore::eval::evaluate(layers, opt);
//
// For each method and keep fraction f: per-head budget n = budget_from_ratio(N, f) (nearest
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

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "kvscore/eval/methods.hpp"
#include "kvscore/eval/metrics.hpp"

namespace kvscore::eval {

struct EvalOptions {
  std::vector<std::string> methods;      ///< registry names (resolve_methods)
  std::vector<double> keep = {0.1, 0.25, 0.5};  ///< fractions of the tokens kept, each in (0, 1]
  MethodOptions method;                  ///< protection, allocation, window, threads
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

inline std::string num17(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}

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
      detail::check_kept(c.kept.head(h), in.tokens, (who + "head " + std::to_string(h)).c_str());
  } else {
    if (std::int64_t(c.per_query.size()) != in.q_heads * in.n_queries)
      invalid(who + "returned " + std::to_string(c.per_query.size()) + " per-query sets, expected " +
              std::to_string(in.q_heads * in.n_queries));
    for (const auto& s : c.per_query) detail::check_kept(s, in.tokens, (who + "per-query set").c_str());
  }
}

}  // namespace detail

inline Report evaluate(const std::vector<LayerInput>& layers, const EvalOptions& opt) {
  detail::validate(layers, opt);
  const LayerInput& a = layers[0];
  Report rep;
  rep.layers = std::int64_t(layers.size());
  rep.kv_heads = a.kv_heads;
  rep.q_heads = a.q_heads;
  rep.tokens = a.tokens;
  rep.head_dim = a.head_dim;
  rep.value_dim = a.value_dim;
  rep.n_queries = a.n_queries;
  rep.options = opt;
  const std::int64_t H = a.kv_heads, G = a.group(), nq = a.n_queries, rows = G * nq;

  struct Job {
    const Method* method;
    double keep;
    std::int64_t n;
    std::vector<Compressed> per_layer;
    double ms = 0;
    bool skipped = false;
  };
  std::vector<Job> jobs;
  for (const std::string& name : opt.methods)
    for (const double f : opt.keep) jobs.push_back({&find_method(name), f, budget_from_ratio(a.tokens, f), {}, 0, false});

  for (Job& job : jobs) {
    for (const LayerInput& in : layers) {
      Compressed c;
      try {
        const auto t0 = std::chrono::steady_clock::now();
        c = job.method->run(in, job.n, opt.method);
        const auto t1 = std::chrono::steady_clock::now();
        job.ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
      } catch (const std::invalid_argument& e) {
        rep.skipped.push_back({job.method->name, job.keep, e.what()});
        job.skipped = true;
        break;
      }
      detail::check_compressed(c, in, job.method->name);  // a bad result is an error, not a skip
      job.per_layer.push_back(std::move(c));
    }
  }

  // Per (layer, head): the full-attention reference once, then every job's metrics.
  const std::int64_t cells = rep.layers * H;
  std::vector<std::vector<HeadResult>> per(jobs.size(), std::vector<HeadResult>(std::size_t(cells)));
  auto work = [&](std::int64_t cell) {
    const std::int64_t l = cell / H, h = cell % H;
    const LayerInput& in = layers[std::size_t(l)];
    const HeadReference ref(in.keys + h * a.tokens * a.head_dim, a.head_dim, in.values + h * a.tokens * a.value_dim,
                            a.value_dim, in.query(h * G, 0), a.head_dim, rows, a.tokens, a.head_dim, a.value_dim);
    std::vector<double> o(std::size_t(a.value_dim));
    for (std::size_t j = 0; j < jobs.size(); ++j) {
      if (jobs[j].skipped) continue;
      const Compressed& c = jobs[j].per_layer[std::size_t(l)];
      HeadResult hr;
      hr.layer = l;
      hr.head = h;
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t hq = h * G + r / nq, i = r % nq;
        const std::span<const std::int64_t> kept =
            c.per_query.empty() ? c.kept.head(h) : std::span<const std::int64_t>(c.per_query[std::size_t(hq * nq + i)]);
        if (r == 0) hr.kept = std::int64_t(kept.size());
        const double* approx = nullptr;
        if (c.output) {
          c.output(hq, i, o.data());
          approx = o.data();
        }
        const RowMetrics m = ref.row_metrics(r, kept, approx);
        hr.attention_mass_recall += m.recall;
        hr.output_rel_error += m.rel_error;
        hr.topk_overlap += m.overlap;
      }
      hr.attention_mass_recall /= double(rows);
      hr.output_rel_error /= double(rows);
      hr.topk_overlap /= double(rows);
      per[j][std::size_t(cell)] = hr;
    }
  };
#if defined(_OPENMP)
  const int threads = opt.threads > 0 ? opt.threads : 0;
  if (threads == 1 || cells == 1) {
    for (std::int64_t c = 0; c < cells; ++c) work(c);
  } else {
    // Each cell writes only its own slot, so the result does not depend on the schedule.
    std::string error;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads > 0 ? threads : omp_get_max_threads())
    for (std::int64_t c = 0; c < cells; ++c) {
      try {
        work(c);
      } catch (const std::exception& e) {
#pragma omp critical(kvscore_eval_error)
        if (error.empty()) error = e.what();
      }
    }
    if (!error.empty()) throw std::invalid_argument(error);
  }
#else
  for (std::int64_t c = 0; c < cells; ++c) work(c);
#endif

  for (std::size_t j = 0; j < jobs.size(); ++j) {
    if (jobs[j].skipped) continue;
    Result r;
    r.method = jobs[j].method->name;
    r.keep = jobs[j].keep;
    r.budget = jobs[j].n;
    r.time_ms = jobs[j].ms / double(rep.layers);
    r.per_head = std::move(per[j]);
    for (const HeadResult& hr : r.per_head) {  // fixed order: deterministic sums
      r.attention_mass_recall += hr.attention_mass_recall;
      r.output_rel_error += hr.output_rel_error;
      r.topk_overlap += hr.topk_overlap;
    }
    r.attention_mass_recall /= double(cells);
    r.output_rel_error /= double(cells);
    r.topk_overlap /= double(cells);
    rep.results.push_back(std::move(r));
  }
  return rep;
}

}  // namespace kvscore::eval
