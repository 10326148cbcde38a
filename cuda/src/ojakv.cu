// cuda/src/ojakv.cu — OjaKV on the GPU (kvscore/cuda/ojakv.hpp): projection, reconstruction,
// the full-rank residual score and the pooled covariance of the batched Oja update.
//
// All heads of a layer per launch (grid.y or grid.z = head). Plain kernels, no cuBLAS (the
// library links cudart only); sizes are small (d <= 256 typical, r <= d). Every sum runs in a
// fixed order that depends on the shape only: results are bit-identical across runs.
//  * project / reconstruct: a tile of TT tokens in shared memory, one thread per output,
//    fp64 accumulation (a product of two fp32 values is exact in fp64), rounded to fp32.
//  * residual: per tile of TT tokens the augmented row [k, −Uᵀk] (fp64, shared), dotted with
//    [q, Uᵀq] of every window query of the group: q·k − (Uᵀq)·(Uᵀk) = q·(k − UUᵀk).
//  * covariance: validity per token, pooled-window counts per head, partial XᵀX per (part of
//    pooled rows, 32×32 tile of C), then the parts added in order and divided by m.
#include "common.cuh"

#include <algorithm>
#include <cfloat>
#include <cmath>

#define KVSCORE_CUDA_OJAKV_DECLARATIONS_ONLY  // the entry points only: no Eigen through nvcc
#include "kvscore/cuda/ojakv.hpp"

namespace kvscore::cuda::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 32;   // covariance: C tile edge
constexpr int kRowBatch = 8;  // covariance: pooled rows staged per step
constexpr long long kPartMinRows = 256, kMaxParts = 64;

template <dtype D>
struct Rows {
  const typename Storage<D>::type* p;
  long long hs, ts, N, d;
  __device__ __forceinline__ float at(long long h, long long t, long long j) const {
    return widen<D>(p[h * hs + t * ts + j]);
  }
};

template <dtype D>
Rows<D> rows_of(const KeysArg& a) {
  return {static_cast<const typename Storage<D>::type*>(a.data), a.head_stride, a.token_stride, a.tokens, a.head_dim};
}

/// Largest power of two <= 32 tokens whose tile fits `budget` bytes (at least 1).
int tile_tokens(long long bytes_per_token, long long budget) {
  int tt = 32;
  while (tt > 1 && tt * bytes_per_token > budget) tt /= 2;
  return tt;
}

/// CPU rule (oja::widen_row): fp64 sum of squares in dimension order, finite and <= FLT_MAX.
__device__ __forceinline__ bool row_ok(double s) { return isfinite(s) && s <= double(FLT_MAX); }

// ------------------------------------------------------------------ projection / reconstruction

template <dtype D>
__global__ void __launch_bounds__(kThreads) project_kernel(Rows<D> k, const float* __restrict__ U, long long r,
                                                            int TT, float* codes, long long chs, long long cts) {
  extern __shared__ float kt[];  // [TT][d]
  const long long h = blockIdx.y, t0 = (long long)blockIdx.x * TT, d = k.d;
  for (long long idx = threadIdx.x; idx < TT * d; idx += kThreads) {
    const long long t = t0 + idx / d;
    kt[idx] = t < k.N ? k.at(h, t, idx % d) : 0.f;
  }
  __syncthreads();
  const float* u = U + h * d * r;
  for (long long idx = threadIdx.x; idx < TT * r; idx += kThreads) {
    const long long tl = idx / r, i = idx % r, t = t0 + tl;
    if (t >= k.N) continue;
    double acc = 0.0;
    for (long long j = 0; j < d; ++j) acc = fma(double(kt[tl * d + j]), double(u[j * r + i]), acc);
    codes[h * chs + t * cts + i] = float(acc);
  }
}

__global__ void __launch_bounds__(kThreads) reconstruct_kernel(Rows<dtype::f32> c, const float* __restrict__ U,
                                                                long long d, int TT, float* out, long long ohs,
                                                                long long ots) {
  extern __shared__ float ct[];  // [TT][r]
  const long long h = blockIdx.y, t0 = (long long)blockIdx.x * TT, r = c.d;
  for (long long idx = threadIdx.x; idx < TT * r; idx += kThreads) {
    const long long t = t0 + idx / r;
    ct[idx] = t < c.N ? c.at(h, t, idx % r) : 0.f;
  }
  __syncthreads();
  const float* u = U + h * d * r;
  for (long long idx = threadIdx.x; idx < TT * d; idx += kThreads) {
    const long long tl = idx / d, j = idx % d, t = t0 + tl;
    if (t >= c.N) continue;
    double acc = 0.0;
    for (long long i = 0; i < r; ++i) acc = fma(double(ct[tl * r + i]), double(u[j * r + i]), acc);
    out[h * ohs + t * ots + j] = float(acc);
  }
}

// ------------------------------------------------------------------ residual score

struct ResidualArgs {
  long long d, r, L, Lp, G, w, GW, P;
  int TT;
  double inv_sqrt_d;
  const double* U;  // [H][d][r]
  const double* A;  // [q_heads][w][L] = [q, Uᵀq]
  float* out;
  long long ohs;
};

template <dtype D>
__global__ void __launch_bounds__(kThreads) residual_kernel(Rows<D> k, ResidualArgs a) {
  extern __shared__ double sm[];  // kt [TT][Lp] (odd stride: no bank conflicts), red [kThreads]
  __shared__ int ok[32];
  double* kt = sm;
  double* red = sm + a.TT * a.Lp;
  const int TT = a.TT, tid = threadIdx.x;
  const long long h = blockIdx.y, t0 = (long long)blockIdx.x * TT;
  for (long long idx = tid; idx < TT * a.d; idx += kThreads) {
    const long long tl = idx / a.d, t = t0 + tl;
    kt[tl * a.Lp + idx % a.d] = t < k.N ? double(k.at(h, t, idx % a.d)) : 0.0;
  }
  __syncthreads();
  if (tid < TT) {
    double s = 0.0;
    for (long long j = 0; j < a.d; ++j) s += kt[tid * a.Lp + j] * kt[tid * a.Lp + j];
    ok[tid] = (t0 + tid < k.N && row_ok(s)) ? 1 : 0;
  }
  __syncthreads();
  for (long long idx = tid; idx < TT * a.d; idx += kThreads)  // invalid rows as zeros (the CPU does the same)
    if (!ok[idx / a.d]) kt[(idx / a.d) * a.Lp + idx % a.d] = 0.0;
  __syncthreads();
  const double* u = a.U + h * a.d * a.r;
  for (long long idx = tid; idx < TT * a.r; idx += kThreads) {
    const long long tl = idx / a.r, i = idx % a.r;
    double c = 0.0;
    for (long long j = 0; j < a.d; ++j) c = fma(kt[tl * a.Lp + j], u[j * a.r + i], c);
    kt[tl * a.Lp + a.d + i] = -c;
  }
  __syncthreads();
  const int tl = tid % TT, grp = tid / TT, NG = kThreads / TT;
  const long long t = t0 + tl;
  const long long first_q = t - a.P > 0 ? t - a.P : 0;  // query i sees t iff P + i >= t
  const double* A = a.A + h * a.GW * a.L;               // the group's queries, rows g*w + i
  const double* krow = kt + tl * a.Lp;
  double sum = 0.0;
  for (long long q0 = 4LL * grp; q0 < a.GW; q0 += 4LL * NG) {  // 4 queries per pass: one shared read each
    const double* p[4];
    double s[4] = {0.0, 0.0, 0.0, 0.0};
#pragma unroll
    for (int v = 0; v < 4; ++v) p[v] = A + (q0 + v < a.GW ? q0 + v : q0) * a.L;
    for (long long l = 0; l < a.L; ++l) {
      const double x = krow[l];
#pragma unroll
      for (int v = 0; v < 4; ++v) s[v] = fma(x, p[v][l], s[v]);
    }
#pragma unroll
    for (int v = 0; v < 4; ++v)
      if (q0 + v < a.GW && (q0 + v) % a.w >= first_q) sum += fabs(s[v]);
  }
  red[tid] = sum;
  __syncthreads();
  if (tid < TT && t < k.N) {
    double tot = 0.0;
    for (int g = 0; g < NG; ++g) tot += red[g * TT + tid];  // groups in order: deterministic
    const long long cnt = a.G * (a.w - first_q);
    a.out[h * a.ohs + t] = ok[tid] ? float(tot / double(cnt) * a.inv_sqrt_d) : kNegInf;
  }
}

struct ResidualWork {
  double* U = nullptr;
  double* A = nullptr;
};

ResidualWork residual_carve(Carver& c, long long H, long long d, long long r, long long q_heads, long long w) {
  ResidualWork k;
  k.U = c.take<double>(std::size_t(H * d * r));
  k.A = c.take<double>(std::size_t(q_heads * w * (d + r)));
  return k;
}

// ------------------------------------------------------------------ pooled covariance

struct CovLayout {
  unsigned char* valid = nullptr;  // [H][N]
  long long* pooled = nullptr;     // [H]
  double* part = nullptr;          // [H][parts][d][d]
  long long M = 0, rpp = 1, parts = 1, tiles = 1;
};

CovLayout cov_carve(Carver& c, long long H, long long N, long long d, long long pool) {
  CovLayout l;
  l.M = (N + pool - 1) / pool;
  l.rpp = std::max<long long>(kPartMinRows, (l.M + kMaxParts - 1) / kMaxParts);
  l.parts = std::max<long long>(1, (l.M + l.rpp - 1) / l.rpp);
  l.tiles = (d + kTile - 1) / kTile;
  l.valid = c.take<unsigned char>(std::size_t(H * N));
  l.pooled = c.take<long long>(std::size_t(H));
  l.part = c.take<double>(std::size_t(H * l.parts * d * d));
  return l;
}

template <dtype D>
__global__ void __launch_bounds__(kThreads) cov_valid(Rows<D> k, CovLayout l) {
  const long long h = blockIdx.y, t = (long long)blockIdx.x * kThreads + threadIdx.x;
  if (t >= k.N) return;
  double s = 0.0;
  for (long long j = 0; j < k.d; ++j) {
    const double x = k.at(h, t, j);
    s += x * x;
  }
  l.valid[h * k.N + t] = row_ok(s) ? 1 : 0;
}

__global__ void __launch_bounds__(kThreads) cov_counts(long long N, long long pool, CovLayout l,
                                                        std::int64_t* valid_out, std::int64_t* pooled_out) {
  __shared__ long long rv[kThreads], rp[kThreads];
  const long long h = blockIdx.x;
  const unsigned char* ok = l.valid + h * N;
  long long v = 0, p = 0;
  for (long long m = threadIdx.x; m < l.M; m += kThreads) {
    long long c = 0;
    for (long long t = m * pool; t < N && t < (m + 1) * pool; ++t) c += ok[t];
    v += c;
    p += c > 0 ? 1 : 0;
  }
  rv[threadIdx.x] = v;
  rp[threadIdx.x] = p;
  __syncthreads();
  for (int o = kThreads / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) {
      rv[threadIdx.x] += rv[threadIdx.x + o];
      rp[threadIdx.x] += rp[threadIdx.x + o];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    l.pooled[h] = rp[0];
    if (valid_out != nullptr) valid_out[h] = rv[0];
    if (pooled_out != nullptr) pooled_out[h] = rp[0];
  }
}

/// Block (part, tile (ta, tb), head): Σ over the part's pooled rows of x[a]·x[b], rows in order.
/// (b, a) is the same products in the same order as (a, b): C comes out exactly symmetric.
template <dtype D>
__global__ void __launch_bounds__(kThreads) cov_partial(Rows<D> k, long long pool, CovLayout l) {
  __shared__ double xa[kRowBatch][kTile], xb[kRowBatch][kTile];
  const long long part = blockIdx.x, h = blockIdx.z, d = k.d;
  const long long a0 = (long long)(blockIdx.y / l.tiles) * kTile, b0 = (long long)(blockIdx.y % l.tiles) * kTile;
  const int tid = threadIdx.x, tx = tid % kTile, ty = tid / kTile;  // 32 x 8: 4 rows of the tile each
  const unsigned char* ok = l.valid + h * k.N;
  const long long mb = part * l.rpp, me = mb + l.rpp < l.M ? mb + l.rpp : l.M;
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  for (long long m0 = mb; m0 < me; m0 += kRowBatch) {
    __syncthreads();
    for (int idx = tid; idx < kRowBatch * 2 * kTile; idx += kThreads) {
      const int r = idx / (2 * kTile), side = (idx / kTile) % 2, j = idx % kTile;
      const long long m = m0 + r, col = (side ? b0 : a0) + j;
      double x = 0.0;
      if (m < me && col < d) {  // the CPU's pooled mean: valid rows summed in token order, / count
        double s = 0.0;
        long long c = 0;
        for (long long t = m * pool; t < k.N && t < (m + 1) * pool; ++t)
          if (ok[t]) {
            s += double(k.at(h, t, col));
            ++c;
          }
        x = c > 0 ? s / double(c) : 0.0;  // an empty window adds exact zeros
      }
      (side ? xb : xa)[r][j] = x;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRowBatch; ++r) {
      const double y = xb[r][tx];
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[q] = fma(xa[r][ty + 8 * q], y, acc[q]);
    }
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const long long a = a0 + ty + 8 * q, b = b0 + tx;
    if (a < d && b < d) l.part[((h * l.parts + part) * d + a) * d + b] = acc[q];
  }
}

__global__ void __launch_bounds__(kThreads) cov_finalize(long long d, CovLayout l, double* cov) {
  const long long h = blockIdx.y, idx = (long long)blockIdx.x * kThreads + threadIdx.x;
  if (idx >= d * d) return;
  double s = 0.0;
  for (long long p = 0; p < l.parts; ++p) s += l.part[(h * l.parts + p) * d * d + idx];
  const long long m = l.pooled[h];
  cov[h * d * d + idx] = m > 0 ? s / double(m) : s;  // as PooledCovariance::finish
}

// ------------------------------------------------------------------ dispatch

template <dtype D>
void run_project(const KeysArg& a, const float* U, long long r, float* codes, long long chs, long long cts,
                 cudaStream_t st) {
  const int TT = tile_tokens(a.head_dim * 4, 48 * 1024);
  const dim3 grid(grid_dim((a.tokens + TT - 1) / TT), grid_dim(a.heads));
  project_kernel<D><<<grid, kThreads, std::size_t(TT * a.head_dim) * sizeof(float), st>>>(rows_of<D>(a), U, r, TT,
                                                                                           codes, chs, cts);
  KVSCORE_CUDA_LAUNCHED();
}

template <dtype D>
void run_residual(const KeysArg& a, const ScoresArg& out, const double* host_u, const double* host_aug, long long r,
                  long long q_heads, long long w, Workspace ws, cudaStream_t st) {
  const long long H = a.heads, d = a.head_dim;
  Carver c(ws.data);
  const ResidualWork k = residual_carve(c, H, d, r, q_heads, w);
  KVSCORE_CUDA_CHECK(cudaMemcpyAsync(k.U, host_u, std::size_t(H * d * r) * sizeof(double), cudaMemcpyHostToDevice, st));
  KVSCORE_CUDA_CHECK(
      cudaMemcpyAsync(k.A, host_aug, std::size_t(q_heads * w * (d + r)) * sizeof(double), cudaMemcpyHostToDevice, st));
  ResidualArgs g;
  g.d = d;
  g.r = r;
  g.L = d + r;
  g.Lp = g.L | 1;
  g.G = q_heads / H;
  g.w = w;
  g.GW = g.G * w;
  g.P = a.tokens - w;
  g.TT = tile_tokens(g.Lp * 8, 96 * 1024);
  g.inv_sqrt_d = 1.0 / std::sqrt(double(d));  // the CPU's constant, computed on the host
  g.U = k.U;
  g.A = k.A;
  g.out = out.data;
  g.ohs = out.head_stride;
  const std::size_t smem = std::size_t(g.TT * g.Lp + kThreads) * sizeof(double);
  if (smem > 48 * 1024)
    KVSCORE_CUDA_CHECK(cudaFuncSetAttribute(residual_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(grid_dim((a.tokens + g.TT - 1) / g.TT), grid_dim(H));
  residual_kernel<D><<<grid, kThreads, smem, st>>>(rows_of<D>(a), g);
  KVSCORE_CUDA_LAUNCHED();
}

template <dtype D>
void run_covariance(const KeysArg& a, long long pool, Workspace ws, double* cov, std::int64_t* valid,
                    std::int64_t* pooled, cudaStream_t st) {
  const long long H = a.heads, N = a.tokens, d = a.head_dim;
  Carver c(ws.data);
  const CovLayout l = cov_carve(c, H, N, d, pool);
  const Rows<D> k = rows_of<D>(a);
  cov_valid<D><<<dim3(grid_dim((N + kThreads - 1) / kThreads), grid_dim(H)), kThreads, 0, st>>>(k, l);
  KVSCORE_CUDA_LAUNCHED();
  cov_counts<<<grid_dim(H), kThreads, 0, st>>>(N, pool, l, valid, pooled);
  KVSCORE_CUDA_LAUNCHED();
  cov_partial<D><<<dim3(grid_dim(l.parts), grid_dim(l.tiles * l.tiles), grid_dim(H)), kThreads, 0, st>>>(k, pool, l);
  KVSCORE_CUDA_LAUNCHED();
  cov_finalize<<<dim3(grid_dim((d * d + kThreads - 1) / kThreads), grid_dim(H)), kThreads, 0, st>>>(d, l, cov);
  KVSCORE_CUDA_LAUNCHED();
}

}  // namespace

void oja_project(const KeysArg& keys, const float* bases, std::int64_t rank, float* codes, std::int64_t codes_hs,
                 std::int64_t codes_ts, stream_t stream) {
  if (keys.heads == 0 || keys.tokens == 0) return;
  require_no_pending_error("kvscore::cuda::project (OjaKV)");
  require_device_pointer(keys.data, "keys");
  require_device_pointer(bases, "bases");
  require_device_pointer(codes, "codes");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  for_dtype(keys.type, [&](auto D) {
    run_project<decltype(D)::value>(keys, bases, rank, codes, codes_hs, codes_ts, st);
  });
}

void oja_reconstruct(const KeysArg& codes, const float* bases, std::int64_t head_dim, float* out, std::int64_t out_hs,
                     std::int64_t out_ts, stream_t stream) {
  if (codes.heads == 0 || codes.tokens == 0) return;
  require_no_pending_error("kvscore::cuda::reconstruct (OjaKV)");
  require_device_pointer(codes.data, "codes");
  require_device_pointer(bases, "bases");
  require_device_pointer(out, "output");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const int TT = tile_tokens(codes.head_dim * 4, 48 * 1024);
  const dim3 grid(grid_dim((codes.tokens + TT - 1) / TT), grid_dim(codes.heads));
  reconstruct_kernel<<<grid, kThreads, std::size_t(TT * codes.head_dim) * sizeof(float), st>>>(
      rows_of<dtype::f32>(codes), bases, head_dim, TT, out, out_hs, out_ts);
  KVSCORE_CUDA_LAUNCHED();
}

std::size_t oja_residual_workspace_bytes(std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
                                         std::int64_t rank, std::int64_t q_heads, std::int64_t window) noexcept {
  if (heads <= 0 || tokens <= 0) return 0;
  Carver c;
  residual_carve(c, heads, head_dim, rank, q_heads, window);
  return c.bytes();
}

void oja_residual_score(const KeysArg& keys, const ScoresArg& out, const double* host_bases, const double* host_aug,
                        std::int64_t rank, std::int64_t q_heads, std::int64_t window, Workspace ws, stream_t stream) {
  if (keys.heads == 0 || keys.tokens == 0) return;
  require_no_pending_error("kvscore::cuda::score (OjaResidual)");
  require_device_pointer(keys.data, "keys");
  require_device_pointer(out.data, "scores");
  require_workspace(ws, oja_residual_workspace_bytes(keys.heads, keys.tokens, keys.head_dim, rank, q_heads, window),
                    "kvscore::cuda::score (OjaResidual)");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  for_dtype(keys.type, [&](auto D) {
    run_residual<decltype(D)::value>(keys, out, host_bases, host_aug, rank, q_heads, window, ws, st);
  });
}

std::size_t oja_covariance_workspace_bytes(std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
                                           std::int64_t pool) noexcept {
  if (heads <= 0 || tokens <= 0 || pool < 1) return 0;
  Carver c;
  cov_carve(c, heads, tokens, head_dim, pool);
  return c.bytes();
}

void oja_covariance(const KeysArg& rows, std::int64_t pool, Workspace ws, double* cov, std::int64_t* valid,
                    std::int64_t* pooled, stream_t stream) {
  if (rows.heads == 0 || rows.tokens == 0) return;
  require_no_pending_error("kvscore::cuda::pooled_covariance_into");
  require_device_pointer(rows.data, "rows");
  require_device_pointer(cov, "cov");
  require_device_pointer(valid, "valid");
  require_device_pointer(pooled, "pooled");
  require_workspace(ws, oja_covariance_workspace_bytes(rows.heads, rows.tokens, rows.head_dim, pool),
                    "kvscore::cuda::pooled_covariance_into");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  for_dtype(rows.type, [&](auto D) { run_covariance<decltype(D)::value>(rows, pool, ws, cov, valid, pooled, st); });
}

}  // namespace kvscore::cuda::detail
