// kvscore/io/safetensors_impl.hpp — the .safetensors reader (nlohmann-json): inline in
// header-only use, compiled once into kvscore::dispatch otherwise (kvscore/detail/compiled.hpp).
#pragma once

#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "kvscore/core/dtype.hpp"
#include "kvscore/io/safetensors.hpp"

namespace kvscore::safetensors {

KVSCORE_IMPL_INLINE Tensor parse(const std::uint8_t* data, std::size_t size, const std::string& name,
                                 const std::string& what) {
  auto fail = [&](const std::string& m) -> void { throw std::invalid_argument(what + ": " + m); };
  if (size < 8) fail("file of " + std::to_string(size) + " bytes is too short for a safetensors header");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];  // little-endian u64
  if (n > size - 8)
    fail("header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) + " bytes)");
  const nlohmann::json header = nlohmann::json::parse(data + 8, data + 8 + n, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) fail("header is not a JSON object");
  const auto it = header.find(name);
  if (it == header.end()) {
    std::string names;  // the first few, as JSON strings (one line, control characters escaped)
    int listed = 0;
    for (auto e = header.begin(); e != header.end(); ++e) {
      if (e.key() == "__metadata__") continue;
      if (++listed > 8) {
        names += ", ...";
        break;
      }
      names += (names.empty() ? "" : ", ") +
               nlohmann::json(e.key()).dump(-1, ' ', true, nlohmann::json::error_handler_t::replace);
    }
    fail("no tensor '" + name + "' (tensors: " + (names.empty() ? "none" : names) + ")");
  }
  const nlohmann::json& t = *it;
  const std::string tw = "tensor '" + name + "'";
  if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets"))
    fail(tw + " lacks dtype, shape or data_offsets");
  Tensor out;
  if (!t["dtype"].is_string()) fail(tw + ": dtype is not a string");
  out.dtype = t["dtype"].get<std::string>();
  std::size_t item = 0;
  if (out.dtype == "F32") item = 4;
  else if (out.dtype == "F16" || out.dtype == "BF16") item = 2;
  else fail(tw + " has dtype '" + out.dtype + "' (supported: F32, F16, BF16)");
  const nlohmann::json& shape = t["shape"];
  if (!shape.is_array()) fail(tw + ": shape is not an array");
  std::uint64_t count = 1;
  for (const auto& e : shape) {
    if (!e.is_number_unsigned()) fail(tw + ": shape " + shape.dump() + " holds a value that is not a count");
    const std::uint64_t v = e.get<std::uint64_t>();
    if (v > std::uint64_t(std::numeric_limits<std::int64_t>::max()) || (v != 0 && count > (std::uint64_t(1) << 62) / v))
      fail(tw + ": shape " + shape.dump() + " is too large");
    count *= v;
    out.shape.push_back(std::int64_t(v));
  }
  const nlohmann::json& off = t["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    fail(tw + ": data_offsets must be two byte offsets [begin, end]");
  const std::uint64_t b = off[0].get<std::uint64_t>(), e = off[1].get<std::uint64_t>(), body = size - 8 - n;
  if (b > e || e > body)
    fail(tw + ": data_offsets [" + std::to_string(b) + ", " + std::to_string(e) + "] are not within the " +
         std::to_string(body) + " data bytes");
  if (e - b != count * item)
    fail(tw + ": data_offsets span " + std::to_string(e - b) + " bytes, but shape " + shape.dump() + " of " +
         out.dtype + " needs " + std::to_string(count * item));
  const std::uint8_t* p = data + 8 + n + b;
  out.values.resize(std::size_t(count));
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint8_t* x = p + i * item;
    if (item == 4) {
      const std::uint32_t bits = std::uint32_t(x[0]) | std::uint32_t(x[1]) << 8 | std::uint32_t(x[2]) << 16 |
                                 std::uint32_t(x[3]) << 24;
      std::memcpy(&out.values[std::size_t(i)], &bits, 4);
    } else {
      const std::uint16_t bits = std::uint16_t(x[0] | x[1] << 8);
      out.values[std::size_t(i)] = out.dtype == "F16" ? to_float(half{bits}) : to_float(bfloat16{bits});
    }
  }
  return out;
}

KVSCORE_IMPL_INLINE Tensor load(const std::string& path, const std::string& name) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::invalid_argument(path + ": cannot open");
  const std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return parse(bytes.data(), bytes.size(), name, path);
}

}  // namespace kvscore::safetensors
