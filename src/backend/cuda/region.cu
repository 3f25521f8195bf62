// Region ops on the GPU, one grid-stride pass each over a contiguous range (1-D tensors):
// fill, copy, cast, the NaN/Inf check with clipping, and the loss-scale update. Semantics
// are those of src/backend/cpu/region.cpp, bit for bit: the casts round to nearest even
// (__float2half_rn, as kiln's float_to_half), the clamp bound is one FP32 product.
#include "backend/cuda/device_util.cuh"
#include "backend/formulas.h"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void fill_kernel(T* y, int64_t count, T v) {
  KILN_GRID_STRIDE(i, count) y[i] = v;
}

template <typename S, typename D>
__global__ void cast_kernel(const S* x, D* y, int64_t count) {
  KILN_GRID_STRIDE(i, count) y[i] = from_f<D>(to_f(x[i]));
}

// Vectorised f32 -> f16 (the weight cast after every step): 4 elements per thread when the
// range is 16-byte aligned (regions are 256-byte aligned and slots multiples of 128).
__global__ void cast_f32_f16_vec4(const float4* x, __half2* y, int64_t count4) {
  KILN_GRID_STRIDE(i, count4) {
    const float4 v = x[i];
    y[2 * i] = __floats2half2_rn(v.x, v.y);
    y[2 * i + 1] = __floats2half2_rn(v.z, v.w);
  }
}
__global__ void cast_f16_f32_vec4(const __half2* x, float4* y, int64_t count4) {
  KILN_GRID_STRIDE(i, count4) {
    const float2 a = __half22float2(x[2 * i]), b = __half22float2(x[2 * i + 1]);
    y[i] = make_float4(a.x, a.y, b.x, b.y);
  }
}

// Any non-finite g sets *flag; with clip, g is clamped to +-bound in the same pass.
__global__ void check_clip_kernel(const float* g, float* out, int64_t count, float clip,
                                  DevScalar scale, int* flag) {
  const float bound = clip > 0.0f ? fmul(clip, static_cast<float>(load_scalar(scale, 1.0))) : 0.0f;
  bool bad = false;
  KILN_GRID_STRIDE(i, count) {
    const float v = g[i];
    bad |= !isfinite(v);
    if (clip > 0.0f) {
      out[i] = v > bound ? bound : (v < -bound ? -bound : v);
    } else if (out != g) {
      out[i] = v;
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flag, 1);
}

__global__ void check_finish_kernel(const int* flag, DevScalar overflow, bool accumulate) {
  const bool before = accumulate && load_scalar(overflow, 0.0) != 0.0;
  store_scalar(overflow, (*flag != 0 || before) ? 1.0 : 0.0);
}

// The dynamic loss scale's update: formula::loss_scale_next, as the CPU loop.
__global__ void loss_scale_update_kernel(DevScalar overflow, DevScalar scale, DevScalar good,
                                         DevScalar scale_out, DevScalar good_out,
                                         int64_t interval) {
  const formula::LossScale now{load_scalar(scale, 1.0), load_scalar(good, 0.0)};
  const bool skipped = load_scalar(overflow, 0.0) != 0.0;
  const formula::LossScale s = formula::loss_scale_next(now, skipped, interval);
  store_scalar(scale_out, s.scale);
  store_scalar(good_out, s.good_steps);
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

}  // namespace

// "-> y = value", in y's dtype.
KernelPtr make_fill(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId y = need_out(n, 0, "y");
  const DTensor& t = ctx.tensor(y);
  const int64_t count = t.numel();
  const float v = n.attrs.value;
  void* p = ctx.ptr(y);
  const unsigned grid = grid_for(ctx, count, kThreads);
  auto launch = [=](auto typed_v) {
    using T = decltype(typed_v);
    return make_fn(stream, [=](Context&, cudaStream_t s) {
      fill_kernel<T><<<grid, kThreads, 0, s>>>(static_cast<T*>(p), count, typed_v);
      KILN_LAUNCH_CHECK("fill");
    });
  };
  switch (t.dtype) {
    case DType::F32:
      return launch(v);
    case DType::F16:
      return launch(__float2half_rn(v));
    case DType::BF16:
      return launch(__float2bfloat16_rn(v));
    case DType::I32:
      return launch(static_cast<int32_t>(v));
    case DType::I64:
      return launch(static_cast<int64_t>(v));
    case DType::U8:
      return launch(static_cast<uint8_t>(v));
  }
  KILN_FAIL(Internal, "fill node '", n.label, "': unknown dtype");
}

// "x -> y": bytes, same dtype and size.
KernelPtr make_copy(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y");
  const DTensor &tx = ctx.tensor(x), &ty = ctx.tensor(y);
  KILN_CHECK(tx.dtype == ty.dtype && tx.numel() == ty.numel(), InvalidArgument, "copy node '",
             n.label, "': '", tx.name, "' (", dtype_name(tx.dtype), " ", tx.shape.str(), ") and '",
             ty.name, "' (", dtype_name(ty.dtype), " ", ty.shape.str(),
             ") differ; use cast to change the dtype");
  const void* xp = ctx.ptr(x);
  void* yp = ctx.ptr(y);
  const auto bytes = static_cast<size_t>(tx.bytes());
  return make_fn(stream, [=](Context&, cudaStream_t s) {
    if (xp != yp) CUDA_CHECK(cudaMemcpyAsync(yp, xp, bytes, cudaMemcpyDeviceToDevice, s));
  });
}

// "x -> y (f32<->f16/bf16)"
KernelPtr make_cast(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y");
  const DTensor &tx = ctx.tensor(x), &ty = ctx.tensor(y);
  expect_float(ctx, n, x, "x");
  expect_float(ctx, n, y, "y");
  expect_numel(ctx, n, y, tx.numel(), "y");
  const int64_t count = tx.numel();
  const void* xp = ctx.ptr(x);
  void* yp = ctx.ptr(y);
  if (tx.dtype == ty.dtype) {
    const auto bytes = static_cast<size_t>(tx.bytes());
    return make_fn(stream, [=](Context&, cudaStream_t s) {
      if (xp != yp) CUDA_CHECK(cudaMemcpyAsync(yp, xp, bytes, cudaMemcpyDeviceToDevice, s));
    });
  }
  if (count % 4 == 0 && aligned16(xp) && aligned16(yp) &&
      ((tx.dtype == DType::F32 && ty.dtype == DType::F16) ||
       (tx.dtype == DType::F16 && ty.dtype == DType::F32))) {
    const int64_t count4 = count / 4;
    const unsigned grid = grid_for(ctx, count4, kThreads);
    const bool down = tx.dtype == DType::F32;
    return make_fn(stream, [=](Context&, cudaStream_t s) {
      if (down) {
        cast_f32_f16_vec4<<<grid, kThreads, 0, s>>>(static_cast<const float4*>(xp),
                                                    static_cast<__half2*>(yp), count4);
      } else {
        cast_f16_f32_vec4<<<grid, kThreads, 0, s>>>(static_cast<const __half2*>(xp),
                                                    static_cast<float4*>(yp), count4);
      }
      KILN_LAUNCH_CHECK("cast");
    });
  }
  const unsigned grid = grid_for(ctx, count, kThreads);
  KernelPtr k;
  KILN_DISPATCH_FLOAT(tx.dtype, S, {
    KILN_DISPATCH_FLOAT(ty.dtype, D, {
      k = make_fn(stream, [=](Context&, cudaStream_t s) {
        cast_kernel<S, D>
            <<<grid, kThreads, 0, s>>>(static_cast<const S*>(xp), static_cast<D*>(yp), count);
        KILN_LAUNCH_CHECK("cast");
      });
    });
  });
  return k;
}

// "g (f32), loss_scale -> overflow (i32), [g]": see cpu/region.cpp. A flag word in the
// stream's workspace collects the blocks' verdicts; a one-thread kernel writes the scalar
// (so it may be f32, i32 or i64, and accumulate ORs into it).
KernelPtr make_check_clip(const Node& n, Context& ctx, int stream) {
  const TensorId g = need_in(n, 0, "g"), scale = in_at(n, 1);
  const TensorId overflow = need_out(n, 0, "overflow"), gout = out_at(n, 1);
  expect_dtype(ctx, n, g, DType::F32, "g");
  if (gout != kNoTensor) {
    expect_dtype(ctx, n, gout, DType::F32, "g (out)");
    expect_numel(ctx, n, gout, ctx.tensor(g).numel(), "g (out)");
  }
  KILN_CHECK(n.attrs.clip >= 0.0f, InvalidArgument, "check_clip node '", n.label,
             "': clip must be >= 0 (0 = off), is ", n.attrs.clip);
  const DevScalar sc = dev_scalar(ctx, n, scale, "loss_scale");
  const DevScalar ov = dev_scalar(ctx, n, overflow, "overflow");
  const float* gp = ctx.ptr<float>(g);
  float* op = gout != kNoTensor ? ctx.ptr<float>(gout) : ctx.ptr<float>(g);
  const int64_t count = ctx.tensor(g).numel();
  const float clip = n.attrs.clip;
  const bool acc = n.attrs.accumulate;
  ctx.need_workspace(stream, sizeof(int));
  const unsigned grid = grid_for(ctx, count, kThreads);
  return make_fn(stream, [=](Context& c, cudaStream_t s) {
    int* flag = static_cast<int*>(c.streams[static_cast<size_t>(stream)].workspace);
    CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), s));
    if (count > 0) {
      check_clip_kernel<<<grid, kThreads, 0, s>>>(gp, op, count, clip, sc, flag);
      KILN_LAUNCH_CHECK("check_clip");
    }
    check_finish_kernel<<<1, 1, 0, s>>>(flag, ov, acc);
    KILN_LAUNCH_CHECK("check_clip finish");
  });
}

// "overflow, loss_scale, good_steps -> loss_scale, good_steps"
KernelPtr make_loss_scale_update(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId overflow = need_in(n, 0, "overflow"), scale = need_in(n, 1, "loss_scale"),
                 good = need_in(n, 2, "good_steps");
  const TensorId scale_out = out_at(n, 0) != kNoTensor ? out_at(n, 0) : scale;
  const TensorId good_out = out_at(n, 1) != kNoTensor ? out_at(n, 1) : good;
  const DevScalar ov = dev_scalar(ctx, n, overflow, "overflow"),
                  sc = dev_scalar(ctx, n, scale, "loss_scale"),
                  gd = dev_scalar(ctx, n, good, "good_steps"),
                  so = dev_scalar(ctx, n, scale_out, "loss_scale (out)"),
                  go = dev_scalar(ctx, n, good_out, "good_steps (out)");
  const int64_t interval = n.attrs.growth_interval;
  return make_fn(stream, [=](Context&, cudaStream_t s) {
    loss_scale_update_kernel<<<1, 1, 0, s>>>(ov, sc, gd, so, go, interval);
    KILN_LAUNCH_CHECK("loss_scale_update");
  });
}

}  // namespace kiln::cuda
