#pragma once
// Hostile payloads for a single-round codec's decoder (docs/wire-format.md): every one must be
// refused with a message and leave the output buffer untouched; and bad calls to its encoder.
// Shared by the qsgd tests and the bucket codec tests (tests/kernels/bucket_codec_test_util.h).

#include <doctest.h>

#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kernels/codec.h"
#include "kernels/payload.h"

namespace lightwire::kernels::testing {

class HostileDecoder {
 public:
  /// `good` is a valid payload of `elements` elements that `codec` decodes.
  HostileDecoder(const Codec& codec, std::vector<uint8_t> good, size_t elements)
      : codec_(codec), good_(std::move(good)), elements_(elements), out_(64) {
    for (size_t i = 0; i < out_.size(); ++i) out_[i] = static_cast<float>(i) * 0.25f - 1.0f;
    out_[2] = NAN;
    before_ = out_;
  }

  /// Decodes `p` into the first `out_elements` of the output: it must fail, say why and write
  /// nothing.
  void operator()(std::span<const uint8_t> p, size_t out_elements, const std::string& what) {
    const Status s = codec_.decodeChunk(p, 1.0f, out_.data(), out_elements);
    CHECK_MESSAGE(!s.isOk(), what);
    CHECK_MESSAGE(!s.message().empty(), what);
    REQUIRE_MESSAGE(std::memcmp(out_.data(), before_.data(), 4 * out_.size()) == 0, what);
    ++refused_;
  }

  /// A copy of the good payload after `edit(payload)`.
  template <typename Edit>
  std::vector<uint8_t> mutated(Edit edit) const {
    std::vector<uint8_t> p = good_;
    edit(p);
    return p;
  }

  /// Every truncation of the good payload, and one trailing byte.
  void refuseTruncations() {
    auto& refuse = *this;
    for (size_t len = 0; len < good_.size(); ++len) {
      refuse({good_.data(), len}, elements_, "truncated to " + std::to_string(len));
    }
    refuse(mutated([](auto& p) { p.push_back(0); }), elements_, "trailing byte");
  }

  /// A set unused bit in the last byte, then the common header's fields: magic, version, the
  /// `foreign_ids` as codec id, the none id on a `body` body, dtype, flags, reserved and round
  /// bytes, output counts and the header's count.
  void refuseHeaderEdits(const std::vector<int>& foreign_ids, const std::string& body) {
    auto& refuse = *this;
    const size_t n = elements_;
    refuse(mutated([](auto& p) { p.back() = static_cast<uint8_t>(p.back() | 0x80); }), n,
           "non-zero unused bit");
    refuse(mutated([](auto& p) { p[0] = 0x4D; }), n, "wrong magic");
    refuse(mutated([](auto& p) { p[1] = 0; }), n, "wrong magic");
    refuse(mutated([](auto& p) { p[2] = 0; }), n, "version 0");
    refuse(mutated([](auto& p) { p[2] = 2; }), n, "version 2");
    for (int id : foreign_ids) {
      refuse(mutated([id](auto& p) { p[3] = static_cast<uint8_t>(id); }), n,
             "codec id " + std::to_string(id));
    }
    refuse(mutated([](auto& p) { p[3] = 0; }), n, "none header on a " + body + " body");
    refuse(mutated([](auto& p) { p[4] = 3; }), n, "unknown dtype");
    for (int bit = 0; bit < 8; ++bit) {
      refuse(mutated([bit](auto& p) { p[5] = static_cast<uint8_t>(1 << bit); }), n,
             "flag bit " + std::to_string(bit));
    }
    refuse(mutated([](auto& p) { p[7] = 0x10; }), n, "reserved header byte");
    refuse(mutated([](auto& p) { p[6] = 1; }), n, "round byte of a single-round codec");
    refuse(good_, n - 1, "output shorter");
    refuse(good_, n + 1, "output longer");
    refuse(mutated([n](auto& p) { storeU64(p.data() + 8, n + 1); }), n, "header count");
  }

  const std::vector<uint8_t>& good() const { return good_; }
  size_t elements() const { return elements_; }
  /// The output buffer (64 floats); decoding a valid payload into it is allowed once done.
  float* out() { return out_.data(); }
  int refused() const { return refused_; }

 private:
  const Codec& codec_;
  std::vector<uint8_t> good_;
  size_t elements_;
  std::vector<float> out_, before_;
  int refused_ = 0;
};

/// Bad calls to the encoder of a single-round codec whose chunks align to 16 elements: a chunk
/// index or round past the end, chunkings that are misaligned or of another tensor, a short
/// buffer. The buffer must hold the none layout of 100 elements.
inline void checkEncoderRefusesBadCalls(const Codec& codec) {
  const std::vector<float> x(100, 1.0f);
  const ConstTensor input{x.data(), x.size(), DType::kF32};
  StepContext ctx;
  CodecState state;
  std::vector<uint8_t> out(codec.maxPayloadBytes(100));
  const Chunking good = Chunking::make(100, 32, 16);
  CHECK(codec.encodeChunk(ctx, good, 3, 0, {}, input, state, {}, out).isOk());
  CHECK_FALSE(codec.encodeChunk(ctx, good, 4, 0, {}, input, state, {}, out).isOk());
  CHECK_FALSE(codec.encodeChunk(ctx, good, 0, 1, {}, input, state, {}, out).isOk());
  CHECK_FALSE(codec.encodeChunk(ctx, Chunking{100, 30}, 0, 0, {}, input, state, {}, out).isOk());
  CHECK_FALSE(
      codec.encodeChunk(ctx, Chunking::make(99, 0, 16), 0, 0, {}, input, state, {}, out).isOk());
  CHECK_FALSE(
      codec.encodeChunk(ctx, good, 0, 0, {}, input, state, {}, std::span<uint8_t>(out.data(), 10))
          .isOk());
  CHECK(codec.maxPayloadBytes(100) >= 16 + 4 * 100);
}

}  // namespace lightwire::kernels::testing
