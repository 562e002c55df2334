#pragma once
// Step buffers shared by every tensor (docs/deploy.md "Sizing"): the host step's result (the
// codec's work area before it), the local sum and the flushed input are lent to one step and given
// back at its end, so many tensors share a few buffers instead of each keeping its own. Buffers
// given back are kept for the next step up to a cap, beyond it freed. Engine thread only (steps
// of the host backend run there; the layers of a bucket hold theirs together until the bucket
// ends).

#include <cstddef>
#include <cstdint>
#include <vector>

namespace lightwire::proxy {

class StepPool {
 public:
  /// `keep_bytes`: what may stay in the pool between steps (0 = nothing kept).
  explicit StepPool(uint64_t keep_bytes = 0) : keep_bytes_(keep_bytes) {}
  void setKeepBytes(uint64_t keep_bytes) { keep_bytes_ = keep_bytes; }

  /// A buffer of n floats (contents unspecified): the smallest kept one whose capacity holds n,
  /// else the largest kept one grown, else a new one.
  std::vector<float> take(size_t n);
  /// Gives back what take() lent.
  void give(std::vector<float>&& b);

  /// Bytes of the buffers kept and lent now.
  uint64_t bytes() const { return kept_bytes_ + lent_bytes_; }
  /// The most bytes() has been.
  uint64_t peakBytes() const { return peak_bytes_; }

 private:
  uint64_t keep_bytes_;
  std::vector<std::vector<float>> kept_;
  uint64_t kept_bytes_ = 0, lent_bytes_ = 0, peak_bytes_ = 0;
};

/// A buffer lent by a StepPool for one step, given back when it goes out of scope.
class PooledFloats {
 public:
  PooledFloats() = default;
  ~PooledFloats() { release(); }
  PooledFloats(const PooledFloats&) = delete;
  PooledFloats& operator=(const PooledFloats&) = delete;

  /// n floats from `pool` (the one lent before is given back first when it is too small).
  float* get(StepPool& pool, size_t n);
  void release();

 private:
  StepPool* pool_ = nullptr;
  std::vector<float> buf_;
};

}  // namespace lightwire::proxy
