#include "proxy/peer/ucx_transport.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "metrics/metrics.h"
#include "proxy/peer/mailbox.h"

namespace lightwire::proxy::peer {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr uint32_t kNoPeer = UINT32_MAX;
constexpr unsigned kAmId = 1;  // every lightwire frame is an active message with this id
// The progress thread never sleeps longer than this (timers are checked at least this often).
constexpr milliseconds kMaxSleep{100};
// At shutdown, how long closing endpoints may take before the worker is destroyed anyway.
constexpr milliseconds kCloseGrace{2000};

std::string ucsText(ucs_status_t s) { return ucs_status_string(s); }

bool parseHostPort(const std::string& s, std::string& host, uint16_t& port) {
  auto colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) return false;
  host = s.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const char* b = s.data() + colon + 1;
  const char* e = s.data() + s.size();
  auto [p, err] = std::from_chars(b, e, port);
  return err == std::errc() && p == e && port != 0;
}

struct SockAddr {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

/// host:port to a socket address (getaddrinfo; `numeric`: no name lookup).
Result<SockAddr> resolve(const std::string& host, uint16_t port, bool numeric) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (numeric ? AI_NUMERICHOST | AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0 || !res) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("cannot resolve '{}': {}", host, ::gai_strerror(rc)));
  }
  SockAddr a;
  std::memcpy(&a.storage, res->ai_addr, res->ai_addrlen);
  a.length = res->ai_addrlen;
  ::freeaddrinfo(res);
  return a;
}

std::string sockaddrName(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(ss);
    ::inet_ntop(AF_INET, &in.sin_addr, buf, sizeof(buf));
    return fmt::format("{}:{}", buf, ntohs(in.sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(ss);
    ::inet_ntop(AF_INET6, &in6.sin6_addr, buf, sizeof(buf));
    return fmt::format("[{}]:{}", buf, ntohs(in6.sin6_port));
  }
  return "unknown address";
}

uint16_t sockaddrPort(const sockaddr_storage& ss) {
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(ss).sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(ss).sin6_port);
  return 0;
}

enum class Phase {
  kConnecting,  // client: endpoint created, HELLO not yet out (connect_timeout)
  kHandshake,   // HELLO .. AUTH (handshake_timeout)
  kUp,          // authenticated
  kClosed,
};

/// One ucp endpoint, before and after its handshake. Touched on the progress thread only.
struct Conn {
  uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  bool client = false;             // we connected (to `target`)
  uint32_t target = kNoPeer;       // client: the rank dialled
  uint32_t peer = kNoPeer;         // set once authenticated
  uint32_t client_rank = kNoPeer;  // server: the rank HELLO claimed (CHALLENGE sent)
  Phase phase = Phase::kConnecting;
  std::string name;  // "rank N (address)" or the remote address, for messages
  std::string address;
  Clock::time_point deadline{};  // of the current phase, until up
  Clock::time_point last_rx = Clock::now();
  Clock::time_point next_ping{};
  Nonce client_nonce{};
  Nonce server_nonce{};
};

}  // namespace

struct UcxTransport::Impl {
  Impl(const UcxOptions& o, metrics::Metrics& m)
      : options(o),
        metrics(m),
        mail(o.max_kept_bytes_per_peer, o.max_kept_frames_per_peer),
        mu(mail.mutex()),
        cv(mail.cv()) {}
  ~Impl() { teardown(); }

  /// One frame handed to ucp_am_send_nbx, and the outcome the sender waits for.
  struct SendOp {
    Impl* impl = nullptr;
    std::shared_ptr<Conn> conn;
    std::array<uint8_t, kHeaderBytes> header{};
    std::vector<uint8_t> owned;                 // internal frames own their payload ...
    std::span<const uint8_t> payload;           // ... send() lends it until done
    std::function<void(ucs_status_t)> on_sent;  // progress thread, before completion
    uint32_t dst = kNoPeer;
    bool done = false;       // guarded by mu
    bool timed_out = false;  // guarded by mu: its deadline closed the endpoint
    std::string error;       // guarded by mu; empty: sent
  };

  /// A rendezvous payload being fetched with ucp_am_recv_data_nbx.
  struct RecvOp {
    Impl* impl = nullptr;
    std::shared_ptr<Conn> conn;
    FrameHeader header;
    std::vector<uint8_t> payload;
    bool kept = false;  // its budget is reserved in the peer's slot
  };

  /// A rendezvous announcement, accepted in the AM callback and fetched after progress returns.
  struct PendingRndv {
    std::shared_ptr<Conn> conn;
    FrameHeader header;
    void* desc = nullptr;
    bool kept = false;
  };

  /// Connecting to one higher rank. Progress thread only.
  struct Dial {
    uint32_t rank = 0;
    std::shared_ptr<Conn> conn;  // the attempt in progress, or the connection
    Clock::time_point next{};
    milliseconds backoff{0};
    bool logged = false;
  };

  UcxOptions options;
  metrics::Metrics& metrics;
  Clock::time_point last_handshake_warning{};  // the cap's warning, at most every 10 s
  Membership membership;
  uint64_t job_hash = 0;

  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  uint16_t listen_port = 0;
  int worker_fd = -1;
  int event_fd = -1;  // other threads wake the progress thread with it
  int epoll_fd = -1;

  std::thread thread;
  std::atomic<bool> started{false};
  std::atomic<bool> stopping{false};
  bool shut_down = false;

  // Work handed to the progress thread.
  std::mutex task_mu;
  std::vector<std::function<void()>> tasks;
  bool stop_requested = false;

  // Progress thread only.
  std::map<uint64_t, std::shared_ptr<Conn>> conns;  // open connections
  std::unordered_map<ucp_ep_h, std::shared_ptr<Conn>> by_ep;
  uint64_t next_conn_id = 1;
  std::vector<ucp_conn_request_h> conn_requests;
  std::vector<ucp_ep_h> eps_to_close;
  std::vector<void*> close_requests;
  std::unordered_map<SendOp*, std::shared_ptr<SendOp>> sends_in_flight;
  std::vector<PendingRndv> pending_rndv;
  std::unordered_map<RecvOp*, std::unique_ptr<RecvOp>> recvs_in_flight;
  std::vector<Dial> dials;

  // Per peer: received frames, aborts, up or down (DESIGN.md §4). Its mutex (mu) also guards
  // `links` and the outcome of every SendOp, and its cv wakes their waiters.
  PeerMailboxes mail;
  std::mutex& mu;
  std::condition_variable& cv;
  std::vector<std::shared_ptr<Conn>> links;  // index = rank: the authenticated connection, if up

  // Set before start() (setJobState), used on the progress thread.
  std::function<std::vector<uint8_t>()> provide_state;
  std::function<void(uint32_t, std::span<const uint8_t>)> take_state;

  std::mutex posted_mu;
  std::vector<std::shared_ptr<SendOp>> posted;  // post()ed, not yet flushed

  Result<std::shared_ptr<SendOp>> queueFrame(uint32_t dst, FrameType type, const FrameKey& key,
                                             uint8_t codec, std::span<const uint8_t> payload);
  Status awaitFrames(std::vector<std::shared_ptr<SendOp>>& ops, Clock::time_point deadline);

  HeaderChecks checks(std::optional<uint32_t> src, uint64_t max) const {
    return HeaderChecks{job_hash, membership.world_size, membership.rank, src, max};
  }

  // --- the progress thread -------------------------------------------------------------------

  /// Runs `f` on the progress thread.
  void post(std::function<void()> f) {
    {
      std::lock_guard lock(task_mu);
      tasks.push_back(std::move(f));
    }
    wake();
  }

  void wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(event_fd, &one, sizeof(one));
  }

  /// Runs queued tasks; false once stop was requested.
  bool runTasks(bool& busy) {
    std::vector<std::function<void()>> mine;
    bool stop = false;
    {
      std::lock_guard lock(task_mu);
      mine.swap(tasks);
      stop = stop_requested;
    }
    for (auto& f : mine) f();
    busy = busy || !mine.empty();
    return !stop;
  }

  void run() {
    std::array<epoll_event, 4> events{};
    for (;;) {
      bool busy = false;
      for (int i = 0; i < 64 && ucp_worker_progress(worker) != 0; ++i) busy = true;
      busy = drain() || busy;
      const bool keep_going = runTasks(busy);
      busy = drain() || busy;
      if (!keep_going) break;
      const auto now = Clock::now();
      timers(now);
      busy = drain() || busy;
      if (busy) continue;
      if (ucp_worker_arm(worker) == UCS_ERR_BUSY) continue;
      {
        std::lock_guard lock(task_mu);
        if (!tasks.empty() || stop_requested) continue;
      }
      const auto until = std::min(nextTimer(now), now + kMaxSleep);
      const auto wait = std::chrono::ceil<milliseconds>(until - Clock::now()).count();
      ::epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()),
                   static_cast<int>(std::max<int64_t>(wait, 0)));
      uint64_t counter = 0;
      [[maybe_unused]] ssize_t n = ::read(event_fd, &counter, sizeof(counter));
    }
    shutdown();
  }

  /// Work that must not happen inside UCX callbacks: fetching rendezvous payloads, accepting
  /// connection requests, closing endpoints. Returns whether it did anything.
  bool drain() {
    bool did = false;
    while (!pending_rndv.empty()) {
      did = true;
      std::vector<PendingRndv> mine;
      mine.swap(pending_rndv);
      for (auto& p : mine) fetchRndv(p);
    }
    while (!conn_requests.empty()) {
      did = true;
      std::vector<ucp_conn_request_h> mine;
      mine.swap(conn_requests);
      for (auto* r : mine) accept(r);
    }
    while (!eps_to_close.empty()) {
      did = true;
      std::vector<ucp_ep_h> mine;
      mine.swap(eps_to_close);
      for (auto* ep : mine) {
        ucp_request_param_t p{};
        p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        p.flags = UCP_EP_CLOSE_FLAG_FORCE;
        ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
        if (r != nullptr && !UCS_PTR_IS_ERR(r)) close_requests.push_back(r);
      }
    }
    std::erase_if(close_requests, [](void* r) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
      ucp_request_free(r);
      return true;
    });
    return did;
  }

  /// Closes every endpoint (progress thread, or the destroying thread when never started).
  void shutdown() {
    if (shut_down) return;
    shut_down = true;
    stopping = true;
    drain();  // rejects connection requests that arrived (stopping)
    if (listener) {
      ucp_listener_destroy(listener);
      listener = nullptr;
    }
    std::vector<std::shared_ptr<Conn>> all;
    for (auto& [id, c] : conns) all.push_back(c);
    for (auto& c : all) closeConn(c, "transport shutting down");
    drain();
    const auto end = Clock::now() + kCloseGrace;
    while ((!close_requests.empty() || !pending_rndv.empty()) && Clock::now() < end) {
      ucp_worker_progress(worker);
      drain();
    }
    for (auto* r : close_requests) ucp_request_free(r);
    close_requests.clear();
  }

  /// Releases UCX (after shutdown(); the progress thread is gone).
  void teardown() {
    if (worker) {
      shutdown();
      ucp_worker_destroy(worker);  // completes what is left with errors
      worker = nullptr;
    }
    if (context) {
      ucp_cleanup(context);
      context = nullptr;
    }
    for (auto& [raw, op] : sends_in_flight) complete(op, "transport destroyed");
    sends_in_flight.clear();
    recvs_in_flight.clear();
    if (epoll_fd >= 0) ::close(epoll_fd);
    if (event_fd >= 0) ::close(event_fd);
    epoll_fd = event_fd = -1;
  }

  // --- connection state ----------------------------------------------------------------------

  std::shared_ptr<Conn> newConn(ucp_ep_h ep) {
    auto c = std::make_shared<Conn>();
    c->id = next_conn_id++;
    c->ep = ep;
    conns.emplace(c->id, c);
    by_ep.emplace(ep, c);
    return c;
  }

  void complete(const std::shared_ptr<SendOp>& op, std::string error) {
    std::lock_guard lock(mu);
    op->done = true;
    op->error = std::move(error);
    cv.notify_all();
  }

  /// Closes `c`: its endpoint is closed (force) after the current UCX call returns, which fails its
  /// sends in flight; if it is a peer's connection, marks the peer down so that pending receives
  /// from it fail with `reason`. Never calls into UCX (safe inside callbacks).
  void closeConn(const std::shared_ptr<Conn>& c, const std::string& reason) {
    if (c->phase == Phase::kClosed) return;
    c->phase = Phase::kClosed;
    by_ep.erase(c->ep);
    conns.erase(c->id);
    eps_to_close.push_back(c->ep);
    if (c->client) {
      for (Dial& d : dials) {
        if (d.conn != c) continue;
        d.conn.reset();
        const auto now = Clock::now();
        if (c->peer != kNoPeer) {  // it was up: reconnect soon, backoff reset
          d.backoff = options.backoff_initial;
          d.next = now + options.backoff_initial;
        } else {
          d.next = now + d.backoff;
          d.backoff = std::min(d.backoff * 2, options.backoff_max);
        }
      }
    }
    if (c->peer == kNoPeer) return;
    bool was_current = false;
    {
      std::lock_guard lock(mu);
      if (links[c->peer] == c) {
        was_current = true;
        links[c->peer].reset();
        mail.markDownLocked(c->peer, reason);
      }
    }
    if (was_current) {
      metrics.peerUp(c->peer).Set(0);
      if (!stopping) spdlog::warn("peer: connection to rank {} lost: {}", c->peer, reason);
    }
  }

  /// Makes `c` the connection of rank `peer`; refused when that rank is already connected.
  Status install(const std::shared_ptr<Conn>& c, uint32_t peer) {
    {
      std::lock_guard lock(mu);
      if (mail.upLocked(peer)) {
        return failedPrecondition(fmt::format("duplicate rank {}: already connected", peer));
      }
      c->peer = peer;
      c->name = fmt::format("rank {}", peer);
      c->phase = Phase::kUp;
      c->last_rx = Clock::now();
      c->next_ping = c->last_rx + options.ping_interval;
      links[peer] = c;
      mail.markUpLocked(peer);
    }
    metrics.peerUp(peer).Set(1);
    spdlog::info("peer: connected to rank {} ({}, ucx)", peer, c->address);
    if (provide_state) sendInternal(c, FrameType::kState, {}, provide_state());
    return Status::ok();
  }

  void refuse(const std::shared_ptr<Conn>& c, const Status& why) {
    if (!stopping) {
      metrics.auth_failures.Increment();
      spdlog::warn("peer: refused connection with {}: {}", c->address, why.message());
    }
    closeConn(c, why.message());
  }

  /// A connection failed before its handshake completed. As with tcp: the accepting side counts
  /// every handshake that does not complete; the connecting side counts wrong answers, not
  /// network errors (kUnavailable), and retries.
  void handshakeFailed(const std::shared_ptr<Conn>& c, const Status& st) {
    if (stopping || c->phase == Phase::kClosed) {
      closeConn(c, st.message());
      return;
    }
    if (!c->client || st.code() != StatusCode::kUnavailable) {
      refuse(c, st);
      return;
    }
    for (Dial& d : dials) {
      if (d.conn == c && !d.logged) {
        spdlog::info("peer: cannot reach rank {} at {} yet ({}); retrying", c->target, c->address,
                     st.message());
        d.logged = true;
      }
    }
    closeConn(c, st.message());
  }

  /// Fails `c` with `st`: a refusal before the handshake completed, a lost peer after.
  void fail(const std::shared_ptr<Conn>& c, const Status& st) {
    if (c->phase == Phase::kUp) {
      closeConn(c, st.message());
    } else {
      handshakeFailed(c, st);
    }
  }

  // --- sending -------------------------------------------------------------------------------

  static void onSendDone(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<SendOp*>(user_data);
    ucp_request_free(request);
    op->impl->sendFinished(op, status);
  }

  void sendFinished(SendOp* raw, ucs_status_t status) {
    auto it = sends_in_flight.find(raw);
    if (it == sends_in_flight.end()) return;
    std::shared_ptr<SendOp> op = std::move(it->second);
    sends_in_flight.erase(it);
    if (op->on_sent) op->on_sent(status);
    if (status == UCS_OK) {
      metrics.wire_bytes_sent.Increment(static_cast<double>(kHeaderBytes + op->payload.size()));
      complete(op, {});
      return;
    }
    Conn& c = *op->conn;
    complete(op, fmt::format("send to {} failed: {}", c.name,
                             c.phase == Phase::kClosed ? "connection closed" : ucsText(status)));
    fail(op->conn, Status(StatusCode::kUnavailable,
                          fmt::format("send to {} failed: {}", c.name, ucsText(status))));
  }

  /// Hands `op` to UCX (progress thread).
  void postSend(const std::shared_ptr<SendOp>& op) {
    Conn& c = *op->conn;
    if (c.phase == Phase::kClosed) {
      complete(op, fmt::format("connection to {} is closed", c.name));
      return;
    }
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = &Impl::onSendDone;
    p.user_data = op.get();
    p.flags = UCP_AM_SEND_FLAG_REPLY;  // the receiver learns our endpoint, hence who sent it
    sends_in_flight.emplace(op.get(), op);
    ucs_status_ptr_t r = ucp_am_send_nbx(c.ep, kAmId, op->header.data(), op->header.size(),
                                         op->payload.data(), op->payload.size(), &p);
    if (r == nullptr) {
      sendFinished(op.get(), UCS_OK);
    } else if (UCS_PTR_IS_ERR(r)) {
      sendFinished(op.get(), UCS_PTR_STATUS(r));
    }
  }

  /// Sends a frame that owns its payload (handshake, ping, pong, abort); nobody waits for it.
  void sendInternal(const std::shared_ptr<Conn>& c, FrameType type, const FrameKey& key,
                    std::vector<uint8_t> payload,
                    std::function<void(ucs_status_t)> on_sent = nullptr) {
    auto op = std::make_shared<SendOp>();
    op->impl = this;
    op->conn = c;
    op->header = encodeHeader(makeHeader(type, key, 0, job_hash, membership.rank, payload));
    op->owned = std::move(payload);
    op->payload = op->owned;
    op->on_sent = std::move(on_sent);
    postSend(op);
  }

  // --- receiving -----------------------------------------------------------------------------

  static ucs_status_t onAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param) {
    return static_cast<Impl*>(arg)->amReceived(header, header_length, data, length, *param);
  }

  /// Checks a received header against the connection's state, before anything is allocated for
  /// the payload (`length`: the payload bytes the message carries).
  Result<FrameHeader> checkHeader(const Conn& c, const void* header, size_t header_length,
                                  size_t length) {
    std::optional<uint32_t> src;
    uint64_t max = kChallengeBytes;  // the largest handshake frame
    if (c.phase == Phase::kUp) {
      src = c.peer;
      max = options.max_frame_bytes;
    } else if (c.client) {
      src = c.target;
    } else if (c.client_rank != kNoPeer) {
      src = c.client_rank;
    }
    auto h = decodeHeader(std::span(static_cast<const uint8_t*>(header), header_length),
                          checks(src, max), c.name);
    if (!h) return h.status();
    if (h->length != length) {
      return dataLoss(fmt::format(
          "malformed frame from {}: the header announces {} payload bytes, the message has {}",
          c.name, h->length, length));
    }
    const FrameType type = h->type;
    const bool handshake =
        type == FrameType::kHello || type == FrameType::kChallenge || type == FrameType::kAuth;
    if (c.phase == Phase::kUp) {
      if (handshake) {
        return dataLoss(
            fmt::format("malformed frame from {}: unexpected {} frame after the handshake", c.name,
                        frameTypeName(type)));
      }
      return h;
    }
    const FrameType want = c.client                   ? FrameType::kChallenge
                           : c.client_rank == kNoPeer ? FrameType::kHello
                                                      : FrameType::kAuth;
    if (type != want) {
      return failedPrecondition(fmt::format("{} sent a {} frame, expected {}", c.name,
                                            frameTypeName(type), frameTypeName(want)));
    }
    return h;
  }

  ucs_status_t amReceived(const void* header, size_t header_length, void* data, size_t length,
                          const ucp_am_recv_param_t& param) {
    const bool rndv = (param.recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    // A rendezvous payload not taken is dropped; the sender's send then fails.
    const ucs_status_t drop = rndv ? UCS_ERR_CANCELED : UCS_OK;
    std::shared_ptr<Conn> c;
    if (param.recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) {
      if (auto it = by_ep.find(param.reply_ep); it != by_ep.end()) c = it->second;
    }
    if (!c) return drop;  // not from an endpoint of ours (or one being closed)
    c->last_rx = Clock::now();
    metrics.wire_bytes_received.Increment(static_cast<double>(header_length + (rndv ? 0 : length)));
    auto h = checkHeader(*c, header, header_length, length);
    if (!h) {
      fail(c, h.status());
      return drop;
    }
    const bool kept = h->type == FrameType::kData || h->type == FrameType::kAbort;
    if (kept) {
      std::string why;
      if (!mail.reserve(c->peer, h->length, why)) {
        closeConn(c, why);
        return drop;
      }
    }
    if (rndv) {
      pending_rndv.push_back(PendingRndv{c, *h, data, kept});
      return UCS_INPROGRESS;
    }
    std::vector<uint8_t> payload = mail.takeBuffer(length);
    if (length > 0) std::memcpy(payload.data(), data, length);
    frameArrived(c, *h, std::move(payload), kept);
    return UCS_OK;
  }

  static void onRecvDone(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
    auto* op = static_cast<RecvOp*>(user_data);
    ucp_request_free(request);
    op->impl->recvFinished(op, status);
  }

  /// Fetches an announced rendezvous payload (after progress returned).
  void fetchRndv(PendingRndv& p) {
    if (p.conn->phase == Phase::kClosed) {
      ucp_am_data_release(worker, p.desc);
      if (p.kept) mail.release(p.header.src, p.header.length);
      return;
    }
    auto op = std::make_unique<RecvOp>();
    op->impl = this;
    op->conn = p.conn;
    op->header = p.header;
    op->kept = p.kept;
    op->payload = mail.takeBuffer(p.header.length);
    RecvOp* raw = op.get();
    recvs_in_flight.emplace(raw, std::move(op));
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    prm.cb.recv_am = &Impl::onRecvDone;
    prm.user_data = raw;
    ucs_status_ptr_t r =
        ucp_am_recv_data_nbx(worker, p.desc, raw->payload.data(), raw->payload.size(), &prm);
    if (r == nullptr) {
      recvFinished(raw, UCS_OK);
    } else if (UCS_PTR_IS_ERR(r)) {
      recvFinished(raw, UCS_PTR_STATUS(r));
    }
  }

  void recvFinished(RecvOp* raw, ucs_status_t status) {
    auto it = recvs_in_flight.find(raw);
    if (it == recvs_in_flight.end()) return;
    std::unique_ptr<RecvOp> op = std::move(it->second);
    recvs_in_flight.erase(it);
    if (status != UCS_OK) {
      if (op->kept) mail.release(op->header.src, op->header.length);
      if (op->conn->phase != Phase::kClosed) {
        fail(op->conn,
             Status(StatusCode::kUnavailable, fmt::format("receiving a frame from {} failed: {}",
                                                          op->conn->name, ucsText(status))));
      }
      return;
    }
    op->conn->last_rx = Clock::now();
    metrics.wire_bytes_received.Increment(static_cast<double>(op->payload.size()));
    frameArrived(op->conn, op->header, std::move(op->payload), op->kept);
  }

  /// A whole frame arrived on `c` (header already checked).
  void frameArrived(const std::shared_ptr<Conn>& c, const FrameHeader& h,
                    std::vector<uint8_t> payload, bool kept) {
    Status st = c->phase == Phase::kClosed ? Status(StatusCode::kUnavailable, "closed")
                                           : verifyPayload(h, payload, c->name);
    if (!st) {
      if (kept) mail.release(h.src, h.length);
      if (c->phase != Phase::kClosed) fail(c, st);
      return;
    }
    if (c->phase == Phase::kUp) {
      dispatch(c, h, std::move(payload));
      return;
    }
    st = c->client ? onChallenge(c, payload) : onServerHandshake(c, h, payload);
    if (!st) handshakeFailed(c, st);
  }

  void dispatch(const std::shared_ptr<Conn>& c, const FrameHeader& h,
                std::vector<uint8_t> payload) {
    switch (h.type) {
      case FrameType::kData:
        mail.deliver(Frame{h.type, h.key, h.src, h.codec, std::move(payload)});
        break;
      case FrameType::kAbort:
        mail.deliverAbort(h.src, h.key.tensor, h.key.step,
                          std::string(payload.begin(), payload.end()));
        break;
      case FrameType::kPing:
        sendInternal(c, FrameType::kPong, {}, std::move(payload));
        break;
      case FrameType::kState:
        if (take_state) take_state(h.src, payload);
        break;
      case FrameType::kRegister:
      case FrameType::kPeers:
        // The rendezvous is served by the tcp transport only.
        closeConn(c, fmt::format("malformed frame from {}: unexpected {} frame (this job has no "
                                 "rendezvous)",
                                 c->name, frameTypeName(h.type)));
        break;
      case FrameType::kPong: {
        uint64_t sent = 0;
        for (size_t i = 0; i < kPingBytes; ++i) sent |= uint64_t{payload[i]} << (8 * i);
        const uint64_t now = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
        if (now >= sent) metrics.peerRtt(h.src).Set(static_cast<double>(now - sent) * 1e-9);
        break;
      }
      default:
        break;
    }
  }

  // --- handshake -----------------------------------------------------------------------------

  /// The connecting side: verify CHALLENGE, send AUTH; the peer is up once AUTH is handed to UCX
  /// (anything we send after it follows it on the endpoint).
  Status onChallenge(const std::shared_ptr<Conn>& c, const std::vector<uint8_t>& challenge) {
    const Membership& m = membership;
    const uint32_t server = c->target;
    std::copy_n(challenge.begin(), kNonceBytes, c->server_nonce.begin());
    const Mac expected = handshakeMac(MacRole::kServer, m.secret, m.job_id, c->client_nonce,
                                      c->server_nonce, m.rank, server, m.world_size);
    if (!macEqual(expected, std::span(challenge).subspan(kNonceBytes))) {
      return failedPrecondition(fmt::format(
          "rank {} failed to prove knowledge of the job secret (wrong secret?)", server));
    }
    const Mac auth = handshakeMac(MacRole::kClient, m.secret, m.job_id, c->client_nonce,
                                  c->server_nonce, m.rank, server, m.world_size);
    sendInternal(c, FrameType::kAuth, {}, std::vector<uint8_t>(auth.begin(), auth.end()));
    if (c->phase == Phase::kClosed) {
      return Status(StatusCode::kUnavailable, fmt::format("handshake with {} failed", c->name));
    }
    Status st = install(c, server);
    if (st) {
      for (Dial& d : dials) {
        if (d.conn == c) d.logged = false;
      }
    }
    return st;
  }

  /// The accepting side: check HELLO and answer CHALLENGE; then verify AUTH.
  Status onServerHandshake(const std::shared_ptr<Conn>& c, const FrameHeader& h,
                           const std::vector<uint8_t>& payload) {
    const Membership& m = membership;
    if (h.type == FrameType::kHello) {
      const uint32_t client = h.src;
      const Hello hello = decodeHello(payload);
      if (hello.world_size != m.world_size) {
        return failedPrecondition(fmt::format("{} claims rank {} of world size {}, ours is {}",
                                              c->name, client, hello.world_size, m.world_size));
      }
      if (hello.dst != m.rank) {
        return failedPrecondition(fmt::format("{} (rank {}) meant to reach rank {}, we are {}",
                                              c->name, client, hello.dst, m.rank));
      }
      if (client > m.rank) {
        return failedPrecondition(fmt::format(
            "{} claims rank {}, higher than ours ({}): lower ranks connect to higher ones", c->name,
            client, m.rank));
      }
      {
        std::lock_guard lock(mu);
        if (mail.upLocked(client)) {
          return failedPrecondition(fmt::format(
              "{} claims rank {}, which is already connected (duplicate rank)", c->name, client));
        }
      }
      auto nonce = randomNonce();
      if (!nonce) return nonce.status();
      c->client_rank = client;
      c->client_nonce = hello.nonce;
      c->server_nonce = *nonce;
      const Mac proof = handshakeMac(MacRole::kServer, m.secret, m.job_id, hello.nonce, *nonce,
                                     client, m.rank, m.world_size);
      std::vector<uint8_t> challenge(kChallengeBytes);
      std::copy(nonce->begin(), nonce->end(), challenge.begin());
      std::copy(proof.begin(), proof.end(), challenge.begin() + kNonceBytes);
      sendInternal(c, FrameType::kChallenge, {}, std::move(challenge));
      return Status::ok();
    }
    // AUTH (checkHeader let nothing else through).
    const uint32_t client = c->client_rank;
    const Mac expected = handshakeMac(MacRole::kClient, m.secret, m.job_id, c->client_nonce,
                                      c->server_nonce, client, m.rank, m.world_size);
    if (!macEqual(expected, payload)) {
      return failedPrecondition(
          fmt::format("{} (rank {}) failed to prove knowledge of the job secret (wrong secret?)",
                      c->name, client));
    }
    return install(c, client);
  }

  // --- accepting and connecting --------------------------------------------------------------

  static void onConnRequest(ucp_conn_request_h request, void* arg) {
    static_cast<Impl*>(arg)->conn_requests.push_back(request);
  }

  static void onEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    static_cast<Impl*>(arg)->epFailed(ep, status);
  }

  void epFailed(ucp_ep_h ep, ucs_status_t status) {
    auto it = by_ep.find(ep);
    if (it == by_ep.end()) return;  // already being closed
    std::shared_ptr<Conn> c = it->second;
    std::string why;
    if (c->phase == Phase::kConnecting) {
      why = fmt::format("connect: {}", ucsText(status));
    } else if (c->phase == Phase::kHandshake) {
      why = fmt::format("handshake with {} failed: {}", c->name, ucsText(status));
    } else {
      why = fmt::format("{} closed the connection ({})", c->name, ucsText(status));
    }
    fail(c, Status(StatusCode::kUnavailable, why));
  }

  /// Accepted endpoints whose handshake has not ended (UcxOptions::max_pending_handshakes).
  size_t pendingHandshakes() const {
    size_t n = 0;
    for (const auto& [id, c] : conns) {
      n += !c->client && c->phase != Phase::kUp && c->phase != Phase::kClosed;
    }
    return n;
  }

  void accept(ucp_conn_request_h request) {
    if (stopping || !listener) {
      if (listener) ucp_listener_reject(listener, request);
      return;
    }
    ucp_conn_request_attr_t attr{};
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    std::string address = "unknown address";
    if (ucp_conn_request_query(request, &attr) == UCS_OK) {
      address = sockaddrName(attr.client_address);
    }
    if (const size_t pending = pendingHandshakes(); pending >= options.max_pending_handshakes) {
      ucp_listener_reject(listener, request);
      metrics.limitHits("peer_handshakes").Increment();
      const auto now = Clock::now();
      if (now - last_handshake_warning > std::chrono::seconds(10)) {
        last_handshake_warning = now;
        spdlog::warn(
            "peer: {} connections are in their handshake already (at most {}); rejecting new "
            "ones, such as {}'s, until they finish (limit hits counted in "
            "lightwire_limit_hits_total)",
            pending, options.max_pending_handshakes, address);
      }
      return;
    }
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                   UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.conn_request = request;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &Impl::onEpError;
    p.err_handler.arg = this;
    ucp_ep_h ep = nullptr;
    if (ucs_status_t st = ucp_ep_create(worker, &p, &ep); st != UCS_OK) {
      spdlog::warn("peer: cannot accept a connection from {}: {}", address, ucsText(st));
      return;
    }
    auto c = newConn(ep);
    c->address = address;
    c->name = address;
    c->phase = Phase::kHandshake;
    c->deadline = Clock::now() + options.handshake_timeout;
  }

  /// Starts a connection attempt to a higher rank.
  void dialOut(Dial& d) {
    const auto now = Clock::now();
    auto retry = [&](const std::string& why) {
      if (!d.logged) {
        spdlog::info("peer: cannot reach rank {} at {} yet ({}); retrying", d.rank,
                     membership.peers[d.rank], why);
        d.logged = true;
      }
      d.next = now + d.backoff;
      d.backoff = std::min(d.backoff * 2, options.backoff_max);
    };
    std::string host;
    uint16_t port = 0;
    parseHostPort(membership.peers[d.rank], host, port);  // validated by start()
    auto addr = resolve(host, port, /*numeric=*/false);
    if (!addr) {
      retry(addr.status().message());
      return;
    }
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = addr->get();
    p.sockaddr.addrlen = addr->length;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &Impl::onEpError;
    p.err_handler.arg = this;
    ucp_ep_h ep = nullptr;
    if (ucs_status_t st = ucp_ep_create(worker, &p, &ep); st != UCS_OK) {
      retry("connect: " + ucsText(st));
      return;
    }
    auto c = newConn(ep);
    c->client = true;
    c->target = d.rank;
    c->address = membership.peers[d.rank];
    c->name = fmt::format("rank {} ({})", d.rank, c->address);
    c->phase = Phase::kConnecting;
    c->deadline = now + options.connect_timeout;
    d.conn = c;
    auto nonce = randomNonce();
    if (!nonce) {
      handshakeFailed(c, nonce.status());
      return;
    }
    c->client_nonce = *nonce;
    auto hello = encodeHello(Hello{membership.world_size, d.rank, *nonce});
    sendInternal(c, FrameType::kHello, {}, std::vector<uint8_t>(hello.begin(), hello.end()),
                 [this, c](ucs_status_t st) {
                   if (st == UCS_OK && c->phase == Phase::kConnecting) {
                     c->phase = Phase::kHandshake;
                     c->deadline = Clock::now() + options.handshake_timeout;
                   }
                 });
  }

  /// Connection attempts, connect and handshake deadlines, pings and silence.
  void timers(Clock::time_point now) {
    if (stopping) return;
    for (Dial& d : dials) {
      if (!d.conn && now >= d.next) dialOut(d);
    }
    std::vector<std::shared_ptr<Conn>> all;
    all.reserve(conns.size());
    for (auto& [id, c] : conns) all.push_back(c);
    for (auto& c : all) {
      if (c->phase == Phase::kClosed) continue;
      if (c->phase != Phase::kUp) {
        if (now < c->deadline) continue;
        handshakeFailed(c, Status(StatusCode::kUnavailable,
                                  c->phase == Phase::kConnecting
                                      ? std::string("connect timed out")
                                      : fmt::format("handshake with {} did not finish before its "
                                                    "deadline",
                                                    c->name)));
        continue;
      }
      if (now < c->next_ping) continue;
      const auto silent = now - c->last_rx;
      if (silent > options.peer_timeout) {
        closeConn(c, fmt::format("{} silent for {} ms", c->name,
                                 std::chrono::duration_cast<milliseconds>(silent).count()));
        continue;
      }
      c->next_ping = now + options.ping_interval;
      std::vector<uint8_t> ts(kPingBytes);
      const uint64_t t = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
      for (size_t i = 0; i < kPingBytes; ++i) ts[i] = static_cast<uint8_t>(t >> (8 * i));
      sendInternal(c, FrameType::kPing, {}, std::move(ts));
    }
  }

  Clock::time_point nextTimer(Clock::time_point now) const {
    Clock::time_point next = now + kMaxSleep;
    for (const Dial& d : dials) {
      if (!d.conn) next = std::min(next, d.next);
    }
    for (const auto& [id, c] : conns) {
      next = std::min(next, c->phase == Phase::kUp ? c->next_ping : c->deadline);
    }
    return next;
  }
};

// --- UcxTransport --------------------------------------------------------------------------------

UcxTransport::UcxTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<UcxTransport>> UcxTransport::listen(const std::string& host, uint16_t port,
                                                           const UcxOptions& options,
                                                           metrics::Metrics& metrics) {
  if (options.max_frame_bytes > options.max_kept_bytes_per_peer) {
    return invalidArgument("peer: max_frame_bytes exceeds max_kept_bytes_per_peer");
  }
  auto addr = resolve(host, port, /*numeric=*/true);
  if (!addr) {
    return invalidArgument(
        fmt::format("peer: bad listen address '{}': {}", host, addr.status().message()));
  }
  auto impl = std::make_unique<Impl>(options, metrics);
  Impl& s = *impl;
  auto failed = [&](const char* what, ucs_status_t st) {
    return Status(
        StatusCode::kUnavailable,
        fmt::format("peer: cannot listen on {}:{} (ucx): {}: {}", host, port, what, ucsText(st)));
  };

  ucp_config_t* config = nullptr;
  if (ucs_status_t st = ucp_config_read(nullptr, nullptr, &config); st != UCS_OK) {
    return failed("ucp_config_read", st);
  }
  // A restarted sidecar must be able to listen on its port again while connections of its
  // previous life linger in TIME_WAIT (as SO_REUSEADDR does for the tcp transport).
  ucp_config_modify(config, "CM_REUSEADDR", "y");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = "lightwire";
  ucs_status_t st = ucp_init(&params, config, &s.context);
  ucp_config_release(config);
  if (st != UCS_OK) return failed("ucp_init", st);

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // the progress thread owns the worker
  if (st = ucp_worker_create(s.context, &wp, &s.worker); st != UCS_OK) {
    return failed("ucp_worker_create", st);
  }
  if (st = ucp_worker_get_efd(s.worker, &s.worker_fd); st != UCS_OK) {
    return failed("ucp_worker_get_efd", st);
  }
  ucp_am_handler_param_t ap{};
  ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  ap.id = kAmId;
  ap.flags = UCP_AM_FLAG_WHOLE_MSG;
  ap.cb = &Impl::onAm;
  ap.arg = &s;
  if (st = ucp_worker_set_am_recv_handler(s.worker, &ap); st != UCS_OK) {
    return failed("ucp_worker_set_am_recv_handler", st);
  }

  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = addr->get();
  lp.sockaddr.addrlen = addr->length;
  lp.conn_handler.cb = &Impl::onConnRequest;
  lp.conn_handler.arg = &s;
  if (st = ucp_listener_create(s.worker, &lp, &s.listener); st != UCS_OK) {
    return failed("ucp_listener_create", st);
  }
  ucp_listener_attr_t la{};
  la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (st = ucp_listener_query(s.listener, &la); st != UCS_OK) {
    return failed("ucp_listener_query", st);
  }
  s.listen_port = sockaddrPort(la.sockaddr);

  s.event_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  s.epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  if (s.event_fd < 0 || s.epoll_fd < 0) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("peer: eventfd/epoll: {}", std::strerror(errno)));
  }
  for (int fd : {s.worker_fd, s.event_fd}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(s.epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return Status(StatusCode::kUnavailable,
                    fmt::format("peer: epoll_ctl: {}", std::strerror(errno)));
    }
  }
  return std::unique_ptr<UcxTransport>(new UcxTransport(std::move(impl)));
}

UcxTransport::~UcxTransport() {
  Impl& s = *impl_;
  if (s.thread.joinable()) {
    {
      std::lock_guard lock(s.task_mu);
      s.stop_requested = true;
    }
    s.wake();
    s.thread.join();  // the thread closes every endpoint on its way out
  }
  s.teardown();
  for (uint32_t r = 0; r < s.mail.size(); ++r) {
    if (r != s.membership.rank) s.metrics.peerUp(r).Set(0);
  }
}

uint16_t UcxTransport::port() const { return impl_->listen_port; }

Status UcxTransport::start(Membership m) {
  Impl& s = *impl_;
  if (s.started.exchange(true)) return failedPrecondition("peer: transport already started");
  if (m.world_size == 0 || m.rank >= m.world_size) {
    return invalidArgument(
        fmt::format("peer: rank {} outside world size {}", m.rank, m.world_size));
  }
  if (!m.rendezvous.empty()) {
    return invalidArgument(
        "peer: the ucx transport needs every rank's address (peer.peers); a rendezvous is served "
        "by the tcp transport only");
  }
  if (m.peers.size() != m.world_size) {
    return invalidArgument(
        fmt::format("peer: {} peer addresses for world size {}", m.peers.size(), m.world_size));
  }
  if (m.job_id.empty()) return invalidArgument("peer: empty job id");
  if (m.secret.empty()) return invalidArgument("peer: empty job secret");
  for (uint32_t r = 0; r < m.world_size; ++r) {
    std::string host;
    uint16_t port = 0;
    if (!parseHostPort(m.peers[r], host, port)) {
      return invalidArgument(fmt::format("peer: bad address '{}' of rank {}", m.peers[r], r));
    }
  }
  s.job_hash = jobHash(m.job_id);
  s.membership = std::move(m);
  s.mail.reset(s.membership.world_size, s.membership.rank);
  s.links.assign(s.membership.world_size, nullptr);
  for (uint32_t r = 0; r < s.membership.world_size; ++r) {
    if (r != s.membership.rank) s.metrics.peerUp(r).Set(0);
  }
  const auto now = Clock::now();
  for (uint32_t r = s.membership.rank + 1; r < s.membership.world_size; ++r) {
    Impl::Dial d;
    d.rank = r;
    d.next = now;
    d.backoff = s.options.backoff_initial;
    s.dials.push_back(std::move(d));
  }
  s.thread = std::thread([&s] { s.run(); });
  return Status::ok();
}

uint32_t UcxTransport::rank() const { return impl_->membership.rank; }
uint32_t UcxTransport::worldSize() const { return impl_->membership.world_size; }

Result<std::shared_ptr<UcxTransport::Impl::SendOp>> UcxTransport::Impl::queueFrame(
    uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
    std::span<const uint8_t> payload) {
  if (!started) return failedPrecondition("peer: send before start()");
  LW_RETURN_IF_ERROR(mail.checkSend(dst, type, payload.size(), options.max_frame_bytes));
  auto op = std::make_shared<SendOp>();
  op->impl = this;
  op->header = encodeHeader(makeHeader(type, key, codec, job_hash, membership.rank, payload));
  op->payload = payload;
  op->dst = dst;
  {
    std::lock_guard lock(mu);
    op->conn = links[dst];
    if (!op->conn) return mail.notConnectedLocked(dst);
  }
  post([this, op] { postSend(op); });
  return op;
}

Status UcxTransport::Impl::awaitFrames(std::vector<std::shared_ptr<SendOp>>& ops,
                                       Clock::time_point deadline) {
  auto all_done = [&] {
    return std::all_of(ops.begin(), ops.end(), [](const auto& op) { return op->done; });
  };
  std::unique_lock lock(mu);
  if (!cv.wait_until(lock, deadline, all_done)) {
    // Payloads are lent and a frame handed to UCX cannot be withdrawn: close the endpoints of the
    // frames still in flight, which completes them (with an error) before we return.
    lock.unlock();
    post([this, ops] {
      std::vector<std::shared_ptr<Conn>> to_close;
      {
        std::lock_guard l(mu);
        for (const auto& op : ops) {
          if (op->done) continue;
          op->timed_out = true;
          to_close.push_back(op->conn);
        }
      }
      for (auto& c : to_close) {
        closeConn(c, fmt::format("a send to rank {} did not finish before its deadline", c->peer));
      }
    });
    lock.lock();
    cv.wait(lock, all_done);
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

Status UcxTransport::send(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                          std::span<const uint8_t> payload, Clock::time_point deadline) {
  auto op = impl_->queueFrame(dst, type, key, codec, payload);
  if (!op) return op.status();
  std::vector<std::shared_ptr<Impl::SendOp>> one{std::move(*op)};
  return impl_->awaitFrames(one, deadline);
}

Status UcxTransport::post(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                          std::span<const uint8_t> payload, Clock::time_point /*deadline*/) {
  auto op = impl_->queueFrame(dst, type, key, codec, payload);
  if (!op) return op.status();
  std::lock_guard lock(impl_->posted_mu);
  impl_->posted.push_back(std::move(*op));
  return Status::ok();
}

Status UcxTransport::flush(Clock::time_point deadline) {
  std::vector<std::shared_ptr<Impl::SendOp>> ops;
  {
    std::lock_guard lock(impl_->posted_mu);
    ops.swap(impl_->posted);
  }
  if (ops.empty()) return Status::ok();
  return impl_->awaitFrames(ops, deadline);
}

void UcxTransport::recycle(std::vector<uint8_t> buffer) { impl_->mail.recycle(std::move(buffer)); }

void UcxTransport::setJobState(std::function<std::vector<uint8_t>()> provide,
                               std::function<void(uint32_t, std::span<const uint8_t>)> take) {
  impl_->provide_state = std::move(provide);
  impl_->take_state = std::move(take);
}

Result<Frame> UcxTransport::receive(uint32_t src, const FrameKey& key, Clock::time_point deadline) {
  if (!impl_->started) return failedPrecondition("peer: receive before start()");
  return impl_->mail.receive(src, key, deadline);
}

void UcxTransport::abortStep(uint64_t tensor, uint64_t step, const std::string& reason) {
  Impl& s = *impl_;
  if (!s.started) return;
  std::vector<uint8_t> payload(reason.begin(), reason.end());
  if (payload.size() > 4096) payload.resize(4096);  // a reason, not a payload
  s.post([&s, tensor, step, payload = std::move(payload)] {
    std::vector<std::shared_ptr<Conn>> up;
    {
      std::lock_guard lock(s.mu);
      for (auto& link : s.links) {
        if (link) up.push_back(link);
      }
    }
    FrameKey key;
    key.tensor = tensor;
    key.step = step;
    for (auto& c : up) s.sendInternal(c, FrameType::kAbort, key, payload);
  });
}

void UcxTransport::broadcastState() {
  Impl& s = *impl_;
  if (!s.started || !s.provide_state) return;
  s.post([&s, state = s.provide_state()] {
    std::vector<std::shared_ptr<Conn>> up;
    {
      std::lock_guard lock(s.mu);
      for (auto& link : s.links) {
        if (link) up.push_back(link);
      }
    }
    for (auto& c : up) s.sendInternal(c, FrameType::kState, {}, state);
  });
}

void UcxTransport::discard(uint64_t tensor, uint64_t step) { impl_->mail.discard(tensor, step); }

void UcxTransport::beginStep(uint64_t tensor, uint64_t step) {
  impl_->mail.beginStep(tensor, step);
}

bool UcxTransport::allConnected() const { return impl_->mail.allUp() && impl_->started; }

std::vector<bool> UcxTransport::peersUp() const { return impl_->mail.peersUp(); }

}  // namespace lightwire::proxy::peer
