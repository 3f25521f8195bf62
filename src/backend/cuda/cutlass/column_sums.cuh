// The host side shared by kiln's SM90 GEMM units whose epilogue sums two values per output
// column (gemm_stats_sm90.cu: z and z^2; dgrad_bn_sm90.cu: g and g (z - mean)): the persistent
// grid's CTA count, clearing the sums, and the finalize kernel that adds per-CTA (or per-tile)
// partial rows. Included by those units alone.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace kiln::sm90 {
namespace {

// The persistent grid's CTA count for the register-sum epilogues: a multiple of the column
// blocks where it costs under 4% of the SMs, so that each CTA's tiles keep to one column block
// (the scheduler rasters along N: CTA i takes tiles i, i + CTAs, ...) and its sums are reduced
// once.
int column_block_ctas(int64_t n, int tile_n, int sm_count) {
  const int blocks = static_cast<int>((n + tile_n - 1) / tile_n);
  const int rounded = sm_count - sm_count % blocks;
  return blocks <= sm_count && rounded * 25 >= sm_count * 24 ? rounded : sm_count;
}

// sum[c] and sumsq[c] = the partials' column c over their rows. Blocks of 32 columns x 8 row
// slices; several blocks down each column (enough to fill the GPU) combine with atomics into
// sums zeroed first, one block stores them.
constexpr int kFinX = 32, kFinY = 8;
__global__ void __launch_bounds__(kFinX* kFinY)
    finalize_partials(const float* __restrict__ ps, const float* __restrict__ pq, int rows, int n,
                      int ld, float* sum, float* sumsq) {
  __shared__ float ss[kFinY][kFinX], sq[kFinY][kFinX];
  const int c = blockIdx.x * kFinX + threadIdx.x;
  float a = 0.0f, b = 0.0f;
  if (c < n) {
    for (int r = blockIdx.y * kFinY + threadIdx.y; r < rows; r += gridDim.y * kFinY) {
      a += ps[static_cast<int64_t>(r) * ld + c];
      b += pq[static_cast<int64_t>(r) * ld + c];
    }
  }
  ss[threadIdx.y][threadIdx.x] = a;
  sq[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < n) {
    for (int j = 1; j < kFinY; ++j) {
      a += ss[j][threadIdx.x];
      b += sq[j][threadIdx.x];
    }
    if (gridDim.y == 1) {
      sum[c] = a;
      sumsq[c] = b;
    } else {
      atomicAdd(sum + c, a);
      atomicAdd(sumsq + c, b);
    }
  }
}

// a [na] and b [nb] = 0 (b may be null): the clear as a kernel, whose graph node the kernels
// around it follow sooner than a memset's.
__global__ void zero_two(float* __restrict__ a, int64_t na, float* __restrict__ b, int64_t nb) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < na; i += step)
    a[i] = 0.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nb; i += step)
    b[i] = 0.0f;
}

// Zeroes a [na] and b [nb] (b may be null): by zero_two where by_kernel, else by memsets, one
// where b follows a.
std::string clear_floats(float* a, int64_t na, float* b, int64_t nb, bool by_kernel,
                         cudaStream_t stream) {
  if (!a) return "";
  if (b == a + na) na += nb, b = nullptr, nb = 0;
  if (!b) nb = 0;
  if (by_kernel) {
    constexpr int kThreads = 256;
    const int64_t most = std::max(na, nb);
    const int blocks = static_cast<int>(std::min<int64_t>(1024, (most + kThreads - 1) / kThreads));
    if (blocks == 0) return "";
    zero_two<<<blocks, kThreads, 0, stream>>>(a, na, b, nb);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? "" : std::string("zero_two launch: ") + cudaGetErrorString(e);
  }
  cudaError_t e = cudaMemsetAsync(a, 0, sizeof(float) * static_cast<size_t>(na), stream);
  if (e == cudaSuccess && b)
    e = cudaMemsetAsync(b, 0, sizeof(float) * static_cast<size_t>(nb), stream);
  return e == cudaSuccess ? "" : std::string("cudaMemsetAsync: ") + cudaGetErrorString(e);
}

// Zeroes sum and sumsq [n].
std::string clear_sums(float* sum, float* sumsq, int64_t n, bool by_kernel, cudaStream_t stream) {
  return clear_floats(sum, n, sumsq, n, by_kernel, stream);
}

// The finalize kernel over partial rows [rows][ld] (ps, then pq): one block down each column
// where one_block (a row per CTA: few), else enough blocks to fill the GPU.
std::string finalize_partial_rows(const float* ps, const float* pq, int rows, int64_t n, int ld,
                                  bool one_block, int sm_count, float* sum, float* sumsq,
                                  bool clear_by_kernel, cudaStream_t stream) {
  const int gx = static_cast<int>((n + kFinX - 1) / kFinX);
  const int want = std::max(1, 2 * sm_count / gx), most = (rows + 4 * kFinY - 1) / (4 * kFinY);
  const dim3 grid(gx, one_block ? 1 : std::max(1, std::min(want, most)));
  if (grid.y > 1) {
    if (std::string err = clear_sums(sum, sumsq, n, clear_by_kernel, stream); !err.empty())
      return err;
  }
  finalize_partials<<<grid, dim3(kFinX, kFinY), 0, stream>>>(ps, pq, rows, static_cast<int>(n), ld,
                                                             sum, sumsq);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return std::string("finalize_partials launch: ") + cudaGetErrorString(e);
  return "";
}

}  // namespace
}  // namespace kiln::sm90
