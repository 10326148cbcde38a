// kvscore/core/splitmix.hpp — the one splitmix64 generator behind every seeded stream in the
// library (ParisKV rotation signs, OjaKV random bases, ProtoKV RFF parameters, synthetic data).
#pragma once

#include <cstdint>

namespace kvscore::detail {

/// splitmix64 (Steele, Lea, Flood 2014; Vigna's splitmix64.c): a 64-bit state advanced by a
/// constant, output through a mixing function. A fixed integer recurrence, so a seed gives the
/// same stream on every platform (std::*_distribution is implementation-defined). Modules add
/// their own conversions on top of next(); the golden tests pin each stream.
struct SplitMix64 {
  std::uint64_t state = 0;

  constexpr SplitMix64() noexcept = default;
  explicit constexpr SplitMix64(std::uint64_t seed) noexcept : state(seed) {}

  static constexpr std::uint64_t mix(std::uint64_t z) noexcept {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  constexpr std::uint64_t next() noexcept { return mix(state += 0x9E3779B97F4A7C15ull); }
  /// Uniform in (0, 1]: ((x >> 11) + 1) · 2^-53, never 0 (so log() stays finite).
  constexpr double uniform_nonzero() noexcept { return double((next() >> 11) + 1) * 0x1.0p-53; }
  /// Uniform in [0, 1): (x >> 11) · 2^-53.
  constexpr double uniform_from_zero() noexcept { return double(next() >> 11) * 0x1.0p-53; }
};

}  // namespace kvscore::detail
