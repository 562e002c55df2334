#include "proxy/server/http_server.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <boost/asio/generic/stream_protocol.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/json/serialize.hpp>
#include <boost/json/value.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <list>
#include <mutex>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "kernels/reuse.h"
#include "proxy/server/utf8.h"

namespace lightwire::proxy {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
using tcp = asio::ip::tcp;
using unix_socket = asio::local::stream_protocol;
// Every connection, TCP or Unix socket, is one stream type: Beast's parser and serializer are
// instantiated once, not once per protocol (they are most of this file's compile time).
using Stream = beast::basic_stream<asio::generic::stream_protocol>;

}  // namespace

Response errorResponse(http::status status, std::string_view code, std::string_view message,
                       unsigned version, bool keep_alive) {
  Response r{status, version};
  r.set(http::field::content_type, "application/json");
  r.keep_alive(keep_alive);
  // Messages quote what the client sent (a path, a name): only UTF-8 keeps the reply JSON.
  r.body() = boost::json::serialize(
      boost::json::object{{"error", std::string(code)}, {"message", toValidUtf8(message)}});
  r.prepare_payload();
  return r;
}

/// State every session shares with the server.
struct Shared {
  HttpLimits limits;
  Handler handler;
  HttpServer::RefusedHook on_refused;
  HttpServer::LimitHook on_limit;
  HeaderCheck on_header;
  std::atomic<bool> stopping{false};
  std::shared_ptr<std::atomic<size_t>> connections;
  // Bytes of request bodies being read or held by a handler, all connections together
  // (limits.max_inflight_body_bytes): reserved from the Content-Length before the body is read.
  std::atomic<uint64_t> inflight_body{0};
  // Strings of large bodies whose replies were written, for the next large body (takeBody):
  // docs/deploy.md "Sizing", request bodies. Under bodies_mu.
  std::mutex bodies_mu;
  std::vector<std::string> bodies;
  uint64_t bodies_bytes = 0;
  std::mutex mu;
  // One per session: close it if idle (on stop). Entries of ended sessions are pruned as new
  // ones arrive, so the list stays about as long as the number of open connections.
  std::vector<std::pair<std::weak_ptr<void>, std::function<void()>>> closers;
};

namespace {

const char* listenerName(const RequestInfo& info) {
  if (info.listener == ListenerKind::kAdmin) return "admin";
  return info.tcp ? "control_tcp" : "unix";
}

}  // namespace

/// The connection budget of one listener: its connections in accept order (the oldest first),
/// each with its source and whether it may be evicted for a new one.
struct Budget {
  using Clock = std::chrono::steady_clock;
  struct Entry {
    std::string source;
    std::function<void()> close;  // posts a close to the session's executor
    bool trusted = false;         // completed a request, or the header check trusted it
    bool evicted = false;
  };
  ListenerLimits limits;
  std::string name;
  std::mutex mu;
  size_t open = 0;
  std::unordered_map<std::string, size_t> per_source;
  std::list<Entry> entries;

  /// The outcome of admitting a connection from `source`.
  enum class Admit { kOk, kFull, kSourceFull };
  /// Admits a connection, evicting the oldest untrusted one when the budget is full (its close
  /// is returned in `evict`). On kOk, `slot` is the new connection's entry.
  Admit admit(const std::string& source, std::list<Entry>::iterator& slot,
              std::function<void()>& evict) {
    std::lock_guard lock(mu);
    if (limits.max_per_source != 0) {
      auto it = per_source.find(source);
      if (it != per_source.end() && it->second >= limits.max_per_source) return Admit::kSourceFull;
    }
    if (open >= limits.max_connections) {
      auto victim = std::find_if(entries.begin(), entries.end(),
                                 [](const Entry& e) { return !e.trusted && !e.evicted; });
      if (victim == entries.end()) return Admit::kFull;
      victim->evicted = true;
      evict = std::move(victim->close);
      leaveLocked(*victim);
    }
    ++open;
    ++per_source[source];
    slot = entries.insert(entries.end(), Entry{source, {}, false, false});
    return Admit::kOk;
  }

  void setCloser(std::list<Entry>::iterator slot, std::function<void()> close) {
    std::lock_guard lock(mu);
    slot->close = std::move(close);
  }

  size_t openNow() {
    std::lock_guard lock(mu);
    return open;
  }

  void trust(std::list<Entry>::iterator slot) {
    std::lock_guard lock(mu);
    slot->trusted = true;
  }

  /// The session of `slot` ended.
  void remove(std::list<Entry>::iterator slot) {
    std::lock_guard lock(mu);
    if (!slot->evicted) leaveLocked(*slot);
    entries.erase(slot);
  }

 private:
  void leaveLocked(const Entry& e) {
    --open;
    auto it = per_source.find(e.source);
    if (it != per_source.end() && --it->second == 0) per_source.erase(it);
  }
};

namespace {

constexpr size_t kSmallBuffer = size_t{1} << 16;  // read buffer of a connection

// Kept body strings (Shared::bodies): at most this many, of this many bytes together.
constexpr size_t kKeptBodies = 8;
constexpr uint64_t kKeptBodyBytes = uint64_t{256} << 20;

/// An empty string with room for `n` bytes: a kept one (the smallest that holds n), else a new
/// one that the body's reader reserves. A body is one string from its first byte to its reply's
/// last (the raw emit path replies in the request's own string), and bodies of the same sizes
/// come back at every step: reusing their strings keeps the heap's arrangement as it was, where
/// a new string per request leaves gaps of every size that the next ones rarely fit, and the
/// process grows a little at each new arrangement.
std::string takeBody(Shared& shared, uint64_t n) {
  std::lock_guard lock(shared.bodies_mu);
  std::string s =
      kernels::takeReused(shared.bodies, n, /*capacity_only=*/true, shared.bodies_bytes);
  s.clear();
  return s;
}

/// Keeps a written reply's string for takeBody(), within the caps (else it is freed).
void giveBody(Shared& shared, std::string&& s) {
  if (s.capacity() < kSmallBuffer) return;  // most replies: no lock
  std::lock_guard lock(shared.bodies_mu);
  if (shared.bodies.size() >= kKeptBodies || shared.bodies_bytes + s.capacity() > kKeptBodyBytes) {
    return;
  }
  shared.bodies_bytes += s.capacity();
  shared.bodies.push_back(std::move(s));
}

constexpr size_t kLargeBuffer = size_t{1} << 20;  // ... while it reads a large body
constexpr int kSocketBuffer = 4 << 20;            // SO_RCVBUF / SO_SNDBUF of a connection
// A body's share of limits.max_inflight_body_bytes runs this far ahead of what has arrived.
constexpr uint64_t kReserveAhead = uint64_t{4} << 20;
// limits.min_body_rate is checked at least every this many bytes of a body.
constexpr uint64_t kRateStep = uint64_t{64} << 10;

/// One connection: read a request, hand it to the handler, write the reply, repeat while kept
/// alive.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Stream stream, std::shared_ptr<Shared> shared, RequestInfo info,
          std::shared_ptr<Budget> budget, std::list<Budget::Entry>::iterator slot)
      : stream_(std::move(stream)),
        shared_(std::move(shared)),
        info_(info),
        budget_(std::move(budget)),
        slot_(slot) {
    shared_->connections->fetch_add(1);
  }
  ~Session() {
    release();
    budget_->remove(slot_);
    shared_->connections->fetch_sub(1);
  }

  /// The closer the budget calls to evict this session.
  static std::function<void()> closer(const std::shared_ptr<Session>& s) {
    std::weak_ptr<Session> weak = s;
    return [weak] {
      if (auto s = weak.lock()) {
        asio::post(s->stream_.get_executor(), [s] {
          // Chosen while it had completed no request, it may have completed one since (the
          // choice and this close are not atomic): a client with a request in hand is kept, its
          // reply not cut. Its budget slot is already free, so the listener holds one connection
          // more than its budget until it ends.
          if (s->requests_ > 0) return;
          s->limitHit("evicted");
          s->close();
        });
      }
    };
  }

  void start(const std::optional<struct ucred>& cred) {
    if (cred) {
      info_.pid = cred->pid;
      info_.uid = static_cast<long>(cred->uid);
    }
    buffer_.reserve(kSmallBuffer);
    std::weak_ptr<Session> weak = shared_from_this();
    {
      std::lock_guard lock(shared_->mu);
      auto& list = shared_->closers;
      if (list.size() >= 64 && list.size() >= 2 * shared_->connections->load()) {
        std::erase_if(list, [](const auto& e) { return e.first.expired(); });
      }
      list.emplace_back(std::weak_ptr<void>(weak.lock()), [weak] {
        if (auto s = weak.lock()) {
          asio::post(s->stream_.get_executor(), [s] {
            if (!s->busy_) s->close();
          });
        }
      });
    }
    readHeader();
  }

 private:
  /// Waits for a request's first byte (idle_timeout on a kept-alive connection that completed a
  /// request, header_timeout on a new one), then reads its headers within header_timeout.
  void readHeader() {
    if (shared_->stopping.load()) return close();
    parser_.emplace();
    parser_->header_limit(shared_->limits.max_header_bytes);
    parser_->body_limit(shared_->limits.max_body_bytes);
    if (buffer_.size() > 0) return readHeaderRest();
    phase_ = requests_ > 0 ? Phase::kIdle : Phase::kHeader;
    if (requests_ > 0) {
      stream_.expires_after(shared_->limits.idle_timeout);
    } else {
      stream_.expires_at(accepted_ + shared_->limits.header_timeout);
    }
    stream_.async_read_some(
        buffer_.prepare(std::max<size_t>(512, buffer_.capacity() - buffer_.size())),
        [self = shared_from_this()](beast::error_code ec, size_t n) {
          if (ec) {
            self->failRead(ec);
            return;
          }
          self->buffer_.commit(n);
          self->readHeaderRest();
        });
  }

  void readHeaderRest() {
    phase_ = Phase::kHeader;
    if (requests_ == 0) {
      stream_.expires_at(accepted_ + shared_->limits.header_timeout);  // from the accept
    } else {
      stream_.expires_after(shared_->limits.header_timeout);  // from the request's first byte
    }
    http::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->onHeader(ec); });
  }

  void limitHit(std::string_view limit) {
    if (shared_->on_limit) shared_->on_limit(limit, listenerName(info_));
  }

  /// Reserves `bytes` of the in-flight body budget for this request; false when it would pass
  /// limits.max_inflight_body_bytes (0 = no cap). `in_flight` is set to what others hold.
  bool reserve(uint64_t bytes, uint64_t& in_flight) {
    const uint64_t cap = shared_->limits.max_inflight_body_bytes;
    uint64_t cur = shared_->inflight_body.load();
    do {
      in_flight = cur;
      if (cap != 0 && (bytes > cap || cur > cap - bytes)) return false;
    } while (!shared_->inflight_body.compare_exchange_weak(cur, cur + bytes));
    reserved_ += bytes;
    return true;
  }

  /// Keeps this request's reservation at min(its body's length, what has arrived + kReserveAhead)
  /// (a chunked body: up to limits.max_body_bytes). False, with the refusal sent, when the budget
  /// cannot hold it.
  bool reserveAhead(uint64_t received) {
    const auto len = parser_->content_length();
    const uint64_t total = len ? *len : shared_->limits.max_body_bytes;
    const uint64_t want = std::min(total, received + kReserveAhead);
    if (want <= reserved_) return true;
    uint64_t in_flight = 0;
    if (reserve(want - reserved_, in_flight)) return true;
    limitHit("inflight_body_bytes");
    fail(http::status::too_many_requests, "limit_reached",
         "request bodies held at once would exceed limits.max_inflight_body_bytes (" +
             std::to_string(shared_->limits.max_inflight_body_bytes) + " bytes; " +
             std::to_string(in_flight) + " held, this one " + std::to_string(want) +
             (!len          ? " so far, chunked"
              : want < *len ? " of " + std::to_string(*len)
                            : "") +
             ")",
         /*retry_after=*/true);
    return false;
  }

  void release() {
    if (reserved_ != 0) shared_->inflight_body.fetch_sub(reserved_);
    reserved_ = 0;
  }

  /// Parse errors are answered (when the connection still works) and end the connection.
  bool failRead(beast::error_code ec) {
    // A deadline ran out in the middle of a request, or before a new connection's first one (a
    // slow or stalled client), not between requests of a kept-alive connection.
    if (ec == beast::error::timeout && phase_ == Phase::kHeader) limitHit("header_timeout");
    if (ec == beast::error::timeout && phase_ == Phase::kBody) limitHit("body_rate");
    if (ec == http::error::end_of_stream || ec == http::error::partial_message ||
        ec == beast::error::timeout || ec == asio::error::operation_aborted ||
        ec == asio::error::connection_reset || ec == asio::error::eof ||
        ec == asio::error::bad_descriptor) {
      close();
      return true;
    }
    if (ec == http::error::header_limit) {
      limitHit("header_bytes");
      fail(http::status::request_header_fields_too_large, "header_too_large",
           "request headers exceed limits.max_header_bytes (" +
               std::to_string(shared_->limits.max_header_bytes) + " bytes)");
    } else if (ec == http::error::body_limit) {
      limitHit("body_bytes");
      fail(http::status::payload_too_large, "too_large",
           "request body exceeds limits.max_body_bytes (" +
               std::to_string(shared_->limits.max_body_bytes) + " bytes)");
    } else {
      fail(http::status::bad_request, "invalid_argument",
           "malformed HTTP request: " + ec.message());
    }
    return true;
  }

  void onHeader(beast::error_code ec) {
    if (ec) {
      failRead(ec);
      return;
    }
    const auto& req = parser_->get();
    if (shared_->on_header) {
      const bool has_body = !parser_->is_done();
      HeaderVerdict verdict = shared_->on_header(req, info_, has_body);
      if (verdict.trusted) budget_->trust(slot_);
      if (verdict.refuse) {
        if (shared_->on_refused) {
          shared_->on_refused(req.target(), static_cast<unsigned>(verdict.refuse->result_int()));
        }
        keep_alive_ = false;
        head_ = false;
        busy_ = true;
        verdict.refuse->keep_alive(false);
        write(std::move(*verdict.refuse));
        return;
      }
    }
    if (const auto len = parser_->content_length(); len && *len > shared_->limits.max_body_bytes) {
      limitHit("body_bytes");
      fail(http::status::payload_too_large, "too_large",
           "request body of " + std::to_string(*len) + " bytes exceeds limits.max_body_bytes (" +
               std::to_string(shared_->limits.max_body_bytes) + " bytes)");
      return;
    }
    // The body's bytes count against the budget of bodies held at once until the reply is
    // written: reserved from its Content-Length up to kReserveAhead before it is read, and
    // kReserveAhead ahead of what has arrived as it is read (docs/RELIABILITY.md "Limits"): a
    // client that declares a large body and sends it slowly holds little of the budget.
    if (!parser_->is_done() && !reserveAhead(0)) return;
    // Beast reads at most the buffer's free capacity (at least 512 bytes) per system call: a large
    // body gets a large buffer, or 100 MB would take 200 000 reads. Always the same size (only the
    // pages a body's reads touch become resident): read buffers of two sizes only come and go, so
    // each fits the gap the last one left in the heap.
    if (const auto len = parser_->content_length(); len && *len > kSmallBuffer) {
      buffer_.reserve(kLargeBuffer);
      parser_->get().body() = takeBody(*shared_, *len);  // before the body's reader reserves
    }
    if (beast::iequals(req[http::field::expect], "100-continue")) {
      auto cont = std::make_shared<http::response<http::empty_body>>(http::status::continue_,
                                                                     req.version());
      http::async_write(stream_, *cont,
                        [self = shared_from_this(), cont](beast::error_code ec2, size_t) {
                          if (ec2) return self->close();
                          self->readBody();
                        });
      return;
    }
    readBody();
  }

  /// Reads the body piece by piece. Each piece has a deadline: header_timeout of grace plus, at
  /// limits.min_body_rate, the time for what has arrived and kRateStep more, from the body's start
  /// (a client slower than the rate on average is cut, whatever length it declared).
  void readBody() {
    if (parser_->is_done()) return onRead({});  // no body
    phase_ = Phase::kBody;
    body_start_ = std::chrono::steady_clock::now();
    readBodySome();
  }

  /// Makes room in the body for what the next read can bring, here, where a failed allocation
  /// is a refusal: Beast's string body would reserve the declared length (or grow a chunked body)
  /// inside the read, where std::bad_alloc ends the process (an address-space limit, strict
  /// overcommit). A declared length is reserved at once (the reads never move the body), a chunked
  /// body one read ahead. False, with the refusal sent, when the memory is not there.
  bool roomForBody() {
    auto& body = parser_->get().body();
    const auto len = parser_->content_length();
    const uint64_t want = len ? *len : body.size() + buffer_.capacity();
    if (want <= body.capacity()) return true;
    try {
      body.reserve(static_cast<size_t>(want));
      return true;
    } catch (const std::exception&) {  // std::bad_alloc, std::length_error
      limitHit("body_memory");
      fail(http::status::service_unavailable, "busy",
           "the sidecar could not allocate " + std::to_string(want) +
               " bytes for this request's body (out of memory); retry later",
           /*retry_after=*/true);
      return false;
    }
  }

  void readBodySome() {
    if (!roomForBody()) return;
    const uint64_t rate = shared_->limits.min_body_rate;
    if (rate == 0) {
      stream_.expires_after(shared_->limits.idle_timeout);
    } else {
      const double seconds =
          static_cast<double>(parser_->get().body().size() + kRateStep) / static_cast<double>(rate);
      stream_.expires_at(
          body_start_ + shared_->limits.header_timeout +
          std::chrono::milliseconds(static_cast<int64_t>(std::min(seconds, 1e9) * 1000.0)));
    }
    http::async_read_some(stream_, buffer_, *parser_,
                          [self = shared_from_this()](beast::error_code ec, size_t) {
                            if (ec || self->parser_->is_done()) return self->onRead(ec);
                            if (!self->reserveAhead(self->parser_->get().body().size())) return;
                            self->readBodySome();
                          });
  }

  void onRead(beast::error_code ec) {
    if (ec) {
      failRead(ec);
      return;
    }
    stream_.expires_never();  // a step may wait for the node's other trainers
    phase_ = Phase::kHandler;
    if (requests_++ == 0) budget_->trust(slot_);  // a client that completed a request
    Request req = parser_->release();
    parser_.reset();
    keep_alive_ = req.keep_alive();
    version_ = req.version();
    head_ = req.method() == http::verb::head;
    busy_ = true;
    auto self = shared_from_this();
    shared_->handler(std::move(req), info_, [self](Response r) {
      asio::post(self->stream_.get_executor(),
                 [self, r = std::move(r)]() mutable { self->write(std::move(r)); });
    });
  }

  void write(Response r) {
    release();  // the handler is done with the request's body
    r.version(version_);
    r.keep_alive(keep_alive_ && !shared_->stopping.load());
    r.prepare_payload();
    if (head_) {  // headers only (RFC 9110 §9.3.2), or the body would read as the next response
      const auto length = r.body().size();
      r.body().clear();
      r.content_length(length);
    }
    response_ = std::make_shared<Response>(std::move(r));
    phase_ = Phase::kWrite;
    stream_.expires_after(shared_->limits.idle_timeout);  // a client that never reads is dropped
    http::async_write(
        stream_, *response_, [self = shared_from_this()](beast::error_code ec, size_t) {
          self->busy_ = false;
          if (ec == beast::error::timeout) self->limitHit("request_timeout");  // never read it
          const bool again = !ec && self->response_->keep_alive();
          giveBody(*self->shared_, std::move(self->response_->body()));
          self->response_.reset();
          if (again) {
            if (self->buffer_.capacity() > kSmallBuffer && self->buffer_.size() == 0) {
              self->buffer_.shrink_to_fit();  // idle connections stay small
              self->buffer_.reserve(kSmallBuffer);
            }
            self->readHeader();
          } else {
            self->close();
          }
        });
  }

  void fail(http::status status, std::string_view code, const std::string& message,
            bool retry_after = false) {
    if (shared_->on_refused) {
      std::string_view target;
      if (parser_) target = parser_->get().target();  // set once the request line is parsed
      shared_->on_refused(target, static_cast<unsigned>(status));
    }
    keep_alive_ = false;
    head_ = false;
    busy_ = true;
    Response r = errorResponse(status, code, message, version_ ? version_ : 11, false);
    if (retry_after) r.set(http::field::retry_after, "1");
    write(std::move(r));
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    beast::error_code ignored;
    stream_.socket().shutdown(Stream::socket_type::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

  /// What the connection is doing: which deadline runs, and which limit a timeout hits.
  enum class Phase { kIdle, kHeader, kBody, kHandler, kWrite };

  Stream stream_;
  std::shared_ptr<Shared> shared_;
  RequestInfo info_;
  std::shared_ptr<Budget> budget_;
  std::list<Budget::Entry>::iterator slot_;
  Phase phase_ = Phase::kHeader;
  uint64_t requests_ = 0;  // requests read completely on this connection
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::shared_ptr<Response> response_;
  bool keep_alive_ = true;
  unsigned version_ = 11;
  bool busy_ = false;
  bool closed_ = false;
  bool head_ = false;
  uint64_t reserved_ = 0;  // this request's share of Shared::inflight_body
  std::chrono::steady_clock::time_point body_start_;
  std::chrono::steady_clock::time_point accepted_ = std::chrono::steady_clock::now();
};

/// Accepts connections of one protocol, admits each into the listener's budget, and starts a
/// Session for it.
template <typename Protocol>
class Listener : public std::enable_shared_from_this<Listener<Protocol>> {
 public:
  Listener(asio::io_context& io, std::shared_ptr<Shared> shared, RequestInfo info,
           ListenerLimits limits)
      : io_(io),
        acceptor_(asio::make_strand(io)),
        backoff_timer_(acceptor_.get_executor()),
        shared_(std::move(shared)),
        info_(info),
        budget_(std::make_shared<Budget>()) {
    budget_->limits = limits;
    budget_->name = listenerName(info);
    const std::string body =
        "{\"error\":\"busy\",\"message\":\"the " + budget_->name +
        " listener's connections are all in use by clients that completed a request "
        "(limits." +
        budget_->name + ".max_connections " + std::to_string(limits.max_connections) +
        "); retry later\"}";
    busy_ =
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: "
        "1\r\nConnection: close\r\nContent-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body;
  }

  typename Protocol::acceptor& acceptor() { return acceptor_; }
  const std::shared_ptr<Budget>& budget() const { return budget_; }

  void accept() {
    acceptor_.async_accept(
        asio::make_strand(io_),
        [self = this->shared_from_this()](beast::error_code ec, typename Protocol::socket socket) {
          if (ec) {
            if (ec == asio::error::operation_aborted || !self->acceptor_.is_open()) return;
            // Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS): the connections we have keep
            // being served; accepting again at once would spin, so wait, longer each time (10 ms to
            // 1 s). The waiting connections stay in the kernel's backlog.
            self->hit("accept_errors");
            self->backoff_ = std::min(std::chrono::milliseconds(1000),
                                      std::max(std::chrono::milliseconds(10), 2 * self->backoff_));
            self->backoff_timer_.expires_after(self->backoff_);
            self->backoff_timer_.async_wait([self](beast::error_code wait_ec) {
              if (!wait_ec && self->acceptor_.is_open()) self->accept();
            });
            return;
          }
          self->backoff_ = std::chrono::milliseconds(0);
          self->admit(std::move(socket));
          self->accept();
        });
  }

  void stop() {
    asio::post(acceptor_.get_executor(), [self = this->shared_from_this()] {
      beast::error_code ignored;
      self->acceptor_.close(ignored);
      self->backoff_timer_.cancel();
    });
  }

 private:
  void hit(std::string_view limit) {
    // Counted before the close: a client that sees its connection refused finds the hit already
    // in /metrics.
    if (shared_->on_limit) shared_->on_limit(limit, budget_->name);
  }

  /// Over the budget: a 503 with Retry-After written without waiting (a new socket's send buffer
  /// holds it), then closed. A client that has sent its request before reading may see a reset
  /// instead.
  void refuse(typename Protocol::socket& socket) {
    beast::error_code ignored;
    socket.non_blocking(true, ignored);
    socket.write_some(asio::buffer(busy_), ignored);
    socket.shutdown(Protocol::socket::shutdown_both, ignored);
    socket.close(ignored);
  }

  void admit(typename Protocol::socket socket) {
    beast::error_code ignored;
    if (shared_->stopping.load()) {
      socket.close(ignored);
      return;
    }
    // The source: a TCP client's address, a Unix-socket client's user id.
    std::string source;
    std::optional<struct ucred> cred;
    if constexpr (std::is_same_v<Protocol, unix_socket>) {
      struct ucred c {};
      socklen_t len = sizeof c;
      if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &c, &len) == 0) {
        cred = c;
        source = "uid:" + std::to_string(c.uid);
      }
    } else {
      beast::error_code ec;
      const auto peer = socket.remote_endpoint(ec);
      if (!ec) source = peer.address().to_string();
    }
    std::list<Budget::Entry>::iterator slot;
    std::function<void()> evict;
    switch (budget_->admit(source, slot, evict)) {
      case Budget::Admit::kSourceFull:
        hit("connections_per_source");
        refuse(socket);
        return;
      case Budget::Admit::kFull:
        hit("connections");
        refuse(socket);
        return;
      case Budget::Admit::kOk:
        break;
    }
    // Large socket buffers: a 100 MB body moves in hundreds of wake-ups, not thousands.
    socket.set_option(asio::socket_base::receive_buffer_size(kSocketBuffer), ignored);
    socket.set_option(asio::socket_base::send_buffer_size(kSocketBuffer), ignored);
    auto session =
        std::make_shared<Session>(Stream(std::move(socket)), shared_, info_, budget_, slot);
    budget_->setCloser(slot, Session::closer(session));
    if (evict) evict();  // the oldest connection without a completed request makes room
    session->start(cred);
  }

  asio::io_context& io_;
  typename Protocol::acceptor acceptor_;
  asio::steady_timer backoff_timer_;
  std::chrono::milliseconds backoff_{0};
  std::shared_ptr<Shared> shared_;
  RequestInfo info_;
  std::shared_ptr<Budget> budget_;
  std::string busy_;  // the 503 of a connection over the budget
};

}  // namespace

struct HttpServer::Impl {
  asio::io_context& io;
  std::shared_ptr<Shared> shared;
  std::vector<std::shared_ptr<Listener<tcp>>> tcp_listeners;
  std::vector<std::shared_ptr<Listener<unix_socket>>> unix_listeners;
  std::vector<std::string> socket_files;
};

HttpServer::HttpServer(asio::io_context& io, HttpLimits limits, Handler handler)
    : connections_(std::make_shared<std::atomic<size_t>>(0)) {
  auto shared = std::make_shared<Shared>();
  shared->limits = limits;
  shared->handler = std::move(handler);
  shared->connections = connections_;
  impl_ = std::make_unique<Impl>(Impl{io, std::move(shared), {}, {}, {}});
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::onRefused(RefusedHook hook) { impl_->shared->on_refused = std::move(hook); }

void HttpServer::onLimit(LimitHook hook) { impl_->shared->on_limit = std::move(hook); }

void HttpServer::onHeader(HeaderCheck check) { impl_->shared->on_header = std::move(check); }

uint64_t HttpServer::keptBodyBytes() const {
  std::lock_guard lock(impl_->shared->bodies_mu);
  return impl_->shared->bodies_bytes;
}

size_t HttpServer::connections(std::string_view listener) const {
  size_t n = 0;
  for (const auto& l : impl_->tcp_listeners) {
    if (l->budget()->name == listener) n += l->budget()->openNow();
  }
  for (const auto& l : impl_->unix_listeners) {
    if (l->budget()->name == listener) n += l->budget()->openNow();
  }
  return n;
}

std::string HttpServer::listenUnix(const std::string& path, ListenerKind kind, unsigned mode,
                                   ListenerLimits budget) {
  namespace fs = std::filesystem;
  std::error_code fec;
  const fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path(), fec);
  if (fec) return "cannot create directory " + p.parent_path().string() + ": " + fec.message();
  if (fs::exists(fs::symlink_status(p, fec))) {
    // A live sidecar answers on it: refuse. A stale file from a crash is replaced.
    unix_socket::socket probe(impl_->io);
    beast::error_code ec;
    probe.connect(unix_socket::endpoint(path), ec);
    if (!ec) return "another process is listening on " + path;
    if (!fs::is_socket(fs::symlink_status(p, fec))) {
      return path + " exists and is not a socket; not replacing it";
    }
    fs::remove(p, fec);
  }
  auto listener = std::make_shared<Listener<unix_socket>>(impl_->io, impl_->shared,
                                                          RequestInfo{kind, false}, budget);
  beast::error_code ec;
  auto& acc = listener->acceptor();
  acc.open(unix_socket(), ec);
  if (!ec) {
    // bind() creates the file with 0777 & ~umask: narrow the umask for that call, so the socket
    // never exists with wider permissions than `mode` (listeners are opened before any thread
    // that creates files starts).
    const mode_t previous = ::umask(static_cast<mode_t>(~mode & 0777));
    acc.bind(unix_socket::endpoint(path), ec);
    ::umask(previous);
  }
  if (ec) return "cannot bind Unix socket " + path + ": " + ec.message();
  if (::chmod(path.c_str(), static_cast<mode_t>(mode)) != 0) {
    return "cannot set the permissions of " + path + ": " + std::strerror(errno);
  }
  acc.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return "cannot listen on " + path + ": " + ec.message();
  listener->accept();
  impl_->unix_listeners.push_back(listener);
  impl_->socket_files.push_back(path);
  return "";
}

std::string HttpServer::listenTcp(const std::string& host, uint16_t port, ListenerKind kind,
                                  uint16_t* bound_port, ListenerLimits budget) {
  beast::error_code ec;
  const auto address = asio::ip::make_address(host, ec);
  if (ec) return "invalid listen address '" + host + "': " + ec.message();
  auto listener =
      std::make_shared<Listener<tcp>>(impl_->io, impl_->shared, RequestInfo{kind, true}, budget);
  auto& acc = listener->acceptor();
  const tcp::endpoint endpoint(address, port);
  acc.open(endpoint.protocol(), ec);
  if (!ec) acc.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acc.bind(endpoint, ec);
  if (!ec) acc.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return "cannot listen on " + host + ":" + std::to_string(port) + ": " + ec.message();
  }
  if (bound_port != nullptr) *bound_port = acc.local_endpoint().port();
  listener->accept();
  impl_->tcp_listeners.push_back(listener);
  return "";
}

void HttpServer::stop() {
  if (!impl_ || impl_->shared->stopping.exchange(true)) return;
  for (auto& l : impl_->tcp_listeners) l->stop();
  for (auto& l : impl_->unix_listeners) l->stop();
  std::vector<std::pair<std::weak_ptr<void>, std::function<void()>>> closers;
  {
    std::lock_guard lock(impl_->shared->mu);
    closers.swap(impl_->shared->closers);
  }
  for (auto& c : closers) c.second();
  std::error_code fec;
  for (const auto& f : impl_->socket_files) std::filesystem::remove(f, fec);
  impl_->socket_files.clear();
}

}  // namespace lightwire::proxy
