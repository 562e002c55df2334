#pragma once
// The "per-bucket scale + bit-packed codes" codecs: `terngrad`, `signsgd`, `onebit`
// (docs/determinism.md §4.9–4.11, docs/wire-format.md). One implementation, parameterised by the
// kind; each codec's file registers its factory. The payload layout and its one host-side
// validation are shared with the CUDA codecs (kernels/cuda/codecs/bucket.cu).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "kernels/codec.h"
#include "kernels/payload.h"

namespace lightwire::kernels {

enum class BucketCodecKind { kTerngrad, kSignsgd, kOnebit };

/// Largest accepted bucket_size for these codecs (as qsgd).
inline constexpr uint32_t kMaxScaleBucket = 1u << 24;

inline constexpr size_t kBucketHeaderBytes = kHeaderBytes + 4;  // + d

/// Static description of one kind. Plain value.
struct BucketKindInfo {
  CodecId id;
  const char* name;
  unsigned bits;    // per element code width
  unsigned scales;  // fp32 scales per bucket
  bool default_error_feedback;
};

constexpr BucketKindInfo bucketKindInfo(BucketCodecKind k) {
  switch (k) {
    case BucketCodecKind::kTerngrad:
      return {CodecId::kTerngrad, "terngrad", 2, 1, false};
    case BucketCodecKind::kSignsgd:
      return {CodecId::kSignsgd, "signsgd", 1, 1, true};
    case BucketCodecKind::kOnebit:
      break;
  }
  return {CodecId::kOnebit, "onebit", 1, 2, true};
}

/// Byte sizes of one payload. Plain value.
struct BucketLayout {
  uint64_t buckets = 0;
  uint64_t scale_bytes = 0;
  uint64_t code_bytes = 0;
  uint64_t total = 0;
};

/// The layout of n elements in buckets of d; nullopt when d = 0 or n is so large that the sizes
/// could overflow (hostile element counts).
std::optional<BucketLayout> bucketLayout(uint64_t n, uint64_t d, const BucketKindInfo& info);

/// A validated payload of one kind. When header.codec is kNone (the dense escape) only `header`
/// is set and the caller checks the dense body; otherwise every field is, and the payload's
/// length, d, scales (finite, with the sign of their kind), code padding and (terngrad) codes are
/// valid.
struct BucketPayload {
  PayloadHeader header;
  uint32_t d = 0;
  BucketLayout layout;
  const uint8_t* scales = nullptr;  // layout.scale_bytes bytes of fp32 scales
  const uint8_t* codes = nullptr;   // layout.code_bytes bytes of codes
};

/// Every check of a payload of `kind` for out_elements elements, in the decoder's order; dataLoss
/// (or readHeader's error) when one fails.
Result<BucketPayload> parseBucketPayload(BucketCodecKind kind, std::span<const uint8_t> payload,
                                         uint64_t out_elements);

/// Builds the codec of `kind` from `config` (reads bucket_size); invalidArgument when out of range.
Result<std::unique_ptr<Codec>> makeBucketCodec(BucketCodecKind kind, const CodecConfig& config);

/// The traits of a bucket codec (its registration and every instance).
constexpr CodecTraits bucketCodecTraits(BucketCodecKind kind) {
  const BucketKindInfo info = bucketKindInfo(kind);
  return CodecTraits{
      .id = info.id, .name = info.name, .default_error_feedback = info.default_error_feedback};
}

}  // namespace lightwire::kernels
