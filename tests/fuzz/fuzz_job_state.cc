// Target `job_state`: the JSON job state peers send in STATE frames (docs/peer-protocol.md
// "STATE"): decodeJobState(), then, as serve's takeJobState does for a sidecar that has completed
// no step, the policy state restored (PolicyEngine::restoreState), and that state written and
// read back. A policy state is also what checkpoints carry (the `checkpoint` target).
//
// Input: the STATE payload (JSON).
#include <boost/json/serialize.hpp>

#include "proxy/step/engine.h"
#include "proxy/step/job_state.h"
#include "tests/fuzz/peer_bodies.h"
#include "tests/fuzz/targets.h"

namespace lightwire::fuzz::job_state {

int run(const uint8_t* data, size_t size) {
  auto policy = fuzzPolicy();
  jobState({data, size}, *policy);
  policyRoundTrip(*policy);
  return 0;
}

void seeds(Seeds& out) {
  const std::map<std::string, uint64_t> committed = {{"bucket.0", 12}, {"bucket.1", 12}};
  out.emplace_back("fresh", proxy::encodeJobState(committed, fuzzPolicy().get()));
  out.emplace_back("no_policy", proxy::encodeJobState({{"w", 3}}));
  // Policy states after steps of the `stats` seeds (baselines, anomalies, settings, rollbacks).
  Seeds runs;
  stats::seeds(runs);
  for (const auto& [name, bytes] : runs) {
    if (name.rfind("steps_", 0) != 0) continue;
    Reader in(bytes);
    in.u8();
    const uint32_t world = 1 + in.u8() % 8;
    auto policy = fuzzPolicy();
    runSteps(in, world, *policy);
    out.emplace_back("after_" + name, proxy::encodeJobState(committed, policy.get()));
  }
  auto resumed = fuzzPolicy();
  resumed->setResumedFrom(12);
  out.emplace_back("resumed", proxy::encodeJobState(committed, resumed.get()));
}

}  // namespace lightwire::fuzz::job_state
