// The step pipeline's GPU backend (proxy/step/gpu_backend.h, Contribution::device, docs/cuda.md
// "Steps on the GPU") against its host backend, on a real GPU: the same contributions — gradients
// in cudaMalloc'd memory, with a host staging copy and fetch/store lambdas as a CUDA IPC region
// has, so that either path can take them — go to an engine with options.gpu = true and to one with
// options.gpu = false (same seed, same options, LocalExchange behind a recorder), step after step,
// and everything must agree bit for bit: each trainer's result read back from its device memory,
// the figures, every exchanged payload, the policies' statistics record and state, and the
// checkpointed codec state. Skipped without a GPU (tests/kernels/cuda/main.cc).
#include <cuda_runtime_api.h>
#include <doctest.h>

#include <boost/json/serialize.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/codec.h"
#include "kernels/dtype.h"
#include "kernels/registry.h"
#include "metrics/metrics.h"
#include "policies/checkpoint.h"
#include "policies/policy.h"
#include "policies/stats.h"
#include "proxy/step/engine.h"
#include "proxy/step/gpu_backend.h"
#include "proxy/step/pipeline.h"
#include "tests/temp_dir.h"

using namespace lightwire;
using namespace lightwire::proxy;
using kernels::DType;

namespace {

// Generous: the first step on the GPU loads the CUDA modules of every codec.
constexpr auto kWait = std::chrono::seconds(60);
constexpr std::byte kPoison{0xA5};  // host staging of GPU-path steps: must stay untouched
const char* const kGpu = "cuda:0";

void cudaOk(cudaError_t e, const char* what) {
  if (e != cudaSuccess) FAIL(what << ": " << cudaGetErrorString(e));
}

// --- one trainer's device buffer -----------------------------------------------------------------

/// One trainer's tensor in device memory (cudaMalloc, device 0), with the host staging copy and the
/// fetch/store of a CUDA IPC region (ipc/cuda_ipc.h): fetch copies device -> staging, store
/// staging -> device. Counts what the engine called.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t n) : bytes(n), staging(n) {
    cudaOk(cudaMalloc(&dev, std::max<size_t>(n, 1)), "cudaMalloc");
  }
  ~DeviceBuffer() {
    if (dev != nullptr) cudaFree(dev);
    if (pinned != nullptr) cudaFreeHost(pinned);
    if (event != nullptr) cudaEventDestroy(event);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void upload(std::span<const std::byte> b) {
    REQUIRE(b.size() == bytes);
    cudaOk(cudaMemcpy(dev, b.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    // From pageable memory cudaMemcpy may return before the DMA has landed: complete it, as a
    // trainer's event would (the engine's stream need not be ordered after the legacy stream).
    cudaOk(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize");
  }
  std::vector<std::byte> download() const {
    std::vector<std::byte> out(bytes);
    cudaOk(cudaMemcpy(out.data(), dev, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    return out;
  }
  void resetCounters() {
    fetches = 0;
    stores = 0;
    waits = 0;
  }

  size_t bytes;
  void* dev = nullptr;
  std::vector<std::byte> staging;
  std::atomic<unsigned> fetches{0}, stores{0}, waits{0};
  // The trainer's event (recorded after the work that produced the gradient): `wait` makes the
  // engine's stream wait for it, `fetch` waits for it on the host. Null: nothing to wait for.
  cudaEvent_t event = nullptr;
  void* pinned = nullptr;  // pinned upload source of asynchronous uploads
  bool fail_wait = false;  // `wait` reports an error
};

/// How a trainer hands its tensor to the engine.
enum class Memory {
  kDevice,  // device memory (Contribution::device on GPU 0) + staging, fetch and store
  kHost,    // host memory only (a shared-memory region): no device, no fetch/store
};

Contribution contributionOf(const std::shared_ptr<DeviceBuffer>& buf, const TensorSpec& spec,
                            Memory memory) {
  Contribution c;
  c.spec = spec;
  c.data = buf->staging.data();
  c.keep_alive = buf;
  if (memory == Memory::kHost) return c;
  DeviceBuffer* b = buf.get();  // kept alive by keep_alive, destroyed after the lambdas
  c.fetch = [b](std::string* why) {
    ++b->fetches;
    if (b->event != nullptr) {
      if (const cudaError_t e = cudaEventSynchronize(b->event); e != cudaSuccess) {
        *why = cudaGetErrorString(e);
        return false;
      }
    }
    const cudaError_t e = cudaMemcpy(b->staging.data(), b->dev, b->bytes, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) *why = cudaGetErrorString(e);
    return e == cudaSuccess;
  };
  c.store = [b](std::string* why) {
    ++b->stores;
    cudaError_t e = cudaMemcpy(b->dev, b->staging.data(), b->bytes, cudaMemcpyHostToDevice);
    // Complete before the reply, as a CUDA IPC region's store is.
    if (e == cudaSuccess) e = cudaStreamSynchronize(nullptr);
    if (e != cudaSuccess) *why = cudaGetErrorString(e);
    return e == cudaSuccess;
  };
  Contribution::Device d;
  d.ordinal = 0;
  d.ptr = b->dev;
  d.wait = [b](void* stream, std::string* error) {
    ++b->waits;
    if (b->fail_wait) {
      *error = "injected: the trainer's event could not be waited on";
      return false;
    }
    if (b->event == nullptr) return true;
    const cudaError_t e = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), b->event, 0);
    if (e != cudaSuccess) *error = cudaGetErrorString(e);
    return e == cudaSuccess;
  };
  c.device = std::move(d);
  return c;
}

// --- an exchange that records what crosses it ----------------------------------------------------

/// What one exchange round carried (this sidecar's side).
struct RoundRecord {
  std::string tensor;
  uint64_t step = 0;
  int round = 0;
  std::optional<double> density;
  std::vector<uint8_t> stats;
  std::vector<std::vector<uint8_t>> payloads;  // per chunk
};

/// LocalExchange (world size 1), recording every round's payloads and statistics record.
class RecordingExchange final : public Exchange {
 public:
  unsigned worldSize() const override { return 1; }
  Result<std::vector<std::vector<std::span<const uint8_t>>>> run(ExchangeRound& round) override {
    // A failure after compression (a peer gone, a corrupt frame): the step fails here.
    if (fail_rounds.load() > 0) {
      fail_rounds.fetch_sub(1);
      return Status(StatusCode::kUnavailable, "exchange failed (injected by the test)");
    }
    RoundRecord r;
    r.tensor = round.tensor;
    r.step = round.step;
    r.round = round.round;
    r.density = round.density;
    r.stats.assign(round.stats_out.begin(), round.stats_out.end());
    for (const auto& p : round.payloads) r.payloads.emplace_back(p.begin(), p.end());
    {
      std::lock_guard lock(mu_);
      log_.push_back(std::move(r));
    }
    return inner_.run(round);
  }
  std::vector<RoundRecord> take() {
    std::lock_guard lock(mu_);
    return std::exchange(log_, {});
  }
  std::atomic<int> fail_rounds{0};  // rounds still to fail

 private:
  LocalExchange inner_;
  std::mutex mu_;
  std::vector<RoundRecord> log_;
};

// --- an engine under test ------------------------------------------------------------------------

EngineOptions baseOptions(unsigned trainers) {
  EngineOptions o;
  o.local_trainers = trainers;
  o.threads = 2;
  o.chunk_elements = 4096;  // every tensor above 4 Ki elements is several chunks
  o.step_timeout = std::chrono::milliseconds(30000);
  o.seed = 0x5EED;
  o.rank = 0;
  o.job_id = "gpu-test";
  return o;
}

CodecChooser always(const kernels::CodecConfig& c) {
  return [c](const TensorFacts&) { return TensorSettings(c); };
}

/// One engine with its metrics, recording exchange, optional policies and the trainers' buffers.
struct Side {
  Side(EngineOptions o, bool gpu, CodecChooser chooser,
       const std::optional<policies::PolicyConfig>& pc = std::nullopt,
       const std::string& state_dir = "")
      : policy(pc ? std::make_unique<policies::PolicyEngine>(*pc, "{}", &metrics) : nullptr),
        engine(configure(o, gpu, policy.get(), state_dir), std::move(chooser), metrics, exchange) {}
  static EngineOptions configure(EngineOptions o, bool gpu, policies::PolicyEngine* p,
                                 const std::string& dir) {
    o.gpu = gpu;
    o.policy = p;
    o.state_dir = dir;
    return o;
  }
  /// Trainer k's buffer for `tensor` (reused from step to step, as a DDP bucket is; a new one when
  /// the size changes).
  std::shared_ptr<DeviceBuffer> buffer(const std::string& tensor, unsigned k, size_t bytes) {
    auto& v = buffers[tensor];
    if (v.size() <= k) v.resize(k + 1);
    if (!v[k] || v[k]->bytes != bytes) v[k] = std::make_shared<DeviceBuffer>(bytes);
    return v[k];
  }

  std::map<std::string, std::vector<std::shared_ptr<DeviceBuffer>>> buffers;
  metrics::Metrics metrics;
  RecordingExchange exchange;
  std::unique_ptr<policies::PolicyEngine> policy;
  StepEngine engine;
};

/// One step as one engine ran it.
struct Run {
  DType dtype = DType::kF32;
  std::vector<StepOutcome> outcomes;            // per trainer
  std::vector<std::vector<std::byte>> results;  // per trainer: its memory after the reply
  std::vector<Memory> memory;
  std::vector<bool> staging_untouched;  // device trainers: the host staging still holds kPoison
  unsigned fetches = 0, stores = 0, waits = 0;
  std::vector<RoundRecord> rounds;
  std::string policy_state;  // PolicyEngine::stateJson() after the step ("" without policies)
};

std::vector<std::byte> encodeAs(const std::vector<float>& values, DType dtype) {
  const size_t width = kernels::dtypeSize(dtype);
  std::vector<std::byte> bytes(values.size() * width);
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h =
          dtype == DType::kF16 ? kernels::floatToHalf(values[i]) : kernels::floatToBf16(values[i]);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return bytes;
}

float valueAt(const std::vector<std::byte>& bytes, DType dtype, size_t i) {
  uint16_t h = 0;
  float f = 0;
  switch (dtype) {
    case DType::kF32:
      std::memcpy(&f, bytes.data() + 4 * i, 4);
      return f;
    case DType::kF16:
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      return kernels::halfToFloat(h);
    case DType::kBF16:
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      return kernels::bf16ToFloat(h);
  }
  return f;
}

/// Uploads trainer k's gradient into its device buffer before the step (default: synchronously).
using Uploader = std::function<void(unsigned k, DeviceBuffer&, std::span<const std::byte>)>;

/// Submits every trainer's part of (name, step) to `side` and waits for every reply.
Run runStep(Side& side, const std::string& name, uint64_t step, DType dtype,
            const std::vector<std::vector<float>>& inputs, std::vector<Memory> memory = {},
            const std::vector<uint64_t>& shape = {}, const Uploader& upload = {}) {
  const unsigned trainers = static_cast<unsigned>(inputs.size());
  if (memory.empty()) memory.assign(trainers, Memory::kDevice);
  REQUIRE(memory.size() == trainers);
  Run run;
  run.dtype = dtype;
  run.memory = memory;
  std::vector<std::shared_ptr<DeviceBuffer>> bufs;
  std::vector<std::future<StepOutcome>> futures;
  for (unsigned k = 0; k < trainers; ++k) {
    const std::vector<std::byte> bytes = encodeAs(inputs[k], dtype);
    auto buf = side.buffer(name, k, bytes.size());
    buf->resetCounters();
    if (memory[k] == Memory::kHost) {
      std::copy(bytes.begin(), bytes.end(), buf->staging.begin());
    } else {
      std::fill(buf->staging.begin(), buf->staging.end(), kPoison);
      if (upload) {
        upload(k, *buf, bytes);
      } else {
        buf->upload(bytes);
      }
    }
    bufs.push_back(buf);
  }
  for (unsigned k = 0; k < trainers; ++k) {
    TensorSpec spec;
    spec.name = name;
    spec.step = step;
    spec.trainer = k;
    spec.dtype = dtype;
    spec.shape = shape;
    spec.elements = inputs[k].size();
    auto promise = std::make_shared<std::promise<StepOutcome>>();
    futures.push_back(promise->get_future());
    side.engine.submit(contributionOf(bufs[k], spec, memory[k]),
                       [promise](StepOutcome o) { promise->set_value(std::move(o)); });
  }
  for (unsigned k = 0; k < trainers; ++k) {
    if (futures[k].wait_for(kWait) != std::future_status::ready) {
      FAIL("tensor '" << name << "' step " << step << ": no reply within 60 s");
    }
    run.outcomes.push_back(futures[k].get());
  }
  for (unsigned k = 0; k < trainers; ++k) {
    DeviceBuffer& b = *bufs[k];
    if (memory[k] == Memory::kHost) {
      run.results.push_back(b.staging);
      run.staging_untouched.push_back(false);
    } else {
      run.results.push_back(b.download());
      run.staging_untouched.push_back(std::all_of(b.staging.begin(), b.staging.end(),
                                                  [](std::byte x) { return x == kPoison; }));
    }
    run.fetches += b.fetches;
    run.stores += b.stores;
    run.waits += b.waits;
  }
  run.rounds = side.exchange.take();
  if (side.policy) run.policy_state = boost::json::serialize(side.policy->stateJson());
  return run;
}

// --- comparisons ---------------------------------------------------------------------------------

bool isNan(const std::vector<std::byte>& bytes, DType dtype, size_t i) {
  return std::isnan(valueAt(bytes, dtype, i));
}

/// "" when a and b hold the same elements bit for bit (NaN against NaN of any payload counts as
/// equal when nan_equal: IEEE-754 leaves NaN payloads to the hardware, docs/determinism.md §1),
/// else a description of the first difference.
std::string difference(const std::vector<std::byte>& a, const std::vector<std::byte>& b,
                       DType dtype, bool nan_equal) {
  if (a.size() != b.size()) {
    return "sizes differ: " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  }
  const size_t width = kernels::dtypeSize(dtype), n = a.size() / width;
  size_t differing = 0, first = n;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(a.data() + i * width, b.data() + i * width, width) == 0) continue;
    if (nan_equal && isNan(a, dtype, i) && isNan(b, dtype, i)) continue;
    if (differing++ == 0) first = i;
  }
  if (differing == 0) return "";
  char buf[200];
  std::snprintf(buf, sizeof buf, "%zu of %zu elements differ; first: [%zu] %.9g vs %.9g", differing,
                n, first, static_cast<double>(valueAt(a, dtype, first)),
                static_cast<double>(valueAt(b, dtype, first)));
  return buf;
}

std::string describeStats(const std::vector<uint8_t>& record) {
  auto s = policies::decodeStats(record);
  if (!s) return "(undecodable: " + s.status().message() + ")";
  char buf[300];
  std::snprintf(buf, sizeof buf,
                "grad_norm2 %.17g nonfinite %llu elements %llu small %llu residual_norm2 %.17g "
                "cos %s",
                s->grad_norm2, static_cast<unsigned long long>(s->nonfinite),
                static_cast<unsigned long long>(s->elements),
                static_cast<unsigned long long>(s->small), s->residual_norm2,
                s->cos_dot ? "measured" : "none");
  return buf;
}

void checkFiguresEqual(const StepFigures& g, const StepFigures& c) {
  CHECK(g.codec == c.codec);
  CHECK(g.elements == c.elements);
  CHECK(g.raw_bytes == c.raw_bytes);
  CHECK(g.wire_bytes == c.wire_bytes);
  CHECK(g.nonfinite == c.nonfinite);
  CHECK(g.state_reset == c.state_reset);
  CHECK(g.mode == c.mode);
  CHECK(g.settings == c.settings);
}

/// What crossed the exchange: the same rounds, densities, statistics records and payloads. A
/// non-finite step's payloads may hold NaNs whose bits differ: their sizes must still agree.
void checkRoundsEqual(const std::vector<RoundRecord>& g, const std::vector<RoundRecord>& c,
                      bool nonfinite) {
  REQUIRE_MESSAGE(g.size() == c.size(),
                  "exchange rounds: GPU " << g.size() << ", host " << c.size());
  for (size_t r = 0; r < g.size(); ++r) {
    CAPTURE(r);
    CHECK(g[r].tensor == c[r].tensor);
    CHECK(g[r].step == c[r].step);
    CHECK(g[r].round == c[r].round);
    CHECK(g[r].density == c[r].density);
    CHECK_MESSAGE(g[r].stats == c[r].stats, "statistics record differs: GPU "
                                                << describeStats(g[r].stats) << "; host "
                                                << describeStats(c[r].stats));
    REQUIRE(g[r].payloads.size() == c[r].payloads.size());
    for (size_t chunk = 0; chunk < g[r].payloads.size(); ++chunk) {
      CAPTURE(chunk);
      CHECK(g[r].payloads[chunk].size() == c[r].payloads[chunk].size());
      if (!nonfinite) CHECK_MESSAGE(g[r].payloads[chunk] == c[r].payloads[chunk], "payload bytes");
    }
  }
}

/// The GPU engine's run of a step against the host engine's run of the same step: every reply 200,
/// equal figures, results bit for bit (each trainer's memory), the same exchange traffic and
/// policy state. `gpu_path`: whether the GPU engine must have run it on the GPU (cuda:0; then
/// without touching data, fetch or store) or on the host ("cpu", staging like the host engine).
void checkSame(const Run& gpu, const Run& cpu, bool gpu_path = true) {
  const size_t trainers = gpu.outcomes.size();
  REQUIRE(cpu.outcomes.size() == trainers);
  for (size_t k = 0; k < trainers; ++k) {
    REQUIRE_MESSAGE(gpu.outcomes[k].ok(),
                    "GPU engine: " << gpu.outcomes[k].error << ": " << gpu.outcomes[k].message);
    REQUIRE_MESSAGE(cpu.outcomes[k].ok(),
                    "host engine: " << cpu.outcomes[k].error << ": " << cpu.outcomes[k].message);
  }
  const StepFigures& gf = gpu.outcomes[0].figures;
  const StepFigures& cf = cpu.outcomes[0].figures;
  CHECK(gf.device == (gpu_path ? kGpu : "cpu"));
  CHECK(cf.device == "cpu");
  checkFiguresEqual(gf, cf);
  for (size_t k = 1; k < trainers; ++k) {
    CHECK(gpu.outcomes[k].figures.device == gf.device);
    CHECK(gpu.outcomes[k].figures.wire_bytes == gf.wire_bytes);
    CHECK(cpu.outcomes[k].figures.device == "cpu");
  }
  const bool nonfinite = cf.nonfinite;
  for (size_t k = 0; k < trainers; ++k) {
    CAPTURE(k);
    const std::string d = difference(gpu.results[k], cpu.results[k], gpu.dtype, nonfinite);
    CHECK_MESSAGE(d.empty(), "trainer " << k << "'s result, GPU engine vs host engine: " << d);
    // Every trainer gets the same result.
    if (k > 0) CHECK(difference(gpu.results[k], gpu.results[0], gpu.dtype, nonfinite).empty());
  }
  size_t device_trainers = 0;
  for (Memory m : cpu.memory) device_trainers += m != Memory::kHost;
  // The host engine staged every device trainer through fetch and store.
  CHECK(cpu.fetches >= device_trainers);
  CHECK(cpu.stores >= device_trainers);
  if (gpu_path) {
    CHECK_MESSAGE(gpu.fetches == 0, "the GPU path called fetch");
    CHECK_MESSAGE(gpu.stores == 0, "the GPU path called store");
    CHECK_MESSAGE(gpu.waits >= trainers, "the GPU path did not call every trainer's wait");
    for (size_t k = 0; k < trainers; ++k) {
      CHECK_MESSAGE(gpu.staging_untouched[k], "the GPU path touched trainer " << k << "'s data");
    }
  } else {
    CHECK(gpu.fetches >= device_trainers);
    CHECK(gpu.stores >= device_trainers);
  }
  checkRoundsEqual(gpu.rounds, cpu.rounds, nonfinite);
  CHECK_MESSAGE(
      gpu.policy_state == cpu.policy_state,
      "policy state differs:\nGPU:  " << gpu.policy_state << "\nhost: " << cpu.policy_state);
}

// --- inputs --------------------------------------------------------------------------------------

std::vector<float> randomValues(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = dist(gen);
    if (x == 0.0f) x = scale;
  }
  return v;
}

/// Every trainer's gradient of one step (distinct, reproducible).
std::vector<std::vector<float>> gradients(unsigned trainers, size_t n, uint32_t seed,
                                          float scale = 1.0f) {
  std::vector<std::vector<float>> out;
  for (unsigned k = 0; k < trainers; ++k) {
    out.push_back(randomValues(n, seed * 7919u + k * 104729u + 1, scale * (1.0f + 0.25f * k)));
  }
  return out;
}

/// Both engines, GPU and host, with the same options, chooser and policies.
struct Pair {
  Pair(const EngineOptions& o, const CodecChooser& chooser,
       const std::optional<policies::PolicyConfig>& pc = std::nullopt,
       const std::string& gpu_dir = "", const std::string& cpu_dir = "")
      : gpu(o, true, chooser, pc, gpu_dir), cpu(o, false, chooser, pc, cpu_dir) {}
  /// Runs the step on both engines and checks that they agree; returns (GPU run, host run).
  std::pair<Run, Run> step(const std::string& name, uint64_t step, DType dtype,
                           const std::vector<std::vector<float>>& inputs,
                           const std::vector<Memory>& memory = {},
                           const std::vector<uint64_t>& shape = {}, bool gpu_path = true) {
    Run g = runStep(gpu, name, step, dtype, inputs, memory, shape);
    Run c = runStep(cpu, name, step, dtype, inputs, memory, shape);
    checkSame(g, c, gpu_path);
    return {std::move(g), std::move(c)};
  }
  Side gpu, cpu;
};

// --- codec configurations ------------------------------------------------------------------------

kernels::CodecConfig named(const std::string& name) {
  kernels::CodecConfig c;
  c.name = name;
  return c;
}

/// The configurations every CUDA codec is tried with: its defaults and a second, different one
/// (other parameters, value encoding or error feedback). Empty for a codec this test does not
/// know yet (the test case then fails, naming it).
std::vector<kernels::CodecConfig> configsFor(const std::string& name) {
  std::vector<kernels::CodecConfig> out;
  kernels::CodecConfig a = named(name), b = named(name);
  if (name == "none" || name == "bf16") {
    out = {a};
  } else if (name == "fp16") {
    b.error_feedback = true;
    out = {a, b};
  } else if (name == "qsgd") {
    a.bits = 4;
    a.bucket_size = 512;
    b.bits = 8;
    b.bucket_size = 7;  // odd buckets across chunk ends
    b.error_feedback = true;
    out = {a, b};
  } else if (name == "terngrad" || name == "signsgd" || name == "onebit") {
    b.bucket_size = 100;
    b.error_feedback = !kernels::createCodec(a).value()->traits().default_error_feedback;
    out = {a, b};
  } else if (name == "topk") {
    a.density = 0.01;
    b.density = 0.05;
    b.sparse_values = DType::kF16;
    b.error_feedback = false;
    out = {a, b};
  } else if (name == "threshold") {
    a.threshold = 1.5;
    b.threshold = 0.5;
    b.sparse_values = DType::kF16;
    b.min_magnitude = 0.75;
    out = {a, b};
  } else if (name == "dgc") {
    a.density = 0.01;
    a.momentum = 0.9;
    b.density = 0.05;
    b.momentum = 0.0;
    b.clip_norm = 50.0;
    b.sample_fraction = 0.005;
    b.sparse_values = DType::kF16;
    out = {a, b};
  } else if (name == "randomk") {
    a.density = 0.05;
    b.density = 0.1;
    b.sparse_values = DType::kF16;
    b.error_feedback = true;
    out = {a, b};
  } else if (name == "powersgd") {
    a.approx_rank = 1;
    b.approx_rank = 4;
    out = {a, b};
  }
  return out;
}

std::string describe(const kernels::CodecConfig& c) { return kernels::configKey(c); }

policies::PolicyConfig quickPolicies() {
  policies::PolicyConfig c;
  c.bypass_steps = 3;
  c.full_sync_every = 0;
  c.min_magnitude = 0;
  return c;
}

const DType kDTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

}  // namespace

// --- every codec ---------------------------------------------------------------------------------

TEST_CASE(
    "every CUDA codec: GPU steps equal host steps bit for bit (dtypes, 1 and 3 trainers, "
    "chunked and odd sizes)") {
  struct Size {
    size_t n;
    std::vector<uint64_t> shape;
  };
  // Chunks of 4096: one element, just over one chunk, ten chunks (odd), 2-D (PowerSGD's matrix).
  const std::vector<Size> sizes = {{1, {}}, {4097, {}}, {39999, {}}, {40000, {160, 250}}};
  const std::vector<std::string> names = kernels::cuda::cudaCodecNames();
  REQUIRE_FALSE(names.empty());
  std::string where;
  CAPTURE(where);
  for (const std::string& name : names) {
    const auto configs = configsFor(name);
    CHECK_MESSAGE(!configs.empty(), "codec '" << name << "' has a CUDA implementation but no "
                                              << "configuration in this test: add it to "
                                              << "configsFor()");
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      const kernels::CodecConfig& config = configs[ci];
      REQUIRE_MESSAGE(kernels::createCodec(config).isOk(), describe(config));
      for (unsigned trainers : {1u, 3u}) {
        Pair pair(baseOptions(trainers), always(config));
        for (DType dtype : kDTypes) {
          for (const Size& size : sizes) {
            const std::string tensor =
                std::string("g.") + apiDTypeName(dtype) + "." + std::to_string(size.n);
            for (uint64_t step = 1; step <= 3; ++step) {
              where = describe(config) + " trainers " + std::to_string(trainers) + " tensor " +
                      tensor + " step " + std::to_string(step);
              const uint32_t seed = static_cast<uint32_t>(ci * 1000 + step * 10 + size.n % 97);
              auto [g, c] =
                  pair.step(tensor, step, dtype,
                            gradients(trainers, size.n, seed, 1.0f + 0.5f * step), {}, size.shape);
              CHECK(g.outcomes[0].figures.codec == name);
              CHECK(g.outcomes[0].figures.mode == "compressed");
              CHECK(g.outcomes[0].figures.state_reset == false);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("edge values: signed zeros, subnormals and large values stay bit-identical") {
  // -0 + -0 is -0 but 0 + -0 is +0: the local sum must start where the host's does.
  auto edgy = [](size_t n, DType dtype, unsigned k) {
    std::vector<float> v(n);
    const float large = dtype == DType::kF16 ? 60000.0f : 1e30f;
    for (size_t i = 0; i < n; ++i) {
      switch ((i + k) % 8) {
        case 0:
          v[i] = -0.0f;
          break;
        case 1:
          v[i] = 0.0f;
          break;
        case 2:
          v[i] = 1e-40f;  // fp32 subnormal
          break;
        case 3:
          v[i] = -1e-39f;
          break;
        case 4:
          v[i] = 6e-8f;  // fp16 subnormal
          break;
        case 5:
          v[i] = (i % 3 == 0 ? -large : large);
          break;
        default:
          v[i] = static_cast<float>(i % 13) - 6.5f;
      }
    }
    // A stretch of -0 in every trainer: their sum is -0.
    for (size_t i = 0; i < std::min<size_t>(n, 64); ++i) v[i] = -0.0f;
    return v;
  };
  std::string where;
  CAPTURE(where);
  for (const char* name : {"none", "fp16", "bf16", "topk", "qsgd", "signsgd"}) {
    kernels::CodecConfig config = named(name);
    if (config.name == "topk") config.density = 0.1;
    for (unsigned trainers : {1u, 3u}) {
      Pair pair(baseOptions(trainers), always(config));
      for (DType dtype : kDTypes) {
        for (uint64_t step = 1; step <= 2; ++step) {
          where = std::string(name) + " trainers " + std::to_string(trainers) + " " +
                  apiDTypeName(dtype) + " step " + std::to_string(step);
          std::vector<std::vector<float>> inputs;
          for (unsigned k = 0; k < trainers; ++k) inputs.push_back(edgy(9001, dtype, k));
          pair.step(std::string("edge.") + apiDTypeName(dtype), step, dtype, inputs);
        }
      }
    }
  }
}

// --- non-finite steps ----------------------------------------------------------------------------

TEST_CASE(
    "a NaN step on the GPU: result returned, nonfinite, state not committed, as on the host") {
  std::vector<kernels::CodecConfig> configs;
  for (const char* name : {"topk", "dgc", "qsgd", "powersgd", "randomk", "fp16", "threshold"}) {
    auto c = configsFor(name);
    REQUIRE_FALSE(c.empty());
    configs.push_back(c.back());  // the second configuration: error feedback where it can be
  }
  const size_t n = 20001;
  std::string where;
  CAPTURE(where);
  for (const auto& config : configs) {
    for (unsigned trainers : {1u, 3u}) {
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        where =
            describe(config) + " trainers " + std::to_string(trainers) + " " + apiDTypeName(dtype);
        Pair pair(baseOptions(trainers), always(config));
        // The same GPU engine without the NaN step: steps 4 and 5 must not see it either.
        Side clean(baseOptions(trainers), true, always(config));
        // Without policies a step is non-finite when its result is. random-k may leave the NaN
        // and the Inf out of the result: that step is then finite and commits its state (NaN in
        // the residual) — on either path alike, which pair.step() checks; the rest does not apply.
        const bool may_miss = config.name == "randomk";
        bool flagged = true;
        for (uint64_t step = 1; step <= 5; ++step) {
          auto inputs = gradients(trainers, n, static_cast<uint32_t>(step * 31 + trainers));
          if (step == 3) {
            inputs[trainers - 1][17] = std::numeric_limits<float>::quiet_NaN();
            inputs[0][n - 2] = std::numeric_limits<float>::infinity();
          }
          auto [g, c] = pair.step("nan", step, dtype, inputs);
          const bool nonfinite = g.outcomes[0].figures.nonfinite;
          if (step == 3) {
            if (!may_miss) CHECK(nonfinite);
            flagged = nonfinite;
            continue;
          }
          if (!flagged) continue;
          CHECK_FALSE(nonfinite);
          Run r = runStep(clean, "nan", step, dtype, inputs);
          REQUIRE(r.outcomes[0].ok());
          CHECK(r.outcomes[0].figures.device == kGpu);
          for (unsigned k = 0; k < trainers; ++k) {
            CHECK_MESSAGE(difference(r.results[k], g.results[k], dtype, false).empty(),
                          "step " << step << ": the NaN step changed the state");
          }
        }
        CHECK(pair.gpu.engine.stepsOk() == 5);
      }
    }
  }
}

// --- policies ------------------------------------------------------------------------------------

TEST_CASE("policies on both paths: periodic full-sync flushes what the state held back") {
  policies::PolicyConfig pc = quickPolicies();
  pc.full_sync_every = 4;
  kernels::CodecConfig dgc = named("dgc");
  dgc.density = 0.05;
  dgc.momentum = 0.9;
  kernels::CodecConfig topk = named("topk");
  topk.density = 0.05;
  kernels::CodecConfig qsgd = named("qsgd");
  qsgd.bits = 4;
  qsgd.error_feedback = true;
  kernels::CodecConfig psgd = named("powersgd");
  psgd.approx_rank = 2;
  std::string where;
  CAPTURE(where);
  for (const auto& config : {topk, dgc, qsgd, psgd}) {
    for (auto [trainers, dtype] : {std::pair{1u, DType::kF32}, std::pair{3u, DType::kBF16}}) {
      Pair pair(baseOptions(trainers), always(config), pc);
      for (uint64_t step = 1; step <= 9; ++step) {
        where = describe(config) + " trainers " + std::to_string(trainers) + " step " +
                std::to_string(step);
        auto [g, c] =
            pair.step("fs", step, dtype, gradients(trainers, 20001, static_cast<uint32_t>(step)));
        CHECK(g.outcomes[0].figures.mode == (step % 4 == 0 ? "full_sync" : "compressed"));
      }
    }
  }
}

TEST_CASE("policies on both paths: NaN, then bypass for K steps, then compressed again") {
  kernels::CodecConfig topk = named("topk");
  topk.density = 0.1;
  kernels::CodecConfig psgd = named("powersgd");
  psgd.approx_rank = 2;
  std::string where;
  CAPTURE(where);
  for (const auto& config : {topk, psgd}) {
    for (auto [trainers, dtype] : {std::pair{1u, DType::kF16}, std::pair{3u, DType::kF32}}) {
      Pair pair(baseOptions(trainers), always(config), quickPolicies());
      for (uint64_t step = 1; step <= 9; ++step) {
        where = describe(config) + " trainers " + std::to_string(trainers) + " step " +
                std::to_string(step);
        auto inputs = gradients(trainers, 12345, static_cast<uint32_t>(100 + step));
        if (step == 5) inputs[0][4321] = std::numeric_limits<float>::quiet_NaN();
        auto [g, c] = pair.step("b", step, dtype, inputs);
        const std::string mode = g.outcomes[0].figures.mode;
        CHECK(g.outcomes[0].figures.nonfinite == (step == 5));
        CHECK(mode == (step >= 6 && step <= 8 ? "bypass" : "compressed"));
        if (step >= 6 && step <= 8 && trainers == 1) {
          // Dense, world size 1, one trainer: the gradient itself.
          CHECK(difference(g.results[0], encodeAs(inputs[0], dtype), dtype, false).empty());
        }
      }
    }
  }
}

// Delayed-sync tensors stay on the host path (their accumulation lives there, with checkpoints:
// docs/cuda.md "Steps on the GPU"), with device memory staged: the same results either way.
TEST_CASE("policies on both paths: a delayed-sync tensor stages through the host, same results") {
  std::string where;
  CAPTURE(where);
  kernels::CodecConfig topk = named("topk");
  topk.density = 0.1;
  kernels::CodecConfig qsgd = named("qsgd");
  qsgd.bits = 6;
  for (const auto& codec : {named("none"), topk, qsgd}) {
    CodecChooser chooser = [codec](const TensorFacts&) {
      TensorSettings s(codec);
      s.sync_every = 3;
      return s;
    };
    for (auto [trainers, dtype] : {std::pair{1u, DType::kF32}, std::pair{3u, DType::kF16}}) {
      Pair pair(baseOptions(trainers), chooser, quickPolicies());
      for (uint64_t step = 0; step < 9; ++step) {
        where = describe(codec) + " trainers " + std::to_string(trainers) + " step " +
                std::to_string(step);
        auto [g, c] = pair.step("d", step, dtype,
                                gradients(trainers, 9000, static_cast<uint32_t>(200 + step)), {},
                                {}, /*gpu_path=*/false);
        CHECK(g.outcomes[0].figures.mode == ((step + 1) % 3 == 0 ? "compressed" : "skip"));
        if ((step + 1) % 3 != 0) {
          const std::vector<std::byte> zeros = encodeAs(std::vector<float>(9000, 0.0f), dtype);
          CHECK(difference(g.results[0], zeros, dtype, false).empty());
        }
      }
    }
  }
}

TEST_CASE("policies on both paths: the statistics take the same decisions (explosion, adaptive)") {
  policies::PolicyConfig pc;
  pc.anomaly = true;
  pc.bypass_steps = 2;
  pc.baseline_steps = 3;
  pc.full_sync_every = 0;
  pc.min_magnitude = 1e-3;
  pc.adaptive = true;
  kernels::CodecConfig topk = named("topk");
  topk.density = 0.05;
  for (auto [trainers, dtype] : {std::pair{1u, DType::kF32}, std::pair{3u, DType::kBF16}}) {
    CAPTURE(trainers);
    Pair pair(baseOptions(trainers), always(topk), pc);
    const size_t n = 30000;
    std::vector<std::string> modes;
    for (uint64_t step = 1; step <= 12; ++step) {
      CAPTURE(step);
      std::vector<std::vector<float>> inputs;
      if (step == 6) {
        inputs = gradients(trainers, n, static_cast<uint32_t>(step), 1e4f);  // explosion
      } else if (step >= 9) {
        // 95 % below min_magnitude: an already-sparse gradient (adaptive: softer).
        inputs = gradients(trainers, n, static_cast<uint32_t>(step), 1e-6f);
        for (auto& v : inputs) {
          for (size_t i = 0; i < n; i += 20) v[i] = static_cast<float>(i % 7) - 3.5f;
        }
      } else {
        inputs = gradients(trainers, n, static_cast<uint32_t>(step));
      }
      auto [g, c] = pair.step("s", step, dtype, inputs);
      modes.push_back(g.outcomes[0].figures.mode);
    }
    // The scenario did what it is for (on both engines: their policy states are equal).
    CHECK(std::count(modes.begin(), modes.end(), "bypass") == 2);
    const std::string state = boost::json::serialize(pair.gpu.policy->stateJson());
    CHECK(state.find("explosion") != std::string::npos);
    CHECK(state.find("density scale") != std::string::npos);
  }
}

// --- checkpoints ---------------------------------------------------------------------------------

TEST_CASE("checkpoint on the GPU engine, resume on either: the same state, the same replay") {
  const testing::TempDir gpu_dir, cpu_dir;  // removed at the end
  const std::string& dir_gpu = gpu_dir.path();
  const std::string& dir_cpu = cpu_dir.path();
  struct TensorCase {
    std::string name;
    DType dtype;
    size_t n;
    std::vector<uint64_t> shape;
  };
  const std::vector<TensorCase> tensors = {{"w.dgc", DType::kF32, 20000, {}},
                                           {"w.psgd", DType::kBF16, 9999, {99, 101}},
                                           {"w.delay", DType::kF16, 12345, {}},
                                           {"w.qsgd", DType::kF32, 4097, {}}};
  CodecChooser chooser = [](const TensorFacts& t) {
    const std::string_view name = t.name;
    kernels::CodecConfig c;
    TensorSettings s;
    if (name == "w.dgc") {
      c.name = "dgc";
      c.density = 0.05;
      c.momentum = 0.9;
    } else if (name == "w.psgd") {
      c.name = "powersgd";
      c.approx_rank = 2;
    } else if (name == "w.delay") {
      c.name = "topk";
      c.density = 0.1;
      s.sync_every = 3;
    } else {
      c.name = "qsgd";
      c.bits = 4;
      c.error_feedback = true;
    }
    s.codec = c;
    return s;
  };
  const unsigned trainers = 3;
  const EngineOptions o = baseOptions(trainers);
  auto inputsOf = [&](const TensorCase& t, uint64_t step) {
    return gradients(trainers, t.n, static_cast<uint32_t>(step * 13 + t.n));
  };
  auto stepAll = [&](Side& gpu, Side& cpu, uint64_t step, std::map<std::string, Run>* out) {
    for (const auto& t : tensors) {
      CAPTURE(t.name);
      CAPTURE(step);
      Run g = runStep(gpu, t.name, step, t.dtype, inputsOf(t, step), {}, t.shape);
      Run c = runStep(cpu, t.name, step, t.dtype, inputsOf(t, step), {}, t.shape);
      checkSame(g, c, /*gpu_path=*/t.name != "w.delay");  // delayed sync: on the host
      if (out) (*out)[t.name] = std::move(c);
    }
  };

  std::map<uint64_t, std::map<std::string, Run>> reference;  // the host engine's first steps 7..9
  {
    Side gpu(o, true, chooser, quickPolicies(), dir_gpu),
        cpu(o, false, chooser, quickPolicies(), dir_cpu);
    for (uint64_t step = 1; step <= 6; ++step) stepAll(gpu, cpu, step, nullptr);
    auto path_gpu = gpu.engine.checkpoint(6);
    auto path_cpu = cpu.engine.checkpoint(6);
    REQUIRE_MESSAGE(path_gpu, path_gpu.status().message());
    REQUIRE_MESSAGE(path_cpu, path_cpu.status().message());

    // The files hold the same state: codec state (residuals, momentum, PowerSGD's factors)
    // downloaded from the device equals the host's, bit for bit; the delayed-sync accumulator too.
    policies::CheckpointExpect expect;
    expect.job_id = o.job_id;
    expect.step = 6;
    auto a = policies::readCheckpoint(*path_gpu, expect);
    auto b = policies::readCheckpoint(*path_cpu, expect);
    REQUIRE_MESSAGE(a, a.status().message());
    REQUIRE_MESSAGE(b, b.status().message());
    CHECK(a->policy_json == b->policy_json);
    REQUIRE(a->tensors.size() == tensors.size());
    REQUIRE(b->tensors.size() == tensors.size());
    bool any_accumulator = false;
    for (size_t i = 0; i < a->tensors.size(); ++i) {
      const auto &x = a->tensors[i], &y = b->tensors[i];
      CAPTURE(x.name);
      CHECK(x.name == y.name);
      CHECK(x.codec_key == y.codec_key);
      CHECK(x.elements == y.elements);
      CHECK(x.dtype == y.dtype);
      CHECK(x.last_committed == 6);
      CHECK(y.last_committed == 6);
      REQUIRE(x.state.size() == y.state.size());
      CHECK_MESSAGE(
          (x.state.empty() || std::memcmp(x.state.data(), y.state.data(), x.state.size() * 4) == 0),
          "codec state saved from the GPU differs from the host's");
      REQUIRE(x.accumulator.size() == y.accumulator.size());
      CHECK((x.accumulator.empty() || std::memcmp(x.accumulator.data(), y.accumulator.data(),
                                                  x.accumulator.size() * 4) == 0));
      any_accumulator = any_accumulator || !x.accumulator.empty();
      if (x.name != "w.delay") CHECK_FALSE(x.state.empty());
    }
    CHECK(any_accumulator);  // w.delay: step 6 accumulated, not sent (steps 2, 5, 8 send)

    for (uint64_t step = 7; step <= 9; ++step) stepAll(gpu, cpu, step, &reference[step]);

    // Resume both where they saved, and replay: the same results as the first time.
    REQUIRE(gpu.engine.resume(6).isOk());
    REQUIRE(cpu.engine.resume(6).isOk());
    for (uint64_t step = 7; step <= 9; ++step) {
      std::map<std::string, Run> again;
      stepAll(gpu, cpu, step, &again);
      for (const auto& t : tensors) {
        CAPTURE(t.name);
        CAPTURE(step);
        CHECK(
            difference(again[t.name].results[0], reference[step][t.name].results[0], t.dtype, false)
                .empty());
      }
    }
  }
  // Fresh engines (restarted sidecars) resume each other's files: the GPU engine the state the
  // host saved, the host engine the state the GPU saved.
  Side gpu(o, true, chooser, quickPolicies(), dir_cpu),
      cpu(o, false, chooser, quickPolicies(), dir_gpu);
  REQUIRE(gpu.engine.resume(6).isOk());
  REQUIRE(cpu.engine.resume(6).isOk());
  for (uint64_t step = 7; step <= 9; ++step) {
    std::map<std::string, Run> again;
    stepAll(gpu, cpu, step, &again);
    for (const auto& t : tensors) {
      CAPTURE(t.name);
      CAPTURE(step);
      CHECK_MESSAGE(
          difference(again[t.name].results[0], reference[step][t.name].results[0], t.dtype, false)
              .empty(),
          "the replay after resuming from the other path's checkpoint differs");
    }
  }
}

// --- which path a step takes ---------------------------------------------------------------------

// (Trainers on different GPUs run on trainer 0's, their gradients copied peer to peer: that needs
// a machine with two GPUs, which no check has had yet.)
TEST_CASE("trainers not all on a GPU stage through the host; the state carries across") {
  kernels::CodecConfig topk = named("topk");
  topk.density = 0.05;
  kernels::CodecConfig dgc = named("dgc");
  dgc.density = 0.05;
  dgc.momentum = 0.9;
  kernels::CodecConfig psgd = named("powersgd");
  psgd.approx_rank = 2;
  std::string where;
  CAPTURE(where);
  for (const auto& config : {topk, dgc, psgd}) {
    for (Memory other : {Memory::kHost}) {
      Pair pair(baseOptions(3), always(config));
      // Alternating: GPU steps, then mixed steps on the host, then on the GPU again — the codec
      // state moves between the device and the host and must evolve as on the host alone.
      for (uint64_t step = 1; step <= 6; ++step) {
        const bool mixed = step % 2 == 0;
        where = describe(config) + " step " + std::to_string(step);
        std::vector<Memory> memory(3, Memory::kDevice);
        if (mixed) memory[1] = other;
        pair.step("mix", step, DType::kF32, gradients(3, 15000, static_cast<uint32_t>(300 + step)),
                  memory, {}, !mixed);
      }
    }
  }
  // codec none: the mixed step's result is the mean, within rounding.
  Pair pair(baseOptions(2), always(named("none")));
  const std::vector<std::vector<float>> inputs = {std::vector<float>(5000, 1.0f),
                                                  std::vector<float>(5000, 3.0f)};
  auto [g, c] =
      pair.step("mean", 1, DType::kF32, inputs, {Memory::kDevice, Memory::kHost}, {}, false);
  for (size_t i = 0; i < 5000; i += 499) CHECK(valueAt(g.results[0], DType::kF32, i) == 2.0f);
  for (size_t i = 0; i < 5000; i += 499) CHECK(valueAt(g.results[1], DType::kF32, i) == 2.0f);
}

TEST_CASE("an engine with gpu = false never runs a step on the GPU") {
  for (const char* name : {"none", "topk", "powersgd", "qsgd"}) {
    CAPTURE(name);
    kernels::CodecConfig config = named(name);
    if (config.name == "topk") config.density = 0.1;
    Side cpu(baseOptions(2), false, always(config));
    for (uint64_t step = 1; step <= 3; ++step) {
      Run r = runStep(cpu, "t", step, DType::kF16, gradients(2, 5000, static_cast<uint32_t>(step)));
      for (const auto& o : r.outcomes) {
        REQUIRE_MESSAGE(o.ok(), o.message);
        CHECK(o.figures.device == "cpu");
      }
      CHECK(r.fetches == 2);
      CHECK(r.stores == 2);
    }
  }
}

TEST_CASE("codecs without a CUDA implementation stage through the host") {
  const auto cuda = kernels::cuda::cudaCodecNames();
  size_t tried = 0;
  for (const std::string& name : kernels::codecNames()) {
    if (std::find(cuda.begin(), cuda.end(), name) != cuda.end()) continue;
    CAPTURE(name);
    kernels::CodecConfig config = named(name);
    if (!kernels::createCodec(config).isOk()) continue;  // needs parameters this test does not know
    ++tried;
    Pair pair(baseOptions(1), always(config));
    for (uint64_t step = 1; step <= 2; ++step) {
      pair.step("t", step, DType::kF32, gradients(1, 5000, static_cast<uint32_t>(step)), {}, {},
                false);
    }
  }
  MESSAGE(tried << " codec(s) without a CUDA implementation tried");
}

TEST_CASE("a size, dtype or codec change resets the state on the GPU as on the host") {
  auto config = std::make_shared<kernels::CodecConfig>(named("topk"));
  config->density = 0.1;
  CodecChooser chooser = [config](const TensorFacts&) { return TensorSettings(*config); };
  Pair pair(baseOptions(3), chooser);
  struct Step {
    size_t n;
    DType dtype;
    const char* codec;
    bool reset;
  };
  const std::vector<Step> steps = {
      {5000, DType::kF32, "topk", false},  {5000, DType::kF32, "topk", false},
      {6000, DType::kF32, "topk", true},                                       // size
      {6000, DType::kBF16, "topk", true},                                      // dtype
      {6000, DType::kBF16, "topk", false}, {6000, DType::kBF16, "dgc", true},  // codec
      {6000, DType::kBF16, "dgc", false}};
  for (size_t s = 0; s < steps.size(); ++s) {
    CAPTURE(s);
    if (config->name != steps[s].codec) {
      config->name = steps[s].codec;
      pair.gpu.engine.setChooser(chooser);
      pair.cpu.engine.setChooser(chooser);
    }
    auto [g, c] = pair.step("r", s + 1, steps[s].dtype,
                            gradients(3, steps[s].n, static_cast<uint32_t>(400 + s)));
    CHECK(g.outcomes[0].figures.state_reset == steps[s].reset);
  }
}

// --- the trainer's event -------------------------------------------------------------------------

TEST_CASE("the GPU path waits for the trainer's event before it reads the gradient") {
  // The trainer's upload runs on a stream of its own behind ~4 GiB of memsets, and the step is
  // submitted at once: an engine that read the gradient without waiting on the event (through
  // Contribution::Device::wait) would see the previous contents (zeros).
  cudaStream_t trainer_stream = nullptr;
  cudaOk(cudaStreamCreateWithFlags(&trainer_stream, cudaStreamNonBlocking), "cudaStreamCreate");
  constexpr size_t kBusyBytes = size_t{256} << 20;
  void* busy = nullptr;
  cudaOk(cudaMalloc(&busy, kBusyBytes), "cudaMalloc (busy)");
  Uploader late = [&](unsigned, DeviceBuffer& b, std::span<const std::byte> bytes) {
    if (b.pinned == nullptr) cudaOk(cudaMallocHost(&b.pinned, b.bytes), "cudaMallocHost");
    if (b.event == nullptr) {
      cudaOk(cudaEventCreateWithFlags(&b.event, cudaEventDisableTiming), "cudaEventCreate");
    }
    // Stale contents first (zeros), on the trainer's stream like the rest.
    cudaOk(cudaMemsetAsync(b.dev, 0, b.bytes, trainer_stream), "cudaMemsetAsync");
    std::memcpy(b.pinned, bytes.data(), bytes.size());
    for (int i = 0; i < 16; ++i) {
      cudaOk(cudaMemsetAsync(busy, i, kBusyBytes, trainer_stream), "cudaMemsetAsync");
    }
    cudaOk(cudaMemcpyAsync(b.dev, b.pinned, b.bytes, cudaMemcpyHostToDevice, trainer_stream),
           "cudaMemcpyAsync");
    cudaOk(cudaEventRecord(b.event, trainer_stream), "cudaEventRecord");
  };
  kernels::CodecConfig topk = named("topk");
  topk.density = 0.1;
  for (const auto& config : {named("none"), topk}) {
    CAPTURE(config.name);
    Side gpu(baseOptions(1), true, always(config)), cpu(baseOptions(1), false, always(config));
    for (uint64_t step = 1; step <= 4; ++step) {
      CAPTURE(step);
      const auto inputs = gradients(1, 50000, static_cast<uint32_t>(500 + step));
      Run g = runStep(gpu, "e", step, DType::kF32, inputs, {}, {}, late);
      Run c = runStep(cpu, "e", step, DType::kF32, inputs, {}, {}, late);
      checkSame(g, c);
      CHECK(g.waits >= 1);
      if (config.name == "none") {
        CHECK(
            difference(g.results[0], encodeAs(inputs[0], DType::kF32), DType::kF32, false).empty());
      }
    }
  }
  cudaStreamSynchronize(trainer_stream);
  cudaFree(busy);
  cudaStreamDestroy(trainer_stream);
}

TEST_CASE("a trainer event that cannot be waited on fails the step and commits nothing") {
  kernels::CodecConfig topk = named("topk");
  topk.density = 0.05;
  Pair pair(baseOptions(2), always(topk));
  pair.step("w", 1, DType::kF32, gradients(2, 8000, 1));
  // Step 2 on the GPU engine only, with trainer 0's wait failing.
  Uploader failing = [](unsigned k, DeviceBuffer& b, std::span<const std::byte> bytes) {
    b.upload(bytes);
    b.fail_wait = k == 0;
  };
  Run failed = runStep(pair.gpu, "w", 2, DType::kF32, gradients(2, 8000, 2), {}, {}, failing);
  for (const auto& o : failed.outcomes) {
    CHECK_MESSAGE(!o.ok(), "a step whose gradient could not be waited on succeeded ("
                               << o.figures.device << ")");
  }
  for (auto& b : pair.gpu.buffers["w"]) b->fail_wait = false;
  // Step 3: as if step 2 had never been (the host engine never saw it).
  pair.step("w", 3, DType::kF32, gradients(2, 8000, 3));
  pair.step("w", 4, DType::kF32, gradients(2, 8000, 4));
}

// --- memory --------------------------------------------------------------------------------------

TEST_CASE(
    "the GPU keeps one copy of the state: a step borrows a work area, a step that fails after "
    "compression commits nothing") {
  // The work area's pooled bytes and the state's, from the engine's gauges.
  auto gauge = [](Side& side, const std::string& name) {
    const std::string text = side.metrics.exposition();
    const auto at = text.find("\n" + name + " ");
    REQUIRE_MESSAGE(at != std::string::npos, name);
    return std::stod(text.substr(at + name.size() + 2));
  };
  kernels::CodecConfig dgc = named("dgc"), topk = named("topk"), psgd = named("powersgd");
  dgc.density = 0.05;
  dgc.momentum = 0.9;
  topk.density = 0.05;  // error feedback by default
  psgd.approx_rank = 2;
  const size_t n = 40000;
  const std::vector<uint64_t> shape = {160, 250};
  for (const auto& config : {dgc, topk, psgd}) {
    CAPTURE(describe(config));
    Pair pair(baseOptions(1), always(config));
    const double floats =
        static_cast<double>(kernels::createCodec(config).value()->stateFloats(n, shape));
    const double work = static_cast<double>(gpu::workAreaBytes(config, n, shape));
    // dgc with momentum works in v' alone (its commit recomputes u and v in place): n floats
    // for a state of 2n; the others prepare their whole next state.
    CHECK(work == (config.name == "dgc" ? 4.0 * n : 4.0 * floats));
    const double before_pool = gauge(pair.gpu, "lightwire_pool_bytes");
    pair.step("m", 1, DType::kF32, gradients(1, n, 11), {}, shape);
    CHECK(gauge(pair.gpu, "lightwire_state_bytes") == 4.0 * floats);  // one copy
    // The work area went back to the pool for the next step (of any tensor on this GPU).
    CHECK(gauge(pair.gpu, "lightwire_pool_bytes") >= before_pool + work);
    // Step 2 fails on the GPU engine after analyze and encode (its exchange fails): nothing is
    // committed, so step 3 continues as if step 2 had never been (the host engine never saw it).
    pair.gpu.exchange.fail_rounds = 1;
    Run failed = runStep(pair.gpu, "m", 2, DType::kF32, gradients(1, n, 12), {}, shape);
    CHECK_FALSE(failed.outcomes[0].ok());
    pair.step("m", 3, DType::kF32, gradients(1, n, 13), {}, shape);
    pair.step("m", 4, DType::kF32, gradients(1, n, 14), {}, shape);
  }
}

TEST_CASE("many tensors share the device's step buffers: they are those of the steps in flight") {
  // Ten tensors of 4 Mi elements, three trainers (a local sum, a result that is not the trainer's
  // memory) with topk and error feedback (a work area): per-tensor buffers would keep ten sets of
  // sum, result and work area on the device; borrowed, they are one set.
  kernels::CodecConfig topk = named("topk");
  topk.density = 0.01;
  const size_t n = size_t{4} << 20, tensors = 10;
  Pair pair(baseOptions(3), always(topk));
  pair.step("first", 1, DType::kF32, gradients(3, n, 1));  // the context and the pool warm
  cudaOk(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  size_t free_before = 0, total = 0;
  cudaOk(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo");
  for (uint64_t step = 1; step <= 2; ++step) {
    for (size_t t = 0; t < tensors; ++t) {
      pair.step("t" + std::to_string(t), step, DType::kF32,
                gradients(3, n, static_cast<uint32_t>(100 * step + t)));
    }
  }
  cudaOk(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  size_t free_after = 0;
  cudaOk(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo");
  const double kept = static_cast<double>(free_before) - static_cast<double>(free_after);
  const double tensor = 4.0 * n;
  // Each tensor's state (its residual: one tensor's size) and its small per-tensor buffers (8
  // tensor sizes of slack for them and allocation granularity); the trainers' buffers besides
  // (the harness's: two engines x three trainers x ten tensors). Per-tensor step buffers would
  // add three tensor sizes per tensor: 30 in all.
  const double trainers_buffers = 2.0 * 3.0 * tensors * tensor;
  CHECK_MESSAGE(kept <= trainers_buffers + tensors * tensor + 8 * tensor,
                "the device kept " << kept / 1e6 << " MB for " << tensors << " tensors of "
                                   << tensor / 1e6 << " MB");
}

TEST_CASE("the device pool keeps at most limits.max_pool_bytes of step buffers between steps") {
  kernels::CodecConfig topk = named("topk");
  topk.density = 0.01;
  const size_t n = size_t{1} << 20;
  {
    // Nothing kept: every step's buffers are freed when it ends; the results stay the host's.
    EngineOptions o = baseOptions(3);
    o.max_pool_bytes = 0;
    Pair pair(o, always(topk));
    for (uint64_t step = 1; step <= 3; ++step) {
      pair.step("p", step, DType::kF32, gradients(3, n, static_cast<uint32_t>(step)));
      CHECK(gpu::pooledDeviceBytes() == 0);
    }
  }
  {
    // A cap of two tensor sizes: the step's local sum and work area (a tensor size each) are kept,
    // its result buffer (a third) is freed.
    EngineOptions o = baseOptions(3);
    o.max_pool_bytes = 2 * 4 * n;
    Pair pair(o, always(topk));
    for (uint64_t step = 1; step <= 3; ++step) {
      pair.step("p", step, DType::kF32, gradients(3, n, static_cast<uint32_t>(10 + step)));
      CHECK(gpu::pooledDeviceBytes() <= o.max_pool_bytes);
      CHECK(gpu::pooledDeviceBytes() > 0);
    }
  }
}
