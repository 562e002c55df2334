// The GPU backend of the step pipeline (proxy/step/gpu_backend.h): the data operations of a step
// on the device, with the CUDA codecs (kernels/cuda/codec.h) and the element-wise kernels of
// kernels/cuda/engine_ops.h. Each operation is the device counterpart of the host backend's
// (proxy/step/host_backend.h), bit for bit. Only payloads cross to the host (and, on the steps that
// need them, a sampled chunk for the cosine and the result for the divergence checksum).

#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include "kernels/cuda/codec.h"
#include "kernels/cuda/engine_ops.h"
#include "kernels/cuda/reduce.h"
#include "kernels/registry.h"
#include "kernels/reuse.h"
#include "proxy/step/gpu_backend.h"

namespace lightwire::proxy::gpu {
namespace {

namespace kc = kernels::cuda;
using kernels::DType;

Status deviceError(cudaError_t e, const std::string& what) {
  return kc::cudaStatus(e, "GPU path: " + what);
}

/// Grow-only device memory of one GPU. Movable (the pool keeps them by value); its device
/// pointer stays the same when it moves.
class DeviceBuffer {
 public:
  using value_type = std::byte;  // kernels::takeReused counts capacity() bytes
  DeviceBuffer() = default;
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      cudaFree(data_);
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }

  Status ensure(size_t bytes, const char* what) {
    if (bytes <= size_) return Status::ok();
    cudaFree(data_);
    data_ = nullptr;
    size_ = 0;
    if (cudaError_t e = cudaMalloc(&data_, bytes); e != cudaSuccess) {
      data_ = nullptr;
      return deviceError(e, std::string(what) + " of " + std::to_string(bytes) + " bytes");
    }
    size_ = bytes;
    return Status::ok();
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  kc::DeviceBytes bytes() const { return {data_, size_}; }
  size_t size() const { return size_; }
  size_t capacity() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

/// The step buffers of the node's GPUs (docs/cuda.md "Memory"): the codec state's work area, the
/// local sum, the result, a full sync's flushed input and the copies of other GPUs' gradients. A
/// step borrows them for its duration, so device memory holds those of the steps in flight, not
/// a set per tensor. A borrower gets the free buffer of its GPU that kernels::takeReused picks
/// (the smallest that holds what it needs, else the largest, grown); buffers go back when the
/// step ends, once its stream has drained, and are freed there when the pool would keep more
/// than limits.max_pool_bytes (keepBytes).
class DevicePool {
 public:
  /// A lower cap frees kept buffers (idle: given back after their streams drained) until the
  /// pool is within it.
  void keepBytes(uint64_t bytes) {
    std::lock_guard lock(mu_);
    keep_bytes_ = bytes;
    for (auto& [ordinal, free] : free_) {
      while (bytes_ > keep_bytes_ && !free.empty()) {
        bytes_ -= free.back().size();
        free.pop_back();
      }
    }
  }
  Result<DeviceBuffer> take(int ordinal, size_t bytes, const char* what) {
    DeviceBuffer area;
    {
      std::lock_guard lock(mu_);
      area = kernels::takeReused(free_[ordinal], bytes, /*capacity_only=*/false, bytes_);
    }
    LW_RETURN_IF_ERROR(area.ensure(bytes, what));
    return area;
  }
  void give(int ordinal, DeviceBuffer area) {
    if (area.size() == 0) return;
    std::lock_guard lock(mu_);
    if (bytes_ + area.size() > keep_bytes_) return;  // freed (the stream that used it drained)
    bytes_ += area.size();
    free_[ordinal].push_back(std::move(area));
  }
  uint64_t bytes() {
    std::lock_guard lock(mu_);
    return bytes_;
  }

 private:
  std::mutex mu_;
  std::map<int, std::vector<DeviceBuffer>> free_;
  uint64_t bytes_ = 0;
  uint64_t keep_bytes_ = uint64_t{1} << 30;  // limits.max_pool_bytes' default
};

DevicePool& devicePool() {
  static DevicePool* pool = new DevicePool();  // never destroyed: device memory outlives main()
  return *pool;
}

}  // namespace

uint64_t pooledDeviceBytes() { return devicePool().bytes(); }
void keepPooledDeviceBytes(uint64_t bytes) { devicePool().keepBytes(bytes); }

uint64_t workAreaBytes(const kernels::CodecConfig& config, size_t n,
                       std::span<const uint64_t> shape) {
  auto codec = kc::createCudaCodec(config);
  if (!codec) return 0;
  return (*codec)->stateFloats(n, shape) > 0 ? (*codec)->workFloats(n, shape) * sizeof(float) : 0;
}

class TensorGpu {
 public:
  explicit TensorGpu(int ordinal) : ordinal_(ordinal) {}
  ~TensorGpu() {
    if (stream_ != nullptr) {
      int previous = -1;
      cudaGetDevice(&previous);
      cudaSetDevice(ordinal_);
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
      if (previous >= 0) cudaSetDevice(previous);
    }
  }
  TensorGpu(const TensorGpu&) = delete;
  TensorGpu& operator=(const TensorGpu&) = delete;

  int ordinal_;
  cudaStream_t stream_ = nullptr;
  std::mutex mu_;  // one operation at a time (the exchange may encode from its own thread)
  // The tensor's CUDA codec (of config_key_) and its committed state (one copy: a step prepares
  // the next in a work area from devicePool()); `none` for dense steps.
  std::string config_key_;
  std::unique_ptr<kc::CudaCodec> codec_, none_;
  kc::DeviceState state_, no_state_;
  bool has_state_ = false;
  // The codec's workspace, one chunk's payload and its size, decode scratch, statistics (the step
  // buffers of the tensor's size come from devicePool()).
  DeviceBuffer workspace_, payload_, size_, scratch_, stats_;
};

uint64_t stateBytes(const TensorGpu* tg) {
  return tg != nullptr && tg->has_state_ ? tg->state_.bytes() : 0;
}

Result<kernels::CodecState> downloadState(TensorGpu& tg) {
  std::lock_guard lock(tg.mu_);
  if (cudaError_t e = cudaSetDevice(tg.ordinal_); e != cudaSuccess) {
    return deviceError(e, "selecting GPU " + std::to_string(tg.ordinal_));
  }
  kernels::CodecState host(tg.state_.floats());
  if (tg.state_.floats() == 0) return host;
  auto values = tg.state_.download(tg.stream_);
  if (!values) return values.status();
  LW_RETURN_IF_ERROR(host.restore(*values));
  return host;
}

std::optional<int> eligibleDevice(std::span<const Contribution* const> parts,
                                  std::string_view codec) {
  std::optional<int> ordinal;  // trainer 0's GPU: where the step runs
  for (const Contribution* c : parts) {
    if (c == nullptr || !c->device || c->device->ptr == nullptr || c->device->ordinal < 0) {
      return std::nullopt;
    }
    if (!ordinal) ordinal = c->device->ordinal;
  }
  if (!ordinal || !kc::hasCudaCodec(codec) || !kc::hasCudaCodec("none")) return std::nullopt;
  return ordinal;
}

struct GpuStep::Impl {
  TensorGpu& t;
  std::shared_ptr<TensorGpu> keep;
  std::vector<void*> parts;        // each trainer's device memory
  std::vector<int> part_devices;   // ... and its GPU
  std::vector<const void*> local;  // each trainer's gradient on this GPU (itself, or a copy)
  size_t n = 0;
  DType dtype = DType::kF32;
  const float* input = nullptr;  // the step's input (fp32, n)
  float* result = nullptr;
  float* own_result = nullptr;  // a result buffer from devicePool(), when not written in place
  bool in_place = false;
  // The result is decoded into the work area and reaches the trainer whose memory is the input
  // only at the commit, which rereads the input (CudaCodec::commitReadsInput).
  bool write_at_commit = false;
  bool dense = false;    // this step compresses with `none` (bypass, full sync)
  bool flushed = false;  // a full sync: the commit leaves the state as after a flush
  // The step's context and chunking, from analyze() (for the commit; the context's shape is the
  // pipeline's, alive until the step ends).
  kernels::StepContext ctx;
  kernels::Chunking chunking;
  DeviceBuffer work;  // the state's work area, borrowed from devicePool() (size 0: none)
  // The other step buffers borrowed from devicePool(): the local sum, the result, the flushed
  // input, and the copies of trainers' gradients on other GPUs (each trainer's result is narrowed
  // there before it is copied back).
  std::vector<DeviceBuffer> borrowed;

  std::unique_lock<std::mutex> lock() {
    std::unique_lock l(t.mu_);
    cudaSetDevice(t.ordinal_);  // per host thread; an error surfaces at the next call
    return l;
  }
  const kc::CudaCodec& codec() const { return dense ? *t.none_ : *t.codec_; }
  kc::DeviceState& state() { return dense ? t.no_state_ : t.state_; }
  Status sync(const char* what) { return deviceError(cudaStreamSynchronize(t.stream_), what); }
  /// Lends the tensor's state a work area for this step (nothing for a state of no floats).
  Status lendWork() {
    if (work.size() > 0 || t.state_.floats() == 0) return Status::ok();
    auto area =
        devicePool().take(t.ordinal_, std::max<size_t>(t.state_.workFloats(), 1) * sizeof(float),
                          "a codec work area");
    if (!area) return area.status();
    work = std::move(*area);
    t.state_.attachWork(work.as<float>());
    return Status::ok();
  }
  /// The work area goes back to the pool (the stream has drained: nothing reads it any more).
  void returnWork() {
    if (work.size() == 0) return;
    // Only its own: a later step of the tensor may have lent the state another area already.
    if (t.state_.work() == work.as<float>()) t.state_.detachWork();
    devicePool().give(t.ordinal_, std::move(work));
  }
  /// A step buffer of at least `bytes` for the rest of the step.
  Result<void*> borrow(size_t bytes, const char* what) {
    auto area = devicePool().take(t.ordinal_, std::max<size_t>(bytes, 1), what);
    if (!area) return area.status();
    borrowed.push_back(std::move(*area));
    return borrowed.back().as<void>();  // device memory: it stays put when the vector grows
  }
  /// Every borrowed step buffer goes back (the stream has drained).
  void giveBack() {
    for (auto& b : borrowed) devicePool().give(t.ordinal_, std::move(b));
    borrowed.clear();
  }
  /// Every trainer's tensor = the result in its dtype (enqueued on the stream).
  Status writeResult() {
    const size_t bytes = n * kernels::dtypeSize(dtype);
    for (size_t k = 0; k < parts.size(); ++k) {
      // A trainer on another GPU: narrowed here (its gradient's copy is no longer needed), then
      // copied over.
      void* here = const_cast<void*>(local[k]);
      LW_RETURN_IF_ERROR(
          deviceError(kc::narrowFloats(result, n, dtype, here, t.stream_), "writing the result"));
      if (here != parts[k]) {
        LW_RETURN_IF_ERROR(deviceError(
            cudaMemcpyPeerAsync(parts[k], part_devices[k], here, t.ordinal_, bytes, t.stream_),
            "copying the result to GPU " + std::to_string(part_devices[k])));
      }
    }
    return Status::ok();
  }
  /// The decode scratch holds `bytes` (grown once the stream has drained: earlier decodes may
  /// still read it).
  Status ensureScratch(size_t bytes, const char* what) {
    if (bytes <= t.scratch_.size()) return Status::ok();
    LW_RETURN_IF_ERROR(sync(what));
    return t.scratch_.ensure(bytes, "decode scratch");
  }
};

GpuStep::GpuStep(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuStep::~GpuStep() {
  // A step that failed half-way may still have work queued that reads the trainers' gradients or
  // writes their results: it ends before the reply goes out.
  auto l = impl_->lock();
  cudaStreamSynchronize(impl_->t.stream_);
  impl_->returnWork();
  impl_->giveBack();
}

std::string GpuStep::deviceName() const { return "cuda:" + std::to_string(impl_->t.ordinal_); }

Result<std::unique_ptr<GpuStep>> GpuStep::begin(std::shared_ptr<TensorGpu>& tg, int ordinal,
                                                const kernels::CodecConfig& config,
                                                std::span<Contribution* const> parts, size_t n,
                                                std::span<const uint64_t> shape, DType dtype,
                                                const kernels::CodecState* host_state) {
  // The tensor's resources on this GPU; `tg` is replaced only once the step has begun, so a
  // failure leaves the state where it was.
  std::shared_ptr<TensorGpu> target = tg && tg->ordinal_ == ordinal ? tg : nullptr;
  std::optional<kernels::CodecState> moved;
  if (!target) {
    if (host_state == nullptr) {
      // Trainer 0 is on another GPU now: the state moves there through the host.
      if (!tg) return internalError("GPU path: the tensor has no codec state");
      auto state = downloadState(*tg);
      if (!state) return state.status();
      moved = std::move(*state);
      host_state = &*moved;
    }
    target = std::make_shared<TensorGpu>(ordinal);
  }
  if (cudaError_t e = cudaSetDevice(ordinal); e != cudaSuccess) {
    return deviceError(e, "selecting GPU " + std::to_string(ordinal));
  }
  TensorGpu& t = *target;
  std::unique_lock lock(t.mu_);
  if (t.stream_ == nullptr) {
    if (cudaError_t e = cudaStreamCreateWithFlags(&t.stream_, cudaStreamNonBlocking);
        e != cudaSuccess) {
      t.stream_ = nullptr;
      return deviceError(e, "creating a stream");
    }
  }
  const std::string key = kernels::configKey(config);
  if (!t.codec_ || t.config_key_ != key) {
    auto codec = kc::createCudaCodec(config);
    if (!codec) return codec.status();
    t.codec_ = std::move(*codec);
    t.config_key_ = key;
  }
  if (!t.none_) {
    kernels::CodecConfig none;
    none.name = "none";
    auto codec = kc::createCudaCodec(none);
    if (!codec) return codec.status();
    t.none_ = std::move(*codec);
  }
  if (host_state != nullptr) {
    // The state moves here: the host's when it is this codec's for this size, else fresh zeros.
    const size_t floats = t.codec_->stateFloats(n, shape);
    auto state = kc::DeviceState::create(floats, t.codec_->workFloats(n, shape));
    if (!state) return state.status();
    if (host_state->floats() == floats && floats > 0) {
      LW_RETURN_IF_ERROR(state->upload(host_state->currentSpan(), t.stream_));
    }
    t.state_ = std::move(*state);
    t.has_state_ = true;
  }
  auto impl = std::make_unique<Impl>(Impl{t, target, {}, {}, {}, n, dtype});
  for (size_t k = 0; k < parts.size(); ++k) {
    Contribution* c = parts[k];
    impl->parts.push_back(c->device->ptr);
    impl->part_devices.push_back(c->device->ordinal);
    impl->local.push_back(c->device->ptr);
    if (c->device->ordinal != ordinal) {
      auto copy = impl->borrow(n * kernels::dtypeSize(dtype), "a copy of another GPU's gradient");
      if (!copy) return copy.status();
      impl->local.back() = *copy;
    }
    if (std::string why; c->device->wait && !c->device->wait(t.stream_, &why)) {
      return internalError("GPU path: waiting for trainer " + std::to_string(c->spec.trainer) +
                           "'s gradient: " + why);
    }
  }
  tg = std::move(target);
  lock.unlock();  // the step's operations take it one at a time
  return std::unique_ptr<GpuStep>(new GpuStep(std::move(impl)));
}

Status GpuStep::ingest() {
  auto l = impl_->lock();
  Impl& s = *impl_;
  // Gradients of trainers on other GPUs come over first (NVLink or PCIe peer to peer; the driver
  // stages through the host where the GPUs cannot reach each other).
  const size_t bytes = s.n * kernels::dtypeSize(s.dtype);
  for (size_t k = 0; k < s.parts.size(); ++k) {
    if (s.local[k] == s.parts[k]) continue;
    LW_RETURN_IF_ERROR(
        deviceError(cudaMemcpyPeerAsync(const_cast<void*>(s.local[k]), s.t.ordinal_, s.parts[k],
                                        s.part_devices[k], bytes, s.t.stream_),
                    "copying trainer " + std::to_string(k) + "'s gradient from GPU " +
                        std::to_string(s.part_devices[k])));
  }
  if (s.parts.size() == 1 && s.dtype == DType::kF32) {
    s.input = static_cast<const float*>(s.local[0]);
    return Status::ok();
  }
  auto sum = s.borrow(s.n * sizeof(float), "the local sum");
  if (!sum) return sum.status();
  LW_RETURN_IF_ERROR(
      deviceError(kc::sumWidened(s.local.data(), static_cast<unsigned>(s.local.size()), s.dtype,
                                 s.n, static_cast<float*>(*sum), s.t.stream_),
                  "summing the local trainers"));
  s.input = static_cast<const float*>(*sum);
  return Status::ok();
}

Status GpuStep::accumulate() {
  return failedPrecondition("GPU path: delayed sync runs on the host");
}
Status GpuStep::addAccumulation() {
  return failedPrecondition("GPU path: delayed sync runs on the host");
}

Status GpuStep::flush(const kernels::StepContext& ctx, const kernels::Chunking& chunking) {
  auto l = impl_->lock();
  Impl& s = *impl_;
  auto flushed = s.borrow(s.n * sizeof(float), "the flushed input");
  if (!flushed) return flushed.status();
  LW_RETURN_IF_ERROR(s.lendWork());
  LW_RETURN_IF_ERROR(s.t.codec_->flush(ctx, chunking, {s.input, s.n, DType::kF32}, s.t.state_,
                                       static_cast<float*>(*flushed), s.t.stream_));
  s.input = static_cast<const float*>(*flushed);
  s.flushed = true;
  return Status::ok();
}

Result<policies::StepStats> GpuStep::stats(double min_magnitude, bool count_small) {
  auto l = impl_->lock();
  Impl& s = *impl_;
  policies::StepStats st;
  st.elements = s.n;
  const size_t blocks = (s.n + kernels::kStatsBlock - 1) / kernels::kStatsBlock;
  // [block sums | total | 2 counts], and the canonical reduction's block sums after them.
  const size_t canonical = kc::canonicalBlocks(s.n);
  const size_t doubles = blocks + 1 + 2 + canonical + 1;
  LW_RETURN_IF_ERROR(s.t.stats_.ensure(doubles * sizeof(double), "statistics"));
  auto* sums = s.t.stats_.as<double>();
  double* total = sums + blocks;
  auto* counts = reinterpret_cast<unsigned long long*>(total + 1);
  double* canonical_sums = total + 3;
  double* canonical_total = canonical_sums + canonical;
  cudaStream_t stream = s.t.stream_;
  LW_RETURN_IF_ERROR(
      deviceError(kc::statsSquareBlockSums(s.input, s.n, sums, stream), "statistics"));
  LW_RETURN_IF_ERROR(deviceError(kc::sumBlockSums(sums, blocks, total, stream), "statistics"));
  double norm2 = 0.0;
  LW_RETURN_IF_ERROR(deviceError(
      cudaMemcpyAsync(&norm2, total, sizeof norm2, cudaMemcpyDeviceToHost, stream), "statistics"));
  LW_RETURN_IF_ERROR(s.sync("statistics"));
  st.grad_norm2 = s.n == 0 ? 0.0 : norm2;
  if (!std::isfinite(st.grad_norm2) || count_small) {
    unsigned long long host[2] = {0, 0};
    LW_RETURN_IF_ERROR(deviceError(cudaMemsetAsync(counts, 0, sizeof host, stream), "statistics"));
    LW_RETURN_IF_ERROR(deviceError(
        kc::countValues(s.input, s.n, static_cast<float>(min_magnitude), counts, stream),
        "statistics"));
    LW_RETURN_IF_ERROR(deviceError(
        cudaMemcpyAsync(host, counts, sizeof host, cudaMemcpyDeviceToHost, stream), "statistics"));
    LW_RETURN_IF_ERROR(s.sync("statistics"));
    st.nonfinite = host[0];
    st.small = count_small ? host[1] : 0;
    if (st.nonfinite > 0) {
      st.grad_norm2 = 0;  // the count says it; the norm is meaningless
    } else if (!std::isfinite(st.grad_norm2)) {
      // Finite values whose float squares overflowed: the exact fp64 sum, as on the CPU.
      LW_RETURN_IF_ERROR(
          deviceError(kc::canonicalSum(s.input, DType::kF32, s.n, kernels::ReduceTerm::kSquare,
                                       canonical_sums, canonical_total, stream),
                      "statistics"));
      LW_RETURN_IF_ERROR(
          deviceError(cudaMemcpyAsync(&st.grad_norm2, canonical_total, sizeof(double),
                                      cudaMemcpyDeviceToHost, stream),
                      "statistics"));
      LW_RETURN_IF_ERROR(s.sync("statistics"));
    }
  }
  return st;
}

Result<double> GpuStep::residualNorm2() {
  auto l = impl_->lock();
  Impl& s = *impl_;
  if (!s.t.has_state_ || s.t.state_.floats() == 0) return 0.0;
  LW_RETURN_IF_ERROR(
      s.t.scratch_.ensure(kc::CudaCodec::residualScratchBytes(s.n), "residual scratch"));
  return s.t.codec_->residualNorm2(s.t.state_, s.n, s.t.scratch_.bytes(), s.t.stream_);
}

Status GpuStep::analyze(const kernels::StepContext& ctx, const kernels::Chunking& chunking,
                        bool dense) {
  auto l = impl_->lock();
  Impl& s = *impl_;
  s.dense = dense;
  s.ctx = ctx;
  s.chunking = chunking;
  const kc::CudaCodec& codec = s.codec();
  size_t max_payload = 0;
  for (size_t c = 0; c < chunking.count(); ++c) {
    max_payload = std::max(max_payload, codec.maxPayloadBytes(chunking.size(c)));
  }
  LW_RETURN_IF_ERROR(s.t.workspace_.ensure(std::max<size_t>(codec.workspaceBytes(chunking), 1),
                                           "the codec workspace"));
  LW_RETURN_IF_ERROR(s.t.payload_.ensure(std::max<size_t>(max_payload, 1), "a payload"));
  LW_RETURN_IF_ERROR(s.t.size_.ensure(sizeof(uint64_t), "a payload size"));
  if (!dense) LW_RETURN_IF_ERROR(s.lendWork());
  return codec.analyze(ctx, chunking, {s.input, s.n, DType::kF32}, s.state(),
                       s.t.workspace_.bytes(), s.t.stream_);
}

Result<std::span<const uint8_t>> GpuStep::encodeChunk(const kernels::StepContext& ctx,
                                                      const kernels::Chunking& chunking,
                                                      size_t chunk, int round,
                                                      std::span<const uint8_t> previous,
                                                      kernels::PayloadBuffer& out) {
  auto l = impl_->lock();
  Impl& s = *impl_;
  const kc::CudaCodec& codec = s.codec();
  cudaStream_t stream = s.t.stream_;
  LW_RETURN_IF_ERROR(codec.encodeChunk(
      ctx, chunking, chunk, round, previous, {s.input, s.n, DType::kF32}, s.state(),
      s.t.workspace_.bytes(), s.t.payload_.as<uint8_t>(), s.t.size_.as<uint64_t>(), stream));
  uint64_t size = 0;
  LW_RETURN_IF_ERROR(deviceError(
      cudaMemcpyAsync(&size, s.t.size_.as<uint64_t>(), sizeof size, cudaMemcpyDeviceToHost, stream),
      "reading a payload's size"));
  LW_RETURN_IF_ERROR(s.sync("compressing"));
  const size_t max = codec.maxPayloadBytes(chunking.size(chunk));
  if (size > max) {
    return internalError("GPU path: chunk " + std::to_string(chunk) + "'s payload of " +
                         std::to_string(size) + " bytes exceeds its bound " + std::to_string(max));
  }
  if (out.size() < max) out.resize(max);
  LW_RETURN_IF_ERROR(deviceError(
      cudaMemcpyAsync(out.data(), s.t.payload_.as<uint8_t>(), size, cudaMemcpyDeviceToHost, stream),
      "copying a payload"));
  LW_RETURN_IF_ERROR(s.sync("copying a payload"));
  return std::span<const uint8_t>(out.data(), size);
}

Result<const float*> GpuStep::chunkInput(const kernels::Chunking& chunking, size_t chunk,
                                         std::vector<float>& out) {
  auto l = impl_->lock();
  Impl& s = *impl_;
  out.resize(chunking.size(chunk));
  LW_RETURN_IF_ERROR(
      deviceError(cudaMemcpyAsync(out.data(), s.input + chunking.begin(chunk),
                                  out.size() * sizeof(float), cudaMemcpyDeviceToHost, s.t.stream_),
                  "reading a chunk"));
  LW_RETURN_IF_ERROR(s.sync("reading a chunk"));
  return out.data();
}

Status GpuStep::prepareResult(bool in_place) {
  auto l = impl_->lock();
  Impl& s = *impl_;
  if (!s.dense && s.work.size() > 0 && s.t.codec_->commitReadsInput()) {
    // The commit rereads the input: the result goes to the work area, whose values the encoder
    // has used up by the time this backend decodes (after the exchange), and reaches a trainer
    // whose memory is the input at the commit (docs/determinism.md §4.6c).
    s.in_place = false;
    s.result = s.work.as<float>();
    s.write_at_commit = s.input == s.local[0];
    return Status::ok();
  }
  s.in_place = in_place && s.parts.size() == 1 && s.dtype == DType::kF32;
  if (s.in_place) {
    s.result = static_cast<float*>(s.parts[0]);
    return Status::ok();
  }
  if (s.own_result == nullptr) {
    auto result = s.borrow(s.n * sizeof(float), "the result");
    if (!result) return result.status();
    s.own_result = static_cast<float*>(*result);
  }
  s.result = s.own_result;
  return Status::ok();
}

Status GpuStep::decodeChunk(const kernels::Chunking& chunking, size_t chunk,
                            std::span<const std::span<const uint8_t>> payloads, bool dense,
                            float weight) {
  auto l = impl_->lock();
  Impl& s = *impl_;
  const kc::CudaCodec& decoder = dense ? *s.t.none_ : s.codec();
  const size_t begin = chunking.begin(chunk), len = chunking.size(chunk);
  size_t scratch = 0;
  for (const auto& p : payloads) {
    scratch = std::max(scratch, decoder.decodeScratchBytes(p.size(), len));
  }
  LW_RETURN_IF_ERROR(s.ensureScratch(scratch, "decompressing"));
  cudaStream_t stream = s.t.stream_;
  LW_RETURN_IF_ERROR(deviceError(cudaMemsetAsync(s.result + begin, 0, len * sizeof(float), stream),
                                 "zeroing the result"));
  for (const auto& p : payloads) {
    // Validated on the host first (nothing from a peer is trusted); nothing enqueued on error.
    LW_RETURN_IF_ERROR(
        decoder.decodeChunk(p, weight, s.result + begin, len, s.t.scratch_.bytes(), stream));
  }
  return Status::ok();
}

Status GpuStep::decodeRounds(const kernels::StepContext& ctx, const kernels::Chunking& chunking,
                             std::span<const std::span<const uint8_t>> rounds, float weight) {
  auto l = impl_->lock();
  Impl& s = *impl_;
  const kc::CudaCodec& codec = s.codec();
  cudaStream_t stream = s.t.stream_;
  LW_RETURN_IF_ERROR(
      s.ensureScratch(std::max<size_t>(codec.decodeScratchBytes(0, s.n), 1), "decompressing"));
  LW_RETURN_IF_ERROR(
      deviceError(cudaMemsetAsync(s.result, 0, s.n * sizeof(float), stream), "zeroing the result"));
  LW_RETURN_IF_ERROR(
      codec.decodeRounds(rounds, weight, s.result, s.n, s.t.scratch_.bytes(), stream));
  return codec.finishStep(ctx, chunking, rounds, weight, {s.input, s.n, DType::kF32}, s.state(),
                          s.t.workspace_.bytes(), stream);
}

Result<bool> GpuStep::resultNonfinite() {
  auto l = impl_->lock();
  Impl& s = *impl_;
  LW_RETURN_IF_ERROR(s.t.stats_.ensure(2 * sizeof(unsigned long long), "statistics"));
  auto* counts = s.t.stats_.as<unsigned long long>();
  unsigned long long host[2] = {0, 0};
  cudaStream_t stream = s.t.stream_;
  LW_RETURN_IF_ERROR(
      deviceError(cudaMemsetAsync(counts, 0, sizeof host, stream), "checking the result"));
  LW_RETURN_IF_ERROR(
      deviceError(kc::countValues(s.result, s.n, 0.0f, counts, stream), "checking the result"));
  LW_RETURN_IF_ERROR(
      deviceError(cudaMemcpyAsync(host, counts, sizeof host, cudaMemcpyDeviceToHost, stream),
                  "checking the result"));
  LW_RETURN_IF_ERROR(s.sync("checking the result"));
  return host[0] > 0;
}

Result<uint64_t> GpuStep::resultChecksum() {
  auto l = impl_->lock();
  Impl& s = *impl_;
  std::vector<float> host(s.n);
  LW_RETURN_IF_ERROR(deviceError(cudaMemcpyAsync(host.data(), s.result, s.n * sizeof(float),
                                                 cudaMemcpyDeviceToHost, s.t.stream_),
                                 "reading the result"));
  LW_RETURN_IF_ERROR(s.sync("reading the result"));
  return XXH3_64bits(host.data(), host.size() * sizeof(float));
}

Status GpuStep::writeBack() {
  auto l = impl_->lock();
  Impl& s = *impl_;
  // Left to the commit where the trainer's memory is the input the commit rereads; the sync
  // surfaces any device error of the step before anything is committed.
  if (!s.in_place && !s.write_at_commit) LW_RETURN_IF_ERROR(s.writeResult());
  // In place before the reply: the trainer reads its tensor as soon as it has the reply.
  return s.sync("writing the result");
}

void GpuStep::commit(const Commit& c) {
  auto l = impl_->lock();
  Impl& s = *impl_;
  cudaStream_t stream = s.t.stream_;
  // Bypass steps prepared nothing (no work area): their state stays as it was.
  const bool state = c.state && s.work.size() > 0;
  Status st;
  if (state && s.flushed) {
    st = s.t.codec_->commitFlush(s.t.state_, stream);
  } else if (state) {
    const kc::CudaCodec& codec = *s.t.codec_;
    size_t scratch = 0;
    for (size_t k = 0; k < c.sent.size() && k < s.chunking.count(); ++k) {
      scratch = std::max(scratch, codec.commitScratchBytes(c.sent[k].size(), s.chunking.size(k)));
    }
    st = s.ensureScratch(scratch, "committing the codec state");
    if (st.isOk()) {
      st = codec.commitState(s.ctx, s.chunking, {s.input, s.n, DType::kF32}, c.sent, s.t.state_,
                             s.t.workspace_.bytes(), s.t.scratch_.bytes(), stream);
    }
  }
  // The result reaches the trainer whose memory held the input once the commit has read it.
  const Status wrote = s.write_at_commit ? s.writeResult() : Status::ok();
  const Status synced = s.sync("committing the codec state");
  if (state && (!st.isOk() || !synced.isOk())) {
    // A device failure after the write-back: the state may be partly updated. It starts over
    // rather than carry a mix (as the host backend does after a failed commit).
    spdlog::error("committing the codec state on the GPU failed, the state is reset: {}",
                  (!st.isOk() ? st : synced).message());
    (void)s.t.state_.reset(stream);
    (void)s.sync("resetting the codec state");
  }
  if (s.write_at_commit && (!wrote.isOk() || !synced.isOk())) {
    spdlog::error(
        "writing the result to the trainer's GPU memory after the commit failed, its "
        "tensor may not hold the result: {}",
        (!wrote.isOk() ? wrote : synced).message());
  }
  s.returnWork();
}

}  // namespace lightwire::proxy::gpu
