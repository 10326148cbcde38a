// tools/cmd_score.cpp — `kvscore score`: score every token of one layer's keys. Every scorer of
// kvscore/methods.hpp, built by make_scorer from ScorerArgs; which flags a method takes is its
// registry entry's `options`, and every default is ScorerArgs's, so no method is named here.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <string_view>
#include <vector>

#include <kvscore/kvscore.hpp>

#include "cli.hpp"

namespace kvscore::cli {

namespace {

/// A flag that sets method options (MethodInfo::options, comma-separated here too): the methods
/// that take it are the registry entries that read one of them.
struct OptionFlag {
  const char* flag;
  const char* options;
};

// --window is a query scorer's number of queries as well: it must then equal the w of Q.npy.
constexpr OptionFlag kOptionFlags[] = {
    {"--window", "window,queries"}, {"--window-tail", "window_tail"},
    {"--filters", "filters"},      {"--layer", "filters"},
    {"--filters-convention", "filters"},
    {"--queries", "queries"},      {"--query-placement", "placement"},
    {"--group", "group"},          {"--seed", "seed"},
    {"--kappa", "kappa"},          {"--sat-candidates", "sat_candidates"},
    {"--lsh-bits", "lsh_bits"},    {"--chunks", "chunks"},
    {"--bandwidth", "bandwidth"},  {"--psi", "psi"},
    {"--query-aggregate", "aggregate"},
};

/// Whether a method reads one of `options` (comma-separated).
bool reads_any(const MethodInfo& m, std::string_view options) {
  for (std::string_view o : split_list(options))
    if (reads_option(m, o)) return true;
  return false;
}

/// The scorers that read one of `options` (and satisfy `also`), under their CLI spelling.
template <class Pred>
std::string readers(std::string_view options, Pred also, bool alternatives = false) {
  const auto keep = [&](const MethodInfo& m) { return is_scorer(m) && reads_any(m, options) && also(m); };
  return alternatives ? method_alternatives(keep) : method_list(keep);
}
std::string readers(std::string_view options) {
  return readers(options, [](const MethodInfo&) { return true; });
}

std::string usage() {
  const ScorerArgs d;  // the registry's defaults
  const auto plain = [](const MethodInfo& m) { return m.kind == MethodKind::scorer; };
  const auto query = [](const MethodInfo& m) { return m.kind == MethodKind::query_scorer; };
  std::string_view alias;  // a spelling other than the CLI's, for the example
  for (const MethodInfo& m : kMethods)
    if (alias.empty() && is_scorer(m) && m.name != m.cli) alias = m.name;
  const std::string pad = "                    ";
  return "usage: kvscore score --method METHOD --keys K.npy --out S.npy [options]\n"
         "\n"
         "Scores every token of one layer's key cache; writes float32 scores [heads, tokens].\n"
         "Higher score = more worth keeping.\n"
         "\n"
         "  --method METHOD   " + method_list(is_scorer, " | ") + "\n" +
         pad + "(or another spelling of kvscore/methods.hpp: " + std::string(alias) + ", ...)\n"
         "  --keys K.npy      keys [heads, tokens, head_dim]: '<f4' float32, '<f2' float16,\n" +
         pad + "or '<u2' (bfloat16 bit patterns); little-endian, C order\n"
         "  --out S.npy       output scores [heads, tokens], '<f4'\n"
         "  --window W        " + readers("window", plain) + ": window length in tokens (default " +
         std::to_string(d.window) + ", > 0);\n" +
         pad + readers("queries", query) + ": observation window, must equal the w of Q.npy (default: that w)\n"
         "  --window-tail own|merge\n" +
         pad + readers("window_tail") + ": a final partial window shorter than W/2 joins the window\n" +
         pad + "before it (merge, default) or is its own window (own: the paper's Alg. 2)\n"
         "  --filters F       " + readers("filters") + " only (required): filters (layers, kv_heads, head_dim), either\n" +
         pad + "F.npy ('<f4', kvscore's convention: score = +<k, f>) or the authors'\n" +
         pad + "published F.safetensors (tensor q_filters, F32/F16/BF16; their\n" +
         pad + "convention: score = -<f, k>, the ranking of Q-Filters and kvpress)\n"
         "  --layer L         " + readers("filters") + " only: layer of F to use (default 0)\n"
         "  --filters-convention published|kvscore\n" +
         pad + readers("filters") + " only: override the sign convention the file type implies\n"
         "  --queries Q.npy   " + readers("queries") + " (required): the last w post-RoPE queries [q_heads, w, head_dim],\n" +
         pad + "'<f4'; query i sits at position tokens - w + i; the last w tokens are\n" +
         pad + "the window (protect them when selecting: select --recent w)\n"
         "  --query-placement in-cache|after-cache\n" +
         pad + readers("placement") + ": the queries are the cache's last w positions (in-cache,\n" +
         pad + "default: causal mask, protect --recent w) or follow the cache (after-cache:\n" +
         pad + "every query sees every key, nothing to protect, w may exceed the tokens)\n"
         "  --group G         " + readers("group") + ": GQA group size, must equal q_heads / heads (default: that)\n"
         "  --query-aggregate max|mean\n" +
         pad + readers("aggregate") + ": a key's score is the largest probability any query (and head\n" +
         pad + "of its group) gives it (max, default: KVzip) or their mean\n"
         "  --isa NAME        pin the SIMD kernel table (scalar, sse2, avx2, avx512, ...;\n" +
         pad + "see 'kvscore version'); default: the best this CPU supports\n"
         "  --threads N       threads over heads (default 0 = OpenMP default); results do not depend on it\n"
         "  -h, --help        this help\n"
         "  " + readers("seed") + " (with --queries and --query-placement; in-cache: select --recent w):\n"
         "  --seed S             RFF-LSH seed, integer >= 0 (default " + std::to_string(d.seed) + ")\n"
         "  --kappa K            neighbourhood radius (default " + std::to_string(d.kappa) + ")\n"
         "  --sat-candidates P   SAT candidates, 0 <= P <= tokens (default " + std::to_string(d.sat_candidates) + ")\n"
         "  --lsh-bits R         LSH bits, at most 2^R SAT prototypes, 0..16 (default " + std::to_string(d.lsh_bits) +
         ")\n"
         "  --chunks V           PDT chunks (default " + std::to_string(d.chunks) + ")\n"
         "  --bandwidth B        RFF bandwidth on unit keys, > 0; default: median pairwise distance\n"
         "  --psi sum|mean|attention\n"
         "                       cluster score: sum or mean of q̄·k, or the window queries' attention\n"
         "                       mass (softmax) of the cluster (default " + to_string(d.psi) + ")\n";
}

/// The scorer a spelling of kvscore/methods.hpp names; UsageError listing the scorers otherwise.
const MethodInfo& scorer_named(const std::string& s) {
  const MethodInfo* m = find_method_info(s);
  if (m && is_scorer(*m)) return *m;
  throw UsageError("score: " + (m ? "method '" + s + "' is not a scorer" : "unknown method '" + s + "'") +
                   " (expected " + method_alternatives(is_scorer) + ")");
}

/// Prefixes `path: ` unless the message already names the path.
[[noreturn]] void rethrow_with_path(const std::exception& e, const std::string& path) {
  const std::string m = e.what();
  throw std::invalid_argument(m.find(path) != std::string::npos ? m : path + ": " + m);
}

/// The command line of one run: the method, its files and its ScorerArgs (queries and filters
/// still to load).
struct Request {
  const MethodInfo* method = nullptr;
  std::string keys_path, out_path, filters_path, queries_path;
  std::int64_t layer = 0;
  std::optional<FilterConvention> convention;  ///< --filters-convention; default by file type
  bool window_given = false;
  ScorerArgs args;  ///< its defaults are the registry's

  bool reads(std::string_view option) const { return reads_option(*method, option); }
};

Request parse_request(const Args& args) {
  Request r;
  r.method = &scorer_named(args.required("--method"));
  // A flag the method would silently ignore is an error: a typo in --method must not quietly
  // produce scores of another kind than asked for.
  for (const OptionFlag& f : kOptionFlags)
    if (args.has(f.flag) && !reads_any(*r.method, f.options))
      throw UsageError(std::string("score: ") + f.flag + " does not apply to --method " + std::string(r.method->cli) +
                       "; " + f.flag + " applies only to --method " +
                       readers(f.options, [](const MethodInfo&) { return true; }, true));
  r.keys_path = args.required("--keys");
  r.out_path = args.required("--out");
  if (r.reads("filters")) r.filters_path = args.required("--filters");
  if (r.reads("queries")) r.queries_path = args.required("--queries");

  ScorerArgs& a = r.args;
  a.threads = int(args.get_int("--threads", a.threads, 0, kMaxThreads));
  a.window = args.get_int("--window", a.window, 1, INT64_MAX);
  r.window_given = args.has("--window");
  a.window_tail = get_enum(args, "--window-tail", a.window_tail, kWindowTails, "score: --window-tail ");
  r.layer = args.get_int("--layer", r.layer, 0, INT64_MAX);
  if (args.has("--filters-convention")) {
    const std::string c = args.required("--filters-convention");
    if (c == "published") r.convention = FilterConvention::published;
    else if (c == "kvscore") r.convention = FilterConvention::kvscore;
    else throw UsageError("score: --filters-convention must be published or kvscore (got '" + c + "')");
  }
  a.placement = get_query_placement(args, "score", a.placement);
  a.group = args.get_int("--group", a.group, 1, INT64_MAX);
  a.seed = std::uint64_t(args.get_int("--seed", std::int64_t(a.seed), 0, INT64_MAX));
  a.kappa = args.get_int("--kappa", a.kappa, 1, INT64_MAX);
  a.sat_candidates = args.get_int("--sat-candidates", a.sat_candidates, 0, INT64_MAX);
  a.lsh_bits = int(args.get_int("--lsh-bits", a.lsh_bits, 0, 16));
  a.chunks = args.get_int("--chunks", a.chunks, 0, INT64_MAX);
  if (args.has("--bandwidth")) {
    const std::string b = args.required("--bandwidth");
    a.bandwidth = parse_double(b, "score: --bandwidth");
    if (!(a.bandwidth > 0)) throw UsageError("score: --bandwidth must be > 0 (got " + b + ")");
  }
  a.aggregate = get_enum(args, "--query-aggregate", a.aggregate, kQueryAggregates, "score: --query-aggregate: ");
  if (args.has("--psi")) {
    const std::string p = args.required("--psi");
    try {
      a.psi = parse_psi(p);
    } catch (const std::invalid_argument&) {
      throw UsageError("score: --psi must be " + kvscore::detail::spellings(kPsis, true) + " (got '" + p + "')");
    }
  }
  return r;
}

/// Q.npy [q_heads, w, head_dim] '<f4' into `r.args` (it points into `q`).
void load_queries(Request& r, npy::Array& q) {
  const std::string& p = r.queries_path;
  q = npy::load(p);
  if (q.shape.size() != 3)
    throw std::invalid_argument(p + ": queries must have shape [q_heads, window, head_dim], got " +
                                std::to_string(q.shape.size()) + " dimensions");
  if (q.descr != npy::descr_of<float>())
    throw std::invalid_argument(p + ": queries dtype '" + q.descr + "' not supported (expected '<f4' float32)");
  const std::int64_t hq = q.shape[0], w = q.shape[1], dim = q.shape[2];
  const std::string shape = "[" + std::to_string(hq) + ", " + std::to_string(w) + ", " + std::to_string(dim) + "]";
  if (hq < 1 || w < 1 || dim < 1 || dim > kMaxHeadDim)
    throw std::invalid_argument(p + ": queries " + shape + " need q_heads >= 1, window >= 1 and head_dim in [1, " +
                                std::to_string(kMaxHeadDim) + "]");
  if (r.window_given && r.args.window != w)
    throw std::invalid_argument("score: --window " + std::to_string(r.args.window) + " does not match the " +
                                std::to_string(w) + " queries per head of " + p + " " + shape);
  r.args.queries = q.as<float>();
  r.args.q_heads = hq;
  r.args.n_queries = w;
  r.args.head_dim = dim;
}

/// The checks of the loaded filters and queries against the keys that name the files (the
/// scorers' own would name only shapes).
void check_against_keys(const Request& r, std::int64_t heads, std::int64_t tokens, std::int64_t dim) {
  const ScorerArgs& a = r.args;
  if (r.reads("filters") && (a.kv_heads != heads || a.head_dim != dim))
    throw std::invalid_argument("score: filters " + r.filters_path + " layer " + std::to_string(r.layer) +
                                " are (kv_heads " + std::to_string(a.kv_heads) + ", head_dim " +
                                std::to_string(a.head_dim) + ") but keys " + r.keys_path + " are (heads " +
                                std::to_string(heads) + ", head_dim " + std::to_string(dim) + ")");
  if (!r.reads("queries")) return;
  const std::string q = "queries " + r.queries_path + " [" + std::to_string(a.q_heads) + ", " +
                        std::to_string(a.n_queries) + ", " + std::to_string(a.head_dim) + "]";
  if (a.head_dim != dim)
    throw std::invalid_argument("score: " + q + " have head_dim " + std::to_string(a.head_dim) + " but keys " +
                                r.keys_path + " have head_dim " + std::to_string(dim));
  if (heads == 0 || a.q_heads % heads != 0)
    throw std::invalid_argument("score: " + q + ": q_heads " + std::to_string(a.q_heads) +
                                " is not a multiple of the " + std::to_string(heads) + " heads of keys " + r.keys_path);
  if (a.group != 0 && a.group != a.q_heads / heads)
    throw std::invalid_argument("score: --group " + std::to_string(a.group) + " does not match q_heads / heads = " +
                                std::to_string(a.q_heads) + " / " + std::to_string(heads) + " = " +
                                std::to_string(a.q_heads / heads) + " (" + q + ", keys " + r.keys_path + ")");
  if (a.placement == QueryPlacement::in_cache && a.n_queries > tokens)
    throw std::invalid_argument("score: " + q + " hold " + std::to_string(a.n_queries) +
                                " queries per head, more than the " + std::to_string(tokens) + " tokens of keys " +
                                r.keys_path + " (the window is the last w tokens; --query-placement "
                                "after-cache for queries that follow the cache)");
}

template <class T>
Scores run(const AnyScorer& scorer, const npy::Array& keys) {
  const std::int64_t heads = keys.shape[0], tokens = keys.shape[1], dim = keys.shape[2];
  // tokens == 0: KeysView rejects head_stride 0 for heads > 1 even though no row
  // exists, so give the (unused) head stride one row's worth.
  return scorer.score(KeysView<T>(keys.as<T>(), heads, tokens, dim, std::max<std::int64_t>(tokens, 1) * dim, dim));
}

}  // namespace

const std::string kScoreUsageText = usage();
const char* const kScoreUsage = kScoreUsageText.c_str();

const std::vector<FlagSpec> kScoreFlags = [] {
  std::vector<FlagSpec> f = {{"--method", true}, {"--keys", true}, {"--out", true}, {"--isa", true}, {"--threads", true}};
  for (const OptionFlag& o : kOptionFlags) f.push_back({o.flag, true});
  return f;
}();

int cmd_score(const Args& args) {
  Request r = parse_request(args);
  set_isa(args, "score");

  ScorerArgs& a = r.args;
  if (r.reads("filters")) {
    try {
      const QFilter f =
          QFilter::load(r.filters_path, r.layer, r.convention.value_or(QFilter::file_convention(r.filters_path)));
      a.filters = f.filters();
      a.kv_heads = f.kv_heads();
      a.head_dim = f.head_dim();
    } catch (const std::exception& e) {
      rethrow_with_path(e, r.filters_path);
    }
  }

  const npy::Array keys = npy::load(r.keys_path);
  const std::string& p = r.keys_path;
  if (keys.shape.size() != 3)
    throw std::invalid_argument(p + ": keys must have shape [heads, tokens, head_dim], got " +
                                std::to_string(keys.shape.size()) + " dimensions");
  const std::int64_t dim = keys.shape[2];
  if (dim < 1 || dim > kMaxHeadDim)
    throw std::invalid_argument(p + ": head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " +
                                std::to_string(dim) + ")");

  npy::Array queries;
  if (r.reads("queries")) load_queries(r, queries);
  std::optional<AnyScorer> scorer;
  try {
    scorer.emplace(make_scorer(r.method->name, a));
  } catch (const std::invalid_argument& e) {
    rethrow_with_path(e, r.reads("queries") ? r.queries_path : r.reads("filters") ? r.filters_path : p);
  }

  Scores scores;
  try {
    check_against_keys(r, keys.shape[0], keys.shape[1], dim);
    scores = visit_dtype(npy::element_dtype(keys, "keys"),
                         [&]<class T>(std::type_identity<T>) { return run<T>(*scorer, keys); });
  } catch (const npy::error&) {
    throw;
  } catch (const std::invalid_argument& e) {
    rethrow_with_path(e, p);
  }

  save_f32_npy_atomic(r.out_path, {scores.heads(), scores.tokens()}, scores.data());
  return kExitOk;
}

KVSCORE_CLI_COMMAND(score, "score", "score every token of one layer's keys (.npy in, .npy out)", cmd_score, kScoreFlags, kScoreUsage);

}  // namespace kvscore::cli
