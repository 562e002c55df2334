// CUDA `none`, `fp16` and `bf16` (docs/determinism.md §4.1, docs/wire-format.md), byte-identical
// to kernels/codecs/none.cc and kernels/codecs/cast.cc.
//
// Encoding is one pass: each thread reads an octet (eight consecutive elements) of the chunk and
// writes its eight wire values; thread 0 of block 0 writes the 16-byte header and the payload
// size. The conversions are kernels/half_bits.h, the bit logic kernels/cuda/cast.cu and the CPU
// (dtype.h, checked against F16C) share: fp32 input is converted; input already of the codec's
// 16-bit format is copied bit for bit (NaN payloads included, as the CPU's memcpy); the other
// 16-bit format is widened (exact) and converted, as the CPU's encodeRange.
//
// Decoding (accumulate) is one pass: out[i] = out[i] + (w · value_i), __fmul_rn then __fadd_rn,
// as the CPU's decodeDenseF32 / accumulateHalves / accumulateBf16s. fp16 and bf16 decoders also
// accept the `none` layout (codec id 0 in the header), which the kernel reads on the device.

#include <memory>
#include <string>

#include "kernels/cuda/codec.h"
#include "kernels/cuda/codecs/dense_payload.cuh"
#include "kernels/cuda/device.cuh"
#include "kernels/half_bits.h"
#include "kernels/payload.h"

namespace lightwire::kernels::cuda {
namespace {

using codecs::kOctet;
using codecs::Prefix;

/// The wire format of a dense codec.
enum class Wire { kF32, kF16, kBf16 };

template <Wire W>
struct WireInfo;
template <>
struct WireInfo<Wire::kF32> {
  static constexpr CodecId kId = CodecId::kNone;
  static constexpr const char* kName = "none";
  static constexpr unsigned kWidth = 4;
  static constexpr DType kDType = DType::kF32;
};
template <>
struct WireInfo<Wire::kF16> {
  static constexpr CodecId kId = CodecId::kFp16;
  static constexpr const char* kName = "fp16";
  static constexpr unsigned kWidth = 2;
  static constexpr DType kDType = DType::kF16;
};
template <>
struct WireInfo<Wire::kBf16> {
  static constexpr CodecId kId = CodecId::kBf16;
  static constexpr const char* kName = "bf16";
  static constexpr unsigned kWidth = 2;
  static constexpr DType kDType = DType::kBF16;
};

/// Writes the payload of the n elements at x (dtype D; the chunk's first element) into out and its
/// size into *d_size. x_vec: x is 16-byte aligned; out_vec: out is 16-byte aligned.
template <Wire W, DType D>
__global__ void __launch_bounds__(kBlockThreads)
    encodeDenseKernel(const void* __restrict__ x, size_t n, Prefix header,
                      uint8_t* __restrict__ out, uint64_t* __restrict__ d_size, uint64_t size,
                      bool x_vec, bool out_vec) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    codecs::writePrefix(out, header);
    *d_size = size;
  }
  uint8_t* const body = out + kHeaderBytes;
  const size_t octets = (n + kOctet - 1) / kOctet;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t o = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < octets;
       o += stride) {
    const size_t j0 = o * kOctet;
    const unsigned count = static_cast<unsigned>(n - j0 < kOctet ? n - j0 : kOctet);
    if constexpr (W == Wire::kF32) {
      float v[kOctet];
      codecs::loadOctet<D>(x, j0, count, x_vec, v);
      codecs::storeDenseOctet(body, j0, count, out_vec, v);
    } else if constexpr (D == WireInfo<W>::kDType) {  // already the wire format: bit for bit
      uint32_t h[kOctet];
      codecs::loadHalfOctet(static_cast<const uint8_t*>(x) + 2 * j0, count, x_vec, h);
      codecs::storeHalfOctet(body + 2 * j0, count, out_vec, h);
    } else {
      float v[kOctet];
      codecs::loadOctet<D>(x, j0, count, x_vec, v);
      uint32_t h[kOctet];
#pragma unroll
      for (unsigned e = 0; e < kOctet; ++e) {
        h[e] = W == Wire::kF16 ? bits::floatBitsToHalf(__float_as_uint(v[e]))
                               : bits::floatBitsToBf16(__float_as_uint(v[e]));
      }
      codecs::storeHalfOctet(body + 2 * j0, count, out_vec, h);
    }
  }
}

/// out[i] = out[i] + (w · value_i) for i < n, the values in the payload's layout: the codec's own
/// or (fp16, bf16) the `none` escape. payload_vec / out_vec: 16-byte aligned.
template <Wire W>
__global__ void __launch_bounds__(kBlockThreads)
    accumulateDenseKernel(const uint8_t* __restrict__ payload, float weight,
                          float* __restrict__ out, size_t n, bool payload_vec, bool out_vec) {
  const uint8_t* const body = payload + kHeaderBytes;
  if (W == Wire::kF32 || payload[3] == static_cast<uint8_t>(CodecId::kNone)) {
    codecs::accumulateDenseBody(body, weight, out, n, payload_vec, out_vec);
    return;
  }
  const size_t octets = (n + kOctet - 1) / kOctet;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t o = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < octets;
       o += stride) {
    const size_t j0 = o * kOctet;
    const unsigned count = static_cast<unsigned>(n - j0 < kOctet ? n - j0 : kOctet);
    uint32_t h[kOctet];
    float acc[kOctet];
    codecs::loadHalfOctet(body + 2 * j0, count, payload_vec, h);
    codecs::loadOutOctet(out + j0, count, out_vec, acc);
#pragma unroll
    for (unsigned e = 0; e < kOctet; ++e) {
      const float v = codecs::widen16<WireInfo<W>::kDType>(h[e]);
      acc[e] = __fadd_rn(acc[e], __fmul_rn(weight, v));
    }
    codecs::storeOutOctet(out + j0, count, out_vec, acc);
  }
}

/// `none`, `fp16` or `bf16` on the GPU. Stateless; immutable and thread-safe.
template <Wire W>
class DenseCudaCodec final : public CudaCodec {
 public:
  explicit DenseCudaCodec(std::unique_ptr<Codec> host) : host_(std::move(host)) {}

  const Codec& host() const override { return *host_; }
  size_t workspaceBytes(const Chunking&) const override { return 0; }

  Status accumulate(const uint8_t* d_payload, float weight, float* d_out, size_t out_elements,
                    DeviceBytes, cudaStream_t stream) const override {
    if (out_elements == 0) return Status::ok();
    if (d_payload == nullptr || d_out == nullptr) {
      return invalidArgument(std::string(Info::kName) + " (cuda): payload or output is null");
    }
    const size_t octets = (out_elements + kOctet - 1) / kOctet;
    accumulateDenseKernel<W><<<blocksFor(octets), kBlockThreads, 0, stream>>>(
        d_payload, weight, d_out, out_elements, codecs::isAligned(d_payload, 16),
        codecs::isAligned(d_out, 16));
    return cudaStatus(cudaGetLastError(), std::string(Info::kName) + " (cuda) decode");
  }

  /// The CPU decoder's checks, without decoding: the header, then the exact length of the
  /// codec's layout or of the `none` escape.
  Status validate(std::span<const uint8_t> payload, size_t out_elements) const override {
    auto h = readHeader(payload, Info::kId, out_elements, 0);
    if (!h) return h.status();
    if (h->round != 0) {
      return dataLoss(std::string(Info::kName) + " payload has round " + std::to_string(h->round) +
                      ", must be 0");
    }
    if (W == Wire::kF32 || h->codec == CodecId::kNone) {
      return codecs::checkDenseLength(payload, *h);
    }
    const uint64_t body = payload.size() - kHeaderBytes;  // readHeader: size >= header
    if (body % Info::kWidth != 0 || body / Info::kWidth != h->elements) {
      return dataLoss(std::string(Info::kName) + " payload of " + std::to_string(h->elements) +
                      " elements must be 16 + " + std::to_string(Info::kWidth) + " * " +
                      std::to_string(h->elements) + " bytes, got " +
                      std::to_string(payload.size()));
    }
    return Status::ok();
  }

 protected:
  Status doAnalyze(const StepContext&, const Chunking&, DeviceTensor, DeviceState&, DeviceBytes,
                   cudaStream_t) const override {
    return Status::ok();
  }

  Status doEncodeChunk(const StepContext&, const Chunking& chunking, size_t chunk, int,
                       std::span<const uint8_t>, DeviceTensor input, DeviceState&, DeviceBytes,
                       uint8_t* d_out, uint64_t* d_size, cudaStream_t stream) const override {
    const size_t begin = chunking.begin(chunk), n = chunking.size(chunk);
    const void* x = static_cast<const char*>(input.data) + begin * dtypeSize(input.dtype);
    const Prefix header = codecs::headerPrefix({Info::kId, input.dtype, 0, 0, n});
    const uint64_t size = kHeaderBytes + uint64_t{Info::kWidth} * n;
    const unsigned grid = blocksFor((n + kOctet - 1) / kOctet);
    const bool x_vec = codecs::isAligned(x, 16), out_vec = codecs::isAligned(d_out, 16);
    visitDeviceDType(input.dtype, [&](auto d) {
      encodeDenseKernel<W, decltype(d)::value>
          <<<grid, kBlockThreads, 0, stream>>>(x, n, header, d_out, d_size, size, x_vec, out_vec);
    });
    return cudaStatus(cudaGetLastError(), std::string(Info::kName) + " (cuda) encode");
  }

 private:
  using Info = WireInfo<W>;
  std::unique_ptr<Codec> host_;
};

template <Wire W>
Result<std::unique_ptr<CudaCodec>> makeDense(std::unique_ptr<Codec> host) {
  return std::unique_ptr<CudaCodec>(new DenseCudaCodec<W>(std::move(host)));
}

LW_REGISTER_CUDA_CODEC(none, CodecId::kNone, makeDense<Wire::kF32>);
LW_REGISTER_CUDA_CODEC(fp16, CodecId::kFp16, makeDense<Wire::kF16>);
LW_REGISTER_CUDA_CODEC(bf16, CodecId::kBf16, makeDense<Wire::kBf16>);

}  // namespace
}  // namespace lightwire::kernels::cuda
