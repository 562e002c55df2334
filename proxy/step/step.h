#pragma once
// What goes into one step of one tensor and what comes out of it (docs/architecture.md "The step
// pipeline"): each local trainer's contribution, the figures of a completed step, and how a step
// ended. Plain values; no HTTP here — the control API maps StepError to its status codes.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/dtype.h"
#include "metrics/metrics.h"

namespace lightwire::proxy {

/// A step's place in its stream (docs/api.md "Buckets in flight"): a trainer with several
/// buckets at the sidecar at once numbers them per iteration in its launch order, so that every
/// sidecar runs them in that order whatever order they arrive in. `stream` names the numbering (one
/// per hook state: two models in one process number apart).
struct StepOrder {
  std::string stream;
  uint64_t iteration = 0;
  uint32_t position = 0;
  bool operator==(const StepOrder&) const = default;
};

/// What a trainer says about the tensor it sends.
struct TensorSpec {
  std::string name;
  uint64_t step = 0;
  unsigned trainer = 0;
  kernels::DType dtype = kernels::DType::kF32;
  std::vector<uint64_t> shape;  // empty = 1-D
  uint64_t elements = 0;
  bool layer = false;  // one parameter of a bucket's layout (TensorFacts::layer)
  // The bucket a layer belongs to (StepEngine::submitBucket; empty: a tensor of its own), and the
  // hash of its layout and its layer count (checked against every other sidecar's in the exchange).
  std::string bucket;
  uint64_t layout_hash = 0;
  uint32_t bucket_layers = 0;
  // `codec: auto` (docs/policies.md): the trainer's compute per iteration that falls to this
  // tensor, and the part of it the tensor's exchange can hide behind (seconds; both or neither).
  std::optional<double> compute_s, overlap_s;
  // ... and what the trainers' own process group added beyond the compute in direct windows, and
  // the sidecars in the other steps.
  std::optional<double> direct_s, tail_s;
  // The momentum the trainer's optimizer takes back from the sidecar where a rung applies it
  // (dgc's momentum correction): `dgc:D:M` rungs are usable only with M declared by every trainer.
  std::optional<double> momentum;
  // The step's place in its stream (empty: it runs when its parts are in, in arrival order).
  std::optional<StepOrder> order;
};

/// One trainer's part of a step: where its tensor is, and where its result goes (the same bytes).
struct Contribution {
  TensorSpec spec;
  std::byte* data = nullptr;          // elements * dtypeSize(dtype) bytes, read then overwritten
  std::shared_ptr<void> keep_alive;   // owns `data` (a request body, a mapped region)
  std::function<bool()> still_valid;  // checked right before the bytes are touched (may be empty)
  /// Device memory (a CUDA IPC buffer, ipc/cuda_ipc.h) staged at `data`: `fetch` copies the
  /// gradient from the device into `data` right before the step reads it, `store` copies the
  /// result from `data` back to the device after the step, before the reply. Empty for host
  /// memory. false and a message on failure.
  std::function<bool(std::string*)> fetch, store;
  /// Device memory the pipeline may work on directly (the GPU backend, docs/cuda.md "Steps on the
  /// GPU"): when every trainer of a step gives one and the step's codec has a CUDA implementation,
  /// the step runs on trainer 0's GPU — the local sum (other GPUs' gradients copied over peer to
  /// peer), the statistics, compression and decompression on the device, only payloads crossing
  /// to the host — and `fetch`/`store` are not called. Otherwise the step stages through `data`.
  struct Device {
    int ordinal = -1;     // CUDA device ordinal in this process
    void* ptr = nullptr;  // elements * dtypeSize(dtype) bytes (the device's primary context)
    // Makes `stream` (a cudaStream_t of that device) wait, on the device, for the trainer's work
    // that produced the gradient (its IPC event). May be empty (nothing to wait for).
    std::function<bool(void* stream, std::string* error)> wait;
  };
  std::optional<Device> device;
};

/// Figures of a completed step (the JSON reply of docs/api.md).
struct StepFigures {
  std::string codec;
  uint64_t elements = 0, raw_bytes = 0, wire_bytes = 0;
  bool nonfinite = false, state_reset = false;
  std::string mode = "compressed";  // policies::stepModeName() of the step
  uint64_t settings = 0;            // the compression settings version it ran with
  std::string device = "cpu";       // where it ran: "cpu", or "cuda:<ordinal>" (the GPU backend)
  // The momentum the sidecar applies to this tensor (dgc's momentum correction; 0: none, the
  // trainer's optimizer owns momentum). A property of the tensor's codec, also on its dense steps.
  double momentum = 0.0;
  // `codec: auto`: the rung the step was sent with ("" for other codecs), and the job's direct
  // window when one was decided for steps after this one (docs/policies.md "codec: auto").
  std::string rung;
  std::optional<std::pair<uint64_t, uint64_t>> direct;
  double durations_us[metrics::kStageCount] = {};
};

/// Why a step failed (kNone: it did not). The control API maps each to its HTTP status and error
/// code (docs/api.md "Errors"); nothing below the API knows HTTP.
enum class StepError : uint8_t {
  kNone = 0,
  kInvalidArgument,   // a trainer index out of range
  kConflict,          // the part conflicts with another, the step went backwards or was overtaken
  kResumeMismatch,    // the sidecars resumed from different steps
  kLimitReached,      // limits.max_pending_steps
  kInternal,          // a codec failed on valid input (a bug)
  kDeviceError,       // a CUDA operation or a CUDA IPC buffer failed
  kExchangeFailed,    // the exchange with the other sidecars (or decoding what it returned)
  kShuttingDown,      // the sidecar is stopping
  kDeadlineExceeded,  // a local trainer never sent its part
  kStateLimit,        // limits.max_state_bytes
  kCancelled,         // its place in its stream was cancelled (POST /v1/cancel) or has passed
};

/// How a step ended for one trainer.
struct StepOutcome {
  StepError error = StepError::kNone;
  std::string message;
  StepFigures figures;
  bool ok() const { return error == StepError::kNone; }
};
using StepDone = std::function<void(StepOutcome)>;

/// The API name of a dtype ("float32", ...).
const char* apiDTypeName(kernels::DType t);

}  // namespace lightwire::proxy
