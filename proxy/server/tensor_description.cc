#include "proxy/server/tensor_description.h"

#include <algorithm>

#include "kernels/dtype.h"
#include "proxy/server/api_util.h"

namespace lightwire::proxy {

using namespace api;  // NOLINT(google-build-using-namespace): the routes' shared helpers

namespace {

bool known(std::span<const std::string_view> names, std::string_view key) {
  return std::find(names.begin(), names.end(), key) != names.end();
}

}  // namespace

const std::string* QueryFields::find(std::string_view key) const {
  auto it = query_.find(std::string(key));
  return it == query_.end() ? nullptr : &it->second;
}

bool QueryFields::present(std::string_view key) const { return find(key) != nullptr; }

std::string QueryFields::unknownKey(std::span<const std::string_view> names) const {
  for (const auto& [k, v] : query_) {
    if (!known(names, k)) return k;
  }
  return "";
}

std::string QueryFields::unsignedValue(std::string_view key, uint64_t* v) const {
  const std::string* s = find(key);
  if (s == nullptr || parseU64(*s, v)) return "";
  return "query parameter '" + std::string(key) + "' must be an unsigned integer, got " + quote(*s);
}

std::string QueryFields::text(std::string_view key, std::string* v) const {
  if (const std::string* s = find(key)) *v = *s;
  return "";
}

std::string QueryFields::dims(std::string_view key, std::vector<uint64_t>* v, bool* given) const {
  const std::string* s = find(key);
  *given = s != nullptr && !s->empty();
  if (!*given) return "";
  std::string_view rest = *s;
  while (true) {
    const size_t comma = rest.find(',');
    uint64_t d = 0;
    if (!parseU64(rest.substr(0, comma), &d)) {
      return "query parameter '" + std::string(key) +
             "' must be unsigned integers separated by commas, got " + quote(*s);
    }
    v->push_back(d);
    if (v->size() > kMaxDims || comma == std::string_view::npos) return "";
    rest = rest.substr(comma + 1);
  }
}

std::string JsonFields::unknownKey(std::span<const std::string_view> names) const {
  for (const auto& kv : o_) {
    if (!known(names, kv.key())) return std::string(kv.key());
  }
  return "";
}

std::string JsonFields::unsignedValue(std::string_view key, uint64_t* v) const {
  return jsonU64(o_, key, false, v);
}

std::string JsonFields::text(std::string_view key, std::string* v) const {
  return jsonString(o_, key, false, v);
}

std::string JsonFields::dims(std::string_view key, std::vector<uint64_t>* v, bool* given) const {
  const json::value* sh = o_.if_contains(key);
  *given = sh != nullptr;
  if (!*given) return "";
  const std::string what = "field '" + std::string(key) + "' must be an array of ";
  if (!sh->is_array()) return what + "integers";
  for (const auto& d : sh->get_array()) {
    if (d.is_uint64()) {
      v->push_back(d.get_uint64());
    } else if (d.is_int64() && d.get_int64() >= 0) {
      v->push_back(static_cast<uint64_t>(d.get_int64()));
    } else {
      return what + "non-negative integers";
    }
    if (v->size() > kMaxDims) break;
  }
  return "";
}

std::string parseTensorDescription(const DescriptionFields& f,
                                   std::initializer_list<std::string_view> extra_known,
                                   unsigned local_trainers, TensorSpec* spec, bool* has_shape) {
  std::vector<std::string_view> names = {"name", "step", "trainer", "dtype", "shape"};
  names.insert(names.end(), extra_known.begin(), extra_known.end());
  if (std::string k = f.unknownKey(names); !k.empty()) {
    std::string list;
    for (std::string_view n : names) list += (list.empty() ? "" : ", ") + std::string(n);
    return "unknown " + std::string(f.noun()) + " " + quote(k) + " (known: " + list + ")";
  }
  const auto missing = [&f](const char* key) {
    return "missing " + std::string(f.noun()) + " '" + key + "'";
  };
  if (!f.present("name")) return missing("name");
  if (std::string e = f.text("name", &spec->name); !e.empty()) return e;
  if (std::string e = checkName(spec->name); !e.empty()) return e;
  if (!f.present("step")) return missing("step");
  if (std::string e = f.unsignedValue("step", &spec->step); !e.empty()) return e;

  if (f.present("trainer")) {
    uint64_t trainer = 0;
    if (std::string e = f.unsignedValue("trainer", &trainer); !e.empty()) return e;
    if (trainer > 1u << 20) {
      return std::string(f.noun()) + " 'trainer' is out of range (at most 1048576), got " +
             std::to_string(trainer);
    }
    spec->trainer = static_cast<unsigned>(trainer);
  } else if (local_trainers > 1) {
    return missing("trainer") + ": this sidecar serves " + std::to_string(local_trainers) +
           " local trainers";
  }

  std::string dtype = "float32";
  if (std::string e = f.text("dtype", &dtype); !e.empty()) return e;
  auto dt = kernels::parseDType(dtype);
  if (!dt) return "unknown dtype " + quote(dtype) + " (float32, float16 or bfloat16)";
  spec->dtype = *dt;

  spec->shape.clear();
  if (std::string e = f.dims("shape", &spec->shape, has_shape); !e.empty()) return e;
  if (*has_shape) return elementsOf(spec->shape, &spec->elements);
  return "";
}

}  // namespace lightwire::proxy
