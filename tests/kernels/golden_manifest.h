#pragma once
// Reading tests/kernels/golden (written by tests/reference/make_golden.py): shared by the CPU
// golden test (tests/kernels/golden_test.cc) and the GPU one
// (tests/kernels/cuda/golden_cuda_test.cc). LW_TEST_DATA_DIR (the tests/ folder) is compiled in by
// tests/meson.build.

#include <boost/json.hpp>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/dtype.h"

namespace lightwire::kernels::golden {

/// tests/kernels/golden/ with a trailing slash.
inline const std::string& dir() {
  static const std::string d = std::string(LW_TEST_DATA_DIR) + "/kernels/golden/";
  return d;
}

/// The bytes of golden file `rel`; false when it cannot be read.
inline bool readFile(const std::string& rel, std::vector<uint8_t>& out) {
  std::ifstream in(dir() + rel, std::ios::binary);
  if (!in) return false;
  out.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return true;
}

/// Doubles are stored as decimal strings (shortest round trip); strtod rounds correctly.
inline double toDouble(const boost::json::value& v) {
  if (v.is_string()) return std::strtod(v.as_string().c_str(), nullptr);
  return v.to_number<double>();
}
inline std::optional<double> toOptDouble(const boost::json::value* v) {
  if (v == nullptr || v->is_null()) return std::nullopt;
  return toDouble(*v);
}

/// A case's codec configuration.
inline CodecConfig configFrom(const boost::json::object& o) {
  CodecConfig c;
  c.name = std::string(o.at("name").as_string());
  c.density = toOptDouble(o.if_contains("density"));
  c.ratio = toOptDouble(o.if_contains("ratio"));
  c.bits = static_cast<int>(o.at("bits").to_number<int64_t>());
  c.bucket_size = static_cast<uint32_t>(o.at("bucket_size").to_number<int64_t>());
  c.momentum = toDouble(o.at("momentum"));
  c.clip_norm = toDouble(o.at("clip_norm"));
  c.sample_fraction = toDouble(o.at("sample_fraction"));
  c.sparse_values = *parseDType(std::string(o.at("sparse_values").as_string()));
  const boost::json::value& ef = o.at("error_feedback");
  if (!ef.is_null()) c.error_feedback = ef.as_bool();
  c.threshold = toOptDouble(o.if_contains("threshold"));
  if (const boost::json::value* b = o.if_contains("bias_correction")) {
    c.bias_correction = b->as_bool();
  }
  if (const boost::json::value* r = o.if_contains("approx_rank")) {
    c.approx_rank = static_cast<int>(r->to_number<int64_t>());
  }
  return c;
}

}  // namespace lightwire::kernels::golden
