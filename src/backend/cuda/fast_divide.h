// A division by a runtime value that is the same for a whole kernel, for device code that
// places elements by index (the first layer's kernels, the pooled BatchNorm pass).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::cuda {

// n / d for 0 <= n < 2^31 by a multiply and a shift (Granlund and Montgomery's round-up method),
// as a kernel places each output row: a divide by a runtime value is ~20 instructions.
struct FastDivide {
  uint32_t multiplier = 1;
  int shift = 0;
  FastDivide() = default;
  explicit FastDivide(int d) {
    while ((int64_t{1} << shift) < d) ++shift;  // ceil(log2 d)
    multiplier = static_cast<uint32_t>((uint64_t{1} << 32) *
                                           ((uint64_t{1} << shift) - static_cast<uint64_t>(d)) /
                                           static_cast<uint64_t>(d) +
                                       1);
  }
  __host__ __device__ int quotient(int n) const {
    const auto u = static_cast<uint32_t>(n);
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi(u, multiplier);
#else
    const auto hi = static_cast<uint32_t>((static_cast<uint64_t>(u) * multiplier) >> 32);
#endif
    return static_cast<int>((hi + u) >> shift);  // hi <= u < 2^31: no overflow
  }
};

}  // namespace kiln::cuda
