// Where kiln's CUTLASS kernels can run, for the GPU tests of them. Only tests/gpu's targets
// include this: they alone have the CUDA runtime's headers (kiln keeps them PRIVATE).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gpu/gpu_test_util.h"

#ifdef KILN_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kiln::test {

// kiln's CUTLASS kernels (src/backend/cuda/cutlass/) are sm_90a code: they run where libkiln was
// built with them (CMake's KILN_CUTLASS_KERNELS) and the GPU is compute capability 9.0.
#if defined(KILN_HAVE_CUDA) && defined(KILN_HAVE_CUTLASS)
inline constexpr bool kCutlassBuilt = true;
#else
inline constexpr bool kCutlassBuilt = false;
#endif

inline bool sm90_gpu() {
#ifdef KILN_HAVE_CUDA
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess)
    return false;
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

#define KILN_REQUIRE_SM90_CUTLASS()                                                                \
  do {                                                                                             \
    KILN_REQUIRE_GPU();                                                                            \
    if (!::kiln::test::kCutlassBuilt)                                                              \
      GTEST_SKIP() << "kiln was built without its CUTLASS kernels (CMake's KILN_CUTLASS_KERNELS)"; \
    if (!::kiln::test::sm90_gpu()) GTEST_SKIP() << "the CUTLASS kernels are sm_90a: not this GPU"; \
  } while (0)

#ifdef KILN_HAVE_CUDA
// A device buffer freed at scope exit, for the tests that call a CUTLASS unit directly.
struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 256)), cudaSuccess);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p(o.p) { o.p = nullptr; }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// v rounded to FP16 in a new device buffer.
inline DeviceBuffer upload_half(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = float_to_half(v[i]);
  DeviceBuffer b(h.size() * 2);
  EXPECT_EQ(cudaMemcpy(b.p, h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  return b;
}
#endif

}  // namespace kiln::test
