// Per-channel helpers shared by the convolution and fc kernels (their bias paths):
// y[r, c] += b[c] over an [rows, C] row-major map, and db[c] = sum_r dy[r, c] (double sums,
// deterministic: block partials in the stream's workspace, then one finalize pass).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kiln/core/dtype.h"

namespace kiln::cuda {

void launch_bias_add(void* y, DType dt, const float* b, int64_t rows, int64_t c, int sm_count,
                     cudaStream_t s);
// Workspace bytes launch_channel_sum needs for this shape.
size_t channel_sum_workspace(int64_t rows, int64_t c, int sm_count);
void launch_channel_sum(const void* dy, DType dt, float* db, int64_t rows, int64_t c,
                        void* workspace, int sm_count, cudaStream_t s);

// Channel padding (conv.cpp, KILN_PAD_CHANNELS): dst [rows, cp] = src [rows, c] with zeros in
// channels c..cp-1 (every element of dst is written), and back: dst [rows, c] = the first c
// channels of src [rows, cp].
void launch_pad_channels(const void* src, void* dst, DType dt, int64_t rows, int64_t c, int64_t cp,
                         int sm_count, cudaStream_t s);
void launch_unpad_channels(const void* src, void* dst, DType dt, int64_t rows, int64_t cp,
                           int64_t c, int sm_count, cudaStream_t s);

}  // namespace kiln::cuda
