// first_layer_conv.h's kernel. GEMM view: rows are output pixels, K is (tap, channel) with the
// 4 channels of a tap adjacent (x's NHWC order), padded to a multiple of 16 with zero taps; N is
// the 64 output channels, eight 8-wide MMA column tiles.
#include <cuda_fp16.h>

#include <algorithm>

#include "backend/cuda/first_layer_conv.h"

namespace kiln::cuda {

namespace {

constexpr int kC = kFirstLayerChannels, kK = kFirstLayerOutputs;
constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kWarpRows = 32;                  // output pixels a warp takes: two m16 tiles
constexpr int kTileRows = kWarps * kWarpRows;  // a CTA's tile
constexpr int kZPitch = kK + 8;                // halves a staged z row takes (16 bytes of pad)
constexpr int kMaxK = 512;                     // taps x 4, padded: a 16x16 filter at most

// K padded to whole 16-deep MMA steps, and the filter's row pitch in shared memory: 8 halves
// more, so that a fragment load's 8 rows x 4 words fall in 32 distinct banks.
int padded_k(const FirstLayerConv& c) {
  return (c.r * c.s * kC + 15) / 16 * 16;
}
size_t smem_bytes(int kp) {
  return (static_cast<size_t>(kK) * (kp + 8) + static_cast<size_t>(kTileRows) * kZPitch) *
             sizeof(__half) +
         2 * kK * sizeof(float);
}

__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct Geometry {
  int h, w, p, q, r, s, sh, sw, ph, pw, taps, kp;
  int64_t m;  // output pixels
};

// Fragment rows of one lane in a warp's 32 pixels: i = 2 mt + half, the pixel
// 16 mt + (lane / 4) + 8 half, as mma.sync's A and C layouts place them.
struct RowPlace {
  int64_t pixel0;  // first input pixel of its image, -1 where the row is past m
  int ih0, iw0;    // its window's top-left in x (may be negative: padding)
};

__device__ __forceinline__ RowPlace place_row(const Geometry& g, int64_t row) {
  RowPlace rp{-1, 0, 0};
  if (row >= g.m) return rp;
  const int64_t pq = static_cast<int64_t>(g.p) * g.q;
  const int64_t b = row / pq;
  const int rem = static_cast<int>(row - b * pq);
  const int op = rem / g.q, oq = rem - op * g.q;
  rp.pixel0 = b * g.h * g.w;
  rp.ih0 = op * g.sh - g.ph;
  rp.iw0 = oq * g.sw - g.pw;
  return rp;
}

// Two channels (c, c + 1) of one tap of a row's window: a 32-bit A register, zero outside x.
__device__ __forceinline__ uint32_t load_tap(const uint32_t* x, const Geometry& g,
                                             const RowPlace& rp, int dy, int dx, bool tap_in,
                                             int c) {
  const int ih = rp.ih0 + dy, iw = rp.iw0 + dx;
  if (!tap_in || rp.pixel0 < 0 || ih < 0 || ih >= g.h || iw < 0 || iw >= g.w) return 0u;
  return __ldg(x + ((rp.pixel0 + static_cast<int64_t>(ih) * g.w + iw) * kC + c) / 2);
}

__global__ void __launch_bounds__(kThreads, 2)
    first_layer_conv_kernel(const __half* __restrict__ x, const __half* __restrict__ w,
                            __half* __restrict__ z, float* __restrict__ sums, Geometry g) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int wpitch = g.kp + 8;
  __half* ws = reinterpret_cast<__half*>(smem);
  __half* zs = ws + kK * wpitch;
  float* red = reinterpret_cast<float*>(zs + kTileRows * kZPitch);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;

  // The filter, [64][taps x 4] zero-padded to kp, once a CTA.
  const int kreal = g.taps * kC;
  for (int e = tid; e < kK * g.kp; e += kThreads) {
    const int n = e / g.kp, k = e - n * g.kp;
    ws[n * wpitch + k] = k < kreal ? w[n * kreal + k] : __float2half(0.0f);
  }
  for (int e = tid; e < 2 * kK; e += kThreads) red[e] = 0.0f;
  __syncthreads();

  const auto* x32 = reinterpret_cast<const uint32_t*>(x);
  const auto* ws32 = reinterpret_cast<const uint32_t*>(ws);
  const int c = (tig & 1) * 2;  // this lane's channel pair within a tap
  // The sums of columns 2 lane and 2 lane + 1 over the CTA's rows, read back from the staged z
  // (four registers across the tiles rather than mma.sync's 32 a lane).
  float s0 = 0.0f, s1 = 0.0f, q0 = 0.0f, q1 = 0.0f;

  const int64_t tiles = (g.m + kTileRows - 1) / kTileRows;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t base = tile * kTileRows + warp * kWarpRows;
    RowPlace rows[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) rows[i] = place_row(g, base + 16 * (i / 2) + gid + 8 * (i % 2));
    float acc[2][8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;

    for (int kk = 0; kk < g.kp / 16; ++kk) {
      // This lane's k (2 tig, and 2 tig + 8) are channels c, c + 1 of taps t0 and t0 + 2.
      const int t0 = kk * 4 + tig / 2, t1 = t0 + 2;
      const int dy0 = t0 / g.s, dx0 = t0 - dy0 * g.s, dy1 = t1 / g.s, dx1 = t1 - dy1 * g.s;
      const bool in0 = t0 < g.taps, in1 = t1 < g.taps;
      uint32_t a[4][2];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i][0] = load_tap(x32, g, rows[i], dy0, dx0, in0, c);
        a[i][1] = load_tap(x32, g, rows[i], dy1, dx1, in1, c);
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int wb = ((nt * 8 + gid) * wpitch + kk * 16 + 2 * tig) / 2;
        const uint32_t b0 = ws32[wb], b1 = ws32[wb + 4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
          mma_16816(acc[mt][nt], a[2 * mt][0], a[2 * mt + 1][0], a[2 * mt][1], a[2 * mt + 1][1], b0,
                    b1);
      }
    }

    // z in FP16 into this warp's staging rows.
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int zr = warp * kWarpRows + 16 * mt + gid;
        *reinterpret_cast<__half2*>(zs + zr * kZPitch + nt * 8 + 2 * tig) =
            __floats2half2_rn(acc[mt][nt][0], acc[mt][nt][1]);
        *reinterpret_cast<__half2*>(zs + (zr + 8) * kZPitch + nt * 8 + 2 * tig) =
            __floats2half2_rn(acc[mt][nt][2], acc[mt][nt][3]);
      }
    }
    __syncwarp();
    // The sums of the FP16 z (as BatchNorm's own pass would read them), rows past m left out.
    if (sums != nullptr) {
      const int valid = static_cast<int>(min(static_cast<int64_t>(kWarpRows), g.m - base));
      for (int row = 0; row < valid; ++row) {
        const float2 v = __half22float2(
            *reinterpret_cast<const __half2*>(zs + (warp * kWarpRows + row) * kZPitch + 2 * lane));
        s0 += v.x, s1 += v.y;
        q0 = fmaf(v.x, v.x, q0), q1 = fmaf(v.y, v.y, q1);
      }
    }
    // The warp's 32 rows of 128 bytes out as 16-byte stores, whole lines a row.
#pragma unroll
    for (int j = 0; j < kWarpRows * kK / 8 / 32; ++j) {
      const int idx = lane + 32 * j, row = idx / 8, v = idx % 8;
      if (base + row < g.m)
        *reinterpret_cast<uint4*>(z + (base + row) * kK + v * 8) =
            *reinterpret_cast<const uint4*>(zs + (warp * kWarpRows + row) * kZPitch + v * 8);
    }
    __syncwarp();  // the staging rows are rewritten by the next tile
  }

  if (sums == nullptr) return;
  atomicAdd(red + 2 * lane, s0);
  atomicAdd(red + 2 * lane + 1, s1);
  atomicAdd(red + kK + 2 * lane, q0);
  atomicAdd(red + kK + 2 * lane + 1, q1);
  __syncthreads();
  if (tid < 2 * kK) atomicAdd(sums + tid, red[tid]);
}

}  // namespace

std::string first_layer_conv_refusal(const FirstLayerConv& c) {
  if (!c.x || !c.w || !c.z) return "needs x, w and z";
  const auto misaligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  if (misaligned(c.x) || misaligned(c.w) || misaligned(c.z))
    return "needs x, w and z 16-byte aligned";
  if (c.n <= 0 || c.h <= 0 || c.w_ <= 0 || c.r <= 0 || c.s <= 0 || c.stride_h <= 0 ||
      c.stride_w <= 0 || c.pad_h < 0 || c.pad_w < 0 || c.h + 2 * c.pad_h < c.r ||
      c.w_ + 2 * c.pad_w < c.s)
    return "has no output";
  if (padded_k(c) > kMaxK)
    return "takes filters of at most " + std::to_string(kMaxK / kC) + " taps";
  const int64_t m = static_cast<int64_t>(c.n) * c.p() * c.q();
  if (m >= (int64_t{1} << 31) || static_cast<int64_t>(c.n) * c.h * c.w_ >= (int64_t{1} << 31))
    return "takes fewer than 2^31 pixels";
  return "";
}

namespace {
Geometry geometry(const FirstLayerConv& c) {
  Geometry g;
  g.h = c.h, g.w = c.w_, g.p = c.p(), g.q = c.q(), g.r = c.r, g.s = c.s;
  g.sh = c.stride_h, g.sw = c.stride_w, g.ph = c.pad_h, g.pw = c.pad_w;
  g.taps = c.r * c.s, g.kp = padded_k(c);
  g.m = static_cast<int64_t>(c.n) * c.p() * c.q();
  return g;
}
}  // namespace

cudaError_t prepare_first_layer_conv(const FirstLayerConv& c, int sm_count, unsigned* grid) {
  if (!first_layer_conv_refusal(c).empty()) return cudaErrorInvalidValue;
  const Geometry g = geometry(c);
  const size_t bytes = smem_bytes(g.kp);
  if (cudaError_t e =
          cudaFuncSetAttribute(first_layer_conv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes));
      e != cudaSuccess)
    return e;
  int per_sm = 0;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &per_sm, first_layer_conv_kernel, kThreads, bytes);
      e != cudaSuccess)
    return e;
  const int64_t tiles = (g.m + kTileRows - 1) / kTileRows;
  *grid = static_cast<unsigned>(
      std::min<int64_t>(tiles, static_cast<int64_t>(sm_count) * std::max(per_sm, 1)));
  return cudaSuccess;
}

cudaError_t launch_first_layer_conv(const FirstLayerConv& c, unsigned grid, cudaStream_t stream) {
  if (!first_layer_conv_refusal(c).empty() || grid == 0) return cudaErrorInvalidValue;
  const Geometry g = geometry(c);
  if (c.sums) {
    if (cudaError_t e = cudaMemsetAsync(c.sums, 0, 2 * kK * sizeof(float), stream);
        e != cudaSuccess)
      return e;
  }
  first_layer_conv_kernel<<<grid, kThreads, smem_bytes(g.kp), stream>>>(c.x, c.w, c.z, c.sums, g);
  return cudaGetLastError();
}

}  // namespace kiln::cuda
