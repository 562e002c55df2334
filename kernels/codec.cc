#include "kernels/codec.h"

#include <algorithm>

#include "kernels/parallel.h"
#include "kernels/tensor_args.h"

namespace lightwire::kernels {

Chunking Chunking::make(size_t n, size_t requested, size_t alignment) {
  alignment = std::max<size_t>(alignment, 1);
  size_t c = requested == 0 ? std::max<size_t>(n, 1) : requested;
  c = (c + alignment - 1) / alignment * alignment;
  return Chunking{n, c};
}

void CodecState::reset() { StateBuffer(state_.size()).swap(state_); }

void CodecState::resize(size_t floats, size_t keep) {
  StateBuffer next(floats);
  std::copy_n(state_.data(), std::min({keep, floats, state_.size()}), next.data());
  next.swap(state_);
}

Status CodecState::restore(std::span<const float> current) {
  if (current.size() != state_.size()) {
    return invalidArgument("codec state holds " + std::to_string(state_.size()) +
                           " floats, the state to restore " + std::to_string(current.size()));
  }
  std::copy(current.begin(), current.end(), state_.begin());
  return Status::ok();
}

float* CodecState::work(size_t floats) {
  if (floats == 0) return nullptr;
  if (lent_.size() >= floats) return lent_.data();
  if (owned_work_.size() < floats) owned_work_.resize(floats);
  return owned_work_.data();
}

Status checkTensorValues(const std::string& name, const Chunking& chunking, size_t elements,
                         DType dtype, const void* data, size_t chunk_alignment, size_t state_floats,
                         size_t need_floats) {
  const size_t n = chunking.elements;
  if (elements != n) {
    return invalidArgument(name + ": input has " + std::to_string(elements) +
                           " elements, the chunking " + std::to_string(n));
  }
  if (dtype > DType::kBF16) return invalidArgument(name + ": input dtype is unknown");
  if (n > 0 && data == nullptr) return invalidArgument(name + ": input data is null");
  if (chunking.chunk_elements == 0) return invalidArgument(name + ": chunk_elements is 0");
  if (chunking.count() > 1 && chunking.chunk_elements % chunk_alignment != 0) {
    return invalidArgument(name + ": chunk size " + std::to_string(chunking.chunk_elements) +
                           " is not a multiple of " + std::to_string(chunk_alignment));
  }
  if (state_floats != need_floats) {
    return invalidArgument(name + ": codec state holds " + std::to_string(state_floats) +
                           " floats, the codec needs " + std::to_string(need_floats));
  }
  return Status::ok();
}

Status checkChunkAndRound(const std::string& name, const Chunking& chunking, size_t chunk,
                          int round, int rounds) {
  if (chunk >= chunking.count()) {
    return outOfRange(name + ": chunk " + std::to_string(chunk) + " of " +
                      std::to_string(chunking.count()));
  }
  if (round < 0 || round >= rounds) {
    return invalidArgument(name + " has " + std::to_string(rounds) + " round(s), got round " +
                           std::to_string(round));
  }
  return Status::ok();
}

Status Codec::checkTensorArgs(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                              const CodecState& state) const {
  return checkTensorValues(traits().name, chunking, input.elements, input.dtype, input.data,
                           chunkAlignment(), state.floats(),
                           stateFloats(chunking.elements, ctx.shape));
}

Status Codec::checkStepArgs(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                            const CodecState& state, std::span<std::byte> workspace) const {
  LW_RETURN_IF_ERROR(checkTensorArgs(ctx, chunking, input, state));
  const std::string name = traits().name;
  if (workspace.size() < workspaceBytes(chunking)) {
    return invalidArgument(name + ": workspace of " + std::to_string(workspace.size()) +
                           " bytes, the codec needs " + std::to_string(workspaceBytes(chunking)));
  }
  return Status::ok();
}

Status Codec::analyze(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                      CodecState& state, std::span<std::byte> workspace) const {
  LW_RETURN_IF_ERROR(checkStepArgs(ctx, chunking, input, state, workspace));
  return doAnalyze(ctx, chunking, input, state, workspace);
}

Result<size_t> Codec::encodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                                  int round, std::span<const uint8_t> previous, ConstTensor input,
                                  CodecState& state, std::span<std::byte> workspace,
                                  std::span<uint8_t> out) const {
  LW_RETURN_IF_ERROR(checkStepArgs(ctx, chunking, input, state, workspace));
  const std::string name = traits().name;
  LW_RETURN_IF_ERROR(checkChunkAndRound(name, chunking, chunk, round, traits().rounds));
  if (out.size() < maxPayloadBytes(chunking.size(chunk))) {
    return outOfRange(name + ": payload buffer of " + std::to_string(out.size()) +
                      " bytes, a chunk may need " +
                      std::to_string(maxPayloadBytes(chunking.size(chunk))));
  }
  return doEncodeChunk(ctx, chunking, chunk, round, previous, input, state, workspace, out);
}

Status Codec::flush(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                    CodecState& state, float* out) const {
  LW_RETURN_IF_ERROR(checkTensorArgs(ctx, chunking, input, state));
  if (chunking.elements > 0 && out == nullptr) {
    return invalidArgument(std::string(traits().name) + ": flush output is null");
  }
  return doFlush(ctx, chunking, input, state, out);
}

Status Codec::doFlush(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                      CodecState& /*state*/, float* out) const {
  parallelFor(ctx.stream, chunking.elements, size_t{1} << 16,
              [&](size_t lo, size_t hi) { widenToFloat(input.slice(lo, hi - lo), out + lo); });
  return Status::ok();
}

Status Codec::commitState(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                          std::span<const std::span<const uint8_t>> sent,
                          std::span<const std::span<const uint8_t>> selected, CodecState& state,
                          std::span<std::byte> workspace, WriteBack write_back) const {
  LW_RETURN_IF_ERROR(checkStepArgs(ctx, chunking, input, state, workspace));
  const std::string name = traits().name;
  const size_t chunks = chunking.count();
  if (sent.size() != chunks) {
    return invalidArgument(name + ": commit with " + std::to_string(sent.size()) +
                           " sent payloads for " + std::to_string(chunks) + " chunks");
  }
  if (!selected.empty() && selected.size() != chunks) {
    return invalidArgument(name + ": commit with " + std::to_string(selected.size()) +
                           " selections for " + std::to_string(chunks) + " chunks");
  }
  if (write_back &&
      (stateFloats(chunking.elements, ctx.shape) == 0 || write_back.from == nullptr)) {
    return invalidArgument(name +
                           ": a write-back in the commit needs a codec with state and a "
                           "source");
  }
  return doCommitState(ctx, chunking, input, sent, selected, state, workspace, write_back);
}

double Codec::residualNorm2(const CodecState&, size_t) const { return 0.0; }

Result<size_t> Codec::addPayloads(std::span<const uint8_t>, std::span<const uint8_t>,
                                  std::span<uint8_t>) const {
  return failedPrecondition(std::string("codec '") + traits().name + "' is not summable");
}

Status Codec::decodeChunkInto(std::span<const uint8_t> payload, float weight, float* out,
                              size_t out_elements) const {
  std::fill_n(out, out_elements, 0.0f);
  return decodeChunk(payload, weight, out, out_elements);
}

Status Codec::decodeRounds(std::span<const std::span<const uint8_t>> reduced_rounds, float weight,
                           float* out, size_t out_elements) const {
  if (reduced_rounds.size() != 1) {
    return invalidArgument(std::string(traits().name) + " has " + std::to_string(traits().rounds) +
                           " round(s), got " + std::to_string(reduced_rounds.size()) +
                           " reduced payloads");
  }
  return decodeChunk(reduced_rounds[0], weight, out, out_elements);
}

Status Codec::finishStep(const StepContext&, const Chunking&,
                         std::span<const std::span<const uint8_t>>, float, ConstTensor, CodecState&,
                         std::span<std::byte>) const {
  return Status::ok();
}

size_t WorkspaceCarver::bytesFor(std::initializer_list<size_t> sizes) {
  size_t total = 0;
  for (size_t s : sizes) total += (s + 63) & ~size_t{63};
  return total;
}

Chunking chunkingFor(const Codec& codec, size_t n, size_t requested) {
  if (codec.traits().single_chunk) return Chunking::make(n, 0, 1);
  return Chunking::make(n, requested, codec.chunkAlignment());
}

void addWidened(CpuStream* stream, ConstTensor x, const float* e, float* out, size_t n,
                WriteBack write_back) {
  visitDType(x.dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    parallelFor(stream, n, size_t{1} << 16, [&](size_t lo, size_t hi) {
      if (!write_back) {
        for (size_t i = lo; i < hi; ++i) out[i] = loadWidened<D>(x.data, i) + e[i];  // vectorised
        return;
      }
      for (size_t i = lo; i < hi; ++i) {
        const float xi = loadWidened<D>(x.data, i);
        out[i] = xi + e[i];
        write_back.to[i] = write_back.from[i];
      }
    });
  });
}

namespace {

/// analyze() and encodeChunk() of every chunk (round 0) with the workspace `ws`.
Result<std::vector<std::vector<uint8_t>>> encodeAll(const Codec& codec, const StepContext& ctx,
                                                    const Chunking& chunking, ConstTensor input,
                                                    CodecState& state, std::vector<std::byte>& ws) {
  ws.resize(codec.workspaceBytes(chunking));
  LW_RETURN_IF_ERROR(codec.analyze(ctx, chunking, input, state, ws));
  std::vector<std::vector<uint8_t>> payloads(chunking.count());
  for (size_t c = 0; c < chunking.count(); ++c) {
    payloads[c].resize(codec.maxPayloadBytes(chunking.size(c)));
    auto size = codec.encodeChunk(ctx, chunking, c, 0, {}, input, state, ws, payloads[c]);
    if (!size) return size.status();
    payloads[c].resize(*size);
  }
  return payloads;
}

}  // namespace

Result<std::vector<std::vector<uint8_t>>> encodeTensor(const Codec& codec, const StepContext& ctx,
                                                       const Chunking& chunking, ConstTensor input,
                                                       CodecState& state) {
  std::vector<std::byte> ws;
  return encodeAll(codec, ctx, chunking, input, state, ws);
}

Result<std::vector<std::vector<uint8_t>>> stepTensor(const Codec& codec, const StepContext& ctx,
                                                     const Chunking& chunking, ConstTensor input,
                                                     CodecState& state) {
  std::vector<std::byte> ws;
  auto payloads = encodeAll(codec, ctx, chunking, input, state, ws);
  if (!payloads) return payloads;
  const std::vector<std::span<const uint8_t>> sent(payloads->begin(), payloads->end());
  LW_RETURN_IF_ERROR(codec.commitState(ctx, chunking, input, sent, {}, state, ws, {}));
  return payloads;
}

Status decodeTensor(const Codec& codec, const Chunking& chunking,
                    const std::vector<std::vector<uint8_t>>& payloads, float weight, float* out) {
  if (payloads.size() != chunking.count()) {
    return invalidArgument("got " + std::to_string(payloads.size()) + " payloads for " +
                           std::to_string(chunking.count()) + " chunks");
  }
  for (size_t c = 0; c < payloads.size(); ++c) {
    Status s = codec.decodeChunk(payloads[c], weight, out + chunking.begin(c), chunking.size(c));
    if (!s.isOk()) return {s.code(), "chunk " + std::to_string(c) + ": " + s.message()};
  }
  return Status::ok();
}

}  // namespace lightwire::kernels
