#pragma once
// HTTP/1.1 listeners (Boost.Beast) on Unix sockets and TCP: keep-alive, header and body limits
// checked before anything is read into memory, idle timeouts, and handlers that may answer later
// (a step waits for the node's other trainers). The server knows nothing of routes: a Handler
// maps a request to a response (proxy/server/control_api.h).

#include <boost/asio/io_context.hpp>
#include <boost/beast/http.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace lightwire::proxy {

namespace http = boost::beast::http;
using Request = http::request<http::string_body>;
using Response = http::response<http::string_body>;

/// Which listener a request came through (the admin listener serves a subset of routes).
enum class ListenerKind { kControl, kAdmin };

/// Limits of one server (docs/configuration.md, limits.*).
struct HttpLimits {
  uint64_t max_body_bytes = uint64_t{1} << 30;
  /// Request bodies being read or held at once, all connections together (0 = no cap): a body
  /// that would pass it is refused from its Content-Length (429), before it is read.
  uint64_t max_inflight_body_bytes = 0;
  uint32_t max_header_bytes = 16384;
  /// A kept-alive connection may wait this long for its next request.
  std::chrono::milliseconds idle_timeout{60000};
  /// From a request's first byte (or a new connection's accept) to the end of its headers.
  std::chrono::milliseconds header_timeout{10000};
  /// A body must arrive at this average rate at least, after header_timeout of grace (bytes per
  /// second; 0 = only idle_timeout bounds it).
  uint64_t min_body_rate = uint64_t{1} << 20;
};

/// The connection budget of one listener (docs/configuration.md, limits.<listener>.*).
struct ListenerLimits {
  size_t max_connections = 256;
  /// Connections at once from one source (0 = no cap): a TCP client's address, a Unix-socket
  /// client's user id (SO_PEERCRED).
  size_t max_per_source = 0;
};

/// Answers one request. Called on an I/O thread; must not block: it calls `reply` exactly once,
/// from any thread, possibly later. `peer_is_tcp` says whether the client came over TCP (bearer
/// tokens guard TCP control access).
using Reply = std::function<void(Response)>;
struct RequestInfo {
  ListenerKind listener = ListenerKind::kControl;
  bool tcp = false;
  /// The client's process id as the kernel reports it (SO_PEERCRED) on a Unix socket; 0 over TCP
  /// or when the client lives in a PID namespace this process cannot see.
  int pid = 0;
  /// The client's user id (SO_PEERCRED) on a Unix socket; -1 over TCP.
  long uid = -1;
};
using Handler = std::function<void(Request&& request, const RequestInfo& info, Reply reply)>;

/// A JSON error response {"error": code, "message": message} (docs/api.md).
Response errorResponse(http::status status, std::string_view code, std::string_view message,
                       unsigned version = 11, bool keep_alive = true);

/// What the server does with a request whose headers have arrived, before its body is read or
/// any of the body budget is reserved: `refuse` is answered at once (and the connection closed);
/// `trusted` marks the connection as a known client's, never evicted for a new one.
struct HeaderVerdict {
  std::optional<Response> refuse;
  bool trusted = false;
};
using HeaderCheck =
    std::function<HeaderVerdict(const Request& header, const RequestInfo& info, bool has_body)>;

/// Owns the acceptors and sessions on an io_context run by the caller's threads. Thread-safe.
class HttpServer {
 public:
  HttpServer(boost::asio::io_context& io, HttpLimits limits, Handler handler);
  ~HttpServer();

  /// Called for every request the server refuses itself, before any handler sees it (413, 431,
  /// malformed HTTP): the request target ("" when the header could not be read) and the status.
  /// Set before listening.
  using RefusedHook = std::function<void(std::string_view target, unsigned status)>;
  void onRefused(RefusedHook hook);
  /// Called whenever a connection or request hits one of the limits (metrics::kLimitNames:
  /// "body_bytes", "inflight_body_bytes", "header_bytes", "connections", "connections_per_source",
  /// "evicted", "header_timeout", "body_rate", "request_timeout", "accept_errors"), with the
  /// listener's name ("unix", "control_tcp", "admin"). Set before listening.
  using LimitHook = std::function<void(std::string_view limit, std::string_view listener)>;
  void onLimit(LimitHook hook);
  /// Called with every request's headers before its body is read (HeaderVerdict). Set before
  /// listening.
  void onHeader(HeaderCheck check);

  /// Listens on a Unix socket at `path` (its directory is created; a stale socket file is
  /// replaced, a live one is an error) with permissions `mode` (set as the socket is created, so
  /// it is never reachable with wider ones). Returns "" or an error message.
  std::string listenUnix(const std::string& path, ListenerKind kind, unsigned mode = 0660,
                         ListenerLimits budget = {});
  /// Listens on host:port (port 0 = chosen by the system); returns "" or an error message and
  /// sets `bound_port`. Each listener has its own connection budget: when it is full, a new
  /// connection evicts the oldest connection that has neither completed a request nor been
  /// trusted by the header check, or else is answered 503 with Retry-After and closed.
  std::string listenTcp(const std::string& host, uint16_t port, ListenerKind kind,
                        uint16_t* bound_port, ListenerLimits budget = {});
  /// Stops accepting, closes idle connections; sessions with a request in progress finish it
  /// and then close. Removes the Unix socket files.
  void stop();
  /// Connections open now, all listeners together.
  size_t connections() const { return connections_->load(); }
  /// Connections open now on the listener of that name (0 when there is none).
  size_t connections(std::string_view listener) const;
  /// Bytes of large bodies' strings kept for the next large bodies (docs/deploy.md "Sizing").
  uint64_t keptBodyBytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<std::atomic<size_t>> connections_;
};

}  // namespace lightwire::proxy
