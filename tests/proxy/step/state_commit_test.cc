// One copy of the codec state (docs/determinism.md "4.6c Atomic steps (one copy of the state)"),
// through the step engine: a step that fails after compression leaves every codec's state bit for
// bit as it was, and dgc's in-place commit on the sampling path (momentum, clipping, fp16 values)
// gives the results and the state of the double-buffered form (a second copy prepared during the
// step, swapped in at commit), kept here as the reference.
#include <doctest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/reduce.h"
#include "kernels/registry.h"
#include "metrics/metrics.h"
#include "policies/checkpoint.h"
#include "policies/policy.h"
#include "policies/stats.h"
#include "proxy/exchange/exchange.h"
#include "proxy/step/engine.h"
#include "proxy/step/step_test_util.h"

using namespace lightwire;
using namespace lightwire::proxy;

namespace {

constexpr auto kStepWait = std::chrono::seconds(30);

using proxy::testing::randomValues;

uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

bool sameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), 4 * a.size()) == 0);  // no null to memcmp
}

/// The exchange of one sidecar (as LocalExchange), with a fault on chosen steps: after every chunk
/// was compressed, the step is aborted (a peer gave up), a payload comes back corrupt (it does not
/// decode), the statistics record comes back truncated (the policies cannot read it), every chunk
/// is decoded (on_chunk) and then a peer aborts, the deadline passes after the first chunk was
/// decoded, or a peer's record says it resumed from another step than this sidecar (a resume
/// mismatch: this sidecar's record is copied with its resume step cleared, as a peer that did not
/// resume would send it).
class FaultyExchange final : public Exchange {
 public:
  enum class Fault { kAbort, kCorrupt, kBadStats, kAbortAfterDecode, kDeadline, kResumeMismatch };
  std::map<uint64_t, Fault> faults;

  unsigned worldSize() const override { return 1; }
  bool selectsGlobally() const override { return true; }
  Result<std::vector<std::vector<std::span<const uint8_t>>>> run(ExchangeRound& r) override {
    std::vector<std::vector<std::span<const uint8_t>>> out(r.chunking.count());
    for (size_t c = 0; c < out.size(); ++c) {
      auto p = r.payload(c);
      if (!p) return p.status();
      out[c].push_back(*p);
    }
    const auto f = faults.find(r.step);
    const std::optional<Fault> fault =
        f != faults.end() ? std::optional<Fault>(f->second) : std::nullopt;
    if (fault == Fault::kAbort) return dataLoss("injected: a peer aborted the step");
    if ((fault == Fault::kAbortAfterDecode || fault == Fault::kDeadline) && r.on_chunk) {
      const size_t decoded = fault == Fault::kDeadline ? 1 : out.size();
      for (size_t c = 0; c < decoded; ++c) LW_RETURN_IF_ERROR(r.on_chunk(c, out[c]));
    }
    if (fault == Fault::kAbortAfterDecode) {
      return dataLoss("injected: a peer aborted the step after it was decoded");
    }
    if (fault == Fault::kDeadline) {
      return Status(StatusCode::kUnavailable,
                    "injected: the step's deadline passed (rank 1 sent nothing in time)");
    }
    if (f != faults.end() && f->second == Fault::kCorrupt) {
      corrupt_.assign(out[0][0].begin(), out[0][0].end());
      corrupt_.resize(std::max<size_t>(corrupt_.size() / 2, 8));  // truncated
      out[0][0] = corrupt_;
    }
    r.stats_in.clear();
    r.stats_folded = false;
    if (!r.stats_out.empty()) {
      r.stats_in.emplace_back(r.stats_out.begin(), r.stats_out.end());
      if (fault == Fault::kBadStats) r.stats_in.back().resize(3);
      if (fault == Fault::kResumeMismatch) {
        auto peer = policies::decodeStats(r.stats_out);
        if (!peer) return peer.status();
        peer->resumed_from.reset();
        r.stats_in.push_back(policies::encodeStats(*peer));
      }
    }
    return out;
  }

 private:
  std::vector<uint8_t> corrupt_;
};

/// An engine with policies, a state directory and the faulty exchange.
struct Sidecar {
  Sidecar(policies::PolicyConfig pc, kernels::CodecConfig codec, const std::string& dir,
          const std::function<void(EngineOptions&)>& tune = {})
      : policy(pc, "{}", &metrics), engine(options(dir, tune), chooser(codec), metrics, exchange) {}
  EngineOptions options(const std::string& dir, const std::function<void(EngineOptions&)>& tune) {
    EngineOptions o;
    o.local_trainers = 1;
    o.threads = 2;
    o.step_timeout = std::chrono::milliseconds(20000);
    o.state_dir = dir;
    o.job_id = "state-commit";
    o.policy = &policy;
    if (tune) tune(o);
    return o;
  }
  static CodecChooser chooser(kernels::CodecConfig c) {
    return [c](const TensorFacts&) { return c; };
  }

  /// One step with one trainer: (outcome, result).
  std::pair<StepOutcome, std::vector<float>> step(uint64_t s, const std::vector<float>& v,
                                                  const std::string& name = "w") {
    auto bytes = std::make_shared<std::vector<float>>(v);
    Contribution c;
    c.spec.name = name;
    c.spec.step = s;
    c.spec.elements = v.size();
    c.data = reinterpret_cast<std::byte*>(bytes->data());
    c.keep_alive = bytes;
    auto promise = std::make_shared<std::promise<StepOutcome>>();
    auto fut = promise->get_future();
    engine.submit(std::move(c), [promise](StepOutcome o) { promise->set_value(std::move(o)); });
    if (fut.wait_for(kStepWait) != std::future_status::ready) FAIL("no answer within 30 s");
    return {fut.get(), *bytes};
  }

  /// The committed codec state of `name` after `s`, from a checkpoint of it.
  std::vector<float> state(uint64_t s, const std::string& name = "w") {
    auto path = engine.checkpoint(s);
    REQUIRE_MESSAGE(path, path.status().message());
    policies::CheckpointExpect expect;
    expect.job_id = "state-commit";
    auto cp = policies::readCheckpoint(*path, expect);
    REQUIRE_MESSAGE(cp, cp.status().message());
    for (const auto& t : cp->tensors) {
      if (t.name == name) return t.state;
    }
    FAIL("no state of '" << name << "' in the checkpoint");
    return {};
  }

  metrics::Metrics metrics;
  FaultyExchange exchange;
  policies::PolicyEngine policy;
  StepEngine engine;
};

std::string stateTempDir() {
  char tmpl[] = "/tmp/lw-state-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  return tmpl;
}

policies::PolicyConfig policiesEvery(uint64_t full_sync_every) {
  policies::PolicyConfig c;
  c.bypass_steps = 3;
  c.full_sync_every = full_sync_every;
  c.min_magnitude = 0;
  return c;
}

}  // namespace

TEST_CASE("a step that fails after compression leaves every codec's state bit for bit") {
  using Fault = FaultyExchange::Fault;
  std::vector<kernels::CodecConfig> codecs;
  auto add = [&](kernels::CodecConfig c) { codecs.push_back(c); };
  add({.name = "topk", .density = 0.05});
  add({.name = "dgc", .density = 0.05});
  add({.name = "dgc",
       .density = 0.05,
       .momentum = 0.9,
       .clip_norm = 60.0,
       .sparse_values = kernels::DType::kF16});
  add({.name = "threshold", .threshold = 1.5});
  add({.name = "randomk", .density = 0.05});
  add({.name = "qsgd", .bits = 4, .error_feedback = true});
  add({.name = "fp16", .error_feedback = true});
  add({.name = "onebit"});
  add({.name = "signsgd"});
  add({.name = "terngrad"});
  add({.name = "powersgd", .approx_rank = 2});
  add({.name = "none"});
  const size_t n = 40000;  // > 32768: dgc samples its threshold
  // Faults on compressed steps and on full-syncs (every 4th step).
  const std::map<uint64_t, Fault> faults{{2, Fault::kAbortAfterDecode},  {3, Fault::kAbort},
                                         {5, Fault::kCorrupt},           {6, Fault::kDeadline},
                                         {7, Fault::kBadStats},          {8, Fault::kAbort},
                                         {11, Fault::kAbortAfterDecode}, {12, Fault::kDeadline}};
  for (const auto& codec : codecs) {
    CAPTURE(codec.name);
    CAPTURE(codec.momentum);
    const std::string da = stateTempDir(), db = stateTempDir();
    {
      // A meets the faults; B runs only the steps that succeed. Same results, same state.
      Sidecar a(policiesEvery(4), codec, da), b(policiesEvery(4), codec, db);
      a.exchange.faults = faults;
      auto made = kernels::createCodec(codec);
      REQUIRE(made);
      const bool has_state = (*made)->stateFloats(n) > 0;
      uint64_t last = 0;
      for (uint64_t s = 1; s <= 14; ++s) {
        CAPTURE(s);
        const auto x = randomValues(n, static_cast<uint32_t>(100 + s));
        const auto oa_ra = a.step(s, x);
        const StepOutcome& oa = oa_ra.first;
        const std::vector<float>& ra = oa_ra.second;
        if (faults.count(s) > 0) {
          CHECK_FALSE(oa.ok());
          // The trainer's buffer: its gradient where the commit would have read it; a codec
          // without state, or a full-sync (every 4th step), decodes in place (it may hold a
          // partial result).
          if (has_state && s % 4 != 0) CHECK(sameBits(ra, x));
          continue;
        }
        const auto ob_rb = b.step(s, x);
        const StepOutcome& ob = ob_rb.first;
        const std::vector<float>& rb = ob_rb.second;
        REQUIRE_MESSAGE(oa.ok(), oa.message);
        REQUIRE_MESSAGE(ob.ok(), ob.message);
        CHECK(oa.figures.mode == ob.figures.mode);
        CHECK(sameBits(ra, rb));
        last = s;
      }
      CHECK(sameBits(a.state(last), b.state(last)));
    }
    std::filesystem::remove_all(da);
    std::filesystem::remove_all(db);
  }
}

TEST_CASE("a step refused for a resume mismatch leaves the state bit for bit") {
  // A resumed from its checkpoint of step 3 and a peer's record says it did not: the step fails on
  // every rank with nothing committed (A itself resumes from nothing more: the step it resumed
  // from is the newest), and A goes on as B, which never met the fault.
  using Fault = FaultyExchange::Fault;
  const size_t n = 40000;
  for (const kernels::CodecConfig& codec :
       {kernels::CodecConfig{.name = "dgc", .density = 0.05, .momentum = 0.9},
        kernels::CodecConfig{.name = "topk", .density = 0.05},
        kernels::CodecConfig{.name = "powersgd", .approx_rank = 2}}) {
    CAPTURE(codec.name);
    const std::string da = stateTempDir(), db = stateTempDir();
    {
      Sidecar a(policiesEvery(0), codec, da), b(policiesEvery(0), codec, db);
      a.exchange.faults = {{4, Fault::kResumeMismatch}};
      for (uint64_t s = 1; s <= 3; ++s) {
        const auto x = randomValues(n, static_cast<uint32_t>(200 + s));
        REQUIRE(a.step(s, x).first.ok());
        REQUIRE(b.step(s, x).first.ok());
      }
      REQUIRE(a.engine.checkpoint(3));
      const Status resumed = a.engine.resume(3);
      REQUIRE_MESSAGE(resumed.isOk(), resumed.message());
      const auto before = a.state(3);
      const auto x4 = randomValues(n, 204);
      const auto failed = a.step(4, x4);
      CHECK_FALSE(failed.first.ok());
      CHECK(failed.first.error == StepError::kResumeMismatch);
      CHECK(failed.first.message.find("resumed") != std::string::npos);
      CHECK(sameBits(failed.second, x4));  // the trainer's buffer still holds its gradient
      CHECK(sameBits(a.state(3), before));
      a.exchange.faults.clear();
      for (uint64_t s = 4; s <= 6; ++s) {
        CAPTURE(s);
        const auto x = randomValues(n, static_cast<uint32_t>(200 + s));
        const auto ra = a.step(s, x);
        const auto rb = b.step(s, x);
        REQUIRE_MESSAGE(ra.first.ok(), ra.first.message);
        REQUIRE_MESSAGE(rb.first.ok(), rb.first.message);
        CHECK(sameBits(ra.second, rb.second));
      }
      CHECK(sameBits(a.state(6), b.state(6)));
    }
    std::filesystem::remove_all(da);
    std::filesystem::remove_all(db);
  }
}

TEST_CASE("dgc's in-place commit equals the double-buffered form over 50 steps") {
  // Sampling path (n > 32768), momentum, clipping (the norm crosses clip_norm), fp16 values.
  const size_t n = 60000;
  const float m = 0.9f;
  const double clip = 250.0;
  kernels::CodecConfig codec{.name = "dgc",
                             .density = 0.01,
                             .momentum = 0.9,
                             .clip_norm = clip,
                             .sparse_values = kernels::DType::kF16};
  const std::string dir = stateTempDir();
  {
    Sidecar e(policiesEvery(0), codec, dir);
    // The reference: u and v, and the next state prepared beside them during the step.
    std::vector<float> u(n, 0.0f), v(n, 0.0f), un(n), vn(n);
    size_t clipped = 0;
    for (uint64_t s = 1; s <= 50; ++s) {
      CAPTURE(s);
      const auto x = randomValues(n, static_cast<uint32_t>(s), s % 3 == 0 ? 1.5f : 0.8f);
      const auto o_r = e.step(s, x);
      const StepOutcome& o = o_r.first;
      const std::vector<float>& r = o_r.second;
      REQUIRE_MESSAGE(o.ok(), o.message);
      REQUIRE(o.figures.codec == "dgc");
      REQUIRE(o.figures.mode == "compressed");
      // Steps 1–3 of docs/determinism.md §4.4 into the second copy.
      const double norm = kernels::canonicalNorm(x.data(), n);
      const bool c = norm > clip;
      clipped += c ? 1 : 0;
      const float f = static_cast<float>(clip / norm);
      for (size_t i = 0; i < n; ++i) {
        const float g = c ? x[i] * f : x[i];
        const float mu = m * u[i];
        un[i] = mu + g;
        vn[i] = v[i] + un[i];
      }
      // The selection is the codec's (checked as a threshold selection); the values and the
      // masking are the reference's.
      size_t selected = 0;
      uint32_t min_in = 0xFFFFFFFFu, max_out = 0;
      bool values_ok = true;
      for (size_t i = 0; i < n; ++i) {
        const uint32_t key = bits(vn[i]) & 0x7FFFFFFFu;
        if (r[i] == 0.0f) {
          max_out = std::max(max_out, key);
          continue;
        }
        ++selected;
        min_in = std::min(min_in, key);
        const float value = kernels::halfToFloat(kernels::floatToHalfSaturating(vn[i]));
        values_ok &= bits(r[i]) == bits(value);
        vn[i] = vn[i] - value;
        un[i] = 0.0f;
      }
      CHECK(values_ok);
      CHECK(selected >= 480);  // [0.8k, 1.3k] of k = 600
      CHECK(selected <= 780);
      CHECK(min_in >= max_out);
      u.swap(un);  // commit: the prepared copy becomes the state
      v.swap(vn);
      if (s % 10 == 0) {
        std::vector<float> ref(u);
        ref.insert(ref.end(), v.begin(), v.end());
        CHECK(sameBits(e.state(s), ref));
      }
    }
    CHECK(clipped > 5);
    CHECK(clipped < 45);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("step buffers come from one pool: flat over 100 steps of many tensors") {
  const std::string dir = stateTempDir();
  {
    Sidecar e(policiesEvery(0), {.name = "topk", .density = 0.05}, dir);
    const size_t n = 20000;
    std::vector<double> pooled;
    auto gauge = [&](const std::string& name) {
      const std::string text = e.metrics.exposition();
      const auto at = text.find("\n" + name + " ");
      REQUIRE(at != std::string::npos);
      return std::stod(text.substr(at + name.size() + 2));
    };
    for (uint64_t s = 1; s <= 100; ++s) {
      for (int t = 0; t < 5; ++t) {
        const auto o_r =
            e.step(s, randomValues(n, static_cast<uint32_t>(s * 7 + t)), "t" + std::to_string(t));
        const StepOutcome& o = o_r.first;
        REQUIRE_MESSAGE(o.ok(), o.message);
      }
      pooled.push_back(gauge("lightwire_pool_bytes"));
    }
    // Five tensors, one result buffer at a time: one tensor's worth (its capacity), every step.
    CHECK(pooled.front() >= 4.0 * n);
    CHECK(pooled.front() < 2 * 4.0 * n);
    for (double p : pooled) CHECK(p == pooled.front());
    CHECK(gauge("lightwire_state_bytes") == 5 * 4.0 * n);  // one residual each, one copy
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("limits.max_state_bytes counts state and step buffers; a refusal changes nothing") {
  const std::string dir = stateTempDir();
  {
    const size_t n = 10000;
    // Room for a's residual and a step buffer of n floats, not for b's of 4n.
    Sidecar e(policiesEvery(0), {.name = "topk", .density = 0.05}, dir,
              [&](EngineOptions& opt) { opt.max_state_bytes = 3 * 4 * n; });
    const auto a1_ra1 = e.step(1, randomValues(n, 1), "a");
    const StepOutcome& a1 = a1_ra1.first;
    REQUIRE_MESSAGE(a1.ok(), a1.message);
    const auto before = e.state(1, "a");
    const auto b1_rb1 = e.step(1, randomValues(4 * n, 2), "b");
    const StepOutcome& b1 = b1_rb1.first;
    REQUIRE_FALSE(b1.ok());
    CHECK(b1.error == StepError::kStateLimit);
    CHECK(b1.message.find("tensor 'b' needs 160000 bytes of codec state and 160000 bytes of step "
                          "buffers") != std::string::npos);
    CHECK(b1.message.find("limits.max_state_bytes (120000)") != std::string::npos);
    CHECK(sameBits(e.state(1, "a"), before));
    const auto a2_ra2 = e.step(2, randomValues(n, 3), "a");
    const StepOutcome& a2 = a2_ra2.first;
    CHECK_MESSAGE(a2.ok(), a2.message);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("limits.drop_state_after_steps: an idle tensor gives up its state") {
  const std::string dir = stateTempDir();
  {
    const size_t n = 5000;
    Sidecar e(policiesEvery(0), {.name = "dgc", .density = 0.05, .momentum = 0.9}, dir,
              [](EngineOptions& opt) { opt.drop_state_after_steps = 3; });
    const auto text = [&] { return e.metrics.exposition(); };
    REQUIRE(e.step(1, randomValues(n, 1), "kept").first.ok());
    REQUIRE(e.step(1, randomValues(n, 2), "idle").first.ok());
    CHECK(text().find("\nlightwire_state_bytes 80000\n") != std::string::npos);
    for (uint64_t s = 2; s <= 3; ++s)
      REQUIRE(e.step(s, randomValues(n, 10 + s), "kept").first.ok());
    CHECK(text().find("\nlightwire_state_bytes 80000\n") != std::string::npos);  // 2 steps behind
    REQUIRE(e.step(4, randomValues(n, 14), "kept").first.ok());  // 3 behind: dropped
    CHECK(text().find("\nlightwire_state_bytes 40000\n") != std::string::npos);
    // Back again: it starts fresh, as a tensor never seen (the same result as a fresh sidecar's).
    const auto x = randomValues(n, 15);
    const auto back_r_back = e.step(5, x, "idle");
    const StepOutcome& back = back_r_back.first;
    const std::vector<float>& r_back = back_r_back.second;
    REQUIRE_MESSAGE(back.ok(), back.message);
    Sidecar fresh(policiesEvery(0), {.name = "dgc", .density = 0.05, .momentum = 0.9}, dir + "-f");
    const auto f5_r_f5 = fresh.step(5, x, "idle");
    const StepOutcome& f5 = f5_r_f5.first;
    const std::vector<float>& r_f5 = f5_r_f5.second;
    REQUIRE(f5.ok());
    CHECK(sameBits(r_back, r_f5));
  }
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(dir + "-f");
}
