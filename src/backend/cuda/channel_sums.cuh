// Per-channel sums over an NHWC map, in double: the reductions that BatchNorm (bn.cu) and
// SyncBN (dist.cu) share. Blocks of 32 channels x 8 rows; each block writes one double2
// partial per channel and row chunk into the stream's workspace, and a finalize pass (in the
// caller) adds the chunks up.
#pragma once
#include "backend/cuda/device_util.cuh"

namespace kiln::cuda {

constexpr int kCx = 32, kCy = 8;  // block: 32 channels x 8 rows

struct ChannelDims {
  int64_t rows = 0, c = 0;  // rows = N*H*W
  int gy = 1;               // row chunks (grid.y)
};

// Enough row chunks to fill the GPU (4 blocks per SM), each at least 8 block-rows long.
inline ChannelDims channel_dims(const Context& ctx, const Nhwc& s) {
  ChannelDims d;
  d.rows = s.n * s.h * s.w;
  d.c = s.c;
  const int64_t gx = (d.c + kCx - 1) / kCx;
  int64_t gy = (static_cast<int64_t>(ctx.sm_count) * 4 + gx - 1) / gx;
  gy = std::min<int64_t>(gy, (d.rows + 8 * kCy - 1) / (8 * kCy));
  d.gy = static_cast<int>(std::max<int64_t>(gy, 1));
  return d;
}

inline size_t partial_bytes(const ChannelDims& d) {
  return sizeof(double2) * static_cast<size_t>(d.gy * d.c);
}

__device__ __forceinline__ void block_reduce_store(double a, double b, double2* partial, int64_t c,
                                                   int64_t C) {
  __shared__ double sa[kCy][kCx], sb[kCy][kCx];
  sa[threadIdx.y][threadIdx.x] = a;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int j = 1; j < kCy; ++j) {
      a += sa[j][threadIdx.x];
      b += sb[j][threadIdx.x];
    }
    partial[static_cast<int64_t>(blockIdx.y) * C + c] = make_double2(a, b);
  }
}

// sum x and sum x^2 per channel, per row chunk.
template <typename T>
__global__ void stats_partial_kernel(const T* x, int64_t rows, int64_t C, double2* partial) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCx + threadIdx.x;
  double s = 0.0, ss = 0.0;
  if (c < C) {
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * kCy + threadIdx.y; r < rows;
         r += static_cast<int64_t>(gridDim.y) * kCy) {
      const double v = to_f(x[r * C + c]);
      s += v;
      ss += v * v;
    }
  }
  block_reduce_store(s, ss, partial, c, C);
}

// The ReLU mask of a fused op (ops.def): bit (i % 8) of byte i / 8 set where the ReLU passed
// element i; a null mask passes everything.
// The gradient at an output with two contributions: dy plus dy2 (null: none), rounded to T as
// the add op rounds its sum, so the fused gradient sum gives the unfused chain's bits.
template <typename T>
__device__ __forceinline__ T grad_sum(T dy, const T* dy2, int64_t i) {
  return dy2 ? from_f<T>(to_f(dy) + to_f(dy2[i])) : dy;
}

__device__ __forceinline__ bool mask_bit(const uint8_t* mask, int64_t i) {
  return mask == nullptr || ((mask[i >> 3] >> (i & 7)) & 1u) != 0;
}

// cbr_pool_bwd's dy is the gradient of z's max-pool (ops.def): row r of z (one pixel) reads
// the dy row of the pool window that holds it, and the mask says whether the window routes
// its gradient there. pool 0: dy has z's rows.
// Since the pool tiles every image (pool divides z's height), image row q = b H + h of z
// lies in pooled image row q / pool: one 32-bit division by the width (the kernels' rows are
// below 2^31) instead of decomposing the row into image, height and width (three 64-bit
// divisions a row made the BN backward slow).
struct PoolMap {
  int pool = 0, w = 0;  // the pool's window (= stride); z's width
  __device__ __forceinline__ int64_t row(int64_t r) const {
    if (pool == 0) return r;
    const auto r32 = static_cast<uint32_t>(r), uw = static_cast<uint32_t>(w),
               up = static_cast<uint32_t>(pool);
    const uint32_t q = r32 / uw, x = r32 - q * uw;
    if (up == 2) return static_cast<int64_t>((q >> 1) * (uw >> 1) + (x >> 1));
    return static_cast<int64_t>((q / up) * (uw / up) + x / up);
  }
};

// sum g and sum g * (x - mean) per channel, per row chunk, with g = dy where the mask passes
// it (the ReLU backward of a fused op) and 0 elsewhere.
template <typename T>
__global__ void bwd_partial_kernel(const T* x, const T* dy, const T* dy2, const uint8_t* mask,
                                   const float* mean, int64_t rows, int64_t C, double2* partial,
                                   PoolMap pm = {}) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCx + threadIdx.x;
  double s = 0.0, sx = 0.0;
  if (c < C) {
    const double mu = mean[c];
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * kCy + threadIdx.y; r < rows;
         r += static_cast<int64_t>(gridDim.y) * kCy) {
      const double g =
          mask_bit(mask, r * C + c) ? to_f(grad_sum(dy[pm.row(r) * C + c], dy2, r * C + c)) : 0.0;
      s += g;
      sx += g * (static_cast<double>(to_f(x[r * C + c])) - mu);
    }
  }
  block_reduce_store(s, sx, partial, c, C);
}

}  // namespace kiln::cuda
