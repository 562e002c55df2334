// The gradient route of the control API (docs/api.md "POST /v1/emit_gradient"): a gradient as a
// raw body (form 1) or as a region of a registered buffer (form 2), one tensor or a bucket of
// layers (docs/api.md "Layouts: one tensor per layer"), submitted to the step engine; the reply
// when its step ends.

#include "proxy/server/control_api.h"

#include <boost/json/serialize.hpp>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>

#include "proxy/server/api_util.h"
#include "proxy/server/layout.h"
#include "proxy/server/tensor_description.h"

namespace lightwire::proxy {

using namespace api;  // NOLINT(google-build-using-namespace): the routes' shared helpers

namespace {

/// A tensor of its own may not take the name of a bucket sent with a layout: the bucket's
/// exchange uses that name for its header (docs/exchange.md "A bucket's layers in one exchange").
std::string notABucket(const std::string& name, const LayoutRegistry& layouts) {
  if (!layouts.contains(name)) return "";
  return "tensor name " + quote(name) +
         " names a bucket sent with a layout: a tensor of its own "
         "needs another name";
}

/// Form 1's reply (docs/api.md "Form 1: raw body"): the averaged tensor's bytes, the step's
/// figures in headers.
Response rawReply(const StepFigures& f, std::string bytes) {
  Response r{status::ok, 11};
  r.set(http::field::content_type, "application/octet-stream");
  r.set("X-Lightwire-Codec", f.codec);
  r.set("X-Lightwire-Raw-Bytes", std::to_string(f.raw_bytes));
  r.set("X-Lightwire-Wire-Bytes", std::to_string(f.wire_bytes));
  r.set("X-Lightwire-Nonfinite", f.nonfinite ? "1" : "0");
  r.set("X-Lightwire-Mode", f.mode);
  r.set("X-Lightwire-Settings", std::to_string(f.settings));
  r.body() = std::move(bytes);
  return r;
}

/// The contribution of the tensor `spec` at byte `offset` of `region` (checked to lie inside it).
Contribution regionContribution(const std::shared_ptr<ipc::Region>& region, uint64_t offset,
                                const TensorSpec& spec) {
  Contribution c;
  c.spec = spec;
  c.data = region->data() + offset;
  c.still_valid = [region] { return region->stillBacked(); };
  if (std::string_view(region->kind()) != "shm") {
    const uint64_t bytes = spec.elements * kernels::dtypeSize(spec.dtype);
    c.fetch = [region, offset, bytes](std::string* why) {
      return region->fetch(offset, bytes, why);
    };
    c.store = [region, offset, bytes](std::string* why) {
      return region->store(offset, bytes, why);
    };
  }
  if (auto view = region->deviceAt(offset)) {
    // The engine's GPU path reads and writes the trainer's memory in place.
    Contribution::Device d;
    d.ordinal = view->ordinal;
    d.ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(view->address));
    d.wait = [region](void* stream, std::string* why) { return region->waitOn(stream, why); };
    c.device = std::move(d);
  }
  c.keep_alive = region;
  return c;
}

/// What a bucket's layers have given when they all ended: each one's outcome, in layout order.
using LayersDone = std::function<void(std::vector<StepOutcome>& outcomes)>;

/// The outcomes of a bucket's layers as they end; `done` once the last one has.
struct LayerSteps {
  std::mutex mu;
  std::vector<StepOutcome> outcomes;
  size_t remaining = 0;
  LayersDone done;
};

/// Submits the entries of `layout` as one step of the bucket `spec` describes (docs/api.md
/// "Layouts: one tensor per layer"): one tensor per entry, in layout order — the same order on
/// every sidecar, as the buckets themselves are — each with the request's step and its share of
/// the request's timing. `at(entry, layer)`: the contribution of the entry, given the layer's
/// spec. `done` once every layer has ended.
void submitLayers(StepEngine& engine, const TensorSpec& spec, std::shared_ptr<const Layout> layout,
                  const std::function<Contribution(const LayoutEntry&, const TensorSpec&)>& at,
                  LayersDone done) {
  auto steps = std::make_shared<LayerSteps>();
  const size_t n = layout->entries.size();
  steps->outcomes.resize(n);
  steps->remaining = n;
  steps->done = std::move(done);
  std::vector<Contribution> layers;
  std::vector<StepDone> dones;
  layers.reserve(n);
  dones.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const LayoutEntry& entry = layout->entries[i];
    TensorSpec layer = spec;
    layer.name = entry.name;
    layer.shape = entry.shape;
    layer.elements = entry.elements;
    layer.layer = true;
    layer.bucket = spec.name;
    layer.layout_hash = layout->hash;
    layer.bucket_layers = static_cast<uint32_t>(n);
    // The bucket's timing, shared by its layers by their elements.
    const double share = static_cast<double>(entry.elements) / static_cast<double>(spec.elements);
    if (spec.compute_s) {
      layer.compute_s = *spec.compute_s * share;
      layer.overlap_s = *spec.overlap_s * share;
    }
    if (spec.direct_s) layer.direct_s = *spec.direct_s * share;
    if (spec.tail_s) layer.tail_s = *spec.tail_s * share;
    layers.push_back(at(entry, layer));
    dones.push_back([steps, i](StepOutcome out) {
      std::unique_lock lock(steps->mu);
      steps->outcomes[i] = std::move(out);
      if (--steps->remaining > 0) return;
      lock.unlock();
      steps->done(steps->outcomes);
    });
  }
  engine.submitBucket(std::move(layers), std::move(dones));
}

/// The outcome a bucket fails with (a bucket fails as a whole; the engine's message names the
/// layer): its first failed layer's, null when every layer completed.
const StepOutcome* failedLayer(const std::vector<StepOutcome>& outcomes) {
  for (const StepOutcome& outcome : outcomes) {
    if (!outcome.ok()) return &outcome;
  }
  return nullptr;
}

/// A completed bucket's figures (docs/api.md "Layouts: one tensor per layer"): sums over its
/// layers — codec, mode, device and rung "mixed" where the layers differ, the exchange's duration
/// the longest layer's, since they share one exchange. *one_momentum: whether every layer has the
/// same momentum (the bucket's then).
StepFigures bucketFigures(const std::vector<StepOutcome>& outcomes, bool* one_momentum) {
  StepFigures total = outcomes.front().figures;
  *one_momentum = true;
  for (size_t i = 1; i < outcomes.size(); ++i) {
    const StepFigures& f = outcomes[i].figures;
    if (f.codec != total.codec) total.codec = "mixed";
    if (f.mode != total.mode) total.mode = "mixed";
    if (f.device != total.device) total.device = "mixed";
    *one_momentum = *one_momentum && f.momentum == total.momentum;
    total.elements += f.elements;
    total.raw_bytes += f.raw_bytes;
    total.wire_bytes += f.wire_bytes;
    total.nonfinite = total.nonfinite || f.nonfinite;
    total.state_reset = total.state_reset || f.state_reset;
    total.settings = std::max(total.settings, f.settings);
    if (f.rung != total.rung) total.rung = "mixed";
    if (!total.direct) total.direct = f.direct;
    for (size_t s = 0; s < metrics::kStageCount; ++s) {
      if (s == static_cast<size_t>(metrics::Stage::kExchange)) {
        total.durations_us[s] = std::max(total.durations_us[s], f.durations_us[s]);
      } else {
        total.durations_us[s] += f.durations_us[s];
      }
    }
  }
  return total;
}

/// Form 2's reply for a bucket whose layers all ended: its error, else the bucket's figures with
/// each layer's own under "layers".
Response bucketReply(const std::string& bucket, uint64_t step, const Layout& layout,
                     const std::vector<StepOutcome>& outcomes) {
  if (const StepOutcome* failed = failedLayer(outcomes)) return fromOutcome(*failed);
  bool one_momentum = true;
  const StepFigures total = bucketFigures(outcomes, &one_momentum);
  json::array layers;
  for (size_t i = 0; i < outcomes.size(); ++i) {
    layers.push_back(figuresJson(layout.entries[i].name, step, outcomes[i].figures));
  }
  json::object o = figuresJson(bucket, step, total);
  if (!one_momentum) o.erase("momentum");  // each layer says its own
  o["layout_hash"] = layoutHashText(layout.hash);
  o["layers"] = std::move(layers);
  return jsonResponse(status::ok, o);
}

/// The layout a request names by its layout hash `text` (`label` names the hash as the request
/// spells it: "field 'layout_hash'", "query parameter 'layout_hash'"), so that a trainer sends a
/// bucket's layout once (docs/api.md "Layouts: one tensor per layer"): with the layout sent
/// beside it (`sent`), the hash must be that layout's (which the caller then registers);
/// without, *layout = the layout registered under `bucket`, which must hold `elements` elements.
/// "" or why not (*unknown: no layout is registered under that name, 404 unknown_layout).
std::string layoutByHash(const std::string& text, const std::string& label,
                         const std::string& bucket, uint64_t elements,
                         const LayoutRegistry& registry, const std::optional<Layout>& sent,
                         std::shared_ptr<const Layout>* layout, bool* unknown) {
  uint64_t hash = 0;
  if (!parseLayoutHash(text, &hash)) {
    return label + " must be 16 hex digits (a reply's layout hash), not " + quote(text);
  }
  if (sent) {
    if (sent->hash == hash) return "";
    return label + " " + quote(text) + " is not the hash of the layout sent with it (" +
           layoutHashText(sent->hash) + ")";
  }
  std::shared_ptr<const Layout> known = registry.find(bucket);
  if (!known) {
    *unknown = true;
    return "no layout is registered under bucket " + quote(bucket) +
           " (a sidecar that restarted has none): send the bucket with its 'layout' once";
  }
  if (known->hash != hash) {
    return "bucket " + quote(bucket) + " was sent with layout " + layoutHashText(known->hash) +
           ", not " + quote(text) + ": a bucket's name stands for one layout";
  }
  uint64_t total = 0;
  for (const LayoutEntry& e : known->entries) total += e.elements;
  if (total != elements) {
    return "bucket " + quote(bucket) + "'s layout holds " + std::to_string(total) +
           " elements, the request " + std::to_string(elements);
  }
  *layout = std::move(known);
  return "";
}

/// The layout the bucket `spec` names runs with (docs/api.md "Layouts: one tensor per layer"),
/// for either form: the layout sent with the request (`sent`, parsed and checked against it),
/// the one registered under its name that its layout hash (`hash`, null when the request has
/// none; `noun` says how the request spells its members) names, or both — the hash then must be
/// the sent layout's. A sent layout is registered under the bucket's name, or must be the one
/// registered before. *layout stays null when the request has neither: one tensor, which may not
/// take a bucket's name. The error reply when the request cannot go on (nothing changed then).
std::optional<Response> requestLayout(const TensorSpec& spec, std::optional<Layout> sent,
                                      const std::string* hash, const char* noun,
                                      LayoutRegistry& registry,
                                      std::shared_ptr<const Layout>* layout) {
  if (hash) {
    bool unknown = false;
    if (std::string e = layoutByHash(*hash, std::string(noun) + " 'layout_hash'", spec.name,
                                     spec.elements, registry, sent, layout, &unknown);
        !e.empty()) {
      return unknown ? errorResponse(status::not_found, "unknown_layout", e) : badRequest(e);
    }
  }
  if (sent) {
    if (std::string e = registry.check(spec.name, std::move(*sent), layout); !e.empty()) {
      return badRequest(e);
    }
  }
  if (!*layout) {
    if (std::string e = notABucket(spec.name, registry); !e.empty()) return badRequest(e);
  }
  return std::nullopt;
}

}  // namespace

Response ControlApi::emitRaw(Request& req, const RequestTarget& t, Reply& reply, bool& replied) {
  const QueryFields query(t.query);
  TensorSpec spec;
  bool has_shape = false;
  if (std::string e = parseTensorDescription(query, {"layout_bytes", "layout_hash"},
                                             config_.local_trainers, &spec, &has_shape);
      !e.empty()) {
    return badRequest(e);
  }
  // A layout sent inline: the body's first `prefix` bytes (docs/api.md "Form 1: raw body").
  uint64_t prefix = 0;
  const bool has_layout = query.present("layout_bytes");
  if (has_layout) {
    if (std::string e = query.unsignedValue("layout_bytes", &prefix); !e.empty()) {
      return badRequest(e);
    }
    if (prefix == 0 || prefix > kMaxLayoutBytes) {
      return badRequest("query parameter 'layout_bytes' must be 1 to " +
                        std::to_string(kMaxLayoutBytes) + " (the layout's JSON), got " +
                        std::to_string(prefix));
    }
    if (prefix > req.body().size()) {
      return badRequest("query parameter 'layout_bytes' is " + std::to_string(prefix) +
                        ", the body has only " + std::to_string(req.body().size()) + " bytes");
    }
  }
  const size_t width = kernels::dtypeSize(spec.dtype);
  const uint64_t body_bytes = req.body().size() - prefix;  // the tensor's
  const std::string body_is =
      "the body has " + std::to_string(body_bytes) + (has_layout ? " bytes after its layout" : "");
  if (has_shape) {
    if (spec.elements > body_bytes / width || spec.elements * width != body_bytes) {
      return badRequest(
          "shape " + quote(t.query.at("shape")) + " of " + apiDTypeName(spec.dtype) + " needs " +
          (spec.elements > body_bytes / width ? std::string("more")
                                              : std::to_string(spec.elements * width)) +
          " bytes, " + body_is);
    }
  } else {
    if (body_bytes % width != 0) {
      return badRequest(body_is + (has_layout ? ", " : " bytes, ") + "not a whole number of " +
                        apiDTypeName(spec.dtype) + " values");
    }
    spec.elements = body_bytes / width;
  }
  if (spec.elements == 0) return badRequest("empty tensor: the body holds no values");
  std::optional<Layout> sent;
  if (has_layout) {
    sent.emplace();
    if (std::string e = parseLayoutText(std::string_view(req.body()).substr(0, prefix),
                                        spec.elements, spec.name, &*sent);
        !e.empty()) {
      return badRequest("the body's first " + std::to_string(prefix) +
                        " bytes (query parameter 'layout_bytes'): " + e);
    }
  }
  std::string hash;
  if (std::string e = query.text("layout_hash", &hash); !e.empty()) return badRequest(e);
  std::shared_ptr<const Layout> layout;
  if (auto refused =
          requestLayout(spec, std::move(sent), query.present("layout_hash") ? &hash : nullptr,
                        query.noun(), layouts_, &layout)) {
    return std::move(*refused);
  }

  auto body = std::make_shared<std::string>(std::move(req.body()));
  if (prefix % width != 0) {  // the values aligned to their width, as a region's offset must be
    body->erase(0, prefix);
    prefix = 0;
  }
  replied = true;
  if (!layout) {
    Contribution c;
    c.spec = spec;
    c.data = reinterpret_cast<std::byte*>(body->data());
    c.keep_alive = body;
    engine_.submit(std::move(c), [reply, body](StepOutcome o) {
      if (!o.ok()) return reply(fromOutcome(o));
      reply(rawReply(o.figures, std::move(*body)));
    });
    return {};
  }
  std::byte* const tensor = reinterpret_cast<std::byte*>(body->data()) + prefix;
  const auto at = [&](const LayoutEntry& entry, const TensorSpec& layer) {
    Contribution c;
    c.spec = layer;
    c.data = tensor + entry.offset * width;
    c.keep_alive = body;
    return c;
  };
  submitLayers(engine_, spec, layout, at,
               [reply, body, prefix, hash = layout->hash](std::vector<StepOutcome>& outcomes) {
                 if (const StepOutcome* failed = failedLayer(outcomes)) {
                   return reply(fromOutcome(*failed));
                 }
                 bool one_momentum = true;
                 body->erase(0, prefix);  // the reply is the tensor's bytes
                 Response r = rawReply(bucketFigures(outcomes, &one_momentum), std::move(*body));
                 r.set("X-Lightwire-Layout-Hash", layoutHashText(hash));
                 reply(std::move(r));
               });
  return {};
}

Response ControlApi::emitShm(Request& req, Reply& reply, bool& replied) {
  json::object o;
  if (std::string e = parseObject(req.body(), &o); !e.empty()) return badRequest(e);
  TensorSpec spec;
  bool has_shape = false;
  if (std::string e = parseTensorDescription(
          JsonFields(o),
          {"buffer", "offset", "elements", "layout", "layout_hash", "compute_s", "overlap_s",
           "direct_s", "tail_s", "order", "momentum"},
          config_.local_trainers, &spec, &has_shape);
      !e.empty()) {
    return badRequest(e);
  }
  std::string buffer;
  uint64_t offset = 0, elements = 0;
  bool has_elements = false;
  for (std::string e :
       {jsonString(o, "buffer", true, &buffer), jsonU64(o, "offset", false, &offset),
        jsonU64(o, "elements", false, &elements, &has_elements),
        jsonTiming(o, &spec.compute_s, &spec.overlap_s, &spec.direct_s, &spec.tail_s),
        jsonOrder(o, &spec.order), jsonMomentum(o, &spec.momentum)}) {
    if (!e.empty()) return badRequest(e);
  }
  if (has_shape) {
    if (has_elements && elements != spec.elements) {
      return badRequest("fields 'shape' and 'elements' disagree");
    }
  } else if (has_elements) {
    spec.elements = elements;
  } else {
    return badRequest("missing field 'shape' (or 'elements')");
  }
  if (spec.elements == 0) return badRequest("empty tensor: 0 elements");
  std::optional<Layout> sent;  // the layout sent with this request
  if (const json::value* lv = o.if_contains("layout")) {
    sent.emplace();
    if (std::string e = parseLayout(*lv, spec.elements, spec.name, &*sent); !e.empty()) {
      return badRequest(e);
    }
  }
  auto region = buffers_.find(buffer);
  if (!region) {
    return errorResponse(status::not_found, "not_found", "unknown buffer " + quote(buffer));
  }
  const uint64_t width = kernels::dtypeSize(spec.dtype);
  if (offset % width != 0) {
    return badRequest("offset " + std::to_string(offset) + " is not a multiple of " +
                      std::to_string(width) + " (the size of " + apiDTypeName(spec.dtype) + ")");
  }
  if (spec.elements > region->size() / width || offset > region->size() ||
      spec.elements * width > region->size() - offset) {
    return badRequest("region [" + std::to_string(offset) + ", +" + std::to_string(spec.elements) +
                      " " + apiDTypeName(spec.dtype) + ") lies outside buffer " + buffer + " (" +
                      std::to_string(region->size()) + " bytes)");
  }
  if (!region->stillBacked()) {
    return badRequest("buffer " + buffer + " no longer holds its registered size");
  }
  std::string hash;
  if (std::string e = jsonString(o, "layout_hash", false, &hash); !e.empty()) {
    return badRequest(e);
  }
  std::shared_ptr<const Layout> layout;  // the bucket's registered layout; null: one tensor
  if (auto refused =
          requestLayout(spec, std::move(sent), o.contains("layout_hash") ? &hash : nullptr, "field",
                        layouts_, &layout)) {
    return std::move(*refused);
  }
  const std::string name = spec.name;
  const uint64_t step = spec.step;
  replied = true;
  if (!layout) {
    engine_.submit(regionContribution(region, offset, spec), [reply, name, step](StepOutcome out) {
      if (!out.ok()) return reply(fromOutcome(out));
      reply(jsonResponse(status::ok, figuresJson(name, step, out.figures)));
    });
    return {};
  }
  const auto at = [&](const LayoutEntry& entry, const TensorSpec& layer) {
    return regionContribution(region, offset + entry.offset * width, layer);
  };
  submitLayers(engine_, spec, layout, at,
               [reply, name, step, layout](std::vector<StepOutcome>& outcomes) {
                 reply(bucketReply(name, step, *layout, outcomes));
               });
  return {};
}

Response ControlApi::cancelRoute(RouteCall& call) {
  json::object o;
  if (std::string e = parseObject(call.req.body(), &o); !e.empty()) return badRequest(e);
  std::optional<StepOrder> order;
  std::string name;
  uint64_t step = 0;
  bool has_step = false;
  for (std::string e : {jsonOrder(o, &order), jsonString(o, "name", false, &name),
                        jsonU64(o, "step", false, &step, &has_step)}) {
    if (!e.empty()) return badRequest(e);
  }
  for (const auto& kv : o) {
    if (kv.key() != "order" && kv.key() != "name" && kv.key() != "step") {
      return badRequest("unknown field " + quote(kv.key()) + " (known: order, name, step)");
    }
  }
  if (!order) return badRequest("missing field 'order'");
  if (name.empty() != !has_step) return badRequest("fields 'name' and 'step' go together");
  if (!name.empty()) {
    if (std::string e = checkName(name); !e.empty()) return badRequest(e);
  }
  auto done = engine_.cancel(*order, name, has_step ? std::optional<uint64_t>(step) : std::nullopt);
  if (!done) {
    if (done.status().code() == StatusCode::kOutOfRange) {
      metrics_.limitHits("pending_steps").Increment();
      return errorResponse(status::too_many_requests, "limit_reached", done.status().message());
    }
    return errorResponse(status::service_unavailable, "shutting_down", done.status().message());
  }
  return jsonResponse(status::ok, json::object{{"cancelled", *done}});
}

}  // namespace lightwire::proxy
