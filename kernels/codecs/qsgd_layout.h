#pragma once
// The `qsgd` payload layout (docs/wire-format.md "qsgd"): its byte sizes and the one host-side
// validation of a payload, shared by the CPU decoder (kernels/codecs/qsgd.cc) and the CUDA codec
// (kernels/cuda/codecs/qsgd.cu).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "kernels/payload.h"
#include "kernels/status.h"

namespace lightwire::kernels {

inline constexpr size_t kQsgdHeaderBytes = kHeaderBytes + 8;  // + b, 3 reserved bytes, d

/// Byte sizes of a qsgd payload. Plain value.
struct QsgdLayout {
  uint64_t buckets = 0;
  uint64_t code_bytes = 0;
  uint64_t total = 0;
};

/// The layout of n elements in buckets of d with b bits; nullopt when d = 0 or the sizes would
/// not fit in 64 bits (hostile element counts).
std::optional<QsgdLayout> qsgdLayout(uint64_t n, uint64_t d, unsigned b);

/// A validated qsgd payload. When header.codec is kNone (the dense escape) only `header` is set
/// and the caller checks the dense body; otherwise every field is, and the payload's length, b,
/// d, reserved bytes, norms (finite, >= 0) and code padding are valid.
struct QsgdPayload {
  PayloadHeader header;
  unsigned bits = 0;
  uint32_t d = 0;
  QsgdLayout layout;
  const uint8_t* norms = nullptr;  // layout.buckets fp32 norms
  const uint8_t* codes = nullptr;  // layout.code_bytes bytes of codes
};

/// Every check of a qsgd payload for out_elements elements, in the decoder's order; dataLoss (or
/// readHeader's error) when one fails.
Result<QsgdPayload> parseQsgdPayload(std::span<const uint8_t> payload, uint64_t out_elements);

}  // namespace lightwire::kernels
