#pragma once
// How many CPUs this process may use: `threads: 0` means that many codec threads. In a container,
// std::thread::hardware_concurrency() counts the node's CPUs, not the CPU limit the container was
// given (a 2-CPU quota on a 128-core node would start 128 threads and be throttled), so the count
// is the smallest of the online CPUs, the scheduler affinity mask (cpusets, taskset) and the
// cgroup CPU quota (v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us), rounded up.

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

/// cgroup v2 cpu.max ("QUOTA PERIOD" or "max PERIOD"): the quota in CPUs, unset for "max" or
/// text that does not parse.
std::optional<double> parseCpuMax(std::string_view text);

/// cgroup v1 cpu.cfs_quota_us and cpu.cfs_period_us: the quota in CPUs, unset for -1 (none) or
/// text that does not parse.
std::optional<double> parseCfsQuota(std::string_view quota_us, std::string_view period_us);

}  // namespace lightwire::proxy
