// Exhaustive checks of the 16-bit element types against independent references.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kvscore/core/dtype.hpp"
#include "kvscore/simd/dispatch.hpp"

using kvscore::bfloat16;
using kvscore::half;

namespace {

// Reference half -> float by the IEEE formula (ldexp), not by bit shuffling.
float half_reference(std::uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0x1f) return mant ? std::numeric_limits<float>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return float(sign * std::ldexp(double(mant), -24));
  return float(sign * std::ldexp(double(1024 + mant), exp - 25));
}

// Reference nearest-even rounding: pick the nearer of the two bracketing finite
// values in double arithmetic; exact ties go to the even bit pattern.
template <class Dec>
std::uint16_t round_reference(float f, Dec decode, std::uint16_t max_finite, std::uint16_t inf_bits) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(double(f));
  // overflow threshold: halfway between max finite and the next step (2 ulps of max above)
  const double maxv = decode(max_finite);
  const double below = decode(std::uint16_t(max_finite - 1));
  if (a >= maxv + (maxv - below) / 2) {
    // exactly halfway rounds to even: max_finite is odd, so ties go to Inf as well
    return std::uint16_t(sign | inf_bits);
  }
  // binary search the largest magnitude pattern <= a
  std::uint16_t lo = 0, hi = max_finite;
  while (lo < hi) {
    const std::uint16_t mid = std::uint16_t((lo + hi + 1) / 2);
    if (decode(mid) <= a) lo = mid; else hi = std::uint16_t(mid - 1);
  }
  if (decode(lo) == a || lo == max_finite) return std::uint16_t(sign | lo);
  const double dl = a - decode(lo), du = decode(std::uint16_t(lo + 1)) - a;
  std::uint16_t r = (dl < du) ? lo : (du < dl ? std::uint16_t(lo + 1) : ((lo & 1) ? std::uint16_t(lo + 1) : lo));
  return std::uint16_t(sign | r);
}

std::uint16_t half_round_ref(float f) {
  return round_reference(f, [](std::uint16_t b) { return double(half_reference(b)); }, 0x7bff, 0x7c00);
}
std::uint16_t bf16_round_ref(float f) {
  return round_reference(f, [](std::uint16_t b) { return double(std::bit_cast<float>(std::uint32_t(b) << 16)); },
                         0x7f7f, 0x7f80);
}

}  // namespace

TEST_CASE("half -> float: all 65536 bit patterns match the IEEE formula", "[dtype]") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float got = kvscore::half_bits_to_float(std::uint16_t(b));
    const float ref = half_reference(std::uint16_t(b));
    if (std::isnan(ref)) {
      REQUIRE(std::isnan(got));
      // payload and sign survive widening
      REQUIRE((std::bit_cast<std::uint32_t>(got) >> 13 & 0x3ff) == (b & 0x3ff));
      REQUIRE(std::signbit(got) == bool(b & 0x8000));
    } else {
      REQUIRE(std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(ref));
    }
  }
}

TEST_CASE("float -> half: round trip of all 65536 patterns and every midpoint", "[dtype]") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float f = kvscore::half_bits_to_float(std::uint16_t(b));
    const std::uint16_t back = kvscore::float_to_half_bits(f);
    if (std::isnan(f)) {
      REQUIRE((back & 0x7c00) == 0x7c00);
      REQUIRE((back & 0x03ff) != 0);      // still NaN
      REQUIRE((back & 0x0200) != 0);      // quiet
    } else {
      REQUIRE(back == b);
    }
    // midpoints to the next magnitude and values just around them (the hard RNE cases)
    const std::uint16_t mag = std::uint16_t(b & 0x7fff);
    if (mag < 0x7bff) {
      const double lo = half_reference(mag), hi = half_reference(std::uint16_t(mag + 1));
      const float mid = float((lo + hi) / 2);  // exact: a half midpoint needs 12 significant bits
      for (float m : {mid, std::nextafterf(mid, 0.f), std::nextafterf(mid, INFINITY)})
        for (float s : {m, -m}) REQUIRE(kvscore::float_to_half_bits(s) == half_round_ref(s));
    }
  }
}

TEST_CASE("float -> half: random floats, subnormals, overflow against a reference", "[dtype]") {
  std::mt19937 rng(42);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t x = bits(rng);
    if (i % 2) x = (x & 0x807fffffu) | ((97u + x % 48u) << 23);  // exponents 2^-30..2^17: the half range
    const float f = std::bit_cast<float>(x);
    if (std::isnan(f)) continue;
    INFO("f = " << f);
    REQUIRE(kvscore::float_to_half_bits(f) == half_round_ref(f));
  }
  REQUIRE(kvscore::float_to_half_bits(65519.996f) == 0x7bff);
  REQUIRE(kvscore::float_to_half_bits(65520.0f) == 0x7c00);  // the tie rounds to even = Inf
  REQUIRE(kvscore::float_to_half_bits(std::ldexp(1.0f, -25)) == 0x0000);                    // tie to even 0
  REQUIRE(kvscore::float_to_half_bits(std::nextafter(std::ldexp(1.0f, -25), 1.f)) == 0x0001);
  REQUIRE(kvscore::float_to_half_bits(1e-45f) == 0x0000);  // fp32 subnormal
  REQUIRE(kvscore::float_to_half_bits(-INFINITY) == 0xfc00);
}

TEST_CASE("bfloat16: all 65536 patterns widen exactly and round trip - midpoints round to even", "[dtype]") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float f = kvscore::bf16_bits_to_float(std::uint16_t(b));
    REQUIRE(std::bit_cast<std::uint32_t>(f) == (b << 16));
    const std::uint16_t back = kvscore::float_to_bf16_bits(f);
    if (std::isnan(f)) {
      REQUIRE(std::isnan(kvscore::bf16_bits_to_float(back)));
    } else {
      REQUIRE(back == b);
      if ((b & 0x7fff) < 0x7f7f) {  // finite, next pattern finite
        for (std::uint32_t low : {0x7fffu, 0x8000u, 0x8001u}) {
          const float m = std::bit_cast<float>((b << 16) | low);
          REQUIRE(kvscore::float_to_bf16_bits(m) == bf16_round_ref(m));
        }
      }
    }
  }
}

TEST_CASE("vector convert() equals the scalar path bit for bit", "[dtype]") {
  INFO("convert path: " << kvscore::convert_path());
  std::vector<half> all(65536);
  for (std::uint32_t b = 0; b < 65536; ++b) all[b].bits = std::uint16_t(b);
  std::vector<float> fast(65536), slow(65536);
  kvscore::convert(all.data(), fast.data(), all.size());
  kvscore::convert_scalar(all.data(), slow.data(), all.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (std::isnan(slow[i])) REQUIRE(std::isnan(fast[i]));
    else REQUIRE(std::bit_cast<std::uint32_t>(fast[i]) == std::bit_cast<std::uint32_t>(slow[i]));
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  std::vector<float> src(100003);
  for (auto& f : src) f = std::bit_cast<float>(bits(rng) & 0xbfffffffu);  // |f| < 2: all in or below half range
  std::vector<half> h_fast(src.size()), h_slow(src.size());
  kvscore::convert(src.data(), h_fast.data(), src.size());
  kvscore::convert_scalar(src.data(), h_slow.data(), src.size());
  for (std::size_t i = 0; i < src.size(); ++i) {
    INFO("i = " << i << " f = " << src[i]);
    if (std::isnan(src[i])) REQUIRE(((h_fast[i].bits & 0x7c00) == 0x7c00 && (h_fast[i].bits & 0x3ff)));
    else REQUIRE(h_fast[i].bits == h_slow[i].bits);
  }
  std::vector<bfloat16> b(src.size());
  kvscore::convert(src.data(), b.data(), src.size());
  for (std::size_t i = 0; i < src.size(); ++i)
    if (!std::isnan(src[i])) REQUIRE(b[i].bits == kvscore::float_to_bf16_bits(src[i]));
}

TEST_CASE("convert(): every length 0..24 (the vector loop's tails) equals the scalar path, both ways", "[dtype]") {
  INFO("convert path: " << kvscore::convert_path());
  std::mt19937 rng(3);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (std::size_t n = 0; n <= 24; ++n) {
    INFO("n = " << n);
    std::vector<float> src(n + 1), back(n + 1, -7.f), back_slow(n + 1, -7.f);
    for (auto& f : src) f = std::bit_cast<float>(bits(rng) & 0xbfffffffu);  // finite, in or below half range
    std::vector<half> h(n + 1, half{0x1234}), h_slow(n + 1, half{0x1234});
    kvscore::convert(src.data(), h.data(), n);
    kvscore::convert_scalar(src.data(), h_slow.data(), n);
    kvscore::convert(h_slow.data(), back.data(), n);
    kvscore::convert_scalar(h_slow.data(), back_slow.data(), n);
    for (std::size_t i = 0; i <= n; ++i) {  // index n: past the end, untouched
      CHECK(h[i].bits == h_slow[i].bits);
      CHECK(std::bit_cast<std::uint32_t>(back[i]) == std::bit_cast<std::uint32_t>(back_slow[i]));
    }
  }
}

TEST_CASE("convert() follows the ISA pin, and every pinned path equals the scalar one", "[dtype][simd]") {
  namespace simd = kvscore::simd;
  const std::string before = simd::active_table().name;
  std::vector<half> all(65536);
  for (std::uint32_t b = 0; b < 65536; ++b) all[b].bits = std::uint16_t(b);
  std::mt19937 rng(11);
  std::uniform_int_distribution<std::uint32_t> bits;
  std::vector<float> src(4099);  // not a multiple of 8: the vector loop's tail runs too
  for (auto& f : src) f = std::bit_cast<float>(bits(rng) & 0xbfffffffu);
  std::vector<float> slow(all.size());
  std::vector<half> h_slow(src.size());
  kvscore::convert_scalar(all.data(), slow.data(), all.size());
  kvscore::convert_scalar(src.data(), h_slow.data(), src.size());
  for (const simd::KernelTable* t : simd::available_tables()) {
    simd::set_active_isa(t->name);
    INFO("table " << t->name << ", convert path " << kvscore::convert_path());
    const bool f16c_allowed = t->level >= kvscore::IsaLevel::avx2 && kvscore::detail::cpu().f16c;
    CHECK(std::string(kvscore::convert_path()) == (f16c_allowed ? "f16c" : "scalar"));
    std::vector<float> fast(all.size());
    kvscore::convert(all.data(), fast.data(), all.size());
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (std::isnan(slow[i])) REQUIRE(std::isnan(fast[i]));
      else REQUIRE(std::bit_cast<std::uint32_t>(fast[i]) == std::bit_cast<std::uint32_t>(slow[i]));
    }
    std::vector<half> h_fast(src.size());
    kvscore::convert(src.data(), h_fast.data(), src.size());
    for (std::size_t i = 0; i < src.size(); ++i)
      if (!std::isnan(src[i])) REQUIRE(h_fast[i].bits == h_slow[i].bits);
  }
  simd::set_active_isa(before);
}

TEST_CASE("visit_dtype: the element type of each dtype", "[dtype]") {
  for (const kvscore::dtype t : {kvscore::dtype::f32, kvscore::dtype::f16, kvscore::dtype::bf16}) {
    const kvscore::dtype back = kvscore::visit_dtype(t, []<class T>(std::type_identity<T>) { return kvscore::dtype_of<T>(); });
    CHECK(back == t);
  }
  CHECK(kvscore::visit_dtype(kvscore::dtype::f16, []<class T>(std::type_identity<T>) { return sizeof(T); }) == 2);
}
