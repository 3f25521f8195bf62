// The interface of kiln's SM90 CUTLASS kernels (gemm_stats_sm90.cu), in plain C++ so that the
// code calling them (the CUDA backend's cutlass_conv.cpp, tools/cutlass_probe) never sees
// CUTLASS: z = x w^T for a 1x1 stride-1 NHWC convolution, with BatchNorm's per-channel sums of
// z and z^2 taken in the GEMM's epilogue.
#pragma once
#include <cstdint>

#include "backend/cuda/cutlass/sm90_kernel.h"

namespace kiln::sm90 {

// One problem. Rows are N*H*W pixels, columns output channels.
struct GemmStats {
  const void* x = nullptr;  // [m][k] FP16: the NHWC input
  const void* w = nullptr;  // [n][k] FP16: the 1x1 KRSC filter
  void* z = nullptr;        // [m][n] FP16: the NHWC output
  float* sum = nullptr;     // [n] FP32: sum over rows of z (none: not written)
  float* sumsq = nullptr;   // [n] FP32: sum over rows of z^2
  int64_t m = 0, n = 0, k = 0;
  // The prologue units (gemm_bn_prologue_*) alone, else null: x is the z of a BatchNorm + ReLU
  // that the GEMM applies on its load, multiplying relu(round16((x - mean) * scale + beta));
  // float4 [k] = (mean, gamma * invstd, beta, -), BatchNorm's apply coefficients
  // (gemm_bn_folded_*: (gamma * invstd, beta - mean * gamma * invstd, -, -)).
  const void* bn_coef = nullptr;
  int sm_count = 0;
  int device_id = 0;             // the CUDA device the pointers live on
  bool clear_by_kernel = false;  // sm90_kernel.h
};

// One compiled kernel: a tile shape, a stats mode and a cluster shape.
using GemmStatsKernel = UnitKernel<GemmStats>;

// The variants the CUDA backend links; X(tile_m, tile_n, mode, cluster_m, cluster_n).
// CMakeLists.txt reads the X(...) entries off this block (one unit each, each compiling for
// minutes), so keep them written out as numbers and names, and few. 256x128 was the fastest
// tile on most of ResNet-50's 1x1 layers (bench/RESULTS.md); reg_partials is the deterministic
// form (KILN_DETERMINISTIC), reg_atomic the default.
#define KILN_GEMM_STATS_BACKEND_VARIANTS(X) \
  X(256, 128, reg_atomic, 1, 1)             \
  X(256, 128, reg_partials, 1, 1)

#define KILN_GEMM_STATS_FN(tm, tn, mode, cm, cn) KILN_SM90_FN(gemm_stats, tm, tn, mode, cm, cn)
#define KILN_GEMM_STATS_DECLARE(tm, tn, mode, cm, cn) \
  GemmStatsKernel KILN_GEMM_STATS_FN(tm, tn, mode, cm, cn)();
#define KILN_GEMM_BN_PROLOGUE_FN(tm, tn, mode, cm, cn) \
  KILN_SM90_FN(gemm_bn_prologue, tm, tn, mode, cm, cn)
#define KILN_GEMM_BN_PROLOGUE_DECLARE(tm, tn, mode, cm, cn) \
  GemmStatsKernel KILN_GEMM_BN_PROLOGUE_FN(tm, tn, mode, cm, cn)();
#define KILN_GEMM_BN_FOLDED_FN(tm, tn, mode, cm, cn) \
  KILN_SM90_FN(gemm_bn_folded, tm, tn, mode, cm, cn)
#define KILN_GEMM_BN_FOLDED_DECLARE(tm, tn, mode, cm, cn) \
  GemmStatsKernel KILN_GEMM_BN_FOLDED_FN(tm, tn, mode, cm, cn)();
KILN_GEMM_STATS_BACKEND_VARIANTS(KILN_GEMM_STATS_DECLARE)

}  // namespace kiln::sm90
