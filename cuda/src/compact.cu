// cuda/src/compact.cu — in-place compaction gather (kvscore/compact.hpp's semantics) on the GPU.
//
// One CTA per head walks its kept rows in order, in chunks staged through shared memory: a
// chunk's source rows are all read before any of its destination rows is written, and since
// kept positions ascend (pos[i] >= i), a later chunk's sources lie after every row written so
// far. So the gather is in place, needs no workspace, and is race-free. Rows already in place
// (the prefix with pos[i] == i, found by binary search: pos[i] - i never decreases) are skipped.
#include "common.cuh"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

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

/// *first = the lowest index i of positions whose entry breaks the rules (out of [0, tokens), or
/// not above the entry before it in the same head); the head is found from the offsets.
__global__ void first_bad_position(const long long* off, long long heads, const long long* pos, long long n,
                                   long long tokens, unsigned long long* first) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    long long lo = 0, hi = heads;  // head h with off[h] <= i < off[h + 1]: the last h with off[h] <= i
    while (hi - lo > 1) {
      const long long mid = (lo + hi) / 2;
      if (off[mid] <= i) lo = mid;
      else hi = mid;
    }
    const long long p = pos[i];
    const bool bad = p < 0 || p >= tokens || (i > off[lo] && p <= pos[i - 1]);
    if (bad) atomicMin(first, (unsigned long long)i);
  }
}

}  // namespace

std::size_t selection_check_workspace_bytes() noexcept { return 256 + sizeof(unsigned long long); }

std::vector<std::int64_t> check_selection(std::int64_t heads, std::int64_t tokens, const std::int64_t* offsets,
                                          const std::int64_t* positions, std::int64_t positions_size, Workspace ws,
                                          stream_t stream, const char* who) {
  const std::string ctx(who);
  auto invalid = [&](const std::string& m) { throw std::invalid_argument(ctx + ": " + m); };
  if (heads < 0 || tokens < 0 || positions_size < 0)
    invalid("selection has a negative shape (" + std::to_string(heads) + ", " + std::to_string(tokens) + ")");
  require_no_pending_error(who);
  require_device_pointer(offsets, "offsets");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  std::vector<std::int64_t> off(std::size_t(heads + 1));
  KVSCORE_CUDA_CHECK(cudaMemcpyAsync(off.data(), offsets, off.size() * sizeof(long long), cudaMemcpyDeviceToHost, st));
  KVSCORE_CUDA_CHECK(cudaStreamSynchronize(st));
  if (off[0] != 0) invalid("selection.offsets[0] = " + std::to_string(off[0]) + ", expected 0");
  if (off.back() != positions_size)
    invalid("selection.offsets[" + std::to_string(heads) + "] = " + std::to_string(off.back()) +
            " but positions has " + std::to_string(positions_size) + " entries");
  for (long long h = 0; h < heads; ++h)
    if (off[h + 1] < off[h])
      invalid("selection.offsets decrease at head " + std::to_string(h) + " (" + std::to_string(off[h]) + " > " +
              std::to_string(off[h + 1]) + ")");
  unsigned long long first = ~0ull;
  if (positions_size > 0) {
    require_device_pointer(positions, "positions");
    require_workspace(ws, selection_check_workspace_bytes(), who);
    Carver c(ws.data);
    unsigned long long* d_first = c.take<unsigned long long>(1);
    KVSCORE_CUDA_CHECK(cudaMemsetAsync(d_first, 0xFF, sizeof(unsigned long long), st));
    first_bad_position<<<grid_dim(std::min<long long>((positions_size + 255) / 256, 1024)), 256, 0, st>>>(
        reinterpret_cast<const long long*>(offsets), heads, reinterpret_cast<const long long*>(positions),
        positions_size, tokens, d_first);
    KVSCORE_CUDA_LAUNCHED();
    KVSCORE_CUDA_CHECK(cudaMemcpyAsync(&first, d_first, sizeof first, cudaMemcpyDeviceToHost, st));
    KVSCORE_CUDA_CHECK(cudaStreamSynchronize(st));
  }
  // in the CPU's order: head by head, its count first, then its positions
  for (long long h = 0; h < heads; ++h) {
    const long long b = off[std::size_t(h)], e = off[std::size_t(h + 1)];
    if (first < (unsigned long long)b) break;
    if (e - b > tokens)
      invalid("head " + std::to_string(h) + " keeps " + std::to_string(e - b) + " positions but there are only " +
              std::to_string(tokens) + " tokens");
    if (first < (unsigned long long)e) {
      const long long i = (long long)first;
      long long pair[2] = {-1, -1};  // positions[i - 1] (same head only), positions[i]
      KVSCORE_CUDA_CHECK(cudaMemcpy(&pair[1], positions + i, sizeof(long long), cudaMemcpyDeviceToHost));
      if (i > b) KVSCORE_CUDA_CHECK(cudaMemcpy(&pair[0], positions + i - 1, sizeof(long long), cudaMemcpyDeviceToHost));
      if (pair[1] < 0 || pair[1] >= tokens)
        invalid("head " + std::to_string(h) + ": position " + std::to_string(pair[1]) + " out of range [0, " +
                std::to_string(tokens) + ")");
      invalid("head " + std::to_string(h) + ": positions must be strictly ascending (" + std::to_string(pair[1]) +
              " after " + std::to_string(pair[0]) + ")");
    }
  }
  return off;
}

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
