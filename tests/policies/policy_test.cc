// policies/policy: plans and decisions as pure functions of the state and the global statistics.
#include "policies/policy.h"

#include <doctest/doctest.h>

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <algorithm>
#include <cmath>
#include <memory>

namespace lightwire::policies {
namespace {

kernels::CodecConfig topk(double density) {
  kernels::CodecConfig c;
  c.name = "topk";
  c.density = density;
  return c;
}

GlobalStats normStats(double norm, double cosine = -2) {
  GlobalStats g;
  g.ranks = 2;
  g.grad_norm2 = norm * norm;
  g.elements = 1000;
  g.resumed_from = {std::nullopt, std::nullopt};
  if (cosine >= -1) {
    g.cos_ranks = 2;
    g.cos_dot = cosine;
    g.cos_c2 = 1;
    g.cos_g2 = 1;
  }
  return g;
}

/// normStats(1) with what both ranks reported of `step`: a loss, a reward (each the mean given).
GlobalStats reported(uint64_t step, std::optional<double> loss, std::optional<double> reward) {
  GlobalStats g = normStats(1);
  if (loss) {
    g.loss_ranks = 2;
    g.loss_sum = 2 * *loss;
    g.loss_step = step;
  }
  if (reward) {
    g.reward_ranks = 2;
    g.reward_sum = 2 * *reward;
    g.reward_step = step;
  }
  return g;
}

PolicyConfig quick() {
  PolicyConfig c;
  c.bypass_steps = 3;
  c.baseline_steps = 5;
  c.full_sync_every = 0;
  c.known_good_steps = 5;
  c.patience = 2;
  c.cooldown_steps = 10;
  c.min_magnitude = 0;
  return c;
}

/// Runs `step` through plan() and update() as the engine does.
StepPlan run(PolicyEngine& p, uint64_t step, const GlobalStats& g,
             kernels::CodecConfig codec = topk(0.1), uint32_t sync_every = 1) {
  const StepPlan plan = p.plan("t", step, codec, sync_every);
  if (plan.mode != StepMode::kSkip) p.update("t", step, plan, g);
  return plan;
}

TEST_SUITE("policies") {
  TEST_CASE("defaults validate; bad values are refused naming the key") {
    CHECK(validate(PolicyConfig{}).isOk());
    PolicyConfig c;
    c.ewma_alpha = 0;
    CHECK(validate(c).message().find("policies.ewma_alpha") != std::string::npos);
    c = {};
    c.adaptive_min_ratio = 100;
    c.adaptive_max_ratio = 10;
    CHECK(validate(c).message().find("adaptive_min_ratio") != std::string::npos);
    c = {};
    c.min_magnitude = std::nan("");
    CHECK_FALSE(validate(c).isOk());
  }

  TEST_CASE("full-sync cadence is exact and skips step 0") {
    PolicyConfig c = quick();
    c.full_sync_every = 5;
    PolicyEngine p(c, "{}", nullptr);
    for (uint64_t s = 0; s < 21; ++s) {
      const bool full = s > 0 && s % 5 == 0;
      CHECK(run(p, s, normStats(1)).mode == (full ? StepMode::kFullSync : StepMode::kCompressed));
    }
  }

  TEST_CASE("delayed sync: exchange steps every k, skips between") {
    PolicyEngine p(quick(), "{}", nullptr);
    for (uint64_t s = 0; s < 12; ++s) {
      const StepPlan plan = p.plan("t", s, topk(0.1), 4);
      if ((s + 1) % 4 == 0) {
        CHECK(plan.mode == StepMode::kCompressed);
        CHECK(plan.delayed_sync_step);
      } else {
        CHECK(plan.mode == StepMode::kSkip);
      }
    }
  }

  TEST_CASE("NaN/Inf: bypass for K steps from the next step, then compression again") {
    PolicyEngine p(quick(), "{}", nullptr);
    for (uint64_t s = 0; s < 50; ++s) CHECK(run(p, s, normStats(1)).mode == StepMode::kCompressed);
    GlobalStats bad = normStats(1);
    bad.nonfinite = 3;
    CHECK(run(p, 50, bad).mode == StepMode::kCompressed);
    // Another tensor's step 50 (a later bucket of the same training step) is not bypassed.
    CHECK(p.plan("u", 50, topk(0.1), 1).mode == StepMode::kCompressed);
    CHECK(p.plan("u", 51, topk(0.1), 1).mode == StepMode::kBypass);
    for (uint64_t s = 51; s <= 53; ++s) CHECK(run(p, s, normStats(1)).mode == StepMode::kBypass);
    CHECK(run(p, 54, normStats(1)).mode == StepMode::kCompressed);
    const auto log = p.decisions();
    REQUIRE(!log.empty());
    CHECK(log.front().kind == "anomaly");
    CHECK(log.front().step == 50);
    CHECK(log.front().detail.find("nonfinite") == 0);
  }

  TEST_CASE("explosion and vanishing against the baseline; not before it is trusted") {
    PolicyEngine p(quick(), "{}", nullptr);
    CHECK(run(p, 0, normStats(1)).mode == StepMode::kCompressed);
    run(p, 1, normStats(1000));  // baseline not trusted yet: no anomaly
    CHECK(run(p, 2, normStats(1)).mode == StepMode::kCompressed);
    PolicyEngine q(quick(), "{}", nullptr);
    for (uint64_t s = 0; s < 20; ++s) run(q, s, normStats(1.0 + 0.01 * (s % 3)));
    run(q, 20, normStats(1000));
    CHECK(run(q, 21, normStats(1)).mode == StepMode::kBypass);
    CHECK(q.decisions().back().detail.find("explosion") == 0);
    for (uint64_t s = 22; s < 40; ++s) run(q, s, normStats(1));
    run(q, 40, normStats(1e-6));
    CHECK(q.decisions().back().detail.find("vanishing") == 0);
    CHECK(run(q, 41, normStats(1)).mode == StepMode::kBypass);
  }

  TEST_CASE("a full-sync step's norm (gradient + flushed state) is no explosion, nor baseline") {
    PolicyConfig c = quick();
    c.full_sync_every = 10;
    PolicyEngine p(c, "{}", nullptr);
    for (uint64_t s = 0; s < 10; ++s) run(p, s, normStats(1.0 + 0.01 * (s % 3)));
    // Step 10 is a full-sync: its input holds the residuals of ten steps.
    CHECK(run(p, 10, normStats(500)).mode == StepMode::kFullSync);
    CHECK(run(p, 11, normStats(1)).mode == StepMode::kCompressed);
    for (const auto& d : p.decisions()) CHECK(d.kind != "anomaly");
    // The baseline did not take it in: a real explosion at the next step is still one.
    run(p, 12, normStats(1000));
    CHECK(p.decisions().back().detail.find("explosion") == 0);
    CHECK(run(p, 13, normStats(1)).mode == StepMode::kBypass);
    // NaN/Inf at a full-sync step is an anomaly as ever.
    for (uint64_t s = 14; s < 30; ++s) run(p, s, normStats(1));
    GlobalStats bad = normStats(1);
    bad.nonfinite = 1;
    CHECK(run(p, 30, bad).mode == StepMode::kFullSync);
    const auto log = p.decisions();
    CHECK(std::any_of(log.begin(), log.end(), [](const Decision& d) {
      return d.step == 30 && d.kind == "anomaly" && d.detail.find("nonfinite") == 0;
    }));
  }

  TEST_CASE("settings proposals take effect at the step after the one that carried them") {
    PolicyEngine a(quick(), "v0", nullptr), b(quick(), "v0", nullptr);
    const std::string v1 = R"({"default": {"codec": "qsgd"}})";  // records carry JSON objects
    const uint64_t id = a.proposeSettings(v1);
    auto rec = decodeStats(a.record({}));
    REQUIRE(rec);
    REQUIRE(rec->requests.size() == 1);
    GlobalStats g = normStats(1);
    g.requests = rec->requests;
    g.requests[0].origin = 0;
    CHECK(g.requests[0].id == id);
    for (auto* p : {&a, &b}) {
      auto r = p->update("t", 7, p->plan("t", 7, topk(0.1), 1), g);
      CHECK(r.settings == std::optional<uint64_t>(1));
      CHECK(p->settingsAt(7).first == 0);
      CHECK(p->settingsAt(8) == std::pair<uint64_t, std::string>{1, v1});
    }
    // Seen by every rank: no longer sent.
    CHECK(decodeStats(a.record({}))->requests.empty());
    CHECK(a.decisions().back().detail == b.decisions().back().detail);
  }

  TEST_CASE("rollback by cosine reverts to the known-good settings on the same step") {
    PolicyEngine p(quick(), "v0", nullptr);
    for (uint64_t s = 0; s < 20; ++s) run(p, s, normStats(1, 0.9));
    GlobalStats g = normStats(1, 0.9);
    g.requests.push_back({Request::Kind::kSettings, 1, 0, "v1"});
    run(p, 20, g);
    CHECK(p.settingsAt(21).first == 1);
    run(p, 21, normStats(1, 0.3));                        // degraded once
    const StepPlan last = run(p, 22, normStats(1, 0.3));  // twice: patience 2
    CHECK(last.settings == 1);
    CHECK(p.settingsAt(23) == std::pair<uint64_t, std::string>{2, "v0"});
    CHECK(p.decisions().back().kind == "rollback");
    // Cool-down: no second rollback (nothing older is known-good anyway).
    for (uint64_t s = 23; s < 30; ++s) run(p, s, normStats(1, 0.3));
    CHECK(p.settingsAt(31).first == 2);
  }

  TEST_CASE("rollback by reported loss; known-good settings are not rolled back past") {
    PolicyEngine p(quick(), "v0", nullptr);
    auto withLoss = [](uint64_t step, double loss) { return reported(step, loss, std::nullopt); };
    for (uint64_t s = 0; s < 10; ++s) run(p, s, withLoss(s, 1.0));
    GlobalStats g = withLoss(10, 1.0);
    g.requests.push_back({Request::Kind::kSettings, 1, 1, "v1"});
    run(p, 10, g);
    for (uint64_t s = 11; s < 20; ++s) run(p, s, withLoss(s, 1.0));  // v1 becomes known-good
    CHECK(p.decisions().back().kind == "known_good");
    g = withLoss(20, 1.0);
    g.requests.push_back({Request::Kind::kSettings, 2, 1, "v2"});
    run(p, 20, g);
    run(p, 21, withLoss(21, 5.0));
    run(p, 22, withLoss(22, 5.0));
    CHECK(p.settingsAt(23) == std::pair<uint64_t, std::string>{3, "v1"});
    // A loss reported once counts once.
    PolicyEngine q(quick(), "v0", nullptr);
    for (uint64_t s = 0; s < 10; ++s) run(q, s, withLoss(0, 1.0));
    CHECK(q.stateJson().at("tensors").at("t").at("loss").at("n").as_uint64() == 1);
  }

  TEST_CASE("rollback by reported reward: a drop beyond the rule rolls back, a rise never") {
    auto withReward = [](uint64_t step, double reward) {
      return reported(step, std::nullopt, reward);
    };
    // Settings version 1 from step 11, after a baseline of rewards around 10 (alternately 9 and
    // 11 for the deviations' form: one deviation of about 1).
    auto engine = [&](PolicyConfig c, bool noisy, metrics::Metrics* m = nullptr) {
      auto p = std::make_unique<PolicyEngine>(c, "v0", m);
      const auto base = [noisy](uint64_t s) { return noisy ? (s % 2 ? 9.0 : 11.0) : 10.0; };
      for (uint64_t s = 0; s < 20; ++s) run(*p, s, withReward(s, base(s)));
      GlobalStats g = withReward(20, base(20));
      g.requests.push_back({Request::Kind::kSettings, 1, 1, "v1"});
      run(*p, 20, g);
      REQUIRE(p->settingsAt(21).first == 1);
      return p;
    };
    auto rolledBack = [](PolicyEngine& p) {
      const auto log = p.decisions();
      return std::any_of(log.begin(), log.end(), [](const Decision& d) {
        return d.kind == "rollback" || d.kind == "degraded";
      });
    };
    PolicyConfig absolute = quick();
    absolute.reward_drop = 1.0;
    PolicyConfig sigma = quick();
    sigma.reward_drop_sigma = 2.0;
    PolicyConfig by_default = quick();  // neither set: 3 deviations
    SUBCASE("an absolute drop beyond reward_drop, for patience steps: back to version 0") {
      metrics::Metrics m;
      auto p = engine(absolute, false, &m);
      run(*p, 21, withReward(21, 8.5));
      run(*p, 22, withReward(22, 8.5));
      CHECK(p->settingsAt(23) == std::pair<uint64_t, std::string>{2, "v0"});
      CHECK(p->decisions().back().kind == "rollback");
      CHECK(p->decisions().back().detail.find("reported reward 8.5 against a baseline of 10 (a "
                                              "drop of more than 1)") != std::string::npos);
      // The job's mean reward, as a gauge.
      CHECK(m.exposition().find("\nlightwire_reward 8.5\n") != std::string::npos);
    }
    SUBCASE("a drop within reward_drop, and a rise, change nothing") {
      for (double after : {9.5, 9.0, 50.0, 1e300}) {
        CAPTURE(after);
        auto p = engine(absolute, false);
        for (uint64_t s = 21; s < 26; ++s) run(*p, s, withReward(s, after));
        CHECK(p->settingsAt(26).first == 1);
        CHECK_FALSE(rolledBack(*p));
      }
    }
    SUBCASE("the deviations' form: beyond reward_drop_sigma deviations rolls back, within not") {
      auto p = engine(sigma, true);
      // A reward 1 lower, as noisy as before: within 2 deviations.
      for (uint64_t s = 21; s < 26; ++s) run(*p, s, withReward(s, s % 2 ? 8.0 : 10.0));
      CHECK(p->settingsAt(26).first == 1);
      CHECK_FALSE(rolledBack(*p));
      auto q = engine(sigma, true);
      run(*q, 21, withReward(21, 6.0));  // about 4 below: 2 deviations are about 2
      run(*q, 22, withReward(22, 6.0));
      CHECK(q->settingsAt(23) == std::pair<uint64_t, std::string>{2, "v0"});
      CHECK(q->decisions().back().detail.find("2 deviations") != std::string::npos);
      // Neither key set: 3 deviations (about 3), so 6.0 is still beyond and 7.5 is not.
      auto d = engine(by_default, true);
      for (uint64_t s = 21; s < 26; ++s) run(*d, s, withReward(s, 7.5));
      CHECK_FALSE(rolledBack(*d));
      auto e = engine(by_default, true);
      run(*e, 21, withReward(21, 6.0));
      run(*e, 22, withReward(22, 6.0));
      CHECK(e->settingsAt(23).first == 2);
      CHECK(e->decisions().back().detail.find("3 deviations") != std::string::npos);
    }
    SUBCASE("a reward reported once counts once; with rollback off a drop changes nothing") {
      auto p = engine(absolute, false);
      for (uint64_t s = 21; s < 26; ++s) run(*p, s, withReward(20, 1.0));  // step 20's, again
      CHECK(p->settingsAt(26).first == 1);
      PolicyConfig off = absolute;
      off.rollback = false;  // as under bounded staleness (serve turns it off there)
      auto q = engine(off, false);
      for (uint64_t s = 21; s < 26; ++s) run(*q, s, withReward(s, 1.0));
      CHECK(q->settingsAt(26).first == 1);
      CHECK_FALSE(rolledBack(*q));
    }
    SUBCASE("the reward's baseline is policy state; a state without it (older) is read") {
      auto p = engine(absolute, false);
      const boost::json::object state = p->stateJson();
      CHECK(state.at("tensors").at("t").at("reward").at("n").as_uint64() == 21);
      CHECK(state.at("tensors").at("t").at("last_reward_step").as_uint64() == 20);
      PolicyEngine q(absolute, "other", nullptr);
      REQUIRE(q.restoreState(state).isOk());
      run(q, 21, withReward(21, 8.5));
      run(q, 22, withReward(22, 8.5));
      CHECK(q.settingsAt(23).first == 2);  // decided from the restored baseline
      boost::json::object older = state;
      auto& t = older["tensors"].as_object()["t"].as_object();
      t.erase("reward");
      t.erase("last_reward_step");
      PolicyEngine r(absolute, "other", nullptr);
      REQUIRE(r.restoreState(older).isOk());
      CHECK(r.stateJson().at("tensors").at("t").at("reward").at("n").as_uint64() == 0);
    }
  }

  TEST_CASE("the reward rule's keys: one form at most, each a finite number > 0") {
    PolicyConfig c;
    CHECK(rewardDropSigma(c) == std::optional<double>(kRewardDropSigma));
    c.reward_drop = 0.5;
    CHECK(validate(c).isOk());
    CHECK(!rewardDropSigma(c));
    c.reward_drop_sigma = 2;
    const Status both = validate(c);
    CHECK(both.message().find("policies.reward_drop and policies.reward_drop_sigma are both set") !=
          std::string::npos);
    for (double bad : {0.0, -1.0, HUGE_VAL, std::nan("")}) {
      CAPTURE(bad);
      PolicyConfig d;
      d.reward_drop = bad;
      CHECK(validate(d).message().find("policies.reward_drop must be") != std::string::npos);
      PolicyConfig e;
      e.reward_drop_sigma = bad;
      CHECK(validate(e).message().find("policies.reward_drop_sigma must be") != std::string::npos);
    }
  }

  TEST_CASE("schedules: warm-up, phase, adaptive") {
    PolicyConfig c = quick();
    c.warmup_steps = 10;
    PolicyEngine p(c, "{}", nullptr);
    const double want[] = {0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625};
    for (uint64_t s = 0; s < 6; ++s) CHECK(*p.plan("t", s, topk(0.001), 1).density == want[s]);
    CHECK(!p.plan("t", 10, topk(0.001), 1).density);
    CHECK(!p.plan("t", 9, topk(0.5), 1).density);               // the codec asks for more already
    CHECK(!p.plan("t", 0, kernels::CodecConfig{}, 1).density);  // not a selection codec

    PolicyConfig ph = quick();
    ph.total_steps = 100;
    PolicyEngine q(ph, "{}", nullptr);
    CHECK(*q.plan("t", 0, topk(0.01), 1).density == doctest::Approx(0.04));
    CHECK(!q.plan("t", 50, topk(0.01), 1).density);
    CHECK(*q.plan("t", 80, topk(0.01), 1).density == doctest::Approx(0.04));
    CHECK(*q.plan("t", 99, topk(0.5), 1).density == 1.0);

    PolicyConfig ad = quick();
    ad.adaptive = true;
    ad.adaptive_max_ratio = 400;
    PolicyEngine r(ad, "{}", nullptr);
    for (uint64_t s = 0; s < 10; ++s) run(r, s, normStats(1));
    for (uint64_t s = 10; s < 20; ++s) run(r, s, normStats(0.001));  // tiny: harder, to the cap
    CHECK(*r.plan("t", 20, topk(0.01), 1).density == doctest::Approx(1.0 / 400));
    GlobalStats sparse = normStats(1);
    sparse.small = 950;
    for (uint64_t s = 20; s < 40; ++s) run(r, s, sparse);  // already sparse: softer, to the floor
    CHECK(*r.plan("t", 40, topk(0.01), 1).density == doctest::Approx(0.1));
  }

  TEST_CASE(
      "a schedule's density change restarts the cosine baseline, a settings change does not") {
    PolicyConfig c = quick();
    c.warmup_steps = 10;
    PolicyEngine p(c, "v0", nullptr);
    // Warm-up stages move the cosine down by design: no degradation, nothing logged.
    for (uint64_t s = 0; s < 10; ++s)
      run(p, s, normStats(1, 0.95 - 0.1 * static_cast<double>(s / 2)), topk(0.001));
    for (uint64_t s = 10; s < 20; ++s) run(p, s, normStats(1, 0.3), topk(0.001));
    CHECK(p.decisions().empty());
    // A settings change that lowers it is judged against the baseline before it.
    GlobalStats g = normStats(1, 0.3);
    g.requests.push_back({Request::Kind::kSettings, 1, 0, "v1"});
    run(p, 20, g, topk(0.001));
    run(p, 21, normStats(1, 0.01), topk(0.001));
    run(p, 22, normStats(1, 0.01), topk(0.001));
    CHECK(p.decisions().back().kind == "rollback");
  }

  TEST_CASE("checkpoint requests reach every rank; own requests stop once seen") {
    PolicyEngine p(quick(), "{}", nullptr);
    p.requestCheckpoint(9);
    auto rec = decodeStats(p.record({}));
    REQUIRE(rec->requests.size() == 1);
    GlobalStats g = normStats(1);
    g.requests = rec->requests;
    auto r = p.update("t", 10, p.plan("t", 10, topk(0.1), 1), g);
    REQUIRE(r.checkpoints.size() == 1);
    CHECK(r.checkpoints[0].step == 9);
    CHECK(decodeStats(p.record({}))->requests.empty());
  }

  TEST_CASE("baselines stay finite, so the state stays JSON, whatever the records say") {
    // Found by fuzzing: a cosine from a record that is not honest (1e247) and a huge reported
    // loss made a baseline's variance Infinity, which JSON cannot hold (checkpoints, STATE).
    PolicyEngine p(quick(), "v0", nullptr);
    for (uint64_t s = 0; s < 12; ++s) {
      GlobalStats g = normStats(s % 2 ? 1e150 : 1e-150, 0.5);
      g.cos_dot = s % 2 ? 1e247 : -1e247;
      g.loss_ranks = 1;
      g.loss_sum = s % 2 ? 1.7e308 : -1.7e308;
      g.loss_step = s + 1;
      run(p, s, g);
    }
    const std::string text = boost::json::serialize(p.stateJson());
    CAPTURE(text);
    boost::system::error_code ec;
    const auto back = boost::json::parse(text, ec);
    REQUIRE_FALSE(ec);
    PolicyEngine q(quick(), "v0", nullptr);
    CHECK(q.restoreState(back).isOk());
  }

  TEST_CASE("state round-trips: a restored engine decides exactly like the original") {
    PolicyEngine a(quick(), "v0", nullptr);
    for (uint64_t s = 0; s < 30; ++s) {
      GlobalStats g = normStats(1 + 0.1 * (s % 4), 0.8);
      if (s == 12) g.nonfinite = 1;
      run(a, s, g);
    }
    PolicyEngine b(quick(), "other", nullptr);
    REQUIRE(b.restoreState(a.stateJson()).isOk());
    CHECK(boost::json::value(a.stateJson()) == boost::json::value(b.stateJson()));
    for (uint64_t s = 30; s < 60; ++s) {
      GlobalStats g = normStats(s == 40 ? 5000 : 1, s > 50 ? 0.1 : 0.8);
      CHECK(run(a, s, g).mode == run(b, s, g).mode);
    }
    const auto la = a.decisions(), lb = b.decisions();
    REQUIRE(la.size() == lb.size());
    for (size_t i = 0; i < la.size(); ++i) {
      CHECK(la[i].seq == lb[i].seq);
      CHECK(la[i].detail == lb[i].detail);
    }
  }

  TEST_CASE("a malformed state is refused and changes nothing") {
    PolicyEngine a(quick(), "v0", nullptr);
    run(a, 0, normStats(1));
    const auto before = boost::json::value(a.stateJson());
    for (
        const char* text :
        {"[]", "{}", R"({"version":2})",
         R"({"version":1,"bypass_from":0,"bypass_until":0,"cooldown_until":0,"next_seq":0,"settings":[],"tensors":{},"log":[]})",
         R"({"version":1,"bypass_until":-1,"cooldown_until":0,"next_seq":0,"settings":[{"json":"","from_step":0,"known_good":true,"why":""}],"tensors":{},"log":[]})",
         R"({"version":1,"bypass_from":0,"bypass_until":0,"cooldown_until":0,"next_seq":0,"settings":[{"json":"","from_step":0,"known_good":true,"why":""}],"tensors":{"t":{"norm":1}},"log":[]})"}) {
      CAPTURE(text);
      CHECK_FALSE(a.restoreState(boost::json::parse(text)).isOk());
      CHECK(boost::json::value(a.stateJson()) == before);
    }
  }

  TEST_CASE(
      "peer.sparse auto: a layer's collective is logged when first chosen and when it moves; "
      "the last choice is policy state") {
    PolicyEngine a(quick(), "{}", nullptr);
    auto exchanges = [](const PolicyEngine& p) {
      std::vector<std::pair<uint64_t, std::string>> out;
      for (const auto& d : p.decisions()) {
        if (d.kind == "exchange") out.emplace_back(d.step, d.detail);
      }
      return out;
    };
    a.noteExchange(0, "w", true, [] { return std::string("sparse allreduce (0)"); });
    a.noteExchange(1, "w", true, [] { return std::string("sparse allreduce (1)"); });
    a.noteExchange(2, "w", false, [] { return std::string("allgather (2)"); });
    using Log = std::vector<std::pair<uint64_t, std::string>>;
    CHECK(exchanges(a) == Log{{0, "sparse allreduce (0)"}, {2, "allgather (2)"}});
    // A sidecar that took the state logs a move only, as its peers do.
    PolicyEngine b(quick(), "{}", nullptr);
    REQUIRE(b.restoreState(a.stateJson()).isOk());
    b.noteExchange(3, "w", false, [] { return std::string("allgather (3)"); });
    b.noteExchange(4, "w", true, [] { return std::string("sparse allreduce (4)"); });
    CHECK(exchanges(b) ==
          Log{{0, "sparse allreduce (0)"}, {2, "allgather (2)"}, {4, "sparse allreduce (4)"}});
    // A bad value: refused, nothing changed.
    boost::json::object bad = a.stateJson();
    bad["tensors"].as_object()["w"].as_object()["exchange"] = "scatter";
    const std::string before = boost::json::serialize(b.stateJson());
    const auto st = b.restoreState(bad);
    CHECK_FALSE(st.isOk());
    CHECK(st.message().find("'exchange' must be") != std::string::npos);
    CHECK(boost::json::serialize(b.stateJson()) == before);
  }
}

}  // namespace
}  // namespace lightwire::policies
