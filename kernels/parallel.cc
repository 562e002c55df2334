#include "kernels/parallel.h"

#include <algorithm>

namespace lightwire::kernels {

namespace {

// About 20-100 microseconds of polling before a thread blocks on its condition variable.
constexpr int kSpins = 4000;

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

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
    pending_.store(static_cast<unsigned>(parts - 1), std::memory_order_relaxed);
    generation_.store(generation_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }
  start_cv_.notify_all();
  const auto [lo, hi] = partRange(count, parts, 0);
  fn(lo, hi);
  for (int spin = 0; spin < kSpins && pending_.load(std::memory_order_acquire) != 0; ++spin) {
    cpuRelax();
  }
  if (pending_.load(std::memory_order_acquire) != 0) {
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
  }
}

void CpuStream::workerLoop(unsigned index) {
  uint64_t seen = 0;
  for (;;) {
    for (int spin = 0; spin < kSpins && generation_.load(std::memory_order_acquire) == seen;
         ++spin) {
      cpuRelax();
    }
    const std::function<void(size_t, size_t)>* job;
    size_t count, parts;
    {
      std::unique_lock lock(mu_);
      start_cv_.wait(lock,
                     [&] { return stop_ || generation_.load(std::memory_order_relaxed) != seen; });
      if (stop_) return;
      seen = generation_.load(std::memory_order_relaxed);
      job = job_;
      count = job_count_;
      parts = job_parts_;
    }
    if (index < parts) {
      const auto [lo, hi] = partRange(count, parts, index);
      (*job)(lo, hi);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard lock(
            mu_);  // pairs with the predicate check in parallelFor: no lost wake-up
        done_cv_.notify_one();
      }
    }
  }
}

}  // namespace lightwire::kernels
