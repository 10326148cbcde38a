// fuzz_safetensors — the .safetensors reader (kvscore::safetensors::parse, behind
// QFilter::from_published) on arbitrary bytes, asking for tensor "q_filters".
// Invariants: only std::invalid_argument escapes, with a one-line message prefixed "fuzz: ";
// an accepted tensor has a supported dtype and exactly product(shape) values.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "fuzz_common.hpp"
#include "kvscore/io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  kvscore::safetensors::Tensor t;
  try {
    t = kvscore::safetensors::parse(data, size, "q_filters", "fuzz");
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    FZ_CHECK(m.rfind("fuzz: ", 0) == 0, "message not prefixed: " + m);
    FZ_CHECK(m.find('\n') == std::string::npos, "multi-line message");
    return 0;
  }
  FZ_CHECK(t.dtype == "F32" || t.dtype == "F16" || t.dtype == "BF16", "dtype " + t.dtype);
  std::uint64_t n = 1;
  for (std::int64_t d : t.shape) {
    FZ_CHECK(d >= 0, "negative dimension accepted");
    n *= std::uint64_t(d);
  }
  FZ_CHECK(n == t.values.size(), "values do not match the shape");
  return 0;
}
