// Checkpoint files (policies/checkpoint.h): the layout, exact round trips, atomic writes, and
// hostile files — truncated, bit-flipped, with lengths that lie under a correct checksum.
#include <doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "policies/checkpoint.h"
#include "tests/temp_dir.h"
#include "tests/text.h"

namespace lightwire::policies {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

Checkpoint sampleCheckpoint() {
  Checkpoint c;
  c.job_id = "job-1";
  c.world_size = 4;
  c.rank = 2;
  c.step = 9;
  c.reason = "periodic";
  c.policy_json = R"({"bypass_left":3,"baseline":1.5e-3,"note":"\u00e9"})";
  CheckpointTensor a;
  a.name = "layer1.weight";
  a.codec_key = "topk:ratio=0.01;ef=1";
  a.elements = 6;
  a.dtype = 0;
  a.last_committed = 9;
  a.state = {-0.0f,
             0.0f,
             std::numeric_limits<float>::denorm_min(),
             -std::numeric_limits<float>::denorm_min(),
             1.1754942e-38f,  // the largest denormal
             std::numeric_limits<float>::max(),
             -std::numeric_limits<float>::max(),
             3.0e38f,
             1.0f / 3.0f};
  a.accumulator = {1.0f, -2.5f, 1e-30f, 0.0f, -0.0f, 65504.0f};
  CheckpointTensor b;  // stateless, no accumulator
  b.name = "layer1.bias";
  b.codec_key = "none";
  b.elements = 4;
  b.dtype = 1;
  b.last_committed = 8;
  CheckpointTensor d;  // accumulator only (delayed sync)
  d.name = "emb";
  d.codec_key = "";
  d.elements = 3;
  d.dtype = 2;
  d.last_committed = 0;
  d.accumulator = {7.0f, -8.0f, 9.5f};
  c.tensors = {a, b, d};
  return c;
}

/// A checkpoint small enough to truncate and flip byte by byte.
Checkpoint small() {
  Checkpoint c;
  c.job_id = "j";
  c.world_size = 2;
  c.rank = 1;
  c.step = 3;
  c.reason = "sigterm";
  c.policy_json = "{}";
  CheckpointTensor t;
  t.name = "w";
  t.codec_key = "fp16";
  t.elements = 2;
  t.last_committed = 3;
  t.state = {0.5f, -1.0f};
  t.accumulator = {2.0f};
  c.tensors = {t};
  return c;
}

CheckpointExpect expectFor(const Checkpoint& c) {
  CheckpointExpect e;
  e.job_id = c.job_id;
  e.world_size = c.world_size;
  e.rank = c.rank;
  e.step = c.step;
  return e;
}

std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> out;
  for (float f : v) out.push_back(std::bit_cast<uint32_t>(f));
  return out;
}

void checkSame(const Checkpoint& a, const Checkpoint& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.world_size == b.world_size);
  CHECK(a.rank == b.rank);
  CHECK(a.step == b.step);
  CHECK(a.reason == b.reason);
  CHECK(a.policy_json == b.policy_json);
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const CheckpointTensor& x = a.tensors[i];
    const CheckpointTensor& y = b.tensors[i];
    CHECK(x.name == y.name);
    CHECK(x.codec_key == y.codec_key);
    CHECK(x.elements == y.elements);
    CHECK(x.dtype == y.dtype);
    CHECK(x.last_committed == y.last_committed);
    CHECK(bits(x.state) == bits(y.state));  // bit-exact: -0.0 and denormals included
    CHECK(bits(x.accumulator) == bits(y.accumulator));
  }
}

std::vector<uint8_t> readAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void writeAll(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

/// Builds bodies by hand, little-endian, for files whose checksum is right but whose contents lie.
struct Bytes {
  std::vector<uint8_t> b;
  Bytes& u(uint64_t v, size_t n) {
    for (size_t i = 0; i < n; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Bytes& u8(uint64_t v) { return u(v, 1); }
  Bytes& u16(uint64_t v) { return u(v, 2); }
  Bytes& u32(uint64_t v) { return u(v, 4); }
  Bytes& u64(uint64_t v) { return u(v, 8); }
  Bytes& str(const std::string& s) {
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Bytes& f32(float f) { return u32(std::bit_cast<uint32_t>(f)); }
  /// job "j", world 2, rank 1, step 3, reason "", policy "{}".
  Bytes& head() { return u16(1).str("j").u32(2).u32(1).u64(3).u8(0).u32(2).str("{}"); }
  /// A tensor up to (not including) its state count.
  Bytes& tensorStart(const std::string& name) {
    return u16(name.size()).str(name).u16(4).str("none").u64(2).u8(0).u64(3);
  }
};

/// Header (with `body_len`, by default the true length), body, XXH3-64 of the body.
std::vector<uint8_t> seal(const std::vector<uint8_t>& body, uint32_t version = 2,
                          std::optional<uint64_t> body_len = std::nullopt) {
  Bytes f;
  f.str("LWCK").u32(version).u64(body_len.value_or(body.size()));
  f.b.insert(f.b.end(), body.begin(), body.end());
  f.u64(XXH3_64bits(body.data(), body.size()));
  return f.b;
}

CheckpointExpect smallExpect() { return expectFor(small()); }

std::string decodeError(const std::vector<uint8_t>& file) {
  Result<Checkpoint> r = decodeCheckpoint(file, smallExpect());
  REQUIRE_FALSE(r.isOk());
  CHECK(r.status().code() == StatusCode::kDataLoss);
  return r.status().message();
}

using lightwire::testing::contains;

std::vector<std::string> filesIn(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_SUITE("checkpoint") {
  TEST_CASE("checkpointPath names files by sanitised job, rank and step") {
    CHECK(checkpointPath("/var/lw", "job-1", 3, 120) == "/var/lw/job-1.rank3.step120.lwck");
    CHECK(checkpointPath("/var/lw/", "job-1", 0, 0) == "/var/lw/job-1.rank0.step0.lwck");
    CHECK(checkpointPath("d", "a/b c\xc3\xa9:*", 1, 2) == "d/a_b_c____.rank1.step2.lwck");
    CHECK(checkpointPath("d", "../..", 0, 1) == "d/.._...rank0.step1.lwck");
    CHECK(checkpointPath("d", "Az09._-", 7, 18446744073709551615ull) ==
          "d/Az09._-.rank7.step18446744073709551615.lwck");
  }

  TEST_CASE("checkpointPath keeps names of long job ids within NAME_MAX") {
    const std::string j128(128, 'a');
    CHECK(checkpointPath("d", j128, 0, 1) == "d/" + j128 + ".rank0.step1.lwck");
    const std::string j129 = j128 + "b";
    const std::string p129 = checkpointPath("d", j129, 0, 1);
    const uint64_t h = XXH3_64bits(j129.data(), j129.size());
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
    CHECK(p129 == "d/" + std::string(111, 'a') + "~" + hex + ".rank0.step1.lwck");
    // Ids that differ only past the cut, or only in bytes that sanitise alike, still differ.
    CHECK(checkpointPath("d", j128 + "c", 0, 1) != p129);
    CHECK(checkpointPath("d", std::string(65535, '/'), 0, 1) !=
          checkpointPath("d", std::string(65535, ':'), 0, 1));
    const std::string longest =
        checkpointPath("", std::string(65535, 'x'), 4294967295u, 18446744073709551615ull);
    CHECK(longest.size() + std::string(".tmp.4194304").size() <= 255);
  }

  TEST_CASE("the encoded layout is little-endian as documented") {
    Checkpoint c;
    c.job_id = "jb";
    c.world_size = 0x0A0B0C0D;
    c.rank = 0x01020304;
    c.step = 0x1122334455667788ull;
    c.reason = "r";
    c.policy_json = "{}";
    CheckpointTensor t;
    t.name = "t";
    t.codec_key = "k";
    t.elements = 0x0102;
    t.dtype = 2;
    t.last_committed = 0x0807;
    t.state = {1.0f};               // 0x3F800000
    t.accumulator = {-0.0f, 2.0f};  // 0x80000000, 0x40000000
    c.tensors = {t};
    const std::vector<uint8_t> body = {
        0x02, 0x00, 'j',  'b',                           // job id
        0x0D, 0x0C, 0x0B, 0x0A,                          // world size
        0x04, 0x03, 0x02, 0x01,                          // rank
        0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,  // step
        0x01, 'r',                                       // reason
        0x02, 0x00, 0x00, 0x00, '{',  '}',               // policy JSON
        0x01, 0x00, 0x00, 0x00,                          // tensor count
        0x01, 0x00, 't',                                 // name
        0x01, 0x00, 'k',                                 // codec key
        0x02, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // elements
        0x02,                                            // dtype
        0x07, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // last committed
        0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // state floats
        0x00, 0x00, 0x80, 0x3F,                          //   1.0
        0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // accumulator floats
        0x00, 0x00, 0x00, 0x80, 0x00, 0x00, 0x00, 0x40,  //   -0.0, 2.0
    };
    std::vector<uint8_t> want = {'L', 'W', 'C', 'K', 0x02, 0x00, 0x00, 0x00};
    Bytes len;
    len.u64(body.size());
    want.insert(want.end(), len.b.begin(), len.b.end());
    want.insert(want.end(), body.begin(), body.end());
    const uint64_t h = XXH3_64bits(body.data(), body.size());
    for (int i = 0; i < 8; ++i) want.push_back(static_cast<uint8_t>(h >> (8 * i)));
    CHECK(encodeCheckpoint(c) == want);
    CHECK(seal(body) == want);

    CheckpointExpect e;
    e.job_id = "jb";
    e.world_size = c.world_size;
    e.rank = c.rank;
    Result<Checkpoint> r = decodeCheckpoint(want, e);
    REQUIRE(r.isOk());
    checkSame(*r, c);
  }

  TEST_CASE("a multi-tensor checkpoint round-trips bit-exactly") {
    const Checkpoint c = sampleCheckpoint();
    SUBCASE("in memory") {
      Result<Checkpoint> r = decodeCheckpoint(encodeCheckpoint(c), expectFor(c));
      REQUIRE(r.isOk());
      checkSame(*r, c);
    }
    SUBCASE("through a file") {
      TempDir tmp;
      Result<std::string> path = writeCheckpoint(tmp.path(), c);
      REQUIRE_MESSAGE(path.isOk(), path.status().message());
      CHECK(*path == checkpointPath(tmp.path(), "job-1", 2, 9));
      CHECK(readAll(*path) == encodeCheckpoint(c));  // the streaming writer writes the same bytes
      Result<Checkpoint> r = readCheckpoint(*path, expectFor(c));
      REQUIRE_MESSAGE(r.isOk(), r.status().message());
      checkSame(*r, c);
    }
    SUBCASE("without a step expectation") {
      CheckpointExpect e = expectFor(c);
      e.step.reset();
      Result<Checkpoint> r = decodeCheckpoint(encodeCheckpoint(c), e);
      REQUIRE(r.isOk());
      CHECK(r->step == 9);
    }
  }

  TEST_CASE("empty state, no tensors and fields at their limits round-trip") {
    SUBCASE("no tensors, empty reason and policy") {
      Checkpoint c;
      c.job_id = "x";
      Result<Checkpoint> r = decodeCheckpoint(encodeCheckpoint(c), expectFor(c));
      REQUIRE(r.isOk());
      checkSame(*r, c);
    }
    SUBCASE("every length at its maximum") {
      Checkpoint c;
      c.job_id = std::string(65535, 'J');
      c.reason = std::string(255, 'r');
      c.policy_json = std::string(1000, ' ');
      CheckpointTensor t;
      t.name = std::string(1024, 'n');
      t.codec_key = std::string(4096, 'k');
      t.elements = std::numeric_limits<uint64_t>::max();
      t.last_committed = std::numeric_limits<uint64_t>::max();
      c.tensors = {t};
      c.step = std::numeric_limits<uint64_t>::max();
      c.world_size = std::numeric_limits<uint32_t>::max();
      c.rank = c.world_size - 1;
      TempDir tmp;
      Result<std::string> path = writeCheckpoint(tmp.path(), c);
      REQUIRE_MESSAGE(path.isOk(), path.status().message());
      Result<Checkpoint> r = readCheckpoint(*path, expectFor(c));
      REQUIRE_MESSAGE(r.isOk(), r.status().message());
      checkSame(*r, c);
    }
  }

  TEST_CASE("writeCheckpoint is atomic and leaves no temporary file") {
    TempDir tmp;
    Checkpoint c = sampleCheckpoint();
    Result<std::string> path = writeCheckpoint(tmp.path(), c);
    REQUIRE(path.isOk());
    CHECK(filesIn(tmp.path()) == std::vector<std::string>{"job-1.rank2.step9.lwck"});
    struct stat st {};
    REQUIRE(::stat(path->c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);

    SUBCASE("overwriting an existing file") {
      c.reason = "trainer";
      c.tensors.pop_back();
      Result<std::string> again = writeCheckpoint(tmp.path(), c);
      REQUIRE_MESSAGE(again.isOk(), again.status().message());
      CHECK(*again == *path);
      CHECK(filesIn(tmp.path()) == std::vector<std::string>{"job-1.rank2.step9.lwck"});
      Result<Checkpoint> r = readCheckpoint(*path, expectFor(c));
      REQUIRE(r.isOk());
      checkSame(*r, c);
    }
    SUBCASE("a stale temporary file of this pid is replaced") {
      c.step = 10;
      const std::string target = checkpointPath(tmp.path(), c.job_id, c.rank, c.step);
      const std::string stale = target + ".tmp." + std::to_string(::getpid());
      writeAll(stale, {1, 2, 3});
      Result<std::string> p = writeCheckpoint(tmp.path(), c);
      REQUIRE_MESSAGE(p.isOk(), p.status().message());
      CHECK_FALSE(fs::exists(stale));
      CHECK(readCheckpoint(target, expectFor(c)).isOk());
    }
    SUBCASE("a write that fails half-way removes its temporary file") {
      // RLIMIT_FSIZE makes write() fail with EFBIG past 100 bytes (SIGXFSZ ignored meanwhile).
      c.step = 11;
      c.tensors[0].state.assign(10000, 1.0f);
      struct rlimit old {};
      REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
      const auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
      struct rlimit lim = old;
      lim.rlim_cur = 100;
      REQUIRE(::setrlimit(RLIMIT_FSIZE, &lim) == 0);
      Result<std::string> p = writeCheckpoint(tmp.path(), c);
      ::setrlimit(RLIMIT_FSIZE, &old);
      ::signal(SIGXFSZ, old_handler);
      REQUIRE_FALSE(p.isOk());
      const std::string target = checkpointPath(tmp.path(), c.job_id, c.rank, c.step);
      CHECK(contains(p.status().message(), target));
      CHECK(contains(p.status().message(), std::strerror(EFBIG)));
      CHECK(filesIn(tmp.path()) == std::vector<std::string>{"job-1.rank2.step9.lwck"});
    }
  }

  TEST_CASE("writeCheckpoint creates missing directories, 0700") {
    TempDir tmp;
    const std::string dir = tmp.path() + "/a/b//c/";
    Result<std::string> path = writeCheckpoint(dir, small());
    REQUIRE_MESSAGE(path.isOk(), path.status().message());
    CHECK(*path == dir + "j.rank1.step3.lwck");
    for (const char* d : {"/a", "/a/b", "/a/b/c"}) {
      struct stat st {};
      REQUIRE(::stat((tmp.path() + d).c_str(), &st) == 0);
      CHECK(S_ISDIR(st.st_mode));
      CHECK((st.st_mode & 0777) == 0700);
    }
    CHECK(readCheckpoint(*path, expectFor(small())).isOk());
  }

  TEST_CASE("writeCheckpoint into an unusable path fails cleanly, naming it") {
    TempDir tmp;
    const std::string file = tmp.write("plain", "not a directory");
    SUBCASE("a directory under a regular file") {
      const std::string dir = file + "/sub";
      Result<std::string> r = writeCheckpoint(dir, small());
      REQUIRE_FALSE(r.isOk());
      CHECK(contains(r.status().message(), checkpointPath(dir, "j", 1, 3)));
      CHECK(contains(r.status().message(), std::strerror(ENOTDIR)));
    }
    SUBCASE("the directory is a regular file") {
      Result<std::string> r = writeCheckpoint(file, small());
      REQUIRE_FALSE(r.isOk());
      CHECK(contains(r.status().message(), checkpointPath(file, "j", 1, 3)));
      CHECK(contains(r.status().message(), std::strerror(ENOTDIR)));
    }
    SUBCASE("the final name is taken by a directory") {
      fs::create_directory(checkpointPath(tmp.path(), "j", 1, 3));
      Result<std::string> r = writeCheckpoint(tmp.path(), small());
      REQUIRE_FALSE(r.isOk());
      CHECK(contains(r.status().message(), checkpointPath(tmp.path(), "j", 1, 3)));
      CHECK(filesIn(tmp.path()) == std::vector<std::string>{"j.rank1.step3.lwck", "plain"});
    }
    SUBCASE("no directory") {
      Result<std::string> r = writeCheckpoint("", small());
      REQUIRE_FALSE(r.isOk());
      CHECK(r.status().code() == StatusCode::kInvalidArgument);
    }
    CHECK(readAll(file).size() == std::string("not a directory").size());
  }

  TEST_CASE("writeCheckpoint refuses an invalid checkpoint and writes nothing") {
    TempDir tmp;
    const std::string dir = tmp.path() + "/never";
    Checkpoint c = small();
    std::string what;
    SUBCASE("empty job id") {
      c.job_id = "";
      what = "job id";
    }
    SUBCASE("job id too long") {
      c.job_id = std::string(65536, 'j');
      what = "job id";
    }
    SUBCASE("world size 0") {
      c.world_size = 0;
      c.rank = 0;
      what = "world size";
    }
    SUBCASE("rank outside the world") {
      c.rank = 2;
      what = "rank 2";
    }
    SUBCASE("reason too long") {
      c.reason = std::string(256, 'r');
      what = "reason";
    }
    SUBCASE("policy state too large") {
      c.policy_json = std::string((size_t{64} << 20) + 1, ' ');
      what = "policy state";
    }
    SUBCASE("empty tensor name") {
      c.tensors[0].name = "";
      what = "name";
    }
    SUBCASE("tensor name too long") {
      c.tensors[0].name = std::string(1025, 'n');
      what = "name";
    }
    SUBCASE("codec key too long") {
      c.tensors[0].codec_key = std::string(4097, 'k');
      what = "codec key";
    }
    SUBCASE("unknown dtype") {
      c.tensors[0].dtype = 3;
      what = "dtype";
    }
    SUBCASE("duplicate tensor names") {
      c.tensors.push_back(c.tensors[0]);
      what = "twice";
    }
    SUBCASE("NaN in the state") {
      c.tensors[0].state[1] = std::nanf("");
      what = "state";
    }
    SUBCASE("infinity in the accumulator") {
      c.tensors[0].accumulator[0] = -INFINITY;
      what = "accumulator";
    }
    Result<std::string> r = writeCheckpoint(dir, c);
    REQUIRE_FALSE(r.isOk());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_MESSAGE(contains(r.status().message(), what), r.status().message());
    CHECK_FALSE(fs::exists(dir));
  }

  TEST_CASE("a reader refuses a checkpoint of another job, world, rank or step") {
    TempDir tmp;
    const Checkpoint c = sampleCheckpoint();  // job-1, world 4, rank 2, step 9
    Result<std::string> path = writeCheckpoint(tmp.path(), c);
    REQUIRE(path.isOk());
    CheckpointExpect e = expectFor(c);
    std::string want;
    SUBCASE("job") {
      e.job_id = "job-2";
      want = "checkpoint is of job 'job-1', this sidecar runs job 'job-2'";
    }
    SUBCASE("world size") {
      e.world_size = 3;
      want = "checkpoint is of world size 4, this job has 3";
    }
    SUBCASE("rank") {
      e.rank = 1;
      want = "checkpoint is of rank 2, this sidecar is rank 1";
    }
    SUBCASE("step") {
      e.step = 10;
      want = "checkpoint is of step 9, not 10";
    }
    Result<Checkpoint> r = readCheckpoint(*path, e);
    REQUIRE_FALSE(r.isOk());
    CHECK(r.status().code() == StatusCode::kFailedPrecondition);
    CHECK_MESSAGE(contains(r.status().message(), want), r.status().message());
    CHECK(contains(r.status().message(), *path));
    Result<Checkpoint> d = decodeCheckpoint(encodeCheckpoint(c), e);
    REQUIRE_FALSE(d.isOk());
    CHECK(d.status().message() == want);
  }

  TEST_CASE("readCheckpoint: missing, oversized and non-regular files") {
    TempDir tmp;
    SUBCASE("missing file names the path") {
      const std::string path = tmp.path() + "/none.rank0.step1.lwck";
      Result<Checkpoint> r = readCheckpoint(path, smallExpect());
      REQUIRE_FALSE(r.isOk());
      CHECK(contains(r.status().message(), path));
      CHECK(contains(r.status().message(), std::strerror(ENOENT)));
    }
    SUBCASE("a file larger than max_bytes is refused unread") {
      Result<std::string> path = writeCheckpoint(tmp.path(), small());
      REQUIRE(path.isOk());
      CheckpointExpect e = smallExpect();
      e.max_bytes = fs::file_size(*path) - 1;
      Result<Checkpoint> r = readCheckpoint(*path, e);
      REQUIRE_FALSE(r.isOk());
      CHECK(r.status().code() == StatusCode::kOutOfRange);
      CHECK(contains(r.status().message(), *path));
      e.max_bytes += 1;
      CHECK(readCheckpoint(*path, e).isOk());
    }
    SUBCASE("a directory") {
      Result<Checkpoint> r = readCheckpoint(tmp.path(), smallExpect());
      REQUIRE_FALSE(r.isOk());
      CHECK(contains(r.status().message(), tmp.path()));
    }
    SUBCASE("a corrupted file's error names it") {
      const std::string path = tmp.path() + "/bad.lwck";
      writeAll(path, {'n', 'o', 'p', 'e', 0, 0, 0, 0});
      Result<Checkpoint> r = readCheckpoint(path, smallExpect());
      REQUIRE_FALSE(r.isOk());
      CHECK(r.status().code() == StatusCode::kDataLoss);
      CHECK(contains(r.status().message(), path));
      CHECK(contains(r.status().message(), "not a lightwire checkpoint (bad magic)"));
    }
  }

  TEST_CASE("every truncation of a valid file is refused") {
    const std::vector<uint8_t> file = encodeCheckpoint(small());
    REQUIRE(decodeCheckpoint(file, smallExpect()).isOk());
    for (size_t n = 0; n < file.size(); ++n) {
      // A copy of exactly n bytes, so that a read past its end is caught by sanitizers.
      const std::vector<uint8_t> cut(file.begin(), file.begin() + static_cast<ptrdiff_t>(n));
      Result<Checkpoint> r = decodeCheckpoint(cut, smallExpect());
      CHECK_MESSAGE(!r.isOk(), "accepted a truncation to ", n, " bytes");
      if (!r.isOk()) CHECK(r.status().code() == StatusCode::kDataLoss);
    }
    TempDir tmp;
    const std::string path = tmp.path() + "/t.lwck";
    for (size_t n = 0; n < file.size(); n += 7) {
      writeAll(path, std::vector<uint8_t>(file.begin(), file.begin() + static_cast<ptrdiff_t>(n)));
      CHECK_FALSE(readCheckpoint(path, smallExpect()).isOk());
    }
  }

  TEST_CASE("every flipped byte of a valid file is refused") {
    const std::vector<uint8_t> file = encodeCheckpoint(small());
    for (size_t i = 0; i < file.size(); ++i) {
      for (uint8_t mask : {uint8_t{0x01}, uint8_t{0x80}, uint8_t{0xFF}}) {
        std::vector<uint8_t> bad = file;
        bad[i] ^= mask;
        Result<Checkpoint> r = decodeCheckpoint(bad, smallExpect());
        CHECK_MESSAGE(!r.isOk(), "accepted byte ", i, " ^ ", int{mask});
      }
    }
    std::vector<uint8_t> bad = file;
    bad[30] ^= 0x10;  // in the body
    CHECK(decodeError(bad) == "checksum mismatch: the file is corrupted");
    bad = file;
    bad.back() ^= 0x10;  // in the checksum
    CHECK(decodeError(bad) == "checksum mismatch: the file is corrupted");
  }

  TEST_CASE("wrong magic, other versions and trailing bytes are refused") {
    const std::vector<uint8_t> file = encodeCheckpoint(small());
    SUBCASE("magic") {
      std::vector<uint8_t> bad = file;
      bad[3] = 'X';
      CHECK(decodeError(bad) == "not a lightwire checkpoint (bad magic)");
      CHECK(decodeError({'{', '"'}) == "not a lightwire checkpoint (bad magic)");
      CHECK(contains(decodeError({}), "truncated"));
      CHECK(contains(decodeError({'L', 'W'}), "truncated"));
    }
    SUBCASE("version 3 (and 0)") {
      Bytes body;
      body.head().u32(0);
      for (uint32_t v : {3u, 0u, 0xFFFFFFFFu}) {
        Result<Checkpoint> r = decodeCheckpoint(seal(body.b, v), smallExpect());
        REQUIRE_FALSE(r.isOk());
        CHECK(r.status().code() == StatusCode::kFailedPrecondition);
        CHECK(r.status().message() ==
              "format version " + std::to_string(v) + " is not supported (this sidecar reads 2)");
      }
      CHECK(decodeCheckpoint(seal(body.b, 2), smallExpect()).isOk());
    }
    SUBCASE("version 1: an older lightwire's file, refused saying so") {
      Bytes body;
      body.head().u32(0);
      Result<Checkpoint> r = decodeCheckpoint(seal(body.b, 1), smallExpect());
      REQUIRE_FALSE(r.isOk());
      CHECK(r.status().code() == StatusCode::kFailedPrecondition);
      CHECK(r.status().message() ==
            "format version 1 is not supported (this sidecar reads 2): it was written by an "
            "older lightwire, whose codec state this one cannot use; start without it "
            "(docs/policies.md \"Durable state: checkpoints\")");
    }
    SUBCASE("trailing bytes after the checksum") {
      std::vector<uint8_t> bad = file;
      bad.push_back(0);
      CHECK(contains(decodeError(bad), "1 trailing bytes"));
    }
    SUBCASE("trailing bytes inside the body (after the last tensor)") {
      Bytes body;
      body.head().u32(0).u8(0);
      CHECK(contains(decodeError(seal(body.b)), "1 unexpected bytes after the last tensor"));
    }
  }

  TEST_CASE("lengths that lie under a correct checksum are refused without allocating") {
    constexpr uint64_t kHuge = uint64_t{1} << 63;
    Bytes body;
    std::string want;
    SUBCASE("header body length 2^63") {
      Bytes ok;
      ok.head().u32(0);
      CHECK(contains(decodeError(seal(ok.b, 2, kHuge)), "truncated"));
      CHECK(contains(decodeError(seal(ok.b, 2, ~uint64_t{0})), "truncated"));
      CHECK(contains(decodeError(seal(ok.b, 2, ok.b.size() - 1)), "trailing"));
      return;
    }
    SUBCASE("job id length beyond the body") {
      body.u16(0xFFFF).str("j");
      want = "truncated";
    }
    SUBCASE("empty job id") {
      body.u16(0).u32(2).u32(1).u64(3).u8(0).u32(0).u32(0);
      want = "job id of 0 bytes";
    }
    SUBCASE("world size 0") {
      body.u16(1).str("j").u32(0).u32(0).u64(3).u8(0).u32(0).u32(0);
      want = "world size 0";
    }
    SUBCASE("rank outside the world") {
      body.u16(1).str("j").u32(2).u32(2).u64(3).u8(0).u32(0).u32(0);
      want = "rank 2";
    }
    SUBCASE("reason length beyond the body") {
      body.u16(1).str("j").u32(2).u32(1).u64(3).u8(200).str("abc");
      want = "truncated";
    }
    SUBCASE("policy length 2^32-1") {
      body.u16(1).str("j").u32(2).u32(1).u64(3).u8(0).u32(0xFFFFFFFF).str("{}");
      want = "policy state";
    }
    SUBCASE("policy length within the limit but beyond the body") {
      body.u16(1).str("j").u32(2).u32(1).u64(3).u8(0).u32(1000).str("{}");
      want = "truncated";
    }
    SUBCASE("tensor count 2^32-1") {
      body.head().u32(0xFFFFFFFF).tensorStart("w").u64(0).u64(0);
      want = "4294967295 tensors declared";
    }
    SUBCASE("tensor count one more than present") {
      body.head().u32(2).tensorStart("w").u64(0).u64(0);
      want = "truncated";
    }
    SUBCASE("state count 2^63") {
      body.head().u32(1).tensorStart("w").u64(kHuge).f32(1).u64(0);
      want = "declares 9223372036854775808 floats";
    }
    SUBCASE("state count 2^62 (times 4 wraps to 0)") {
      body.head().u32(1).tensorStart("w").u64(uint64_t{1} << 62).u64(0);
      want = "floats";
    }
    SUBCASE("state count 2^62+1 (times 4 wraps to 4)") {
      body.head().u32(1).tensorStart("w").u64((uint64_t{1} << 62) + 1).f32(1).u64(0);
      want = "floats";
    }
    SUBCASE("state count 2^64-1") {
      body.head().u32(1).tensorStart("w").u64(~uint64_t{0}).f32(1).u64(0);
      want = "floats";
    }
    SUBCASE("accumulator count 2^63") {
      body.head().u32(1).tensorStart("w").u64(1).f32(1).u64(kHuge).f32(2);
      want = "accumulator";
    }
    SUBCASE("accumulator count one more than present") {
      body.head().u32(1).tensorStart("w").u64(0).u64(2).f32(2);
      want = "accumulator";
    }
    SUBCASE("empty tensor name") {
      body.head().u32(1).u16(0).u16(0).u64(2).u8(0).u64(3).u64(0).u64(0);
      want = "name of 0 bytes";
    }
    SUBCASE("tensor name of 1025 bytes") {
      body.head().u32(1).tensorStart(std::string(1025, 'n')).u64(0).u64(0);
      want = "name of 1025 bytes";
    }
    SUBCASE("tensor name length beyond the body") {
      body.head().u32(1).u16(1024).str("w").u16(0).u64(2).u8(0).u64(3).u64(0).u64(0);
      want = "truncated";
    }
    SUBCASE("codec key of 4097 bytes") {
      body.head().u32(1).u16(1).str("w").u16(4097).str(std::string(4097, 'k'));
      body.u64(2).u8(0).u64(3).u64(0).u64(0);
      want = "codec key of 4097 bytes";
    }
    SUBCASE("unknown dtype") {
      body.head().u32(1).u16(1).str("w").u16(0).u64(2).u8(3).u64(3).u64(0).u64(0);
      want = "unknown dtype 3";
    }
    SUBCASE("duplicate tensor names") {
      body.head().u32(2).tensorStart("w").u64(0).u64(0).tensorStart("w").u64(0).u64(0);
      want = "tensor 'w' appears twice";
    }
    SUBCASE("NaN in the state") {
      body.head().u32(1).tensorStart("w").u64(2).f32(1).f32(std::nanf("")).u64(0);
      want = "tensor 'w''s state: value 1 is nan";
    }
    SUBCASE("infinity in the accumulator") {
      body.head().u32(1).tensorStart("w").u64(0).u64(1).f32(-INFINITY);
      want = "tensor 'w''s accumulator: value 0 is -inf";
    }
    SUBCASE("a file that ends inside a tensor") {
      body.head().u32(1).tensorStart("w");
      want = "truncated";
    }
    Result<Checkpoint> r = decodeCheckpoint(seal(body.b), smallExpect());
    REQUIRE_FALSE(r.isOk());
    CHECK(r.status().code() == StatusCode::kDataLoss);
    CHECK_MESSAGE(contains(r.status().message(), want), r.status().message());
  }

  TEST_CASE("a malformed file is refused before its job is compared") {
    // Contents are checked before the expectations: a corrupted body of another job says so.
    Bytes body;
    body.u16(1).str("x").u32(2).u32(1).u64(3).u8(0).u32(0).u32(1).tensorStart("w").u64(1).f32(NAN);
    body.u64(0);
    const std::string msg = decodeError(seal(body.b));
    CHECK(contains(msg, "nan"));
  }

  TEST_CASE("listCheckpoints finds this job's and rank's files, in numeric order") {
    TempDir tmp;
    for (const char* name : {"job-1.rank2.step10.lwck", "job-1.rank2.step9.lwck",
                             "job-1.rank2.step100.lwck", "job-1.rank2.step0.lwck"}) {
      tmp.write(name, "");
    }
    for (const char* name : {
             "job-1.rank2.step11.lwck.tmp.1234",           // a temporary file
             "job-1.rank2.step12.lwck.tmp.",               //
             "job-1.rank3.step5.lwck",                     // another rank
             "job-1.rank22.step5.lwck",                    //
             "job-1.rank02.step5.lwck",                    //
             "job-2.rank2.step5.lwck",                     // another job
             "xjob-1.rank2.step5.lwck",                    //
             "job-1.rank2.step+5.lwck",                    // not a plain decimal
             "job-1.rank2.step-5.lwck",                    //
             "job-1.rank2.step 5.lwck",                    //
             "job-1.rank2.step05.lwck",                    // not as checkpointPath() writes it
             "job-1.rank2.step5x.lwck",                    //
             "job-1.rank2.step0x5.lwck",                   //
             "job-1.rank2.step.lwck",                      //
             "job-1.rank2.step5.lwck.bak",                 //
             "job-1.rank2.step5.LWCK",                     //
             "job-1.rank2.step18446744073709551616.lwck",  // overflows u64
             "notes.txt",
         }) {
      tmp.write(name, "");
    }
    fs::create_directory(tmp.path() + "/job-1.rank2.step50.lwck");  // not a file
    CHECK(listCheckpoints(tmp.path(), "job-1", 2) == std::vector<uint64_t>{0, 9, 10, 100});
    CHECK(listCheckpoints(tmp.path(), "job-1", 3) == std::vector<uint64_t>{5});
    CHECK(listCheckpoints(tmp.path(), "job-1", 7).empty());
    CHECK(listCheckpoints(tmp.path() + "/missing", "job-1", 2).empty());
    CHECK(listCheckpoints(tmp.path() + "/notes.txt", "job-1", 2).empty());

    tmp.write("a_b.rank0.step18446744073709551615.lwck", "");
    CHECK(listCheckpoints(tmp.path(), "a/b", 0) == std::vector<uint64_t>{18446744073709551615ull});
  }

  TEST_CASE("listCheckpoints sees what writeCheckpoint wrote") {
    TempDir tmp;
    Checkpoint c = small();
    for (uint64_t s : {12, 3, 7}) {
      c.step = s;
      REQUIRE(writeCheckpoint(tmp.path(), c).isOk());
    }
    CHECK(listCheckpoints(tmp.path(), "j", 1) == std::vector<uint64_t>{3, 7, 12});
    c.job_id = std::string(5000, 'L');
    c.step = 4;
    REQUIRE(writeCheckpoint(tmp.path(), c).isOk());
    CHECK(listCheckpoints(tmp.path(), c.job_id, 1) == std::vector<uint64_t>{4});
    CHECK(listCheckpoints(tmp.path(), std::string(5001, 'L'), 1).empty());
  }

  TEST_CASE("pruneCheckpoints keeps the newest files") {
    TempDir tmp;
    for (const char* name : {"j.rank1.step1.lwck", "j.rank1.step2.lwck", "j.rank1.step9.lwck",
                             "j.rank1.step10.lwck", "j.rank1.step11.lwck", "j.rank0.step1.lwck",
                             "k.rank1.step1.lwck", "j.rank1.step3.lwck.tmp.77", "other"}) {
      tmp.write(name, "");
    }
    SUBCASE("keep 2") {
      pruneCheckpoints(tmp.path(), "j", 1, 2);
      CHECK(listCheckpoints(tmp.path(), "j", 1) == std::vector<uint64_t>{10, 11});
      CHECK(filesIn(tmp.path()) ==
            std::vector<std::string>{"j.rank0.step1.lwck", "j.rank1.step10.lwck",
                                     "j.rank1.step11.lwck", "j.rank1.step3.lwck.tmp.77",
                                     "k.rank1.step1.lwck", "other"});
    }
    SUBCASE("keep more than there are") {
      pruneCheckpoints(tmp.path(), "j", 1, 10);
      CHECK(listCheckpoints(tmp.path(), "j", 1) == std::vector<uint64_t>{1, 2, 9, 10, 11});
    }
    SUBCASE("keep 0 keeps one") {
      pruneCheckpoints(tmp.path(), "j", 1, 0);
      CHECK(listCheckpoints(tmp.path(), "j", 1) == std::vector<uint64_t>{11});
    }
    SUBCASE("a missing directory") { pruneCheckpoints(tmp.path() + "/none", "j", 1, 1); }
    CHECK(listCheckpoints(tmp.path(), "j", 0) == std::vector<uint64_t>{1});
    CHECK(listCheckpoints(tmp.path(), "k", 1) == std::vector<uint64_t>{1});
  }

  TEST_CASE("checkpoint files are ordered as written (modification time, then step)") {
    TempDir tmp;
    // Written in the order 8 and 7 (at the same time: by step), 5, 3, 9.
    auto at = [&](uint64_t step, int64_t sec) {
      const std::string path = tmp.write("j.rank1.step" + std::to_string(step) + ".lwck", "");
      const timespec times[2] = {{sec, 0}, {sec, 0}};
      REQUIRE(::utimensat(AT_FDCWD, path.c_str(), times, 0) == 0);
      return path;
    };
    at(5, 1000);
    const std::string three = at(3, 2000);
    at(9, 3000);
    at(8, 500);
    at(7, 500);
    auto steps = [&](const std::string& dir) {
      std::vector<uint64_t> out;
      for (const auto& f : listCheckpointFiles(dir, "j", 1)) out.push_back(f.step);
      return out;
    };
    CHECK(steps(tmp.path()) == std::vector<uint64_t>{7, 8, 5, 3, 9});
    CHECK(listCheckpoints(tmp.path(), "j", 1) == std::vector<uint64_t>{3, 5, 7, 8, 9});
    const auto files = listCheckpointFiles(tmp.path(), "j", 1);
    CHECK(files[3].path == three);
    CHECK(files[3].mtime_ns == int64_t{2000} * 1000000000);
    // A resume from step 3 marks it as the newest; a restart would restore it, not step 9.
    REQUIRE(markNewest(three).isOk());
    CHECK(steps(tmp.path()) == std::vector<uint64_t>{7, 8, 5, 9, 3});
    auto newest = newestCheckpoint({tmp.path()}, "j", 1);
    REQUIRE(newest);
    CHECK(newest->step == 3);
    CHECK(newest->path == three);
    // Pruning removes the least recently written, whatever their steps.
    pruneCheckpoints(tmp.path(), "j", 1, 2);
    CHECK(steps(tmp.path()) == std::vector<uint64_t>{9, 3});
    CHECK_FALSE(markNewest(tmp.path() + "/missing.lwck").isOk());
  }

  TEST_CASE("newestCheckpoint looks in every directory") {
    TempDir a, b;
    auto at = [](const TempDir& d, uint64_t step, int64_t sec) {
      const std::string path = d.write("j.rank0.step" + std::to_string(step) + ".lwck", "");
      const timespec times[2] = {{sec, 0}, {sec, 0}};
      REQUIRE(::utimensat(AT_FDCWD, path.c_str(), times, 0) == 0);
    };
    CHECK_FALSE(newestCheckpoint({a.path(), b.path(), a.path() + "/none"}, "j", 0));
    at(a, 100, 10);
    at(b, 40, 20);  // a trainer checkpoint written after the periodic one of a later step
    auto n = newestCheckpoint({a.path(), b.path()}, "j", 0);
    REQUIRE(n);
    CHECK((n->step == 40 && n->path == b.path() + "/j.rank0.step40.lwck"));
    at(a, 200, 20);  // same time: the higher step
    n = newestCheckpoint({a.path(), b.path()}, "j", 0);
    REQUIRE(n);
    CHECK(n->step == 200);
    CHECK_FALSE(newestCheckpoint({a.path(), b.path()}, "j", 1));
  }
}

}  // namespace lightwire::policies
