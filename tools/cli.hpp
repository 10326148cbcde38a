// tools/cli.hpp — shared pieces of the `kvscore` command-line tool: the subcommand
// interface, a small flag parser, strict number parsing.
//
// Adding a subcommand: write tools/cmd_<name>.cpp (every tools/*.cpp is built into the
// tool) with its run function, flag list and usage text, and register it at namespace
// scope with
//   KVSCORE_CLI_COMMAND(name, "name", "one-line summary", run_fn, kFlags, kUsage);
// `kvscore --help` lists the registered commands sorted by name. Subcommands report bad input by throwing (UsageError,
// std::invalid_argument, npy::error, ...); main() turns every exception into one
// `kvscore: ...` line on stderr and exit code 2.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/core/names.hpp"
#include "kvscore/core/scorer_options.hpp"

namespace kvscore::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitBadInput = 2;
/// The most threads a --threads flag accepts.
inline constexpr std::int64_t kMaxThreads = 4096;

/// Bad command line (unknown flag, missing value, unparsable number, ...).
class UsageError : public std::runtime_error {
 public:
  using runtime_error::runtime_error;
};

/// One flag a subcommand accepts.
struct FlagSpec {
  const char* name;   ///< with the dashes: "--keys"
  bool takes_value;   ///< false for switches
};

/// The parsed arguments of one subcommand (everything after the subcommand name).
class Args {
 public:
  /// Parses `--flag value` / `--flag=value` / `--switch`; `-h`/`--help` sets help().
  /// Throws UsageError for an unknown or repeated flag, a missing value or a positional argument.
  Args(const std::vector<std::string>& argv, const std::vector<FlagSpec>& spec, const std::string& command);

  bool help() const noexcept { return help_; }
  bool has(const std::string& flag) const { return values_.count(flag) != 0; }
  /// The value of a flag that must be present (UsageError "missing required flag --x").
  const std::string& required(const std::string& flag) const;
  /// The value or `fallback` when absent.
  std::string get(const std::string& flag, const std::string& fallback) const;
  /// Integer value (whole string, base 10, in [min, max]) or `fallback` when absent.
  std::int64_t get_int(const std::string& flag, std::int64_t fallback, std::int64_t min, std::int64_t max) const;

 private:
  std::string command_;
  std::map<std::string, std::string> values_;
  bool help_ = false;
};

/// Strict base-10 integer: no spaces, no trailing characters, no overflow (UsageError naming `what`).
std::int64_t parse_int(const std::string& text, const std::string& what);

/// Strict decimal number: the whole string, finite (UsageError "what: 'text' is not a number").
double parse_double(const std::string& text, const std::string& what);

/// A default for --help: %g (0.2, not 0.20000000000000001).
std::string help_num(double v);

/// --isa NAME: pins the SIMD kernel table (simd::set_active_isa); UsageError naming the value.
void set_isa(const Args& args, const std::string& command);

/// An enum-valued flag: one of `values` in the CLI's spelling (the library's to_string with '-'
/// for '_', kvscore/core/names.hpp), `fallback` when absent; otherwise UsageError
/// "<prefix>'<value>' (expected a or b)".
template <class E, std::size_t N>
E get_enum(const Args& args, const std::string& flag, E fallback, const E (&values)[N], const std::string& prefix) {
  if (!args.has(flag)) return fallback;
  const std::string v = args.required(flag);
  for (const E e : values)
    if (v == kvscore::detail::cli_spelling(to_string(e))) return e;
  throw UsageError(prefix + "'" + v + "' (expected " + kvscore::detail::spellings(values, true) + ")");
}

/// --query-placement in-cache|after-cache (snapkv, protokv, ojakv), `fallback` when absent;
/// UsageError naming the value otherwise.
inline QueryPlacement get_query_placement(const Args& args, const std::string& command, QueryPlacement fallback) {
  return get_enum(args, "--query-placement", fallback, kQueryPlacements, command + ": --query-placement: ");
}

/// Writes to `path` through a temporary file in the same directory and a rename, so a
/// failed run never leaves a partial output behind.
void save_f32_npy_atomic(const std::string& path, const std::vector<std::int64_t>& shape, const float* data);

// ---- subcommands

/// One subcommand of the tool.
struct Command {
  const char* name;                      ///< as typed: "score"
  const char* summary;                   ///< one line for `kvscore --help`
  int (*run)(const Args&);               ///< returns the exit code; throws on bad input
  const std::vector<FlagSpec>* flags;    ///< the flags it accepts
  const char* const* usage;              ///< its --help text
};

/// Every registered subcommand (filled before main() by KVSCORE_CLI_COMMAND).
inline std::vector<Command>& command_registry() {
  static std::vector<Command> commands;
  return commands;
}

struct RegisterCommand {
  explicit RegisterCommand(const Command& c) { command_registry().push_back(c); }
};

#define KVSCORE_CLI_COMMAND(ident, name, summary, run, flags, usage) \
  const ::kvscore::cli::RegisterCommand kvscore_cli_command_##ident{     \
      ::kvscore::cli::Command{name, summary, run, &(flags), &(usage)}}

}  // namespace kvscore::cli
