#pragma once
// One step of one tensor, from the trainers' contributions to their results (DESIGN.md §1): wait
// for every local trainer's part of (tensor, step), sum them, compress the sum with the tensor's
// codec (state prepared, not committed), exchange with the other sidecars (the Exchange seam;
// world size 1 until the peer-exchange issue), decompress and average, write each trainer's
// result, and commit the codec state only when all of that succeeded.

#include <boost/json/array.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kernels/codec.h"
#include "kernels/parallel.h"
#include "metrics/metrics.h"
#include "policies/policy.h"

namespace lightwire::proxy {

/// What a trainer says about the tensor it sends.
struct TensorSpec {
  std::string name;
  uint64_t step = 0;
  unsigned trainer = 0;
  kernels::DType dtype = kernels::DType::kF32;
  std::vector<uint64_t> shape;  // empty = 1-D
  uint64_t elements = 0;
};

/// One trainer's part of a step: where its tensor is, and where its result goes (the same bytes).
struct Contribution {
  TensorSpec spec;
  std::byte* data = nullptr;          // elements * dtypeSize(dtype) bytes, read then overwritten
  std::shared_ptr<void> keep_alive;   // owns `data` (a request body, a mapped region)
  std::function<bool()> still_valid;  // checked right before the bytes are touched (may be empty)
  /// Device memory (a CUDA IPC buffer, ipc/cuda_ipc.h) staged at `data`: `fetch` copies the
  /// gradient from the device into `data` right before the step reads it, `store` copies the
  /// result from `data` back to the device after the step, before the reply. Empty for host
  /// memory. false and a message on failure.
  std::function<bool(std::string*)> fetch, store;
  /// Device memory the engine may work on directly (the GPU path, docs/cuda.md "Steps on the
  /// GPU"): when every trainer of a step gives one and the step's codec has a CUDA implementation,
  /// the step runs on trainer 0's GPU — the local sum (other GPUs' gradients copied over peer to
  /// peer), the statistics, compression and decompression on the device, only payloads crossing
  /// to the host — and `fetch`/`store` are not called. Otherwise the step stages through `data`.
  struct Device {
    int ordinal = -1;     // CUDA device ordinal in this process
    void* ptr = nullptr;  // elements * dtypeSize(dtype) bytes (the device's primary context)
    // Makes `stream` (a cudaStream_t of that device) wait, on the device, for the trainer's work
    // that produced the gradient (its IPC event). May be empty (nothing to wait for).
    std::function<bool(void* stream, std::string* error)> wait;
  };
  std::optional<Device> device;
};

/// Figures of a completed step (the JSON reply of docs/api.md).
struct StepFigures {
  std::string codec;
  uint64_t elements = 0, raw_bytes = 0, wire_bytes = 0;
  bool nonfinite = false, state_reset = false;
  std::string mode = "compressed";  // policies::stepModeName() of the step
  uint64_t settings = 0;            // the compression settings version it ran with
  std::string device = "cpu";       // where it ran: "cpu", or "cuda:<ordinal>" (the GPU path)
  double durations_us[metrics::kStageCount] = {};
};

/// How a step ended for one trainer. `http_status` 200 means success.
struct StepOutcome {
  unsigned http_status = 200;
  std::string error;  // docs/api.md error code
  std::string message;
  StepFigures figures;
};
using StepDone = std::function<void(StepOutcome)>;

/// Largest statistics record a sidecar sends or accepts with a step (ExchangeRound::stats_out).
inline constexpr size_t kMaxStatsBytes = size_t{64} << 10;

/// One exchange round of one step of one tensor, as this sidecar sees it.
struct ExchangeRound {
  const std::string& tensor;
  uint64_t step;
  int round;
  const kernels::Codec& codec;
  const kernels::Chunking& chunking;
  std::span<const std::span<const uint8_t>> payloads;  // this sidecar's payload of every chunk
  // Exchanges that say encodesLazily(): instead of `payloads` (then empty), compresses chunk c on
  // first call and returns its payload (stable until the step ends), so compressing chunk i+1
  // overlaps sending chunk i. Use payload(c), which covers both.
  std::function<Result<std::span<const uint8_t>>(size_t)> encode;
  // The step's density of selection codecs when a schedule overrides the configured one (the same
  // on every sidecar: a function of the step).
  std::optional<double> density;
  // Optional (set by the engine for single-round codecs): the exchange may call it as soon as
  // chunk c's payloads to decode are final — the same list run() returns for c, which must stay
  // valid — so decoding overlaps the rest of the exchange. An error fails the exchange. Chunks it
  // was not called for are decoded after run(). Exchanges that set `contributors` below
  // worldSize() must not call it.
  std::function<Status(size_t, std::span<const std::span<const uint8_t>>)> on_chunk;
  // Set by the exchange: how many sidecars' contributions the returned payloads hold (0 = all of
  // worldSize(); fewer under bounded staleness, where the result is their mean).
  uint32_t contributors = 0;
  // Set by the exchange: the returned payloads are plain fp32 arrays (codec `none`), not the
  // codec's payloads (a sparse allgather switched to a dense allreduce because it was smaller).
  bool dense = false;
  // Policy statistics (DESIGN.md §5, docs/policies.md): this sidecar's statistics record of the
  // step (opaque bytes, at most kMaxStatsBytes; given in round 0 only, empty = none). The exchange
  // delivers every sidecar's record to every sidecar within the step's own exchange (frames posted
  // with the step's first data frames, received once its data is in: no extra round trip) and
  // fills `stats_in`, index = rank; an entry stays empty for a rank whose record is not part of
  // the step (not a contributor under bounded staleness). Every rank gets the same records.
  std::span<const uint8_t> stats_out;
  std::vector<std::vector<uint8_t>> stats_in;

  Result<std::span<const uint8_t>> payload(size_t chunk) const {
    if (encode) return encode(chunk);
    return payloads[chunk];
  }
};

/// The seam to the other sidecars. For each chunk it returns the payloads to decode: the reduced
/// (summed) payload for summable and multi-round codecs, or every sidecar's payload otherwise.
/// The spans stay valid until the step ends (the engine runs one step at a time).
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual unsigned worldSize() const = 0;
  virtual Result<std::vector<std::vector<std::span<const uint8_t>>>> run(ExchangeRound& round) = 0;
  /// Whether run() takes this sidecar's payloads chunk by chunk through ExchangeRound::encode
  /// (compression overlapping the exchange) rather than all compressed beforehand.
  virtual bool encodesLazily() const { return false; }
  /// Silent-divergence guard (DESIGN.md §4): compares this sidecar's checksum of a step's result
  /// with every other sidecar's. Returns the ranks whose checksum differs from this one's (empty:
  /// all agree), or an error when the comparison itself failed (a peer down or silent).
  virtual Result<std::vector<uint32_t>> compareResults(const std::string& /*tensor*/,
                                                       uint64_t /*step*/, uint64_t /*checksum*/) {
    return std::vector<uint32_t>{};
  }
  /// The step (tensor, step) failed here (before, during or after its exchange): tell the other
  /// sidecars, so they fail it at once rather than at their deadline.
  virtual void abort(const std::string& /*tensor*/, uint64_t /*step*/,
                     const std::string& /*reason*/) {}
  /// The step (tensor, step) is over here, successfully or not: what was kept for it can go.
  virtual void stepDone(const std::string& /*tensor*/, uint64_t /*step*/) {}
};

/// World size 1: this sidecar's payloads are the reduced ones.
class LocalExchange final : public Exchange {
 public:
  unsigned worldSize() const override { return 1; }
  Result<std::vector<std::vector<std::span<const uint8_t>>>> run(ExchangeRound& round) override;
};

/// Sums of a sampled chunk for the cosine similarity of a compressed gradient (policies).
struct CosineTerms {
  double dot = 0, c2 = 0, g2 = 0;
};
/// Decodes `payload` (one chunk) and returns its sums against `original` (nullopt: not finite or
/// not decodable). `scratch` is reused.
std::optional<CosineTerms> cosineTerms(const kernels::Codec& codec,
                                       std::span<const uint8_t> payload, const float* original,
                                       size_t len, std::vector<float>& scratch);

/// A tensor's settings from compression.default and compression.rules.
struct TensorSettings {
  TensorSettings() = default;
  TensorSettings(kernels::CodecConfig c) : codec(std::move(c)) {}  // NOLINT: implicit on purpose
  kernels::CodecConfig codec;
  uint32_t sync_every = 1;  // delayed sync: exchanged every k steps, accumulated locally between
  std::string group;        // metrics label ("" = the codec's name)
};
/// Picks the settings of a tensor (name, elements).
using CodecChooser = std::function<TensorSettings(std::string_view, uint64_t)>;
/// The chooser of a compression settings version (PUT /v1/config versions agreed through the
/// policies: version, its JSON). Called on the engine thread; may cache.
using SettingsChooser = std::function<CodecChooser(uint64_t, const std::string&)>;

struct EngineOptions {
  unsigned local_trainers = 1;
  unsigned threads = 1;
  uint64_t chunk_elements = uint64_t{1} << 20;
  std::chrono::milliseconds step_timeout{120000};
  size_t max_pending_steps = 4096;
  uint32_t seed = 0;  // Philox key word 0 (job seed: the same on every sidecar of a job)
  uint32_t rank = 0;  // this sidecar's rank: its per-rank random streams (qsgd rounding, ...)
  uint64_t checksum_every = 100;  // compare result checksums every N steps of a tensor (0 = off)
  // DGC warm-up (DESIGN.md §5): over a tensor's first warmup_steps steps, selection codecs send
  // at least 25 %, 6.25 %, 1.5625 %, 0.39 %, 0.098 % (five equal stages), then their own density.
  uint64_t warmup_steps = 0;
  uint64_t max_state_bytes = 0;  // codec state of all tensors together (0 = no cap)
  // Policies (DESIGN.md §5): null = none (every step compressed, warm-up from warmup_steps, no
  // statistics in the exchange). With them, warm-up comes from their configuration, and
  // `settings` (when set) maps agreed settings versions to choosers (else the chooser is used).
  policies::PolicyEngine* policy = nullptr;
  SettingsChooser settings;
  // Durable state (docs/policies.md "Checkpoints"): where files go ("" = nowhere), whose they are.
  std::string state_dir;
  std::string job_id = "default";
  uint32_t world_size = 1;
  uint64_t checkpoint_every = 0;       // periodic checkpoint every N steps (0 = off)
  size_t checkpoint_keep = 3;          // periodic/sigterm files kept per sidecar
  size_t trainer_checkpoint_keep = 0;  // trainer-requested files kept (0 = all)
  // Steps whose trainers all hand device memory (Contribution::device) run on the GPU when the
  // binary has the CUDA codecs; false stages them through the host (engine.gpu: false).
  bool gpu = true;
};

/// Runs steps, one at a time. submit() is thread-safe; it never waits for other trainers, and it
/// runs a small step (at most 64 Ki elements) itself when its part completes the step and nothing
/// else is queued; every other step runs on the engine's thread. Results come through the
/// StepDone callbacks, called from whichever thread ran the step.
class StepEngine {
 public:
  StepEngine(EngineOptions options, CodecChooser chooser, metrics::Metrics& metrics,
             Exchange& exchange);
  ~StepEngine();

  /// Adds one trainer's contribution. Refused at once (done called before submit returns) when
  /// it conflicts: same (tensor, step, trainer) pending, a step not after the last committed one,
  /// a size or dtype different from the other trainers' for that step, too many steps pending.
  void submit(Contribution c, StepDone done);
  /// New codec settings; each tensor's next step uses them (fresh state when its codec changes).
  void setChooser(CodecChooser chooser);
  /// Tensors for /v1/status.
  boost::json::array tensorsJson() const;
  /// The job's step state as this sidecar knows it (DESIGN.md §5): every tensor's last committed
  /// step. Told to every peer that (re)connects.
  std::map<std::string, uint64_t> committedSteps() const;
  /// Takes a peer's step state while this sidecar has completed no step yet (it has just started
  /// or restarted): each tensor's next step must then come after the job's last committed one
  /// (the largest any peer reports). Returns how many tensors it took (0: ignored).
  size_t adoptCommittedSteps(const std::map<std::string, uint64_t>& steps);
  /// Runs `task` on the engine's thread between two steps (never during one) and waits for it.
  /// Used for checkpoints and resume, which touch every tensor's codec state.
  Status runBetweenSteps(const std::function<Status()>& task);
  /// Like runBetweenSteps() without waiting (for threads the running step may wait on, such as a
  /// transport's); an error is logged.
  void postBetweenSteps(std::function<Status()> task);
  /// Writes this sidecar's state as it stands (the last committed step of every tensor) as the
  /// checkpoint of `step` (reason: trainer, periodic, sigterm). Engine thread, or after shutdown().
  Result<std::string> saveCheckpoint(uint64_t step, const std::string& reason);
  /// POST /v1/checkpoint: saves here now (between steps) unless a step after `step` has already
  /// committed (an error), and asks every other sidecar to save theirs with the next step.
  Result<std::string> checkpoint(uint64_t step);
  /// POST /v1/resume: restores this sidecar's checkpoint of `step` (codec and policy state); every
  /// tensor's next step is then step + 1. Pending steps fail (409).
  Status resume(uint64_t step);
  /// resume(step) queued between steps without waiting (from a transport's thread); does nothing
  /// when this sidecar has resumed from that step already. Errors are logged.
  void resumeLater(uint64_t step);
  /// A restart mid-job: takes the codec state (not the steps, not the policy state: those come
  /// from the peers) of the newest checkpoint of this sidecar in state_dir, logging what was lost.
  /// Returns its step (nullopt: none). Refuses a checkpoint of another job, world size or rank, or
  /// a corrupted one. Between steps only (postBetweenSteps()).
  Result<std::optional<uint64_t>> restoreLatest();
  /// Steps completed and failed so far.
  uint64_t stepsOk() const;
  uint64_t stepsFailed() const;
  /// Fails every waiting step with 503 and finishes the running one; later submits get 503.
  void shutdown();

 private:
  struct Pending;
  struct Tensor;
  void loop();
  /// Takes the first ready step and runs it (mu_ held on entry and exit, released while running).
  void runNextReady(std::unique_lock<std::mutex>& lock);
  void runStep(Tensor& t, uint64_t step, Pending& p);
  StepOutcome execute(Tensor& t, uint64_t step, Pending& p);
  void failPending(Pending& p, unsigned status, const std::string& error,
                   const std::string& message);
  /// Runs queued between-step tasks (mu_ held on entry and exit).
  void runTasks(std::unique_lock<std::mutex>& lock);
  Status restoreFrom(const std::string& path, std::optional<uint64_t> step, bool steps_too,
                     bool policy_too);
  Status resumeHere(uint64_t step);         // engine thread
  std::optional<uint64_t> pending_resume_;  // engine thread: resume once the step has ended
  struct Task {
    std::function<Status()> fn;
    std::promise<Status> done;
  };
  std::deque<std::shared_ptr<Task>> tasks_;
  uint64_t settings_version_ = 0;  // engine thread: the settings version settings_chooser_ is of
  CodecChooser settings_chooser_;
  uint64_t last_periodic_ = 0;

  EngineOptions options_;
  metrics::Metrics& metrics_;
  Exchange& exchange_;
  kernels::CpuStream stream_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  CodecChooser chooser_;
  std::map<std::string, std::unique_ptr<Tensor>> tensors_;
  std::deque<std::pair<std::string, uint64_t>> ready_;  // (tensor, step) with every part in
  size_t pending_count_ = 0;
  bool stopping_ = false;
  bool executing_ = false;  // a step is running (on the engine thread or inline in submit())
  uint64_t steps_ok_ = 0, steps_failed_ = 0;
  std::thread thread_;
};

/// The job state a sidecar tells its peers (STATE frames, docs/peer-protocol.md): JSON
/// {"version": 1, "committed": {"<tensor>": <last committed step>, ...}}.
/// With policies, also "policy": PolicyEngine::stateJson().
std::vector<uint8_t> encodeJobState(const std::map<std::string, uint64_t>& committed,
                                    const policies::PolicyEngine* policy = nullptr);
struct JobState {
  std::map<std::string, uint64_t> committed;
  std::optional<boost::json::value> policy;
};
/// Parses and checks a peer's job state (any malformed input is an error, nothing taken).
Result<JobState> decodeJobState(std::span<const uint8_t> bytes);

/// The density the DGC warm-up prescribes for `step` of `warmup_steps` (nullopt after it): stage
/// i = step * 5 / warmup_steps sends 0.25^(i+1).
std::optional<double> warmupDensity(uint64_t step, uint64_t warmup_steps);

/// The API name of a dtype ("float32", ...).
const char* apiDTypeName(kernels::DType t);

}  // namespace lightwire::proxy
