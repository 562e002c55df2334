// Determinism contracts (docs/determinism.md §5): payload bytes independent of the thread count;
// decoded results and committed state independent of the chunk size; fp16/bf16 inputs equal to
// their fp32 widening; lengths 0 and 1 work for every codec.
#include <doctest.h>

#include "kernels/parallel.h"
#include "tests/kernels/test_util.h"

namespace test_determinism {

using namespace lightwire::kernels;

namespace {

struct Outcome {
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<float> decoded;
  std::vector<float> state;
};

// Three steps, each committed (stepTensor); returns the last step's outcome.
Outcome run(const Codec& codec, const std::vector<std::vector<float>>& inputs, size_t chunk,
            CpuStream* stream, DType dtype = DType::kF32) {
  const size_t n = inputs[0].size();
  CodecState state(codec.stateFloats(n));
  Outcome o;
  for (size_t s = 0; s < inputs.size(); ++s) {
    std::vector<uint16_t> narrow(n);
    ConstTensor in{inputs[s].data(), n, DType::kF32};
    if (dtype != DType::kF32) {
      for (size_t i = 0; i < n; ++i) {
        narrow[i] = dtype == DType::kF16 ? floatToHalf(inputs[s][i]) : floatToBf16(inputs[s][i]);
      }
      in = {narrow.data(), n, dtype};
    }
    StepContext ctx{.seed = 9,
                    .name_key = tensorNameKey("blocks.3.mlp"),
                    .step = 40 + s,
                    .rank = 2,
                    .stream = stream};
    const auto chunking = Chunking::make(n, chunk, codec.chunkAlignment());
    auto p = stepTensor(codec, ctx, chunking, in, state);
    REQUIRE_MESSAGE(p.isOk(), p.status().message());
    o.payloads = std::move(p).value();
    o.decoded.assign(n, 0.0f);
    REQUIRE(decodeTensor(codec, chunking, o.payloads, 0.25f, o.decoded.data()).isOk());
  }
  o.state.assign(state.currentSpan().begin(), state.currentSpan().end());
  return o;
}

std::vector<std::vector<float>> inputs(size_t n) {
  return {testing::gaussian(n, 1), testing::gaussian(n, 2, 3.0f), testing::gaussian(n, 3, 0.01f)};
}

}  // namespace

TEST_CASE("determinism: 1 and 2 threads give identical payload bytes, results and state") {
  CpuStream one(1), two(2);
  const auto in = inputs(70001);
  for (const auto& c : testing::representativeConfigs()) {
    CAPTURE(testing::describe(c));
    auto codec = testing::make(c);
    for (size_t chunk : {0ul, 16384ul}) {
      const auto a = run(*codec, in, chunk, &one);
      const auto b = run(*codec, in, chunk, &two);
      const auto z = run(*codec, in, chunk, nullptr);
      CHECK(a.payloads == b.payloads);
      CHECK(a.payloads == z.payloads);
      CHECK(testing::bitEqual(a.decoded, b.decoded));
      CHECK(testing::bitEqual(a.state, b.state));
    }
  }
}

TEST_CASE("determinism: decoded result and state do not depend on the chunk size") {
  CpuStream two(2);
  const auto in = inputs(70001);
  for (const auto& c : testing::representativeConfigs()) {
    CAPTURE(testing::describe(c));
    auto codec = testing::make(c);
    const auto whole = run(*codec, in, 0, &two);
    for (size_t chunk : {1000ul, 4096ul, 30000ul, 70000ul}) {
      CAPTURE(chunk);
      const auto part = run(*codec, in, chunk, &two);
      CHECK(part.payloads.size() == Chunking::make(70001, chunk, codec->chunkAlignment()).count());
      CHECK(testing::bitEqual(part.decoded, whole.decoded));
      CHECK(testing::bitEqual(part.state, whole.state));
    }
  }
}

TEST_CASE("determinism: fp16 and bf16 inputs behave as their exact fp32 widening") {
  for (const auto& c : testing::representativeConfigs()) {
    CAPTURE(testing::describe(c));
    auto codec = testing::make(c);
    for (DType t : {DType::kF16, DType::kBF16}) {
      auto widened = inputs(5000);
      for (auto& step : widened) {
        for (auto& v : step)
          v = t == DType::kF16 ? halfToFloat(floatToHalf(v)) : bf16ToFloat(floatToBf16(v));
      }
      const auto narrow = run(*codec, widened, 2048, nullptr, t);
      const auto wide = run(*codec, widened, 2048, nullptr, DType::kF32);
      CHECK(testing::bitEqual(narrow.decoded, wide.decoded));
      CHECK(testing::bitEqual(narrow.state, wide.state));
      for (size_t i = 0; i < narrow.payloads.size(); ++i) {
        auto a = narrow.payloads[i], b = wide.payloads[i];
        REQUIRE(a.size() == b.size());
        CHECK(a[4] == static_cast<uint8_t>(t));              // the header names the source dtype
        if (c.name == "fp16" || c.name == "bf16") continue;  // cast of narrow input is a copy
        a[4] = b[4];
        CHECK(a == b);
      }
    }
  }
}

TEST_CASE("determinism: lengths 0, 1 and 2 work for every codec") {
  for (const auto& c : testing::representativeConfigs()) {
    CAPTURE(testing::describe(c));
    auto codec = testing::make(c);
    for (size_t n : {0ul, 1ul, 2ul}) {
      std::vector<std::vector<float>> in = {std::vector<float>(n, -1.5f)};
      const auto o = run(*codec, in, 0, nullptr);
      REQUIRE(o.payloads.size() == 1);
      CHECK(o.payloads[0].size() >= kHeaderBytes);
      // Every codec sends at least the largest element of a tiny tensor exactly or close to it.
      if (n > 0 && c.name != "qsgd" && c.name != "randomk")
        CHECK(o.decoded[0] == doctest::Approx(-1.5f * 0.25f).epsilon(0.01));
    }
  }
}

}  // namespace test_determinism
