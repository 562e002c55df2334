#pragma once
// The skeleton of the "per-bucket scales + bit-packed codes" family: `qsgd`
// (kernels/codecs/qsgd.cc) and `terngrad`, `signsgd`, `onebit` (kernels/codecs/bucket.cc);
// docs/determinism.md §4.5, §4.9–4.11, docs/wire-format.md. Host only: the layouts the CUDA codecs
// share are in kernels/codecs/bucket.h and kernels/codecs/qsgd_layout.h.
//
// Every member of the family has a fixed bucket size d, chunks aligned to buckets, no analysis and
// no workspace, a payload size fixed by (n, d), and encodes a chunk in parallel units of whole
// buckets whose codes end on a byte boundary (so threads never share a byte of the code stream),
// falling back to the `none` layout when a bucket's scale is not finite.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "kernels/codec.h"
#include "kernels/philox.h"
#include "kernels/status.h"

namespace lightwire::kernels {

/// invalidArgument unless 1 <= bucket_size <= kMaxScaleBucket (kernels/codecs/bucket.h), the
/// message naming the codec.
Status checkBucketSize(const char* name, const CodecConfig& config);

/// A codec of the family. Immutable, thread-safe; subclasses add the payload headers, the
/// per-bucket encoding and the decoding.
class BucketFamilyCodec : public Codec {
 public:
  const CodecConfig& config() const override { return config_; }
  size_t chunkAlignment() const override { return bucket_; }
  size_t workspaceBytes(const Chunking&) const override { return 0; }
  size_t maxPayloadBytes(size_t n) const override;
  std::optional<size_t> nominalPayloadBytes(size_t n, std::optional<double>) const override;

 protected:
  /// Where one chunk's scales and codes start in its payload.
  struct Regions {
    uint8_t* scales;
    uint8_t* codes;
  };

  /// `code_bits` bits per element; `purpose` the Philox purpose of the rounding words.
  BucketFamilyCodec(const CodecConfig& config, unsigned code_bits, RandomPurpose purpose);

  /// Payload bytes of a chunk of n elements (the packed size every step has); nullopt when n is
  /// too large for the layout.
  virtual std::optional<uint64_t> payloadBytes(uint64_t n) const = 0;
  /// Writes the headers of the payload of chunk x at p (room for payloadBytes(x.elements)).
  virtual Regions writeHeaders(ConstTensor x, uint64_t buckets, uint8_t* p) const = 0;
  /// Scales and codes of buckets [first, last) of chunk x, which starts at tensor index `begin`;
  /// `first` is a multiple of unit_buckets_. Sets non_finite (and may stop) when a scale is not
  /// finite, and may stop early once it is set.
  virtual void encodeBuckets(ConstTensor x, size_t begin, size_t first, size_t last,
                             const PhiloxStream& rng, const Regions& regions,
                             std::atomic<bool>& non_finite) const = 0;

  Status doAnalyze(const StepContext&, const Chunking&, ConstTensor, CodecState&,
                   std::span<std::byte>) const override {
    return Status::ok();
  }
  Result<size_t> doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                               int round, std::span<const uint8_t> previous, ConstTensor input,
                               CodecState& state, std::span<std::byte> workspace,
                               std::span<uint8_t> out) const final;

  CodecConfig config_;
  uint32_t bucket_;
  uint64_t unit_buckets_ = 1;  // buckets per thread unit: their codes end on a byte boundary
  RandomPurpose purpose_;
};

}  // namespace lightwire::kernels
