// cuda/src/scorers.cu — KNorm, KeyDiff, ManifoldL2, WindowedManifoldL2 and QFilter on the GPU.
//
// All heads of a layer in one launch (grid.y = head). Two kernels:
//  * centroid (ManifoldL2, windowed, KeyDiff): per (head, segment, part of <= kPartRows rows)
//    a block sums its valid rows (KeyDiff: k/‖k‖) into fp64 accumulators, one thread per
//    dimension, rows in order; a finalize kernel adds the parts in order. The partition depends
//    only on the shape, so the result is bit-identical on every run (no floating atomics).
//    With 16-byte-aligned rows of head_dim 64/128/256 (every engine layout we know) the block
//    reads rows with 16-byte loads, each lane keeps fp64 sums of its slice for the rows of its
//    slot (a fixed subset; kUnroll rows at a time added in fp32 first), and the slots are added in
//    a fixed order at the end.
//  * rows: fp32 accumulation, butterfly reduction. With 16-byte-aligned rows of head_dim
//    64/128/256 a row is read by LPR lanes with one 16-byte load each (fp16 d = 128: 16 lanes,
//    two rows per warp load) and kUnroll loads are in flight per warp: the kernel is a stream at
//    the read bandwidth. One generic loop (a warp per row) otherwise.
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
constexpr int kRowIters = 2;         // vector path: kUnroll warp loads per iteration
constexpr int kCentroidVecThreads = 256;

/// A row of DIM elements read 16 bytes per lane: LPR lanes per row, C loads per lane, RPW rows
/// per warp load, EL elements per lane.
template <dtype D, int DIM>
struct RowShape {
  using S = typename Storage<D>::type;
  static constexpr int E = 16 / int(sizeof(S));
  static constexpr int LPR = DIM / E < 32 ? DIM / E : 32;
  static constexpr int C = DIM / (E * LPR);
  static constexpr int RPW = 32 / LPR;
  static constexpr int EL = E * C;
  static_assert(DIM % (E * LPR) == 0 && 32 % LPR == 0, "head_dim 64/128/256");
};

/// Sum over the LPR lanes of a row (butterfly: every lane of the group gets the same value).
template <int LPR>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = LPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/// Lane `sub`'s slice of a row: elements (c * LPR + sub) * E .. + E for c < C, widened.
template <dtype D, int DIM>
__device__ __forceinline__ void load_slice(const typename Storage<D>::type* row, int sub,
                                           float (&x)[RowShape<D, DIM>::EL]) {
  using R = RowShape<D, DIM>;
  using S = typename R::S;
#pragma unroll
  for (int c = 0; c < R::C; ++c) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(row + (c * R::LPR + sub) * R::E));
    const S* e = reinterpret_cast<const S*>(&v);
#pragma unroll
    for (int i = 0; i < R::E; ++i) x[c * R::E + i] = widen<D>(e[i]);
  }
}

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

/// The same partial sums from 16-byte loads: slot q (of NW * RPW) sums the rows b + q + m·NW·RPW in
/// order, per lane in fp64 over its slice; the slots are added in order at the end. The partition
/// depends only on the shape: bit-identical on every run.
template <dtype D, int DIM, bool Normalize>
__global__ void __launch_bounds__(kCentroidVecThreads) centroid_partial_vec(KeysDev<D> k, Segments g, Layout l) {
  using R = RowShape<D, DIM>;
  constexpr int NW = kCentroidVecThreads / 32, SLOTS = NW * R::RPW;
  __shared__ double red[SLOTS][DIM];
  __shared__ long long cnt[SLOTS];
  const long long h = blockIdx.y, s = blockIdx.x / g.pps, part = blockIdx.x % g.pps;
  const long long b = g.begin(s) + part * kPartRows;
  const long long e1 = g.end(s, k.N), e = e1 < b + kPartRows ? e1 : b + kPartRows;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % R::LPR, slot = warp * R::RPW + lane / R::LPR;
  double acc[R::EL];
#pragma unroll
  for (int i = 0; i < R::EL; ++i) acc[i] = 0.0;
  long long valid = 0;
  for (long long m0 = 0; b + m0 * SLOTS < e; m0 += kUnroll) {
    float x[kUnroll][R::EL];
    bool in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // all loads first
      const long long t = b + (m0 + u) * SLOTS + slot;
      in[u] = t < e;
      if (in[u]) load_slice<D, DIM>(k.row(h, t), sub, x[u]);
      else
#pragma unroll
        for (int i = 0; i < R::EL; ++i) x[u][i] = 0.f;
    }
    // The step's kUnroll rows are added in fp32 (in order), then once into the fp64 sums: an
    // fp32 -> fp64 conversion per element and row capped this kernel at ~0.8 of the read rate.
    float step[R::EL];
#pragma unroll
    for (int i = 0; i < R::EL; ++i) step[i] = 0.f;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float sq = 0.f;
#pragma unroll
      for (int i = 0; i < R::EL; ++i) sq = fmaf(x[u][i], x[u][i], sq);
      sq = group_sum<R::LPR>(sq);
      const bool ok = in[u] && isfinite(sq) && (!Normalize || sq > 0.f);
      const float w = ok ? (Normalize ? 1.f / sqrtf(sq) : 1.f) : 0.f;
      if (ok) {
#pragma unroll
        for (int i = 0; i < R::EL; ++i) step[i] = fmaf(x[u][i], w, step[i]);
        ++valid;
      }
    }
#pragma unroll
    for (int i = 0; i < R::EL; ++i) acc[i] += double(step[i]);
  }
#pragma unroll
  for (int c = 0; c < R::C; ++c)
#pragma unroll
    for (int i = 0; i < R::E; ++i) red[slot][(c * R::LPR + sub) * R::E + i] = acc[c * R::E + i];
  if (sub == 0) cnt[slot] = valid;
  __syncthreads();
  const std::size_t cell = (std::size_t(h) * g.S + s) * g.pps + part;
  for (int j = threadIdx.x; j < DIM; j += kCentroidVecThreads) {
    double a = 0.0;
    for (int q = 0; q < SLOTS; ++q) a += red[q][j];  // slots in order
    l.partial[cell * DIM + j] = a;
  }
  if (threadIdx.x == 0) {
    long long v = 0;
    for (int q = 0; q < SLOTS; ++q) v += cnt[q];
    l.count[cell] = v;
  }
}

/// Per (head, segment): adds the parts. Mean (ManifoldL2) or unit anchor (KeyDiff). Warp q sums
/// the parts q, q + 32, ... in order (loads in flight), the 32 warp sums are added in warp order:
/// a fixed order, bit-identical on every run. One thread per dimension summing every part in turn
/// took 200 µs for 1024 parts (8 × 1M keys, H100 under ncu): a chain of dependent loads.
constexpr int kFinThreads = 1024, kFinGroups = kFinThreads / 32, kFinAhead = 8;
__global__ void __launch_bounds__(kFinThreads) centroid_finalize(Segments g, long long d, bool keydiff, Layout l) {
  __shared__ double sums[kFinGroups][33];
  __shared__ unsigned long long valid_sh;
  __shared__ double norm_sh;
  const long long hs = std::size_t(blockIdx.y) * g.S + blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, q = tid >> 5;
  double* P = l.partial + hs * g.pps * d;  // [pps][d]; part 0 keeps the total
  if (tid == 0) valid_sh = 0;
  __syncthreads();
  unsigned long long c = 0;  // integers: any order gives the same count
  for (long long p = tid; p < g.pps; p += kFinThreads) c += (unsigned long long)l.count[hs * g.pps + p];
  if (c != 0) atomicAdd(&valid_sh, c);
  double norm2 = 0.0;  // warp 0: its lanes' dimensions
  for (long long j0 = 0; j0 < d; j0 += 32) {
    const long long j = j0 + lane;
    double a = 0.0;
    if (j < d) {
      long long p = q;
      for (; p + (kFinAhead - 1) * kFinGroups < g.pps; p += kFinAhead * kFinGroups) {
        double v[kFinAhead];
#pragma unroll
        for (int u = 0; u < kFinAhead; ++u) v[u] = P[(p + u * kFinGroups) * d + j];
#pragma unroll
        for (int u = 0; u < kFinAhead; ++u) a += v[u];
      }
      for (; p < g.pps; p += kFinGroups) a += P[p * d + j];
    }
    sums[q][lane] = a;
    __syncthreads();  // every read of these columns is done
    if (q == 0 && j < d) {
      double t = 0.0;
      for (int r = 0; r < kFinGroups; ++r) t += sums[r][lane];
      P[j] = t;
      norm2 += t * t;
    }
    __syncthreads();
  }
  if (q == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) norm2 += __shfl_xor_sync(0xffffffffu, norm2, o);  // fixed butterfly
    if (lane == 0) norm_sh = norm2;
  }
  __syncthreads();
  const double anorm = sqrt(norm_sh);
  const long long valid = (long long)valid_sh;
  const bool ok = keydiff ? anorm > 0.0 : valid > 0;
  for (long long j = tid; j < d; j += kFinThreads) {
    const double a = P[j];
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
      const float n = sqrtf(sq);  // the CPU takes ‖k‖ < 2^-63 in fp64 (docs/methods/keydiff.md); here only the clamp
      return n > 0.f ? fminf(1.f, fmaxf(-1.f, -dot / n)) : 0.f;
    }
  }
  return kNegInf;
}

/// DIM > 0: head_dim == DIM and 16-byte-aligned rows; LPR lanes per row (RowShape), kUnroll warp
/// loads in flight. DIM == 0: one warp per row, any layout.
template <dtype D, int DIM>
__global__ void __launch_bounds__(kRowThreads) row_scores(KeysDev<D> k, Geometric kind, Segments g, Layout l,
                                                          RowOut o) {
  const long long h = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool uses_vec = kind != Geometric::knorm;
  if constexpr (DIM > 0) {
    using R = RowShape<D, DIM>;
    constexpr int NW = kRowThreads / 32;
    const int sub = lane % R::LPR, slot = lane / R::LPR;
    const long long base = (long long)blockIdx.x * (kRowIters * kUnroll * NW * R::RPW);
    // The vector (centroid, anchor, filter) of the block's rows: loaded once when they share one
    // segment (always but at a window edge), else per row. Per-row loads from L1 held L2's row
    // pass at ~0.6 of DRAM throughput (ncu, H100).
    const long long last = base + kRowIters * kUnroll * NW * R::RPW - 1 < k.N - 1
                               ? base + kRowIters * kUnroll * NW * R::RPW - 1
                               : k.N - 1;
    const bool one_seg = !uses_vec || g.of(base) == g.of(last);
    float vr[R::EL];
    auto load_vector = [&](long long seg) {
      const float* vrow = l.vec + seg * DIM;
#pragma unroll
      for (int c = 0; c < R::C; ++c)
#pragma unroll
        for (int i4 = 0; i4 < R::E; i4 += 4) {
          const float4 v4 = *reinterpret_cast<const float4*>(vrow + (c * R::LPR + sub) * R::E + i4);
          vr[c * R::E + i4] = v4.x;
          vr[c * R::E + i4 + 1] = v4.y;
          vr[c * R::E + i4 + 2] = v4.z;
          vr[c * R::E + i4 + 3] = v4.w;
        }
    };
    if (uses_vec && one_seg) load_vector(h * g.S + g.of(base));
    for (int it = 0; it < kRowIters; ++it) {
      float x[kUnroll][R::EL];
      long long t[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll loads in flight
        t[u] = base + ((long long)(it * kUnroll + u) * NW + warp) * R::RPW + slot;
        if (t[u] < k.N) load_slice<D, DIM>(k.row(h, t[u]), sub, x[u]);
        else
#pragma unroll
          for (int i = 0; i < R::EL; ++i) x[u][i] = 0.f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const bool in = t[u] < k.N;
        const long long seg = uses_vec && in ? h * g.S + g.of(t[u]) : 0;
        float sq = 0.f, dot = 0.f, dist = 0.f;
#pragma unroll
        for (int i = 0; i < R::EL; ++i) sq = fmaf(x[u][i], x[u][i], sq);
        if (uses_vec) {
          if (!one_seg) load_vector(seg);
#pragma unroll
          for (int i = 0; i < R::EL; ++i) {  // L2 needs the distance, QFilter/KeyDiff the dot
            if (kind == Geometric::l2) {
              const float df = x[u][i] - vr[i];
              dist = fmaf(df, df, dist);
            } else {
              dot = fmaf(x[u][i], vr[i], dot);
            }
          }
        }
        sq = group_sum<R::LPR>(sq);
        if (kind == Geometric::l2) dist = group_sum<R::LPR>(dist);
        else if (uses_vec) dot = group_sum<R::LPR>(dot);
        if (in && sub == 0) {
          const bool ok = kind == Geometric::qfilter || kind == Geometric::knorm ? true : l.flag[seg] != 0;
          o.out[h * o.out_hs + t[u]] = finish(kind, sq, dot, dist, ok);
        }
      }
    }
  } else {
    const long long base = (long long)blockIdx.x * (kRowThreads / 32) * kRowsPerWarp;
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

/// head_dim == dim and every row 16-byte aligned: the vector paths.
template <class S>
bool rows_aligned16(const KeysArg& a, std::int64_t dim) {
  const std::int64_t e = 16 / std::int64_t(sizeof(S));
  return a.head_dim == dim && reinterpret_cast<std::uintptr_t>(a.data) % 16 == 0 && a.head_stride % e == 0 &&
         a.token_stride % e == 0;
}

template <dtype D, bool Normalize>
void launch_centroid(const KeysDev<D>& k, const KeysArg& a, const Segments& g, const Layout& l, dim3 grid,
                     cudaStream_t st) {
  using S = typename Storage<D>::type;
  if (rows_aligned16<S>(a, 64)) centroid_partial_vec<D, 64, Normalize><<<grid, kCentroidVecThreads, 0, st>>>(k, g, l);
  else if (rows_aligned16<S>(a, 128))
    centroid_partial_vec<D, 128, Normalize><<<grid, kCentroidVecThreads, 0, st>>>(k, g, l);
  else if (rows_aligned16<S>(a, 256))
    centroid_partial_vec<D, 256, Normalize><<<grid, kCentroidVecThreads, 0, st>>>(k, g, l);
  else {
    const std::size_t smem = std::size_t(a.head_dim) * sizeof(double);
    if (smem > 48 * 1024)
      KVSCORE_CUDA_CHECK(cudaFuncSetAttribute(centroid_partial<D, Normalize>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    centroid_partial<D, Normalize><<<grid, kCentroidThreads, smem, st>>>(k, g, l);
  }
  KVSCORE_CUDA_LAUNCHED();
}

template <dtype D, int DIM>
void launch_rows(const KeysDev<D>& k, Geometric kind, const Segments& g, const Layout& l, const RowOut& o,
                 long long N, long long H, cudaStream_t st) {
  const long long rows = DIM > 0 ? kRowIters * kUnroll * (kRowThreads / 32) * RowShape<D, DIM == 0 ? 64 : DIM>::RPW
                                 : (kRowThreads / 32) * kRowsPerWarp;
  const dim3 grid(grid_dim((N + rows - 1) / rows), grid_dim(H));
  row_scores<D, DIM><<<grid, kRowThreads, 0, st>>>(k, kind, g, l, o);
  KVSCORE_CUDA_LAUNCHED();
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
    if (kind == Geometric::keydiff) launch_centroid<D, true>(k, a, g, l, grid, st);
    else launch_centroid<D, false>(k, a, g, l, grid, st);
    centroid_finalize<<<dim3(grid_dim(g.S), grid_dim(H)), kFinThreads, 0, st>>>(g, d, kind == Geometric::keydiff,
                                                                                     l);
    KVSCORE_CUDA_LAUNCHED();
  }
  const RowOut o{out.data, out.head_stride};
  if (rows_aligned16<S>(a, 64)) launch_rows<D, 64>(k, kind, g, l, o, N, H, st);
  else if (rows_aligned16<S>(a, 128)) launch_rows<D, 128>(k, kind, g, l, o, N, H, st);
  else if (rows_aligned16<S>(a, 256)) launch_rows<D, 256>(k, kind, g, l, o, N, H, st);
  else launch_rows<D, 0>(k, kind, g, l, o, N, H, st);
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
