// Per-target bodies of kernels/simd/kernels.h, compiled once per Highway target
// (foreach_target.h) and dispatched at run time (HWY_DYNAMIC_DISPATCH).

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd/kernels.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/half_bits.h"
#include "kernels/simd/block_sum-inl.h"
#include "kernels/simd/kernels.h"
#include "kernels/simd/philox_simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace lightwire::kernels::simd::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void PhiloxGroups(const uint32_t* ctr, const uint32_t* key, uint64_t g0, size_t count,
                  uint32_t* out) {
  philoxGroupsImpl(ctr, key, g0, count, out);
}

// ---------------------------------------------------------------------------------------------
// Canonical block sums (kernels/simd/block_sum-inl.h).

enum class Term { kSquare, kAbs, kValue };

template <Term kTerm>
HWY_INLINE double blockSum(const float* HWY_RESTRICT x, size_t n) {
  return CanonicalBlockSum(
      n,
      [x](BlockSumTag dd, size_t i) HWY_ATTR {
        const BlockSumVec v = LoadPromoted(dd, x + i);
        if constexpr (kTerm == Term::kSquare) {
          return hn::Mul(v, v);
        } else if constexpr (kTerm == Term::kAbs) {
          return hn::Abs(v);
        } else {
          return v;
        }
      },
      [x](size_t i) HWY_ATTR {
        const double v = static_cast<double>(x[i]);
        if constexpr (kTerm == Term::kSquare) {
          return v * v;
        } else if constexpr (kTerm == Term::kAbs) {
          return std::fabs(v);
        } else {
          return v;
        }
      });
}

double BlockSumSquares(const float* x, size_t n) { return blockSum<Term::kSquare>(x, n); }
double BlockSumAbs(const float* x, size_t n) { return blockSum<Term::kAbs>(x, n); }
double BlockSumValues(const float* x, size_t n) { return blockSum<Term::kValue>(x, n); }

// ---------------------------------------------------------------------------------------------
// fp16 / bf16 casts.

inline void storeU16le(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
inline uint16_t loadU16le(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (uint16_t{p[1]} << 8));
}

// Outputs of at least this many elements are written with non-temporal stores (they leave the
// caches anyway, and streaming saves reading each destination line before writing it).
constexpr size_t kStreamElements = size_t{1} << 18;

void FloatsToHalves(const float* HWY_RESTRICT src, size_t n, uint8_t* HWY_RESTRICT dst) {
  size_t i = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
  // vcvtps2ph (immediate round-to-nearest-even) converts exactly as §4.1, NaN rule included,
  // independent of MXCSR; checked against bits::floatBitsToHalf in tests/kernels/simd_test.cc.
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const hn::Rebind<uint16_t, decltype(df)> du16;
  const size_t lanes = hn::Lanes(df);
  if (n >= kStreamElements) {
    const size_t align = lanes * sizeof(uint16_t);
    for (; i < n && reinterpret_cast<uintptr_t>(dst + 2 * i) % align != 0; ++i) {
      storeU16le(dst + 2 * i, bits::floatBitsToHalf(bits::asBits(src[i])));
    }
    if (reinterpret_cast<uintptr_t>(dst + 2 * i) % align == 0) {
      for (; i + lanes <= n; i += lanes) {
        hn::Stream(hn::BitCast(du16, hn::DemoteTo(dh, hn::LoadU(df, src + i))), du16,
                   reinterpret_cast<uint16_t*>(dst + 2 * i));
      }
      hwy::FlushStream();
    }
  }
  for (; i + lanes <= n; i += lanes) {
    hn::StoreU(hn::DemoteTo(dh, hn::LoadU(df, src + i)), dh,
               reinterpret_cast<hwy::float16_t*>(dst + 2 * i));
  }
#endif
  for (; i < n; ++i) storeU16le(dst + 2 * i, bits::floatBitsToHalf(bits::asBits(src[i])));
}

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
/// One vector of floats from the little-endian binary16 values at `p` (vcvtph2ps: exact, except
/// that it quiets a signalling NaN, which halfToFloatBits keeps signalling: the same once the
/// value goes through any arithmetic).
template <class DF>
HWY_INLINE hn::Vec<DF> LoadHalvesAsFloats(DF df, const uint8_t* p) {
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
}
#endif

void HalvesToFloats(const uint8_t* HWY_RESTRICT src, size_t n, float* HWY_RESTRICT out) {
  size_t i = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  for (; i + lanes <= n; i += lanes) hn::StoreU(LoadHalvesAsFloats(df, src + 2 * i), df, out + i);
#endif
  for (; i < n; ++i) out[i] = bits::asFloat(bits::halfToFloatBits(loadU16le(src + 2 * i)));
}

void AccumulateHalves(const uint8_t* HWY_RESTRICT src, size_t n, float weight,
                      float* HWY_RESTRICT out) {
  size_t i = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  const auto w = hn::Set(df, weight);
  for (; i + lanes <= n; i += lanes) {
    const auto v = LoadHalvesAsFloats(df, src + 2 * i);
    hn::StoreU(hn::Add(hn::LoadU(df, out + i), hn::Mul(w, v)), df, out + i);
  }
#endif
  for (; i < n; ++i) {
    out[i] = out[i] + weight * bits::asFloat(bits::halfToFloatBits(loadU16le(src + 2 * i)));
  }
}

// Dense fp32 payload bodies (little-endian binary32, any alignment): sums and decodes.

void AddFloats(const uint8_t* a, const uint8_t* b, size_t n, uint8_t* out) {
  size_t i = 0;
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  for (; i + lanes <= n; i += lanes) {  // element i is read before out's element i is written
    const auto va = hn::LoadU(df, reinterpret_cast<const float*>(a + 4 * i));
    const auto vb = hn::LoadU(df, reinterpret_cast<const float*>(b + 4 * i));
    hn::StoreU(hn::Add(va, vb), df, reinterpret_cast<float*>(out + 4 * i));
  }
  for (; i < n; ++i) {
    float x, y;
    std::memcpy(&x, a + 4 * i, 4);
    std::memcpy(&y, b + 4 * i, 4);
    const float sum = x + y;
    std::memcpy(out + 4 * i, &sum, 4);
  }
}

template <bool kInto>
HWY_INLINE void weightedFloats(const uint8_t* HWY_RESTRICT src, size_t n, float weight,
                               float* HWY_RESTRICT out) {
  size_t i = 0;
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  const auto w = hn::Set(df, weight);
  const auto zero = hn::Zero(df);
  for (; i + lanes <= n; i += lanes) {
    const auto v = hn::Mul(w, hn::LoadU(df, reinterpret_cast<const float*>(src + 4 * i)));
    hn::StoreU(hn::Add(kInto ? zero : hn::LoadU(df, out + i), v), df, out + i);
  }
  for (; i < n; ++i) {
    float v;
    std::memcpy(&v, src + 4 * i, 4);
    out[i] = (kInto ? 0.0f : out[i]) + weight * v;
  }
}

void AccumulateFloats(const uint8_t* HWY_RESTRICT src, size_t n, float weight,
                      float* HWY_RESTRICT out) {
  weightedFloats<false>(src, n, weight, out);
}
void ScaleFloats(const uint8_t* HWY_RESTRICT src, size_t n, float weight, float* HWY_RESTRICT out) {
  weightedFloats<true>(src, n, weight, out);
}

bool AnyNonfinite(const float* HWY_RESTRICT x, size_t n) {
  size_t i = 0;
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const size_t lanes = hn::Lanes(df);
  const auto exp = hn::Set(du, 0x7F800000u);
  auto bad = hn::Zero(du);  // lanes with the exponent all ones: Inf or NaN
  for (; i + lanes <= n; i += lanes) {
    const auto u = hn::BitCast(du, hn::LoadU(df, x + i));
    bad = hn::Or(bad, hn::VecFromMask(du, hn::Eq(hn::And(u, exp), exp)));
  }
  bool any = !hn::AllFalse(du, hn::Ne(bad, hn::Zero(du)));
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    any = any || (u & 0x7F800000u) == 0x7F800000u;
  }
  return any;
}

void FloatsToBf16s(const float* HWY_RESTRICT src, size_t n, uint8_t* HWY_RESTRICT dst) {
  size_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  // Per 32-bit lane: rounded = u + 0x7FFF + ((u >> 16) & 1), or u | 0x00400000 for a NaN; the
  // result is the upper 16 bits, i.e. the odd 16-bit lanes (ConcatOdd of two vectors).
  const hn::ScalableTag<float> df;
  const hn::RebindToUnsigned<decltype(df)> du;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Repartition<uint16_t, decltype(df)> d16;
  const size_t lanes = hn::Lanes(df);
  const auto abs_mask = hn::Set(di, 0x7FFFFFFF);
  const auto inf = hn::Set(di, 0x7F800000);
  const auto bias = hn::Set(du, 0x7FFFu);
  const auto one = hn::Set(du, 1u);
  const auto quiet = hn::Set(du, 0x00400000u);
  auto convert = [&](const float* p) {
    const auto u = hn::BitCast(du, hn::LoadU(df, p));
    const auto is_nan = hn::RebindMask(du, hn::Gt(hn::And(hn::BitCast(di, u), abs_mask), inf));
    const auto rounded = hn::Add(hn::Add(u, bias), hn::And(hn::ShiftRight<16>(u), one));
    return hn::BitCast(d16, hn::IfThenElse(is_nan, hn::Or(u, quiet), rounded));
  };
  if (n >= kStreamElements) {
    const size_t align = 2 * lanes * sizeof(uint16_t);
    for (; i < n && reinterpret_cast<uintptr_t>(dst + 2 * i) % align != 0; ++i) {
      storeU16le(dst + 2 * i, bits::floatBitsToBf16(bits::asBits(src[i])));
    }
    if (reinterpret_cast<uintptr_t>(dst + 2 * i) % align == 0) {
      for (; i + 2 * lanes <= n; i += 2 * lanes) {
        hn::Stream(hn::ConcatOdd(d16, convert(src + i + lanes), convert(src + i)), d16,
                   reinterpret_cast<uint16_t*>(dst + 2 * i));
      }
      hwy::FlushStream();
    }
  }
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    hn::StoreU(hn::ConcatOdd(d16, convert(src + i + lanes), convert(src + i)), d16,
               reinterpret_cast<uint16_t*>(dst + 2 * i));
  }
#endif
  for (; i < n; ++i) storeU16le(dst + 2 * i, bits::floatBitsToBf16(bits::asBits(src[i])));
}

#if HWY_TARGET != HWY_SCALAR
/// One vector of floats from the little-endian bfloat16 values at `p` (exact: the top halves).
template <class DF>
HWY_INLINE hn::Vec<DF> LoadBf16sAsFloats(DF df, const uint8_t* p) {
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<uint16_t, DF> d16;
  const auto h = hn::LoadU(d16, reinterpret_cast<const uint16_t*>(p));
  return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, h)));
}
#endif

void Bf16sToFloats(const uint8_t* HWY_RESTRICT src, size_t n, float* HWY_RESTRICT out) {
  size_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  for (; i + lanes <= n; i += lanes) hn::StoreU(LoadBf16sAsFloats(df, src + 2 * i), df, out + i);
#endif
  for (; i < n; ++i) out[i] = bits::asFloat(bits::bf16ToFloatBits(loadU16le(src + 2 * i)));
}

void AccumulateBf16s(const uint8_t* HWY_RESTRICT src, size_t n, float weight,
                     float* HWY_RESTRICT out) {
  size_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  const auto w = hn::Set(df, weight);
  for (; i + lanes <= n; i += lanes) {
    const auto v = LoadBf16sAsFloats(df, src + 2 * i);
    hn::StoreU(hn::Add(hn::LoadU(df, out + i), hn::Mul(w, v)), df, out + i);
  }
#endif
  for (; i < n; ++i) {
    out[i] = out[i] + weight * bits::asFloat(bits::bf16ToFloatBits(loadU16le(src + 2 * i)));
  }
}

// ---------------------------------------------------------------------------------------------
// qsgd.

// Per bucket: F = (float)s / norm, +Inf (norm below about s / FLT_MAX) replaced by FLT_MAX.
inline float qsgdFactor(float norm, uint32_t s) {
  const float f = static_cast<float>(s) / norm;
  return f > std::numeric_limits<float>::max() ? std::numeric_limits<float>::max() : f;
}

// One element, the specification's fp32 arithmetic (§4.5 step 3) as written. Every operation is
// exact or a single correctly rounded fp32 multiply, so the vector path below gives the same bits.
inline uint8_t quantizeOne(float xk, uint16_t hk, float factor, float s_f, unsigned sign_shift) {
  const float r = std::fabs(xk) * factor;
  const float fl = std::floor(r);
  const float p = r - fl;                             // exact
  const float u = static_cast<float>(hk) * 0x1p-16f;  // exact
  float level = fl + (u < p ? 1.0f : 0.0f);           // exact (fl <= 2^8)
  level = level < s_f ? level : s_f;
  const uint32_t sign = xk < 0.0f ? 1u : 0u;
  return static_cast<uint8_t>((sign << sign_shift) | static_cast<uint32_t>(level));
}

void QsgdQuantize(const float* HWY_RESTRICT x, const uint16_t* HWY_RESTRICT h, size_t len,
                  float norm, uint32_t s, unsigned sign_shift, uint8_t* HWY_RESTRICT codes) {
  const float factor = qsgdFactor(norm, s);
  const float s_f = static_cast<float>(s);
  size_t k = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<uint16_t, decltype(df)> du16;
  const hn::Rebind<uint8_t, decltype(df)> du8;
  const size_t lanes = hn::Lanes(df);
  const auto f = hn::Set(df, factor);
  const auto sf = hn::Set(df, s_f);
  const auto zero = hn::Zero(df);
  const auto one = hn::Set(df, 1.0f);
  const auto two_m16 = hn::Set(df, 0x1p-16f);
  const auto sign_value = hn::Set(df, static_cast<float>(1u << sign_shift));
  for (; k + lanes <= len; k += lanes) {
    const auto xv = hn::LoadU(df, x + k);
    const auto r = hn::Mul(hn::Abs(xv), f);
    const auto fl = hn::Floor(r);
    const auto p = hn::Sub(r, fl);
    const auto u = hn::Mul(hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(du16, h + k))), two_m16);
    const auto level = hn::Min(hn::Add(fl, hn::IfThenElseZero(hn::Lt(u, p), one)), sf);
    const auto code = hn::Add(level, hn::IfThenElseZero(hn::Lt(xv, zero), sign_value));
    hn::StoreU(hn::DemoteTo(du8, hn::ConvertTo(di, code)), du8, codes + k);
  }
#endif
  for (; k < len; ++k) codes[k] = quantizeOne(x[k], h[k], factor, s_f, sign_shift);
}

void QsgdDequantize(const uint8_t* HWY_RESTRICT codes, const float* HWY_RESTRICT scales, size_t len,
                    uint32_t s, unsigned sign_shift, float weight, float* HWY_RESTRICT out) {
  size_t k = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<uint8_t, decltype(df)> du8;
  const size_t lanes = hn::Lanes(df);
  const auto s_v = hn::Set(di, static_cast<int32_t>(s));
  const auto w = hn::Set(df, weight);
  for (; k + lanes <= len; k += lanes) {
    const auto c = hn::PromoteTo(di, hn::LoadU(du8, codes + k));
    const auto v = hn::Mul(hn::ConvertTo(df, hn::And(c, s_v)), hn::LoadU(df, scales + k));
    const auto negative = hn::RebindMask(df, hn::Gt(c, s_v));  // sign bit set
    const auto value = hn::IfThenElse(negative, hn::Neg(v), v);
    hn::StoreU(hn::Add(hn::LoadU(df, out + k), hn::Mul(w, value)), df, out + k);
  }
#endif
  for (; k < len; ++k) {
    const uint32_t code = codes[k];
    const float v = static_cast<float>(static_cast<int32_t>(code & s)) * scales[k];
    const float value = (code >> sign_shift) != 0 ? -v : v;
    out[k] = out[k] + weight * value;
  }
}

}  // namespace lightwire::kernels::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace lightwire::kernels::simd {

HWY_EXPORT(PhiloxGroups);
HWY_EXPORT(BlockSumSquares);
HWY_EXPORT(BlockSumAbs);
HWY_EXPORT(BlockSumValues);
HWY_EXPORT(FloatsToHalves);
HWY_EXPORT(AccumulateHalves);
HWY_EXPORT(AddFloats);
HWY_EXPORT(HalvesToFloats);
HWY_EXPORT(Bf16sToFloats);
HWY_EXPORT(AccumulateFloats);
HWY_EXPORT(ScaleFloats);
HWY_EXPORT(AnyNonfinite);
HWY_EXPORT(FloatsToBf16s);
HWY_EXPORT(AccumulateBf16s);
HWY_EXPORT(QsgdQuantize);
HWY_EXPORT(QsgdDequantize);

void philoxGroups(const uint32_t ctr[3], const uint32_t key[2], uint64_t g0, size_t count,
                  uint32_t* out) {
  HWY_DYNAMIC_DISPATCH(PhiloxGroups)(ctr, key, g0, count, out);
}
double blockSumSquares(const float* x, size_t n) {
  return HWY_DYNAMIC_DISPATCH(BlockSumSquares)(x, n);
}
double blockSumAbs(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(BlockSumAbs)(x, n); }
double blockSumValues(const float* x, size_t n) {
  return HWY_DYNAMIC_DISPATCH(BlockSumValues)(x, n);
}
void floatsToHalves(const float* src, size_t n, uint8_t* dst) {
  HWY_DYNAMIC_DISPATCH(FloatsToHalves)(src, n, dst);
}
void floatsToBf16s(const float* src, size_t n, uint8_t* dst) {
  HWY_DYNAMIC_DISPATCH(FloatsToBf16s)(src, n, dst);
}
void accumulateHalves(const uint8_t* src, size_t n, float weight, float* out) {
  HWY_DYNAMIC_DISPATCH(AccumulateHalves)(src, n, weight, out);
}
void addFloats(const uint8_t* a, const uint8_t* b, size_t n, uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(AddFloats)(a, b, n, out);
}
void accumulateFloats(const uint8_t* src, size_t n, float weight, float* out) {
  HWY_DYNAMIC_DISPATCH(AccumulateFloats)(src, n, weight, out);
}
void scaleFloats(const uint8_t* src, size_t n, float weight, float* out) {
  HWY_DYNAMIC_DISPATCH(ScaleFloats)(src, n, weight, out);
}
void halvesToFloats(const uint8_t* src, size_t n, float* out) {
  HWY_DYNAMIC_DISPATCH(HalvesToFloats)(src, n, out);
}
void bf16sToFloats(const uint8_t* src, size_t n, float* out) {
  HWY_DYNAMIC_DISPATCH(Bf16sToFloats)(src, n, out);
}
bool anyNonfinite(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(AnyNonfinite)(x, n); }
void accumulateBf16s(const uint8_t* src, size_t n, float weight, float* out) {
  HWY_DYNAMIC_DISPATCH(AccumulateBf16s)(src, n, weight, out);
}
void qsgdQuantize(const float* x, const uint16_t* h, size_t len, float norm, uint32_t s,
                  unsigned sign_shift, uint8_t* codes) {
  HWY_DYNAMIC_DISPATCH(QsgdQuantize)(x, h, len, norm, s, sign_shift, codes);
}
void qsgdDequantize(const uint8_t* codes, const float* scales, size_t len, uint32_t s,
                    unsigned sign_shift, float weight, float* out) {
  HWY_DYNAMIC_DISPATCH(QsgdDequantize)(codes, scales, len, s, sign_shift, weight, out);
}

}  // namespace lightwire::kernels::simd
#endif  // HWY_ONCE
