#pragma once
// What the CUDA sparse codecs (topk, threshold, dgc: kernels/cuda/codecs/*.cu) share, private to
// them: the device selection plan, exact top-k on the GPU, the sparse payload writer and the
// sparse decoder. The GPU twin of kernels/select.h; every result is bit-identical to it.
//
// Selection: a plan (SelectState: "key > threshold, or key == threshold and whole-tensor index <
// tie_end", SelectionPlan's semantics) lives in device memory. Exact top-k fills it with three
// radix-histogram passes over the 31-bit magnitude keys (11, 11 and 9 bits) and, only when the
// ties with the threshold key are cut, a count of equal keys per 4096-element tile and a one-block
// search for the tie cut. All counts are integers (atomics on integer counts are exact and
// order-free), so the plan is a pure function of the data, as on the CPU.
//
// Encoding a chunk: a stable CUB compaction (DeviceSelect::If) of the chunk-local indices the plan
// selects, an OR of the gaps (w = its bit length), then one kernel writes header, packed gaps,
// padding and values and the size. Nothing is copied to the host and nothing synchronises.
//
// Decoding (trusted device payload): one CUB inclusive scan over the chunk turns the gaps into
// indices, and its output iterator adds weight · value at each index. Untrusted payloads are
// validated on the host first (validateSparse), as CudaCodec::decodeChunk does.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>

#include "kernels/cuda/codec.h"
#include "kernels/cuda/device.cuh"
#include "kernels/select.h"

namespace lightwire::kernels::cuda::sparse {

inline constexpr size_t kAlign = 256;
inline constexpr size_t alignUp(size_t b) { return (b + kAlign - 1) & ~(kAlign - 1); }

/// Slices of a caller's device workspace, each 256-byte aligned (the base is aligned up first:
/// bytesFor() counts that slack).
class DeviceCarver {
 public:
  explicit DeviceCarver(DeviceBytes ws)
      : next_((reinterpret_cast<uintptr_t>(ws.data) + kAlign - 1) & ~uintptr_t{kAlign - 1}) {}
  /// Bytes a carver needs for slices of these byte sizes (taken in this order).
  static size_t bytesFor(std::initializer_list<size_t> sizes) {
    size_t total = kAlign;
    for (size_t s : sizes) total += alignUp(s);
    return total;
  }
  template <typename T>
  T* take(size_t count) {
    T* p = reinterpret_cast<T*>(next_);
    next_ += alignUp(count * sizeof(T));
    return p;
  }

 private:
  uintptr_t next_;
};

/// The step's selection and the state of the device-side algorithms that decide it. Lives in the
/// workspace between analyze() and encodeChunk() (dgc's clipping decision until its commit); all
/// fields zero at the start of a dgc step.
struct SelectState {
  // The plan.
  uint32_t threshold;
  uint32_t none;  // 1: nothing is selected (n = 0)
  uint64_t tie_end;
  // Exact top-k in progress: decided high key bits, rank of the target among the keys with that
  // prefix (1-based), and after the last digit the ties to take.
  uint64_t remaining;
  uint64_t need;
  uint32_t prefix;
  uint32_t cut;  // ties with the threshold are cut: the tie search runs
  // dgc's sampled threshold (docs/determinism.md §4.4).
  unsigned long long rank;
  unsigned long long count;  // atomically added to
  uint32_t sample_threshold;
  uint32_t decided;  // a threshold was accepted, or the exact fallback was chosen
  uint32_t exact;    // the exact fallback runs
  // dgc's clipping.
  uint32_t clip;
  float factor;
  uint32_t reserved;
};

/// Where encoding finds the plan: in device memory (analyze wrote it), or by value.
struct PlanArg {
  const SelectState* dev = nullptr;
  uint32_t threshold = 0;
  uint32_t none = 0;
  uint64_t tie_end = 0;
};

#if defined(__CUDACC__)
/// key(x): the fp32 bits with the sign cleared (NaN above +Inf), as magnitudeKey.
__device__ __forceinline__ uint32_t keyOf(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }
template <DType D>
__device__ __forceinline__ uint32_t keyAt(const void* x, size_t i) {
  return keyOf(loadWidenedDevice<D>(x, i));
}
#endif

// --- exact top-k ---------------------------------------------------------------------------------

/// Device memory of the exact selection for a tensor of n elements.
struct SelectWs {
  SelectState* state = nullptr;
  unsigned long long* hist = nullptr;  // the three digit histograms (2048 + 2048 + 512 counters)
  uint32_t* tile_counts = nullptr;     // equal keys per 4096-element tile
};
size_t selectWsBytes(size_t n);  // without the carver's slack
SelectWs carveSelectWs(DeviceCarver& carver, size_t n);

/// *state's plan := (threshold, tie_end, none).
cudaError_t setPlan(SelectState* state, uint32_t threshold, uint64_t tie_end, bool none,
                    cudaStream_t stream);

/// Exact top-k of the keys of x[0..n) (dtype), 1 <= k <= n: writes the plan (threshold, tie_end,
/// none = 0) into ws.state. When `active` is non-null the kernels do nothing unless *active != 0
/// (decided on the device). Touches no other plan field.
cudaError_t exactTopk(const void* x, DType dtype, size_t n, size_t k, const SelectWs& ws,
                      const uint32_t* active, cudaStream_t stream);

/// applyMinKey on the device plan (min_key != 0).
cudaError_t applyMinKey(SelectState* state, uint32_t min_key, cudaStream_t stream);

// --- encoding ------------------------------------------------------------------------------------

struct ChunkCounters {
  unsigned long long nnz;
  uint32_t gap_or;
  uint32_t reserved;
};

/// Device memory to encode one chunk of at most chunk_elements elements.
struct EncodeWs {
  uint32_t* indices = nullptr;  // chunk_elements
  ChunkCounters* counters = nullptr;
  void* cub_temp = nullptr;
  size_t cub_bytes = 0;
};
size_t encodeWsBytes(size_t chunk_elements);  // without the carver's slack
EncodeWs carveEncodeWs(DeviceCarver& carver, size_t chunk_elements);

/// The sparse payload (codec id `codec`, header dtype `source`, fp32 or fp16 `values`) of the
/// chunk x[begin, begin + len) of the whole tensor x under `plan`, into d_out, its size into
/// *d_size. dgc: with `mask_v` (== x.data, fp32) every sent element gets v'_i = v'_i − value_i
/// and, with `mask_u`, u'_i = 0 (docs/determinism.md §4.4 step 6). len must be < 2^32.
cudaError_t encodeChunk(CodecId codec, DType source, DType values, const PlanArg& plan,
                        DeviceTensor x, size_t begin, size_t len, const EncodeWs& ws,
                        uint8_t* d_out, uint64_t* d_size, float* mask_v, float* mask_u,
                        cudaStream_t stream);

// --- decoding ------------------------------------------------------------------------------------

/// Device bytes accumulateSparse needs for n output elements (CUB scan storage).
size_t accumulateBytes(size_t n);
/// d_out[0..n) += weight · decoded(d_payload): a sparse payload (or the `none` escape) of n
/// elements, trusted. Bit-identical to decodeSparsePayload. With `d_zero` (and `d_zero2`),
/// d_zero[i] = 0 (d_zero2[i] = 0) for every entry i of the payload too (dgc's masking of u and c
/// at commit: docs/determinism.md §4.4 step 6).
cudaError_t accumulateSparse(const uint8_t* d_payload, float weight, float* d_out, size_t n,
                             DeviceBytes scratch, cudaStream_t stream, float* d_zero = nullptr,
                             float* d_zero2 = nullptr);
/// Every check decodeSparsePayload makes, on the host, without decoding into an output.
Status validateSparse(std::span<const uint8_t> payload, CodecId codec, size_t out_elements);

/// The decoding half every sparse CUDA codec shares.
class SparseCudaCodec : public CudaCodec {
 public:
  SparseCudaCodec(std::unique_ptr<Codec> host, CodecId id)
      : host_(std::move(host)),
        id_(id),
        values_(host_->config().sparse_values),
        min_key_(minMagnitudeKey(host_->config().min_magnitude)) {}
  const Codec& host() const override { return *host_; }
  size_t accumulateScratchBytes(size_t n) const override { return accumulateBytes(n); }
  Status accumulate(const uint8_t* d_payload, float weight, float* d_out, size_t out_elements,
                    DeviceBytes scratch, cudaStream_t stream) const override;
  Status validate(std::span<const uint8_t> payload, size_t out_elements) const override {
    return validateSparse(payload, id_, out_elements);
  }

 protected:
  /// Checks what the CPU writer checks before encoding a chunk (index range of the layout).
  Status checkChunk(size_t len) const;

  std::unique_ptr<Codec> host_;
  CodecId id_;
  DType values_;
  uint32_t min_key_;  // min_magnitude as a key floor (0 = off)
};

}  // namespace lightwire::kernels::cuda::sparse
