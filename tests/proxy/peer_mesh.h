#pragma once
// N transports of one job on loopback over one link (tcp, tcp with TLS, ucx), for the transport
// conformance suite (tests/proxy/peer_conformance_test.cc) and the collective tests. UCX's own
// transports are whatever UCX_TLS in the environment allows (tests/meson.build runs the ucx cases
// with UCX_TLS=tcp and with shared memory).

#include <doctest.h>

#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "metrics/metrics.h"
#include "proxy/exchange/exchange.h"
#include "proxy/peer/tcp_transport.h"
#include "tests/proxy/tls_pki.h"
#ifdef LIGHTWIRE_HAVE_UCX
#include "proxy/peer/ucx_transport.h"
#endif

namespace lightwire::proxy::peer::testing {

using namespace std::chrono_literals;  // NOLINT(google-build-using-namespace)
using Clock = std::chrono::steady_clock;

inline constexpr const char* kJob = "job-test";
inline constexpr const char* kSecret = "correct horse battery staple";

/// Short timeouts for tests, on the options of either transport.
template <typename Options>
Options fastOptionsOf() {
  Options o;
  o.connect_timeout = 1000ms;
  o.handshake_timeout = 2000ms;
  o.backoff_initial = 10ms;
  o.backoff_max = 200ms;
  o.ping_interval = 100ms;
  o.peer_timeout = 3000ms;
  return o;
}

inline TcpOptions fastOptions() { return fastOptionsOf<TcpOptions>(); }

inline TcpOptions Pki::optionsFor(uint32_t r) const {
  TcpOptions o = fastOptions();
  o.tls = {
      .enabled = true, .cert_file = cert_files[r], .key_file = key_files[r], .ca_file = ca_file};
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

/// The plain `tcp` link. Stateless.
struct TcpLink {
  using TransportType = TcpTransport;
  using Options = TcpOptions;
  static constexpr bool kCountsRefusedFrames = true;  // lightwire_peer_frames_refused_total
  static Options options(uint32_t /*rank*/) { return fastOptions(); }
  static Result<std::unique_ptr<TcpTransport>> listen(uint16_t port, const Options& o,
                                                      metrics::Metrics& m) {
    return TcpTransport::listen("127.0.0.1", port, o, m);
  }
};

/// The `tcp` link with mutual TLS: every rank's certificate from one PKI made for the process.
struct TlsLink : TcpLink {
  static const Pki& pki() {
    static const Pki* const kPki = new Pki(5);  // outlives every test; its files go at exit
    return *kPki;
  }
  static Options options(uint32_t rank) { return pki().optionsFor(rank); }
};

#ifdef LIGHTWIRE_HAVE_UCX
inline UcxOptions fastUcxOptions() { return fastOptionsOf<UcxOptions>(); }

/// The `ucx` link. Stateless.
struct UcxLink {
  using TransportType = UcxTransport;
  using Options = UcxOptions;
  static constexpr bool kCountsRefusedFrames = false;
  static Options options(uint32_t /*rank*/) { return fastUcxOptions(); }
  static Result<std::unique_ptr<UcxTransport>> listen(uint16_t port, const Options& o,
                                                      metrics::Metrics& m) {
    return UcxTransport::listen("127.0.0.1", port, o, m);
  }
};
#endif

/// N transports of one job over link L, listening before any starts. Not thread-safe.
template <typename L>
struct LinkMesh {
  using Options = typename L::Options;
  explicit LinkMesh(uint32_t n) {
    for (uint32_t r = 0; r < n; ++r) listenRank(L::options(r));
  }
  /// Every rank with L's options for it, changed by `change`.
  template <typename Change>
  LinkMesh(uint32_t n, Change change) {
    for (uint32_t r = 0; r < n; ++r) {
      Options o = L::options(r);
      change(o);
      listenRank(o);
    }
  }
  /// Adds a rank listening with `o`.
  void listenRank(const Options& o) {
    options.push_back(o);
    metrics.push_back(std::make_unique<metrics::Metrics>());
    auto t = L::listen(0, o, *metrics.back());
    REQUIRE_MESSAGE(t.isOk(), t.status().message());
    ports.push_back((*t)->port());
    REQUIRE(ports.back() != 0);
    transports.push_back(std::move(*t));
  }
  /// Rank r again, on its port (after its transport was destroyed).
  void relisten(uint32_t r) {
    auto t = L::listen(ports[r], options[r], *metrics[r]);
    REQUIRE_MESSAGE(t.isOk(), t.status().message());
    transports[r] = std::move(*t);
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
  std::vector<Options> options;  // index = rank
  std::vector<std::unique_ptr<metrics::Metrics>> metrics;
  std::vector<std::unique_ptr<typename L::TransportType>> transports;
  std::vector<uint16_t> ports;
};

using Mesh = LinkMesh<TcpLink>;
#ifdef LIGHTWIRE_HAVE_UCX
using UcxMesh = LinkMesh<UcxLink>;
#endif

/// Rank r's policy statistics record of `step` for exchange tests: a different size on every
/// rank and step, rank 1's the largest allowed (kMaxStatsBytes).
inline std::vector<uint8_t> statsOf(uint32_t rank, uint64_t step) {
  const size_t n = rank == 1 ? kMaxStatsBytes : 1 + 37 * rank + step % 5;
  std::vector<uint8_t> b;
  b.reserve(n);
  for (size_t i = 0; i < n; ++i) b.push_back(static_cast<uint8_t>(i * 31 + rank * 7 + step));
  return b;
}

/// A statistics fold for exchange tests (ExchangeRound::stats_fold), which keeps every record:
/// the partial is a list of (u32 rank, u32 length, record), ranks increasing. Refuses a partial
/// that is not such a list and a rank out of order, as the policies' fold does.
inline Result<std::vector<uint8_t>> keepAllFold(std::span<const uint8_t> partial,
                                                std::span<const uint8_t> record, uint32_t rank) {
  auto u32 = [](std::span<const uint8_t> b, size_t at) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v |= uint32_t{b[at + i]} << (8 * i);
    return v;
  };
  size_t pos = 0;
  int64_t last = -1;
  while (pos < partial.size()) {
    if (partial.size() - pos < 8) return invalidArgument("kept records: truncated");
    const uint32_t r = u32(partial, pos), len = u32(partial, pos + 4);
    if (static_cast<int64_t>(r) <= last || partial.size() - pos - 8 < len) {
      return invalidArgument("kept records: malformed");
    }
    last = r;
    pos += 8 + len;
  }
  if (static_cast<int64_t>(rank) <= last) return invalidArgument("kept records: out of order");
  std::vector<uint8_t> out(partial.begin(), partial.end());
  for (uint32_t v : {rank, static_cast<uint32_t>(record.size())}) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  out.insert(out.end(), record.begin(), record.end());
  return out;
}

/// The records keepAllFold() kept, index = rank (`w` entries; empty for a rank without one).
inline std::vector<std::vector<uint8_t>> keptRecords(std::span<const uint8_t> partial, uint32_t w) {
  std::vector<std::vector<uint8_t>> out(w);
  for (size_t pos = 0; pos + 8 <= partial.size();) {
    uint32_t r = 0, len = 0;
    for (size_t i = 0; i < 4; ++i) {
      r |= uint32_t{partial[pos + i]} << (8 * i);
      len |= uint32_t{partial[pos + 4 + i]} << (8 * i);
    }
    REQUIRE(r < w);
    out[r].assign(partial.begin() + static_cast<std::ptrdiff_t>(pos + 8),
                  partial.begin() + static_cast<std::ptrdiff_t>(pos + 8 + len));
    pos += 8 + len;
  }
  return out;
}

}  // namespace lightwire::proxy::peer::testing
