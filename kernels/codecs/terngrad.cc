// `terngrad`: TernGrad: per-bucket max |g| scaler and stochastic
// ternary 2-bit codes (Philox purpose 4); unbiased, error feedback off by default.
// Arithmetic and layout: docs/determinism.md, docs/wire-format.md; the shared implementation is in
// kernels/bucket_codec.cc.

#include "kernels/bucket_codec.h"
#include "kernels/registry.h"

namespace lightwire::kernels {
namespace {

LW_REGISTER_CODEC(terngrad, bucketCodecTraits(BucketCodecKind::kTerngrad),
                  [](const CodecConfig& c) {
                    return makeBucketCodec(BucketCodecKind::kTerngrad, c);
                  });

}  // namespace
}  // namespace lightwire::kernels
