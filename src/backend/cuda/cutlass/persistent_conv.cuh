// CUTLASS 4.2's SM90 implicit-GEMM convolution mainloop (im2col TMA loads of x, tiled TMA loads of
// the filter) run by its persistent cooperative GEMM kernel, which CUTLASS's own SM90 convolutions
// do not offer: their only kernel is the non-persistent one with one consumer warpgroup and one
// tile per CTA, whose epilogue nothing overlaps (1.2-3x cuDNN's time on VGG16's layers on the
// H200, bench/RESULTS.md). Here two consumer warpgroups share each tile (256 rows for the
// forward's units, 128 for the data gradient's) and each CTA loops over tiles, so one tile's
// epilogue runs while the producer warp loads the next tile's operands, as kiln's 1x1 GEMM
// (gemm_stats_sm90.cu) does.
//
// The adapter only renames: the convolution's linearised problem (M = N*P*Q pixels, N = K
// channels, K = (C, S, R), L = 1) is the GEMM kernel's problem shape; its tile coordinates are the
// GEMM's; the kernel's extra batch mode (L) is added to the filter's view, which the kernel
// reads it from, and the convolution's own load gets the views it made. The convolution's loads,
// MMAs and pipeline are CUTLASS's.
#pragma once
#include <cstdint>
#include <cute/tensor.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>

namespace kiln::sm90 {

// The collective `Conv` (a cutlass::conv::collective::CollectiveConv) with its TiledMma replaced
// by `Mma`: the conv builder makes a one-warpgroup TiledMma (its cooperative schedule is refused),
// the persistent kernel wants one warpgroup per 128 rows of the tile.
template <class Conv, class Mma>
struct WithTiledMma;
template <class Policy, class Tile, class A, class B, class OldMma, class TraitsA, class TraitsB,
          class Mma>
struct WithTiledMma<
    cutlass::conv::collective::CollectiveConv<Policy, Tile, A, B, OldMma, TraitsA, TraitsB>, Mma> {
  using type = cutlass::conv::collective::CollectiveConv<Policy, Tile, A, B, Mma, TraitsA, TraitsB>;
};

// Schedule: what the GEMM kernel dispatches on, the cooperative persistent schedule (two
// warpgroups a tile) or the ping-pong one (a warpgroup a tile, each warpgroup's epilogue under
// the other's MMAs: the conv builder's own one-warpgroup TiledMma).
template <class Conv, class Schedule_ = cutlass::gemm::KernelTmaWarpSpecializedCooperative>
struct PersistentConvMainloop : Conv {
  struct DispatchPolicy {
    static constexpr int Stages = Conv::DispatchPolicy::Stages;
    using ClusterShape = typename Conv::DispatchPolicy::ClusterShape;
    using ArchTag = typename Conv::DispatchPolicy::ArchTag;
    using Schedule = Schedule_;
  };
  // The GEMM kernel asserts rank-3 (M|N, K, L) operand strides; the convolution's own strides
  // live in its TMA descriptors, built by Conv::to_underlying_arguments.
  using StrideA = cute::Stride<int64_t, cute::_1, int64_t>;
  using StrideB = cute::Stride<int64_t, cute::_1, int64_t>;
  // One elected producer thread issues each stage's TMA loads.
  static constexpr int NumProducerThreadEvents = 1;

  using ConvProblem = typename Conv::ProblemShape;
  // The GEMM kernel's problem shape: (N*P*Q, K, (C, S, R), 1), the convolution's linearised one
  // with a run-time L as the GEMM epilogue's TMA store expects.
  using GemmProblem = cute::Shape<int, int, cute::Shape<int, int, int>, int>;
  static GemmProblem gemm_problem(ConvProblem const& conv) {
    auto const [m, n, k, l] = Conv::get_problem_shape_MNKL(conv);
    return {static_cast<int>(m),
            static_cast<int>(n),
            {static_cast<int>(cute::get<0>(k)), static_cast<int>(cute::get<1>(k)),
             static_cast<int>(cute::get<2>(k))},
            static_cast<int>(l)};
  }

  struct Arguments {
    typename Conv::Arguments conv;
    ConvProblem problem;
  };
  using Params = typename Conv::Params;

  template <class Shape>
  static Params to_underlying_arguments(Shape const&, Arguments const& args, void* workspace) {
    return Conv::to_underlying_arguments(args.problem, args.conv, workspace);
  }
  template <class Shape>
  static bool can_implement(Shape const&, Arguments const& args) {
    return Conv::can_implement(args.problem, args.conv);
  }

  // (A, B with a batch mode of one appended, B): the GEMM kernel reads the tile counts of the
  // first two and B's batch mode; the convolution's load takes A and the third.
  template <class ProblemMNKL>
  CUTLASS_DEVICE auto load_init(ProblemMNKL const& problem, Params const& params) {
    auto inputs = Conv::load_init(problem, params);
    auto const& b = cute::get<1>(inputs);
    auto b_with_l =
        cute::make_tensor(b.data(), cute::append(b.layout(), cute::Layout<cute::_1, cute::_0>{}));
    return cute::make_tuple(cute::get<0>(inputs), b_with_l, b);
  }

  template <class Inputs, class BlockCoord, class KTileIterator>
  CUTLASS_DEVICE void load(Params const& params, typename Conv::MainloopPipeline pipeline,
                           typename Conv::PipelineState state, Inputs const& inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int thread_idx, uint32_t block_rank_in_cluster,
                           typename Conv::TensorStorage& shared) {
    Conv::load(params, pipeline, state,
               cute::make_tuple(cute::get<0>(inputs), cute::get<2>(inputs)), blk_coord, k_tile_iter,
               k_tile_count, thread_idx, block_rank_in_cluster, shared);
  }
};

}  // namespace kiln::sm90
