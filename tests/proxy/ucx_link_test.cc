// The ucx link's own cases (the conformance suite, tests/proxy/peer_conformance_test.cc, runs the
// shared ones; tests/proxy/collective_test.cc the ring over ucx): the rendezvous it does not
// serve, the cap on endpoints stuck before authenticating, a message whose length disagrees with
// its header, and a raw TCP client at the listener. UCX_TLS as tests/meson.build sets it; every
// wait is bounded.

#include <arpa/inet.h>
#include <doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "metrics/metrics.h"
#include "proxy/peer/frame.h"
#include "proxy/peer/ucx_transport.h"
#include "tests/proxy/peer_mesh.h"
#include "tests/proxy/raw_peers.h"

namespace lightwire::proxy::peer {
namespace {

using namespace std::chrono_literals;             // NOLINT(google-build-using-namespace)
using namespace lightwire::proxy::peer::testing;  // NOLINT(google-build-using-namespace)

}  // namespace

TEST_CASE("ucx transport: a rendezvous membership is refused at start (tcp serves it)") {
  metrics::Metrics metrics;
  auto t = UcxTransport::listen("127.0.0.1", 0, fastUcxOptions(), metrics);
  REQUIRE(t.isOk());
  Membership m;
  m.job_id = kJob;
  m.rank = 1;
  m.world_size = 2;
  m.secret = kSecret;
  m.rendezvous = "127.0.0.1:4781";
  Status st = (*t)->start(m);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message().find("rendezvous") != std::string::npos);
  CHECK(!UcxTransport::listen("not-an-address", 0, fastUcxOptions(), metrics).isOk());
}

TEST_CASE("ucx transport: endpoints stuck before authenticating are capped at accept") {
  UcxOptions o = fastUcxOptions();
  o.max_pending_handshakes = 3;
  o.handshake_timeout = 5000ms;
  Lone<UcxLink> lone(o);
  auto hits = [&] { return lone.metrics.limitHits("peer_handshakes").Value(); };
  // Four clients that connect and say nothing: three hold every handshake place, whichever
  // arrives when they are taken is rejected at once and counted (the order in which the
  // listener sees them is UCX's business).
  std::vector<std::unique_ptr<RawUcx>> idle;
  for (int i = 0; i < 4; ++i) {
    idle.push_back(std::make_unique<RawUcx>(lone.transport->port()));
    idle.back()->progressFor(20ms);
  }
  CHECK(waitFor([&] {
    for (auto& c : idle) c->progressFor(1ms);
    return hits() >= 1;
  }));
  int closed = 0;
  for (auto& c : idle) closed += c->closedByPeer(300ms);
  // Exactly one, long before the handshake deadline would have closed the other three.
  CHECK(closed == 1);
  CHECK(hits() == 1);
  // Once they are gone, a real rank connects.
  idle.clear();
  bool ok = false;
  std::unique_ptr<RawUcx> good;
  // The server may not have seen the idle ones close yet: a refused attempt is retried.
  for (int attempt = 0; attempt < 50 && !ok; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(50ms);
    good = std::make_unique<RawUcx>(lone.transport->port());
    ok = good->handshake(0, 1, 2);
  }
  REQUIRE(ok);
  CHECK(waitFor([&] {
    good->progressFor(5ms);
    return lone.transport->allConnected();
  }));
}

TEST_CASE("ucx transport: a frame whose header and message disagree closes the connection") {
  UcxOptions o = fastUcxOptions();
  o.max_frame_bytes = 1 << 20;
  const uint64_t job = jobHash(kJob);
  {
    Lone<UcxLink> lone(o);
    RawUcx c(lone.transport->port());
    REQUIRE(c.handshake(0, 1, 2));
    std::vector<uint8_t> p(100, 1);
    auto h = makeHeader(FrameType::kData, keyFor(1), 0, job, 0, p);
    h.length = 50;  // the message carries 100
    REQUIRE(c.sendFrame(h, p));
    CHECK(c.closedByPeer());
    auto f = lone.transport->receive(0, keyFor(1), Clock::now() + 2s);
    REQUIRE(!f.isOk());
    CHECK(f.status().message().find("rank 0") != std::string::npos);
    CHECK(f.status().message().find("announces") != std::string::npos);
  }
}

TEST_CASE("ucx transport: a raw TCP client sending garbage to the listener changes nothing") {
  UcxMesh mesh(2);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  for (int i = 0; i < 3; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(mesh.ports[1]);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    std::vector<uint8_t> junk(4096, static_cast<uint8_t>('x' + i));
    (void)::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    std::this_thread::sleep_for(50ms);
    ::close(fd);
  }
  std::vector<uint8_t> p = pattern(3000, 6);
  REQUIRE(mesh.transports[0]->send(1, FrameType::kData, keyFor(1), 0, p, Clock::now() + 5s).isOk());
  auto f = mesh.transports[1]->receive(0, keyFor(1), Clock::now() + 5s);
  REQUIRE(f.isOk());
  CHECK(f->payload == p);
  CHECK(mesh.transports[1]->allConnected());
}

}  // namespace lightwire::proxy::peer
