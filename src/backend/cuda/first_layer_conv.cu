// first_layer_conv.h's kernel. GEMM view: rows are output pixels, K is (tap, channel), N the 64
// output channels (eight 8-wide MMA column tiles). K is ordered so that a lane's A fragment for
// one 16-deep step is one tap's 4 channels, 8 bytes in one load: of step kk, lane tig takes tap
// 4 kk + tig, its channels 0-1 as k = 2 tig, 2 tig + 1 and 2-3 as k = 2 tig + 8, 2 tig + 9. The
// filter sits in shared memory in the same order; taps past the filter's are zero.
#include <cuda_fp16.h>

#include "backend/cuda/first_layer_conv.h"
#include "backend/cuda/first_layer_tiles.cuh"

namespace kiln::cuda {

namespace {

using namespace first_layer;  // NOLINT: the shared pieces (first_layer_tiles.cuh)

constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kWarpRows = 32;                  // output pixels a warp takes: two m16 tiles
constexpr int kTileRows = kWarps * kWarpRows;  // a CTA's tile
static_assert(kTileRows <= 256, "first_layer_shape_refusal leaves 256 pixels of index room");
constexpr int kZPitch = kK + 8;  // halves a staged z row takes (16 bytes of pad)
constexpr int kMaxK = 512;       // taps x 4, padded: 128 taps (11x11) at most
// The filter's row pitch in shared memory is K + 8 halves, so that ldmatrix's 8 rows of 16 bytes
// fall in distinct banks (as the staged z's do).
// The tap table has a step's 4 taps more than K holds: the prefetch past the last step reads them.
__host__ __device__ int tap_slots(int kp) {
  return kp / kC + 4;
}
size_t smem_bytes(int kp) {
  return (static_cast<size_t>(kK) * (kp + 8) + static_cast<size_t>(kTileRows) * kZPitch) *
             sizeof(__half) +
         static_cast<size_t>(tap_slots(kp)) * sizeof(int4) +
         static_cast<size_t>(kWarps) * 2 * kK * sizeof(float);
}

// The MMA computes z's transpose, W x^T: M is the 64 output channels (A, the filter, from shared
// memory), N the pixels (B, so that a lane's 8-byte load of one tap is its b0 and b1 as they
// stand in registers: mma.sync's A operand would need the two halves of a load apart).
__global__ void __launch_bounds__(kThreads, 2)
    first_layer_conv_kernel(const __half* __restrict__ x, const __half* __restrict__ w,
                            __half* __restrict__ z, float* __restrict__ sums,
                            float* __restrict__ partials, Geometry g) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int wpitch = g.kp + 8;
  __half* ws = reinterpret_cast<__half*>(smem);
  __half* zs = ws + kK * wpitch;
  auto* taps = reinterpret_cast<int4*>(zs + kTileRows * kZPitch);
  float* red = reinterpret_cast<float*>(taps + tap_slots(g.kp));  // [warp][Σz, Σz²][64]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;

  // The filter in K's order, and each tap's place in the window.
  const int kreal = g.taps * kC;
  for (int e = tid; e < kK * g.kp; e += kThreads) {
    const int n = e / g.kp, k = e - n * g.kp, pos = k % 16;
    const int tap = k / 16 * 4 + (pos % 8) / 2, ch = (pos / 8) * 2 + pos % 2;
    ws[n * wpitch + k] = tap < g.taps ? w[n * kreal + tap * kC + ch] : __float2half(0.0f);
  }
  for (int t = tid; t < tap_slots(g.kp); t += kThreads) taps[t] = tap_place(g, t);
  __syncthreads();

  const auto* x8 = reinterpret_cast<const uint2*>(x);
  // ldmatrix of the filter for output channels 16 mt + 0..15 and a 16-deep step: matrix i (lanes
  // 8i..8i+7) holds channels 8 (i % 2) + 0..7 at k offset 8 (i / 2), as a0..a3 take them.
  const __half* w_lane = ws + (((lane / 8) % 2) * 8 + lane % 8) * wpitch + (lane / 16) * 8;
  __half* z_warp = zs + warp * kWarpRows * kZPitch;
  // The staged z's 16 pixels x 16 channels as four 8x8 matrices, matrix i (lanes 8i..8i+7) being
  // pixels 8 (i / 2) + 0..7 at channel offset 8 (i % 2): stmatrix.trans writes C's (channel,
  // pixel) fragments there as rows of pixels, and ldmatrix.trans reads them back as the A
  // fragment of z's transpose for the sums.
  __half* z_lane = z_warp + ((lane / 16) * 8 + lane % 8) * kZPitch + ((lane / 8) % 2) * 8;
  // This warp's Σz and Σz², added a tile at a time: the lanes whose tig is gid / 2 (where the
  // Gram matrix's diagonal falls) own channels 16 c + gid and 16 c + 8 + gid (c = 0..3). In
  // shared memory rather than registers, which the accumulators fill.
  float* warp_sums = red + warp * 2 * kK;
  const bool owner = tig == gid / 2;
  if (owner)
    for (int c = 0; c < 8; ++c) warp_sums[8 * c + gid] = warp_sums[kK + 8 * c + gid] = 0.0f;
  constexpr uint32_t kOnes = 0x3C003C00u;  // half2(1, 1)

  const int tiles = (g.m + kTileRows - 1) / kTileRows, steps = g.kp / 16;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int base = tile * kTileRows + warp * kWarpRows;
    PixelPlace px[4];  // pixel tile j's column gid: pixel base + 8 j + gid
#pragma unroll
    for (int j = 0; j < 4; ++j) px[j] = place_pixel(g, base + 8 * j + gid);
    float acc[4][4][4];  // [channel tile mt][pixel tile j]
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.0f;

    uint2 bx[4];
    int4 tap = taps[tig];
#pragma unroll
    for (int j = 0; j < 4; ++j) bx[j] = load_tap(x8, g, px[j], tap);
    for (int kk = 0; kk < steps; ++kk) {
      // The next step's loads go out before this step's MMAs.
      uint2 next[4];
      tap = taps[(kk + 1) * 4 + tig];
#pragma unroll
      for (int j = 0; j < 4; ++j) next[j] = load_tap(x8, g, px[j], tap);
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        uint32_t a[4];
        ldmatrix_x4(a, w_lane + 16 * mt * wpitch + 16 * kk);
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_16816(acc[mt][j], a[0], a[1], a[2], a[3], bx[j].x, bx[j].y);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) bx[j] = next[j];
    }

    // z in FP16 into this warp's staging rows: C's (channel, pixel) fragments transposed.
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        const float(&c0)[4] = acc[mt][2 * jp];
        const float(&c1)[4] = acc[mt][2 * jp + 1];
        stmatrix_x4_trans(z_lane + 16 * jp * kZPitch + 16 * mt, half2_bits(c0[0], c0[1]),
                          half2_bits(c0[2], c0[3]), half2_bits(c1[0], c1[1]),
                          half2_bits(c1[2], c1[3]));
      }
    __syncwarp();
    // The sums of the FP16 z, as BatchNorm's own pass would read it (rows past m are zeros).
    if (sums != nullptr) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float gram_lo[4] = {}, gram_hi[4] = {}, ones[4] = {};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t t[4];
          ldmatrix_x4_trans(t, z_lane + 16 * half * kZPitch + 16 * c);
          mma_16816(gram_lo, t[0], t[1], t[2], t[3], t[0], t[2]);
          mma_16816(gram_hi, t[0], t[1], t[2], t[3], t[1], t[3]);
          mma_16816(ones, t[0], t[1], t[2], t[3], kOnes, kOnes);
        }
        if (owner) {
          warp_sums[16 * c + gid] += ones[0];
          warp_sums[16 * c + 8 + gid] += ones[2];
          warp_sums[kK + 16 * c + gid] += (gid & 1) ? gram_lo[1] : gram_lo[0];
          warp_sums[kK + 16 * c + 8 + gid] += (gid & 1) ? gram_hi[3] : gram_hi[2];
        }
      }
    }
    // The warp's 32 rows of 128 bytes out as 16-byte stores, whole lines a row: lane takes
    // 16 bytes lane % 8 of rows lane / 8 + 4 j.
    const __half* z_from = z_warp + (lane / 8) * kZPitch + (lane % 8) * 8;
    __half* z_to = z + static_cast<int64_t>(base + lane / 8) * kK + (lane % 8) * 8;
#pragma unroll
    for (int j = 0; j < kWarpRows / 4; ++j)
      if (base + lane / 8 + 4 * j < g.m)
        *reinterpret_cast<uint4*>(z_to + 4 * j * kK) =
            *reinterpret_cast<const uint4*>(z_from + 4 * j * kZPitch);
    __syncwarp();  // the staging rows are rewritten by the next tile
  }

  if (sums == nullptr) return;
  // The CTAs' sums added in a fixed order, so the same inputs give the same bits every run
  // (FP32 atomics would not): each CTA leaves its share in `partials`, and the last to finish
  // (a counter after them, zero between launches) adds them up, CTA by CTA.
  __syncthreads();
  auto* counter = reinterpret_cast<unsigned*>(partials + static_cast<size_t>(gridDim.x) * 2 * kK);
  if (tid < 2 * kK) {
    float total = 0.0f;
    for (int v = 0; v < kWarps; ++v) total += red[v * 2 * kK + tid];
    partials[static_cast<size_t>(blockIdx.x) * 2 * kK + tid] = total;
  }
  __threadfence();  // this CTA's share is visible before the counter says so
  __syncthreads();
  __shared__ bool last;
  if (tid == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // Two threads a value, each over half the CTAs (loads in flight, not one after another's
  // add), then the halves added: a fixed association.
  static_assert(kThreads == 4 * kK, "two threads a sum");
  const int value = tid % (2 * kK), half = tid / (2 * kK), ctas = static_cast<int>(gridDim.x);
  const int from = half * (ctas / 2), to = half ? ctas : ctas / 2;
  float part = 0.0f;
#pragma unroll 8
  for (int cta = from; cta < to; ++cta) part += __ldcg(partials + cta * 2 * kK + value);
  __syncthreads();  // red's last readers are done
  red[tid] = part;
  __syncthreads();
  if (half == 0) sums[value] = red[value] + red[2 * kK + value];
  if (tid == 0) *counter = 0;  // for the next launch
}

}  // namespace

std::string first_layer_shape_refusal(const FirstLayerShape& c, int max_k) {
  if (c.n <= 0 || c.h <= 0 || c.w_ <= 0 || c.r <= 0 || c.s <= 0 || c.stride_h <= 0 ||
      c.stride_w <= 0 || c.pad_h < 0 || c.pad_w < 0 || c.h + 2 * c.pad_h < c.r ||
      c.w_ + 2 * c.pad_w < c.s)
    return "has no output";
  if (padded_k(c) > max_k)
    return "takes filters of at most " + std::to_string(max_k / kC) + " taps";
  if (c.h + c.pad_h >= kOutside / 2 || c.w_ + c.pad_w >= kOutside / 2)
    return "takes images and padding of fewer than 2^27 pixels a side";
  // Pixels are 32-bit indices, a tile's end included (tiles are at most 256 pixels).
  const int64_t m = static_cast<int64_t>(c.n) * c.p() * c.q();
  if (m >= (int64_t{1} << 31) - 256 || static_cast<int64_t>(c.n) * c.h * c.w_ >= (int64_t{1} << 31))
    return "takes fewer than 2^31 pixels";
  return "";
}

std::string first_layer_conv_refusal(const FirstLayerConv& c) {
  if (!c.x || !c.w || !c.z) return "needs x, w and z";
  const auto misaligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  if (misaligned(c.x) || misaligned(c.w) || misaligned(c.z))
    return "needs x, w and z 16-byte aligned";
  return first_layer_shape_refusal(c, kMaxK);
}

cudaError_t prepare_first_layer_conv(const FirstLayerConv& c, int sm_count, unsigned* grid) {
  if (!first_layer_conv_refusal(c).empty()) return cudaErrorInvalidValue;
  const Geometry g = geometry(c);
  return prepare_persistent(first_layer_conv_kernel, kThreads, smem_bytes(g.kp),
                            (g.m + kTileRows - 1) / kTileRows, sm_count, grid);
}

size_t first_layer_conv_workspace(unsigned grid) {
  return (static_cast<size_t>(grid) * 2 * kK + 4) * sizeof(float);
}

cudaError_t launch_first_layer_conv(const FirstLayerConv& c, unsigned grid, cudaStream_t stream) {
  if (!first_layer_conv_refusal(c).empty() || grid == 0) return cudaErrorInvalidValue;
  if (c.sums && !c.partials) return cudaErrorInvalidValue;
  const Geometry g = geometry(c);
  first_layer_conv_kernel<<<grid, kThreads, smem_bytes(g.kp), stream>>>(c.x, c.w, c.z, c.sums,
                                                                        c.partials, g);
  return cudaGetLastError();
}

}  // namespace kiln::cuda
