// cbr_pool_* with a max-pool whose windows overlap or are padded (ops.def; ResNet's 3x3 / 2 stem
// pool, padding 1), included by bn.cu alone. The forward folds the pool into BatchNorm's apply
// pass, as apply_relu_pool does for tiled windows, and keeps a byte per pooled element (the
// window position of the element taken, 255 where the ReLU did not pass it); the backward's
// sums pass gathers the gradient at each element of z from the windows that cover it, writes it
// (g, full resolution) and sums it, so that no maxpool_bwd pass and no full-resolution ReLU
// output or i32 argmax exist. The dx pass then reads g like any other BatchNorm backward.
#pragma once
#include "backend/cuda/bn_kernels.cuh"

namespace kiln::cuda {
namespace {

// z's and y's sizes and the pool's window, stride and padding; 32-bit (the host checks pixels
// x groups < 2^31).
struct OverlapPool {
  int zh = 0, zw = 0, yh = 0, yw = 0, k = 0, s = 0, p = 0;
  // The pooled rows (or columns) [*lo, *hi] whose windows cover z's row (column) i, of `out`:
  // maxpool_bwd's covering().
  __device__ __forceinline__ void covering(int i, int out, int* lo, int* hi) const {
    const int num = i + p - k + 1;
    *lo = num <= 0 ? 0 : (num + s - 1) / s;
    *hi = min((i + p) / s, out - 1);
  }
};

// y = the max-pool of relu(bn(z)) over each window clipped to the map (maxpool_fwd's scan:
// first maximum in window order, NaN wins; the values bn_relu_one's), mask = the window
// position taken per element of y, 255 where the ReLU did not pass it. One thread per pooled
// pixel and group of eight channels, so its eight mask bytes are one 8-byte store. K > 0: the
// window is K x K (op.k == K; ResNet's stem, 3), and its loads are all issued before the
// arithmetic, up to K^2 16-byte loads in flight a thread where the loop of K = 0 waits on each.
template <typename T, bool Vec, int K>
__global__ void __launch_bounds__(kVecThreads)
    apply_relu_pool_overlap(const T* z, T* y, uint8_t* mask, int total, int cg, OverlapPool op,
                            const float4* coef) {
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += gridDim.x * blockDim.x) {
    const int gi = t % cg, pix = t / cg;
    const int ow = pix % op.yw, row = pix / op.yw, oh = row % op.yh, b = row / op.yh;
    float4 k[8];
    alignas(16) T best[8];
    float bestf[8];
    int at[8];
    pool_start(coef, gi, k, bestf, at);
    const int h0 = oh * op.s - op.p, w0 = ow * op.s - op.p;
    const int hs = max(h0, 0), he = min(h0 + op.k, op.zh), ws = max(w0, 0),
              we = min(w0 + op.k, op.zw);
    auto group = [&](int ih, int iw) {  // z's group of eight channels at (ih, iw)
      return z + (static_cast<int64_t>((b * op.zh + ih) * op.zw + iw) * cg + gi) * 8;
    };
    if constexpr (K > 0) {
      // Window position (i, j) within the map: the loop's bounds below.
      auto inside = [&](int i, int j) {
        return h0 + i >= hs && h0 + i < he && w0 + j >= ws && w0 + j < we;
      };
      alignas(16) T a[K * K][8];
#pragma unroll
      for (int i = 0; i < K; ++i) {
#pragma unroll
        for (int j = 0; j < K; ++j) {
          if (inside(i, j)) load_group<T, Vec>(group(h0 + i, w0 + j), a[i * K + j]);
        }
      }
#pragma unroll
      for (int i = 0; i < K; ++i) {
#pragma unroll
        for (int j = 0; j < K; ++j) {
          if (inside(i, j)) pool_take(a[i * K + j], k, i * K + j, best, bestf, at);
        }
      }
    } else {
      for (int ih = hs; ih < he; ++ih) {
        for (int iw = ws; iw < we; ++iw) {
          alignas(16) T a[8];
          load_group<T, Vec>(group(ih, iw), a);
          pool_take(a, k, (ih - h0) * op.k + (iw - w0), best, bestf, at);
        }
      }
    }
    if constexpr (Vec) {
      store8(y + static_cast<int64_t>(t) * 8, best);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) y[static_cast<int64_t>(t) * 8 + j] = best[j];
    }
    uint32_t m[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t pos = bestf[j] > 0.0f ? static_cast<uint32_t>(at[j]) : 255u;
      m[j / 4] |= pos << (8 * (j % 4));
    }
    reinterpret_cast<uint2*>(mask)[t] = make_uint2(m[0], m[1]);
  }
}

// The gradient at z's element (row r = (b zh + ih) zw + iw, channels c0 .. c0 + V - 1): the sum
// over the windows that cover it, in row-major order, of dy where the window took it, in FP32
// and rounded once to T (maxpool_bwd's arithmetic). C: channels; dy and mask are y's. Over a
// 16-byte vector (V = 8 of f16, 4 of f32) a window's mask bytes are read as one word each four
// and compared four at a time, and dy as one vector where a byte matched; V = 1 reads one of
// each. Row arithmetic in 32 bits (merged_pool checks pixels < 2^31).
template <typename T, int V>
__device__ __forceinline__ void routed_grad(const T* dy, const uint8_t* mask, int r, int C, int c0,
                                            const OverlapPool& op, T (&g)[V]) {
  static_assert(V == 1 || V * sizeof(T) == 16, "one channel, or a 16-byte vector");
  const int iw = r % op.zw, q = r / op.zw, ih = q % op.zh, b = q / op.zh;
  int oh0 = 0, oh1 = 0, ow0 = 0, ow1 = 0;
  op.covering(ih, op.yh, &oh0, &oh1);
  op.covering(iw, op.yw, &ow0, &ow1);
  float sum[V];
#pragma unroll
  for (int j = 0; j < V; ++j) sum[j] = 0.0f;
  for (int oh = oh0; oh <= oh1; ++oh) {
    const int prow = (b * op.yh + oh) * op.yw;
    const int dh = (ih - (oh * op.s - op.p)) * op.k;
    for (int ow = ow0; ow <= ow1; ++ow) {
      const int64_t o = static_cast<int64_t>(prow + ow) * C + c0;
      const uint32_t pos = static_cast<uint32_t>(dh + iw - (ow * op.s - op.p));
      if constexpr (V == 1) {
        if (mask[o] == pos) sum[0] += to_f(dy[o]);
      } else {
        constexpr int W = V / 4;  // mask words
        const uint32_t pos4 = pos * 0x01010101u;
        uint32_t hit[W];
        if constexpr (W == 2) {
          const uint2 m = *reinterpret_cast<const uint2*>(mask + o);
          hit[0] = __vcmpeq4(m.x, pos4), hit[1] = __vcmpeq4(m.y, pos4);
        } else {
          hit[0] = __vcmpeq4(*reinterpret_cast<const uint32_t*>(mask + o), pos4);
        }
        if ((hit[0] | hit[W - 1]) == 0u) continue;
        const uint4 dv = *reinterpret_cast<const uint4*>(dy + o);
        const T* d = reinterpret_cast<const T*>(&dv);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if ((hit[j / 4] >> (8 * (j % 4))) & 1u) sum[j] += to_f(d[j]);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) g[j] = from_f<T>(sum[j]);
}

// routed_grad over 16-byte vectors where at most M x M windows cover an element (M = (k - 1) / s
// + 1: 2 for the stem's 3x3 / 2): every covering window's mask words are loaded first, then dy
// where a byte matched, then summed in the loop's order (same bits). The loop waits on each
// window's mask and then its dy in turn; here a row waits twice. Eager (KILN_POOL_ROUTE_EAGER)
// loads every covering window's dy beside its mask, matched or not, so a row waits once, for
// more reads from L2; only matched bytes are summed, so the bits are the same.
template <typename T, int M, bool Eager = false>
__device__ __forceinline__ void routed_grad_unrolled(const T* dy, const uint8_t* mask, int r, int C,
                                                     int c0, const OverlapPool& op,
                                                     T (&g)[kVec<T>]) {
  constexpr int V = kVec<T>, W = V / 4, N = M * M;  // V elements, W mask words a window
  const int iw = r % op.zw, q = r / op.zw, ih = q % op.zh, b = q / op.zh;
  int oh0 = 0, oh1 = 0, ow0 = 0, ow1 = 0;
  op.covering(ih, op.yh, &oh0, &oh1);
  op.covering(iw, op.yw, &ow0, &ow1);
  int64_t off[N];
  uint32_t hit[N][W];
  uint4 dv[N];
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const int oh = oh0 + u / M, ow = ow0 + u % M;
    off[u] = static_cast<int64_t>((b * op.yh + oh) * op.yw + ow) * C + c0;
#pragma unroll
    for (int w = 0; w < W; ++w) hit[u][w] = 0u;
    dv[u] = make_uint4(0, 0, 0, 0);
    if (oh <= oh1 && ow <= ow1) {
      if constexpr (W == 2) {
        const uint2 m = *reinterpret_cast<const uint2*>(mask + off[u]);
        hit[u][0] = m.x, hit[u][1] = m.y;
      } else {
        hit[u][0] = *reinterpret_cast<const uint32_t*>(mask + off[u]);
      }
      if constexpr (Eager) dv[u] = *reinterpret_cast<const uint4*>(dy + off[u]);
    }
  }
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const int oh = oh0 + u / M, ow = ow0 + u % M;
    const uint32_t pos = static_cast<uint32_t>((ih - (oh * op.s - op.p)) * op.k + iw -
                                               (ow * op.s - op.p)),
                   pos4 = pos * 0x01010101u;
    const bool inside = oh <= oh1 && ow <= ow1;
#pragma unroll
    for (int w = 0; w < W; ++w) hit[u][w] = inside ? __vcmpeq4(hit[u][w], pos4) : 0u;
    if constexpr (!Eager) {
      if ((hit[u][0] | hit[u][W - 1]) != 0u) dv[u] = *reinterpret_cast<const uint4*>(dy + off[u]);
    }
  }
  float sum[V];
#pragma unroll
  for (int j = 0; j < V; ++j) sum[j] = 0.0f;
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const T* d = reinterpret_cast<const T*>(&dv[u]);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if ((hit[u][j / 4] >> (8 * (j % 4))) & 1u) sum[j] += to_f(d[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) g[j] = from_f<T>(sum[j]);
}

// The sums pass of the overlapping form, 16-byte vectors (bwd_partial_vec's layout and
// partials): g gathered per row and vector, written to g_out, and sum g, sum g (x - mean)
// accumulated. Two rows in flight: both rows' x loads and gathers are issued before either's
// sums. M > 0: routed_grad_unrolled's gather (the same bits as the loop's, M = 0), Eager as it.
template <typename T, int M, bool Eager = false>
__global__ void __launch_bounds__(kVecThreads)
    route_partial_vec(const T* x, const T* dy, const uint8_t* mask, const float* mean, int rows,
                      int C, OverlapPool op, T* g_out, double2* partial) {
  constexpr int V = kVec<T>, U = 2;
  const int cv = C / V, cvec = threadIdx.x % cv, rpb = kVecThreads / cv, rstride = gridDim.x * rpb;
  double s[V], sx[V];
  float mu[V];  // widened where used: the same double as a double copy, in half the registers
#pragma unroll
  for (int j = 0; j < V; ++j) {
    s[j] = sx[j] = 0.0;
    mu[j] = mean[cvec * V + j];
  }
  for (int r = blockIdx.x * rpb + threadIdx.x / cv; r < rows; r += U * rstride) {
    uint4 xa[U];
    alignas(16) T g[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ru = r + u * rstride;
      xa[u] = ru < rows ? reinterpret_cast<const uint4*>(x)[static_cast<int64_t>(ru) * cv + cvec]
                        : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ru = r + u * rstride;
      if (ru < rows) {
        if constexpr (M > 0) {
          routed_grad_unrolled<T, M, Eager>(dy, mask, ru, C, cvec * V, op, g[u]);
        } else {
          routed_grad<T, V>(dy, mask, ru, C, cvec * V, op, g[u]);
        }
        reinterpret_cast<uint4*>(g_out)[static_cast<int64_t>(ru) * cv + cvec] =
            *reinterpret_cast<const uint4*>(g[u]);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) g[u][j] = from_f<T>(0.0f);  // a zero g adds nothing
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const T* xe = reinterpret_cast<const T*>(&xa[u]);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const double gj = to_f(g[u][j]);
        s[j] += gj;
        sx[j] += gj * (static_cast<double>(to_f(xe[j])) - static_cast<double>(mu[j]));
      }
    }
  }
  combine_store<V>(s, sx, cv, cvec, C, partial);
}

// Likewise, one element at a time (bwd_partial_kernel's layout and partials).
template <typename T>
__global__ void route_partial_kernel(const T* x, const T* dy, const uint8_t* mask,
                                     const float* mean, int64_t rows, int64_t C, OverlapPool op,
                                     T* g_out, double2* partial) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCx + threadIdx.x;
  double s = 0.0, sx = 0.0;
  if (c < C) {
    const double mu = mean[c];
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * kCy + threadIdx.y; r < rows;
         r += static_cast<int64_t>(gridDim.y) * kCy) {
      T g[1];
      routed_grad<T, 1>(dy, mask, static_cast<int>(r), static_cast<int>(C), static_cast<int>(c), op,
                        g);
      g_out[r * C + c] = g[0];
      const double gd = to_f(g[0]);
      s += gd;
      sx += gd * (static_cast<double>(to_f(x[r * C + c])) - mu);
    }
  }
  block_reduce_store(s, sx, partial, c, C);
}

}  // namespace
}  // namespace kiln::cuda
