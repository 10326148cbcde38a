// tools/cmd_score.cpp — `kvscore score`: score every token of one layer's keys.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <kvscore/kvscore.hpp>

#include "cli.hpp"

namespace kvscore::cli {

// The protokv lines come from tools/score_protokv.cpp (constant-initialised, so safe here).
extern const char* const kProtoKVScoreUsage;
extern const std::vector<FlagSpec> kProtoKVScoreFlags;
void run_score_protokv(const Args& args);

// The scorers of kvscore/methods.hpp, in its order, under their CLI spelling.
const std::string kScorerNames = method_list(is_scorer, " | ");

const std::string kScoreUsageText = std::string(
    "usage: kvscore score --method METHOD --keys K.npy --out S.npy [options]\n"
    "\n"
    "Scores every token of one layer's key cache; writes float32 scores [heads, tokens].\n"
    "Higher score = more worth keeping.\n"
    "\n"
    "  --method METHOD   ") + kScorerNames + "\n" + std::string(
    "                    (or another spelling of kvscore/methods.hpp: manifold_l2, ...)\n"
    "  --keys K.npy      keys [heads, tokens, head_dim]: '<f4' float32, '<f2' float16,\n"
    "                    or '<u2' (bfloat16 bit patterns); little-endian, C order\n"
    "  --out S.npy       output scores [heads, tokens], '<f4'\n"
    "  --window W        windowed-l2: window length in tokens (default 4096, > 0);\n"
    "                    snapkv: observation window, must equal the w of Q.npy (default: that w)\n"
    "  --window-tail own|merge\n"
    "                    windowed-l2: a final partial window shorter than W/2 joins the window\n"
    "                    before it (merge, default) or is its own window (own: the paper's Alg. 2)\n"
    "  --filters F       qfilter only (required): filters (layers, kv_heads, head_dim), either\n"
    "                    F.npy ('<f4', kvscore's convention: score = +<k, f>) or the authors'\n"
    "                    published F.safetensors (tensor q_filters, F32/F16/BF16; their\n"
    "                    convention: score = -<f, k>, the ranking of Q-Filters and kvpress)\n"
    "  --layer L         qfilter only: layer of F to use (default 0)\n"
    "  --filters-convention published|kvscore\n"
    "                    qfilter only: override the sign convention the file type implies\n"
    "  --queries Q.npy   snapkv, protokv (required): the last w post-RoPE queries [q_heads, w, head_dim],\n"
    "                    '<f4'; query i sits at position tokens - w + i; the last w tokens are\n"
    "                    the window (protect them when selecting: select --recent w)\n"
    "  --query-placement in-cache|after-cache\n"
    "                    snapkv, protokv: the queries are the cache's last w positions (in-cache,\n"
    "                    default: causal mask, protect --recent w) or follow the cache (after-cache:\n"
    "                    every query sees every key, nothing to protect, w may exceed the tokens)\n"
    "  --group G         snapkv, protokv: GQA group size, must equal q_heads / heads (default: that)\n"
    "  --isa NAME        pin the SIMD kernel table (scalar, sse2, avx2, avx512, ...;\n"
    "                    see 'kvscore version'); default: the best this CPU supports\n"
    "  --threads N       threads over heads (default 0 = OpenMP default); results do not depend on it\n"
    "  -h, --help        this help\n") + kProtoKVScoreUsage;
const char* const kScoreUsage = kScoreUsageText.c_str();

const std::vector<FlagSpec> kScoreFlags = {
    {"--method", true}, {"--keys", true},  {"--out", true}, {"--window", true},  {"--window-tail", true},
    {"--filters", true},
    {"--layer", true},  {"--filters-convention", true}, {"--isa", true},  {"--threads", true},
    {"--queries", true}, {"--group", true}, {"--query-placement", true},
    // --method protokv only (the same list as kProtoKVScoreFlags, which is not usable during static init)
    {"--seed", true},   {"--kappa", true}, {"--sat-candidates", true}, {"--lsh-bits", true}, {"--chunks", true},
    {"--bandwidth", true}, {"--psi", true},
};

namespace {

/// Any spelling kvscore/methods.hpp accepts for a scorer, as its canonical name; protokv is
/// handled before this (its own flags, tools/score_protokv.cpp).
std::string_view parse_method(const std::string& s) {
  const MethodInfo* m = find_method_info(s);
  if (m && is_scorer(*m) && m->name != "protokv") return m->name;
  const std::string names = method_list(is_scorer);
  const std::size_t last = names.rfind(", ");
  throw UsageError("score: " + (m ? "method '" + s + "' is not a scorer" : "unknown method '" + s + "'") +
                   " (expected " + names.substr(0, last) + " or " + names.substr(last + 2) + ")");
}

struct Options {
  std::string_view method;  ///< canonical name (kvscore/methods.hpp)
  std::string keys_path, out_path;
  std::int64_t window = 4096;
  WindowTail window_tail = WindowTail::merge;
  std::string filters_path;
  std::int64_t layer = 0;
  std::optional<FilterConvention> convention;  // --filters-convention; default by file type
  std::string queries_path;
  QueryPlacement placement = QueryPlacement::in_cache;
  std::int64_t group = 0;  // 0: not given
  bool window_given = false;
  int threads = 0;
};

Options parse_options(const Args& args) {
  Options o;
  o.method = parse_method(args.required("--method"));
  o.keys_path = args.required("--keys");
  o.out_path = args.required("--out");
  // Flags that another method would silently ignore are errors: a typo in --method
  // must not quietly produce scores of a different kind than asked for.
  const bool windowed = o.method == "windowed_manifold_l2", qfilter = o.method == "qfilter",
             snapkv = o.method == "snapkv";
  if (args.has("--window") && !windowed && !snapkv)
    throw UsageError("score: --window applies only to --method windowed-l2 or snapkv");
  for (const char* f : {"--filters", "--layer", "--filters-convention"})
    if (args.has(f) && !qfilter)
      throw UsageError(std::string("score: ") + f + " applies only to --method qfilter");
  for (const char* f : {"--queries", "--group", "--query-placement"})
    if (args.has(f) && !snapkv)
      throw UsageError(std::string("score: ") + f + " applies only to --method snapkv or protokv");
  o.placement = get_query_placement(args, "score", QueryPlacement::in_cache);
  if (args.has("--window-tail") && !windowed)
    throw UsageError("score: --window-tail applies only to --method windowed-l2");
  o.window = args.get_int("--window", 4096, 1, INT64_MAX);
  o.window_given = args.has("--window");
  if (args.has("--window-tail")) {
    const std::string t = args.required("--window-tail");
    if (t != "own" && t != "merge") throw UsageError("score: --window-tail '" + t + "' (expected own or merge)");
    o.window_tail = parse_window_tail(t);
  }
  o.group = args.get_int("--group", 0, 1, INT64_MAX);
  o.layer = args.get_int("--layer", 0, 0, INT64_MAX);
  o.threads = int(args.get_int("--threads", 0, 0, 4096));
  if (qfilter) o.filters_path = args.required("--filters");
  if (args.has("--filters-convention")) {
    const std::string c = args.required("--filters-convention");
    if (c == "published") o.convention = FilterConvention::published;
    else if (c == "kvscore") o.convention = FilterConvention::kvscore;
    else throw UsageError("score: --filters-convention must be published or kvscore (got '" + c + "')");
  }
  if (snapkv) o.queries_path = args.required("--queries");
  return o;
}

/// Prefixes `path: ` unless the message already names the path.
[[noreturn]] void rethrow_with_path(const std::exception& e, const std::string& path) {
  const std::string m = e.what();
  throw std::invalid_argument(m.find(path) != std::string::npos ? m : path + ": " + m);
}

/// Q.npy [q_heads, w, head_dim] '<f4' into `a` (it points into `q`); the checks against the
/// keys come in run().
void load_queries(const Options& o, npy::Array& q, ScorerArgs& a) {
  const std::string& p = o.queries_path;
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
  if (o.window_given && o.window != w)
    throw std::invalid_argument("score: --window " + std::to_string(o.window) + " does not match the " +
                                std::to_string(w) + " queries per head of " + p + " " + shape);
  a.queries = q.as<float>();
  a.q_heads = hq;
  a.n_queries = w;
  a.head_dim = dim;
  a.placement = o.placement;
}

template <class T>
Scores run(const Options& o, const AnyScorer& scorer, const npy::Array& keys) {
  const std::int64_t heads = keys.shape[0], tokens = keys.shape[1], dim = keys.shape[2];
  // tokens == 0: KeysView rejects head_stride 0 for heads > 1 even though no row
  // exists, so give the (unused) head stride one row's worth.
  const KeysView<T> view(keys.as<T>(), heads, tokens, dim, std::max<std::int64_t>(tokens, 1) * dim, dim);
  // the checks that name the files (the scorers' own would name only shapes)
  if (const QFilter* f = scorer.get<QFilter>(); f && (f->kv_heads() != heads || f->head_dim() != dim))
    throw std::invalid_argument("score: filters " + o.filters_path + " layer " + std::to_string(o.layer) +
                                " are (kv_heads " + std::to_string(f->kv_heads()) + ", head_dim " +
                                std::to_string(f->head_dim()) + ") but keys " + o.keys_path + " are (heads " +
                                std::to_string(heads) + ", head_dim " + std::to_string(dim) + ")");
  if (const SnapKV* sp = scorer.get<SnapKV>()) {
    const SnapKV& s = *sp;
    const std::string q = "queries " + o.queries_path + " [" + std::to_string(s.q_heads()) + ", " +
                          std::to_string(s.window()) + ", " + std::to_string(s.head_dim()) + "]";
    if (s.head_dim() != dim)
      throw std::invalid_argument("score: " + q + " have head_dim " + std::to_string(s.head_dim()) + " but keys " +
                                  o.keys_path + " have head_dim " + std::to_string(dim));
    if (heads == 0 || s.q_heads() % heads != 0)
      throw std::invalid_argument("score: " + q + ": q_heads " + std::to_string(s.q_heads()) +
                                  " is not a multiple of the " + std::to_string(heads) + " heads of keys " +
                                  o.keys_path);
    if (o.group != 0 && o.group != s.q_heads() / heads)
      throw std::invalid_argument("score: --group " + std::to_string(o.group) + " does not match q_heads / heads = " +
                                  std::to_string(s.q_heads()) + " / " + std::to_string(heads) + " = " +
                                  std::to_string(s.q_heads() / heads) + " (" + q + ", keys " + o.keys_path + ")");
    if (s.placement == QueryPlacement::in_cache && s.window() > tokens)
      throw std::invalid_argument("score: " + q + " hold " + std::to_string(s.window()) +
                                  " queries per head, more than the " + std::to_string(tokens) + " tokens of keys " +
                                  o.keys_path + " (the window is the last w tokens; --query-placement "
                                  "after-cache for queries that follow the cache)");
  }
  return scorer.score(view);
}

}  // namespace

int cmd_score(const Args& args) {
  if (const MethodInfo* m = find_method_info(args.required("--method")); m && m->name == "protokv") {
    run_score_protokv(args);
    return kExitOk;
  }
  for (const FlagSpec& f : kProtoKVScoreFlags)
    if (args.has(f.name)) throw UsageError(std::string("score: ") + f.name + " applies only to --method protokv");
  const Options o = parse_options(args);
  if (args.has("--isa")) {
    try {
      simd::set_active_isa(args.required("--isa"));
    } catch (const std::invalid_argument& e) {
      const std::string m = e.what();
      const std::size_t colon = m.find(": ");
      throw UsageError("score: --isa: " + (colon == std::string::npos ? m : m.substr(colon + 2)));
    }
  }

  // the registry's constructor (kvscore/make_scorer.hpp) from the flags and files
  ScorerArgs a;
  a.threads = o.threads;
  a.window = o.window;
  a.window_tail = o.window_tail;
  if (o.method == "qfilter") {
    try {
      const QFilter f =
          QFilter::load(o.filters_path, o.layer, o.convention.value_or(QFilter::file_convention(o.filters_path)));
      a.filters = f.filters();
      a.kv_heads = f.kv_heads();
      a.head_dim = f.head_dim();
    } catch (const std::exception& e) {
      rethrow_with_path(e, o.filters_path);
    }
  }

  const npy::Array keys = npy::load(o.keys_path);
  const std::string& p = o.keys_path;
  if (keys.shape.size() != 3)
    throw std::invalid_argument(p + ": keys must have shape [heads, tokens, head_dim], got " +
                                std::to_string(keys.shape.size()) + " dimensions");
  const std::int64_t dim = keys.shape[2];
  if (dim < 1 || dim > kMaxHeadDim)
    throw std::invalid_argument(p + ": head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " +
                                std::to_string(dim) + ")");

  npy::Array queries;
  if (o.method == "snapkv") load_queries(o, queries, a);
  std::optional<AnyScorer> scorer;
  try {
    scorer.emplace(make_scorer(o.method, a));
  } catch (const std::invalid_argument& e) {
    rethrow_with_path(e, o.method == "snapkv" ? o.queries_path : o.method == "qfilter" ? o.filters_path : p);
  }

  Scores scores;
  try {
    if (keys.descr == npy::descr_of<float>()) scores = run<float>(o, *scorer, keys);
    else if (keys.descr == npy::descr_of<half>()) scores = run<half>(o, *scorer, keys);
    else if (keys.descr == npy::descr_of<bfloat16>()) scores = run<bfloat16>(o, *scorer, keys);
    else
      throw std::invalid_argument("keys dtype '" + keys.descr +
                                  "' not supported (expected '<f4' float32, '<f2' float16 or '<u2' bfloat16 bits)");
  } catch (const npy::error&) {
    throw;
  } catch (const std::invalid_argument& e) {
    rethrow_with_path(e, p);
  }

  save_f32_npy_atomic(o.out_path, {scores.heads(), scores.tokens()}, scores.data());
  return kExitOk;
}

KVSCORE_CLI_COMMAND(score, "score", "score every token of one layer's keys (.npy in, .npy out)", cmd_score, kScoreFlags, kScoreUsage);

}  // namespace kvscore::cli
