// Target `http`: the control API (docs/api.md), every route, in process, through the handler the
// server uses: a keep-alive stream of requests parsed with Beast's request_parser<string_body>
// under the server's header and body limits (proxy/server/http_server.cc: a parse error ends the
// connection and is counted through ControlApi::countRefused), each complete request handed to
// ControlApi::handle of a sidecar set up as `serve` sets one up (proxy/server/serve.cc): world size
// 1, one or two local trainers (so steps complete in process), a policy engine, durable state in a
// scratch directory, a registered-buffer table, and a shared-memory segment
// "/lightwire-fuzz-http" (64 KiB) that requests may register. Every input gets a fresh sidecar.
//
// Each reply must be a complete HTTP response; an error reply is JSON {"error", "message"}.
// The id of the last buffer registered replaces "$ID" in later targets and bodies (ids are
// random per sidecar), so that steps on registered buffers and their release are reachable.
//
// Input: u8 setup (bit 0: two local trainers, bit 1: a bearer token "fuzz-token", bit 2: the
// admin listener, bit 3: over TCP, bit 4: no policy engine), then the bytes of the connection.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <boost/asio/buffer.hpp>
#include <boost/beast/http.hpp>
#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <condition_variable>
#include <mutex>

#include "ipc/shm_region.h"
#include "metrics/metrics.h"
#include "proxy/config/config.h"
#include "proxy/server/control_api.h"
#include "proxy/server/http_server.h"
#include "proxy/server/layout.h"
#include "proxy/step/engine.h"
#include "tests/fuzz/peer_bodies.h"
#include "tests/fuzz/targets.h"

namespace lightwire::fuzz::http {
namespace {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using proxy::Request;
using proxy::Response;

constexpr uint8_t kTwoTrainers = 1, kToken = 2, kAdmin = 4, kTcp = 8, kNoPolicy = 16;
constexpr size_t kMaxRequests = 32;
constexpr std::string_view kSegment = "/lightwire-fuzz-http";
constexpr size_t kSegmentBytes = 64 << 10;
constexpr std::string_view kIdPlaceholder = "$ID";

/// The shared-memory segment requests may register (created once, zeroed for every input).
class Segment {
 public:
  Segment() {
    const std::string name(kSegment);
    fd_ = ::shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd_ < 0 || ::ftruncate(fd_, kSegmentBytes) != 0) fail("cannot create " + name);
    void* p = ::mmap(nullptr, kSegmentBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) fail("cannot map " + name);
    data_ = static_cast<uint8_t*>(p);
  }
  ~Segment() {
    ::munmap(data_, kSegmentBytes);
    ::close(fd_);
    ::shm_unlink(std::string(kSegment).c_str());
  }
  void zero() { std::memset(data_, 0, kSegmentBytes); }

 private:
  int fd_ = -1;
  uint8_t* data_ = nullptr;
};

/// Replies as the server would write them, in order of arrival (they may come from the engine).
struct Replies {
  std::mutex mu;
  std::vector<Response> got;
  void add(Response r) {
    std::lock_guard lock(mu);
    got.push_back(std::move(r));
  }
};

void checkReply(Response& r) {
  r.prepare_payload();
  const unsigned status = r.result_int();
  check(status >= 200 && status < 600, "a reply with status " + std::to_string(status));
  const bool json = r[bhttp::field::content_type].starts_with("application/json");
  check(status < 400 || json, "an error reply that is not JSON: " + r.body().substr(0, 200));
  if (!json) return;
  const std::string bad = jsonError(r.body());
  check(bad.empty(), "a JSON reply that does not parse: " + bad);
  if (status < 400) return;
  const boost::json::value v = boost::json::parse(r.body());
  check(v.is_object() && v.as_object().contains("error") && v.as_object().contains("message"),
        "an error reply that is not {\"error\", \"message\"}: " + r.body().substr(0, 200));
}

void replaceAll(std::string& s, std::string_view what, const std::string& with) {
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + with.size())) {
    s.replace(at, what.size(), with);
  }
}

/// A sidecar in process, as proxy/server/serve.cc builds one (world size 1).
struct Sidecar {
  explicit Sidecar(uint8_t setup)
      : config(configFor(setup)),
        policy(setup & kNoPolicy ? nullptr : fuzzPolicy()),
        buffers(static_cast<size_t>(config.limits.max_buffers),
                static_cast<size_t>(config.limits.max_buffers_per_client)),
        engine(
            engineOptions(config, policy.get()),
            proxy::chooserFor(std::make_shared<const proxy::CompressionConfig>(config.compression)),
            metrics, exchange),
        api(config, metrics, buffers, engine, policy.get()) {}
  ~Sidecar() { engine.shutdown(); }

  static proxy::ServeConfig configFor(uint8_t setup) {
    proxy::ServeConfig c;
    c.job_id = std::string(kJob);
    c.local_trainers = (setup & kTwoTrainers) ? 2 : 1;
    c.threads = 1;
    c.gpu = false;
    if (setup & kToken) c.token = "fuzz-token";
    c.limits.max_buffers = 8;
    c.limits.max_buffers_per_client = 4;
    c.limits.max_pending_steps = 16;
    c.state.dir = ScratchDir::get().path();
    c.state.checkpoint_every = 3;
    c.compression.chunk_elements = 1024;
    return c;
  }
  static proxy::EngineOptions engineOptions(const proxy::ServeConfig& c,
                                            policies::PolicyEngine* policy) {
    proxy::EngineOptions o;
    o.local_trainers = static_cast<unsigned>(c.local_trainers);
    o.threads = 1;
    o.gpu = false;
    o.chunk_elements = c.compression.chunk_elements;
    o.step_timeout = std::chrono::seconds(60);  // never within an input: shutdown answers them
    o.max_pending_steps = static_cast<size_t>(c.limits.max_pending_steps);
    o.seed = 7;
    o.checksum_every = c.peer.checksum_every;
    o.policy = policy;
    o.settings = [](uint64_t, const std::string& json) -> proxy::CodecChooser {
      boost::system::error_code ec;
      const auto v = boost::json::parse(json, ec);
      if (ec) return nullptr;
      auto parsed = proxy::compressionFromJson(v);
      if (!parsed) return nullptr;
      return proxy::chooserFor(
          std::make_shared<const proxy::CompressionConfig>(std::move(*parsed)));
    };
    o.state_dir = c.state.dir;
    o.job_id = c.job_id;
    o.checkpoint_every = c.state.checkpoint_every;
    return o;
  }

  proxy::ServeConfig config;
  std::unique_ptr<policies::PolicyEngine> policy;
  metrics::Metrics metrics;
  ipc::BufferTable buffers;
  proxy::LocalExchange exchange;
  proxy::StepEngine engine;
  proxy::ControlApi api;
};

/// The id in a 201 reply to POST /v1/buffers, or "".
std::string registeredId(const Response& r) {
  if (r.result_int() != 201) return "";
  boost::system::error_code ec;
  const boost::json::value v = boost::json::parse(r.body(), ec);
  if (ec || !v.is_object()) return "";
  const auto* id = v.as_object().if_contains("id");
  return id && id->is_string() ? std::string(id->as_string()) : "";
}

}  // namespace

int run(const uint8_t* data, size_t size) {
  static Segment segment;
  segment.zero();
  ScratchDir::get().clear();
  Reader in(data, size);
  const uint8_t setup = in.u8();
  std::string_view rest = textOf(in.rest());
  auto replies = std::make_shared<Replies>();
  {
    Sidecar sidecar(setup);
    proxy::RequestInfo info;
    info.listener = (setup & kAdmin) ? proxy::ListenerKind::kAdmin : proxy::ListenerKind::kControl;
    info.tcp = (setup & kTcp) != 0;
    info.pid = info.tcp ? 0 : static_cast<int>(::getpid());
    std::string id;
    for (size_t n = 0; n < kMaxRequests && !rest.empty(); ++n) {
      bhttp::request_parser<bhttp::string_body> parser;
      parser.header_limit(static_cast<uint32_t>(sidecar.config.limits.max_header_bytes));
      parser.body_limit(sidecar.config.limits.max_body_bytes);
      parser.eager(true);
      beast::error_code ec;
      while (!parser.is_done()) {
        const size_t used = parser.put(boost::asio::buffer(rest.data(), rest.size()), ec);
        rest.remove_prefix(used);
        if (ec == bhttp::error::need_more) ec = {};
        if (ec) break;
        if (used == 0) {  // the connection ends here
          parser.put_eof(ec);
          break;
        }
      }
      if (ec || !parser.is_done()) {
        // The server answers 431, 413 or 400 (or nothing, for a cut request) and closes.
        const unsigned status = ec == bhttp::error::header_limit ? 431
                                : ec == bhttp::error::body_limit ? 413
                                                                 : 400;
        const std::string target =
            parser.is_header_done() ? std::string(parser.get().target()) : std::string();
        if (ec) sidecar.api.countRefused(target, status);
        break;
      }
      Request req = parser.release();
      const bool keep_alive = req.keep_alive();
      if (!id.empty()) {
        std::string target(req.target());
        replaceAll(target, kIdPlaceholder, id);
        req.target(target);
        replaceAll(req.body(), kIdPlaceholder, id);
      }
      const size_t before = [&] {
        std::lock_guard lock(replies->mu);
        return replies->got.size();
      }();
      sidecar.api.handle(std::move(req), info,
                         [replies](Response r) { replies->add(std::move(r)); });
      {
        std::lock_guard lock(replies->mu);
        for (size_t i = before; i < replies->got.size(); ++i) {
          if (auto got = registeredId(replies->got[i]); !got.empty()) id = got;
        }
      }
      if (!keep_alive) break;
    }
  }  // the engine shuts down: steps still waiting for a trainer are answered
  std::lock_guard lock(replies->mu);
  for (auto& r : replies->got) checkReply(r);
  return 0;
}

namespace {

std::string request(std::string_view method, std::string_view target, std::string_view body = "",
                    std::string_view type = "application/json", std::string_view extra = "") {
  std::string r =
      std::string(method) + " " + std::string(target) + " HTTP/1.1\r\nHost: lightwire\r\n";
  if (!body.empty() || method == "POST" || method == "PUT") {
    r += "Content-Type: " + std::string(type) +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  r += std::string(extra) + "\r\n" + std::string(body);
  return r;
}

std::string floats(std::initializer_list<float> v) {
  return {reinterpret_cast<const char*>(std::data(v)), v.size() * sizeof(float)};
}

std::vector<uint8_t> seed(uint8_t setup, const std::vector<std::string>& requests) {
  Writer w;
  w.u8(setup);
  for (const auto& r : requests) w.bytes(r);
  return w.take();
}

}  // namespace

void seeds(Seeds& out) {
  const std::string raw = "application/octet-stream";
  const std::string body4 = floats({1.0f, -2.0f, 0.5f, 3.0f});
  out.emplace_back("probes", seed(0, {request("GET", "/healthz"), request("GET", "/readyz"),
                                      request("HEAD", "/healthz"), request("GET", "/metrics"),
                                      request("GET", "/v1/status")}));
  out.emplace_back("admin",
                   seed(kAdmin | kTcp, {request("GET", "/v1/status"), request("GET", "/metrics"),
                                        request("POST", "/v1/report", "{}")}));
  out.emplace_back(
      "emit_raw",
      seed(0, {request("POST", "/v1/emit_gradient?name=w&step=1&shape=2,2", body4, raw),
               request("POST", "/v1/emit_gradient?name=w&step=2&dtype=float32", body4, raw),
               request("GET", "/v1/status")}));
  // A bucket's layout inline (docs/api.md "Form 1: raw body"), then by its hash.
  const std::string layout =
      R"([{"name":"a.weight","offset":0,"shape":[3]},{"name":"a.bias","offset":3,"shape":[1]}])";
  proxy::Layout parsed;
  if (!proxy::parseLayoutText(layout, 4, "bucket.a", &parsed).empty()) fail("the seed's layout");
  out.emplace_back("emit_raw_layout",
                   seed(0, {request("POST",
                                    "/v1/emit_gradient?name=bucket.a&step=1&layout_bytes=" +
                                        std::to_string(layout.size()),
                                    layout + body4, raw),
                            request("POST",
                                    "/v1/emit_gradient?name=bucket.a&step=2&layout_hash=" +
                                        proxy::layoutHashText(parsed.hash),
                                    body4, raw),
                            request("GET", "/v1/status")}));
  out.emplace_back("emit_half",
                   seed(0, {request("POST", "/v1/emit_gradient?name=h&step=1&dtype=float16",
                                    std::string("\x00\x3c\x00\xc0\x00\x38\x00\x42", 8), raw),
                            request("POST", "/v1/emit_gradient?name=b&step=1&dtype=bfloat16",
                                    std::string("\x80\x3f\x00\xc0\x00\x3f\x40\x40", 8), raw)}));
  out.emplace_back(
      "emit_two_trainers",
      seed(kTwoTrainers,
           {request("POST", "/v1/emit_gradient?name=w&step=1&trainer=0", body4, raw),
            request("POST", "/v1/emit_gradient?name=w&step=1&trainer=1", body4, raw),
            request("POST", "/v1/emit_gradient?name=w&step=2&trainer=1", body4, raw)}));
  const std::string reg =
      R"({"kind": "shm", "name": ")" + std::string(kSegment) + R"(", "size": 4096})";
  out.emplace_back(
      "buffers",
      seed(0, {request("POST", "/v1/buffers", reg),
               request("POST", "/v1/emit_gradient",
                       R"({"name": "bucket.0", "step": 1, "trainer": 0, "buffer": "$ID", )"
                       R"("offset": 0, "dtype": "float32", "shape": [256]})"),
               request("POST", "/v1/emit_gradient",
                       R"({"name": "bucket.0", "step": 2, "buffer": "$ID", "offset": 1024, )"
                       R"("dtype": "bfloat16", "elements": 512})"),
               request("GET", "/v1/status"), request("DELETE", "/v1/buffers/$ID")}));
  out.emplace_back(
      "cuda_ipc", seed(0, {request("POST", "/v1/buffers",
                                   R"({"kind": "cuda_ipc", "handle": ")" + std::string(128, 'a') +
                                       R"(", "device": "0000:3b:00.0", "offset": 0, "size": 4096, )"
                                       R"("event": ")" +
                                       std::string(128, '0') + R"(", "name": "bucket.0"})")}));
  out.emplace_back("report",
                   seed(0, {request("POST", "/v1/report",
                                    R"({"step": 12, "trainer": 0, "loss": 0.731, "reward": -41.5, )"
                                    R"("fallbacks": 1})")}));
  // Losses at the ends of the doubles feed the loss baseline (it must stay finite: the status
  // and the policy state are JSON).
  std::vector<std::string> losses;
  for (int s = 1; s <= 4; ++s) {
    losses.push_back(request("POST", "/v1/report",
                             "{\"step\": " + std::to_string(s) +
                                 ", \"loss\": " + (s % 2 ? "1.7e308" : "-1.7e308") + "}"));
    losses.push_back(
        request("POST", "/v1/emit_gradient?name=w&step=" + std::to_string(s), body4, raw));
  }
  losses.push_back(request("GET", "/v1/status"));
  out.emplace_back("report_huge_losses", seed(0, losses));
  const std::string cfg =
      R"({"default": {"codec": "dgc", "density": 0.01, "momentum": 0.9}, )"
      R"("rules": [{"pattern": "*.bias", "codec": "none"}, {"max_elements": 4096, "codec": "qsgd", "bits": 4}]})";
  out.emplace_back(
      "config", seed(kToken, {request("PUT", "/v1/config", cfg, "application/json",
                                      "Authorization: Bearer fuzz-token\r\n"),
                              request("POST", "/v1/emit_gradient?name=w.bias&step=1", body4, raw),
                              request("POST", "/v1/emit_gradient?name=w&step=2", body4, raw)}));
  out.emplace_back(
      "config_no_policy",
      seed(kNoPolicy, {request("PUT", "/v1/config", cfg),
                       request("POST", "/v1/emit_gradient?name=w&step=1", body4, raw)}));
  out.emplace_back("checkpoint_resume",
                   seed(0, {request("POST", "/v1/emit_gradient?name=w&step=1", body4, raw),
                            request("POST", "/v1/checkpoint", R"({"step": 1})"),
                            request("POST", "/v1/emit_gradient?name=w&step=2", body4, raw),
                            request("POST", "/v1/resume", R"({"step": 1})"),
                            request("POST", "/v1/emit_gradient?name=w&step=2", body4, raw)}));
  out.emplace_back("tcp_token",
                   seed(kTcp | kToken, {request("GET", "/v1/status", "", "",
                                                "Authorization: Bearer fuzz-token\r\n"),
                                        request("GET", "/v1/status")}));
  out.emplace_back(
      "http_features",
      seed(0, {request("POST", "/v1/report", "", "application/json", "Expect: 100-continue\r\n"),
               "POST /v1/report HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
               "Content-Type: application/json\r\n\r\n5\r\n{\"ste\r\nd\r\np\": 1, "
               "\"loss\"\r\n4\r\n: 1}\r\n0\r\n\r\n",
               request("GET", "/v1/st%61tus?x=1"), request("DELETE", "/v1/buffers/b-1"),
               // Found by fuzzing: an error message quoting bytes that are not UTF-8.
               request("GET", "/v1/\xfe\xff%C3?name=\xe9"), "GET /healthz HTTP/1.0\r\n\r\n"}));
}

}  // namespace lightwire::fuzz::http
