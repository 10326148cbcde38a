// fuzz_view — KeysView / ScoresView / Scores construction from arbitrary sizes and strides.
// Invariants: a view is accepted only if every row lies in [0, span) with span computed
// without overflow and rows are disjoint; accepted views small enough to back with memory
// are scored (KNorm) and every row read lies inside the buffer (ASan) and matches the
// reference squared norm. Rejections are std::invalid_argument with a message.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fuzz_common.hpp"
#include "kvscore/scorers/knorm.hpp"
#include "kvscore/core/view.hpp"

namespace {

using i64 = std::int64_t;
using i128 = __int128;

i64 pick(FuzzedDataProvider& fdp) {
  // Mostly small values, sometimes boundaries and arbitrary 64-bit values.
  switch (fdp.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return fdp.ConsumeIntegral<i64>();
    case 1: {
      static const i64 edge[] = {0, 1, -1, 2, 4096, 4097, (i64(1) << 31) - 1, i64(1) << 31, (i64(1) << 31) + 1,
                                 i64(1) << 32, i64(1) << 62, INT64_MAX, INT64_MIN, INT64_MAX / 2 + 1};
      return edge[fdp.ConsumeIntegralInRange<std::size_t>(0, sizeof edge / sizeof edge[0] - 1)];
    }
    default: return fdp.ConsumeIntegralInRange<i64>(0, 40);
  }
}

void check_view(const kvscore::KeysView<float>& v, i64 heads, i64 tokens, i64 d, i64 hs, i64 ts) {
  FZ_CHECK(heads >= 0 && tokens >= 0 && d >= 1 && d <= kvscore::kMaxHeadDim, "bad shape accepted");
  FZ_CHECK(v.heads() == heads && v.tokens() == tokens && v.head_dim() == d, "shape not kept");
  if (heads == 0 || tokens == 0) return;
  FZ_CHECK(hs >= 0 && ts >= 0, "negative stride accepted");
  const i128 span = i128(heads - 1) * hs + i128(tokens - 1) * ts + d;
  FZ_CHECK(span <= i128(INT64_MAX), "span overflows int64 but the view was accepted");
  // Disjoint rows: brute force when the row count is small.
  if (i128(heads) * tokens <= 4096) {
    std::vector<i64> starts;
    for (i64 h = 0; h < heads; ++h)
      for (i64 t = 0; t < tokens; ++t) starts.push_back(h * hs + t * ts);
    std::sort(starts.begin(), starts.end());
    for (std::size_t i = 1; i < starts.size(); ++i)
      FZ_CHECK(starts[i] - starts[i - 1] >= d, "overlapping rows accepted");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const i64 heads = pick(fdp), tokens = pick(fdp);
  i64 d = pick(fdp);
  if (fdp.ConsumeBool()) d = fdp.ConsumeIntegralInRange<i64>(1, 200);
  const i64 hs = pick(fdp), ts = pick(fdp);
  constexpr i64 kBuf = 1 << 15;  // floats backing the views that are small enough
  static std::vector<float> buf(kBuf);
  const int which = fdp.ConsumeIntegralInRange<int>(0, 3);
  try {
    kvscore::KeysView<float> v;
    i64 H = heads, N = tokens, HS = hs, TS = ts;
    if (which == 0) {
      v = kvscore::KeysView<float>(buf.data(), heads, tokens, d, hs, ts);
    } else if (which == 1) {
      v = kvscore::KeysView<float>::token_major(buf.data(), tokens, heads, d);
      HS = d;
      TS = heads * d;  // only reached if no overflow was reported
    } else if (which == 2) {
      const i64 batch = std::max<i64>(1, hs % 4), bi = ts % 4, cap = fdp.ConsumeBool() ? -1 : pick(fdp);
      // Finding F3 (docs/contributing/robustness.md, fixed in view.hpp): hf() formed the batch pointer
      // before validating the shape. Negative shapes now reach hf() and must be rejected;
      // only offsets far beyond this small buffer are skipped (the rows are read below).
      const double off = double(cap < 0 ? tokens : cap) * double(d) * double(heads) * double(bi);
      if (off * 4 > 0x1p40) return 0;
      v = kvscore::KeysView<float>::hf(buf.data(), bi, batch, heads, tokens, d, cap);
      HS = v.head_stride();
      TS = v.token_stride();
      FZ_CHECK(bi >= 0 && bi < batch, "batch_index out of range accepted");
      FZ_CHECK(TS == d && HS >= tokens * d, "hf strides");
    } else {
      kvscore::ScoresView sv(buf.data(), heads, tokens, hs);
      FZ_CHECK(heads >= 0 && tokens >= 0, "negative ScoresView shape accepted");
      if (heads > 1) FZ_CHECK((hs < 0 ? tokens : hs) >= tokens, "overlapping ScoresView heads accepted");
      return 0;
    }
    check_view(v, H, N, d, HS, TS);
    // Slices: either rejected or inside the view.
    const i64 t0 = pick(fdp), t1 = pick(fdp);
    // Finding F1 (docs/contributing/robustness.md, fixed in view.hpp): tokens_slice offset the pointer for
    // views with 0 heads, for empty slices at t0 == tokens, and for spans that fit int64 in
    // elements but not in bytes. No skip: UBSan's pointer-overflow check guards it now.
    try {
      const auto s = v.tokens_slice(t0, t1);
      FZ_CHECK(t0 >= 0 && t0 <= t1 && t1 <= N && s.tokens() == t1 - t0, "bad slice accepted");
    } catch (const std::invalid_argument&) {
      FZ_CHECK(!(t0 >= 0 && t0 <= t1 && t1 <= N), "valid slice rejected");
    }
    if (v.empty()) return 0;
    // hf() views of batch row b start b*heads*capacity*d elements into the buffer.
    const i128 span = i128(v.data() - buf.data()) + i128(H - 1) * HS + i128(N - 1) * TS + d;
    if (span > kBuf || i128(H) * N > 4096) return 0;
    // Back the view with memory and score it: every read must stay in the buffer.
    for (i64 i = 0; i < i64(span); ++i) buf[std::size_t(i)] = float((i * 7) % 13) - 6.f;
    kvscore::KNorm knorm;
    knorm.num_threads = 1;
    const kvscore::Scores sc = knorm.score(v);
    for (i64 h = 0; h < H; ++h)
      for (i64 t = 0; t < N; ++t) {
        double sq = 0;
        for (i64 j = 0; j < d; ++j) sq += double(v.row(h, t)[j]) * v.row(h, t)[j];
        const double ref = -std::sqrt(sq);
        FZ_CHECK(std::abs(sc(h, t) - ref) <= 1e-4 * (1 + std::abs(ref)), "KNorm differs from reference");
      }
  } catch (const std::invalid_argument& e) {
    FZ_CHECK(std::string(e.what()).size() > 10, "empty message");
  }
  return 0;
}
