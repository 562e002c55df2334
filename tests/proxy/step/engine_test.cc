// The step engine (proxy/step/engine.h) with LocalExchange: averaging of local trainers, the
// refusals of submit(), step timeouts, codec state across steps, size and codec changes,
// non-finite steps and shutdown.
#include <doctest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <boost/json/array.hpp>
#include <boost/json/object.hpp>

#include "kernels/dtype.h"
#include "kernels/registry.h"
#include "metrics/metrics.h"
#include "policies/policy.h"
#include "proxy/step/engine.h"
#include "proxy/step/job_state.h"
#include "proxy/step/pipeline.h"
#include "proxy/step/step_test_util.h"

using namespace lightwire;
using namespace lightwire::proxy;
using kernels::DType;

namespace {

constexpr auto kWait = std::chrono::seconds(10);

kernels::CodecConfig codecNamed(const std::string& name, std::optional<double> density = {}) {
  kernels::CodecConfig c;
  c.name = name;
  c.density = density;
  return c;
}

CodecChooser always(kernels::CodecConfig c) {
  return [c](const TensorFacts&) { return c; };
}

/// One trainer's part in flight: its bytes (overwritten by the result) and its outcome.
struct Sent {
  std::shared_ptr<std::vector<std::byte>> bytes;
  std::future<StepOutcome> outcome;

  /// The outcome, or a failed test after 10 s (never hangs).
  StepOutcome get() {
    if (outcome.wait_for(kWait) != std::future_status::ready) {
      FAIL("the engine did not answer within 10 s");
    }
    return outcome.get();
  }
  /// The result as floats.
  std::vector<float> values(DType dtype) const {
    const size_t width = kernels::dtypeSize(dtype);
    std::vector<float> out(bytes->size() / width);
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t h = 0;
      switch (dtype) {
        case DType::kF32:
          std::memcpy(&out[i], bytes->data() + 4 * i, 4);
          break;
        case DType::kF16:
          std::memcpy(&h, bytes->data() + 2 * i, 2);
          out[i] = kernels::halfToFloat(h);
          break;
        case DType::kBF16:
          std::memcpy(&h, bytes->data() + 2 * i, 2);
          out[i] = kernels::bf16ToFloat(h);
          break;
      }
    }
    return out;
  }
};

/// Submits `values` (converted to `dtype`) as trainer `trainer`'s part of (name, step).
Sent send(StepEngine& engine, const std::string& name, uint64_t step, unsigned trainer,
          const std::vector<float>& values, DType dtype = DType::kF32,
          std::vector<uint64_t> shape = {}) {
  const size_t width = kernels::dtypeSize(dtype);
  auto bytes = std::make_shared<std::vector<std::byte>>(values.size() * width);
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(bytes->data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h =
          dtype == DType::kF16 ? kernels::floatToHalf(values[i]) : kernels::floatToBf16(values[i]);
      std::memcpy(bytes->data() + 2 * i, &h, 2);
    }
  }
  Contribution c;
  c.spec.name = name;
  c.spec.step = step;
  c.spec.trainer = trainer;
  c.spec.dtype = dtype;
  c.spec.elements = values.size();
  c.spec.shape = std::move(shape);
  c.data = bytes->data();
  c.keep_alive = bytes;
  auto promise = std::make_shared<std::promise<StepOutcome>>();
  Sent s{bytes, promise->get_future()};
  engine.submit(std::move(c), [promise](StepOutcome o) { promise->set_value(std::move(o)); });
  return s;
}

/// The engine and what it needs, torn down in order.
struct Fixture {
  explicit Fixture(EngineOptions options, CodecChooser chooser = always(codecNamed("none")))
      : engine(options, std::move(chooser), metrics, exchange) {}
  metrics::Metrics metrics;
  LocalExchange exchange;
  StepEngine engine;
};

EngineOptions withTrainers(unsigned n) {
  EngineOptions o;
  o.local_trainers = n;
  o.threads = 2;
  o.step_timeout = std::chrono::milliseconds(10000);
  return o;
}

using proxy::testing::randomValues;

bool bitsEqual(const std::vector<std::byte>& a, const std::vector<std::byte>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

/// Runs one step with one trainer and returns (outcome, result values).
std::pair<StepOutcome, std::vector<float>> step1(StepEngine& e, const std::string& name,
                                                 uint64_t step, const std::vector<float>& v) {
  Sent s = send(e, name, step, 0, v);
  StepOutcome o = s.get();
  return {o, s.values(DType::kF32)};
}

}  // namespace

TEST_CASE("codec none with one trainer returns the input bit for bit") {
  Fixture f(withTrainers(1));
  const auto values = randomValues(5000, 1, 3.0f);
  uint64_t step = 1;
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    CAPTURE(kernels::dtypeSize(dtype));
    const std::string name = std::string("t.") + apiDTypeName(dtype);
    Sent s = send(f.engine, name, step, 0, values, dtype);
    const std::vector<std::byte> before = *s.bytes;
    const StepOutcome o = s.get();
    REQUIRE_MESSAGE(o.ok(), o.message);
    CHECK(o.figures.codec == "none");
    CHECK(o.figures.elements == values.size());
    CHECK(o.figures.raw_bytes == values.size() * kernels::dtypeSize(dtype));
    CHECK_FALSE(o.figures.nonfinite);
    CHECK_FALSE(o.figures.state_reset);
    CHECK(bitsEqual(*s.bytes, before));
    ++step;
  }
  CHECK(f.engine.stepsOk() == 3);
  CHECK(f.engine.stepsFailed() == 0);
}

TEST_CASE("three local trainers sending from three threads each get the mean") {
  Fixture f(withTrainers(3));
  const size_t n = 3000;
  for (uint64_t step = 1; step <= 3; ++step) {
    std::vector<Sent> sent(3);
    std::vector<std::thread> threads;
    for (unsigned k = 0; k < 3; ++k) {
      threads.emplace_back([&, k] {
        const float v = k == 0 ? 1.0f : k == 1 ? 2.0f : 6.0f;  // mean 3
        std::vector<float> values(n, v);
        values[0] = static_cast<float>(k);  // mean 1
        sent[k] = send(f.engine, "grad", step, k, values);
      });
    }
    for (auto& t : threads) t.join();
    for (unsigned k = 0; k < 3; ++k) {
      const StepOutcome o = sent[k].get();
      REQUIRE_MESSAGE(o.ok(), o.message);
      const auto r = sent[k].values(DType::kF32);
      CHECK(r[0] == 1.0f);
      size_t wrong = 0;
      for (size_t i = 1; i < n; ++i) wrong += r[i] != 3.0f;
      CHECK(wrong == 0);
    }
  }
  CHECK(f.engine.stepsOk() == 3);
}

TEST_CASE("three local trainers in bfloat16 get the mean in bfloat16") {
  Fixture f(withTrainers(3));
  std::vector<Sent> sent;
  for (unsigned k = 0; k < 3; ++k) {
    sent.push_back(send(f.engine, "g16", 1, k, std::vector<float>(64, k == 2 ? 6.0f : k + 1.0f),
                        DType::kBF16));
  }
  for (auto& s : sent) {
    const StepOutcome o = s.get();
    REQUIRE_MESSAGE(o.ok(), o.message);
    for (float v : s.values(DType::kBF16)) CHECK(v == 3.0f);
  }
}

TEST_CASE("submit refuses conflicting contributions and changes nothing") {
  EngineOptions options = withTrainers(2);
  options.max_pending_steps = 2;
  Fixture f(options);
  const std::vector<float> v(16, 1.0f);

  SUBCASE("trainer index out of range: 400") {
    Sent s = send(f.engine, "t", 1, 2, v);
    const StepOutcome o = s.get();
    CHECK(o.error == StepError::kInvalidArgument);
    CHECK(o.message.find("trainer 2") != std::string::npos);
  }
  SUBCASE("the same trainer twice for one pending step: 409, then the step completes") {
    Sent first = send(f.engine, "t", 1, 0, v);
    Sent again = send(f.engine, "t", 1, 0, v);
    const StepOutcome o = again.get();
    CHECK(o.error == StepError::kConflict);
    CHECK(o.message.find("already sent") != std::string::npos);
    Sent other = send(f.engine, "t", 1, 1, std::vector<float>(16, 3.0f));
    REQUIRE(first.get().ok());
    REQUIRE(other.get().ok());
    CHECK(first.values(DType::kF32)[0] == 2.0f);
  }
  SUBCASE("different element counts or dtypes among the trainers of one step: 409") {
    Sent first = send(f.engine, "t", 1, 0, v);
    Sent wrong = send(f.engine, "t", 1, 1, std::vector<float>(17, 1.0f));
    StepOutcome o = wrong.get();
    CHECK(o.error == StepError::kConflict);
    CHECK(o.message.find("17") != std::string::npos);
    Sent wrong_dtype = send(f.engine, "t", 1, 1, v, DType::kF16);
    o = wrong_dtype.get();
    CHECK(o.error == StepError::kConflict);
    // The step still waits for trainer 1 with the right size.
    Sent right = send(f.engine, "t", 1, 1, v);
    CHECK(first.get().ok());
    CHECK(right.get().ok());
  }
  SUBCASE("a step at or before the last committed one: 409") {
    Sent a = send(f.engine, "t", 5, 0, v), b = send(f.engine, "t", 5, 1, v);
    REQUIRE(a.get().ok());
    REQUIRE(b.get().ok());
    for (uint64_t step : {uint64_t{5}, uint64_t{3}, uint64_t{0}}) {
      CAPTURE(step);
      const StepOutcome o = send(f.engine, "t", step, 0, v).get();
      CHECK(o.error == StepError::kConflict);
      CHECK(o.message.find("backwards") != std::string::npos);
    }
    // Other tensors are independent; later steps go on.
    Sent c = send(f.engine, "t", 6, 0, v), d = send(f.engine, "t", 6, 1, v);
    CHECK(c.get().ok());
    CHECK(d.get().ok());
  }
  SUBCASE("max_pending_steps reached: 429, and room again once a step completes") {
    Sent s1 = send(f.engine, "t", 1, 0, v);
    Sent s2 = send(f.engine, "u", 1, 0, v);
    const StepOutcome o = send(f.engine, "t", 2, 0, v).get();
    CHECK(o.error == StepError::kLimitReached);
    CHECK(o.message.find("max_pending_steps") != std::string::npos);
    // A part of a step already pending is not a new step.
    Sent s1b = send(f.engine, "t", 1, 1, v);
    CHECK(s1.get().ok());
    CHECK(s1b.get().ok());
    Sent s3 = send(f.engine, "t", 2, 0, v);
    Sent s3b = send(f.engine, "t", 2, 1, v);
    Sent s2b = send(f.engine, "u", 1, 1, v);
    CHECK(s3.get().ok());
    CHECK(s3b.get().ok());
    CHECK(s2.get().ok());
    CHECK(s2b.get().ok());
  }
}

TEST_CASE("a step whose trainers do not all arrive in time fails with 504, then can be resent") {
  EngineOptions options = withTrainers(2);
  options.step_timeout = std::chrono::milliseconds(200);
  Fixture f(options);
  const std::vector<float> v(8, 2.0f);
  const auto t0 = std::chrono::steady_clock::now();
  Sent lone = send(f.engine, "late", 7, 0, v);
  const StepOutcome o = lone.get();
  const auto waited = std::chrono::steady_clock::now() - t0;
  CHECK(o.error == StepError::kDeadlineExceeded);
  CHECK(o.message.find("trainer(s) 1 ") != std::string::npos);
  CHECK(o.message.find("'late'") != std::string::npos);
  CHECK(waited >= std::chrono::milliseconds(190));
  CHECK(f.engine.stepsFailed() == 1);

  Sent a = send(f.engine, "late", 7, 0, v);
  Sent b = send(f.engine, "late", 7, 1, std::vector<float>(8, 4.0f));
  const StepOutcome oa = a.get(), ob = b.get();
  REQUIRE_MESSAGE(oa.ok(), oa.message);
  REQUIRE_MESSAGE(ob.ok(), ob.message);
  for (float x : a.values(DType::kF32)) CHECK(x == 3.0f);
  CHECK(f.engine.stepsOk() == 1);
}

TEST_CASE("a tensor whose size or codec changes starts with fresh codec state") {
  auto config = std::make_shared<kernels::CodecConfig>(codecNamed("topk", 0.25));
  Fixture f(withTrainers(1));
  f.engine.setChooser(always(*config));
  const auto v8 = randomValues(8, 3), v16 = randomValues(16, 4);

  StepOutcome o1;
  std::vector<float> r1;
  std::tie(o1, r1) = step1(f.engine, "w", 1, v8);
  REQUIRE_MESSAGE(o1.ok(), o1.message);
  CHECK(o1.figures.codec == "topk");
  CHECK_FALSE(o1.figures.state_reset);
  StepOutcome o2;
  std::vector<float> r2;
  std::tie(o2, r2) = step1(f.engine, "w", 2, v16);
  REQUIRE_MESSAGE(o2.ok(), o2.message);
  CHECK(o2.figures.state_reset);
  CHECK(o2.figures.elements == 16);
  StepOutcome o3;
  std::vector<float> r3;
  std::tie(o3, r3) = step1(f.engine, "w", 3, v16);
  REQUIRE_MESSAGE(o3.ok(), o3.message);
  CHECK_FALSE(o3.figures.state_reset);

  f.engine.setChooser(always(codecNamed("none")));
  StepOutcome o4;
  std::vector<float> r4;
  std::tie(o4, r4) = step1(f.engine, "w", 4, v16);
  REQUIRE_MESSAGE(o4.ok(), o4.message);
  CHECK(o4.figures.codec == "none");
  CHECK(o4.figures.state_reset);
  CHECK(r4 == v16);
  auto [o5, r5] = step1(f.engine, "w", 5, v16);
  CHECK_FALSE(o5.figures.state_reset);
  // A different density of the same codec is a codec change too.
  f.engine.setChooser(always(codecNamed("topk", 0.5)));
  auto [o6, r6] = step1(f.engine, "w", 6, v16);
  CHECK(o6.figures.state_reset);
  CHECK(f.metrics.exposition().find("lightwire_state_resets_total 3") != std::string::npos);
}

TEST_CASE("topk and dgc keep their state across steps and do not commit it after a NaN step") {
  for (const char* codec : {"topk", "dgc"}) {
    CAPTURE(codec);
    const auto chooser = always(codecNamed(codec, 0.1));
    const size_t n = 4000;
    const auto x1 = randomValues(n, 11), x2 = randomValues(n, 12), x3 = randomValues(n, 13);
    auto with_nan = x2;
    with_nan[17] = std::numeric_limits<float>::quiet_NaN();

    // Engine A: x1, then x2. Engine B (fresh): x2 at the same step.
    Fixture a(withTrainers(1), chooser), b(withTrainers(1), chooser);
    StepOutcome a1;
    std::vector<float> ra1;
    std::tie(a1, ra1) = step1(a.engine, "layer.weight", 1, x1);
    REQUIRE_MESSAGE(a1.ok(), a1.message);
    CHECK(a1.figures.codec == codec);
    CHECK(a1.figures.wire_bytes < a1.figures.raw_bytes);
    auto [a2, ra2] = step1(a.engine, "layer.weight", 2, x2);
    auto [b2, rb2] = step1(b.engine, "layer.weight", 2, x2);
    REQUIRE(a2.ok());
    REQUIRE(b2.ok());
    CHECK(ra2 != rb2);  // the residual of step 1 took part in step 2

    // Engine C: x1, NaN step, x3. Engine D: x1, x3. The NaN step leaves the state as it was.
    Fixture c(withTrainers(1), chooser), d(withTrainers(1), chooser);
    auto [c1, rc1] = step1(c.engine, "layer.weight", 1, x1);
    auto [d1, rd1] = step1(d.engine, "layer.weight", 1, x1);
    CHECK(rc1 == rd1);
    StepOutcome c2;
    std::vector<float> rc2;
    std::tie(c2, rc2) = step1(c.engine, "layer.weight", 2, with_nan);
    REQUIRE_MESSAGE(c2.ok(), c2.message);
    CHECK(c2.figures.nonfinite);
    CHECK(c.metrics.exposition().find("lightwire_steps_total{result=\"nonfinite\"} 1") !=
          std::string::npos);
    StepOutcome c3;
    std::vector<float> rc3;
    std::tie(c3, rc3) = step1(c.engine, "layer.weight", 3, x3);
    auto [d3, rd3] = step1(d.engine, "layer.weight", 3, x3);
    REQUIRE_MESSAGE(c3.ok(), c3.message);
    REQUIRE(d3.ok());
    CHECK_FALSE(c3.figures.nonfinite);
    CHECK(rc3 == rd3);
  }
}

TEST_CASE("shutdown fails waiting steps with 503 and refuses later submits") {
  Fixture f(withTrainers(2));
  const std::vector<float> v(8, 1.0f);
  Sent waiting = send(f.engine, "s", 1, 0, v);
  Sent other = send(f.engine, "s2", 4, 1, v);
  f.engine.shutdown();
  for (Sent* s : {&waiting, &other}) {
    const StepOutcome o = s->get();
    CHECK(o.error == StepError::kShuttingDown);
  }
  const StepOutcome later = send(f.engine, "s", 2, 0, v).get();
  CHECK(later.error == StepError::kShuttingDown);
  f.engine.shutdown();  // idempotent
}

TEST_CASE("a pending step overtaken by a committed later step fails at once with 409") {
  Fixture f(withTrainers(2));  // step timeout 10 s: the doomed step must not wait for it
  const std::vector<float> v(8, 1.0f);
  Sent old0 = send(f.engine, "t", 1, 0, v);
  Sent new0 = send(f.engine, "t", 2, 0, v), new1 = send(f.engine, "t", 2, 1, v);
  REQUIRE(new0.get().ok());
  REQUIRE(new1.get().ok());
  const StepOutcome late = send(f.engine, "t", 1, 1, v).get();
  CHECK(late.error == StepError::kConflict);
  REQUIRE(old0.outcome.wait_for(std::chrono::seconds(2)) == std::future_status::ready);
  const StepOutcome o = old0.get();
  CHECK(o.error == StepError::kConflict);
  CHECK(o.message.find("backwards") != std::string::npos);
  const auto tensors = f.engine.tensorsJson();
  REQUIRE(tensors.size() == 1);
  CHECK(tensors[0].at("pending_steps").to_number<uint64_t>() == 0);
}

TEST_CASE("a tensor whose dtype changes between steps starts with fresh codec state") {
  Fixture f(withTrainers(1), always(codecNamed("topk", 0.25)));
  const auto v = randomValues(16, 5);
  Sent a = send(f.engine, "d", 1, 0, v, DType::kF32);
  REQUIRE(a.get().ok());
  Sent b = send(f.engine, "d", 2, 0, v, DType::kBF16);
  const StepOutcome o = b.get();
  REQUIRE_MESSAGE(o.ok(), o.message);
  CHECK(o.figures.state_reset);
  CHECK(o.figures.raw_bytes == 32);
}

TEST_CASE("a fresh engine takes the job's step state from a peer; a running one ignores it") {
  Fixture f(withTrainers(1));
  const auto values = randomValues(100, 7);
  auto state = decodeJobState(encodeJobState({{"a", 41}, {"b", 7}}));
  REQUIRE(state.isOk());
  CHECK(state->committed == std::map<std::string, uint64_t>{{"a", 41}, {"b", 7}});
  CHECK(!state->policy);
  CHECK(f.engine.adoptCommittedSteps(state->committed) == 2);
  CHECK(f.engine.adoptCommittedSteps({{"a", 40}}) == 0);  // older: nothing to take
  CHECK(f.engine.committedSteps() == state->committed);
  // Steps up to the job's last committed one are over; the next one runs.
  CHECK(step1(f.engine, "a", 41, values).first.error == StepError::kConflict);
  CHECK(step1(f.engine, "a", 42, values).first.ok());
  // Once it has completed a step, a peer's state no longer applies.
  CHECK(f.engine.adoptCommittedSteps({{"a", 100}, {"c", 5}}) == 0);
  CHECK(f.engine.committedSteps().at("a") == 42);
  CHECK(f.engine.committedSteps().count("c") == 0);
}

TEST_CASE("a malformed job state is refused whole") {
  auto bad = [](const std::string& text) {
    return decodeJobState(std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  };
  CHECK_FALSE(bad("").isOk());
  CHECK_FALSE(bad("[1]").isOk());
  CHECK_FALSE(bad(R"({"version": 2, "committed": {}})").isOk());
  CHECK_FALSE(bad(R"({"version": 1})").isOk());
  CHECK_FALSE(bad(R"({"version": 1, "committed": {"a": -1}})").isOk());
  CHECK_FALSE(bad(R"({"version": 1, "committed": {"a": 1, "b": "x"}})").isOk());
  CHECK_FALSE(bad(R"({"version": 1, "committed": {"": 1}})").isOk());
  CHECK_FALSE(bad(R"({"version": 1, "committed": {}, "policy": 3})").isOk());
  CHECK(bad(R"({"version": 1, "committed": {}})").isOk());
  CHECK(bad(R"({"version": 1, "committed": {}, "policy": {"version": 1}})")->policy);
}

TEST_CASE("DGC warm-up: five stages of decreasing density, then the codec's own") {
  CHECK(!policies::warmupDensity(0, 0));
  CHECK(*policies::warmupDensity(0, 10) == 0.25);
  CHECK(*policies::warmupDensity(1, 10) == 0.25);
  CHECK(*policies::warmupDensity(2, 10) == 0.0625);
  CHECK(*policies::warmupDensity(5, 10) == 0.015625);
  CHECK(*policies::warmupDensity(9, 10) == 0.25 * 0.25 * 0.25 * 0.25 * 0.25);
  CHECK(!policies::warmupDensity(10, 10));
  EngineOptions o = withTrainers(1);
  o.warmup_steps = 10;
  kernels::CodecConfig topk;
  topk.name = "topk";
  topk.density = 0.01;
  Fixture f(o, always(topk));
  const auto values = randomValues(100000, 3);
  std::map<uint64_t, uint64_t> wire;
  for (uint64_t step : {0, 2, 4, 6, 8, 10, 11}) {
    StepOutcome outcome;
    std::vector<float> result;
    std::tie(outcome, result) = step1(f.engine, "w", step, values);
    REQUIRE_MESSAGE(outcome.ok(), outcome.message);
    wire[step] = outcome.figures.wire_bytes;
  }
  // 25 % -> 6.25 % -> 1.5625 % (payload bytes scale with the pairs sent), then the codec's 1 %
  // (stage 4's 0.39 % is below it).
  CHECK(wire[0] > 3 * wire[2]);
  CHECK(wire[2] > 3 * wire[4]);
  CHECK(wire[4] > wire[6]);
  // Same k from step 6 on (the size varies a little with the gap coding of the indices).
  auto near = [&](uint64_t a, uint64_t b) {
    return wire[a] * 10 > wire[b] * 9 && wire[b] * 10 > wire[a] * 9;
  };
  CHECK(near(6, 10));
  CHECK(near(8, 10));
  CHECK(near(10, 11));
  CHECK(wire[0] > 15 * wire[10]);
}

TEST_CASE("limits.max_state_bytes: a tensor whose codec state would not fit fails with 507") {
  EngineOptions o = withTrainers(1);
  // topk with error feedback keeps a residual of n floats (one copy: 4 n bytes), and its steps a
  // result buffer of n floats from the pool every tensor shares (the largest so far: a's).
  o.max_state_bytes = 4 * 1000 + 4 * 500 + 4 * 1000;
  Fixture f(o, always(codecNamed("topk", 0.1)));
  CHECK(step1(f.engine, "a", 1, randomValues(1000, 1)).first.ok());
  CHECK(step1(f.engine, "b", 1, randomValues(500, 2)).first.ok());
  auto [refused, values] = step1(f.engine, "c", 1, randomValues(10, 3));
  CHECK(refused.error == StepError::kStateLimit);
  CHECK(refused.message.find("tensor 'c' needs 40 bytes of codec state and 40 bytes of step "
                             "buffers; other tensors hold 6000 bytes of state and the step pool "
                             "4000") != std::string::npos);
  // What is held already goes on; a tensor that shrinks fits again.
  CHECK(step1(f.engine, "a", 2, randomValues(1000, 4)).first.ok());
  CHECK(step1(f.engine, "b", 2, randomValues(490, 5)).first.ok());
  CHECK(step1(f.engine, "c", 2, randomValues(10, 6)).first.ok());
  CHECK(f.metrics.exposition().find("lightwire_state_bytes 6000") != std::string::npos);
  CHECK(f.metrics.exposition().find("lightwire_pool_bytes 4000") != std::string::npos);
}

// --- policies (world size 1: the statistics loop back) ----------------------------------------

namespace {

/// An engine with policies and (optionally) a state directory.
struct PolicyFixture {
  PolicyFixture(policies::PolicyConfig pc, CodecChooser chooser, std::string state_dir = "")
      : policy(pc, "{}", &metrics),
        engine(options(state_dir), std::move(chooser), metrics, exchange) {}
  EngineOptions options(const std::string& dir) {
    EngineOptions o = withTrainers(1);
    o.policy = &policy;
    o.state_dir = dir;
    o.job_id = "pj";
    return o;
  }
  metrics::Metrics metrics;
  LocalExchange exchange;
  policies::PolicyEngine policy;
  StepEngine engine;
};

policies::PolicyConfig quickPolicies() {
  policies::PolicyConfig c;
  c.bypass_steps = 3;
  c.full_sync_every = 0;
  c.min_magnitude = 0;
  return c;
}

std::string tempDir() {
  char tmpl[] = "/tmp/lw-engine-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  return tmpl;
}

}  // namespace

TEST_CASE("policies: a full-sync sends everything the residual held back") {
  policies::PolicyConfig pc = quickPolicies();
  pc.full_sync_every = 6;
  PolicyFixture f(pc, always(codecNamed("topk", 0.05)));
  std::vector<double> inputs(2000, 0.0), results(2000, 0.0);
  for (uint64_t s = 1; s <= 6; ++s) {
    const auto v = randomValues(2000, 100 + static_cast<uint32_t>(s));
    StepOutcome o;
    std::vector<float> r;
    std::tie(o, r) = step1(f.engine, "g", s, v);
    REQUIRE_MESSAGE(o.ok(), o.message);
    CHECK(o.figures.mode == (s == 6 ? "full_sync" : "compressed"));
    for (size_t i = 0; i < v.size(); ++i) {
      inputs[i] += v[i];
      results[i] += r[i];
    }
  }
  // Error feedback loses nothing, and the flush delivered the rest: the sums agree.
  for (size_t i = 0; i < inputs.size(); ++i)
    CHECK(results[i] == doctest::Approx(inputs[i]).epsilon(1e-5));
  CHECK(f.metrics.exposition().find("lightwire_full_syncs_total{reason=\"periodic\"} 1") !=
        std::string::npos);
}

TEST_CASE("codec auto: a switch away from a rung with state flushes it first, then starts fresh") {
  policies::PolicyConfig pc = quickPolicies();
  pc.auto_codec.ladder_text = "none,dgc:0.05";
  PolicyFixture f(pc, always(codecNamed("auto")));
  // World size 1: no link is measured, so the rungs are the ones the state says. Put the layer
  // on dgc (rung 1) from step 1, then a switch to none decided at step 3: step 4 flushes dgc's
  // residual (a full-sync with dgc), step 5 is none with fresh state.
  auto put = [&](uint64_t cur, uint64_t prev, uint64_t cur_from, uint64_t flush_at) {
    auto state = f.policy.stateJson();
    auto& a = state["tensors"].as_object()["g"].as_object()["auto"].as_object();
    a["cur"] = cur;
    a["prev"] = prev;
    a["cur_from"] = cur_from;
    a["flush_at"] = flush_at;
    REQUIRE(f.policy.restoreState(state).isOk());
  };
  std::vector<double> inputs(2000, 0.0), results(2000, 0.0);
  auto run = [&](uint64_t s) {
    const auto v = randomValues(2000, 300 + static_cast<uint32_t>(s));
    const std::pair<StepOutcome, std::vector<float>> got = step1(f.engine, "g", s, v);
    REQUIRE_MESSAGE(got.first.ok(), got.first.message);
    for (size_t i = 0; i < v.size(); ++i) {
      inputs[i] += v[i];
      results[i] += got.second[i];
    }
    return got.first;
  };
  StepOutcome o = run(0);  // the first step: rung none, the auto state made
  CHECK(o.figures.codec == "none");
  CHECK(o.figures.rung == "none");
  put(1, 1, 1, UINT64_MAX);
  for (uint64_t s = 1; s <= 3; ++s) {
    o = run(s);
    CHECK(o.figures.codec == "dgc");
    CHECK(o.figures.rung == "dgc:0.05");
    CHECK(o.figures.mode == "compressed");
  }
  put(0, 1, 5, 4);
  o = run(4);
  CHECK(o.figures.codec == "dgc");
  CHECK(o.figures.mode == "full_sync");
  o = run(5);
  CHECK(o.figures.codec == "none");
  CHECK(o.figures.state_reset);
  // Nothing dgc held back was lost: the results add up to the inputs.
  for (size_t i = 0; i < inputs.size(); ++i) {
    CHECK(results[i] == doctest::Approx(inputs[i]).epsilon(1e-5));
  }
  CHECK(f.metrics.exposition().find("lightwire_full_syncs_total{reason=\"switch\"} 1") !=
        std::string::npos);
}

TEST_CASE("policies: NaN -> result returned, state not committed, bypass for K steps") {
  PolicyFixture f(quickPolicies(), always(codecNamed("topk", 0.1)));
  for (uint64_t s = 1; s <= 4; ++s) {
    REQUIRE(step1(f.engine, "g", s, randomValues(500, static_cast<uint32_t>(s))).first.ok());
  }
  auto bad = randomValues(500, 9);
  bad[17] = std::numeric_limits<float>::quiet_NaN();
  auto [o, r] = step1(f.engine, "g", 5, bad);
  REQUIRE(o.ok());
  CHECK(o.figures.nonfinite);
  for (uint64_t s = 6; s <= 8; ++s) {
    const auto v = randomValues(500, 50 + static_cast<uint32_t>(s));
    auto [ob, rb] = step1(f.engine, "g", s, v);
    CHECK(ob.figures.mode == "bypass");
    CHECK(rb == v);  // dense, world size 1: the gradient itself
  }
  CHECK(step1(f.engine, "g", 9, randomValues(500, 9)).first.figures.mode == "compressed");
  CHECK(f.metrics.exposition().find("lightwire_anomalies_total{kind=\"nonfinite\"} 1") !=
        std::string::npos);
}

TEST_CASE("policies: a delayed-sync tensor accumulates locally and sends the sum on its steps") {
  CodecChooser chooser = [](const TensorFacts&) {
    TensorSettings s(codecNamed("none"));
    s.sync_every = 3;
    return s;
  };
  PolicyFixture f(quickPolicies(), chooser);
  std::vector<float> acc(300, 0.0f);
  for (uint64_t s = 0; s < 9; ++s) {
    const auto v = randomValues(300, 200 + static_cast<uint32_t>(s));
    for (size_t i = 0; i < v.size(); ++i) acc[i] = acc[i] + v[i];
    StepOutcome o;
    std::vector<float> r;
    std::tie(o, r) = step1(f.engine, "d", s, v);
    REQUIRE_MESSAGE(o.ok(), o.message);
    if ((s + 1) % 3 == 0) {
      CHECK(o.figures.mode == "compressed");
      CHECK(r == acc);
      std::fill(acc.begin(), acc.end(), 0.0f);
    } else {
      CHECK(o.figures.mode == "skip");
      CHECK(r == std::vector<float>(300, 0.0f));
    }
  }
}

TEST_CASE("policies: checkpoint then resume replays the same results bitwise") {
  const std::string dir = tempDir();
  kernels::CodecConfig dgc = codecNamed("dgc", 0.05);
  dgc.momentum = 0.9;
  PolicyFixture f(quickPolicies(), always(dgc), dir);
  for (uint64_t s = 1; s <= 10; ++s) {
    REQUIRE(step1(f.engine, "w", s, randomValues(3000, static_cast<uint32_t>(s))).first.ok());
  }
  auto path = f.engine.checkpoint(10);
  REQUIRE_MESSAGE(path, path.status().message());
  std::vector<std::vector<float>> first;
  for (uint64_t s = 11; s <= 15; ++s) {
    first.push_back(step1(f.engine, "w", s, randomValues(3000, static_cast<uint32_t>(s))).second);
  }
  // Too late now: step 15 has completed.
  CHECK_FALSE(f.engine.checkpoint(10));
  REQUIRE(f.engine.resume(10).isOk());
  for (uint64_t s = 11; s <= 15; ++s) {
    StepOutcome o;
    std::vector<float> r;
    std::tie(o, r) = step1(f.engine, "w", s, randomValues(3000, static_cast<uint32_t>(s)));
    REQUIRE_MESSAGE(o.ok(), o.message);
    CHECK(r == first[s - 11]);
  }
  // A fresh engine (a restarted sidecar) resumes the same way.
  PolicyFixture g(quickPolicies(), always(dgc), dir);
  REQUIRE(g.engine.resume(10).isOk());
  CHECK(step1(g.engine, "w", 11, randomValues(3000, 11)).second == first[0]);
  CHECK(step1(g.engine, "w", 10, randomValues(3000, 11)).first.error == StepError::kConflict);
  CHECK_FALSE(g.engine.resume(77).isOk());
  std::filesystem::remove_all(dir);
}

TEST_CASE("powersgd's state follows its shape's view; a change of view keeps the error") {
  kernels::CodecConfig psgd = codecNamed("powersgd");
  psgd.approx_rank = 1;
  Fixture f(withTrainers(1), always(psgd));
  Fixture fresh(withTrainers(1), always(psgd));
  const auto v0 = randomValues(600, 5), v1 = randomValues(600, 6);
  auto stateBytes = [](Fixture& fx) {
    const std::string text = fx.metrics.exposition();
    const auto at = text.find("\nlightwire_state_bytes ");
    return at == std::string::npos ? -1.0 : std::stod(text.substr(at + 23));
  };
  StepOutcome o = send(f.engine, "w", 0, 0, v0, DType::kF32, {30, 20}).get();
  REQUIRE_MESSAGE(o.ok(), o.message);
  CHECK(stateBytes(f) == 4.0 * (600 + 8 + 20));  // e, the meta block, Q: 20 x 1
  Sent s1 = send(f.engine, "w", 1, 0, v1, DType::kF32, {20, 30});
  o = s1.get();
  REQUIRE_MESSAGE(o.ok(), o.message);
  CHECK(stateBytes(f) == 4.0 * (600 + 8 + 30));  // Q: 30 x 1
  CHECK(o.figures.state_reset == false);         // the error carried over
  // A fresh state (no error) gives another result for the same input and view.
  Sent r = send(fresh.engine, "w", 1, 0, v1, DType::kF32, {20, 30});
  REQUIRE_MESSAGE(r.get().ok(), "fresh step");
  CHECK(r.values(DType::kF32) != s1.values(DType::kF32));
  // Back to the first view: the state is resized again, the step succeeds.
  o = send(f.engine, "w", 2, 0, v0, DType::kF32, {30, 20}).get();
  REQUIRE_MESSAGE(o.ok(), o.message);
  CHECK(stateBytes(f) == 4.0 * (600 + 8 + 20));
}

TEST_CASE("powersgd's start step: dense steps before it leave the state untouched") {
  kernels::CodecConfig psgd = codecNamed("powersgd");
  psgd.approx_rank = 1;
  EngineOptions late = withTrainers(1);
  late.powersgd_start_step = 3;
  Fixture f(late, always(psgd));
  Fixture fresh(withTrainers(1), always(psgd));  // compresses from its first step
  const auto v = randomValues(4096, 77);
  for (uint64_t step = 0; step < 3; ++step) {
    CAPTURE(step);
    // (No structured bindings: clang 14 cannot capture one in the macros' lambdas.)
    const auto got = step1(f.engine, "m", step, v);
    const StepOutcome& o = got.first;
    const std::vector<float>& r = got.second;
    REQUIRE_MESSAGE(o.ok(), o.message);
    CHECK(o.figures.mode == "dense");
    CHECK(o.figures.codec == "powersgd");
    CHECK(o.figures.wire_bytes >= 4096 * sizeof(float));  // fp32, uncompressed
    CHECK(r == v);                                        // one trainer, one sidecar: exact
  }
  const auto got3 = step1(f.engine, "m", 3, v);
  const StepOutcome& o3 = got3.first;
  const std::vector<float>& r3 = got3.second;
  REQUIRE_MESSAGE(o3.ok(), o3.message);
  CHECK(o3.figures.mode == "compressed");
  CHECK(o3.figures.wire_bytes < 4096);
  CHECK(r3 != v);  // a rank-1 approximation of a random matrix
  // The same as a first compressed step from fresh state: the dense steps changed nothing.
  const auto gotf = step1(fresh.engine, "m", 3, v);
  REQUIRE_MESSAGE(gotf.first.ok(), gotf.first.message);
  CHECK(gotf.second == r3);
}

namespace {

/// One layer of a bucket for the bucket tests: its name, values and shape.
struct LayerIn {
  std::string name;
  std::vector<float> values;
  std::vector<uint64_t> shape;
};

/// Trainer 0's part of `layer` at `step` (a layer: its shape, no bucket yet), over a copy of its
/// values; the copy is returned beside it.
std::pair<Contribution, std::shared_ptr<std::vector<std::byte>>> layerPart(const LayerIn& layer,
                                                                           uint64_t step) {
  auto bytes = std::make_shared<std::vector<std::byte>>(layer.values.size() * 4);
  std::memcpy(bytes->data(), layer.values.data(), bytes->size());
  Contribution c;
  c.spec.name = layer.name;
  c.spec.step = step;
  c.spec.elements = layer.values.size();
  c.spec.shape = layer.shape;
  c.spec.layer = true;
  c.data = bytes->data();
  c.keep_alive = bytes;
  return {std::move(c), bytes};
}

/// A done that fulfils the returned future.
std::pair<StepDone, std::future<StepOutcome>> promised() {
  auto promise = std::make_shared<std::promise<StepOutcome>>();
  auto future = promise->get_future();
  return {[promise](StepOutcome o) { promise->set_value(std::move(o)); }, std::move(future)};
}

/// Submits `layers` as trainer 0's bucket "bucket.x" at `step` (submitBucket); layer `broken`
/// (if any) with a buffer that no longer holds its size. One Sent per layer.
std::vector<Sent> sendBucket(StepEngine& engine, uint64_t step, const std::vector<LayerIn>& layers,
                             std::optional<size_t> broken = std::nullopt) {
  std::vector<Contribution> cs;
  std::vector<StepDone> dones;
  std::vector<Sent> sent;
  for (size_t i = 0; i < layers.size(); ++i) {
    auto [c, bytes] = layerPart(layers[i], step);
    c.spec.bucket = "bucket.x";
    if (broken && *broken == i) c.still_valid = [] { return false; };
    auto [done, future] = promised();
    sent.push_back(Sent{bytes, std::move(future)});
    cs.push_back(std::move(c));
    dones.push_back(std::move(done));
  }
  engine.submitBucket(std::move(cs), std::move(dones));
  return sent;
}

/// `layer` submitted on its own (submit(): a tensor of that name and shape, not in a bucket).
Sent sendShaped(StepEngine& engine, const LayerIn& layer, uint64_t step) {
  auto [c, bytes] = layerPart(layer, step);
  auto [done, future] = promised();
  engine.submit(std::move(c), std::move(done));
  return Sent{bytes, std::move(future)};
}

/// Per layer: topk with error feedback, none for the bias, powersgd (two rounds) for a matrix.
CodecChooser layerCodecs() {
  return [](const TensorFacts& f) -> TensorSettings {
    if (f.name == "fc.bias") return codecNamed("none");
    if (f.name == "fc.weight") return codecNamed("topk", 0.1);
    kernels::CodecConfig p = codecNamed("powersgd");
    p.approx_rank = 2;
    return p;
  };
}

std::vector<LayerIn> bucketLayers(uint32_t seed) {
  return {{"fc.weight", randomValues(600, seed), {20, 30}},
          {"fc.bias", randomValues(20, seed + 1), {20}},
          {"out.weight", randomValues(512, seed + 2), {16, 32}}};
}

const boost::json::object* tensorEntry(const boost::json::array& tensors, const std::string& name) {
  for (const auto& t : tensors) {
    if (t.as_object().at("name").as_string() == name) return &t.as_object();
  }
  return nullptr;
}

}  // namespace

TEST_CASE("a bucket's layers run as one step: each its own tensor, results as when sent alone") {
  Fixture bucket(withTrainers(1), layerCodecs());
  Fixture alone(withTrainers(1), layerCodecs());
  for (uint64_t step = 1; step <= 3; ++step) {
    CAPTURE(step);
    const auto layers = bucketLayers(static_cast<uint32_t>(10 * step));
    auto sent = sendBucket(bucket.engine, step, layers);
    REQUIRE(sent.size() == 3);
    for (size_t i = 0; i < layers.size(); ++i) {
      CAPTURE(layers[i].name);
      const StepOutcome o = sent[i].get();
      REQUIRE_MESSAGE(o.ok(), o.message);
      Sent one = sendShaped(alone.engine, layers[i], step);
      const StepOutcome oa = one.get();
      REQUIRE_MESSAGE(oa.ok(), oa.message);
      CHECK(o.figures.codec == oa.figures.codec);
      CHECK(o.figures.wire_bytes == oa.figures.wire_bytes);
      CHECK(bitsEqual(*sent[i].bytes, *one.bytes));
    }
  }
  const auto tensors = bucket.engine.tensorsJson();
  for (const std::string name : {"fc.weight", "fc.bias", "out.weight"}) {
    CAPTURE(name);
    const auto* t = tensorEntry(tensors, name);
    REQUIRE(t != nullptr);
    CHECK(t->at("last_committed_step").to_number<uint64_t>() == 3);
  }
  CHECK(tensorEntry(tensors, "fc.bias")->at("codec").as_string() == "none");
  CHECK(tensorEntry(tensors, "out.weight")->at("codec").as_string() == "powersgd");
}

TEST_CASE("a bucket fails as a whole: one layer's failure fails every layer, and none commits") {
  Fixture f(withTrainers(1), layerCodecs());
  Fixture fresh(withTrainers(1), layerCodecs());
  const auto layers = bucketLayers(5);
  auto sent = sendBucket(f.engine, 1, layers, /*broken=*/2);
  for (size_t i = 0; i < layers.size(); ++i) {
    CAPTURE(layers[i].name);
    const StepOutcome o = sent[i].get();
    REQUIRE_FALSE(o.ok());
    CHECK(o.error == StepError::kConflict);
    CHECK(o.message.find("layer 'out.weight'") != std::string::npos);
    CHECK(o.message.find("no longer holds its registered size") != std::string::npos);
    CHECK(bitsEqual(*sent[i].bytes, [&] {  // the buffers are as the trainer left them
      std::vector<std::byte> b(layers[i].values.size() * 4);
      std::memcpy(b.data(), layers[i].values.data(), b.size());
      return b;
    }()));
  }
  for (const auto& t : f.engine.tensorsJson()) {
    CHECK(t.as_object().at("last_committed_step").is_null());
  }
  // Nothing was committed: the next step equals a first step from fresh state (topk's residual
  // and powersgd's factors untouched).
  auto again = sendBucket(f.engine, 2, layers);
  auto first = sendBucket(fresh.engine, 2, layers);
  for (size_t i = 0; i < layers.size(); ++i) {
    CAPTURE(layers[i].name);
    const StepOutcome a = again[i].get(), b = first[i].get();
    REQUIRE_MESSAGE(a.ok(), a.message);
    REQUIRE_MESSAGE(b.ok(), b.message);
    CHECK(bitsEqual(*again[i].bytes, *first[i].bytes));
  }
}

TEST_CASE("a failed bucket leaves a delayed-sync layer's accumulation as it was") {
  // fc.bias is exchanged every 2 steps: step 0 only accumulates it, step 1 sends the sum.
  const CodecChooser every2 = [](const TensorFacts& facts) -> TensorSettings {
    TensorSettings s = layerCodecs()(facts);
    if (facts.name == "fc.bias") s.sync_every = 2;
    return s;
  };
  // Delayed sync is a policy: the policy engine plans the accumulation steps.
  PolicyFixture f(quickPolicies(), every2);
  PolicyFixture fresh(quickPolicies(), every2);
  const auto layers = bucketLayers(11);
  auto sent = sendBucket(f.engine, 0, layers, /*broken=*/2);
  for (size_t i = 0; i < layers.size(); ++i) {
    CAPTURE(layers[i].name);
    const StepOutcome o = sent[i].get();
    REQUIRE_FALSE(o.ok());  // the accumulating layer too: the bucket failed
    CHECK(o.message.find("layer 'out.weight'") != std::string::npos);
    CHECK(bitsEqual(*sent[i].bytes, [&] {  // its part of the buffer not zeroed either
      std::vector<std::byte> b(layers[i].values.size() * 4);
      std::memcpy(b.data(), layers[i].values.data(), b.size());
      return b;
    }()));
  }
  // Step 1 sends what fc.bias accumulated: only step 1's gradient, as on an engine that never
  // ran step 0.
  const auto next = bucketLayers(12);
  auto again = sendBucket(f.engine, 1, next);
  auto first = sendBucket(fresh.engine, 1, next);
  for (size_t i = 0; i < next.size(); ++i) {
    CAPTURE(next[i].name);
    const StepOutcome a = again[i].get(), b = first[i].get();
    REQUIRE_MESSAGE(a.ok(), a.message);
    REQUIRE_MESSAGE(b.ok(), b.message);
    CHECK(bitsEqual(*again[i].bytes, *first[i].bytes));
  }
  // A bucket that succeeds accumulates: step 2 zeroes fc.bias's part, step 3 sends both steps'.
  auto s2 = sendBucket(f.engine, 2, bucketLayers(13));
  for (size_t i = 0; i < s2.size(); ++i) {
    const StepOutcome o = s2[i].get();
    REQUIRE_MESSAGE(o.ok(), o.message);
    if (i == 1) {
      CHECK(o.figures.mode == "skip");
      CHECK(bitsEqual(*s2[i].bytes, std::vector<std::byte>(20 * 4)));
    }
  }
  auto s3 = sendBucket(f.engine, 3, bucketLayers(14));
  const StepOutcome o3 = s3[1].get();
  REQUIRE_MESSAGE(o3.ok(), o3.message);
  std::vector<float> sum(20);
  const auto a2 = bucketLayers(13)[1].values, a3 = bucketLayers(14)[1].values;
  for (size_t k = 0; k < sum.size(); ++k) sum[k] = a2[k] + a3[k];
  std::vector<std::byte> want(sum.size() * 4);
  std::memcpy(want.data(), sum.data(), want.size());
  CHECK(bitsEqual(*s3[1].bytes, want));
  for (const size_t i : {size_t{0}, size_t{2}}) REQUIRE(s3[i].get().ok());
}

TEST_CASE("a bucket is taken all or none: one layer's refusal refuses every layer") {
  Fixture f(withTrainers(1), layerCodecs());
  // fc.bias committed step 5 on its own: a bucket at step 3 goes backwards for it.
  const auto got5 = step1(f.engine, "fc.bias", 5, randomValues(20, 1));
  REQUIRE_MESSAGE(got5.first.ok(), got5.first.message);
  auto sent = sendBucket(f.engine, 3, bucketLayers(7));
  for (auto& s : sent) {
    const StepOutcome o = s.get();
    REQUIRE_FALSE(o.ok());
    CHECK(o.error == StepError::kConflict);
    CHECK(o.message.find("tensor 'fc.bias' step 3 goes backwards") != std::string::npos);
  }
  // Nothing of it stayed: no tensor made, nothing pending.
  const auto tensors = f.engine.tensorsJson();
  CHECK(tensors.size() == 1);
  CHECK(tensorEntry(tensors, "fc.weight") == nullptr);
  CHECK(tensorEntry(tensors, "fc.bias")->at("pending_steps").to_number<uint64_t>() == 0);
  auto later = sendBucket(f.engine, 6, bucketLayers(7));
  for (auto& s : later) {
    const StepOutcome o = s.get();
    CHECK_MESSAGE(o.ok(), o.message);
  }
}

TEST_CASE("ring chunking: elementwise codecs give every rank a chunk of a tensor above 64 Ki") {
  using lightwire::proxy::kRingSplitMinElements;
  using lightwire::proxy::ringChunkElements;
  auto make = [](lightwire::kernels::CodecConfig c) {
    auto codec = lightwire::kernels::createCodec(c);
    REQUIRE(codec.isOk());
    return std::move(codec).value();
  };
  const auto none = make({.name = "none"});
  const auto fp16 = make({.name = "fp16"});
  const auto topk = make({.name = "topk", .density = 0.01});
  const auto qsgd = make({.name = "qsgd"});
  const size_t mi = size_t{1} << 20;
  CHECK(ringChunkElements(*none, mi, mi, 4) == mi / 4);  // one chunk -> four
  CHECK(ringChunkElements(*fp16, 3 * mi, mi, 4) == (3 * mi + 3) / 4);
  CHECK(ringChunkElements(*none, 16 * mi, mi, 4) == mi);                    // enough chunks already
  CHECK(ringChunkElements(*none, 100000, mi, 4) == kRingSplitMinElements);  // never below 64 Ki
  CHECK(ringChunkElements(*none, kRingSplitMinElements, mi, 4) == mi);      // small: as configured
  CHECK(ringChunkElements(*none, mi, mi, 1) == mi);  // one rank: nothing to share
  CHECK(ringChunkElements(*topk, mi, mi, 4) == mi);  // selection is per chunk
  // A sparse allreduce gives every rank a region of the index space, as elementwise codecs.
  CHECK(ringChunkElements(*topk, mi, mi, 4, /*global_select=*/true) == mi / 4);
  CHECK(ringChunkElements(*topk, 100000, mi, 4, true) == kRingSplitMinElements);
  CHECK(ringChunkElements(*topk, mi, mi, 1, true) == mi);
  // peer.sparse auto: the sparse allreduce from 3 sidecars on, while a selection is smaller
  // than the dense layer (nominal sizes).
  using lightwire::proxy::sparseAllreduceIsSmaller;
  CHECK_FALSE(sparseAllreduceIsSmaller(*topk, mi, 2, std::nullopt));  // equal bytes: the allgather
  CHECK(sparseAllreduceIsSmaller(*topk, mi, 3, std::nullopt));
  CHECK(sparseAllreduceIsSmaller(*topk, mi, 64, 0.25));       // a warm-up density
  CHECK_FALSE(sparseAllreduceIsSmaller(*topk, mi, 16, 0.9));  // dense is smaller
  // threshold: no nominal size; the sparse allreduce from 3 sidecars on.
  const auto threshold = make({.name = "threshold", .threshold = 1.5});
  CHECK_FALSE(sparseAllreduceIsSmaller(*threshold, mi, 2, std::nullopt));
  CHECK(sparseAllreduceIsSmaller(*threshold, mi, 3, std::nullopt));
  CHECK(ringChunkElements(*qsgd, mi, mi, 4) == mi);
}

// ---------------------------------------------------------------- buckets in flight

namespace {

/// The order in which steps ended (their tensors' names), as their done callbacks ran.
struct EndOrder {
  std::mutex mu;
  std::vector<std::string> names;
  std::vector<std::string> get() {
    std::lock_guard lock(mu);
    return names;
  }
};

/// Trainer `trainer`'s part of (name, step) at `place` of stream "s" (nullopt: no place).
Sent sendAt(StepEngine& engine, const std::string& name, uint64_t step,
            std::optional<std::pair<uint64_t, uint32_t>> place, EndOrder* ended = nullptr,
            unsigned trainer = 0) {
  Contribution c;
  auto bytes = std::make_shared<std::vector<std::byte>>(16 * sizeof(float));
  c.spec.name = name;
  c.spec.step = step;
  c.spec.trainer = trainer;
  c.spec.elements = 16;
  if (place) c.spec.order = StepOrder{"s", place->first, place->second};
  c.data = bytes->data();
  c.keep_alive = bytes;
  auto promise = std::make_shared<std::promise<StepOutcome>>();
  Sent s{bytes, promise->get_future()};
  engine.submit(std::move(c), [promise, ended, name](StepOutcome o) {
    if (ended != nullptr) {
      std::lock_guard lock(ended->mu);
      ended->names.push_back(name);
    }
    promise->set_value(std::move(o));
  });
  return s;
}

StepOrder place(uint64_t iteration, uint32_t position) { return {"s", iteration, position}; }

}  // namespace

TEST_CASE("ordered steps run in their stream's order, not in the order they arrive") {
  Fixture f(withTrainers(1));
  EndOrder ended;
  Sent c = sendAt(f.engine, "c", 0, std::pair{uint64_t{0}, 2u}, &ended);
  Sent b = sendAt(f.engine, "b", 0, std::pair{uint64_t{0}, 1u}, &ended);
  // A step without a place does not wait behind them.
  Sent u = sendAt(f.engine, "u", 0, std::nullopt, &ended);
  REQUIRE(u.get().ok());
  CHECK(ended.get() == std::vector<std::string>{"u"});
  const auto streams = f.engine.streamsJson();
  REQUIRE(streams.size() == 1);
  CHECK(streams[0].at("stream").as_string() == "s");
  CHECK(streams[0].at("last").is_null());
  CHECK(streams[0].at("waiting_steps").to_number<uint64_t>() == 2);
  Sent a = sendAt(f.engine, "a", 0, std::pair{uint64_t{0}, 0u}, &ended);
  for (Sent* s : {&a, &b, &c}) {
    const StepOutcome o = s->get();
    REQUIRE_MESSAGE(o.ok(), o.message);
  }
  CHECK(ended.get() == std::vector<std::string>{"u", "a", "b", "c"});
  // The next iteration starts at position 0 again; its position 1 waits for it.
  Sent b1 = sendAt(f.engine, "b", 1, std::pair{uint64_t{1}, 1u}, &ended);
  Sent a1 = sendAt(f.engine, "a", 1, std::pair{uint64_t{1}, 0u}, &ended);
  REQUIRE(b1.get().ok());
  REQUIRE(a1.get().ok());
  CHECK(ended.get() == std::vector<std::string>{"u", "a", "b", "c", "a", "b"});
  // A part at a place that has passed is refused and changes nothing.
  Sent late = sendAt(f.engine, "d", 1, std::pair{uint64_t{1}, 0u});
  const StepOutcome o = late.get();
  CHECK(o.error == StepError::kConflict);
  CHECK(o.message.find("has passed") != std::string::npos);
  CHECK(f.engine.committedSteps().count("d") == 0);
}

TEST_CASE("a cancelled place does not hold up the places after it") {
  EngineOptions options = withTrainers(2);
  Fixture f(options);
  EndOrder ended;
  // Both trainers send position 1; position 0 comes from trainer 0 only, then is cancelled.
  Sent b0 = sendAt(f.engine, "b", 0, std::pair{uint64_t{0}, 1u}, &ended, 0);
  Sent b1 = sendAt(f.engine, "b", 0, std::pair{uint64_t{0}, 1u}, &ended, 1);
  Sent a0 = sendAt(f.engine, "a", 0, std::pair{uint64_t{0}, 0u}, &ended, 0);
  auto cancelled = f.engine.cancel(place(0, 0), "", std::nullopt);
  REQUIRE(cancelled.isOk());
  CHECK(*cancelled);
  const StepOutcome oa = a0.get();
  CHECK(oa.error == StepError::kCancelled);
  CHECK(oa.message.find("position 0 of iteration 0 of stream 's' was cancelled") !=
        std::string::npos);
  REQUIRE(b0.get().ok());
  REQUIRE(b1.get().ok());
  CHECK(f.engine.committedSteps().count("a") == 0);
  CHECK(f.engine.committedSteps().at("b") == 0);
  // Cancelling a place that has passed does nothing; a part sent there later is refused.
  auto again = f.engine.cancel(place(0, 0), "", std::nullopt);
  REQUIRE(again.isOk());
  CHECK_FALSE(*again);
  Sent late = sendAt(f.engine, "a", 0, std::pair{uint64_t{0}, 0u});
  CHECK(late.get().error == StepError::kConflict);
  // A place cancelled before any part of it came is skipped when it is reached.
  REQUIRE(*f.engine.cancel(place(1, 0), "", std::nullopt));
  const auto streams = f.engine.streamsJson();
  REQUIRE(streams.size() == 1);
  CHECK(streams[0].at("cancelled_ahead").to_number<uint64_t>() == 1);
  CHECK(streams[0].at("last").at("position").to_number<uint64_t>() == 1);
  Sent c0 = sendAt(f.engine, "c", 1, std::pair{uint64_t{1}, 1u}, &ended, 0);
  Sent c1 = sendAt(f.engine, "c", 1, std::pair{uint64_t{1}, 1u}, &ended, 1);
  REQUIRE(c0.get().ok());
  REQUIRE(c1.get().ok());
  Sent refused = sendAt(f.engine, "x", 1, std::pair{uint64_t{1}, 0u});
  CHECK(refused.get().error != StepError::kNone);
}

TEST_CASE("a place that never comes: the steps after it fail at the deadline, nothing committed") {
  EngineOptions options = withTrainers(1);
  options.step_timeout = std::chrono::milliseconds(300);
  Fixture f(options);
  REQUIRE(sendAt(f.engine, "a", 0, std::pair{uint64_t{0}, 0u}).get().ok());
  const auto t0 = std::chrono::steady_clock::now();
  Sent c = sendAt(f.engine, "c", 0, std::pair{uint64_t{0}, 2u});
  const StepOutcome o = c.get();
  CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(290));
  CHECK(o.error == StepError::kDeadlineExceeded);
  CHECK(o.message.find("waited limits.step_timeout_s for position 1, which never came") !=
        std::string::npos);
  CHECK(f.engine.committedSteps().count("c") == 0);
  CHECK(f.engine.stepsFailed() == 1);
  // The place given up on has passed: the missing one is refused when it comes at last, and the
  // next place runs at once.
  CHECK(sendAt(f.engine, "b", 0, std::pair{uint64_t{0}, 1u}).get().error == StepError::kConflict);
  REQUIRE(sendAt(f.engine, "d", 0, std::pair{uint64_t{0}, 3u}).get().ok());
}

TEST_CASE("two streams keep their own order; trainers must agree on a step's place") {
  EngineOptions options = withTrainers(2);
  Fixture f(options);
  // Stream "t" is apart from stream "s": its position 0 runs while "s" waits for its own.
  Sent s1 = sendAt(f.engine, "s1", 0, std::pair{uint64_t{0}, 1u}, nullptr, 0);
  Sent s1b = sendAt(f.engine, "s1", 0, std::pair{uint64_t{0}, 1u}, nullptr, 1);
  {
    auto bytes = std::make_shared<std::vector<std::byte>>(16 * sizeof(float));
    auto promise = std::make_shared<std::promise<StepOutcome>>();
    auto fut = promise->get_future();
    for (unsigned trainer : {0u, 1u}) {
      Contribution t;
      t.spec.name = "t0";
      t.spec.trainer = trainer;
      t.spec.elements = 16;
      t.spec.order = StepOrder{"t", 0, 0};
      t.data = bytes->data();
      t.keep_alive = bytes;
      f.engine.submit(std::move(t), [promise, trainer](StepOutcome o) {
        if (trainer == 1) promise->set_value(std::move(o));
      });
    }
    REQUIRE(fut.wait_for(kWait) == std::future_status::ready);
    CHECK(fut.get().ok());
  }
  CHECK(s1.outcome.wait_for(std::chrono::milliseconds(50)) == std::future_status::timeout);
  // Trainer 1 sends "s0" at another place than trainer 0 did: refused, trainer 0's part stays.
  Sent s0 = sendAt(f.engine, "s0", 0, std::pair{uint64_t{0}, 0u}, nullptr, 0);
  Sent wrong = sendAt(f.engine, "s0", 0, std::pair{uint64_t{0}, 5u}, nullptr, 1);
  const StepOutcome ow = wrong.get();
  CHECK(ow.error == StepError::kConflict);
  CHECK(ow.message.find("another trainer at another place") != std::string::npos);
  Sent right = sendAt(f.engine, "s0", 0, std::pair{uint64_t{0}, 0u}, nullptr, 1);
  for (Sent* s : {&s0, &right, &s1, &s1b}) {
    const StepOutcome o = s->get();
    REQUIRE_MESSAGE(o.ok(), o.message);
  }
}

TEST_CASE("a bucket at a place: its layers wait together and run as one step") {
  Fixture f(withTrainers(1), layerCodecs());
  auto withPlace = [&](uint64_t step, uint32_t position) {
    std::vector<Contribution> cs;
    std::vector<StepDone> dones;
    std::vector<Sent> sent;
    for (const LayerIn& layer : bucketLayers(static_cast<uint32_t>(step))) {
      auto [c, bytes] = layerPart(layer, step);
      c.spec.bucket = "bucket.p" + std::to_string(position);
      c.spec.order = StepOrder{"s", step, position};
      auto [done, future] = promised();
      sent.push_back(Sent{bytes, std::move(future)});
      cs.push_back(std::move(c));
      dones.push_back(std::move(done));
    }
    f.engine.submitBucket(std::move(cs), std::move(dones));
    return sent;
  };
  auto second = withPlace(0, 1);
  for (auto& s : second) {
    CHECK(s.outcome.wait_for(std::chrono::milliseconds(20)) == std::future_status::timeout);
  }
  EndOrder ended;
  Sent first = sendAt(f.engine, "alone", 0, std::pair{uint64_t{0}, 0u}, &ended);
  REQUIRE(first.get().ok());
  for (auto& s : second) {
    const StepOutcome o = s.get();
    REQUIRE_MESSAGE(o.ok(), o.message);
  }
}
