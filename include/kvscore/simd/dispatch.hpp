// kvscore/simd/dispatch.hpp — which kernel table the scorers use.
//
// Header-only use: the scalar table plus one built for the consumer's own compile
// flags (xsimd::default_arch). Linking kvscore::dispatch (defines
// KVSCORE_RUNTIME_DISPATCH) adds sse2/avx2/avx512 tables compiled in separate
// translation units and picks the best one the CPU supports at run time.
// The environment variable KVSCORE_ISA (scalar, sse2, avx2, avx512, ...) or
// set_active_isa() pins one; an unknown or unsupported name is an error.
#pragma once

#include <atomic>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvscore/core/cpu.hpp"
#include "kvscore/simd/kernels.hpp"
#include "kvscore/simd/table.hpp"

namespace kvscore::simd {

#ifdef KVSCORE_RUNTIME_DISPATCH
namespace detail {
/// Defined in src/dispatch.cpp: the compiled tables this CPU supports, narrowest first.
std::vector<const KernelTable*> compiled_tables();
}  // namespace detail
#else
namespace detail {
template <class Arch>
inline void push_default_arch(std::vector<const KernelTable*>& v) {
  v.push_back(&make_table<XsimdPolicy<Arch>>(Arch::name()));
}
template <>
inline void push_default_arch<xsimd::unavailable>(std::vector<const KernelTable*>&) {}
}  // namespace detail
#endif

/// Every kernel table usable on this CPU: scalar first, then increasing vector width.
inline std::vector<const KernelTable*> available_tables() {
  std::vector<const KernelTable*> v{&scalar_table()};
#ifdef KVSCORE_RUNTIME_DISPATCH
  for (const KernelTable* t : detail::compiled_tables()) v.push_back(t);
#else
  detail::push_default_arch<xsimd::default_arch>(v);
#endif
  return v;
}

/// The table named `name` among available_tables() ("scalar", "sse2", "avx2", "avx512", "neon"), or nullptr.
inline const KernelTable* find_table(std::string_view name) {
  for (const KernelTable* t : available_tables())
    if (name == t->name) return t;
  return nullptr;
}

namespace detail {
inline std::string table_names() {
  std::string s;
  for (const KernelTable* t : available_tables()) s += (s.empty() ? "" : ", ") + std::string(t->name);
  return s;
}
inline std::atomic<const KernelTable*>& active_slot() noexcept {
  static std::atomic<const KernelTable*> slot{nullptr};
  return slot;
}
inline const KernelTable& checked_table(std::string_view name, const char* who) {
  const KernelTable* t = find_table(name);
  if (t == nullptr)
    throw std::invalid_argument(std::string(who) + ": unknown or unsupported ISA '" + std::string(name) +
                                "' (available here: " + table_names() + ")");
  return *t;
}
}  // namespace detail

/// The table scorers use when their `isa` member is null.
inline const KernelTable& active_table() {
  const KernelTable* t = detail::active_slot().load(std::memory_order_acquire);
  if (t != nullptr) return *t;
  const std::string_view env = kvscore::detail::isa_env();
  t = !env.empty() ? &detail::checked_table(env, "KVSCORE_ISA") : available_tables().back();
  detail::active_slot().store(t, std::memory_order_release);
  return *t;
}

/// Pin the table by name; throws std::invalid_argument naming the available ones.
inline void set_active_isa(std::string_view name) {
  const KernelTable& t = detail::checked_table(name, "kvscore::simd::set_active_isa");
  detail::active_slot().store(&t, std::memory_order_release);
  kvscore::detail::isa_cap_slot().store(t.level, std::memory_order_relaxed);
}

/// The highest instruction-set level the kernel families outside the row tables (ParisKV's
/// search, the selector passes) may use: the active table's when KVSCORE_ISA / set_active_isa()
/// pinned it, otherwise unlimited (each family then takes the best its CPU check allows, also
/// in header-only builds whose own table is only as wide as their compile flags).
inline IsaLevel isa_cap() {
  (void)active_table();  // an unknown KVSCORE_ISA is an error here, as for the row tables
  return kvscore::detail::isa_cap_slot().load(std::memory_order_relaxed);
}

}  // namespace kvscore::simd
