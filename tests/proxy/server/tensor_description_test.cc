// The tensor description of POST /v1/emit_gradient read from both of its forms — query
// parameters (raw body) and JSON members (buffer region) — by the one parser: the same spec from
// the same description, the same rules and messages (only the noun differs).

#include "proxy/server/tensor_description.h"
#include "tests/text.h"

#include <doctest/doctest.h>

#include <boost/json/parse.hpp>

#include <map>
#include <string>

namespace lw = lightwire;
using lw::proxy::JsonFields;
using lw::proxy::QueryFields;
using lw::proxy::TensorSpec;

namespace {

struct Parsed {
  std::string error;
  TensorSpec spec;
  bool has_shape = false;
};

Parsed fromQuery(const std::map<std::string, std::string>& q, unsigned local_trainers = 1) {
  Parsed p;
  p.error =
      lw::proxy::parseTensorDescription(QueryFields(q), {}, local_trainers, &p.spec, &p.has_shape);
  return p;
}

Parsed fromJson(const std::string& body, unsigned local_trainers = 1) {
  Parsed p;
  const boost::json::object o = boost::json::parse(body).as_object();
  p.error = lw::proxy::parseTensorDescription(JsonFields(o), {"buffer", "offset", "elements"},
                                              local_trainers, &p.spec, &p.has_shape);
  return p;
}

using lightwire::testing::contains;

}  // namespace

TEST_CASE("tensor description: both forms give the same spec") {
  const Parsed q = fromQuery({{"name", "layer.0"},
                              {"step", "7"},
                              {"trainer", "1"},
                              {"dtype", "float16"},
                              {"shape", "4,3"}},
                             2);
  const Parsed j = fromJson(
      R"({"name": "layer.0", "step": 7, "trainer": 1, "dtype": "float16", "shape": [4, 3],
          "buffer": "b1"})",
      2);
  for (const Parsed* p : {&q, &j}) {
    CAPTURE(p->error);
    REQUIRE(p->error.empty());
    CHECK(p->spec.name == "layer.0");
    CHECK(p->spec.step == 7);
    CHECK(p->spec.trainer == 1);
    CHECK(p->spec.dtype == lw::kernels::DType::kF16);
    CHECK(p->spec.shape == std::vector<uint64_t>{4, 3});
    CHECK(p->spec.elements == 12);
    CHECK(p->has_shape);
  }
  // Defaults: float32, trainer 0, no shape (the form decides the element count).
  const Parsed dq = fromQuery({{"name", "g"}, {"step", "0"}});
  const Parsed dj = fromJson(R"({"name": "g", "step": 0, "buffer": "b", "elements": 5})");
  for (const Parsed* p : {&dq, &dj}) {
    REQUIRE(p->error.empty());
    CHECK(p->spec.dtype == lw::kernels::DType::kF32);
    CHECK(p->spec.trainer == 0);
    CHECK_FALSE(p->has_shape);
  }
  // An empty query shape is the 1-D default; an empty JSON array a 0-d tensor of one element.
  CHECK_FALSE(fromQuery({{"name", "g"}, {"step", "0"}, {"shape", ""}}).has_shape);
  const Parsed zero_d = fromJson(R"({"name": "g", "step": 0, "shape": []})");
  CHECK(zero_d.has_shape);
  CHECK(zero_d.spec.elements == 1);
}

TEST_CASE("tensor description: the same rules and messages in both forms") {
  struct Case {
    const char* what;
    std::map<std::string, std::string> query;
    std::string json;
    std::string message;  // a part of both messages
  };
  const Case cases[] = {
      {"missing name", {{"step", "1"}}, R"({"step": 1})", "'name'"},
      {"missing step", {{"name", "g"}}, R"({"name": "g"})", "'step'"},
      {"bad step", {{"name", "g"}, {"step", "-3"}}, R"({"name": "g", "step": -3})", "'step'"},
      {"unknown key",
       {{"name", "g"}, {"step", "1"}, {"color", "1"}},
       R"({"name": "g", "step": 1, "color": 1})",
       "unknown"},
      {"bad dtype",
       {{"name", "g"}, {"step", "1"}, {"dtype", "int8"}},
       R"({"name": "g", "step": 1, "dtype": "int8"})",
       "unknown dtype 'int8'"},
      {"trainer out of range",
       {{"name", "g"}, {"step", "1"}, {"trainer", "2000000"}},
       R"({"name": "g", "step": 1, "trainer": 2000000})",
       "'trainer' is out of range"},
      {"zero dimension",
       {{"name", "g"}, {"step", "1"}, {"shape", "4,0"}},
       R"({"name": "g", "step": 1, "shape": [4, 0]})",
       "at least 1"},
      {"too many dimensions",
       {{"name", "g"}, {"step", "1"}, {"shape", "1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1"}},
       R"({"name": "g", "step": 1, "shape": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]})",
       "more than 16 dims"},
      {"bad name", {{"name", ""}, {"step", "1"}}, R"({"name": "", "step": 1})", "name"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const Parsed q = fromQuery(c.query);
    const Parsed j = fromJson(c.json);
    CAPTURE(q.error);
    CAPTURE(j.error);
    CHECK(contains(q.error, c.message));
    CHECK(contains(j.error, c.message));
  }
  // Entries are named as the form names them.
  CHECK(fromQuery({{"step", "1"}}).error == "missing query parameter 'name'");
  CHECK(fromJson(R"({"step": 1})").error == "missing field 'name'");
  CHECK(contains(fromQuery({{"name", "g"}, {"step", "1"}, {"x", "1"}}).error,
                 "unknown query parameter 'x' (known: name, step, trainer, dtype, shape)"));
  CHECK(contains(fromJson(R"({"name": "g", "step": 1, "x": 1})").error,
                 "unknown field 'x' (known: name, step, trainer, dtype, shape, buffer, offset, "
                 "elements)"));
  // A sidecar with several local trainers needs to know whose contribution it is.
  for (const std::string& e : {fromQuery({{"name", "g"}, {"step", "1"}}, 3).error,
                               fromJson(R"({"name": "g", "step": 1})", 3).error}) {
    CHECK(contains(e, "'trainer': this sidecar serves 3 local trainers"));
  }
  // Malformed values in the form's own spelling.
  CHECK(contains(fromQuery({{"name", "g"}, {"step", "1"}, {"shape", "4,x"}}).error,
                 "separated by commas"));
  CHECK(
      contains(fromJson(R"({"name": "g", "step": 1, "shape": "4,3"})").error, "must be an array"));
  CHECK(contains(fromJson(R"({"name": 5, "step": 1})").error, "'name' must be a string"));
}
