// Target `stats`: the policy statistics records peers send with every step (policies/stats.h,
// docs/exchange.md): one record (decodeStats), or a run of steps, each the parameter server's
// broadcast of every rank's record (parsePsStats), taken as the step engine takes them
// (peer_bodies.h stepRecords: aggregate, resume check, the policy's decisions, agreed settings
// parsed and used), and at the end the policy state written and read back.
//
// Input: u8 mode (bit 1: the rest is the body of a `ring` statistics frame, folds of records
// (peer_bodies.h statsFolds); else bit 0: a run of steps), then either one record (the rest), or
// u8 world size (1 + x % 8) and up to 8 pieces (u32 length, bytes), one broadcast per step.
#include <boost/json/serialize.hpp>

#include "policies/stats.h"
#include "proxy/config/config.h"
#include "proxy/peer/collective.h"
#include "proxy/peer/ps_exchange.h"
#include "tests/fuzz/peer_bodies.h"
#include "tests/fuzz/targets.h"

namespace lightwire::fuzz::stats {
namespace {

constexpr uint8_t kSteps = 1;
constexpr uint8_t kFolds = 2;  // a `ring` statistics frame's body: folds of records

using policies::Request;
using policies::StepStats;

StepStats healthy(double norm2) {
  StepStats s{.grad_norm2 = norm2, .elements = 4096, .small = 12, .residual_norm2 = 0.25};
  s.cos_dot = 0.8;
  s.cos_c2 = 1.0;
  s.cos_g2 = 1.0;
  return s;
}

std::vector<uint8_t> stepsSeed(uint32_t world, const std::vector<std::vector<StepStats>>& steps) {
  Writer w;
  w.u8(kSteps).u8(static_cast<uint8_t>(world - 1));
  for (const auto& ranks : steps) {
    std::vector<std::vector<uint8_t>> records;
    for (const auto& s : ranks) records.push_back(policies::encodeStats(s));
    w.piece(proxy::peer::encodePsStats(records));
  }
  return w.take();
}

}  // namespace

int run(const uint8_t* data, size_t size) {
  Reader in(data, size);
  const uint8_t mode = in.u8();
  if (mode & kFolds) {
    statsFolds(in.rest());
    return 0;
  }
  if (!(mode & kSteps)) {
    statsRecord(in.rest());
    return 0;
  }
  const uint32_t world = 1 + in.u8() % 8;
  auto policy = fuzzPolicy();
  runSteps(in, world, *policy);
  policyRoundTrip(*policy);
  return 0;
}

void seeds(Seeds& out) {
  StepStats full = healthy(2.0);
  full.nonfinite = 0;
  full.loss = 1.25;
  full.loss_step = 9;
  full.reward = -3.5;
  full.reward_step = 9;
  full.resumed_from = 4;
  full.momentum = 0.9;
  const std::string settings = boost::json::serialize(proxy::toJson(proxy::CompressionConfig{
      .default_codec = {.name = "dgc", .density = 0.02, .momentum = 0.9}}));
  full.requests.push_back({.kind = Request::Kind::kSettings, .id = 3, .body = settings});
  full.requests.push_back({.kind = Request::Kind::kCheckpoint, .id = 4, .step = 9});
  Writer one;
  one.u8(0).bytes(policies::encodeStats(full));
  out.emplace_back("record_full", one.take());
  Writer bare;
  bare.u8(0).bytes(policies::encodeStats(StepStats{.elements = 1}));
  out.emplace_back("record_bare", bare.take());
  // The folds a ring's statistics frame carries: ranks 0..2 of one tensor, rank 0 of another.
  std::vector<uint8_t> fold;
  for (uint32_t r = 0; r < 3; ++r) {
    StepStats s = r == 1 ? full : healthy(1.0 + r);
    s.resumed_from = 4;
    fold = *policies::foldStats(fold, policies::encodeStats(s), r);
  }
  Writer folds;
  folds.u8(kFolds).bytes(proxy::peer::packStatsEntries(
      {fold, *policies::foldStats({}, policies::encodeStats(healthy(3.0)), 0)}));
  out.emplace_back("folds", folds.take());

  // Steady steps, then a norm explosion (anomaly: bypass), then NaN on one rank.
  std::vector<std::vector<StepStats>> steps;
  for (int i = 0; i < 4; ++i) steps.push_back({healthy(2.0 + 0.1 * i), healthy(2.1)});
  steps.push_back({healthy(5000.0), healthy(4000.0)});
  StepStats nan = healthy(0);
  nan.nonfinite = 3;
  steps.push_back({nan, healthy(2.0)});
  out.emplace_back("steps_anomaly", stepsSeed(2, steps));

  // A settings proposal agreed, then the cosine, the loss and the reward degrade (rollback).
  steps.clear();
  StepStats propose = healthy(2.0);
  propose.requests.push_back({.kind = Request::Kind::kSettings, .id = 1, .body = settings});
  steps.push_back({propose, healthy(2.0), healthy(2.0)});
  for (int i = 0; i < 5; ++i) {
    StepStats worse = healthy(2.0);
    worse.cos_dot = 0.8 / (i + 2);
    worse.loss = 1.0 + i;
    worse.loss_step = static_cast<uint64_t>(i + 1);
    worse.reward = 10.0 - 4.0 * i;
    worse.reward_step = static_cast<uint64_t>(i + 1);
    steps.push_back({worse, worse, healthy(2.0)});
  }
  out.emplace_back("steps_rollback", stepsSeed(3, steps));

  // Sidecars that resumed from different steps; a rank without a record (bounded staleness).
  steps.clear();
  StepStats resumed = healthy(1.0);
  resumed.resumed_from = 10;
  StepStats other = healthy(1.0);
  other.resumed_from = 12;
  steps.push_back({resumed, other});
  out.emplace_back("steps_resume_mismatch", stepsSeed(2, steps));
  Writer partial;
  partial.u8(kSteps).u8(3).piece(proxy::peer::encodePsStats(
      {policies::encodeStats(healthy(1.0)), {}, policies::encodeStats(healthy(1.5)), {}}));
  out.emplace_back("steps_partial", partial.take());

  // Found by fuzzing: settings that are not a JSON object (here not UTF-8) were taken into the
  // policy state; a dishonest cosine and huge losses made a baseline Infinity. Both left a policy
  // state that is not JSON.
  StepStats not_json = healthy(1.0);
  not_json.requests.push_back(
      {.kind = Request::Kind::kSettings, .id = 2, .body = "{\"a\xff\": 1}"});
  steps.clear();
  steps.push_back({not_json, healthy(1.0)});
  for (int i = 0; i < 6; ++i) {
    StepStats huge = healthy(i % 2 ? 1e300 : 1e-300);
    huge.cos_dot = i % 2 ? 1e247 : -1e247;
    huge.loss = i % 2 ? 1.7e308 : -1.7e308;
    huge.loss_step = static_cast<uint64_t>(i + 1);
    huge.reward = i % 2 ? -1.7e308 : 1.7e308;
    huge.reward_step = static_cast<uint64_t>(i + 1);
    steps.push_back({huge, healthy(1.0)});
  }
  out.emplace_back("steps_not_json", stepsSeed(2, steps));
}

}  // namespace lightwire::fuzz::stats
