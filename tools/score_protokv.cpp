// tools/score_protokv.cpp — `kvscore score --method protokv` (docs/protokv.md): the method's
// flag handling, called by cmd_score.cpp when --method is protokv. Self-contained: it checks
// every flag it reads and rejects the score flags of other methods, so cmd_score only has to
// hand it the parsed Args (whose flag list must include kProtoKVScoreFlags).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include <kvscore/io/npy.hpp>
#include <kvscore/make_scorer.hpp>
#include <kvscore/scorers/protokv.hpp>
#include <kvscore/simd/dispatch.hpp>

#include "cli.hpp"

namespace kvscore::cli {

/// Flags of `score` that only --method protokv takes (cmd_score's flag list needs them too);
/// it also reads --keys, --queries, --out, --group, --window, --isa and --threads.
extern const std::vector<FlagSpec> kProtoKVScoreFlags;
const std::vector<FlagSpec> kProtoKVScoreFlags = {
    {"--seed", true}, {"--kappa", true}, {"--sat-candidates", true}, {"--lsh-bits", true},
    {"--chunks", true}, {"--bandwidth", true}, {"--psi", true},
};

/// Lines for `kvscore score --help`.
extern const char* const kProtoKVScoreUsage;
const char* const kProtoKVScoreUsage =
    "  protokv (--queries, --query-placement as for snapkv; in-cache: select --recent w):\n"
    "  --seed S             RFF-LSH seed, integer >= 0 (default 0)\n"
    "  --kappa K            neighbourhood radius (default 5)\n"
    "  --sat-candidates P   SAT candidates, 0 <= P <= tokens (default 32)\n"
    "  --lsh-bits R         LSH bits, at most 2^R SAT prototypes, 0..16 (default 2)\n"
    "  --chunks V           PDT chunks (default 496)\n"
    "  --bandwidth B        RFF bandwidth on unit keys, > 0; default: median pairwise distance\n"
    "  --psi sum|mean|attention\n"
    "                       cluster score: sum or mean of q̄·k, or the window queries' attention\n"
    "                       mass (softmax) of the cluster (default attention)\n";

void run_score_protokv(const Args& args);

namespace {

const char* const kOtherMethodFlags[] = {"--filters", "--layer"};

double parse_positive_double(const std::string& text, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE || !std::isfinite(v))
    throw UsageError(what + ": '" + text + "' is not a finite number");
  if (!(v > 0)) throw UsageError(what + " must be > 0 (got " + text + ")");
  return v;
}

template <class T>
Scores score_keys(const ProtoKV& pk, const npy::Array& keys) {
  const std::int64_t H = keys.shape[0], N = keys.shape[1], d = keys.shape[2];
  const KeysView<T> view(keys.as<T>(), H, N, d, std::max<std::int64_t>(N, 1) * d, d);
  return pk.score(view);
}

}  // namespace

void run_score_protokv(const Args& args) {
  for (const char* f : kOtherMethodFlags)
    if (args.has(f)) throw UsageError(std::string("score: ") + f + " does not apply to --method protokv");
  const std::string keys_path = args.required("--keys"), out_path = args.required("--out");
  const std::string q_path = args.required("--queries");
  const std::int64_t group = args.get_int("--group", 0, 1, INT64_MAX);
  const std::int64_t threads = args.get_int("--threads", 0, 0, 4096);
  const std::int64_t seed = args.get_int("--seed", 0, 0, INT64_MAX);
  const std::int64_t kappa = args.get_int("--kappa", ProtoKV::kDefaultKappa, 1, INT64_MAX);
  const std::int64_t lsh_bits = args.get_int("--lsh-bits", ProtoKV::kDefaultLshBits, 0, 16);
  const std::int64_t chunks = args.get_int("--chunks", ProtoKV::kDefaultChunks, 0, INT64_MAX);
  const std::int64_t p = args.get_int("--sat-candidates", ProtoKV::kDefaultSatCandidates, 0, INT64_MAX);
  const double bandwidth = args.has("--bandwidth") ? parse_positive_double(args.required("--bandwidth"),
                                                                           "score: --bandwidth")
                                                   : 0.0;
  const std::string psi = args.get("--psi", "attention");
  if (psi != "sum" && psi != "mean" && psi != "attention")
    throw UsageError("score: --psi must be sum, mean or attention (got '" + psi + "')");
  const QueryPlacement placement = get_query_placement(args, "score", QueryPlacement::in_cache);
  if (args.has("--isa")) {
    try {
      simd::set_active_isa(args.required("--isa"));
    } catch (const std::invalid_argument& e) {
      const std::string m = e.what();
      const std::size_t colon = m.find(": ");
      throw UsageError("score: --isa: " + (colon == std::string::npos ? m : m.substr(colon + 2)));
    }
  }

  const npy::Array q = npy::load(q_path);
  if (q.shape.size() != 3)
    throw std::invalid_argument(q_path + ": queries must have shape [q_heads, window, head_dim], got " +
                                std::to_string(q.shape.size()) + " dimensions");
  if (q.descr != npy::descr_of<float>())
    throw std::invalid_argument(q_path + ": queries dtype '" + q.descr + "' not supported (expected '<f4' float32)");
  const std::int64_t hq = q.shape[0], w = q.shape[1], qd = q.shape[2];
  if (args.has("--window") && args.get_int("--window", 0, 1, INT64_MAX) != w)
    throw std::invalid_argument("score: --window " + args.required("--window") + " does not match the " +
                                std::to_string(w) + " queries per head of " + q_path);

  const npy::Array keys = npy::load(keys_path);
  if (keys.shape.size() != 3)
    throw std::invalid_argument(keys_path + ": keys must have shape [heads, tokens, head_dim], got " +
                                std::to_string(keys.shape.size()) + " dimensions");
  const std::int64_t H = keys.shape[0], N = keys.shape[1], d = keys.shape[2];
  if (d < 1 || d > kMaxHeadDim)
    throw std::invalid_argument(keys_path + ": head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " +
                                std::to_string(d) + ")");
  Scores scores;
  try {
    if (hq < 1 || w < 1 || qd < 1 || qd > kMaxHeadDim)
      throw std::invalid_argument("queries [" + std::to_string(hq) + ", " + std::to_string(w) + ", " +
                                  std::to_string(qd) + "] need q_heads >= 1, window >= 1 and head_dim in [1, " +
                                  std::to_string(kMaxHeadDim) + "]");
    // the registry's constructor (kvscore/make_scorer.hpp), then ProtoKV's own options
    ScorerArgs a;
    a.threads = int(threads);
    a.queries = q.as<float>();
    a.q_heads = hq;
    a.n_queries = w;
    a.head_dim = qd;
    a.group = group;
    a.placement = placement;
    AnyScorer scorer = make_scorer("protokv", a);
    ProtoKV& pk = *scorer.get<ProtoKV>();
    pk.seed = std::uint64_t(seed);
    pk.kappa = kappa;
    pk.lsh_bits = int(lsh_bits);
    pk.chunks = chunks;
    pk.sat_candidates = p;
    pk.bandwidth = bandwidth;
    pk.psi = psi == "mean" ? ProtoKV::Psi::mean : psi == "attention" ? ProtoKV::Psi::attention : ProtoKV::Psi::sum;
    if (keys.descr == npy::descr_of<float>()) scores = score_keys<float>(pk, keys);
    else if (keys.descr == npy::descr_of<half>()) scores = score_keys<half>(pk, keys);
    else if (keys.descr == npy::descr_of<bfloat16>()) scores = score_keys<bfloat16>(pk, keys);
    else
      throw std::invalid_argument("keys dtype '" + keys.descr +
                                  "' not supported (expected '<f4' float32, '<f2' float16 or '<u2' bfloat16 bits)");
  } catch (const std::invalid_argument& e) {
    // name both inputs: a mismatch may lie in either
    throw std::invalid_argument("score: " + std::string(e.what()) + " (keys " + keys_path + " [" +
                                std::to_string(H) + ", " + std::to_string(N) + ", " + std::to_string(d) +
                                "], queries " + q_path + " [" + std::to_string(hq) + ", " + std::to_string(w) + ", " +
                                std::to_string(qd) + "])");
  }
  save_f32_npy_atomic(out_path, {scores.heads(), scores.tokens()}, scores.data());
}

}  // namespace kvscore::cli
