// first_layer_wgrad.h's kernels. GEMM view: dw (64 x K, K = taps x 4 padded to 16) = dzᵀ · X,
// summed over output pixels, X's row for a pixel being its window's taps, 4 channels each. A
// CTA's 8 warps split dw: warp w takes output channels 16 (w % 4) + 0..15 and half of K's
// 16-wide column pairs.
#include <cuda_fp16.h>

#include "backend/cuda/first_layer_tiles.cuh"
#include "backend/cuda/first_layer_wgrad.h"

namespace kiln::cuda {

namespace {

using namespace first_layer;  // NOLINT: the shared pieces (first_layer_tiles.cuh)

constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kPixels = 64;       // a tile: four 16-deep MMA steps
constexpr int kDzPitch = kK + 8;  // halves a staged dz row takes (16 bytes of pad)
constexpr int kMaxK = 256;        // 64 taps (8x8) at most: a warp's share of dw in 64 registers
constexpr int kMaxPairs = kMaxK / 16 / 2;  // column pairs a warp takes at most

size_t smem_bytes(int kp) {
  return kK * sizeof(float4) +
         (static_cast<size_t>(kPixels) * kDzPitch + static_cast<size_t>(kPixels) * (kp + 8)) *
             sizeof(__half) +
         static_cast<size_t>(kp / kC) * sizeof(int4) + kPixels * sizeof(PixelPlace);
}

// 8 channels of a staged dz row (16 bytes at channel 8 v of pixel `row`, zeros past the output):
// dz itself, or (Fold) formed from g, z, the mask and the coefficients as bwd_dx_group forms it.
template <bool Fold>
__device__ __forceinline__ uint4 dz_vector(const __half* __restrict__ dz, int64_t row, int v,
                                           const FirstLayerBnFold& bn, const float4* coef) {
  const int64_t at = row * kK + 8 * v;
  const uint4 g = __ldg(reinterpret_cast<const uint4*>(dz + at));
  if constexpr (!Fold) {
    return g;
  } else {
    const uint4 zv = __ldg(reinterpret_cast<const uint4*>(bn.z + at));
    const unsigned bits = bn.mask ? bn.mask[row * (kK / 8) + v] : 0xFFu;
    const auto* gh = reinterpret_cast<const __half*>(&g);
    const auto* zh = reinterpret_cast<const __half*>(&zv);
    uint4 out;
    auto* oh = reinterpret_cast<__half*>(&out);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float4 k = coef[8 * v + j];
      const float gj = (bits >> j) & 1u ? __half2float(gh[j]) : 0.0f;
      oh[j] = __float2half_rn(k.y * (gj - k.z - (__half2float(zh[j]) - k.x) * k.w));
    }
    return out;
  }
}

template <bool Fold>
__global__ void __launch_bounds__(kThreads, 2)
    first_layer_wgrad_kernel(const __half* __restrict__ x, const __half* __restrict__ dz,
                             float* __restrict__ partials, Geometry g, FastDivide by_taps,
                             FirstLayerBnFold bn) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int xpitch = g.kp + 8, ntaps = g.kp / kC;
  auto* coef = reinterpret_cast<float4*>(smem);        // [channel]: Fold's coefficients
  __half* dzs = reinterpret_cast<__half*>(coef + kK);  // [pixel][channel]
  __half* xs = dzs + kPixels * kDzPitch;               // [pixel][tap x 4 + channel]
  auto* taps = reinterpret_cast<int4*>(xs + kPixels * xpitch);
  auto* places = reinterpret_cast<PixelPlace*>(taps + ntaps);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;
  for (int t = tid; t < ntaps; t += kThreads) taps[t] = tap_place(g, t);
  if (Fold && tid < kK) coef[tid] = bn.coef[tid];

  const int mt = warp % 4, pairs = g.kp / 16;
  const int pair0 = warp < 4 ? 0 : (pairs + 1) / 2, pair1 = warp < 4 ? (pairs + 1) / 2 : pairs;
  float acc[kMaxPairs][2][4];
#pragma unroll
  for (int i = 0; i < kMaxPairs; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][h][e] = 0.0f;
  // ldmatrix.trans row addresses, matrix i being lanes 8i..8i+7. A = dzᵀ (channels x pixels):
  // matrix i is pixels 8 (i / 2) + 0..7 at channel 16 mt + 8 (i % 2). B = X (pixels x K): matrix
  // i is pixels 8 (i % 2) + 0..7 at column 8 (i / 2) of a 16-wide pair: b0, b1 of its two tiles.
  const __half* a_lane =
      dzs + ((lane / 16) * 8 + lane % 8) * kDzPitch + ((lane / 8) % 2) * 8 + 16 * mt;
  const __half* b_lane = xs + (((lane / 8) % 2) * 8 + lane % 8) * xpitch + (lane / 16) * 8;
  const auto* x8 = reinterpret_cast<const uint2*>(x);

  const int tiles = (g.m + kPixels - 1) / kPixels;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int base = tile * kPixels;
    __syncthreads();  // the last tile's reads are done (and the tap table is written)
    if (tid < kPixels) places[tid] = place_pixel(g, base + tid);
    // dz's 64 rows of 128 bytes, zeros past the output (whose dz is 0: they add nothing).
    for (int e = tid; e < kPixels * 8; e += kThreads) {
      const int row = e / 8, v = e % 8;
      const uint4 val = base + row < g.m ? dz_vector<Fold>(dz, base + row, v, bn, coef)
                                         : make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(dzs + row * kDzPitch + v * 8) = val;
    }
    __syncthreads();  // the pixels' places
    for (int e = tid; e < kPixels * ntaps; e += kThreads) {
      const int row = by_taps.quotient(e), t = e - row * ntaps;
      *reinterpret_cast<uint2*>(xs + row * xpitch + t * kC) = load_tap(x8, g, places[row], taps[t]);
    }
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < kPixels / 16; ++ks) {
      uint32_t a[4];
      ldmatrix_x4_trans(a, a_lane + 16 * ks * kDzPitch);
#pragma unroll
      for (int i = 0; i < kMaxPairs; ++i) {
        if (pair0 + i >= pair1) break;
        uint32_t b[4];
        ldmatrix_x4_trans(b, b_lane + 16 * ks * xpitch + 16 * (pair0 + i));
        mma_16816(acc[i][0], a[0], a[1], a[2], a[3], b[0], b[1]);
        mma_16816(acc[i][1], a[0], a[1], a[2], a[3], b[2], b[3]);
      }
    }
  }

  // This CTA's share of dw, [64][kp], for the fixed-order sum.
  float* out = partials + static_cast<size_t>(blockIdx.x) * kK * g.kp;
  const int row = 16 * mt + gid;
#pragma unroll
  for (int i = 0; i < kMaxPairs; ++i) {
    if (pair0 + i >= pair1) break;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = 16 * (pair0 + i) + 8 * h + 2 * tig;
      *reinterpret_cast<float2*>(out + row * g.kp + col) = make_float2(acc[i][h][0], acc[i][h][1]);
      *reinterpret_cast<float2*>(out + (row + 8) * g.kp + col) =
          make_float2(acc[i][h][2], acc[i][h][3]);
    }
  }
}

// dw[k][tap][c] = the CTAs' shares summed in CTA order (the same bits every run), c < channels.
__global__ void first_layer_wgrad_sum(const float* __restrict__ partials, int ctas, int kp,
                                      int taps, int channels, void* dw, bool f32) {
  const int total = kK * taps * channels;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int k = i / (taps * channels), rem = i - k * taps * channels;
    const int t = rem / channels, c = rem - t * channels;
    const float* p = partials + k * kp + t * kC + c;
    float s = 0.0f;
    for (int cta = 0; cta < ctas; ++cta) s += p[static_cast<size_t>(cta) * kK * kp];
    if (f32) {
      static_cast<float*>(dw)[i] = s;
    } else {
      static_cast<__half*>(dw)[i] = __float2half_rn(s);
    }
  }
}

}  // namespace

std::string first_layer_wgrad_refusal(const FirstLayerWgrad& c) {
  if (!c.x || !c.dz || !c.dw) return "needs x, dz and dw";
  const auto misaligned = [](const void* p, uintptr_t a) {
    return reinterpret_cast<uintptr_t>(p) % a != 0;
  };
  if (misaligned(c.x, 16) || misaligned(c.dz, 16) || misaligned(c.dw, 4))
    return "needs x and dz 16-byte aligned, dw 4-byte";
  if (c.bn.z && (!c.bn.coef || misaligned(c.bn.z, 16) || misaligned(c.bn.coef, 16)))
    return "folds BatchNorm's backward with z 16-byte aligned and its coefficients";
  if (c.dw_channels < 1 || c.dw_channels > kC) return "takes dw of 1 to 4 channels";
  return first_layer_shape_refusal(c, kMaxK);
}

cudaError_t prepare_first_layer_wgrad(const FirstLayerWgrad& c, int sm_count, unsigned* grid) {
  if (!first_layer_wgrad_refusal(c).empty()) return cudaErrorInvalidValue;
  const Geometry g = geometry(c);
  return prepare_persistent(
      c.bn.z ? first_layer_wgrad_kernel<true> : first_layer_wgrad_kernel<false>, kThreads,
      smem_bytes(g.kp), (g.m + kPixels - 1) / kPixels, sm_count, grid);
}

size_t first_layer_wgrad_workspace(const FirstLayerWgrad& c, unsigned grid) {
  return static_cast<size_t>(grid) * kK * padded_k(c) * sizeof(float);
}

cudaError_t launch_first_layer_wgrad(const FirstLayerWgrad& c, unsigned grid, cudaStream_t stream) {
  if (!first_layer_wgrad_refusal(c).empty() || grid == 0 || c.partials == nullptr)
    return cudaErrorInvalidValue;
  const Geometry g = geometry(c);
  const auto kernel = c.bn.z ? first_layer_wgrad_kernel<true> : first_layer_wgrad_kernel<false>;
  kernel<<<grid, kThreads, smem_bytes(g.kp), stream>>>(c.x, c.dz, c.partials, g,
                                                       FastDivide(g.kp / kC), c.bn);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const int total = kK * g.taps * c.dw_channels;
  first_layer_wgrad_sum<<<(total + 255) / 256, 256, 0, stream>>>(
      c.partials, static_cast<int>(grid), g.kp, g.taps, c.dw_channels, c.dw, c.dw_f32);
  return cudaGetLastError();
}

}  // namespace kiln::cuda
