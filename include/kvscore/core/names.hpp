// kvscore/core/names.hpp — option enums by name, both ways, by one rule. Every option enum of the
// library (Alloc, BudgetRounding, QueryPlacement, WindowTail, ProtoKV's Psi, eval's Protocol and MixMetric) has
// beside it the list of its values, `to_string(e)` (its C++ and Python spelling, "per_head") and
// `parse_<enum>(s)`; the CLI spells the same names with '-' for '_' ("per-head"). The front ends
// call these, so no front end keeps a list of spellings of its own.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

namespace kvscore::detail {

/// The CLI's spelling of a name: '-' for every '_' ("leak_free" -> "leak-free").
inline std::string cli_spelling(std::string_view name) {
  std::string s(name);
  for (char& c : s)
    if (c == '_') c = '-';
  return s;
}

/// "'a' or 'b'", "'a', 'b' or 'c'" (to_string's spellings); cli: "a or b" (the CLI's).
template <class E, std::size_t N>
std::string spellings(const E (&values)[N], bool cli = false) {
  std::string s;
  for (std::size_t i = 0; i < N; ++i) {
    s += i == 0 ? "" : i + 1 == N ? " or " : ", ";
    s += cli ? cli_spelling(to_string(values[i])) : "'" + std::string(to_string(values[i])) + "'";
  }
  return s;
}

/// The value of `values` whose to_string, or its CLI spelling, is `s`; anything else is
/// std::invalid_argument "kvscore: <what> '<s>' must be 'a' or 'b'".
template <class E, std::size_t N>
E parse_enum(std::string_view s, const E (&values)[N], const char* what) {
  for (const E v : values)
    if (s == to_string(v) || s == cli_spelling(to_string(v))) return v;
  throw std::invalid_argument("kvscore: " + std::string(what) + " '" + std::string(s) + "' must be " +
                              spellings(values));
}

}  // namespace kvscore::detail
