#pragma once
// Shared by the GPU codec tests: device buffers, input generators, and checkCudaMatchesCpu(), which
// runs the same steps of one codec configuration on the CPU (kernels/codec.h) and on the GPU
// (kernels/cuda/codec.h) and requires byte-identical payloads, bit-identical committed states and
// bit-identical decode-accumulate results. Single-round codecs only (PowerSGD has its own tests).

#include <cuda_runtime_api.h>
#include <doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/cuda/codec.h"
#include "kernels/dtype.h"
#include "kernels/philox.h"
#include "kernels/registry.h"

namespace lightwire::kernels::cuda::testing {

#define LW_CUDA_CHECK_OK(call)                                        \
  do {                                                                \
    const cudaError_t lw_e_ = (call);                                 \
    INFO(#call);                                                      \
    REQUIRE_MESSAGE(lw_e_ == cudaSuccess, cudaGetErrorString(lw_e_)); \
  } while (0)

#define LW_STATUS_OK(expr)                          \
  do {                                              \
    const ::lightwire::Status lw_s_ = (expr);       \
    INFO(#expr);                                    \
    REQUIRE_MESSAGE(lw_s_.isOk(), lw_s_.message()); \
  } while (0)

/// Device memory of `bytes` bytes (at least 1), freed on scope exit.
class DeviceMem {
 public:
  explicit DeviceMem(size_t bytes = 0) : bytes_(bytes) {
    LW_CUDA_CHECK_OK(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)));
  }
  ~DeviceMem() { cudaFree(ptr_); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  template <typename T = void>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }
  DeviceBytes span() const { return DeviceBytes{ptr_, bytes_}; }
  void upload(const void* host, size_t bytes) {
    REQUIRE(bytes <= std::max<size_t>(bytes_, 1));
    if (bytes > 0) LW_CUDA_CHECK_OK(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
  }
  template <typename T>
  std::vector<T> download(size_t count) const {
    std::vector<T> host(count);
    if (count > 0) {
      LW_CUDA_CHECK_OK(cudaMemcpy(host.data(), ptr_, count * sizeof(T), cudaMemcpyDeviceToHost));
    }
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

// --- inputs --------------------------------------------------------------------------------------

inline std::vector<float> normalInput(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = d(gen);
  return x;
}

/// Normal / uniform(0.01, 1): a heavy tail (a few huge magnitudes), both signs.
inline std::vector<float> heavyTailedInput(size_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.01f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = d(gen) / u(gen);
  return x;
}

inline std::vector<float> constantInput(size_t n, float value) {
  return std::vector<float>(n, value);
}

/// Small integers in [-3, 3] (many exactly equal magnitudes: ties everywhere).
inline std::vector<float> tiedInput(size_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> d(-3, 3);
  std::vector<float> x(n);
  for (auto& v : x) v = static_cast<float>(d(gen));
  return x;
}

/// The host bytes of `x` as `dtype` (fp32 as is; fp16 / bf16 rounded as kernels/dtype.h does).
inline std::vector<uint8_t> asDType(const std::vector<float>& x, DType dtype) {
  std::vector<uint8_t> bytes(x.size() * dtypeSize(dtype));
  for (size_t i = 0; i < x.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &x[i], 4);
    } else {
      const uint16_t h = dtype == DType::kF16 ? floatToHalf(x[i]) : floatToBf16(x[i]);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return bytes;
}

// --- the comparison ------------------------------------------------------------------------------

struct CompareOptions {
  size_t chunk_elements = 0;  // requested chunk size (0 = one chunk); rounded by chunkingFor()
  DType dtype = DType::kF32;  // input dtype handed to both codecs
  uint32_t seed = 7;
  std::string tensor = "layer.weight";
  uint32_t rank = 0;
  uint64_t first_step = 1;
  std::optional<double> density;  // StepContext::density override (schedules)
  float weight = 0.37f;           // decode weight
  bool flush_last = false;        // end with a flush() step compared on both
};

inline std::string firstDifference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return "first difference at byte " + std::to_string(i) + " (sizes " + std::to_string(a.size()) +
         " gpu, " + std::to_string(b.size()) + " cpu)";
}

inline bool sameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// The step succeeded: gpu.commitState() with `sent` (the step's payloads) and the scratch it
/// asks for, then the stream drained.
inline Status commitOnGpu(const CudaCodec& gpu, const StepContext& ctx, const Chunking& chunking,
                          DeviceTensor input, std::span<const std::span<const uint8_t>> sent,
                          DeviceState& state, DeviceBytes workspace, cudaStream_t stream) {
  size_t bytes = 0;
  for (size_t c = 0; c < sent.size() && c < chunking.count(); ++c) {
    bytes = std::max(bytes, gpu.commitScratchBytes(sent[c].size(), chunking.size(c)));
  }
  DeviceMem scratch(bytes);
  LW_RETURN_IF_ERROR(
      gpu.commitState(ctx, chunking, input, sent, state, workspace, scratch.span(), stream));
  return cudaStatus(cudaStreamSynchronize(stream), "committing");
}

/// Runs inputs.size() steps (step s takes inputs[s]) of `config` on the CPU and the GPU, committing
/// after each, and CHECKs: every chunk's payload identical; every committed state identical;
/// decoding each payload (CPU decodeChunk vs GPU decodeChunk of the same bytes) into the same
/// non-zero base with opt.weight gives identical fp32 bits. Returns the CPU payloads of the last
/// step (for codec-specific checks).
inline std::vector<std::vector<uint8_t>> checkCudaMatchesCpu(
    const CodecConfig& config, const std::vector<std::vector<float>>& inputs,
    const CompareOptions& opt = {}) {
  auto cpu_r = createCodec(config);
  REQUIRE_MESSAGE(cpu_r.isOk(), cpu_r.status().message());
  auto gpu_r = createCudaCodec(config);
  REQUIRE_MESSAGE(gpu_r.isOk(), gpu_r.status().message());
  const Codec& cpu = **cpu_r;
  const CudaCodec& gpu = **gpu_r;
  REQUIRE(!inputs.empty());
  const size_t n = inputs[0].size();
  const Chunking chunking = chunkingFor(cpu, n, opt.chunk_elements);

  CodecState cpu_state(cpu.stateFloats(n));
  auto gs = DeviceState::create(gpu.stateFloats(n));
  REQUIRE_MESSAGE(gs.isOk(), gs.status().message());
  DeviceState gpu_state = std::move(*gs);

  std::vector<std::byte> cpu_ws(cpu.workspaceBytes(chunking));
  DeviceMem gpu_ws(gpu.workspaceBytes(chunking));
  const size_t max_payload = cpu.maxPayloadBytes(chunking.chunk_elements);
  DeviceMem d_payload(max_payload);
  DeviceMem d_size(sizeof(uint64_t));
  DeviceMem d_input(n * dtypeSize(opt.dtype));
  cudaStream_t stream = nullptr;
  LW_CUDA_CHECK_OK(cudaStreamCreate(&stream));

  std::vector<std::vector<uint8_t>> last;
  for (size_t s = 0; s < inputs.size(); ++s) {
    CAPTURE(s);
    REQUIRE(inputs[s].size() == n);
    const std::vector<uint8_t> host_in = asDType(inputs[s], opt.dtype);
    d_input.upload(host_in.data(), host_in.size());
    StepContext ctx;
    ctx.seed = opt.seed;
    ctx.name_key = tensorNameKey(opt.tensor);
    ctx.step = opt.first_step + s;
    ctx.rank = opt.rank;
    ctx.density = opt.density;
    const ConstTensor cin{host_in.data(), n, opt.dtype};
    const DeviceTensor gin{d_input.as(), n, opt.dtype};

    if (opt.flush_last && s + 1 == inputs.size()) {
      std::vector<float> cpu_out(n);
      DeviceMem gpu_out(n * sizeof(float));
      LW_STATUS_OK(cpu.flush(ctx, chunking, cin, cpu_state, cpu_out.data()));
      LW_STATUS_OK(gpu.flush(ctx, chunking, gin, gpu_state, gpu_out.as<float>(), stream));
      LW_CUDA_CHECK_OK(cudaStreamSynchronize(stream));
      CHECK_MESSAGE(sameBits(gpu_out.download<float>(n), cpu_out), "flush output differs");
      cpu.commitFlush(cpu_state, n);
      LW_STATUS_OK(gpu.commitFlush(gpu_state, stream));
    } else {
      LW_STATUS_OK(cpu.analyze(ctx, chunking, cin, cpu_state, cpu_ws));
      LW_STATUS_OK(gpu.analyze(ctx, chunking, gin, gpu_state, gpu_ws.span(), stream));
      last.clear();
      for (size_t c = 0; c < chunking.count(); ++c) {
        CAPTURE(c);
        std::vector<uint8_t> cpu_payload(max_payload);
        auto size = cpu.encodeChunk(ctx, chunking, c, 0, {}, cin, cpu_state, cpu_ws, cpu_payload);
        REQUIRE_MESSAGE(size.isOk(), size.status().message());
        cpu_payload.resize(*size);
        LW_STATUS_OK(gpu.encodeChunk(ctx, chunking, c, 0, {}, gin, gpu_state, gpu_ws.span(),
                                     d_payload.as<uint8_t>(), d_size.as<uint64_t>(), stream));
        LW_CUDA_CHECK_OK(cudaStreamSynchronize(stream));
        const uint64_t gpu_size = d_size.download<uint64_t>(1)[0];
        REQUIRE(gpu_size <= max_payload);
        const std::vector<uint8_t> gpu_payload = d_payload.download<uint8_t>(gpu_size);
        CHECK_MESSAGE(gpu_payload == cpu_payload, firstDifference(gpu_payload, cpu_payload));

        // Decode the CPU's bytes on both sides into the same non-zero base.
        const size_t len = chunking.size(c);
        std::vector<float> base = normalInput(len, 1000 + s * 31 + c);
        std::vector<float> cpu_out = base;
        LW_STATUS_OK(cpu.decodeChunk(cpu_payload, opt.weight, cpu_out.data(), len));
        DeviceMem gpu_out(len * sizeof(float));
        gpu_out.upload(base.data(), len * sizeof(float));
        DeviceMem scratch(gpu.decodeScratchBytes(cpu_payload.size(), len));
        LW_STATUS_OK(gpu.decodeChunk(cpu_payload, opt.weight, gpu_out.as<float>(), len,
                                     scratch.span(), stream));
        LW_CUDA_CHECK_OK(cudaStreamSynchronize(stream));
        CHECK_MESSAGE(sameBits(gpu_out.download<float>(len), cpu_out), "decoded result differs");
        last.push_back(std::move(cpu_payload));
      }
      // Both states are committed from what was sent (the same bytes, checked above): the host's
      // in place, the GPU's by copying its work area or in place (dgc with momentum, which reads
      // the input and the payloads back).
      const std::vector<std::span<const uint8_t>> sent(last.begin(), last.end());
      LW_STATUS_OK(cpu.commitState(ctx, chunking, cin, sent, {}, cpu_state, cpu_ws));
      LW_STATUS_OK(commitOnGpu(gpu, ctx, chunking, gin, sent, gpu_state, gpu_ws.span(), stream));
    }
    auto gpu_committed = gpu_state.download(stream);
    REQUIRE_MESSAGE(gpu_committed.isOk(), gpu_committed.status().message());
    const auto cpu_committed = cpu_state.currentSpan();
    CHECK_MESSAGE(
        sameBits(*gpu_committed, std::vector<float>(cpu_committed.begin(), cpu_committed.end())),
        "committed state differs");
    // The residual norm the policies read.
    DeviceMem norm_scratch(CudaCodec::residualScratchBytes(n));
    auto g_norm = gpu.residualNorm2(gpu_state, n, norm_scratch.span(), stream);
    REQUIRE_MESSAGE(g_norm.isOk(), g_norm.status().message());
    CHECK(*g_norm == cpu.residualNorm2(cpu_state, n));
  }
  LW_CUDA_CHECK_OK(cudaStreamDestroy(stream));
  return last;
}

/// decodeChunk of a hostile payload: rejected on both sides, and the GPU output untouched.
inline void checkRejectedLikeCpu(const CodecConfig& config, const std::vector<uint8_t>& payload,
                                 size_t out_elements) {
  auto cpu_r = createCodec(config);
  REQUIRE(cpu_r.isOk());
  auto gpu_r = createCudaCodec(config);
  REQUIRE_MESSAGE(gpu_r.isOk(), gpu_r.status().message());
  std::vector<float> cpu_out(out_elements, 1.5f);
  CHECK_FALSE((*cpu_r)->decodeChunk(payload, 1.0f, cpu_out.data(), out_elements).isOk());
  DeviceMem out(out_elements * sizeof(float));
  std::vector<float> base(out_elements, 1.5f);
  out.upload(base.data(), base.size() * sizeof(float));
  DeviceMem scratch((*gpu_r)->decodeScratchBytes(payload.size(), out_elements));
  const Status s =
      (*gpu_r)->decodeChunk(payload, 1.0f, out.as<float>(), out_elements, scratch.span(), nullptr);
  CHECK_FALSE(s.isOk());
  LW_CUDA_CHECK_OK(cudaDeviceSynchronize());
  CHECK(sameBits(out.download<float>(out_elements), base));
}

}  // namespace lightwire::kernels::cuda::testing
