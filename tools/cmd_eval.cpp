// tools/cmd_eval.cpp — `kvscore eval`: which scorer at which budget, measured against full
// attention on dumped (or synthetic) K, V, Q. Library: include/kvscore/eval/. Docs: docs/evaluate.md.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <stdexcept>
#include <string>
#include <system_error>
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

/// An .npy of float32 / float16 / bfloat16 as fp32, with its shape.
struct Tensor {
  std::vector<std::int64_t> shape;
  std::vector<float> data;
};

Tensor eval_load(const std::string& path, const char* what) {
  const npy::Array a = npy::load(path);
  Tensor t;
  t.shape = a.shape;
  std::int64_t n = 1;
  for (const auto s : a.shape) n *= s;
  t.data.resize(std::size_t(n));
  if (a.descr == npy::descr_of<float>()) {
    std::copy(a.as<float>(), a.as<float>() + n, t.data.begin());
  } else if (a.descr == npy::descr_of<half>()) {
    for (std::int64_t i = 0; i < n; ++i) t.data[std::size_t(i)] = to_float(a.as<half>()[i]);
  } else if (a.descr == npy::descr_of<bfloat16>()) {
    for (std::int64_t i = 0; i < n; ++i) t.data[std::size_t(i)] = to_float(a.as<bfloat16>()[i]);
  } else {
    throw std::invalid_argument(path + ": " + what + " dtype '" + a.descr +
                                "' not supported (expected '<f4' float32, '<f2' float16 or '<u2' bfloat16 bits)");
  }
  return t;
}

std::string eval_shape(const std::vector<std::int64_t>& s) {
  std::string o = "[";
  for (std::size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
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

/// Window or calibration queries: the rank of the keys, the layers, query heads and head_dim of Q.
Tensor eval_load_queries_like(const std::string& path, const char* what, const Tensor& Q, const std::string& qp) {
  Tensor t = eval_load(path, what);
  const std::size_t rank = Q.shape.size(), o = rank - 3;
  if (t.shape.size() != rank || (rank == 4 && t.shape[0] != Q.shape[0]) || t.shape[o] != Q.shape[o] ||
      t.shape[o + 2] != Q.shape[o + 2] || t.shape[o + 1] < 1)
    throw std::invalid_argument(path + ": " + what + " " + eval_shape(t.shape) + " do not match queries " +
                                eval_shape(Q.shape) + " of " + qp + " (same layers, q_heads and head_dim; n >= 1)");
  return t;
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
  const std::string alloc = args.get("--alloc", "per-head");
  if (alloc == "adakv") opt.method.select.alloc = Alloc::adakv;
  else if (alloc != "per-head") throw UsageError("eval: --alloc: '" + alloc + "' (expected per-head or adakv)");
  opt.method.window = args.get_int("--window", opt.method.window, 1, INT64_MAX);
  const std::string rounding = args.get("--budget-rounding", "nearest");
  if (rounding != "nearest" && rounding != "floor")
    throw UsageError("eval: --budget-rounding: '" + rounding + "' (expected nearest or floor)");
  opt.rounding = rounding == "floor" ? BudgetRounding::floor : BudgetRounding::nearest;
  const std::string tail = args.get("--window-tail", "merge");
  if (tail != "own" && tail != "merge") throw UsageError("eval: --window-tail: '" + tail + "' (expected own or merge)");
  opt.method.window_tail = parse_window_tail(tail);
  const std::string protocol = args.get("--protocol", wp.empty() ? "shared" : "leak-free");
  if (protocol != "leak-free" && protocol != "shared")
    throw UsageError("eval: --protocol: '" + protocol + "' (expected leak-free or shared)");
  if (protocol == "leak-free" && wp.empty())
    throw UsageError("eval: --protocol leak-free needs the cache's last-window queries (--window-queries, or a "
                     "--dump made by dump_kv.py --following)");
  if (protocol == "leak-free" && args.has("--query-placement"))
    throw UsageError("eval: --query-placement is for --protocol shared (leak-free places the window in the cache)");
  opt.method.protocol = protocol == "leak-free" ? eval::Protocol::leak_free : eval::Protocol::shared;
  opt.method.placement = protocol == "leak-free" ? QueryPlacement::in_cache
                                                 : get_query_placement(args, "eval", QueryPlacement::after_cache);
  const std::string mix = args.get("--mix-metric", "recall");
  if (mix != "recall" && mix != "error" && mix != "overlap")
    throw UsageError("eval: --mix-metric: '" + mix + "' (expected recall, error or overlap)");
  opt.mix_metric = mix == "recall" ? eval::MixMetric::recall
                   : mix == "error" ? eval::MixMetric::output_error
                                    : eval::MixMetric::overlap;
  const int threads = int(args.get_int("--threads", 1, 0, kMaxThreads));
  opt.threads = threads;
  opt.method.threads = threads;
  opt.method.select.num_threads = threads;
  const std::int64_t group = args.get_int("--group", 0, 1, INT64_MAX);

  const Tensor K = eval_load(kp, "keys"), V = eval_load(vp, "values"), Q = eval_load(qp, "queries");
  const std::size_t rank = K.shape.size();
  if (rank != 3 && rank != 4)
    throw std::invalid_argument(kp + ": keys must be [kv_heads, tokens, d] or [layers, kv_heads, tokens, d], got " +
                                eval_shape(K.shape));
  if (V.shape.size() != rank)
    throw std::invalid_argument(vp + ": values " + eval_shape(V.shape) + " must have the rank of keys " +
                                eval_shape(K.shape));
  if (Q.shape.size() != rank)
    throw std::invalid_argument(qp + ": queries " + eval_shape(Q.shape) + " must have the rank of keys " +
                                eval_shape(K.shape) + " (" + (rank == 3 ? "[q_heads, n_q, d]" : "[layers, q_heads, n_q, d]") +
                                ")");
  const std::size_t o = rank - 3;  // offset of the per-layer dims
  const std::int64_t L = rank == 4 ? K.shape[0] : 1, H = K.shape[o], N = K.shape[o + 1], d = K.shape[o + 2];
  const std::int64_t dv = V.shape[o + 2], Hq = Q.shape[o], nq = Q.shape[o + 1];
  if (L < 1 || H < 1 || N < 1 || d < 1)
    throw std::invalid_argument(kp + ": keys " + eval_shape(K.shape) + " must have no empty dimension");
  if ((rank == 4 && V.shape[0] != L) || V.shape[o] != H || V.shape[o + 1] != N || dv < 1)
    throw std::invalid_argument(vp + ": values " + eval_shape(V.shape) + " do not match keys " + eval_shape(K.shape) +
                                " (same layers, kv_heads and tokens; dv >= 1)");
  if ((rank == 4 && Q.shape[0] != L) || Q.shape[o + 2] != d || nq < 1)
    throw std::invalid_argument(qp + ": queries " + eval_shape(Q.shape) + " do not match keys " + eval_shape(K.shape) +
                                " (same layers and head_dim, n_q >= 1)");
  if (Hq < 1 || Hq % H != 0)
    throw std::invalid_argument(qp + ": q_heads " + std::to_string(Hq) + " is not a multiple of the " +
                                std::to_string(H) + " kv_heads of " + kp);
  if (group != 0 && group != Hq / H)
    throw std::invalid_argument("eval: --group " + std::to_string(group) + " does not match q_heads / kv_heads = " +
                                std::to_string(Hq) + " / " + std::to_string(H) + " = " + std::to_string(Hq / H));

  // shared protocol: the window and calibration queries are not read (nothing would see them)
  const bool leak_free = opt.method.protocol == eval::Protocol::leak_free;
  const Tensor W = leak_free ? eval_load_queries_like(wp, "window queries", Q, qp) : Tensor{};
  const Tensor C = leak_free && !cp.empty() ? eval_load_queries_like(cp, "calibration queries", Q, qp) : Tensor{};
  const std::int64_t nw = W.shape.empty() ? 0 : W.shape[o + 1], nc = C.shape.empty() ? 0 : C.shape[o + 1];
  if (nw > N)
    throw std::invalid_argument(wp + ": " + std::to_string(nw) + " window queries, but they are the cache's last "
                                "positions and the cache has " + std::to_string(N) + " tokens");
  std::vector<eval::LayerInput> layers;
  for (std::int64_t l = 0; l < L; ++l) {
    eval::LayerInput in;
    in.keys = K.data.data() + l * H * N * d;
    in.values = V.data.data() + l * H * N * dv;
    in.queries = Q.data.data() + l * Hq * nq * d;
    in.kv_heads = H;
    in.tokens = N;
    in.head_dim = d;
    in.value_dim = dv;
    in.q_heads = Hq;
    in.n_queries = nq;
    if (nw > 0) in.window_queries = W.data.data() + l * Hq * nw * d, in.n_window = nw;
    if (nc > 0) in.calib_queries = C.data.data() + l * Hq * nc * d, in.n_calib = nc;
    layers.push_back(in);
  }
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
