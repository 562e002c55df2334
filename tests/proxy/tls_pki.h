#pragma once
// A throwaway PKI made at test time (a CA and a certificate per rank) for the TLS option of the
// tcp link (TcpOptions::tls, docs/peer-protocol.md "TLS").

#include <doctest.h>
#include <openssl/ec.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "proxy/peer/tcp_transport.h"
#include "tests/temp_dir.h"

namespace lightwire::proxy::peer::testing {

using lightwire::testing::TempDir;

using PkeyPtr = std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)>;
using X509Ptr = std::unique_ptr<X509, decltype(&X509_free)>;

inline void addExtension(X509* cert, X509* issuer, int nid, const char* value) {
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
inline X509Ptr makeCert(EVP_PKEY* key, const std::string& cn, X509* issuer, EVP_PKEY* issuer_key) {
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
  /// fastOptions() with TLS on as rank r (tests/proxy/peer_mesh.h).
  TcpOptions optionsFor(uint32_t r) const;
  TempDir dir;
  std::string ca_file;
  std::vector<std::string> cert_files, key_files;
};

}  // namespace lightwire::proxy::peer::testing
