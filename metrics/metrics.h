#pragma once
// The sidecar's Prometheus registry (prometheus-cpp) and the stats its components touch on the hot
// path (docs/metrics.md "Catalog"). Every family and every fixed-label child is built once in the
// constructor and held as a reference; the hot path only increments and observes.

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

namespace lightwire::metrics {

/// Stages of one step, as labelled in lightwire_stage_duration_seconds{stage}.
enum class Stage { kIngest, kCompress, kExchange, kDecompress, kTotal };
inline constexpr size_t kStageCount = 5;

/// The `limit` labels of lightwire_limit_hits_total without a listener, created at zero when
/// Metrics is built.
inline constexpr const char* kLimitNames[] = {
    "body_bytes",          // limits.max_body_bytes (a CUDA buffer's size; HTTP bodies: below)
    "buffers",             // limits.max_buffers
    "buffers_per_client",  // limits.max_buffers_per_client
    "pending_steps",       // limits.max_pending_steps
    "state_bytes",         // limits.max_state_bytes
    "peer_handshakes",     // connections on the peer port still in their handshake (at accept)
};

/// The `limit` labels of lightwire_limit_hits_total{limit, listener}: limits an HTTP listener
/// enforces, counted per listener (kListenerNames), created at zero.
inline constexpr const char* kListenerLimitNames[] = {
    "body_bytes",              // limits.max_body_bytes
    "inflight_body_bytes",     // limits.max_inflight_body_bytes (bodies held at once)
    "header_bytes",            // limits.max_header_bytes
    "connections",             // limits.<listener>.max_connections: refused with 503
    "connections_per_source",  // limits.<listener>.max_per_source / max_per_uid: refused, 503
    "evicted",                 // a connection without a completed request closed for a new one
    "header_timeout",          // limits.header_timeout_s ran out (slow or silent client)
    "body_rate",               // a body slower than limits.min_body_rate
    "request_timeout",         // a reply not read within limits.idle_timeout_s
    "accept_errors",           // accept() failed (out of descriptors): accepting backs off
};
inline constexpr const char* kListenerNames[] = {"unix", "control_tcp", "admin"};

/// The registry and every family the sidecar exports. Thread-safe (prometheus-cpp's counters,
/// gauges and histograms are; the labelled lookups below take a lock and cache children).
class Metrics {
 public:
  Metrics();

  /// Prometheus text exposition of everything registered (also the process_* family).
  std::string exposition() const;
  prometheus::Registry& registry() { return *registry_; }

  // lightwire_raw_bytes_total: uncompressed bytes of the tensors compressed.
  prometheus::Counter& raw_bytes;
  // lightwire_wire_bytes_total{direction}: compressed bytes sent / received.
  prometheus::Counter& wire_bytes_sent;
  prometheus::Counter& wire_bytes_received;
  // lightwire_peer_data_frames_sent_total: DATA frames written to peers (payloads, statistics,
  // bucket headers, checksums).
  prometheus::Counter& data_frames_sent;
  // lightwire_steps_total{result}.
  prometheus::Counter& steps_ok;
  prometheus::Counter& steps_failed;
  prometheus::Counter& steps_nonfinite;
  // lightwire_fallbacks_total: steps the clients fell back to their process group (reported).
  prometheus::Counter& fallbacks;
  // lightwire_state_resets_total: tensors whose codec state started fresh (size or codec change).
  prometheus::Counter& state_resets;
  // lightwire_state_bytes: bytes of codec state held.
  prometheus::Gauge& state_bytes;
  // lightwire_pool_bytes: bytes of step buffers (results, local sums), kept and lent.
  prometheus::Gauge& pool_bytes;
  // lightwire_buffer_pool_bytes{pool}: buffers kept for reuse outside the step pool: frames
  // received from peers ("receive") and request bodies ("request_bodies"). Set at each scrape.
  prometheus::Gauge& receive_pool_bytes;
  prometheus::Gauge& body_pool_bytes;
  // lightwire_registered_buffers.
  prometheus::Gauge& registered_buffers;
  // lightwire_auth_failures_total: peer connections refused at the handshake.
  prometheus::Counter& auth_failures;
  // lightwire_result_mismatches_total: result checksums that differed between ranks.
  prometheus::Counter& result_mismatches;

  // Policies (docs/policies.md).
  // lightwire_rollbacks_total: compression settings reverted to the last known-good ones.
  prometheus::Counter& rollbacks;
  // lightwire_bypass_active: 1 while compression is bypassed (dense exchange) after an anomaly.
  prometheus::Gauge& bypass_active;
  // lightwire_checkpoints_total{result}: state files written ("ok") or not ("failed").
  prometheus::Counter& checkpoints_ok;
  prometheus::Counter& checkpoints_failed;
  // lightwire_skipped_steps_total: delayed-sync steps accumulated locally, not exchanged.
  prometheus::Counter& skipped_steps;

  /// lightwire_info{job_id,rank,world_size,version,transport,topology} = 1: who this sidecar is
  /// (join it on instance to label other series). Set once at start.
  void setInfo(const std::map<std::string, std::string>& labels);
  /// lightwire_anomalies_total{kind}: nonfinite, explosion, vanishing.
  prometheus::Counter& anomalies(std::string_view kind);
  /// lightwire_full_syncs_total{reason}: periodic, divergence.
  prometheus::Counter& fullSyncs(std::string_view reason);
  /// lightwire_auto_switches_total{group,rung}: `codec: auto` moved a layer of the group to the
  /// rung (its label in the ladder's text form, e.g. "dgc:0.01").
  prometheus::Counter& autoSwitches(std::string_view group, std::string_view rung);
  /// lightwire_auto_direct_windows_total: windows of steps `codec: auto` gave to the trainers'
  /// own process group (the `direct` rung, job-wide).
  prometheus::Counter& auto_direct_windows;
  /// lightwire_cosine_similarity{group}: sampled cosine between compressed and original gradient.
  prometheus::Gauge& cosineSimilarity(std::string_view group);
  /// lightwire_residual_norm{group}: L2 norm of the residual held back (all ranks together).
  prometheus::Gauge& residualNorm(std::string_view group);

  /// lightwire_stage_duration_seconds{stage}.
  prometheus::Histogram& stage(Stage s) { return *stages_[static_cast<size_t>(s)]; }
  /// lightwire_compression_ratio{group} (raw / wire bytes of the group's last step).
  prometheus::Gauge& compressionRatio(std::string_view group);
  /// lightwire_http_requests_total{route,code}; `route` is a template (bounded set).
  prometheus::Counter& httpRequests(std::string_view route, unsigned code);
  /// lightwire_limit_hits_total{limit}: requests, connections and steps refused because they hit
  /// one of the configured limits (docs/RELIABILITY.md, "Limits"). `limit` is one of kLimitNames.
  prometheus::Counter& limitHits(std::string_view limit, std::string_view listener = {});
  /// lightwire_buffers_released_total{reason}: registered buffers released by their client
  /// ("client") or because the process that registered them exited ("owner_exited").
  prometheus::Counter& buffersReleased(std::string_view reason);
  /// lightwire_peer_frames_refused_total{reason}: frames from authenticated peers that closed the
  /// connection: "header" (malformed, oversized, foreign or out-of-place), "checksum" (payload
  /// does not match its XXH3), "queue" (past the per-peer queue limits).
  prometheus::Counter& peerFramesRefused(std::string_view reason);
  /// lightwire_peer_up{peer} (1 connected and authenticated, 0 not); `peer` is the rank.
  prometheus::Gauge& peerUp(uint32_t rank);
  /// lightwire_peer_rtt_seconds{peer}: the last ping round trip to that rank.
  prometheus::Gauge& peerRtt(uint32_t rank);
  /// lightwire_peer_tls_certificate_expiry_timestamp_seconds: the end of validity of this
  /// sidecar's peer TLS certificate (exported only once set, i.e. with peer.tls on).
  prometheus::Gauge& tlsCertificateExpiry();
  /// lightwire_reward: the job's mean reported reward of the newest step reported (exported only
  /// once a trainer has reported one, POST /v1/report).
  prometheus::Gauge& reward();

 private:
  explicit Metrics(std::shared_ptr<prometheus::Registry> registry);
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Gauge>& ratio_family_;
  prometheus::Family<prometheus::Counter>& http_family_;
  prometheus::Family<prometheus::Counter>& limit_family_;
  prometheus::Family<prometheus::Counter>& released_family_;
  prometheus::Family<prometheus::Counter>& frames_refused_family_;
  prometheus::Family<prometheus::Gauge>& peer_up_family_;
  prometheus::Family<prometheus::Gauge>& peer_rtt_family_;
  prometheus::Family<prometheus::Gauge>& tls_expiry_family_;
  prometheus::Family<prometheus::Gauge>& reward_family_;
  prometheus::Family<prometheus::Counter>& anomalies_family_;
  prometheus::Family<prometheus::Counter>& full_syncs_family_;
  prometheus::Family<prometheus::Counter>& auto_switches_family_;
  prometheus::Family<prometheus::Gauge>& cosine_family_;
  prometheus::Family<prometheus::Gauge>& residual_family_;
  std::array<prometheus::Histogram*, kStageCount> stages_{};
  double start_time_ = 0;
};

}  // namespace lightwire::metrics
