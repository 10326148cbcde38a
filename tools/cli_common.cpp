// tools/cli_common.cpp — flag parsing and helpers shared by the subcommands.
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <system_error>
#include <vector>

#include <unistd.h>

#include "cli.hpp"
#include "kvscore/io/npy.hpp"
#include "kvscore/simd/dispatch.hpp"

namespace kvscore::cli {

namespace {
std::string quoted(const std::string& s) { return "'" + s + "'"; }
}  // namespace

Args::Args(const std::vector<std::string>& argv, const std::vector<FlagSpec>& spec, const std::string& command)
    : command_(command) {
  for (std::size_t i = 0; i < argv.size(); ++i) {
    const std::string& arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      help_ = true;
      continue;
    }
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0)
      throw UsageError(command_ + ": unexpected argument " + quoted(arg) + " (try 'kvscore " + command_ +
                       " --help')");
    std::string name = arg, value;
    bool inline_value = false;
    if (const std::size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    const FlagSpec* f = nullptr;
    for (const FlagSpec& s : spec)
      if (name == s.name) f = &s;
    if (f == nullptr)
      throw UsageError(command_ + ": unknown flag " + quoted(name) + " (try 'kvscore " + command_ + " --help')");
    if (values_.count(name) != 0) throw UsageError(command_ + ": flag " + name + " given more than once");
    if (f->takes_value) {
      if (!inline_value) {
        if (i + 1 >= argv.size()) throw UsageError(command_ + ": flag " + name + " needs a value");
        value = argv[++i];
        if (value.size() >= 2 && value.compare(0, 2, "--") == 0)
          throw UsageError(command_ + ": flag " + name + " needs a value (got flag " + quoted(value) + ")");
      }
      if (value.empty()) throw UsageError(command_ + ": flag " + name + " has an empty value");
    } else if (inline_value) {
      throw UsageError(command_ + ": flag " + name + " takes no value");
    }
    values_[name] = value;
  }
}

const std::string& Args::required(const std::string& flag) const {
  const auto it = values_.find(flag);
  if (it == values_.end())
    throw UsageError(command_ + ": missing required flag " + flag + " (try 'kvscore " + command_ + " --help')");
  return it->second;
}

std::string Args::get(const std::string& flag, const std::string& fallback) const {
  const auto it = values_.find(flag);
  return it == values_.end() ? fallback : it->second;
}

std::int64_t Args::get_int(const std::string& flag, std::int64_t fallback, std::int64_t min, std::int64_t max) const {
  const auto it = values_.find(flag);
  if (it == values_.end()) return fallback;
  const std::int64_t v = parse_int(it->second, command_ + ": " + flag);
  if (v < min || v > max) {
    const std::string range = max != INT64_MAX ? "in [" + std::to_string(min) + ", " + std::to_string(max) + "]"
                              : min == 1       ? std::string("> 0")
                                               : ">= " + std::to_string(min);
    throw UsageError(command_ + ": " + flag + " must be " + range + " (got " + std::to_string(v) + ")");
  }
  return v;
}

std::int64_t parse_int(const std::string& text, const std::string& what) {
  std::int64_t v = 0;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  if (first != last && *first == '+') ++first;  // from_chars rejects a leading '+'
  const auto [ptr, ec] = std::from_chars(first, last, v, 10);
  if (ec == std::errc::result_out_of_range)
    throw UsageError(what + ": " + quoted(text) + " is out of range");
  if (ec != std::errc() || ptr != last || first == last)
    throw UsageError(what + ": " + quoted(text) + " is not an integer");
  return v;
}

double parse_double(const std::string& text, const std::string& what) {
  double v = 0;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  if (first != last && *first == '+') ++first;
  const auto [ptr, ec] = std::from_chars(first, last, v, std::chars_format::general);
  if (ec != std::errc() || ptr != last || first == last || !std::isfinite(v))
    throw UsageError(what + ": " + quoted(text) + " is not a number");
  return v;
}

std::string help_num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

void set_isa(const Args& args, const std::string& command) {
  if (!args.has("--isa")) return;
  try {
    simd::set_active_isa(args.required("--isa"));
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    const std::size_t colon = m.find(": ");
    throw UsageError(command + ": --isa: " + (colon == std::string::npos ? m : m.substr(colon + 2)));
  }
}

void save_f32_npy_atomic(const std::string& path, const std::vector<std::int64_t>& shape, const float* data) {
  const std::string tmp = path + ".tmp-" + std::to_string(static_cast<long long>(::getpid()));
  try {
    npy::save<float>(tmp, shape, data);
  } catch (const npy::error& e) {
    std::remove(tmp.c_str());
    std::string why = e.what();
    if (why.compare(0, tmp.size() + 2, tmp + ": ") == 0) why = why.substr(tmp.size() + 2);
    throw npy::error(path + ": cannot write output: " + why);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw npy::error(path + ": cannot write output (rename from " + tmp + " failed)");
  }
}

}  // namespace kvscore::cli
