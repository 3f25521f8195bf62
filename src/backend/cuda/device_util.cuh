// Device-side helpers for the .cu kernels: float conversions of the feature types, device
// scalar loads and stores, a dtype dispatch, and FP32 arithmetic that the compiler may not
// contract into FMAs (the region kernels must round exactly as the CPU loops do).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/cuda_kernel.h"

namespace kiln::cuda {

__device__ __forceinline__ float to_f(float v) {
  return v;
}
__device__ __forceinline__ float to_f(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ float to_f(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// IEEE single operations, never fused (nvcc contracts a*b+c into an FMA by default; the
// CPU reference does not).
__device__ __forceinline__ float fmul(float a, float b) {
  return __fmul_rn(a, b);
}
__device__ __forceinline__ float fadd(float a, float b) {
  return __fadd_rn(a, b);
}
__device__ __forceinline__ float fsub(float a, float b) {
  return __fsub_rn(a, b);
}
__device__ __forceinline__ float fdiv(float a, float b) {
  return __fdiv_rn(a, b);
}

__device__ __forceinline__ double load_scalar(DevScalar s, double absent) {
  switch (s.kind) {
    case 1:
      return static_cast<double>(*static_cast<const float*>(s.p));
    case 2:
      return static_cast<double>(*static_cast<const int32_t*>(s.p));
    case 3:
      return static_cast<double>(*static_cast<const int64_t*>(s.p));
    default:
      return absent;
  }
}
__device__ __forceinline__ void store_scalar(DevScalar s, double v) {
  switch (s.kind) {
    case 1:
      *static_cast<float*>(s.p) = static_cast<float>(v);
      break;
    case 2:
      *static_cast<int32_t*>(s.p) = static_cast<int32_t>(v);
      break;
    case 3:
      *static_cast<int64_t*>(s.p) = static_cast<int64_t>(v);
      break;
    default:
      break;
  }
}

#define KILN_GRID_STRIDE(i, count)                                                           \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (count); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

}  // namespace kiln::cuda

// Calls F with a value of the C++ type of a float dtype: KILN_DISPATCH_FLOAT(dt, T, { ... }).
#define KILN_DISPATCH_FLOAT(dtype, T, ...)                                              \
  do {                                                                                  \
    switch (dtype) {                                                                    \
      case ::kiln::DType::F32: {                                                        \
        using T = float;                                                                \
        __VA_ARGS__;                                                                    \
      } break;                                                                          \
      case ::kiln::DType::F16: {                                                        \
        using T = __half;                                                               \
        __VA_ARGS__;                                                                    \
      } break;                                                                          \
      case ::kiln::DType::BF16: {                                                       \
        using T = __nv_bfloat16;                                                        \
        __VA_ARGS__;                                                                    \
      } break;                                                                          \
      default:                                                                          \
        KILN_FAIL(Internal, "no float dispatch for dtype ", ::kiln::dtype_name(dtype)); \
    }                                                                                   \
  } while (0)

namespace kiln::cuda {

// The 16-byte paths: V elements of T per access (8 f16, 4 f32). They apply when the count
// is a multiple of V, every pointer is 16-byte aligned (tensors are 256-byte aligned) and the
// vector count fits an int (so index arithmetic stays 32-bit).
template <typename T>
inline constexpr int kVec = 16 / static_cast<int>(sizeof(T));

inline bool vec_fits(const Options& o, int64_t count, int width,
                     std::initializer_list<const void*> ptrs) {
  if (!o.vector_kernels || count % width != 0 || count / width >= (int64_t{1} << 31)) return false;
  for (const void* p : ptrs) {
    if (p && (reinterpret_cast<uintptr_t>(p) & 15u) != 0) return false;
  }
  return true;
}

}  // namespace kiln::cuda
