// The data gradient of a 1x1 stride-1 convolution with BatchNorm's dx pass folded into its
// operand load (issue 20): where z -> BN -> ReLU follows the convolution, today's backward runs
// BatchNorm's dx pass (dz = k1 (g - mean g - (z - mean) k3), reading g and z, writing dz), then
// the data gradient reads dz. This kernel reads g and z, forms dz in shared memory with the dx
// pass's arithmetic (the same FP16 bits), writes dz once for the weight gradient and multiplies
// it by W, so dz is never read back. Its epilogue is the SM90 data gradient's (dgrad_bn.h): the
// previous BatchNorm's masked gradient g' = mask ? round16(round16(dX) [+ dy2]) : 0 and its sums
// Σ g' and Σ g' (z' - mean'), in FP32 atomics.
//
// Hand-written mma.sync (m16n8k16, FP16 in, FP32 accumulation) rather than CUTLASS's SM90 WGMMA:
// these layers are bound by bytes (ResNet-50's 1x1 data gradients do ~50 FLOP a byte, the H100
// balances at ~300), and a transform between a TMA load and a shared-memory-sourced WGMMA is not
// something CUTLASS 3's mainloops offer.
//
// The step does not use it: exact, but 3x slower than the dx pass plus the SM90 data gradient
// on ResNet-50's 1x1 layers (kiln_cutlass_probe --fold-dgrad; bench/RESULTS.md, thirty-second
// session), chiefly because each 64-column tile of dX reads and folds g and z again.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace kiln::cuda {

struct FoldDgrad {
  // This convolution's BatchNorm, whose dx pass is folded: dz[m][k] = round16(coef.y (g - coef.z
  // - (z - coef.x) coef.w)), bwd_dx_group's arithmetic (bn_kernels.cuh) on an already-masked g.
  const __half* g = nullptr;     // [m][k] BatchNorm's masked output gradient
  const __half* z = nullptr;     // [m][k] BatchNorm's input (the convolution's output)
  const float4* coef = nullptr;  // [k] (mean, k1, mean of g, k3): the dx pass's coefficients
  __half* dz = nullptr;          // [m][k] or null: written once, for the weight gradient
  const __half* w = nullptr;     // [k][n] the 1x1 KRSC filter
  // The previous BatchNorm, which dX = dz W feeds (DgradBn's epilogue, dgrad_bn.h).
  const __half* z_prev = nullptr;      // [m][n] its input
  const uint8_t* mask_prev = nullptr;  // its ReLU's bits over [m][n] (bit e % 8 of byte e / 8)
  const __half* dy2 = nullptr;         // [m][n] or null: BN+add+ReLU's residual-path gradient
  const float* mean_prev = nullptr;    // [n] its saved batch mean
  __half* g_prev = nullptr;            // [m][n] out: mask ? round16(round16(dX) [+ dy2]) : 0
  float* sums = nullptr;               // [2][n] added into: Σ g', then Σ g' (z' - mean')
  int64_t m = 0, k = 0, n = 0;
  // The depth of the k slices the kernel stages: 32 (64-byte pieces of g's and z's rows, three
  // in flight), 64 (whole 128-byte lines, two in flight) or 0, 64 where k allows.
  int chunk = 0;
};

// Why the kernel cannot take c ("" when it can): k a multiple of the chunk and at least 64, n of
// 64, m below 2^31, every tensor 16-byte aligned (the mask 8-byte: a 64-wide tile's row of bits).
std::string fold_dgrad_refusal(const FoldDgrad& c);

// The persistent grid for c on sm_count SMs (sets the kernel's shared memory); once, outside a
// captured graph.
cudaError_t prepare_fold_dgrad(const FoldDgrad& c, int sm_count, unsigned* grid);

// Runs it on stream (sums must hold zeros, or the sums to add to); checks the launch.
cudaError_t launch_fold_dgrad(const FoldDgrad& c, unsigned grid, cudaStream_t stream);

}  // namespace kiln::cuda
