// Every decoder rejects hostile payloads with a message and leaves the output untouched; random
// corruption never crashes (run under ASan+UBSan in CI) and never writes outside the output.
#include <doctest.h>

#include <random>

#include "tests/kernels/test_util.h"

namespace test_hostile {

using namespace lightwire::kernels;

namespace {

std::vector<uint8_t> validPayload(const Codec& codec, size_t n) {
  CodecState state(codec.stateFloats(n));
  auto x = testing::gaussian(n, 5);
  StepContext ctx{.name_key = tensorNameKey("t")};
  auto p = encodeTensor(codec, ctx, Chunking::make(n, 0, codec.chunkAlignment()),
                        {x.data(), n, DType::kF32}, state);
  REQUIRE(p.isOk());
  return (*p)[0];
}

// Decodes into a canary-guarded output; returns whether it succeeded. On failure requires a
// message and an untouched output; either way the canaries must survive.
bool decodeGuarded(const Codec& codec, const std::vector<uint8_t>& payload, size_t n) {
  std::vector<float> out(n + 16, 7.0f);
  const Status s = codec.decodeChunk(payload, 1.0f, out.data() + 8, n);
  for (size_t i = 0; i < 8; ++i) {
    REQUIRE(out[i] == 7.0f);
    REQUIRE(out[n + 8 + i] == 7.0f);
  }
  if (!s.isOk()) {
    CHECK(!s.message().empty());
    for (size_t i = 0; i < n; ++i) REQUIRE(out[8 + i] == 7.0f);
  }
  return s.isOk();
}

}  // namespace

TEST_CASE("hostile: structural corruption is rejected by every decoder") {
  for (const auto& c : testing::representativeConfigs()) {
    CAPTURE(testing::describe(c));
    auto codec = testing::make(c);
    const size_t n = 1000;
    const auto ok = validPayload(*codec, n);
    REQUIRE(decodeGuarded(*codec, ok, n));
    for (size_t len = 0; len < ok.size(); ++len) {
      CAPTURE(len);
      CHECK(!decodeGuarded(*codec, {ok.begin(), ok.begin() + len}, n));
    }
    auto m = ok;
    m.push_back(0);
    CHECK(!decodeGuarded(*codec, m, n));  // trailing byte
    const std::pair<size_t, uint8_t> header_faults[] = {{0, 0x00}, {1, 0x00}, {2, 0x00}, {2, 0x02},
                                                        {4, 0x03}, {5, 0x80}, {6, 0x01}, {7, 0x01}};
    for (const auto& fault : header_faults) {
      const size_t off = fault.first;  // plain variables: CAPTURE's lambda takes them
      const uint8_t val = fault.second;
      CAPTURE(off);
      m = ok;
      m[off] = val;
      CHECK(!decodeGuarded(*codec, m, n));
    }
    m = ok;
    m[3] = static_cast<uint8_t>(codec->traits().id) == 7 ? 3 : 7;  // another codec's id
    CHECK(!decodeGuarded(*codec, m, n));
    CHECK(!decodeGuarded(*codec, ok, n - 1));  // output range mismatch
    CHECK(!decodeGuarded(*codec, ok, n + 1));
    m = ok;
    m[15] = 0x80;  // element count near 2^63
    CHECK(!decodeGuarded(*codec, m, n));
  }
}

TEST_CASE("hostile: random corruption never crashes or writes out of bounds") {
  std::mt19937_64 gen(2024);
  for (const auto& c : testing::representativeConfigs()) {
    CAPTURE(testing::describe(c));
    auto codec = testing::make(c);
    for (size_t n : {1ul, 37ul, 1000ul}) {
      const auto ok = validPayload(*codec, n);
      for (int trial = 0; trial < 400; ++trial) {
        auto m = ok;
        const int edits = 1 + static_cast<int>(gen() % 4);
        for (int e = 0; e < edits; ++e) {
          const size_t off = kHeaderBytes + gen() % std::max<size_t>(1, m.size() - kHeaderBytes);
          if (off < m.size()) m[off] = static_cast<uint8_t>(gen());
        }
        decodeGuarded(*codec, m, n);  // may succeed (a value changed) or fail; never crash
      }
    }
  }
}

TEST_CASE("hostile: every decoder accepts the dense escape layout and nothing wider") {
  for (const auto& c : testing::representativeConfigs()) {
    CAPTURE(testing::describe(c));
    auto codec = testing::make(c);
    auto none = testing::make({.name = "none"});
    auto dense = validPayload(*none, 10);
    std::vector<float> out(10, 0.0f);
    CHECK(codec->decodeChunk(dense, 2.0f, out.data(), 10).isOk());
    auto x = testing::gaussian(10, 5);
    for (size_t i = 0; i < 10; ++i) CHECK(out[i] == 2.0f * x[i]);
    dense.resize(dense.size() - 4);
    CHECK(!decodeGuarded(*codec, dense, 10));
  }
}

}  // namespace test_hostile
