// Error feedback (docs/determinism.md §4.6) as a decorator around a codec without memory of its
// own: the residual of what was not sent is added to the next step's input.

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
  size_t stateFloats(size_t n) const override { return n; }
  size_t workspaceBytes(const Chunking& c) const override { return inner_->workspaceBytes(c); }
  size_t maxPayloadBytes(size_t n) const override { return inner_->maxPayloadBytes(n); }
  std::optional<size_t> nominalPayloadBytes(size_t n,
                                            std::optional<double> density) const override {
    return inner_->nominalPayloadBytes(n, density);
  }

  Status doAnalyze(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                   CodecState& state, std::span<std::byte> workspace) const override {
    const size_t n = chunking.elements;
    const float* e = state.current();
    float* a = state.next();
    visitDType(input.dtype, [&](auto d) {
      constexpr DType D = decltype(d)::value;
      auto body = [&](size_t lo, size_t hi) {  // one typed loop: vectorised by the compiler
        for (size_t i = lo; i < hi; ++i) a[i] = loadWidened<D>(input.data, i) + e[i];
      };
      parallelFor(ctx.stream, n, 1 << 16, body);
    });
    CodecState none;
    return inner_->analyze(ctx, chunking, ConstTensor{a, n, DType::kF32}, none, workspace);
  }

  Result<size_t> doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                               int round, std::span<const uint8_t> previous, ConstTensor input,
                               CodecState& state, std::span<std::byte> workspace,
                               std::span<uint8_t> out) const override {
    CodecState none;
    float* a = state.next();
    auto size =
        inner_->encodeChunk(ctx, chunking, chunk, round, previous,
                            ConstTensor{a, chunking.elements, DType::kF32}, none, workspace, out);
    if (!size) return size;
    out[4] = static_cast<uint8_t>(input.dtype);  // the header names what the trainer handed in
    if (ctx.defer_sent) return size;             // settleChunk applies what the selection kept
    // e' = a - decoded: decoding with weight -1 subtracts exactly what the payload carries.
    Status s = inner_->decodeChunk(out.first(*size), -1.0f, a + chunking.begin(chunk),
                                   chunking.size(chunk));
    if (!s.isOk())
      return internalError("error feedback could not decode its own payload: " + s.message());
    return size;
  }

  bool selectsGlobally() const override { return inner_->selectsGlobally(); }
  size_t selectionCount(size_t n, std::optional<double> density) const override {
    return inner_->selectionCount(n, density);
  }
  uint32_t globalMinKey(uint32_t world) const override { return inner_->globalMinKey(world); }

  /// e' = a − value for the sent entries the global selection kept: the same arithmetic as the
  /// decode with weight −1 above, on those entries only.
  Status settleChunk(const StepContext&, const Chunking& chunking, size_t chunk,
                     std::span<const uint8_t> sent, std::span<const uint8_t> selected,
                     CodecState& state) const override {
    float* a = state.next() + chunking.begin(chunk);
    return forEachSettled(traits().id, sent, selected, chunking.size(chunk),
                          [&](size_t i, float value) { a[i] = a[i] + -1.0f * value; });
  }

  /// out = x + e, exactly as a_i of doAnalyze (determinism.md §4.6); the prepared residual is 0.
  Status doFlush(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                 CodecState& state, float* out) const override {
    const size_t n = chunking.elements;
    const float* e = state.current();
    float* en = state.next();
    visitDType(input.dtype, [&](auto d) {
      constexpr DType D = decltype(d)::value;
      parallelFor(ctx.stream, n, 1 << 16, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) out[i] = loadWidened<D>(input.data, i) + e[i];
        std::fill(en + lo, en + hi, 0.0f);
      });
    });
    return Status::ok();
  }

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
