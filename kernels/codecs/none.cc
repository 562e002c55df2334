// `none`: the fp32 values as they are (docs/wire-format.md). The baseline, and the layout every
// decoder accepts as a dense escape.

#include "kernels/parallel.h"
#include "kernels/registry.h"
#include "kernels/simd/kernels.h"

namespace lightwire::kernels {
namespace {

constexpr CodecTraits kNoneTraits{.id = CodecId::kNone, .name = "none", .summable = true};

class NoneCodec final : public Codec {
 public:
  explicit NoneCodec(const CodecConfig& c) : config_(c) {}

  const CodecTraits& traits() const override { return kNoneTraits; }
  const CodecConfig& config() const override { return config_; }
  size_t workspaceBytes(const Chunking&) const override { return 0; }
  size_t maxPayloadBytes(size_t n) const override { return kHeaderBytes + 4 * n; }

  Status doAnalyze(const StepContext&, const Chunking&, ConstTensor, CodecState&,
                   std::span<std::byte>) const override {
    return Status::ok();
  }

  Result<size_t> doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk, int,
                               std::span<const uint8_t>, ConstTensor input, CodecState&,
                               std::span<std::byte>, std::span<uint8_t> out) const override {
    return writeDensePayload(input.slice(chunking.begin(chunk), chunking.size(chunk)), out.data(),
                             ctx.stream);
  }

  Status decodeChunk(std::span<const uint8_t> payload, float weight, float* out,
                     size_t out_elements) const override {
    auto h = readHeader(payload, CodecId::kNone, out_elements, 0);
    if (!h) return h.status();
    return decodeDenseF32(payload, *h, weight, out);
  }

  Status decodeChunkInto(std::span<const uint8_t> payload, float weight, float* out,
                         size_t out_elements) const override {
    auto h = readHeader(payload, CodecId::kNone, out_elements, 0);
    if (!h) return h.status();
    return decodeDenseF32(payload, *h, weight, out, /*into=*/true);
  }

  Result<size_t> addPayloads(std::span<const uint8_t> a, std::span<const uint8_t> b,
                             std::span<uint8_t> out) const override {
    if (a.size() < kHeaderBytes) return dataLoss("payload truncated");
    const uint64_t n = loadU64(a.data() + 8);
    auto ha = readHeader(a, CodecId::kNone, n, 0);
    if (!ha) return ha.status();
    auto hb = readHeader(b, CodecId::kNone, n, 0);
    if (!hb) return hb.status();
    if (a.size() != kHeaderBytes + 4 * n || b.size() != a.size()) {
      return dataLoss("none payloads to add have inconsistent lengths");
    }
    if (out.size() < a.size()) return outOfRange("payload buffer too small");
    writeHeader(out.data(), *ha);
    simd::addFloats(a.data() + kHeaderBytes, b.data() + kHeaderBytes, n, out.data() + kHeaderBytes);
    return a.size();
  }

 private:
  CodecConfig config_;
};

LW_REGISTER_CODEC(none, kNoneTraits, [](const CodecConfig& c) -> Result<std::unique_ptr<Codec>> {
  return std::unique_ptr<Codec>(new NoneCodec(c));
});

}  // namespace
}  // namespace lightwire::kernels
