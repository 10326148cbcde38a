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
#include "common.cuh"

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

template <dtype D>
void run(const KeysArg& a, const ScoresArg& out, const float* host_q, long long q_heads, long long w,
         long long kernel, Workspace ws, cudaStream_t st) {
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
  s.P = s.N - w;
  s.T = tile_for(s.d);
  Carver c(ws.data);
  const Work k = carve(c, s.H, s.N, s.d, q_heads, w);
  KVSCORE_CUDA_CHECK(
      cudaMemcpyAsync(k.q, host_q, std::size_t(q_heads * w * s.d) * sizeof(float), cudaMemcpyHostToDevice, st));
  validity<D><<<dim3(grid_dim((s.N + 7) / 8), grid_dim(s.H)), kThreads, 0, st>>>(keys, s, k);
  KVSCORE_CUDA_LAUNCHED();
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

void score_snapkv(const KeysArg& keys, const ScoresArg& out, const float* host_scaled_queries, std::int64_t q_heads,
                  std::int64_t window, std::int64_t kernel_size, Workspace ws, stream_t stream) {
  if (keys.heads == 0 || keys.tokens == 0) return;
  require_no_pending_error("kvscore::cuda::score (SnapKV)");
  require_device_pointer(keys.data, "keys");
  require_device_pointer(out.data, "scores");
  require_workspace(ws, snapkv_workspace_bytes(keys.heads, keys.tokens, keys.head_dim, q_heads, window),
                    "kvscore::cuda::score (SnapKV)");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  for_dtype(keys.type, [&](auto D) {
    run<decltype(D)::value>(keys, out, host_scaled_queries, q_heads, window, kernel_size, ws, st);
  });
}

}  // namespace kvscore::cuda::detail
