// What the data gradient's two epilogues (dgrad_bn_epilogue.cuh: the cooperative kernel's;
// pingpong_dgrad_bn_epilogue.cuh: the ping-pong kernel's, a staging buffer per warpgroup) share:
// BatchNorm's inputs, a row's mask bits, and one accumulator pair made BatchNorm's masked
// gradient g exactly as kiln's BatchNorm backward forms it from the stored dX, dy2 and the mask
// (bn_kernels.cuh's grad_sum: the FP16 sum of the FP16 values).
#pragma once
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

namespace kiln::sm90 {

// BatchNorm's side of the epilogue.
struct DgradBnInputs {
  const __half* z = nullptr;      // [M][N] BatchNorm's input, saved by the forward
  const uint8_t* mask = nullptr;  // bit e % 8 of byte e / 8: element e = row N + col
  const __half* dy2 = nullptr;    // [M][N] or none: BN+add+ReLU's second gradient
  const float* mean = nullptr;    // [N] BatchNorm's saved batch mean
  int64_t rows = 0, cols = 0;     // M and N
  // Each tile row's TileN / 8 mask bytes sit at a TileN / 8 aligned address (N % TileN == 0
  // and an aligned mask): one vector load a row.
  bool mask_rows_aligned = false;
};

// A tile row's mask bytes from `bytes` (the row's byte of column n0), four to a word: column
// group g (8 columns from n0 + 8 g) is byte g; zeros for a row past M (in_rows false, nothing
// read). Words = TileN / 32.
template <int Words>
__device__ __forceinline__ void load_mask_words(const uint8_t* bytes, bool in_rows, bool aligned,
                                                int n0, int cols, uint32_t (&words)[Words]) {
  if (!in_rows) {
#pragma unroll
    for (int w = 0; w < Words; ++w) words[w] = 0;
    return;
  }
  if (aligned) {  // TileN / 8 bytes at a TileN / 8 aligned address
    if constexpr (Words == 4) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(bytes));
      words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
    } else if constexpr (Words == 2) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(bytes));
      words[0] = v.x, words[1] = v.y;
    } else {
      static_assert(Words == 4 || Words == 2, "TileN 64 or 128");
    }
    return;
  }
#pragma unroll
  for (int w = 0; w < Words; ++w) words[w] = 0;
#pragma unroll
  for (int g = 0; g < 4 * Words; ++g) {
    if (n0 + 8 * g < cols) words[g / 4] |= static_cast<uint32_t>(__ldg(bytes + g)) << (8 * (g % 4));
  }
}

// g for two adjacent columns: mask ? round16(round16(acc) [+ dy2]) : 0, with `two` holding the
// pair's mask bits at bits 0 and 1. dX is rounded as kiln's dgrad stores it and added to dy2 in
// FP16 (__hadd2 rounds as grad_sum's float add and round do: FP32's 24 bits make the double
// rounding exact); the mask applies as a bit mask.
__device__ __forceinline__ float2 masked_gradient(float a0, float a1, uint32_t two,
                                                  const __half2* dy2) {
  __half2 d = __float22half2_rn(make_float2(a0, a1));
  if (dy2 != nullptr) d = __hadd2(d, *dy2);
  const uint32_t keep = ((0u - (two & 1u)) & 0xffffu) | ((0u - (two >> 1 & 1u)) << 16);
  uint32_t bits;
  memcpy(&bits, &d, sizeof bits);
  bits &= keep;
  __half2 g;
  memcpy(&g, &bits, sizeof g);
  return __half22float2(g);
}

}  // namespace kiln::sm90
