// What the first layer's kernels (first_layer_conv.cu, first_layer_wgrad.cu) share: mma.sync
// and ldmatrix/stmatrix in PTX, and the walk from an output pixel to the 4-channel taps of its
// window in x. Device code only; included by those two .cu files.
#pragma once
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/first_layer_conv.h"

namespace kiln::cuda::first_layer {

constexpr int kC = kFirstLayerChannels, kK = kFirstLayerOutputs;
// A tap past the filter is placed kOutside past x, a pixel past the output 2 kOutside before it:
// every load either makes is out of bounds (images are refused from kOutside / 2 pixels a side),
// so it reads zeros and adds nothing.
constexpr int kOutside = 1 << 28;

// K (taps x 4 channels) padded to whole 16-deep MMA steps.
inline int padded_k(const FirstLayerShape& c) {
  return (c.r * c.s * kC + 15) / 16 * 16;
}

__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __half* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __half* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

__device__ __forceinline__ void stmatrix_x4_trans(__half* p, uint32_t r0, uint32_t r1, uint32_t r2,
                                                  uint32_t r3) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};" ::"r"(smem_addr(p)),
      "r"(r0), "r"(r1), "r"(r2), "r"(r3)
      : "memory");
}

// cp.async of 16 or 8 bytes into shared memory; where !valid nothing is read and zeros land.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_8(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 8 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most one group of this thread's copies is in flight.
__device__ __forceinline__ void cp_async_wait_1() {
  asm volatile("cp.async.wait_group 1;" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

struct Geometry {
  int h, w, p, q, s, sh, sw, ph, pw, taps, kp, m;  // m: output pixels
  FastDivide by_q, by_pq;
};

inline Geometry geometry(const FirstLayerShape& c) {
  Geometry g;
  g.h = c.h, g.w = c.w_, g.p = c.p(), g.q = c.q(), g.s = c.s;
  g.sh = c.stride_h, g.sw = c.stride_w, g.ph = c.pad_h, g.pw = c.pad_w;
  g.taps = c.r * c.s, g.kp = padded_k(c);
  g.m = c.n * g.p * g.q;  // below 2^31 (first_layer_shape_refusal)
  g.by_q = FastDivide(g.q), g.by_pq = FastDivide(g.p * g.q);
  return g;
}

// Each tap's place in the window, (dy, dx, dy w + dx), for slots taps; kOutside past them.
__device__ __forceinline__ int4 tap_place(const Geometry& g, int t) {
  const int dy = t / g.s, dx = t % g.s;
  return t < g.taps ? make_int4(dy, dx, dy * g.w + dx, 0) : make_int4(kOutside, kOutside, 0, 0);
}

// A pixel of a lane's B fragments: its window's top-left in x (negative where the window starts
// in the padding) and that corner's index in x, in pixels (so a tap adds its own offset).
struct PixelPlace {
  int corner, ih0, iw0;
};

__device__ __forceinline__ PixelPlace place_pixel(const Geometry& g, int row) {
  if (row >= g.m) return {0, -2 * kOutside, -2 * kOutside};
  const int b = g.by_pq.quotient(row);
  const int rem = row - b * g.p * g.q;
  const int op = g.by_q.quotient(rem), oq = rem - op * g.q;
  const int ih0 = op * g.sh - g.ph, iw0 = oq * g.sw - g.pw;
  return {(b * g.h + ih0) * g.w + iw0, ih0, iw0};
}

// One tap (dy, dx, dy w + dx) of a pixel's window: its 4 channels (8 bytes), zero outside x.
__device__ __forceinline__ uint2 load_tap(const uint2* x, const Geometry& g, const PixelPlace& px,
                                          int4 tap) {
  const int ih = px.ih0 + tap.x, iw = px.iw0 + tap.y;
  if (static_cast<unsigned>(ih) >= static_cast<unsigned>(g.h) ||
      static_cast<unsigned>(iw) >= static_cast<unsigned>(g.w))
    return make_uint2(0u, 0u);
  return __ldg(x + static_cast<unsigned>(px.corner + tap.z));
}

// A persistent kernel's grid: shared memory set to bytes, then as many CTAs as fit on sm_count
// SMs at once, at most one per tile. Once, while compiling, outside a captured CUDA Graph.
template <typename Kernel>
cudaError_t prepare_persistent(Kernel kernel, int threads, size_t bytes, int64_t tiles,
                               int sm_count, unsigned* grid) {
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes));
      e != cudaSuccess)
    return e;
  int per_sm = 0;
  if (cudaError_t e =
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, bytes);
      e != cudaSuccess)
    return e;
  *grid = static_cast<unsigned>(
      std::min<int64_t>(tiles, static_cast<int64_t>(sm_count) * std::max(per_sm, 1)));
  return cudaSuccess;
}

}  // namespace kiln::cuda::first_layer
