#pragma once
// `lightwire bench ingest`: how fast a gradient gets into the sidecar and back, codec `none`,
// against a real `lightwire serve` child process on a Unix socket: the round trip of a 4 KiB
// tensor (p50, p99) from a C++ client (Boost.Beast) and from the Python client, and the
// throughput of a 100 MB tensor as an HTTP body and through registered shared memory; and, with
// `--concurrency`, the load the control API holds: many clients at once across the Unix socket
// and TCP. Prints figures; never passes or fails on time. Method: bench/README.md.

#include <cstddef>
#include <string>
#include <vector>

namespace lightwire::proxy {

struct IngestBenchSettings {
  std::string self_exe;   // this executable (started as `serve`)
  int small_runs = 2000;  // timed 4 KiB round trips per client
  size_t large_bytes = 100'000'000;
  int large_runs = 5;       // timed 100 MB round trips (median)
  std::string python;       // interpreter for the Python client ("" = skip it)
  std::string python_path;  // directory holding the `lightwire` package
  bool json = false;
  /// Load figures: for each number of concurrent clients (half on the Unix socket, half on the
  /// TCP control listener) and each step size, requests per second and latency against one
  /// client; empty = none.
  std::vector<int> concurrency;
  std::vector<size_t> load_bytes = {4096, size_t{4} << 20};
  double load_seconds = 3.0;  // timed per (clients, size)
  /// Run only the load figures.
  bool load_only = false;
};

/// Runs the benchmark; returns the exit code (0, or 1 when the sidecar or a client failed).
int runIngestBench(const IngestBenchSettings& s);

}  // namespace lightwire::proxy
