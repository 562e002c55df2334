#pragma once
// The "per-bucket scale + bit-packed codes" codecs: `terngrad`, `signsgd`, `onebit`
// (docs/determinism.md §4.9–4.11, docs/wire-format.md). One implementation, parameterised by the
// kind; each codec's file registers its factory.

#include <memory>

#include "kernels/codec.h"

namespace lightwire::kernels {

enum class BucketCodecKind { kTerngrad, kSignsgd, kOnebit };

/// Largest accepted bucket_size for these codecs (as qsgd).
inline constexpr uint32_t kMaxScaleBucket = 1u << 24;

/// Builds the codec of `kind` from `config` (reads bucket_size); invalidArgument when out of range.
Result<std::unique_ptr<Codec>> makeBucketCodec(BucketCodecKind kind, const CodecConfig& config);

}  // namespace lightwire::kernels
