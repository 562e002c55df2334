// The `qsgd` codec (docs/determinism.md §4.5, docs/wire-format.md): bytes against a plain
// per-element reference written from the spec, statistics (unbiased, QSGD's variance bound),
// chunk and thread independence, the non-finite escape and hostile payloads.

#include <doctest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "kernels/codec.h"
#include "kernels/parallel.h"
#include "kernels/philox.h"
#include "kernels/registry.h"
#include "tests/kernels/hostile_payload_util.h"

namespace lightwire::kernels {
namespace test_qsgd {

std::unique_ptr<Codec> makeQsgd(int bits, uint32_t bucket_size) {
  CodecConfig config;
  config.name = "qsgd";
  config.bits = bits;
  config.bucket_size = bucket_size;
  auto codec = createCodec(config);
  REQUIRE_MESSAGE(codec.isOk(), codec.status().message());
  return std::move(codec).value();
}

StepContext makeContext(uint64_t step, uint32_t rank = 0, CpuStream* stream = nullptr) {
  StepContext ctx;
  ctx.seed = 1234;
  ctx.name_key = tensorNameKey("layer.weight");
  ctx.step = step;
  ctx.rank = rank;
  ctx.stream = stream;
  return ctx;
}

std::vector<std::vector<uint8_t>> encodeAll(const Codec& codec, const StepContext& ctx,
                                            ConstTensor input, size_t chunk_elements = 0) {
  CodecState state;
  const Chunking chunking = Chunking::make(input.elements, chunk_elements, codec.chunkAlignment());
  auto payloads = encodeTensor(codec, ctx, chunking, input, state);
  REQUIRE_MESSAGE(payloads.isOk(), payloads.status().message());
  return std::move(payloads).value();
}

std::vector<uint8_t> encodeOne(const Codec& codec, const StepContext& ctx, ConstTensor input) {
  auto payloads = encodeAll(codec, ctx, input);
  REQUIRE(payloads.size() == 1);
  return payloads[0];
}

// §2 written out plainly: blocks of 4096, eight strided fp64 accumulators, pairwise combination.
double referenceSumOfSquares(const float* x, size_t n) {
  double total = 0.0;
  for (size_t block = 0; block < n; block += 4096) {
    double a[8] = {};
    for (size_t i = block; i < std::min(n, block + 4096); ++i) {
      a[(i - block) % 8] =
          a[(i - block) % 8] + static_cast<double>(x[i]) * static_cast<double>(x[i]);
    }
    total = total + (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
  }
  return total;
}

// One chunk [begin, begin + n) of the fp32 tensor x, encoded per §4.5 one element at a time.
std::vector<uint8_t> referenceChunk(const std::vector<float>& x, size_t begin, size_t n, unsigned b,
                                    uint32_t d, const StepContext& ctx, DType source) {
  const size_t buckets = (n + d - 1) / d;
  std::vector<float> norms(buckets);
  bool finite = true;
  for (size_t k = 0; k < buckets; ++k) {
    const size_t len = std::min<size_t>(d, n - k * d);
    norms[k] = static_cast<float>(std::sqrt(referenceSumOfSquares(&x[begin + k * d], len)));
    finite = finite && std::isfinite(norms[k]);
  }
  std::vector<uint8_t> p(16);
  p[0] = 0x4C, p[1] = 0x57, p[2] = 1, p[4] = static_cast<uint8_t>(source);
  storeU64(p.data() + 8, n);
  if (!finite) {
    p[3] = 0;
    p.resize(16 + 4 * n);
    for (size_t i = 0; i < n; ++i) storeF32(p.data() + 16 + 4 * i, x[begin + i]);
    return p;
  }
  p[3] = 7;
  p.resize(24 + 4 * buckets + (n * b + 7) / 8, 0);
  p[16] = static_cast<uint8_t>(b);
  storeU32(p.data() + 20, d);
  for (size_t k = 0; k < buckets; ++k) storeF32(p.data() + 24 + 4 * k, norms[k]);
  uint8_t* codes = p.data() + 24 + 4 * buckets;
  const uint32_t s = (1u << (b - 1)) - 1;
  const PhiloxStream rng(ctx.seed, ctx.name_key, ctx.step, ctx.rank, RandomPurpose::kQsgdRounding);
  for (size_t i = 0; i < n; ++i) {
    const float xi = x[begin + i];
    const float norm = norms[i / d];
    uint32_t level = 0;
    if (norm != 0.0f) {  // all fp32; element t uses half t mod 2 of stream word t / 2
      float f = static_cast<float>(s) / norm;
      if (std::isinf(f)) f = FLT_MAX;
      const float r = std::fabs(xi) * f;
      const float fl = std::floor(r);
      const float pr = r - fl;
      const uint64_t t = begin + i;
      const uint32_t h = (rng.word(t / 2) >> (16 * (t % 2))) & 0xFFFFu;
      const float u = static_cast<float>(h) / 65536.0f;
      level = std::min(static_cast<uint32_t>(fl) + (u < pr ? 1u : 0u), s);
    }
    const uint32_t code = ((xi < 0.0f ? 1u : 0u) << (b - 1)) | level;
    for (unsigned bit = 0; bit < b; ++bit) {
      const size_t t = i * b + bit;
      if ((code >> bit) & 1u) codes[t / 8] = static_cast<uint8_t>(codes[t / 8] | (1u << (t % 8)));
    }
  }
  return p;
}

std::vector<float> randomTensor(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-8, 8);
  std::vector<float> x(n);
  for (float& v : x) v = std::ldexp(normal(rng), exponent(rng));
  return x;
}

std::vector<float> decodeAll(const Codec& codec, const std::vector<std::vector<uint8_t>>& payloads,
                             size_t n, size_t chunk_elements, float weight = 1.0f) {
  std::vector<float> out(n, 0.0f);
  const Chunking chunking = Chunking::make(n, chunk_elements, codec.chunkAlignment());
  const Status s = decodeTensor(codec, chunking, payloads, weight, out.data());
  REQUIRE_MESSAGE(s.isOk(), s.message());
  return out;
}

TEST_CASE("qsgd configuration and traits") {
  const auto codec = makeQsgd(8, 512);
  const CodecTraits& t = codec->traits();
  CHECK(t.id == CodecId::kQsgd);
  CHECK_FALSE(t.summable);
  CHECK_FALSE(t.sparse);
  CHECK_FALSE(t.own_memory);
  CHECK_FALSE(t.default_error_feedback);
  CHECK(codec->chunkAlignment() == 512);
  CHECK(makeQsgd(3, 7)->chunkAlignment() == 7);
  CodecConfig defaults;
  defaults.name = "qsgd";
  auto made = createCodec(defaults);
  REQUIRE(made.isOk());
  CHECK((*made)->chunkAlignment() == 512);
  CHECK((*made)->config().bits == 8);

  auto refused = [](int bits, uint32_t bucket, const char* word) {
    CodecConfig c;
    c.name = "qsgd";
    c.bits = bits;
    c.bucket_size = bucket;
    auto r = createCodec(c);
    REQUIRE_FALSE(r.isOk());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(r.status().message().find(word) != std::string::npos, r.status().message());
  };
  refused(1, 512, "bits");
  refused(9, 512, "bits");
  refused(0, 512, "bits");
  refused(-3, 512, "bits");
  refused(8, 0, "bucket_size");
  refused(8, (1u << 24) + 1, "bucket_size");
  refused(8, 0xFFFFFFFFu, "bucket_size");
  CHECK(makeQsgd(2, 1 << 24)->chunkAlignment() == (1u << 24));
}

TEST_CASE("qsgd payload matches a per-element reference of the spec") {
  struct Case {
    unsigned bits;
    uint32_t d;
    size_t n;
    size_t chunk;
  };
  const Case cases[] = {{8, 512, 5000, 0},   {8, 512, 5000, 1024}, {2, 1, 37, 0},
                        {3, 7, 1001, 21},    {5, 64, 1000, 0},     {4, 100, 999, 300},
                        {7, 9000, 20000, 0}, {6, 3, 2, 0},         {2, 5000, 12345, 5000},
                        {8, 1, 1, 0},        {3, 8, 0, 0}};
  for (const Case& c : cases) {
    CAPTURE(c.bits);
    CAPTURE(c.d);
    CAPTURE(c.n);
    CAPTURE(c.chunk);
    const auto codec = makeQsgd(static_cast<int>(c.bits), c.d);
    const std::vector<float> x = randomTensor(c.n, static_cast<uint32_t>(c.n + c.d));
    for (uint32_t rank : {0u, 3u}) {
      const StepContext ctx = makeContext(17, rank);
      const auto payloads = encodeAll(*codec, ctx, {x.data(), x.size(), DType::kF32}, c.chunk);
      const Chunking chunking = Chunking::make(c.n, c.chunk, c.d);
      REQUIRE(payloads.size() == chunking.count());
      for (size_t k = 0; k < payloads.size(); ++k) {
        const auto expected =
            referenceChunk(x, chunking.begin(k), chunking.size(k), c.bits, c.d, ctx, DType::kF32);
        REQUIRE(payloads[k] == expected);
        CHECK(payloads[k].size() <= codec->maxPayloadBytes(chunking.size(k)));
      }
    }
  }
}

TEST_CASE("qsgd payload size and header fields") {
  const auto codec = makeQsgd(5, 64);
  const std::vector<float> x = randomTensor(1000, 5);
  const auto p = encodeOne(*codec, makeContext(0), {x.data(), x.size(), DType::kF32});
  // B = ceil(1000 / 64) = 16 norms, C = ceil(1000 * 5 / 8) = 625 code bytes.
  REQUIRE(p.size() == 24 + 4 * 16 + 625);
  CHECK(p[0] == 0x4C);
  CHECK(p[1] == 0x57);
  CHECK(p[2] == 1);
  CHECK(p[3] == 7);
  CHECK(p[4] == 0);
  CHECK(p[5] == 0);
  CHECK(p[6] == 0);
  CHECK(p[7] == 0);
  CHECK(loadU64(p.data() + 8) == 1000);
  CHECK(p[16] == 5);
  CHECK(p[17] == 0);
  CHECK(p[18] == 0);
  CHECK(p[19] == 0);
  CHECK(loadU32(p.data() + 20) == 64);
  for (size_t k = 0; k < 16; ++k) {
    const size_t len = std::min<size_t>(64, 1000 - 64 * k);
    CHECK(loadF32(p.data() + 24 + 4 * k) ==
          static_cast<float>(std::sqrt(referenceSumOfSquares(&x[64 * k], len))));
  }
  // 8 bits with the default bucket: n + 4n/d bytes after the headers.
  const auto codec8 = makeQsgd(8, 512);
  const std::vector<float> y = randomTensor(4096, 6);
  CHECK(encodeOne(*codec8, makeContext(0), {y.data(), y.size(), DType::kF32}).size() ==
        24 + 4096 + 4 * 8);
}

TEST_CASE("qsgd decoded result does not depend on the chunk size") {
  for (const auto& setting : {std::pair{8, 512u}, {3, 7u}, {2, 1u}, {6, 100u}}) {
    const int bits = setting.first;  // plain variables: CAPTURE's lambda takes them
    const unsigned d = setting.second;
    CAPTURE(bits);
    CAPTURE(d);
    const auto codec = makeQsgd(bits, d);
    const std::vector<float> x = randomTensor(10007, static_cast<uint32_t>(bits));
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

TEST_CASE("qsgd payload bytes do not depend on the thread count") {
  CpuStream one(1), two(2), three(3);
  for (const auto& setting : {std::pair{8, 512u}, {3, 7u}, {5, 1u}, {2, 4096u}, {7, 12345u}}) {
    const int bits = setting.first;  // plain variables: CAPTURE's lambda takes them
    const unsigned d = setting.second;
    CAPTURE(bits);
    CAPTURE(d);
    const auto codec = makeQsgd(bits, d);
    const std::vector<float> x = randomTensor(300007, static_cast<uint32_t>(d));
    const ConstTensor input{x.data(), x.size(), DType::kF32};
    for (size_t chunk : {size_t{0}, size_t{100000}}) {
      const auto base = encodeAll(*codec, makeContext(9, 2, nullptr), input, chunk);
      CHECK(encodeAll(*codec, makeContext(9, 2, &one), input, chunk) == base);
      CHECK(encodeAll(*codec, makeContext(9, 2, &two), input, chunk) == base);
      CHECK(encodeAll(*codec, makeContext(9, 2, &three), input, chunk) == base);
    }
  }
}

TEST_CASE("qsgd randomness follows step, rank, seed and tensor name") {
  const auto codec = makeQsgd(4, 64);
  const std::vector<float> x = randomTensor(4096, 3);
  const ConstTensor input{x.data(), x.size(), DType::kF32};
  const auto base = encodeOne(*codec, makeContext(1, 0), input);
  CHECK(encodeOne(*codec, makeContext(1, 0), input) == base);
  CHECK(encodeOne(*codec, makeContext(2, 0), input) != base);
  CHECK(encodeOne(*codec, makeContext(1, 1), input) != base);
  StepContext other_seed = makeContext(1, 0);
  other_seed.seed = 99;
  CHECK(encodeOne(*codec, other_seed, input) != base);
  StepContext other_name = makeContext(1, 0);
  other_name.name_key = tensorNameKey("layer.bias");
  CHECK(encodeOne(*codec, other_name, input) != base);
}

// Bucket layouts that stress the estimator differently: gaussian, equal magnitudes (close to the
// √d/s bound at low s), one dominant value, zeros and exact levels, a short last bucket.
std::vector<float> statisticsInput(uint32_t d) {
  std::mt19937 rng(2024);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x;
  for (uint32_t i = 0; i < d; ++i) x.push_back(normal(rng));
  for (uint32_t i = 0; i < d; ++i) x.push_back(i % 3 == 0 ? -0.5f : 0.5f);
  for (uint32_t i = 0; i < d; ++i) x.push_back(i == 5 ? 40.0f : 0.1f * normal(rng));
  for (uint32_t i = 0; i < d; ++i) x.push_back(i % 4 == 0 ? 0.0f : (i % 4 == 1 ? 1.0f : -1e-3f));
  for (uint32_t i = 0; i < d / 3 + 1; ++i) x.push_back(1e-30f * normal(rng));
  return x;
}

TEST_CASE("qsgd is unbiased and within QSGD's variance bound") {
  constexpr int kTrials = 3000;
  constexpr uint32_t kBucket = 64;
  for (int bits : {2, 4, 8}) {
    CAPTURE(bits);
    const auto codec = makeQsgd(bits, kBucket);
    const std::vector<float> x = statisticsInput(kBucket);
    const size_t n = x.size();
    const ConstTensor input{x.data(), n, DType::kF32};
    const double s = (1 << (bits - 1)) - 1;
    std::vector<double> sum(n, 0.0), squared_error(n, 0.0);
    std::vector<float> out(n);
    for (int t = 0; t < kTrials; ++t) {
      const auto p = encodeOne(*codec, makeContext(static_cast<uint64_t>(t), 0), input);
      REQUIRE(p[3] == 7);
      std::fill(out.begin(), out.end(), 0.0f);
      REQUIRE(codec->decodeChunk(p, 1.0f, out.data(), n).isOk());
      for (size_t i = 0; i < n; ++i) {
        const double e = static_cast<double>(out[i]) - x[i];
        sum[i] += out[i];
        squared_error[i] += e * e;
      }
    }
    const size_t buckets = (n + kBucket - 1) / kBucket;
    for (size_t k = 0; k < buckets; ++k) {
      CAPTURE(k);
      const size_t lo = k * kBucket, hi = std::min(n, lo + kBucket);
      const double d = static_cast<double>(hi - lo);
      double norm2 = 0.0;
      for (size_t i = lo; i < hi; ++i) norm2 += static_cast<double>(x[i]) * x[i];
      const double norm = std::sqrt(norm2);
      const double scale = norm / s;
      double variance = 0.0, expected_variance = 0.0;
      for (size_t i = lo; i < hi; ++i) {
        // Per element: value = scale * (floor(r) + Bernoulli(p)), so its standard deviation is
        // scale * sqrt(p (1 - p)); the mean of kTrials draws must be within 6 of those, plus the
        // fp32 rounding of the norm, the scale and the product (a few ulps of x).
        const double r = std::fabs(x[i]) / norm * s;
        const double frac = r - std::floor(r);
        const double sigma = scale * std::sqrt(frac * (1.0 - frac));
        expected_variance += sigma * sigma;
        const double mean = sum[i] / kTrials;
        const double tolerance = 6.0 * sigma / std::sqrt(kTrials) + 1e-6 * std::fabs(x[i]) + 1e-37;
        REQUIRE_MESSAGE(std::fabs(mean - x[i]) <= tolerance,
                        "element " << i << ": x = " << x[i] << ", mean = " << mean);
        variance += squared_error[i] / kTrials;
      }
      const double bound = std::min(d / (s * s), std::sqrt(d) / s) * norm2;
      CHECK_MESSAGE(variance <= 1.05 * bound + 1e-12 * norm2,
                    "bucket " << k << ": variance " << variance << " bound " << bound);
      // And the measured variance is what the rounding probabilities predict.
      CHECK_MESSAGE(
          std::fabs(variance - expected_variance) <= 0.25 * expected_variance + 1e-9 * norm2,
          "bucket " << k << ": variance " << variance << " expected " << expected_variance);
    }
  }
}

TEST_CASE("qsgd all-zero bucket has norm 0 and zero codes") {
  const auto codec = makeQsgd(4, 8);
  std::vector<float> x(24, 0.0f);
  for (size_t i = 8; i < 16; i += 2) x[i] = -0.0f;
  x[20] = 3.0f;
  const auto p = encodeOne(*codec, makeContext(3), {x.data(), x.size(), DType::kF32});
  REQUIRE(p.size() == 24 + 12 + 12);
  CHECK(p[3] == 7);
  CHECK(loadF32(p.data() + 24) == 0.0f);
  CHECK(floatBits(loadF32(p.data() + 28)) == 0u);
  CHECK(loadF32(p.data() + 32) == 3.0f);
  for (size_t i = 36; i < 36 + 8; ++i) CHECK(p[i] == 0);  // buckets 0 and 1: 16 codes of 4 bits
  // x[20] = norm: r = s exactly, level s = 7, no rounding needed.
  CHECK((p[36 + 10] & 0x0F) == 7);
  std::vector<float> out(x.size(), 2.0f);
  REQUIRE(codec->decodeChunk(p, 1.0f, out.data(), out.size()).isOk());
  for (size_t i = 0; i < x.size(); ++i) {
    const float expected = i == 20 ? 2.0f + 7.0f * (3.0f / 7.0f) : 2.0f;
    CHECK(floatBits(out[i]) == floatBits(expected));
  }
  // Subnormal and tiny values: the norm is small but not 0, and the reference agrees.
  std::vector<float> tiny = {FLT_TRUE_MIN, -FLT_TRUE_MIN, 0.0f,    -0.0f,  3 * FLT_TRUE_MIN,
                             0.0f,         0.0f,          FLT_MIN, 1e-40f, -1e-41f,
                             0.0f,         0.0f,          0.0f,    0.0f,   0.0f,
                             0.0f};
  const auto pt = encodeOne(*codec, makeContext(3), {tiny.data(), tiny.size(), DType::kF32});
  CHECK(pt == referenceChunk(tiny, 0, tiny.size(), 4, 8, makeContext(3), DType::kF32));
  CHECK(loadF32(pt.data() + 24) > 0.0f);
}

TEST_CASE("qsgd non-finite bucket norms send the chunk in the none layout") {
  const auto codec = makeQsgd(8, 16);
  std::vector<float> x = randomTensor(16 * 12, 11);
  x[16 * 4 + 3] = NAN;                             // chunk 1
  x[16 * 8 + 1] = -INFINITY;                       // chunk 2
  x[16 * 11 + 0] = 3e38f, x[16 * 11 + 1] = 3e38f;  // chunk 2: finite values, norm overflows fp32
  const ConstTensor input{x.data(), x.size(), DType::kF32};
  const auto payloads = encodeAll(*codec, makeContext(1), input, 64);
  REQUIRE(payloads.size() == 3);
  CHECK(payloads[0][3] == 7);
  for (size_t c : {1, 2}) {
    CHECK(payloads[c][3] == 0);
    CHECK(payloads[c].size() == 16 + 4 * 64);
    CHECK(loadU64(payloads[c].data() + 8) == 64);
  }
  const auto out = decodeAll(*codec, payloads, x.size(), 64);
  for (size_t i = 64; i < x.size(); ++i) {
    if (std::isnan(x[i])) {
      CHECK(std::isnan(out[i]));
    } else {
      CHECK(floatBits(out[i]) == floatBits(0.0f + x[i]));
    }
  }
  // Overflow alone, in a single chunk.
  std::vector<float> big(40, 1.0f);
  big[30] = FLT_MAX, big[31] = FLT_MAX;
  const auto p = encodeOne(*codec, makeContext(1), {big.data(), big.size(), DType::kF32});
  CHECK(p[3] == 0);
  CHECK(p.size() == 16 + 4 * 40);
  // Reference agrees on both.
  CHECK(p == referenceChunk(big, 0, 40, 8, 16, makeContext(1), DType::kF32));
  CHECK(payloads[2] == referenceChunk(x, 128, 64, 8, 16, makeContext(1), DType::kF32));
  // With threads too.
  CpuStream three(3);
  std::vector<float> large = randomTensor(200000, 12);
  large[150001] = INFINITY;
  const ConstTensor large_input{large.data(), large.size(), DType::kF32};
  const auto threaded = encodeOne(*codec, makeContext(1, 0, &three), large_input);
  CHECK(threaded[3] == 0);
  CHECK(threaded == encodeOne(*codec, makeContext(1), large_input));
}

TEST_CASE("qsgd fp16 and bf16 input equal their widened fp32 input") {
  std::mt19937 rng(5);
  std::vector<uint16_t> halves(3000), bf16s(3000);
  for (auto& h : halves)
    h = static_cast<uint16_t>(rng() & 0x7BFF) | static_cast<uint16_t>(rng() & 0x8000);
  for (auto& b : bf16s) {  // magnitudes 2^-27 .. 2^32
    b = static_cast<uint16_t>((rng() & 0x8000) | ((100 + rng() % 60) << 7) | (rng() & 0x7F));
  }
  for (auto [bits, d] : {std::pair{8, 512u}, {3, 7u}, {5, 5000u}}) {
    const auto codec = makeQsgd(bits, d);
    for (auto [data, dtype] : {std::pair{&halves, DType::kF16}, {&bf16s, DType::kBF16}}) {
      std::vector<float> wide(data->size());
      widenToFloat({data->data(), data->size(), dtype}, wide.data());
      const StepContext ctx = makeContext(4);
      auto narrow = encodeOne(*codec, ctx, {data->data(), data->size(), dtype});
      CHECK(narrow[4] == static_cast<uint8_t>(dtype));
      const auto expected = referenceChunk(wide, 0, wide.size(), bits, d, ctx, dtype);
      CHECK(narrow == expected);
    }
  }
  // Inf in fp16 input: the escape widens exactly.
  const auto codec = makeQsgd(8, 512);
  std::vector<uint16_t> with_inf = {0x3C00, 0xFC00, 0x0001, 0x7E00};
  const auto p = encodeOne(*codec, makeContext(0), {with_inf.data(), with_inf.size(), DType::kF16});
  REQUIRE(p[3] == 0);
  CHECK(p[4] == 1);
  for (size_t i = 0; i < with_inf.size(); ++i) {
    CHECK(floatBits(loadF32(p.data() + 16 + 4 * i)) == floatBits(halfToFloat(with_inf[i])));
  }
}

TEST_CASE("qsgd decoder reads b and d from the payload and applies the weight") {
  const auto codec8 = makeQsgd(8, 512);
  const auto codec3 = makeQsgd(3, 10);
  const std::vector<float> x = randomTensor(95, 8);
  const auto p = encodeOne(*codec3, makeContext(2), {x.data(), x.size(), DType::kF32});
  std::vector<float> a(x.size(), 1.0f), b(x.size(), 1.0f);
  REQUIRE(codec3->decodeChunk(p, -0.75f, a.data(), a.size()).isOk());
  REQUIRE(codec8->decodeChunk(p, -0.75f, b.data(), b.size()).isOk());
  CHECK(a == b);
  // out[i] = out[i] + w * (±(float)level * (norm / (float)s)).
  const uint32_t s = 3;
  for (size_t i = 0; i < x.size(); ++i) {
    const float norm = loadF32(p.data() + 24 + 4 * (i / 10));
    const size_t codes = 24 + 4 * 10;
    uint32_t code = 0;
    for (unsigned bit = 0; bit < 3; ++bit) {
      const size_t t = 3 * i + bit;
      code |= ((p[codes + t / 8] >> (t % 8)) & 1u) << bit;
    }
    float value = static_cast<float>(code & s) * (norm / static_cast<float>(s));
    if (code & 4u) value = -value;
    CHECK(floatBits(a[i]) == floatBits(1.0f + -0.75f * value));
  }
}

TEST_CASE("qsgd hostile payloads are refused without touching the output") {
  const auto codec = makeQsgd(3, 8);
  const std::vector<float> x = randomTensor(37, 21);
  // n = 37, d = 8, b = 3: B = 5 norms, 111 code bits in 14 bytes (one unused bit).
  const auto good = encodeOne(*codec, makeContext(0), {x.data(), x.size(), DType::kF32});
  REQUIRE(good.size() == 24 + 20 + 14);
  testing::HostileDecoder refuse(*codec, good, x.size());
  auto mutated = [&](auto edit) { return refuse.mutated(edit); };
  refuse.refuseTruncations();
  for (int b : {0, 1, 9, 16, 255}) {
    refuse(mutated([b](auto& p) { p[16] = static_cast<uint8_t>(b); }), x.size(),
           "b = " + std::to_string(b));
  }
  // b = 4 and 2 are valid widths but give a different length.
  refuse(mutated([](auto& p) { p[16] = 4; }), x.size(), "b changes the length");
  refuse(mutated([](auto& p) { p[16] = 2; }), x.size(), "b changes the length");
  for (int r : {17, 18, 19}) refuse(mutated([r](auto& p) { p[r] = 1; }), x.size(), "reserved");
  refuse(mutated([](auto& p) { storeU32(p.data() + 20, 0); }), x.size(), "d = 0");
  refuse(mutated([](auto& p) { storeU32(p.data() + 20, 4); }), x.size(), "d changes B");
  refuse(mutated([](auto& p) { storeU32(p.data() + 20, 0xFFFFFFFFu); }), x.size(), "d huge");
  for (size_t k : {0, 4}) {
    for (float bad : {NAN, -NAN, INFINITY, -INFINITY, -1.0f, -FLT_TRUE_MIN, -FLT_MAX}) {
      refuse(mutated([&](auto& p) { storeF32(p.data() + 24 + 4 * k, bad); }), x.size(),
             "norm " + std::to_string(bad));
    }
  }
  refuse.refuseHeaderEdits({1, 2, 3, 6, 8, 11, 12, 255}, "qsgd");
  // Counts whose naive size wraps around 64 bits: n = 2^62 + 1, d = 1, b = 8 gives
  // 24 + 4n + n = 29 (mod 2^64), exactly this payload's length.
  const uint64_t huge = (uint64_t{1} << 62) + 1;
  std::vector<uint8_t> wrap(29, 0);
  std::copy(good.begin(), good.begin() + 24, wrap.begin());
  storeU64(wrap.data() + 8, huge);
  wrap[16] = 8;
  storeU32(wrap.data() + 20, 1);
  refuse(wrap, static_cast<size_t>(huge), "n = 2^62 + 1");
  storeU64(wrap.data() + 8, ~uint64_t{0});
  refuse(wrap, static_cast<size_t>(~uint64_t{0}), "n = 2^64 - 1");
  storeU32(wrap.data() + 20, 0xFFFFFFFFu);
  refuse(wrap, static_cast<size_t>(~uint64_t{0}), "n = 2^64 - 1, d huge");
  CHECK(refuse.refused() > 100);

  // The unmodified payload still decodes; so does a valid `none` escape and an empty chunk.
  CHECK(codec->decodeChunk(good, 1.0f, refuse.out(), x.size()).isOk());
  std::vector<float> inf_x = x;
  inf_x[0] = INFINITY;
  const auto escaped = encodeOne(*codec, makeContext(0), {inf_x.data(), inf_x.size(), DType::kF32});
  REQUIRE(escaped[3] == 0);
  CHECK(codec->decodeChunk(escaped, 1.0f, refuse.out(), x.size()).isOk());
  const auto empty = encodeOne(*codec, makeContext(0), {nullptr, 0, DType::kF32});
  CHECK(empty.size() == 24);
  CHECK(codec->decodeChunk(empty, 1.0f, nullptr, 0).isOk());
}

TEST_CASE("qsgd encoder refuses bad calls") {
  const auto codec = makeQsgd(8, 16);
  testing::checkEncoderRefusesBadCalls(*codec);
  CHECK(makeQsgd(8, 1)->maxPayloadBytes(100) >= 24 + 4 * 100 + 100);
}

}  // namespace test_qsgd
}  // namespace lightwire::kernels
