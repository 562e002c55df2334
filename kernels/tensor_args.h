#pragma once
// The argument checks every codec step makes on its tensor, chunking, state, chunk and round, on
// plain values:
// shared by Codec (kernels/codec.cc) and CudaCodec (kernels/cuda/codec.cu).

#include <cstddef>
#include <string>

#include "kernels/codec.h"

namespace lightwire::kernels {

/// invalidArgument, its message prefixed with `name`, unless the input has chunking.elements
/// elements of a known dtype (and non-null data when any), the chunking a non-zero chunk size that
/// is a multiple of chunk_alignment when there are several chunks, and the state state_floats ==
/// need_floats floats.
Status checkTensorValues(const std::string& name, const Chunking& chunking, size_t elements,
                         DType dtype, const void* data, size_t chunk_alignment, size_t state_floats,
                         size_t need_floats);

/// outOfRange unless chunk < chunking.count(), invalidArgument unless 0 <= round < rounds; the
/// messages prefixed with `name`.
Status checkChunkAndRound(const std::string& name, const Chunking& chunking, size_t chunk,
                          int round, int rounds);

}  // namespace lightwire::kernels
