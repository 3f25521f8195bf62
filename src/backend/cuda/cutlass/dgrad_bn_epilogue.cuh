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
// z and dy2 reach the epilogue through shared memory: each tile's epilogue, once it has read
// them, starts asynchronous copies (cp.async, 16 bytes a thread at a time, completion counted on
// an mbarrier: dgrad_bn_pair.cuh's StagedRows) of the rows its CTA's next tile reads, so they land
// while this tile's stores and the next mainloop run. Per-thread loads at the accumulators' own
// coordinates left a DRAM latency per tile exposed; a second buffer cost the mainloop stages and
// won nothing (bench/RESULTS.md). The mask (1/16 of the bytes, at byte alignment) is read per
// thread, all of a staged piece's bytes before their first use. Rows are padded by 16 bytes so the
// accumulator layout's reads (8 rows x 4 column pairs a warp) fall in 32 distinct banks. Dy2 =
// false: no second gradient and no room staged for one (a CBR's g), so the mainloop keeps that
// shared memory for its stages. A 256-row tile stages its rows in two 128-row halves through one
// buffer (the second half's copies start once the first is read): the whole tile's 68 KB of z
// left its mainloop two stages of a K step of 64.
#pragma once
#include <cuda_fp16.h>

#include "backend/cuda/cutlass/dgrad_bn_pair.cuh"
#include "backend/cuda/cutlass/register_stats_epilogue.cuh"

namespace kiln::sm90 {

template <class Base, int TileM, int TileN, bool Partials, bool Dy2 = true>
class DgradBnEpilogue : public RegisterStatsEpilogue<Base, TileM, TileN, Partials> {
  using Stats = RegisterStatsEpilogue<Base, TileM, TileN, Partials>;
  static constexpr int kThreads = Stats::kThreads;
  static constexpr int kParts = TileM > 128 ? 2 : 1;  // staged pieces of a tile
  static constexpr int kPartRows = TileM / kParts;
  using Staging = StagedRows<kThreads, kPartRows, TileN>;
  static constexpr int kPitch = Staging::kPitch;

 public:
  struct TensorStorage : Stats::TensorStorage {
    alignas(16) __half z[Staging::kHalves];
    alignas(16) __half dy2[Dy2 ? Staging::kHalves : 8];
    alignas(8) uint64_t staged;  // mbarrier: every consumer thread's copies of one piece landed
  };
  using PipelineStorage = typename Stats::PipelineStorage;
  struct SharedStorage {
    TensorStorage tensors;
    PipelineStorage pipeline;
  };

  // BatchNorm's side of the epilogue; the sums go to Stats::Arguments' stats (sum: sum g,
  // sumsq: sum g (z - mean)).
  using BnArguments = DgradBnInputs;
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
      : Stats(params, shared), bn_(params.bn), smem_(&shared) {
#if defined(__CUDA_ARCH__)
    // The kernel builds its epilogue once in every thread before its __syncthreads (the consumer
    // warpgroups build theirs again after it); thread 0, a producer, builds it only there.
    if (threadIdx.x == 0) {
      cutlass::arch::ClusterBarrier::init(&shared.staged, kThreads);
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
    static_assert(cute::size(TiledMma{}) == kThreads, "two consumer warpgroups");
    this->begin_tile(problem, coord, thread_idx);
    const int64_t nb = (bn_.cols + TileN - 1) / TileN;
    const int64_t tile = static_cast<int64_t>(cute::get<0>(coord)) * nb + cute::get<1>(coord);
    if (staging_.staged() != tile * kParts) {  // the first tile, or the guess below was wrong
      staging_.drain(&smem_->staged);
      stage(tile, 0, thread_idx);
    }
    form_gradient(accumulators, tiled_mma, problem, coord, thread_idx, tile);
    if (const int64_t next = next_tile(tile); next >= 0) {
      stage(next, 0, thread_idx);
      prefetch_mask_l2<kThreads, TileM, TileN>(bn_, next, thread_idx);
    }
    return Base::store(load_pipeline, load_state, store_pipeline, store_state, problem, tile_shape,
                       coord, accumulators, tiled_mma, thread_idx, shared, subtile_idx);
  }

  // After the CTA's last tile: a guessed next tile the scheduler did not give this CTA may
  // still be landing in shared memory; the CTA must not exit under it.
  CUTLASS_DEVICE auto store_tail(typename Base::LoadPipeline load_pipeline,
                                 typename Base::LoadPipelineState load_state,
                                 typename Base::StorePipeline store_pipeline,
                                 typename Base::StorePipelineState store_state) {
    staging_.drain(&smem_->staged);
    return Stats::store_tail(load_pipeline, load_state, store_pipeline, store_state);
  }

 private:
  static constexpr uint32_t kStageBarrier = Stats::kStatsBarrier + 1;

  // The CTA's next tile is the persistent scheduler's: with one-CTA clusters and no swizzle it
  // rasters along N where the M tiles are at least as many (ResNet-50's every layer), tile
  // t = m nb + n, and a CTA moves on by the grid's size. Elsewhere nothing is staged ahead, and
  // store() checks the guess before it uses it.
  CUTLASS_DEVICE int64_t next_tile(int64_t tile) const {
    const int64_t mb = (bn_.rows + TileM - 1) / TileM, nb = (bn_.cols + TileN - 1) / TileN;
    const int64_t next = tile + static_cast<int64_t>(gridDim.x) * gridDim.y * gridDim.z;
    return nb > mb || next >= mb * nb ? -1 : next;
  }

  // Starts the copies of piece `part` of tile t's z and dy2 rows into shared memory; this
  // thread arrives on the mbarrier when its copies land.
  CUTLASS_DEVICE void stage(int64_t t, int part, int thread_idx) {
    const int64_t nb = (bn_.cols + TileN - 1) / TileN;
    staging_.template start<Dy2>(t * kParts + part, t / nb * TileM + part * kPartRows,
                                 t % nb * TileN, bn_, smem_->z, smem_->dy2, &smem_->staged,
                                 thread_idx);
  }

  // acc -> g in place, and g's two sums into the column slots of register_stats_epilogue.cuh
  // (slot 2 group + v0: the column depends only on those accumulator modes). The epilogue runs on
  // the 8 consumer warps of the SM's one CTA, so its instruction count is its time
  // (bench/RESULTS.md): the mask comes as one vector a row where aligned, g is formed in FP16
  // (__hadd2 rounds as grad_sum's float add and round does: FP32's 24 bits make the double
  // rounding exact) and masked with a bit mask, and full tiles skip the bounds checks.
  template <class AccEngine, class AccLayout, class TiledMma, class ProblemShapeMNKL,
            class TileCoordMNKL>
  CUTLASS_DEVICE void form_gradient(cute::Tensor<AccEngine, AccLayout>& acc,
                                    TiledMma const& tiled_mma, ProblemShapeMNKL problem,
                                    TileCoordMNKL coord, int thread_idx, int64_t tile) {
    using namespace cute;
    using L = AccLayout;
    static_assert(
        rank(L{}) == 3 && rank<0>(L{}) == 3 && size<0, 0>(L{}) == 2 && size<0, 1>(L{}) == 2,
        "expects the SM90 GMMA F32 accumulator layout ((2,2,N/8),MMA_M,MMA_N)");
    static_assert(size<0, 2>(L{}) == Stats::kGroups && size<2>(L{}) == 1,
                  "one GMMA atom TileN wide");
    constexpr int kAtomsM = size<1>(L{});
    // The two consumer warpgroups' atoms cover 128 rows; the next atom along M the next 128, so
    // a piece of the staged rows is a run of atoms.
    static_assert(kAtomsM * 128 == TileM && kAtomsM % kParts == 0, "128 rows per atom along M");
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
    const bool full = rows_left == TileM && n0 + TileN <= cols;
    form_piece<0>(acc, coords, mask, bit0, cols, n0, rows_left, full, tile, thread_idx);
    if constexpr (kParts > 1)
      form_piece<1>(acc, coords, mask, bit0, cols, n0, rows_left, full, tile, thread_idx);
  }

  // Piece Part of the tile: its rows' mask bytes (in flight together while the staged rows
  // land; a second piece's loads start only after the first's are used, which keeps the 256-row
  // tile's registers within the consumers' budget), then its accumulators, then the next
  // piece's copies once every consumer thread has read these rows.
  template <int Part, class Acc, class Coords>
  CUTLASS_DEVICE void form_piece(Acc& acc, Coords const& coords, const uint8_t* mask, int bit0,
                                 int cols, int n0, int rows_left, bool full, int64_t tile,
                                 int thread_idx) {
    using namespace cute;
    constexpr int kGroups = Stats::kGroups;
    constexpr int kWords = (kGroups + 3) / 4;  // mask bytes of a row's groups, four a word
    constexpr int kPartAtoms = size<1>(typename Acc::layout_type{}) / kParts;
    // Group g's column pair (col0 + 8 g, + 1) has its two bits in byte g of the row's bytes from
    // n0, at bit col0 % 8 (row N + n0 is a multiple of 8).
    uint32_t words[kPartAtoms][2][kWords];
    CUTLASS_PRAGMA_UNROLL
    for (int pa = 0; pa < kPartAtoms; ++pa) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = get<0>(coords(make_coord(make_coord(0, r, 0), Part * kPartAtoms + pa, 0)));
        load_mask_words(mask + row * (cols / 8), row < rows_left, bn_.mask_rows_aligned, n0, cols,
                        words[pa][r]);
      }
    }
    staging_.wait(&smem_->staged);
    if (full) {
      form_pairs<false, Part>(acc, coords, words, bit0, cols, n0, rows_left);
    } else {
      form_pairs<true, Part>(acc, coords, words, bit0, cols, n0, rows_left);
    }
    cutlass::arch::NamedBarrier::sync(kThreads, kStageBarrier);
    if constexpr (Part + 1 < kParts) stage(tile, Part + 1, thread_idx);
  }

  // The accumulator atoms of one staged piece: rows [Part kPartRows, (Part + 1) kPartRows).
  template <bool Checked, int Part, class Acc, class Coords, int kPartAtoms, int kWords>
  CUTLASS_DEVICE void form_pairs(Acc& acc, Coords const& coords,
                                 uint32_t const (&words)[kPartAtoms][2][kWords], int bit0, int cols,
                                 int n0, int rows_left) {
    using namespace cute;
    constexpr int first_row = Part * kPartRows;
    const __half* z = smem_->z;
    const __half* dy2 = smem_->dy2;
    const bool has_dy2 = Dy2 && bn_.dy2 != nullptr;
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < Stats::kGroups; ++g) {
      const int col = get<1>(coords(make_coord(make_coord(0, 0, g), 0, 0)));  // even: col, col + 1
      const bool col_in = !Checked || n0 + col < cols;  // N % 8 == 0: both or neither
      const float mu0 = col_in ? __ldg(bn_.mean + n0 + col) : 0.0f;
      const float mu1 = col_in ? __ldg(bn_.mean + n0 + col + 1) : 0.0f;
      CUTLASS_PRAGMA_UNROLL
      for (int pa = 0; pa < kPartAtoms; ++pa) {
        const int am = Part * kPartAtoms + pa;
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          const auto i0 = make_coord(make_coord(0, r, g), am, 0);
          const auto i1 = make_coord(make_coord(1, r, g), am, 0);
          const int row = get<0>(coords(i0));
          float2 gv = make_float2(0.0f, 0.0f);
          if (!Checked || (col_in && row < rows_left)) {
            const int s = (row - first_row) * kPitch + col;
            const uint32_t two = words[pa][r][g / 4] >> (8 * (g % 4) + bit0);
            gv = masked_gradient(acc(i0), acc(i1), two,
                                 has_dy2 ? reinterpret_cast<const __half2*>(dy2 + s) : nullptr);
            const float2 zf = __half22float2(*reinterpret_cast<const __half2*>(z + s));
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
  TensorStorage* smem_;
  Staging staging_;  // piece t kParts + part of tile t
};

}  // namespace kiln::sm90
