#pragma once
// Peers that speak the protocol by hand, for the hostile cases of the conformance suite: a TCP
// client (over TLS after startTls()) and, with UCX, a ucx client; and Lone, one transport whose
// rank 0 is such a client. Also the payloads and keys the transport tests send.

#include <arpa/inet.h>
#include <doctest.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "metrics/metrics.h"
#include "proxy/peer/frame.h"
#include "tests/proxy/peer_mesh.h"
#ifdef LIGHTWIRE_HAVE_UCX
#include <ucp/api/ucp.h>
#endif

namespace lightwire::proxy::peer::testing {

inline std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

inline FrameKey keyFor(uint64_t step, uint32_t chunk = 0, uint32_t origin = 0) {
  FrameKey k;
  k.tensor = 0xabcdefull;
  k.step = step;
  k.chunk = chunk;
  k.origin = origin;
  return k;
}

/// Every rank sends a distinct payload for steps 2 then 1 to every other; every rank then asks
/// for step 1 first (step 2's frames arrived first and must have been kept).
template <typename M>
void allToAll(M& mesh, size_t big_bytes) {
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
  /// Bytes that are no frame header.
  void sendGarbage() {
    std::vector<uint8_t> junk(64, 'x');
    sendAll(junk);
  }
  /// Nothing to do: the kernel keeps the connection (RawUcx progresses its worker here).
  void progressFor(std::chrono::milliseconds /*d*/) {}
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

#ifdef LIGHTWIRE_HAVE_UCX
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

  bool connected() const { return ep_ != nullptr; }
  /// A message whose header is no frame header.
  void sendGarbage() {
    std::vector<uint8_t> junk(10, 'x');
    sendRaw(junk, junk);
  }
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

#endif

/// The raw client type of link L.
template <typename L>
struct RawOf {
  using type = RawClient;
};
#ifdef LIGHTWIRE_HAVE_UCX
template <>
struct RawOf<UcxLink> {
  using type = RawUcx;
};
#endif
template <typename L>
using RawPeer = typename RawOf<L>::type;

/// One transport over link L (rank 1 of `world`) whose rank 0 is played by a RawPeer<L>. Owns it
/// and its metrics; used from the test thread only.
template <typename L>
struct Lone {
  explicit Lone(typename L::Options o = L::options(1), uint32_t world = 2) {
    auto t = L::listen(0, o, metrics);
    REQUIRE(t.isOk());
    transport = std::move(*t);
    std::vector<uint16_t> ports(world, 1);  // rank 0 never listens: it is the raw client
    ports[1] = transport->port();
    REQUIRE(transport->start(membershipFor(1, ports)).isOk());
  }
  metrics::Metrics metrics;
  std::unique_ptr<typename L::TransportType> transport;
};

}  // namespace lightwire::proxy::peer::testing
