// The GPU backend in a build without the CUDA codecs (no CUDA toolkit at build time): no step is
// ever eligible, so the pipeline stages device memory through the host. GpuStep cannot be begun;
// its other methods are unreachable.

#include "proxy/step/gpu_backend.h"

namespace lightwire::proxy::gpu {

class TensorGpu {};

std::optional<int> eligibleDevice(std::span<const Contribution* const>, std::string_view) {
  return std::nullopt;
}
uint64_t stateBytes(const TensorGpu*) { return 0; }
uint64_t pooledDeviceBytes() { return 0; }
void keepPooledDeviceBytes(uint64_t) {}
uint64_t workAreaBytes(const kernels::CodecConfig&, size_t, std::span<const uint64_t>) { return 0; }
Result<kernels::CodecState> downloadState(TensorGpu&) {
  return failedPrecondition("this build has no GPU path");
}

struct GpuStep::Impl {};
GpuStep::GpuStep(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuStep::~GpuStep() = default;
Result<std::unique_ptr<GpuStep>> GpuStep::begin(std::shared_ptr<TensorGpu>&, int,
                                                const kernels::CodecConfig&,
                                                std::span<Contribution* const>, size_t,
                                                std::span<const uint64_t>, kernels::DType,
                                                const kernels::CodecState*) {
  return failedPrecondition("this build has no GPU path (built without the CUDA toolkit)");
}

namespace {
Status none() { return failedPrecondition("this build has no GPU path"); }
}  // namespace

std::string GpuStep::deviceName() const { return "cpu"; }
Status GpuStep::ingest() { return none(); }
Status GpuStep::accumulate() { return none(); }
Status GpuStep::addAccumulation() { return none(); }
Status GpuStep::flush(const kernels::StepContext&, const kernels::Chunking&) { return none(); }
Result<policies::StepStats> GpuStep::stats(double, bool) { return none(); }
Result<double> GpuStep::residualNorm2() { return none(); }
Status GpuStep::analyze(const kernels::StepContext&, const kernels::Chunking&, bool) {
  return none();
}
Result<std::span<const uint8_t>> GpuStep::encodeChunk(const kernels::StepContext&,
                                                      const kernels::Chunking&, size_t, int,
                                                      std::span<const uint8_t>,
                                                      kernels::PayloadBuffer&) {
  return none();
}
Result<const float*> GpuStep::chunkInput(const kernels::Chunking&, size_t, std::vector<float>&) {
  return none();
}
Status GpuStep::prepareResult(bool) { return none(); }
Status GpuStep::decodeChunk(const kernels::Chunking&, size_t,
                            std::span<const std::span<const uint8_t>>, bool, float) {
  return none();
}
Status GpuStep::decodeRounds(const kernels::StepContext&, const kernels::Chunking&,
                             std::span<const std::span<const uint8_t>>, float) {
  return none();
}
Result<bool> GpuStep::resultNonfinite() { return none(); }
Result<uint64_t> GpuStep::resultChecksum() { return none(); }
Status GpuStep::writeBack() { return none(); }
void GpuStep::commit(const Commit&) {}

}  // namespace lightwire::proxy::gpu
