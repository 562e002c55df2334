// `signsgd`: signSGD with a per-bucket mean-|g| scale and one sign bit
// per element; biased, error feedback on by default.
// Arithmetic and layout: docs/determinism.md, docs/wire-format.md; the shared implementation is in
// kernels/bucket_codec.cc.

#include "kernels/bucket_codec.h"
#include "kernels/registry.h"

namespace lightwire::kernels {
namespace {

LW_REGISTER_CODEC(signsgd, bucketCodecTraits(BucketCodecKind::kSignsgd), [](const CodecConfig& c) {
  return makeBucketCodec(BucketCodecKind::kSignsgd, c);
});

}  // namespace
}  // namespace lightwire::kernels
