#pragma once
// Simulates W ranks exchanging one step of a (possibly multi-round) codec in one process: every
// rank analyzes its input, then for each round r every rank encodes round r with the reduced
// payload of round r−1 as `previous`, and the W payloads are summed with addPayloads in rank order
// ((p0 + p1) + p2 ...), which is what an allreduce in rank order gives. Every rank then decodes
// the reduced payloads (decodeRounds) and keeps in its workspace what its commit needs
// (finishStep). Commit (commitMultiRank) is left to the caller. Single-chunk codecs only
// (multi-round codecs are single_chunk).
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "kernels/codec.h"

namespace lightwire::kernels::testing {

struct MultiRankStep {
  std::vector<std::vector<uint8_t>> reduced;            // one reduced payload per round
  std::vector<std::vector<std::vector<uint8_t>>> sent;  // sent[round][rank]
  std::vector<std::vector<float>> decoded;              // per rank: 0 + weight · decoded
  std::vector<std::vector<std::byte>> workspaces;       // per rank, as finishStep() left it
};

/// Runs one step for inputs.size() ranks (any dtype, equal sizes); states[rank] is each rank's
/// codec state (read, not committed: commitMultiRank). ctx.rank is set to the rank; ctx.stream as
/// given.
inline Result<MultiRankStep> runMultiRank(const Codec& codec, StepContext ctx,
                                          const std::vector<ConstTensor>& inputs,
                                          std::vector<CodecState>& states, float weight) {
  const size_t world = inputs.size();
  if (world == 0 || states.size() != world) return invalidArgument("runMultiRank: bad world");
  const size_t n = inputs[0].elements;
  const Chunking chunking = chunkingFor(codec, n, 0);
  if (chunking.count() != 1) return invalidArgument("runMultiRank: single-chunk codecs only");
  std::vector<std::vector<std::byte>> ws(world);
  auto input = [&](size_t rank) { return inputs[rank]; };
  auto rankCtx = [&](size_t rank) {
    StepContext c = ctx;
    c.rank = static_cast<uint32_t>(rank);
    return c;
  };
  for (size_t rank = 0; rank < world; ++rank) {
    if (inputs[rank].elements != n) return invalidArgument("runMultiRank: input sizes differ");
    ws[rank].resize(codec.workspaceBytes(chunking));
    LW_RETURN_IF_ERROR(codec.analyze(rankCtx(rank), chunking, input(rank), states[rank], ws[rank]));
  }
  MultiRankStep step;
  const int rounds = codec.traits().rounds;
  for (int round = 0; round < rounds; ++round) {
    std::vector<std::vector<uint8_t>> sent(world);
    const std::span<const uint8_t> previous =
        round == 0 ? std::span<const uint8_t>{} : std::span<const uint8_t>(step.reduced.back());
    for (size_t rank = 0; rank < world; ++rank) {
      sent[rank].resize(codec.maxPayloadBytes(n));
      auto size = codec.encodeChunk(rankCtx(rank), chunking, 0, round, previous, input(rank),
                                    states[rank], ws[rank], sent[rank]);
      if (!size) return size.status();
      sent[rank].resize(*size);
    }
    std::vector<uint8_t> sum = sent[0];
    for (size_t rank = 1; rank < world; ++rank) {
      std::vector<uint8_t> next(std::max(sum.size(), sent[rank].size()));
      auto size = codec.addPayloads(sum, sent[rank], next);
      if (!size) return size.status();
      next.resize(*size);
      sum = std::move(next);
    }
    step.reduced.push_back(std::move(sum));
    step.sent.push_back(std::move(sent));
  }
  std::vector<std::span<const uint8_t>> views(step.reduced.begin(), step.reduced.end());
  for (size_t rank = 0; rank < world; ++rank) {
    std::vector<float> out(n, 0.0f);
    LW_RETURN_IF_ERROR(codec.decodeRounds(views, weight, out.data(), n));
    step.decoded.push_back(std::move(out));
    LW_RETURN_IF_ERROR(codec.finishStep(rankCtx(rank), chunking, views, weight, input(rank),
                                        states[rank], ws[rank]));
  }
  step.workspaces = std::move(ws);
  return step;
}

/// The step succeeded on every rank: commits each rank's state (commitState() after the
/// finishStep() of runMultiRank; `sent`: the rank's round-0 payload, which multi-round codecs do
/// not read). `ctx`, `inputs` (unchanged since) and `states` as given to runMultiRank, `step` what
/// it returned.
inline Status commitMultiRank(const Codec& codec, StepContext ctx,
                              const std::vector<ConstTensor>& inputs,
                              std::vector<CodecState>& states, MultiRankStep& step) {
  const size_t world = inputs.size();
  if (world == 0 || states.size() != world || step.workspaces.size() != world ||
      step.sent.empty() || step.sent[0].size() != world) {
    return invalidArgument("commitMultiRank: not the step of these ranks");
  }
  const Chunking chunking = chunkingFor(codec, inputs[0].elements, 0);
  for (size_t rank = 0; rank < world; ++rank) {
    StepContext c = ctx;
    c.rank = static_cast<uint32_t>(rank);
    const std::vector<std::span<const uint8_t>> sent{step.sent[0][rank]};
    LW_RETURN_IF_ERROR(codec.commitState(c, chunking, inputs[rank], sent, {}, states[rank],
                                         step.workspaces[rank]));
  }
  return Status::ok();
}

/// fp32 inputs, one vector per rank.
inline Result<MultiRankStep> runMultiRank(const Codec& codec, StepContext ctx,
                                          const std::vector<std::vector<float>>& inputs,
                                          std::vector<CodecState>& states, float weight) {
  std::vector<ConstTensor> tensors;
  for (const auto& x : inputs) tensors.push_back(ConstTensor{x.data(), x.size(), DType::kF32});
  return runMultiRank(codec, ctx, tensors, states, weight);
}

/// fp32 inputs, one vector per rank.
inline Status commitMultiRank(const Codec& codec, StepContext ctx,
                              const std::vector<std::vector<float>>& inputs,
                              std::vector<CodecState>& states, MultiRankStep& step) {
  std::vector<ConstTensor> tensors;
  for (const auto& x : inputs) tensors.push_back(ConstTensor{x.data(), x.size(), DType::kF32});
  return commitMultiRank(codec, ctx, tensors, states, step);
}

}  // namespace lightwire::kernels::testing
