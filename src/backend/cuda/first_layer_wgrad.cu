// first_layer_wgrad.h's kernels. GEMM view: dw (64 x K, K = taps x 4 padded to 16) = dzᵀ · X,
// summed over output pixels, X's row for a pixel being its window's taps, 4 channels each. A
// CTA's 8 warps split a tile's product three ways: output channels in two halves of 32, K's
// 16-wide column pairs in `groups` runs of at most Pairs, and the tile's four 16-pixel MMA steps
// among the 4 / groups warps left, whose sums are added once at the end. Each warp thus reads an
// A fragment (dz) once for up to Pairs column pairs, and each B fragment (x) is read by two warps
// rather than four: fewer shared-memory reads a tile, and the 3x3's three pairs evenly shared.
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
static_assert(kThreads == 4 * kPixels, "four threads stage each pixel of a tile");

// Shared memory, in order: the fold's coefficients [64], the tap table, dz's tile (two buffers;
// none when folding), x's patches (two buffers), then when folding g's and z's tiles (dz's pitch,
// so ldmatrix reads them without bank conflicts) and the mask's bytes (two buffers each). Every
// piece is 16-byte aligned.
struct Layout {
  int dz, xs, gs, zs, ms, bytes;  // byte offsets, then the total
};
__host__ __device__ inline Layout layout(int kp, bool fold) {
  Layout l;
  const int taps = kp / kC, xtile = kPixels * (kp + 8) * 2, dztile = kPixels * kDzPitch * 2;
  l.dz = kK * 16 + taps * 16;
  l.xs = l.dz + (fold ? 0 : 2) * dztile;
  l.gs = l.xs + 2 * xtile;
  l.zs = l.gs + (fold ? 2 * dztile : 0);
  l.ms = l.zs + (fold ? 2 * dztile : 0);
  l.bytes = l.ms + (fold ? 2 * kPixels * 8 : 0);
  return l;
}

// The fold, on a warp's A fragment of one 16-pixel step: a holds g (as ldmatrix.trans left it:
// register i is channel 16 mt + 8 (i % 2) + gid at pixels 8 (i / 2) + 2 tig + 0, 1 of the step),
// zf holds z the same way, and each becomes dz = k.y (g - k.z - (z - k.x) k.w), g zero where the
// mask's bit is clear and dz zero past the output: bwd_dx_group's arithmetic (bn_kernels.cuh), so
// the same FP16 bits as BatchNorm's dx pass, formed in registers where the MMA takes them.
__device__ __forceinline__ void fold_fragment(uint32_t (&a)[4], const uint32_t (&zf)[4],
                                              const float4* coef, const unsigned char* masks,
                                              bool has_mask, int step, int left, int mt, int gid,
                                              int tig) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 k = coef[16 * mt + 8 * (i % 2) + gid];
    const __half2 gh = *reinterpret_cast<const __half2*>(&a[i]);
    const __half2 zh = *reinterpret_cast<const __half2*>(&zf[i]);
    float out[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int p = 16 * step + 8 * (i / 2) + 2 * tig + j;  // the pixel within the tile
      const unsigned bits = has_mask ? masks[p * 8 + 2 * mt + i % 2] : 0xFFu;
      const float gj =
          (bits >> gid) & 1u ? __half2float(j ? __high2half(gh) : __low2half(gh)) : 0.0f;
      const float zj = __half2float(j ? __high2half(zh) : __low2half(zh));
      out[j] = p < left ? k.y * (gj - k.z - (zj - k.x) * k.w) : 0.0f;
    }
    a[i] = half2_bits(out[0], out[1]);
  }
}

// How a problem's K splits among the warps: column pairs in `groups` runs (1, 2 or 4), at most
// Pairs each, the MMA steps among the 4 / groups warps of a run and channel half.
struct WarpSplit {
  int groups, pairs_per_warp;
};
__host__ __device__ inline WarpSplit warp_split(int kp) {
  const int pairs = kp / 16, groups = pairs <= 4 ? 1 : pairs <= 8 ? 2 : 4;
  return {groups, (pairs + groups - 1) / groups};
}

// Pairs: the 16-wide column pairs of dw a warp takes at most (its accumulators' size), so that
// a small filter's kernel keeps few registers and more CTAs stay resident to hide latency.
// kMinCtas: the CTAs an SM the registers must leave room for: as many as the accumulators (and the
// fold's z fragments and coefficients) allow without spilling.
template <bool Fold, int Pairs>
constexpr int kMinCtas = Fold         ? (Pairs == 1 ? 3 : 2)
                         : Pairs > 3  ? 2
                         : Pairs == 3 ? 3
                                      : 4;

template <bool Fold, int Pairs>
__global__ void __launch_bounds__(kThreads, kMinCtas<Fold, Pairs>)
    first_layer_wgrad_kernel(const __half* __restrict__ x, const __half* __restrict__ dz,
                             float* __restrict__ partials, Geometry g, FirstLayerBnFold bn) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int xpitch = g.kp + 8, ntaps = g.kp / kC;
  const Layout l = layout(g.kp, Fold);
  auto* coef = reinterpret_cast<float4*>(smem);  // [channel]: Fold's coefficients
  auto* taps = reinterpret_cast<int4*>(smem + kK * 16);
  const auto dz_buf = [&](int b) {
    return reinterpret_cast<__half*>(smem + l.dz) + b * kPixels * kDzPitch;
  };
  const auto x_buf = [&](int b) {
    return reinterpret_cast<__half*>(smem + l.xs) + b * kPixels * xpitch;
  };
  const auto g_buf = [&](int b) {  // Fold's g and z tiles
    return reinterpret_cast<__half*>(smem + l.gs) + b * kPixels * kDzPitch;
  };
  const auto z_buf = [&](int b) {
    return reinterpret_cast<__half*>(smem + l.zs) + b * kPixels * kDzPitch;
  };
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;
  for (int t = tid; t < ntaps; t += kThreads) taps[t] = tap_place(g, t);
  if (Fold && tid < kK) coef[tid] = bn.coef[tid];
  __syncthreads();  // the tap table

  // Staging: thread tid takes pixel tid / 4 of a tile: every fourth of its taps from tid % 4, and
  // its 16-byte vectors 2 (tid % 4) and 2 (tid % 4) + 1 of dz (or of g and z), all by cp.async
  // (zeros outside x and past the output), so the next tile's loads fly during this one's MMAs.
  const int srow = tid / 4, sub = tid % 4;
  const auto* x8 = reinterpret_cast<const uint2*>(x);
  const auto stage = [&](int tile, int b) {
    const int pixel = tile * kPixels + srow;
    const bool in = pixel < g.m;
    const PixelPlace px = place_pixel(g, pixel);
    __half* xrow = x_buf(b) + srow * xpitch;
    for (int t = sub; t < ntaps; t += 4) {
      const int4 tap = taps[t];
      const int ih = px.ih0 + tap.x, iw = px.iw0 + tap.y;
      const bool inside = static_cast<unsigned>(ih) < static_cast<unsigned>(g.h) &&
                          static_cast<unsigned>(iw) < static_cast<unsigned>(g.w);
      cp_async_8(xrow + t * kC, inside ? x8 + static_cast<unsigned>(px.corner + tap.z) : x8,
                 inside);
    }
    const int64_t at = static_cast<int64_t>(in ? pixel : 0) * kK;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int v = 2 * sub + h;
      if constexpr (Fold) {
        cp_async_16(g_buf(b) + srow * kDzPitch + 8 * v, dz + at + 8 * v, in);
        cp_async_16(z_buf(b) + srow * kDzPitch + 8 * v, bn.z + at + 8 * v, in);
      } else {
        cp_async_16(dz_buf(b) + srow * kDzPitch + 8 * v, dz + at + 8 * v, in);
      }
    }
    if (Fold && bn.mask && sub == 0)
      cp_async_8(smem + l.ms + (b * kPixels + srow) * 8, bn.mask + at / 8, in);
    cp_async_commit();
  };

  // Warp w: channels 32 (w % 2) + 0..31 (two 16-row MMA tiles, mt0 and mt0 + 1), column pairs
  // [pair0, pair1) of run (w / 2) % groups, and MMA steps step0, step0 + steps, ... of 4.
  const int pairs = g.kp / 16, groups = warp_split(g.kp).groups, steps = 4 / groups;
  const int mt0 = 2 * (warp % 2), run = (warp / 2) % groups, step0 = warp / 2 / groups;
  const int pair0 = run * pairs / groups, pair1 = (run + 1) * pairs / groups;
  float acc[2][Pairs][2][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int i = 0; i < Pairs; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][i][h][e] = 0.0f;
  // ldmatrix.trans row offsets, matrix i being lanes 8i..8i+7. A = dzᵀ (channels x pixels):
  // matrix i is pixels 8 (i / 2) + 0..7 at channel 16 mt + 8 (i % 2). B = X (pixels x K): matrix
  // i is pixels 8 (i % 2) + 0..7 at column 8 (i / 2) of a 16-wide pair: b0, b1 of its two tiles.
  const int a_lane = ((lane / 16) * 8 + lane % 8) * kDzPitch + ((lane / 8) % 2) * 8 + 16 * mt0;
  const int b_lane = (((lane / 8) % 2) * 8 + lane % 8) * xpitch + (lane / 16) * 8;

  const int tiles = (g.m + kPixels - 1) / kPixels;
  if (static_cast<int>(blockIdx.x) < tiles) stage(blockIdx.x, 0);
  int b = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, b ^= 1) {
    if (tile + static_cast<int>(gridDim.x) < tiles) {
      stage(tile + gridDim.x, b ^ 1);  // its buffers were last read before the loop's end
    } else {
      cp_async_commit();  // an empty group: the wait below still means this tile's
    }
    cp_async_wait<1>();
    __syncthreads();  // every thread's copies of this tile
    const __half* a_tile = Fold ? g_buf(b) : dz_buf(b);
    const int left = g.m - tile * kPixels;  // the tile's pixels inside the output
    const __half* xt = x_buf(b);
    for (int ks = step0; ks < kPixels / 16; ks += steps) {
      uint32_t a[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        ldmatrix_x4_trans(a[m], a_tile + a_lane + 16 * m + 16 * ks * kDzPitch);
        if constexpr (Fold) {
          uint32_t zf[4];
          ldmatrix_x4_trans(zf, z_buf(b) + a_lane + 16 * m + 16 * ks * kDzPitch);
          fold_fragment(a[m], zf, coef, smem + l.ms + b * kPixels * 8, bn.mask != nullptr, ks, left,
                        mt0 + m, gid, tig);
        }
      }
#pragma unroll
      for (int i = 0; i < Pairs; ++i) {
        if (pair0 + i >= pair1) break;
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, xt + b_lane + 16 * ks * xpitch + 16 * (pair0 + i));
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          mma_16816(acc[m][i][0], a[m][0], a[m][1], a[m][2], a[m][3], bf[0], bf[1]);
          mma_16816(acc[m][i][1], a[m][0], a[m][1], a[m][2], a[m][3], bf[2], bf[3]);
        }
      }
    }
    __syncthreads();  // this tile's buffers are free for the stage two tiles on
  }

  // The MMA steps' warps' sums, added in step order through shared memory (x's buffers, free
  // now: 4 kp floats a row fit in their 2 (kp + 8) halves), then this CTA's share of dw,
  // [64][kp], for the fixed-order sum.
  cp_async_wait<0>();
  auto* scratch = reinterpret_cast<float*>(smem + l.xs);
  const auto each = [&](auto&& f) {  // f(accumulator pair, its offset in [64][kp])
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int i = 0; i < Pairs; ++i) {
        if (pair0 + i >= pair1) break;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = 16 * (mt0 + m) + gid, col = 16 * (pair0 + i) + 8 * h + 2 * tig;
          f(acc[m][i][h][0], acc[m][i][h][1], row * g.kp + col);
          f(acc[m][i][h][2], acc[m][i][h][3], (row + 8) * g.kp + col);
        }
      }
  };
  for (int round = 1; round < steps; ++round) {
    __syncthreads();  // the scratch's last reader
    if (step0 == round)
      each([&](float& e0, float& e1, int at) {
        *reinterpret_cast<float2*>(scratch + at) = make_float2(e0, e1);
      });
    __syncthreads();
    if (step0 == 0)
      each([&](float& e0, float& e1, int at) {
        const float2 v = *reinterpret_cast<const float2*>(scratch + at);
        e0 += v.x, e1 += v.y;
      });
  }
  float* out = partials + static_cast<size_t>(blockIdx.x) * kK * g.kp;
  if (step0 == 0)
    each([&](float& e0, float& e1, int at) {
      *reinterpret_cast<float2*>(out + at) = make_float2(e0, e1);
    });
}

using WgradKernel = void (*)(const __half*, const __half*, float*, Geometry, FirstLayerBnFold);

// The kernel for a problem: folding or not, and accumulators for the warp's share of K's pairs.
WgradKernel kernel_for(const Geometry& g, bool fold) {
  switch (warp_split(g.kp).pairs_per_warp) {
    case 1:
      return fold ? first_layer_wgrad_kernel<true, 1> : first_layer_wgrad_kernel<false, 1>;
    case 2:
      return fold ? first_layer_wgrad_kernel<true, 2> : first_layer_wgrad_kernel<false, 2>;
    case 3:
      return fold ? first_layer_wgrad_kernel<true, 3> : first_layer_wgrad_kernel<false, 3>;
    default:
      return fold ? first_layer_wgrad_kernel<true, 4> : first_layer_wgrad_kernel<false, 4>;
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
  if (c.bn.z && (!c.bn.coef || misaligned(c.bn.z, 16) || misaligned(c.bn.coef, 16) ||
                 misaligned(c.bn.mask, 8)))
    return "folds BatchNorm's backward with z 16-byte aligned, its coefficients and the mask "
           "8-byte";
  if (c.dw_channels < 1 || c.dw_channels > kC) return "takes dw of 1 to 4 channels";
  return first_layer_shape_refusal(c, kMaxK);
}

cudaError_t prepare_first_layer_wgrad(const FirstLayerWgrad& c, int sm_count, unsigned* grid) {
  if (!first_layer_wgrad_refusal(c).empty()) return cudaErrorInvalidValue;
  const Geometry g = geometry(c);
  const bool fold = c.bn.z != nullptr;
  return prepare_persistent(kernel_for(g, fold), kThreads, layout(g.kp, fold).bytes,
                            (g.m + kPixels - 1) / kPixels, sm_count, grid);
}

size_t first_layer_wgrad_workspace(const FirstLayerWgrad& c, unsigned grid) {
  return static_cast<size_t>(grid) * kK * padded_k(c) * sizeof(float);
}

cudaError_t launch_first_layer_wgrad(const FirstLayerWgrad& c, unsigned grid, cudaStream_t stream) {
  if (!first_layer_wgrad_refusal(c).empty() || grid == 0 || c.partials == nullptr)
    return cudaErrorInvalidValue;
  const Geometry g = geometry(c);
  const bool fold = c.bn.z != nullptr;
  kernel_for(g, fold)<<<grid, kThreads, layout(g.kp, fold).bytes, stream>>>(c.x, c.dz, c.partials,
                                                                            g, c.bn);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const int total = kK * g.taps * c.dw_channels;
  first_layer_wgrad_sum<<<(total + 255) / 256, 256, 0, stream>>>(
      c.partials, static_cast<int>(grid), g.kp, g.taps, c.dw_channels, c.dw, c.dw_f32);
  return cudaGetLastError();
}

}  // namespace kiln::cuda
