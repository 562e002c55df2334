// The `signsgd` codec (docs/determinism.md §4.10, docs/wire-format.md): its plain per-element
// reference, the generic bucket codec tests (tests/kernels/bucket_codec_test_util.h: bytes against
// the reference, packing round trips, chunk and thread independence, error feedback, the non-finite
// escape and hostile payloads), and signsgd's own: decoded values against a plain mean-|g|
// reference.

#include <doctest.h>

#include <cfloat>
#include <cmath>
#include <utility>
#include <vector>

#include "kernels/codec.h"
#include "tests/kernels/bucket_codec_test_util.h"

namespace lightwire::kernels {
namespace test_signsgd {

using namespace bucket_test;

struct Signsgd {
  static constexpr const char* kName = "signsgd";
  static constexpr uint8_t kId = 9;
  static constexpr unsigned kBits = 1;
  static constexpr size_t kScales = 1;
  static constexpr bool kDefaultErrorFeedback = true;

  // scale = (float)(canonical sum of |x| / count).
  static std::vector<float> referenceScales(const float* x, size_t n) {
    const double sum =
        referenceSum(x, n, [](float v) { return std::fabs(static_cast<double>(v)); });
    return {static_cast<float>(sum / static_cast<double>(n))};
  }

  static uint32_t referenceCode(float x, size_t, const std::vector<float>&, const StepContext&) {
    return x < 0.0f ? 1 : 0;
  }

  static float referenceValue(uint32_t code, const std::vector<float>& s) {
    return code != 0 ? -s[0] : s[0];
  }

  static std::vector<float> badScales(size_t) { return nonFiniteOrNegative(); }

  // Every code is valid.
  static void hostileExtra(const std::vector<uint8_t>&, size_t, testing::HostileDecoder&) {}
};

LW_BUCKET_CODEC_TESTS(Signsgd, "signsgd")

TEST_CASE("signsgd decoded values are ±(mean |g|) of the bucket") {
  // Dyadic values: every fp64 sum is exact, so any summation order gives the mean.
  const auto codec = makeCodec<Signsgd>(6);
  const std::vector<float> x = {1.0f,   -2.0f, 0.5f,  -0.0f, 0.0f,  4.5f,   // mean 8/6
                                -1.0f,  -1.0f, -1.0f, -1.0f, -1.0f, -1.0f,  // mean 1
                                0.0f,   -0.0f, 0.0f,  0.0f,  -0.0f, 0.0f,   // mean 0
                                -0.25f, 0.75f};                             // mean 0.5
  const std::vector<float> means = {static_cast<float>(8.0 / 6.0), 1.0f, 0.0f, 0.5f};
  const auto p = encodeOne(*codec, makeContext(0), {x.data(), x.size(), DType::kF32});
  REQUIRE(p.size() == 20 + 16 + 3);
  std::vector<float> out(x.size(), 0.0f);
  REQUIRE(codec->decodeChunk(p, 1.0f, out.data(), out.size()).isOk());
  for (size_t i = 0; i < x.size(); ++i) {
    CAPTURE(i);
    const float m = means[i / 6];
    // +0 and -0 both have bit 0: +scale.
    const float expected = x[i] < 0.0f ? -m : m;
    CHECK(floatBits(out[i]) == floatBits(0.0f + expected));
  }
  // Sign bits: x < 0 only.
  CHECK(p[36] == 0xC2);  // elements 0..7: x[1], x[6], x[7] are negative (x[3] is -0)
  CHECK(p[37] == 0x0F);  // elements 8..11 negative, 12..15 zeros
  CHECK(p[38] == 0x04);  // element 18 = -0.25
}

TEST_CASE("signsgd mean uses the bucket's own count in a short last bucket") {
  const auto codec = makeCodec<Signsgd>(512);
  std::vector<float> x(515, 0.0f);
  for (size_t i = 0; i < 512; ++i) x[i] = 2.0f;
  x[512] = -3.0f, x[513] = 3.0f, x[514] = 0.0f;  // mean 2
  const auto p = encodeOne(*codec, makeContext(0), {x.data(), x.size(), DType::kF32});
  CHECK(loadF32(p.data() + 20) == 2.0f);
  CHECK(loadF32(p.data() + 24) == 2.0f);
  const auto out = decodeAll(*codec, {p}, x.size(), 0);
  CHECK(out[512] == -2.0f);
  CHECK(out[513] == 2.0f);
  CHECK(out[514] == 2.0f);
}

}  // namespace test_signsgd
}  // namespace lightwire::kernels
