#pragma once
// The routes of docs/api.md on top of HttpServer: parameter checks, buffers, steps, reports,
// settings, status. Every bad request gets a JSON error and changes nothing. Also the handler the
// fuzz targets drive in process.

#include <boost/json/object.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ipc/cuda_driver.h"
#include "ipc/shm_region.h"
#include "metrics/metrics.h"
#include "policies/policy.h"
#include "proxy/config/config.h"
#include "proxy/server/http_server.h"
#include "proxy/server/layout.h"
#include "proxy/step/engine.h"

namespace lightwire::proxy {

/// The HTTP status and the error code (docs/api.md "Errors") a step error is answered with.
struct ApiError {
  unsigned status;
  const char* code;
};
ApiError apiError(StepError error);

/// Where the listeners ended up (ports chosen by the system are known only after binding).
struct BoundListeners {
  std::string control_socket;
  std::optional<uint16_t> control_tcp_port, admin_port;
};

/// The chooser of a compression section: the first matching rule, else the default.
CodecChooser chooserFor(std::shared_ptr<const CompressionConfig> c);

struct RequestTarget;  // a request's path and query parameters, parsed once (control_api.cc)

/// Serves the control and admin routes. Thread-safe.
class ControlApi {
 public:
  /// `policy` (may be null): PUT /v1/config proposes settings to every sidecar through it, and
  /// reported losses and rewards feed it.
  ControlApi(ServeConfig config, metrics::Metrics& metrics, ipc::BufferTable& buffers,
             StepEngine& engine, policies::PolicyEngine* policy = nullptr);

  /// The HttpServer handler.
  void handle(Request&& request, const RequestInfo& info, Reply reply);
  /// Counts a request the HttpServer refused itself (its onRefused hook).
  void countRefused(std::string_view target, unsigned status);
  /// The HttpServer's check of a request's headers, before its body is read or reserved
  /// (docs/RELIABILITY.md "Overload"): the admin listener takes no bodies (413); the TCP control
  /// listener with a token refuses a body sent without it (401; a request without a body gets its
  /// 401 from the route); a request with the right token marks its connection trusted (never
  /// evicted for a new one).
  HeaderVerdict checkHeader(const Request& header, const RequestInfo& info, bool has_body) const;
  void setListeners(BoundListeners l);
  /// After SIGTERM: /readyz answers 503, new steps are refused.
  void setStopping() { stopping_ = true; }
  /// Where the peers stand (world size > 1): one entry per rank, true when connected (this
  /// rank's own entry is true). /readyz is 503 until all are, and /v1/status lists them.
  void setPeers(std::function<std::vector<bool>()> peers_up);
  /// What /v1/status shows as "peer_tls" (this node's peer TLS certificate; null without TLS).
  void setPeerTls(std::function<boost::json::value()> info);
  /// The CUDA driver, when loaded (else null and why): /v1/status and `cuda_ipc` buffers.
  void setCuda(std::shared_ptr<ipc::CudaDriver> driver, std::string why_not);
  /// Called after a successful POST /v1/resume (tells the other sidecars).
  void setAfterResume(std::function<void()> after);
  /// Called before each /metrics exposition, to set gauges read from parts the API does not own
  /// (the buffer pools of the transport and the HTTP server).
  void setBeforeScrape(std::function<void()> before);
  /// Releases the buffers of trainers that exited without releasing them (logged, counted in
  /// lightwire_buffers_released_total{reason="owner_exited"}); returns how many. Call it
  /// periodically (serve does, every second).
  size_t releaseExitedOwners();

 private:
  /// What a route's handler is given.
  struct RouteCall {
    Request& req;
    const RequestTarget& target;
    const RequestInfo& info;
    Reply& reply;  // for a reply after the step (set `replied`, return an empty Response)
    bool& replied;
  };
  struct Route {
    std::string_view path;  // a template: "{id}" matches the rest of the path
    http::verb method;      // GET routes answer HEAD too
    bool admin;             // the admin listener serves it too
    Response (ControlApi::*handler)(RouteCall&);
  };
  /// The route table (control_api.cc) and the route of a path (null: none).
  static const std::vector<Route>& routes();
  static const Route* findRoute(std::string_view path);
  /// The route template of a path, for metric labels (a bounded set: the templates, "other").
  static std::string routeTemplate(std::string_view path);

  /// `route`: the table's row for t.path (null: none).
  Response route(Request& req, const RequestTarget& t, const Route* route, const RequestInfo& info,
                 Reply& reply, bool& replied);
  Response healthz(RouteCall& call);
  Response readyz(RouteCall& call);
  Response metricsText(RouteCall& call);
  Response statusRoute(RouteCall& call);
  Response emitGradient(RouteCall& call);
  Response emitRaw(Request& req, const RequestTarget& t, Reply& reply, bool& replied);
  Response emitShm(Request& req, Reply& reply, bool& replied);
  Response registerBuffer(RouteCall& call);
  Response registerCudaBuffer(const boost::json::object& o, const ipc::BufferOwner& owner);
  /// The 429 reply to a registration refused for room, counted as a limit hit.
  Response bufferLimit(ipc::BufferTable::AddError why, const std::string& error);
  Response releaseBuffer(RouteCall& call);
  Response report(RouteCall& call);
  /// POST /v1/cancel (docs/api.md "Buckets in flight").
  Response cancelRoute(RouteCall& call);
  Response putConfig(RouteCall& call);
  Response checkpointRoute(RouteCall& call);
  Response resumeRoute(RouteCall& call);
  Response durableState(const Request& req, bool resume);
  Response status();
  bool tokenOk(const Request& req) const;

  const ServeConfig config_;
  metrics::Metrics& metrics_;
  ipc::BufferTable& buffers_;
  StepEngine& engine_;
  policies::PolicyEngine* const policy_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;
  BoundListeners listeners_;
  std::function<std::vector<bool>()> peers_up_;
  std::function<boost::json::value()> peer_tls_;
  std::function<void()> after_resume_;
  std::function<void()> before_scrape_;
  std::shared_ptr<ipc::CudaDriver> cuda_;
  std::string cuda_why_not_ = "not probed";
  std::shared_ptr<const CompressionConfig> compression_;
  LayoutRegistry layouts_;  // the layout each bucket name was first sent with
  boost::json::object last_report_;
};

}  // namespace lightwire::proxy
