#include "kernels/dtype.h"

namespace lightwire::kernels {

std::string_view dtypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "fp32";
    case DType::kF16:
      return "fp16";
    case DType::kBF16:
      return "bf16";
  }
  return "?";
}

std::optional<DType> parseDType(std::string_view s) {
  if (s == "fp32" || s == "float32" || s == "f32") return DType::kF32;
  if (s == "fp16" || s == "float16" || s == "f16" || s == "half") return DType::kF16;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  return std::nullopt;
}

void widenToFloat(ConstTensor src, float* dst) {
  for (size_t i = 0; i < src.elements; ++i) dst[i] = src.at(i);
}

}  // namespace lightwire::kernels
