#pragma once
// The `powersgd` matrix view and factor payload layout (docs/determinism.md §4.12,
// docs/wire-format.md "powersgd"), and their one host-side validation, shared by the CPU codec
// (kernels/codecs/powersgd.cc) and the CUDA codec (kernels/cuda/codecs/powersgd.cu).

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "kernels/codec.h"
#include "kernels/payload.h"
#include "kernels/status.h"

namespace lightwire::kernels::powersgd {

inline constexpr int kMaxRank = 1024;
inline constexpr size_t kBodyHeaderBytes = 16;  // rows, cols, rank, reserved (u32 each)
inline constexpr size_t kFactorOffset = kHeaderBytes + kBodyHeaderBytes;
inline constexpr size_t kMetaFloats = 8;  // state: valid, rows, cols, rank

/// The matrix view of §4.12: rows × cols, row-major, zero-padded past n; r factor columns.
struct View {
  uint64_t rows = 0, cols = 0, rank = 0;
  bool operator==(const View&) const = default;
};

/// ⌈√n⌉, exact.
uint64_t isqrtCeil(uint64_t n);

/// "rows x cols rank r", for messages.
std::string describe(const View& v);

/// The rank the codec uses for a rows × cols view: min(approx_rank, rows, cols).
uint64_t rankFor(int approx_rank, uint64_t rows, uint64_t cols);

/// Room for one factor (rows·r or cols·r values) of any view of n elements.
size_t capFactor(size_t n, int approx_rank);
/// The codec state of n elements with `shape` (docs/determinism.md "4.12 `powersgd`"): the error
/// (n), the meta block and the warm-start Q of the shape's matrix view (cols · rank), 0 when n is
/// 0. A shape that does not hold n elements is sized as no shape (the step then fails on it).
size_t stateFloats(size_t n, std::span<const uint64_t> shape, int approx_rank);
/// Whether a state of `floats` values is one of n elements for some shape (stateFloats() of the
/// flat view or of a rows x cols view with cols dividing n): what a caller without the shape can
/// check.
bool stateHolds(size_t floats, size_t n, int approx_rank);

/// The matrix view of n elements for a tensor of `shape` (none: the squarest view).
Result<View> viewFor(std::span<const uint64_t> shape, size_t n, int approx_rank);

/// The view of a step: invalidArgument unless the chunking has one chunk (the whole matrix is one
/// payload), then viewFor(ctx.shape, chunking.elements).
Result<View> stepView(const StepContext& ctx, const Chunking& chunking, int approx_rank);

/// The kMetaFloats floats of the state's meta block recording `v`.
void writeMeta(float* meta, const View& v, float valid);

/// The kFactorOffset header bytes of a factor payload of `round`.
void writeFactorHeaders(uint8_t* out, DType dtype, int round, size_t n, const View& v);

/// A parsed factor payload (header and body header validated, length exact).
struct Factors {
  PayloadHeader header;
  View view;
  const uint8_t* values = nullptr;  // rows·r (round 0) or cols·r (round 1) fp32
  size_t count = 0;
};

/// Validates a factor payload for n elements; round < 0 accepts either round. `what` starts the
/// messages.
Result<Factors> parseFactors(std::span<const uint8_t> payload, uint64_t n, int round,
                             const std::string& what, int approx_rank);

/// Validates the two reduced payloads of a step for n elements (the same view in both).
Result<std::pair<Factors, Factors>> parseRounds(std::span<const std::span<const uint8_t>> rounds,
                                                size_t n, int approx_rank);

/// What finishStep() was given, against what the codec needs.
struct FinishArgs {
  size_t input_elements = 0;
  size_t state_floats = 0, state_needed = 0;
  size_t workspace_bytes = 0, workspace_needed = 0;
  bool workspace_null = false;  // no workspace memory (refused when workspace_needed > 0)
};

/// Every check finishStep() makes before it touches the state, in order: one chunk, the input,
/// state and workspace sizes, the matrix view, the two reduced payloads and that they are for
/// that view. Returns the reduced payloads (P, then Q).
Result<std::pair<Factors, Factors>> parseFinishStep(
    const StepContext& ctx, const Chunking& chunking,
    std::span<const std::span<const uint8_t>> rounds, const FinishArgs& args, int approx_rank);

}  // namespace lightwire::kernels::powersgd
