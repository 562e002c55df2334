// `fp16` and `bf16` (docs/determinism.md §4.1, docs/wire-format.md): every value cast to a 16-bit
// float. One codec template, parameterised by the format; the conversions are those of dtype.h.

#include <bit>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "kernels/parallel.h"
#include "kernels/registry.h"
#include "kernels/simd/kernels.h"

namespace lightwire::kernels {
namespace {

constexpr size_t kParallelGrain = 1 << 16;  // elements per thread at least

/// binary16 (IEEE half) as a cast-codec format. Stateless.
struct Fp16Format {
  static constexpr CodecId kId = CodecId::kFp16;
  static constexpr DType kDType = DType::kF16;
  static constexpr const char* kName = "fp16";
  static uint16_t encode(float f) { return floatToHalf(f); }
  static float decode(uint16_t h) { return halfToFloat(h); }

  /// dst[0..2n) = the values of src[0..n) (Highway dispatch: F16C on AVX2 and AVX-512, which
  /// converts exactly as §4.1; the bit manipulation of dtype.h elsewhere).
  static void encodeRange(const float* src, size_t n, uint8_t* dst) {
    simd::floatsToHalves(src, n, dst);
  }
  /// out[i] = out[i] + weight * value i of src, for i < n.
  static void decodeRange(const uint8_t* src, size_t n, float weight, float* out) {
    simd::accumulateHalves(src, n, weight, out);
  }
  /// out[i] = value i of src, exactly, for i < n.
  static void widenRange(const uint8_t* src, size_t n, float* out) {
    simd::halvesToFloats(src, n, out);
  }
};

/// bfloat16 (top half of binary32) as a cast-codec format. Stateless.
struct Bf16Format {
  static constexpr CodecId kId = CodecId::kBf16;
  static constexpr DType kDType = DType::kBF16;
  static constexpr const char* kName = "bf16";
  static uint16_t encode(float f) { return floatToBf16(f); }
  static float decode(uint16_t h) { return bf16ToFloat(h); }

  static void encodeRange(const float* src, size_t n, uint8_t* dst) {
    simd::floatsToBf16s(src, n, dst);
  }
  static void decodeRange(const uint8_t* src, size_t n, float weight, float* out) {
    simd::accumulateBf16s(src, n, weight, out);
  }
  static void widenRange(const uint8_t* src, size_t n, float* out) {
    simd::bf16sToFloats(src, n, out);
  }
};

/// Exact size of a cast payload of n elements; nullopt when it does not fit in size_t.
std::optional<size_t> castPayloadBytes(uint64_t n) {
  if (n > (std::numeric_limits<size_t>::max() - kHeaderBytes) / 2) return std::nullopt;
  return kHeaderBytes + 2 * static_cast<size_t>(n);
}

/// Checks that a payload whose header `h` was read (own layout or the `none` escape) has exactly
/// the length its element count needs.
template <typename F>
Status checkLength(std::span<const uint8_t> p, const PayloadHeader& h) {
  const uint64_t n = h.elements;
  const bool dense = h.codec == CodecId::kNone;
  const uint64_t width = dense ? 4 : 2;
  const uint64_t body = p.size() - kHeaderBytes;  // readHeader guarantees size >= header
  if (body % width != 0 || body / width != n) {
    return dataLoss(std::string(dense ? "none" : F::kName) + " payload of " + std::to_string(n) +
                    " elements must be 16 + " + std::to_string(width) + " * " + std::to_string(n) +
                    " bytes, got " + std::to_string(p.size()));
  }
  return Status::ok();
}

/// Single-round codec: the header's round byte must be 0 (readHeader does not check it).
template <typename F>
Status checkRound(const PayloadHeader& h) {
  if (h.round == 0) return Status::ok();
  return dataLoss(std::string(F::kName) + " payload has round " + std::to_string(h.round) +
                  ", must be 0");
}

/// Value i of a validated payload body, in either layout.
template <typename F>
inline float valueAt(const uint8_t* body, bool dense, size_t i) {
  return dense ? loadF32(body + 4 * i) : F::decode(loadU16(body + 2 * i));
}

template <typename F>
constexpr CodecTraits kCastTraits{.id = F::kId, .name = F::kName, .summable = true};

/// The fp16 or bf16 codec. Immutable, thread-safe.
template <typename F>
class CastCodec final : public Codec {
 public:
  explicit CastCodec(const CodecConfig& c) : config_(c) {}

  const CodecTraits& traits() const override { return kCastTraits<F>; }
  const CodecConfig& config() const override { return config_; }
  size_t workspaceBytes(const Chunking&) const override { return 0; }
  size_t maxPayloadBytes(size_t n) const override { return kHeaderBytes + 2 * n; }

  Status doAnalyze(const StepContext&, const Chunking&, ConstTensor, CodecState&,
                   std::span<std::byte>) const override {
    return Status::ok();
  }

  Result<size_t> doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                               int /*round*/, std::span<const uint8_t>, ConstTensor input,
                               CodecState&, std::span<std::byte>,
                               std::span<uint8_t> out) const override {
    const size_t begin = chunking.begin(chunk), n = chunking.size(chunk);
    writeHeader(out.data(), {F::kId, input.dtype, 0, 0, n});
    uint8_t* body = out.data() + kHeaderBytes;
    auto work = [&](size_t lo, size_t hi) { encodeRange(input, begin, lo, hi, body); };
    parallelFor(ctx.stream, n, kParallelGrain, work);
    return kHeaderBytes + 2 * n;
  }

  Status decodeChunk(std::span<const uint8_t> payload, float weight, float* out,
                     size_t out_elements) const override {
    auto h = readHeader(payload, F::kId, out_elements, 0);
    if (!h) return h.status();
    LW_RETURN_IF_ERROR(checkRound<F>(*h));
    if (h->codec == CodecId::kNone) return decodeDenseF32(payload, *h, weight, out);
    LW_RETURN_IF_ERROR(checkLength<F>(payload, *h));
    F::decodeRange(payload.data() + kHeaderBytes, out_elements, weight, out);
    return Status::ok();
  }

  Result<size_t> addPayloads(std::span<const uint8_t> a, std::span<const uint8_t> b,
                             std::span<uint8_t> out) const override {
    if (a.size() < kHeaderBytes || b.size() < kHeaderBytes) {
      return dataLoss(std::string(F::kName) + " payload to add is shorter than its header");
    }
    const uint64_t n = loadU64(a.data() + 8), n_b = loadU64(b.data() + 8);
    if (n != n_b) {
      return dataLoss(std::string(F::kName) + " payloads to add hold " + std::to_string(n) +
                      " and " + std::to_string(n_b) + " elements");
    }
    auto ha = readHeader(a, F::kId, n, 0);
    if (!ha) return ha.status();
    auto hb = readHeader(b, F::kId, n, 0);
    if (!hb) return hb.status();
    LW_RETURN_IF_ERROR(checkRound<F>(*ha));
    LW_RETURN_IF_ERROR(checkRound<F>(*hb));
    LW_RETURN_IF_ERROR(checkLength<F>(a, *ha));
    LW_RETURN_IF_ERROR(checkLength<F>(b, *hb));
    const std::optional<size_t> size = castPayloadBytes(n);
    if (!size || out.size() < *size) return outOfRange("payload buffer too small");
    const bool dense_a = ha->codec == CodecId::kNone, dense_b = hb->codec == CodecId::kNone;
    const uint8_t* va = a.data() + kHeaderBytes;
    const uint8_t* vb = b.data() + kHeaderBytes;
    uint8_t* vo = out.data() + kHeaderBytes;
    // Element i is read before out[i] is written and the output is never wider than an input, so
    // `out` may be one of the inputs.
    if (!dense_a && !dense_b) {  // the common case, vectorised a block at a time: the same bits
      constexpr size_t kBlock = 2048;
      float fa[kBlock], fb[kBlock];
      for (size_t i = 0; i < n; i += kBlock) {
        const size_t len = std::min<size_t>(kBlock, n - i);
        F::widenRange(va + 2 * i, len, fa);
        F::widenRange(vb + 2 * i, len, fb);
        for (size_t j = 0; j < len; ++j) fa[j] = fa[j] + fb[j];
        F::encodeRange(fa, len, vo + 2 * i);
      }
    } else {
      for (size_t i = 0; i < n; ++i) {
        const float sum = valueAt<F>(va, dense_a, i) + valueAt<F>(vb, dense_b, i);
        storeU16(vo + 2 * i, F::encode(sum));
      }
    }
    writeHeader(out.data(), {F::kId, ha->dtype, 0, 0, n});
    return *size;
  }

 private:
  // Codes input[begin + lo .. begin + hi) into body[2 * lo ..).
  static void encodeRange(ConstTensor input, size_t begin, size_t lo, size_t hi, uint8_t* body) {
    if (input.dtype == F::kDType) {  // already this format: bit for bit
      const auto* src = static_cast<const uint16_t*>(input.data) + begin;
      if constexpr (std::endian::native == std::endian::little) {
        std::memcpy(body + 2 * lo, src + lo, 2 * (hi - lo));
      } else {
        for (size_t i = lo; i < hi; ++i) storeU16(body + 2 * i, src[i]);
      }
    } else if (input.dtype == DType::kF32) {
      F::encodeRange(static_cast<const float*>(input.data) + begin + lo, hi - lo, body + 2 * lo);
    } else {  // the other 16-bit format: widen (exact), then convert
      const ConstTensor src = input.slice(begin, hi);
      for (size_t i = lo; i < hi; ++i) storeU16(body + 2 * i, F::encode(src.at(i)));
    }
  }

  CodecConfig config_;
};

LW_REGISTER_CODEC(fp16, kCastTraits<Fp16Format>,
                  [](const CodecConfig& c) -> Result<std::unique_ptr<Codec>> {
                    return std::unique_ptr<Codec>(new CastCodec<Fp16Format>(c));
                  });
LW_REGISTER_CODEC(bf16, kCastTraits<Bf16Format>,
                  [](const CodecConfig& c) -> Result<std::unique_ptr<Codec>> {
                    return std::unique_ptr<Codec>(new CastCodec<Bf16Format>(c));
                  });

}  // namespace
}  // namespace lightwire::kernels
