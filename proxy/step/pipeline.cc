#include "proxy/step/pipeline.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

#include "kernels/philox.h"
#include "kernels/registry.h"
#include "proxy/step/gpu_backend.h"
#include "proxy/step/host_backend.h"
#include "proxy/step/tensor.h"

namespace lightwire::proxy {
namespace {

using Clock = std::chrono::steady_clock;
using policies::StepMode;

double microsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

double& duration(StepFigures& fig, metrics::Stage stage) {
  return fig.durations_us[static_cast<size_t>(stage)];
}

}  // namespace

size_t ringChunkElements(const kernels::Codec& codec, size_t n, size_t chunk_elements,
                         uint32_t world, bool global_select) {
  const auto& traits = codec.traits();
  const bool elementwise =
      traits.summable && !traits.sparse && traits.rounds == 1 && !traits.single_chunk;
  if (!(elementwise || global_select) || world < 2 || n <= kRingSplitMinElements ||
      chunk_elements == 0) {
    return chunk_elements;
  }
  const size_t share = std::max<size_t>(kRingSplitMinElements, (n + world - 1) / world);
  return std::min(chunk_elements, share);
}

bool sparseAllreduceIsSmaller(const kernels::Codec& codec, size_t n, uint32_t world,
                              std::optional<double> density) {
  // Per rank: the allgather sends (W − 1) selections, or 2(W − 1)/W dense tensors once it switches
  // to the dense allreduce (W · selection > 2 · dense); the sparse allreduce 2(W − 1)/W
  // selections. So the sparse allreduce moves fewer from W = 3 on, while a selection is smaller
  // than the dense tensor. Nominal sizes (the configuration's), never the data's.
  if (world < 3) return false;
  // `threshold`, whose selection size is not known ahead: the sparse allreduce too. Per rank it
  // sends its one selection (spread over the owners) and receives the global selection's shares,
  // which hold only the entries whose mean reaches the threshold — not more than one rank's
  // selection unless the ranks agree on more — against W − 1 selections gathered.
  if (codec.globalMinKey(world) != 0) return true;
  const auto selection = codec.nominalPayloadBytes(n, density);
  return selection && *selection < kernels::noneCodec().maxPayloadBytes(n);
}

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

StepPipeline::StepPipeline(StepEngine& engine, StepEngine::Tensor& tensor, uint64_t step,
                           StepEngine::Pending& pending)
    : engine_(engine),
      t_(tensor),
      step_(step),
      p_(pending),
      n_(pending.elements),
      trainers_(engine.options_.local_trainers),
      policy_(engine.options_.policy),
      t0_(Clock::now()) {}

// The backend may still hold work of the step (the GPU's stream): it ends before the reply.
StepPipeline::~StepPipeline() = default;

StepOutcome StepPipeline::run() {
  if (auto stop = beforeExchange()) return stopped(std::move(*stop));
  if (plan_.mode == StepMode::kSkip) return skipped();
  if (auto stop = beginExchange()) return stopped(std::move(*stop));
  for (int r = 0; r < rounds_; ++r) {
    if (auto stop = exchangeRound(r)) return stopped(std::move(*stop));
  }
  endExchange();
  measureLink(engine_, modelBytes(), exchange_us_);
  if (auto stop = afterExchange()) return stopped(std::move(*stop));
  if (auto stop = writeBack()) return stopped(std::move(*stop));
  commit();
  record();
  return std::move(out_);
}

double StepPipeline::modelBytes() const {
  if (!step_codec_) return 0;
  // At the step's own density: in the DGC warm-up a selection codec sends several times its
  // nominal payload, and the link estimate must see those bytes, not the nominal ones.
  return policies::modelBytes(*step_codec_, n_, p_.shape, engine_.exchange_.worldSize(),
                              ctx_.density);
}

void StepPipeline::measureLink(StepEngine& engine, double bytes, double exchange_us) {
  if (engine.exchange_.worldSize() > 1) engine.link_.add(bytes, exchange_us * 1e-6);
}

std::vector<StepOutcome> StepPipeline::runBucket(
    std::vector<std::unique_ptr<StepPipeline>>& pipelines) {
  const size_t n = pipelines.size();
  std::vector<StepOutcome> out(n);
  if (n == 0) return out;
  Exchange& exchange = pipelines.front()->engine_.exchange_;
  // The first failure fails the bucket; `done` marks the layers without an exchange (a local
  // accumulation step of delayed sync), which accumulate only once the others wrote back.
  std::optional<Stop> failed;
  std::vector<char> done(n, 0);
  auto fail = [&](size_t i, Stop stop) {
    stop.message = "layer '" + pipelines[i]->t_.name + "': " + stop.message;
    failed = std::move(stop);
  };
  for (size_t i = 0; i < n && !failed; ++i) {
    StepPipeline& p = *pipelines[i];
    p.defer_accumulation_ = true;
    if (auto stop = p.beforeExchange()) {
      fail(i, std::move(*stop));
    } else if (p.plan_.mode == StepMode::kSkip) {
      done[i] = 1;
    } else if (auto stop2 = p.beginExchange()) {
      fail(i, std::move(*stop2));
    }
  }
  // Round by round, every layer that has that round in one exchange.
  for (int r = 0; !failed; ++r) {
    std::vector<size_t> in_round;
    std::vector<ExchangeRound*> rounds;
    for (size_t i = 0; i < n && !failed; ++i) {
      StepPipeline& p = *pipelines[i];
      if (done[i] || r >= p.rounds_) continue;
      if (auto stop = p.openRound(r)) {
        fail(i, std::move(*stop));
        break;
      }
      in_round.push_back(i);
      rounds.push_back(&*p.round_);
    }
    if (failed || rounds.empty()) break;
    // Round 0 carries the bucket's layout, which every sidecar checks against every other's.
    const StepEngine::Pending& first = pipelines.front()->p_;
    std::optional<BucketTag> tag;
    if (r == 0 && !first.bucket.empty()) {
      tag = BucketTag{first.bucket, first.layout_hash, first.bucket_layers};
    }
    auto got = exchange.runAll(rounds, tag ? &*tag : nullptr);
    for (size_t k = 0; k < in_round.size() && !failed; ++k) {
      StepPipeline& p = *pipelines[in_round[k]];
      auto mine =
          got ? Result<std::vector<std::vector<std::span<const uint8_t>>>>(std::move((*got)[k]))
              : Result<std::vector<std::vector<std::span<const uint8_t>>>>(got.status());
      if (auto stop = p.closeRound(r, std::move(mine))) fail(in_round[k], std::move(*stop));
    }
  }
  // The bucket's layers went through one exchange: one measurement of the link, of all their
  // bytes in the longest layer's time.
  double bytes = 0, exchange_us = 0;
  for (size_t i = 0; i < n && !failed; ++i) {
    if (done[i]) continue;
    pipelines[i]->endExchange();
    bytes += pipelines[i]->modelBytes();
    exchange_us = std::max(exchange_us, pipelines[i]->exchange_us_);
  }
  if (!failed && bytes > 0) measureLink(pipelines.front()->engine_, bytes, exchange_us);
  for (size_t i = 0; i < n && !failed; ++i) {
    if (done[i]) continue;
    if (auto stop = pipelines[i]->afterExchange()) fail(i, std::move(*stop));
  }
  // Every layer got through its exchange and the stages after it: now each writes back (which
  // may fail: a device error), and only once every layer has, all of them commit (which cannot).
  for (size_t i = 0; i < n && !failed; ++i) {
    if (done[i]) continue;
    if (auto stop = pipelines[i]->writeBack()) fail(i, std::move(*stop));
  }
  // The delayed-sync layers' accumulations, then the commits: neither can fail on the host, where
  // every delayed-sync tensor runs (plan()), so a bucket changes every layer's state or none.
  for (size_t i = 0; i < n && !failed; ++i) {
    if (!done[i]) continue;
    if (auto stop = pipelines[i]->accumulate()) fail(i, std::move(*stop));
  }
  for (size_t i = 0; i < n && !failed; ++i) {
    if (!done[i]) pipelines[i]->commit();
  }
  for (size_t i = 0; i < n; ++i) {
    if (failed) {
      out[i] = pipelines[i]->stopped(*failed);
    } else if (done[i]) {
      out[i] = pipelines[i]->skipped();
    } else {
      pipelines[i]->record();
      out[i] = std::move(pipelines[i]->out_);
    }
  }
  return out;
}

StepPipeline::Stage StepPipeline::beforeExchange() {
  if (auto stop = checkBuffers()) return stop;
  if (auto stop = plan()) return stop;
  if (auto stop = begin()) return stop;
  if (auto stop = ingest()) return stop;
  if (plan_.mode == StepMode::kSkip) return std::nullopt;
  if (auto stop = prepare()) return stop;
  return statistics();
}

StepPipeline::Stage StepPipeline::afterExchange() {
  noteSparseChoice();
  if (auto stop = decode()) return stop;
  if (auto stop = guard()) return stop;
  return policies();
}

// peer.sparse auto: a layer's collective moved (a schedule's density changed the sizes, or its
// first step): into the decision log (identical on every rank: the choice is the configuration's,
// and the last one is policy state, which a rejoining sidecar takes from its peers), or the log
// without policies. Steps after the exchange run in bucket order on one thread.
void StepPipeline::noteSparseChoice() {
  if (!sparse_choice_) return;
  if (!policy_ && t_.sparse_allreduce == sparse_choice_) return;
  t_.sparse_allreduce = sparse_choice_;
  auto detail = [this] {
    const uint32_t world = engine_.exchange_.worldSize();
    const std::string selecting =
        step_codec_->globalMinKey(world) != 0
            ? fmt::format("{} keeping the entries whose mean reaches its threshold, of {} elements",
                          step_codec_->traits().name, n_)
            : fmt::format("{} selecting {} of {} elements", step_codec_->traits().name,
                          step_codec_->selectionCount(n_, ctx_.density), n_);
    return fmt::format("{} ({}, {} sidecars; peer.sparse auto)",
                       *sparse_choice_ ? "sparse allreduce" : "allgather", selecting, world);
  };
  if (policy_) {
    policy_->noteExchange(step_, t_.name, *sparse_choice_, detail);
  } else {
    spdlog::info("tensor '{}' step {}: exchange: {}", t_.name, step_, detail());
  }
}

StepOutcome StepPipeline::stopped(Stop stop) {
  out_.error = stop.error;
  out_.message = std::move(stop.message);
  return std::move(out_);
}

StepPipeline::Stage StepPipeline::checkBuffers() {
  for (auto& part : p_.parts) {
    if (part->still_valid && !part->still_valid()) {
      return Stop{StepError::kConflict,
                  "trainer " + std::to_string(part->spec.trainer) +
                      "'s buffer no longer holds its registered size (was it truncated?)"};
    }
  }
  return std::nullopt;
}

// The settings of this tensor (the agreed settings version) and what the policies make of this
// step; then its codec and its state.
StepPipeline::Stage StepPipeline::plan() {
  const TensorFacts facts{t_.name, n_, p_.shape, p_.layer};
  {
    std::lock_guard lock(engine_.mu_);
    settings_ = engine_.chooser_(facts);
  }
  if (policy_) {
    auto [version, json] = policy_->settingsAt(step_);
    if (version > 0 && engine_.options_.settings) {
      if (!engine_.settings_chooser_ || engine_.settings_version_ != version) {
        engine_.settings_chooser_ = engine_.options_.settings(version, json);
        engine_.settings_version_ = version;
      }
      if (engine_.settings_chooser_) settings_ = engine_.settings_chooser_(facts);
    }
    if (settings_.codec.name == "auto") {
      // codec: auto (docs/policies.md): the rung in force for this layer; the step before a
      // switch away from a rung whose codec holds state flushes it (a full-sync).
      auto_ = policy_->autoStep(t_.name, step_);
      if (!auto_->rung) return Stop{StepError::kInternal, "codec auto: no ladder configured"};
      settings_.codec = auto_->rung->codec;
      if (settings_.group.empty()) settings_.group = "auto";
      out_.figures.rung = auto_->rung->text;
    }
    plan_ = policy_->plan(t_.name, step_, settings_.codec, settings_.sync_every);
    plan_.settings = version;
    if (auto_ && auto_->flush && plan_.mode != StepMode::kSkip) plan_.mode = StepMode::kFullSync;
    if (const auto traits = kernels::findCodecTraits(settings_.codec.name);
        traits && traits->uses_min_magnitude) {
      settings_.codec.min_magnitude = plan_.min_magnitude;
    }
  }
  StepFigures& fig = out_.figures;
  if (!policy_ && settings_.codec.name == "auto") {
    return Stop{StepError::kInternal, "codec auto needs the policies (their statistics)"};
  }
  fig.mode = policies::stepModeName(plan_.mode);
  fig.settings = plan_.settings;
  // The tensor's per-group gauges, looked up once per group change, not every step.
  const std::string& group = settings_.group.empty() ? settings_.codec.name : settings_.group;
  if (t_.gauges.group != group || !t_.gauges.ratio) {
    metrics::Metrics& m = engine_.metrics_;
    t_.gauges = {group, &m.compressionRatio(group), &m.cosineSimilarity(group),
                 &m.residualNorm(group)};
  }
  if (auto stop = makeCodec()) return stop;
  // The GPU backend (docs/cuda.md "Steps on the GPU") when every trainer hands device memory and
  // the codec runs there; else the host, device memory staged through `data`. Delayed-sync
  // tensors stay on the host: their accumulation lives there, with checkpoints.
  if (engine_.options_.gpu && settings_.sync_every <= 1 && plan_.mode != StepMode::kSkip &&
      !plan_.delayed_sync_step) {
    std::vector<const Contribution*> parts;
    for (const auto& part : p_.parts) parts.push_back(&*part);
    gpu_ordinal_ = gpu::eligibleDevice(parts, settings_.codec.name);
  }
  if (auto stop = makeState()) return stop;
  fig.codec = t_.codec->traits().name;
  if (t_.codec->traits().id == kernels::CodecId::kDgc) fig.momentum = settings_.codec.momentum;
  fig.elements = n_;
  fig.raw_bytes = n_ * kernels::dtypeSize(p_.dtype);
  return std::nullopt;
}

// The tensor's codec, with fresh state when the codec or the tensor's size or dtype changed.
StepPipeline::Stage StepPipeline::makeCodec() {
  const kernels::CodecConfig& config = settings_.codec;
  const std::string key = kernels::configKey(config);
  StepFigures& fig = out_.figures;
  if (!t_.codec || key != t_.config_key) {
    auto codec = kernels::createCodec(config);
    if (!codec) return Stop{StepError::kInternal, "codec settings: " + codec.status().message()};
    // Codec state restored from a checkpoint is kept when it is of these very settings.
    const bool restored = !t_.codec && t_.has_state && key == t_.config_key;
    if (t_.codec) {
      spdlog::info("tensor '{}': codec changed to {}, its codec state starts fresh", t_.name,
                   config.name);
      fig.state_reset = true;
    } else if (t_.has_state && !restored) {
      spdlog::warn(
          "tensor '{}': the restored codec state is of other settings ({}), not {}: it "
          "starts fresh",
          t_.name, t_.config_key, key);
      fig.state_reset = true;
    }
    t_.codec = std::move(*codec);
    t_.config_key = key;
    if (!restored) t_.has_state = false;
  }
  if (t_.has_state && (t_.state_elements != n_ || t_.state_dtype != p_.dtype)) {
    spdlog::info("tensor '{}' changed from {} to {} elements ({}): its codec state starts fresh",
                 t_.name, t_.state_elements, n_, apiDTypeName(p_.dtype));
    fig.state_reset = true;
    t_.has_state = false;
  } else if (t_.has_state && t_.state_floats != t_.codec->stateFloats(n_, p_.shape)) {
    // PowerSGD's state ends with the warm start of its matrix view, which the shape decides: the
    // state is made again at its new size (within the budget), its error kept and its warm start
    // drawn afresh, as any change of view does (docs/determinism.md "4.12 `powersgd`").
    if (t_.state_on_gpu) {
      auto host = gpu::downloadState(*t_.gpu);
      if (host) {
        carried_ = std::move(*host);
      } else {
        spdlog::warn(
            "tensor '{}' changed its shape and its codec state could not be read from "
            "the device ({}): it starts fresh",
            t_.name, host.status().message());
        fig.state_reset = true;
      }
    } else {
      carried_ = std::move(t_.state);
    }
    spdlog::info(
        "tensor '{}' changed its shape: its codec state keeps the error, the warm start "
        "is drawn afresh",
        t_.name);
    t_.has_state = false;
  }
  return std::nullopt;
}

// Fresh codec state, within limits.max_state_bytes (on the GPU backend it is made on the device).
// The cap covers the codec state of every tensor and the step buffers of the engine's pool
// together (docs/deploy.md "Sizing"): a tensor whose needs change (first seen, a size, dtype or
// settings change, a rollback, an `auto` switch: each makes its state afresh here) is checked
// against what the others hold, and refused with nothing changed.
StepPipeline::Stage StepPipeline::makeState() {
  if (t_.has_state) return std::nullopt;
  const kernels::Codec& codec = *t_.codec;
  // One copy of the state on either backend. The host's steps take a result buffer (the codec's
  // work area) and, with several trainers or a narrow dtype, a local sum from the pool; the
  // device's a work area from its own pool (docs/cuda.md "Memory").
  const uint64_t floats = codec.stateFloats(n_, p_.shape);
  const uint64_t need = floats * sizeof(float);
  const bool own_result = !resultInPlace(trainers_, p_.dtype, codec.traits().rounds, floats > 0);
  const bool own_sum = !inputIsTrainers(trainers_, p_.dtype);
  const uint64_t step_need =
      gpu_ordinal_ ? gpu::workAreaBytes(settings_.codec, n_, p_.shape)
                   : ((own_result ? 1 : 0) + (own_sum ? 1 : 0)) * uint64_t{n_} * sizeof(float);
  const uint64_t cap = engine_.options_.max_state_bytes;
  if (cap > 0 && need + step_need > 0) {
    uint64_t held = 0;
    {
      std::lock_guard lock(engine_.mu_);
      for (const auto& [name, other] : engine_.tensors_) {
        if (other.get() != &t_) held += other->state_bytes;
      }
    }
    const uint64_t pooled = engine_.pool_.bytes();
    if (held + need + std::max(pooled, step_need) > cap) {
      t_.state = kernels::CodecState();  // nothing held for it
      engine_.metrics_.limitHits("state_bytes").Increment();
      return Stop{StepError::kStateLimit,
                  "tensor '" + t_.name + "' needs " + std::to_string(need) +
                      " bytes of codec state and " + std::to_string(step_need) +
                      " bytes of step buffers; other tensors hold " + std::to_string(held) +
                      " bytes of state and the step pool " + std::to_string(pooled) +
                      ": more than limits.max_state_bytes (" + std::to_string(cap) + ")"};
    }
  }
  if (carried_.floats() > 0) {  // the step moves it to the device when it runs there
    carried_.resize(floats, n_);
    t_.state = std::move(carried_);
    carried_ = kernels::CodecState();
  } else {
    t_.state = gpu_ordinal_ ? kernels::CodecState() : kernels::CodecState(floats);
  }
  t_.state_on_gpu = false;
  t_.state_elements = n_;
  t_.state_floats = floats;
  t_.state_dtype = p_.dtype;
  t_.has_state = true;
  if (out_.figures.state_reset) engine_.metrics_.state_resets.Increment();
  return std::nullopt;
}

// The backend of this step. The codec state moves to where the step runs when it is elsewhere.
StepPipeline::Stage StepPipeline::begin() {
  std::vector<Contribution*> parts;
  for (auto& part : p_.parts) parts.push_back(&*part);
  if (gpu_ordinal_) {
    auto begun = gpu::GpuStep::begin(t_.gpu, *gpu_ordinal_, settings_.codec, parts, n_, p_.shape,
                                     p_.dtype, t_.state_on_gpu ? nullptr : &t_.state);
    if (!begun) {
      // A fresh state was never made on the host: make it afresh on the next step.
      if (!t_.state_on_gpu && t_.state.floats() != t_.state_floats) {
        t_.has_state = false;
      }
      return Stop{StepError::kDeviceError, begun.status().message()};
    }
    backend_ = std::move(*begun);
    if (!t_.state_on_gpu) {
      t_.state = kernels::CodecState();
      t_.state_on_gpu = true;
    }
    out_.figures.device = backend_->deviceName();
    return std::nullopt;
  }
  if (t_.state_on_gpu) {
    // The tensor's state moves to the host (its trainers no longer all hand device memory).
    auto host = gpu::downloadState(*t_.gpu);
    if (!host) return Stop{StepError::kDeviceError, host.status().message()};
    t_.state = std::move(*host);
    t_.state_on_gpu = false;
  }
  for (auto* part : parts) {
    if (std::string why; part->fetch && !part->fetch(&why)) {
      return Stop{StepError::kDeviceError, "trainer " + std::to_string(part->spec.trainer) +
                                               "'s GPU buffer could not be read: " + why};
    }
  }
  backend_ = std::make_unique<HostBackend>(engine_.stream_, *t_.codec, t_.state, t_.host,
                                           engine_.pool_, std::move(parts), n_, p_.dtype);
  return std::nullopt;
}

// The sum of the local trainers' tensors, in trainer order (deterministic). Delayed sync (a
// rule's sync_every): between its exchange steps a tensor is accumulated locally and the trainers
// get zeros; the exchange step sends the accumulation too.
StepPipeline::Stage StepPipeline::ingest() {
  if (auto st = backend_->ingest(); !st.isOk()) return backendFailed(st);
  if (plan_.mode == StepMode::kSkip) {
    return defer_accumulation_ ? std::nullopt : accumulate();
  }
  if (plan_.delayed_sync_step) {
    if (auto st = backend_->addAccumulation(); !st.isOk()) return backendFailed(st);
  }
  duration(out_.figures, metrics::Stage::kIngest) = microsSince(t0_);
  return std::nullopt;
}

// A delayed-sync step between its exchange steps: the local sum joins the accumulation, and the
// trainers' tensors become zeros.
StepPipeline::Stage StepPipeline::accumulate() {
  if (auto st = backend_->accumulate(); !st.isOk()) return backendFailed(st);
  return std::nullopt;
}

StepOutcome StepPipeline::skipped() {
  engine_.metrics_.skipped_steps.Increment();
  duration(out_.figures, metrics::Stage::kTotal) = microsSince(t0_);
  return std::move(out_);
}

// The step's context and schedules; bypass and full-sync steps exchange dense fp32 (codec
// `none`), and a full sync first flushes what the codec state holds back into what it sends.
StepPipeline::Stage StepPipeline::prepare() {
  const kernels::Codec& codec = *t_.codec;
  const EngineOptions& options = engine_.options_;
  ctx_.seed = options.seed;
  ctx_.name_key = kernels::tensorNameKey(t_.name);
  ctx_.step = step_;
  ctx_.rank = options.rank;
  ctx_.stream = &engine_.stream_;
  ctx_.shape = p_.shape;
  // Schedules: the policies' density, or (without policies) the warm-up density where it asks
  // for more than the codec's own.
  if (policy_) {
    ctx_.density = plan_.density;
  } else if (codec.traits().uses_density) {
    const auto& cc = codec.config();
    const double target = cc.density ? *cc.density : (cc.ratio ? 1.0 / *cc.ratio : 1.0);
    if (const auto d = policies::warmupDensity(step_, options.warmup_steps); d && *d > target) {
      ctx_.density = *d;
    }
  }
  dense_step_ = plan_.mode == StepMode::kBypass || plan_.mode == StepMode::kFullSync;
  // A sparse allreduce (docs/exchange.md "Sparse allreduce") where everything allows it: the
  // codec selects, the exchange and the backend (the host's) do their part, and there is more
  // than one sidecar. Encoding defers the effect of sending to the settling after the exchange.
  const uint32_t world = engine_.exchange_.worldSize();
  select_globally_ = options.sparse != EngineOptions::Sparse::kAllgather && !dense_step_ &&
                     codec.selectsGlobally() && engine_.exchange_.selectsGlobally() && world > 1 &&
                     backend_->settlesChunks();
  sparse_choice_.reset();
  if (select_globally_ && options.sparse == EngineOptions::Sparse::kAuto) {
    select_globally_ = sparseAllreduceIsSmaller(codec, n_, world, ctx_.density);
    sparse_choice_ = select_globally_;
  }
  ctx_.defer_sent = select_globally_;
  chunking_ = kernels::chunkingFor(
      codec, n_, ringChunkElements(codec, n_, options.chunk_elements, world, select_globally_));
  // PowerSGD's start step (docs/policies.md "Schedules"): dense until then, the state untouched,
  // so that the factorisation starts from a gradient past the first, fastest-changing steps.
  if (codec.traits().id == kernels::CodecId::kPowersgd && step_ < options.powersgd_start_step &&
      plan_.mode == StepMode::kCompressed) {
    dense_step_ = true;
    out_.figures.mode = "dense";
  }
  if (plan_.mode == StepMode::kFullSync) {
    if (auto st = backend_->flush(ctx_, chunking_); !st.isOk()) return backendFailed(st);
  }
  step_codec_ = dense_step_ ? &kernels::noneCodec() : &codec;
  if (dense_step_) ctx_.density.reset();
  return std::nullopt;
}

// This sidecar's statistics record, carried by the exchange to every rank (policies).
StepPipeline::Stage StepPipeline::statistics() {
  if (!policy_) return std::nullopt;
  auto got = backend_->stats(plan_.min_magnitude, policy_->config().adaptive);
  if (!got) return backendFailed(got.status());
  policies::StepStats st = std::move(*got);
  // The residual's norm feeds a gauge only: a tensor of more than 256 Ki elements has it
  // measured every 8th step (a pass over the state), smaller ones every step.
  if (n_ <= (size_t{1} << 18) || step_ % 8 == 0 || !t_.residual_norm2) {
    auto r2 = backend_->residualNorm2();
    if (!r2) return backendFailed(r2.status());
    t_.residual_norm2 = *r2;
  }
  st.residual_norm2 = *t_.residual_norm2;
  // codec: auto's inputs: the link as measured here, the trainers' compute (the least any local
  // trainer reported: the exchange must hide behind every one's).
  if (const auto link = engine_.link_.estimate()) {
    st.link_bytes_per_s = link->bytes_per_s;
    st.link_latency_s = link->latency_s;
  }
  // The declared momentum, when every local trainer declared the same.
  st.momentum = p_.parts.empty() ? std::nullopt : p_.parts.front()->spec.momentum;
  for (const auto& part : p_.parts) {
    const TensorSpec& s = part->spec;
    if (s.momentum != st.momentum) st.momentum.reset();
    if (s.direct_s) st.direct_s = std::max(st.direct_s.value_or(0.0), *s.direct_s);
    if (s.tail_s) st.tail_s = std::max(st.tail_s.value_or(0.0), *s.tail_s);
    if (!s.compute_s || !s.overlap_s) continue;
    st.compute_s = std::min(st.compute_s.value_or(INFINITY), *s.compute_s);
    st.overlap_s = std::min(st.overlap_s.value_or(INFINITY), std::min(*s.overlap_s, *s.compute_s));
  }
  if (t_.cos) {
    st.cos_dot = t_.cos->dot;
    st.cos_c2 = t_.cos->c2;
    st.cos_g2 = t_.cos->g2;
  }
  record_ = policy_->record(std::move(st));
  return std::nullopt;
}

// Compress (the whole-tensor phase — error feedback, momentum, thresholds — is part of it) and
// exchange, round by round for multi-round codecs: beginExchange(), each round (exchangeRound()
// alone, or opened and closed around a bucket's Exchange::runAll), endExchange().
StepPipeline::Stage StepPipeline::beginExchange() {
  const auto ta = Clock::now();
  if (auto st = backend_->analyze(ctx_, chunking_, dense_step_); !st.isOk()) {
    return backendFailed(st);
  }
  compress_us_ = microsSince(ta);
  rounds_ = step_codec_->traits().rounds;
  // Payload buffers live with the tensor: allocated (and faulted in) once, not every step.
  t_.payloads.resize(static_cast<size_t>(rounds_));
  // One fp32 trainer whose step has one round: decode straight into its buffer (its values were
  // read by the encoder already), which saves a pass over the result.
  const bool in_place = resultInPlace(trainers_, p_.dtype, rounds_, false);
  if (auto st = backend_->prepareResult(in_place); !st.isOk()) return backendFailed(st);
  decoded_.assign(chunking_.count(), 0);
  contributors_ = engine_.exchange_.worldSize();
  return std::nullopt;
}

void StepPipeline::endExchange() {
  duration(out_.figures, metrics::Stage::kCompress) = compress_us_;
  duration(out_.figures, metrics::Stage::kExchange) = exchange_us_;
}

// Compresses chunk `chunk` of round `round` once (each chunk is encoded at most once per
// analyze()); the exchange may call it from its own thread (ExchangeRound::encode).
Result<std::span<const uint8_t>> StepPipeline::encode(int round, size_t chunk) {
  const size_t chunks = chunking_.count();
  if (chunk >= chunks) return internalError("chunk " + std::to_string(chunk) + " out of range");
  if (encoded_[chunk]) return mine_[chunk];
  const auto tc = Clock::now();
  auto& bufs = t_.payloads[static_cast<size_t>(round)];
  const std::span<const uint8_t> previous =
      round > 0 ? round_payloads_.back() : std::span<const uint8_t>();
  auto payload = backend_->encodeChunk(ctx_, chunking_, chunk, round, previous, bufs[chunk]);
  if (!payload) return payload.status();
  mine_[chunk] = *payload;
  encoded_[chunk] = 1;
  out_.figures.wire_bytes += mine_[chunk].size();
  // The sampled cosine of this step: one chunk (which one turns with the step), decoded back
  // right after it is encoded, against what it was encoded from. A health signal, not worth a
  // decode of a large chunk every step: tensors of more than 256 Ki elements are sampled every
  // 4th step. Codec `none` is lossless (its cosine is 1 by construction): never sampled.
  const uint64_t every = n_ > (size_t{1} << 18) ? 4 : 1;
  if (policy_ && round == 0 && rounds_ == 1 && plan_.mode == StepMode::kCompressed &&
      step_codec_->traits().id != kernels::CodecId::kNone && step_ % every == 0 &&
      chunk == (step_ / every) % chunks) {
    auto original = backend_->chunkInput(chunking_, chunk, t_.original);
    if (!original) return original.status();
    cos_ = cosineTerms(*step_codec_, mine_[chunk], *original, chunking_.size(chunk), t_.scratch);
  }
  round_compress_us_ += microsSince(tc);
  return mine_[chunk];
}

StepPipeline::Stage StepPipeline::exchangeRound(int r) {
  if (auto stop = openRound(r)) return stop;
  return closeRound(r, engine_.exchange_.run(*round_));
}

StepPipeline::Stage StepPipeline::openRound(int r) {
  Exchange& exchange = engine_.exchange_;
  const size_t chunks = chunking_.count();
  t_.payloads[static_cast<size_t>(r)].resize(chunks);
  mine_.assign(chunks, {});
  encoded_.assign(chunks, 0);
  round_compress_us_ = 0.0;
  const bool lazy = exchange.encodesLazily();
  if (!lazy) {
    for (size_t c = 0; c < chunks; ++c) {
      if (auto p = encode(r, c); !p) return Stop{backend_->failure(), p.status().message()};
    }
  }
  round_.emplace(
      ExchangeRound{t_.name, step_, r, *step_codec_, chunking_,
                    lazy ? std::span<const std::span<const uint8_t>>{} : std::span(mine_)});
  ExchangeRound& er = *round_;
  er.density = ctx_.density;
  er.select_globally = select_globally_;
  if (rounds_ == 1 && backend_->decodesDuringExchange()) {
    // A chunk whose payloads are final is decoded at once, while later chunks still travel.
    er.on_chunk = [this, chunks, &exchange](
                      size_t c, std::span<const std::span<const uint8_t>> list) -> Status {
      if (c >= chunks || decoded_[c]) return internalError("chunk decoded twice or unknown");
      const auto td = Clock::now();
      const float w = 1.0f / static_cast<float>(exchange.worldSize() * trainers_);
      const Status st = backend_->decodeChunk(chunking_, c, list, round_->dense, w);
      early_decode_us_ += microsSince(td);
      if (!st.isOk()) {
        return dataLoss("decompressing: chunk " + std::to_string(c) + ": " + st.message());
      }
      decoded_[c] = 1;
      return Status::ok();
    };
  }
  if (lazy) er.encode = [this, r](size_t c) { return encode(r, c); };
  // Codec `none` without state on the host: its payload is the input's bytes behind a header, so
  // the ring may add the input itself where it only adds (no copy into a payload).
  if (lazy && rounds_ == 1 && step_codec_->traits().id == kernels::CodecId::kNone &&
      step_codec_->stateFloats(n_) == 0) {
    if (const float* in = backend_->hostInput()) {
      er.raw = [this, in](size_t c) { return in + chunking_.begin(c); };
    }
  }
  if (r == 0) {
    er.stats_out = record_;
    er.stats_fold = &policies::foldStats;
  }
  round_started_ = Clock::now();
  return std::nullopt;
}

StepPipeline::Stage StepPipeline::closeRound(
    int r, Result<std::vector<std::vector<std::span<const uint8_t>>>> got) {
  const size_t chunks = chunking_.count();
  const bool lazy = engine_.exchange_.encodesLazily();
  ExchangeRound& er = *round_;
  if (r == 0) {
    stats_in_ = std::move(er.stats_in);
    stats_folded_ = er.stats_folded;
  }
  const double round_us = microsSince(round_started_);
  if (!got) return Stop{StepError::kExchangeFailed, got.status().message()};
  // Every chunk's state update happens in its encode: none may be left out — but a chunk the
  // ring added as raw values (stateless `none`) has no update and no payload to make: it counts
  // the payload it stood for.
  for (size_t c = 0; c < chunks; ++c) {
    if (c < er.raw_used.size() && er.raw_used[c] && !encoded_[c]) {
      encoded_[c] = 1;
      out_.figures.wire_bytes += step_codec_->maxPayloadBytes(chunking_.size(c));
      continue;
    }
    if (auto p = encode(r, c); !p) return Stop{backend_->failure(), p.status().message()};
  }
  compress_us_ += round_compress_us_;
  exchange_us_ += std::max(0.0, round_us - (lazy ? round_compress_us_ : 0.0) - early_decode_us_);
  if (er.contributors > 0) contributors_ = er.contributors;
  if (er.dense && rounds_ > 1) {
    return Stop{StepError::kInternal, "a multi-round codec's exchange returned dense payloads"};
  }
  dense_result_ = er.dense;
  if (rounds_ > 1) {
    if (got->size() != 1 || (*got)[0].size() != 1) {
      return Stop{StepError::kInternal,
                  "multi-round codec exchange returned more than one payload"};
    }
    round_payloads_.push_back((*got)[0][0]);
  } else {
    reduced_ = std::move(*got);
  }
  return select_globally_ ? settle() : std::nullopt;
}

// A global selection (docs/exchange.md "Sparse allreduce"): at commit each chunk's state gives up
// what this sidecar sent and the selection kept; the rest stays in it. Checked here, so that the
// commit, which cannot fail, does not meet a bad selection.
StepPipeline::Stage StepPipeline::settle() {
  for (size_t c = 0; c < chunking_.count(); ++c) {
    if (c >= reduced_.size() || reduced_[c].size() != 1) {
      return Stop{StepError::kInternal,
                  "a sparse allreduce returned other than one selection for "
                  "chunk " +
                      std::to_string(c)};
    }
    if (auto st = backend_->checkSelection(chunking_, c, mine_[c], reduced_[c][0]); !st.isOk()) {
      return Stop{StepError::kExchangeFailed, st.message()};
    }
  }
  selected_.clear();
  for (const auto& list : reduced_) selected_.push_back(list[0]);
  return std::nullopt;
}

// Decompress and average over every trainer of every sidecar, each chunk checked for non-finite
// values as soon as it is decoded. A sparse allgather the exchange switched to a dense allreduce
// returns plain fp32 sums.
StepPipeline::Stage StepPipeline::decode() {
  const auto t2 = Clock::now();
  const float weight = 1.0f / static_cast<float>(contributors_ * trainers_);
  if (rounds_ > 1) {
    if (auto st = backend_->decodeRounds(ctx_, chunking_, round_payloads_, weight); !st.isOk()) {
      return backendFailed(st);
    }
  } else if (auto st = backend_->decodeChunks(chunking_, reduced_, decoded_, dense_result_, weight);
             !st.isOk()) {
    return Stop{StepError::kExchangeFailed, "decompressing: " + st.message()};
  }
  auto bad = backend_->resultNonfinite();
  if (!bad) return backendFailed(bad.status());
  nonfinite_ = *bad;
  duration(out_.figures, metrics::Stage::kDecompress) = microsSince(t2) + early_decode_us_;
  return std::nullopt;
}

// Silent-divergence guard: every checksum_every steps the ranks compare their results.
StepPipeline::Stage StepPipeline::guard() {
  Exchange& exchange = engine_.exchange_;
  const uint64_t every = engine_.options_.checksum_every;
  if (exchange.worldSize() <= 1 || every == 0 || step_ % every != 0) return std::nullopt;
  auto checksum = backend_->resultChecksum();
  if (!checksum) return backendFailed(checksum.status());
  auto differ = exchange.compareResults(t_.name, step_, *checksum);
  if (!differ) {
    return Stop{StepError::kExchangeFailed, "comparing results: " + differ.status().message()};
  }
  if (!differ->empty()) {
    std::string ranks;
    for (uint32_t r : *differ) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    engine_.metrics_.result_mismatches.Increment();
    if (policy_) policy_->forceFullSync(t_.name, step_);
    spdlog::error(
        "tensor '{}' step {}: the result differs from rank(s) {} (checksum {:016x}): "
        "the sidecars have diverged",
        t_.name, step_, ranks, *checksum);
  }
  return std::nullopt;
}

// The policies: every rank aggregates the same records and decides alike. Checkpoints asked for
// are saved first, with the state as it stood before this step.
StepPipeline::Stage StepPipeline::policies() {
  if (!policy_) return std::nullopt;
  auto g = !stats_folded_          ? policies::aggregate(stats_in_)
           : stats_in_.size() == 1 ? policies::finishStats(stats_in_[0])
                                   : Result<policies::GlobalStats>(internalError(
                                         "the exchange folded the statistics into " +
                                         std::to_string(stats_in_.size()) + " entries, not 1"));
  if (!g) return Stop{StepError::kExchangeFailed, "statistics: " + g.status().message()};
  if (auto m = policies::resumeMismatch(*g)) {
    // POST /v1/resume reached some sidecars only: the others resume from the same step now
    // (from their own checkpoint of it), so the step after this failed one agrees again.
    std::optional<uint64_t> newest;
    for (const auto& r : g->resumed_from) {
      if (r && (!newest || *r > *newest)) newest = *r;
    }
    auto& pending_resume = engine_.pending_resume_;
    if (newest && policy_->resumedFrom() != newest) pending_resume = *newest;
    return Stop{StepError::kResumeMismatch,
                *m + (pending_resume ? "; this sidecar resumes from step " +
                                           std::to_string(*pending_resume) + " now"
                                     : std::string())};
  }
  for (const auto& q : g->requests) {
    if (q.kind != policies::Request::Kind::kCheckpoint) continue;
    if (q.origin == engine_.options_.rank) continue;  // saved when it was asked for
    if (auto saved = engine_.saveCheckpoint(q.step, "trainer"); !saved) {
      spdlog::error("checkpoint of step {} asked for by rank {}: {}", q.step, q.origin,
                    saved.status().message());
    }
  }
  // Non-finite values in some rank's gradient that did not make it into the result (a codec
  // that did not select them) count too: the global statistics say so on every rank alike.
  nonfinite_ = nonfinite_ || g->nonfinite > 0;
  if (auto_) {
    const policies::AutoFacts facts{n_, p_.shape, engine_.exchange_.worldSize(), settings_.group};
    policy_->update(t_.name, step_, plan_, *g, &facts);
  } else {
    policy_->update(t_.name, step_, plan_, *g);
  }
  if (const auto w = policy_->directWindowAfter(step_)) {
    out_.figures.direct = std::make_pair(w->from, w->until);
  }
  if (const auto c = g->cosine()) t_.gauges.cosine->Set(*c);
  t_.gauges.residual->Set(std::sqrt(g->residual_norm2));
  return std::nullopt;
}

// The result goes to the trainer's buffer (the backend's write-back, which may fail: a device
// error). Nothing is committed yet: a failed write-back fails the step with the state unchanged.
StepPipeline::Stage StepPipeline::writeBack() {
  out_.figures.nonfinite = nonfinite_;
  if (auto st = backend_->writeBack(); !st.isOk()) return backendFailed(st);
  return std::nullopt;
}

// Non-finite results are returned as plain averaging would, and the state is not committed.
// Compressed steps apply the step to the codec state in place (docs/determinism.md "4.7 Atomic
// steps without a second copy"); full-syncs leave it as after a flush; bypasses leave the state
// as it was. A commit cannot fail (backend.h), so a bucket's layers commit all or none.
void StepPipeline::commit() {
  backend_->commit({.state = !nonfinite_ && plan_.mode != StepMode::kBypass,
                    .sent = mine_,
                    .selected = selected_});
  // A measured cosine goes out with the tensor's next record, once.
  if (!nonfinite_ && plan_.mode == StepMode::kCompressed) t_.cos = cos_;
}

void StepPipeline::record() {
  StepFigures& fig = out_.figures;
  duration(fig, metrics::Stage::kTotal) = microsSince(t0_);
  metrics::Metrics& m = engine_.metrics_;
  m.raw_bytes.Increment(static_cast<double>(fig.raw_bytes));
  for (size_t s = 0; s < metrics::kStageCount; ++s) {
    m.stage(static_cast<metrics::Stage>(s)).Observe(fig.durations_us[s] * 1e-6);
  }
  if (fig.wire_bytes > 0) {
    t_.gauges.ratio->Set(static_cast<double>(fig.raw_bytes) / static_cast<double>(fig.wire_bytes));
  }
}

}  // namespace lightwire::proxy
