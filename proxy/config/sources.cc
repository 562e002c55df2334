// The sources of the serve configuration, later ones winning: the defaults < one YAML file <
// LIGHTWIRE_* environment variables < command-line flags, then the secret files
// (docs/configuration.md "Sources and precedence"); also the JSON of PUT /v1/config and the
// effective config as JSON.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <yaml-cpp/yaml.h>
#include <CLI/CLI.hpp>
#include <boost/json/array.hpp>

#include <cassert>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <utility>

#include "proxy/config/config_impl.h"
#include "proxy/server/utf8.h"

namespace lightwire::proxy {
namespace config_detail {
namespace {

namespace json = boost::json;
using kernels::CodecConfig;

constexpr int kMaxDepth = 16;  // far deeper than any key; bounds recursion on hostile input

// --- A source-neutral tree (YAML and JSON are both read into it) -------------------------------

std::string childPath(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

Result<Tree> fromYaml(const YAML::Node& n, const std::string& path, int depth) {
  if (depth > kMaxDepth) return invalidArgument(path + ": nested too deeply");
  Tree t;
  switch (n.Type()) {
    case YAML::NodeType::Undefined:
    case YAML::NodeType::Null:
      return t;
    case YAML::NodeType::Scalar:
      t.kind = Tree::Kind::kScalar;
      t.scalar = n.Scalar();
      return t;
    case YAML::NodeType::Sequence: {
      t.kind = Tree::Kind::kList;
      size_t i = 0;
      for (const auto& item : n) {
        auto child = fromYaml(item, path + "[" + std::to_string(i++) + "]", depth + 1);
        if (!child) return child.status();
        t.items.push_back(std::move(child).value());
      }
      return t;
    }
    case YAML::NodeType::Map: {
      t.kind = Tree::Kind::kMap;
      for (const auto& kv : n) {
        if (!kv.first.IsScalar()) {
          return invalidArgument((path.empty() ? std::string("the top level") : path) +
                                 " has a key that is not a plain name");
        }
        const std::string key = kv.first.Scalar();
        auto child = fromYaml(kv.second, childPath(path, key), depth + 1);
        if (!child) return child.status();
        t.keys.push_back(key);
        t.items.push_back(std::move(child).value());
      }
      return t;
    }
  }
  return t;
}

std::string jsonNumberText(const json::value& v) {
  if (v.is_int64()) return std::to_string(v.get_int64());
  if (v.is_uint64()) return std::to_string(v.get_uint64());
  const double d = v.get_double();
  // 5.0 from a JSON encoder that always writes doubles still reads as the integer 5.
  if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9007199254740992.0) {
    return std::to_string(static_cast<int64_t>(d));
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", d);
  return buf;
}

Result<Tree> fromJson(const json::value& v, const std::string& path, int depth) {
  if (depth > kMaxDepth) return invalidArgument(path + ": nested too deeply");
  Tree t;
  switch (v.kind()) {
    case json::kind::null:
      return t;
    case json::kind::bool_:
      t.kind = Tree::Kind::kScalar;
      t.scalar = v.get_bool() ? "true" : "false";
      return t;
    case json::kind::int64:
    case json::kind::uint64:
    case json::kind::double_:
      t.kind = Tree::Kind::kScalar;
      t.scalar = jsonNumberText(v);
      return t;
    case json::kind::string:
      t.kind = Tree::Kind::kScalar;
      t.scalar = std::string(v.get_string());
      return t;
    case json::kind::array: {
      t.kind = Tree::Kind::kList;
      size_t i = 0;
      for (const auto& item : v.get_array()) {
        auto child = fromJson(item, path + "[" + std::to_string(i++) + "]", depth + 1);
        if (!child) return child.status();
        t.items.push_back(std::move(child).value());
      }
      return t;
    }
    case json::kind::object: {
      t.kind = Tree::Kind::kMap;
      for (const auto& kv : v.get_object()) {
        const std::string key(kv.key());
        auto child = fromJson(kv.value(), childPath(path, key), depth + 1);
        if (!child) return child.status();
        t.keys.push_back(key);
        t.items.push_back(std::move(child).value());
      }
      return t;
    }
  }
  return t;
}

Status setKey(const KeyImpl& k, std::string_view raw, ServeConfig& cfg, const std::string& source,
              const std::string& name_in_message, Origins* origins) {
  // Values end up in JSON (/v1/status, the settings proposed to the peers): UTF-8 only.
  const std::string e = isValidUtf8(raw) ? k.set(cfg, raw) : "is not UTF-8 text";
  if (!e.empty())
    return invalidArgument(valueError(source, name_in_message, e, raw, k.info.secret));
  if (origins) (*origins)[k.info.path] = source;
  return Status::ok();
}

Status applyTree(const Tree& t, const std::string& path, ServeConfig& cfg,
                 const std::string& source, Origins* origins) {
  if (path == kRulesPath) {
    auto rules = parseRules(t, source);
    if (!rules) return rules.status();
    cfg.compression.rules = std::move(rules).value();
    return Status::ok();
  }
  if (const KeyImpl* k = findKey(path)) {
    if (t.kind == Tree::Kind::kMap || t.kind == Tree::Kind::kList) {
      return invalidArgument(
          withSource(source, path + " must be a single value, got " + t.kindName()));
    }
    return setKey(*k, t.scalar, cfg, source, path, origins);  // null reads as ""
  }
  if (!isSection(path)) return invalidArgument(withSource(source, "unknown key '" + path + "'"));
  if (t.kind == Tree::Kind::kNull) return Status::ok();
  if (t.kind != Tree::Kind::kMap) {
    return invalidArgument(withSource(source, (path.empty() ? std::string("the top level") : path) +
                                                  " must be a map, got " + t.kindName()));
  }
  for (size_t i = 0; i < t.keys.size(); ++i) {
    LW_RETURN_IF_ERROR(applyTree(t.items[i], childPath(path, t.keys[i]), cfg, source, origins));
  }
  return Status::ok();
}

/// The defaults, applied from the table's text through the same setters as every source.
ServeConfig defaults() {
  ServeConfig c;
  for (const auto& k : keyTable()) {
    if (!k.info.has_default) continue;
    const std::string e = k.set(c, k.info.default_text);
    assert(e.empty() && "a default in the key table does not parse");
    (void)e;
  }
  return c;
}

Result<std::string> readFile(const std::string& path) {
  const std::string source = "file " + path;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return invalidArgument(source + ": cannot open: " + std::strerror(errno));
  std::string text;
  char buf[65536];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f);
  const int err = errno;
  std::fclose(f);
  if (failed) return invalidArgument(source + ": cannot read: " + std::strerror(err));
  return text;
}

constexpr size_t kMaxSecretFileBytes = 4096;

/// Reads `file_key`'s file into the secret key `value_key` (one trailing "\n" or "\r\n"
/// dropped), checked by that key's own rules; the contents never appear in a message. A file
/// others may read is allowed (a Kubernetes secret volume's default mode is 0644) with a warning.
Status readSecretFile(const std::string& file_key, const std::string& file,
                      const std::string& value_key, ServeConfig& cfg, Origins& origins,
                      std::vector<std::string>& warnings) {
  if (file.empty()) return Status::ok();
  const KeyImpl& value = *findKey(value_key);
  const json::value current = value.get(cfg);
  if (!current.is_string() || !current.as_string().empty()) {
    return invalidArgument("give " + value_key + " or " + file_key + ", not both (" + value_key +
                           " from " + origins[value_key] + ")");
  }
  const std::string source = file_key + " " + file;
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return invalidArgument(source + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  std::string text;
  std::string error;
  if (::fstat(fd, &st) != 0) {
    error = std::string("cannot stat: ") + std::strerror(errno);
  } else if (!S_ISREG(st.st_mode)) {
    error = "is not a regular file";
  } else if (static_cast<uint64_t>(st.st_size) > kMaxSecretFileBytes) {
    error = "is " + std::to_string(st.st_size) + " bytes; a secret file holds at most " +
            std::to_string(kMaxSecretFileBytes);
  } else {
    text.resize(kMaxSecretFileBytes + 1);
    size_t got = 0;
    while (got < text.size()) {
      const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) error = std::string("cannot read: ") + std::strerror(errno);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    text.resize(got);
    if (error.empty() && got > kMaxSecretFileBytes) error = "grew past the limit while read";
  }
  ::close(fd);
  if (!error.empty()) return invalidArgument(source + ": " + error);
  if (text.size() >= 1 && text.back() == '\n') text.pop_back();
  if (text.size() >= 1 && text.back() == '\r') text.pop_back();
  if (text.empty()) return invalidArgument(source + ": the file is empty");
  if (st.st_mode & S_IROTH) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    warnings.push_back(source + ": other users may read it (mode " + mode + "); chmod o-r");
  }
  return setKey(value, text, cfg, source, value_key, &origins);
}

/// A peer.peers template ("node-{rank}.peers:4781") as world_size addresses.
void expandPeerTemplate(ServeConfig& cfg) {
  auto& p = cfg.peer;
  if (p.peers.size() != 1 || p.peers[0].find(kRankPlaceholder) == std::string::npos) return;
  const std::string pattern = p.peers[0];
  p.peers.clear();
  for (uint32_t r = 0; r < p.world_size; ++r) p.peers.push_back(expandRank(pattern, r));
}

Status applyFile(const std::string& path, ServeConfig& cfg, Origins& origins) {
  const std::string source = "file " + path;
  auto text = readFile(path);
  if (!text) return text.status();
  // Values end up in JSON (/v1/status, the settings proposed to the peers): UTF-8 only.
  if (!isValidUtf8(*text)) return invalidArgument(source + ": the file is not UTF-8 text");
  Tree tree;
  try {
    const YAML::Node root = YAML::Load(*text);
    auto t = fromYaml(root, "", 0);
    if (!t) return invalidArgument(withSource(source, t.status().message()));
    tree = std::move(t).value();
  } catch (const YAML::Exception& e) {
    return invalidArgument(source + ": invalid YAML at line " + std::to_string(e.mark.line + 1) +
                           ", column " + std::to_string(e.mark.column + 1) + ": " + e.msg);
  } catch (const std::exception& e) {
    return invalidArgument(source + ": " + e.what());
  }
  return applyTree(tree, "", cfg, source, &origins);
}

Status applyEnvironment(const std::vector<std::string>& entries, ServeConfig& cfg, Origins& origins,
                        std::vector<std::string>& warnings) {
  std::map<std::string, std::string> vars;  // the last of duplicate entries wins, as in getenv
  for (const auto& entry : entries) {
    const size_t eq = entry.find('=');
    if (eq == std::string::npos || entry.rfind(kEnvPrefix, 0) != 0) continue;
    vars[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  // The alias first, so the specific name wins when both are set.
  if (auto it = vars.find(kSocketAlias); it != vars.end()) {
    LW_RETURN_IF_ERROR(setKey(*findKey("control.socket"), it->second, cfg,
                              std::string("environment ") + kSocketAlias, "control.socket",
                              &origins));
    const auto specific = vars.find(envName("control.socket"));
    if (specific != vars.end() && specific->second != it->second) {
      warnings.push_back("environment: " + specific->first + " overrides " + kSocketAlias);
    }
  }
  std::set<std::string> known = {kSocketAlias};
  for (const auto& k : keyTable()) {
    known.insert(k.info.env);
    auto it = vars.find(k.info.env);
    if (it == vars.end()) continue;
    LW_RETURN_IF_ERROR(
        setKey(k, it->second, cfg, "environment " + k.info.env, k.info.path, &origins));
  }
  for (const auto& [name, value] : vars) {
    if (known.count(name)) continue;
    if (name == envName(kRulesPath)) {
      warnings.push_back("environment " + name + ": ignored; " + kRulesPath +
                         " can only be set in the file or with PUT /v1/config");
    } else {
      warnings.push_back("environment " + name + ": unknown variable, ignored");
    }
  }
  return Status::ok();
}

Status applyFlags(const FlagValues& flags, ServeConfig& cfg, Origins& origins,
                  std::vector<std::string>& warnings) {
  for (const auto& [path, raw] : flags.values) {
    const KeyImpl* k = findKey(path);
    if (!k) return invalidArgument("flag for an unknown key '" + path + "'");
    LW_RETURN_IF_ERROR(setKey(*k, raw, cfg, "flag " + k->info.flag, k->info.path, &origins));
    if (k->info.secret && !raw.empty()) {
      warnings.push_back("flag " + k->info.flag +
                         ": other local users can read it in the process " + "list; prefer " +
                         k->info.env);
    }
  }
  return Status::ok();
}

void insertAt(json::object& root, const std::string& path, json::value v) {
  json::object* o = &root;
  size_t begin = 0;
  for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', begin)) {
    json::value& child = (*o)[path.substr(begin, dot - begin)];
    if (!child.is_object()) child = json::object();
    o = &child.get_object();
    begin = dot + 1;
  }
  (*o)[path.substr(begin)] = std::move(v);
}

json::object codecJson(const CodecConfig& c) {
  json::object o;
  for (const auto& k : codecKeys()) o[k.name] = k.get(c);
  return o;
}

}  // namespace
}  // namespace config_detail

using config_detail::applyEnvironment;
using config_detail::applyFile;
using config_detail::applyFlags;
using config_detail::applyTree;
using config_detail::codecJson;
using config_detail::defaults;
using config_detail::expandPeerTemplate;
using config_detail::fromJson;
using config_detail::insertAt;
using config_detail::keyTable;
using config_detail::kRulesPath;
using config_detail::Origins;
using config_detail::readSecretFile;
using config_detail::validateDefaultCodec;
using config_detail::validatePolicies;
namespace json = boost::json;

void addServeFlags(CLI::App& app, FlagValues& flags) {
  app.add_option_function<std::string>(
         "--config", [&flags](const std::string& v) { flags.config_file = v; },
         "YAML configuration file (docs/configuration.md)")
      ->type_name("FILE");
  for (const auto& k : keyTable()) {
    const ConfigKey& info = k.info;
    std::string help = info.description + " [" + info.path + ", " + info.env + "; default ";
    help += info.has_default ? (info.default_text.empty() ? "\"\"" : info.default_text) : "unset";
    help += "]";
    const std::string path = info.path;
    CLI::Option* opt =
        app.add_option_function<std::string>(
               info.flag, [&flags, path](const std::string& v) { flags.values[path] = v; }, help)
            ->type_name(info.type);
    // A bool key's flag alone means true ("--fresh-state"); "--anomaly false" and "--anomaly=no"
    // give the value.
    if (info.boolean) opt->expected(0, 1)->default_str("true")->option_text("[true | false]");
  }
}

Result<ServeConfig> buildServeConfig(const std::optional<std::string>& file_path,
                                     const std::vector<std::string>& environ_entries,
                                     const FlagValues& flags, std::vector<std::string>* warnings) {
  std::vector<std::string> local_warnings;
  std::vector<std::string>& w = warnings ? *warnings : local_warnings;
  ServeConfig cfg = defaults();
  Origins origins;
  if (file_path) LW_RETURN_IF_ERROR(applyFile(*file_path, cfg, origins));
  LW_RETURN_IF_ERROR(applyEnvironment(environ_entries, cfg, origins, w));
  LW_RETURN_IF_ERROR(applyFlags(flags, cfg, origins, w));
  LW_RETURN_IF_ERROR(
      readSecretFile("peer.secret_file", cfg.peer.secret_file, "peer.secret", cfg, origins, w));
  LW_RETURN_IF_ERROR(
      readSecretFile("security.token_file", cfg.token_file, "security.token", cfg, origins, w));
  expandPeerTemplate(cfg);
  LW_RETURN_IF_ERROR(validateDefaultCodec(cfg, origins));
  // Each key was checked alone; now the policies as a whole (adaptive_min_ratio <= max, ...).
  LW_RETURN_IF_ERROR(validatePolicies(cfg, origins));
  return cfg;
}

Result<CompressionConfig> compressionFromJson(const boost::json::value& v) {
  const std::string path = "compression";
  if (!v.is_object()) return invalidArgument(path + " must be a JSON object");
  auto tree = fromJson(v, path, 0);
  if (!tree) return tree.status();
  ServeConfig cfg = defaults();
  Origins origins;
  LW_RETURN_IF_ERROR(applyTree(*tree, path, cfg, "", &origins));
  LW_RETURN_IF_ERROR(validateDefaultCodec(cfg, {}));
  return std::move(cfg.compression);
}

boost::json::object toJson(const ServeConfig& c) {
  json::object root;
  for (const auto& k : keyTable()) insertAt(root, k.info.path, k.get(c));
  json::array rules;
  for (const auto& r : c.compression.rules) {
    json::object o;
    if (r.pattern) o["pattern"] = *r.pattern;
    if (r.min_elements) o["min_elements"] = *r.min_elements;
    if (r.max_elements) o["max_elements"] = *r.max_elements;
    if (r.ndim) o["ndim"] = *r.ndim;
    for (auto& kv : codecJson(r.codec)) o[kv.key()] = kv.value();
    o["sync_every"] = r.sync_every;
    if (!r.group.empty()) o["group"] = r.group;
    rules.push_back(std::move(o));
  }
  insertAt(root, kRulesPath, std::move(rules));
  return root;
}

boost::json::object toJson(const CompressionConfig& c) {
  ServeConfig s;
  s.compression = c;
  json::object all = toJson(s);
  return std::move(all["compression"].get_object());
}

}  // namespace lightwire::proxy
