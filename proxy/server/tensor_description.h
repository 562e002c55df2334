#pragma once
// The tensor description of POST /v1/emit_gradient (docs/api.md): name, step, trainer, dtype and
// shape, parsed and checked once for both forms of the route — from the query parameters of a
// raw body (form 1) or from the members of a JSON body naming a buffer region (form 2). The forms
// differ only in how a value is spelled (text in a query, JSON numbers and arrays in a body); the
// rules and the messages are the same. Free functions; thread-safe.

#include <boost/json/object.hpp>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "proxy/step/step.h"

namespace lightwire::proxy {

/// Where the entries of a tensor description come from. Every reader returns "" or a message for
/// the client; a missing entry is not an error for the readers (`present` says).
class DescriptionFields {
 public:
  virtual ~DescriptionFields() = default;
  /// How messages name an entry: "query parameter" or "field".
  virtual const char* noun() const = 0;
  virtual bool present(std::string_view key) const = 0;
  /// The first key not in `known` ("" = none).
  virtual std::string unknownKey(std::span<const std::string_view> known) const = 0;
  virtual std::string unsignedValue(std::string_view key, uint64_t* v) const = 0;
  virtual std::string text(std::string_view key, std::string* v) const = 0;
  /// The dimensions of `key` (at most kMaxDims + 1 are read: one more is an error later);
  /// `given`: whether a shape was given (an empty query parameter is the 1-D default, an empty
  /// JSON array a 0-d tensor of one element).
  virtual std::string dims(std::string_view key, std::vector<uint64_t>* v, bool* given) const = 0;
};

/// The query parameters of form 1.
class QueryFields final : public DescriptionFields {
 public:
  explicit QueryFields(const std::map<std::string, std::string>& query) : query_(query) {}
  const char* noun() const override { return "query parameter"; }
  bool present(std::string_view key) const override;
  std::string unknownKey(std::span<const std::string_view> known) const override;
  std::string unsignedValue(std::string_view key, uint64_t* v) const override;
  std::string text(std::string_view key, std::string* v) const override;
  std::string dims(std::string_view key, std::vector<uint64_t>* v, bool* given) const override;

 private:
  const std::string* find(std::string_view key) const;
  const std::map<std::string, std::string>& query_;
};

/// The members of the JSON body of form 2.
class JsonFields final : public DescriptionFields {
 public:
  explicit JsonFields(const boost::json::object& o) : o_(o) {}
  const char* noun() const override { return "field"; }
  bool present(std::string_view key) const override { return o_.contains(key); }
  std::string unknownKey(std::span<const std::string_view> known) const override;
  std::string unsignedValue(std::string_view key, uint64_t* v) const override;
  std::string text(std::string_view key, std::string* v) const override;
  std::string dims(std::string_view key, std::vector<uint64_t>* v, bool* given) const override;

 private:
  const boost::json::object& o_;
};

/// Name (required, checkName), step (required), trainer (required when this sidecar serves more
/// than one local trainer; at most 2^20), dtype (float32 by default) and, when present, shape
/// (spec->shape and spec->elements; `*has_shape` says whether it was). `extra_known`: the other
/// keys the form accepts. "" or a message for the client; nothing else is checked here (the
/// element count against the data is the form's own).
std::string parseTensorDescription(const DescriptionFields& f,
                                   std::initializer_list<std::string_view> extra_known,
                                   unsigned local_trainers, TensorSpec* spec, bool* has_shape);

}  // namespace lightwire::proxy
