#pragma once
// POSIX shared-memory regions registered by trainers (docs/api.md, POST /v1/buffers): the client
// creates and owns a segment, the sidecar maps it once and reads the gradient from it and writes
// the result into it, so no tensor bytes cross the socket.

#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
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
  /// Where byte `offset` of device memory lies for a step that reads and writes it in place on
  /// the GPU (docs/cuda.md "Steps on the GPU"): the CUDA device ordinal and the address in this
  /// process. nullopt for host memory.
  struct DeviceView {
    int ordinal = -1;
    uint64_t address = 0;
  };
  virtual std::optional<DeviceView> deviceAt(uint64_t /*offset*/) const { return std::nullopt; }
  /// Device memory: makes `stream` (a cudaStream_t of the region's GPU) wait, on the device, for
  /// the trainer's work that produced the bytes (its IPC event, if any). Host memory: nothing.
  virtual bool waitOn(void* /*stream*/, std::string* /*error*/) { return true; }
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
  /// The user id that owns the segment.
  unsigned uid() const { return uid_; }
  /// True while the segment still holds the mapped size. A client that shrinks its segment under
  /// a mapping would make an access fault (SIGBUS), so each step checks this before touching it.
  bool stillBacked() const override;

 private:
  ShmRegion(std::string name, int fd, std::byte* data, uint64_t size, unsigned uid)
      : name_(std::move(name)), fd_(fd), data_(data), size_(size), uid_(uid) {}
  std::string name_;
  int fd_ = -1;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  unsigned uid_ = 0;
};

/// The process that registered a buffer: its pid as the kernel reported it on the Unix socket
/// (SO_PEERCRED), and that process's start time, so a recycled pid is never mistaken for it.
/// pid 0 = unknown (a client over TCP, or in a PID namespace this process cannot see): such
/// buffers live until released, and count together as one client for the per-client limit.
struct BufferOwner {
  int pid = 0;
  uint64_t start_ticks = 0;  // field 22 of /proc/<pid>/stat (clock ticks after boot)
  /// The client's user id (SO_PEERCRED), -1 = unknown. A known, non-root client may only register
  /// segments it owns: the sidecar opens them with its own rights, and must not lend those to a
  /// client that could not open the segment itself.
  long uid = -1;

  /// The owner `pid` (0: unknown) as this process sees it now.
  static BufferOwner of(int pid);
  /// False once the process has exited (its pid gone, or reused by a later process). Unknown
  /// owners are always alive.
  bool alive() const;
};

/// The registered buffers of one sidecar, by id ("b<instance>-1", "b<instance>-2", ...: the
/// instance part is random per table, so a client that missed a sidecar restart cannot hit
/// another client's buffer with an old id). A step holds a shared_ptr to the region it uses, so
/// releasing a buffer during that step unmaps it only afterwards. Thread-safe.
class BufferTable {
 public:
  /// At most `max_buffers` in all and `max_per_owner` per owner (unknown owners together).
  explicit BufferTable(size_t max_buffers, size_t max_per_owner = SIZE_MAX);

  enum class AddError { kNone, kInvalid, kLimit, kOwnerLimit, kForbidden };
  /// Registers segment `name` of at least `size` bytes for `owner`; returns its id, or "" with
  /// `why` and a message in `error`.
  std::string add(const std::string& name, uint64_t size, const BufferOwner& owner, AddError* why,
                  std::string* error);
  /// Whether `owner` may register another buffer now (false: `why` and `error` say why).
  bool hasRoom(const BufferOwner& owner, AddError* why, std::string* error) const;
  /// Registers an opened region of any kind (CUDA IPC: ipc/cuda_ipc.h); "" and kLimit or
  /// kOwnerLimit when there is no room.
  std::string insert(std::shared_ptr<Region> region, const BufferOwner& owner, AddError* why,
                     std::string* error);
  /// Releases `id`; false when unknown.
  bool remove(const std::string& id);
  /// The region of `id`, or null.
  std::shared_ptr<Region> find(const std::string& id) const;
  size_t count() const;
  /// (id, name, size, kind, owner pid) of every buffer, ordered by id number.
  struct Listed {
    std::string id, name;
    uint64_t size;
    std::string kind;
    int pid = 0;
  };
  std::vector<Listed> list() const;
  /// Releases every buffer whose owner has exited (a trainer killed while holding them) and
  /// returns them. Reads /proc once per distinct owner; call it every second or so.
  std::vector<Listed> releaseExited();

 private:
  struct Entry {
    uint64_t ordinal;  // registration order, for list()
    std::shared_ptr<Region> region;
    BufferOwner owner;
  };
  bool hasRoomLocked(const BufferOwner& owner, AddError* why, std::string* error) const;
  Listed listed(const std::string& id, const Entry& e) const;
  const size_t max_buffers_, max_per_owner_;
  const std::string prefix_;  // "b<instance>-"
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  std::unordered_map<std::string, Entry> buffers_;
  std::unordered_map<int, size_t> per_owner_;  // buffers held per owner pid (0 = unknown)
};

}  // namespace lightwire::ipc
