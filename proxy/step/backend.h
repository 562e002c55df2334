#pragma once
// The backend seam of the step pipeline (docs/architecture.md "Seams"): every data operation of
// one step of one tensor, from the local sum to the commit, done either on the host
// (host_backend.h) or on trainer 0's GPU (gpu_backend.h). The pipeline (pipeline.h) owns the
// control flow — policies, exchange rounds, the silent-divergence guard, checkpoints asked for
// by peers — and calls these in one order on both. Both backends use codecs that are byte-identical
// (docs/cuda.md "The CUDA codecs"), so a step gives the same result bits and the same codec state
// on either, and a tensor may move between them.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/buffer.h"
#include "kernels/codec.h"
#include "kernels/status.h"
#include "policies/stats.h"
#include "proxy/step/step.h"

namespace lightwire::proxy {

/// One step's data operations. Created for one step and dropped at its end; the tensor's
/// persistent buffers and codec state live with the tensor, not here. Methods are called from the
/// pipeline's thread, except encodeChunk() and decodeChunk(), which the exchange may call from its
/// own threads (one chunk each) while run() is in progress.
class StepBackend {
 public:
  virtual ~StepBackend() = default;

  /// "cpu", or "cuda:<ordinal>".
  virtual std::string deviceName() const = 0;
  /// The error a failed data operation of this backend is reported as (kInternal on the host:
  /// a codec bug; kDeviceError on the GPU).
  virtual StepError failure() const = 0;

  /// Ingest: the step's input is the fp32 sum of the trainers' tensors in trainer order (the
  /// single fp32 trainer's memory itself).
  virtual Status ingest() = 0;
  /// Delayed sync, a step that is not exchanged: the input is added to the tensor's accumulation
  /// and every trainer's result is zeros.
  virtual Status accumulate() = 0;
  /// Delayed sync, the exchange step: the input becomes input + the accumulation (cleared by
  /// commit()).
  virtual Status addAccumulation() = 0;
  /// Full sync: the input becomes input + what the codec state holds back; prepares the flushed
  /// state.
  virtual Status flush(const kernels::StepContext& ctx, const kernels::Chunking& chunking) = 0;

  /// This step's statistics record fields (elements, grad_norm2, nonfinite, small).
  virtual Result<policies::StepStats> stats(double min_magnitude, bool count_small) = 0;
  /// What the committed codec state holds back (the codec's residualNorm2).
  virtual Result<double> residualNorm2() = 0;

  /// Compression, as Codec::analyze and encodeChunk, with the tensor's codec (`dense`: codec
  /// `none` and no state, for bypass and full-sync steps). The chunk's payload lies in `out`
  /// (resized to hold it) and is returned.
  virtual Status analyze(const kernels::StepContext& ctx, const kernels::Chunking& chunking,
                         bool dense) = 0;
  virtual Result<std::span<const uint8_t>> encodeChunk(const kernels::StepContext& ctx,
                                                       const kernels::Chunking& chunking,
                                                       size_t chunk, int round,
                                                       std::span<const uint8_t> previous,
                                                       kernels::PayloadBuffer& out) = 0;
  /// Global selection (docs/exchange.md "Sparse allreduce"): whether this backend settles chunks
  /// (the commit applies only what the selection kept); the pipeline asks the exchange for a
  /// sparse allreduce only then.
  virtual bool settlesChunks() const { return false; }
  /// Codec::checkSelection with the step codec: chunk `chunk` was encoded with ctx.defer_sent,
  /// `sent` is its payload, `selected` the chunk's global selection (both kept by the pipeline
  /// until commit(), which settles them).
  virtual Status checkSelection(const kernels::Chunking& /*chunking*/, size_t /*chunk*/,
                                std::span<const uint8_t> /*sent*/,
                                std::span<const uint8_t> /*selected*/) {
    return failedPrecondition("this backend does not settle a global selection");
  }
  /// The input values of chunk `chunk` on the host (cosine sampling); may use `scratch`.
  virtual Result<const float*> chunkInput(const kernels::Chunking& chunking, size_t chunk,
                                          std::vector<float>& scratch) = 0;

  /// The step's fp32 input in host memory, what the codec encodes (nullptr: it is not on the host,
  /// the GPU backend). Valid until the result is written (it may be the result's memory).
  virtual const float* hostInput() const { return nullptr; }

  /// Where the result goes: the single fp32 trainer's memory when `in_place` and the step's commit
  /// does not read the input (the host backend's codec state is updated from it at commit), else
  /// a buffer.
  virtual Status prepareResult(bool in_place) = 0;
  /// Whether decodeChunk() may be called from the exchange's threads while it runs, so decoding
  /// overlaps the exchange (ExchangeRound::on_chunk).
  virtual bool decodesDuringExchange() const = 0;
  /// Result range of chunk `chunk` = sum of weight · decoded payloads, in list order; `dense`:
  /// the payloads are plain fp32 (codec `none`). An error names what is wrong with a payload.
  virtual Status decodeChunk(const kernels::Chunking& chunking, size_t chunk,
                             std::span<const std::span<const uint8_t>> payloads, bool dense,
                             float weight) = 0;
  /// decodeChunk() of every chunk c with !done[c]; an error message starts with "chunk c: " of
  /// the first chunk that failed. Default: one after the other.
  virtual Status decodeChunks(const kernels::Chunking& chunking,
                              std::span<const std::vector<std::span<const uint8_t>>> lists,
                              std::span<const char> done, bool dense, float weight);
  /// Multi-round codecs: result = decodeRounds(...), then finishStep(...) on the tensor's state.
  virtual Status decodeRounds(const kernels::StepContext& ctx, const kernels::Chunking& chunking,
                              std::span<const std::span<const uint8_t>> rounds, float weight) = 0;
  /// Whether the result holds a NaN or an infinity.
  virtual Result<bool> resultNonfinite() = 0;
  /// XXH3-64 of the result's fp32 bytes (the silent-divergence guard).
  virtual Result<uint64_t> resultChecksum() = 0;
  /// Every trainer's tensor = the result in its dtype. A backend whose commit still reads the
  /// input where it is a trainer's own memory may leave the copy to commit(), which cannot fail.
  virtual Status writeBack() = 0;
  /// What commit() applies: whether the codec state takes the step (false: a bypass, or a result
  /// that is not finite), this sidecar's round-0 payload of every chunk, and with a global
  /// selection each chunk's selection (else empty). The spans stay valid during commit().
  struct Commit {
    bool state = false;
    std::span<const std::span<const uint8_t>> sent;
    std::span<const std::span<const uint8_t>> selected;
  };
  /// The step succeeded: commit the codec state (Commit::state), finish a write-back writeBack()
  /// left to it, and clear what delayed sync accumulated (when it was added). It cannot fail, so
  /// the layers of a bucket, written back first, commit all or none (docs/architecture.md "A
  /// bucket's layers: one step").
  virtual void commit(const Commit& c) = 0;
};

}  // namespace lightwire::proxy
