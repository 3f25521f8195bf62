// Per-channel bias add and bias gradient, channel padding (see channel_ops.h).
#include "backend/cuda/channel_ops.h"
#include "backend/cuda/device_util.cuh"

namespace kiln::cuda {

namespace {

constexpr int kCx = 32, kCy = 8;

template <typename T>
__global__ void bias_add_kernel(T* y, const float* b, int64_t count, int64_t C) {
  KILN_GRID_STRIDE(i, count) y[i] = from_f<T>(to_f(y[i]) + b[i % C]);
}

template <typename T>
__global__ void channel_partial_kernel(const T* dy, int64_t rows, int64_t C, double* partial) {
  __shared__ double sm[kCy][kCx];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCx + threadIdx.x;
  double s = 0.0;
  if (c < C) {
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * kCy + threadIdx.y; r < rows;
         r += static_cast<int64_t>(gridDim.y) * kCy) {
      s += to_f(dy[r * C + c]);
    }
  }
  sm[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int j = 1; j < kCy; ++j) s += sm[j][threadIdx.x];
    partial[static_cast<int64_t>(blockIdx.y) * C + c] = s;
  }
}

// One thread per row of the padded map: it writes the whole row, so dst needs no zeroing.
template <typename T>
__global__ void pad_channels_kernel(const T* src, T* dst, int64_t rows, int64_t c, int64_t cp) {
  KILN_GRID_STRIDE(r, rows) {
    for (int64_t j = 0; j < cp; ++j) dst[r * cp + j] = j < c ? src[r * c + j] : from_f<T>(0.0f);
  }
}

// The first layer's case, 1 to 3 half-precision channels to 4: one 8-byte store a row (zero is
// all bits clear in FP16 and BF16 alike).
__global__ void pad_16bit_to_4_kernel(const uint16_t* src, uint2* dst, int64_t rows, int c) {
  KILN_GRID_STRIDE(r, rows) {
    uint32_t v[4] = {0, 0, 0, 0};
    for (int j = 0; j < c; ++j) v[j] = src[r * c + j];
    dst[r] = make_uint2(v[0] | (v[1] << 16), v[2] | (v[3] << 16));
  }
}

template <typename T>
__global__ void unpad_channels_kernel(const T* src, T* dst, int64_t count, int64_t cp, int64_t c) {
  KILN_GRID_STRIDE(i, count) dst[i] = src[(i / c) * cp + i % c];
}

unsigned elementwise_grid(int64_t count, int sm_count) {
  const int64_t want = (count + 255) / 256, cap = static_cast<int64_t>(sm_count) * 16;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(want, cap)));
}

__global__ void channel_finalize_kernel(const double* partial, int gy, int64_t C, float* db) {
  KILN_GRID_STRIDE(c, C) {
    double s = 0.0;
    for (int j = 0; j < gy; ++j) s += partial[j * C + c];
    db[c] = static_cast<float>(s);
  }
}

int row_chunks(int64_t rows, int64_t c, int sm_count) {
  const int64_t gx = (c + kCx - 1) / kCx;
  int64_t gy = (static_cast<int64_t>(sm_count) * 4 + gx - 1) / gx;
  gy = std::min<int64_t>(gy, (rows + 8 * kCy - 1) / (8 * kCy));
  return static_cast<int>(std::max<int64_t>(gy, 1));
}

}  // namespace

void launch_bias_add(void* y, DType dt, const float* b, int64_t rows, int64_t c, int sm_count,
                     cudaStream_t s) {
  const int64_t count = rows * c;
  const unsigned grid = elementwise_grid(count, sm_count);
  KILN_DISPATCH_FLOAT(dt, T, {
    bias_add_kernel<T><<<grid, 256, 0, s>>>(static_cast<T*>(y), b, count, c);
    KILN_LAUNCH_CHECK("bias add");
  });
}

size_t channel_sum_workspace(int64_t rows, int64_t c, int sm_count) {
  return sizeof(double) * static_cast<size_t>(row_chunks(rows, c, sm_count) * c);
}

void launch_channel_sum(const void* dy, DType dt, float* db, int64_t rows, int64_t c,
                        void* workspace, int sm_count, cudaStream_t s) {
  const int gy = row_chunks(rows, c, sm_count);
  const dim3 grid(static_cast<unsigned>((c + kCx - 1) / kCx), static_cast<unsigned>(gy));
  auto* partial = static_cast<double*>(workspace);
  KILN_DISPATCH_FLOAT(dt, T, {
    channel_partial_kernel<T>
        <<<grid, dim3(kCx, kCy), 0, s>>>(static_cast<const T*>(dy), rows, c, partial);
    KILN_LAUNCH_CHECK("bias grad sums");
  });
  channel_finalize_kernel<<<static_cast<unsigned>((c + 255) / 256), 256, 0, s>>>(partial, gy, c,
                                                                                 db);
  KILN_LAUNCH_CHECK("bias grad finalize");
}

void launch_pad_channels(const void* src, void* dst, DType dt, int64_t rows, int64_t c, int64_t cp,
                         int sm_count, cudaStream_t s) {
  if (dtype_size(dt) == 2 && cp == 4 && c < 4) {
    pad_16bit_to_4_kernel<<<elementwise_grid(rows, sm_count), 256, 0, s>>>(
        static_cast<const uint16_t*>(src), static_cast<uint2*>(dst), rows, static_cast<int>(c));
    KILN_LAUNCH_CHECK("pad channels to 4");
    return;
  }
  KILN_DISPATCH_FLOAT(dt, T, {
    pad_channels_kernel<T><<<elementwise_grid(rows, sm_count), 256, 0, s>>>(
        static_cast<const T*>(src), static_cast<T*>(dst), rows, c, cp);
    KILN_LAUNCH_CHECK("pad channels");
  });
}

void launch_unpad_channels(const void* src, void* dst, DType dt, int64_t rows, int64_t cp,
                           int64_t c, int sm_count, cudaStream_t s) {
  const int64_t count = rows * c;
  KILN_DISPATCH_FLOAT(dt, T, {
    unpad_channels_kernel<T><<<elementwise_grid(count, sm_count), 256, 0, s>>>(
        static_cast<const T*>(src), static_cast<T*>(dst), count, cp, c);
    KILN_LAUNCH_CHECK("unpad channels");
  });
}

}  // namespace kiln::cuda
