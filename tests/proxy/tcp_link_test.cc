// The tcp link's own cases (the conformance suite, tests/proxy/peer_conformance_test.cc, runs the
// shared ones): a raw peer that never reads or floods the mailbox, the rendezvous on rank 0, the
// TLS option with a throwaway PKI made at test time (tests/proxy/tls_pki.h), and the cap on
// connections stuck before authenticating. Real loopback sockets; every wait is bounded.

#include <doctest.h>

#include <chrono>
#include <csignal>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "metrics/metrics.h"
#include "proxy/peer/frame.h"
#include "proxy/peer/tcp_transport.h"
#include "tests/proxy/peer_mesh.h"
#include "tests/proxy/raw_peers.h"
#include "tests/proxy/tls_pki.h"
#include "tests/temp_dir.h"

namespace lightwire::proxy::peer {
namespace {

using namespace std::chrono_literals;             // NOLINT(google-build-using-namespace)
using namespace lightwire::proxy::peer::testing;  // NOLINT(google-build-using-namespace)
namespace fs = std::filesystem;

TEST_CASE("tcp transport: a send to a peer that never reads fails at its deadline") {
  Lone<TcpLink> lone;
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

TEST_CASE("tcp transport: a raw peer flooding the mailbox is closed and counted") {
  TcpOptions o = fastOptions();
  o.max_frame_bytes = 1 << 20;
  o.max_kept_frames_per_peer = 4;
  o.max_kept_bytes_per_peer = 2 << 20;
  const uint64_t job = jobHash(kJob);
  {
    Lone<TcpLink> lone(o);
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
  auto t = TcpTransport::listen("127.0.0.1", 0, mesh.options[2], *mesh.metrics[2]);
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

// --- TLS (TcpOptions::tls, docs/peer-protocol.md "TLS") ------------------------------------------

/// SIGPIPE ignored while it lives: the raw client's SSL_write may meet a closed connection.
struct IgnoreSigpipe {
  IgnoreSigpipe() : old(std::signal(SIGPIPE, SIG_IGN)) {}
  ~IgnoreSigpipe() { std::signal(SIGPIPE, old); }
  void (*old)(int);
};

TEST_CASE("tcp transport: TLS: 3 ranks connect over mutual TLS and exchange all to all") {
  Pki pki(3);
  Mesh mesh(0);
  for (uint32_t r = 0; r < 3; ++r) mesh.listenRank(pki.optionsFor(r));
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
    mesh.listenRank(tls_connects ? pki.optionsFor(0) : fastOptions());
    mesh.listenRank(tls_connects ? fastOptions() : pki.optionsFor(1));
    mesh.startAll();
    // The accepting rank refuses every attempt (a plain HELLO is not TLS; a TLS ClientHello is not
    // a frame), and the connecting one keeps trying with backoff.
    CHECK(waitFor([&] { return authFailures(*mesh.metrics[1]) >= 3; }));
    CHECK(!mesh.allConnected(300ms));
    CHECK(!mesh.transports[0]->peersUp()[1]);
    CHECK(!mesh.transports[1]->peersUp()[0]);
  }
  // A raw client speaking the plain protocol with the right secret gets nowhere either.
  Lone<TcpLink> lone(pki.optionsFor(1));
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
      mesh.listenRank(o);
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
    mesh.listenRank(o);
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
  mesh.listenRank(old_pki.optionsFor(0));
  mesh.listenRank(o1);
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
  Lone<TcpLink> lone(o);
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
  Lone<TcpLink> lone(o);
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
