// Convolution on the CPU: oneDNN direct convolution over kiln's layouts (features NHWC =
// format_tag::nhwc, weights KRSC = format_tag::ohwi), forward, backward data and backward
// weights (with the bias gradient). Padding is symmetric (PyTorch's), output sizes use the
// floor rule, so padding_r = padding_l always satisfies oneDNN's shape check.
//
// Weights: oneDNN 2.6 has no optimised kernel for ohwi weights -- with them fixed it falls
// back to its reference convolution (ref:any, one to two orders of magnitude slower). So the
// primitives take the weight format they prefer (format_tag::any; blocked, jit/brgconv) and
// the kernel reorders: KRSC weights into that format before the forward and the backward
// data, and the weight gradient from it into KRSC after the backward weights. A reorder
// moves K*R*S*C values, small next to the convolution; the buffers are made at compile time.
#include "backend/cpu/cpu_util.h"

namespace kiln::cpu {

namespace {

using namespace dnnl;

// A convolution node's geometry (conv_geom) with oneDNN's descriptors of it.
struct DnnlConv : ConvGeom {
  dims strides, pad;

  memory::desc x_md() const { return {nchw(x), dt::f32, tag::nhwc}; }
  memory::desc y_md() const { return {nchw(y), dt::f32, tag::nhwc}; }
  dims w_dims() const { return {k, x.c, r, s}; }
  memory::desc w_any() const { return {w_dims(), dt::f32, tag::any}; }  // oneDNN's choice
  memory::desc b_md() const { return {{k}, dt::f32, tag::x}; }
};

DnnlConv dnnl_conv(const Context& ctx, const Node& n, TensorId x, TensorId w, TensorId y) {
  for (TensorId id : {x, w, y}) expect_dtype(ctx, n, id, DType::F32, "tensor");
  DnnlConv g;
  static_cast<ConvGeom&>(g) = conv_geom(ctx, n, x, w, y);
  g.strides = {g.sh, g.sw};
  g.pad = {g.ph, g.pw};
  return g;
}

convolution_forward::primitive_desc fwd_pd(const Context& ctx, const DnnlConv& g, bool bias,
                                           const primitive_attr& attr) {
  const memory::desc no_bias;
  convolution_forward::desc d(prop_kind::forward_training, algorithm::convolution_direct, g.x_md(),
                              g.w_any(), bias ? g.b_md() : no_bias, g.y_md(), g.strides, g.pad,
                              g.pad);
  return convolution_forward::primitive_desc(d, attr, ctx.engine);
}

// The weights (or their gradient) in the primitive's format: kiln's tensor itself when the
// formats agree, else a compile-time buffer plus a reorder to (to_primitive) or from it.
struct WeightsIn {
  memory mem;
  std::vector<DnnlCall> reorders;  // 0 or 1
  std::vector<std::unique_ptr<Buffer>> buffers;
};
WeightsIn weights_for(const Node& n, Context& ctx, const DnnlConv& g, TensorId w,
                      const memory::desc& want, bool to_primitive) {
  WeightsIn r;
  memory user = make_memory(ctx, w, g.w_dims(), tag::ohwi);
  if (want == user.get_desc()) {
    r.mem = user;
    return r;
  }
  auto buf = std::make_unique<Buffer>();
  buf->reserve(want.get_size());
  r.mem = memory(want, ctx.engine, buf->data());
  const memory& from = to_primitive ? user : r.mem;
  const memory& to = to_primitive ? r.mem : user;
  reorder::primitive_desc pd(from, to, user_scratchpad_attr());
  r.reorders.emplace_back(
      n, ctx, reorder(pd), pd,
      std::unordered_map<int, memory>{{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}});
  r.buffers.push_back(std::move(buf));
  return r;
}

// weights reorder (if any), then the convolution; or the convolution, then the gradient's.
KernelPtr sequence(WeightsIn wi, DnnlCall conv, bool reorder_first) {
  std::vector<DnnlCall> calls;
  if (reorder_first) calls.insert(calls.end(), wi.reorders.begin(), wi.reorders.end());
  calls.push_back(std::move(conv));
  if (!reorder_first) calls.insert(calls.end(), wi.reorders.begin(), wi.reorders.end());
  return std::make_unique<DnnlSeqKernel>(std::move(calls), std::move(wi.buffers));
}

}  // namespace

// "x, w, [b] -> y"
KernelPtr make_conv_fwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), w = need_in(n, 1, "w"), b = in_at(n, 2);
  const TensorId y = need_out(n, 0, "y");
  const DnnlConv g = dnnl_conv(ctx, n, x, w, y);
  if (b != kNoTensor) {
    expect_dtype(ctx, n, b, DType::F32, "bias");
    expect_numel(ctx, n, b, g.k, "bias");
  }
  try {
    auto pd = fwd_pd(ctx, g, b != kNoTensor, user_scratchpad_attr());
    WeightsIn wi = weights_for(n, ctx, g, w, pd.weights_desc(), /*to_primitive=*/true);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, make_memory(ctx, x, nchw(g.x), tag::nhwc)},
                                         {DNNL_ARG_WEIGHTS, wi.mem},
                                         {DNNL_ARG_DST, make_memory(ctx, y, nchw(g.y), tag::nhwc)}};
    if (b != kNoTensor) args[DNNL_ARG_BIAS] = make_memory(ctx, b, {g.k}, tag::x);
    DnnlCall conv(n, ctx, convolution_forward(pd), pd, std::move(args));
    return sequence(std::move(wi), std::move(conv), true);
  } catch (const dnnl::error& e) {
    rethrow_dnnl(n, e);
  }
}

// "dy, w -> dx"
KernelPtr make_conv_bwd_data(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId dy = need_in(n, 0, "dy"), w = need_in(n, 1, "w");
  const TensorId dx = need_out(n, 0, "dx");
  const DnnlConv g = dnnl_conv(ctx, n, dx, w, dy);
  try {
    auto hint = fwd_pd(ctx, g, false, primitive_attr());
    convolution_backward_data::desc d(algorithm::convolution_direct, g.x_md(), g.w_any(), g.y_md(),
                                      g.strides, g.pad, g.pad);
    convolution_backward_data::primitive_desc pd(d, user_scratchpad_attr(), ctx.engine, hint);
    WeightsIn wi = weights_for(n, ctx, g, w, pd.weights_desc(), /*to_primitive=*/true);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_DIFF_DST, make_memory(ctx, dy, nchw(g.y), tag::nhwc)},
        {DNNL_ARG_WEIGHTS, wi.mem},
        {DNNL_ARG_DIFF_SRC, make_memory(ctx, dx, nchw(g.x), tag::nhwc)}};
    DnnlCall conv(n, ctx, convolution_backward_data(pd), pd, std::move(args));
    return sequence(std::move(wi), std::move(conv), true);
  } catch (const dnnl::error& e) {
    rethrow_dnnl(n, e);
  }
}

// "x, dy -> dw, [db]"
KernelPtr make_conv_bwd_weight(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy");
  const TensorId dw = need_out(n, 0, "dw"), db = out_at(n, 1);
  const DnnlConv g = dnnl_conv(ctx, n, x, dw, dy);
  if (db != kNoTensor) {
    expect_dtype(ctx, n, db, DType::F32, "db");
    expect_numel(ctx, n, db, g.k, "db");
  }
  try {
    const bool bias = db != kNoTensor;
    auto hint = fwd_pd(ctx, g, bias, primitive_attr());
    const memory::desc no_bias;
    convolution_backward_weights::desc d(algorithm::convolution_direct, g.x_md(), g.w_any(),
                                         bias ? g.b_md() : no_bias, g.y_md(), g.strides, g.pad,
                                         g.pad);
    convolution_backward_weights::primitive_desc pd(d, user_scratchpad_attr(), ctx.engine, hint);
    WeightsIn wi = weights_for(n, ctx, g, dw, pd.diff_weights_desc(), /*to_primitive=*/false);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, make_memory(ctx, x, nchw(g.x), tag::nhwc)},
        {DNNL_ARG_DIFF_DST, make_memory(ctx, dy, nchw(g.y), tag::nhwc)},
        {DNNL_ARG_DIFF_WEIGHTS, wi.mem}};
    if (bias) args[DNNL_ARG_DIFF_BIAS] = make_memory(ctx, db, {g.k}, tag::x);
    DnnlCall conv(n, ctx, convolution_backward_weights(pd), pd, std::move(args));
    return sequence(std::move(wi), std::move(conv), false);
  } catch (const dnnl::error& e) {
    rethrow_dnnl(n, e);
  }
}

}  // namespace kiln::cpu
