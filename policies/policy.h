#pragma once
// The policies (docs/policies.md): what each step of each tensor does — compressed with which
// density, bypassed (dense), a full-sync (dense, residuals flushed), or skipped (a delayed-sync
// group accumulating locally) — and which compression settings are in force. Every decision for
// step t+1 is a pure function of this state and the *global* statistics of step t
// (policies/stats.h), which every rank receives identically with the step, so every rank decides
// alike without extra messages. Decisions are counted, logged and kept in a decision log.
//
// Thread-safe: plan()/update() run on the engine's thread; proposals, reports and status come
// from HTTP threads.

#include <boost/json/object.hpp>
#include <boost/json/value.hpp>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "metrics/metrics.h"
#include "policies/auto.h"
#include "policies/stats.h"

namespace lightwire::policies {

/// The `policies` and `schedule` configuration sections (docs/configuration.md). Plain value.
struct PolicyConfig {
  // Anomalies: NaN/Inf, and norm explosion or vanishing against an exponentially weighted
  // baseline (mean and deviation of the global gradient norm) -> bypass for bypass_steps steps.
  bool anomaly = true;
  uint32_t bypass_steps = 10;    // K
  double explode_factor = 10.0;  // norm > factor * baseline mean (and > mean + 6 deviations)
  double vanish_factor = 1e-3;   // norm < factor * baseline mean
  double ewma_alpha = 0.1;       // weight of a new sample in every baseline
  uint32_t baseline_steps = 10;  // samples before a baseline is trusted
  // Periodic full-sync every N steps of a tensor (steps N, 2N, ...; 0 = off).
  uint64_t full_sync_every = 1000;
  // Rollback to the last known-good compression settings.
  bool rollback = true;
  double cosine_drop = 0.5;  // degraded: cosine < baseline * (1 - drop) (relative: sparse codecs
                             // sit at 0.02..0.5 by nature, docs/metrics.md)
  double loss_rise = 0.5;    // degraded: loss > baseline * (1 + rise)
  // Degraded: the reported reward (higher is better) dropped below its baseline by more than
  // `reward_drop` (absolute), or by more than `reward_drop_sigma` deviations of the baseline. At
  // most one is set; neither: kRewardDropSigma deviations (rewardDropSigma()).
  std::optional<double> reward_drop, reward_drop_sigma;
  uint32_t patience = 3;           // consecutive degraded steps before a rollback
  uint32_t cooldown_steps = 100;   // no further rollback for this many steps
  uint32_t known_good_steps = 50;  // settings in force this long without degradation are good
  // Schedules.
  uint64_t warmup_steps = 0;         // DGC warm-up over a tensor's first N steps (0 = off)
  uint64_t powersgd_start_step = 0;  // powersgd tensors dense before this step (0 = off)
  uint64_t total_steps = 0;          // phase schedule: gentler in the first and last 20 % (0 = off)
  double phase_factor = 4.0;         // ... density times this there (at most 1)
  bool adaptive = false;             // adaptive ratio from the gradient statistics
  double adaptive_tiny = 0.01;       // norm < tiny * baseline -> compress harder (ratio x2)
  double adaptive_sparse = 0.9;      // fraction of |g| < min_magnitude above this -> softer (/2)
  double adaptive_max_ratio = 10000;  // harder up to this ratio
  double adaptive_min_ratio = 10;     // softer down to this ratio
  double min_magnitude = 1e-6;        // selection codecs never send |value| below this
  size_t decision_log = 256;          // entries kept in /v1/status
  AutoConfig auto_codec;              // compression.auto: the tensors whose codec is `auto`
};

/// The reward rule's deviations when neither policies.reward_drop nor reward_drop_sigma is set.
inline constexpr double kRewardDropSigma = 3.0;
/// The deviations of the reward rule in force (nullopt: its absolute form, reward_drop).
std::optional<double> rewardDropSigma(const PolicyConfig& c);

/// Checks ranges (factors > 0, alpha in (0, 1], cosine_drop in (0, 1), ...); errors name the key.
Status validate(const PolicyConfig& c);

enum class StepMode { kCompressed, kBypass, kFullSync, kSkip };
const char* stepModeName(StepMode m);

/// The density the DGC warm-up prescribes for `step` of `warmup_steps`: 25 %, 6.25 %, 1.5625 %,
/// 0.39 %, 0.098 % in five equal stages (stage i = step * 5 / warmup_steps sends 0.25^(i+1));
/// nullopt after it.
std::optional<double> warmupDensity(uint64_t step, uint64_t warmup_steps);

/// What one step of one tensor does. Plain value.
struct StepPlan {
  StepMode mode = StepMode::kCompressed;
  std::optional<double> density;   // selection codecs: the step's density when not the configured
  double min_magnitude = 0;        // selection codecs
  uint64_t settings = 0;           // the compression settings version in force (index)
  bool delayed_sync_step = false;  // a delayed-sync group's exchange step (sends its accumulation)
  bool lossless = false;           // codec none every step: what the `direct` rung does too
};

/// One entry of the decision log (identical on every rank). Plain value.
struct Decision {
  uint64_t seq = 0;  // position in the job's log
  uint64_t step = 0;
  std::string tensor;
  std::string kind;  // anomaly, bypass, full_sync, rollback, settings, density, checkpoint, ...
  std::string detail;
};

/// What `codec: auto` sends one step of one layer with (docs/policies.md "codec: auto"). Plain
/// value.
struct AutoStep {
  const Rung* rung = nullptr;  // into the configured ladder
  size_t index = 0;
  // The last step with a rung whose codec holds state (a residual) before a switch: a full-sync
  // with it, which sends what the state held back and flushes it, so nothing is lost.
  bool flush = false;
};

/// What update() needs to know of a `codec: auto` layer. Plain value.
struct AutoFacts {
  uint64_t elements = 0;
  std::vector<uint64_t> shape;
  uint32_t world = 1;
  std::string group;  // metrics label
};

/// Steps [from, until) the trainers average with their own process group (the `direct` rung,
/// job-wide). Plain value.
struct DirectWindow {
  uint64_t from = 0, until = 0;
  uint32_t chain =
      0;  // windows before it that it follows at once (its length: probe_every << chain)
};

/// What update() asks the step's owner to do. Plain value.
struct UpdateResult {
  std::vector<Request> checkpoints;  // save the state as it stood before this step
  std::optional<uint64_t> settings;  // a new settings version takes effect at step + 1
};

/// Every decision of one sidecar. Thread-safe.
class PolicyEngine {
 public:
  /// `initial_settings`: the compression section as configured (JSON), version 0.
  PolicyEngine(PolicyConfig config, std::string initial_settings, metrics::Metrics* metrics);

  const PolicyConfig& config() const { return config_; }

  /// What step `step` of `tensor` does. `codec`: its configured settings; `sync_every`: its rule's
  /// delayed-sync period (<= 1 = every step). Pure function of the state and the arguments.
  StepPlan plan(const std::string& tensor, uint64_t step, const kernels::CodecConfig& codec,
                uint32_t sync_every) const;

  /// The settings version in force at `step` and its JSON.
  std::pair<uint64_t, std::string> settingsAt(uint64_t step) const;

  /// This sidecar's statistics record for a step (adds the pending outgoing requests and the last
  /// reported loss to `local`).
  std::vector<uint8_t> record(StepStats local) const;

  /// After step `step` of `tensor` succeeded on every rank (mode as planned) with global
  /// statistics `g`: updates the baselines, decides anomalies, rollbacks and adaptive changes for
  /// the next steps, takes the requests. Outgoing requests seen in `g` are no longer sent.
  /// `auto_facts`: the tensor's codec is `auto` (then its rung is decided here too).
  UpdateResult update(const std::string& tensor, uint64_t step, const StepPlan& plan,
                      const GlobalStats& g, const AutoFacts* auto_facts = nullptr);

  /// `codec: auto`: the rung step `step` of `tensor` is sent with. Pure function of the state.
  AutoStep autoStep(const std::string& tensor, uint64_t step) const;
  /// The direct window decided at or before `step` that starts after it, if any: what the replies
  /// of `step` tell the trainers.
  std::optional<DirectWindow> directWindowAfter(uint64_t step) const;

  /// A checksum mismatch (silent divergence): the tensor's next step is a full-sync.
  void forceFullSync(const std::string& tensor, uint64_t step);

  // --- requests from this sidecar's clients -------------------------------------------------
  /// PUT /v1/config: the settings (JSON, validated by the caller) travel with this sidecar's next
  /// step to every rank and take effect at the step after it. Returns the proposal id.
  uint64_t proposeSettings(std::string json);
  /// POST /v1/checkpoint: every sidecar saves its state as it stood after `step`.
  uint64_t requestCheckpoint(uint64_t step);
  /// POST /v1/report: the trainer's loss at `step` (travels with the next records).
  void reportLoss(uint64_t step, double loss);
  /// POST /v1/report: the trainer's reward at `step` (travels with the next records).
  void reportReward(uint64_t step, double reward);
  /// POST /v1/resume: this sidecar resumed from `step` (told in every record from now on).
  void setResumedFrom(uint64_t step);
  std::optional<uint64_t> resumedFrom() const;

  // --- state ------------------------------------------------------------------------------------
  bool bypassActive(uint64_t step) const;
  /// Status: config, bypass, settings history, baselines, decision log (last entries).
  boost::json::object statusJson() const;
  /// peer.sparse auto (docs/exchange.md "Sparse allreduce"): the collective the step engine chose
  /// for this step of a layer, from what every rank knows alike. Kept in the policy state (so a
  /// sidecar that took the state from its peers logs what they log); a move — or the layer's
  /// first choice — is an `exchange` entry of the decision log with `detail()` (made only then).
  void noteExchange(uint64_t step, const std::string& tensor, bool sparse_allreduce,
                    const std::function<std::string()>& detail);
  /// The decision log (for tests and `lightwire status`).
  std::vector<Decision> decisions() const;
  /// Everything decisions depend on, as JSON (checkpoints, and the job state a rejoining sidecar
  /// takes from its peers). Pending outgoing requests and reported losses are not part of it.
  boost::json::object stateJson() const;
  /// Replaces the state with one from stateJson() (checked; nothing changes on error).
  Status restoreState(const boost::json::value& v);

 private:
  struct Ewma {
    double mean = 0, var = 0;
    uint64_t n = 0;
    void add(double x, double alpha);
    double dev() const;
  };
  struct TensorState {
    Ewma norm, cosine, loss, reward;
    uint32_t degraded = 0;                  // consecutive degraded steps
    double adaptive_scale = 1.0;            // density multiplier of the adaptive schedule
    uint64_t force_full_sync = UINT64_MAX;  // a full-sync forced at this step
    double last_density = -2.0;  // the density override of its last compressed step (-1: none)
    uint64_t last_loss_step = 0;
    bool has_loss_step = false;
    uint64_t last_reward_step = 0;
    bool has_reward_step = false;
    std::optional<uint64_t> last_step;  // the last step updated
    bool lossless = false;              // its last step's plan was codec none, every step
    // peer.sparse auto: its collective at its last compressed selection step (-1: none yet, 0:
    // the allgather, 1: the sparse allreduce); a move is logged (noteExchange).
    int exchange = -1;
    // `codec: auto` (policies/auto.h).
    struct Auto {
      bool active = false;
      size_t cur = 0, prev = 0;  // the rung from cur_from on, and before
      uint64_t cur_from = 0;
      uint64_t flush_at = UINT64_MAX;  // a full-sync with `prev` at this step (a switch)
      size_t candidate = 0;            // a move to more compression waiting for hysteresis
      uint32_t agree = 0;              // ... evaluations in a row that chose it
      uint32_t link_seen = 0;          // updates in a row that saw the link move
      // Its modelled exchange at its last update (weight_step): its share of that step's tail.
      double weight = 0;
      uint64_t weight_step = UINT64_MAX, weight_step_before = UINT64_MAX;  // ... and the one before
      double compute = -1, overlap = 0;  // running means of the reported figures (< 0: none yet)
      double sec_per_byte = 0, latency = 0;                // ... of the link (0: none yet)
      std::vector<std::pair<double, double>> link_recent;  // its last 3 readings (s/byte, latency)
      std::optional<Link> link;                            // the link at the last switch
      std::vector<double> measured;  // per rung: its measured tail (< 0: not measured)
      // Per rung: the compute of the iterations it carried (running mean, < 0: none yet). Where
      // the sidecar shares the trainers' cores, its work on a rung lengthens their compute, which
      // the tail does not show.
      std::vector<double> compute_by;
      uint64_t critical_until = 0;
      bool critical_start = false;  // a critical phase started at this step
      uint64_t next_eval = 0;       // its next evaluation (every `period` of its own steps)
      // Whether an evaluation with a measured link has decided its rung yet: the rung it starts
      // on was nobody's choice, so the first decision away from it needs no hysteresis.
      bool evaluated = false;
      double overhead = 0;  // the sidecar path's own cost (AutoInputs::sidecar_overhead_s)
      // Its last scores with `direct` and with the rung in force (< 0: none yet), and whether
      // `direct` was measured: what the job's direct window compares.
      double score_direct = -1, score_cur = -1, score_best = -1;  // best: the rung it chose
      bool direct_measured = false, best_lossless = false;
      double direct_ignored = -1;  // the hook's direct_s from before the link last moved
      std::string why;             // the inputs of the last evaluation, for people
    } autos;
  };
  struct Settings {
    std::string json;
    uint64_t from_step = 0;
    bool known_good = false;
    std::string why;
  };
  void log(uint64_t step, const std::string& tensor, std::string kind, std::string detail);
  void anomaly(uint64_t step, const std::string& tensor, const char* kind, std::string detail);
  // The parts of update(), in order (mu_ held).
  void takeRequests(const std::string& tensor, uint64_t step, const GlobalStats& g,
                    UpdateResult& out);
  void judgeGradient(const std::string& tensor, uint64_t step, const StepPlan& plan,
                     const GlobalStats& g, TensorState& ts);
  void judgeHealth(const std::string& tensor, uint64_t step, const StepPlan& plan,
                   const GlobalStats& g, TensorState& ts, UpdateResult& out);
  size_t currentSettingsIndex(uint64_t step) const;
  // `codec: auto` (mu_ held): the rung decision of one layer, and the job's direct window.
  void decideAuto(const std::string& tensor, uint64_t step, const GlobalStats& g,
                  const AutoFacts& facts, TensorState& ts);
  void decideDirect(uint64_t step);
  // The parts of decideAuto(), in order.
  struct AutoMeasurement {
    bool link_moved = false;  // the link moved since the layer's last switch (seen twice)
  };
  struct AutoChoice {
    size_t want = 0;        // the rung the layer wants
    bool forced = false;    // the rung in force is no longer usable
    bool critical = false;  // a critical phase lasts
    bool started = false;   // ... and started at this step
  };
  static void readAutoInputs(const GlobalStats& g, TensorState::Auto& a, AutoInputs& in);
  std::optional<double> tailShare(uint64_t step, const GlobalStats& g, const AutoFacts& facts,
                                  const AutoInputs& in, TensorState::Auto& a);
  AutoMeasurement measureAuto(uint64_t step, const GlobalStats& g, std::optional<double> tail,
                              AutoInputs& in, TensorState::Auto& a);
  AutoChoice chooseAuto(uint64_t step, const GlobalStats& g, const AutoInputs& in, bool link_moved,
                        TensorState& ts);
  size_t firstSidecarRung() const;

  const PolicyConfig config_;
  metrics::Metrics* metrics_;
  mutable std::mutex mu_;
  std::map<std::string, TensorState> tensors_;
  std::vector<Settings> settings_;
  uint64_t bypass_from_ = 0, bypass_until_ = 0;  // steps in [from, until) are bypassed (job-wide)
  uint64_t cooldown_until_ = 0;
  DirectWindow direct_;               // the last direct window decided
  std::optional<uint64_t> job_step_;  // the newest step any tensor updated
  // codec auto: the auto layers' modelled exchanges (and elements) of the newest step and of the
  // one before, by which the tails the hook reports are shared among the layers (decideAuto).
  struct TailWeights {
    double weight = 0, elements = 0;
  };
  TailWeights tail_weights_, tail_weights_prev_;
  uint64_t next_seq_ = 0;
  std::deque<Decision> log_;
  // This sidecar's outgoing requests (until seen in a step's global statistics).
  std::vector<Request> outgoing_;
  uint64_t next_request_id_ = 1;
  // The trainers' reports of the newest step reported: their mean goes with the next records.
  struct Reported {
    uint64_t step = 0;
    double sum = 0;
    uint64_t count = 0;
    static void add(std::optional<Reported>& r, uint64_t step, double v);
  };
  std::optional<Reported> loss_, reward_;
  std::optional<uint64_t> resumed_from_;
};

}  // namespace lightwire::policies
