// `onebit`: 1-bit SGD: per bucket the means of the non-negative and of
// the negative elements, one bit per element picks one; biased, error feedback on by default.
// Arithmetic and layout: docs/determinism.md, docs/wire-format.md; the shared implementation is in
// kernels/bucket_codec.cc.

#include "kernels/bucket_codec.h"
#include "kernels/registry.h"

namespace lightwire::kernels {
namespace {

LW_REGISTER_CODEC(onebit, bucketCodecTraits(BucketCodecKind::kOnebit), [](const CodecConfig& c) {
  return makeBucketCodec(BucketCodecKind::kOnebit, c);
});

}  // namespace
}  // namespace lightwire::kernels
