#pragma once
// What the control API's routes share (control_api.cc, gradient_routes.cc, buffer_routes.cc):
// replies, the request target, parsing of parameters and JSON fields, the figures of a step.
// Free functions; thread-safe.

#include <boost/json/object.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "proxy/server/control_api.h"
#include "proxy/server/http_server.h"
#include "proxy/step/step.h"

namespace lightwire::proxy {

/// A request's path and query parameters, parsed once.
struct RequestTarget {
  std::string path;
  std::map<std::string, std::string> query;
  std::string error;  // "" or why the target could not be parsed
};

namespace api {

namespace json = boost::json;
using http::status;

inline constexpr size_t kMaxNameBytes = 256;
inline constexpr size_t kMaxQueryParams = 16;
inline constexpr size_t kMaxDims = 16;

Response jsonResponse(status st, const json::value& v);
Response textResponse(status st, std::string body, const char* type = "text/plain");
/// 400 invalid_argument.
Response badRequest(const std::string& message);
/// The error reply of a failed step (its StepError mapped by apiError()).
Response fromOutcome(const StepOutcome& o);
/// Path and query of a request target; an error message ("" = none).
std::string parseTarget(std::string_view target, RequestTarget* t);
bool parseU64(std::string_view s, uint64_t* v);
/// `s` in single quotes, cut short and with control characters escaped (for messages).
std::string quote(std::string_view s);
/// Why a tensor name cannot be used ("" = it can).
std::string checkName(std::string_view name);
/// The element count of `shape` (an error message on overflow or too many dimensions).
std::string elementsOf(const std::vector<uint64_t>& shape, uint64_t* elements);
/// Field `key` of `o` as an unsigned integer or a string; an error message ("" = fine).
std::string jsonU64(const json::object& o, std::string_view key, bool required, uint64_t* v,
                    bool* present = nullptr);
std::string jsonString(const json::object& o, std::string_view key, bool required, std::string* v);
/// Fields "compute_s" and "overlap_s" (codec auto's timing, docs/api.md): both or neither, finite,
/// 0 <= overlap_s <= compute_s <= 1 hour; "direct_s" and "tail_s" (optional, 0..3600); an error
/// message
/// ("" = fine).
std::string jsonTiming(const json::object& o, std::optional<double>* compute_s,
                       std::optional<double>* overlap_s, std::optional<double>* direct_s,
                       std::optional<double>* tail_s);
/// Field "momentum" (codec auto, docs/api.md): the momentum the trainer's optimizer takes back
/// from the sidecar, in (0, 1); *momentum untouched when absent. An error message ("" = fine).
std::string jsonMomentum(const json::object& o, std::optional<double>* momentum);
/// Field "order" (docs/api.md "Buckets in flight"): {"stream", "iteration", "position"}, a stream
/// name as a tensor name is made, a position below 2^31; *order untouched when absent. An error
/// message ("" = fine).
std::string jsonOrder(const json::object& o, std::optional<StepOrder>* order);
/// The body as a JSON object; an error message ("" = fine).
std::string parseObject(const std::string& body, json::object* out);
/// The JSON figures of a completed step (docs/api.md).
json::object figuresJson(const std::string& name, uint64_t step, const StepFigures& f);

}  // namespace api
}  // namespace lightwire::proxy
