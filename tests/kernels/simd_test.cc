// Highway vectorisation (kernels/simd): every target this CPU can run gives the bits of the scalar
// definitions — Philox words, canonical sums, fp16/bf16 casts, qsgd codes and decoding — and the
// codecs give the same payload bytes on every target.
#include <doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/half_bits.h"
#include "kernels/parallel.h"
#include "kernels/philox.h"
#include "kernels/reduce.h"
#include "kernels/simd/kernels.h"
#include "kernels/simd/targets.h"
#include "tests/kernels/test_util.h"

namespace test_simd {

using namespace lightwire::kernels;

namespace {

// The scalar definitions the vector code must reproduce (written from docs/determinism.md).
double refBlockSum(const float* x, size_t n, int term) {
  double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (size_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    const double t = term == 0 ? v * v : term == 1 ? std::fabs(v) : v;
    a[i & 7] = a[i & 7] + t;
  }
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// §4.5 step 3, all fp32: F = s / norm (FLT_MAX for +Inf), r = |x| * F, level = floor(r) + (u < p).
uint8_t refQuantize(float x, uint16_t h, float norm, uint32_t s, unsigned shift) {
  float f = static_cast<float>(s) / norm;
  if (std::isinf(f)) f = std::numeric_limits<float>::max();
  const float r = std::fabs(x) * f;
  const float fl = std::floor(r);
  const float p = r - fl;
  const float u = static_cast<float>(h) / 65536.0f;
  uint32_t level = static_cast<uint32_t>(fl) + (u < p ? 1u : 0u);
  if (level > s) level = s;
  return static_cast<uint8_t>(((x < 0.0f ? 1u : 0u) << shift) | level);
}

uint32_t bitsOf(float f) { return std::bit_cast<uint32_t>(f); }
uint64_t bitsOf(double d) { return std::bit_cast<uint64_t>(d); }

// Floats worth testing: specials, boundaries of the half range, random bit patterns.
std::vector<uint32_t> interestingFloatBits(size_t random_count, uint64_t seed) {
  std::vector<uint32_t> v;
  for (uint32_t hi = 0; hi < 0x200u; ++hi) {  // every sign/exponent
    for (uint32_t lo :
         {0u, 1u, 0xFFFu, 0x1000u, 0x1001u, 0x2000u, 0x3000u, 0x7FFFu, 0x8000u, 0x8001u, 0x18000u,
          0x400000u, 0x7FE000u, 0x7FEFFFu, 0x7FF000u, 0x7FFFFFu, 0x12345u}) {
      v.push_back((hi << 23) | lo);
    }
  }
  std::mt19937_64 gen(seed);
  for (size_t i = 0; i < random_count; ++i) v.push_back(static_cast<uint32_t>(gen()));
  return v;
}

}  // namespace

TEST_CASE("simd: this CPU runs at least one Highway target and forcing one takes effect") {
  const auto targets = simd::availableTargets();
  REQUIRE(!targets.empty());
  std::string names;
  for (int64_t t : targets) names += simd::targetName(t) + " ";
  MESSAGE("Highway targets available here: " << names);
  for (int64_t t : targets) {
    simd::ScopedTargetForTest force(t);
    CHECK(simd::currentTarget() == t);
  }
  CHECK(simd::currentTarget() == targets.front());
}

TEST_CASE("simd: Philox batch equals scalar philoxBlock on every target") {
  std::mt19937_64 gen(7);
  for (int64_t t : simd::availableTargets()) {
    simd::ScopedTargetForTest force(t);
    CAPTURE(simd::targetName(t));
    for (int trial = 0; trial < 40; ++trial) {
      const std::array<uint32_t, 3> head = {
          static_cast<uint32_t>(gen()), static_cast<uint32_t>(gen()), static_cast<uint32_t>(gen())};
      const std::array<uint32_t, 2> key = {static_cast<uint32_t>(gen()),
                                           static_cast<uint32_t>(gen())};
      // Counter word 3 wraps at 2^32: start some batches just below it.
      const uint64_t g0 = trial % 3 == 0 ? 0xFFFFFFF0u + (gen() % 8) : gen() % (uint64_t{1} << 40);
      const size_t count = gen() % 70;
      std::vector<uint32_t> out(4 * count + 1, 0xDEADBEEFu);
      philoxBlocks(head, key, g0, count, out.data());
      for (size_t k = 0; k < count; ++k) {
        const auto want =
            philoxBlock({head[0], head[1], head[2], static_cast<uint32_t>(g0 + k)}, key);
        for (int j = 0; j < 4; ++j) REQUIRE(out[4 * k + j] == want[j]);
      }
      CHECK(out[4 * count] == 0xDEADBEEFu);  // nothing written past the end
    }
    // A long batch, and PhiloxStream::words from unaligned starts.
    const PhiloxStream rng(42, tensorNameKey("w"), 3, 1, RandomPurpose::kQsgdRounding);
    std::vector<uint32_t> w(5000);
    for (uint64_t first : {uint64_t{0}, uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{4099},
                           (uint64_t{1} << 34) - 5}) {
      for (size_t len : {size_t{0}, size_t{1}, size_t{3}, size_t{5}, size_t{64}, size_t{4999}}) {
        rng.words(first, len, w.data());
        for (size_t k = 0; k < len; ++k) REQUIRE(w[k] == rng.word(first + k));
      }
    }
  }
}

TEST_CASE("simd: canonical block sums are the scalar definition's bits on every target") {
  std::mt19937_64 gen(11);
  std::vector<float> x(kReduceBlock);
  for (auto& v : x) v = std::ldexp(static_cast<float>(gen() % 2000000) - 1e6f, -int(gen() % 40));
  x[17] = -0.0f;
  x[100] = 3.0e38f;
  x[101] = -3.0e38f;
  x[555] = 1e-45f;
  for (int64_t t : simd::availableTargets()) {
    simd::ScopedTargetForTest force(t);
    CAPTURE(simd::targetName(t));
    for (size_t n :
         {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{15}, size_t{16}, size_t{17},
          size_t{100}, size_t{511}, size_t{512}, size_t{4095}, size_t{4096}}) {
      for (size_t off : {size_t{0}, size_t{1}, size_t{3}}) {
        if (off + n > x.size()) continue;
        const float* p = x.data() + off;
        CHECK(bitsOf(canonicalBlockSum(p, n, ReduceTerm::kSquare)) == bitsOf(refBlockSum(p, n, 0)));
        CHECK(bitsOf(canonicalBlockSum(p, n, ReduceTerm::kAbs)) == bitsOf(refBlockSum(p, n, 1)));
        CHECK(bitsOf(canonicalBlockSum(p, n, ReduceTerm::kValue)) == bitsOf(refBlockSum(p, n, 2)));
      }
    }
    // Whole tensors, with and without a stream.
    const auto g = testing::gaussian(3 * kReduceBlock + 123, 5);
    double want = 0;
    for (size_t b = 0; b < g.size(); b += kReduceBlock) {
      want = want + refBlockSum(g.data() + b, std::min(kReduceBlock, g.size() - b), 0);
    }
    CpuStream stream(2);
    std::vector<double> block_sums(4);
    CHECK(bitsOf(canonicalSum(g.data(), g.size(), ReduceTerm::kSquare)) == bitsOf(want));
    CHECK(bitsOf(canonicalSum(g.data(), g.size(), ReduceTerm::kSquare, &stream, block_sums)) ==
          bitsOf(want));
  }
}

TEST_CASE("simd: fp16 and bf16 conversions are the scalar bit manipulation on every target") {
  const auto in_bits = interestingFloatBits(200000, 3);
  std::vector<float> in(in_bits.size());
  for (size_t i = 0; i < in.size(); ++i) in[i] = std::bit_cast<float>(in_bits[i]);
  const size_t n = in.size();
  for (int64_t t : simd::availableTargets()) {
    simd::ScopedTargetForTest force(t);
    CAPTURE(simd::targetName(t));
    std::vector<uint8_t> h(2 * n + 2), b(2 * n + 2);
    // Odd offsets: the tails and unaligned stores.
    simd::floatsToHalves(in.data() + 1, n - 1, h.data() + 2);
    simd::floatsToBf16s(in.data() + 1, n - 1, b.data() + 2);
    size_t bad_h = 0, bad_b = 0;
    for (size_t i = 1; i < n; ++i) {
      const uint16_t gh = static_cast<uint16_t>(h[2 * i] | (h[2 * i + 1] << 8));
      const uint16_t gb = static_cast<uint16_t>(b[2 * i] | (b[2 * i + 1] << 8));
      if (gh != bits::floatBitsToHalf(in_bits[i])) ++bad_h;
      if (gb != bits::floatBitsToBf16(in_bits[i])) ++bad_b;
    }
    CHECK(bad_h == 0);
    CHECK(bad_b == 0);

    // Long outputs take the non-temporal-store path; misaligned destinations take a scalar head.
    {
      const size_t big = (size_t{1} << 20) + 37;
      std::vector<float> src(big);
      for (size_t i = 0; i < big; ++i) src[i] = in[i % n];
      for (const size_t shift : {size_t{0}, size_t{2}, size_t{6}}) {
        std::vector<uint8_t> bh(2 * big + 8), bb(2 * big + 8);
        simd::floatsToHalves(src.data(), big, bh.data() + shift);
        simd::floatsToBf16s(src.data(), big, bb.data() + shift);
        size_t bad = 0;
        for (size_t i = 0; i < big; ++i) {
          const uint8_t* ph = bh.data() + shift + 2 * i;
          const uint8_t* pb = bb.data() + shift + 2 * i;
          bad += static_cast<uint16_t>(ph[0] | (ph[1] << 8)) !=
                 bits::floatBitsToHalf(bits::asBits(src[i]));
          bad += static_cast<uint16_t>(pb[0] | (pb[1] << 8)) !=
                 bits::floatBitsToBf16(bits::asBits(src[i]));
        }
        CHECK_MESSAGE(bad == 0, "destination offset " << shift);
      }
    }

    // Decoding: every 16-bit pattern, accumulated into non-zero outputs with a weight.
    std::vector<uint8_t> all(2 * 65536);
    for (uint32_t v = 0; v < 65536; ++v) {
      all[2 * v] = static_cast<uint8_t>(v);
      all[2 * v + 1] = static_cast<uint8_t>(v >> 8);
    }
    for (const float weight : {1.0f, 0.375f, -3.0f}) {
      std::vector<float> oh(65536), ob(65536), wh(65536), wb(65536);
      for (uint32_t v = 0; v < 65536; ++v) {
        oh[v] = ob[v] = wh[v] = wb[v] = static_cast<float>(int(v % 7) - 3) * 0.5f;
        wh[v] = wh[v] + weight * std::bit_cast<float>(bits::halfToFloatBits(uint16_t(v)));
        wb[v] = wb[v] + weight * std::bit_cast<float>(bits::bf16ToFloatBits(uint16_t(v)));
      }
      simd::accumulateHalves(all.data(), 65536, weight, oh.data());
      simd::accumulateBf16s(all.data(), 65536, weight, ob.data());
      size_t bad = 0;
      for (uint32_t v = 0; v < 65536; ++v) {
        bad += bitsOf(oh[v]) != bitsOf(wh[v]);
        bad += bitsOf(ob[v]) != bitsOf(wb[v]);
      }
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("simd: qsgd codes equal the specification's fp32 arithmetic on every target") {
  // Random elements plus the boundaries: u = p exactly (F = 1 or 1/2, |x| = fl + h / 2^16), r an
  // exact integer, |x| = norm (min clamps), norms whose F overflows to FLT_MAX or is tiny,
  // subnormal x (p > 0 = u for h = 0), ±0; each next to random lanes.
  std::mt19937_64 gen(99);
  std::vector<float> x, norms;
  std::vector<uint16_t> h;
  const uint32_t s_values[] = {127u, 7u, 1u};
  auto push = [&](float xv, uint32_t hv, float nv) {
    x.push_back(xv);
    h.push_back(static_cast<uint16_t>(hv));
    norms.push_back(nv);
  };
  auto random_h = [&] { return static_cast<uint32_t>(gen() & 0xFFFFu); };
  for (int b = 0; b < 4000; ++b) {  // buckets of 1..100 elements, norms over the whole range
    const int e = b % 10 == 0 ? int(gen() % 250) - 125 : int(gen() % 60) - 30;
    const float norm = std::ldexp(1.0f + float(gen() % 1000) / 1000.0f, e);
    const int len = 1 + int(gen() % 100);
    for (int i = 0; i < len; ++i) {
      const float frac = float(gen() % 1000001) / 1000000.0f;
      push((gen() & 1 ? -1.0f : 1.0f) * norm * frac, random_h(), norm);
    }
  }
  const float flt_max = std::numeric_limits<float>::max();
  // Each boundary family in long runs of one norm, so that the vector path sees them.
  for (const float norm : {127.0f, 1.0f, 3.0f, 0.1f, 1e-30f, 5e37f, 1e38f, flt_max, 1e-35f, 1e-39f,
                           1e-44f, 127.0f / flt_max, std::nextafter(127.0f / flt_max, 0.0f),
                           std::nextafter(127.0f / flt_max, 1.0f)}) {
    for (int k = 0; k <= 127; ++k) {  // r integral or nearly, |x| = norm at k = 127
      // <= norm (1 + 2^-23); min: 127 * (FLT_MAX / 127) rounds to +Inf
      const float xv = std::min(static_cast<float>(k) * (norm / 127.0f), norm);
      push(xv, random_h(), norm);
      push(-xv, 0u, norm);
      push(xv, 0xFFFFu, norm);
      push(std::nextafter(xv, 0.0f), random_h(), norm);
      if (xv < flt_max) push(std::nextafter(xv, flt_max), random_h(), norm);
      push(-norm, random_h(), norm);
      push(norm, 0u, norm);
    }
  }
  for (const uint32_t s : s_values) {  // u = p exactly: F = 1 (norm = s) or 1/2 (norm = 2s)
    for (const float scale : {1.0f, 2.0f}) {
      const float norm = scale * static_cast<float>(s);
      for (int i = 0; i < 3000; ++i) {
        const uint32_t fl = static_cast<uint32_t>(gen() % s), hv = random_h();
        const float xv = scale * (static_cast<float>(fl) + static_cast<float>(hv) / 65536.0f);
        push(xv, hv, norm);                           // u = p: level fl
        push(-xv, hv == 0 ? 0u : hv - 1, norm);       // u < p (unless p = 0): fl + 1
        push(xv, hv == 0xFFFFu ? hv : hv + 1, norm);  // u > p: fl
      }
    }
  }
  for (const float norm : {1.0f, std::ldexp(1024.0f, -149)}) {  // subnormal x
    for (int i = 0; i < 1000; ++i) {
      const float xv = std::ldexp(static_cast<float>(gen() % 1024), -149);
      push(i % 4 < 2 ? xv : -xv, i % 3 == 0 ? 0u : random_h(), norm);
    }
  }
  for (int i = 0; i < 1000; ++i) push(i % 2 ? 0.0f : -0.0f, random_h(), 2.0f);
  const size_t n = x.size();
  // The halves as the codec reads them: a run of u32 words viewed as uint16_t (little-endian),
  // starting at half 0 or half 1 of its first word.
  static_assert(std::endian::native == std::endian::little);
  std::vector<uint32_t> words(n / 2 + 2);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t shift =
        16 * ((i + 1) % 2);  // element i is half (i + 1) mod 2 of word (i + 1) / 2
    words[(i + 1) / 2] |= uint32_t{h[i]} << shift;
  }
  for (int64_t t : simd::availableTargets()) {
    simd::ScopedTargetForTest force(t);
    CAPTURE(simd::targetName(t));
    for (const uint32_t s : s_values) {
      const unsigned shift = s == 127 ? 7 : s == 7 ? 3 : 1;
      // Runs of equal norm are one bucket each (the kernel's unit); the halves from the packed
      // words (odd and even starts) or from the plain array.
      std::vector<uint8_t> codes(n);
      const auto* halves = reinterpret_cast<const uint16_t*>(words.data()) + 1;
      for (size_t i = 0, run = 0; i < n; ++run) {
        size_t j = i + 1;
        while (j < n && norms[j] == norms[i]) ++j;
        const uint16_t* hp = run % 2 ? halves + i : h.data() + i;
        REQUIRE(std::equal(hp, hp + (j - i), h.data() + i));
        simd::qsgdQuantize(x.data() + i, hp, j - i, norms[i], s, shift, codes.data() + i);
        i = j;
      }
      size_t bad = 0, first = n;
      for (size_t i = 0; i < n; ++i) {
        if (codes[i] != refQuantize(x[i], h[i], norms[i], s, shift) && bad++ == 0) first = i;
      }
      CHECK_MESSAGE(bad == 0, bad << " codes differ (s = " << s << "), first at " << first);

      // Decoding the codes back.
      std::vector<float> scales(n), out(n, 0.25f), want(n, 0.25f);
      for (size_t i = 0; i < n; ++i) scales[i] = norms[i] / static_cast<float>(s);
      simd::qsgdDequantize(codes.data(), scales.data(), n, s, shift, 0.5f, out.data());
      size_t bad_dec = 0;
      for (size_t i = 0; i < n; ++i) {
        const float v = static_cast<float>(codes[i] & s) * scales[i];
        want[i] = want[i] + 0.5f * ((codes[i] >> shift) != 0 ? -v : v);
        bad_dec += bitsOf(out[i]) != bitsOf(want[i]);
      }
      CHECK(bad_dec == 0);
    }
  }
}

TEST_CASE("simd: fp16, bf16 and qsgd payloads and decodings are identical on every target") {
  const auto targets = simd::availableTargets();
  const size_t n = 100003;
  auto x = testing::gaussian(n, 21);
  for (size_t i = 0; i < n; i += 97) x[i] = 0.0f;  // zero elements (and a zero bucket below)
  for (size_t i = 600; i < 700; ++i) x[i] = 0.0f;
  x[5] = 1e-42f;
  x[6] = 70000.0f;
  const std::vector<CodecConfig> configs = {
      {.name = "fp16"},
      {.name = "bf16"},
      {.name = "qsgd", .bits = 8},
      {.name = "qsgd", .bits = 4, .bucket_size = 100},
      {.name = "qsgd", .bits = 2, .bucket_size = 3},
      {.name = "qsgd", .bits = 8, .bucket_size = 50},
  };
  CpuStream stream(2);
  for (const CodecConfig& config : configs) {
    CAPTURE(testing::describe(config));
    auto codec = testing::make(config);
    const Chunking chunking = chunkingFor(*codec, n, 30000);
    StepContext ctx;
    ctx.seed = 5;
    ctx.name_key = tensorNameKey("layer.simd");
    ctx.step = 9;
    ctx.rank = 1;
    ctx.stream = &stream;
    std::vector<std::vector<uint8_t>> first_payloads;
    std::vector<float> first_out;
    for (int64_t t : targets) {
      simd::ScopedTargetForTest force(t);
      CAPTURE(simd::targetName(t));
      CodecState state(codec->stateFloats(n));
      auto payloads = encodeTensor(*codec, ctx, chunking, {x.data(), n, DType::kF32}, state);
      REQUIRE(payloads.isOk());
      std::vector<float> out(n, 1.0f);
      REQUIRE(decodeTensor(*codec, chunking, *payloads, 0.5f, out.data()).isOk());
      if (first_payloads.empty()) {
        first_payloads = *payloads;
        first_out = out;
        continue;
      }
      CHECK(*payloads == first_payloads);
      CHECK(testing::bitEqual(out, first_out));
    }
  }
}

TEST_CASE(
    "simd: dense fp32 sums, decodes and the non-finite scan are the scalar bits on every "
    "target") {
  // Every sign and exponent (NaNs with payloads, Infs, −0, subnormals) and random patterns, as
  // little-endian bytes at an odd offset (payload bodies follow a 16-byte header, but any
  // alignment must work), lengths that leave a scalar tail.
  const auto a_bits = interestingFloatBits(3001, 5);
  auto b_bits = interestingFloatBits(3001, 6);
  std::reverse(b_bits.begin(), b_bits.end());
  const size_t n = a_bits.size() - 3;
  std::vector<uint8_t> a(4 * n + 1), b(4 * n + 1);
  std::memcpy(a.data() + 1, a_bits.data(), 4 * n);
  std::memcpy(b.data() + 1, b_bits.data(), 4 * n);
  auto at = [](const std::vector<uint8_t>& v, size_t i) {
    float f;
    std::memcpy(&f, v.data() + 1 + 4 * i, 4);
    return f;
  };
  const float w = 0.125f;
  std::vector<float> base(n);
  for (size_t i = 0; i < n; ++i) base[i] = static_cast<float>(i % 97) - 48.5f;
  for (int64_t t : simd::availableTargets()) {
    simd::ScopedTargetForTest force(t);
    CAPTURE(simd::targetName(t));
    for (size_t len : {n, size_t{5}, size_t{0}}) {
      std::vector<uint8_t> sum(4 * len + 1, 0xAB);
      simd::addFloats(a.data() + 1, b.data() + 1, len, sum.data() + 1);
      std::vector<float> acc(base.begin(), base.begin() + len), into(len, 99.0f);
      simd::accumulateFloats(a.data() + 1, len, w, acc.data());
      simd::scaleFloats(a.data() + 1, len, w, into.data());
      for (size_t i = 0; i < len; ++i) {
        CAPTURE(i);
        REQUIRE(bitsOf(at(sum, i)) == bitsOf(at(a, i) + at(b, i)));
        REQUIRE(bitsOf(acc[i]) == bitsOf(base[i] + w * at(a, i)));
        REQUIRE(bitsOf(into[i]) == bitsOf(0.0f + w * at(a, i)));
      }
      // In place: `out` is `a`.
      std::vector<uint8_t> inplace(a.begin(), a.begin() + 4 * len + 1);
      simd::addFloats(inplace.data() + 1, b.data() + 1, len, inplace.data() + 1);
      CHECK(std::equal(inplace.begin() + 1, inplace.end(), sum.begin() + 1));
    }
    // One Inf or NaN anywhere (vector body or tail) is found; finite values never are.
    std::vector<float> x(1003, 1.5f);
    x[500] = -0.0f;
    x[7] = std::numeric_limits<float>::max();
    x[8] = std::numeric_limits<float>::denorm_min();
    CHECK(!simd::anyNonfinite(x.data(), x.size()));
    CHECK(!simd::anyNonfinite(x.data(), 0));
    for (size_t pos : {size_t{0}, size_t{9}, size_t{512}, size_t{1002}}) {
      for (float bad :
           {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
            std::numeric_limits<float>::quiet_NaN()}) {
        auto y = x;
        y[pos] = bad;
        CHECK(simd::anyNonfinite(y.data(), y.size()));
        CHECK(simd::anyNonfinite(y.data() + pos, 1));
        CHECK(!simd::anyNonfinite(y.data(), pos));
      }
    }
  }
}

TEST_CASE(
    "simd: widening fp16 and bf16 is the scalar conversion on every target (fp16's "
    "signalling NaNs may come out quiet)") {
  // Every 16-bit pattern, at an odd byte offset.
  std::vector<uint8_t> src(2 * 65536 + 1);
  for (uint32_t h = 0; h < 65536; ++h) {
    src[1 + 2 * h] = static_cast<uint8_t>(h);
    src[2 + 2 * h] = static_cast<uint8_t>(h >> 8);
  }
  for (int64_t t : simd::availableTargets()) {
    simd::ScopedTargetForTest force(t);
    CAPTURE(simd::targetName(t));
    std::vector<float> halves(65536), bf16s(65536);
    simd::halvesToFloats(src.data() + 1, 65536, halves.data());
    simd::bf16sToFloats(src.data() + 1, 65536, bf16s.data());
    for (uint32_t h = 0; h < 65536; ++h) {
      CAPTURE(h);
      // A signalling NaN may come out quiet (vcvtph2ps), never otherwise different.
      const uint32_t want = bits::halfToFloatBits(static_cast<uint16_t>(h));
      const bool snan = (want & 0x7F800000u) == 0x7F800000u && (want & 0x007FFFFFu) != 0 &&
                        (want & 0x00400000u) == 0;
      REQUIRE((bitsOf(halves[h]) == want || (snan && bitsOf(halves[h]) == (want | 0x00400000u))));
      REQUIRE(bitsOf(bf16s[h]) == bits::bf16ToFloatBits(static_cast<uint16_t>(h)));
    }
  }
}

}  // namespace test_simd
