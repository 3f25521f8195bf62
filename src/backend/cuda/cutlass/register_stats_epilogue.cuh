// BatchNorm's per-channel sums taken from the accumulators themselves, in registers, by a
// collective epilogue wrapped around CUTLASS's SM90 TMA epilogue (which stores z unchanged).
//
// Why a collective and not an EVT node: a node's callbacks live for one tile, so its sums are
// reduced across threads once per tile; the collective epilogue object lives across the
// persistent kernel's whole tile loop, so its per-thread column sums can too. Each thread adds
// the FP16-rounded z and z^2 of every tile it computes into registers indexed by the GMMA
// accumulator's compile-time coordinates, and the CTA reduces them across threads (shuffles,
// then shared memory across warps) only when its tiles move to another column block and after
// its last tile: once per CTA when the CTA count is a multiple of the column blocks.
#pragma once
#include <cuda_fp16.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cute/tensor.hpp>

namespace kiln::sm90 {

// Base: CUTLASS's sm90 TMA warp-specialised collective epilogue (its fusion writes z in FP16),
// for a cooperative kernel (Threads 256: two consumer warpgroups along M) or the non-persistent
// one CUTLASS's SM90 convolutions use (Threads 128: one warpgroup, one tile, so its sums are
// flushed once, by store_tail); one GMMA atom TileN wide.
// Partials: each CTA adds into its own row of partial sums [rows][ld] (zeroed by the host, then
// summed by a finalize kernel); else it adds into sum and sumsq [N] with one FP32 atomic per
// column per flush.
template <class Base, int TileM, int TileN, bool Partials, int Threads = 256>
class RegisterStatsEpilogue : public Base {
 public:
  // The GMMA F32 accumulator of one thread: ((2 adjacent columns, 2 rows 8 apart, TileN / 8
  // column groups 8 apart), atoms along M, 1 atom along N); lane % 4 picks the column pair,
  // lane / 4 the row. Columns depend only on modes 0.0 and 0.2: one slot each, summed over rows.
  static constexpr int kThreads = Threads, kWarps = kThreads / 32;
  static constexpr int kGroups = TileN / 8, kSlots = 2 * kGroups;

  struct TensorStorage : Base::TensorStorage {
    // Per warp column sums [sum, sum of squares][warp][column], added across warps on a flush.
    alignas(16) float warp_sums[2][kWarps][TileN];
  };
  using PipelineStorage = typename Base::PipelineStorage;
  struct SharedStorage {
    TensorStorage tensors;
    PipelineStorage pipeline;
  };

  struct StatsArguments {
    float* sum = nullptr;  // [N], or the partial sums [rows][ld] (Partials)
    float* sumsq = nullptr;
    int rows = 0, ld = 0;  // Partials: one row per CTA of the grid
  };
  struct Arguments : Base::Arguments {
    StatsArguments stats;
  };
  struct Params : Base::Params {
    StatsArguments stats;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem, Arguments const& args,
                                        void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem, args, workspace);
    p.stats = args.stats;
    return p;
  }

  CUTLASS_HOST_DEVICE
  RegisterStatsEpilogue(Params const& params, TensorStorage& shared)
      : Base(params, shared), stats_(params.stats), warp_sums_(shared.warp_sums) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kSlots; ++i) sum_[i] = sumsq_[i] = 0.0f;
  }

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine,
            class AccLayout, class TiledMma>
  CUTLASS_DEVICE auto store(typename Base::LoadPipeline load_pipeline,
                            typename Base::LoadPipelineState load_state,
                            typename Base::StorePipeline store_pipeline,
                            typename Base::StorePipelineState store_state, ProblemShapeMNKL problem,
                            TileShapeMNK tile_shape, TileCoordMNKL coord,
                            cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma tiled_mma,
                            int thread_idx, TensorStorage& shared, int subtile_idx = -1) {
    static_assert(cute::size<0>(TileShapeMNK{}) == TileM && cute::size<1>(TileShapeMNK{}) == TileN);
    static_assert(cute::size(TiledMma{}) == kThreads, "the consumer warpgroups' threads");
    begin_tile(problem, coord, thread_idx);
    // z's stores go first: the sums below overlap the TMA stores' drain.
    auto next =
        Base::store(load_pipeline, load_state, store_pipeline, store_state, problem, tile_shape,
                    coord, accumulators, tiled_mma, thread_idx, shared, subtile_idx);
    accumulate(accumulators);
    return next;
  }

  // After the CTA's last tile (the kernel calls it once, where the CTA stored any tile).
  CUTLASS_DEVICE auto store_tail(typename Base::LoadPipeline load_pipeline,
                                 typename Base::LoadPipelineState load_state,
                                 typename Base::StorePipeline store_pipeline,
                                 typename Base::StorePipelineState store_state) {
    if (n_block_ >= 0) flush();
    return Base::store_tail(load_pipeline, load_state, store_pipeline, store_state);
  }

 protected:
  // Flushes the sums where the tile's column block differs from the last one's (all the consumer
  // threads call it together).
  template <class ProblemShapeMNKL, class TileCoordMNKL>
  CUTLASS_DEVICE void begin_tile(ProblemShapeMNKL problem, TileCoordMNKL coord, int thread_idx) {
    const int n_block = static_cast<int>(cute::get<1>(coord));
    if (n_block != n_block_ && n_block_ >= 0) flush();
    n_block_ = n_block;
    thread_idx_ = thread_idx;
    n_total_ = static_cast<int>(cute::get<1>(problem));
  }

  template <class AccEngine, class AccLayout>
  CUTLASS_DEVICE void accumulate(cute::Tensor<AccEngine, AccLayout> const& acc) {
    using namespace cute;
    using L = AccLayout;
    static_assert(
        rank(L{}) == 3 && rank<0>(L{}) == 3 && size<0, 0>(L{}) == 2 && size<0, 1>(L{}) == 2,
        "expects the SM90 GMMA F32 accumulator layout ((2,2,N/8),MMA_M,MMA_N)");
    static_assert(size<0, 2>(L{}) == kGroups && size<2>(L{}) == 1, "one GMMA atom TileN wide");
    constexpr int kAtomsM = size<1>(L{});
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      CUTLASS_PRAGMA_UNROLL
      for (int am = 0; am < kAtomsM; ++am) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          // z as the store rounds it (round to nearest), its two adjacent columns at once.
          const float2 z = __half22float2(
              __float22half2_rn(make_float2(acc(make_coord(make_coord(0, r, g), am, 0)),
                                            acc(make_coord(make_coord(1, r, g), am, 0)))));
          sum_[2 * g] += z.x;
          sum_[2 * g + 1] += z.y;
          sumsq_[2 * g] = fmaf(z.x, z.x, sumsq_[2 * g]);
          sumsq_[2 * g + 1] = fmaf(z.y, z.y, sumsq_[2 * g + 1]);
        }
      }
    }
  }

  // Adds the CTA's sums for column block n_block_ to global memory and clears them. All the
  // consumer threads call it together (it synchronises them).
  CUTLASS_DEVICE void flush() {
    using namespace cute;
    const int thread_idx = thread_idx_;
    // The lanes holding the same columns differ in lane bits 2-4 (GMMA: lane % 4 picks the
    // column pair, lane / 4 the row).
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kSlots; ++i) {
      CUTLASS_PRAGMA_UNROLL
      for (int x = 4; x < 32; x *= 2) {
        sum_[i] += __shfl_xor_sync(0xffffffffu, sum_[i], x);
        sumsq_[i] += __shfl_xor_sync(0xffffffffu, sumsq_[i], x);
      }
    }
    const int warp = thread_idx / 32, lane = thread_idx % 32;
    if (lane < 4) {
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < kGroups; ++g) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) {
          const int col = 2 * lane + c + 8 * g;
          warp_sums_[0][warp][col] = sum_[2 * g + c];
          warp_sums_[1][warp][col] = sumsq_[2 * g + c];
        }
      }
    }
    cutlass::arch::NamedBarrier::sync(kThreads, kStatsBarrier);
    const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    for (int c = thread_idx; c < TileN; c += kThreads) {
      float s = 0.0f, q = 0.0f;
      CUTLASS_PRAGMA_UNROLL
      for (int w = 0; w < kWarps; ++w) {
        s += warp_sums_[0][w][c];
        q += warp_sums_[1][w][c];
      }
      const int col = n_block_ * TileN + c;
      if (col >= n_total_) continue;
      if constexpr (Partials) {
        // Only this CTA writes its row: a plain add (a CTA may flush one block twice).
        if (cta < stats_.rows) {
          stats_.sum[static_cast<int64_t>(cta) * stats_.ld + col] += s;
          stats_.sumsq[static_cast<int64_t>(cta) * stats_.ld + col] += q;
        }
      } else {
        atomicAdd(stats_.sum + col, s);
        atomicAdd(stats_.sumsq + col, q);
      }
    }
    // warp_sums_ is written again by the next flush.
    cutlass::arch::NamedBarrier::sync(kThreads, kStatsBarrier);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kSlots; ++i) sum_[i] = sumsq_[i] = 0.0f;
  }

  static constexpr uint32_t kStatsBarrier = 0;  // the first named barrier CUTLASS leaves to users

  StatsArguments stats_;
  float (*warp_sums_)[kWarps][TileN];
  float sum_[kSlots], sumsq_[kSlots];
  int n_block_ = -1;  // the column block sum_ holds, -1 before the first tile
  int thread_idx_ = 0, n_total_ = 0;
};

}  // namespace kiln::sm90
