#pragma once
// The codec interface (docs/codecs.md "The codec interface"). A Codec is a configured algorithm:
// immutable after creation and safe to share between threads. Everything that changes lives in
// caller-owned memory:
//   - CodecState: persistent per-tensor state (residuals, momentum), one copy. A step reads it
//     and leaves it alone; commitState() applies the step to it in place once the whole step
//     succeeded (docs/determinism.md "4.6c Atomic steps (one copy of the state)"), so a failed step
//     changes nothing. The step's own working values (error feedback's x + e, DGC's v', PowerSGD's
//     M) go to the state's work area, step-scoped memory the owner lends (workFloats());
//   - a workspace sized by workspaceBytes() (no allocation on the hot path);
//   - a CpuStream, the explicit execution context (CUDA codecs take a cudaStream_t instead).
//
// One step of one tensor, on the sending side:
//   analyze(...)                      whole tensor: error feedback / momentum into the work
//                                     area, thresholds, norms — anything that must see every chunk;
//   encodeChunk(...) for each chunk   independent per chunk (may run concurrently, or pipelined
//                                     with sending the previous chunk);
//   ... exchange; for multi-round codecs (rounds() > 1) encodeChunk is called again with the
//       reduced result of the previous round ...
//   decodeChunk(...) for every payload received: out += weight * decoded. Once a chunk is
//       encoded its range of the work area is free: the owner may decode the result there.
//   commitState(...) when the step succeeded everywhere, otherwise nothing: it recomputes the
//       new state in place from the input (which must be unchanged until then), the committed
//       state and what this sidecar sent, with the same arithmetic as analyze() and encodeChunk().
// Multi-round codecs decode with decodeRounds(...) (every round's reduced payload) instead of
// decodeChunk(...), and need finishStep(...) after the last round and before commitState().
// A full synchronisation (docs/determinism.md "4.6a Full synchronisation (flush)") replaces all of
// that with flush(...): the dense fp32 tensor to exchange, which includes what the state held back;
// commitFlush() then leaves the state as after a flush. residualNorm2(...) tells how much the
// committed state holds back.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/buffer.h"
#include "kernels/dtype.h"
#include "kernels/payload.h"
#include "kernels/status.h"

namespace lightwire::kernels {

class CpuStream;

/// Typed, validated codec settings. Each codec reads the fields it uses and rejects values out of
/// range; fields it does not use are ignored.
struct CodecConfig {
  std::string name = "none";
  std::optional<double> density;  // topk, dgc: k/n in (0, 1]
  std::optional<double> ratio;    // topk, dgc: n/k >= 1 (alternative to density)
  int bits = 8;                   // qsgd: bits per element including sign, 2..8
  uint32_t bucket_size = 512;     // qsgd (and codecs with per-bucket scales): bucket size
  double momentum = 0.0;          // dgc: momentum correction factor in [0, 1)
  double clip_norm = 0.0;         // dgc: local gradient clipping (0 = off)
  double sample_fraction = 0.01;  // dgc: threshold sample in [0.001, 0.01]
  /// dgc with momentum: divide each element's momentum by 1 − m^a (a = steps since the element
  /// was last sent, or since the start) before accumulating it (docs/determinism.md §4.4).
  bool bias_correction = false;
  DType sparse_values = DType::kF32;   // topk, dgc, threshold: value encoding, kF32 or kF16
  std::optional<double> threshold;     // threshold: send elements with |g| >= threshold
  std::optional<bool> error_feedback;  // unset = the codec's default (docs/codecs.md)
  int approx_rank = 1;                 // powersgd
  /// topk, dgc, threshold: an element whose value to send (after error feedback / momentum, in
  /// fp32, before any fp16 value encoding) has |value| < min_magnitude is never sent; it stays in
  /// the residual (velocity) like any unsent element. Finite and >= 0; 0 = off.
  double min_magnitude = 0.0;
};

/// Static facts about a codec.
struct CodecTraits {
  CodecId id = CodecId::kNone;
  const char* name = "none";
  bool summable = false;    // payloads add in the compressed domain (addPayloads)
  bool sparse = false;      // payload is (index, value) pairs
  bool own_memory = false;  // keeps its own residual/momentum: never wrapped in error feedback
  bool default_error_feedback = false;  // biased codecs: EF on unless configured off
  int rounds = 1;                       // exchanges per step (PowerSGD: 2)
  bool single_chunk = false;  // the whole tensor is one payload (PowerSGD's matrix): chunkingFor()
  // Selects a fraction of the elements given by density (or ratio): the DGC warm-up and the
  // density schedules of the policies apply (StepContext::density).
  bool uses_density = false;
  // Never sends an element below CodecConfig::min_magnitude (the adaptive schedule sets it).
  bool uses_min_magnitude = false;
  // A parameter server may re-compress the mean of the contributions that arrived (bounded
  // staleness): false when payloads are scaled for exactly one decoding.
  bool staleness_safe = true;
};

/// How a tensor of `elements` is cut into chunks of `chunk_elements` (last one shorter).
struct Chunking {
  size_t elements = 0;
  size_t chunk_elements = 0;  // > 0

  /// A chunking of n elements with chunks of about `requested` elements (0 = one chunk), rounded up
  /// to a multiple of `alignment`.
  static Chunking make(size_t n, size_t requested, size_t alignment);
  size_t count() const {
    if (elements == 0 || chunk_elements == 0) return 1;
    return (elements + chunk_elements - 1) / chunk_elements;
  }
  size_t begin(size_t chunk) const { return std::min(elements, chunk * chunk_elements); }
  size_t size(size_t chunk) const {
    const size_t b = begin(chunk);
    return std::min(chunk_elements, elements - b);
  }
};

/// Identity and randomness of one step of one tensor.
struct StepContext {
  uint32_t seed = 0;                // job seed (Philox key word 0)
  uint32_t name_key = 0;            // tensorNameKey(name) (Philox key word 1)
  uint64_t step = 0;                // Philox counter word 0 (low 32 bits)
  uint32_t rank = 0;                // Philox stream for per-rank randomness
  std::optional<double> density;    // per-step override for selection codecs (schedules)
  CpuStream* stream = nullptr;      // execution context; null = calling thread only
  std::span<const uint64_t> shape;  // the trainer's tensor shape when known (PowerSGD's matrix
                                    // view); empty = unknown, the tensor is flat
  // Global selection (Codec::selectsGlobally, docs/exchange.md "Sparse allreduce"): commitState
  // applies the effect of sending (the residual's, dgc's masking) to the entries the global
  // selection kept, not to every entry sent.
  bool defer_sent = false;
};

/// A copy commitState() makes in the pass that reads the input: to[i] = from[i] for every element
/// i, each right after input i was read, so `to` may be the input's own memory (the host backend
/// writes the step's result back into the trainer's buffer that held the input this way, without a
/// pass of its own). Empty: no copy.
struct WriteBack {
  const float* from = nullptr;
  float* to = nullptr;
  explicit operator bool() const { return to != nullptr; }
};

/// Persistent per-tensor codec state, one copy: what the last committed step left. A step never
/// writes it before commitState(); its working values go to the work area (work()), which the
/// owner lends for the step (attachWork) or which the state allocates itself on first use (tests,
/// tools). Not thread-safe; owned by the caller.
class CodecState {
 public:
  CodecState() = default;
  explicit CodecState(size_t floats) : state_(floats) {}  // zeros
  size_t floats() const { return state_.size(); }
  /// Bytes of the persistent state (the work area is step-scoped memory, not counted).
  size_t bytes() const { return state_.size() * sizeof(float); }
  const float* current() const { return state_.empty() ? nullptr : state_.data(); }
  /// The committed state, for commitState() and commitFlush() only.
  float* mutableCurrent() { return state_.empty() ? nullptr : state_.data(); }
  /// Forgets everything (fresh state, e.g. after a size change or a residual flush): fresh
  /// zeroed memory, resident again only where written.
  void reset();
  /// `floats` values (fresh zeroed memory) whose first `keep` are the committed ones: PowerSGD's
  /// state when the tensor's shape changes its matrix view (the error kept, the warm start not).
  void resize(size_t floats, size_t keep);
  std::span<const float> currentSpan() const { return state_; }
  /// Sets the committed state to `current` (a checkpoint). Fails, changing nothing, when
  /// current.size() != floats().
  Status restore(std::span<const float> current);

  /// The step's work area of at least `floats` floats: the lent one when it is large enough, else
  /// memory the state owns (allocated once).
  float* work(size_t floats);
  /// Lends `area` as the work area until detachWork() (the step's owner: its result buffer).
  void attachWork(std::span<float> area) { lent_ = area; }
  void detachWork() { lent_ = {}; }

 private:
  StateBuffer state_;
  std::span<float> lent_;
  std::vector<float> owned_work_;
};

/// A compression algorithm with fixed parameters. Thread-safe (const methods only).
class Codec {
 public:
  virtual ~Codec() = default;

  virtual const CodecTraits& traits() const = 0;
  virtual const CodecConfig& config() const = 0;

  /// Chunk sizes must be multiples of this (QSGD: its bucket size).
  virtual size_t chunkAlignment() const { return 1; }
  /// fp32 values of persistent state for a tensor of n elements (0 = stateless) with `shape`
  /// (StepContext::shape: the trainer's shape, empty when unknown). Only PowerSGD's depends on
  /// the shape (its warm-start Q has the matrix view's cols · rank values).
  virtual size_t stateFloats(size_t /*n*/, std::span<const uint64_t> /*shape*/) const { return 0; }
  /// stateFloats() of a tensor without a shape.
  size_t stateFloats(size_t n) const { return stateFloats(n, {}); }
  /// fp32 values of the step's work area (CodecState::work) for n elements: n for codecs with
  /// state (error feedback's x + e, DGC's v', PowerSGD's M), 0 for stateless ones.
  size_t workFloats(size_t n) const { return stateFloats(n) > 0 ? n : 0; }
  /// Scratch bytes one step of a tensor with this chunking needs.
  virtual size_t workspaceBytes(const Chunking& chunking) const = 0;
  /// Upper bound of one chunk's payload size.
  virtual size_t maxPayloadBytes(size_t chunk_elements) const = 0;
  /// The size one chunk's payload is expected to have, the same on every sidecar (from the
  /// configuration, not the data), or nullopt when it cannot be told in advance (threshold
  /// selection). The exchange uses it to choose between gathering payloads and a dense
  /// allreduce. Default: the upper bound for dense and quantised codecs, nullopt for sparse ones.
  /// `density`: the step's density override of selection codecs (StepContext::density), if any.
  virtual std::optional<size_t> nominalPayloadBytes(
      size_t chunk_elements, std::optional<double> /*density*/ = std::nullopt) const {
    if (traits().sparse) return std::nullopt;
    return maxPayloadBytes(chunk_elements);
  }

  /// Whole-tensor phase of a step: reads `input` and the committed state, writes the work area
  /// (state.work(workFloats(n))) and leaves in `workspace` what encodeChunk needs. Never writes
  /// the committed state.
  /// Checks the arguments every codec relies on (sizes of input, state and workspace; chunk size
  /// a multiple of chunkAlignment()), then runs doAnalyze().
  Status analyze(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                 CodecState& state, std::span<std::byte> workspace) const;

  /// Encodes chunk `chunk` for exchange round `round` into `out` (at least
  /// maxPayloadBytes(chunking.size(chunk)) bytes) and returns the payload size. `previous` is the
  /// reduced payload of round-1 (empty in round 0). Reads only the chunk's range of `input` and of
  /// the work area and writes neither, so calls for different chunks may run concurrently after
  /// analyze(), and once chunk c is encoded its range of the work area may hold the result.
  /// Concurrent calls need distinct ctx.stream values.
  /// Checks the arguments as analyze() does plus chunk, round and `out`, then runs doEncodeChunk().
  Result<size_t> encodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                             int round, std::span<const uint8_t> previous, ConstTensor input,
                             CodecState& state, std::span<std::byte> workspace,
                             std::span<uint8_t> out) const;

  /// Validates `payload` and adds weight * decoded to out[0..out_elements) (the chunk's range of
  /// the result). On error `out` is untouched and the message says what is wrong.
  virtual Status decodeChunk(std::span<const uint8_t> payload, float weight, float* out,
                             size_t out_elements) const = 0;

  /// decodeChunk() into a range of zeros, without a pass to zero it first: writes
  /// out[i] = +0 + weight * decoded[i] (the same bits as zeroing and adding; `+0 +` turns a −0
  /// into +0). The first payload of a chunk's result. The default zeroes `out`, then decodeChunk();
  /// the dense layout overrides it. On error `out` may hold zeros.
  virtual Status decodeChunkInto(std::span<const uint8_t> payload, float weight, float* out,
                                 size_t out_elements) const;

  /// Summable codecs: out = a + b in the compressed domain; returns the size written.
  virtual Result<size_t> addPayloads(std::span<const uint8_t> a, std::span<const uint8_t> b,
                                     std::span<uint8_t> out) const;

  /// Full synchronisation (docs/determinism.md "4.6a Full synchronisation (flush)"): writes into
  /// out[0..chunking.elements) what a dense exchange of this step must send so that nothing this
  /// sidecar owes is lost — the input plus whatever the codec's state holds back (error-feedback
  /// residual; DGC's accumulated velocity after this step's momentum update, clipping included;
  /// PowerSGD's error). commitFlush() leaves the state as after such a flush once the step
  /// succeeded. Reads input and the committed state; writes neither. Checks the
  /// arguments as analyze() does (no workspace is needed) plus a non-null `out` when there are
  /// elements, then runs doFlush().
  Status flush(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
               CodecState& state, float* out) const;

  /// Squared L2 norm of what `state` (committed, state.current()) holds back for a tensor of n
  /// elements, accumulated in fp64 in the canonical order (docs/determinism.md §2): the
  /// error-feedback residual, DGC's accumulated velocity v (not the momentum u), PowerSGD's error.
  /// 0 for stateless codecs, and for a state that holds nothing (floats() == 0) or is not sized for
  /// n elements (stateFloats(n)).
  virtual double residualNorm2(const CodecState& state, size_t n) const;

  /// Multi-round codecs (traits().rounds > 1, single_chunk): decodes one step from the reduced
  /// payload of every round, in round order, and adds weight * decoded to out[0..out_elements).
  /// The default accepts exactly one payload and is decodeChunk(). On error `out` is untouched.
  virtual Status decodeRounds(std::span<const std::span<const uint8_t>> reduced_rounds,
                              float weight, float* out, size_t out_elements) const;

  /// Called by the step's owner after the last round and before commit, with the reduced payload of
  /// every round, the same weight as decodeRounds() and the arguments analyze() had. Codecs whose
  /// next state depends on the reduced result (PowerSGD's error and warm start) keep in the
  /// workspace what commitState() needs of it; the default does nothing. Never writes the state;
  /// the work area may already hold the result.
  virtual Status finishStep(const StepContext& ctx, const Chunking& chunking,
                            std::span<const std::span<const uint8_t>> reduced_rounds, float weight,
                            ConstTensor input, CodecState& state,
                            std::span<std::byte> workspace) const;

  /// Whether the sparse allreduce may carry this codec (docs/exchange.md "Sparse allreduce"): a
  /// selection codec whose summed contributions can be selected again (topk, dgc).
  virtual bool selectsGlobally() const { return false; }
  /// Selection codecs: k, the elements one step of a tensor of n elements selects at `density`
  /// (the step's override, StepContext::density; nullopt: the codec's own). Others: n.
  virtual size_t selectionCount(size_t n, std::optional<double> /*density*/) const { return n; }
  /// The global selection's floor (docs/determinism.md "4.6b Global selection"): an owner keeps
  /// only summed entries whose magnitude key is at least this, for `world` sidecars. 0: none (topk
  /// and dgc keep a count); threshold: key(fl32(W · τ)) — the mean's magnitude at least τ.
  virtual uint32_t globalMinKey(uint32_t /*world*/) const { return 0; }

  /// The step succeeded everywhere: applies it to the committed state in place, with the same
  /// arithmetic as analyze(), encodeChunk() and finishStep() (docs/determinism.md "4.7 Atomic
  /// steps without a second copy"): error feedback's e = x + e minus what was sent, DGC's momentum
  /// and accumulation then its masking, PowerSGD's error and warm start. `input`: the step's
  /// input, unchanged since analyze(); `sent`: this sidecar's round-0 payload of every chunk;
  /// `selected`: with ctx.defer_sent, the global selection of every chunk (a payload of this
  /// codec) — then only the sent entries it also holds give up their values, the rest stays in
  /// the state as if never sent — else empty; `workspace` as finishStep() left it (the work area
  /// is not read). The payloads were made by this codec for this step: an error means a bug, and
  /// the state may then be partly updated (the owner resets it). Stateless codecs: nothing.
  /// `write_back`: a copy made in the same pass (WriteBack; codecs with state only, input fp32).
  Status commitState(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                     std::span<const std::span<const uint8_t>> sent,
                     std::span<const std::span<const uint8_t>> selected, CodecState& state,
                     std::span<std::byte> workspace, WriteBack write_back = {}) const;
  /// A full synchronisation succeeded: the state as after a flush (error-feedback residual zero;
  /// DGC: velocity and momentum zero; PowerSGD: error zero, warm-start factor kept).
  virtual void commitFlush(CodecState& /*state*/, size_t /*n*/) const {}
  /// Global selection: whether the sent payload and the selection of one chunk can be settled at
  /// commit (both parse as this codec's payloads for the chunk), changing nothing. The pipeline
  /// asks before the step may commit, so commitState() does not fail on a peer's bad selection.
  virtual Status checkSelection(const Chunking& /*chunking*/, size_t /*chunk*/,
                                std::span<const uint8_t> /*sent*/,
                                std::span<const uint8_t> /*selected*/) const {
    return Status::ok();
  }

 protected:
  /// analyze() and encodeChunk() after their argument checks: implementations may rely on
  /// input.elements == chunking.elements, a valid dtype, non-null data when non-empty, the state
  /// and workspace sizes they asked for, chunk < chunking.count(), 0 <= round < rounds, and `out`
  /// of at least maxPayloadBytes(chunking.size(chunk)) bytes.
  virtual Status doAnalyze(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                           CodecState& state, std::span<std::byte> workspace) const = 0;
  virtual Result<size_t> doEncodeChunk(const StepContext& ctx, const Chunking& chunking,
                                       size_t chunk, int round, std::span<const uint8_t> previous,
                                       ConstTensor input, CodecState& state,
                                       std::span<std::byte> workspace,
                                       std::span<uint8_t> out) const = 0;
  /// flush() after its argument checks (as doAnalyze's, without the workspace; `out` holds
  /// chunking.elements floats). Default, for codecs without state: out = input (widened to fp32).
  virtual Status doFlush(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                         CodecState& state, float* out) const;
  /// commitState() after its argument checks (as analyze()'s, plus one sent payload per chunk and
  /// none or one selection per chunk). Default, for codecs without state: nothing.
  virtual Status doCommitState(const StepContext& /*ctx*/, const Chunking& /*chunking*/,
                               ConstTensor /*input*/,
                               std::span<const std::span<const uint8_t>> /*sent*/,
                               std::span<const std::span<const uint8_t>> /*selected*/,
                               CodecState& /*state*/, std::span<std::byte> /*workspace*/,
                               WriteBack /*write_back*/) const {
    return Status::ok();
  }

 private:
  Status checkStepArgs(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                       const CodecState& state, std::span<std::byte> workspace) const;
  Status checkTensorArgs(const StepContext& ctx, const Chunking& chunking, ConstTensor input,
                         const CodecState& state) const;
};

/// Bump allocator over a caller-owned workspace; every slice is 64-byte aligned.
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(std::span<std::byte> ws) : ws_(ws) {}
  /// Bytes needed for slices of the given byte sizes.
  static size_t bytesFor(std::initializer_list<size_t> sizes);
  template <typename T>
  std::span<T> take(size_t count) {
    const size_t bytes = (count * sizeof(T) + 63) & ~size_t{63};
    if (offset_ + bytes > ws_.size()) return {};
    T* p = reinterpret_cast<T*>(ws_.data() + offset_);
    offset_ += bytes;
    return {p, count};
  }

 private:
  std::span<std::byte> ws_;
  size_t offset_ = 0;
};

/// The chunking a codec uses for n elements when about `requested` elements per chunk are asked
/// for (0 = one chunk): one chunk for single_chunk codecs, else rounded to chunkAlignment().
Chunking chunkingFor(const Codec& codec, size_t n, size_t requested);

/// Convenience for tests, benchmarks and the step loop: compresses a whole tensor into one
/// payload per chunk (analyze + encodeChunk for each chunk, round 0), the state left as it was.
/// Allocates.
Result<std::vector<std::vector<uint8_t>>> encodeTensor(const Codec& codec, const StepContext& ctx,
                                                       const Chunking& chunking, ConstTensor input,
                                                       CodecState& state);

/// encodeTensor(), then commitState() with those payloads (a single-round step that succeeded,
/// without a global selection). Allocates.
Result<std::vector<std::vector<uint8_t>>> stepTensor(const Codec& codec, const StepContext& ctx,
                                                     const Chunking& chunking, ConstTensor input,
                                                     CodecState& state);

/// out[i] = x_i + e_i in fp32 (x widened), for i < n, on `stream`: error feedback's a = x + e
/// (docs/determinism.md §4.6 step 1) and PowerSGD's M (§4.12 step 1). `out` may be `e`; with
/// `write_back`, its copy in the same pass (x_i read first).
void addWidened(CpuStream* stream, ConstTensor x, const float* e, float* out, size_t n,
                WriteBack write_back = {});

/// Decodes one payload per chunk into out[0..chunking.elements) with `weight`.
Status decodeTensor(const Codec& codec, const Chunking& chunking,
                    const std::vector<std::vector<uint8_t>>& payloads, float weight, float* out);

}  // namespace lightwire::kernels
