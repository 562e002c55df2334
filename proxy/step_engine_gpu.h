#pragma once
// The step engine's GPU path (docs/cuda.md "Steps on the GPU"): the device half of
// StepEngine::execute() for steps whose trainers all hand device memory (Contribution::device).
// The engine keeps the control flow (policies, exchange rounds, commit); GpuStep does each data
// operation on the device with the CUDA codecs, which are byte-identical to the CPU codecs, so a
// step gives the same result bits and the same codec state on either path and a tensor may move
// between them (its state is copied across once when it does).
//
// No CUDA type appears here: the engine compiles the same with or without the CUDA toolkit.
// step_engine_cuda.cc implements it; step_engine_nogpu.cc (builds without the CUDA codecs) says
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
#include "proxy/step_engine.h"

namespace lightwire::proxy::gpu {

/// A tensor's device resources (buffers, codec state, CUDA codecs), kept between its steps.
class TensorGpu;

/// The GPU a step runs on — trainer 0's — when every part gives device memory (on any GPU of
/// this node: the others' gradients are copied there peer to peer and their results back) and
/// codec `codec` (and `none`, for dense steps) has a CUDA implementation; nullopt otherwise.
std::optional<int> eligibleDevice(std::span<const Contribution* const> parts,
                                  std::string_view codec);

/// Device bytes of the codec state `tg` holds (0 for none).
uint64_t stateBytes(const TensorGpu* tg);
/// The committed codec state `tg` holds, copied to the host (a checkpoint, or the tensor moving
/// to the host path).
Result<kernels::CodecState> downloadState(TensorGpu& tg);

/// One step of one tensor on the GPU. Every method is safe to call from any thread (one at a
/// time: they serialise) and reports a CUDA failure as an error for a 500 device_error.
class GpuStep {
 public:
  /// Prepares `tg` (created, or re-created when the device changed) for a step of `n` elements of
  /// `dtype` from `parts` on GPU `ordinal` with codec `config`, and makes the step's stream wait
  /// for every trainer's gradient. `host_state`: the tensor's committed state when it is on the
  /// host (moved to the device when sized for this codec; fresh zeros otherwise), null when `tg`
  /// holds it already.
  static Result<std::unique_ptr<GpuStep>> begin(std::shared_ptr<TensorGpu>& tg, int ordinal,
                                                const kernels::CodecConfig& config,
                                                std::span<Contribution* const> parts, size_t n,
                                                kernels::DType dtype,
                                                const kernels::CodecState* host_state);
  ~GpuStep();
  GpuStep(const GpuStep&) = delete;
  GpuStep& operator=(const GpuStep&) = delete;

  /// "cuda:<ordinal>".
  std::string deviceName() const;

  /// Ingest: the step's input is the fp32 sum of the trainers' tensors in trainer order (the
  /// single fp32 trainer's memory itself).
  Status ingest();
  /// Full sync: input = input + what the codec state holds back; prepares the flushed state.
  Status flush(const kernels::StepContext& ctx, const kernels::Chunking& chunking);

  /// This step's statistics, bit for bit as the CPU engine's (elements, grad_norm2, nonfinite,
  /// small).
  Result<policies::StepStats> stats(double min_magnitude, bool count_small);
  /// What the committed codec state holds back (the codec's residualNorm2).
  Result<double> residualNorm2();

  /// Compression with the tensor's codec (`dense`: codec `none`, no state), as Codec::analyze and
  /// encodeChunk; the chunk's payload is copied into `out` (resized to hold it) and returned.
  Status analyze(const kernels::StepContext& ctx, const kernels::Chunking& chunking, bool dense);
  Result<std::span<const uint8_t>> encodeChunk(const kernels::StepContext& ctx,
                                               const kernels::Chunking& chunking, size_t chunk,
                                               int round, std::span<const uint8_t> previous,
                                               std::vector<uint8_t>& out);
  /// The input values of chunk `chunk` on the host (cosine sampling).
  Status chunkInput(const kernels::Chunking& chunking, size_t chunk, std::vector<float>& out);

  /// Where the result goes: the single fp32 trainer's memory when `in_place`, else a buffer.
  Status prepareResult(bool in_place);
  /// Result range of chunk `chunk` = sum of weight · decoded payloads (validated on the host);
  /// `dense`: the payloads are plain fp32 (codec `none`).
  Status decodeChunk(const kernels::Chunking& chunking, size_t chunk,
                     std::span<const std::span<const uint8_t>> payloads, bool dense, float weight);
  /// Multi-round codecs: result = decodeRounds(...), then finishStep(...) on the tensor's state.
  Status decodeRounds(const kernels::StepContext& ctx, const kernels::Chunking& chunking,
                      std::span<const std::span<const uint8_t>> rounds, float weight);
  /// Whether the result holds a NaN or an infinity.
  Result<bool> resultNonfinite();
  /// XXH3-64 of the result's fp32 bytes (the silent-divergence guard).
  Result<uint64_t> resultChecksum();
  /// Every trainer's tensor = the result in its dtype; waits until it is in place.
  Status writeBack();
  /// The step succeeded: commit the codec state (when `state`).
  Status commit(bool state);

 private:
  struct Impl;
  explicit GpuStep(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace lightwire::proxy::gpu
