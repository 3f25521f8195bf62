// The interface of kiln's SM90 implicit-GEMM convolution with BatchNorm's statistics
// (conv_stats_sm90.cu), in plain C++ like gemm_stats.h: z = conv(x, w) for an NHWC FP16
// convolution of any filter size, stride and padding (VGG's and ResNet-50's 3x3 layers), with
// the per-channel sums of z and z^2 taken from the accumulators in the epilogue, so BatchNorm
// skips its statistics pass. Each CTA adds its column sums with FP32 atomics (reg_atomic) or
// into its own row of partials that a finalize kernel adds in a fixed order (reg_partials: the
// deterministic form): once after its tile on CUTLASS's non-persistent convolution kernel, once
// per column block on the persistent one (persistent_conv.cuh).
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cuda/cutlass/sm90_kernel.h"

namespace kiln::sm90 {

// One problem: x [n][h][w][c], w [k][r][s][c] (KRSC), z [n][p][q][k], cross-correlation.
struct ConvStats {
  const void* x = nullptr;
  const void* w = nullptr;
  void* z = nullptr;
  float* sum = nullptr;  // [k] FP32: sum over N*P*Q of z
  float* sumsq = nullptr;
  int n = 0, h = 0, w_ = 0, c = 0;  // w_: the input's width (w is the filter)
  int k = 0, r = 0, s = 0;
  int pad_h = 0, pad_w = 0, stride_h = 1, stride_w = 1;
  int sm_count = 0;
  int device_id = 0;
  bool clear_by_kernel = false;  // sm90_kernel.h

  int p() const { return (h + 2 * pad_h - r) / stride_h + 1; }
  int q() const { return (w_ + 2 * pad_w - s) / stride_w + 1; }
  int64_t rows() const { return static_cast<int64_t>(n) * p() * q(); }
};

using ConvStatsKernel = UnitKernel<ConvStats>;

// The variants the CUDA backend links; X(tile_m, tile_n, mode, cluster_m, cluster_n), read by
// CMakeLists.txt as gemm_stats.h's list is. 128-row tiles run on CUTLASS's own SM90 convolution
// kernel (non-persistent, one consumer warpgroup: a 256-row tile would not fit its registers);
// 256-row tiles on its persistent cooperative GEMM kernel (persistent_conv.cuh: two consumer
// warpgroups, one tile's epilogue overlapping the next tile's loads). 64 columns for layers of
// 64 channels (VGG's first block, ResNet-50's stage 1), 128 for the wider ones; reg_partials is
// the deterministic form (128 rows: at 256 its sums spill). none: z alone, the baseline the
// statistics' cost is read against (the probe and the GPU test run it). The 2x1 cluster shares
// each filter tile's load between two CTAs (TMA multicast): a candidate for the probe.
#define KILN_CONV_STATS_BACKEND_VARIANTS(X) \
  X(128, 64, reg_atomic, 1, 1)              \
  X(128, 128, reg_atomic, 1, 1)             \
  X(128, 128, reg_partials, 1, 1)           \
  X(128, 128, none, 1, 1)                   \
  X(256, 64, reg_atomic, 1, 1)              \
  X(256, 128, reg_atomic, 1, 1)             \
  X(256, 128, reg_atomic, 2, 1)             \
  X(256, 128, none, 1, 1)

#define KILN_CONV_STATS_FN(tm, tn, mode, cm, cn) KILN_SM90_FN(conv_stats, tm, tn, mode, cm, cn)
#define KILN_CONV_STATS_DECLARE(tm, tn, mode, cm, cn) \
  ConvStatsKernel KILN_CONV_STATS_FN(tm, tn, mode, cm, cn)();
KILN_CONV_STATS_BACKEND_VARIANTS(KILN_CONV_STATS_DECLARE)

// Every variant the backend links, in the list's order (the GPU test and the probe run each).
inline std::vector<ConvStatsKernel> conv_stats_backend_kernels() {
#define KILN_CONV_STATS_ENTRY(tm, tn, mode, cm, cn) KILN_CONV_STATS_FN(tm, tn, mode, cm, cn)(),
  return {KILN_CONV_STATS_BACKEND_VARIANTS(KILN_CONV_STATS_ENTRY)};
#undef KILN_CONV_STATS_ENTRY
}

// The variant with the sums for k output channels: the deterministic form, else the persistent
// atomic one whose tile wastes no columns. (The non-persistent atomic variants stay for the probe
// and the GPU test: on the H200 they lost to cuDNN, bench/RESULTS.md, seventeenth session.)
inline ConvStatsKernel conv_stats_kernel_for(int64_t k, bool deterministic) {
  if (deterministic) return conv_stats_128x128_reg_partials_1x1();
  return k <= 64 ? conv_stats_256x64_reg_atomic_1x1() : conv_stats_256x128_reg_atomic_1x1();
}

}  // namespace kiln::sm90
