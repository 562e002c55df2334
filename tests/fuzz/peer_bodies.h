#pragma once
// What a sidecar does with the bodies of the frames its peers send, beyond the frame header
// (docs/peer-protocol.md "After the handshake"): shared by the `frame` target, which reaches them
// through a header, and the `stats` and `job_state` targets, which drive them directly.

#include <cstdint>
#include <memory>
#include <span>

#include "policies/policy.h"
#include "tests/fuzz/fuzz_util.h"

namespace lightwire::fuzz {

using Span = std::span<const uint8_t>;

/// A policy engine as `serve` builds one, with short baselines, patience and schedules so that a
/// few steps reach every decision (anomaly, rollback, full-sync, adaptive density, warm-up).
std::unique_ptr<policies::PolicyEngine> fuzzPolicy();

/// A DATA payload of codec id `codec` from a ring (reduce or gather phase) or the parameter
/// server's broadcast (after its header): decoded into a chunk of the element count its header
/// states (at most 2^16), as the step engine would; PowerSGD's rounds are the `payload` target's.
void codecPayload(uint8_t codec, Span payload);

/// One statistics record (ps phase 7): size check and decodeStats().
void statsRecord(Span record);

/// A `ring` statistics frame's body (phase 3): unpackStatsEntries(), then each fold as the next
/// rank takes it (foldStats() of a record into it) and as every rank finishes it (finishStats(),
/// then stepAggregate()).
void statsFolds(Span body);

/// The step's records from every rank (ring: gathered; ps phase 8: parsePsStats()), as the step
/// engine takes them after step `step` of a tensor: aggregate(), resumeMismatch(), the policy's
/// plan() and update(), then the settings version that takes effect (compressionFromJson() of the
/// agreed JSON, its chooser, createCodec() of what it chooses) and the policy state read back.
void stepRecords(const std::vector<std::vector<uint8_t>>& records, uint64_t step,
                 policies::PolicyEngine& policy);
/// stepRecords() from the aggregate on.
void stepAggregate(const policies::GlobalStats& g, uint64_t step, policies::PolicyEngine& policy);

/// Steps 1, 2, ... (at most 8) of one tensor, each the parameter server's broadcast of the step's
/// records (a piece of `in`: parsePsStats(), then stepRecords()); one that does not parse fails
/// its step.
void runSteps(Reader& in, uint32_t world, policies::PolicyEngine& policy);

/// A STATE frame: decodeJobState(), then (as serve's takeJobState) the policy state restored into
/// `policy` and read back.
void jobState(Span bytes, policies::PolicyEngine& policy);

/// The policy state read back: restoreState(stateJson()) must succeed, and the status renders.
void policyRoundTrip(policies::PolicyEngine& policy);

}  // namespace lightwire::fuzz
