#include "policies/policy.h"

#include "kernels/registry.h"

#include <spdlog/spdlog.h>

#include <boost/json/array.hpp>
#include <boost/json/serialize.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

namespace lightwire::policies {
namespace {

namespace json = boost::json;

constexpr size_t kMaxSettingsVersions = 64;
// codec auto: an unmeasured `direct` rung is tried while its modelled score is at most this many
// times the winning lossless rung's (docs/policies.md "codec: auto").
constexpr double kExploreMargin = 1.5;
// codec auto: a direct window that measured better than the rungs in force had before it is
// followed at once by one twice as long, up to this many times (16, 32, 64, 128 steps with
// probe_every 16); then the sidecars measure the rungs again.
constexpr uint32_t kDirectChain = 3;

bool selection(const kernels::CodecConfig& c) {
  const auto traits = kernels::findCodecTraits(c.name);
  return traits && traits->uses_density;
}

std::string fmt(double v) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

/// `v` with 3 significant digits and a unit: "118 MB/s", "4.1 ms".
// codec auto's running figures: the newest reading weighs 0.3 (the first is taken as it is).
double runningMean(double mean, double x, bool first) { return first ? x : 0.7 * mean + 0.3 * x; }

std::string human(double v, const char* unit) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.3g %s", v, unit);
  return buf;
}

std::string sig(double v) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

/// The configuration with its auto ladder parsed (a PolicyConfig built in code names the ladder
/// by its text only).
PolicyConfig withLadder(PolicyConfig c) {
  if (c.auto_codec.ladder.empty()) {
    if (auto l = parseLadder(c.auto_codec.ladder_text)) c.auto_codec.ladder = std::move(*l);
  }
  return c;
}

}  // namespace

std::optional<double> warmupDensity(uint64_t step, uint64_t warmup_steps) {
  if (warmup_steps == 0 || step >= warmup_steps) return std::nullopt;
  const uint64_t stage = std::min<uint64_t>(4, step * 5 / warmup_steps);
  double d = 0.25;
  for (uint64_t i = 0; i < stage; ++i) d *= 0.25;
  return d;
}

std::optional<double> rewardDropSigma(const PolicyConfig& c) {
  if (c.reward_drop) return std::nullopt;
  return c.reward_drop_sigma.value_or(kRewardDropSigma);
}

Status validate(const PolicyConfig& c) {
  auto bad = [](const char* key, const std::string& what) {
    return invalidArgument(std::string(key) + " must be " + what);
  };
  if (c.bypass_steps < 1) return bad("policies.bypass_steps", "at least 1");
  if (!(c.explode_factor > 1)) return bad("policies.explode_factor", "> 1");
  if (!(c.vanish_factor > 0 && c.vanish_factor < 1))
    return bad("policies.vanish_factor", "in (0, 1)");
  if (!(c.ewma_alpha > 0 && c.ewma_alpha <= 1)) return bad("policies.ewma_alpha", "in (0, 1]");
  if (!(c.cosine_drop > 0 && c.cosine_drop < 1)) return bad("policies.cosine_drop", "in (0, 1)");
  if (!(c.loss_rise > 0)) return bad("policies.loss_rise", "> 0");
  if (c.reward_drop && !(*c.reward_drop > 0 && std::isfinite(*c.reward_drop))) {
    return bad("policies.reward_drop", "a finite number > 0 (or unset)");
  }
  if (c.reward_drop_sigma && !(*c.reward_drop_sigma > 0 && std::isfinite(*c.reward_drop_sigma))) {
    return bad("policies.reward_drop_sigma", "a finite number > 0 (or unset)");
  }
  if (c.reward_drop && c.reward_drop_sigma) {
    return invalidArgument(
        "policies.reward_drop and policies.reward_drop_sigma are both set: the reward rule takes "
        "one form, an absolute drop or a drop of so many deviations; unset one of them");
  }
  if (c.patience < 1) return bad("policies.patience", "at least 1");
  if (!(c.phase_factor >= 1)) return bad("schedule.phase_factor", ">= 1");
  if (!(c.adaptive_tiny > 0 && c.adaptive_tiny < 1))
    return bad("schedule.adaptive_tiny", "in (0, 1)");
  if (!(c.adaptive_sparse > 0 && c.adaptive_sparse <= 1))
    return bad("schedule.adaptive_sparse", "in (0, 1]");
  if (!(c.adaptive_min_ratio >= 1 && c.adaptive_max_ratio >= c.adaptive_min_ratio))
    return bad("schedule.adaptive_min_ratio", ">= 1 and <= schedule.adaptive_max_ratio");
  if (!(c.min_magnitude >= 0 && std::isfinite(c.min_magnitude)))
    return bad("policies.min_magnitude", "a finite number >= 0");
  AutoConfig a = c.auto_codec;
  return validate(a);
}

const char* stepModeName(StepMode m) {
  switch (m) {
    case StepMode::kCompressed:
      return "compressed";
    case StepMode::kBypass:
      return "bypass";
    case StepMode::kFullSync:
      return "full_sync";
    case StepMode::kSkip:
      return "skip";
  }
  return "?";
}

void PolicyEngine::Ewma::add(double x, double alpha) {
  // The state stays finite: it is written as JSON (checkpoints, the job state told to peers),
  // which has no Infinity or NaN. Samples come from peers' records and trainers' reports.
  if (!std::isfinite(x)) return;
  constexpr double kMax = std::numeric_limits<double>::max();
  if (n == 0) {
    mean = x;
    var = 0;
  } else {
    const double d = x - mean;  // overflows for samples far apart near the largest double
    mean = std::isfinite(d) ? mean + alpha * d : (1 - alpha) * mean + alpha * x;
    var = (1 - alpha) * (var + alpha * d * d);
    if (!std::isfinite(var)) var = kMax;  // |d| above ~1e154: as large as it can be
  }
  ++n;
}

double PolicyEngine::Ewma::dev() const { return std::sqrt(std::max(0.0, var)); }

PolicyEngine::PolicyEngine(PolicyConfig config, std::string initial_settings,
                           metrics::Metrics* metrics)
    : config_(withLadder(std::move(config))), metrics_(metrics) {
  // The switch counters of the default group exist from the start (at 0), one per rung.
  if (metrics_) {
    for (const Rung& r : config_.auto_codec.ladder) {
      if (!r.direct) metrics_->autoSwitches("auto", r.text);
    }
  }
  settings_.push_back({std::move(initial_settings), 0, true, "configured"});
}

size_t PolicyEngine::currentSettingsIndex(uint64_t step) const {
  size_t idx = 0;
  for (size_t i = 0; i < settings_.size(); ++i) {
    if (settings_[i].from_step <= step) idx = i;
  }
  return idx;
}

std::pair<uint64_t, std::string> PolicyEngine::settingsAt(uint64_t step) const {
  std::lock_guard lock(mu_);
  const size_t i = currentSettingsIndex(step);
  return {i, settings_[i].json};
}

StepPlan PolicyEngine::plan(const std::string& tensor, uint64_t step,
                            const kernels::CodecConfig& codec, uint32_t sync_every) const {
  std::lock_guard lock(mu_);
  StepPlan p;
  p.settings = currentSettingsIndex(step);
  p.min_magnitude = config_.min_magnitude;
  p.lossless = codec.name == "none" && sync_every <= 1;
  if (sync_every > 1) {
    if ((step + 1) % sync_every != 0) {
      p.mode = StepMode::kSkip;
      return p;
    }
    p.delayed_sync_step = true;
  }
  const auto it = tensors_.find(tensor);
  const bool forced = it != tensors_.end() && it->second.force_full_sync == step;
  if (forced || (config_.full_sync_every > 0 && step > 0 && step % config_.full_sync_every == 0)) {
    p.mode = StepMode::kFullSync;
    return p;
  }
  if (step >= bypass_from_ && step < bypass_until_) {
    p.mode = StepMode::kBypass;
    return p;
  }
  if (!selection(codec) || codec.name == "none") return p;
  const double base = codec.density ? *codec.density : (codec.ratio ? 1.0 / *codec.ratio : 1.0);
  double d = base;
  if (config_.adaptive && it != tensors_.end() && it->second.adaptive_scale != 1.0) {
    d = std::clamp(base * it->second.adaptive_scale, 1.0 / config_.adaptive_max_ratio,
                   std::min(1.0, 1.0 / config_.adaptive_min_ratio));
  }
  if (config_.total_steps > 0) {
    const double f = static_cast<double>(step) / static_cast<double>(config_.total_steps);
    if (f < 0.2 || f >= 0.8) d = std::min(1.0, d * config_.phase_factor);
  }
  if (const auto w = warmupDensity(step, config_.warmup_steps); w && *w > d) d = *w;
  if (d != base) p.density = d;
  return p;
}

std::vector<uint8_t> PolicyEngine::record(StepStats local) const {
  std::lock_guard lock(mu_);
  if (loss_) {
    local.loss = loss_->sum / static_cast<double>(loss_->count);
    local.loss_step = loss_->step;
  }
  if (reward_) {
    local.reward = reward_->sum / static_cast<double>(reward_->count);
    local.reward_step = reward_->step;
  }
  local.resumed_from = resumed_from_;
  local.requests = outgoing_;
  return encodeStats(local);
}

void PolicyEngine::noteExchange(uint64_t step, const std::string& tensor, bool sparse_allreduce,
                                const std::function<std::string()>& detail) {
  std::lock_guard lock(mu_);
  TensorState& ts = tensors_[tensor];
  const int now = sparse_allreduce ? 1 : 0;
  if (ts.exchange == now) return;
  ts.exchange = now;
  log(step, tensor, "exchange", detail());
}

void PolicyEngine::log(uint64_t step, const std::string& tensor, std::string kind,
                       std::string detail) {
  Decision d{next_seq_++, step, tensor, std::move(kind), std::move(detail)};
  // Events at info; the adaptive schedule's density moves can come every step: debug.
  spdlog::log(d.kind == "density" ? spdlog::level::debug : spdlog::level::info,
              "policy: tensor '{}' step {}: {}: {}", d.tensor, d.step, d.kind, d.detail);
  log_.push_back(std::move(d));
  while (log_.size() > std::max<size_t>(1, config_.decision_log)) log_.pop_front();
}

void PolicyEngine::anomaly(uint64_t step, const std::string& tensor, const char* kind,
                           std::string detail) {
  if (metrics_) metrics_->anomalies(kind).Increment();
  if (!config_.anomaly) {
    log(step, tensor, "anomaly", std::string(kind) + ": " + detail + " (bypass is off)");
    return;
  }
  const uint64_t until = step + 1 + config_.bypass_steps;
  log(step, tensor, "anomaly",
      std::string(kind) + ": " + detail + "; compression bypassed for steps " +
          std::to_string(step + 1) + ".." + std::to_string(until - 1));
  // From the next step on (a later tensor of this very step is not bypassed: the ranks decided
  // at the end of this one).
  if (step + 1 >= bypass_until_) bypass_from_ = step + 1;
  bypass_until_ = std::max(bypass_until_, until);
}

// Requests first: they are the same on every rank, in rank order. mu_ held.
void PolicyEngine::takeRequests(const std::string& tensor, uint64_t step, const GlobalStats& g,
                                UpdateResult& out) {
  for (const Request& q : g.requests) {
    if (q.kind == Request::Kind::kCheckpoint) {
      out.checkpoints.push_back(q);
      log(step, tensor, "checkpoint",
          "rank " + std::to_string(q.origin) + " asked for the state after step " +
              std::to_string(q.step));
    } else {
      // Equal to the settings in force: nothing to do (a proposal seen twice, or a no-op).
      const size_t cur = currentSettingsIndex(step + 1);
      if (settings_[cur].json == q.body) continue;
      settings_.push_back(
          {q.body, step + 1, false, "PUT /v1/config at rank " + std::to_string(q.origin)});
      out.settings = settings_.size() - 1;
      log(step, tensor, "settings",
          "version " + std::to_string(settings_.size() - 1) + " from rank " +
              std::to_string(q.origin) + " takes effect at step " + std::to_string(step + 1));
    }
  }
  // Our own requests reached every rank: stop sending them.
  std::erase_if(outgoing_, [&](const Request& mine) {
    return std::any_of(g.requests.begin(), g.requests.end(), [&](const Request& q) {
      return q.kind == mine.kind && q.id == mine.id && q.body == mine.body && q.step == mine.step;
    });
  });
}

// Anomalies of this step's gradient, and the adaptive ratio from a normal one. mu_ held.
void PolicyEngine::judgeGradient(const std::string& tensor, uint64_t step, const StepPlan& plan,
                                 const GlobalStats& g, TensorState& ts) {
  const double alpha = config_.ewma_alpha;
  // Anomalies of this step's gradient. A full-sync step's input also holds everything the codec
  // state held back (residuals, momentum), so its norm is no gradient norm: it is neither judged
  // against the baseline nor folded into it (NaN/Inf still are anomalies).
  const double norm = std::sqrt(g.grad_norm2);
  if (g.nonfinite > 0 || !std::isfinite(norm)) {
    anomaly(step, tensor, "nonfinite",
            std::to_string(g.nonfinite) + " NaN/Inf value(s) in the gradients");
  } else if (plan.mode != StepMode::kFullSync) {
    const bool trusted = ts.norm.n >= config_.baseline_steps;
    if (trusted && ts.norm.mean > 0 && norm > config_.explode_factor * ts.norm.mean &&
        norm > ts.norm.mean + 6 * ts.norm.dev()) {
      anomaly(step, tensor, "explosion",
              "gradient norm " + fmt(norm) + " against a baseline of " + fmt(ts.norm.mean));
    } else if (trusted && ts.norm.mean > 0 && norm < config_.vanish_factor * ts.norm.mean) {
      anomaly(step, tensor, "vanishing",
              "gradient norm " + fmt(norm) + " against a baseline of " + fmt(ts.norm.mean));
    } else {
      // Adaptive ratio, from the statistics of a normal step.
      if (config_.adaptive && plan.mode == StepMode::kCompressed && g.elements > 0) {
        const double before = ts.adaptive_scale;
        const double small = static_cast<double>(g.small) / static_cast<double>(g.elements);
        if (small > config_.adaptive_sparse) {
          ts.adaptive_scale = std::min(ts.adaptive_scale * 2, 1e6);
        } else if (trusted && norm < config_.adaptive_tiny * ts.norm.mean) {
          ts.adaptive_scale = std::max(ts.adaptive_scale / 2, 1e-6);
        }
        if (ts.adaptive_scale != before) {
          log(step, tensor, "density",
              std::string(ts.adaptive_scale > before ? "already-sparse gradient ("
                                                     : "tiny gradient norm (") +
                  (ts.adaptive_scale > before ? fmt(small * 100) + " % below min_magnitude"
                                              : fmt(norm) + " against " + fmt(ts.norm.mean)) +
                  "): density scale " + fmt(before) + " -> " + fmt(ts.adaptive_scale));
        }
      }
      ts.norm.add(norm, alpha);
    }
  }
}

// Health (the cosine of compressed steps, the reported loss and reward) and rollback. mu_ held.
void PolicyEngine::judgeHealth(const std::string& tensor, uint64_t step, const StepPlan& plan,
                               const GlobalStats& g, TensorState& ts, UpdateResult& out) {
  const double alpha = config_.ewma_alpha;
  // A schedule changed the density (warm-up stages, phases, adaptive): the cosine moves with it
  // by design, so its baseline starts again rather than reading that as degradation. (A settings
  // change is judged against the baseline of the settings before: that is what rollback is for.)
  const double density = plan.density.value_or(-1.0);
  if (plan.mode == StepMode::kCompressed && density != ts.last_density) {
    if (ts.last_density != -2.0) {
      ts.cosine = {};
      ts.degraded = 0;
    }
    ts.last_density = density;
  }
  // Health: cosine of compressed steps, reported loss, reported reward.
  bool degraded = false;
  std::string why;
  const auto cos = g.cosine();
  if (cos && plan.mode == StepMode::kCompressed) {
    if (ts.cosine.n >= config_.baseline_steps && ts.cosine.mean > 0 &&
        *cos < ts.cosine.mean * (1 - config_.cosine_drop)) {
      degraded = true;
      why = "cosine similarity " + fmt(*cos) + " against a baseline of " + fmt(ts.cosine.mean);
    }
  }
  const auto loss = g.loss();
  const bool new_loss = loss && (!ts.has_loss_step || g.loss_step > ts.last_loss_step);
  if (new_loss) {
    ts.has_loss_step = true;
    ts.last_loss_step = g.loss_step;
    if (ts.loss.n >= config_.baseline_steps && *loss > ts.loss.mean * (1 + config_.loss_rise)) {
      degraded = true;
      why += (why.empty() ? "" : "; ") + std::string("reported loss ") + fmt(*loss) +
             " against a baseline of " + fmt(ts.loss.mean);
    }
  }
  // The reward (higher is better): a drop below its baseline by more than the rule allows; a rise
  // never counts.
  const auto reward = g.reward();
  const bool new_reward = reward && (!ts.has_reward_step || g.reward_step > ts.last_reward_step);
  if (new_reward) {
    ts.has_reward_step = true;
    ts.last_reward_step = g.reward_step;
    if (metrics_) metrics_->reward().Set(*reward);
    const auto sigma = rewardDropSigma(config_);
    const double allowed = sigma ? *sigma * ts.reward.dev() : *config_.reward_drop;
    if (ts.reward.n >= config_.baseline_steps && ts.reward.mean - *reward > allowed) {
      degraded = true;
      why += (why.empty() ? "" : "; ") + std::string("reported reward ") + fmt(*reward) +
             " against a baseline of " + fmt(ts.reward.mean) + " (a drop of more than " +
             fmt(allowed) + (sigma ? ", " + fmt(*sigma) + " deviations)" : ")");
    }
  }
  const size_t cur = currentSettingsIndex(step);
  if (degraded && config_.rollback && step >= cooldown_until_) {
    if (++ts.degraded >= config_.patience) {
      ts.degraded = 0;
      // The newest known-good settings older than the ones in force.
      std::optional<size_t> good;
      for (size_t i = cur; i-- > 0;) {
        if (settings_[i].known_good) {
          good = i;
          break;
        }
      }
      cooldown_until_ = step + 1 + config_.cooldown_steps;
      if (good && settings_[*good].json != settings_[cur].json) {
        settings_.push_back({settings_[*good].json, step + 1, true,
                             "rollback to version " + std::to_string(*good)});
        out.settings = settings_.size() - 1;
        if (metrics_) metrics_->rollbacks.Increment();
        log(step, tensor, "rollback",
            why + ": settings version " + std::to_string(cur) + " reverted to version " +
                std::to_string(*good) + " from step " + std::to_string(step + 1));
        for (auto& [name, other] : tensors_) {
          other.cosine = {};
          other.degraded = 0;
          other.adaptive_scale = 1.0;
        }
      } else {
        log(step, tensor, "degraded", why + ": no earlier known-good settings to revert to");
      }
    }
  } else {
    // A step that measured no health signal (the cosine is sampled) neither breaks nor extends
    // a degraded streak.
    const bool measured = (cos && plan.mode == StepMode::kCompressed) || new_loss || new_reward;
    if (!degraded && measured) ts.degraded = 0;
    if (cos && plan.mode == StepMode::kCompressed) ts.cosine.add(*cos, alpha);
    if (new_loss) ts.loss.add(*loss, alpha);
    if (new_reward) ts.reward.add(*reward, alpha);
    // Settings in force long enough without degradation are known-good.
    if (!degraded && !settings_[cur].known_good &&
        step >= settings_[cur].from_step + config_.known_good_steps) {
      settings_[cur].known_good = true;
      log(step, tensor, "known_good", "settings version " + std::to_string(cur) + " is known-good");
    }
  }
}

UpdateResult PolicyEngine::update(const std::string& tensor, uint64_t step, const StepPlan& plan,
                                  const GlobalStats& g, const AutoFacts* auto_facts) {
  std::lock_guard lock(mu_);
  UpdateResult out;
  // A new step's first update: the job's direct window, from the rungs of the step before.
  if (!job_step_ || step > *job_step_) {
    if (job_step_) decideDirect(step);
    job_step_ = step;
    tail_weights_prev_ = tail_weights_;
    tail_weights_ = {};
  }
  TensorState& ts = tensors_[tensor];
  ts.last_step = step;
  ts.lossless = plan.lossless;
  // The first step of an auto layer's new rung: its baselines start afresh. The norm's (critical
  // phases, anomalies), because what the trainer sends may change with the rung —
  // lightwire.torch.AdamW sends its preconditioned update where the rung selects, the gradient
  // elsewhere: norms 10^3-10^4 apart on the LM, which read as a critical phase that moved the
  // layer straight back; the cosine's (health, rollback), because a lossier rung has a lower
  // cosine by design, as a density schedule's stage has (judgeHealth). And again at its second
  // step: a trainer learns a layer's rung from the reply of the step before, so the first step of
  // a new rung still carries what it sent for the old one.
  if (auto_facts && ts.autos.active && ts.autos.prev != ts.autos.cur &&
      (step == ts.autos.cur_from || step == ts.autos.cur_from + 1)) {
    ts.norm = Ewma{};
    ts.cosine = Ewma{};
    ts.degraded = 0;
  }
  // A critical phase starts with a sharp change of the gradient norm against its baseline (before
  // this step's norm joins it).
  const double norm = std::sqrt(g.grad_norm2);
  if (auto_facts && ts.norm.n >= config_.baseline_steps && ts.norm.mean > 0 &&
      std::isfinite(norm) && plan.mode != StepMode::kFullSync &&
      std::abs(norm / ts.norm.mean - 1) > config_.auto_codec.critical_change) {
    if (step >= ts.autos.critical_until) {
      log(step, tensor, "critical",
          "gradient norm " + fmt(norm) + " against a baseline of " + fmt(ts.norm.mean) +
              ": one rung less compressed, and no more, until step " +
              std::to_string(step + 1 + config_.auto_codec.critical_hold));
      ts.autos.critical_start = true;
    }
    ts.autos.critical_until = step + 1 + config_.auto_codec.critical_hold;
  }
  takeRequests(tensor, step, g, out);
  judgeGradient(tensor, step, plan, g, ts);
  if (metrics_) {
    const bool next = step + 1 >= bypass_from_ && step + 1 < bypass_until_;
    metrics_->bypass_active.Set(next ? 1.0 : 0.0);
  }

  judgeHealth(tensor, step, plan, g, ts, out);
  if (plan.mode == StepMode::kFullSync) {
    const bool forced = ts.force_full_sync == step;
    const bool switching = auto_facts && ts.autos.flush_at == step;
    if (metrics_) {
      metrics_->fullSyncs(forced ? "divergence" : (switching ? "switch" : "periodic")).Increment();
    }
    log(step, tensor, "full_sync",
        forced ? "after a result mismatch"
               : (switching ? "flushing " + config_.auto_codec.ladder[ts.autos.prev].label +
                                  "'s state before the switch to " +
                                  config_.auto_codec.ladder[ts.autos.cur].label
                            : std::string("periodic")));
  }
  if (auto_facts && !config_.auto_codec.ladder.empty())
    decideAuto(tensor, step, g, *auto_facts, ts);
  // Bound the history: keep the newest versions and every one still referenced.
  while (settings_.size() > kMaxSettingsVersions) {
    settings_.erase(settings_.begin() + 1);  // version 0 (as configured) stays
  }
  return out;
}

size_t PolicyEngine::firstSidecarRung() const {
  const auto& l = config_.auto_codec.ladder;
  return !l.empty() && l[0].direct ? 1 : 0;
}

AutoStep PolicyEngine::autoStep(const std::string& tensor, uint64_t step) const {
  std::lock_guard lock(mu_);
  AutoStep a;
  const auto& ladder = config_.auto_codec.ladder;
  if (ladder.empty()) return a;
  a.index = firstSidecarRung();
  const auto it = tensors_.find(tensor);
  if (it != tensors_.end() && it->second.autos.active) {
    const auto& s = it->second.autos;
    a.index = step >= s.cur_from ? s.cur : s.prev;
    a.flush = step == s.flush_at;
  }
  a.rung = &ladder[a.index];
  return a;
}

std::optional<DirectWindow> PolicyEngine::directWindowAfter(uint64_t step) const {
  std::lock_guard lock(mu_);
  if (direct_.until > direct_.from && direct_.from > step) return direct_;
  return std::nullopt;
}

// One layer's rung (mu_ held): every `period` steps, or at once when the link moved by more than
// `link_change` since its last switch (seen at two updates in a row), the least lossy rung the time
// model finds within `tolerance` of the fastest, one rung less compressed in a critical phase. A
// move to less compression happens at once; to more, after `hysteresis` evaluations in a row agree
// (or at once when the link changed). A switch away from a rung whose codec holds state is preceded
// by a full-sync with it.
void PolicyEngine::decideAuto(const std::string& tensor, uint64_t step, const GlobalStats& g,
                              const AutoFacts& facts, TensorState& ts) {
  const AutoConfig& ac = config_.auto_codec;
  auto& a = ts.autos;
  if (!a.active) {
    a.active = true;
    a.cur = a.prev = firstSidecarRung();
    a.cur_from = step;
    a.next_eval = step;
  }
  if (!g.link_bytes_per_s) return;  // nothing measured yet
  AutoInputs in;
  in.elements = facts.elements;
  in.shape = facts.shape;
  in.world = facts.world;
  readAutoInputs(g, a, in);
  const std::optional<double> tail = tailShare(step, g, facts, in, a);
  if (step < a.cur_from) return;  // a switch is under way
  const AutoMeasurement m = measureAuto(step, g, tail, in, a);
  const AutoChoice c = chooseAuto(step, g, in, m.link_moved, ts);
  const size_t want = c.want;
  const auto cos = g.cosine();
  a.why = "link " + human(in.link->bytes_per_s / 1e6, "MB/s") + ", latency " +
          human(in.link->latency_s * 1e3, "ms") +
          (g.compute_s ? ", compute " + human(in.compute_s * 1e3, "ms") + ", overlap " +
                             human(in.overlap_s * 1e3, "ms")
                       : std::string(", compute not reported")) +
          (g.direct_s ? ", direct " + human(*g.direct_s * 1e3, "ms") : std::string()) +
          (tail ? ", sidecar tail " + human(*tail * 1e3, "ms") : std::string()) +
          (cos ? ", cosine " + sig(*cos) : "") +
          (g.momentum ? ", trainers' momentum " + sig(*g.momentum) : "") +
          (c.critical ? ", critical phase" : "") + (m.link_moved ? ", link moved" : "") +
          "; model " + human(modelScore(ac.ladder[a.cur], in) * 1e3, "ms") + " now, " +
          human(modelScore(ac.ladder[want], in) * 1e3, "ms") + " with " + ac.ladder[want].label;
  // Due every `period` steps of the layer (its steps, not the job's: a layer in a direct window
  // has none), and at the steps right after a direct window, which are the ones that see it.
  const bool after_window = direct_.until > 0 && step >= direct_.until && step <= direct_.until + 2;
  const bool due = step >= a.next_eval || after_window;
  // The job's direct window compares these (decideDirect).
  a.score_direct = ac.ladder[0].direct ? modelScore(ac.ladder[0], in) : -1.0;
  a.direct_measured = !a.measured.empty() && a.measured[0] >= 0;
  a.score_cur = modelScore(ac.ladder[a.cur], in);
  a.score_best = modelScore(ac.ladder[want], in);
  a.best_lossless = ac.ladder[want].steps_factor == 1.0;
  // The first decision waits for the hook's compute figure (it comes with the trainer's second
  // iteration), for at most a period: made without it, at the first step, it moved layers of an
  // unlimited loopback to dgc and back (measured: 0.94x DDP's step against 0.99x).
  if (!a.evaluated && !g.compute_s && step < a.cur_from + ac.period && !c.forced) return;
  if (!(due || m.link_moved || c.forced || (c.started && want < a.cur))) return;
  if (due) a.next_eval = step + ac.period;
  const bool first = !a.evaluated;
  a.evaluated = true;
  if (want == a.cur) {
    a.agree = 0;
    if (!a.link || m.link_moved) a.link = in.link;
    return;
  }
  if (want > a.cur && !m.link_moved && !first && !c.forced) {  // more compression: hysteresis
    a.agree = a.candidate == want ? a.agree + 1 : 1;
    a.candidate = want;
    if (a.agree < ac.hysteresis) return;
  }
  const Rung& from = ac.ladder[a.cur];
  const Rung& to = ac.ladder[want];
  const bool flush = !from.direct && from.impl->stateFloats(1 << 16) > 0;
  a.prev = a.cur;
  a.cur = want;
  a.flush_at = flush ? step + 1 : UINT64_MAX;
  a.cur_from = step + (flush ? 2 : 1);
  a.agree = 0;
  a.link = in.link;  // the link the new rung's measurements belong to
  a.score_cur = modelScore(to, in);
  if (metrics_) metrics_->autoSwitches(facts.group, to.text).Increment();
  log(step, tensor, "auto",
      from.label + " -> " + to.label + " from step " + std::to_string(a.cur_from) +
          (flush ? " (step " + std::to_string(step + 1) + " flushes " + from.label + "'s state)"
                 : "") +
          " (" + a.why + ")");
}

// The link and the compute of one auto layer's step, as running figures (decideAuto).
void PolicyEngine::readAutoInputs(const GlobalStats& g, TensorState::Auto& a, AutoInputs& in) {
  // The link as a running mean (weight 0.3 for the newest) of the median of its last three
  // readings, in time per byte and latency: the estimate swings by a factor of two from step to
  // step (on the LM at 1 Gbit/s, 32 to 70 MB/s, as the other ranks' flows come and go), and a
  // swing read as a new link forgot what the rungs had measured. The median drops a reading
  // alone; in time per byte a slowdown shows soon (a link ten times slower reads 3.7 times slower
  // at its second step, 5.6 at its third), a burst of speed only damped.
  a.link_recent.emplace_back(1.0 / *g.link_bytes_per_s, g.link_latency_s.value_or(0.0));
  while (a.link_recent.size() > 3) a.link_recent.erase(a.link_recent.begin());
  std::vector<double> spbs, lats;
  for (const auto& [b, l] : a.link_recent) {
    spbs.push_back(b);
    lats.push_back(l);
  }
  const double spb = median(std::move(spbs)), lat = median(std::move(lats));
  const bool first_link = !(a.sec_per_byte > 0);
  a.sec_per_byte = runningMean(a.sec_per_byte, spb, first_link);
  a.latency = runningMean(a.latency, lat, first_link);
  in.link = Link{1.0 / a.sec_per_byte, a.latency};
  // The compute and the overlap as a running mean over the layer's steps (weight 0.3 for the
  // newest): the least any rank reported swings by a factor of two from step to step (one rank
  // evaluates, the two cores are shared), and through the steps factors every rung's score with
  // it — on the LM at 1 Gbit/s layers took turns between qsgd 4 bits and fp16 with each swing.
  if (g.compute_s && g.overlap_s) {
    const bool first = !(a.compute >= 0);
    a.compute = runningMean(a.compute, *g.compute_s, first);
    a.overlap = runningMean(a.overlap, *g.overlap_s, first);
  }
  in.compute_s = a.compute >= 0 ? a.compute : 0.0;
  in.overlap_s = a.compute >= 0 ? std::min(a.overlap, a.compute) : 0.0;
  in.direct_s = g.direct_s;
}

// The layer's share of the tail the hook reported with this step (that of the trainer's previous
// iteration), and its weight for the next one's (decideAuto). The hook shares an iteration's tail
// among the layers by their elements; but a layer that moves a hundredth of the bytes does not
// cause as much of it as a dense one beside it. Each layer's share is taken in proportion to the
// modelled exchange of the rung that carried it (its weight: a full-sync's dense bytes, a
// warm-up's density), against the weights of every auto layer of that step — the step before
// this one, whose tail this request carries.
std::optional<double> PolicyEngine::tailShare(uint64_t step, const GlobalStats& g,
                                              const AutoFacts& facts, const AutoInputs& in,
                                              TensorState::Auto& a) {
  const AutoConfig& ac = config_.auto_codec;
  const uint64_t weight_step = a.weight_step, weight_step_before = a.weight_step_before;
  const double weight = a.weight;
  const bool flushing = step == a.flush_at;
  const Rung& carrying = ac.ladder[step >= a.cur_from ? a.cur : a.prev];
  const auto density = warmupDensity(step, config_.warmup_steps);
  const double n = static_cast<double>(facts.elements);
  const double bytes = flushing || carrying.direct
                           ? 2.0 * (facts.world - 1) / std::max<uint32_t>(facts.world, 1) * 4.0 * n
                           : modelBytes(*carrying.impl, facts.elements, facts.shape, facts.world,
                                        selection(carrying.codec) && density &&
                                                *density > carrying.codec.density.value_or(1.0)
                                            ? density
                                            : std::nullopt);
  a.weight = modelExchangeSeconds(carrying, *in.link, bytes, facts.elements);
  a.weight_step_before = a.weight_step;
  a.weight_step = step;
  tail_weights_.weight += a.weight;
  tail_weights_.elements += n;
  // Not the tail of the first iteration through the sidecars after a gap (a direct window): as
  // the first step of a rung, it cost several times the steps after it (on the MLP at 10 Gbit/s,
  // 123 ms against 60 ms), and it moved layers to rungs that measured no better.
  if (g.tail_s && step > 1 && weight_step == step - 1 && weight_step_before == step - 2 &&
      weight > 0 && tail_weights_prev_.weight > 0) {
    return *g.tail_s * (weight / n) * (tail_weights_prev_.elements / tail_weights_prev_.weight);
  }
  return std::nullopt;
}

// What the hook measured of the rungs, whether the link moved, and the sidecar path's own cost,
// into `in` (decideAuto).
PolicyEngine::AutoMeasurement PolicyEngine::measureAuto(uint64_t step, const GlobalStats& g,
                                                        std::optional<double> tail, AutoInputs& in,
                                                        TensorState::Auto& a) {
  const AutoConfig& ac = config_.auto_codec;
  AutoMeasurement out;
  // What the hook measured: the direct rung's tail in direct windows; the rung in force's from its
  // second step on. A request carries the tail of the trainer's previous iteration, so the first
  // tail of the rung's second step comes with its third: the first step of a rung is left out
  // (measured: 0.24-0.85 s against 0.03-0.09 s for the steps after it, for dgc 1 % at 1 Gbit/s).
  // Nor are the steps a selection rung runs above its own density in the DGC warm-up
  // (schedule.warmup_steps): 1.0-1.5 s at 25 % against 0.05 s at 1 % for the MLP at 1 Gbit/s, a
  // figure that would hold the rung back long after the warm-up.
  const Rung& in_force = ac.ladder[a.cur];
  const auto warm = step > 0 ? warmupDensity(step - 1, config_.warmup_steps) : std::nullopt;
  const bool warming =
      selection(in_force.codec) && warm && *warm > in_force.codec.density.value_or(1.0);
  const bool rung_measured = step >= a.cur_from + 2 && !warming && tail && !in_force.direct;
  a.measured.resize(ac.ladder.size(), -1.0);
  a.compute_by.resize(ac.ladder.size(), -1.0);
  // The compute the hook reports with a request is of the trainer's previous iteration, as the
  // tail is: at the first step after a direct window, of the window's last iteration; otherwise
  // of the rung in force, when its tail is measured (below).
  const auto note_compute = [&](size_t rung) {
    if (!g.compute_s) return;
    double& c = a.compute_by[rung];
    c = runningMean(c, *g.compute_s, c < 0);
  };
  if (ac.ladder[0].direct && direct_.until > 0 && step == direct_.until) note_compute(0);
  // The hook's `direct_s` changes only in a direct window: a figure from before the link moved
  // stays ignored until a window measures again.
  if (g.direct_s && ac.ladder[0].direct && *g.direct_s != a.direct_ignored) {
    a.measured[0] = *g.direct_s;
  }
  // A tail twice the rung's running figure, at two updates in a row, is a link that slowed down
  // as surely as the estimate (which the median and the running means make wait a few steps):
  // the measured tail moves at the first slow iteration. One such tail alone (a rank that
  // evaluated, which the others waited for) does not join the figure.
  bool tail_jump = false;
  if (rung_measured) {
    double& m = a.measured[a.cur];
    tail_jump = m > 0 && *tail > 2 * m;
    if (!tail_jump) {
      m = m < 0 ? *tail : 0.5 * m + 0.5 * *tail;
      note_compute(a.cur);
    } else if (a.link_seen >= 1) {
      m = *tail;  // the second in a row: the figure of the new link
    }
  }
  // A link that moved since the layer's last switch: what was measured is of another link.
  if (a.link) {
    AutoInputs then = in;
    then.link = a.link;
    const double before = modelExchangeSeconds(in_force, then),
                 now = modelExchangeSeconds(in_force, in);
    // Seen at two updates in a row: one exchange that waited on a slow peer is not a new link.
    const bool moved_now =
        std::abs(now - before) > ac.link_change * std::max(before, 1e-4) || tail_jump;
    out.link_moved = moved_now && a.link_seen >= 1;
    a.link_seen = moved_now ? a.link_seen + 1 : 0;
  }
  if (out.link_moved) {
    for (size_t i = 0; i < a.measured.size(); ++i) {
      if (i != a.cur) a.measured[i] = -1.0;
    }
    if (g.direct_s) a.direct_ignored = *g.direct_s;
  }
  in.measured_s = a.measured;
  in.compute_by_s = a.compute_by;
  // `direct` as the model has it, unless measured since the link moved.
  if (a.measured.empty() || a.measured[0] < 0) in.direct_s.reset();
  in.ladder_base = ac.ladder.data();
  if (rung_measured) {
    // The measured tail of the steps through the sidecars against what the model says of the
    // rung that carried them: the rest is the sidecar path's own cost.
    AutoInputs bare = in;
    bare.measured_s.clear();
    bare.compute_by_s.clear();
    const double modelled = modelStepSeconds(in_force, bare) - in.compute_s;
    a.overhead = std::max(0.0, *tail - modelled);
  }
  in.sidecar_overhead_s = a.overhead;
  in.overhead_ref_s = modelExchangeSeconds(in_force, in);
  return out;
}

// The rung the layer wants (decideAuto): the model's choice, kept in the band of the rung in
// force, on the side of a momentum rung unless the margin is won, and held back in a critical
// phase.
PolicyEngine::AutoChoice PolicyEngine::chooseAuto(uint64_t step, const GlobalStats& g,
                                                  const AutoInputs& in, bool link_moved,
                                                  TensorState& ts) {
  const AutoConfig& ac = config_.auto_codec;
  auto& a = ts.autos;
  AutoChoice out;
  // `direct` is job-wide (decideDirect): a layer chooses among the rungs through the sidecars.
  // A rung with momentum correction only where every trainer declared that momentum: the
  // optimizer must leave those layers' momentum to the sidecar (docs/policies.md "codec: auto").
  std::vector<char> usable(ac.ladder.size());
  for (size_t i = 0; i < ac.ladder.size(); ++i) {
    usable[i] = !ac.ladder[i].direct && rungUsable(ac.ladder[i], in.elements, in.shape, g.momentum);
  }
  // The rung in force no longer usable (the trainers stopped declaring its momentum): it goes at
  // once, whichever way the ladder moves.
  out.forced = !ac.ladder[a.cur].direct && !usable[a.cur];
  size_t want = chooseRung(ac.ladder, usable, in, ac.tolerance);
  const auto best_of = [&](const std::vector<char>& among) {
    double best = INFINITY;
    for (size_t i = 0; i < ac.ladder.size(); ++i) {
      if (among[i]) best = std::min(best, modelScore(ac.ladder[i], in));
    }
    return best;
  };
  // The rung in force stays while it is within the tolerance of the best (a band, so that rungs
  // of nearly equal scores do not take turns with the noise of the measurements).
  if (want != a.cur && usable[a.cur] &&
      modelScore(ac.ladder[a.cur], in) <= best_of(usable) * (1 + ac.tolerance)) {
    want = a.cur;
  }
  // A move onto or off a rung with momentum correction loses the layer's velocity (and leaving
  // flushes): it must win by the margin over the best rung on the side of the rung in force, or
  // the layer stays on that side (rungs of nearly equal scores on the two sides took turns with
  // the noise of the measurements on fast links).
  const auto owns = [&](size_t i) { return ac.ladder[i].codec.momentum > 0; };
  if (!out.forced && want != a.cur && owns(want) != owns(a.cur)) {
    std::vector<char> side(usable);
    for (size_t i = 0; i < ac.ladder.size(); ++i) side[i] = usable[i] && owns(i) == owns(a.cur);
    const double side_best = best_of(side);
    if (modelScore(ac.ladder[want], in) * (1 + ac.momentum_margin) > side_best) {
      want = chooseRung(ac.ladder, side, in, ac.tolerance);
      if (modelScore(ac.ladder[a.cur], in) <= side_best * (1 + ac.tolerance)) want = a.cur;
    }
  }
  // Critical phases: no move to more compression while one lasts; and when one starts, a lossy
  // rung in force gives way to the next less lossy one at once.
  out.critical = step < ac.critical_steps || step < a.critical_until || ts.degraded > 0;
  out.started = a.critical_start;
  a.critical_start = false;
  if (out.critical && want > a.cur && !link_moved && !out.forced) want = a.cur;
  // Not across the sides of a momentum rung: leaving it loses the layer's velocity and flushes,
  // and coming back after the phase loses it again — on the MLP at 1 Gbit/s the critical phases
  // around step 85 that moved the large layers from dgc with momentum correction to qsgd 4 bits
  // and back cost 110 more steps to DDP's loss than the fixed dgc row (710 against 600).
  if (out.started && ac.ladder[a.cur].steps_factor > 1) {
    for (size_t i = a.cur; i-- > 0;) {
      if (usable[i] && owns(i) == owns(a.cur)) {
        want = std::min(want, i);
        break;
      }
    }
  }
  out.want = want;
  return out;
}

// The job's direct window (mu_ held), at the first update of `step`, from the layers' scores of
// the steps before: when every tensor updated in the last `period` steps is an auto layer (scored)
// or a tensor sent with codec none every step (which the process group averages the same way), and
// the auto layers' scores with `direct` times (1 + tolerance) add up to at most their scores with
// the rungs in force (a window costs steps through the sidecars to measure again: `direct` must
// win) — or `direct` was never measured, every rung in force is lossless and the model puts
// `direct` within kExploreMargin of them — the trainers average steps step + 1 ... step +
// probe_every themselves; the steps after come back to the sidecars, which measure again (a new
// window needs three steps through the sidecars after the last one, so that the scores are of a
// link measured after it). Except in a chain: at the first update of the second step after a
// window, when every layer's `direct` (just measured in it) beats by the tolerance the rung in
// force as measured before it, the next window follows at once, twice as long (up to kDirectChain
// times): on the unlimited loopback a third of the LM's steps went through the sidecars between
// windows of 16, at 1.07-1.13x DDP's step where direct ran at 1.00-1.02x.
void PolicyEngine::decideDirect(uint64_t step) {
  const AutoConfig& ac = config_.auto_codec;
  if (ac.ladder.empty() || !ac.ladder[0].direct || !job_step_) return;
  const uint64_t prev = *job_step_;
  const bool chained = direct_.until > 0 && prev == direct_.until && direct_.chain < kDirectChain;
  if (direct_.until > 0 && prev < direct_.until + 2 && !chained) return;
  size_t layers = 0;
  double with_direct = 0, in_force = 0;
  bool measured = false, lossless = true;
  for (const auto& [name, ts] : tensors_) {
    if (!ts.last_step || *ts.last_step + ac.period < prev) continue;  // not seen lately
    const auto& a = ts.autos;
    if (!a.active) {
      if (!ts.lossless) return;  // a tensor of its own codec: the sidecars must carry it
      continue;                  // codec none already: the process group does the same
    }
    if (!(a.score_direct >= 0) || !(a.score_cur >= 0) || !(a.score_best >= 0) ||
        a.cur_from > prev + 1) {
      return;
    }
    // A layer whose momentum the sidecar owns (a dgc:D:M rung): the process group's average
    // carries no momentum, and handing it to the optimizer for the window and back would lose the
    // velocity twice.
    if (ac.ladder[a.cur].codec.momentum > 0) return;
    // A link on the move (seen by a layer, not yet twice in a row): its scores are of the link
    // before, `direct`'s measured one too — on the MLP, a window decided one step after the link
    // fell from 10 to 1 Gbit/s ran 16 steps at 1.05 s where the sidecars were to run at 0.12 s.
    if (a.link_seen > 0) return;
    // A chain compares measurements: the window's `direct` against the rung in force's figure.
    if (chained && (!a.direct_measured || a.cur >= a.measured.size() || a.measured[a.cur] < 0)) {
      return;
    }
    with_direct += a.score_direct;
    in_force += std::min(a.score_cur, a.score_best);  // a switch may be waiting for hysteresis
    measured = measured || a.direct_measured;
    lossless = lossless && ac.ladder[a.cur].steps_factor == 1.0 && a.best_lossless;
    ++layers;
  }
  if (layers == 0) return;
  const bool better = with_direct * (1 + ac.tolerance) <= in_force;
  const bool explore = !measured && lossless && with_direct <= kExploreMargin * in_force;
  if (!better && !(explore && !chained)) return;
  const uint32_t chain = chained ? direct_.chain + 1 : 0;
  direct_ = {step + 1, step + 1 + (ac.probe_every << chain), chain};
  if (metrics_) metrics_->auto_direct_windows.Increment();
  log(step, "*", "direct",
      "the trainers' own process group averages steps " + std::to_string(direct_.from) + ".." +
          std::to_string(direct_.until - 1) + " (" + std::to_string(layers) + " auto layers: " +
          human(with_direct * 1e3, "ms") + " with it against " + human(in_force * 1e3, "ms") +
          " with their rungs" + (better ? "" : ", not measured yet: tried") +
          (chained ? ", as measured in the window before and before it: window " +
                         std::to_string(chain + 1) + " of a chain of at most " +
                         std::to_string(kDirectChain + 1)
                   : std::string()) +
          "), then the sidecars measure again");
}

void PolicyEngine::forceFullSync(const std::string& tensor, uint64_t step) {
  std::lock_guard lock(mu_);
  tensors_[tensor].force_full_sync = step + 1;
}

uint64_t PolicyEngine::proposeSettings(std::string json) {
  std::lock_guard lock(mu_);
  Request q;
  q.kind = Request::Kind::kSettings;
  q.id = next_request_id_++;
  q.body = std::move(json);
  // A newer proposal replaces one not yet sent.
  std::erase_if(outgoing_, [](const Request& r) { return r.kind == Request::Kind::kSettings; });
  outgoing_.push_back(std::move(q));
  return outgoing_.back().id;
}

uint64_t PolicyEngine::requestCheckpoint(uint64_t step) {
  std::lock_guard lock(mu_);
  Request q;
  q.kind = Request::Kind::kCheckpoint;
  q.id = next_request_id_++;
  q.step = step;
  outgoing_.push_back(q);
  while (outgoing_.size() > 8) outgoing_.erase(outgoing_.begin());
  return q.id;
}

void PolicyEngine::Reported::add(std::optional<Reported>& r, uint64_t step, double v) {
  if (!std::isfinite(v)) return;
  // The mean of the values of the newest step (several local trainers report one each).
  if (!r || step > r->step) {
    r = Reported{step, v, 1};
  } else if (step == r->step) {
    r->sum += v;
    ++r->count;
  }
}

void PolicyEngine::reportLoss(uint64_t step, double loss) {
  std::lock_guard lock(mu_);
  Reported::add(loss_, step, loss);
}

void PolicyEngine::reportReward(uint64_t step, double reward) {
  std::lock_guard lock(mu_);
  Reported::add(reward_, step, reward);
}

void PolicyEngine::setResumedFrom(uint64_t step) {
  std::lock_guard lock(mu_);
  resumed_from_ = step;
  loss_.reset();
  reward_.reset();
}

std::optional<uint64_t> PolicyEngine::resumedFrom() const {
  std::lock_guard lock(mu_);
  return resumed_from_;
}

bool PolicyEngine::bypassActive(uint64_t step) const {
  std::lock_guard lock(mu_);
  return step >= bypass_from_ && step < bypass_until_;
}

std::vector<Decision> PolicyEngine::decisions() const {
  std::lock_guard lock(mu_);
  return {log_.begin(), log_.end()};
}

namespace {

json::object ewmaJson(double mean, double var, uint64_t n) {
  return {{"mean", mean}, {"var", var}, {"n", n}};
}

}  // namespace

json::object PolicyEngine::stateJson() const {
  std::lock_guard lock(mu_);
  json::object o;
  o["version"] = 1;
  o["bypass_from"] = bypass_from_;
  o["bypass_until"] = bypass_until_;
  o["cooldown_until"] = cooldown_until_;
  o["next_seq"] = next_seq_;
  o["resumed_from"] = resumed_from_ ? json::value(*resumed_from_) : json::value(nullptr);
  o["direct"] =
      json::object{{"from", direct_.from}, {"until", direct_.until}, {"chain", direct_.chain}};
  o["job_step"] = job_step_ ? json::value(*job_step_) : json::value(nullptr);
  o["tail_weights"] = json::array{tail_weights_.weight, tail_weights_.elements,
                                  tail_weights_prev_.weight, tail_weights_prev_.elements};
  json::array settings;
  for (const auto& s : settings_) {
    settings.push_back(json::object{{"json", s.json},
                                    {"from_step", s.from_step},
                                    {"known_good", s.known_good},
                                    {"why", s.why}});
  }
  o["settings"] = std::move(settings);
  json::object tensors;
  for (const auto& [name, t] : tensors_) {
    tensors[name] = json::object{
        {"norm", ewmaJson(t.norm.mean, t.norm.var, t.norm.n)},
        {"cosine", ewmaJson(t.cosine.mean, t.cosine.var, t.cosine.n)},
        {"loss", ewmaJson(t.loss.mean, t.loss.var, t.loss.n)},
        {"reward", ewmaJson(t.reward.mean, t.reward.var, t.reward.n)},
        {"degraded", t.degraded},
        {"adaptive_scale", t.adaptive_scale},
        {"last_density", t.last_density},
        {"force_full_sync", t.force_full_sync},
        {"last_loss_step", t.has_loss_step ? json::value(t.last_loss_step) : json::value(nullptr)},
        {"last_reward_step",
         t.has_reward_step ? json::value(t.last_reward_step) : json::value(nullptr)}};
    json::object& to = tensors[name].as_object();
    if (t.last_step) to["last_step"] = *t.last_step;
    if (t.lossless) to["lossless"] = true;
    if (t.exchange >= 0) to["exchange"] = t.exchange == 1 ? "allreduce" : "allgather";
    if (t.autos.active) {
      const auto& a = t.autos;
      to["auto"] = json::object{
          {"cur", a.cur},
          {"prev", a.prev},
          {"cur_from", a.cur_from},
          {"flush_at", a.flush_at},
          {"candidate", a.candidate},
          {"agree", a.agree},
          {"link_seen", a.link_seen},
          {"weight", a.weight},
          {"compute", a.compute},
          {"sec_per_byte", a.sec_per_byte},
          {"link_recent",
           [&] {
             json::array out;
             for (const auto& [spb, lat] : a.link_recent) out.push_back(json::array{spb, lat});
             return out;
           }()},
          {"latency", a.latency},
          {"overlap", a.overlap},
          {"weight_step", a.weight_step},
          {"weight_step_before", a.weight_step_before},
          {"link_bytes_per_s", a.link ? json::value(a.link->bytes_per_s) : json::value(nullptr)},
          {"link_latency_s", a.link ? json::value(a.link->latency_s) : json::value(nullptr)},
          {"critical_until", a.critical_until},
          {"next_eval", a.next_eval},
          {"overhead", a.overhead},
          {"score_direct", a.score_direct},
          {"score_cur", a.score_cur},
          {"direct_measured", a.direct_measured},
          {"score_best", a.score_best},
          {"direct_ignored", a.direct_ignored},
          {"best_lossless", a.best_lossless},
          {"measured", json::array(a.measured.begin(), a.measured.end())},
          {"compute_by", json::array(a.compute_by.begin(), a.compute_by.end())},
          {"evaluated", a.evaluated},
          {"why", a.why}};
    }
  }
  o["tensors"] = std::move(tensors);
  json::array log;
  for (const auto& d : log_) {
    log.push_back(json::object{{"seq", d.seq},
                               {"step", d.step},
                               {"tensor", d.tensor},
                               {"kind", d.kind},
                               {"detail", d.detail}});
  }
  o["log"] = std::move(log);
  // The ladder the auto rungs index (the state of a ladder with other rungs means nothing here).
  if (!config_.auto_codec.ladder.empty()) o["auto_ladder"] = ladderText(config_.auto_codec.ladder);
  return o;
}

namespace {

/// Strict readers for restoreState(): every field present with the right type.
struct JsonReader {
  std::string error;
  const json::value* field(const json::object& o, const char* key) {
    const auto* v = o.if_contains(key);
    if (!v && error.empty()) error = std::string("missing '") + key + "'";
    return v;
  }
  uint64_t u64(const json::object& o, const char* key) {
    const auto* v = field(o, key);
    if (!v) return 0;
    if (v->is_uint64()) return v->as_uint64();
    if (v->is_int64() && v->as_int64() >= 0) return static_cast<uint64_t>(v->as_int64());
    if (error.empty()) error = std::string("'") + key + "' must be a non-negative integer";
    return 0;
  }
  double num(const json::object& o, const char* key) {
    const auto* v = field(o, key);
    if (!v) return 0;
    if (v->is_double() && std::isfinite(v->as_double())) return v->as_double();
    if (v->is_int64()) return static_cast<double>(v->as_int64());
    if (v->is_uint64()) return static_cast<double>(v->as_uint64());
    if (error.empty()) error = std::string("'") + key + "' must be a finite number";
    return 0;
  }
  std::string str(const json::object& o, const char* key) {
    const auto* v = field(o, key);
    if (!v) return {};
    if (v->is_string()) return std::string(v->as_string());
    if (error.empty()) error = std::string("'") + key + "' must be a string";
    return {};
  }
  bool boolean(const json::object& o, const char* key) {
    const auto* v = field(o, key);
    if (!v) return false;
    if (v->is_bool()) return v->as_bool();
    if (error.empty()) error = std::string("'") + key + "' must be true or false";
    return false;
  }
  const json::object& obj(const json::object& o, const char* key) {
    static const json::object empty;
    const auto* v = field(o, key);
    if (v && v->is_object()) return v->as_object();
    if (v && error.empty()) error = std::string("'") + key + "' must be an object";
    return empty;
  }
  const json::array& arr(const json::object& o, const char* key) {
    static const json::array empty;
    const auto* v = field(o, key);
    if (v && v->is_array()) return v->as_array();
    if (v && error.empty()) error = std::string("'") + key + "' must be an array";
    return empty;
  }
};

}  // namespace

Status PolicyEngine::restoreState(const json::value& v) {
  if (!v.is_object()) return invalidArgument("policy state must be a JSON object");
  const auto& o = v.as_object();
  JsonReader r;
  if (r.u64(o, "version") != 1 && r.error.empty()) r.error = "unsupported policy state version";
  const uint64_t bypass_from = r.u64(o, "bypass_from");
  const uint64_t bypass_until = r.u64(o, "bypass_until");
  const uint64_t cooldown_until = r.u64(o, "cooldown_until");
  const uint64_t next_seq = r.u64(o, "next_seq");
  std::optional<uint64_t> resumed_from;
  if (const auto* rf = o.if_contains("resumed_from"); rf && !rf->is_null()) {
    resumed_from = r.u64(o, "resumed_from");
  }
  std::vector<Settings> settings;
  for (const auto& s : r.arr(o, "settings")) {
    if (!s.is_object()) {
      r.error = r.error.empty() ? "a settings entry is not an object" : r.error;
      break;
    }
    const auto& so = s.as_object();
    settings.push_back(
        {r.str(so, "json"), r.u64(so, "from_step"), r.boolean(so, "known_good"), r.str(so, "why")});
  }
  if (settings.empty() && r.error.empty()) r.error = "no settings versions";
  if (settings.size() > kMaxSettingsVersions && r.error.empty()) r.error = "too many settings";
  std::map<std::string, TensorState> tensors;
  auto ewma = [&](const json::object& t, const char* key) {
    const auto& e = r.obj(t, key);
    Ewma out;
    if (!r.error.empty()) return out;
    out.mean = r.num(e, "mean");
    out.var = r.num(e, "var");
    out.n = r.u64(e, "n");
    return out;
  };
  for (const auto& [name, tv] : r.obj(o, "tensors")) {
    if (!tv.is_object()) {
      r.error = r.error.empty() ? "a tensor entry is not an object" : r.error;
      break;
    }
    const auto& t = tv.as_object();
    TensorState ts;
    ts.norm = ewma(t, "norm");
    ts.cosine = ewma(t, "cosine");
    ts.loss = ewma(t, "loss");
    ts.degraded = static_cast<uint32_t>(r.u64(t, "degraded"));
    ts.adaptive_scale = r.num(t, "adaptive_scale");
    ts.last_density = r.num(t, "last_density");
    ts.force_full_sync = r.u64(t, "force_full_sync");
    if (const auto* l = t.if_contains("last_loss_step"); l && !l->is_null()) {
      ts.last_loss_step = r.u64(t, "last_loss_step");
      ts.has_loss_step = true;
    }
    // Absent from the state of an older version: no reward reported yet.
    if (t.contains("reward")) ts.reward = ewma(t, "reward");
    if (const auto* l = t.if_contains("last_reward_step"); l && !l->is_null()) {
      ts.last_reward_step = r.u64(t, "last_reward_step");
      ts.has_reward_step = true;
    }
    if (!(ts.adaptive_scale > 0) && r.error.empty()) r.error = "adaptive_scale must be > 0";
    if (t.contains("last_step")) ts.last_step = r.u64(t, "last_step");
    if (t.contains("lossless")) ts.lossless = r.boolean(t, "lossless");
    if (const auto* x = t.if_contains("exchange")) {  // absent: no choice made yet
      const auto* xs = x->if_string();
      if (xs && (*xs == "allreduce" || *xs == "allgather")) {
        ts.exchange = *xs == "allreduce" ? 1 : 0;
      } else if (r.error.empty()) {
        r.error =
            "tensor '" + std::string(name) + "': 'exchange' must be \"allgather\" or \"allreduce\"";
      }
    }
    if (const auto* av = t.if_contains("auto")) {
      const auto& ao = av->is_object() ? av->as_object() : json::object();
      if (!av->is_object() && r.error.empty()) r.error = "'auto' must be an object";
      auto& a = ts.autos;
      a.active = true;
      a.cur = r.u64(ao, "cur");
      a.prev = r.u64(ao, "prev");
      a.cur_from = r.u64(ao, "cur_from");
      a.flush_at = r.u64(ao, "flush_at");
      a.candidate = r.u64(ao, "candidate");
      a.agree = static_cast<uint32_t>(r.u64(ao, "agree"));
      // Absent from the state of an older version: no link move seen yet.
      if (ao.contains("link_seen")) a.link_seen = static_cast<uint32_t>(r.u64(ao, "link_seen"));
      if (ao.contains("weight")) {
        a.weight = r.num(ao, "weight");
        a.weight_step = r.u64(ao, "weight_step");
        a.weight_step_before = r.u64(ao, "weight_step_before");
      }
      if (ao.contains("compute")) {
        a.compute = r.num(ao, "compute");
        a.overlap = r.num(ao, "overlap");
      }
      if (ao.contains("sec_per_byte")) {
        a.sec_per_byte = r.num(ao, "sec_per_byte");
        a.latency = r.num(ao, "latency");
        if (!(a.sec_per_byte >= 0) || !(a.latency >= 0)) {
          if (r.error.empty()) r.error = "auto 'sec_per_byte' and 'latency' must be >= 0";
        }
        for (const auto& p : r.arr(ao, "link_recent")) {
          const auto* pa = p.if_array();
          if (!pa || pa->size() != 2 || !(*pa)[0].is_number() || !(*pa)[1].is_number() ||
              !((*pa)[0].to_number<double>() > 0) || !((*pa)[1].to_number<double>() >= 0) ||
              a.link_recent.size() >= 3) {
            if (r.error.empty()) r.error = "auto 'link_recent' must hold up to 3 [s/byte, latency]";
            break;
          }
          a.link_recent.emplace_back((*pa)[0].to_number<double>(), (*pa)[1].to_number<double>());
        }
      }
      if (const auto* l = ao.if_contains("link_bytes_per_s"); l && !l->is_null()) {
        a.link = Link{r.num(ao, "link_bytes_per_s"), r.num(ao, "link_latency_s")};
        if (!(a.link->bytes_per_s > 0) && r.error.empty()) r.error = "auto link must be > 0";
      }
      a.critical_until = r.u64(ao, "critical_until");
      a.next_eval = r.u64(ao, "next_eval");
      a.overhead = r.num(ao, "overhead");
      a.score_direct = r.num(ao, "score_direct");
      a.score_cur = r.num(ao, "score_cur");
      a.direct_measured = r.boolean(ao, "direct_measured");
      a.score_best = r.num(ao, "score_best");
      a.direct_ignored = r.num(ao, "direct_ignored");
      a.best_lossless = r.boolean(ao, "best_lossless");
      for (const auto& m : r.arr(ao, "measured")) {
        if (!m.is_number() && r.error.empty()) r.error = "auto 'measured' must hold numbers";
        a.measured.push_back(m.is_number() ? m.to_number<double>() : -1.0);
      }
      // Absent from the state of an older version: no rung's compute of its own yet.
      if (ao.contains("compute_by")) {
        for (const auto& c : r.arr(ao, "compute_by")) {
          if ((!c.is_number() || !std::isfinite(c.to_number<double>())) && r.error.empty()) {
            r.error = "auto 'compute_by' must hold a finite number per rung";
          }
          if (!r.error.empty()) break;
          a.compute_by.push_back(c.to_number<double>());
        }
      }
      a.why = r.str(ao, "why");
      // Absent from the state of an older version: evaluated (hysteresis as before).
      if (const auto* e = ao.if_contains("evaluated")) {
        if (!e->is_bool() && r.error.empty()) r.error = "auto 'evaluated' must be a boolean";
        a.evaluated = !e->is_bool() || e->as_bool();
      } else {
        a.evaluated = true;
      }
      const size_t rungs = config_.auto_codec.ladder.size();
      if ((a.cur >= rungs || a.prev >= rungs || a.candidate >= std::max<size_t>(rungs, 1)) &&
          r.error.empty()) {
        r.error = "tensor '" + std::string(name) + "': auto rung out of this sidecar's ladder (" +
                  std::to_string(rungs) + " rungs): compression.auto.ladder differs";
      }
      // Per-rung figures: one per rung at most (an older version's state may hold fewer: the
      // rungs it did not know stay unmeasured).
      if ((a.measured.size() > rungs || a.compute_by.size() > rungs) && r.error.empty()) {
        r.error = "tensor '" + std::string(name) + "': auto 'measured' and 'compute_by' hold " +
                  std::to_string(a.measured.size()) + " and " +
                  std::to_string(a.compute_by.size()) + " entries, more than this sidecar's " +
                  std::to_string(rungs) + " rungs: compression.auto.ladder differs";
      }
    }
    tensors[std::string(name)] = ts;
  }
  std::deque<Decision> log;
  for (const auto& e : r.arr(o, "log")) {
    if (!e.is_object()) {
      r.error = r.error.empty() ? "a log entry is not an object" : r.error;
      break;
    }
    const auto& eo = e.as_object();
    log.push_back({r.u64(eo, "seq"), r.u64(eo, "step"), r.str(eo, "tensor"), r.str(eo, "kind"),
                   r.str(eo, "detail")});
  }
  // Absent from the state of an older version: only the rung count is checked (above).
  if (const auto* lv = o.if_contains("auto_ladder"); lv && r.error.empty()) {
    const std::string here = ladderText(config_.auto_codec.ladder);
    if (!lv->is_string()) {
      r.error = "'auto_ladder' must be a string";
    } else if (lv->as_string() != here) {
      r.error = "compression.auto.ladder differs: the state was saved with '" +
                std::string(lv->as_string()) + "', this sidecar has '" + here + "'";
    }
  }
  DirectWindow direct;
  if (const auto* dv = o.if_contains("direct")) {
    if (!dv->is_object()) {
      r.error = r.error.empty() ? "'direct' must be an object" : r.error;
    } else {
      direct = {r.u64(dv->as_object(), "from"), r.u64(dv->as_object(), "until")};
      // Absent from the state of an older version: the window is a chain's first.
      if (dv->as_object().contains("chain")) {
        const uint64_t chain = r.u64(dv->as_object(), "chain");
        if (chain > kDirectChain && r.error.empty()) {
          r.error = "'direct' 'chain' must be at most " + std::to_string(kDirectChain);
        }
        direct.chain = static_cast<uint32_t>(std::min<uint64_t>(chain, kDirectChain));
      }
    }
  }
  std::optional<uint64_t> job_step;
  if (const auto* jv = o.if_contains("job_step"); jv && !jv->is_null()) {
    job_step = r.u64(o, "job_step");
  }
  // Absent from the state of an older version: no weights (the next step's tails are not
  // measured).
  TailWeights weights, weights_prev;
  if (const auto* wv = o.if_contains("tail_weights"); wv && r.error.empty()) {
    const auto* wa = wv->if_array();
    bool ok = wa && wa->size() == 4;
    for (size_t i = 0; ok && i < 4; ++i) {
      ok = (*wa)[i].is_number() && std::isfinite((*wa)[i].to_number<double>()) &&
           (*wa)[i].to_number<double>() >= 0;
    }
    if (!ok) {
      r.error = "'tail_weights' must be 4 finite numbers >= 0";
    } else {
      weights = {(*wa)[0].to_number<double>(), (*wa)[1].to_number<double>()};
      weights_prev = {(*wa)[2].to_number<double>(), (*wa)[3].to_number<double>()};
    }
  }
  if (!r.error.empty()) return invalidArgument("policy state: " + r.error);
  std::lock_guard lock(mu_);
  direct_ = direct;
  job_step_ = job_step;
  tail_weights_ = weights;
  tail_weights_prev_ = weights_prev;
  bypass_from_ = bypass_from;
  bypass_until_ = bypass_until;
  cooldown_until_ = cooldown_until;
  next_seq_ = next_seq;
  resumed_from_ = resumed_from;
  settings_ = std::move(settings);
  tensors_ = std::move(tensors);
  log_ = std::move(log);
  while (log_.size() > std::max<size_t>(1, config_.decision_log)) log_.pop_front();
  return Status::ok();
}

json::object PolicyEngine::statusJson() const {
  json::object o = stateJson();
  std::lock_guard lock(mu_);
  // Settings bodies can be long: status shows versions without them.
  for (auto& s : o["settings"].as_array()) s.as_object().erase("json");
  o["pending_requests"] = outgoing_.size();
  o["config"] = json::object{
      {"anomaly", config_.anomaly},
      {"bypass_steps", config_.bypass_steps},
      {"full_sync_every", config_.full_sync_every},
      {"rollback", config_.rollback},
      {"reward_drop",
       config_.reward_drop ? json::value(*config_.reward_drop) : json::value(nullptr)},
      {"reward_drop_sigma",
       rewardDropSigma(config_) ? json::value(*rewardDropSigma(config_)) : json::value(nullptr)},
      {"warmup_steps", config_.warmup_steps},
      {"powersgd_start_step", config_.powersgd_start_step},
      {"total_steps", config_.total_steps},
      {"adaptive", config_.adaptive},
      {"min_magnitude", config_.min_magnitude}};
  // codec: auto, for people: each auto layer's rung and why.
  const AutoConfig& ac = config_.auto_codec;
  json::object layers;
  for (const auto& [name, t] : tensors_) {
    if (!t.autos.active || ac.ladder.empty()) continue;
    const auto& a = t.autos;
    const Rung& r = ac.ladder[a.cur];
    layers[name] = json::object{
        {"rung", r.text},
        {"from_step", a.cur_from},
        {"text", name + ": " + r.label + (a.why.empty() ? std::string() : " (" + a.why + ")")}};
  }
  json::array ladder;
  for (const auto& r : ac.ladder) ladder.push_back(json::value(r.text));
  o["auto"] = json::object{
      {"ladder", std::move(ladder)},
      {"direct",
       json::object{{"from", direct_.from}, {"until", direct_.until}, {"chain", direct_.chain}}},
      {"period", ac.period},
      {"hysteresis", ac.hysteresis},
      {"tolerance", ac.tolerance},
      {"link_change", ac.link_change},
      {"momentum_margin", ac.momentum_margin},
      {"probe_every", ac.probe_every},
      {"layers", std::move(layers)}};
  return o;
}

}  // namespace lightwire::policies
