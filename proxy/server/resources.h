#pragma once
// What this process may use of the machine, as a container sees it.
//
// CPUs: `threads: 0` means that many codec threads. In a container,
// std::thread::hardware_concurrency() counts the node's CPUs, not the CPU limit the container was
// given (a 2-CPU quota on a 128-core node would start 128 threads and be throttled), so the count
// is the smallest of the online CPUs, the scheduler affinity mask (cpusets, taskset) and the
// cgroup CPU quota (v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us), rounded up.
//
// Memory: `limits.max_inflight_body_bytes: 0` caps the request bodies held at once at half of
// the memory this process may use: the smallest of the physical memory (MemTotal) and the cgroup
// memory limit (v2 memory.max, v1 memory.limit_in_bytes) of its cgroup and every ancestor.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace lightwire::proxy {

struct CpuBudget {
  unsigned online = 0;          // hardware_concurrency() (0 = unknown)
  unsigned affinity = 0;        // CPUs in the affinity mask (0 = unknown)
  std::optional<double> quota;  // cgroup CPU quota in CPUs (unset = none)
  std::string quota_source;     // the file the quota came from

  /// min(online, affinity, ceil(quota)) over the known ones; at least 1.
  unsigned usable() const;
  /// "2 (cgroup quota 1.5 CPUs from /sys/fs/cgroup/cpu.max; affinity 8; online 64)".
  std::string describe() const;
};

/// The budget of this process. `root` prefixes /proc and /sys (tests give a fake tree; then the
/// affinity mask and the online count are not read).
CpuBudget cpuBudget(const std::string& root = "");

struct MemoryBudget {
  uint64_t physical = 0;          // MemTotal (0 = unknown)
  std::optional<uint64_t> limit;  // cgroup memory limit in bytes (unset = none)
  std::string limit_source;       // the file the limit came from

  /// min(physical, limit) over the known ones (0 when neither is known).
  uint64_t usable() const;
  /// "23.5 GiB (cgroup limit 4 GiB from /sys/fs/cgroup/memory.max; physical 23.5 GiB)".
  std::string describe() const;
};

/// The memory budget of this process; `root` as for cpuBudget.
MemoryBudget memoryBudget(const std::string& root = "");

/// A cgroup memory limit file (v2 memory.max: bytes or "max"; v1 memory.limit_in_bytes: bytes,
/// where values at or above 2^62 mean none): the limit, unset for none or text that does not
/// parse.
std::optional<uint64_t> parseMemoryLimit(std::string_view text);

/// cgroup v2 cpu.max ("QUOTA PERIOD" or "max PERIOD"): the quota in CPUs, unset for "max" or
/// text that does not parse.
std::optional<double> parseCpuMax(std::string_view text);

/// cgroup v1 cpu.cfs_quota_us and cpu.cfs_period_us: the quota in CPUs, unset for -1 (none) or
/// text that does not parse.
std::optional<double> parseCfsQuota(std::string_view quota_us, std::string_view period_us);

}  // namespace lightwire::proxy
