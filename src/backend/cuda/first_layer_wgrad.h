// A first layer's weight gradient, written for its shape as first_layer_conv.h's forward is:
// dw[k][tap][c] = Σ over output pixels of dz[pixel][k] · x[the tap's input pixel][c], 4 channels
// into 64, FP16 operands, FP32 sums. A persistent grid walks tiles of 64 output pixels: dz's tile
// and the tile's input patches (each a tap's 4 channels, 8 bytes) are staged in shared memory by
// cp.async, the next tile's while this one's are multiplied (staged and then computed, it was
// latency-bound: 2.7x the time), and mma.sync takes dzᵀ as A and the patches as B (both through
// ldmatrix.trans), so each CTA keeps its share of dw in registers across its tiles; the CTAs'
// shares are then added in a fixed order (deterministic). It beats cuDNN on VGG16-BN's 3x3 first
// layer and loses on ResNet-50's 7x7 stem (bench/RESULTS.md); the step times the two per layer.
// With BatchNorm's backward folded in (FirstLayerBnFold), dz is formed from BatchNorm's input, the
// gradient g and the coefficients its finalize pass left, as that backward's dx pass forms it
// (the same arithmetic, so the same FP16 bits), in the registers the MMA takes it from (formed in
// shared memory first, with a pass and a barrier a tile more, it lost): dz is neither written nor
// read. The step uses it under KILN_FIRST_LAYER_WGRAD and KILN_FIRST_LAYER_BN_FOLD (fused.cpp,
// first_layer_bwd.cpp); tests/gpu/gpu_first_layer_test.cpp checks it.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "backend/cuda/first_layer_conv.h"

namespace kiln::cuda {

// dz = k.y (g - k.z - (z - k.x) k.w) with k = coef[channel] and g = dz's buffer where mask's bit
// (ReLU's, one per element) passes it, else 0: bwd_dx_group's arithmetic (bn_kernels.cuh).
struct FirstLayerBnFold {
  const __half* z = nullptr;      // [n][p][q][64]: BatchNorm's input; null: no fold
  const uint8_t* mask = nullptr;  // [n][p][q][64 / 8]; null passes every element
  const float4* coef = nullptr;   // [64]: BatchNorm's backward finalize's coefficients
};

struct FirstLayerWgrad : FirstLayerShape {
  const __half* x = nullptr;   // [n][h][w][4]
  const __half* dz = nullptr;  // [n][p][q][64]; BatchNorm's g where bn.z is set
  void* dw = nullptr;          // [64][r][s][dw_channels], FP16 or FP32 (dw_f32)
  bool dw_f32 = true;
  int dw_channels = 4;        // x's channels before padding to 4 (1..4): dw's last dimension
  float* partials = nullptr;  // first_layer_wgrad_workspace(grid) bytes
  FirstLayerBnFold bn;
};

// "" where launch_first_layer_wgrad takes the problem, else why not.
std::string first_layer_wgrad_refusal(const FirstLayerWgrad& c);

// The persistent grid's CTAs for sm_count SMs (and the kernel's shared memory set): once, while
// compiling, outside a captured CUDA Graph.
cudaError_t prepare_first_layer_wgrad(const FirstLayerWgrad& c, int sm_count, unsigned* grid);
// Bytes of the CTAs' partial sums (c.partials).
size_t first_layer_wgrad_workspace(const FirstLayerWgrad& c, unsigned grid);
// Queues the two kernels (the CTAs' shares, then their fixed-order sum into dw); the launch's
// error.
cudaError_t launch_first_layer_wgrad(const FirstLayerWgrad& c, unsigned grid, cudaStream_t stream);

}  // namespace kiln::cuda
