// `threshold` (docs/determinism.md §4.8): every element with key(x) >= key((float)t) — |x| >= t
// in fp32, plus every NaN and ±Inf — sent in the sparse layout of topk. The decision is local to
// each element, so a chunk needs nothing from the others and analyze() has nothing to do. No
// memory of its own; the registry wraps it in error feedback by default.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "kernels/parallel.h"
#include "kernels/registry.h"
#include "kernels/select.h"

namespace lightwire::kernels {
namespace {

constexpr CodecTraits kThresholdTraits{.id = CodecId::kThreshold,
                                       .name = "threshold",
                                       .summable = false,
                                       .sparse = true,
                                       .own_memory = false,
                                       .default_error_feedback = true,
                                       .uses_min_magnitude = true};

class ThresholdCodec final : public Codec {
 public:
  ThresholdCodec(const CodecConfig& c, float tau) : config_(c), tau_(tau) {
    // min_magnitude (§4.2) only ever raises the key threshold.
    plan_.threshold = std::max(magnitudeKey(tau), minMagnitudeKey(c.min_magnitude));
    plan_.tie_end = std::numeric_limits<uint64_t>::max();  // every key == threshold is taken
    plan_.select_none = false;
  }

  const CodecTraits& traits() const override { return kThresholdTraits; }
  const CodecConfig& config() const override { return config_; }
  // The sparse allreduce: an owner keeps the summed entries whose mean reaches τ (|Σ| >= W·τ in
  // fp32), how many there are; what a rank sent and that drops stays in its error feedback.
  bool selectsGlobally() const override { return true; }
  uint32_t globalMinKey(uint32_t world) const override {
    return std::max(magnitudeKey(static_cast<float>(world) * tau_), uint32_t{1});
  }
  size_t workspaceBytes(const Chunking& c) const override {
    return WorkspaceCarver::bytesFor({c.elements * sizeof(uint32_t)});
  }
  size_t maxPayloadBytes(size_t n) const override {
    return sparseMaxPayloadBytes(n, config_.sparse_values);
  }

  Status doAnalyze(const StepContext&, const Chunking&, ConstTensor, CodecState&,
                   std::span<std::byte>) const override {
    return Status::ok();
  }

  Result<size_t> doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                               int /*round*/, std::span<const uint8_t>, ConstTensor input,
                               CodecState&, std::span<std::byte> workspace,
                               std::span<uint8_t> out) const override {
    WorkspaceCarver carver(workspace);
    // Chunk c uses index slots [begin(c), begin(c) + size(c)): concurrent chunks never overlap.
    const std::span<uint32_t> slots = carver.take<uint32_t>(chunking.elements);
    const size_t begin = chunking.begin(chunk), len = chunking.size(chunk);
    auto written =
        writeSparsePayload(CodecId::kThreshold, input.dtype, config_.sparse_values, plan_, input,
                           begin, len, slots.subspan(begin, len), ctx.stream, out);
    if (!written) return written.status();
    return written->bytes;
  }

  Status decodeChunk(std::span<const uint8_t> payload, float weight, float* out,
                     size_t out_elements) const override {
    return decodeSparsePayload(payload, CodecId::kThreshold, weight, out, out_elements);
  }

 private:
  CodecConfig config_;
  float tau_;
  SelectionPlan plan_;
};

LW_REGISTER_CODEC(threshold, kThresholdTraits,
                  [](const CodecConfig& c) -> Result<std::unique_ptr<Codec>> {
                    if (!c.threshold) {
                      return invalidArgument(
                          "threshold: parameter 'threshold' is required (elements with |g| >= "
                          "threshold are sent)");
                    }
                    const double t = *c.threshold;
                    if (!std::isfinite(t) || !(t > 0.0)) {
                      return invalidArgument("threshold: 'threshold' must be finite and > 0, got " +
                                             formatNumber(t));
                    }
                    const float tau = static_cast<float>(t);
                    if (!std::isfinite(tau) || !(tau > 0.0f)) {
                      return invalidArgument("threshold: 'threshold' " + formatNumber(t) +
                                             " rounds to " + formatNumber(tau) +
                                             " in fp32; it must stay finite and > 0 there");
                    }
                    LW_RETURN_IF_ERROR(checkSparseValues(c, "threshold"));
                    return std::unique_ptr<Codec>(new ThresholdCodec(c, tau));
                  });

}  // namespace
}  // namespace lightwire::kernels
