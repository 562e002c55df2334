// Error feedback decorator (docs/determinism.md §4.6) and the prepare/commit contract.
#include <doctest.h>

#include <cmath>

#include "kernels/parallel.h"
#include "tests/kernels/test_util.h"

namespace test_error_feedback {

using namespace lightwire::kernels;

namespace {
// Runs one step; returns the decoded result (weight 1). With `commit` the step succeeded and the
// state is committed (stepTensor); without, the state is left as it was (a failed step).
std::vector<float> step(const Codec& codec, CodecState& state, const std::vector<float>& x,
                        uint64_t step_no, size_t chunk = 0, bool commit = false) {
  StepContext ctx{.seed = 1, .name_key = tensorNameKey("w"), .step = step_no};
  auto chunking = Chunking::make(x.size(), chunk, codec.chunkAlignment());
  const ConstTensor input{x.data(), x.size(), DType::kF32};
  auto payloads = commit ? stepTensor(codec, ctx, chunking, input, state)
                         : encodeTensor(codec, ctx, chunking, input, state);
  REQUIRE(payloads.isOk());
  std::vector<float> out(x.size(), 0.0f);
  REQUIRE(decodeTensor(codec, chunking, *payloads, 1.0f, out.data()).isOk());
  return out;
}
}  // namespace

TEST_CASE("error feedback: sent + new residual = input + old residual") {
  for (CodecConfig c : {CodecConfig{.name = "topk", .density = 0.01},
                        CodecConfig{.name = "topk", .density = 0.1, .sparse_values = DType::kF16},
                        CodecConfig{.name = "fp16", .error_feedback = true},
                        CodecConfig{.name = "bf16", .error_feedback = true},
                        CodecConfig{.name = "qsgd", .bits = 4, .error_feedback = true}}) {
    CAPTURE(testing::describe(c));
    auto codec = testing::make(c);
    const size_t n = 20000;
    CodecState state(codec->stateFloats(n));
    for (uint64_t s = 0; s < 4; ++s) {
      const auto x = testing::gaussian(n, 100 + s);
      const std::vector<float> old(state.currentSpan().begin(), state.currentSpan().end());
      const auto sent = step(*codec, state, x, s, 3000, /*commit=*/true);
      const auto& now = state.currentSpan();
      size_t bad = 0;
      for (size_t i = 0; i < n; ++i) {
        const float lhs = sent[i] + now[i];
        const float rhs = x[i] + old[i];
        // Selection and cast codecs: the residual is exactly what was not sent (Sterbenz).
        // QSGD: the residual subtraction rounds once, so allow one ulp of the larger operand.
        const bool exact = c.name != "qsgd";
        const float tol = exact ? 0.0f : 2.5e-7f * std::max(std::fabs(rhs), std::fabs(sent[i]));
        if (std::fabs(lhs - rhs) > tol) ++bad;
      }
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("error feedback: residuals carry what topk did not send") {
  auto codec = testing::make({.name = "topk", .density = 0.25});
  CodecState state(codec->stateFloats(4));
  std::vector<float> x = {1.0f, -4.0f, 2.0f, 3.0f};
  auto sent = step(*codec, state, x, 0, 0, /*commit=*/true);
  CHECK(sent == std::vector<float>{0, -4.0f, 0, 0});
  CHECK(std::vector<float>(state.currentSpan().begin(), state.currentSpan().end()) ==
        std::vector<float>{1.0f, 0.0f, 2.0f, 3.0f});
  // Next step: residual 3 + 3 = 6 wins.
  sent = step(*codec, state, x, 1);
  CHECK(sent == std::vector<float>{0, 0, 0, 6.0f});
}

TEST_CASE("prepare without commit leaves the codec state unchanged") {
  for (const auto& c : testing::representativeConfigs()) {
    auto codec = testing::make(c);
    if (codec->stateFloats(5000) == 0) continue;
    CAPTURE(testing::describe(c));
    CodecState state(codec->stateFloats(5000));
    step(*codec, state, testing::gaussian(5000, 1), 0, 1000, /*commit=*/true);
    const std::vector<float> before(state.currentSpan().begin(), state.currentSpan().end());
    CodecState copy = state;
    // Prepared but never committed: a failed step.
    const auto a = step(*codec, state, testing::gaussian(5000, 2), 1, 1000);
    CHECK(testing::bitEqual(
        std::vector<float>(state.currentSpan().begin(), state.currentSpan().end()), before));
    // Retrying the same step gives the same result as if the failure never happened.
    const auto b = step(*codec, copy, testing::gaussian(5000, 2), 1, 1000);
    CHECK(testing::bitEqual(a, b));
  }
}

TEST_CASE("error feedback: fp16 sparse values saturate so the residual stays finite") {
  auto codec = testing::make({.name = "topk", .density = 0.5, .sparse_values = DType::kF16});
  CodecState state(codec->stateFloats(2));
  std::vector<float> x = {1.0e6f, 0.5f};
  auto sent = step(*codec, state, x, 0, 0, /*commit=*/true);
  CHECK(sent[0] == 65504.0f);
  CHECK(state.currentSpan()[0] == 1.0e6f - 65504.0f);
  // The excess keeps flowing, nothing becomes Inf or NaN.
  sent = step(*codec, state, x, 1, 0, /*commit=*/true);
  CHECK(sent[0] == 65504.0f);
  CHECK(std::isfinite(state.currentSpan()[0]));
  CHECK(std::isfinite(state.currentSpan()[1]));
}

}  // namespace test_error_feedback
