#include "policies/auto.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <set>

#include "kernels/registry.h"

namespace lightwire::policies {
namespace {

constexpr size_t kMaxRungs = 16;

/// The sidecar's CPU time per element, encode and decode, in nanoseconds: `lightwire bench codec
/// --codec C --elements 4000000 --threads 1` on the development machine (docs/policies.md
/// "codec: auto" has the table). Codecs without a figure there get the nearest kin's.
double costNs(const kernels::CodecConfig& c) {
  if (c.name == "none") return 0.45;
  if (c.name == "fp16" || c.name == "bf16") return 0.22;
  if (c.name == "qsgd") return c.bits <= 4 ? 1.96 : 0.84;
  if (c.name == "dgc") return c.density && *c.density <= 0.001 ? 0.45 : 0.90;
  if (c.name == "topk") return 1.07;
  if (c.name == "randomk") return 0.45;
  if (c.name == "powersgd") return 2.0 * c.approx_rank;
  return 1.0;
}

std::string percent(double d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g %%", d * 100);
  return buf;
}

/// The steps factor of a rung without its own: 1 for lossless rungs; for the others the steps
/// the time-to-accuracy benchmarks measured to reach DDP's loss, over DDP's (docs/policies.md
/// "codec: auto": qsgd 4 bits 1.34, topk 1 % 2.5, powersgd rank 4 1.5), and guesses from the
/// nearest measured kin where no row exists (marked so in the table there).
double stepsFactor(const kernels::CodecConfig& c) {
  if (c.name == "none" || c.name == "fp16" || c.name == "bf16") return 1.0;
  if (c.name == "qsgd") return c.bits >= 8 ? 1.05 : (c.bits >= 4 ? 1.34 : 2.0);
  if (c.name == "powersgd") return c.approx_rank >= 4 ? 1.5 : 2.5;
  if (c.name == "topk" || c.name == "dgc" || c.name == "randomk") {
    const double d = c.density.value_or(0.01);
    // dgc with momentum correction: 1.45 (540 and 600 steps against DDP's 380 and 400,
    // docs/BENCHMARKS-tta-auto.md); with bias correction 1.33, the larger of its two measured
    // (DDP's 343 steps on the MLP, docs/BENCHMARKS-tta-biascorr.md; 400 against 300 on the LM,
    // docs/BENCHMARKS-tta-lm-biascorr.md); error feedback alone: topk's 2.5.
    const double base = c.name == "randomk" ? 5.0
                        : c.bias_correction ? 1.33
                        : c.momentum > 0    ? 1.45
                                            : 2.5;
    return d >= 0.01 ? base : base * 2;  // sparser than measured: twice the steps, a guess
  }
  return 2.0;
}

/// One rung from its text ("qsgd:8", "dgc:0.01@2"); "" when fine, else why not.
std::string parseRung(std::string_view full, Rung* out) {
  std::string_view text = full;
  std::optional<double> factor;
  if (const size_t at = full.find('@'); at != std::string_view::npos) {
    text = full.substr(0, at);
    const std::string f(full.substr(at + 1));
    char* end = nullptr;
    const double v = std::strtod(f.c_str(), &end);
    if (f.empty() || !end || *end != '\0' || !(v >= 1 && v <= 100)) {
      return "its steps factor (after '@') must be a number in [1, 100]";
    }
    factor = v;
  }
  const size_t colon = text.find(':');
  const std::string name(text.substr(0, colon));
  const std::string arg =
      colon == std::string_view::npos ? "" : std::string(text.substr(colon + 1));
  Rung r;
  r.text = std::string(full);
  auto numberIn = [](const std::string& text, double* v) {
    if (text.empty()) return false;
    char* end = nullptr;
    *v = std::strtod(text.c_str(), &end);
    return end && *end == '\0' && std::isfinite(*v);
  };
  auto number = [&](double* v) { return numberIn(arg, v); };
  double v = 0;
  if (name == "direct" || name == "none" || name == "fp16" || name == "bf16") {
    if (!arg.empty()) return "'" + name + "' takes no argument";
    r.direct = name == "direct";
    r.codec.name = r.direct ? "none" : name;
    r.label = name;
  } else if (name == "qsgd") {
    if (!number(&v) || v != std::floor(v) || v < 2 || v > 8) {
      return "qsgd needs its bits, 2..8 (qsgd:8)";
    }
    r.codec.name = "qsgd";
    r.codec.bits = static_cast<int>(v);
    r.label = "qsgd " + arg + " bits";
  } else if (name == "dgc" && arg.find(':') != std::string::npos) {
    // dgc:DENSITY:MOMENTUM[:bc]: DGC's momentum correction, the sidecar owning the layer's
    // momentum while the rung is in force (docs/policies.md "What a switch does to a layer's
    // state"); `bc`: with dgc's bias correction (docs/codecs.md "dgc's bias correction").
    const std::string d = arg.substr(0, arg.find(':'));
    std::string m = arg.substr(arg.find(':') + 1);
    bool bias = false;
    if (const size_t third = m.find(':'); third != std::string::npos) {
      if (m.substr(third + 1) != "bc") {
        return "dgc's last part (after the third ':') can only be 'bc', bias correction "
               "(dgc:0.01:0.9:bc)";
      }
      bias = true;
      m = m.substr(0, third);
    }
    double mom = 0;
    if (!numberIn(d, &v) || !(v > 0 && v <= 1)) {
      return "dgc needs its density in (0, 1] (dgc:0.01:0.9)";
    }
    if (!numberIn(m, &mom) || !(mom > 0 && mom < 1)) {
      return "dgc's momentum (after the second ':') must be in (0, 1) (dgc:0.01:0.9)";
    }
    r.codec.name = "dgc";
    r.codec.density = v;
    r.codec.momentum = mom;
    r.codec.bias_correction = bias;
    r.label = "dgc " + percent(v) + " momentum " + m + (bias ? " bias-corrected" : "");
  } else if (name == "topk" || name == "dgc" || name == "randomk") {
    if (!number(&v) || !(v > 0 && v <= 1))
      return name + " needs its density in (0, 1] (" + name + ":0.01)";
    r.codec.name = name;
    r.codec.density = v;
    r.label = name + " " + percent(v);
  } else if (name == "powersgd") {
    if (!number(&v) || v != std::floor(v) || v < 1 || v > 64) {
      return "powersgd needs its rank, 1..64 (powersgd:4)";
    }
    r.codec.name = "powersgd";
    r.codec.approx_rank = static_cast<int>(v);
    r.label = "powersgd rank " + arg;
  } else {
    return "unknown rung '" + name +
           "' (direct, none, fp16, bf16, qsgd:BITS, topk:D, dgc:D, dgc:D:MOMENTUM, "
           "dgc:D:MOMENTUM:bc, randomk:D, powersgd:RANK)";
  }
  auto codec = kernels::createCodec(r.codec);
  if (!codec) return codec.status().message();
  r.impl = std::move(*codec);
  r.cost_ns = r.direct ? 0.0 : costNs(r.codec);
  r.steps_factor = factor.value_or(stepsFactor(r.codec));
  if (factor) r.label += " @" + std::string(full.substr(full.find('@') + 1));
  *out = std::move(r);
  return "";
}

}  // namespace

Result<std::vector<Rung>> parseLadder(std::string_view text) {
  std::vector<Rung> out;
  std::set<std::string> seen;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view item = text.substr(pos, comma - pos);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    const std::string where = "compression.auto.ladder: rung " + std::to_string(out.size() + 1);
    if (item.empty()) return invalidArgument(where + " is empty");
    Rung r;
    if (std::string e = parseRung(item, &r); !e.empty()) {
      return invalidArgument(where + " ('" + std::string(item) + "'): " + e);
    }
    if (r.direct && !out.empty()) {
      return invalidArgument(where + ": 'direct' can only be the first rung (it is lossless)");
    }
    if (!seen.insert(r.text.substr(0, r.text.find('@'))).second)
      return invalidArgument(where + " ('" + r.text + "') twice");
    out.push_back(std::move(r));
    if (out.size() > kMaxRungs) {
      return invalidArgument("compression.auto.ladder: more than " + std::to_string(kMaxRungs) +
                             " rungs");
    }
    pos = comma + 1;
  }
  if (out.empty() || (out.size() == 1 && out[0].direct)) {
    return invalidArgument("compression.auto.ladder needs a rung through the sidecar");
  }
  return out;
}

Status validate(AutoConfig& c) {
  auto bad = [](const char* key, const std::string& what) {
    return invalidArgument(std::string("compression.auto.") + key + " must be " + what);
  };
  if (c.period < 1) return bad("period", "at least 1");
  if (c.hysteresis < 1) return bad("hysteresis", "at least 1");
  if (!(c.tolerance >= 0 && c.tolerance <= 10)) return bad("tolerance", "in [0, 10]");
  if (!(c.link_change > 0 && c.link_change <= 10)) return bad("link_change", "in (0, 10]");
  if (!(c.momentum_margin >= 0 && c.momentum_margin <= 10)) {
    return bad("momentum_margin", "in [0, 10]");
  }
  if (!(c.critical_change > 0)) return bad("critical_change", "> 0");
  if (c.probe_every < 1) return bad("probe_every", "at least 1");
  auto ladder = parseLadder(c.ladder_text);
  if (!ladder) return ladder.status();
  c.ladder = std::move(*ladder);
  return Status::ok();
}

void LinkEstimator::add(double bytes, double seconds) {
  if (!(bytes > 0) || !(seconds > 0) || !std::isfinite(bytes) || !std::isfinite(seconds)) return;
  points_.emplace_back(bytes, seconds);
  while (points_.size() > kWindow) points_.pop_front();
}

namespace {

/// The least-squares fit of time = latency + bytes / bandwidth to `use` (not empty).
Link fitLink(const std::vector<std::pair<double, double>>& use) {
  const double n = static_cast<double>(use.size());
  double sb = 0, st = 0, tmin = use.front().second, bmax = 0;
  for (const auto& [b, t] : use) {
    sb += b;
    st += t;
    tmin = std::min(tmin, t);
    bmax = std::max(bmax, b);
  }
  const double mb = sb / n, mt = st / n;
  double cov = 0, var = 0;
  for (const auto& [b, t] : use) {
    cov += (b - mb) * (t - mt);
    var += (b - mb) * (b - mb);
  }
  Link l;
  if (use.size() >= 3 && var > 0 && std::sqrt(var / n) > 0.1 * mb) {
    // Sizes spread enough (more than 10 % around their mean) to tell latency from bandwidth.
    if (cov > 0) {
      const double slope = cov / var;
      l.bytes_per_s = 1.0 / slope;
      l.latency_s = std::clamp(mt - slope * mb, 0.0, tmin);
    } else {
      // Time does not grow with the bytes: the link is latency-bound (the largest payload costs
      // at most 5 % of the latency).
      l.latency_s = tmin;
      l.bytes_per_s = bmax / (0.05 * tmin);
    }
  } else {
    // One size: latency and bandwidth cannot be told apart. The mean rate, no latency (the
    // optimistic reading: a rung that moves fewer bytes then gets tried, and its exchanges spread
    // the sizes).
    l.bytes_per_s = sb / st;
    l.latency_s = 0;
  }
  return l;
}

}  // namespace

std::optional<Link> LinkEstimator::estimate() const {
  if (points_.empty()) return std::nullopt;
  // The newest kWindow points: older ones may be of a link that has changed since.
  std::vector<std::pair<double, double>> use(points_.end() - std::min(points_.size(), kWindow),
                                             points_.end());
  Link l = fitLink(use);
  // Waits only add: an exchange's time holds the link and however long this sidecar waited for
  // its peers to arrive (their compute differs from step to step; one evaluates). Points above
  // the fit by more than the median residual (and 5 % of the mean time, the noise of a clean
  // link) are such waits: the fit of the rest is the link's.
  if (use.size() >= 4) {
    std::vector<double> res;
    double st = 0;
    for (const auto& [b, t] : use) {
      res.push_back(t - (l.latency_s + b / l.bytes_per_s));
      st += t;
    }
    std::vector<double> sorted = res;
    std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
    const double cut = sorted[sorted.size() / 2] + 0.05 * st / static_cast<double>(use.size());
    std::vector<std::pair<double, double>> kept;
    for (size_t i = 0; i < use.size(); ++i) {
      // The newest points stay whatever their residual: a link that slowed down is slow points
      // at the end of the window, which must move the fit within a few steps.
      if (res[i] <= cut || i + kKeepNewest >= use.size()) kept.push_back(use[i]);
    }
    if (kept.size() >= 2 && kept.size() < use.size()) l = fitLink(kept);
  }
  return l;
}

double modelBytes(const kernels::Codec& impl, uint64_t n, const std::vector<uint64_t>& shape,
                  uint32_t world, std::optional<double> density) {
  if (world <= 1 || n == 0) return 0;
  const double w = world;
  const kernels::CodecConfig& codec = impl.config();
  if (codec.name == "powersgd") {
    const uint64_t rows = shape.empty() ? n : shape[0];
    const uint64_t cols = rows ? n / rows : 1;
    const double r = std::min<double>(codec.approx_rank, std::min(rows, cols));
    // Two rounds of summable factors: P (rows × r) then Q (cols × r).
    return 2 * (w - 1) / w * 4.0 * r * static_cast<double>(rows + cols);
  }
  // The nominal payload (selection codecs: k pairs at the step's density), not the worst case.
  const double payload =
      static_cast<double>(impl.nominalPayloadBytes(n, density).value_or(impl.maxPayloadBytes(n)));
  return impl.traits().summable ? 2 * (w - 1) / w * payload : (w - 1) * payload;
}

std::string ladderText(const std::vector<Rung>& ladder) {
  std::string out;
  for (const Rung& r : ladder) out += (out.empty() ? "" : ",") + r.text;
  return out;
}

bool rungStalenessSafe(const Rung& r) {
  if (r.direct || !r.impl) return true;
  const auto& traits = r.impl->traits();
  return traits.rounds <= 1 && traits.staleness_safe;
}

bool rungUsable(const Rung& r, uint64_t n, const std::vector<uint64_t>& shape,
                std::optional<double> momentum) {
  if (r.codec.momentum > 0) return momentum && *momentum == r.codec.momentum;
  if (r.codec.name != "powersgd") return true;
  if (shape.size() < 2 || n == 0) return false;
  const double rows = static_cast<double>(shape[0]), cols = static_cast<double>(n) / rows;
  return rows * cols > 2.0 * (rows + cols) * r.codec.approx_rank;
}

double modelExchangeSeconds(const Rung& r, const Link& link, double bytes, uint64_t elements) {
  const double rounds = r.codec.name == "powersgd" ? 2 : 1;
  return rounds * link.latency_s + bytes / link.bytes_per_s +
         r.cost_ns * 1e-9 * static_cast<double>(elements);
}

double modelExchangeSeconds(const Rung& r, const AutoInputs& in) {
  return modelExchangeSeconds(r, *in.link, modelBytes(*r.impl, in.elements, in.shape, in.world),
                              in.elements);
}

double modelStepSeconds(const Rung& r, const AutoInputs& in) {
  if (const size_t i = static_cast<size_t>(&r - in.ladder_base);
      in.ladder_base && i < in.measured_s.size() && in.measured_s[i] >= 0) {
    const bool own = i < in.compute_by_s.size() && in.compute_by_s[i] >= 0;
    return (own ? in.compute_by_s[i] : in.compute_s) + in.measured_s[i];
  }
  if (r.direct && in.direct_s) return in.compute_s + *in.direct_s;
  const double exchange = modelExchangeSeconds(r, in);
  const double overhead = in.overhead_ref_s > 0
                              ? in.sidecar_overhead_s * std::min(1.0, exchange / in.overhead_ref_s)
                              : in.sidecar_overhead_s;
  return in.compute_s + std::max(0.0, exchange - in.overlap_s) + overhead;
}

double modelScore(const Rung& r, const AutoInputs& in) {
  return modelStepSeconds(r, in) * r.steps_factor;
}

size_t chooseRung(const std::vector<Rung>& ladder, const std::vector<char>& usable,
                  const AutoInputs& in, double tolerance) {
  std::vector<double> t(ladder.size(), 0);
  double best = INFINITY;
  for (size_t i = 0; i < ladder.size(); ++i) {
    if (!usable[i]) continue;
    t[i] = modelScore(ladder[i], in);
    best = std::min(best, t[i]);
  }
  for (size_t i = 0; i < ladder.size(); ++i) {
    if (usable[i] && t[i] <= best * (1 + tolerance)) return i;
  }
  return 0;
}

}  // namespace lightwire::policies
