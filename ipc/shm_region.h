#pragma once
// POSIX shared-memory regions registered by trainers (docs/api.md, POST /v1/buffers): the client
// creates and owns a segment, the sidecar maps it once and reads the gradient from it and writes
// the result into it, so no tensor bytes cross the socket.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace lightwire::ipc {

/// One mapped segment (read-write, MAP_SHARED). Immutable after open; the mapping lives as long
/// as the object. Thread-safe for concurrent readers of its fields.
class ShmRegion {
 public:
  /// Maps the existing segment `name` (shm_open name: "/" then 1..254 characters, no other "/"),
  /// which must hold at least `size` bytes (size > 0). Never creates a segment. On failure returns
  /// null and a message for the client in `error`.
  static std::unique_ptr<ShmRegion> open(const std::string& name, uint64_t size,
                                         std::string* error);
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  /// True while the segment still holds the mapped size. A client that shrinks its segment under
  /// a mapping would make an access fault (SIGBUS), so each step checks this before touching it.
  bool stillBacked() const;

 private:
  ShmRegion(std::string name, int fd, std::byte* data, uint64_t size)
      : name_(std::move(name)), fd_(fd), data_(data), size_(size) {}
  std::string name_;
  int fd_ = -1;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

/// The registered buffers of one sidecar, by id ("b<instance>-1", "b<instance>-2", ...: the
/// instance part is random per table, so a client that missed a sidecar restart cannot hit
/// another client's buffer with an old id). A step holds a shared_ptr to the region it uses, so
/// releasing a buffer during that step unmaps it only afterwards. Thread-safe.
class BufferTable {
 public:
  explicit BufferTable(size_t max_buffers);

  enum class AddError { kNone, kInvalid, kLimit };
  /// Registers segment `name` of at least `size` bytes; returns its id, or "" with `why` and a
  /// message in `error`.
  std::string add(const std::string& name, uint64_t size, AddError* why, std::string* error);
  /// Releases `id`; false when unknown.
  bool remove(const std::string& id);
  /// The region of `id`, or null.
  std::shared_ptr<ShmRegion> find(const std::string& id) const;
  size_t count() const;
  /// (id, name, size) of every buffer, ordered by id number.
  struct Listed {
    std::string id, name;
    uint64_t size;
  };
  std::vector<Listed> list() const;

 private:
  struct Entry {
    uint64_t ordinal;  // registration order, for list()
    std::shared_ptr<ShmRegion> region;
  };
  const size_t max_buffers_;
  const std::string prefix_;  // "b<instance>-"
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  std::unordered_map<std::string, Entry> buffers_;
};

}  // namespace lightwire::ipc
