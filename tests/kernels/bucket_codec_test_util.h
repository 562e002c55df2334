#pragma once
// The generic tests of the "per-bucket scale + bit-packed codes" codecs `terngrad`, `signsgd` and
// `onebit` (kernels/codecs/bucket.h, docs/determinism.md §4.9–4.11, docs/wire-format.md): bytes
// against a plain per-element reference written from the spec, packing round trips, chunk, thread
// and SIMD-target independence, narrow inputs, error feedback, the non-finite escape and hostile
// payloads. Each codec's test file describes the codec (a `Desc`: its name, id, bits per code,
// scales per bucket and its plain per-element reference) and instantiates them with
// LW_BUCKET_CODEC_TESTS(Desc, "name").
//
// A `Desc` has
//   static constexpr const char* kName; uint8_t kId; unsigned kBits; size_t kScales;
//   static constexpr bool kDefaultErrorFeedback;
//   static std::vector<float> referenceScales(const float* x, size_t n);  // one bucket's scales
//   static uint32_t referenceCode(float x, size_t i, const std::vector<float>& scales,
//                                 const StepContext& ctx);               // element i's code
//   static float referenceValue(uint32_t code, const std::vector<float>& scales);
//   static std::vector<float> badScales(size_t j);  // values the decoder refuses as scale j
//   static void hostileExtra(const std::vector<uint8_t>& good, size_t codes_at,
//                            testing::HostileDecoder& refuse);  // its own bad codes, n = 37

#include <doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/codec.h"
#include "kernels/parallel.h"
#include "kernels/payload.h"
#include "kernels/philox.h"
#include "kernels/registry.h"
#include "kernels/simd/targets.h"
#include "tests/kernels/hostile_payload_util.h"
#include "tests/kernels/test_util.h"

namespace lightwire::kernels::bucket_test {

/// What a decoder must refuse as a scale that has to be finite and >= 0.
inline std::vector<float> nonFiniteOrNegative() {
  return {NAN, -NAN, INFINITY, -INFINITY, -1.0f, -FLT_TRUE_MIN, -FLT_MAX};
}

template <typename Desc>
std::unique_ptr<Codec> makeCodec(uint32_t bucket_size, std::optional<bool> error_feedback = false) {
  CodecConfig config;
  config.name = Desc::kName;
  config.bucket_size = bucket_size;
  config.error_feedback = error_feedback;
  auto codec = createCodec(config);
  REQUIRE_MESSAGE(codec.isOk(), codec.status().message());
  return std::move(codec).value();
}

inline StepContext makeContext(uint64_t step, uint32_t rank = 0, CpuStream* stream = nullptr) {
  StepContext ctx;
  ctx.seed = 4321;
  ctx.name_key = tensorNameKey("layer.weight");
  ctx.step = step;
  ctx.rank = rank;
  ctx.stream = stream;
  return ctx;
}

inline std::vector<std::vector<uint8_t>> encodeAll(const Codec& codec, const StepContext& ctx,
                                                   ConstTensor input, size_t chunk_elements = 0) {
  CodecState state(codec.stateFloats(input.elements));
  const Chunking chunking = Chunking::make(input.elements, chunk_elements, codec.chunkAlignment());
  auto payloads = encodeTensor(codec, ctx, chunking, input, state);
  REQUIRE_MESSAGE(payloads.isOk(), payloads.status().message());
  return std::move(payloads).value();
}

inline std::vector<uint8_t> encodeOne(const Codec& codec, const StepContext& ctx,
                                      ConstTensor input) {
  auto payloads = encodeAll(codec, ctx, input);
  REQUIRE(payloads.size() == 1);
  return payloads[0];
}

inline std::vector<float> decodeAll(const Codec& codec,
                                    const std::vector<std::vector<uint8_t>>& payloads, size_t n,
                                    size_t chunk_elements, float weight = 1.0f) {
  std::vector<float> out(n, 0.0f);
  const Chunking chunking = Chunking::make(n, chunk_elements, codec.chunkAlignment());
  const Status s = decodeTensor(codec, chunking, payloads, weight, out.data());
  REQUIRE_MESSAGE(s.isOk(), s.message());
  return out;
}

// §2 written out plainly for terms t(x): blocks of 4096, eight strided fp64 accumulators.
template <typename Term>
double referenceSum(const float* x, size_t n, Term term) {
  double total = 0.0;
  for (size_t block = 0; block < n; block += 4096) {
    double a[8] = {};
    for (size_t i = block; i < std::min(n, block + 4096); ++i) {
      a[(i - block) % 8] = a[(i - block) % 8] + term(x[i]);
    }
    total = total + (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
  }
  return total;
}

template <typename Desc>
uint32_t codeAt(const uint8_t* codes, size_t i) {
  uint32_t code = 0;
  for (unsigned bit = 0; bit < Desc::kBits; ++bit) {
    const size_t t = i * Desc::kBits + bit;
    code |= ((codes[t / 8] >> (t % 8)) & 1u) << bit;
  }
  return code;
}

// One chunk [begin, begin + n) of the fp32 tensor x, encoded per the spec one element at a time.
template <typename Desc>
std::vector<uint8_t> referenceChunk(const std::vector<float>& x, size_t begin, size_t n, uint32_t d,
                                    const StepContext& ctx, DType source) {
  const size_t buckets = (n + d - 1) / d;
  std::vector<std::vector<float>> scales(buckets);
  bool finite = true;
  for (size_t k = 0; k < buckets; ++k) {
    const size_t len = std::min<size_t>(d, n - k * d);
    scales[k] = Desc::referenceScales(&x[begin + k * d], len);
    for (float s : scales[k]) finite = finite && std::isfinite(s);
  }
  // Sized once (growing a 16-byte vector trips a -Warray-bounds false positive in GCC 12).
  std::vector<uint8_t> p(
      finite ? 20 + 4 * Desc::kScales * buckets + (n * Desc::kBits + 7) / 8 : 16 + 4 * n, 0);
  p[0] = 0x4C, p[1] = 0x57, p[2] = 1, p[4] = static_cast<uint8_t>(source);
  storeU64(p.data() + 8, n);
  if (!finite) {
    p[3] = 0;
    for (size_t i = 0; i < n; ++i) storeF32(p.data() + 16 + 4 * i, x[begin + i]);
    return p;
  }
  p[3] = Desc::kId;
  storeU32(p.data() + 16, d);
  for (size_t k = 0; k < buckets; ++k) {
    for (size_t j = 0; j < Desc::kScales; ++j)
      storeF32(p.data() + 20 + 4 * (Desc::kScales * k + j), scales[k][j]);
  }
  uint8_t* codes = p.data() + 20 + 4 * Desc::kScales * buckets;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t code = Desc::referenceCode(x[begin + i], begin + i, scales[i / d], ctx);
    for (unsigned bit = 0; bit < Desc::kBits; ++bit) {
      const size_t t = i * Desc::kBits + bit;
      if ((code >> bit) & 1u) codes[t / 8] = static_cast<uint8_t>(codes[t / 8] | (1u << (t % 8)));
    }
  }
  return p;
}

// The decoded values of a payload of this codec, element by element (out = 0 + w * value).
template <typename Desc>
std::vector<float> referenceDecode(const std::vector<uint8_t>& p, float weight) {
  const uint64_t n = loadU64(p.data() + 8);
  std::vector<float> out(n, 0.0f);
  if (p[3] == 0) {
    for (size_t i = 0; i < n; ++i) out[i] = 0.0f + weight * loadF32(p.data() + 16 + 4 * i);
    return out;
  }
  const uint32_t d = loadU32(p.data() + 16);
  const size_t buckets = (n + d - 1) / d;
  const uint8_t* codes = p.data() + 20 + 4 * Desc::kScales * buckets;
  for (size_t i = 0; i < n; ++i) {
    std::vector<float> s(Desc::kScales);
    for (size_t j = 0; j < Desc::kScales; ++j)
      s[j] = loadF32(p.data() + 20 + 4 * (Desc::kScales * (i / d) + j));
    out[i] = 0.0f + weight * Desc::referenceValue(codeAt<Desc>(codes, i), s);
  }
  return out;
}

inline std::vector<float> randomTensor(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-8, 8);
  std::vector<float> x(n);
  for (float& v : x) v = std::ldexp(normal(rng), exponent(rng));
  // Signed zeros and equal magnitudes of both signs.
  for (size_t i = 0; i < n; i += 13) x[i] = (i / 13) % 2 == 0 ? 0.0f : -0.0f;
  for (size_t i = 5; i < n; i += 29) x[i] = (i / 29) % 2 == 0 ? 0.75f : -0.75f;
  return x;
}

template <typename Desc>
void configurationAndTraits() {
  const auto codec = makeCodec<Desc>(512);
  const CodecTraits& t = codec->traits();
  CHECK(t.id == static_cast<CodecId>(Desc::kId));
  CHECK(std::string(t.name) == Desc::kName);
  CHECK_FALSE(t.summable);
  CHECK_FALSE(t.sparse);
  CHECK_FALSE(t.own_memory);
  CHECK(t.default_error_feedback == Desc::kDefaultErrorFeedback);
  CHECK(t.rounds == 1);
  CHECK(codec->chunkAlignment() == 512);
  CHECK(codec->stateFloats(100) == 0);
  CHECK(makeCodec<Desc>(7)->chunkAlignment() == 7);
  CHECK(makeCodec<Desc>(1u << 24)->chunkAlignment() == (1u << 24));
  CodecConfig defaults;
  defaults.name = Desc::kName;
  auto made = createCodec(defaults);
  REQUIRE(made.isOk());
  CHECK((*made)->chunkAlignment() == 512);
  // Error feedback by default (biased codecs): the wrapper keeps one residual per element.
  CHECK((*made)->stateFloats(100) == (Desc::kDefaultErrorFeedback ? 100u : 0u));
  CHECK(makeCodec<Desc>(512, true)->stateFloats(100) == 100);
  CHECK(makeCodec<Desc>(512, false)->stateFloats(100) == 0);

  for (uint32_t bucket : {0u, (1u << 24) + 1, 0xFFFFFFFFu}) {
    CodecConfig c;
    c.name = Desc::kName;
    c.bucket_size = bucket;
    auto r = createCodec(c);
    REQUIRE_FALSE(r.isOk());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(r.status().message().find("bucket_size") != std::string::npos,
                  r.status().message());
    CHECK_MESSAGE(r.status().message().find(Desc::kName) != std::string::npos,
                  r.status().message());
  }
}

template <typename Desc>
void payloadMatchesReference() {
  struct Case {
    uint32_t d;
    size_t n;
    size_t chunk;
  };
  std::vector<Case> cases;
  for (uint32_t d : {1u, 7u, 512u, 1000u}) {
    for (size_t n = 0; n <= 17; ++n) cases.push_back({d, n, 0});
    for (size_t n :
         {size_t{511}, size_t{513}, size_t{1000}, size_t{1001}, size_t{4103}, size_t{9999}}) {
      cases.push_back({d, n, 0});
      cases.push_back({d, n, 3 * size_t{d}});
    }
  }
  cases.push_back({5000, 12345, 5000});
  cases.push_back({3, 2, 0});
  for (const Case& c : cases) {
    CAPTURE(c.d);
    CAPTURE(c.n);
    CAPTURE(c.chunk);
    const auto codec = makeCodec<Desc>(c.d);
    const std::vector<float> x = randomTensor(c.n, static_cast<uint32_t>(c.n + c.d));
    for (uint32_t rank : {0u, 3u}) {
      const StepContext ctx = makeContext(17, rank);
      const auto payloads = encodeAll(*codec, ctx, {x.data(), x.size(), DType::kF32}, c.chunk);
      const Chunking chunking = Chunking::make(c.n, c.chunk, c.d);
      REQUIRE(payloads.size() == chunking.count());
      std::vector<float> expected_out;
      for (size_t k = 0; k < payloads.size(); ++k) {
        const auto expected =
            referenceChunk<Desc>(x, chunking.begin(k), chunking.size(k), c.d, ctx, DType::kF32);
        REQUIRE(payloads[k] == expected);
        CHECK(payloads[k].size() <= codec->maxPayloadBytes(chunking.size(k)));
        const auto values = referenceDecode<Desc>(expected, -0.5f);
        expected_out.insert(expected_out.end(), values.begin(), values.end());
      }
      // Unpacking: every decoded value is exactly the reference's.
      const auto out = decodeAll(*codec, payloads, c.n, c.chunk, -0.5f);
      REQUIRE(out.size() == expected_out.size());
      CHECK(testing::bitEqual(out, expected_out));
    }
  }
}

template <typename Desc>
void payloadSizeAndHeader() {
  const auto codec = makeCodec<Desc>(64);
  const std::vector<float> x = randomTensor(1000, 5);
  const auto p = encodeOne(*codec, makeContext(0), {x.data(), x.size(), DType::kF32});
  // B = ceil(1000 / 64) = 16 buckets.
  REQUIRE(p.size() == 20 + 4 * Desc::kScales * 16 + (1000 * Desc::kBits + 7) / 8);
  CHECK(p[0] == 0x4C);
  CHECK(p[1] == 0x57);
  CHECK(p[2] == 1);
  CHECK(p[3] == Desc::kId);
  for (size_t i : {4, 5, 6, 7}) CHECK(p[i] == 0);
  CHECK(loadU64(p.data() + 8) == 1000);
  CHECK(loadU32(p.data() + 16) == 64);
  const auto empty = encodeOne(*codec, makeContext(0), {nullptr, 0, DType::kF32});
  CHECK(empty.size() == 20);
  CHECK(codec->decodeChunk(empty, 1.0f, nullptr, 0).isOk());
}

template <typename Desc>
void chunkSizeIndependence() {
  for (uint32_t d : {512u, 7u, 1u, 100u, 1000u}) {
    CAPTURE(d);
    const auto codec = makeCodec<Desc>(d);
    const std::vector<float> x = randomTensor(10007, d);
    const ConstTensor input{x.data(), x.size(), DType::kF32};
    const StepContext ctx = makeContext(5, 1);
    const auto whole = decodeAll(*codec, encodeAll(*codec, ctx, input), x.size(), 0, 0.5f);
    for (size_t chunk : {size_t{d}, size_t{3} * d, size_t{1000}, size_t{4099}}) {
      CAPTURE(chunk);
      const auto chunked =
          decodeAll(*codec, encodeAll(*codec, ctx, input, chunk), x.size(), chunk, 0.5f);
      CHECK(std::memcmp(whole.data(), chunked.data(), 4 * x.size()) == 0);
    }
  }
}

template <typename Desc>
void threadCountIndependence() {
  CpuStream one(1), two(2), three(3);
  for (uint32_t d : {512u, 7u, 1u, 4096u, 12345u, 1000u}) {
    CAPTURE(d);
    const auto codec = makeCodec<Desc>(d);
    const std::vector<float> x = randomTensor(300007, d);
    const ConstTensor input{x.data(), x.size(), DType::kF32};
    for (size_t chunk : {size_t{0}, size_t{100000}}) {
      const auto base = encodeAll(*codec, makeContext(9, 2, nullptr), input, chunk);
      CHECK(encodeAll(*codec, makeContext(9, 2, &one), input, chunk) == base);
      CHECK(encodeAll(*codec, makeContext(9, 2, &two), input, chunk) == base);
      CHECK(encodeAll(*codec, makeContext(9, 2, &three), input, chunk) == base);
    }
  }
}

template <typename Desc>
void simdTargetIndependence() {
  const std::vector<int64_t> targets = simd::availableTargets();
  REQUIRE_FALSE(targets.empty());
  for (uint32_t d : {512u, 7u, 1u, 100u}) {
    CAPTURE(d);
    const auto codec = makeCodec<Desc>(d);
    std::vector<float> x = randomTensor(20011, d + 1);
    x[3] = FLT_TRUE_MIN, x[4] = -FLT_MAX, x[5] = FLT_MAX, x[6] = -FLT_TRUE_MIN;
    const ConstTensor input{x.data(), x.size(), DType::kF32};
    const StepContext ctx = makeContext(3, 1);
    std::vector<std::vector<uint8_t>> base;
    std::vector<float> base_out;
    for (int64_t target : targets) {
      CAPTURE(simd::targetName(target));
      simd::ScopedTargetForTest force(target);
      const auto payloads = encodeAll(*codec, ctx, input, 3 * size_t{d} + 8 * d);
      const auto out = decodeAll(*codec, payloads, x.size(), 3 * size_t{d} + 8 * d, 0.375f);
      if (base.empty()) {
        base = payloads;
        base_out = out;
        const Chunking chunking = Chunking::make(x.size(), 11 * size_t{d}, d);
        for (size_t k = 0; k < payloads.size(); ++k) {
          REQUIRE(payloads[k] == referenceChunk<Desc>(x, chunking.begin(k), chunking.size(k), d,
                                                      ctx, DType::kF32));
        }
      } else {
        CHECK(payloads == base);
        CHECK(testing::bitEqual(out, base_out));
      }
    }
  }
}

template <typename Desc>
void nonFiniteEscape() {
  const auto codec = makeCodec<Desc>(16);
  std::vector<float> x = randomTensor(16 * 12, 11);
  x[16 * 4 + 3] = NAN;                                                     // chunk 1
  x[16 * 8 + 1] = -INFINITY;                                               // chunk 2
  x[16 * 11 + 0] = INFINITY;                                               // chunk 2
  x[16 * 2] = FLT_MAX, x[16 * 2 + 1] = -FLT_MAX, x[16 * 2 + 2] = FLT_MAX;  // chunk 0: finite
  const ConstTensor input{x.data(), x.size(), DType::kF32};
  const auto payloads = encodeAll(*codec, makeContext(1), input, 64);
  REQUIRE(payloads.size() == 3);
  CHECK(payloads[0][3] == Desc::kId);
  CHECK(payloads[0] == referenceChunk<Desc>(x, 0, 64, 16, makeContext(1), DType::kF32));
  for (size_t c : {1, 2}) {
    CHECK(payloads[c][3] == 0);
    CHECK(payloads[c].size() == 16 + 4 * 64);
    CHECK(loadU64(payloads[c].data() + 8) == 64);
    CHECK(payloads[c] == referenceChunk<Desc>(x, 64 * c, 64, 16, makeContext(1), DType::kF32));
  }
  const auto out = decodeAll(*codec, payloads, x.size(), 64);
  for (size_t i = 64; i < x.size(); ++i) {
    if (std::isnan(x[i])) {
      CHECK(std::isnan(out[i]));
    } else {
      CHECK(floatBits(out[i]) == floatBits(0.0f + x[i]));
    }
  }
  // Finite scales in chunk 0 even with ±FLT_MAX.
  for (size_t j = 0; j < Desc::kScales; ++j) {
    CHECK(std::isfinite(loadF32(payloads[0].data() + 20 + 4 * (Desc::kScales * 2 + j))));
  }
  // With threads too.
  CpuStream three(3);
  std::vector<float> large = randomTensor(200000, 12);
  large[150001] = NAN;
  const ConstTensor large_input{large.data(), large.size(), DType::kF32};
  const auto threaded = encodeOne(*codec, makeContext(1, 0, &three), large_input);
  CHECK(threaded[3] == 0);
  CHECK(threaded == encodeOne(*codec, makeContext(1), large_input));
}

template <typename Desc>
void narrowInput() {
  std::mt19937 rng(5);
  std::vector<uint16_t> halves(3000), bf16s(3000);
  for (auto& h : halves)
    h = static_cast<uint16_t>(rng() & 0x7BFF) | static_cast<uint16_t>(rng() & 0x8000);
  for (auto& b : bf16s) {  // magnitudes 2^-27 .. 2^32
    b = static_cast<uint16_t>((rng() & 0x8000) | ((100 + rng() % 60) << 7) | (rng() & 0x7F));
  }
  halves[7] = 0x8000, bf16s[7] = 0x8000;  // -0
  for (uint32_t d : {512u, 7u, 5000u}) {
    const auto codec = makeCodec<Desc>(d);
    for (auto [data, dtype] : {std::pair{&halves, DType::kF16}, {&bf16s, DType::kBF16}}) {
      std::vector<float> wide(data->size());
      widenToFloat({data->data(), data->size(), dtype}, wide.data());
      const StepContext ctx = makeContext(4);
      for (size_t chunk : {size_t{0}, size_t{2} * d}) {
        const auto narrow = encodeAll(*codec, ctx, {data->data(), data->size(), dtype}, chunk);
        const Chunking chunking = Chunking::make(wide.size(), chunk, d);
        for (size_t k = 0; k < narrow.size(); ++k) {
          CHECK(narrow[k][4] == static_cast<uint8_t>(dtype));
          CHECK(narrow[k] ==
                referenceChunk<Desc>(wide, chunking.begin(k), chunking.size(k), d, ctx, dtype));
        }
      }
    }
  }
  // Inf in fp16 input: the escape widens exactly.
  const auto codec = makeCodec<Desc>(512);
  std::vector<uint16_t> with_inf = {0x3C00, 0xFC00, 0x0001, 0x7E00};
  const auto p = encodeOne(*codec, makeContext(0), {with_inf.data(), with_inf.size(), DType::kF16});
  REQUIRE(p[3] == 0);
  CHECK(p[4] == 1);
  for (size_t i = 0; i < with_inf.size(); ++i) {
    CHECK(floatBits(loadF32(p.data() + 16 + 4 * i)) == floatBits(halfToFloat(with_inf[i])));
  }
}

template <typename Desc>
void decoderReadsD() {
  const auto codec512 = makeCodec<Desc>(512);
  const auto codec10 = makeCodec<Desc>(10);
  const std::vector<float> x = randomTensor(95, 8);
  const auto p = encodeOne(*codec10, makeContext(2), {x.data(), x.size(), DType::kF32});
  std::vector<float> a(x.size(), 1.0f), b(x.size(), 1.0f);
  REQUIRE(codec10->decodeChunk(p, -0.75f, a.data(), a.size()).isOk());
  REQUIRE(codec512->decodeChunk(p, -0.75f, b.data(), b.size()).isOk());
  CHECK(testing::bitEqual(a, b));
  // out[i] = out[i] + w * value.
  const auto values = referenceDecode<Desc>(p, 1.0f);
  for (size_t i = 0; i < x.size(); ++i)
    CHECK(floatBits(a[i]) == floatBits(1.0f + -0.75f * values[i]));
}

template <typename Desc>
void errorFeedback() {
  const auto codec = makeCodec<Desc>(100, true);
  const size_t n = 20000;
  CodecState state(codec->stateFloats(n));
  REQUIRE(state.floats() == n);
  for (uint64_t s = 0; s < 4; ++s) {
    const auto x = testing::gaussian(n, 100 + s);
    const std::vector<float> old(state.currentSpan().begin(), state.currentSpan().end());
    StepContext ctx = makeContext(s);
    const Chunking chunking = Chunking::make(n, 3000, codec->chunkAlignment());
    auto payloads = stepTensor(*codec, ctx, chunking, {x.data(), n, DType::kF32}, state);
    REQUIRE(payloads.isOk());
    std::vector<float> sent(n, 0.0f);
    REQUIRE(decodeTensor(*codec, chunking, *payloads, 1.0f, sent.data()).isOk());
    const auto& now = state.currentSpan();
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      // e' = a + (-1 * decoded) with a = x + e: exactly a - decoded, rounded once.
      const float a = x[i] + old[i];
      if (floatBits(now[i]) != floatBits(a + (-1.0f * sent[i]))) ++bad;
      const float tol = 2.5e-7f * std::max(std::fabs(a), std::fabs(sent[i]));
      if (std::fabs((sent[i] + now[i]) - a) > tol) ++bad;
    }
    CHECK(bad == 0);
  }
}

template <typename Desc>
void hostilePayloads() {
  const auto codec = makeCodec<Desc>(8);
  const std::vector<float> x = randomTensor(37, 21);
  // n = 37, d = 8: B = 5 buckets, 37 * kBits code bits (unused bits in the last byte).
  const auto good = encodeOne(*codec, makeContext(0), {x.data(), x.size(), DType::kF32});
  const size_t scales_at = 20, codes_at = 20 + 4 * Desc::kScales * 5;
  REQUIRE(good.size() == codes_at + (37 * Desc::kBits + 7) / 8);
  REQUIRE(good[3] == Desc::kId);
  testing::HostileDecoder refuse(*codec, good, x.size());
  auto mutated = [&](auto edit) { return refuse.mutated(edit); };
  refuse.refuseTruncations();
  refuse(mutated([](auto& p) { storeU32(p.data() + 16, 0); }), x.size(), "d = 0");
  refuse(mutated([](auto& p) { storeU32(p.data() + 16, 4); }), x.size(), "d changes B");
  refuse(mutated([](auto& p) { storeU32(p.data() + 16, 0xFFFFFFFFu); }), x.size(), "d huge");
  for (size_t k : {size_t{0}, size_t{4}}) {
    for (size_t j = 0; j < Desc::kScales; ++j) {
      for (float bad : Desc::badScales(j)) {
        refuse(mutated([&](auto& p) {
                 storeF32(p.data() + scales_at + 4 * (Desc::kScales * k + j), bad);
               }),
               x.size(), "scale " + std::to_string(j) + " = " + std::to_string(bad));
      }
    }
  }
  std::vector<int> foreign_ids;
  for (int id : {1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 255}) {
    if (id != Desc::kId) foreign_ids.push_back(id);
  }
  refuse.refuseHeaderEdits(foreign_ids, "bucket");
  // Counts whose naive size wraps around 64 bits.
  for (uint64_t huge : {(uint64_t{1} << 62) + 1, (uint64_t{1} << 61) + 3, ~uint64_t{0}}) {
    std::vector<uint8_t> wrap(good.begin(), good.end());
    storeU64(wrap.data() + 8, huge);
    storeU32(wrap.data() + 16, 1);
    refuse(wrap, static_cast<size_t>(huge), "n = " + std::to_string(huge));
    storeU32(wrap.data() + 16, 0xFFFFFFFFu);
    refuse(wrap, static_cast<size_t>(huge), "n = " + std::to_string(huge) + ", d huge");
  }
  Desc::hostileExtra(good, codes_at, refuse);
  CHECK(refuse.refused() > 80);

  // The unmodified payload still decodes; so does a valid `none` escape.
  CHECK(codec->decodeChunk(good, 1.0f, refuse.out(), x.size()).isOk());
  std::vector<float> inf_x = x;
  inf_x[0] = INFINITY;
  const auto escaped = encodeOne(*codec, makeContext(0), {inf_x.data(), inf_x.size(), DType::kF32});
  REQUIRE(escaped[3] == 0);
  CHECK(codec->decodeChunk(escaped, 1.0f, refuse.out(), x.size()).isOk());
  // Accepted edge scales: ±0.
  for (size_t j = 0; j < Desc::kScales; ++j) {
    for (float edge : {0.0f, -0.0f}) {
      auto p = good;
      storeF32(p.data() + scales_at + 4 * j, edge);
      std::vector<float> o(x.size(), 0.0f);
      CHECK_MESSAGE(codec->decodeChunk(p, 1.0f, o.data(), o.size()).isOk(), edge);
    }
  }
}

template <typename Desc>
void encoderRefusesBadCalls() {
  const auto codec = makeCodec<Desc>(16);
  testing::checkEncoderRefusesBadCalls(*codec);
  CHECK(codec->maxPayloadBytes(0) >= 20);
}

}  // namespace lightwire::kernels::bucket_test

/// Declares the generic tests for the codec described by `Desc`, named "<NAME> ...".
#define LW_BUCKET_CODEC_TESTS(Desc, NAME)                                                          \
  static_assert(std::string_view(Desc::kName) == NAME);                                            \
  TEST_CASE(NAME " configuration and traits") { bucket_test::configurationAndTraits<Desc>(); }     \
  TEST_CASE(NAME " payload matches a per-element reference and round-trips") {                     \
    bucket_test::payloadMatchesReference<Desc>();                                                  \
  }                                                                                                \
  TEST_CASE(NAME " payload size and header fields") { bucket_test::payloadSizeAndHeader<Desc>(); } \
  TEST_CASE(NAME " decoded result does not depend on the chunk size") {                            \
    bucket_test::chunkSizeIndependence<Desc>();                                                    \
  }                                                                                                \
  TEST_CASE(NAME " payload bytes do not depend on the thread count") {                             \
    bucket_test::threadCountIndependence<Desc>();                                                  \
  }                                                                                                \
  TEST_CASE(NAME " payload bytes and decoded values do not depend on the SIMD target") {           \
    bucket_test::simdTargetIndependence<Desc>();                                                   \
  }                                                                                                \
  TEST_CASE(NAME " non-finite values send the chunk in the none layout") {                         \
    bucket_test::nonFiniteEscape<Desc>();                                                          \
  }                                                                                                \
  TEST_CASE(NAME " fp16 and bf16 input equal their widened fp32 input") {                          \
    bucket_test::narrowInput<Desc>();                                                              \
  }                                                                                                \
  TEST_CASE(NAME " decoder reads d from the payload and applies the weight") {                     \
    bucket_test::decoderReadsD<Desc>();                                                            \
  }                                                                                                \
  TEST_CASE(NAME " error feedback: sent + new residual = input + old residual") {                  \
    bucket_test::errorFeedback<Desc>();                                                            \
  }                                                                                                \
  TEST_CASE(NAME " hostile payloads are refused without touching the output") {                    \
    bucket_test::hostilePayloads<Desc>();                                                          \
  }                                                                                                \
  TEST_CASE(NAME " encoder refuses bad calls") { bucket_test::encoderRefusesBadCalls<Desc>(); }
