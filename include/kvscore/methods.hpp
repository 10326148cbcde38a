// kvscore/methods.hpp — the one list of kvscore's methods. The evaluator (eval/methods.hpp),
// the CLI (`kvscore score`, `kvscore eval --methods`), the benchmarks and the Python package
// (kvscore.METHODS / ALIASES) all read it; a test checks each of them against it, so adding a
// method starts here and the tests name every front end that still lacks it.
//
// Names: `name` is the one name in code, Python and docs (the class's name in snake case).
// `cli` is the spelling the CLI, the evaluator's report and the benchmark names print; it is
// `name` except where an earlier contract fixed a short form (`kvscore score --method l2`,
// issue 2; `pariskv-flat` in eval reports). Every spelling in `cli` and `aliases` is accepted
// wherever a method is named. This header is metadata only: it includes no method, so any
// floor may read it.
//
// Defaults: the kDefault* constants below are every default a method shares with a front end
// (the CLI, the evaluator, Python); each is written here once, and the methods' own constants
// (SnapKV::kDefaultWindow, ProtoKV::kDefaultKappa, ...) name these.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kvscore {

// ---- defaults shared by the methods and every front end

/// windowed ManifoldKV: the window W in tokens (manifoldkv.txt Alg. 2).
inline constexpr std::int64_t kDefaultWindow = 4096;
/// SnapKV: the observation window w, the queries to capture (the paper's and kvpress's window_size).
inline constexpr std::int64_t kDefaultSnapKVWindow = 64;
/// SnapKV: the average-pooling kernel over the prefix (the paper's code and kvpress).
inline constexpr std::int64_t kDefaultSnapKVKernel = 5;
/// ProtoKV: the neighbourhood radius κ (the paper's default).
inline constexpr std::int64_t kDefaultProtoKVKappa = 5;
/// ProtoKV: the SAT candidates p (the paper: 20–40 suffice).
inline constexpr std::int64_t kDefaultProtoKVSatCandidates = 32;
/// ProtoKV: the LSH bits r, at most 2^r = 4 SAT prototypes (the paper: 2–4).
inline constexpr int kDefaultProtoKVLshBits = 2;
/// ProtoKV: the PDT chunks v; with 2^r SAT buckets at most 500 prototypes (the paper: about 500).
inline constexpr std::int64_t kDefaultProtoKVChunks = 496;
/// StreamingLLM and ParisKV's zones: the attention sinks kept at the start (Xiao et al. use 4).
inline constexpr std::int64_t kDefaultSinks = 4;
/// ParisKV's zones: the local window is min(kDefaultParisKVLocal, (n − sinks) / 2).
inline constexpr std::int64_t kDefaultParisKVLocal = 256;
/// KVzip: context tokens reconstructed per pass (kvpress KVzipPress's chunk_size).
inline constexpr std::int64_t kDefaultKVzipChunk = 2048;
/// KVzip: tokens of the previous chunk a later pass's prompt repeats (kvpress's prev_postfix_size).
inline constexpr std::int64_t kDefaultKVzipRepeat = 8;
/// KVzip's reconstruction prompts (the paper's, kvpress KVzipPress's): the first pass, and the
/// later ones, which continue with the last kDefaultKVzipRepeat tokens of the previous chunk.
inline constexpr std::string_view kKVzipPromptFirst = "\n\nRepeat the previous context exactly.";
/// The later passes' prompt, followed by the previous chunk's last kDefaultKVzipRepeat tokens.
inline constexpr std::string_view kKVzipPromptNext = "\n\nRepeat the part of the previous context exactly, starting with";

/// What shape of method an entry is (the concepts of contract.hpp where one exists); each kind
/// has its constructor in kvscore/make_method.hpp.
enum class MethodKind {
  scorer,          ///< Scorer: score(keys) -> Scores, query-agnostic
  query_scorer,    ///< QueryScorer: scored by a window of queries, protects protected_recent()
  selection_rule,  ///< a selector configuration without scores (StreamingLLM)
  retriever,       ///< Retriever: per-query top-k over an index (ParisKV)
  hybrid,          ///< HybridStore: full-rank tokens + low-rank codes (OjaKV)
  reference,       ///< not a compression method: the evaluator's ceiling (oracle)
};

/// The kind's name in the registry (`kvscore.REGISTRY`'s "kind"): "scorer", "query_scorer", ...
inline constexpr std::string_view kind_name(MethodKind k) noexcept {
  switch (k) {
    case MethodKind::scorer: return "scorer";
    case MethodKind::query_scorer: return "query_scorer";
    case MethodKind::selection_rule: return "selection_rule";
    case MethodKind::retriever: return "retriever";
    case MethodKind::hybrid: return "hybrid";
    case MethodKind::reference: return "reference";
  }
  return "?";
}

/// One entry of the registry: a method's names, kind, type, header and documentation page.
struct MethodInfo {
  std::string_view name;     ///< canonical: code, Python, docs
  std::string_view cli;      ///< the CLI / report / benchmark spelling
  std::string_view aliases;  ///< other accepted spellings, comma-separated ("" = none)
  MethodKind kind;  ///< which constructor of make_method.hpp builds it
  std::string_view cls;      ///< the C++ type (kvscore::cls)
  std::string_view header;   ///< its header, under `include/`
  std::string_view doc;      ///< its documentation page, under `docs/`
  std::string_view summary;  ///< one line for --help, the evaluator and the docs
  /// The options beyond the keys a front end passes to its constructor, comma-separated ("" =
  /// none): the fields of its kind's arguments (kvscore/make_method.hpp: ScorerArgs, ...) it
  /// reads, which are also the CLI's flags (`filters`: a Q-Filters filter file there).
  std::string_view options = "";
};

/// Every method, in the evaluator's report order (`--methods all`).
inline constexpr std::array<MethodInfo, 13> kMethods = {{
    {"knorm", "knorm", "k-norm", MethodKind::scorer, "KNorm", "kvscore/scorers/knorm.hpp", "methods/knorm.md",
     "K-norm: keep low-norm keys"},
    {"keydiff", "keydiff", "", MethodKind::scorer, "KeyDiff", "kvscore/scorers/keydiff.hpp", "methods/keydiff.md",
     "KeyDiff: keep keys least similar (cosine) to the mean direction"},
    {"manifold_l2", "l2", "manifoldkv,manifold-l2", MethodKind::scorer, "ManifoldL2",
     "kvscore/scorers/manifold_l2.hpp", "methods/manifoldkv.md", "ManifoldKV: keep keys far (L2) from the centroid"},
    {"windowed_manifold_l2", "windowed-l2", "windowed_l2,windowed-manifoldkv", MethodKind::scorer,
     "WindowedManifoldL2", "kvscore/scorers/windowed_manifold_l2.hpp", "methods/windowed-manifoldkv.md",
     "windowed ManifoldKV: L2 to the centroid of the key's window (--window)", "window,window_tail"},
    {"qfilter", "qfilter", "q-filters,qfilters", MethodKind::scorer, "QFilter", "kvscore/scorers/qfilter.hpp",
     "methods/qfilters.md", "Q-Filters: <k, f_h>, filters calibrated on the queries", "filters"},
    {"snapkv", "snapkv", "", MethodKind::query_scorer, "SnapKV", "kvscore/scorers/snapkv.hpp", "methods/snapkv.md",
     "SnapKV: pooled attention of the window queries (in-cache: window kept)",
     "queries,group,placement,kernel_size"},
    {"streaming_llm", "streaming_llm", "streamingllm,streaming-llm", MethodKind::selection_rule, "StreamingLLM",
     "kvscore/streaming_llm.hpp", "reference/select.md", "StreamingLLM: sinks + most recent tokens (per head)", "sinks"},
    {"protokv", "protokv", "", MethodKind::query_scorer, "ProtoKV", "kvscore/scorers/protokv.hpp", "methods/protokv.md",
     "ProtoKV: prototype clusters scored by the window queries (in-cache: window kept)",
     "queries,group,placement,seed,kappa,sat_candidates,lsh_bits,chunks,bandwidth,psi"},
    {"kvzip", "kvzip", "", MethodKind::query_scorer, "KVzip", "kvscore/scorers/kvzip.hpp", "methods/kvzip.md",
     "KVzip: attention received from a set of queries (a context-reconstruction pass), max over queries",
     "queries,group,placement,aggregate"},
    {"pariskv", "pariskv", "", MethodKind::retriever, "ParisKVCache", "kvscore/pariskv/cache.hpp", "methods/pariskv.md",
     "ParisKV with zones: 4 sinks + a local window of min(256, (n-4)/2) + per-query retrieval"},
    {"pariskv_flat", "pariskv-flat", "", MethodKind::retriever, "ParisKVCache", "kvscore/pariskv/cache.hpp",
     "methods/pariskv.md", "ParisKV without zones: per-query top-n retrieval over the whole cache"},
    {"ojakv", "ojakv", "", MethodKind::hybrid, "OjaHybridCache", "kvscore/ojakv/ojakv.hpp", "methods/ojakv.md",
     "OjaKV: n full-rank tokens by query-weighted residual, the rest at rank head_dim/4 (hybrid)",
     "queries,placement"},
    {"oracle", "oracle", "", MethodKind::reference, "", "kvscore/eval/methods.hpp", "reference/evaluate.md",
     "oracle: top mean full attention of the evaluation queries (ceiling)"},
}};

/// True when `s` is one of the comma-separated spellings in `list`.
inline constexpr bool in_list(std::string_view list, std::string_view s) noexcept {
  while (!list.empty()) {
    const std::size_t c = list.find(',');
    if (list.substr(0, c) == s) return true;
    if (c == std::string_view::npos) break;
    list.remove_prefix(c + 1);
  }
  return false;
}

/// The index in kMethods of the entry a spelling (name, cli or alias) names; -1 when none
/// does. (An index, not a pointer, so that constant evaluation needs no address comparison,
/// which GCC refuses under -fsanitize=address,undefined.)
inline constexpr int method_index(std::string_view spelling) noexcept {
  if (spelling.empty()) return -1;
  for (std::size_t i = 0; i < kMethods.size(); ++i) {
    const MethodInfo& m = kMethods[i];
    if (m.name == spelling || m.cli == spelling || in_list(m.aliases, spelling)) return int(i);
  }
  return -1;
}

/// The spellings in a comma-separated list (an entry's `aliases`), in order.
inline std::vector<std::string_view> split_list(std::string_view list) {
  std::vector<std::string_view> out;
  while (!list.empty()) {
    const std::size_t c = list.find(',');
    out.push_back(list.substr(0, c));
    if (c == std::string_view::npos) break;
    list.remove_prefix(c + 1);
  }
  return out;
}

/// The entry a spelling names; nullptr when none does.
inline const MethodInfo* find_method_info(std::string_view spelling) noexcept {
  const int i = method_index(spelling);
  return i < 0 ? nullptr : &kMethods[std::size_t(i)];
}

/// Every method's CLI spelling of the given kinds, ", "-separated (for messages and --help).
template <class Pred>
std::string method_list(Pred keep, std::string_view sep = ", ") {
  std::string s;
  for (const MethodInfo& m : kMethods)
    if (keep(m)) s += std::string(s.empty() ? "" : sep) + std::string(m.cli);
  return s;
}

/// As method_list, with the last two joined by " or " ("a", "a or b", "a, b or c"): for messages.
template <class Pred>
std::string method_alternatives(Pred keep) {
  const std::string s = method_list(keep);
  const std::size_t last = s.rfind(", ");
  return last == std::string::npos ? s : s.substr(0, last) + " or " + s.substr(last + 2);
}

/// Whether a method reads an option of MethodInfo::options.
inline constexpr bool reads_option(const MethodInfo& m, std::string_view option) noexcept {
  return in_list(m.options, option);
}

/// The entry a spelling names; std::invalid_argument naming the spelling and the known names otherwise.
inline const MethodInfo& method_info(std::string_view spelling) {
  if (const MethodInfo* m = find_method_info(spelling)) return *m;
  throw std::invalid_argument("kvscore: unknown method '" + std::string(spelling) + "' (expected one of " +
                              method_list([](const MethodInfo&) { return true; }) + ")");
}

/// The methods that are scorers (query-agnostic or query-driven): what `kvscore score` runs.
inline constexpr bool is_scorer(const MethodInfo& m) noexcept {
  return m.kind == MethodKind::scorer || m.kind == MethodKind::query_scorer;
}

// Names are unique across all spellings: no spelling may name two methods.
namespace detail {
constexpr bool method_spellings_unique() {
  for (std::size_t i = 0; i < kMethods.size(); ++i)
    for (std::size_t j = 0; j < kMethods.size(); ++j) {
      if (i == j) continue;
      const MethodInfo &a = kMethods[i], &b = kMethods[j];
      if (in_list(b.aliases, a.name) || in_list(b.aliases, a.cli) || a.name == b.name || a.cli == b.cli ||
          a.name == b.cli)
        return false;
    }
  return true;
}
static_assert(method_spellings_unique(), "kMethods: a spelling names two methods");
}  // namespace detail

}  // namespace kvscore
