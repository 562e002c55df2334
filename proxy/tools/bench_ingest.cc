#include "proxy/tools/bench_ingest.h"

#include <sched.h>
#include <unistd.h>

#include <boost/beast/http.hpp>
#include <boost/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "proxy/tools/bench_util.h"

namespace lightwire::proxy {
namespace {

namespace http = boost::beast::http;
using bench::Client;
using bench::Clock;
using bench::expectOk;
using bench::median;
using bench::percentile;
using bench::seconds;
using bench::Segment;

/// Starts `exe serve` (codec none) on `socket`, pinned to `cpu` when >= 0, and waits until it is
/// ready.
std::unique_ptr<bench::Sidecar> startSidecar(const std::string& exe, const std::string& socket,
                                             const std::string& log, int cpu = -1) {
  bench::Sidecar::Options o;
  o.exe = exe;
  o.socket = socket;
  o.log = log;
  o.args = {"--codec", "none", "--max-body-bytes", "2000000000"};
  o.cpu = cpu;
  auto sidecar = std::make_unique<bench::Sidecar>(std::move(o));
  sidecar->waitReady(std::chrono::seconds(10));
  return sidecar;
}

/// Thrown past the classic figures when only the load figures were asked for.
struct SkipRest {};

std::string emitTarget(uint64_t step, const char* name = "bench") {
  return std::string("/v1/emit_gradient?name=") + name + "&step=" + std::to_string(step);
}

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

/// One (clients, size) cell of the load figures.
struct LoadCell {
  int clients = 0;
  size_t bytes = 0;
  double seconds = 0;
  uint64_t requests = 0, errors = 0;
  std::vector<double> latencies;
};

/// `clients` keep-alive clients at once, even ones on the Unix socket and odd ones on TCP, each
/// sending steps of `bytes` to a tensor of its own (one trainer: each step completes alone) back
/// to back for `seconds` after a short warm-up.
LoadCell loadCell(const std::string& socket, uint16_t port, int clients, size_t bytes,
                  double seconds_each) {
  LoadCell cell;
  cell.clients = clients;
  cell.bytes = bytes / 4 * 4;
  std::mutex mu;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false}, stop{false};
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(clients));
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([&, i] {
      std::vector<double> lat;
      uint64_t errors = 0;
      try {
        std::unique_ptr<Client> c =
            i % 2 == 0 ? std::make_unique<Client>(socket) : std::make_unique<Client>(port);
        std::string body(cell.bytes, '\0'), reply;
        const std::string name = "load-" + std::to_string(bytes) + "-" + std::to_string(clients) +
                                 "-" + std::to_string(i);  // a tensor of its own per cell
        uint64_t step = 0;
        for (int w = 0; w < 3; ++w) c->requestReuse(emitTarget(step++, name.c_str()), body, reply);
        ++ready;
        while (!go.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
        while (!stop.load()) {
          const auto t0 = Clock::now();
          const auto st = c->requestReuse(emitTarget(step++, name.c_str()), body, reply);
          if (st == http::status::ok && reply.size() >= cell.bytes) {
            lat.push_back(seconds(Clock::now() - t0));
          } else {
            ++errors;
          }
        }
      } catch (const std::exception&) {
        ++errors;
        ++ready;  // counted as ready, so the others are not held up
      }
      std::lock_guard lock(mu);
      cell.latencies.insert(cell.latencies.end(), lat.begin(), lat.end());
      cell.errors += errors;
    });
  }
  while (ready.load() < clients) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto t0 = Clock::now();
  go = true;
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds_each));
  stop = true;
  for (auto& t : threads) t.join();
  cell.seconds = seconds(Clock::now() - t0);  // the last requests finish after `stop`
  cell.requests = cell.latencies.size();
  return cell;
}

/// The load figures: a sidecar of its own, pinned to one core, the clients to another.
boost::json::array loadFigures(const IngestBenchSettings& s, const std::string& dir) {
  boost::json::array out;
  int max_clients = 1;
  for (int c : s.concurrency) max_clients = std::max(max_clients, c);
  cpu_set_t original;
  CPU_ZERO(&original);
  sched_getaffinity(0, sizeof original, &original);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c) {
    if (CPU_ISSET(c, &original)) cpus.push_back(c);
  }
  bench::Sidecar::Options o;
  o.exe = s.self_exe;
  o.socket = dir + "/load.sock";
  o.control_tcp = "127.0.0.1:0";
  o.log = dir + "/load.log";
  const std::string budget = std::to_string(max_clients + 8);
  o.args = {"--codec",
            "none",
            "--max-body-bytes",
            "2000000000",
            "--unix-max-connections",
            budget,
            "--control-tcp-max-connections",
            budget};
  if (cpus.size() >= 2) o.cpu = cpus[0];
  bench::Sidecar sidecar(std::move(o));
  sidecar.waitReady(std::chrono::seconds(10));
  uint16_t port = 0;
  {
    Client probe(dir + "/load.sock");
    const auto st = probe.request(http::verb::get, "/v1/status");
    expectOk(st, "GET /v1/status");
    port = static_cast<uint16_t>(
        boost::json::parse(st.body()).at("listeners").at("control_tcp_port").to_number<int>());
  }
  if (cpus.size() >= 2) {
    cpu_set_t mine;
    CPU_ZERO(&mine);
    CPU_SET(cpus[1], &mine);
    sched_setaffinity(0, sizeof mine, &mine);
  }
  for (const size_t bytes : s.load_bytes) {
    double single_rps = 0;
    for (const int clients : s.concurrency) {
      std::fprintf(stderr, "lightwire bench ingest: %d client(s) at once, %zu-byte steps ...\n",
                   clients, bytes);
      LoadCell cell = loadCell(dir + "/load.sock", port, clients, bytes, s.load_seconds);
      const double rps = static_cast<double>(cell.requests) / cell.seconds;
      if (clients == 1) single_rps = rps;
      boost::json::object row{{"clients", clients},        {"bytes", cell.bytes},
                              {"requests", cell.requests}, {"errors", cell.errors},
                              {"seconds", cell.seconds},   {"requests_per_s", rps}};
      if (!cell.latencies.empty()) {
        row["p50_us"] = percentile(cell.latencies, 0.5) * 1e6;
        row["p99_us"] = percentile(cell.latencies, 0.99) * 1e6;
      }
      if (single_rps > 0) row["rps_vs_one_client"] = rps / single_rps;
      out.push_back(std::move(row));
    }
  }
  sched_setaffinity(0, sizeof original, &original);
  return out;
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
    if (!s.concurrency.empty()) result["load"] = loadFigures(s, dir);
    if (s.load_only) throw SkipRest{};
    const auto sidecar = startSidecar(s.self_exe, socket, dir + "/sidecar.log");
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
        const auto pinned = startSidecar(s.self_exe, pinned_socket, dir + "/pinned.log", cpus[0]);
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
  } catch (const SkipRest&) {
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
    if (!s.load_only) {
      std::printf("4 KiB round trip, C++ client:     p50 %8.1f us   p99 %8.1f us\n",
                  num("cpp_4k_p50_us"), num("cpp_4k_p99_us"));
    }
    if (result.contains("cpp_4k_same_core_p50_us")) {
      std::printf("  pinned to one core:             p50 %8.1f us   p99 %8.1f us\n",
                  num("cpp_4k_same_core_p50_us"), num("cpp_4k_same_core_p99_us"));
      std::printf("  pinned to two cores:            p50 %8.1f us   p99 %8.1f us\n",
                  num("cpp_4k_cross_core_p50_us"), num("cpp_4k_cross_core_p99_us"));
    }
    if (!s.python.empty() && !s.load_only) {
      std::printf("4 KiB round trip, Python client:  p50 %8.1f us   p99 %8.1f us\n",
                  num("python_4k_p50_us"), num("python_4k_p99_us"));
    }
    if (!s.load_only) {
      std::printf("100 MB as HTTP bodies:            %6.2f GB/s\n", num("body_100mb_gbps"));
      std::printf("100 MB through shared memory:     %6.2f GB/s\n", num("shm_100mb_gbps"));
    }
    if (const auto* load = result.if_contains("load")) {
      std::printf("clients  step bytes   requests/s  vs 1 client   p50 us     p99 us   errors\n");
      for (const auto& v : load->as_array()) {
        const auto& r = v.as_object();
        auto f = [&](const char* k) {
          const auto* x = r.if_contains(k);
          return x ? x->to_number<double>() : 0.0;
        };
        std::printf("%7.0f %11.0f %12.1f %11.2fx %9.0f %10.0f %8.0f\n", f("clients"), f("bytes"),
                    f("requests_per_s"), f("rps_vs_one_client"), f("p50_us"), f("p99_us"),
                    f("errors"));
      }
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rc;
}

}  // namespace lightwire::proxy
