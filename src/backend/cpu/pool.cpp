// Pooling on the CPU: average pooling through oneDNN; max pooling and global average
// pooling as plain loops.
//
// Why max pooling is a loop and not oneDNN's pooling_max: the Program carries the argmax as
// an explicit i32 tensor in the aux region, in a format the CUDA kernels share (index
// ih * W + iw of the chosen element in its input HxW plane, PyTorch's `indices`), so that
// the backward is a plain scatter that any backend can run from that tensor. oneDNN's
// workspace is opaque, implementation-defined, and lives outside kiln's memory plan.
// Ties go to the first element in window order (rows, then columns); a NaN wins, as in
// PyTorch (`val > max || isnan(val)`), so NaN propagates to the output and the overflow check.
#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cpu/cpu_util.h"

namespace kiln::cpu {

namespace {

using namespace dnnl;

struct PoolGeom {
  Nhwc x, y;
  dims kernel, strides, pad;
};

PoolGeom pool_geom(const Context& ctx, const Node& n, TensorId x, TensorId y) {
  expect_dtype(ctx, n, x, DType::F32, "x");
  expect_dtype(ctx, n, y, DType::F32, "y");
  expect_rank(ctx, n, x, 4, "x");
  expect_rank(ctx, n, y, 4, "y");
  PoolGeom g;
  g.x = nhwc_of(ctx, n, x, "x");
  g.y = nhwc_of(ctx, n, y, "y");
  const Attrs& a = n.attrs;
  KILN_CHECK(a.kh >= 1 && a.kw >= 1 && a.sh >= 1 && a.sw >= 1 && a.ph >= 0 && a.pw >= 0 &&
                 2 * a.ph <= a.kh && 2 * a.pw <= a.kw,
             Shape, op_name(n.op), " node '", n.label, "': kernel ", a.kh, "x", a.kw, ", stride ",
             a.sh, "x", a.sw, ", padding ", a.ph, "x", a.pw,
             " is not a valid pooling (padding at most half the kernel, as PyTorch)");
  const int64_t p = (g.x.h + 2 * a.ph - a.kh) / a.sh + 1;
  const int64_t q = (g.x.w + 2 * a.pw - a.kw) / a.sw + 1;
  KILN_CHECK(g.x.h + 2 * a.ph >= a.kh && g.x.w + 2 * a.pw >= a.kw && p == g.y.h && q == g.y.w &&
                 g.x.n == g.y.n && g.x.c == g.y.c,
             Shape, op_name(n.op), " node '", n.label, "': pooling ", a.kh, "x", a.kw, "/", a.sh,
             " pad ", a.ph, " over ", ctx.tensor(x).shape.str(), " gives [", g.x.n, ", ", p, ", ",
             q, ", ", g.x.c, "], but the output is ", ctx.tensor(y).shape.str());
  g.kernel = {a.kh, a.kw};
  g.strides = {a.sh, a.sw};
  // Symmetric padding with the floor rule: no window reaches past H + pad, so oneDNN's
  // include-padding divisor (always kh*kw) equals PyTorch's (window clipped to H + pad).
  g.pad = {a.ph, a.pw};
  return g;
}

algorithm avg_algorithm(const Node& n) {
  return n.attrs.count_include_pad ? algorithm::pooling_avg_include_padding
                                   : algorithm::pooling_avg_exclude_padding;
}

pooling_forward::primitive_desc avg_fwd_pd(const Context& ctx, const Node& n, const PoolGeom& g,
                                           const primitive_attr& attr) {
  pooling_forward::desc d(prop_kind::forward_training, avg_algorithm(n),
                          {nchw(g.x), dt::f32, tag::nhwc}, {nchw(g.y), dt::f32, tag::nhwc},
                          g.strides, g.kernel, g.pad, g.pad);
  return pooling_forward::primitive_desc(d, attr, ctx.engine);
}

}  // namespace

// "x -> y, [argmax (i32, index into the input window's HxW plane)]"
KernelPtr make_maxpool_fwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y"), am = out_at(n, 1);
  const PoolGeom g = pool_geom(ctx, n, x, y);
  if (am != kNoTensor) expect_argmax(ctx, n, am, y);
  const float* xp = ctx.ptr<float>(x);
  float* yp = ctx.ptr<float>(y);
  int32_t* ap = am != kNoTensor ? ctx.ptr<int32_t>(am) : nullptr;
  const Attrs a = n.attrs;
  // Branch-free over channels (NHWC: C contiguous) so the compiler vectorises it; batches in
  // parallel on oneDNN's OpenMP pool. NaN wins and stays, as in PyTorch.
  return make_loop([=](Context&) {
    const int64_t H = g.x.h, W = g.x.w, C = g.x.c;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < g.x.n; ++b) {
      const float* xb = xp + b * H * W * C;
      for (int64_t oh = 0; oh < g.y.h; ++oh) {
        const int64_t h0 = oh * a.sh - a.ph;
        const int64_t hs = std::max<int64_t>(h0, 0), he = std::min<int64_t>(h0 + a.kh, H);
        for (int64_t ow = 0; ow < g.y.w; ++ow) {
          const int64_t w0 = ow * a.sw - a.pw;
          const int64_t ws = std::max<int64_t>(w0, 0), we = std::min<int64_t>(w0 + a.kw, W);
          const int64_t o = ((b * g.y.h + oh) * g.y.w + ow) * C;
          float* __restrict best = yp + o;
          const int32_t first = static_cast<int32_t>(hs * W + ws);
          int32_t* __restrict idx = ap ? ap + o : nullptr;
          for (int64_t c = 0; c < C; ++c) best[c] = -std::numeric_limits<float>::infinity();
          if (idx) {
            for (int64_t c = 0; c < C; ++c) idx[c] = first;
          }
          for (int64_t ih = hs; ih < he; ++ih) {
            for (int64_t iw = ws; iw < we; ++iw) {
              const float* __restrict v = xb + (ih * W + iw) * C;
              const auto at = static_cast<int32_t>(ih * W + iw);
              if (idx) {
                for (int64_t c = 0; c < C; ++c) {
                  const bool take = (v[c] > best[c]) | (v[c] != v[c]);
                  best[c] = take ? v[c] : best[c];
                  idx[c] = take ? at : idx[c];
                }
              } else {
                for (int64_t c = 0; c < C; ++c) {
                  const bool take = (v[c] > best[c]) | (v[c] != v[c]);
                  best[c] = take ? v[c] : best[c];
                }
              }
            }
          }
        }
      }
    }
  });
}

KernelPtr make_maxpool_bwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId dy = need_in(n, 0, "dy"), am = need_in(n, 1, "argmax"), dx = need_out(n, 0, "dx");
  const PoolGeom g = pool_geom(ctx, n, dx, dy);
  expect_argmax(ctx, n, am, dy);
  const float* dyp = ctx.ptr<float>(dy);
  const int32_t* ap = ctx.ptr<int32_t>(am);
  float* dxp = ctx.ptr<float>(dx);
  // The argmax comes from maxpool_fwd of the same step, which writes only in-plane indices;
  // an index is clamped rather than checked here (no throw inside a parallel loop), and
  // tests/op checks the forward's indices exactly.
  return make_loop([=](Context&) {
    const int64_t plane = g.x.h * g.x.w, C = g.x.c, P = g.y.h * g.y.w;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < g.x.n; ++b) {
      float* dxb = dxp + b * plane * C;
      std::memset(dxb, 0, static_cast<size_t>(plane * C) * sizeof(float));
      for (int64_t o = 0; o < P; ++o) {
        const int64_t off = (b * P + o) * C;
        for (int64_t c = 0; c < C; ++c) {
          const int64_t i = std::min<int64_t>(std::max<int32_t>(ap[off + c], 0), plane - 1);
          dxb[i * C + c] += dyp[off + c];
        }
      }
    }
  });
}

// "x -> y"
KernelPtr make_avgpool_fwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y");
  const PoolGeom g = pool_geom(ctx, n, x, y);
  try {
    auto pd = avg_fwd_pd(ctx, n, g, user_scratchpad_attr());
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, make_memory(ctx, x, nchw(g.x), tag::nhwc)},
                                         {DNNL_ARG_DST, make_memory(ctx, y, nchw(g.y), tag::nhwc)}};
    return std::make_unique<DnnlKernel>(DnnlCall(n, ctx, pooling_forward(pd), pd, std::move(args)));
  } catch (const dnnl::error& e) {
    rethrow_dnnl(n, e);
  }
}

// "dy -> dx"
KernelPtr make_avgpool_bwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId dy = need_in(n, 0, "dy"), dx = need_out(n, 0, "dx");
  const PoolGeom g = pool_geom(ctx, n, dx, dy);
  try {
    auto hint = avg_fwd_pd(ctx, n, g, primitive_attr());
    pooling_backward::desc d(avg_algorithm(n), {nchw(g.x), dt::f32, tag::nhwc},
                             {nchw(g.y), dt::f32, tag::nhwc}, g.strides, g.kernel, g.pad, g.pad);
    pooling_backward::primitive_desc pd(d, user_scratchpad_attr(), ctx.engine, hint);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_DIFF_DST, make_memory(ctx, dy, nchw(g.y), tag::nhwc)},
        {DNNL_ARG_DIFF_SRC, make_memory(ctx, dx, nchw(g.x), tag::nhwc)}};
    return std::make_unique<DnnlKernel>(
        DnnlCall(n, ctx, pooling_backward(pd), pd, std::move(args)));
  } catch (const dnnl::error& e) {
    rethrow_dnnl(n, e);
  }
}

// "x [N,H,W,C] -> y [N,C]": the mean over H x W, summed in double.
KernelPtr make_gap_fwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y");
  expect_dtype(ctx, n, x, DType::F32, "x");
  expect_dtype(ctx, n, y, DType::F32, "y");
  expect_rank(ctx, n, x, 4, "x");
  const Nhwc s = nhwc_of(ctx, n, x, "x");
  expect_numel(ctx, n, y, s.n * s.c, "y [N, C]");
  const float* xp = ctx.ptr<float>(x);
  float* yp = ctx.ptr<float>(y);
  return make_loop([=, acc = std::vector<double>(static_cast<size_t>(s.c))](Context&) mutable {
    const int64_t hw = s.h * s.w;
    const double inv = 1.0 / static_cast<double>(hw);
    for (int64_t b = 0; b < s.n; ++b) {
      std::fill(acc.begin(), acc.end(), 0.0);
      const float* xb = xp + b * hw * s.c;
      for (int64_t i = 0; i < hw; ++i) {
        for (int64_t c = 0; c < s.c; ++c) acc[static_cast<size_t>(c)] += xb[i * s.c + c];
      }
      for (int64_t c = 0; c < s.c; ++c)
        yp[b * s.c + c] = static_cast<float>(acc[static_cast<size_t>(c)] * inv);
    }
  });
}

// "dy [N,C] -> dx [N,H,W,C]": dx = dy / (H W) at every position.
KernelPtr make_gap_bwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId dy = need_in(n, 0, "dy"), dx = need_out(n, 0, "dx");
  expect_dtype(ctx, n, dy, DType::F32, "dy");
  expect_dtype(ctx, n, dx, DType::F32, "dx");
  expect_rank(ctx, n, dx, 4, "dx");
  const Nhwc s = nhwc_of(ctx, n, dx, "dx");
  expect_numel(ctx, n, dy, s.n * s.c, "dy [N, C]");
  const float* dyp = ctx.ptr<float>(dy);
  float* dxp = ctx.ptr<float>(dx);
  return make_loop([=](Context&) {
    const int64_t hw = s.h * s.w;
    const auto count = static_cast<float>(hw);  // a division, correctly rounded, like PyTorch's
    for (int64_t b = 0; b < s.n; ++b) {
      const float* g = dyp + b * s.c;
      float* d = dxp + b * hw * s.c;
      for (int64_t i = 0; i < hw; ++i) {
        for (int64_t c = 0; c < s.c; ++c) d[i * s.c + c] = g[c] / count;
      }
    }
  });
}

}  // namespace kiln::cpu
