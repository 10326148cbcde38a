// cuda/src/protokv.cu — ProtoKV (kvscore/scorers/protokv.hpp) on the GPU, all KV heads per launch.
//
//  1. prep: one warp per key: fp32 ‖k‖² and q̄·k, validity, fp32 unit row u = float(x · 1/√‖k‖²)
//     (the CPU's fp64 scaling), stored [H][N][d] for the later passes.
//  2. similarity: one warp per key, S(i) = fp64 sum of the fp32 cosines of its valid neighbours in
//     ascending position (the CPU's order) / count.
//  3. candidates: one block per head: p rounds of a block argmin of (S, position) above the last
//     pick; then the pairwise distances and the RFF projections W·u of the picks in fp64, sequential.
//  -- host: σ (lower median), RFF bits, bucket ids, PDT chunks, prototype member lists (one sync).
//  4. prototypes: one block per (head, prototype): fp64 sums over the members in the CPU's order.
//  5. assign: tiled fp32 GEMM (64 tokens x 64 prototypes, k-slabs of 32) + argmax, ties to the
//     lower prototype index (a total order on (cosine desc, index asc), so any reduction order agrees).
//  6. clusters: member counts per (head, part of 256 tokens); parts in order give each part its
//     slots, so every cluster's tokens are listed in position order (stable, no atomics); ψ = fp64
//     sum of q̄·k over that list: the CPU's order, so ψ equals the CPU's wherever q̄·k does.
//  7. order: cluster ranks by (ψ desc, index asc) by counting; rank in cluster by counting
//     (q̄·k desc, position asc); score = M - (first rank of the cluster + rank in cluster).
// The fp64 products/sums that mirror the CPU use __dmul_rn/__dadd_rn (never contracted to FMA).
// Fixed partitions and in-order sums, no atomics: bit-identical across runs.
#define KVSCORE_CUDA_PROTOKV_DETAIL_ONLY
#include "kvscore/cuda/protokv.hpp"

#include "common.cuh"

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace kvscore::cuda::detail {
namespace {

constexpr int kWarpThreads = 256;  // 8 warps, one key each
constexpr int kCandThreads = 512;
constexpr int kProtoThreads = 128;
constexpr int kBM = 64, kBN = 64, kBK = 32, kGemmThreads = 256;
constexpr long long kPart = 256;   // tokens per ψ part
constexpr int kPartThreads = 128;
constexpr int kOrderThreads = 512;

struct Sizes {
  long long H, N, d, pcap, pairs, r, Pcap, parts;
};

Sizes sizes_of(std::int64_t H, std::int64_t N, std::int64_t d, std::int64_t sat, int r, std::int64_t chunks) {
  Sizes z;
  z.H = H;
  z.N = N;
  z.d = d;
  z.pcap = std::max<long long>(0, std::min<long long>(sat, N));
  z.pairs = z.pcap * (z.pcap - 1) / 2;
  z.r = r;
  z.Pcap = std::min<long long>(chunks, N) + std::min<long long>(1ll << r, z.pcap);
  if (z.Pcap < 1) z.Pcap = 1;
  z.parts = (N + kPart - 1) / kPart;
  return z;
}

struct Work {
  float* qbar;            // [H][d]
  double* W;              // [H][r][d]
  float* U;               // [H][N][d]
  float* qk;              // [H][N]
  float* norm;            // [H][N]
  unsigned char* valid;   // [H][N]
  double* S;              // [H][N]
  long long* cand;        // [H][pcap]
  int* ncand;             // [H]
  double* dist;           // [H][pairs]
  double* z;              // [H][pcap][r]
  long long* poff;        // [H][Pcap + 1] member CSR per prototype
  int* members;           // [H][N]
  int* P;                 // [H]
  float* protos;          // [H][Pcap][d]
  int* cl;                // [H][N]
  int* pcnt;              // [H][parts][Pcap]
  double* psi;            // [H][Pcap]
  long long* size;        // [H][Pcap]
  long long* crank;       // [H][Pcap]
  long long* cstart;      // [H][Pcap]
  long long* base;        // [H][Pcap]
  long long* M;           // [H]
  int* bycl;              // [H][N]
};

Work carve(Carver& c, const Sizes& z) {
  const std::size_t H = std::size_t(z.H), N = std::size_t(z.N), d = std::size_t(z.d), Pc = std::size_t(z.Pcap);
  Work w;
  w.qbar = c.take<float>(H * d);
  w.W = c.take<double>(H * std::size_t(z.r) * d);
  w.U = c.take<float>(H * N * d);
  w.qk = c.take<float>(H * N);
  w.norm = c.take<float>(H * N);
  w.valid = c.take<unsigned char>(H * N);
  w.S = c.take<double>(H * N);
  w.cand = c.take<long long>(H * std::size_t(z.pcap));
  w.ncand = c.take<int>(H);
  w.dist = c.take<double>(H * std::size_t(z.pairs));
  w.z = c.take<double>(H * std::size_t(z.pcap) * std::size_t(z.r));
  w.poff = c.take<long long>(H * (Pc + 1));
  w.members = c.take<int>(H * N);
  w.P = c.take<int>(H);
  w.protos = c.take<float>(H * Pc * d);
  w.cl = c.take<int>(H * N);
  w.pcnt = c.take<int>(H * std::size_t(z.parts) * Pc);
  w.psi = c.take<double>(H * Pc);
  w.size = c.take<long long>(H * Pc);
  w.crank = c.take<long long>(H * Pc);
  w.cstart = c.take<long long>(H * Pc);
  w.base = c.take<long long>(H * Pc);
  w.M = c.take<long long>(H);
  w.bycl = c.take<int>(H * N);
  return w;
}

template <dtype D>
struct KeysDev {
  const typename Storage<D>::type* p;
  long long hs, ts;
  __device__ const typename Storage<D>::type* row(long long h, long long t) const { return p + h * hs + t * ts; }
};

// ------------------------------------------------------------------ 1. prep

template <dtype D>
__global__ void __launch_bounds__(kWarpThreads) prep(KeysDev<D> k, Sizes z, Work w) {
  __shared__ float q[256];
  const long long h = blockIdx.y;
  for (long long j = threadIdx.x; j < z.d; j += kWarpThreads) q[j] = w.qbar[h * z.d + j];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const long long t = (long long)blockIdx.x * (kWarpThreads / 32) + (threadIdx.x >> 5);
  if (t >= z.N) return;
  const auto* row = k.row(h, t);
  float sq = 0.f, dot = 0.f;
  for (long long j = lane; j < z.d; j += 32) {
    const float x = widen<D>(row[j]);
    sq = fmaf(x, x, sq);
    dot = fmaf(x, q[j], dot);
  }
  sq = warp_sum(sq);
  dot = warp_sum(dot);
  const long long i = h * z.N + t;
  const bool ok = isfinite(sq);
  const bool unit = ok && sq != 0.f;
  const double nrm = unit ? sqrt(double(sq)) : 0.0, inv = unit ? 1.0 / nrm : 0.0;
  float* u = w.U + i * z.d;
  for (long long j = lane; j < z.d; j += 32) u[j] = unit ? float(__dmul_rn(double(widen<D>(row[j])), inv)) : 0.f;
  if (lane != 0) return;
  w.valid[i] = ok ? 1 : 0;
  w.norm[i] = float(nrm);
  if (!ok) dot = 0.f;
  if (unit && !isfinite(dot)) {  // |q̄|·|k| beyond fp32: the CPU's fp64 redo, clamped
    double s = 0;
    for (long long j = 0; j < z.d; ++j) {
      const double uj = double(float(__dmul_rn(double(widen<D>(row[j])), inv)));
      s = __dadd_rn(s, __dmul_rn(__dmul_rn(uj, nrm), double(q[j])));
    }
    dot = float(fmin(fmax(s, -double(FLT_MAX)), double(FLT_MAX)));
  }
  w.qk[i] = dot;
}

// ------------------------------------------------------------------ 2. similarity

__device__ __forceinline__ float warp_dot(const float* a, const float* b, long long d, int lane) {
  float s = 0.f;
  for (long long j = lane; j < d; j += 32) s = fmaf(a[j], b[j], s);
  return warp_sum(s);
}

__global__ void __launch_bounds__(kWarpThreads) similarity(Sizes z, long long kappa, Work w) {
  const long long h = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const long long t = (long long)blockIdx.x * (kWarpThreads / 32) + (threadIdx.x >> 5);
  if (t >= z.N) return;
  const long long i = h * z.N + t;
  if (!w.valid[i]) {
    if (lane == 0) w.S[i] = __longlong_as_double(0x7ff8000000000000ll);  // NaN
    return;
  }
  const float* ui = w.U + i * z.d;
  const long long lo = t - kappa > 0 ? t - kappa : 0, hi = t + kappa < z.N - 1 ? t + kappa : z.N - 1;
  double s = 0;
  long long cnt = 0;
  for (long long j = lo; j <= hi; ++j) {
    if (j == t || !w.valid[h * z.N + j]) continue;
    s += double(warp_dot(ui, w.U + (h * z.N + j) * z.d, z.d, lane));
    ++cnt;
  }
  if (lane == 0) w.S[i] = cnt > 0 ? s / double(cnt) : 1.0;
}

// ------------------------------------------------------------------ 3. candidates

__device__ __forceinline__ bool less_sp(double s1, long long t1, double s2, long long t2) {
  return s1 != s2 ? s1 < s2 : t1 < t2;
}

__global__ void __launch_bounds__(kCandThreads) candidates(Sizes z, Work w) {
  __shared__ double bs[kCandThreads];
  __shared__ long long bt[kCandThreads];
  __shared__ double last_s;
  __shared__ long long last_t;
  __shared__ int found;
  const long long h = blockIdx.x;
  const int tid = threadIdx.x;
  if (tid == 0) {
    last_s = -__builtin_huge_val();
    last_t = -1;
    found = 0;
  }
  __syncthreads();
  for (long long k = 0; k < z.pcap; ++k) {
    double mys = 0;
    long long myt = -1;
    for (long long t = tid; t < z.N; t += kCandThreads) {
      const long long i = h * z.N + t;
      if (!w.valid[i] || !(w.norm[i] > 0.f)) continue;  // eligible: valid, non-zero
      const double s = w.S[i];
      if (!less_sp(last_s, last_t, s, t)) continue;    // at or before the last pick
      if (myt < 0 || less_sp(s, t, mys, myt)) mys = s, myt = t;
    }
    bs[tid] = mys;
    bt[tid] = myt;
    __syncthreads();
    for (int o = kCandThreads / 2; o > 0; o >>= 1) {
      if (tid < o && bt[tid + o] >= 0 && (bt[tid] < 0 || less_sp(bs[tid + o], bt[tid + o], bs[tid], bt[tid])))
        bs[tid] = bs[tid + o], bt[tid] = bt[tid + o];
      __syncthreads();
    }
    const bool none = bt[0] < 0;
    if (tid == 0 && !none) {
      w.cand[h * z.pcap + k] = bt[0];
      last_s = bs[0];
      last_t = bt[0];
      found = int(k + 1);
    }
    __syncthreads();
    if (none) break;
  }
  const long long p = found;
  if (tid == 0) w.ncand[h] = int(p);
  // Pairwise distances in the CPU's (x < y) order and RFF projections, fp64, j in order.
  for (long long q = tid; q < p * p; q += kCandThreads) {
    const long long x = q / p, y = q % p;
    if (y <= x) continue;
    const float* ux = w.U + (h * z.N + w.cand[h * z.pcap + x]) * z.d;
    const float* uy = w.U + (h * z.N + w.cand[h * z.pcap + y]) * z.d;
    double s = 0;
    for (long long j = 0; j < z.d; ++j) {
      const double df = __dadd_rn(double(ux[j]), -double(uy[j]));
      s = __dadd_rn(s, __dmul_rn(df, df));
    }
    w.dist[h * z.pairs + x * (2 * p - x - 1) / 2 + (y - x - 1)] = sqrt(s);
  }
  for (long long q = tid; q < p * z.r; q += kCandThreads) {
    const long long x = q / z.r, b = q % z.r;
    const float* u = w.U + (h * z.N + w.cand[h * z.pcap + x]) * z.d;
    const double* Wb = w.W + (h * z.r + b) * z.d;
    double s = 0;
    for (long long j = 0; j < z.d; ++j) s = __dadd_rn(s, __dmul_rn(Wb[j], double(u[j])));
    w.z[(h * z.pcap + x) * z.r + b] = s;
  }
}

// ------------------------------------------------------------------ 4. prototypes

__global__ void __launch_bounds__(kProtoThreads) prototypes(Sizes z, Work w) {
  __shared__ double acc[256];
  __shared__ double inv;
  const long long h = blockIdx.y, c = blockIdx.x;
  if (c >= w.P[h]) return;
  const long long* off = w.poff + h * (z.Pcap + 1);
  const int* mem = w.members + h * z.N;
  for (long long j = threadIdx.x; j < z.d; j += kProtoThreads) {
    double a = 0;
    for (long long m = off[c]; m < off[c + 1]; ++m) {
      const long long i = h * z.N + mem[m];
      a = __dadd_rn(a, __dmul_rn(double(w.norm[i]), double(w.U[i * z.d + j])));
    }
    acc[j] = a;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (long long j = 0; j < z.d; ++j) s = __dadd_rn(s, __dmul_rn(acc[j], acc[j]));
    inv = s > 0 ? 1.0 / sqrt(s) : 0.0;
  }
  __syncthreads();
  for (long long j = threadIdx.x; j < z.d; j += kProtoThreads)
    w.protos[(h * z.Pcap + c) * z.d + j] = float(__dmul_rn(acc[j], inv));
}

// ------------------------------------------------------------------ 5. assignment: GEMM + argmax

__device__ __forceinline__ bool better(float v, int c, float bv, int bc) { return v > bv || (v == bv && c < bc); }

__global__ void __launch_bounds__(kGemmThreads) assign(Sizes z, Work w) {
  __shared__ float As[kBK][kBM + 1];
  __shared__ float Bs[kBK][kBN + 1];
  const long long h = blockIdx.y, t0 = (long long)blockIdx.x * kBM;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int P = w.P[h];
  float best[4];
  int bidx[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) best[i] = kNegInf, bidx[i] = INT_MAX;
  const float* U = w.U + h * z.N * z.d;
  const float* Pr = w.protos + h * z.Pcap * z.d;
  for (int c0 = 0; c0 < P; c0 += kBN) {
    float acc[4][4] = {};
    for (long long k0 = 0; k0 < z.d; k0 += kBK) {
      for (int e = tid; e < kBM * kBK; e += kGemmThreads) {
        const int m = e / kBK, kk = e % kBK;
        const long long t = t0 + m, j = k0 + kk;
        As[kk][m] = t < z.N && j < z.d ? U[t * z.d + j] : 0.f;
        const long long c = c0 + m;
        Bs[kk][m] = c < P && j < z.d ? Pr[c * z.d + j] : 0.f;
      }
      __syncthreads();
#pragma unroll 8
      for (int kk = 0; kk < kBK; ++kk) {
        float a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = As[kk][ty * 4 + i], b[i] = Bs[kk][tx + 16 * i];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) acc[i][jj] = fmaf(a[i], b[jj], acc[i][jj]);
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int c = c0 + tx + 16 * jj;
        if (c < P && better(acc[i][jj], c, best[i], bidx[i])) best[i] = acc[i][jj], bidx[i] = c;
      }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    for (int o = 8; o > 0; o >>= 1) {  // the 16 lanes of a row (same half-warp)
      const float v = __shfl_xor_sync(0xffffffffu, best[i], o);
      const int c = __shfl_xor_sync(0xffffffffu, bidx[i], o);
      if (better(v, c, best[i], bidx[i])) best[i] = v, bidx[i] = c;
    }
    const long long t = t0 + ty * 4 + i;
    if (tx == 0 && t < z.N) w.cl[h * z.N + t] = (w.valid[h * z.N + t] && P > 0) ? bidx[i] : -1;
  }
}

// ------------------------------------------------------------------ 6. clusters and ψ

/// Per (head, part of kPart tokens): member count of every cluster.
__global__ void __launch_bounds__(kPartThreads) count_parts(Sizes z, Work w) {
  const long long h = blockIdx.y, part = (long long)blockIdx.x * kPartThreads + threadIdx.x;
  if (part >= z.parts) return;
  int* pc = w.pcnt + (h * z.parts + part) * z.Pcap;
  const int P = w.P[h];
  for (int c = 0; c < P; ++c) pc[c] = 0;
  const long long e = (part + 1) * kPart < z.N ? (part + 1) * kPart : z.N;
  for (long long t = part * kPart; t < e; ++t) {
    const int c = w.cl[h * z.N + t];
    if (c >= 0) ++pc[c];
  }
}

/// Per cluster: its size; pcnt becomes each part's first slot inside the cluster.
__global__ void __launch_bounds__(kPartThreads) count_total(Sizes z, Work w) {
  const long long h = blockIdx.y, c = (long long)blockIdx.x * kPartThreads + threadIdx.x;
  if (c >= w.P[h]) return;
  long long n = 0;
  for (long long part = 0; part < z.parts; ++part) {
    const long long k = (h * z.parts + part) * z.Pcap + c;
    const int m = w.pcnt[k];
    w.pcnt[k] = int(n);
    n += m;
  }
  w.size[h * z.Pcap + c] = n;
}

/// Per head: where each cluster's tokens start in bycl (clusters in index order).
__global__ void cluster_starts(Sizes z, Work w) {
  const long long h = blockIdx.x;
  long long st = 0;
  for (int c = 0; c < w.P[h]; ++c) w.cstart[h * z.Pcap + c] = st, st += w.size[h * z.Pcap + c];
}

/// Tokens of each cluster in position order (each part writes its own slots: stable, no atomics).
__global__ void __launch_bounds__(kPartThreads) bucket_tokens(Sizes z, Work w) {
  const long long h = blockIdx.y, part = (long long)blockIdx.x * kPartThreads + threadIdx.x;
  if (part >= z.parts) return;
  int* pc = w.pcnt + (h * z.parts + part) * z.Pcap;
  const long long e = (part + 1) * kPart < z.N ? (part + 1) * kPart : z.N;
  for (long long t = part * kPart; t < e; ++t) {
    const int c = w.cl[h * z.N + t];
    if (c < 0) continue;
    w.bycl[h * z.N + w.cstart[h * z.Pcap + c] + pc[c]++] = int(t);
  }
}

/// ψ per cluster: fp64 sum of q̄·k over its tokens in position order (the CPU's sum).
__global__ void __launch_bounds__(kPartThreads) cluster_psi(Sizes z, bool mean, Work w) {
  const long long h = blockIdx.y, c = (long long)blockIdx.x * kPartThreads + threadIdx.x;
  if (c >= w.P[h]) return;
  const long long b = w.cstart[h * z.Pcap + c], n = w.size[h * z.Pcap + c];
  const int* mem = w.bycl + h * z.N + b;
  double s = 0;
  for (long long m = 0; m < n; ++m) s += double(w.qk[h * z.N + mem[m]]);
  if (mean && n > 0) s /= double(n);
  w.psi[h * z.Pcap + c] = s;
}

// ------------------------------------------------------------------ 7. order

/// Per head: rank of every non-empty cluster (ψ desc, index asc) by counting, the first output
/// rank of each, and M (valid tokens).
__global__ void __launch_bounds__(kOrderThreads) cluster_order(Sizes z, Work w) {
  const long long h = blockIdx.x;
  const int P = w.P[h];
  const double* psi = w.psi + h * z.Pcap;
  const long long* size = w.size + h * z.Pcap;
  long long* crank = w.crank + h * z.Pcap;
  long long* base = w.base + h * z.Pcap;  // first holds the size at each rank
  for (int c = threadIdx.x; c < P; c += kOrderThreads) {
    if (size[c] == 0) {
      crank[c] = -1;
      continue;
    }
    long long r = 0;
    for (int e = 0; e < P; ++e)
      if (size[e] > 0 && (psi[e] > psi[c] || (psi[e] == psi[c] && e < c))) ++r;
    crank[c] = r;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < P; c += kOrderThreads)
    if (crank[c] >= 0) base[crank[c]] = size[c];
  __syncthreads();
  if (threadIdx.x == 0) {
    long long nonempty = 0, acc = 0;
    for (int c = 0; c < P; ++c) nonempty += size[c] > 0;
    for (long long k = 0; k < nonempty; ++k) {
      const long long s = base[k];
      base[k] = acc;
      acc += s;
    }
    w.M[h] = acc;
  }
}

/// One thread per token: its rank inside its cluster by counting (q̄·k desc, position asc).
__global__ void __launch_bounds__(kWarpThreads) final_scores(Sizes z, Work w, float* out, long long out_hs) {
  const long long h = blockIdx.y, t = (long long)blockIdx.x * kWarpThreads + threadIdx.x;
  if (t >= z.N) return;
  const int c = w.cl[h * z.N + t];
  if (c < 0) {
    out[h * out_hs + t] = kNegInf;
    return;
  }
  const float q = w.qk[h * z.N + t];
  const long long b = w.cstart[h * z.Pcap + c], n = w.size[h * z.Pcap + c];
  const int* mem = w.bycl + h * z.N + b;
  long long within = 0;
  for (long long m = 0; m < n; ++m) {
    const int u = mem[m];
    const float qu = w.qk[h * z.N + u];
    within += (qu > q || (qu == q && u < t)) ? 1 : 0;
  }
  const long long o = w.base[h * z.Pcap + w.crank[h * z.Pcap + c]] + within;
  out[h * out_hs + t] = float(w.M[h] - o);
}

// ------------------------------------------------------------------ host step

struct HostPlan {
  std::vector<long long> poff;  // [H][Pcap + 1]
  std::vector<int> members;     // [H][N]
  std::vector<int> P;           // [H]
  // per head, for the trace
  std::vector<std::vector<int>> bucket, ids;
  std::vector<std::vector<long long>> cand, cb;
  std::vector<double> sigma;
  std::vector<long long> v;
};

HostPlan host_plan(const Sizes& z, const ProtoArg& a, const std::vector<unsigned char>& valid,
                   const std::vector<long long>& cand, const std::vector<int>& ncand, const std::vector<double>& dist,
                   const std::vector<double>& zz) {
  HostPlan hp;
  const long long H = z.H, N = z.N;
  hp.poff.assign(std::size_t(H * (z.Pcap + 1)), 0);
  hp.members.assign(std::size_t(H * N), 0);
  hp.P.assign(std::size_t(H), 0);
  hp.bucket.resize(std::size_t(H));
  hp.ids.resize(std::size_t(H));
  hp.cand.resize(std::size_t(H));
  hp.cb.resize(std::size_t(H));
  hp.sigma.assign(std::size_t(H), 0);
  hp.v.assign(std::size_t(H), 0);
  const int r = a.lsh_bits;
  for (long long h = 0; h < H; ++h) {
    const long long p = ncand[std::size_t(h)];
    std::vector<long long>& cd = hp.cand[std::size_t(h)];
    cd.assign(cand.begin() + std::ptrdiff_t(h * z.pcap), cand.begin() + std::ptrdiff_t(h * z.pcap + p));
    double sigma = a.bandwidth;
    if (sigma == 0) {  // lower median of the pairwise distances (the CPU's)
      std::vector<double> ds(dist.begin() + std::ptrdiff_t(h * z.pairs),
                             dist.begin() + std::ptrdiff_t(h * z.pairs + p * (p - 1) / 2));
      if (!ds.empty()) {
        const std::size_t mid = (ds.size() - 1) / 2;
        std::nth_element(ds.begin(), ds.begin() + std::ptrdiff_t(mid), ds.end());
        sigma = ds[mid];
      }
      if (!(sigma > 0)) sigma = 1.0;
    }
    hp.sigma[std::size_t(h)] = sigma;
    std::vector<int>& bucket = hp.bucket[std::size_t(h)];
    bucket.assign(std::size_t(p), 0);
    for (long long x = 0; x < p; ++x) {
      int id = 0;
      for (int i = 0; i < r; ++i) {
        const double zi = zz[std::size_t((h * z.pcap + x) * r + i)];
        const bool bit = std::cos(zi / sigma + a.b[std::size_t(h * r + i)]) >= 0.0;
        id = (id << 1) | (bit ? 1 : 0);
      }
      bucket[std::size_t(x)] = id;
    }
    std::vector<unsigned char> is_cand(std::size_t(N), 0);
    for (long long t : cd) is_cand[std::size_t(t)] = 1;
    std::vector<int> rest;
    rest.reserve(std::size_t(N));
    for (long long t = 0; t < N; ++t)
      if (valid[std::size_t(h * N + t)] && !is_cand[std::size_t(t)]) rest.push_back(int(t));
    const long long nr = (long long)rest.size(), v = std::min<long long>(a.chunks, nr);
    hp.v[std::size_t(h)] = v;
    std::vector<long long>& cb = hp.cb[std::size_t(h)];
    cb.assign(std::size_t(v + 1), 0);
    for (long long c = 0; c <= v; ++c) cb[std::size_t(c)] = v > 0 ? c * nr / v : 0;
    std::vector<int>& ids = hp.ids[std::size_t(h)];
    ids = bucket;
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    const long long ns = (long long)ids.size(), P = v + ns;
    hp.P[std::size_t(h)] = int(P);
    long long* off = hp.poff.data() + h * (z.Pcap + 1);
    int* mem = hp.members.data() + h * N;
    long long m = 0;
    for (long long c = 0; c < v; ++c) {
      off[c] = m;
      for (long long k = cb[std::size_t(c)]; k < cb[std::size_t(c + 1)]; ++k) mem[m++] = rest[std::size_t(k)];
    }
    std::vector<std::pair<int, long long>> sat(static_cast<std::size_t>(p));
    for (long long x = 0; x < p; ++x) sat[std::size_t(x)] = {bucket[std::size_t(x)], cd[std::size_t(x)]};
    std::sort(sat.begin(), sat.end());
    std::size_t k = 0;
    for (long long s = 0; s < ns; ++s) {
      off[v + s] = m;
      for (; k < sat.size() && sat[k].first == ids[std::size_t(s)]; ++k) mem[m++] = int(sat[k].second);
    }
    off[P] = m;
  }
  return hp;
}

template <class T>
std::vector<T> fetch(const T* dev, std::size_t n, cudaStream_t st) {
  std::vector<T> v(n);
  if (n > 0) KVSCORE_CUDA_CHECK(cudaMemcpyAsync(v.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost, st));
  return v;
}

template <dtype D>
void run(const KeysArg& ka, const ScoresArg& out, const ProtoArg& a, Workspace ws, cudaStream_t st, ProtoTrace* trace,
         std::int64_t th) {
  using S = typename Storage<D>::type;
  const Sizes z = sizes_of(ka.heads, ka.tokens, ka.head_dim, a.sat_candidates, a.lsh_bits, a.chunks);
  Carver c(ws.data);
  const Work w = carve(c, z);
  const KeysDev<D> k{static_cast<const S*>(ka.data), ka.head_stride, ka.token_stride};
  const long long H = z.H, N = z.N, d = z.d;
  KVSCORE_CUDA_CHECK(cudaMemcpyAsync(w.qbar, a.qbar, std::size_t(H * d) * sizeof(float), cudaMemcpyHostToDevice, st));
  if (z.r > 0)
    KVSCORE_CUDA_CHECK(cudaMemcpyAsync(w.W, a.W, std::size_t(H * z.r * d) * sizeof(double), cudaMemcpyHostToDevice, st));
  const dim3 rows(grid_dim((N + 7) / 8), grid_dim(H));
  prep<D><<<rows, kWarpThreads, 0, st>>>(k, z, w);
  KVSCORE_CUDA_LAUNCHED();
  similarity<<<rows, kWarpThreads, 0, st>>>(z, a.kappa, w);
  KVSCORE_CUDA_LAUNCHED();
  candidates<<<grid_dim(H), kCandThreads, 0, st>>>(z, w);
  KVSCORE_CUDA_LAUNCHED();

  // Host step: the one synchronisation.
  const std::vector<unsigned char> valid = fetch(w.valid, std::size_t(H * N), st);
  const std::vector<long long> cand = fetch(w.cand, std::size_t(H * z.pcap), st);
  const std::vector<int> ncand = fetch(w.ncand, std::size_t(H), st);
  const std::vector<double> dist = fetch(w.dist, std::size_t(H * z.pairs), st);
  const std::vector<double> zz = fetch(w.z, std::size_t(H * z.pcap * z.r), st);
  KVSCORE_CUDA_CHECK(cudaStreamSynchronize(st));
  const HostPlan hp = host_plan(z, a, valid, cand, ncand, dist, zz);
  KVSCORE_CUDA_CHECK(cudaMemcpyAsync(w.poff, hp.poff.data(), hp.poff.size() * sizeof(long long),
                                     cudaMemcpyHostToDevice, st));
  KVSCORE_CUDA_CHECK(cudaMemcpyAsync(w.members, hp.members.data(), hp.members.size() * sizeof(int),
                                     cudaMemcpyHostToDevice, st));
  KVSCORE_CUDA_CHECK(cudaMemcpyAsync(w.P, hp.P.data(), hp.P.size() * sizeof(int), cudaMemcpyHostToDevice, st));

  prototypes<<<dim3(grid_dim(z.Pcap), grid_dim(H)), kProtoThreads, 0, st>>>(z, w);
  KVSCORE_CUDA_LAUNCHED();
  assign<<<dim3(grid_dim((N + kBM - 1) / kBM), grid_dim(H)), kGemmThreads, 0, st>>>(z, w);
  KVSCORE_CUDA_LAUNCHED();
  const dim3 parts(grid_dim((z.parts + kPartThreads - 1) / kPartThreads), grid_dim(H));
  count_parts<<<parts, kPartThreads, 0, st>>>(z, w);
  KVSCORE_CUDA_LAUNCHED();
  const dim3 clusters(grid_dim((z.Pcap + kPartThreads - 1) / kPartThreads), grid_dim(H));
  count_total<<<clusters, kPartThreads, 0, st>>>(z, w);
  KVSCORE_CUDA_LAUNCHED();
  cluster_starts<<<grid_dim(H), 1, 0, st>>>(z, w);
  KVSCORE_CUDA_LAUNCHED();
  bucket_tokens<<<parts, kPartThreads, 0, st>>>(z, w);
  KVSCORE_CUDA_LAUNCHED();
  cluster_psi<<<clusters, kPartThreads, 0, st>>>(z, a.psi_mean, w);
  KVSCORE_CUDA_LAUNCHED();
  cluster_order<<<grid_dim(H), kOrderThreads, 0, st>>>(z, w);
  KVSCORE_CUDA_LAUNCHED();
  final_scores<<<dim3(grid_dim((N + kWarpThreads - 1) / kWarpThreads), grid_dim(H)), kWarpThreads, 0, st>>>(
      z, w, out.data, out.head_stride);
  KVSCORE_CUDA_LAUNCHED();

  if (trace == nullptr) return;
  const long long h = th, P = hp.P[std::size_t(h)];
  ProtoTrace& t = *trace;
  t.valid.assign(valid.begin() + std::ptrdiff_t(h * N), valid.begin() + std::ptrdiff_t((h + 1) * N));
  t.similarity = fetch(w.S + h * N, std::size_t(N), st);
  t.qk = fetch(w.qk + h * N, std::size_t(N), st);
  t.norm = fetch(w.norm + h * N, std::size_t(N), st);
  t.candidates.assign(hp.cand[std::size_t(h)].begin(), hp.cand[std::size_t(h)].end());
  t.candidate_bucket = hp.bucket[std::size_t(h)];
  t.bandwidth = hp.sigma[std::size_t(h)];
  t.pdt = hp.v[std::size_t(h)];
  t.sat = P - t.pdt;
  t.sat_bucket_id = hp.ids[std::size_t(h)];
  t.chunk_begin.assign(hp.cb[std::size_t(h)].begin(), hp.cb[std::size_t(h)].end());
  t.prototypes = fetch(w.protos + h * z.Pcap * d, std::size_t(P * d), st);
  t.cluster = fetch(w.cl + h * N, std::size_t(N), st);
  t.psi = fetch(w.psi + h * z.Pcap, std::size_t(P), st);
  const std::vector<long long> size = fetch(w.size + h * z.Pcap, std::size_t(P), st);
  const std::vector<long long> crank = fetch(w.crank + h * z.Pcap, std::size_t(P), st);
  KVSCORE_CUDA_CHECK(cudaStreamSynchronize(st));
  t.cluster_size.assign(size.begin(), size.end());
  std::vector<std::int32_t> order;
  for (long long cc = 0; cc < P; ++cc)
    if (crank[std::size_t(cc)] >= 0) order.push_back(std::int32_t(cc));
  std::sort(order.begin(), order.end(),
            [&](std::int32_t x, std::int32_t y) { return crank[std::size_t(x)] < crank[std::size_t(y)]; });
  t.cluster_order = order;
}

}  // namespace

std::size_t protokv_workspace_bytes(std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
                                    std::int64_t sat_candidates, int lsh_bits, std::int64_t chunks) noexcept {
  if (heads <= 0 || tokens <= 0) return 0;
  Carver c;
  carve(c, sizes_of(heads, tokens, head_dim, sat_candidates, lsh_bits, chunks));
  return c.bytes();
}

void score_protokv(const KeysArg& keys, const ScoresArg& out, const ProtoArg& p, Workspace ws, stream_t stream,
                   ProtoTrace* trace, std::int64_t trace_head) {
  if (keys.heads == 0 || keys.tokens == 0) return;
  require_no_pending_error("kvscore::cuda::score (ProtoKV)");
  if (keys.head_dim > 256)
    throw std::invalid_argument("kvscore::cuda::score(ProtoKV): head_dim " + std::to_string(keys.head_dim) +
                                " > 256 is not supported on the GPU");
  require_device_pointer(keys.data, "keys");
  require_device_pointer(out.data, "scores");
  require_workspace(ws,
                    protokv_workspace_bytes(keys.heads, keys.tokens, keys.head_dim, p.sat_candidates, p.lsh_bits,
                                            p.chunks),
                    "kvscore::cuda::score(ProtoKV)");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  for_dtype(keys.type, [&](auto D) { run<decltype(D)::value>(keys, out, p, ws, st, trace, trace_head); });
}

}  // namespace kvscore::cuda::detail
