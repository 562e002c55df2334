// dgc (docs/determinism.md §4.4): selection counts, a plain reference of clipping, momentum
// correction, accumulation, sampling and masking, atomic state, configuration checks.

#include <doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <hwy/targets.h>

#include "kernels/codec.h"
#include "kernels/dtype.h"
#include "kernels/parallel.h"
#include "kernels/payload.h"
#include "kernels/philox.h"
#include "kernels/registry.h"
#include "kernels/select.h"
#include "tests/kernels/test_util.h"

namespace lightwire::kernels {
namespace test_dgc {

using Bytes = std::vector<uint8_t>;

uint32_t keyOf(float x) { return floatBits(x) & 0x7FFFFFFFu; }

size_t expectedK(size_t n, double d) {
  if (n == 0) return 0;
  const double r = std::floor(d * static_cast<double>(n) + 0.5);
  return std::min<size_t>(n, std::max<double>(1.0, r));
}

struct DgcSettings {
  double density = 0.01;
  double momentum = 0.0;
  double clip_norm = 0.0;
  double sample_fraction = 0.01;
  DType values = DType::kF32;
  bool bias_correction = false;
};

std::unique_ptr<Codec> makeDgc(const DgcSettings& s) {
  CodecConfig c;
  c.name = "dgc";
  c.density = s.density;
  c.momentum = s.momentum;
  c.clip_norm = s.clip_norm;
  c.sample_fraction = s.sample_fraction;
  c.sparse_values = s.values;
  c.bias_correction = s.bias_correction;
  auto codec = createCodec(c);
  REQUIRE_MESSAGE(codec.isOk(), codec.status().message());
  return std::move(codec).value();
}

StepContext stepContext(uint64_t step, CpuStream* stream) {
  StepContext ctx;
  ctx.seed = 1234;
  ctx.name_key = tensorNameKey("layer.0.weight");
  ctx.step = step;
  ctx.rank = 3;
  ctx.stream = stream;
  return ctx;
}

/// One step's payloads; with `commit` the step succeeded and is committed into `state`
/// (stepTensor), without it `state` is left as it was.
std::vector<Bytes> encode(const Codec& codec, const StepContext& ctx, ConstTensor x, size_t chunk,
                          CodecState& state, bool commit = false) {
  const Chunking chunking = Chunking::make(x.elements, chunk, 1);
  auto payloads = commit ? stepTensor(codec, ctx, chunking, x, state)
                         : encodeTensor(codec, ctx, chunking, x, state);
  REQUIRE_MESSAGE(payloads.isOk(), payloads.status().message());
  return std::move(payloads).value();
}

struct Selected {
  std::vector<size_t> indices;  // whole-tensor
  std::vector<float> values;
};

/// Reads the sparse payloads of a chunking bit by bit (independent of the codec's reader).
Selected parsePayloads(const std::vector<Bytes>& payloads, size_t n, size_t chunk) {
  const Chunking chunking = Chunking::make(n, chunk, 1);
  Selected s;
  for (size_t c = 0; c < payloads.size(); ++c) {
    const Bytes& p = payloads[c];
    REQUIRE(p.size() >= 24);
    CHECK(p[3] == 6);
    const uint32_t nnz = loadU32(p.data() + 16);
    const unsigned w = p[20];
    const size_t g = ((size_t{nnz} * w + 7) / 8 + 3) / 4 * 4;
    const size_t vsize = (p[5] & 1) ? 2 : 4;
    REQUIRE(p.size() == 24 + g + vsize * nnz);
    uint64_t bit = 0;
    int64_t prev = -1;
    for (uint32_t j = 0; j < nnz; ++j) {
      uint64_t gap = 0;
      for (unsigned b = 0; b < w; ++b, ++bit)
        gap |= uint64_t((p[24 + bit / 8] >> (bit % 8)) & 1) << b;
      prev = prev + 1 + static_cast<int64_t>(gap);
      s.indices.push_back(chunking.begin(c) + static_cast<size_t>(prev));
      const uint8_t* v = p.data() + 24 + g + vsize * j;
      s.values.push_back(vsize == 2 ? halfToFloat(loadU16(v)) : loadF32(v));
    }
  }
  return s;
}

// --- A plain reference of §4.4, written from the spec with simple loops ----------------------

double referenceNorm(const std::vector<float>& x) {
  double total = 0.0;
  for (size_t b = 0; b < x.size(); b += 4096) {
    double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (size_t i = b; i < std::min(x.size(), b + 4096); ++i) {
      const double d = static_cast<double>(x[i]);
      a[(i - b) % 8] = a[(i - b) % 8] + d * d;
    }
    total = total + (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
  }
  return std::sqrt(total);
}

std::vector<size_t> referenceTopk(const std::vector<float>& x, size_t k) {
  std::vector<size_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), size_t{0});
  std::stable_sort(idx.begin(), idx.end(),
                   [&](size_t a, size_t b) { return keyOf(x[a]) > keyOf(x[b]); });
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

/// §4.4's selection; `path` (optional) records the way it went, e.g. "adjust-up,refined(1)".
std::vector<size_t> referenceSelect(const std::vector<float>& v, size_t k, double f,
                                    const StepContext& ctx, std::string* path = nullptr) {
  std::string trace;
  auto done = [&](const char* how, std::vector<size_t> sel) {
    if (path) *path = trace + how;
    return sel;
  };
  const size_t n = v.size();
  if (n <= 32768) return done("exact", referenceTopk(v, k));
  const size_t m =
      std::max<size_t>(1024, static_cast<size_t>(std::ceil(f * static_cast<double>(n))));
  const PhiloxStream philox(ctx.seed, ctx.name_key, ctx.step, ctx.rank,
                            RandomPurpose::kDgcSampling);
  std::vector<uint32_t> s(m);
  for (size_t j = 0; j < m; ++j) s[j] = keyOf(v[(uint64_t{philox.word(j)} * n) >> 32]);
  std::sort(s.begin(), s.end(), std::greater<uint32_t>());
  const int64_t lo = static_cast<int64_t>((8 * k + 9) / 10), hi = static_cast<int64_t>(13 * k / 10);
  auto count = [&](uint32_t t) {
    int64_t c = 0;
    for (float x : v) c += keyOf(x) >= t;
    return c;
  };
  auto atLeast = [&](uint32_t t) {
    std::vector<size_t> out;
    for (size_t i = 0; i < n; ++i) {
      if (keyOf(v[i]) >= t) out.push_back(i);
    }
    return out;
  };
  const int64_t mm = static_cast<int64_t>(m), kk = static_cast<int64_t>(k);
  int64_t r =
      std::clamp<int64_t>((kk * mm + static_cast<int64_t>(n) - 1) / static_cast<int64_t>(n), 1, mm);
  int64_t c = count(s[r - 1]);
  if (lo <= c && c <= hi) return done("initial", atLeast(s[r - 1]));
  for (int refinement = 0; refinement < 3; ++refinement) {
    int64_t r2 = std::clamp<int64_t>((2 * r * kk + c) / (2 * c), 1, mm);
    if (r2 == r) {
      r2 = c > hi ? r - 1 : r + 1;
      trace += c > hi ? "adjust-down," : "adjust-up,";
    }
    if (r2 < 1 || r2 > mm) {
      trace += "stop,";
      break;
    }
    r = r2;
    c = count(s[r - 1]);
    if (lo <= c && c <= hi) {
      return done(("refined(" + std::to_string(refinement + 1) + ")").c_str(), atLeast(s[r - 1]));
    }
  }
  return done("fallback", referenceTopk(v, k));
}

struct ReferenceDgc {
  DgcSettings settings;
  std::vector<float> u, v;                                    // committed state
  std::vector<float> c = std::vector<float>(u.size(), 0.0f);  // bias correction's c

  /// One step; returns what the payload must carry and updates (u, v) as if committed.
  Selected step(const std::vector<float>& x, const StepContext& ctx) {
    const size_t n = x.size();
    std::vector<float> g = x;
    if (settings.clip_norm > 0.0) {
      const double norm = referenceNorm(x);
      if (norm > settings.clip_norm) {
        const float f = static_cast<float>(settings.clip_norm / norm);
        for (size_t i = 0; i < n; ++i) g[i] = x[i] * f;
      }
    }
    std::vector<float> u2(n), v2(n), c2(n, 0.0f);
    const float m = static_cast<float>(settings.momentum);
    const float w = static_cast<float>(1.0 - settings.momentum);
    for (size_t i = 0; i < n; ++i) {
      if (settings.momentum > 0.0 && settings.bias_correction) {
        const float mu = m * u[i];
        u2[i] = mu + g[i];
        const float mc = m * c[i];
        c2[i] = mc + 1.0f;
        const float d = c2[i] * w;
        const float q = u2[i] / d;
        v2[i] = v[i] + q;
      } else if (settings.momentum > 0.0) {
        const float mu = m * u[i];
        u2[i] = mu + g[i];
        v2[i] = v[i] + u2[i];
      } else {
        u2[i] = 0.0f;
        v2[i] = v[i] + g[i];
      }
    }
    Selected sel;
    sel.indices =
        referenceSelect(v2, expectedK(n, settings.density), settings.sample_fraction, ctx);
    for (size_t i : sel.indices) {
      const float value = settings.values == DType::kF16 ? halfToFloat(floatToHalf(v2[i])) : v2[i];
      sel.values.push_back(value);
      v2[i] = v2[i] - value;
      u2[i] = 0.0f;
      c2[i] = 0.0f;
    }
    u = u2;
    v = v2;
    c = c2;
    return sel;
  }
};

std::vector<float> gaussian(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = dist(rng);
  return x;
}

bool sameBits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Runs `steps` steps of the codec and of the reference, committing each, and compares the
/// payload contents and the whole state bit for bit.
void compareWithReference(const DgcSettings& settings, size_t n, int steps, size_t chunk,
                          unsigned threads) {
  const auto codec = makeDgc(settings);
  CpuStream stream(threads);
  CodecState state(codec->stateFloats(n));
  ReferenceDgc ref{settings, std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f)};
  for (int s = 0; s < steps; ++s) {
    // Alternate large and small gradients so clipping both triggers and does not.
    const auto x = gaussian(n, 100 + s, s % 2 == 0 ? 1.0f : 0.05f);
    const StepContext ctx = stepContext(static_cast<uint64_t>(s), &stream);
    const auto payloads = encode(*codec, ctx, ConstTensor{x.data(), n}, chunk, state, true);
    const Selected got = parsePayloads(payloads, n, chunk);
    const Selected want = ref.step(x, ctx);
    CAPTURE(s);
    REQUIRE(got.indices == want.indices);
    CHECK(sameBits(got.values, want.values));
    if (settings.momentum > 0.0 && settings.bias_correction) {  // u, v, then c
      REQUIRE(state.floats() == 3 * n);
      CHECK(sameBits(state.currentSpan().first(n), ref.u));
      CHECK(sameBits(state.currentSpan().subspan(n, n), ref.v));
      CHECK(sameBits(state.currentSpan().subspan(2 * n), ref.c));
    } else if (settings.momentum > 0.0) {  // u then v
      REQUIRE(state.floats() == 2 * n);
      CHECK(sameBits(state.currentSpan().first(n), ref.u));
      CHECK(sameBits(state.currentSpan().subspan(n), ref.v));
    } else {  // v alone; the reference's u stays zero
      REQUIRE(state.floats() == n);
      CHECK(sameBits(state.currentSpan(), ref.v));
      CHECK(std::all_of(ref.u.begin(), ref.u.end(), [](float f) { return f == 0.0f; }));
    }
  }
}

TEST_CASE("dgc momentum correction and masking equal a plain reference (exact path)") {
  DgcSettings s;
  s.density = 0.05;
  s.momentum = 0.9;
  compareWithReference(s, 3000, 6, 0, 1);
  compareWithReference(s, 3000, 6, 700, 2);
}

TEST_CASE("dgc bias correction equals a plain reference (exact and sampled paths)") {
  DgcSettings s;
  s.density = 0.05;
  s.momentum = 0.9;
  s.bias_correction = true;
  compareWithReference(s, 3000, 8, 0, 1);
  compareWithReference(s, 3000, 6, 700, 2);
  s.clip_norm = 20.0;
  s.values = DType::kF16;
  compareWithReference(s, 3000, 6, 1000, 2);
  s.density = 0.01;
  s.clip_norm = 0.0;
  s.values = DType::kF32;
  compareWithReference(s, 40000, 4, 9000, 2);
}

TEST_CASE("dgc bias correction speeds up an element sent every step, as specified") {
  // One element with a constant gradient 1, always selected (k = 1 of 2, the other 0): c' = 1
  // after every masking, so each step sends u' / (1 · (1 − m)) = 1 / 0.1 = 10 (fp32: the value
  // rounds to 10.000000149...); without the correction it sends u' = 1, the masked momentum.
  DgcSettings s;
  s.density = 0.5;
  s.momentum = 0.9;
  for (const bool bias : {false, true}) {
    s.bias_correction = bias;
    CAPTURE(bias);
    const auto codec = makeDgc(s);
    CpuStream stream(1);
    CodecState state(codec->stateFloats(2));
    const std::vector<float> x = {1.0f, 0.0f};
    for (int step = 0; step < 3; ++step) {
      const auto payloads =
          encode(*codec, stepContext(step, &stream), ConstTensor{x.data(), 2}, 0, state, true);
      const Selected got = parsePayloads(payloads, 2, 0);
      REQUIRE(got.indices == std::vector<size_t>{0});
      const float w = static_cast<float>(1.0 - 0.9);
      CHECK(got.values[0] == (bias ? 1.0f / (1.0f * w) : 1.0f));
    }
  }
}

TEST_CASE("dgc clipping equals a plain reference") {
  DgcSettings s;
  s.density = 0.02;
  s.momentum = 0.5;
  s.clip_norm = 20.0;  // |x| ~ sqrt(3000) = 55 on even steps, 2.7 on odd steps
  compareWithReference(s, 3000, 6, 0, 1);
  s.momentum = 0.0;
  compareWithReference(s, 3000, 4, 1000, 2);
}

TEST_CASE("dgc without momentum keeps u at zero and accumulates v") {
  DgcSettings s;
  s.density = 0.1;
  compareWithReference(s, 2000, 5, 0, 1);
}

TEST_CASE("dgc with fp16 values masks with the decoded value") {
  DgcSettings s;
  s.density = 0.1;
  s.momentum = 0.8;
  s.values = DType::kF16;
  compareWithReference(s, 2000, 5, 0, 1);
}

TEST_CASE("dgc sampled threshold and refinement equal a plain reference") {
  for (double density : {0.001, 0.01, 0.25}) {
    DgcSettings s;
    s.density = density;
    s.momentum = 0.9;
    s.sample_fraction = 0.001;
    CAPTURE(density);
    compareWithReference(s, 100000, 3, 0, 2);
    s.sample_fraction = 0.01;
    compareWithReference(s, 200003, 2, 30000, 3);
  }
}

TEST_CASE(
    "dgc selection paths equal the reference: initial, refinements 1-3, rank steps, fallback") {
  // Inputs found to take each path of §4.4 (the reference records which one it took).
  struct Case {
    size_t n;
    double density;
    uint32_t seed;
    const char* path;
  };
  const Case cases[] = {
      {40000, 0.0003, 6, "initial"},
      {40000, 0.001, 3, "refined(1)"},
      {40000, 0.001, 27, "refined(2)"},
      {40000, 0.01, 18, "refined(3)"},
      {100000, 0.01, 7, "refined(3)"},
      {40000, 0.0005, 18, "adjust-up,refined(1)"},
      {40000, 0.001, 2, "adjust-up,fallback"},
      {40000, 0.0003, 34, "adjust-up,adjust-up,fallback"},
      {40000, 0.001, 64, "adjust-down,refined(1)"},
      {40000, 0.003, 53, "adjust-down,refined(2)"},
      {40000, 0.0003, 0, "adjust-down,stop,fallback"},
      {40000, 0.0003, 4, "fallback"},
  };
  CpuStream stream(2);
  for (const Case& c : cases) {
    DgcSettings s;
    s.density = c.density;
    const auto codec = makeDgc(s);
    const auto x = gaussian(c.n, c.seed);
    const StepContext ctx = stepContext(c.seed, &stream);
    CodecState state(codec->stateFloats(c.n));
    const Selected got =
        parsePayloads(encode(*codec, ctx, ConstTensor{x.data(), c.n}, 0, state), c.n, 0);
    std::string path;
    const auto want = referenceSelect(x, expectedK(c.n, c.density), s.sample_fraction, ctx, &path);
    CAPTURE(c.n);
    CAPTURE(c.density);
    CAPTURE(c.seed);
    CHECK(path == c.path);
    CHECK(got.indices == want);
  }
}

enum class Dist { kGaussian, kCauchy, kStudentT, kConstant, kTied };

std::vector<float> sample(Dist dist, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> x(n);
  switch (dist) {
    case Dist::kGaussian: {
      std::normal_distribution<float> d;
      for (auto& v : x) v = d(rng);
      break;
    }
    case Dist::kCauchy: {
      std::cauchy_distribution<float> d;
      for (auto& v : x) v = d(rng);
      break;
    }
    case Dist::kStudentT: {
      std::student_t_distribution<float> d(2.0f);
      for (auto& v : x) v = d(rng);
      break;
    }
    case Dist::kConstant:
      std::fill(x.begin(), x.end(), -0.125f);
      break;
    case Dist::kTied: {
      std::uniform_int_distribution<int> d(-2, 2);
      for (auto& v : x) v = static_cast<float>(d(rng));
      break;
    }
  }
  return x;
}

TEST_CASE("dgc count lies within [ceil(0.8k), floor(1.3k)] and takes the largest magnitudes") {
  CpuStream stream(2);
  for (size_t n : {size_t{100000}, size_t{1000000}}) {
    for (double density : {0.001, 0.01, 0.25}) {
      for (Dist dist :
           {Dist::kGaussian, Dist::kCauchy, Dist::kStudentT, Dist::kConstant, Dist::kTied}) {
        DgcSettings s;
        s.density = density;
        const auto codec = makeDgc(s);
        const auto x = sample(dist, n, static_cast<uint32_t>(n) + static_cast<uint32_t>(dist));
        CodecState state(codec->stateFloats(n));
        const auto payloads =
            encode(*codec, stepContext(5, &stream), ConstTensor{x.data(), n}, 0, state);
        const Selected sel = parsePayloads(payloads, n, 0);
        const size_t k = expectedK(n, density);
        CAPTURE(n);
        CAPTURE(density);
        CAPTURE(static_cast<int>(dist));
        CHECK(sel.indices.size() >= (8 * k + 9) / 10);
        CHECK(sel.indices.size() <= 13 * k / 10);
        CHECK(sel.indices.size() >= 1);
        if (dist == Dist::kConstant) CHECK(sel.indices.size() == k);
        // The selected set is a top set: no unselected magnitude exceeds a selected one.
        std::vector<char> chosen(n, 0);
        for (size_t i : sel.indices) chosen[i] = 1;
        uint32_t min_selected = 0xFFFFFFFFu, max_unselected = 0;
        for (size_t i = 0; i < n; ++i) {
          if (chosen[i]) {
            min_selected = std::min(min_selected, keyOf(x[i]));
          } else {
            max_unselected = std::max(max_unselected, keyOf(x[i]));
          }
        }
        CHECK(min_selected >= max_unselected);
      }
    }
  }
}

TEST_CASE("dgc payload bytes and state do not depend on the thread count") {
  DgcSettings s;
  s.density = 0.01;
  s.momentum = 0.9;
  s.clip_norm = 100.0;
  const auto codec = makeDgc(s);
  const size_t n = 400001;
  const auto x = gaussian(n, 51);
  std::vector<Bytes> first;
  std::vector<float> first_state;
  for (unsigned threads : {1u, 2u, 3u}) {
    CpuStream stream(threads);
    CodecState state(codec->stateFloats(n));
    const auto payloads =
        encode(*codec, stepContext(1, &stream), ConstTensor{x.data(), n}, 100000, state, true);
    std::vector<float> now(state.currentSpan().begin(), state.currentSpan().end());
    if (threads == 1) {
      first = payloads;
      first_state = now;
    } else {
      CHECK(payloads == first);
      CHECK(sameBits(now, first_state));
    }
  }
}

TEST_CASE("dgc decoded result and state do not depend on the chunking") {
  DgcSettings s;
  s.density = 0.02;
  s.momentum = 0.5;
  const auto codec = makeDgc(s);
  const size_t n = 123457;
  CpuStream stream(2);
  std::vector<float> want_out, want_state;
  for (size_t chunk : {size_t{0}, size_t{1000}, size_t{65536}, size_t{100000}}) {
    CodecState state(codec->stateFloats(n));
    std::vector<float> out(n, 0.25f);
    for (int step = 0; step < 3; ++step) {
      const auto x = gaussian(n, 60 + step);
      const auto payloads =
          encode(*codec, stepContext(step, &stream), ConstTensor{x.data(), n}, chunk, state, true);
      REQUIRE(decodeTensor(*codec, Chunking::make(n, chunk, 1), payloads, 0.5f, out.data()).isOk());
    }
    std::vector<float> st(state.currentSpan().begin(), state.currentSpan().end());
    if (want_out.empty()) {
      want_out = out;
      want_state = st;
    } else {
      CAPTURE(chunk);
      CHECK(sameBits(out, want_out));
      CHECK(sameBits(st, want_state));
    }
  }
}

TEST_CASE("dgc prepare without commit leaves the state unchanged") {
  DgcSettings s;
  s.density = 0.05;
  s.momentum = 0.9;
  const auto codec = makeDgc(s);
  const size_t n = 50000;
  CodecState state(codec->stateFloats(n));
  CpuStream stream(2);
  const auto x0 = gaussian(n, 70);
  encode(*codec, stepContext(0, &stream), ConstTensor{x0.data(), n}, 0, state, true);
  const std::vector<float> committed(state.currentSpan().begin(), state.currentSpan().end());

  const auto x1 = gaussian(n, 71);
  const ConstTensor in1{x1.data(), n};
  const auto first = encode(*codec, stepContext(1, &stream), in1, 20000, state);
  CHECK(sameBits(state.currentSpan(), committed));
  // The failed step is retried: it sends the same thing again from the same committed state.
  const Chunking chunking = Chunking::make(n, 20000, 1);
  auto again = testing::openStep(*codec, stepContext(1, &stream), chunking, in1, state);
  REQUIRE(again.isOk());
  CHECK(again->payloads == first);
  CHECK(sameBits(state.currentSpan(), committed));
  // Committed, it leaves the state of a run in which the step never failed.
  REQUIRE(
      testing::commitStep(*codec, stepContext(1, &stream), chunking, in1, *again, state).isOk());
  CodecState clean(codec->stateFloats(n));
  encode(*codec, stepContext(0, &stream), ConstTensor{x0.data(), n}, 0, clean, true);
  encode(*codec, stepContext(1, &stream), in1, 20000, clean, true);
  CHECK(sameBits(state.currentSpan(), clean.currentSpan()));
  CHECK_FALSE(sameBits(state.currentSpan(), committed));
}

TEST_CASE("dgc step density overrides the configured density") {
  DgcSettings s;
  s.density = 0.5;
  const auto codec = makeDgc(s);
  const size_t n = 10000;
  const auto x = gaussian(n, 80);
  CodecState state(codec->stateFloats(n));
  StepContext ctx = stepContext(0, nullptr);
  ctx.density = 0.01;
  const Selected sel = parsePayloads(encode(*codec, ctx, ConstTensor{x.data(), n}, 0, state), n, 0);
  CHECK(sel.indices == referenceTopk(x, 100));
  ctx.density = 1.5;
  const Chunking chunking = Chunking::make(n, 0, 1);
  std::vector<std::byte> ws(codec->workspaceBytes(chunking));
  const Status st = codec->analyze(ctx, chunking, ConstTensor{x.data(), n}, state, ws);
  CHECK_FALSE(st.isOk());
  CHECK(st.message().find("density") != std::string::npos);
}

TEST_CASE("dgc with fp16 input equals dgc with the widened fp32 input") {
  DgcSettings s;
  s.density = 0.01;
  s.momentum = 0.9;
  s.clip_norm = 50.0;
  const auto codec = makeDgc(s);
  const size_t n = 70000;
  const auto x = gaussian(n, 90);
  std::vector<uint16_t> half(n);
  std::vector<float> widened(n);
  for (size_t i = 0; i < n; ++i) {
    half[i] = floatToHalf(x[i]);
    widened[i] = halfToFloat(half[i]);
  }
  CpuStream stream(2);
  CodecState a(codec->stateFloats(n)), b(codec->stateFloats(n));
  auto pa =
      encode(*codec, stepContext(0, &stream), ConstTensor{half.data(), n, DType::kF16}, 0, a, true);
  auto pb = encode(*codec, stepContext(0, &stream), ConstTensor{widened.data(), n}, 0, b, true);
  CHECK(pa[0][4] == 1);  // the header names the trainer's dtype
  pa[0][4] = 0;
  CHECK(pa == pb);
  CHECK(sameBits(a.currentSpan(), b.currentSpan()));
}

TEST_CASE("dgc traits: own memory with state (u then) v, never wrapped in error feedback") {
  const auto codec = makeDgc({});
  const CodecTraits& t = codec->traits();
  CHECK(t.id == CodecId::kDgc);
  CHECK(t.own_memory);
  CHECK(t.sparse);
  CHECK_FALSE(t.summable);
  CHECK(codec->stateFloats(1000) == 1000);  // momentum 0: v alone
  CHECK(codec->config().error_feedback.value_or(false) == false);
  DgcSettings with_momentum;
  with_momentum.momentum = 0.9;
  CHECK(makeDgc(with_momentum)->stateFloats(1000) == 2000);
  with_momentum.bias_correction = true;  // u, v, then c
  CHECK(makeDgc(with_momentum)->stateFloats(1000) == 3000);
}

TEST_CASE("dgc of an empty tensor sends an empty payload") {
  const auto codec = makeDgc({});
  CodecState state(0);
  const auto payloads = encode(*codec, stepContext(0, nullptr), ConstTensor{nullptr, 0}, 0, state);
  REQUIRE(payloads.size() == 1);
  CHECK(payloads[0].size() == 24);
  CHECK(codec->decodeChunk(payloads[0], 1.0f, nullptr, 0).isOk());
}

void expectConfigError(CodecConfig c, const char* word) {
  c.name = "dgc";
  auto codec = createCodec(c);
  REQUIRE_FALSE(codec.isOk());
  CAPTURE(codec.status().message());
  CHECK(codec.status().code() == StatusCode::kInvalidArgument);
  CHECK(codec.status().message().find(word) != std::string::npos);
}

TEST_CASE("dgc rejects bad configs with messages naming the parameter") {
  CodecConfig c;
  c.density = 0.0;
  expectConfigError(c, "density");
  c.density = 1.5;
  expectConfigError(c, "density");
  c.density = 0.1;
  c.ratio = 10.0;
  expectConfigError(c, "ratio");
  c.density.reset();
  c.ratio = 0.5;
  expectConfigError(c, "ratio");
  c.ratio.reset();  // neither: the default density (tested below), not an error
  c.density = 0.1;
  c.momentum = 1.0;
  expectConfigError(c, "momentum");
  c.momentum = -0.1;
  expectConfigError(c, "momentum");
  c.momentum = 0.9;
  c.sample_fraction = 0.5;
  expectConfigError(c, "sample_fraction");
  c.sample_fraction = 0.0005;
  expectConfigError(c, "sample_fraction");
  c.sample_fraction = 0.01;
  c.clip_norm = -1.0;
  expectConfigError(c, "clip_norm");
  c.clip_norm = 0.0;
  c.momentum = 0.0;
  c.bias_correction = true;  // without momentum: nothing to correct
  expectConfigError(c, "bias_correction");
  c.momentum = 0.9;  // with it: accepted
  CHECK(createCodec(c).isOk());
  c.bias_correction = false;
  c.sparse_values = DType::kBF16;
  expectConfigError(c, "sparse_values");
  c.sparse_values = DType::kF16;
  c.error_feedback = true;
  expectConfigError(c, "error_feedback");
  c.error_feedback = false;
  c.name = "dgc";
  CHECK(createCodec(c).isOk());
}

TEST_CASE("dgc decoder rejects other codecs' payloads and damaged ones without touching out") {
  DgcSettings s;
  s.density = 0.05;
  const auto codec = makeDgc(s);
  const size_t n = 1000;
  const auto x = gaussian(n, 95);
  CodecState state(codec->stateFloats(n));
  const Bytes good = encode(*codec, stepContext(0, nullptr), ConstTensor{x.data(), n}, 0, state)[0];
  std::vector<float> out(n, 2.0f);
  auto rejected = [&](const Bytes& p, size_t elements) {
    const Status st = codec->decodeChunk(p, 1.0f, out.data(), elements);
    return !st.isOk() && !st.message().empty() &&
           std::all_of(out.begin(), out.end(), [](float v) { return v == 2.0f; });
  };
  Bytes topk = good;
  topk[3] = 3;
  CHECK(rejected(topk, n));
  for (size_t len = 0; len < good.size(); ++len)
    CHECK(rejected(Bytes(good.begin(), good.begin() + len), n));
  Bytes trailing = good;
  trailing.push_back(0);
  CHECK(rejected(trailing, n));
  CHECK(rejected(good, n - 1));
  Bytes flags = good;
  flags[5] = 2;
  CHECK(rejected(flags, n));
  CHECK(codec->decodeChunk(good, 1.0f, out.data(), n).isOk());
}

}  // namespace test_dgc
}  // namespace lightwire::kernels

TEST_CASE("dgc without density or ratio uses the documented default of 0.001") {
  auto codec = lightwire::kernels::createCodec({.name = "dgc"});
  REQUIRE(codec.isOk());
  const size_t n = 20000;  // exact path: exactly k = 20 selected
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 977) - 488.0f;
  lightwire::kernels::CodecState state((*codec)->stateFloats(n));
  auto payloads =
      lightwire::kernels::encodeTensor(**codec, {}, lightwire::kernels::Chunking::make(n, 0, 1),
                                       {x.data(), n, lightwire::kernels::DType::kF32}, state);
  REQUIRE(payloads.isOk());
  CHECK(lightwire::kernels::loadU32((*payloads)[0].data() + 16) == 20);
  auto topk = lightwire::kernels::createCodec({.name = "topk"});
  CHECK(!topk.isOk());  // topk has no default: the user must choose
}

namespace lightwire::kernels {
namespace test_dgc {

TEST_CASE(
    "dgc fused pass, commit pass and listed selection equal the reference on every Highway "
    "target") {
  // The fused pass (momentum, clipping, accumulation, first count), the listed encode and the
  // commit's state pass run on each target; fp16 values, clipping and several steps exercise
  // masking and state.
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    const std::string target_name = hwy::TargetName(target);
    CAPTURE(target_name);
    DgcSettings s;
    s.density = 0.01;
    s.momentum = 0.9;
    s.clip_norm = 100.0;
    compareWithReference(s, 100003, 3, 25000, 2);
    s.bias_correction = true;
    compareWithReference(s, 100003, 3, 25000, 2);
    s.bias_correction = false;
    s.momentum = 0.0;
    s.values = DType::kF16;
    s.clip_norm = 0.0;
    compareWithReference(s, 65537, 2, 0, 1);
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST_CASE("dgc with bf16 input and clipping equals dgc with the widened fp32 input") {
  // Clipping widens bf16 input into v' and the fused pass then reads and writes v' in place.
  DgcSettings s;
  s.density = 0.003;
  s.momentum = 0.5;
  s.clip_norm = 10.0;
  const auto codec = makeDgc(s);
  const size_t n = 90001;
  const auto x = gaussian(n, 91);
  std::vector<uint16_t> bf(n);
  std::vector<float> widened(n);
  for (size_t i = 0; i < n; ++i) {
    bf[i] = static_cast<uint16_t>(floatBits(x[i]) >> 16);
    widened[i] = bf16ToFloat(bf[i]);
  }
  CpuStream stream(2);
  CodecState a(codec->stateFloats(n)), b(codec->stateFloats(n));
  for (uint64_t step = 0; step < 2; ++step) {
    auto pa = encode(*codec, stepContext(step, &stream), ConstTensor{bf.data(), n, DType::kBF16},
                     30000, a, true);
    auto pb =
        encode(*codec, stepContext(step, &stream), ConstTensor{widened.data(), n}, 30000, b, true);
    for (auto& p : pa) p[4] = 0;
    CHECK(pa == pb);
    CHECK(sameBits(a.currentSpan(), b.currentSpan()));
  }
}

// The sparse allreduce's owner rule (docs/determinism.md "4.6b Global selection"): dgc's ranks
// send 0.8k to 1.3k entries each, and the chunks' shares of the summed selections still add up to
// at most k — each chunk's share is its part of the entries the ranks sent for the whole layer.
TEST_CASE("global selection: a layer's shares add up to at most k when the ranks sent more") {
  const auto codec = makeDgc(DgcSettings{});
  const size_t len = 50;
  std::vector<float> sums;
  std::vector<uint64_t> scratch;
  // Payloads of dgc (fp32 values) holding the given entries of a chunk of `len` elements.
  auto payload = [&](std::vector<std::pair<uint32_t, float>> entries) {
    std::vector<float> dense(len, 0.0f);
    for (auto [i, v] : entries) dense[i] = v;
    Bytes out(sparseMaxPayloadBytes(len, DType::kF32));
    auto size = writeGlobalSelection(CodecId::kDgc, dense, entries.size(), 0, scratch, out);
    REQUIRE(size.isOk());
    out.resize(*size);
    return out;
  };
  // Rank 0 sent 4 entries, all in chunk 0; rank 1 sent 6, 3 in each chunk; k = 3.
  const Bytes r0c0 = payload({{1, 4.0f}, {2, 3.0f}, {3, 2.0f}, {4, 1.0f}});
  const Bytes r0c1 = payload({});
  const Bytes r1c0 = payload({{1, 0.5f}, {7, 5.0f}, {9, 0.25f}});
  const Bytes r1c1 = payload({{0, 9.0f}, {1, 8.0f}, {2, 7.0f}});
  const std::vector<uint64_t> entries{4, 6};
  const LayerCounts layer{3, entries};
  auto select = [&](const Bytes& a, const Bytes& b, const LayerCounts& counts) {
    const std::vector<std::span<const uint8_t>> contributions{a, b};
    Bytes out(sparseMaxPayloadBytes(len, DType::kF32));
    auto size = reduceSelectChunk(*codec, contributions, len, counts, sums, scratch, out);
    std::vector<uint32_t> idx;
    std::vector<float> val;
    if (size.isOk()) {
      out.resize(*size);
      REQUIRE(readSparseEntries(out, CodecId::kDgc, len, idx, val).isOk());
    }
    return std::make_pair(size.status(), idx);
  };
  // Chunk 0: 7 of the 10 entries, ⌊7 · min(3, 5) / 10⌋ = 2 (the ranks' mean count would be 3).
  const auto c0 = select(r0c0, r1c0, layer);
  REQUIRE(c0.first.isOk());
  CHECK(c0.second == std::vector<uint32_t>{1, 7});  // sums 4.5 and 5
  // Chunk 1: 3 of 10, ⌊3 · 3 / 10⌋ = 0 (the mean count: 1).
  const auto c1 = select(r0c1, r1c1, layer);
  REQUIRE(c1.first.isOk());
  CHECK(c1.second.empty());
  // Ranks that sent fewer than k in all keep their mean count: ⌊7 · ⌊10 / 2⌋ / 10⌋ = 3.
  const std::vector<uint64_t> many_k{4, 6};
  const auto c0_large_k = select(r0c0, r1c0, LayerCounts{100, many_k});
  REQUIRE(c0_large_k.first.isOk());
  CHECK(c0_large_k.second == std::vector<uint32_t>{1, 2, 7});
  // A payload holding more entries than its rank declared for the layer is refused.
  const std::vector<uint64_t> short_count{3, 6};
  const auto refused = select(r0c0, r1c0, LayerCounts{3, short_count});
  CHECK(refused.first.code() == StatusCode::kDataLoss);
  CHECK(refused.first.message().find("rank 0") != std::string::npos);
  // Nothing sent anywhere: nothing selected.
  const std::vector<uint64_t> none{0, 0};
  const auto empty = select(r0c1, r0c1, LayerCounts{3, none});
  REQUIRE(empty.first.isOk());
  CHECK(empty.second.empty());
}

}  // namespace test_dgc
}  // namespace lightwire::kernels
