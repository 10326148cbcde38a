// tools/cmd_pariskv_codebook.cpp — `kvscore pariskv-codebook`: the Lloyd–Max 3-bit magnitude
// quantiser ParisKV uses for subspaces of m dimensions.
#include <cstdio>
#include <string>
#include <vector>

#include <kvscore/pariskv/pariskv.hpp>

#include "cli.hpp"

namespace kvscore::cli {

const std::string kPariskvCodebookUsageText =
    "usage: kvscore pariskv-codebook --m M [--iterations N]\n"
    "\n"
    "Prints the 7 thresholds (first line) and the 8 centres (second line) of the Lloyd-Max\n"
    "quantiser of |u_j| for u uniform on the unit sphere of R^M (the Beta(1/2, (M-1)/2) prior of\n"
    "ParisKV's 4-bit codes), space separated, 6 decimals.\n"
    "\n"
    "  --m M            subspace dimension, 2 <= M <= 64 (ParisKV's default is " +
    std::to_string(ParisKVConfig{}.m) + ")\n"
    "  --iterations N   Lloyd steps from the quantile start (default 0 = to convergence, the\n"
    "                   index's default; 100 reproduces the public code's table)\n"
    "  -h, --help       this help\n";
const char* const kPariskvCodebookUsage = kPariskvCodebookUsageText.c_str();

const std::vector<FlagSpec> kPariskvCodebookFlags = {{"--m", true}, {"--iterations", true}};

int cmd_pariskv_codebook(const Args& args) {
  args.required("--m");
  const std::int64_t m = args.get_int("--m", ParisKVConfig{}.m, 2, 64);
  const std::int64_t it = args.get_int("--iterations", 0, 0, 100000000);
  const pariskv::Codebook cb = pariskv::lloyd_max(int(m), int(it));
  std::string a, b;
  char buf[32];
  for (double t : cb.thresholds) {
    std::snprintf(buf, sizeof(buf), "%.6f", t);
    a += (a.empty() ? "" : " ") + std::string(buf);
  }
  for (double c : cb.centres) {
    std::snprintf(buf, sizeof(buf), "%.6f", c);
    b += (b.empty() ? "" : " ") + std::string(buf);
  }
  std::printf("%s\n%s\n", a.c_str(), b.c_str());
  return std::fflush(stdout) == 0 ? kExitOk : kExitBadInput;
}

KVSCORE_CLI_COMMAND(pariskv_codebook, "pariskv-codebook", "print ParisKV's Lloyd-Max thresholds and centres for --m",
                    cmd_pariskv_codebook, kPariskvCodebookFlags, kPariskvCodebookUsage);

}  // namespace kvscore::cli
