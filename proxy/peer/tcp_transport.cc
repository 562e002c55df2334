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

namespace lightwire::proxy::peer {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
namespace ssl = asio::ssl;
// TLS over a connection's socket (TcpOptions::tls); the socket stays the Conn's own, so closing,
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

constexpr uint32_t kNoPeer = UINT32_MAX;
constexpr size_t kReadChunk = size_t{8} << 20;  // payload read piece (liveness is per piece)
// SO_RCVLOWAT while reading a payload: wake the reader when this much has arrived.
constexpr size_t kLowWater = size_t{256} << 10;

/// One frame waiting in a connection's write queue, and the outcome the sender waits for.
struct WriteOp {
  std::array<uint8_t, kHeaderBytes> header{};
  std::vector<uint8_t> owned;        // internal frames own their payload ...
  std::span<const uint8_t> payload;  // ... send() lends it until done
  uint32_t dst = kNoPeer;
  bool done = false;  // guarded by Impl::mu
  std::string error;  // guarded by Impl::mu; empty: written
};

/// One TCP connection, before and after its handshake. Touched on the I/O thread only.
struct Conn {
  explicit Conn(tcp::socket s) : socket(std::move(s)) {}
  tcp::socket socket;
  // The TLS context the connection was made with: a reload (TcpTransport::reloadTls) gives new
  // connections another one, this one lives as long as the connection.
  std::shared_ptr<ssl::context> tls_ctx;
  // With TLS: set by the TLS handshake, before any other byte; every read and write then goes
  // through it (streamOf). Declared after `socket` and `tls_ctx`, which it refers to.
  std::unique_ptr<TlsStream> tls;
  uint64_t id = 0;
  uint32_t peer = kNoPeer;  // set once authenticated
  std::string name;         // "rank N" or the remote address, for messages
  std::string address;
  bool closed = false;
  bool timed_out = false;  // the watchdog closed it
  std::deque<std::shared_ptr<WriteOp>> queue;
  bool writing = false;
  Clock::time_point last_rx = Clock::now();
  size_t rcvlowat = 1;  // the socket's SO_RCVLOWAT
};

/// Calls op(stream) with the connection's byte stream: its TLS stream, or else its socket. Both
/// calls must return the same type (an awaitable, or void).
template <typename Op>
auto streamOf(Conn& c, Op&& op) {
  return c.tls ? op(*c.tls) : op(c.socket);
}

/// Closes a connection's socket unless disarmed first (connect and handshake deadlines).
class Watchdog {
 public:
  explicit Watchdog(const asio::any_io_executor& ex) : timer_(ex) {}
  ~Watchdog() { disarm(); }
  void arm(std::shared_ptr<Conn> c, std::chrono::milliseconds after) {
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

// --- TLS -----------------------------------------------------------------------------------------

/// The reason of the oldest error in this thread's OpenSSL error queue (the root cause), which is
/// then cleared.
std::string opensslReason() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  const char* reason = e ? ERR_reason_error_string(e) : nullptr;
  return reason ? reason : "unknown OpenSSL error";
}

/// An error about file `path` of option `key` ("peer.tls.cert_file /x.pem: no start line").
Status tlsFileError(const char* key, const std::string& path, const std::string& why) {
  return invalidArgument(fmt::format("{} {}: {}", key, path, why));
}

/// `path` of option `key` is set and readable.
Status checkReadable(const char* key, const std::string& path) {
  if (path.empty()) return invalidArgument(fmt::format("{} is not set (peer.tls is on)", key));
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return tlsFileError(key, path, std::strerror(errno));
  std::fclose(f);
  return Status::ok();
}

/// The TLS context of every connection: TLS >= 1.2, this node's certificate and key, the CA that
/// peers' certificates are verified against (both roles: a peer connects or is connected to).
Result<std::unique_ptr<ssl::context>> makeTlsContext(const TcpOptions::Tls& o) {
  LW_RETURN_IF_ERROR(checkReadable("peer.tls.cert_file", o.cert_file));
  LW_RETURN_IF_ERROR(checkReadable("peer.tls.key_file", o.key_file));
  if (o.verify_peer || !o.ca_file.empty()) {
    LW_RETURN_IF_ERROR(checkReadable("peer.tls.ca_file", o.ca_file));
  }
  std::unique_ptr<ssl::context> ctx;
  try {
    ctx = std::make_unique<ssl::context>(ssl::context::tls);
  } catch (const std::exception& e) {
    return internalError(fmt::format("peer: cannot create a TLS context: {}", e.what()));
  }
  SSL_CTX* native = ctx->native_handle();
  ERR_clear_error();
  SSL_CTX_set_min_proto_version(native, TLS1_2_VERSION);
  SSL_CTX_set_options(native, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_TICKET);
  SSL_CTX_set_num_tickets(native, 0);  // no session resumption: nothing to hand out
  SSL_CTX_set_session_cache_mode(native, SSL_SESS_CACHE_OFF);
  // An encrypted key fails here rather than prompting on the terminal.
  SSL_CTX_set_default_passwd_cb(native, [](char*, int, int, void*) { return 0; });
  if (SSL_CTX_use_certificate_chain_file(native, o.cert_file.c_str()) != 1) {
    return tlsFileError("peer.tls.cert_file", o.cert_file, opensslReason());
  }
  const std::string mismatch = "key does not match certificate peer.tls.cert_file " + o.cert_file;
  if (SSL_CTX_use_PrivateKey_file(native, o.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    const unsigned long e = ERR_peek_error();
    const bool other_key =
        ERR_GET_LIB(e) == ERR_LIB_X509 && ERR_GET_REASON(e) == X509_R_KEY_VALUES_MISMATCH;
    const std::string why = opensslReason() + " (an unencrypted PEM private key is needed)";
    return tlsFileError("peer.tls.key_file", o.key_file, other_key ? mismatch : why);
  }
  if (SSL_CTX_check_private_key(native) != 1) {
    ERR_clear_error();
    return tlsFileError("peer.tls.key_file", o.key_file, mismatch);
  }
  if (!o.ca_file.empty() &&
      SSL_CTX_load_verify_locations(native, o.ca_file.c_str(), nullptr) != 1) {
    return tlsFileError("peer.tls.ca_file", o.ca_file, opensslReason());
  }
  SSL_CTX_set_verify(
      native, o.verify_peer ? SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT : SSL_VERIFY_NONE,
      nullptr);
  return ctx;
}

/// A subject name for the log ("/CN=node-3").
std::string subjectOf(X509* cert) {
  if (!cert) return "none";
  char buf[256];
  return X509_NAME_oneline(X509_get_subject_name(cert), buf, sizeof buf) ? buf : "?";
}

/// The end of the certificate's validity, in seconds since the epoch (nullopt: unreadable).
std::optional<int64_t> notAfterOf(X509* cert) {
  std::tm tm{};
  if (!cert || ASN1_TIME_to_tm(X509_get0_notAfter(cert), &tm) != 1) return std::nullopt;
  return static_cast<int64_t>(timegm(&tm));
}

/// Unix time as "2027-03-01T12:00:00Z" ("" if it cannot be shown).
std::string utcText(int64_t unix_time) {
  const std::time_t t = static_cast<std::time_t>(unix_time);
  std::tm tm{};
  char buf[32];
  if (!gmtime_r(&t, &tm) || std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0) {
    return "";
  }
  return buf;
}

/// The certificate of `ctx` as Transport::tlsCertificate() describes it.
Transport::TlsCertificate certificateOf(const TcpOptions::Tls& o, ssl::context& ctx) {
  X509* cert = SSL_CTX_get0_certificate(ctx.native_handle());
  Transport::TlsCertificate c{.file = o.cert_file, .subject = subjectOf(cert)};
  if (const auto end = notAfterOf(cert)) {
    c.not_after = *end;
    c.not_after_utc = utcText(*end);
  }
  return c;
}

/// "certificate /etc/lw/node.pem (/CN=node-3), valid until 2027-03-01T12:00:00Z" for the log.
std::string describeCertificate(const TcpOptions::Tls& o, ssl::context& ctx) {
  const auto c = certificateOf(o, ctx);
  std::string out = fmt::format("certificate {} ({})", c.file, c.subject);
  if (!c.not_after_utc.empty()) out += ", valid until " + c.not_after_utc;
  return out;
}

/// lightwire_peer_tls_certificate_expiry_timestamp_seconds: when this node's certificate expires.
void setCertificateExpiry(metrics::Metrics& metrics, ssl::context& ctx) {
  if (const auto end = notAfterOf(SSL_CTX_get0_certificate(ctx.native_handle()))) {
    metrics.tlsCertificateExpiry().Set(static_cast<double>(*end));
  }
}

/// Whether these bytes (a frame header's place) start a TLS handshake record.
bool looksLikeTls(std::span<const uint8_t> b) {
  return b.size() >= 3 && b[0] == 0x16 && b[1] == 0x03 && b[2] <= 0x04;
}

}  // namespace

struct TcpTransport::Impl {
  Impl(const TcpOptions& o, metrics::Metrics& m)
      : options(o),
        metrics(m),
        io(std::make_unique<asio::io_context>(1)),
        acceptor(*io),
        mail(o.max_kept_bytes_per_peer, o.max_kept_frames_per_peer),
        mu(mail.mutex()),
        cv(mail.cv()) {}

  TcpOptions options;
  metrics::Metrics& metrics;
  Membership membership;
  uint64_t job_hash = 0;
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
  std::chrono::steady_clock::time_point last_handshake_warning{};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::thread thread;
  std::atomic<bool> started{false};
  std::atomic<bool> stopping{false};

  // I/O thread only.
  std::map<uint64_t, std::shared_ptr<Conn>> conns;
  uint64_t next_conn_id = 1;

  // Per peer: received frames, aborts, up or down (DESIGN.md §4). Its mutex (mu) also guards
  // `links`, `addresses` and the outcome of every WriteOp, and its cv wakes their waiters.
  PeerMailboxes mail;
  std::mutex& mu;
  std::condition_variable& cv;
  std::vector<std::shared_ptr<Conn>> links;  // index = rank: the authenticated connection, if up
  // Every rank's peer address (index = rank; guarded by mu): membership.peers, or what the
  // rendezvous taught (rank 0 learns them from REGISTER frames, the others from PEERS).
  std::vector<std::string> addresses;
  bool peers_learned = false;
  // Set before start() (setJobState), used on the I/O thread.
  std::function<std::vector<uint8_t>()> provide_state;
  std::function<void(uint32_t, std::span<const uint8_t>)>
      take_state;  // I/O thread: rank > 0 got PEERS and started its connect loops

  bool rendezvousMode() const { return !membership.rendezvous.empty(); }
  /// Whether rank a opens the connection between a and b: the lower rank, except that with a
  /// rendezvous every rank connects to rank 0 (it cannot know their addresses before).
  bool initiates(uint32_t a, uint32_t b) const {
    if (rendezvousMode() && (a == 0 || b == 0)) return b == 0;
    return a < b;
  }
  std::string addressOf(uint32_t r) const {
    std::lock_guard lock(mu);
    return addresses[r];
  }

  /// A frame queued on a connection, and that connection (to cancel it at a deadline).
  struct Posted {
    std::shared_ptr<Conn> conn;
    std::shared_ptr<WriteOp> op;
  };
  std::mutex posted_mu;
  std::vector<Posted> posted;  // post()ed, not yet flushed

  Result<Posted> queueFrame(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                            std::span<const uint8_t> payload);
  Status awaitFrames(std::vector<Posted>& ops, Clock::time_point deadline);

  HeaderChecks checks(std::optional<uint32_t> src, uint64_t max) const {
    return HeaderChecks{job_hash, membership.world_size, membership.rank, src, max};
  }

  std::shared_ptr<Conn> newConn(tcp::socket s) {
    auto c = std::make_shared<Conn>(std::move(s));
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

  void complete(const std::shared_ptr<WriteOp>& op, std::string error) {
    std::lock_guard lock(mu);
    op->done = true;
    op->error = std::move(error);
    cv.notify_all();
  }

  /// Closes `c` (I/O thread): fails its queued writes and, if it is a peer's connection, marks the
  /// peer down so that pending receives from it fail with `reason`.
  void closeConn(const std::shared_ptr<Conn>& c, const std::string& reason) {
    if (c->closed) return;
    c->closed = true;
    error_code ignored;
    c->socket.close(ignored);
    // The write in flight (the front, while writing) completes through its handler.
    for (size_t i = c->writing ? 1 : 0; i < c->queue.size(); ++i) {
      complete(c->queue[i], fmt::format("connection to {} closed: {}", c->name, reason));
    }
    if (c->writing && !c->queue.empty()) {
      c->queue.erase(c->queue.begin() + 1, c->queue.end());
    } else {
      c->queue.clear();
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
      c->last_rx = Clock::now();
      links[peer] = c;
      mail.markUpLocked(peer);
    }
    metrics.peerUp(peer).Set(1);
    if (c->tls) {
      SSL* s = c->tls->native_handle();
      spdlog::info("peer: connected to rank {} ({}, {} {}, certificate {})", peer, c->address,
                   SSL_get_version(s), SSL_get_cipher_name(s),
                   subjectOf(SSL_get0_peer_certificate(s)));
    } else {
      spdlog::info("peer: connected to rank {} ({})", peer, c->address);
    }
    if (provide_state) sendInternal(c, FrameType::kState, {}, provide_state());
    return Status::ok();
  }

  void refuse(const std::shared_ptr<Conn>& c, const Status& why) {
    if (stopping) return;
    metrics.auth_failures.Increment();
    spdlog::warn("peer: refused connection with {}: {}", c->address, why.message());
    closeConn(c, why.message());
  }

  // --- writing ---------------------------------------------------------------------------------

  void enqueue(const std::shared_ptr<Conn>& c, std::shared_ptr<WriteOp> op) {
    if (c->closed) {
      complete(op, fmt::format("connection to {} is closed", c->name));
      return;
    }
    c->queue.push_back(std::move(op));
    if (!c->writing) writeNext(c);
  }

  void writeNext(const std::shared_ptr<Conn>& c) {
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
        complete(op, fmt::format("write to {} failed: {}", c->name,
                                 c->closed ? "connection closed" : ec.message()));
        c->writing = false;
        closeConn(c, fmt::format("write failed: {}", ec.message()));
        return;
      }
      complete(op, {});
      writeNext(c);
    };
    streamOf(*c, [&](auto& stream) { asio::async_write(stream, bufs, std::move(done)); });
  }

  /// Queues an internal frame (ping, pong, abort) that owns its payload; nobody waits for it.
  void sendInternal(const std::shared_ptr<Conn>& c, FrameType type, const FrameKey& key,
                    std::vector<uint8_t> payload) {
    auto op = std::make_shared<WriteOp>();
    op->header = encodeHeader(makeHeader(type, key, 0, job_hash, membership.rank, payload));
    op->owned = std::move(payload);
    op->payload = op->owned;
    enqueue(c, std::move(op));
  }

  // --- reading ---------------------------------------------------------------------------------

  awaitable<error_code> readExact(Conn& c, uint8_t* data, size_t n) {
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

  std::string lostReason(const Conn& c, const error_code& ec, std::string_view during) {
    if (c.timed_out) return fmt::format("{} did not finish before its deadline", during);
    // A TLS peer that closes its socket without a TLS close_notify, as this transport does.
    if (ec == asio::error::eof || ec == ssl::error::stream_truncated) {
      return fmt::format("{} closed the connection ({})", c.name, during);
    }
    return fmt::format("{} failed: {}", during, ec.message());
  }

  /// A read or write of the handshake failed. A TLS error (the peer's certificate, a TLS alert,
  /// bytes that are not TLS) refuses the peer as a bad MAC does; anything else is the network.
  Status handshakeError(const Conn& c, const error_code& ec, std::string_view what = "handshake") {
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
  awaitable<Status> tlsHandshake(Conn& c, ssl::stream_base::handshake_type role) {
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
  awaitable<Status> readHandshakeFrame(Conn& c, FrameType want, std::optional<uint32_t> src,
                                       FrameHeader& header, std::vector<uint8_t>& payload) {
    std::array<uint8_t, kHeaderBytes> hb{};
    if (error_code ec = co_await readExact(c, hb.data(), hb.size())) {
      co_return handshakeError(c, ec);
    }
    auto h = decodeHeader(hb, checks(src, kChallengeBytes), c.name);
    if (!h && !c.tls && looksLikeTls(hb)) {
      co_return failedPrecondition(h.status().message() +
                                   " (it speaks TLS: peer.tls is on there and off here?)");
    }
    if (!h) co_return h.status();
    if (h->type != want) {
      co_return failedPrecondition(fmt::format("{} sent a {} frame, expected {}", c.name,
                                               frameTypeName(h->type), frameTypeName(want)));
    }
    payload.assign(h->length, 0);
    if (error_code ec = co_await readExact(c, payload.data(), payload.size())) {
      co_return handshakeError(c, ec);
    }
    LW_CO_RETURN_IF_ERROR(verifyPayload(*h, payload, c.name));
    header = *h;
    co_return Status::ok();
  }

  awaitable<Status> writeFrame(Conn& c, FrameType type, std::span<const uint8_t> payload) {
    auto hb = encodeHeader(makeHeader(type, {}, 0, job_hash, membership.rank, payload));
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
  awaitable<Status> clientHandshake(std::shared_ptr<Conn> c, uint32_t server) {
    const Membership& m = membership;
    LW_CO_RETURN_IF_ERROR(co_await tlsHandshake(*c, ssl::stream_base::client));
    auto nonce = randomNonce();
    if (!nonce) co_return nonce.status();
    auto hello = encodeHello(Hello{m.world_size, server, *nonce});
    LW_CO_RETURN_IF_ERROR(co_await writeFrame(*c, FrameType::kHello, hello));
    FrameHeader h;
    std::vector<uint8_t> challenge;
    LW_CO_RETURN_IF_ERROR(
        co_await readHandshakeFrame(*c, FrameType::kChallenge, server, h, challenge));
    Nonce server_nonce{};
    std::copy_n(challenge.begin(), kNonceBytes, server_nonce.begin());
    const Mac expected = handshakeMac(MacRole::kServer, m.secret, m.job_id, *nonce, server_nonce,
                                      m.rank, server, m.world_size);
    if (!macEqual(expected, std::span(challenge).subspan(kNonceBytes))) {
      co_return failedPrecondition(fmt::format(
          "rank {} failed to prove knowledge of the job secret (wrong secret?)", server));
    }
    const Mac auth = handshakeMac(MacRole::kClient, m.secret, m.job_id, *nonce, server_nonce,
                                  m.rank, server, m.world_size);
    LW_CO_RETURN_IF_ERROR(co_await writeFrame(*c, FrameType::kAuth, auth));
    co_return install(c, server);
  }

  /// The accepting side: check HELLO, answer CHALLENGE, verify AUTH.
  awaitable<Status> serverHandshake(std::shared_ptr<Conn> c) {
    const Membership& m = membership;
    LW_CO_RETURN_IF_ERROR(co_await tlsHandshake(*c, ssl::stream_base::server));
    FrameHeader h;
    std::vector<uint8_t> payload;
    LW_CO_RETURN_IF_ERROR(
        co_await readHandshakeFrame(*c, FrameType::kHello, std::nullopt, h, payload));
    const uint32_t client = h.src;
    const Hello hello = decodeHello(payload);
    if (hello.world_size != m.world_size) {
      co_return failedPrecondition(fmt::format("{} claims rank {} of world size {}, ours is {}",
                                               c->name, client, hello.world_size, m.world_size));
    }
    if (hello.dst != m.rank) {
      co_return failedPrecondition(fmt::format("{} (rank {}) meant to reach rank {}, we are {}",
                                               c->name, client, hello.dst, m.rank));
    }
    if (!initiates(client, m.rank)) {
      co_return failedPrecondition(fmt::format(
          "{} claims rank {}, which does not connect to us (rank {}): lower ranks connect to "
          "higher ones{}",
          c->name, client, m.rank,
          rendezvousMode() ? ", and with a rendezvous every rank connects to rank 0" : ""));
    }
    {
      std::lock_guard lock(mu);
      if (mail.upLocked(client)) {
        co_return failedPrecondition(fmt::format(
            "{} claims rank {}, which is already connected (duplicate rank)", c->name, client));
      }
    }
    auto nonce = randomNonce();
    if (!nonce) co_return nonce.status();
    const Mac proof = handshakeMac(MacRole::kServer, m.secret, m.job_id, hello.nonce, *nonce,
                                   client, m.rank, m.world_size);
    std::array<uint8_t, kChallengeBytes> challenge{};
    std::copy(nonce->begin(), nonce->end(), challenge.begin());
    std::copy(proof.begin(), proof.end(), challenge.begin() + kNonceBytes);
    LW_CO_RETURN_IF_ERROR(co_await writeFrame(*c, FrameType::kChallenge, challenge));
    std::vector<uint8_t> auth;
    LW_CO_RETURN_IF_ERROR(co_await readHandshakeFrame(*c, FrameType::kAuth, client, h, auth));
    const Mac expected = handshakeMac(MacRole::kClient, m.secret, m.job_id, hello.nonce, *nonce,
                                      client, m.rank, m.world_size);
    if (!macEqual(expected, auth)) {
      co_return failedPrecondition(
          fmt::format("{} (rank {}) failed to prove knowledge of the job secret (wrong secret?)",
                      c->name, client));
    }
    co_return install(c, client);
  }

  /// Reads frames from an authenticated connection until it fails or is closed.
  awaitable<void> serve(std::shared_ptr<Conn> c) {
    const uint32_t src = c->peer;
    const HeaderChecks hc = checks(src, options.max_frame_bytes);
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
      if (type == FrameType::kHello || type == FrameType::kChallenge || type == FrameType::kAuth) {
        reason = fmt::format("malformed frame from {}: unexpected {} frame after the handshake",
                             c->name, frameTypeName(type));
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
      dispatch(c, *h, std::move(payload));
    }
    closeConn(c, reason);
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
      case FrameType::kRegister:
        onRegister(c, h.src, std::string(payload.begin(), payload.end()));
        break;
      case FrameType::kPeers:
        onPeers(c, h.src, std::string(payload.begin(), payload.end()));
        break;
      case FrameType::kState:
        if (take_state) take_state(h.src, payload);
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

  /// Pings the peer every ping_interval; closes the connection when it has been silent too long.
  awaitable<void> pinger(std::shared_ptr<Conn> c) {
    static_assert(std::is_same_v<Clock::duration, std::chrono::nanoseconds>);
    asio::steady_timer timer(co_await asio::this_coro::executor);
    while (!c->closed) {
      timer.expires_after(options.ping_interval);
      error_code ec;
      co_await timer.async_wait(asio::redirect_error(use_awaitable, ec));
      if (c->closed || stopping) break;
      const auto silent = Clock::now() - c->last_rx;
      if (silent > options.peer_timeout) {
        closeConn(
            c, fmt::format("{} silent for {} ms", c->name,
                           std::chrono::duration_cast<std::chrono::milliseconds>(silent).count()));
        break;
      }
      std::vector<uint8_t> ts(kPingBytes);
      const uint64_t now = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
      for (size_t i = 0; i < kPingBytes; ++i) ts[i] = static_cast<uint8_t>(now >> (8 * i));
      sendInternal(c, FrameType::kPing, {}, std::move(ts));
    }
  }

  // --- rendezvous (docs/peer-protocol.md) ------------------------------------------------------

  /// Rank > 0, right after authenticating with rank 0: tells it where this rank listens.
  void sendRegister(const std::shared_ptr<Conn>& c) {
    std::string mine = membership.advertise;
    if (mine.empty()) {
      error_code ec;
      mine = fmt::format(":{}", acceptor.local_endpoint(ec).port());
    }
    sendInternal(c, FrameType::kRegister, {}, std::vector<uint8_t>(mine.begin(), mine.end()));
  }

  /// A frame that is not for this rank closes the connection (as any malformed frame does).
  void misplaced(const std::shared_ptr<Conn>& c, const char* what) {
    closeConn(c, fmt::format("malformed frame from {}: unexpected {} frame", c->name, what));
  }

  /// Rank 0: rank `src` listens at `text` (":port" = on the address its connection comes from).
  /// Once every rank is known, every rank gets PEERS; later, a rank that registers again (a
  /// restarted one) gets them at once, and everyone again if its address changed.
  void onRegister(const std::shared_ptr<Conn>& c, uint32_t src, const std::string& text) {
    if (!rendezvousMode() || membership.rank != 0) return misplaced(c, "REGISTER");
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
    std::vector<std::shared_ptr<Conn>> targets;
    {
      std::lock_guard lock(mu);
      const bool was_complete =
          std::all_of(addresses.begin() + 1, addresses.end(), [](auto& a) { return !a.empty(); });
      changed = addresses[src] != address;
      addresses[src] = address;
      complete =
          std::all_of(addresses.begin() + 1, addresses.end(), [](auto& a) { return !a.empty(); });
      if (complete) {
        for (const auto& a : addresses) list += a + "\n";
        if (!was_complete || changed) {
          for (auto& link : links) {
            if (link) targets.push_back(link);
          }
        } else {
          targets.push_back(c);
        }
        if (!was_complete) {
          spdlog::info("peer: rendezvous complete: all {} ranks registered", membership.world_size);
        }
      }
    }
    spdlog::info("peer: rank {} registered at {}", src, address);
    if (!complete) return;
    for (auto& t : targets) {
      sendInternal(t, FrameType::kPeers, {}, std::vector<uint8_t>(list.begin(), list.end()));
    }
  }

  /// Rank > 0: every rank's address from rank 0; the first time, connect to the higher ranks.
  void onPeers(const std::shared_ptr<Conn>& c, uint32_t src, const std::string& text) {
    if (!rendezvousMode() || membership.rank == 0 || src != 0) return misplaced(c, "PEERS");
    std::vector<std::string> lines;
    size_t at = 0;
    while (at < text.size()) {
      const size_t nl = text.find('\n', at);
      if (nl == std::string::npos) break;
      lines.push_back(text.substr(at, nl - at));
      at = nl + 1;
    }
    bool ok = at == text.size() && lines.size() == membership.world_size;
    for (uint32_t r = 1; ok && r < lines.size(); ++r) {
      std::string host;
      uint16_t port = 0;
      ok = parseHostPort(lines[r], host, port);
    }
    if (!ok) {
      return closeConn(c, fmt::format("malformed frame from {}: PEERS is not {} addresses", c->name,
                                      membership.world_size));
    }
    {
      std::lock_guard lock(mu);
      for (uint32_t r = 1; r < lines.size(); ++r) {
        if (r != membership.rank) addresses[r] = lines[r];
      }
    }
    if (peers_learned) return;
    peers_learned = true;
    spdlog::info("peer: rendezvous: learned the addresses of all {} ranks", membership.world_size);
    for (uint32_t r = membership.rank + 1; r < membership.world_size; ++r) {
      asio::co_spawn(*io, connectLoop(r), asio::detached);
    }
  }

  // --- accepting and connecting ----------------------------------------------------------------

  awaitable<void> acceptLoop() {
    for (;;) {
      tcp::socket s(*io);
      error_code ec;
      co_await acceptor.async_accept(s, asio::redirect_error(use_awaitable, ec));
      if (stopping || ec == asio::error::operation_aborted) co_return;
      if (ec) {
        spdlog::warn("peer: accept failed: {}", ec.message());
        asio::steady_timer pause(*io, std::chrono::milliseconds(50));  // e.g. out of descriptors
        co_await pause.async_wait(asio::redirect_error(use_awaitable, ec));
        continue;
      }
      if (pending_handshakes >= options.max_pending_handshakes) {
        error_code ignored;
        s.close(ignored);
        metrics.limitHits("peer_handshakes").Increment();
        const auto now = std::chrono::steady_clock::now();
        if (now - last_handshake_warning > std::chrono::seconds(10)) {
          last_handshake_warning = now;
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

  awaitable<void> serverSession(std::shared_ptr<Conn> c) {
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
    while (!stopping) {
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
        if (ec || stopping) {
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
          if (rendezvousMode() && server == 0) sendRegister(c);
          co_await serve(c);
        } else if (!stopping) {
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
      if (stopping) break;
      if (served) backoff = options.backoff_initial;
      timer.expires_after(backoff);
      co_await timer.async_wait(asio::redirect_error(use_awaitable, ec));
      if (!served) backoff = std::min(backoff * 2, options.backoff_max);
    }
  }

  void closeAll() {
    stopping = true;
    error_code ignored;
    acceptor.close(ignored);
    for (auto& [id, c] : conns) closeConn(c, "transport shutting down");
  }
};

// --- TcpTransport --------------------------------------------------------------------------------

TcpTransport::TcpTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

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
  s.stopping = true;
  // The I/O thread is gone: close what is left here, then destroy the suspended coroutines
  // (io_context's destructor) while everything they refer to still exists.
  error_code ignored;
  s.acceptor.close(ignored);
  for (auto& [id, c] : s.conns) c->socket.close(ignored);
  s.conns.clear();
  s.work.reset();
  s.io.reset();
  for (uint32_t r = 0; r < s.mail.size(); ++r) {
    if (r != s.membership.rank) s.metrics.peerUp(r).Set(0);
  }
}

uint16_t TcpTransport::port() const {
  error_code ec;
  auto ep = impl_->acceptor.local_endpoint(ec);
  return ec ? 0 : ep.port();
}

Status TcpTransport::start(Membership m) {
  Impl& s = *impl_;
  if (s.started.exchange(true)) return failedPrecondition("peer: transport already started");
  if (m.world_size == 0 || m.rank >= m.world_size) {
    return invalidArgument(
        fmt::format("peer: rank {} outside world size {}", m.rank, m.world_size));
  }
  const bool rendezvous = !m.rendezvous.empty();
  if (rendezvous) {
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
  } else if (m.peers.size() != m.world_size) {
    return invalidArgument(
        fmt::format("peer: {} peer addresses for world size {}", m.peers.size(), m.world_size));
  }
  if (m.job_id.empty()) return invalidArgument("peer: empty job id");
  if (m.secret.empty()) return invalidArgument("peer: empty job secret");
  for (uint32_t r = 0; r < m.world_size && !rendezvous; ++r) {
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
  s.addresses = s.membership.peers;
  for (uint32_t r = 0; r < s.membership.world_size; ++r) {
    if (r != s.membership.rank) s.metrics.peerUp(r).Set(0);
  }
  s.work.emplace(s.io->get_executor());
  asio::co_spawn(*s.io, s.acceptLoop(), asio::detached);
  if (s.rendezvousMode()) {
    // Rank 0 waits for the others; they connect to it and, once it has told them every rank's
    // address (PEERS), to the ranks above them.
    if (s.membership.rank != 0) asio::co_spawn(*s.io, s.connectLoop(0), asio::detached);
  } else {
    for (uint32_t r = s.membership.rank + 1; r < s.membership.world_size; ++r) {
      asio::co_spawn(*s.io, s.connectLoop(r), asio::detached);
    }
  }
  s.thread = std::thread([&s] { s.io->run(); });
  return Status::ok();
}

uint32_t TcpTransport::rank() const { return impl_->membership.rank; }
uint32_t TcpTransport::worldSize() const { return impl_->membership.world_size; }

Result<TcpTransport::Impl::Posted> TcpTransport::Impl::queueFrame(
    uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
    std::span<const uint8_t> payload) {
  if (!started) return failedPrecondition("peer: send before start()");
  LW_RETURN_IF_ERROR(mail.checkSend(dst, type, payload.size(), options.max_frame_bytes));
  auto op = std::make_shared<WriteOp>();
  op->header = encodeHeader(makeHeader(type, key, codec, job_hash, membership.rank, payload));
  op->payload = payload;
  op->dst = dst;
  std::shared_ptr<Conn> conn;
  {
    std::lock_guard lock(mu);
    conn = links[dst];
    if (!conn) return mail.notConnectedLocked(dst);
  }
  asio::post(*io, [this, conn, op] { enqueue(conn, op); });
  return Posted{conn, op};
}

Status TcpTransport::Impl::awaitFrames(std::vector<Posted>& ops, Clock::time_point deadline) {
  std::unique_lock lock(mu);
  const bool all_done = cv.wait_until(lock, deadline, [&] {
    return std::all_of(ops.begin(), ops.end(), [](const Posted& p) { return p.op->done; });
  });
  if (!all_done) {
    // Payloads are lent: every frame must be out of its queue (or its connection closed, since a
    // frame cannot be abandoned half-written) before returning.
    lock.unlock();
    asio::post(*io, [this, ops] {
      for (const auto& [conn, op] : ops) {
        if (op->done) continue;
        auto& q = conn->queue;
        const bool in_flight = conn->writing && !q.empty() && q.front() == op;
        if (in_flight) {
          closeConn(conn, fmt::format("a send to rank {} did not finish before its deadline",
                                      conn->peer));
        } else {
          q.erase(std::remove(q.begin(), q.end(), op), q.end());
          complete(op, "deadline passed");
        }
      }
    });
    lock.lock();
    cv.wait(lock, [&] {
      return std::all_of(ops.begin(), ops.end(), [](const Posted& p) { return p.op->done; });
    });
  }
  Status first = Status::ok();
  for (const auto& [conn, op] : ops) {
    if (op->error.empty()) continue;
    first = op->error == "deadline passed"
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

Status TcpTransport::send(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                          std::span<const uint8_t> payload, Clock::time_point deadline) {
  auto posted = impl_->queueFrame(dst, type, key, codec, payload);
  if (!posted) return posted.status();
  std::vector<Impl::Posted> one{std::move(*posted)};
  return impl_->awaitFrames(one, deadline);
}

Status TcpTransport::post(uint32_t dst, FrameType type, const FrameKey& key, uint8_t codec,
                          std::span<const uint8_t> payload, Clock::time_point /*deadline*/) {
  auto posted = impl_->queueFrame(dst, type, key, codec, payload);
  if (!posted) return posted.status();
  std::lock_guard lock(impl_->posted_mu);
  impl_->posted.push_back(std::move(*posted));
  return Status::ok();
}

Status TcpTransport::flush(Clock::time_point deadline) {
  std::vector<Impl::Posted> ops;
  {
    std::lock_guard lock(impl_->posted_mu);
    ops.swap(impl_->posted);
  }
  if (ops.empty()) return Status::ok();
  return impl_->awaitFrames(ops, deadline);
}

void TcpTransport::recycle(std::vector<uint8_t> buffer) { impl_->mail.recycle(std::move(buffer)); }

Result<Frame> TcpTransport::receive(uint32_t src, const FrameKey& key, Clock::time_point deadline) {
  if (!impl_->started) return failedPrecondition("peer: receive before start()");
  return impl_->mail.receive(src, key, deadline);
}

void TcpTransport::abortStep(uint64_t tensor, uint64_t step, const std::string& reason) {
  Impl& s = *impl_;
  if (!s.started) return;
  std::vector<uint8_t> payload(reason.begin(), reason.end());
  if (payload.size() > 4096) payload.resize(4096);  // a reason, not a payload
  std::vector<std::shared_ptr<Conn>> conns;
  {
    std::lock_guard lock(s.mu);
    for (auto& link : s.links) {
      if (link) conns.push_back(link);
    }
  }
  asio::post(*s.io, [&s, conns = std::move(conns), tensor, step, payload = std::move(payload)] {
    FrameKey key;
    key.tensor = tensor;
    key.step = step;
    for (auto& c : conns) s.sendInternal(c, FrameType::kAbort, key, payload);
  });
}

void TcpTransport::broadcastState() {
  Impl& s = *impl_;
  if (!s.started || !s.provide_state) return;
  std::vector<std::shared_ptr<Conn>> conns;
  {
    std::lock_guard lock(s.mu);
    for (auto& link : s.links) {
      if (link) conns.push_back(link);
    }
  }
  asio::post(*s.io, [&s, conns = std::move(conns), state = s.provide_state()] {
    for (auto& c : conns) s.sendInternal(c, FrameType::kState, {}, state);
  });
}

void TcpTransport::discard(uint64_t tensor, uint64_t step) { impl_->mail.discard(tensor, step); }

void TcpTransport::beginStep(uint64_t tensor, uint64_t step) {
  impl_->mail.beginStep(tensor, step);
}

void TcpTransport::setJobState(std::function<std::vector<uint8_t>()> provide,
                               std::function<void(uint32_t, std::span<const uint8_t>)> take) {
  impl_->provide_state = std::move(provide);
  impl_->take_state = std::move(take);
}

bool TcpTransport::allConnected() const { return impl_->mail.allUp() && impl_->started; }

std::vector<bool> TcpTransport::peersUp() const { return impl_->mail.peersUp(); }

}  // namespace lightwire::proxy::peer
