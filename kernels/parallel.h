#pragma once
// CpuStream: the CPU analogue of a CUDA stream — the explicit execution context a codec call runs
// on. It owns a small fixed pool of worker threads; work is split into contiguous ranges so the
// caller decides the layout and results never depend on the thread count.

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lightwire::kernels {

/// A fixed pool of `threads` workers (the calling thread counts as one). One parallelFor at a
/// time per stream: a stream is not thread-safe, use one per concurrent caller.
class CpuStream {
 public:
  explicit CpuStream(unsigned threads = 1);
  ~CpuStream();
  CpuStream(const CpuStream&) = delete;
  CpuStream& operator=(const CpuStream&) = delete;

  unsigned threads() const { return threads_; }

  /// Runs fn(lo, hi) over a partition of [0, count) into at most threads() contiguous ranges of
  /// at least `grain` items each, and waits for all of them.
  void parallelFor(size_t count, size_t grain, const std::function<void(size_t, size_t)>& fn);

 private:
  void workerLoop(unsigned index);

  unsigned threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  size_t job_count_ = 0, job_parts_ = 0;
  // Atomics so that the calling thread and the workers can spin briefly before blocking: codecs
  // call parallelFor once per chunk, and a condition-variable hand-off per call costs tens of
  // microseconds, a sizeable share of a memory-bound chunk.
  std::atomic<uint64_t> generation_{0};
  std::atomic<unsigned> pending_{0};
  bool stop_ = false;
};

/// stream->parallelFor(count, grain, fn), or fn(0, count) on the calling thread when `stream` is
/// null (codecs take an optional stream). Does nothing for count = 0.
inline void parallelFor(CpuStream* stream, size_t count, size_t grain,
                        const std::function<void(size_t, size_t)>& fn) {
  if (count == 0) return;
  if (stream != nullptr) {
    stream->parallelFor(count, grain, fn);
  } else {
    fn(0, count);
  }
}

}  // namespace lightwire::kernels
