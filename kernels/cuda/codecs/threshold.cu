// `threshold` on the GPU (docs/determinism.md §4.8): every element with key(x) >= max(key(τ), K)
// (|x| >= τ in fp32, every NaN and ±Inf; K from min_magnitude), in the sparse layout of topk.
// The decision is local to each element, so analyze() has nothing to do and a chunk's encoding
// (kernels/cuda/codecs/sparse.cuh: compaction, gaps, values) reads only that chunk, with the plan
// passed by value. Byte-identical to kernels/codecs/threshold.cc; no memory of its own, error
// feedback by default (createCudaCodec).

#include <algorithm>
#include <limits>
#include <memory>

#include "kernels/cuda/codecs/sparse.cuh"

namespace lightwire::kernels::cuda {
namespace {

class ThresholdCuda final : public sparse::SparseCudaCodec {
 public:
  ThresholdCuda(std::unique_ptr<Codec> host, float tau)
      : SparseCudaCodec(std::move(host), CodecId::kThreshold),
        // min_magnitude (§4.2) only ever raises the key threshold.
        threshold_(std::max(magnitudeKey(tau), min_key_)) {}

  size_t workspaceBytes(const Chunking& c) const override {
    return sparse::kAlign + sparse::encodeWsBytes(std::min(c.chunk_elements, c.elements));
  }

 protected:
  Status doAnalyze(const StepContext&, const Chunking&, DeviceTensor, DeviceState&, DeviceBytes,
                   cudaStream_t) const override {
    return Status::ok();
  }

  Status doEncodeChunk(const StepContext&, const Chunking& chunking, size_t chunk, int,
                       std::span<const uint8_t>, DeviceTensor input, DeviceState&,
                       DeviceBytes workspace, uint8_t* d_out, uint64_t* d_size,
                       cudaStream_t stream) const override {
    const size_t begin = chunking.begin(chunk), len = chunking.size(chunk);
    LW_RETURN_IF_ERROR(checkChunk(len));
    sparse::DeviceCarver carver(workspace);
    const sparse::EncodeWs ews =
        sparse::carveEncodeWs(carver, std::min(chunking.chunk_elements, chunking.elements));
    sparse::PlanArg plan;
    plan.threshold = threshold_;
    plan.tie_end = std::numeric_limits<uint64_t>::max();  // every key == threshold is taken
    plan.none = 0;
    return cudaStatus(sparse::encodeChunk(CodecId::kThreshold, input.dtype, values_, plan, input,
                                          begin, len, ews, d_out, d_size, nullptr, nullptr, stream),
                      "threshold (cuda): encoding a chunk");
  }

 private:
  uint32_t threshold_;
};

Result<std::unique_ptr<CudaCodec>> makeThresholdCuda(std::unique_ptr<Codec> host) {
  // createCodec validated it: finite, > 0, and so is its fp32 rounding.
  const auto& t = host->config().threshold;
  if (!t) return invalidArgument("threshold (cuda): parameter 'threshold' is required");
  const float tau = static_cast<float>(*t);
  return std::unique_ptr<CudaCodec>(new ThresholdCuda(std::move(host), tau));
}

}  // namespace

LW_REGISTER_CUDA_CODEC(threshold, CodecId::kThreshold, makeThresholdCuda);

}  // namespace lightwire::kernels::cuda
