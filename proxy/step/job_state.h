#pragma once
// The job state a sidecar tells its peers (STATE frames, docs/peer-protocol.md): every tensor's
// last committed step and, with policies, their state (docs/policies.md).

#include <boost/json/value.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/status.h"
#include "policies/policy.h"

namespace lightwire::proxy {

/// JSON {"version": 1, "committed": {"<tensor>": <last committed step>, ...}}; with policies,
/// also "policy": PolicyEngine::stateJson().
std::vector<uint8_t> encodeJobState(const std::map<std::string, uint64_t>& committed,
                                    const policies::PolicyEngine* policy = nullptr);
/// A peer's job state, parsed and checked.
struct JobState {
  std::map<std::string, uint64_t> committed;
  std::optional<boost::json::value> policy;
};
/// Parses and checks a peer's job state (any malformed input is an error, nothing taken).
Result<JobState> decodeJobState(std::span<const uint8_t> bytes);

}  // namespace lightwire::proxy
