// cuda/src/scorers.cu — KNorm, KeyDiff, ManifoldL2, WindowedManifoldL2 and QFilter on the GPU.
//
// All heads of a layer in one launch (grid.y = head). Two kernels:
//  * centroid (ManifoldL2, windowed, KeyDiff): per (head, segment, part of <= kPartRows rows)
//    a block sums its valid rows (KeyDiff: k/‖k‖) into fp64 accumulators, one thread per
//    dimension, rows in order; a finalize kernel adds the parts in order. The partition depends
//    only on the shape, so the result is bit-identical on every run (no floating atomics).
//  * rows: one warp per row, fp32 accumulation, butterfly reduction; head_dim 64/128/256 with
//    vector loads when the rows are aligned, one generic loop otherwise.
// Invalid rows (non-finite fp32 squared norm) follow scorers/scorer_base.hpp: -inf, left out of
// every centroid.
#include "common.cuh"

#include <algorithm>
#include <stdexcept>

namespace kvscore::cuda::detail {
namespace {

constexpr int kPartRows = 1024;     // rows per centroid block
constexpr int kCentroidThreads = 128;
constexpr int kRowThreads = 256;     // 8 warps
constexpr int kRowsPerWarp = 8;      // rows per warp per block
constexpr int kUnroll = 4;           // rows in flight per warp

/// Segments (windows) of a head: [s*W, (s+1)*W), the last one running to N (the tail, or a
/// full window with a merged tail).
struct Segments {
  long long W = 1, S = 1, pps = 1;  // window, segments, parts per segment
  __host__ __device__ long long of(long long t) const { return t / W < S - 1 ? t / W : S - 1; }
  __host__ __device__ long long begin(long long s) const { return s * W; }
  __host__ __device__ long long end(long long s, long long N) const { return s == S - 1 ? N : (s + 1) * W; }
};

Segments make_segments(std::int64_t N, std::int64_t window, bool merge_tail) {
  Segments g;
  if (window <= 0 || window >= N) {
    g.W = N > 0 ? N : 1;
    g.S = 1;
  } else {  // WindowedManifoldL2::windows(): WindowTail::merge joins a tail < W/2 to the window before it
    const std::int64_t full = N / window, tail = N % window;
    g.W = window;
    g.S = full + ((tail > 0 && !(merge_tail && full >= 1 && 2 * tail < window)) ? 1 : 0);
  }
  long long maxlen = g.S == 1 ? N : std::max<long long>(g.W, N - (g.S - 1) * g.W);
  g.pps = std::max<long long>(1, (maxlen + kPartRows - 1) / kPartRows);
  return g;
}

struct Layout {
  double* partial = nullptr;       // [H][S][pps][d]
  long long* count = nullptr;      // [H][S][pps]
  float* vec = nullptr;            // [H][S][d]: centroid, unit anchor or filter
  int* flag = nullptr;             // [H][S]: 1 = usable vector
};

Layout carve(Carver& c, Geometric kind, std::int64_t H, std::int64_t N, std::int64_t d, std::int64_t window,
             bool merge_tail) {
  Layout l;
  if (kind == Geometric::knorm) return l;
  const Segments g = make_segments(N, kind == Geometric::l2 ? window : 0, merge_tail);
  const std::size_t hs = std::size_t(H) * std::size_t(g.S);
  if (kind != Geometric::qfilter) {
    l.partial = c.take<double>(hs * std::size_t(g.pps) * std::size_t(d));
    l.count = c.take<long long>(hs * std::size_t(g.pps));
    l.flag = c.take<int>(hs);
  }
  l.vec = c.take<float>(hs * std::size_t(d));
  return l;
}

template <dtype D>
struct KeysDev {
  const typename Storage<D>::type* p;
  long long hs, ts, N, d;
  __device__ const typename Storage<D>::type* row(long long h, long long t) const { return p + h * hs + t * ts; }
};

// ------------------------------------------------------------------ centroid partial sums

template <dtype D, bool Normalize>
__global__ void __launch_bounds__(kCentroidThreads) centroid_partial(KeysDev<D> k, Segments g, Layout l) {
  extern __shared__ double acc[];  // [d]
  __shared__ float weight[32];
  __shared__ int used[32];
  const long long h = blockIdx.y, s = blockIdx.x / g.pps, part = blockIdx.x % g.pps;
  const long long b = g.begin(s) + part * kPartRows;
  const long long e1 = g.end(s, k.N), e = e1 < b + kPartRows ? e1 : b + kPartRows;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (long long j = tid; j < k.d; j += kCentroidThreads) acc[j] = 0.0;
  long long valid = 0;
  for (long long t0 = b; t0 < e; t0 += 32) {
    const int m = e - t0 < 32 ? int(e - t0) : 32;
    __syncthreads();
    for (int r = warp; r < m; r += kCentroidThreads / 32) {  // squared norms, one warp per row
      const auto* row = k.row(h, t0 + r);
      float sq = 0.f;
      for (long long j = lane; j < k.d; j += 32) {
        const float x = widen<D>(row[j]);
        sq = fmaf(x, x, sq);
      }
      sq = warp_sum(sq);
      if (lane == 0) {
        const bool ok = isfinite(sq) && (!Normalize || sq > 0.f);
        used[r] = ok ? 1 : 0;
        weight[r] = ok ? (Normalize ? 1.f / sqrtf(sq) : 1.f) : 0.f;
      }
    }
    __syncthreads();
    for (long long j = tid; j < k.d; j += kCentroidThreads) {  // one thread per dimension, rows in order
      double a = acc[j];
      for (int r = 0; r < m; ++r)
        if (used[r]) a += double(widen<D>(k.row(h, t0 + r)[j])) * double(weight[r]);
      acc[j] = a;
    }
    for (int r = 0; r < m; ++r) valid += used[r];
  }
  __syncthreads();
  const std::size_t cell = (std::size_t(h) * g.S + s) * g.pps + part;
  for (long long j = tid; j < k.d; j += kCentroidThreads) l.partial[cell * k.d + j] = acc[j];
  if (tid == 0) l.count[cell] = valid;
}

/// Per (head, segment): adds the parts in order. Mean (ManifoldL2) or unit anchor (KeyDiff).
__global__ void __launch_bounds__(kCentroidThreads) centroid_finalize(Segments g, long long d, bool keydiff, Layout l) {
  __shared__ double red[kCentroidThreads];
  const long long hs = std::size_t(blockIdx.y) * g.S + blockIdx.x;
  const int tid = threadIdx.x;
  long long valid = 0;
  for (long long p = 0; p < g.pps; ++p) valid += l.count[hs * g.pps + p];
  double norm2 = 0.0;
  for (long long j = tid; j < d; j += kCentroidThreads) {
    double a = 0.0;
    for (long long p = 0; p < g.pps; ++p) a += l.partial[(hs * g.pps + p) * d + j];
    l.partial[(hs * g.pps) * d + j] = a;  // part 0 keeps the total
    norm2 += a * a;
  }
  red[tid] = norm2;
  __syncthreads();
  for (int o = kCentroidThreads / 2; o > 0; o >>= 1) {  // fixed tree: deterministic
    if (tid < o) red[tid] += red[tid + o];
    __syncthreads();
  }
  const double anorm = sqrt(red[0]);
  const bool ok = keydiff ? anorm > 0.0 : valid > 0;
  for (long long j = tid; j < d; j += kCentroidThreads) {
    const double a = l.partial[(hs * g.pps) * d + j];
    l.vec[hs * d + j] = ok ? float(keydiff ? a / anorm : a / double(valid)) : 0.f;
  }
  if (tid == 0) l.flag[hs] = ok ? 1 : 0;
}

// ------------------------------------------------------------------ per-row scores

struct RowOut {
  float* out;
  long long out_hs;
};

__device__ __forceinline__ float finish(Geometric kind, float sq, float dot, float dist, bool vec_ok) {
  if (!isfinite(sq)) return kNegInf;
  switch (kind) {
    case Geometric::knorm: return -sqrtf(sq);
    case Geometric::qfilter: return isfinite(dot) ? dot : kNegInf;
    case Geometric::l2: return vec_ok ? sqrtf(dist) : kNegInf;
    case Geometric::keydiff: {
      if (!vec_ok) return 0.f;  // zero anchor: every valid key scores 0
      const float n = sqrtf(sq);  // the CPU takes ‖k‖ < 2^-63 in fp64 (docs/keydiff.md); here only the clamp
      return n > 0.f ? fminf(1.f, fmaxf(-1.f, -dot / n)) : 0.f;
    }
  }
  return kNegInf;
}

/// One warp per row. DIM > 0: head_dim == DIM, rows aligned to DIM/32 elements (vector loads).
template <dtype D, int DIM>
__global__ void __launch_bounds__(kRowThreads) row_scores(KeysDev<D> k, Geometric kind, Segments g, Layout l,
                                                          RowOut o) {
  const long long h = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long base = (long long)blockIdx.x * (kRowThreads / 32) * kRowsPerWarp;
  const bool uses_vec = kind != Geometric::knorm;
  if constexpr (DIM > 0) {
    constexpr int V = DIM / 32;
    for (int r0 = 0; r0 < kRowsPerWarp; r0 += kUnroll) {
      float x[kUnroll][V];
      long long t[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll rows in flight
        t[u] = base + (long long)(r0 + u) * (kRowThreads / 32) + warp;
        if (t[u] < k.N) load_vec<D, V>(k.row(h, t[u]) + lane * V, x[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (t[u] >= k.N) continue;
        const long long seg = uses_vec ? h * g.S + g.of(t[u]) : 0;
        float v[V];
        if (uses_vec) {
#pragma unroll
          for (int i = 0; i < V; ++i) v[i] = l.vec[seg * DIM + lane * V + i];
        }
        float sq = 0.f, dot = 0.f, dist = 0.f;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          sq = fmaf(x[u][i], x[u][i], sq);
          if (uses_vec) {
            dot = fmaf(x[u][i], v[i], dot);
            const float df = x[u][i] - v[i];
            dist = fmaf(df, df, dist);
          }
        }
        sq = warp_sum(sq);
        if (uses_vec) {
          dot = warp_sum(dot);
          dist = warp_sum(dist);
        }
        const bool ok = kind == Geometric::qfilter || kind == Geometric::knorm ? true : l.flag[seg] != 0;
        if (lane == 0) o.out[h * o.out_hs + t[u]] = finish(kind, sq, dot, dist, ok);
      }
    }
  } else {
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const long long t = base + (long long)r * (kRowThreads / 32) + warp;
      if (t >= k.N) break;
      const long long seg = uses_vec ? h * g.S + g.of(t) : 0;
      const auto* row = k.row(h, t);
      float sq = 0.f, dot = 0.f, dist = 0.f;
      for (long long j = lane; j < k.d; j += 32) {
        const float x = widen<D>(row[j]);
        sq = fmaf(x, x, sq);
        if (uses_vec) {
          const float v = l.vec[seg * k.d + j];
          dot = fmaf(x, v, dot);
          const float df = x - v;
          dist = fmaf(df, df, dist);
        }
      }
      sq = warp_sum(sq);
      dot = warp_sum(dot);
      dist = warp_sum(dist);
      const bool ok = kind == Geometric::qfilter || kind == Geometric::knorm ? true : l.flag[seg] != 0;
      if (lane == 0) o.out[h * o.out_hs + t] = finish(kind, sq, dot, dist, ok);
    }
  }
}

template <dtype D>
void run(Geometric kind, const KeysArg& a, const ScoresArg& out, std::int64_t window, bool merge_tail,
         const float* host_filters, Workspace ws, cudaStream_t st) {
  using S = typename Storage<D>::type;
  const KeysDev<D> k{static_cast<const S*>(a.data), a.head_stride, a.token_stride, a.tokens, a.head_dim};
  const std::int64_t H = a.heads, N = a.tokens, d = a.head_dim;
  Carver c(ws.data);
  const Layout l = carve(c, kind, H, N, d, window, merge_tail);
  const Segments g = make_segments(N, kind == Geometric::l2 ? window : 0, merge_tail);
  if (kind == Geometric::qfilter)
    KVSCORE_CUDA_CHECK(cudaMemcpyAsync(l.vec, host_filters, std::size_t(H * d) * sizeof(float),
                                       cudaMemcpyHostToDevice, st));
  if (kind == Geometric::l2 || kind == Geometric::keydiff) {
    const dim3 grid(grid_dim(g.S * g.pps), grid_dim(H));
    const std::size_t smem = std::size_t(d) * sizeof(double);
    if (kind == Geometric::keydiff) {
      if (smem > 48 * 1024)
        KVSCORE_CUDA_CHECK(cudaFuncSetAttribute(centroid_partial<D, true>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      centroid_partial<D, true><<<grid, kCentroidThreads, smem, st>>>(k, g, l);
    } else {
      if (smem > 48 * 1024)
        KVSCORE_CUDA_CHECK(cudaFuncSetAttribute(centroid_partial<D, false>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      centroid_partial<D, false><<<grid, kCentroidThreads, smem, st>>>(k, g, l);
    }
    KVSCORE_CUDA_LAUNCHED();
    centroid_finalize<<<dim3(grid_dim(g.S), grid_dim(H)), kCentroidThreads, 0, st>>>(g, d, kind == Geometric::keydiff,
                                                                                     l);
    KVSCORE_CUDA_LAUNCHED();
  }
  const RowOut o{out.data, out.head_stride};
  const long long rows_per_block = (kRowThreads / 32) * kRowsPerWarp;
  const dim3 grid(grid_dim((N + rows_per_block - 1) / rows_per_block), grid_dim(H));
  // Vector path: head_dim 64/128/256 and every row starting at a multiple of head_dim/32 elements.
  auto aligned = [&](std::int64_t dim) {
    const std::int64_t v = dim / 32;
    const std::uintptr_t bytes = std::uintptr_t(v) * sizeof(S);
    return d == dim && reinterpret_cast<std::uintptr_t>(a.data) % bytes == 0 && a.head_stride % v == 0 &&
           a.token_stride % v == 0;
  };
  if (aligned(64)) row_scores<D, 64><<<grid, kRowThreads, 0, st>>>(k, kind, g, l, o);
  else if (aligned(128)) row_scores<D, 128><<<grid, kRowThreads, 0, st>>>(k, kind, g, l, o);
  else if (aligned(256)) row_scores<D, 256><<<grid, kRowThreads, 0, st>>>(k, kind, g, l, o);
  else row_scores<D, 0><<<grid, kRowThreads, 0, st>>>(k, kind, g, l, o);
  KVSCORE_CUDA_LAUNCHED();
}

}  // namespace

std::size_t geometric_workspace_bytes(Geometric kind, std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
                                      std::int64_t window, bool merge_tail) noexcept {
  if (kind == Geometric::knorm || heads <= 0 || tokens <= 0) return 0;
  Carver c;
  carve(c, kind, heads, tokens, head_dim, window, merge_tail);
  return c.bytes();
}

void score_geometric(Geometric kind, const KeysArg& keys, const ScoresArg& out, std::int64_t window, bool merge_tail,
                     const float* host_filters, Workspace ws, stream_t stream) {
  if (keys.heads == 0 || keys.tokens == 0) return;
  require_no_pending_error("kvscore::cuda::score");
  require_device_pointer(keys.data, "keys");
  require_device_pointer(out.data, "scores");
  require_workspace(ws, geometric_workspace_bytes(kind, keys.heads, keys.tokens, keys.head_dim, window, merge_tail),
                    "kvscore::cuda::score");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  for_dtype(keys.type, [&](auto D) {
    run<decltype(D)::value>(kind, keys, out, window, merge_tail, host_filters, ws, st);
  });
}

}  // namespace kvscore::cuda::detail
