// Pooling on the GPU, NHWC, one thread per output (forward) or per input element (backward:
// a gather over the windows that cover it, so there are no atomics and the sums come out in
// the CPU loop's order).
//
// Max pooling writes the argmax as an explicit i32 tensor (index ih * W + iw in the input
// HxW plane, PyTorch's `indices`), ties to the first element in window order, NaN wins: the
// rules of src/backend/cpu/pool.cpp. Average pooling divides by kh*kw with
// count_include_pad (symmetric padding with the floor rule never reaches past H + pad), else
// by the number of elements inside the image.
#include <algorithm>
#include <cfloat>

#include "backend/cuda/device_util.cuh"
#include "backend/cuda/float_launch.cuh"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) {
  return a > b ? a : b;
}
__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) {
  return a < b ? a : b;
}

struct PoolDims {
  int64_t n, h, w, c;  // input
  int64_t p, q;        // output
  int kh, kw, sh, sw, ph, pw;
  bool include_pad;
};

// Output element o of the pooled map: its pixel and channel, and its window clipped to the input.
struct OutWindow {
  int64_t b, oh, ow, c;
  int64_t hs, he, ws, we;  // input rows [hs, he), columns [ws, we)
};
__device__ __forceinline__ OutWindow out_window(const PoolDims& d, int64_t o) {
  OutWindow v;
  v.c = o % d.c;
  int64_t r = o / d.c;
  v.ow = r % d.q;
  r /= d.q;
  v.oh = r % d.p;
  v.b = r / d.p;
  const int64_t h0 = v.oh * d.sh - d.ph, w0 = v.ow * d.sw - d.pw;
  v.hs = imax(h0, 0), v.he = imin(h0 + d.kh, d.h);
  v.ws = imax(w0, 0), v.we = imin(w0 + d.kw, d.w);
  return v;
}

template <typename T>
__global__ void maxpool_fwd_kernel(const T* x, T* y, int32_t* argmax, PoolDims d) {
  const int64_t total = d.n * d.p * d.q * d.c;
  KILN_GRID_STRIDE(o, total) {
    const auto [b, oh, ow, c, hs, he, ws, we] = out_window(d, o);
    float best = -INFINITY;
    int32_t idx = static_cast<int32_t>(hs * d.w + ws);
    const T* xb = x + b * d.h * d.w * d.c + c;
    for (int64_t ih = hs; ih < he; ++ih) {
      for (int64_t iw = ws; iw < we; ++iw) {
        const float v = to_f(xb[(ih * d.w + iw) * d.c]);
        if (v > best || isnan(v)) {
          best = v;
          idx = static_cast<int32_t>(ih * d.w + iw);
        }
      }
    }
    y[o] = from_f<T>(best);
    if (argmax) argmax[o] = idx;
  }
}

// Output rows / columns whose window covers input row i: oh with oh*s - p <= i < oh*s - p + k.
__device__ __forceinline__ void covering(int64_t i, int k, int s, int p, int64_t out, int64_t* lo,
                                         int64_t* hi) {
  const int64_t num = i + p - k + 1;
  *lo = num <= 0 ? 0 : (num + s - 1) / s;
  *hi = imin((i + p) / s, out - 1);
}

// Input element i of the map: its pixel and channel, and the output rows [oh0, oh1] and
// columns [ow0, ow1] whose windows cover it.
struct InCover {
  int64_t b, ih, iw, c;
  int64_t oh0, oh1, ow0, ow1;
};
__device__ __forceinline__ InCover in_cover(const PoolDims& d, int64_t i) {
  InCover v;
  v.c = i % d.c;
  int64_t r = i / d.c;
  v.iw = r % d.w;
  r /= d.w;
  v.ih = r % d.h;
  v.b = r / d.h;
  covering(v.ih, d.kh, d.sh, d.ph, d.p, &v.oh0, &v.oh1);
  covering(v.iw, d.kw, d.sw, d.pw, d.q, &v.ow0, &v.ow1);
  return v;
}

template <typename T>
__global__ void maxpool_bwd_kernel(const T* dy, const int32_t* argmax, T* dx, PoolDims d) {
  const int64_t total = d.n * d.h * d.w * d.c;
  KILN_GRID_STRIDE(i, total) {
    const auto [b, ih, iw, c, oh0, oh1, ow0, ow1] = in_cover(d, i);
    const auto self = static_cast<int32_t>(ih * d.w + iw);
    float sum = 0.0f;
    for (int64_t oh = oh0; oh <= oh1; ++oh) {
      for (int64_t ow = ow0; ow <= ow1; ++ow) {
        const int64_t o = ((b * d.p + oh) * d.q + ow) * d.c + c;
        if (argmax[o] == self) sum += to_f(dy[o]);
      }
    }
    dx[i] = from_f<T>(sum);
  }
}

// 16-byte paths of max pooling (KILN_VECTOR_KERNELS): one thread per V channels of a pixel
// (V = 8 f16 or 4 f32), 32-bit index arithmetic, the argmax as V i32 in 16-byte words, as the
// scalar kernels above spend most of their time in 64-bit divisions and 2-byte loads. Same rules
// and summation order as the scalar kernels.
struct PoolDims32 {
  int h, w, cv;  // input rows, columns, channel vectors
  int p, q;      // output rows, columns
  int kh, kw, sh, sw, ph, pw;
};

// Output vector o's place: batch b, row oh, column ow, channel vector cvec.
struct OutPos {
  int b, oh, ow, cvec;
};
__device__ __forceinline__ OutPos out_pos(int o, const PoolDims32& d) {
  OutPos p;
  p.cvec = o % d.cv;
  int r = o / d.cv;
  p.ow = r % d.q;
  r /= d.q;
  p.oh = r % d.p;
  p.b = r / d.p;
  return p;
}

// The V argmax entries of output vector o (V / 4 16-byte loads).
template <int V>
__device__ __forceinline__ void load_argmax(const int32_t* argmax, int64_t o, int32_t (&am)[V]) {
#pragma unroll
  for (int w = 0; w < V / 4; ++w) {
    const uint4 a = reinterpret_cast<const uint4*>(argmax)[o * (V / 4) + w];
    am[4 * w] = static_cast<int32_t>(a.x);
    am[4 * w + 1] = static_cast<int32_t>(a.y);
    am[4 * w + 2] = static_cast<int32_t>(a.z);
    am[4 * w + 3] = static_cast<int32_t>(a.w);
  }
}

template <typename T>
__global__ void maxpool_fwd_vec(const uint4* x, uint4* y, int32_t* argmax, int total,
                                PoolDims32 d) {
  constexpr int V = kVec<T>;
  for (int o = blockIdx.x * blockDim.x + threadIdx.x; o < total; o += gridDim.x * blockDim.x) {
    const auto [b, oh, ow, cvec] = out_pos(o, d);
    const int h0 = oh * d.sh - d.ph, w0 = ow * d.sw - d.pw;
    const int hs = max(h0, 0), he = min(h0 + d.kh, d.h), ws = max(w0, 0), we = min(w0 + d.kw, d.w);
    float best[V];
    int32_t idx[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      best[j] = -INFINITY;
      idx[j] = hs * d.w + ws;
    }
    for (int ih = hs; ih < he; ++ih) {
      for (int iw = ws; iw < we; ++iw) {
        const uint4 raw = x[(static_cast<int64_t>(b * d.h + ih) * d.w + iw) * d.cv + cvec];
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float v = to_f(e[j]);
          if (v > best[j] || isnan(v)) {
            best[j] = v;
            idx[j] = ih * d.w + iw;
          }
        }
      }
    }
    uint4 out;
    T* oe = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int j = 0; j < V; ++j) oe[j] = from_f<T>(best[j]);
    y[o] = out;
    if (argmax) {
#pragma unroll
      for (int w = 0; w < V / 4; ++w) {
        reinterpret_cast<uint4*>(argmax)[static_cast<int64_t>(o) * (V / 4) + w] =
            make_uint4(idx[4 * w], idx[4 * w + 1], idx[4 * w + 2], idx[4 * w + 3]);
      }
    }
  }
}

template <typename T>
__global__ void maxpool_bwd_vec(const uint4* dy, const int32_t* argmax, uint4* dx, int total,
                                PoolDims32 d) {
  constexpr int V = kVec<T>;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int cvec = i % d.cv;
    int r = i / d.cv;
    const int iw = r % d.w;
    r /= d.w;
    const int ih = r % d.h;
    const int b = r / d.h;
    // Output rows / columns whose window covers (ih, iw), as covering() above.
    const int nh = ih + d.ph - d.kh + 1, nw = iw + d.pw - d.kw + 1;
    const int oh0 = nh <= 0 ? 0 : (nh + d.sh - 1) / d.sh, oh1 = min((ih + d.ph) / d.sh, d.p - 1);
    const int ow0 = nw <= 0 ? 0 : (nw + d.sw - 1) / d.sw, ow1 = min((iw + d.pw) / d.sw, d.q - 1);
    const int self = ih * d.w + iw;
    float sum[V];
#pragma unroll
    for (int j = 0; j < V; ++j) sum[j] = 0.0f;
    for (int oh = oh0; oh <= oh1; ++oh) {
      for (int ow = ow0; ow <= ow1; ++ow) {
        const int64_t o = (static_cast<int64_t>(b * d.p + oh) * d.q + ow) * d.cv + cvec;
        const uint4 g = dy[o];
        const T* ge = reinterpret_cast<const T*>(&g);
        int32_t am[V];
        load_argmax<V>(argmax, o, am);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          if (am[j] == self) sum[j] += to_f(ge[j]);
        }
      }
    }
    uint4 out;
    T* oe = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int j = 0; j < V; ++j) oe[j] = from_f<T>(sum[j]);
    dx[i] = out;
  }
}

// Windows that tile the input exactly, without overlap or padding (VGG's 2x2 stride 2): each
// input element lies in one window, so a thread takes one output vector and writes its
// window's kh x kw input vectors - the gradient where the argmax points, zero elsewhere -
// instead of every input searching the windows that cover it (maxpool_bwd_vec, far slower on
// VGG's pools). The value is maxpool_bwd_vec's own, 0 + g, so the bits are the same (a -0
// gradient becomes +0 in both).
template <typename T>
__global__ void maxpool_bwd_tiled(const uint4* dy, const int32_t* argmax, uint4* dx, int total,
                                  PoolDims32 d) {
  constexpr int V = kVec<T>;
  for (int o = blockIdx.x * blockDim.x + threadIdx.x; o < total; o += gridDim.x * blockDim.x) {
    const auto [b, oh, ow, cvec] = out_pos(o, d);
    const uint4 g = dy[o];
    const T* ge = reinterpret_cast<const T*>(&g);
    int32_t am[V];
    load_argmax<V>(argmax, o, am);
    for (int i = 0; i < d.kh; ++i) {
      const int ih = oh * d.sh + i;
      for (int j = 0; j < d.kw; ++j) {
        const int iw = ow * d.sw + j;
        const int self = ih * d.w + iw;
        uint4 out;
        T* oe = reinterpret_cast<T*>(&out);
#pragma unroll
        for (int e = 0; e < V; ++e) oe[e] = from_f<T>(am[e] == self ? 0.0f + to_f(ge[e]) : 0.0f);
        dx[(static_cast<int64_t>(b * d.h + ih) * d.w + iw) * d.cv + cvec] = out;
      }
    }
  }
}

// The vector form applies: C a multiple of V, 16-byte aligned maps, every index within int.
bool pool_vec(const Context& ctx, const PoolDims& d, DType dt,
              std::initializer_list<const void*> ptrs, PoolDims32* out) {
  const int v = dt == DType::F32 ? 4 : 8;
  const int64_t big = std::max(d.n * d.h * d.w * d.c, d.n * d.p * d.q * d.c);
  if (d.c % v != 0 || big >= (int64_t{1} << 31) || !vec_fits(ctx.opts, big, v, ptrs)) return false;
  *out = {static_cast<int>(d.h),
          static_cast<int>(d.w),
          static_cast<int>(d.c / v),
          static_cast<int>(d.p),
          static_cast<int>(d.q),
          d.kh,
          d.kw,
          d.sh,
          d.sw,
          d.ph,
          d.pw};
  return true;
}

__device__ __forceinline__ int avg_divisor(const PoolDims& d, int64_t oh, int64_t ow) {
  if (d.include_pad) return d.kh * d.kw;
  const int64_t h0 = oh * d.sh - d.ph, w0 = ow * d.sw - d.pw;
  const int64_t hn = imin(h0 + d.kh, d.h) - imax(h0, 0);
  const int64_t wn = imin(w0 + d.kw, d.w) - imax(w0, 0);
  return static_cast<int>(hn * wn);
}

template <typename T>
__global__ void avgpool_fwd_kernel(const T* x, T* y, PoolDims d) {
  const int64_t total = d.n * d.p * d.q * d.c;
  KILN_GRID_STRIDE(o, total) {
    const auto [b, oh, ow, c, hs, he, ws, we] = out_window(d, o);
    const T* xb = x + b * d.h * d.w * d.c + c;
    float sum = 0.0f;
    for (int64_t ih = hs; ih < he; ++ih) {
      for (int64_t iw = ws; iw < we; ++iw) sum += to_f(xb[(ih * d.w + iw) * d.c]);
    }
    y[o] = from_f<T>(sum / static_cast<float>(avg_divisor(d, oh, ow)));
  }
}

template <typename T>
__global__ void avgpool_bwd_kernel(const T* dy, T* dx, PoolDims d) {
  const int64_t total = d.n * d.h * d.w * d.c;
  KILN_GRID_STRIDE(i, total) {
    const auto [b, ih, iw, c, oh0, oh1, ow0, ow1] = in_cover(d, i);
    float sum = 0.0f;
    for (int64_t oh = oh0; oh <= oh1; ++oh) {
      for (int64_t ow = ow0; ow <= ow1; ++ow) {
        const int64_t o = ((b * d.p + oh) * d.q + ow) * d.c + c;
        sum += to_f(dy[o]) / static_cast<float>(avg_divisor(d, oh, ow));
      }
    }
    dx[i] = from_f<T>(sum);
  }
}

// Global average pooling: one thread per (n, c), a coalesced walk over H x W.
template <typename T>
__global__ void gap_fwd_kernel(const T* x, T* y, int64_t n, int64_t hw, int64_t c) {
  KILN_GRID_STRIDE(i, n * c) {
    const int64_t b = i / c, ch = i % c;
    const T* xb = x + b * hw * c + ch;
    double acc = 0.0;
    for (int64_t k = 0; k < hw; ++k) acc += to_f(xb[k * c]);
    y[i] = from_f<T>(static_cast<float>(acc / static_cast<double>(hw)));
  }
}

template <typename T>
__global__ void gap_bwd_kernel(const T* dy, T* dx, int64_t n, int64_t hw, int64_t c) {
  const float count = static_cast<float>(hw);
  KILN_GRID_STRIDE(i, n * hw * c) {
    const int64_t ch = i % c, b = i / (hw * c);
    dx[i] = from_f<T>(fdiv(to_f(dy[b * c + ch]), count));
  }
}

// The same in 16-byte pieces where C is a multiple of V: one dy vector broadcast over the H x W
// pixels, 32-bit index arithmetic (vec_fits), the same division per element.
template <typename T>
__global__ void gap_bwd_vec(const T* dy, T* dx, int nvec, int hw_cvec, int cvec, float count) {
  constexpr int V = kVec<T>;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += gridDim.x * blockDim.x) {
    const int b = i / hw_cvec, cv = i % cvec;
    const uint4 r = reinterpret_cast<const uint4*>(dy)[b * cvec + cv];
    const T* e = reinterpret_cast<const T*>(&r);
    uint4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = from_f<T>(fdiv(to_f(e[j]), count));
    reinterpret_cast<uint4*>(dx)[i] = out;
  }
}

PoolDims pool_dims(const Context& ctx, const Node& n, TensorId x, TensorId y) {
  expect_rank(ctx, n, x, 4, "x");
  expect_rank(ctx, n, y, 4, "y");
  expect_float(ctx, n, x, "x");
  expect_same_dtype(ctx, n, x, y);
  const Nhwc xs = nhwc_of(ctx, n, x, "x"), ys = nhwc_of(ctx, n, y, "y");
  const Attrs& a = n.attrs;
  KILN_CHECK(a.kh >= 1 && a.kw >= 1 && a.sh >= 1 && a.sw >= 1 && a.ph >= 0 && a.pw >= 0 &&
                 2 * a.ph <= a.kh && 2 * a.pw <= a.kw,
             Shape, op_name(n.op), " node '", n.label, "': kernel ", a.kh, "x", a.kw, ", stride ",
             a.sh, "x", a.sw, ", padding ", a.ph, "x", a.pw,
             " is not a valid pooling (padding at most half the kernel, as PyTorch)");
  const int64_t p = (xs.h + 2 * a.ph - a.kh) / a.sh + 1, q = (xs.w + 2 * a.pw - a.kw) / a.sw + 1;
  KILN_CHECK(xs.h + 2 * a.ph >= a.kh && xs.w + 2 * a.pw >= a.kw && p == ys.h && q == ys.w &&
                 xs.n == ys.n && xs.c == ys.c,
             Shape, op_name(n.op), " node '", n.label, "': pooling ", a.kh, "x", a.kw, "/", a.sh,
             " pad ", a.ph, " over ", ctx.tensor(x).shape.str(), " gives [", xs.n, ", ", p, ", ", q,
             ", ", xs.c, "], but the output is ", ctx.tensor(y).shape.str());
  return {xs.n, xs.h, xs.w, xs.c, p, q, a.kh, a.kw, a.sh, a.sw, a.ph, a.pw, a.count_include_pad};
}

}  // namespace

#define KILN_POOL_LAUNCH(kernel, count, ...)              \
  KernelPtr k;                                            \
  const unsigned grid = grid_for(ctx, (count), kThreads); \
  KILN_DISPATCH_FLOAT(dt, T, {                            \
    k = make_fn(stream, [=](Context&, cudaStream_t s) {   \
      kernel<T><<<grid, kThreads, 0, s>>>(__VA_ARGS__);   \
      KILN_LAUNCH_CHECK(#kernel);                         \
    });                                                   \
  });                                                     \
  return k

// "x -> y, [argmax]"
KernelPtr make_maxpool_fwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y"), am = out_at(n, 1);
  const PoolDims d = pool_dims(ctx, n, x, y);
  if (am != kNoTensor) expect_argmax(ctx, n, am, y);
  const DType dt = ctx.tensor(x).dtype;
  const void* xp = ctx.ptr(x);
  void* yp = ctx.ptr(y);
  int32_t* ap = ctx.ptr<int32_t>(am);
  PoolDims32 v{};
  if (pool_vec(ctx, d, dt, {xp, yp, ap}, &v)) {
    const int total = static_cast<int>(d.n * d.p * d.q) * v.cv;
    const unsigned grid = grid_for(ctx, total, kThreads);
    return float_launch(dt, stream, "maxpool_fwd (vec)", [=](auto t, cudaStream_t s) {
      using T = decltype(t);
      maxpool_fwd_vec<T><<<grid, kThreads, 0, s>>>(static_cast<const uint4*>(xp),
                                                   static_cast<uint4*>(yp), ap, total, v);
    });
  }
  KILN_POOL_LAUNCH(maxpool_fwd_kernel, d.n * d.p * d.q * d.c, static_cast<const T*>(xp),
                   static_cast<T*>(yp), ap, d);
}

// "dy, argmax -> dx"
KernelPtr make_maxpool_bwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId dy = need_in(n, 0, "dy"), am = need_in(n, 1, "argmax"), dx = need_out(n, 0, "dx");
  const PoolDims d = pool_dims(ctx, n, dx, dy);
  expect_argmax(ctx, n, am, dy);
  const DType dt = ctx.tensor(dy).dtype;
  const void* dyp = ctx.ptr(dy);
  const int32_t* ap = ctx.ptr<int32_t>(am);
  void* dxp = ctx.ptr(dx);
  PoolDims32 v{};
  const bool tiles = d.ph == 0 && d.pw == 0 && d.kh == d.sh && d.kw == d.sw && d.h == d.p * d.sh &&
                     d.w == d.q * d.sw;
  if (tiles && pool_vec(ctx, d, dt, {dyp, ap, dxp}, &v)) {
    const int total = static_cast<int>(d.n * d.p * d.q) * v.cv;
    const unsigned grid = grid_for(ctx, total, kThreads);
    return float_launch(dt, stream, "maxpool_bwd (tiled)", [=](auto t, cudaStream_t s) {
      using T = decltype(t);
      maxpool_bwd_tiled<T><<<grid, kThreads, 0, s>>>(static_cast<const uint4*>(dyp), ap,
                                                     static_cast<uint4*>(dxp), total, v);
    });
  }
  if (pool_vec(ctx, d, dt, {dyp, ap, dxp}, &v)) {
    const int total = static_cast<int>(d.n * d.h * d.w) * v.cv;
    const unsigned grid = grid_for(ctx, total, kThreads);
    return float_launch(dt, stream, "maxpool_bwd (vec)", [=](auto t, cudaStream_t s) {
      using T = decltype(t);
      maxpool_bwd_vec<T><<<grid, kThreads, 0, s>>>(static_cast<const uint4*>(dyp), ap,
                                                   static_cast<uint4*>(dxp), total, v);
    });
  }
  KILN_POOL_LAUNCH(maxpool_bwd_kernel, d.n * d.h * d.w * d.c, static_cast<const T*>(dyp), ap,
                   static_cast<T*>(dxp), d);
}

namespace {

// avgpool_fwd "x -> y" and avgpool_bwd "dy -> dx": one map in and one out, the pooled one being
// y or dy.
KernelPtr avgpool(const Node& n, Context& ctx, int stream, bool backward) {
  reject_accumulate(ctx, n);
  const TensorId in = need_in(n, 0, backward ? "dy" : "x"),
                 out = need_out(n, 0, backward ? "dx" : "y");
  const PoolDims d = backward ? pool_dims(ctx, n, out, in) : pool_dims(ctx, n, in, out);
  const void* ip = ctx.ptr(in);
  void* op = ctx.ptr(out);
  const unsigned grid =
      grid_for(ctx, backward ? d.n * d.h * d.w * d.c : d.n * d.p * d.q * d.c, kThreads);
  return float_launch(ctx.tensor(in).dtype, stream, backward ? "avgpool_bwd" : "avgpool_fwd",
                      [=](auto t, cudaStream_t s) {
                        using T = decltype(t);
                        if (backward) {
                          avgpool_bwd_kernel<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(ip),
                                                                          static_cast<T*>(op), d);
                        } else {
                          avgpool_fwd_kernel<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(ip),
                                                                          static_cast<T*>(op), d);
                        }
                      });
}

}  // namespace

// "x -> y"
KernelPtr make_avgpool_fwd(const Node& n, Context& ctx, int stream) {
  return avgpool(n, ctx, stream, false);
}

// "dy -> dx"
KernelPtr make_avgpool_bwd(const Node& n, Context& ctx, int stream) {
  return avgpool(n, ctx, stream, true);
}

// "x [N,H,W,C] -> y [N,C]"
KernelPtr make_gap_fwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y");
  const DType dt = expect_float(ctx, n, x, "x");
  expect_same_dtype(ctx, n, x, y);
  expect_rank(ctx, n, x, 4, "x");
  const Nhwc s = nhwc_of(ctx, n, x, "x");
  expect_numel(ctx, n, y, s.n * s.c, "y [N, C]");
  const void* xp = ctx.ptr(x);
  void* yp = ctx.ptr(y);
  const int64_t nn = s.n, hw = s.h * s.w, c = s.c;
  KILN_POOL_LAUNCH(gap_fwd_kernel, nn * c, static_cast<const T*>(xp), static_cast<T*>(yp), nn, hw,
                   c);
}

// "dy [N,C] -> dx [N,H,W,C]"
KernelPtr make_gap_bwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId dy = need_in(n, 0, "dy"), dx = need_out(n, 0, "dx");
  const DType dt = expect_float(ctx, n, dy, "dy");
  expect_same_dtype(ctx, n, dy, dx);
  expect_rank(ctx, n, dx, 4, "dx");
  const Nhwc s = nhwc_of(ctx, n, dx, "dx");
  expect_numel(ctx, n, dy, s.n * s.c, "dy [N, C]");
  const void* dyp = ctx.ptr(dy);
  void* dxp = ctx.ptr(dx);
  const int64_t nn = s.n, hw = s.h * s.w, c = s.c;
  // ResNet-50's 51 MB dx: one element a thread with 64-bit division took ~5x its bytes' time.
  const int width = dt == DType::F32 ? 4 : 8;
  if (c % width == 0 && vec_fits(ctx.opts, nn * hw * c, width, {dyp, dxp})) {
    const auto nvec = static_cast<int>(nn * hw * c / width), cvec = static_cast<int>(c / width);
    const int hw_cvec = static_cast<int>(hw) * cvec;
    const unsigned vgrid = grid_for(ctx, nvec, kThreads);
    const auto count = static_cast<float>(hw);
    return float_launch(dt, stream, "gap_bwd (vec)", [=](auto t, cudaStream_t st) {
      using T = decltype(t);
      gap_bwd_vec<T><<<vgrid, kThreads, 0, st>>>(static_cast<const T*>(dyp), static_cast<T*>(dxp),
                                                 nvec, hw_cvec, cvec, count);
    });
  }
  KILN_POOL_LAUNCH(gap_bwd_kernel, nn * hw * c, static_cast<const T*>(dyp), static_cast<T*>(dxp),
                   nn, hw, c);
}

}  // namespace kiln::cuda
