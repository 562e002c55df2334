// The codec rules of compression.rules and the checks that look at several keys together: the
// default codec, the policies, the membership of the job (docs/configuration.md "Codec rules",
// docs/exchange.md "Membership").

#include <fnmatch.h>

#include <boost/json/serialize.hpp>

#include <algorithm>
#include <cctype>
#include <limits>
#include <utility>

#include "kernels/codecs/powersgd_layout.h"
#include "kernels/registry.h"
#include "policies/auto.h"
#include "proxy/config/config_impl.h"

namespace lightwire::proxy {
namespace config_detail {

namespace json = boost::json;
using kernels::CodecConfig;

namespace {

constexpr uint64_t kMaxSyncEvery = 1000000;  // a rule's sync_every
constexpr size_t kMaxGroupChars = 64;        // a rule's group
constexpr uint64_t kMaxNdim = 64;            // a rule's ndim

Status validateCodec(const CodecConfig& c, const std::string& where) {
  if (c.name == "auto") return Status::ok();  // compression.auto's ladder is checked on its own
  auto codec = kernels::createCodec(c);
  if (!codec) return invalidArgument(where + ": " + codec.status().message());
  return Status::ok();
}

/// A rule's `group`: "" (the codec name) or 1..64 of [A-Za-z0-9_.-] (a metrics label value).
bool validGroup(std::string_view g) {
  if (g.size() > kMaxGroupChars) return false;
  for (unsigned char ch : g) {
    if (!std::isalnum(ch) && ch != '_' && ch != '.' && ch != '-') return false;
  }
  return true;
}

Result<CodecRule> parseRule(const Tree& t, const std::string& where, const std::string& source) {
  if (t.kind != Tree::Kind::kMap) {
    return invalidArgument(
        withSource(source, where + " must be a map of codec keys, got " + t.kindName()));
  }
  CodecRule rule;
  bool has_codec = false;
  for (size_t i = 0; i < t.keys.size(); ++i) {
    const std::string& key = t.keys[i];
    const Tree& item = t.items[i];
    const std::string name = where + "." + key;
    if (item.kind == Tree::Kind::kMap || item.kind == Tree::Kind::kList) {
      return invalidArgument(
          withSource(source, name + " must be a single value, got " + item.kindName()));
    }
    const std::string& raw = item.scalar;
    if (key == "pattern") {
      if (raw.empty() || raw.find('\0') != std::string::npos) {
        return invalidArgument(valueError(source, name, "must be a non-empty glob", raw, false));
      }
      rule.pattern = raw;
    } else if (key == "min_elements" || key == "max_elements") {
      uint64_t v = 0;
      const std::string e = setUnsigned(raw, 0, std::numeric_limits<uint64_t>::max(), v);
      if (!e.empty()) return invalidArgument(valueError(source, name, e, raw, false));
      (key == "min_elements" ? rule.min_elements : rule.max_elements) = v;
    } else if (key == "ndim") {
      uint64_t v = 0;
      const std::string e = setUnsigned(raw, 1, kMaxNdim, v);
      if (!e.empty()) return invalidArgument(valueError(source, name, e, raw, false));
      rule.ndim = static_cast<uint32_t>(v);
    } else if (key == "sync_every") {
      uint64_t v = 0;
      const std::string e = setUnsigned(raw, 1, kMaxSyncEvery, v);
      if (!e.empty()) return invalidArgument(valueError(source, name, e, raw, false));
      rule.sync_every = static_cast<uint32_t>(v);
    } else if (key == "group") {
      if (!validGroup(raw)) {
        return invalidArgument(valueError(
            source, name, "must be 1..64 characters of A-Z a-z 0-9 _ . - (\"\" = the codec name)",
            raw, false));
      }
      rule.group = raw;
    } else if (const CodecKey* ck = findCodecKey(key)) {
      const std::string e = ck->set(rule.codec, raw);
      if (!e.empty()) return invalidArgument(valueError(source, name, e, raw, false));
      has_codec = has_codec || key == "codec";
    } else {
      return invalidArgument(withSource(source, "unknown key '" + name + "'"));
    }
  }
  if (!has_codec) return invalidArgument(withSource(source, where + ".codec is required"));
  if (rule.min_elements && rule.max_elements && *rule.min_elements > *rule.max_elements) {
    return invalidArgument(
        withSource(source, where + ": min_elements " + std::to_string(*rule.min_elements) +
                               " is above max_elements " + std::to_string(*rule.max_elements)));
  }
  LW_RETURN_IF_ERROR(validateCodec(rule.codec, withSource(source, where)));
  return rule;
}

/// A key's value as shown in messages ("0.5", not JSON's "5E-1").
std::string valueText(const json::value& v) {
  if (v.is_double()) return numberText(v.get_double());
  if (v.is_string()) return std::string(v.get_string());
  return json::serialize(v);
}

/// Whether `message` names the key `path` as a whole word ("schedule.adaptive" is not named by
/// "schedule.adaptive_tiny").
bool names(std::string_view message, std::string_view path) {
  auto word = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
  for (size_t pos = message.find(path); pos != std::string_view::npos;
       pos = message.find(path, pos + 1)) {
    const size_t end = pos + path.size();
    if ((pos == 0 || !word(message[pos - 1])) && (end == message.size() || !word(message[end]))) {
      return true;
    }
  }
  return false;
}

}  // namespace

Result<std::vector<CodecRule>> parseRules(const Tree& t, const std::string& source) {
  std::vector<CodecRule> rules;
  if (t.kind == Tree::Kind::kNull) return rules;
  if (t.kind != Tree::Kind::kList) {
    return invalidArgument(
        withSource(source, std::string(kRulesPath) + " must be a list, got " + t.kindName()));
  }
  for (size_t i = 0; i < t.items.size(); ++i) {
    auto rule =
        parseRule(t.items[i], std::string(kRulesPath) + "[" + std::to_string(i) + "]", source);
    if (!rule) return rule.status();
    rules.push_back(std::move(rule).value());
  }
  return rules;
}

Status validateDefaultCodec(const ServeConfig& cfg, const Origins& origins) {
  if (cfg.compression.default_codec.name == "auto") return Status::ok();
  auto codec = kernels::createCodec(cfg.compression.default_codec);
  if (codec) return Status::ok();
  std::string m = std::string(kDefaultCodecPath) + ": " + codec.status().message();
  const std::string prefix = std::string(kDefaultCodecPath) + ".";
  std::string from;
  for (const auto& [path, source] : origins) {
    if (path.rfind(prefix, 0) != 0) continue;
    from += (from.empty() ? "" : "; ") + path.substr(prefix.size()) + " from " + source;
  }
  if (!from.empty()) m += " (" + from + ")";
  return invalidArgument(m);
}

/// policies::validate() on the merged config; its error gets the value and the source of every
/// key it names.
Status validatePolicies(const ServeConfig& cfg, const Origins& origins) {
  const Status st = policies::validate(cfg.policies);
  if (st.isOk()) return st;
  std::string m = st.message();
  std::string values;
  for (const auto& k : keyTable()) {
    if (k.info.secret || !names(st.message(), k.info.path)) continue;
    values += (values.empty() ? "" : "; ") + k.info.path + " " + valueText(k.get(cfg));
    const auto it = origins.find(k.info.path);
    values += it == origins.end() ? " (default)" : " from " + it->second;
  }
  if (!values.empty()) m += " (" + values + ")";
  return invalidArgument(m);
}

}  // namespace config_detail

bool CodecRule::matches(const TensorFacts& t) const {
  if (min_elements && t.elements < *min_elements) return false;
  if (max_elements && t.elements > *max_elements) return false;
  if (ndim && t.ndim() != *ndim) return false;
  if (pattern && fnmatch(pattern->c_str(), std::string(t.name).c_str(), 0) != 0) return false;
  return true;
}

const CodecRule* CompressionConfig::ruleFor(const TensorFacts& t) const {
  for (const auto& r : rules) {
    if (r.matches(t)) return &r;
  }
  return nullptr;
}

const char* denseLayerReason(const LayerDefaults& d, const TensorFacts& t,
                             const kernels::CodecConfig& codec, bool by_rule) {
  if (!t.layer || codec.name == "none") return nullptr;
  if (by_rule) {
    // A rule that names the layer decides its codec; only a powersgd that cannot compress it
    // is overruled.
  } else if (d.dense_max_ndim > 0 && t.ndim() <= d.dense_max_ndim) {
    return "dense_max_ndim";
  } else if (d.dense_max_elements > 0 && t.elements <= d.dense_max_elements) {
    return "dense_max_elements";
  }
  if (codec.name == "powersgd" && d.powersgd_min_ratio > 0 && !t.shape.empty() && t.elements > 0) {
    // The (shape[0], -1) view of the codec (docs/determinism.md §4.12) and its rank.
    const uint64_t rows = t.shape[0], cols = t.elements / rows;
    const auto r = static_cast<double>(kernels::powersgd::rankFor(codec.approx_rank, rows, cols));
    const double n = static_cast<double>(rows), m = static_cast<double>(cols);
    if (!(n * m > d.powersgd_min_ratio * (n + m) * r)) return "powersgd_min_ratio";
  }
  return nullptr;
}

namespace {

/// peer.tls: complete when enabled, and for the tcp transport only.
Status checkPeerTls(const ServeConfig::Peer& p) {
  if (!p.tls.enabled) return Status::ok();
  if (p.transport != "tcp") {
    return invalidArgument("peer.tls applies to the tcp transport only (peer.transport is " +
                           p.transport + ")");
  }
  const std::pair<const char*, const std::string*> files[] = {
      {"peer.tls.cert_file", &p.tls.cert_file},
      {"peer.tls.key_file", &p.tls.key_file},
      {"peer.tls.ca_file", p.tls.verify ? &p.tls.ca_file : nullptr},
  };
  for (const auto& [key, path] : files) {
    if (path && path->empty()) {
      return invalidArgument(std::string(key) + " must be set when peer.tls.enabled is true" +
                             (path == &p.tls.ca_file ? " and peer.tls.verify is true" : ""));
    }
  }
  return Status::ok();
}

}  // namespace

Status checkMembership(const ServeConfig& c) {
  const auto& p = c.peer;
  LW_RETURN_IF_ERROR(checkPeerTls(p));
  if (p.rank >= p.world_size) {
    return invalidArgument("rank " + std::to_string(p.rank) + " is not below world_size " +
                           std::to_string(p.world_size));
  }
  if (p.world_size == 1) return Status::ok();
  if (p.topology == "ps" && p.ps_rank >= p.world_size) {
    return invalidArgument("peer.ps_rank " + std::to_string(p.ps_rank) +
                           " is not below world_size " + std::to_string(p.world_size));
  }
  if (p.sparse != "allgather" && p.topology != "ring") {
    return invalidArgument("peer.sparse " + p.sparse +
                           " needs peer.topology ring (the parameter server re-selects what it "
                           "sums itself)");
  }
  if (p.synchrony == "bounded-staleness" && p.topology != "ps") {
    return invalidArgument("peer.synchrony bounded-staleness needs peer.topology ps");
  }
  if (p.synchrony == "bounded-staleness") {
    const auto& ladder = c.policies.auto_codec.ladder;
    if (std::none_of(ladder.begin(), ladder.end(), [](const policies::Rung& r) {
          return !r.direct && policies::rungStalenessSafe(r);
        })) {
      return invalidArgument(
          "compression.auto.ladder " + c.policies.auto_codec.ladder_text +
          " has no rung a parameter server under bounded staleness can close a step with "
          "(several rounds, or payloads scaled for one decoding: docs/exchange.md); add one such "
          "as none, fp16, qsgd:8 or dgc:0.01");
    }
  }
  if (p.rendezvous && !p.peers.empty()) {
    return invalidArgument("give peer.peers or peer.rendezvous, not both");
  }
  if (p.rendezvous && p.transport == "ucx") {
    return invalidArgument(
        "peer.rendezvous is served by the tcp transport: with peer.transport "
        "ucx give peer.peers");
  }
  if (p.secret.empty()) {
    return invalidArgument(
        "peer.secret must be set when world_size > 1 (LIGHTWIRE_PEER__SECRET, or a file named "
        "by peer.secret_file)");
  }
  if (p.rendezvous) return Status::ok();
  if (p.peers.size() != p.world_size) {
    return invalidArgument("peer.peers must list " + std::to_string(p.world_size) +
                           " addresses (one per rank, this sidecar's included), got " +
                           std::to_string(p.peers.size()));
  }
  return Status::ok();
}

}  // namespace lightwire::proxy
