// One SM90 data-gradient kernel variant (dgrad_bn.h), chosen by the compile definitions
// KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE (reg_atomic or reg_partials), KILN_CLUSTER_M and
// KILN_CLUSTER_N: CMake compiles this file once per entry of dgrad_bn.h's list, each in its own
// translation unit.
//
// dX[m][n] = sum_k dY[m][k] W[k][n]: the forward's TMA warp-specialised cooperative GEMM
// (gemm_stats_sm90.cu) with B = W read N-major (KRSC's [k][n] holds the input channels n
// contiguous; WGMMA transposes 16-bit operands from shared memory), FP32 accumulators, and
// dgrad_bn_epilogue.cuh around CUTLASS's TMA epilogue: g instead of dX, and BatchNorm-backward's
// two per-column sums.
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>

#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>
#include <string>

#include "backend/cuda/cutlass/cutlass_unit.cuh"
#include "backend/cuda/cutlass/dgrad_bn.h"
#include "backend/cuda/cutlass/dgrad_bn_epilogue.cuh"
#include "backend/cuda/cutlass/dgrad_bn_unit.cuh"

namespace kiln::sm90 {
namespace {

using namespace cute;

static_assert(kMode == StatsMode::reg_atomic || kMode == StatsMode::reg_partials,
              "the data gradient's sums are the register epilogue's: reg_atomic or reg_partials");
constexpr bool kPartials = kMode == StatsMode::reg_partials;

using TmaEpilogue = StoreHalfEpilogue<TileShape>;
using Epilogue = DgradBnEpilogue<TmaEpilogue, kTileM, kTileN, kPartials, kDy2>;

// A = dY [m][k] K-major (RowMajor), B = W [k][n] N-major (RowMajor in CUTLASS's K x N view).
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::half_t, cutlass::layout::RowMajor,
    8, cutlass::half_t, cutlass::layout::RowMajor, 8, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

int ctas(const DgradBn& d) {
  return column_block_ctas(d.n, kTileN, d.sm_count);
}

// sums = [sum g; sum g (z - mean)]; reg_partials: through per-CTA partial rows [CTAs][n] of
// both, ahead of CUTLASS's workspace.
ColumnSums column_sums(const DgradBn& d) {
  ColumnSums s{d.sums, d.sums ? d.sums + d.n : nullptr, d.n, ctas(d), d.n, d.sm_count};
  s.clear_by_kernel = d.clear_by_kernel;
  return s;
}

typename Gemm::Arguments arguments(const DgradBn& d, void* workspace) {
  using Element = cutlass::half_t;
  const int m = static_cast<int>(d.m), n = static_cast<int>(d.n), k = static_cast<int>(d.k);
  const auto sa = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {m, k, 1});
  const auto sb = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {n, k, 1});
  const auto sd = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {m, n, 1});
  const ColumnSums s = column_sums(d);
  float* sum = kPartials ? s.partial_sum(workspace) : s.sum;
  float* sumsq = kPartials ? s.partial_sumsq(workspace) : s.sumsq;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = d.device_id;
  hw.sm_count = ctas(d);
  typename Epilogue::Arguments epilogue{};
  static_cast<typename TmaEpilogue::Arguments&>(epilogue) = {
      {}, nullptr, typename Kernel::StrideC{}, static_cast<Element*>(d.g), sd};
  set_bn_arguments(epilogue, d, sum, sumsq, kPartials ? ctas(d) : 0);
  return typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const Element*>(d.dy), sa, static_cast<const Element*>(d.w), sb},
      epilogue,
      hw};
}

size_t workspace_bytes(const DgradBn& d) {
  return column_sums(d).partial_bytes() + Gemm::get_workspace_size(arguments(d, nullptr));
}

std::string check(const DgradBn& d) {
  if (d.r != 1 || d.s != 1) return "takes 1x1 filters (the convolution units take others)";
  if (std::string err = check_inputs(d); !err.empty()) return err;
  return check_gemm<Gemm>(arguments(d, nullptr));
}

std::string run(const DgradBn& d, void* workspace, cudaStream_t stream) {
  if (std::string err = check_inputs(d); !err.empty()) return err;
  return run_gemm<Gemm>(arguments(d, workspace), column_sums(d), workspace, stream);
}

}  // namespace

#if KILN_DGRAD_DY2
DgradBnKernel KILN_DGRAD_BN_FN(KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE, KILN_CLUSTER_M,
                               KILN_CLUSTER_N)() {
#else
DgradBnKernel KILN_DGRAD_BN_NODY2_FN(KILN_TILE_M, KILN_TILE_N, KILN_STATS_MODE, KILN_CLUSTER_M,
                                     KILN_CLUSTER_N)() {
#endif
  return unit_kernel<DgradBn>("dgrad+bn " KILN_VARIANT_NAME KILN_DGRAD_NAME_TAIL, workspace_bytes,
                              check, run);
}

}  // namespace kiln::sm90
