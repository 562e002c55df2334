// The CUDA codec base (kernels/cuda/codec.h): argument checks, device state, the registry, the
// default host-side validation, the stateless flush and the error-feedback decorator.

#include <algorithm>
#include <map>
#include <mutex>

#include "kernels/cuda/codec.h"
#include "kernels/cuda/device.cuh"
#include "kernels/cuda/reduce.h"
#include "kernels/registry.h"
#include "kernels/tensor_args.h"

namespace lightwire::kernels::cuda {

Status cudaStatus(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return Status::ok();
  return internalError(std::string(what) + ": " + cudaGetErrorString(e));
}

// --- DeviceState
// ----------------------------------------------------------------------------------

Result<DeviceState> DeviceState::create(size_t floats, size_t work_floats) {
  DeviceState s;
  if (floats == 0) return Result<DeviceState>(std::move(s));
  const size_t bytes = floats * sizeof(float);
  void* a = nullptr;
  if (cudaError_t e = cudaMalloc(&a, bytes); e != cudaSuccess) {
    return cudaStatus(e, "codec state of " + std::to_string(bytes) + " bytes");
  }
  s.floats_ = floats;
  s.work_floats_ = work_floats;
  s.current_ = static_cast<float*>(a);
  cudaError_t e = cudaMemset(a, 0, bytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) return cudaStatus(e, "zeroing the codec state");
  return Result<DeviceState>(std::move(s));
}

DeviceState::~DeviceState() {
  cudaFree(current_);
  cudaFree(owned_work_);
}

DeviceState::DeviceState(DeviceState&& other) noexcept
    : floats_(other.floats_),
      work_floats_(other.work_floats_),
      current_(other.current_),
      owned_work_(other.owned_work_),
      lent_(other.lent_) {
  other.floats_ = other.work_floats_ = 0;
  other.current_ = other.owned_work_ = other.lent_ = nullptr;
}

DeviceState& DeviceState::operator=(DeviceState&& other) noexcept {
  if (this != &other) {
    cudaFree(current_);
    cudaFree(owned_work_);
    floats_ = other.floats_;
    work_floats_ = other.work_floats_;
    current_ = other.current_;
    owned_work_ = other.owned_work_;
    lent_ = other.lent_;
    other.floats_ = other.work_floats_ = 0;
    other.current_ = other.owned_work_ = other.lent_ = nullptr;
  }
  return *this;
}

Status DeviceState::ensureWork() {
  if (floats_ == 0 || work() != nullptr) return Status::ok();
  const size_t bytes = std::max<size_t>(work_floats_, 1) * sizeof(float);
  void* w = nullptr;
  if (cudaError_t e = cudaMalloc(&w, bytes); e != cudaSuccess) {
    return cudaStatus(e, "codec work area of " + std::to_string(bytes) + " bytes");
  }
  owned_work_ = static_cast<float*>(w);
  return Status::ok();
}

Status DeviceState::commit(cudaStream_t stream) {
  if (floats_ == 0) return Status::ok();
  if (work() == nullptr) return failedPrecondition("committing a codec state no step prepared");
  if (work_floats_ < floats_) {
    return failedPrecondition("the work area holds " + std::to_string(work_floats_) +
                              " floats of a state of " + std::to_string(floats_) +
                              ": its codec commits in place (CudaCodec::commitState)");
  }
  return cudaStatus(
      cudaMemcpyAsync(current_, work(), floats_ * sizeof(float), cudaMemcpyDeviceToDevice, stream),
      "committing the codec state");
}

Status DeviceState::reset(cudaStream_t stream) {
  if (floats_ == 0) return Status::ok();
  return cudaStatus(cudaMemsetAsync(current_, 0, floats_ * sizeof(float), stream),
                    "resetting the codec state");
}

Result<std::vector<float>> DeviceState::download(cudaStream_t stream) const {
  std::vector<float> host(floats_);
  if (floats_ == 0) return host;
  cudaError_t e = cudaMemcpyAsync(host.data(), current_, floats_ * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return cudaStatus(e, "copying the codec state to the host");
  return host;
}

Status DeviceState::upload(std::span<const float> current, cudaStream_t stream) {
  if (current.size() != floats_) {
    return invalidArgument("codec state holds " + std::to_string(floats_) +
                           " floats, the state to restore " + std::to_string(current.size()));
  }
  if (floats_ == 0) return Status::ok();
  cudaError_t e = cudaMemcpyAsync(current_, current.data(), floats_ * sizeof(float),
                                  cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  return cudaStatus(e, "copying the codec state to the device");
}

// --- CudaCodec
// ------------------------------------------------------------------------------------

namespace {

template <DType D>
__global__ void __launch_bounds__(kBlockThreads)
    widenKernel(const void* __restrict__ in, float* __restrict__ out, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = loadWidenedDevice<D>(in, i);
  }
}

/// a[i] = widen(x[i]) + e[i] (fp32, one rounding): error feedback's analyze (determinism.md §4.6).
template <DType D>
__global__ void __launch_bounds__(kBlockThreads)
    addResidualKernel(const void* __restrict__ x, const float* __restrict__ e,
                      float* __restrict__ a, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    a[i] = __fadd_rn(loadWidenedDevice<D>(x, i), e[i]);
  }
}

/// out[i] = widen(x[i]) + e[i]; en[i] = 0: error feedback's flush.
template <DType D>
__global__ void __launch_bounds__(kBlockThreads)
    flushResidualKernel(const void* __restrict__ x, const float* __restrict__ e,
                        float* __restrict__ out, float* __restrict__ en, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = __fadd_rn(loadWidenedDevice<D>(x, i), e[i]);
    en[i] = 0.0f;
  }
}

}  // namespace

Status CudaCodec::checkTensorArgs(const StepContext& ctx, const Chunking& chunking,
                                  DeviceTensor input, const DeviceState& state) const {
  return checkTensorValues(std::string(traits().name) + " (cuda)", chunking, input.elements,
                           input.dtype, input.data, host().chunkAlignment(), state.floats(),
                           stateFloats(chunking.elements, ctx.shape));
}

Status CudaCodec::analyze(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                          DeviceState& state, DeviceBytes workspace, cudaStream_t stream) const {
  LW_RETURN_IF_ERROR(checkTensorArgs(ctx, chunking, input, state));
  if (workspace.size < workspaceBytes(chunking) ||
      (workspace.data == nullptr && workspaceBytes(chunking) > 0)) {
    return invalidArgument(std::string(traits().name) + " (cuda): workspace of " +
                           std::to_string(workspace.size) + " bytes, the codec needs " +
                           std::to_string(workspaceBytes(chunking)));
  }
  LW_RETURN_IF_ERROR(checkWorkArea(ctx, chunking, state));
  LW_RETURN_IF_ERROR(state.ensureWork());
  return doAnalyze(ctx, chunking, input, state, workspace, stream);
}

Status CudaCodec::checkWorkArea(const StepContext& ctx, const Chunking& chunking,
                                const DeviceState& state) const {
  const size_t need = workFloats(chunking.elements, ctx.shape);
  if (state.floats() > 0 && state.workFloats() < need) {
    return invalidArgument(std::string(traits().name) + " (cuda): a work area of " +
                           std::to_string(state.workFloats()) + " floats, the codec works in " +
                           std::to_string(need));
  }
  return Status::ok();
}

Status CudaCodec::commitState(const StepContext&, const Chunking&, DeviceTensor,
                              std::span<const std::span<const uint8_t>>, DeviceState& state,
                              DeviceBytes, DeviceBytes, cudaStream_t stream) const {
  return state.commit(stream);
}

Status CudaCodec::commitFlush(DeviceState& state, cudaStream_t stream) const {
  return state.commit(stream);
}

Status CudaCodec::encodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk,
                              int round, std::span<const uint8_t> previous, DeviceTensor input,
                              DeviceState& state, DeviceBytes workspace, uint8_t* d_out,
                              uint64_t* d_size, cudaStream_t stream) const {
  LW_RETURN_IF_ERROR(checkTensorArgs(ctx, chunking, input, state));
  const std::string name = std::string(traits().name) + " (cuda)";
  if (workspace.size < workspaceBytes(chunking) ||
      (workspace.data == nullptr && workspaceBytes(chunking) > 0)) {
    return invalidArgument(name + ": workspace of " + std::to_string(workspace.size) +
                           " bytes, the codec needs " + std::to_string(workspaceBytes(chunking)));
  }
  LW_RETURN_IF_ERROR(checkChunkAndRound(name, chunking, chunk, round, traits().rounds));
  if (d_out == nullptr || d_size == nullptr) {
    return invalidArgument(name + ": payload or size pointer is null");
  }
  if (state.floats() > 0 && state.work() == nullptr) {
    return failedPrecondition(name + ": encodeChunk() before analyze() (no work area)");
  }
  return doEncodeChunk(ctx, chunking, chunk, round, previous, input, state, workspace, d_out,
                       d_size, stream);
}

Status CudaCodec::validate(std::span<const uint8_t> payload, size_t out_elements) const {
  // Complete but O(out_elements) on the host: codecs override it with structural checks.
  std::vector<float> sink(out_elements, 0.0f);
  return host().decodeChunk(payload, 1.0f, sink.data(), out_elements);
}

Status CudaCodec::decodeChunk(std::span<const uint8_t> payload, float weight, float* d_out,
                              size_t out_elements, DeviceBytes scratch, cudaStream_t stream) const {
  const std::string name = std::string(traits().name) + " (cuda)";
  if (out_elements > 0 && d_out == nullptr) return invalidArgument(name + ": output is null");
  if (scratch.size < decodeScratchBytes(payload.size(), out_elements) ||
      (scratch.data == nullptr && !payload.empty())) {
    return invalidArgument(name + ": decode scratch of " + std::to_string(scratch.size) +
                           " bytes, the payload needs " +
                           std::to_string(decodeScratchBytes(payload.size(), out_elements)));
  }
  LW_RETURN_IF_ERROR(validate(payload, out_elements));
  auto staged = stage(payload, scratch, stream, name + ": staging a payload");
  if (!staged) return staged.status();
  return accumulate(staged->payload, weight, d_out, out_elements, staged->rest, stream);
}

Result<CudaCodec::Staged> CudaCodec::stage(std::span<const uint8_t> payload, DeviceBytes scratch,
                                           cudaStream_t stream, const std::string& what) {
  auto* staged = static_cast<uint8_t*>(scratch.data);
  LW_RETURN_IF_ERROR(cudaStatus(
      cudaMemcpyAsync(staged, payload.data(), payload.size(), cudaMemcpyHostToDevice, stream),
      what));
  const size_t taken = stagedBytes(payload.size());
  return Staged{staged, DeviceBytes{staged + taken, scratch.size - taken}};
}

Status CudaCodec::flush(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                        DeviceState& state, float* d_out, cudaStream_t stream) const {
  LW_RETURN_IF_ERROR(checkTensorArgs(ctx, chunking, input, state));
  if (chunking.elements > 0 && d_out == nullptr) {
    return invalidArgument(std::string(traits().name) + " (cuda): flush output is null");
  }
  LW_RETURN_IF_ERROR(checkWorkArea(ctx, chunking, state));
  LW_RETURN_IF_ERROR(state.ensureWork());
  return doFlush(ctx, chunking, input, state, d_out, stream);
}

Status CudaCodec::doFlush(const StepContext&, const Chunking& chunking, DeviceTensor input,
                          DeviceState& state, float* d_out, cudaStream_t stream) const {
  const size_t n = chunking.elements;
  if (n > 0) {
    visitDeviceDType(input.dtype, [&](auto d) {
      widenKernel<decltype(d)::value>
          <<<blocksFor(n), kBlockThreads, 0, stream>>>(input.data, d_out, n);
    });
    LW_RETURN_IF_ERROR(cudaStatus(cudaGetLastError(), "flush"));
  }
  if (state.floats() > 0) {
    LW_RETURN_IF_ERROR(
        cudaStatus(cudaMemcpyAsync(state.work(), state.current(), state.floats() * sizeof(float),
                                   cudaMemcpyDeviceToDevice, stream),
                   "flush: copying the state"));
  }
  return Status::ok();
}

size_t CudaCodec::residualScratchBytes(size_t n) {
  return (canonicalBlocks(n) + 1) * sizeof(double);
}

Result<double> CudaCodec::residualNorm2(const DeviceState&, size_t, DeviceBytes,
                                        cudaStream_t) const {
  return 0.0;
}

Status CudaCodec::decodeRounds(std::span<const std::span<const uint8_t>> reduced_rounds,
                               float weight, float* d_out, size_t out_elements, DeviceBytes scratch,
                               cudaStream_t stream) const {
  if (reduced_rounds.size() != 1) {
    return invalidArgument(std::string(traits().name) + " has " + std::to_string(traits().rounds) +
                           " round(s), got " + std::to_string(reduced_rounds.size()) +
                           " reduced payloads");
  }
  return decodeChunk(reduced_rounds[0], weight, d_out, out_elements, scratch, stream);
}

Status CudaCodec::finishStep(const StepContext&, const Chunking&,
                             std::span<const std::span<const uint8_t>>, float, DeviceTensor,
                             DeviceState&, DeviceBytes, cudaStream_t) const {
  return Status::ok();
}

// --- canonical sum of squares of a device fp32 array (residual norms)
// ------------------------------

namespace {

Result<double> deviceSumSquares(const float* d_x, size_t n, DeviceBytes scratch,
                                cudaStream_t stream) {
  if (n == 0) return 0.0;
  if (scratch.size < CudaCodec::residualScratchBytes(n) || scratch.data == nullptr) {
    return invalidArgument("residual norm: scratch of " + std::to_string(scratch.size) +
                           " bytes, needs " + std::to_string(CudaCodec::residualScratchBytes(n)));
  }
  auto* sums = static_cast<double*>(scratch.data);
  double* total = sums + canonicalBlocks(n);
  LW_RETURN_IF_ERROR(
      cudaStatus(canonicalSum(d_x, DType::kF32, n, ReduceTerm::kSquare, sums, total, stream),
                 "residual norm"));
  double host = 0.0;
  cudaError_t e = cudaMemcpyAsync(&host, total, sizeof(double), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return cudaStatus(e, "residual norm");
  return host;
}

// --- error feedback
// -------------------------------------------------------------------------------

class CudaErrorFeedback final : public CudaCodec {
 public:
  CudaErrorFeedback(std::unique_ptr<CudaCodec> inner, std::unique_ptr<Codec> host)
      : inner_(std::move(inner)), host_(std::move(host)) {}

  const Codec& host() const override { return *host_; }

  /// The inner codec's workspace, then scratch for decoding its own payload (the residual).
  size_t workspaceBytes(const Chunking& c) const override {
    return align(inner_->workspaceBytes(c)) + inner_->accumulateScratchBytes(c.chunk_elements);
  }
  size_t accumulateScratchBytes(size_t n) const override {
    return inner_->accumulateScratchBytes(n);
  }
  Status accumulate(const uint8_t* d_payload, float weight, float* d_out, size_t n,
                    DeviceBytes scratch, cudaStream_t stream) const override {
    return inner_->accumulate(d_payload, weight, d_out, n, scratch, stream);
  }
  Status validate(std::span<const uint8_t> payload, size_t n) const override {
    return inner_->validate(payload, n);
  }

  Result<double> residualNorm2(const DeviceState& state, size_t n, DeviceBytes scratch,
                               cudaStream_t stream) const override {
    if (n == 0 || state.floats() != stateFloats(n)) return 0.0;
    return deviceSumSquares(state.current(), n, scratch, stream);
  }

 protected:
  Status doAnalyze(const StepContext& ctx, const Chunking& chunking, DeviceTensor input,
                   DeviceState& state, DeviceBytes workspace, cudaStream_t stream) const override {
    const size_t n = chunking.elements;
    if (n > 0) {
      visitDeviceDType(input.dtype, [&](auto d) {
        addResidualKernel<decltype(d)::value><<<blocksFor(n), kBlockThreads, 0, stream>>>(
            input.data, state.current(), state.work(), n);
      });
      LW_RETURN_IF_ERROR(cudaStatus(cudaGetLastError(), "error feedback"));
    }
    DeviceState none;
    return inner_->analyze(ctx, chunking, DeviceTensor{state.work(), n, DType::kF32}, none,
                           innerWorkspace(chunking, workspace), stream);
  }

  Status doEncodeChunk(const StepContext& ctx, const Chunking& chunking, size_t chunk, int round,
                       std::span<const uint8_t> previous, DeviceTensor input, DeviceState& state,
                       DeviceBytes workspace, uint8_t* d_out, uint64_t* d_size,
                       cudaStream_t stream) const override {
    DeviceState none;
    float* a = state.work();
    LW_RETURN_IF_ERROR(inner_->encodeChunk(
        ctx, chunking, chunk, round, previous, DeviceTensor{a, chunking.elements, DType::kF32},
        none, innerWorkspace(chunking, workspace), d_out, d_size, stream));
    // The header names what the trainer handed in (byte 4: dtype), as on the CPU.
    LW_RETURN_IF_ERROR(cudaStatus(
        cudaMemsetAsync(d_out + 4, static_cast<int>(input.dtype), 1, stream), "error feedback"));
    // e' = a − decoded: decoding with weight −1 subtracts exactly what the payload carries.
    const size_t inner_bytes = align(inner_->workspaceBytes(chunking));
    Status s = inner_->accumulate(d_out, -1.0f, a + chunking.begin(chunk), chunking.size(chunk),
                                  DeviceBytes{static_cast<uint8_t*>(workspace.data) + inner_bytes,
                                              workspace.size - inner_bytes},
                                  stream);
    if (!s.isOk()) {
      return internalError("error feedback could not decode its own payload: " + s.message());
    }
    return Status::ok();
  }

  Status doFlush(const StepContext&, const Chunking& chunking, DeviceTensor input,
                 DeviceState& state, float* d_out, cudaStream_t stream) const override {
    const size_t n = chunking.elements;
    if (n == 0) return Status::ok();
    visitDeviceDType(input.dtype, [&](auto d) {
      flushResidualKernel<decltype(d)::value><<<blocksFor(n), kBlockThreads, 0, stream>>>(
          input.data, state.current(), d_out, state.work(), n);
    });
    return cudaStatus(cudaGetLastError(), "error feedback flush");
  }

 private:
  static size_t align(size_t b) { return (b + 255) & ~size_t{255}; }
  DeviceBytes innerWorkspace(const Chunking& c, DeviceBytes ws) const {
    return DeviceBytes{ws.data, inner_->workspaceBytes(c)};
  }

  std::unique_ptr<CudaCodec> inner_;
  std::unique_ptr<Codec> host_;
};

// --- registry
// -------------------------------------------------------------------------------------

struct Registry {
  std::mutex mutex;
  std::map<CodecId, CudaCodecFactory> factories;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

std::unique_ptr<CudaCodec> makeCudaErrorFeedback(std::unique_ptr<CudaCodec> inner,
                                                 std::unique_ptr<Codec> host_with_ef) {
  return std::make_unique<CudaErrorFeedback>(std::move(inner), std::move(host_with_ef));
}

Status registerCudaCodec(CodecId id, CudaCodecFactory factory) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  if (!r.factories.emplace(id, std::move(factory)).second) {
    return internalError("CUDA codec " + codecIdName(id) + " registered twice");
  }
  return Status::ok();
}

namespace {
Result<CudaCodecFactory> factoryFor(CodecId id) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  auto it = r.factories.find(id);
  if (it == r.factories.end()) {
    return failedPrecondition("codec '" + codecIdName(id) + "' has no CUDA implementation");
  }
  return it->second;
}
}  // namespace

bool hasCudaCodec(std::string_view name) {
  for (const std::string& n : cudaCodecNames()) {
    if (n == name) return true;
  }
  return false;
}

std::vector<std::string> cudaCodecNames() {
  std::vector<std::string> names;
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  for (const auto& [id, f] : r.factories) names.push_back(codecIdName(id));
  std::sort(names.begin(), names.end());
  return names;
}

Result<std::unique_ptr<CudaCodec>> createCudaCodec(const CodecConfig& config) {
  auto full = createCodec(config);  // validates the configuration exactly as the CPU does
  if (!full) return full.status();
  auto factory = factoryFor((*full)->traits().id);
  if (!factory) return factory.status();
  const bool wrapped =
      (*full)->config().error_feedback.value_or(false) && !(*full)->traits().own_memory;
  CodecConfig bare = config;
  if (wrapped) bare.error_feedback = false;
  auto inner_host = wrapped ? createCodec(bare) : std::move(full);
  if (!inner_host) return inner_host.status();
  auto inner = (*factory)(std::move(*inner_host));
  if (!inner || !wrapped) return inner;
  auto host_with_ef = createCodec(config);
  if (!host_with_ef) return host_with_ef.status();
  return makeCudaErrorFeedback(std::move(*inner), std::move(*host_with_ef));
}

detail::CudaCodecRegistrar::CudaCodecRegistrar(CodecId id, CudaCodecFactory factory) {
  Status s = registerCudaCodec(id, std::move(factory));
  if (!s.isOk()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    std::abort();
  }
}

}  // namespace lightwire::kernels::cuda
