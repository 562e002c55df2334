// The `onebit` codec (docs/determinism.md §4.11, docs/wire-format.md): its plain per-element
// reference, the generic bucket codec tests (tests/kernels/bucket_codec_test_util.h: bytes against
// the reference, packing round trips, chunk and thread independence, error feedback, the non-finite
// escape and hostile payloads), and onebit's own: decoded values against plain positive/negative
// means, empty halves and kept bucket sums.

#include <doctest.h>

#include <cfloat>
#include <cmath>
#include <utility>
#include <vector>

#include "kernels/codec.h"
#include "tests/kernels/bucket_codec_test_util.h"

namespace lightwire::kernels {
namespace test_onebit {

using namespace bucket_test;

struct Onebit {
  static constexpr const char* kName = "onebit";
  static constexpr uint8_t kId = 10;
  static constexpr unsigned kBits = 1;
  static constexpr size_t kScales = 2;
  static constexpr bool kDefaultErrorFeedback = true;

  // pos = mean of the elements with bit 0 (x >= 0, -0, NaN), neg = mean of those with x < 0; +0
  // when a half is empty.
  static std::vector<float> referenceScales(const float* x, size_t n) {
    const double p =
        referenceSum(x, n, [](float v) { return v < 0.0f ? 0.0 : static_cast<double>(v); });
    const double q =
        referenceSum(x, n, [](float v) { return v < 0.0f ? static_cast<double>(v) : 0.0; });
    size_t negatives = 0;
    for (size_t i = 0; i < n; ++i) negatives += x[i] < 0.0f ? 1 : 0;
    const size_t positives = n - negatives;
    return {positives > 0 ? static_cast<float>(p / static_cast<double>(positives)) : 0.0f,
            negatives > 0 ? static_cast<float>(q / static_cast<double>(negatives)) : 0.0f};
  }

  static uint32_t referenceCode(float x, size_t, const std::vector<float>&, const StepContext&) {
    return x < 0.0f ? 1 : 0;
  }

  static float referenceValue(uint32_t code, const std::vector<float>& s) {
    return code != 0 ? s[1] : s[0];
  }

  static std::vector<float> badScales(size_t j) {
    if (j == 0) return nonFiniteOrNegative();
    return {NAN, -NAN, INFINITY, -INFINITY, 1.0f, FLT_TRUE_MIN, FLT_MAX};
  }

  // Every code is valid.
  static void hostileExtra(const std::vector<uint8_t>&, size_t, testing::HostileDecoder&) {}
};

LW_BUCKET_CODEC_TESTS(Onebit, "onebit")

TEST_CASE("onebit decoded values are the means of the non-negative and negative elements") {
  // Dyadic values: every fp64 sum is exact, so any summation order gives the means.
  const auto codec = makeCodec<Onebit>(6);
  const std::vector<float> x = {
      1.0f,   -2.0f, 0.5f,  -0.0f, 0.0f,  4.5f,   // pos 6/5 (±0 count), neg -2
      -1.0f,  -1.5f, -1.0f, -1.0f, -1.0f, -1.5f,  // pos +0 (empty), neg -7/6
      0.0f,   -0.0f, 0.0f,  3.0f,  -0.0f, 0.0f,   // pos 0.5, neg +0 (empty)
      -0.25f, 0.75f};                             // pos 0.75, neg -0.25
  const std::vector<std::pair<double, double>> means = {
      {6.0 / 5.0, -2.0}, {0.0, -7.0 / 6.0}, {0.5, 0.0}, {0.75, -0.25}};
  const auto p = encodeOne(*codec, makeContext(0), {x.data(), x.size(), DType::kF32});
  REQUIRE(p.size() == 20 + 32 + 3);
  for (size_t k = 0; k < 4; ++k) {
    CHECK(floatBits(loadF32(p.data() + 20 + 8 * k)) ==
          floatBits(static_cast<float>(means[k].first)));
    CHECK(floatBits(loadF32(p.data() + 24 + 8 * k)) ==
          floatBits(static_cast<float>(means[k].second)));
  }
  // Empty halves are +0, never -0.
  CHECK(floatBits(loadF32(p.data() + 28)) == 0u);
  CHECK(floatBits(loadF32(p.data() + 40)) == 0u);
  std::vector<float> out(x.size(), 0.0f);
  REQUIRE(codec->decodeChunk(p, 1.0f, out.data(), out.size()).isOk());
  for (size_t i = 0; i < x.size(); ++i) {
    CAPTURE(i);
    const auto [pos, neg] = means[i / 6];
    // -0 is in the non-negative half.
    const float expected = static_cast<float>(x[i] < 0.0f ? neg : pos);
    CHECK(floatBits(out[i]) == floatBits(0.0f + expected));
  }
  CHECK(p[52] == 0xC2);  // elements 0..7: x[1], x[6], x[7] are negative (x[3] is -0)
  CHECK(p[53] == 0x0F);
  CHECK(p[54] == 0x04);
}

TEST_CASE("onebit keeps each bucket's sum; tiny means stay non-zero") {
  const auto codec = makeCodec<Onebit>(512);
  const std::vector<float> x = randomTensor(5000, 77);
  const auto p = encodeOne(*codec, makeContext(0), {x.data(), x.size(), DType::kF32});
  const auto out = decodeAll(*codec, {p}, x.size(), 0);
  for (size_t lo = 0; lo < x.size(); lo += 512) {
    double in = 0.0, sent = 0.0, mag = 0.0;
    for (size_t i = lo; i < std::min(x.size(), lo + 512); ++i) {
      in += x[i];
      sent += out[i];
      mag += std::fabs(x[i]);
    }
    CHECK(std::fabs(in - sent) <= 1e-5 * mag);
  }
  // A mean of values of magnitude >= FLT_TRUE_MIN never rounds to 0.
  const std::vector<float> tiny = {-FLT_TRUE_MIN, 0.0f, -0.0f, FLT_TRUE_MIN, -2 * FLT_TRUE_MIN};
  const auto c5 = makeCodec<Onebit>(5);
  const auto pt = encodeOne(*c5, makeContext(0), {tiny.data(), tiny.size(), DType::kF32});
  CHECK(pt == referenceChunk<Onebit>(tiny, 0, tiny.size(), 5, makeContext(0), DType::kF32));
  CHECK(loadF32(pt.data() + 20) == 0.0f);               // (0 + 0 + 1e-45) / 3 rounds to 0
  CHECK(loadF32(pt.data() + 24) == -2 * FLT_TRUE_MIN);  // -3e-45 / 2 = -1.5 ulp: to even, -2
  std::vector<float> o(5, 1.0f);
  REQUIRE(c5->decodeChunk(pt, 1.0f, o.data(), o.size()).isOk());
  CHECK(o == std::vector<float>(5, 1.0f));
}

}  // namespace test_onebit
}  // namespace lightwire::kernels
