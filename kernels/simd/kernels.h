#pragma once
// Highway-vectorised inner loops with run-time dispatch (kernels/simd/kernels.cc): each call runs
// the best target this CPU supports (or the one a test forces, kernels/simd/targets.h). Every
// function gives the same bits on every target as the scalar definition it documents: integer
// arithmetic, or IEEE operations that are exact or correctly rounded, in the scalar order, with no
// FMA (docs/determinism.md). Pure and thread-safe.

#include <cstddef>
#include <cstdint>

namespace lightwire::kernels::simd {

/// out[4k + j] = word j of Philox4x32-10 at counter (ctr[0], ctr[1], ctr[2], (uint32)(g0 + k)) and
/// key (key[0], key[1]), for k < count (as kernels/philox.cc's philoxBlock).
void philoxGroups(const uint32_t ctr[3], const uint32_t key[2], uint64_t g0, size_t count,
                  uint32_t* out);

/// The canonical block sums of kernels/reduce.h (n <= kReduceBlock): eight fp64 accumulators,
/// element i into accumulator i mod 8, combined ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)).
double blockSumSquares(const float* x, size_t n);
double blockSumAbs(const float* x, size_t n);
double blockSumValues(const float* x, size_t n);

/// dst[2i..2i+2) = little-endian binary16 / bfloat16 bits of src[i] (docs/determinism.md §4.1,
/// as bits::floatBitsToHalf / floatBitsToBf16), for i < n.
void floatsToHalves(const float* src, size_t n, uint8_t* dst);
void floatsToBf16s(const float* src, size_t n, uint8_t* dst);

/// out[i] = value i (as bits::halfToFloatBits / bf16ToFloatBits, except that halvesToFloats may
/// return a signalling NaN quieted, as any arithmetic on it does), the values little-endian
/// binary16 / bfloat16, for i < n. For inputs to arithmetic.
void halvesToFloats(const uint8_t* src, size_t n, float* out);
void bf16sToFloats(const uint8_t* src, size_t n, float* out);

/// out[i] = out[i] + weight * value i, the values little-endian binary16 / bfloat16, for i < n.
void accumulateHalves(const uint8_t* src, size_t n, float weight, float* out);
void accumulateBf16s(const uint8_t* src, size_t n, float weight, float* out);

/// Dense fp32 payload bodies (little-endian binary32 at any alignment), for i < n:
/// addFloats: out value i = a value i + b value i (`out` may be `a` or `b`);
/// accumulateFloats: out[i] = out[i] + weight * src value i;
/// scaleFloats: out[i] = +0 + weight * src value i (accumulateFloats into zeros, −0 made +0).
void addFloats(const uint8_t* a, const uint8_t* b, size_t n, uint8_t* out);
void accumulateFloats(const uint8_t* src, size_t n, float weight, float* out);
void scaleFloats(const uint8_t* src, size_t n, float weight, float* out);
/// Whether some x[i], i < n, is Inf or NaN (its exponent bits all ones).
bool anyNonfinite(const float* x, size_t n);

/// qsgd codes (docs/determinism.md §4.5 step 3) of len elements of one bucket of norm `norm`
/// (finite, > 0), h[k] the 16-bit random half of element k. All fp32, no FMA: once
///   F = (float)s / norm, FLT_MAX where that is +Inf;
/// then for k < len
///   r = |x[k]| * F; fl = floor(r); p = r - fl; u = (float)h[k] * 2^-16;
///   level = min(fl + (u < p), s); codes[k] = ((x[k] < 0) << sign_shift) | level.
/// (|x[k]| <= norm up to the fp32 rounding of the norm.)
void qsgdQuantize(const float* x, const uint16_t* h, size_t len, float norm, uint32_t s,
                  unsigned sign_shift, uint8_t* codes);

/// qsgd decoding: out[k] = out[k] + weight * v, v = (float)(codes[k] & s) * scales[k], negated when
/// codes[k] >> sign_shift is non-zero (codes[k] < 2^(sign_shift + 1), s = 2^sign_shift - 1).
void qsgdDequantize(const uint8_t* codes, const float* scales, size_t len, uint32_t s,
                    unsigned sign_shift, float weight, float* out);

}  // namespace lightwire::kernels::simd
