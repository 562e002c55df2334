#include "proxy/control_api.h"

#include <openssl/crypto.h>
#include <spdlog/spdlog.h>

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <cmath>
#include <limits>
#include <map>

#include "ipc/cuda_ipc.h"
#include "proxy/version.h"

namespace lightwire::proxy {

ApiError apiError(StepError error) {
  switch (error) {
    case StepError::kNone:
      return {200, ""};
    case StepError::kInvalidArgument:
      return {400, "invalid_argument"};
    case StepError::kConflict:
      return {409, "conflict"};
    case StepError::kResumeMismatch:
      return {409, "resume_mismatch"};
    case StepError::kLimitReached:
      return {429, "limit_reached"};
    case StepError::kInternal:
      return {500, "internal"};
    case StepError::kDeviceError:
      return {500, "device_error"};
    case StepError::kExchangeFailed:
      return {502, "exchange_failed"};
    case StepError::kShuttingDown:
      return {503, "shutting_down"};
    case StepError::kDeadlineExceeded:
      return {504, "deadline_exceeded"};
    case StepError::kStateLimit:
      return {507, "state_limit"};
  }
  return {500, "internal"};
}

struct RequestTarget {
  std::string path;
  std::map<std::string, std::string> query;
  std::string error;  // "" or why the target could not be parsed
};
namespace {

namespace json = boost::json;
using http::status;

constexpr size_t kMaxNameBytes = 256;
constexpr size_t kMaxQueryParams = 16;
constexpr size_t kMaxDims = 16;

Response jsonResponse(status st, const json::value& v) {
  Response r{st, 11};
  r.set(http::field::content_type, "application/json");
  r.body() = json::serialize(v);
  return r;
}

Response textResponse(status st, std::string body, const char* type = "text/plain") {
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

std::string quoted(std::string_view s) {
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
    if (!ok) return "tensor name " + quoted(name) + " may only use A-Z a-z 0-9 _ . : / -";
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
                    bool* present = nullptr) {
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
                 {"durations_us", std::move(d)}};
  o["ratio"] =
      f.wire_bytes ? static_cast<double>(f.raw_bytes) / static_cast<double>(f.wire_bytes) : 0.0;
  return o;
}

/// The route template of a path, for metric labels (bounded set).
std::string routeTemplate(const std::string& path) {
  static const char* known[] = {"/healthz",          "/readyz",     "/metrics",   "/v1/status",
                                "/v1/emit_gradient", "/v1/buffers", "/v1/report", "/v1/config",
                                "/v1/checkpoint",    "/v1/resume"};
  for (const char* k : known) {
    if (path == k) return k;
  }
  if (path.rfind("/v1/buffers/", 0) == 0) return "/v1/buffers/{id}";
  return "other";
}

}  // namespace

CodecChooser chooserFor(std::shared_ptr<const CompressionConfig> c) {
  return [c = std::move(c)](std::string_view name, uint64_t elements) {
    const CodecRule* rule = c->ruleFor(name, elements);
    TensorSettings s(rule ? rule->codec : c->default_codec);
    if (rule) {
      s.sync_every = rule->sync_every;
      s.group = rule->group;
    }
    return s;
  };
}

ControlApi::ControlApi(ServeConfig config, metrics::Metrics& metrics, ipc::BufferTable& buffers,
                       StepEngine& engine, policies::PolicyEngine* policy)
    : config_(std::move(config)),
      metrics_(metrics),
      buffers_(buffers),
      engine_(engine),
      policy_(policy),
      compression_(std::make_shared<const CompressionConfig>(config_.compression)) {}

void ControlApi::setCuda(std::shared_ptr<ipc::CudaDriver> driver, std::string why_not) {
  std::lock_guard lock(mu_);
  cuda_ = std::move(driver);
  cuda_why_not_ = std::move(why_not);
}

void ControlApi::setAfterResume(std::function<void()> after) {
  std::lock_guard lock(mu_);
  after_resume_ = std::move(after);
}

void ControlApi::setPeers(std::function<std::vector<bool>()> peers_up) {
  std::lock_guard lock(mu_);
  peers_up_ = std::move(peers_up);
}

void ControlApi::setPeerTls(std::function<boost::json::value()> info) {
  std::lock_guard lock(mu_);
  peer_tls_ = std::move(info);
}

void ControlApi::setListeners(BoundListeners l) {
  std::lock_guard lock(mu_);
  listeners_ = std::move(l);
}

bool ControlApi::tokenOk(const Request& req) const {
  if (config_.token.empty()) return true;
  const std::string expected = "Bearer " + config_.token;
  const auto got = req[http::field::authorization];
  return got.size() == expected.size() &&
         CRYPTO_memcmp(got.data(), expected.data(), expected.size()) == 0;
}

void ControlApi::countRefused(std::string_view target, unsigned status) {
  RequestTarget t;
  parseTarget(target, &t);
  metrics_.httpRequests(routeTemplate(t.path), status).Increment();
}

void ControlApi::handle(Request&& request, const RequestInfo& info, Reply reply) {
  RequestTarget t;
  t.error = parseTarget(request.target(), &t);
  const std::string route = routeTemplate(t.path);
  // Count every reply by route template and status.
  Reply counted = [this, route, reply = std::move(reply)](Response r) {
    metrics_.httpRequests(route, static_cast<unsigned>(r.result_int())).Increment();
    reply(std::move(r));
  };
  bool replied = false;
  Response r;
  try {
    r = this->route(request, t, info, counted, replied);
  } catch (const std::exception& e) {  // a bug, never the client's fault: keep serving
    spdlog::error("request {} {} failed: {}", std::string(request.method_string()),
                  std::string(request.target().substr(0, 200)), e.what());
    r = errorResponse(status::internal_server_error, "internal", "internal error");
  }
  if (!replied) counted(std::move(r));
}

Response ControlApi::route(Request& req, const RequestTarget& t, const RequestInfo& info,
                           Reply& reply, bool& replied) {
  if (!t.error.empty()) return badRequest(t.error);
  const auto method = req.method();
  auto methodNotAllowed = [](const char* allow) {
    Response r = errorResponse(status::method_not_allowed, "method_not_allowed",
                               std::string("allowed: ") + allow);
    r.set(http::field::allow, allow);
    return r;
  };
  const bool admin = info.listener == ListenerKind::kAdmin;
  const bool admin_route =
      t.path == "/healthz" || t.path == "/readyz" || t.path == "/metrics" || t.path == "/v1/status";
  if (admin && !admin_route) {
    return errorResponse(status::not_found, "not_found",
                         "the admin listener serves /healthz, /readyz, /metrics and /v1/status");
  }
  if (!admin && info.tcp && !tokenOk(req)) {
    Response r = errorResponse(status::unauthorized, "unauthenticated",
                               "the TCP control listener needs 'Authorization: Bearer <token>'");
    r.set(http::field::www_authenticate, "Bearer");
    return r;
  }
  if (admin_route) {
    if (method != http::verb::get && method != http::verb::head) return methodNotAllowed("GET");
    if (t.path == "/healthz") return textResponse(status::ok, "ok\n");
    if (t.path == "/readyz") {
      if (stopping_) return textResponse(status::service_unavailable, "stopping\n");
      std::function<std::vector<bool>()> peers;
      {
        std::lock_guard lock(mu_);
        peers = peers_up_;
      }
      if (peers) {
        std::string down;
        const auto up = peers();
        for (size_t r = 0; r < up.size(); ++r) {
          if (!up[r]) down += (down.empty() ? "" : ", ") + std::to_string(r);
        }
        if (!down.empty()) {
          return textResponse(status::service_unavailable,
                              "waiting for peer rank(s) " + down + "\n");
        }
      }
      return textResponse(status::ok, "ready\n");
    }
    if (t.path == "/metrics") {
      metrics_.registered_buffers.Set(static_cast<double>(buffers_.count()));
      return textResponse(status::ok, metrics_.exposition(), "text/plain; version=0.0.4");
    }
    return this->status();
  }
  if (t.path == "/v1/emit_gradient") {
    if (method != http::verb::post) return methodNotAllowed("POST");
    if (stopping_) {
      return errorResponse(status::service_unavailable, "shutting_down",
                           "the sidecar is shutting down");
    }
    const auto type = req[http::field::content_type];
    if (type.rfind("application/json", 0) == 0) return emitShm(req, reply, replied);
    return emitRaw(req, t, reply, replied);
  }
  if (t.path == "/v1/buffers") {
    if (method != http::verb::post) return methodNotAllowed("POST");
    return registerBuffer(req, info);
  }
  if (t.path.rfind("/v1/buffers/", 0) == 0) {
    if (method != http::verb::delete_) return methodNotAllowed("DELETE");
    return releaseBuffer(t.path.substr(std::string_view("/v1/buffers/").size()));
  }
  if (t.path == "/v1/report") {
    if (method != http::verb::post) return methodNotAllowed("POST");
    return report(req);
  }
  if (t.path == "/v1/config") {
    if (method != http::verb::put) return methodNotAllowed("PUT");
    return putConfig(req, info);
  }
  if (t.path == "/v1/checkpoint" || t.path == "/v1/resume") {
    if (method != http::verb::post) return methodNotAllowed("POST");
    return durableState(req, t.path == "/v1/resume");
  }
  return errorResponse(status::not_found, "not_found", "no route " + quoted(t.path));
}

Response ControlApi::emitRaw(Request& req, const RequestTarget& t, Reply& reply, bool& replied) {
  for (const auto& [k, v] : t.query) {
    if (k != "name" && k != "step" && k != "dtype" && k != "shape" && k != "trainer") {
      return badRequest("unknown query parameter " + quoted(k) +
                        " (known: name, step, dtype, shape, trainer)");
    }
  }
  TensorSpec spec;
  auto q = [&](const char* k) -> const std::string* {
    auto it = t.query.find(k);
    return it == t.query.end() ? nullptr : &it->second;
  };
  if (!q("name")) return badRequest("missing query parameter 'name'");
  spec.name = *q("name");
  if (std::string e = checkName(spec.name); !e.empty()) return badRequest(e);
  if (!q("step")) return badRequest("missing query parameter 'step'");
  if (!parseU64(*q("step"), &spec.step)) {
    return badRequest("query parameter 'step' must be an unsigned integer, got " +
                      quoted(*q("step")));
  }
  if (const std::string* d = q("dtype")) {
    auto dt = kernels::parseDType(*d);
    if (!dt) {
      return badRequest("unknown dtype " + quoted(*d) + " (float32, float16 or bfloat16)");
    }
    spec.dtype = *dt;
  }
  if (const std::string* tr = q("trainer")) {
    uint64_t v = 0;
    if (!parseU64(*tr, &v) || v > 1u << 20) {
      return badRequest("query parameter 'trainer' must be a small unsigned integer, got " +
                        quoted(*tr));
    }
    spec.trainer = static_cast<unsigned>(v);
  } else if (config_.local_trainers > 1) {
    return badRequest("missing query parameter 'trainer': this sidecar serves " +
                      std::to_string(config_.local_trainers) + " local trainers");
  }
  const size_t width = kernels::dtypeSize(spec.dtype);
  const uint64_t body_bytes = req.body().size();
  if (const std::string* sh = q("shape"); sh && !sh->empty()) {
    std::string_view rest = *sh;
    while (true) {
      const size_t comma = rest.find(',');
      uint64_t d = 0;
      if (!parseU64(rest.substr(0, comma), &d)) {
        return badRequest(
            "query parameter 'shape' must be unsigned integers separated by "
            "commas, got " +
            quoted(*sh));
      }
      spec.shape.push_back(d);
      if (spec.shape.size() > kMaxDims) break;
      if (comma == std::string_view::npos) break;
      rest = rest.substr(comma + 1);
    }
    if (std::string e = elementsOf(spec.shape, &spec.elements); !e.empty()) return badRequest(e);
    if (spec.elements > body_bytes / width || spec.elements * width != body_bytes) {
      return badRequest("shape " + quoted(*sh) + " of " + apiDTypeName(spec.dtype) + " needs " +
                        (spec.elements > body_bytes / width
                             ? std::string("more")
                             : std::to_string(spec.elements * width)) +
                        " bytes, the body has " + std::to_string(body_bytes));
    }
  } else {
    if (body_bytes % width != 0) {
      return badRequest("body of " + std::to_string(body_bytes) +
                        " bytes is not a whole number of " + apiDTypeName(spec.dtype) + " values");
    }
    spec.elements = body_bytes / width;
  }
  if (spec.elements == 0) return badRequest("empty tensor: the body holds no values");

  auto body = std::make_shared<std::string>(std::move(req.body()));
  Contribution c;
  c.spec = spec;
  c.data = reinterpret_cast<std::byte*>(body->data());
  c.keep_alive = body;
  replied = true;
  const std::string name = spec.name;
  const uint64_t step = spec.step;
  engine_.submit(std::move(c), [reply, body, name, step](StepOutcome o) {
    if (!o.ok()) return reply(fromOutcome(o));
    Response r{status::ok, 11};
    r.set(http::field::content_type, "application/octet-stream");
    r.set("X-Lightwire-Codec", o.figures.codec);
    r.set("X-Lightwire-Raw-Bytes", std::to_string(o.figures.raw_bytes));
    r.set("X-Lightwire-Wire-Bytes", std::to_string(o.figures.wire_bytes));
    r.set("X-Lightwire-Nonfinite", o.figures.nonfinite ? "1" : "0");
    r.set("X-Lightwire-Mode", o.figures.mode);
    r.set("X-Lightwire-Settings", std::to_string(o.figures.settings));
    r.body() = std::move(*body);
    reply(std::move(r));
  });
  return {};
}

Response ControlApi::emitShm(Request& req, Reply& reply, bool& replied) {
  json::object o;
  if (std::string e = parseObject(req.body(), &o); !e.empty()) return badRequest(e);
  for (const auto& kv : o) {
    const std::string_view k = kv.key();
    if (k != "name" && k != "step" && k != "trainer" && k != "buffer" && k != "offset" &&
        k != "dtype" && k != "shape" && k != "elements") {
      return badRequest("unknown field " + quoted(k));
    }
  }
  TensorSpec spec;
  std::string buffer, dtype = "float32";
  uint64_t offset = 0, trainer = 0, elements = 0;
  bool has_trainer = false, has_elements = false;
  for (std::string e :
       {jsonString(o, "name", true, &spec.name), jsonU64(o, "step", true, &spec.step),
        jsonU64(o, "trainer", false, &trainer, &has_trainer),
        jsonString(o, "buffer", true, &buffer), jsonU64(o, "offset", false, &offset),
        jsonString(o, "dtype", false, &dtype),
        jsonU64(o, "elements", false, &elements, &has_elements)}) {
    if (!e.empty()) return badRequest(e);
  }
  if (std::string e = checkName(spec.name); !e.empty()) return badRequest(e);
  auto dt = kernels::parseDType(dtype);
  if (!dt) return badRequest("unknown dtype " + quoted(dtype) + " (float32, float16 or bfloat16)");
  spec.dtype = *dt;
  if (has_trainer) {
    if (trainer > 1u << 20) return badRequest("field 'trainer' is out of range");
    spec.trainer = static_cast<unsigned>(trainer);
  } else if (config_.local_trainers > 1) {
    return badRequest("missing field 'trainer': this sidecar serves " +
                      std::to_string(config_.local_trainers) + " local trainers");
  }
  if (const json::value* sh = o.if_contains("shape")) {
    if (!sh->is_array()) return badRequest("field 'shape' must be an array of integers");
    for (const auto& d : sh->get_array()) {
      if (d.is_uint64()) {
        spec.shape.push_back(d.get_uint64());
      } else if (d.is_int64() && d.get_int64() >= 0) {
        spec.shape.push_back(static_cast<uint64_t>(d.get_int64()));
      } else {
        return badRequest("field 'shape' must be an array of non-negative integers");
      }
      if (spec.shape.size() > kMaxDims) break;
    }
    if (std::string e = elementsOf(spec.shape, &spec.elements); !e.empty()) return badRequest(e);
    if (has_elements && elements != spec.elements) {
      return badRequest("fields 'shape' and 'elements' disagree");
    }
  } else if (has_elements) {
    spec.elements = elements;
  } else {
    return badRequest("missing field 'shape' (or 'elements')");
  }
  if (spec.elements == 0) return badRequest("empty tensor: 0 elements");
  auto region = buffers_.find(buffer);
  if (!region) {
    return errorResponse(status::not_found, "not_found", "unknown buffer " + quoted(buffer));
  }
  const uint64_t width = kernels::dtypeSize(spec.dtype);
  if (offset % width != 0) {
    return badRequest("offset " + std::to_string(offset) + " is not a multiple of " +
                      std::to_string(width) + " (the size of " + apiDTypeName(spec.dtype) + ")");
  }
  if (spec.elements > region->size() / width || offset > region->size() ||
      spec.elements * width > region->size() - offset) {
    return badRequest("region [" + std::to_string(offset) + ", +" + std::to_string(spec.elements) +
                      " " + apiDTypeName(spec.dtype) + ") lies outside buffer " + buffer + " (" +
                      std::to_string(region->size()) + " bytes)");
  }
  if (!region->stillBacked()) {
    return badRequest("buffer " + buffer + " no longer holds its registered size");
  }
  Contribution c;
  c.spec = spec;
  c.data = region->data() + offset;
  c.still_valid = [region] { return region->stillBacked(); };
  if (std::string_view(region->kind()) != "shm") {
    const uint64_t bytes = spec.elements * width;
    c.fetch = [region, offset, bytes](std::string* why) {
      return region->fetch(offset, bytes, why);
    };
    c.store = [region, offset, bytes](std::string* why) {
      return region->store(offset, bytes, why);
    };
  }
  if (auto cuda = std::dynamic_pointer_cast<ipc::CudaIpcRegion>(region)) {
    // The engine's GPU path reads and writes the trainer's memory in place.
    Contribution::Device d;
    d.ordinal = cuda->deviceOrdinal();
    d.ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(cuda->devicePointer() + offset));
    d.wait = [cuda](void* stream, std::string* why) { return cuda->waitOn(stream, why); };
    c.device = std::move(d);
  }
  c.keep_alive = region;
  replied = true;
  const std::string name = spec.name;
  const uint64_t step = spec.step;
  engine_.submit(std::move(c), [reply, name, step](StepOutcome out) {
    if (!out.ok()) return reply(fromOutcome(out));
    reply(jsonResponse(status::ok, figuresJson(name, step, out.figures)));
  });
  return {};
}

Response ControlApi::bufferLimit(ipc::BufferTable::AddError why, const std::string& error) {
  metrics_
      .limitHits(why == ipc::BufferTable::AddError::kOwnerLimit ? "buffers_per_client" : "buffers")
      .Increment();
  return errorResponse(status::too_many_requests, "limit_reached", error);
}

Response ControlApi::registerBuffer(const Request& req, const RequestInfo& info) {
  json::object o;
  if (std::string e = parseObject(req.body(), &o); !e.empty()) return badRequest(e);
  std::string kind = "shm";
  if (std::string e = jsonString(o, "kind", false, &kind); !e.empty()) return badRequest(e);
  ipc::BufferOwner owner = ipc::BufferOwner::of(info.pid);
  owner.uid = info.uid;
  if (kind == "cuda_ipc") return registerCudaBuffer(o, owner);
  if (kind != "shm") {
    return badRequest("unknown buffer kind " + quoted(kind) + " (known: 'shm', 'cuda_ipc')");
  }
  for (const auto& kv : o) {
    if (kv.key() != "kind" && kv.key() != "name" && kv.key() != "size") {
      return badRequest("unknown field " + quoted(kv.key()) + " for kind 'shm'");
    }
  }
  std::string name;
  uint64_t size = 0;
  for (std::string e : {jsonString(o, "name", true, &name), jsonU64(o, "size", true, &size)}) {
    if (!e.empty()) return badRequest(e);
  }
  ipc::BufferTable::AddError why{};
  std::string error;
  const std::string id = buffers_.add(name, size, owner, &why, &error);
  if (id.empty()) {
    if (why == ipc::BufferTable::AddError::kForbidden) {
      return errorResponse(status::forbidden, "forbidden", error);
    }
    if (why != ipc::BufferTable::AddError::kInvalid) return bufferLimit(why, error);
    return badRequest(error);
  }
  metrics_.registered_buffers.Set(static_cast<double>(buffers_.count()));
  spdlog::debug("registered buffer {} ({} bytes of {})", id, size, name);
  return jsonResponse(status::created, json::object{{"id", id}, {"kind", "shm"}, {"size", size}});
}

Response ControlApi::registerCudaBuffer(const json::object& o, const ipc::BufferOwner& owner) {
  for (const auto& kv : o) {
    const std::string_view k = kv.key();
    if (k != "kind" && k != "name" && k != "size" && k != "handle" && k != "device" &&
        k != "offset" && k != "event") {
      return badRequest("unknown field " + quoted(kv.key()) + " for kind 'cuda_ipc'");
    }
  }
  ipc::CudaIpcSpec spec;
  std::string handle, event;
  bool has_event = false;
  for (std::string e :
       {jsonString(o, "handle", true, &handle), jsonString(o, "device", true, &spec.pci_bus_id),
        jsonU64(o, "size", true, &spec.size), jsonU64(o, "offset", false, &spec.offset),
        jsonString(o, "name", false, &spec.name)}) {
    if (!e.empty()) return badRequest(e);
  }
  if (o.if_contains("event") != nullptr && !o.at("event").is_null()) {
    if (std::string e = jsonString(o, "event", true, &event); !e.empty()) return badRequest(e);
    has_event = true;
  }
  if (!ipc::parseHandleHex(handle, &spec.memory)) {
    return badRequest(
        "field 'handle' must be the 64-byte CUDA IPC memory handle as 128 hex digits");
  }
  if (has_event) {
    ipc::CudaIpcHandle ev;
    if (!ipc::parseHandleHex(event, &ev)) {
      return badRequest(
          "field 'event' must be the 64-byte CUDA IPC event handle as 128 hex digits");
    }
    spec.event = ev;
  }
  if (spec.size == 0) return badRequest("field 'size' must be > 0");
  if (spec.pci_bus_id.empty() || spec.pci_bus_id.size() > 64) {
    return badRequest("field 'device' must be the GPU's PCI bus id, e.g. \"0000:3b:00.0\"");
  }
  if (spec.name.size() > 256) return badRequest("field 'name' is longer than 256 bytes");
  std::shared_ptr<ipc::CudaDriver> driver;
  {
    std::lock_guard lock(mu_);
    if (!cuda_) {
      return errorResponse(status::conflict, "failed_precondition",
                           "this sidecar cannot open CUDA IPC handles: " + cuda_why_not_ +
                               "; send host memory (kind 'shm') or an HTTP body instead");
    }
    driver = cuda_;
  }
  std::string error;
  ipc::BufferTable::AddError why{};
  if (!buffers_.hasRoom(owner, &why, &error)) return bufferLimit(why, error);
  // This version stages device buffers through host memory of their size: bounded like a body.
  if (spec.size > config_.limits.max_body_bytes) {
    metrics_.limitHits("body_bytes").Increment();
    return errorResponse(status::payload_too_large, "too_large",
                         "a CUDA IPC buffer of " + std::to_string(spec.size) +
                             " bytes exceeds limits.max_body_bytes (" +
                             std::to_string(config_.limits.max_body_bytes) +
                             "): register smaller ranges (one per gradient bucket)");
  }
  auto region = ipc::CudaIpcRegion::open(driver, spec, &error);
  if (!region) return badRequest(error);
  const std::string label = region->name();
  const int ordinal = region->deviceOrdinal();
  const std::string id = buffers_.insert(std::move(region), owner, &why, &error);
  if (id.empty()) return bufferLimit(why, error);
  metrics_.registered_buffers.Set(static_cast<double>(buffers_.count()));
  spdlog::debug("registered CUDA IPC buffer {} ({} bytes on GPU {} = {})", id, spec.size, ordinal,
                spec.pci_bus_id);
  return jsonResponse(status::created, json::object{{"id", id},
                                                    {"kind", "cuda_ipc"},
                                                    {"size", spec.size},
                                                    {"device", spec.pci_bus_id},
                                                    {"name", label}});
}

Response ControlApi::releaseBuffer(const std::string& id) {
  if (!buffers_.remove(id)) {
    return errorResponse(status::not_found, "not_found", "unknown buffer " + quoted(id));
  }
  metrics_.registered_buffers.Set(static_cast<double>(buffers_.count()));
  metrics_.buffersReleased("client").Increment();
  return jsonResponse(status::ok, json::object{});
}

size_t ControlApi::releaseExitedOwners() {
  const auto released = buffers_.releaseExited();
  if (released.empty()) return 0;
  for (const auto& b : released) {
    spdlog::warn("released buffer {} ({}, {} bytes of {}): process {} that registered it exited",
                 b.id, b.kind, b.size, b.name, b.pid);
  }
  metrics_.buffersReleased("owner_exited").Increment(static_cast<double>(released.size()));
  metrics_.registered_buffers.Set(static_cast<double>(buffers_.count()));
  return released.size();
}

Response ControlApi::report(const Request& req) {
  json::object o;
  if (std::string e = parseObject(req.body(), &o); !e.empty()) return badRequest(e);
  uint64_t step = 0, trainer = 0, fallbacks = 0;
  bool has_trainer = false, has_fallbacks = false;
  for (std::string e :
       {jsonU64(o, "step", true, &step), jsonU64(o, "trainer", false, &trainer, &has_trainer),
        jsonU64(o, "fallbacks", false, &fallbacks, &has_fallbacks)}) {
    if (!e.empty()) return badRequest(e);
  }
  json::object kept{{"step", step}};
  if (has_trainer) kept["trainer"] = trainer;
  for (const auto& kv : o) {
    const std::string_view k = kv.key();
    if (k == "step" || k == "trainer" || k == "fallbacks") continue;
    if (k.size() > 64 || !kv.value().is_number()) {
      return badRequest("report field " + quoted(k) + " must be a number (name up to 64 bytes)");
    }
    const double v = kv.value().to_number<double>();
    if (!std::isfinite(v)) return badRequest("report field " + quoted(k) + " must be finite");
    if (kept.size() >= 16) return badRequest("at most 16 report fields");
    kept[k] = v;
  }
  if (fallbacks > 1000000) return badRequest("field 'fallbacks' is out of range");
  if (has_fallbacks && fallbacks > 0) {
    metrics_.fallbacks.Increment(static_cast<double>(fallbacks));
    spdlog::warn("a trainer reports {} step(s) fallen back to its process group (step {})",
                 fallbacks, step);
  }
  if (policy_) {
    if (const auto* loss = kept.if_contains("loss")) policy_->reportLoss(step, loss->as_double());
  }
  std::lock_guard lock(mu_);
  last_report_ = std::move(kept);
  return jsonResponse(status::ok, json::object{});
}

Response ControlApi::durableState(const Request& req, bool resume) {
  json::object o;
  if (std::string e = parseObject(req.body(), &o); !e.empty()) return badRequest(e);
  uint64_t step = 0;
  if (std::string e = jsonU64(o, "step", true, &step); !e.empty()) return badRequest(e);
  for (const auto& kv : o) {
    if (kv.key() != "step")
      return badRequest("unknown field " + quoted(kv.key()) + " (known: step)");
  }
  if (config_.state.dir.empty()) {
    return errorResponse(status::conflict, "failed_precondition",
                         "this sidecar keeps no durable state (state.dir is \"\")");
  }
  if (resume) {
    if (auto st = engine_.resume(step); !st.isOk()) {
      const bool missing = st.message().find("No such file") != std::string::npos;
      return errorResponse(missing ? status::not_found : status::conflict,
                           missing ? "not_found" : "failed_precondition",
                           "resume from step " + std::to_string(step) + ": " + st.message());
    }
    std::function<void()> after;
    {
      std::lock_guard lock(mu_);
      after = after_resume_;
    }
    if (after) after();  // the other sidecars resume too (docs/policies.md)
    return jsonResponse(status::ok, json::object{{"step", step}, {"next_step", step + 1}});
  }
  auto path = engine_.checkpoint(step);
  if (!path) {
    const bool late = path.status().code() == StatusCode::kFailedPrecondition;
    return errorResponse(
        late ? status::conflict : status::internal_server_error, late ? "conflict" : "internal",
        "checkpoint of step " + std::to_string(step) + ": " + path.status().message());
  }
  json::object r{{"step", step}, {"path", *path}};
  r["peers"] =
      config_.peer.world_size > 1 ? "asked: they save with the next step" : "none (world size 1)";
  return jsonResponse(status::ok, r);
}

Response ControlApi::putConfig(const Request& req, const RequestInfo& /*info*/) {
  if (!tokenOk(req)) {
    Response r = errorResponse(status::unauthorized, "unauthenticated",
                               "PUT /v1/config needs 'Authorization: Bearer <token>'");
    r.set(http::field::www_authenticate, "Bearer");
    return r;
  }
  boost::system::error_code ec;
  json::parse_options opts;
  opts.max_depth = 16;
  const json::value v = json::parse(req.body(), ec, {}, opts);
  if (ec) return badRequest("malformed JSON body: " + ec.message());
  auto c = compressionFromJson(v);
  if (!c) return badRequest(c.status().message());
  auto shared = std::make_shared<const CompressionConfig>(std::move(*c));
  if (policy_) {
    // The settings travel with this sidecar's next step to every sidecar and take effect, on all
    // of them alike, at the step after it (docs/policies.md "Settings versions and rollback").
    const uint64_t id = policy_->proposeSettings(json::serialize(toJson(*shared)));
    {
      std::lock_guard lock(mu_);
      compression_ = shared;
    }
    spdlog::info(
        "compression settings proposed through PUT /v1/config (default codec {}): they "
        "take effect on every sidecar after this sidecar's next step",
        shared->default_codec.name);
    return jsonResponse(status::accepted,
                        json::object{{"applied", false},
                                     {"proposal", id},
                                     {"takes_effect",
                                      "at the step after this sidecar's next exchanged step, on "
                                      "every sidecar (see policies.settings in /v1/status)"}});
  }
  engine_.setChooser(chooserFor(shared));
  {
    std::lock_guard lock(mu_);
    compression_ = shared;
  }
  spdlog::info("compression settings replaced through PUT /v1/config (default codec {})",
               shared->default_codec.name);
  return jsonResponse(status::ok, json::object{{"applied", true}});
}

Response ControlApi::status() {
  json::object o;
  o["version"] = LIGHTWIRE_VERSION;
  o["uptime_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  json::object cfg;
  {
    std::lock_guard lock(mu_);
    ServeConfig current = config_;
    current.compression = *compression_;
    cfg = toJson(current);
    json::object l;
    l["control_socket"] = listeners_.control_socket;
    l["control_tcp_port"] = listeners_.control_tcp_port ? json::value(*listeners_.control_tcp_port)
                                                        : json::value(nullptr);
    l["admin_port"] =
        listeners_.admin_port ? json::value(*listeners_.admin_port) : json::value(nullptr);
    o["listeners"] = std::move(l);
    o["last_report"] = last_report_;
  }
  o["config"] = std::move(cfg);
  o["world_size"] = config_.peer.world_size;
  o["rank"] = config_.peer.rank;
  {
    std::function<std::vector<bool>()> peers;
    {
      std::lock_guard lock(mu_);
      peers = peers_up_;
    }
    json::array up;
    if (peers) {
      for (bool b : peers()) up.push_back(b);
    }
    o["peers_up"] = std::move(up);
  }
  {
    std::function<json::value()> tls;
    {
      std::lock_guard lock(mu_);
      tls = peer_tls_;
    }
    o["peer_tls"] = tls ? tls() : json::value(nullptr);
  }
  o["local_trainers"] = config_.local_trainers;
  o["tensors"] = engine_.tensorsJson();
  json::array bufs;
  for (const auto& b : buffers_.list()) {
    json::object entry{{"id", b.id}, {"name", b.name}, {"size", b.size}, {"kind", b.kind}};
    if (b.pid > 0) entry["pid"] = b.pid;
    bufs.push_back(std::move(entry));
  }
  o["buffers"] = std::move(bufs);
  o["steps"] = json::object{{"ok", engine_.stepsOk()}, {"failed", engine_.stepsFailed()}};
  if (policy_) o["policies"] = policy_->statusJson();
  {
    std::lock_guard lock(mu_);
    json::object cuda{{"available", cuda_ != nullptr}};
    if (cuda_) {
      cuda["driver_version"] = cuda_->version();
      json::array devices;
      for (const auto& d : cuda_->devices()) {
        devices.push_back(
            json::object{{"ordinal", d.ordinal}, {"name", d.name}, {"pci_bus_id", d.pci_bus_id}});
      }
      cuda["devices"] = std::move(devices);
    } else {
      cuda["why_not"] = cuda_why_not_;
    }
    o["cuda"] = std::move(cuda);
  }
  return jsonResponse(status::ok, o);
}

}  // namespace lightwire::proxy
