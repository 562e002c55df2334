// TcpTransport over real loopback sockets (ports chosen by the OS): mesh set-up in any order,
// all-to-all traffic, deadlines, aborts, lost and rejoining peers, handshake refusals, and hostile
// frames from a raw client that speaks the protocol itself (also over TLS), and the TLS option
// with a throwaway PKI made at test time. Every wait is bounded.

#include <arpa/inet.h>
#include <doctest.h>
#include <netinet/in.h>
#include <openssl/ec.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include "metrics/metrics.h"
#include "proxy/peer/frame.h"
#include "proxy/peer/tcp_transport.h"
#include "tests/proxy/peer_mesh.h"
#include "tests/temp_dir.h"

namespace lightwire::proxy::peer {
namespace {

using namespace std::chrono_literals;
using namespace lightwire::proxy::peer::testing;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

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

/// A client that speaks the protocol by hand, over TLS after startTls().
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
  ~RawClient() {
    SSL_free(ssl_);
    SSL_CTX_free(ctx_);
    ::close(fd_);
  }
  bool connected() const { return connected_; }
  /// A TLS handshake as a client presenting cert/key (none if empty) and verifying the server
  /// against ca (not at all if empty); everything after goes through TLS. Whether it succeeded.
  bool startTls(const std::string& cert, const std::string& key, const std::string& ca) {
    ctx_ = SSL_CTX_new(TLS_client_method());
    if (!cert.empty() && (SSL_CTX_use_certificate_chain_file(ctx_, cert.c_str()) != 1 ||
                          SSL_CTX_use_PrivateKey_file(ctx_, key.c_str(), SSL_FILETYPE_PEM) != 1)) {
      return false;
    }
    if (!ca.empty() && SSL_CTX_load_verify_locations(ctx_, ca.c_str(), nullptr) != 1) return false;
    SSL_CTX_set_verify(ctx_, ca.empty() ? SSL_VERIFY_NONE : SSL_VERIFY_PEER, nullptr);
    ssl_ = SSL_new(ctx_);
    SSL_set_fd(ssl_, fd_);
    return SSL_connect(ssl_) == 1;
  }
  bool sendAll(std::span<const uint8_t> b) {
    size_t off = 0;
    while (off < b.size()) {
      ssize_t n = ssl_ ? SSL_write(ssl_, b.data() + off, static_cast<int>(b.size() - off))
                       : ::send(fd_, b.data() + off, b.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }
  bool sendFrame(const FrameHeader& h, std::span<const uint8_t> payload) {
    auto hb = encodeHeader(h);
    return sendAll(hb) && sendAll(payload);
  }
  /// One read: > 0 bytes, 0 at the end of the stream (an EOF, a reset, a TLS alert), < 0 when
  /// the receive timeout passed.
  ssize_t recvSome(uint8_t* p, size_t n) {
    if (!ssl_) {
      ssize_t k = ::recv(fd_, p, n, 0);
      return k < 0 && errno == ECONNRESET ? 0 : k;
    }
    const int k = SSL_read(ssl_, p, static_cast<int>(n));
    if (k > 0) return k;
    return SSL_get_error(ssl_, k) == SSL_ERROR_WANT_READ ? -1 : 0;
  }
  bool recvAll(uint8_t* p, size_t n) {
    size_t off = 0;
    while (off < n) {
      ssize_t k = recvSome(p + off, n - off);
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
      ssize_t k = recvSome(buf, sizeof(buf));
      if (k <= 0) return k == 0;  // < 0: timed out, still open
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
  SSL_CTX* ctx_ = nullptr;
  SSL* ssl_ = nullptr;
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
  CHECK(lone.metrics.peerFramesRefused("checksum").Value() == 1);
  CHECK(lone.metrics.peerFramesRefused("header").Value() == 0);
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
    CHECK(lone.metrics.peerFramesRefused("header").Value() == 1);
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
    CHECK(lone.metrics.peerFramesRefused("queue").Value() == 1);
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

// --- TLS (TcpOptions::tls, docs/peer-protocol.md "TLS") ------------------------------------------

namespace lightwire::proxy::peer {
namespace {

using namespace lightwire::proxy::peer::testing;  // NOLINT(google-build-using-namespace)
using lightwire::testing::TempDir;

using PkeyPtr = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;
using X509Ptr = std::unique_ptr<X509, decltype(&X509_free)>;

void addExtension(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  REQUIRE(ext != nullptr);
  X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
}

/// A certificate for `key` named `cn`, valid from an hour ago for a day: a CA's own when issuer is
/// null, else a node's (TLS client and server) signed by issuer / issuer_key.
X509Ptr makeCert(EVP_PKEY* key, const std::string& cn, X509* issuer, EVP_PKEY* issuer_key) {
  static std::atomic<long> serial{1};
  X509Ptr x(X509_new(), X509_free);
  X509_set_version(x.get(), 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x.get()), serial++);
  X509_gmtime_adj(X509_getm_notBefore(x.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(x.get()), 86400);
  X509_set_pubkey(x.get(), key);
  X509_NAME_add_entry_by_txt(X509_get_subject_name(x.get()), "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
  X509* signer = issuer ? issuer : x.get();
  X509_set_issuer_name(x.get(), X509_get_subject_name(signer));
  if (!issuer) {
    addExtension(x.get(), signer, NID_basic_constraints, "critical,CA:TRUE");
    addExtension(x.get(), signer, NID_key_usage, "critical,keyCertSign,cRLSign");
  } else {
    addExtension(x.get(), signer, NID_basic_constraints, "critical,CA:FALSE");
    addExtension(x.get(), signer, NID_key_usage, "critical,digitalSignature");
    addExtension(x.get(), signer, NID_ext_key_usage, "serverAuth,clientAuth");
  }
  REQUIRE(X509_sign(x.get(), issuer_key ? issuer_key : key, EVP_sha256()) > 0);
  return x;
}

template <typename Write>
void writePem(const std::string& path, Write write) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  REQUIRE(f != nullptr);
  CHECK(write(f) == 1);
  std::fclose(f);
}

/// A throwaway PKI made at test time in a temporary directory: a CA (EC P-256) and a
/// certificate and key per rank signed by it.
struct Pki {
  explicit Pki(uint32_t ranks, const std::string& name = "ca") {
    PkeyPtr ca_key(EVP_EC_gen("P-256"), EVP_PKEY_free);
    REQUIRE(ca_key);
    X509Ptr ca = makeCert(ca_key.get(), "lightwire test " + name, nullptr, nullptr);
    ca_file = dir.path() + "/" + name + ".pem";
    writePem(ca_file, [&](std::FILE* f) { return PEM_write_X509(f, ca.get()); });
    for (uint32_t r = 0; r < ranks; ++r) {
      PkeyPtr key(EVP_EC_gen("P-256"), EVP_PKEY_free);
      REQUIRE(key);
      X509Ptr cert =
          makeCert(key.get(), name + " node " + std::to_string(r), ca.get(), ca_key.get());
      cert_files.push_back(dir.path() + "/node" + std::to_string(r) + ".pem");
      key_files.push_back(dir.path() + "/node" + std::to_string(r) + ".key");
      writePem(cert_files.back(), [&](std::FILE* f) { return PEM_write_X509(f, cert.get()); });
      writePem(key_files.back(), [&](std::FILE* f) {
        return PEM_write_PrivateKey(f, key.get(), nullptr, nullptr, 0, nullptr, nullptr);
      });
    }
  }
  /// fastOptions() with TLS on as rank r.
  TcpOptions optionsFor(uint32_t r) const {
    TcpOptions o = fastOptions();
    o.tls = {
        .enabled = true, .cert_file = cert_files[r], .key_file = key_files[r], .ca_file = ca_file};
    return o;
  }
  TempDir dir;
  std::string ca_file;
  std::vector<std::string> cert_files, key_files;
};

/// Adds a rank listening with `o` to `mesh` (made with no ranks).
void listenRank(Mesh& mesh, const TcpOptions& o) {
  mesh.metrics.push_back(std::make_unique<metrics::Metrics>());
  auto t = TcpTransport::listen("127.0.0.1", 0, o, *mesh.metrics.back());
  REQUIRE_MESSAGE(t.isOk(), t.status().message());
  mesh.ports.push_back((*t)->port());
  mesh.transports.push_back(std::move(*t));
}

/// SIGPIPE ignored while it lives: the raw client's SSL_write may meet a closed connection.
struct IgnoreSigpipe {
  IgnoreSigpipe() : old(std::signal(SIGPIPE, SIG_IGN)) {}
  ~IgnoreSigpipe() { std::signal(SIGPIPE, old); }
  void (*old)(int);
};

TEST_CASE("tcp transport: TLS: 3 ranks connect over mutual TLS and exchange all to all") {
  Pki pki(3);
  Mesh mesh(0);
  for (uint32_t r = 0; r < 3; ++r) listenRank(mesh, pki.optionsFor(r));
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  allToAll(mesh, size_t{16} << 20);
  for (auto& m : mesh.metrics) {
    CHECK(authFailures(*m) == 0);
    CHECK(metricValue(*m, "lightwire_wire_bytes_total{direction=\"received\"}") > 0);
  }
  // Pings and pongs travel too.
  CHECK(waitFor(
      [&] { return metricValue(*mesh.metrics[0], "lightwire_peer_rtt_seconds{peer=\"2\"}") > 0; }));
}

TEST_CASE("tcp transport: TLS: a TLS rank and a plain rank never connect; refusals are counted") {
  Pki pki(2);
  for (const bool tls_connects : {false, true}) {
    CAPTURE(tls_connects);
    Mesh mesh(0);  // rank 0 connects to rank 1
    listenRank(mesh, tls_connects ? pki.optionsFor(0) : fastOptions());
    listenRank(mesh, tls_connects ? fastOptions() : pki.optionsFor(1));
    mesh.startAll();
    // The accepting rank refuses every attempt (a plain HELLO is not TLS; a TLS ClientHello is not
    // a frame), and the connecting one keeps trying with backoff.
    CHECK(waitFor([&] { return authFailures(*mesh.metrics[1]) >= 3; }));
    CHECK(!mesh.allConnected(300ms));
    CHECK(!mesh.transports[0]->peersUp()[1]);
    CHECK(!mesh.transports[1]->peersUp()[0]);
  }
  // A raw client speaking the plain protocol with the right secret gets nowhere either.
  Lone lone(pki.optionsFor(1));
  RawClient c(lone.transport->port());
  REQUIRE(c.connected());
  CHECK(!c.handshake(0, 1, 2));
  CHECK(c.closedByPeer());
  CHECK(waitFor([&] { return authFailures(lone.metrics) >= 1; }));
  CHECK(!lone.transport->peersUp()[0]);
}

TEST_CASE("tcp transport: TLS: a certificate signed by another CA is refused and counted") {
  Pki pki(2);
  Pki other(2, "other-ca");
  for (const uint32_t foreign : {0u, 1u}) {  // the connecting rank's, then the accepting rank's
    CAPTURE(foreign);
    Mesh mesh(0);
    for (uint32_t r = 0; r < 2; ++r) {
      TcpOptions o = pki.optionsFor(r);
      if (r == foreign) {
        o.tls.cert_file = other.cert_files[r];
        o.tls.key_file = other.key_files[r];
      }
      listenRank(mesh, o);
    }
    mesh.startAll();
    // Both sides count: the one that verifies the foreign certificate, and the other from its
    // TLS alert.
    CHECK(waitFor([&] { return authFailures(*mesh.metrics[0]) >= 2; }));
    CHECK(waitFor([&] { return authFailures(*mesh.metrics[1]) >= 2; }));
    CHECK(!mesh.transports[0]->peersUp()[1]);
    CHECK(!mesh.transports[1]->peersUp()[0]);
  }
  // peer.tls.verify false on both sides: the same certificates connect (encryption only; the job
  // secret still authenticates), without a CA file on the side that has none to give.
  Mesh mesh(0);
  for (uint32_t r = 0; r < 2; ++r) {
    TcpOptions o = pki.optionsFor(r);
    o.tls.verify_peer = false;
    if (r == 1) {
      o.tls.cert_file = other.cert_files[r];
      o.tls.key_file = other.key_files[r];
      o.tls.ca_file.clear();
    }
    listenRank(mesh, o);
  }
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  allToAll(mesh, 1 << 16);
}

TEST_CASE("tcp transport: TLS: reloadTls takes renewed files for new connections") {
  Pki old_pki(2), new_pki(2, "renewed");
  // Rank 1's files live where it was told to find them; renewing overwrites them.
  TempDir mine;
  TcpOptions o1 = old_pki.optionsFor(1);
  auto copy = [](const std::string& from, const std::string& to) {
    fs::copy_file(from, to, fs::copy_options::overwrite_existing);
  };
  o1.tls.cert_file = mine.path() + "/node.pem";
  o1.tls.key_file = mine.path() + "/node.key";
  o1.tls.ca_file = mine.path() + "/ca.pem";
  auto install = [&](const Pki& p) {
    copy(p.cert_files[1], o1.tls.cert_file);
    copy(p.key_files[1], o1.tls.key_file);
    copy(p.ca_file, o1.tls.ca_file);
  };
  install(old_pki);
  Mesh mesh(0);  // rank 0 connects to rank 1
  listenRank(mesh, old_pki.optionsFor(0));
  listenRank(mesh, o1);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  const auto now = static_cast<double>(std::time(nullptr));
  const double expiry =
      metricValue(*mesh.metrics[1], "lightwire_peer_tls_certificate_expiry_timestamp_seconds");
  CHECK(expiry > now + 3600);  // Pki's certificates are valid for a day
  CHECK(expiry < now + 2 * 86400);
  // A fresh rank 0 in place of the old one, with `p`'s files.
  auto replaceRank0 = [&](const Pki& p) {
    mesh.transports[0].reset();
    mesh.metrics[0] = std::make_unique<metrics::Metrics>();
    auto t = TcpTransport::listen("127.0.0.1", 0, p.optionsFor(0), *mesh.metrics[0]);
    REQUIRE(t.isOk());
    mesh.transports[0] = std::move(*t);
    mesh.start(0);
  };

  // Renewed files (another CA, to tell them apart): the connection that is up stays up ...
  install(new_pki);
  auto reloaded = mesh.transports[1]->reloadTls();
  REQUIRE_MESSAGE(reloaded.isOk(), reloaded.status().message());
  CHECK(reloaded->find("renewed node 1") != std::string::npos);
  CHECK(reloaded->find("valid until 20") != std::string::npos);
  const auto in_force = mesh.transports[1]->tlsCertificate();
  REQUIRE(in_force);
  CHECK(in_force->subject == "/CN=renewed node 1");
  CHECK(in_force->file == o1.tls.cert_file);
  CHECK(in_force->not_after > static_cast<int64_t>(now));
  CHECK(reloaded->find(in_force->not_after_utc) != std::string::npos);
  CHECK(mesh.transports[1]->peersUp()[0]);
  // ... and new connections use the new files: a rank 0 of the old CA is refused, ...
  const double refused = authFailures(*mesh.metrics[1]);
  replaceRank0(old_pki);
  CHECK(waitFor([&] { return authFailures(*mesh.metrics[1]) >= refused + 2; }));
  CHECK(!mesh.transports[1]->peersUp()[0]);
  // ... one of the new CA connects.
  replaceRank0(new_pki);
  REQUIRE(mesh.allConnected());
  allToAll(mesh, 1 << 16);

  // A broken renewal is an error naming the file; the files loaded before stay in use.
  { std::ofstream(o1.tls.key_file) << "-----BEGIN PRIVATE KEY-----\nnot a key\n"; }
  auto broken = mesh.transports[1]->reloadTls();
  REQUIRE_FALSE(broken.isOk());
  CHECK(broken.status().message().find("peer.tls.key_file " + o1.tls.key_file) !=
        std::string::npos);
  replaceRank0(new_pki);
  REQUIRE(mesh.allConnected());
  // Without TLS there is nothing to reload.
  Mesh plain(2);
  auto none = plain.transports[0]->reloadTls();
  REQUIRE_FALSE(none.isOk());
  CHECK(none.status().message() == "peer.tls is off: no certificate to reload");
  CHECK_FALSE(plain.transports[0]->tlsCertificate());
}

TEST_CASE(
    "tcp transport: TLS: missing or bad certificate, key or CA files are errors of listen()") {
  Pki pki(2);
  metrics::Metrics metrics;
  const TcpOptions::Tls good = pki.optionsFor(0).tls;
  auto listenWith = [&](auto change) -> std::string {
    TcpOptions o = fastOptions();
    o.tls = good;
    change(o.tls);
    auto t = TcpTransport::listen("127.0.0.1", 0, o, metrics);
    return t.isOk() ? "ok" : t.status().message();
  };
  const std::string missing = pki.dir.path() + "/missing.pem";
  const std::string garbage = pki.dir.write("garbage.pem", "SECRET-KEY-MATERIAL, not PEM\n");
  CHECK(listenWith([](auto&) {}) == "ok");
  CHECK(listenWith([&](auto& t) { t.cert_file = missing; }) ==
        "peer.tls.cert_file " + missing + ": No such file or directory");
  CHECK(listenWith([&](auto& t) { t.key_file = missing; }) ==
        "peer.tls.key_file " + missing + ": No such file or directory");
  CHECK(listenWith([&](auto& t) { t.ca_file = missing; }) ==
        "peer.tls.ca_file " + missing + ": No such file or directory");
  CHECK(listenWith([&](auto& t) { t.cert_file.clear(); }) ==
        "peer.tls.cert_file is not set (peer.tls is on)");
  using Tls = TcpOptions::Tls;
  const std::pair<std::string, std::string Tls::*> files[] = {
      {"peer.tls.cert_file", &Tls::cert_file},
      {"peer.tls.key_file", &Tls::key_file},
      {"peer.tls.ca_file", &Tls::ca_file},
  };
  for (const auto& entry : files) {  // no structured binding: clang 14 cannot capture those
    const std::string& key = entry.first;
    const auto field = entry.second;
    CAPTURE(key);
    const std::string e = listenWith([&](Tls& t) { t.*field = garbage; });
    CHECK(e.rfind(key + " " + garbage + ": ", 0) == 0);
    CHECK(e.size() > key.size() + garbage.size() + 3);          // OpenSSL's reason
    CHECK(e.find("SECRET-KEY-MATERIAL") == std::string::npos);  // never a file's contents
  }
  // An encrypted key is refused, never prompted for.
  PkeyPtr key(EVP_EC_gen("P-256"), EVP_PKEY_free);
  const std::string encrypted = pki.dir.path() + "/encrypted.key";
  writePem(encrypted, [&](std::FILE* f) {
    return PEM_write_PrivateKey(f, key.get(), EVP_aes_256_cbc(),
                                reinterpret_cast<const unsigned char*>("passphrase"), 10, nullptr,
                                nullptr);
  });
  const std::string refused = listenWith([&](auto& t) { t.key_file = encrypted; });
  CAPTURE(refused);
  CHECK(refused.find("(an unencrypted PEM private key is needed)") != std::string::npos);
  CHECK(listenWith([&](auto& t) { t.key_file = pki.key_files[1]; }) ==
        "peer.tls.key_file " + pki.key_files[1] + ": key does not match certificate " +
            "peer.tls.cert_file " + good.cert_file);
  CHECK(listenWith([](auto& t) {
          t.verify_peer = false;
          t.ca_file.clear();
        }) == "ok");
}

TEST_CASE(
    "tcp transport: TLS: clients stalling or babbling in or after the TLS handshake are "
    "dropped within handshake_timeout") {
  IgnoreSigpipe ignore_sigpipe;
  Pki pki(2);
  Pki other(1, "other-ca");
  TcpOptions o = pki.optionsFor(1);
  o.handshake_timeout = 500ms;
  Lone lone(o);
  auto tls = [&](RawClient& c) {
    return c.startTls(pki.cert_files[0], pki.key_files[0], pki.ca_file);
  };
  auto refused = [&](auto&& speak, const char* what, bool stalls) {
    CAPTURE(what);
    const double before = authFailures(lone.metrics);
    RawClient c(lone.transport->port());
    REQUIRE(c.connected());
    const auto t0 = Clock::now();
    speak(c);
    CHECK(c.closedByPeer());
    const auto waited = Clock::now() - t0;
    CHECK(waited < 2500ms);  // the client's own receive timeout is 5 s
    if (stalls) CHECK(waited >= 400ms);
    CHECK(waitFor([&] { return authFailures(lone.metrics) >= before + 1; }));
    CHECK(!lone.transport->peersUp()[0]);
  };
  const std::vector<uint8_t> record_start = {0x16, 0x03, 0x01, 0x02, 0x00};  // 512 bytes to come
  const std::vector<uint8_t> junk(200, 'x');
  refused([&](RawClient& c) { c.sendAll(record_start); }, "stalls in the TLS handshake", true);
  refused([&](RawClient& c) { c.sendAll(junk); }, "garbage instead of TLS", false);
  refused([&](RawClient& c) { REQUIRE(tls(c)); }, "TLS, then silence", true);
  refused(
      [&](RawClient& c) {
        REQUIRE(tls(c));
        c.sendAll(junk);
      },
      "TLS, then garbage", false);
  refused(
      [&](RawClient& c) {
        REQUIRE(tls(c));
        c.handshake(0, 1, 2, kJob, "wrong secret");
      },
      "TLS, then the wrong secret", false);
  // TLS 1.3: the client learns of the refusal after its handshake; ignore the outcome.
  refused([&](RawClient& c) { c.startTls("", "", ""); }, "no client certificate", false);
  refused([&](RawClient& c) { c.startTls(other.cert_files[0], other.key_files[0], ""); },
          "a certificate of another CA", false);

  // The right certificate and secret: connected, and frames flow both ways.
  RawClient c(lone.transport->port());
  REQUIRE(tls(c));
  REQUIRE(c.handshake(0, 1, 2));
  REQUIRE(waitFor([&] { return lone.transport->allConnected(); }));
  std::vector<uint8_t> p = pattern(70000, 5);
  REQUIRE(c.sendFrame(makeHeader(FrameType::kData, keyFor(1), 0, jobHash(kJob), 0, p), p));
  auto f = lone.transport->receive(0, keyFor(1), Clock::now() + 5s);
  REQUIRE(f.isOk());
  CHECK(f->payload == p);
}

TEST_CASE("tcp transport: connections stuck before authenticating are capped at accept") {
  TcpOptions o = fastOptions();
  o.max_pending_handshakes = 4;
  o.handshake_timeout = 3000ms;
  Lone lone(o);
  auto hits = [&] { return lone.metrics.limitHits("peer_handshakes").Value(); };
  // Four connections that say nothing hold every handshake place ...
  std::vector<std::unique_ptr<RawClient>> idle;
  for (int i = 0; i < 4; ++i) {
    idle.push_back(std::make_unique<RawClient>(lone.transport->port()));
    REQUIRE(idle.back()->connected());
  }
  // ... so a fifth is closed at once, long before the handshake deadline, and counted.
  const auto t0 = Clock::now();
  RawClient extra(lone.transport->port());
  CHECK(extra.closedByPeer());
  CHECK(Clock::now() - t0 < 1500ms);
  CHECK(waitFor([&] { return hits() >= 1; }));
  // Once they are gone, a real rank connects.
  idle.clear();
  std::unique_ptr<RawClient> good;
  bool ok = false;
  // The server may not have seen the idle ones close yet: a refused attempt is retried.
  for (int attempt = 0; attempt < 50 && !ok; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(20ms);
    good = std::make_unique<RawClient>(lone.transport->port());
    ok = good->handshake(0, 1, 2);
  }
  REQUIRE(ok);
  CHECK(waitFor([&] { return lone.transport->allConnected(); }));
}

}  // namespace
}  // namespace lightwire::proxy::peer
