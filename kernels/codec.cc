#include "kernels/codec.h"

#include <algorithm>

namespace lightwire::kernels {

Chunking Chunking::make(size_t n, size_t requested, size_t alignment) {
  alignment = std::max<size_t>(alignment, 1);
  size_t c = requested == 0 ? std::max<size_t>(n, 1) : requested;
  c = (c + alignment - 1) / alignment * alignment;
  return Chunking{n, c};
}

void CodecState::reset() {
  std::fill(current_.begin(), current_.end(), 0.0f);
  std::fill(next_.begin(), next_.end(), 0.0f);
}

Result<size_t> Codec::addPayloads(std::span<const uint8_t>, std::span<const uint8_t>,
                                  std::span<uint8_t>) const {
  return failedPrecondition(std::string("codec '") + traits().name + "' is not summable");
}

size_t WorkspaceCarver::bytesFor(std::initializer_list<size_t> sizes) {
  size_t total = 0;
  for (size_t s : sizes) total += (s + 63) & ~size_t{63};
  return total;
}

Result<std::vector<std::vector<uint8_t>>> encodeTensor(const Codec& codec, const StepContext& ctx,
                                                       const Chunking& chunking, ConstTensor input,
                                                       CodecState& state) {
  if (input.elements != chunking.elements) {
    return invalidArgument("input has " + std::to_string(input.elements) +
                           " elements, chunking expects " + std::to_string(chunking.elements));
  }
  if (state.floats() != codec.stateFloats(chunking.elements)) {
    return invalidArgument("codec state holds " + std::to_string(state.floats()) +
                           " floats, the codec needs " +
                           std::to_string(codec.stateFloats(chunking.elements)));
  }
  std::vector<std::byte> ws(codec.workspaceBytes(chunking));
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
