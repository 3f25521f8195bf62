// A first layer's forward convolution, written for its shape: 4 input channels (3 padded, as
// KILN_PAD_CHANNELS pads them) into 64, FP16 NHWC, any filter size, stride and padding, with
// BatchNorm's per-channel sums of the FP16 z taken on the way. cuDNN has only slow engines for
// such layers (VGG16-BN's first layer 1.39 ms a forward at batch 256 on an H100, where its
// 1.64 GB of output need ~0.55 ms; ResNet-50's stem 0.59 ms), and CUTLASS's fixed-channels
// implicit GEMM was slower still (2.92 ms, bench/RESULTS.md): both tile the work as a GEMM whose
// K (taps x 4 channels) is one or two k-blocks, so each tile pays a pipeline's fill for little
// work. Here a persistent grid of CTAs walks tiles of 256 output pixels; each warp takes 32 of
// them through mma.sync (16x8x16, FP32 accumulation) as zᵀ = W xᵀ, its B fragments loaded
// straight from x in global memory (a pixel's 4 channels of one tap are 8 bytes, one load;
// neighbouring pixels' taps share cache lines, so the reads hit L1) and the filter, A, kept in
// shared memory; z leaves through shared memory as 16-byte stores, and the sums are taken from
// the staged FP16 z on the tensor cores too (Σz against ones, Σz² as the diagonal of z's Gram
// matrix: FP16 products are exact in FP32). Few instructions an output matter more than anything
// here: the first form, with 64-bit divides placing rows and a scalar sums loop, was issue-bound
// at 2.4x its bytes.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "backend/cuda/fast_divide.h"

namespace kiln::cuda {

// A first layer's convolution: n images of h x w with 4 channels, an r x s filter.
struct FirstLayerShape {
  int n = 0, h = 0, w_ = 0, r = 1, s = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
  int p() const { return (h + 2 * pad_h - r) / stride_h + 1; }
  int q() const { return (w_ + 2 * pad_w - s) / stride_w + 1; }
};

struct FirstLayerConv : FirstLayerShape {
  const __half* x = nullptr;  // [n][h][w][4]
  const __half* w = nullptr;  // [64][r][s][4]
  __half* z = nullptr;        // [n][p][q][64]
  float* sums = nullptr;      // [2][64]: sum z, then sum z^2 (FP32, of the FP16 z); or none
  // With sums: first_layer_conv_workspace(grid) bytes, zeros before the first launch (each
  // launch leaves them so): the CTAs' shares, added in a fixed order.
  float* partials = nullptr;
};

inline constexpr int kFirstLayerChannels = 4, kFirstLayerOutputs = 64;

// "" where the first layer's kernels take the shape with K (taps x 4, padded to 16) up to max_k,
// else why not (the kernels' own refusals add what they need of their operands).
std::string first_layer_shape_refusal(const FirstLayerShape& c, int max_k);

// "" where launch_first_layer_conv takes the problem, else why not.
std::string first_layer_conv_refusal(const FirstLayerConv& c);

// Sets the kernel's shared memory for the problem and puts in *grid the persistent grid's CTAs
// for sm_count SMs: once, while compiling, outside a captured CUDA Graph (as the SM90 units'
// check() does CUTLASS's).
cudaError_t prepare_first_layer_conv(const FirstLayerConv& c, int sm_count, unsigned* grid);
// The workspace a launch on `grid` CTAs takes for its sums (FirstLayerConv::partials).
size_t first_layer_conv_workspace(unsigned grid);
// Queues the kernel on the stream (the sums written, not added to); the launch's error.
cudaError_t launch_first_layer_conv(const FirstLayerConv& c, unsigned grid, cudaStream_t stream);

}  // namespace kiln::cuda
