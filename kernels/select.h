#pragma once
// What the sparse codecs (topk, dgc; later threshold) share (docs/determinism.md §4.2–4.4,
// docs/wire-format.md "Sparse layout"): magnitude keys, the selection size k, exact top-k over the
// whole tensor, the sparse payload writer and the validating sparse decoder.
//
// A selection is decided once per step over the whole tensor (analyze) and stored as a
// SelectionPlan: "key > threshold, or key == threshold and whole-tensor index < tie_end". That
// plan is all a chunk needs, so encoding chunk c reads only chunk c, and the decoded result never
// depends on the chunking or the thread count.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "kernels/codec.h"
#include "kernels/dtype.h"
#include "kernels/payload.h"
#include "kernels/status.h"

namespace lightwire::kernels {

/// key(x): the fp32 bits with the sign cleared; orders by magnitude, NaN above +Inf.
inline uint32_t magnitudeKey(float x) { return floatBits(x) & 0x7FFFFFFFu; }

/// Element i of raw tensor data of dtype D, widened to fp32 (exact).
template <DType D>
inline float loadWidened(const void* data, size_t i) {
  if constexpr (D == DType::kF32) {
    return static_cast<const float*>(data)[i];
  } else if constexpr (D == DType::kF16) {
    return halfToFloat(static_cast<const uint16_t*>(data)[i]);
  } else {
    return bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
  }
}

/// Calls fn(std::integral_constant<DType, t>{}): the one dtype switch in front of a typed loop.
template <typename Fn>
decltype(auto) visitDType(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF16:
      return fn(std::integral_constant<DType, DType::kF16>{});
    case DType::kBF16:
      return fn(std::integral_constant<DType, DType::kBF16>{});
    case DType::kF32:
      break;
  }
  return fn(std::integral_constant<DType, DType::kF32>{});
}

/// A parameter value for an error message, exactly (%.17g).
std::string formatNumber(double v);

/// dgc's density when none is configured: the DGC paper's 99.9 % sparsity (warm-up schedules in
/// policies/ start gentler). topk has no default: its users choose.
inline constexpr double kDgcDefaultDensity = 0.001;

/// k for n elements at density d (§4.2): 0 if n = 0, else min(n, max(1, floor(d·n + 0.5))).
size_t selectionSize(size_t n, double density);

/// Checks that a density is a number in (0, 1]; `what` names its origin in the message.
Status checkDensity(double density, std::string_view what);

/// The density a sparse codec is configured with: exactly one of config.density (in (0, 1]) and
/// config.ratio (>= 1, density = 1 / ratio in fp64), or `fallback` when neither is set and the
/// codec has a default. `codec` names the codec in messages.
Result<double> configuredDensity(const CodecConfig& config, std::string_view codec,
                                 std::optional<double> fallback = std::nullopt);

/// Checks config.sparse_values (fp32 or fp16).
Status checkSparseValues(const CodecConfig& config, std::string_view codec);

/// The selected set of one step: elements with key > threshold, plus those with key == threshold
/// whose whole-tensor index is < tie_end. Plain data, kept in the workspace between analyze and
/// encodeChunk (read-only there, so chunks may be encoded concurrently).
struct SelectionPlan {
  uint32_t threshold = 0;
  uint64_t tie_end = 0;
  bool select_none = true;  // n = 0: nothing is selected
};

/// Contiguous work split of n elements that depends on n only (never on the thread count), so
/// per-task integer results combine the same way everywhere.
struct TaskSplit {
  static constexpr size_t kMaxTasks = 64;
  static constexpr size_t kMinTaskElements = size_t{1} << 16;
  size_t elements = 0;
  size_t tasks = 1;

  static TaskSplit of(size_t n);
  size_t begin(size_t t) const { return elements / tasks * t + std::min(t, elements % tasks); }
  size_t end(size_t t) const { return begin(t + 1); }
};

/// Runs fn(t) for every task t of `split` on `stream` (null = the calling thread).
void runTasks(CpuStream* stream, const TaskSplit& split, const std::function<void(size_t)>& fn);

/// Views of a sparse codec's workspace for a tensor of n elements: the plan, per-task key
/// histograms, guiding sample keys, and n u32 slots that hold candidate keys during analyze and
/// chunk-local indices during encodeChunk (chunk c uses slots [begin(c), begin(c) + size(c)), so
/// concurrent chunks never overlap). Owns nothing.
struct SelectWorkspace {
  static constexpr size_t kBuckets = 2048;  // histogram of key >> 20
  static constexpr size_t kGuideSamples = 16384;
  static constexpr size_t kGuideMinElements = size_t{1} << 18;
  SelectionPlan* plan = nullptr;
  std::span<uint64_t> histograms;  // tasks × kBuckets
  std::span<uint32_t> samples;     // sampleCount(n): keys that guide the exact selection
  std::span<uint32_t> slots;       // n

  /// Guiding sample size for n elements (0 for small tensors: the histogram path is cheap).
  static size_t sampleCount(size_t n);

  /// Bytes carve() takes for n elements.
  static size_t bytes(size_t n);
  /// Carves the slices for n elements; the carver must have bytes(n) left.
  static SelectWorkspace carve(WorkspaceCarver& carver, size_t n);
};

/// Exact top-k of `x` (§4.3): the k largest keys, ties broken by lower index. Writes the plan to
/// *plan; the result is independent of the thread count. Usually one pass over x (bracketed by a
/// strided sample), two when the sample misses (a histogram of key >> 20), plus one when ties
/// with the threshold must be cut.
void selectExact(ConstTensor x, size_t k, CpuStream* stream, const SelectWorkspace& ws,
                 SelectionPlan* plan);

/// #{i : key(x_i) >= threshold} over fp32 x[0..n), in fixed tasks (thread-count independent).
uint64_t countKeysAtLeast(const float* x, size_t n, uint32_t threshold, CpuStream* stream);

/// Upper bound of a sparse payload for a chunk of n elements with values of type `values`.
size_t sparseMaxPayloadBytes(size_t n, DType values);

/// What writeSparsePayload produced.
struct SparseWritten {
  size_t bytes = 0;  // payload size
  size_t nnz = 0;    // selected elements; their chunk-local indices are in indices[0..nnz)
};

/// Writes the sparse payload (codec id `codec`, header dtype `source`) of the chunk
/// x[begin, begin + len) of the whole tensor `x` under `plan`, with fp32 or fp16 `values`.
/// `indices` (len u32) is scratch that keeps the selected chunk-local indices afterwards.
/// `out` must hold sparseMaxPayloadBytes(len, values).
Result<SparseWritten> writeSparsePayload(CodecId codec, DType source, DType values,
                                         const SelectionPlan& plan, ConstTensor x, size_t begin,
                                         size_t len, std::span<uint32_t> indices, CpuStream* stream,
                                         std::span<uint8_t> out);

/// Validates a sparse payload of codec `codec` (or the `none` escape) completely, then adds
/// weight · value_j to out[i_j]. On error `out` is untouched.
Status decodeSparsePayload(std::span<const uint8_t> payload, CodecId codec, float weight,
                           float* out, size_t out_elements);

}  // namespace lightwire::kernels
