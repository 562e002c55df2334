#pragma once
// Small string helpers shared by the test files.

#include <string_view>

namespace lightwire::testing {

/// Whether `text` contains `part` (std::string::contains is C++23).
inline bool contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

}  // namespace lightwire::testing
