// One SM90 implicit-GEMM convolution variant (conv_stats.h), chosen by the compile definitions
// KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE (none, reg_atomic or reg_partials), KILN_CLUSTER_M and
// KILN_CLUSTER_N: CMake compiles this file once per entry of conv_stats.h's list.
//
// z[n][p][q][k] = sum_{r,s,c} x[n][p*u+r-pad][q*v+s-pad][c] w[k][r][s][c]: CUTLASS's SM90 fprop
// (im2col TMA loads of x, tiled TMA loads of w, FP32 accumulators) as the GEMM [N*P*Q] x [K]
// with K = C*R*S, whose output rows are NHWC's pixels, so z is stored as the row-major
// [N*P*Q][K] matrix by CUTLASS's TMA epilogue, and register_stats_epilogue.cuh adds the sums of
// the FP16-rounded z and z^2 per column from the accumulators.
//
// Tiles of 128 rows run on CUTLASS's own convolution kernel (non-persistent, one consumer
// warpgroup, one tile per CTA); tiles of 256 rows on its persistent cooperative GEMM kernel
// (two consumer warpgroups, a CTA's sums kept across its tiles) through persistent_conv.cuh.

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
// The persistent form's kernel in its units alone: CUTLASS 2.x's GemmUniversal, which the GEMM
// adapter's header brings in, also matches the template arguments of CUTLASS's conv kernel.
#if KILN_TILE_M == 256
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#endif
// clang-format on

#include <string>
#include <type_traits>

#include "backend/cuda/cutlass/conv_stats.h"
#include "backend/cuda/cutlass/cutlass_unit.cuh"
#include "backend/cuda/cutlass/persistent_conv.cuh"
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
// 256-row tiles: the persistent cooperative form, one consumer warpgroup per 128 rows.
constexpr bool kPersistent = kTileM == 256;
static_assert(kTileM == 128 || kPersistent, "128 rows (one warpgroup) or 256 (two)");
constexpr int kConsumerThreads = kPersistent ? 256 : 128;

// z in FP16 from the accumulators; the sums below reduce these rounded values, as BatchNorm's
// own pass over the stored z does.
using ZHalf =
    fusion::Sm90EVT<fusion::Sm90Compute<cutlass::epilogue::thread::Identity, cutlass::half_t, float,
                                        cutlass::FloatRoundStyle::round_to_nearest>,
                    fusion::Sm90AccFetch>;
// The persistent kernel's epilogue sees the GEMM's row-major [N*P*Q][K] z; CUTLASS's convolution
// kernel's sees NHWC with the rows as (Q, P, N).
using OutputLayout =
    std::conditional_t<kPersistent, cutlass::layout::RowMajor, cutlass::layout::TensorNHWC>;
using EpilogueSchedule =
    std::conditional_t<kPersistent, cutlass::epilogue::TmaWarpSpecializedCooperative,
                       cutlass::epilogue::TmaWarpSpecialized>;
using TmaEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ConvTileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, OutputLayout, 8,
    cutlass::half_t, OutputLayout, 8, EpilogueSchedule, ZHalf>::CollectiveOp;
using Epilogue = std::conditional_t<
    kStats, RegisterStatsEpilogue<TmaEpilogue, kTileM, kTileN, kPartialSums, kConsumerThreads>,
    TmaEpilogue>;

using ConvMainloop = typename cutlass::conv::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::conv::Operator::kFprop,
    cutlass::half_t, cutlass::layout::TensorNHWC, 8, cutlass::half_t, cutlass::layout::TensorNHWC,
    8, float, ConvTileShape, ClusterShape,
    cutlass::conv::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;

using Problem = cutlass::conv::ConvProblemShape<cutlass::conv::Operator::kFprop, 2>;

// The two kernels, and the device-side adapter that launches each.
template <bool Persistent>
struct Form {
  using Kernel = cutlass::conv::kernel::ConvUniversal<Problem, ConvMainloop, Epilogue>;
  using Device = cutlass::conv::device::ConvUniversalAdapter<Kernel>;
};
#if KILN_TILE_M == 256
template <>
struct Form<true> {
  // Two warpgroups along M, each a 64-row GMMA atom repeated down its 128 rows.
  using CooperativeMma =
      decltype(make_tiled_mma(GMMA::ss_op_selector<cutlass::half_t, cutlass::half_t, float,
                                                   ConvTileShape, GMMA::Major::K, GMMA::Major::K>(),
                              Layout<Shape<_2, _1, _1>>{}));
  using Mainloop =
      PersistentConvMainloop<typename WithTiledMma<ConvMainloop, CooperativeMma>::type>;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<typename Mainloop::GemmProblem, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};
#endif
using Kernel = typename Form<kPersistent>::Kernel;
using Conv = typename Form<kPersistent>::Device;

Problem problem(const ConvStats& c) {
  return Problem(cutlass::conv::Mode::kCrossCorrelation, {c.n, c.h, c.w_, c.c},
                 {c.k, c.r, c.s, c.c}, {c.pad_h, c.pad_w}, {c.pad_h, c.pad_w},
                 {c.stride_h, c.stride_w}, {1, 1}, 1);
}

// The grid: one CTA per tile (M tiles along x, column blocks along y); the persistent form
// launches as many CTAs as the SMs that keep whole column blocks (column_block_ctas), each
// holding its sums across its tiles.
int64_t ctas(const ConvStats& c) {
  if constexpr (kPersistent) return column_block_ctas(c.k, kTileN, c.sm_count);
  return (c.rows() + kTileM - 1) / kTileM * ((c.k + kTileN - 1) / kTileN);
}

// reg_atomic adds into sum and sumsq; reg_partials into a row of k per CTA at the workspace's
// start (each CTA writes its column block of its own row), then the finalize kernel.
ColumnSums column_sums(const ConvStats& c) {
  return {c.sum, c.sumsq, c.k, kPartialSums ? ctas(c) : 0, c.k, c.sm_count, c.clear_by_kernel};
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

// z's store and the sums (a plain function: nvcc's host pass rejects the epilogue builder's
// types named inside a function template).
typename Epilogue::Arguments epilogue_arguments(const ConvStats& c, void* workspace,
                                                typename Kernel::StrideD sd) {
  typename Epilogue::Arguments epilogue{};
  static_cast<typename TmaEpilogue::Arguments&>(epilogue) = {
      {}, nullptr, typename Kernel::StrideC{}, static_cast<cutlass::half_t*>(c.z), sd};
  set_stats_arguments(epilogue, c, workspace);
  return epilogue;
}

// A template so that `if constexpr` drops the other form's lines (they name its types).
template <bool Persistent = kPersistent>
typename Form<Persistent>::Device::Arguments arguments(const ConvStats& c, void* workspace) {
  using Arguments = typename Form<Persistent>::Device::Arguments;
  using Element = cutlass::half_t;
  const Problem shape = problem(c);
  const auto* x = static_cast<const Element*>(c.x);
  const auto* w = static_cast<const Element*>(c.w);
  typename Kernel::StrideD sd{};
  if constexpr (Persistent) {
    sd = cutlass::make_cute_packed_stride(typename Kernel::StrideD{},
                                          {static_cast<int>(c.rows()), c.k, 1});
  } else {
    // The epilogue sees the output's rows as (Q, P, N): z's NHWC strides, innermost first.
    cute::for_each(cute::make_seq<cute::rank<0>(typename Kernel::StrideD{})>{},
                   [&](auto i) { cute::get<0, i>(sd) = shape.stride_C[Problem::RankT - 2 - i]; });
  }
  cutlass::KernelHardwareInfo hw;
  hw.device_id = c.device_id;
  hw.sm_count = c.sm_count;
  if constexpr (Persistent) {
    hw.sm_count = kStats ? static_cast<int>(ctas(c)) : c.sm_count;
    using Mainloop = typename Form<Persistent>::Mainloop;
    return Arguments{cutlass::gemm::GemmUniversalMode::kGemm, Mainloop::gemm_problem(shape),
                     typename Mainloop::Arguments{{x, w}, shape},
                     epilogue_arguments(c, workspace, sd), hw};
  } else {
    return Arguments{shape, {x, w}, epilogue_arguments(c, workspace, sd), hw};
  }
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
