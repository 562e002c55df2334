#pragma once
// Element types and the exact fp32 <-> fp16/bf16 conversions of docs/determinism.md §4.1.

#include <bit>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>
#include <type_traits>

#include "kernels/half_bits.h"

namespace lightwire::kernels {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

constexpr size_t dtypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
std::string_view dtypeName(DType t);
std::optional<DType> parseDType(std::string_view name);  // "fp32"/"float32", "fp16", "bf16"

inline uint32_t floatBits(float f) { return std::bit_cast<uint32_t>(f); }
inline float bitsFloat(uint32_t u) { return std::bit_cast<float>(u); }

/// fp32 -> binary16, round to nearest even; NaN -> sign | 0x7E00 | (mantissa >> 13).
inline uint16_t floatToHalf(float f) { return bits::floatBitsToHalf(floatBits(f)); }

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
inline float halfToFloat(uint16_t h) { return bitsFloat(bits::halfToFloatBits(h)); }

/// fp32 -> bf16, round to nearest even; NaN -> (u >> 16) | 0x0040.
inline uint16_t floatToBf16(float f) { return bits::floatBitsToBf16(floatBits(f)); }

inline float bf16ToFloat(uint16_t b) { return bitsFloat(bits::bf16ToFloatBits(b)); }

/// A read-only view of a contiguous tensor (or chunk) in host memory.
struct ConstTensor {
  const void* data = nullptr;
  size_t elements = 0;
  DType dtype = DType::kF32;

  /// Element i widened to fp32 (exact).
  float at(size_t i) const {
    switch (dtype) {
      case DType::kF32:
        return static_cast<const float*>(data)[i];
      case DType::kF16:
        return halfToFloat(static_cast<const uint16_t*>(data)[i]);
      case DType::kBF16:
        return bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
    }
    return 0.0f;
  }
  ConstTensor slice(size_t begin, size_t count) const {
    return {static_cast<const char*>(data) + begin * dtypeSize(dtype), count, dtype};
  }
};

/// Element i of raw tensor data of dtype D, widened to fp32 (exact).
template <DType D>
inline float loadWidened(const void* data, size_t i) {
  if constexpr (D == DType::kF32) {
    return static_cast<const float*>(data)[i];
  } else if constexpr (D == DType::kF16) {
    return halfToFloat(static_cast<const uint16_t*>(data)[i]);
  } else {
    return bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
  }
}

/// Calls fn(std::integral_constant<DType, t>{}): the one dtype switch in front of a typed loop.
template <typename Fn>
decltype(auto) visitDType(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF16:
      return fn(std::integral_constant<DType, DType::kF16>{});
    case DType::kBF16:
      return fn(std::integral_constant<DType, DType::kBF16>{});
    case DType::kF32:
      break;
  }
  return fn(std::integral_constant<DType, DType::kF32>{});
}

/// Widens src[0..n) to fp32 into dst (exact).
void widenToFloat(ConstTensor src, float* dst);

}  // namespace lightwire::kernels
