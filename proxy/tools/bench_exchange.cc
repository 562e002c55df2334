#include "proxy/tools/bench_exchange.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/beast/http.hpp>
#include <boost/json.hpp>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
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
using bench::seconds;

constexpr const char* kTensor = "exchange";
constexpr const char* kStages[] = {"ingest", "compress", "exchange", "decompress", "total"};

/// A temporary directory removed (with what it holds) on destruction.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/lightwire-exchange-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      throw std::runtime_error(std::string("mkdtemp: ") + std::strerror(errno));
    }
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

/// `count` distinct free loopback TCP ports, chosen by the OS (all held open until every one is
/// chosen, then released for the sidecars to bind).
std::vector<int> freePorts(int count) {
  std::vector<int> fds, ports;
  auto closeAll = [&] {
    for (int fd : fds) close(fd);
  };
  for (int i = 0; i < count; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
      closeAll();
      throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
    }
    fds.push_back(fd);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      const int err = errno;
      closeAll();
      throw std::runtime_error(std::string("bind 127.0.0.1:0: ") + std::strerror(err));
    }
    ports.push_back(ntohs(a.sin_port));
  }
  closeAll();
  return ports;
}

std::string randomSecret() {
  std::random_device rd;
  static const char hex[] = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 32; ++i) {
    const unsigned v = rd();
    s += hex[v & 15];
    s += hex[(v >> 4) & 15];
  }
  return s;
}

/// What a sidecar has sent its peers so far, from its /metrics.
struct Sent {
  double bytes = 0;   // lightwire_wire_bytes_total{direction="sent"}
  double frames = 0;  // lightwire_peer_data_frames_sent_total
};

Sent sentBy(Client& c) {
  const auto r = c.request(http::verb::get, "/metrics");
  expectOk(r, "GET /metrics");
  std::istringstream in(r.body());
  std::string line;
  std::optional<double> bytes, frames;
  auto value = [&] { return std::strtod(line.c_str() + line.rfind(' ') + 1, nullptr); };
  while (std::getline(in, line)) {
    if (line.rfind("lightwire_wire_bytes_total{", 0) == 0 &&
        line.find("direction=\"sent\"") != std::string::npos) {
      bytes = value();
    } else if (line.rfind("lightwire_peer_data_frames_sent_total ", 0) == 0) {
      frames = value();
    }
  }
  if (!bytes || !frames) {
    throw std::runtime_error(
        "/metrics lacks lightwire_wire_bytes_total{direction=\"sent\"} or "
        "lightwire_peer_data_frames_sent_total");
  }
  return {*bytes, *frames};
}

/// Deterministic input of one rank: uniform in [-1, 1) from SplitMix64, different per rank.
void fillInput(std::vector<float>& v, int rank) {
  uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(rank + 1);
  for (auto& f : v) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    f = static_cast<float>(static_cast<double>(z >> 40) / static_cast<double>(1ull << 23) - 1.0);
  }
}

}  // namespace

int runExchangeBench(const ExchangeBenchSettings& s) {
  const int W = s.world_size;
  const int K = s.steps;
  const size_t N = s.elements;
  const size_t bytes = N * 4;
  boost::json::object params;
  for (const auto& [k, v] : s.codec_params) {
    char* end = nullptr;
    const double d = std::strtod(v.c_str(), &end);
    if (end != v.c_str() && *end == '\0') {
      params[k] = d;
    } else {
      params[k] = v;
    }
  }

  std::fprintf(stderr,
               "lightwire bench exchange: world size %d, codec %s, %zu elements (%.1f MB fp32), "
               "%d timed steps\n",
               W, s.codec.c_str(), N, static_cast<double>(bytes) / 1e6, K);

  std::unique_ptr<TempDir> dir;
  std::vector<std::unique_ptr<bench::Sidecar>> sidecars;  // destroyed before `dir`
  int failed_rank = -1;
  try {
    dir = std::make_unique<TempDir>();
    const std::vector<int> ports = freePorts(W);
    std::string peers;
    for (int p : ports) peers += (peers.empty() ? "" : ",") + ("127.0.0.1:" + std::to_string(p));
    const std::string secret = randomSecret();
    const std::string max_body = std::to_string(std::max<size_t>(bytes + 4096, 1 << 20));
    for (int r = 0; r < W; ++r) {
      bench::Sidecar::Options o;
      o.exe = s.self_exe;
      o.socket = dir->path + "/r" + std::to_string(r) + ".sock";
      o.log = dir->path + "/r" + std::to_string(r) + ".log";
      o.args = {"--job-id",         "bench-exchange",
                "--rank",           std::to_string(r),
                "--world-size",     std::to_string(W),
                "--peers",          peers,
                "--peer-listen",    "127.0.0.1:" + std::to_string(ports[r]),
                "--threads",        "1",
                "--codec",          s.codec,
                "--transport",      s.transport,
                "--topology",       s.topology,
                "--sparse",         s.sparse,
                "--warmup-steps",   std::to_string(s.warmup_steps),
                "--max-body-bytes", max_body};
      o.args.insert(o.args.end(), s.codec_args.begin(), s.codec_args.end());
      o.env = {{"LIGHTWIRE_PEER__SECRET", secret}};
      sidecars.push_back(std::make_unique<bench::Sidecar>(std::move(o)));
    }
    const auto ready_deadline = Clock::now() + std::chrono::seconds(30);
    for (int r = 0; r < W; ++r) {
      failed_rank = r;
      sidecars[r]->waitReady(std::max(Clock::duration::zero(), ready_deadline - Clock::now()) +
                             std::chrono::milliseconds(1));
    }
    failed_rank = -1;
    std::fprintf(stderr, "lightwire bench exchange: %d sidecars ready (peers %s)\n", W,
                 peers.c_str());

    // One segment per rank, registered with its sidecar, and the pristine input copied into it
    // before every step (the result is written in place; the copy is not timed).
    std::vector<std::unique_ptr<bench::Segment>> segments;
    std::vector<std::vector<float>> inputs(W, std::vector<float>(N));
    std::vector<std::string> buffer_ids;
    std::vector<std::unique_ptr<Client>> control;
    {
      std::vector<std::thread> fillers;
      for (int r = 0; r < W; ++r) fillers.emplace_back([&, r] { fillInput(inputs[r], r); });
      for (auto& t : fillers) t.join();
    }
    for (int r = 0; r < W; ++r) {
      failed_rank = r;
      segments.push_back(std::make_unique<bench::Segment>(
          "/lightwire-exchange-" + std::to_string(getpid()) + "-" + std::to_string(r), bytes));
      control.push_back(std::make_unique<Client>(sidecars[r]->socket()));
      auto reg =
          control[r]->request(http::verb::post, "/v1/buffers",
                              boost::json::serialize(boost::json::object{
                                  {"kind", "shm"}, {"name", segments[r]->name}, {"size", bytes}}),
                              "application/json");
      expectOk(reg, "POST /v1/buffers");
      buffer_ids.emplace_back(boost::json::parse(reg.body()).at("id").as_string());
    }
    failed_rank = -1;

    // K + 1 steps, the first untimed; a barrier before and after each. The barrier's completion
    // (run by one thread while the others wait) takes the time and reads the metrics.
    std::vector<double> step_s;
    std::vector<Sent> sent_before(W), sent_after(W);
    std::vector<std::vector<boost::json::object>> replies(W);
    std::vector<Clock::time_point> done(W);
    Clock::time_point t0;
    std::atomic<bool> failed{false};
    std::mutex err_mu;
    std::string error;
    auto fail = [&](int rank, const std::string& what) {
      std::lock_guard lock(err_mu);
      if (!failed.exchange(true)) {
        error = what;
        failed_rank = rank;
      }
    };
    int phase = 0;
    auto completion = [&]() noexcept {
      const int step = phase / 2;
      const bool start = phase % 2 == 0;
      ++phase;
      if (failed) return;
      if (start) {
        t0 = Clock::now();
        return;
      }
      if (step > 0) step_s.push_back(seconds(*std::max_element(done.begin(), done.end()) - t0));
      if (step == 0 || step == K) {
        try {
          // A connection of its own each time: the control connections sit idle through the
          // timed steps, longer than the sidecars' keep-alive timeout when steps are slow.
          for (int r = 0; r < W; ++r) {
            Client fresh(sidecars[r]->socket());
            (step == 0 ? sent_before : sent_after)[r] = sentBy(fresh);
          }
        } catch (const std::exception& e) {
          fail(-1, std::string("reading /metrics: ") + e.what());
        }
      }
      if (step == 0) {
        std::fprintf(stderr, "lightwire bench exchange: warm-up step done\n");
      } else {
        std::fprintf(stderr, "lightwire bench exchange: step %d/%d: %.4f s\n", step, K,
                     step_s.back());
      }
    };
    std::barrier sync(W, completion);
    std::vector<std::thread> workers;
    for (int r = 0; r < W; ++r) {
      workers.emplace_back([&, r] {
        std::unique_ptr<Client> client;
        try {
          client = std::make_unique<Client>(sidecars[r]->socket());
        } catch (const std::exception& e) {
          fail(r, std::string("connect: ") + e.what());
        }
        for (int step = 0; step <= K; ++step) {
          if (!failed) std::memcpy(segments[r]->data, inputs[r].data(), bytes);
          sync.arrive_and_wait();
          if (!failed) {
            try {
              boost::json::object doc{{"name", kTensor},
                                      {"step", step},
                                      {"buffer", buffer_ids[r]},
                                      {"elements", N},
                                      {"dtype", "float32"}};
              auto reply = client->request(http::verb::post, "/v1/emit_gradient",
                                           boost::json::serialize(doc), "application/json");
              done[r] = Clock::now();
              expectOk(reply, "emit_gradient");
              if (step > 0) replies[r].push_back(boost::json::parse(reply.body()).as_object());
            } catch (const std::exception& e) {
              fail(r, "rank " + std::to_string(r) + ", step " + std::to_string(step) + ": " +
                          e.what());
            }
          }
          sync.arrive_and_wait();
        }
      });
    }
    for (auto& t : workers) t.join();
    if (failed) throw std::runtime_error(error);

    // Figures.
    const double sps = median(step_s);
    double sent = 0, frames = 0;
    for (int r = 0; r < W; ++r) {
      sent += sent_after[r].bytes - sent_before[r].bytes;
      frames += sent_after[r].frames - sent_before[r].frames;
    }
    const double wire_per_rank = sent / W / K;
    const double frames_per_step = frames / K;  // every rank's together
    std::vector<double> ratios;
    boost::json::object stages;
    for (const char* stage : kStages) {
      std::vector<double> per_step;  // mean over ranks of each timed step
      for (int k = 0; k < K; ++k) {
        double sum = 0;
        for (int r = 0; r < W; ++r) {
          const auto* d = replies[r][k].if_contains("durations_us");
          const auto* v = d && d->is_object() ? d->as_object().if_contains(stage) : nullptr;
          sum += v ? v->to_number<double>() : 0.0;
        }
        per_step.push_back(sum / W / 1e3);
      }
      stages[stage] = median(per_step);
    }
    for (int r = 0; r < W; ++r) {
      for (const auto& rep : replies[r]) {
        if (const auto* v = rep.if_contains("ratio")) ratios.push_back(v->to_number<double>());
      }
    }
    const double ratio = ratios.empty() ? 0.0 : median(ratios);

    boost::json::object result{
        {"world_size", W},
        {"codec", s.codec},
        {"params", params},
        {"elements", N},
        {"steps", K},
        {"threads_per_sidecar", 1},
        {"transport", s.transport + " loopback"},
        {"topology", s.topology},
        {"sparse", s.sparse},
        {"warmup_steps", s.warmup_steps},
        {"raw_bytes", bytes},
        {"seconds_per_step", sps},
        {"seconds_per_step_min", *std::min_element(step_s.begin(), step_s.end())},
        {"seconds_per_step_max", *std::max_element(step_s.begin(), step_s.end())},
        {"algbw_gbps", static_cast<double>(bytes) / sps / 1e9},
        {"wire_bytes_per_rank", wire_per_rank},
        {"data_frames_per_step", frames_per_step},
        {"compression_ratio", ratio},
        {"raw_vs_wire_per_rank", static_cast<double>(bytes) / wire_per_rank},
        {"stage_ms", stages}};
    if (s.json) {
      std::printf("%s\n", boost::json::serialize(result).c_str());
    } else {
      std::string p;
      for (const auto& [k, v] : s.codec_params) p += " " + k + "=" + v;
      std::printf(
          "world size %d, codec %s%s, %zu fp32 elements (%.1f MB), sparse %s, median of %d "
          "steps\n",
          W, s.codec.c_str(), p.c_str(), N, static_cast<double>(bytes) / 1e6, s.sparse.c_str(), K);
      std::printf("seconds_per_step      %10.4f  (min %.4f, max %.4f)\n", sps,
                  result["seconds_per_step_min"].as_double(),
                  result["seconds_per_step_max"].as_double());
      std::printf("algbw_gbps            %10.3f\n", result["algbw_gbps"].as_double());
      std::printf("wire_bytes_per_rank   %10.0f  (raw tensor %zu bytes: raw / wire %.2f)\n",
                  wire_per_rank, bytes, result["raw_vs_wire_per_rank"].as_double());
      std::printf(
          "data_frames_per_step  %10.1f  (every rank's DATA frames: payloads, statistics)\n",
          frames_per_step);
      std::printf("compression_ratio     %10.2f  (the codec's raw / payload bytes)\n", ratio);
      std::printf("stage ms (rank mean)  ");
      for (const char* stage : kStages) {
        std::printf(" %s %.1f", stage, stages[stage].as_double());
      }
      std::printf("\n");
    }
    std::fflush(stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lightwire bench exchange: %s\n", e.what());
    bool any_exited = false;
    for (size_t r = 0; r < sidecars.size(); ++r) {
      if (sidecars[r]->exited()) {
        any_exited = true;
        std::fprintf(stderr, "--- sidecar rank %zu exited; the end of its log (%s):\n%s", r,
                     sidecars[r]->log().c_str(), bench::fileTail(sidecars[r]->log()).c_str());
      }
    }
    if (!any_exited) {
      for (size_t r = 0; r < sidecars.size(); ++r) {
        if (failed_rank >= 0 && static_cast<size_t>(failed_rank) != r) continue;
        std::fprintf(stderr, "--- sidecar rank %zu, the end of its log (%s):\n%s", r,
                     sidecars[r]->log().c_str(), bench::fileTail(sidecars[r]->log()).c_str());
      }
    }
    return 1;
  }
}

}  // namespace lightwire::proxy
