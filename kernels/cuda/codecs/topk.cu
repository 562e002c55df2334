// `topk` on the GPU (docs/determinism.md §4.3): the k elements of largest magnitude over the whole
// tensor, ties broken by lower index, less those below min_magnitude (§4.2), in the sparse layout.
// Byte-identical to kernels/codecs/topk.cc: analyze() decides the plan with the device exact
// top-k (kernels/cuda/codecs/sparse.cuh), encodeChunk() compacts and writes one chunk. No memory
// of its own: createCudaCodec wraps it in the CUDA error feedback by default, which decodes this
// codec's own payload with weight −1 (accumulate(), bit-exact with the CPU decoder).

#include <algorithm>
#include <memory>
#include <string>

#include "kernels/cuda/codecs/sparse.cuh"

namespace lightwire::kernels::cuda {
namespace {

using sparse::DeviceCarver;

/// The largest chunk of this chunking (a chunk size above n only ever serves n elements).
size_t largestChunk(const Chunking& c) { return std::min(c.chunk_elements, c.elements); }

class TopkCuda final : public sparse::SparseCudaCodec {
 public:
  TopkCuda(std::unique_ptr<Codec> host, double density)
      : SparseCudaCodec(std::move(host), CodecId::kTopk), density_(density) {}

  /// The plan and the exact selection's counters, then one chunk's encoding scratch.
  size_t workspaceBytes(const Chunking& c) const override {
    return sparse::kAlign + sparse::selectWsBytes(c.elements) +
           sparse::encodeWsBytes(largestChunk(c));
  }

 protected:
  Status doAnalyze(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                   DeviceState&, DeviceBytes workspace, cudaStream_t stream) const override {
    const size_t n = chunking.elements;
    double density = density_;
    if (ctx.density) {
      LW_RETURN_IF_ERROR(checkDensity(*ctx.density, "topk: step density"));
      density = *ctx.density;
    }
    DeviceCarver carver(workspace);
    const sparse::SelectWs ws = sparse::carveSelectWs(carver, n);
    const size_t k = selectionSize(n, density);
    cudaError_t e;
    if (n == 0) {
      e = sparse::setPlan(ws.state, 0, 0, /*none=*/true, stream);
    } else if (k >= n) {  // everything: key > 0, or key == 0 anywhere (selectExact)
      e = sparse::setPlan(ws.state, 0, n, /*none=*/false, stream);
    } else {
      e = sparse::exactTopk(input.data, input.dtype, n, k, ws, nullptr, stream);
    }
    if (e == cudaSuccess) e = sparse::applyMinKey(ws.state, min_key_, stream);
    return cudaStatus(e, "topk (cuda): selection");
  }

  Status doEncodeChunk(const StepContext&, const Chunking& chunking, size_t chunk, int,
                       std::span<const uint8_t>, DeviceTensor input, DeviceState&,
                       DeviceBytes workspace, uint8_t* d_out, uint64_t* d_size,
                       cudaStream_t stream) const override {
    const size_t begin = chunking.begin(chunk), len = chunking.size(chunk);
    LW_RETURN_IF_ERROR(checkChunk(len));
    DeviceCarver carver(workspace);
    const sparse::SelectWs sws = sparse::carveSelectWs(carver, chunking.elements);
    const sparse::EncodeWs ews = sparse::carveEncodeWs(carver, largestChunk(chunking));
    sparse::PlanArg plan;
    plan.dev = sws.state;
    return cudaStatus(sparse::encodeChunk(CodecId::kTopk, input.dtype, values_, plan, input, begin,
                                          len, ews, d_out, d_size, nullptr, nullptr, stream),
                      "topk (cuda): encoding a chunk");
  }

 private:
  double density_;
};

Result<std::unique_ptr<CudaCodec>> makeTopkCuda(std::unique_ptr<Codec> host) {
  auto density = configuredDensity(host->config(), "topk");
  if (!density) return density.status();
  return std::unique_ptr<CudaCodec>(new TopkCuda(std::move(host), *density));
}

}  // namespace

LW_REGISTER_CUDA_CODEC(topk, CodecId::kTopk, makeTopkCuda);

}  // namespace lightwire::kernels::cuda
