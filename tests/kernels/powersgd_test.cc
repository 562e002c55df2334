// powersgd (docs/determinism.md §4.12): exactness on low-rank matrices, error vs rank, warm start,
// multi-rank agreement, error feedback, atomicity, thread independence, views, hostile payloads.
#include <doctest.h>

#include <cmath>
#include <cstring>

#include "kernels/parallel.h"
#include "kernels/simd/targets.h"
#include "tests/kernels/multirank.h"
#include "tests/kernels/test_util.h"

namespace lightwire::kernels {
namespace test_powersgd {

using testing::gaussian;
using testing::make;
using testing::runMultiRank;

std::unique_ptr<Codec> psgd(int rank) { return make({.name = "powersgd", .approx_rank = rank}); }

/// rows × cols matrix A·Bᵀ of rank r (row-major).
std::vector<float> lowRank(size_t rows, size_t cols, size_t r, uint64_t seed) {
  const auto a = gaussian(rows * r, seed), b = gaussian(cols * r, seed + 1);
  std::vector<float> m(rows * cols);
  for (size_t i = 0; i < rows; ++i)
    for (size_t k = 0; k < cols; ++k) {
      double s = 0;
      for (size_t j = 0; j < r; ++j) s += double(a[i * r + j]) * double(b[k * r + j]);
      m[i * cols + k] = float(s);
    }
  return m;
}

double norm(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += double(x) * double(x);
  return std::sqrt(s);
}

double relErr(const std::vector<float>& want, const std::vector<float>& got) {
  std::vector<float> d(want.size());
  for (size_t i = 0; i < d.size(); ++i) d[i] = want[i] - got[i];
  return norm(d) / norm(want);
}

/// One W = 1 step (weight 1) on x with the given shape; commits when asked (else commitLater()
/// with `out` commits it).
std::vector<float> step(const Codec& c, const std::vector<float>& x, CodecState& state,
                        std::vector<uint64_t> shape, uint64_t step_no = 0, bool commit = true,
                        testing::MultiRankStep* out = nullptr, CpuStream* stream = nullptr) {
  StepContext ctx{.seed = 7, .name_key = 11, .step = step_no, .stream = stream, .shape = shape};
  const std::vector<std::vector<float>> inputs{x};
  std::vector<CodecState> states{std::move(state)};
  auto r = runMultiRank(c, ctx, inputs, states, 1.0f);
  REQUIRE_MESSAGE(r.isOk(), r.status().message());
  if (commit) REQUIRE(testing::commitMultiRank(c, ctx, inputs, states, *r).isOk());
  state = std::move(states[0]);
  if (out) *out = *r;
  return r->decoded[0];
}

/// Commits a step that step() left uncommitted: the same x, shape and step number, `r` its `out`.
void commitLater(const Codec& c, const std::vector<float>& x, CodecState& state,
                 std::vector<uint64_t> shape, uint64_t step_no, testing::MultiRankStep& r) {
  StepContext ctx{.seed = 7, .name_key = 11, .step = step_no, .shape = shape};
  std::vector<CodecState> states{std::move(state)};
  const Status st = testing::commitMultiRank(c, ctx, {x}, states, r);
  state = std::move(states[0]);
  REQUIRE_MESSAGE(st.isOk(), st.message());
}

/// The state of a tensor of n elements with `shape`: PowerSGD's is sized by its matrix view.
CodecState stateFor(const Codec& c, size_t n, std::vector<uint64_t> shape = {}) {
  return CodecState(c.stateFloats(n, shape));
}

std::vector<float> residual(const CodecState& s, size_t n) {
  return {s.currentSpan().begin(), s.currentSpan().begin() + n};
}

TEST_CASE("powersgd: exact on a rank-r matrix when approx_rank >= r") {
  const size_t rows = 40, cols = 30;
  for (size_t r : {1, 3}) {
    const auto m = lowRank(rows, cols, r, 100 + r);
    for (int approx : {int(r), int(r) + 2}) {
      CAPTURE(r);
      CAPTURE(approx);
      auto c = psgd(approx);
      CodecState state = stateFor(*c, m.size(), {rows, cols});
      const auto decoded = step(*c, m, state, {rows, cols});
      CHECK(relErr(m, decoded) < 1e-5);
      CHECK(norm(residual(state, m.size())) < 1e-5 * norm(m));
    }
  }
}

TEST_CASE("powersgd: the error shrinks as approx_rank grows") {
  const size_t rows = 64, cols = 48;
  const auto m = gaussian(rows * cols, 5);
  double last = 2.0;
  for (int r : {1, 2, 4, 8, 16, 32, 48}) {
    auto c = psgd(r);
    CodecState state = stateFor(*c, m.size(), {rows, cols});
    const double e = relErr(m, step(*c, m, state, {rows, cols}));
    CAPTURE(r);
    CHECK(e < last);
    last = e;
  }
  CHECK(last < 1e-5);  // rank 48 = full rank
}

TEST_CASE("powersgd: warm start (a second step on the same matrix is at least as good)") {
  // Decaying spectrum: a rank-8 matrix plus a little noise, approximated with rank 4.
  const size_t rows = 60, cols = 50, n = rows * cols;
  auto m = lowRank(rows, cols, 8, 9);
  for (size_t i = 0; i < n; ++i) m[i] *= 1.0f + 0.1f * float(i % 7);
  auto c = psgd(4);
  CodecState state = stateFor(*c, n, {rows, cols});
  const double e1 = relErr(m, step(*c, m, state, {rows, cols}, 0));
  // Feed x2 = M − e1 so that the second step's matrix x2 + e1 is M again (to fp32 rounding).
  const auto e = residual(state, n);
  std::vector<float> x2(n);
  for (size_t i = 0; i < n; ++i) x2[i] = m[i] - e[i];
  const double e2 = relErr(m, step(*c, x2, state, {rows, cols}, 1));
  CHECK(e2 <= e1 * (1 + 1e-6));
  MESSAGE("rank-4 relative error: cold start " << e1 << ", warm start " << e2);
}

TEST_CASE("powersgd: W ranks agree bitwise, and W identical ranks decode as one") {
  const size_t rows = 33, cols = 21, n = rows * cols;
  auto c = psgd(3);
  const std::vector<uint64_t> shape{rows, cols};
  const StepContext ctx{.seed = 3, .name_key = 4, .step = 9, .shape = shape};
  std::vector<float> single;
  for (size_t world : {1, 2, 3}) {
    CAPTURE(world);
    std::vector<std::vector<float>> inputs;
    for (size_t rank = 0; rank < world; ++rank) inputs.push_back(gaussian(n, 50 + rank));
    std::vector<CodecState> states(world, stateFor(*c, n, shape));
    auto r = runMultiRank(*c, ctx, inputs, states, 1.0f / float(world));
    REQUIRE_MESSAGE(r.isOk(), r.status().message());
    for (size_t rank = 1; rank < world; ++rank) {
      CHECK(testing::bitEqual(r->decoded[0], r->decoded[rank]));
    }
    // The warm start agrees too; each rank's residual is its own M minus the common result.
    REQUIRE(testing::commitMultiRank(*c, ctx, inputs, states, *r).isOk());
    for (size_t rank = 0; rank < world; ++rank) {
      const auto s = states[rank].currentSpan();
      const auto s0 = states[0].currentSpan();
      CHECK(std::memcmp(s.data() + n, s0.data() + n, (s.size() - n) * 4) == 0);
      for (size_t i = 0; i < n; i += 37) {
        CHECK(s[i] + r->decoded[rank][i] == doctest::Approx(inputs[rank][i]).epsilon(1e-5));
      }
    }
    // W copies of one input decode bitwise as a single rank (sums of equal payloads scale by W).
    std::vector<std::vector<float>> same(world, gaussian(n, 77));
    std::vector<CodecState> fresh(world, stateFor(*c, n, shape));
    auto s = runMultiRank(*c, ctx, same, fresh, 1.0f / float(world));
    REQUIRE(s.isOk());
    if (world == 1) single = s->decoded[0];
    if (world == 2) CHECK(testing::bitEqual(single, s->decoded[1]));
  }
}

TEST_CASE("powersgd: error feedback (decoded + e' = M) and atomicity of prepare") {
  const size_t n = 1000;  // flat view: cols = 32, rows = 32, 24 padding elements
  auto c = psgd(2);
  CodecState state(c->stateFloats(n));
  const auto x1 = gaussian(n, 1), x2 = gaussian(n, 2);
  testing::MultiRankStep r1, r2;
  const auto d1 = step(*c, x1, state, {}, 0, false, &r1);
  for (float v : state.currentSpan()) REQUIRE(v == 0.0f);  // finished, not committed
  commitLater(*c, x1, state, {}, 0, r1);
  auto e1 = residual(state, n);
  for (size_t i = 0; i < n; ++i) CHECK(d1[i] + e1[i] == doctest::Approx(x1[i]).epsilon(1e-6));
  const std::vector<float> snapshot(state.currentSpan().begin(), state.currentSpan().end());
  const auto d2 = step(*c, x2, state, {}, 1, false, &r2);
  CHECK(testing::bitEqual(snapshot, {state.currentSpan().begin(), state.currentSpan().end()}));
  commitLater(*c, x2, state, {}, 1, r2);
  const auto e2 = residual(state, n);
  for (size_t i = 0; i < n; ++i) {
    CHECK(d2[i] + e2[i] == doctest::Approx(x2[i] + e1[i]).epsilon(1e-6).scale(1e-6));
  }
  // finishStep() without analyze(), or twice, is refused.
  {
    testing::MultiRankStep r;
    CodecState s(c->stateFloats(n));
    step(*c, x1, s, {}, 0, false, &r);
    const std::vector<std::span<const uint8_t>> v{r.reduced[0], r.reduced[1]};
    const Chunking ch = chunkingFor(*c, n, 0);
    // Twice: the workspace of the step that finished.
    CHECK(!c->finishStep({}, ch, v, 1.0f, ConstTensor{x1.data(), n}, s, r.workspaces[0]).isOk());
    // Without analyze(): a fresh state and workspace.
    std::vector<std::byte> ws(c->workspaceBytes(ch));
    CodecState fresh(c->stateFloats(n));
    CHECK(!c->finishStep({}, ch, v, 1.0f, ConstTensor{x1.data(), n}, fresh, ws).isOk());
  }
  // Over steps, the sum of what was sent tracks the sum of the gradients (bounded residual).
  CHECK(norm(e2) < norm(x1) + norm(x2));
}

TEST_CASE("powersgd: payloads and results independent of the thread count") {
  const size_t rows = 700, cols = 300, n = rows * cols;
  const auto x = gaussian(n, 8);
  auto c = psgd(4);
  CpuStream one(1), two(2);
  CodecState s1 = stateFor(*c, n, {rows, cols}), s2 = stateFor(*c, n, {rows, cols});
  testing::MultiRankStep a, b;
  const auto d1 = step(*c, x, s1, {rows, cols}, 0, true, &a, &one);
  const auto d2 = step(*c, x, s2, {rows, cols}, 0, true, &b, &two);
  CHECK(a.reduced == b.reduced);
  CHECK(testing::bitEqual(d1, d2));
  const std::vector<float> c1(s1.currentSpan().begin(), s1.currentSpan().end());
  const std::vector<float> c2(s2.currentSpan().begin(), s2.currentSpan().end());
  CHECK(testing::bitEqual(c1, c2));
  // And null stream (calling thread only) gives the same bytes.
  CodecState s3 = stateFor(*c, n, {rows, cols});
  testing::MultiRankStep d;
  step(*c, x, s3, {rows, cols}, 0, true, &d, nullptr);
  CHECK(a.reduced == d.reduced);
}

TEST_CASE("powersgd: every SIMD target gives the same bytes") {
  // Odd sizes so that vector loops leave tails; a padded flat view and a shaped one; rank 5 spans
  // two groups of the Mᵀ·P̂ tile; the second step uses the warm start.
  struct Case {
    size_t n;
    std::vector<uint64_t> shape;
    int rank;
  };
  for (const Case& k : {Case{10007, {}, 5}, Case{131 * 77, {131, 7, 11}, 3}, Case{9, {}, 2}}) {
    CAPTURE(k.n);
    auto c = psgd(k.rank);
    const auto x1 = gaussian(k.n, 21), x2 = gaussian(k.n, 22);
    auto run = [&] {
      CodecState s = stateFor(*c, k.n, k.shape);
      testing::MultiRankStep a, b;
      CpuStream two(2);
      step(*c, x1, s, k.shape, 0, true, &a, &two);
      step(*c, x2, s, k.shape, 1, true, &b, &two);
      std::vector<uint8_t> bytes;
      for (const auto* st : {&a, &b}) {
        for (const auto& p : st->reduced) bytes.insert(bytes.end(), p.begin(), p.end());
        const auto* d = reinterpret_cast<const uint8_t*>(st->decoded[0].data());
        bytes.insert(bytes.end(), d, d + 4 * k.n);
      }
      const auto* f = reinterpret_cast<const uint8_t*>(s.currentSpan().data());
      bytes.insert(bytes.end(), f, f + 4 * s.floats());
      return bytes;
    };
    const auto want = run();
    for (int64_t t : simd::availableTargets()) {
      CAPTURE(simd::targetName(t));
      const simd::ScopedTargetForTest force(t);
      CHECK(run() == want);
    }
  }
}

TEST_CASE("powersgd: shape-driven and flat views") {
  auto c = psgd(2);
  auto dims = [](const std::vector<uint8_t>& p) {
    return std::array<uint32_t, 3>{loadU32(p.data() + 16), loadU32(p.data() + 20),
                                   loadU32(p.data() + 24)};
  };
  testing::MultiRankStep r;
  {  // [20, 3, 5] -> 20 x 15
    const auto x = gaussian(300, 1);
    CodecState s = stateFor(*c, 300, {20, 3, 5});
    step(*c, x, s, {20, 3, 5}, 0, true, &r);
    CHECK(dims(r.reduced[0]) == std::array<uint32_t, 3>{20, 15, 2});
    CHECK(r.reduced[0].size() == 32 + 4 * 20 * 2);
    CHECK(r.reduced[1].size() == 32 + 4 * 15 * 2);
  }
  {  // flat 300 -> cols 18, rows 17 (6 padding elements); a 1-d shape is flat too
    const auto x = gaussian(300, 1);
    CodecState s(c->stateFloats(300));
    step(*c, x, s, {300}, 0, true, &r);
    CHECK(dims(r.reduced[0]) == std::array<uint32_t, 3>{17, 18, 2});
  }
  {  // tiny: n = 1 -> 1 x 1, rank clamped to 1; n = 3 -> 2 x 2 with padding
    for (size_t n : {1, 2, 3, 5}) {
      CAPTURE(n);
      const auto x = gaussian(n, n);
      CodecState s(c->stateFloats(n));
      const auto d = step(*c, x, s, {}, 0, true, &r);
      const auto e = residual(s, n);
      for (size_t i = 0; i < n; ++i) CHECK(d[i] + e[i] == doctest::Approx(x[i]).epsilon(1e-6));
    }
    const auto x = gaussian(4, 4);
    CodecState s(c->stateFloats(4));
    CHECK(relErr(x, step(*c, x, s, {}, 0, true, &r)) < 1e-6);  // 2 x 2 with rank 2: exact
    CHECK(dims(r.reduced[0]) == std::array<uint32_t, 3>{2, 2, 2});
  }
  {  // empty tensor
    CodecState s(c->stateFloats(0));
    std::vector<float> x;
    step(*c, x, s, {}, 0, true, &r);
    CHECK(r.reduced[0].size() == 32);
  }
  {  // a shape that does not match the element count
    const auto x = gaussian(10, 1);
    CodecState s(c->stateFloats(10));
    std::vector<uint64_t> shape{3, 4};
    StepContext ctx{.shape = shape};
    std::vector<std::byte> ws(c->workspaceBytes(chunkingFor(*c, 10, 0)));
    Status st = c->analyze(ctx, chunkingFor(*c, 10, 0), ConstTensor{x.data(), 10}, s, ws);
    CHECK(!st.isOk());
    CHECK(st.message().find("shape") != std::string::npos);
  }
  for (const std::vector<uint64_t>& shape : {std::vector<uint64_t>{5, 0}, {0, 7}, {1u << 31, 0}}) {
    // An empty tensor whose zero dimension comes after others (found by fuzzing: refused).
    CodecState s(c->stateFloats(0));
    const StepContext ctx{.shape = shape};
    std::vector<std::byte> ws(c->workspaceBytes(chunkingFor(*c, 0, 0)));
    CHECK(c->analyze(ctx, chunkingFor(*c, 0, 0), ConstTensor{nullptr, 0}, s, ws).isOk());
  }
}

TEST_CASE("powersgd: the state holds the error, the meta block and its view's Q, no more") {
  auto c = psgd(4);
  // 2-D and 3-D shapes: rows = shape[0], cols = n / rows; Q is cols x min(4, rows, cols).
  CHECK(c->stateFloats(600, std::vector<uint64_t>{30, 20}) == 600 + 8 + 20 * 4);
  CHECK(c->stateFloats(600, std::vector<uint64_t>{20, 30}) == 600 + 8 + 30 * 4);
  CHECK(c->stateFloats(300, std::vector<uint64_t>{20, 3, 5}) == 300 + 8 + 15 * 4);
  CHECK(c->stateFloats(8200, std::vector<uint64_t>{4100, 2}) == 8200 + 8 + 2 * 2);  // rank 2
  // No shape, one dimension, or one that does not hold n: the squarest view (300: 17 x 18).
  CHECK(c->stateFloats(300) == 300 + 8 + 18 * 4);
  CHECK(c->stateFloats(300, std::vector<uint64_t>{300}) == c->stateFloats(300));
  CHECK(c->stateFloats(300, std::vector<uint64_t>{3, 4}) == c->stateFloats(300));
  CHECK(c->stateFloats(0, std::vector<uint64_t>{5, 0}) == 0);
  CHECK(c->stateFloats(1) == 1 + 8 + 1);
  // The largest view a 1 GB fp32 tensor can take at rank 1: about n, not 2n.
  const size_t big = size_t{1} << 28;
  CHECK(psgd(1)->stateFloats(big) == big + 8 + (size_t{1} << 14));
  // A state sized for another view is refused, naming both sizes.
  const auto x = gaussian(600, 3);
  CodecState wrong = stateFor(*c, 600, {20, 30});
  const std::vector<uint64_t> shape{30, 20};
  const StepContext ctx{.shape = shape};
  std::vector<std::byte> ws(c->workspaceBytes(chunkingFor(*c, 600, 0)));
  const Status st = c->analyze(ctx, chunkingFor(*c, 600, 0), ConstTensor{x.data(), 600}, wrong, ws);
  CHECK(!st.isOk());
  CHECK(st.message().find(std::to_string(600 + 8 + 30 * 4)) != std::string::npos);
  CHECK(st.message().find(std::to_string(600 + 8 + 20 * 4)) != std::string::npos);
  // residualNorm2 reads the error of a state of any view of n, and nothing of another n.
  CodecState s = stateFor(*c, 600, {30, 20});
  step(*c, x, s, {30, 20}, 0);
  CHECK(c->residualNorm2(s, 600) > 0.0);
  CHECK(c->residualNorm2(s, 601) == 0.0);
  CHECK(c->residualNorm2(s, 599) == 0.0);
}

TEST_CASE("powersgd: a change of view keeps the error and draws the warm start afresh") {
  // The state resized to the new view (CodecState::resize keeps the error, zeroes the rest):
  // the step equals one from a state with the same error and no warm start.
  auto c = psgd(2);
  const size_t n = 600;
  const auto x1 = gaussian(n, 31), x2 = gaussian(n, 32);
  CodecState s = stateFor(*c, n, {30, 20});
  step(*c, x1, s, {30, 20}, 0);
  const auto e = residual(s, n);
  s.resize(c->stateFloats(n, std::vector<uint64_t>{20, 30}), n);
  CHECK(s.floats() == n + 8 + 30 * 2);
  CHECK(testing::bitEqual(residual(s, n), e));
  CodecState cold = stateFor(*c, n, {20, 30});
  std::vector<float> full(cold.floats(), 0.0f);
  std::copy(e.begin(), e.end(), full.begin());
  REQUIRE(cold.restore(full).isOk());
  testing::MultiRankStep a, b;
  const auto d1 = step(*c, x2, s, {20, 30}, 1, true, &a);
  const auto d2 = step(*c, x2, cold, {20, 30}, 1, true, &b);
  CHECK(a.reduced == b.reduced);
  CHECK(testing::bitEqual(d1, d2));
  CHECK(testing::bitEqual({s.currentSpan().begin(), s.currentSpan().end()},
                          {cold.currentSpan().begin(), cold.currentSpan().end()}));
}

TEST_CASE("powersgd: rejects chunking, decodeChunk, and bad configs") {
  auto c = psgd(2);
  const auto x = gaussian(100, 1);
  CodecState s(c->stateFloats(100));
  const Chunking two{100, 50};
  std::vector<std::byte> ws(c->workspaceBytes(two));
  Status st = c->analyze({}, two, ConstTensor{x.data(), 100}, s, ws);
  CHECK(!st.isOk());
  CHECK(st.message().find("chunkingFor") != std::string::npos);
  CHECK(chunkingFor(*c, 100, 10).count() == 1);

  float out = 0;
  std::vector<uint8_t> p(64, 0);
  st = c->decodeChunk(p, 1.0f, &out, 1);
  CHECK(!st.isOk());
  CHECK(st.message().find("decodeRounds") != std::string::npos);

  for (int bad : {0, -1, 1025}) {
    auto r = createCodec({.name = "powersgd", .approx_rank = bad});
    CHECK(!r.isOk());
    if (!r.isOk()) CHECK(r.status().message().find("approx_rank") != std::string::npos);
  }
  auto ef = createCodec({.name = "powersgd", .error_feedback = true, .approx_rank = 2});
  CHECK(!ef.isOk());
  CHECK(createCodec({.name = "powersgd", .error_feedback = false, .approx_rank = 2}).isOk());
  CHECK(c->traits().rounds == 2);
  CHECK(c->traits().own_memory);
  CHECK(c->traits().summable);
  CHECK(c->traits().single_chunk);
}

TEST_CASE("powersgd: non-finite gradients propagate") {
  auto c = psgd(2);
  auto x = gaussian(400, 3);
  x[17] = std::nanf("");
  CodecState s = stateFor(*c, 400, {20, 20});
  const auto d = step(*c, x, s, {20, 20}, 0, false);
  CHECK(std::isnan(d[17]));
}

TEST_CASE("powersgd: hostile reduced payloads leave out untouched") {
  const size_t rows = 12, cols = 10, n = rows * cols;
  auto c = psgd(3);
  CodecState s = stateFor(*c, n, {rows, cols});
  testing::MultiRankStep r;
  step(*c, gaussian(n, 4), s, {rows, cols}, 0, false, &r);
  const std::vector<float> sentinel(n, 42.0f);
  auto decode = [&](const std::vector<uint8_t>& p0, const std::vector<uint8_t>& p1) {
    std::vector<float> out = sentinel;
    const std::vector<std::span<const uint8_t>> v{p0, p1};
    Status st = c->decodeRounds(v, 1.0f, out.data(), n);
    CHECK(testing::bitEqual(out, sentinel) == !st.isOk());
    if (st.isOk()) return st;
    CHECK(!st.message().empty());
    return st;
  };
  CHECK(decode(r.reduced[0], r.reduced[1]).isOk());
  // Truncated at every length, and a trailing byte, in either round.
  for (int which = 0; which < 2; ++which) {
    auto good = r.reduced[which];
    for (size_t len = 0; len < good.size(); ++len) {
      std::vector<uint8_t> t(good.begin(), good.begin() + len);
      CHECK(!(which == 0 ? decode(t, r.reduced[1]) : decode(r.reduced[0], t)).isOk());
    }
    auto longer = good;
    longer.push_back(0);
    CHECK(!(which == 0 ? decode(longer, r.reduced[1]) : decode(r.reduced[0], longer)).isOk());
  }
  auto mutate = [&](int which, size_t offset, uint32_t value, bool u32 = true) {
    auto p0 = r.reduced[0], p1 = r.reduced[1];
    auto& p = which == 0 ? p0 : p1;
    if (u32)
      storeU32(p.data() + offset, value);
    else
      p[offset] = uint8_t(value);
    return decode(p0, p1);
  };
  CHECK(!mutate(0, 16, rows + 1).isOk());  // rows inconsistent with the element count
  CHECK(!mutate(0, 16, 0).isOk());
  CHECK(!mutate(1, 20, cols - 1).isOk());  // cols
  CHECK(!mutate(0, 24, 2).isOk());         // rank not the configured one
  CHECK(!mutate(1, 24, 0).isOk());
  CHECK(!mutate(0, 28, 1).isOk());        // reserved
  CHECK(!mutate(0, 6, 1, false).isOk());  // round-1 payload where round 0 belongs
  CHECK(!mutate(1, 6, 0, false).isOk());
  CHECK(!mutate(1, 6, 2, false).isOk());         // round out of range
  CHECK(!mutate(0, 3, 0, false).isOk());         // codec id 0: no dense escape for factors
  CHECK(!mutate(0, 5, 1, false).isOk());         // flags
  CHECK(!mutate(0, 8, uint32_t(n + 1)).isOk());  // element count
  {                                              // one reduced payload where two are needed
    const std::vector<std::span<const uint8_t>> one{r.reduced[0]};
    std::vector<float> out = sentinel;
    CHECK(!c->decodeRounds(one, 1.0f, out.data(), n).isOk());
    CHECK(testing::bitEqual(out, sentinel));
  }
  // NaN factors are values (a non-finite gradient must reach the result): accepted.
  CHECK(mutate(1, 32, 0x7FC00000u).isOk());
  // A hostile reduced round-0 payload fed back as `previous` is rejected by encodeChunk.
  {
    const std::vector<uint64_t> shape{rows, cols};
    const StepContext ctx{.shape = shape};
    const auto x = gaussian(n, 4);
    const Chunking ch = chunkingFor(*c, n, 0);
    CodecState st = stateFor(*c, n, shape);
    std::vector<std::byte> ws(c->workspaceBytes(ch));
    REQUIRE(c->analyze(ctx, ch, ConstTensor{x.data(), n}, st, ws).isOk());
    std::vector<uint8_t> out(c->maxPayloadBytes(n));
    auto bad = r.reduced[0];
    bad.pop_back();
    CHECK(!c->encodeChunk(ctx, ch, 0, 1, bad, ConstTensor{x.data(), n}, st, ws, out).isOk());
    CHECK(
        !c->encodeChunk(ctx, ch, 0, 1, r.reduced[1], ConstTensor{x.data(), n}, st, ws, out).isOk());
    CHECK(
        c->encodeChunk(ctx, ch, 0, 1, r.reduced[0], ConstTensor{x.data(), n}, st, ws, out).isOk());
    // addPayloads refuses mixed rounds and lengths.
    std::vector<uint8_t> sum(out.size());
    CHECK(!c->addPayloads(r.reduced[0], r.reduced[1], sum).isOk());
    CHECK(!c->addPayloads(r.reduced[0], bad, sum).isOk());
    CHECK(c->addPayloads(r.reduced[0], r.reduced[0], sum).isOk());
  }
}

}  // namespace test_powersgd
}  // namespace lightwire::kernels
