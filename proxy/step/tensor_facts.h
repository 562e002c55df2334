#pragma once
// What a tensor's settings are chosen from (compression.rules and compression.layers,
// docs/configuration.md "Codec rules"): a plain value, shared by the step engine and the
// configuration.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace lightwire::proxy {

struct TensorFacts {
  std::string_view name;
  uint64_t elements = 0;
  std::span<const uint64_t> shape;  // empty: 1-D, or not given
  bool layer = false;               // one parameter of a bucket's layout (docs/api.md "Layouts")
  /// Dimensions: shape.size(), at least 1.
  size_t ndim() const { return shape.empty() ? 1 : shape.size(); }
};

}  // namespace lightwire::proxy
