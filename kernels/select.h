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
#include <vector>

#include "kernels/codec.h"
#include "kernels/dtype.h"
#include "kernels/payload.h"
#include "kernels/status.h"

namespace lightwire::kernels {

/// key(x): the fp32 bits with the sign cleared; orders by magnitude, NaN above +Inf.
inline uint32_t magnitudeKey(float x) { return floatBits(x) & 0x7FFFFFFFu; }

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
  /// When set, the selected set is also listed: its whole-tensor indices, ascending, in
  /// SelectWorkspace::slots[0, listed). Encoding then reads the list instead of scanning the
  /// tensor (and uses no slots of its own). Only for n < 2^32.
  bool has_list = false;
  uint64_t listed = 0;
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
/// histograms, guiding sample keys, and n u32 slots that hold candidates (keys, or u64 composite
/// keys) during analyze, then either the plan's list of selected indices (SelectionPlan::has_list)
/// or chunk-local indices during encodeChunk (chunk c uses slots [begin(c), begin(c) + size(c)),
/// so concurrent chunks never overlap). Owns nothing.
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

/// The smallest key an element must have to be sent under CodecConfig::min_magnitude m: the key of
/// the smallest fp32 value >= m (m rounded up to fp32; +Inf beyond the fp32 range), or 0 when m is
/// not > 0 (off). For every fp32 x, NaN included: key(x) >= minMagnitudeKey(m) <=> !(|x| < m).
uint32_t minMagnitudeKey(double min_magnitude);

/// Removes from the selection of `plan` (over the tensor `x`) every element with key < min_key
/// (min_magnitude, docs/determinism.md §4.2): where the plan's threshold is below min_key it
/// becomes min_key with every tie taken, and a listed selection (has_list, in slots) is compacted
/// in place. A plain, scalar filter after the selection, so every SIMD path honours it alike.
void applyMinKey(ConstTensor x, uint32_t min_key, std::span<uint32_t> slots, SelectionPlan* plan);

/// Exact top-k of `x` (§4.3): the k largest keys, ties broken by lower index. Writes the plan to
/// *plan; the result is independent of the thread count. Usually one pass over x: a strided
/// sample gives a key bound a, the pass collects every element with key >= a as a u64 composite
/// key (key, then lower index first), and nth_element over those decides the threshold and the
/// tie cut at once and lists the selection (has_list: encoding needs no scan). When that does not
/// apply or the sample misses: a bracketed pass, then a histogram of key >> 20 (two passes), plus
/// one when ties with the threshold must be cut.
void selectExact(ConstTensor x, size_t k, CpuStream* stream, const SelectWorkspace& ws,
                 SelectionPlan* plan);

/// #{i : key(x_i) >= threshold} over fp32 x[0..n), in fixed tasks (thread-count independent).
uint64_t countKeysAtLeast(const float* x, size_t n, uint32_t threshold, CpuStream* stream);

// --- SIMD kernels (kernels/select_simd.cc, Highway with run-time dispatch) ---

/// Composite selection key of element i: (key << 32) | (2^32 − 1 − i). Distinct for distinct i
/// (i < 2^32), and ordered as §4.3 orders elements: larger key first, then lower index.
inline uint64_t compositeKey(uint32_t key, size_t i) {
  return (uint64_t{key} << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

/// Writes compositeKey(key(x_i), i) for every i in [lo, hi) with key(x_i) >= a, in index order,
/// to dst (the first `cap` of them); returns how many there are (possibly more than cap).
uint64_t collectCompositesF32(const float* x, size_t lo, size_t hi, uint32_t a, uint64_t* dst,
                              uint64_t cap);

/// One fused pass of dgc's steps 1–3 (docs/determinism.md §4.4) over fp32 input.
struct DgcPass {
  const float* x = nullptr;  // input
  const float* u = nullptr;  // momentum (read only when `momentum`)
  const float* v = nullptr;  // accumulated residual
  float* un = nullptr;       // u' (written only with `momentum` and when not null)
  float* vn = nullptr;       // v'
  bool clip = false;         // g = clip ? x · factor : x
  float factor = 1.0f;
  bool momentum = false;  // u' = m · u + g, v' = v + u'; else v' = v + g (no u')
  float m = 0.0f;
  /// Bias correction (with `momentum`): c' = (m · c) + 1, v' = v + (u' / (c' · w)).
  const float* c = nullptr;
  bool bias = false;
  float w = 1.0f;          // (float)(1 − m)
  uint32_t threshold = 0;  // list the elements with key(v') >= threshold
};

/// Steps 2–3 of docs/determinism.md §4.4 for element i of `p` from its clipped gradient g: the
/// scalar form of what dgcFusedPassF32 computes (u' and c' are 0 where they are not kept).
struct DgcNext {
  float u = 0.0f;  // u' (momentum)
  float c = 0.0f;  // c' (bias correction)
  float v = 0.0f;  // v'
};
inline DgcNext dgcNext(const DgcPass& p, size_t i, float g) {
  DgcNext r;
  if (!p.momentum) {
    r.v = p.v[i] + g;
    return r;
  }
  const float mu = p.m * p.u[i];
  r.u = mu + g;
  if (!p.bias) {
    r.v = p.v[i] + r.u;
    return r;
  }
  const float mc = p.m * p.c[i];
  r.c = mc + 1.0f;
  const float d = r.c * p.w;
  r.v = p.v[i] + (r.u / d);
  return r;
}

/// dgcNext of element i from its input value x (clipped here as `p` says), stored: v' to p.vn[i],
/// u' to p.un[i] with momentum, c' to cn[i] with bias correction — the commit's scalar form.
inline void dgcStoreNext(const DgcPass& p, float* cn, size_t i, float x) {
  const DgcNext next = dgcNext(p, i, p.clip ? x * p.factor : x);
  if (p.momentum) p.un[i] = next.u;
  if (p.bias) cn[i] = next.c;
  p.vn[i] = next.v;
}

/// Runs `p` over [lo, hi): writes v' (and u' with momentum, where un is not null) there, and the
/// indices i (ascending, as u32; needs hi <= 2^32) with key(v'_i) >= p.threshold to list[0, count);
/// list must hold hi − lo entries. Returns count.
uint64_t dgcFusedPassF32(const DgcPass& p, size_t lo, size_t hi, uint32_t* list);

/// The commit's form of the same pass: writes v' to p.vn and, with momentum, u' to p.un (not
/// null) and, with bias correction, c' to `cn` over [lo, hi), bit for bit dgcNext; lists nothing.
/// Each output may be its own input (p.vn == p.v, p.un == p.u, cn == p.c): the state updated in
/// place.
void dgcStatePassF32(const DgcPass& p, float* cn, size_t lo, size_t hi);

/// Upper bound of a sparse payload for a chunk of n elements with values of type `values`.
size_t sparseMaxPayloadBytes(size_t n, DType values);

/// What writeSparsePayload produced.
struct SparseWritten {
  size_t bytes = 0;  // payload size
  size_t nnz = 0;    // selected elements; their chunk-local indices are in indices[0..nnz)
  size_t first = 0;  // writeSparsePayloadFromList: the chunk's first entry in the list
};

/// Writes the sparse payload (codec id `codec`, header dtype `source`) of the chunk
/// x[begin, begin + len) of the whole tensor `x` under `plan`, with fp32 or fp16 `values`.
/// `indices` (len u32) is scratch that keeps the selected chunk-local indices afterwards.
/// `out` must hold sparseMaxPayloadBytes(len, values).
Result<SparseWritten> writeSparsePayload(CodecId codec, DType source, DType values,
                                         const SelectionPlan& plan, ConstTensor x, size_t begin,
                                         size_t len, std::span<uint32_t> indices, CpuStream* stream,
                                         std::span<uint8_t> out);

/// Writes the sparse payload of the chunk x[begin, begin + len) from `list`, the ascending
/// whole-tensor indices of every selected element of the tensor (a plan's list). The chunk's
/// entries are list[first, first + nnz) (SparseWritten::first). `stream` gathers the values.
Result<SparseWritten> writeSparsePayloadFromList(CodecId codec, DType source, DType values,
                                                 std::span<const uint32_t> list, ConstTensor x,
                                                 size_t begin, size_t len, CpuStream* stream,
                                                 std::span<uint8_t> out);

/// The checked layout of a sparse payload (docs/wire-format.md): everything about it but its
/// indices, which only a pass over its gaps can check.
struct SparseLayout {
  PayloadHeader header;
  bool dense = false;  // the `none` escape: plain fp32 values follow the header (nothing below)
  uint64_t nnz = 0;
  unsigned w = 0;            // gap width in bits
  uint64_t value_bytes = 4;  // 2: fp16 values
  const uint8_t* gaps = nullptr;
  const uint8_t* values = nullptr;
};
/// Parses and checks a sparse payload of codec `codec` for a chunk of `out_elements`: header,
/// reserved bytes, nnz, gap width, exact size, zero padding after the gaps (the dense escape: its
/// exact size). Shared by the CPU decoder and the CUDA codecs' host-side validation.
Result<SparseLayout> parseSparsePayload(std::span<const uint8_t> payload, CodecId codec,
                                        size_t out_elements);

/// Validates a sparse payload of codec `codec` (or the `none` escape) completely, then adds
/// weight · value_j to out[i_j]. On error `out` is untouched.
Status decodeSparsePayload(std::span<const uint8_t> payload, CodecId codec, float weight,
                           float* out, size_t out_elements);

/// The entries of a sparse payload of codec `codec` for a chunk of `out_elements`, validated as
/// decodeSparsePayload validates: chunk-local indices (ascending) and their values as decoded
/// (fp16 widened); the `none` escape lists every element. Replaces the vectors' contents.
Status readSparseEntries(std::span<const uint8_t> payload, CodecId codec, size_t out_elements,
                         std::vector<uint32_t>& indices, std::vector<float>& values);

/// The global selection of one chunk (docs/exchange.md "Sparse allreduce"): of the summed
/// contributions sums[0, len), the k entries with the largest keys among those whose key is at
/// least max(min_key, 1) — never +-0 (ties: the lower index; a non-finite sum has the largest
/// keys, so the result carries it), written as a sparse payload of codec `codec` with fp32
/// values (header dtype fp32). `scratch` is reused across calls. `out` must hold
/// sparseMaxPayloadBytes(len, kF32). Returns the payload size.
Result<size_t> writeGlobalSelection(CodecId codec, std::span<const float> sums, size_t k,
                                    uint32_t min_key, std::vector<uint64_t>& scratch,
                                    std::span<uint8_t> out);

/// The number of entries of a sparse payload of `codec` for a chunk of `len` elements (its nnz;
/// a dense escape: every element), from its header, checked as decoding checks it.
Result<size_t> sparseEntryCount(std::span<const uint8_t> payload, CodecId codec, size_t len);

/// What the owner's rule needs of a whole layer beyond its chunk (docs/determinism.md "4.6b
/// Global selection"): k, the codec's selection count for the layer at the step's density
/// (Codec::selectionCount), and `entries`, per rank in rank order, the entries of all of that
/// rank's payloads of the layer (sparseLayerEntries; the contribution frames carry it).
struct LayerCounts {
  size_t k = 0;
  std::span<const uint64_t> entries;
};

/// The entries of a rank's payloads of a layer, one per chunk of `chunking`: the sum of their
/// sparseEntryCount()s.
Result<uint64_t> sparseLayerEntries(std::span<const std::span<const uint8_t>> payloads,
                                    CodecId codec, const Chunking& chunking);

/// The owner's rule of the sparse allreduce for one chunk of `len` elements (docs/determinism.md
/// "4.6b Global selection"): every rank's payload of it (`codec`'s; in rank order, one per rank)
/// decoded with weight 1 into fp32 sums from +0, then writeGlobalSelection() into `out` of the
/// chunk's share k_c = ⌊D_c · K / D⌋ entries — D_c the entries of the W payloads of the chunk, D
/// those of the W ranks' payloads of the whole layer (`layer.entries`), K = min(k, ⌊D / W⌋) — so
/// the shares of a layer's chunks add up to at most k; or, for a codec with a floor
/// (Codec::globalMinKey: threshold), every sum of at least the floor (`layer` unused). `sums` and
/// `scratch` are reused across calls. An error names the position of the payload in
/// `contributions` that does not decode, or whose entries exceed its rank's count of the layer.
Result<size_t> reduceSelectChunk(const Codec& codec,
                                 std::span<const std::span<const uint8_t>> contributions,
                                 size_t len, const LayerCounts& layer, std::vector<float>& sums,
                                 std::vector<uint64_t>& scratch, std::span<uint8_t> out);

/// The entries `sent` (this sidecar's payload of a chunk) shares with `selected` (the chunk's
/// global selection), both sparse payloads of codec `codec` for a chunk of `len` elements, in
/// index order: fn(chunk-local index, value as sent). What a selection codec settles after a
/// global selection (Codec::commitState).
Status forEachSettled(CodecId codec, std::span<const uint8_t> sent,
                      std::span<const uint8_t> selected, size_t len,
                      const std::function<void(size_t, float)>& fn);

}  // namespace lightwire::kernels
