// One SM90 implicit-GEMM convolution variant (conv_stats.h), chosen by the compile definitions
// KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE (none, reg_atomic or reg_partials), KILN_CLUSTER_M and
// KILN_CLUSTER_N: CMake compiles this file once per entry of conv_stats.h's list.
//
// z[n][p][q][k] = sum_{r,s,c} x[n][p*u+r-pad][q*v+s-pad][c] w[k][r][s][c]: CUTLASS's SM90 fprop
// (im2col TMA loads of x, tiled TMA loads of w, FP32 accumulators) as the GEMM [N*P*Q] x [K]
// with K = C*R*S, whose output rows are NHWC's pixels, so z is stored as the row-major
// [N*P*Q][K] matrix by CUTLASS's TMA epilogue, and register_stats_epilogue.cuh adds the sums of
// the FP16-rounded z and z^2 per column from the accumulators.

// The order: CUTLASS's convolution headers use cute, cutlass's core and its hardware info
// without including them, so those come first.
// clang-format off
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include <cutlass/kernel_hardware_info.hpp>
#include <cutlass/conv/collective/collective_builder.hpp>
#include <cutlass/conv/convnd_problem_shape.hpp>
#include <cutlass/conv/device/conv_universal_adapter.hpp>
#include <cutlass/conv/kernel/conv_universal.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/util/packed_stride.hpp>
// clang-format on

#include <string>
#include <type_traits>

#include "backend/cuda/cutlass/conv_stats.h"
#include "backend/cuda/cutlass/cutlass_unit.cuh"
#include "backend/cuda/cutlass/register_stats_epilogue.cuh"

namespace kiln::sm90 {
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

static_assert(kMode == StatsMode::none || kMode == StatsMode::reg_atomic ||
                  kMode == StatsMode::reg_partials,
              "the convolution's sums are the register epilogue's (or none)");
constexpr bool kStats = kMode != StatsMode::none;

// A convolution's tile names its K mode as a shape (CUTLASS folds C, S and R into it).
using ConvTileShape = Shape<Int<kTileM>, Int<kTileN>, Shape<_64>>;
constexpr int kConsumerThreads = 128;  // one consumer warpgroup

// z in FP16 from the accumulators; the sums below reduce these rounded values, as BatchNorm's
// own pass over the stored z does.
using ZHalf =
    fusion::Sm90EVT<fusion::Sm90Compute<cutlass::epilogue::thread::Identity, cutlass::half_t, float,
                                        cutlass::FloatRoundStyle::round_to_nearest>,
                    fusion::Sm90AccFetch>;
using TmaEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ConvTileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
    cutlass::layout::TensorNHWC, 8, cutlass::half_t, cutlass::layout::TensorNHWC, 8,
    cutlass::epilogue::TmaWarpSpecialized, ZHalf>::CollectiveOp;
using Epilogue = std::conditional_t<
    kStats, RegisterStatsEpilogue<TmaEpilogue, kTileM, kTileN, kPartialSums, kConsumerThreads>,
    TmaEpilogue>;

using Mainloop = typename cutlass::conv::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::conv::Operator::kFprop,
    cutlass::half_t, cutlass::layout::TensorNHWC, 8, cutlass::half_t, cutlass::layout::TensorNHWC,
    8, float, ConvTileShape, ClusterShape,
    cutlass::conv::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;

using Problem = cutlass::conv::ConvProblemShape<cutlass::conv::Operator::kFprop, 2>;
using Kernel = cutlass::conv::kernel::ConvUniversal<Problem, Mainloop, Epilogue>;
using Conv = cutlass::conv::device::ConvUniversalAdapter<Kernel>;

Problem problem(const ConvStats& c) {
  return Problem(cutlass::conv::Mode::kCrossCorrelation, {c.n, c.h, c.w_, c.c},
                 {c.k, c.r, c.s, c.c}, {c.pad_h, c.pad_w}, {c.pad_h, c.pad_w},
                 {c.stride_h, c.stride_w}, {1, 1}, 1);
}

// The grid: one CTA per tile (M tiles along x, column blocks along y).
int64_t ctas(const ConvStats& c) {
  return (c.rows() + kTileM - 1) / kTileM * ((c.k + kTileN - 1) / kTileN);
}

// reg_atomic adds into sum and sumsq; reg_partials into a row of k per CTA at the workspace's
// start (each CTA writes its column block of its own row), then the finalize kernel.
ColumnSums column_sums(const ConvStats& c) {
  return {c.sum, c.sumsq, c.k, kPartialSums ? ctas(c) : 0, c.k, c.sm_count};
}

template <class EpilogueArguments>
void set_stats_arguments(EpilogueArguments& epilogue, const ConvStats& c, void* workspace) {
  if constexpr (kStats) {
    const ColumnSums s = column_sums(c);
    if constexpr (kPartialSums) {
      epilogue.stats = {s.partial_sum(workspace), s.partial_sumsq(workspace),
                        static_cast<int>(s.rows), static_cast<int>(s.ld)};
    } else {
      epilogue.stats = {c.sum, c.sumsq, 0, 0};
    }
  }
}

typename Conv::Arguments arguments(const ConvStats& c, void* workspace) {
  using Element = cutlass::half_t;
  const Problem shape = problem(c);
  // The epilogue sees the output's rows as (Q, P, N): z's NHWC strides, innermost first.
  typename Kernel::StrideD sd{};
  cute::for_each(cute::make_seq<cute::rank<0>(typename Kernel::StrideD{})>{},
                 [&](auto i) { cute::get<0, i>(sd) = shape.stride_C[Problem::RankT - 2 - i]; });
  typename Epilogue::Arguments epilogue{};
  static_cast<typename TmaEpilogue::Arguments&>(epilogue) = {
      {}, nullptr, typename Kernel::StrideC{}, static_cast<Element*>(c.z), sd};
  set_stats_arguments(epilogue, c, workspace);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = c.device_id;
  hw.sm_count = c.sm_count;
  return typename Conv::Arguments{
      shape, {static_cast<const Element*>(c.x), static_cast<const Element*>(c.w)}, epilogue, hw};
}

size_t workspace_bytes(const ConvStats& c) {
  return column_sums(c).partial_bytes() + Conv::get_workspace_size(arguments(c, nullptr));
}

std::string check(const ConvStats& c) {
  if (c.rows() > INT32_MAX) return "has more than 2^31 output pixels";
  if (kPartialSums && ctas(c) > INT32_MAX / c.k) return "has too many tiles for per-CTA partials";
  return check_gemm<Conv>(arguments(c, nullptr));
}

std::string run(const ConvStats& c, void* workspace, cudaStream_t stream) {
  return run_gemm<Conv>(arguments(c, workspace), column_sums(c), workspace, stream);
}

}  // namespace

ConvStatsKernel KILN_CONV_STATS_FN(KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE, KILN_CLUSTER_M,
                                   KILN_CLUSTER_N)() {
  return unit_kernel<ConvStats>(KILN_VARIANT_NAME, workspace_bytes, check, run);
}

}  // namespace kiln::sm90
