// What the data gradient's two epilogues (dgrad_bn_epilogue.cuh: the cooperative kernel's;
// pingpong_dgrad_bn_epilogue.cuh: the ping-pong kernel's, a staging buffer per warpgroup) share:
// BatchNorm's inputs, a row's mask bits, and one accumulator pair made BatchNorm's masked
// gradient g exactly as kiln's BatchNorm backward forms it from the stored dX, dy2 and the mask
// (bn_kernels.cuh's grad_sum: the FP16 sum of the FP16 values), and the staging of z (and dy2)
// rows in shared memory.
#pragma once
#include <cuda_fp16.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>
#include <cstring>
#include <cute/tensor.hpp>

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

// One piece of a tile's z (and dy2) rows staged in shared memory for the epilogue, copied while
// other work runs: each of Threads threads starts 16-byte asynchronous copies (cp.async) of one
// column chunk of every (Threads / chunks)-th row, and arrives on the piece's mbarrier (made for
// Threads arrivals) when they land. Rows past M and columns past N are zero-filled. Rows are
// padded by 16 bytes so the accumulator layout's reads (8 rows x 4 column pairs a warp) fall in
// 32 distinct banks.
template <int Threads, int Rows, int TileN>
class StagedRows {
  static constexpr int kChunks = TileN / 8;  // 16-byte copies a staged row takes
  static_assert(Threads % kChunks == 0, "each thread copies one column chunk of every row");

 public:
  static constexpr int kPitch = TileN + 8;       // halves a staged row takes (16 bytes of pad)
  static constexpr int kHalves = Rows * kPitch;  // a staging buffer's

  // Starts the copies of rows [m1, m1 + Rows) x columns [n1, n1 + TileN) of bn.z into z_s and,
  // WithDy2 and where bn.dy2 is set, of bn.dy2 into dy2_s; `piece` names them for staged().
  template <bool WithDy2>
  CUTLASS_DEVICE void start(int64_t piece, int64_t m1, int64_t n1, DgradBnInputs const& bn,
                            __half* z_s, __half* dy2_s, uint64_t* landed, int thread_idx) {
    constexpr int kRowStep = Threads / kChunks;
    const int chunk = thread_idx % kChunks, row0 = thread_idx / kChunks;
    const bool col_in = n1 + 8 * chunk < bn.cols;  // N % 8 == 0: whole chunks
    // Negative where the piece starts past M: every copy zero-fills.
    const int rows_in = static_cast<int>(cute::min(bn.rows - m1, static_cast<int64_t>(Rows)));
    const int64_t first = (m1 + row0) * bn.cols + n1 + 8 * chunk, step = kRowStep * bn.cols;
    const uint32_t dst = static_cast<uint32_t>((row0 * kPitch + 8 * chunk) * sizeof(__half));
    const uint32_t z_d = cute::cast_smem_ptr_to_uint(z_s) + dst;
    const uint32_t dy2_d = cute::cast_smem_ptr_to_uint(dy2_s) + dst;
    constexpr uint32_t kDstStep = kRowStep * kPitch * sizeof(__half);
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < Rows / kRowStep; ++k) {
      const bool in = col_in && row0 + k * kRowStep < rows_in;
      const int64_t e = in ? first + k * step : 0;
      copy16(z_d + k * kDstStep, bn.z + e, in);
      if (WithDy2 && bn.dy2) copy16(dy2_d + k * kDstStep, bn.dy2 + e, in);
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(
                     cute::cast_smem_ptr_to_uint(landed))
                 : "memory");
    staged_ = piece;
  }

  // Waits for the copies started last (the mbarrier's current phase).
  CUTLASS_DEVICE void wait(uint64_t* landed) {
    cutlass::arch::ClusterBarrier::wait(landed, phase_);
    phase_ ^= 1u;
    staged_ = -1;
  }

  // Waits for copies in flight, if any: a wrong guess's, or a last one before the CTA exits.
  CUTLASS_DEVICE void drain(uint64_t* landed) {
    if (staged_ >= 0) wait(landed);
  }

  // The piece whose copies are landing, -1 for none.
  CUTLASS_DEVICE int64_t staged() const { return staged_; }

 private:
  // 16 bytes global -> shared, or 16 zero bytes (src-size 0 reads nothing).
  static CUTLASS_DEVICE void copy16(uint32_t dst, const void* src, bool in) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(in ? 16 : 0)
                 : "memory");
  }

  int64_t staged_ = -1;
  uint32_t phase_ = 0;  // the mbarrier phase the next wait() waits for
};

// Tile t's mask rows (tiles numbered m nb + n) into L2: a hint, one prefetch a row.
template <int Threads, int TileM, int TileN>
__device__ __forceinline__ void prefetch_mask_l2(DgradBnInputs const& bn, int64_t t,
                                                 int thread_idx) {
  const int64_t nb = (bn.cols + TileN - 1) / TileN;
  const int64_t m1 = t / nb * TileM, n1 = t % nb * TileN;
  for (int row = thread_idx; row < TileM; row += Threads) {
    if (m1 + row >= bn.rows) break;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(bn.mask + ((m1 + row) * bn.cols + n1) / 8)
                 : "memory");
  }
}

}  // namespace kiln::sm90
