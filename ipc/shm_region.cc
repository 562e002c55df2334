#include "ipc/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

namespace lightwire::ipc {
namespace {

constexpr size_t kMaxNameBytes = 255;

bool validName(const std::string& name, std::string* error) {
  if (name.size() < 2 || name.size() > kMaxNameBytes || name[0] != '/') {
    *error = "shared-memory name must be '/' followed by 1 to 254 characters";
    return false;
  }
  for (size_t i = 1; i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (c == '/' || c < 0x20 || c == 0x7F) {
      *error =
          "shared-memory name may not contain '/' after the first character or control "
          "characters";
      return false;
    }
  }
  return true;
}

}  // namespace

std::unique_ptr<ShmRegion> ShmRegion::open(const std::string& name, uint64_t size,
                                           std::string* error) {
  if (!validName(name, error)) return nullptr;
  if (size == 0) {
    *error = "buffer size must be at least 1 byte";
    return nullptr;
  }
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    *error = "cannot open shared-memory segment '" + name + "': " + std::strerror(errno);
    return nullptr;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    *error = "cannot stat shared-memory segment '" + name + "': " + std::strerror(errno);
    ::close(fd);
    return nullptr;
  }
  if (static_cast<uint64_t>(st.st_size) < size) {
    *error = "shared-memory segment '" + name + "' holds " + std::to_string(st.st_size) +
             " bytes, fewer than the " + std::to_string(size) + " registered";
    ::close(fd);
    return nullptr;
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *error = "cannot map shared-memory segment '" + name + "': " + std::strerror(errno);
    ::close(fd);
    return nullptr;
  }
  return std::unique_ptr<ShmRegion>(
      new ShmRegion(name, fd, static_cast<std::byte*>(p), size, static_cast<unsigned>(st.st_uid)));
}

ShmRegion::~ShmRegion() {
  if (data_ != nullptr) ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
}

bool ShmRegion::stillBacked() const {
  struct stat st {};
  return ::fstat(fd_, &st) == 0 && static_cast<uint64_t>(st.st_size) >= size_;
}

namespace {

std::string instancePrefix() {
  std::random_device rd;
  char buf[16];
  std::snprintf(buf, sizeof buf, "b%06x-", static_cast<unsigned>(rd()) & 0xFFFFFFu);
  return buf;
}

}  // namespace

BufferOwner BufferOwner::of(int pid) {
  BufferOwner o;
  if (pid <= 0) return o;
  // /proc/<pid>/stat: "pid (comm) state ppid ..." with the start time as field 22; comm may hold
  // spaces and parentheses, so fields are counted after the last ')'.
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return o;  // not visible from here: unknown owner
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return o;
  std::istringstream fields(line.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i == 22) {
      o.pid = pid;
      o.start_ticks = std::strtoull(field.c_str(), nullptr, 10);
    }
  }
  return o;
}

bool BufferOwner::alive() const {
  if (pid <= 0) return true;
  const BufferOwner now = of(pid);
  return now.pid == pid && now.start_ticks == start_ticks;
}

BufferTable::BufferTable(size_t max_buffers, size_t max_per_owner)
    : max_buffers_(max_buffers), max_per_owner_(max_per_owner), prefix_(instancePrefix()) {}

bool BufferTable::hasRoomLocked(const BufferOwner& owner, AddError* why, std::string* error) const {
  if (buffers_.size() >= max_buffers_) {
    *why = AddError::kLimit;
    *error = "at most " + std::to_string(max_buffers_) +
             " buffers may be registered (limits.max_buffers); release one first";
    return false;
  }
  const auto it = per_owner_.find(owner.pid);
  if (it != per_owner_.end() && it->second >= max_per_owner_) {
    *why = AddError::kOwnerLimit;
    *error = "this client holds " + std::to_string(it->second) +
             " registered buffers already, the most one client may hold "
             "(limits.max_buffers_per_client); release one first";
    return false;
  }
  return true;
}

bool BufferTable::hasRoom(const BufferOwner& owner, AddError* why, std::string* error) const {
  std::lock_guard lock(mu_);
  return hasRoomLocked(owner, why, error);
}

std::string BufferTable::add(const std::string& name, uint64_t size, const BufferOwner& owner,
                             AddError* why, std::string* error) {
  if (!hasRoom(owner, why, error)) return "";
  auto region = ShmRegion::open(name, size, error);  // outside the lock: a system call
  if (!region) {
    *why = AddError::kInvalid;
    return "";
  }
  if (owner.uid > 0 && static_cast<long>(region->uid()) != owner.uid) {
    *why = AddError::kForbidden;
    *error = "shared-memory segment '" + name + "' belongs to user " +
             std::to_string(region->uid()) + ", not to the registering client (user " +
             std::to_string(owner.uid) + ")";
    return "";
  }
  return insert(std::shared_ptr<Region>(std::move(region)), owner, why, error);
}

std::string BufferTable::insert(std::shared_ptr<Region> region, const BufferOwner& owner,
                                AddError* why, std::string* error) {
  std::lock_guard lock(mu_);
  if (!hasRoomLocked(owner, why, error)) return "";  // another registration won the race
  const uint64_t ordinal = next_id_++;
  std::string id = prefix_ + std::to_string(ordinal);
  buffers_.emplace(id, Entry{ordinal, std::move(region), owner});
  ++per_owner_[owner.pid];
  *why = AddError::kNone;
  return id;
}

bool BufferTable::remove(const std::string& id) {
  std::shared_ptr<Region> released;  // unmapped (closed) after the lock is dropped
  std::lock_guard lock(mu_);
  auto it = buffers_.find(id);
  if (it == buffers_.end()) return false;
  released = std::move(it->second.region);
  if (auto o = per_owner_.find(it->second.owner.pid); o != per_owner_.end() && --o->second == 0) {
    per_owner_.erase(o);
  }
  buffers_.erase(it);
  return true;
}

std::shared_ptr<Region> BufferTable::find(const std::string& id) const {
  std::lock_guard lock(mu_);
  auto it = buffers_.find(id);
  return it == buffers_.end() ? nullptr : it->second.region;
}

size_t BufferTable::count() const {
  std::lock_guard lock(mu_);
  return buffers_.size();
}

BufferTable::Listed BufferTable::listed(const std::string& id, const Entry& e) const {
  return {id, e.region->name(), e.region->size(), e.region->kind(), e.owner.pid};
}

std::vector<BufferTable::Listed> BufferTable::list() const {
  std::vector<std::pair<uint64_t, Listed>> sorted;
  {
    std::lock_guard lock(mu_);
    for (const auto& [id, e] : buffers_) sorted.push_back({e.ordinal, listed(id, e)});
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<Listed> out;
  for (auto& [ordinal, l] : sorted) out.push_back(std::move(l));
  return out;
}

std::vector<BufferTable::Listed> BufferTable::releaseExited() {
  // The owners to check, read outside the lock (one /proc read each).
  std::vector<BufferOwner> owners;
  {
    std::lock_guard lock(mu_);
    for (const auto& entry : buffers_) {
      const Entry& e = entry.second;  // not a structured binding: clang 14 cannot capture one
      if (e.owner.pid > 0 && std::none_of(owners.begin(), owners.end(), [&](const BufferOwner& o) {
            return o.pid == e.owner.pid && o.start_ticks == e.owner.start_ticks;
          })) {
        owners.push_back(e.owner);
      }
    }
  }
  std::erase_if(owners, [](const BufferOwner& o) { return o.alive(); });
  std::vector<Listed> out;
  if (owners.empty()) return out;
  std::vector<std::string> ids;
  {
    std::lock_guard lock(mu_);
    for (const auto& [id, e] : buffers_) {
      for (const auto& o : owners) {
        if (e.owner.pid == o.pid && e.owner.start_ticks == o.start_ticks) {
          out.push_back(listed(id, e));
          ids.push_back(id);
        }
      }
    }
  }
  for (const auto& id : ids) remove(id);  // a release in between just finds it gone
  return out;
}

}  // namespace lightwire::ipc
