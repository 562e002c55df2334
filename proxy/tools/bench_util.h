#pragma once
// Pieces shared by the benchmarks that run real `lightwire serve` child processes
// (proxy/tools/bench_ingest.h, proxy/tools/bench_exchange.h): a keep-alive Beast client on a
// sidecar's Unix socket, the sidecar child process itself, a POSIX shared-memory segment, and the
// statistics.

#include <sys/mman.h>
#include <sys/types.h>

#include <boost/asio/generic/stream_protocol.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace lightwire::proxy::bench {

using Clock = std::chrono::steady_clock;

inline double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

/// The element of rank round(q · (n − 1)) of the sorted values (q in [0, 1]; v not empty).
double percentile(std::vector<double> v, double q);
inline double median(std::vector<double> v) { return percentile(std::move(v), 0.5); }

/// A keep-alive HTTP/1.1 client on the sidecar's Unix socket. Throws on connection errors.
class Client {
 public:
  explicit Client(const std::string& path);
  /// On 127.0.0.1:port (the sidecar's TCP control listener).
  explicit Client(uint16_t port);

  /// A request whose large body and reply reuse the caller's buffers (a benchmark client should
  /// not be the bottleneck): `body` is sent and left as it was; the reply body goes into `reply`,
  /// resized to fit. Returns the status.
  boost::beast::http::status requestReuse(const std::string& target, std::string& body,
                                          std::string& reply);

  boost::beast::http::response<boost::beast::http::string_body> request(
      boost::beast::http::verb verb, const std::string& target, std::string body = {},
      const char* type = "application/octet-stream");

 private:
  void tune();

  boost::asio::io_context io_;
  boost::asio::generic::stream_protocol::socket socket_;
  boost::beast::flat_buffer buffer_;
};

/// Throws "<what>: HTTP <status> <body>" unless the reply is 200 or 201.
void expectOk(const boost::beast::http::response<boost::beast::http::string_body>& r,
              const char* what);

/// A `lightwire serve` child process: SIGTERM and wait on destruction (SIGKILL after 10 s), and
/// the child gets SIGTERM when this process dies (PR_SET_PDEATHSIG), so it never outlives the
/// benchmark.
class Sidecar {
 public:
  struct Options {
    std::string exe;          // the `lightwire` executable
    std::string socket;       // its control Unix socket
    std::string control_tcp;  // its TCP control listener, host:port ("" = none)
    std::string log;          // its stdout and stderr
    /// Arguments after `serve --socket S --control-tcp T --admin-listen "" --log-level warn`.
    std::vector<std::string> args;
    /// Added to the inherited environment (NAME, value).
    std::vector<std::pair<std::string, std::string>> env;
    int cpu = -1;  // when >= 0, pinned to this CPU with every thread it starts
  };

  /// Starts the process; returns at once (see waitReady).
  explicit Sidecar(Options o);
  ~Sidecar();
  Sidecar(const Sidecar&) = delete;
  Sidecar& operator=(const Sidecar&) = delete;

  /// Waits until GET /readyz on its socket answers 200 (every listener up, every peer
  /// connected). Throws when the process exits first or `timeout` passes.
  void waitReady(Clock::duration timeout = std::chrono::seconds(10));

  /// Whether the process has exited (reaps it).
  bool exited();
  const std::string& log() const { return o_.log; }
  const std::string& socket() const { return o_.socket; }

 private:
  Options o_;
  pid_t pid_ = -1;
};

/// The last `lines` lines of a text file ("" when it cannot be read).
std::string fileTail(const std::string& path, size_t lines = 20);

/// A POSIX shared-memory segment created (and unlinked) by the benchmark, as a trainer would.
struct Segment {
  std::string name;
  void* data = MAP_FAILED;
  size_t bytes = 0;
  Segment(std::string n, size_t b);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
};

}  // namespace lightwire::proxy::bench
