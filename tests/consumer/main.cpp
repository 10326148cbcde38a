#include <cmath>
#include <cstdio>
#include <vector>

#include <kvscore/kvscore.hpp>

int main() {
  std::vector<float> k = {3, 4, 0, 0, 0, 0, 6, 8};  // 1 head, 4 tokens, head_dim 2
  const auto s = kvscore::KNorm{}.score(kvscore::KeysView<float>(k.data(), 1, 4, 2, 8, 2));
  // calibrate_qfilters is compiled into kvscore::dispatch (src/impl_linalg.cpp): this links
  // only if the installed library carries it. Samples along +x: the filter is (1, 0).
  const std::vector<float> q = {1, 0, 2, 0, 3, 0};  // 1 query head, 3 samples, head_dim 2
  const std::vector<float> f = kvscore::calibrate_qfilters(q.data(), 1, 3, 2, 1);
  std::printf("kvscore %s consumer: knorm = %g %g %g %g, filter = (%g, %g) (ISA %s)\n", kvscore::version_string,
              s(0, 0), s(0, 1), s(0, 2), s(0, 3), f[0], f[1], kvscore::simd::active_table().name);
  const bool filter_ok = std::abs(f[0] - 1.f) < 1e-6f && std::abs(f[1]) < 1e-6f;
  return (s(0, 0) == -5.f && s(0, 1) == 0.f && s(0, 3) == -10.f && filter_ok) ? 0 : 1;
}
