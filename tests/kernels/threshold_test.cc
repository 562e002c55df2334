// threshold (docs/determinism.md §4.8): |g| >= t in fp32 (NaN/Inf always), the sparse layout of
// topk under codec id 5, error feedback by default, hostile payloads, bad configs.

#include <doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "kernels/codec.h"
#include "kernels/dtype.h"
#include "kernels/parallel.h"
#include "kernels/payload.h"
#include "kernels/registry.h"
#include "kernels/simd/targets.h"
#include "tests/kernels/test_util.h"

namespace lightwire::kernels {
namespace test_threshold {

using Bytes = std::vector<uint8_t>;

std::unique_ptr<Codec> makeThreshold(double t, DType values = DType::kF32,
                                     std::optional<bool> ef = false) {
  CodecConfig c;
  c.name = "threshold";
  c.threshold = t;
  c.sparse_values = values;
  c.error_feedback = ef;
  auto codec = createCodec(c);
  REQUIRE_MESSAGE(codec.isOk(), codec.status().message());
  return std::move(codec).value();
}

std::vector<Bytes> encode(const Codec& codec, const std::vector<float>& x, size_t chunk,
                          unsigned threads = 1, CodecState* state_in = nullptr, uint64_t step = 0) {
  CpuStream stream(threads);
  StepContext ctx;
  ctx.step = step;
  ctx.stream = &stream;
  const Chunking chunking = Chunking::make(x.size(), chunk, codec.chunkAlignment());
  CodecState local(codec.stateFloats(x.size()));
  CodecState& state = state_in ? *state_in : local;
  // A given state carries over: the step is committed into it (stepTensor).
  const ConstTensor input{x.data(), x.size()};
  auto payloads = state_in ? stepTensor(codec, ctx, chunking, input, state)
                           : encodeTensor(codec, ctx, chunking, input, state);
  REQUIRE_MESSAGE(payloads.isOk(), payloads.status().message());
  return std::move(payloads).value();
}

std::vector<float> decode(const Codec& codec, const std::vector<Bytes>& payloads, size_t n,
                          size_t chunk) {
  std::vector<float> out(n, 0.0f);
  const Status s = decodeTensor(codec, Chunking::make(n, chunk, codec.chunkAlignment()), payloads,
                                1.0f, out.data());
  REQUIRE_MESSAGE(s.isOk(), s.message());
  return out;
}

/// An independent reader of the sparse layout (wire-format.md), bit by bit.
struct Sparse {
  std::vector<uint64_t> indices;
  std::vector<float> values;
};

Sparse readSparse(const Bytes& p) {
  REQUIRE(p.size() >= 24);
  CHECK(p[3] == 5);
  const uint64_t nnz = loadU32(p.data() + 16);
  const unsigned w = p[20];
  const bool f16 = p[5] & 1;
  const size_t g = ((nnz * w + 7) / 8 + 3) / 4 * 4;
  REQUIRE(p.size() == 24 + g + nnz * (f16 ? 2 : 4));
  Sparse s;
  int64_t prev = -1;
  for (uint64_t j = 0; j < nnz; ++j) {
    uint64_t gap = 0;
    for (unsigned b = 0; b < w; ++b) {
      const uint64_t bit = j * w + b;
      gap |= uint64_t((p[24 + bit / 8] >> (bit % 8)) & 1) << b;
    }
    prev = prev + 1 + static_cast<int64_t>(gap);
    s.indices.push_back(static_cast<uint64_t>(prev));
    s.values.push_back(f16 ? halfToFloat(loadU16(p.data() + 24 + g + 2 * j))
                           : loadF32(p.data() + 24 + g + 4 * j));
  }
  return s;
}

TEST_CASE("threshold selects exactly the elements with |g| >= t, NaN and Inf included") {
  const float inf = std::numeric_limits<float>::infinity();
  const float t = 0.75f;
  const float below = std::nextafter(t, 0.0f), above = std::nextafter(t, 1.0f);
  const std::vector<float> x = {0.0f, -0.0f, t,   -t,   below,         -below, above, -above,
                                1.0f, -3.0f, inf, -inf, std::nanf(""), 0.1f,   -0.5f, 2.0e30f};
  auto codec = makeThreshold(0.75);
  const auto p = encode(*codec, x, 0);
  REQUIRE(p.size() == 1);
  const Sparse s = readSparse(p[0]);
  std::vector<uint64_t> expected;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::abs(x[i]) >= t) expected.push_back(i);
  }
  CHECK(s.indices == expected);
  REQUIRE(s.values.size() == expected.size());
  for (size_t j = 0; j < expected.size(); ++j) {
    CHECK(floatBits(s.values[j]) == floatBits(x[expected[j]]));  // NaN bits too
  }
}

TEST_CASE("threshold compares against the fp32 rounding of the configured threshold") {
  const double t = 0.1;  // not representable: (float)0.1 > 0.1
  const float tau = static_cast<float>(t);
  REQUIRE(static_cast<double>(tau) > t);
  const std::vector<float> x = {std::nextafter(tau, 0.0f), tau, -tau};
  const Sparse s = readSparse(encode(*makeThreshold(t), x, 0)[0]);
  CHECK(s.indices == std::vector<uint64_t>{1, 2});
}

TEST_CASE("threshold matches a plain reference on random data, any chunking and thread count") {
  const size_t n = 400003;
  const auto x = testing::gaussian(n, 31);
  auto codec = makeThreshold(2.5);
  std::vector<float> expected(n, 0.0f);
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::abs(x[i]) >= 2.5f) {
      expected[i] = x[i];
      ++count;
    }
  }
  REQUIRE(count > 1000);
  for (size_t chunk : {size_t{0}, size_t{1000}, size_t{65536}, size_t{131071}}) {
    CAPTURE(chunk);
    const auto p1 = encode(*codec, x, chunk, 1);
    const auto p2 = encode(*codec, x, chunk, 2);
    CHECK(p1 == p2);
    CHECK(testing::bitEqual(decode(*codec, p1, n, chunk), expected));
  }
}

TEST_CASE("threshold payload bytes are identical on every SIMD target") {
  auto x = testing::gaussian(200003, 32);
  x[100] = std::nanf("");
  x[150000] = -std::numeric_limits<float>::infinity();
  for (DType values : {DType::kF32, DType::kF16}) {
    auto codec = makeThreshold(1.96, values);
    std::vector<Bytes> ref;
    for (int64_t target : simd::availableTargets()) {
      CAPTURE(simd::targetName(target));
      simd::ScopedTargetForTest force(target);
      const auto p = encode(*codec, x, 70000, 2);
      if (ref.empty()) {
        ref = p;
      } else {
        CHECK(p == ref);
      }
    }
  }
}

TEST_CASE("threshold fp16 values round-trip as floatToHalfSaturating") {
  const std::vector<float> x = {1.0e6f, -1.0e6f, 3.14159f, 0.001f, -7.0f};
  auto codec = makeThreshold(1.0, DType::kF16);
  const auto p = encode(*codec, x, 0);
  CHECK((p[0][5] & 1) == 1);
  const Sparse s = readSparse(p[0]);
  CHECK(s.indices == std::vector<uint64_t>{0, 1, 2, 4});
  for (size_t j = 0; j < s.indices.size(); ++j) {
    CHECK(floatBits(s.values[j]) == floatBits(halfToFloat(floatToHalfSaturating(x[s.indices[j]]))));
  }
  CHECK(s.values[0] == 65504.0f);
  CHECK(s.values[1] == -65504.0f);
}

TEST_CASE("threshold selects on the widened value of fp16 and bf16 input") {
  const auto xf = testing::gaussian(5000, 8);
  auto codec = makeThreshold(1.0);
  for (DType t : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> raw(xf.size());
    std::vector<float> widened(xf.size());
    for (size_t i = 0; i < xf.size(); ++i) {
      raw[i] = t == DType::kF16 ? floatToHalf(xf[i]) : floatToBf16(xf[i]);
      widened[i] = t == DType::kF16 ? halfToFloat(raw[i]) : bf16ToFloat(raw[i]);
    }
    StepContext ctx;
    CodecState state;
    auto p = encodeTensor(*codec, ctx, Chunking::make(raw.size(), 999, 1),
                          ConstTensor{raw.data(), raw.size(), t}, state);
    REQUIRE(p.isOk());
    const auto ref = encode(*codec, widened, 999);
    REQUIRE(p->size() == ref.size());
    for (size_t c = 0; c < ref.size(); ++c) {
      CHECK((*p)[c][4] == static_cast<uint8_t>(t));
      Bytes a = (*p)[c];
      a[4] = 0;
      CHECK(a == ref[c]);
    }
  }
}

TEST_CASE("threshold with default error feedback: sent + new residual = input + old residual") {
  for (DType values : {DType::kF32, DType::kF16}) {
    auto codec = makeThreshold(1.5, values, std::nullopt);  // default: on
    CHECK(codec->stateFloats(10) == 10);
    const size_t n = 20000;
    CodecState state(codec->stateFloats(n));
    for (uint64_t s = 0; s < 5; ++s) {
      auto x = testing::gaussian(n, 100 + s);
      x[17] = 1.0e6f;  // saturates with fp16 values: the excess stays in the residual
      const std::vector<float> old(state.currentSpan().begin(), state.currentSpan().end());
      const auto p = encode(*codec, x, 3000, 2, &state, s);  // committed
      const auto sent = decode(*codec, p, n, 3000);
      const float* now = state.current();
      for (size_t i = 0; i < n; ++i) {
        const float a = x[i] + old[i];
        REQUIRE(now[i] == a + (-1.0f * sent[i]));
        if (values == DType::kF32) {
          // Selection codec with fp32 values: exact split.
          REQUIRE(now[i] + sent[i] == a);
          REQUIRE((std::abs(a) >= 1.5f) == (now[i] == 0.0f && a != 0.0f));
        }
      }
      for (size_t i = 0; i < n; ++i) REQUIRE(std::isfinite(now[i]));
    }
  }
}

TEST_CASE("threshold residual grows until it crosses the threshold") {
  auto codec = makeThreshold(1.0, DType::kF32, std::nullopt);
  CodecState state(codec->stateFloats(2));
  const std::vector<float> x = {0.375f, 2.0f};
  std::vector<std::vector<float>> sent;
  for (uint64_t s = 0; s < 3; ++s) {
    sent.push_back(decode(*codec, encode(*codec, x, 0, 1, &state, s), 2, 0));  // committed
  }
  CHECK(sent[0] == std::vector<float>{0.0f, 2.0f});
  CHECK(sent[1] == std::vector<float>{0.0f, 2.0f});
  CHECK(sent[2] == std::vector<float>{1.125f, 2.0f});
}

TEST_CASE("threshold traits: sparse, not summable, no own memory, error feedback by default") {
  auto codec = makeThreshold(1.0);
  CHECK(codec->traits().id == CodecId::kThreshold);
  CHECK(codec->traits().sparse);
  CHECK_FALSE(codec->traits().summable);
  CHECK_FALSE(codec->traits().own_memory);
  CHECK(codec->traits().default_error_feedback);
  CHECK(codec->stateFloats(100) == 0);
  Bytes out(64);
  CHECK_FALSE(codec->addPayloads(out, out, out).isOk());
}

TEST_CASE("threshold with an empty tensor or nothing above the threshold sends nnz 0") {
  auto codec = makeThreshold(100.0);
  for (size_t n : {size_t{0}, size_t{1000}}) {
    const auto p = encode(*codec, testing::gaussian(n, 1), 0);
    REQUIRE(p.size() == 1);
    CHECK(p[0].size() == 24);
    CHECK(loadU32(p[0].data() + 16) == 0);
  }
}

TEST_CASE("threshold rejects bad configs with messages naming the parameter") {
  auto fails = [](CodecConfig c) {
    c.name = "threshold";
    auto r = createCodec(c);
    REQUIRE_FALSE(r.isOk());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(r.status().message().find("threshold") != std::string::npos,
                  r.status().message());
  };
  fails({});
  fails({.threshold = 0.0});
  fails({.threshold = -1.0});
  fails({.threshold = std::nan("")});
  fails({.threshold = std::numeric_limits<double>::infinity()});
  fails({.threshold = 1.0e-50});  // rounds to 0 in fp32
  fails({.threshold = 1.0e39});   // rounds to Inf in fp32
  fails({.sparse_values = DType::kBF16, .threshold = 1.0});
  CHECK(createCodec({.name = "threshold", .threshold = 1.0e-40}).isOk());  // fp32 subnormal
}

// ---- hostile payloads ----

void expectRejected(const Codec& codec, const Bytes& p, size_t n) {
  std::vector<float> out(n, 3.25f);
  const Status s = codec.decodeChunk(p, 1.0f, out.data(), n);
  CHECK_FALSE(s.isOk());
  CHECK_FALSE(s.message().empty());
  for (float v : out) REQUIRE(v == 3.25f);
}

TEST_CASE("threshold decoder rejects truncated, trailing and corrupted payloads") {
  auto codec = makeThreshold(1.0);
  const size_t n = 300;
  const auto x = testing::gaussian(n, 4);
  const Bytes good = encode(*codec, x, 0)[0];
  REQUIRE(loadU32(good.data() + 16) > 10);
  for (size_t len = 0; len < good.size(); ++len) {
    expectRejected(*codec, Bytes(good.begin(), good.begin() + len), n);
  }
  Bytes p = good;
  p.push_back(0);
  expectRejected(*codec, p, n);
  auto patched = [&](size_t off, uint8_t v) {
    Bytes q = good;
    q[off] = v;
    return q;
  };
  expectRejected(*codec, patched(3, 3), n);    // a topk payload is not a threshold payload
  expectRejected(*codec, patched(3, 6), n);    // nor a dgc one
  expectRejected(*codec, patched(5, 2), n);    // unknown flag
  expectRejected(*codec, patched(6, 1), n);    // round
  expectRejected(*codec, patched(7, 1), n);    // reserved
  expectRejected(*codec, patched(21, 1), n);   // reserved after w
  expectRejected(*codec, patched(20, 33), n);  // w > 32
  expectRejected(*codec, good, n - 1);         // element count
  p = good;
  storeU32(p.data() + 16, static_cast<uint32_t>(n + 1));  // nnz > n
  expectRejected(*codec, p, n);
  p = good;
  storeU32(p.data() + 16, 0xFFFFFFFFu);
  expectRejected(*codec, p, n);
  // Random corruption never writes outside the output or crashes.
  std::mt19937 gen(5);
  for (int trial = 0; trial < 2000; ++trial) {
    Bytes q = good;
    const int flips = 1 + trial % 4;
    for (int f = 0; f < flips; ++f) q[gen() % q.size()] ^= static_cast<uint8_t>(1 + gen() % 255);
    std::vector<float> out(n + 16, 0.0f);
    (void)codec->decodeChunk(q, 1.0f, out.data(), n);
    for (size_t i = n; i < n + 16; ++i) REQUIRE(out[i] == 0.0f);
  }
}

TEST_CASE("threshold decoder accepts the none escape layout") {
  auto codec = makeThreshold(1.0);
  Bytes p(16 + 8);
  writeHeader(p.data(), {CodecId::kNone, DType::kF32, 0, 0, 2});
  storeF32(p.data() + 16, 1.0f);
  storeF32(p.data() + 20, -2.0f);
  std::vector<float> out(2, 0.5f);
  REQUIRE(codec->decodeChunk(p, 2.0f, out.data(), 2).isOk());
  CHECK(out == std::vector<float>{2.5f, -3.5f});
}

}  // namespace test_threshold
}  // namespace lightwire::kernels
