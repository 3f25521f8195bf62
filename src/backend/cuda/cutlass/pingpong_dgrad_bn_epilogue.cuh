// The data gradient's BatchNorm epilogue (dgrad_bn_epilogue.cuh's: g in place of dX, and
// sum g and sum g (z - mean) per column) for CUTLASS's ping-pong kernel, where each consumer
// warpgroup computes whole tiles of its own and one warpgroup's epilogue runs while the other's
// MMAs do. The cooperative kernel stops both warpgroups' MMAs for every tile's epilogue, which
// made the fused data gradient slower than cuDNN's plus the sums pass it removes
// (bench/RESULTS.md); here the epilogue is hidden wherever it is shorter than a mainloop.
//
// What differs from the cooperative epilogue, and why:
// - 128 threads a tile, 128 accumulators a thread: the sums cannot also live in registers
//   across tiles (64 more), so each tile's are reduced across the lanes that share a column
//   (shuffles) and added into the warp's row of shared sums, flushed to global memory (one FP32
//   atomic per column) when the warpgroup's column block changes and after its last tile.
// - Each warpgroup stages its own tiles' z rows in shared memory (as the cooperative epilogue
//   does, with a buffer and an mbarrier of its own): once its epilogue has read a tile's rows it
//   starts the copies of its next tile's, which land under the next mainloops. z read at the
//   accumulators' own coordinates from global memory put a DRAM latency per column group on
//   each tile (the unit ran 1.5-2.2x the cooperative one's time on VGG's layers,
//   bench/RESULTS.md). The mask (1/16 of the bytes) is read per thread, the next tile's rows
//   prefetched into L2.
// - The kernel calls store_tail after every tile; the warpgroup's last tile is known from the
//   static persistent scheduler's order (a CTA's warpgroups take its tiles alternately), which
//   each tile's coordinates confirm (else the sums are flushed after every tile).
// Atomic sums only (a deterministic form would need a fixed order of the two warpgroups' adds)
// and no second gradient (a CBR's g: VGG's layers).
#pragma once
#include <cuda_fp16.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cute/tensor.hpp>

#include "backend/cuda/cutlass/dgrad_bn_pair.cuh"

namespace kiln::sm90 {

// Base: CUTLASS's sm90 TMA warp-specialised (non-cooperative) collective epilogue storing the
// accumulators in FP16; a tile of TileM x TileN on one warpgroup, one GMMA atom TileN wide.
template <class Base, int TileM, int TileN>
class PingpongDgradBnEpilogue : public Base {
  static constexpr int kThreads = 128, kWarps = 4, kWarpGroups = 2;
  static constexpr int kGroups = TileN / 8;  // a thread's column pairs, 8 columns apart
  static constexpr int kWords = TileN / 32;  // a row's mask bytes, four to a word
  using Staging = StagedRows<kThreads, TileM, TileN>;
  static constexpr int kPitch = Staging::kPitch;

 public:
  struct TensorStorage : Base::TensorStorage {
    // [warpgroup][sum, sum of g (z - mean)][warp][column]: each slot written by one lane.
    alignas(16) float sums[kWarpGroups][2][kWarps][TileN];
    // Each warpgroup's staged z rows of one tile, and its mbarrier: all its threads' copies
    // landed.
    alignas(16) __half z[kWarpGroups][Staging::kHalves];
    alignas(8) uint64_t staged[kWarpGroups];
  };
  using PipelineStorage = typename Base::PipelineStorage;
  struct SharedStorage {
    TensorStorage tensors;
    PipelineStorage pipeline;
  };

  // As RegisterStatsEpilogue's, so dgrad_bn_unit.cuh's set_bn_arguments fills either.
  struct StatsArguments {
    float* sum = nullptr;  // [N]
    float* sumsq = nullptr;
    int rows = 0, ld = 0;  // unused: atomic sums only
  };
  using BnArguments = DgradBnInputs;
  struct Arguments : Base::Arguments {
    StatsArguments stats;
    BnArguments bn;
  };
  struct Params : Base::Params {
    StatsArguments stats;
    BnArguments bn;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem, Arguments const& args,
                                        void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem, args, workspace);
    p.stats = args.stats;
    p.bn = args.bn;
    return p;
  }

  CUTLASS_HOST_DEVICE
  PingpongDgradBnEpilogue(Params const& params, TensorStorage& shared)
      : Base(params, shared), stats_(params.stats), bn_(params.bn), smem_(&shared) {
#if defined(__CUDA_ARCH__)
    // Every thread builds the epilogue before the kernel's __syncthreads: the shared sums start
    // at zero for both warpgroups.
    float* all = &shared.sums[0][0][0][0];
    for (int i = threadIdx.x; i < kWarpGroups * 2 * kWarps * TileN; i += blockDim.x) all[i] = 0.0f;
    warp_group_ = static_cast<int>(threadIdx.x) / kThreads - 1;  // the consumers are 1 and 2
    if (threadIdx.x == 0) {
      for (int w = 0; w < kWarpGroups; ++w)
        cutlass::arch::ClusterBarrier::init(&shared.staged[w], kThreads);
      cutlass::arch::fence_barrier_init();
    }
#endif
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
    static_assert(cute::size(TiledMma{}) == kThreads, "one consumer warpgroup a tile");
    const int n_block = static_cast<int>(cute::get<1>(coord));
    if (n_block != n_block_ && n_block_ >= 0) flush(thread_idx);
    n_block_ = n_block;
    n_total_ = static_cast<int>(cute::get<1>(problem));
    // This warpgroup's tiles are the CTA's linear tiles warp_group_, warp_group_ + 2, ... of the
    // scheduler's order (one-dimensional grid: both raster orders start at the CTA's index).
    const int64_t grid = static_cast<int64_t>(gridDim.x) * gridDim.y * gridDim.z;
    const int64_t cta = blockIdx.x + static_cast<int64_t>(blockIdx.y) * gridDim.x;
    const int64_t mb = (bn_.rows + TileM - 1) / TileM, nb = (bn_.cols + TileN - 1) / TileN;
    const int64_t linear = cta + (kWarpGroups * done_ + warp_group_) * grid;
    ++done_;
    // The scheduler's number for the tile it gave, under its raster order (along N where the M
    // tiles are at least as many, else along M): should it ever differ from the order assumed
    // here, the warpgroup could not tell its last tile, so from then on it flushes its sums
    // after every tile (slower, still right).
    const int64_t m_block = cute::get<0>(coord);
    in_order_ = in_order_ && (nb > mb ? m_block + n_block * mb : m_block * nb + n_block) == linear;
    last_ = !in_order_ || linear + kWarpGroups * grid >= mb * nb;
    const int64_t tile = m_block * nb + n_block;
    if (staging_.staged() != tile) {  // the first tile, or the guess below was wrong
      staging_.drain(landed());
      stage(tile, thread_idx);
    }
    // The warpgroup's next tile: where the M tiles are at least as many as the N tiles, the
    // scheduler rasters along N (tile t = m nb + n) and the warpgroup moves on by two grids;
    // elsewhere nothing is staged ahead.
    const int64_t next = last_ || nb > mb ? -1 : tile + kWarpGroups * grid;
    if (next >= 0) prefetch_mask_l2<kThreads, TileM, TileN>(bn_, next, thread_idx);
    form_gradient(accumulators, tiled_mma, problem, coord, thread_idx);
    // Every thread of the warpgroup has read the staged rows: the next tile's may land on them.
    cutlass::arch::NamedBarrier::sync(kThreads, barrier_id());
    if (next >= 0) stage(next, thread_idx);
    return Base::store(load_pipeline, load_state, store_pipeline, store_state, problem, tile_shape,
                       coord, accumulators, tiled_mma, thread_idx, shared, subtile_idx);
  }

  // The kernel calls it after each of the warpgroup's tiles; the sums go out after the last.
  CUTLASS_DEVICE auto store_tail(typename Base::LoadPipeline load_pipeline,
                                 typename Base::LoadPipelineState load_state,
                                 typename Base::StorePipeline store_pipeline,
                                 typename Base::StorePipelineState store_state) {
    if (last_) {
      staging_.drain(landed());
      flush(static_cast<int>(threadIdx.x) % kThreads);
    }
    return Base::store_tail(load_pipeline, load_state, store_pipeline, store_state);
  }

 private:
  // The first named barriers CUTLASS leaves to users, one per warpgroup.
  CUTLASS_DEVICE uint32_t barrier_id() const {
    return static_cast<uint32_t>(warp_group_);
  }

  // The warpgroup's mbarrier: its staged rows landed.
  CUTLASS_DEVICE uint64_t* landed() const {
    return &smem_->staged[warp_group_];
  }

  // Starts the copies of tile t's z rows into the warpgroup's buffer; this thread arrives on the
  // warpgroup's mbarrier when its copies land.
  CUTLASS_DEVICE void stage(int64_t t, int thread_idx) {
    const int64_t nb = (bn_.cols + TileN - 1) / TileN;
    staging_.template start<false>(t, t / nb * TileM, t % nb * TileN, bn_, smem_->z[warp_group_],
                                   nullptr, landed(), thread_idx);
  }

  // acc -> g in place, and each column's two sums over the tile's rows into the warp's shared
  // slots.
  template <class AccEngine, class AccLayout, class TiledMma, class ProblemShapeMNKL,
            class TileCoordMNKL>
  CUTLASS_DEVICE void form_gradient(cute::Tensor<AccEngine, AccLayout>& acc,
                                    TiledMma const& tiled_mma, ProblemShapeMNKL problem,
                                    TileCoordMNKL coord, int thread_idx) {
    using namespace cute;
    using L = AccLayout;
    static_assert(
        rank(L{}) == 3 && rank<0>(L{}) == 3 && size<0, 0>(L{}) == 2 && size<0, 1>(L{}) == 2,
        "expects the SM90 GMMA F32 accumulator layout ((2,2,N/8),MMA_M,MMA_N)");
    static_assert(size<0, 2>(L{}) == kGroups && size<2>(L{}) == 1, "one GMMA atom TileN wide");
    constexpr int kAtomsM = size<1>(L{});
    static_assert(kAtomsM * 64 == TileM, "one warpgroup: 64 rows per atom along M");
    const auto coords =
        tiled_mma.get_thread_slice(thread_idx)
            .partition_C(make_identity_tensor(make_shape(Int<TileM>{}, Int<TileN>{})));
    // The tile's origin in 64 bits once; offsets within it fit 32 bits (TileM rows of N < 2^23).
    const int cols = static_cast<int>(get<1>(problem));
    const int64_t m0 = static_cast<int64_t>(get<0>(coord)) * TileM;
    const int n0 = static_cast<int>(get<1>(coord)) * TileN;
    const int rows_left = static_cast<int>(
        cute::min(static_cast<int64_t>(get<0>(problem)) - m0, static_cast<int64_t>(TileM)));
    const uint8_t* mask = bn_.mask + (m0 * cols + n0) / 8;  // whole bytes: (m0 N + n0) % 8 == 0
    const int bit0 = get<1>(coords(make_coord(make_coord(0, 0, 0), 0, 0))) & 7;
    // Group g's column pair (col0 + 8 g, + 1) has its two bits in byte g of the row's bytes from
    // n0, at bit col0 % 8 (row N + n0 is a multiple of 8). All rows' words load first.
    uint32_t words[kAtomsM][2][kWords];
    CUTLASS_PRAGMA_UNROLL
    for (int am = 0; am < kAtomsM; ++am) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = get<0>(coords(make_coord(make_coord(0, r, 0), am, 0)));
        load_mask_words(mask + row * (cols / 8), row < rows_left, bn_.mask_rows_aligned, n0, cols,
                        words[am][r]);
      }
    }
    // A whole tile skips the bounds checks (as the cooperative epilogue's form_pairs): its
    // element loop then has no branches, and the groups' shared-memory and shuffle latencies
    // overlap one another.
    const bool full = rows_left == TileM && n0 + TileN <= cols;
    staging_.wait(landed());
    if (full) {
      form_groups<false>(acc, coords, words, bit0, cols, n0, rows_left, thread_idx);
    } else {
      form_groups<true>(acc, coords, words, bit0, cols, n0, rows_left, thread_idx);
    }
  }

  // form_gradient's accumulators, column group by column group; Checked: the tile ends inside
  // M or N, and elements past them stay out of the sums.
  template <bool Checked, class Acc, class Coords, int kAtomsM>
  CUTLASS_DEVICE void form_groups(Acc& acc, Coords const& coords,
                                  uint32_t const (&words)[kAtomsM][2][kWords], int bit0, int cols,
                                  int n0, int rows_left, int thread_idx) {
    using namespace cute;
    const int lane = thread_idx % 32, warp = thread_idx / 32 % kWarps;
    const __half* z = smem_->z[warp_group_];
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      const int col = get<1>(coords(make_coord(make_coord(0, 0, g), 0, 0)));  // even: col, col + 1
      const bool col_in = !Checked || n0 + col < cols;  // N % 8 == 0: both or neither
      const float mu0 = col_in ? __ldg(bn_.mean + n0 + col) : 0.0f;
      const float mu1 = col_in ? __ldg(bn_.mean + n0 + col + 1) : 0.0f;
      float s0 = 0.0f, s1 = 0.0f, q0 = 0.0f, q1 = 0.0f;
      CUTLASS_PRAGMA_UNROLL
      for (int am = 0; am < kAtomsM; ++am) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          const auto i0 = make_coord(make_coord(0, r, g), am, 0);
          const auto i1 = make_coord(make_coord(1, r, g), am, 0);
          const int row = get<0>(coords(i0));
          float2 gv = make_float2(0.0f, 0.0f);
          if (!Checked || (col_in && row < rows_left)) {
            const uint32_t two = words[am][r][g / 4] >> (8 * (g % 4) + bit0);
            gv = masked_gradient(acc(i0), acc(i1), two, nullptr);
            const float2 zf =
                __half22float2(*reinterpret_cast<const __half2*>(z + row * kPitch + col));
            s0 += gv.x;
            s1 += gv.y;
            q0 = fmaf(gv.x, zf.x - mu0, q0);
            q1 = fmaf(gv.y, zf.y - mu1, q1);
          }
          acc(i0) = gv.x;
          acc(i1) = gv.y;
        }
      }
      // The lanes holding the same columns differ in lane bits 2-4 (lane % 4 picks the pair).
      CUTLASS_PRAGMA_UNROLL
      for (int x = 4; x < 32; x *= 2) {
        s0 += __shfl_xor_sync(0xffffffffu, s0, x);
        s1 += __shfl_xor_sync(0xffffffffu, s1, x);
        q0 += __shfl_xor_sync(0xffffffffu, q0, x);
        q1 += __shfl_xor_sync(0xffffffffu, q1, x);
      }
      if (lane < 4) {
        float* s = &smem_->sums[warp_group_][0][warp][col];
        float* q = &smem_->sums[warp_group_][1][warp][col];
        s[0] += s0, s[1] += s1, q[0] += q0, q[1] += q1;
      }
    }
  }

  // The warpgroup's shared sums for column block n_block_ into global memory, then cleared.
  // All of the warpgroup's threads call it together (it synchronises them).
  CUTLASS_DEVICE void flush(int thread_idx) {
    cutlass::arch::NamedBarrier::sync(kThreads, barrier_id());
    for (int c = thread_idx; c < TileN; c += kThreads) {
      float s = 0.0f, q = 0.0f;
      CUTLASS_PRAGMA_UNROLL
      for (int w = 0; w < kWarps; ++w) {
        s += smem_->sums[warp_group_][0][w][c];
        q += smem_->sums[warp_group_][1][w][c];
        smem_->sums[warp_group_][0][w][c] = 0.0f;
        smem_->sums[warp_group_][1][w][c] = 0.0f;
      }
      const int col = n_block_ * TileN + c;
      if (col < n_total_) {
        atomicAdd(stats_.sum + col, s);
        atomicAdd(stats_.sumsq + col, q);
      }
    }
    // The next tile's adds come after every clear.
    cutlass::arch::NamedBarrier::sync(kThreads, barrier_id());
  }

  StatsArguments stats_;
  BnArguments bn_;
  TensorStorage* smem_;
  Staging staging_;     // the warpgroup's tile whose rows are landing
  int warp_group_ = 0;  // the consumer warpgroup, 0 or 1
  int n_block_ = -1;    // the column block the shared sums hold, -1 before the first tile
  int n_total_ = 0;
  int64_t done_ = 0;      // the warpgroup's tiles so far
  bool in_order_ = true;  // every tile so far the one the static order gave
  bool last_ = false;     // this tile is the warpgroup's last, or the order is not known
};

}  // namespace kiln::sm90
