// Checkpoint and resume orchestration of the step engine (docs/policies.md "Durable state:
// checkpoints"): what a checkpoint holds of every tensor, where files go and how many are kept, and
// how a sidecar resumes from one (POST /v1/resume, a peer's resume, a restart). Files themselves:
// policies/checkpoint.h. Everything here runs between steps (StepEngine::runBetweenSteps) or
// after shutdown, never during a step.

#include <spdlog/spdlog.h>

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <algorithm>

#include "policies/checkpoint.h"
#include "proxy/step/engine.h"
#include "proxy/step/gpu_backend.h"
#include "proxy/step/tensor.h"

namespace lightwire::proxy {

using kernels::DType;

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
      const auto& accum = t->host.accum;
      if (std::any_of(accum.begin(), accum.end(), [](float v) { return v != 0.0f; })) {
        ct.accumulator = accum;
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
      Tensor& t = tensorSlot(ct.name);
      t.codec.reset();  // re-created from the settings at the next step; state kept if they match
      t.cos.reset();
      t.has_state = !ct.codec_key.empty();
      t.config_key = ct.codec_key;
      t.state_elements = ct.elements;
      t.state_floats = ct.state.size();
      t.state_dtype = static_cast<DType>(ct.dtype);
      t.state = kernels::CodecState(ct.state.size());
      if (!ct.state.empty()) LW_RETURN_IF_ERROR(t.state.restore(ct.state));
      t.state_on_gpu = false;  // a GPU step moves it back to the device
      t.state_bytes = t.state.bytes();
      t.host.accum = ct.accumulator;
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
    failPending(p, StepError::kConflict,
                "tensor '" + what + " was pending when the sidecar resumed");
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
    // The trainers number their buckets afresh from here (docs/api.md "Buckets in flight").
    streams_.clear();
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

}  // namespace lightwire::proxy
