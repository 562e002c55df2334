#pragma once
// The `tcp` transport (docs/peer-protocol.md "Connections"): a full mesh of TCP connections on
// Boost.Asio, one per pair of ranks (the lower rank connects), authenticated with the HMAC
// handshake of docs/peer-protocol.md, reconnected with backoff; optionally over mutual TLS
// (TcpOptions::tls).

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/status.h"
#include "proxy/peer/frame.h"
#include "proxy/peer/session.h"
#include "proxy/peer/transport.h"

namespace lightwire::metrics {
class Metrics;
}

namespace lightwire::proxy::peer {

/// Settings of a TcpTransport. Plain value.
struct TcpOptions {
  std::chrono::milliseconds connect_timeout{2000};    // one TCP connect attempt
  std::chrono::milliseconds handshake_timeout{5000};  // HELLO .. AUTH, either side
  // Accepted connections not yet authenticated, at most; beyond it a new connection is closed at
  // accept (counted as lightwire_limit_hits_total{limit="peer_handshakes"}): connections that
  // never authenticate cannot take every descriptor while each waits out handshake_timeout.
  size_t max_pending_handshakes = 64;
  std::chrono::milliseconds backoff_initial{50};  // between connect attempts, doubling ...
  std::chrono::milliseconds backoff_max{2000};    // ... up to this
  std::chrono::milliseconds ping_interval{1000};
  std::chrono::milliseconds peer_timeout{10000};     // nothing received for this long: peer lost
  uint64_t max_frame_bytes = kDefaultMaxFrameBytes;  // payload bytes of one frame
  // Received frames not yet asked for, per peer; beyond either bound the connection is closed.
  uint64_t max_kept_bytes_per_peer = uint64_t{4} << 30;
  uint64_t max_kept_frames_per_peer = 65536;
  int socket_buffer_bytes = 0;  // SO_SNDBUF / SO_RCVBUF; 0 = the kernel's autotuning

  /// TLS on every connection (docs/peer-protocol.md "TLS"; config keys peer.tls.*): TLS 1.2 at
  /// least (1.3 preferred), mutual: both sides present their certificate and, with verify_peer,
  /// check the other's against ca_file (host names are not checked). The HMAC handshake runs
  /// inside it. Files are PEM, read by TcpTransport::listen().
  struct Tls {
    bool enabled = false;
    std::string cert_file;    // this node's certificate (then any intermediates)
    std::string key_file;     // its private key, unencrypted (the contents are never logged)
    std::string ca_file;      // the CA certificate(s) a peer's certificate must chain to
    bool verify_peer = true;  // false: any certificate is accepted (encryption only)
  } tls;
};

/// Transport over TCP with its own I/O thread: the tcp links (TLS optional) of a PeerSession, set
/// up by listening, connecting and reconnecting with backoff. Thread-safe (Transport's methods may
/// be called from any thread after start()); destroying it closes every connection and joins the
/// thread, and must not race with calls in progress.
class TcpTransport final : public SessionTransport {
 public:
  /// Binds and listens on host:port (0: chosen by the OS; see port()). Connections that arrive
  /// before start() wait in the backlog. With options.tls.enabled, loads and checks the
  /// certificate, key and CA first: an error names the option, the file and OpenSSL's reason.
  static Result<std::unique_ptr<TcpTransport>> listen(const std::string& host, uint16_t port,
                                                      const TcpOptions& options,
                                                      metrics::Metrics& metrics);
  ~TcpTransport() override;
  TcpTransport(const TcpTransport&) = delete;
  TcpTransport& operator=(const TcpTransport&) = delete;

  /// The port listened on.
  uint16_t port() const override;

  /// Validates the membership, starts the I/O thread, accepts connections from lower ranks and
  /// connects to every higher rank (retrying with backoff until it succeeds, and after a loss).
  /// Returns at once; see allConnected(). Once only.
  Status start(Membership membership) override;

  /// Reads the certificate, key and CA files again (a renewed certificate; docs/peer-protocol.md
  /// "TLS"): connections made from then on use them, those already up keep theirs. On an error
  /// (named as listen() names it) the previous files stay in use. Returns the new certificate's
  /// subject and end of validity for the log. Thread-safe.
  Result<std::string> reloadTls() override;
  std::optional<TlsCertificate> tlsCertificate() const override;

  struct Impl;

 private:
  explicit TcpTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;  // keeps Asio out of this header
};

}  // namespace lightwire::proxy::peer
