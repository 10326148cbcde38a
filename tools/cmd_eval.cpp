// tools/cmd_eval.cpp — `kvscore eval`: which scorer at which budget, measured against full
// attention on dumped (or synthetic) K, V, Q. Library: include/kvscore/eval/. Docs: docs/reference/evaluate.md.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include <kvscore/core/dtype.hpp>
#include <kvscore/eval/evaluate.hpp>
#include <kvscore/eval/report.hpp>
#include <kvscore/io/npy.hpp>

#include "cli.hpp"

namespace kvscore::cli {

const char* const kEvalUsage =
    "usage: kvscore eval --keys K.npy --values V.npy --queries Q.npy --out report.json [options]\n"
    "       kvscore eval --dump DIR --out report.json [options]    (a tools/dump_kv.py dump)\n"
    "\n"
    "Runs every method at every keep fraction and measures, against full attention of the\n"
    "queries Q (the queries that attend after compression; no causal mask):\n"
    "  attention-mass recall   full softmax mass on the kept tokens (1 = nothing lost)\n"
    "  output relative error   |o_kept - o_full| / |o_full|, softmax over the kept tokens only\n"
    "  top-k overlap           share of the true top-k attended tokens kept (k = tokens kept)\n"
    "  time                    scoring + selection, ms per layer (single thread unless --threads)\n"
    "averaged over query heads and queries (and per KV head in the JSON). Prints a table.\n"
    "\n"
    "  --keys K.npy        [kv_heads, tokens, d] or [layers, kv_heads, tokens, d]; '<f4', '<f2'\n"
    "                      or '<u2' (bfloat16 bits); post-RoPE\n"
    "  --values V.npy      [.., kv_heads, tokens, dv], same layers/heads/tokens as K\n"
    "  --queries Q.npy     [q_heads, n_q, d] (or [layers, q_heads, n_q, d] with 4-D keys)\n"
    "  --dump DIR          DIR/K.npy, V.npy, Q.npy, and DIR/Qwin.npy, Qcal.npy where they exist\n"
    "                      (dump_kv.py --following writes them); instead of --keys ... --calib-queries\n"
    "  --window-queries W.npy  [.., q_heads, n_w, d]: queries of the cache's own last n_w tokens\n"
    "                      (what an engine's SnapKV sees when it compresses); makes leak-free the default\n"
    "  --calib-queries C.npy   [.., q_heads, n_c, d]: queries of other text (%CALIBRATED%'s calibration\n"
    "                      under the leak-free protocol; without it %CALIBRATED% is skipped there)\n"
    "  --protocol P        leak-free (the default when window queries are given: %PLACED_ALL%\n"
    "                      see only the window queries, in the cache, the window protected;\n"
    "                      %CALIBRATED% is calibrated on --calib-queries; Q only measures) | shared (every\n"
    "                      method sees Q, the upper bound; the default without window queries)\n"
    "  --mix-metric M      recall (default) | error | overlap: what the JSON's per_layer_best (the best\n"
    "                      press-able method per layer, at each keep) maximises (error: minimises)\n"
    "  --out report.json   the report (results, per-head values, skipped budgets)\n"
    "  --svg report.svg    quality vs budget plot, one line per method (open in a browser)\n"
    "  --group G           GQA group size; must equal q_heads / kv_heads (default: that)\n"
    "  --methods LIST      all (default) or a comma list of: %METHODS%\n"
    "  --keep LIST         keep fractions in (0, 1] (default %KEEP%); per-head budget =\n"
    "                      nearest integer to keep x tokens (halves up), at least 1\n"
    "  --sinks S           always keep the first S tokens per head (default 0; %SINKS%)\n"
    "  --recent R          always keep the last R tokens per head (default 0)\n"
    "  --alloc A           per-head (default) | adakv: how selection methods spread the budget\n"
    "  --budget-rounding R nearest (default: n = the integer nearest f*N) | floor (n = floor(f*N),\n"
    "                      the papers' M = floor((1 - rho) N) and kvpress's count); n >= 1 either way\n"
    "  --window W          %WINDOWED% window in tokens (default %WINDOW%)\n"
    "  --window-tail T     %WINDOWED%: merge (default: a tail < W/2 joins the window before it) |\n"
    "                      own (the paper's Alg. 2: the tail is its own window)\n"
    "  --query-placement P (shared protocol) after-cache (default: Q follows the cache; %PLACED%\n"
    "                      see every key, no causal mask, nothing protected beyond --recent) |\n"
    "                      in-cache (Q are the cache's last n_q positions: causal mask, the\n"
    "                      last n_q tokens protected; prefill compression as kvpress runs it)\n"
    "  --threads N         threads for scoring and metrics (default 1; 0 = OpenMP default)\n"
    "  -h, --help          this help\n"
    "Methods that cannot run at a budget (e.g. sinks + recent above it) are skipped and listed.\n";

const std::vector<FlagSpec> kEvalFlags = {
    {"--keys", true},   {"--values", true}, {"--queries", true}, {"--out", true},   {"--svg", true},
    {"--group", true},  {"--methods", true}, {"--keep", true},   {"--sinks", true}, {"--recent", true},
    {"--alloc", true},  {"--window", true}, {"--window-tail", true}, {"--threads", true},
    {"--budget-rounding", true}, {"--query-placement", true}, {"--dump", true}, {"--window-queries", true},
    {"--calib-queries", true}, {"--protocol", true}, {"--mix-metric", true},
};

namespace {

double eval_parse_fraction(const std::string& text, const std::string& what) {
  const double v = parse_double(text, what);
  if (!(v > 0.0 && v <= 1.0)) throw UsageError(what + ": " + text + " is not in (0, 1]");
  return v;
}

std::vector<double> eval_parse_keep(const std::string& list) {
  std::vector<double> out;
  std::size_t b = 0;
  for (;;) {
    const std::size_t e = list.find(',', b);
    out.push_back(eval_parse_fraction(list.substr(b, e == std::string::npos ? std::string::npos : e - b), "eval: --keep"));
    if (e == std::string::npos) break;
    b = e + 1;
  }
  return out;
}

/// An .npy of float32 / float16 / bfloat16 as fp32, with its shape (the evaluator's precision).
struct Tensor {
  std::vector<std::int64_t> shape;
  std::vector<float> data;
};

Tensor eval_load(const std::string& path, const char* what) {
  const npy::Array a = npy::load(path);
  Tensor t;
  t.shape = a.shape;
  t.data.resize(std::size_t(a.size()));
  visit_dtype(npy::element_dtype(a, path + ": " + what), [&]<class T>(std::type_identity<T>) {
    const T* p = a.as<T>();
    for (std::size_t i = 0; i < t.data.size(); ++i) t.data[i] = to_float(p[i]);
  });
  return t;
}

void eval_write_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp-" + std::to_string(static_cast<long long>(::getpid()));
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) throw std::invalid_argument(path + ": cannot open for writing");
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if ((std::fclose(f) != 0) || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::invalid_argument(path + ": write error");
  }
}

bool eval_file_exists(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  std::fclose(f);
  return true;
}

}  // namespace

int cmd_eval(const Args& args) {
  std::string kp, vp, qp, wp, cp;
  if (args.has("--dump")) {
    for (const char* f : {"--keys", "--values", "--queries", "--window-queries", "--calib-queries"})
      if (args.has(f)) throw UsageError(std::string("eval: --dump DIR reads DIR's files; drop ") + f);
    const std::string dir = args.required("--dump");
    kp = dir + "/K.npy", vp = dir + "/V.npy", qp = dir + "/Q.npy";
    if (eval_file_exists(dir + "/Qwin.npy")) wp = dir + "/Qwin.npy";
    if (eval_file_exists(dir + "/Qcal.npy")) cp = dir + "/Qcal.npy";
  } else {
    kp = args.required("--keys"), vp = args.required("--values"), qp = args.required("--queries");
    wp = args.get("--window-queries", ""), cp = args.get("--calib-queries", "");
  }
  const std::string out = args.required("--out");
  eval::EvalOptions opt;
  try {
    opt.methods = eval::resolve_methods(args.get("--methods", "all"));
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    throw UsageError("eval: --methods: " + m.substr(m.find(": ") + 2));
  }
  if (args.has("--keep")) opt.keep = eval_parse_keep(args.required("--keep"));
  opt.method.select.sinks = args.get_int("--sinks", 0, 0, INT64_MAX);
  opt.method.select.recent = args.get_int("--recent", 0, 0, INT64_MAX);
  opt.method.select.alloc = get_enum(args, "--alloc", opt.method.select.alloc, kAllocs, "eval: --alloc: ");
  opt.method.window = args.get_int("--window", opt.method.window, 1, INT64_MAX);
  opt.rounding = get_enum(args, "--budget-rounding", opt.rounding, kBudgetRoundings, "eval: --budget-rounding: ");
  opt.method.window_tail = get_enum(args, "--window-tail", opt.method.window_tail, kWindowTails, "eval: --window-tail: ");
  opt.method.protocol = get_enum(args, "--protocol", wp.empty() ? eval::Protocol::shared : eval::Protocol::leak_free,
                                 eval::kProtocols, "eval: --protocol: ");
  const bool leak_free = opt.method.protocol == eval::Protocol::leak_free;
  if (leak_free && wp.empty())
    throw UsageError("eval: --protocol leak-free needs the cache's last-window queries (--window-queries, or a "
                     "--dump made by dump_kv.py --following)");
  if (leak_free && args.has("--query-placement"))
    throw UsageError("eval: --query-placement is for --protocol shared (leak-free places the window in the cache)");
  opt.method.placement = leak_free ? QueryPlacement::in_cache
                                   : get_query_placement(args, "eval", QueryPlacement::after_cache);
  opt.mix_metric = get_enum(args, "--mix-metric", opt.mix_metric, eval::kMixMetrics, "eval: --mix-metric: ");
  const int threads = int(args.get_int("--threads", 1, 0, kMaxThreads));
  opt.threads = threads;
  opt.method.threads = threads;
  opt.method.select.num_threads = threads;
  const std::int64_t group = args.get_int("--group", 0, 1, INT64_MAX);

  // shared protocol: the window and calibration queries are not read (nothing would see them)
  const Tensor K = eval_load(kp, "keys"), V = eval_load(vp, "values"), Q = eval_load(qp, "queries");
  const Tensor W = leak_free ? eval_load(wp, "window queries") : Tensor{};
  const Tensor C = leak_free && !cp.empty() ? eval_load(cp, "calibration queries") : Tensor{};
  const auto tensor = [](const Tensor& t, const std::string& path, bool read = true) {
    return eval::EvalTensor{read ? t.data.data() : nullptr, t.shape, path};
  };
  const std::vector<eval::LayerInput> layers = eval::layer_inputs(
      {tensor(K, kp), tensor(V, vp), tensor(Q, qp), tensor(W, wp, leak_free), tensor(C, cp, leak_free && !cp.empty())});
  const std::int64_t kv_heads = layers[0].kv_heads, q_heads = layers[0].q_heads;
  if (group != 0 && group != q_heads / kv_heads)
    throw std::invalid_argument("eval: --group " + std::to_string(group) + " does not match q_heads / kv_heads = " +
                                std::to_string(q_heads) + " / " + std::to_string(kv_heads) + " = " +
                                std::to_string(q_heads / kv_heads));
  const eval::Report rep = eval::evaluate(layers, opt);
  if (rep.results.empty())
    throw std::invalid_argument("eval: every method x keep was skipped; first: " + rep.skipped[0].method + " at keep " +
                                eval::detail::num17(rep.skipped[0].keep) + ": " + rep.skipped[0].reason);
  eval_write_atomic(out, eval::to_json(rep));
  if (args.has("--svg")) eval_write_atomic(args.required("--svg"), eval::to_svg(rep));
  std::cout << eval::to_table(rep);
  return kExitOk;
}

namespace {
/// The usage text with the registered method names filled in.
const char* eval_usage_text() {
  static const std::string u = [] {
    // method names and defaults from the registry (kvscore/methods.hpp)
    const auto reading = [](const char* option, bool scorers_only = false) {
      return [=](const MethodInfo& m) { return reads_option(m, option) && (!scorers_only || m.kind == MethodKind::scorer); };
    };
    std::string s = kEvalUsage;
    const std::pair<std::string, std::string> fill[] = {
        {"%METHODS%", eval::method_names()},
        {"%KEEP%", [] {
           std::string k;
           for (const double f : eval::EvalOptions{}.keep) k += (k.empty() ? "" : ",") + help_num(f);
           return k;
         }()},
        {"%SINKS%", method_list(reading("sinks")) + ": " + std::to_string(eval::MethodOptions{}.streaming_sinks)},
        {"%WINDOWED%", method_list(reading("window", true))},
        {"%WINDOW%", std::to_string(eval::MethodOptions{}.window)},
        {"%PLACED%", method_alternatives(reading("placement"))},
        {"%PLACED_ALL%", [&] {  // "a, b and c"
           const std::string l = method_list(reading("placement"));
           const std::size_t last = l.rfind(", ");
           return last == std::string::npos ? l : l.substr(0, last) + " and " + l.substr(last + 2);
         }()},
        {"%CALIBRATED%", method_list(reading("filters"))},
    };
    for (const auto& [key, value] : fill)
      for (std::size_t i; (i = s.find(key)) != std::string::npos;) s.replace(i, key.size(), value);
    return s;
  }();
  return u.c_str();
}
const char* const kEvalUsageFilled = eval_usage_text();
}  // namespace

KVSCORE_CLI_COMMAND(eval, "eval", "measure methods x budgets against full attention (recall, output error, top-k, time)",
                    cmd_eval, kEvalFlags, kEvalUsageFilled);

}  // namespace kvscore::cli
