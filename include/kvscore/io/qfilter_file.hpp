// kvscore/io/qfilter_file.hpp — Q-Filters' filter files: reads a layer's filters from the
// authors' published .safetensors or from a kvscore .npy (QFilter::load, from_published,
// from_npy, from_safetensors, declared in kvscore/scorers/qfilter.hpp) and writes .npy
// (save_qfilters_npy). The front ends (CLI, Python, tests) include this; the scorer does not,
// so it depends on no file format. Sign conventions: the top of kvscore/scorers/qfilter.hpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvscore/io/npy.hpp"
#include "kvscore/io/safetensors.hpp"
#include "kvscore/scorers/qfilter.hpp"

namespace kvscore {

inline QFilter QFilter::load(const std::string& path, std::int64_t layer, FilterConvention convention) {
  QFilter f = is_safetensors(path) ? from_safetensors(path, layer) : from_npy(path, layer);
  if (convention == FilterConvention::published)
    for (float& x : f.filters_) x = -x;
  return f;
}

inline QFilter QFilter::from_published(const std::string& path, std::int64_t layer) {
  return load(path, layer, FilterConvention::published);
}

inline QFilter QFilter::from_npy(const std::string& path, std::int64_t layer) {
  const npy::Array a = npy::load(path);
  if (a.shape.size() != 3)
    detail::throw_invalid("kvscore::QFilter::from_npy: " + path + " must have shape (layers, kv_heads, head_dim), got " +
                          std::to_string(a.shape.size()) + " dimensions");
  if (layer < 0 || layer >= a.shape[0])
    detail::throw_invalid("kvscore::QFilter::from_npy: layer " + std::to_string(layer) + " out of range [0, " +
                          std::to_string(a.shape[0]) + ") in " + path);
  if (a.descr != npy::descr_of<float>())
    detail::throw_invalid("kvscore::QFilter::from_npy: " + path + " has dtype '" + a.descr + "', expected '" +
                          npy::descr_of<float>() + "' (float32)");
  const float* p = a.as<float>() + layer * a.shape[1] * a.shape[2];
  return QFilter(std::vector<float>(p, p + a.shape[1] * a.shape[2]), a.shape[1], a.shape[2]);
}

inline QFilter QFilter::from_safetensors(const std::string& path, std::int64_t layer) {
  const safetensors::Tensor t = safetensors::load(path, "q_filters");
  const std::string who = "kvscore::QFilter::from_safetensors: ";
  if (t.shape.size() != 3)
    detail::throw_invalid(who + path + ": q_filters must have shape (layers, kv_heads, head_dim), got " +
                          std::to_string(t.shape.size()) + " dimensions");
  if (layer < 0 || layer >= t.shape[0])
    detail::throw_invalid(who + "layer " + std::to_string(layer) + " out of range [0, " + std::to_string(t.shape[0]) +
                          ") in " + path);
  const float* p = t.values.data() + layer * t.shape[1] * t.shape[2];
  return QFilter(std::vector<float>(p, p + t.shape[1] * t.shape[2]), t.shape[1], t.shape[2]);
}

/// Writes filters of all layers, [layers][kv_heads][head_dim], as float32 .npy.
inline void save_qfilters_npy(const std::string& path, const std::vector<float>& filters, std::int64_t layers,
                              std::int64_t kv_heads, std::int64_t head_dim) {
  if (layers <= 0 || kv_heads <= 0 || head_dim <= 0 || std::int64_t(filters.size()) != layers * kv_heads * head_dim)
    detail::throw_invalid("kvscore::save_qfilters_npy: " + std::to_string(filters.size()) +
                          " values do not make shape (" + std::to_string(layers) + ", " + std::to_string(kv_heads) +
                          ", " + std::to_string(head_dim) + ")");
  npy::save<float>(path, {layers, kv_heads, head_dim}, filters.data());
}

}  // namespace kvscore
