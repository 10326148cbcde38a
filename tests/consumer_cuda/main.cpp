// Links the installed kvscore::cuda and runs what needs no GPU: the device query, and an argument
// error thrown before any CUDA call. With a device it also scores 4 keys on it.
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include <kvscore/cuda/pariskv.hpp>
#include <kvscore/cuda/scorers.hpp>

int main() {
  namespace kc = kvscore::cuda;
  const int devices = kc::device_count();
  std::printf("kvscore::cuda consumer: %d CUDA device(s)\n", devices);
  try {
    kvscore::ParisKVConfig cfg;
    cfg.m = 16;
    kc::ParisKV index(1, 128, cfg);
    return 1;
  } catch (const std::invalid_argument& e) {
    if (std::string(e.what()).find("m 16 is not supported on the GPU path") == std::string::npos) return 1;
  }
  if (devices == 0) return 0;
  const std::vector<float> k = {3, 4, 0, 0, 0, 0, 6, 8};  // 1 head, 4 tokens, head_dim 2
  kc::DeviceBuffer dk(k.size() * sizeof(float)), ds(4 * sizeof(float));
  kc::copy_to_device(dk.get(), k.data(), k.size() * sizeof(float));
  kc::score(kvscore::KNorm{}, kc::DeviceKeysView<float>(dk.as<float>(), 1, 4, 2, 8, 2), kc::DeviceScoresView(ds.as<float>(), 1, 4));
  std::vector<float> s(4);
  kc::copy_to_host(s.data(), ds.get(), 4 * sizeof(float));
  std::printf("knorm on %s: %g %g %g %g\n", kc::device_description().c_str(), s[0], s[1], s[2], s[3]);
  return (s[0] == -5.f && s[1] == 0.f && s[3] == -10.f) ? 0 : 1;
}
