// `qsgd` (docs/determinism.md §4.5, docs/wire-format.md): per bucket of d elements an fp32 norm,
// per element a b-bit code (sign, then a level in 0..s rounded stochastically with a 16-bit half of
// a Philox word, indexed by the whole-tensor element index), bit-packed LSB-first without padding.
// A chunk whose bucket norms are not all finite is sent in the `none` layout instead.

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "kernels/codecs/bucket.h"
#include "kernels/codecs/bucket_family.h"
#include "kernels/codecs/qsgd_layout.h"
#include "kernels/philox.h"
#include "kernels/reduce.h"
#include "kernels/registry.h"
#include "kernels/simd/kernels.h"

namespace lightwire::kernels {
namespace {

constexpr size_t kSubBlock = 1024;  // elements quantised per batch

// Element i rounds with half i mod 2 (0 = low 16 bits) of stream word i / 2 (§4.5 step 3); the
// encoder copies a run of words into a uint16_t array, which is that order only here.
static_assert(std::endian::native == std::endian::little,
              "qsgd reads the 16-bit halves of Philox words in little-endian order");

/// fp32 norm of one bucket: canonical fp64 sum of squares (§2: reduce blocks added in order, as
/// canonicalSum does without a stream), fp64 sqrt, then fp32. `scratch` holds kReduceBlock floats
/// for widening fp16/bf16 input.
float bucketNorm(ConstTensor bucket, float* scratch) {
  double total = 0.0;
  for (size_t begin = 0; begin < bucket.elements; begin += kReduceBlock) {
    const size_t len = std::min(kReduceBlock, bucket.elements - begin);
    const float* v = static_cast<const float*>(bucket.data) + begin;
    if (bucket.dtype != DType::kF32) {
      widenToFloat(bucket.slice(begin, len), scratch);
      v = scratch;
    }
    total = total + canonicalBlockSum(v, len, ReduceTerm::kSquare);
  }
  return static_cast<float>(std::sqrt(total));
}

/// Appends codes[0..len) of `bits` bits each to the stream, four codes per BitWriter call.
void packCodes(const uint8_t* codes, size_t len, unsigned bits, BitWriter& writer) {
  size_t k = 0;
  for (; k + 4 <= len; k += 4) {
    const uint32_t v = uint32_t{codes[k]} | (uint32_t{codes[k + 1]} << bits) |
                       (uint32_t{codes[k + 2]} << (2 * bits)) |
                       (uint32_t{codes[k + 3]} << (3 * bits));
    writer.put(v, 4 * bits);
  }
  for (; k < len; ++k) writer.put(codes[k], bits);
}

/// Reads `len` codes of `bits` bits each from the stream into codes[0..len).
void unpackCodes(BitReader& reader, size_t len, unsigned bits, uint8_t* codes) {
  const uint32_t mask = (1u << bits) - 1;
  size_t k = 0;
  for (; k + 4 <= len; k += 4) {
    const uint32_t v = reader.get(4 * bits);
    codes[k] = static_cast<uint8_t>(v & mask);
    codes[k + 1] = static_cast<uint8_t>((v >> bits) & mask);
    codes[k + 2] = static_cast<uint8_t>((v >> (2 * bits)) & mask);
    codes[k + 3] = static_cast<uint8_t>((v >> (3 * bits)) & mask);
  }
  for (; k < len; ++k) codes[k] = static_cast<uint8_t>(reader.get(bits));
}

constexpr CodecTraits kQsgdTraits{.id = CodecId::kQsgd, .name = "qsgd"};

/// QSGD with fixed bits and bucket size. Immutable, thread-safe.
class QsgdCodec final : public BucketFamilyCodec {
 public:
  explicit QsgdCodec(const CodecConfig& c)
      : BucketFamilyCodec(c, static_cast<unsigned>(c.bits), RandomPurpose::kQsgdRounding),
        bits_(static_cast<unsigned>(c.bits)),
        levels_((1u << (c.bits - 1)) - 1) {}

  const CodecTraits& traits() const override { return kQsgdTraits; }

  Status decodeChunk(std::span<const uint8_t> payload, float weight, float* out,
                     size_t out_elements) const override {
    auto q = parseQsgdPayload(payload, out_elements);
    if (!q) return q.status();
    if (q->header.codec == CodecId::kNone) return decodeDenseF32(payload, q->header, weight, out);
    const unsigned b = q->bits;
    const uint64_t d = q->d, n = q->header.elements;
    const uint8_t* norms = q->norms;
    const uint8_t* codes = q->codes;

    const uint32_t s = (1u << (b - 1)) - 1;
    const float s_f = static_cast<float>(s);
    BitReader reader(codes);
    alignas(64) uint8_t batch_codes[kSubBlock];
    alignas(64) float scales[kSubBlock];
    // Batches of whole buckets when they are small, else sub-blocks of one bucket.
    const uint64_t per_batch = std::max<uint64_t>(1, kSubBlock / d);
    for (uint64_t k = 0; k < q->layout.buckets; k += per_batch) {
      const uint64_t e_end = std::min<uint64_t>(n, (k + per_batch) * d);
      for (uint64_t off = k * d; off < e_end; off += kSubBlock) {
        const auto m = static_cast<size_t>(std::min<uint64_t>(kSubBlock, e_end - off));
        for (uint64_t pos = off; pos < off + m;) {
          const uint64_t bucket = pos / d, seg_end = std::min<uint64_t>(off + m, (bucket + 1) * d);
          const float scale = loadF32(norms + 4 * bucket) / s_f;
          std::fill(scales + (pos - off), scales + (seg_end - off), scale);
          pos = seg_end;
        }
        // Eight-bit codes are the bytes of the stream themselves.
        const uint8_t* batch = codes + off;
        if (b != 8) {
          unpackCodes(reader, m, b, batch_codes);
          batch = batch_codes;
        }
        simd::qsgdDequantize(batch, scales, m, s, b - 1, weight, out + off);
      }
    }
    return Status::ok();
  }

 private:
  std::optional<uint64_t> payloadBytes(uint64_t n) const override {
    const auto l = qsgdLayout(n, bucket_, bits_);
    if (!l) return std::nullopt;
    return l->total;
  }

  Regions writeHeaders(ConstTensor x, uint64_t buckets, uint8_t* p) const override {
    writeHeader(p, {CodecId::kQsgd, x.dtype, 0, 0, x.elements});
    p[16] = static_cast<uint8_t>(bits_);
    p[17] = p[18] = p[19] = 0;
    storeU32(p + 20, bucket_);
    uint8_t* norms = p + kQsgdHeaderBytes;
    return {norms, norms + 4 * buckets};
  }

  // Norms (the scales) and codes of buckets [first, last).
  void encodeBuckets(ConstTensor x, size_t begin, size_t first, size_t last,
                     const PhiloxStream& rng, const Regions& regions,
                     std::atomic<bool>& non_finite) const override {
    uint8_t* norms = regions.scales;
    uint8_t* codes = regions.codes;
    alignas(64) float scratch[kReduceBlock];
    alignas(64) float values[kSubBlock];
    alignas(64) uint32_t words[kSubBlock / 2 + 1];  // halves of a run of up to kSubBlock elements
    alignas(64) uint16_t halves[kSubBlock + 2];     // the same words as 16-bit halves
    alignas(64) uint8_t batch_codes[kSubBlock];
    alignas(64) float batch_norms[kSubBlock];
    const unsigned sign_shift = bits_ - 1;
    const size_t d = bucket_;
    BitWriter writer(codes + (uint64_t{first} * d * bits_) / 8);
    // Batches of whole buckets when they are small, else one bucket in sub-blocks.
    const size_t per_batch = std::max<size_t>(1, kSubBlock / d);
    for (size_t k = first; k < last; k += per_batch) {
      if (non_finite.load(std::memory_order_relaxed)) return;  // the chunk is escaped anyway
      const size_t k_end = std::min(last, k + per_batch);
      const size_t e_end = std::min(x.elements, k_end * d);
      {  // The next batch's input, requested while this one is quantised (hides DRAM latency).
        const size_t width = dtypeSize(x.dtype);
        const auto* next = static_cast<const char*>(x.data) + e_end * width;
        const size_t next_bytes =
            std::min<size_t>(8192, (std::min(x.elements, std::min(last, k_end + per_batch) * d) -
                                    std::min(x.elements, e_end)) *
                                       width);
        for (size_t b = 0; b < next_bytes; b += 64) __builtin_prefetch(next + b);
      }
      for (size_t j = k; j < k_end; ++j) {
        const float norm = bucketNorm(x.slice(j * d, std::min(d, x.elements - j * d)), scratch);
        storeF32(norms + 4 * j, norm);
        if (!std::isfinite(norm)) {
          non_finite.store(true, std::memory_order_relaxed);
          return;
        }
        batch_norms[j - k] = norm;
      }
      for (size_t off = k * d; off < e_end; off += kSubBlock) {
        const size_t m = std::min(kSubBlock, e_end - off);
        const float* v = static_cast<const float*>(x.data) + off;
        if (x.dtype != DType::kF32) {
          widenToFloat(x.slice(off, m), values);
          v = values;
        }
        // Eight-bit codes go straight into the stream (byte-aligned), others through packCodes.
        uint8_t* dst = bits_ == 8 ? codes + off : batch_codes;
        for (size_t pos = off; pos < off + m;) {  // bucket by bucket: random words, then codes
          const size_t bucket = pos / d, seg_end = std::min(off + m, (bucket + 1) * d);
          const float norm = batch_norms[bucket - k];
          if (norm != 0.0f) {
            // Tensor indices [i0, i1) use the halves of stream words i0 / 2 .. (i1 - 1) / 2.
            const uint64_t i0 = uint64_t{begin} + pos, i1 = uint64_t{begin} + seg_end;
            const uint64_t w0 = i0 >> 1;
            const size_t word_count = static_cast<size_t>(((i1 - 1) >> 1) - w0 + 1);
            rng.words(w0, word_count, words);
            std::memcpy(halves, words, word_count * sizeof(uint32_t));  // no aliasing through casts
            simd::qsgdQuantize(v + (pos - off), halves + (i0 & 1), seg_end - pos, norm, levels_,
                               sign_shift, dst + (pos - off));
          } else {
            // Every x of the bucket is ±0, never < 0: level 0 and sign 0 (§4.5), no word drawn.
            std::memset(dst + (pos - off), 0, seg_end - pos);
          }
          pos = seg_end;
        }
        if (bits_ != 8) packCodes(batch_codes, m, bits_, writer);
      }
    }
    writer.flush();
  }

  unsigned bits_;
  uint32_t levels_;  // s = 2^(b-1) - 1
};

LW_REGISTER_CODEC(qsgd, kQsgdTraits, [](const CodecConfig& c) -> Result<std::unique_ptr<Codec>> {
  if (c.bits < 2 || c.bits > 8) {
    return invalidArgument("qsgd: bits must be in 2..8, got " + std::to_string(c.bits));
  }
  if (Status s = checkBucketSize("qsgd", c); !s.isOk()) return s;
  return std::unique_ptr<Codec>(new QsgdCodec(c));
});

}  // namespace
}  // namespace lightwire::kernels
