#include "kernels/parallel.h"

#include <algorithm>

namespace lightwire::kernels {

namespace {
std::pair<size_t, size_t> partRange(size_t count, size_t parts, size_t part) {
  const size_t base = count / parts, extra = count % parts;
  const size_t lo = part * base + std::min(part, extra);
  return {lo, lo + base + (part < extra ? 1 : 0)};
}
}  // namespace

CpuStream::CpuStream(unsigned threads) : threads_(std::max(1u, threads)) {
  for (unsigned i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { workerLoop(i); });
}

CpuStream::~CpuStream() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void CpuStream::parallelFor(size_t count, size_t grain,
                            const std::function<void(size_t, size_t)>& fn) {
  if (count == 0) return;
  const size_t parts =
      std::min<size_t>(threads_, std::max<size_t>(1, count / std::max<size_t>(grain, 1)));
  if (parts <= 1) {
    fn(0, count);
    return;
  }
  {
    std::lock_guard lock(mu_);
    job_ = &fn;
    job_count_ = count;
    job_parts_ = parts;
    pending_ = static_cast<unsigned>(parts - 1);
    ++generation_;
  }
  start_cv_.notify_all();
  const auto [lo, hi] = partRange(count, parts, 0);
  fn(lo, hi);
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
}

void CpuStream::workerLoop(unsigned index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(size_t, size_t)>* job;
    size_t count, parts;
    {
      std::unique_lock lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      count = job_count_;
      parts = job_parts_;
    }
    if (index < parts) {
      const auto [lo, hi] = partRange(count, parts, index);
      (*job)(lo, hi);
      std::lock_guard lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace lightwire::kernels
