// cuda/src/compact.cu — in-place compaction gather (kvscore/compact.hpp's semantics) on the GPU.
//
// One CTA per head walks its kept rows in order, in chunks staged through shared memory: a
// chunk's source rows are all read before any of its destination rows is written, and since
// kept positions ascend (pos[i] >= i), a later chunk's sources lie after every row written so
// far. So the gather is in place, needs no workspace, and is race-free. Rows already in place
// (the prefix with pos[i] == i, found by binary search: pos[i] - i never decreases) are skipped.
#include "common.cuh"

#include <algorithm>

namespace kvscore::cuda::detail {
namespace {

constexpr int kThreads = 256;
constexpr long long kSmemBytes = 48 * 1024;

template <class W>
__global__ void __launch_bounds__(kThreads) gather(char* data, long long hs, long long ts, long long row_words,
                                                   long long tokens, const long long* off, const long long* pos,
                                                   bool zero_tail, long long chunk) {
  extern __shared__ unsigned char smem_raw[];
  W* buf = reinterpret_cast<W*>(smem_raw);
  const long long h = blockIdx.x, b = off[h], n = off[h + 1] - b;
  const long long* p = pos + b;
  auto row = [&](long long t) { return reinterpret_cast<W*>(data + h * hs + t * ts); };
  long long lo = 0, hi = n;  // first i with p[i] != i
  while (lo < hi) {
    const long long mid = (lo + hi) / 2;
    if (p[mid] == mid) lo = mid + 1;
    else hi = mid;
  }
  for (long long i0 = lo; i0 < n; i0 += chunk) {
    const long long m = n - i0 < chunk ? n - i0 : chunk;
    for (long long idx = threadIdx.x; idx < m * row_words; idx += kThreads)
      buf[idx] = row(p[i0 + idx / row_words])[idx % row_words];
    __syncthreads();
    for (long long idx = threadIdx.x; idx < m * row_words; idx += kThreads)
      row(i0 + idx / row_words)[idx % row_words] = buf[idx];
    __syncthreads();
  }
  if (zero_tail)
    for (long long idx = threadIdx.x; idx < (tokens - n) * row_words; idx += kThreads)
      row(n + idx / row_words)[idx % row_words] = W{};
}

template <class W>
void launch(void* data, long long es, long long heads, long long tokens, long long d, long long hs, long long ts,
            const long long* off, const long long* pos, bool zero_tail, cudaStream_t st) {
  const long long row_words = d * es / (long long)sizeof(W);
  const long long chunk = std::max<long long>(1, std::min<long long>(1024, kSmemBytes / (row_words * (long long)sizeof(W))));
  gather<W><<<grid_dim(heads), kThreads, std::size_t(chunk * row_words) * sizeof(W), st>>>(
      static_cast<char*>(data), hs * es, ts * es, row_words, tokens, off, pos, zero_tail, chunk);
  KVSCORE_CUDA_LAUNCHED();
}

}  // namespace

void compact(void* data, dtype type, std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
             std::int64_t head_stride, std::int64_t token_stride, const std::int64_t* offsets,
             const std::int64_t* positions, bool zero_tail, stream_t stream) {
  if (heads == 0 || tokens == 0) return;
  require_no_pending_error("kvscore::cuda::compact");
  require_device_pointer(data, "cache");
  require_device_pointer(offsets, "offsets");
  require_device_pointer(positions, "positions");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const long long es = type == dtype::f32 ? 4 : 2;
  const auto* off = reinterpret_cast<const long long*>(offsets);
  const auto* pos = reinterpret_cast<const long long*>(positions);
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(data);
  // 16-byte words when every row starts on a 16-byte boundary and holds whole words.
  if (a % 16 == 0 && (head_dim * es) % 16 == 0 && (head_stride * es) % 16 == 0 && (token_stride * es) % 16 == 0)
    launch<uint4>(data, es, heads, tokens, head_dim, head_stride, token_stride, off, pos, zero_tail, st);
  else if (es == 4)
    launch<unsigned>(data, es, heads, tokens, head_dim, head_stride, token_stride, off, pos, zero_tail, st);
  else
    launch<unsigned short>(data, es, heads, tokens, head_dim, head_stride, token_stride, off, pos, zero_tail, st);
}

}  // namespace kvscore::cuda::detail
