// One variant of the stride-1 convolution's data gradient with BatchNorm-backward's sums
// (dgrad_bn.h's KILN_CONV_DGRAD_BN_BACKEND_VARIANTS), chosen by the compile definitions
// KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE (reg_atomic or reg_partials), KILN_CLUSTER_M and
// KILN_CLUSTER_N.
//
// dX[n][h][w][c] = sum_{k,r,s} dY[n][h+pad-r][w+pad-s][k] W[k][r][s][c]: CUTLASS's SM90 implicit
// GEMM dgrad mainloop (im2col TMA loads of dY, the KRSC filter read C-major) as the GEMM
// [N*H*W] x [C] with K = K*R*S, run by CUTLASS's persistent cooperative kernel
// (persistent_conv.cuh); stride 1 keeps dX's rows NHWC's pixels, so the 1x1 units' epilogue
// (dgrad_bn_epilogue.cuh: g instead of dX, and the two sums) applies unchanged.
// KILN_DGRAD_PINGPONG=1: CUTLASS's ping-pong kernel instead (a warpgroup a tile, one warpgroup's
// epilogue under the other's MMAs) with pingpong_dgrad_bn_epilogue.cuh's epilogue.

// The order: CUTLASS's convolution headers use cute, cutlass's core and its hardware info
// without including them, so those come first.
// clang-format off
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include <cutlass/kernel_hardware_info.hpp>
#include <cutlass/conv/collective/collective_builder.hpp>
#include <cutlass/conv/convnd_problem_shape.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>
// clang-format on

#include <string>

#include "backend/cuda/cutlass/cutlass_unit.cuh"
#include "backend/cuda/cutlass/dgrad_bn.h"
#include "backend/cuda/cutlass/dgrad_bn_epilogue.cuh"
#include "backend/cuda/cutlass/dgrad_bn_unit.cuh"
#include "backend/cuda/cutlass/persistent_conv.cuh"
#include "backend/cuda/cutlass/pingpong_dgrad_bn_epilogue.cuh"

#ifndef KILN_DGRAD_PINGPONG
#define KILN_DGRAD_PINGPONG 0
#endif

namespace kiln::sm90 {
namespace {

using namespace cute;

static_assert(kMode == StatsMode::reg_atomic || kMode == StatsMode::reg_partials,
              "the data gradient's sums are the register epilogue's: reg_atomic or reg_partials");
constexpr bool kPartials = kMode == StatsMode::reg_partials;

// A convolution's tile names its K mode as a shape (CUTLASS folds K, S and R into it). The
// 256-row tile's epilogue stages its z rows in two 34 KB halves (dgrad_bn_epilogue.cuh), which
// leaves a K step of 64 three pipeline stages of 48 KB (the whole tile's z left it two).
using ConvTileShape = Shape<Int<kTileM>, Int<kTileN>, Shape<_64>>;

#if KILN_DGRAD_PINGPONG
static_assert(kMode == StatsMode::reg_atomic && !kDy2, "the ping-pong unit: atomic sums, no dy2");
using TmaEpilogue = StoreHalfEpilogue<ConvTileShape, cutlass::epilogue::TmaWarpSpecialized>;
using Epilogue = PingpongDgradBnEpilogue<TmaEpilogue, kTileM, kTileN>;
#else
using TmaEpilogue = StoreHalfEpilogue<ConvTileShape>;
using Epilogue = DgradBnEpilogue<TmaEpilogue, kTileM, kTileN, kPartials, kDy2>;
#endif

using ConvMainloop = typename cutlass::conv::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::conv::Operator::kDgrad,
    cutlass::half_t, cutlass::layout::TensorNHWC, 8, cutlass::half_t, cutlass::layout::TensorNHWC,
    8, float, ConvTileShape, ClusterShape,
    cutlass::conv::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;
#if KILN_DGRAD_PINGPONG
// The builder's own TiledMma: one warpgroup over the whole tile.
using Mainloop =
    PersistentConvMainloop<ConvMainloop, cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
#else
// Two warpgroups along M (64 rows each at 128), B (the filter) read C-major as dgrad's is.
using CooperativeMma =
    decltype(make_tiled_mma(GMMA::ss_op_selector<cutlass::half_t, cutlass::half_t, float,
                                                 ConvTileShape, GMMA::Major::K, GMMA::Major::MN>(),
                            Layout<Shape<_2, _1, _1>>{}));
using Mainloop = PersistentConvMainloop<typename WithTiledMma<ConvMainloop, CooperativeMma>::type>;
#endif
using Kernel =
    cutlass::gemm::kernel::GemmUniversal<typename Mainloop::GemmProblem, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
using Problem = typename Mainloop::ConvProblem;

int64_t images(const DgradBn& d) {
  return d.m / (static_cast<int64_t>(d.h) * d.w_);
}

// The convolution whose data gradient this is: x [images][h][w][n], W [k][r][s][n].
Problem problem(const DgradBn& d) {
  return Problem(cutlass::conv::Mode::kCrossCorrelation,
                 {static_cast<int>(images(d)), d.h, d.w_, static_cast<int>(d.n)},
                 {static_cast<int>(d.k), d.r, d.s, static_cast<int>(d.n)}, {d.pad_h, d.pad_w},
                 {d.pad_h, d.pad_w}, {1, 1}, {1, 1}, 1);
}

int ctas(const DgradBn& d) {
  return column_block_ctas(d.n, kTileN, d.sm_count);
}

// As the GEMM units' (dgrad_bn_sm90.cu): reg_partials sums through per-CTA partial rows ahead of
// CUTLASS's workspace.
ColumnSums column_sums(const DgradBn& d) {
  float* second = d.sums ? d.sums + d.n : nullptr;
  ColumnSums s{d.sums, second, d.n, kPartials ? ctas(d) : 0, d.n, d.sm_count};
  s.clear_by_kernel = d.clear_by_kernel;
  return s;
}

typename Gemm::Arguments arguments(const DgradBn& d, void* workspace) {
  using Element = cutlass::half_t;
  const Problem shape = problem(d);
  const auto sd = cutlass::make_cute_packed_stride(
      typename Kernel::StrideD{}, {static_cast<int>(d.m), static_cast<int>(d.n), 1});
  cutlass::KernelHardwareInfo hw;
  hw.device_id = d.device_id;
  hw.sm_count = ctas(d);
  typename Epilogue::Arguments epilogue{};
  static_cast<typename TmaEpilogue::Arguments&>(epilogue) = {
      {}, nullptr, typename Kernel::StrideC{}, static_cast<Element*>(d.g), sd};
  const ColumnSums s = column_sums(d);
  set_bn_arguments(epilogue, d, kPartials ? s.partial_sum(workspace) : s.sum,
                   kPartials ? s.partial_sumsq(workspace) : s.sumsq, kPartials ? ctas(d) : 0);
  return typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGemm, Mainloop::gemm_problem(shape),
      typename Mainloop::Arguments{
          {static_cast<const Element*>(d.dy), static_cast<const Element*>(d.w)}, shape},
      epilogue, hw};
}

// The geometry this unit takes: stride 1 with padding that keeps the size (dX's rows are then
// dY's), whole images.
std::string check_geometry(const DgradBn& d) {
  if (d.h <= 0 || d.w_ <= 0 || d.m % (static_cast<int64_t>(d.h) * d.w_) != 0)
    return "m (" + std::to_string(d.m) + ") is not a whole number of h x w images";
  if (d.h + 2 * d.pad_h - d.r + 1 != d.h || d.w_ + 2 * d.pad_w - d.s + 1 != d.w_)
    return "takes stride-1 filters padded to keep the size (2 pad = filter - 1)";
  return "";
}

size_t workspace_bytes(const DgradBn& d) {
  return column_sums(d).partial_bytes() + Gemm::get_workspace_size(arguments(d, nullptr));
}

std::string check(const DgradBn& d) {
  if (std::string err = check_inputs(d); !err.empty()) return err;
  if (std::string err = check_geometry(d); !err.empty()) return err;
  return check_gemm<Gemm>(arguments(d, nullptr));
}

std::string run(const DgradBn& d, void* workspace, cudaStream_t stream) {
  if (std::string err = check_inputs(d); !err.empty()) return err;
  if (std::string err = check_geometry(d); !err.empty()) return err;
  return run_gemm<Gemm>(arguments(d, workspace), column_sums(d), workspace, stream);
}

}  // namespace

#if KILN_DGRAD_PINGPONG
DgradBnKernel KILN_CONV_DGRAD_BN_PINGPONG_FN(KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE,
                                             KILN_CLUSTER_M, KILN_CLUSTER_N)() {
#elif KILN_DGRAD_DY2
DgradBnKernel KILN_CONV_DGRAD_BN_FN(KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE, KILN_CLUSTER_M,
                                    KILN_CLUSTER_N)() {
#else
DgradBnKernel KILN_CONV_DGRAD_BN_NODY2_FN(KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE, KILN_CLUSTER_M,
                                          KILN_CLUSTER_N)() {
#endif
  return unit_kernel<DgradBn>(
      "conv dgrad+bn " KILN_VARIANT_NAME KILN_DGRAD_NAME_TAIL KILN_DGRAD_SCHEDULE_TAIL,
      workspace_bytes, check, run);
}

}  // namespace kiln::sm90
