#pragma once
// N UcxTransports of one job on loopback, for the ucx transport tests (peer_mesh.h for tcp).
// UCX's transports are whatever UCX_TLS in the environment allows (tests/meson.build runs the
// ucx tests with UCX_TLS=tcp and with shared memory).

#include <doctest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "metrics/metrics.h"
#include "proxy/peer/ucx_transport.h"
#include "tests/proxy/peer_mesh.h"

namespace lightwire::proxy::peer::testing {

inline UcxOptions fastUcxOptions() {
  UcxOptions o;
  o.connect_timeout = 1000ms;
  o.handshake_timeout = 2000ms;
  o.backoff_initial = 10ms;
  o.backoff_max = 200ms;
  o.ping_interval = 100ms;
  o.peer_timeout = 3000ms;
  return o;
}

/// N ucx transports of one job, listening before any starts.
struct UcxMesh {
  explicit UcxMesh(uint32_t n, UcxOptions o = fastUcxOptions()) : options(o) {
    for (uint32_t r = 0; r < n; ++r) {
      metrics.push_back(std::make_unique<metrics::Metrics>());
      auto t = UcxTransport::listen("127.0.0.1", 0, options, *metrics.back());
      REQUIRE_MESSAGE(t.isOk(), t.status().message());
      ports.push_back((*t)->port());
      REQUIRE(ports.back() != 0);
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
  UcxOptions options;
  std::vector<std::unique_ptr<metrics::Metrics>> metrics;
  std::vector<std::unique_ptr<UcxTransport>> transports;
  std::vector<uint16_t> ports;
};

}  // namespace lightwire::proxy::peer::testing
