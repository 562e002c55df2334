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
};

/// Figures of a completed step (the JSON reply of docs/api.md).
struct StepFigures {
  std::string codec;
  uint64_t elements = 0, raw_bytes = 0, wire_bytes = 0;
  bool nonfinite = false, state_reset = false;
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

/// Picks the codec settings of a tensor (name, elements): compression.default and rules.
using CodecChooser = std::function<kernels::CodecConfig(std::string_view, uint64_t)>;

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
std::vector<uint8_t> encodeJobState(const std::map<std::string, uint64_t>& committed);
/// Parses and checks a peer's job state (any malformed input is an error, nothing taken).
Result<std::map<std::string, uint64_t>> decodeJobState(std::span<const uint8_t> bytes);

/// The density the DGC warm-up prescribes for `step` of `warmup_steps` (nullopt after it): stage
/// i = step * 5 / warmup_steps sends 0.25^(i+1).
std::optional<double> warmupDensity(uint64_t step, uint64_t warmup_steps);

/// The API name of a dtype ("float32", ...).
const char* apiDTypeName(kernels::DType t);

}  // namespace lightwire::proxy
