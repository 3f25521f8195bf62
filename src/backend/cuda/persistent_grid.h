// The grid of a persistent kernel (one that walks tiles until none are left): as many CTAs as
// fit on the GPU at once, at most one a tile. Shared by kiln's hand-written kernels (the first
// layer's, fold_dgrad.cu); host code, in the .cu files that define the kernels.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace kiln::cuda {

// A persistent kernel's grid: shared memory set to bytes, then as many CTAs as fit on sm_count
// SMs at once, at most one per tile. Once, while compiling, outside a captured CUDA Graph.
template <typename Kernel>
cudaError_t prepare_persistent(Kernel kernel, int threads, size_t bytes, int64_t tiles,
                               int sm_count, unsigned* grid) {
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes));
      e != cudaSuccess)
    return e;
  int per_sm = 0;
  if (cudaError_t e =
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, bytes);
      e != cudaSuccess)
    return e;
  *grid = static_cast<unsigned>(
      std::min<int64_t>(tiles, static_cast<int64_t>(sm_count) * std::max(per_sm, 1)));
  return cudaSuccess;
}

}  // namespace kiln::cuda
