#include "proxy/server/resources.h"

#include <sched.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include <spdlog/fmt/fmt.h>

namespace lightwire::proxy {
namespace {

std::optional<std::string> readFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) {
    s.remove_suffix(1);
  }
  return s;
}

std::optional<long long> toInt(std::string_view s) {
  s = trim(s);
  long long v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

/// The directories from `dir` up to `top` (both included): a quota on any ancestor applies.
std::vector<std::string> upTo(std::string dir, const std::string& top) {
  std::vector<std::string> out;
  while (dir.size() >= top.size()) {
    out.push_back(dir);
    if (dir.size() == top.size()) break;
    const auto slash = dir.rfind('/');
    if (slash == std::string::npos || slash < top.size()) {
      dir = top;
    } else {
      dir.resize(slash);
    }
  }
  return out;
}

void takeSmaller(CpuBudget& b, std::optional<double> q, const std::string& from) {
  if (q && (!b.quota || *q < *b.quota)) {
    b.quota = q;
    b.quota_source = from;
  }
}

}  // namespace

std::optional<double> parseCpuMax(std::string_view text) {
  text = trim(text);
  const auto space = text.find(' ');
  if (space == std::string_view::npos) return std::nullopt;
  const std::string_view quota = text.substr(0, space);
  if (quota == "max") return std::nullopt;
  const auto q = toInt(quota);
  const auto p = toInt(text.substr(space + 1));
  if (!q || !p || *q <= 0 || *p <= 0) return std::nullopt;
  return static_cast<double>(*q) / static_cast<double>(*p);
}

std::optional<double> parseCfsQuota(std::string_view quota_us, std::string_view period_us) {
  const auto q = toInt(quota_us);
  const auto p = toInt(period_us);
  if (!q || !p || *q <= 0 || *p <= 0) return std::nullopt;  // -1: no quota
  return static_cast<double>(*q) / static_cast<double>(*p);
}

unsigned CpuBudget::usable() const {
  unsigned n = 0;
  const auto take = [&](unsigned v) {
    if (v > 0 && (n == 0 || v < n)) n = v;
  };
  take(online);
  take(affinity);
  if (quota) take(static_cast<unsigned>(std::max(1.0, std::ceil(*quota - 1e-9))));
  return std::max(1u, n);
}

std::string CpuBudget::describe() const {
  std::vector<std::string> parts;
  if (quota) parts.push_back(fmt::format("cgroup quota {:.3g} CPUs from {}", *quota, quota_source));
  if (affinity) parts.push_back(fmt::format("affinity {}", affinity));
  if (online) parts.push_back(fmt::format("online {}", online));
  std::string s = std::to_string(usable());
  for (size_t i = 0; i < parts.size(); ++i) s += (i == 0 ? " (" : "; ") + parts[i];
  if (!parts.empty()) s += ")";
  return s;
}

namespace {

/// Calls `v2(dir)` for every cgroup v2 directory that applies to this process (its cgroup and the
/// ancestors visible under `root`/sys/fs/cgroup), and `v1(dirs)` with the candidate directories
/// of a v1 hierarchy holding `controller` (its cgroup's directory when visible, else the mount's
/// root, which a container sees as its own cgroup), in order of preference.
template <typename V2, typename V1>
void visitCgroups(const std::string& root, std::string_view controller, V2&& v2, V1&& v1) {
  const std::string cg = root + "/sys/fs/cgroup";
  const auto self = readFile(root + "/proc/self/cgroup");
  if (!self) return;
  std::istringstream lines(*self);
  std::string line;
  while (std::getline(lines, line)) {
    // hierarchy-ID:controllers:path
    const auto a = line.find(':');
    const auto c = a == std::string::npos ? a : line.find(':', a + 1);
    if (c == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, c - a - 1);
    std::string path = line.substr(c + 1);
    if (!path.empty() && path.back() == '/') path.pop_back();
    if (controllers.empty()) {
      // cgroup v2. In a container with its own cgroup namespace the path is "/": the
      // container's own cgroup is the mount's root.
      for (const auto& dir : upTo(cg + path, cg)) v2(dir);
      continue;
    }
    std::vector<std::string> names;
    std::istringstream cs(controllers);
    for (std::string n; std::getline(cs, n, ',');) names.push_back(n);
    if (std::find(names.begin(), names.end(), controller) == names.end()) continue;
    for (const std::string& mount :
         std::vector<std::string>{cg + "/" + controllers, cg + "/" + std::string(controller)}) {
      if (v1(std::vector<std::string>{mount + path, mount})) break;
    }
  }
}

}  // namespace

CpuBudget cpuBudget(const std::string& root) {
  CpuBudget b;
  if (root.empty()) {
    b.online = std::thread::hardware_concurrency();
    cpu_set_t set;
    CPU_ZERO(&set);
    if (::sched_getaffinity(0, sizeof set, &set) == 0) b.affinity = CPU_COUNT(&set);
  }
  visitCgroups(
      root, "cpu",
      [&](const std::string& dir) {
        if (auto t = readFile(dir + "/cpu.max")) takeSmaller(b, parseCpuMax(*t), dir + "/cpu.max");
      },
      [&](const std::vector<std::string>& dirs) {
        for (const auto& dir : dirs) {
          const auto q = readFile(dir + "/cpu.cfs_quota_us");
          const auto p = readFile(dir + "/cpu.cfs_period_us");
          if (!q || !p) continue;
          takeSmaller(b, parseCfsQuota(*q, *p), dir + "/cpu.cfs_quota_us");
          return true;
        }
        return false;
      });
  return b;
}

std::optional<uint64_t> parseMemoryLimit(std::string_view text) {
  text = trim(text);
  if (text == "max") return std::nullopt;
  const auto v = toInt(text);
  if (!v || *v <= 0 || static_cast<uint64_t>(*v) >= (uint64_t{1} << 62)) return std::nullopt;
  return static_cast<uint64_t>(*v);
}

uint64_t MemoryBudget::usable() const {
  uint64_t n = physical;
  if (limit && (n == 0 || *limit < n)) n = *limit;
  return n;
}

namespace {

std::string gib(uint64_t bytes) {
  return fmt::format("{:.3g} GiB", double(bytes) / double(1 << 30));
}

}  // namespace

std::string MemoryBudget::describe() const {
  std::string s = gib(usable());
  std::vector<std::string> parts;
  if (limit) parts.push_back("cgroup limit " + gib(*limit) + " from " + limit_source);
  if (physical) parts.push_back("physical " + gib(physical));
  for (size_t i = 0; i < parts.size(); ++i) s += (i == 0 ? " (" : "; ") + parts[i];
  if (!parts.empty()) s += ")";
  return s;
}

MemoryBudget memoryBudget(const std::string& root) {
  MemoryBudget b;
  if (auto info = readFile(root + "/proc/meminfo")) {
    // "MemTotal:       24576000 kB"
    const auto at = info->find("MemTotal:");
    if (at != std::string::npos) {
      const auto end = info->find('\n', at);
      std::string_view v(*info);
      v = v.substr(at + 9, (end == std::string::npos ? info->size() : end) - at - 9);
      v = trim(v);
      if (v.size() > 3 && v.substr(v.size() - 3) == " kB") v.remove_suffix(3);
      if (const auto kb = toInt(v); kb && *kb > 0) b.physical = static_cast<uint64_t>(*kb) * 1024;
    }
  }
  const auto take = [&](std::optional<uint64_t> v, const std::string& from) {
    if (v && (!b.limit || *v < *b.limit)) {
      b.limit = v;
      b.limit_source = from;
    }
  };
  visitCgroups(
      root, "memory",
      [&](const std::string& dir) {
        if (auto t = readFile(dir + "/memory.max")) take(parseMemoryLimit(*t), dir + "/memory.max");
      },
      [&](const std::vector<std::string>& dirs) {
        for (const auto& dir : dirs) {
          const auto t = readFile(dir + "/memory.limit_in_bytes");
          if (!t) continue;
          take(parseMemoryLimit(*t), dir + "/memory.limit_in_bytes");
          return true;
        }
        return false;
      });
  return b;
}

}  // namespace lightwire::proxy
