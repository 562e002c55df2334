// randomk (docs/determinism.md §4.7, docs/wire-format.md "randomk"): shared-stream selection,
// unbiased scaling, summable payloads, chunk and thread independence, hostile payloads.

#include <doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <vector>

#include "kernels/codec.h"
#include "kernels/dtype.h"
#include "kernels/parallel.h"
#include "kernels/payload.h"
#include "kernels/philox.h"
#include "kernels/registry.h"
#include "kernels/simd/targets.h"
#include "tests/kernels/test_util.h"

namespace lightwire::kernels {
namespace test_randomk {

using Bytes = std::vector<uint8_t>;
constexpr size_t kFixed = 56;

std::unique_ptr<Codec> makeRandomk(std::optional<double> density, DType values = DType::kF32,
                                   std::optional<bool> ef = std::nullopt) {
  CodecConfig c;
  c.name = "randomk";
  c.density = density;
  c.sparse_values = values;
  c.error_feedback = ef;
  auto codec = createCodec(c);
  REQUIRE_MESSAGE(codec.isOk(), codec.status().message());
  return std::move(codec).value();
}

StepContext context(uint64_t step, uint32_t rank = 0, uint32_t seed = 7,
                    const char* name = "layer.weight") {
  StepContext ctx;
  ctx.seed = seed;
  ctx.name_key = tensorNameKey(name);
  ctx.step = step;
  ctx.rank = rank;
  return ctx;
}

std::vector<Bytes> encode(const Codec& codec, StepContext ctx, const std::vector<float>& x,
                          size_t chunk, unsigned threads = 1) {
  CpuStream stream(threads);
  ctx.stream = &stream;
  const Chunking chunking = Chunking::make(x.size(), chunk, codec.chunkAlignment());
  CodecState state(codec.stateFloats(x.size()));
  auto payloads = encodeTensor(codec, ctx, chunking, ConstTensor{x.data(), x.size()}, state);
  REQUIRE_MESSAGE(payloads.isOk(), payloads.status().message());
  return std::move(payloads).value();
}

std::vector<float> decode(const Codec& codec, const std::vector<Bytes>& payloads, size_t n,
                          size_t chunk, float weight = 1.0f) {
  std::vector<float> out(n, 0.0f);
  const Chunking chunking = Chunking::make(n, chunk, codec.chunkAlignment());
  const Status s = decodeTensor(codec, chunking, payloads, weight, out.data());
  REQUIRE_MESSAGE(s.isOk(), s.message());
  return out;
}

/// §4.7 step 2, written independently (long division in 64-bit pieces).
uint64_t referenceWord(uint64_t n, uint64_t k) {
  if (n == 0) return 0;
  const unsigned __int128 num = (static_cast<unsigned __int128>(k) << 32) + n / 2;
  const uint64_t t = static_cast<uint64_t>(num / n);
  return std::max<uint64_t>(t, 1);
}

size_t expectedK(size_t n, double d) {
  if (n == 0) return 0;
  const double r = std::floor(d * static_cast<double>(n) + 0.5);
  return std::min<size_t>(n, std::max<double>(1.0, r));
}

/// The reference selection (philoxBlock via PhiloxStream, not the codec's batched Philox).
bool referenceSelected(const StepContext& ctx, uint64_t t, uint64_t i) {
  const PhiloxStream s(ctx.seed, ctx.name_key, ctx.step, kSharedStream,
                       RandomPurpose::kRandomkIndices);
  return uint64_t{s.word(i)} < t;
}

struct Parsed {
  uint8_t flags = 0;
  uint64_t n = 0, start = 0, t = 0, nnz = 0;
  uint32_t seed = 0, name_key = 0, step = 0;
};

Parsed parse(const Bytes& p) {
  REQUIRE(p.size() >= kFixed);
  Parsed r;
  CHECK(p[0] == 0x4C);
  CHECK(p[1] == 0x57);
  CHECK(p[2] == 1);
  CHECK(p[3] == 4);
  r.flags = p[5];
  CHECK(p[6] == 0);
  CHECK(p[7] == 0);
  r.n = loadU64(p.data() + 8);
  r.seed = loadU32(p.data() + 16);
  r.name_key = loadU32(p.data() + 20);
  r.step = loadU32(p.data() + 24);
  CHECK(loadU32(p.data() + 28) == 0);
  r.start = loadU64(p.data() + 32);
  r.t = loadU64(p.data() + 40);
  r.nnz = loadU64(p.data() + 48);
  CHECK(p.size() == kFixed + r.nnz * ((r.flags & 1) ? 2 : 4));
  return r;
}

/// Indices selected for (ctx, n elements at density d), from a payload of all-ones input.
std::set<size_t> selectedSet(const Codec& codec, const StepContext& ctx, size_t n, size_t chunk,
                             std::vector<float> x = {}) {
  if (x.empty()) x.assign(n, 1.0f);
  const auto out = decode(codec, encode(codec, ctx, x, chunk), n, chunk);
  std::set<size_t> s;
  for (size_t i = 0; i < n; ++i) {
    if (out[i] != 0.0f) s.insert(i);
  }
  return s;
}

TEST_CASE("randomk payload bytes follow the spec exactly (shared Philox stream, scaled values)") {
  for (DType values : {DType::kF32, DType::kF16}) {
    for (double d : {0.1, 0.003, 1.0}) {
      CAPTURE(d);
      auto codec = makeRandomk(d, values);
      const size_t n = 10007;
      auto x = testing::gaussian(n, 3);
      x[5] = 1.0e9f;                                    // saturates in fp16
      const StepContext ctx = context(0x100000005ull);  // counter word 0 = low 32 bits
      const size_t chunk = 1001;
      const auto payloads = encode(*codec, ctx, x, chunk);
      const uint64_t t = referenceWord(n, expectedK(n, d));
      const float s = static_cast<float>(4294967296.0 / static_cast<double>(t));
      size_t begin = 0;
      for (const Bytes& p : payloads) {
        const Parsed h = parse(p);
        CHECK(h.flags == (values == DType::kF16 ? 1 : 0));
        CHECK(h.seed == 7);
        CHECK(h.name_key == tensorNameKey("layer.weight"));
        CHECK(h.step == 5);
        CHECK(h.start == begin);
        CHECK(h.t == t);
        std::vector<size_t> idx;
        for (size_t j = 0; j < h.n; ++j) {
          if (referenceSelected(ctx, t, begin + j)) idx.push_back(j);
        }
        REQUIRE(h.nnz == idx.size());
        for (size_t m = 0; m < idx.size(); ++m) {
          const float v = x[begin + idx[m]] * s;
          if (values == DType::kF16) {
            CHECK(loadU16(p.data() + kFixed + 2 * m) == floatToHalfSaturating(v));
          } else {
            CHECK(loadU32(p.data() + kFixed + 4 * m) == floatBits(v));
          }
        }
        begin += h.n;
      }
      CHECK(begin == n);
    }
  }
}

TEST_CASE("randomk payloads and decodes are identical on every SIMD target") {
  const size_t n = 70001;
  const auto x = testing::gaussian(n, 14);
  std::vector<std::vector<Bytes>> ref;
  std::vector<std::vector<float>> ref_out;
  const std::vector<std::pair<double, size_t>> cases = {{0.01, 0}, {0.3, 999}, {0.5, 3}};
  for (int64_t target : simd::availableTargets()) {
    CAPTURE(simd::targetName(target));
    simd::ScopedTargetForTest force(target);
    for (size_t c = 0; c < cases.size(); ++c) {
      auto codec = makeRandomk(cases[c].first);
      const size_t len = cases[c].second == 3 ? 1001 : n;  // tiny chunks: a shorter tensor
      const std::vector<float> xs(x.begin(), x.begin() + len);
      const StepContext ctx = context(c + 1);
      const auto p = encode(*codec, ctx, xs, cases[c].second, 2);
      const auto out = decode(*codec, p, len, cases[c].second);
      if (ref.size() <= c) {
        // First (best) target: check the selection against philoxBlock, element by element.
        const uint64_t t = referenceWord(len, expectedK(len, cases[c].first));
        for (size_t i = 0; i < len; ++i) {
          REQUIRE((out[i] != 0.0f) == referenceSelected(ctx, t, i));
        }
        ref.push_back(p);
        ref_out.push_back(out);
      } else {
        CHECK(p == ref[c]);
        CHECK(testing::bitEqual(out, ref_out[c]));
      }
    }
  }
}

TEST_CASE("randomk at density 1 sends every element unscaled") {
  auto codec = makeRandomk(1.0);
  const auto x = testing::gaussian(1000, 4);
  const auto payloads = encode(*codec, context(3), x, 0);
  CHECK(parse(payloads[0]).t == (uint64_t{1} << 32));
  CHECK(testing::bitEqual(decode(*codec, payloads, x.size(), 0), x));
}

TEST_CASE("randomk indices are identical across ranks and differ across steps and tensors") {
  auto codec = makeRandomk(0.05);
  const size_t n = 50000;
  const auto base = selectedSet(*codec, context(11, 0), n, 0);
  for (uint32_t rank = 1; rank < 4; ++rank) {
    // Different rank, different data (no zeros), different chunking: same indices.
    auto x = testing::gaussian(n, 40 + rank);
    for (auto& v : x) v = v == 0.0f ? 1.0f : v;
    CHECK(selectedSet(*codec, context(11, rank), n, 777 * rank, x) == base);
  }
  CHECK(selectedSet(*codec, context(12, 0), n, 0) != base);
  CHECK(selectedSet(*codec, context(11, 0, 7, "layer.bias"), n, 0) != base);
  CHECK(selectedSet(*codec, context(11, 0, 8), n, 0) != base);
}

TEST_CASE("randomk selects about k elements") {
  const size_t n = 1000000;
  for (double d : {0.001, 0.01, 0.3}) {
    CAPTURE(d);
    auto codec = makeRandomk(d);
    const double k = static_cast<double>(expectedK(n, d));
    for (uint64_t step = 0; step < 3; ++step) {
      const auto payloads = encode(*codec, context(step), std::vector<float>(n, 1.0f), 65536, 2);
      uint64_t count = 0;
      for (const auto& p : payloads) count += parse(p).nnz;
      const double sigma = std::sqrt(k * (1.0 - d));
      CHECK(std::abs(static_cast<double>(count) - k) < 5.0 * sigma);
    }
  }
}

TEST_CASE("randomk is unbiased: the mean of many decoded steps converges to the input") {
  auto codec = makeRandomk(0.25);
  const size_t n = 64;
  const auto x = testing::gaussian(n, 9);
  const int steps = 20000;
  std::vector<double> sum(n, 0.0);
  for (int s = 0; s < steps; ++s) {
    const auto out = decode(*codec, encode(*codec, context(s), x, 0), n, 0);
    for (size_t i = 0; i < n; ++i) sum[i] += out[i];
  }
  const double p = static_cast<double>(referenceWord(n, expectedK(n, 0.25))) / 4294967296.0;
  for (size_t i = 0; i < n; ++i) {
    const double mean = sum[i] / steps;
    const double sigma = std::abs(x[i]) * std::sqrt((1.0 / p - 1.0) / steps);
    CHECK(std::abs(mean - x[i]) <= 5.0 * sigma + 1e-6 * std::abs(x[i]));
  }
}

TEST_CASE("randomk addPayloads equals the sum of the decodes") {
  for (DType values : {DType::kF32, DType::kF16}) {
    auto codec = makeRandomk(0.1, values);
    CHECK(codec->traits().summable);
    const size_t n = 30000, chunk = 7000;
    std::vector<std::vector<Bytes>> ranks;
    for (uint32_t r = 0; r < 4; ++r) {
      ranks.push_back(encode(*codec, context(21, r), testing::gaussian(n, 60 + r), chunk));
    }
    // fp32 values: the decodes summed into one output. fp16 values: every partial sum re-rounded
    // to fp16 (saturating), as addPayloads does.
    std::vector<float> decoded_sum(n, 0.0f);
    for (const auto& p : ranks) {
      const auto d = decode(*codec, p, n, chunk);
      for (size_t i = 0; i < n; ++i) {
        const float sum = decoded_sum[i] + d[i];
        decoded_sum[i] = values == DType::kF16 && &p != &ranks[0]
                             ? halfToFloat(floatToHalfSaturating(sum))
                             : sum;
      }
    }
    std::vector<Bytes> acc = ranks[0];
    for (uint32_t r = 1; r < 4; ++r) {
      for (size_t c = 0; c < acc.size(); ++c) {
        Bytes out(acc[c].size());
        auto size = codec->addPayloads(acc[c], ranks[r][c], out);
        REQUIRE_MESSAGE(size.isOk(), size.status().message());
        CHECK(*size == out.size());
        // In place (out aliasing an input) gives the same bytes.
        Bytes in_place = acc[c];
        auto size2 = codec->addPayloads(in_place, ranks[r][c], in_place);
        REQUIRE(size2.isOk());
        CHECK(in_place == out);
        acc[c] = out;
      }
    }
    const auto summed = decode(*codec, acc, n, chunk);
    CHECK(testing::bitEqual(summed, decoded_sum));  // same additions in the same order
  }
}

TEST_CASE("randomk fp16 addPayloads adds in fp32 and saturates") {
  auto codec = makeRandomk(1.0, DType::kF16);
  const std::vector<float> x = {60000.0f, -60000.0f, 1.0f, 0.5f};
  const auto a = encode(*codec, context(1), x, 0);
  Bytes out(a[0].size());
  REQUIRE(codec->addPayloads(a[0], a[0], out).isOk());
  const auto sum = decode(*codec, {out}, 4, 0);
  CHECK(sum == std::vector<float>{65504.0f, -65504.0f, 2.0f, 1.0f});
}

TEST_CASE("randomk decoded result does not depend on chunking; bytes not on threads") {
  auto codec = makeRandomk(0.02);
  const size_t n = 300007;
  const auto x = testing::gaussian(n, 5);
  const auto whole = decode(*codec, encode(*codec, context(2), x, 0), n, 0);
  for (size_t chunk : {size_t{1000}, size_t{65537}, size_t{99999}}) {
    CAPTURE(chunk);
    const auto p1 = encode(*codec, context(2), x, chunk, 1);
    const auto p2 = encode(*codec, context(2), x, chunk, 2);
    CHECK(p1 == p2);
    CHECK(testing::bitEqual(decode(*codec, p1, n, chunk), whole));
  }
  // Tiny chunks exercise the unaligned group paths.
  const auto small = testing::gaussian(203, 6);
  const auto ref = decode(*codec, encode(*codec, context(2), small, 0), 203, 0);
  for (size_t chunk : {size_t{1}, size_t{3}, size_t{5}, size_t{63}, size_t{65}}) {
    CHECK(testing::bitEqual(decode(*codec, encode(*codec, context(2), small, chunk), 203, chunk),
                            ref));
  }
}

TEST_CASE("randomk NaN and Inf propagate; fp16 values saturate finite overflow") {
  auto codec = makeRandomk(1.0, DType::kF16);
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {std::nanf(""), inf, -inf, 1.0e6f, -1.0e6f};
  const auto out = decode(*codec, encode(*codec, context(0), x, 0), x.size(), 0);
  CHECK(std::isnan(out[0]));
  CHECK(out[1] == inf);
  CHECK(out[2] == -inf);
  CHECK(out[3] == 65504.0f);
  CHECK(out[4] == -65504.0f);
}

TEST_CASE("randomk selects on the widened value of fp16 and bf16 input") {
  auto codec = makeRandomk(0.5);
  const auto xf = testing::gaussian(999, 8);
  for (DType t : {DType::kF16, DType::kBF16}) {
    std::vector<uint16_t> raw(xf.size());
    std::vector<float> widened(xf.size());
    for (size_t i = 0; i < xf.size(); ++i) {
      raw[i] = t == DType::kF16 ? floatToHalf(xf[i]) : floatToBf16(xf[i]);
      widened[i] = t == DType::kF16 ? halfToFloat(raw[i]) : bf16ToFloat(raw[i]);
    }
    StepContext ctx = context(4);
    const Chunking chunking = Chunking::make(raw.size(), 100, 1);
    CodecState state;
    auto p = encodeTensor(*codec, ctx, chunking, ConstTensor{raw.data(), raw.size(), t}, state);
    REQUIRE(p.isOk());
    const auto ref = encode(*codec, ctx, widened, 100);
    REQUIRE(p->size() == ref.size());
    for (size_t c = 0; c < ref.size(); ++c) {
      CHECK((*p)[c][4] == static_cast<uint8_t>(t));
      Bytes a = (*p)[c];
      a[4] = 0;
      CHECK(a == ref[c]);
    }
  }
}

TEST_CASE("randomk step density overrides the configured density") {
  auto codec = makeRandomk(0.5);
  StepContext ctx = context(1);
  ctx.density = 0.01;
  const auto p = encode(*codec, ctx, std::vector<float>(10000, 1.0f), 0);
  CHECK(parse(p[0]).t == referenceWord(10000, 100));
  ctx.density = 0.0;
  CpuStream stream(1);
  ctx.stream = &stream;
  std::vector<float> x(10, 1.0f);
  CodecState state;
  auto r = encodeTensor(*codec, ctx, Chunking::make(10, 0, 1), ConstTensor{x.data(), 10}, state);
  CHECK_FALSE(r.isOk());
}

TEST_CASE("randomk with an empty tensor sends an empty payload") {
  auto codec = makeRandomk(0.1);
  const auto p = encode(*codec, context(0), {}, 0);
  REQUIRE(p.size() == 1);
  const Parsed h = parse(p[0]);
  CHECK(h.n == 0);
  CHECK(h.t == 0);
  CHECK(h.nnz == 0);
  CHECK(codec->decodeChunk(p[0], 1.0f, nullptr, 0).isOk());
}

TEST_CASE("randomk traits: summable, not sparse, error feedback off by default") {
  auto codec = makeRandomk(0.1);
  CHECK(codec->traits().id == CodecId::kRandomk);
  CHECK(codec->traits().summable);
  CHECK_FALSE(codec->traits().sparse);
  CHECK_FALSE(codec->traits().default_error_feedback);
  CHECK(codec->stateFloats(100) == 0);
  CHECK(makeRandomk(0.1, DType::kF32, true)->stateFloats(100) == 100);
}

TEST_CASE("randomk with error feedback: sent + new residual = input + old residual") {
  auto codec = makeRandomk(0.2, DType::kF32, true);
  const size_t n = 5000;
  CodecState state(codec->stateFloats(n));
  for (uint64_t s = 0; s < 3; ++s) {
    const auto x = testing::gaussian(n, 70 + s);
    const std::vector<float> old(state.currentSpan().begin(), state.currentSpan().end());
    CpuStream stream(1);
    StepContext ctx = context(s);
    ctx.stream = &stream;
    const Chunking chunking = Chunking::make(n, 999, 1);
    auto p = stepTensor(*codec, ctx, chunking, ConstTensor{x.data(), n}, state);
    REQUIRE(p.isOk());
    const auto sent = decode(*codec, *p, n, 999);
    const float* now = state.current();  // the committed residual
    for (size_t i = 0; i < n; ++i) {
      const float a = x[i] + old[i];
      CHECK(now[i] == a + (-1.0f * sent[i]));
    }
  }
}

TEST_CASE("randomk rejects bad configs with messages naming the parameter") {
  auto fails = [](CodecConfig c, const char* word) {
    c.name = "randomk";
    auto r = createCodec(c);
    REQUIRE_FALSE(r.isOk());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(r.status().message().find(word) != std::string::npos, r.status().message());
  };
  fails({}, "density");
  fails({.density = 0.0}, "density");
  fails({.density = 1.5}, "density");
  fails({.density = std::nan("")}, "density");
  fails({.ratio = 0.5}, "ratio");
  fails({.density = 0.1, .ratio = 10.0}, "ratio");
  fails({.density = 0.1, .sparse_values = DType::kBF16}, "values");
  CHECK(createCodec({.name = "randomk", .ratio = 100.0}).isOk());
}

// ---- hostile payloads ----

struct Fixture {
  std::unique_ptr<Codec> codec = makeRandomk(0.3);
  std::vector<float> x = testing::gaussian(200, 12);
  Bytes good = encode(*codec, context(5), x, 0)[0];
};

void expectRejected(const Codec& codec, const Bytes& p, size_t n = 200) {
  std::vector<float> out(n, 3.25f);
  const Status s = codec.decodeChunk(p, 1.0f, out.data(), n);
  CHECK_FALSE(s.isOk());
  CHECK_FALSE(s.message().empty());
  for (float v : out) REQUIRE(v == 3.25f);
}

TEST_CASE("randomk decoder rejects a payload truncated at every length, or with a trailing byte") {
  Fixture f;
  REQUIRE(parse(f.good).nnz > 0);
  for (size_t len = 0; len < f.good.size(); ++len) {
    expectRejected(*f.codec, Bytes(f.good.begin(), f.good.begin() + len));
  }
  Bytes longer = f.good;
  longer.push_back(0);
  expectRejected(*f.codec, longer);
}

TEST_CASE("randomk decoder rejects bad header and body fields") {
  Fixture f;
  auto patched = [&](size_t off, uint8_t v) {
    Bytes p = f.good;
    p[off] = v;
    return p;
  };
  expectRejected(*f.codec, patched(0, 0x4D));  // magic
  expectRejected(*f.codec, patched(2, 2));     // version
  expectRejected(*f.codec, patched(3, 3));     // codec id topk
  expectRejected(*f.codec, patched(5, 0x02));  // unknown flag
  expectRejected(*f.codec, patched(5, 0x01));  // fp16 flag: length no longer matches
  expectRejected(*f.codec, patched(6, 1));     // round
  expectRejected(*f.codec, patched(7, 1));     // reserved
  expectRejected(*f.codec, patched(8, 201));   // element count
  expectRejected(*f.codec, patched(28, 1));    // reserved body field
  // Seed, name key, step or start changed so that the selection has another count: rejected.
  // (A change that happens to select as many elements is a valid payload of another selection;
  // nothing in the bytes can tell, and the decoder then accepts it.)
  for (size_t off : {size_t{16}, size_t{20}, size_t{24}, size_t{32}}) {
    CAPTURE(off);
    const Parsed h = parse(f.good);
    bool found = false;
    for (int delta = 1; delta < 256 && !found; ++delta) {
      Bytes q = patched(off, static_cast<uint8_t>(f.good[off] ^ delta));
      const Parsed m = parse(q);
      StepContext ctx;
      ctx.seed = m.seed;
      ctx.name_key = m.name_key;
      ctx.step = m.step;
      uint64_t count = 0;
      for (uint64_t j = 0; j < m.n; ++j) count += referenceSelected(ctx, m.t, m.start + j);
      if (count != h.nnz) {
        found = true;
        expectRejected(*f.codec, q);
      } else {
        std::vector<float> out(200, 0.0f);
        CHECK(f.codec->decodeChunk(q, 1.0f, out.data(), 200).isOk());
      }
    }
    CHECK(found);
  }
  Bytes p = f.good;
  storeU64(p.data() + 40, (uint64_t{1} << 32) + 1);  // t > 2^32
  expectRejected(*f.codec, p);
  p = f.good;
  storeU64(p.data() + 40, loadU64(f.good.data() + 40) + (uint64_t{1} << 31));  // other count
  expectRejected(*f.codec, p);
  p = f.good;
  storeU64(p.data() + 32, std::numeric_limits<uint64_t>::max() - 10);  // start + n overflows
  expectRejected(*f.codec, p);
  // A chunk that ends at the very top of the index range decodes (or is refused) without
  // overflowing its block arithmetic.
  for (uint64_t top : {uint64_t{0}, uint64_t{1}, uint64_t{3}, uint64_t{255}, uint64_t{256}}) {
    p = f.good;
    storeU64(p.data() + 32, std::numeric_limits<uint64_t>::max() - 200 - top);
    std::vector<float> out(200, 0.0f);
    const Status st = f.codec->decodeChunk(p, 1.0f, out.data(), 200);
    if (!st.isOk()) {
      for (float v : out) REQUIRE(v == 0.0f);
    }
  }
  p = f.good;
  storeU64(p.data() + 48, 201);  // nnz > n
  expectRejected(*f.codec, p);
  p = f.good;
  storeU64(p.data() + 48, std::numeric_limits<uint64_t>::max());  // huge nnz
  expectRejected(*f.codec, p);
  // nnz and length consistent with each other, but not with the selection.
  p = f.good;
  storeU64(p.data() + 48, loadU64(f.good.data() + 48) - 1);
  p.resize(p.size() - 4);
  expectRejected(*f.codec, p);
}

TEST_CASE("randomk decoder accepts the none escape layout") {
  Fixture f;
  Bytes p(16 + 4 * 3);
  writeHeader(p.data(), {CodecId::kNone, DType::kF32, 0, 0, 3});
  storeF32(p.data() + 16, 1.0f);
  storeF32(p.data() + 20, 2.0f);
  storeF32(p.data() + 24, 3.0f);
  std::vector<float> out(3, 1.0f);
  REQUIRE(f.codec->decodeChunk(p, 2.0f, out.data(), 3).isOk());
  CHECK(out == std::vector<float>{3.0f, 5.0f, 7.0f});
}

TEST_CASE("randomk addPayloads rejects payloads that do not select the same elements") {
  Fixture f;
  const Bytes other = encode(*f.codec, context(5, 1), testing::gaussian(200, 13), 0)[0];
  Bytes out(f.good.size());
  REQUIRE(f.codec->addPayloads(f.good, other, out).isOk());
  auto rejected = [&](const Bytes& b, const char* what) {
    CAPTURE(what);
    Bytes o(std::max(f.good.size(), b.size()) + 8, 0xAB);
    CHECK_FALSE(f.codec->addPayloads(f.good, b, o).isOk());
    CHECK_FALSE(f.codec->addPayloads(b, f.good, o).isOk());
  };
  rejected(encode(*f.codec, context(6), f.x, 0)[0], "step");
  rejected(encode(*f.codec, context(5, 0, 8), f.x, 0)[0], "seed");
  rejected(encode(*f.codec, context(5, 0, 7, "other"), f.x, 0)[0], "name");
  rejected(encode(*makeRandomk(0.1), context(5), f.x, 0)[0], "density");
  rejected(encode(*makeRandomk(0.3, DType::kF16), context(5), f.x, 0)[0], "values");
  rejected(encode(*f.codec, context(5), testing::gaussian(201, 1), 0)[0], "elements");
  {
    const auto two = encode(*f.codec, context(5), testing::gaussian(400, 1), 200);
    rejected(two[1], "start");
  }
  Bytes b = other;
  b[4] = 1;  // source dtype
  rejected(b, "dtype");
  b = other;
  storeU64(b.data() + 48, loadU64(b.data() + 48) - 1);
  b.resize(b.size() - 4);
  rejected(b, "nnz");
  b = other;
  b.push_back(0);
  rejected(b, "trailing");
  b = other;
  b.pop_back();
  rejected(b, "truncated");
  Bytes dense(16 + 4 * 200, 0);
  writeHeader(dense.data(), {CodecId::kNone, DType::kF32, 0, 0, 200});
  rejected(dense, "none layout");
  Bytes small(f.good.size() - 1);
  CHECK_FALSE(f.codec->addPayloads(f.good, other, small).isOk());
}

TEST_CASE("randomk decoder adds weight times the values") {
  auto codec = makeRandomk(1.0, DType::kF16);
  const std::vector<float> x = {1.0f, -2.0f, 0.5f};
  const auto p = encode(*codec, context(0), x, 0);
  std::vector<float> out = {1.0f, 1.0f, 1.0f};
  REQUIRE(codec->decodeChunk(p[0], -0.5f, out.data(), 3).isOk());
  CHECK(out == std::vector<float>{0.5f, 2.0f, 0.75f});
}

}  // namespace test_randomk
}  // namespace lightwire::kernels
