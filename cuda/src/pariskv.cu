// cuda/src/pariskv.cu — the GPU ParisKV index (include/kvscore/cuda/pariskv.hpp).
//   append: validate -> key mean (first append) -> encode (one thread per key)
//   search: validate + prepare queries -> tier tables -> collision scores + histogram ->
//           threshold -> candidate counts / scan / ordered write -> RSQ-IP -> top-k -> map.
// Compiled with -fmad=false (cuda/CMakeLists.txt): the encoding and the estimates follow the CPU
// index's operation order (kvscore/pariskv/pariskv.hpp), and a contracted multiply-add would change
// their last bits.
#include "common.cuh"

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kvscore/cuda/pariskv_kernels.hpp"

namespace kvscore::cuda::detail {
namespace {

constexpr int kBlock = 256;
constexpr int kPerThread = 16;                   // keys per thread in the candidate kernels
constexpr long long kChunk = kBlock * kPerThread;  // keys per block there
constexpr int kTiers = 6;
constexpr int kTierPercent[kTiers] = {5, 15, 30, 50, 75, 100};
constexpr unsigned long long kNoBad = ~0ull;

struct Consts {  // Lloyd–Max thresholds and code values (as the CPU index rounds them)
  float tau[7];
  float value[16];
};

// ------------------------------------------------------------------ validation

/// Row r = (head h = r / per_head, t = r % per_head) at x + h*hs + t*ts; records the first
/// non-finite element (code r*(d+1) + j) or a fp32 squared-norm overflow (code r*(d+1) + d),
/// the CPU's check_row in the same order.
template <dtype D>
__global__ void validate_rows(const typename Storage<D>::type* x, long long per_head, long long hs, long long ts,
                              long long d, long long rows, unsigned long long* bad) {
  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const typename Storage<D>::type* p = x + (r / per_head) * hs + (r % per_head) * ts;
  float sq = 0.f;
  for (long long j = 0; j < d; ++j) {
    const float v = widen<D>(p[j]);
    if (!isfinite(v)) {
      atomicMin(bad, (unsigned long long)(r * (d + 1) + j));
      return;
    }
    sq += v * v;
  }
  if (!isfinite(sq)) atomicMin(bad, (unsigned long long)(r * (d + 1) + d));
}

// ------------------------------------------------------------------ rotation

/// y[0..P) = H·D/√P · pad(x): signs then the unnormalised butterflies, fp32, the CPU's order.
template <int P>
__device__ __forceinline__ void fwht(float (&y)[P]) {
  for (int h = 1; h < P; h *= 2)
    for (int i = 0; i < P; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = y[j], b = y[j + h];
        y[j] = a + b;
        y[j + h] = a - b;
      }
}

// ------------------------------------------------------------------ append

template <dtype D>
__global__ void key_mean(const typename Storage<D>::type* x, long long n, long long hs, long long ts, long long d,
                         long long heads, float* mu) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= heads * d) return;
  const long long h = i / d, j = i % d;
  const typename Storage<D>::type* p = x + h * hs + j;
  double acc = 0;  // token order, as the CPU's set_mean
  for (long long t = 0; t < n; ++t) acc += double(widen<D>(p[t * ts]));
  mu[i] = float(acc / double(n));
}

struct EncodeArgs {
  long long d, m, B, nc, cb, cap, n0, n;
  bool has_mu;
  const float* mu;
  const float* signs;
  std::uint8_t* ids;
  std::uint8_t* codes;
  float* w;
  std::int32_t* pop;
  Consts k;
};

/// One thread per key: kvscore::ParisKV::encode, operation for operation.
template <dtype D, int P>
__global__ void __launch_bounds__(128) encode(EncodeArgs a, const typename Storage<D>::type* x, long long hs,
                                              long long ts) {
  constexpr int CB = (P + 31) / 32 * 16;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y;
  if (i >= a.n) return;
  const typename Storage<D>::type* r = x + h * hs + i * ts;
  const float* mu = a.mu + h * a.d;
  double sq = 0;
  for (long long j = 0; j < a.d; ++j) {
    const double v = double(widen<D>(r[j])) - (a.has_mu ? double(mu[j]) : 0.0);
    sq += v * v;
  }
  const double norm = sqrt(sq);
  float y[P];
  for (int j = 0; j < P; ++j) {
    if (j < a.d) {
      const double v = double(widen<D>(r[j])) - (a.has_mu ? double(mu[j]) : 0.0);
      const float xj = norm > 0 ? float(v / norm) : 0.f;
      y[j] = xj * a.signs[j];
    } else {
      y[j] = 0.f;
    }
  }
  fwht<P>(y);
  std::uint8_t code[CB];
  for (int c = 0; c < CB; ++c) code[c] = 0;
  const long long pos = a.n0 + i;
  for (long long b = 0; b < a.B; ++b) {
    double r2 = 0;
    for (long long j = 0; j < a.m; ++j) r2 += double(y[b * a.m + j]) * double(y[b * a.m + j]);
    const double rb = sqrt(r2);
    unsigned id = 0;
    double alpha = 0;
    for (long long j = 0; j < a.m; ++j) {
      const float v = y[b * a.m + j];
      if (v >= 0.f) id |= 1u << j;
      const float au = rb > 0 ? float(fabs(double(v)) / rb) : 0.f;
      int t = 0;
      while (t < 7 && au >= a.k.tau[t]) ++t;
      alpha += double(a.k.value[t]) * double(au);
      const std::uint8_t c = std::uint8_t(t | (v < 0.f ? 8 : 0));
      const long long jj = b * a.m + j, g = jj / 32, rr = jj % 32;
      code[g * 16 + rr % 16] |= rr < 16 ? c : std::uint8_t(c << 4);
    }
    a.ids[(h * a.B + b) * a.cap + pos] = std::uint8_t(id);
    atomicAdd(a.pop + (h * a.B + b) * a.nc + id, 1);  // integer: order-independent
    a.w[(h * a.cap + pos) * a.B + b] = rb > 0 ? float(norm * rb / alpha) : 0.f;
  }
  uint4* dst = reinterpret_cast<uint4*>(a.codes + (h * a.cap + pos) * a.cb);
#pragma unroll
  for (int c = 0; c < CB / 16; ++c) {
    uint4 u;
    std::memcpy(&u, code + 16 * c, 16);
    dst[c] = u;
  }
}

// ------------------------------------------------------------------ search: queries

struct PrepareArgs {
  long long d, pc, rows_per_kv;
  bool has_mu;
  const float* mu;  // [heads][d]
  const float* signs;
};

/// Per query row: ‖q‖ (fp64), the rotated unit query (pc floats, zero tail) and ⟨μ, q⟩ (fp64).
template <int P>
__global__ void prepare(PrepareArgs a, const float* q, long long rows, float* qrot, float* qnorm, double* cdot) {
  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const float* x = q + r * a.d;
  double sq = 0;
  for (long long j = 0; j < a.d; ++j) sq += double(x[j]) * double(x[j]);
  const double qn = sqrt(sq);
  // a zero query (the CPU's rule), and a non-finite one, which throws at the end of the
  // search: all-zero tables, so nothing downstream reads a NaN-derived index
  const bool ok = qn != 0 && isfinite(qn);
  float y[P];
  for (int j = 0; j < P; ++j) y[j] = (j < a.d && ok) ? float(double(x[j]) / qn) * a.signs[j] : 0.f;
  if (ok) fwht<P>(y);
  float* out = qrot + r * a.pc;
  for (int j = 0; j < P; ++j) out[j] = y[j];
  for (long long j = P; j < a.pc; ++j) out[j] = 0.f;
  qnorm[r] = ok ? float(qn) : 0.f;
  double c = 0;
  if (a.has_mu) {
    const float* mu = a.mu + (r / a.rows_per_kv) * a.d;
    for (long long j = 0; j < a.d; ++j) c += double(mu[j]) * double(x[j]);
  }
  cdot[r] = c;
}

// ------------------------------------------------------------------ search: Stage I

struct Limits {
  long long t[kTiers];
};

using PatternSort = cub::BlockRadixSort<unsigned long long, kBlock, 1>;
using LongScan = cub::BlockScan<long long, kBlock>;

/// Block (b, r): the weight of each of the 2^m sign patterns of subspace b for query row r.
/// Patterns in descending ⟨q̃_b, s⟩ = the flip sets of sign(q̃_b) in ascending cost (the costs
/// 2|q̃_j| of the set summed in sorted order, fp32, as the CPU's enumeration); the best pattern
/// first, then by (cost, id) — the CPU's order, exact ties included.
/// weight = #{tiers t : keys in better-ranked patterns < limit_t}.
__global__ void __launch_bounds__(kBlock) tier_table(const float* qrot, const float* qnorm, const std::int32_t* pop,
                                                     long long pc, int m, long long B, long long rows_per_kv, Limits lim,
                                                     std::uint8_t* tbl) {
  __shared__ union {
    typename PatternSort::TempStorage sort;
    typename LongScan::TempStorage scan;
  } tmp;
  const long long r = blockIdx.y, b = blockIdx.x, h = r / rows_per_kv;
  const int nc = 1 << m, tid = threadIdx.x;
  std::uint8_t* out = tbl + (r * B + b) * nc;
  if (qnorm[r] == 0.f) {  // zero query: every score 0, the first positions win (the CPU's rule)
    if (tid < nc) out[tid] = 0;
    return;
  }
  const float* qb = qrot + r * pc + b * m;
  float cost[8];
  int ord[8];
  unsigned best = 0;
  for (int j = 0; j < m; ++j) {
    cost[j] = 2.f * fabsf(qb[j]);
    if (qb[j] >= 0.f) best |= 1u << j;
  }
  for (int j = 0; j < m; ++j) ord[j] = j;
  for (int j = 0; j < m; ++j) {  // rank by (cost, index), as the CPU's std::sort comparator
    int rk = 0;
    for (int i = 0; i < m; ++i) rk += cost[i] < cost[j] || (cost[i] == cost[j] && i < j);
    ord[rk] = j;
  }
  unsigned long long key[1] = {~0ull};
  if (tid < nc) {
    const unsigned flip = unsigned(tid) ^ best;
    float s = 0.f;
    for (int k = 0; k < m; ++k)
      if (flip & (1u << ord[k])) s = s + cost[ord[k]];
    key[0] = unsigned(tid) == best ? 0ull : (static_cast<unsigned long long>(__float_as_uint(s)) << 32) | unsigned(tid + 1);
  }
  PatternSort(tmp.sort).Sort(key);
  __syncthreads();
  const bool valid = key[0] != ~0ull;
  const unsigned id = key[0] == 0ull ? best : unsigned(key[0] & 0xFFFFFFFFull) - 1u;
  long long cnt = valid ? pop[(h * B + b) * nc + id] : 0, before = 0;
  LongScan(tmp.scan).ExclusiveSum(cnt, before);
  if (valid) {
    int wgt = 0;
#pragma unroll
    for (int t = 0; t < kTiers; ++t) wgt += before < lim.t[t];
    out[id] = std::uint8_t(wgt);
  }
}

/// Collision scores of 4 keys per thread (uint8 ids, tables in shared memory), a fused
/// histogram of the scores, and optionally the scores as int32 (tests).
__global__ void __launch_bounds__(kBlock) collide(const std::uint8_t* ids, long long cap, long long n, long long B,
                                                  int nc, long long rows_per_kv, const std::uint8_t* tbl,
                                                  std::uint16_t* S, long long npad, int* hist, int nbins,
                                                  std::int32_t* col) {
  extern __shared__ unsigned char sm[];
  const long long tbytes = B * nc, r = blockIdx.y, h = r / rows_per_kv;
  std::uint8_t* st = sm;
  int* sh = reinterpret_cast<int*>(sm + (tbytes + 15) / 16 * 16);
  for (long long i = threadIdx.x; i < tbytes; i += kBlock) st[i] = tbl[r * tbytes + i];
  for (int i = threadIdx.x; i < nbins; i += kBlock) sh[i] = 0;
  __syncthreads();
  const long long t0 = ((long long)blockIdx.x * kBlock + threadIdx.x) * 4;
  if (t0 < n) {
    unsigned a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    const std::uint8_t* base = ids + h * B * cap + t0;
    for (long long b = 0; b < B; ++b) {
      const uchar4 v = *reinterpret_cast<const uchar4*>(base + b * cap);
      const std::uint8_t* tb = st + b * nc;
      a0 += tb[v.x];
      a1 += tb[v.y];
      a2 += tb[v.z];
      a3 += tb[v.w];
    }
    *reinterpret_cast<ushort4*>(S + r * npad + t0) =
        make_ushort4((unsigned short)a0, (unsigned short)a1, (unsigned short)a2, (unsigned short)a3);
    const unsigned a[4] = {a0, a1, a2, a3};
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (t0 + q < n) {
        atomicAdd(sh + a[q], 1);
        if (col != nullptr) col[r * n + t0 + q] = std::int32_t(a[q]);
      }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nbins; i += kBlock)
    if (sh[i] != 0) atomicAdd(hist + r * nbins + i, sh[i]);
}

/// Per row: threshold T and need_eq so that S > T plus the first need_eq with S == T are C keys.
__global__ void threshold(const int* hist, int nbins, long long rows, long long C, long long* T, long long* need) {
  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  long long above = 0;
  for (int v = nbins - 1; v >= 0; --v) {
    const long long cnt = hist[r * nbins + v];
    if (above + cnt >= C) {
      T[r] = v;
      need[r] = C - above;
      return;
    }
    above += cnt;
  }
  T[r] = 0;
  need[r] = C - above;
}

__device__ __forceinline__ void load_scores(const std::uint16_t* S, long long b, long long n, unsigned (&s)[kPerThread],
                                            long long& first) {
  first = b + (long long)threadIdx.x * kPerThread;
#pragma unroll
  for (int q = 0; q < kPerThread; ++q) s[q] = first + q < n ? S[first + q] : 0u;
}

__global__ void __launch_bounds__(kBlock) cand_count(const std::uint16_t* S, long long npad, long long n,
                                                     const long long* T, long long chunks, long long* gt, long long* eq) {
  __shared__ typename cub::BlockReduce<long long, kBlock>::TempStorage tmp;
  const long long r = blockIdx.y, c = blockIdx.x;
  unsigned s[kPerThread];
  long long first;
  load_scores(S + r * npad, c * kChunk, n, s, first);
  long long g = 0, q = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i)
    if (first + i < n) {
      g += (long long)s[i] > T[r];
      q += (long long)s[i] == T[r];
    }
  const long long G = cub::BlockReduce<long long, kBlock>(tmp).Sum(g);
  __syncthreads();
  const long long Q = cub::BlockReduce<long long, kBlock>(tmp).Sum(q);
  if (threadIdx.x == 0) {
    gt[r * chunks + c] = G;
    eq[r * chunks + c] = Q;
  }
}

/// Per row, in chunk order: the first output rank of each chunk and the equal keys before it.
__global__ void cand_scan(long long rows, long long chunks, const long long* need, long long* gt, long long* eq) {
  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  long long eq_before = 0, out_before = 0;
  for (long long c = 0; c < chunks; ++c) {
    const long long G = gt[r * chunks + c], Q = eq[r * chunks + c];
    const long long want = need[r] - eq_before;
    const long long take_eq = want <= 0 ? 0 : (want < Q ? want : Q);
    gt[r * chunks + c] = out_before;
    eq[r * chunks + c] = eq_before;
    out_before += G + take_eq;
    eq_before += Q;
  }
}

/// The candidates of each chunk in ascending position: S > T, or S == T among the first need_eq.
__global__ void __launch_bounds__(kBlock) cand_write(const std::uint16_t* S, long long npad, long long n,
                                                     const long long* T, const long long* need, long long chunks,
                                                     const long long* out_before, const long long* eq_before,
                                                     long long C, long long* cand) {
  __shared__ typename LongScan::TempStorage tmp;
  const long long r = blockIdx.y, c = blockIdx.x, th = T[r], nd = need[r];
  unsigned s[kPerThread];
  long long first;
  load_scores(S + r * npad, c * kChunk, n, s, first);
  long long q = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) q += first + i < n && (long long)s[i] == th;
  long long eq_rank = 0;
  LongScan(tmp).ExclusiveSum(q, eq_rank);
  __syncthreads();
  eq_rank += eq_before[r * chunks + c];
  bool take[kPerThread];
  long long cnt = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const bool in = first + i < n, is_eq = in && (long long)s[i] == th;
    take[i] = in && ((long long)s[i] > th || (is_eq && eq_rank < nd));
    eq_rank += is_eq;
    cnt += take[i];
  }
  long long at = 0;
  LongScan(tmp).ExclusiveSum(cnt, at);
  at += out_before[r * chunks + c];
  long long* out = cand + r * C;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i)
    if (take[i]) out[at++] = first + i;
}

// ------------------------------------------------------------------ search: Stage II

struct RsqArgs {
  long long cap, cb, B, m, pc, rows_per_kv, C;
  const std::uint8_t* codes;
  const float* w;
  Consts k;
};

/// RSQ-IP of one candidate per thread, in the CPU kernels' one order (pariskv/kernels.hpp,
/// "The estimate"): coordinates in segments of len inside a subspace, a fused chain per
/// segment, a fused chain per lane over the lane groups (segment s is lane s mod 16), the fixed
/// 16-lane tree, times ‖q‖. Explicit __fmaf_rn/__fadd_rn: nvcc must not contract differently.
__global__ void __launch_bounds__(kBlock) rsq_ip(RsqArgs a, const float* qrot, const float* qnorm,
                                                 const long long* cand, float* est) {
  __shared__ float q[512];
  __shared__ float value[16];
  const long long r = blockIdx.y, h = r / a.rows_per_kv;
  for (long long i = threadIdx.x; i < a.pc; i += kBlock) q[i] = qrot[r * a.pc + i];
  if (threadIdx.x < 16) value[threadIdx.x] = a.k.value[threadIdx.x];
  __syncthreads();
  const long long c = (long long)blockIdx.x * kBlock + threadIdx.x;
  if (c >= a.C) return;
  const long long pos = cand[r * a.C + c];
  const std::uint8_t* cp = a.codes + (h * a.cap + pos) * a.cb;
  const float* wp = a.w + (h * a.cap + pos) * a.B;
  const long long P = a.B * a.m, len = P >= 16 ? min(a.m, P / 16) : 1, S = P / len;
  float s[16];
  for (int l = 0; l < 16; ++l) s[l] = 0.f;
  for (long long seg = 0; seg < S; ++seg) {
    float part = 0.f;
    for (long long t = 0; t < len; ++t) {
      const long long j = seg * len + t, rr = j % 32;
      const std::uint8_t byte = __ldg(cp + (j / 32) * 16 + rr % 16);
      part = __fmaf_rn(value[rr < 16 ? byte & 15 : byte >> 4], q[j], part);
    }
    s[seg % 16] = __fmaf_rn(__ldg(wp + seg * len / a.m), part, s[seg % 16]);
  }
  float t8[8], t4[4];
  for (int l = 0; l < 8; ++l) t8[l] = __fadd_rn(s[l], s[l + 8]);
  for (int l = 0; l < 4; ++l) t4[l] = __fadd_rn(t8[l], t8[l + 4]);
  const float e = __fadd_rn(__fadd_rn(t4[0], t4[2]), __fadd_rn(t4[1], t4[3]));
  est[r * a.C + c] = __fmul_rn(e, qnorm[r]);
}

/// positions[r][i] = cand[r][top[r][i]]; scores = estimate + ⟨μ, q⟩ (fp64, as the CPU).
__global__ void map_results(long long rows, long long k, long long C, const long long* top, const long long* cand,
                            const float* est, const double* cdot, std::int64_t* positions, float* scores) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * k) return;
  const long long r = i / k, ci = top[i];
  positions[i] = cand[r * C + ci];
  scores[i] = float(double(est[r * C + ci]) + cdot[r]);
}

// ------------------------------------------------------------------ host side

/// One element as the library's own conversions widen it (kvscore/core/dtype.hpp).
float widen_host(dtype t, const void* p) {
  if (t == dtype::f32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  std::uint16_t u;
  std::memcpy(&u, p, 2);
  return t == dtype::bf16 ? kvscore::bf16_bits_to_float(u) : kvscore::half_bits_to_float(u);
}

std::size_t elem_bytes(dtype t) { return t == dtype::f32 ? 4 : 2; }

/// The first invalid row recorded by validate_rows, as the CPU's message; "" if none.
std::string bad_row_message(unsigned long long code, const void* data, dtype type, long long per_head, long long hs,
                            long long ts, long long d, const char* what, long long index_base, const char* head_word) {
  if (code == kNoBad) return {};
  const long long r = (long long)(code / (unsigned long long)(d + 1)), j = (long long)(code % (unsigned long long)(d + 1));
  const long long h = r / per_head, t = r % per_head;
  std::string s = std::string(what) + " " + std::to_string(index_base + t) + " of " + head_word + " " + std::to_string(h);
  if (j == d) return s + " has a squared norm that overflows fp32 (magnitude above ~1.8e19)";
  unsigned char buf[4] = {};
  const auto* at = static_cast<const unsigned char*>(data) + std::size_t(h * hs + t * ts + j) * elem_bytes(type);
  KVSCORE_CUDA_CHECK(cudaMemcpy(buf, at, elem_bytes(type), cudaMemcpyDeviceToHost));
  return s + " has a non-finite value " + std::to_string(widen_host(type, buf)) + " at element " + std::to_string(j);
}

template <dtype D>
void launch_validate(const void* x, long long per_head, long long hs, long long ts, long long d, long long rows,
                     unsigned long long* bad, cudaStream_t st) {
  validate_rows<D><<<grid_dim((rows + 255) / 256), 256, 0, st>>>(static_cast<const typename Storage<D>::type*>(x),
                                                                 per_head, hs, ts, d, rows, bad);
  KVSCORE_CUDA_LAUNCHED();
}

void validate_any(dtype t, const void* x, long long per_head, long long hs, long long ts, long long d, long long rows,
                  unsigned long long* bad, cudaStream_t st) {
  KVSCORE_CUDA_CHECK(cudaMemsetAsync(bad, 0xFF, sizeof(unsigned long long), st));
  if (rows == 0) return;
  for_dtype(t, [&](auto D) { launch_validate<decltype(D)::value>(x, per_head, hs, ts, d, rows, bad, st); });
}

Consts consts_of(const ParisKVState& s) {
  Consts k{};
  for (int t = 0; t < 7; ++t) k.tau[t] = s.tau[t];
  for (int t = 0; t < 16; ++t) k.value[t] = s.value[t];
  return k;
}

template <dtype D, int P>
void launch_encode(const EncodeArgs& a, const KeysArg& k, cudaStream_t st) {
  const dim3 grid(grid_dim((a.n + 127) / 128), grid_dim(k.heads));
  encode<D, P><<<grid, 128, 0, st>>>(a, static_cast<const typename Storage<D>::type*>(k.data), k.head_stride,
                                     k.token_stride);
  KVSCORE_CUDA_LAUNCHED();
}

template <dtype D>
void encode_dispatch(long long P, const EncodeArgs& a, const KeysArg& k, cudaStream_t st) {
  switch (P) {  // closed set: the padded head_dim (power of two, 2..512)
    case 2: launch_encode<D, 2>(a, k, st); break;
    case 4: launch_encode<D, 4>(a, k, st); break;
    case 8: launch_encode<D, 8>(a, k, st); break;
    case 16: launch_encode<D, 16>(a, k, st); break;
    case 32: launch_encode<D, 32>(a, k, st); break;
    case 64: launch_encode<D, 64>(a, k, st); break;
    case 128: launch_encode<D, 128>(a, k, st); break;
    case 256: launch_encode<D, 256>(a, k, st); break;
    case 512: launch_encode<D, 512>(a, k, st); break;
    default: throw std::invalid_argument("kvscore::cuda::ParisKV: padded head_dim " + std::to_string(P) + " unsupported");
  }
}

template <dtype D>
void launch_mean(const KeysArg& k, float* mu, cudaStream_t st) {
  const long long total = k.heads * k.head_dim;
  key_mean<D><<<grid_dim((total + 127) / 128), 128, 0, st>>>(static_cast<const typename Storage<D>::type*>(k.data),
                                                            k.tokens, k.head_stride, k.token_stride, k.head_dim,
                                                            k.heads, mu);
  KVSCORE_CUDA_LAUNCHED();
}

template <int P>
void launch_prepare(const PrepareArgs& a, const float* q, long long rows, float* qrot, float* qnorm, double* cdot,
                    cudaStream_t st) {
  prepare<P><<<grid_dim((rows + 63) / 64), 64, 0, st>>>(a, q, rows, qrot, qnorm, cdot);
  KVSCORE_CUDA_LAUNCHED();
}

void prepare_dispatch(long long P, const PrepareArgs& a, const float* q, long long rows, float* qrot, float* qnorm,
                      double* cdot, cudaStream_t st) {
  switch (P) {
    case 2: launch_prepare<2>(a, q, rows, qrot, qnorm, cdot, st); break;
    case 4: launch_prepare<4>(a, q, rows, qrot, qnorm, cdot, st); break;
    case 8: launch_prepare<8>(a, q, rows, qrot, qnorm, cdot, st); break;
    case 16: launch_prepare<16>(a, q, rows, qrot, qnorm, cdot, st); break;
    case 32: launch_prepare<32>(a, q, rows, qrot, qnorm, cdot, st); break;
    case 64: launch_prepare<64>(a, q, rows, qrot, qnorm, cdot, st); break;
    case 128: launch_prepare<128>(a, q, rows, qrot, qnorm, cdot, st); break;
    case 256: launch_prepare<256>(a, q, rows, qrot, qnorm, cdot, st); break;
    case 512: launch_prepare<512>(a, q, rows, qrot, qnorm, cdot, st); break;
    default: throw std::invalid_argument("kvscore::cuda::ParisKV: padded head_dim " + std::to_string(P) + " unsupported");
  }
}

struct SearchWork {
  unsigned long long* bad;
  float* qrot;
  float* qnorm;
  double* cdot;
  std::uint8_t* tbl;
  std::uint16_t* S;
  int* hist;
  long long *T, *need, *gt, *eq, *cand, *top;
  float* est;
  void* topk_ws;
  std::size_t topk_bytes;
};

long long npad_of(long long n) { return (n + 3) / 4 * 4; }
long long chunks_of(long long n) { return (n + kChunk - 1) / kChunk; }

SelectPlan topk_plan(long long rows, long long C, long long k) {
  SelectPlan p;
  p.heads = rows;
  p.tokens = C;
  p.score_head_stride = C;
  p.per_head = k;
  p.layer = rows * k;
  p.sink_end = 0;
  p.recent_begin = C;
  p.protect = 0;
  return p;
}

SearchWork carve_search(Carver& c, const ParisKVState& s, const ParisKVSearchArgs& a, long long n) {
  const long long R = a.q_heads * a.n_queries, nbins = 6 * s.B + 1, chunks = chunks_of(n);
  SearchWork w{};
  w.bad = c.take<unsigned long long>(1);
  w.qrot = c.take<float>(std::size_t(R * s.pc));
  w.qnorm = c.take<float>(std::size_t(R));
  w.cdot = c.take<double>(std::size_t(R));
  w.tbl = c.take<std::uint8_t>(std::size_t(R * s.B * s.nc));
  w.S = c.take<std::uint16_t>(std::size_t(R * npad_of(n)));
  w.hist = c.take<int>(std::size_t(R * nbins));
  w.T = c.take<long long>(std::size_t(R));
  w.need = c.take<long long>(std::size_t(R));
  w.gt = c.take<long long>(std::size_t(R * chunks));
  w.eq = c.take<long long>(std::size_t(R * chunks));
  w.cand = c.take<long long>(std::size_t(R * a.C));
  w.top = c.take<long long>(std::size_t(R * a.k));
  w.est = c.take<float>(std::size_t(R * a.C));
  w.topk_bytes = select_workspace_bytes(topk_plan(R, a.C, a.k));
  w.topk_ws = c.take<unsigned char>(w.topk_bytes);
  return w;
}

}  // namespace

std::size_t pariskv_append_workspace_bytes(const ParisKVState&, std::int64_t) noexcept {
  Carver c;
  c.take<unsigned long long>(1);
  return c.bytes();
}

void pariskv_validate(const ParisKVState& s, const KeysArg& k, Workspace ws, stream_t stream) {
  const char* who = "kvscore::cuda::ParisKV::append";
  require_no_pending_error(who);
  require_workspace(ws, pariskv_append_workspace_bytes(s, k.tokens), who);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  Carver c(ws.data);
  unsigned long long* bad = c.take<unsigned long long>(1);
  const long long n = k.tokens;
  validate_any(k.type, k.data, n, k.head_stride, k.token_stride, k.head_dim, k.heads * n, bad, st);
  unsigned long long code = kNoBad;
  KVSCORE_CUDA_CHECK(cudaMemcpyAsync(&code, bad, sizeof(code), cudaMemcpyDeviceToHost, st));
  KVSCORE_CUDA_CHECK(cudaStreamSynchronize(st));
  const std::string msg =
      bad_row_message(code, k.data, k.type, n, k.head_stride, k.token_stride, k.head_dim, "key", s.n, "head");
  if (!msg.empty()) throw std::invalid_argument(std::string(who) + ": " + msg);
}

void pariskv_encode(ParisKVState& s, const KeysArg& k, stream_t stream) {
  require_no_pending_error("kvscore::cuda::ParisKV::append");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const long long n = k.tokens;
  if (s.center && !s.has_mu) {
    for_dtype(k.type, [&](auto D) { launch_mean<decltype(D)::value>(k, s.mu, st); });
    s.has_mu = true;
  }
  EncodeArgs a{};
  a.d = s.d;
  a.m = s.m;
  a.B = s.B;
  a.nc = s.nc;
  a.cb = s.cb;
  a.cap = s.cap;
  a.n0 = s.n;
  a.n = n;
  a.has_mu = s.has_mu;
  a.mu = s.mu;
  a.signs = s.signs;
  a.ids = s.ids;
  a.codes = s.codes;
  a.w = s.w;
  a.pop = s.pop;
  a.k = consts_of(s);
  for_dtype(k.type, [&](auto D) { encode_dispatch<decltype(D)::value>(s.P, a, k, st); });
  KVSCORE_CUDA_CHECK(cudaStreamSynchronize(st));
  s.n += n;
}

std::size_t pariskv_search_workspace_bytes(const ParisKVState& s, const ParisKVSearchArgs& a, std::int64_t tokens) noexcept {
  Carver c;
  carve_search(c, s, a, tokens);
  return c.bytes();
}

void pariskv_search(const ParisKVState& s, const ParisKVSearchArgs& a, const float* queries, std::int64_t* positions,
                    float* scores, std::int32_t* collisions, Workspace ws, stream_t stream) {
  const char* who = "kvscore::cuda::ParisKV::search";
  const long long R = a.q_heads * a.n_queries, n = s.n;
  if (R == 0) return;
  require_no_pending_error(who);
  require_workspace(ws, pariskv_search_workspace_bytes(s, a, n), who);
  if (R > 65535) throw std::invalid_argument(std::string(who) + ": " + std::to_string(R) + " query rows exceed 65535");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  Carver c(ws.data);
  const SearchWork w = carve_search(c, s, a, n);
  const long long rows_per_kv = R / s.heads;  // = G · n_queries: row r searches KV head r / rows_per_kv
  validate_any(dtype::f32, queries, R, 0, s.d, s.d, R, w.bad, st);
  const bool stage1 = n > 0 && (a.k > 0 || collisions != nullptr);
  if (stage1) {
    PrepareArgs pa{s.d, s.pc, rows_per_kv, s.has_mu, s.mu, s.signs};
    prepare_dispatch(s.P, pa, queries, R, w.qrot, w.qnorm, w.cdot, st);
    Limits lim{};
    for (int t = 0; t < kTiers; ++t) lim.t[t] = (a.collided * kTierPercent[t] + 99) / 100;
    tier_table<<<dim3(grid_dim(s.B), grid_dim(R)), kBlock, 0, st>>>(w.qrot, w.qnorm, s.pop, s.pc, int(s.m), s.B,
                                                                    rows_per_kv, lim, w.tbl);
    KVSCORE_CUDA_LAUNCHED();
    const int nbins = int(6 * s.B + 1);
    KVSCORE_CUDA_CHECK(cudaMemsetAsync(w.hist, 0, std::size_t(R * nbins) * sizeof(int), st));
    const std::size_t shm = std::size_t((s.B * s.nc + 15) / 16 * 16) + std::size_t(nbins) * sizeof(int);
    collide<<<dim3(grid_dim((n + 4 * kBlock - 1) / (4 * kBlock)), grid_dim(R)), kBlock, shm, st>>>(
        s.ids, s.cap, n, s.B, int(s.nc), rows_per_kv, w.tbl, w.S, npad_of(n), w.hist, nbins, collisions);
    KVSCORE_CUDA_LAUNCHED();
    if (a.k > 0) {
      const long long chunks = chunks_of(n);
      threshold<<<grid_dim((R + 127) / 128), 128, 0, st>>>(w.hist, nbins, R, a.C, w.T, w.need);
      KVSCORE_CUDA_LAUNCHED();
      cand_count<<<dim3(grid_dim(chunks), grid_dim(R)), kBlock, 0, st>>>(w.S, npad_of(n), n, w.T, chunks, w.gt, w.eq);
      KVSCORE_CUDA_LAUNCHED();
      cand_scan<<<grid_dim((R + 127) / 128), 128, 0, st>>>(R, chunks, w.need, w.gt, w.eq);
      KVSCORE_CUDA_LAUNCHED();
      cand_write<<<dim3(grid_dim(chunks), grid_dim(R)), kBlock, 0, st>>>(w.S, npad_of(n), n, w.T, w.need, chunks, w.gt,
                                                                         w.eq, a.C, w.cand);
      KVSCORE_CUDA_LAUNCHED();
      RsqArgs ra{s.cap, s.cb, s.B, s.m, s.pc, rows_per_kv, a.C, s.codes, s.w, consts_of(s)};
      rsq_ip<<<dim3(grid_dim((a.C + kBlock - 1) / kBlock), grid_dim(R)), kBlock, 0, st>>>(ra, w.qrot, w.qnorm, w.cand,
                                                                                          w.est);
      KVSCORE_CUDA_LAUNCHED();
      select_into(w.est, topk_plan(R, a.C, a.k), {w.topk_ws, w.topk_bytes}, nullptr,
                  reinterpret_cast<std::int64_t*>(w.top), stream);
      map_results<<<grid_dim((R * a.k + 255) / 256), 256, 0, st>>>(R, a.k, a.C, w.top, w.cand, w.est, w.cdot,
                                                                   positions, scores);
      KVSCORE_CUDA_LAUNCHED();
    }
  }
  unsigned long long code = kNoBad;
  KVSCORE_CUDA_CHECK(cudaMemcpyAsync(&code, w.bad, sizeof(code), cudaMemcpyDeviceToHost, st));
  KVSCORE_CUDA_CHECK(cudaStreamSynchronize(st));
  const std::string msg = bad_row_message(code, queries, dtype::f32, a.n_queries, a.n_queries * s.d, s.d, s.d, "query", 0,
                                          "query head");
  if (!msg.empty()) throw std::invalid_argument(std::string(who) + ": " + msg);
}

}  // namespace kvscore::cuda::detail
