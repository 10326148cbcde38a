// tools/cmd_version.cpp — `kvscore version`: library version and SIMD kernel tables.
#include <cstdio>
#include <string>
#include <vector>

#include <kvscore/kvscore.hpp>

#include "cli.hpp"

namespace kvscore::cli {

const char* const kVersionUsage =
    "usage: kvscore version\n"
    "\n"
    "Prints the kvscore version, the active SIMD kernel table (the one 'score' uses;\n"
    "pinned by the environment variable KVSCORE_ISA) and every table usable on this CPU:\n"
    "\n"
    "  kvscore " KVSCORE_VERSION_STRING "\n"
    "  isa: avx2\n"
    "  available: scalar, sse2, avx2\n";

const std::vector<FlagSpec> kVersionFlags = {};

int cmd_version(const Args&) {
  const simd::KernelTable& active = simd::active_table();  // throws for a bad KVSCORE_ISA
  std::string avail;
  for (const simd::KernelTable* t : simd::available_tables()) avail += (avail.empty() ? "" : ", ") + std::string(t->name);
  std::printf("kvscore %s\nisa: %s\navailable: %s\n", version_string, active.name, avail.c_str());
  return std::fflush(stdout) == 0 ? kExitOk : kExitBadInput;
}

KVSCORE_CLI_COMMAND(version, "version", "print the version and the SIMD kernel table in use", cmd_version, kVersionFlags, kVersionUsage);

}  // namespace kvscore::cli
