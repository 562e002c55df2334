#pragma once
// Element types and the exact fp32 <-> fp16/bf16 conversions of docs/determinism.md §4.1.

#include <bit>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace lightwire::kernels {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

constexpr size_t dtypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
std::string_view dtypeName(DType t);
std::optional<DType> parseDType(std::string_view name);  // "fp32"/"float32", "fp16", "bf16"

inline uint32_t floatBits(float f) { return std::bit_cast<uint32_t>(f); }
inline float bitsFloat(uint32_t u) { return std::bit_cast<float>(u); }

/// fp32 -> binary16, round to nearest even; NaN -> sign | 0x7E00 | (mantissa >> 13).
inline uint16_t floatToHalf(float f) {
  const uint32_t u = floatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs & 0x7FFFFFu) >> 13));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 -> Inf
  if (abs >= 0x38800000u) {  // normal half range (>= 2^-14)
    // Re-bias exponent (127 -> 15) and round the 13 dropped bits to nearest even.
    const uint32_t mant_odd = (abs >> 13) & 1u;
    const uint32_t rounded = abs + 0xFFFu + mant_odd;
    return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
  }
  if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 rounds to zero
  // Subnormal half: value = m * 2^-24. Shift the full 24-bit significand, round to nearest even.
  const uint32_t exp = abs >> 23;              // 102..112
  const uint32_t sig = (abs & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - exp;           // 14..24
  const uint32_t half_ulp = 1u << (shift - 1);
  const uint32_t rem = sig & ((1u << shift) - 1u);
  uint32_t m = sig >> shift;
  if (rem > half_ulp || (rem == half_ulp && (m & 1u))) ++m;
  return static_cast<uint16_t>(sign | m);
}

/// fp32 -> binary16 like floatToHalf, but a finite value beyond ±65504 becomes ±65504 instead of
/// ±Inf (sparse fp16 values: the residual keeps the excess). NaN and ±Inf are kept.
inline uint16_t floatToHalfSaturating(float f) {
  const uint32_t abs = floatBits(f) & 0x7FFFFFFFu;
  if (abs > 0x477FE000u && abs < 0x7F800000u) {  // finite and > 65504
    return static_cast<uint16_t>(((floatBits(f) >> 16) & 0x8000u) | 0x7BFFu);
  }
  return floatToHalf(f);
}

/// binary16 -> fp32, exact.
inline float halfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return bitsFloat(sign | 0x7F800000u | (mant << 13));
  if (exp != 0) return bitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bitsFloat(sign);
  // Subnormal: mant * 2^-24, exactly representable in fp32.
  const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
  return sign ? -v : v;
}

/// fp32 -> bf16, round to nearest even; NaN -> (u >> 16) | 0x0040.
inline uint16_t floatToBf16(float f) {
  const uint32_t u = floatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16ToFloat(uint16_t b) { return bitsFloat(static_cast<uint32_t>(b) << 16); }

/// A read-only view of a contiguous tensor (or chunk) in host memory.
struct ConstTensor {
  const void* data = nullptr;
  size_t elements = 0;
  DType dtype = DType::kF32;

  /// Element i widened to fp32 (exact).
  float at(size_t i) const {
    switch (dtype) {
      case DType::kF32: return static_cast<const float*>(data)[i];
      case DType::kF16: return halfToFloat(static_cast<const uint16_t*>(data)[i]);
      case DType::kBF16: return bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
    }
    return 0.0f;
  }
  ConstTensor slice(size_t begin, size_t count) const {
    return {static_cast<const char*>(data) + begin * dtypeSize(dtype), count, dtype};
  }
};

/// Widens src[0..n) to fp32 into dst (exact).
void widenToFloat(ConstTensor src, float* dst);

}  // namespace lightwire::kernels
