#include "proxy/step/step_pool.h"

#include <algorithm>

#include "kernels/reuse.h"

namespace lightwire::proxy {

std::vector<float> StepPool::take(size_t n) {
  std::vector<float> b = kernels::takeReused(kept_, n, /*capacity_only=*/false, kept_bytes_);
  // Growing within the capacity writes only the growth; a shrink writes nothing.
  b.resize(n);
  lent_bytes_ += b.capacity() * sizeof(float);
  peak_bytes_ = std::max(peak_bytes_, bytes());
  return b;
}

void StepPool::give(std::vector<float>&& b) {
  const uint64_t bytes = b.capacity() * sizeof(float);
  lent_bytes_ -= std::min(lent_bytes_, bytes);
  if (bytes == 0 || kept_bytes_ + bytes > keep_bytes_) return;  // freed with `b`
  kept_bytes_ += bytes;
  kept_.push_back(std::move(b));
}

float* PooledFloats::get(StepPool& pool, size_t n) {
  if (pool_ != nullptr && buf_.capacity() >= n) {
    buf_.resize(n);
    return buf_.data();
  }
  release();
  pool_ = &pool;
  buf_ = pool.take(n);
  return buf_.data();
}

void PooledFloats::release() {
  if (pool_ != nullptr) pool_->give(std::move(buf_));
  pool_ = nullptr;
  buf_ = {};
}

}  // namespace lightwire::proxy
