// kvscore/io/safetensors.hpp — reads one tensor of a .safetensors file (the format the Q-Filters
// authors publish their filters in, and Hugging Face its weights): 8 bytes little-endian header
// length N, N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...},
// then the data, offsets relative to its start. F32, F16 and BF16 tensors are widened to fp32.
// The JSON goes through nlohmann-json (Debian's nlohmann-json3-dev), never a hand-written
// parser. Every malformed file is a std::invalid_argument naming the file and what is wrong
// (header length past the end, not JSON, missing tensor, dtype, shape, offsets).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvscore/detail/compiled.hpp"

namespace kvscore::safetensors {

/// One tensor widened to fp32, C order.
struct Tensor {
  std::string dtype;                ///< as stored: "F32", "F16" or "BF16"
  std::vector<std::int64_t> shape;  ///< the tensor's shape
  std::vector<float> values;        ///< product(shape) values
};

/// Tensor `name` of the file at `path` (F32, F16 or BF16).
Tensor load(const std::string& path, const std::string& name);

/// Parses a whole file held in memory (`what` names it in errors).
Tensor parse(const std::uint8_t* data, std::size_t size, const std::string& name, const std::string& what);

}  // namespace kvscore::safetensors

#if !defined(KVSCORE_COMPILED)
#include "kvscore/io/safetensors_impl.hpp"
#endif
