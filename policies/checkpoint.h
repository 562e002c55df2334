#pragma once
// Checkpoint files of one sidecar's durable state (docs/policies.md "Durable state: checkpoints"):
// every tensor's codec state (as committed after `step`), its delayed-sync accumulator, its last
// committed step, and the policy state (JSON, opaque here). One file per (job, rank, step):
//   <dir>/<job>.rank<R>.step<S>.lwck
// written atomically (temporary file in the same directory, fsync, rename, fsync of the
// directory). Layout (little-endian, docs/policies.md):
//   magic "LWCK" | u32 format version | u64 body length | body | u64 XXH3-64 of the body
// body: u16 job id length, job id | u32 world size | u32 rank | u64 step | u8 reason length,
//   reason | u32 policy JSON length, JSON | u32 tensor count | per tensor: u16 name length, name |
//   u16 codec key length, codec key | u64 elements | u8 dtype | u64 last committed step |
//   u64 state floats, floats | u64 accumulator floats, floats.
// A reader checks everything (magic, version, lengths against what is left, the checksum, the job,
// the world size and the rank it expects) before it allocates or returns anything.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/status.h"

namespace lightwire::policies {

// 2: PowerSGD's state holds the warm-start Q of its matrix view (cols · rank values), no longer
// a reservation for any view of the tensor's size (docs/determinism.md "4.12 `powersgd`").
inline constexpr uint32_t kCheckpointVersion = 2;

/// One tensor's durable state. Plain value.
struct CheckpointTensor {
  std::string name;       // 1..1024 bytes
  std::string codec_key;  // kernels::configKey() of the codec the state belongs to (<= 4096 bytes)
  uint64_t elements = 0;
  uint8_t dtype = 0;               // kernels::DType as its integer value
  uint64_t last_committed = 0;     // the tensor's last committed step
  std::vector<float> state;        // kernels::CodecState current() (empty = stateless)
  std::vector<float> accumulator;  // delayed sync: what was accumulated locally (may be empty)
};

/// One sidecar's state as it stood after `step` committed. Plain value.
struct Checkpoint {
  std::string job_id;  // 1..65535 bytes
  uint32_t world_size = 1;
  uint32_t rank = 0;
  uint64_t step = 0;
  std::string reason;       // "trainer", "periodic", "sigterm" (<= 255 bytes)
  std::string policy_json;  // policies' own state, opaque here (<= 64 MiB)
  std::vector<CheckpointTensor> tensors;
};

/// What a reader requires of a file before it takes anything from it.
struct CheckpointExpect {
  std::string job_id;
  uint32_t world_size = 1;
  uint32_t rank = 0;
  std::optional<uint64_t> step;             // when set, the file must be of this step
  uint64_t max_bytes = uint64_t{64} << 30;  // files larger than this are refused unread
};

/// "<dir>/<job>.rank<R>.step<S>.lwck" (job ids are sanitised: bytes outside [A-Za-z0-9._-]
/// become '_'; a sanitised id longer than 128 bytes becomes its first 111 bytes, '~' and the 16
/// hex digits of XXH3-64 of the whole id, so that names fit in NAME_MAX).
std::string checkpointPath(const std::string& dir, const std::string& job_id, uint32_t rank,
                           uint64_t step);

/// The serialised file (header, body, checksum) — what writeCheckpoint() writes.
std::vector<uint8_t> encodeCheckpoint(const Checkpoint& c);
/// Parses and checks serialised bytes (errors name what is wrong: "not a lightwire checkpoint
/// (bad magic)", "format version 7 is not supported (this sidecar reads 2)" (an older version
/// says it was written by an older lightwire), "truncated: ...",
/// "checksum mismatch: the file is corrupted", then the contents (kDataLoss), then "checkpoint is
/// of job 'a', this sidecar runs job 'b'", "... of world size 3, this job has 4", "... of rank 1,
/// this sidecar is rank 2", "... of step 7, not 9" (kFailedPrecondition, as is the version).
Result<Checkpoint> decodeCheckpoint(std::span<const uint8_t> bytes, const CheckpointExpect& expect);

/// Writes `c` atomically to checkpointPath(dir, c.job_id, c.rank, c.step), creating `dir` if
/// needed; returns the path. On error nothing is left behind (the temporary file is removed).
Result<std::string> writeCheckpoint(const std::string& dir, const Checkpoint& c);
/// Reads and checks the file at `path` (errors also for a missing or unreadable file, naming it).
Result<Checkpoint> readCheckpoint(const std::string& path, const CheckpointExpect& expect);

/// Steps of the checkpoint files of (job, rank) in `dir`, ascending (empty when none or no dir).
std::vector<uint64_t> listCheckpoints(const std::string& dir, const std::string& job_id,
                                      uint32_t rank);

/// One checkpoint file found in a directory.
struct CheckpointFile {
  uint64_t step = 0;
  std::string path;
  int64_t mtime_ns = 0;  // its modification time: when it was written (or marked newest)
};
/// The checkpoint files of (job, rank) in `dir` in the order they were written: by modification
/// time, then step. Not by step alone: after a resume from step S the files of steps after S
/// are of an abandoned run, older than what the resumed run writes (see markNewest).
std::vector<CheckpointFile> listCheckpointFiles(const std::string& dir, const std::string& job_id,
                                                uint32_t rank);
/// The most recently written checkpoint of (job, rank) in any of `dirs`; none when there is none.
std::optional<CheckpointFile> newestCheckpoint(const std::vector<std::string>& dirs,
                                               const std::string& job_id, uint32_t rank);
/// Sets the file's modification time to now, so that it counts as the most recently written
/// (the checkpoint a run resumed from).
Status markNewest(const std::string& path);
/// Removes all but the `keep` most recently written files of (job, rank) in `dir` (keep >= 1).
void pruneCheckpoints(const std::string& dir, const std::string& job_id, uint32_t rank,
                      size_t keep);

}  // namespace lightwire::policies
