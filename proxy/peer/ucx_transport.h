#pragma once
// The `ucx` transport (docs/peer-protocol.md "The `ucx` transport"): a full mesh of
// UCX ucp endpoints, one per pair of ranks (the lower rank connects), created through UCX's
// connection manager (ucp_listener_create / ucp_ep_create with a socket address), authenticated
// with the same HELLO / CHALLENGE / AUTH handshake as the `tcp` transport, reconnected with
// backoff. UCX picks the wire per pair among what UCX_TLS allows: RDMA verbs where the hardware
// has them, TCP elsewhere (UCX 1.13 uses no shared memory for endpoints made this way).
//
// Messaging: ucp active messages (ucp_am_send_nbx). Every frame is one active message whose
// user header is the 64-byte frame header and whose data is the payload; large payloads arrive
// by rendezvous (UCP_AM_RECV_ATTR_FLAG_RNDV: the receiver checks the header and reserves its
// budget, then allocates and fetches the payload with ucp_am_recv_data_nbx). Messages are sent
// with UCP_AM_SEND_FLAG_REPLY so the receiver knows the endpoint (hence the peer) of each one.
//
// Threading: the UCX context and worker are created with UCS_THREAD_MODE_SINGLE and belong to
// one progress thread (started by start()); no other thread calls into UCX meanwhile (listen()
// and the destructor do, before the thread starts and after it has been joined). Other threads
// hand it work through a queue and wake it with an eventfd; it sleeps in epoll on that eventfd
// and the worker's event fd (UCP_FEATURE_WAKEUP, ucp_worker_arm) between timers. Callers wait
// for results on a condition variable, as with TcpTransport.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/status.h"
#include "proxy/peer/frame.h"
#include "proxy/peer/session.h"
#include "proxy/peer/transport.h"

namespace lightwire::metrics {
class Metrics;
}

namespace lightwire::proxy::peer {

/// Settings of a UcxTransport; the same meanings and defaults as TcpOptions. Plain value.
struct UcxOptions {
  std::chrono::milliseconds connect_timeout{2000};    // one connection attempt (until HELLO is out)
  std::chrono::milliseconds handshake_timeout{5000};  // HELLO .. AUTH, either side
  std::chrono::milliseconds backoff_initial{50};      // between connect attempts, doubling ...
  std::chrono::milliseconds backoff_max{2000};        // ... up to this
  std::chrono::milliseconds ping_interval{1000};
  std::chrono::milliseconds peer_timeout{10000};     // nothing received for this long: peer lost
  uint64_t max_frame_bytes = kDefaultMaxFrameBytes;  // payload bytes of one frame
  // Received frames not yet asked for, per peer; beyond either bound the connection is closed.
  uint64_t max_kept_bytes_per_peer = uint64_t{4} << 30;
  uint64_t max_kept_frames_per_peer = 65536;
  // Accepted endpoints still in their handshake at once; beyond it a connection request is
  // rejected (ucp_listener_reject) and counted in lightwire_limit_hits_total{limit=
  // "peer_handshakes"}, as TcpOptions::max_pending_handshakes does at accept.
  size_t max_pending_handshakes = 64;
};

/// Transport over UCX with its own progress thread: the ucx links (endpoints) of a PeerSession,
/// set up by UCX's connection manager and reconnected with backoff. Thread-safe (Transport's
/// methods may be called from any thread after start()); destroying it closes every endpoint,
/// joins the thread and releases UCX, and must not race with calls in progress.
class UcxTransport final : public SessionTransport {
 public:
  /// Creates the UCX context and worker and listens on host:port (a numeric address; port 0:
  /// chosen by the OS, see port()). Connection requests that arrive before start() wait.
  static Result<std::unique_ptr<UcxTransport>> listen(const std::string& host, uint16_t port,
                                                      const UcxOptions& options,
                                                      metrics::Metrics& metrics);
  ~UcxTransport() override;
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  /// The port listened on (ucp_listener_query).
  uint16_t port() const override;

  /// Validates the membership, starts the progress thread, accepts connections from lower ranks
  /// and connects to every higher rank (retrying with backoff until it succeeds, and after a
  /// loss). Returns at once; see allConnected(). Once only. Needs every rank's address
  /// (`peers`): a rendezvous (`Membership::rendezvous`) is served by TcpTransport only.
  Status start(Membership membership) override;

  struct Impl;

 private:
  explicit UcxTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;  // keeps UCX out of this header
};

}  // namespace lightwire::proxy::peer
