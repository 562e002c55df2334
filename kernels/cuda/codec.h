#pragma once
// The CUDA codecs (docs/cuda.md "The CUDA codecs (`kernels/cuda/`)"): one CudaCodec per CPU codec,
// on device memory, with payloads byte-identical to the CPU codec's for the same input, parameters,
// seed and step (PowerSGD too: docs/determinism.md §4.12; NaN bits aside, §1). CUB style: every
// buffer is caller-owned device memory (sized by the *Bytes() methods), the stream is explicit, the
// hot path neither allocates nor synchronises the device, and every call returns a Status.
//
// One step of one tensor on the GPU, as on the CPU (kernels/codec.h):
//   analyze(...)                          whole tensor; prepares the next state in state.work()
//   encodeChunk(...) for each chunk       payload into device memory, its size into a device u64
//   ... the caller copies sizes and payloads to the host and exchanges them ...
//   decodeChunk(...) for every payload    host bytes, validated on the host, then decoded on the
//                                         device: d_out += weight · decoded
//   commitState(...) once the step succeeded everywhere (the work area over the state, or, for a
//                                         codec that commits in place, the step recomputed into
//                                         the state from the input and what was sent).
// Multi-round codecs (PowerSGD) take the previous round's reduced payload as host bytes, decode
// with decodeRounds() and need finishStep() before the commit, as on the CPU.
//
// The CPU codec of the same configuration is always at hand (host()): it gives the traits, the
// payload size bounds and chunk alignment, and validates payloads.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/codec.h"
#include "kernels/status.h"

namespace lightwire::kernels::cuda {

/// A Status for a CUDA runtime error (ok for cudaSuccess): "<what>: <cudaGetErrorString>".
Status cudaStatus(cudaError_t e, std::string_view what);

/// A device tensor (fp32, fp16 or bf16 elements).
struct DeviceTensor {
  const void* data = nullptr;
  size_t elements = 0;
  DType dtype = DType::kF32;
};

/// Caller-owned device bytes (a workspace or scratch area).
struct DeviceBytes {
  void* data = nullptr;
  size_t size = 0;
};

/// Persistent per-tensor codec state in device memory, one copy (docs/cuda.md "Memory"): what
/// the last committed step left. A step never writes it before its commit: analyze(),
/// encodeChunk(), finishStep() and flush() work in the step's work area (workFloats() values: the
/// whole next state in the state's layout, or less for a codec that commits in place), which the
/// owner lends for the step (attachWork) or which the state allocates itself on first use (tests,
/// tools). Once the step succeeded everywhere the codec's commitState() applies it (the work area
/// copied over the state, or a recomputation in place), so a failed step changes nothing. Owns its
/// memory (allocated when the tensor's state is created, not on the hot path). Move-only.
class DeviceState {
 public:
  DeviceState() = default;
  /// `floats` fp32 values, zero-filled (synchronously); a work area of `work_floats` (the codec's
  /// CudaCodec::workFloats; the one-argument form: `floats`, what any codec can work in).
  static Result<DeviceState> create(size_t floats, size_t work_floats);
  static Result<DeviceState> create(size_t floats) { return create(floats, floats); }
  ~DeviceState();
  DeviceState(DeviceState&& other) noexcept;
  DeviceState& operator=(DeviceState&& other) noexcept;
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  size_t floats() const { return floats_; }
  /// fp32 values of the step's work area.
  size_t workFloats() const { return work_floats_; }
  /// Bytes of the committed state (the work area is step-scoped memory, not counted).
  size_t bytes() const { return floats_ * sizeof(float); }
  const float* current() const { return current_; }
  /// The committed state, for CudaCodec::commitState() and commitFlush() only.
  float* mutableCurrent() { return current_; }
  /// The step's work area: the lent one, else the one the state owns (null before ensureWork()).
  float* work() { return lent_ != nullptr ? lent_ : owned_work_; }
  /// A work area for the step: the lent one, else one the state allocates (once). analyze() and
  /// flush() call it; no-op for a state of no floats.
  Status ensureWork();
  /// Lends `area` (device memory of workFloats() values) as the work area until detachWork().
  void attachWork(float* area) { lent_ = area; }
  void detachWork() { lent_ = nullptr; }
  /// Zeroes the committed state (on `stream`).
  Status reset(cudaStream_t stream);
  /// The committed state, copied to the host (synchronises `stream`).
  Result<std::vector<float>> download(cudaStream_t stream) const;
  /// Sets the committed state from the host (a checkpoint); fails, changing nothing, when
  /// current.size() != floats(). Synchronises `stream`.
  Status upload(std::span<const float> current, cudaStream_t stream);

 private:
  friend class CudaCodec;
  /// The state prepared whole in the work area becomes the committed one (a device copy on
  /// `stream`, after the step's kernels; asynchronous): the default CudaCodec::commitState() and
  /// commitFlush(), so only a codec that prepares the whole state commits this way.
  /// failedPrecondition when no step prepared one, or when the work area is smaller than the
  /// state.
  Status commit(cudaStream_t stream);

  size_t floats_ = 0;
  size_t work_floats_ = 0;
  float* current_ = nullptr;
  float* owned_work_ = nullptr;
  float* lent_ = nullptr;
};

/// A compression algorithm with fixed parameters on the GPU. Thread-safe (const methods only);
/// concurrent calls need distinct streams and workspaces.
class CudaCodec {
 public:
  virtual ~CudaCodec() = default;

  /// The CPU codec of the same configuration (error feedback included when configured).
  virtual const Codec& host() const = 0;
  const CodecTraits& traits() const { return host().traits(); }
  const CodecConfig& config() const { return host().config(); }
  size_t stateFloats(size_t n, std::span<const uint64_t> shape = {}) const {
    return host().stateFloats(n, shape);
  }
  /// fp32 values of a step's work area for n elements (DeviceState::create's `work_floats`): by
  /// default the whole next state, which commitState() copies over the state; fewer for a codec
  /// that commits in place (dgc: v' alone, n).
  virtual size_t workFloats(size_t n, std::span<const uint64_t> shape = {}) const {
    return stateFloats(n, shape);
  }
  /// Whether commitState() rereads the step's input: the result must not be written over the
  /// input before the commit (the GPU backend then decodes it into the work area and copies it
  /// to the trainer once the state is committed, as the host backend does). Default: no.
  virtual bool commitReadsInput() const { return false; }
  /// Device bytes of the scratch commitState() needs for a sent payload of `payload_bytes` of a
  /// chunk of `chunk_elements` (0: it reads no payload; the default).
  virtual size_t commitScratchBytes(size_t /*payload_bytes*/, size_t /*chunk_elements*/) const {
    return 0;
  }
  size_t maxPayloadBytes(size_t chunk_elements) const {
    return host().maxPayloadBytes(chunk_elements);
  }

  /// Device bytes analyze() + encodeChunk() need for one step with this chunking.
  virtual size_t workspaceBytes(const Chunking& chunking) const = 0;
  /// Device bytes accumulate() needs to decode a payload into `out_elements` elements (e.g. CUB
  /// scan storage for sparse indices). Default 0.
  virtual size_t accumulateScratchBytes(size_t /*out_elements*/) const { return 0; }
  /// Device bytes decodeChunk() / decodeRounds() need for a payload of `payload_bytes` decoded into
  /// `out_elements` elements: the staged payload (rounded up to 256) + accumulateScratchBytes.
  size_t decodeScratchBytes(size_t payload_bytes, size_t out_elements) const {
    return stagedBytes(payload_bytes) + accumulateScratchBytes(out_elements);
  }

  /// Whole-tensor phase of a step (as Codec::analyze), on `stream`. Checks the arguments (input
  /// elements == chunking.elements, non-null data when non-empty, state sized stateFloats(n),
  /// workspace >= workspaceBytes, chunk size a multiple of the alignment), then doAnalyze().
  /// ctx.stream (the CPU stream) is ignored.
  Status analyze(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                 DeviceState& state, DeviceBytes workspace, cudaStream_t stream) const;

  /// Encodes chunk `chunk` for round `round` into d_out (device, >= maxPayloadBytes(chunk size))
  /// and writes the payload's byte size to *d_size (device). Asynchronous: both are valid once
  /// `stream` reaches this point. `previous`: the reduced payload of round-1 (host bytes; empty in
  /// round 0). Checks the arguments as analyze() does plus chunk, round, d_out and d_size.
  Status encodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk, int round,
                     std::span<const uint8_t> previous, DeviceTensor input, DeviceState& state,
                     DeviceBytes workspace, uint8_t* d_out, uint64_t* d_size,
                     cudaStream_t stream) const;

  /// Validates the host payload `payload` on the host (as the CPU decoder does: nothing is
  /// trusted), copies it into `scratch` and adds weight · decoded to d_out[0..out_elements) on
  /// `stream`. On error nothing is enqueued and d_out is untouched. `scratch` must hold
  /// decodeScratchBytes(payload.size(), out_elements) bytes and stay valid until `stream` has
  /// consumed it; `payload` may be freed when the call returns (it is staged synchronously).
  Status decodeChunk(std::span<const uint8_t> payload, float weight, float* d_out,
                     size_t out_elements, DeviceBytes scratch, cudaStream_t stream) const;

  /// Adds weight · decoded(d_payload) to d_out[0..out_elements): a payload in device memory that
  /// this codec wrote or that was validated; sizes and counts are read from the payload itself.
  /// No host-side checks beyond pointers: trusted input only. `scratch`: accumulateScratchBytes.
  /// Bit-identical to the CPU decoder (out = out + weight · value, two fp32 roundings, no FMA,
  /// payloads of one call applied in one fixed order per element).
  virtual Status accumulate(const uint8_t* d_payload, float weight, float* d_out,
                            size_t out_elements, DeviceBytes scratch,
                            cudaStream_t stream) const = 0;

  /// Host-side validation of an untrusted payload for out_elements elements; decodeChunk() calls
  /// it. Default: the CPU codec decodes it into a host buffer (complete, but O(out_elements) host
  /// work); codecs override it with checks that do not decode.
  virtual Status validate(std::span<const uint8_t> payload, size_t out_elements) const;

  /// Full synchronisation (as Codec::flush): d_out[0..n) = input + what the state holds back;
  /// commitFlush() applies it. Checks as analyze() (no workspace), then doFlush().
  Status flush(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
               DeviceState& state, float* d_out, cudaStream_t stream) const;

  /// The step succeeded everywhere: the committed state takes it, on `stream` (asynchronous).
  /// `ctx`, `input` and `workspace` as the step had them (the input unchanged since analyze(), the
  /// workspace holding what finishStep() left); `sent`:
  /// this sidecar's round-0 payload of every chunk, host bytes this codec wrote, staged through
  /// `scratch` (commitScratchBytes of the largest) by a codec that reads them. Default: the work
  /// area over the state (DeviceState::commit). A codec that commits in place recomputes the
  /// state from itself, the input and what was sent, with the CPU codec's commitState()
  /// arithmetic (docs/determinism.md §4.6c), so the state stays bit-identical to the host's.
  virtual Status commitState(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                             std::span<const std::span<const uint8_t>> sent, DeviceState& state,
                             DeviceBytes workspace, DeviceBytes scratch, cudaStream_t stream) const;
  /// A full sync (flush()) succeeded: the state as after a flush, on `stream`. Default: the work
  /// area doFlush() prepared over the state.
  virtual Status commitFlush(DeviceState& state, cudaStream_t stream) const;

  /// Squared L2 norm (fp64, canonical order) of what the committed state holds back, as
  /// Codec::residualNorm2. Synchronises `stream`. `scratch`: residualScratchBytes(n) device bytes.
  virtual Result<double> residualNorm2(const DeviceState& state, size_t n, DeviceBytes scratch,
                                       cudaStream_t stream) const;
  static size_t residualScratchBytes(size_t n);

  /// Multi-round codecs: as Codec::decodeRounds / finishStep (host payloads, device output).
  /// decodeRounds' scratch: accumulateScratchBytes(out_elements) (= decodeScratchBytes(0, n)),
  /// which includes the staging of every round's factors.
  virtual Status decodeRounds(std::span<const std::span<const uint8_t>> reduced_rounds,
                              float weight, float* d_out, size_t out_elements, DeviceBytes scratch,
                              cudaStream_t stream) const;
  virtual Status finishStep(const StepContext& ctx, const Chunking& chunking,
                            std::span<const std::span<const uint8_t>> reduced_rounds, float weight,
                            DeviceTensor input, DeviceState& state, DeviceBytes workspace,
                            cudaStream_t stream) const;

 protected:
  /// Device bytes a staged payload of `payload_bytes` takes (rounded up to 256, so that what
  /// follows it in the scratch stays aligned).
  static size_t stagedBytes(size_t payload_bytes) { return (payload_bytes + 255) & ~size_t{255}; }
  /// A host payload copied to the front of a device scratch, and the scratch after it.
  struct Staged {
    const uint8_t* payload;
    DeviceBytes rest;
  };
  /// Copies host `payload` to the front of `scratch` on `stream` (pageable memory: the copy is
  /// staged before cudaMemcpyAsync returns, so `payload` may go; the stream orders it after
  /// earlier work that read the same scratch). The caller checked that `scratch` holds
  /// stagedBytes(payload.size()); `what` names the copy in an error.
  static Result<Staged> stage(std::span<const uint8_t> payload, DeviceBytes scratch,
                              cudaStream_t stream, const std::string& what);

  /// After the argument checks of analyze() / encodeChunk() / flush(), as in kernels/codec.h.
  virtual Status doAnalyze(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                           DeviceState& state, DeviceBytes workspace,
                           cudaStream_t stream) const = 0;
  virtual Status doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                               int round, std::span<const uint8_t> previous, DeviceTensor input,
                               DeviceState& state, DeviceBytes workspace, uint8_t* d_out,
                               uint64_t* d_size, cudaStream_t stream) const = 0;
  /// Default, for stateless codecs: d_out = input widened to fp32; state.work() = current (what the
  /// default commitFlush() copies).
  virtual Status doFlush(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                         DeviceState& state, float* d_out, cudaStream_t stream) const;

 private:
  Status checkTensorArgs(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                         const DeviceState& state) const;
  /// The state's work area holds workFloats() (a lent one is the lender's to size).
  Status checkWorkArea(const StepContext& ctx, const Chunking& chunking,
                       const DeviceState& state) const;
};

/// Builds a CUDA codec from the unwrapped CPU codec of the same configuration (error feedback is
/// added by createCudaCodec, never by a factory).
using CudaCodecFactory =
    std::function<Result<std::unique_ptr<CudaCodec>>(std::unique_ptr<Codec> host)>;

/// Adds the CUDA implementation of codec `id`; fails when one is already registered.
Status registerCudaCodec(CodecId id, CudaCodecFactory factory);

/// Whether codec `name` has a CUDA implementation.
bool hasCudaCodec(std::string_view name);
/// Names of the codecs with a CUDA implementation, sorted.
std::vector<std::string> cudaCodecNames();

/// The CUDA codec for `config`: validated exactly as createCodec(config), wrapped in the CUDA error
/// feedback decorator when the CPU codec would be. failedPrecondition when the codec has no CUDA
/// implementation (the caller then stages through the host).
Result<std::unique_ptr<CudaCodec>> createCudaCodec(const CodecConfig& config);

/// Wraps `inner` (a CUDA codec without memory of its own) in residual error feedback;
/// `host_with_ef` is the CPU codec of the wrapped configuration.
std::unique_ptr<CudaCodec> makeCudaErrorFeedback(std::unique_ptr<CudaCodec> inner,
                                                 std::unique_ptr<Codec> host_with_ef);

namespace detail {
struct CudaCodecRegistrar {
  CudaCodecRegistrar(CodecId id, CudaCodecFactory factory);
};
}  // namespace detail

}  // namespace lightwire::kernels::cuda

#define LW_REGISTER_CUDA_CODEC(ident, id, factory)                    \
  static const ::lightwire::kernels::cuda::detail::CudaCodecRegistrar \
      lw_cuda_codec_registrar_##ident(id, factory)
