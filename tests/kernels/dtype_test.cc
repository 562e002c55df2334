// fp32 <-> fp16/bf16 conversions (docs/determinism.md §4.1) against independent references:
// GCC's _Float16 (correctly rounded, round to nearest even) for binary16, exact fp64 arithmetic for
// bf16.

#include <doctest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ios>
#include <random>
#include <vector>

#include "kernels/dtype.h"

namespace lightwire::kernels {
namespace test_dtype {

#if defined(__clang__) && __clang_major__ < 15
// clang 14 has no _Float16 on x86; its __fp16 converts the same way (IEEE binary16, round to
// nearest even), through the F16C instructions (without them it needs compiler-rt's builtins).
__attribute__((target("f16c"))) uint16_t halfReference(float f) {
  const __fp16 h = static_cast<__fp16>(f);
  uint16_t u;
  std::memcpy(&u, &h, sizeof u);
  return u;
}
__attribute__((target("f16c"))) float halfValue(uint16_t u) {
  __fp16 h;
  std::memcpy(&h, &u, sizeof u);
  return static_cast<float>(h);
}
#else
uint16_t halfReference(float f) { return std::bit_cast<uint16_t>(static_cast<_Float16>(f)); }
float halfValue(uint16_t h) { return static_cast<float>(std::bit_cast<_Float16>(h)); }
#endif
bool isHalfNan(uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0; }

// Round to nearest even by comparing the two bf16 neighbours in fp64 (exact: both differences
// have at most 24 significant bits). Overflow follows IEEE: the value above the largest finite
// bf16 is 2^128, which is infinity. Not for NaN.
uint16_t bf16Reference(float f) {
  const uint32_t u = floatBits(f);
  const uint32_t sign = u & 0x80000000u, mag = u & 0x7FFFFFFFu;
  const uint32_t lo = mag & 0xFFFF0000u;  // truncation toward zero
  if (lo == mag) return static_cast<uint16_t>((sign | mag) >> 16);
  const uint32_t hi = lo + 0x10000u;
  const double x = bitsFloat(mag), a = bitsFloat(lo);
  const double b = hi == 0x7F800000u ? 0x1p128 : static_cast<double>(bitsFloat(hi));
  const double below = x - a, above = b - x;
  uint32_t pick;
  if (below < above) {
    pick = lo;
  } else if (above < below) {
    pick = hi;
  } else {
    pick = ((lo >> 16) & 1u) == 0 ? lo : hi;
  }
  return static_cast<uint16_t>((sign | pick) >> 16);
}

// Every fp32 value the binary16 conversion must get right: each fp16 value, each midpoint between
// neighbours (ties to an even and to an odd neighbour alternate along the sequence) and the float
// neighbours of both, both signs.
std::vector<float> halfEdgeValues() {
  std::vector<float> v;
  auto add = [&v](float f) {
    for (float g : {f, -f}) {
      v.push_back(g);
      v.push_back(std::nextafter(g, INFINITY));
      v.push_back(std::nextafter(g, -INFINITY));
    }
  };
  for (uint32_t h = 0; h <= 0x7C00u; ++h) {
    add(halfValue(static_cast<uint16_t>(h)));
    if (h < 0x7BFFu) {  // midpoint to the next fp16 value (exact in fp32)
      add((halfValue(static_cast<uint16_t>(h)) + halfValue(static_cast<uint16_t>(h + 1))) / 2.0f);
    }
  }
  for (float f : {65504.0f, 65519.99f, 65520.0f, 65536.0f, 1e10f, FLT_MAX, INFINITY, 0.0f, FLT_MIN,
                  FLT_TRUE_MIN, 0x1p-24f, 0x1p-25f, 0x1.8p-25f, 0x1p-26f, 0x1p-14f, 0x1.ffcp-15f}) {
    add(f);
  }
  return v;
}

TEST_CASE("dtype floatToHalf matches _Float16 on every fp16 value, midpoint and neighbour") {
  int mismatches = 0;
  const std::vector<float> values = halfEdgeValues();
  for (float f : values) {
    REQUIRE_FALSE(std::isnan(f));
    if (floatToHalf(f) != halfReference(f) && ++mismatches <= 10) {
      FAIL_CHECK("floatToHalf(" << f << " = 0x" << std::hex << floatBits(f) << ") = 0x"
                                << floatToHalf(f) << ", expected 0x" << halfReference(f));
    }
  }
  CHECK(mismatches == 0);
  CHECK(values.size() > 350000);
}

TEST_CASE("dtype floatToHalf edge values") {
  CHECK(floatToHalf(65504.0f) == 0x7BFFu);
  CHECK(floatToHalf(65519.99f) == 0x7BFFu);
  CHECK(floatToHalf(65520.0f) == 0x7C00u);
  CHECK(floatToHalf(-65520.0f) == 0xFC00u);
  CHECK(floatToHalf(FLT_MAX) == 0x7C00u);
  CHECK(floatToHalf(INFINITY) == 0x7C00u);
  CHECK(floatToHalf(-INFINITY) == 0xFC00u);
  CHECK(floatToHalf(0.0f) == 0x0000u);
  CHECK(floatToHalf(-0.0f) == 0x8000u);
  CHECK(floatToHalf(0x1p-24f) == 0x0001u);  // smallest subnormal
  CHECK(floatToHalf(0x1p-25f) == 0x0000u);  // tie to even: 0
  CHECK(floatToHalf(0x1.000002p-25f) == 0x0001u);
  CHECK(floatToHalf(0x1.8p-24f) == 0x0002u);    // tie between 1 and 2 subnormal ulps: even
  CHECK(floatToHalf(0x1.ff8p-15f) == 0x03FFu);  // largest subnormal
  CHECK(floatToHalf(0x1.ffcp-15f) == 0x0400u);  // tie, odd neighbour: up into the normal range
  CHECK(floatToHalf(FLT_TRUE_MIN) == 0x0000u);
  CHECK(floatToHalf(1.0f + 0x1p-11f) == 0x3C00u);    // tie to even (down)
  CHECK(floatToHalf(1.0f + 0x1.8p-10f) == 0x3C02u);  // tie to even (up)
}

TEST_CASE("dtype floatToHalf matches _Float16 on random and strided fp32 bit patterns") {
  std::mt19937_64 rng(12345);
  int mismatches = 0;
  auto check = [&](uint32_t u) {
    const float f = bitsFloat(u);
    if (std::isnan(f)) return;
    if (floatToHalf(f) != halfReference(f) && ++mismatches <= 10) {
      FAIL_CHECK("floatToHalf(0x" << std::hex << u << ") = 0x" << floatToHalf(f) << ", expected 0x"
                                  << halfReference(f));
    }
  };
  for (int i = 0; i < 4000000; ++i) check(static_cast<uint32_t>(rng()));
  for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += 997) check(static_cast<uint32_t>(u));
  // Every fp32 value in the fp16 subnormal range and at the normal boundary, with a small stride.
  for (uint32_t u = 0x33000000u - 64; u <= 0x38800000u + 64; u += 61) {
    check(u);
    check(u | 0x80000000u);
  }
  CHECK(mismatches == 0);
}

TEST_CASE("dtype floatToHalf NaN keeps sign and top payload bits, always quiet") {
  int mismatches = 0;
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t mant = 1; mant <= 0x7FFFFFu; ++mant) {
      const uint32_t u = sign | 0x7F800000u | mant;
      const uint16_t h = floatToHalf(bitsFloat(u));
      const uint16_t expected = static_cast<uint16_t>((sign >> 16) | 0x7E00u | (mant >> 13));
      if (h != expected && ++mismatches <= 10) {
        FAIL_CHECK("floatToHalf(0x" << std::hex << u << ") = 0x" << h);
      }
      if (!isHalfNan(h) && ++mismatches <= 10) FAIL_CHECK("not a NaN: 0x" << std::hex << u);
    }
  }
  CHECK(mismatches == 0);
  CHECK(floatToHalf(bitsFloat(0x7F800001u)) == 0x7E00u);  // signalling, payload below bit 13
  CHECK(floatToHalf(bitsFloat(0xFFC00000u)) == 0xFE00u);
  CHECK(floatToHalf(bitsFloat(0x7FFFFFFFu)) == 0x7FFFu);
}

TEST_CASE("dtype halfToFloat matches _Float16 on all 65536 values") {
  int mismatches = 0;
  for (uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const auto hh = static_cast<uint16_t>(h);
    const float got = halfToFloat(hh), ref = halfValue(hh);
    if (isHalfNan(hh)) {
      // Exact widening keeps the payload; GCC's reference quiets signalling NaNs.
      const uint32_t expected = (static_cast<uint32_t>(h & 0x8000u) << 16) | 0x7F800000u |
                                (static_cast<uint32_t>(h & 0x3FFu) << 13);
      const bool ok = std::isnan(got) && std::isnan(ref) && floatBits(got) == expected &&
                      (floatBits(got) | 0x00400000u) == floatBits(ref);
      if (!ok && ++mismatches <= 10) FAIL_CHECK("NaN 0x" << std::hex << h);
    } else if (floatBits(got) != floatBits(ref) && ++mismatches <= 10) {
      FAIL_CHECK("halfToFloat(0x" << std::hex << h << ") = " << got << ", expected " << ref);
    }
    // Round trip: every non-NaN half survives fp32 and back.
    if (!isHalfNan(hh) && floatToHalf(got) != hh && ++mismatches <= 10) {
      FAIL_CHECK("round trip 0x" << std::hex << h);
    }
  }
  CHECK(mismatches == 0);
}

TEST_CASE("dtype floatToBf16 matches exact rounding on edge values") {
  int mismatches = 0;
  auto check = [&](float f) {
    for (float g : {f, -f, std::nextafter(f, INFINITY), std::nextafter(f, -INFINITY),
                    std::nextafter(-f, INFINITY), std::nextafter(-f, -INFINITY)}) {
      if (std::isnan(g)) continue;
      if (floatToBf16(g) != bf16Reference(g) && ++mismatches <= 10) {
        FAIL_CHECK("floatToBf16(0x" << std::hex << floatBits(g) << ") = 0x" << floatToBf16(g)
                                    << ", expected 0x" << bf16Reference(g));
      }
    }
  };
  for (uint32_t b = 0; b <= 0x7F80u; ++b) {
    const uint32_t u = b << 16;
    check(bitsFloat(u));
    if (b < 0x7F80u) check(bitsFloat(u | 0x8000u));  // midpoint to the next bf16 value
  }
  for (float f : {FLT_MAX, FLT_MIN, FLT_TRUE_MIN, 1.0f, 0.0f, INFINITY}) check(f);
  CHECK(mismatches == 0);

  CHECK(floatToBf16(FLT_MAX) == 0x7F80u);  // above the last midpoint: overflows to Inf
  CHECK(floatToBf16(bitsFloat(0x7F7F7FFFu)) == 0x7F7Fu);
  CHECK(floatToBf16(bitsFloat(0x7F7F8000u)) == 0x7F80u);  // tie with an odd neighbour: up
  CHECK(floatToBf16(bitsFloat(0x3F808000u)) == 0x3F80u);  // tie with an even neighbour: down
  CHECK(floatToBf16(bitsFloat(0x3F818000u)) == 0x3F82u);  // tie with an odd neighbour: up
  CHECK(floatToBf16(-INFINITY) == 0xFF80u);
  CHECK(floatToBf16(-0.0f) == 0x8000u);
  CHECK(floatToBf16(FLT_TRUE_MIN) == 0x0000u);
}

TEST_CASE("dtype floatToBf16 matches exact rounding on random and strided fp32 bit patterns") {
  std::mt19937_64 rng(777);
  int mismatches = 0;
  auto check = [&](uint32_t u) {
    const float f = bitsFloat(u);
    if (std::isnan(f)) return;
    if (floatToBf16(f) != bf16Reference(f) && ++mismatches <= 10) {
      FAIL_CHECK("floatToBf16(0x" << std::hex << u << ") = 0x" << floatToBf16(f) << ", expected 0x"
                                  << bf16Reference(f));
    }
  };
  for (int i = 0; i < 4000000; ++i) check(static_cast<uint32_t>(rng()));
  for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += 1009) check(static_cast<uint32_t>(u));
  CHECK(mismatches == 0);
}

TEST_CASE("dtype floatToBf16 NaN is quieted and keeps sign and top payload bits") {
  int mismatches = 0;
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t mant = 1; mant <= 0x7FFFFFu; ++mant) {
      const uint32_t u = sign | 0x7F800000u | mant;
      const uint16_t b = floatToBf16(bitsFloat(u));
      const bool ok = b == static_cast<uint16_t>((u >> 16) | 0x0040u) &&
                      std::isnan(bf16ToFloat(b)) && (b & 0x8000u) == (sign >> 16);
      if (!ok && ++mismatches <= 10) FAIL_CHECK("floatToBf16(0x" << std::hex << u << ")");
    }
  }
  CHECK(mismatches == 0);
  // Payload only in the low half: truncation alone would give an infinity.
  CHECK(floatToBf16(bitsFloat(0x7F800001u)) == 0x7FC0u);
  CHECK(floatToBf16(bitsFloat(0xFF80FFFFu)) == 0xFFC0u);
  CHECK(floatToBf16(bitsFloat(0x7FFFFFFFu)) == 0x7FFFu);
}

TEST_CASE("dtype bf16ToFloat is exact on all 65536 values") {
  for (uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const float f = bf16ToFloat(static_cast<uint16_t>(b));
    REQUIRE(floatBits(f) == (b << 16));
    if (!std::isnan(f)) REQUIRE(floatToBf16(f) == b);
  }
}

TEST_CASE("dtype widenToFloat and ConstTensor::at widen exactly") {
  const std::vector<uint16_t> halves = {0x0000, 0x8000, 0x0001, 0x3C00, 0x7BFF, 0xFC00, 0x7E01};
  std::vector<float> out(halves.size());
  widenToFloat({halves.data(), halves.size(), DType::kF16}, out.data());
  for (size_t i = 0; i < halves.size(); ++i) {
    CHECK(floatBits(out[i]) == floatBits(halfToFloat(halves[i])));
  }
  widenToFloat({halves.data(), halves.size(), DType::kBF16}, out.data());
  for (size_t i = 0; i < halves.size(); ++i) CHECK(floatBits(out[i]) == uint32_t{halves[i]} << 16);
}

}  // namespace test_dtype
}  // namespace lightwire::kernels
