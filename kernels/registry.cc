#include "kernels/registry.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>

#include "kernels/select.h"

namespace lightwire::kernels {
namespace {

struct Registered {
  CodecFactory factory;
  CodecTraits traits;
};

struct Registry {
  std::mutex mu;
  std::map<std::string, Registered, std::less<>> factories;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: used during static init and exit
  return *r;
}

}  // namespace

Status registerCodec(const CodecTraits& traits, CodecFactory factory) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  const std::string name = traits.name;
  if (!r.factories.emplace(name, Registered{std::move(factory), traits}).second) {
    return failedPrecondition("codec '" + name + "' is registered twice");
  }
  return Status::ok();
}

std::optional<CodecTraits> findCodecTraits(std::string_view name) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  auto it = r.factories.find(name);
  if (it == r.factories.end()) return std::nullopt;
  return it->second.traits;
}

std::vector<std::string> codecNames() {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  std::vector<std::string> names;
  for (const auto& [name, f] : r.factories) names.push_back(name);
  return names;
}

Result<std::unique_ptr<Codec>> createCodec(const CodecConfig& config) {
  CodecFactory factory;
  {
    auto& r = registry();
    std::lock_guard lock(r.mu);
    auto it = r.factories.find(config.name);
    if (it == r.factories.end()) {
      std::string known;
      for (const auto& [name, f] : r.factories) known += (known.empty() ? "" : ", ") + name;
      return invalidArgument("unknown codec '" + config.name + "' (known: " + known + ")");
    }
    factory = it->second.factory;
  }
  // Shared by every codec (those that do not select ignore it), so checked here once.
  if (!std::isfinite(config.min_magnitude) || !(config.min_magnitude >= 0.0)) {
    return invalidArgument(config.name +
                           ": min_magnitude must be a finite number >= 0 (0 = off), got " +
                           formatNumber(config.min_magnitude));
  }
  auto made = factory(config);
  if (!made) return made.status();
  std::unique_ptr<Codec> codec = std::move(made).value();
  const CodecTraits& t = codec->traits();
  if (t.own_memory) {
    if (config.error_feedback.value_or(false)) {
      return invalidArgument("codec '" + config.name +
                             "' keeps its own residual; error_feedback cannot be stacked on it");
    }
    return codec;
  }
  if (config.error_feedback.value_or(t.default_error_feedback)) {
    return makeErrorFeedback(std::move(codec));
  }
  return codec;
}

detail::CodecRegistrar::CodecRegistrar(const CodecTraits& traits, CodecFactory factory) {
  const Status s = registerCodec(traits, std::move(factory));
  if (!s.isOk()) {
    std::fprintf(stderr, "lightwire: %s\n", s.message().c_str());
    std::abort();  // a build defect, not input: fail at start, loudly
  }
}

std::string configKey(const CodecConfig& c) {
  std::ostringstream o;
  auto opt = [&](const std::optional<double>& v) {
    if (v) {
      o << *v;
    } else {
      o << '-';
    }
    o << '|';
  };
  o.precision(17);
  o << c.name << '|';
  opt(c.density);
  opt(c.ratio);
  o << c.bits << '|' << c.bucket_size << '|' << c.momentum << '|' << c.clip_norm << '|'
    << c.sample_fraction << '|' << static_cast<int>(c.sparse_values) << '|';
  opt(c.threshold);
  o << (c.error_feedback ? (*c.error_feedback ? 1 : 0) : -1) << '|' << c.approx_rank;
  // Fields added later appear only when set, so the keys of existing configurations stay as
  // they were.
  if (c.min_magnitude != 0.0) o << "|min_magnitude=" << c.min_magnitude;
  if (c.bias_correction) o << "|bias_correction=1";
  return o.str();
}

const Codec& noneCodec() {
  static const std::unique_ptr<Codec> codec = [] {
    auto c = createCodec(CodecConfig{});
    return std::move(*c);
  }();
  return *codec;
}

}  // namespace lightwire::kernels
