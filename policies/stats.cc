#include "policies/stats.h"

#include <boost/json/parse.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

namespace lightwire::policies {
namespace {

constexpr uint8_t kStatsMagic[4] = {'L', 'W', 'S', '1'};
constexpr uint16_t kVersion = 4;
constexpr size_t kMaxRecordBytes = size_t{64} << 10;  // = proxy's kMaxStatsBytes
constexpr uint32_t kMaxRequests = 16;
constexpr size_t kMaxBodyBytes = size_t{48} << 10;

/// Whether `text` is a JSON object (Boost.JSON's parser: UTF-8, depth at most 32).
bool isJsonObject(const std::string& text) {
  boost::system::error_code ec;
  const boost::json::value v = boost::json::parse(text, ec);
  return !ec && v.is_object();
}

class Writer {
 public:
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  template <typename T>
  void le(T v) {
    for (size_t i = 0; i < sizeof(T); ++i)
      out.push_back(static_cast<uint8_t>(uint64_t(v) >> (8 * i)));
  }
  void f64(double v) { le(std::bit_cast<uint64_t>(v)); }
  std::vector<uint8_t> out;
};

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> b) : b_(b) {}
  bool need(size_t n) const { return b_.size() - pos_ >= n; }
  template <typename T>
  bool le(T& v) {
    if (!need(sizeof(T))) return false;
    uint64_t x = 0;
    for (size_t i = 0; i < sizeof(T); ++i) x |= uint64_t{b_[pos_ + i]} << (8 * i);
    pos_ += sizeof(T);
    v = static_cast<T>(x);
    return true;
  }
  bool f64(double& v) {
    uint64_t u = 0;
    if (!le(u)) return false;
    v = std::bit_cast<double>(u);
    return true;
  }
  bool str(std::string& s, size_t n) {
    if (!need(n)) return false;
    s.assign(reinterpret_cast<const char*>(b_.data() + pos_), n);
    pos_ += n;
    return true;
  }
  size_t left() const { return b_.size() - pos_; }

 private:
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
};

/// The value checks a record and a fold share.
bool validSeconds(double v) { return v >= 0 && std::isfinite(v); }
bool validLink(double bps, double lat) {
  return bps > 0 && std::isfinite(bps) && validSeconds(lat);
}
bool validTiming(double compute, double overlap) {
  return validSeconds(compute) && overlap >= 0 && overlap <= compute;
}
bool validMomentum(double m) { return m > 0 && m < 1; }

void writeRequest(Writer& w, const Request& r, bool with_origin) {
  w.le<uint8_t>(static_cast<uint8_t>(r.kind));
  w.le<uint64_t>(r.id);
  w.le<uint64_t>(r.step);
  if (with_origin) w.le<uint32_t>(r.origin);
  w.le<uint32_t>(static_cast<uint32_t>(r.body.size()));
  w.bytes(r.body.data(), r.body.size());
}

/// One request as writeRequest() wrote it, checked; `what` names the container in errors.
Status readRequest(Reader& r, Request& q, bool with_origin, const char* what) {
  uint8_t kind = 0;
  uint32_t len = 0;
  if (!r.le(kind) || !r.le(q.id) || !r.le(q.step) || (with_origin && !r.le(q.origin)) ||
      !r.le(len)) {
    return invalidArgument(std::string(what) + " is truncated");
  }
  if (kind != 1 && kind != 2) {
    return invalidArgument(std::string(what) + ": unknown request kind " + std::to_string(kind));
  }
  q.kind = static_cast<Request::Kind>(kind);
  if (len > kMaxBodyBytes) return invalidArgument(std::string(what) + ": request body too long");
  if (q.kind == Request::Kind::kCheckpoint && len != 0) {
    return invalidArgument(std::string(what) + ": a checkpoint request has no body");
  }
  if (!r.str(q.body, len)) return invalidArgument(std::string(what) + " is truncated");
  if (q.kind == Request::Kind::kSettings && !isJsonObject(q.body)) {
    // Every rank keeps the settings in its history, its status, its checkpoints and the job
    // state it tells rejoining peers, all JSON: bytes that are not would make those unreadable.
    return invalidArgument(std::string(what) + ": a settings request's body is not a JSON object");
  }
  return Status::ok();
}

}  // namespace

std::optional<double> GlobalStats::cosine() const {
  if (cos_ranks == 0 || !(cos_c2 > 0) || !(cos_g2 > 0)) return std::nullopt;
  const double c = cos_dot / std::sqrt(cos_c2 * cos_g2);
  if (!std::isfinite(c)) return std::nullopt;
  // A cosine is in [-1, 1] (beyond only by rounding, or in a record that is not honest).
  return std::clamp(c, -1.0, 1.0);
}

namespace {

/// The mean of `ranks` reported values summing to `sum` (finite values whose sum overflowed: none).
std::optional<double> reportedMean(uint32_t ranks, double sum) {
  if (ranks == 0) return std::nullopt;
  const double mean = sum / ranks;
  if (!std::isfinite(mean)) return std::nullopt;
  return mean;
}

}  // namespace

std::optional<double> GlobalStats::loss() const { return reportedMean(loss_ranks, loss_sum); }

std::optional<double> GlobalStats::reward() const { return reportedMean(reward_ranks, reward_sum); }

std::vector<uint8_t> encodeStats(const StepStats& s) {
  Writer w;
  w.bytes(kStatsMagic, 4);
  w.le<uint16_t>(kVersion);
  const bool cos = s.cos_dot && s.cos_c2 && s.cos_g2;
  const bool link = s.link_bytes_per_s && s.link_latency_s;
  const bool timing = s.compute_s && s.overlap_s;
  w.le<uint16_t>(static_cast<uint16_t>(
      (cos ? 1 : 0) | (s.loss ? 2 : 0) | (link ? 4 : 0) | (timing ? 8 : 0) | (s.direct_s ? 16 : 0) |
      (s.tail_s ? 32 : 0) | (s.momentum ? 64 : 0) | (s.reward ? 128 : 0)));
  w.f64(s.grad_norm2);
  w.le<uint64_t>(s.nonfinite);
  w.le<uint64_t>(s.elements);
  w.le<uint64_t>(s.small);
  w.f64(s.residual_norm2);
  w.f64(cos ? *s.cos_dot : 0.0);
  w.f64(cos ? *s.cos_c2 : 0.0);
  w.f64(cos ? *s.cos_g2 : 0.0);
  w.f64(s.loss.value_or(0.0));
  w.le<uint64_t>(s.loss_step);
  w.le<uint64_t>(s.resumed_from ? *s.resumed_from + 1 : 0);
  w.f64(link ? *s.link_bytes_per_s : 0.0);
  w.f64(link ? *s.link_latency_s : 0.0);
  w.f64(timing ? *s.compute_s : 0.0);
  w.f64(timing ? *s.overlap_s : 0.0);
  w.f64(s.direct_s.value_or(0.0));
  w.f64(s.tail_s.value_or(0.0));
  w.f64(s.momentum.value_or(0.0));
  w.f64(s.reward.value_or(0.0));
  w.le<uint64_t>(s.reward_step);
  w.le<uint32_t>(static_cast<uint32_t>(s.requests.size()));
  for (const auto& r : s.requests) writeRequest(w, r, false);
  return std::move(w.out);
}

Result<StepStats> decodeStats(std::span<const uint8_t> bytes) {
  if (bytes.size() > kMaxRecordBytes) {
    return invalidArgument("statistics record of " + std::to_string(bytes.size()) +
                           " bytes (at most " + std::to_string(kMaxRecordBytes) + ")");
  }
  Reader r(bytes);
  const auto truncated = [] { return invalidArgument("statistics record is truncated"); };
  if (bytes.size() < 4 || std::memcmp(bytes.data(), kStatsMagic, 4) != 0) {
    return invalidArgument("not a statistics record (bad magic)");
  }
  std::string skip;
  (void)r.str(skip, 4);
  uint16_t version = 0, flags = 0;
  if (!r.le(version) || !r.le(flags)) return truncated();
  if (version < 1 || version > kVersion) {
    return invalidArgument("statistics record version " + std::to_string(version) +
                           " (this sidecar reads 1 to " + std::to_string(kVersion) + ")");
  }
  const uint16_t known = version == 1 ? 3 : version == 2 ? 63 : version == 3 ? 127 : 255;
  if ((flags & ~known) != 0) return invalidArgument("statistics record: unknown flags");
  StepStats s;
  double dot = 0, c2 = 0, g2 = 0, loss = 0;
  uint64_t resumed = 0;
  if (!r.f64(s.grad_norm2) || !r.le(s.nonfinite) || !r.le(s.elements) || !r.le(s.small) ||
      !r.f64(s.residual_norm2) || !r.f64(dot) || !r.f64(c2) || !r.f64(g2) || !r.f64(loss) ||
      !r.le(s.loss_step) || !r.le(resumed)) {
    return truncated();
  }
  if (s.nonfinite > s.elements || s.small > s.elements) {
    return invalidArgument("statistics record: counts exceed the element count");
  }
  if (flags & 1) {
    s.cos_dot = dot;
    s.cos_c2 = c2;
    s.cos_g2 = g2;
  }
  if (flags & 2) s.loss = loss;
  if (resumed > 0) s.resumed_from = resumed - 1;
  if (version >= 2) {
    double bps = 0, lat = 0, compute = 0, overlap = 0, direct = 0, tail = 0;
    if (!r.f64(bps) || !r.f64(lat) || !r.f64(compute) || !r.f64(overlap) || !r.f64(direct) ||
        !r.f64(tail)) {
      return truncated();
    }
    for (auto [bit, v, out] :
         {std::tuple{16, direct, &s.direct_s}, std::tuple{32, tail, &s.tail_s}}) {
      if ((flags & bit) == 0) continue;
      if (!validSeconds(v)) {
        return invalidArgument("statistics record: direct and tail seconds must be finite, >= 0");
      }
      *out = v;
    }
    if (flags & 4) {
      if (!validLink(bps, lat)) {
        return invalidArgument("statistics record: link figures must be finite, bandwidth > 0");
      }
      s.link_bytes_per_s = bps;
      s.link_latency_s = lat;
    }
    if (flags & 8) {
      if (!validTiming(compute, overlap)) {
        return invalidArgument(
            "statistics record: compute and overlap must be finite, 0 <= overlap <= compute");
      }
      s.compute_s = compute;
      s.overlap_s = overlap;
    }
  }
  if (version >= 3) {
    double m = 0;
    if (!r.f64(m)) return truncated();
    if (flags & 64) {
      if (!validMomentum(m)) {
        return invalidArgument("statistics record: the declared momentum must lie in (0, 1)");
      }
      s.momentum = m;
    }
  }
  if (version >= 4) {
    double reward = 0;
    if (!r.f64(reward) || !r.le(s.reward_step)) return truncated();
    if (flags & 128) {
      if (!std::isfinite(reward)) {
        return invalidArgument("statistics record: the reported reward must be finite");
      }
      s.reward = reward;
    }
  }
  uint32_t count = 0;
  if (!r.le(count)) return truncated();
  if (count > kMaxRequests) {
    return invalidArgument("statistics record: " + std::to_string(count) + " requests (at most " +
                           std::to_string(kMaxRequests) + ")");
  }
  for (uint32_t i = 0; i < count; ++i) {
    Request q;
    LW_RETURN_IF_ERROR(readRequest(r, q, false, "statistics record"));
    s.requests.push_back(std::move(q));
  }
  if (r.left() != 0) return invalidArgument("statistics record: trailing bytes");
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

namespace {

constexpr uint8_t kPartialMagic[4] = {'L', 'W', 'P', '1'};
constexpr uint32_t kMaxRanks = 1u << 16;  // = proxy's largest world size

/// Adds a rank's reported value (a loss, a reward) of step `step` to the count, sum and newest
/// step of the fold.
void addReported(const std::optional<double>& v, uint64_t step, uint32_t& ranks, double& sum,
                 uint64_t& newest) {
  if (!v || !std::isfinite(*v)) return;
  ++ranks;
  sum += *v;
  newest = std::max(newest, step);
}

/// Folds one decoded record of `rank` into `p` (rank order: the caller checks it).
void foldInto(PartialStats& p, StepStats s, uint32_t rank) {
  GlobalStats& g = p.g;
  ++g.ranks;
  g.grad_norm2 += s.grad_norm2;
  g.nonfinite += s.nonfinite;
  g.elements += s.elements;
  g.small += s.small;
  g.residual_norm2 += s.residual_norm2;
  if (s.cos_dot) {
    ++g.cos_ranks;
    g.cos_dot += *s.cos_dot;
    g.cos_c2 += *s.cos_c2;
    g.cos_g2 += *s.cos_g2;
  }
  addReported(s.loss, s.loss_step, g.loss_ranks, g.loss_sum, g.loss_step);
  addReported(s.reward, s.reward_step, g.reward_ranks, g.reward_sum, g.reward_step);
  if (s.link_bytes_per_s) {
    // The fastest link any rank measured: an exchange is collective, so every rank's time
    // holds the slowest hop, and what differs between ranks is how long each waited for the
    // others to arrive (docs/policies.md "The inputs, identical on every rank").
    g.link_bytes_per_s = std::max(g.link_bytes_per_s.value_or(0.0), *s.link_bytes_per_s);
    g.link_latency_s = std::min(g.link_latency_s.value_or(INFINITY), *s.link_latency_s);
  }
  if (s.direct_s) g.direct_s = std::max(g.direct_s.value_or(0.0), *s.direct_s);
  if (s.tail_s) g.tail_s = std::max(g.tail_s.value_or(0.0), *s.tail_s);
  if (s.compute_s) {
    p.computes.push_back(*s.compute_s);
    p.overlaps.push_back(*s.overlap_s);
  }
  if (!s.momentum || (g.momentum && *g.momentum != *s.momentum)) p.momentum_agreed = false;
  if (s.momentum && !g.momentum) g.momentum = s.momentum;
  g.resumed_from.push_back(s.resumed_from);
  for (auto& q : s.requests) {
    q.origin = rank;
    g.requests.push_back(std::move(q));
  }
  p.next_rank = rank + 1;
}

GlobalStats finish(PartialStats p) {
  GlobalStats g = std::move(p.g);
  if (!p.momentum_agreed) g.momentum.reset();
  // The compute (and overlap) as the median of what the ranks reported: each rank's figure
  // swings from step to step (the trainers share the cores; one evaluates), and the least of
  // them all is biased low by that noise — on the MLP at 10 Gbit/s it read half the compute
  // and made a lossy rung look twice as cheap as it is.
  if (!p.computes.empty()) {
    g.compute_s = median(std::move(p.computes));
    g.overlap_s = median(std::move(p.overlaps));
  }
  return g;
}

std::vector<uint8_t> encodePartial(const PartialStats& p) {
  const GlobalStats& g = p.g;
  Writer w;
  w.bytes(kPartialMagic, 4);
  w.le<uint32_t>(g.ranks);
  w.le<uint32_t>(p.next_rank);
  const bool link = g.link_bytes_per_s.has_value();
  w.le<uint8_t>(static_cast<uint8_t>((link ? 1 : 0) | (g.direct_s ? 2 : 0) | (g.tail_s ? 4 : 0) |
                                     (g.momentum ? 8 : 0) | (p.momentum_agreed ? 16 : 0)));
  w.f64(g.grad_norm2);
  w.le<uint64_t>(g.nonfinite);
  w.le<uint64_t>(g.elements);
  w.le<uint64_t>(g.small);
  w.f64(g.residual_norm2);
  w.le<uint32_t>(g.cos_ranks);
  w.f64(g.cos_dot);
  w.f64(g.cos_c2);
  w.f64(g.cos_g2);
  w.le<uint32_t>(g.loss_ranks);
  w.f64(g.loss_sum);
  w.le<uint64_t>(g.loss_step);
  w.le<uint32_t>(g.reward_ranks);
  w.f64(g.reward_sum);
  w.le<uint64_t>(g.reward_step);
  w.f64(link ? *g.link_bytes_per_s : 0.0);
  w.f64(link ? *g.link_latency_s : 0.0);
  w.f64(g.direct_s.value_or(0.0));
  w.f64(g.tail_s.value_or(0.0));
  w.f64(g.momentum.value_or(0.0));
  // Resume marks as runs of equal values (every rank's is normally the same: one run).
  std::vector<std::pair<uint64_t, uint32_t>> runs;  // (value + 1 or 0, count)
  for (const auto& r : g.resumed_from) {
    const uint64_t v = r ? *r + 1 : 0;
    if (!runs.empty() && runs.back().first == v) {
      ++runs.back().second;
    } else {
      runs.emplace_back(v, 1);
    }
  }
  w.le<uint32_t>(static_cast<uint32_t>(runs.size()));
  for (const auto& [v, n] : runs) {
    w.le<uint64_t>(v);
    w.le<uint32_t>(n);
  }
  w.le<uint32_t>(static_cast<uint32_t>(p.computes.size()));
  for (size_t i = 0; i < p.computes.size(); ++i) {
    w.f64(p.computes[i]);
    w.f64(p.overlaps[i]);
  }
  w.le<uint32_t>(static_cast<uint32_t>(g.requests.size()));
  for (const auto& q : g.requests) writeRequest(w, q, true);
  return std::move(w.out);
}

Result<PartialStats> decodePartial(std::span<const uint8_t> bytes) {
  const char* what = "partial statistics";
  auto bad = [&](const std::string& why) {
    return invalidArgument(std::string(what) + ": " + why);
  };
  const auto truncated = [&] { return invalidArgument(std::string(what) + " are truncated"); };
  if (bytes.size() < 4 || std::memcmp(bytes.data(), kPartialMagic, 4) != 0) {
    return invalidArgument("not partial statistics (bad magic)");
  }
  Reader r(bytes.subspan(4));
  PartialStats p;
  GlobalStats& g = p.g;
  uint8_t flags = 0;
  double bps = 0, lat = 0, direct = 0, tail = 0, m = 0;
  if (!r.le(g.ranks) || !r.le(p.next_rank) || !r.le(flags) || !r.f64(g.grad_norm2) ||
      !r.le(g.nonfinite) || !r.le(g.elements) || !r.le(g.small) || !r.f64(g.residual_norm2) ||
      !r.le(g.cos_ranks) || !r.f64(g.cos_dot) || !r.f64(g.cos_c2) || !r.f64(g.cos_g2) ||
      !r.le(g.loss_ranks) || !r.f64(g.loss_sum) || !r.le(g.loss_step) || !r.le(g.reward_ranks) ||
      !r.f64(g.reward_sum) || !r.le(g.reward_step) || !r.f64(bps) || !r.f64(lat) ||
      !r.f64(direct) || !r.f64(tail) || !r.f64(m)) {
    return truncated();
  }
  if ((flags & ~31) != 0) return bad("unknown flags");
  if (g.ranks > p.next_rank || p.next_rank > kMaxRanks) return bad("more records than ranks");
  if (g.cos_ranks > g.ranks || g.loss_ranks > g.ranks || g.reward_ranks > g.ranks) {
    return bad("counts exceed the records");
  }
  if (g.nonfinite > g.elements || g.small > g.elements) {
    return bad("counts exceed the element count");
  }
  if (flags & 1) {
    if (!validLink(bps, lat)) return bad("link figures must be finite, bandwidth > 0");
    g.link_bytes_per_s = bps;
    g.link_latency_s = lat;
  }
  for (auto [bit, v, out] : {std::tuple{2, direct, &g.direct_s}, std::tuple{4, tail, &g.tail_s}}) {
    if ((flags & bit) == 0) continue;
    if (!validSeconds(v)) return bad("direct and tail seconds must be finite, >= 0");
    *out = v;
  }
  if (flags & 8) {
    if (!validMomentum(m)) return bad("the declared momentum must lie in (0, 1)");
    g.momentum = m;
  }
  p.momentum_agreed = (flags & 16) != 0;
  uint32_t runs = 0;
  if (!r.le(runs)) return truncated();
  if (runs > g.ranks) return bad("more resume runs than records");
  for (uint32_t i = 0; i < runs; ++i) {
    uint64_t v = 0;
    uint32_t n = 0;
    if (!r.le(v) || !r.le(n)) return truncated();
    if (n == 0 || n > g.ranks - g.resumed_from.size()) return bad("resume runs do not add up");
    const std::optional<uint64_t> mark = v ? std::optional<uint64_t>(v - 1) : std::nullopt;
    g.resumed_from.insert(g.resumed_from.end(), n, mark);
  }
  if (g.resumed_from.size() != g.ranks) return bad("resume runs do not add up");
  uint32_t computes = 0;
  if (!r.le(computes)) return truncated();
  if (computes > g.ranks) return bad("more compute figures than records");
  for (uint32_t i = 0; i < computes; ++i) {
    double c = 0, o = 0;
    if (!r.f64(c) || !r.f64(o)) return truncated();
    if (!validTiming(c, o)) {
      return bad("compute and overlap must be finite, 0 <= overlap <= compute");
    }
    p.computes.push_back(c);
    p.overlaps.push_back(o);
  }
  uint32_t count = 0;
  if (!r.le(count)) return truncated();
  if (uint64_t{count} > uint64_t{kMaxRequests} * g.ranks) {
    return bad(std::to_string(count) + " requests (at most " + std::to_string(kMaxRequests) +
               " per record)");
  }
  for (uint32_t i = 0; i < count; ++i) {
    Request q;
    LW_RETURN_IF_ERROR(readRequest(r, q, true, what));
    if (q.origin >= p.next_rank || (!g.requests.empty() && q.origin < g.requests.back().origin)) {
      return bad("requests out of rank order");
    }
    g.requests.push_back(std::move(q));
  }
  if (r.left() != 0) return bad("trailing bytes");
  return p;
}

}  // namespace

Result<std::vector<uint8_t>> foldStats(std::span<const uint8_t> partial,
                                       std::span<const uint8_t> record, uint32_t rank) {
  PartialStats p;
  if (!partial.empty()) {
    auto got = decodePartial(partial);
    if (!got) return got.status();
    p = std::move(*got);
  }
  if (rank < p.next_rank || rank >= kMaxRanks) {
    return invalidArgument("the record of rank " + std::to_string(rank) +
                           " comes after ranks up to " + std::to_string(p.next_rank) +
                           ": records fold in rank order");
  }
  auto s = decodeStats(record);
  if (!s) return invalidArgument("rank " + std::to_string(rank) + ": " + s.status().message());
  foldInto(p, std::move(*s), rank);
  return encodePartial(p);
}

Result<GlobalStats> finishStats(std::span<const uint8_t> partial) {
  auto p = decodePartial(partial);
  if (!p) return p.status();
  return finish(std::move(*p));
}

Result<GlobalStats> aggregate(const std::vector<std::vector<uint8_t>>& records) {
  PartialStats p;
  for (size_t rank = 0; rank < records.size(); ++rank) {
    if (records[rank].empty()) continue;
    auto s = decodeStats(records[rank]);
    if (!s) return invalidArgument("rank " + std::to_string(rank) + ": " + s.status().message());
    foldInto(p, std::move(*s), static_cast<uint32_t>(rank));
  }
  return finish(std::move(p));
}

std::optional<std::string> resumeMismatch(const GlobalStats& g) {
  bool differ = false;
  for (const auto& r : g.resumed_from) differ = differ || r != g.resumed_from.front();
  if (!differ) return std::nullopt;
  std::string list;
  for (size_t i = 0; i < g.resumed_from.size(); ++i) {
    list += (i ? ", " : "") +
            (g.resumed_from[i] ? std::to_string(*g.resumed_from[i]) : std::string("none"));
  }
  return "the sidecars resumed from different steps (in rank order: " + list +
         "): POST /v1/resume with the same step at every sidecar before the next step";
}

}  // namespace lightwire::policies
