// `terngrad`, `signsgd`, `onebit` (docs/determinism.md §4.9–4.11, docs/wire-format.md): per bucket
// of d elements one or two fp32 scales, per element a 1- or 2-bit code, bit-packed LSB-first
// without padding. A chunk containing NaN or ±Inf is sent in the `none` layout instead (as qsgd).
//
// Encoding runs over units of whole buckets whose codes end on a byte boundary, so threads never
// share a byte of the code stream; each unit is one pass over its buckets' scales (canonical fp64
// sums, or an exact maximum) and one over its elements (codes), both on data still in cache.
// That skeleton, shared with qsgd, is BucketFamilyCodec (kernels/codecs/bucket_family.h, defined
// here). The three codecs register here; their CUDA twins are kernels/cuda/codecs/bucket.cu.
// The inner loops are Highway kernels compiled for every target (foreach_target) and dispatched
// at run time; each gives the bytes of its scalar definition on every target.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/codecs/bucket.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/simd/block_sum-inl.h"

HWY_BEFORE_NAMESPACE();
namespace lightwire::kernels::bucket_simd::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using simd::HWY_NAMESPACE::BlockSumTag;
using simd::HWY_NAMESPACE::BlockSumVec;
using simd::HWY_NAMESPACE::CanonicalBlockSums;
using simd::HWY_NAMESPACE::LoadPromoted;

/// Largest |x| over x[0..n) as a bit pattern with the sign cleared (u32 maximum: exact, and NaN
/// and Inf compare above every finite value).
uint32_t MaxMagnitudeBits(const float* HWY_RESTRICT x, size_t n) {
  uint32_t m = 0;
  size_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<uint32_t> du;
  const size_t lanes = hn::Lanes(du);
  const auto clear = hn::Set(du, 0x7FFFFFFFu);
  auto mv = hn::Zero(du);
  for (; i + lanes <= n; i += lanes) {
    mv = hn::Max(mv, hn::And(hn::LoadU(du, reinterpret_cast<const uint32_t*>(x + i)), clear));
  }
  m = hn::GetLane(hn::MaxOfLanes(du, mv));
#endif
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    u &= 0x7FFFFFFFu;
    m = u > m ? u : m;
  }
  return m;
}

/// One §2 block (n <= 4096) of onebit's two sums, terms P_i = (x_i < 0 ? +0 : x_i) and
/// N_i = (x_i < 0 ? x_i : +0), element i into accumulator i mod 8, and the count of x_i < 0 (kept
/// in fp64 lanes, exact), all three in one pass (kernels/simd/block_sum-inl.h). Adds the block sums
/// to *pos, *neg and the count to *negatives.
void SplitBlockSums(const float* HWY_RESTRICT x, size_t n, double* pos, double* neg,
                    uint64_t* negatives) {
  double sums[3];
  CanonicalBlockSums<3>(
      n,
      [x](BlockSumTag dd, size_t i, BlockSumVec* t) HWY_ATTR {
        const auto v = LoadPromoted(dd, x + i);
        const auto negative = hn::Lt(v, hn::Zero(dd));
        t[0] = hn::IfThenZeroElse(negative, v);
        t[1] = hn::IfThenElseZero(negative, v);
        t[2] = hn::IfThenElseZero(negative, hn::Set(dd, 1.0));
      },
      [x](size_t i, double* t) HWY_ATTR {
        const double d = static_cast<double>(x[i]);
        const bool negative = d < 0.0;
        t[0] = negative ? 0.0 : d;
        t[1] = negative ? d : 0.0;
        t[2] = negative ? 1.0 : 0.0;
      },
      sums);
  *pos = *pos + sums[0];
  *neg = *neg + sums[1];
  *negatives += static_cast<uint64_t>(sums[2]);
}

/// TernGrad code of one element (§4.9 step 3) for a scaler s > 0 and rounding word w.
inline uint8_t ternaryOne(float x, uint32_t w, double s) {
  const double p = std::fabs(static_cast<double>(x)) / s;
  const double u = static_cast<double>(w) * 0x1p-32;
  return u < p ? (x < 0.0f ? 2 : 1) : 0;
}

/// TernGrad codes of x[0..len), one bucket segment of scaler s > 0, rounding words w. fp64 as
/// the scalar definition: p = |x| / s (correctly rounded), u = w * 2^-32 (exact).
void TernaryCodes(const float* HWY_RESTRICT x, const uint32_t* HWY_RESTRICT w, size_t len, float s,
                  uint8_t* HWY_RESTRICT codes) {
  const double sd = static_cast<double>(s);
  size_t k = 0;
#if HWY_TARGET != HWY_SCALAR
  if (s >= 0x1p-100f && s <= 0x1p100f) {
    // Fast path in fp32: pf = |x| * (1/s) and uf = w * 2^-32 are each within 2^-22 of p and u
    // (p <= 1, u < 1), so when |pf - uf| > 2^-20 the fp64 comparison u < p has the same
    // outcome; otherwise the vector falls back to the exact scalar definition (rare: about 2^-19
    // of the elements).
    const hn::ScalableTag<float> df;
    const hn::RebindToSigned<decltype(df)> di;
    const hn::Rebind<uint8_t, decltype(df)> du8;
    const size_t lanes = hn::Lanes(df);
    const auto inv = hn::Set(df, 1.0f / s);
    const auto zero = hn::Zero(df), one = hn::Set(df, 1.0f), two = hn::Set(df, 2.0f);
    const auto eps = hn::Set(df, 0x1p-20f);
    const auto two31 = hn::Set(df, 0x1p31f), two_m32 = hn::Set(df, 0x1p-32f);
    const auto flip = hn::Set(di, static_cast<int32_t>(0x80000000u));
    for (; k + lanes <= len; k += lanes) {
      const auto xv = hn::LoadU(df, x + k);
      const auto pf = hn::Mul(hn::Abs(xv), inv);
      const auto wi = hn::Xor(hn::LoadU(di, reinterpret_cast<const int32_t*>(w + k)), flip);
      const auto uf = hn::Mul(hn::Add(hn::ConvertTo(df, wi), two31), two_m32);
      const auto diff = hn::Sub(pf, uf);
      if (HWY_UNLIKELY(!hn::AllFalse(df, hn::Lt(hn::Abs(diff), eps)))) {
        for (size_t j = k; j < k + lanes; ++j) codes[j] = ternaryOne(x[j], w[j], sd);
        continue;
      }
      const auto code =
          hn::IfThenElseZero(hn::Gt(diff, zero), hn::IfThenElse(hn::Lt(xv, zero), two, one));
      hn::StoreU(hn::DemoteTo(du8, hn::ConvertTo(di, code)), du8, codes + k);
    }
    for (; k < len; ++k) codes[k] = ternaryOne(x[k], w[k], sd);
    return;
  }
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const hn::Rebind<int32_t, decltype(dd)> di;
  const hn::Rebind<uint8_t, decltype(dd)> du8;
  const size_t lanes = hn::Lanes(dd);
  const auto s_v = hn::Set(dd, sd);
  const auto zero = hn::Zero(dd), one = hn::Set(dd, 1.0), two = hn::Set(dd, 2.0);
  const auto two31 = hn::Set(dd, 0x1p31), two_m32 = hn::Set(dd, 0x1p-32);
  const auto flip = hn::Set(di, static_cast<int32_t>(0x80000000u));
  for (; k + lanes <= len; k += lanes) {
    const auto xv = hn::PromoteTo(dd, hn::LoadU(df, x + k));
    const auto p = hn::Div(hn::Abs(xv), s_v);
    // (double)w = (double)(int32)(w ^ 2^31) + 2^31, exact.
    const auto wi = hn::Xor(hn::LoadU(di, reinterpret_cast<const int32_t*>(w + k)), flip);
    const auto u = hn::Mul(hn::Add(hn::PromoteTo(dd, wi), two31), two_m32);
    const auto code = hn::IfThenElseZero(hn::Lt(u, p), hn::IfThenElse(hn::Lt(xv, zero), two, one));
    hn::StoreU(hn::DemoteTo(du8, hn::DemoteTo(di, code)), du8, codes + k);
  }
#endif
  for (; k < len; ++k) codes[k] = ternaryOne(x[k], w[k], sd);
}

/// codes[k] = x[k] < 0 ? 1 : 0 (±0 give 0).
void SignCodes(const float* HWY_RESTRICT x, size_t len, uint8_t* HWY_RESTRICT codes) {
  size_t k = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<uint8_t, decltype(df)> du8;
  const size_t lanes = hn::Lanes(df);
  const auto one = hn::Set(di, 1);
  for (; k + lanes <= len; k += lanes) {
    const auto negative = hn::RebindMask(di, hn::Lt(hn::LoadU(df, x + k), hn::Zero(df)));
    hn::StoreU(hn::DemoteTo(du8, hn::IfThenElseZero(negative, one)), du8, codes + k);
  }
#endif
  for (; k < len; ++k) codes[k] = x[k] < 0.0f ? 1 : 0;
}

/// out[k] = out[k] + weight * (codes[k] != 0 ? b : a).
void DecodeBinary(const uint8_t* HWY_RESTRICT codes, size_t len, float a, float b, float weight,
                  float* HWY_RESTRICT out) {
  size_t k = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<uint8_t, decltype(df)> du8;
  const size_t lanes = hn::Lanes(df);
  const auto a_v = hn::Set(df, a), b_v = hn::Set(df, b), w = hn::Set(df, weight);
  for (; k + lanes <= len; k += lanes) {
    const auto c = hn::PromoteTo(di, hn::LoadU(du8, codes + k));
    const auto set = hn::RebindMask(df, hn::Ne(c, hn::Zero(di)));
    const auto value = hn::IfThenElse(set, b_v, a_v);
    hn::StoreU(hn::Add(hn::LoadU(df, out + k), hn::Mul(w, value)), df, out + k);
  }
#endif
  for (; k < len; ++k) {
    const float value = codes[k] != 0 ? b : a;
    out[k] = out[k] + weight * value;
  }
}

/// out[k] = out[k] + weight * value, value = +0 (code 0), s (1), -s (2).
void DecodeTernary(const uint8_t* HWY_RESTRICT codes, size_t len, float s, float weight,
                   float* HWY_RESTRICT out) {
  const float neg = -s;
  size_t k = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const hn::Rebind<uint8_t, decltype(df)> du8;
  const size_t lanes = hn::Lanes(df);
  const auto s_v = hn::Set(df, s), neg_v = hn::Set(df, neg), w = hn::Set(df, weight);
  const auto one = hn::Set(di, 1), two = hn::Set(di, 2);
  for (; k + lanes <= len; k += lanes) {
    const auto c = hn::PromoteTo(di, hn::LoadU(du8, codes + k));
    const auto is1 = hn::RebindMask(df, hn::Eq(c, one));
    const auto is2 = hn::RebindMask(df, hn::Eq(c, two));
    const auto value = hn::IfThenElse(is1, s_v, hn::IfThenElseZero(is2, neg_v));
    hn::StoreU(hn::Add(hn::LoadU(df, out + k), hn::Mul(w, value)), df, out + k);
  }
#endif
  for (; k < len; ++k) {
    const uint8_t c = codes[k];
    const float value = c == 0 ? 0.0f : (c == 1 ? s : neg);
    out[k] = out[k] + weight * value;
  }
}

/// True when some 2-bit code of bytes[0..n) is 3.
bool HasCode3(const uint8_t* HWY_RESTRICT bytes, size_t n) {
  uint8_t any = 0;
  for (size_t i = 0; i < n; ++i) any = static_cast<uint8_t>(any | (bytes[i] & (bytes[i] >> 1)));
  return (any & 0x55) != 0;
}

}  // namespace lightwire::kernels::bucket_simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include "kernels/codecs/bucket.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>

#include "kernels/codecs/bucket_family.h"
#include "kernels/parallel.h"
#include "kernels/philox.h"
#include "kernels/reduce.h"
#include "kernels/registry.h"

namespace lightwire::kernels {
namespace bucket_simd {
HWY_EXPORT(MaxMagnitudeBits);
HWY_EXPORT(SplitBlockSums);
HWY_EXPORT(TernaryCodes);
HWY_EXPORT(SignCodes);
HWY_EXPORT(DecodeBinary);
HWY_EXPORT(DecodeTernary);
HWY_EXPORT(HasCode3);

uint32_t maxMagnitudeBits(const float* x, size_t n) {
  return HWY_DYNAMIC_DISPATCH(MaxMagnitudeBits)(x, n);
}
void splitBlockSums(const float* x, size_t n, double* pos, double* neg, uint64_t* negatives) {
  HWY_DYNAMIC_DISPATCH(SplitBlockSums)(x, n, pos, neg, negatives);
}
void ternaryCodes(const float* x, const uint32_t* w, size_t len, float s, uint8_t* codes) {
  HWY_DYNAMIC_DISPATCH(TernaryCodes)(x, w, len, s, codes);
}
void signCodes(const float* x, size_t len, uint8_t* codes) {
  HWY_DYNAMIC_DISPATCH(SignCodes)(x, len, codes);
}
void decodeBinary(const uint8_t* codes, size_t len, float a, float b, float weight, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeBinary)(codes, len, a, b, weight, out);
}
void decodeTernary(const uint8_t* codes, size_t len, float s, float weight, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeTernary)(codes, len, s, weight, out);
}
bool hasCode3(const uint8_t* bytes, size_t n) { return HWY_DYNAMIC_DISPATCH(HasCode3)(bytes, n); }

}  // namespace bucket_simd

namespace {
using bucket_simd::decodeBinary;
using bucket_simd::decodeTernary;
using bucket_simd::hasCode3;
using bucket_simd::maxMagnitudeBits;
using bucket_simd::signCodes;
using bucket_simd::splitBlockSums;
using bucket_simd::ternaryCodes;

constexpr size_t kSubBlock = 1024;          // elements coded per batch
constexpr size_t kParallelGrain = 1 << 15;  // elements per thread at least

/// The name of scale k of a bucket in messages.
std::string scaleName(BucketCodecKind kind, uint64_t k) {
  switch (kind) {
    case BucketCodecKind::kTerngrad:
      return "scaler";
    case BucketCodecKind::kSignsgd:
      return "scale";
    case BucketCodecKind::kOnebit:
      break;
  }
  return (k & 1) != 0 ? "neg" : "pos";
}

/// Packs codes[0..len) of `bits` (1 or 2) bits each, LSB-first, into dst[0..ceil(len*bits/8));
/// the unused bits of the last byte are 0. Eight (or four) 0/1 (0..3) bytes become one byte by a
/// multiplication whose partial products never overlap below the result bits.
void packCodes(const uint8_t* codes, size_t len, unsigned bits, uint8_t* dst) {
  size_t k = 0, j = 0;
  if (bits == 1) {
    for (; k + 8 <= len; k += 8, ++j) {
      uint64_t v;
      std::memcpy(&v, codes + k, 8);
      dst[j] = static_cast<uint8_t>((v * 0x0102040810204080ull) >> 56);
    }
  } else {
    for (; k + 4 <= len; k += 4, ++j) {
      uint32_t v;
      std::memcpy(&v, codes + k, 4);
      dst[j] = static_cast<uint8_t>((v * 0x01041040u) >> 24);
    }
  }
  if (k < len) {
    uint32_t last = 0;
    for (unsigned t = 0; k < len; ++k, t += bits) last |= uint32_t{codes[k]} << t;
    dst[j] = static_cast<uint8_t>(last);
  }
}

/// Byte -> its eight 1-bit codes (as bytes), or its four 2-bit codes.
struct UnpackTables {
  uint64_t ones[256];
  uint32_t twos[256];
  UnpackTables() {
    for (unsigned b = 0; b < 256; ++b) {
      ones[b] = 0;
      twos[b] = 0;
      for (unsigned t = 0; t < 8; ++t) ones[b] |= uint64_t{(b >> t) & 1u} << (8 * t);
      for (unsigned t = 0; t < 4; ++t) twos[b] |= uint32_t{(b >> (2 * t)) & 3u} << (8 * t);
    }
  }
};
const UnpackTables kUnpack;

/// Reads `len` codes of `bits` (1 or 2) bits each from src (starting on a byte boundary).
void unpackCodes(const uint8_t* src, size_t len, unsigned bits, uint8_t* codes) {
  size_t k = 0, j = 0;
  if (bits == 1) {
    for (; k + 8 <= len; k += 8, ++j) std::memcpy(codes + k, &kUnpack.ones[src[j]], 8);
  } else {
    for (; k + 4 <= len; k += 4, ++j) std::memcpy(codes + k, &kUnpack.twos[src[j]], 4);
  }
  for (unsigned t = 0; k < len; ++k, t += bits) {
    codes[k] = static_cast<uint8_t>((src[j] >> t) & ((1u << bits) - 1));
  }
}

/// One of the three codecs with a fixed bucket size. Immutable, thread-safe.
class BucketCodec final : public BucketFamilyCodec {
 public:
  BucketCodec(BucketCodecKind kind, const CodecConfig& c)
      : BucketFamilyCodec(c, bucketKindInfo(kind).bits, RandomPurpose::kTerngradRounding),
        kind_(kind),
        info_(bucketKindInfo(kind)),
        traits_(bucketCodecTraits(kind)) {}

  const CodecTraits& traits() const override { return traits_; }

  Status decodeChunk(std::span<const uint8_t> payload, float weight, float* out,
                     size_t out_elements) const override {
    auto parsed = parseBucketPayload(kind_, payload, out_elements);
    if (!parsed) return parsed.status();
    if (parsed->header.codec == CodecId::kNone) {
      return decodeDenseF32(payload, parsed->header, weight, out);
    }
    const uint64_t n = parsed->header.elements, d = parsed->d;
    const uint8_t* scales = parsed->scales;
    const uint8_t* codes = parsed->codes;

    // Sub-blocks of kSubBlock codes start on byte boundaries; each is decoded bucket segment
    // by bucket segment.
    alignas(64) uint8_t batch_codes[kSubBlock];
    for (uint64_t off = 0; off < n; off += kSubBlock) {
      const auto m = static_cast<size_t>(std::min<uint64_t>(kSubBlock, n - off));
      unpackCodes(codes + off * info_.bits / 8, m, info_.bits, batch_codes);
      for (uint64_t pos = off; pos < off + m;) {
        const uint64_t k = pos / d, seg_end = std::min<uint64_t>(off + m, (k + 1) * d);
        const float a = loadF32(scales + 4 * info_.scales * k);
        const size_t len = static_cast<size_t>(seg_end - pos);
        uint8_t* c = batch_codes + (pos - off);
        switch (kind_) {
          case BucketCodecKind::kTerngrad:
            decodeTernary(c, len, a, weight, out + pos);
            break;
          case BucketCodecKind::kSignsgd:
            decodeBinary(c, len, a, -a, weight, out + pos);
            break;
          case BucketCodecKind::kOnebit:
            decodeBinary(c, len, a, loadF32(scales + 8 * k + 4), weight, out + pos);
            break;
        }
        pos = seg_end;
      }
    }
    return Status::ok();
  }

 private:
  std::optional<uint64_t> payloadBytes(uint64_t n) const override {
    const auto l = bucketLayout(n, bucket_, info_);
    if (!l) return std::nullopt;
    return l->total;
  }

  Regions writeHeaders(ConstTensor x, uint64_t buckets, uint8_t* p) const override {
    writeHeader(p, {info_.id, x.dtype, 0, 0, x.elements});
    storeU32(p + kHeaderBytes, bucket_);
    uint8_t* scales = p + kBucketHeaderBytes;
    return {scales, scales + 4 * info_.scales * buckets};
  }

  // Stores bucket j's scales (x: its fp32-widenable elements) at `dst`; false when not finite.
  bool bucketScales(ConstTensor bucket, float* scratch, uint8_t* dst, float* first) const {
    uint32_t max_bits = 0;
    double sum = 0.0, pos = 0.0, neg = 0.0;
    uint64_t negatives = 0;
    for (size_t b = 0; b < bucket.elements; b += kReduceBlock) {
      const size_t len = std::min(kReduceBlock, bucket.elements - b);
      const float* v = static_cast<const float*>(bucket.data) + b;
      if (bucket.dtype != DType::kF32) {
        widenToFloat(bucket.slice(b, len), scratch);
        v = scratch;
      }
      switch (kind_) {
        case BucketCodecKind::kTerngrad:
          max_bits = std::max(max_bits, maxMagnitudeBits(v, len));
          break;
        case BucketCodecKind::kSignsgd:
          sum = sum + canonicalBlockSum(v, len, ReduceTerm::kAbs);
          break;
        case BucketCodecKind::kOnebit:
          splitBlockSums(v, len, &pos, &neg, &negatives);
          break;
      }
    }
    const auto count = static_cast<double>(bucket.elements);
    switch (kind_) {
      case BucketCodecKind::kTerngrad: {
        const float s = bitsFloat(max_bits);
        storeF32(dst, s);
        *first = s;
        return max_bits < 0x7F800000u;
      }
      case BucketCodecKind::kSignsgd: {
        const auto scale = static_cast<float>(sum / count);
        storeF32(dst, scale);
        *first = scale;
        return std::isfinite(scale);
      }
      case BucketCodecKind::kOnebit:
        break;
    }
    const uint64_t positives = bucket.elements - negatives;
    const float ps =
        positives > 0 ? static_cast<float>(pos / static_cast<double>(positives)) : 0.0f;
    const float ns =
        negatives > 0 ? static_cast<float>(neg / static_cast<double>(negatives)) : 0.0f;
    storeF32(dst, ps);
    storeF32(dst + 4, ns);
    *first = ps;
    return std::isfinite(ps) && std::isfinite(ns);
  }

  void encodeBuckets(ConstTensor x, size_t begin, size_t first, size_t last,
                     const PhiloxStream& rng, const Regions& regions,
                     std::atomic<bool>& non_finite) const override {
    uint8_t* scales = regions.scales;
    uint8_t* codes = regions.codes;
    alignas(64) float scratch[kReduceBlock];
    alignas(64) float values[kSubBlock];
    alignas(64) uint32_t words[kSubBlock];
    alignas(64) uint8_t batch_codes[kSubBlock];
    alignas(64) float batch_scales[kSubBlock];
    const bool ternary = kind_ == BucketCodecKind::kTerngrad;
    const size_t d = bucket_;
    const unsigned bits = info_.bits;
    // Batches of whole units (their codes end on byte boundaries), so every sub-block of codes
    // starts on a byte boundary.
    const size_t per_batch = unit_buckets_ * std::max<size_t>(1, kSubBlock / (d * unit_buckets_));
    for (size_t k = first; k < last; k += per_batch) {
      if (non_finite.load(std::memory_order_relaxed)) return;  // the chunk is escaped anyway
      const size_t k_end = std::min(last, k + per_batch);
      const size_t e_end = std::min(x.elements, k_end * d);
      for (size_t j = k; j < k_end; ++j) {
        const ConstTensor bucket = x.slice(j * d, std::min(d, x.elements - j * d));
        if (!bucketScales(bucket, scratch, scales + 4 * info_.scales * j, &batch_scales[j - k])) {
          non_finite.store(true, std::memory_order_relaxed);
          return;
        }
      }
      for (size_t off = k * d; off < e_end; off += kSubBlock) {
        const size_t m = std::min(kSubBlock, e_end - off);
        const float* v = static_cast<const float*>(x.data) + off;
        if (x.dtype != DType::kF32) {
          widenToFloat(x.slice(off, m), values);
          v = values;
        }
        if (ternary) {
          for (size_t pos = off; pos < off + m;) {  // bucket segment by bucket segment
            const size_t bucket = pos / d, seg_end = std::min(off + m, (bucket + 1) * d);
            const float s = batch_scales[bucket - k];
            const size_t at = pos - off, len = seg_end - pos;
            if (s != 0.0f) {
              rng.words(begin + pos, len, words + at);  // vectorised Philox
              ternaryCodes(v + at, words + at, len, s, batch_codes + at);
            } else {
              // Every x of the bucket is ±0: code 0 (§4.9), and no word is drawn.
              std::fill(batch_codes + at, batch_codes + at + len, uint8_t{0});
            }
            pos = seg_end;
          }
        } else {
          signCodes(v, m, batch_codes);
        }
        packCodes(batch_codes, m, bits, codes + off * bits / 8);
      }
    }
  }

  BucketCodecKind kind_;
  BucketKindInfo info_;
  CodecTraits traits_;
};

}  // namespace

Status checkBucketSize(const char* name, const CodecConfig& config) {
  if (config.bucket_size < 1 || config.bucket_size > kMaxScaleBucket) {
    return invalidArgument(std::string(name) + ": bucket_size must be in 1.." +
                           std::to_string(kMaxScaleBucket) + ", got " +
                           std::to_string(config.bucket_size));
  }
  return Status::ok();
}

BucketFamilyCodec::BucketFamilyCodec(const CodecConfig& config, unsigned code_bits,
                                     RandomPurpose purpose)
    : config_(config), bucket_(config.bucket_size), purpose_(purpose) {
  const uint64_t bucket_bits = uint64_t{bucket_} * code_bits;
  unit_buckets_ = 8 / std::gcd<uint64_t, uint64_t>(bucket_bits, 8);
}

size_t BucketFamilyCodec::maxPayloadBytes(size_t n) const {
  const auto total = payloadBytes(n);
  return std::max<size_t>(total ? *total : 0, kHeaderBytes + 4 * n);
}

std::optional<size_t> BucketFamilyCodec::nominalPayloadBytes(size_t n,
                                                             std::optional<double>) const {
  const auto total = payloadBytes(n);
  if (!total) return std::nullopt;
  return static_cast<size_t>(*total);
}

Result<size_t> BucketFamilyCodec::doEncodeChunk(const StepContext& ctx, const Chunking& chunking,
                                                size_t chunk, int /*round*/,
                                                std::span<const uint8_t>, ConstTensor input,
                                                CodecState&, std::span<std::byte>,
                                                std::span<uint8_t> out) const {
  const size_t begin = chunking.begin(chunk), n = chunking.size(chunk);
  const auto total = payloadBytes(n);
  if (!total) {
    return outOfRange(std::string(traits().name) + " chunk of " + std::to_string(n) +
                      " elements is too large");
  }
  uint8_t* p = out.data();
  const ConstTensor x = input.slice(begin, n);
  const size_t buckets = n / bucket_ + (n % bucket_ != 0 ? 1 : 0);
  const Regions regions = writeHeaders(x, buckets, p);

  const PhiloxStream rng(ctx.seed, ctx.name_key, ctx.step, ctx.rank, purpose_);
  std::atomic<bool> non_finite{false};
  const size_t units = (buckets + unit_buckets_ - 1) / unit_buckets_;
  auto work = [&](size_t lo, size_t hi) {
    encodeBuckets(x, begin, lo * unit_buckets_, std::min(hi * unit_buckets_, buckets), rng, regions,
                  non_finite);
  };
  const size_t grain = std::max<size_t>(1, kParallelGrain / (unit_buckets_ * bucket_));
  parallelFor(ctx.stream, units, grain, work);
  if (!non_finite.load(std::memory_order_relaxed)) return static_cast<size_t>(*total);

  // Escape (docs/determinism.md §4.5 step 2, §4.9–4.11): the whole chunk as plain fp32 values.
  return writeDensePayload(x, p, ctx.stream);
}

std::optional<BucketLayout> bucketLayout(uint64_t n, uint64_t d, const BucketKindInfo& info) {
  if (d == 0 || n > (uint64_t{1} << 60)) return std::nullopt;
  BucketLayout l;
  l.buckets = n / d + (n % d != 0 ? 1 : 0);
  l.scale_bytes = 4 * info.scales * l.buckets;
  l.code_bytes = packedBytes(n, info.bits);
  l.total = kBucketHeaderBytes + l.scale_bytes + l.code_bytes;
  return l;
}

Result<BucketPayload> parseBucketPayload(BucketCodecKind kind, std::span<const uint8_t> payload,
                                         uint64_t out_elements) {
  const BucketKindInfo info = bucketKindInfo(kind);
  const std::string name = info.name;
  auto h = readHeader(payload, info.id, out_elements, 0);
  if (!h) return h.status();
  BucketPayload parsed;
  parsed.header = *h;
  if (h->codec == CodecId::kNone) return parsed;
  const uint8_t* p = payload.data();
  if (payload.size() < kBucketHeaderBytes) {
    return dataLoss(name + " payload truncated: " + std::to_string(payload.size()) +
                    " bytes, its headers alone need " + std::to_string(kBucketHeaderBytes));
  }
  const uint32_t d = loadU32(p + kHeaderBytes);
  if (d == 0) return dataLoss(name + " payload has bucket size d = 0");
  const uint64_t n = h->elements;
  const auto layout = bucketLayout(n, d, info);
  if (!layout) {
    return dataLoss(name + " payload element count " + std::to_string(n) + " is too large");
  }
  if (payload.size() != layout->total) {
    return dataLoss(name + " payload of " + std::to_string(n) + " elements (d = " +
                    std::to_string(d) + ") must be " + std::to_string(layout->total) +
                    " bytes, got " + std::to_string(payload.size()));
  }
  const uint8_t* scales = p + kBucketHeaderBytes;
  const uint64_t scale_count = layout->buckets * info.scales;
  for (uint64_t k = 0; k < scale_count; ++k) {
    const float v = loadF32(scales + 4 * k);
    // onebit's second scale of each bucket (neg) must be <= 0, every other scale >= 0.
    const bool negative_scale = info.scales == 2 && (k & 1) != 0;
    const bool bad = !std::isfinite(v) || (negative_scale ? v > 0.0f : v < 0.0f);
    if (bad) {
      return dataLoss(name + " bucket " + std::to_string(k / info.scales) + " has " +
                      scaleName(kind, k) + " " + std::to_string(v) + " (must be finite and " +
                      (negative_scale ? "<= 0)" : ">= 0)"));
    }
  }
  const uint8_t* codes = scales + layout->scale_bytes;
  const auto code_bytes = static_cast<size_t>(layout->code_bytes);
  if (!paddingIsZero({codes, code_bytes}, n * info.bits)) {
    return dataLoss(name + " payload has non-zero unused bits after its last code");
  }
  if (kind == BucketCodecKind::kTerngrad && hasCode3(codes, code_bytes)) {
    return dataLoss(name + " payload has the invalid code 3");
  }
  parsed.d = d;
  parsed.layout = *layout;
  parsed.scales = scales;
  parsed.codes = codes;
  return parsed;
}

Result<std::unique_ptr<Codec>> makeBucketCodec(BucketCodecKind kind, const CodecConfig& config) {
  if (Status s = checkBucketSize(bucketKindInfo(kind).name, config); !s.isOk()) return s;
  return std::unique_ptr<Codec>(new BucketCodec(kind, config));
}

namespace {

// `terngrad`: TernGrad: per-bucket max |g| scaler and stochastic ternary 2-bit codes (Philox
// purpose 4); unbiased, error feedback off by default.
LW_REGISTER_CODEC(terngrad, bucketCodecTraits(BucketCodecKind::kTerngrad),
                  [](const CodecConfig& c) {
                    return makeBucketCodec(BucketCodecKind::kTerngrad, c);
                  });

// `signsgd`: signSGD with a per-bucket mean-|g| scale and one sign bit per element; biased, error
// feedback on by default.
LW_REGISTER_CODEC(signsgd, bucketCodecTraits(BucketCodecKind::kSignsgd), [](const CodecConfig& c) {
  return makeBucketCodec(BucketCodecKind::kSignsgd, c);
});

// `onebit`: 1-bit SGD: per bucket the means of the non-negative and of the negative elements, one
// bit per element picks one; biased, error feedback on by default.
LW_REGISTER_CODEC(onebit, bucketCodecTraits(BucketCodecKind::kOnebit), [](const CodecConfig& c) {
  return makeBucketCodec(BucketCodecKind::kOnebit, c);
});

}  // namespace

}  // namespace lightwire::kernels
#endif  // HWY_ONCE
