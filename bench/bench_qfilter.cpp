// Q-Filters (QFilter): score/qfilter/<fp32|fp16|bf16>/d<64|128>/N<4096|65536|2^20>, one head, one
// thread (kvbench::register_score in bench_common.hpp), with a fixed filter. Doc: docs/methods/qfilters.md.
#include <vector>

#include "bench_common.hpp"

namespace {

kvscore::QFilter make_qfilter(std::int64_t d) {
  std::vector<float> f(static_cast<std::size_t>(d));
  for (std::int64_t j = 0; j < d; ++j) f[std::size_t(j)] = (j % 3 == 0 ? 1.f : -0.5f) / float(d);
  return kvscore::QFilter(f, 1, d);
}

const int registered = kvbench::register_score(make_qfilter);

}  // namespace
