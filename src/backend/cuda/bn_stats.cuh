// BatchNorm's statistics pass over an FP16 or FP32 NHWC map with 16-byte loads: per-channel
// double sums of x and x^2 as [blocks][C] partials, which bn.cu's finalize pass adds up. Its
// own header so that tools/cutlass_probe times the very kernel that a training step runs.
#pragma once
#include <algorithm>
#include <cstdint>

#include "backend/cuda/device_util.cuh"

namespace kiln::cuda {

constexpr int kVecThreads = 256;  // threads of the 16-byte reduction and group kernels

// Blocks of stats_partial_vec for rows x (cv vectors of channels): 4 per multiprocessor at
// most, and no block without rows.
inline int stats_vec_blocks(int64_t rows, int64_t cv, int sm_count) {
  const int64_t rpb = kVecThreads / cv;
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((rows + rpb - 1) / rpb, int64_t{sm_count} * 4)));
}

// Reductions: each thread owns one vector of V channels (cv = C / V vectors per row;
// 256 % cv == 0) and walks rows with several independent 16-byte loads in flight; the block
// combines the threads of each channel vector in shared memory and writes the same
// [blocks][C] double partials as the plain kernels, so the finalize passes are shared.

template <typename T>
__device__ __forceinline__ uint4 load_row(const uint4* v, int r, int rows, int cv, int cvec) {
  return r < rows ? v[static_cast<int64_t>(r) * cv + cvec]
                  : make_uint4(0, 0, 0, 0);  // zeros add nothing
}

template <int V>
__device__ __forceinline__ void combine_store(double (&a)[V], double (&b)[V], int cv, int cvec,
                                              int64_t C, double2* partial) {
  __shared__ double sm[kVecThreads * 8];
#pragma unroll
  for (int j = 0; j < V; ++j) sm[threadIdx.x * V + j] = a[j];
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < cv) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      double acc = 0.0;
      for (int t = threadIdx.x; t < kVecThreads; t += cv) acc += sm[t * V + j];
      a[j] = acc;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < V; ++j) sm[threadIdx.x * V + j] = b[j];
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < cv) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      double acc = 0.0;
      for (int t = threadIdx.x; t < kVecThreads; t += cv) acc += sm[t * V + j];
      partial[static_cast<int64_t>(blockIdx.x) * C + cvec * V + j] = make_double2(a[j], acc);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kVecThreads)
    stats_partial_vec(const T* x, int rows, int C, double2* partial) {
  constexpr int V = kVec<T>;
  const int cv = C / V, cvec = threadIdx.x % cv, rpb = kVecThreads / cv, rstride = gridDim.x * rpb;
  const auto* xv = reinterpret_cast<const uint4*>(x);
  double s[V], ss[V];
#pragma unroll
  for (int j = 0; j < V; ++j) s[j] = ss[j] = 0.0;
  for (int r = blockIdx.x * rpb + threadIdx.x / cv; r < rows; r += 4 * rstride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = load_row<T>(xv, r + u * rstride, rows, cv, cvec);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const T* e = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const double f = to_f(e[j]);
        s[j] += f;
        ss[j] += f * f;
      }
    }
  }
  combine_store<V>(s, ss, cv, cvec, C, partial);
}

}  // namespace kiln::cuda
