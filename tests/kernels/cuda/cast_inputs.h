#pragma once
// fp32 bit patterns that exercise every branch of the fp16/bf16 conversions: hand-picked edge
// values, a structured sweep of every sign/exponent/top-mantissa combination with the low bits
// that decide rounding, and random patterns from a fixed seed.

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace lightwire::kernels::testing {

/// "0x..." for messages (doctest's message builder ignores std::hex).
inline std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%X", v);
  return buf;
}

inline std::vector<uint32_t> castEdgePatterns() {
  return {
      0x00000000u, 0x80000000u, 0x3F800000u, 0xBF800000u,  // ±0, ±1
      0x00000001u, 0x007FFFFFu, 0x80000001u, 0x00400000u,  // fp32 subnormals
      0x477FE000u, 0x477FEFFFu, 0x477FF000u, 0x477FF001u,  // 65504, just below/at/above 65520
      0xC77FF000u, 0x7F7FFFFFu, 0xFF7FFFFFu,               // -65520, ±FLT_MAX
      0x7F800000u, 0xFF800000u,                            // ±Inf
      0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u,  // quiet / signalling NaN
      0x7FFFFFFFu, 0xFFFFFFFFu, 0x7FBFFFFFu, 0x7FC02000u, 0x7F802000u, 0x7F801FFFu,
      0x38800000u, 0x387FFFFFu, 0x387FF000u, 0x387FEFFFu,  // half min normal 2^-14 and below
      0x33800000u, 0x33000000u, 0x33000001u, 0x32FFFFFFu,  // 2^-24, 2^-25 (tie to 0), around
      0x33C00000u, 0x34200000u, 0x35800000u, 0x36000000u,  // 1.5·2^-24 (tie to 2), ...
      0x3F801000u, 0x3F803000u, 0x3F800FFFu, 0x3F801001u,  // fp16 ties at 1.0 (even / odd)
      0x3F808000u, 0x3F818000u, 0x3F807FFFu, 0x3F808001u,  // bf16 ties at 1.0
      0x7F7F8000u, 0x7F7F7FFFu, 0xFF7F8000u,               // bf16 overflow to ±Inf by rounding
  };
}

/// Every (sign, exponent, top 7 mantissa bits) with low 16 bits from a set that hits the fp16 and
/// bf16 rounding boundaries, then `random_count` random patterns.
inline std::vector<uint32_t> castTestPatterns(size_t random_count) {
  std::vector<uint32_t> v = castEdgePatterns();
  static constexpr uint32_t kLow[] = {0x0000u, 0x0001u, 0x0FFFu, 0x1000u, 0x1001u, 0x1FFFu, 0x2000u,
                                      0x3000u, 0x7FFFu, 0x8000u, 0x8001u, 0xF000u, 0xFFFFu};
  for (uint32_t high = 0; high < 0x10000u; ++high) {
    for (uint32_t low : kLow) v.push_back((high << 16) | low);
  }
  std::mt19937 rng(20240611u);
  for (size_t i = 0; i < random_count; ++i) v.push_back(static_cast<uint32_t>(rng()));
  return v;
}

}  // namespace lightwire::kernels::testing
