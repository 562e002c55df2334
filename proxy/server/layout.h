#pragma once
// The layout of a bucket (docs/api.md "Layouts: one tensor per layer"): a trainer's gradient
// bucket (one buffer region holding several parameters' gradients back to back, as DDP packs
// them) described entry by entry — each parameter's name, element offset and shape — so that the
// sidecar treats every parameter as a tensor of its own (codec choice, codec state, selection,
// statistics, checkpoints). Parsing checks everything a client can get wrong; the registry keeps
// the first layout each bucket name was sent with and refuses a different one under that name.
// Thread-safe.

#include <boost/json/value.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lightwire::proxy {

/// Entries a layout may have at most (a bucket of DDP holds a few hundred parameters at most).
inline constexpr size_t kMaxLayoutEntries = 4096;
/// Buckets whose layout the registry keeps at most (DDP rebuilds its buckets once, after the
/// first iteration: a job sends about twice as many bucket names as it has buckets).
inline constexpr size_t kMaxLayouts = 65536;
/// Bytes a layout sent as JSON text ahead of a raw body (form 1's `layout_bytes`) may take at most:
/// room for kMaxLayoutEntries entries of the longest names and shapes (about 650 bytes each).
inline constexpr size_t kMaxLayoutBytes = size_t{4} << 20;

/// One parameter of a bucket.
struct LayoutEntry {
  std::string name;             // the tensor name of this parameter (docs/api.md name rules)
  uint64_t offset = 0;          // in elements, from the start of the bucket's region
  std::vector<uint64_t> shape;  // the parameter's shape (empty: a 0-d tensor of one element)
  uint64_t elements = 0;        // the product of `shape`
};

/// A parsed, checked layout: entries in the order given, and a hash of all of them.
struct Layout {
  std::vector<LayoutEntry> entries;
  uint64_t hash = 0;  // XXH3-64 of the entries' names, offsets and shapes (layoutHash)
};

/// Parses `v` (the "layout" member of an emit_gradient body) as the layout of a bucket of
/// `elements` elements: a non-empty array of at most kMaxLayoutEntries objects
/// {"name": string, "offset": integer, "shape": [integers]}, each name a valid tensor name that
/// no other entry and not `bucket` itself uses, each entry inside the bucket, no two
/// overlapping, and the entries' elements adding up to the bucket's. "" or a message for the
/// client naming the entry (by its index and name).
std::string parseLayout(const boost::json::value& v, uint64_t elements, const std::string& bucket,
                        Layout* out);

/// parseLayout() of `text`, the layout as JSON text (form 1's body prefix, docs/api.md "Form 1:
/// raw body"): at most kMaxLayoutBytes of UTF-8 JSON. "" or a message for the client.
std::string parseLayoutText(std::string_view text, uint64_t elements, const std::string& bucket,
                            Layout* out);

/// XXH3-64 over every entry's name, offset and shape, in order.
uint64_t layoutHash(const std::vector<LayoutEntry>& entries);
/// A layout hash as the replies and the status show it: 16 lower-case hex digits.
std::string layoutHashText(uint64_t hash);
/// Parses layoutHashText's form (16 hex digits, either case); false when `text` is not one.
bool parseLayoutHash(std::string_view text, uint64_t* hash);

/// The layouts buckets were first sent with, by bucket name.
class LayoutRegistry {
 public:
  /// Registers `layout` under `bucket`, or checks it against the one registered before. "" when
  /// it is (now) the registered one, and *registered then points to the registered layout (one
  /// copy, shared by every step of the bucket); otherwise why not (a different layout, naming
  /// the first entry that differs; too many buckets), and nothing changes.
  std::string check(const std::string& bucket, Layout layout,
                    std::shared_ptr<const Layout>* registered);
  /// The layout registered under `bucket` (null: none).
  std::shared_ptr<const Layout> find(const std::string& bucket) const;
  bool contains(const std::string& bucket) const;
  size_t size() const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<const Layout>> layouts_;
};

}  // namespace lightwire::proxy
