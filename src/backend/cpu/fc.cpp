// Fully connected layers on the CPU: oneDNN inner_product, forward, backward data and
// backward weights (with the bias gradient). x is [N, K] (a flattened NHWC map reads as
// [N, H*W*C]), weights [O, K] (format_tag::oi), y [N, O].
#include "backend/cpu/cpu_util.h"

namespace kiln::cpu {

namespace {

using namespace dnnl;

// A fully connected node's geometry (fc_geom) with oneDNN's descriptors of it.
struct DnnlFc : FcGeom {
  memory::desc x_md() const { return {{n, k}, dt::f32, tag::nc}; }
  memory::desc w_md() const { return {{o, k}, dt::f32, tag::oi}; }
  memory::desc b_md() const { return {{o}, dt::f32, tag::x}; }
  memory::desc y_md() const { return {{n, o}, dt::f32, tag::nc}; }
};

DnnlFc dnnl_fc(const Context& ctx, const Node& n, TensorId x, TensorId w, TensorId y) {
  for (TensorId id : {x, w, y}) expect_dtype(ctx, n, id, DType::F32, "tensor");
  return DnnlFc{fc_geom(ctx, n, x, w, y)};
}

inner_product_forward::primitive_desc fwd_pd(const Context& ctx, const DnnlFc& g, bool bias,
                                             const primitive_attr& attr) {
  const memory::desc no_bias;
  inner_product_forward::desc d(prop_kind::forward_training, g.x_md(), g.w_md(),
                                bias ? g.b_md() : no_bias, g.y_md());
  return inner_product_forward::primitive_desc(d, attr, ctx.engine);
}

}  // namespace

// "x [N,K], w [O,K], [b] -> y [N,O]"
KernelPtr make_fc_fwd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), w = need_in(n, 1, "w"), b = in_at(n, 2),
                 y = need_out(n, 0, "y");
  const DnnlFc g = dnnl_fc(ctx, n, x, w, y);
  if (b != kNoTensor) {
    expect_dtype(ctx, n, b, DType::F32, "bias");
    expect_numel(ctx, n, b, g.o, "bias");
  }
  try {
    auto pd = fwd_pd(ctx, g, b != kNoTensor, user_scratchpad_attr());
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, make_memory(ctx, x, {g.n, g.k}, tag::nc)},
        {DNNL_ARG_WEIGHTS, make_memory(ctx, w, {g.o, g.k}, tag::oi)},
        {DNNL_ARG_DST, make_memory(ctx, y, {g.n, g.o}, tag::nc)}};
    if (b != kNoTensor) args[DNNL_ARG_BIAS] = make_memory(ctx, b, {g.o}, tag::x);
    return std::make_unique<DnnlKernel>(
        DnnlCall(n, ctx, inner_product_forward(pd), pd, std::move(args)));
  } catch (const dnnl::error& e) {
    rethrow_dnnl(n, e);
  }
}

// "dy, w -> dx"
KernelPtr make_fc_bwd_data(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId dy = need_in(n, 0, "dy"), w = need_in(n, 1, "w"), dx = need_out(n, 0, "dx");
  const DnnlFc g = dnnl_fc(ctx, n, dx, w, dy);
  try {
    auto hint = fwd_pd(ctx, g, false, primitive_attr());
    inner_product_backward_data::desc d(g.x_md(), g.w_md(), g.y_md());
    inner_product_backward_data::primitive_desc pd(d, user_scratchpad_attr(), ctx.engine, hint);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_DIFF_DST, make_memory(ctx, dy, {g.n, g.o}, tag::nc)},
        {DNNL_ARG_WEIGHTS, make_memory(ctx, w, {g.o, g.k}, tag::oi)},
        {DNNL_ARG_DIFF_SRC, make_memory(ctx, dx, {g.n, g.k}, tag::nc)}};
    return std::make_unique<DnnlKernel>(
        DnnlCall(n, ctx, inner_product_backward_data(pd), pd, std::move(args)));
  } catch (const dnnl::error& e) {
    rethrow_dnnl(n, e);
  }
}

// "x, dy -> dw (f32), [db (f32)]"
KernelPtr make_fc_bwd_weight(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy");
  const TensorId dw = need_out(n, 0, "dw"), db = out_at(n, 1);
  const DnnlFc g = dnnl_fc(ctx, n, x, dw, dy);
  if (db != kNoTensor) {
    expect_dtype(ctx, n, db, DType::F32, "db");
    expect_numel(ctx, n, db, g.o, "db");
  }
  try {
    const bool bias = db != kNoTensor;
    auto hint = fwd_pd(ctx, g, bias, primitive_attr());
    const memory::desc no_bias;
    inner_product_backward_weights::desc d(g.x_md(), g.w_md(), bias ? g.b_md() : no_bias, g.y_md());
    inner_product_backward_weights::primitive_desc pd(d, user_scratchpad_attr(), ctx.engine, hint);
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, make_memory(ctx, x, {g.n, g.k}, tag::nc)},
        {DNNL_ARG_DIFF_DST, make_memory(ctx, dy, {g.n, g.o}, tag::nc)},
        {DNNL_ARG_DIFF_WEIGHTS, make_memory(ctx, dw, {g.o, g.k}, tag::oi)}};
    if (bias) args[DNNL_ARG_DIFF_BIAS] = make_memory(ctx, db, {g.o}, tag::x);
    return std::make_unique<DnnlKernel>(
        DnnlCall(n, ctx, inner_product_backward_weights(pd), pd, std::move(args)));
  } catch (const dnnl::error& e) {
    rethrow_dnnl(n, e);
  }
}

}  // namespace kiln::cpu
