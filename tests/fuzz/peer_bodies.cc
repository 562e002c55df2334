#include "tests/fuzz/peer_bodies.h"

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <string>
#include <vector>

#include "kernels/registry.h"
#include "policies/stats.h"
#include "proxy/config/config.h"
#include "proxy/peer/collective.h"
#include "proxy/peer/ps_exchange.h"
#include "proxy/server/control_api.h"
#include "proxy/step/engine.h"
#include "proxy/step/job_state.h"
#include "tests/fuzz/fuzz_util.h"

namespace lightwire::fuzz {

std::unique_ptr<policies::PolicyEngine> fuzzPolicy() {
  policies::PolicyConfig c;
  c.bypass_steps = 2;
  c.baseline_steps = 2;
  c.full_sync_every = 5;
  c.patience = 1;
  c.cooldown_steps = 2;
  c.known_good_steps = 2;
  c.warmup_steps = 3;
  c.total_steps = 20;
  c.adaptive = true;
  c.decision_log = 16;
  const std::string settings = boost::json::serialize(
      proxy::toJson(proxy::CompressionConfig{.default_codec = {.name = "topk", .density = 0.01}}));
  return std::make_unique<policies::PolicyEngine>(c, settings, nullptr);
}

void codecPayload(uint8_t codec, Span payload) {
  constexpr uint64_t kMaxElements = uint64_t{1} << 16;
  if (payload.size() < 16) return;
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{payload[8 + i]} << (8 * i);
  const auto& configs = codecConfigs();
  for (size_t i = 0; i < configs.size(); ++i) {
    const kernels::Codec& c = codecAt(i);
    if (static_cast<uint8_t>(c.traits().id) != codec || c.traits().rounds > 1) continue;
    std::vector<float> out(std::min(n, kMaxElements), 0.0f);
    const std::vector<float> before = out;
    const Status s = c.decodeChunk(payload, 0.5f, out.data(), out.size());
    check(s.isOk() || out == before,
          "a refused payload was written (codec id " + std::to_string(codec) + "): " + s.message());
    return;
  }
}

void statsRecord(Span record) {
  if (record.empty() || record.size() > proxy::kMaxStatsBytes) return;  // the exchange's check
  (void)policies::decodeStats(record);
}

void statsFolds(Span body) {
  if (body.size() < 4) return;
  const uint32_t count = uint32_t{body[0]} | uint32_t{body[1]} << 8 | uint32_t{body[2]} << 16 |
                         uint32_t{body[3]} << 24;
  auto folds = proxy::peer::unpackStatsEntries(body, count);
  if (!folds) return;
  const std::vector<uint8_t> mine = policies::encodeStats(policies::StepStats{.elements = 1});
  uint64_t step = 1;
  for (Span fold : *folds) {
    // As the next rank of the ring folds its own record in, and as every rank finishes it.
    (void)policies::foldStats(fold, mine, 0xFFFF);
    auto g = policies::finishStats(fold);
    if (!g) continue;
    auto policy = fuzzPolicy();
    stepAggregate(*g, step++, *policy);
  }
}

void stepRecords(const std::vector<std::vector<uint8_t>>& records, uint64_t step,
                 policies::PolicyEngine& policy) {
  auto g = policies::aggregate(records);
  if (g) stepAggregate(*g, step, policy);
}

void stepAggregate(const policies::GlobalStats& aggregate, uint64_t step,
                   policies::PolicyEngine& policy) {
  const policies::GlobalStats* g = &aggregate;
  if (policies::resumeMismatch(*g)) return;
  (void)g->cosine();
  (void)g->loss();
  const kernels::CodecConfig topk{.name = "topk", .density = 0.01};
  const policies::StepPlan plan = policy.plan("fuzz.tensor", step, topk, 1);
  const policies::UpdateResult r = policy.update("fuzz.tensor", step, plan, *g);
  if (r.settings) {
    // The engine's SettingsChooser (proxy/server/serve.cc): the agreed JSON as a compression
    // section.
    const auto [version, json] = policy.settingsAt(step + 1);
    boost::system::error_code ec;
    const boost::json::value v = boost::json::parse(json, ec);
    if (!ec) {
      if (auto c = proxy::compressionFromJson(v)) {
        auto chooser = proxy::chooserFor(std::make_shared<const proxy::CompressionConfig>(*c));
        for (uint64_t n : {uint64_t{1}, uint64_t{4096}, uint64_t{1} << 20}) {
          (void)kernels::createCodec(chooser(proxy::TensorFacts{"fuzz.tensor", n}).codec);
        }
      }
    }
  }
  (void)policy.plan("fuzz.tensor", step + 1, topk, 1);
}

void runSteps(Reader& in, uint32_t world, policies::PolicyEngine& policy) {
  constexpr uint64_t kMaxSteps = 8;
  for (uint64_t step = 1; step <= kMaxSteps && !in.empty(); ++step) {
    if (auto records = proxy::peer::parsePsStats(in.piece(), world)) {
      stepRecords(*records, step, policy);
    }
  }
}

void jobState(Span bytes, policies::PolicyEngine& policy) {
  auto state = proxy::decodeJobState(bytes);
  if (!state) {
    check(!state.status().message().empty(), "job state refused without a message");
    return;
  }
  if (state->policy) (void)policy.restoreState(*state->policy);
}

void policyRoundTrip(policies::PolicyEngine& policy) {
  (void)policy.statusJson();
  const boost::json::object state = policy.stateJson();
  // Through text, as checkpoints and STATE frames carry it.
  const std::string text = boost::json::serialize(state);
  const std::string bad = jsonError(text);
  check(bad.empty(), "the policy state does not serialise to JSON that parses: " + bad);
  const boost::json::value back = boost::json::parse(text);
  auto fresh = fuzzPolicy();
  const Status s = fresh->restoreState(back);
  check(s.isOk(),
        "the policy state does not read back (" + s.message() + "): " + text.substr(0, 400));
}

}  // namespace lightwire::fuzz
