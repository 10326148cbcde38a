// tests/test_support.hpp — small helpers several test files share.
#pragma once

#include <exception>
#include <functional>
#include <stdexcept>
#include <string>

#include <kvscore/synth.hpp>

namespace test_support {

/// One KV head of `kvscore synth --kind drift` keys/values (one query head, one query): the
/// long-generation data of the decode-time tests.
inline kvscore::synth::Data drift_head(std::int64_t tokens, std::int64_t head_dim, std::uint64_t seed) {
  kvscore::synth::Spec spec;
  spec.kind = kvscore::synth::Kind::drift;
  spec.kv_heads = 1;
  spec.group = 1;
  spec.queries = 1;
  spec.head_dim = head_dim;
  spec.tokens = tokens;
  spec.seed = seed;
  return kvscore::synth::generate(spec);
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
