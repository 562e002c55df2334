// Error feedback (docs/determinism.md §4.6) as a decorator around a codec without memory of its
// own: the residual of what was not sent is added to the next step's input. The step works on
// a = x + e in the work area; commitState() recomputes a into the residual and takes off what was
// sent (docs/determinism.md "4.6c Atomic steps (one copy of the state)").

#include <algorithm>

#include "kernels/parallel.h"
#include "kernels/reduce.h"
#include "kernels/registry.h"
#include "kernels/select.h"

namespace lightwire::kernels {
namespace {

class ErrorFeedbackCodec final : public Codec {
 public:
  explicit ErrorFeedbackCodec(std::unique_ptr<Codec> inner) : inner_(std::move(inner)) {
    config_ = inner_->config();
    config_.error_feedback = true;
  }

  const CodecTraits& traits() const override { return inner_->traits(); }
  const CodecConfig& config() const override { return config_; }
  size_t chunkAlignment() const override { return inner_->chunkAlignment(); }
  using Codec::stateFloats;
  size_t stateFloats(size_t n, std::span<const uint64_t>) const override { return n; }
  size_t workspaceBytes(const Chunking& c) const override { return inner_->workspaceBytes(c); }
  size_t maxPayloadBytes(size_t n) const override { return inner_->maxPayloadBytes(n); }
  std::optional<size_t> nominalPayloadBytes(size_t n,
                                            std::optional<double> density) const override {
    return inner_->nominalPayloadBytes(n, density);
  }

  Status doAnalyze(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                   CodecState& state, std::span<std::byte> workspace) const override {
    const size_t n = chunking.elements;
    float* a = state.work(n);
    addWidened(ctx.stream, input, state.current(), a, n);
    CodecState none;
    return inner_->analyze(ctx, chunking, ConstTensor{a, n, DType::kF32}, none, workspace);
  }

  Result<size_t> doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                               int round, std::span<const uint8_t> previous, ConstTensor input,
                               CodecState& state, std::span<std::byte> workspace,
                               std::span<uint8_t> out) const override {
    CodecState none;
    const float* a = state.work(chunking.elements);
    auto size =
        inner_->encodeChunk(ctx, chunking, chunk, round, previous,
                            ConstTensor{a, chunking.elements, DType::kF32}, none, workspace, out);
    if (!size) return size;
    out[4] = static_cast<uint8_t>(input.dtype);  // the header names what the trainer handed in
    return size;
  }

  /// e = x + e (a of doAnalyze, bit for bit), then e' = a − decoded sent payload: decoding with
  /// weight −1 subtracts exactly what the payload carries; under a global selection only the sent
  /// entries the selection kept, with the same arithmetic on those entries.
  Status doCommitState(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                       std::span<const std::span<const uint8_t>> sent,
                       std::span<const std::span<const uint8_t>> selected, CodecState& state,
                       std::span<std::byte>, WriteBack write_back) const override {
    const size_t n = chunking.elements;
    float* e = state.mutableCurrent();
    addWidened(ctx.stream, input, e, e, n, write_back);
    std::vector<std::string> errors(sent.size());
    parallelFor(ctx.stream, sent.size(), 1, [&](size_t lo, size_t hi) {
      for (size_t c = lo; c < hi; ++c) {
        float* a = e + chunking.begin(c);
        const size_t len = chunking.size(c);
        const Status s =
            selected.empty()
                ? inner_->decodeChunk(sent[c], -1.0f, a, len)
                : forEachSettled(traits().id, sent[c], selected[c], len,
                                 [&](size_t i, float value) { a[i] = a[i] + -1.0f * value; });
        if (!s.isOk()) errors[c] = "chunk " + std::to_string(c) + ": " + s.message();
      }
    });
    for (const auto& err : errors) {
      if (!err.empty()) return internalError("error feedback could not settle its payload: " + err);
    }
    return Status::ok();
  }

  bool selectsGlobally() const override { return inner_->selectsGlobally(); }
  size_t selectionCount(size_t n, std::optional<double> density) const override {
    return inner_->selectionCount(n, density);
  }
  uint32_t globalMinKey(uint32_t world) const override { return inner_->globalMinKey(world); }

  Status checkSelection(const Chunking& chunking, size_t chunk, std::span<const uint8_t> sent,
                        std::span<const uint8_t> selected) const override {
    return forEachSettled(traits().id, sent, selected, chunking.size(chunk), [](size_t, float) {});
  }

  /// out = x + e, exactly as a_i of doAnalyze (determinism.md §4.6); commitFlush() zeroes e.
  Status doFlush(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                 CodecState& state, float* out) const override {
    addWidened(ctx.stream, input, state.current(), out, chunking.elements);
    return Status::ok();
  }
  void commitFlush(CodecState& state, size_t) const override { state.reset(); }

  /// Σ e_i² of the committed residual.
  double residualNorm2(const CodecState& state, size_t n) const override {
    if (n == 0 || state.floats() != stateFloats(n)) return 0.0;
    return canonicalSum(state.current(), n, ReduceTerm::kSquare);
  }

  Status decodeChunk(std::span<const uint8_t> payload, float weight, float* out,
                     size_t out_elements) const override {
    return inner_->decodeChunk(payload, weight, out, out_elements);
  }

  Result<size_t> addPayloads(std::span<const uint8_t> a, std::span<const uint8_t> b,
                             std::span<uint8_t> out) const override {
    return inner_->addPayloads(a, b, out);
  }

 private:
  std::unique_ptr<Codec> inner_;
  CodecConfig config_;
};

}  // namespace

std::unique_ptr<Codec> makeErrorFeedback(std::unique_ptr<Codec> inner) {
  return std::make_unique<ErrorFeedbackCodec>(std::move(inner));
}

}  // namespace lightwire::kernels
