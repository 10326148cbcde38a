// tests/test_support.hpp — small helpers several test files share.
#pragma once

#include <exception>
#include <functional>
#include <stdexcept>
#include <string>

namespace test_support {

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
