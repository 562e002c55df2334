// Shared-memory buffers (ipc/shm_region.h): opening segments a client created, the size and name
// checks, data shared both ways, shrinking under a mapping, and the BufferTable registry.
#include <doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <set>
#include <string>

#include "ipc/shm_region.h"

using namespace lightwire::ipc;

namespace {

const BufferOwner kTcp{};  // an owner that is not known (a client over TCP)

/// A segment created with shm_open + ftruncate, unlinked at the end of the test.
class TestSegment {
 public:
  explicit TestSegment(size_t size) {
    static std::atomic<int> counter{0};
    name_ = "/lw-shm-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    fd_ = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    REQUIRE(fd_ >= 0);
    REQUIRE(::ftruncate(fd_, static_cast<off_t>(size)) == 0);
  }
  ~TestSegment() {
    ::close(fd_);
    ::shm_unlink(name_.c_str());
  }
  const std::string& name() const { return name_; }
  int fd() const { return fd_; }

 private:
  std::string name_;
  int fd_ = -1;
};

}  // namespace

TEST_CASE("ShmRegion opens an existing segment and shares its bytes both ways") {
  TestSegment seg(4096);
  std::string error;
  auto region = ShmRegion::open(seg.name(), 4096, &error);
  REQUIRE_MESSAGE(region != nullptr, error);
  CHECK(region->size() == 4096);
  CHECK(region->name() == seg.name());
  CHECK(region->stillBacked());

  void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, seg.fd(), 0);
  REQUIRE(p != MAP_FAILED);
  auto* other = static_cast<unsigned char*>(p);
  other[0] = 0xAB;
  other[4095] = 0xCD;
  CHECK(static_cast<unsigned char>(region->data()[0]) == 0xAB);
  CHECK(static_cast<unsigned char>(region->data()[4095]) == 0xCD);
  region->data()[100] = std::byte{0x5A};
  CHECK(other[100] == 0x5A);
  ::munmap(p, 4096);
}

TEST_CASE("ShmRegion maps a prefix of a larger segment") {
  TestSegment seg(8192);
  std::string error;
  auto region = ShmRegion::open(seg.name(), 100, &error);
  REQUIRE_MESSAGE(region != nullptr, error);
  CHECK(region->size() == 100);
  CHECK(region->stillBacked());
}

TEST_CASE("ShmRegion refuses a segment smaller than the registered size, naming both sizes") {
  TestSegment seg(1000);
  std::string error;
  CHECK(ShmRegion::open(seg.name(), 1001, &error) == nullptr);
  CHECK(error.find("1000") != std::string::npos);
  CHECK(error.find("1001") != std::string::npos);
}

TEST_CASE("ShmRegion refuses size 0 and a segment that does not exist") {
  TestSegment seg(64);
  std::string error;
  CHECK(ShmRegion::open(seg.name(), 0, &error) == nullptr);
  CHECK(!error.empty());
  error.clear();
  const std::string missing = "/lw-shm-test-missing-" + std::to_string(::getpid());
  CHECK(ShmRegion::open(missing, 64, &error) == nullptr);
  CHECK(error.find(missing) != std::string::npos);
}

TEST_CASE("ShmRegion refuses bad names without touching the system") {
  for (const std::string& name :
       {std::string(), std::string("x"), std::string("/"), std::string("/a/b"),
        std::string("no-slash"), std::string("/ctl\x01"), "/" + std::string(299, 'a')}) {
    CAPTURE(name.size());
    std::string error;
    CHECK(ShmRegion::open(name, 64, &error) == nullptr);
    CHECK(!error.empty());
  }
  // The longest allowed name passes the name check (and fails only because it does not exist).
  std::string error;
  CHECK(ShmRegion::open("/" + std::string(254, 'z'), 64, &error) == nullptr);
  CHECK(error.find("must be '/'") == std::string::npos);
}

TEST_CASE("ShmRegion::stillBacked turns false when the creator shrinks the segment") {
  TestSegment seg(8192);
  std::string error;
  auto region = ShmRegion::open(seg.name(), 8192, &error);
  REQUIRE_MESSAGE(region != nullptr, error);
  CHECK(region->stillBacked());
  REQUIRE(::ftruncate(seg.fd(), 4096) == 0);
  CHECK_FALSE(region->stillBacked());
  REQUIRE(::ftruncate(seg.fd(), 8192) == 0);
  CHECK(region->stillBacked());
}

TEST_CASE("BufferTable registers, finds, lists and releases buffers") {
  TestSegment a(4096), b(8192);
  BufferTable table(8);
  BufferTable::AddError why = BufferTable::AddError::kInvalid;
  std::string error;
  const std::string ida = table.add(a.name(), 4096, kTcp, &why, &error);
  REQUIRE_MESSAGE(!ida.empty(), error);
  CHECK(why == BufferTable::AddError::kNone);
  const std::string idb = table.add(b.name(), 8000, kTcp, &why, &error);
  REQUIRE_MESSAGE(!idb.empty(), error);
  CHECK(ida != idb);
  CHECK(table.count() == 2);

  auto ra = table.find(ida);
  REQUIRE(ra != nullptr);
  CHECK(ra->name() == a.name());
  CHECK(ra->size() == 4096);
  CHECK(table.find("b999") == nullptr);
  CHECK(table.find("") == nullptr);

  const auto listed = table.list();
  REQUIRE(listed.size() == 2);
  CHECK(listed[0].id == ida);
  CHECK(listed[0].name == a.name());
  CHECK(listed[1].id == idb);
  CHECK(listed[1].size == 8000);

  CHECK(table.remove(ida));
  CHECK_FALSE(table.remove(ida));
  CHECK(table.find(ida) == nullptr);
  CHECK(table.count() == 1);
  // A region held by a step stays mapped after its release.
  ra->data()[0] = std::byte{1};
  CHECK(ra->data()[0] == std::byte{1});
}

TEST_CASE("BufferTable reports invalid segments and never reuses ids") {
  TestSegment a(64);
  BufferTable table(4);
  BufferTable::AddError why = BufferTable::AddError::kNone;
  std::string error;
  CHECK(table.add(a.name(), 65, kTcp, &why, &error).empty());
  CHECK(why == BufferTable::AddError::kInvalid);
  CHECK(!error.empty());
  CHECK(table.add("bad", 64, kTcp, &why, &error).empty());
  CHECK(why == BufferTable::AddError::kInvalid);
  CHECK(table.count() == 0);

  std::set<std::string> ids;
  for (int i = 0; i < 10; ++i) {
    const std::string id = table.add(a.name(), 64, kTcp, &why, &error);
    REQUIRE_MESSAGE(!id.empty(), error);
    CHECK(ids.insert(id).second);
    CHECK(table.remove(id));
  }
}

TEST_CASE("BufferTable refuses registrations past max_buffers with kLimit") {
  TestSegment a(64);
  BufferTable table(3);
  BufferTable::AddError why{};
  std::string error;
  std::set<std::string> ids;
  for (int i = 0; i < 3; ++i) {
    const std::string id = table.add(a.name(), 64, kTcp, &why, &error);
    REQUIRE_MESSAGE(!id.empty(), error);
    ids.insert(id);
  }
  CHECK(ids.size() == 3);
  error.clear();
  CHECK(table.add(a.name(), 64, kTcp, &why, &error).empty());
  CHECK(why == BufferTable::AddError::kLimit);
  CHECK(error.find("3") != std::string::npos);
  CHECK(table.count() == 3);
  CHECK(table.remove(*ids.begin()));
  CHECK_FALSE(table.add(a.name(), 64, kTcp, &why, &error).empty());
  CHECK(why == BufferTable::AddError::kNone);
  // More than 9 ids: list() orders by registration, not text ("...-10" after "...-9").
  BufferTable big(20);
  std::vector<std::string> added;
  for (int i = 0; i < 12; ++i) added.push_back(big.add(a.name(), 64, kTcp, &why, &error));
  const auto listed = big.list();
  REQUIRE(listed.size() == 12);
  for (size_t i = 0; i < added.size(); ++i) CHECK(listed[i].id == added[i]);
  CHECK(listed[9].id.ends_with("-10"));
  // Another table (a restarted sidecar) hands out different ids.
  BufferTable other(20);
  const std::string first_other = other.add(a.name(), 64, kTcp, &why, &error);
  CHECK(first_other.ends_with("-1"));
  CHECK(first_other != added[0]);
}

TEST_CASE("BufferTable limits the buffers one owner holds; unknown owners count as one") {
  TestSegment a(64);
  BufferTable table(10, 2);
  BufferTable::AddError why{};
  std::string error;
  const BufferOwner self = BufferOwner::of(::getpid());
  REQUIRE(self.pid == ::getpid());
  CHECK(self.start_ticks > 0);
  const std::string first = table.add(a.name(), 64, self, &why, &error);
  REQUIRE_MESSAGE(!first.empty(), error);
  CHECK_FALSE(table.add(a.name(), 64, self, &why, &error).empty());
  CHECK(table.add(a.name(), 64, self, &why, &error).empty());
  CHECK(why == BufferTable::AddError::kOwnerLimit);
  CHECK(error.find("limits.max_buffers_per_client") != std::string::npos);
  CHECK_FALSE(table.hasRoom(self, &why, &error));
  // Another owner still has room; releasing one of ours makes room again.
  CHECK(table.hasRoom(kTcp, &why, &error));
  CHECK_FALSE(table.add(a.name(), 64, kTcp, &why, &error).empty());
  CHECK_FALSE(table.add(a.name(), 64, kTcp, &why, &error).empty());
  CHECK(table.add(a.name(), 64, kTcp, &why, &error).empty());
  CHECK(why == BufferTable::AddError::kOwnerLimit);
  CHECK(table.remove(first));
  CHECK(table.hasRoom(self, &why, &error));
  const auto listed = table.list();
  REQUIRE(listed.size() == 3);
  CHECK(listed[0].pid == ::getpid());
  CHECK(listed[1].pid == 0);
}

TEST_CASE("BufferTable releases the buffers of an owner that exited, and only those") {
  TestSegment a(64);
  BufferTable table(10);
  BufferTable::AddError why{};
  std::string error;
  // A real child process that registers nothing itself: its pid owns two buffers here.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  const BufferOwner owner = BufferOwner::of(child);
  REQUIRE(owner.pid == child);
  CHECK(owner.alive());
  const std::string mine = table.add(a.name(), 64, BufferOwner::of(::getpid()), &why, &error);
  const std::string theirs1 = table.add(a.name(), 64, owner, &why, &error);
  const std::string theirs2 = table.add(a.name(), 64, owner, &why, &error);
  const std::string unknown = table.add(a.name(), 64, kTcp, &why, &error);
  REQUIRE(!mine.empty());
  REQUIRE(!theirs2.empty());
  auto held = table.find(theirs1);       // a step in progress keeps its region mapped
  CHECK(table.releaseExited().empty());  // everyone alive
  ::kill(child, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK_FALSE(owner.alive());
  const auto released = table.releaseExited();
  REQUIRE(released.size() == 2);
  std::set<std::string> ids{released[0].id, released[1].id};
  CHECK(ids == std::set<std::string>{theirs1, theirs2});
  CHECK(released[0].pid == child);
  CHECK(table.count() == 2);
  CHECK(table.find(mine) != nullptr);
  CHECK(table.find(unknown) != nullptr);
  CHECK(table.find(theirs1) == nullptr);
  held->data()[0] = std::byte{7};  // still mapped until the step lets go
  CHECK(table.releaseExited().empty());
  // A recycled pid is not the owner: same pid, another start time.
  BufferOwner recycled = BufferOwner::of(::getpid());
  recycled.start_ticks += 1;
  CHECK_FALSE(recycled.alive());
  CHECK(BufferOwner::of(0).alive());
  CHECK(BufferOwner::of(-5).pid == 0);
}
