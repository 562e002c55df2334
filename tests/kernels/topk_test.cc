// topk (docs/determinism.md §4.2–4.3) and the sparse layout it shares with dgc
// (docs/wire-format.md "Sparse layout"), including the decoder's handling of hostile payloads.

#include <doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include <hwy/targets.h>

#include "kernels/codec.h"
#include "kernels/dtype.h"
#include "kernels/parallel.h"
#include "kernels/payload.h"
#include "kernels/registry.h"
#include "kernels/select.h"

namespace lightwire::kernels {
namespace test_topk {

using Bytes = std::vector<uint8_t>;

uint32_t keyOf(float x) { return floatBits(x) & 0x7FFFFFFFu; }

/// §4.2, written independently of the codec.
size_t expectedK(size_t n, double d) {
  if (n == 0) return 0;
  const double r = std::floor(d * static_cast<double>(n) + 0.5);
  return std::min<size_t>(n, std::max<double>(1.0, r));
}

/// The reference selection: std::nth_element on (key descending, index ascending).
std::vector<size_t> referenceTopk(const std::vector<float>& x, size_t k) {
  std::vector<size_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), size_t{0});
  auto before = [&](size_t a, size_t b) {
    const uint32_t ka = keyOf(x[a]), kb = keyOf(x[b]);
    return ka != kb ? ka > kb : a < b;
  };
  if (k < idx.size()) std::nth_element(idx.begin(), idx.begin() + k, idx.end(), before);
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

std::unique_ptr<Codec> makeTopk(std::optional<double> density, std::optional<double> ratio = {},
                                DType values = DType::kF32, bool error_feedback = false) {
  CodecConfig c;
  c.name = "topk";
  c.density = density;
  c.ratio = ratio;
  c.sparse_values = values;
  c.error_feedback = error_feedback;
  auto codec = createCodec(c);
  REQUIRE_MESSAGE(codec.isOk(), codec.status().message());
  return std::move(codec).value();
}

std::vector<Bytes> encode(const Codec& codec, const std::vector<float>& x, size_t chunk,
                          unsigned threads = 1, CodecState* state_in = nullptr) {
  CpuStream stream(threads);
  StepContext ctx;
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

/// An independent reader of the sparse layout (bit by bit).
struct Sparse {
  uint64_t n = 0;
  uint8_t flags = 0;
  std::vector<uint64_t> indices;
  std::vector<float> values;
};

Sparse parseSparse(const Bytes& p) {
  REQUIRE(p.size() >= 24);
  Sparse s;
  s.n = loadU64(p.data() + 8);
  s.flags = p[5];
  const uint32_t nnz = loadU32(p.data() + 16);
  const unsigned w = p[20];
  const size_t g = ((size_t{nnz} * w + 7) / 8 + 3) / 4 * 4;
  const size_t vsize = (s.flags & 1) ? 2 : 4;
  REQUIRE(p.size() == 24 + g + vsize * nnz);
  uint64_t bit = 0;
  int64_t prev = -1;
  for (uint32_t j = 0; j < nnz; ++j) {
    uint64_t gap = 0;
    for (unsigned b = 0; b < w; ++b, ++bit)
      gap |= uint64_t((p[24 + bit / 8] >> (bit % 8)) & 1) << b;
    prev = prev + 1 + static_cast<int64_t>(gap);
    s.indices.push_back(static_cast<uint64_t>(prev));
    const uint8_t* v = p.data() + 24 + g + vsize * j;
    s.values.push_back(vsize == 2 ? halfToFloat(loadU16(v)) : loadF32(v));
  }
  for (; bit < 8 * g; ++bit) REQUIRE(((p[24 + bit / 8] >> (bit % 8)) & 1) == 0);
  return s;
}

/// Whole-tensor indices of all payloads of a chunking.
std::vector<size_t> selectedSet(const std::vector<Bytes>& payloads, size_t n, size_t chunk) {
  const Chunking chunking = Chunking::make(n, chunk, 1);
  std::vector<size_t> all;
  for (size_t c = 0; c < payloads.size(); ++c) {
    for (uint64_t i : parseSparse(payloads[c]).indices) all.push_back(chunking.begin(c) + i);
  }
  return all;
}

std::vector<float> gaussian(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist;
  std::vector<float> x(n);
  for (auto& v : x) v = dist(rng);
  return x;
}

/// Values from a small set, so keys tie a lot (signs differ: -3 and 3 tie).
std::vector<float> tied(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-3, 3);
  std::vector<float> x(n);
  for (auto& v : x) v = static_cast<float>(dist(rng));
  return x;
}

const size_t kSizes[] = {0, 1, 2, 3, 17, 1000, 100003, 300000};

TEST_CASE("topk selects the k largest magnitudes with ties to lower indices (density)") {
  for (size_t n : kSizes) {
    for (double d : {0.001, 0.01, 0.3, 0.999, 1.0}) {
      for (int data = 0; data < 2; ++data) {
        const auto x = data == 0 ? gaussian(n, 7 + n) : tied(n, 9 + n);
        const auto codec = makeTopk(d);
        const auto payloads = encode(*codec, x, 0);
        CAPTURE(n);
        CAPTURE(d);
        CAPTURE(data);
        CHECK(selectedSet(payloads, n, 0) == referenceTopk(x, expectedK(n, d)));
      }
    }
  }
}

TEST_CASE("topk selects the k largest magnitudes with ties to lower indices (ratio)") {
  for (size_t n : kSizes) {
    for (double r : {1.0, 2.0, 3.0, 100.0, 1000.0}) {
      for (int data = 0; data < 2; ++data) {
        const auto x = data == 0 ? gaussian(n, 3 + n) : tied(n, 5 + n);
        const auto codec = makeTopk(std::nullopt, r);
        CAPTURE(n);
        CAPTURE(r);
        CHECK(selectedSet(encode(*codec, x, 0), n, 0) == referenceTopk(x, expectedK(n, 1.0 / r)));
      }
    }
  }
}

TEST_CASE("topk is exact on inputs laid out against a strided sample") {
  // Every 64th element differs from the rest (zero, or huge), sorted runs, and a periodic
  // pattern: whatever a sample of the tensor suggests, the selection must stay exact.
  const size_t n = size_t{1} << 20;
  const auto base = gaussian(n, 53);
  std::vector<std::vector<float>> inputs;
  for (float special : {0.0f, 1e30f}) {
    auto x = base;
    for (size_t i = 0; i < n; i += 64) x[i] = special;
    inputs.push_back(x);
  }
  auto sorted = base;
  std::sort(sorted.begin(), sorted.end());
  inputs.push_back(sorted);
  std::vector<float> periodic(n);
  for (size_t i = 0; i < n; ++i) periodic[i] = static_cast<float>(i % 97) - 48.0f;
  inputs.push_back(periodic);
  for (size_t which = 0; which < inputs.size(); ++which) {
    for (double d : {0.001, 0.01, 0.05, 0.3}) {
      CAPTURE(which);
      CAPTURE(d);
      CHECK(selectedSet(encode(*makeTopk(d), inputs[which], 0, 2), n, 0) ==
            referenceTopk(inputs[which], expectedK(n, d)));
    }
  }
}

TEST_CASE("topk with k = n sends every element, zeros included") {
  std::vector<float> x = {0.0f, -0.0f, 1.0f, 0.0f, -2.5f};
  const auto payloads = encode(*makeTopk(1.0), x, 0);
  const Sparse s = parseSparse(payloads[0]);
  CHECK(s.indices == std::vector<uint64_t>{0, 1, 2, 3, 4});
  CHECK(payloads[0][20] == 0);  // every gap is 0
  for (size_t i = 0; i < x.size(); ++i) CHECK(floatBits(s.values[i]) == floatBits(x[i]));
}

TEST_CASE("topk payload bytes follow the sparse layout exactly") {
  // Indices 1 and 4: gaps 1, 2 -> w = 2, stream bits 01 then 10 -> byte 0x09, G padded to 4.
  const std::vector<float> x = {0.0f, 5.0f, 0.5f, 0.0f, -7.0f, 1.0f};
  const auto payloads = encode(*makeTopk(2.0 / 6.0), x, 0);
  REQUIRE(payloads.size() == 1);
  Bytes want = {0x4C, 0x57, 1, 3, 0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0,  // header
                2,    0,    0, 0, 2, 0, 0, 0,                          // nnz, w, reserved
                0x09, 0,    0, 0};                                     // gaps, padded
  Bytes v(8);
  storeF32(v.data(), 5.0f);
  storeF32(v.data() + 4, -7.0f);
  want.insert(want.end(), v.begin(), v.end());
  CHECK(payloads[0] == want);
}

TEST_CASE("topk payload at 1% density is well under 8 bytes per selected element") {
  const size_t n = 1000000;
  const auto x = gaussian(n, 11);
  const auto payloads = encode(*makeTopk(0.01), x, 0);
  const double per =
      static_cast<double>(payloads[0].size()) / static_cast<double>(expectedK(n, 0.01));
  CHECK(per < 6.0);  // wire-format.md: about 5.5 bytes with fp32 values
  const auto half = encode(*makeTopk(0.01, std::nullopt, DType::kF16), x, 0);
  CHECK(static_cast<double>(half[0].size()) / static_cast<double>(expectedK(n, 0.01)) < 4.0);
}

TEST_CASE("topk fp16 values round-trip as floatToHalfSaturating") {
  std::vector<float> x = gaussian(5000, 13);
  x[10] = 1e6f;           // saturates to 65504 (a finite value never becomes Inf)
  x[11] = -INFINITY;      // stays -Inf
  x[20] = std::nanf("");  // NaN is selected first
  x[30] = 3.0e-6f;        // subnormal in fp16; key small, so set density to take all
  const auto codec = makeTopk(1.0, std::nullopt, DType::kF16);
  const auto payloads = encode(*codec, x, 0);
  CHECK(payloads[0][5] == 1);  // flag: fp16 values
  CHECK(halfToFloat(floatToHalfSaturating(1e6f)) == 65504.0f);
  const Sparse s = parseSparse(payloads[0]);
  REQUIRE(s.indices.size() == x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    CHECK(floatBits(s.values[i]) == floatBits(halfToFloat(floatToHalfSaturating(x[i]))));
  }
  std::vector<float> out(x.size(), 0.0f);
  REQUIRE(decodeTensor(*codec, Chunking::make(x.size(), 0, 1), payloads, 1.0f, out.data()).isOk());
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = 0.0f + 1.0f * halfToFloat(floatToHalfSaturating(x[i]));
    CHECK((floatBits(out[i]) == floatBits(want) || (std::isnan(out[i]) && std::isnan(want))));
  }
}

TEST_CASE("topk selects NaN and Inf before every finite value") {
  std::vector<float> x(1000, 1.0f);
  x[500] = -std::numeric_limits<float>::infinity();
  x[900] = std::nanf("");
  const auto set = selectedSet(encode(*makeTopk(std::nullopt, 500.0), x, 0), x.size(), 0);
  CHECK(set == std::vector<size_t>{500, 900});
}

TEST_CASE("topk selects on the widened value of fp16 and bf16 input") {
  const auto x = gaussian(20000, 17);
  for (DType t : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> raw(x.size());
    std::vector<float> widened(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      raw[i] = t == DType::kF16 ? floatToHalf(x[i]) : floatToBf16(x[i]);
      widened[i] = t == DType::kF16 ? halfToFloat(raw[i]) : bf16ToFloat(raw[i]);
    }
    const auto codec = makeTopk(0.05);
    CpuStream stream(2);
    StepContext ctx;
    ctx.stream = &stream;
    CodecState state;
    auto payloads = encodeTensor(*codec, ctx, Chunking::make(x.size(), 3000, 1),
                                 ConstTensor{raw.data(), raw.size(), t}, state);
    REQUIRE(payloads.isOk());
    CHECK((*payloads)[0][4] == static_cast<uint8_t>(t));
    CHECK(selectedSet(*payloads, x.size(), 3000) ==
          referenceTopk(widened, expectedK(x.size(), 0.05)));
  }
}

TEST_CASE("topk with multiple chunks decodes to exactly the single-chunk result") {
  for (int data = 0; data < 2; ++data) {
    const size_t n = 250001;
    const auto x = data == 0 ? gaussian(n, 19) : tied(n, 23);
    const auto codec = makeTopk(0.02);
    const Chunking one = Chunking::make(n, 0, 1);
    std::vector<float> want(n, 0.5f);
    REQUIRE(decodeTensor(*codec, one, encode(*codec, x, 0), 2.0f, want.data()).isOk());
    for (size_t chunk : {size_t{1} << 16, size_t{1000}, size_t{65537}, size_t{99999}}) {
      std::vector<float> got(n, 0.5f);
      REQUIRE(decodeTensor(*codec, Chunking::make(n, chunk, 1), encode(*codec, x, chunk), 2.0f,
                           got.data())
                  .isOk());
      CAPTURE(chunk);
      CHECK(std::memcmp(got.data(), want.data(), n * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("topk payload bytes do not depend on the thread count") {
  const size_t n = 700001;
  for (int data = 0; data < 2; ++data) {
    const auto x = data == 0 ? gaussian(n, 29) : tied(n, 31);
    const auto codec = makeTopk(0.01);
    for (size_t chunk : {size_t{0}, size_t{200000}}) {
      const auto one = encode(*codec, x, chunk, 1);
      CHECK(encode(*codec, x, chunk, 2) == one);
      CHECK(encode(*codec, x, chunk, 5) == one);
    }
  }
}

TEST_CASE("topk step density overrides the configured density") {
  const auto x = gaussian(10000, 37);
  const auto codec = makeTopk(0.5);
  CodecState state;
  StepContext ctx;
  ctx.density = 0.01;
  const Chunking chunking = Chunking::make(x.size(), 0, 1);
  auto payloads = encodeTensor(*codec, ctx, chunking, ConstTensor{x.data(), x.size()}, state);
  REQUIRE(payloads.isOk());
  CHECK(selectedSet(*payloads, x.size(), 0) == referenceTopk(x, 100));
  ctx.density = 0.0;
  std::vector<std::byte> ws(codec->workspaceBytes(chunking));
  const Status s = codec->analyze(ctx, chunking, ConstTensor{x.data(), x.size()}, state, ws);
  CHECK_FALSE(s.isOk());
  CHECK(s.message().find("density") != std::string::npos);
}

TEST_CASE("topk with default error feedback sends the residual next step") {
  CodecConfig c;
  c.name = "topk";
  c.density = 0.1;
  auto codec = createCodec(c);
  REQUIRE(codec.isOk());
  CHECK((*codec)->stateFloats(1000) == 1000);  // wrapped in error feedback
  const auto x = gaussian(1000, 41);
  CodecState state((*codec)->stateFloats(x.size()));
  const auto payloads = encode(**codec, x, 300, 2, &state);
  std::vector<float> decoded(x.size(), 0.0f);
  REQUIRE(decodeTensor(**codec, Chunking::make(x.size(), 300, 1), payloads, 1.0f, decoded.data())
              .isOk());
  for (size_t i = 0; i < x.size(); ++i) CHECK(decoded[i] + state.current()[i] == x[i]);
}

TEST_CASE("topk traits: sparse, not summable, no own memory, error feedback by default") {
  const auto codec = makeTopk(0.1);
  const CodecTraits& t = codec->traits();
  CHECK(t.id == CodecId::kTopk);
  CHECK(t.sparse);
  CHECK_FALSE(t.summable);
  CHECK_FALSE(t.own_memory);
  CHECK(t.default_error_feedback);
  CHECK(codec->stateFloats(100) == 0);
  CHECK_FALSE(codec->addPayloads({}, {}, {}).isOk());
}

void expectConfigError(const CodecConfig& c, const char* word) {
  auto codec = createCodec(c);
  REQUIRE_FALSE(codec.isOk());
  CAPTURE(codec.status().message());
  CHECK(codec.status().code() == StatusCode::kInvalidArgument);
  CHECK(codec.status().message().find(word) != std::string::npos);
}

TEST_CASE("topk rejects bad configs with messages naming the parameter") {
  CodecConfig c;
  c.name = "topk";
  c.density = 0.0;
  expectConfigError(c, "density");
  c.density = 1.5;
  expectConfigError(c, "density");
  c.density = std::nan("");
  expectConfigError(c, "density");
  c.density = 0.1;
  c.ratio = 10.0;
  expectConfigError(c, "ratio");
  c.density.reset();
  c.ratio = 0.5;
  expectConfigError(c, "ratio");
  c.ratio.reset();
  expectConfigError(c, "density");
  c.density = 0.1;
  c.sparse_values = DType::kBF16;
  expectConfigError(c, "sparse_values");
}

// --- The sparse decoder against hostile payloads ---------------------------------------------

/// A header followed by a sparse body with the given fields (gap stream and values raw).
Bytes sparsePayload(uint64_t n, uint32_t nnz, uint8_t w, const Bytes& gaps, size_t value_bytes,
                    uint8_t codec = 3, uint8_t flags = 0) {
  Bytes p(24, 0);
  writeHeader(p.data(), {static_cast<CodecId>(codec), DType::kF32, flags, 0, n});
  storeU32(p.data() + 16, nnz);
  p[20] = w;
  p.insert(p.end(), gaps.begin(), gaps.end());
  p.resize(p.size() + value_bytes, 0x3F);
  return p;
}

/// Decodes `p` into a random-filled output and checks it fails with a message and leaves the
/// output bit-for-bit unchanged.
void expectRejected(const Codec& codec, const Bytes& p, size_t out_elements,
                    const char* word = "") {
  std::vector<float> out(std::min<size_t>(out_elements, 4096));
  std::mt19937 rng(static_cast<uint32_t>(p.size()));
  for (auto& v : out) v = bitsFloat(rng());
  const std::vector<float> before = out;
  const Status s = codec.decodeChunk(p, 1.0f, out.data(), out_elements);
  REQUIRE_FALSE(s.isOk());
  CAPTURE(s.message());
  CHECK_FALSE(s.message().empty());
  CHECK(s.message().find(word) != std::string::npos);
  CHECK(std::memcmp(out.data(), before.data(), out.size() * sizeof(float)) == 0);
}

Bytes validPayload(const Codec& codec, size_t n) {
  const auto x = gaussian(n, 43);
  return encode(codec, x, 0)[0];
}

TEST_CASE("topk decoder rejects a payload truncated at every length, or with a trailing byte") {
  const auto codec = makeTopk(0.05);
  const Bytes p = validPayload(*codec, 1000);
  for (size_t len = 0; len < p.size(); ++len) {
    CAPTURE(len);
    expectRejected(*codec, Bytes(p.begin(), p.begin() + len), 1000);
  }
  Bytes longer = p;
  longer.push_back(0);
  expectRejected(*codec, longer, 1000, "bytes");
  std::vector<float> out(1000, 0.0f);
  CHECK(codec->decodeChunk(p, 1.0f, out.data(), 1000).isOk());
}

TEST_CASE("topk decoder rejects nnz > n") {
  const auto codec = makeTopk(0.5);
  expectRejected(*codec, sparsePayload(4, 5, 0, {}, 20), 4, "nnz");
}

TEST_CASE("topk decoder rejects a gap width above 32") {
  const auto codec = makeTopk(0.5);
  expectRejected(*codec, sparsePayload(100, 1, 33, {0, 0, 0, 0, 0, 0, 0, 0}, 4), 100, "32");
}

TEST_CASE("topk decoder rejects gaps that run past the chunk") {
  const auto codec = makeTopk(0.5);
  // n = 10, gaps 5 and 5 (w = 4): indices 5 and 11.
  expectRejected(*codec, sparsePayload(10, 2, 4, {0x55, 0, 0, 0}, 8), 10, "index");
  // One index exactly n: gap 10 with n = 10.
  expectRejected(*codec, sparsePayload(10, 1, 4, {0x0A, 0, 0, 0}, 4), 10, "index");
  // The last of many entries is out of range; earlier ones must not have been added.
  expectRejected(*codec, sparsePayload(3, 3, 1, {0x04, 0, 0, 0}, 12), 3, "index");
}

TEST_CASE("topk decoder rejects non-zero padding bits") {
  const auto codec = makeTopk(0.5);
  // nnz 1, w 3, gap 2: bits 0..2 used.
  std::vector<float> out(10, 0.0f);
  CHECK(
      codec->decodeChunk(sparsePayload(10, 1, 3, {0x02, 0, 0, 0}, 4), 1.0f, out.data(), 10).isOk());
  expectRejected(*codec, sparsePayload(10, 1, 3, {0x22, 0, 0, 0}, 4), 10, "padding");
  expectRejected(*codec, sparsePayload(10, 1, 3, {0x02, 0, 0x01, 0}, 4), 10, "padding");
  expectRejected(*codec, sparsePayload(10, 1, 3, {0x02, 0, 0, 0x80}, 4), 10, "padding");
}

TEST_CASE("topk decoder rejects a huge nnz without overflowing its length arithmetic") {
  const auto codec = makeTopk(0.5);
  const uint64_t huge = uint64_t{1} << 62;
  expectRejected(*codec, sparsePayload(huge, 0xFFFFFFFFu, 32, {0, 0, 0, 0}, 4), huge, "bytes");
  expectRejected(*codec, sparsePayload(~uint64_t{0}, 0xFFFFFFFFu, 255, {}, 0), ~uint64_t{0});
  expectRejected(*codec, sparsePayload(1000, 0xFFFFFFFFu, 32, {}, 0), 1000, "nnz");
  expectRejected(*codec, sparsePayload(1000, 0x40000000u, 0, {}, 0), 1000, "nnz");
}

TEST_CASE("topk decoder rejects bad header fields") {
  const auto codec = makeTopk(0.05);
  const Bytes good = validPayload(*codec, 1000);
  auto with = [&](size_t offset, uint8_t value) {
    Bytes p = good;
    p[offset] = value;
    return p;
  };
  expectRejected(*codec, with(0, 0x4D), 1000, "magic");
  expectRejected(*codec, with(1, 0x00), 1000, "magic");
  expectRejected(*codec, with(2, 2), 1000, "version");
  expectRejected(*codec, with(3, 6), 1000, "codec");  // dgc
  expectRejected(*codec, with(3, 7), 1000, "codec");  // qsgd
  expectRejected(*codec, with(3, 200), 1000, "codec");
  expectRejected(*codec, with(4, 3), 1000, "dtype");
  expectRejected(*codec, with(5, 0x02), 1000, "flag");
  expectRejected(*codec, with(5, 0x80), 1000, "flag");
  expectRejected(*codec, with(7, 1), 1000, "reserved");
  expectRejected(*codec, with(21, 1), 1000, "reserved");
  expectRejected(*codec, with(23, 0x10), 1000, "reserved");
  expectRejected(*codec, good, 999, "elements");
  expectRejected(*codec, good, 1001, "elements");
}

TEST_CASE("topk decoder never touches the output of a corrupted payload it rejects") {
  const auto codec = makeTopk(0.2);
  const Bytes good = validPayload(*codec, 300);
  std::mt19937 rng(47);
  for (size_t offset = 0; offset < good.size(); ++offset) {
    for (int trial = 0; trial < 4; ++trial) {
      Bytes p = good;
      p[offset] ^= static_cast<uint8_t>(1u << (rng() % 8));
      std::vector<float> out(300, 1.0f);
      const Status s = codec->decodeChunk(p, 1.0f, out.data(), out.size());
      if (!s.isOk()) {
        CHECK_FALSE(s.message().empty());
        CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 1.0f; }));
      }
    }
  }
}

TEST_CASE("topk decoder accepts the none escape layout") {
  const auto codec = makeTopk(0.1);
  Bytes p(16 + 12);
  writeHeader(p.data(), {CodecId::kNone, DType::kF32, 0, 0, 3});
  storeF32(p.data() + 16, 1.0f);
  storeF32(p.data() + 20, -2.0f);
  storeF32(p.data() + 24, 0.5f);
  std::vector<float> out = {1.0f, 1.0f, 1.0f};
  REQUIRE(codec->decodeChunk(p, 2.0f, out.data(), 3).isOk());
  CHECK(out == std::vector<float>{3.0f, -3.0f, 2.0f});
  p[5] = 1;  // the none layout defines no flags
  expectRejected(*codec, p, 3, "flag");
}

TEST_CASE("topk decoder adds weight times fp16 values") {
  const auto codec = makeTopk(0.5);
  Bytes p = sparsePayload(5, 2, 2, {0x09, 0, 0, 0}, 0, 3, 1);  // indices 1, 4
  p.resize(p.size() + 4);
  storeU16(p.data() + 28, floatToHalf(1.5f));
  storeU16(p.data() + 30, floatToHalf(-0.25f));
  std::vector<float> out(5, 1.0f);
  REQUIRE(codec->decodeChunk(p, -2.0f, out.data(), 5).isOk());
  CHECK(out == std::vector<float>{1.0f, -2.0f, 1.0f, 1.0f, 1.5f});
}

}  // namespace test_topk
}  // namespace lightwire::kernels

// --- The one-pass listed selection (select.cc selectGuidedList) and its SIMD kernels ---

namespace lightwire::kernels {
namespace test_topk {

/// Inputs whose keys defeat a radix or sampled selection: all equal, two values, NaN/Inf among
/// finite ones, denormals only, keys packed in one key >> 20 bucket, a huge tie at the
/// threshold, and a run of equal keys at the tensor's end.
std::vector<std::pair<const char*, std::vector<float>>> adversarialInputs(size_t n) {
  std::vector<std::pair<const char*, std::vector<float>>> out;
  std::mt19937 rng(71);
  out.push_back({"all equal", std::vector<float>(n, -1.5f)});
  {
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = (rng() % 3 == 0) ? 2.0f : -1.0f;
    out.push_back({"two values", x});
  }
  {
    auto x = gaussian(n, 72);
    const float specials[] = {
        std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
        std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
    for (size_t i = 0; i < n; i += 97) x[i] = specials[(i / 97) % 4];
    out.push_back({"NaN and Inf", x});
  }
  {
    std::vector<float> x(n);
    for (auto& v : x) {
      v = bitsFloat(static_cast<uint32_t>(rng() % 0x007FFFFFu + 1) | (rng() & 0x80000000u));
    }
    out.push_back({"denormals", x});
  }
  {
    std::vector<float> x(n);  // [1, 1 + 2^-4): every key in one bucket of key >> 20
    for (auto& v : x) v = bitsFloat(0x3F800000u | static_cast<uint32_t>(rng() % (1u << 19)));
    out.push_back({"one bucket", x});
  }
  {
    std::vector<float> x(n);  // 10 % large, then a sea of ties at the threshold, then small
    for (size_t i = 0; i < n; ++i) {
      x[i] = (rng() % 10 == 0) ? 5.0f + static_cast<float>(rng() % 100) : 1.0f;
    }
    out.push_back({"ties at the threshold", x});
  }
  {
    auto x = gaussian(n, 73);
    for (size_t i = n - n / 16; i < n; ++i) x[i] = 3.0f;  // equal keys at the end
    out.push_back({"tail run", x});
  }
  {
    std::vector<float> x(n, 0.0f);  // zeros, -0 and a few values
    for (size_t i = 0; i < n; i += 1001) x[i] = (i % 2) ? -0.0f : 1e-3f;
    out.push_back({"mostly zero", x});
  }
  return out;
}

TEST_CASE("topk equals nth_element on adversarial key distributions (all paths, 1-2 threads)") {
  // Large enough for the sampled (listed or bracketed) paths; densities where the listed path
  // applies and where it does not.
  const size_t n = (size_t{1} << 18) + 12345;
  for (const auto& input : adversarialInputs(n)) {
    const auto& name = input.first;  // not a structured binding: CAPTURE's lambda takes it
    const auto& x = input.second;
    for (double d : {1e-5, 0.001, 0.01, 0.2, 0.7}) {
      CAPTURE(name);
      CAPTURE(d);
      const auto want = referenceTopk(x, expectedK(n, d));
      const auto one = encode(*makeTopk(d), x, 0, 1);
      CHECK(selectedSet(one, n, 0) == want);
      const size_t chunk = 40000;
      const auto two = encode(*makeTopk(d), x, chunk, 2);
      CHECK(selectedSet(two, n, chunk) == want);
    }
  }
}

TEST_CASE("topk selection is exact when the sampled bracket misses on purpose") {
  // The guiding sample reads every 32nd element (n = 2^19, 16384 samples); only those hold large
  // keys, so the sample predicts a far higher threshold than the true k-th largest key: the
  // listed path and the bracketed path both miss and the histogram path decides.
  const size_t n = size_t{1} << 19;
  auto x = gaussian(n, 78);
  for (size_t i = 0; i < n; ++i) x[i] = (i % 32 == 0) ? static_cast<float>(i + 1) : x[i] * 1e-3f;
  for (double d : {0.001, 0.01, 0.1}) {
    CAPTURE(d);
    CHECK(selectedSet(encode(*makeTopk(d), x, 0, 2), n, 0) == referenceTopk(x, expectedK(n, d)));
  }
}

/// Payloads of topk and dgc (with and without momentum, fp16 values) for one input.
std::vector<Bytes> selectionPayloads(const std::vector<float>& x, unsigned threads) {
  std::vector<Bytes> all;
  auto add = [&](const std::vector<Bytes>& p) { all.insert(all.end(), p.begin(), p.end()); };
  add(encode(*makeTopk(0.01), x, 100000, threads));
  add(encode(*makeTopk(0.003, {}, DType::kF16), x, 0, threads));
  for (double momentum : {0.0, 0.9}) {
    CodecConfig c;
    c.name = "dgc";
    c.density = 0.01;
    c.momentum = momentum;
    auto dgc = createCodec(c);
    REQUIRE(dgc.isOk());
    CodecState state((*dgc)->stateFloats(x.size()));
    for (int step = 0; step < 2; ++step) {
      add(encode(**dgc, x, 70000, threads, &state));
    }
    for (float v : state.currentSpan()) {
      Bytes b(4);
      storeF32(b.data(), v);
      if (v != 0.0f) all.push_back(b);
    }
  }
  return all;
}

TEST_CASE("topk and dgc bytes are identical on every Highway target the machine supports") {
  const auto x = gaussian(size_t{1} << 19, 74);
  const auto reference = selectionPayloads(x, 1);
  const auto targets = hwy::SupportedAndGeneratedTargets();
  CHECK(!targets.empty());
  for (const int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    const std::string target_name = hwy::TargetName(target);
    CAPTURE(target_name);
    CHECK(selectionPayloads(x, 2) == reference);
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST_CASE("SIMD selection kernels equal their scalar definition on every target and alignment") {
  const size_t n = 5000;
  auto x = gaussian(n, 75);
  x[17] = std::numeric_limits<float>::quiet_NaN();
  x[18] = -std::numeric_limits<float>::infinity();
  x[19] = 1e-42f;
  const auto u = gaussian(n, 76);
  const auto v = gaussian(n, 77);
  std::vector<float> scratch(4 * n + 64);
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    const std::string target_name = hwy::TargetName(target);
    CAPTURE(target_name);
    for (size_t lo : {size_t{0}, size_t{1}, size_t{7}}) {
      for (size_t hi : {n, n - 3, size_t{lo + 5}}) {
        for (uint32_t a : {1u, keyOf(1.0f), keyOf(2.5f), 0x7F800000u}) {
          CAPTURE(lo);
          CAPTURE(hi);
          CAPTURE(a);
          std::vector<uint64_t> want;
          for (size_t i = lo; i < hi; ++i) {
            if (keyOf(x[i]) >= a) want.push_back(compositeKey(keyOf(x[i]), i));
          }
          std::vector<uint64_t> got(hi - lo);
          const uint64_t count = collectCompositesF32(x.data(), lo, hi, a, got.data(), got.size());
          REQUIRE(count == want.size());
          got.resize(count);
          CHECK(got == want);
          // A cap below the count: the count is still exact, only cap entries are written.
          if (count > 2) {
            std::vector<uint64_t> capped(2);
            CHECK(collectCompositesF32(x.data(), lo, hi, a, capped.data(), 2) == count);
            CHECK(capped[0] == want[0]);
            CHECK(capped[1] == want[1]);
          }
        }
        for (bool momentum : {false, true}) {
          for (bool clip : {false, true}) {
            for (size_t shift : {size_t{0}, size_t{1}, size_t{3}}) {  // un/vn alignment
              DgcPass p;
              p.x = x.data();
              p.u = u.data();
              p.v = v.data();
              p.un = momentum ? scratch.data() + shift : nullptr;  // no u' without momentum
              p.vn = scratch.data() + 2 * n + 32;                  // aligned the same as un or not
              p.clip = clip;
              p.factor = 0.3f;
              p.momentum = momentum;
              p.m = 0.9f;
              p.threshold = keyOf(1.5f);
              std::vector<uint32_t> list(hi - lo);
              const uint64_t count = dgcFusedPassF32(p, lo, hi, list.data());
              std::vector<uint32_t> want_list;
              bool same = true;
              for (size_t i = lo; i < hi; ++i) {
                const float g = clip ? x[i] * p.factor : x[i];
                float ui = 0.0f, vi;
                if (momentum) {
                  const float mu = p.m * u[i];
                  ui = mu + g;
                  vi = v[i] + ui;
                } else {
                  vi = v[i] + g;
                }
                same = same && (!momentum || floatBits(p.un[i]) == floatBits(ui)) &&
                       floatBits(p.vn[i]) == floatBits(vi);
                if (keyOf(vi) >= p.threshold) want_list.push_back(static_cast<uint32_t>(i));
              }
              CAPTURE(momentum);
              CAPTURE(clip);
              CAPTURE(shift);
              CHECK(same);
              REQUIRE(count == want_list.size());
              list.resize(count);
              CHECK(list == want_list);
            }
          }
        }
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace test_topk
}  // namespace lightwire::kernels
