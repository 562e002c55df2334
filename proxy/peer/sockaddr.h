#pragma once
// Peer addresses: "host:port" text and the socket addresses the ucx transport gives UCX.

#include <sys/socket.h>

#include <cstdint>
#include <string>

#include "kernels/status.h"

namespace lightwire::proxy::peer {

/// "host:port" (or "[v6]:port") to host and a port other than 0.
bool parseHostPort(const std::string& s, std::string& host, uint16_t& port);

/// A socket address of either family. Plain value.
struct SockAddr {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

/// host:port to a socket address (getaddrinfo; `numeric`: no name lookup).
Result<SockAddr> resolve(const std::string& host, uint16_t port, bool numeric);

/// "1.2.3.4:5" or "[::1]:5" ("unknown address" for another family).
std::string sockaddrName(const sockaddr_storage& ss);

/// The port of an IPv4 or IPv6 address (0 for another family).
uint16_t sockaddrPort(const sockaddr_storage& ss);

}  // namespace lightwire::proxy::peer
