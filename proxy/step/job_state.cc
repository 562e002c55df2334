#include "proxy/step/job_state.h"

#include <boost/json/object.hpp>
#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>

namespace lightwire::proxy {

std::vector<uint8_t> encodeJobState(const std::map<std::string, uint64_t>& committed,
                                    const policies::PolicyEngine* policy) {
  boost::json::object steps;
  for (const auto& [name, step] : committed) steps[name] = step;
  boost::json::object o{{"version", 1}, {"committed", std::move(steps)}};
  if (policy) o["policy"] = policy->stateJson();
  const std::string text = boost::json::serialize(o);
  return {text.begin(), text.end()};
}

Result<JobState> decodeJobState(std::span<const uint8_t> bytes) {
  boost::system::error_code ec;
  const boost::json::value v = boost::json::parse(
      std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), ec);
  if (ec) return invalidArgument("job state is not JSON: " + ec.message());
  const auto* o = v.if_object();
  if (!o || !o->contains("version") || !o->at("version").is_int64() ||
      o->at("version").as_int64() != 1) {
    return invalidArgument("job state: expected an object with \"version\": 1");
  }
  const auto* committed = o->if_contains("committed");
  if (!committed || !committed->is_object()) {
    return invalidArgument("job state: \"committed\" must be an object");
  }
  JobState state;
  auto& out = state.committed;
  if (const auto* p = o->if_contains("policy")) {
    if (!p->is_object()) return invalidArgument("job state: \"policy\" must be an object");
    state.policy = *p;
  }
  for (const auto& [name, step] : committed->as_object()) {
    if (name.empty() || name.size() > 1024) {
      return invalidArgument("job state: a tensor name is empty or longer than 1024 bytes");
    }
    if (step.is_uint64()) {
      out[std::string(name)] = step.as_uint64();
    } else if (step.is_int64() && step.as_int64() >= 0) {
      out[std::string(name)] = static_cast<uint64_t>(step.as_int64());
    } else {
      return invalidArgument("job state: the step of '" + std::string(name) +
                             "' is not a non-negative integer");
    }
  }
  return state;
}

}  // namespace lightwire::proxy
