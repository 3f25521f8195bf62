// The probe's plain CUDA helpers; see probe_kernels.h.
#include <algorithm>

#include "backend/cuda/bn_kernels.cuh"
#include "probe_kernels.h"

namespace kiln::probe {
namespace {

__device__ __forceinline__ uint64_t mix(uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void fill_kernel(__half* p, int64_t count, float lo, float hi, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float u = static_cast<float>(mix(seed * 0x9E3779B97F4A7C15ull + i) >> 40) * 0x1p-24f;
    p[i] = __float2half_rn(lo + (hi - lo) * u);
  }
}

__global__ void total_kernel(const double2* partial, int blocks, int64_t c, double2* total) {
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < c;
       j += int64_t{gridDim.x} * blockDim.x) {
    double s = 0.0, q = 0.0;
    for (int b = 0; b < blocks; ++b) {
      s += partial[b * c + j].x;
      q += partial[b * c + j].y;
    }
    total[j] = make_double2(s, q);
  }
}

__global__ void compare_kernel(const __half* a, const __half* b, int64_t count, float rel_tol,
                               float abs_tol, unsigned long long* result) {
  float worst = 0.0f;
  unsigned long long bad = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float x = __half2float(a[i]), y = __half2float(b[i]);
    const float d = fabsf(x - y);
    const bool ok = d <= abs_tol + rel_tol * fabsf(y);  // false for NaN too
    worst = ok || !isnan(d) ? fmaxf(worst, d) : INFINITY;
    bad += ok ? 0 : 1;
  }
  // Non-negative floats order as their bits do.
  atomicMax(result, static_cast<unsigned long long>(__float_as_uint(worst)));
  if (bad) atomicAdd(result + 1, bad);
}

__global__ void masked_grad_kernel(const __half* dx, const __half* dy2, const uint8_t* mask,
                                   int64_t count, __half* g) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const __half v = dy2 ? __float2half_rn(__half2float(dx[i]) + __half2float(dy2[i])) : dx[i];
    g[i] = (mask[i / 8] >> (i % 8)) & 1u ? v : __float2half_rn(0.0f);
  }
}

__global__ void fill_bytes_kernel(uint8_t* p, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x)
    p[i] = static_cast<uint8_t>(mix(seed * 0x9E3779B97F4A7C15ull + i) >> 56);
}

constexpr int kThreads = 256, kBlocks = 1024;

}  // namespace

cudaError_t kiln_bwd_sums(const __half* z, const __half* dx, const __half* dy2, const uint8_t* mask,
                          const float* mean, int64_t rows, int64_t c, int sm_count, void* partial,
                          cudaStream_t s) {
  if (c % 8 != 0 || cuda::kVecThreads % (c / 8) != 0) return cudaErrorInvalidValue;
  const int blocks = cuda::stats_vec_blocks(rows, c / 8, sm_count);
  cuda::bwd_partial_vec<__half>
      <<<blocks, cuda::kVecThreads, 0, s>>>(z, dx, dy2, mask, mean, static_cast<int>(rows),
                                            static_cast<int>(c), static_cast<double2*>(partial));
  return cudaGetLastError();
}

cudaError_t masked_grad(const __half* dx, const __half* dy2, const uint8_t* mask, int64_t count,
                        __half* g, cudaStream_t s) {
  masked_grad_kernel<<<kBlocks, kThreads, 0, s>>>(dx, dy2, mask, count, g);
  return cudaGetLastError();
}

cudaError_t fill_bytes(uint8_t* p, int64_t count, uint64_t seed, cudaStream_t s) {
  fill_bytes_kernel<<<kBlocks, kThreads, 0, s>>>(p, count, seed);
  return cudaGetLastError();
}

cudaError_t fill_uniform(__half* p, int64_t count, float lo, float hi, uint64_t seed,
                         cudaStream_t s) {
  fill_kernel<<<kBlocks, kThreads, 0, s>>>(p, count, lo, hi, seed);
  return cudaGetLastError();
}

size_t kiln_stats_bytes(int64_t rows, int64_t c, int sm_count) {
  return sizeof(double2) * static_cast<size_t>(cuda::stats_vec_blocks(rows, c / 8, sm_count) * c);
}

cudaError_t kiln_stats(const __half* z, int64_t rows, int64_t c, int sm_count, void* partial,
                       cudaStream_t s) {
  if (c % 8 != 0 || cuda::kVecThreads % (c / 8) != 0) return cudaErrorInvalidValue;
  const int blocks = cuda::stats_vec_blocks(rows, c / 8, sm_count);
  cuda::stats_partial_vec<__half><<<blocks, cuda::kVecThreads, 0, s>>>(
      z, static_cast<int>(rows), static_cast<int>(c), static_cast<double2*>(partial));
  return cudaGetLastError();
}

cudaError_t kiln_stats_total(const void* partial, int64_t rows, int64_t c, int sm_count,
                             double2* total, cudaStream_t s) {
  const int blocks = cuda::stats_vec_blocks(rows, c / 8, sm_count);
  total_kernel<<<static_cast<unsigned>((c + kThreads - 1) / kThreads), kThreads, 0, s>>>(
      static_cast<const double2*>(partial), blocks, c, total);
  return cudaGetLastError();
}

cudaError_t kiln_apply_relu(const __half* z, const float4* coef, int64_t rows, int64_t c,
                            int sm_count, __half* y, uint8_t* mask, cudaStream_t s) {
  if (c % 8 != 0 || cuda::kVecThreads % (c / 8) != 0 || rows >= (int64_t{1} << 31))
    return cudaErrorInvalidValue;
  // bn.cu's group_plan: two rows per thread per trip, up to 8 blocks per multiprocessor.
  const int64_t rpb = cuda::kVecThreads / (c / 8);
  const auto blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((rows + 2 * rpb - 1) / (2 * rpb), sm_count * 8)));
  cuda::apply_group<__half, true><<<blocks, cuda::kVecThreads, 0, s>>>(
      z, nullptr, y, mask, static_cast<int>(rows), static_cast<int>(c / 8), coef);
  return cudaGetLastError();
}

cudaError_t kiln_bn_dx(const __half* z, const __half* g, const float4* coef, int64_t rows,
                       int64_t c, int sm_count, __half* dz, cudaStream_t s) {
  if (c % 8 != 0 || cuda::kVecThreads % (c / 8) != 0 || rows >= (int64_t{1} << 31))
    return cudaErrorInvalidValue;
  // bn.cu's group_plan, as for the apply pass above.
  const int64_t rpb = cuda::kVecThreads / (c / 8);
  const auto blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((rows + 2 * rpb - 1) / (2 * rpb), sm_count * 8)));
  cuda::bwd_dx_group<__half><<<blocks, cuda::kVecThreads, 0, s>>>(
      z, g, nullptr, nullptr, dz, nullptr, static_cast<int>(rows), static_cast<int>(c / 8), coef);
  return cudaGetLastError();
}

cudaError_t compare_half(const __half* a, const __half* b, int64_t count, float rel_tol,
                         float abs_tol, unsigned long long* result, cudaStream_t s) {
  if (cudaError_t e = cudaMemsetAsync(result, 0, 2 * sizeof(unsigned long long), s);
      e != cudaSuccess)
    return e;
  compare_kernel<<<kBlocks, kThreads, 0, s>>>(a, b, count, rel_tol, abs_tol, result);
  return cudaGetLastError();
}

}  // namespace kiln::probe
