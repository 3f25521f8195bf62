// The data gradient's epilogue that also does BatchNorm-backward's sums pass: where dX is the
// gradient at the output of relu(bn(z)) (a CBR) or relu(bn(z) + residual) (BN+add+ReLU, whose
// other gradient dy2 arrives from the residual path), each accumulator becomes
//   g = mask ? round16(round16(acc) [+ dy2]) : 0
// exactly as kiln's BatchNorm backward forms it from the stored dX, dy2 and the mask bits
// (bn_kernels.cuh's grad_sum: the FP16 sum of the FP16 values), and the per-column sums
// sum g and sum g (z - mean) that bwd_partial_* would take are added in registers across the
// CTA's tiles, as register_stats_epilogue.cuh does for the forward's statistics (its flush).
// CUTLASS's TMA epilogue then stores g (exact in FP16) in place of dX.
//
// Each thread reads z, the mask byte and dy2 at its accumulators' own (row, column), which it
// takes from the TiledMma's partition of an identity tensor (no assumed row layout); two
// adjacent columns at a time (GMMA holds column pairs), so z and dy2 as half2 and both bits from
// one mask byte (C % 8 == 0: a byte holds 8 channels of one pixel).
#pragma once
#include <cuda_fp16.h>

#include "backend/cuda/cutlass/register_stats_epilogue.cuh"

namespace kiln::sm90 {

template <class Base, int TileM, int TileN, bool Partials>
class DgradBnEpilogue : public RegisterStatsEpilogue<Base, TileM, TileN, Partials> {
  using Stats = RegisterStatsEpilogue<Base, TileM, TileN, Partials>;

 public:
  using typename Stats::SharedStorage;
  using typename Stats::TensorStorage;

  // BatchNorm's side of the epilogue; the sums go to Stats::Arguments' stats (sum: sum g,
  // sumsq: sum g (z - mean)).
  struct BnArguments {
    const __half* z = nullptr;      // [M][N] BatchNorm's input, saved by the forward
    const uint8_t* mask = nullptr;  // bit e % 8 of byte e / 8: element e = row N + col
    const __half* dy2 = nullptr;    // [M][N] or none: BN+add+ReLU's second gradient
    const float* mean = nullptr;    // [N] BatchNorm's saved batch mean
    int64_t rows = 0, cols = 0;     // M and N: the first tile's prefetch (before any store)
  };
  struct Arguments : Stats::Arguments {
    BnArguments bn;
  };
  struct Params : Stats::Params {
    BnArguments bn;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem, Arguments const& args,
                                        void* workspace) {
    Params p;
    static_cast<typename Stats::Params&>(p) =
        Stats::to_underlying_arguments(problem, args, workspace);
    p.bn = args.bn;
    return p;
  }

  CUTLASS_HOST_DEVICE
  DgradBnEpilogue(Params const& params, TensorStorage& shared)
      : Stats(params, shared), bn_(params.bn) {
#if defined(__CUDA_ARCH__)
    // The CTA's first tile (the scheduler's linear index along N, below): its consumer threads
    // (warp groups 1 and 2; the producer's is 0) build the epilogue before their first mainloop.
    if (threadIdx.x >= 128)
      prefetch_tile(static_cast<int64_t>(blockIdx.x) + static_cast<int64_t>(blockIdx.y) * gridDim.x,
                    bn_.rows, bn_.cols, static_cast<int>(threadIdx.x) - 128);
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
    static_assert(cute::size(TiledMma{}) == Stats::kThreads, "two consumer warpgroups");
    this->begin_tile(problem, coord, thread_idx);
    prefetch_next_tile(problem, coord, thread_idx);
    form_gradient(accumulators, tiled_mma, problem, coord, thread_idx);
    return Base::store(load_pipeline, load_state, store_pipeline, store_state, problem, tile_shape,
                       coord, accumulators, tiled_mma, thread_idx, shared, subtile_idx);
  }

 private:
  // The epilogue's loads of z, dy2 and the mask wait on DRAM once per tile, with nothing else
  // in flight on the SM (measured: ~0.75 TB/s). So each tile first asks L2 for the rows its CTA's
  // next tile will read (bulk prefetches, one row segment per thread), and those arrive while
  // this epilogue and the next mainloop run. The next tile is the persistent scheduler's: with
  // one-CTA clusters and no swizzle it rasters along N where the M tiles are at least as many
  // (ResNet-50's every layer), tile t = m nb + n, and a CTA moves on by the grid's size; else no
  // prefetch (a hint only: a wrong guess costs bandwidth, never a wrong value).
  template <class ProblemShapeMNKL, class TileCoordMNKL>
  CUTLASS_DEVICE void prefetch_next_tile(ProblemShapeMNKL problem, TileCoordMNKL coord,
                                         int thread_idx) const {
    using namespace cute;
    const int64_t rows = get<0>(problem), cols = get<1>(problem);
    const int64_t nb = (cols + TileN - 1) / TileN;
    prefetch_tile(static_cast<int64_t>(get<0>(coord)) * nb + get<1>(coord) +
                      static_cast<int64_t>(gridDim.x) * gridDim.y * gridDim.z,
                  rows, cols, thread_idx);
  }

  // Linear tile t of an M x N problem (rows, cols), if it is one.
  CUTLASS_DEVICE void prefetch_tile(int64_t t, int64_t rows, int64_t cols, int thread_idx) const {
    const int64_t mb = (rows + TileM - 1) / TileM, nb = (cols + TileN - 1) / TileN;
    if (nb > mb || t >= mb * nb) return;  // rastered along M, or no such tile
    const int64_t m1 = t / nb * TileM, n1 = t % nb * TileN;
    const int64_t width = cols - n1 < TileN ? cols - n1 : TileN;  // a multiple of 8
    for (int i = thread_idx; i < 3 * TileM; i += Stats::kThreads) {
      const int64_t row = m1 + i % TileM;
      if (row >= rows) continue;
      const int64_t e = row * cols + n1;
      const int kind = i / TileM;
      if (kind == 0) {
        bulk_prefetch_l2(bn_.z + e, static_cast<uint32_t>(2 * width));
      } else if (kind == 1 && bn_.dy2) {
        bulk_prefetch_l2(bn_.dy2 + e, static_cast<uint32_t>(2 * width));
      } else if (kind == 2) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(bn_.mask + e / 8) : "memory");
      }
    }
  }

  // TMA's L2 prefetch of bytes (a multiple of 16) from a 16-byte aligned global address.
  static CUTLASS_DEVICE void bulk_prefetch_l2(const void* p, uint32_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
  }

  // acc -> g in place, and g's two sums into the column slots of register_stats_epilogue.cuh
  // (slot 2 group + v0: the column depends only on those accumulator modes).
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
    static_assert(size<0, 2>(L{}) == Stats::kGroups && size<2>(L{}) == 1,
                  "one GMMA atom TileN wide");
    constexpr int kAtomsM = size<1>(L{});
    const auto coords =
        tiled_mma.get_thread_slice(thread_idx)
            .partition_C(make_identity_tensor(make_shape(Int<TileM>{}, Int<TileN>{})));
    // The tile's origin in 64 bits once; offsets within it fit 32 bits (TileM rows of N < 2^23).
    const int cols = static_cast<int>(get<1>(problem));
    const int64_t m0 = static_cast<int64_t>(get<0>(coord)) * TileM;
    const int n0 = static_cast<int>(get<1>(coord)) * TileN;
    const int rows_left = static_cast<int>(
        cute::min(static_cast<int64_t>(get<0>(problem)) - m0, static_cast<int64_t>(TileM)));
    const int64_t origin = m0 * cols + n0;  // a multiple of 8: mask bytes hold whole groups
    const __half* z = bn_.z + origin;
    const __half* dy2 = bn_.dy2 ? bn_.dy2 + origin : nullptr;
    const uint8_t* mask = bn_.mask + origin / 8;
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < Stats::kGroups; ++g) {
      const int col = get<1>(coords(make_coord(make_coord(0, 0, g), 0, 0)));  // even: col, col + 1
      const bool col_in = n0 + col < cols;  // N % 8 == 0: both or neither
      const float mu0 = col_in ? __ldg(bn_.mean + n0 + col) : 0.0f;
      const float mu1 = col_in ? __ldg(bn_.mean + n0 + col + 1) : 0.0f;
      CUTLASS_PRAGMA_UNROLL
      for (int am = 0; am < kAtomsM; ++am) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          const auto i0 = make_coord(make_coord(0, r, g), am, 0);
          const auto i1 = make_coord(make_coord(1, r, g), am, 0);
          const int row = get<0>(coords(i0));
          float2 gv = make_float2(0.0f, 0.0f);
          if (col_in && row < rows_left) {
            const int e = row * cols + col;
            // dX as kiln's dgrad stores it, then grad_sum's rounding of dX + dy2.
            __half2 d = __float22half2_rn(make_float2(acc(i0), acc(i1)));
            if (dy2) {
              const float2 a = __half22float2(d);
              const float2 b = __half22float2(*reinterpret_cast<const __half2*>(dy2 + e));
              d = __float22half2_rn(make_float2(a.x + b.x, a.y + b.y));
            }
            const unsigned bits = static_cast<unsigned>(__ldg(mask + (e >> 3))) >> (e & 7);
            const float2 df = __half22float2(d);
            gv.x = bits & 1u ? df.x : 0.0f;
            gv.y = bits & 2u ? df.y : 0.0f;
            const float2 zf = __half22float2(*reinterpret_cast<const __half2*>(z + e));
            this->sum_[2 * g] += gv.x;
            this->sum_[2 * g + 1] += gv.y;
            this->sumsq_[2 * g] = fmaf(gv.x, zf.x - mu0, this->sumsq_[2 * g]);
            this->sumsq_[2 * g + 1] = fmaf(gv.y, zf.y - mu1, this->sumsq_[2 * g + 1]);
          }
          acc(i0) = gv.x;
          acc(i1) = gv.y;
        }
      }
    }
  }

  BnArguments bn_;
};

}  // namespace kiln::sm90
