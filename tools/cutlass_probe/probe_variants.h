// The kernel variants tools/cutlass_probe times, each compiled from the CUDA backend's
// src/backend/cuda/cutlass/gemm_stats_sm90.cu; X(tile_m, tile_n, mode, cluster_m, cluster_n).
// CMakeLists.txt reads the X(...) entries off this file (one unit each), so keep them written
// out as numbers and names. The EVT modes atomic and last_cta lost to partials
// (bench/RESULTS.md) and are left out of the build.
#pragma once
#include "backend/cuda/cutlass/gemm_stats.h"

#define KILN_GEMM_STATS_VARIANTS(X) \
  X(128, 64, none, 1, 1)            \
  X(128, 64, partials, 1, 1)        \
  X(128, 64, reg_atomic, 1, 1)      \
  X(128, 64, reg_partials, 1, 1)    \
  X(128, 128, none, 1, 1)           \
  X(128, 128, partials, 1, 2)       \
  X(128, 128, reg_atomic, 1, 1)     \
  X(128, 128, reg_partials, 1, 1)   \
  X(128, 128, reg_atomic, 1, 2)     \
  X(256, 128, none, 1, 1)           \
  X(256, 128, reg_atomic, 1, 1)

// The GEMM with BatchNorm + ReLU on A's load (KILN_BN_PROLOGUE=1, prologue_probe.cpp): the
// backend's tile, with the statistics and without, and 128x128 (half the accumulators per thread:
// 256x128's register sums plus the prologue spill at ptxas's 168-register cap).
#define KILN_GEMM_BN_PROLOGUE_VARIANTS(X) \
  X(256, 128, none, 1, 1)                 \
  X(256, 128, reg_atomic, 1, 1)           \
  X(128, 128, reg_atomic, 1, 1)

// The same with the coefficients folded to (scale, shift) (KILN_BN_PROLOGUE=2): one FMA a value.
#define KILN_GEMM_BN_FOLDED_VARIANTS(X) \
  X(256, 128, none, 1, 1)               \
  X(128, 128, reg_atomic, 1, 1)

#include <vector>

namespace kiln::sm90 {
KILN_GEMM_STATS_VARIANTS(KILN_GEMM_STATS_DECLARE)
KILN_GEMM_BN_PROLOGUE_VARIANTS(KILN_GEMM_BN_PROLOGUE_DECLARE)
KILN_GEMM_BN_FOLDED_VARIANTS(KILN_GEMM_BN_FOLDED_DECLARE)

// Every variant above, in the list's order.
inline std::vector<GemmStatsKernel> probe_gemm_stats_kernels() {
#define KILN_GEMM_STATS_ENTRY(tm, tn, mode, cm, cn) KILN_GEMM_STATS_FN(tm, tn, mode, cm, cn)(),
  return {KILN_GEMM_STATS_VARIANTS(KILN_GEMM_STATS_ENTRY)};
#undef KILN_GEMM_STATS_ENTRY
}
inline std::vector<GemmStatsKernel> probe_gemm_bn_prologue_kernels() {
#define KILN_GEMM_BN_PROLOGUE_ENTRY(tm, tn, mode, cm, cn) \
  KILN_GEMM_BN_PROLOGUE_FN(tm, tn, mode, cm, cn)(),
  return {KILN_GEMM_BN_PROLOGUE_VARIANTS(KILN_GEMM_BN_PROLOGUE_ENTRY)};
#undef KILN_GEMM_BN_PROLOGUE_ENTRY
}
inline std::vector<GemmStatsKernel> probe_gemm_bn_folded_kernels() {
#define KILN_GEMM_BN_FOLDED_ENTRY(tm, tn, mode, cm, cn) \
  KILN_GEMM_BN_FOLDED_FN(tm, tn, mode, cm, cn)(),
  return {KILN_GEMM_BN_FOLDED_VARIANTS(KILN_GEMM_BN_FOLDED_ENTRY)};
#undef KILN_GEMM_BN_FOLDED_ENTRY
}
}  // namespace kiln::sm90
