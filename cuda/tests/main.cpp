// cuda/tests/main.cpp — kvscore_cuda_tests' entry point: with no CUDA device every [gpu] test
// is skipped, visibly, and only the host-side tests run.
#define CATCH_CONFIG_RUNNER
#include "cuda_harness.hpp"

#include <cstdio>

int main(int argc, char** argv) {
  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  const int devices = kc::device_count();
  if (devices == 0) {
    std::printf("kvscore_cuda_tests: no CUDA device -- SKIPPING every [gpu] test (they compare the kernels with the "
                "CPU path and need a GPU); running the host-side [host] tests only\n");
    session.configData().testsOrTags.push_back("~[gpu]");
  } else {
    std::printf("kvscore_cuda_tests: running on %s\n", kc::device_description().c_str());
  }
  return session.run();
}
