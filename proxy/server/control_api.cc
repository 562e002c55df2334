#include "proxy/server/control_api.h"

#include <openssl/crypto.h>
#include <spdlog/spdlog.h>

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <cmath>
#include <limits>
#include <map>

#include "proxy/server/api_util.h"
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
    case StepError::kCancelled:
      return {409, "cancelled"};
  }
  return {500, "internal"};
}

namespace {

namespace json = boost::json;
using http::status;
using namespace api;  // NOLINT(google-build-using-namespace): the routes' shared helpers

/// A template's fixed part: all of it, or what comes before its "{id}".
std::string_view fixedPart(std::string_view path_template) {
  return path_template.substr(0, path_template.find('{'));
}

bool matches(std::string_view path_template, std::string_view path) {
  const std::string_view fixed = fixedPart(path_template);
  return fixed.size() == path_template.size() ? path == fixed : path.rfind(fixed, 0) == 0;
}

}  // namespace

CodecChooser chooserFor(std::shared_ptr<const CompressionConfig> c) {
  return [c = std::move(c)](const TensorFacts& t) {
    const CodecRule* rule = c->ruleFor(t);
    TensorSettings s(rule ? rule->codec : c->default_codec);
    if (rule) {
      s.sync_every = rule->sync_every;
      s.group = rule->group;
    }
    // A layer goes dense where compressing it costs accuracy for little traffic (a rule's
    // sync_every and group stay).
    if (denseLayerReason(c->layers, t, s.codec, rule != nullptr)) s.codec = kernels::CodecConfig{};
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

void ControlApi::setBeforeScrape(std::function<void()> before) {
  std::lock_guard lock(mu_);
  before_scrape_ = std::move(before);
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

HeaderVerdict ControlApi::checkHeader(const Request& header, const RequestInfo& info,
                                      bool has_body) const {
  HeaderVerdict v;
  if (info.listener == ListenerKind::kAdmin) {
    if (has_body) {
      v.refuse = errorResponse(status::payload_too_large, "too_large",
                               "the admin listener accepts no request bodies (it serves GET "
                               "/healthz, /readyz, /metrics and /v1/status)",
                               header.version(), false);
    }
    return v;
  }
  if (!info.tcp || config_.token.empty()) return v;
  if (!tokenOk(header)) {
    if (!has_body) return v;  // answered 401 by the route, on a connection that goes on
    Response r = errorResponse(status::unauthorized, "unauthenticated",
                               "the TCP control listener needs 'Authorization: Bearer <token>'",
                               header.version(), false);
    r.set(http::field::www_authenticate, "Bearer");
    v.refuse = std::move(r);
    return v;
  }
  v.trusted = true;
  return v;
}

/// The routes of docs/api.md: a path template ("{id}" matches the rest of the path), the method
/// (GET routes answer HEAD too), whether the admin listener serves it, and its handler.
const std::vector<ControlApi::Route>& ControlApi::routes() {
  using V = http::verb;
  static const std::vector<Route> table = {
      {"/healthz", V::get, true, &ControlApi::healthz},
      {"/readyz", V::get, true, &ControlApi::readyz},
      {"/metrics", V::get, true, &ControlApi::metricsText},
      {"/v1/status", V::get, true, &ControlApi::statusRoute},
      {"/v1/emit_gradient", V::post, false, &ControlApi::emitGradient},
      {"/v1/buffers", V::post, false, &ControlApi::registerBuffer},
      {"/v1/buffers/{id}", V::delete_, false, &ControlApi::releaseBuffer},
      {"/v1/report", V::post, false, &ControlApi::report},
      {"/v1/cancel", V::post, false, &ControlApi::cancelRoute},
      {"/v1/config", V::put, false, &ControlApi::putConfig},
      {"/v1/checkpoint", V::post, false, &ControlApi::checkpointRoute},
      {"/v1/resume", V::post, false, &ControlApi::resumeRoute},
  };
  return table;
}

const ControlApi::Route* ControlApi::findRoute(std::string_view path) {
  for (const Route& r : routes()) {
    if (matches(r.path, path)) return &r;
  }
  return nullptr;
}

std::string ControlApi::routeTemplate(std::string_view path) {
  const Route* r = findRoute(path);
  return r ? std::string(r->path) : "other";
}

void ControlApi::countRefused(std::string_view target, unsigned status) {
  RequestTarget t;
  parseTarget(target, &t);
  metrics_.httpRequests(routeTemplate(t.path), status).Increment();
}

void ControlApi::handle(Request&& request, const RequestInfo& info, Reply reply) {
  RequestTarget t;
  t.error = parseTarget(request.target(), &t);
  const Route* found = findRoute(t.path);  // looked up once: the dispatch and the metric label
  // Count every reply by route template and status.
  Reply counted = [this, label = std::string(found ? found->path : "other"),
                   reply = std::move(reply)](Response r) {
    metrics_.httpRequests(label, static_cast<unsigned>(r.result_int())).Increment();
    reply(std::move(r));
  };
  bool replied = false;
  Response r;
  try {
    r = this->route(request, t, found, info, counted, replied);
  } catch (const std::exception& e) {  // a bug, never the client's fault: keep serving
    spdlog::error("request {} {} failed: {}", std::string(request.method_string()),
                  std::string(request.target().substr(0, 200)), e.what());
    r = errorResponse(status::internal_server_error, "internal", "internal error");
  }
  if (!replied) counted(std::move(r));
}

Response ControlApi::route(Request& req, const RequestTarget& t, const Route* route,
                           const RequestInfo& info, Reply& reply, bool& replied) {
  if (!t.error.empty()) return badRequest(t.error);
  if (info.listener == ListenerKind::kAdmin && (route == nullptr || !route->admin)) {
    return errorResponse(status::not_found, "not_found",
                         "the admin listener serves /healthz, /readyz, /metrics and /v1/status");
  }
  if (info.listener != ListenerKind::kAdmin && info.tcp && !tokenOk(req)) {
    Response r = errorResponse(status::unauthorized, "unauthenticated",
                               "the TCP control listener needs 'Authorization: Bearer <token>'");
    r.set(http::field::www_authenticate, "Bearer");
    return r;
  }
  if (route == nullptr) {
    return errorResponse(status::not_found, "not_found", "no route " + quote(t.path));
  }
  const auto method = req.method();
  if (method != route->method &&
      !(route->method == http::verb::get && method == http::verb::head)) {
    const std::string allow(http::to_string(route->method));
    Response r =
        errorResponse(status::method_not_allowed, "method_not_allowed", "allowed: " + allow);
    r.set(http::field::allow, allow);
    return r;
  }
  RouteCall call{req, t, info, reply, replied};
  return (this->*(route->handler))(call);
}

Response ControlApi::healthz(RouteCall& /*call*/) { return textResponse(status::ok, "ok\n"); }

Response ControlApi::readyz(RouteCall& /*call*/) {
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
      return textResponse(status::service_unavailable, "waiting for peer rank(s) " + down + "\n");
    }
  }
  return textResponse(status::ok, "ready\n");
}

Response ControlApi::metricsText(RouteCall& /*call*/) {
  metrics_.registered_buffers.Set(static_cast<double>(buffers_.count()));
  std::function<void()> before;
  {
    std::lock_guard lock(mu_);
    before = before_scrape_;
  }
  if (before) before();
  return textResponse(status::ok, metrics_.exposition(), "text/plain; version=0.0.4");
}

Response ControlApi::statusRoute(RouteCall& /*call*/) { return status(); }

Response ControlApi::emitGradient(RouteCall& call) {
  if (stopping_) {
    return errorResponse(status::service_unavailable, "shutting_down",
                         "the sidecar is shutting down");
  }
  const auto type = call.req[http::field::content_type];
  if (type.rfind("application/json", 0) == 0) return emitShm(call.req, call.reply, call.replied);
  return emitRaw(call.req, call.target, call.reply, call.replied);
}

Response ControlApi::checkpointRoute(RouteCall& call) { return durableState(call.req, false); }

Response ControlApi::resumeRoute(RouteCall& call) { return durableState(call.req, true); }

Response ControlApi::report(RouteCall& call) {
  json::object o;
  if (std::string e = parseObject(call.req.body(), &o); !e.empty()) return badRequest(e);
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
      return badRequest("report field " + quote(k) + " must be a number (name up to 64 bytes)");
    }
    const double v = kv.value().to_number<double>();
    if (!std::isfinite(v)) return badRequest("report field " + quote(k) + " must be finite");
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
    if (const auto* reward = kept.if_contains("reward")) {
      policy_->reportReward(step, reward->as_double());
    }
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
      return badRequest("unknown field " + quote(kv.key()) + " (known: step)");
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

Response ControlApi::putConfig(RouteCall& call) {
  const Request& req = call.req;
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
  o["streams"] = engine_.streamsJson();
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
