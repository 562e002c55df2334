// The `fp16` and `bf16` codecs (docs/determinism.md §4.1, docs/wire-format.md).

#include <doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "kernels/codec.h"
#include "kernels/parallel.h"
#include "kernels/registry.h"

namespace lightwire::kernels {
namespace test_cast {

/// What a test needs to know about one cast format.
struct Format {
  const char* name;
  CodecId id;
  DType dtype;
  uint16_t (*encode)(float);
  float (*decode)(uint16_t);
};

const Format kFp16{"fp16", CodecId::kFp16, DType::kF16, floatToHalf, halfToFloat};
const Format kBf16{"bf16", CodecId::kBf16, DType::kBF16, floatToBf16, bf16ToFloat};

std::unique_ptr<Codec> makeCodec(const char* name) {
  CodecConfig config;
  config.name = name;
  auto codec = createCodec(config);
  REQUIRE_MESSAGE(codec.isOk(), codec.status().message());
  return std::move(codec).value();
}

std::vector<uint8_t> encodeOne(const Codec& codec, ConstTensor input, CpuStream* stream = nullptr) {
  StepContext ctx;
  ctx.stream = stream;
  CodecState state;
  auto payloads = encodeTensor(codec, ctx, Chunking::make(input.elements, 0, 1), input, state);
  REQUIRE_MESSAGE(payloads.isOk(), payloads.status().message());
  REQUIRE(payloads->size() == 1);
  return (*payloads)[0];
}

// Finite values of every magnitude, plus the special ones.
std::vector<float> testValues(size_t random_count) {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          65504.0f,
                          65519.99f,
                          65520.0f,
                          -70000.f,
                          FLT_MAX,
                          -FLT_MAX,
                          FLT_MIN,
                          FLT_TRUE_MIN,
                          1e-8f,
                          -3e-6f,
                          INFINITY,
                          -INFINITY,
                          NAN,
                          -NAN,
                          bitsFloat(0x7F800001u),
                          bitsFloat(0xFFA12345u),
                          3.0e38f,
                          1.0f + 0x1p-11f};
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 30);
  for (size_t i = 0; i < random_count; ++i) v.push_back(std::ldexp(normal(rng), exponent(rng)));
  return v;
}

uint16_t bodyValue(const std::vector<uint8_t>& p, size_t i) {
  return loadU16(p.data() + 16 + 2 * i);
}

void checkHeader(const std::vector<uint8_t>& p, const Format& f, DType source, uint64_t n) {
  REQUIRE(p.size() == 16 + 2 * n);
  CHECK(p[0] == 0x4C);
  CHECK(p[1] == 0x57);
  CHECK(p[2] == 1);
  CHECK(p[3] == static_cast<uint8_t>(f.id));
  CHECK(p[4] == static_cast<uint8_t>(source));
  CHECK(p[5] == 0);
  CHECK(p[6] == 0);
  CHECK(p[7] == 0);
  CHECK(loadU64(p.data() + 8) == n);
}

bool sameFloat(float a, float b) {
  return std::isnan(a) ? std::isnan(b) : floatBits(a) == floatBits(b);
}

void checkRoundTrip(const Format& f) {
  const auto codec = makeCodec(f.name);
  const CodecTraits& t = codec->traits();
  CHECK(t.id == f.id);
  CHECK(t.summable);
  CHECK_FALSE(t.sparse);
  CHECK_FALSE(t.own_memory);
  CHECK_FALSE(t.default_error_feedback);

  const std::vector<float> x = testValues(5000);
  const auto p = encodeOne(*codec, {x.data(), x.size(), DType::kF32});
  checkHeader(p, f, DType::kF32, x.size());
  CHECK(p.size() <= codec->maxPayloadBytes(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    REQUIRE_MESSAGE(bodyValue(p, i) == f.encode(x[i]), "element " << i << " = " << x[i]);
  }
  // Decoding adds weight * value: into zeros with weight 1, and into values with other weights.
  for (float weight : {1.0f, 0.25f, -1.0f, 3.0f}) {
    std::vector<float> out(x.size()), before(x.size());
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
    for (float& o : out) o = weight == 1.0f ? 0.0f : uniform(rng);
    before = out;
    REQUIRE(codec->decodeChunk(p, weight, out.data(), out.size()).isOk());
    for (size_t i = 0; i < x.size(); ++i) {
      const float expected = before[i] + weight * f.decode(f.encode(x[i]));
      REQUIRE_MESSAGE(sameFloat(out[i], expected), "element " << i << " weight " << weight);
    }
  }
  // NaN and Inf survive: NaN stays NaN with its sign, Inf stays Inf.
  std::vector<float> out(x.size(), 0.0f);
  REQUIRE(codec->decodeChunk(p, 1.0f, out.data(), out.size()).isOk());
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) {
      CHECK(std::isnan(out[i]));
      CHECK(std::signbit(f.decode(bodyValue(p, i))) == std::signbit(x[i]));
    }
    if (std::isinf(x[i])) CHECK(out[i] == x[i]);
  }
}

TEST_CASE("fp16 round trip equals the conversion, NaN and Inf preserved") { checkRoundTrip(kFp16); }
TEST_CASE("bf16 round trip equals the conversion, NaN and Inf preserved") { checkRoundTrip(kBf16); }

// The codecs may use vector conversions (x86 F16C for fp16): every bit pattern, NaNs included,
// must still give exactly the scalar conversion of dtype.h, also at lengths that leave a tail.
void checkBitPatterns(const Format& f) {
  const auto codec = makeCodec(f.name);
  std::mt19937_64 rng(99);
  for (size_t n :
       {size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{1} << 20, (size_t{1} << 20) + 13}) {
    std::vector<uint32_t> bits(n);
    for (auto& b : bits) b = static_cast<uint32_t>(rng());
    for (size_t i = 0; i < n; i += 5) bits[i] = 0x7F800000u | (bits[i] & 0x807FFFFFu);  // NaN/Inf
    std::vector<float> x(n);
    std::memcpy(x.data(), bits.data(), 4 * n);
    const auto p = encodeOne(*codec, {x.data(), n, DType::kF32});
    size_t mismatches = 0;
    for (size_t i = 0; i < n; ++i) mismatches += bodyValue(p, i) != f.encode(x[i]) ? 1 : 0;
    CHECK(mismatches == 0);
    // Decoding: exactly out + weight * (scalar widening), NaN bits included.
    std::vector<float> out(n), expected(n);
    for (size_t i = 0; i < n; ++i) out[i] = expected[i] = static_cast<float>(i % 17) - 8.0f;
    for (size_t i = 0; i < n; ++i) expected[i] = expected[i] + -1.5f * f.decode(bodyValue(p, i));
    REQUIRE(codec->decodeChunk(p, -1.5f, out.data(), n).isOk());
    CHECK(std::memcmp(out.data(), expected.data(), 4 * n) == 0);
  }
}

TEST_CASE("fp16 codec equals the scalar conversion on random bit patterns") {
  checkBitPatterns(kFp16);
}
TEST_CASE("bf16 codec equals the scalar conversion on random bit patterns") {
  checkBitPatterns(kBf16);
}

// Every 16-bit pattern as input of each dtype.
void checkSixteenBitInput(const Format& f, const Format& other) {
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  const auto codec = makeCodec(f.name);
  // Same format: bit for bit, NaN payloads and signalling NaNs included.
  const auto same = encodeOne(*codec, {all.data(), all.size(), f.dtype});
  checkHeader(same, f, f.dtype, all.size());
  CHECK(std::memcmp(same.data() + 16, all.data(), 2 * all.size()) == 0);
  for (size_t i = 0; i < all.size(); ++i) REQUIRE(bodyValue(same, i) == all[i]);
  // Decoding every pattern (signalling NaNs included) is exactly out + weight * (exact widening).
  std::vector<float> out(all.size()), expected(all.size());
  for (size_t i = 0; i < all.size(); ++i) out[i] = expected[i] = static_cast<float>(i % 5) - 2.0f;
  for (size_t i = 0; i < all.size(); ++i) expected[i] = expected[i] + 0.75f * f.decode(all[i]);
  REQUIRE(codec->decodeChunk(same, 0.75f, out.data(), out.size()).isOk());
  CHECK(std::memcmp(out.data(), expected.data(), 4 * out.size()) == 0);
  // The other format: widened, then converted.
  const auto cross = encodeOne(*codec, {all.data(), all.size(), other.dtype});
  checkHeader(cross, f, other.dtype, all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    REQUIRE(bodyValue(cross, i) == f.encode(other.decode(all[i])));
  }
}

TEST_CASE("fp16 input is sent bit for bit, bf16 input widened then converted") {
  checkSixteenBitInput(kFp16, kBf16);
}
TEST_CASE("bf16 input is sent bit for bit, fp16 input widened then converted") {
  checkSixteenBitInput(kBf16, kFp16);
}

void checkThreadsAndChunks(const Format& f) {
  const auto codec = makeCodec(f.name);
  const std::vector<float> x = testValues(300000);
  const ConstTensor input{x.data(), x.size(), DType::kF32};
  CpuStream one(1), three(3);
  const auto p1 = encodeOne(*codec, input, &one);
  CHECK(encodeOne(*codec, input, &three) == p1);
  CHECK(encodeOne(*codec, input, nullptr) == p1);
  // Chunked: each chunk's body is the matching slice of the whole.
  StepContext ctx;
  ctx.stream = &three;
  const Chunking chunking = Chunking::make(x.size(), 70001, codec->chunkAlignment());
  CodecState state;
  auto chunks = encodeTensor(*codec, ctx, chunking, input, state);
  REQUIRE(chunks.isOk());
  REQUIRE(chunks->size() == 5);
  for (size_t c = 0; c < chunks->size(); ++c) {
    const auto& pc = (*chunks)[c];
    checkHeader(pc, f, DType::kF32, chunking.size(c));
    CHECK(std::memcmp(pc.data() + 16, p1.data() + 16 + 2 * chunking.begin(c), pc.size() - 16) == 0);
  }
  std::vector<float> whole(x.size(), 0.0f), chunked(x.size(), 0.0f);
  REQUIRE(codec->decodeChunk(p1, 0.5f, whole.data(), whole.size()).isOk());
  REQUIRE(decodeTensor(*codec, chunking, *chunks, 0.5f, chunked.data()).isOk());
  CHECK(std::memcmp(whole.data(), chunked.data(), 4 * x.size()) == 0);
}

TEST_CASE("fp16 payload bytes do not depend on threads or chunking") {
  checkThreadsAndChunks(kFp16);
}
TEST_CASE("bf16 payload bytes do not depend on threads or chunking") {
  checkThreadsAndChunks(kBf16);
}

void checkAddPayloads(const Format& f) {
  const auto codec = makeCodec(f.name);
  std::vector<float> xa = testValues(3000), xb = testValues(3000);
  std::reverse(xb.begin(), xb.end());
  const auto a = encodeOne(*codec, {xa.data(), xa.size(), DType::kF32});
  const auto b = encodeOne(*codec, {xb.data(), xb.size(), DType::kF32});
  std::vector<uint8_t> sum(a.size());
  auto size = codec->addPayloads(a, b, sum);
  REQUIRE_MESSAGE(size.isOk(), size.status().message());
  CHECK(*size == a.size());
  checkHeader(sum, f, DType::kF32, xa.size());
  for (size_t i = 0; i < xa.size(); ++i) {
    const float s = f.decode(bodyValue(a, i)) + f.decode(bodyValue(b, i));
    REQUIRE_MESSAGE(bodyValue(sum, i) == f.encode(s), "element " << i);
  }
  // Decoding the sum equals decoding (and re-encoding) the fp32 sum of both.
  std::vector<float> out(xa.size(), 0.0f);
  REQUIRE(codec->decodeChunk(sum, 1.0f, out.data(), out.size()).isOk());
  for (size_t i = 0; i < xa.size(); ++i) {
    const float s = f.decode(bodyValue(a, i)) + f.decode(bodyValue(b, i));
    REQUIRE(sameFloat(out[i], 0.0f + f.decode(f.encode(s))));
  }
  // In place: out may be the first input.
  std::vector<uint8_t> in_place = a;
  REQUIRE(codec->addPayloads(in_place, b, in_place).isOk());
  CHECK(in_place == sum);

  // A `none` payload (the dense escape) is accepted as an operand.
  const auto none = makeCodec("none");
  const auto dense_b = encodeOne(*none, {xb.data(), xb.size(), DType::kF32});
  std::vector<uint8_t> mixed(a.size());
  REQUIRE(codec->addPayloads(a, dense_b, mixed).isOk());
  for (size_t i = 0; i < xa.size(); ++i) {
    REQUIRE(bodyValue(mixed, i) == f.encode(f.decode(bodyValue(a, i)) + xb[i]));
  }

  // Every 16-bit pattern against another (NaNs with payloads, signalling ones included, as a peer
  // could send): the sum is the scalar definition's bits; a NaN sum is a NaN, its payload left to
  // the hardware (docs/determinism.md §1).
  {
    const std::vector<float> zeros(65536, 0.0f);
    auto pa = encodeOne(*codec, {zeros.data(), zeros.size(), DType::kF32});
    auto pb = pa;
    for (uint32_t h = 0; h < 65536; ++h) {
      const uint32_t g = (h * 40503u + 1u) & 0xFFFFu;  // a permutation of the patterns
      pa[16 + 2 * h] = static_cast<uint8_t>(h);
      pa[17 + 2 * h] = static_cast<uint8_t>(h >> 8);
      pb[16 + 2 * h] = static_cast<uint8_t>(g);
      pb[17 + 2 * h] = static_cast<uint8_t>(g >> 8);
    }
    std::vector<uint8_t> all(pa.size());
    REQUIRE(codec->addPayloads(pa, pb, all).isOk());
    for (size_t i = 0; i < 65536; ++i) {
      const float s = f.decode(bodyValue(pa, i)) + f.decode(bodyValue(pb, i));
      if (std::isnan(s)) {
        REQUIRE_MESSAGE(std::isnan(f.decode(bodyValue(all, i))), "pattern " << i);
      } else {
        REQUIRE_MESSAGE(bodyValue(all, i) == f.encode(s), "pattern " << i);
      }
    }
  }

  // Errors: different element counts, malformed operands, short output.
  const std::vector<float> shorter(xa.begin(), xa.end() - 1);
  const auto c = encodeOne(*codec, {shorter.data(), shorter.size(), DType::kF32});
  auto r = codec->addPayloads(a, c, sum);
  CHECK_FALSE(r.isOk());
  CHECK(r.status().message().find("elements") != std::string::npos);
  std::vector<uint8_t> truncated(b.begin(), b.end() - 1);
  CHECK_FALSE(codec->addPayloads(a, truncated, sum).isOk());
  CHECK_FALSE(codec->addPayloads(truncated, a, sum).isOk());
  CHECK_FALSE(codec->addPayloads(std::span<const uint8_t>(a.data(), 10), b, sum).isOk());
  std::vector<uint8_t> bad_magic = b;
  bad_magic[0] = 0;
  CHECK_FALSE(codec->addPayloads(a, bad_magic, sum).isOk());
  std::vector<uint8_t> bad_round = b;
  bad_round[6] = 1;
  CHECK_FALSE(codec->addPayloads(a, bad_round, sum).isOk());
  std::vector<uint8_t> small(a.size() - 1);
  CHECK_FALSE(codec->addPayloads(a, b, small).isOk());
}

TEST_CASE("fp16 addPayloads adds in fp32 and re-encodes") { checkAddPayloads(kFp16); }
TEST_CASE("bf16 addPayloads adds in fp32 and re-encodes") { checkAddPayloads(kBf16); }

void checkDenseEscape(const Format& f) {
  const auto codec = makeCodec(f.name);
  const std::vector<float> x = testValues(100);
  const auto dense = encodeOne(*makeCodec("none"), {x.data(), x.size(), DType::kF32});
  std::vector<float> out(x.size(), 1.0f);
  REQUIRE(codec->decodeChunk(dense, 2.0f, out.data(), out.size()).isOk());
  for (size_t i = 0; i < x.size(); ++i) REQUIRE(sameFloat(out[i], 1.0f + 2.0f * x[i]));
}

TEST_CASE("fp16 decoder accepts the none layout") { checkDenseEscape(kFp16); }
TEST_CASE("bf16 decoder accepts the none layout") { checkDenseEscape(kBf16); }

// Every malformed payload is refused with a message and leaves `out` bit for bit as it was.
void checkHostile(const Format& f) {
  const auto codec = makeCodec(f.name);
  const std::vector<float> x = testValues(37);
  const auto good = encodeOne(*codec, {x.data(), x.size(), DType::kF32});
  std::vector<float> out(x.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(i) * 0.5f - 3.0f;
  out[3] = NAN;
  const std::vector<float> before = out;
  int refused = 0;
  auto refuse = [&](std::span<const uint8_t> p, size_t out_elements, const char* what) {
    const Status s = codec->decodeChunk(p, 1.0f, out.data(), out_elements);
    CHECK_MESSAGE(!s.isOk(), what);
    CHECK_MESSAGE(!s.message().empty(), what);
    REQUIRE_MESSAGE(std::memcmp(out.data(), before.data(), 4 * out.size()) == 0, what);
    ++refused;
  };
  for (size_t len = 0; len < good.size(); ++len) refuse({good.data(), len}, x.size(), "truncated");
  auto mutated = [&](auto edit) {
    std::vector<uint8_t> p = good;
    edit(p);
    return p;
  };
  refuse(mutated([](auto& p) { p.push_back(0); }), x.size(), "trailing byte");
  refuse(mutated([](auto& p) {
           p.pop_back();
           p.pop_back();
         }),
         x.size(), "one element short");
  refuse(good, x.size() - 1, "count mismatch (output shorter)");
  refuse(good, x.size() + 1, "count mismatch (output longer)");
  refuse(mutated([](auto& p) { storeU64(p.data() + 8, 36); }), x.size(), "header count differs");
  refuse(mutated([](auto& p) { p[0] = 'X'; }), x.size(), "wrong magic");
  refuse(mutated([](auto& p) { p[1] = 0; }), x.size(), "wrong magic");
  refuse(mutated([](auto& p) { p[2] = 2; }), x.size(), "unknown version");
  refuse(mutated([](auto& p) { p[2] = 0; }), x.size(), "unknown version");
  refuse(mutated([](auto& p) { p[3] = 7; }), x.size(), "foreign codec id");
  refuse(mutated([&](auto& p) { p[3] = f.id == CodecId::kFp16 ? 2 : 1; }), x.size(),
         "the other cast codec's id");
  refuse(mutated([](auto& p) { p[3] = 200; }), x.size(), "unknown codec id");
  refuse(mutated([](auto& p) { p[4] = 3; }), x.size(), "unknown dtype");
  for (int bit = 0; bit < 8; ++bit) {
    refuse(mutated([bit](auto& p) { p[5] = static_cast<uint8_t>(1 << bit); }), x.size(),
           "unknown flags");
  }
  refuse(mutated([](auto& p) { p[7] = 1; }), x.size(), "reserved byte");
  refuse(mutated([](auto& p) { p[6] = 1; }), x.size(), "round byte of a single-round codec");
  // A `none` escape with a wrong length.
  refuse(mutated([](auto& p) { p[3] = 0; }), x.size(), "none layout with fp16 length");
  // Element counts whose byte size wraps around 64 bits: 16 + 2n = 16 + 4 (mod 2^64).
  const uint64_t huge = (uint64_t{1} << 63) + 2;
  std::vector<uint8_t> wrap(good.begin(), good.begin() + 20);
  storeU64(wrap.data() + 8, huge);
  refuse(wrap, static_cast<size_t>(huge), "element count overflows the length");
  storeU64(wrap.data() + 8, ~uint64_t{0});
  refuse(wrap, static_cast<size_t>(~uint64_t{0}), "element count overflows the length");
  CHECK(refused > 60);
  // The untouched payload still decodes.
  CHECK(codec->decodeChunk(good, 1.0f, out.data(), out.size()).isOk());
}

TEST_CASE("fp16 hostile payloads are refused without touching the output") { checkHostile(kFp16); }
TEST_CASE("bf16 hostile payloads are refused without touching the output") { checkHostile(kBf16); }

TEST_CASE("fp16 and bf16 encoder refuses bad calls") {
  for (const char* name : {"fp16", "bf16"}) {
    const auto codec = makeCodec(name);
    const std::vector<float> x(10, 1.0f);
    const ConstTensor input{x.data(), x.size(), DType::kF32};
    const Chunking chunking = Chunking::make(x.size(), 0, 1);
    StepContext ctx;
    CodecState state;
    std::vector<uint8_t> out(codec->maxPayloadBytes(x.size()));
    CHECK_FALSE(codec
                    ->encodeChunk(ctx, chunking, 0, 0, {}, input, state, {},
                                  std::span<uint8_t>(out.data(), out.size() - 1))
                    .isOk());
    CHECK_FALSE(codec->encodeChunk(ctx, chunking, 1, 0, {}, input, state, {}, out).isOk());
    CHECK_FALSE(
        codec->encodeChunk(ctx, Chunking::make(11, 0, 1), 0, 0, {}, input, state, {}, out).isOk());
    auto ok = codec->encodeChunk(ctx, chunking, 0, 0, {}, input, state, {}, out);
    REQUIRE(ok.isOk());
    CHECK(*ok == 16 + 2 * x.size());
    // An empty tensor is one empty chunk.
    auto empty = codec->encodeChunk(ctx, Chunking::make(0, 0, 1), 0, 0, {},
                                    ConstTensor{nullptr, 0, DType::kF32}, state, {}, out);
    REQUIRE(empty.isOk());
    CHECK(*empty == 16);
    CHECK(codec->decodeChunk(std::span<const uint8_t>(out.data(), 16), 1.0f, nullptr, 0).isOk());
  }
}

}  // namespace test_cast
}  // namespace lightwire::kernels
