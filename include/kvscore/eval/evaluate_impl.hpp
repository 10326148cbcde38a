// kvscore/eval/evaluate_impl.hpp — kvscore::eval::evaluate(): inline in header-only use,
// compiled once into kvscore::dispatch otherwise (kvscore/detail/compiled.hpp).
#pragma once

#include "kvscore/core/parallel.hpp"
#include "kvscore/eval/evaluate.hpp"

namespace kvscore::eval {

namespace detail {
/// The three quality metrics of a HeadResult or a Result: sums, then the mean over n.
template <class R>
void add_metrics(R& r, double recall, double rel_error, double overlap) {
  r.attention_mass_recall += recall;
  r.output_rel_error += rel_error;
  r.topk_overlap += overlap;
}
template <class R>
void mean_metrics(R& r, std::int64_t n) {
  r.attention_mass_recall /= double(n);
  r.output_rel_error /= double(n);
  r.topk_overlap /= double(n);
}
}  // namespace detail

KVSCORE_IMPL_INLINE Report evaluate(const std::vector<LayerInput>& layers, const EvalOptions& opt) {
  detail::validate(layers, opt);
  const LayerInput& a = layers[0];
  Report rep{.layers = std::int64_t(layers.size()), .kv_heads = a.kv_heads, .q_heads = a.q_heads, .tokens = a.tokens,
             .head_dim = a.head_dim, .value_dim = a.value_dim, .n_queries = a.n_queries, .options = opt,
             .results = {}, .skipped = {}, .n_window = a.window_queries ? a.n_window : 0,
             .n_calib = a.calib_queries ? a.n_calib : 0};
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
    for (const double f : opt.keep) jobs.push_back({&find_method(name), f, budget_from_ratio(a.tokens, f, opt.rounding), {}, 0, false});

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
        detail::add_metrics(hr, m.recall, m.rel_error, m.overlap);
      }
      detail::mean_metrics(hr, rows);
      per[j][std::size_t(cell)] = hr;
    }
  };
  // Each cell writes only its own slot, so the result does not depend on the schedule; an
  // error is rethrown after the parallel region (detail::parallel_for).
  kvscore::detail::parallel_for(cells, opt.threads, work);

  for (std::size_t j = 0; j < jobs.size(); ++j) {
    if (jobs[j].skipped) continue;
    Result r;
    r.method = jobs[j].method->name;
    r.keep = jobs[j].keep;
    r.budget = jobs[j].n;
    r.time_ms = jobs[j].ms / double(rep.layers);
    r.per_head = std::move(per[j]);
    for (const HeadResult& hr : r.per_head)  // fixed order: deterministic sums
      detail::add_metrics(r, hr.attention_mass_recall, hr.output_rel_error, hr.topk_overlap);
    detail::mean_metrics(r, cells);
    rep.results.push_back(std::move(r));
  }
  return rep;
}

}  // namespace kvscore::eval
