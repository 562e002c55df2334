#include "proxy/peer/session.h"

#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <future>

#include "metrics/metrics.h"

namespace lightwire::proxy::peer {

PeerSession::PeerSession(const SessionOptions& options, metrics::Metrics& metrics)
    : options_(options),
      metrics_(metrics),
      mail_(options.max_kept_bytes_per_peer, options.max_kept_frames_per_peer) {}

// --- start ---------------------------------------------------------------------------------------

Status PeerSession::checkMembership(Membership& m,
                                    const std::function<Status(Membership&)>& rendezvous) {
  if (m.world_size == 0 || m.rank >= m.world_size) {
    return invalidArgument(
        fmt::format("peer: rank {} outside world size {}", m.rank, m.world_size));
  }
  const bool with_rendezvous = !m.rendezvous.empty();
  if (with_rendezvous) {
    LW_RETURN_IF_ERROR(rendezvous(m));
  } else if (m.peers.size() != m.world_size) {
    return invalidArgument(
        fmt::format("peer: {} peer addresses for world size {}", m.peers.size(), m.world_size));
  }
  if (m.job_id.empty()) return invalidArgument("peer: empty job id");
  if (m.secret.empty()) return invalidArgument("peer: empty job secret");
  for (uint32_t r = 0; r < m.world_size && !with_rendezvous; ++r) {
    std::string host;
    uint16_t port = 0;
    if (!parseHostPort(m.peers[r], host, port)) {
      return invalidArgument(fmt::format("peer: bad address '{}' of rank {}", m.peers[r], r));
    }
  }
  return Status::ok();
}

void PeerSession::begin(Membership m) {
  job_hash_ = peer::jobHash(m.job_id);
  membership_ = std::move(m);
  mail_.reset(membership_.world_size, membership_.rank);
  links_.assign(membership_.world_size, nullptr);
  markAllDown();
}

void PeerSession::markAllDown() {
  for (uint32_t r = 0; r < mail_.size(); ++r) {
    if (r != membership_.rank) metrics_.peerUp(r).Set(0);
  }
}

bool PeerSession::initiates(uint32_t a, uint32_t b) const {
  if (rendezvousMode() && (a == 0 || b == 0)) return b == 0;
  return a < b;
}

std::array<uint8_t, kHeaderBytes> PeerSession::header(FrameType type, const FrameKey& key,
                                                      uint8_t codec,
                                                      std::span<const uint8_t> payload) const {
  return encodeHeader(makeHeader(type, key, codec, job_hash_, membership_.rank, payload));
}

std::shared_ptr<SendOp> PeerSession::ownedOp(FrameType type, const FrameKey& key,
                                             std::vector<uint8_t> payload) const {
  auto op = std::make_shared<SendOp>();
  op->header = header(type, key, 0, payload);
  op->owned = std::move(payload);
  op->payload = op->owned;
  return op;
}

// --- handshake -----------------------------------------------------------------------------------

Result<std::array<uint8_t, kHelloBytes>> PeerSession::hello(ClientHandshake& hs,
                                                            uint32_t server) const {
  auto nonce = randomNonce();
  if (!nonce) return nonce.status();
  hs.server = server;
  hs.client_nonce = *nonce;
  return encodeHello(Hello{membership_.world_size, server, *nonce});
}

Result<Mac> PeerSession::answerChallenge(const ClientHandshake& hs,
                                         std::span<const uint8_t> challenge) const {
  const Membership& m = membership_;
  Nonce server_nonce{};
  std::copy_n(challenge.begin(), kNonceBytes, server_nonce.begin());
  const Mac expected = handshakeMac(MacRole::kServer, m.secret, m.job_id, hs.client_nonce,
                                    server_nonce, m.rank, hs.server, m.world_size);
  if (!macEqual(expected, challenge.subspan(kNonceBytes))) {
    return failedPrecondition(fmt::format(
        "rank {} failed to prove knowledge of the job secret (wrong secret?)", hs.server));
  }
  return handshakeMac(MacRole::kClient, m.secret, m.job_id, hs.client_nonce, server_nonce, m.rank,
                      hs.server, m.world_size);
}

Result<std::array<uint8_t, kChallengeBytes>> PeerSession::answerHello(
    ServerHandshake& hs, const std::string& name, uint32_t client,
    std::span<const uint8_t> payload) const {
  const Membership& m = membership_;
  const Hello hello = decodeHello(payload);
  if (hello.world_size != m.world_size) {
    return failedPrecondition(fmt::format("{} claims rank {} of world size {}, ours is {}", name,
                                          client, hello.world_size, m.world_size));
  }
  if (hello.dst != m.rank) {
    return failedPrecondition(fmt::format("{} (rank {}) meant to reach rank {}, we are {}", name,
                                          client, hello.dst, m.rank));
  }
  if (!initiates(client, m.rank)) return failedPrecondition(wrong_direction_(name, client));
  {
    std::lock_guard lock(mutex());
    if (mail_.upLocked(client)) {
      return failedPrecondition(fmt::format(
          "{} claims rank {}, which is already connected (duplicate rank)", name, client));
    }
  }
  auto nonce = randomNonce();
  if (!nonce) return nonce.status();
  hs.client = client;
  hs.client_nonce = hello.nonce;
  hs.server_nonce = *nonce;
  const Mac proof = handshakeMac(MacRole::kServer, m.secret, m.job_id, hello.nonce, *nonce, client,
                                 m.rank, m.world_size);
  std::array<uint8_t, kChallengeBytes> challenge{};
  std::copy(nonce->begin(), nonce->end(), challenge.begin());
  std::copy(proof.begin(), proof.end(), challenge.begin() + kNonceBytes);
  return challenge;
}

Status PeerSession::checkAuth(const ServerHandshake& hs, const std::string& name,
                              std::span<const uint8_t> auth) const {
  const Membership& m = membership_;
  const Mac expected = handshakeMac(MacRole::kClient, m.secret, m.job_id, hs.client_nonce,
                                    hs.server_nonce, hs.client, m.rank, m.world_size);
  if (!macEqual(expected, auth)) {
    return failedPrecondition(
        fmt::format("{} (rank {}) failed to prove knowledge of the job secret (wrong secret?)",
                    name, hs.client));
  }
  return Status::ok();
}

Status PeerSession::install(const std::shared_ptr<Link>& link, uint32_t peer,
                            const std::string& detail) {
  {
    std::lock_guard lock(mutex());
    if (mail_.upLocked(peer)) {
      return failedPrecondition(fmt::format("duplicate rank {}: already connected", peer));
    }
    link->peer = peer;
    link->name = fmt::format("rank {}", peer);
    link->last_rx = Clock::now();
    links_[peer] = link;
    mail_.markUpLocked(peer);
  }
  metrics_.peerUp(peer).Set(1);
  spdlog::info("peer: connected to rank {} ({})", peer, detail);
  return Status::ok();
}

void PeerSession::greet(const std::shared_ptr<Link>& link) {
  if (provide_state_) link->sendOwned(FrameType::kState, {}, provide_state_());
}

void PeerSession::linkClosed(const std::shared_ptr<Link>& link, const std::string& reason) {
  if (link->peer == kNoPeer) return;
  bool was_current = false;
  {
    std::lock_guard lock(mutex());
    if (links_[link->peer] == link) {
      was_current = true;
      links_[link->peer].reset();
      mail_.markDownLocked(link->peer, reason);
    }
  }
  if (was_current) {
    metrics_.peerUp(link->peer).Set(0);
    if (!stopping_) spdlog::warn("peer: connection to rank {} lost: {}", link->peer, reason);
  }
}

void PeerSession::noteRefused(const std::string& address, const Status& why) {
  if (stopping_) return;
  metrics_.auth_failures.Increment();
  spdlog::warn("peer: refused connection with {}: {}", address, why.message());
}

bool PeerSession::noteHandshakeCap() {
  metrics_.limitHits("peer_handshakes").Increment();
  const auto now = Clock::now();
  if (now - last_handshake_warning_ <= std::chrono::seconds(10)) return false;
  last_handshake_warning_ = now;
  return true;
}

// --- receiving -----------------------------------------------------------------------------------

Status PeerSession::checkNotHandshake(FrameType type, const std::string& name) {
  if (type == FrameType::kHello || type == FrameType::kChallenge || type == FrameType::kAuth) {
    return dataLoss(fmt::format("malformed frame from {}: unexpected {} frame after the handshake",
                                name, frameTypeName(type)));
  }
  return Status::ok();
}

Status PeerSession::unexpectedFrame(const std::string& name, FrameType got, FrameType want) {
  return failedPrecondition(fmt::format("{} sent a {} frame, expected {}", name, frameTypeName(got),
                                        frameTypeName(want)));
}

void PeerSession::dispatch(const std::shared_ptr<Link>& link, const FrameHeader& h,
                           std::vector<uint8_t> payload) {
  switch (h.type) {
    case FrameType::kData:
      mail_.deliver(Frame{h.type, h.key, h.src, h.codec, std::move(payload)});
      break;
    case FrameType::kAbort:
      mail_.deliverAbort(h.src, h.key.tensor, h.key.step,
                         std::string(payload.begin(), payload.end()));
      break;
    case FrameType::kPing:
      // The pong carries the ping's bytes in a buffer of their own: the received one came from
      // the receive pool (it may be a large frame's, lent to this small one) and goes back to it.
      link->sendOwned(FrameType::kPong, {}, std::vector<uint8_t>(payload.begin(), payload.end()));
      break;
    case FrameType::kState:
      if (take_state_) take_state_(h.src, payload);
      break;
    case FrameType::kRegister:
    case FrameType::kPeers:
      if (rendezvous_) {
        rendezvous_(link, h, payload);
      } else {
        link->close(
            fmt::format("malformed frame from {}: unexpected {} frame (this job has no "
                        "rendezvous)",
                        link->name, frameTypeName(h.type)));
      }
      break;
    case FrameType::kPong:
      onPong(h.src, payload);
      break;
    default:
      break;
  }
  // Every frame's buffer came from the receive pool: a data frame's goes back once its consumer
  // is done with it, every other one's now. A buffer not given back takes its capacity out of the
  // pool for good, and the next large frame needs a new allocation (the heap churns).
  if (h.type != FrameType::kData) mail_.recycle(std::move(payload));
}

void PeerSession::onPong(uint32_t src, const std::vector<uint8_t>& payload) {
  uint64_t sent = 0;
  for (size_t i = 0; i < kPingBytes; ++i) sent |= uint64_t{payload[i]} << (8 * i);
  const uint64_t now = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  if (now >= sent) metrics_.peerRtt(src).Set(static_cast<double>(now - sent) * 1e-9);
}

bool PeerSession::keepAlive(const std::shared_ptr<Link>& link, Clock::time_point now) {
  static_assert(std::is_same_v<Clock::duration, std::chrono::nanoseconds>);
  const auto silent = now - link->last_rx;
  if (silent > options_.peer_timeout) {
    link->close(fmt::format("{} silent for {} ms", link->name,
                            std::chrono::duration_cast<std::chrono::milliseconds>(silent).count()));
    return false;
  }
  std::vector<uint8_t> ts(kPingBytes);
  const uint64_t t = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  for (size_t i = 0; i < kPingBytes; ++i) ts[i] = static_cast<uint8_t>(t >> (8 * i));
  link->sendOwned(FrameType::kPing, {}, std::move(ts));
  return true;
}

// --- sending -------------------------------------------------------------------------------------

void PeerSession::complete(const std::shared_ptr<SendOp>& op, std::string error) {
  if (error.empty() && op->data) metrics_.data_frames_sent.Increment();
  std::lock_guard lock(mutex());
  op->done = true;
  op->error = std::move(error);
  mail_.cv().notify_all();
}

void PeerSession::completeTimedOut(const std::shared_ptr<SendOp>& op) {
  std::lock_guard lock(mutex());
  op->done = true;
  op->timed_out = true;
  op->error = "deadline passed";
  mail_.cv().notify_all();
}

Result<std::shared_ptr<SendOp>> PeerSession::queueFrame(uint32_t dst, FrameType type,
                                                        const FrameKey& key, uint8_t codec,
                                                        std::span<const uint8_t> payload,
                                                        std::vector<uint8_t>* owned) {
  if (!started_) return failedPrecondition("peer: send before start()");
  LW_RETURN_IF_ERROR(mail_.checkSend(dst, type, payload.size(), options_.max_frame_bytes));
  auto op = std::make_shared<SendOp>();
  op->header = header(type, key, codec, payload);
  op->dst = dst;
  op->data = type == FrameType::kData;
  {
    std::lock_guard lock(mutex());
    op->link = links_[dst];
    if (!op->link) return mail_.notConnectedLocked(dst);
  }
  if (owned != nullptr) {  // a moved vector keeps its bytes where they were: `payload` stays valid
    op->owned = std::move(*owned);
    op->give_back = true;
  }
  op->payload = payload;
  op->link->post(op);
  return op;
}

Status PeerSession::awaitFrames(std::vector<std::shared_ptr<SendOp>>& ops,
                                Clock::time_point deadline) {
  auto all_done = [&] {
    return std::all_of(ops.begin(), ops.end(), [](const auto& op) { return op->done; });
  };
  std::unique_lock lock(mutex());
  if (!mail_.cv().wait_until(lock, deadline, all_done)) {
    // Payloads are lent: every frame must be out of its queue (or its link closed, since a frame
    // cannot be abandoned half-written) before returning.
    lock.unlock();
    post_([ops] {
      for (const auto& op : ops) op->link->abandon(op);
    });
    lock.lock();
    mail_.cv().wait(lock, all_done);
  }
  Status first = Status::ok();
  for (const auto& op : ops) {
    if (op->error.empty()) continue;
    first = op->timed_out
                ? Status(StatusCode::kUnavailable,
                         fmt::format("peer: send of {} bytes to rank {} did not finish before "
                                     "its deadline",
                                     op->payload.size(), op->dst))
                : Status(StatusCode::kUnavailable, "peer: " + op->error);
    break;
  }
  ops.clear();
  return first;
}

Status PeerSession::send(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                         std::span<const uint8_t> payload, Clock::time_point deadline) {
  auto op = queueFrame(dst, type, key, codec, payload);
  if (!op) return op.status();
  std::vector<std::shared_ptr<SendOp>> one{std::move(*op)};
  return awaitFrames(one, deadline);
}

Status PeerSession::post(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                         std::span<const uint8_t> payload, std::vector<uint8_t>* owned) {
  auto op = queueFrame(dst, type, key, codec, payload, owned);
  if (!op) return op.status();
  std::lock_guard lock(posted_mu_);
  posted_.push_back(std::move(*op));
  return Status::ok();
}

Status PeerSession::postOwned(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                              std::vector<uint8_t> payload) {
  const std::span<const uint8_t> bytes = payload;
  return post(dst, type, key, codec, bytes, &payload);
}

void PeerSession::reclaim() {
  std::vector<std::vector<uint8_t>> written;
  {
    std::lock_guard posted(posted_mu_);
    std::lock_guard lock(mutex());
    // Failed frames stay for flush(), which reports them.
    std::erase_if(posted_, [&](std::shared_ptr<SendOp>& op) {
      if (!op->give_back || !op->done || !op->error.empty()) return false;
      written.push_back(std::move(op->owned));
      return true;
    });
  }
  for (auto& b : written) mail_.recycle(std::move(b));
}

Status PeerSession::flush(Clock::time_point deadline) {
  std::vector<std::shared_ptr<SendOp>> ops;
  {
    std::lock_guard lock(posted_mu_);
    ops.swap(posted_);
  }
  if (ops.empty()) return Status::ok();
  std::vector<std::shared_ptr<SendOp>> owning;
  for (const auto& op : ops) {
    if (op->give_back) owning.push_back(op);
  }
  Status st = awaitFrames(ops, deadline);
  for (const auto& op : owning) mail_.recycle(std::move(op->owned));
  return st;
}

Result<Frame> PeerSession::receive(uint32_t src, const FrameKey& key, Clock::time_point deadline) {
  if (!started_) return failedPrecondition("peer: receive before start()");
  return mail_.receive(src, key, deadline);
}

Result<std::optional<Frame>> PeerSession::receiveOrWake(uint32_t src, const FrameKey& key,
                                                        const Wake& wake,
                                                        Clock::time_point deadline) {
  if (!started_) return failedPrecondition("peer: receive before start()");
  return mail_.receiveOrWake(src, key, &wake, deadline);
}

std::vector<std::shared_ptr<Link>> PeerSession::upLinks() const {
  std::vector<std::shared_ptr<Link>> up;
  std::lock_guard lock(mutex());
  for (const auto& link : links_) {
    if (link) up.push_back(link);
  }
  return up;
}

void PeerSession::abortStep(uint64_t tensor, uint64_t step, const std::string& reason) {
  if (!started_) return;
  std::vector<uint8_t> payload(reason.begin(), reason.end());
  if (payload.size() > 4096) payload.resize(4096);  // a reason, not a payload
  // The caller fails the step right after this, and its trainer may then send the same step to
  // another sidecar: the ABORT frames are handed to the links (on an idle link, written) before
  // this returns, so that they travel ahead of that request (docs/exchange.md "Failure"). A
  // busy link thread delays the failure by kAbortQueued at most; it never blocks the step.
  auto queued = std::make_shared<std::promise<void>>();
  std::future<void> done = queued->get_future();
  post_([this, tensor, step, payload = std::move(payload), queued] {
    FrameKey key;
    key.tensor = tensor;
    key.step = step;
    for (auto& link : upLinks()) link->sendOwned(FrameType::kAbort, key, payload);
    queued->set_value();
  });
  done.wait_for(kAbortQueued);
}

void PeerSession::broadcastState() {
  if (!started_ || !provide_state_) return;
  post_([this, state = provide_state_()] {
    for (auto& link : upLinks()) link->sendOwned(FrameType::kState, {}, state);
  });
}

void PeerSession::setJobState(std::function<std::vector<uint8_t>()> provide,
                              std::function<void(uint32_t, std::span<const uint8_t>)> take) {
  provide_state_ = std::move(provide);
  take_state_ = std::move(take);
}

// --- SessionTransport ----------------------------------------------------------------------------

uint32_t SessionTransport::rank() const { return session_.membership().rank; }
uint32_t SessionTransport::worldSize() const { return session_.membership().world_size; }

Status SessionTransport::send(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                              std::span<const uint8_t> payload,
                              std::chrono::steady_clock::time_point deadline) {
  return session_.send(dst, type, key, codec, payload, deadline);
}

Status SessionTransport::post(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                              std::span<const uint8_t> payload,
                              std::chrono::steady_clock::time_point /*deadline*/) {
  return session_.post(dst, type, key, codec, payload);
}

Status SessionTransport::flush(std::chrono::steady_clock::time_point deadline) {
  return session_.flush(deadline);
}

void SessionTransport::recycle(std::vector<uint8_t> buffer) {
  session_.mail().recycle(std::move(buffer));
}

Status SessionTransport::postOwned(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                                   std::vector<uint8_t> payload,
                                   std::chrono::steady_clock::time_point /*deadline*/) {
  return session_.postOwned(dst, type, key, codec, std::move(payload));
}

void SessionTransport::reclaim() { session_.reclaim(); }

std::vector<uint8_t> SessionTransport::takeBuffer(size_t n) {
  return session_.mail().takeBuffer(n);
}

uint64_t SessionTransport::pooledBytes() { return session_.mail().pooledBytes(); }

Result<Frame> SessionTransport::receive(uint32_t src, const FrameKey& key,
                                        std::chrono::steady_clock::time_point deadline) {
  return session_.receive(src, key, deadline);
}

Result<std::optional<Frame>> SessionTransport::receiveOrWake(
    uint32_t src, const FrameKey& key, const Wake& wake,
    std::chrono::steady_clock::time_point deadline) {
  return session_.receiveOrWake(src, key, wake, deadline);
}

void SessionTransport::abortStep(uint64_t tensor, uint64_t step, const std::string& reason) {
  session_.abortStep(tensor, step, reason);
}

void SessionTransport::discard(uint64_t tensor, uint64_t step) {
  session_.mail().discard(tensor, step);
}

void SessionTransport::beginStep(uint64_t tensor, uint64_t step) {
  session_.mail().beginStep(tensor, step);
}

void SessionTransport::broadcastState() { session_.broadcastState(); }

void SessionTransport::setJobState(std::function<std::vector<uint8_t>()> provide,
                                   std::function<void(uint32_t, std::span<const uint8_t>)> take) {
  session_.setJobState(std::move(provide), std::move(take));
}

bool SessionTransport::allConnected() const { return session_.allConnected(); }

std::vector<bool> SessionTransport::peersUp() const { return session_.mail().peersUp(); }

}  // namespace lightwire::proxy::peer
