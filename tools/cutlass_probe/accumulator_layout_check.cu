// kiln_cutlass_layout_check: register_stats_epilogue.cuh (and dgrad_bn_epilogue.cuh, whose
// mainloop reads B N-major) indexes its per-thread column sums by
// the GMMA accumulator's coordinates without looking them up; this checks, on the host (no GPU
// needed), that CUTLASS's TiledMma for each register variant's tile (the GEMMs' cooperative one,
// 256 threads; the convolutions' single warpgroup, conv_stats_sm90.cu, 128) puts thread t's
// accumulator ((v0, r, g), am, 0) in column 2 * (t % 4) + v0 + 8 * g (so the lanes sharing a
// column differ only in lane bits 2-4), that each warp covers every column, and that the threads
// hold each element of the tile once. Exits 1 on any mismatch.
// The order: the convolution's headers need cute and cutlass's core first.
// clang-format off
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include <cutlass/kernel_hardware_info.hpp>
#include <cutlass/conv/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
// clang-format on

#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace cute;

template <int TileM, int TileN, class TiledMma>
int mismatches(const std::string& name, int threads) {
  const auto tile = make_shape(Int<TileM>{}, Int<TileN>{});
  using Coords = decltype(TiledMma{}.get_thread_slice(0).partition_C(make_identity_tensor(tile)));
  using L = decltype(Coords{}.layout());
  static_assert(size<0, 0>(L{}) == 2 && size<0, 1>(L{}) == 2 && size<0, 2>(L{}) == TileN / 8 &&
                size<2>(L{}) == 1);
  constexpr int kThreads = size(TiledMma{}), kAtomsM = size<1>(L{});
  int bad = kThreads == threads ? 0 : 1;
  std::vector<int> held(TileM * TileN, 0);
  std::vector<std::vector<int>> warp_cols(kThreads / 32, std::vector<int>(TileN, 0));
  for (int t = 0; t < kThreads; ++t) {
    auto coords = TiledMma{}.get_thread_slice(t).partition_C(make_identity_tensor(tile));
    for (int g = 0; g < TileN / 8; ++g)
      for (int am = 0; am < kAtomsM; ++am)
        for (int r = 0; r < 2; ++r)
          for (int v0 = 0; v0 < 2; ++v0) {
            const auto mn = coords(make_coord(make_coord(v0, r, g), am, 0));
            const int m = get<0>(mn), n = get<1>(mn);
            bad += n != 2 * (t % 4) + v0 + 8 * g;
            ++held[m * TileN + n];
            warp_cols[t / 32][n] = 1;
          }
  }
  for (int h : held) bad += h != 1;
  for (const auto& cols : warp_cols)
    for (int c : cols) bad += c != 1;
  std::printf("%dx%d %s: %s\n", TileM, TileN, name.c_str(), bad ? "MISMATCH" : "ok");
  return bad;
}

// The GEMMs'. LayoutB: ColumnMajor is the forward's K-major filter, RowMajor the data gradient's
// N-major one (dgrad_bn_sm90.cu).
template <int TileM, int TileN, class LayoutB = cutlass::layout::ColumnMajor>
int gemm_mismatches() {
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::half_t,
      cutlass::layout::RowMajor, 8, cutlass::half_t, LayoutB, 8, float,
      Shape<Int<TileM>, Int<TileN>, _64>, Shape<_1, _1, _1>,
      cutlass::gemm::collective::StageCount<4>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  return mismatches<TileM, TileN, typename Mainloop::TiledMma>(
      std::is_same_v<LayoutB, cutlass::layout::RowMajor> ? "GEMM (B N-major)" : "GEMM", 256);
}

// The convolutions' (conv_stats_sm90.cu's mainloop).
template <int TileM, int TileN>
int conv_mismatches() {
  using Mainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::conv::Operator::kFprop,
      cutlass::half_t, cutlass::layout::TensorNHWC, 8, cutlass::half_t, cutlass::layout::TensorNHWC,
      8, float, Shape<Int<TileM>, Int<TileN>, Shape<_64>>, Shape<_1, _1, _1>,
      cutlass::conv::collective::StageCount<4>,
      cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;
  return mismatches<TileM, TileN, typename Mainloop::TiledMma>("convolution", 128);
}

}  // namespace

int main() {
  const int bad = gemm_mismatches<128, 64>() + gemm_mismatches<128, 128>() +
                  gemm_mismatches<256, 128>() +
                  gemm_mismatches<128, 64, cutlass::layout::RowMajor>() +
                  gemm_mismatches<256, 128, cutlass::layout::RowMajor>() +
                  conv_mismatches<128, 64>() + conv_mismatches<128, 128>();
  return bad ? 1 : 0;
}
