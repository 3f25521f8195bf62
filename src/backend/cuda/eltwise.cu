// Elementwise layer ops on the GPU: ReLU (backward from the output, as PyTorch's
// threshold_backward), SiLU and hardswish (backward from the input), the residual / gradient
// add, and dropout. FP16/BF16 values are
// computed in FP32 and rounded once.
//
// Dropout's mask is the counter-based hash of backend/formulas.h, as the CPU kernel's, so both
// backends drop the same elements: y = keep ? x * (1 / (1 - p)) : 0.
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/float_launch.cuh"
#include "backend/formulas.h"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void relu_fwd_kernel(const T* x, T* y, int64_t count) {
  KILN_GRID_STRIDE(i, count) {
    const float v = to_f(x[i]);
    y[i] = from_f<T>(v > 0.0f ? v : (isnan(v) ? v : 0.0f));
  }
}

// f16 fast path: 8 values per thread through 16-byte accesses.
__global__ void relu_fwd_h8(const uint4* x, uint4* y, int64_t count8) {
  const __half2 zero = __float2half2_rn(0.0f);
  KILN_GRID_STRIDE(i, count8) {
    uint4 v = x[i];
    __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = __hmax2_nan(h[j], zero);
    y[i] = v;
  }
}

template <typename T>
__global__ void relu_bwd_kernel(const T* y, const T* dy, T* dx, int64_t count) {
  KILN_GRID_STRIDE(i, count) dx[i] = to_f(y[i]) > 0.0f ? dy[i] : from_f<T>(0.0f);
}

// 16-byte paths (KILN_VECTOR_KERNELS): V elements per access.
template <typename T>
__global__ void relu_bwd_vec(const T* y, const T* dy, T* dx, int nvec) {
  constexpr int V = kVec<T>;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += gridDim.x * blockDim.x) {
    const uint4 ry = reinterpret_cast<const uint4*>(y)[i],
                rg = reinterpret_cast<const uint4*>(dy)[i];
    const T* ye = reinterpret_cast<const T*>(&ry);
    const T* ge = reinterpret_cast<const T*>(&rg);
    uint4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = to_f(ye[j]) > 0.0f ? ge[j] : from_f<T>(0.0f);
    reinterpret_cast<uint4*>(dx)[i] = out;
  }
}

template <typename T>
__global__ void add_vec(const T* a, const T* b, T* y, int nvec, bool acc) {
  constexpr int V = kVec<T>;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += gridDim.x * blockDim.x) {
    const uint4 ra = reinterpret_cast<const uint4*>(a)[i];
    const uint4 rb = b ? reinterpret_cast<const uint4*>(b)[i] : make_uint4(0, 0, 0, 0);
    const uint4 ry = acc ? reinterpret_cast<const uint4*>(y)[i] : make_uint4(0, 0, 0, 0);
    const T* ae = reinterpret_cast<const T*>(&ra);
    const T* be = reinterpret_cast<const T*>(&rb);
    const T* ye = reinterpret_cast<const T*>(&ry);
    uint4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float v = b ? to_f(ae[j]) + to_f(be[j]) : to_f(ae[j]);
      if (acc) v = to_f(ye[j]) + v;
      o[j] = from_f<T>(v);
    }
    reinterpret_cast<uint4*>(y)[i] = out;
  }
}

template <typename T>
__global__ void add_kernel(const T* a, const T* b, T* y, int64_t count, bool acc) {
  KILN_GRID_STRIDE(i, count) {
    float v = b ? to_f(a[i]) + to_f(b[i]) : to_f(a[i]);
    if (acc) v = to_f(y[i]) + v;
    y[i] = from_f<T>(v);
  }
}

template <typename T>
__global__ void dropout_fwd_kernel(const T* x, T* y, uint8_t* mask, int64_t count, float p,
                                   float scale, uint64_t seed, DevScalar step) {
  const auto s = static_cast<uint32_t>(static_cast<int64_t>(load_scalar(step, 0.0)));
  const uint64_t k = formula::dropout_key(seed, s);
  KILN_GRID_STRIDE(i, count) {
    const bool keep = p < 1.0f && formula::dropout_keep(k, static_cast<uint64_t>(i), p);
    mask[i] = keep ? 1 : 0;
    y[i] = from_f<T>(keep ? fmul(to_f(x[i]), scale) : 0.0f);
  }
}

template <typename T>
__global__ void dropout_bwd_kernel(const T* dy, const uint8_t* mask, T* dx, int64_t count,
                                   float scale) {
  KILN_GRID_STRIDE(i, count) dx[i] = from_f<T>(mask[i] ? fmul(to_f(dy[i]), scale) : 0.0f);
}

// An element-wise y = f(x) and dx = g(x, dy) (formulas.h), computed in FP32.
template <typename T, typename F>
__global__ void unary_fwd_kernel(const T* x, T* y, int64_t count, F f) {
  KILN_GRID_STRIDE(i, count) y[i] = from_f<T>(f(to_f(x[i])));
}

template <typename T, typename G>
__global__ void unary_bwd_kernel(const T* x, const T* dy, T* dx, int64_t count, G g) {
  KILN_GRID_STRIDE(i, count) dx[i] = from_f<T>(g(to_f(x[i]), to_f(dy[i])));
}

struct SiluFwd {
  __device__ float operator()(float x) const { return formula::silu(x); }
};
struct SiluBwd {
  __device__ float operator()(float x, float dy) const { return formula::silu_grad(x, dy); }
};
struct HardswishFwd {
  __device__ float operator()(float x) const { return formula::hardswish(x); }
};
struct HardswishBwd {
  __device__ float operator()(float x, float dy) const { return formula::hardswish_grad(x, dy); }
};

// A forward "x -> y" node: both of one float dtype and size (`in` names the input).
struct MapNode {
  const void* x = nullptr;
  void* y = nullptr;
  DType dt = DType::F32;
  int64_t count = 0;
};
MapNode map_node(const Node& n, const Context& ctx, const char* in) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, in), y = need_out(n, 0, "y");
  MapNode m;
  m.dt = expect_float(ctx, n, x, in);
  expect_same_dtype(ctx, n, x, y);
  expect_same_size(ctx, n, x, y);
  m.count = ctx.tensor(x).numel();
  m.x = ctx.ptr(x);
  m.y = ctx.ptr(y);
  return m;
}

// A backward "x, dy -> dx" node (x: the forward's input or output, named `in`): all three of
// one float dtype and size.
struct GradNode {
  const void *x = nullptr, *dy = nullptr;
  void* dx = nullptr;
  DType dt = DType::F32;
  int64_t count = 0;
};
GradNode grad_node(const Node& n, const Context& ctx, const char* in) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, in), dy = need_in(n, 1, "dy"), dx = need_out(n, 0, "dx");
  GradNode g;
  g.dt = expect_float(ctx, n, x, in);
  expect_same_dtype(ctx, n, x, dy);
  expect_same_dtype(ctx, n, x, dx);
  expect_same_size(ctx, n, x, dy);
  expect_same_size(ctx, n, x, dx);
  g.count = ctx.tensor(x).numel();
  g.x = ctx.ptr(x);
  g.dy = ctx.ptr(dy);
  g.dx = ctx.ptr(dx);
  return g;
}

template <typename F>
KernelPtr unary_fwd(const Node& n, Context& ctx, int stream, const char* what) {
  const MapNode m = map_node(n, ctx, "x");
  const unsigned grid = grid_for(ctx, m.count, kThreads);
  return float_launch(m.dt, stream, what, [=](auto t, cudaStream_t s) {
    using T = decltype(t);
    unary_fwd_kernel<T>
        <<<grid, kThreads, 0, s>>>(static_cast<const T*>(m.x), static_cast<T*>(m.y), m.count, F{});
  });
}

template <typename G>
KernelPtr unary_bwd(const Node& n, Context& ctx, int stream, const char* what) {
  const GradNode g = grad_node(n, ctx, "x");
  const unsigned grid = grid_for(ctx, g.count, kThreads);
  return float_launch(g.dt, stream, what, [=](auto t, cudaStream_t s) {
    using T = decltype(t);
    unary_bwd_kernel<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(g.x),
                                                  static_cast<const T*>(g.dy),
                                                  static_cast<T*>(g.dx), g.count, G{});
  });
}

}  // namespace

KernelPtr make_silu_fwd(const Node& n, Context& ctx, int stream) {
  return unary_fwd<SiluFwd>(n, ctx, stream, "silu_fwd");
}
KernelPtr make_silu_bwd(const Node& n, Context& ctx, int stream) {
  return unary_bwd<SiluBwd>(n, ctx, stream, "silu_bwd");
}
KernelPtr make_hardswish_fwd(const Node& n, Context& ctx, int stream) {
  return unary_fwd<HardswishFwd>(n, ctx, stream, "hardswish_fwd");
}
KernelPtr make_hardswish_bwd(const Node& n, Context& ctx, int stream) {
  return unary_bwd<HardswishBwd>(n, ctx, stream, "hardswish_bwd");
}

// "x -> y"
KernelPtr make_relu_fwd(const Node& n, Context& ctx, int stream) {
  const MapNode m = map_node(n, ctx, "x");
  const void* xp = m.x;
  void* yp = m.y;
  const int64_t count = m.count;
  if (m.dt == DType::F16 && count % 8 == 0 && (reinterpret_cast<uintptr_t>(xp) % 16) == 0 &&
      (reinterpret_cast<uintptr_t>(yp) % 16) == 0) {
    const unsigned grid = grid_for(ctx, count / 8, kThreads);
    return make_fn(stream, [=](Context&, cudaStream_t s) {
      relu_fwd_h8<<<grid, kThreads, 0, s>>>(static_cast<const uint4*>(xp), static_cast<uint4*>(yp),
                                            count / 8);
      KILN_LAUNCH_CHECK("relu_fwd");
    });
  }
  const unsigned grid = grid_for(ctx, count, kThreads);
  return float_launch(m.dt, stream, "relu_fwd", [=](auto t, cudaStream_t s) {
    using T = decltype(t);
    relu_fwd_kernel<T>
        <<<grid, kThreads, 0, s>>>(static_cast<const T*>(xp), static_cast<T*>(yp), count);
  });
}

// "y, dy -> dx": dx = y > 0 ? dy : 0.
KernelPtr make_relu_bwd(const Node& n, Context& ctx, int stream) {
  const GradNode g = grad_node(n, ctx, "y");
  const void *yp = g.x, *dyp = g.dy;
  void* dxp = g.dx;
  const int64_t count = g.count;
  const int width = g.dt == DType::F32 ? 4 : 8;
  if (vec_fits(ctx.opts, count, width, {yp, dyp, dxp})) {
    const auto nvec = static_cast<int>(count / width);
    const unsigned vgrid = grid_for(ctx, nvec, kThreads);
    return float_launch(g.dt, stream, "relu_bwd (vec)", [=](auto t, cudaStream_t s) {
      using T = decltype(t);
      relu_bwd_vec<T><<<vgrid, kThreads, 0, s>>>(
          static_cast<const T*>(yp), static_cast<const T*>(dyp), static_cast<T*>(dxp), nvec);
    });
  }
  const unsigned grid = grid_for(ctx, count, kThreads);
  return float_launch(g.dt, stream, "relu_bwd", [=](auto t, cudaStream_t s) {
    using T = decltype(t);
    relu_bwd_kernel<T><<<grid, kThreads, 0, s>>>(
        static_cast<const T*>(yp), static_cast<const T*>(dyp), static_cast<T*>(dxp), count);
  });
}

// "a, b -> y = a + b"; attrs.accumulate: y += a + b. b may be absent; any may alias.
KernelPtr make_add(const Node& n, Context& ctx, int stream) {
  const TensorId a = need_in(n, 0, "a"), b = in_at(n, 1), y = need_out(n, 0, "y");
  const DType dt = expect_float(ctx, n, a, "a");
  for (TensorId id : {b, y}) {
    if (id == kNoTensor) continue;
    expect_same_dtype(ctx, n, a, id);
    expect_same_size(ctx, n, a, id);
  }
  const int64_t count = ctx.tensor(a).numel();
  const void* ap = ctx.ptr(a);
  const void* bp = ctx.ptr(b);
  void* yp = ctx.ptr(y);
  const bool acc = n.attrs.accumulate;
  const unsigned grid = grid_for(ctx, count, kThreads);
  const size_t bytes = static_cast<size_t>(ctx.tensor(a).bytes());
  KernelPtr k;
  const int width = dt == DType::F32 ? 4 : 8;
  if ((bp || acc) && vec_fits(ctx.opts, count, width, {ap, bp, yp})) {
    const auto nvec = static_cast<int>(count / width);
    const unsigned vgrid = grid_for(ctx, nvec, kThreads);
    return float_launch(dt, stream, "add (vec)", [=](auto t, cudaStream_t s) {
      using T = decltype(t);
      add_vec<T><<<vgrid, kThreads, 0, s>>>(static_cast<const T*>(ap), static_cast<const T*>(bp),
                                            static_cast<T*>(yp), nvec, acc);
    });
  }
  KILN_DISPATCH_FLOAT(dt, T, {
    k = make_fn(stream, [=](Context&, cudaStream_t s) {
      if (!bp && !acc) {
        if (yp != ap) CUDA_CHECK(cudaMemcpyAsync(yp, ap, bytes, cudaMemcpyDeviceToDevice, s));
        return;
      }
      add_kernel<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(ap), static_cast<const T*>(bp),
                                              static_cast<T*>(yp), count, acc);
      KILN_LAUNCH_CHECK("add");
    });
  });
  return k;
}

// "x, step (i32 scalar) -> y, mask (u8)"
KernelPtr make_dropout_fwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), step = need_in(n, 1, "step");
  const TensorId y = need_out(n, 0, "y"), mask = need_out(n, 1, "mask");
  const DType dt = expect_float(ctx, n, x, "x");
  expect_same_dtype(ctx, n, x, y);
  expect_dtype(ctx, n, mask, DType::U8, "mask");
  expect_same_size(ctx, n, x, y);
  expect_same_size(ctx, n, x, mask);
  const DevScalar st = dev_scalar(ctx, n, step, "step");
  const int64_t count = ctx.tensor(x).numel();
  const void* xp = ctx.ptr(x);
  void* yp = ctx.ptr(y);
  auto* mp = ctx.ptr<uint8_t>(mask);
  const float p = n.attrs.p;
  const float scale = p >= 1.0f ? 0.0f : 1.0f / (1.0f - p);
  const uint64_t seed = n.attrs.seed;
  const unsigned grid = grid_for(ctx, count, kThreads);
  return float_launch(dt, stream, "dropout_fwd", [=](auto t, cudaStream_t s) {
    using T = decltype(t);
    dropout_fwd_kernel<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(xp), static_cast<T*>(yp),
                                                    mp, count, p, scale, seed, st);
  });
}

// "dy, mask -> dx": dx = mask ? dy / (1 - p) : 0.
KernelPtr make_dropout_bwd(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId dy = need_in(n, 0, "dy"), mask = need_in(n, 1, "mask"), dx = need_out(n, 0, "dx");
  const DType dt = expect_float(ctx, n, dy, "dy");
  expect_same_dtype(ctx, n, dy, dx);
  expect_dtype(ctx, n, mask, DType::U8, "mask");
  expect_same_size(ctx, n, dy, dx);
  expect_same_size(ctx, n, dy, mask);
  const int64_t count = ctx.tensor(dy).numel();
  const void* dyp = ctx.ptr(dy);
  const auto* mp = ctx.ptr<uint8_t>(mask);
  void* dxp = ctx.ptr(dx);
  const float p = n.attrs.p;
  const float scale = p >= 1.0f ? 0.0f : 1.0f / (1.0f - p);
  const unsigned grid = grid_for(ctx, count, kThreads);
  return float_launch(dt, stream, "dropout_bwd", [=](auto t, cudaStream_t s) {
    using T = decltype(t);
    dropout_bwd_kernel<T><<<grid, kThreads, 0, s>>>(static_cast<const T*>(dyp), mp,
                                                    static_cast<T*>(dxp), count, scale);
  });
}

}  // namespace kiln::cuda
