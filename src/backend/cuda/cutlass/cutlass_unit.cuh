// The host side shared by kiln's SM90 kernel units (gemm_stats_sm90.cu, dgrad_bn_sm90.cu), each
// compiled once per variant from the definitions KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE (a
// StatsMode name), KILN_CLUSTER_M and KILN_CLUSTER_N: the variant's constants, where its two
// column sums go (per-CTA partials ahead of CUTLASS's own workspace), the CUTLASS calls behind
// check() and run(), and the variant's descriptor. Included by those units alone.
#pragma once
#include <cuda_runtime.h>
#include <cutlass/cutlass.h>

#include <cstddef>
#include <cstdint>
#include <cute/tensor.hpp>
#include <string>

#include "backend/cuda/cutlass/column_sums.cuh"
#include "backend/cuda/cutlass/sm90_kernel.h"

#if !defined(KILN_TILE_M) || !defined(KILN_TILE_N) || !defined(KILN_STATS_MODE) || \
    !defined(KILN_CLUSTER_M) || !defined(KILN_CLUSTER_N)
#error "compile with KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE, KILN_CLUSTER_M and KILN_CLUSTER_N"
#endif

// The variant's name as its definitions spell it: "256x128 reg_atomic cluster 1x1".
#define KILN_STR2(x) #x
#define KILN_STR(x) KILN_STR2(x)
#define KILN_VARIANT_NAME                                                       \
  KILN_STR(KILN_TILE_M)                                                         \
  "x" KILN_STR(KILN_TILE_N) " " KILN_STR(KILN_STATS_MODE) " cluster " KILN_STR( \
      KILN_CLUSTER_M) "x" KILN_STR(KILN_CLUSTER_N)

namespace kiln::sm90 {
namespace {

constexpr StatsMode kMode = StatsMode::KILN_STATS_MODE;
constexpr int kTileM = KILN_TILE_M, kTileN = KILN_TILE_N;
using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::_64>;
using ClusterShape = cute::Shape<cute::Int<KILN_CLUSTER_M>, cute::Int<KILN_CLUSTER_N>, cute::_1>;
// The modes whose sums go through per-CTA (or per-tile) partial rows and a finalize kernel.
constexpr bool kPartialSums = kMode == StatsMode::partials || kMode == StatsMode::reg_partials;

std::string status_error(const char* what, cutlass::Status st) {
  return std::string(what) + ": " + cutlassGetStatusString(st);
}

size_t align256(size_t b) {
  return (b + 255) / 256 * 256;
}

// Where a problem's two column sums go: sum and sumsq [n]; in the partials modes, first into
// partial rows [rows][ld] of each at the workspace's start (partial_bytes() / 2 each, 256-byte
// aligned), CUTLASS's own workspace after them, and the finalize kernel adds the rows up.
struct ColumnSums {
  float* sum;
  float* sumsq;
  int64_t n;
  int64_t rows, ld;  // the partials' rows (M tiles, or CTAs) and row stride
  int sm_count;
  bool clear_by_kernel = false;  // the problem's (sm90_kernel.h)

  size_t partial_bytes() const {
    const size_t one = align256(sizeof(float) * static_cast<size_t>(rows * ld));
    return kPartialSums ? 2 * one : 0;
  }
  float* partial_sum(void* workspace) const { return static_cast<float*>(workspace); }
  float* partial_sumsq(void* workspace) const {
    return reinterpret_cast<float*>(static_cast<uint8_t*>(workspace) + partial_bytes() / 2);
  }
};

// check()'s CUTLASS part: "" when CUTLASS can run args.
template <class Gemm>
std::string check_gemm(const typename Gemm::Arguments& args) {
  Gemm gemm;
  if (auto st = gemm.can_implement(args); st != cutlass::Status::kSuccess)
    return status_error("can_implement", st);
  // Where CUTLASS needs no workspace of its own (these kernels), initialize only sets the
  // kernel's shared-memory size: done once here rather than first inside a captured CUDA Graph.
  if (Gemm::get_workspace_size(args) == 0) {
    if (auto st = gemm.initialize(args, nullptr, nullptr); st != cutlass::Status::kSuccess)
      return status_error("initialize", st);
  }
  return "";
}

// run()'s: the GEMM on `stream` with `workspace` laid out as ColumnSums says, the sums it adds
// into cleared first and, in the partials modes, the finalize kernel after it.
template <class Gemm>
std::string run_gemm(const typename Gemm::Arguments& args, const ColumnSums& s, void* workspace,
                     cudaStream_t stream) {
  Gemm gemm;
  if (auto st = gemm.can_implement(args); st != cutlass::Status::kSuccess)
    return status_error("can_implement", st);
  // initialize clears what an EVT accumulates into (atomic sums, tile counters); the register
  // epilogues add into sums or partials cleared here.
  if constexpr (kMode == StatsMode::reg_atomic) {
    if (std::string err = clear_sums(s.sum, s.sumsq, s.n, s.clear_by_kernel, stream); !err.empty())
      return err;
  } else if constexpr (kMode == StatsMode::reg_partials) {
    const auto words = static_cast<int64_t>(s.partial_bytes() / sizeof(float));
    if (std::string err = clear_floats(static_cast<float*>(workspace), words, nullptr, 0,
                                       s.clear_by_kernel, stream);
        !err.empty())
      return err;
  }
  void* own = static_cast<uint8_t*>(workspace) + s.partial_bytes();
  if (auto st = gemm.initialize(args, own, stream); st != cutlass::Status::kSuccess)
    return status_error("initialize", st);
  if (auto st = gemm.run(stream); st != cutlass::Status::kSuccess) return status_error("run", st);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return std::string("GEMM launch: ") + cudaGetErrorString(e);
  if constexpr (kPartialSums) {
    // reg_partials has a row per CTA: one block down each column sums them and stores.
    return finalize_partial_rows(s.partial_sum(workspace), s.partial_sumsq(workspace),
                                 static_cast<int>(s.rows), s.n, static_cast<int>(s.ld),
                                 kMode == StatsMode::reg_partials, s.sm_count, s.sum, s.sumsq,
                                 s.clear_by_kernel, stream);
  }
  return "";
}

// The variant's descriptor, its shape and mode from the definitions.
template <class Problem>
UnitKernel<Problem> unit_kernel(const char* name, size_t (*workspace)(const Problem&),
                                std::string (*check)(const Problem&),
                                std::string (*run)(const Problem&, void*, cudaStream_t)) {
  return {name, kTileM, kTileN, kMode, KILN_CLUSTER_N, workspace, check, run};
}

}  // namespace
}  // namespace kiln::sm90
