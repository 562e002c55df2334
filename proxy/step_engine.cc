#include "proxy/step_engine.h"

#include <spdlog/spdlog.h>

#include <boost/json/object.hpp>
#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <sstream>

#include "kernels/philox.h"
#include "kernels/reduce.h"
#include "kernels/registry.h"
#include "kernels/simd/kernels.h"
#include "policies/checkpoint.h"
#include "proxy/step_engine_gpu.h"

#include <xxh_x86dispatch.h>
#include <xxhash.h>

namespace lightwire::proxy {
namespace {

using Clock = std::chrono::steady_clock;
using kernels::DType;

constexpr size_t kGrain = size_t{1} << 16;

// Steps of at most this many elements run on the thread that completes them (see submit()).
constexpr uint64_t kInlineMaxElements = uint64_t{1} << 16;

double microsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

/// out[i] (+)= value i of the trainer's tensor, for i in [lo, hi).
void widenRange(DType dtype, const std::byte* data, size_t lo, size_t hi, float* out, bool add) {
  const kernels::ConstTensor t{data, hi, dtype};
  if (!add) {
    kernels::widenToFloat(t.slice(lo, hi - lo), out + lo);
    return;
  }
  float scratch[4096];
  for (size_t b = lo; b < hi; b += 4096) {
    const size_t len = std::min<size_t>(4096, hi - b);
    kernels::widenToFloat(t.slice(b, len), scratch);
    for (size_t i = 0; i < len; ++i) out[b + i] = out[b + i] + scratch[i];
  }
}

/// The trainer's tensor bytes [lo, hi) = result values, in its dtype.
void narrowRange(DType dtype, const float* result, size_t lo, size_t hi, std::byte* data) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(data + 4 * lo, result + lo, 4 * (hi - lo));
      return;
    case DType::kF16:
      kernels::simd::floatsToHalves(result + lo, hi - lo,
                                    reinterpret_cast<uint8_t*>(data) + 2 * lo);
      return;
    case DType::kBF16:
      kernels::simd::floatsToBf16s(result + lo, hi - lo, reinterpret_cast<uint8_t*>(data) + 2 * lo);
      return;
  }
}

/// The statistics record of one input (policies): norm² with the SIMD canonical reduction (in
/// parallel, block order fixed), then — only when they matter — the non-finite count (the norm is
/// not finite) and the count of values below min_magnitude (the adaptive schedule reads it).
policies::StepStats localStats(kernels::CpuStream* stream, const float* input, size_t n,
                               double min_magnitude, bool count_small,
                               std::vector<double>& block_sums) {
  policies::StepStats st;
  st.elements = n;
  // A statistic, not a payload: float lanes per 4096-value block (vectorised; NaN and Inf
  // propagate), blocks added in order in fp64. Half the cost of the canonical fp64 reduction.
  constexpr size_t kBlock = kernels::kStatsBlock;
  block_sums.assign((n + kBlock - 1) / kBlock, 0.0);
  kernels::parallelFor(stream, block_sums.size(), 16, [&](size_t lo, size_t hi) {
    for (size_t k = lo; k < hi; ++k) {
      block_sums[k] =
          kernels::statsSquareBlockSum(input + k * kBlock, std::min(kBlock, n - k * kBlock));
    }
  });
  for (const double b : block_sums) st.grad_norm2 += b;
  if (!std::isfinite(st.grad_norm2) || count_small) {
    std::mutex mu;
    const float tiny = static_cast<float>(min_magnitude);
    kernels::parallelFor(stream, n, size_t{1} << 16, [&](size_t lo, size_t hi) {
      uint64_t bad = 0, small = 0;
      for (size_t i = lo; i < hi; ++i) {
        const float v = input[i];
        bad += std::isfinite(v) ? 0 : 1;
        small += std::fabs(v) < tiny ? 1 : 0;
      }
      std::lock_guard lock(mu);
      st.nonfinite += bad;
      st.small += small;
    });
    if (!count_small) st.small = 0;
    if (st.nonfinite > 0) {
      st.grad_norm2 = 0;  // the count says it; the norm is meaningless
    } else if (!std::isfinite(st.grad_norm2)) {
      // Finite values whose float squares overflowed: the exact fp64 sum.
      st.grad_norm2 = kernels::canonicalSum(input, n, kernels::ReduceTerm::kSquare);
    }
  }
  return st;
}

}  // namespace

/// Cosine terms of a codec's payload against what it encoded (one chunk).
std::optional<CosineTerms> cosineTerms(const kernels::Codec& codec,
                                       std::span<const uint8_t> payload, const float* original,
                                       size_t len, std::vector<float>& scratch) {
  scratch.assign(len, 0.0f);
  if (!codec.decodeChunk(payload, 1.0f, scratch.data(), len).isOk()) return std::nullopt;
  CosineTerms c;
  for (size_t i = 0; i < len; ++i) {
    const double a = scratch[i], g = original[i];
    if (!std::isfinite(a) || !std::isfinite(g)) return std::nullopt;
    c.dot += a * g;
    c.c2 += a * a;
    c.g2 += g * g;
  }
  return c;
}

const char* apiDTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
  }
  return "?";
}

Result<std::vector<std::vector<std::span<const uint8_t>>>> LocalExchange::run(
    ExchangeRound& round) {
  std::vector<std::vector<std::span<const uint8_t>>> out(round.payloads.size());
  for (size_t c = 0; c < round.payloads.size(); ++c) out[c].push_back(round.payloads[c]);
  round.stats_in.clear();
  if (!round.stats_out.empty())
    round.stats_in.emplace_back(round.stats_out.begin(), round.stats_out.end());
  return out;
}

struct StepEngine::Pending {
  std::vector<std::optional<Contribution>> parts;
  std::vector<StepDone> dones;
  unsigned arrived = 0;
  uint64_t elements = 0;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  Clock::time_point deadline;
  bool queued = false;
};

struct StepEngine::Tensor {
  std::string name;
  // Engine thread only (no lock): the codec and its state.
  std::unique_ptr<kernels::Codec> codec;
  std::string config_key;
  kernels::CodecState state;
  uint64_t state_elements = 0;
  DType state_dtype = DType::kF32;
  bool has_state = false;
  std::vector<std::byte> workspace;
  std::vector<float> sum, result;
  std::vector<std::vector<std::vector<uint8_t>>> payloads;  // [round][chunk], reused
  std::vector<float> accum;              // delayed sync: accumulated since the last exchange step
  std::vector<float> flushed;            // full-sync: input plus what the codec state held back
  std::vector<float> scratch;            // cosine sampling
  std::vector<float> original;           // cosine sampling on the GPU path: the chunk's input
  std::optional<CosineTerms> cos;        // of the last committed compressed step
  std::optional<double> residual_norm2;  // of the state, last measured
  std::vector<double> blocks;            // block sums of the statistics' norm
  // The GPU path (step_engine_gpu.h): the tensor's device resources, and whether its committed
  // codec state is there (then `state` is empty) rather than in `state`.
  std::shared_ptr<gpu::TensorGpu> gpu;
  bool state_on_gpu = false;
  struct {
    std::string group;
    prometheus::Gauge *ratio = nullptr, *cosine = nullptr, *residual = nullptr;
  } gauges;  // lightwire_*{group} of the tensor's group
  // Under mu_.
  std::optional<uint64_t> last_committed;
  std::optional<uint64_t> running;
  std::map<uint64_t, Pending> pending;
  std::string codec_name = "-";
  uint64_t elements = 0;
  DType dtype = DType::kF32;
  std::optional<uint64_t> last_step;
  uint64_t state_bytes = 0;
};

StepEngine::StepEngine(EngineOptions options, CodecChooser chooser, metrics::Metrics& metrics,
                       Exchange& exchange)
    : options_(options),
      metrics_(metrics),
      exchange_(exchange),
      stream_(std::max(1u, options.threads)),
      chooser_(std::move(chooser)) {
  thread_ = std::thread([this] { loop(); });
}

StepEngine::~StepEngine() { shutdown(); }

void StepEngine::setChooser(CodecChooser chooser) {
  std::lock_guard lock(mu_);
  chooser_ = std::move(chooser);
}

void StepEngine::submit(Contribution c, StepDone done) {
  auto refuse = [&](unsigned status, const char* error, std::string message) {
    done(StepOutcome{status, error, std::move(message), {}});
  };
  const TensorSpec& s = c.spec;
  if (s.trainer >= options_.local_trainers) {
    return refuse(400, "invalid_argument",
                  "trainer " + std::to_string(s.trainer) +
                      " is out of range: this sidecar serves " +
                      std::to_string(options_.local_trainers) + " local trainer(s), 0.." +
                      std::to_string(options_.local_trainers - 1));
  }
  std::unique_lock lock(mu_);
  if (stopping_) return refuse(503, "shutting_down", "the sidecar is shutting down");
  auto& slot = tensors_[s.name];
  if (!slot) {
    slot = std::make_unique<Tensor>();
    slot->name = s.name;
  }
  Tensor& t = *slot;
  const std::string where = "tensor '" + s.name + "' step " + std::to_string(s.step);
  if (t.last_committed && s.step <= *t.last_committed) {
    lock.unlock();
    return refuse(409, "conflict",
                  where + " goes backwards: step " + std::to_string(*t.last_committed) +
                      " already completed");
  }
  if (t.running && *t.running == s.step) {
    lock.unlock();
    return refuse(409, "conflict", where + " is being exchanged already");
  }
  auto it = t.pending.find(s.step);
  if (it == t.pending.end()) {
    if (pending_count_ >= options_.max_pending_steps) {
      lock.unlock();
      metrics_.limitHits("pending_steps").Increment();
      return refuse(429, "limit_reached",
                    "too many steps in flight (limits.max_pending_steps = " +
                        std::to_string(options_.max_pending_steps) + ")");
    }
    Pending p;
    p.parts.resize(options_.local_trainers);
    p.dones.resize(options_.local_trainers);
    p.elements = s.elements;
    p.dtype = s.dtype;
    p.shape = s.shape;
    p.deadline = Clock::now() + options_.step_timeout;
    it = t.pending.emplace(s.step, std::move(p)).first;
    ++pending_count_;
  }
  Pending& p = it->second;
  std::pair<std::string, uint64_t> ready_key;
  if (p.parts[s.trainer]) {
    lock.unlock();
    return refuse(409, "conflict",
                  where + ": trainer " + std::to_string(s.trainer) + " already sent its part");
  }
  if (p.elements != s.elements || p.dtype != s.dtype) {
    lock.unlock();
    return refuse(409, "conflict",
                  where + ": trainer " + std::to_string(s.trainer) + " sent " +
                      std::to_string(s.elements) + " " + apiDTypeName(s.dtype) +
                      " elements, another trainer " + std::to_string(p.elements) + " " +
                      apiDTypeName(p.dtype));
  }
  const unsigned trainer = s.trainer;
  ready_key = {s.name, s.step};  // `s` refers into `c`, moved below
  p.parts[trainer] = std::move(c);
  p.dones[trainer] = std::move(done);
  if (++p.arrived == options_.local_trainers) {
    p.queued = true;
    ready_.push_back(std::move(ready_key));
    // A small step with nothing ahead of it runs right here: no hand-off to the engine thread and
    // back (two thread wake-ups, most of a 4 KiB round trip).
    // Only without peers: waiting for them must not hold up the caller's (I/O) thread.
    if (!executing_ && tasks_.empty() && ready_.size() == 1 && p.elements <= kInlineMaxElements &&
        exchange_.worldSize() == 1) {
      runNextReady(lock);
      return;
    }
  }
  cv_.notify_all();
}

void StepEngine::failPending(Pending& p, unsigned status, const std::string& error,
                             const std::string& message) {
  for (auto& d : p.dones) {
    if (d) d(StepOutcome{status, error, message, {}});
  }
}

void StepEngine::loop() {
  std::unique_lock lock(mu_);
  while (true) {
    // Earliest deadline among steps still waiting for trainers.
    std::optional<Clock::time_point> next;
    for (auto& [name, t] : tensors_) {
      for (auto& [step, p] : t->pending) {
        if (!p.queued && (!next || p.deadline < *next)) next = p.deadline;
      }
    }
    if (!tasks_.empty() && !executing_) {
      runTasks(lock);
      continue;
    }
    if (ready_.empty() && !stopping_) {
      if (next) {
        cv_.wait_until(lock, *next);
      } else {
        cv_.wait(lock);
      }
    }
    // Steps whose trainers did not all arrive in time fail for those that did.
    const auto now = Clock::now();
    std::vector<std::pair<std::string, Pending>> expired;
    for (auto& [name, t] : tensors_) {
      for (auto it = t->pending.begin(); it != t->pending.end();) {
        if (!it->second.queued && (stopping_ || it->second.deadline <= now)) {
          expired.emplace_back(name + "' step " + std::to_string(it->first), std::move(it->second));
          it = t->pending.erase(it);
          --pending_count_;
        } else {
          ++it;
        }
      }
    }
    if (!expired.empty()) {
      const bool stopping = stopping_;
      steps_failed_ += stopping ? 0 : expired.size();
      lock.unlock();
      for (auto& [what, p] : expired) {
        std::string missing;
        for (size_t i = 0; i < p.parts.size(); ++i) {
          if (!p.parts[i]) missing += (missing.empty() ? "" : ", ") + std::to_string(i);
        }
        if (stopping) {
          failPending(p, 503, "shutting_down", "the sidecar is shutting down");
        } else {
          spdlog::warn("tensor '{}: local trainer(s) {} did not send their part within {} s", what,
                       missing, options_.step_timeout.count() / 1000.0);
          metrics_.steps_failed.Increment();
          failPending(p, 504, "deadline_exceeded",
                      "tensor '" + what + ": local trainer(s) " + missing +
                          " did not send their part within limits.step_timeout_s");
        }
      }
      lock.lock();
      continue;
    }
    if (ready_.empty()) {
      if (stopping_) break;
      continue;
    }
    if (executing_) {  // a submitting thread runs a small step inline: wait for it
      cv_.wait(lock);
      continue;
    }
    runNextReady(lock);
  }
}

void StepEngine::runTasks(std::unique_lock<std::mutex>& lock) {
  while (!tasks_.empty()) {
    auto task = tasks_.front();
    tasks_.pop_front();
    executing_ = true;
    lock.unlock();
    Status st = task->fn();
    task->done.set_value(std::move(st));
    lock.lock();
    executing_ = false;
  }
}

void StepEngine::postBetweenSteps(std::function<Status()> fn) {
  auto task = std::make_shared<Task>();
  task->fn = [fn = std::move(fn)] {
    if (Status st = fn(); !st.isOk()) spdlog::error("{}", st.message());
    return Status::ok();
  };
  {
    std::lock_guard lock(mu_);
    if (!thread_.joinable() || stopping_) return;
    tasks_.push_back(std::move(task));
  }
  cv_.notify_all();
}

Status StepEngine::runBetweenSteps(const std::function<Status()>& fn) {
  auto task = std::make_shared<Task>();
  task->fn = fn;
  auto result = task->done.get_future();
  {
    std::lock_guard lock(mu_);
    if (!thread_.joinable() || stopping_) {
      return failedPrecondition("the sidecar is shutting down");
    }
    tasks_.push_back(task);
  }
  cv_.notify_all();
  return result.get();
}

void StepEngine::runNextReady(std::unique_lock<std::mutex>& lock) {
  auto [name, step] = ready_.front();
  ready_.pop_front();
  auto tit = tensors_.find(name);
  if (tit == tensors_.end()) return;
  Tensor& t = *tit->second;
  auto pit = t.pending.find(step);
  if (pit == t.pending.end()) return;
  Pending p = std::move(pit->second);
  t.pending.erase(pit);
  --pending_count_;
  if (stopping_) {
    lock.unlock();
    failPending(p, 503, "shutting_down", "the sidecar is shutting down");
    lock.lock();
    return;
  }
  t.running = step;
  executing_ = true;
  lock.unlock();
  runStep(t, step, p);
  lock.lock();
  t.running.reset();
  executing_ = false;
  // Wake the engine thread only when it has something to do: waking it after every inline step
  // would cost a context switch per small round trip.
  if (!ready_.empty() || stopping_) cv_.notify_all();
}

void StepEngine::runStep(Tensor& t, uint64_t step, Pending& p) {
  StepOutcome outcome;
  {
    std::lock_guard lock(mu_);
    if (t.last_committed && step <= *t.last_committed) {
      outcome = {409, "conflict",
                 "tensor '" + t.name + "' step " + std::to_string(step) + " goes backwards: step " +
                     std::to_string(*t.last_committed) + " already completed"};
    }
  }
  // Periodic checkpoint: the first step numbered a multiple of checkpoint_every saves the state
  // after the step before it (every tensor's last committed step).
  // Not before this sidecar has completed a step: a restarted sidecar has nothing of its own yet,
  // and an empty file would shadow its real one.
  if (outcome.http_status == 200 && options_.checkpoint_every > 0 && !options_.state_dir.empty() &&
      step > 0 && step % options_.checkpoint_every == 0 && step - 1 > last_periodic_ &&
      stepsOk() > 0) {
    last_periodic_ = step - 1;
    if (auto saved = saveCheckpoint(step - 1, "periodic"); !saved) {
      spdlog::error("periodic checkpoint of step {}: {}", step - 1, saved.status().message());
    }
  }
  if (outcome.http_status == 200) outcome = execute(t, step, p);
  if (outcome.http_status != 200) exchange_.abort(t.name, step, outcome.message);
  exchange_.stepDone(t.name, step);
  std::vector<std::pair<uint64_t, Pending>> overtaken;  // waiting steps this commit dooms
  {
    std::lock_guard lock(mu_);
    t.last_step = step;
    if (outcome.http_status == 200) {
      if (!outcome.figures.nonfinite) {
        t.last_committed = step;
        // Earlier steps still waiting for trainers can never complete: fail them now (409)
        // rather than at limits.step_timeout_s. Queued ones are refused when they run.
        for (auto it = t.pending.begin(); it != t.pending.end() && it->first <= step;) {
          if (it->second.queued) {
            ++it;
            continue;
          }
          overtaken.emplace_back(it->first, std::move(it->second));
          it = t.pending.erase(it);
          --pending_count_;
          ++steps_failed_;
        }
      }
      ++steps_ok_;
    } else {
      ++steps_failed_;
    }
    t.codec_name = outcome.figures.codec.empty() ? t.codec_name : outcome.figures.codec;
    t.elements = p.elements;
    t.dtype = p.dtype;
    t.state_bytes = t.state_on_gpu ? gpu::stateBytes(t.gpu.get()) : t.state.bytes();
    uint64_t total = 0;
    for (const auto& [name, other] : tensors_) total += other->state_bytes;
    metrics_.state_bytes.Set(static_cast<double>(total));
  }
  if (outcome.http_status == 200) {
    (outcome.figures.nonfinite ? metrics_.steps_nonfinite : metrics_.steps_ok).Increment();
  } else {
    metrics_.steps_failed.Increment();
    spdlog::warn("tensor '{}' step {} failed: {}", t.name, step, outcome.message);
  }
  for (size_t k = 0; k < p.dones.size(); ++k) {
    // Device buffers get their result copied back before the reply says it is there.
    std::string why;
    // (The GPU path wrote them in place already.)
    if (outcome.http_status == 200 && outcome.figures.device == "cpu" && p.parts[k] &&
        p.parts[k]->store && !p.parts[k]->store(&why)) {
      spdlog::error(
          "tensor '{}' step {}: trainer {}'s result could not be written to its GPU "
          "buffer: {}",
          t.name, step, k, why);
      StepOutcome failed{500, "device_error",
                         "the result could not be written to the GPU buffer: " + why};
      p.dones[k](failed);
      continue;
    }
    p.dones[k](outcome);
  }
  if (pending_resume_) {
    const uint64_t at = *pending_resume_;
    pending_resume_.reset();
    if (auto st = resumeHere(at); !st.isOk()) {
      spdlog::error("could not resume from step {} as the other sidecars did: {}", at,
                    st.message());
    }
  }
  for (auto& [old_step, old] : overtaken) {
    metrics_.steps_failed.Increment();
    failPending(old, 409, "conflict",
                "tensor '" + t.name + "' step " + std::to_string(old_step) +
                    " goes backwards: step " + std::to_string(step) + " already completed");
  }
}

StepOutcome StepEngine::execute(Tensor& t, uint64_t step, Pending& p) {
  const auto t0 = Clock::now();
  StepOutcome out;
  StepFigures& fig = out.figures;
  auto fail = [&](unsigned status, const char* error, std::string message) {
    out.http_status = status;
    out.error = error;
    out.message = std::move(message);
    return out;
  };
  const size_t n = p.elements;
  const unsigned trainers = options_.local_trainers;
  for (auto& part : p.parts) {
    if (part->still_valid && !part->still_valid()) {
      return fail(409, "conflict",
                  "trainer " + std::to_string(part->spec.trainer) +
                      "'s buffer no longer holds its registered size (was it truncated?)");
    }
  }

  // The settings of this tensor (the agreed settings version) and what the policies make of
  // this step; then its codec, with fresh state when the codec or the tensor's size or dtype
  // changed.
  TensorSettings settings;
  {
    std::lock_guard lock(mu_);
    settings = chooser_(t.name, n);
  }
  policies::StepPlan plan;
  policies::PolicyEngine* const policy = options_.policy;
  if (policy) {
    auto [version, json] = policy->settingsAt(step);
    if (version > 0 && options_.settings) {
      if (!settings_chooser_ || settings_version_ != version) {
        settings_chooser_ = options_.settings(version, json);
        settings_version_ = version;
      }
      if (settings_chooser_) settings = settings_chooser_(t.name, n);
    }
    plan = policy->plan(t.name, step, settings.codec, settings.sync_every);
    plan.settings = version;
    const auto& name = settings.codec.name;
    if (name == "topk" || name == "dgc" || name == "threshold") {
      settings.codec.min_magnitude = plan.min_magnitude;
    }
  }
  fig.mode = policies::stepModeName(plan.mode);
  fig.settings = plan.settings;
  const kernels::CodecConfig& config = settings.codec;
  // The tensor's per-group gauges, looked up once per group change, not every step.
  const std::string& group = settings.group.empty() ? config.name : settings.group;
  if (t.gauges.group != group || !t.gauges.ratio) {
    t.gauges = {group, &metrics_.compressionRatio(group), &metrics_.cosineSimilarity(group),
                &metrics_.residualNorm(group)};
  }
  const std::string key = kernels::configKey(config);
  if (!t.codec || key != t.config_key) {
    auto codec = kernels::createCodec(config);
    if (!codec) return fail(500, "internal", "codec settings: " + codec.status().message());
    // Codec state restored from a checkpoint is kept when it is of these very settings.
    const bool restored = !t.codec && t.has_state && key == t.config_key;
    if (t.codec) {
      spdlog::info("tensor '{}': codec changed to {}, its codec state starts fresh", t.name,
                   config.name);
      fig.state_reset = true;
    } else if (t.has_state && !restored) {
      spdlog::warn(
          "tensor '{}': the restored codec state is of other settings ({}), not {}: it "
          "starts fresh",
          t.name, t.config_key, key);
      fig.state_reset = true;
    }
    t.codec = std::move(*codec);
    t.config_key = key;
    if (!restored) t.has_state = false;
  }
  const kernels::Codec& codec = *t.codec;
  if (t.has_state && (t.state_elements != n || t.state_dtype != p.dtype)) {
    spdlog::info("tensor '{}' changed from {} to {} elements ({}): its codec state starts fresh",
                 t.name, t.state_elements, n, apiDTypeName(p.dtype));
    fig.state_reset = true;
    t.has_state = false;
  }
  // The GPU path (docs/cuda.md "Steps on the GPU") when every trainer hands device memory and the
  // codec runs there; else the host, device memory staged through `data`.
  // (Delayed-sync tensors stay on the host: their accumulation lives there, with checkpoints.)
  std::optional<int> gpu_ordinal;
  if (options_.gpu && settings.sync_every <= 1 && plan.mode != policies::StepMode::kSkip &&
      !plan.delayed_sync_step) {
    std::vector<const Contribution*> parts;
    for (const auto& part : p.parts) parts.push_back(&*part);
    gpu_ordinal = gpu::eligibleDevice(parts, config.name);
  }
  if (!t.has_state) {
    const uint64_t need = 2 * uint64_t{codec.stateFloats(n)} * sizeof(float);  // double-buffered
    if (options_.max_state_bytes > 0 && need > 0) {
      uint64_t held = 0;
      {
        std::lock_guard lock(mu_);
        for (const auto& [name, other] : tensors_) {
          if (other.get() != &t) held += other->state_bytes;
        }
      }
      if (held + need > options_.max_state_bytes) {
        t.state = kernels::CodecState();  // nothing held for it
        metrics_.limitHits("state_bytes").Increment();
        return fail(507, "state_limit",
                    "tensor '" + t.name + "' needs " + std::to_string(need) +
                        " bytes of codec state, other tensors hold " + std::to_string(held) +
                        ": more than limits.max_state_bytes (" +
                        std::to_string(options_.max_state_bytes) + ")");
      }
    }
    // On the GPU path the fresh state is created on the device (zeros), not here.
    t.state = gpu_ordinal ? kernels::CodecState() : kernels::CodecState(codec.stateFloats(n));
    t.state_on_gpu = false;
    t.state_elements = n;
    t.state_dtype = p.dtype;
    t.has_state = true;
    if (fig.state_reset) metrics_.state_resets.Increment();
  }
  fig.codec = codec.traits().name;
  fig.elements = n;
  fig.raw_bytes = n * kernels::dtypeSize(p.dtype);

  std::unique_ptr<gpu::GpuStep> g;  // the GPU path's step (null: the host path)
  auto device_fail = [&](const Status& st) { return fail(500, "device_error", st.message()); };
  if (gpu_ordinal) {
    std::vector<Contribution*> parts;
    for (auto& part : p.parts) parts.push_back(&*part);
    // The committed state moves to the device when it is on the host (once).
    auto begun = gpu::GpuStep::begin(t.gpu, *gpu_ordinal, config, parts, n, p.dtype,
                                     t.state_on_gpu ? nullptr : &t.state);
    if (!begun) {
      // A fresh state was never made on the host: make it afresh on the next step.
      if (!t.state_on_gpu && t.state.floats() != codec.stateFloats(n)) t.has_state = false;
      return device_fail(begun.status());
    }
    g = std::move(*begun);
    if (!t.state_on_gpu) {
      t.state = kernels::CodecState();
      t.state_on_gpu = true;
    }
    fig.device = g->deviceName();
  } else {
    if (t.state_on_gpu) {
      // The tensor's state moves to the host (its trainers no longer all hand device memory).
      auto host = gpu::downloadState(*t.gpu);
      if (!host) return device_fail(host.status());
      t.state = std::move(*host);
      t.state_on_gpu = false;
    }
    for (auto& part : p.parts) {
      if (std::string why; part->fetch && !part->fetch(&why)) {
        return fail(500, "device_error",
                    "trainer " + std::to_string(part->spec.trainer) +
                        "'s GPU buffer could not be read: " + why);
      }
    }
  }

  // Ingest: the sum of the local trainers' tensors, in trainer order (deterministic).
  const float* input = nullptr;  // the host path's (the GPU path keeps its own on the device)
  if (g) {
    if (auto st = g->ingest(); !st.isOk()) return device_fail(st);
  } else if (trainers == 1 && p.dtype == DType::kF32) {
    input = reinterpret_cast<const float*>(p.parts[0]->data);
  } else {
    t.sum.resize(n);
    kernels::parallelFor(&stream_, n, kGrain, [&](size_t lo, size_t hi) {
      for (unsigned k = 0; k < trainers; ++k) {
        widenRange(p.dtype, p.parts[k]->data, lo, hi, t.sum.data(), k > 0);
      }
    });
    input = t.sum.data();
  }
  // Delayed sync (a rule's sync_every): between its exchange steps a tensor is accumulated
  // locally and the trainers get zeros; the exchange step sends the accumulation too.
  if (!g && t.accum.size() != n) t.accum.assign(n, 0.0f);
  if (plan.mode == policies::StepMode::kSkip) {
    float* acc = t.accum.data();
    kernels::parallelFor(&stream_, n, kGrain, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) acc[i] = acc[i] + input[i];
    });
    for (auto& part : p.parts) std::memset(part->data, 0, n * kernels::dtypeSize(p.dtype));
    metrics_.skipped_steps.Increment();
    fig.durations_us[static_cast<size_t>(metrics::Stage::kTotal)] = microsSince(t0);
    return out;
  }
  if (plan.delayed_sync_step) {
    t.sum.resize(n);
    const float* acc = t.accum.data();
    float* sum = t.sum.data();
    kernels::parallelFor(&stream_, n, kGrain, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) sum[i] = input[i] + acc[i];
    });
    input = sum;
  }
  fig.durations_us[static_cast<size_t>(metrics::Stage::kIngest)] = microsSince(t0);

  // Compress (and, for multi-round codecs, exchange round by round).
  kernels::StepContext ctx;
  ctx.seed = options_.seed;
  ctx.name_key = kernels::tensorNameKey(t.name);
  ctx.step = step;
  ctx.rank = options_.rank;
  ctx.stream = &stream_;
  ctx.shape = p.shape;
  // Schedules: the policies' density, or (without policies) the warm-up density where it asks
  // for more than the codec's own.
  if (policy) {
    ctx.density = plan.density;
  } else if (const auto id = codec.traits().id; id == kernels::CodecId::kTopk ||
                                                id == kernels::CodecId::kDgc ||
                                                id == kernels::CodecId::kRandomk) {
    const auto& cc = codec.config();
    const double target = cc.density ? *cc.density : (cc.ratio ? 1.0 / *cc.ratio : 1.0);
    if (const auto d = warmupDensity(step, options_.warmup_steps); d && *d > target) {
      ctx.density = *d;
    }
  }
  // Bypass and full-sync steps exchange dense fp32 (codec `none`); a full-sync first flushes what
  // the codec state holds back into what it sends, and prepares the flushed state.
  const bool dense_step =
      plan.mode == policies::StepMode::kBypass || plan.mode == policies::StepMode::kFullSync;
  if (plan.mode == policies::StepMode::kFullSync && g) {
    if (auto st = g->flush(ctx, kernels::chunkingFor(codec, n, options_.chunk_elements));
        !st.isOk()) {
      return device_fail(st);
    }
  } else if (plan.mode == policies::StepMode::kFullSync) {
    t.flushed.resize(n);
    const auto codec_chunking = kernels::chunkingFor(codec, n, options_.chunk_elements);
    if (auto s = codec.flush(ctx, codec_chunking, kernels::ConstTensor{input, n, DType::kF32},
                             t.state, t.flushed.data());
        !s.isOk()) {
      return fail(500, "internal", "flushing the codec state: " + s.message());
    }
    input = t.flushed.data();
  }
  kernels::CodecState none_state;
  const kernels::Codec& sc = dense_step ? kernels::noneCodec() : codec;  // this step's codec
  kernels::CodecState& state = dense_step ? none_state : t.state;
  if (dense_step) ctx.density.reset();

  // This sidecar's statistics record, carried by the exchange to every rank (policies).
  std::vector<uint8_t> record;
  if (policy) {
    policies::StepStats st;
    if (g) {
      auto got = g->stats(plan.min_magnitude, policy->config().adaptive);
      if (!got) return device_fail(got.status());
      st = std::move(*got);
    } else {
      st = localStats(&stream_, input, n, plan.min_magnitude, policy->config().adaptive, t.blocks);
    }
    // The residual's norm feeds a gauge only: a tensor of more than 256 Ki elements has it
    // measured every 8th step (a pass over the state), smaller ones every step.
    if (n <= (size_t{1} << 18) || step % 8 == 0 || !t.residual_norm2) {
      if (g) {
        auto r2 = g->residualNorm2();
        if (!r2) return device_fail(r2.status());
        t.residual_norm2 = *r2;
      } else {
        t.residual_norm2 =
            t.has_state && t.state.floats() > 0 ? codec.residualNorm2(t.state, n) : 0.0;
      }
    }
    st.residual_norm2 = *t.residual_norm2;
    if (t.cos) {
      st.cos_dot = t.cos->dot;
      st.cos_c2 = t.cos->c2;
      st.cos_g2 = t.cos->g2;
    }
    record = policy->record(std::move(st));
  }
  std::vector<std::vector<uint8_t>> stats_in;
  std::optional<CosineTerms> cos;  // of this step, measured on one chunk while it is encoded
  const kernels::ConstTensor tensor{input, n, DType::kF32};
  const kernels::Chunking chunking = kernels::chunkingFor(codec, n, options_.chunk_elements);
  // The whole-tensor phase (error feedback, momentum, thresholds) is part of compressing.
  const auto ta = Clock::now();
  if (g) {
    if (auto st = g->analyze(ctx, chunking, dense_step); !st.isOk()) return device_fail(st);
  } else {
    t.workspace.resize(sc.workspaceBytes(chunking));
    if (auto s = sc.analyze(ctx, chunking, tensor, state, t.workspace); !s.isOk()) {
      return fail(500, "internal", "compressing: " + s.message());
    }
  }
  const double analyze_us = microsSince(ta);
  const int rounds = sc.traits().rounds;
  const size_t chunks = chunking.count();
  // Payload buffers live with the tensor: allocated (and faulted in) once, not every step.
  t.payloads.resize(static_cast<size_t>(rounds));
  std::vector<std::vector<std::span<const uint8_t>>> reduced;  // per chunk: payloads to decode
  std::vector<std::span<const uint8_t>> round_payloads;        // multi-round: reduced per round
  // One fp32 trainer whose step has one round: decode straight into its buffer (its values were
  // read by the encoder already), which saves a pass over the result.
  const bool in_place = trainers == 1 && p.dtype == DType::kF32 && rounds == 1;
  float* result = nullptr;  // the host path's
  if (g) {
    if (auto st = g->prepareResult(in_place); !st.isOk()) return device_fail(st);
  } else if (in_place) {
    result = reinterpret_cast<float*>(p.parts[0]->data);
  } else {
    t.result.resize(n);
    result = t.result.data();
  }
  std::atomic<bool> nonfinite_seen{false};
  auto scan = [&](size_t lo, size_t hi) {  // exponent all ones: Inf or NaN (vectorises)
    uint32_t bad = 0;
    for (size_t i = lo; i < hi; ++i) {
      uint32_t u;
      std::memcpy(&u, result + i, sizeof u);
      bad |= static_cast<uint32_t>((u & 0x7F800000u) == 0x7F800000u);
    }
    if (bad != 0) nonfinite_seen.store(true, std::memory_order_relaxed);
  };
  // Decodes chunk c's final payloads into its range of the result (zeroed first), then scans it.
  auto decodeInto = [&](size_t c, std::span<const std::span<const uint8_t>> list,
                        const kernels::Codec& decoder, float weight) -> std::string {
    if (g) {  // on the device: its non-finite check comes once every chunk is in
      const auto st = g->decodeChunk(chunking, c, list, &decoder != &sc, weight);
      return st.isOk() ? "" : "chunk " + std::to_string(c) + ": " + st.message();
    }
    const size_t begin = chunking.begin(c), len = chunking.size(c);
    std::fill_n(result + begin, len, 0.0f);
    for (const auto& payload : list) {
      if (auto st = decoder.decodeChunk(payload, weight, result + begin, len); !st.isOk()) {
        return "chunk " + std::to_string(c) + ": " + st.message();
      }
    }
    scan(begin, begin + len);
    return "";
  };
  std::vector<char> decoded(chunks, 0);  // decoded during the exchange (ExchangeRound::on_chunk)
  double early_decode_us = 0.0;
  double exchange_us = 0.0, compress_us = analyze_us;
  uint32_t contributors = exchange_.worldSize();
  bool dense_result = false;
  for (int r = 0; r < rounds; ++r) {
    auto& bufs = t.payloads[static_cast<size_t>(r)];
    bufs.resize(chunks);
    std::vector<std::span<const uint8_t>> mine(chunks);
    std::vector<char> encoded(chunks, 0);
    std::span<const uint8_t> previous;
    if (r > 0) previous = round_payloads.back();
    double round_compress_us = 0.0;
    // Compresses chunk c once (each chunk is encoded at most once per analyze()).
    auto encodeOne = [&](size_t c) -> Result<std::span<const uint8_t>> {
      if (c >= chunks) return internalError("chunk " + std::to_string(c) + " out of range");
      if (encoded[c]) return mine[c];
      const auto tc = Clock::now();
      if (g) {
        auto payload = g->encodeChunk(ctx, chunking, c, r, previous, bufs[c]);
        if (!payload) return payload.status();
        mine[c] = *payload;
      } else {
        const size_t max = sc.maxPayloadBytes(chunking.size(c));
        if (bufs[c].size() < max) bufs[c].resize(max);
        auto size = sc.encodeChunk(ctx, chunking, c, r, previous, tensor, state, t.workspace,
                                   std::span<uint8_t>(bufs[c].data(), max));
        if (!size) return internalError("compressing: " + size.status().message());
        mine[c] = {bufs[c].data(), *size};
      }
      encoded[c] = 1;
      fig.wire_bytes += mine[c].size();
      // The sampled cosine of this step: one chunk (which one turns with the step), decoded
      // back right after it is encoded, against what it was encoded from.
      // A health signal, not worth a decode of a large chunk every step: tensors of more than
      // 256 Ki elements are sampled every 4th step.
      const uint64_t every = n > (size_t{1} << 18) ? 4 : 1;
      if (policy && r == 0 && rounds == 1 && plan.mode == policies::StepMode::kCompressed &&
          step % every == 0 && c == (step / every) % chunks) {
        const float* original = nullptr;
        if (g) {  // the chunk's input from the device
          if (auto st = g->chunkInput(chunking, c, t.original); !st.isOk()) return st;
          original = t.original.data();
        } else {
          original = input + chunking.begin(c);
        }
        cos = cosineTerms(sc, mine[c], original, chunking.size(c), t.scratch);
      }
      round_compress_us += microsSince(tc);
      return mine[c];
    };
    const bool lazy = exchange_.encodesLazily();
    if (!lazy) {
      for (size_t c = 0; c < chunks; ++c) {
        if (auto p = encodeOne(c); !p) {
          return fail(500, g ? "device_error" : "internal", p.status().message());
        }
      }
    }
    const auto te = Clock::now();
    const std::span<const std::span<const uint8_t>> given =
        lazy ? std::span<const std::span<const uint8_t>>{} : std::span(mine);
    ExchangeRound er{t.name, step, r, sc, chunking, given};
    er.density = ctx.density;
    if (rounds == 1 && !g) {
      // A chunk whose payloads are final is decoded at once, while later chunks still travel.
      // (Not on the GPU path: a device decode is brief, and the exchange's threads would have to
      // take turns with the engine's on the device.)
      er.on_chunk = [&](size_t c, std::span<const std::span<const uint8_t>> list) -> Status {
        if (c >= chunks || decoded[c]) return internalError("chunk decoded twice or unknown");
        const auto td = Clock::now();
        const float w = 1.0f / static_cast<float>(exchange_.worldSize() * trainers);
        std::string e = decodeInto(c, list, er.dense ? kernels::noneCodec() : sc, w);
        early_decode_us += microsSince(td);
        if (!e.empty()) return dataLoss("decompressing: " + e);
        decoded[c] = 1;
        return Status::ok();
      };
    }
    if (lazy) er.encode = encodeOne;
    if (r == 0) er.stats_out = record;
    auto got = exchange_.run(er);
    if (r == 0) stats_in = std::move(er.stats_in);
    const double round_us = microsSince(te);
    if (!got) return fail(502, "exchange_failed", got.status().message());
    // Every chunk's state update happens in its encode: none may be left out.
    for (size_t c = 0; c < chunks; ++c) {
      if (auto p = encodeOne(c); !p) {
        return fail(500, g ? "device_error" : "internal", p.status().message());
      }
    }
    compress_us += round_compress_us;
    exchange_us += std::max(0.0, round_us - (lazy ? round_compress_us : 0.0) - early_decode_us);
    if (er.contributors > 0) contributors = er.contributors;
    if (er.dense && rounds > 1) {
      return fail(500, "internal", "a multi-round codec's exchange returned dense payloads");
    }
    dense_result = er.dense;
    if (rounds > 1) {
      if (got->size() != 1 || (*got)[0].size() != 1) {
        return fail(500, "internal", "multi-round codec exchange returned more than one payload");
      }
      round_payloads.push_back((*got)[0][0]);
    } else {
      reduced = std::move(*got);
    }
  }
  fig.durations_us[static_cast<size_t>(metrics::Stage::kCompress)] = compress_us;
  fig.durations_us[static_cast<size_t>(metrics::Stage::kExchange)] = exchange_us;

  // Decompress and average over every trainer of every sidecar; chunks in parallel (each owns its
  // range of the result), each checked for non-finite values as soon as it is decoded.
  const auto t2 = Clock::now();
  const float weight = 1.0f / static_cast<float>(contributors * trainers);
  // A sparse allgather the exchange switched to a dense allreduce returns plain fp32 sums.
  const kernels::Codec& decoder = dense_result ? kernels::noneCodec() : sc;
  if (rounds > 1 && g) {
    if (auto st = g->decodeRounds(ctx, chunking, round_payloads, weight); !st.isOk()) {
      return device_fail(st);
    }
  } else if (rounds > 1) {
    std::fill_n(result, n, 0.0f);
    if (auto s = sc.decodeRounds(round_payloads, weight, result, n); !s.isOk()) {
      return fail(500, "internal", "decompressing: " + s.message());
    }
    if (auto s = sc.finishStep(ctx, chunking, round_payloads, weight, tensor, state, t.workspace);
        !s.isOk()) {
      return fail(500, "internal", "finishing the step: " + s.message());
    }
    kernels::parallelFor(&stream_, n, kGrain, scan);
  } else if (g) {
    for (size_t c = 0; c < chunks; ++c) {
      if (std::string e = decodeInto(c, reduced[c], decoder, weight); !e.empty()) {
        return fail(502, "exchange_failed", "decompressing: " + e);
      }
    }
  } else {
    std::vector<std::string> errors(chunks);
    kernels::parallelFor(&stream_, chunks, 1, [&](size_t lo, size_t hi) {
      for (size_t c = lo; c < hi; ++c) {
        if (!decoded[c]) errors[c] = decodeInto(c, reduced[c], decoder, weight);
      }
    });
    for (const auto& e : errors) {
      if (!e.empty()) return fail(502, "exchange_failed", "decompressing: " + e);
    }
  }
  if (g) {
    auto bad = g->resultNonfinite();
    if (!bad) return device_fail(bad.status());
    if (*bad) nonfinite_seen.store(true);
  }
  // Silent-divergence guard: every checksum_every steps the ranks compare their results.
  if (exchange_.worldSize() > 1 && options_.checksum_every > 0 &&
      step % options_.checksum_every == 0) {
    uint64_t checksum = 0;
    if (g) {
      auto sum = g->resultChecksum();
      if (!sum) return device_fail(sum.status());
      checksum = *sum;
    } else {
      checksum = XXH3_64bits_dispatch(result, n * sizeof(float));
    }
    auto differ = exchange_.compareResults(t.name, step, checksum);
    if (!differ)
      return fail(502, "exchange_failed", "comparing results: " + differ.status().message());
    if (!differ->empty()) {
      std::string ranks;
      for (uint32_t r : *differ) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      metrics_.result_mismatches.Increment();
      if (policy) policy->forceFullSync(t.name, step);
      spdlog::error(
          "tensor '{}' step {}: the result differs from rank(s) {} (checksum {:016x}): "
          "the sidecars have diverged",
          t.name, step, ranks, checksum);
    }
  }
  // The policies: every rank aggregates the same records and decides alike. Checkpoints asked
  // for are saved first, with the state as it stood before this step.
  bool global_nonfinite = false;
  if (policy) {
    auto g = policies::aggregate(stats_in);
    if (!g) return fail(502, "exchange_failed", "statistics: " + g.status().message());
    if (auto m = policies::resumeMismatch(*g)) {
      // POST /v1/resume reached some sidecars only: the others resume from the same step now
      // (from their own checkpoint of it), so the step after this failed one agrees again.
      std::optional<uint64_t> newest;
      for (const auto& r : g->resumed_from) {
        if (r && (!newest || *r > *newest)) newest = *r;
      }
      if (newest && policy->resumedFrom() != newest) pending_resume_ = *newest;
      return fail(409, "resume_mismatch",
                  *m + (pending_resume_ ? "; this sidecar resumes from step " +
                                              std::to_string(*pending_resume_) + " now"
                                        : std::string()));
    }
    for (const auto& q : g->requests) {
      if (q.kind != policies::Request::Kind::kCheckpoint) continue;
      if (q.origin == options_.rank) continue;  // saved when it was asked for
      auto saved = saveCheckpoint(q.step, "trainer");
      if (!saved) {
        spdlog::error("checkpoint of step {} asked for by rank {}: {}", q.step, q.origin,
                      saved.status().message());
      }
    }
    global_nonfinite = g->nonfinite > 0;
    policy->update(t.name, step, plan, *g);
    if (const auto c = g->cosine()) t.gauges.cosine->Set(*c);
    t.gauges.residual->Set(std::sqrt(g->residual_norm2));
  }
  // Non-finite results are returned as plain averaging would, and the state is not committed —
  // also when the NaN/Inf of some rank's gradient did not make it into the result (a codec that
  // did not select it): the global statistics say so on every rank alike.
  const bool nonfinite = nonfinite_seen.load() || global_nonfinite;
  fig.nonfinite = nonfinite;
  if (g) {
    if (auto st = g->writeBack(); !st.isOk()) return device_fail(st);
  } else if (!in_place) {
    for (auto& part : p.parts) {
      kernels::parallelFor(&stream_, n, kGrain, [&](size_t lo, size_t hi) {
        narrowRange(p.dtype, result, lo, hi, part->data);
      });
    }
  }
  if (!nonfinite) {
    // Compressed steps commit what the codec prepared; full-syncs the flushed state (prepared by
    // flush() in the tensor's own state); bypasses leave the state as it was.
    if (g) {
      if (auto st = g->commit(plan.mode != policies::StepMode::kBypass); !st.isOk()) {
        return device_fail(st);
      }
    } else {
      if (plan.mode != policies::StepMode::kBypass) t.state.commit();
      if (plan.delayed_sync_step) std::fill(t.accum.begin(), t.accum.end(), 0.0f);
    }
    // A measured cosine goes out with the tensor's next record, once.
    if (plan.mode == policies::StepMode::kCompressed) t.cos = cos;
  }
  fig.durations_us[static_cast<size_t>(metrics::Stage::kDecompress)] =
      microsSince(t2) + early_decode_us;
  fig.durations_us[static_cast<size_t>(metrics::Stage::kTotal)] = microsSince(t0);

  metrics_.raw_bytes.Increment(static_cast<double>(fig.raw_bytes));
  for (size_t s = 0; s < metrics::kStageCount; ++s) {
    metrics_.stage(static_cast<metrics::Stage>(s)).Observe(fig.durations_us[s] * 1e-6);
  }
  if (fig.wire_bytes > 0) {
    t.gauges.ratio->Set(static_cast<double>(fig.raw_bytes) / static_cast<double>(fig.wire_bytes));
  }
  return out;
}

std::optional<double> warmupDensity(uint64_t step, uint64_t warmup_steps) {
  if (warmup_steps == 0 || step >= warmup_steps) return std::nullopt;
  const uint64_t stage = std::min<uint64_t>(4, step * 5 / warmup_steps);
  double d = 0.25;
  for (uint64_t i = 0; i < stage; ++i) d *= 0.25;
  return d;
}

std::vector<uint8_t> encodeJobState(const std::map<std::string, uint64_t>& committed,
                                    const policies::PolicyEngine* policy) {
  boost::json::object steps;
  for (const auto& [name, step] : committed) steps[name] = step;
  boost::json::object o{{"version", 1}, {"committed", std::move(steps)}};
  if (policy) o["policy"] = policy->stateJson();
  const std::string text = boost::json::serialize(o);
  return {text.begin(), text.end()};
}

Result<JobState> decodeJobState(std::span<const uint8_t> bytes) {
  boost::system::error_code ec;
  const boost::json::value v = boost::json::parse(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), ec);
  if (ec) return invalidArgument("job state is not JSON: " + ec.message());
  const auto* o = v.if_object();
  if (!o || !o->contains("version") || !o->at("version").is_int64() ||
      o->at("version").as_int64() != 1) {
    return invalidArgument("job state: expected an object with \"version\": 1");
  }
  const auto* committed = o->if_contains("committed");
  if (!committed || !committed->is_object()) {
    return invalidArgument("job state: \"committed\" must be an object");
  }
  JobState state;
  auto& out = state.committed;
  if (const auto* p = o->if_contains("policy")) {
    if (!p->is_object()) return invalidArgument("job state: \"policy\" must be an object");
    state.policy = *p;
  }
  for (const auto& [name, step] : committed->as_object()) {
    if (name.empty() || name.size() > 1024) {
      return invalidArgument("job state: a tensor name is empty or longer than 1024 bytes");
    }
    if (step.is_uint64()) {
      out[std::string(name)] = step.as_uint64();
    } else if (step.is_int64() && step.as_int64() >= 0) {
      out[std::string(name)] = static_cast<uint64_t>(step.as_int64());
    } else {
      return invalidArgument("job state: the step of '" + std::string(name) +
                             "' is not a non-negative integer");
    }
  }
  return state;
}

Result<std::string> StepEngine::saveCheckpoint(uint64_t step, const std::string& reason) {
  if (options_.state_dir.empty()) {
    return failedPrecondition("no state directory is configured (state.dir)");
  }
  policies::Checkpoint c;
  c.job_id = options_.job_id;
  c.world_size = options_.world_size;
  c.rank = options_.rank;
  c.step = step;
  c.reason = reason;
  if (options_.policy) c.policy_json = boost::json::serialize(options_.policy->stateJson());
  {
    std::lock_guard lock(mu_);
    for (const auto& [name, t] : tensors_) {
      if (!t->last_committed) continue;
      policies::CheckpointTensor ct;
      ct.name = name;
      ct.last_committed = *t->last_committed;
      if (t->has_state) {
        ct.codec_key = t->config_key;
        ct.elements = t->state_elements;
        ct.dtype = static_cast<uint8_t>(t->state_dtype);
        if (t->state_on_gpu) {
          auto host = gpu::downloadState(*t->gpu);
          if (!host) return host.status();
          const auto cur = host->currentSpan();
          ct.state.assign(cur.begin(), cur.end());
        } else {
          const auto cur = t->state.currentSpan();
          ct.state.assign(cur.begin(), cur.end());
        }
      }
      if (std::any_of(t->accum.begin(), t->accum.end(), [](float v) { return v != 0.0f; })) {
        ct.accumulator = t->accum;
      }
      c.tensors.push_back(std::move(ct));
    }
  }
  // Trainer-driven checkpoints live apart from the periodic and on-SIGTERM ones, which are pruned.
  const std::string dir =
      reason == "trainer" ? options_.state_dir + "/trainer" : options_.state_dir;
  auto path = policies::writeCheckpoint(dir, c);
  if (!path) {
    metrics_.checkpoints_failed.Increment();
    return path.status();
  }
  metrics_.checkpoints_ok.Increment();
  spdlog::info("checkpoint of step {} ({}): {} tensor(s) written to {}", step, reason,
               c.tensors.size(), *path);
  if (reason != "trainer") {
    policies::pruneCheckpoints(options_.state_dir, options_.job_id, options_.rank,
                               std::max<size_t>(1, options_.checkpoint_keep));
  } else if (options_.trainer_checkpoint_keep > 0) {
    policies::pruneCheckpoints(dir, options_.job_id, options_.rank,
                               options_.trainer_checkpoint_keep);
  }
  return path;
}

Result<std::string> StepEngine::checkpoint(uint64_t step) {
  Result<std::string> out = internalError("not run");
  const Status st = runBetweenSteps([&]() -> Status {
    {
      std::lock_guard lock(mu_);
      for (const auto& [name, t] : tensors_) {
        if (t->last_committed && *t->last_committed > step) {
          out = failedPrecondition(
              "the state after step " + std::to_string(step) + " is gone here: tensor '" + name +
              "' has completed step " + std::to_string(*t->last_committed) +
              " (ask for a checkpoint before sending the next step's gradients)");
          return Status::ok();
        }
      }
    }
    out = saveCheckpoint(step, "trainer");
    if (out && options_.policy && options_.world_size > 1) options_.policy->requestCheckpoint(step);
    return Status::ok();
  });
  if (!st.isOk()) return st;
  return out;
}

Status StepEngine::restoreFrom(const std::string& path, std::optional<uint64_t> step,
                               bool steps_too, bool policy_too) {
  policies::CheckpointExpect expect;
  expect.job_id = options_.job_id;
  expect.world_size = options_.world_size;
  expect.rank = options_.rank;
  expect.step = step;
  auto c = policies::readCheckpoint(path, expect);
  if (!c) return c.status();
  std::optional<boost::json::value> policy_state;
  if (options_.policy && policy_too && !c->policy_json.empty()) {
    boost::system::error_code ec;
    policy_state = boost::json::parse(c->policy_json, ec);
    if (ec) return dataLoss(path + ": the policy state is not JSON: " + ec.message());
  }
  for (const auto& ct : c->tensors) {
    if (ct.dtype > static_cast<uint8_t>(DType::kBF16)) {
      return dataLoss(path + ": tensor '" + ct.name + "' has an unknown dtype");
    }
  }
  if (policy_state) LW_RETURN_IF_ERROR(options_.policy->restoreState(*policy_state));
  std::vector<std::pair<std::string, Pending>> dropped;
  {
    std::lock_guard lock(mu_);
    for (const auto& ct : c->tensors) {
      auto& slot = tensors_[ct.name];
      if (!slot) {
        slot = std::make_unique<Tensor>();
        slot->name = ct.name;
      }
      Tensor& t = *slot;
      t.codec.reset();  // re-created from the settings at the next step; state kept if they match
      t.cos.reset();
      t.has_state = !ct.codec_key.empty();
      t.config_key = ct.codec_key;
      t.state_elements = ct.elements;
      t.state_dtype = static_cast<DType>(ct.dtype);
      t.state = kernels::CodecState(ct.state.size());
      if (!ct.state.empty()) LW_RETURN_IF_ERROR(t.state.restore(ct.state));
      t.state_on_gpu = false;  // a GPU step moves it back to the device
      t.state_bytes = t.state.bytes();
      t.accum = ct.accumulator;
      if (steps_too) {
        t.last_committed = c->step;
        for (auto it = t.pending.begin(); it != t.pending.end();) {
          if (it->second.queued) {
            ++it;
            continue;
          }
          dropped.emplace_back(ct.name + "' step " + std::to_string(it->first),
                               std::move(it->second));
          it = t.pending.erase(it);
          --pending_count_;
        }
      }
    }
  }
  for (auto& [what, p] : dropped) {
    failPending(p, 409, "conflict", "tensor '" + what + " was pending when the sidecar resumed");
  }
  return Status::ok();
}

Status StepEngine::resume(uint64_t step) {
  if (options_.state_dir.empty()) {
    return failedPrecondition("no state directory is configured (state.dir)");
  }
  return runBetweenSteps([&] { return resumeHere(step); });
}

void StepEngine::resumeLater(uint64_t step) {
  postBetweenSteps([this, step]() -> Status {
    if (options_.policy && options_.policy->resumedFrom() == step) return Status::ok();
    if (auto st = resumeHere(step); !st.isOk()) {
      return failedPrecondition("resuming from step " + std::to_string(step) +
                                " as a peer did: " + st.message());
    }
    return Status::ok();
  });
}

Status StepEngine::resumeHere(uint64_t step) {
  if (options_.state_dir.empty()) {
    return failedPrecondition("no state directory is configured (state.dir)");
  }
  const std::string path = policies::checkpointPath(options_.state_dir + "/trainer",
                                                    options_.job_id, options_.rank, step);
  LW_RETURN_IF_ERROR(restoreFrom(path, step, /*steps_too=*/true, /*policy_too=*/true));
  {
    std::lock_guard lock(mu_);
    // Tensors the checkpoint does not know start after `step` too.
    for (auto& [name, t] : tensors_) t->last_committed = step;
  }
  if (options_.policy) options_.policy->setResumedFrom(step);
  // Periodic checkpoints go on from here, even below the last one of the abandoned run.
  last_periodic_ = step;
  // The checkpoints written after this one belong to the run abandoned here: make this one the
  // most recently written, so that a restart restores it (or what the resumed run writes next),
  // not a later step of that run, and pruning removes those first.
  if (auto st = policies::markNewest(path); !st.isOk()) {
    spdlog::warn("{}; a restart may restore a checkpoint of the run abandoned at this resume",
                 st.message());
  }
  spdlog::info("resumed from the checkpoint of step {} ({}); the next step is {}", step, path,
               step + 1);
  return Status::ok();
}

Result<std::optional<uint64_t>> StepEngine::restoreLatest() {
  if (options_.state_dir.empty()) return std::optional<uint64_t>{};
  // The most recently written of the periodic, on-SIGTERM and trainer-driven checkpoints (after
  // a resume, the one resumed from counts as written then: policies::markNewest).
  const auto newest = policies::newestCheckpoint(
      {options_.state_dir, options_.state_dir + "/trainer"}, options_.job_id, options_.rank);
  if (!newest) return std::optional<uint64_t>{};
  const uint64_t step = newest->step;
  const std::string path = newest->path;
  // The job's steps and policy state come from the peers; only the codec state from the file.
  LW_RETURN_IF_ERROR(restoreFrom(path, step, /*steps_too=*/false, /*policy_too=*/false));
  uint64_t residual = 0;
  {
    std::lock_guard lock(mu_);
    for (const auto& [name, t] : tensors_) residual += t->state.floats() * sizeof(float);
  }
  spdlog::warn(
      "restored the codec state of step {} from {} ({} bytes of residual and momentum); what "
      "the steps since then accumulated here is lost, and the job's step and policy state come "
      "from the peers",
      step, path, residual);
  return std::optional<uint64_t>{step};
}

std::map<std::string, uint64_t> StepEngine::committedSteps() const {
  std::map<std::string, uint64_t> out;
  std::lock_guard lock(mu_);
  for (const auto& [name, t] : tensors_) {
    if (t->last_committed) out[name] = *t->last_committed;
  }
  return out;
}

size_t StepEngine::adoptCommittedSteps(const std::map<std::string, uint64_t>& steps) {
  std::lock_guard lock(mu_);
  if (steps_ok_ > 0 || stopping_) return 0;
  size_t taken = 0;
  for (const auto& [name, step] : steps) {
    auto& slot = tensors_[name];
    if (!slot) {
      slot = std::make_unique<Tensor>();
      slot->name = name;
    }
    if (!slot->last_committed || *slot->last_committed < step) {
      slot->last_committed = step;
      ++taken;
    }
  }
  return taken;
}

boost::json::array StepEngine::tensorsJson() const {
  boost::json::array out;
  std::lock_guard lock(mu_);
  for (const auto& [name, t] : tensors_) {
    boost::json::object o{{"name", name},
                          {"elements", t->elements},
                          {"dtype", apiDTypeName(t->dtype)},
                          {"codec", t->codec_name},
                          {"state_bytes", t->state_bytes},
                          {"pending_steps", t->pending.size()}};
    o["last_step"] = t->last_step ? boost::json::value(*t->last_step) : boost::json::value(nullptr);
    o["last_committed_step"] =
        t->last_committed ? boost::json::value(*t->last_committed) : boost::json::value(nullptr);
    out.push_back(std::move(o));
  }
  return out;
}

uint64_t StepEngine::stepsOk() const {
  std::lock_guard lock(mu_);
  return steps_ok_;
}

uint64_t StepEngine::stepsFailed() const {
  std::lock_guard lock(mu_);
  return steps_failed_;
}

void StepEngine::shutdown() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

}  // namespace lightwire::proxy
