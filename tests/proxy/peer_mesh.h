#pragma once
// N TcpTransports of one job on loopback, for the transport and collective tests.

#include <doctest.h>

#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "metrics/metrics.h"
#include "proxy/peer/tcp_transport.h"

#include "proxy/step/engine.h"

namespace lightwire::proxy::peer::testing {

using namespace std::chrono_literals;  // NOLINT(google-build-using-namespace)
using Clock = std::chrono::steady_clock;

inline constexpr const char* kJob = "job-test";
inline constexpr const char* kSecret = "correct horse battery staple";

inline TcpOptions fastOptions() {
  TcpOptions o;
  o.connect_timeout = 1000ms;
  o.handshake_timeout = 2000ms;
  o.backoff_initial = 10ms;
  o.backoff_max = 200ms;
  o.ping_interval = 100ms;
  o.peer_timeout = 3000ms;
  return o;
}

inline Membership membershipFor(uint32_t rank, const std::vector<uint16_t>& ports,
                                std::string job = kJob, std::string secret = kSecret) {
  Membership m;
  m.job_id = std::move(job);
  m.rank = rank;
  m.world_size = static_cast<uint32_t>(ports.size());
  for (uint16_t p : ports) m.peers.push_back("127.0.0.1:" + std::to_string(p));
  m.secret = std::move(secret);
  return m;
}

template <typename Pred>
bool waitFor(Pred pred, std::chrono::milliseconds timeout = 10s) {
  const auto end = Clock::now() + timeout;
  while (Clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return pred();
}

inline double metricValue(const metrics::Metrics& m, const std::string& line_prefix) {
  std::istringstream in(m.exposition());
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(line_prefix + " ", 0) == 0) return std::stod(line.substr(line_prefix.size()));
  }
  return -1;
}
inline double authFailures(const metrics::Metrics& m) {
  return metricValue(m, "lightwire_auth_failures_total");
}

/// N transports of one job, listening before any starts.
struct Mesh {
  explicit Mesh(uint32_t n, TcpOptions o = fastOptions()) : options(o) {
    for (uint32_t r = 0; r < n; ++r) {
      metrics.push_back(std::make_unique<metrics::Metrics>());
      auto t = TcpTransport::listen("127.0.0.1", 0, options, *metrics.back());
      REQUIRE(t.isOk());
      ports.push_back((*t)->port());
      transports.push_back(std::move(*t));
    }
  }
  void startAll() {
    for (uint32_t r = 0; r < transports.size(); ++r) start(r);
  }
  void start(uint32_t r) { REQUIRE(transports[r]->start(membershipFor(r, ports)).isOk()); }
  bool allConnected(std::chrono::milliseconds timeout = 10s) {
    return waitFor(
        [&] {
          for (auto& t : transports) {
            if (t && !t->allConnected()) return false;
          }
          return true;
        },
        timeout);
  }
  TcpOptions options;
  std::vector<std::unique_ptr<metrics::Metrics>> metrics;
  std::vector<std::unique_ptr<TcpTransport>> transports;
  std::vector<uint16_t> ports;
};

/// Rank r's policy statistics record of `step` for exchange tests: a different size on every
/// rank and step, rank 1's the largest allowed (kMaxStatsBytes).
inline std::vector<uint8_t> statsOf(uint32_t rank, uint64_t step) {
  const size_t n = rank == 1 ? kMaxStatsBytes : 1 + 37 * rank + step % 5;
  std::vector<uint8_t> b;
  b.reserve(n);
  for (size_t i = 0; i < n; ++i) b.push_back(static_cast<uint8_t>(i * 31 + rank * 7 + step));
  return b;
}

}  // namespace lightwire::proxy::peer::testing
