// BatchNorm's apply and ReLU on the A operand's load (issue 20, stage 2's forward): a GEMM whose A
// is the previous layer's pre-BatchNorm z multiplies relu(round16((z - mean) * scale + beta)), the
// tensor BatchNorm's apply pass would have written, without that pass or that tensor.
//
// CUTLASS 4.2's SM90 register-sourced mainloop (MainloopSm90TmaGmmaRmemAWarpSpecialized: TMA
// loads A and B into shared memory; each consumer thread copies its A fragment into registers
// and WGMMA reads A from there, B from shared memory) with one step added: after each k-block's
// copy into registers, the fragment is transformed in place. Which channel an element belongs to
// is its k coordinate, read off an identity tensor partitioned as the fragment is. The loop is
// CUTLASS's `mma` with that step; the loads, the pipeline and the WGMMA schedule are CUTLASS's.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cutlass/cutlass.h>

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>

namespace kiln::sm90 {

// relu(round16((x - c.x) * c.y + c.z)) elementwise over a fragment of half_t whose k coordinates
// (within the tile) `coords` holds; coef[k0 + k] = (mean, gamma * invstd, beta, -). The arithmetic
// and its rounding are BatchNorm's apply pass's (bn_kernels.cuh), so the GEMM sees the bits the
// unfused chain stores (but for the sign of a zero and a NaN's payload). Pairs of values share a
// 32-bit register (a k pair of WGMMA's A fragment): one packing conversion and one max per pair
// keep the prologue's instructions under the WGMMAs' time, where a per-value round trip through
// float for the ReLU (the first form) made the consumer warps issue-bound.
// Folded: coef[k] = (scale, shift, -, -) with shift = beta - mean * scale, one FMA a value instead
// of a subtraction and an FMA; y may differ from the apply pass's by an FP16 ulp.
template <bool Folded, class Frag, class Coords>
CUTLASS_DEVICE void bn_relu_in_place(Frag&& frag, Coords const& coords, const float4* coef,
                                     int k0) {
  static_assert(decltype(cute::size(frag))::value % 2 == 0, "k pairs");
  const __half2 zero = __float2half2_rn(0.0f);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < cute::size(frag); i += 2) {
    const float4 c0 = __ldg(coef + k0 + cute::get<1>(coords(i)));
    const float4 c1 = __ldg(coef + k0 + cute::get<1>(coords(i + 1)));
    const float x0 = static_cast<float>(frag(i)), x1 = static_cast<float>(frag(i + 1));
    const float y0 = Folded ? fmaf(x0, c0.x, c0.y) : (x0 - c0.x) * c0.y + c0.z;
    const float y1 = Folded ? fmaf(x1, c1.x, c1.y) : (x1 - c1.x) * c1.y + c1.z;
    // ReLU that passes NaN, as relu_fwd does.
    const __half2 v = __hmax2_nan(__floats2half2_rn(y0, y1), zero);
    frag(i) = cutlass::half_t::bitcast(__half_as_ushort(__low2half(v)));
    frag(i + 1) = cutlass::half_t::bitcast(__half_as_ushort(__high2half(v)));
  }
}

// Base: CUTLASS's CollectiveMma for MainloopSm90TmaGmmaRmemAWarpSpecialized with 16-bit A and B,
// both K-major (no operand swap or transposition). Folded: coef holds (scale, shift) pairs.
template <class Base, bool Folded = false>
struct BnReluPrologueMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  using TileShape = typename Base::TileShape;
  static_assert(!Base::SwapAB && !Base::TransposeB, "16-bit K-major operands only");

  struct Arguments : Base::Arguments {
    const float4* coef = nullptr;  // [K] BatchNorm's apply coefficients of A's channels
  };
  // What the kernel keeps (it names this type, so it is Params too): CUTLASS's and coef.
  struct Params : Base::Params {
    const float4* coef;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args,
                                        void* workspace) {
    return {Base::to_underlying_arguments(shape, args, workspace), args.coef};
  }
  // Every k tile whole: the coefficients are read for each k of a tile.
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    const auto k = cute::get<2>(cute::append<4>(shape, 1));
    return args.coef != nullptr && k % cute::size<2>(TileShape{}) == 0 &&
           Base::can_implement(shape, args);
  }

  // CUTLASS's consumer loop (sm90_mma_tma_gmma_rs_warpspecialized.hpp) for 16-bit K-major
  // operands, with the prologue after each copy into registers. k_tile_count is the whole K (the
  // persistent scheduler does not split K), so the k tile a copy reads is counted here.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const& params) {
    using namespace cute;
    using SmemLayoutA = typename Base::SmemLayoutA;
    using SmemLayoutB = typename Base::SmemLayoutB;
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");

    Tensor sA = as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{}));
    Tensor sB_ = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});

    constexpr int MmaWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout =
        make_layout(Int<MmaWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);

    TiledMma tiled_mma;
    auto mma_thread_slice = tiled_mma.get_thread_slice(thread_idx);
    auto mma_warpgroup_slice = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));

    Tensor tCrA = mma_thread_slice.partition_fragment_A(sA(_, _, Int<0>{}));  // (MMA,MMA_M,MMA_K)
    Tensor tCsB = mma_warpgroup_slice.partition_B(sB_);  // (MMA,MMA_N,MMA_K,PIPE)
    Tensor tCrB = mma_warpgroup_slice.make_fragment_B(tCsB);
    // Each register's (m, k) in the tile: the fragment's partition of an identity tensor.
    Tensor tCcA = mma_thread_slice.partition_A(
        make_identity_tensor(make_shape(size<0>(TileShape{}), size<2>(TileShape{}))));

    auto smem_tiled_copy_A = make_tiled_copy_A(typename Base::InternalSmemCopyAtomA{}, tiled_mma);
    auto smem_thr_copy_A = smem_tiled_copy_A.get_thread_slice(thread_idx);
    Tensor tCrA_copy_view = smem_thr_copy_A.retile_D(tCrA);   // (CPY,CPY_M,CPY_K)
    Tensor tCsA_copy_view = smem_thr_copy_A.partition_S(sA);  // (CPY,CPY_M,CPY_K,PIPE)
    CUTE_STATIC_ASSERT_V(size<1>(tCrA) == size<1>(accum));
    CUTE_STATIC_ASSERT_V(size<2>(tCrA) > _2{}, "RS loops require more than 2 MMA k-iterations.");
    CUTE_STATIC_ASSERT_V(size(tCcA) == size(tCrA) && size<1>(tCcA) == size<1>(tCrA) &&
                         size<2>(tCcA) == size<2>(tCrA));
    constexpr int kBlocks = size<2>(tCrA);
    constexpr int kTileK = size<2>(TileShape{});

    // A's k-block `kb` of stage `stage` (k tile `kt`) into registers, then BatchNorm + ReLU. The
    // fence keeps the arithmetic before the next warpgroup_arrive (the compiler may otherwise
    // sink register-only work past it, and ptxas then serialises the WGMMAs: C7519).
    const int k_tiles = k_tile_count;
    auto load_a = [&](int stage, int kb, int kt) {
      copy(smem_tiled_copy_A, tCsA_copy_view(_, _, kb, stage), tCrA_copy_view(_, _, kb));
      Tensor a = tCrA(_, _, kb);
      bn_relu_in_place<Folded>(a, tCcA(_, _, kb), params.coef, kt * kTileK);
      warpgroup_fence_operand(a);
    };

    PipelineState smem_pipe_release = smem_pipe_read;
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(accum);

    auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    // The first k tile.
    {
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      int read_stage = smem_pipe_read.index();
      ++smem_pipe_read;
      barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
      load_a(read_stage, 0, 0);
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < kBlocks - 1; ++k_block) {
        load_a(read_stage, k_block + 1, 0);
        warpgroup_arrive();
        cute::gemm(tiled_mma, tCrA(_, _, k_block), tCrB(_, _, k_block, read_stage), accum);
        if (k_block == 0) tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        warpgroup_commit_batch();
      }
      warpgroup_wait<2>();
      warpgroup_arrive();
      cute::gemm(tiled_mma, tCrA(_, _, kBlocks - 1), tCrB(_, _, kBlocks - 1, read_stage), accum);
      warpgroup_commit_batch();
      --k_tile_count;
      if (k_tile_count == 0) return;
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      load_a(smem_pipe_read.index(), 0, k_tiles - k_tile_count);
      warpgroup_wait<2>();
    }

    warpgroup_fence_operand(accum);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 1; --k_tile_count) {
      int read_stage = smem_pipe_read.index();
      ++smem_pipe_read;
      const int kt = k_tiles - k_tile_count;  // the k tile now in registers' stage
      warpgroup_fence_operand(accum);
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < kBlocks; ++k_block) {
        if (k_block == 0) barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
        if (k_block == kBlocks - 1) {
          pipeline.consumer_wait(smem_pipe_read, barrier_token);
          load_a(smem_pipe_read.index(), 0, kt + 1);
        } else {
          load_a(read_stage, k_block + 1, kt);
        }
        warpgroup_arrive();
        cute::gemm(tiled_mma, tCrA(_, _, k_block), tCrB(_, _, k_block, read_stage), accum);
        warpgroup_commit_batch();
        warpgroup_wait<2>();
        if (k_block == 1) {
          pipeline.consumer_release(smem_pipe_release);
          ++smem_pipe_release;
        }
      }
      warpgroup_fence_operand(accum);
    }

    warpgroup_fence_operand(accum);
    // The last k tile.
    {
      int read_stage = smem_pipe_read.index();
      const int kt = k_tiles - 1;
      warpgroup_fence_operand(accum);
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < kBlocks - 1; ++k_block) {
        load_a(read_stage, k_block + 1, kt);
        warpgroup_arrive();
        cute::gemm(tiled_mma, tCrA(_, _, k_block), tCrB(_, _, k_block, read_stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        warpgroup_commit_batch();
        warpgroup_wait<2>();
        if (k_block == 1) {
          pipeline.consumer_release(smem_pipe_release);
          ++smem_pipe_release;
        }
      }
      warpgroup_arrive();
      cute::gemm(tiled_mma, tCrA(_, _, kBlocks - 1), tCrB(_, _, kBlocks - 1, read_stage), accum);
      warpgroup_commit_batch();
    }
    warpgroup_fence_operand(accum);
  }
};

}  // namespace kiln::sm90
