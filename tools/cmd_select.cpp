// tools/cmd_select.cpp — `kvscore select`: choose the tokens to keep from scores.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <unistd.h>

#include <kvscore/io/npy.hpp>
#include <kvscore/select.hpp>

#include "cli.hpp"

namespace kvscore::cli {

const std::string kSelectUsageText =
    "usage: kvscore select --scores S.npy --keep N --out I.npy [options]\n"
    "\n"
    "Chooses the tokens to keep from scores [heads, tokens] (higher = keep). Kept positions\n"
    "are ascending per head. Ties: lower position first; NaN ranks below every number.\n"
    "\n"
    "  --scores S.npy    scores [heads, tokens], '<f4' (e.g. from 'kvscore score')\n"
    "  --keep N          tokens kept per head (the layer keeps N x heads with adakv); 0 <= N <= tokens\n"
    "  --out I.npy       per-head: int64 [heads, N]; adakv: int64 [total] and I.offsets.npy\n"
    "                    int64 [heads + 1] (CSR: head h keeps I[offsets[h]:offsets[h+1]])\n"
    "  --sinks S         always keep the first S tokens of every head (default 0); they count in N\n"
    "  --recent R        always keep the last R tokens of every head (default 0); they count in N\n"
    "  --alloc A         per-head (default) | adakv (safeguard + one global top-k, ragged heads)\n"
    "  --alpha A         adakv only: safeguard fraction in [0, 1] (default " + help_num(SelectOptions{}.alpha) +
    "): every head keeps\n"
    "                    at least floor(A x N) tokens\n"
    "  --normalize       adakv only: z-normalise each head's scores before the global top-k\n"
    "  -h, --help        this help\n";
const char* const kSelectUsage = kSelectUsageText.c_str();

const std::vector<FlagSpec> kSelectFlags = {
    {"--scores", true}, {"--keep", true},  {"--out", true},   {"--sinks", true},
    {"--recent", true}, {"--alloc", true}, {"--alpha", true}, {"--normalize", false},
};

namespace {

/// `out` with its trailing ".npy" replaced by ".offsets.npy" (appended when there is none).
std::string offsets_path(const std::string& out) {
  const std::string ext = ".npy";
  if (out.size() >= ext.size() && out.compare(out.size() - ext.size(), ext.size(), ext) == 0)
    return out.substr(0, out.size() - ext.size()) + ".offsets.npy";
  return out + ".offsets.npy";
}

/// Writes int64 arrays to temporary files next to their targets, then renames them all,
/// so a failed run leaves no partial output.
void save_i64_npy_atomic(const std::vector<std::string>& paths, const std::vector<std::vector<std::int64_t>>& shapes,
                         const std::vector<const std::int64_t*>& data) {
  std::vector<std::string> tmps;
  auto cleanup = [&] {
    for (const auto& t : tmps) std::remove(t.c_str());
  };
  for (std::size_t i = 0; i < paths.size(); ++i) {
    const std::string tmp = paths[i] + ".tmp-" + std::to_string(static_cast<long long>(::getpid()));
    tmps.push_back(tmp);
    try {
      npy::save<std::int64_t>(tmp, shapes[i], data[i]);
    } catch (const npy::error& e) {
      cleanup();
      std::string why = e.what();
      if (why.compare(0, tmp.size() + 2, tmp + ": ") == 0) why = why.substr(tmp.size() + 2);
      throw npy::error(paths[i] + ": cannot write output: " + why);
    }
  }
  for (std::size_t i = 0; i < paths.size(); ++i) {
    if (std::rename(tmps[i].c_str(), paths[i].c_str()) != 0) {
      cleanup();
      throw npy::error(paths[i] + ": cannot write output (rename from " + tmps[i] + " failed)");
    }
  }
}

}  // namespace

int cmd_select(const Args& args) {
  const std::string scores_path = args.required("--scores");
  args.required("--keep");
  const std::string out_path = args.required("--out");
  const std::int64_t keep = args.get_int("--keep", 0, 0, INT64_MAX);
  const std::int64_t sinks = args.get_int("--sinks", 0, 0, INT64_MAX);
  const std::int64_t recent = args.get_int("--recent", 0, 0, INT64_MAX);
  SelectOptions opt;
  opt.sinks = sinks;
  opt.recent = recent;
  opt.alloc = get_enum(args, "--alloc", opt.alloc, kAllocs, "select: unknown alloc ");
  // Flags that per-head selection would silently ignore are errors.
  if (opt.alloc != Alloc::adakv && (args.has("--alpha") || args.has("--normalize")))
    throw UsageError(std::string("select: ") + (args.has("--alpha") ? "--alpha" : "--normalize") +
                     " applies only to --alloc adakv");
  if (args.has("--alpha")) {
    const std::string a = args.required("--alpha");
    opt.alpha = parse_double(a, "select: --alpha");
    if (!(opt.alpha >= 0.0 && opt.alpha <= 1.0))
      throw UsageError("select: --alpha must be in [0, 1] (got " + a + ")");
  }
  opt.normalize = args.has("--normalize");

  const npy::Array scores = npy::load(scores_path);
  if (scores.descr != npy::descr_of<float>())
    throw std::invalid_argument(scores_path + ": scores dtype '" + scores.descr +
                                "' not supported (expected '<f4' float32)");
  if (scores.shape.size() != 2)
    throw std::invalid_argument(scores_path + ": scores must have shape [heads, tokens], got " +
                                std::to_string(scores.shape.size()) + " dimensions");
  const std::int64_t heads = scores.shape[0], tokens = scores.shape[1];
  if (keep > tokens)
    throw std::invalid_argument("select: --keep " + std::to_string(keep) + " exceeds the " + std::to_string(tokens) +
                                " tokens of " + scores_path + " (k > N)");
  const std::int64_t s0 = std::min(sinks, tokens);
  const std::int64_t protect = s0 + (tokens - std::max(s0, tokens - std::min(recent, tokens)));
  if (protect > keep)
    throw std::invalid_argument("select: --sinks " + std::to_string(sinks) + " and --recent " +
                                std::to_string(recent) + " protect " + std::to_string(protect) +
                                " tokens per head (overlap counted once), more than --keep " + std::to_string(keep));

  Selection sel;
  try {
    sel = select(ConstScoresView(scores.as<float>(), heads, tokens, std::max<std::int64_t>(tokens, 1)),
                 Budget::per_head(keep), opt);
  } catch (const std::invalid_argument& e) {
    std::string m = e.what();
    const std::string prefix = "kvscore::select: ";
    if (m.compare(0, prefix.size(), prefix) == 0) m = m.substr(prefix.size());
    throw std::invalid_argument("select: " + m);
  }

  if (opt.alloc == Alloc::per_head) {
    save_i64_npy_atomic({out_path}, {{heads, keep}}, {sel.positions.data()});
  } else {
    save_i64_npy_atomic({out_path, offsets_path(out_path)},
                        {{std::int64_t(sel.positions.size())}, {heads + 1}},
                        {sel.positions.data(), sel.offsets.data()});
  }
  return kExitOk;
}

KVSCORE_CLI_COMMAND(select, "select", "choose the tokens to keep from scores (.npy in, kept positions .npy out)", cmd_select, kSelectFlags, kSelectUsage);

}  // namespace kvscore::cli
