// `topk` (docs/determinism.md §4.3): the k elements of largest magnitude over the whole tensor,
// ties broken by lower index, less those below min_magnitude (§4.2), sent in the sparse layout. No
// memory of its own; the registry wraps it in error feedback by default.

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "kernels/parallel.h"
#include "kernels/registry.h"
#include "kernels/select.h"

namespace lightwire::kernels {
namespace {

constexpr CodecTraits kTopkTraits{.id = CodecId::kTopk,
                                  .name = "topk",
                                  .summable = false,
                                  .sparse = true,
                                  .own_memory = false,
                                  .default_error_feedback = true,
                                  .uses_density = true,
                                  .uses_min_magnitude = true};

class TopkCodec final : public Codec {
 public:
  TopkCodec(const CodecConfig& c, double density)
      : config_(c), density_(density), min_key_(minMagnitudeKey(c.min_magnitude)) {}

  const CodecTraits& traits() const override { return kTopkTraits; }
  const CodecConfig& config() const override { return config_; }
  bool selectsGlobally() const override { return true; }
  size_t selectionCount(size_t n, std::optional<double> density) const override {
    return selectionSize(n, density.value_or(density_));
  }
  size_t workspaceBytes(const Chunking& c) const override {
    return SelectWorkspace::bytes(c.elements);
  }
  size_t maxPayloadBytes(size_t n) const override {
    return sparseMaxPayloadBytes(n, config_.sparse_values);
  }
  std::optional<size_t> nominalPayloadBytes(size_t n,
                                            std::optional<double> density) const override {
    // k = density * n pairs; an index costs at most 4 bytes (gap coding usually needs less).
    const double d = density.value_or(density_);
    const size_t k = std::min(n, static_cast<size_t>(std::ceil(d * static_cast<double>(n))));
    return std::min(maxPayloadBytes(n), 64 + k * (4 + dtypeSize(config_.sparse_values)));
  }

  Status doAnalyze(const StepContext& ctx, const Chunking& chunking, ConstTensor input, CodecState&,
                   std::span<std::byte> workspace) const override {
    const size_t n = chunking.elements;
    double density = density_;
    if (ctx.density) {
      LW_RETURN_IF_ERROR(checkDensity(*ctx.density, "topk: step density"));
      density = *ctx.density;
    }
    WorkspaceCarver carver(workspace);
    const SelectWorkspace ws = SelectWorkspace::carve(carver, n);
    selectExact(input, selectionSize(n, density), ctx.stream, ws, ws.plan);
    applyMinKey(input, min_key_, ws.slots, ws.plan);
    return Status::ok();
  }

  Result<size_t> doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                               int /*round*/, std::span<const uint8_t>, ConstTensor input,
                               CodecState&, std::span<std::byte> workspace,
                               std::span<uint8_t> out) const override {
    WorkspaceCarver carver(workspace);
    const SelectWorkspace ws = SelectWorkspace::carve(carver, chunking.elements);
    const size_t begin = chunking.begin(chunk), len = chunking.size(chunk);
    if (ws.plan->has_list) {
      auto written = writeSparsePayloadFromList(CodecId::kTopk, input.dtype, config_.sparse_values,
                                                ws.slots.first(ws.plan->listed), input, begin, len,
                                                ctx.stream, out);
      if (!written) return written.status();
      return written->bytes;
    }
    auto written =
        writeSparsePayload(CodecId::kTopk, input.dtype, config_.sparse_values, *ws.plan, input,
                           begin, len, ws.slots.subspan(begin, len), ctx.stream, out);
    if (!written) return written.status();
    return written->bytes;
  }

  Status decodeChunk(std::span<const uint8_t> payload, float weight, float* out,
                     size_t out_elements) const override {
    return decodeSparsePayload(payload, CodecId::kTopk, weight, out, out_elements);
  }

 private:
  CodecConfig config_;
  double density_;
  uint32_t min_key_;  // min_magnitude as a key floor (0 = off)
};

LW_REGISTER_CODEC(topk, kTopkTraits, [](const CodecConfig& c) -> Result<std::unique_ptr<Codec>> {
  auto density = configuredDensity(c, "topk");
  if (!density) return density.status();
  LW_RETURN_IF_ERROR(checkSparseValues(c, "topk"));
  return std::unique_ptr<Codec>(new TopkCodec(c, *density));
});

}  // namespace
}  // namespace lightwire::kernels
