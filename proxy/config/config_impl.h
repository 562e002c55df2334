#pragma once
// Internal to proxy/config/: what values.cc (parsing one value), keys.cc (the key table),
// sources.cc (the sources and the JSON output) and rules.cc (codec rules, the checks across keys)
// share. Not for other code: the public interface is proxy/config/config.h (docs/configuration.md).

#include <boost/json/value.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kernels/codec.h"
#include "kernels/status.h"
#include "proxy/config/config.h"

namespace lightwire::proxy::config_detail {

inline constexpr char kEnvPrefix[] = "LIGHTWIRE_";
inline constexpr char kSocketAlias[] = "LIGHTWIRE_SOCKET";
inline constexpr char kRulesPath[] = "compression.rules";
inline constexpr char kDefaultCodecPath[] = "compression.default";
inline constexpr char kRedacted[] = "<redacted>";
inline constexpr char kBoolType[] = "true | false";
inline constexpr std::string_view kRankPlaceholder = "{rank}";

// --- Parsing one value from its text (values.cc; the same code for every source) ---------------
// Each setter returns "" on success, else what the value must be ("must be ..."); the caller adds
// the source, the key and the value.

std::string setUnsigned(std::string_view s, uint64_t lo, uint64_t hi, uint64_t& out);

/// Parses an unsigned integer in [lo, hi] into the field fn(target) refers to.
template <typename Target, typename Field>
auto unsignedSetter(Field field, uint64_t lo, uint64_t hi) {
  return [=](Target& t, std::string_view s) -> std::string {
    uint64_t v = 0;
    std::string e = setUnsigned(s, lo, hi, v);
    if (e.empty()) {
      auto& ref = field(t);
      ref = static_cast<std::remove_reference_t<decltype(ref)>>(v);
    }
    return e;
  };
}

std::string setSeconds(std::string_view s, double& out);
std::string setAnyNumber(std::string_view s, double& out);
std::string setNumber(std::string_view s, double& out, bool (*ok)(double), const std::string& must);
std::string numberText(double v);
std::string setBool(std::string_view s, bool& out);
std::string setPath(std::string_view s, std::string& out);
std::string setOptionalNumber(std::string_view s, std::optional<double>& out,
                              const std::function<bool(double)>& ok, const char* what);
std::optional<ListenAddress> parseListen(std::string_view s);
std::string expandRank(std::string_view text, uint32_t rank);
std::string setListen(std::string_view s, std::optional<ListenAddress>& out);
boost::json::value listenJson(const std::optional<ListenAddress>& a);
boost::json::value optionalJson(const std::optional<double>& v);

/// `raw` as quoted in an error message (cut when long).
std::string shown(std::string_view raw);
/// `message` prefixed by "source: " (nothing when `source` is "").
std::string withSource(const std::string& source, const std::string& message);
/// "source: key what, got 'raw'" (the value left out when `secret`).
std::string valueError(const std::string& source, const std::string& key, const std::string& what,
                       std::string_view raw, bool secret);

// --- The key table (keys.cc) -------------------------------------------------------------------

/// One key of a codec section: what `compression.default.<name>` and a rule's `<name>` accept.
/// Immutable after the table is built; the table itself is safe to read from any thread.
struct CodecKey {
  const char* name;
  const char* flag;
  const char* type;
  std::optional<const char*> default_text;  // nullopt = unset
  const char* description;
  std::function<std::string(kernels::CodecConfig&, std::string_view)> set;
  std::function<boost::json::value(const kernels::CodecConfig&)> get;
};

const std::vector<CodecKey>& codecKeys();
const CodecKey* findCodecKey(std::string_view name);

/// A key of the table with the code that reads and shows it. Immutable once in the table.
struct KeyImpl {
  ConfigKey info;
  std::function<std::string(ServeConfig&, std::string_view)> set;
  std::function<boost::json::value(const ServeConfig&)> get;
};

/// "limits.max_body_bytes" -> "LIGHTWIRE_LIMITS__MAX_BODY_BYTES".
std::string envName(const std::string& path);
/// Every key, in the order of `--help` and toJson(); built once, then read-only.
const std::vector<KeyImpl>& keyTable();
const KeyImpl* findKey(std::string_view path);
/// Whether `path` is a section (a proper prefix of some key path, or compression.rules' parent).
bool isSection(std::string_view path);

// --- A source-neutral tree (sources.cc; YAML and JSON are both read into it) -------------------

/// A parsed document: null, scalar text, map (keys + items) or list (items). A plain value.
struct Tree {
  enum class Kind { kNull, kScalar, kMap, kList };
  Kind kind = Kind::kNull;
  std::string scalar;
  std::vector<std::string> keys;  // kMap: keys[i] names items[i]
  std::vector<Tree> items;

  const char* kindName() const {
    switch (kind) {
      case Kind::kNull:
        return "null";
      case Kind::kScalar:
        return "a single value";
      case Kind::kMap:
        return "a map";
      case Kind::kList:
        return "a list";
    }
    return "?";
  }
};

/// Which source last set each key (for messages about several keys together: the default codec,
/// the policies).
using Origins = std::map<std::string, std::string>;

// --- Rules and the checks across keys (rules.cc) -----------------------------------------------

Result<std::vector<CodecRule>> parseRules(const Tree& t, const std::string& source);
Status validateDefaultCodec(const ServeConfig& cfg, const Origins& origins);
/// policies::validate() on the merged config; its error gets the value and the source of every
/// key it names.
Status validatePolicies(const ServeConfig& cfg, const Origins& origins);

}  // namespace lightwire::proxy::config_detail
