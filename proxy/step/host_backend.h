#pragma once
// The host backend of the step pipeline (backend.h): every data operation of a step on the CPU,
// with the SIMD codecs of kernels/ on the engine's thread pool. Device memory of trainers is
// staged through their host buffers before it gets here (Contribution::fetch).

#include <atomic>
#include <cstddef>
#include <vector>

#include "kernels/buffer.h"
#include "kernels/codec.h"
#include "kernels/parallel.h"
#include "proxy/step/backend.h"
#include "proxy/step/step_pool.h"

namespace lightwire::proxy {

/// Host memory a tensor keeps from one step to the next (allocated once, not every step), and what
/// delayed sync accumulated. Owned by the tensor; not thread-safe. The buffers of the size of the
/// tensor that only a step needs (the result, the local sum, the flushed input) come from the
/// engine's StepPool instead, shared by every tensor.
struct HostBuffers {
  kernels::WorkspaceBuffer workspace;  // sized to the bound, touched where used
  std::vector<float> accum;            // delayed sync: accumulated since the last exchange step
  std::vector<double> blocks;          // block sums of the statistics' norm
};

/// Which of a host step's buffers of tensor size come from the pool (docs/deploy.md "Sizing"):
/// the input is one fp32 trainer's own memory, or a local sum; the result is decoded into that
/// memory only for one round and when no codec state reads the input at commit.
inline bool inputIsTrainers(size_t trainers, kernels::DType dtype) {
  return trainers == 1 && dtype == kernels::DType::kF32;
}
inline bool resultInPlace(size_t trainers, kernels::DType dtype, int rounds,
                          bool state_reads_input) {
  return inputIsTrainers(trainers, dtype) && rounds == 1 && !state_reads_input;
}

/// One step on the host. Not copyable; lives for one step.
class HostBackend final : public StepBackend {
 public:
  /// `codec` and `state`: the tensor's codec and its state (prepared in place, committed by
  /// commit()); `parts`: every local trainer's contribution, in trainer order (host memory).
  /// `pool`: where the step's result, local sum and flushed input come from (given back when
  /// the backend goes).
  HostBackend(kernels::CpuStream& stream, const kernels::Codec& codec, kernels::CodecState& state,
              HostBuffers& buffers, StepPool& pool, std::vector<Contribution*> parts, size_t n,
              kernels::DType dtype);
  ~HostBackend() override;

  std::string deviceName() const override { return "cpu"; }
  StepError failure() const override { return StepError::kInternal; }
  Status ingest() override;
  Status accumulate() override;
  Status addAccumulation() override;
  Status flush(const kernels::StepContext& ctx, const kernels::Chunking& chunking) override;
  Result<policies::StepStats> stats(double min_magnitude, bool count_small) override;
  Result<double> residualNorm2() override;
  Status analyze(const kernels::StepContext& ctx, const kernels::Chunking& chunking,
                 bool dense) override;
  Result<std::span<const uint8_t>> encodeChunk(const kernels::StepContext& ctx,
                                               const kernels::Chunking& chunking, size_t chunk,
                                               int round, std::span<const uint8_t> previous,
                                               kernels::PayloadBuffer& out) override;
  bool settlesChunks() const override { return true; }
  Status checkSelection(const kernels::Chunking& chunking, size_t chunk,
                        std::span<const uint8_t> sent, std::span<const uint8_t> selected) override;
  Result<const float*> chunkInput(const kernels::Chunking& chunking, size_t chunk,
                                  std::vector<float>& scratch) override;
  Status prepareResult(bool in_place) override;
  bool decodesDuringExchange() const override { return true; }
  Status decodeChunk(const kernels::Chunking& chunking, size_t chunk,
                     std::span<const std::span<const uint8_t>> payloads, bool dense,
                     float weight) override;
  Status decodeChunks(const kernels::Chunking& chunking,
                      std::span<const std::vector<std::span<const uint8_t>>> lists,
                      std::span<const char> done, bool dense, float weight) override;
  Status decodeRounds(const kernels::StepContext& ctx, const kernels::Chunking& chunking,
                      std::span<const std::span<const uint8_t>> rounds, float weight) override;
  Result<bool> resultNonfinite() override { return nonfinite_.load(); }
  Result<uint64_t> resultChecksum() override;
  Status writeBack() override;
  void commit(const Commit& c) override;
  const float* hostInput() const override { return input_; }

 private:
  const kernels::Codec& stepCodec() const;
  kernels::CodecState& stepState();
  kernels::ConstTensor input() const { return {input_, n_, kernels::DType::kF32}; }
  /// Records whether result[lo, hi) holds an Inf or a NaN.
  void scan(size_t lo, size_t hi);
  /// The trainers' tensors = the result.
  void copyResult();
  /// Whether commit() updates the codec state from the input (a compressed step of a codec with
  /// state): then the input must stay as it is until the commit.
  bool stateReadsInput() const { return !dense_ && !flushed_ && state_.floats() > 0; }

  kernels::CpuStream& stream_;
  const kernels::Codec& codec_;
  kernels::CodecState& state_;
  kernels::CodecState no_state_;  // dense steps: codec `none` keeps nothing
  HostBuffers& buf_;
  StepPool& pool_;
  PooledFloats result_buf_;   // the result, when it is not decoded in place; before it, the
                              // codec's work area (CodecState::work)
  PooledFloats sum_buf_;      // the local sum, when it is not one fp32 trainer's memory
  PooledFloats flushed_buf_;  // full sync: input plus what the codec state held back
  std::vector<Contribution*> parts_;
  size_t n_;
  kernels::DType dtype_;
  const float* input_ = nullptr;
  float* result_ = nullptr;
  bool in_place_ = false;
  bool dense_ = false;
  bool flushed_ = false;             // flush() ran: commit() leaves the state as after a flush
  bool write_back_pending_ = false;  // writeBack() left the copy to commit()
  kernels::StepContext ctx_;         // of analyze(), for commit()
  kernels::Chunking chunking_;
  /// The tensor's delayed-sync accumulation, made (zeros) on first use.
  std::vector<float>& accumulation();
  bool accumulated_ = false;  // addAccumulation() ran: commit() clears the accumulation
  std::atomic<bool> nonfinite_{false};
};

}  // namespace lightwire::proxy
