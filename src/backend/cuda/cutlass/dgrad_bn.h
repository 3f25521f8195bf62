// The interface of kiln's SM90 data-gradient kernels (dgrad_bn_sm90.cu), in plain C++ like
// gemm_stats.h: the data gradient of a 1x1 stride-1 NHWC FP16 convolution,
// dX[m][c] = sum_k dY[m][k] W[k][c], when dX is the gradient at the output of relu(bn(z)) or
// relu(bn(z) + residual): the epilogue writes BatchNorm's masked gradient g instead of dX and
// takes BatchNorm-backward's per-channel sums (dgrad_bn_epilogue.cuh), so BatchNorm's backward
// runs only its finalize and dx passes, reading g. The step uses it under KILN_CUTLASS_DGRAD
// (cutlass_dgrad.cpp), on by default wherever the forward's GEMM is: on the H200 it is faster
// than cuDNN's dgrad followed by kiln's sums pass (bench/RESULTS.md, issue 20).
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cuda/cutlass/sm90_kernel.h"

namespace kiln::sm90 {

// One problem. Rows are N*H*W pixels; k is the convolution's output channels (dY's), n its
// input channels (dX's, BatchNorm's).
struct DgradBn {
  const void* dy = nullptr;       // [m][k] FP16: the gradient at the convolution's output
  const void* w = nullptr;        // [k][n] FP16: the 1x1 KRSC filter
  const void* z = nullptr;        // [m][n] FP16: BatchNorm's input (saved by the forward)
  const uint8_t* mask = nullptr;  // ReLU's bits over [m][n] (bit e % 8 of byte e / 8)
  const void* dy2 = nullptr;      // [m][n] FP16 or null: BN+add+ReLU's residual-path gradient
  const float* mean = nullptr;    // [n]: BatchNorm's saved batch mean
  void* g = nullptr;              // [m][n] FP16: mask ? dX [+ dy2] : 0, kiln's rounding
  float* sums = nullptr;          // [2][n] FP32: sum over rows of g, then of g (z - mean)
  int64_t m = 0, n = 0, k = 0;
  int sm_count = 0;
  int device_id = 0;             // the CUDA device the pointers live on
  bool clear_by_kernel = false;  // sm90_kernel.h
  // The convolution units' (conv_dgrad_bn_sm90.cu) stride-1 R x S filter, KRSC [k][r][s][n]
  // with padding keeping h x w, over m / (h w) images; the GEMM units take r = s = 1 alone.
  int h = 1, w_ = 1, r = 1, s = 1, pad_h = 0, pad_w = 0;
};

// One compiled kernel: a tile shape and how the sums reach global memory (reg_atomic: FP32
// atomics; reg_partials: per-CTA partials then a finalize kernel, fixed order: deterministic).
// check() also wants n and k multiples of 8.
using DgradBnKernel = UnitKernel<DgradBn>;

// The variants the CUDA backend links; X(tile_m, tile_n, mode, cluster_m, cluster_n), read by
// CMakeLists.txt as gemm_stats.h's list is (one unit each, about a minute to compile: keep them
// few). 128x64 for the layers of at most 64 channels (ResNet-50's conv3 data gradients at
// 56x56), where a 128-wide tile would spend half its MMAs on padding; 128x128 (64 accumulators
// and 32 sums a thread: no spill) for the wider ones; reg_partials is the deterministic form,
// in both widths (at 56x56 the 128-wide one took 0.279 ms against the 64-wide atomic's 0.155).
// (A 256x128 unit spilled and was the slowest on every layer on the H200: bench/RESULTS.md.)
#define KILN_DGRAD_BN_BACKEND_VARIANTS(X) \
  X(128, 64, reg_atomic, 1, 1)            \
  X(128, 128, reg_atomic, 1, 1)           \
  X(128, 64, reg_partials, 1, 1)          \
  X(128, 128, reg_partials, 1, 1)

#define KILN_DGRAD_BN_FN(tm, tn, mode, cm, cn) KILN_SM90_FN(dgrad_bn, tm, tn, mode, cm, cn)
#define KILN_DGRAD_BN_DECLARE(tm, tn, mode, cm, cn) \
  DgradBnKernel KILN_DGRAD_BN_FN(tm, tn, mode, cm, cn)();
KILN_DGRAD_BN_BACKEND_VARIANTS(KILN_DGRAD_BN_DECLARE)

// The atomic variants again without a second gradient (KILN_DGRAD_DY2=0, for a CBR's g): the
// epilogue stages no dy2 rows (a 128-row tile's 34 KB at 128 columns), which the mainloop takes
// as pipeline stages. The deterministic form keeps the list above's units.
#define KILN_DGRAD_BN_NODY2_BACKEND_VARIANTS(X) \
  X(128, 64, reg_atomic, 1, 1)                  \
  X(128, 128, reg_atomic, 1, 1)

#define KILN_DGRAD_BN_NODY2_FN(tm, tn, mode, cm, cn) \
  KILN_SM90_FN(dgrad_bn_nody2, tm, tn, mode, cm, cn)
#define KILN_DGRAD_BN_NODY2_DECLARE(tm, tn, mode, cm, cn) \
  DgradBnKernel KILN_DGRAD_BN_NODY2_FN(tm, tn, mode, cm, cn)();
KILN_DGRAD_BN_NODY2_BACKEND_VARIANTS(KILN_DGRAD_BN_NODY2_DECLARE)

// Every variant the backend links that takes a problem with (dy2) or without a second gradient,
// in the lists' order (the GPU test and the probe run each).
inline std::vector<DgradBnKernel> dgrad_bn_backend_kernels(bool dy2) {
#define KILN_DGRAD_BN_ENTRY(tm, tn, mode, cm, cn) KILN_DGRAD_BN_FN(tm, tn, mode, cm, cn)(),
#define KILN_DGRAD_BN_NODY2_ENTRY(tm, tn, mode, cm, cn) \
  KILN_DGRAD_BN_NODY2_FN(tm, tn, mode, cm, cn)(),
  std::vector<DgradBnKernel> all{KILN_DGRAD_BN_BACKEND_VARIANTS(KILN_DGRAD_BN_ENTRY)};
  if (!dy2)
    all.insert(all.end(), {KILN_DGRAD_BN_NODY2_BACKEND_VARIANTS(KILN_DGRAD_BN_NODY2_ENTRY)});
  return all;
#undef KILN_DGRAD_BN_ENTRY
#undef KILN_DGRAD_BN_NODY2_ENTRY
}

// The variant for n channels whose tile fits: the deterministic form, or the atomic one (without
// room for dy2 where the problem has none).
inline DgradBnKernel dgrad_bn_kernel_for(int64_t n, bool deterministic, bool dy2) {
  if (deterministic)
    return n <= 64 ? dgrad_bn_128x64_reg_partials_1x1() : dgrad_bn_128x128_reg_partials_1x1();
  if (!dy2)
    return n <= 64 ? dgrad_bn_nody2_128x64_reg_atomic_1x1()
                   : dgrad_bn_nody2_128x128_reg_atomic_1x1();
  return n <= 64 ? dgrad_bn_128x64_reg_atomic_1x1() : dgrad_bn_128x128_reg_atomic_1x1();
}

// The data gradient of a stride-1 R x S convolution (VGG's 3x3 layers, whose dX feeds the
// previous CBR's BatchNorm): CUTLASS's SM90 implicit-GEMM dgrad mainloop (im2col TMA loads of
// dY) on its persistent cooperative kernel (persistent_conv.cuh), with the same epilogue. The
// step uses it under KILN_CUTLASS_CONV_DGRAD (cutlass_dgrad.cpp; off by default until measured).
#define KILN_CONV_DGRAD_BN_BACKEND_VARIANTS(X) \
  X(128, 64, reg_atomic, 1, 1)                 \
  X(128, 128, reg_atomic, 1, 1)                \
  X(128, 64, reg_partials, 1, 1)               \
  X(128, 128, reg_partials, 1, 1)

#define KILN_CONV_DGRAD_BN_FN(tm, tn, mode, cm, cn) \
  KILN_SM90_FN(conv_dgrad_bn, tm, tn, mode, cm, cn)
#define KILN_CONV_DGRAD_BN_DECLARE(tm, tn, mode, cm, cn) \
  DgradBnKernel KILN_CONV_DGRAD_BN_FN(tm, tn, mode, cm, cn)();
KILN_CONV_DGRAD_BN_BACKEND_VARIANTS(KILN_CONV_DGRAD_BN_DECLARE)

// As KILN_DGRAD_BN_NODY2_BACKEND_VARIANTS: VGG's layers and ResNet-50's conv2 feed CBRs. The
// 256x128 unit tries the forward's winning tile (conv_stats.h) on VGG's 3x3 data gradients: two
// 128-row warpgroups on a K step of 64, its z staged in halves. It runs level with the 128x128
// unit and behind cuDNN + the sums pass (bench/RESULTS.md), so conv_dgrad_bn_kernel_for takes it
// only under KILN_CONV_DGRAD_WIDE_TILE, off; the probe and the GPU test run it.
#define KILN_CONV_DGRAD_BN_NODY2_BACKEND_VARIANTS(X) \
  X(128, 64, reg_atomic, 1, 1)                       \
  X(128, 128, reg_atomic, 1, 1)                      \
  X(256, 128, reg_atomic, 1, 1)

#define KILN_CONV_DGRAD_BN_NODY2_FN(tm, tn, mode, cm, cn) \
  KILN_SM90_FN(conv_dgrad_bn_nody2, tm, tn, mode, cm, cn)
#define KILN_CONV_DGRAD_BN_NODY2_DECLARE(tm, tn, mode, cm, cn) \
  DgradBnKernel KILN_CONV_DGRAD_BN_NODY2_FN(tm, tn, mode, cm, cn)();
KILN_CONV_DGRAD_BN_NODY2_BACKEND_VARIANTS(KILN_CONV_DGRAD_BN_NODY2_DECLARE)

// The ping-pong units (KILN_DGRAD_PINGPONG=1: pingpong_dgrad_bn_epilogue.cuh), for a CBR's g with
// atomic sums: each consumer warpgroup takes whole tiles, so one's epilogue runs under the
// other's MMAs, where the cooperative kernel stops both for it. conv_dgrad_bn_kernel_for takes
// them under KILN_CONV_DGRAD_PINGPONG.
#define KILN_CONV_DGRAD_BN_PINGPONG_BACKEND_VARIANTS(X) \
  X(128, 64, reg_atomic, 1, 1)                          \
  X(128, 128, reg_atomic, 1, 1)

#define KILN_CONV_DGRAD_BN_PINGPONG_FN(tm, tn, mode, cm, cn) \
  KILN_SM90_FN(conv_dgrad_bn_pingpong, tm, tn, mode, cm, cn)
#define KILN_CONV_DGRAD_BN_PINGPONG_DECLARE(tm, tn, mode, cm, cn) \
  DgradBnKernel KILN_CONV_DGRAD_BN_PINGPONG_FN(tm, tn, mode, cm, cn)();
KILN_CONV_DGRAD_BN_PINGPONG_BACKEND_VARIANTS(KILN_CONV_DGRAD_BN_PINGPONG_DECLARE)

// Whether k is one of the ping-pong units.
inline bool is_pingpong_unit(const DgradBnKernel& k) {
#define KILN_CONV_DGRAD_BN_PINGPONG_IS(tm, tn, mode, cm, cn) \
  k.run == KILN_CONV_DGRAD_BN_PINGPONG_FN(tm, tn, mode, cm, cn)().run ||
  return KILN_CONV_DGRAD_BN_PINGPONG_BACKEND_VARIANTS(KILN_CONV_DGRAD_BN_PINGPONG_IS) false;
#undef KILN_CONV_DGRAD_BN_PINGPONG_IS
}

inline std::vector<DgradBnKernel> conv_dgrad_bn_backend_kernels(bool dy2) {
#define KILN_CONV_DGRAD_BN_ENTRY(tm, tn, mode, cm, cn) \
  KILN_CONV_DGRAD_BN_FN(tm, tn, mode, cm, cn)(),
#define KILN_CONV_DGRAD_BN_NODY2_ENTRY(tm, tn, mode, cm, cn) \
  KILN_CONV_DGRAD_BN_NODY2_FN(tm, tn, mode, cm, cn)(),
#define KILN_CONV_DGRAD_BN_PINGPONG_ENTRY(tm, tn, mode, cm, cn) \
  KILN_CONV_DGRAD_BN_PINGPONG_FN(tm, tn, mode, cm, cn)(),
  std::vector<DgradBnKernel> all{KILN_CONV_DGRAD_BN_BACKEND_VARIANTS(KILN_CONV_DGRAD_BN_ENTRY)};
  if (!dy2) {
    all.insert(all.end(),
               {KILN_CONV_DGRAD_BN_NODY2_BACKEND_VARIANTS(KILN_CONV_DGRAD_BN_NODY2_ENTRY)});
    all.insert(all.end(),
               {KILN_CONV_DGRAD_BN_PINGPONG_BACKEND_VARIANTS(KILN_CONV_DGRAD_BN_PINGPONG_ENTRY)});
  }
  return all;
#undef KILN_CONV_DGRAD_BN_ENTRY
#undef KILN_CONV_DGRAD_BN_NODY2_ENTRY
#undef KILN_CONV_DGRAD_BN_PINGPONG_ENTRY
}

// As dgrad_bn_kernel_for, for the stride-1 convolution's data gradient; wide: the 256x128 unit
// where its tile fits (KILN_CONV_DGRAD_WIDE_TILE), pingpong: the ping-pong units
// (KILN_CONV_DGRAD_PINGPONG, first where both are on); atomic sums and no dy2 only.
inline DgradBnKernel conv_dgrad_bn_kernel_for(int64_t n, bool deterministic, bool dy2,
                                              bool wide = false, bool pingpong = false) {
  if (deterministic)
    return n <= 64 ? conv_dgrad_bn_128x64_reg_partials_1x1()
                   : conv_dgrad_bn_128x128_reg_partials_1x1();
  if (!dy2) {
    if (pingpong)
      return n <= 64 ? conv_dgrad_bn_pingpong_128x64_reg_atomic_1x1()
                     : conv_dgrad_bn_pingpong_128x128_reg_atomic_1x1();
    if (wide && n >= 128) return conv_dgrad_bn_nody2_256x128_reg_atomic_1x1();
    return n <= 64 ? conv_dgrad_bn_nody2_128x64_reg_atomic_1x1()
                   : conv_dgrad_bn_nody2_128x128_reg_atomic_1x1();
  }
  return n <= 64 ? conv_dgrad_bn_128x64_reg_atomic_1x1() : conv_dgrad_bn_128x128_reg_atomic_1x1();
}

}  // namespace kiln::sm90
