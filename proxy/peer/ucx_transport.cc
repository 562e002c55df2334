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
#include "proxy/peer/session.h"
#include "proxy/peer/sockaddr.h"
#include "proxy/peer/ucx_worker.h"

namespace lightwire::proxy::peer {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The progress thread never sleeps longer than this (timers are checked at least this often).
constexpr milliseconds kMaxSleep{100};
// At shutdown, how long closing endpoints may take before the worker is destroyed anyway.
constexpr milliseconds kCloseGrace{2000};

enum class Phase {
  kConnecting,  // client: endpoint created, HELLO not yet out (connect_timeout)
  kHandshake,   // HELLO .. AUTH (handshake_timeout)
  kUp,          // authenticated
  kClosed,
};

/// One ucp endpoint, before and after its handshake: the `ucx` link. Touched on the progress
/// thread only, but for post().
struct UcxConn final : Link {
  explicit UcxConn(UcxTransport::Impl& i) : impl(i) {}
  void post(std::shared_ptr<SendOp> op) override;
  void sendOwned(FrameType type, const FrameKey& key, std::vector<uint8_t> payload) override;
  void abandon(const std::shared_ptr<SendOp>& op) override;
  void close(const std::string& reason) override;
  std::shared_ptr<UcxConn> self() { return std::static_pointer_cast<UcxConn>(shared_from_this()); }

  UcxTransport::Impl& impl;
  uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  bool client = false;             // we connected (to `target`)
  uint32_t target = kNoPeer;       // client: the rank dialled
  uint32_t client_rank = kNoPeer;  // server: the rank HELLO claimed (CHALLENGE sent)
  Phase phase = Phase::kConnecting;
  Clock::time_point deadline{};  // of the current phase, until up
  Clock::time_point next_ping{};
  ClientHandshake client_hs;
  ServerHandshake server_hs;
};

}  // namespace

struct UcxTransport::Impl : UcxWorker {
  Impl(const UcxOptions& o, metrics::Metrics& m)
      : options(o),
        metrics(m),
        session(SessionOptions{o.ping_interval, o.peer_timeout, o.max_frame_bytes,
                               o.max_kept_bytes_per_peer, o.max_kept_frames_per_peer},
                m),
        mail(session.mail()) {
    session.setPost([this](std::function<void()> f) { post(std::move(f)); });
    session.setWrongDirection([this](const std::string& name, uint32_t client) {
      return fmt::format(
          "{} claims rank {}, higher than ours ({}): lower ranks connect to higher "
          "ones",
          name, client, session.membership().rank);
    });
  }
  ~Impl() { teardown(); }

  /// A rendezvous payload being fetched with ucp_am_recv_data_nbx.
  struct RecvOp {
    Impl* impl = nullptr;
    std::shared_ptr<UcxConn> conn;
    FrameHeader header;
    std::vector<uint8_t> payload;
    bool kept = false;  // its budget is reserved in the peer's slot
  };

  /// A rendezvous announcement, accepted in the AM callback and fetched after progress returns.
  struct PendingRndv {
    std::shared_ptr<UcxConn> conn;
    FrameHeader header;
    void* desc = nullptr;
    bool kept = false;
  };

  /// Connecting to one higher rank. Progress thread only.
  struct Dial {
    uint32_t rank = 0;
    std::shared_ptr<UcxConn> conn;  // the attempt in progress, or the connection
    Clock::time_point next{};
    milliseconds backoff{0};
    bool logged = false;
  };

  UcxOptions options;
  metrics::Metrics& metrics;
  // The protocol (docs/peer-protocol.md).
  PeerSession session;
  PeerMailboxes& mail;
  bool stopping() const { return session.stopping(); }
  const Membership& membership() const { return session.membership(); }

  std::thread thread;
  bool shut_down = false;

  // Work handed to the progress thread.
  std::mutex task_mu;
  std::vector<std::function<void()>> tasks;
  bool stop_requested = false;

  // Progress thread only.
  std::map<uint64_t, std::shared_ptr<UcxConn>> conns;  // open connections
  std::unordered_map<ucp_ep_h, std::shared_ptr<UcxConn>> by_ep;
  uint64_t next_conn_id = 1;
  std::vector<ucp_conn_request_h> conn_requests;
  std::vector<ucp_ep_h> eps_to_close;
  std::vector<void*> close_requests;
  std::unordered_map<SendOp*, std::shared_ptr<SendOp>> sends_in_flight;
  std::vector<PendingRndv> pending_rndv;
  std::unordered_map<RecvOp*, std::unique_ptr<RecvOp>> recvs_in_flight;
  std::vector<Dial> dials;

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
    session.setStopping();
    drain();  // rejects connection requests that arrived (stopping)
    if (listener) {
      ucp_listener_destroy(listener);
      listener = nullptr;
    }
    std::vector<std::shared_ptr<UcxConn>> all;
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
    for (auto& [raw, op] : sends_in_flight) session.complete(op, "transport destroyed");
    sends_in_flight.clear();
    recvs_in_flight.clear();
    if (epoll_fd >= 0) ::close(epoll_fd);
    if (event_fd >= 0) ::close(event_fd);
    epoll_fd = event_fd = -1;
  }

  // --- connection state ----------------------------------------------------------------------

  std::shared_ptr<UcxConn> newConn(ucp_ep_h ep) {
    auto c = std::make_shared<UcxConn>(*this);
    c->id = next_conn_id++;
    c->ep = ep;
    conns.emplace(c->id, c);
    by_ep.emplace(ep, c);
    return c;
  }

  /// Closes `c`: its endpoint is closed (force) after the current UCX call returns, which fails its
  /// sends in flight; if it is a peer's connection, marks the peer down so that pending receives
  /// from it fail with `reason`. Never calls into UCX (safe inside callbacks).
  void closeConn(const std::shared_ptr<UcxConn>& c, const std::string& reason) {
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
    session.linkClosed(c, reason);
  }

  /// Makes `c` the connection of rank `peer`; refused when that rank is already connected.
  Status install(const std::shared_ptr<UcxConn>& c, uint32_t peer) {
    LW_RETURN_IF_ERROR(session.install(c, peer, c->address + ", ucx"));
    c->phase = Phase::kUp;
    c->next_ping = c->last_rx + options.ping_interval;
    session.greet(c);
    return Status::ok();
  }

  void refuse(const std::shared_ptr<UcxConn>& c, const Status& why) {
    session.noteRefused(c->address, why);
    closeConn(c, why.message());
  }

  /// A connection failed before its handshake completed. As with tcp: the accepting side counts
  /// every handshake that does not complete; the connecting side counts wrong answers, not
  /// network errors (kUnavailable), and retries.
  void handshakeFailed(const std::shared_ptr<UcxConn>& c, const Status& st) {
    if (stopping() || c->phase == Phase::kClosed) {
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
  void fail(const std::shared_ptr<UcxConn>& c, const Status& st) {
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
    static_cast<UcxConn&>(*op->link).impl.sendFinished(op, status);
  }

  void sendFinished(SendOp* raw, ucs_status_t status) {
    auto it = sends_in_flight.find(raw);
    if (it == sends_in_flight.end()) return;
    std::shared_ptr<SendOp> op = std::move(it->second);
    sends_in_flight.erase(it);
    if (op->on_sent) op->on_sent(status == UCS_OK);
    if (status == UCS_OK) {
      metrics.wire_bytes_sent.Increment(static_cast<double>(kHeaderBytes + op->payload.size()));
      session.complete(op, {});
      return;
    }
    auto conn = std::static_pointer_cast<UcxConn>(op->link);
    UcxConn& c = *conn;
    session.complete(
        op, fmt::format("send to {} failed: {}", c.name,
                        c.phase == Phase::kClosed ? "connection closed" : ucsText(status)));
    fail(conn, Status(StatusCode::kUnavailable,
                      fmt::format("send to {} failed: {}", c.name, ucsText(status))));
  }

  /// Hands `op` to UCX (progress thread).
  void postSend(const std::shared_ptr<SendOp>& op) {
    UcxConn& c = static_cast<UcxConn&>(*op->link);
    if (c.phase == Phase::kClosed) {
      session.complete(op, fmt::format("connection to {} is closed", c.name));
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
  void sendInternal(const std::shared_ptr<UcxConn>& c, FrameType type, const FrameKey& key,
                    std::vector<uint8_t> payload, std::function<void(bool)> on_sent = nullptr) {
    auto op = session.ownedOp(type, key, std::move(payload));
    op->link = c;
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
  Result<FrameHeader> checkHeader(const UcxConn& c, const void* header, size_t header_length,
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
                          session.checks(src, max), c.name);
    if (!h) return h.status();
    if (h->length != length) {
      return dataLoss(fmt::format(
          "malformed frame from {}: the header announces {} payload bytes, the message has {}",
          c.name, h->length, length));
    }
    const FrameType type = h->type;
    if (c.phase == Phase::kUp) {
      LW_RETURN_IF_ERROR(PeerSession::checkNotHandshake(type, c.name));
      return h;
    }
    const FrameType want = c.client                   ? FrameType::kChallenge
                           : c.client_rank == kNoPeer ? FrameType::kHello
                                                      : FrameType::kAuth;
    if (type != want) return PeerSession::unexpectedFrame(c.name, type, want);
    return h;
  }

  ucs_status_t amReceived(const void* header, size_t header_length, void* data, size_t length,
                          const ucp_am_recv_param_t& param) {
    const bool rndv = (param.recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    // A rendezvous payload not taken is dropped; the sender's send then fails.
    const ucs_status_t drop = rndv ? UCS_ERR_CANCELED : UCS_OK;
    std::shared_ptr<UcxConn> c;
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
  void frameArrived(const std::shared_ptr<UcxConn>& c, const FrameHeader& h,
                    std::vector<uint8_t> payload, bool kept) {
    Status st = c->phase == Phase::kClosed ? Status(StatusCode::kUnavailable, "closed")
                                           : verifyPayload(h, payload, c->name);
    if (!st) {
      if (kept) mail.release(h.src, h.length);
      if (c->phase != Phase::kClosed) fail(c, st);
      return;
    }
    if (c->phase == Phase::kUp) {
      session.dispatch(c, h, std::move(payload));
      return;
    }
    st = c->client ? onChallenge(c, payload) : onServerHandshake(c, h, payload);
    if (!st) handshakeFailed(c, st);
  }

  // --- handshake -----------------------------------------------------------------------------

  /// The connecting side: verify CHALLENGE, send AUTH; the peer is up once AUTH is handed to UCX
  /// (anything we send after it follows it on the endpoint).
  Status onChallenge(const std::shared_ptr<UcxConn>& c, const std::vector<uint8_t>& challenge) {
    auto auth = session.answerChallenge(c->client_hs, challenge);
    if (!auth) return auth.status();
    sendInternal(c, FrameType::kAuth, {}, std::vector<uint8_t>(auth->begin(), auth->end()));
    if (c->phase == Phase::kClosed) {
      return Status(StatusCode::kUnavailable, fmt::format("handshake with {} failed", c->name));
    }
    Status st = install(c, c->target);
    if (st) {
      for (Dial& d : dials) {
        if (d.conn == c) d.logged = false;
      }
    }
    return st;
  }

  /// The accepting side: check HELLO and answer CHALLENGE; then verify AUTH.
  Status onServerHandshake(const std::shared_ptr<UcxConn>& c, const FrameHeader& h,
                           const std::vector<uint8_t>& payload) {
    if (h.type == FrameType::kHello) {
      auto challenge = session.answerHello(c->server_hs, c->name, h.src, payload);
      if (!challenge) return challenge.status();
      c->client_rank = c->server_hs.client;
      sendInternal(c, FrameType::kChallenge, {},
                   std::vector<uint8_t>(challenge->begin(), challenge->end()));
      return Status::ok();
    }
    // AUTH (checkHeader let nothing else through).
    LW_RETURN_IF_ERROR(session.checkAuth(c->server_hs, c->name, payload));
    return install(c, c->client_rank);
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
    std::shared_ptr<UcxConn> c = it->second;
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
    if (stopping() || !listener) {
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
      if (session.noteHandshakeCap()) {
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
                     membership().peers[d.rank], why);
        d.logged = true;
      }
      d.next = now + d.backoff;
      d.backoff = std::min(d.backoff * 2, options.backoff_max);
    };
    std::string host;
    uint16_t port = 0;
    parseHostPort(membership().peers[d.rank], host, port);  // validated by start()
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
    c->address = membership().peers[d.rank];
    c->name = fmt::format("rank {} ({})", d.rank, c->address);
    c->phase = Phase::kConnecting;
    c->deadline = now + options.connect_timeout;
    d.conn = c;
    auto hello = session.hello(c->client_hs, d.rank);
    if (!hello) {
      handshakeFailed(c, hello.status());
      return;
    }
    sendInternal(c, FrameType::kHello, {}, std::vector<uint8_t>(hello->begin(), hello->end()),
                 [this, c](bool sent) {
                   if (sent && c->phase == Phase::kConnecting) {
                     c->phase = Phase::kHandshake;
                     c->deadline = Clock::now() + options.handshake_timeout;
                   }
                 });
  }

  /// Connection attempts, connect and handshake deadlines, pings and silence.
  void timers(Clock::time_point now) {
    if (stopping()) return;
    for (Dial& d : dials) {
      if (!d.conn && now >= d.next) dialOut(d);
    }
    std::vector<std::shared_ptr<UcxConn>> all;
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
      if (session.keepAlive(c, now)) c->next_ping = now + options.ping_interval;
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

UcxTransport::UcxTransport(std::unique_ptr<Impl> impl)
    : SessionTransport(impl->session), impl_(std::move(impl)) {}

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
  LW_RETURN_IF_ERROR(
      openUcxWorker(host, port, *addr, &Impl::onAm, &Impl::onConnRequest, impl.get(), *impl));
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
  s.session.markAllDown();
}

uint16_t UcxTransport::port() const { return impl_->listen_port; }

Status UcxTransport::start(Membership m) {
  Impl& s = *impl_;
  if (s.session.markStarted()) return failedPrecondition("peer: transport already started");
  LW_RETURN_IF_ERROR(PeerSession::checkMembership(m, [](Membership&) {
    return invalidArgument(
        "peer: the ucx transport needs every rank's address (peer.peers); a rendezvous is served "
        "by the tcp transport only");
  }));
  s.session.begin(std::move(m));
  const auto now = Clock::now();
  for (uint32_t r = s.membership().rank + 1; r < s.membership().world_size; ++r) {
    Impl::Dial d;
    d.rank = r;
    d.next = now;
    d.backoff = s.options.backoff_initial;
    s.dials.push_back(std::move(d));
  }
  s.thread = std::thread([&s] { s.run(); });
  return Status::ok();
}

// --- UcxConn: the ucx link
// --------------------------------------------------------------------------

void UcxConn::post(std::shared_ptr<SendOp> op) {
  impl.post([c = self(), op = std::move(op)] { c->impl.postSend(op); });
}

void UcxConn::sendOwned(FrameType type, const FrameKey& key, std::vector<uint8_t> payload) {
  impl.sendInternal(self(), type, key, std::move(payload));
}

void UcxConn::abandon(const std::shared_ptr<SendOp>& op) {
  // A frame handed to UCX cannot be withdrawn: closing the endpoint completes it (with an error).
  {
    std::lock_guard lock(impl.session.mutex());
    if (op->done) return;
    op->timed_out = true;
  }
  impl.closeConn(self(), fmt::format("a send to rank {} did not finish before its deadline", peer));
}

void UcxConn::close(const std::string& reason) { impl.closeConn(self(), reason); }

}  // namespace lightwire::proxy::peer
