#pragma once
// Helpers shared by the kernels tests.
#include <cstddef>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "kernels/codec.h"
#include "kernels/philox.h"
#include "kernels/registry.h"

using lightwire::Result;
using lightwire::Status;

namespace lightwire::kernels::testing {

inline std::vector<float> gaussian(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = d(gen);
  return x;
}

inline std::unique_ptr<Codec> make(const CodecConfig& c) {
  auto r = createCodec(c);
  if (!r) throw std::runtime_error(r.status().message());
  return std::move(r).value();
}

/// Views of payloads (one per chunk), as commitState() takes them.
inline std::vector<std::span<const uint8_t>> spans(const std::vector<std::vector<uint8_t>>& p) {
  return {p.begin(), p.end()};
}

/// One single-round step of one tensor held open between encoding and commit, as a step's owner
/// holds it: this sidecar's round-0 payload of every chunk and the workspace analyze() and
/// encodeChunk() used (commitState() reads what the codec kept there).
struct OpenStep {
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<std::byte> workspace;
};

/// analyze() and encodeChunk() of every chunk (round 0), as encodeTensor(), keeping the workspace
/// for commitStep(). The state is left as it was: without commitStep() the step never happened
/// (a failed step).
inline Result<OpenStep> openStep(const Codec& codec, const StepContext& ctx,
                                 const Chunking& chunking, ConstTensor input, CodecState& state) {
  OpenStep step;
  step.workspace.resize(codec.workspaceBytes(chunking));
  LW_RETURN_IF_ERROR(codec.analyze(ctx, chunking, input, state, step.workspace));
  step.payloads.resize(chunking.count());
  for (size_t c = 0; c < chunking.count(); ++c) {
    auto& p = step.payloads[c];
    p.resize(codec.maxPayloadBytes(chunking.size(c)));
    auto size = codec.encodeChunk(ctx, chunking, c, 0, {}, input, state, step.workspace, p);
    if (!size) return size.status();
    p.resize(*size);
  }
  return step;
}

/// The step succeeded: commitState() with its own payloads as `sent`. `ctx`, `chunking` and
/// `input` (unchanged since) as given to openStep(); `selected`: empty, or the global selection
/// of every chunk (ctx.defer_sent).
inline Status commitStep(const Codec& codec, const StepContext& ctx, const Chunking& chunking,
                         ConstTensor input, OpenStep& step, CodecState& state,
                         std::span<const std::span<const uint8_t>> selected = {}) {
  return codec.commitState(ctx, chunking, input, spans(step.payloads), selected, state,
                           step.workspace);
}

inline bool bitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// The configurations every generic single-round test runs (one per codec family and option);
/// powersgd (two rounds) has its own tests through tests/kernels/multirank.h.
inline std::vector<CodecConfig> representativeConfigs() {
  std::vector<CodecConfig> v;
  auto add = [&](CodecConfig c) { v.push_back(std::move(c)); };
  add({.name = "none"});
  add({.name = "none", .error_feedback = true});
  add({.name = "fp16"});
  add({.name = "fp16", .error_feedback = true});
  add({.name = "bf16"});
  add({.name = "topk", .density = 0.01});
  add({.name = "topk", .ratio = 300.0, .sparse_values = DType::kF16});
  add({.name = "topk", .density = 0.05, .error_feedback = false});
  add({.name = "dgc", .density = 0.01});
  add({.name = "dgc", .density = 0.001, .momentum = 0.9, .clip_norm = 50.0});
  add({.name = "dgc", .density = 0.02, .sparse_values = DType::kF16});
  add({.name = "qsgd", .bits = 8});
  add({.name = "qsgd", .bits = 4, .bucket_size = 100});
  add({.name = "qsgd", .bits = 2, .bucket_size = 64, .error_feedback = true});
  add({.name = "randomk", .density = 0.05});
  add({.name = "randomk", .ratio = 50.0, .sparse_values = DType::kF16});
  add({.name = "threshold", .threshold = 1.5});
  add({.name = "threshold",
       .sparse_values = DType::kF16,
       .threshold = 1.0,
       .error_feedback = false});
  add({.name = "terngrad"});
  add({.name = "terngrad", .bucket_size = 100, .error_feedback = true});
  add({.name = "signsgd"});
  add({.name = "signsgd", .bucket_size = 64, .error_feedback = false});
  add({.name = "onebit"});
  add({.name = "onebit", .bucket_size = 1000});
  return v;
}

inline std::string describe(const CodecConfig& c) {
  std::string s = c.name;
  if (c.density) s += " density=" + std::to_string(*c.density);
  if (c.ratio) s += " ratio=" + std::to_string(*c.ratio);
  if (c.name == "qsgd") s += " bits=" + std::to_string(c.bits);
  if (c.name == "qsgd" || c.name == "terngrad" || c.name == "signsgd" || c.name == "onebit") {
    s += " bucket=" + std::to_string(c.bucket_size);
  }
  if (c.threshold) s += " threshold=" + std::to_string(*c.threshold);
  if (c.momentum != 0) s += " momentum=" + std::to_string(c.momentum);
  if (c.error_feedback) s += *c.error_feedback ? " ef=on" : " ef=off";
  if (c.sparse_values == DType::kF16) s += " values=fp16";
  return s;
}

}  // namespace lightwire::kernels::testing
