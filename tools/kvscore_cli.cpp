// tools/kvscore_cli.cpp — `kvscore`, the command-line front end of the library.
//
//   kvscore score --method M --keys K.npy --out S.npy [...]
//   kvscore version
//
// Exit codes: 0 success (and --help), 2 any error: exactly one line on stderr,
// starting with "kvscore: ". See docs/reference/cli.md.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "cli.hpp"

namespace {

using namespace kvscore::cli;

/// The registered subcommands, sorted by name.
const std::vector<Command>& commands() {
  static const std::vector<Command> sorted = [] {
    std::vector<Command> v = command_registry();
    std::sort(v.begin(), v.end(), [](const Command& a, const Command& b) { return std::strcmp(a.name, b.name) < 0; });
    return v;
  }();
  return sorted;
}

void print_usage(std::FILE* to) {
  std::fprintf(to,
               "usage: kvscore COMMAND [options]\n"
               "       kvscore COMMAND --help\n"
               "\n"
               "KV-cache token scorers for LLM inference engines.\n"
               "\n"
               "commands:\n");
  for (const Command& c : commands()) std::fprintf(to, "  %-16s %s\n", c.name, c.summary);
  std::fprintf(to,
               "\n"
               "exit codes: 0 success, 2 bad input or failure (one 'kvscore: ...' line on stderr)\n");
}

/// One line: control characters (from file names, file contents) are escaped.
std::string one_line(const std::string& s) {
  std::string out;
  for (char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += c == '\n' ? std::string("\\n") : std::string("\\x") + hex[u >> 4] + hex[u & 15];
    } else {
      out += c;
    }
  }
  return out;
}

int fail(const std::string& message) {
  std::fflush(stdout);
  std::fprintf(stderr, "kvscore: %s\n", one_line(message).c_str());
  std::fflush(stderr);
  return kExitBadInput;
}

int run(int argc, char** argv) {
  if (argc < 2) return fail("missing command (try 'kvscore --help')");
  std::string cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    print_usage(stdout);
    return kExitOk;
  }
  if (cmd == "--version") cmd = "version";
  for (const Command& c : commands()) {
    if (cmd != c.name) continue;
    const Args args(std::vector<std::string>(argv + 2, argv + argc), *c.flags, c.name);
    if (args.help()) {
      std::fputs(*c.usage, stdout);
      return kExitOk;
    }
    return c.run(args);
  }
  return fail("unknown command '" + cmd + "' (try 'kvscore --help')");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {
    return fail("out of memory");
  } catch (const std::exception& e) {
    return fail(e.what());
  } catch (...) {
    return fail("unknown error");
  }
}
