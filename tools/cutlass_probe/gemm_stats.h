// The interface of tools/cutlass_probe's SM90 kernels, in plain C++ so that the probe's host
// code never sees CUTLASS: z = x w^T for a 1x1 stride-1 NHWC convolution, with BatchNorm's
// per-channel sums of z and z^2 taken in the GEMM's epilogue.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace kiln::probe {

// How the epilogue's per-column sums reach global memory.
enum class StatsMode {
  none,      // z only: the GEMM alone, the baseline the statistics' cost is read against
  atomic,    // each CTA adds its column sums into sum and sumsq with FP32 atomics
  last_cta,  // CUTLASS's final reduction: per-CTA partials, added by each column's last CTA
  partials,  // per-CTA partials [M tiles][N], then a small finalize kernel over the M tiles
  // register_stats_epilogue.cuh: sums kept in registers across all of a CTA's tiles, reduced
  // across its threads once per column block it visits (once per CTA where the CTA count is a
  // multiple of the column blocks), then
  reg_atomic,    // one FP32 atomic per column into sum and sumsq
  reg_partials,  // per-CTA partials [CTAs][N], then the finalize kernel over the CTAs
};

// One problem. Rows are N*H*W pixels, columns output channels.
struct GemmStats {
  const void* x = nullptr;  // [m][k] FP16: the NHWC input
  const void* w = nullptr;  // [n][k] FP16: the 1x1 KRSC filter
  void* z = nullptr;        // [m][n] FP16: the NHWC output
  float* sum = nullptr;     // [n] FP32: sum over rows of z (none: not written)
  float* sumsq = nullptr;   // [n] FP32: sum over rows of z^2
  int64_t m = 0, n = 0, k = 0;
  int sm_count = 0;
};

// One compiled kernel: a tile shape, a stats mode and a cluster shape.
struct GemmStatsKernel {
  const char* name;
  int tile_m, tile_n;
  StatsMode mode;
  int cluster_n;  // CTAs along N that share each A tile by TMA multicast
  size_t (*workspace)(const GemmStats&);
  // "" when it ran, else what failed (a CUTLASS status or a CUDA error).
  std::string (*run)(const GemmStats&, void* workspace, cudaStream_t);
};

// Every variant; X(tile_m, tile_n, mode, cluster_m, cluster_n). CMakeLists.txt reads the X(...)
// entries off this file (one unit each), so keep them written out as numbers and names. The EVT
// modes atomic and last_cta lost to partials (bench/RESULTS.md) and are left out of the build.
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

// Two steps, so that arguments that are macros (the kernel units' definitions) expand first.
#define KILN_GEMM_STATS_FN_(tm, tn, mode, cm, cn) gemm_stats_##tm##x##tn##_##mode##_##cm##x##cn
#define KILN_GEMM_STATS_FN(tm, tn, mode, cm, cn) KILN_GEMM_STATS_FN_(tm, tn, mode, cm, cn)
#define KILN_GEMM_STATS_DECLARE(tm, tn, mode, cm, cn) \
  GemmStatsKernel KILN_GEMM_STATS_FN(tm, tn, mode, cm, cn)();
KILN_GEMM_STATS_VARIANTS(KILN_GEMM_STATS_DECLARE)
#undef KILN_GEMM_STATS_DECLARE

}  // namespace kiln::probe
