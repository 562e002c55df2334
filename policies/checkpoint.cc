#include "policies/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cassert>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string_view>
#include <unordered_set>

#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include "kernels/dtype.h"

namespace lightwire::policies {
namespace {

constexpr std::array<uint8_t, 4> kCheckpointMagic = {'L', 'W', 'C', 'K'};
constexpr size_t kHeaderBytes = 4 + 4 + 8;  // magic | version | body length
constexpr size_t kTrailerBytes = 8;         // XXH3-64 of the body

// Field limits (policies/checkpoint.h).
constexpr size_t kMaxJobId = 65535;
constexpr size_t kMaxReason = 255;
constexpr size_t kMaxName = 1024;
constexpr size_t kMaxCodecKey = 4096;
constexpr size_t kMaxPolicyJson = size_t{64} << 20;
constexpr uint8_t kMaxDType = static_cast<uint8_t>(kernels::DType::kBF16);
// The fixed-size fields of one tensor plus its shortest name (1 byte): name length, name, codec
// key length, elements, dtype, last committed step, state count, accumulator count.
constexpr size_t kMinTensorBytes = 2 + 1 + 2 + 8 + 1 + 8 + 8 + 8;

std::string errnoText(int err) { return std::strerror(err); }

// ---- serialisation ------------------------------------------------------------------------------

/// Appends to a byte vector.
class VectorSink {
 public:
  explicit VectorSink(std::vector<uint8_t>& out) : out_(out) {}
  void put(const uint8_t* p, size_t n) { out_.insert(out_.end(), p, p + n); }

 private:
  std::vector<uint8_t>& out_;
};

/// Writes to a file descriptor through a buffer, hashing what it writes while `hashing` is set.
/// The first error sticks; later writes are no-ops.
class FileSink {
 public:
  explicit FileSink(int fd) : fd_(fd), buf_(kBufBytes), state_(XXH3_createState()) {
    if (state_ == nullptr) {
      err_ = ENOMEM;
    } else {
      XXH3_64bits_reset(state_.get());
    }
  }
  void put(const uint8_t* p, size_t n) {
    if (err_ != 0) return;
    if (hashing_) XXH3_64bits_update(state_.get(), p, n);
    while (n > 0) {
      const size_t take = std::min(n, buf_.size() - used_);
      std::memcpy(buf_.data() + used_, p, take);
      used_ += take;
      p += take;
      n -= take;
      if (used_ == buf_.size()) flush();
    }
  }
  void setHashing(bool on) { hashing_ = on; }
  uint64_t digest() const { return XXH3_64bits_digest(state_.get()); }
  /// Writes what is buffered; returns 0 or the errno of the first failure.
  int flush() {
    size_t done = 0;
    while (err_ == 0 && done < used_) {
      const ssize_t w = ::write(fd_, buf_.data() + done, used_ - done);
      if (w < 0) {
        if (errno != EINTR) err_ = errno;
      } else if (w == 0) {
        err_ = EIO;
      } else {
        done += static_cast<size_t>(w);
      }
    }
    used_ = 0;
    return err_;
  }
  int error() const { return err_; }

 private:
  struct StateFree {
    void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
  };
  static constexpr size_t kBufBytes = size_t{1} << 20;
  int fd_;
  std::vector<uint8_t> buf_;
  size_t used_ = 0;
  std::unique_ptr<XXH3_state_t, StateFree> state_;
  bool hashing_ = false;
  int err_ = 0;
};

template <typename Sink>
void putLE(Sink& s, uint64_t v, size_t bytes) {
  std::array<uint8_t, 8> b{};
  for (size_t i = 0; i < bytes; ++i) b[i] = static_cast<uint8_t>(v >> (8 * i));
  s.put(b.data(), bytes);
}
template <typename Sink>
void putU8(Sink& s, uint8_t v) {
  putLE(s, v, 1);
}
template <typename Sink>
void putU16(Sink& s, uint16_t v) {
  putLE(s, v, 2);
}
template <typename Sink>
void putU32(Sink& s, uint32_t v) {
  putLE(s, v, 4);
}
template <typename Sink>
void putU64(Sink& s, uint64_t v) {
  putLE(s, v, 8);
}
template <typename Sink>
void putBytes(Sink& s, const std::string& str) {
  s.put(reinterpret_cast<const uint8_t*>(str.data()), str.size());
}
/// u64 count, then each float's IEEE-754 bits, little-endian.
template <typename Sink>
void putFloats(Sink& s, const std::vector<float>& v) {
  putU64(s, v.size());
  constexpr size_t kBatch = 4096;
  std::array<uint8_t, kBatch * 4> b;
  for (size_t i = 0; i < v.size(); i += kBatch) {
    const size_t n = std::min(kBatch, v.size() - i);
    for (size_t j = 0; j < n; ++j) {
      const uint32_t u = std::bit_cast<uint32_t>(v[i + j]);
      b[4 * j] = static_cast<uint8_t>(u);
      b[4 * j + 1] = static_cast<uint8_t>(u >> 8);
      b[4 * j + 2] = static_cast<uint8_t>(u >> 16);
      b[4 * j + 3] = static_cast<uint8_t>(u >> 24);
    }
    s.put(b.data(), 4 * n);
  }
}

uint64_t bodyBytes(const Checkpoint& c) {
  uint64_t n = 2 + c.job_id.size() + 4 + 4 + 8 + 1 + c.reason.size() + 4 + c.policy_json.size() + 4;
  for (const CheckpointTensor& t : c.tensors) {
    n += 2 + t.name.size() + 2 + t.codec_key.size() + 8 + 1 + 8;
    n += 8 + 4 * uint64_t{t.state.size()} + 8 + 4 * uint64_t{t.accumulator.size()};
  }
  return n;
}

template <typename Sink>
void putHeader(Sink& s, uint64_t body_bytes) {
  s.put(kCheckpointMagic.data(), kCheckpointMagic.size());
  putU32(s, kCheckpointVersion);
  putU64(s, body_bytes);
}

template <typename Sink>
void putBody(Sink& s, const Checkpoint& c) {
  putU16(s, static_cast<uint16_t>(c.job_id.size()));
  putBytes(s, c.job_id);
  putU32(s, c.world_size);
  putU32(s, c.rank);
  putU64(s, c.step);
  putU8(s, static_cast<uint8_t>(c.reason.size()));
  putBytes(s, c.reason);
  putU32(s, static_cast<uint32_t>(c.policy_json.size()));
  putBytes(s, c.policy_json);
  putU32(s, static_cast<uint32_t>(c.tensors.size()));
  for (const CheckpointTensor& t : c.tensors) {
    putU16(s, static_cast<uint16_t>(t.name.size()));
    putBytes(s, t.name);
    putU16(s, static_cast<uint16_t>(t.codec_key.size()));
    putBytes(s, t.codec_key);
    putU64(s, t.elements);
    putU8(s, t.dtype);
    putU64(s, t.last_committed);
    putFloats(s, t.state);
    putFloats(s, t.accumulator);
  }
}

/// The writer's checks: everything a reader would refuse is refused before anything is written.
Status validate(const Checkpoint& c) {
  if (c.job_id.empty() || c.job_id.size() > kMaxJobId) {
    return invalidArgument(
        fmt::format("checkpoint: job id of {} bytes (1..{} allowed)", c.job_id.size(), kMaxJobId));
  }
  if (c.world_size == 0) return invalidArgument("checkpoint: world size 0");
  if (c.rank >= c.world_size) {
    return invalidArgument(
        fmt::format("checkpoint: rank {} is not below the world size {}", c.rank, c.world_size));
  }
  if (c.reason.size() > kMaxReason) {
    return invalidArgument(fmt::format("checkpoint: reason of {} bytes (at most {} allowed)",
                                       c.reason.size(), kMaxReason));
  }
  if (c.policy_json.size() > kMaxPolicyJson) {
    return invalidArgument(fmt::format("checkpoint: policy state of {} bytes (at most {} allowed)",
                                       c.policy_json.size(), kMaxPolicyJson));
  }
  if (c.tensors.size() > std::numeric_limits<uint32_t>::max()) {
    return invalidArgument(fmt::format("checkpoint: {} tensors", c.tensors.size()));
  }
  std::unordered_set<std::string_view> names;
  names.reserve(c.tensors.size());
  for (const CheckpointTensor& t : c.tensors) {
    if (t.name.empty() || t.name.size() > kMaxName) {
      return invalidArgument(fmt::format("checkpoint: tensor name of {} bytes (1..{} allowed)",
                                         t.name.size(), kMaxName));
    }
    if (!names.insert(t.name).second) {
      return invalidArgument(fmt::format("checkpoint: tensor '{}' appears twice", t.name));
    }
    if (t.codec_key.size() > kMaxCodecKey) {
      return invalidArgument(
          fmt::format("checkpoint: tensor '{}': codec key of {} bytes (at most {} allowed)", t.name,
                      t.codec_key.size(), kMaxCodecKey));
    }
    if (t.dtype > kMaxDType) {
      return invalidArgument(
          fmt::format("checkpoint: tensor '{}': unknown dtype {}", t.name, int{t.dtype}));
    }
    for (const auto* v : {&t.state, &t.accumulator}) {
      const auto bad =
          std::find_if(v->begin(), v->end(), [](float f) { return !std::isfinite(f); });
      if (bad != v->end()) {
        return invalidArgument(fmt::format("checkpoint: tensor '{}': {} value {} is {}", t.name,
                                           v == &t.state ? "state" : "accumulator",
                                           bad - v->begin(), *bad));
      }
    }
  }
  return Status::ok();
}

// ---- parsing ------------------------------------------------------------------------------------

/// Reads little-endian fields from the body; never reads past its end.
class Cursor {
 public:
  explicit Cursor(std::span<const uint8_t> b) : p_(b.data()), left_(b.size()) {}
  size_t left() const { return left_; }
  /// Reads an unsigned integer of `bytes` bytes; false when fewer are left.
  bool uint(size_t bytes, uint64_t& v) {
    if (left_ < bytes) return false;
    v = 0;
    for (size_t i = 0; i < bytes; ++i) v |= uint64_t{p_[i]} << (8 * i);
    skip(bytes);
    return true;
  }
  const uint8_t* data() const { return p_; }
  void skip(size_t n) {
    p_ += n;
    left_ -= n;
  }

 private:
  const uint8_t* p_;
  size_t left_;
};

Status truncated(std::string_view what, uint64_t need, size_t left) {
  return dataLoss(
      fmt::format("truncated: {} needs {} bytes, {} left in the body", what, need, left));
}

Status readUint(Cursor& cur, size_t bytes, uint64_t& v, std::string_view what) {
  if (!cur.uint(bytes, v)) return truncated(what, bytes, cur.left());
  return Status::ok();
}

/// A u<len_bytes> length, then that many bytes, within [min, max].
Status readString(Cursor& cur, size_t len_bytes, size_t min, size_t max, std::string_view what,
                  std::string_view& out) {
  uint64_t n = 0;
  LW_RETURN_IF_ERROR(readUint(cur, len_bytes, n, fmt::format("the length of {}", what)));
  if (n < min || n > max) {
    return dataLoss(fmt::format("{} of {} bytes ({}..{} allowed)", what, n, min, max));
  }
  if (n > cur.left()) return truncated(what, n, cur.left());
  out = std::string_view(reinterpret_cast<const char*>(cur.data()), n);
  cur.skip(n);
  return Status::ok();
}

/// A u64 count, then that many floats, all finite; copied into `out` when it is not null.
Status readFloats(Cursor& cur, std::string_view what, std::vector<float>* out) {
  uint64_t n = 0;
  LW_RETURN_IF_ERROR(readUint(cur, 8, n, fmt::format("the count of {}", what)));
  if (n > cur.left() / 4) {  // n * 4 cannot overflow past this check
    return dataLoss(fmt::format("truncated: {} declares {} floats, {} bytes left in the body", what,
                                n, cur.left()));
  }
  if (out != nullptr) out->resize(n);
  const uint8_t* p = cur.data();
  for (uint64_t i = 0; i < n; ++i, p += 4) {
    const uint32_t u =
        uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
    const float f = std::bit_cast<float>(u);
    if (!std::isfinite(f)) {
      return dataLoss(fmt::format("{}: value {} is {} (a corrupted file)", what, i, f));
    }
    if (out != nullptr) (*out)[i] = f;
  }
  cur.skip(n * 4);
  return Status::ok();
}

/// Checks the body (its checksum already verified) and reads it into `c`: the job, world size,
/// rank, step and reason always, the policy state and the tensors only when `copy` is set. With
/// `copy` unset nothing is allocated but the job id, the reason and the set of tensor names.
Status parseBody(std::span<const uint8_t> body, Checkpoint& c, bool copy) {
  Cursor cur(body);
  std::string_view s;
  uint64_t v = 0;

  LW_RETURN_IF_ERROR(readString(cur, 2, 1, kMaxJobId, "the job id", s));
  c.job_id.assign(s);
  LW_RETURN_IF_ERROR(readUint(cur, 4, v, "the world size"));
  c.world_size = static_cast<uint32_t>(v);
  LW_RETURN_IF_ERROR(readUint(cur, 4, v, "the rank"));
  c.rank = static_cast<uint32_t>(v);
  if (c.world_size == 0) return dataLoss("world size 0");
  if (c.rank >= c.world_size) {
    return dataLoss(fmt::format("rank {} is not below the world size {}", c.rank, c.world_size));
  }
  LW_RETURN_IF_ERROR(readUint(cur, 8, c.step, "the step"));
  LW_RETURN_IF_ERROR(readString(cur, 1, 0, kMaxReason, "the reason", s));
  c.reason.assign(s);
  LW_RETURN_IF_ERROR(readString(cur, 4, 0, kMaxPolicyJson, "the policy state", s));
  if (copy) c.policy_json.assign(s);

  uint64_t count = 0;
  LW_RETURN_IF_ERROR(readUint(cur, 4, count, "the tensor count"));
  if (count > cur.left() / kMinTensorBytes) {
    return dataLoss(fmt::format("truncated: {} tensors declared, {} bytes left in the body", count,
                                cur.left()));
  }
  std::unordered_set<std::string_view> names;
  names.reserve(count);
  if (copy) c.tensors.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    std::string_view name;
    LW_RETURN_IF_ERROR(readString(cur, 2, 1, kMaxName, fmt::format("tensor {}'s name", i), name));
    if (!names.insert(name).second) {
      return dataLoss(fmt::format("tensor '{}' appears twice", name));
    }
    const std::string who = fmt::format("tensor '{}'", name);
    std::string_view key;
    LW_RETURN_IF_ERROR(readString(cur, 2, 0, kMaxCodecKey, who + "'s codec key", key));
    CheckpointTensor scratch_tensor;
    CheckpointTensor& t = copy ? c.tensors.emplace_back() : scratch_tensor;
    if (copy) {
      t.name.assign(name);
      t.codec_key.assign(key);
    }
    LW_RETURN_IF_ERROR(readUint(cur, 8, t.elements, who + "'s element count"));
    LW_RETURN_IF_ERROR(readUint(cur, 1, v, who + "'s dtype"));
    if (v > kMaxDType) return dataLoss(fmt::format("{}: unknown dtype {}", who, v));
    t.dtype = static_cast<uint8_t>(v);
    LW_RETURN_IF_ERROR(readUint(cur, 8, t.last_committed, who + "'s last committed step"));
    LW_RETURN_IF_ERROR(readFloats(cur, who + "'s state", copy ? &t.state : nullptr));
    LW_RETURN_IF_ERROR(readFloats(cur, who + "'s accumulator", copy ? &t.accumulator : nullptr));
  }
  if (cur.left() != 0) {
    return dataLoss(fmt::format("{} unexpected bytes after the last tensor", cur.left()));
  }
  return Status::ok();
}

Status checkExpectations(const Checkpoint& c, const CheckpointExpect& e) {
  if (c.job_id != e.job_id) {
    return failedPrecondition(
        fmt::format("checkpoint is of job '{}', this sidecar runs job '{}'", c.job_id, e.job_id));
  }
  if (c.world_size != e.world_size) {
    return failedPrecondition(
        fmt::format("checkpoint is of world size {}, this job has {}", c.world_size, e.world_size));
  }
  if (c.rank != e.rank) {
    return failedPrecondition(
        fmt::format("checkpoint is of rank {}, this sidecar is rank {}", c.rank, e.rank));
  }
  if (e.step && c.step != *e.step) {
    return failedPrecondition(fmt::format("checkpoint is of step {}, not {}", c.step, *e.step));
  }
  return Status::ok();
}

// ---- files --------------------------------------------------------------------------------------

/// Serialises the writers of one process: two writes of the same file would share a temporary.
std::mutex& writeMutex() {
  static std::mutex m;
  return m;
}

void fsyncDir(const std::string& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

std::string parentOf(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

/// mkdir -p with mode 0700 for the directories it creates (and an fsync of their parents).
Status makeDirs(const std::string& dir) {
  for (size_t pos = 0; pos != std::string::npos;) {
    pos = dir.find('/', pos + 1);
    const std::string prefix = dir.substr(0, pos);
    if (prefix.empty() || prefix.back() == '/') continue;
    if (::mkdir(prefix.c_str(), 0700) == 0) {
      fsyncDir(parentOf(prefix));
    } else if (errno != EEXIST) {
      return internalError(
          fmt::format("cannot create directory '{}': {}", prefix, errnoText(errno)));
    }
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    return internalError(fmt::format("cannot use directory '{}': {}", dir, errnoText(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return internalError(fmt::format("cannot use directory '{}': {}", dir, errnoText(ENOTDIR)));
  }
  return Status::ok();
}

// File names stay within NAME_MAX (255 bytes) with the longest rank, step and temporary suffix
// (".rank4294967295.step18446744073709551615.lwck.tmp.4194304", 57 bytes): a longer sanitised
// job id is cut and made unique again by a hash of the whole id ('~' is never in a sanitised id).
constexpr size_t kMaxJobInName = 128;
constexpr size_t kJobHashChars = 16;

std::string sanitise(const std::string& job_id) {
  std::string s = job_id;
  for (char& ch : s) {
    const bool keep = (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') ||
                      (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
    if (!keep) ch = '_';
  }
  if (s.size() > kMaxJobInName) {
    s.resize(kMaxJobInName - 1 - kJobHashChars);
    s += fmt::format("~{:016x}", XXH3_64bits(job_id.data(), job_id.size()));
  }
  return s;
}

std::string fileName(const std::string& job_id, uint32_t rank, uint64_t step) {
  return fmt::format("{}.rank{}.step{}.lwck", sanitise(job_id), rank, step);
}

}  // namespace

std::string checkpointPath(const std::string& dir, const std::string& job_id, uint32_t rank,
                           uint64_t step) {
  const std::string name = fileName(job_id, rank, step);
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::vector<uint8_t> encodeCheckpoint(const Checkpoint& c) {
  assert(validate(c).isOk() && "encodeCheckpoint: invalid checkpoint");
  const uint64_t body = bodyBytes(c);
  std::vector<uint8_t> out;
  out.reserve(kHeaderBytes + body + kTrailerBytes);
  VectorSink sink(out);
  putHeader(sink, body);
  putBody(sink, c);
  assert(out.size() == kHeaderBytes + body);
  putU64(sink, XXH3_64bits(out.data() + kHeaderBytes, body));
  return out;
}

Result<Checkpoint> decodeCheckpoint(std::span<const uint8_t> bytes,
                                    const CheckpointExpect& expect) {
  const size_t size = bytes.size();
  const uint8_t* p = bytes.data();
  auto le = [p](size_t off, size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= uint64_t{p[off + i]} << (8 * i);
    return v;
  };
  // Magic first: a file that begins like a checkpoint but is shorter than the magic is truncated.
  if (size == 0 ||
      std::memcmp(p, kCheckpointMagic.data(), std::min(size, kCheckpointMagic.size())) != 0) {
    if (size == 0) return dataLoss("truncated: the file is empty");
    return dataLoss("not a lightwire checkpoint (bad magic)");
  }
  if (size < 8) return dataLoss(fmt::format("truncated: {} bytes, no format version", size));
  if (const uint64_t version = le(4, 4); version != kCheckpointVersion) {
    return failedPrecondition(fmt::format(
        "format version {} is not supported (this sidecar reads {}){}", version, kCheckpointVersion,
        version > 0 && version < kCheckpointVersion
            ? ": it was written by an older lightwire, whose codec state this one cannot use; "
              "start without it (docs/policies.md \"Durable state: checkpoints\")"
            : ""));
  }
  if (size < kHeaderBytes + kTrailerBytes) {
    return dataLoss(fmt::format("truncated: {} bytes, shorter than the {}-byte header and checksum",
                                size, kHeaderBytes + kTrailerBytes));
  }
  const uint64_t body_bytes = le(8, 8);
  const uint64_t room = size - kHeaderBytes - kTrailerBytes;
  if (body_bytes > room) {
    return dataLoss(
        fmt::format("truncated: the header declares a body of {} bytes, the file has room for {}",
                    body_bytes, room));
  }
  if (body_bytes < room) {
    return dataLoss(
        fmt::format("{} trailing bytes after the checksum (body of {} bytes in a {}-byte file)",
                    room - body_bytes, body_bytes, size));
  }
  const std::span<const uint8_t> body = bytes.subspan(kHeaderBytes, body_bytes);
  if (XXH3_64bits(body.data(), body.size()) != le(kHeaderBytes + body_bytes, 8)) {
    return dataLoss("checksum mismatch: the file is corrupted");
  }
  // Checks only, no allocation of state; then the expectations; then the copy.
  {
    Checkpoint head;
    LW_RETURN_IF_ERROR(parseBody(body, head, false));
    LW_RETURN_IF_ERROR(checkExpectations(head, expect));
  }
  Checkpoint c;
  try {
    LW_RETURN_IF_ERROR(parseBody(body, c, true));
  } catch (const std::bad_alloc&) {
    return internalError(
        fmt::format("out of memory decoding a checkpoint of {} bytes", bytes.size()));
  }
  return c;
}

Result<std::string> writeCheckpoint(const std::string& dir, const Checkpoint& c) {
  if (dir.empty()) return invalidArgument("checkpoint: no directory given");
  LW_RETURN_IF_ERROR(validate(c));
  const std::string path = checkpointPath(dir, c.job_id, c.rank, c.step);
  auto fail = [&path](std::string what, int err) {
    return internalError(
        fmt::format("cannot write checkpoint '{}': {}: {}", path, what, errnoText(err)));
  };
  {
    Status st = makeDirs(dir);
    if (!st) {
      return Status(st.code(), fmt::format("cannot write checkpoint '{}': {}", path, st.message()));
    }
  }
  std::lock_guard<std::mutex> lock(writeMutex());
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  constexpr int kFlags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
  int fd = ::open(tmp.c_str(), kFlags, 0600);
  if (fd < 0 && errno == EEXIST) {
    // Left by a process with our pid that died mid-write (containers reuse pids, PID 1 above all);
    // no writer of this process holds it (writeMutex).
    ::unlink(tmp.c_str());
    fd = ::open(tmp.c_str(), kFlags, 0600);
  }
  if (fd < 0) return fail(fmt::format("cannot create '{}'", tmp), errno);

  int err = 0;
  std::string what;
  try {
    FileSink sink(fd);
    const uint64_t body = bodyBytes(c);
    putHeader(sink, body);
    sink.setHashing(true);
    putBody(sink, c);
    sink.setHashing(false);
    putU64(sink, sink.error() == 0 ? sink.digest() : 0);
    err = sink.flush();
    if (err != 0) what = fmt::format("cannot write '{}'", tmp);
  } catch (const std::bad_alloc&) {
    err = ENOMEM;
    what = "out of memory";
  }
  if (err == 0 && ::fsync(fd) != 0) {
    err = errno;
    what = fmt::format("cannot fsync '{}'", tmp);
  }
  if (::close(fd) != 0 && err == 0) {
    err = errno;
    what = fmt::format("cannot close '{}'", tmp);
  }
  if (err == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    what = fmt::format("cannot rename '{}'", tmp);
  }
  if (err != 0) {
    ::unlink(tmp.c_str());
    return fail(what, err);
  }
  // The rename is durable once the directory is.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return fail(fmt::format("cannot open directory '{}'", dir), errno);
  if (::fsync(dfd) != 0 && errno != EINVAL) {  // EINVAL: this file system cannot sync directories
    err = errno;
    ::close(dfd);
    return fail(fmt::format("cannot fsync directory '{}'", dir), err);
  }
  ::close(dfd);
  return path;
}

Result<Checkpoint> readCheckpoint(const std::string& path, const CheckpointExpect& expect) {
  auto fail = [&path](StatusCode code, std::string what) {
    return Status(code, fmt::format("checkpoint '{}': {}", path, what));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return fail(err == ENOENT ? StatusCode::kFailedPrecondition : StatusCode::kInternal,
                fmt::format("cannot open: {}", errnoText(err)));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return fail(StatusCode::kInternal, fmt::format("cannot stat: {}", errnoText(errno)));
  }
  if (!S_ISREG(st.st_mode)) return fail(StatusCode::kFailedPrecondition, "not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > expect.max_bytes) {
    return fail(StatusCode::kOutOfRange,
                fmt::format("{} bytes, more than the {} allowed", size, expect.max_bytes));
  }
  if (size > std::numeric_limits<size_t>::max()) {
    return fail(StatusCode::kOutOfRange, fmt::format("{} bytes", size));
  }
  std::vector<uint8_t> bytes;
  try {
    bytes.resize(size);
  } catch (const std::bad_alloc&) {
    return fail(StatusCode::kInternal, fmt::format("out of memory reading {} bytes", size));
  }
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t r = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (r < 0) {
      if (errno == EINTR) continue;
      return fail(StatusCode::kInternal, fmt::format("cannot read: {}", errnoText(errno)));
    }
    if (r == 0) {
      return fail(StatusCode::kDataLoss,
                  fmt::format("truncated while reading: {} of {} bytes", done, size));
    }
    done += static_cast<size_t>(r);
  }
  Result<Checkpoint> r = decodeCheckpoint(bytes, expect);
  if (!r) return fail(r.status().code(), r.status().message());
  return r;
}

std::vector<CheckpointFile> listCheckpointFiles(const std::string& dir, const std::string& job_id,
                                                uint32_t rank) {
  std::vector<CheckpointFile> files;
  DIR* d = ::opendir(dir.empty() ? "." : dir.c_str());
  if (d == nullptr) return files;
  const std::string prefix = fmt::format("{}.rank{}.step", sanitise(job_id), rank);
  constexpr std::string_view kSuffix = ".lwck";
  while (const dirent* e = ::readdir(d)) {
    const std::string_view name = e->d_name;
    if (name.size() <= prefix.size() + kSuffix.size() || !name.starts_with(prefix) ||
        !name.ends_with(kSuffix)) {
      continue;
    }
    const std::string_view digits =
        name.substr(prefix.size(), name.size() - prefix.size() - kSuffix.size());
    // Decimal digits only, no leading zero: exactly the names checkpointPath() makes.
    if (digits.size() > 1 && digits[0] == '0') continue;
    uint64_t step = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
    if (ec != std::errc() || end != digits.data() + digits.size()) continue;
    struct stat st {};
    if (::fstatat(::dirfd(d), e->d_name, &st, 0) != 0 || !S_ISREG(st.st_mode)) continue;
    const int64_t mtime = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    files.push_back({step, checkpointPath(dir, job_id, rank, step), mtime});
  }
  ::closedir(d);
  std::sort(files.begin(), files.end(), [](const CheckpointFile& a, const CheckpointFile& b) {
    return a.mtime_ns != b.mtime_ns ? a.mtime_ns < b.mtime_ns : a.step < b.step;
  });
  return files;
}

std::vector<uint64_t> listCheckpoints(const std::string& dir, const std::string& job_id,
                                      uint32_t rank) {
  std::vector<uint64_t> steps;
  for (const auto& f : listCheckpointFiles(dir, job_id, rank)) steps.push_back(f.step);
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::optional<CheckpointFile> newestCheckpoint(const std::vector<std::string>& dirs,
                                               const std::string& job_id, uint32_t rank) {
  std::optional<CheckpointFile> newest;
  for (const auto& dir : dirs) {
    auto files = listCheckpointFiles(dir, job_id, rank);
    if (files.empty()) continue;
    auto& f = files.back();
    if (!newest || f.mtime_ns > newest->mtime_ns ||
        (f.mtime_ns == newest->mtime_ns && f.step > newest->step)) {
      newest = std::move(f);
    }
  }
  return newest;
}

Status markNewest(const std::string& path) {
  if (::utimensat(AT_FDCWD, path.c_str(), nullptr, 0) != 0) {
    return internalError("cannot set the modification time of '" + path + "': " + errnoText(errno));
  }
  return Status::ok();
}

void pruneCheckpoints(const std::string& dir, const std::string& job_id, uint32_t rank,
                      size_t keep) {
  keep = std::max<size_t>(keep, 1);
  const std::vector<CheckpointFile> files = listCheckpointFiles(dir, job_id, rank);
  for (size_t i = 0; i + keep < files.size(); ++i) {
    if (::unlink(files[i].path.c_str()) != 0 && errno != ENOENT) {
      spdlog::warn("cannot remove old checkpoint '{}': {}", files[i].path, errnoText(errno));
    }
  }
}

}  // namespace lightwire::policies
