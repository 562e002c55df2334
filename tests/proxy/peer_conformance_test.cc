// The conformance suite of the peer transports: every case runs once per link it applies to
// (tcp, tcp with TLS, ucx), as a doctest case of its own named after the link ("tcp transport:
// ...", "tcp transport: TLS: ...", "ucx transport: ..."; tests/meson.build picks the ucx ones by
// that prefix). Real sockets, real UCX on loopback (ports chosen by the OS): mesh set-up in any
// order, all-to-all traffic (a payload of many MB, many small ones, empty ones), deadlines,
// aborts, lost and rejoining peers, job state, posted frames, handshake refusals and hostile
// frames from a raw peer that speaks the protocol itself. Every wait is bounded.

#include <doctest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "metrics/metrics.h"
#include "proxy/peer/frame.h"
#include "tests/proxy/peer_mesh.h"
#include "tests/proxy/raw_peers.h"

namespace lightwire::proxy::peer {
namespace {

using namespace std::chrono_literals;             // NOLINT(google-build-using-namespace)
using namespace lightwire::proxy::peer::testing;  // NOLINT(google-build-using-namespace)

/// Links whose mesh cases reach this size of job and payload.
template <typename L>
std::vector<uint32_t> meshSizes() {
  return {2u, 3u, 5u};
}
template <typename L>
size_t bigPayload() {
  return size_t{64} << 20;
}
#ifdef LIGHTWIRE_HAVE_UCX
template <>
std::vector<uint32_t> meshSizes<UcxLink>() {
  return {2u, 3u};
}
template <>
size_t bigPayload<UcxLink>() {
  return (size_t{12} << 20) + 13;  // 12 MiB: rendezvous
}
#endif

template <typename L>
void connectAndExchange() {
  for (uint32_t n : meshSizes<L>()) {
    CAPTURE(n);
    LinkMesh<L> mesh(n);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    for (auto& t : mesh.transports) {
      for (bool up : t->peersUp()) CHECK(up);
    }
    CHECK(metricValue(*mesh.metrics[0], "lightwire_peer_up{peer=\"1\"}") == 1);
    allToAll(mesh, n == 3 ? bigPayload<L>() : 4096);
    for (auto& m : mesh.metrics) {
      CHECK(metricValue(*m, "lightwire_wire_bytes_total{direction=\"sent\"}") > 0);
      CHECK(metricValue(*m, "lightwire_wire_bytes_total{direction=\"received\"}") > 0);
    }
    CHECK(metricValue(*mesh.metrics[1], "lightwire_wire_bytes_total{direction=\"received\"}") >
          12e6 * (n == 3));
    CHECK(authFailures(*mesh.metrics[0]) == 0);
  }
}

template <typename L>
void anyOrder() {
  LinkMesh<L> mesh(4);
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

template <typename L>
void manySmallFrames() {
  LinkMesh<L> mesh(2);
  for (uint32_t r : {1u, 0u}) {  // the accepting side starts first, then the other
    mesh.start(r);
    std::this_thread::sleep_for(100ms);
  }
  REQUIRE(mesh.allConnected());
  constexpr uint32_t kFrames = 2000;
  auto sender = std::async(std::launch::async, [&] {
    for (uint32_t i = 0; i < kFrames; ++i) {
      auto p = pattern(1 + i % 300, i);
      Status st =
          mesh.transports[1]->send(0, FrameType::kData, keyFor(3, i), 0, p, Clock::now() + 10s);
      if (!st.isOk()) return st;
    }
    return Status::ok();
  });
  int bad = 0;
  for (uint32_t j = 0; j < kFrames; ++j) {
    const uint32_t i = kFrames - 1 - j;  // backwards: everything but the last is kept first
    auto f = mesh.transports[0]->receive(1, keyFor(3, i), Clock::now() + 10s);
    if (!f.isOk() || f->payload != pattern(1 + i % 300, i)) {
      if (!f.isOk()) MESSAGE(f.status().message());
      ++bad;
      break;
    }
  }
  Status sent = sender.get();
  CHECK_MESSAGE(sent.isOk(), sent.message());
  CHECK(bad == 0);
  CHECK(waitFor(
      [&] { return metricValue(*mesh.metrics[0], "lightwire_peer_rtt_seconds{peer=\"1\"}") > 0; }));
  CHECK(waitFor(
      [&] { return metricValue(*mesh.metrics[1], "lightwire_peer_rtt_seconds{peer=\"0\"}") > 0; }));
}

template <typename L>
void receiveDeadline() {
  LinkMesh<L> mesh(2);
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
  // Beyond max_frame_bytes: refused before anything is sent.
  LinkMesh<L> limited(2, [](auto& o) { o.max_frame_bytes = 1000; });
  limited.startAll();
  REQUIRE(limited.allConnected());
  std::vector<uint8_t> big(1001);
  Status st = limited.transports[0]->send(1, FrameType::kData, keyFor(1), 0, big, t0 + 5s);
  CHECK(st.code() == StatusCode::kOutOfRange);
  CHECK(limited.transports[0]->peersUp()[1]);
}

template <typename L>
void abortStep() {
  LinkMesh<L> mesh(3);
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

template <typename L>
void discardDrops() {
  LinkMesh<L> mesh(2);
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

template <typename L>
void floodedMailbox() {
  LinkMesh<L> mesh(2, [](auto& o) {
    o.max_kept_frames_per_peer = 4;
    o.max_kept_bytes_per_peer = 1 << 20;
    o.max_frame_bytes = 1 << 20;
  });
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  std::vector<uint8_t> p(100, 1);
  for (uint64_t step = 0; step < 5; ++step) {
    // The fifth may fail (the connection is being closed): either way, no hang.
    (void)mesh.transports[1]->send(0, FrameType::kData, keyFor(step + 10), 0, p, Clock::now() + 5s);
  }
  auto f = mesh.transports[0]->receive(1, keyFor(99), Clock::now() + 3s);
  REQUIRE(!f.isOk());
  CHECK(f.status().message().find("more than we keep") != std::string::npos);
  CHECK(f.status().message().find("rank 1") != std::string::npos);
  // The lower rank reconnects; the kept frames are still there to be taken (or discarded).
  REQUIRE(mesh.allConnected());
  mesh.transports[0]->discard(0xabcdefull, 100);
  REQUIRE(
      mesh.transports[1]->send(0, FrameType::kData, keyFor(200), 0, p, Clock::now() + 5s).isOk());
  CHECK(mesh.transports[0]->receive(1, keyFor(200), Clock::now() + 5s).isOk());
}

template <typename L>
void destroyedPeerRejoins() {
  LinkMesh<L> mesh(3);
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
  MESSAGE(f.status().message());
  CHECK(f.status().message().find("rank 1") != std::string::npos);
  CHECK(waited < 5s);
  CHECK(waitFor(
      [&] { return !mesh.transports[0]->peersUp()[1] && !mesh.transports[2]->peersUp()[1]; }));
  CHECK(!mesh.transports[0]->allConnected());
  // The gauge follows the session's state from the thread that noticed the loss: wait for it too.
  CHECK(
      waitFor([&] { return metricValue(*mesh.metrics[2], "lightwire_peer_up{peer=\"1\"}") == 0; }));
  // Sending to it fails promptly too.
  std::vector<uint8_t> p = pattern(10, 3);
  CHECK(!mesh.transports[2]->send(1, FrameType::kData, keyFor(9), 0, p, Clock::now() + 5s).isOk());

  // Rejoin on the same address.
  mesh.relisten(1);
  mesh.start(1);
  REQUIRE(mesh.allConnected());
  allToAll(mesh, 1 << 16);
}

template <typename L>
void wrongSecretOrJob() {
  for (const char* what : {"secret", "job"}) {
    CAPTURE(what);
    LinkMesh<L> mesh(2);
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
    CHECK(!mesh.transports[1]->allConnected());
  }
}

template <typename L>
void sendPastDeadline() {
  LinkMesh<L> mesh(2);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  std::vector<uint8_t> big(size_t{64} << 20, 3);
  const auto t0 = Clock::now();
  // A deadline that has already passed: a frame being written cannot be withdrawn, so unless it
  // completes at once the connection is closed; either way send() returns promptly.
  Status st = mesh.transports[0]->send(1, FrameType::kData, keyFor(1), 0, big, t0);
  CHECK(Clock::now() - t0 < 3s);
  if (!st.isOk()) {
    CHECK(st.message().find("rank 1") != std::string::npos);
    // The lower rank reconnects.
    CHECK(mesh.allConnected());
  }
  std::vector<uint8_t> p = pattern(1000, 5);
  REQUIRE(mesh.allConnected());
  REQUIRE(mesh.transports[0]->send(1, FrameType::kData, keyFor(2), 0, p, Clock::now() + 5s).isOk());
  auto f = mesh.transports[1]->receive(0, keyFor(2), Clock::now() + 5s);
  REQUIRE(f.isOk());
  CHECK(f->payload == p);
}

template <typename L>
void postedFrames() {
  LinkMesh<L> mesh(3);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  std::vector<std::vector<uint8_t>> payloads;
  for (uint32_t i = 0; i < 40; ++i) payloads.push_back(pattern(i == 7 ? (3 << 20) : 500 + i, i));
  for (uint32_t i = 0; i < payloads.size(); ++i) {
    REQUIRE(
        mesh.transports[0]
            ->post(1 + i % 2, FrameType::kData, keyFor(4, i), 0, payloads[i], Clock::now() + 10s)
            .isOk());
  }
  Status flushed = mesh.transports[0]->flush(Clock::now() + 10s);
  REQUIRE_MESSAGE(flushed.isOk(), flushed.message());
  for (uint32_t i = 0; i < payloads.size(); ++i) {
    auto f = mesh.transports[1 + i % 2]->receive(0, keyFor(4, i), Clock::now() + 5s);
    REQUIRE(f.isOk());
    CHECK(f->payload == payloads[i]);
    mesh.transports[1 + i % 2]->recycle(std::move(f->payload));
  }
  CHECK(mesh.transports[0]->flush(Clock::now()).isOk());  // nothing posted: nothing to wait for
  // Posting to a rank that is not connected fails at once.
  mesh.transports[2].reset();
  CHECK(waitFor([&] { return !mesh.transports[0]->peersUp()[2]; }));
  CHECK(!mesh.transports[0]
             ->post(2, FrameType::kData, keyFor(5), 0, payloads[0], Clock::now() + 1s)
             .isOk());
  CHECK(mesh.transports[0]->flush(Clock::now() + 1s).isOk());
}

template <typename L>
void jobState() {
  LinkMesh<L> mesh(3);
  std::mutex mu;
  std::vector<std::vector<std::pair<uint32_t, std::string>>> got(3);
  for (uint32_t r = 0; r < 3; ++r) {
    mesh.transports[r]->setJobState(
        [r] {
          std::string s = "state of " + std::to_string(r);
          return std::vector<uint8_t>(s.begin(), s.end());
        },
        [&, r](uint32_t from, std::span<const uint8_t> p) {
          std::lock_guard lock(mu);
          got[r].emplace_back(from, std::string(p.begin(), p.end()));
        });
  }
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  CHECK(waitFor([&] {
    std::lock_guard lock(mu);
    return got[0].size() == 2 && got[1].size() == 2 && got[2].size() == 2;
  }));
  std::lock_guard lock(mu);
  for (uint32_t r = 0; r < 3; ++r) {
    for (const auto& [from, text] : got[r]) {
      CHECK(from != r);
      CHECK(text == "state of " + std::to_string(from));
    }
  }
}

// --- a raw peer as rank 0
// -------------------------------------------------------------------------

template <typename L>
void rawClientsRefused() {
  auto o = L::options(1);
  o.handshake_timeout = 500ms;
  Lone<L> lone(o);
  using Raw = RawPeer<L>;
  auto refused = [&](auto&& speak, const char* what, bool rank0_up = false) {
    CAPTURE(what);
    const double before = authFailures(lone.metrics);
    Raw c(lone.transport->port());
    REQUIRE(c.connected());
    speak(c);
    CHECK(c.closedByPeer());
    CHECK(waitFor([&] { return authFailures(lone.metrics) >= before + 1; }));
    CHECK(lone.transport->peersUp()[0] == rank0_up);
  };
  auto hello = [](Raw& c, uint16_t version, uint32_t rank, uint32_t world, uint32_t dst,
                  const char* job) {
    auto n = randomNonce();
    auto p = encodeHello(Hello{world, dst, *n});
    auto h = makeHeader(FrameType::kHello, {}, 0, jobHash(job), rank, p);
    h.version = version;
    c.sendFrame(h, p);
  };
  refused([&](Raw& c) { hello(c, 2, 0, 2, 1, kJob); }, "version mismatch");
  refused([&](Raw& c) { hello(c, 1, 0, 2, 1, "other-job"); }, "wrong job");
  refused([&](Raw& c) { hello(c, 1, 5, 2, 1, kJob); }, "rank out of range");
  refused([&](Raw& c) { hello(c, 1, 1, 2, 1, kJob); }, "our own rank");
  refused([&](Raw& c) { hello(c, 1, 0, 3, 1, kJob); }, "world size mismatch");
  refused([&](Raw& c) { c.handshake(0, 1, 2, kJob, "wrong secret"); }, "wrong secret");
  refused([&](Raw& c) { c.sendGarbage(); }, "garbage");
  refused(
      [&](Raw& c) {
        std::vector<uint8_t> p(100, 1);
        c.sendFrame(makeHeader(FrameType::kData, keyFor(1), 0, jobHash(kJob), 0, p), p);
      },
      "data before the handshake");
  refused(
      [&](Raw& c) {
        hello(c, 1, 0, 2, 1, kJob); /* then silence */
      },
      "handshake deadline");

  // Duplicate rank: a real rank 0 is connected; a second one is refused.
  Raw first(lone.transport->port());
  REQUIRE(first.handshake(0, 1, 2));
  REQUIRE(waitFor([&] {
    first.progressFor(5ms);
    return lone.transport->allConnected();
  }));
  refused([&](Raw& c) { c.handshake(0, 1, 2); }, "duplicate rank", true);
  // The first connection still works.
  first.progressFor(50ms);
  CHECK(lone.transport->peersUp()[0]);
  // Rendezvous frames in a job without one close the connection.
  std::string addr = ":4781";
  std::vector<uint8_t> reg(addr.begin(), addr.end());
  REQUIRE(first.sendFrame(makeHeader(FrameType::kRegister, {}, 0, jobHash(kJob), 0, reg), reg));
  CHECK(first.closedByPeer());
  CHECK(waitFor([&] { return !lone.transport->peersUp()[0]; }));
}

template <typename L>
void silentPeerLost() {
  auto o = L::options(1);
  o.peer_timeout = 500ms;
  Lone<L> lone(o);
  RawPeer<L> c(lone.transport->port());
  REQUIRE(c.handshake(0, 1, 2));
  c.progressFor(20ms);
  REQUIRE(waitFor([&] { return lone.transport->allConnected(); }));
  // The raw client sends nothing more (and answers no PING): the transport gives up on it.
  const auto t0 = Clock::now();
  auto f = lone.transport->receive(0, keyFor(1), t0 + 5s);
  REQUIRE(!f.isOk());
  CHECK(f.status().message().find("rank 0") != std::string::npos);
  CHECK(f.status().message().find("silent") != std::string::npos);
  CHECK(Clock::now() - t0 < 2s);
  CHECK(!lone.transport->peersUp()[0]);
}

template <typename L>
void corruptedFrame() {
  Lone<L> lone;
  RawPeer<L> c(lone.transport->port());
  REQUIRE(c.handshake(0, 1, 2));
  REQUIRE(waitFor([&] {
    c.progressFor(5ms);
    return lone.transport->allConnected();
  }));
  const uint64_t job = jobHash(kJob);
  std::vector<uint8_t> p = pattern(5000, 4);
  REQUIRE(c.sendFrame(makeHeader(FrameType::kData, keyFor(1), 0, job, 0, p), p));
  c.progressFor(50ms);
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
  if constexpr (L::kCountsRefusedFrames) {
    CHECK(lone.metrics.peerFramesRefused("checksum").Value() == 1);
    CHECK(lone.metrics.peerFramesRefused("header").Value() == 0);
  }
}

template <typename L>
void oversizedFrame() {
  auto o = L::options(1);
  o.max_frame_bytes = 1 << 20;
  Lone<L> lone(o);
  RawPeer<L> c(lone.transport->port());
  REQUIRE(c.handshake(0, 1, 2));
  auto h = makeHeader(FrameType::kData, keyFor(1), 0, jobHash(kJob), 0, {});
  h.length = uint64_t{1} << 40;  // claims a terabyte, sends nothing
  REQUIRE(c.sendFrame(h, {}));
  CHECK(c.closedByPeer());
  auto f = lone.transport->receive(0, keyFor(1), Clock::now() + 2s);
  REQUIRE(!f.isOk());
  CHECK(f.status().message().find("exceeds the limit") != std::string::npos);
  if constexpr (L::kCountsRefusedFrames) {
    CHECK(lone.metrics.peerFramesRefused("header").Value() == 1);
  }
}

}  // namespace

// One doctest case per link: "<link> transport: <what>".
#define LW_CASE_FOR(prefix, what, fn, link) \
  TEST_CASE(prefix what) { fn<link>(); }
#ifdef LIGHTWIRE_HAVE_UCX
#define LW_UCX_CASE(what, fn) LW_CASE_FOR("ucx transport: ", what, fn, UcxLink)
#else
#define LW_UCX_CASE(what, fn)
#endif
// Cases of a mesh of real transports: every link.
#define LW_MESH_CASE(what, fn)                           \
  LW_CASE_FOR("tcp transport: ", what, fn, TcpLink)      \
  LW_CASE_FOR("tcp transport: TLS: ", what, fn, TlsLink) \
  LW_UCX_CASE(what, fn)
// Cases with a raw peer speaking plain frames: the links without TLS.
#define LW_RAW_CASE(what, fn)                       \
  LW_CASE_FOR("tcp transport: ", what, fn, TcpLink) \
  LW_UCX_CASE(what, fn)

LW_MESH_CASE("2, 3 (and 5) ranks connect and exchange all to all", connectAndExchange)
LW_MESH_CASE("peers start in any order, with delays", anyOrder)
LW_MESH_CASE("many small frames, in any order, and pings measure round trips", manySmallFrames)
LW_MESH_CASE("receive deadline names the silent rank; bad arguments are errors", receiveDeadline)
LW_MESH_CASE("abortStep fails the other side's receive at once; discard clears it", abortStep)
LW_MESH_CASE("discard drops kept frames", discardDrops)
LW_MESH_CASE("a flooded mailbox closes the connection and fails receives", floodedMailbox)
LW_MESH_CASE("a destroyed peer fails receives from it; a new one rejoins", destroyedPeerRejoins)
LW_MESH_CASE("a transport with the wrong secret or job is refused and counted", wrongSecretOrJob)
LW_MESH_CASE("a send past its deadline fails instead of hanging", sendPastDeadline)
LW_MESH_CASE("posted frames travel until flush; flush reports and bounds them", postedFrames)
LW_MESH_CASE("each side tells the other its job state once connected", jobState)
LW_RAW_CASE("raw clients speaking wrong things are refused and counted", rawClientsRefused)
LW_RAW_CASE("a peer silent for peer_timeout is lost", silentPeerLost)
LW_RAW_CASE("a corrupted frame closes the connection and fails receives", corruptedFrame)
LW_RAW_CASE("an oversized frame closes the connection", oversizedFrame)

}  // namespace lightwire::proxy::peer
