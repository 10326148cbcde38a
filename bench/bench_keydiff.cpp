// KeyDiff: score/keydiff/<fp32|fp16|bf16>/d<64|128>/N<4096|65536|2^20>, one head, one thread
// (kvbench::register_score in bench_common.hpp). Doc: docs/methods/keydiff.md.
#include "bench_common.hpp"

namespace {

const int registered = kvbench::register_score([](std::int64_t) { return kvscore::KeyDiff{}; });

}  // namespace
