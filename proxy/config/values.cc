// Parsing one value of a key from its text: the same code whatever its source, so that a value
// means the same in the file, the environment and a flag (docs/configuration.md "Sources and
// precedence").

#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <utility>

#include "proxy/config/config_impl.h"

namespace lightwire::proxy {
namespace config_detail {

namespace json = boost::json;

namespace {

constexpr size_t kMaxShownValue = 80;  // longer values are cut in error messages
constexpr double kMaxSeconds = 1e9;    // keeps durations representable as int64 nanoseconds

/// Digits only (no sign, no spaces, no exponent), no overflow.
std::optional<uint64_t> parseDigits(std::string_view s) {
  if (s.empty()) return std::nullopt;
  for (char ch : s) {
    if (ch < '0' || ch > '9') return std::nullopt;
  }
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || end != s.data() + s.size()) return std::nullopt;
  return v;
}

/// A finite decimal number ("0.5", "-1", "1e-3"); no spaces, no "inf"/"nan", no leading '+'.
std::optional<double> parseNumber(std::string_view s) {
  if (s.empty()) return std::nullopt;
  double v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || end != s.data() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

std::string integerRange(uint64_t lo, uint64_t hi) {
  if (hi == std::numeric_limits<uint64_t>::max()) {
    return lo == 1 ? "must be a positive integer" : "must be a non-negative integer";
  }
  return "must be an integer in " + std::to_string(lo) + ".." + std::to_string(hi);
}

}  // namespace

std::string setUnsigned(std::string_view s, uint64_t lo, uint64_t hi, uint64_t& out) {
  const auto v = parseDigits(s);
  if (!v || *v < lo || *v > hi) return integerRange(lo, hi);
  out = *v;
  return "";
}

/// A duration in seconds: > 0 and at most kMaxSeconds.
std::string setSeconds(std::string_view s, double& out) {
  const auto v = parseNumber(s);
  if (!v || *v <= 0 || *v > kMaxSeconds) return "must be a number of seconds > 0 (at most 1e9)";
  out = *v;
  return "";
}

std::string setAnyNumber(std::string_view s, double& out) {
  const auto v = parseNumber(s);
  if (!v) return "must be a finite number";
  out = *v;
  return "";
}

/// A finite number for which ok() holds; `must` says which ("must be a number > 0").
std::string setNumber(std::string_view s, double& out, bool (*ok)(double),
                      const std::string& must) {
  const auto v = parseNumber(s);
  if (!v || !ok(*v)) return must;
  out = *v;
  return "";
}

/// The shortest text that parses back to `v` exactly (the key table's defaults).
std::string numberText(double v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc{} ? std::string(buf, end) : std::string();
}

/// true, yes, on, 1 / false, no, off, 0 in any case (YAML 1.1's spellings, and the JSON ones).
std::string setBool(std::string_view s, bool& out) {
  std::string v(s.size() <= 5 ? s : std::string_view());  // longer: no spelling matches
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (v == "true" || v == "yes" || v == "on" || v == "1") {
    out = true;
  } else if (v == "false" || v == "no" || v == "off" || v == "0") {
    out = false;
  } else {
    return "must be true or false (or yes/no, on/off, 1/0)";
  }
  return "";
}

/// A file or directory path ("" allowed: the key's own meaning of unset).
std::string setPath(std::string_view s, std::string& out) {
  if (s.size() > 4095 || s.find('\0') != std::string_view::npos) {
    return "must be a path of at most 4095 bytes";
  }
  out = std::string(s);
  return "";
}

/// "" clears an optional value (so an override can undo the file's setting).
std::string setOptionalNumber(std::string_view s, std::optional<double>& out,
                              const std::function<bool(double)>& ok, const char* what) {
  if (s.empty()) {
    out.reset();
    return "";
  }
  const auto v = parseNumber(s);
  if (!v || !ok(*v)) return what;
  out = *v;
  return "";
}

std::optional<ListenAddress> parseListen(std::string_view s) {
  ListenAddress a;
  std::string_view port;
  if (!s.empty() && s.front() == '[') {
    const size_t close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':') {
      return std::nullopt;
    }
    a.host = std::string(s.substr(1, close - 1));
    if (a.host.find(':') == std::string::npos) return std::nullopt;  // brackets are for IPv6
    port = s.substr(close + 2);
  } else {
    const size_t colon = s.rfind(':');
    if (colon == std::string_view::npos) return std::nullopt;
    a.host = std::string(s.substr(0, colon));
    if (a.host.find(':') != std::string::npos) return std::nullopt;  // IPv6 needs brackets
    port = s.substr(colon + 1);
  }
  if (a.host.empty()) return std::nullopt;
  for (unsigned char ch : a.host) {
    if (std::iscntrl(ch) || std::isspace(ch) || ch == '[' || ch == ']' || ch == '/') {
      return std::nullopt;
    }
  }
  const auto p = parseDigits(port);
  if (!p || *p > 65535) return std::nullopt;
  a.port = static_cast<uint16_t>(*p);
  return a;
}

/// `text` with every "{rank}" replaced by `rank`.
std::string expandRank(std::string_view text, uint32_t rank) {
  std::string out;
  for (size_t at = text.find(kRankPlaceholder); at != std::string_view::npos;
       at = text.find(kRankPlaceholder)) {
    out += text.substr(0, at);
    out += std::to_string(rank);
    text.remove_prefix(at + kRankPlaceholder.size());
  }
  return out += text;
}

std::string setListen(std::string_view s, std::optional<ListenAddress>& out) {
  if (s.empty()) {
    out.reset();
    return "";
  }
  auto a = parseListen(s);
  if (!a) return "must be \"host:port\" with port 0..65535 (IPv6 as \"[::1]:4780\", \"\" = off)";
  out = std::move(a);
  return "";
}

json::value listenJson(const std::optional<ListenAddress>& a) {
  return json::value(a ? a->toString() : std::string());
}

json::value optionalJson(const std::optional<double>& v) {
  return v ? json::value(*v) : json::value(nullptr);
}

std::string shown(std::string_view raw) {
  if (raw.size() <= kMaxShownValue) return std::string(raw);
  return std::string(raw.substr(0, kMaxShownValue)) + "...";
}

std::string withSource(const std::string& source, const std::string& message) {
  return source.empty() ? message : source + ": " + message;
}

std::string valueError(const std::string& source, const std::string& key, const std::string& what,
                       std::string_view raw, bool secret) {
  std::string m = key + " " + what;
  m += secret ? " (value not shown)" : ", got '" + shown(raw) + "'";
  return withSource(source, m);
}

}  // namespace config_detail

std::string ListenAddress::toString() const {
  const std::string p = std::to_string(port);
  return host.find(':') != std::string::npos ? "[" + host + "]:" + p : host + ":" + p;
}

}  // namespace lightwire::proxy
