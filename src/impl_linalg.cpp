// OjaKV's and Q-Filters' Eigen numerics (SVD, QR, GEMMs) and the safetensors reader, compiled once
// (kvscore/detail/compiled.hpp): users of kvscore::dispatch see only their declarations.
#include "kvscore/ojakv/cache_impl.hpp"
#include "kvscore/ojakv/ojakv_impl.hpp"
#include "kvscore/scorers/qfilter_impl.hpp"
#include "kvscore/io/safetensors_impl.hpp"
