// What the interfaces of kiln's SM90 kernel units share (gemm_stats.h: the forward's GEMM with
// BatchNorm's statistics; dgrad_bn.h: the data gradient with BatchNorm-backward's sums), in plain
// C++ like them: how the epilogue's sums reach memory, one compiled variant's descriptor, and
// the variants' function names.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

namespace kiln::sm90 {

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

// Each problem's clear_by_kernel: the sums (or partial rows) the kernel adds into are cleared
// before it by a small kernel rather than cudaMemsetAsync; inside a CUDA Graph a memset node
// leaves the GPU idle ~4 us longer around it than a kernel node (bench/RESULTS.md).

// One compiled kernel for problems of type Problem (GemmStats, DgradBn): a tile shape, a stats
// mode and a cluster shape.
template <class Problem>
struct UnitKernel {
  const char* name;
  int tile_m, tile_n;
  StatsMode mode;
  int cluster_n;  // CTAs along N that share each A tile by TMA multicast
  size_t (*workspace)(const Problem&);
  // "" when CUTLASS can run this problem (shapes, alignment) and the kernel's shared memory
  // is set up, else why not; launches nothing, so a caller can ask while compiling.
  std::string (*check)(const Problem&);
  // "" when it ran, else what failed (a CUTLASS status or a CUDA error).
  std::string (*run)(const Problem&, void* workspace, cudaStream_t);
};

// A variant's function, prefix_<tm>x<tn>_<mode>_<cm>x<cn>, declared by each unit's header from
// its list of X(tile_m, tile_n, mode, cluster_m, cluster_n). Two steps, so that arguments that
// are macros (the kernel units' definitions) expand first.
#define KILN_SM90_FN_(prefix, tm, tn, mode, cm, cn) prefix##_##tm##x##tn##_##mode##_##cm##x##cn
#define KILN_SM90_FN(prefix, tm, tn, mode, cm, cn) KILN_SM90_FN_(prefix, tm, tn, mode, cm, cn)

}  // namespace kiln::sm90
