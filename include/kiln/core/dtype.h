// Element types and the half-precision conversions the CPU side needs
// (casting master weights, reading FP16 tensors back for tests and checkpoints).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace kiln {

enum class DType : uint8_t { F32, F16, BF16, I32, U8, I64 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// safetensors spelling: "F32", "F16", "BF16", "I32", "U8", "I64".
const char* dtype_safetensors_name(DType t);
bool dtype_from_safetensors_name(const std::string& s, DType* out);

// IEEE binary16 and bfloat16 conversions with round-to-nearest-even, as CUDA's
// __float2half_rn and __float2bfloat16_rn do, so CPU and GPU casts agree bit for bit.
uint16_t float_to_half(float f);
float half_to_float(uint16_t h);
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t h);

}  // namespace kiln
