#pragma once
// The step engine (docs/architecture.md "The step pipeline"): collects every local trainer's
// part of (tensor, step), runs complete steps one at a time through the pipeline (pipeline.h:
// sum, compress with the tensor's codec — state prepared, not committed — exchange with the other
// sidecars, decompress and average, write each trainer's result, commit only when all of that
// succeeded), and keeps every tensor's codec state between steps, with checkpoints and resume
// (checkpoints.cc).

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
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "kernels/codec.h"
#include "kernels/parallel.h"
#include "metrics/metrics.h"
#include "policies/policy.h"
#include "proxy/exchange/exchange.h"
#include "proxy/step/step.h"
#include "proxy/step/step_pool.h"
#include "proxy/step/tensor_facts.h"

namespace lightwire::proxy {

/// A tensor's settings from compression.default and compression.rules.
struct TensorSettings {
  TensorSettings() = default;
  TensorSettings(kernels::CodecConfig c) : codec(std::move(c)) {}  // NOLINT: implicit on purpose
  kernels::CodecConfig codec;
  uint32_t sync_every = 1;  // delayed sync: exchanged every k steps, accumulated locally between
  std::string group;        // metrics label ("" = the codec's name)
};
/// Picks the settings of a tensor.
using CodecChooser = std::function<TensorSettings(const TensorFacts&)>;
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
  // How topk and dgc are exchanged (peer.sparse, docs/exchange.md "Sparse allreduce"): the ring
  // allgather, the sparse allreduce (where the exchange, the backend — the host's — and the step
  // allow it), or per layer whichever moves fewer bytes (auto).
  enum class Sparse { kAllgather, kAllreduce, kAuto };
  Sparse sparse = Sparse::kAllgather;
  // DGC warm-up (docs/policies.md): over a tensor's first warmup_steps steps, selection codecs
  // send at least 25 %, 6.25 %, 1.5625 %, 0.39 %, 0.098 % (five equal stages), then their own
  // density.
  uint64_t warmup_steps = 0;
  // PowerSGD start (docs/policies.md "Schedules"): a powersgd tensor's steps before this one are
  // exchanged dense (codec `none`) and leave its state as it is; compression starts here.
  uint64_t powersgd_start_step = 0;
  uint64_t max_state_bytes = 0;  // codec state and step buffers together (0 = no cap)
  uint64_t max_pool_bytes = uint64_t{1} << 30;  // step buffers kept between steps (StepPool)
  // A tensor whose last step is this many steps behind a completed step of another tensor loses
  // its codec state and buffers (it starts fresh if it comes back; 0 = never).
  uint64_t drop_state_after_steps = 0;
  // Policies (docs/policies.md): null = none (every step compressed, warm-up from warmup_steps,
  // no statistics in the exchange). With them, warm-up comes from their configuration, and
  // `settings` (when set) maps agreed settings versions to choosers (else the chooser is used).
  policies::PolicyEngine* policy = nullptr;
  SettingsChooser settings;
  // Durable state (docs/policies.md "Durable state: checkpoints"): where files go ("" = nowhere),
  // whose they are.
  std::string state_dir;
  std::string job_id = "default";
  uint32_t world_size = 1;
  uint64_t checkpoint_every = 0;       // periodic checkpoint every N steps (0 = off)
  size_t checkpoint_keep = 3;          // periodic/sigterm files kept per sidecar
  size_t trainer_checkpoint_keep = 0;  // trainer-requested files kept (0 = all)
  // Steps whose trainers all hand device memory (Contribution::device) run on the GPU backend
  // when the binary has the CUDA codecs; false stages them through the host (engine.gpu: false).
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
  /// The layers of one trainer's bucket (docs/architecture.md "A bucket's layers: one step"), each
  /// a tensor of its own (spec.bucket names the bucket, the same step for every layer), with one
  /// StepDone each: taken all or none (a refusal of any layer refuses every one, each done called
  /// with that error), and once every trainer's part of every layer is in, run as one step of
  /// the bucket — every layer's exchange together, and every layer committed or none.
  void submitBucket(std::vector<Contribution> layers, std::vector<StepDone> dones);
  /// POST /v1/cancel (docs/api.md "Buckets in flight"): the place `order` of its stream will not
  /// be sent (the trainer failed before sending it), so the places after it need not wait for it.
  /// Parts of it already here fail with kCancelled, and so does the step on the other sidecars
  /// (`bucket` and `step`, when given, name it to them; else the parts here do). Returns whether
  /// it cancelled anything (false: the place has run or was cancelled already), or an error
  /// (limits on the streams and cancellations kept).
  Result<bool> cancel(const StepOrder& order, const std::string& bucket,
                      std::optional<uint64_t> step);
  /// New codec settings; each tensor's next step uses them (fresh state when its codec changes).
  void setChooser(CodecChooser chooser);
  /// Tensors for /v1/status.
  boost::json::array tensorsJson() const;
  /// Streams of ordered steps for /v1/status (docs/api.md "Buckets in flight"): each one's last
  /// place run, its cancelled places not reached yet, and its steps waiting for their place.
  boost::json::array streamsJson() const;
  /// The job's step state as this sidecar knows it (docs/policies.md): every tensor's last
  /// committed step. Told to every peer that (re)connects.
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
  /// Fails every waiting step with kShuttingDown and finishes the running one; later submits get
  /// kShuttingDown.
  void shutdown();

 private:
  friend class StepPipeline;
  struct Pending;  // step/tensor.h
  struct Tensor;
  void loop();
  /// Takes the first ready step and runs it (mu_ held on entry and exit, released while running).
  void runNextReady(std::unique_lock<std::mutex>& lock);
  void runStep(Tensor& t, uint64_t step, Pending& p);
  /// runStep for the layers of one bucket (their ready entries, in order).
  void runBucketStep(std::vector<Tensor*>& tensors, uint64_t step, std::vector<Pending>& parts);
  /// limits.drop_state_after_steps after a step of `step` ended (engine thread).
  void dropIdleStates(uint64_t step);
  /// lightwire_state_bytes: every tensor's state (mu_ held).
  void publishStateBytes();
  /// The bookkeeping of a step that ended (ok or not) and its replies; the resume a step's
  /// statistics asked for runs after it (resumePending()).
  void endStep(Tensor& t, uint64_t step, Pending& p, const StepOutcome& outcome);
  void resumePending();
  /// Why `s` cannot join its step now (kNone: it can, `why` untouched); changes nothing. `created`:
  /// steps the same submission creates before this part (for limits.max_pending_steps). mu_ held.
  StepError admit(const TensorSpec& s, size_t created, bool* creates, std::string* why) const;
  /// Adds an admitted part; true when it completed its step (now queued). mu_ held.
  bool enqueue(Contribution c, StepDone done, std::chrono::steady_clock::time_point now);
  /// The periodic checkpoint due before `step`, if any (before the step runs).
  void periodicCheckpoint(uint64_t step);
  void failPending(Pending& p, StepError error, const std::string& message);
  /// Runs queued between-step tasks (mu_ held on entry and exit).
  void runTasks(std::unique_lock<std::mutex>& lock);
  /// Ordered steps (docs/api.md "Buckets in flight"): per stream, the last place that ran (or was
  /// cancelled, or gave up waiting), and the places after it cancelled before they came. mu_.
  struct Stream {
    std::optional<std::pair<uint64_t, uint32_t>> last;  // (iteration, position)
    std::set<std::pair<uint64_t, uint32_t>> cancelled;
  };
  static constexpr size_t kMaxStreams = 1024, kMaxCancelled = 256;
  /// Whether `order`'s place has run, was cancelled or gave up (a part of it comes too late).
  bool orderPassed(const StepOrder& order) const;
  /// The position that runs next in `order`'s iteration of its stream.
  uint64_t nextPlace(const StepOrder& order) const;
  /// Whether a queued step may run now: it has no place, or every place before it has passed.
  bool runnable(const Pending& p) const;
  /// The first queued step that may run (ready_.end(): none).
  std::deque<std::pair<std::string, uint64_t>>::iterator firstRunnable();
  /// The place `order` is taken (its step runs, or is given up): places before it are passed.
  void passOrder(const StepOrder& order);
  /// Fails queued steps that waited past their order deadline for a place that never came; true
  /// when it failed any (mu_ held on entry and exit, released while failing them).
  bool expireOrderWaits(std::unique_lock<std::mutex>& lock);
  std::map<std::string, Stream> streams_;
  /// The tensor's slot (created when new). mu_ held.
  Tensor& tensorSlot(const std::string& name);
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
  // The link as this sidecar's exchanges measured it (codec: auto); the running step's only.
  policies::LinkEstimator link_;

  EngineOptions options_;
  metrics::Metrics& metrics_;
  Exchange& exchange_;
  kernels::CpuStream stream_;
  StepPool pool_;  // the host steps' buffers of tensor size (engine thread)

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

}  // namespace lightwire::proxy
