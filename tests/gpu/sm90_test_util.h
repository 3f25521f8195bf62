// Where kiln's CUTLASS kernels can run, for the GPU tests of them. Only tests/gpu's targets
// include this: they alone have the CUDA runtime's headers (kiln keeps them PRIVATE).
#pragma once
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

}  // namespace kiln::test
