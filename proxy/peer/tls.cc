#include "proxy/peer/tls.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <spdlog/fmt/fmt.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <optional>

#include "metrics/metrics.h"

namespace lightwire::proxy::peer {
namespace {

namespace ssl = boost::asio::ssl;

/// The reason of the oldest error in this thread's OpenSSL error queue (the root cause), which is
/// then cleared.
std::string opensslReason() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  const char* reason = e ? ERR_reason_error_string(e) : nullptr;
  return reason ? reason : "unknown OpenSSL error";
}

/// An error about file `path` of option `key` ("peer.tls.cert_file /x.pem: no start line").
Status tlsFileError(const char* key, const std::string& path, const std::string& why) {
  return invalidArgument(fmt::format("{} {}: {}", key, path, why));
}

/// `path` of option `key` is set and readable.
Status checkReadable(const char* key, const std::string& path) {
  if (path.empty()) return invalidArgument(fmt::format("{} is not set (peer.tls is on)", key));
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return tlsFileError(key, path, std::strerror(errno));
  std::fclose(f);
  return Status::ok();
}

/// The end of the certificate's validity, in seconds since the epoch (nullopt: unreadable).
std::optional<int64_t> notAfterOf(X509* cert) {
  std::tm tm{};
  if (!cert || ASN1_TIME_to_tm(X509_get0_notAfter(cert), &tm) != 1) return std::nullopt;
  return static_cast<int64_t>(timegm(&tm));
}

/// Unix time as "2027-03-01T12:00:00Z" ("" if it cannot be shown).
std::string utcText(int64_t unix_time) {
  const std::time_t t = static_cast<std::time_t>(unix_time);
  std::tm tm{};
  char buf[32];
  if (!gmtime_r(&t, &tm) || std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0) {
    return "";
  }
  return buf;
}

}  // namespace

/// The TLS context of every connection: TLS >= 1.2, this node's certificate and key, the CA that
/// peers' certificates are verified against (both roles: a peer connects or is connected to).
Result<std::unique_ptr<ssl::context>> makeTlsContext(const TcpOptions::Tls& o) {
  LW_RETURN_IF_ERROR(checkReadable("peer.tls.cert_file", o.cert_file));
  LW_RETURN_IF_ERROR(checkReadable("peer.tls.key_file", o.key_file));
  if (o.verify_peer || !o.ca_file.empty()) {
    LW_RETURN_IF_ERROR(checkReadable("peer.tls.ca_file", o.ca_file));
  }
  std::unique_ptr<ssl::context> ctx;
  try {
    ctx = std::make_unique<ssl::context>(ssl::context::tls);
  } catch (const std::exception& e) {
    return internalError(fmt::format("peer: cannot create a TLS context: {}", e.what()));
  }
  SSL_CTX* native = ctx->native_handle();
  ERR_clear_error();
  SSL_CTX_set_min_proto_version(native, TLS1_2_VERSION);
  SSL_CTX_set_options(native, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_TICKET);
  SSL_CTX_set_num_tickets(native, 0);  // no session resumption: nothing to hand out
  SSL_CTX_set_session_cache_mode(native, SSL_SESS_CACHE_OFF);
  // An encrypted key fails here rather than prompting on the terminal.
  SSL_CTX_set_default_passwd_cb(native, [](char*, int, int, void*) { return 0; });
  if (SSL_CTX_use_certificate_chain_file(native, o.cert_file.c_str()) != 1) {
    return tlsFileError("peer.tls.cert_file", o.cert_file, opensslReason());
  }
  const std::string mismatch = "key does not match certificate peer.tls.cert_file " + o.cert_file;
  if (SSL_CTX_use_PrivateKey_file(native, o.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    const unsigned long e = ERR_peek_error();
    const bool other_key =
        ERR_GET_LIB(e) == ERR_LIB_X509 && ERR_GET_REASON(e) == X509_R_KEY_VALUES_MISMATCH;
    const std::string why = opensslReason() + " (an unencrypted PEM private key is needed)";
    return tlsFileError("peer.tls.key_file", o.key_file, other_key ? mismatch : why);
  }
  if (SSL_CTX_check_private_key(native) != 1) {
    ERR_clear_error();
    return tlsFileError("peer.tls.key_file", o.key_file, mismatch);
  }
  if (!o.ca_file.empty() &&
      SSL_CTX_load_verify_locations(native, o.ca_file.c_str(), nullptr) != 1) {
    return tlsFileError("peer.tls.ca_file", o.ca_file, opensslReason());
  }
  SSL_CTX_set_verify(
      native, o.verify_peer ? SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT : SSL_VERIFY_NONE,
      nullptr);
  return ctx;
}

/// A subject name for the log ("/CN=node-3").
std::string subjectOf(X509* cert) {
  if (!cert) return "none";
  char buf[256];
  return X509_NAME_oneline(X509_get_subject_name(cert), buf, sizeof buf) ? buf : "?";
}

/// The certificate of `ctx` as Transport::tlsCertificate() describes it.
Transport::TlsCertificate certificateOf(const TcpOptions::Tls& o, ssl::context& ctx) {
  X509* cert = SSL_CTX_get0_certificate(ctx.native_handle());
  Transport::TlsCertificate c{.file = o.cert_file, .subject = subjectOf(cert)};
  if (const auto end = notAfterOf(cert)) {
    c.not_after = *end;
    c.not_after_utc = utcText(*end);
  }
  return c;
}

/// "certificate /etc/lw/node.pem (/CN=node-3), valid until 2027-03-01T12:00:00Z" for the log.
std::string describeCertificate(const TcpOptions::Tls& o, ssl::context& ctx) {
  const auto c = certificateOf(o, ctx);
  std::string out = fmt::format("certificate {} ({})", c.file, c.subject);
  if (!c.not_after_utc.empty()) out += ", valid until " + c.not_after_utc;
  return out;
}

/// lightwire_peer_tls_certificate_expiry_timestamp_seconds: when this node's certificate expires.
void setCertificateExpiry(metrics::Metrics& metrics, ssl::context& ctx) {
  if (const auto end = notAfterOf(SSL_CTX_get0_certificate(ctx.native_handle()))) {
    metrics.tlsCertificateExpiry().Set(static_cast<double>(*end));
  }
}

/// Whether these bytes (a frame header's place) start a TLS handshake record.
bool looksLikeTls(std::span<const uint8_t> b) {
  return b.size() >= 3 && b[0] == 0x16 && b[1] == 0x03 && b[2] <= 0x04;
}

}  // namespace lightwire::proxy::peer
