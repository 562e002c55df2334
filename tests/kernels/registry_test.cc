// Codec registry: names, factories, parameter validation and the error-feedback policy of
// DESIGN.md §3.
#include <doctest.h>

#include "kernels/registry.h"
#include "tests/kernels/test_util.h"

using namespace lightwire::kernels;

TEST_CASE("registry: every codec of this issue is registered once") {
  const auto names = codecNames();
  for (const char* want : {"none", "fp16", "bf16", "topk", "dgc", "qsgd"}) {
    CHECK_MESSAGE(std::find(names.begin(), names.end(), want) != names.end(), want);
  }
  auto dup = registerCodec("topk", [](const CodecConfig&) -> Result<std::unique_ptr<Codec>> {
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

TEST_CASE("registry: error feedback defaults follow DESIGN.md §3") {
  auto state_of = [](CodecConfig c) {
    auto codec = testing::make(c);
    return codec->stateFloats(1000);
  };
  CHECK(state_of({.name = "topk", .density = 0.1}) == 1000);               // biased: EF on
  CHECK(state_of({.name = "topk", .density = 0.1, .error_feedback = false}) == 0);
  CHECK(state_of({.name = "fp16"}) == 0);                                  // off by default
  CHECK(state_of({.name = "fp16", .error_feedback = true}) == 1000);
  CHECK(state_of({.name = "qsgd"}) == 0);                                  // unbiased: off
  CHECK(state_of({.name = "none", .error_feedback = true}) == 1000);
  CHECK(state_of({.name = "dgc", .density = 0.1}) == 2000);                // own u and v
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
