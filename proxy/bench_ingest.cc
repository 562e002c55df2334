#include "proxy/bench_ingest.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

namespace lightwire::proxy {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using unix_socket = asio::local::stream_protocol;
using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

double median(std::vector<double> v) { return percentile(std::move(v), 0.5); }

/// A keep-alive HTTP/1.1 client on the sidecar's Unix socket.
class Client {
 public:
  explicit Client(const std::string& path) : socket_(io_) {
    socket_.connect(unix_socket::endpoint(path));
    socket_.set_option(asio::socket_base::receive_buffer_size(4 << 20));
    socket_.set_option(asio::socket_base::send_buffer_size(4 << 20));
    buffer_.reserve(size_t{1} << 20);  // Beast reads at most the free capacity per call
  }
  /// A request whose large body and reply reuse the caller's buffers (a benchmark client should
  /// not be the bottleneck): `body` is sent and left as it was; the reply body goes into `reply`,
  /// resized to fit. Returns the status.
  http::status requestReuse(const std::string& target, std::string& body, std::string& reply) {
    http::request<http::string_body> req{http::verb::post, target, 11};
    req.set(http::field::host, "lightwire");
    req.set(http::field::content_type, "application/octet-stream");
    req.body().swap(body);
    req.prepare_payload();
    beast::error_code ec;
    http::write(socket_, req, ec);
    req.body().swap(body);
    if (ec) throw std::runtime_error("write: " + ec.message());
    http::response_parser<http::buffer_body> parser;
    parser.body_limit(uint64_t{4} << 30);
    http::read_header(socket_, buffer_, parser);
    const auto length = parser.content_length();
    if (!length) throw std::runtime_error("reply without Content-Length");
    if (reply.size() < *length) reply.resize(*length);
    size_t got = 0;
    while (!parser.is_done()) {
      parser.get().body().data = reply.data() + got;
      parser.get().body().size = reply.size() - got;
      http::read(socket_, buffer_, parser, ec);
      if (ec == http::error::need_buffer) ec = {};
      if (ec) throw std::runtime_error("read: " + ec.message());
      got = reply.size() - parser.get().body().size;
    }
    reply.resize(got);
    return parser.get().result();
  }

  http::response<http::string_body> request(http::verb verb, const std::string& target,
                                            std::string body, const char* type) {
    http::request<http::string_body> req{verb, target, 11};
    req.set(http::field::host, "lightwire");
    req.set(http::field::content_type, type);
    req.body() = std::move(body);
    req.prepare_payload();
    http::write(socket_, req);
    http::response_parser<http::string_body> parser;
    parser.body_limit(uint64_t{4} << 30);
    http::read(socket_, buffer_, parser);
    return parser.release();
  }

 private:
  asio::io_context io_;
  unix_socket::socket socket_;
  beast::flat_buffer buffer_;
};

/// The sidecar child process; SIGTERM and wait on destruction.
class Sidecar {
 public:
  /// Starts `exe serve` on `socket`, pinned to `cpu` (with every thread it starts) when >= 0.
  Sidecar(const std::string& exe, const std::string& socket, const std::string& log, int cpu = -1) {
    pid_ = fork();
    if (pid_ == 0) {
      if (cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        sched_setaffinity(0, sizeof set, &set);
      }
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 2);
        dup2(fd, 1);
      }
      execl(exe.c_str(), exe.c_str(), "serve", "--socket", socket.c_str(), "--control-tcp", "",
            "--admin-listen", "", "--codec", "none", "--log-level", "warn", "--max-body-bytes",
            "2000000000", static_cast<char*>(nullptr));
      _exit(127);
    }
    for (int i = 0; i < 200; ++i) {  // up to 10 s for the socket to accept
      try {
        Client probe(socket);
        return;
      } catch (const std::exception&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        throw std::runtime_error("the sidecar exited at start; see " + log);
      }
    }
    throw std::runtime_error("the sidecar did not accept connections within 10 s; see " + log);
  }
  ~Sidecar() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
  }

 private:
  pid_t pid_ = -1;
};

std::string emitTarget(uint64_t step, const char* name = "bench") {
  return std::string("/v1/emit_gradient?name=") + name + "&step=" + std::to_string(step);
}

void expectOk(const http::response<http::string_body>& r, const char* what) {
  if (r.result() != http::status::ok && r.result() != http::status::created) {
    throw std::runtime_error(std::string(what) + ": HTTP " + std::to_string(r.result_int()) + " " +
                             r.body().substr(0, 300));
  }
}

/// A POSIX shared-memory segment created (and unlinked) by the benchmark, as a trainer would.
struct Segment {
  std::string name;
  void* data = MAP_FAILED;
  size_t bytes = 0;
  Segment(std::string n, size_t b) : name(std::move(n)), bytes(b) {
    const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) throw std::runtime_error("shm_open " + name + ": " + std::strerror(errno));
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      close(fd);
      throw std::runtime_error("ftruncate: " + std::string(std::strerror(errno)));
    }
    data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (data == MAP_FAILED) throw std::runtime_error("mmap: " + std::string(std::strerror(errno)));
  }
  ~Segment() {
    if (data != MAP_FAILED) munmap(data, bytes);
    shm_unlink(name.c_str());
  }
};

std::optional<boost::json::object> pythonFigures(const IngestBenchSettings& s,
                                                 const std::string& socket) {
  const std::string script =
      "import json, sys, time\n"
      "import numpy as np\n"
      "import lightwire\n"
      "c = lightwire.Client(socket_path=sys.argv[1], timeout=30)\n"
      "x = np.arange(1024, dtype=np.float32)\n"
      "runs = int(sys.argv[2])\n"
      "for i in range(200): c.emit_gradient(x, name='py', step=i)\n"
      "t = []\n"
      "for i in range(runs):\n"
      "    t0 = time.perf_counter(); c.emit_gradient(x, name='py', step=200 + i)\n"
      "    t.append(time.perf_counter() - t0)\n"
      "t.sort()\n"
      "print(json.dumps({'p50_us': t[len(t) // 2] * 1e6, 'p99_us': t[int(0.99 * (len(t) - 1) + "
      "0.5)] "
      "* 1e6}))\n";
  const std::string path = std::filesystem::path(socket).parent_path() / "client.py";
  if (FILE* f = std::fopen(path.c_str(), "w")) {
    std::fputs(script.c_str(), f);
    std::fclose(f);
  } else {
    return std::nullopt;
  }
  auto quote = [](const std::string& v) {  // single-quoted for sh
    std::string q = "'";
    for (char ch : v) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    return q + "'";
  };
  const std::string full = "PYTHONPATH=" + quote(s.python_path) + " " + quote(s.python) + " " +
                           quote(path) + " " + quote(socket) + " " + std::to_string(s.small_runs);
  FILE* p = popen(full.c_str(), "r");
  if (p == nullptr) return std::nullopt;
  std::string out;
  char buf[4096];
  size_t got = 0;
  while ((got = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, got);
  if (pclose(p) != 0) return std::nullopt;
  boost::system::error_code ec;
  auto v = boost::json::parse(out, ec);
  if (ec || !v.is_object()) return std::nullopt;
  return v.as_object();
}

}  // namespace

int runIngestBench(const IngestBenchSettings& s) {
  char tmpl[] = "/tmp/lightwire-bench-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string dir = tmpl;
  const std::string socket = dir + "/lightwire.sock";
  boost::json::object result{{"codec", "none"}, {"transport", "unix socket"}};
  int rc = 0;
  try {
    Sidecar sidecar(s.self_exe, socket, dir + "/sidecar.log");
    Client client(socket);
    uint64_t step = 0;

    // 4 KiB round trips from C++: unpinned, and then with the client and a separate sidecar
    // pinned to the same core and to different cores (a round trip costs two wake-ups, and waking
    // a process on another core costs an inter-processor interrupt, dear in a VM).
    std::fprintf(stderr, "lightwire bench ingest: 4 KiB round trips (C++ client) ...\n");
    auto smallRuns = [&](Client& c, uint64_t& st) {
      const std::string small(4096, '\0');
      for (int i = 0; i < 200; ++i) {
        expectOk(c.request(http::verb::post, emitTarget(st++), small, "application/octet-stream"),
                 "4 KiB emit_gradient");
      }
      std::vector<double> lat;
      for (int i = 0; i < s.small_runs; ++i) {
        const auto t0 = Clock::now();
        auto r = c.request(http::verb::post, emitTarget(st++), small, "application/octet-stream");
        lat.push_back(seconds(Clock::now() - t0));
        expectOk(r, "4 KiB emit_gradient");
      }
      return lat;
    };
    {
      const auto lat = smallRuns(client, step);
      result["cpp_4k_p50_us"] = percentile(lat, 0.5) * 1e6;
      result["cpp_4k_p99_us"] = percentile(lat, 0.99) * 1e6;
    }
    cpu_set_t original;
    CPU_ZERO(&original);
    sched_getaffinity(0, sizeof original, &original);
    if (CPU_COUNT(&original) >= 2) {
      std::vector<int> cpus;
      for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c) {
        if (CPU_ISSET(c, &original)) cpus.push_back(c);
      }
      for (const bool same : {true, false}) {
        const std::string pinned_socket = dir + (same ? "/same.sock" : "/split.sock");
        Sidecar pinned(s.self_exe, pinned_socket, dir + "/pinned.log", cpus[0]);
        cpu_set_t mine;
        CPU_ZERO(&mine);
        CPU_SET(same ? cpus[0] : cpus[1], &mine);
        sched_setaffinity(0, sizeof mine, &mine);
        Client pc(pinned_socket);
        uint64_t pst = 0;
        const auto lat = smallRuns(pc, pst);
        sched_setaffinity(0, sizeof original, &original);
        const std::string key = same ? "cpp_4k_same_core" : "cpp_4k_cross_core";
        result[key + "_p50_us"] = percentile(lat, 0.5) * 1e6;
        result[key + "_p99_us"] = percentile(lat, 0.99) * 1e6;
      }
    }

    // 100 MB as an HTTP body, both ways.
    std::fprintf(stderr, "lightwire bench ingest: %zu MB as HTTP bodies ...\n",
                 s.large_bytes / 1000000);
    const size_t large = s.large_bytes / 4 * 4;
    std::string body(large, '\0'), reply;
    std::vector<double> body_s;
    for (int i = 0; i <= s.large_runs; ++i) {
      const auto t0 = Clock::now();
      const auto st = client.requestReuse(emitTarget(step++, "big"), body, reply);
      if (i > 0) body_s.push_back(seconds(Clock::now() - t0));  // the first is the warm-up
      if (st != http::status::ok) {
        throw std::runtime_error("100 MB emit_gradient (body): HTTP " +
                                 std::to_string(static_cast<unsigned>(st)));
      }
      if (reply.size() != large) throw std::runtime_error("100 MB reply has the wrong size");
    }
    result["body_100mb_gbps"] = static_cast<double>(large) / median(body_s) / 1e9;

    // 100 MB through registered shared memory: no tensor bytes on the socket.
    std::fprintf(stderr, "lightwire bench ingest: %zu MB through shared memory ...\n",
                 s.large_bytes / 1000000);
    Segment seg("/lightwire-bench-" + std::to_string(getpid()), large);
    std::memset(seg.data, 0, large);
    auto reg = client.request(
        http::verb::post, "/v1/buffers",
        boost::json::serialize(boost::json::object{{"name", seg.name}, {"size", large}}),
        "application/json");
    expectOk(reg, "POST /v1/buffers");
    const std::string id = std::string(boost::json::parse(reg.body()).at("id").as_string());
    std::vector<double> shm_s;
    for (int i = 0; i <= s.large_runs; ++i) {
      boost::json::object doc{{"name", "big-shm"},
                              {"step", step++},
                              {"buffer", id},
                              {"elements", large / 4},
                              {"dtype", "float32"}};
      const auto t0 = Clock::now();
      auto r = client.request(http::verb::post, "/v1/emit_gradient", boost::json::serialize(doc),
                              "application/json");
      if (i > 0) shm_s.push_back(seconds(Clock::now() - t0));
      expectOk(r, "100 MB emit_gradient (shm)");
    }
    result["shm_100mb_gbps"] = static_cast<double>(large) / median(shm_s) / 1e9;

    // 4 KiB round trips from the Python client.
    if (!s.python.empty()) {
      std::fprintf(stderr, "lightwire bench ingest: 4 KiB round trips (Python client) ...\n");
      if (auto py = pythonFigures(s, socket)) {
        result["python_4k_p50_us"] = py->at("p50_us");
        result["python_4k_p99_us"] = py->at("p99_us");
      } else {
        std::fprintf(stderr,
                     "lightwire bench ingest: the Python client run failed (python %s, "
                     "PYTHONPATH %s)\n",
                     s.python.c_str(), s.python_path.c_str());
        rc = 1;
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lightwire bench ingest: %s\n", e.what());
    rc = 1;
  }
  result["small_runs"] = s.small_runs;
  result["large_bytes"] = s.large_bytes / 4 * 4;
  result["large_runs"] = s.large_runs;
  if (s.json) {
    std::printf("%s\n", boost::json::serialize(result).c_str());
  } else {
    auto num = [&](const char* k) {
      const auto* v = result.if_contains(k);
      return v ? v->to_number<double>() : 0.0;
    };
    std::printf("4 KiB round trip, C++ client:     p50 %8.1f us   p99 %8.1f us\n",
                num("cpp_4k_p50_us"), num("cpp_4k_p99_us"));
    if (result.contains("cpp_4k_same_core_p50_us")) {
      std::printf("  pinned to one core:             p50 %8.1f us   p99 %8.1f us\n",
                  num("cpp_4k_same_core_p50_us"), num("cpp_4k_same_core_p99_us"));
      std::printf("  pinned to two cores:            p50 %8.1f us   p99 %8.1f us\n",
                  num("cpp_4k_cross_core_p50_us"), num("cpp_4k_cross_core_p99_us"));
    }
    if (!s.python.empty()) {
      std::printf("4 KiB round trip, Python client:  p50 %8.1f us   p99 %8.1f us\n",
                  num("python_4k_p50_us"), num("python_4k_p99_us"));
    }
    std::printf("100 MB as HTTP bodies:            %6.2f GB/s\n", num("body_100mb_gbps"));
    std::printf("100 MB through shared memory:     %6.2f GB/s\n", num("shm_100mb_gbps"));
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rc;
}

}  // namespace lightwire::proxy
