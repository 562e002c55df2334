#pragma once
// The fp32 <-> fp16/bf16 conversions of docs/determinism.md §4.1 as integer bit manipulation: the
// one definition, compiled for the host (kernels/dtype.h wraps it) and for the device (the CUDA
// kernels use it rather than __float2half / __float2bfloat16, whose NaN results differ from the
// specification). Exhaustively tested in tests/kernels/dtype_test.cc. Pure and thread-safe.

#include <cstdint>

#if defined(__CUDACC__)
#define LW_HOST_DEVICE __host__ __device__ __forceinline__
#else
#include <bit>
#define LW_HOST_DEVICE inline
#endif

namespace lightwire::kernels::bits {

LW_HOST_DEVICE uint32_t asBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#elif defined(__CUDACC__)
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
#else
  return std::bit_cast<uint32_t>(f);
#endif
}

LW_HOST_DEVICE float asFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#elif defined(__CUDACC__)
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#else
  return std::bit_cast<float>(u);
#endif
}

/// fp32 bits -> binary16 bits, round to nearest even; magnitudes >= 65520 -> Inf;
/// NaN -> sign | 0x7E00 | (mantissa >> 13).
LW_HOST_DEVICE uint16_t floatBitsToHalf(uint32_t u) {
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs & 0x7FFFFFu) >> 13));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (abs >= 0x38800000u) {  // normal half range: re-bias 127 -> 15, round 13 bits to even
    const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
  }
  if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to zero
  // Subnormal half (m * 2^-24): shift the 24-bit significand right by 14..24, round to even.
  const uint32_t shift = 126u - (abs >> 23);
  const uint32_t sig = (abs & 0x7FFFFFu) | 0x800000u;
  const uint32_t half_ulp = 1u << (shift - 1);
  const uint32_t rem = sig & ((1u << shift) - 1u);
  uint32_t m = sig >> shift;
  if (rem > half_ulp || (rem == half_ulp && (m & 1u))) ++m;
  return static_cast<uint16_t>(sign | m);
}

/// fp32 bits -> bf16 bits, round to nearest even (overflow to Inf); NaN -> (u >> 16) | 0x0040.
LW_HOST_DEVICE uint16_t floatBitsToBf16(uint32_t u) {
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/// binary16 bits -> fp32 bits, exact (subnormals normalised with integer shifts, no arithmetic).
LW_HOST_DEVICE uint32_t halfToFloatBits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1Fu) return sign | 0x7F800000u | (mant << 13);
  if (exp != 0) return sign | ((exp + 112u) << 23) | (mant << 13);
  if (mant == 0) return sign;
  // Subnormal: mant * 2^-24. Normalise: shift until bit 10 is set, adjusting the exponent.
  uint32_t e = 113u;  // exponent field of 2^-14
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return sign | (e << 23) | ((mant & 0x3FFu) << 13);
}

LW_HOST_DEVICE uint32_t bf16ToFloatBits(uint16_t b) { return static_cast<uint32_t>(b) << 16; }

}  // namespace lightwire::kernels::bits

#undef LW_HOST_DEVICE
