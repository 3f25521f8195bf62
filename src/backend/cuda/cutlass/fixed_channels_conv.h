// A forward convolution over 4 or 8 input channels (a first layer's 3 channels, padded) on
// CUTLASS's implicit GEMM for fixed channel counts (CUTLASS 2.x, mma.sync tensor cores, each
// pixel's channels one 8- or 16-byte access): cuDNN has only slow engines for such layers
// (VGG16-BN's first layer 1.39 ms a forward at batch 256 on an H100, ResNet-50's stem 0.59 ms),
// whose time is mostly their output's bytes. conv.cpp times it against cuDNN per layer
// (KILN_FIXED_CHANNELS_CONV, off: on an H100 it took 2.92 ms to cuDNN's 1.40, bench/RESULTS.md).
// Plain C++, like gemm_stats.h: the unit is compiled apart.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

namespace kiln::sm90 {

// y = conv(x, w), NHWC FP16, FP32 accumulation: x [n][h][w][c], w [k][r][s][c], y [n][p][q][k].
struct FixedChannelsConv {
  const void* x = nullptr;
  const void* w = nullptr;
  void* y = nullptr;
  int n = 0, h = 0, w_ = 0, c = 0, k = 0, r = 0, s = 0, p = 0, q = 0;
  int pad_h = 0, pad_w = 0, stride_h = 1, stride_w = 1;
};

// "" when the unit can run the problem (c 4 or 8, k a multiple of 8, 16-byte aligned tensors,
// CUTLASS's own checks), else why not; launches nothing.
std::string fixed_channels_conv_check(const FixedChannelsConv& p);
size_t fixed_channels_conv_workspace(const FixedChannelsConv& p);
// "" when it was queued on the stream, else what failed.
std::string fixed_channels_conv_run(const FixedChannelsConv& p, void* workspace,
                                    cudaStream_t stream);

}  // namespace kiln::sm90
