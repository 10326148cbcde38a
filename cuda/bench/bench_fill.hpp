// cuda/bench/bench_fill.hpp — random benchmark data drawn on the device (fill.cu): seconds for the
// 32 × 1M fp16 key cache, where a host generator took minutes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvbench {

/// out[i] ~ N(0, 1), a function of (seed, i) only; device pointers; synchronous.
void fill_normal_f32(float* out, std::size_t n, std::uint64_t seed);
/// The same draws rounded to fp16 (out: device, n halves).
void fill_normal_f16(void* out, std::size_t n, std::uint64_t seed);
/// Keys [H][N][d] fp16 with the structure of real keys: per-head channel offsets and scales plus a
/// planted rank-`rank` part, key = off[j] + scale[j]·g + 0.4·Σ_r z_r·basis[r][j] (rank <= 64).
/// off, scale: device [H][d]; basis: device [H][rank][d].
void fill_structured_f16(void* out, long long H, long long N, long long d, const float* off, const float* scale,
                         const float* basis, int rank, std::uint64_t seed);

}  // namespace kvbench
