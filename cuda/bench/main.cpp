// cuda/bench/main.cpp — kvscore_cuda_bench's entry point (exits 0, saying so, without a device).
#include "bench_util.hpp"

int main(int argc, char** argv) {
  if (kc::device_count() == 0) {
    std::printf("kvscore_cuda_bench: no CUDA device -- skipping every GPU benchmark\n");
    return 0;
  }
  std::printf("kvscore_cuda_bench: %s\n", kc::device_description().c_str());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
