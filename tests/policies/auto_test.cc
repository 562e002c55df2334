// policies/auto: codec auto — the ladder, the link estimate, the time model, and the decisions the
// policy engine takes from the global statistics (identical on every rank, hysteresis, critical
// phases, the direct window, the flush on a switch away from a rung with state).
#include "policies/auto.h"

#include <doctest/doctest.h>

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <string>
#include <vector>

#include "kernels/registry.h"
#include "policies/policy.h"

namespace lightwire::policies {
namespace {

constexpr uint64_t kN = 1 << 20;  // a 1024 x 1024 layer

PolicyConfig autoConfig(std::string ladder = std::string(kDefaultLadder)) {
  PolicyConfig c;
  c.full_sync_every = 0;
  c.baseline_steps = 5;
  c.auto_codec.ladder_text = std::move(ladder);
  c.auto_codec.period = 2;
  c.auto_codec.hysteresis = 2;
  c.auto_codec.critical_steps = 0;
  c.auto_codec.probe_every = 4;
  return c;
}

/// Global statistics of a step of a layer: a gradient norm of 1, the link and the compute.
GlobalStats stats(double bytes_per_s, double latency_s, double compute_s, double norm = 1.0) {
  GlobalStats g;
  g.ranks = 3;
  g.grad_norm2 = norm * norm;
  g.elements = kN;
  g.resumed_from = {std::nullopt, std::nullopt, std::nullopt};
  g.link_bytes_per_s = bytes_per_s;
  g.link_latency_s = latency_s;
  g.compute_s = compute_s;
  g.overlap_s = compute_s / 2;
  return g;
}

AutoFacts facts() { return AutoFacts{kN, {1024, 1024}, 3, "auto"}; }

/// One step of an auto layer as the pipeline runs it: its rung, the plan, the update.
AutoStep run(PolicyEngine& p, const std::string& tensor, uint64_t step, const GlobalStats& g) {
  const AutoStep a = p.autoStep(tensor, step);
  StepPlan plan = p.plan(tensor, step, a.rung->codec, 1);
  if (a.flush) plan.mode = StepMode::kFullSync;
  const AutoFacts f = facts();
  p.update(tensor, step, plan, g, &f);
  return a;
}

/// Steps 0 and 1 of layer "a" on a fast link: the first direct window (tried, not measured yet).
DirectWindow firstWindow(PolicyEngine& p, const GlobalStats& g) {
  for (uint64_t s = 0; s < 2; ++s) run(p, "a", s, g);
  const auto w = p.directWindowAfter(1);
  REQUIRE(w);
  return *w;
}

size_t rungIndex(const PolicyEngine& p, const std::string& tensor, uint64_t step) {
  return p.autoStep(tensor, step).index;
}

TEST_SUITE("auto") {
  TEST_CASE("the ladder: defaults, every rung kind, clear refusals") {
    auto l = parseLadder(kDefaultLadder);
    REQUIRE(l.isOk());
    REQUIRE(l->size() == 7);
    CHECK((*l)[0].direct);
    CHECK((*l)[0].codec.name == "none");
    CHECK((*l)[3].codec.name == "qsgd");
    CHECK((*l)[3].codec.bits == 8);
    // DGC with momentum correction where the trainers declare momentum 0.9, error feedback alone
    // (the optimizer keeps momentum) where they do not.
    CHECK((*l)[5].label == "dgc 1 % momentum 0.9");
    CHECK((*l)[5].codec.momentum == 0.9);
    CHECK((*l)[6].label == "dgc 1 %");
    CHECK((*l)[6].codec.momentum == 0.0);
    CHECK((*l)[0].steps_factor == 1.0);
    CHECK((*l)[4].steps_factor > 1.0);
    auto own = parseLadder("none,dgc:0.01@1.8");
    REQUIRE(own.isOk());
    CHECK((*own)[1].steps_factor == 1.8);
    CHECK((*own)[1].label == "dgc 1 % @1.8");
    CHECK(parseLadder("none, bf16, topk:0.01, randomk:0.1, powersgd:4").isOk());
    // DGC's momentum correction as a rung: the sidecar owns the layer's momentum while it is in
    // force, and it needs fewer steps than error feedback alone.
    auto corrected = parseLadder("none,dgc:0.01,dgc:0.01:0.9");
    REQUIRE(corrected.isOk());
    CHECK((*corrected)[2].codec.name == "dgc");
    CHECK((*corrected)[2].codec.momentum == 0.9);
    CHECK((*corrected)[2].codec.density == 0.01);
    CHECK((*corrected)[2].label == "dgc 1 % momentum 0.9");
    CHECK((*corrected)[2].steps_factor < (*corrected)[1].steps_factor);
    CHECK_FALSE((*corrected)[2].codec.bias_correction);
    // With dgc's bias correction: its own rung (and codec key), fewer steps again.
    auto biased = parseLadder("none,dgc:0.01:0.9:bc,dgc:0.01:0.9");
    REQUIRE(biased.isOk());
    CHECK((*biased)[1].codec.bias_correction);
    CHECK((*biased)[1].codec.momentum == 0.9);
    CHECK((*biased)[1].label == "dgc 1 % momentum 0.9 bias-corrected");
    CHECK((*biased)[1].text == "dgc:0.01:0.9:bc");
    CHECK((*biased)[1].steps_factor < (*biased)[2].steps_factor);
    CHECK(kernels::configKey((*biased)[1].codec) != kernels::configKey((*biased)[2].codec));
    for (const char* bad : {"",
                            "none,,fp16",
                            "fp16,direct",
                            "qsgd:9",
                            "qsgd",
                            "topk:0",
                            "dgc:2",
                            "powersgd:0",
                            "none,none",
                            "lz4",
                            "fp16:3",
                            "direct",
                            "dgc:0.01@0.5",
                            "dgc:0.01@",
                            "none,none@2",
                            "dgc:0.01:1",
                            "dgc:0.01:0",
                            "dgc:0.01:",
                            "dgc::0.9",
                            "dgc:0.01:x",
                            "topk:0.01:0.9",
                            "dgc:0.01:0.9:",
                            "dgc:0.01:0.9:bias",
                            "dgc:0.01:0.9:bc:bc",
                            "dgc:0.01:bc",
                            "dgc:0.01:0.9:bc,dgc:0.01:0.9:bc@2"}) {
      INFO(bad);
      auto r = parseLadder(bad);
      REQUIRE_FALSE(r.isOk());
      CHECK(r.status().message().find("compression.auto.ladder") != std::string::npos);
    }
    AutoConfig c;
    c.period = 0;
    CHECK(validate(c).message().find("compression.auto.period") != std::string::npos);
  }

  TEST_CASE("the link estimate separates latency from bandwidth") {
    LinkEstimator e;
    CHECK_FALSE(e.estimate());
    for (int i = 0; i < 20; ++i) {
      const double bytes = 1e5 * (1 + i % 4);
      e.add(bytes, 2e-3 + bytes / 1e8);  // 2 ms + 100 MB/s
    }
    auto l = e.estimate();
    REQUIRE(l);
    CHECK(l->bytes_per_s == doctest::Approx(1e8).epsilon(1e-6));
    CHECK(l->latency_s == doctest::Approx(2e-3).epsilon(1e-6));
    // One size only (a layer settled on one rung): the mean rate, no latency; a link ten times
    // slower is seen within the window.
    for (int i = 0; i < 16; ++i) e.add(1e5, 2e-3 + 1e5 / 1e8);
    l = e.estimate();
    CHECK(l->bytes_per_s == doctest::Approx(1e5 / 3e-3));
    CHECK(l->latency_s == 0);
    for (int i = 0; i < 16; ++i) e.add(1e5, 2e-3 + 1e5 / 1e7);
    CHECK(e.estimate()->bytes_per_s == doctest::Approx(1e5 / 12e-3));
    // Waits for peers only add: an exchange that waited 20 ms for a slower rank is not the link.
    LinkEstimator waited;
    for (int i = 0; i < 16; ++i) {
      const double bytes = 1e5 * (1 + i % 4);
      waited.add(bytes, 2e-3 + bytes / 1e8 + (i % 3 == 0 && i < 12 ? 20e-3 : 0.0));
    }
    l = waited.estimate();
    CHECK(l->bytes_per_s == doctest::Approx(1e8).epsilon(1e-6));
    CHECK(l->latency_s == doctest::Approx(2e-3).epsilon(1e-6));
    // ... but the newest points are never waits: a link ten times slower for four exchanges moves
    // the estimate (as much as a least-squares fit of 4 points in 16 can).
    for (int i = 0; i < 4; ++i) {
      const double bytes = 1e5 * (1 + i % 4);
      waited.add(bytes, 2e-3 + bytes / 1e7);
    }
    CHECK(waited.estimate()->bytes_per_s < 0.7e8);
    // Time that does not grow with the bytes: latency-bound.
    LinkEstimator flat;
    for (int i = 0; i < 8; ++i) flat.add(1e4 * (1 + i % 2), 1e-3);
    l = flat.estimate();
    CHECK(l->latency_s == doctest::Approx(1e-3));
    CHECK(l->bytes_per_s >= 2e4 / (0.05 * 1e-3));
  }

  TEST_CASE("the time model: fast links keep dense, slow links compress") {
    auto ladder = *parseLadder(kDefaultLadder);
    std::vector<char> usable(ladder.size(), 1);
    AutoInputs in{kN, {1024, 1024}, 4, Link{1.25e9, 1e-4}, 0.05, 0.04};
    CHECK(chooseRung(ladder, usable, in, 0.05) == 0);  // 10 Gbit/s: hidden behind compute
    in.link = Link{1.25e8 / 8, 1e-4};                  // 125 Mbit/s
    const size_t slow = chooseRung(ladder, usable, in, 0.05);
    CHECK(slow >= 4);
    CHECK(modelStepSeconds(ladder[slow], in) < modelStepSeconds(ladder[1], in) / 3);
    // More compute to hide behind: less compression.
    in.compute_s = in.overlap_s = 5.0;
    CHECK(chooseRung(ladder, usable, in, 0.05) == 0);
    // powersgd needs a matrix.
    const Rung p = (*parseLadder("powersgd:4"))[0];
    CHECK(rungUsable(p, kN, {1024, 1024}));
    CHECK_FALSE(rungUsable(p, kN, {kN}));
  }

  TEST_CASE("a rung with momentum correction only where every trainer declared its momentum") {
    // DGC with momentum correction where the trainers declare momentum 0.9, error feedback alone
    // (the optimizer keeps momentum) where they do not.
    const std::string ladder = "direct,none,fp16,qsgd:8,qsgd:4,dgc:0.01:0.9,dgc:0.01";
    const GlobalStats slow = stats(1e6, 1e-4, 0.05);  // 8 Mbit/s: dgc even at 2.5 times the steps
    auto settle = [](PolicyEngine& p, const GlobalStats& g) {
      for (uint64_t s = 0; s < 6; ++s) run(p, "w", s, g);
      return p.autoStep("w", 6).rung->text;
    };
    // Undeclared (torch.optim.SGD, or trainers that disagree: GlobalStats::momentum is then
    // empty): error feedback alone, the optimizer keeps momentum.
    PolicyEngine plain(autoConfig(ladder), "{}", nullptr);
    CHECK(settle(plain, slow) == "dgc:0.01");
    // Declared 0.9 by every trainer: the rung with momentum correction, fewer steps to the loss.
    GlobalStats declared = slow;
    declared.momentum = 0.9;
    PolicyEngine corrected(autoConfig(ladder), "{}", nullptr);
    CHECK(settle(corrected, declared) == "dgc:0.01:0.9");
    CHECK(corrected.decisions().back().detail.find("trainers' momentum 0.9") != std::string::npos);
    // Another momentum than the rung's: not usable either.
    GlobalStats other = slow;
    other.momentum = 0.95;
    PolicyEngine mismatch(autoConfig(ladder), "{}", nullptr);
    CHECK(settle(mismatch, other) == "dgc:0.01");
    // The declaration stops (a trainer's optimizer changed): the rung goes at once, not at the
    // next period and without hysteresis, flushing its state first.
    run(corrected, "w", 6, slow);  // step 6: odd, not due
    const AutoStep flush = corrected.autoStep("w", 7);
    CHECK(flush.flush);
    CHECK(flush.rung->text == "dgc:0.01:0.9");
    CHECK(corrected.autoStep("w", 8).rung->text == "dgc:0.01");
  }

  TEST_CASE(
      "a switch starts the layer's baselines afresh: another input scale is no critical "
      "phase") {
    PolicyEngine p(autoConfig(), "{}", nullptr);
    const GlobalStats fast = stats(1.25e10, 1e-5, 0.05);  // dense hides behind the compute
    uint64_t s = 0;
    for (; s < 10; ++s) run(p, "w", s, fast);  // a baseline of norm 1 on `none`
    REQUIRE(rungIndex(p, "w", s) == 1);
    const GlobalStats slow = stats(1e6, 1e-4, 0.05);
    while (rungIndex(p, "w", s) == 1 && s < 20) run(p, "w", s++, slow);
    const size_t heavy = rungIndex(p, "w", s);
    REQUIRE(heavy > 1);
    // The new rung's input is 1000 times larger (lightwire.torch.AdamW's preconditioned update,
    // where the rung selects): a new baseline, not a critical phase that moves the layer back.
    // The trainer learns the rung from the reply of the step before: the rung's first step still
    // carries the old scale.
    const size_t logged = p.decisions().size();
    for (uint64_t first = s, end = s + 8; s < end; ++s) {
      run(p, "w", s, stats(1e6, 1e-4, 0.05, s == first ? 1.0 : 1000.0));
    }
    for (size_t i = logged; i < p.decisions().size(); ++i) {
      CHECK(p.decisions()[i].kind != "critical");
    }
    CHECK(rungIndex(p, "w", s) == heavy);
    // ... and a change against that new baseline still is one.
    run(p, "w", s, stats(1e6, 1e-4, 0.05, 3000.0));
    CHECK(p.decisions().back().kind == "auto");
    bool critical = false;
    for (size_t i = logged; i < p.decisions().size(); ++i) {
      critical = critical || p.decisions()[i].kind == "critical";
    }
    CHECK(critical);
  }

  TEST_CASE("the link model counts the bytes of the step's density (the DGC warm-up)") {
    const Rung dgc = (*parseLadder("dgc:0.01"))[0];
    const double nominal = modelBytes(*dgc.impl, kN, {1024, 1024}, 4);
    CHECK(modelBytes(*dgc.impl, kN, {1024, 1024}, 4, 0.01) == doctest::Approx(nominal));
    CHECK(modelBytes(*dgc.impl, kN, {1024, 1024}, 4, 0.25) > 20 * nominal);
  }

  TEST_CASE("a rung is measured from its second step: its first step's tail is left out") {
    PolicyConfig c = autoConfig();
    c.warmup_steps = 20;  // the DGC warm-up: steps 0-19 above 1 %
    PolicyEngine p(c, "{}", nullptr);
    GlobalStats slow = stats(1.25e8 / 8, 1e-4, 0.05);
    run(p, "w", 0, slow);  // the first evaluation: a move without hysteresis
    const size_t heavy = rungIndex(p, "w", 1);
    REQUIRE(heavy >= 4);  // in force from step 1
    auto measured = [&] {
      const auto st = p.stateJson();
      return st.at("tensors").at("w").at("auto").at("measured").as_array().at(heavy).as_double();
    };
    // A request carries the tail of the trainer's iteration before: step 2 brings step 1's, the
    // rung's first (slow, whatever made it so); step 3 brings step 2's.
    run(p, "w", 1, slow);
    slow.tail_s = 10.0;
    run(p, "w", 2, slow);
    CHECK(measured() < 0);  // not measured
    slow.tail_s = 0.02;
    run(p, "w", 3, slow);
    const bool selecting = p.autoStep("w", 3).rung->codec.density.has_value();
    if (selecting) {
      // A selection rung is not measured while the warm-up sends more than its density.
      CHECK(measured() < 0);
      for (uint64_t s = 4; s <= 20; ++s) run(p, "w", s, slow);
      CHECK(measured() < 0);  // step 20 brings step 19's tail: still in the warm-up
      run(p, "w", 21, slow);
    }
    CHECK(measured() == doctest::Approx(0.02));
  }

  TEST_CASE("the first decision waits for the compute figure, then moves without hysteresis") {
    PolicyEngine p(autoConfig(), "{}", nullptr);
    CHECK(rungIndex(p, "w", 0) == 1);  // none: the rung a layer starts on
    GlobalStats early = stats(1.25e8 / 8, 1e-4, 0.05);
    early.compute_s.reset();  // the trainer's first iteration: no compute measured yet
    early.overlap_s.reset();
    run(p, "w", 0, early);
    CHECK(rungIndex(p, "w", 1) == 1);
    CHECK(p.decisions().empty());
    run(p, "w", 1, stats(1.25e8 / 8, 1e-4, 0.05));
    CHECK(rungIndex(p, "w", 2) >= 4);  // no hysteresis for the first decision
    CHECK(p.decisions().back().detail.find("none -> ") == 0);
    // A client that never reports compute gets its first decision after a period.
    PolicyEngine q(autoConfig(), "{}", nullptr);
    for (uint64_t s = 0; s <= 2; ++s) run(q, "w", s, early);
    CHECK(rungIndex(q, "w", 3) >= 4);
  }

  TEST_CASE("a slow link forces compression after the hysteresis; a fast one brings it back") {
    // Evaluations every 20 steps (no direct rung, whose windows add evaluations): the running
    // mean of the compute settles in between.
    PolicyConfig c = autoConfig("none,fp16,qsgd:8,qsgd:4,dgc:0.01");
    c.auto_codec.period = 20;
    PolicyEngine p(c, "{}", nullptr);
    // Starts with the first rung (none); its first evaluation keeps it (enough compute to hide a
    // dense exchange of the slow link).
    CHECK(rungIndex(p, "w", 0) == 0);
    run(p, "w", 0, stats(1.25e8 / 8, 1e-4, 5.0));
    CHECK(rungIndex(p, "w", 1) == 0);
    // The compute shrinks, the link stays: a move to more compression needs two votes.
    const GlobalStats slow = stats(1.25e8 / 8, 1e-4, 0.05);
    uint64_t s = 1;
    for (; s <= 20; ++s) run(p, "w", s, slow);  // step 20: the first vote
    CHECK(rungIndex(p, "w", s) == 0);
    for (; s <= 40; ++s) run(p, "w", s, slow);  // step 40: the second vote in a row
    CHECK(rungIndex(p, "w", 40) == 0);
    const size_t heavy = rungIndex(p, "w", 41);
    CHECK(heavy >= 3);
    auto log = p.decisions();
    REQUIRE_FALSE(log.empty());
    CHECK(log.back().kind == "auto");
    CHECK(log.back().detail.find("none -> ") == 0);
    CHECK(log.back().detail.find("link 15.6 MB/s") != std::string::npos);
    // Back to a fast link: a move to less compression needs no hysteresis, and the rung held
    // state (dgc's residual) when it is one: step s + 1 flushes it.
    const size_t entries = p.decisions().size();
    for (const uint64_t end = s + 25; s < end && p.decisions().size() == entries; ++s)
      run(p, "w", s, stats(1.25e9, 1e-4, 0.05));
    REQUIRE(p.decisions().size() > entries);  // decided at step s - 1
    const bool stateful = p.autoStep("w", s - 1).rung->codec.name == "dgc";
    const AutoStep next = p.autoStep("w", s);
    if (stateful) {
      CHECK(next.flush);  // step s flushes dgc's residual with a full-sync of dgc
      CHECK(next.index == heavy);
      CHECK(p.plan("w", s, next.rung->codec, 1).mode == StepMode::kCompressed);  // made full-sync
      CHECK(rungIndex(p, "w", s + 1) < heavy);
      CHECK(p.decisions().back().detail.find("flushes") != std::string::npos);
    } else {
      CHECK_FALSE(next.flush);
      CHECK(next.index < heavy);
    }
  }

  TEST_CASE("an iteration's tail is shared by the layers' modelled exchanges, not their elements") {
    // Two layers of as many elements: a matrix that PowerSGD carries in a few kilobytes, a vector
    // that only `none` can carry. The hook reports the iteration's tail shared by elements.
    PolicyEngine p(autoConfig("none,powersgd:1"), "{}", nullptr);
    const AutoFacts matrix{kN, {1024, 1024}, 3, "auto"}, vec{kN, {kN}, 3, "auto"};
    const double tail = 1.0;
    for (uint64_t s = 0; s < 12; ++s) {
      for (const auto& [name, f] : {std::pair{"m", matrix}, std::pair{"v", vec}}) {
        GlobalStats g = stats(1e6, 1e-4, 0.05);  // 8 Mbit/s: the matrix compresses
        if (s > 0) g.tail_s = tail / 2;
        const AutoStep a = p.autoStep(name, s);
        StepPlan plan = p.plan(name, s, a.rung->codec, 1);
        if (a.flush) plan.mode = StepMode::kFullSync;
        p.update(name, s, plan, g, &f);
      }
    }
    REQUIRE(p.autoStep("m", 12).rung->text == "powersgd:1");
    REQUIRE(p.autoStep("v", 12).rung->text == "none");
    const auto st = p.stateJson();
    auto measured = [&](const char* name, size_t rung) {
      return st.at("tensors").at(name).at("auto").at("measured").as_array().at(rung).as_double();
    };
    const double m = measured("m", 1), v = measured("v", 0);
    CHECK(m + v == doctest::Approx(tail));
    CHECK(m < 0.01 * v);  // the dense layer caused the tail
  }

  TEST_CASE("a link move counts once two updates in a row see it") {
    PolicyConfig c = autoConfig();
    c.auto_codec.period = 1000;  // evaluations only when the link moves
    PolicyEngine p(c, "{}", nullptr);
    const GlobalStats fast = stats(1.25e10, 1e-5, 5.0), slow = stats(1e6, 1e-4, 0.05);
    uint64_t s = 0;
    for (; s < 6; ++s) run(p, "w", s, fast);
    REQUIRE(rungIndex(p, "w", s) == 1);
    const size_t entries = p.decisions().size();
    // One exchange that waited on a slow peer: not a new link.
    run(p, "w", s++, slow);
    run(p, "w", s++, fast);
    CHECK(rungIndex(p, "w", s) == 1);
    CHECK(p.decisions().size() == entries);
    // Two in a row: the link moved, and the layer moves at once (no period, no hysteresis).
    run(p, "w", s++, slow);
    CHECK(rungIndex(p, "w", s) == 1);
    run(p, "w", s++, slow);
    CHECK(rungIndex(p, "w", s) > 1);
    REQUIRE(p.decisions().size() > entries);
    CHECK(p.decisions().back().detail.find("none -> ") == 0);
  }

  TEST_CASE("a move onto or off a momentum rung must win by the margin") {
    // A link where the momentum rung's score beats the best rung without momentum by 5-15 %:
    // within the noise of the measurements of each other, not worth the velocity a move loses.
    const std::vector<Rung> ladder = *parseLadder(kDefaultLadder);
    const size_t momentum = 5;
    REQUIRE(ladder[momentum].codec.momentum == 0.9);
    auto ratio = [&](double bw) {
      AutoInputs in{kN, {1024, 1024}, 3, Link{bw, 1e-4}, 0.05, 0.025};
      double other = INFINITY;
      for (size_t i = 1; i < ladder.size(); ++i) {
        if (i != momentum) other = std::min(other, modelScore(ladder[i], in));
      }
      return modelScore(ladder[momentum], in) / other;
    };
    double bw = 0;
    for (double b = 1e6; b < 1e11 && bw == 0; b *= 1.02) {
      if (ratio(b) > 0.85 && ratio(b) < 0.95) bw = b;
    }
    REQUIRE(bw > 0);
    GlobalStats close = stats(bw, 1e-4, 0.05);
    close.momentum = 0.9;
    auto settle = [&](PolicyConfig c) {
      PolicyEngine p(c, "{}", nullptr);
      for (uint64_t s = 0; s < 8; ++s) run(p, "w", s, close);
      return p.autoStep("w", 8).index;
    };
    CHECK(settle(autoConfig()) != momentum);  // the default margin, 50 %
    PolicyConfig none = autoConfig();
    none.auto_codec.momentum_margin = 0;
    CHECK(settle(none) == momentum);
    // A clear win (a link 100 times slower) takes the rung.
    GlobalStats slow = stats(bw / 100, 1e-4, 0.05);
    slow.momentum = 0.9;
    PolicyEngine p(autoConfig(), "{}", nullptr);
    for (uint64_t s = 0; s < 8; ++s) run(p, "w", s, slow);
    CHECK(p.autoStep("w", 8).index == momentum);
  }

  TEST_CASE("identical decisions on every rank from different local timings") {
    // Three ranks measured different links and compute; each aggregates the same three records.
    std::vector<std::vector<uint8_t>> records;
    for (int r = 0; r < 3; ++r) {
      StepStats s;
      s.grad_norm2 = 1;
      s.elements = kN;
      s.link_bytes_per_s = 1e7 * (r + 1);
      s.link_latency_s = 1e-4 * (3 - r);
      s.compute_s = 0.01 * (r + 1);
      s.overlap_s = 0.005;
      records.push_back(encodeStats(s));
    }
    auto g = aggregate(records);
    REQUIRE(g.isOk());
    CHECK(*g->link_bytes_per_s == 3e7);  // the fastest link: the rank that waited least
    CHECK(*g->link_latency_s == doctest::Approx(1e-4));
    CHECK(*g->compute_s == doctest::Approx(0.02));  // the median compute
    std::vector<std::unique_ptr<PolicyEngine>> ranks;
    for (int r = 0; r < 3; ++r)
      ranks.push_back(std::make_unique<PolicyEngine>(autoConfig(), "{}", nullptr));
    for (uint64_t step = 0; step < 12; ++step) {
      for (auto& e : ranks) run(*e, "w", step, *g);
    }
    for (auto& e : ranks) {
      CHECK(boost::json::serialize(e->stateJson()) ==
            boost::json::serialize(ranks[0]->stateJson()));
    }
    CHECK_FALSE(ranks[0]->decisions().empty());
  }

  TEST_CASE("a critical phase moves a layer to less compression at once") {
    PolicyConfig c = autoConfig("none,fp16,qsgd:8,qsgd:4,dgc:0.01");
    c.auto_codec.critical_change = 0.5;
    c.auto_codec.critical_hold = 4;
    PolicyEngine p(c, "{}", nullptr);
    const double bw = 1.25e8 / 8;
    uint64_t s = 0;
    for (; s < 10; ++s) run(p, "w", s, stats(bw, 1e-4, 0.05));
    const size_t settled = rungIndex(p, "w", s);
    REQUIRE(settled >= 2);
    // The gradient norm triples (an odd step: not an evaluation step of the period).
    run(p, "w", s, stats(bw, 1e-4, 0.05, 3.0));
    const size_t critical =
        rungIndex(p, "w", s + 1) == settled ? rungIndex(p, "w", s + 2) : rungIndex(p, "w", s + 1);
    CHECK(critical == settled - 1);
    bool logged = false;
    for (const auto& d : p.decisions()) logged = logged || d.kind == "critical";
    CHECK(logged);
    // While the phase lasts (4 steps), no move back to more compression; after it, the score
    // takes the layer back.
    const uint64_t phase_end = s + 1 + 4;
    for (++s; s < phase_end; ++s) {
      run(p, "w", s, stats(bw, 1e-4, 0.05));
      CHECK(rungIndex(p, "w", s + 1) <= settled - 1);
    }
    for (; s < phase_end + 30; ++s) run(p, "w", s, stats(bw, 1e-4, 0.05));
    CHECK(rungIndex(p, "w", s) == settled);
  }

  TEST_CASE("a critical phase does not move a layer off its momentum rung") {
    PolicyConfig c = autoConfig();
    c.auto_codec.critical_change = 0.5;
    PolicyEngine p(c, "{}", nullptr);
    GlobalStats slow = stats(1e6, 1e-4, 0.05);
    slow.momentum = 0.9;
    uint64_t s = 0;
    for (; s < 10; ++s) run(p, "w", s, slow);
    const size_t settled = rungIndex(p, "w", s);
    REQUIRE(p.autoStep("w", s).rung->codec.momentum == 0.9);
    GlobalStats sharp = slow;
    sharp.grad_norm2 = 9.0;  // the norm triples
    run(p, "w", s++, sharp);
    bool logged = false;
    for (const auto& d : p.decisions()) logged = logged || d.kind == "critical";
    CHECK(logged);
    for (const uint64_t end = s + 4; s < end; ++s) {
      run(p, "w", s, slow);
      CHECK(rungIndex(p, "w", s + 1) == settled);
    }
  }

  TEST_CASE("the direct rung is taken job-wide, and only when every tensor allows it") {
    PolicyEngine p(autoConfig(), "{}", nullptr);
    const GlobalStats fast = stats(1.25e10, 1e-5, 0.05);
    StepPlan dense = p.plan("bias", 0, kernels::CodecConfig{}, 1);  // a layer kept dense
    for (uint64_t s = 0; s < 2; ++s) {
      run(p, "a", s, fast);
      run(p, "b", s, fast);
      p.update("bias", s, dense, fast);
    }
    // Step 0 scored the layers (none, lossless; direct scores no worse): decided at the first
    // update of step 1, for steps 2 .. 5.
    auto w = p.directWindowAfter(1);
    REQUIRE(w);
    CHECK(w->from == 2);
    CHECK(w->until == 6);
    CHECK_FALSE(p.directWindowAfter(2));
    bool logged = false;
    for (const auto& d : p.decisions()) logged = logged || (d.kind == "direct" && d.tensor == "*");
    CHECK(logged);
    // After the window (the trainers' process group had steps 2 .. 5), a new one needs three
    // steps through the sidecars first (the first one's tail is not measured): steps 6, 7 and 8,
    // decided at 9.
    for (uint64_t s = 6; s < 9; ++s) {
      run(p, "a", s, fast);
      run(p, "b", s, fast);
    }
    CHECK_FALSE(p.directWindowAfter(8));
    run(p, "a", 9, fast);
    w = p.directWindowAfter(9);
    REQUIRE(w);
    CHECK(w->from == 10);
    // A slow link: the layers' compressed rungs score far better than direct: no window.
    PolicyEngine slow(autoConfig(), "{}", nullptr);
    for (uint64_t s = 0; s < 8; ++s) {
      run(slow, "a", s, stats(1.25e8 / 8, 1e-4, 0.05));
      CHECK_FALSE(slow.directWindowAfter(s));
    }
    // A tensor with a codec of its own keeps the sidecars in the data path.
    PolicyEngine q(autoConfig(), "{}", nullptr);
    kernels::CodecConfig topk;
    topk.name = "topk";
    topk.density = 0.01;
    for (uint64_t s = 0; s < 6; ++s) {
      run(q, "a", s, fast);
      q.update("emb", s, q.plan("emb", s, topk, 1), fast);
    }
    CHECK_FALSE(q.directWindowAfter(5));
    CHECK(q.autoStep("a", 5).rung->codec.name == "none");  // a layer never takes direct alone
  }

  TEST_CASE("a measured direct rung must beat the rungs by the tolerance") {
    // After the first window (tried: not measured yet), `direct` and `none` are measured alike:
    // no second window; measured at half the tail of the sidecars: one.
    for (const double direct : {0.02, 0.01}) {
      CAPTURE(direct);
      PolicyEngine p(autoConfig("direct,none"), "{}", nullptr);
      GlobalStats g = stats(1.25e10, 1e-5, 0.05);
      const auto w = firstWindow(p, g);
      g.direct_s = direct;
      g.tail_s = 0.02;
      for (uint64_t s = w.until; s < w.until + 4; ++s) run(p, "a", s, g);
      CHECK(p.directWindowAfter(w.until + 3).has_value() == (direct < 0.02));
    }
  }

  TEST_CASE(
      "a window that measured better is followed at once by longer ones, up to a chain's end") {
    const uint64_t probe = autoConfig("direct,none").auto_codec.probe_every;
    PolicyEngine p(autoConfig("direct,none"), "{}", nullptr);
    GlobalStats g = stats(1.25e10, 1e-5, 0.05);
    std::optional<DirectWindow> w = firstWindow(p, g);  // tried: not measured yet
    g.direct_s = 0.01;
    g.tail_s = 0.02;
    // The rung in force measured after the first window, then a window of probe_every.
    for (uint64_t s = w->until; s < w->until + 4; ++s) run(p, "a", s, g);
    w = p.directWindowAfter(w->until + 3);
    REQUIRE(w);
    CHECK(w->until - w->from == probe);
    CHECK(w->chain == 0);
    // Each window after it follows two steps through the sidecars, twice as long, three times.
    for (uint32_t chain = 1; chain <= 3; ++chain) {
      CAPTURE(chain);
      const uint64_t end = w->until;
      run(p, "a", end, g);
      run(p, "a", end + 1, g);
      const auto next = p.directWindowAfter(end + 1);
      REQUIRE(next);
      CHECK(next->from == end + 2);
      CHECK(next->until - next->from == (probe << chain));
      CHECK(next->chain == chain);
      w = next;
    }
    // After a chain's last window the sidecars measure the rungs again (three steps) first.
    const uint64_t end = w->until;
    for (uint64_t s = end; s < end + 3; ++s) run(p, "a", s, g);
    CHECK_FALSE(p.directWindowAfter(end + 2).has_value());
    run(p, "a", end + 3, g);
    w = p.directWindowAfter(end + 3);
    REQUIRE(w);
    CHECK(w->chain == 0);
    CHECK(w->until - w->from == probe);
    // The state keeps a window's place in its chain.
    PolicyEngine q(autoConfig("direct,none"), "{}", nullptr);
    REQUIRE(q.restoreState(p.stateJson()).isOk());
    CHECK(q.stateJson().at("direct").at("chain").to_number<uint64_t>() == 0);
    // A window whose `direct` measured no better than the rung in force: no chain.
    g.direct_s = 0.03;
    run(p, "a", w->until, g);
    run(p, "a", w->until + 1, g);
    CHECK_FALSE(p.directWindowAfter(w->until + 1).has_value());
  }

  TEST_CASE("a rung whose iterations compute longer loses to direct at an equal tail") {
    // Where the sidecar shares the trainers' cores, its work lengthens their compute: `direct`
    // and `none` measure the same tail, but the iterations through the sidecars compute 30 %
    // longer than the window's. A rung is judged by the compute of its own iterations.
    for (const double sidecar_compute : {0.05, 0.065}) {
      CAPTURE(sidecar_compute);
      PolicyEngine p(autoConfig("direct,none"), "{}", nullptr);
      GlobalStats g = stats(1.25e10, 1e-5, 0.05);
      const auto w = firstWindow(p, g);
      g.direct_s = 0.02;
      g.tail_s = 0.02;
      run(p, "a", w.until, g);  // the window's last iteration: compute 0.05
      g.compute_s = sidecar_compute;
      g.overlap_s = sidecar_compute / 2;
      for (uint64_t s = w.until + 1; s < w.until + 4; ++s) run(p, "a", s, g);
      const boost::json::object st = p.stateJson();
      const auto& layer = st.at("tensors").at("a").at("auto").as_object();
      CHECK(layer.at("compute_by").as_array().at(0).to_number<double>() == doctest::Approx(0.05));
      CHECK(layer.at("compute_by").as_array().at(1).to_number<double>() ==
            doctest::Approx(sidecar_compute));
      CHECK(p.directWindowAfter(w.until + 3).has_value() == (sidecar_compute > 0.05));
    }
  }

  TEST_CASE("a tail twice the rung's figure, twice in a row, is a slower link; once, a spike") {
    PolicyConfig c = autoConfig("none,fp16");
    c.auto_codec.period = 1000;
    PolicyEngine p(c, "{}", nullptr);
    GlobalStats g = stats(1.25e10, 1e-5, 0.05);
    auto measured = [&] {
      return p.stateJson()
          .at("tensors")
          .at("w")
          .at("auto")
          .at("measured")
          .as_array()
          .at(0)
          .as_double();
    };
    g.tail_s = 0.01;
    uint64_t s = 0;
    for (; s < 6; ++s) run(p, "w", s, g);
    REQUIRE(measured() == doctest::Approx(0.01));
    g.tail_s = 0.1;  // one rank evaluated: the others waited
    run(p, "w", s++, g);
    g.tail_s = 0.01;
    run(p, "w", s++, g);
    CHECK(measured() == doctest::Approx(0.01));  // the spike did not join the figure
    g.tail_s = 0.1;                              // the link slowed down
    run(p, "w", s++, g);
    run(p, "w", s++, g);
    CHECK(measured() == doctest::Approx(0.1));  // the new link's figure at once
  }

  TEST_CASE("no direct window while the link is on the move") {
    // After the first window, three steps through the sidecars; the last two read a slower link
    // (the median of the last three readings sees it once: not yet a move). With a steady link a
    // window follows; with the moving one, none.
    for (const bool moving : {false, true}) {
      CAPTURE(moving);
      PolicyEngine p(autoConfig("direct,none"), "{}", nullptr);
      const GlobalStats fast = stats(1.25e10, 1e-5, 0.05);
      for (uint64_t s = 0; s < 2; ++s) run(p, "a", s, fast);
      auto w = p.directWindowAfter(1);
      REQUIRE(w);
      const uint64_t u = w->until;
      run(p, "a", u, fast);
      run(p, "a", u + 1, moving ? stats(1.25e8, 1e-5, 0.05) : fast);
      run(p, "a", u + 2, moving ? stats(1.25e8, 1e-5, 0.05) : fast);
      run(p, "a", u + 3, moving ? stats(1.25e8, 1e-5, 0.05) : fast);
      CHECK(p.directWindowAfter(u + 3).has_value() == !moving);
    }
  }

  TEST_CASE("no direct window while a layer's momentum is the sidecar's") {
    // One rung through the sidecars, scored as lossless (`@1`), on a fast link: a direct window is
    // tried — unless that rung owns the layer's momentum (the process group's average carries
    // none).
    GlobalStats fast = stats(1.25e10, 1e-5, 0.05);
    fast.momentum = 0.9;
    for (const std::string ladder : {"direct,dgc:0.01@1", "direct,dgc:0.01:0.9@1"}) {
      CAPTURE(ladder);
      PolicyEngine p(autoConfig(ladder), "{}", nullptr);
      for (uint64_t s = 0; s < 4; ++s) run(p, "a", s, fast);
      const bool owns = ladder.find(":0.9") != std::string::npos;
      REQUIRE(p.autoStep("a", 4).rung->codec.momentum == (owns ? 0.9 : 0.0));
      CHECK(p.directWindowAfter(1).has_value() != owns);
    }
  }

  TEST_CASE("auto state survives the state JSON (checkpoints, rejoining peers)") {
    PolicyEngine p(autoConfig(), "{}", nullptr);
    for (uint64_t s = 0; s < 6; ++s) run(p, "w", s, stats(1.25e8 / 8, 1e-4, 0.05));
    PolicyEngine q(autoConfig(), "{}", nullptr);
    REQUIRE(q.restoreState(p.stateJson()).isOk());
    CHECK(boost::json::serialize(q.stateJson()) == boost::json::serialize(p.stateJson()));
    CHECK(q.autoStep("w", 6).index == p.autoStep("w", 6).index);
    // A ladder with fewer rungs cannot take it.
    PolicyEngine r(autoConfig("none,fp16"), "{}", nullptr);
    auto st = r.restoreState(p.stateJson());
    CHECK_FALSE(st.isOk());
    CHECK(st.message().find("compression.auto.ladder differs") != std::string::npos);
    // Nor one with as many rungs but other ones: the indices would name other codecs.
    PolicyEngine other(autoConfig("direct,none,fp16,qsgd:8,qsgd:4,dgc:0.01,dgc:0.001:0.9"), "{}",
                       nullptr);
    const std::string untouched = boost::json::serialize(other.stateJson());
    st = other.restoreState(p.stateJson());
    CHECK_FALSE(st.isOk());
    CHECK(st.message().find("the state was saved with 'direct,none,fp16,qsgd:8,qsgd:4,"
                            "dgc:0.01:0.9,dgc:0.01'") != std::string::npos);
    CHECK(boost::json::serialize(other.stateJson()) == untouched);
    // A ladder that is not a string: refused, nothing changed.
    boost::json::object odd = p.stateJson();
    odd["auto_ladder"] = 7;
    PolicyEngine same(autoConfig(), "{}", nullptr);
    const std::string pristine = boost::json::serialize(same.stateJson());
    st = same.restoreState(odd);
    CHECK_FALSE(st.isOk());
    CHECK(st.message().find("'auto_ladder' must be a string") != std::string::npos);
    CHECK(boost::json::serialize(same.stateJson()) == pristine);
    // Tail weights that are not 4 finite numbers >= 0: refused, nothing changed.
    for (const char* bad : {"[1, 2, 3]", "[1, 2, 3, -4]", "\"x\"", "[1, 2, 3, \"4\"]"}) {
      boost::json::object w = p.stateJson();
      w["tail_weights"] = boost::json::parse(bad);
      st = same.restoreState(w);
      CHECK_FALSE(st.isOk());
      CHECK(st.message().find("'tail_weights' must be 4 finite numbers") != std::string::npos);
      CHECK(boost::json::serialize(same.stateJson()) == pristine);
    }
    // A rung's compute that is not a finite number: refused, nothing changed.
    for (const char* bad : {"[\"x\"]", "[-1, null]", "[1e999]", "7"}) {
      CAPTURE(bad);
      boost::json::object w = p.stateJson();
      w["tensors"].as_object()["w"].as_object()["auto"].as_object()["compute_by"] =
          boost::json::parse(bad);
      st = same.restoreState(w);
      CHECK_FALSE(st.isOk());
      CHECK(st.message().find("compute_by") != std::string::npos);
      CHECK(boost::json::serialize(same.stateJson()) == pristine);
    }
    // Per-rung figures for more rungs than the ladder has: refused, nothing changed.
    for (const char* key : {"measured", "compute_by"}) {
      CAPTURE(key);
      boost::json::object w = p.stateJson();
      auto& a = w["tensors"].as_object()["w"].as_object()["auto"].as_object();
      boost::json::array longer = a.at(key).as_array();
      longer.push_back(-1.0);
      a[key] = longer;
      st = same.restoreState(w);
      CHECK_FALSE(st.isOk());
      CHECK(st.message().find("more than this sidecar's") != std::string::npos);
      CHECK(boost::json::serialize(same.stateJson()) == pristine);
    }
    // A layer's recent link readings that are not up to 3 pairs [s/byte > 0, latency >= 0]:
    // refused, nothing changed.
    for (const char* bad : {"[[1e-9, 0], [1e-9, 0], [1e-9, 0], [1e-9, 0]]", "[[0, 0]]",
                            "[[1e-9, -1]]", "[[1e-9]]", "[\"x\"]", "[[1e-9, \"0\"]]", "7"}) {
      CAPTURE(bad);
      boost::json::object w = p.stateJson();
      w["tensors"].as_object()["w"].as_object()["auto"].as_object()["link_recent"] =
          boost::json::parse(bad);
      st = same.restoreState(w);
      CHECK_FALSE(st.isOk());
      CHECK(st.message().find("link_recent") != std::string::npos);
      CHECK(boost::json::serialize(same.stateJson()) == pristine);
    }
    // 'evaluated' must be a boolean (a bad one changes nothing); a state without it (an older
    // version's) is taken as evaluated.
    boost::json::object bad = p.stateJson();
    auto& layer = bad["tensors"].as_object()["w"].as_object()["auto"].as_object();
    layer["evaluated"] = 3;
    PolicyEngine fresh(autoConfig(), "{}", nullptr);
    const std::string before = boost::json::serialize(fresh.stateJson());
    auto refused = fresh.restoreState(bad);
    CHECK_FALSE(refused.isOk());
    CHECK(refused.message().find("'evaluated' must be a boolean") != std::string::npos);
    CHECK(boost::json::serialize(fresh.stateJson()) == before);
    layer.erase("evaluated");
    REQUIRE(fresh.restoreState(bad).isOk());
    CHECK(fresh.stateJson().at("tensors").at("w").at("auto").at("evaluated").as_bool());
    // The status explains each layer.
    auto status = p.statusJson();
    const auto& layers = status["auto"].as_object().at("layers").as_object();
    REQUIRE(layers.contains("w"));
    const std::string text(layers.at("w").as_object().at("text").as_string());
    CHECK(text.find("w: ") == 0);
    CHECK(text.find("link 15.6 MB/s") != std::string::npos);
    CHECK(text.find("compute 50 ms") != std::string::npos);
  }
}

}  // namespace
}  // namespace lightwire::policies
