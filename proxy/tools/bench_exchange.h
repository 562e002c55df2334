#pragma once
// `lightwire bench exchange`: the time of one allreduce step through W real `lightwire serve`
// child processes exchanging over loopback TCP. W client threads (one per sidecar) send an
// N-element fp32 tensor through registered shared memory at the same time; a step is timed from
// its start until the last of the W replies. Prints seconds_per_step (median), algbw_gbps,
// wire_bytes_per_rank and the compression ratio; never passes or fails on time.
// Method: bench/README.md.

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace lightwire::proxy {

struct ExchangeBenchSettings {
  std::string self_exe;  // this executable (started as `serve`)
  int world_size = 4;
  std::string codec = "none";
  /// The codec's parameters as `serve` flags (`--density`, `0.01`, ...), already validated.
  std::vector<std::string> codec_args;
  /// The same parameters for the report (flag name without dashes, value).
  std::vector<std::pair<std::string, std::string>> codec_params;
  size_t elements = 0;
  int steps = 5;                     // timed steps (one more, untimed, runs first)
  std::string transport = "tcp";     // peer.transport of every sidecar: tcp | ucx
  std::string topology = "ring";     // peer.topology: ring | ps (server rank 0)
  std::string sparse = "allgather";  // peer.sparse: allgather | allreduce
  uint64_t warmup_steps = 0;  // schedule.warmup_steps (0: the codec's own density from the start)
  bool json = false;
};

/// Runs the benchmark; returns the exit code (0, or 1 when a sidecar or a client failed).
int runExchangeBench(const ExchangeBenchSettings& s);

}  // namespace lightwire::proxy
