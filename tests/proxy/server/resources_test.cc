#include "proxy/server/resources.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace lightwire::proxy {
namespace {

namespace fs = std::filesystem;

/// A fake /proc and /sys tree under a temporary directory.
struct Tree {
  fs::path root;
  Tree() {
    root = fs::temp_directory_path() /
           ("lw-cpus-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    fs::create_directories(root);
  }
  ~Tree() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  static int& counter() {
    static int n = 0;
    return n;
  }
  void write(const std::string& rel, const std::string& text) {
    const fs::path p = root / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
};

TEST_CASE("resources: cgroup v2 cpu.max and v1 CFS quota parse to CPUs") {
  CHECK(parseCpuMax("max 100000\n") == std::nullopt);
  CHECK(parseCpuMax("150000 100000\n").value() == doctest::Approx(1.5));
  CHECK(parseCpuMax("200000 100000").value() == doctest::Approx(2.0));
  CHECK(parseCpuMax("") == std::nullopt);
  CHECK(parseCpuMax("abc 100000") == std::nullopt);
  CHECK(parseCpuMax("0 100000") == std::nullopt);
  CHECK(parseCpuMax("100000 0") == std::nullopt);
  CHECK(parseCfsQuota("-1\n", "100000\n") == std::nullopt);
  CHECK(parseCfsQuota("50000\n", "100000\n").value() == doctest::Approx(0.5));
  CHECK(parseCfsQuota("x", "100000") == std::nullopt);
}

TEST_CASE("resources: usable is the smallest known bound, the quota rounded up, at least 1") {
  CpuBudget b;
  CHECK(b.usable() == 1);
  b.online = 64;
  CHECK(b.usable() == 64);
  b.affinity = 8;
  CHECK(b.usable() == 8);
  b.quota = 1.5;
  b.quota_source = "/sys/fs/cgroup/cpu.max";
  CHECK(b.usable() == 2);
  CHECK(b.describe() ==
        "2 (cgroup quota 1.5 CPUs from /sys/fs/cgroup/cpu.max; affinity 8; online 64)");
  b.quota = 0.2;
  CHECK(b.usable() == 1);
  b.quota = 2.0;
  CHECK(b.usable() == 2);  // exactly 2 CPUs: 2 threads, not 3
  b.quota = 100.0;
  CHECK(b.usable() == 8);
}

TEST_CASE("resources: cgroup v2, the container's own cgroup (namespace root) and ancestors") {
  Tree t;
  t.write("proc/self/cgroup", "0::/\n");
  t.write("sys/fs/cgroup/cpu.max", "250000 100000\n");
  CpuBudget b = cpuBudget(t.root.string());
  REQUIRE(b.quota.has_value());
  CHECK(*b.quota == doctest::Approx(2.5));
  CHECK(b.usable() == 3);
  CHECK(b.online == 0);  // not read from a fake tree

  Tree u;  // no namespace: the path below the mount, a tighter limit on an ancestor
  u.write("proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  u.write("sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n");
  u.write("sys/fs/cgroup/kubepods/pod1/cpu.max", "100000 100000\n");
  u.write("sys/fs/cgroup/kubepods/cpu.max", "max 100000\n");
  b = cpuBudget(u.root.string());
  REQUIRE(b.quota.has_value());
  CHECK(*b.quota == doctest::Approx(1.0));
  CHECK(b.quota_source.find("kubepods/pod1/cpu.max") != std::string::npos);

  Tree none;  // no limit anywhere
  none.write("proc/self/cgroup", "0::/user.slice\n");
  none.write("sys/fs/cgroup/user.slice/cpu.max", "max 100000\n");
  CHECK_FALSE(cpuBudget(none.root.string()).quota.has_value());
}

TEST_CASE("resources: cgroup v1 cpu,cpuacct quota, at the cgroup's path or the mount's root") {
  Tree t;
  t.write("proc/self/cgroup", "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n");
  t.write("sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "300000\n");
  t.write("sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
  CpuBudget b = cpuBudget(t.root.string());
  REQUIRE(b.quota.has_value());
  CHECK(*b.quota == doctest::Approx(3.0));

  Tree u;  // inside the container: its cgroup is the mount's root
  u.write("proc/self/cgroup", "4:cpu,cpuacct:/docker/abc\n");
  u.write("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  u.write("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  CHECK_FALSE(cpuBudget(u.root.string()).quota.has_value());

  Tree missing;  // no /proc/self/cgroup: nothing known
  CHECK_FALSE(cpuBudget(missing.root.string()).quota.has_value());
}

TEST_CASE("resources: this process has at least one usable CPU") {
  const CpuBudget b = cpuBudget();
  CHECK(b.online >= 1);
  CHECK(b.affinity >= 1);
  CHECK(b.usable() >= 1);
  CHECK(b.usable() <= b.online);
}

}  // namespace
}  // namespace lightwire::proxy

namespace lightwire::proxy {
namespace {

TEST_CASE("resources: cgroup memory limits parse; huge v1 values mean none") {
  CHECK(parseMemoryLimit("max\n") == std::nullopt);
  CHECK(parseMemoryLimit("4294967296\n").value() == 4294967296ull);
  CHECK(parseMemoryLimit("9223372036854771712\n") == std::nullopt);  // v1's "unlimited"
  CHECK(parseMemoryLimit("") == std::nullopt);
  CHECK(parseMemoryLimit("12k") == std::nullopt);
  CHECK(parseMemoryLimit("0") == std::nullopt);
}

TEST_CASE("resources: the memory budget is the smaller of MemTotal and the cgroup limits") {
  Tree t;
  t.write("proc/meminfo", "MemTotal:       24576000 kB\nMemFree:  100 kB\n");
  t.write("proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
  t.write("sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "4294967296\n");
  t.write("sys/fs/cgroup/kubepods/pod1/memory.max", "8589934592\n");
  t.write("sys/fs/cgroup/kubepods/memory.max", "max\n");
  MemoryBudget b = memoryBudget(t.root.string());
  CHECK(b.physical == 24576000ull * 1024);
  REQUIRE(b.limit.has_value());
  CHECK(*b.limit == 4294967296ull);
  CHECK(b.limit_source.find("pod1/ctr/memory.max") != std::string::npos);
  CHECK(b.usable() == 4294967296ull);
  CHECK(b.describe().rfind("4 GiB (cgroup limit 4 GiB from ", 0) == 0);

  Tree v1;  // cgroup v1, no limit: the physical memory
  v1.write("proc/meminfo", "MemTotal: 1048576 kB\n");
  v1.write("proc/self/cgroup", "5:memory:/docker/abc\n");
  v1.write("sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");
  b = memoryBudget(v1.root.string());
  CHECK_FALSE(b.limit.has_value());
  CHECK(b.usable() == 1024ull * 1024 * 1024);
  CHECK(b.describe() == "1 GiB (physical 1 GiB)");

  Tree none;  // nothing readable
  CHECK(memoryBudget(none.root.string()).usable() == 0);
}

TEST_CASE("resources: this process has a memory budget") {
  const MemoryBudget b = memoryBudget();
  CHECK(b.physical > 0);
  CHECK(b.usable() > 0);
  CHECK(b.usable() <= b.physical);
}

}  // namespace
}  // namespace lightwire::proxy
