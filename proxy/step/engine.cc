#include "proxy/step/engine.h"

#include <spdlog/spdlog.h>

#include <boost/json/object.hpp>

#include <algorithm>

#include "proxy/step/gpu_backend.h"
#include "proxy/step/pipeline.h"
#include "proxy/step/tensor.h"

namespace lightwire::proxy {
namespace {

using Clock = std::chrono::steady_clock;
using kernels::DType;

// Steps of at most this many elements run on the thread that completes them (see submit()).
constexpr uint64_t kInlineMaxElements = uint64_t{1} << 16;

/// "position P of iteration I of stream 'S'", for messages.
std::string placeText(const StepOrder& o) {
  return "position " + std::to_string(o.position) + " of iteration " + std::to_string(o.iteration) +
         " of stream '" + o.stream + "'";
}

}  // namespace

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

StepEngine::StepEngine(EngineOptions options, CodecChooser chooser, metrics::Metrics& metrics,
                       Exchange& exchange)
    : options_(options),
      metrics_(metrics),
      exchange_(exchange),
      stream_(std::max(1u, options.threads)),
      pool_(options.max_pool_bytes),
      chooser_(std::move(chooser)) {
  gpu::keepPooledDeviceBytes(options.max_pool_bytes);
  thread_ = std::thread([this] { loop(); });
}

StepEngine::~StepEngine() { shutdown(); }

StepEngine::Tensor& StepEngine::tensorSlot(const std::string& name) {
  auto& slot = tensors_[name];
  if (!slot) {
    slot = std::make_unique<Tensor>();
    slot->name = name;
  }
  return *slot;
}

void StepEngine::setChooser(CodecChooser chooser) {
  std::lock_guard lock(mu_);
  chooser_ = std::move(chooser);
}

StepError StepEngine::admit(const TensorSpec& s, size_t created, bool* creates,
                            std::string* why) const {
  const std::string where = "tensor '" + s.name + "' step " + std::to_string(s.step);
  *creates = true;
  auto tit = tensors_.find(s.name);
  if (tit != tensors_.end()) {
    const Tensor& t = *tit->second;
    if (t.last_committed && s.step <= *t.last_committed) {
      *why = where + " goes backwards: step " + std::to_string(*t.last_committed) +
             " already completed";
      return StepError::kConflict;
    }
    if (t.running && *t.running == s.step) {
      *why = where + " is being exchanged already";
      return StepError::kConflict;
    }
    if (auto it = t.pending.find(s.step); it != t.pending.end()) {
      *creates = false;
      const Pending& p = it->second;
      if (p.parts[s.trainer]) {
        *why = where + ": trainer " + std::to_string(s.trainer) + " already sent its part";
        return StepError::kConflict;
      }
      if (p.elements != s.elements || p.dtype != s.dtype) {
        *why = where + ": trainer " + std::to_string(s.trainer) + " sent " +
               std::to_string(s.elements) + " " + apiDTypeName(s.dtype) +
               " elements, another trainer " + std::to_string(p.elements) + " " +
               apiDTypeName(p.dtype);
        return StepError::kConflict;
      }
      if (p.bucket != s.bucket || p.layout_hash != s.layout_hash) {
        *why = where + ": trainer " + std::to_string(s.trainer) + " sent it " +
               (s.bucket.empty() ? std::string("on its own") : "in bucket '" + s.bucket + "'") +
               ", another trainer " +
               (p.bucket.empty() ? std::string("on its own") : "in bucket '" + p.bucket + "'");
        return StepError::kConflict;
      }
      if (p.order != s.order) {
        auto text = [](const std::optional<StepOrder>& o) {
          return o ? "at " + placeText(*o) : std::string("without a place");
        };
        *why = where + ": trainer " + std::to_string(s.trainer) + " sent it " + text(s.order) +
               ", another trainer at another place (" + text(p.order) + ")";
        return StepError::kConflict;
      }
    }
  }
  if (s.order) {
    const StepOrder& o = *s.order;
    if (auto st = streams_.find(o.stream); st != streams_.end()) {
      if (st->second.cancelled.contains({o.iteration, o.position})) {
        *why = where + ": its place, " + placeText(o) + ", was cancelled";
        return StepError::kCancelled;
      }
      if (orderPassed(o)) {
        *why = where + ": its place, " + placeText(o) + ", has passed (position " +
               std::to_string(st->second.last->second) + " ran, was cancelled or gave up waiting)";
        return StepError::kConflict;
      }
    } else if (streams_.size() >= kMaxStreams) {
      *why = "too many streams of ordered steps (" + std::to_string(kMaxStreams) + ")";
      return StepError::kLimitReached;
    }
  }
  if (*creates && pending_count_ + created >= options_.max_pending_steps) {
    *why = "too many steps in flight (limits.max_pending_steps = " +
           std::to_string(options_.max_pending_steps) + ")";
    return StepError::kLimitReached;
  }
  return StepError::kNone;
}

bool StepEngine::enqueue(Contribution c, StepDone done, std::chrono::steady_clock::time_point now) {
  const TensorSpec& s = c.spec;
  Tensor& t = tensorSlot(s.name);
  auto it = t.pending.find(s.step);
  if (it == t.pending.end()) {
    Pending p;
    p.parts.resize(options_.local_trainers);
    p.dones.resize(options_.local_trainers);
    p.elements = s.elements;
    p.dtype = s.dtype;
    p.shape = s.shape;
    p.layer = s.layer;
    p.bucket = s.bucket;
    p.layout_hash = s.layout_hash;
    p.bucket_layers = s.bucket_layers;
    p.order = s.order;
    p.deadline = now + options_.step_timeout;
    it = t.pending.emplace(s.step, std::move(p)).first;
    ++pending_count_;
  }
  Pending& p = it->second;
  const unsigned trainer = s.trainer;
  std::pair<std::string, uint64_t> ready_key{s.name, s.step};  // `s` refers into `c`, moved below
  p.parts[trainer] = std::move(c);
  p.dones[trainer] = std::move(done);
  if (++p.arrived < options_.local_trainers) return false;
  p.queued = true;
  if (p.order) {
    streams_[p.order->stream];  // counted against kMaxStreams from now on
    p.order_deadline = now + options_.step_timeout;
  }
  ready_.push_back(std::move(ready_key));
  return true;
}

namespace {

std::string trainerOutOfRange(unsigned trainer, unsigned trainers) {
  return "trainer " + std::to_string(trainer) + " is out of range: this sidecar serves " +
         std::to_string(trainers) + " local trainer(s), 0.." + std::to_string(trainers - 1);
}

}  // namespace

void StepEngine::submit(Contribution c, StepDone done) {
  auto refuse = [&](StepError error, std::string message) {
    done(StepOutcome{error, std::move(message), {}});
  };
  if (c.spec.trainer >= options_.local_trainers) {
    return refuse(StepError::kInvalidArgument,
                  trainerOutOfRange(c.spec.trainer, options_.local_trainers));
  }
  std::unique_lock lock(mu_);
  if (stopping_) return refuse(StepError::kShuttingDown, "the sidecar is shutting down");
  std::string why;
  bool creates = false;
  if (StepError e = admit(c.spec, 0, &creates, &why); e != StepError::kNone) {
    lock.unlock();
    if (e == StepError::kLimitReached) metrics_.limitHits("pending_steps").Increment();
    return refuse(e, std::move(why));
  }
  const uint64_t elements = c.spec.elements;
  if (enqueue(std::move(c), std::move(done), Clock::now())) {
    // A small step with nothing ahead of it runs right here: no hand-off to the engine thread and
    // back (two thread wake-ups, most of a 4 KiB round trip).
    // Only without peers: waiting for them must not hold up the caller's (I/O) thread.
    if (!executing_ && tasks_.empty() && ready_.size() == 1 && elements <= kInlineMaxElements &&
        exchange_.worldSize() == 1 && firstRunnable() != ready_.end()) {
      runNextReady(lock);
      return;
    }
  }
  cv_.notify_all();
}

void StepEngine::submitBucket(std::vector<Contribution> layers, std::vector<StepDone> dones) {
  auto refuse = [&](StepError error, const std::string& message) {
    for (auto& d : dones) d(StepOutcome{error, message, {}});
  };
  if (layers.empty() || layers.size() != dones.size()) {
    return refuse(StepError::kInternal, "a bucket needs one done per layer, and a layer");
  }
  for (const auto& c : layers) {
    if (c.spec.trainer >= options_.local_trainers) {
      return refuse(StepError::kInvalidArgument,
                    trainerOutOfRange(c.spec.trainer, options_.local_trainers));
    }
  }
  std::unique_lock lock(mu_);
  if (stopping_) return refuse(StepError::kShuttingDown, "the sidecar is shutting down");
  size_t created = 0;
  for (const auto& c : layers) {
    std::string why;
    bool creates = false;
    if (StepError e = admit(c.spec, created, &creates, &why); e != StepError::kNone) {
      lock.unlock();
      if (e == StepError::kLimitReached) metrics_.limitHits("pending_steps").Increment();
      return refuse(e, why);
    }
    created += creates ? 1 : 0;
  }
  // Every layer is in, in one go: the last trainer's parts queue the bucket's layers one after
  // the other, which is how runNextReady() finds them together.
  // One time for all: a bucket's layers wait, and give up waiting, together.
  const auto now = Clock::now();
  for (size_t i = 0; i < layers.size(); ++i) {
    enqueue(std::move(layers[i]), std::move(dones[i]), now);
  }
  cv_.notify_all();
}

void StepEngine::failPending(Pending& p, StepError error, const std::string& message) {
  for (auto& d : p.dones) {
    if (d) d(StepOutcome{error, message, {}});
  }
}

void StepEngine::loop() {
  std::unique_lock lock(mu_);
  while (true) {
    // Earliest deadline among steps still waiting for trainers, or (queued) for their place.
    std::optional<Clock::time_point> next;
    for (auto& [name, t] : tensors_) {
      for (auto& [step, p] : t->pending) {
        const auto due = p.queued ? p.order_deadline : p.deadline;
        if ((!p.queued || p.order) && (!next || due < *next)) next = due;
      }
    }
    if (!tasks_.empty() && !executing_) {
      runTasks(lock);
      continue;
    }
    if (firstRunnable() == ready_.end() && !stopping_) {
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
          failPending(p, StepError::kShuttingDown, "the sidecar is shutting down");
        } else {
          spdlog::warn("tensor '{}: local trainer(s) {} did not send their part within {} s", what,
                       missing, options_.step_timeout.count() / 1000.0);
          metrics_.steps_failed.Increment();
          failPending(p, StepError::kDeadlineExceeded,
                      "tensor '" + what + ": local trainer(s) " + missing +
                          " did not send their part within limits.step_timeout_s");
        }
      }
      lock.lock();
      continue;
    }
    if (expireOrderWaits(lock)) continue;
    if (ready_.empty()) {
      if (stopping_) break;
      continue;
    }
    if (firstRunnable() == ready_.end()) continue;
    if (executing_) {  // a submitting thread runs a small step inline: wait for it
      cv_.wait(lock);
      continue;
    }
    runNextReady(lock);
  }
}

bool StepEngine::orderPassed(const StepOrder& o) const {
  auto st = streams_.find(o.stream);
  if (st == streams_.end()) return false;
  if (st->second.cancelled.contains({o.iteration, o.position})) return true;
  const auto& last = st->second.last;
  return last && last->first == o.iteration && o.position <= last->second;
}

uint64_t StepEngine::nextPlace(const StepOrder& o) const {
  // The place that comes next in o's iteration: after the last one run there, or the first (the
  // trainer's next iteration begins once every bucket of the last has its reply), skipping places
  // cancelled before they came.
  uint64_t next = 0;
  auto st = streams_.find(o.stream);
  if (st == streams_.end()) return 0;
  if (st->second.last && st->second.last->first == o.iteration) {
    next = uint64_t{st->second.last->second} + 1;
  }
  const auto& cancelled = st->second.cancelled;
  while (next < o.position && cancelled.contains({o.iteration, static_cast<uint32_t>(next)})) {
    ++next;
  }
  return next;
}

bool StepEngine::runnable(const Pending& p) const {
  return !p.order || p.order->position == nextPlace(*p.order);
}

std::deque<std::pair<std::string, uint64_t>>::iterator StepEngine::firstRunnable() {
  if (stopping_) return ready_.begin();  // every one fails now, in order
  for (auto it = ready_.begin(); it != ready_.end(); ++it) {
    auto tit = tensors_.find(it->first);
    if (tit == tensors_.end()) return it;
    auto pit = tit->second->pending.find(it->second);
    if (pit == tit->second->pending.end() || runnable(pit->second)) return it;
  }
  return ready_.end();
}

void StepEngine::passOrder(const StepOrder& o) {
  Stream& st = streams_[o.stream];
  st.last = std::make_pair(o.iteration, o.position);
  std::erase_if(st.cancelled, [&](const auto& c) {
    return c.first < o.iteration || (c.first == o.iteration && c.second <= o.position);
  });
}

bool StepEngine::expireOrderWaits(std::unique_lock<std::mutex>& lock) {
  struct Doomed {
    std::string tensor;
    uint64_t step;
    Pending p;
    StepError error;
    std::string message;
  };
  if (streams_.empty()) return false;  // no ordered step was ever queued
  std::vector<Doomed> doomed;
  const auto now = Clock::now();
  for (auto& [name, t] : tensors_) {
    for (auto it = t->pending.begin(); it != t->pending.end();) {
      Pending& p = it->second;
      if (!p.queued || !p.order) {
        ++it;
        continue;
      }
      const StepOrder& o = *p.order;
      const bool passed = orderPassed(o);
      if (!passed && (p.order_deadline > now || runnable(p))) {
        ++it;
        continue;
      }
      const std::string where =
          "tensor '" + name + "' step " + std::to_string(it->first) + " (" + placeText(o) + ")";
      // Passed: another step took its place (two steps sent at one place), or it was cancelled.
      const StepError error = passed ? StepError::kConflict : StepError::kDeadlineExceeded;
      std::string message = passed ? where + ": its place was taken by another step or cancelled"
                                   : where + " waited limits.step_timeout_s for position " +
                                         std::to_string(nextPlace(o)) +
                                         ", which never came; nothing was exchanged or committed";
      doomed.push_back({name, it->first, std::move(p), error, std::move(message)});
      it = t->pending.erase(it);
      --pending_count_;
      ++steps_failed_;
    }
  }
  if (doomed.empty()) return false;
  // The places given up on are passed: the ones after them need not wait as long again.
  for (const Doomed& d : doomed) {
    if (d.error == StepError::kDeadlineExceeded) passOrder(*d.p.order);
  }
  lock.unlock();
  std::set<std::pair<std::string, uint64_t>> aborted_buckets;
  for (Doomed& d : doomed) {
    spdlog::warn("{}", d.message);
    metrics_.steps_failed.Increment();
    // The other sidecars may be exchanging it already: they fail it at once, not at their deadline.
    exchange_.abort(d.tensor, d.step, d.message);
    if (!d.p.bucket.empty() && aborted_buckets.emplace(d.p.bucket, d.step).second) {
      exchange_.abort(d.p.bucket, d.step, d.message);
    }
    failPending(d.p, d.error, d.message);
  }
  lock.lock();
  return true;
}

Result<bool> StepEngine::cancel(const StepOrder& o, const std::string& bucket,
                                std::optional<uint64_t> step) {
  std::vector<std::pair<std::string, uint64_t>> aborts;
  std::vector<Pending> failed;
  {
    std::lock_guard lock(mu_);
    if (stopping_) return failedPrecondition("the sidecar is shutting down");
    if (orderPassed(o)) return false;
    auto st = streams_.find(o.stream);
    if (st == streams_.end() && streams_.size() >= kMaxStreams) {
      return outOfRange("too many streams of ordered steps (" + std::to_string(kMaxStreams) + ")");
    }
    if (st != streams_.end() && st->second.cancelled.size() >= kMaxCancelled) {
      return outOfRange("stream '" + o.stream + "' holds " + std::to_string(kMaxCancelled) +
                        " cancelled places not reached yet; no more are kept");
    }
    streams_[o.stream].cancelled.emplace(o.iteration, o.position);
    std::set<std::string> buckets;
    for (auto& [name, t] : tensors_) {
      for (auto it = t->pending.begin(); it != t->pending.end();) {
        if (!it->second.order || *it->second.order != o) {
          ++it;
          continue;
        }
        aborts.emplace_back(name, it->first);
        if (!it->second.bucket.empty() && buckets.insert(it->second.bucket).second) {
          aborts.emplace_back(it->second.bucket, it->first);
        }
        failed.push_back(std::move(it->second));
        it = t->pending.erase(it);
        --pending_count_;
        ++steps_failed_;
      }
    }
    if (step && !bucket.empty() && !buckets.contains(bucket)) aborts.emplace_back(bucket, *step);
  }
  cv_.notify_all();
  const std::string why =
      placeText(o) + " was cancelled by a trainer (it failed before sending it)";
  for (const auto& [name, s] : aborts) exchange_.abort(name, s, why);
  for (auto& p : failed) {
    metrics_.steps_failed.Increment();
    failPending(p, StepError::kCancelled, why);
  }
  return true;
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
  // The ready entries of one step: a tensor's, or every layer of a bucket (queued together by
  // submitBucket(), so they are next to each other).
  // The first one that may run: ordered steps wait for the places before theirs.
  std::vector<Tensor*> ts;
  std::vector<Pending> ps;
  uint64_t step = 0;
  std::string bucket;
  for (auto at = firstRunnable(); at != ready_.end();) {
    const auto [name, s] = *at;
    auto tit = tensors_.find(name);
    if (tit == tensors_.end() || !tit->second->pending.contains(s)) {
      at = ready_.erase(at);  // gone meanwhile (failed by a resume or while waiting for its place)
      if (ts.empty()) break;
      continue;
    }
    Tensor& t = *tit->second;
    auto pit = t.pending.find(s);
    if (!ts.empty() && (pit->second.bucket.empty() || pit->second.bucket != bucket || s != step)) {
      break;  // the next step's
    }
    step = s;
    bucket = pit->second.bucket;
    ts.push_back(&t);
    ps.push_back(std::move(pit->second));
    t.pending.erase(pit);
    --pending_count_;
    at = ready_.erase(at);
    if (bucket.empty()) break;
  }
  if (ts.empty()) return;
  if (ps.front().order && !stopping_) passOrder(*ps.front().order);
  if (stopping_) {
    lock.unlock();
    for (auto& p : ps) failPending(p, StepError::kShuttingDown, "the sidecar is shutting down");
    lock.lock();
    return;
  }
  for (Tensor* t : ts) t->running = step;
  executing_ = true;
  lock.unlock();
  if (ts.size() == 1 && bucket.empty()) {
    runStep(*ts.front(), step, ps.front());
  } else {
    runBucketStep(ts, step, ps);
  }
  resumePending();
  lock.lock();
  for (Tensor* t : ts) t->running.reset();
  executing_ = false;
  // Wake the engine thread only when it has something to do: waking it after every inline step
  // would cost a context switch per small round trip.
  if (!ready_.empty() || stopping_) cv_.notify_all();
}

// Periodic checkpoint: the first step numbered a multiple of checkpoint_every saves the state
// after the step before it (every tensor's last committed step). Not before this sidecar has
// completed a step: a restarted sidecar has nothing of its own yet, and an empty file would shadow
// its real one.
void StepEngine::periodicCheckpoint(uint64_t step) {
  if (options_.checkpoint_every == 0 || options_.state_dir.empty() || step == 0 ||
      step % options_.checkpoint_every != 0 || step - 1 <= last_periodic_ || stepsOk() == 0) {
    return;
  }
  last_periodic_ = step - 1;
  if (auto saved = saveCheckpoint(step - 1, "periodic"); !saved) {
    spdlog::error("periodic checkpoint of step {}: {}", step - 1, saved.status().message());
  }
}

namespace {

/// The refusal of a step that would go backwards (the tensor committed it or a later one while
/// it waited), or nullopt.
std::optional<StepOutcome> goesBackwards(const std::string& name, uint64_t step,
                                         const std::optional<uint64_t>& last_committed) {
  if (!last_committed || step > *last_committed) return std::nullopt;
  return StepOutcome{StepError::kConflict, "tensor '" + name + "' step " + std::to_string(step) +
                                               " goes backwards: step " +
                                               std::to_string(*last_committed) +
                                               " already completed"};
}

}  // namespace

void StepEngine::runStep(Tensor& t, uint64_t step, Pending& p) {
  std::optional<StepOutcome> refused;
  {
    std::lock_guard lock(mu_);
    refused = goesBackwards(t.name, step, t.last_committed);
  }
  StepOutcome outcome;
  if (refused) {
    outcome = std::move(*refused);
  } else {
    periodicCheckpoint(step);
    outcome = StepPipeline(*this, t, step, p).run();
  }
  if (!outcome.ok()) exchange_.abort(t.name, step, outcome.message);
  exchange_.stepDone(t.name, step);
  endStep(t, step, p, outcome);
}

void StepEngine::runBucketStep(std::vector<Tensor*>& tensors, uint64_t step,
                               std::vector<Pending>& parts) {
  const size_t n = tensors.size();
  std::vector<StepOutcome> outcomes(n);
  std::optional<StepOutcome> refused;
  {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < n && !refused; ++i) {
      refused = goesBackwards(tensors[i]->name, step, tensors[i]->last_committed);
    }
  }
  if (refused) {
    outcomes.assign(n, *refused);
  } else {
    periodicCheckpoint(step);
    std::vector<std::unique_ptr<StepPipeline>> pipelines;
    pipelines.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      pipelines.push_back(std::make_unique<StepPipeline>(*this, *tensors[i], step, parts[i]));
    }
    outcomes = StepPipeline::runBucket(pipelines);
  }
  // A failed bucket is aborted for every layer, and its header: the other sidecars may wait on
  // any of them.
  const std::string& bucket = parts.front().bucket;
  for (size_t i = 0; i < n; ++i) {
    if (!outcomes[i].ok()) exchange_.abort(tensors[i]->name, step, outcomes[i].message);
  }
  if (!outcomes.front().ok() && !bucket.empty()) {
    exchange_.abort(bucket, step, outcomes.front().message);
  }
  for (size_t i = 0; i < n; ++i) exchange_.stepDone(tensors[i]->name, step);
  if (!bucket.empty()) exchange_.stepDone(bucket, step);
  for (size_t i = 0; i < n; ++i) endStep(*tensors[i], step, parts[i], outcomes[i]);
}

void StepEngine::dropIdleStates(uint64_t step) {
  const uint64_t after = options_.drop_state_after_steps;
  if (after == 0) return;
  std::lock_guard lock(mu_);
  bool dropped = false;
  for (auto& [name, t] : tensors_) {
    const bool holds = t->has_state || t->gpu || !t->host.workspace.empty() ||
                       !t->host.accum.empty() || !t->payloads.empty();
    if (!holds || !t->last_step || *t->last_step >= step || step - *t->last_step < after) continue;
    if (t->running || !t->pending.empty()) continue;
    spdlog::info(
        "tensor '{}': no step since step {}, {} steps before this one (limits.drop_state_after_"
        "steps {}): its codec state ({} bytes) and buffers are dropped; it starts fresh if it "
        "comes back",
        name, *t->last_step, step - *t->last_step, after, t->state_bytes);
    t->state = kernels::CodecState();
    t->has_state = false;
    t->state_on_gpu = false;
    t->gpu.reset();
    t->host = HostBuffers{};
    t->payloads.clear();
    t->state_bytes = 0;
    dropped = true;
  }
  if (dropped) publishStateBytes();
}

void StepEngine::publishStateBytes() {
  uint64_t total = 0;
  for (const auto& [name, t] : tensors_) total += t->state_bytes;
  metrics_.state_bytes.Set(static_cast<double>(total));
}

void StepEngine::endStep(Tensor& t, uint64_t step, Pending& p, const StepOutcome& outcome) {
  std::vector<std::pair<uint64_t, Pending>> overtaken;  // waiting steps this commit dooms
  {
    std::lock_guard lock(mu_);
    t.last_step = step;
    if (outcome.ok()) {
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
    publishStateBytes();
    // The host's step buffers and the GPUs' work areas (docs/metrics.md).
    metrics_.pool_bytes.Set(static_cast<double>(pool_.bytes() + gpu::pooledDeviceBytes()));
  }
  if (outcome.ok()) dropIdleStates(step);
  if (outcome.ok()) {
    (outcome.figures.nonfinite ? metrics_.steps_nonfinite : metrics_.steps_ok).Increment();
  } else {
    metrics_.steps_failed.Increment();
    spdlog::warn("tensor '{}' step {} failed: {}", t.name, step, outcome.message);
  }
  for (size_t k = 0; k < p.dones.size(); ++k) {
    // Device buffers get their result copied back before the reply says it is there.
    std::string why;
    // (The GPU path wrote them in place already.)
    if (outcome.ok() && outcome.figures.device == "cpu" && p.parts[k] && p.parts[k]->store &&
        !p.parts[k]->store(&why)) {
      spdlog::error(
          "tensor '{}' step {}: trainer {}'s result could not be written to its GPU "
          "buffer: {}",
          t.name, step, k, why);
      StepOutcome failed{StepError::kDeviceError,
                         "the result could not be written to the GPU buffer: " + why};
      p.dones[k](failed);
      continue;
    }
    p.dones[k](outcome);
  }
  for (auto& [old_step, old] : overtaken) {
    metrics_.steps_failed.Increment();
    failPending(old, StepError::kConflict,
                "tensor '" + t.name + "' step " + std::to_string(old_step) +
                    " goes backwards: step " + std::to_string(step) + " already completed");
  }
}

void StepEngine::resumePending() {
  if (!pending_resume_) return;
  const uint64_t at = *pending_resume_;
  pending_resume_.reset();
  if (auto st = resumeHere(at); !st.isOk()) {
    spdlog::error("could not resume from step {} as the other sidecars did: {}", at, st.message());
  }
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
    Tensor& t = tensorSlot(name);
    if (!t.last_committed || *t.last_committed < step) {
      t.last_committed = step;
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

boost::json::array StepEngine::streamsJson() const {
  std::lock_guard lock(mu_);
  std::map<std::string, uint64_t> waiting;
  for (const auto& [name, t] : tensors_) {
    for (const auto& [step, p] : t->pending) {
      if (p.order && p.queued) ++waiting[p.order->stream];
    }
  }
  boost::json::array out;
  for (const auto& [name, st] : streams_) {
    boost::json::object o{{"stream", name}};
    o["last"] = st.last ? boost::json::value(boost::json::object{{"iteration", st.last->first},
                                                                 {"position", st.last->second}})
                        : boost::json::value(nullptr);
    o["cancelled_ahead"] = st.cancelled.size();
    o["waiting_steps"] = waiting.contains(name) ? waiting.at(name) : 0;
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
