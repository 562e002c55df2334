#include "proxy/peer/tcp_transport.h"

#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/socket.h>

#include <algorithm>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/ssl/error.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "metrics/metrics.h"
#include "proxy/peer/mailbox.h"
#include "proxy/peer/session.h"
#include "proxy/peer/tls.h"

namespace lightwire::proxy::peer {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
namespace ssl = asio::ssl;
// TLS over a connection's socket (TcpOptions::tls); the socket stays the TcpConn's own, so closing,
// socket options and addresses work the same with and without TLS.
using TlsStream = ssl::stream<tcp::socket&>;
using Clock = std::chrono::steady_clock;
using asio::awaitable;
using asio::use_awaitable;
using boost::system::error_code;

// LW_RETURN_IF_ERROR for coroutines.
#define LW_CO_RETURN_IF_ERROR(expr)               \
  do {                                            \
    ::lightwire::Status lw_status_ = (expr);      \
    if (!lw_status_.isOk()) co_return lw_status_; \
  } while (0)

constexpr size_t kReadChunk = size_t{8} << 20;  // payload read piece (liveness is per piece)
// SO_RCVLOWAT while reading a payload: wake the reader when this much has arrived.
constexpr size_t kLowWater = size_t{256} << 10;

/// One TCP connection, before and after its handshake: the `tcp` link (with TLS, the TLS stream
/// over its socket). Touched on the I/O thread only, but for post().
struct TcpConn final : Link {
  TcpConn(TcpTransport::Impl& i, tcp::socket s) : impl(i), socket(std::move(s)) {}
  void post(std::shared_ptr<SendOp> op) override;
  void sendOwned(FrameType type, const FrameKey& key, std::vector<uint8_t> payload) override;
  void abandon(const std::shared_ptr<SendOp>& op) override;
  void close(const std::string& reason) override;
  std::shared_ptr<TcpConn> self() { return std::static_pointer_cast<TcpConn>(shared_from_this()); }

  TcpTransport::Impl& impl;
  tcp::socket socket;
  // The TLS context the connection was made with: a reload (TcpTransport::reloadTls) gives new
  // connections another one, this one lives as long as the connection.
  std::shared_ptr<ssl::context> tls_ctx;
  // With TLS: set by the TLS handshake, before any other byte; every read and write then goes
  // through it (streamOf). Declared after `socket` and `tls_ctx`, which it refers to.
  std::unique_ptr<TlsStream> tls;
  uint64_t id = 0;
  bool closed = false;
  bool timed_out = false;  // the watchdog closed it
  std::deque<std::shared_ptr<SendOp>> queue;
  bool writing = false;
  size_t rcvlowat = 1;  // the socket's SO_RCVLOWAT
};

/// Calls op(stream) with the connection's byte stream: its TLS stream, or else its socket. Both
/// calls must return the same type (an awaitable, or void).
template <typename Op>
auto streamOf(TcpConn& c, Op&& op) {
  return c.tls ? op(*c.tls) : op(c.socket);
}

/// Closes a connection's socket unless disarmed first (connect and handshake deadlines).
class Watchdog {
 public:
  explicit Watchdog(const asio::any_io_executor& ex) : timer_(ex) {}
  ~Watchdog() { disarm(); }
  void arm(std::shared_ptr<TcpConn> c, std::chrono::milliseconds after) {
    disarm();
    armed_ = std::make_shared<bool>(true);
    timer_.expires_after(after);
    timer_.async_wait([c = std::move(c), armed = armed_](const error_code& ec) {
      if (ec || !*armed || c->closed) return;
      c->timed_out = true;
      error_code ignored;
      c->socket.close(ignored);
    });
  }
  void disarm() {
    if (armed_) *armed_ = false;
    armed_.reset();
    timer_.cancel();
  }

 private:
  asio::steady_timer timer_;
  std::shared_ptr<bool> armed_;
};

std::string endpointName(const tcp::socket& s) {
  error_code ec;
  auto ep = s.remote_endpoint(ec);
  if (ec) return "unknown address";
  return fmt::format("{}:{}", ep.address().to_string(), ep.port());
}

}  // namespace

struct TcpTransport::Impl {
  Impl(const TcpOptions& o, metrics::Metrics& m)
      : options(o),
        metrics(m),
        io(std::make_unique<asio::io_context>(1)),
        acceptor(*io),
        session(sessionOptions(o), m),
        mail(session.mail()) {
    session.setPost([this](std::function<void()> f) { asio::post(*io, std::move(f)); });
    session.setWrongDirection([this](const std::string& name, uint32_t client) {
      return fmt::format(
          "{} claims rank {}, which does not connect to us (rank {}): lower ranks connect to "
          "higher ones{}",
          name, client, session.membership().rank,
          session.rendezvousMode() ? ", and with a rendezvous every rank connects to rank 0" : "");
    });
    session.setRendezvous([this](const std::shared_ptr<Link>& link, const FrameHeader& h,
                                 const std::vector<uint8_t>& payload) {
      auto c = std::static_pointer_cast<TcpConn>(link);
      const std::string text(payload.begin(), payload.end());
      if (h.type == FrameType::kRegister) {
        onRegister(c, h.src, text);
      } else {
        onPeers(c, h.src, text);
      }
    });
  }

  static SessionOptions sessionOptions(const TcpOptions& o) {
    return SessionOptions{o.ping_interval, o.peer_timeout, o.max_frame_bytes,
                          o.max_kept_bytes_per_peer, o.max_kept_frames_per_peer};
  }

  TcpOptions options;
  metrics::Metrics& metrics;
  // Set by listen() with options.tls.enabled and replaced by reloadTls(); guarded by tls_mu.
  std::shared_ptr<ssl::context> tls_ctx;
  mutable std::mutex tls_mu;
  std::shared_ptr<ssl::context> tlsContext() const {
    std::lock_guard lock(tls_mu);
    return tls_ctx;
  }
  std::unique_ptr<asio::io_context> io;
  tcp::acceptor acceptor;
  // Accepted connections whose handshake has not ended (TcpOptions::max_pending_handshakes).
  size_t pending_handshakes = 0;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::thread thread;

  // I/O thread only.
  std::map<uint64_t, std::shared_ptr<TcpConn>> conns;
  uint64_t next_conn_id = 1;

  // The protocol (docs/peer-protocol.md): its mutex also guards `addresses`.
  PeerSession session;
  PeerMailboxes& mail;
  bool stopping() const { return session.stopping(); }
  // Every rank's peer address (index = rank; guarded by the session's mutex): membership.peers,
  // or what the rendezvous taught (rank 0 learns them from REGISTER frames, the others from PEERS).
  std::vector<std::string> addresses;
  bool peers_learned = false;  // I/O thread: rank > 0 got PEERS and started its connect loops

  const Membership& membership() const { return session.membership(); }
  std::string addressOf(uint32_t r) const {
    std::lock_guard lock(session.mutex());
    return addresses[r];
  }

  std::shared_ptr<TcpConn> newConn(tcp::socket s) {
    auto c = std::make_shared<TcpConn>(*this, std::move(s));
    c->id = next_conn_id++;
    conns.emplace(c->id, c);
    return c;
  }

  void setSocketOptions(tcp::socket& s) {
    error_code ignored;
    s.set_option(tcp::no_delay(true), ignored);
    if (options.socket_buffer_bytes > 0) {
      s.set_option(asio::socket_base::send_buffer_size(options.socket_buffer_bytes), ignored);
      s.set_option(asio::socket_base::receive_buffer_size(options.socket_buffer_bytes), ignored);
    }
  }

  // --- connection state ------------------------------------------------------------------------

  /// Closes `c` (I/O thread): fails its queued writes and, if it is a peer's connection, marks the
  /// peer down so that pending receives from it fail with `reason`.
  void closeConn(const std::shared_ptr<TcpConn>& c, const std::string& reason) {
    if (c->closed) return;
    c->closed = true;
    error_code ignored;
    c->socket.close(ignored);
    // The write in flight (the front, while writing) completes through its handler.
    for (size_t i = c->writing ? 1 : 0; i < c->queue.size(); ++i) {
      session.complete(c->queue[i], fmt::format("connection to {} closed: {}", c->name, reason));
    }
    if (c->writing && !c->queue.empty()) {
      c->queue.erase(c->queue.begin() + 1, c->queue.end());
    } else {
      c->queue.clear();
    }
    session.linkClosed(c, reason);
  }

  /// Makes `c` the connection of rank `peer`; refused when that rank is already connected.
  Status install(const std::shared_ptr<TcpConn>& c, uint32_t peer) {
    std::string detail = c->address;
    if (c->tls) {
      SSL* s = c->tls->native_handle();
      detail += fmt::format(", {} {}, certificate {}", SSL_get_version(s), SSL_get_cipher_name(s),
                            subjectOf(SSL_get0_peer_certificate(s)));
    }
    LW_RETURN_IF_ERROR(session.install(c, peer, detail));
    session.greet(c);
    return Status::ok();
  }

  void refuse(const std::shared_ptr<TcpConn>& c, const Status& why) {
    if (stopping()) return;
    session.noteRefused(c->address, why);
    closeConn(c, why.message());
  }

  // --- writing ---------------------------------------------------------------------------------

  void enqueue(const std::shared_ptr<TcpConn>& c, std::shared_ptr<SendOp> op) {
    if (c->closed) {
      session.complete(op, fmt::format("connection to {} is closed", c->name));
      return;
    }
    c->queue.push_back(std::move(op));
    if (!c->writing) writeNext(c);
  }

  void writeNext(const std::shared_ptr<TcpConn>& c) {
    if (c->queue.empty() || c->closed) {
      c->writing = false;
      return;
    }
    c->writing = true;
    auto op = c->queue.front();
    std::array<asio::const_buffer, 2> bufs = {asio::buffer(op->header),
                                              asio::buffer(op->payload.data(), op->payload.size())};
    auto done = [this, c, op](const error_code& ec, size_t n) {
      if (!c->queue.empty() && c->queue.front() == op) c->queue.pop_front();
      metrics.wire_bytes_sent.Increment(static_cast<double>(n));
      if (ec || c->closed) {
        session.complete(op, fmt::format("write to {} failed: {}", c->name,
                                         c->closed ? "connection closed" : ec.message()));
        c->writing = false;
        closeConn(c, fmt::format("write failed: {}", ec.message()));
        return;
      }
      session.complete(op, {});
      writeNext(c);
    };
    streamOf(*c, [&](auto& stream) { asio::async_write(stream, bufs, std::move(done)); });
  }

  // --- reading ---------------------------------------------------------------------------------

  awaitable<error_code> readExact(TcpConn& c, uint8_t* data, size_t n) {
    error_code ec;
    size_t off = 0;
    while (off < n && !ec) {
      // Wake up for large pieces only (SO_RCVLOWAT, never above what is still to come, or the
      // last bytes would never make the socket readable): a reader woken for every 64 KiB that
      // arrives spends its time in wake-ups on a busy machine.
      // Not with TLS: the bytes still to come on the socket are not the plaintext still to come
      // (record overhead, records already buffered by the TLS stream), and it reads at most a
      // record (16 KiB) at a time anyway.
      const size_t want = std::min(kLowWater, n - off);
      if (want != c.rcvlowat && !c.tls) {
        const int v = static_cast<int>(want);
        ::setsockopt(c.socket.native_handle(), SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v);
        c.rcvlowat = want;
      }
      const auto piece = asio::buffer(data + off, std::min(kReadChunk, n - off));
      const size_t got = co_await streamOf(c, [&](auto& stream) {
        return stream.async_read_some(piece, asio::redirect_error(use_awaitable, ec));
      });
      if (got > 0) {
        off += got;
        c.last_rx = Clock::now();
        metrics.wire_bytes_received.Increment(static_cast<double>(got));
      }
    }
    co_return ec;
  }

  std::string lostReason(const TcpConn& c, const error_code& ec, std::string_view during) {
    if (c.timed_out) return fmt::format("{} did not finish before its deadline", during);
    // A TLS peer that closes its socket without a TLS close_notify, as this transport does.
    if (ec == asio::error::eof || ec == ssl::error::stream_truncated) {
      return fmt::format("{} closed the connection ({})", c.name, during);
    }
    return fmt::format("{} failed: {}", during, ec.message());
  }

  /// A read or write of the handshake failed. A TLS error (the peer's certificate, a TLS alert,
  /// bytes that are not TLS) refuses the peer as a bad MAC does; anything else is the network.
  Status handshakeError(const TcpConn& c, const error_code& ec,
                        std::string_view what = "handshake") {
    std::string why = lostReason(c, ec, fmt::format("{} with {}", what, c.name));
    if (c.timed_out || ec.category() != asio::error::get_ssl_category()) {
      return Status(StatusCode::kUnavailable, std::move(why));
    }
    if (c.tls) {
      const long v = SSL_get_verify_result(c.tls->native_handle());
      if (v != X509_V_OK) why += fmt::format(" ({})", X509_verify_cert_error_string(v));
    }
    if (ERR_GET_REASON(static_cast<unsigned long>(ec.value())) == SSL_R_WRONG_VERSION_NUMBER) {
      why += " (no TLS 1.2 or 1.3 there: is peer.tls off on that side?)";
    }
    return failedPrecondition(std::move(why));
  }

  /// With TLS, the TLS handshake in `role`; the HMAC handshake then runs inside it.
  awaitable<Status> tlsHandshake(TcpConn& c, ssl::stream_base::handshake_type role) {
    c.tls_ctx = tlsContext();
    if (!c.tls_ctx) co_return Status::ok();
    try {
      c.tls = std::make_unique<TlsStream>(c.socket, *c.tls_ctx);
    } catch (const std::exception& e) {
      co_return internalError(fmt::format("TLS with {}: {}", c.name, e.what()));
    }
    error_code ec;
    co_await c.tls->async_handshake(role, asio::redirect_error(use_awaitable, ec));
    co_return ec ? handshakeError(c, ec, "TLS handshake") : Status::ok();
  }

  /// Reads one handshake frame of type `want`; checks its header and payload.
  awaitable<Status> readHandshakeFrame(TcpConn& c, FrameType want, std::optional<uint32_t> src,
                                       FrameHeader& header, std::vector<uint8_t>& payload) {
    std::array<uint8_t, kHeaderBytes> hb{};
    if (error_code ec = co_await readExact(c, hb.data(), hb.size())) {
      co_return handshakeError(c, ec);
    }
    auto h = decodeHeader(hb, session.checks(src, kChallengeBytes), c.name);
    if (!h && !c.tls && looksLikeTls(hb)) {
      co_return failedPrecondition(h.status().message() +
                                   " (it speaks TLS: peer.tls is on there and off here?)");
    }
    if (!h) co_return h.status();
    if (h->type != want) co_return PeerSession::unexpectedFrame(c.name, h->type, want);
    payload.assign(h->length, 0);
    if (error_code ec = co_await readExact(c, payload.data(), payload.size())) {
      co_return handshakeError(c, ec);
    }
    LW_CO_RETURN_IF_ERROR(verifyPayload(*h, payload, c.name));
    header = *h;
    co_return Status::ok();
  }

  awaitable<Status> writeFrame(TcpConn& c, FrameType type, std::span<const uint8_t> payload) {
    auto hb = session.header(type, {}, 0, payload);
    std::array<asio::const_buffer, 2> bufs = {asio::buffer(hb),
                                              asio::buffer(payload.data(), payload.size())};
    error_code ec;
    size_t n = co_await streamOf(c, [&](auto& stream) {
      return asio::async_write(stream, bufs, asio::redirect_error(use_awaitable, ec));
    });
    metrics.wire_bytes_sent.Increment(static_cast<double>(n));
    if (ec) co_return handshakeError(c, ec);
    co_return Status::ok();
  }

  /// The connecting side: HELLO, verify CHALLENGE, AUTH. Network failures are kUnavailable;
  /// anything else means the other side is not a peer of this job.
  awaitable<Status> clientHandshake(std::shared_ptr<TcpConn> c, uint32_t server) {
    LW_CO_RETURN_IF_ERROR(co_await tlsHandshake(*c, ssl::stream_base::client));
    ClientHandshake hs;
    auto hello = session.hello(hs, server);
    if (!hello) co_return hello.status();
    LW_CO_RETURN_IF_ERROR(co_await writeFrame(*c, FrameType::kHello, *hello));
    FrameHeader h;
    std::vector<uint8_t> challenge;
    LW_CO_RETURN_IF_ERROR(
        co_await readHandshakeFrame(*c, FrameType::kChallenge, server, h, challenge));
    auto auth = session.answerChallenge(hs, challenge);
    if (!auth) co_return auth.status();
    LW_CO_RETURN_IF_ERROR(co_await writeFrame(*c, FrameType::kAuth, *auth));
    co_return install(c, server);
  }

  /// The accepting side: check HELLO, answer CHALLENGE, verify AUTH.
  awaitable<Status> serverHandshake(std::shared_ptr<TcpConn> c) {
    LW_CO_RETURN_IF_ERROR(co_await tlsHandshake(*c, ssl::stream_base::server));
    FrameHeader h;
    std::vector<uint8_t> payload;
    LW_CO_RETURN_IF_ERROR(
        co_await readHandshakeFrame(*c, FrameType::kHello, std::nullopt, h, payload));
    ServerHandshake hs;
    auto challenge = session.answerHello(hs, c->name, h.src, payload);
    if (!challenge) co_return challenge.status();
    LW_CO_RETURN_IF_ERROR(co_await writeFrame(*c, FrameType::kChallenge, *challenge));
    std::vector<uint8_t> auth;
    LW_CO_RETURN_IF_ERROR(co_await readHandshakeFrame(*c, FrameType::kAuth, hs.client, h, auth));
    LW_CO_RETURN_IF_ERROR(session.checkAuth(hs, c->name, auth));
    co_return install(c, hs.client);
  }

  /// Reads frames from an authenticated connection until it fails or is closed.
  awaitable<void> serve(std::shared_ptr<TcpConn> c) {
    const uint32_t src = c->peer;
    const HeaderChecks hc = session.checks(src, options.max_frame_bytes);
    asio::co_spawn(*io, pinger(c), asio::detached);
    std::array<uint8_t, kHeaderBytes> hb{};
    std::string reason;
    while (reason.empty()) {
      if (error_code ec = co_await readExact(*c, hb.data(), hb.size())) {
        reason = c->closed ? "closed" : lostReason(*c, ec, "reading");
        break;
      }
      auto h = decodeHeader(hb, hc, c->name);
      if (!h) {
        reason = h.status().message();
        metrics.peerFramesRefused("header").Increment();
        break;
      }
      const FrameType type = h->type;
      if (Status st = PeerSession::checkNotHandshake(type, c->name); !st) {
        reason = st.message();
        metrics.peerFramesRefused("header").Increment();
        break;
      }
      const bool kept = type == FrameType::kData || type == FrameType::kAbort;
      if (kept && !mail.reserve(src, h->length, reason)) {
        metrics.peerFramesRefused("queue").Increment();
        break;
      }
      std::vector<uint8_t> payload = mail.takeBuffer(h->length);
      error_code ec = co_await readExact(*c, payload.data(), payload.size());
      Status st = ec ? Status(StatusCode::kUnavailable,
                              c->closed ? "closed" : lostReason(*c, ec, "reading"))
                     : verifyPayload(*h, payload, c->name);
      if (!st) {
        if (kept) mail.release(src, h->length);
        reason = st.message();
        if (!ec) metrics.peerFramesRefused("checksum").Increment();
        break;
      }
      session.dispatch(c, *h, std::move(payload));
    }
    closeConn(c, reason);
  }

  /// Pings the peer every ping_interval; closes the connection when it has been silent too long.
  awaitable<void> pinger(std::shared_ptr<TcpConn> c) {
    asio::steady_timer timer(co_await asio::this_coro::executor);
    while (!c->closed) {
      timer.expires_after(options.ping_interval);
      error_code ec;
      co_await timer.async_wait(asio::redirect_error(use_awaitable, ec));
      if (c->closed || stopping()) break;
      if (!session.keepAlive(c, Clock::now())) break;
    }
  }

  // --- rendezvous (docs/peer-protocol.md) ------------------------------------------------------

  /// Rank > 0, right after authenticating with rank 0: tells it where this rank listens.
  void sendRegister(const std::shared_ptr<TcpConn>& c) {
    std::string mine = membership().advertise;
    if (mine.empty()) {
      error_code ec;
      mine = fmt::format(":{}", acceptor.local_endpoint(ec).port());
    }
    c->sendOwned(FrameType::kRegister, {}, std::vector<uint8_t>(mine.begin(), mine.end()));
  }

  /// A frame that is not for this rank closes the connection (as any malformed frame does).
  void misplaced(const std::shared_ptr<TcpConn>& c, const char* what) {
    closeConn(c, fmt::format("malformed frame from {}: unexpected {} frame", c->name, what));
  }

  /// Rank 0: rank `src` listens at `text` (":port" = on the address its connection comes from).
  /// Once every rank is known, every rank gets PEERS; later, a rank that registers again (a
  /// restarted one) gets them at once, and everyone again if its address changed.
  void onRegister(const std::shared_ptr<TcpConn>& c, uint32_t src, const std::string& text) {
    if (!session.rendezvousMode() || membership().rank != 0) return misplaced(c, "REGISTER");
    std::string address = text;
    if (!address.empty() && address.front() == ':') {
      error_code ec;
      const auto remote = c->socket.remote_endpoint(ec);
      if (ec) return closeConn(c, "rendezvous: remote address unknown: " + ec.message());
      const auto ip = remote.address();
      address = (ip.is_v6() ? "[" + ip.to_string() + "]" : ip.to_string()) + address;
    }
    std::string host;
    uint16_t port = 0;
    if (address.find('\n') != std::string::npos || !parseHostPort(address, host, port)) {
      return closeConn(c, fmt::format("malformed frame from {}: REGISTER address '{}'", c->name,
                                      address.substr(0, 64)));
    }
    bool complete = false, changed = false;
    std::string list;
    std::vector<std::shared_ptr<Link>> targets;
    {
      std::lock_guard lock(session.mutex());
      const bool was_complete =
          std::all_of(addresses.begin() + 1, addresses.end(), [](auto& a) { return !a.empty(); });
      changed = addresses[src] != address;
      addresses[src] = address;
      complete =
          std::all_of(addresses.begin() + 1, addresses.end(), [](auto& a) { return !a.empty(); });
      if (complete) {
        for (const auto& a : addresses) list += a + "\n";
        if (!was_complete || changed) {
          for (uint32_t r = 0; r < membership().world_size; ++r) {
            if (auto& link = session.linkLocked(r)) targets.push_back(link);
          }
        } else {
          targets.push_back(c);
        }
        if (!was_complete) {
          spdlog::info("peer: rendezvous complete: all {} ranks registered",
                       membership().world_size);
        }
      }
    }
    spdlog::info("peer: rank {} registered at {}", src, address);
    if (!complete) return;
    for (auto& t : targets) {
      t->sendOwned(FrameType::kPeers, {}, std::vector<uint8_t>(list.begin(), list.end()));
    }
  }

  /// Rank > 0: every rank's address from rank 0; the first time, connect to the higher ranks.
  void onPeers(const std::shared_ptr<TcpConn>& c, uint32_t src, const std::string& text) {
    if (!session.rendezvousMode() || membership().rank == 0 || src != 0)
      return misplaced(c, "PEERS");
    std::vector<std::string> lines;
    size_t at = 0;
    while (at < text.size()) {
      const size_t nl = text.find('\n', at);
      if (nl == std::string::npos) break;
      lines.push_back(text.substr(at, nl - at));
      at = nl + 1;
    }
    bool ok = at == text.size() && lines.size() == membership().world_size;
    for (uint32_t r = 1; ok && r < lines.size(); ++r) {
      std::string host;
      uint16_t port = 0;
      ok = parseHostPort(lines[r], host, port);
    }
    if (!ok) {
      return closeConn(c, fmt::format("malformed frame from {}: PEERS is not {} addresses", c->name,
                                      membership().world_size));
    }
    {
      std::lock_guard lock(session.mutex());
      for (uint32_t r = 1; r < lines.size(); ++r) {
        if (r != membership().rank) addresses[r] = lines[r];
      }
    }
    if (peers_learned) return;
    peers_learned = true;
    spdlog::info("peer: rendezvous: learned the addresses of all {} ranks",
                 membership().world_size);
    for (uint32_t r = membership().rank + 1; r < membership().world_size; ++r) {
      asio::co_spawn(*io, connectLoop(r), asio::detached);
    }
  }

  // --- accepting and connecting ----------------------------------------------------------------

  awaitable<void> acceptLoop() {
    for (;;) {
      tcp::socket s(*io);
      error_code ec;
      co_await acceptor.async_accept(s, asio::redirect_error(use_awaitable, ec));
      if (stopping() || ec == asio::error::operation_aborted) co_return;
      if (ec) {
        spdlog::warn("peer: accept failed: {}", ec.message());
        asio::steady_timer pause(*io, std::chrono::milliseconds(50));  // e.g. out of descriptors
        co_await pause.async_wait(asio::redirect_error(use_awaitable, ec));
        continue;
      }
      if (pending_handshakes >= options.max_pending_handshakes) {
        error_code ignored;
        s.close(ignored);
        if (session.noteHandshakeCap()) {
          spdlog::warn(
              "peer: {} connections are in their handshake already (at most {}); closing new ones "
              "until they finish (limit hits counted in lightwire_limit_hits_total)",
              pending_handshakes, options.max_pending_handshakes);
        }
        continue;
      }
      setSocketOptions(s);
      auto c = newConn(std::move(s));
      c->address = endpointName(c->socket);
      c->name = c->address;
      ++pending_handshakes;  // from accept to the handshake's verdict (serverSession)
      asio::co_spawn(*io, serverSession(c), asio::detached);
    }
  }

  awaitable<void> serverSession(std::shared_ptr<TcpConn> c) {
    Watchdog watchdog(io->get_executor());
    watchdog.arm(c, options.handshake_timeout);
    Status st = co_await serverHandshake(c);
    --pending_handshakes;
    watchdog.disarm();
    if (!st) {
      refuse(c, st);
    } else {
      co_await serve(c);
    }
    closeConn(c, "done");
    conns.erase(c->id);
  }

  /// Connects to `server` (a higher rank) for as long as the transport runs.
  awaitable<void> connectLoop(uint32_t server) {
    tcp::resolver resolver(*io);
    asio::steady_timer timer(*io);
    auto backoff = options.backoff_initial;
    bool logged = false;
    while (!stopping()) {
      bool served = false;
      error_code ec;
      // Read at every attempt: a rendezvous may teach a new address (a restarted rank).
      const std::string address = addressOf(server);
      std::string host;
      uint16_t port = 0;
      parseHostPort(address, host, port);  // validated by start() or the PEERS frame
      auto endpoints = co_await resolver.async_resolve(host, std::to_string(port),
                                                       asio::redirect_error(use_awaitable, ec));
      if (!ec) {
        auto c = newConn(tcp::socket(*io));
        c->address = address;
        c->name = fmt::format("rank {} ({})", server, c->address);
        Watchdog watchdog(io->get_executor());
        watchdog.arm(c, options.connect_timeout);
        co_await asio::async_connect(c->socket, endpoints, asio::redirect_error(use_awaitable, ec));
        Status st;
        if (ec || stopping()) {
          st = Status(StatusCode::kUnavailable,
                      c->timed_out ? "connect timed out" : "connect: " + ec.message());
        } else {
          setSocketOptions(c->socket);
          watchdog.arm(c, options.handshake_timeout);
          st = co_await clientHandshake(c, server);
        }
        watchdog.disarm();
        if (st) {
          logged = false;
          served = true;
          if (session.rendezvousMode() && server == 0) sendRegister(c);
          co_await serve(c);
        } else if (!stopping()) {
          if (st.code() != StatusCode::kUnavailable) {
            refuse(c, st);
          } else if (!logged) {
            spdlog::info("peer: cannot reach rank {} at {} yet ({}); retrying", server, c->address,
                         st.message());
            logged = true;
          }
        }
        closeConn(c, st ? "done" : st.message());
        conns.erase(c->id);
      } else if (!logged) {
        spdlog::info("peer: cannot resolve {} for rank {} ({}); retrying", address, server,
                     ec.message());
        logged = true;
      }
      if (stopping()) break;
      if (served) backoff = options.backoff_initial;
      timer.expires_after(backoff);
      co_await timer.async_wait(asio::redirect_error(use_awaitable, ec));
      if (!served) backoff = std::min(backoff * 2, options.backoff_max);
    }
  }

  void closeAll() {
    session.setStopping();
    error_code ignored;
    acceptor.close(ignored);
    for (auto& [id, c] : conns) closeConn(c, "transport shutting down");
  }
};

// --- TcpTransport --------------------------------------------------------------------------------

TcpTransport::TcpTransport(std::unique_ptr<Impl> impl)
    : SessionTransport(impl->session), impl_(std::move(impl)) {}

Result<std::unique_ptr<TcpTransport>> TcpTransport::listen(const std::string& host, uint16_t port,
                                                           const TcpOptions& options,
                                                           metrics::Metrics& metrics) {
  if (options.max_frame_bytes > options.max_kept_bytes_per_peer) {
    return invalidArgument("peer: max_frame_bytes exceeds max_kept_bytes_per_peer");
  }
  auto impl = std::make_unique<Impl>(options, metrics);
  if (options.tls.enabled) {
    auto ctx = makeTlsContext(options.tls);
    if (!ctx) return ctx.status();
    impl->tls_ctx = std::move(*ctx);
    setCertificateExpiry(metrics, *impl->tls_ctx);
  }
  error_code ec;
  auto address = asio::ip::make_address(host, ec);
  if (ec)
    return invalidArgument(fmt::format("peer: bad listen address '{}': {}", host, ec.message()));
  tcp::endpoint ep(address, port);
  auto& a = impl->acceptor;
  if (a.open(ep.protocol(), ec); !ec) a.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) a.bind(ep, ec);
  if (!ec) a.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("peer: cannot listen on {}:{}: {}", host, port, ec.message()));
  }
  if (impl->tls_ctx) {
    const auto& t = options.tls;
    spdlog::info("peer: TLS on: {}, {}", describeCertificate(t, *impl->tls_ctx),
                 t.verify_peer ? "peers verified against CA " + t.ca_file
                               : "peers' certificates NOT verified (peer.tls.verify false)");
  }
  return std::unique_ptr<TcpTransport>(new TcpTransport(std::move(impl)));
}

std::optional<Transport::TlsCertificate> TcpTransport::tlsCertificate() const {
  const auto ctx = impl_->tlsContext();
  if (!ctx) return std::nullopt;
  return certificateOf(impl_->options.tls, *ctx);
}

Result<std::string> TcpTransport::reloadTls() {
  const auto& t = impl_->options.tls;
  if (!t.enabled) return failedPrecondition("peer.tls is off: no certificate to reload");
  auto ctx = makeTlsContext(t);
  if (!ctx) return ctx.status();
  std::shared_ptr<ssl::context> fresh = std::move(*ctx);
  setCertificateExpiry(impl_->metrics, *fresh);
  std::string what = describeCertificate(t, *fresh);
  {
    std::lock_guard lock(impl_->tls_mu);
    impl_->tls_ctx = std::move(fresh);
  }
  return what;
}

TcpTransport::~TcpTransport() {
  Impl& s = *impl_;
  if (s.thread.joinable()) {
    asio::post(*s.io, [&s] {
      s.closeAll();
      s.io->stop();
    });
    s.thread.join();
  }
  s.session.setStopping();
  // The I/O thread is gone: close what is left here, then destroy the suspended coroutines
  // (io_context's destructor) while everything they refer to still exists.
  error_code ignored;
  s.acceptor.close(ignored);
  for (auto& [id, c] : s.conns) c->socket.close(ignored);
  s.conns.clear();
  s.work.reset();
  s.io.reset();
  s.session.markAllDown();
}

uint16_t TcpTransport::port() const {
  error_code ec;
  auto ep = impl_->acceptor.local_endpoint(ec);
  return ec ? 0 : ep.port();
}

/// A membership with a rendezvous: rank 0's address instead of every rank's.
static Status checkRendezvous(Membership& m) {
  std::string host;
  uint16_t port = 0;
  if (!m.peers.empty()) return invalidArgument("peer: give peer addresses or a rendezvous");
  if (!parseHostPort(m.rendezvous, host, port)) {
    return invalidArgument(fmt::format("peer: bad rendezvous address '{}'", m.rendezvous));
  }
  if (!m.advertise.empty() && !parseHostPort(m.advertise, host, port)) {
    return invalidArgument(fmt::format("peer: bad advertised address '{}'", m.advertise));
  }
  m.peers.assign(m.world_size, "");
  if (m.rank != 0) m.peers[0] = m.rendezvous;
  return Status::ok();
}

Status TcpTransport::start(Membership m) {
  Impl& s = *impl_;
  if (s.session.markStarted()) return failedPrecondition("peer: transport already started");
  LW_RETURN_IF_ERROR(PeerSession::checkMembership(m, checkRendezvous));
  s.addresses = m.peers;
  s.session.begin(std::move(m));
  s.work.emplace(s.io->get_executor());
  asio::co_spawn(*s.io, s.acceptLoop(), asio::detached);
  const Membership& mm = s.membership();
  if (s.session.rendezvousMode()) {
    // Rank 0 waits for the others; they connect to it and, once it has told them every rank's
    // address (PEERS), to the ranks above them.
    if (mm.rank != 0) asio::co_spawn(*s.io, s.connectLoop(0), asio::detached);
  } else {
    for (uint32_t r = mm.rank + 1; r < mm.world_size; ++r) {
      asio::co_spawn(*s.io, s.connectLoop(r), asio::detached);
    }
  }
  s.thread = std::thread([&s] { s.io->run(); });
  return Status::ok();
}

// --- TcpConn: the tcp link
// --------------------------------------------------------------------------

void TcpConn::post(std::shared_ptr<SendOp> op) {
  asio::post(*impl.io, [c = self(), op = std::move(op)] { c->impl.enqueue(c, op); });
}

void TcpConn::sendOwned(FrameType type, const FrameKey& key, std::vector<uint8_t> payload) {
  impl.enqueue(self(), impl.session.ownedOp(type, key, std::move(payload)));
}

void TcpConn::abandon(const std::shared_ptr<SendOp>& op) {
  if (op->done) return;
  const bool in_flight = writing && !queue.empty() && queue.front() == op;
  if (in_flight) {
    impl.closeConn(self(),
                   fmt::format("a send to rank {} did not finish before its deadline", peer));
  } else {
    queue.erase(std::remove(queue.begin(), queue.end(), op), queue.end());
    impl.session.completeTimedOut(op);
  }
}

void TcpConn::close(const std::string& reason) { impl.closeConn(self(), reason); }

}  // namespace lightwire::proxy::peer
