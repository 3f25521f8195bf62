// One SM90 kernel variant, chosen by the compile definitions KILN_TILE_M, KILN_TILE_N,
// KILN_STATS_MODE (a StatsMode name), KILN_CLUSTER_M and KILN_CLUSTER_N: CMake compiles this
// file once per variant (gemm_stats.h's list for the CUDA backend, tools/cutlass_probe's
// probe_variants.h for the probe), each in its own translation unit (CUTLASS kernels compile
// slowly; separate units build in parallel and rebuild alone).
//
// z[m][n] = sum_k x[m][k] w[n][k]: a TMA warp-specialised cooperative GEMM (FP16 operands,
// both K-major, FP32 accumulators) whose epilogue visitor tree rounds z to FP16, stores it
// with TMA and reduces the rounded values over the rows of each column: the sums of z and z^2
// that BatchNorm's statistics pass would otherwise read z again for (the reg_ modes take them
// from the accumulators instead: register_stats_epilogue.cuh).
//
// With KILN_BN_PROLOGUE=1 the unit (gemm_bn_prologue_*) multiplies relu(bn(x)) instead of x:
// BatchNorm's apply and ReLU of the layer before on A's load (bn_prologue_mainloop.cuh), with
// g.bn_coef its coefficients; KILN_BN_PROLOGUE=2 (gemm_bn_folded_*) the same with the
// coefficients folded to (scale, shift); without either, a non-null bn_coef is refused.
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include <algorithm>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>
#include <string>
#include <type_traits>

#include "backend/cuda/cutlass/bn_prologue_mainloop.cuh"
#include "backend/cuda/cutlass/cutlass_unit.cuh"
#include "backend/cuda/cutlass/gemm_stats.h"
#include "backend/cuda/cutlass/register_stats_epilogue.cuh"

namespace kiln::sm90 {
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

constexpr bool kRegisterStats = kMode == StatsMode::reg_atomic || kMode == StatsMode::reg_partials;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// The register step of the sum of squares: the row reduction folds each new value v into its
// running sum s.
template <class T>
struct SquareAdd {
  CUTLASS_HOST_DEVICE T operator()(T const& s, T const& v) const { return s + v * v; }
};

// z in FP16 from the accumulators; the statistics reduce these rounded values, as BatchNorm's
// own pass over the stored z does.
using ZHalf = fusion::Sm90EVT<
    fusion::Sm90Compute<cutlass::epilogue::thread::Identity, cutlass::half_t, float, kRound>,
    fusion::Sm90AccFetch>;

// A per-column reduction over the rows (M): Sm90RowReduction yields a row vector [N]. It passes
// its input through, so the two chain and the root still yields z for the store. Final false:
// ptr_row receives per-CTA partials [M tiles][N rounded up to the tile], added up afterwards.
template <template <class> class RegFn, template <class> class GmemFn, bool Final>
using ColumnSum = fusion::Sm90RowReduction<RegFn, cutlass::plus, GmemFn, 0, TileShape, float, float,
                                           kRound, Stride<_0, _1, _0>, 4, true, Final>;

template <StatsMode M>
struct Tree {  // none and the reg_ modes: the EVT only writes z
  using type = ZHalf;
  static typename type::Arguments args(void*, void*) { return {}; }
};
template <template <class> class GmemFn, bool Final>
struct StatsTree {
  using type = fusion::Sm90EVT<ColumnSum<SquareAdd, GmemFn, Final>,
                               fusion::Sm90EVT<ColumnSum<cutlass::plus, GmemFn, Final>, ZHalf>>;
  // Each node's arguments are its children's, then its own: {ptr_row, identity, stride}.
  static typename type::Arguments args(void* sum, void* sumsq) {
    return {{{}, {sum, 0.0f, {}}}, {sumsq, 0.0f, {}}};
  }
};
template <>
struct Tree<StatsMode::atomic> : StatsTree<cutlass::atomic_add, true> {};
template <>
struct Tree<StatsMode::last_cta> : StatsTree<cutlass::plus, true> {};
template <>
struct Tree<StatsMode::partials> : StatsTree<cutlass::plus, false> {};

using TreeEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor,
    8, cutlass::half_t, cutlass::layout::RowMajor, 8,
    cutlass::epilogue::TmaWarpSpecializedCooperative, typename Tree<kMode>::type>::CollectiveOp;
using Epilogue = std::conditional_t<
    kRegisterStats,
    RegisterStatsEpilogue<TreeEpilogue, kTileM, kTileN, kMode == StatsMode::reg_partials>,
    TreeEpilogue>;

#ifndef KILN_BN_PROLOGUE
#define KILN_BN_PROLOGUE 0
#endif
constexpr bool kPrologue = KILN_BN_PROLOGUE != 0;
constexpr bool kFolded = KILN_BN_PROLOGUE == 2;  // coef as (scale, shift): one FMA a value
using StageCount = cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
    sizeof(typename Epilogue::SharedStorage))>;
using SsMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::half_t, cutlass::layout::RowMajor,
    8, cutlass::half_t, cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape, StageCount,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

// The prologue's form: CUTLASS's register-sourced mainloop (what its builder makes for operands
// that need a transform in registers, with the same stage count, smem layouts and TMA atoms as the
// builder would choose), wrapped by BnReluPrologueMainloop. A reaches registers by ldmatrix (one
// instruction per eight values and thread) where the builder's AutoVectorizingCopy issues four
// 32-bit loads on the swizzled layout: the consumer warps' issue slots are what the prologue costs.
namespace gdetail = cutlass::gemm::collective::detail;
using RsMainloop = cutlass::gemm::collective::CollectiveMma<
    cutlass::gemm::MainloopSm90TmaGmmaRmemAWarpSpecialized<
        gdetail::compute_stage_count_or_override<gdetail::sm90_smem_capacity_bytes, cutlass::half_t,
                                                 cutlass::half_t, TileShape>(StageCount{}),
        ClusterShape, cutlass::gemm::KernelTmaWarpSpecializedCooperative>,
    TileShape, cutlass::half_t, cutlass::gemm::TagToStrideA_t<cutlass::layout::RowMajor>,
    cutlass::half_t, cutlass::gemm::TagToStrideB_t<cutlass::layout::ColumnMajor>,
    decltype(make_tiled_mma(GMMA::rs_op_selector<cutlass::half_t, cutlass::half_t, float, TileShape,
                                                 GMMA::Major::K, GMMA::Major::K>(),
                            Layout<Shape<_2, _1, _1>>{})),
    decltype(gdetail::sm90_cluster_shape_to_tma_atom(shape<1>(ClusterShape{}))),
    decltype(gdetail::rs_smem_selector<GMMA::Major::K, cutlass::half_t, Int<kTileM>, _64, false>()),
    Copy_Atom<SM75_U32x4_LDSM_N, cutlass::half_t>, cute::identity,
    decltype(gdetail::sm90_cluster_shape_to_tma_atom(shape<0>(ClusterShape{}))),
    decltype(gdetail::rs_smem_selector<GMMA::Major::K, cutlass::half_t, Int<kTileN>, _64, false>()),
    void, cute::identity>;
using Mainloop =
    std::conditional_t<kPrologue, BnReluPrologueMainloop<RsMainloop, kFolded>, SsMainloop>;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

int64_t m_tiles(const GemmStats& g) {
  return (g.m + kTileM - 1) / kTileM;
}
int64_t n_padded(const GemmStats& g) {
  return (g.n + kTileN - 1) / kTileN * kTileN;
}

int stats_ctas(const GemmStats& g) {
  return column_block_ctas(g.n, kTileN, g.sm_count);
}

// Rows of the partial sums: M tiles (partials) or CTAs (reg_partials).
int64_t partial_rows(const GemmStats& g) {
  return kMode == StatsMode::partials ? m_tiles(g) : stats_ctas(g);
}
int64_t partial_ld(const GemmStats& g) {
  return kMode == StatsMode::partials ? n_padded(g) : g.n;
}

// Where the sums go (partials, reg_partials: through partial rows ahead of CUTLASS's workspace).
ColumnSums column_sums(const GemmStats& g) {
  return {g.sum, g.sumsq, g.n, partial_rows(g), partial_ld(g), g.sm_count, g.clear_by_kernel};
}

// Where the register epilogue adds its sums (a template, so that the other modes' arguments,
// which have no stats, discard the assignment).
template <class EpilogueArguments>
void set_stats_arguments(EpilogueArguments& epilogue, void* sum, void* sumsq, const GemmStats& g) {
  if constexpr (kRegisterStats) {
    epilogue.stats = {static_cast<float*>(sum), static_cast<float*>(sumsq),
                      static_cast<int>(partial_rows(g)), static_cast<int>(partial_ld(g))};
  }
}

// The prologue's coefficients (a template, so that the plain mainloop's arguments, which have
// none, discard the assignment).
template <class MainloopArguments>
void set_prologue_arguments(MainloopArguments& mainloop, const GemmStats& g) {
  if constexpr (kPrologue) mainloop.coef = static_cast<const float4*>(g.bn_coef);
}

typename Gemm::Arguments arguments(const GemmStats& g, void* workspace) {
  using Element = cutlass::half_t;
  const int m = static_cast<int>(g.m), n = static_cast<int>(g.n), k = static_cast<int>(g.k);
  const auto sa = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {m, k, 1});
  const auto sb = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {n, k, 1});
  const auto sd = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {m, n, 1});
  void* sum = g.sum;
  void* sumsq = g.sumsq;
  if (const ColumnSums s = column_sums(g); s.partial_bytes() > 0) {
    sum = s.partial_sum(workspace);
    sumsq = s.partial_sumsq(workspace);
  }
  cutlass::KernelHardwareInfo hw;
  hw.device_id = g.device_id;
  hw.sm_count = kRegisterStats ? stats_ctas(g) : g.sm_count;
  typename Epilogue::Arguments epilogue{};
  static_cast<typename TreeEpilogue::Arguments&>(epilogue) = {Tree<kMode>::args(sum, sumsq),
                                                              nullptr, typename Kernel::StrideC{},
                                                              static_cast<Element*>(g.z), sd};
  set_stats_arguments(epilogue, sum, sumsq, g);
  typename Mainloop::Arguments mainloop{};
  mainloop.ptr_A = static_cast<const Element*>(g.x);
  mainloop.dA = sa;
  mainloop.ptr_B = static_cast<const Element*>(g.w);
  mainloop.dB = sb;
  set_prologue_arguments(mainloop, g);
  return typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGemm, {m, n, k, 1}, mainloop, epilogue, hw};
}

size_t workspace_bytes(const GemmStats& g) {
  return column_sums(g).partial_bytes() + Gemm::get_workspace_size(arguments(g, nullptr));
}

std::string check(const GemmStats& g) {
  if (kPrologue && g.bn_coef == nullptr) return "needs BatchNorm's coefficients (bn_coef)";
  if (!kPrologue && g.bn_coef != nullptr) return "has no BatchNorm prologue (bn_coef is set)";
  if (kPrologue && g.k % 64 != 0) return "needs input channels in whole k tiles of 64";
  return check_gemm<Gemm>(arguments(g, nullptr));
}

std::string run(const GemmStats& g, void* workspace, cudaStream_t stream) {
  return run_gemm<Gemm>(arguments(g, workspace), column_sums(g), workspace, stream);
}

}  // namespace

#if KILN_BN_PROLOGUE == 2
GemmStatsKernel KILN_GEMM_BN_FOLDED_FN(KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE, KILN_CLUSTER_M,
                                       KILN_CLUSTER_N)() {
#elif KILN_BN_PROLOGUE
GemmStatsKernel KILN_GEMM_BN_PROLOGUE_FN(KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE, KILN_CLUSTER_M,
                                         KILN_CLUSTER_N)() {
#else
GemmStatsKernel KILN_GEMM_STATS_FN(KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE, KILN_CLUSTER_M,
                                   KILN_CLUSTER_N)() {
#endif
  return unit_kernel<GemmStats>(KILN_VARIANT_NAME, workspace_bytes, check, run);
}

}  // namespace kiln::sm90
