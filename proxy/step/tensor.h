#pragma once
// What the step engine keeps per tensor and per waiting step (internal to proxy/step: the engine,
// the pipeline and the checkpoints share it).

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "proxy/step/engine.h"
#include "proxy/step/host_backend.h"
#include "proxy/step/pipeline.h"

namespace lightwire::proxy {

namespace gpu {
class TensorGpu;
}

/// The parts of one (tensor, step) received so far. Under the engine's mutex.
struct StepEngine::Pending {
  std::vector<std::optional<Contribution>> parts;
  std::vector<StepDone> dones;
  unsigned arrived = 0;
  uint64_t elements = 0;
  kernels::DType dtype = kernels::DType::kF32;
  std::vector<uint64_t> shape;
  bool layer = false;
  std::string bucket;  // TensorSpec::bucket of the first part: the layers of one bucket run as one
  uint64_t layout_hash = 0;  // ... and its TensorSpec::layout_hash, bucket_layers
  uint32_t bucket_layers = 0;
  std::chrono::steady_clock::time_point deadline;
  bool queued = false;
  // Its place in its stream (TensorSpec::order, the same from every trainer), and, once queued,
  // until when it may wait there for the places before it.
  std::optional<StepOrder> order;
  std::chrono::steady_clock::time_point order_deadline;
};

/// One tensor: its codec, codec state and buffers (the pipeline's, on the engine thread) and its
/// step bookkeeping (under the engine's mutex).
struct StepEngine::Tensor {
  std::string name;
  // Engine thread only (no lock): the codec and its state.
  std::unique_ptr<kernels::Codec> codec;
  std::string config_key;
  kernels::CodecState state;
  uint64_t state_elements = 0;
  uint64_t state_floats = 0;  // the state's size when made or restored (host or device)
  kernels::DType state_dtype = kernels::DType::kF32;
  bool has_state = false;
  HostBuffers host;
  std::vector<std::vector<kernels::PayloadBuffer>> payloads;  // [round][chunk], reused
  std::vector<float> scratch;                                 // cosine sampling
  std::vector<float> original;           // cosine sampling on the GPU backend: the chunk's input
  std::optional<CosineTerms> cos;        // of the last committed compressed step
  std::optional<double> residual_norm2;  // of the state, last measured
  std::optional<bool> sparse_allreduce;  // peer.sparse auto: the last choice (logged when it moves)
  // The GPU backend (gpu_backend.h): the tensor's device resources, and whether its committed
  // codec state is there (then `state` is empty) rather than in `state`.
  std::shared_ptr<gpu::TensorGpu> gpu;
  bool state_on_gpu = false;
  struct {
    std::string group;
    prometheus::Gauge *ratio = nullptr, *cosine = nullptr, *residual = nullptr;
  } gauges;  // lightwire_*{group} of the tensor's group
  // Under mu_.
  std::optional<uint64_t> last_committed;
  std::optional<uint64_t> running;
  std::map<uint64_t, Pending> pending;
  std::string codec_name = "-";
  uint64_t elements = 0;
  kernels::DType dtype = kernels::DType::kF32;
  std::optional<uint64_t> last_step;
  uint64_t state_bytes = 0;
};

}  // namespace lightwire::proxy
