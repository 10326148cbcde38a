// cuda/src/snapkv.cu — SnapKV (kvscore/scorers/snapkv.hpp) on the GPU, all KV heads in one launch.
//
// The formula, masks and invalid-key rules are the CPU's; only the order of the sums differs.
//  1. validity: fp32 squared norm of every key (one warp per row).
//  2. stats: per (KV head, block of kKeysPerBlock keys, tile of T queries) the running max
//     and fp64 sum of exp(l - max) of each query over the block's keys, in key order.
//  3. combine: per query M = max of the block maxima, S = Σ s_b·exp(m_b - M) (fp64), blocks in order.
//  4. acc: per key tile, Σ over all G·w queries (in order) of exp(l - M)/S, in fp64.
//  5. pool: the mean over queries, average pooling over the prefix, the window as is.
// Logits are recomputed in step 4 (as the CPU's second pass) from fp32 tiles in shared memory:
// T keys and T queries, T = 64 for head_dim <= 127, halved until the tiles fit 96 KB.
// Fixed partitions and in-order sums: bit-identical across runs.
//
// fp16 keys with head_dim 64/128/256 take the tensor cores for the logits of steps 2 and 4 (see
// "tensor-core path" below); fp32 and bf16 keys and other head_dims keep the FMA tiles.
#include "common.cuh"

#include <mma.h>

#include <algorithm>
#include <cfloat>

namespace kvscore::cuda::detail {
namespace {

constexpr int kThreads = 256;
constexpr long long kKeysPerBlock = 1024;
constexpr std::size_t kMaxSmem = 96 * 1024;

int tile_for(long long d) {
  int T = 64;
  while (T > 1 && std::size_t(2 * T * (d + 1) + T * (T + 1)) * sizeof(float) > kMaxSmem) T /= 2;
  return T;
}
std::size_t smem_for(int T, long long d) { return std::size_t(2 * T * (d + 1) + T * (T + 1)) * sizeof(float); }

struct Work {
  unsigned char* valid = nullptr;  // [H][N]
  double* acc = nullptr;           // [H][N]
  float* pmax = nullptr;           // [H][nq][nkb]
  double* psum = nullptr;          // [H][nq][nkb]
  float* M = nullptr;              // [H][nq]
  double* S = nullptr;             // [H][nq]
  float* q = nullptr;              // [q_heads][w][d]
  __half* qhi = nullptr;           // [q_heads][w][d]: fp16(q·2^e), tensor-core path
  __half* qlo = nullptr;           // [q_heads][w][d]: fp16(q·2^e − qhi)
  unsigned* qmax = nullptr;        // bits of max |q| (the scale 2^e)
};

Work carve(Carver& c, long long H, long long N, long long d, long long q_heads, long long w) {
  const long long nq = q_heads / H * w, nkb = (N + kKeysPerBlock - 1) / kKeysPerBlock;
  Work k;
  k.valid = c.take<unsigned char>(std::size_t(H * N));
  k.acc = c.take<double>(std::size_t(H * N));
  k.pmax = c.take<float>(std::size_t(H * nq * nkb));
  k.psum = c.take<double>(std::size_t(H * nq * nkb));
  k.M = c.take<float>(std::size_t(H * nq));
  k.S = c.take<double>(std::size_t(H * nq));
  k.q = c.take<float>(std::size_t(q_heads * w * d));
  k.qhi = c.take<__half>(std::size_t(q_heads * w * d));
  k.qlo = c.take<__half>(std::size_t(q_heads * w * d));
  k.qmax = c.take<unsigned>(1);
  return k;
}

struct Shape {
  long long H, N, d, hs, ts, w, nq, nkb, P;
  int T;
};

template <dtype D>
__global__ void __launch_bounds__(kThreads) validity(const typename Storage<D>::type* keys, Shape s, Work k) {
  const int lane = threadIdx.x & 31;
  const long long t = (long long)blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5), h = blockIdx.y;
  if (t >= s.N) return;
  const auto* row = keys + h * s.hs + t * s.ts;
  float sq = 0.f;
  for (long long j = lane; j < s.d; j += 32) {
    const float x = widen<D>(row[j]);
    sq = fmaf(x, x, sq);
  }
  sq = warp_sum(sq);
  if (lane == 0) k.valid[h * s.N + t] = isfinite(sq) ? 1 : 0;
}

/// Loads keys [t0, t0+m) of head h into Ks (fp32, row pitch d+1) and queries [q0, q0+nqr) into Qs.
template <dtype D>
__device__ void load_keys(const typename Storage<D>::type* keys, const Shape& s, long long h, long long t0, int m,
                          float* Ks) {
  for (long long i = threadIdx.x; i < (long long)m * s.d; i += kThreads) {
    const long long r = i / s.d, j = i % s.d;
    Ks[r * (s.d + 1) + j] = widen<D>(keys[h * s.hs + (t0 + r) * s.ts + j]);
  }
}
__device__ void load_queries(const Work& k, const Shape& s, long long h, long long q0, int nqr, float* Qs) {
  for (long long i = threadIdx.x; i < (long long)nqr * s.d; i += kThreads) {
    const long long r = i / s.d, j = i % s.d;
    Qs[r * (s.d + 1) + j] = k.q[(h * s.nq + q0 + r) * s.d + j];
  }
}

/// L[i][r] = logit of query q0+i on key t0+r; -inf where masked (causal, invalid key, NaN),
/// +inf clamped to FLT_MAX (snapkv.hpp).
__device__ void logits(const Work& k, const Shape& s, long long h, long long q0, int nqr, long long t0, int m,
                       const float* Qs, const float* Ks, float* L) {
  for (int idx = threadIdx.x; idx < nqr * m; idx += kThreads) {
    const int i = idx / m, r = idx % m;
    const long long t = t0 + r, q = q0 + i;
    float x = kNegInf;
    if (t <= s.P + q % s.w && k.valid[h * s.N + t]) {
      const float* a = Qs + i * (s.d + 1);
      const float* b = Ks + r * (s.d + 1);
      float dot = 0.f;
      for (long long j = 0; j < s.d; ++j) dot = fmaf(a[j], b[j], dot);
      x = dot == dot ? (dot > FLT_MAX ? FLT_MAX : dot) : kNegInf;
    }
    L[i * (s.T + 1) + r] = x;
  }
}

template <dtype D>
__global__ void __launch_bounds__(kThreads) stats(const typename Storage<D>::type* keys, Shape s, Work k) {
  extern __shared__ float sm[];
  float* Qs = sm;
  float* Ks = Qs + s.T * (s.d + 1);
  float* L = Ks + s.T * (s.d + 1);
  const long long h = blockIdx.y, kb = blockIdx.x, q0 = (long long)blockIdx.z * s.T;
  const int nqr = int(s.nq - q0 < s.T ? s.nq - q0 : s.T);
  load_queries(k, s, h, q0, nqr, Qs);
  float mx = kNegInf;
  double sum = 0.0;
  const long long b = kb * kKeysPerBlock, e = b + kKeysPerBlock < s.N ? b + kKeysPerBlock : s.N;
  for (long long t0 = b; t0 < e; t0 += s.T) {
    const int m = int(e - t0 < s.T ? e - t0 : s.T);
    __syncthreads();
    load_keys<D>(keys, s, h, t0, m, Ks);
    __syncthreads();
    logits(k, s, h, q0, nqr, t0, m, Qs, Ks, L);
    __syncthreads();
    if (threadIdx.x < nqr) {
      const float* l = L + threadIdx.x * (s.T + 1);
      float cm = kNegInf;
      for (int r = 0; r < m; ++r) cm = fmaxf(cm, l[r]);
      if (cm != kNegInf) {
        if (cm > mx) {
          sum *= exp(double(mx) - double(cm));  // 0 on the first finite tile
          mx = cm;
        }
        for (int r = 0; r < m; ++r) sum += double(expf(l[r] - mx));
      }
    }
  }
  if (threadIdx.x < nqr) {
    const long long cell = (h * s.nq + q0 + threadIdx.x) * s.nkb + kb;
    k.pmax[cell] = mx;
    k.psum[cell] = sum;
  }
}

__global__ void combine(Shape s, Work k) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // h * nq + q
  if (i >= s.H * s.nq) return;
  float M = kNegInf;
  for (long long b = 0; b < s.nkb; ++b) M = fmaxf(M, k.pmax[i * s.nkb + b]);
  double S = 0.0;
  if (M != kNegInf)
    for (long long b = 0; b < s.nkb; ++b) {
      const float m = k.pmax[i * s.nkb + b];
      if (m != kNegInf) S += k.psum[i * s.nkb + b] * exp(double(m) - double(M));
    }
  k.M[i] = M;
  k.S[i] = S;
}

template <dtype D>
__global__ void __launch_bounds__(kThreads) accumulate(const typename Storage<D>::type* keys, Shape s, Work k) {
  extern __shared__ float sm[];
  float* Qs = sm;
  float* Ks = Qs + s.T * (s.d + 1);
  float* L = Ks + s.T * (s.d + 1);
  const long long h = blockIdx.y, t0 = (long long)blockIdx.x * s.T;
  const int m = int(s.N - t0 < s.T ? s.N - t0 : s.T);
  load_keys<D>(keys, s, h, t0, m, Ks);
  double acc = 0.0;
  for (long long q0 = 0; q0 < s.nq; q0 += s.T) {
    const int nqr = int(s.nq - q0 < s.T ? s.nq - q0 : s.T);
    __syncthreads();
    load_queries(k, s, h, q0, nqr, Qs);
    __syncthreads();
    logits(k, s, h, q0, nqr, t0, m, Qs, Ks, L);
    __syncthreads();
    if (threadIdx.x < m)
      for (int i = 0; i < nqr; ++i) {
        const long long q = h * s.nq + q0 + i;
        const double S = k.S[q];
        const float l = L[i * (s.T + 1) + threadIdx.x];
        if (S > 0.0 && l != kNegInf) acc += double(expf(l - k.M[q])) * (1.0 / S);
      }
  }
  if (threadIdx.x < m) k.acc[h * s.N + t0 + threadIdx.x] = acc;
}

__global__ void pool(Shape s, Work k, long long kernel, float* out, long long out_hs) {
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y;
  if (t >= s.N) return;
  const double mean = 1.0 / double(s.nq);
  const double* a = k.acc + h * s.N;
  float r;
  if (t < s.P) {
    const long long rad = kernel / 2, lo = t - rad < 0 ? 0 : t - rad, hi = t + rad < s.P - 1 ? t + rad : s.P - 1;
    double sum = 0.0;
    for (long long u = lo; u <= hi; ++u) sum += a[u];
    r = float(sum * (mean / double(kernel)));
  } else {
    r = float(a[t] * mean);
  }
  out[h * out_hs + t] = k.valid[h * s.N + t] ? r : kNegInf;
}


// ------------------------------------------------------------------ tensor-core path (fp16 keys)
//
// The logits of steps 2 and 4 on the tensor cores (WMMA 16×16×16, fp16 operands, fp32
// accumulation); everything after the logits (masks, clamping, expf, fp64 sums, the partition)
// is the FMA path's. The fp32 queries q/√d are scaled by a power of two 2^e (max |q|·2^e in
// [2^13, 2^14): no fp16 overflow) and split into q_hi = fp16(q·2^e) and q_lo = fp16(q·2^e − q_hi),
// so q keeps ~22 bits (fp16 keys are exact operands) and l = 2^−e·(q_hi·k + q_lo·k): two MMAs per
// product, the error of an fp32 dot product (the test's bound, derived in test_snapkv.cpp). A
// 64 × 64 logit tile goes through shared memory; 4 threads per query row (stats) or per key
// (accumulate) reduce it in a fixed order.

constexpr int kTcT = 64;     // queries and keys per tile
constexpr int kTcPad = 8;    // halves of padding per row (banks; WMMA ldm a multiple of 8)
constexpr int kTcLPad = 4;   // floats of padding per logit row

template <int DIM>
struct TcSmem {
  static constexpr int ldq = DIM + kTcPad;
  static constexpr int ldl = kTcT + kTcLPad;
  static constexpr std::size_t tile = std::size_t(kTcT) * ldq;  // halves of one Q or K tile
  static constexpr std::size_t bytes = 3 * tile * sizeof(__half) + std::size_t(kTcT) * ldl * sizeof(float);
};

/// The four tiles of a block's dynamic shared memory (Q_hi, Q_lo, K in fp16, the logits in fp32)
/// and the queries' unscale 2^−e.
struct TcTiles {
  __half *Qh, *Ql, *Ks;
  float* L;
  float unscale;
  template <int DIM>
  __device__ static TcTiles carve(unsigned char* sm, const unsigned* qmax);
};

template <int DIM>
__device__ void tc_load_keys(const std::uint16_t* keys, const Shape& s, long long h, long long t0, int m, bool vec16,
                             __half* Ks) {
  constexpr int ldq = TcSmem<DIM>::ldq, CH = DIM / 8;
  if (vec16) {
    for (int i = threadIdx.x; i < kTcT * CH; i += kThreads) {
      const int r = i / CH, c = i % CH;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (r < m) v = __ldg(reinterpret_cast<const uint4*>(keys + h * s.hs + (t0 + r) * s.ts) + c);
      *reinterpret_cast<uint4*>(Ks + r * ldq + c * 8) = v;
    }
  } else {
    for (int i = threadIdx.x; i < kTcT * DIM; i += kThreads) {
      const int r = i / DIM, j = i % DIM;
      Ks[r * ldq + j] = __ushort_as_half(r < m ? keys[h * s.hs + (t0 + r) * s.ts + j] : std::uint16_t(0));
    }
  }
}

/// Rows [0, nqr) of a [rows][DIM] fp16 array into a Q tile, zeros below.
template <int DIM>
__device__ void tc_load_q(const __half* src, int nqr, __half* Qs) {
  constexpr int ldq = TcSmem<DIM>::ldq, CH = DIM / 8;
  for (int i = threadIdx.x; i < kTcT * CH; i += kThreads) {
    const int r = i / CH, c = i % CH;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < nqr) v = *(reinterpret_cast<const uint4*>(src + std::size_t(r) * DIM) + c);
    *reinterpret_cast<uint4*>(Qs + r * ldq + c * 8) = v;
  }
}

/// L[i][r] = 2^−e·(q_hi,i + q_lo,i)·k_r for the 64 × 64 tile (unmasked).
template <int DIM>
__device__ void tc_logits(const __half* Qh, const __half* Ql, const __half* Ks, float* L, float unscale) {
  using namespace nvcuda;
  constexpr int ldq = TcSmem<DIM>::ldq, ldl = TcSmem<DIM>::ldl;
  for (int tt = threadIdx.x >> 5; tt < 16; tt += kThreads / 32) {
    const int qi = tt >> 2, ki = tt & 3;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::fill_fragment(c, 0.f);
#pragma unroll
    for (int kk = 0; kk < DIM; kk += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;  // B(j, r) = K[r][j]
      wmma::load_matrix_sync(b, Ks + ki * 16 * ldq + kk, ldq);
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
      wmma::load_matrix_sync(a, Qh + qi * 16 * ldq + kk, ldq);
      wmma::mma_sync(c, a, b, c);
      wmma::load_matrix_sync(a, Ql + qi * 16 * ldq + kk, ldq);
      wmma::mma_sync(c, a, b, c);
    }
#pragma unroll
    for (int i = 0; i < c.num_elements; ++i) c.x[i] *= unscale;  // a power of two: exact
    wmma::store_matrix_sync(L + qi * 16 * ldl + ki * 16, c, ldl, wmma::mem_row_major);
  }
}

/// The logit the FMA path's logits() would give: −inf where masked or NaN, +inf clamped.
__device__ __forceinline__ float tc_masked(float x, bool visible) {
  return visible ? (x == x ? fminf(x, FLT_MAX) : kNegInf) : kNegInf;
}

/// max |q| as float bits (non-negative floats order as integers: atomicMax is exact).
__global__ void q_absmax(const float* q, long long n, unsigned* out) {
  unsigned m = 0;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    m = max(m, __float_as_uint(fabsf(q[i])));
  m = __reduce_max_sync(0xffffffffu, m);
  if ((threadIdx.x & 31) == 0) atomicMax(out, m);
}

/// e with max |q|·2^e in [2^13, 2^14) (clamped: 2^±100 stays a normal float).
__device__ __forceinline__ int tc_exponent(unsigned qmax_bits) {
  int ex = 0;
  const float qmax = __uint_as_float(qmax_bits);
  if (qmax > 0.f) frexpf(qmax, &ex);
  const int e = 14 - ex;
  return e < -100 ? -100 : (e > 100 ? 100 : e);
}

template <int DIM>
__device__ TcTiles TcTiles::carve(unsigned char* sm, const unsigned* qmax) {
  __half* q = reinterpret_cast<__half*>(sm);
  return {q, q + TcSmem<DIM>::tile, q + 2 * TcSmem<DIM>::tile, reinterpret_cast<float*>(q + 3 * TcSmem<DIM>::tile),
          ldexpf(1.f, -tc_exponent(*qmax))};
}

/// q·2^e into fp16 hi + lo (x − hi is exact in fp32; lo keeps the next 11 bits).
__global__ void split_queries(const float* q, long long n, const unsigned* qmax, __half* hi, __half* lo) {
  const int e = tc_exponent(*qmax);
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const float x = ldexpf(q[i], e);
    const __half h = __float2half_rn(x);
    hi[i] = h;
    lo[i] = __float2half_rn(x - __half2float(h));
  }
}

template <int DIM>
__global__ void __launch_bounds__(kThreads) stats_tc(const std::uint16_t* keys, Shape s, Work k, bool vec16) {
  extern __shared__ __align__(128) unsigned char tc_sm[];
  using SM = TcSmem<DIM>;
  const TcTiles tl = TcTiles::carve<DIM>(tc_sm, k.qmax);
  const long long h = blockIdx.y, kb = blockIdx.x, q0 = (long long)blockIdx.z * kTcT;
  const int nqr = int(s.nq - q0 < kTcT ? s.nq - q0 : kTcT);
  tc_load_q<DIM>(k.qhi + (h * s.nq + q0) * DIM, nqr, tl.Qh);
  tc_load_q<DIM>(k.qlo + (h * s.nq + q0) * DIM, nqr, tl.Ql);
  const int row = threadIdx.x >> 2, part = threadIdx.x & 3;  // 4 lanes per query row, 16 keys each
  const long long q = q0 + row;
  float mx = kNegInf;
  double sum = 0.0;
  const long long b = kb * kKeysPerBlock, e = b + kKeysPerBlock < s.N ? b + kKeysPerBlock : s.N;
  for (long long t0 = b; t0 < e; t0 += kTcT) {
    const int m = int(e - t0 < kTcT ? e - t0 : kTcT);
    __syncthreads();
    tc_load_keys<DIM>(keys, s, h, t0, m, vec16, tl.Ks);
    __syncthreads();
    tc_logits<DIM>(tl.Qh, tl.Ql, tl.Ks, tl.L, tl.unscale);
    __syncthreads();
    float x[16];
    float cm = kNegInf;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const int r = part * 16 + c;
      const long long t = t0 + r;
      const bool vis = row < nqr && r < m && t <= s.P + q % s.w && k.valid[h * s.N + t];
      x[c] = tc_masked(tl.L[row * SM::ldl + r], vis);
      cm = fmaxf(cm, x[c]);
    }
    cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 1));
    cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 2));
    const float nm = fmaxf(mx, cm);
    const float base = nm == kNegInf ? 0.f : nm;  // a row with nothing visible yet: every x is -inf
    double ts = 0.0;
#pragma unroll
    for (int c = 0; c < 16; ++c) ts += double(expf(x[c] - base));
    ts += __shfl_xor_sync(0xffffffffu, ts, 1);  // the same sum on the 4 lanes (a + b == b + a)
    ts += __shfl_xor_sync(0xffffffffu, ts, 2);
    if (cm != kNegInf) {
      sum = (mx == kNegInf ? 0.0 : sum * exp(double(mx) - double(nm))) + ts;
      mx = nm;
    }
  }
  if (row < nqr && part == 0) {
    const long long cell = (h * s.nq + q) * s.nkb + kb;
    k.pmax[cell] = mx;
    k.psum[cell] = sum;
  }
}

template <int DIM>
__global__ void __launch_bounds__(kThreads) accumulate_tc(const std::uint16_t* keys, Shape s, Work k, bool vec16) {
  extern __shared__ __align__(128) unsigned char tc_sm[];
  using SM = TcSmem<DIM>;
  const TcTiles tl = TcTiles::carve<DIM>(tc_sm, k.qmax);
  const long long h = blockIdx.y, t0 = (long long)blockIdx.x * kTcT;
  const int m = int(s.N - t0 < kTcT ? s.N - t0 : kTcT);
  tc_load_keys<DIM>(keys, s, h, t0, m, vec16, tl.Ks);
  __shared__ float sM[kTcT];
  __shared__ double sInv[kTcT];
  const int col = threadIdx.x >> 2, part = threadIdx.x & 3;  // 4 lanes per key, 16 queries each
  const long long t = t0 + col;
  const bool kv = col < m && k.valid[h * s.N + t];
  double acc = 0.0;
  for (long long q0 = 0; q0 < s.nq; q0 += kTcT) {
    const int nqr = int(s.nq - q0 < kTcT ? s.nq - q0 : kTcT);
    __syncthreads();
    tc_load_q<DIM>(k.qhi + (h * s.nq + q0) * DIM, nqr, tl.Qh);
    tc_load_q<DIM>(k.qlo + (h * s.nq + q0) * DIM, nqr, tl.Ql);
    if (threadIdx.x < nqr) {  // the same 1/S the FMA path divides by, once per query
      const double S = k.S[h * s.nq + q0 + threadIdx.x];
      sM[threadIdx.x] = k.M[h * s.nq + q0 + threadIdx.x];
      sInv[threadIdx.x] = S > 0.0 ? 1.0 / S : 0.0;
    }
    __syncthreads();
    tc_logits<DIM>(tl.Qh, tl.Ql, tl.Ks, tl.L, tl.unscale);
    __syncthreads();
    if (kv)
#pragma unroll 4
      for (int c = 0; c < 16; ++c) {
        const int i = part * 16 + c;
        const long long q = q0 + i;
        if (i >= nqr || t > s.P + q % s.w) continue;
        const float l = tc_masked(tl.L[i * SM::ldl + col], true);
        if (sInv[i] > 0.0 && l != kNegInf) acc += double(expf(l - sM[i])) * sInv[i];
      }
  }
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  acc += __shfl_xor_sync(0xffffffffu, acc, 2);
  if (col < m && part == 0) k.acc[h * s.N + t] = acc;
}

/// The tensor-core path takes fp16 keys of head_dim 64/128/256.
bool tc_dim(long long d) { return d == 64 || d == 128 || d == 256; }

template <int DIM>
void run_tc(const std::uint16_t* keys, const Shape& s, const Work& k, bool vec16, long long nq_total, cudaStream_t st) {
  KVSCORE_CUDA_CHECK(cudaMemsetAsync(k.qmax, 0, sizeof(unsigned), st));
  q_absmax<<<64, 256, 0, st>>>(k.q, nq_total, k.qmax);
  KVSCORE_CUDA_LAUNCHED();
  split_queries<<<64, 256, 0, st>>>(k.q, nq_total, k.qmax, k.qhi, k.qlo);
  KVSCORE_CUDA_LAUNCHED();
  const std::size_t smem = TcSmem<DIM>::bytes;
  KVSCORE_CUDA_CHECK(cudaFuncSetAttribute(stats_tc<DIM>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  KVSCORE_CUDA_CHECK(cudaFuncSetAttribute(accumulate_tc<DIM>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  stats_tc<DIM><<<dim3(grid_dim(s.nkb), grid_dim(s.H), grid_dim((s.nq + kTcT - 1) / kTcT)), kThreads, smem, st>>>(
      keys, s, k, vec16);
  KVSCORE_CUDA_LAUNCHED();
  combine<<<grid_dim((s.H * s.nq + 255) / 256), 256, 0, st>>>(s, k);
  KVSCORE_CUDA_LAUNCHED();
  accumulate_tc<DIM><<<dim3(grid_dim((s.N + kTcT - 1) / kTcT), grid_dim(s.H)), kThreads, smem, st>>>(keys, s, k, vec16);
  KVSCORE_CUDA_LAUNCHED();
}

/// k.q[((b*heads + h)*w + i)*d + j] = float(double(q[b][h][n - w + i][j]) / sqrt(d)): the CPU
/// SnapKV's rounding of its window queries (gathered to fp32, then scaled once in fp64).
template <dtype D>
__global__ void scale_queries(QueriesArg q, long long w, double inv_sqrt_d, float* out) {
  using S = typename Storage<D>::type;
  const S* base = static_cast<const S*>(q.data);
  const long long d = q.head_dim, total = q.batch * q.heads * w * d, first = q.n - w;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long j = i % d, r = (i / d) % w, bh = i / (d * w), b = bh / q.heads, h = bh % q.heads;
    const float x = widen<D>(base[b * q.batch_stride + h * q.head_stride + (first + r) * q.query_stride + j * q.dim_stride]);
    out[i] = __double2float_rn(__dmul_rn(double(x), inv_sqrt_d));
  }
}

template <dtype D>
void run(const KeysArg& a, const ScoresArg& out, const SnapKVArg& qa, Workspace ws, cudaStream_t st) {
  const long long q_heads = qa.q_heads, w = qa.window, kernel = qa.kernel_size;
  using S = typename Storage<D>::type;
  const S* keys = static_cast<const S*>(a.data);
  Shape s{};
  s.H = a.heads;
  s.N = a.tokens;
  s.d = a.head_dim;
  s.hs = a.head_stride;
  s.ts = a.token_stride;
  s.w = w;
  s.nq = q_heads / a.heads * w;
  s.nkb = (s.N + kKeysPerBlock - 1) / kKeysPerBlock;
  s.P = qa.after_cache ? s.N : s.N - w;  // the queries sit at P + i: in the cache, or after it
  s.T = tile_for(s.d);
  Carver c(ws.data);
  const Work k = carve(c, s.H, s.N, s.d, q_heads, w);
  if (qa.host_scaled != nullptr) {
    KVSCORE_CUDA_CHECK(cudaMemcpyAsync(k.q, qa.host_scaled, std::size_t(q_heads * w * s.d) * sizeof(float),
                                       cudaMemcpyHostToDevice, st));
  } else {
    for_dtype(qa.device.type, [&](auto QD) {
      scale_queries<decltype(QD)::value><<<grid_dim(std::min<long long>((q_heads * w * s.d + 255) / 256, 1024)), 256, 0,
                                           st>>>(qa.device, w, qa.inv_sqrt_d, k.q);
    });
    KVSCORE_CUDA_LAUNCHED();
  }
  validity<D><<<dim3(grid_dim((s.N + 7) / 8), grid_dim(s.H)), kThreads, 0, st>>>(keys, s, k);
  KVSCORE_CUDA_LAUNCHED();
  if constexpr (D == dtype::f16) {
    if (tc_dim(s.d)) {
      const long long nq_total = q_heads * w * s.d;
      const bool vec16 = reinterpret_cast<std::uintptr_t>(a.data) % 16 == 0 && s.hs % 8 == 0 && s.ts % 8 == 0;
      if (s.d == 64) run_tc<64>(keys, s, k, vec16, nq_total, st);
      else if (s.d == 128) run_tc<128>(keys, s, k, vec16, nq_total, st);
      else run_tc<256>(keys, s, k, vec16, nq_total, st);
      pool<<<dim3(grid_dim((s.N + 255) / 256), grid_dim(s.H)), 256, 0, st>>>(s, k, kernel, out.data, out.head_stride);
      KVSCORE_CUDA_LAUNCHED();
      return;
    }
  }
  const std::size_t smem = smem_for(s.T, s.d);
  KVSCORE_CUDA_CHECK(cudaFuncSetAttribute(stats<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  KVSCORE_CUDA_CHECK(cudaFuncSetAttribute(accumulate<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  stats<D><<<dim3(grid_dim(s.nkb), grid_dim(s.H), grid_dim((s.nq + s.T - 1) / s.T)), kThreads, smem, st>>>(keys, s, k);
  KVSCORE_CUDA_LAUNCHED();
  combine<<<grid_dim((s.H * s.nq + 255) / 256), 256, 0, st>>>(s, k);
  KVSCORE_CUDA_LAUNCHED();
  accumulate<D><<<dim3(grid_dim((s.N + s.T - 1) / s.T), grid_dim(s.H)), kThreads, smem, st>>>(keys, s, k);
  KVSCORE_CUDA_LAUNCHED();
  pool<<<dim3(grid_dim((s.N + 255) / 256), grid_dim(s.H)), 256, 0, st>>>(s, k, kernel, out.data, out.head_stride);
  KVSCORE_CUDA_LAUNCHED();
}

}  // namespace

std::size_t snapkv_workspace_bytes(std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
                                   std::int64_t q_heads, std::int64_t window) noexcept {
  if (heads <= 0 || tokens <= 0) return 0;
  Carver c;
  carve(c, heads, tokens, head_dim, q_heads, window);
  return c.bytes();
}

void score_snapkv(const KeysArg& keys, const ScoresArg& out, const SnapKVArg& q, Workspace ws, stream_t stream) {
  if (keys.heads == 0 || keys.tokens == 0) return;
  require_no_pending_error("kvscore::cuda::score (SnapKV)");
  require_device_pointer(keys.data, "keys");
  require_device_pointer(out.data, "scores");
  if (q.host_scaled == nullptr) require_device_pointer(q.device.data, "queries");
  require_workspace(ws, snapkv_workspace_bytes(keys.heads, keys.tokens, keys.head_dim, q.q_heads, q.window),
                    "kvscore::cuda::score (SnapKV)");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  for_dtype(keys.type, [&](auto D) { run<decltype(D)::value>(keys, out, q, ws, st); });
}

}  // namespace kvscore::cuda::detail
