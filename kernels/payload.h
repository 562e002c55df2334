#pragma once
// Payload header and byte-level helpers shared by every codec (docs/wire-format.md).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "kernels/dtype.h"
#include "kernels/status.h"

namespace lightwire::kernels {

class CpuStream;

enum class CodecId : uint8_t {
  kNone = 0,
  kFp16 = 1,
  kBf16 = 2,
  kTopk = 3,
  kRandomk = 4,
  kThreshold = 5,
  kDgc = 6,
  kQsgd = 7,
  kTerngrad = 8,
  kSignsgd = 9,
  kOnebit = 10,
  kPowersgd = 11,
};

inline constexpr size_t kHeaderBytes = 16;
inline constexpr uint8_t kPayloadVersion = 1;
inline constexpr uint8_t kMagic0 = 0x4C, kMagic1 = 0x57;  // "LW"

struct PayloadHeader {
  CodecId codec = CodecId::kNone;
  DType dtype = DType::kF32;
  uint8_t flags = 0;
  uint8_t round = 0;
  uint64_t elements = 0;
};

inline void storeU16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
}
inline void storeU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
inline void storeU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}
inline void storeF32(uint8_t* p, float v) { storeU32(p, floatBits(v)); }
inline uint16_t loadU16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
inline uint32_t loadU32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
inline uint64_t loadU64(const uint8_t* p) {
  return uint64_t(loadU32(p)) | (uint64_t(loadU32(p + 4)) << 32);
}
inline float loadF32(const uint8_t* p) { return bitsFloat(loadU32(p)); }

/// Writes the 16-byte header at out[0..16).
void writeHeader(uint8_t* out, const PayloadHeader& h);

/// Parses and validates the header of `payload` for a decoder of codec `expected` that decodes
/// into `out_elements` elements. Accepts `expected` or kNone (the universal dense escape), and
/// only flag bits inside `allowed_flags`, and rounds up to `max_round` (0 for single-round codecs).
Result<PayloadHeader> readHeader(std::span<const uint8_t> payload, CodecId expected,
                                 uint64_t out_elements, uint8_t allowed_flags,
                                 uint8_t max_round = 0);

/// A `none`-layout payload `a` of n elements plus n fp32 values `b`, as a `none` payload in `out`
/// (header of `a`, then a[i] + b[i]: the bits NoneCodec::addPayloads gives for a payload of `b`).
/// Returns its size; `a` refused (dataLoss) when it is not such a payload, `out` too small.
Result<size_t> addDenseValues(std::span<const uint8_t> a, const float* b, uint64_t n,
                              std::span<uint8_t> out);

/// Decodes a `none`-layout payload whose header was already read: out += weight * values, or
/// (`into`) out = +0 + weight * values, the same bits without reading `out`.
Status decodeDenseF32(std::span<const uint8_t> payload, const PayloadHeader& h, float weight,
                      float* out, bool into = false);

/// Writes x as a `none`-layout payload (header + fp32 values) at out[0 .. 16 + 4·x.elements) and
/// returns its size: the `none` codec, and the dense escape of codecs whose chunk holds a
/// non-finite value.
size_t writeDensePayload(ConstTensor x, uint8_t* out, CpuStream* stream);

/// Bytes that `count` values of `width` bits occupy, before any padding.
inline size_t packedBytes(uint64_t count, unsigned width) { return (count * width + 7) / 8; }

/// LSB-first bit-stream writer over a zero-initialised buffer.
class BitWriter {
 public:
  explicit BitWriter(uint8_t* out) : out_(out) {}
  void put(uint64_t value, unsigned width) {
    // Accumulates up to 64 bits; width <= 32.
    acc_ |= value << fill_;
    fill_ += width;
    while (fill_ >= 8) {
      *out_++ = uint8_t(acc_);
      acc_ >>= 8;
      fill_ -= 8;
    }
  }
  void flush() {
    if (fill_ > 0) *out_++ = uint8_t(acc_);
    acc_ = 0;
    fill_ = 0;
  }

 private:
  uint8_t* out_;
  uint64_t acc_ = 0;
  unsigned fill_ = 0;
};

/// LSB-first bit-stream reader; the caller guarantees the stream holds enough bits.
class BitReader {
 public:
  explicit BitReader(const uint8_t* in) : in_(in) {}
  uint32_t get(unsigned width) {
    while (fill_ < width) {
      acc_ |= uint64_t(*in_++) << fill_;
      fill_ += 8;
    }
    const uint64_t mask = width == 32 ? 0xFFFFFFFFull : ((1ull << width) - 1);
    const uint32_t v = uint32_t(acc_ & mask);
    acc_ >>= width;
    fill_ -= width;
    return v;
  }

 private:
  const uint8_t* in_;
  uint64_t acc_ = 0;
  unsigned fill_ = 0;
};

/// True when every bit from stream bit `used_bits` to the end of `bytes` is zero.
bool paddingIsZero(std::span<const uint8_t> bytes, uint64_t used_bits);

std::string codecIdName(CodecId id);

}  // namespace lightwire::kernels
