// tests/test_support.hpp — small helpers several test files share.
#pragma once

#include <exception>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <string>

#include <kvscore/synth.hpp>

namespace test_support {

/// One KV head of `kvscore synth --kind drift` keys/values (one query head, one query): the
/// long-generation data of the decode-time tests.
inline kvscore::synth::Data drift_head(std::int64_t tokens, std::int64_t head_dim, std::uint64_t seed,
                                      std::int64_t kv_heads = 1) {
  kvscore::synth::Spec spec;
  spec.kind = kvscore::synth::Kind::drift;
  spec.kv_heads = kv_heads;
  spec.group = 1;
  spec.queries = 1;
  spec.head_dim = head_dim;
  spec.tokens = tokens;
  spec.seed = seed;
  return kvscore::synth::generate(spec);
}

/// RoPE as an engine applies it (post-RoPE caches): pairs (2i, 2i+1) of x rotated by
/// pos·10000^(−2i/d), in double, rounded to fp32 once.
inline void rope_rotate(float* x, std::int64_t d, std::int64_t pos) {
  for (std::int64_t i = 0; i < d / 2; ++i) {
    const double th = double(pos) * std::pow(10000.0, -2.0 * double(i) / double(d));
    const double a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = float(a * std::cos(th) - b * std::sin(th));
    x[2 * i + 1] = float(a * std::sin(th) + b * std::cos(th));
  }
}

/// The message of the exception of type E (default: the library's std::invalid_argument) that
/// `f` throws, "no throw" when it throws none; any other exception propagates.
template <class E = std::invalid_argument>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "no throw";
}

}  // namespace test_support
