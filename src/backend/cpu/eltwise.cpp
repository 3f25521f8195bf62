// Elementwise layer ops on the CPU: the ReLU backward through oneDNN eltwise (from the output,
// eltwise_relu_use_dst_for_bwd), and loops for the ReLU forward, SiLU, hardswish, add and
// dropout.
//
// Why the ReLU forward is a loop: oneDNN 2.6's eltwise_relu maps NaN to 0 (checked on this
// version), which would hide a diverged step; PyTorch (clamp_min) and cuDNN with
// CUDNN_PROPAGATE_NAN pass the NaN on, so the loss and the overflow check see it. A
// memory-bound select gains nothing from oneDNN anyway.
//
// Dropout's mask is the counter-based hash of backend/formulas.h, so the CUDA kernel drops the
// same elements: y = keep ? x * (1 / (1 - p)) : 0, mask = keep (u8 0/1). The scale 1/(1-p)
// is one FP32 division, done once (as PyTorch's `scale`). p >= 1 drops everything (y = 0, as
// PyTorch), p <= 0 keeps everything.
#include <cstring>

#include "backend/cpu/cpu_util.h"
#include "backend/formulas.h"

namespace kiln::cpu {

namespace {

using namespace dnnl;

memory::desc flat_md(const Context& ctx, TensorId id) {
  return {{ctx.tensor(id).numel()}, dt::f32, tag::a};
}

eltwise_forward::primitive_desc relu_pd(const Context& ctx, TensorId x, algorithm alg,
                                        const primitive_attr& attr) {
  eltwise_forward::desc d(prop_kind::forward_training, alg, flat_md(ctx, x), 0.0f, 0.0f);
  return eltwise_forward::primitive_desc(d, attr, ctx.engine);
}

}  // namespace

// "x -> y": y = x > 0 ? x : 0, NaN stays NaN (!(x <= 0) is true for NaN), -0 gives +0.
KernelPtr make_relu_fwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y");
  expect_dtype(ctx, n, x, DType::F32, "x");
  expect_dtype(ctx, n, y, DType::F32, "y");
  expect_same_size(ctx, n, x, y);
  const float* xp = ctx.ptr<float>(x);
  float* yp = ctx.ptr<float>(y);
  const int64_t count = ctx.tensor(x).numel();
  return make_loop([=](Context&) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < count; ++i) yp[i] = !(xp[i] <= 0.0f) ? xp[i] : 0.0f;
  });
}

// "y, dy -> dx": dx = y > 0 ? dy : 0 (PyTorch's threshold_backward on the output).
KernelPtr make_relu_bwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId y = need_in(n, 0, "y"), dy = need_in(n, 1, "dy"), dx = need_out(n, 0, "dx");
  for (TensorId id : {y, dy, dx}) expect_dtype(ctx, n, id, DType::F32, "tensor");
  expect_same_size(ctx, n, y, dy);
  expect_same_size(ctx, n, y, dx);
  try {
    auto hint = relu_pd(ctx, y, algorithm::eltwise_relu_use_dst_for_bwd, primitive_attr());
    eltwise_backward::desc d(algorithm::eltwise_relu_use_dst_for_bwd, flat_md(ctx, dy),
                             flat_md(ctx, y), 0.0f, 0.0f);
    eltwise_backward::primitive_desc pd(d, user_scratchpad_attr(), ctx.engine, hint);
    const dims dd{ctx.tensor(y).numel()};
    std::unordered_map<int, memory> args{{DNNL_ARG_DST, make_memory(ctx, y, dd, tag::a)},
                                         {DNNL_ARG_DIFF_DST, make_memory(ctx, dy, dd, tag::a)},
                                         {DNNL_ARG_DIFF_SRC, make_memory(ctx, dx, dd, tag::a)}};
    return std::make_unique<DnnlKernel>(
        DnnlCall(n, ctx, eltwise_backward(pd), pd, std::move(args)));
  } catch (const dnnl::error& e) {
    rethrow_dnnl(n, e);
  }
}

namespace {

// An element-wise "x -> y" whose y = f(x) (formulas.h), and its "x, dy -> dx" = g(x, dy).
template <typename F>
KernelPtr unary_fwd(const Node& n, Context& ctx, F f) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y");
  expect_dtype(ctx, n, x, DType::F32, "x");
  expect_dtype(ctx, n, y, DType::F32, "y");
  expect_same_size(ctx, n, x, y);
  const float* xp = ctx.ptr<float>(x);
  float* yp = ctx.ptr<float>(y);
  const int64_t count = ctx.tensor(x).numel();
  return make_loop([=](Context&) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) yp[i] = f(xp[i]);
  });
}

template <typename G>
KernelPtr unary_bwd(const Node& n, Context& ctx, G g) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), dx = need_out(n, 0, "dx");
  for (TensorId id : {x, dy, dx}) expect_dtype(ctx, n, id, DType::F32, "tensor");
  expect_same_size(ctx, n, x, dy);
  expect_same_size(ctx, n, x, dx);
  const float *xp = ctx.ptr<float>(x), *dyp = ctx.ptr<float>(dy);
  float* dxp = ctx.ptr<float>(dx);
  const int64_t count = ctx.tensor(x).numel();
  return make_loop([=](Context&) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) dxp[i] = g(xp[i], dyp[i]);
  });
}

}  // namespace

KernelPtr make_silu_fwd(const Node& n, Context& ctx) {
  return unary_fwd(n, ctx, [](float x) { return formula::silu(x); });
}
KernelPtr make_silu_bwd(const Node& n, Context& ctx) {
  return unary_bwd(n, ctx, [](float x, float dy) { return formula::silu_grad(x, dy); });
}
KernelPtr make_hardswish_fwd(const Node& n, Context& ctx) {
  return unary_fwd(n, ctx, [](float x) { return formula::hardswish(x); });
}
KernelPtr make_hardswish_bwd(const Node& n, Context& ctx) {
  return unary_bwd(n, ctx, [](float x, float dy) { return formula::hardswish_grad(x, dy); });
}

// "a, b -> y = a + b"; with attrs.accumulate, y += a + b. b may be absent (y = a / y += a).
// Any of the three may alias (in-place residual sums).
KernelPtr make_add(const Node& n, Context& ctx) {
  const TensorId a = need_in(n, 0, "a"), b = in_at(n, 1), y = need_out(n, 0, "y");
  for (TensorId id : {a, b, y}) {
    if (id == kNoTensor) continue;
    expect_dtype(ctx, n, id, DType::F32, "tensor");
    expect_same_size(ctx, n, a, id);
  }
  const float* ap = ctx.ptr<float>(a);
  const float* bp = b != kNoTensor ? ctx.ptr<float>(b) : nullptr;
  float* yp = ctx.ptr<float>(y);
  const int64_t count = ctx.tensor(a).numel();
  const bool acc = n.attrs.accumulate;
  return make_loop([=](Context&) {
    if (bp && acc) {
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < count; ++i) yp[i] += ap[i] + bp[i];
    } else if (bp) {
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < count; ++i) yp[i] = ap[i] + bp[i];
    } else if (acc) {
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < count; ++i) yp[i] += ap[i];
    } else if (yp != ap) {
      std::memmove(yp, ap, static_cast<size_t>(count) * sizeof(float));
    }
  });
}

// "x, step (i32 scalar) -> y, mask (u8)"
KernelPtr make_dropout_fwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), step = need_in(n, 1, "step");
  const TensorId y = need_out(n, 0, "y"), mask = need_out(n, 1, "mask");
  expect_dtype(ctx, n, x, DType::F32, "x");
  expect_dtype(ctx, n, y, DType::F32, "y");
  expect_dtype(ctx, n, mask, DType::U8, "mask");
  expect_same_size(ctx, n, x, y);
  expect_same_size(ctx, n, x, mask);
  expect_scalar(ctx, n, step, "step");
  const float* xp = ctx.ptr<float>(x);
  float* yp = ctx.ptr<float>(y);
  uint8_t* mp = ctx.ptr<uint8_t>(mask);
  const int64_t count = ctx.tensor(x).numel();
  const float p = n.attrs.p;
  const uint64_t seed = n.attrs.seed;
  return make_loop([=](Context& c) {
    const auto s = static_cast<uint32_t>(static_cast<int64_t>(read_scalar(c, step, 0.0)));
    if (p >= 1.0f) {  // everything dropped; 1/(1-p) would be Inf and 0 * Inf NaN
      std::memset(yp, 0, static_cast<size_t>(count) * sizeof(float));
      std::memset(mp, 0, static_cast<size_t>(count));
      return;
    }
    const float scale = 1.0f / (1.0f - p);
    const uint64_t k = formula::dropout_key(seed, s);
    for (int64_t i = 0; i < count; ++i) {
      const bool keep = formula::dropout_keep(k, static_cast<uint64_t>(i), p);
      mp[i] = keep ? 1 : 0;
      yp[i] = keep ? xp[i] * scale : 0.0f;
    }
  });
}

// "dy, mask -> dx": dx = mask ? dy / (1 - p) : 0, with the forward's attrs.p.
KernelPtr make_dropout_bwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId dy = need_in(n, 0, "dy"), mask = need_in(n, 1, "mask"), dx = need_out(n, 0, "dx");
  expect_dtype(ctx, n, dy, DType::F32, "dy");
  expect_dtype(ctx, n, dx, DType::F32, "dx");
  expect_dtype(ctx, n, mask, DType::U8, "mask");
  expect_same_size(ctx, n, dy, dx);
  expect_same_size(ctx, n, dy, mask);
  const float* dyp = ctx.ptr<float>(dy);
  const uint8_t* mp = ctx.ptr<uint8_t>(mask);
  float* dxp = ctx.ptr<float>(dx);
  const int64_t count = ctx.tensor(dy).numel();
  const float p = n.attrs.p;
  return make_loop([=](Context&) {
    const float scale = p >= 1.0f ? 0.0f : 1.0f / (1.0f - p);
    for (int64_t i = 0; i < count; ++i) dxp[i] = mp[i] ? dyp[i] * scale : 0.0f;
  });
}

}  // namespace kiln::cpu
