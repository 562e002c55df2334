#include "ipc/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

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
  return std::unique_ptr<ShmRegion>(new ShmRegion(name, fd, static_cast<std::byte*>(p), size));
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

BufferTable::BufferTable(size_t max_buffers)
    : max_buffers_(max_buffers), prefix_(instancePrefix()) {}

bool BufferTable::hasRoom(std::string* error) const {
  std::lock_guard lock(mu_);
  if (buffers_.size() < max_buffers_) return true;
  *error = "at most " + std::to_string(max_buffers_) +
           " buffers may be registered (limits.max_buffers); release one first";
  return false;
}

std::string BufferTable::add(const std::string& name, uint64_t size, AddError* why,
                             std::string* error) {
  if (!hasRoom(error)) {
    *why = AddError::kLimit;
    return "";
  }
  auto region = ShmRegion::open(name, size, error);  // outside the lock: a system call
  if (!region) {
    *why = AddError::kInvalid;
    return "";
  }
  return insert(std::shared_ptr<Region>(std::move(region)), why, error);
}

std::string BufferTable::insert(std::shared_ptr<Region> region, AddError* why, std::string* error) {
  std::lock_guard lock(mu_);
  if (buffers_.size() >= max_buffers_) {  // another registration won the race
    *why = AddError::kLimit;
    *error = "at most " + std::to_string(max_buffers_) +
             " buffers may be registered (limits.max_buffers); release one first";
    return "";
  }
  const uint64_t ordinal = next_id_++;
  std::string id = prefix_ + std::to_string(ordinal);
  buffers_.emplace(id, Entry{ordinal, std::move(region)});
  *why = AddError::kNone;
  return id;
}

bool BufferTable::remove(const std::string& id) {
  std::shared_ptr<Region> released;  // unmapped (closed) after the lock is dropped
  std::lock_guard lock(mu_);
  auto it = buffers_.find(id);
  if (it == buffers_.end()) return false;
  released = std::move(it->second.region);
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

std::vector<BufferTable::Listed> BufferTable::list() const {
  std::vector<std::pair<uint64_t, Listed>> sorted;
  {
    std::lock_guard lock(mu_);
    for (const auto& [id, e] : buffers_) {
      sorted.push_back({e.ordinal, {id, e.region->name(), e.region->size(), e.region->kind()}});
    }
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<Listed> out;
  for (auto& [ordinal, l] : sorted) out.push_back(std::move(l));
  return out;
}

}  // namespace lightwire::ipc
