// What the data-gradient units share (dgrad_bn_sm90.cu: 1x1 GEMMs; conv_dgrad_bn_sm90.cu:
// stride-1 convolutions): CUTLASS's store under the BatchNorm epilogue, what that epilogue needs
// of the inputs, and its BatchNorm and sums arguments. Included after cutlass_unit.cuh and
// CUTLASS's epilogue headers, by those units alone.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "backend/cuda/cutlass/dgrad_bn.h"

// KILN_DGRAD_DY2=0 (dgrad_bn.h's *_NODY2 lists): the unit takes no second gradient, and its
// epilogue stages none (dgrad_bn_epilogue.cuh's Dy2).
#ifndef KILN_DGRAD_DY2
#define KILN_DGRAD_DY2 1
#endif
#if KILN_DGRAD_DY2
#define KILN_DGRAD_NAME_TAIL ""
#else
#define KILN_DGRAD_NAME_TAIL " no dy2"
#endif
// KILN_DGRAD_PINGPONG=1 (conv_dgrad_bn_sm90.cu): CUTLASS's ping-pong kernel.
#if defined(KILN_DGRAD_PINGPONG) && KILN_DGRAD_PINGPONG
#define KILN_DGRAD_SCHEDULE_TAIL " ping-pong"
#else
#define KILN_DGRAD_SCHEDULE_TAIL ""
#endif

namespace kiln::sm90 {
namespace {

constexpr bool kDy2 = KILN_DGRAD_DY2 != 0;

// CUTLASS's cooperative TMA epilogue for a tile of shape Tile, storing the accumulators rounded
// to FP16: the BatchNorm epilogue (dgrad_bn_epilogue.cuh) has made them g, which FP16 holds
// exactly.
using StoreHalf = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, cutlass::half_t,
                                           float, cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90AccFetch>;
// (Schedule: the ping-pong kernel's is TmaWarpSpecialized, one warpgroup a tile.)
template <class Tile, class Schedule = cutlass::epilogue::TmaWarpSpecializedCooperative>
using StoreHalfEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor,
    8, cutlass::half_t, cutlass::layout::RowMajor, 8, Schedule, StoreHalf>::CollectiveOp;

// What the epilogue reads per element (half2 and byte loads at each accumulator pair) and the
// mask's byte per 8 channels need; CUTLASS's TMA checks the rest.
std::string check_inputs(const DgradBn& d) {
  if (!d.dy || !d.w || !d.z || !d.mask || !d.mean || !d.g || !d.sums)
    return "dy, w, z, mask, mean, g and sums are all needed (dy2 alone is optional)";
  if (!kDy2 && d.dy2) return "takes no second gradient (dy2): a unit with one does";
  if (d.n % 8 != 0 || d.k % 8 != 0)
    return "n (" + std::to_string(d.n) + ") and k (" + std::to_string(d.k) +
           ") must be multiples of 8";
  if (d.m <= 0 || d.m > INT32_MAX) return "m (" + std::to_string(d.m) + ") out of range";
  // The epilogue's offsets within a tile are 32-bit: TileM rows of n channels.
  if (d.n >= (int64_t{1} << 31) / kTileM) return "n (" + std::to_string(d.n) + ") too large";
  const auto misaligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  if (misaligned(d.dy) || misaligned(d.w) || misaligned(d.z) || misaligned(d.g) ||
      (d.dy2 && misaligned(d.dy2)))
    return "dy, w, z, dy2 and g must be 16-byte aligned";
  return "";
}

// The epilogue's sums (into sum and sumsq: the outputs, or per-CTA partial rows) and what it
// reads to form g.
template <class EpilogueArguments>
void set_bn_arguments(EpilogueArguments& epilogue, const DgradBn& d, float* sum, float* sumsq,
                      int partial_rows) {
  epilogue.stats = {sum, sumsq, partial_rows, static_cast<int>(d.n)};
  epilogue.bn = {static_cast<const __half*>(d.z), d.mask, static_cast<const __half*>(d.dy2), d.mean,
                 d.m, d.n,
                 // A tile row's kTileN / 8 mask bytes load as one vector where they are aligned.
                 d.n % kTileN == 0 && reinterpret_cast<uintptr_t>(d.mask) % (kTileN / 8) == 0};
}

}  // namespace
}  // namespace kiln::sm90
