#pragma once
// Mutual TLS of the `tcp` link (docs/peer-protocol.md "TLS"): the TLS context made from the
// peer.tls.* files, and what the log, /v1/status and the metrics say about its certificate.

#include <openssl/x509.h>

#include <boost/asio/ssl/context.hpp>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kernels/status.h"
#include "proxy/peer/tcp_transport.h"

namespace lightwire::metrics {
class Metrics;
}

namespace lightwire::proxy::peer {

/// The TLS context of every connection: TLS >= 1.2, this node's certificate and key, the CA that
/// peers' certificates are verified against (both roles: a peer connects or is connected to).
/// An error names the option, the file and OpenSSL's reason.
Result<std::unique_ptr<boost::asio::ssl::context>> makeTlsContext(const TcpOptions::Tls& o);

/// A subject name for the log ("/CN=node-3").
std::string subjectOf(X509* cert);

/// The certificate of `ctx` as Transport::tlsCertificate() describes it.
Transport::TlsCertificate certificateOf(const TcpOptions::Tls& o, boost::asio::ssl::context& ctx);

/// "certificate /etc/lw/node.pem (/CN=node-3), valid until 2027-03-01T12:00:00Z" for the log.
std::string describeCertificate(const TcpOptions::Tls& o, boost::asio::ssl::context& ctx);

/// lightwire_peer_tls_certificate_expiry_timestamp_seconds: when this node's certificate expires.
void setCertificateExpiry(metrics::Metrics& metrics, boost::asio::ssl::context& ctx);

/// Whether these bytes (a frame header's place) start a TLS handshake record.
bool looksLikeTls(std::span<const uint8_t> b);

}  // namespace lightwire::proxy::peer
