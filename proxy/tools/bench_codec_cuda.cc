// `lightwire bench codec --device cuda` (proxy/tools/bench_codec.h): the CUDA codecs (kernels/cuda)
// on GPU 0. Times are CUDA event times around the kernels of one run (analyze + every chunk's
// encode; every chunk's device decode), medians of `runs` runs after one warm-up run; the baselines
// are a device-to-device cudaMemcpy of the same bytes and, for the selection codecs, torch.topk on
// the same GPU in a child Python process (PyTorch with CUDA; skipped with a note when it cannot be
// imported). Builds without the CUDA kernels say so.

#include <boost/json/object.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/philox.h"
#include "kernels/registry.h"
#include "kernels/select.h"
#include "proxy/tools/bench_codec.h"

#if defined(LIGHTWIRE_HAVE_CUDA_KERNELS)
#include <cuda_runtime_api.h>
#include <sys/wait.h>

#include "kernels/cuda/codec.h"
#endif

namespace lightwire::proxy {

#if !defined(LIGHTWIRE_HAVE_CUDA_KERNELS)

bool cudaBenchBuilt() { return false; }

Result<BenchResult> benchCodecCuda(const kernels::CodecConfig&, std::span<const float>,
                                   const BenchSettings&, const std::string&,
                                   const std::function<void(const std::string&)>&) {
  return failedPrecondition(
      "this lightwire was built without the CUDA kernels (no CUDA toolkit at build time); "
      "rebuild on a machine with nvcc, see docs/cuda.md");
}

#else

namespace {

using kernels::Chunking;
using kernels::CodecConfig;
using kernels::DType;
using kernels::StepContext;
using kernels::cuda::CudaCodec;
using kernels::cuda::cudaStatus;
using kernels::cuda::DeviceBytes;
using kernels::cuda::DeviceState;
using kernels::cuda::DeviceTensor;

/// Device memory freed on scope exit.
class DeviceAlloc {
 public:
  DeviceAlloc() = default;
  ~DeviceAlloc() { cudaFree(ptr_); }
  DeviceAlloc(const DeviceAlloc&) = delete;
  DeviceAlloc& operator=(const DeviceAlloc&) = delete;
  Status allocate(size_t bytes, const std::string& what) {
    bytes_ = bytes;
    return cudaStatus(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)),
                      "allocating " + std::to_string(bytes) + " bytes for " + what);
  }
  template <typename T = uint8_t>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  DeviceBytes span() const { return DeviceBytes{ptr_, bytes_}; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

/// Median of CUDA event times of `runs` runs of `body` on `stream` (one warm-up run first).
Result<double> medianEventSeconds(int runs, cudaStream_t stream,
                                  const std::function<Status()>& body) {
  cudaEvent_t start = nullptr, stop = nullptr;
  LW_RETURN_IF_ERROR(cudaStatus(cudaEventCreate(&start), "cudaEventCreate"));
  if (cudaError_t e = cudaEventCreate(&stop); e != cudaSuccess) {
    cudaEventDestroy(start);
    return cudaStatus(e, "cudaEventCreate");
  }
  std::vector<double> times;
  Status failed;
  for (int r = 0; r <= runs && failed.isOk(); ++r) {
    cudaError_t e = cudaEventRecord(start, stream);
    if (e == cudaSuccess) {
      failed = body();
      if (!failed.isOk()) break;
      e = cudaEventRecord(stop, stream);
    }
    if (e == cudaSuccess) e = cudaEventSynchronize(stop);
    float ms = 0;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, start, stop);
    if (e != cudaSuccess) {
      failed = cudaStatus(e, "timing a run");
      break;
    }
    if (r > 0) times.push_back(double(ms) / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!failed.isOk()) return failed;
  std::sort(times.begin(), times.end());
  const size_t m = times.size() / 2;
  return times.size() % 2 ? times[m] : 0.5 * (times[m - 1] + times[m]);
}

/// torch.topk(|x|, k) on GPU 0 in a child `python`: the median seconds of `runs` CUDA-event-timed
/// calls on a fresh Gaussian tensor of n fp32 elements, or nullopt (and why) when PyTorch with
/// CUDA cannot be used.
std::optional<double> torchTopkSeconds(const std::string& python, size_t n, size_t k, int runs,
                                       std::string* why) {
  const std::string script =
      "import sys\n"
      "try:\n"
      "    import torch\n"
      "except Exception as e:\n"
      "    print('skip: cannot import torch:', e); sys.exit(0)\n"
      "if not torch.cuda.is_available():\n"
      "    print('skip: torch.cuda.is_available() is False'); sys.exit(0)\n"
      "n, k, runs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])\n"
      "g = torch.Generator(device='cuda'); g.manual_seed(1)\n"
      "x = torch.randn(n, device='cuda', generator=g)\n"
      "torch.topk(x.abs(), k, sorted=False); torch.cuda.synchronize()\n"
      "ts = []\n"
      "for _ in range(runs):\n"
      "    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)\n"
      "    s.record(); torch.topk(x.abs(), k, sorted=False); e.record()\n"
      "    torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 1e3)\n"
      "ts.sort(); print('seconds', ts[len(ts) // 2])\n";
  // The script goes through a temporary file: no shell quoting of program text.
  char path[] = "/tmp/lightwire-torch-topk-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) {
    *why = "cannot create a temporary file";
    return std::nullopt;
  }
  FILE* f = fdopen(fd, "w");
  std::fputs(script.c_str(), f);
  std::fclose(f);
  const std::string cmd = "'" + python + "' " + path + " " + std::to_string(n) + " " +
                          std::to_string(k) + " " + std::to_string(runs) + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  if (p != nullptr) {
    char buf[512];
    while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
    const int rc = pclose(p);
    if (rc != 0) out += " (exit " + std::to_string(WEXITSTATUS(rc)) + ")";
  }
  std::remove(path);
  const size_t at = out.rfind("seconds ");
  if (at == std::string::npos) {
    while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
    *why = out.empty() ? "no output from " + python
                       : out.substr(out.size() > 300 ? out.size() - 300 : 0);
    return std::nullopt;
  }
  return std::strtod(out.c_str() + at + 8, nullptr);
}

}  // namespace

bool cudaBenchBuilt() { return true; }

Result<BenchResult> benchCodecCuda(const CodecConfig& config, std::span<const float> input,
                                   const BenchSettings& settings, const std::string& python,
                                   const std::function<void(const std::string&)>& progress) {
  int devices = 0;
  if (cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    return failedPrecondition(std::string("no CUDA device: ") +
                              (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices"));
  }
  LW_RETURN_IF_ERROR(cudaStatus(cudaSetDevice(0), "cudaSetDevice(0)"));
  auto made = kernels::cuda::createCudaCodec(config);
  if (!made) return made.status();
  const CudaCodec& codec = **made;
  if (codec.traits().rounds > 1) {
    return failedPrecondition("bench codec --device cuda measures single-round codecs; " +
                              config.name + " runs " + std::to_string(codec.traits().rounds) +
                              " rounds (use --device cpu)");
  }
  const size_t n = input.size();
  const int runs = std::max(settings.runs, kMinRuns);

  BenchResult r;
  r.device = "cuda";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) r.device_name = prop.name;
  r.label = makeLabel(config);
  r.config = config;
  r.params = effectiveParams(config, codec.host());
  r.elements = n;
  r.threads = 0;
  r.runs = runs;
  r.raw_bytes = n * sizeof(float);
  const Chunking chunking = kernels::chunkingFor(
      codec.host(), n, settings.chunk_elements ? settings.chunk_elements : kDefaultChunkElements);
  r.chunk_elements = chunking.chunk_elements;
  r.chunks = chunking.count();
  auto note = [&](const std::string& what) {
    if (progress) progress(r.label + " (cuda): " + what);
  };

  cudaStream_t stream = nullptr;
  LW_RETURN_IF_ERROR(cudaStatus(cudaStreamCreate(&stream), "cudaStreamCreate"));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{stream};

  DeviceAlloc d_in, d_copy, d_out, workspace, payloads, sizes, scratch;
  std::vector<size_t> offsets(chunking.count() + 1, 0);
  size_t scratch_bytes = 0;
  for (size_t c = 0; c < chunking.count(); ++c) {
    offsets[c + 1] = offsets[c] + ((codec.maxPayloadBytes(chunking.size(c)) + 255) & ~size_t{255});
    scratch_bytes = std::max(scratch_bytes, codec.accumulateScratchBytes(chunking.size(c)));
  }
  LW_RETURN_IF_ERROR(d_in.allocate(n * sizeof(float), "the input"));
  LW_RETURN_IF_ERROR(d_copy.allocate(n * sizeof(float), "the copy baseline"));
  LW_RETURN_IF_ERROR(d_out.allocate(n * sizeof(float), "the decoded output"));
  LW_RETURN_IF_ERROR(workspace.allocate(codec.workspaceBytes(chunking), "the workspace"));
  LW_RETURN_IF_ERROR(payloads.allocate(offsets.back(), "the payloads"));
  LW_RETURN_IF_ERROR(sizes.allocate(chunking.count() * sizeof(uint64_t), "the payload sizes"));
  LW_RETURN_IF_ERROR(scratch.allocate(scratch_bytes, "the decode scratch"));
  auto state_r = DeviceState::create(codec.stateFloats(n));
  if (!state_r) return state_r.status();
  DeviceState state = std::move(*state_r);
  LW_RETURN_IF_ERROR(cudaStatus(
      cudaMemcpy(d_in.as(), input.data(), n * sizeof(float), cudaMemcpyHostToDevice), "upload"));
  LW_RETURN_IF_ERROR(cudaStatus(cudaMemset(d_out.as(), 0, n * sizeof(float)), "memset"));

  StepContext ctx;
  ctx.seed = 0;
  ctx.name_key = kernels::tensorNameKey("lightwire.bench");
  ctx.step = 1;
  ctx.rank = 0;
  const DeviceTensor tensor{d_in.as(), n, DType::kF32};

  note("device-to-device copy baseline");
  auto copy_s = medianEventSeconds(runs, stream, [&] {
    return cudaStatus(cudaMemcpyAsync(d_copy.as(), d_in.as(), n * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream),
                      "cudaMemcpyAsync");
  });
  if (!copy_s) return copy_s.status();
  r.memcpy_s = *copy_s;

  // Compress: analyze + every chunk's encode. State is never committed: every run does the same.
  note("compress");
  auto compress_s = medianEventSeconds(runs, stream, [&]() -> Status {
    LW_RETURN_IF_ERROR(codec.analyze(ctx, chunking, tensor, state, workspace.span(), stream));
    for (size_t c = 0; c < chunking.count(); ++c) {
      LW_RETURN_IF_ERROR(codec.encodeChunk(ctx, chunking, c, 0, {}, tensor, state, workspace.span(),
                                           payloads.as() + offsets[c], sizes.as<uint64_t>() + c,
                                           stream));
    }
    return Status::ok();
  });
  if (!compress_s) return compress_s.status();
  r.compress_s = *compress_s;
  std::vector<uint64_t> host_sizes(chunking.count());
  LW_RETURN_IF_ERROR(
      cudaStatus(cudaMemcpy(host_sizes.data(), sizes.as(), host_sizes.size() * sizeof(uint64_t),
                            cudaMemcpyDeviceToHost),
                 "reading the payload sizes"));
  for (uint64_t s : host_sizes) r.wire_bytes += s;

  // Decompress: every chunk's device payload accumulated into the output (weight 1).
  note("decompress");
  auto decompress_s = medianEventSeconds(runs, stream, [&]() -> Status {
    for (size_t c = 0; c < chunking.count(); ++c) {
      LW_RETURN_IF_ERROR(codec.accumulate(payloads.as() + offsets[c], 1.0f,
                                          d_out.as<float>() + chunking.begin(c), chunking.size(c),
                                          scratch.span(), stream));
    }
    return Status::ok();
  });
  if (!decompress_s) return decompress_s.status();
  r.decompress_s = *decompress_s;

  if (isSelection(config.name)) {
    if (auto density = effectiveDensity(config); density && n > 0) {
      note("torch.topk baseline (" + python + ")");
      std::string why;
      r.torch_topk_s = torchTopkSeconds(python, n, kernels::selectionSize(n, *density), runs, &why);
      if (!r.torch_topk_s) note("torch.topk baseline skipped: " + why);
    }
  }
  return r;
}

#endif

}  // namespace lightwire::proxy
