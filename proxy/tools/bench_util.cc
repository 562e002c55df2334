#include "proxy/tools/bench_util.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/ip/tcp.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace lightwire::proxy::bench {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using unix_socket = asio::local::stream_protocol;

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

Client::Client(const std::string& path) : socket_(io_) {
  const unix_socket::endpoint ep(path);
  socket_.connect(asio::generic::stream_protocol::endpoint(ep.data(), ep.size()));
  tune();
}

Client::Client(uint16_t port) : socket_(io_) {
  const asio::ip::tcp::endpoint ep(asio::ip::address_v4::loopback(), port);
  socket_.connect(asio::generic::stream_protocol::endpoint(ep.data(), ep.size()));
  const int one = 1;
  ::setsockopt(socket_.native_handle(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  tune();
}

void Client::tune() {
  socket_.set_option(asio::socket_base::receive_buffer_size(4 << 20));
  socket_.set_option(asio::socket_base::send_buffer_size(4 << 20));
  buffer_.reserve(size_t{1} << 20);  // Beast reads at most the free capacity per call
}

http::status Client::requestReuse(const std::string& target, std::string& body,
                                  std::string& reply) {
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

http::response<http::string_body> Client::request(http::verb verb, const std::string& target,
                                                  std::string body, const char* type) {
  http::request<http::string_body> req{verb, target, 11};
  req.set(http::field::host, "lightwire");
  if (verb != http::verb::get) req.set(http::field::content_type, type);
  req.body() = std::move(body);
  req.prepare_payload();
  http::write(socket_, req);
  http::response_parser<http::string_body> parser;
  parser.body_limit(uint64_t{4} << 30);
  http::read(socket_, buffer_, parser);
  return parser.release();
}

void expectOk(const http::response<http::string_body>& r, const char* what) {
  if (r.result() != http::status::ok && r.result() != http::status::created) {
    throw std::runtime_error(std::string(what) + ": HTTP " + std::to_string(r.result_int()) + " " +
                             r.body().substr(0, 300));
  }
}

Sidecar::Sidecar(Options o) : o_(std::move(o)) {
  // Everything the child needs is built before fork(): only async-signal-safe calls after it.
  std::vector<std::string> args = {o_.exe,          "serve",        "--socket",       o_.socket,
                                   "--control-tcp", o_.control_tcp, "--admin-listen", "",
                                   "--log-level",   "warn",         "--state-dir",    ""};
  args.insert(args.end(), o_.args.begin(), o_.args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : o_.env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const bool overridden = std::any_of(o_.env.begin(), o_.env.end(), [&](const auto& kv) {
      return std::strncmp(*e, kv.first.c_str(), kv.first.size()) == 0 &&
             (*e)[kv.first.size()] == '=';
    });
    if (!overridden) envp.push_back(*e);
  }
  envp.push_back(nullptr);
  const pid_t parent = getpid();

  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid_ == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // the parent died before prctl
    if (o_.cpu >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(o_.cpu, &set);
      sched_setaffinity(0, sizeof set, &set);
    }
    const int fd = ::open(o_.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 2);
      dup2(fd, 1);
    }
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
}

bool Sidecar::exited() {
  if (pid_ <= 0) return true;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) {
    pid_ = -1;
    return true;
  }
  return false;
}

void Sidecar::waitReady(Clock::duration timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (exited()) throw std::runtime_error("the sidecar exited at start; see " + o_.log);
    try {
      Client probe(o_.socket);
      if (probe.request(http::verb::get, "/readyz").result() == http::status::ok) return;
    } catch (const std::exception&) {
      // not listening yet
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw std::runtime_error(
      "the sidecar was not ready (GET /readyz = 200) within " +
      std::to_string(std::chrono::duration_cast<std::chrono::seconds>(timeout).count()) +
      " s; see " + o_.log);
}

Sidecar::~Sidecar() {
  if (pid_ <= 0) return;
  kill(pid_, SIGTERM);
  int status = 0;
  for (int i = 0; i < 1000; ++i) {  // 10 s to stop, then SIGKILL
    if (waitpid(pid_, &status, WNOHANG) == pid_) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, &status, 0);
}

std::string fileTail(const std::string& path, size_t lines) {
  std::ifstream in(path);
  std::deque<std::string> last;
  std::string line;
  while (std::getline(in, line)) {
    last.push_back(line);
    if (last.size() > lines) last.pop_front();
  }
  std::string out;
  for (const auto& l : last) out += l + "\n";
  return out;
}

Segment::Segment(std::string n, size_t b) : name(std::move(n)), bytes(b) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) throw std::runtime_error("shm_open " + name + ": " + std::strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error("ftruncate: " + std::string(std::strerror(err)));
  }
  data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (data == MAP_FAILED) {
    const int err = errno;
    shm_unlink(name.c_str());
    throw std::runtime_error("mmap: " + std::string(std::strerror(err)));
  }
}

Segment::~Segment() {
  if (data != MAP_FAILED) munmap(data, bytes);
  shm_unlink(name.c_str());
}

}  // namespace lightwire::proxy::bench
