// The control API over real sockets (proxy/server/control_api.h on proxy/server/http_server.h): the
// whole stack runs in process on an io_context with two threads; a small blocking Beast client
// talks to it over the Unix socket and TCP. Every error reply is checked for its status, its JSON
// shape and for changing nothing.
#include <doctest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/buffer.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "ipc/shm_region.h"
#include "metrics/metrics.h"
#include "proxy/config/config.h"
#include "proxy/server/control_api.h"
#include "proxy/server/http_server.h"
#include "proxy/server/layout.h"
#include "proxy/step/engine.h"
#include "proxy/version.h"
#include "tests/temp_dir.h"

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace json = boost::json;
using namespace lightwire;
using namespace lightwire::proxy;

namespace {

constexpr int kTimeoutMs = 5000;

/// A blocking byte stream over a socket fd for Beast's sync API; every wait is bounded by poll()
/// (asio's own sync sockets ignore SO_RCVTIMEO), so a hung server fails the test.
class FdStream {
 public:
  explicit FdStream(int fd) : fd_(fd) {}
  FdStream(FdStream&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  ~FdStream() {
    if (fd_ >= 0) ::close(fd_);
  }

  template <typename Buffers>
  size_t read_some(const Buffers& buffers, beast::error_code& ec) {
    ec = {};
    for (auto it = asio::buffer_sequence_begin(buffers); it != asio::buffer_sequence_end(buffers);
         ++it) {
      asio::mutable_buffer b = *it;
      if (b.size() == 0) continue;
      if (!waitFor(POLLIN, ec)) return 0;
      const ssize_t got = ::recv(fd_, b.data(), b.size(), 0);
      if (got < 0) {
        ec = beast::error_code(errno, boost::system::system_category());
        return 0;
      }
      if (got == 0) ec = asio::error::eof;
      return static_cast<size_t>(got);
    }
    return 0;
  }
  template <typename Buffers>
  size_t read_some(const Buffers& buffers) {
    beast::error_code ec;
    const size_t n = read_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }
  template <typename Buffers>
  size_t write_some(const Buffers& buffers, beast::error_code& ec) {
    ec = {};
    // One sendmsg for the whole sequence (header and body together), as a real client would.
    std::vector<iovec> iov;
    for (auto it = asio::buffer_sequence_begin(buffers); it != asio::buffer_sequence_end(buffers);
         ++it) {
      asio::const_buffer b = *it;
      if (b.size() > 0) iov.push_back({const_cast<void*>(b.data()), b.size()});
    }
    if (iov.empty()) return 0;
    if (!waitFor(POLLOUT, ec)) return 0;
    msghdr msg{};
    msg.msg_iov = iov.data();
    msg.msg_iovlen = std::min<size_t>(iov.size(), 64);
    const ssize_t sent = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (sent < 0) {
      ec = beast::error_code(errno, boost::system::system_category());
      return 0;
    }
    return static_cast<size_t>(sent);
  }
  template <typename Buffers>
  size_t write_some(const Buffers& buffers) {
    beast::error_code ec;
    const size_t n = write_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

  /// True when the peer closes the connection within `ms` (EOF or reset; no data).
  bool closedWithin(int ms) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, ms) <= 0) return false;
    char c;
    return ::recv(fd_, &c, 1, 0) <= 0;
  }
  int fd() const { return fd_; }

 private:
  bool waitFor(short events, beast::error_code& ec) {
    pollfd p{fd_, events, 0};
    const int r = ::poll(&p, 1, kTimeoutMs);
    if (r == 0) {
      ec = asio::error::timed_out;
      return false;
    }
    if (r < 0) {
      ec = beast::error_code(errno, boost::system::system_category());
      return false;
    }
    return true;
  }
  int fd_;
};

using Res = http::response<http::string_body>;

/// One keep-alive connection to the sidecar.
class Client {
 public:
  static Client unixSocket(const std::string& path) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    REQUIRE(path.size() < sizeof(a.sun_path));
    std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    return Client(fd);
  }
  /// `source`: the local address to connect from (any of 127.0.0.0/8 works on loopback).
  static Client tcp(uint16_t port, const char* source = nullptr) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    if (source != nullptr) {
      sockaddr_in from{};
      from.sin_family = AF_INET;
      REQUIRE(::inet_pton(AF_INET, source, &from.sin_addr) == 1);
      REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) == 0);
    }
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    return Client(fd);
  }

  void send(http::verb method, const std::string& target, const std::string& body = {},
            const std::string& type = {}, const std::map<std::string, std::string>& headers = {}) {
    http::request<http::string_body> req{method, target, 11};
    req.set(http::field::host, "lightwire");
    req.keep_alive(true);
    if (!type.empty()) req.set(http::field::content_type, type);
    for (const auto& [k, v] : headers) req.set(k, v);
    req.body() = body;
    req.prepare_payload();
    beast::error_code ec;
    http::write(stream_, req, ec);
    REQUIRE_MESSAGE(!ec, "writing the request: " << ec.message());
  }
  /// Writes bytes as they are; `lenient`: the server may stop reading (and close) midway.
  void sendRaw(const std::string& bytes, bool lenient = false) {
    beast::error_code ec;
    asio::write(stream_, asio::buffer(bytes), ec);
    if (!lenient) REQUIRE_MESSAGE(!ec, "writing: " << ec.message());
  }
  Res receive() {
    Res res;
    beast::error_code ec;
    http::read(stream_, buffer_, res, ec);
    REQUIRE_MESSAGE(!ec, "reading the response: " << ec.message());
    return res;
  }
  Res receive(http::response_parser<http::string_body>& parser) {
    beast::error_code ec;
    http::read(stream_, buffer_, parser, ec);
    REQUIRE_MESSAGE(!ec, "reading the response: " << ec.message());
    return parser.release();
  }
  Res request(http::verb method, const std::string& target, const std::string& body = {},
              const std::string& type = {},
              const std::map<std::string, std::string>& headers = {}) {
    send(method, target, body, type, headers);
    return receive();
  }
  Res get(const std::string& target) { return request(http::verb::get, target); }
  bool closedWithin(int ms) { return stream_.closedWithin(ms); }
  int fd() const { return stream_.fd(); }

 private:
  explicit Client(int fd) : stream_(fd) {}
  FdStream stream_;
  beast::flat_buffer buffer_;
};

using lightwire::testing::TempDir;

/// A POSIX shared-memory segment the "client" owns.
class ClientSegment {
 public:
  explicit ClientSegment(size_t size) : size_(size) {
    static std::atomic<int> counter{0};
    name_ = "/lw-api-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    fd_ = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    REQUIRE(fd_ >= 0);
    REQUIRE(::ftruncate(fd_, static_cast<off_t>(size)) == 0);
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    REQUIRE(p != MAP_FAILED);
    data_ = static_cast<std::byte*>(p);
  }
  ~ClientSegment() {
    ::munmap(data_, size_);
    ::close(fd_);
    ::shm_unlink(name_.c_str());
  }
  const std::string& name() const { return name_; }
  float* floats(size_t offset = 0) { return reinterpret_cast<float*>(data_ + offset); }

 private:
  std::string name_;
  size_t size_;
  int fd_ = -1;
  std::byte* data_ = nullptr;
};

/// The connection budgets of the Stack's three listeners.
struct Budgets {
  ListenerLimits unix_socket, control_tcp, admin;
};

/// The sidecar's stack, in process: control listener on a Unix socket and TCP, admin on TCP.
struct Stack {
  explicit Stack(ServeConfig config = {}, HttpLimits limits = {},
                 std::chrono::milliseconds step_timeout = std::chrono::seconds(10),
                 CodecChooser chooser = nullptr, Budgets budgets = {})
      : buffers(16, static_cast<size_t>(config.limits.max_buffers_per_client)),
        engine(engineOptions(config, step_timeout),
               chooser ? std::move(chooser)
                       : CodecChooser([](const TensorFacts&) { return kernels::CodecConfig{}; }),
               metrics, exchange),
        api(config, metrics, buffers, engine),
        work(asio::make_work_guard(io)),
        server(io, limits, [this](Request&& req, const RequestInfo& info, Reply reply) {
          api.handle(std::move(req), info, std::move(reply));
        }) {
    server.onRefused(
        [this](std::string_view target, unsigned status) { api.countRefused(target, status); });
    server.onLimit([this](std::string_view limit, std::string_view listener) {
      metrics.limitHits(limit, listener).Increment();
    });
    server.onHeader([this](const Request& header, const RequestInfo& info, bool has_body) {
      return api.checkHeader(header, info, has_body);
    });
    socket_path = dir.path() + "/run/lightwire.sock";
    REQUIRE(server.listenUnix(socket_path, ListenerKind::kControl, config.control_socket_mode,
                              budgets.unix_socket) == "");
    REQUIRE(server.listenTcp("127.0.0.1", 0, ListenerKind::kControl, &tcp_port,
                             budgets.control_tcp) == "");
    REQUIRE(server.listenTcp("127.0.0.1", 0, ListenerKind::kAdmin, &admin_port, budgets.admin) ==
            "");
    REQUIRE(tcp_port != 0);
    REQUIRE(admin_port != 0);
    REQUIRE(tcp_port != admin_port);
    api.setListeners(BoundListeners{socket_path, tcp_port, admin_port});
    for (int i = 0; i < 2; ++i) threads.emplace_back([this] { io.run(); });
  }
  ~Stack() {
    server.stop();
    engine.shutdown();
    work.reset();
    io.stop();
    for (auto& t : threads) t.join();
  }
  static EngineOptions engineOptions(const ServeConfig& c, std::chrono::milliseconds timeout) {
    EngineOptions o;
    o.local_trainers = static_cast<unsigned>(c.local_trainers);
    o.threads = 2;
    o.step_timeout = timeout;
    o.max_pending_steps = 64;
    return o;
  }
  Client unixClient() { return Client::unixSocket(socket_path); }
  Client tcpClient() { return Client::tcp(tcp_port); }
  Client adminClient() { return Client::tcp(admin_port); }

  TempDir dir;
  metrics::Metrics metrics;
  ipc::BufferTable buffers;
  LocalExchange exchange;
  StepEngine engine;
  ControlApi api;
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work;
  HttpServer server;
  std::vector<std::thread> threads;
  std::string socket_path;
  uint16_t tcp_port = 0, admin_port = 0;
};

std::string floatsBody(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

std::vector<float> bodyFloats(const std::string& body) {
  std::vector<float> v(body.size() / sizeof(float));
  std::memcpy(v.data(), body.data(), v.size() * sizeof(float));
  return v;
}

/// Checks an error reply: status, JSON {"error", "message"} and nothing else; returns the message.
std::string expectError(const Res& res, unsigned status, const std::string& code) {
  CHECK(res.result_int() == status);
  CHECK(res[http::field::content_type] == "application/json");
  boost::system::error_code ec;
  const json::value v = json::parse(res.body(), ec);
  REQUIRE_MESSAGE(!ec, "not JSON: " << res.body());
  REQUIRE(v.is_object());
  const auto& o = v.get_object();
  CHECK(o.size() == 2);
  REQUIRE(o.contains("error"));
  REQUIRE(o.contains("message"));
  REQUIRE(o.at("error").is_string());
  REQUIRE(o.at("message").is_string());
  CHECK(o.at("error").get_string() == code);
  const std::string message(o.at("message").get_string());
  CHECK(!message.empty());
  return message;
}

/// The parts of /v1/status a failed request must not change.
std::string snapshot(Client& c) {
  const Res res = c.get("/v1/status");
  REQUIRE(res.result_int() == 200);
  const json::value v = json::parse(res.body());
  const auto& o = v.get_object();
  return json::serialize(o.at("tensors")) + json::serialize(o.at("buffers")) +
         json::serialize(o.at("steps"));
}

json::object parseObject(const std::string& body) {
  const json::value v = json::parse(body);
  REQUIRE(v.is_object());
  return v.get_object();
}

/// Waits (at most 5 s) until the engine holds a pending step of `tensor`: a request sent on
/// another connection has arrived.
void waitPending(StepEngine& engine, const std::string& tensor) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    for (const auto& t : engine.tensorsJson()) {
      const auto& o = t.as_object();
      if (o.at("name").as_string() == tensor && o.at("pending_steps").to_number<uint64_t>() > 0) {
        return;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  FAIL("no pending step of '" << tensor << "' within 5 s");
}

const std::string kRaw = "application/octet-stream";
const std::string kJson = "application/json";

/// Registers shared-memory segment `name` of `size` bytes through `c`; returns the buffer id.
std::string registerShm(Client& c, const std::string& name, size_t size) {
  const Res reg =
      c.request(http::verb::post, "/v1/buffers",
                R"({"name": ")" + name + R"(", "size": )" + std::to_string(size) + "}", kJson);
  REQUIRE_MESSAGE(reg.result_int() == 201, reg.body());
  return std::string(parseObject(reg.body()).at("id").get_string());
}

/// Biases exchanged as they are, every other layer as fp16: a result shows which codec each
/// layer's elements went through.
kernels::CodecConfig biasesDense(const TensorFacts& t) {
  const std::string_view name = t.name;
  kernels::CodecConfig cc;
  const bool bias = name.size() >= 5 && name.substr(name.size() - 5) == ".bias";
  cc.name = bias ? "none" : "fp16";
  return cc;
}

}  // namespace

TEST_CASE("every step error is answered with the status and code of docs/api.md's table") {
  // The table's rows ("| 409 | `conflict` | ..."), read from the document itself.
  std::ifstream doc(std::string(LIGHTWIRE_SOURCE_DIR) + "/docs/api.md");
  REQUIRE(doc);
  std::map<std::string, unsigned> documented;
  for (std::string line; std::getline(doc, line);) {
    unsigned status = 0;
    char code[64] = {};
    if (std::sscanf(line.c_str(), "| %u | `%63[a-z_]` |", &status, code) == 2) {
      documented[code] = status;
    }
  }
  const StepError errors[] = {
      StepError::kInvalidArgument, StepError::kConflict,     StepError::kResumeMismatch,
      StepError::kLimitReached,    StepError::kInternal,     StepError::kDeviceError,
      StepError::kExchangeFailed,  StepError::kShuttingDown, StepError::kDeadlineExceeded,
      StepError::kStateLimit,      StepError::kCancelled};
  std::set<std::string> codes;
  for (StepError e : errors) {
    const ApiError a = apiError(e);
    CAPTURE(a.code);
    REQUIRE(documented.count(a.code) == 1);
    CHECK(documented.at(a.code) == a.status);
    CHECK(a.status >= 400);
    codes.insert(a.code);
  }
  CHECK(codes.size() == std::size(errors));  // no two errors share a code
  CHECK(apiError(StepError::kNone).status == 200);
}

TEST_CASE("raw emit_gradient round trip over the Unix socket and TCP, keep-alive") {
  Stack s;
  const std::vector<float> values = {1.5f, -2.25f, 3.0f, 1e-20f, 7.0f, 65504.0f};
  for (bool over_tcp : {false, true}) {
    CAPTURE(over_tcp);
    Client c = over_tcp ? s.tcpClient() : s.unixClient();
    const std::string name = over_tcp ? "tcp.w" : "unix.w";
    for (int step = 1; step <= 3; ++step) {  // three requests on one connection
      const Res res = c.request(http::verb::post,
                                "/v1/emit_gradient?name=" + name + "&step=" + std::to_string(step) +
                                    "&dtype=float32&shape=2,3",
                                floatsBody(values), kRaw);
      REQUIRE_MESSAGE(res.result_int() == 200, res.body());
      CHECK(res[http::field::content_type] == kRaw);
      CHECK(res["X-Lightwire-Codec"] == "none");
      CHECK(res["X-Lightwire-Raw-Bytes"] == "24");
      CHECK(res["X-Lightwire-Nonfinite"] == "0");
      CHECK_FALSE(res["X-Lightwire-Wire-Bytes"].empty());
      CHECK(res.keep_alive());
      CHECK(bodyFloats(res.body()) == values);
    }
  }
  Client c = s.unixClient();
  const json::object st = parseObject(c.get("/v1/status").body());
  CHECK(st.at("steps").at("ok").to_number<uint64_t>() == 6);
  CHECK(st.at("tensors").as_array().size() == 2);
  // A NaN is averaged through and flagged.
  const Res nan = c.request(http::verb::post, "/v1/emit_gradient?name=n&step=1",
                            floatsBody({1.0f, std::nanf("")}), kRaw);
  REQUIRE(nan.result_int() == 200);
  CHECK(nan["X-Lightwire-Nonfinite"] == "1");
}

TEST_CASE("bad raw emit_gradient requests get 400 and change nothing") {
  Stack s;
  Client c = s.unixClient();
  const std::string body8 = floatsBody({1, 2});  // 8 bytes
  REQUIRE(
      c.request(http::verb::post, "/v1/emit_gradient?name=w&step=1", body8, kRaw).result_int() ==
      200);
  const std::string before = snapshot(c);
  const std::string long_name(257, 'a');
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/v1/emit_gradient?name=w&step=2&dtype=float64", "dtype"},
      {"/v1/emit_gradient?name=w&step=2&dtype=", "dtype"},
      {"/v1/emit_gradient?name=w&step=2&shape=3", "shape"},
      {"/v1/emit_gradient?name=w&step=2&shape=1,1", "shape"},
      {"/v1/emit_gradient?name=w&step=2&shape=0,4", "shape"},
      {"/v1/emit_gradient?name=w&step=2&shape=-1", "shape"},
      {"/v1/emit_gradient?name=w&step=2&shape=1,,2", "shape"},
      {"/v1/emit_gradient?name=w&step=2&shape=2,", "shape"},
      {"/v1/emit_gradient?name=w&step=2&shape=99999999999999999999", "shape"},
      {"/v1/emit_gradient?name=w&step=2&shape=4294967296,4294967296", "shape"},
      {"/v1/emit_gradient?name=w&step=2&shape=1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,2", "dims"},
      {"/v1/emit_gradient?step=2", "name"},
      {"/v1/emit_gradient?name=w", "step"},
      {"/v1/emit_gradient?name=w&step=-3", "'-3'"},
      {"/v1/emit_gradient?name=w&step=1.5", "'1.5'"},
      {"/v1/emit_gradient?name=w&step=", "step"},
      {"/v1/emit_gradient?name=w&step=18446744073709551616", "step"},
      {"/v1/emit_gradient?name=a%20b&step=2", "name"},
      {"/v1/emit_gradient?name=a%00b&step=2", "name"},
      {"/v1/emit_gradient?name=&step=2", "name"},
      {"/v1/emit_gradient?name=" + long_name + "&step=2", "name"},
      {"/v1/emit_gradient?name=w&step=2&foo=1", "'foo'"},
      {"/v1/emit_gradient?name=w&step=2&step=3", "twice"},
      {"/v1/emit_gradient?name=%zz&step=2", "percent"},
      {"/v1/emit_gradient?name=w%4&step=2", "percent"},
      {"/v1/emit_gradient?name=w%&step=2", "percent"},
      {"/v1/emit_gradient?name=w&step=2&trainer=x", "trainer"},
  };
  for (const auto& entry : cases) {
    // Not a structured binding: clang 14 cannot capture one in CAPTURE's lambda.
    const auto& target = entry.first;
    const auto& needle = entry.second;
    CAPTURE(target);
    const Res res = c.request(http::verb::post, target, body8, kRaw);
    const std::string message = expectError(res, 400, "invalid_argument");
    CHECK_MESSAGE(message.find(needle) != std::string::npos, message);
    CHECK(res.keep_alive());
  }
  // Bodies that are not whole values, or empty.
  expectError(c.request(http::verb::post, "/v1/emit_gradient?name=w&step=2", "12345", kRaw), 400,
              "invalid_argument");
  expectError(c.request(http::verb::post, "/v1/emit_gradient?name=w&step=2", "", kRaw), 400,
              "invalid_argument");
  expectError(
      c.request(http::verb::post, "/v1/emit_gradient?name=w&step=2&dtype=float16", "123", kRaw),
      400, "invalid_argument");
  // A trainer index past local_trainers (1): refused by the engine.
  expectError(c.request(http::verb::post, "/v1/emit_gradient?name=w&step=2&trainer=1", body8, kRaw),
              400, "invalid_argument");
  CHECK(snapshot(c) == before);
  // The same connection still serves a valid request.
  const Res ok = c.request(http::verb::post, "/v1/emit_gradient?name=w&step=2", body8, kRaw);
  CHECK(ok.result_int() == 200);
  CHECK(ok.body() == body8);
}

TEST_CASE(
    "bad codec-auto timing and momentum fields of a form-2 request get 400 and change nothing") {
  Stack s;
  Client c = s.unixClient();
  const std::string before = snapshot(c);
  const std::string head = R"({"name": "w", "step": 1, "buffer": "b1", "shape": [4], )";
  for (const auto& bad : std::vector<std::pair<std::string, std::string>>{
           {R"("compute_s": 1})", "go together"},
           {R"("overlap_s": 1})", "go together"},
           {R"("compute_s": 1, "overlap_s": 2})", "overlap_s <= compute_s"},
           {R"("compute_s": -1, "overlap_s": 0})", "0 <= overlap_s"},
           {R"("compute_s": 4000, "overlap_s": 0})", "3600"},
           {R"("compute_s": "1", "overlap_s": 0})", "must be numbers"},
           {R"("tail_s": -0.5})", "'tail_s' must be a number"},
           {R"("direct_s": 1e9})", "'direct_s' must be a number"},
           {R"("momentum": 0})", "'momentum' must be a number in (0, 1)"},
           {R"("momentum": 1})", "'momentum' must be a number in (0, 1)"},
           {R"("momentum": "0.9"})", "'momentum' must be a number in (0, 1)"},
           {R"("momentum": -0.9})", "'momentum' must be a number in (0, 1)"}}) {
    const std::string& fields = bad.first;
    CAPTURE(fields);
    const std::string m =
        expectError(c.request(http::verb::post, "/v1/emit_gradient", head + fields, kJson), 400,
                    "invalid_argument");
    CHECK(m.find(bad.second) != std::string::npos);
  }
  CHECK(snapshot(c) == before);
}

TEST_CASE("bad step places and cancellations get 400 and change nothing; a cancel is answered") {
  Stack s;
  Client c = s.unixClient();
  const std::string before = snapshot(c);
  const std::string head = R"({"name": "w", "step": 1, "buffer": "b1", "shape": [4], )";
  const std::vector<std::pair<std::string, std::string>> bad_orders{
      {R"("order": 3)", "must be an object"},
      {R"("order": {"iteration": 0, "position": 0})", "missing field 'stream'"},
      {R"("order": {"stream": "s", "position": 0})", "missing field 'iteration'"},
      {R"("order": {"stream": "s", "iteration": 0})", "missing field 'position'"},
      {R"("order": {"stream": "", "iteration": 0, "position": 0})", "stream '' must be"},
      {R"("order": {"stream": "a b", "iteration": 0, "position": 0})", "must be 1 to"},
      {R"("order": {"stream": "s", "iteration": -1, "position": 0})", "non-negative"},
      {R"("order": {"stream": "s", "iteration": 0, "position": 2147483648})", "below 2^31"},
      {R"("order": {"stream": "s", "iteration": 0, "position": 0, "x": 1})", "unknown field"}};
  for (const auto& bad : bad_orders) {
    const std::string& fields = bad.first;
    const std::string& why = bad.second;
    CAPTURE(fields);
    const std::string m =
        expectError(c.request(http::verb::post, "/v1/emit_gradient", head + fields + "}", kJson),
                    400, "invalid_argument");
    CHECK(m.find(why) != std::string::npos);
    const std::string mc =
        expectError(c.request(http::verb::post, "/v1/cancel", "{" + fields + "}", kJson), 400,
                    "invalid_argument");
    CHECK(mc.find(why) != std::string::npos);
  }
  const std::string order = R"("order": {"stream": "s", "iteration": 4, "position": 1})";
  for (const auto& bad : std::vector<std::pair<std::string, std::string>>{
           {"{}", "missing field 'order'"},
           {"{" + order + R"(, "name": "b"})", "go together"},
           {"{" + order + R"(, "step": 2})", "go together"},
           {"{" + order + R"(, "name": "a b", "step": 2})", "may only use"},
           {"{" + order + R"(, "when": 2})", "unknown field 'when'"}}) {
    const std::string& body = bad.first;
    const std::string& why = bad.second;
    CAPTURE(body);
    const std::string m = expectError(c.request(http::verb::post, "/v1/cancel", body, kJson), 400,
                                      "invalid_argument");
    CHECK(m.find(why) != std::string::npos);
  }
  CHECK(snapshot(c) == before);
  const Res first = c.request(http::verb::post, "/v1/cancel",
                              "{" + order + R"(, "name": "b", "step": 4})", kJson);
  CHECK(first.result_int() == 200);
  CHECK(parseObject(first.body()).at("cancelled").as_bool());
  const Res again = c.request(http::verb::post, "/v1/cancel", "{" + order + "}", kJson);
  CHECK(again.result_int() == 200);
  CHECK_FALSE(parseObject(again.body()).at("cancelled").as_bool());
}

TEST_CASE("malformed JSON bodies get 400 on every JSON route") {
  Stack s;
  Client c = s.unixClient();
  const std::string before = snapshot(c);
  struct Case {
    http::verb method;
    std::string target;
  };
  for (const Case& k :
       {Case{http::verb::post, "/v1/emit_gradient"}, Case{http::verb::post, "/v1/buffers"},
        Case{http::verb::post, "/v1/report"}, Case{http::verb::put, "/v1/config"}}) {
    for (const std::string body : {"{", "", "{\"step\": 1,}", "[1, 2]", "nul", "{\"a\":1} x"}) {
      CAPTURE(k.target);
      CAPTURE(body);
      expectError(c.request(k.method, k.target, body, kJson), 400, "invalid_argument");
    }
  }
  // Deeply nested JSON is refused, not recursed into.
  expectError(c.request(http::verb::post, "/v1/report", std::string(10000, '['), kJson), 400,
              "invalid_argument");
  // Bad report values.
  expectError(c.request(http::verb::post, "/v1/report", R"({"loss": 1})", kJson), 400,
              "invalid_argument");
  expectError(c.request(http::verb::post, "/v1/report", R"({"step": -1})", kJson), 400,
              "invalid_argument");
  expectError(c.request(http::verb::post, "/v1/report", R"({"step": 1, "loss": "x"})", kJson), 400,
              "invalid_argument");
  CHECK(snapshot(c) == before);
  const Res ok = c.request(http::verb::post, "/v1/report",
                           R"({"step": 3, "loss": 0.5, "fallbacks": 2})", kJson);
  CHECK(ok.result_int() == 200);
  CHECK(ok.body() == "{}");
  const auto st = parseObject(c.get("/v1/status").body());
  CHECK(st.at("last_report").at("step").to_number<uint64_t>() == 3);
  CHECK(s.metrics.exposition().find("lightwire_fallbacks_total 2") != std::string::npos);
}

TEST_CASE("buffers: register, bad registrations, Form 2 regions, release twice") {
  Stack s;
  Client c = s.unixClient();
  ClientSegment seg(4096), small(1024);
  const std::string before = snapshot(c);

  // Registrations that fail change nothing.
  const std::string missing = "/lw-api-test-missing-" + std::to_string(::getpid());
  std::string m =
      expectError(c.request(http::verb::post, "/v1/buffers",
                            R"({"kind": "shm", "name": ")" + missing + R"(", "size": 64})", kJson),
                  400, "invalid_argument");
  CHECK(m.find(missing) != std::string::npos);
  m = expectError(c.request(http::verb::post, "/v1/buffers",
                            R"({"name": ")" + small.name() + R"(", "size": 4096})", kJson),
                  400, "invalid_argument");
  CHECK(m.find("1024") != std::string::npos);
  for (const std::string body :
       {R"({"name": "/a/b", "size": 64})", R"({"name": "x", "size": 64})",
        R"({"name": "", "size": 64})", R"({"size": 64})", R"({"name": "/x"})",
        R"({"name": "/x", "size": -1})", R"({"name": "/x", "size": 0})",
        R"({"kind": "gpu", "name": "/x", "size": 64})", R"({"name": "/x", "size": 64, "extra": 1})",
        R"({"name": 5, "size": 64})"}) {
    CAPTURE(body);
    expectError(c.request(http::verb::post, "/v1/buffers", body, kJson), 400, "invalid_argument");
  }
  // CUDA IPC handles: malformed registrations are refused as such (400) before anything else;
  // a well-formed one needs the CUDA driver (none here, or none probed): a clear 409.
  const std::string handle(128, 'a');
  auto cudaReg = [&](const std::string& fields) {
    return c.request(http::verb::post, "/v1/buffers", R"({"kind": "cuda_ipc", )" + fields + "}",
                     kJson);
  };
  m = expectError(cudaReg(R"("device": "0000:3b:00.0", "size": 64)"), 400, "invalid_argument");
  CHECK(m.find("'handle'") != std::string::npos);
  m = expectError(cudaReg(R"("handle": "abc", "device": "0000:3b:00.0", "size": 64)"), 400,
                  "invalid_argument");
  CHECK(m.find("128 hex digits") != std::string::npos);
  m = expectError(
      cudaReg(R"("handle": ")" + std::string(127, 'a') + R"(g", "device": "0", "size": 64)"), 400,
      "invalid_argument");
  CHECK(m.find("128 hex digits") != std::string::npos);
  m = expectError(cudaReg(R"("handle": ")" + handle + R"(", "size": 64)"), 400, "invalid_argument");
  CHECK(m.find("'device'") != std::string::npos);
  m = expectError(cudaReg(R"("handle": ")" + handle + R"(", "device": "0000:3b:00.0", "size": 0)"),
                  400, "invalid_argument");
  CHECK(m.find("'size'") != std::string::npos);
  m = expectError(cudaReg(R"("handle": ")" + handle +
                          R"(", "device": "0000:3b:00.0", "size": 64, "event": "zz")"),
                  400, "invalid_argument");
  CHECK(m.find("'event'") != std::string::npos);
  m = expectError(
      cudaReg(R"("handle": ")" + handle + R"(", "device": "0000:3b:00.0", "size": 64, "color": 1)"),
      400, "invalid_argument");
  CHECK(m.find("unknown field") != std::string::npos);
  m = expectError(cudaReg(R"("handle": ")" + handle + R"(", "device": "0000:3b:00.0", "size": 64)"),
                  409, "failed_precondition");
  CHECK(m.find("cannot open CUDA IPC handles") != std::string::npos);
  // An shm registration with a cuda_ipc field is refused, naming the field and the kind.
  m = expectError(c.request(http::verb::post, "/v1/buffers",
                            R"({"kind": "shm", "name": "/x", "size": 64, "handle": "a"})", kJson),
                  400, "invalid_argument");
  CHECK(m.find("for kind 'shm'") != std::string::npos);
  CHECK(snapshot(c) == before);
  CHECK(s.buffers.count() == 0);

  // Register.
  const Res reg =
      c.request(http::verb::post, "/v1/buffers",
                R"({"kind": "shm", "name": ")" + seg.name() + R"(", "size": 4096})", kJson);
  REQUIRE_MESSAGE(reg.result_int() == 201, reg.body());
  const auto ro = parseObject(reg.body());
  const std::string id(ro.at("id").get_string());
  CHECK(ro.at("kind").get_string() == "shm");
  CHECK(ro.at("size").to_number<uint64_t>() == 4096);
  const std::string registered = snapshot(c);
  CHECK(registered.find(seg.name()) != std::string::npos);

  // Form 2 requests that fail.
  auto form2 = [&](const std::string& fields) {
    return c.request(http::verb::post, "/v1/emit_gradient", "{" + fields + "}", kJson);
  };
  m = expectError(form2(R"("name": "w", "step": 1, "buffer": "b999", "shape": [4])"), 404,
                  "not_found");
  CHECK(m.find("b999") != std::string::npos);
  const std::string buf = R"("buffer": ")" + id + R"(", )";
  for (const std::string fields :
       {R"("name": "w", "step": 1, "offset": 4088, "shape": [4])",
        R"("name": "w", "step": 1, "offset": 0, "shape": [1025])",
        R"("name": "w", "step": 1, "offset": 2, "shape": [4])",
        R"("name": "w", "step": 1, "offset": 2, "dtype": "float16", "shape": [2048])",
        R"("name": "w", "step": 1, "offset": 9223372036854775808, "shape": [4])",
        R"("name": "w", "step": 1, "offset": 18446744073709551612, "shape": [4])",
        R"("name": "w", "step": 1, "offset": 4096, "shape": [1])",
        R"("name": "w", "step": 1, "shape": [4611686018427387904])",
        R"("name": "w", "step": 1, "shape": [0])", R"("name": "w", "step": 1, "shape": [-4])",
        R"("name": "w", "step": 1, "shape": [4], "elements": 5)", R"("name": "w", "step": 1)",
        R"("name": "w", "step": -3, "shape": [4])", R"("name": "w", "step": 1.5, "shape": [4])",
        R"("step": 1, "shape": [4])", R"("name": "a b", "step": 1, "shape": [4])",
        R"("name": "w", "step": 1, "dtype": "int8", "shape": [4])",
        R"("name": "w", "step": 1, "shape": [4], "unknown": true)"}) {
    CAPTURE(fields);
    expectError(form2(buf + fields), 400, "invalid_argument");
  }
  CHECK(snapshot(c) == registered);

  // A valid Form 2 request: the result is written in place, the reply is the figures.
  for (int i = 0; i < 16; ++i) seg.floats(64)[i] = static_cast<float>(i) + 0.5f;
  const Res ok = form2(buf + R"("name": "w", "step": 1, "offset": 64, "shape": [4, 4])");
  REQUIRE_MESSAGE(ok.result_int() == 200, ok.body());
  const auto fig = parseObject(ok.body());
  CHECK(fig.at("name").get_string() == "w");
  CHECK(fig.at("step").to_number<uint64_t>() == 1);
  CHECK(fig.at("codec").get_string() == "none");
  CHECK(fig.at("elements").to_number<uint64_t>() == 16);
  CHECK(fig.at("raw_bytes").to_number<uint64_t>() == 64);
  CHECK(fig.at("nonfinite").get_bool() == false);
  CHECK(fig.at("state_reset").get_bool() == false);
  for (const char* k : {"ingest", "compress", "exchange", "decompress", "total"}) {
    CHECK(fig.at("durations_us").as_object().contains(k));
  }
  CHECK(fig.contains("ratio"));
  for (int i = 0; i < 16; ++i) CHECK(seg.floats(64)[i] == static_cast<float>(i) + 0.5f);

  // Release, then release again.
  const Res del = c.request(http::verb::delete_, "/v1/buffers/" + id);
  CHECK(del.result_int() == 200);
  CHECK(del.body() == "{}");
  expectError(c.request(http::verb::delete_, "/v1/buffers/" + id), 404, "not_found");
  expectError(c.request(http::verb::delete_, "/v1/buffers/"), 404, "not_found");
  CHECK(s.buffers.count() == 0);
  expectError(form2(buf + R"("name": "w", "step": 2, "shape": [4])"), 404, "not_found");
}

TEST_CASE(
    "a bucket with a layout: one tensor per layer, its own codec; bad layouts change nothing") {
  Stack s({}, {}, std::chrono::seconds(10), biasesDense);
  Client c = s.unixClient();
  ClientSegment seg(4096);
  const std::string id = registerShm(c, seg.name(), 4096);
  auto form2 = [&](const std::string& fields) {
    return c.request(http::verb::post, "/v1/emit_gradient",
                     R"({"buffer": ")" + id + R"(", "offset": 128, )" + fields + "}", kJson);
  };
  const std::string layout = R"("layout": [{"name": "fc.weight", "offset": 0, "shape": [2, 3]},
      {"name": "fc.bias", "offset": 6, "shape": [2]}, {"name": "out.weight", "offset": 8,
      "shape": [4]}])";
  const std::string before = snapshot(c);

  // Bad layouts: 400 naming the entry, nothing registered, no step run.
  const std::string head = R"("name": "bucket.a", "step": 0, "shape": [12], )";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"("layout": {})", "must be an array"},
      {R"("layout": [])", "no entries"},
      {R"("layout": [5])", "layout entry 0 must be an object"},
      {R"("layout": [{"name": "a", "offset": 0, "shape": [12], "dtype": "x"}])", "unknown field"},
      {R"("layout": [{"offset": 0, "shape": [12]}])", "'name'"},
      {R"("layout": [{"name": "a b", "offset": 0, "shape": [12]}])", "may only use"},
      {R"("layout": [{"name": "a", "shape": [12]}])", "'offset'"},
      {R"("layout": [{"name": "a", "offset": 0}])", "'shape'"},
      {R"("layout": [{"name": "a", "offset": 0, "shape": [0]}])", "at least 1"},
      {R"("layout": [{"name": "a", "offset": 0, "shape": [13]}])", "outside the bucket"},
      {R"("layout": [{"name": "a", "offset": 10, "shape": [4]}])", "outside the bucket"},
      {R"("layout": [{"name": "a", "offset": 0, "shape": [8]}, {"name": "b", "offset": 6,
         "shape": [6]}])",
       "overlaps"},
      {R"("layout": [{"name": "a", "offset": 0, "shape": [6]}, {"name": "a", "offset": 6,
         "shape": [6]}])",
       "earlier entry"},
      {R"("layout": [{"name": "a", "offset": 0, "shape": [6]}, {"name": "b", "offset": 7,
         "shape": [4]}])",
       "hold 10 elements"},
      {R"("layout": [{"name": "bucket.a", "offset": 0, "shape": [12]}])", "bucket's own name"},
  };
  for (const auto& c : bad) {
    const std::string& fields = c.first;  // (not a structured binding: CAPTURE takes a lambda)
    CAPTURE(fields);
    const std::string m = expectError(form2(head + fields), 400, "invalid_argument");
    CHECK_MESSAGE(m.find(c.second) != std::string::npos, m);
  }
  // Too many entries.
  std::string many = R"("name": "bucket.m", "step": 0, "shape": [4097], "layout": [)";
  for (size_t i = 0; i <= kMaxLayoutEntries; ++i) {
    many += (i ? ", " : "") + std::string(R"({"name": "p)") + std::to_string(i) +
            R"(", "offset": )" + std::to_string(i) + R"(, "shape": [1]})";
  }
  const Res too_many = c.request(http::verb::post, "/v1/emit_gradient",
                                 R"({"buffer": ")" + id + R"(", )" + many + "]}", kJson);
  CHECK(expectError(too_many, 400, "invalid_argument").find("more than 4096") != std::string::npos);
  CHECK(snapshot(c) == before);

  // The bucket: three tensors, each with its own codec.
  float* x = seg.floats(128);
  for (int i = 0; i < 12; ++i) x[i] = 0.1f * static_cast<float>(i) + 0.01f;
  std::vector<float> sent(x, x + 12);
  const Res ok = form2(R"("name": "bucket.a", "step": 0, "shape": [12], )" + layout);
  REQUIRE_MESSAGE(ok.result_int() == 200, ok.body());
  const auto fig = parseObject(ok.body());
  CHECK(fig.at("name").get_string() == "bucket.a");
  CHECK(fig.at("codec").get_string() == "mixed");
  CHECK(fig.at("elements").to_number<uint64_t>() == 12);
  CHECK(fig.at("raw_bytes").to_number<uint64_t>() == 48);
  CHECK(fig.at("layout_hash").get_string().size() == 16);
  const auto& layers = fig.at("layers").as_array();
  REQUIRE(layers.size() == 3);
  const std::vector<std::pair<std::string, std::string>> want = {
      {"fc.weight", "fp16"}, {"fc.bias", "none"}, {"out.weight", "fp16"}};
  for (size_t i = 0; i < 3; ++i) {
    CHECK(layers[i].at("name").as_string() == want[i].first);
    CHECK(layers[i].at("codec").as_string() == want[i].second);
  }
  CHECK(layers[0].at("elements").to_number<uint64_t>() == 6);
  for (int i = 0; i < 12; ++i) {
    CAPTURE(i);
    if (i == 6 || i == 7) {
      CHECK(x[i] == sent[static_cast<size_t>(i)]);  // the bias: exact
    } else {
      CHECK(x[i] != sent[static_cast<size_t>(i)]);  // fp16's rounding
      CHECK(x[i] == doctest::Approx(sent[static_cast<size_t>(i)]).epsilon(1e-3));
    }
  }
  // /v1/status lists the layers as tensors, each with its shape's element count; not the bucket.
  const json::value status = json::parse(c.get("/v1/status").body());
  std::map<std::string, uint64_t> tensors;
  for (const auto& t : status.at("tensors").as_array()) {
    tensors[std::string(t.at("name").as_string())] = t.at("elements").to_number<uint64_t>();
  }
  CHECK(tensors ==
        std::map<std::string, uint64_t>{{"fc.weight", 6}, {"fc.bias", 2}, {"out.weight", 4}});

  // The next step with the same layout runs; a different layout under the same bucket name is
  // refused, naming the entry that differs, and runs nothing.
  const Res again = form2(R"("name": "bucket.a", "step": 1, "shape": [12], )" + layout);
  CHECK_MESSAGE(again.result_int() == 200, again.body());
  const std::string after = snapshot(c);
  const std::string m = expectError(
      form2(R"("name": "bucket.a", "step": 2, "shape": [12], "layout": [{"name": "fc.weight",
            "offset": 0, "shape": [6]}, {"name": "fc.bias", "offset": 6, "shape": [2]},
            {"name": "out.weight", "offset": 8, "shape": [4]}])"),
      400, "invalid_argument");
  CHECK(m.find("another layout") != std::string::npos);
  CHECK(m.find("'fc.weight'") != std::string::npos);
  CHECK(snapshot(c) == after);

  // A bucket is one step: fc.bias sent on its own at step 5 makes the bucket's step 3 go
  // backwards for that layer, and the whole bucket is refused (409 naming it), its buffer and
  // every layer's state untouched; the bucket's step 6 runs every layer.
  const Res alone = c.request(
      http::verb::post, "/v1/emit_gradient",
      R"({"buffer": ")" + id + R"(", "offset": 152, "name": "fc.bias", "step": 5, "shape": [2]})",
      kJson);
  REQUIRE_MESSAGE(alone.result_int() == 200, alone.body());
  const std::vector<float> held(x, x + 12);
  const std::string refused = expectError(
      form2(R"("name": "bucket.a", "step": 3, "shape": [12], )" + layout), 409, "conflict");
  CHECK(refused.find("tensor 'fc.bias' step 3 goes backwards") != std::string::npos);
  CHECK(std::vector<float>(x, x + 12) == held);
  const json::value st = json::parse(c.get("/v1/status").body());
  for (const auto& t : st.at("tensors").as_array()) {
    CAPTURE(t);
    const uint64_t want_step = t.at("name").as_string() == "fc.bias" ? 5 : 1;
    CHECK(t.at("last_committed_step").to_number<uint64_t>() == want_step);
    CHECK(t.at("pending_steps").to_number<uint64_t>() == 0);
  }
  const Res later = form2(R"("name": "bucket.a", "step": 6, "shape": [12], )" + layout);
  CHECK_MESSAGE(later.result_int() == 200, later.body());

  // Sent once: later steps may name the layout by its hash (the reply's layout_hash).
  const std::string hash(parseObject(later.body()).at("layout_hash").get_string());
  const Res by_hash =
      form2(R"("name": "bucket.a", "step": 7, "shape": [12], "layout_hash": ")" + hash + R"(")");
  REQUIRE_MESSAGE(by_hash.result_int() == 200, by_hash.body());
  CHECK(parseObject(by_hash.body()).at("layers").as_array().size() == 3);
  CHECK(parseObject(by_hash.body()).at("layout_hash").get_string() == hash);
  const std::string before_hash = snapshot(c);
  std::string wrong = hash;
  wrong[0] = wrong[0] == '0' ? '1' : '0';
  const std::vector<std::pair<std::string, std::string>> bad_hashes = {
      {R"("name": "bucket.a", "step": 8, "shape": [12], "layout_hash": ")" + wrong + R"(")",
       "was sent with layout " + hash},
      {R"("name": "bucket.a", "step": 8, "shape": [12], "layout_hash": "xyz")", "16 hex digits"},
      {R"("name": "bucket.a", "step": 8, "shape": [12], "layout_hash": 7)", "'layout_hash'"},
      {R"("name": "bucket.a", "step": 8, "shape": [10], "layout_hash": ")" + hash + R"(")",
       "holds 12 elements, the request 10"},
      {R"("name": "bucket.a", "step": 8, "shape": [12], "layout_hash": ")" + wrong + R"(", )" +
           layout,
       "is not the hash of the layout sent with it"}};
  for (const auto& bad : bad_hashes) {
    CAPTURE(bad.first);
    const std::string got = expectError(form2(bad.first), 400, "invalid_argument");
    CHECK_MESSAGE(got.find(bad.second) != std::string::npos, got);
  }
  const std::string unknown = expectError(
      form2(R"("name": "bucket.z", "step": 0, "shape": [12], "layout_hash": ")" + hash + R"(")"),
      404, "unknown_layout");
  CHECK(unknown.find("send the bucket with its 'layout' once") != std::string::npos);
  // A tensor of its own cannot take a bucket's name (form 2 without a layout, and form 1).
  const std::string taken =
      expectError(c.request(http::verb::post, "/v1/emit_gradient",
                            R"({"buffer": ")" + id +
                                R"(", "offset": 128, "name": "bucket.a", "step": 9, )"
                                R"("shape": [12]})",
                            kJson),
                  400, "invalid_argument");
  CHECK(taken.find("names a bucket sent with a layout") != std::string::npos);
  const std::string raw(48, '\0');
  expectError(c.request(http::verb::post, "/v1/emit_gradient?name=bucket.a&step=9", raw, kRaw), 400,
              "invalid_argument");
  CHECK(snapshot(c) == before_hash);
}

TEST_CASE(
    "a raw body with its layout inline: one tensor per layer, then by hash; bad layouts change "
    "nothing") {
  Stack s({}, {}, std::chrono::seconds(10), biasesDense);
  Client c = s.unixClient();
  const std::string layout = R"([{"name": "fc.weight", "offset": 0, "shape": [2, 3]},
      {"name": "fc.bias", "offset": 6, "shape": [2]}, {"name": "out.weight", "offset": 8,
      "shape": [4]}])";
  std::vector<float> sent(12);
  for (size_t i = 0; i < sent.size(); ++i) sent[i] = 0.1f * static_cast<float>(i) + 0.01f;
  const std::string tensor = floatsBody(sent);
  // POST of `prefix` (the layout's JSON, or nothing) and the tensor, with `query` after "step=N".
  auto emit = [&](uint64_t step, const std::string& prefix, const std::string& query,
                  const std::string& bucket = "bucket.r") {
    std::string target = "/v1/emit_gradient?name=" + bucket + "&step=" + std::to_string(step);
    if (!prefix.empty()) target += "&layout_bytes=" + std::to_string(prefix.size());
    return c.request(http::verb::post, target + query, prefix + tensor, kRaw);
  };
  const std::string before = snapshot(c);

  // Bad requests: 400 naming the problem, no layout registered, no step run.
  const std::string aligned = layout + std::string(4 - layout.size() % 4, ' ');
  const std::vector<std::pair<std::string, std::string>> bad_targets = {
      {"layout_bytes=x", "'layout_bytes' must be an unsigned integer"},
      {"layout_bytes=0", "'layout_bytes' must be 1 to 4194304"},
      {"layout_bytes=4194305", "'layout_bytes' must be 1 to 4194304"},
      {"layout_bytes=" + std::to_string(aligned.size() + tensor.size() + 1),
       "the body has only " + std::to_string(aligned.size() + tensor.size()) + " bytes"},
      {"layout_bytes=" + std::to_string(aligned.size()) + "&shape=5",
       "needs 20 bytes, the body has 48 bytes after its layout"},
      {"layout_bytes=" + std::to_string(aligned.size() + 2), "not a whole number of float32"},
      {"layout_bytes=" + std::to_string(aligned.size() - 8), "malformed layout JSON"},
      {"layout_bytes=" + std::to_string(aligned.size()) + "&layout_hash=xyz",
       "query parameter 'layout_hash' must be 16 hex digits"},
      {"layout_bytes=" + std::to_string(aligned.size()) + "&layout_hash=0123456789abcdef",
       "query parameter 'layout_hash' '0123456789abcdef' is not the hash of the layout sent "
       "with it"},
      {"layout_bytes=" + std::to_string(aligned.size()) + "&layout=1", "unknown query parameter"},
  };
  for (const auto& bad : bad_targets) {
    const std::string& query = bad.first;  // (not a structured binding: CAPTURE takes a lambda)
    CAPTURE(query);
    const Res res = c.request(http::verb::post, "/v1/emit_gradient?name=bucket.r&step=0&" + query,
                              aligned + tensor, kRaw);
    const std::string m = expectError(res, 400, "invalid_argument");
    CHECK_MESSAGE(m.find(bad.second) != std::string::npos, m);
  }
  const std::vector<std::pair<std::string, std::string>> bad_layouts = {
      {"[{\"name\": \"a\", \"offset\": 0, ", "malformed layout JSON"},
      {"{\"name\": \"a\"}", "must be an array"},
      {R"([{"name": "a", "offset": 0, "shape": [13]}])", "outside the bucket"},
      {R"([{"name": "a", "offset": 0, "shape": [6]}, {"name": "b", "offset": 7, "shape": [4]}])",
       "hold 10 elements"},
      {R"([{"name": "bucket.r", "offset": 0, "shape": [12]}])", "bucket's own name"},
      {"[{\"name\": \"a\xff\", \"offset\": 0, \"shape\": [12]}]", "malformed layout JSON"},
  };
  for (const auto& bad : bad_layouts) {
    const std::string& prefix = bad.first;
    CAPTURE(prefix);
    const std::string m = expectError(emit(0, prefix, ""), 400, "invalid_argument");
    CHECK_MESSAGE(m.find(bad.second) != std::string::npos, m);
    CHECK_MESSAGE(
        m.find("the body's first " + std::to_string(prefix.size()) + " bytes") != std::string::npos,
        m);
  }
  // A layout hash of a bucket this sidecar holds no layout for: 404 unknown_layout.
  const std::string unknown =
      expectError(emit(0, "", "&layout_hash=0123456789abcdef"), 404, "unknown_layout");
  CHECK(unknown.find("send the bucket with its 'layout' once") != std::string::npos);
  CHECK(snapshot(c) == before);

  // The bucket: three tensors, each with its own codec; the reply is the tensor's bytes only.
  const Res ok = emit(0, layout, "&shape=3,4");
  REQUIRE_MESSAGE(ok.result_int() == 200, ok.body());
  CHECK(ok[http::field::content_type] == kRaw);
  CHECK(ok["X-Lightwire-Codec"] == "mixed");
  CHECK(ok["X-Lightwire-Raw-Bytes"] == "48");
  CHECK(ok["X-Lightwire-Nonfinite"] == "0");
  CHECK(ok["X-Lightwire-Mode"] == "compressed");
  const std::string hash(ok["X-Lightwire-Layout-Hash"]);
  uint64_t parsed = 0;
  CHECK(parseLayoutHash(hash, &parsed));
  REQUIRE(ok.body().size() == tensor.size());
  const std::vector<float> got = bodyFloats(ok.body());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    if (i == 6 || i == 7) {
      CHECK(got[i] == sent[i]);  // the bias: exact
    } else {
      CHECK(got[i] != sent[i]);  // fp16's rounding
      CHECK(got[i] == doctest::Approx(sent[i]).epsilon(1e-3));
    }
  }
  // /v1/status lists the layers as tensors, not the bucket.
  std::map<std::string, uint64_t> tensors;
  const json::value status = json::parse(c.get("/v1/status").body());
  for (const auto& t : status.at("tensors").as_array()) {
    tensors[std::string(t.at("name").as_string())] =
        t.at("last_committed_step").to_number<uint64_t>();
  }
  CHECK(tensors ==
        std::map<std::string, uint64_t>{{"fc.weight", 0}, {"fc.bias", 0}, {"out.weight", 0}});

  // Sent once: the hash alone names it from then on; with both, the hash must be the layout's.
  const Res by_hash = emit(1, "", "&layout_hash=" + hash);
  REQUIRE_MESSAGE(by_hash.result_int() == 200, by_hash.body());
  CHECK(by_hash["X-Lightwire-Layout-Hash"] == hash);
  CHECK(bodyFloats(by_hash.body()) == got);
  const Res both = emit(2, layout, "&layout_hash=" + hash);
  REQUIRE_MESSAGE(both.result_int() == 200, both.body());
  // A layout of any length: one whose values would not be aligned is as good (spaces pad JSON).
  const Res unaligned = emit(3, layout + std::string(4 - layout.size() % 4 + 1, ' '), "");
  REQUIRE_MESSAGE(unaligned.result_int() == 200, unaligned.body());
  CHECK(bodyFloats(unaligned.body()) == got);
  // The registry is the one form 2 uses: its hash is the one form 2 would reply.
  ClientSegment seg(48);
  const std::string id = registerShm(c, seg.name(), 48);
  std::memcpy(seg.floats(), sent.data(), tensor.size());
  const Res form2 = c.request(http::verb::post, "/v1/emit_gradient",
                              R"({"buffer": ")" + id +
                                  R"(", "name": "bucket.r", "step": 4, "shape": [12], )"
                                  R"("layout_hash": ")" +
                                  hash + R"("})",
                              kJson);
  REQUIRE_MESSAGE(form2.result_int() == 200, form2.body());
  CHECK(parseObject(form2.body()).at("layout_hash").as_string() == hash);

  // Another layout under the same bucket name, a wrong hash, a tensor part of another size: 400,
  // and nothing runs.
  const std::string after = snapshot(c);
  std::string wrong = hash;
  wrong[0] = wrong[0] == '0' ? '1' : '0';
  const std::string other = R"([{"name": "fc.weight", "offset": 0, "shape": [6]},
      {"name": "fc.bias", "offset": 6, "shape": [2]}, {"name": "out.weight", "offset": 8,
      "shape": [4]}])";
  CHECK(expectError(emit(5, other, ""), 400, "invalid_argument").find("another layout") !=
        std::string::npos);
  CHECK(expectError(emit(5, "", "&layout_hash=" + wrong), 400, "invalid_argument")
            .find("was sent with layout " + hash) != std::string::npos);
  const Res shorter =
      c.request(http::verb::post, "/v1/emit_gradient?name=bucket.r&step=5&layout_hash=" + hash,
                tensor.substr(0, 40), kRaw);
  CHECK(expectError(shorter, 400, "invalid_argument").find("holds 12 elements, the request 10") !=
        std::string::npos);
  CHECK(snapshot(c) == after);
}

TEST_CASE(
    "layers of a layout: 1-D and small layers dense, rules by name, ndim and size, powersgd only "
    "where it compresses") {
  auto cc = compressionFromJson(json::parse(R"({"default": {"codec": "topk", "density": 0.01},
      "rules": [{"pattern": "emb.*", "ndim": 1, "codec": "fp16"},
                {"pattern": "mom.*", "codec": "dgc", "density": 0.01, "momentum": 0.9},
                {"pattern": "*.proj", "ndim": 2, "min_elements": 10000, "codec": "powersgd",
                 "approx_rank": 4}]})"));
  REQUIRE_MESSAGE(cc, cc.status().message());
  Stack s({}, {}, std::chrono::seconds(10),
          chooserFor(std::make_shared<const CompressionConfig>(std::move(*cc))));
  Client c = s.unixClient();
  const std::vector<std::tuple<std::string, std::vector<uint64_t>, std::string>> layers = {
      {"emb.weight", {64, 200}, "topk"},       // the default codec
      {"emb.bias", {200}, "fp16"},             // 1-D, but a rule names it (ndim 1)
      {"fc.bias", {200}, "none"},              // 1-D: dense
      {"small.weight", {10, 10}, "none"},      // at most 8192 elements: dense
      {"conv.weight", {16, 4, 3, 3}, "none"},  // 576 elements: dense
      {"attn.proj", {128, 128}, "powersgd"},   // 128·128 > 2·(128 + 128)·4
      {"wide.proj", {2, 9000}, "none"},        // rank 2: 2·9000 < 2·(2 + 9000)·2
      {"big.weight", {96, 100}, "topk"},       // 9600 elements, 2-D
      {"mom.weight", {100, 100}, "dgc"},       // with momentum correction: the sidecar's
      {"mom.bias", {100}, "dgc"},              // a rule names it: not dense
  };
  std::string layout;
  uint64_t total = 0;
  for (const auto& [name, shape, codec] : layers) {
    std::string dims;
    uint64_t n = 1;
    for (uint64_t d : shape) {
      dims += (dims.empty() ? "" : ", ") + std::to_string(d);
      n *= d;
    }
    layout += (layout.empty() ? "" : ", ") + std::string(R"({"name": ")") + name +
              R"(", "offset": )" + std::to_string(total) + R"(, "shape": [)" + dims + "]}";
    total += n;
  }
  ClientSegment seg(total * sizeof(float));
  const std::string id = registerShm(c, seg.name(), total * sizeof(float));
  for (uint64_t i = 0; i < total; ++i) seg.floats()[i] = std::sin(0.37f * static_cast<float>(i));
  const Res ok =
      c.request(http::verb::post, "/v1/emit_gradient",
                R"({"buffer": ")" + id + R"(", "name": "bucket.l", "step": 0, "shape": [)" +
                    std::to_string(total) + R"(], "layout": [)" + layout + "]}",
                kJson);
  REQUIRE_MESSAGE(ok.result_int() == 200, ok.body());
  const auto fig = parseObject(ok.body());
  const auto& got = fig.at("layers").as_array();
  REQUIRE(got.size() == layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].at("name").as_string() == std::get<0>(layers[i]));
    CHECK(got[i].at("codec").as_string() == std::get<2>(layers[i]));
    const bool dgc = std::get<2>(layers[i]) == "dgc";
    CHECK(got[i].at("momentum").to_number<double>() == (dgc ? 0.9 : 0.0));
  }
  CHECK(!fig.contains("momentum"));  // the layers differ: each says its own
  // The same names as flat tensors (no layout): the layer defaults do not apply, only the rules.
  const Res flat = c.request(
      http::verb::post, "/v1/emit_gradient",
      R"({"buffer": ")" + id + R"(", "name": "fc.bias.flat", "step": 0, "shape": [200]})", kJson);
  REQUIRE_MESSAGE(flat.result_int() == 200, flat.body());
  CHECK(parseObject(flat.body()).at("codec").as_string() == "topk");
}

TEST_CASE("powersgd per layer: a rank-r weight matrix comes back exact, its bias dense") {
  auto cc =
      compressionFromJson(json::parse(R"({"default": {"codec": "powersgd", "approx_rank": 2}})"));
  REQUIRE_MESSAGE(cc, cc.status().message());
  Stack s({}, {}, std::chrono::seconds(10),
          chooserFor(std::make_shared<const CompressionConfig>(std::move(*cc))));
  Client c = s.unixClient();
  constexpr uint64_t kRows = 96, kCols = 128, kTotal = kRows * kCols + kCols;
  ClientSegment seg(kTotal * sizeof(float));
  const std::string id = registerShm(c, seg.name(), kTotal * sizeof(float));
  // W = a·bᵀ + c·dᵀ (rank 2), then the bias.
  float* x = seg.floats();
  for (uint64_t i = 0; i < kRows; ++i) {
    for (uint64_t j = 0; j < kCols; ++j) {
      const float a = std::sin(0.1f * static_cast<float>(i) + 0.3f);
      const float b = std::cos(0.07f * static_cast<float>(j));
      const float cc2 = 0.5f + 0.01f * static_cast<float>(i % 7);
      const float d = std::sin(0.05f * static_cast<float>(j) + 1.0f);
      x[i * kCols + j] = a * b + cc2 * d;
    }
  }
  for (uint64_t j = 0; j < kCols; ++j)
    x[kRows * kCols + j] = 0.001f * static_cast<float>(j) - 0.05f;
  const std::vector<float> sent(x, x + kTotal);
  const std::string layout = R"("layout": [{"name": "proj.weight", "offset": 0, "shape": [96, 128]},
      {"name": "proj.bias", "offset": 12288, "shape": [128]}])";
  // The first step starts the warm-started factors; the second shows the approximation.
  for (uint64_t step = 0; step < 2; ++step) {
    std::copy(sent.begin(), sent.end(), x);
    const Res ok = c.request(http::verb::post, "/v1/emit_gradient",
                             R"({"buffer": ")" + id + R"(", "name": "bucket.p", "step": )" +
                                 std::to_string(step) + R"(, "shape": [12416], )" + layout + "}",
                             kJson);
    REQUIRE_MESSAGE(ok.result_int() == 200, ok.body());
    const auto reply = parseObject(ok.body());
    const auto& got = reply.at("layers").as_array();
    REQUIRE(got.size() == 2);
    CHECK(got[0].at("codec").as_string() == "powersgd");
    CHECK(got[1].at("codec").as_string() == "none");
    CHECK(got[0].at("wire_bytes").to_number<uint64_t>() < kRows * kCols);  // (96 + 128)·2 floats
  }
  double err = 0, norm = 0;
  for (uint64_t i = 0; i < kRows * kCols; ++i) {
    err += (double(x[i]) - sent[i]) * (double(x[i]) - sent[i]);
    norm += double(sent[i]) * sent[i];
  }
  CHECK(std::sqrt(err / norm) < 1e-5);  // rank 2 of a rank-2 matrix: exact up to rounding
  for (uint64_t j = 0; j < kCols; ++j) CHECK(x[kRows * kCols + j] == sent[kRows * kCols + j]);
}

TEST_CASE("a segment shrunk after registration is refused, not touched") {
  Stack s;
  Client c = s.unixClient();
  const std::string name = "/lw-api-shrink-" + std::to_string(::getpid());
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, 8192) == 0);
  const std::string id = registerShm(c, name, 8192);
  REQUIRE(::ftruncate(fd, 100) == 0);
  const std::string before = snapshot(c);
  const Res res = c.request(
      http::verb::post, "/v1/emit_gradient",
      R"({"name": "w", "step": 1, "buffer": ")" + id + R"(", "offset": 4096, "shape": [16]})",
      kJson);
  expectError(res, 400, "invalid_argument");
  CHECK(snapshot(c) == before);
  ::close(fd);
  ::shm_unlink(name.c_str());
}

TEST_CASE("unknown routes get 404, wrong methods 405 with Allow") {
  Stack s;
  Client c = s.tcpClient();
  expectError(c.get("/v1/nothing"), 404, "not_found");
  expectError(c.get("/"), 404, "not_found");
  expectError(c.get("/v1/emit_gradient/extra"), 404, "not_found");
  struct Case {
    http::verb method;
    std::string target, allow;
  };
  for (const Case& k :
       {Case{http::verb::get, "/v1/emit_gradient", "POST"},
        Case{http::verb::put, "/v1/buffers", "POST"},
        Case{http::verb::get, "/v1/buffers/b1", "DELETE"},
        Case{http::verb::get, "/v1/report", "POST"}, Case{http::verb::post, "/v1/config", "PUT"},
        Case{http::verb::post, "/v1/status", "GET"},
        Case{http::verb::delete_, "/metrics", "GET"}}) {
    CAPTURE(k.target);
    const Res res = c.request(k.method, k.target, "", kJson);
    expectError(res, 405, "method_not_allowed");
    CHECK(res[http::field::allow] == k.allow);
  }
  CHECK(c.get("/healthz").result_int() == 200);
  // Replies are counted by route template, and any other path as "other" (a bounded label set).
  expectError(c.request(http::verb::delete_, "/v1/buffers/no-such-id", "", kJson), 404,
              "not_found");
  const std::string metrics = c.get("/metrics").body();
  for (const char* line :
       {R"(lightwire_http_requests_total{code="404",route="other"} 3)",
        R"(lightwire_http_requests_total{code="404",route="/v1/buffers/{id}"} 1)",
        R"(lightwire_http_requests_total{code="405",route="/v1/buffers/{id}"} 1)",
        R"(lightwire_http_requests_total{code="405",route="/metrics"} 1)",
        R"(lightwire_http_requests_total{code="200",route="/healthz"} 1)"}) {
    CAPTURE(line);
    CHECK(metrics.find(line) != std::string::npos);
  }
}

TEST_CASE("a body over max_body_bytes is refused from its Content-Length, before it is sent") {
  HttpLimits limits;
  limits.max_body_bytes = 1 << 20;
  limits.max_header_bytes = 4096;
  Stack s({}, limits);
  for (bool over_tcp : {false, true}) {
    CAPTURE(over_tcp);
    Client c = over_tcp ? s.tcpClient() : s.unixClient();
    c.sendRaw(
        "POST /v1/emit_gradient?name=w&step=1 HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: application/octet-stream\r\nContent-Length: 2097152\r\n\r\n");
    const Res res = c.receive();  // no body sent: the reply must come anyway
    const std::string m = expectError(res, 413, "too_large");
    CHECK(m.find("1048576") != std::string::npos);
    CHECK_FALSE(res.keep_alive());
    CHECK(c.closedWithin(kTimeoutMs));
  }
  // Just at the limit is fine.
  Client c = s.unixClient();
  const Res ok = c.request(http::verb::post, "/v1/emit_gradient?name=w&step=1",
                           std::string(1 << 20, '\0'), kRaw);
  CHECK(ok.result_int() == 200);
  // Chunked bodies are limited as they arrive.
  c.sendRaw(
      "POST /v1/emit_gradient?name=w&step=2 HTTP/1.1\r\nHost: x\r\n"
      "Transfer-Encoding: chunked\r\n\r\n200000\r\n" +
          std::string(0x200000, 'a') + "\r\n0\r\n\r\n",
      true);
  expectError(c.receive(), 413, "too_large");
  // Refused before any handler, and still counted under the route's template.
  const std::string metrics = s.unixClient().get("/metrics").body();
  CHECK(metrics.find(R"(lightwire_http_requests_total{code="413",route="/v1/emit_gradient"} 3)") !=
        std::string::npos);
  CHECK(metrics.find(R"(lightwire_limit_hits_total{limit="body_bytes",listener="unix"} 2)") !=
        std::string::npos);
  CHECK(
      metrics.find(R"(lightwire_limit_hits_total{limit="body_bytes",listener="control_tcp"} 1)") !=
      std::string::npos);
}

TEST_CASE("headers over max_header_bytes get 431") {
  HttpLimits limits;
  limits.max_header_bytes = 2048;
  Stack s({}, limits);
  for (bool over_tcp : {false, true}) {
    CAPTURE(over_tcp);
    Client c = over_tcp ? s.tcpClient() : s.unixClient();
    c.sendRaw("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(3000, 'h') + "\r\n\r\n");
    const Res res = c.receive();
    expectError(res, 431, "header_too_large");
    CHECK(c.closedWithin(kTimeoutMs));
  }
  Client c = s.unixClient();
  CHECK(c.get("/healthz").result_int() == 200);
  const std::string metrics = c.get("/metrics").body();
  CHECK(metrics.find(R"(lightwire_http_requests_total{code="431",route="/healthz"} 2)") !=
        std::string::npos);
  CHECK(metrics.find(R"(lightwire_limit_hits_total{limit="header_bytes",listener="unix"} 1)") !=
        std::string::npos);
  CHECK(metrics.find(
            R"(lightwire_limit_hits_total{limit="header_bytes",listener="control_tcp"} 1)") !=
        std::string::npos);
}

TEST_CASE("bodies held at once are capped: a body that would pass the budget is 429 unread") {
  ServeConfig config;
  config.local_trainers = 2;
  HttpLimits limits;
  limits.max_inflight_body_bytes = 1 << 20;
  Stack s(config, limits);
  constexpr size_t kN = 100000;  // 400 000 bytes per trainer
  Client a = s.unixClient(), b = s.unixClient(), c = s.tcpClient();
  // Trainer 0's body is held while the step waits for trainer 1.
  a.send(http::verb::post, "/v1/emit_gradient?name=g&step=1&trainer=0",
         floatsBody(std::vector<float>(kN, 1.0f)), kRaw);
  waitPending(s.engine, "g");
  // 700 000 more bytes would pass 1 MiB: refused from the Content-Length, before the body.
  c.sendRaw(
      "POST /v1/emit_gradient?name=h&step=1&trainer=0 HTTP/1.1\r\nHost: x\r\n"
      "Content-Type: application/octet-stream\r\nContent-Length: 700000\r\n\r\n");
  const Res refused = c.receive();
  const std::string m = expectError(refused, 429, "limit_reached");
  CHECK(m.find("limits.max_inflight_body_bytes (1048576 bytes; 400000 held, this one 700000)") !=
        std::string::npos);
  CHECK_FALSE(refused.keep_alive());
  CHECK(refused[http::field::retry_after] == "1");  // nothing was read: try again shortly
  // Trainer 1's 400 000 bytes fit (800 000 held): the step completes, both get the mean.
  const Res r1 = b.request(http::verb::post, "/v1/emit_gradient?name=g&step=1&trainer=1",
                           floatsBody(std::vector<float>(kN, 3.0f)), kRaw);
  REQUIRE_MESSAGE(r1.result_int() == 200, r1.body());
  CHECK(bodyFloats(r1.body()) == std::vector<float>(kN, 2.0f));
  REQUIRE(a.receive().result_int() == 200);
  // Answered bodies are released: two bodies of 480 000 bytes now fit.
  Client d = s.unixClient();
  d.send(http::verb::post, "/v1/emit_gradient?name=h&step=1&trainer=0",
         floatsBody(std::vector<float>(120000, 1.0f)), kRaw);
  waitPending(s.engine, "h");
  const Res h1 = b.request(http::verb::post, "/v1/emit_gradient?name=h&step=1&trainer=1",
                           floatsBody(std::vector<float>(120000, 1.0f)), kRaw);
  CHECK(h1.result_int() == 200);
  CHECK(d.receive().result_int() == 200);
  const std::string metrics = s.unixClient().get("/metrics").body();
  CHECK(
      metrics.find(
          R"(lightwire_limit_hits_total{limit="inflight_body_bytes",listener="control_tcp"} 1)") !=
      std::string::npos);
}

TEST_CASE("two local trainers: a second request for the same part is 409; steps do not go back") {
  ServeConfig config;
  config.local_trainers = 2;
  Stack s(config);
  ClientSegment seg(1024);
  Client a = s.unixClient(), b = s.unixClient(), t1 = s.tcpClient();
  const std::string id = registerShm(a, seg.name(), 1024);
  for (int i = 0; i < 8; ++i) seg.floats()[i] = 1.0f;

  // Trainer 0 through its buffer: waits for trainer 1.
  a.send(http::verb::post, "/v1/emit_gradient",
         R"({"name": "g", "step": 1, "trainer": 0, "buffer": ")" + id + R"(", "shape": [8]})",
         kJson);
  waitPending(s.engine, "g");
  // A second trainer-0 part of the same step, while the first waits.
  std::string m =
      expectError(b.request(http::verb::post, "/v1/emit_gradient?name=g&step=1&trainer=0",
                            floatsBody(std::vector<float>(8, 100.0f)), kRaw),
                  409, "conflict");
  CHECK(m.find("trainer 0") != std::string::npos);
  // Without 'trainer' with two local trainers: 400.
  expectError(b.request(http::verb::post, "/v1/emit_gradient?name=g&step=1",
                        floatsBody(std::vector<float>(8, 1.0f)), kRaw),
              400, "invalid_argument");
  // Trainer 1 completes the step; both get the mean (trainer 0's in its buffer).
  const Res r1 = t1.request(http::verb::post, "/v1/emit_gradient?name=g&step=1&trainer=1",
                            floatsBody(std::vector<float>(8, 5.0f)), kRaw);
  REQUIRE_MESSAGE(r1.result_int() == 200, r1.body());
  CHECK(bodyFloats(r1.body()) == std::vector<float>(8, 3.0f));
  const Res r0 = a.receive();
  REQUIRE_MESSAGE(r0.result_int() == 200, r0.body());
  CHECK(parseObject(r0.body()).at("elements").to_number<uint64_t>() == 8);
  for (int i = 0; i < 8; ++i) CHECK(seg.floats()[i] == 3.0f);

  // Step 1 again, or before it: backwards.
  for (const char* step : {"1", "0"}) {
    m = expectError(
        b.request(http::verb::post, std::string("/v1/emit_gradient?name=g&trainer=0&step=") + step,
                  floatsBody(std::vector<float>(8, 1.0f)), kRaw),
        409, "conflict");
    CHECK(m.find("backwards") != std::string::npos);
  }
  // A dtype change between the trainers of one step.
  a.send(http::verb::post, "/v1/emit_gradient?name=g&step=2&trainer=0",
         floatsBody(std::vector<float>(8, 1.0f)), kRaw);
  waitPending(s.engine, "g");
  expectError(b.request(http::verb::post, "/v1/emit_gradient?name=g&step=2&trainer=1&dtype=float16",
                        std::string(32, '\0'), kRaw),
              409, "conflict");
  const Res r2b = b.request(http::verb::post, "/v1/emit_gradient?name=g&step=2&trainer=1",
                            floatsBody(std::vector<float>(8, 3.0f)), kRaw);
  CHECK(r2b.result_int() == 200);
  CHECK(a.receive().result_int() == 200);
}

TEST_CASE("a step whose other trainer never comes gets 504 over HTTP") {
  ServeConfig config;
  config.local_trainers = 2;
  Stack s(config, {}, std::chrono::milliseconds(200));
  Client c = s.unixClient();
  const std::string m =
      expectError(c.request(http::verb::post, "/v1/emit_gradient?name=g&step=1&trainer=0",
                            floatsBody({1, 2}), kRaw),
                  504, "deadline_exceeded");
  CHECK(m.find("trainer(s) 1 ") != std::string::npos);
  // The connection is still usable.
  CHECK(c.get("/healthz").result_int() == 200);
}

TEST_CASE("the admin listener serves health, metrics and status only") {
  Stack s;
  Client control = s.unixClient();
  REQUIRE(
      control.request(http::verb::post, "/v1/emit_gradient?name=w&step=1", floatsBody({1}), kRaw)
          .result_int() == 200);
  expectError(
      control.request(http::verb::post, "/v1/emit_gradient?name=w&step=x", floatsBody({1}), kRaw),
      400, "invalid_argument");
  Client admin = s.adminClient();
  Res r = admin.get("/healthz");
  CHECK(r.result_int() == 200);
  CHECK(r.body() == "ok\n");
  r = admin.get("/readyz");
  CHECK(r.result_int() == 200);
  r = admin.get("/v1/status");
  CHECK(r.result_int() == 200);
  const auto st = parseObject(r.body());
  CHECK(st.at("listeners").at("admin_port").to_number<uint64_t>() == s.admin_port);
  CHECK(st.at("tensors").as_array().size() == 1);
  r = admin.get("/metrics");
  REQUIRE(r.result_int() == 200);
  CHECK(r.body().find("lightwire_steps_total") != std::string::npos);
  CHECK(r.body().find(R"(lightwire_http_requests_total{code="400",route="/v1/emit_gradient"} 1)") !=
        std::string::npos);
  CHECK(r.body().find(R"(lightwire_http_requests_total{code="200",route="/v1/emit_gradient"} 1)") !=
        std::string::npos);
  for (const char* target : {"/v1/emit_gradient?name=w&step=2", "/v1/buffers", "/v1/config"}) {
    CAPTURE(target);
    // A control route is not found there; with a body it is refused from its headers (413).
    expectError(admin.request(http::verb::post, target), 404, "not_found");
    Client with_body = s.adminClient();
    expectError(with_body.request(http::verb::post, target, floatsBody({1}), kRaw), 413,
                "too_large");
    CHECK(with_body.closedWithin(kTimeoutMs));
  }
  const auto after = parseObject(admin.get("/v1/status").body());
  CHECK(after.at("steps").at("ok").to_number<uint64_t>() == 1);
  s.api.setStopping();
  CHECK(admin.get("/readyz").result_int() == 503);
  expectError(
      control.request(http::verb::post, "/v1/emit_gradient?name=w&step=5", floatsBody({1}), kRaw),
      503, "shutting_down");
}

TEST_CASE("PUT /v1/config changes the codec of the next step; a bad density changes nothing") {
  Stack s;
  Client c = s.unixClient();
  const std::vector<float> v(64, 1.0f);
  auto emit = [&](int step) {
    return c.request(http::verb::post, "/v1/emit_gradient?name=w&step=" + std::to_string(step),
                     floatsBody(v), kRaw);
  };
  CHECK(emit(1)["X-Lightwire-Codec"] == "none");
  const Res put = c.request(http::verb::put, "/v1/config",
                            R"({"default": {"codec": "topk", "density": 0.5}})", kJson);
  REQUIRE_MESSAGE(put.result_int() == 200, put.body());
  CHECK(parseObject(put.body()).at("applied").get_bool());
  CHECK(emit(2)["X-Lightwire-Codec"] == "topk");
  const std::string before = snapshot(c);
  for (const std::string body : {R"({"default": {"codec": "topk", "density": 2}})",
                                 R"({"default": {"codec": "topk", "density": -0.1}})",
                                 R"({"default": {"codec": "topk", "density": "x"}})"}) {
    CAPTURE(body);
    const std::string m =
        expectError(c.request(http::verb::put, "/v1/config", body, kJson), 400, "invalid_argument");
    CHECK(m.find("density") != std::string::npos);
  }
  expectError(c.request(http::verb::put, "/v1/config", R"({"default": {"codec": "zip"}})", kJson),
              400, "invalid_argument");
  CHECK(snapshot(c) == before);
  const auto st = parseObject(c.get("/v1/status").body());
  CHECK(st.at("config").at("compression").at("default").at("codec").get_string() == "topk");
  CHECK(emit(3)["X-Lightwire-Codec"] == "topk");
}

TEST_CASE("a token guards TCP control requests and PUT /v1/config everywhere") {
  ServeConfig config;
  config.token = "s3cret-token";
  Stack s(config);
  const std::string body = floatsBody({1, 2, 3});
  const std::map<std::string, std::string> good = {{"Authorization", "Bearer s3cret-token"}};
  const std::map<std::string, std::string> bad = {{"Authorization", "Bearer s3cret-tokeN"}};
  for (const auto* headers :
       {&bad, static_cast<const std::map<std::string, std::string>*>(nullptr)}) {
    // A body without the token is refused from the headers, unread: the connection closes.
    Client refused = s.tcpClient();
    const Res res = refused.request(http::verb::post, "/v1/emit_gradient?name=w&step=1", body, kRaw,
                                    headers ? *headers : std::map<std::string, std::string>{});
    expectError(res, 401, "unauthenticated");
    CHECK(res.body().find("s3cret") == std::string::npos);
    CHECK(res[http::field::www_authenticate] == "Bearer");
    CHECK(refused.closedWithin(kTimeoutMs));
  }
  // A request without a body gets 401 on a connection that goes on.
  Client tcp = s.tcpClient();
  expectError(tcp.get("/v1/status"), 401, "unauthenticated");
  CHECK(tcp.request(http::verb::post, "/v1/emit_gradient?name=w&step=1", body, kRaw, good)
            .result_int() == 200);
  // The Unix socket needs no token, except for PUT /v1/config.
  Client ux = s.unixClient();
  CHECK(ux.request(http::verb::post, "/v1/emit_gradient?name=w&step=2", body, kRaw).result_int() ==
        200);
  const std::string cfg = R"({"default": {"codec": "none"}})";
  expectError(ux.request(http::verb::put, "/v1/config", cfg, kJson), 401, "unauthenticated");
  CHECK(ux.request(http::verb::put, "/v1/config", cfg, kJson, good).result_int() == 200);
  CHECK(tcp.request(http::verb::put, "/v1/config", cfg, kJson, good).result_int() == 200);
  // The admin listener needs none; the status never shows the token.
  Client admin = s.adminClient();
  const Res st = admin.get("/v1/status");
  CHECK(st.result_int() == 200);
  CHECK(st.body().find("s3cret") == std::string::npos);
  CHECK(admin.get("/metrics").body().find("s3cret") == std::string::npos);
}

/// Waits until the exposition holds `line` (a count follows the close that a timer caused).
bool exposes(metrics::Metrics& m, const std::string& line, int ms = 3000) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (m.exposition().find(line) == std::string::npos) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

TEST_CASE("kept-alive clients wait idle_timeout; silent and trickling ones only header_timeout") {
  HttpLimits limits;
  limits.idle_timeout = std::chrono::milliseconds(1500);
  limits.header_timeout = std::chrono::milliseconds(300);
  Stack s({}, limits);
  for (bool over_tcp : {false, true}) {
    CAPTURE(over_tcp);
    // A new connection that sends nothing is a stalled client: cut by the header deadline.
    Client silent = over_tcp ? s.tcpClient() : s.unixClient();
    auto t0 = std::chrono::steady_clock::now();
    CHECK(silent.closedWithin(3000));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1400));
    // After a request, the kept-alive connection may idle longer, then is closed as well.
    Client used = over_tcp ? s.tcpClient() : s.unixClient();
    CHECK(used.get("/healthz").result_int() == 200);
    t0 = std::chrono::steady_clock::now();
    CHECK_FALSE(used.closedWithin(800));  // past the header deadline, still open
    CHECK(used.closedWithin(3000));
    CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(1300));
    // Its next request trickling its headers is cut by the header deadline, not the idle one.
    Client trickle = over_tcp ? s.tcpClient() : s.unixClient();
    CHECK(trickle.get("/healthz").result_int() == 200);
    trickle.sendRaw("GET /healthz HTTP/1.1\r\nHost:");
    t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10 && !trickle.closedWithin(100); ++i) trickle.sendRaw(" x", true);
    CHECK(trickle.closedWithin(3000));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1400));
  }
  // Counted per listener: the silent and the trickling client of each; the idle ones are not.
  CHECK(exposes(s.metrics,
                R"(lightwire_limit_hits_total{limit="header_timeout",listener="unix"} 2)"));
  CHECK(exposes(s.metrics,
                R"(lightwire_limit_hits_total{limit="header_timeout",listener="control_tcp"} 2)"));
}

TEST_CASE("a slow body is cut once it falls behind min_body_rate, and holds little budget") {
  HttpLimits limits;
  limits.header_timeout = std::chrono::milliseconds(300);
  limits.min_body_rate = 1 << 20;  // checked every 64 KiB: 0.3 s of grace + 62.5 ms
  limits.idle_timeout = std::chrono::seconds(30);
  limits.max_inflight_body_bytes = 16 << 20;
  Stack s({}, limits);
  // Three clients declare 1 GiB bodies and trickle them: each holds only 4 MiB of the 16 MiB
  // budget (the part reserved ahead of what has arrived), so a trainer's body still fits.
  std::vector<Client> slow;
  for (int i = 0; i < 3; ++i) {
    slow.push_back(s.unixClient());
    slow.back().sendRaw("POST /v1/emit_gradient?name=s" + std::to_string(i) +
                        "&step=1 HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                        "Content-Length: 1073741824\r\n\r\n" +
                        std::string(10, 'a'));
  }
  Client fast = s.unixClient();
  CHECK(fast.request(http::verb::post, "/v1/emit_gradient?name=w&step=1",
                     std::string(1 << 20, '\0'), kRaw)
            .result_int() == 200);
  // Trickling one byte every 50 ms, each is cut within the grace plus 64 KiB at the rate.
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 40; ++i) {
    bool all = true;
    for (auto& c : slow) {
      if (!c.closedWithin(1)) {
        c.sendRaw("b", true);
        all = false;
      }
    }
    if (all) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (auto& c : slow) CHECK(c.closedWithin(3000));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1500));
  CHECK(exposes(s.metrics, R"(lightwire_limit_hits_total{limit="body_rate",listener="unix"} 3)"));
  // Nothing stays reserved: 6 MiB fit (not if the cut clients still held their 12 MiB).
  CHECK(fast.request(http::verb::post, "/v1/emit_gradient?name=w&step=2",
                     std::string(6 << 20, '\0'), kRaw)
            .result_int() == 200);
}

TEST_CASE("a new connection's headers are due header_timeout after its accept, first byte or not") {
  HttpLimits limits;
  limits.header_timeout = std::chrono::milliseconds(600);
  limits.idle_timeout = std::chrono::seconds(30);
  Stack s({}, limits);
  Client late = s.tcpClient();
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(450));  // silent for most of it
  for (int i = 0; i < 30 && !late.closedWithin(50); ++i) late.sendRaw("G", true);
  CHECK(late.closedWithin(3000));
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= std::chrono::milliseconds(550));
  CHECK(took < std::chrono::milliseconds(1000));  // not 600 ms more from the first byte
}

TEST_CASE("a client hanging up mid-request is a close, not a 400") {
  Stack s;
  {
    Client gone = s.unixClient();
    gone.sendRaw("GET /metrics HTTP/1.1\r\nHost:");
  }
  Client c = s.unixClient();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::string text = c.get("/metrics").body();
  CHECK(text.find(R"(code="400")") == std::string::npos);
}

TEST_CASE("HttpServer::stop removes the socket file and refuses new connections") {
  auto s = std::make_unique<Stack>();
  REQUIRE(std::filesystem::exists(s->socket_path));
  {
    Client c = s->unixClient();
    CHECK(c.get("/healthz").result_int() == 200);
    s->server.stop();
    CHECK(c.closedWithin(3000));
  }
  CHECK_FALSE(std::filesystem::exists(s->socket_path));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(s->tcp_port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool connected = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  if (connected) {
    // Accepted by the kernel before the acceptor closed? Then the server must close it.
    FdStream stream(fd);
    CHECK(stream.closedWithin(3000));
  } else {
    ::close(fd);
  }
  s.reset();
}

TEST_CASE("a live socket is not replaced; a stale one is") {
  Stack s;
  HttpServer other(s.io, {}, [](Request&&, const RequestInfo&, Reply reply) {
    reply(errorResponse(http::status::not_found, "not_found", "x"));
  });
  const std::string e = other.listenUnix(s.socket_path, ListenerKind::kControl);
  CHECK(e.find("another process") != std::string::npos);
  // A stale socket file (bound, never listened) is replaced.
  const std::string stale = s.dir.path() + "/stale.sock";
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, stale.c_str(), stale.size() + 1);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  ::close(fd);
  CHECK(other.listenUnix(stale, ListenerKind::kControl) == "");
  other.stop();
  CHECK_FALSE(std::filesystem::exists(stale));
}

TEST_CASE("a large body's string is reused for the next large body, within its capacity") {
  // An echo server that records where each body's bytes were: the reply is the request's own
  // string, as on the raw emit path.
  Stack s;
  std::mutex mu;
  std::vector<const char*> seen;
  std::vector<size_t> capacity;
  HttpServer echo(s.io, {}, [&](Request&& req, const RequestInfo&, Reply reply) {
    {
      std::lock_guard lock(mu);
      seen.push_back(req.body().data());
      capacity.push_back(req.body().capacity());
    }
    Response r{http::status::ok, 11};
    r.body() = std::move(req.body());
    reply(std::move(r));
  });
  const std::string path = s.dir.path() + "/echo.sock";
  REQUIRE(echo.listenUnix(path, ListenerKind::kControl) == "");
  const std::string big(1 << 20, 'a'), smaller((1 << 20) - 4096, 'b'), larger((2 << 20), 'c');
  {
    Client c = Client::unixSocket(path);
    CHECK(c.request(http::verb::post, "/x", big).body() == big);
    CHECK(c.request(http::verb::post, "/x", smaller).body() == smaller);  // fits: reused
  }
  {
    Client c = Client::unixSocket(path);  // another connection: the strings are the server's
    CHECK(c.request(http::verb::post, "/x", big).body() == big);
    CHECK(c.request(http::verb::post, "/x", larger).body() == larger);  // does not fit: new
    CHECK(c.request(http::verb::post, "/x", "small").body() == "small");
  }
  echo.stop();
  std::lock_guard lock(mu);
  REQUIRE(seen.size() == 5);
  // The smaller body was read into the first one's string: its room, not its own size.
  CHECK(capacity[1] == capacity[0]);
  CHECK(capacity[1] > smaller.size());
  CHECK(seen[1] == seen[0]);
  CHECK(seen[2] == seen[0]);
  CHECK(seen[3] != seen[0]);
}

TEST_CASE("HEAD, pipelined requests, HTTP/1.0 and Expect: 100-continue") {
  Stack s;
  SUBCASE("HEAD gets headers only, and the connection goes on") {
    Client c = s.adminClient();
    c.sendRaw("HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    http::response_parser<http::string_body> head;
    head.skip(true);
    Res res = c.receive(head);
    CHECK(res.result_int() == 200);
    CHECK(res.body().empty());
    res = c.receive();
    CHECK(res.result_int() == 200);
    CHECK(res.body() == "ok\n");
  }
  SUBCASE("two pipelined requests get two replies in order") {
    Client c = s.unixClient();
    const std::string body = floatsBody({4, 5});
    c.sendRaw(
        "POST /v1/emit_gradient?name=p&step=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n" +
        body + "GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n");
    Res r1 = c.receive();
    CHECK(r1.result_int() == 200);
    CHECK(r1.body() == body);
    expectError(c.receive(), 404, "not_found");
  }
  SUBCASE("HTTP/1.0 without keep-alive: one reply, then the server closes") {
    Client c = s.unixClient();
    c.sendRaw("GET /healthz HTTP/1.0\r\n\r\n");
    Res r = c.receive();
    CHECK(r.result_int() == 200);
    CHECK(r.version() == 10);
    CHECK(c.closedWithin(kTimeoutMs));
  }
  SUBCASE("Expect: 100-continue") {
    Client c = s.unixClient();
    const std::string body = floatsBody({1, 2});
    c.sendRaw(
        "POST /v1/emit_gradient?name=e&step=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n"
        "Expect: 100-continue\r\n\r\n");
    http::response_parser<http::string_body> cont;
    cont.skip(true);
    CHECK(c.receive(cont).result_int() == 100);
    c.sendRaw(body);
    Res r = c.receive();
    CHECK(r.result_int() == 200);
    CHECK(r.body() == body);
  }
  SUBCASE("a malformed request line gets 400 and the connection closes") {
    Client c = s.unixClient();
    c.sendRaw("NOT HTTP\r\n\r\n");
    expectError(c.receive(), 400, "invalid_argument");
    CHECK(c.closedWithin(kTimeoutMs));
  }
}

/// A connection over its listener's budget: answered 503 `busy` with Retry-After, then closed.
void expectBusy(Client& c) {
  const Res r = c.receive();
  const std::string m = expectError(r, 503, "busy");
  CHECK(m.find("max_connections") != std::string::npos);
  CHECK(r[http::field::retry_after] == "1");
  CHECK(c.closedWithin(kTimeoutMs));
}

TEST_CASE("each listener has its own budget: exhausting one leaves the others serving") {
  Budgets budgets;
  budgets.unix_socket.max_connections = 2;
  budgets.control_tcp.max_connections = 2;
  budgets.admin.max_connections = 2;
  Stack s({}, {}, std::chrono::seconds(10), nullptr, budgets);
  // Two trainers on the Unix socket completed a request: they are never evicted.
  Client a = s.unixClient(), b = s.unixClient();
  CHECK(a.get("/healthz").result_int() == 200);
  CHECK(b.get("/healthz").result_int() == 200);
  Client c = s.unixClient();
  expectBusy(c);
  // The TCP control listener and the admin listener serve on.
  Client t = s.tcpClient(), m = s.adminClient();
  CHECK(t.get("/healthz").result_int() == 200);
  CHECK(m.get("/healthz").result_int() == 200);
  CHECK(a.get("/healthz").result_int() == 200);
  CHECK(b.get("/healthz").result_int() == 200);
  CHECK(s.server.connections("unix") == 2);
  CHECK(s.server.connections("admin") == 1);
  const std::string text = m.get("/metrics").body();
  CHECK(text.find(R"(lightwire_limit_hits_total{limit="connections",listener="unix"} 1)") !=
        std::string::npos);
  CHECK(text.find(R"(lightwire_limit_hits_total{limit="connections",listener="admin"} 0)") !=
        std::string::npos);
}

TEST_CASE("health answers with the admin listener full of stalled clients: the oldest is evicted") {
  Budgets budgets;
  budgets.admin.max_connections = 4;
  HttpLimits limits;
  limits.header_timeout = std::chrono::seconds(30);  // the stalled stay until evicted
  Stack s({}, limits, std::chrono::seconds(10), nullptr, budgets);
  // A scraper that completed a request: kept.
  Client scraper = s.adminClient();
  CHECK(scraper.get("/metrics").result_int() == 200);
  // Three stalled clients fill the budget (one byte of headers each, or nothing at all).
  std::vector<Client> stalled;
  for (int i = 0; i < 3; ++i) {
    stalled.push_back(s.adminClient());
    if (i < 2) stalled.back().sendRaw("GET /metrics HTTP/1.1\r\nHost");
  }
  std::vector<Client> probes;  // kept open: each new one must make room
  for (int probe = 0; probe < 3; ++probe) {
    CAPTURE(probe);
    // Each new probe evicts the oldest stalled client and is answered.
    probes.push_back(s.adminClient());
    CHECK(probes.back().get("/healthz").result_int() == 200);
    CHECK(stalled[static_cast<size_t>(probe)].closedWithin(kTimeoutMs));
  }
  // The scraper was never evicted.
  CHECK(scraper.get("/healthz").result_int() == 200);
  CHECK(exposes(s.metrics, R"(lightwire_limit_hits_total{limit="evicted",listener="admin"} 3)"));
}

TEST_CASE("eviction takes a stalled request, never a trainer's kept-alive connection") {
  Budgets budgets;
  budgets.unix_socket.max_connections = 3;
  HttpLimits limits;
  limits.header_timeout = std::chrono::seconds(30);
  Stack s({}, limits, std::chrono::seconds(10), nullptr, budgets);
  Client stalled = s.unixClient();
  stalled.sendRaw("POST /v1/emit_gradient?name=w&step=1 HTTP/1.1\r\nHost: x\r\n");
  // Two trainers, newer than the stalled client, idle on keep-alive between steps.
  Client t0 = s.unixClient(), t1 = s.unixClient();
  CHECK(t0.get("/healthz").result_int() == 200);
  CHECK(t1.get("/healthz").result_int() == 200);
  Client next = s.unixClient();  // evicts the stalled one
  CHECK(next.get("/healthz").result_int() == 200);
  CHECK(stalled.closedWithin(kTimeoutMs));
  // All three now completed a request: a fourth is refused, and nobody is evicted.
  Client fourth = s.unixClient();
  expectBusy(fourth);
  for (Client* c : {&t0, &t1, &next}) CHECK(c->get("/healthz").result_int() == 200);
}

TEST_CASE("the TCP control listener trusts a request with the token: never evicted") {
  ServeConfig config;
  config.token = "tok";
  Budgets budgets;
  budgets.control_tcp.max_connections = 2;
  HttpLimits limits;
  limits.header_timeout = std::chrono::seconds(30);
  Stack s(config, limits, std::chrono::seconds(10), nullptr, budgets);
  const std::map<std::string, std::string> good = {{"Authorization", "Bearer tok"}};
  // A trainer whose step is still being sent (headers with the token, body underway).
  Client trainer = s.tcpClient();
  trainer.sendRaw(
      "POST /v1/emit_gradient?name=w&step=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
      "tok\r\nContent-Type: application/octet-stream\r\nContent-Length: 8\r\n\r\n");
  Client stalled = s.tcpClient();  // nothing sent
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Client next = s.tcpClient();  // evicts `stalled`, not the older trainer
  CHECK(next.request(http::verb::get, "/healthz", {}, {}, good).result_int() == 200);
  CHECK(stalled.closedWithin(kTimeoutMs));
  trainer.sendRaw(floatsBody({1, 2}));
  CHECK(trainer.receive().result_int() == 200);
}

TEST_CASE("per-source caps refuse the excess from one address and admit another") {
  Budgets budgets;
  budgets.admin.max_per_source = 2;
  budgets.control_tcp.max_per_source = 1;
  Stack s({}, {}, std::chrono::seconds(10), nullptr, budgets);
  Client a = Client::tcp(s.admin_port, "127.0.0.1"), b = Client::tcp(s.admin_port, "127.0.0.1");
  CHECK(a.get("/healthz").result_int() == 200);
  CHECK(b.get("/healthz").result_int() == 200);
  Client c = Client::tcp(s.admin_port, "127.0.0.1");
  const Res r = c.receive();
  expectError(r, 503, "busy");
  CHECK(c.closedWithin(kTimeoutMs));
  Client other = Client::tcp(s.admin_port, "127.0.0.2");
  CHECK(other.get("/healthz").result_int() == 200);
  {
    Client t = Client::tcp(s.tcp_port, "127.0.0.3");
    CHECK(t.get("/healthz").result_int() == 200);
    Client t2 = Client::tcp(s.tcp_port, "127.0.0.3");
    expectError(t2.receive(), 503, "busy");
  }
  // A source's slot is free again once its connection ends.
  bool admitted = false;
  for (int i = 0; i < 100 && !admitted; ++i) {
    if (s.server.connections("control_tcp") == 0) {
      Client again = Client::tcp(s.tcp_port, "127.0.0.3");
      admitted = again.get("/healthz").result_int() == 200;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(admitted);
  const std::string text = other.get("/metrics").body();
  CHECK(text.find(
            R"(lightwire_limit_hits_total{limit="connections_per_source",listener="admin"} 1)") !=
        std::string::npos);
  CHECK(
      text.find(
          R"(lightwire_limit_hits_total{limit="connections_per_source",listener="control_tcp"} 1)") !=
      std::string::npos);
}

/// A child process that runs `prepare` (async-signal-safe calls only), connects to the Unix
/// socket at `path`, asks GET /healthz and exits 0 when the answer is 200. Returns its pid.
template <typename Prepare>
pid_t childHealthz(const std::string& path, Prepare prepare) {
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child != 0) return child;
  if (!prepare()) _exit(2);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) _exit(3);
  const char req[] = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
  if (::write(fd, req, sizeof req - 1) != static_cast<ssize_t>(sizeof req - 1)) _exit(4);
  char buf[64] = {};
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  _exit(n > 12 && std::string_view(buf, 12) == "HTTP/1.1 200" ? 0 : 5);
}

/// The exit code of a child (-1 when it did not exit normally).
int exitCode(pid_t child) {
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST_CASE("the Unix socket caps connections per user id (SO_PEERCRED)") {
  if (::geteuid() != 0) {
    MESSAGE("skipped: needs root to connect as another user");
    return;
  }
  ServeConfig config;
  config.control_socket_mode = 0666;  // so that another user may connect at all
  Budgets budgets;
  budgets.unix_socket.max_per_source = 1;
  Stack s(config, {}, std::chrono::seconds(10), nullptr, budgets);
  namespace fs = std::filesystem;
  fs::permissions(s.dir.path(),
                  fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
  fs::permissions(s.dir.path() + "/run",
                  fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
  Client root = s.unixClient();
  CHECK(root.get("/healthz").result_int() == 200);
  Client again = s.unixClient();
  expectError(again.receive(), 503, "busy");
  // Another user id is admitted: a child process as nobody (65534) connects and asks /healthz.
  const pid_t child = childHealthz(s.socket_path, [] {
    return ::setresgid(65534, 65534, 65534) == 0 && ::setresuid(65534, 65534, 65534) == 0;
  });
  CHECK(exitCode(child) == 0);
}

TEST_CASE("bodies are refused at header time where they do not belong, before any reservation") {
  ServeConfig config;
  config.token = "tok";
  HttpLimits limits;
  limits.max_inflight_body_bytes = 1 << 20;
  Stack s(config, limits);
  // The admin listener takes no bodies: a 1 GiB declaration is answered at once, 413.
  Client admin = s.adminClient();
  admin.sendRaw("POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1073741824\r\n\r\n");
  const Res r = admin.receive();
  expectError(r, 413, "too_large");
  CHECK(admin.closedWithin(kTimeoutMs));
  // The token-protected TCP control listener refuses an unauthenticated body from its headers.
  Client tcp = s.tcpClient();
  tcp.sendRaw(
      "POST /v1/emit_gradient?name=w&step=1 HTTP/1.1\r\nHost: x\r\n"
      "Content-Type: application/octet-stream\r\nContent-Length: 1000000\r\n\r\n");
  const Res u = tcp.receive();
  expectError(u, 401, "unauthenticated");
  CHECK(u[http::field::www_authenticate] == "Bearer");
  CHECK(tcp.closedWithin(kTimeoutMs));
  // Nothing was reserved: a body of the whole budget is still accepted.
  Client ux = s.unixClient();
  CHECK(ux.request(http::verb::post, "/v1/emit_gradient?name=w&step=1", std::string(1 << 20, '\0'),
                   kRaw)
            .result_int() == 200);
  const std::string text = ux.get("/metrics").body();
  CHECK(
      text.find(
          R"(lightwire_limit_hits_total{limit="inflight_body_bytes",listener="control_tcp"} 0)") !=
      std::string::npos);
}

TEST_CASE("accept errors back off instead of spinning") {
  Stack s;
  // Fill this process's descriptor table, so that accept() fails with EMFILE.
  struct rlimit saved {};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
  int highest = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1) highest = fd;
  }
  struct rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(highest + 32);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
  std::vector<int> filler;
  for (int fd; (fd = ::dup(0)) >= 0;) filler.push_back(fd);
  // A client in another process (its descriptors are its own) connects and waits for a reply.
  const pid_t child = childHealthz(s.socket_path, [&filler] {
    for (int fd : filler) ::close(fd);
    return true;
  });
  auto hits = [&] { return s.metrics.limitHits("accept_errors", "unix").Value(); };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (hits() < 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const double during = hits();
  for (int fd : filler) ::close(fd);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &saved) == 0);
  // 10 ms doubling to 1 s: a handful of tries in 1.5 s, not the thousands of a spinning loop.
  CHECK(during >= 1);
  CHECK(during <= 12);
  // Descriptors free again: the waiting client is accepted and answered.
  CHECK(exitCode(child) == 0);
}

TEST_CASE("a buffer shrunk while its step waits fails the step without touching it") {
  ServeConfig config;
  config.local_trainers = 2;
  Stack s(config);
  const std::string name = "/lw-api-shrink2-" + std::to_string(::getpid());
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, 8192) == 0);
  Client a = s.unixClient(), b = s.unixClient();
  const std::string id = registerShm(a, name, 8192);
  a.send(http::verb::post, "/v1/emit_gradient",
         R"({"name": "g", "step": 1, "trainer": 0, "buffer": ")" + id +
             R"(", "offset": 4096, "shape": [16]})",
         kJson);
  waitPending(s.engine, "g");
  REQUIRE(::ftruncate(fd, 100) == 0);
  const Res r1 = b.request(http::verb::post, "/v1/emit_gradient?name=g&step=1&trainer=1",
                           floatsBody(std::vector<float>(16, 1.0f)), kRaw);
  expectError(r1, 409, "conflict");
  expectError(a.receive(), 409, "conflict");
  const auto st = parseObject(a.get("/v1/status").body());
  CHECK(st.at("tensors").at(0).at("last_committed_step").is_null());
  ::close(fd);
  ::shm_unlink(name.c_str());
}

TEST_CASE("a client that leaves while its step waits does not disturb the others") {
  ServeConfig config;
  config.local_trainers = 2;
  Stack s(config);
  {
    Client gone = s.unixClient();
    gone.send(http::verb::post, "/v1/emit_gradient?name=g&step=1&trainer=0", floatsBody({2, 2}),
              kRaw);
    waitPending(s.engine, "g");
  }
  Client b = s.tcpClient();
  const Res r = b.request(http::verb::post, "/v1/emit_gradient?name=g&step=1&trainer=1",
                          floatsBody({4, 4}), kRaw);
  CHECK(r.result_int() == 200);
  CHECK(bodyFloats(r.body()) == std::vector<float>{3, 3});
  CHECK(b.get("/healthz").result_int() == 200);
}

TEST_CASE("a buffer released while its step waits is unmapped only after the step") {
  ServeConfig config;
  config.local_trainers = 2;
  Stack s(config);
  ClientSegment seg(256);
  Client a = s.unixClient(), b = s.unixClient();
  const std::string id = registerShm(a, seg.name(), 256);
  for (int i = 0; i < 4; ++i) seg.floats()[i] = 2.0f;
  a.send(http::verb::post, "/v1/emit_gradient",
         R"({"name": "g", "step": 1, "trainer": 0, "buffer": ")" + id + R"(", "shape": [4]})",
         kJson);
  waitPending(s.engine, "g");
  CHECK(b.request(http::verb::delete_, "/v1/buffers/" + id).result_int() == 200);
  const Res r1 = b.request(http::verb::post, "/v1/emit_gradient?name=g&step=1&trainer=1",
                           floatsBody(std::vector<float>(4, 4.0f)), kRaw);
  CHECK(r1.result_int() == 200);
  CHECK(a.receive().result_int() == 200);
  for (int i = 0; i < 4; ++i) CHECK(seg.floats()[i] == 3.0f);
}

TEST_CASE("stopping answers waiting steps with 503 and closes their connections") {
  ServeConfig config;
  config.local_trainers = 2;
  Stack s(config);
  Client a = s.unixClient(), idle = s.tcpClient();
  CHECK(idle.get("/healthz").result_int() == 200);
  a.send(http::verb::post, "/v1/emit_gradient?name=g&step=1&trainer=0", floatsBody({1}), kRaw);
  waitPending(s.engine, "g");
  s.api.setStopping();
  s.server.stop();
  s.engine.shutdown();
  const Res r = a.receive();
  expectError(r, 503, "shutting_down");
  CHECK_FALSE(r.keep_alive());
  CHECK(a.closedWithin(kTimeoutMs));
  CHECK(idle.closedWithin(kTimeoutMs));
  CHECK_FALSE(std::filesystem::exists(s.socket_path));
}

TEST_CASE("three trainers on their own connections and threads, many steps of two tensors") {
  ServeConfig config;
  config.local_trainers = 3;
  Stack s(config);
  constexpr int kSteps = 30;
  std::atomic<int> wrong{0}, failed{0};
  std::vector<std::thread> trainers;
  for (unsigned k = 0; k < 3; ++k) {
    trainers.emplace_back([&, k] {
      Client c = k == 1 ? s.tcpClient() : s.unixClient();
      for (int step = 1; step <= kSteps; ++step) {
        for (const char* tensor : {"a.weight", "b.bias"}) {
          const float v = k == 0 ? 1.0f : k == 1 ? 2.0f : 6.0f;
          const Res r = c.request(http::verb::post,
                                  std::string("/v1/emit_gradient?name=") + tensor + "&step=" +
                                      std::to_string(step) + "&trainer=" + std::to_string(k),
                                  floatsBody(std::vector<float>(1000, v * step)), kRaw);
          if (r.result_int() != 200) {
            ++failed;
            continue;
          }
          for (float x : bodyFloats(r.body())) wrong += x != 3.0f * static_cast<float>(step);
        }
      }
    });
  }
  for (auto& t : trainers) t.join();
  CHECK(failed.load() == 0);
  CHECK(wrong.load() == 0);
  CHECK(s.engine.stepsOk() == 2 * kSteps);
}

namespace {

/// A POST /v1/buffers request for `size` bytes of segment `name`.
std::string bufferRequest(const std::string& name, size_t size) {
  const std::string body = R"({"name": ")" + name + R"(", "size": )" + std::to_string(size) + "}";
  return "POST /v1/buffers HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
         "Content-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body;
}

/// A client in a child process of its own (a trainer, to the sidecar): it becomes `user` (when
/// not 0), sends `request` over the Unix socket with plain system calls (the parent has threads),
/// passes the reply's first bytes back, then exits, or waits to be killed when `stay`.
struct ChildClient {
  ChildClient(const std::string& socket_path, const std::string& request, uid_t user, bool stay) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket_path.c_str(), sizeof addr.sun_path - 1);
    int out[2];
    REQUIRE(::pipe(out) == 0);
    pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      char buf[1024];
      ssize_t n = 0;
      const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
      if ((user != 0 && (::setgid(user) != 0 || ::setuid(user) != 0)) || fd < 0 ||
          ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
          ::write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size()) ||
          (n = ::read(fd, buf, sizeof buf)) <= 0 || ::write(out[1], buf, n) != n) {
        ::_exit(1);
      }
      ::close(out[1]);
      if (stay) ::pause();
      ::_exit(0);
    }
    ::close(out[1]);
    read_fd = out[0];
  }
  ~ChildClient() {
    if (read_fd >= 0) ::close(read_fd);
    if (status < 0) kill();
  }
  /// The reply as far as the child passed it on (read until it closes its end).
  std::string reply() {
    std::string r;
    char buf[1024];
    for (ssize_t n; (n = ::read(read_fd, buf, sizeof buf)) > 0;) r.append(buf, n);
    return r;
  }
  void kill() {
    ::kill(pid, SIGKILL);
    wait();
  }
  int exitCode() {
    wait();
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  void wait() {
    if (status < 0) REQUIRE(::waitpid(pid, &status, 0) == pid);
  }
  pid_t pid = -1;
  int read_fd = -1;
  int status = -1;
};

}  // namespace

TEST_CASE("buffers belong to the registering process: per-client limit, pid, release on exit") {
  ServeConfig config;
  config.limits.max_buffers_per_client = 2;
  config.control_socket_mode = 0600;
  Stack s(config);
  struct stat st {};
  REQUIRE(::stat(s.socket_path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);

  ClientSegment seg(4096);
  Client mine = s.unixClient();
  registerShm(mine, seg.name(), 4096);
  registerShm(mine, seg.name(), 1024);
  const Res over = mine.request(http::verb::post, "/v1/buffers",
                                R"({"name": ")" + seg.name() + R"(", "size": 64})", kJson);
  CHECK(expectError(over, 429, "limit_reached").find("limits.max_buffers_per_client") !=
        std::string::npos);
  // Over TCP the client is unknown: its own allowance, and no pid.
  Client tcp = s.tcpClient();
  registerShm(tcp, seg.name(), 64);

  // A real child process registers a buffer over the Unix socket and is killed without
  // releasing it.
  ChildClient child(s.socket_path, bufferRequest(seg.name(), 128), /*user=*/0, /*stay=*/true);
  CHECK(child.reply().rfind("HTTP/1.1 201", 0) == 0);
  json::array listed = parseObject(mine.get("/v1/status").body()).at("buffers").as_array();
  REQUIRE(listed.size() == 4);
  CHECK(listed[0].as_object().at("pid").to_number<int>() == ::getpid());
  CHECK(listed[2].as_object().if_contains("pid") == nullptr);  // the TCP client's
  CHECK(listed[3].as_object().at("pid").to_number<int>() == child.pid);
  CHECK(s.api.releaseExitedOwners() == 0);
  child.kill();
  CHECK(s.api.releaseExitedOwners() == 1);
  listed = parseObject(mine.get("/v1/status").body()).at("buffers").as_array();
  CHECK(listed.size() == 3);
  const std::string metrics = mine.get("/metrics").body();
  CHECK(metrics.find(R"(lightwire_buffers_released_total{reason="owner_exited"} 1)") !=
        std::string::npos);
  CHECK(metrics.find("lightwire_registered_buffers 3") != std::string::npos);
  CHECK(metrics.find(R"(lightwire_limit_hits_total{limit="buffers_per_client"} 1)") !=
        std::string::npos);
}

TEST_CASE("a client may register only shared-memory segments of its own user") {
  if (::geteuid() != 0) {
    MESSAGE("skipped: needs root to run a client as another user");
    return;
  }
  Stack s;
  ClientSegment seg(4096);  // owned by root
  // Let user 65534 (nobody) reach the socket: this test only, the sidecar refuses such modes.
  for (std::filesystem::path p = s.socket_path; p != s.dir.path(); p = p.parent_path()) {
    ::chmod(p.c_str(), p == std::filesystem::path(s.socket_path) ? 0666 : 0755);
  }
  ::chmod(s.dir.path().c_str(), 0755);
  ChildClient child(s.socket_path, bufferRequest(seg.name(), 128), /*user=*/65534,
                    /*stay=*/false);
  const std::string reply = child.reply();
  CHECK(child.exitCode() == 0);
  CHECK(reply.rfind("HTTP/1.1 403", 0) == 0);
  CHECK(reply.find("belongs to user 0") != std::string::npos);
  CHECK(s.buffers.count() == 0);
}
