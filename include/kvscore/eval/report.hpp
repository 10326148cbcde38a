// kvscore/eval/report.hpp — an evaluation Report as JSON, a text table and an SVG plot
// (the outputs of `kvscore eval`; layout in docs/reference/evaluate.md).
//
// JSON: {"kvscore_eval": 1, "input": {...}, "options": {...},
//        "results": [{"method", "keep", "budget", "attention_mass_recall", "output_rel_error",
//                     "topk_overlap", "time_ms", "per_head": [{"layer", "head", "kept", ...}]}],
//        "skipped": [{"method", "keep", "reason"}],
//        "per_layer_best": [{"keep", "metric", "methods": [per layer], "values": [per layer]}]}
// Numbers are printed with 17 significant digits (round-trip), never NaN/Inf (the metrics
// are finite by construction; time is finite).
// SVG: three panels (attention-mass recall ↑, output relative error ↓, top-k overlap ↑)
// against the keep fraction, one coloured line per method, a legend, and a tooltip
// (<title>) on every point. Self-contained, opens in any browser.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kvscore/eval/evaluate.hpp"

namespace kvscore::eval {

namespace detail {

inline std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (const unsigned char c : s) {
    if (c == '"') o += "\\\"";
    else if (c == '\\') o += "\\\\";
    else if (c == '\n') o += "\\n";
    else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else o += char(c);
  }
  return o + "\"";
}

inline std::string json_num(double v) { return std::isfinite(v) ? num17(v) : "null"; }

inline std::string xml_escape(const std::string& s) {
  std::string o;
  for (const char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else if (c == '"') o += "&quot;";
    else o += c;
  }
  return o;
}

inline std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}


}  // namespace detail

/// The report as JSON (what `kvscore eval --out` writes and `kvscore.evaluate` returns as a dict).
inline std::string to_json(const Report& r) {
  using detail::json_num;
  using detail::json_str;
  std::string o = "{\n  \"kvscore_eval\": 1,\n";
  o += "  \"input\": {\"layers\": " + std::to_string(r.layers) + ", \"kv_heads\": " + std::to_string(r.kv_heads) +
       ", \"q_heads\": " + std::to_string(r.q_heads) + ", \"group\": " +
       std::to_string(r.kv_heads > 0 ? r.q_heads / r.kv_heads : 0) + ", \"tokens\": " + std::to_string(r.tokens) +
       ", \"head_dim\": " + std::to_string(r.head_dim) + ", \"value_dim\": " + std::to_string(r.value_dim) +
       ", \"queries\": " + std::to_string(r.n_queries) + ", \"window_queries\": " + std::to_string(r.n_window) +
       ", \"calib_queries\": " + std::to_string(r.n_calib) + "},\n";
  const MethodOptions& m = r.options.method;
  o += "  \"options\": {\"sinks\": " + std::to_string(m.select.sinks) + ", \"recent\": " +
       std::to_string(m.select.recent) + ", \"alloc\": " + json_str(kvscore::detail::cli_spelling(to_string(m.select.alloc))) +
       ", \"window\": " + std::to_string(m.window) +
       ", \"window_tail\": " + json_str(to_string(m.window_tail)) +
       ", \"budget_rounding\": " + json_str(to_string(r.options.rounding)) +
       ", \"query_placement\": " +  // leak-free: the window queries, always in the cache
       json_str(kvscore::detail::cli_spelling(to_string(m.protocol == Protocol::leak_free ? QueryPlacement::in_cache : m.placement))) +
       ", \"protocol\": " + json_str(kvscore::detail::cli_spelling(to_string(m.protocol))) + ", \"mix_metric\": " + json_str(metric_name(r.options.mix_metric)) +
       ", \"keep\": [";
  for (std::size_t i = 0; i < r.options.keep.size(); ++i) o += (i ? ", " : "") + json_num(r.options.keep[i]);
  o += "], \"methods\": [";
  for (std::size_t i = 0; i < r.options.methods.size(); ++i) o += (i ? ", " : "") + json_str(r.options.methods[i]);
  o += "]},\n  \"results\": [";
  for (std::size_t i = 0; i < r.results.size(); ++i) {
    const Result& x = r.results[i];
    o += std::string(i ? "," : "") + "\n    {\"method\": " + json_str(x.method) + ", \"keep\": " + json_num(x.keep) +
         ", \"budget\": " + std::to_string(x.budget) + ", \"attention_mass_recall\": " +
         json_num(x.attention_mass_recall) + ", \"output_rel_error\": " + json_num(x.output_rel_error) +
         ", \"topk_overlap\": " + json_num(x.topk_overlap) + ", \"time_ms\": " + json_num(x.time_ms) +
         ",\n     \"per_head\": [";
    for (std::size_t j = 0; j < x.per_head.size(); ++j) {
      const HeadResult& h = x.per_head[j];
      o += std::string(j ? ", " : "") + "{\"layer\": " + std::to_string(h.layer) + ", \"head\": " +
           std::to_string(h.head) + ", \"kept\": " + std::to_string(h.kept) + ", \"attention_mass_recall\": " +
           json_num(h.attention_mass_recall) + ", \"output_rel_error\": " + json_num(h.output_rel_error) +
           ", \"topk_overlap\": " + json_num(h.topk_overlap) + "}";
    }
    o += "]}";
  }
  o += "\n  ],\n  \"skipped\": [";
  for (std::size_t i = 0; i < r.skipped.size(); ++i)
    o += std::string(i ? ", " : "") + "{\"method\": " + json_str(r.skipped[i].method) + ", \"keep\": " +
         json_num(r.skipped[i].keep) + ", \"reason\": " + json_str(r.skipped[i].reason) + "}";
  o += "],\n  \"per_layer_best\": [";
  const std::vector<LayerChoice> best = per_layer_best(r, r.options.mix_metric);
  for (std::size_t i = 0; i < best.size(); ++i) {
    o += std::string(i ? "," : "") + "\n    {\"keep\": " + json_num(best[i].keep) + ", \"metric\": " +
         json_str(metric_name(best[i].metric)) + ", \"methods\": [";
    for (std::size_t l = 0; l < best[i].methods.size(); ++l) o += (l ? ", " : "") + json_str(best[i].methods[l]);
    o += "], \"values\": [";
    for (std::size_t l = 0; l < best[i].values.size(); ++l) o += (l ? ", " : "") + json_num(best[i].values[l]);
    o += "]}";
  }
  o += best.empty() ? "]\n}\n" : "\n  ]\n}\n";
  return o;
}

/// A fixed-width table: one row per (method, keep).
inline std::string to_table(const Report& r) {
  std::string o = "kvscore eval: " + std::to_string(r.layers) + " layer(s), " + std::to_string(r.kv_heads) +
                  " KV heads x " + std::to_string(r.tokens) + " tokens, " + std::to_string(r.q_heads) +
                  " query heads x " + std::to_string(r.n_queries) + " queries, head_dim " +
                  std::to_string(r.head_dim) + ", protocol " + kvscore::detail::cli_spelling(to_string(r.options.method.protocol)) +
                  (r.n_window ? ", " + std::to_string(r.n_window) + " window queries" : std::string()) +
                  (r.n_calib ? ", " + std::to_string(r.n_calib) + " calibration queries" : std::string()) + "\n";
  char line[256];
  std::snprintf(line, sizeof line, "%-16s %6s %8s %8s %9s %8s %10s\n", "method", "keep", "budget", "recall",
                "rel_err", "top-k", "time_ms");
  o += line;
  for (const Result& x : r.results) {
    std::snprintf(line, sizeof line, "%-16s %6.3f %8lld %8.4f %9.4f %8.4f %10.3f\n", x.method.c_str(), x.keep,
                  static_cast<long long>(x.budget), x.attention_mass_recall, x.output_rel_error, x.topk_overlap,
                  x.time_ms);
    o += line;
  }
  for (const Skipped& s : r.skipped) o += "skipped " + s.method + " at keep " + detail::fmt("%g", s.keep) + ": " + s.reason + "\n";
  return o;
}

/// Quality against budget, one line per method, three panels.
inline std::string to_svg(const Report& r) {
  using detail::fmt;
  static const char* const colours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                                        "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939"};
  std::vector<std::string> methods;
  for (const Result& x : r.results)
    if (std::find(methods.begin(), methods.end(), x.method) == methods.end()) methods.push_back(x.method);
  double kmin = 1, kmax = 0, emax = 0;
  for (const Result& x : r.results) {
    kmin = std::min(kmin, x.keep);
    kmax = std::max(kmax, x.keep);
    emax = std::max(emax, x.output_rel_error);
  }
  if (r.results.empty()) kmin = 0, kmax = 1;
  if (kmax - kmin < 1e-9) kmin = std::max(0.0, kmin - 0.05), kmax = std::min(1.0, kmax + 0.05);
  emax = emax > 0 ? emax * 1.05 : 1.0;
  const int W = 1140, Hh = 400, pw = 300, ph = 260, top = 50, left0 = 60, gap = 80;
  std::string o = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(W) + "\" height=\"" +
                  std::to_string(Hh + 20 * int((methods.size() + 3) / 4)) +
                  "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o += "<text x=\"" + std::to_string(W / 2) + "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">kvscore eval: " +
       std::to_string(r.layers) + " layer(s), " + std::to_string(r.kv_heads) + " KV heads x " +
       std::to_string(r.tokens) + " tokens, " + std::to_string(r.q_heads) + " query heads x " +
       std::to_string(r.n_queries) + " queries</text>\n";
  struct Panel { const char* title; double lo, hi; double Result::*field; };
  const Panel panels[3] = {{"attention-mass recall (higher is better)", 0, 1, &Result::attention_mass_recall},
                           {"output relative error (lower is better)", 0, emax, &Result::output_rel_error},
                           {"top-k overlap (higher is better)", 0, 1, &Result::topk_overlap}};
  for (int p = 0; p < 3; ++p) {
    const Panel& P = panels[p];
    const int x0 = left0 + p * (pw + gap), y0 = top;
    auto X = [&](double k) { return x0 + (k - kmin) / (kmax - kmin) * pw; };
    auto Y = [&](double v) { return y0 + ph - (v - P.lo) / (P.hi - P.lo) * ph; };
    o += "<text x=\"" + std::to_string(x0 + pw / 2) + "\" y=\"" + std::to_string(y0 - 10) +
         "\" text-anchor=\"middle\">" + P.title + "</text>\n";
    o += "<rect x=\"" + std::to_string(x0) + "\" y=\"" + std::to_string(y0) + "\" width=\"" + std::to_string(pw) +
         "\" height=\"" + std::to_string(ph) + "\" fill=\"none\" stroke=\"#444\"/>\n";
    for (int t = 0; t <= 4; ++t) {
      const double v = P.lo + (P.hi - P.lo) * t / 4, k = kmin + (kmax - kmin) * t / 4;
      o += "<line x1=\"" + fmt("%.1f", x0) + "\" x2=\"" + fmt("%.1f", x0 + pw) + "\" y1=\"" + fmt("%.1f", Y(v)) +
           "\" y2=\"" + fmt("%.1f", Y(v)) + "\" stroke=\"#ddd\"/>\n";
      o += "<text x=\"" + std::to_string(x0 - 5) + "\" y=\"" + fmt("%.1f", Y(v) + 4) + "\" text-anchor=\"end\">" +
           fmt("%.2f", v) + "</text>\n";
      o += "<text x=\"" + fmt("%.1f", X(k)) + "\" y=\"" + std::to_string(y0 + ph + 16) +
           "\" text-anchor=\"middle\">" + fmt("%.2f", k) + "</text>\n";
    }
    o += "<text x=\"" + std::to_string(x0 + pw / 2) + "\" y=\"" + std::to_string(y0 + ph + 34) +
         "\" text-anchor=\"middle\">keep fraction</text>\n";
    for (std::size_t mi = 0; mi < methods.size(); ++mi) {
      std::vector<const Result*> pts;
      for (const Result& x : r.results)
        if (x.method == methods[mi]) pts.push_back(&x);
      std::sort(pts.begin(), pts.end(), [](const Result* a, const Result* b) { return a->keep < b->keep; });
      const char* c = colours[mi % 12];
      std::string poly;
      for (const Result* x : pts) poly += fmt("%.1f", X(x->keep)) + "," + fmt("%.1f", Y(x->*P.field)) + " ";
      o += "<polyline class=\"method\" data-method=\"" + detail::xml_escape(methods[mi]) + "\" fill=\"none\" stroke=\"" +
           c + "\" stroke-width=\"2\" points=\"" + poly + "\"/>\n";
      for (const Result* x : pts)
        o += "<circle cx=\"" + fmt("%.1f", X(x->keep)) + "\" cy=\"" + fmt("%.1f", Y(x->*P.field)) + "\" r=\"3\" fill=\"" +
             c + "\"><title>" + detail::xml_escape(methods[mi]) + " keep " + fmt("%g", x->keep) + ": " +
             fmt("%.4f", x->*P.field) + "</title></circle>\n";
    }
  }
  for (std::size_t mi = 0; mi < methods.size(); ++mi) {
    const int lx = left0 + int(mi % 4) * 260, ly = top + ph + 60 + 20 * int(mi / 4);
    o += "<line x1=\"" + std::to_string(lx) + "\" x2=\"" + std::to_string(lx + 24) + "\" y1=\"" + std::to_string(ly) +
         "\" y2=\"" + std::to_string(ly) + "\" stroke=\"" + colours[mi % 12] + "\" stroke-width=\"3\"/>\n";
    o += "<text x=\"" + std::to_string(lx + 30) + "\" y=\"" + std::to_string(ly + 4) + "\">" +
         detail::xml_escape(methods[mi]) + "</text>\n";
  }
  return o + "</svg>\n";
}

}  // namespace kvscore::eval
