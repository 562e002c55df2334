#include "proxy/peer/ps_exchange.h"
#include "proxy/peer/ps_util.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>

#include "kernels/philox.h"
#include "kernels/registry.h"
#include "proxy/peer/collective.h"

namespace lightwire::proxy::peer {
namespace {

using Clock = std::chrono::steady_clock;

// Frame phases of the `ps` topology (the ring uses 0, 1 and 2).
constexpr uint8_t kPsPhasePush = 3;       // a rank's payload of one chunk, to the server
constexpr uint8_t kPsPhaseBroadcast = 4;  // the server's combined payload of one chunk, to everyone
constexpr uint8_t kPsPhaseChecksum = 5;   // a rank's result checksum, to the server
constexpr uint8_t kPsPhaseChecksums = 6;  // every rank's checksum, from the server to everyone
constexpr uint8_t kPsPhaseStats = 7;      // a rank's policy statistics record, to the server
constexpr uint8_t kPsPhaseStatsAll = 8;   // the step's statistics records, from the server to all
constexpr uint8_t kRoundChecksum = 0xFF;

// Bounded staleness: how long the server blocks on one missing rank before looking at the others.
constexpr auto kSlice = std::chrono::milliseconds(2);

FrameKey keyOf(uint64_t tensor, uint64_t step, int round, uint8_t phase, uint32_t chunk,
               uint32_t origin) {
  FrameKey k;
  k.tensor = tensor;
  k.step = step;
  k.round = static_cast<uint8_t>(round);
  k.phase = phase;
  k.chunk = chunk;
  k.origin = origin;
  return k;
}

/// Whether this exchange carries statistics records: round 0 with a record of this sidecar's (the
/// engine gives every rank of a job one, or none).
bool carriesStats(const ExchangeRound& r) { return r.round == 0 && !r.stats_out.empty(); }

/// The key of a statistics frame of a step (round 0, chunk 0).
FrameKey statsKey(uint64_t tensor, uint64_t step, uint8_t phase, uint32_t origin) {
  return keyOf(tensor, step, 0, phase, 0, origin);
}

std::string rankList(const std::vector<uint32_t>& ranks) {
  std::string s;
  for (uint32_t r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

}  // namespace

// --- state
// ----------------------------------------------------------------------------------------

/// The server's state of one tensor.
struct PsExchange::ServerTensor {
  // Re-compression: the tensor's codec with momentum 0 (so no bias correction) and clipping off,
  // its own state.
  std::string config_key;
  size_t elements = 0;
  std::shared_ptr<const kernels::Codec> codec;  // also decodes the workers' payloads
  kernels::CodecState state;
  std::vector<std::byte> workspace;
  std::vector<float> sum;

  // Bounded staleness.
  /// Per rank: the latest step whose push the server holds (folded, or kept to be folded).
  std::vector<std::optional<uint64_t>> last_in;
  /// A closed step some ranks had not pushed: their pushes are owed (to be folded when they come).
  struct Owed {
    uint64_t step = 0;
    std::vector<uint32_t> ranks;
    std::shared_ptr<const kernels::Codec> decoder;  // the codec of that step
    kernels::Chunking chunking;                     // and its chunking
  };
  std::vector<Owed> owed;  // ascending step
  /// A late push received, not yet in a committed aggregate. Sorted by (step, rank).
  struct Late {
    uint32_t rank = 0;
    uint64_t step = 0;
    std::vector<std::vector<uint8_t>> chunks;
    std::shared_ptr<const kernels::Codec> decoder;
    kernels::Chunking chunking;
  };
  std::vector<Late> late;

  void dropBacklog(const std::string& name, const char* why) {
    if (!owed.empty() || !late.empty()) {
      spdlog::warn("tensor '{}': {}: {} late contribution(s) held and {} step(s) owed are dropped",
                   name, why, late.size(), owed.size());
    }
    owed.clear();
    late.clear();
  }
};

/// What stepDone() commits on the server for the step whose exchange completed.
struct PsExchange::Pending {
  std::string tensor;
  uint64_t step = 0;
  bool commit_state = false;  // the server codec's state (re-compression, finite sum) ...
  kernels::StepContext ctx;   // ... from this re-compression of the sum: its context and the
  std::vector<std::span<const uint8_t>> sent;  // payloads sent (in held_)
  bool bounded = false;
  std::vector<std::pair<uint32_t, uint64_t>> folded;  // late (rank, step) in the aggregate
  std::vector<uint32_t> ontime, missing;
  std::shared_ptr<const kernels::Codec> decoder;
  kernels::Chunking chunking;
};

PsExchange::PsExchange(Transport& transport, std::chrono::milliseconds timeout, PsOptions options)
    : transport_(transport), timeout_(timeout), options_(options) {}

PsExchange::~PsExchange() = default;

Status PsExchange::fail(uint64_t tensor, uint64_t step, Status s) {
  transport_.abortStep(tensor, step, s.message());
  return s;
}

void PsExchange::abort(const std::string& tensor, uint64_t step, const std::string& reason) {
  const uint64_t key = tensorKey(tensor);
  aborted_ = std::make_pair(key, step);
  transport_.abortStep(key, step, reason);
}

void PsExchange::stepDone(const std::string& tensor, uint64_t step) {
  const uint64_t key = tensorKey(tensor);
  std::optional<uint64_t> discard_to = step;
  auto it = tensors_.find(tensor);
  if (pending_ && pending_->tensor == tensor && pending_->step == step && it != tensors_.end()) {
    const bool aborted = aborted_ && aborted_->first == key && aborted_->second == step;
    ServerTensor& st = *it->second;
    if (!aborted) {
      if (pending_->commit_state) {
        const kernels::ConstTensor input{st.sum.data(), pending_->chunking.elements,
                                         kernels::DType::kF32};
        if (auto s = st.codec->commitState(pending_->ctx, pending_->chunking, input, pending_->sent,
                                           {}, st.state, st.workspace);
            !s.isOk()) {
          spdlog::error("tensor '{}' step {}: the parameter server's codec state is reset: {}",
                        tensor, step, s.message());
          st.state.reset();
        }
      }
      if (pending_->bounded) {
        std::erase_if(st.late, [&](const ServerTensor::Late& l) {
          return std::find(pending_->folded.begin(), pending_->folded.end(),
                           std::make_pair(l.rank, l.step)) != pending_->folded.end();
        });
        for (uint32_t r : pending_->ontime) {
          if (!st.last_in[r] || *st.last_in[r] < step) st.last_in[r] = step;
        }
        if (!pending_->missing.empty()) {
          st.owed.push_back({step, pending_->missing, pending_->decoder, pending_->chunking});
        }
      }
    }
  }
  // Frames of steps whose late pushes are still owed must stay (a late push arrives after the
  // step is over here).
  if (it != tensors_.end() && !it->second->owed.empty()) {
    const uint64_t oldest = it->second->owed.front().step;
    discard_to = oldest == 0 ? std::nullopt : std::optional<uint64_t>(std::min(step, oldest - 1));
  }
  if (discard_to) transport_.discard(key, *discard_to);
  pending_.reset();
  aborted_.reset();
  held_.clear();
}

// --- one exchange
// ---------------------------------------------------------------------------------

Result<PsExchange::Spans> PsExchange::run(ExchangeRound& r) {
  const uint64_t tensor = tensorKey(r.tensor);
  if (r.round == 0) transport_.beginStep(tensor, r.step);
  const auto& traits = r.codec.traits();
  if (options_.server_rank >= transport_.worldSize()) {
    return fail(
        tensor, r.step,
        invalidArgument("peer.ps_rank " + std::to_string(options_.server_rank) +
                        " is not a rank of this job of " + std::to_string(transport_.worldSize())));
  }
  if (options_.bounded_staleness && traits.rounds > 1) {
    return fail(tensor, r.step,
                failedPrecondition(std::string(traits.name) +
                                   " needs peer.synchrony sync (its rounds cannot be averaged "
                                   "over the contributions that arrived)"));
  }
  if (options_.bounded_staleness && !traits.staleness_safe) {
    return fail(tensor, r.step,
                failedPrecondition(std::string(traits.name) +
                                   " needs peer.synchrony sync (its payloads are scaled for one "
                                   "decoding: re-compressing the server's sum would scale it "
                                   "twice)"));
  }
  r.stats_in.clear();
  r.stats_folded = false;
  if (carriesStats(r) && r.stats_out.size() > kMaxStatsBytes) {
    return fail(tensor, r.step,
                invalidArgument("this sidecar's statistics record has " +
                                std::to_string(r.stats_out.size()) + " bytes, more than " +
                                std::to_string(kMaxStatsBytes)));
  }
  auto out = isServer() ? server(r, tensor) : worker(r, tensor);
  if (!out) {
    r.stats_in.clear();
    return fail(tensor, r.step, out.status());
  }
  return out;
}

Result<PsExchange::Spans> PsExchange::worker(ExchangeRound& r, uint64_t tensor) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank(), srv = options_.server_rank;
  const size_t chunks = r.payloads.size();
  const auto deadline = Clock::now() + timeout_;
  const uint8_t codec = static_cast<uint8_t>(r.codec.traits().id);
  const std::string server_name = "the parameter server (rank " + std::to_string(srv) + ")";
  const bool stats = carriesStats(r);
  if (stats) {  // a frame of its own, right before the push (the same TCP connection)
    if (auto s = transport_.send(srv, FrameType::kData, statsKey(tensor, r.step, kPsPhaseStats, me),
                                 0, r.stats_out, deadline);
        !s.isOk()) {
      return withContext("sending the statistics record to " + server_name, s);
    }
  }
  for (size_t c = 0; c < chunks; ++c) {
    if (auto s = transport_.send(
            srv, FrameType::kData,
            keyOf(tensor, r.step, r.round, kPsPhasePush, static_cast<uint32_t>(c), me), codec,
            r.payloads[c], deadline);
        !s.isOk()) {
      return withContext("pushing to " + server_name, s);
    }
  }
  Spans out(chunks);
  std::optional<PsHeader> first;
  for (size_t c = 0; c < chunks; ++c) {
    auto got = transport_.receive(
        srv, keyOf(tensor, r.step, r.round, kPsPhaseBroadcast, static_cast<uint32_t>(c), srv),
        deadline);
    if (!got) return withContext("waiting for " + server_name, got.status());
    if (got->codec != codec) {
      return dataLoss(server_name + " broadcast chunk " + std::to_string(c) + " with codec id " +
                      std::to_string(got->codec) + "; this sidecar uses " + std::to_string(codec) +
                      " (do the sidecars' codec settings differ?)");
    }
    auto h = parsePsHeader(got->payload, w);
    if (!h) return withContext("chunk " + std::to_string(c) + " from " + server_name, h.status());
    if (first && (h->count != first->count || h->ranks != first->ranks)) {
      return dataLoss("chunk " + std::to_string(c) + " from " + server_name +
                      " has a header different from chunk 0's");
    }
    if (!first) first = *h;
    held_.push_back(std::move(got->payload));
    out[c].push_back(std::span<const uint8_t>(held_.back()).subspan(psHeaderBytes(w)));
  }
  if (first && !options_.bounded_staleness &&
      (first->count != w || std::count(first->ranks.begin(), first->ranks.end(), true) != w)) {
    return failedPrecondition(server_name + " sent the sum of " + std::to_string(first->count) +
                              " contribution(s) of a sync step of " + std::to_string(w) +
                              " ranks (does it run peer.synchrony bounded-staleness?)");
  }
  if (stats) {
    // The records of the step's contributors (rank ascending), sent by the server right before
    // its broadcast: already in once the data is.
    auto got = transport_.receive(srv, statsKey(tensor, r.step, kPsPhaseStatsAll, srv), deadline);
    if (!got) {
      return withContext("waiting for the statistics records from " + server_name, got.status());
    }
    auto records = parsePsStats(got->payload, w);
    transport_.recycle(std::move(got->payload));
    if (!records) return withContext("from " + server_name, records.status());
    if (first) {
      for (uint32_t k = 0; k < w; ++k) {
        if ((*records)[k].empty() == first->ranks[k]) {
          return dataLoss(server_name + " sent " +
                          (first->ranks[k] ? std::string("no statistics record")
                                           : std::string("a statistics record")) +
                          " of rank " + std::to_string(k) + ", " +
                          (first->ranks[k] ? "a" : "not a") + " contributor to step " +
                          std::to_string(r.step));
        }
      }
    }
    r.stats_in = std::move(*records);
  }
  if (!first) return out;  // no chunk (not produced by the engine)
  if (!first->ranks[me]) {
    spdlog::debug(
        "tensor '{}' step {}: this sidecar's contribution came late; it is folded into "
        "a later aggregate",
        r.tensor, r.step);
  }
  r.contributors = first->count;
  return out;
}

Status PsExchange::prepareServerCodec(const ExchangeRound& r, ServerTensor& st) {
  kernels::CodecConfig config = r.codec.config();
  config.momentum = 0.0;
  config.bias_correction = false;  // corrects a momentum the server does not have
  config.clip_norm = 0.0;
  const std::string key = kernels::configKey(config);
  const size_t n = r.chunking.elements;
  const bool resized = st.codec && st.elements != n;
  if (resized) {
    st.dropBacklog(r.tensor, "the tensor changed size");
    st.last_in.assign(transport_.worldSize(), std::nullopt);
  }
  if (!st.codec || key != st.config_key) {
    auto made = kernels::createCodec(config);
    if (!made) return invalidArgument("the server's codec: " + made.status().message());
    if (st.codec) {
      spdlog::info(
          "tensor '{}': the parameter server's codec changed to {}; its state starts fresh",
          r.tensor, config.name);
    }
    st.codec = std::shared_ptr<const kernels::Codec>(std::move(*made));
    st.config_key = key;
    st.state = kernels::CodecState(st.codec->stateFloats(n));
  } else if (resized) {
    st.state = kernels::CodecState(st.codec->stateFloats(n));
  }
  st.elements = n;
  if (st.last_in.size() != transport_.worldSize()) {
    st.last_in.assign(transport_.worldSize(), std::nullopt);
  }
  st.workspace.resize(st.codec->workspaceBytes(r.chunking));
  return Status::ok();
}

Status PsExchange::gatherBounded(ExchangeRound& r, uint64_t tensor, ServerTensor& st,
                                 Clock::time_point deadline,
                                 std::vector<std::vector<std::vector<uint8_t>>>& ontime,
                                 std::vector<bool>& present) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  const uint64_t t = r.step;
  const uint8_t codec = static_cast<uint8_t>(r.codec.traits().id);
  const size_t chunks = r.payloads.size();
  auto last_arrival = Clock::now();
  constexpr Clock::time_point kNow{};  // a deadline already past: take only what is kept

  // The rest of a push whose chunk 0 is in (sent right after it, in order).
  auto takeRest = [&](uint32_t rank, uint64_t step, std::vector<uint8_t> first, size_t count,
                      std::vector<std::vector<uint8_t>>& dst) -> Status {
    dst.clear();
    dst.push_back(std::move(first));
    for (size_t c = 1; c < count; ++c) {
      auto f = transport_.receive(
          rank, keyOf(tensor, step, 0, kPsPhasePush, static_cast<uint32_t>(c), rank), deadline);
      if (!f) {
        return withContext("waiting for rank " + std::to_string(rank) + "'s contribution to step " +
                               std::to_string(step),
                           f.status());
      }
      dst.push_back(std::move(f->payload));
    }
    return Status::ok();
  };
  // Late pushes of `rank` that are in: kept to be folded. A rank pushes its steps in order, so an
  // owed step still missing when a later push of the same rank is in (`final`: its push of this
  // step) will never come (the rank did not run it).
  auto drainOwed = [&](uint32_t rank, bool final) -> Status {
    std::vector<uint64_t> absent, never;
    for (auto& o : st.owed) {
      auto pos = std::find(o.ranks.begin(), o.ranks.end(), rank);
      if (pos == o.ranks.end()) continue;
      auto f = transport_.receive(rank, keyOf(tensor, o.step, 0, kPsPhasePush, 0, rank), kNow);
      if (!f) {
        absent.push_back(o.step);
        continue;
      }
      never.insert(never.end(), absent.begin(), absent.end());  // a later push came first
      absent.clear();
      o.ranks.erase(pos);
      ServerTensor::Late late{rank, o.step, {}, o.decoder, o.chunking};
      if (auto s = takeRest(rank, o.step, std::move(f->payload), o.chunking.count(), late.chunks);
          !s.isOk()) {
        spdlog::warn("tensor '{}': the late contribution of rank {} to step {} is dropped: {}",
                     r.tensor, rank, o.step, s.message());
        continue;
      }
      auto at =
          std::upper_bound(st.late.begin(), st.late.end(), late,
                           [](const ServerTensor::Late& a, const ServerTensor::Late& b) {
                             return std::make_pair(a.step, a.rank) < std::make_pair(b.step, b.rank);
                           });
      st.late.insert(at, std::move(late));
      if (!st.last_in[rank] || *st.last_in[rank] < o.step) st.last_in[rank] = o.step;
      last_arrival = Clock::now();
    }
    if (final) never.insert(never.end(), absent.begin(), absent.end());
    for (uint64_t s : never) {
      for (auto& o : st.owed) {
        if (o.step != s) continue;
        std::erase(o.ranks, rank);
        spdlog::warn(
            "tensor '{}': rank {} never pushed step {} (a later push of it came): "
            "nothing of it to fold",
            r.tensor, rank, s);
      }
    }
    std::erase_if(st.owed, [](const ServerTensor::Owed& o) { return o.ranks.empty(); });
    return Status::ok();
  };
  auto takeOntime = [&](uint32_t rank, Frame f) -> Status {
    if (f.codec != codec) {
      return dataLoss("rank " + std::to_string(rank) + " pushed codec id " +
                      std::to_string(f.codec) + "; this sidecar uses " + std::to_string(codec) +
                      " (do the sidecars' codec settings differ?)");
    }
    LW_RETURN_IF_ERROR(takeRest(rank, t, std::move(f.payload), chunks, ontime[rank]));
    present[rank] = true;
    last_arrival = Clock::now();
    return drainOwed(rank, true);
  };
  auto within = [&](uint32_t rank) {
    return st.last_in[rank] && *st.last_in[rank] + options_.staleness >= t;
  };

  for (;;) {
    for (uint32_t k = 0; k < w; ++k) {
      if (k != me && !present[k]) LW_RETURN_IF_ERROR(drainOwed(k, false));
    }
    for (uint32_t k = 0; k < w; ++k) {
      if (k == me || present[k]) continue;
      auto f = transport_.receive(k, keyOf(tensor, t, r.round, kPsPhasePush, 0, k), kNow);
      if (f) LW_RETURN_IF_ERROR(takeOntime(k, std::move(*f)));
    }
    std::vector<uint32_t> missing, beyond;
    for (uint32_t k = 0; k < w; ++k) {
      if (present[k]) continue;
      missing.push_back(k);
      if (!within(k)) beyond.push_back(k);
    }
    if (missing.empty()) return Status::ok();
    const auto now = Clock::now();
    if (beyond.empty() && now - last_arrival >= options_.straggler_wait) {
      spdlog::debug("tensor '{}' step {}: closed without rank(s) {} (within the staleness bound)",
                    r.tensor, t, rankList(missing));
      return Status::ok();
    }
    const auto up = transport_.peersUp();
    for (uint32_t k : missing) {
      if (k < up.size() && !up[k]) {
        return Status(StatusCode::kUnavailable, "waiting for rank " + std::to_string(k) +
                                                    "'s contribution: peer: rank " +
                                                    std::to_string(k) + " is not connected");
      }
    }
    if (now >= deadline) {
      if (beyond.empty()) {  // straggler_wait longer than the deadline
        return Status(StatusCode::kUnavailable,
                      "peer: deadline passed waiting for rank(s) " + rankList(missing) +
                          " (peer.straggler_wait_s is longer than peer.timeout_s)");
      }
      std::string why;
      for (uint32_t k : beyond) {
        why += (why.empty() ? "" : "; ") + std::string("rank ") + std::to_string(k) + "'s " +
               (st.last_in[k] ? "latest contribution is of step " + std::to_string(*st.last_in[k])
                              : std::string("first contribution is missing"));
      }
      return Status(StatusCode::kUnavailable,
                    "peer: deadline passed waiting for rank(s) " + rankList(beyond) +
                        ", beyond the staleness bound " + std::to_string(options_.staleness) +
                        " at step " + std::to_string(t) + " (" + why + ")");
    }
    auto wake = std::min(deadline, now + kSlice);
    if (beyond.empty()) wake = std::min(wake, last_arrival + options_.straggler_wait);
    const uint32_t k = beyond.empty() ? missing.front() : beyond.front();
    auto f = transport_.receive(k, keyOf(tensor, t, r.round, kPsPhasePush, 0, k), wake);
    if (f) {
      LW_RETURN_IF_ERROR(takeOntime(k, std::move(*f)));
    } else if (Clock::now() < wake) {  // not the deadline of this wait: an abort, a peer lost
      return withContext("waiting for rank " + std::to_string(k) + "'s contribution", f.status());
    }
  }
}

// Synchronous steps: every other rank's push of every chunk, in rank order.
Status PsExchange::gatherSync(const ExchangeRound& r, uint64_t tensor, Clock::time_point deadline,
                              OnTime& ontime, std::vector<bool>& present) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  const size_t chunks = r.payloads.size();
  const uint8_t codec = static_cast<uint8_t>(r.codec.traits().id);
  for (uint32_t k = 0; k < w; ++k) {
    if (k == me) continue;
    for (size_t c = 0; c < chunks; ++c) {
      auto f = transport_.receive(
          k, keyOf(tensor, r.step, r.round, kPsPhasePush, static_cast<uint32_t>(c), k), deadline);
      if (!f) {
        return withContext("waiting for rank " + std::to_string(k) + "'s contribution", f.status());
      }
      if (f->codec != codec) {
        return dataLoss("rank " + std::to_string(k) + " pushed codec id " +
                        std::to_string(f->codec) + "; this sidecar uses " + std::to_string(codec) +
                        " (do the sidecars' codec settings differ?)");
      }
      ontime[k].push_back(std::move(f->payload));
    }
    present[k] = true;
  }
  return Status::ok();
}

// The statistics records of this step's contributors (sent right before their pushes).
Status PsExchange::receiveRecords(const ExchangeRound& r, uint64_t tensor,
                                  const std::vector<bool>& present, Clock::time_point deadline,
                                  std::vector<std::vector<uint8_t>>& records) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  records.resize(w);
  records[me].assign(r.stats_out.begin(), r.stats_out.end());
  for (uint32_t k = 0; k < w; ++k) {
    if (k == me || !present[k]) continue;
    auto f = transport_.receive(k, statsKey(tensor, r.step, kPsPhaseStats, k), deadline);
    if (!f) {
      return withContext("waiting for rank " + std::to_string(k) + "'s statistics record",
                         f.status());
    }
    const Status size = checkStatsSize(k, f->payload.size());
    // A copy: the received buffer may be a recycled one much larger than the record.
    if (size.isOk()) records[k].assign(f->payload.begin(), f->payload.end());
    transport_.recycle(std::move(f->payload));
    LW_RETURN_IF_ERROR(size);
  }
  return Status::ok();
}

std::span<const uint8_t> PsExchange::payloadOf(const ExchangeRound& r, const OnTime& ontime,
                                               uint32_t k, size_t c) const {
  return k == transport_.rank() ? r.payloads[c] : std::span<const uint8_t>(ontime[k][c]);
}

// Summable and multi-round codecs: ((p0 + p1) + p2) + ... in the compressed domain.
Status PsExchange::sumCompressed(const ExchangeRound& r, const OnTime& ontime,
                                 std::vector<std::span<const uint8_t>>& combined) {
  const uint32_t w = transport_.worldSize();
  const size_t chunks = r.payloads.size();
  for (size_t c = 0; c < chunks; ++c) {
    std::span<const uint8_t> acc = payloadOf(r, ontime, 0, c);
    for (uint32_t k = 1; k < w; ++k) {
      std::vector<uint8_t> sum(r.codec.maxPayloadBytes(r.chunking.size(c)));
      auto size = r.codec.addPayloads(acc, payloadOf(r, ontime, k, c), sum);
      if (!size) {
        return dataLoss("chunk " + std::to_string(c) + " from rank " + std::to_string(k) +
                        " does not add up: " + size.status().message());
      }
      sum.resize(*size);
      held_.push_back(std::move(sum));
      acc = held_.back();
    }
    combined[c] = acc;
  }
  return Status::ok();
}

// Other codecs: the dense fp32 sum (late contributions in (step, rank) order, then this step's in
// rank order; each chunk decoded with weight 1), re-compressed with the server's codec and state.
Status PsExchange::sumDense(const ExchangeRound& r, ServerTensor& st, const OnTime& ontime,
                            const std::vector<bool>& present, Pending& pending,
                            std::vector<std::span<const uint8_t>>& combined) {
  const uint32_t w = transport_.worldSize();
  const size_t chunks = r.payloads.size();
  // The dense fp32 sum: late contributions in (step, rank) order, then this step's in rank
  // order; each chunk decoded with weight 1.
  const size_t n = r.chunking.elements;
  float* sum = nullptr;
  for (;;) {  // again without a late contribution that does not decode
    st.sum.assign(n, 0.0f);
    sum = st.sum.data();
    size_t bad = st.late.size();
    for (size_t i = 0; i < st.late.size() && bad == st.late.size(); ++i) {
      const auto& l = st.late[i];
      if (l.chunking.elements != n || l.chunks.size() != l.chunking.count()) {
        bad = i;
        break;
      }
      for (size_t c = 0; c < l.chunks.size(); ++c) {
        if (!l.decoder
                 ->decodeChunk(l.chunks[c], 1.0f, sum + l.chunking.begin(c), l.chunking.size(c))
                 .isOk()) {
          bad = i;
          break;
        }
      }
    }
    if (bad == st.late.size()) break;
    spdlog::error(
        "tensor '{}': the late contribution of rank {} to step {} does not decode; "
        "dropped",
        r.tensor, st.late[bad].rank, st.late[bad].step);
    st.late.erase(st.late.begin() + static_cast<std::ptrdiff_t>(bad));
  }
  for (const auto& l : st.late) pending.folded.emplace_back(l.rank, l.step);
  for (uint32_t k = 0; k < w; ++k) {
    if (!present[k]) {
      pending.missing.push_back(k);
      continue;
    }
    pending.ontime.push_back(k);
    for (size_t c = 0; c < chunks; ++c) {
      auto s = st.codec->decodeChunk(payloadOf(r, ontime, k, c), 1.0f, sum + r.chunking.begin(c),
                                     r.chunking.size(c));
      if (!s.isOk()) {
        return dataLoss("chunk " + std::to_string(c) + " from rank " + std::to_string(k) +
                        " does not decode: " + s.message());
      }
    }
  }
  bool finite = true;
  for (size_t i = 0; i < n; ++i) finite &= std::isfinite(sum[i]);
  // Re-compression with the server's codec and state (Philox stream `w`: no worker uses it).
  kernels::StepContext ctx;
  ctx.seed = options_.seed;
  ctx.name_key = kernels::tensorNameKey(r.tensor);
  ctx.step = r.step;
  ctx.rank = w;
  const kernels::ConstTensor input{sum, n, kernels::DType::kF32};
  if (auto s = st.codec->analyze(ctx, r.chunking, input, st.state, st.workspace); !s.isOk()) {
    return internalError("re-compressing the sum: " + s.message());
  }
  for (size_t c = 0; c < chunks; ++c) {
    std::vector<uint8_t> buf(st.codec->maxPayloadBytes(r.chunking.size(c)));
    auto size =
        st.codec->encodeChunk(ctx, r.chunking, c, 0, {}, input, st.state, st.workspace, buf);
    if (!size) return internalError("re-compressing the sum: " + size.status().message());
    buf.resize(*size);
    held_.push_back(std::move(buf));
    combined[c] = held_.back();
  }
  if (!finite) {
    spdlog::warn(
        "tensor '{}' step {}: the sum is not finite; the parameter server's codec "
        "state is not committed",
        r.tensor, r.step);
  }
  pending.commit_state = finite;
  pending.ctx = ctx;
  pending.sent.assign(combined.begin(), combined.end());
  pending.decoder = st.codec;
  pending.chunking = r.chunking;
  return Status::ok();
}

Result<PsExchange::Spans> PsExchange::server(ExchangeRound& r, uint64_t tensor) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  const size_t chunks = r.payloads.size();
  const auto deadline = Clock::now() + timeout_;
  const auto& traits = r.codec.traits();
  const bool bounded = options_.bounded_staleness;
  const bool compressed_sum = !bounded && (traits.summable || traits.rounds > 1);

  auto& slot = tensors_[r.tensor];
  if (!slot) slot = std::make_unique<ServerTensor>();
  ServerTensor& st = *slot;
  if (!compressed_sum) LW_RETURN_IF_ERROR(prepareServerCodec(r, st));

  // ontime[k]: rank k's payload of every chunk (empty for this rank and for missing ranks).
  OnTime ontime(w);
  std::vector<bool> present(w, false);
  present[me] = true;
  if (bounded) {
    LW_RETURN_IF_ERROR(gatherBounded(r, tensor, st, deadline, ontime, present));
  } else {
    LW_RETURN_IF_ERROR(gatherSync(r, tensor, deadline, ontime, present));
  }
  const bool stats = carriesStats(r);
  std::vector<std::vector<uint8_t>> records;
  if (stats) LW_RETURN_IF_ERROR(receiveRecords(r, tensor, present, deadline, records));

  PsHeader header;
  header.ranks = present;
  std::vector<std::span<const uint8_t>> combined(chunks);
  auto pending = std::make_unique<Pending>();
  pending->tensor = r.tensor;
  pending->step = r.step;
  pending->bounded = bounded;
  if (compressed_sum) {
    LW_RETURN_IF_ERROR(sumCompressed(r, ontime, combined));
    header.count = w;
  } else {
    LW_RETURN_IF_ERROR(sumDense(r, st, ontime, present, *pending, combined));
    header.count = static_cast<uint32_t>(pending->folded.size() + pending->ontime.size());
  }

  Spans out(chunks);
  const std::vector<uint8_t> stats_frame = stats ? encodePsStats(records) : std::vector<uint8_t>{};
  LW_RETURN_IF_ERROR(broadcast(r, tensor, header, combined, stats_frame, deadline, out));
  r.contributors = header.count;
  if (stats) r.stats_in = std::move(records);
  pending_ = std::move(pending);
  return out;
}

Status PsExchange::broadcast(const ExchangeRound& r, uint64_t tensor, const PsHeader& header,
                             const std::vector<std::span<const uint8_t>>& combined,
                             std::span<const uint8_t> stats, Clock::time_point deadline,
                             Spans& out) {
  const uint32_t w = transport_.worldSize(), me = transport_.rank();
  const uint8_t codec = static_cast<uint8_t>(r.codec.traits().id);
  if (!stats.empty()) {  // the step's statistics records, right before its first chunk
    for (uint32_t k = 0; k < w; ++k) {
      if (k == me) continue;
      if (auto s =
              transport_.send(k, FrameType::kData, statsKey(tensor, r.step, kPsPhaseStatsAll, me),
                              0, stats, deadline);
          !s.isOk()) {
        return withContext("sending the statistics records to rank " + std::to_string(k), s);
      }
    }
  }
  for (size_t c = 0; c < combined.size(); ++c) {
    std::vector<uint8_t> framed;
    framed.reserve(psHeaderBytes(w) + combined[c].size());
    appendPsHeader(header, framed);
    framed.insert(framed.end(), combined[c].begin(), combined[c].end());
    held_.push_back(std::move(framed));
    const std::span<const uint8_t> full = held_.back();
    out[c].push_back(full.subspan(psHeaderBytes(w)));
    for (uint32_t k = 0; k < w; ++k) {
      if (k == me) continue;
      if (auto s = transport_.send(
              k, FrameType::kData,
              keyOf(tensor, r.step, r.round, kPsPhaseBroadcast, static_cast<uint32_t>(c), me),
              codec, full, deadline);
          !s.isOk()) {
        return withContext("broadcasting to rank " + std::to_string(k), s);
      }
    }
  }
  return Status::ok();
}

// --- result checksums
// -----------------------------------------------------------------------------

Result<std::vector<uint32_t>> PsExchange::compareResults(const std::string& name, uint64_t step,
                                                         uint64_t checksum) {
  const uint64_t tensor = tensorKey(name);
  const uint32_t w = transport_.worldSize(), me = transport_.rank(), srv = options_.server_rank;
  const auto deadline = Clock::now() + timeout_;
  uint8_t mine[8];
  for (int i = 0; i < 8; ++i) mine[i] = static_cast<uint8_t>(checksum >> (8 * i));
  auto fail = [&](Status s) {
    transport_.abortStep(tensor, step, s.message());
    return s;
  };
  std::vector<uint8_t> all(size_t{8} * w);
  if (me == srv) {
    std::memcpy(all.data() + size_t{8} * me, mine, 8);
    for (uint32_t k = 0; k < w; ++k) {
      if (k == me) continue;
      auto got = transport_.receive(k, keyOf(tensor, step, kRoundChecksum, kPsPhaseChecksum, 0, k),
                                    deadline);
      if (!got) return fail(withContext("waiting for rank " + std::to_string(k), got.status()));
      if (got->payload.size() != 8) {
        return fail(dataLoss("result checksum from rank " + std::to_string(k) + " has " +
                             std::to_string(got->payload.size()) + " bytes, not 8"));
      }
      std::memcpy(all.data() + size_t{8} * k, got->payload.data(), 8);
    }
    for (uint32_t k = 0; k < w; ++k) {
      if (k == me) continue;
      if (auto s = transport_.send(k, FrameType::kData,
                                   keyOf(tensor, step, kRoundChecksum, kPsPhaseChecksums, 0, me), 0,
                                   all, deadline);
          !s.isOk()) {
        return fail(withContext("sending the checksums to rank " + std::to_string(k), s));
      }
    }
  } else {
    const std::string server_name = "the parameter server (rank " + std::to_string(srv) + ")";
    if (auto s = transport_.send(srv, FrameType::kData,
                                 keyOf(tensor, step, kRoundChecksum, kPsPhaseChecksum, 0, me), 0,
                                 std::span<const uint8_t>(mine, 8), deadline);
        !s.isOk()) {
      return fail(withContext("sending the result checksum to " + server_name, s));
    }
    auto got = transport_.receive(
        srv, keyOf(tensor, step, kRoundChecksum, kPsPhaseChecksums, 0, srv), deadline);
    if (!got) return fail(withContext("waiting for " + server_name, got.status()));
    if (got->payload.size() != all.size()) {
      return fail(dataLoss("result checksums from " + server_name + " have " +
                           std::to_string(got->payload.size()) + " bytes, not " +
                           std::to_string(all.size())));
    }
    all = std::move(got->payload);
  }
  std::vector<uint32_t> differ;
  for (uint32_t k = 0; k < w; ++k) {
    if (k != me && std::memcmp(all.data() + size_t{8} * k, mine, 8) != 0) differ.push_back(k);
  }
  return differ;
}

}  // namespace lightwire::proxy::peer
