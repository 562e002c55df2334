// Codec registry: names, factories, parameter validation and the error-feedback policy of
// docs/codecs.md ("The codec interface", and the "error feedback by default" column).
#include <doctest.h>

#include <algorithm>
#include <cstring>

#include "kernels/registry.h"
#include "tests/kernels/test_util.h"

namespace test_registry {

using namespace lightwire::kernels;

TEST_CASE("registry: every codec of docs/codecs.md is registered once") {
  const auto names = codecNames();
  for (const char* want : {"none", "fp16", "bf16", "topk", "randomk", "threshold", "dgc", "qsgd",
                           "terngrad", "signsgd", "onebit", "powersgd"}) {
    CHECK_MESSAGE(std::find(names.begin(), names.end(), want) != names.end(), want);
  }
  auto dup =
      registerCodec({.name = "topk"}, [](const CodecConfig&) -> Result<std::unique_ptr<Codec>> {
        return lightwire::invalidArgument("never built");
      });
  CHECK(!dup.isOk());
  CHECK(dup.message().find("twice") != std::string::npos);
}

TEST_CASE("registry: unknown codec is an error that lists the known ones") {
  auto r = createCodec({.name = "zip"});
  REQUIRE(!r.isOk());
  CHECK(r.status().message().find("zip") != std::string::npos);
  CHECK(r.status().message().find("topk") != std::string::npos);
}

TEST_CASE("registry: error feedback defaults follow docs/codecs.md") {
  auto state_of = [](CodecConfig c) {
    auto codec = testing::make(c);
    return codec->stateFloats(1000);
  };
  CHECK(state_of({.name = "topk", .density = 0.1}) == 1000);  // biased: EF on
  CHECK(state_of({.name = "topk", .density = 0.1, .error_feedback = false}) == 0);
  CHECK(state_of({.name = "fp16"}) == 0);  // off by default
  CHECK(state_of({.name = "fp16", .error_feedback = true}) == 1000);
  CHECK(state_of({.name = "qsgd"}) == 0);  // unbiased: off
  CHECK(state_of({.name = "none", .error_feedback = true}) == 1000);
  CHECK(state_of({.name = "dgc", .density = 0.1}) == 1000);                   // own v (momentum 0)
  CHECK(state_of({.name = "dgc", .density = 0.1, .momentum = 0.9}) == 2000);  // own u and v
  auto stacked = createCodec({.name = "dgc", .density = 0.1, .error_feedback = true});
  REQUIRE(!stacked.isOk());
  CHECK(stacked.status().message().find("error_feedback") != std::string::npos);
}

TEST_CASE("registry: traits match the collective each codec needs") {
  CHECK(testing::make({.name = "none"})->traits().summable);
  CHECK(testing::make({.name = "fp16"})->traits().summable);
  CHECK(testing::make({.name = "bf16"})->traits().summable);
  CHECK(testing::make({.name = "topk", .density = 0.1})->traits().sparse);
  CHECK(testing::make({.name = "dgc", .density = 0.1})->traits().sparse);
  auto q = testing::make({.name = "qsgd"});
  CHECK(!q->traits().summable);
  CHECK(!q->traits().sparse);
  CHECK(q->chunkAlignment() == 512);
  for (const auto& c : testing::representativeConfigs()) {
    CHECK_MESSAGE(testing::make(c)->traits().rounds == 1, testing::describe(c));
  }
}

TEST_CASE("codec: analyze and encodeChunk reject bad arguments with the codec's name") {
  for (const auto& c : testing::representativeConfigs()) {
    CAPTURE(testing::describe(c));
    auto codec = testing::make(c);
    const size_t n = 2048;
    const auto x = testing::gaussian(n, 3);
    const ConstTensor in{x.data(), n, DType::kF32};
    const auto chunking = Chunking::make(n, 1024, codec->chunkAlignment());
    CodecState state(codec->stateFloats(n));
    std::vector<std::byte> ws(codec->workspaceBytes(chunking));
    std::vector<uint8_t> out(codec->maxPayloadBytes(chunking.chunk_elements));
    const StepContext ctx;
    auto expectError = [&](const Status& s, const char* what) {
      CHECK_MESSAGE(!s.isOk(), what);
      CHECK_MESSAGE(s.message().find(codec->traits().name) != std::string::npos, s.message());
    };
    expectError(codec->analyze(ctx, chunking, {x.data(), n - 1, DType::kF32}, state, ws), "length");
    expectError(codec->analyze(ctx, chunking, {nullptr, n, DType::kF32}, state, ws), "null");
    expectError(codec->analyze(ctx, chunking, {x.data(), n, DType(7)}, state, ws), "dtype");
    expectError(codec->analyze(ctx, Chunking{n, 0}, in, state, ws), "chunk 0");
    CodecState wrong(codec->stateFloats(n) + 1);
    expectError(codec->analyze(ctx, chunking, in, wrong, ws), "state size");
    if (!ws.empty()) {
      expectError(codec->analyze(ctx, chunking, in, state, std::span(ws).first(ws.size() - 1)),
                  "workspace");
    }
    if (codec->chunkAlignment() > 1) {
      expectError(codec->analyze(ctx, Chunking{n, codec->chunkAlignment() + 1}, in, state, ws),
                  "misaligned chunks");
    }
    REQUIRE(codec->analyze(ctx, chunking, in, state, ws).isOk());
    expectError(codec->encodeChunk(ctx, chunking, 2, 0, {}, in, state, ws, out).status(), "chunk");
    expectError(codec->encodeChunk(ctx, chunking, 0, 1, {}, in, state, ws, out).status(), "round");
    expectError(codec->encodeChunk(ctx, chunking, 0, -1, {}, in, state, ws, out).status(), "round");
    expectError(codec
                    ->encodeChunk(ctx, chunking, 0, 0, {}, in, state, ws,
                                  std::span(out).first(out.size() - 1))
                    .status(),
                "out");
    CHECK(codec->encodeChunk(ctx, chunking, 0, 0, {}, in, state, ws, out).isOk());
  }
}

TEST_CASE("codec: decodeChunkInto writes the bits of decodeChunk into zeros, −0 included") {
  // Values with negative zeros and a weight that keeps them: +0 + w·(−0) is +0 both ways.
  const size_t n = 3000;
  auto x = testing::gaussian(n, 11);
  for (size_t i = 0; i < n; i += 7) x[i] = -0.0f;
  for (const auto& c : testing::representativeConfigs()) {
    CAPTURE(testing::describe(c));
    auto codec = testing::make(c);
    const auto chunking = Chunking::make(n, 1024, codec->chunkAlignment());
    CodecState state(codec->stateFloats(n));
    StepContext ctx;
    ctx.density = c.density;
    auto payloads = encodeTensor(*codec, ctx, chunking, ConstTensor{x.data(), n}, state);
    REQUIRE_MESSAGE(payloads.isOk(), payloads.status().message());
    for (size_t k = 0; k < chunking.count(); ++k) {
      const size_t len = chunking.size(k);
      std::vector<float> added(len, 0.0f), into(len, 1234.5f);  // `into` never read
      REQUIRE(codec->decodeChunk((*payloads)[k], 0.25f, added.data(), len).isOk());
      REQUIRE(codec->decodeChunkInto((*payloads)[k], 0.25f, into.data(), len).isOk());
      CHECK(std::memcmp(added.data(), into.data(), len * sizeof(float)) == 0);
    }
  }
  // A payload that does not fit the range is refused, the range untouched (the dense layout).
  auto none = testing::make({.name = "none"});
  const auto chunking = Chunking::make(8, 8, 1);
  CodecState none_state;
  auto p = encodeTensor(*none, StepContext{}, chunking, ConstTensor{x.data(), 8}, none_state);
  REQUIRE(p.isOk());
  std::vector<float> out(9, 7.0f);
  CHECK(!none->decodeChunkInto((*p)[0], 1.0f, out.data(), 9).isOk());
  CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 7.0f; }));
}

}  // namespace test_registry
