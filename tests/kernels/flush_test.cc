// Codec::flush (full synchronisation, docs/determinism.md "4.6a Full synchronisation (flush)"),
// Codec::residualNorm2, CodecState::restore and CodecConfig::min_magnitude
// (docs/determinism.md §4.2) for every codec in the registry.
#include <doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/dtype.h"
#include "kernels/parallel.h"
#include "kernels/payload.h"
#include "kernels/registry.h"
#include "kernels/select.h"
#include "kernels/simd/targets.h"
#include "tests/kernels/multirank.h"
#include "tests/kernels/test_util.h"

namespace test_flush {

using namespace lightwire::kernels;
using lightwire::kernels::testing::bitEqual;
using lightwire::kernels::testing::gaussian;
using lightwire::kernels::testing::make;

namespace {

using Bytes = std::vector<uint8_t>;

/// A tensor of any dtype built from fp32 values (fp16/bf16 rounded), with its exact fp32 widening.
struct Input {
  DType dtype = DType::kF32;
  std::vector<float> f32;     // kF32 data, or the widened values of h
  std::vector<uint16_t> h16;  // kF16 / kBF16 data

  Input(const std::vector<float>& x, DType d) : dtype(d), f32(x) {
    if (d == DType::kF32) return;
    h16.resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      h16[i] = d == DType::kF16 ? floatToHalf(x[i]) : floatToBf16(x[i]);
      f32[i] = d == DType::kF16 ? halfToFloat(h16[i]) : bf16ToFloat(h16[i]);
    }
  }
  ConstTensor tensor() const {
    if (dtype == DType::kF32) return {f32.data(), f32.size(), dtype};
    return {h16.data(), h16.size(), dtype};
  }
};

std::vector<float> current(const CodecState& s) {
  return {s.currentSpan().begin(), s.currentSpan().end()};
}

double plainNorm2(const float* x, size_t n) {
  double s = 0.0;
  for (size_t i = n; i-- > 0;) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return s;
}

/// One configuration per registered codec (and error-feedback setting); every registered codec
/// must appear, so a new codec fails here until it is considered.
std::vector<CodecConfig> everyCodec() {
  std::vector<CodecConfig> v = {
      {.name = "none"},
      {.name = "none", .error_feedback = true},
      {.name = "fp16"},
      {.name = "fp16", .error_feedback = true},
      {.name = "bf16"},
      {.name = "bf16", .error_feedback = true},
      {.name = "topk", .density = 0.02},
      {.name = "topk", .density = 0.05, .sparse_values = DType::kF16},
      {.name = "topk", .density = 0.05, .error_feedback = false},
      {.name = "randomk", .density = 0.05},
      {.name = "randomk", .density = 0.05, .error_feedback = true},
      {.name = "threshold", .threshold = 1.0},
      {.name = "threshold", .threshold = 1.0, .error_feedback = false},
      {.name = "dgc", .density = 0.01},
      {.name = "dgc", .density = 0.01, .momentum = 0.9},
      {.name = "dgc", .density = 0.02, .momentum = 0.5, .clip_norm = 20.0},
      {.name = "dgc", .density = 0.02, .momentum = 0.9, .sparse_values = DType::kF16},
      {.name = "dgc", .density = 0.02, .momentum = 0.9, .bias_correction = true},
      {.name = "qsgd", .bits = 4, .bucket_size = 128},
      {.name = "qsgd", .bits = 4, .bucket_size = 128, .error_feedback = true},
      {.name = "terngrad", .bucket_size = 128},
      {.name = "terngrad", .bucket_size = 128, .error_feedback = true},
      {.name = "signsgd", .bucket_size = 128},
      {.name = "signsgd", .bucket_size = 128, .error_feedback = false},
      {.name = "onebit", .bucket_size = 128},
      {.name = "onebit", .bucket_size = 128, .error_feedback = false},
      {.name = "powersgd", .approx_rank = 2},
  };
  std::set<std::string> covered;
  for (const auto& c : v) covered.insert(c.name);
  for (const auto& name : codecNames()) {
    CHECK_MESSAGE(covered.count(name) == 1, "codec '" << name << "' has no flush test config");
  }
  return v;
}

StepContext ctxFor(uint64_t step, CpuStream* stream = nullptr) {
  StepContext ctx;
  ctx.seed = 77;
  ctx.name_key = tensorNameKey("layer.weight");
  ctx.step = step;
  ctx.rank = 1;
  ctx.stream = stream;
  return ctx;
}

/// One compressed step (any codec; powersgd through runMultiRank with one rank), committed.
/// Returns what was decoded (weight 1).
std::vector<float> compressedStep(const Codec& codec, const StepContext& ctx, const Chunking& ch,
                                  ConstTensor x, CodecState& state) {
  const size_t n = ch.elements;
  std::vector<float> out(n, 0.0f);
  if (codec.traits().rounds > 1) {
    std::vector<CodecState> states(1);
    states[0] = state;
    const std::vector<ConstTensor> inputs{x};
    auto step = testing::runMultiRank(codec, ctx, inputs, states, 1.0f);
    REQUIRE_MESSAGE(step.isOk(), step.status().message());
    REQUIRE(testing::commitMultiRank(codec, ctx, inputs, states, *step).isOk());
    state = states[0];
    out = step->decoded[0];
  } else {
    auto payloads = stepTensor(codec, ctx, ch, x, state);
    REQUIRE_MESSAGE(payloads.isOk(), payloads.status().message());
    REQUIRE(decodeTensor(codec, ch, *payloads, 1.0f, out.data()).isOk());
  }
  return out;
}

/// The sparse layout (wire-format.md): chunk-local indices and fp32-widened values.
struct Sparse {
  std::vector<uint32_t> idx;
  std::vector<float> val;
};
Sparse parseSparse(const Bytes& p) {
  Sparse s;
  REQUIRE(p.size() >= 24);
  uint32_t nnz;
  std::memcpy(&nnz, p.data() + 16, 4);
  const unsigned w = p[20];
  const bool f16 = (p[5] & 1) != 0;  // flags byte of the header
  const size_t g = ((size_t{nnz} * w + 7) / 8 + 3) & ~size_t{3};
  REQUIRE(p.size() == 24 + g + nnz * (f16 ? 2 : 4));
  uint64_t bit = 0, next = 0;
  for (uint32_t j = 0; j < nnz; ++j) {
    uint64_t gap = 0;
    for (unsigned b = 0; b < w; ++b, ++bit)
      gap |= uint64_t{(p[24 + bit / 8] >> (bit % 8)) & 1u} << b;
    const uint64_t i = next + gap;
    s.idx.push_back(static_cast<uint32_t>(i));
    next = i + 1;
    if (f16) {
      uint16_t h;
      std::memcpy(&h, p.data() + 24 + g + 2 * j, 2);
      s.val.push_back(halfToFloat(h));
    } else {
      float f;
      std::memcpy(&f, p.data() + 24 + g + 4 * j, 4);
      s.val.push_back(f);
    }
  }
  return s;
}

}  // namespace

TEST_CASE("flush: every codec sends input + held-back state, and leaves nothing behind") {
  const size_t n = 6000;
  for (const CodecConfig& c : everyCodec()) {
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      CAPTURE(testing::describe(c));
      CAPTURE(dtypeName(dtype));
      auto codec = make(c);
      const Chunking ch = chunkingFor(*codec, n, 1000);
      CodecState state(codec->stateFloats(n));
      for (uint64_t s = 0; s < 3; ++s) {
        const Input x(gaussian(n, 10 + s), dtype);
        compressedStep(*codec, ctxFor(s), ch, x.tensor(), state);
      }
      const bool stateful = codec->stateFloats(n) > 0;
      const double before = codec->residualNorm2(state, n);
      // Every stateful codec here holds something back after lossy steps, except those that
      // send everything exactly (`none`; a cast the input's values fit in).
      const bool exact = c.name == "none" || (c.name == "fp16" && dtype != DType::kF32) ||
                         (c.name == "bf16" && dtype == DType::kBF16);
      CHECK((before > 0.0) == (stateful && !exact));

      const Input x(gaussian(n, 99), dtype);
      const std::vector<float> committed = current(state);
      std::vector<float> out(n, -7.0f);
      Status s = codec->flush(ctxFor(3), ch, x.tensor(), state, out.data());
      REQUIRE_MESSAGE(s.isOk(), s.message());
      CHECK(bitEqual(current(state), committed));  // flush never touches state.current()

      if (!stateful) {
        CHECK(bitEqual(out, x.f32));  // stateless: out = input (widened, exactly)
      } else if (c.name != "dgc") {
        // Error feedback and powersgd: out = x + e, bit for bit (the a_i / M of analyze).
        std::vector<float> expect(n);
        for (size_t i = 0; i < n; ++i) expect[i] = x.f32[i] + committed[i];
        CHECK(bitEqual(out, expect));
      }
      codec->commitFlush(state, n);
      CHECK(codec->residualNorm2(state, n) == 0.0);
      if (c.name == "powersgd") {
        // Error zero; the meta block and the warm-start Q are kept.
        const auto now = current(state);
        CHECK(std::all_of(now.begin(), now.begin() + n, [](float v) { return v == 0.0f; }));
        CHECK(std::equal(now.begin() + n, now.end(), committed.begin() + n));
      } else if (stateful) {
        // The flushed state is a fresh one: the next step is byte-identical to a fresh codec's.
        const auto now = current(state);
        CHECK(std::all_of(now.begin(), now.end(), [](float v) { return v == 0.0f; }));
        const Input y(gaussian(n, 123), dtype);
        CodecState fresh(codec->stateFloats(n));
        auto a = encodeTensor(*codec, ctxFor(4), ch, y.tensor(), state);
        auto b = encodeTensor(*codec, ctxFor(4), ch, y.tensor(), fresh);
        REQUIRE(a.isOk());
        REQUIRE(b.isOk());
        CHECK(*a == *b);
      }
    }
  }
}

TEST_CASE("flush: argument checks, like analyze's; nothing is written on error") {
  auto codec = make({.name = "topk", .density = 0.1});
  const size_t n = 100;
  const std::vector<float> x = gaussian(n, 1);
  const Chunking ch = chunkingFor(*codec, n, 0);
  CodecState state(n);
  std::vector<float> out(n, 0.0f);
  CodecState wrong(n + 1);
  Status s = codec->flush(ctxFor(0), ch, {x.data(), n, DType::kF32}, wrong, out.data());
  CHECK(!s.isOk());
  CHECK(s.message().find("101") != std::string::npos);
  s = codec->flush(ctxFor(0), ch, {x.data(), n - 1, DType::kF32}, state, out.data());
  CHECK(!s.isOk());
  s = codec->flush(ctxFor(0), ch, {x.data(), n, DType::kF32}, state, nullptr);
  CHECK(!s.isOk());
  CHECK(s.message().find("null") != std::string::npos);
  s = codec->flush(ctxFor(0), ch, {nullptr, n, DType::kF32}, state, out.data());
  CHECK(!s.isOk());
  CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 0.0f; }));
  // n = 0: nothing to do, null pointers allowed.
  CodecState empty(codec->stateFloats(0));
  CHECK(
      codec->flush(ctxFor(0), chunkingFor(*codec, 0, 0), {nullptr, 0, DType::kF32}, empty, nullptr)
          .isOk());
  CHECK(codec->residualNorm2(empty, 0) == 0.0);
}

TEST_CASE("flush: a stream gives the same bits as the calling thread") {
  CpuStream stream(2);
  const size_t n = 300000;
  for (CodecConfig c :
       {CodecConfig{.name = "topk", .density = 0.01},
        CodecConfig{.name = "dgc", .density = 0.01, .momentum = 0.9, .clip_norm = 100.0},
        CodecConfig{.name = "powersgd", .approx_rank = 1}}) {
    CAPTURE(c.name);
    auto codec = make(c);
    const Chunking ch = chunkingFor(*codec, n, 1 << 16);
    CodecState state(codec->stateFloats(n));
    compressedStep(*codec, ctxFor(0), ch, {gaussian(n, 5).data(), n, DType::kF32}, state);
    const Input x(gaussian(n, 6), DType::kBF16);
    std::vector<float> a(n), b(n);
    CodecState s1 = state, s2 = state;
    REQUIRE(codec->flush(ctxFor(1), ch, x.tensor(), s1, a.data()).isOk());
    REQUIRE(codec->flush(ctxFor(1, &stream), ch, x.tensor(), s2, b.data()).isOk());
    CHECK(bitEqual(a, b));
    codec->commitFlush(s1, n);
    codec->commitFlush(s2, n);
    CHECK(bitEqual(current(s1), current(s2)));
  }
}

TEST_CASE("flush: dgc sends exactly this step's v' (momentum, clipping), then zero state") {
  // flush's out must be bit for bit the v' that analyze() prepares from the same state and input:
  // steps 1-3 of docs/determinism.md §4.4, clipping included.
  const size_t n = 50000;
  for (CodecConfig c :
       {CodecConfig{.name = "dgc", .density = 0.01},
        CodecConfig{.name = "dgc", .density = 0.01, .momentum = 0.9},
        CodecConfig{.name = "dgc", .density = 0.01, .clip_norm = 30.0},
        CodecConfig{.name = "dgc", .density = 0.01, .momentum = 0.7, .clip_norm = 30.0},
        CodecConfig{.name = "dgc",
        .density = 0.01,
        .momentum = 0.9,
        .clip_norm = 30.0,
        .bias_correction = true}}) {
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      CAPTURE(testing::describe(c));
      CAPTURE(c.clip_norm);
      CAPTURE(c.bias_correction);
      CAPTURE(dtypeName(dtype));
      auto codec = make(c);
      const Chunking ch = chunkingFor(*codec, n, 8192);
      CodecState state(codec->stateFloats(n));
      for (uint64_t s = 0; s < 3; ++s) {
        compressedStep(*codec, ctxFor(s), ch, Input(gaussian(n, 40 + s), dtype).tensor(), state);
      }
      const Input x(gaussian(n, 50), dtype);
      CodecState probe = state;
      std::vector<std::byte> ws(codec->workspaceBytes(ch));
      REQUIRE(codec->analyze(ctxFor(3), ch, x.tensor(), probe, ws).isOk());
      const float* vprime = probe.work(n);  // v', in the work area
      std::vector<float> out(n);
      REQUIRE(codec->flush(ctxFor(3), ch, x.tensor(), state, out.data()).isOk());
      CHECK(std::memcmp(out.data(), vprime, n * sizeof(float)) == 0);
      codec->commitFlush(state, n);
      const auto now = current(state);
      CHECK(std::all_of(now.begin(), now.end(), [](float v) { return v == 0.0f; }));
      CHECK(codec->residualNorm2(state, n) == 0.0);
    }
  }
}

TEST_CASE("flush: dgc loses nothing — what k steps and one flush sent is the sum of u'") {
  // Per element, the codec's only roundings are v'_t = v_t + u'_t (|error| <= 2^-24 |v'_t|) and,
  // with fp16 values, the masking v_(t+1) = v'_t − value_t (|error| <= 2^-24 |v_(t+1)|); fp32
  // values make the masking exact (v'_t − v'_t = 0). The sent values are decoded into a zero
  // buffer (0 + 1·value: exact) and summed in fp64, as is the reference Σ_t u'_t (with m = 0 the
  // u'_t are the inputs themselves), whose few terms add at most ~K·2^-53 relative error. So
  // |Σ sent − Σ u'| <= 2^-24 Σ_t (|v'_t| + |v_(t+1)|) + 1e-12 · Σ_t |u'_t| for every element.
  struct Case {
    CodecConfig c;
    size_t n;
  };
  for (const Case& tc :
       {Case{{.name = "dgc", .density = 0.01}, 20000},
        Case{{.name = "dgc", .density = 0.01, .momentum = 0.9}, 20000},
        Case{{.name = "dgc", .density = 0.005, .momentum = 0.9}, 100000},  // sampled selection
        Case{{.name = "dgc", .density = 0.01, .momentum = 0.5, .clip_norm = 100.0}, 100000},
        Case{{.name = "dgc", .density = 0.02, .momentum = 0.9, .sparse_values = DType::kF16},
             50000},
        Case{{.name = "dgc", .density = 0.01, .momentum = 0.9, .min_magnitude = 0.5}, 50000}}) {
    const CodecConfig& c = tc.c;
    const size_t n = tc.n;
    CAPTURE(testing::describe(c));
    CAPTURE(n);
    auto codec = make(c);
    const bool momentum = c.momentum > 0;
    const Chunking ch = chunkingFor(*codec, n, 7000);
    std::vector<std::byte> ws(codec->workspaceBytes(ch));
    CodecState state(codec->stateFloats(n));
    // An empty global selection of every chunk: a commit with it and nothing sent applies the
    // step's momentum correction and accumulation and masks nothing.
    std::vector<Bytes> nothing(ch.count());
    std::vector<uint64_t> scratch;
    for (size_t k = 0; k < ch.count(); ++k) {
      nothing[k].resize(sparseMaxPayloadBytes(ch.size(k), DType::kF32));
      const std::vector<float> zeros(ch.size(k), 0.0f);
      auto size = writeGlobalSelection(CodecId::kDgc, zeros, 0, 0, scratch, nothing[k]);
      REQUIRE(size.isOk());
      nothing[k].resize(*size);
    }
    std::vector<double> sent(n, 0.0), want(n, 0.0), tol(n, 0.0), mag(n, 0.0);
    const int steps = 6;
    for (int t = 0; t <= steps; ++t) {
      const std::vector<float> x = gaussian(n, 1000 + t);
      const ConstTensor xt{x.data(), n, DType::kF32};
      const StepContext ctx = ctxFor(t);
      // This step's v' as analyze() prepares it (in the work area), and u' and v' as a commit
      // leaves them before any masking.
      CodecState probe = state;
      REQUIRE(codec->analyze(ctx, ch, xt, probe, ws).isOk());
      const float* vn = probe.work(n);
      CodecState unmasked = state;
      StepContext deferred = ctx;
      deferred.defer_sent = true;
      REQUIRE(codec
                  ->commitState(deferred, ch, xt, testing::spans(nothing), testing::spans(nothing),
                                unmasked, ws)
                  .isOk());
      const float* un = momentum ? unmasked.current() : nullptr;
      CHECK(std::memcmp(unmasked.current() + (momentum ? n : 0), vn, n * sizeof(float)) == 0);
      if (momentum && c.clip_norm == 0.0) {
        // Momentum correction, independently: u' = ((float)m · u) + x.
        const float* u = state.current();
        size_t bad = 0;
        for (size_t i = 0; i < n; ++i) {
          const float mu = static_cast<float>(c.momentum) * u[i];
          bad += floatBits(mu + x[i]) != floatBits(un[i]);
        }
        CHECK(bad == 0);
      }
      for (size_t i = 0; i < n; ++i) {
        const double u = momentum ? un[i] : x[i];  // (the cases clip only with momentum)
        want[i] += u;
        mag[i] += std::fabs(u);
        tol[i] += std::ldexp(std::fabs(static_cast<double>(vn[i])), -24);
      }
      std::vector<float> got(n, 0.0f);
      if (t < steps) {
        std::vector<Bytes> payloads(ch.count());
        for (size_t k = 0; k < ch.count(); ++k) {
          Bytes& p = payloads[k];
          p.resize(codec->maxPayloadBytes(ch.size(k)));
          auto size = codec->encodeChunk(ctx, ch, k, 0, {}, xt, probe, ws, p);
          REQUIRE(size.isOk());
          p.resize(*size);
          REQUIRE(codec->decodeChunk(p, 1.0f, got.data() + ch.begin(k), ch.size(k)).isOk());
        }
        REQUIRE(codec->commitState(ctx, ch, xt, testing::spans(payloads), {}, state, ws).isOk());
        const float* v = state.current() + (momentum ? n : 0);
        for (size_t i = 0; i < n; ++i) tol[i] += std::ldexp(std::fabs(double{v[i]}), -24);
      } else {
        REQUIRE(codec->flush(ctx, ch, xt, state, got.data()).isOk());
        codec->commitFlush(state, n);
        CHECK(codec->residualNorm2(state, n) == 0.0);
      }
      for (size_t i = 0; i < n; ++i) sent[i] += got[i];
    }
    size_t bad = 0;
    double worst = 0.0;
    for (size_t i = 0; i < n; ++i) {
      const double err = std::fabs(sent[i] - want[i]);
      worst = std::max(worst, err);
      if (err > tol[i] + 1e-12 * mag[i]) ++bad;
    }
    CAPTURE(worst);
    CHECK(bad == 0);
  }
}

TEST_CASE("residualNorm2: the fp64 squared norm of what the state holds back") {
  const size_t n = 30000;
  for (const CodecConfig& c : everyCodec()) {
    CAPTURE(testing::describe(c));
    auto codec = make(c);
    const Chunking ch = chunkingFor(*codec, n, 4096);
    CodecState state(codec->stateFloats(n));
    CHECK(codec->residualNorm2(state, n) == 0.0);  // fresh
    for (uint64_t s = 0; s < 3; ++s) {
      compressedStep(*codec, ctxFor(s), ch, {gaussian(n, 60 + s).data(), n, DType::kF32}, state);
    }
    const double got = codec->residualNorm2(state, n);
    double want = 0.0;
    if (codec->stateFloats(n) > 0 && c.name != "none") {  // `none` + EF: the residual is 0
      // EF residual, powersgd error: the first n floats; dgc: v, after u when there is momentum.
      const size_t at = c.name == "dgc" && c.momentum > 0 ? n : 0;
      want = plainNorm2(state.current() + at, n);
      CHECK(want > 0.0);
      if (c.name == "dgc" && c.momentum > 0) {
        CHECK(plainNorm2(state.current(), n) > 0.0);  // u is non-zero and not counted
      }
    }
    CHECK(std::fabs(got - want) <= 1e-12 * want);
    // A state of another size holds nothing this codec can read.
    if (codec->stateFloats(n) > 0) {
      CHECK(codec->residualNorm2(state, n + 1) == 0.0);
      CHECK(codec->residualNorm2(CodecState{}, n) == 0.0);
    }
  }
}

TEST_CASE("restore: round-trips a committed state and refuses a wrong size") {
  auto codec = make({.name = "dgc", .density = 0.01, .momentum = 0.9});
  const size_t n = 5000;
  const Chunking ch = chunkingFor(*codec, n, 0);
  CodecState state(codec->stateFloats(n));
  for (uint64_t s = 0; s < 2; ++s) {
    compressedStep(*codec, ctxFor(s), ch, {gaussian(n, 70 + s).data(), n, DType::kF32}, state);
  }
  const std::vector<float> saved = current(state);  // a checkpoint

  CodecState loaded(codec->stateFloats(n));
  float* work = loaded.work(n);
  std::fill(work, work + n, 3.0f);
  REQUIRE(loaded.restore(saved).isOk());
  CHECK(bitEqual(current(loaded), saved));
  CHECK(loaded.work(n) == work);
  CHECK(std::all_of(work, work + n, [](float v) { return v == 3.0f; }));  // work area untouched
  CHECK(codec->residualNorm2(loaded, n) == codec->residualNorm2(state, n));
  // The restored state continues exactly as the original.
  const std::vector<float> x = gaussian(n, 80);
  auto a = encodeTensor(*codec, ctxFor(2), ch, {x.data(), n, DType::kF32}, state);
  auto b = encodeTensor(*codec, ctxFor(2), ch, {x.data(), n, DType::kF32}, loaded);
  REQUIRE(a.isOk());
  REQUIRE(b.isOk());
  CHECK(*a == *b);

  const std::vector<float> before = current(loaded);
  const std::vector<float> short_one(saved.begin(), saved.end() - 1);
  Status s = loaded.restore(short_one);
  CHECK(s.code() == lightwire::StatusCode::kInvalidArgument);
  CHECK(s.message().find(std::to_string(saved.size())) != std::string::npos);
  CHECK(s.message().find(std::to_string(short_one.size())) != std::string::npos);
  CHECK(bitEqual(current(loaded), before));
  CodecState none;
  CHECK(none.restore({}).isOk());
  CHECK(!none.restore(saved).isOk());
}

// --- min_magnitude ------------------------------------------------------------------------------

TEST_CASE("min_magnitude: validated in createCodec, part of configKey only when set") {
  for (const char* name : {"topk", "dgc", "threshold", "none", "qsgd"}) {
    CAPTURE(name);
    CodecConfig c{.name = name, .density = 0.1, .threshold = 1.0};
    if (std::string(name) != "topk" && std::string(name) != "dgc") c.density.reset();
    const std::string base = configKey(c);
    CHECK(base.find("min_magnitude") == std::string::npos);
    for (double bad :
         {-1.0, -1e-300, std::numeric_limits<double>::quiet_NaN(),
          std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()}) {
      c.min_magnitude = bad;
      auto r = createCodec(c);
      REQUIRE(!r.isOk());
      CHECK(r.status().code() == lightwire::StatusCode::kInvalidArgument);
      CHECK(r.status().message().find("min_magnitude") != std::string::npos);
    }
    c.min_magnitude = -0.0;
    CHECK(createCodec(c).isOk());
    CHECK(configKey(c) == base);
    c.min_magnitude = 0.0;
    CHECK(configKey(c) == base);
    c.min_magnitude = 1e-3;
    REQUIRE(createCodec(c).isOk());
    const std::string k1 = configKey(c);
    CHECK(k1 != base);
    CHECK(k1.rfind(base, 0) == 0);  // the old key, extended
    c.min_magnitude = 2e-3;
    CHECK(configKey(c) != k1);
  }
  // The key of an untouched configuration is what it always was.
  CHECK(configKey({.name = "topk", .density = 0.01}) == "topk|0.01|-|8|512|0|0|0.01|0|-|-1|1");
  // nominalPayloadBytes is an estimate from the configuration: unchanged.
  auto plain = make({.name = "topk", .density = 0.01});
  auto floored = make({.name = "topk", .density = 0.01, .min_magnitude = 1.0});
  CHECK(plain->nominalPayloadBytes(100000) == floored->nominalPayloadBytes(100000));
}

TEST_CASE("min_magnitude: tiny elements are never sent and stay in the residual") {
  // 10 % large elements, 90 % tiny ones; the selection sizes take far more than the large ones.
  const size_t n = 40000;
  std::vector<float> x = gaussian(n, 90, 1e-6f);
  std::set<size_t> large;
  for (size_t i = 0; i < n; i += 10) {
    x[i] = (i % 20 == 0 ? 1.0f : -1.0f) * (1.0f + static_cast<float>(i % 7));
    large.insert(i);
  }
  for (CodecConfig c : {CodecConfig{.name = "topk", .density = 0.5},
                        CodecConfig{.name = "topk", .density = 0.5, .sparse_values = DType::kF16},
                        CodecConfig{.name = "topk", .density = 1.0, .error_feedback = false},
                        CodecConfig{.name = "dgc", .density = 0.5, .momentum = 0.9},
                        CodecConfig{.name = "dgc", .density = 0.3},
                        CodecConfig{.name = "threshold", .threshold = 1e-30}}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      c.min_magnitude = 1e-3;
      CAPTURE(testing::describe(c));
      CAPTURE(dtypeName(dtype));
      auto codec = make(c);
      const Input in(x, dtype);
      const Chunking ch = chunkingFor(*codec, n, 6000);
      CodecState state(codec->stateFloats(n));
      auto payloads = stepTensor(*codec, ctxFor(0), ch, in.tensor(), state);
      REQUIRE(payloads.isOk());
      size_t nnz = 0, tiny = 0;
      for (size_t k = 0; k < ch.count(); ++k) {
        const Sparse s = parseSparse((*payloads)[k]);
        nnz += s.idx.size();
        for (uint32_t i : s.idx) tiny += large.count(ch.begin(k) + i) == 0;
      }
      CHECK(tiny == 0);
      CHECK(nnz == large.size());
      if (codec->stateFloats(n) > 0) {
        // The kept residual (EF e', dgc v') holds every tiny element as it was.
        const float* kept = state.current() + (c.name == "dgc" && c.momentum > 0 ? n : 0);
        size_t lost = 0;
        for (size_t i = 0; i < n; ++i) {
          if (large.count(i) == 0) lost += floatBits(kept[i]) != floatBits(in.f32[i]);
        }
        CHECK(lost == 0);
        const double r2 = codec->residualNorm2(state, n);
        double tiny2 = 0.0;
        for (size_t i = 0; i < n; ++i) {
          if (large.count(i) == 0) tiny2 += double{in.f32[i]} * double{in.f32[i]};
        }
        // fp32 values: only the tiny ones remain; fp16 values add the large ones' rounding.
        if (c.sparse_values == DType::kF32) CHECK(std::fabs(r2 - tiny2) <= 1e-9 * tiny2);
        if (c.name == "dgc" && c.momentum > 0) {
          // Momentum factor masking only for what was sent: u' of a tiny element stays.
          size_t masked = 0;
          for (size_t i = 0; i < n; ++i) masked += large.count(i) == 0 && state.current()[i] == 0;
          CHECK(masked == 0);
        }
      }
    }
  }
}

TEST_CASE("min_magnitude: a filter on the selection, at the fp32 boundary, on every SIMD path") {
  // Sent set with min_magnitude m = sent set without it ∩ {!(|v| < m)}, values unchanged; the
  // sizes reach every selection path (topk: histogram, guided, listed; dgc: exact, sampled and
  // listed); every Highway target gives the same bytes.
  const double m = 0.1;  // not an fp32 value: (float)0.1 > 0.1
  const float at = static_cast<float>(m);
  const float below = std::nextafter(at, 0.0f);
  // Scales put the plain selection's smallest magnitudes well below m, so the filter removes
  // some of what it selects.
  struct Case {
    CodecConfig c;
    size_t n;
    float scale;
  };
  std::vector<Case> cases = {
      {{.name = "topk", .density = 0.8, .error_feedback = false}, 3000, 0.2f},  // histogram
      {{.name = "topk", .density = 0.05}, 300000, 0.03f},                       // guided list
      {{.name = "topk", .density = 0.6, .error_feedback = false}, 300000, 0.1f},
      {{.name = "dgc", .density = 0.8, .momentum = 0.5}, 3000, 0.2f},      // exact
      {{.name = "dgc", .density = 0.05, .momentum = 0.5}, 200000, 0.03f},  // sampled, listed
      {{.name = "dgc", .density = 0.05, .sparse_values = DType::kF16}, 200000, 0.03f},
      {{.name = "threshold", .threshold = 0.01}, 50000, 0.2f},
      {{.name = "threshold", .sparse_values = DType::kF16, .threshold = 0.01}, 50000, 0.2f},
  };
  for (const Case& tc : cases) {
    for (DType dtype : {DType::kF32, DType::kF16}) {
      const size_t n = tc.n;
      CAPTURE(testing::describe(tc.c));
      CAPTURE(n);
      CAPTURE(dtypeName(dtype));
      std::vector<float> x = gaussian(n, 7, tc.scale);
      // Boundary values and specials at fixed places.
      for (size_t i = 0; i + 5 < n; i += 97) {
        x[i] = at;
        x[i + 1] = -below;
        x[i + 2] = -at;
      }
      x[5] = std::numeric_limits<float>::quiet_NaN();
      x[6] = -std::numeric_limits<float>::infinity();
      const Input in(x, dtype);
      CodecConfig with = tc.c;
      with.min_magnitude = m;
      auto plain = make(tc.c);
      auto floored = make(with);
      const Chunking ch = chunkingFor(*plain, n, 50000);
      std::vector<std::vector<Bytes>> per_target;
      for (int64_t target : simd::availableTargets()) {
        simd::ScopedTargetForTest force(target);
        CodecState s0(plain->stateFloats(n)), s1(floored->stateFloats(n));
        auto a = encodeTensor(*plain, ctxFor(3), ch, in.tensor(), s0);
        auto b = encodeTensor(*floored, ctxFor(3), ch, in.tensor(), s1);
        REQUIRE(a.isOk());
        REQUIRE(b.isOk());
        per_target.push_back(*b);
        size_t bad = 0, at_kept = 0, below_sent = 0, nnz = 0, removed = 0;
        for (size_t k = 0; k < ch.count(); ++k) {
          const Sparse pa = parseSparse((*a)[k]);
          const Sparse pb = parseSparse((*b)[k]);
          Sparse want;
          for (size_t j = 0; j < pa.idx.size(); ++j) {
            // The value the plain codec sends (fp16 values: its fp32 source decides, which the
            // plain payload does not carry, so use the input where it is the sent value).
            const size_t i = ch.begin(k) + pa.idx[j];
            const float v = tc.c.sparse_values == DType::kF16 ? in.f32[i] : pa.val[j];
            if (!(std::fabs(static_cast<double>(v)) < m)) {
              want.idx.push_back(pa.idx[j]);
              want.val.push_back(pa.val[j]);
            }
          }
          removed += pa.idx.size() - want.idx.size();
          bad += want.idx != pb.idx;
          bad += !bitEqual(want.val, pb.val);  // NaN bits too: the same computation made them
          nnz += pb.idx.size();
          for (uint32_t li : pb.idx) {
            const float v = in.f32[ch.begin(k) + li];
            at_kept += std::fabs(v) == at;
            below_sent += std::fabs(v) == below;
          }
        }
        CHECK(bad == 0);
        CHECK(below_sent == 0);
        CHECK(nnz > 0);
        CHECK(removed > 0);
        if (dtype == DType::kF32) CHECK(at_kept > 0);  // |x| = (float)m >= m is sent
      }
      for (size_t t = 1; t < per_target.size(); ++t) CHECK(per_target[t] == per_target[0]);
    }
  }
}

TEST_CASE("min_magnitude: everything below it gives empty, valid payloads") {
  const size_t n = 1000;
  const std::vector<float> x = gaussian(n, 3, 1e-4f);
  for (CodecConfig c :
       {CodecConfig{.name = "topk", .density = 0.1, .min_magnitude = 1.0},
        CodecConfig{.name = "dgc", .density = 0.1, .min_magnitude = 1.0},
        CodecConfig{.name = "threshold", .threshold = 1e-9, .min_magnitude = 1.0}}) {
    CAPTURE(c.name);
    auto codec = make(c);
    const Chunking ch = chunkingFor(*codec, n, 300);
    CodecState state(codec->stateFloats(n));
    auto payloads = stepTensor(*codec, ctxFor(0), ch, {x.data(), n, DType::kF32}, state);
    REQUIRE(payloads.isOk());
    std::vector<float> out(n, 0.0f);
    REQUIRE(decodeTensor(*codec, ch, *payloads, 1.0f, out.data()).isOk());
    CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 0.0f; }));
    for (const auto& p : *payloads) CHECK(p.size() == kHeaderBytes + 8);  // nnz = 0, w = 0
    // Everything stayed behind; a flush sends it.
    CHECK(std::fabs(codec->residualNorm2(state, n) - plainNorm2(x.data(), n)) <=
          1e-12 * plainNorm2(x.data(), n));
    std::vector<float> flushed(n);
    const std::vector<float> zero(n, 0.0f);
    REQUIRE(
        codec->flush(ctxFor(1), ch, {zero.data(), n, DType::kF32}, state, flushed.data()).isOk());
    CHECK(bitEqual(flushed, x));
  }
}

}  // namespace test_flush
