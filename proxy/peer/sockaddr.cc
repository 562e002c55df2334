#include "proxy/peer/sockaddr.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <spdlog/fmt/fmt.h>

#include <charconv>
#include <cstring>

namespace lightwire::proxy::peer {

bool parseHostPort(const std::string& s, std::string& host, uint16_t& port) {
  auto colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) return false;
  host = s.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const char* b = s.data() + colon + 1;
  const char* e = s.data() + s.size();
  auto [p, err] = std::from_chars(b, e, port);
  return err == std::errc() && p == e && port != 0;
}

Result<SockAddr> resolve(const std::string& host, uint16_t port, bool numeric) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (numeric ? AI_NUMERICHOST | AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0 || !res) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("cannot resolve '{}': {}", host, ::gai_strerror(rc)));
  }
  SockAddr a;
  std::memcpy(&a.storage, res->ai_addr, res->ai_addrlen);
  a.length = res->ai_addrlen;
  ::freeaddrinfo(res);
  return a;
}

std::string sockaddrName(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(ss);
    ::inet_ntop(AF_INET, &in.sin_addr, buf, sizeof(buf));
    return fmt::format("{}:{}", buf, ntohs(in.sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(ss);
    ::inet_ntop(AF_INET6, &in6.sin6_addr, buf, sizeof(buf));
    return fmt::format("[{}]:{}", buf, ntohs(in6.sin6_port));
  }
  return "unknown address";
}

uint16_t sockaddrPort(const sockaddr_storage& ss) {
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(ss).sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(ss).sin6_port);
  return 0;
}

}  // namespace lightwire::proxy::peer
