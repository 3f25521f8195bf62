// What the first layer's kernels (first_layer_conv.cu, first_layer_wgrad.cu) share: the walk from
// an output pixel to the 4-channel taps of its window in x (the PTX they use: mma_ptx.cuh).
// Device code only; included by those two .cu files.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "backend/cuda/first_layer_conv.h"
#include "backend/cuda/mma_ptx.cuh"
#include "backend/cuda/persistent_grid.h"

namespace kiln::cuda::first_layer {

using namespace mma_ptx;  // NOLINT: the kernels name the PTX helpers unqualified

constexpr int kC = kFirstLayerChannels, kK = kFirstLayerOutputs;
// A tap past the filter is placed kOutside past x, a pixel past the output 2 kOutside before it:
// every load either makes is out of bounds (images are refused from kOutside / 2 pixels a side),
// so it reads zeros and adds nothing.
constexpr int kOutside = 1 << 28;

// K (taps x 4 channels) padded to whole 16-deep MMA steps.
inline int padded_k(const FirstLayerShape& c) {
  return (c.r * c.s * kC + 15) / 16 * 16;
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

}  // namespace kiln::cuda::first_layer
