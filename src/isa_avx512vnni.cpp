// Kernel table for avx512vnni: the avx512 table's code compiled with -mavx512vnni too, where the
// int4 block score's dot products use vpdpwssd (one instruction for vpmaddwd + vpaddd: the same
// int32 sums, so the same bits as every other table). A distinct policy type (XsimdPolicy's Ext)
// keeps its instantiations apart from isa_avx512.cpp's.
#include "kvscore/simd/kernels.hpp"

namespace kvscore::simd::detail {
struct Avx512Vnni {};
const KernelTable& table_avx512vnni() noexcept {
  return make_table<XsimdPolicy<xsimd::avx512bw, Avx512Vnni>>("avx512vnni");
}
}  // namespace kvscore::simd::detail
