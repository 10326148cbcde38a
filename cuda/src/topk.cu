// cuda/src/topk.cu — batched deterministic top-k and the selector (per-head and AdaKV) on the GPU.
//
// Keys: the CPU selector's order-preserving uint32 of every score (select/radix.hpp: -0 == +0,
// every NaN below -inf). A row's selection of m is a threshold {K, need_eq}: keep key > K, and
// the first need_eq keys equal to K in position order — "higher score first, equal scores lower
// position first", the CPU's total order — found by a radix select over three digits
// (11 + 11 + 10 bits) with integer histograms (shared-memory atomics on integers: exact, so the
// result does not depend on scheduling). The kept positions are then written in ascending order
// by an ordered block scan. Two paths, same integers, same output:
//  * one CTA per row (many rows, moderate N): histograms, bin choice and the ordered write in one
//    kernel, the row read 4 times (3 histograms + write);
//  * several CTAs per row (few long rows): per-level histogram kernels adding into a global
//    histogram, a per-row bin choice, then count / scan / write kernels over the row's chunks.
// AdaKV's global step runs on the position-major key array Z[t][h], whose flat order is "lower
// position first, then lower head" — the CPU's tie rule for that step — once per layer of a batch.
#include "common.cuh"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <stdexcept>

namespace kvscore::cuda::detail {
namespace {

constexpr int kBlock = 512;
constexpr int kItems = 4;                   // per thread per tile of the ordered write (8 was slower at k = N/2)
constexpr int kTile = kBlock * kItems;
constexpr int kBins = 2048;
constexpr int kBinsPerThread = kBins / kBlock;
constexpr int kMaxCtasPerRow = 256;
constexpr int kLevels = 3;
__host__ __device__ constexpr int level_shift(int l) { return l == 0 ? 21 : l == 1 ? 10 : 0; }
__host__ __device__ constexpr int level_bins(int l) { return l == 2 ? 1024 : 2048; }

using Scan = cub::BlockScan<long long, kBlock>;

struct Th {
  std::uint32_t key;
  long long need_eq;
};
struct RowState {  // radix state of one row between the multi-CTA kernels
  std::uint32_t prefix, mask;
  long long m;
};

// -------------------------------------------------------------- sources of keys

struct ScoreSrc {  // scores[r*stride + off + i]
  const float* p;
  long long stride, off;
  __device__ std::uint32_t key(long long r, long long i) const {
    return key_of_bits(__float_as_uint(p[r * stride + off + i]));
  }
};
struct ZSrc {  // row b of precomputed keys: z[b*len + i] (one row per layer of the batch)
  const std::uint32_t* z;
  long long len;
  __device__ std::uint32_t key(long long b, long long i) const { return z[b * len + i]; }
};
struct MaskSrc {  // row r = b*H + h: keep[b*H*N + t*H + h]: 2 if kept else 1 (threshold {1, 0} takes the kept ones)
  const unsigned char* keep;
  long long H, N;
  __device__ std::uint32_t key(long long r, long long t) const {
    return keep[(r / H) * H * N + t * H + r % H] ? 2u : 1u;
  }
};

// -------------------------------------------------------------- outputs of the ordered write

struct PosOut {  // out[base(r) + rank_add + rank] = i + pos_add
  long long* out;
  long long row_stride;
  const long long* row_base;  // device offsets, or nullptr: r * row_stride
  long long rank_add, pos_add;
  __device__ void emit(long long r, long long i, long long rank) const {
    const long long b = row_base != nullptr ? row_base[r] : r * row_stride;
    out[b + rank_add + rank] = i + pos_add;
  }
};
struct ForceOut {  // AdaKV safeguard of row r = b*H + h: Z[b*H*N + (i + off)*H + h] = forced
  std::uint32_t* z;
  long long H, N, off;
  __device__ void emit(long long r, long long i, long long) const {
    z[(r / H) * H * N + (i + off) * H + r % H] = kForcedKey;
  }
};
struct MaskOut {  // AdaKV global step of layer b: keep[b*len + i] = 1
  unsigned char* keep;
  long long len;
  __device__ void emit(long long b, long long i, long long) const { keep[b * len + i] = 1; }
};

// -------------------------------------------------------------- block building blocks

/// kLoads coalesced loads per thread are issued before their atomics: one load at a time left the
/// row pass latency-bound (1.7 TB/s on an H200, issue 30).
constexpr int kLoads = 8;

/// f(key) for this thread's keys of row r in [b, e) (i = b + threadIdx.x + j·kBlock), kLoads loads
/// issued before their f calls.
template <class Src, class F>
__device__ __forceinline__ void for_each_key(const Src& src, long long r, long long b, long long e, F&& f) {
  long long i0 = b + threadIdx.x;
  for (; i0 + (kLoads - 1) * kBlock < e; i0 += kLoads * kBlock) {
    std::uint32_t k[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) k[u] = src.key(r, i0 + u * kBlock);
#pragma unroll
    for (int u = 0; u < kLoads; ++u) f(k[u]);
  }
  for (long long i = i0; i < e; i += kBlock) f(src.key(r, i));
}

template <class Src>
__device__ void block_hist(const Src& src, long long r, long long b, long long e, std::uint32_t prefix,
                           std::uint32_t mask, int level, unsigned* hist) {
  const int shift = level_shift(level);
  const std::uint32_t dmask = std::uint32_t(level_bins(level) - 1);
  for_each_key(src, r, b, e, [&](std::uint32_t k) {
    if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & dmask], 1u);
  });
}

/// The bin (from the top) where the m-th largest key falls; every thread gets it (smem).
__device__ void choose_bin(const unsigned* hist, int bins, long long m, Scan::TempStorage& tmp, int* out_bin,
                           long long* out_above) {
  long long v[kBinsPerThread], sum = 0;
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    const int idx = threadIdx.x * kBinsPerThread + j;
    v[j] = idx < bins ? hist[bins - 1 - idx] : 0;
    sum += v[j];
  }
  long long cum;
  Scan(tmp).ExclusiveSum(sum, cum);
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    const int idx = threadIdx.x * kBinsPerThread + j;
    if (idx < bins && cum < m && m <= cum + v[j]) {
      *out_bin = bins - 1 - idx;
      *out_above = cum;
    }
    cum += v[j];
  }
  __syncthreads();
}

/// Ordered write of the kept elements of [b, e): element i is kept iff key > K, or key == K and
/// fewer than need_eq equal keys came before it in the row (eq_before of them before b).
/// Ranks start at out_before. Tiles of kTile elements, kItems consecutive per thread.
template <class Src, class Out>
__device__ void block_collect(const Src& src, const Out& out, long long r, long long b, long long e, Th th,
                              long long eq_before, long long out_before, Scan::TempStorage& tmp) {
  for (long long t0 = b; t0 < e; t0 += kTile) {
    std::uint32_t k[kItems];
    long long ne = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const long long i = t0 + threadIdx.x * kItems + j;
      k[j] = i < e ? src.key(r, i) : 0u;
      ne += (i < e && k[j] == th.key) ? 1 : 0;
    }
    long long eq_rank, eq_total;
    Scan(tmp).ExclusiveSum(ne, eq_rank, eq_total);
    __syncthreads();
    eq_rank += eq_before;
    bool take[kItems];
    long long nt = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const long long i = t0 + threadIdx.x * kItems + j;
      const bool eq = i < e && k[j] == th.key;
      take[j] = i < e && (k[j] > th.key || (eq && eq_rank < th.need_eq));
      eq_rank += eq ? 1 : 0;
      nt += take[j] ? 1 : 0;
    }
    long long rank, taken;
    Scan(tmp).ExclusiveSum(nt, rank, taken);
    __syncthreads();
    rank += out_before;
#pragma unroll
    for (int j = 0; j < kItems; ++j)
      if (take[j]) out.emit(r, t0 + threadIdx.x * kItems + j, rank++);
    eq_before += eq_total;
    out_before += taken;
  }
}

// -------------------------------------------------------------- one CTA per row

template <class Src>
__device__ Th block_threshold(const Src& src, long long r, long long n, long long m, unsigned* hist,
                              Scan::TempStorage& tmp) {
  if (m <= 0) return {kForcedKey, 0};
  if (m >= n) return {0u, 0};
  __shared__ int bin;
  __shared__ long long above;
  std::uint32_t prefix = 0, mask = 0;
  for (int level = 0; level < kLevels; ++level) {
    for (int j = threadIdx.x; j < kBins; j += kBlock) hist[j] = 0;
    __syncthreads();
    block_hist(src, r, 0, n, prefix, mask, level, hist);
    __syncthreads();
    choose_bin(hist, level_bins(level), m, tmp, &bin, &above);
    prefix |= std::uint32_t(bin) << level_shift(level);
    mask |= std::uint32_t(level_bins(level) - 1) << level_shift(level);
    m -= above;
    __syncthreads();
  }
  return {prefix, m};
}

template <class Src, class Out>
__global__ void __launch_bounds__(kBlock) topk_one_cta(Src src, Out out, long long n, long long m, Th* th_out) {
  __shared__ unsigned hist[kBins];
  __shared__ Scan::TempStorage tmp;
  const long long r = blockIdx.x;
  const Th th = block_threshold(src, r, n, m, hist, tmp);
  if (th_out != nullptr && threadIdx.x == 0) th_out[r] = th;
  if (m > 0) block_collect(src, out, r, 0, n, th, 0, 0, tmp);
}

// -------------------------------------------------------------- several CTAs per row

__global__ void mc_init(RowState* st, unsigned* hist, long long rows, long long m) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < rows * kBins; i += gridDim.x * blockDim.x) {
    hist[i] = 0;
    if (i < rows) st[i] = {0u, 0u, m};
  }
}

template <class Src>
__global__ void __launch_bounds__(kBlock) mc_hist(Src src, long long n, long long chunk, int level, const RowState* st,
                                                  unsigned* ghist) {
  __shared__ unsigned hist[kBins];
  const long long r = blockIdx.y, b = blockIdx.x * chunk, e = b + chunk < n ? b + chunk : n;
  for (int j = threadIdx.x; j < kBins; j += kBlock) hist[j] = 0;
  __syncthreads();
  const RowState s = st[r];
  if (s.m > 0 && s.m < n) block_hist(src, r, b, e, s.prefix, s.mask, level, hist);
  __syncthreads();
  for (int j = threadIdx.x; j < level_bins(level); j += kBlock)
    if (hist[j] != 0) atomicAdd(&ghist[r * kBins + j], hist[j]);
}

__global__ void __launch_bounds__(kBlock) mc_choose(long long n, int level, RowState* st, unsigned* ghist, Th* th) {
  __shared__ Scan::TempStorage tmp;
  __shared__ int bin;
  __shared__ long long above;
  const long long r = blockIdx.x;
  RowState s = st[r];
  unsigned* hist = ghist + r * kBins;
  if (s.m <= 0 || s.m >= n) {
    if (threadIdx.x == 0 && level == kLevels - 1) th[r] = s.m <= 0 ? Th{kForcedKey, 0} : Th{0u, 0};
    return;
  }
  choose_bin(hist, level_bins(level), s.m, tmp, &bin, &above);
  for (int j = threadIdx.x; j < kBins; j += kBlock) hist[j] = 0;  // ready for the next level
  if (threadIdx.x == 0) {
    s.prefix |= std::uint32_t(bin) << level_shift(level);
    s.mask |= std::uint32_t(level_bins(level) - 1) << level_shift(level);
    s.m -= above;
    st[r] = s;
    if (level == kLevels - 1) th[r] = {s.prefix, s.m};
  }
}

template <class Src>
__global__ void __launch_bounds__(kBlock) mc_count(Src src, long long n, long long chunk, const Th* th, long long* gt,
                                                   long long* eq) {
  __shared__ typename cub::BlockReduce<long long, kBlock>::TempStorage tmp;
  const long long r = blockIdx.y, b = blockIdx.x * chunk, e = b + chunk < n ? b + chunk : n;
  const Th t = th[r];
  long long g = 0, q = 0;
  for_each_key(src, r, b, e, [&](std::uint32_t k) {
    g += k > t.key;
    q += k == t.key;
  });
  const long long G = cub::BlockReduce<long long, kBlock>(tmp).Sum(g);
  __syncthreads();
  const long long Q = cub::BlockReduce<long long, kBlock>(tmp).Sum(q);
  if (threadIdx.x == 0) {
    gt[r * kMaxCtasPerRow + blockIdx.x] = G;
    eq[r * kMaxCtasPerRow + blockIdx.x] = Q;
  }
}

/// Per row, in chunk order: equal keys before each chunk, and its first output rank.
__global__ void mc_scan(long long ctas, const Th* th, long long* gt, long long* eq) {
  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= gridDim.x * blockDim.x) return;
  long long* g = gt + r * kMaxCtasPerRow;
  long long* q = eq + r * kMaxCtasPerRow;
  long long eq_before = 0, out_before = 0;
  for (long long c = 0; c < ctas; ++c) {
    const long long G = g[c], Q = q[c];
    const long long need = th[r].need_eq - eq_before;
    const long long take_eq = need <= 0 ? 0 : (need < Q ? need : Q);
    g[c] = out_before;  // becomes the first output rank of chunk c
    q[c] = eq_before;   // becomes the equal keys before chunk c
    out_before += G + take_eq;
    eq_before += Q;
  }
}

template <class Src, class Out>
__global__ void __launch_bounds__(kBlock) mc_write(Src src, Out out, long long n, long long chunk, const Th* th,
                                                   const long long* out_before, const long long* eq_before) {
  __shared__ Scan::TempStorage tmp;
  const long long r = blockIdx.y, b = blockIdx.x * chunk, e = b + chunk < n ? b + chunk : n;
  const long long cell = r * kMaxCtasPerRow + blockIdx.x;
  if (th[r].key == kForcedKey && th[r].need_eq == 0) return;  // nothing selected
  block_collect(src, out, r, b, e, th[r], eq_before[cell], out_before[cell], tmp);
}

// -------------------------------------------------------------- driver

struct TopkWork {
  Th* th = nullptr;
  RowState* st = nullptr;
  unsigned* hist = nullptr;
  long long* gt = nullptr;
  long long* eq = nullptr;
};

TopkWork carve_topk(Carver& c, long long rows) {
  TopkWork w;
  w.th = c.take<Th>(std::size_t(rows));
  w.st = c.take<RowState>(std::size_t(rows));
  w.hist = c.take<unsigned>(std::size_t(rows) * kBins);
  w.gt = c.take<long long>(std::size_t(rows) * kMaxCtasPerRow);
  w.eq = c.take<long long>(std::size_t(rows) * kMaxCtasPerRow);
  return w;
}

int sm_count() {
  int dev = 0, sms = 0;
  KVSCORE_CUDA_CHECK(cudaGetDevice(&dev));
  KVSCORE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

/// Top m of each of `rows` rows of n keys, kept elements emitted in ascending order.
template <class Src, class Out>
void topk(const Src& src, const Out& out, long long rows, long long n, long long m, TopkPath path,
          const TopkWork& w, cudaStream_t st) {
  if (rows == 0 || n == 0) return;
  const int sms = sm_count();
  if (path == TopkPath::automatic)
    path = (rows >= sms || n < 65536) ? TopkPath::one_cta_per_row : TopkPath::multi_cta_per_row;
  if (rows > 65535) path = TopkPath::one_cta_per_row;  // grid.y of the multi-CTA kernels
  if (path == TopkPath::one_cta_per_row) {
    topk_one_cta<<<grid_dim(rows), kBlock, 0, st>>>(src, out, n, m, w.th);
    KVSCORE_CUDA_LAUNCHED();
    return;
  }
  // Chunks: enough CTAs to fill the GPU about four times, at least 4096 keys each.
  long long ctas = std::max<long long>(1, (4LL * sms + rows - 1) / rows);
  ctas = std::min<long long>({ctas, kMaxCtasPerRow, (n + 4095) / 4096});
  ctas = std::max<long long>(ctas, (n + (1LL << 30) - 1) >> 30);  // never more than 2^30 keys per CTA
  const long long chunk = (n + ctas - 1) / ctas;
  ctas = (n + chunk - 1) / chunk;
  mc_init<<<grid_dim(std::min<long long>((rows * kBins + 255) / 256, 4096)), 256, 0, st>>>(w.st, w.hist, rows, m);
  KVSCORE_CUDA_LAUNCHED();
  const dim3 grid(grid_dim(ctas), grid_dim(rows));
  for (int level = 0; level < kLevels; ++level) {
    mc_hist<<<grid, kBlock, 0, st>>>(src, n, chunk, level, w.st, w.hist);
    KVSCORE_CUDA_LAUNCHED();
    mc_choose<<<grid_dim(rows), kBlock, 0, st>>>(n, level, w.st, w.hist, w.th);
    KVSCORE_CUDA_LAUNCHED();
  }
  if (m <= 0) return;
  mc_count<<<grid, kBlock, 0, st>>>(src, n, chunk, w.th, w.gt, w.eq);
  KVSCORE_CUDA_LAUNCHED();
  mc_scan<<<grid_dim(rows), 1, 0, st>>>(ctas, w.th, w.gt, w.eq);
  KVSCORE_CUDA_LAUNCHED();
  mc_write<<<grid, kBlock, 0, st>>>(src, out, n, chunk, w.th, w.gt, w.eq);
  KVSCORE_CUDA_LAUNCHED();
}

// -------------------------------------------------------------- selector kernels

/// Protected positions of every head: [0, s0) at the front, [e0, N) at the back of its row.
__global__ void write_protected(long long* pos, long long n_keep, long long s0, long long e0, long long N) {
  const long long h = blockIdx.y;
  for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < s0 + (N - e0); j += gridDim.x * blockDim.x) {
    const long long t = j < s0 ? j : e0 + (j - s0);
    const long long slot = j < s0 ? j : n_keep - (N - e0) + (j - s0);
    pos[h * n_keep + slot] = t;
  }
}

__global__ void write_offsets_uniform(long long* off, long long heads, long long n) {
  for (long long h = (long long)blockIdx.x * blockDim.x + threadIdx.x; h <= heads; h += gridDim.x * blockDim.x)
    off[h] = h * n;
}

/// AdaKV's z-score parameters of every row r (normalize): the CPU's znorm_params bit for bit —
/// eight interleaved fp64 sums (lane i % 8 over the finite x[i], in order), added as
/// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); squares rounded on their own (no FMA);
/// sd = sqrt(sum / c), inv = 1 / sd (0 for sd = 0). One warp per row, lanes 0..7 sum.
__global__ void znorm_params(const float* x, long long hs, long long N, double* mean, double* inv) {
  const long long r = blockIdx.x;
  const int lane = threadIdx.x;
  const float* row = x + r * hs;
  double acc = 0.0;
  long long c = 0;
  if (lane < 8)
    for (long long i = lane; i < N; i += 8) {
      const float v = row[i];
      if (isfinite(v)) {
        acc = __dadd_rn(acc, double(v));
        ++c;
      }
    }
  __shared__ double l[8];
  __shared__ long long cs[8];
  if (lane < 8) {
    l[lane] = acc;
    cs[lane] = c;
  }
  __syncthreads();
  const long long count = cs[0] + cs[1] + cs[2] + cs[3] + cs[4] + cs[5] + cs[6] + cs[7];
  const double mu = count > 0 ? __ddiv_rn(__dadd_rn(__dadd_rn(__dadd_rn(l[0], l[1]), __dadd_rn(l[2], l[3])),
                                                     __dadd_rn(__dadd_rn(l[4], l[5]), __dadd_rn(l[6], l[7]))),
                                          double(count))
                              : 0.0;
  __syncthreads();
  acc = 0.0;
  if (lane < 8)
    for (long long i = lane; i < N; i += 8) {
      const float v = row[i];
      if (isfinite(v)) {
        const double d = __dsub_rn(double(v), mu);
        acc = __dadd_rn(acc, __dmul_rn(d, d));
      }
    }
  if (lane < 8) l[lane] = acc;
  __syncthreads();
  if (lane == 0) {
    const double sq = __dadd_rn(__dadd_rn(__dadd_rn(l[0], l[1]), __dadd_rn(l[2], l[3])),
                                __dadd_rn(__dadd_rn(l[4], l[5]), __dadd_rn(l[6], l[7])));
    const double sd = count > 0 ? __dsqrt_rn(__ddiv_rn(sq, double(count))) : 0.0;
    mean[r] = mu;
    inv[r] = sd > 0 ? __ddiv_rn(1.0, sd) : 0.0;
  }
}

/// Z[b*H*N + t*H + h] = forced for protected positions, else key(score) of row b*H + h, or of its
/// z-score float((double(x) - mean) * inv) when `mean` is given (non-finite scores keep their own key).
__global__ void fill_z(const float* x, long long hs, long long B, long long H, long long N, long long s0, long long e0,
                       const double* mean, const double* inv, std::uint32_t* z) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // b*H*N + t*H + h
  if (i >= B * H * N) return;
  const long long b = i / (H * N), t = (i % (H * N)) / H, h = i % H, r = b * H + h;
  if (t < s0 || t >= e0) {
    z[i] = kForcedKey;
    return;
  }
  const float v = x[r * hs + t];
  z[i] = (mean != nullptr && isfinite(v))
             ? key_of_bits(__float_as_uint(__double2float_rn(__dmul_rn(__dsub_rn(double(v), mean[r]), inv[r]))))
             : key_of_bits(__float_as_uint(v));
}

__global__ void __launch_bounds__(kBlock) count_kept(const unsigned char* keep, long long H, long long N,
                                                     long long* cnt) {
  __shared__ typename cub::BlockReduce<long long, kBlock>::TempStorage tmp;
  const long long r = blockIdx.x, b = r / H, h = r % H;  // row b*H + h
  long long c = 0;
  for (long long t = threadIdx.x; t < N; t += kBlock) c += keep[b * H * N + t * H + h];
  const long long s = cub::BlockReduce<long long, kBlock>(tmp).Sum(c);
  if (threadIdx.x == 0) cnt[r] = s;
}

__global__ void offsets_from_counts(const long long* cnt, long long rows, long long* off) {
  long long s = 0;
  off[0] = 0;
  for (long long r = 0; r < rows; ++r) off[r + 1] = (s += cnt[r]);
}

template <class Src, class Out>
__global__ void __launch_bounds__(kBlock) collect_rows(Src src, Out out, long long n, Th th) {
  __shared__ Scan::TempStorage tmp;
  block_collect(src, out, blockIdx.x, 0, n, th, 0, 0, tmp);
}

struct SelectWork {
  TopkWork tk;
  std::uint32_t* z = nullptr;
  unsigned char* keep = nullptr;
  long long* cnt = nullptr;
  long long* off = nullptr;
  double* mean = nullptr;
  double* inv = nullptr;
};

SelectWork carve_select(Carver& c, const SelectPlan& p) {
  const long long rows = p.batch * p.heads;
  SelectWork w;
  w.tk = carve_topk(c, std::max<long long>(rows, 1));
  w.off = c.take<long long>(std::size_t(rows + 1));
  if (p.adakv) {
    w.z = c.take<std::uint32_t>(std::size_t(rows * p.tokens));
    w.keep = c.take<unsigned char>(std::size_t(rows * p.tokens));
    w.cnt = c.take<long long>(std::size_t(rows));
    if (p.normalize) {
      w.mean = c.take<double>(std::size_t(rows));
      w.inv = c.take<double>(std::size_t(rows));
    }
  }
  return w;
}

}  // namespace

std::size_t select_workspace_bytes(const SelectPlan& p) noexcept {
  Carver c;
  carve_select(c, p);
  return c.bytes();
}

void select_into(const float* scores, const SelectPlan& p, Workspace ws, std::int64_t* offsets,
                 std::int64_t* positions, stream_t stream) {
  require_no_pending_error("kvscore::cuda::select_into");
  require_device_pointer(scores, "scores");
  require_device_pointer(offsets, "offsets");
  require_device_pointer(positions, "positions");
  require_workspace(ws, select_workspace_bytes(p), "kvscore::cuda::select_into");
  if (p.heads * p.tokens >= (1LL << 32))
    throw std::invalid_argument("kvscore::cuda::select_into: heads x tokens = " + std::to_string(p.heads * p.tokens) +
                                " exceeds 2^32 - 1 keys (the histogram counters are 32-bit)");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  Carver c(ws.data);
  const SelectWork w = carve_select(c, p);
  long long* off = reinterpret_cast<long long*>(offsets);
  long long* pos = reinterpret_cast<long long*>(positions);
  // B layers of H rows each (batch rows): per-head selection treats all B*H rows alike; AdaKV's
  // global step runs once per layer.
  const long long B = p.batch, H = p.heads, R = B * H, N = p.tokens, s0 = p.sink_end, e0 = p.recent_begin,
                  L = e0 - s0;
  if (!p.adakv) {
    if (off != nullptr) {
      write_offsets_uniform<<<grid_dim((R + 256) / 256), 256, 0, st>>>(off, R, p.per_head);
      KVSCORE_CUDA_LAUNCHED();
    }
    if (R == 0 || p.per_head == 0) return;
    if (p.protect > 0) {
      write_protected<<<dim3(grid_dim((p.protect + 255) / 256), grid_dim(R)), 256, 0, st>>>(pos, p.per_head, s0, e0, N);
      KVSCORE_CUDA_LAUNCHED();
    }
    const long long m = p.per_head - p.protect;
    if (m > 0 && L > 0)
      topk(ScoreSrc{scores, p.score_head_stride, s0}, PosOut{pos, p.per_head, nullptr, s0, s0}, R, L, m, p.path,
           w.tk, st);
    return;
  }
  // AdaKV
  if (R == 0) {
    KVSCORE_CUDA_CHECK(cudaMemsetAsync(off, 0, sizeof(long long), st));
    return;
  }
  if (p.layer == 0) {
    KVSCORE_CUDA_CHECK(cudaMemsetAsync(off, 0, std::size_t(R + 1) * sizeof(long long), st));
    return;
  }
  // 1. keys of the global step (z-scores with normalize), protected tokens forced; 2. the safeguard forced.
  if (p.normalize) {
    znorm_params<<<grid_dim(R), 32, 0, st>>>(scores, p.score_head_stride, N, w.mean, w.inv);
    KVSCORE_CUDA_LAUNCHED();
  }
  fill_z<<<grid_dim((R * N + 255) / 256), 256, 0, st>>>(scores, p.score_head_stride, B, H, N, s0, e0, w.mean, w.inv,
                                                          w.z);
  KVSCORE_CUDA_LAUNCHED();
  const long long ms = p.guaranteed - p.protect;
  if (ms > 0 && L > 0)
    topk(ScoreSrc{scores, p.score_head_stride, s0}, ForceOut{w.z, H, N, s0}, R, L, ms, p.path, w.tk, st);
  // 3. per layer, one global top-B over its position-major keys (ties: lower position, then lower head).
  KVSCORE_CUDA_CHECK(cudaMemsetAsync(w.keep, 0, std::size_t(R * N), st));
  topk(ZSrc{w.z, H * N}, MaskOut{w.keep, H * N}, B, H * N, p.layer, p.path, w.tk, st);
  // 4. per head: counts, offsets, positions in ascending order.
  count_kept<<<grid_dim(R), kBlock, 0, st>>>(w.keep, H, N, w.cnt);
  KVSCORE_CUDA_LAUNCHED();
  offsets_from_counts<<<1, 1, 0, st>>>(w.cnt, R, off);
  KVSCORE_CUDA_LAUNCHED();
  collect_rows<<<grid_dim(R), kBlock, 0, st>>>(MaskSrc{w.keep, H, N}, PosOut{pos, 0, off, 0, 0}, N, Th{1u, 0});
  KVSCORE_CUDA_LAUNCHED();
}

}  // namespace kvscore::cuda::detail
