// TcpTransport over real loopback sockets (ports chosen by the OS): mesh set-up in any order,
// all-to-all traffic, deadlines, aborts, lost and rejoining peers, handshake refusals, and hostile
// frames from a raw client that speaks the protocol itself. Every wait is bounded.

#include <arpa/inet.h>
#include <doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <sstream>
#include <thread>

#include "metrics/metrics.h"
#include "proxy/peer/frame.h"
#include "proxy/peer/tcp_transport.h"
#include "tests/proxy/peer_mesh.h"

namespace lightwire::proxy::peer {
namespace {

using namespace std::chrono_literals;
using namespace lightwire::proxy::peer::testing;
using Clock = std::chrono::steady_clock;

std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

FrameKey keyFor(uint64_t step, uint32_t chunk = 0, uint32_t origin = 0) {
  FrameKey k;
  k.tensor = 0xabcdefull;
  k.step = step;
  k.chunk = chunk;
  k.origin = origin;
  return k;
}

/// Every rank sends a distinct payload for steps 2 then 1 to every other; every rank then asks
/// for step 1 first (step 2's frames arrived first and must have been kept).
void allToAll(Mesh& mesh, size_t big_bytes) {
  const uint32_t n = static_cast<uint32_t>(mesh.transports.size());
  auto size_of = [&](uint32_t src, uint32_t dst, uint64_t step) -> size_t {
    if (src == 0 && dst == 1 && step == 1) return big_bytes;
    if (src == 1 && step == 2) return 0;  // empty payloads travel too
    return 1000 + 37 * src + 11 * dst + step;
  };
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (uint32_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      for (uint64_t step : {2, 1}) {
        for (uint32_t d = 0; d < n; ++d) {
          if (d == r) continue;
          auto p = pattern(size_of(r, d, step), r * 100 + d * 10 + static_cast<uint32_t>(step));
          Status st = mesh.transports[r]->send(d, FrameType::kData, keyFor(step, d, r),
                                               static_cast<uint8_t>(step), p, Clock::now() + 20s);
          if (!st.isOk()) {
            MESSAGE(st.message());
            ++failures;
          }
        }
      }
    });
  }
  for (uint32_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      for (uint64_t step : {1, 2}) {
        for (uint32_t s = 0; s < n; ++s) {
          if (s == r) continue;
          auto f = mesh.transports[r]->receive(s, keyFor(step, r, s), Clock::now() + 20s);
          if (!f.isOk()) {
            MESSAGE(f.status().message());
            ++failures;
            continue;
          }
          auto want = pattern(size_of(s, r, step), s * 100 + r * 10 + static_cast<uint32_t>(step));
          if (f->payload != want || f->src != s || f->codec != step ||
              !(f->key == keyFor(step, r, s))) {
            ++failures;
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(failures.load() == 0);
}

/// A client that speaks the protocol by hand.
class RawClient {
 public:
  explicit RawClient(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval tv{5, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~RawClient() { ::close(fd_); }
  bool connected() const { return connected_; }
  bool sendAll(std::span<const uint8_t> b) {
    size_t off = 0;
    while (off < b.size()) {
      ssize_t n = ::send(fd_, b.data() + off, b.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }
  bool sendFrame(const FrameHeader& h, std::span<const uint8_t> payload) {
    auto hb = encodeHeader(h);
    return sendAll(hb) && sendAll(payload);
  }
  bool recvAll(uint8_t* p, size_t n) {
    size_t off = 0;
    while (off < n) {
      ssize_t k = ::recv(fd_, p + off, n - off, 0);
      if (k <= 0) return false;
      off += static_cast<size_t>(k);
    }
    return true;
  }
  /// Whether the other side closed the connection (EOF or reset) within the receive timeout,
  /// skipping whatever it sent before (pings).
  bool closedByPeer() {
    uint8_t buf[4096];
    for (;;) {
      ssize_t k = ::recv(fd_, buf, sizeof(buf), 0);
      if (k == 0) return true;
      if (k < 0) return errno == ECONNRESET;  // EAGAIN: timed out, still open
    }
  }
  /// Completes the handshake as `rank` with the server `server` of a world of `world`.
  bool handshake(uint32_t rank, uint32_t server, uint32_t world, std::string job = kJob,
                 std::string secret = kSecret) {
    auto cn = randomNonce();
    auto hello = encodeHello(Hello{world, server, *cn});
    if (!sendFrame(makeHeader(FrameType::kHello, {}, 0, jobHash(job), rank, hello), hello)) {
      return false;
    }
    std::array<uint8_t, kHeaderBytes> hb{};
    if (!recvAll(hb.data(), hb.size())) return false;
    HeaderChecks c{jobHash(job), world, rank, server, kChallengeBytes};
    auto h = decodeHeader(hb, c, "server");
    if (!h.isOk() || h->type != FrameType::kChallenge) return false;
    std::array<uint8_t, kChallengeBytes> ch{};
    if (!recvAll(ch.data(), ch.size())) return false;
    Nonce sn{};
    std::copy_n(ch.begin(), kNonceBytes, sn.begin());
    auto expect = handshakeMac(MacRole::kServer, secret, job, *cn, sn, rank, server, world);
    if (!macEqual(expect, std::span(ch).subspan(kNonceBytes))) return false;
    auto auth = handshakeMac(MacRole::kClient, secret, job, *cn, sn, rank, server, world);
    return sendFrame(makeHeader(FrameType::kAuth, {}, 0, jobHash(job), rank, auth), auth);
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

/// One transport (rank 1 of 2) whose rank 0 is played by a RawClient.
struct Lone {
  explicit Lone(TcpOptions o = fastOptions(), uint32_t world = 2) {
    auto t = TcpTransport::listen("127.0.0.1", 0, o, metrics);
    REQUIRE(t.isOk());
    transport = std::move(*t);
    std::vector<uint16_t> ports(world, 1);  // rank 0 never listens: it is the raw client
    ports[1] = transport->port();
    REQUIRE(transport->start(membershipFor(1, ports)).isOk());
  }
  metrics::Metrics metrics;
  std::unique_ptr<TcpTransport> transport;
};

}  // namespace

TEST_CASE("tcp transport: 2, 3 and 5 ranks connect and exchange all to all") {
  for (uint32_t n : {2u, 3u, 5u}) {
    CAPTURE(n);
    Mesh mesh(n);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    allToAll(mesh, n == 3 ? (size_t{64} << 20) : 4096);
    for (auto& m : mesh.metrics) {
      CHECK(metricValue(*m, "lightwire_wire_bytes_total{direction=\"sent\"}") > 0);
    }
  }
}

TEST_CASE("tcp transport: peers start in any order, with delays") {
  Mesh mesh(4);
  for (uint32_t r : {3u, 0u, 2u, 1u}) {
    std::this_thread::sleep_for(150ms);
    mesh.start(r);
  }
  REQUIRE(mesh.allConnected());
  for (auto& t : mesh.transports) {
    for (bool up : t->peersUp()) CHECK(up);
  }
  CHECK(metricValue(*mesh.metrics[0], "lightwire_peer_up{peer=\"3\"}") == 1);
  // Pings measure round trips.
  CHECK(waitFor(
      [&] { return metricValue(*mesh.metrics[0], "lightwire_peer_rtt_seconds{peer=\"1\"}") > 0; }));
  allToAll(mesh, 1 << 20);
}

TEST_CASE("tcp transport: receive deadline names the silent rank") {
  Mesh mesh(2);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  const auto t0 = Clock::now();
  auto f = mesh.transports[0]->receive(1, keyFor(5), t0 + 300ms);
  const auto waited = Clock::now() - t0;
  REQUIRE(!f.isOk());
  CHECK(f.status().message().find("rank 1") != std::string::npos);
  CHECK(f.status().message().find("deadline") != std::string::npos);
  CHECK(waited >= 290ms);
  CHECK(waited < 2s);
  // Bad arguments are errors, not aborts.
  CHECK(!mesh.transports[0]->receive(0, keyFor(5), t0).isOk());
  CHECK(!mesh.transports[0]->receive(7, keyFor(5), t0).isOk());
  std::vector<uint8_t> p(10);
  CHECK(!mesh.transports[0]->send(0, FrameType::kData, keyFor(5), 0, p, t0 + 1s).isOk());
  CHECK(!mesh.transports[0]->send(1, FrameType::kHello, keyFor(5), 0, p, t0 + 1s).isOk());
}

TEST_CASE("tcp transport: abortStep fails the other side's receive at once; discard clears it") {
  Mesh mesh(3);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  auto pending = std::async(std::launch::async, [&] {
    auto t0 = Clock::now();
    auto f = mesh.transports[0]->receive(2, keyFor(7, 3), t0 + 10s);
    return std::pair{std::move(f), Clock::now() - t0};
  });
  std::this_thread::sleep_for(100ms);
  mesh.transports[1]->abortStep(0xabcdefull, 7, "non-finite gradient");
  auto [f, waited] = pending.get();
  REQUIRE(!f.isOk());
  CHECK(f.status().message().find("non-finite gradient") != std::string::npos);
  CHECK(f.status().message().find("rank 1") != std::string::npos);
  CHECK(waited < 3s);
  // Other steps are unaffected; after discard the step is no longer aborted.
  std::vector<uint8_t> p = pattern(100, 1);
  REQUIRE(mesh.transports[2]->send(0, FrameType::kData, keyFor(8), 0, p, Clock::now() + 5s).isOk());
  auto g = mesh.transports[0]->receive(2, keyFor(8), Clock::now() + 5s);
  REQUIRE(g.isOk());
  CHECK(g->payload == p);
  mesh.transports[0]->discard(0xabcdefull, 7);
  auto h = mesh.transports[0]->receive(2, keyFor(7), Clock::now() + 100ms);
  REQUIRE(!h.isOk());
  CHECK(h.status().message().find("deadline") != std::string::npos);
}

TEST_CASE("tcp transport: discard drops kept frames") {
  Mesh mesh(2);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  std::vector<uint8_t> p = pattern(100, 2);
  for (uint64_t step : {1, 2, 3}) {
    REQUIRE(mesh.transports[1]
                ->send(0, FrameType::kData, keyFor(step), 0, p, Clock::now() + 5s)
                .isOk());
  }
  // Let them arrive, then drop steps <= 2.
  std::this_thread::sleep_for(200ms);
  mesh.transports[0]->discard(0xabcdefull, 2);
  CHECK(!mesh.transports[0]->receive(1, keyFor(1), Clock::now() + 50ms).isOk());
  CHECK(!mesh.transports[0]->receive(1, keyFor(2), Clock::now() + 50ms).isOk());
  CHECK(mesh.transports[0]->receive(1, keyFor(3), Clock::now() + 2s).isOk());
}

TEST_CASE("tcp transport: a destroyed peer fails receives from it; a new one rejoins") {
  Mesh mesh(3);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  auto pending = std::async(std::launch::async, [&] {
    auto t0 = Clock::now();
    auto f = mesh.transports[0]->receive(1, keyFor(9), t0 + 20s);
    return std::pair{std::move(f), Clock::now() - t0};
  });
  std::this_thread::sleep_for(100ms);
  mesh.transports[1].reset();
  auto [f, waited] = pending.get();
  REQUIRE(!f.isOk());
  CHECK(f.status().message().find("rank 1") != std::string::npos);
  CHECK(waited < 5s);
  CHECK(waitFor(
      [&] { return !mesh.transports[0]->peersUp()[1] && !mesh.transports[2]->peersUp()[1]; }));
  CHECK(!mesh.transports[0]->allConnected());
  CHECK(metricValue(*mesh.metrics[2], "lightwire_peer_up{peer=\"1\"}") == 0);
  // Sending to it fails promptly too.
  std::vector<uint8_t> p = pattern(10, 3);
  CHECK(!mesh.transports[2]->send(1, FrameType::kData, keyFor(9), 0, p, Clock::now() + 5s).isOk());

  // Rejoin on the same address.
  auto t = TcpTransport::listen("127.0.0.1", mesh.ports[1], mesh.options, *mesh.metrics[1]);
  REQUIRE(t.isOk());
  mesh.transports[1] = std::move(*t);
  mesh.start(1);
  REQUIRE(mesh.allConnected());
  allToAll(mesh, 1 << 16);
}

TEST_CASE("tcp transport: a transport with the wrong secret or job is refused and counted") {
  for (const char* what : {"secret", "job"}) {
    CAPTURE(what);
    Mesh mesh(2);
    mesh.start(1);
    const bool bad_secret = std::string(what) == "secret";
    auto m = membershipFor(0, mesh.ports, bad_secret ? kJob : "other-job",
                           bad_secret ? "wrong secret" : kSecret);
    REQUIRE(mesh.transports[0]->start(m).isOk());
    CHECK(waitFor([&] { return authFailures(*mesh.metrics[1]) >= 1; }));
    if (bad_secret) CHECK(waitFor([&] { return authFailures(*mesh.metrics[0]) >= 1; }));
    CHECK(!mesh.transports[1]->peersUp()[0]);
    CHECK(!mesh.transports[0]->peersUp()[1]);
    CHECK(!mesh.transports[0]->allConnected());
  }
}

TEST_CASE("tcp transport: raw clients speaking wrong things are refused and counted") {
  Lone lone;
  auto refused = [&](auto&& speak, const char* what, bool rank0_up = false) {
    CAPTURE(what);
    const double before = authFailures(lone.metrics);
    RawClient c(lone.transport->port());
    REQUIRE(c.connected());
    speak(c);
    CHECK(c.closedByPeer());
    CHECK(waitFor([&] { return authFailures(lone.metrics) >= before + 1; }));
    CHECK(lone.transport->peersUp()[0] == rank0_up);
  };
  auto hello = [](RawClient& c, uint16_t version, uint32_t rank, uint32_t world, uint32_t dst,
                  const char* job) {
    auto n = randomNonce();
    auto p = encodeHello(Hello{world, dst, *n});
    auto h = makeHeader(FrameType::kHello, {}, 0, jobHash(job), rank, p);
    h.version = version;
    c.sendFrame(h, p);
  };
  refused([&](RawClient& c) { hello(c, 2, 0, 2, 1, kJob); }, "version mismatch");
  refused([&](RawClient& c) { hello(c, 1, 0, 2, 1, "other-job"); }, "wrong job");
  refused([&](RawClient& c) { hello(c, 1, 5, 2, 1, kJob); }, "rank out of range");
  refused([&](RawClient& c) { hello(c, 1, 1, 2, 1, kJob); }, "our own rank");
  refused([&](RawClient& c) { hello(c, 1, 0, 3, 1, kJob); }, "world size mismatch");
  refused([&](RawClient& c) { c.handshake(0, 1, 2, kJob, "wrong secret"); }, "wrong secret");
  refused(
      [&](RawClient& c) {
        std::vector<uint8_t> junk(64, 'x');
        c.sendAll(junk);
      },
      "garbage");
  refused(
      [&](RawClient& c) {
        hello(c, 1, 0, 2, 1, kJob); /* then silence */
      },
      "handshake deadline");

  // Duplicate rank: a real rank 0 is connected; a second one is refused.
  RawClient first(lone.transport->port());
  REQUIRE(first.handshake(0, 1, 2));
  REQUIRE(waitFor([&] { return lone.transport->allConnected(); }));
  refused([&](RawClient& c) { c.handshake(0, 1, 2); }, "duplicate rank", true);
  // The first connection still works.
  CHECK(lone.transport->peersUp()[0]);
}

TEST_CASE("tcp transport: a corrupted frame closes the connection and fails receives") {
  Lone lone;
  RawClient c(lone.transport->port());
  REQUIRE(c.handshake(0, 1, 2));
  REQUIRE(waitFor([&] { return lone.transport->allConnected(); }));
  const uint64_t job = jobHash(kJob);
  std::vector<uint8_t> p = pattern(5000, 4);
  REQUIRE(c.sendFrame(makeHeader(FrameType::kData, keyFor(1), 0, job, 0, p), p));
  auto f = lone.transport->receive(0, keyFor(1), Clock::now() + 5s);
  REQUIRE(f.isOk());
  CHECK(f->payload == p);

  auto pending = std::async(std::launch::async, [&] {
    return lone.transport->receive(0, keyFor(2), Clock::now() + 10s);
  });
  auto h = makeHeader(FrameType::kData, keyFor(2), 0, job, 0, p);
  p[100] ^= 1;
  REQUIRE(c.sendFrame(h, p));
  CHECK(c.closedByPeer());
  auto g = pending.get();
  REQUIRE(!g.isOk());
  CHECK(g.status().message().find("rank 0") != std::string::npos);
  CHECK(g.status().message().find("checksum") != std::string::npos);
  CHECK(waitFor([&] { return !lone.transport->peersUp()[0]; }));
}

TEST_CASE("tcp transport: oversized frames and a flooded mailbox close the connection") {
  TcpOptions o = fastOptions();
  o.max_frame_bytes = 1 << 20;
  o.max_kept_frames_per_peer = 4;
  o.max_kept_bytes_per_peer = 2 << 20;
  const uint64_t job = jobHash(kJob);
  {
    Lone lone(o);
    RawClient c(lone.transport->port());
    REQUIRE(c.handshake(0, 1, 2));
    auto h = makeHeader(FrameType::kData, keyFor(1), 0, job, 0, {});
    h.length = uint64_t{1} << 40;  // claims a terabyte, sends nothing
    REQUIRE(c.sendFrame(h, {}));
    CHECK(c.closedByPeer());
    auto f = lone.transport->receive(0, keyFor(1), Clock::now() + 2s);
    REQUIRE(!f.isOk());
    CHECK(f.status().message().find("exceeds the limit") != std::string::npos);
  }
  {
    Lone lone(o);
    RawClient c(lone.transport->port());
    REQUIRE(c.handshake(0, 1, 2));
    std::vector<uint8_t> p(100, 1);
    for (uint64_t step = 0; step < 5; ++step) {
      c.sendFrame(makeHeader(FrameType::kData, keyFor(step + 10), 0, job, 0, p), p);
    }
    CHECK(c.closedByPeer());
    auto f = lone.transport->receive(0, keyFor(99), Clock::now() + 2s);
    REQUIRE(!f.isOk());
    CHECK(f.status().message().find("more than we keep") != std::string::npos);
  }
}

TEST_CASE("tcp transport: a send past its deadline fails instead of hanging") {
  Lone lone;
  RawClient c(lone.transport->port());
  REQUIRE(c.handshake(0, 1, 2));
  REQUIRE(waitFor([&] { return lone.transport->allConnected(); }));
  // The raw peer never reads: 64 MiB cannot be handed to the OS.
  std::vector<uint8_t> big(size_t{64} << 20, 3);
  const auto t0 = Clock::now();
  Status st = lone.transport->send(0, FrameType::kData, keyFor(1), 0, big, t0 + 300ms);
  CHECK(!st.isOk());
  CHECK(st.message().find("rank 0") != std::string::npos);
  CHECK(Clock::now() - t0 < 3s);
}

}  // namespace lightwire::proxy::peer

namespace lightwire::proxy::peer {
namespace {

using namespace lightwire::proxy::peer::testing;  // NOLINT(google-build-using-namespace)

/// Membership through the rendezvous on rank 0's port (no peer list).
Membership rendezvousFor(uint32_t rank, uint32_t world, uint16_t rank0_port,
                         std::string advertise = "") {
  Membership m;
  m.job_id = kJob;
  m.rank = rank;
  m.world_size = world;
  m.secret = kSecret;
  m.rendezvous = "127.0.0.1:" + std::to_string(rank0_port);
  m.advertise = std::move(advertise);
  return m;
}

TEST_CASE("tcp transport: a rendezvous on rank 0 teaches every rank the others' addresses") {
  Mesh mesh(4);
  // Start in reverse order: the higher ranks wait for rank 0, which waits for all of them.
  for (uint32_t r = 4; r-- > 0;) {
    // Rank 3 says where it listens; the others let rank 0 see it.
    const std::string adv = r == 3 ? "127.0.0.1:" + std::to_string(mesh.ports[3]) : "";
    REQUIRE(mesh.transports[r]->start(rendezvousFor(r, 4, mesh.ports[0], adv)).isOk());
  }
  REQUIRE(mesh.allConnected());
  allToAll(mesh, 1 << 14);

  // A restarted rank comes back on another port: rank 0 tells everyone, the lower ranks reach it.
  mesh.transports[2].reset();
  CHECK(waitFor([&] { return !mesh.transports[1]->peersUp()[2]; }));
  auto t = TcpTransport::listen("127.0.0.1", 0, mesh.options, *mesh.metrics[2]);
  REQUIRE(t.isOk());
  mesh.ports[2] = (*t)->port();
  mesh.transports[2] = std::move(*t);
  REQUIRE(mesh.transports[2]->start(rendezvousFor(2, 4, mesh.ports[0])).isOk());
  REQUIRE(mesh.allConnected());
  allToAll(mesh, 1 << 12);
}

TEST_CASE("tcp transport: a rendezvous membership is checked at start") {
  metrics::Metrics metrics;
  auto start = [&](Membership m) {
    auto t = TcpTransport::listen("127.0.0.1", 0, fastOptions(), metrics);
    REQUIRE(t.isOk());
    return (*t)->start(std::move(m));
  };
  Membership both = rendezvousFor(1, 2, 4781);
  both.peers = {"127.0.0.1:1", "127.0.0.1:2"};
  CHECK(start(both).message().find("peer addresses or a rendezvous") != std::string::npos);
  Membership bad = rendezvousFor(1, 2, 4781);
  bad.rendezvous = "no-port";
  CHECK(start(bad).message().find("bad rendezvous address") != std::string::npos);
  Membership bad_adv = rendezvousFor(1, 2, 4781, "host-without-port");
  CHECK(start(bad_adv).message().find("bad advertised address") != std::string::npos);
}

}  // namespace
}  // namespace lightwire::proxy::peer
