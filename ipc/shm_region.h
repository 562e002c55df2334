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

/// A registered buffer a step reads its gradient from and writes its result into: host bytes at
/// data() (a shared-memory mapping, or the host staging of device memory). Thread-safe for
/// concurrent steps on disjoint ranges.
class Region {
 public:
  virtual ~Region() = default;
  virtual std::byte* data() const = 0;
  virtual uint64_t size() const = 0;
  virtual const std::string& name() const = 0;
  /// "shm" or "cuda_ipc" (the `kind` of POST /v1/buffers).
  virtual const char* kind() const = 0;
  /// False once the memory no longer holds the registered size (checked before each step).
  virtual bool stillBacked() const = 0;
  /// Device memory: copies bytes [offset, offset + bytes) from the device into data() before a
  /// step reads them, after the trainer's work that produced them (its IPC event, if any). Host
  /// memory: nothing to do. false and a message on failure.
  virtual bool fetch(uint64_t /*offset*/, uint64_t /*bytes*/, std::string* /*error*/) {
    return true;
  }
  /// Device memory: copies data()[offset, offset + bytes) back to the device once the step wrote
  /// its result there, complete before it returns (the reply tells the trainer the result is in
  /// place). Host memory: nothing to do.
  virtual bool store(uint64_t /*offset*/, uint64_t /*bytes*/, std::string* /*error*/) {
    return true;
  }
};

/// One mapped segment (read-write, MAP_SHARED). Immutable after open; the mapping lives as long
/// as the object. Thread-safe for concurrent readers of its fields.
class ShmRegion final : public Region {
 public:
  /// Maps the existing segment `name` (shm_open name: "/" then 1..254 characters, no other "/"),
  /// which must hold at least `size` bytes (size > 0). Never creates a segment. On failure returns
  /// null and a message for the client in `error`.
  static std::unique_ptr<ShmRegion> open(const std::string& name, uint64_t size,
                                         std::string* error);
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  std::byte* data() const override { return data_; }
  uint64_t size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const char* kind() const override { return "shm"; }
  /// True while the segment still holds the mapped size. A client that shrinks its segment under
  /// a mapping would make an access fault (SIGBUS), so each step checks this before touching it.
  bool stillBacked() const override;

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
  /// Whether another buffer may be registered now (false: `error` says why, AddError::kLimit).
  bool hasRoom(std::string* error) const;
  /// Registers an opened region of any kind (CUDA IPC: ipc/cuda_ipc.h); "" and kLimit when the
  /// table is full.
  std::string insert(std::shared_ptr<Region> region, AddError* why, std::string* error);
  /// Releases `id`; false when unknown.
  bool remove(const std::string& id);
  /// The region of `id`, or null.
  std::shared_ptr<Region> find(const std::string& id) const;
  size_t count() const;
  /// (id, name, size, kind) of every buffer, ordered by id number.
  struct Listed {
    std::string id, name;
    uint64_t size;
    std::string kind;
  };
  std::vector<Listed> list() const;

 private:
  struct Entry {
    uint64_t ordinal;  // registration order, for list()
    std::shared_ptr<Region> region;
  };
  const size_t max_buffers_;
  const std::string prefix_;  // "b<instance>-"
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  std::unordered_map<std::string, Entry> buffers_;
};

}  // namespace lightwire::ipc
