#include <cstdio>
#include <vector>

#include <kvscore/kvscore.hpp>

int main() {
  std::vector<float> k = {3, 4, 0, 0, 0, 0, 6, 8};  // 1 head, 4 tokens, head_dim 2
  const auto s = kvscore::KNorm{}.score(kvscore::KeysView<float>(k.data(), 1, 4, 2, 8, 2));
  std::printf("kvscore %s consumer: knorm = %g %g %g %g (ISA %s)\n", kvscore::version_string, s(0, 0), s(0, 1),
              s(0, 2), s(0, 3), kvscore::simd::active_table().name);
  return (s(0, 0) == -5.f && s(0, 1) == 0.f && s(0, 3) == -10.f) ? 0 : 1;
}
