// Helpers the control API's routes share (api_util.h).

#include "proxy/server/api_util.h"

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <cmath>

namespace lightwire::proxy::api {
namespace {

int hexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/// Percent-decoding ('+' is a space in query strings); false on a malformed escape.
bool percentDecode(std::string_view in, std::string* out) {
  out->clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == '%') {
      if (i + 2 >= in.size() + 0 && i + 2 > in.size() - 1 + 1) return false;
      if (i + 2 >= in.size() + 1) return false;
      const int hi = hexValue(in[i + 1]), lo = i + 2 < in.size() ? hexValue(in[i + 2]) : -1;
      if (hi < 0 || lo < 0) return false;
      out->push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    } else if (in[i] == '+') {
      out->push_back(' ');
    } else {
      out->push_back(in[i]);
    }
  }
  return true;
}

/// Splits a request target into path and query parameters; "" or an error message.
}  // namespace

Response jsonResponse(status st, const json::value& v) {
  Response r{st, 11};
  r.set(http::field::content_type, "application/json");
  r.body() = json::serialize(v);
  return r;
}

Response textResponse(status st, std::string body, const char* type) {
  Response r{st, 11};
  r.set(http::field::content_type, type);
  r.body() = std::move(body);
  return r;
}

Response badRequest(const std::string& message) {
  return errorResponse(status::bad_request, "invalid_argument", message);
}

Response fromOutcome(const StepOutcome& o) {
  const ApiError e = apiError(o.error);
  return errorResponse(static_cast<status>(e.status), e.code, o.message);
}

std::string parseTarget(std::string_view target, RequestTarget* t) {
  const size_t q = target.find('?');
  if (!percentDecode(target.substr(0, q), &t->path)) return "malformed percent-escape in the path";
  if (q == std::string_view::npos) return "";
  std::string_view rest = target.substr(q + 1);
  while (!rest.empty()) {
    const size_t amp = rest.find('&');
    const std::string_view pair = rest.substr(0, amp);
    rest = amp == std::string_view::npos ? std::string_view{} : rest.substr(amp + 1);
    if (pair.empty()) continue;
    const size_t eq = pair.find('=');
    std::string key, value;
    if (!percentDecode(pair.substr(0, eq), &key) ||
        (eq != std::string_view::npos && !percentDecode(pair.substr(eq + 1), &value))) {
      return "malformed percent-escape in the query string";
    }
    if (t->query.size() >= kMaxQueryParams) return "too many query parameters";
    if (!t->query.emplace(key, value).second) {
      return "query parameter '" + key + "' is given twice";
    }
  }
  return "";
}

/// Decimal digits only, no sign, no overflow.
bool parseU64(std::string_view s, uint64_t* v) {
  if (s.empty() || s.size() > 20) return false;
  uint64_t x = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (x > (std::numeric_limits<uint64_t>::max() - d) / 10) return false;
    x = x * 10 + d;
  }
  *v = x;
  return true;
}

std::string quote(std::string_view s) {
  std::string out = "'";
  for (char c : s.substr(0, 64)) {
    out += (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) ? '?' : c;
  }
  if (s.size() > 64) out += "...";
  return out + "'";
}

/// "" or why `name` is not a valid tensor name.
std::string checkName(std::string_view name) {
  if (name.empty() || name.size() > kMaxNameBytes) {
    return "tensor name must have 1 to " + std::to_string(kMaxNameBytes) + " characters";
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == ':' || c == '/' || c == '-';
    if (!ok) return "tensor name " + quote(name) + " may only use A-Z a-z 0-9 _ . : / -";
  }
  return "";
}

/// elements = product of dims, each >= 1, without overflow; "" or an error.
std::string elementsOf(const std::vector<uint64_t>& shape, uint64_t* elements) {
  if (shape.size() > kMaxDims) return "shape has more than " + std::to_string(kMaxDims) + " dims";
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (d == 0) return "shape dimensions must be at least 1";
    if (n > (uint64_t{1} << 62) / d) return "shape is too large";
    n *= d;
  }
  *elements = n;
  return "";
}

/// An unsigned integer field of a JSON object; "" or an error. `present` says whether it was
/// there (absent is an error when `required`).
std::string jsonU64(const json::object& o, std::string_view key, bool required, uint64_t* v,
                    bool* present) {
  const json::value* f = o.if_contains(key);
  if (present) *present = f != nullptr;
  if (f == nullptr) return required ? "missing field '" + std::string(key) + "'" : "";
  if (f->is_uint64()) {
    *v = f->get_uint64();
  } else if (f->is_int64() && f->get_int64() >= 0) {
    *v = static_cast<uint64_t>(f->get_int64());
  } else {
    return "field '" + std::string(key) + "' must be a non-negative integer";
  }
  return "";
}

std::string jsonString(const json::object& o, std::string_view key, bool required, std::string* v) {
  const json::value* f = o.if_contains(key);
  if (f == nullptr) return required ? "missing field '" + std::string(key) + "'" : "";
  if (!f->is_string()) return "field '" + std::string(key) + "' must be a string";
  *v = std::string(f->get_string());
  return "";
}

namespace {

// A JSON number as a finite double (false: not a number, or not finite).
bool finiteNumber(const json::value* f, double* out) {
  if (f->is_double()) {
    *out = f->get_double();
  } else if (f->is_int64()) {
    *out = static_cast<double>(f->get_int64());
  } else if (f->is_uint64()) {
    *out = static_cast<double>(f->get_uint64());
  } else {
    return false;
  }
  return std::isfinite(*out);
}

}  // namespace

std::string jsonMomentum(const json::object& o, std::optional<double>* momentum) {
  const json::value* f = o.if_contains("momentum");
  if (!f) return "";
  double m = 0;
  if (!finiteNumber(f, &m) || !(m > 0 && m < 1)) {
    return "field 'momentum' must be a number in (0, 1): the momentum the trainer's optimizer "
           "takes back from the sidecar";
  }
  *momentum = m;
  return "";
}

std::string jsonTiming(const json::object& o, std::optional<double>* compute_s,
                       std::optional<double>* overlap_s, std::optional<double>* direct_s,
                       std::optional<double>* tail_s) {
  const json::value* c = o.if_contains("compute_s");
  const json::value* v = o.if_contains("overlap_s");
  for (auto [key, out] : {std::pair{"direct_s", direct_s}, std::pair{"tail_s", tail_s}}) {
    const json::value* f = o.if_contains(key);
    if (!f) continue;
    double v = 0;
    if (!finiteNumber(f, &v) || !(v >= 0 && v <= 3600)) {
      return "field '" + std::string(key) + "' must be a number in [0, 3600]";
    }
    *out = v;
  }
  if (!c && !v) return "";
  if (!c || !v) return "fields 'compute_s' and 'overlap_s' go together";
  double cv = 0, ov = 0;
  if (!finiteNumber(c, &cv) || !finiteNumber(v, &ov) || !(ov >= 0 && ov <= cv && cv <= 3600)) {
    return "fields 'compute_s' and 'overlap_s' must be numbers with 0 <= overlap_s <= "
           "compute_s <= 3600";
  }
  *compute_s = cv;
  *overlap_s = ov;
  return "";
}

std::string jsonOrder(const json::object& o, std::optional<StepOrder>* order) {
  const json::value* f = o.if_contains("order");
  if (f == nullptr) return "";
  const json::object* fields = f->if_object();
  if (fields == nullptr) return "field 'order' must be an object {stream, iteration, position}";
  StepOrder out;
  uint64_t position = 0;
  for (std::string e : {jsonString(*fields, "stream", true, &out.stream),
                        jsonU64(*fields, "iteration", true, &out.iteration),
                        jsonU64(*fields, "position", true, &position)}) {
    if (!e.empty()) return "field 'order': " + e;
  }
  for (const auto& kv : *fields) {
    const std::string_view k = kv.key();
    if (k != "stream" && k != "iteration" && k != "position") {
      return "field 'order': unknown field " + quote(k) + " (known: stream, iteration, position)";
    }
  }
  if (std::string e = checkName(out.stream); !e.empty()) {
    return "field 'order': stream " + quote(out.stream) + " must be 1 to " +
           std::to_string(kMaxNameBytes) + " characters of A-Z a-z 0-9 _ . : / -";
  }
  if (position >= (uint64_t{1} << 31)) return "field 'order': position must be below 2^31";
  out.position = static_cast<uint32_t>(position);
  *order = std::move(out);
  return "";
}

/// The body as a JSON object; "" or an error.
std::string parseObject(const std::string& body, json::object* out) {
  boost::system::error_code ec;
  json::parse_options opts;
  opts.max_depth = 16;
  json::value v = json::parse(body, ec, {}, opts);
  if (ec) return "malformed JSON body: " + ec.message();
  if (!v.is_object()) return "JSON body must be an object";
  *out = std::move(v.get_object());
  return "";
}

json::object figuresJson(const std::string& name, uint64_t step, const StepFigures& f) {
  json::object d;
  const char* stages[metrics::kStageCount] = {"ingest", "compress", "exchange", "decompress",
                                              "total"};
  for (size_t s = 0; s < metrics::kStageCount; ++s) {
    d[stages[s]] = static_cast<uint64_t>(std::llround(f.durations_us[s]));
  }
  json::object o{{"name", name},
                 {"step", step},
                 {"codec", f.codec},
                 {"elements", f.elements},
                 {"raw_bytes", f.raw_bytes},
                 {"wire_bytes", f.wire_bytes},
                 {"nonfinite", f.nonfinite},
                 {"state_reset", f.state_reset},
                 {"mode", f.mode},
                 {"settings", f.settings},
                 {"device", f.device},
                 {"momentum", f.momentum},
                 {"durations_us", std::move(d)}};
  if (!f.rung.empty()) o["rung"] = f.rung;
  if (f.direct) o["direct"] = json::object{{"from", f.direct->first}, {"until", f.direct->second}};
  o["ratio"] =
      f.wire_bytes ? static_cast<double>(f.raw_bytes) / static_cast<double>(f.wire_bytes) : 0.0;
  return o;
}

}  // namespace lightwire::proxy::api
