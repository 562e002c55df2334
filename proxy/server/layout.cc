#include "proxy/server/layout.h"

#include <xxhash.h>

#include <boost/json/parse.hpp>

#include <algorithm>
#include <numeric>
#include <set>
#include <string_view>

#include "proxy/server/api_util.h"
#include "proxy/server/tensor_description.h"

namespace lightwire::proxy {

namespace {

namespace json = boost::json;

std::string entryLabel(size_t i, const std::string& name) {
  return "layout entry " + std::to_string(i) + (name.empty() ? "" : " (" + api::quote(name) + ")");
}

// One entry: {"name", "offset", "shape"}, nothing else; "" or the message.
std::string parseEntry(const json::value& v, size_t i, LayoutEntry* e) {
  if (!v.is_object()) return entryLabel(i, "") + " must be an object {name, offset, shape}";
  const json::object& o = v.get_object();
  for (const auto& kv : o) {
    if (kv.key() != "name" && kv.key() != "offset" && kv.key() != "shape") {
      return entryLabel(i, "") + ": unknown field " + api::quote(kv.key()) +
             " (known: name, offset, shape)";
    }
  }
  if (std::string err = api::jsonString(o, "name", true, &e->name); !err.empty()) {
    return entryLabel(i, "") + ": " + err;
  }
  if (std::string err = api::checkName(e->name); !err.empty()) {
    return entryLabel(i, "") + ": " + err;
  }
  if (std::string err = api::jsonU64(o, "offset", true, &e->offset); !err.empty()) {
    return entryLabel(i, e->name) + ": " + err;
  }
  if (!o.contains("shape")) return entryLabel(i, e->name) + ": missing field 'shape'";
  JsonFields fields(o);
  bool given = false;
  if (std::string err = fields.dims("shape", &e->shape, &given); !err.empty()) {
    return entryLabel(i, e->name) + ": " + err;
  }
  if (std::string err = api::elementsOf(e->shape, &e->elements); !err.empty()) {
    return entryLabel(i, e->name) + ": " + err;
  }
  return "";
}

}  // namespace

std::string parseLayout(const json::value& v, uint64_t elements, const std::string& bucket,
                        Layout* out) {
  if (!v.is_array()) return "field 'layout' must be an array of {name, offset, shape}";
  const json::array& a = v.get_array();
  if (a.empty()) return "field 'layout' has no entries";
  if (a.size() > kMaxLayoutEntries) {
    return "field 'layout' has " + std::to_string(a.size()) + " entries, more than " +
           std::to_string(kMaxLayoutEntries);
  }
  std::vector<LayoutEntry> entries(a.size());
  std::set<std::string_view> names;
  uint64_t sum = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    LayoutEntry& e = entries[i];
    if (std::string err = parseEntry(a[i], i, &e); !err.empty()) return err;
    if (e.name == bucket) {
      return entryLabel(i, e.name) + ": a layer may not have the bucket's own name";
    }
    if (!names.insert(e.name).second) {
      return entryLabel(i, e.name) + ": the name is used by an earlier entry";
    }
    if (e.offset > elements || e.elements > elements - e.offset) {
      return entryLabel(i, e.name) + ": elements [" + std::to_string(e.offset) + ", " +
             std::to_string(e.offset) + " + " + std::to_string(e.elements) +
             ") lie outside the bucket's " + std::to_string(elements) + " elements";
    }
    sum += e.elements;  // no overflow: each is at most `elements`, at most 4096 of them
  }
  // Overlaps: sorted by offset, each entry must end where or before the next begins.
  std::vector<size_t> order(entries.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t x, size_t y) { return entries[x].offset < entries[y].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const LayoutEntry& prev = entries[order[k - 1]];
    const LayoutEntry& next = entries[order[k]];
    if (prev.offset + prev.elements > next.offset) {
      return entryLabel(order[k], next.name) + " overlaps " + entryLabel(order[k - 1], prev.name) +
             ": it starts at element " + std::to_string(next.offset) + ", which " +
             api::quote(prev.name) + " covers ([" + std::to_string(prev.offset) + ", " +
             std::to_string(prev.offset + prev.elements) + "))";
    }
  }
  if (sum != elements) {
    return "the layout's entries hold " + std::to_string(sum) + " elements, the bucket has " +
           std::to_string(elements) + ": every element must belong to exactly one entry";
  }
  out->entries = std::move(entries);
  out->hash = layoutHash(out->entries);
  return "";
}

std::string parseLayoutText(std::string_view text, uint64_t elements, const std::string& bucket,
                            Layout* out) {
  if (text.size() > kMaxLayoutBytes) {
    return "the layout takes " + std::to_string(text.size()) + " bytes, more than " +
           std::to_string(kMaxLayoutBytes);
  }
  boost::system::error_code ec;
  json::parse_options opts;
  opts.max_depth = 16;  // as every JSON body's (an entry's shape is at depth 3)
  const json::value v = json::parse(text, ec, {}, opts);
  if (ec) return "malformed layout JSON: " + ec.message();
  return parseLayout(v, elements, bucket, out);
}

uint64_t layoutHash(const std::vector<LayoutEntry>& entries) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  for (const auto& e : entries) {
    const uint64_t header[2] = {e.name.size(), e.offset};
    XXH3_64bits_update(st, header, sizeof header);
    XXH3_64bits_update(st, e.name.data(), e.name.size());
    const uint64_t dims = e.shape.size();
    XXH3_64bits_update(st, &dims, sizeof dims);
    XXH3_64bits_update(st, e.shape.data(), e.shape.size() * sizeof(uint64_t));
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

std::string layoutHashText(uint64_t hash) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, hash >>= 4) s[static_cast<size_t>(i)] = kHex[hash & 0xF];
  return s;
}

bool parseLayoutHash(std::string_view text, uint64_t* hash) {
  if (text.size() != 16) return false;
  uint64_t h = 0;
  for (const char c : text) {
    int d = -1;
    if (c >= '0' && c <= '9') d = c - '0';
    if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    if (d < 0) return false;
    h = (h << 4) | static_cast<uint64_t>(d);
  }
  *hash = h;
  return true;
}

std::string LayoutRegistry::check(const std::string& bucket, Layout layout,
                                  std::shared_ptr<const Layout>* registered) {
  std::lock_guard lock(mu_);
  auto it = layouts_.find(bucket);
  if (it == layouts_.end()) {
    if (layouts_.size() >= kMaxLayouts) {
      return "this sidecar holds the layouts of " + std::to_string(layouts_.size()) +
             " buckets already, the most it keeps";
    }
    *registered = std::make_shared<const Layout>(std::move(layout));
    layouts_.emplace(bucket, *registered);
    return "";
  }
  const Layout& known = *it->second;
  const auto same = [](const LayoutEntry& x, const LayoutEntry& y) {
    return x.name == y.name && x.offset == y.offset && x.shape == y.shape;
  };
  const size_t n = std::min(known.entries.size(), layout.entries.size());
  size_t i = 0;
  while (i < n && same(known.entries[i], layout.entries[i])) ++i;
  if (i == n && known.entries.size() == layout.entries.size()) {
    *registered = it->second;
    return "";
  }
  std::string where = i < n ? entryLabel(i, layout.entries[i].name) +
                                  " differs from the first "
                                  "layout's " +
                                  api::quote(known.entries[i].name)
                            : "it has " + std::to_string(layout.entries.size()) +
                                  " entries, the first layout " +
                                  std::to_string(known.entries.size());
  return "bucket " + api::quote(bucket) + " was first sent with another layout (" + where +
         "): a bucket's name must stand for one layout (name buckets by their parameters)";
}

std::shared_ptr<const Layout> LayoutRegistry::find(const std::string& bucket) const {
  std::lock_guard lock(mu_);
  auto it = layouts_.find(bucket);
  if (it == layouts_.end()) return nullptr;
  return it->second;
}

bool LayoutRegistry::contains(const std::string& bucket) const {
  std::lock_guard lock(mu_);
  return layouts_.contains(bucket);
}

size_t LayoutRegistry::size() const {
  std::lock_guard lock(mu_);
  return layouts_.size();
}

}  // namespace lightwire::proxy
