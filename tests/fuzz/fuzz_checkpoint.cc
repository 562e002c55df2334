// Target `checkpoint`: a checkpoint file as a sidecar reads it at start or on POST /v1/resume
// (policies/checkpoint.h, proxy/step/checkpoints.cc restoreFrom): decodeCheckpoint() of the bytes,
// and again with the header's body length and the XXH3 trailer put right (so that the fuzzer gets
// past the checksum); then what the engine does with an accepted file: the policy state restored
// (and read back), every tensor's dtype checked and its codec state restored, and, for a tensor
// whose codec key is one of codecConfigs() and whose state has that codec's size, one step and one
// full synchronisation run from the restored state (fuzz_util.h runStep).
//
// Input: the file.
#include <xxhash.h>

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include "kernels/registry.h"
#include "policies/checkpoint.h"
#include "tests/fuzz/peer_bodies.h"
#include "tests/fuzz/targets.h"

namespace lightwire::fuzz::checkpoint {
namespace {

constexpr size_t kHeaderBytes = 16, kTrailerBytes = 8;
constexpr uint64_t kMaxStepElements = uint64_t{1} << 16;
constexpr size_t kMaxStepTensors = 4;

policies::CheckpointExpect expectation() {
  policies::CheckpointExpect e;
  e.job_id = std::string(kJob);
  e.world_size = 2;
  e.rank = 1;
  return e;
}

/// The index in codecConfigs() whose configKey() is `key`, or -1.
int configOfKey(const std::string& key) {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> k;
    for (const auto& c : codecConfigs()) k.push_back(kernels::configKey(c));
    return k;
  }();
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] == key) return static_cast<int>(i);
  }
  return -1;
}

void restore(const policies::Checkpoint& c) {
  if (!c.policy_json.empty()) {
    boost::system::error_code ec;
    const boost::json::value v = boost::json::parse(c.policy_json, ec);
    if (!ec) {
      auto policy = fuzzPolicy();
      if (policy->restoreState(v).isOk()) policyRoundTrip(*policy);
    }
  }
  size_t stepped = 0;
  for (const auto& t : c.tensors) {
    if (t.dtype > static_cast<uint8_t>(kernels::DType::kBF16)) return;  // the engine refuses it
  }
  for (const auto& t : c.tensors) {
    kernels::CodecState state(t.state.size());
    if (!t.state.empty() && !state.restore(t.state).isOk()) fail("restore of a sized state failed");
    const int i = configOfKey(t.codec_key);
    if (i < 0 || t.elements > kMaxStepElements || stepped >= kMaxStepTensors) continue;
    const kernels::Codec& codec = codecAt(static_cast<size_t>(i));
    // The engine keeps a restored state only at its codec's size (else: fresh state).
    if (t.state.size() != codec.stateFloats(t.elements)) continue;
    ++stepped;
    kernels::CodecState flushed = state;
    (void)runStep(codec, t.elements, 1, state);
    (void)runStep(codec, t.elements, 2, flushed, /*flush=*/true);
  }
}

}  // namespace

int run(const uint8_t* data, size_t size) {
  std::vector<uint8_t> bytes(data, data + size);
  auto c = policies::decodeCheckpoint(bytes, expectation());
  if (!c && size >= kHeaderBytes + kTrailerBytes) {
    // Put the body length and the checksum right, and read it again.
    const uint64_t body = size - kHeaderBytes - kTrailerBytes;
    for (int i = 0; i < 8; ++i) bytes[8 + i] = static_cast<uint8_t>(body >> (8 * i));
    const uint64_t sum = XXH3_64bits(bytes.data() + kHeaderBytes, body);
    for (int i = 0; i < 8; ++i)
      bytes[kHeaderBytes + body + i] = static_cast<uint8_t>(sum >> (8 * i));
    c = policies::decodeCheckpoint(bytes, expectation());
  }
  if (!c) {
    check(!c.status().message().empty(), "a checkpoint refused without a message");
    return 0;
  }
  // The layout has one spelling per content: what was read writes back byte for byte.
  check(policies::encodeCheckpoint(*c) == bytes,
        "an accepted checkpoint does not write back the same");
  restore(*c);
  return 0;
}

void seeds(Seeds& out) {
  // Every codec's state after two steps, as the engine writes it (its configKey, elements, dtype,
  // last committed step), with the policy state of a policy engine and a delayed-sync accumulator.
  const auto& configs = codecConfigs();
  policies::Checkpoint all;
  all.job_id = std::string(kJob);
  all.world_size = 2;
  all.rank = 1;
  all.step = 5;
  all.reason = "trainer";
  all.policy_json = boost::json::serialize(fuzzPolicy()->stateJson());
  for (size_t i = 0; i < configs.size(); ++i) {
    const kernels::Codec& codec = codecAt(i);
    const size_t n = 300;
    if (codec.stateFloats(n) == 0 && i != 0) continue;
    kernels::CodecState state(codec.stateFloats(n));
    for (uint32_t step = 4; step <= 5; ++step) {
      if (!runStep(codec, n, step, state).isOk()) fail("seed step of " + configs[i].name);
    }
    policies::CheckpointTensor t;
    t.name = "layer" + std::to_string(i) + ".weight";
    t.codec_key = kernels::configKey(configs[i]);
    t.elements = n;
    t.last_committed = 5;
    const auto current = state.currentSpan();
    t.state.assign(current.begin(), current.end());
    if (i == 0) t.accumulator = pattern(n, 11);
    policies::Checkpoint one = all;
    one.tensors = {t};
    out.emplace_back(std::to_string(i) + "_" + configs[i].name, policies::encodeCheckpoint(one));
  }
  policies::Checkpoint periodic = all;
  periodic.reason = "periodic";
  periodic.policy_json.clear();
  out.emplace_back("empty", policies::encodeCheckpoint(periodic));
}

}  // namespace lightwire::fuzz::checkpoint
