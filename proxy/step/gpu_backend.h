#pragma once
// The GPU backend of the step pipeline (backend.h; docs/cuda.md "Steps on the GPU"): the data
// operations of steps whose trainers all hand device memory (Contribution::device), on trainer
// 0's GPU with the CUDA codecs, which are byte-identical to the CPU codecs: a step gives the same
// result bits and the same codec state as on the host backend, and a tensor may move between
// them (its state is copied across once when it does).
//
// No CUDA type appears here: the pipeline compiles the same with or without the CUDA toolkit.
// gpu_backend_cuda.cc implements it; gpu_backend_none.cc (builds without the CUDA codecs) says
// it is not compiled in.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/codec.h"
#include "policies/stats.h"
#include "proxy/step/backend.h"

namespace lightwire::proxy::gpu {

/// A tensor's device resources (buffers, codec state, CUDA codecs), kept between its steps.
class TensorGpu;

/// The GPU a step runs on — trainer 0's — when every part gives device memory (on any GPU of
/// this node: the others' gradients are copied there peer to peer and their results back) and
/// codec `codec` (and `none`, for dense steps) has a CUDA implementation; nullopt otherwise.
std::optional<int> eligibleDevice(std::span<const Contribution* const> parts,
                                  std::string_view codec);

/// Device bytes of the codec state `tg` holds (0 for none): one copy, the committed state.
uint64_t stateBytes(const TensorGpu* tg);
/// Device bytes of step buffers kept for the next steps (docs/cuda.md "Memory"): work areas, local
/// sums, results, flushed inputs, copies of other GPUs' gradients, which a step borrows for its
/// duration; the node's GPUs together.
uint64_t pooledDeviceBytes();
/// At most `bytes` of step buffers stay in the device pool between steps (limits.max_pool_bytes,
/// the node's GPUs together); one given back beyond it is freed. Applies from the next give-back.
void keepPooledDeviceBytes(uint64_t bytes);
/// Device bytes of a step's work area for a tensor of `n` elements and `shape` with codec
/// `config` (the CUDA codec's CudaCodec::workFloats; 0 when the codec has no CUDA implementation
/// or no state).
uint64_t workAreaBytes(const kernels::CodecConfig& config, size_t n,
                       std::span<const uint64_t> shape);
/// The committed codec state `tg` holds, copied to the host (a checkpoint, or the tensor moving
/// to the host backend).
Result<kernels::CodecState> downloadState(TensorGpu& tg);

/// One step of one tensor on the GPU. Every method is safe to call from any thread (one at a
/// time: they serialise) and reports a CUDA failure as an error (StepError::kDeviceError).
class GpuStep final : public StepBackend {
 public:
  /// Prepares `tg` (created, or re-created when the device changed) for a step of `n` elements of
  /// `dtype` from `parts` on GPU `ordinal` with codec `config`, and makes the step's stream wait
  /// for every trainer's gradient. `host_state`: the tensor's committed state when it is on the
  /// host (moved to the device when sized for this codec and `shape`; fresh zeros otherwise),
  /// null when `tg` holds it already.
  static Result<std::unique_ptr<GpuStep>> begin(std::shared_ptr<TensorGpu>& tg, int ordinal,
                                                const kernels::CodecConfig& config,
                                                std::span<Contribution* const> parts, size_t n,
                                                std::span<const uint64_t> shape,
                                                kernels::DType dtype,
                                                const kernels::CodecState* host_state);
  ~GpuStep() override;
  GpuStep(const GpuStep&) = delete;
  GpuStep& operator=(const GpuStep&) = delete;

  std::string deviceName() const override;
  StepError failure() const override { return StepError::kDeviceError; }
  Status ingest() override;
  /// Delayed-sync tensors stay on the host (their accumulation lives there, with checkpoints):
  /// the pipeline never picks the GPU for them.
  Status accumulate() override;
  Status addAccumulation() override;
  Status flush(const kernels::StepContext& ctx, const kernels::Chunking& chunking) override;
  /// Bit for bit as the host backend's.
  Result<policies::StepStats> stats(double min_magnitude, bool count_small) override;
  Result<double> residualNorm2() override;
  Status analyze(const kernels::StepContext& ctx, const kernels::Chunking& chunking,
                 bool dense) override;
  Result<std::span<const uint8_t>> encodeChunk(const kernels::StepContext& ctx,
                                               const kernels::Chunking& chunking, size_t chunk,
                                               int round, std::span<const uint8_t> previous,
                                               kernels::PayloadBuffer& out) override;
  Result<const float*> chunkInput(const kernels::Chunking& chunking, size_t chunk,
                                  std::vector<float>& scratch) override;
  Status prepareResult(bool in_place) override;
  /// No: a device decode is brief, and the exchange's threads would have to take turns with the
  /// pipeline's on the device.
  bool decodesDuringExchange() const override { return false; }
  /// Payloads are validated on the host first.
  Status decodeChunk(const kernels::Chunking& chunking, size_t chunk,
                     std::span<const std::span<const uint8_t>> payloads, bool dense,
                     float weight) override;
  Status decodeRounds(const kernels::StepContext& ctx, const kernels::Chunking& chunking,
                      std::span<const std::span<const uint8_t>> rounds, float weight) override;
  Result<bool> resultNonfinite() override;
  Result<uint64_t> resultChecksum() override;
  /// Waits until the result is in place.
  Status writeBack() override;
  void commit(const Commit& c) override;

 private:
  struct Impl;
  explicit GpuStep(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace lightwire::proxy::gpu
