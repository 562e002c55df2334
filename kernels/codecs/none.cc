// `none`: the fp32 values as they are (docs/wire-format.md). The baseline, and the layout every
// decoder accepts as a dense escape.

#include <bit>
#include <cstring>

#include "kernels/parallel.h"
#include "kernels/registry.h"

namespace lightwire::kernels {
namespace {

static_assert(std::endian::native == std::endian::little, "payloads are little-endian");

class NoneCodec final : public Codec {
 public:
  explicit NoneCodec(const CodecConfig& c) : config_(c) {}

  const CodecTraits& traits() const override {
    static const CodecTraits t{.id = CodecId::kNone, .name = "none", .summable = true};
    return t;
  }
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
    const size_t begin = chunking.begin(chunk), n = chunking.size(chunk);
    writeHeader(out.data(), {CodecId::kNone, input.dtype, 0, 0, n});
    uint8_t* body = out.data() + kHeaderBytes;
    auto work = [&](size_t lo, size_t hi) {
      if (input.dtype == DType::kF32) {  // little-endian fp32 is already the wire layout
        std::memcpy(body + 4 * lo, static_cast<const float*>(input.data) + begin + lo,
                    4 * (hi - lo));
        return;
      }
      for (size_t i = lo; i < hi; ++i) storeF32(body + 4 * i, input.at(begin + i));
    };
    if (ctx.stream)
      ctx.stream->parallelFor(n, 1 << 16, work);
    else
      work(0, n);
    return kHeaderBytes + 4 * n;
  }

  Status decodeChunk(std::span<const uint8_t> payload, float weight, float* out,
                     size_t out_elements) const override {
    auto h = readHeader(payload, CodecId::kNone, out_elements, 0);
    if (!h) return h.status();
    return decodeDenseF32(payload, *h, weight, out);
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
    for (uint64_t i = 0; i < n; ++i) {
      const size_t o = kHeaderBytes + 4 * i;
      storeF32(out.data() + o, loadF32(a.data() + o) + loadF32(b.data() + o));
    }
    return a.size();
  }

 private:
  CodecConfig config_;
};

LW_REGISTER_CODEC(none, "none", [](const CodecConfig& c) -> Result<std::unique_ptr<Codec>> {
  return std::unique_ptr<Codec>(new NoneCodec(c));
});

}  // namespace
}  // namespace lightwire::kernels
