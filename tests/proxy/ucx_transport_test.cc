// UcxTransport over loopback (ports chosen by the OS), with whatever UCX transports UCX_TLS allows
// (tests/meson.build runs these cases with UCX_TLS=tcp and with shared memory): mesh set-up,
// all-to-all traffic (a payload of several MB, many small ones, empty ones), deadlines, aborts,
// lost and rejoining peers, handshake refusals; and the ring collectives over a ucx mesh, whose
// results must equal the tcp transport's bit for bit. Every wait is bounded.

#include <arpa/inet.h>
#include <doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "kernels/codec.h"
#include "kernels/registry.h"
#include "metrics/metrics.h"
#include "proxy/peer/collective.h"
#include "proxy/peer/frame.h"
#include "proxy/peer/tcp_transport.h"
#include "proxy/peer/ucx_transport.h"
#include "tests/proxy/peer_mesh.h"
#include "tests/proxy/ucx_mesh.h"

namespace lightwire::proxy::peer {
namespace {

using namespace std::chrono_literals;             // NOLINT(google-build-using-namespace)
using namespace lightwire::proxy::peer::testing;  // NOLINT(google-build-using-namespace)
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
void allToAll(UcxMesh& mesh, size_t big_bytes) {
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

/// A UCX client that speaks the protocol by hand (docs/peer-protocol.md: every frame is one
/// active message, id 1, sent with UCP_AM_SEND_FLAG_REPLY, header = the 64-byte frame header).
/// Single-threaded: it progresses its own worker while it waits.
class RawUcx {
 public:
  explicit RawUcx(uint16_t port) {
    ucp_config_t* config = nullptr;
    REQUIRE(ucp_config_read(nullptr, nullptr, &config) == UCS_OK);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    REQUIRE(ucp_init(&params, config, &context_) == UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    REQUIRE(ucp_worker_create(context_, &wp, &worker_) == UCS_OK);
    ucp_am_handler_param_t ap{};
    ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    ap.id = 1;
    ap.flags = UCP_AM_FLAG_WHOLE_MSG;
    ap.cb = [](void* arg, const void* header, size_t header_length, void* data, size_t length,
               const ucp_am_recv_param_t* param) -> ucs_status_t {
      if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return UCS_ERR_CANCELED;
      auto* self = static_cast<RawUcx*>(arg);
      const auto* h = static_cast<const uint8_t*>(header);
      const auto* d = static_cast<const uint8_t*>(data);
      self->inbox_.push_back(
          {std::vector<uint8_t>(h, h + header_length), std::vector<uint8_t>(d, d + length)});
      return UCS_OK;
    };
    ap.arg = this;
    REQUIRE(ucp_worker_set_am_recv_handler(worker_, &ap) == UCS_OK);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&a);
    ep.sockaddr.addrlen = sizeof(a);
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t) {
      static_cast<RawUcx*>(arg)->failed_ = true;
    };
    ep.err_handler.arg = this;
    REQUIRE(ucp_ep_create(worker_, &ep, &ep_) == UCS_OK);
  }
  ~RawUcx() {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(ep_, &p);
    const auto end = Clock::now() + 2s;
    while (r != nullptr && !UCS_PTR_IS_ERR(r) && ucp_request_check_status(r) == UCS_INPROGRESS &&
           Clock::now() < end) {
      ucp_worker_progress(worker_);
    }
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }
  RawUcx(const RawUcx&) = delete;
  RawUcx& operator=(const RawUcx&) = delete;

  /// Sends `header_bytes` (normally an encoded header) and `payload`; true once sent.
  bool sendRaw(std::span<const uint8_t> header_bytes, std::span<const uint8_t> payload) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    void* r = ucp_am_send_nbx(ep_, 1, header_bytes.data(), header_bytes.size(), payload.data(),
                              payload.size(), &p);
    if (r == nullptr) return true;
    if (UCS_PTR_IS_ERR(r)) return false;
    const auto end = Clock::now() + 5s;
    while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < end) {
      ucp_worker_progress(worker_);
    }
    const bool ok = ucp_request_check_status(r) == UCS_OK;
    ucp_request_free(r);
    return ok;
  }
  bool sendFrame(const FrameHeader& h, std::span<const uint8_t> payload) {
    auto hb = encodeHeader(h);
    return sendRaw(hb, payload);
  }
  /// Whether the other side closed the endpoint within `timeout` (skipping what it sent).
  bool closedByPeer(std::chrono::milliseconds timeout = 5s) {
    const auto end = Clock::now() + timeout;
    while (!failed_ && Clock::now() < end) ucp_worker_progress(worker_);
    return failed_;
  }
  /// The next frame of `type` received within 5 s: header bytes and payload.
  std::optional<std::pair<std::vector<uint8_t>, std::vector<uint8_t>>> next(FrameType type) {
    const auto end = Clock::now() + 5s;
    while (Clock::now() < end && !failed_) {
      ucp_worker_progress(worker_);
      while (!inbox_.empty()) {
        auto m = std::move(inbox_.front());
        inbox_.erase(inbox_.begin());
        if (m.first.size() == kHeaderBytes && m.first[6] == static_cast<uint8_t>(type)) return m;
      }
    }
    return std::nullopt;
  }
  /// Completes the handshake as `rank` with the server `server` of a world of `world`.
  bool handshake(uint32_t rank, uint32_t server, uint32_t world, std::string job = kJob,
                 std::string secret = kSecret) {
    auto cn = randomNonce();
    auto hello = encodeHello(Hello{world, server, *cn});
    if (!sendFrame(makeHeader(FrameType::kHello, {}, 0, jobHash(job), rank, hello), hello)) {
      return false;
    }
    auto m = next(FrameType::kChallenge);
    if (!m) return false;
    HeaderChecks c{jobHash(job), world, rank, server, kChallengeBytes};
    auto h = decodeHeader(m->first, c, "server");
    if (!h.isOk() || m->second.size() != kChallengeBytes) return false;
    Nonce sn{};
    std::copy_n(m->second.begin(), kNonceBytes, sn.begin());
    auto expect = handshakeMac(MacRole::kServer, secret, job, *cn, sn, rank, server, world);
    if (!macEqual(expect, std::span(m->second).subspan(kNonceBytes))) return false;
    auto auth = handshakeMac(MacRole::kClient, secret, job, *cn, sn, rank, server, world);
    return sendFrame(makeHeader(FrameType::kAuth, {}, 0, jobHash(job), rank, auth), auth);
  }
  /// Keeps the connection alive (answers nothing, but progresses) for `d`.
  void progressFor(std::chrono::milliseconds d) {
    const auto end = Clock::now() + d;
    while (Clock::now() < end) ucp_worker_progress(worker_);
  }

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  bool failed_ = false;
  std::vector<std::pair<std::vector<uint8_t>, std::vector<uint8_t>>> inbox_;
};

/// One transport (rank 1 of 2) whose rank 0 is played by a RawUcx.
struct Lone {
  explicit Lone(UcxOptions o = fastUcxOptions()) {
    auto t = UcxTransport::listen("127.0.0.1", 0, o, metrics);
    REQUIRE(t.isOk());
    transport = std::move(*t);
    std::vector<uint16_t> ports = {1, transport->port()};  // rank 0 never listens
    REQUIRE(transport->start(membershipFor(1, ports)).isOk());
  }
  metrics::Metrics metrics;
  std::unique_ptr<UcxTransport> transport;
};

}  // namespace

TEST_CASE("ucx transport: 2 and 3 ranks connect and exchange all to all") {
  for (uint32_t n : {2u, 3u}) {
    CAPTURE(n);
    UcxMesh mesh(n);
    mesh.startAll();
    REQUIRE(mesh.allConnected());
    for (auto& t : mesh.transports) {
      for (bool up : t->peersUp()) CHECK(up);
    }
    CHECK(metricValue(*mesh.metrics[0], "lightwire_peer_up{peer=\"1\"}") == 1);
    allToAll(mesh, n == 3 ? (size_t{12} << 20) + 13 : 4096);  // 12 MiB: rendezvous
    for (auto& m : mesh.metrics) {
      CHECK(metricValue(*m, "lightwire_wire_bytes_total{direction=\"sent\"}") > 0);
      CHECK(metricValue(*m, "lightwire_wire_bytes_total{direction=\"received\"}") > 0);
    }
    CHECK(metricValue(*mesh.metrics[1], "lightwire_wire_bytes_total{direction=\"received\"}") >
          12e6 * (n == 3));
    CHECK(authFailures(*mesh.metrics[0]) == 0);
  }
}

TEST_CASE("ucx transport: peers start in any order, with delays") {
  UcxMesh mesh(4);
  for (uint32_t r : {3u, 0u, 2u, 1u}) {
    std::this_thread::sleep_for(150ms);
    mesh.start(r);
  }
  REQUIRE(mesh.allConnected());
  for (auto& t : mesh.transports) {
    for (bool up : t->peersUp()) CHECK(up);
  }
  CHECK(metricValue(*mesh.metrics[0], "lightwire_peer_up{peer=\"3\"}") == 1);
  allToAll(mesh, 1 << 20);
}

TEST_CASE("ucx transport: many small frames, in any order, and pings measure round trips") {
  UcxMesh mesh(2);
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

TEST_CASE("ucx transport: receive deadline names the silent rank; bad arguments are errors") {
  UcxMesh mesh(2);
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
  CHECK(!mesh.transports[0]->receive(0, keyFor(5), t0).isOk());
  CHECK(!mesh.transports[0]->receive(7, keyFor(5), t0).isOk());
  std::vector<uint8_t> p(10);
  CHECK(!mesh.transports[0]->send(0, FrameType::kData, keyFor(5), 0, p, t0 + 1s).isOk());
  CHECK(!mesh.transports[0]->send(1, FrameType::kHello, keyFor(5), 0, p, t0 + 1s).isOk());
  // Beyond max_frame_bytes: refused before anything is sent.
  UcxOptions small = fastUcxOptions();
  small.max_frame_bytes = 1000;
  UcxMesh limited(2, small);
  limited.startAll();
  REQUIRE(limited.allConnected());
  std::vector<uint8_t> big(1001);
  Status st = limited.transports[0]->send(1, FrameType::kData, keyFor(1), 0, big, t0 + 5s);
  CHECK(st.code() == StatusCode::kOutOfRange);
  CHECK(limited.transports[0]->peersUp()[1]);
}

TEST_CASE("ucx transport: abortStep fails the other side's receive at once; discard clears it") {
  UcxMesh mesh(3);
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

TEST_CASE("ucx transport: discard drops kept frames") {
  UcxMesh mesh(2);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  std::vector<uint8_t> p = pattern(100, 2);
  for (uint64_t step : {1, 2, 3}) {
    REQUIRE(mesh.transports[1]
                ->send(0, FrameType::kData, keyFor(step), 0, p, Clock::now() + 5s)
                .isOk());
  }
  std::this_thread::sleep_for(200ms);
  mesh.transports[0]->discard(0xabcdefull, 2);
  CHECK(!mesh.transports[0]->receive(1, keyFor(1), Clock::now() + 50ms).isOk());
  CHECK(!mesh.transports[0]->receive(1, keyFor(2), Clock::now() + 50ms).isOk());
  CHECK(mesh.transports[0]->receive(1, keyFor(3), Clock::now() + 2s).isOk());
}

TEST_CASE("ucx transport: a flooded mailbox closes the connection and fails receives") {
  UcxOptions o = fastUcxOptions();
  o.max_kept_frames_per_peer = 4;
  o.max_kept_bytes_per_peer = 1 << 20;
  o.max_frame_bytes = 1 << 20;
  UcxMesh mesh(2, o);
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

TEST_CASE("ucx transport: a destroyed peer fails receives from it; a new one rejoins") {
  UcxMesh mesh(3);
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
  CHECK(metricValue(*mesh.metrics[2], "lightwire_peer_up{peer=\"1\"}") == 0);
  std::vector<uint8_t> p = pattern(10, 3);
  CHECK(!mesh.transports[2]->send(1, FrameType::kData, keyFor(9), 0, p, Clock::now() + 5s).isOk());

  // Rejoin on the same address.
  auto t = UcxTransport::listen("127.0.0.1", mesh.ports[1], mesh.options, *mesh.metrics[1]);
  REQUIRE_MESSAGE(t.isOk(), t.status().message());
  mesh.transports[1] = std::move(*t);
  mesh.start(1);
  REQUIRE(mesh.allConnected());
  allToAll(mesh, 1 << 16);
}

TEST_CASE("ucx transport: a transport with the wrong secret or job is refused and counted") {
  for (const char* what : {"secret", "job"}) {
    CAPTURE(what);
    UcxMesh mesh(2);
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

TEST_CASE("ucx transport: a send past its deadline fails instead of hanging") {
  UcxMesh mesh(2);
  mesh.startAll();
  REQUIRE(mesh.allConnected());
  std::vector<uint8_t> big(size_t{64} << 20, 3);
  const auto t0 = Clock::now();
  // A deadline that has already passed: the frame is handed to UCX and cannot be withdrawn, so
  // unless it completes at once the connection is closed; either way send() returns promptly.
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

TEST_CASE("ucx transport: posted frames travel until flush; flush reports and bounds them") {
  UcxMesh mesh(3);
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

TEST_CASE("ucx transport: each side tells the other its job state once connected") {
  UcxMesh mesh(3);
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

TEST_CASE("ucx transport: raw clients speaking wrong things are refused and counted") {
  UcxOptions o = fastUcxOptions();
  o.handshake_timeout = 500ms;
  Lone lone(o);
  auto refused = [&](auto&& speak, const char* what, bool rank0_up = false) {
    CAPTURE(what);
    const double before = authFailures(lone.metrics);
    RawUcx c(lone.transport->port());
    speak(c);
    CHECK(c.closedByPeer());
    CHECK(waitFor([&] { return authFailures(lone.metrics) >= before + 1; }));
    CHECK(lone.transport->peersUp()[0] == rank0_up);
  };
  auto hello = [](RawUcx& c, uint16_t version, uint32_t rank, uint32_t world, uint32_t dst,
                  const char* job) {
    auto n = randomNonce();
    auto p = encodeHello(Hello{world, dst, *n});
    auto h = makeHeader(FrameType::kHello, {}, 0, jobHash(job), rank, p);
    h.version = version;
    c.sendFrame(h, p);
  };
  refused([&](RawUcx& c) { hello(c, 2, 0, 2, 1, kJob); }, "version mismatch");
  refused([&](RawUcx& c) { hello(c, 1, 0, 2, 1, "other-job"); }, "wrong job");
  refused([&](RawUcx& c) { hello(c, 1, 5, 2, 1, kJob); }, "rank out of range");
  refused([&](RawUcx& c) { hello(c, 1, 1, 2, 1, kJob); }, "our own rank");
  refused([&](RawUcx& c) { hello(c, 1, 0, 3, 1, kJob); }, "world size mismatch");
  refused([&](RawUcx& c) { c.handshake(0, 1, 2, kJob, "wrong secret"); }, "wrong secret");
  refused(
      [&](RawUcx& c) {
        std::vector<uint8_t> junk(10, 'x');
        c.sendRaw(junk, junk);
      },
      "garbage header");
  refused(
      [&](RawUcx& c) {
        std::vector<uint8_t> p(100, 1);
        c.sendFrame(makeHeader(FrameType::kData, keyFor(1), 0, jobHash(kJob), 0, p), p);
      },
      "data before the handshake");
  refused(
      [&](RawUcx& c) {
        hello(c, 1, 0, 2, 1, kJob); /* then silence */
      },
      "handshake deadline");

  // Duplicate rank: a real rank 0 is connected; a second one is refused.
  RawUcx first(lone.transport->port());
  REQUIRE(first.handshake(0, 1, 2));
  REQUIRE(waitFor([&] {
    first.progressFor(5ms);
    return lone.transport->allConnected();
  }));
  refused([&](RawUcx& c) { c.handshake(0, 1, 2); }, "duplicate rank", true);
  first.progressFor(50ms);
  CHECK(lone.transport->peersUp()[0]);
  // Rendezvous frames in a job without one close the connection.
  std::string addr = ":4781";
  std::vector<uint8_t> reg(addr.begin(), addr.end());
  REQUIRE(first.sendFrame(makeHeader(FrameType::kRegister, {}, 0, jobHash(kJob), 0, reg), reg));
  CHECK(first.closedByPeer());
  CHECK(waitFor([&] { return !lone.transport->peersUp()[0]; }));
}

TEST_CASE("ucx transport: endpoints stuck before authenticating are capped at accept") {
  UcxOptions o = fastUcxOptions();
  o.max_pending_handshakes = 3;
  o.handshake_timeout = 5000ms;
  Lone lone(o);
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

TEST_CASE("ucx transport: a peer silent for peer_timeout is lost") {
  UcxOptions o = fastUcxOptions();
  o.peer_timeout = 500ms;
  Lone lone(o);
  RawUcx c(lone.transport->port());
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

TEST_CASE("ucx transport: a corrupted frame closes the connection and fails receives") {
  Lone lone;
  RawUcx c(lone.transport->port());
  REQUIRE(c.handshake(0, 1, 2));
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
}

TEST_CASE("ucx transport: oversized or inconsistent frames close the connection") {
  UcxOptions o = fastUcxOptions();
  o.max_frame_bytes = 1 << 20;
  const uint64_t job = jobHash(kJob);
  {
    Lone lone(o);
    RawUcx c(lone.transport->port());
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

namespace {

std::vector<float> tensorOf(uint32_t rank, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = static_cast<float>((rank + 1) * 0.37) + static_cast<float>(i % 97) * 0.013f -
           static_cast<float>(rank) * 0.5f;
  }
  return v;
}

/// One exchange round of `codec` on every rank of `transports` (threads); each rank's decoded
/// result with weight 1/W.
std::vector<std::vector<float>> exchangeAll(const std::vector<Transport*>& transports,
                                            const kernels::Codec& codec, size_t n, size_t chunk) {
  const uint32_t w = static_cast<uint32_t>(transports.size());
  const kernels::Chunking chunking = kernels::chunkingFor(codec, n, chunk);
  std::vector<std::future<std::vector<float>>> futures;
  for (uint32_t r = 0; r < w; ++r) {
    futures.push_back(std::async(std::launch::async, [&, r] {
      RingExchange ring(*transports[r], std::chrono::milliseconds(5000));
      const auto x = tensorOf(r, n);
      kernels::CodecState state(codec.stateFloats(n));
      kernels::StepContext ctx;
      ctx.rank = r;
      ctx.step = 1;
      auto payloads =
          kernels::encodeTensor(codec, ctx, chunking, kernels::ConstTensor{x.data(), n}, state);
      REQUIRE(payloads.isOk());
      std::vector<std::span<const uint8_t>> mine(payloads->begin(), payloads->end());
      const std::string name = "t";
      ExchangeRound round{name, 1, 0, codec, chunking, mine};
      auto got = ring.run(round);
      REQUIRE_MESSAGE(got.isOk(), got.status().message());
      auto none = kernels::createCodec({.name = "none"});
      const kernels::Codec& decoder = round.dense ? **none : codec;
      std::vector<float> out(n, 0.0f);
      for (size_t c = 0; c < got->size(); ++c) {
        for (auto p : (*got)[c]) {
          REQUIRE(decoder
                      .decodeChunk(p, 1.0f / static_cast<float>(w), out.data() + chunking.begin(c),
                                   chunking.size(c))
                      .isOk());
        }
      }
      ring.stepDone(name, 1);
      return out;
    }));
  }
  std::vector<std::vector<float>> results;
  for (auto& f : futures) results.push_back(f.get());
  return results;
}

/// The ring over ucx and over tcp: every rank's result is bitwise the same, on both transports.
void ringMatchesTcp(const kernels::CodecConfig& config, size_t n, size_t chunk) {
  auto codec = kernels::createCodec(config);
  REQUIRE(codec.isOk());
  UcxMesh ucx(3);
  ucx.startAll();
  REQUIRE(ucx.allConnected());
  std::vector<Transport*> ucx_ts;
  for (auto& t : ucx.transports) ucx_ts.push_back(t.get());
  const auto over_ucx = exchangeAll(ucx_ts, **codec, n, chunk);

  Mesh tcp(3);
  tcp.startAll();
  REQUIRE(tcp.allConnected());
  std::vector<Transport*> tcp_ts;
  for (auto& t : tcp.transports) tcp_ts.push_back(t.get());
  const auto over_tcp = exchangeAll(tcp_ts, **codec, n, chunk);

  for (uint32_t r = 0; r < 3; ++r) {
    CAPTURE(r);
    REQUIRE(over_ucx[r].size() == n);
    CHECK(std::memcmp(over_ucx[r].data(), over_ucx[0].data(), n * sizeof(float)) == 0);
    CHECK(std::memcmp(over_ucx[r].data(), over_tcp[r].data(), n * sizeof(float)) == 0);
  }
}

}  // namespace

TEST_CASE("ucx ring: allreduce of codec none at W=3 is identical on every rank and equals tcp") {
  ringMatchesTcp({.name = "none"}, 100000, 8192);
}

TEST_CASE("ucx ring: allgather of topk at W=3 is identical on every rank and equals tcp") {
  ringMatchesTcp({.name = "topk", .density = 0.1, .error_feedback = false}, 50000, 4096);
}

}  // namespace lightwire::proxy::peer
