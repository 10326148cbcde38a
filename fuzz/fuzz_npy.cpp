// fuzz_npy — the .npy reader of the CLI (kvscore::npy::parse) on arbitrary bytes.
// Invariants: only npy::error escapes; an accepted array has exactly size()*itemsize bytes,
// a canonical descr, and re-parses identically from the header save() would write.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_common.hpp"
#include "kvscore/io/npy.hpp"

namespace {
std::size_t itemsize(const std::string& descr) {
  return kvscore::npy::detail::describe(descr).itemsize;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace npy = kvscore::npy;
  npy::Array a;
  try {
    a = npy::parse(data, size, "fuzz");
  } catch (const npy::error& e) {
    FZ_CHECK(std::string(e.what()).rfind("fuzz: ", 0) == 0, std::string("message not prefixed: ") + e.what());
    FZ_CHECK(std::string(e.what()).find('\n') == std::string::npos, "multi-line message");
    return 0;
  }
  for (std::int64_t d : a.shape) FZ_CHECK(d >= 0, "negative dimension accepted");
  const std::size_t isz = itemsize(a.descr);
  FZ_CHECK(isz >= 1 && isz <= 8, "itemsize " + std::to_string(isz));
  FZ_CHECK(std::uint64_t(a.size()) * isz == a.bytes.size(), "bytes do not match shape x itemsize");
  // Canonical descr round trip: the header save() writes parses to the same array.
  std::string img = npy::make_header(a.descr, a.shape);
  FZ_CHECK(img.size() % 64 == 0, "header not padded to 64");
  img.append(reinterpret_cast<const char*>(a.bytes.data()), a.bytes.size());
  const npy::Array b = npy::parse(img.data(), img.size(), "roundtrip");
  FZ_CHECK(b.descr == a.descr && b.shape == a.shape && b.bytes == a.bytes, "round trip differs");
  // as<T>() on a matching descr must succeed; on float it must agree with the bytes.
  if (a.descr == "<f4") FZ_CHECK(a.to_vector<float>().size() == std::size_t(a.size()), "to_vector<float> size");
  return 0;
}
