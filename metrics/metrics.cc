#include "metrics/metrics.h"

#include <prometheus/text_serializer.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace lightwire::metrics {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

prometheus::Family<prometheus::Counter>& counterFamily(prometheus::Registry& r, const char* name,
                                                       const char* help) {
  return BuildCounter().Name(name).Help(help).Register(r);
}

/// Microseconds to tens of seconds: a step's stages span that whole range.
prometheus::Histogram::BucketBoundaries stageBuckets() {
  return {1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
          5e-2, 0.1,  0.25, 0.5,    1.0,  2.5,  5.0,    10.0, 30.0};
}

double nowSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

/// The standard process_* family, read from /proc at exposition time.
std::string processMetrics(double start_time) {
  std::ostringstream out;
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  const double cpu = static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
                     static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
  long rss_pages = 0;
  {
    std::ifstream statm("/proc/self/statm");
    long size = 0;
    statm >> size >> rss_pages;
  }
  size_t fds = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++fds;
  }
  char buf[64];
  auto num = [&](double v) {
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  out << "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n"
      << "# TYPE process_cpu_seconds_total counter\n"
      << "process_cpu_seconds_total " << num(cpu) << "\n"
      << "# HELP process_resident_memory_bytes Resident memory size in bytes.\n"
      << "# TYPE process_resident_memory_bytes gauge\n"
      << "process_resident_memory_bytes "
      << num(static_cast<double>(rss_pages) * static_cast<double>(sysconf(_SC_PAGESIZE))) << "\n"
      << "# HELP process_open_fds Number of open file descriptors.\n"
      << "# TYPE process_open_fds gauge\n"
      << "process_open_fds " << num(static_cast<double>(fds)) << "\n"
      << "# HELP process_start_time_seconds Start time of the process since unix epoch in "
         "seconds.\n"
      << "# TYPE process_start_time_seconds gauge\n"
      << "process_start_time_seconds " << num(start_time) << "\n";
  return out.str();
}

}  // namespace

Metrics::Metrics() : Metrics(std::make_shared<prometheus::Registry>()) {}

Metrics::Metrics(std::shared_ptr<prometheus::Registry> r)
    : raw_bytes(counterFamily(*r, "lightwire_raw_bytes_total",
                              "Uncompressed bytes of the tensors compressed.")
                    .Add({})),
      wire_bytes_sent(counterFamily(*r, "lightwire_wire_bytes_total",
                                    "Compressed bytes sent to and received from peers.")
                          .Add({{"direction", "sent"}})),
      wire_bytes_received(BuildCounter()
                              .Name("lightwire_wire_bytes_total")
                              .Help("Compressed bytes sent to and received from peers.")
                              .Register(*r)
                              .Add({{"direction", "received"}})),
      data_frames_sent(counterFamily(*r, "lightwire_peer_data_frames_sent_total",
                                     "DATA frames written to peers (payloads, statistics, "
                                     "bucket headers, checksums).")
                           .Add({})),
      steps_ok(counterFamily(*r, "lightwire_steps_total", "Steps completed, by result.")
                   .Add({{"result", "ok"}})),
      steps_failed(counterFamily(*r, "lightwire_steps_total", "Steps completed, by result.")
                       .Add({{"result", "failed"}})),
      steps_nonfinite(counterFamily(*r, "lightwire_steps_total", "Steps completed, by result.")
                          .Add({{"result", "nonfinite"}})),
      fallbacks(counterFamily(*r, "lightwire_fallbacks_total",
                              "Steps the clients fell back to their own process group, as they "
                              "reported them.")
                    .Add({})),
      state_resets(counterFamily(*r, "lightwire_state_resets_total",
                                 "Tensors whose codec state started fresh (size or codec change).")
                       .Add({})),
      state_bytes(BuildGauge()
                      .Name("lightwire_state_bytes")
                      .Help("Bytes of codec state (residuals, momentum) held.")
                      .Register(*r)
                      .Add({})),
      pool_bytes(BuildGauge()
                     .Name("lightwire_pool_bytes")
                     .Help("Bytes of step buffers (results, local sums) kept and lent.")
                     .Register(*r)
                     .Add({})),
      receive_pool_bytes(BuildGauge()
                             .Name("lightwire_buffer_pool_bytes")
                             .Help("Bytes of buffers kept for reuse outside the step pool: frames "
                                   "received from peers, request bodies.")
                             .Register(*r)
                             .Add({{"pool", "receive"}})),
      body_pool_bytes(BuildGauge()
                          .Name("lightwire_buffer_pool_bytes")
                          .Help("Bytes of buffers kept for reuse outside the step pool: frames "
                                "received from peers, request bodies.")
                          .Register(*r)
                          .Add({{"pool", "request_bodies"}})),
      registered_buffers(BuildGauge()
                             .Name("lightwire_registered_buffers")
                             .Help("Shared-memory buffers registered by clients.")
                             .Register(*r)
                             .Add({})),
      auth_failures(counterFamily(*r, "lightwire_auth_failures_total",
                                  "Peer connections refused at the handshake (wrong secret, job, "
                                  "version or rank).")
                        .Add({})),
      result_mismatches(counterFamily(*r, "lightwire_result_mismatches_total",
                                      "Result checksums that differed between ranks.")
                            .Add({})),
      rollbacks(counterFamily(*r, "lightwire_rollbacks_total",
                              "Compression settings reverted to the last known-good ones.")
                    .Add({})),
      bypass_active(BuildGauge()
                        .Name("lightwire_bypass_active")
                        .Help("1 while compression is bypassed (dense exchange) after an anomaly.")
                        .Register(*r)
                        .Add({})),
      checkpoints_ok(counterFamily(*r, "lightwire_checkpoints_total",
                                   "State checkpoint files written, by result.")
                         .Add({{"result", "ok"}})),
      checkpoints_failed(counterFamily(*r, "lightwire_checkpoints_total",
                                       "State checkpoint files written, by result.")
                             .Add({{"result", "failed"}})),
      skipped_steps(counterFamily(*r, "lightwire_skipped_steps_total",
                                  "Delayed-sync steps accumulated locally instead of exchanged.")
                        .Add({})),
      auto_direct_windows(counterFamily(*r, "lightwire_auto_direct_windows_total",
                                        "Windows of steps codec: auto gave to the trainers' own "
                                        "process group (the direct rung).")
                              .Add({})),
      registry_(std::move(r)),
      ratio_family_(BuildGauge()
                        .Name("lightwire_compression_ratio")
                        .Help("Raw bytes over wire bytes of the last step, per tensor group.")
                        .Register(*registry_)),
      http_family_(counterFamily(*registry_, "lightwire_http_requests_total",
                                 "HTTP requests served, by route template and status code.")),
      limit_family_(counterFamily(*registry_, "lightwire_limit_hits_total",
                                  "Requests, connections and steps refused because they hit a "
                                  "configured limit, by limit.")),
      released_family_(counterFamily(*registry_, "lightwire_buffers_released_total",
                                     "Registered buffers released, by reason (client: released "
                                     "by the client; owner_exited: the registering process "
                                     "exited).")),
      frames_refused_family_(counterFamily(*registry_, "lightwire_peer_frames_refused_total",
                                           "Frames from authenticated peers refused (the "
                                           "connection is closed), by reason.")),
      peer_up_family_(BuildGauge()
                          .Name("lightwire_peer_up")
                          .Help("1 while the peer sidecar is connected and authenticated.")
                          .Register(*registry_)),
      peer_rtt_family_(BuildGauge()
                           .Name("lightwire_peer_rtt_seconds")
                           .Help("Last measured round-trip time to the peer sidecar.")
                           .Register(*registry_)),
      tls_expiry_family_(BuildGauge()
                             .Name("lightwire_peer_tls_certificate_expiry_timestamp_seconds")
                             .Help("When this sidecar's peer TLS certificate expires (Unix time; "
                                   "only with peer.tls on).")
                             .Register(*registry_)),
      reward_family_(BuildGauge()
                         .Name("lightwire_reward")
                         .Help("The job's mean reported reward, of the newest step reported "
                               "(only once a trainer has reported one).")
                         .Register(*registry_)),
      anomalies_family_(counterFamily(*registry_, "lightwire_anomalies_total",
                                      "Anomalies detected in the global statistics, by kind.")),
      full_syncs_family_(counterFamily(*registry_, "lightwire_full_syncs_total",
                                       "Full (dense, residual-flushing) synchronisations, by "
                                       "reason.")),
      auto_switches_family_(counterFamily(*registry_, "lightwire_auto_switches_total",
                                          "Layers codec: auto moved to another rung, by group "
                                          "and rung.")),
      cosine_family_(BuildGauge()
                         .Name("lightwire_cosine_similarity")
                         .Help("Sampled cosine similarity between the compressed and the original "
                               "gradient, all ranks together, per tensor group.")
                         .Register(*registry_)),
      residual_family_(BuildGauge()
                           .Name("lightwire_residual_norm")
                           .Help("L2 norm of the residual the codecs hold back, all ranks "
                                 "together, per tensor group.")
                           .Register(*registry_)),
      start_time_(nowSeconds()) {
  for (const char* kind : {"nonfinite", "explosion", "vanishing"}) anomalies(kind);
  for (const char* reason : {"periodic", "divergence", "switch"}) fullSyncs(reason);
  for (const char* limit : kLimitNames) limitHits(limit);
  for (const char* listener : kListenerNames) {
    for (const char* limit : kListenerLimitNames) limitHits(limit, listener);
  }
  for (const char* reason : {"client", "owner_exited"}) buffersReleased(reason);
  for (const char* reason : {"header", "checksum", "queue"}) peerFramesRefused(reason);
  auto& stage_family = BuildHistogram()
                           .Name("lightwire_stage_duration_seconds")
                           .Help("Duration of each stage of a step.")
                           .Register(*registry_);
  const char* names[kStageCount] = {"ingest", "compress", "exchange", "decompress", "total"};
  for (size_t i = 0; i < kStageCount; ++i) {
    stages_[i] = &stage_family.Add({{"stage", names[i]}}, stageBuckets());
  }
}

prometheus::Gauge& Metrics::compressionRatio(std::string_view group) {
  return ratio_family_.Add({{"group", std::string(group)}});
}

prometheus::Counter& Metrics::httpRequests(std::string_view route, unsigned code) {
  return http_family_.Add({{"route", std::string(route)}, {"code", std::to_string(code)}});
}

prometheus::Counter& Metrics::limitHits(std::string_view limit, std::string_view listener) {
  if (listener.empty()) return limit_family_.Add({{"limit", std::string(limit)}});
  return limit_family_.Add({{"limit", std::string(limit)}, {"listener", std::string(listener)}});
}

prometheus::Counter& Metrics::buffersReleased(std::string_view reason) {
  return released_family_.Add({{"reason", std::string(reason)}});
}

prometheus::Counter& Metrics::peerFramesRefused(std::string_view reason) {
  return frames_refused_family_.Add({{"reason", std::string(reason)}});
}

prometheus::Gauge& Metrics::peerUp(uint32_t rank) {
  return peer_up_family_.Add({{"peer", std::to_string(rank)}});
}

prometheus::Gauge& Metrics::peerRtt(uint32_t rank) {
  return peer_rtt_family_.Add({{"peer", std::to_string(rank)}});
}

prometheus::Gauge& Metrics::tlsCertificateExpiry() { return tls_expiry_family_.Add({}); }

prometheus::Gauge& Metrics::reward() { return reward_family_.Add({}); }

void Metrics::setInfo(const std::map<std::string, std::string>& labels) {
  BuildGauge()
      .Name("lightwire_info")
      .Help(
          "Identity of this sidecar (value 1): job, rank, world size, version, transport, "
          "topology.")
      .Register(*registry_)
      .Add(labels)
      .Set(1);
}

prometheus::Counter& Metrics::anomalies(std::string_view kind) {
  return anomalies_family_.Add({{"kind", std::string(kind)}});
}

prometheus::Counter& Metrics::fullSyncs(std::string_view reason) {
  return full_syncs_family_.Add({{"reason", std::string(reason)}});
}

prometheus::Counter& Metrics::autoSwitches(std::string_view group, std::string_view rung) {
  return auto_switches_family_.Add({{"group", std::string(group)}, {"rung", std::string(rung)}});
}

prometheus::Gauge& Metrics::cosineSimilarity(std::string_view group) {
  return cosine_family_.Add({{"group", std::string(group)}});
}

prometheus::Gauge& Metrics::residualNorm(std::string_view group) {
  return residual_family_.Add({{"group", std::string(group)}});
}

std::string Metrics::exposition() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect()) + processMetrics(start_time_);
}

}  // namespace lightwire::metrics
