#include "proxy/tools/status_cli.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>
#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <sstream>
#include <string_view>

namespace lightwire::proxy {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace json = boost::json;

constexpr const char* kDefaultSocket = "/run/lightwire/lightwire.sock";

std::string str(const json::value* v) {
  if (!v || v->is_null()) return "-";
  if (v->is_string()) return std::string(v->as_string());
  return json::serialize(*v);
}

const json::value* at(const json::object& o, std::string_view key) { return o.if_contains(key); }

std::string num(double v) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

std::string bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return num(b) + " " + units[u];
}

double number(const json::value* v) {
  if (!v) return 0;
  if (v->is_double()) return v->as_double();
  if (v->is_int64()) return static_cast<double>(v->as_int64());
  if (v->is_uint64()) return static_cast<double>(v->as_uint64());
  return 0;
}

struct Reply {
  unsigned status = 0;
  std::string body;
};

/// GET `target` over an already connected stream.
template <typename Stream>
Reply get(Stream& stream, const std::string& host, const std::string& token,
          const std::string& target) {
  http::request<http::empty_body> req{http::verb::get, target, 11};
  req.set(http::field::host, host);
  req.set(http::field::user_agent, "lightwire-cli");
  if (!token.empty()) req.set(http::field::authorization, "Bearer " + token);
  http::write(stream, req);
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(64u << 20);
  http::read(stream, buffer, parser);
  auto res = parser.release();
  return Reply{res.result_int(), std::move(res.body())};
}

/// GET `target` from the sidecar `o` names (--url, else --socket, else $LIGHTWIRE_SOCKET, else
/// the default socket); `where` is set to what was asked, for error messages.
Reply fetch(const StatusOptions& o, const std::string& target, std::string& where) {
  asio::io_context io;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000));
  if (o.url) {
    std::string_view u = *o.url;
    if (u.rfind("http://", 0) != 0) {
      throw std::invalid_argument("--url must be http://HOST:PORT, got '" + *o.url + "'");
    }
    u.remove_prefix(7);
    if (const auto slash = u.find('/'); slash != std::string_view::npos) u = u.substr(0, slash);
    std::string host, port;
    if (!u.empty() && u.front() == '[') {
      const auto close = u.find(']');
      if (close == std::string_view::npos || close + 1 >= u.size() || u[close + 1] != ':') {
        throw std::invalid_argument("--url: bad IPv6 address in '" + *o.url + "'");
      }
      host = std::string(u.substr(1, close - 1));
      port = std::string(u.substr(close + 2));
    } else {
      const auto colon = u.rfind(':');
      if (colon == std::string_view::npos) {
        throw std::invalid_argument("--url needs a port: '" + *o.url + "'");
      }
      host = std::string(u.substr(0, colon));
      port = std::string(u.substr(colon + 1));
    }
    where = *o.url;
    beast::tcp_stream stream(io);
    stream.expires_after(timeout);
    asio::ip::tcp::resolver resolver(io);
    stream.connect(resolver.resolve(host, port));
    return get(stream, host, o.token, target);
  }
  const char* env = std::getenv("LIGHTWIRE_SOCKET");
  const std::string path = o.socket ? *o.socket : (env && *env ? env : kDefaultSocket);
  where = "unix:" + path;
  asio::local::stream_protocol::socket sock(io);
  sock.connect(asio::local::stream_protocol::endpoint(path));
  struct timeval tv {};
  tv.tv_sec = static_cast<time_t>(o.timeout_s);
  tv.tv_usec = static_cast<suseconds_t>((o.timeout_s - static_cast<double>(tv.tv_sec)) * 1e6);
  ::setsockopt(sock.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(sock.native_handle(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  return get(sock, "localhost", o.token, target);
}

/// "codec=topk density=0.1 ..." of a codec or rule object: set fields only.
std::string settingsLine(const json::value* v) {
  if (!v || !v->is_object()) return str(v);
  std::string line;
  for (const auto& [k, x] : v->as_object()) {
    if (x.is_null()) continue;
    std::string value;
    if (x.is_number()) {
      value = num(number(&x));
    } else if (x.is_string()) {
      value = std::string(x.as_string());
    } else {
      value = json::serialize(x);
    }
    line += (line.empty() ? "" : " ") + std::string(k) + "=" + value;
  }
  return line;
}

}  // namespace

std::string formatStatus(const json::object& s, int decisions) {
  std::ostringstream out;
  const json::object empty;
  const auto obj = [&](const json::object& o, std::string_view k) -> const json::object& {
    const auto* v = o.if_contains(k);
    return v && v->is_object() ? v->as_object() : empty;
  };
  const auto& config = obj(s, "config");
  out << "lightwire " << str(at(s, "version")) << "  job " << str(at(config, "job_id")) << "  rank "
      << str(at(s, "rank")) << " of " << str(at(s, "world_size")) << "  up "
      << num(number(at(s, "uptime_s"))) << " s\n";
  // Peers.
  if (const auto* peers = at(s, "peers_up"); peers && peers->is_array()) {
    const auto& arr = peers->as_array();
    size_t up = 0;
    std::string list;
    for (size_t r = 0; r < arr.size(); ++r) {
      const bool ok = arr[r].is_bool() && arr[r].as_bool();
      up += ok ? 1 : 0;
      list += (r ? " " : "") + std::to_string(r) + (ok ? ":up" : ":DOWN");
    }
    if (!arr.empty()) out << "peers     " << up << "/" << arr.size() << " up  (" << list << ")\n";
  }
  if (const auto* tls = at(s, "peer_tls"); tls && tls->is_object()) {
    const auto& t = tls->as_object();
    out << "tls       " << str(at(t, "subject")) << " (" << str(at(t, "certificate"))
        << "), valid until " << str(at(t, "not_after"));
    if (const auto* end = at(t, "not_after_unix"); end && end->is_int64()) {
      const double days = static_cast<double>(end->as_int64() - std::time(nullptr)) / 86400.0;
      out << "  (" << num(days) << " days left)";
    }
    out << "\n";
  }
  const auto& listeners = obj(s, "listeners");
  out << "listeners control " << str(at(listeners, "control_socket")) << ", tcp "
      << str(at(listeners, "control_tcp_port")) << ", admin " << str(at(listeners, "admin_port"))
      << "\n";
  const auto& steps = obj(s, "steps");
  out << "steps     " << str(at(steps, "ok")) << " ok, " << str(at(steps, "failed"))
      << " failed  (local trainers " << str(at(s, "local_trainers")) << ")\n";
  // Codec settings per group.
  const auto& compression = obj(config, "compression");
  out << "\ncompression\n  default  " << settingsLine(at(compression, "default")) << "\n";
  if (const auto* rules = at(compression, "rules"); rules && rules->is_array()) {
    for (const auto& r : rules->as_array()) out << "  rule     " << settingsLine(&r) << "\n";
  }
  // Policies.
  const auto& pol = obj(s, "policies");
  if (!pol.empty()) {
    const double from = number(at(pol, "bypass_from")), until = number(at(pol, "bypass_until"));
    out << "\npolicies\n  bypass   "
        << (until > 0 ? "steps " + num(from) + ".." + num(until - 1) : std::string("never"))
        << "\n";
    if (const auto* settings = at(pol, "settings"); settings && settings->is_array()) {
      const auto& arr = settings->as_array();
      for (size_t i = 0; i < arr.size(); ++i) {
        if (!arr[i].is_object()) continue;
        const auto& e = arr[i].as_object();
        out << "  settings v" << i << " from step " << str(at(e, "from_step"))
            << (at(e, "known_good") && at(e, "known_good")->is_bool() &&
                        at(e, "known_good")->as_bool()
                    ? ", known-good"
                    : "")
            << " (" << str(at(e, "why")) << ")\n";
      }
    }
    out << "  resumed  " << str(at(pol, "resumed_from")) << "\n";
    // codec auto: the direct window and each layer's rung with why.
    if (const auto* a = at(pol, "auto"); a && a->is_object()) {
      const auto& ao = a->as_object();
      const auto* layers = at(ao, "layers");
      if (layers && layers->is_object() && !layers->as_object().empty()) {
        const auto& d = obj(ao, "direct");
        const double from = number(at(d, "from")), until = number(at(d, "until"));
        out << "  auto     direct window "
            << (until > from ? "steps " + num(from) + ".." + num(until - 1) : std::string("none"))
            << "\n";
        for (const auto& [name, layer] : layers->as_object()) {
          if (layer.is_object()) out << "    " << str(at(layer.as_object(), "text")) << "\n";
        }
      }
    }
    if (const auto* log = at(pol, "log"); log && log->is_array()) {
      const auto& arr = log->as_array();
      out << "  decisions (" << arr.size() << " kept, last " << decisions << ")\n";
      const size_t first = arr.size() > static_cast<size_t>(decisions)
                               ? arr.size() - static_cast<size_t>(decisions)
                               : 0;
      for (size_t i = first; i < arr.size(); ++i) {
        if (!arr[i].is_object()) continue;
        const auto& e = arr[i].as_object();
        out << "    step " << str(at(e, "step")) << "  " << str(at(e, "tensor")) << "  "
            << str(at(e, "kind")) << ": " << str(at(e, "detail")) << "\n";
      }
    }
  }
  // Tensors and their recent steps.
  if (const auto* tensors = at(s, "tensors"); tensors && tensors->is_array()) {
    out << "\ntensors\n";
    char line[256];
    std::snprintf(line, sizeof line, "  %-24s %-8s %12s %10s %10s %12s\n", "name", "codec",
                  "elements", "last step", "committed", "state");
    out << line;
    for (const auto& t : tensors->as_array()) {
      if (!t.is_object()) continue;
      const auto& o = t.as_object();
      std::snprintf(line, sizeof line, "  %-24s %-8s %12s %10s %10s %12s\n",
                    str(at(o, "name")).substr(0, 24).c_str(), str(at(o, "codec")).c_str(),
                    str(at(o, "elements")).c_str(), str(at(o, "last_step")).c_str(),
                    str(at(o, "last_committed_step")).c_str(),
                    bytes(number(at(o, "state_bytes"))).c_str());
      out << line;
    }
  }
  // Streams of ordered steps (buckets in flight): where each stands.
  if (const auto* streams = at(s, "streams");
      streams && streams->is_array() && !streams->as_array().empty()) {
    out << "\nstreams (steps run in the trainers' order)\n";
    for (const auto& v : streams->as_array()) {
      if (!v.is_object()) continue;
      const auto& o = v.as_object();
      std::string last = "nothing run yet";
      if (const auto* l = at(o, "last"); l && l->is_object()) {
        last = "last ran: iteration " + str(at(l->as_object(), "iteration")) + " position " +
               str(at(l->as_object(), "position"));
      }
      out << "  " << str(at(o, "stream")) << "  " << last << ", " << str(at(o, "waiting_steps"))
          << " waiting, " << str(at(o, "cancelled_ahead")) << " cancelled ahead\n";
    }
  }
  if (const auto* report = at(s, "last_report");
      report && report->is_object() && !report->as_object().empty()) {
    out << "\nlast report  " << json::serialize(*report) << "\n";
  }
  return out.str();
}

int runStatus(const StatusOptions& o) {
  if (o.socket && o.url) {
    std::fprintf(stderr, "lightwire status: give --socket or --url, not both\n");
    return 2;
  }
  StatusOptions opts = o;
  if (opts.token.empty()) {
    if (const char* t = std::getenv("LIGHTWIRE_TOKEN"); t) opts.token = t;
  }
  std::string where, body;
  try {
    Reply reply = fetch(opts, "/v1/status", where);
    if (reply.status != 200) {
      throw std::runtime_error("HTTP " + std::to_string(reply.status) + ": " +
                               reply.body.substr(0, 300));
    }
    body = std::move(reply.body);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "lightwire status: %s\n", e.what());
    return 2;
  } catch (const boost::system::system_error& e) {
    std::fprintf(stderr, "lightwire status: cannot read the status of %s: %s\n",
                 where.empty() ? "the sidecar" : where.c_str(), e.code().message().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lightwire status: cannot read the status of %s: %s\n",
                 where.empty() ? "the sidecar" : where.c_str(), e.what());
    return 1;
  }
  boost::system::error_code ec;
  const json::value v = json::parse(body, ec);
  if (ec || !v.is_object()) {
    std::fprintf(stderr, "lightwire status: %s did not answer a JSON object\n", where.c_str());
    return 1;
  }
  if (opts.json) {
    std::printf("%s\n", body.c_str());
  } else {
    std::fputs(formatStatus(v.as_object(), opts.decisions).c_str(), stdout);
  }
  return 0;
}

std::string defaultHealthUrl(const char* admin_listen) {
  std::string listen = admin_listen && *admin_listen ? admin_listen : "0.0.0.0:4782";
  const auto colon = listen.rfind(':');
  if (colon == std::string::npos || colon + 1 == listen.size()) return "http://127.0.0.1:4782";
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  // A wildcard listener is reached on the loopback address of its family.
  if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
  if (host == "[::]") host = "[::1]";
  return "http://" + host + ":" + port;
}

int runHealth(const HealthOptions& o) {
  if (o.socket && o.url) {
    std::fprintf(stderr, "lightwire health: give --socket or --url, not both\n");
    return 2;
  }
  StatusOptions opts;
  opts.socket = o.socket;
  opts.url = o.url;
  opts.timeout_s = o.timeout_s;
  if (!opts.socket && !opts.url)
    opts.url = defaultHealthUrl(std::getenv("LIGHTWIRE_ADMIN__LISTEN"));
  if (const char* t = std::getenv("LIGHTWIRE_TOKEN"); t) opts.token = t;
  const std::string target = o.ready ? "/readyz" : "/healthz";
  std::string where;
  try {
    const Reply reply = fetch(opts, target, where);
    std::string body = reply.body.substr(0, 300);
    while (!body.empty() && (body.back() == '\n' || body.back() == '\r')) body.pop_back();
    if (reply.status == 200) {
      if (!o.quiet) std::printf("%s%s: %s\n", where.c_str(), target.c_str(), body.c_str());
      return 0;
    }
    std::fprintf(stderr, "lightwire health: %s%s: HTTP %u: %s\n", where.c_str(), target.c_str(),
                 reply.status, body.c_str());
    return 1;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "lightwire health: %s\n", e.what());
    return 2;
  } catch (const boost::system::system_error& e) {
    std::fprintf(stderr, "lightwire health: %s%s: %s\n",
                 where.empty() ? "the sidecar" : where.c_str(), target.c_str(),
                 e.code().message().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lightwire health: %s%s: %s\n",
                 where.empty() ? "the sidecar" : where.c_str(), target.c_str(), e.what());
    return 1;
  }
}

}  // namespace lightwire::proxy
