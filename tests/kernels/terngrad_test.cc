// The `terngrad` codec (docs/determinism.md §4.9, docs/wire-format.md): its plain per-element
// reference, the generic bucket codec tests (tests/kernels/bucket_codec_test_util.h: bytes against
// the reference, packing round trips, chunk and thread independence, the non-finite escape and
// hostile payloads), and terngrad's own: codes at the edges, rounding near u, randomness,
// unbiasedness and TernGrad's variance.

#include <doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/philox.h"
#include "kernels/simd/targets.h"
#include "tests/kernels/bucket_codec_test_util.h"

namespace lightwire::kernels {
namespace test_terngrad {

using namespace bucket_test;

struct Terngrad {
  static constexpr const char* kName = "terngrad";
  static constexpr uint8_t kId = 8;
  static constexpr unsigned kBits = 2;
  static constexpr size_t kScales = 1;
  static constexpr bool kDefaultErrorFeedback = false;

  // s = max |x| (NaN when the bucket holds one; then the chunk is escaped).
  static std::vector<float> referenceScales(const float* x, size_t n) {
    float s = 0.0f;
    for (size_t i = 0; i < n; ++i) {
      if (std::isnan(x[i])) return {NAN};
      s = std::max(s, std::fabs(x[i]));
    }
    return {s};
  }

  static uint32_t referenceCode(float x, size_t i, const std::vector<float>& s,
                                const StepContext& ctx) {
    if (s[0] == 0.0f) return 0;
    const double p = std::fabs(static_cast<double>(x)) / static_cast<double>(s[0]);
    const PhiloxStream rng(ctx.seed, ctx.name_key, ctx.step, ctx.rank,
                           RandomPurpose::kTerngradRounding);
    const double u = unitDouble(rng.word(i));
    if (!(u < p)) return 0;
    return x < 0.0f ? 2 : 1;
  }

  static float referenceValue(uint32_t code, const std::vector<float>& s) {
    return code == 0 ? 0.0f : (code == 1 ? s[0] : -s[0]);
  }

  static std::vector<float> badScales(size_t) { return nonFiniteOrNegative(); }

  // The invalid code 3 anywhere.
  static void hostileExtra(const std::vector<uint8_t>& good, size_t codes_at,
                           testing::HostileDecoder& refuse) {
    for (size_t i : {size_t{0}, size_t{1}, size_t{3}, size_t{4}, size_t{17}, size_t{36}}) {
      std::vector<uint8_t> p = good;
      p[codes_at + i / 4] = static_cast<uint8_t>(p[codes_at + i / 4] | (3u << (2 * (i % 4))));
      refuse(p, 37, "code 3 at element " + std::to_string(i));
    }
  }
};

LW_BUCKET_CODEC_TESTS(Terngrad, "terngrad")

TEST_CASE("terngrad codes: signed zeros, the bucket maximum, all-zero buckets") {
  const auto codec = makeCodec<Terngrad>(8);
  std::vector<float> x = {
      0.0f,  -0.0f,        2.0f,          -2.0f, 1.0f,  -1.0f, 0.5f, -0.0f,  // s = 2
      0.0f,  -0.0f,        0.0f,          0.0f,  -0.0f, 0.0f,  0.0f, 0.0f,   // s = 0
      -3.0f, FLT_TRUE_MIN, -FLT_TRUE_MIN, 0.0f};                             // s = 3
  for (uint64_t step = 0; step < 50; ++step) {
    const auto p = encodeOne(*codec, makeContext(step), {x.data(), x.size(), DType::kF32});
    REQUIRE(p == referenceChunk<Terngrad>(x, 0, x.size(), 8, makeContext(step), DType::kF32));
    CHECK(loadF32(p.data() + 20) == 2.0f);
    CHECK(floatBits(loadF32(p.data() + 24)) == 0u);
    CHECK(loadF32(p.data() + 28) == 3.0f);
    const uint8_t* codes = p.data() + 32;
    CHECK(codeAt<Terngrad>(codes, 0) == 0);
    CHECK(codeAt<Terngrad>(codes, 1) == 0);
    CHECK(codeAt<Terngrad>(codes, 2) == 1);  // |x| = s: p = 1, always sent
    CHECK(codeAt<Terngrad>(codes, 3) == 2);
    CHECK(codeAt<Terngrad>(codes, 7) == 0);
    for (size_t i = 8; i < 16; ++i) CHECK(codeAt<Terngrad>(codes, i) == 0);
    CHECK(codeAt<Terngrad>(codes, 16) == 2);
    CHECK(codeAt<Terngrad>(codes, 19) == 0);
    std::vector<float> out(x.size(), -0.0f);
    REQUIRE(codec->decodeChunk(p, 1.0f, out.data(), out.size()).isOk());
    // Code 0 decodes to +0: -0 + 1 * +0 = +0.
    for (size_t i = 8; i < 16; ++i) CHECK(floatBits(out[i]) == 0u);
    CHECK(out[2] == 2.0f);
    CHECK(out[3] == -2.0f);
  }
}

TEST_CASE("terngrad comparisons where p is within rounding of u, and extreme scalers") {
  // Elements whose p = |x| / s equals (or neighbours) the element's own u: the fp32 shortcut must
  // defer to the exact fp64 comparison. Buckets of 64 with s = 1 (x[0] = 1).
  const StepContext ctx = makeContext(6, 2);
  const PhiloxStream rng(ctx.seed, ctx.name_key, ctx.step, ctx.rank,
                         RandomPurpose::kTerngradRounding);
  const size_t n = 64 * 40;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    if (i % 64 == 0) {
      x[i] = 1.0f;
      continue;
    }
    const float u = static_cast<float>(unitDouble(rng.word(i)));
    switch (i % 5) {
      case 0:
        x[i] = u;
        break;
      case 1:
        x[i] = -u;
        break;
      case 2:
        x[i] = std::nextafter(u, 2.0f);
        break;
      case 3:
        x[i] = -std::nextafter(u, 0.0f);
        break;
      default:
        x[i] = static_cast<float>(i % 7) * 0.1f;
        break;
    }
  }
  // Extreme scalers (outside the shortcut's range) and subnormals.
  for (size_t i = 64 * 30; i < 64 * 32; ++i) x[i] = std::ldexp(x[i], -120);
  for (size_t i = 64 * 32; i < 64 * 34; ++i) x[i] = std::ldexp(x[i], 110);
  for (size_t i = 64 * 34; i < 64 * 35; ++i) x[i] = static_cast<float>(i % 9) * FLT_TRUE_MIN;
  for (size_t i = 64 * 35; i < 64 * 36; ++i) x[i] = std::ldexp(x[i], -100);
  for (size_t i = 64 * 36; i < 64 * 37; ++i) x[i] = std::ldexp(x[i], 100);
  const auto codec = makeCodec<Terngrad>(64);
  for (int64_t target : simd::availableTargets()) {
    CAPTURE(simd::targetName(target));
    simd::ScopedTargetForTest force(target);
    const auto p = encodeOne(*codec, ctx, {x.data(), n, DType::kF32});
    CHECK(p == referenceChunk<Terngrad>(x, 0, n, 64, ctx, DType::kF32));
  }
}

TEST_CASE("terngrad randomness follows step, rank, seed and tensor name") {
  const auto codec = makeCodec<Terngrad>(64);
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

TEST_CASE("terngrad is unbiased and within TernGrad's variance") {
  constexpr int kTrials = 4000;
  for (uint32_t d : {64u, 7u}) {
    CAPTURE(d);
    const auto codec = makeCodec<Terngrad>(d);
    std::mt19937 rng(2024);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x;
    for (uint32_t i = 0; i < 4 * d; ++i) x.push_back(normal(rng));
    for (uint32_t i = 0; i < d; ++i) x.push_back(i % 3 == 0 ? -0.5f : 0.5f);
    for (uint32_t i = 0; i < d; ++i) x.push_back(i == 5 ? 40.0f : 0.1f * normal(rng));
    for (uint32_t i = 0; i < d; ++i) x.push_back(i % 4 == 0 ? 0.0f : (i % 4 == 1 ? 1.0f : -1e-3f));
    for (uint32_t i = 0; i < d / 3 + 1; ++i) x.push_back(1e-30f * normal(rng));
    const size_t n = x.size();
    const ConstTensor input{x.data(), n, DType::kF32};
    std::vector<double> sum(n, 0.0), squared_error(n, 0.0);
    std::vector<float> out(n);
    for (int t = 0; t < kTrials; ++t) {
      const auto p = encodeOne(*codec, makeContext(static_cast<uint64_t>(t), 1), input);
      REQUIRE(p[3] == 8);
      std::fill(out.begin(), out.end(), 0.0f);
      REQUIRE(codec->decodeChunk(p, 1.0f, out.data(), n).isOk());
      for (size_t i = 0; i < n; ++i) {
        const double e = static_cast<double>(out[i]) - x[i];
        sum[i] += out[i];
        squared_error[i] += e * e;
      }
    }
    double total_variance = 0.0, total_bound = 0.0;
    for (size_t i = 0; i < n; ++i) {
      CAPTURE(i);
      const size_t lo = i / d * d, hi = std::min(n, lo + d);
      double s = 0.0;
      for (size_t j = lo; j < hi; ++j) s = std::max(s, static_cast<double>(std::fabs(x[j])));
      const double a = std::fabs(static_cast<double>(x[i]));
      // TernGrad: value = sign * s * Bernoulli(|x| / s): variance s |x| - x^2.
      const double bound = s * a - a * a;
      const double sigma = std::sqrt(std::max(bound, 0.0));
      const double mean = sum[i] / kTrials;
      const double tolerance = 6.0 * sigma / std::sqrt(kTrials) + 1e-6 * a + 1e-37;
      REQUIRE_MESSAGE(std::fabs(mean - x[i]) <= tolerance,
                      "element " << i << ": x = " << x[i] << ", mean = " << mean);
      const double variance = squared_error[i] / kTrials;
      // The sample variance of kTrials Bernoulli draws: within ~6 standard errors of the bound.
      CHECK_MESSAGE(variance <= 1.25 * bound + 1e-12 * s * s + 6.0 * s * s / std::sqrt(kTrials),
                    "element " << i << ": variance " << variance << " bound " << bound);
      total_variance += variance;
      total_bound += bound;
    }
    CHECK(std::fabs(total_variance - total_bound) <= 0.05 * total_bound);
  }
}

}  // namespace test_terngrad
}  // namespace lightwire::kernels
