// fold_dgrad.h's kernel. A CTA of 8 warps owns one 64-column tile of dX (fixed for its life, so
// its sums gather in shared memory until the end) and walks 128-row tiles of it; each tile's
// product dX = dz W runs over k in chunks (32 deep, three in flight, or 64 deep, two; cp.async):
// per chunk, g and z land in shared memory, every thread folds its 16-byte vectors into dz in
// place (and writes them out once, from the CTAs of the first column tile), then each warp
// multiplies its 32 x 32 share.
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "backend/cuda/fold_dgrad.h"
#include "backend/cuda/mma_ptx.cuh"
#include "backend/cuda/persistent_grid.h"

namespace kiln::cuda {

namespace {

using namespace mma_ptx;  // NOLINT: the PTX helpers, named unqualified

constexpr int kThreads = 256, kTileM = 128, kTileN = 64;
constexpr int kWPitch = kTileN + 8;  // halves a staged W / z' row takes (16 bytes of pad: no
constexpr int kZPitch = kTileN + 8;  // bank conflicts for ldmatrix's eight 16-byte rows)

// A variant: Chunk-deep slices of k (32: 64-byte pieces of g's and z's rows; 64: whole 128-byte
// lines), Stages of them in flight. Shared memory, in bytes: per stage g (folded into dz in
// place), z, W's chunk and the chunk's coefficients; then the tile's z' and mask bytes for the
// epilogue, and the CTA's sums. Both variants fit two CTAs an SM.
template <int Chunk, int Stages>
struct Shape {
  static constexpr int kAPitch = Chunk + 8;  // halves a staged g / z row takes
  static constexpr int kABytes = kTileM * kAPitch * 2, kWBytes = Chunk * kWPitch * 2;
  static constexpr int kStageBytes = 2 * kABytes + kWBytes + Chunk * 16;
  static constexpr int kZpOffset = Stages * kStageBytes;
  static constexpr int kMaskOffset = kZpOffset + kTileM * kZPitch * 2;
  static constexpr int kSumsOffset = kMaskOffset + kTileM * kTileN / 8;
  static constexpr int kSmemBytes = kSumsOffset + 2 * kTileN * 4;
  static_assert(kStageBytes % 16 == 0 && kZpOffset % 16 == 0 && kMaskOffset % 16 == 0, "align");
  static_assert(2 * (kSmemBytes + 1024) <= 228 * 1024, "two CTAs an SM");
};

// Element indices fit 32 bits (fold_dgrad_refusal): the kernel's address arithmetic is 32-bit.
struct Params {
  FoldDgrad c;
  int m, k, n, row_tiles, col_tiles, chunks;
};

template <int Chunk, int Stages>
__global__ void __launch_bounds__(kThreads, 2) fold_dgrad_kernel(Params p) {
  using L = Shape<Chunk, Stages>;
  constexpr int kChunk = Chunk, kStages = Stages, kAPitch = L::kAPitch, kABytes = L::kABytes;
  constexpr int kWBytes = L::kWBytes, kStageBytes = L::kStageBytes;
  constexpr int kAVecs = kTileM * Chunk / 8 / kThreads;  // g's (and z's) 16-byte vectors a thread
  constexpr int kWVecs = Chunk * kTileN / 8 / kThreads;  // W's
  extern __shared__ __align__(16) unsigned char smem[];
  const FoldDgrad& c = p.c;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane / 4, tig = lane % 4;
  const int col_tile = static_cast<int>(blockIdx.x) % p.col_tiles;
  const int first_row_tile = static_cast<int>(blockIdx.x) / p.col_tiles;
  const int row_tile_step = static_cast<int>(gridDim.x) / p.col_tiles;
  if (first_row_tile >= p.row_tiles) return;
  const int my_tiles = (p.row_tiles - first_row_tile + row_tile_step - 1) / row_tile_step;
  const int n0 = col_tile * kTileN;
  const bool writes_dz = c.dz != nullptr && col_tile == 0;

  const auto a_buf = [&](int s) { return reinterpret_cast<__half*>(smem + s * kStageBytes); };
  const auto z_buf = [&](int s) {
    return reinterpret_cast<__half*>(smem + s * kStageBytes + kABytes);
  };
  const auto w_buf = [&](int s) {
    return reinterpret_cast<__half*>(smem + s * kStageBytes + 2 * kABytes);
  };
  const auto coef_buf = [&](int s) {
    return reinterpret_cast<float4*>(smem + s * kStageBytes + 2 * kABytes + kWBytes);
  };
  auto* zp_tile = reinterpret_cast<__half*>(smem + L::kZpOffset);
  auto* mask_tile = smem + L::kMaskOffset;
  auto* sums_tile = reinterpret_cast<float*>(smem + L::kSumsOffset);  // [2][kTileN]: Σ g', Σ g' z'

  // Iteration it is chunk it % chunks of this CTA's row tile it / chunks.
  const auto tile_row0 = [&](int t) { return (first_row_tile + t * row_tile_step) * kTileM; };
  const int total = my_tiles * p.chunks;
  // Staging of iteration it into stage it % kStages: thread tid takes g's and z's 16-byte
  // vectors tid + 256 j (row v / (Chunk / 8), columns 8 (v % (Chunk / 8))...), W's likewise
  // (row v / 8) and, for tid < Chunk, one coefficient. Rows past m read nothing and land as
  // zeros.
  const auto stage = [&](int it) {
    if (it < total) {
      const int s = it % kStages, k0 = (it % p.chunks) * kChunk;
      const int r0 = tile_row0(it / p.chunks);
#pragma unroll
      for (int j = 0; j < kAVecs; ++j) {
        const int v = tid + j * kThreads, row = v / (Chunk / 8), cv = v % (Chunk / 8);
        const bool in = r0 + row < p.m;
        const int at = (in ? r0 + row : 0) * p.k + k0 + 8 * cv;
        cp_async_16(a_buf(s) + row * kAPitch + 8 * cv, c.g + at, in);
        cp_async_16(z_buf(s) + row * kAPitch + 8 * cv, c.z + at, in);
      }
#pragma unroll
      for (int j = 0; j < kWVecs; ++j) {
        const int v = tid + j * kThreads, wr = v / 8, wc = v % 8;
        cp_async_16(w_buf(s) + wr * kWPitch + 8 * wc, c.w + (k0 + wr) * p.n + n0 + 8 * wc, true);
      }
      if (tid < kChunk) cp_async_16(coef_buf(s) + tid, c.coef + k0 + tid, true);
    }
    cp_async_commit();  // empty past the end: the waits below count groups alike
  };
  // The epilogue's z' and mask rows of tile t, in their own group (after the previous tile's
  // epilogue has read the single buffer).
  const auto stage_epilogue = [&](int t) {
    const int r0 = tile_row0(t);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int v = tid + j * kThreads, row = v / 8, cv = v % 8;
      const bool in = r0 + row < p.m;
      cp_async_16(zp_tile + row * kZPitch + 8 * cv,
                  c.z_prev + (in ? r0 + row : 0) * p.n + n0 + 8 * cv, in);
    }
    if (tid < kTileM) {
      const bool in = r0 + tid < p.m;
      cp_async_8(mask_tile + tid * (kTileN / 8), c.mask_prev + ((in ? r0 + tid : 0) * p.n + n0) / 8,
                 in);
    }
    cp_async_commit();
  };

  // Warp w: rows 32 (w % 4) + 0..31 (two m16 tiles), columns 32 (w / 4) + 0..31 (four n8 tiles).
  const int wm = warp % 4, wn = warp / 4;
  const int a_lane = (32 * wm + lane % 16) * kAPitch + (lane / 16) * 8;
  const int b_lane = (lane % 8 + ((lane / 8) % 2) * 8) * kWPitch + 32 * wn + (lane / 16) * 8;
  if (tid < 2 * kTileN) sums_tile[tid] = 0.0f;  // the loop's first barrier orders it
  stage_epilogue(0);
  for (int it = 0; it < kStages - 1; ++it) stage(it);
  float acc[2][4][4];
  for (int it = 0; it < total; ++it) {
    const int s = it % kStages, chunk = it % p.chunks;
    const int r0 = tile_row0(it / p.chunks);
    if (chunk == 0) {
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;
    }
    cp_async_wait<kStages - 2>();  // this iteration's group (and any older epilogue's)
    __syncthreads();               // every thread's copies; stage (it - 1) % kStages is free again
    stage(it + kStages - 1);

    // The fold: dz = coef.y (g - coef.z - (z - coef.x) coef.w), bwd_dx_group's expression, so
    // the same FP16 bits as BatchNorm's dx pass; written over g, and once to global memory.
    {
      // All of a thread's vectors sit at the same columns (256 is a multiple of Chunk / 8): one
      // set of coefficients.
      const float4* kc = coef_buf(s) + 8 * (tid % (Chunk / 8));
#pragma unroll 1  // one vector at a time: with the accumulators live, no registers to spare
      for (int j = 0; j < kAVecs; ++j) {
        const int v = tid + j * kThreads, row = v / (Chunk / 8), cv = v % (Chunk / 8);
        __half* gp = a_buf(s) + row * kAPitch + 8 * cv;
        const uint4 graw = *reinterpret_cast<const uint4*>(gp);
        const uint4 zraw = *reinterpret_cast<const uint4*>(z_buf(s) + row * kAPitch + 8 * cv);
        const auto* gh = reinterpret_cast<const __half*>(&graw);
        const auto* zh = reinterpret_cast<const __half*>(&zraw);
        alignas(16) __half out[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float4 k = kc[e];
          out[e] = __float2half_rn(k.y *
                                   (__half2float(gh[e]) - k.z - (__half2float(zh[e]) - k.x) * k.w));
        }
        const uint4 dz = *reinterpret_cast<const uint4*>(out);
        *reinterpret_cast<uint4*>(gp) = dz;
        if (writes_dz && r0 + row < p.m)
          *reinterpret_cast<uint4*>(c.dz + (r0 + row) * p.k + chunk * kChunk + 8 * cv) = dz;
      }
    }
    __syncthreads();  // the folded chunk

    const __half* at = a_buf(s);
    const __half* wt = w_buf(s);
#pragma unroll
    for (int ks = 0; ks < kChunk / 16; ++ks) {
      uint32_t a[2][4], b[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) ldmatrix_x4(a[mi], at + a_lane + 16 * mi * kAPitch + 16 * ks);
#pragma unroll
      for (int nj = 0; nj < 2; ++nj)
        ldmatrix_x4_trans(b[nj], wt + b_lane + 16 * ks * kWPitch + 16 * nj);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
          mma_16816(acc[mi][ni], a[mi][0], a[mi][1], a[mi][2], a[mi][3], b[ni / 2][2 * (ni % 2)],
                    b[ni / 2][2 * (ni % 2) + 1]);
    }

    if (chunk != p.chunks - 1) continue;
      // The epilogue: g' = mask ? round16(round16(dX) [+ dy2]) : 0 (dgrad_bn_epilogue.cuh's
      // rounding), stored; each column's sums over the warp's 32 rows added to the CTA's in shared
      // memory (registers held across the mainloop would spill). z' and the mask's group was
      // committed after the previous tile's epilogue, before the copies of this tile's third
      // chunk (three stages, at least two chunks a tile) or its second (two stages): a wait at
      // or before this iteration's covered it.
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int col = 32 * wn + 8 * ni + 2 * tig;  // within the tile
      const float2 mean = __ldg(reinterpret_cast<const float2*>(c.mean_prev + n0 + col));
      float sg[2] = {0.0f, 0.0f}, sz[2] = {0.0f, 0.0f};
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = 32 * wm + 16 * mi + gid + 8 * h;
          const int grow = r0 + row;
          const bool in = grow < p.m;
          const unsigned byte = mask_tile[row * (kTileN / 8) + col / 8];
          float d[2] = {__half2float(__float2half_rn(acc[mi][ni][2 * h])),
                        __half2float(__float2half_rn(acc[mi][ni][2 * h + 1]))};
          if (c.dy2 != nullptr && in) {
            const __half2 y2 = *reinterpret_cast<const __half2*>(c.dy2 + grow * p.n + n0 + col);
            d[0] = __half2float(__float2half_rn(d[0] + __low2float(y2)));
            d[1] = __half2float(__float2half_rn(d[1] + __high2float(y2)));
          }
          const __half2 zp = *reinterpret_cast<const __half2*>(zp_tile + row * kZPitch + col);
          float gv[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            gv[j] = in && ((byte >> (col % 8 + j)) & 1u) ? d[j] : 0.0f;
            const float zj = j ? __high2float(zp) : __low2float(zp);
            sg[j] += gv[j];
            sz[j] += gv[j] * (zj - (j ? mean.y : mean.x));
          }
          if (in)
            *reinterpret_cast<__half2*>(c.g_prev + grow * p.n + n0 + col) =
                __floats2half2_rn(gv[0], gv[1]);
        }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int o = 4; o < 32; o *= 2) {
          sg[j] += __shfl_xor_sync(0xFFFFFFFFu, sg[j], o);
          sz[j] += __shfl_xor_sync(0xFFFFFFFFu, sz[j], o);
        }
        if (gid == 0) {
          atomicAdd(sums_tile + col + j, sg[j]);
          atomicAdd(sums_tile + kTileN + col + j, sz[j]);
        }
      }
    }
    __syncthreads();  // the epilogue's tiles are read: the next tile's may land
    if (it / p.chunks + 1 < my_tiles) stage_epilogue(it / p.chunks + 1);
  }

  // The CTA's sums, once (every warp's shared-memory atomics done).
  __syncthreads();
  if (tid < 2 * kTileN)
    atomicAdd(c.sums + (tid < kTileN ? 0 : p.n) + n0 + tid % kTileN, sums_tile[tid]);
}

}  // namespace

namespace {

// The variant's depth: the asked one, else whole 128-byte lines where k allows.
int chunk_of(const FoldDgrad& c) {
  return c.chunk != 0 ? c.chunk : c.k % 64 == 0 ? 64 : 32;
}

using FoldKernel = void (*)(Params);
struct Variant {
  FoldKernel kernel;
  int smem;
};
Variant variant_of(const FoldDgrad& c) {
  if (chunk_of(c) == 64) return {fold_dgrad_kernel<64, 2>, Shape<64, 2>::kSmemBytes};
  return {fold_dgrad_kernel<32, 3>, Shape<32, 3>::kSmemBytes};
}

}  // namespace

std::string fold_dgrad_refusal(const FoldDgrad& c) {
  if (!c.g || !c.z || !c.coef || !c.w || !c.z_prev || !c.mask_prev || !c.mean_prev || !c.g_prev ||
      !c.sums)
    return "needs g, z, the coefficients, W, z', the mask, the mean, g' and the sums";
  const auto misaligned = [](const void* p, uintptr_t a) {
    return p != nullptr && reinterpret_cast<uintptr_t>(p) % a != 0;
  };
  if (misaligned(c.g, 16) || misaligned(c.z, 16) || misaligned(c.coef, 16) ||
      misaligned(c.dz, 16) || misaligned(c.w, 16) || misaligned(c.z_prev, 16) ||
      misaligned(c.dy2, 4) || misaligned(c.g_prev, 4) || misaligned(c.mask_prev, 8) ||
      misaligned(c.mean_prev, 8))
    return "needs its tensors 16-byte aligned (dy2 and g' 4-byte, the mask and mean 8-byte)";
  if (c.chunk != 0 && c.chunk != 32 && c.chunk != 64) return "takes chunks of 32 or 64 (or 0)";
  const int chunk = chunk_of(c);
  if (c.k < 64 || c.k % chunk != 0)
    return "takes k a multiple of " + std::to_string(chunk) + ", at least 64";
  if (c.n < kTileN || c.n % kTileN != 0) return "takes n a multiple of 64";
  if (c.m < 1 || (c.m + kTileM) * std::max(c.k, c.n) >= (int64_t{1} << 31) ||
      (c.m + kTileM - 1) / kTileM >= (int64_t{1} << 30) / (c.n / kTileN))
    return "takes m from 1 to below 2^31 elements a tensor";
  return "";
}

namespace {

Params params_of(const FoldDgrad& c) {
  Params p;
  p.c = c;
  p.m = static_cast<int>(c.m), p.k = static_cast<int>(c.k), p.n = static_cast<int>(c.n);
  p.row_tiles = static_cast<int>((c.m + kTileM - 1) / kTileM);
  p.col_tiles = static_cast<int>(c.n / kTileN);
  p.chunks = static_cast<int>(c.k / chunk_of(c));
  return p;
}

}  // namespace

cudaError_t prepare_fold_dgrad(const FoldDgrad& c, int sm_count, unsigned* grid) {
  if (!fold_dgrad_refusal(c).empty()) return cudaErrorInvalidValue;
  const Variant v = variant_of(c);
  const Params p = params_of(c);
  if (cudaError_t e =
          prepare_persistent(v.kernel, kThreads, v.smem,
                             static_cast<int64_t>(p.row_tiles) * p.col_tiles, sm_count, grid);
      e != cudaSuccess)
    return e;
  // A whole number of CTAs a column tile, each column tile's CTAs walking the same row tiles
  // side by side (neighbours in launch order), so that g and z may meet in L2.
  *grid =
      std::max(1u, *grid / static_cast<unsigned>(p.col_tiles)) * static_cast<unsigned>(p.col_tiles);
  return cudaSuccess;
}

cudaError_t launch_fold_dgrad(const FoldDgrad& c, unsigned grid, cudaStream_t stream) {
  if (!fold_dgrad_refusal(c).empty() || grid == 0) return cudaErrorInvalidValue;
  const Params p = params_of(c);
  if (grid % static_cast<unsigned>(p.col_tiles) != 0) return cudaErrorInvalidValue;
  const Variant v = variant_of(c);
  v.kernel<<<grid, kThreads, v.smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kiln::cuda
