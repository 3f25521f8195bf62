// The fused forms the merge passes make (ops.def's Fused ops): Conv→BatchNorm→ReLU (CBR),
// with a max-pool folded in, and BatchNorm→add→ReLU. Training runs the fused ops;
// evaluation runs the convolution, then BatchNorm, [the residual add,] and ReLU in one
// bn_relu_infer pass with the unfused chain's roundings [, then the merged max-pool].
#include "graph/lower/lower.h"

namespace kiln::lower {

namespace {

void cbr_params(Context& c, const PlanNode& n, std::vector<ParamSpec>& specs) {
  lower_conv.params(c, n, specs);
  c.bn_params(specs, n.bn_name, n.out);
}

// A merged max-pool's window, stride and padding (none: pool 0). The stride is left 0 (= the
// window) for a pool that tiles, so that those programs stay as they were.
void set_pool_attrs(const PlanNode& n, Attrs& a) {
  a.pool = n.pool;
  const bool tiles = n.pool_stride == n.pool && n.pool_pad == 0;
  a.pool_stride = n.pool && !tiles ? n.pool_stride : 0;
  a.pool_pad = n.pool && !tiles ? n.pool_pad : 0;
}

Attrs bn_attrs(const PlanNode& n) {
  Attrs a = window_attrs(n);
  a.eps = n.eps;
  a.bn_momentum = n.momentum;
  return a;
}

// Evaluation: bn_relu_infer over x [+ residual], then the merged max-pool as its own node
// (evaluation keeps no argmax).
void bn_relu_infer(Context& c, const PlanNode& n, TensorId x, TensorId residual, Forward& f,
                   Pass& pass) {
  const auto& [rm, rv] = c.running(n.bn_name, pass.master);
  std::vector<TensorId> in{x, c.param_in(n.bn_name + ".weight", pass.master),
                           c.param_in(n.bn_name + ".bias", pass.master), rm, rv};
  if (residual != kNoTensor) in.push_back(residual);
  Attrs a;
  a.eps = n.eps;
  const TensorId y = c.feature(n.name + ":relu" + pass.tag, n.conv_shape());
  pass.nodes.push_back(make_node(OpKind::bn_relu_infer, in, {y}, a, n.name + " bn+relu infer"));
  f.out[n.id] = y;
  if (!n.pool) return;
  PlanNode pool;
  pool.id = n.id;
  pool.op = PlanOp::MaxPool;
  pool.name = n.pool_name;
  pool.shape = n.shape;
  pool.k = n.pool;
  pool.stride = n.pool_stride;
  pool.pad = n.pool_pad;
  pool.inputs = {n.id};
  Forward tmp{{{n.id, y}}, {}};
  lower_maxpool.forward(c, pool, tmp, pass);
  f.out[n.id] = tmp.out.at(n.id);
}

void cbr_forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
  const TensorId x = f.out.at(n.inputs[0]);
  if (!pass.train) {
    PlanNode conv = n;
    conv.op = PlanOp::Conv;
    conv.shape = n.conv_shape();
    Forward tmp{{{n.inputs[0], x}}, {}};
    lower_conv.forward(c, conv, tmp, pass);
    bn_relu_infer(c, n, tmp.out.at(n.id), kNoTensor, f, pass);
    return;
  }
  const TensorId y = c.feature(n.name + ":y" + pass.tag, n.shape);
  Attrs a = bn_attrs(n);
  const auto& [rm, rv] = c.running(n.bn_name);
  const TensorId saved = c.tensor(n.bn_name + ":saved", Region::bn_saved, Shape{2, n.shape[2]},
                                  DType::F32, Layout::Flat);
  // The convolution's output; with a merged max-pool y is the pooled map, and the mask covers z
  // (a bit an element) or, for a pool whose windows overlap, y (a byte an element): ops.def's
  // cbr_pool_fwd.
  const TensorId z = c.feature(n.name + ":z" + pass.tag, n.conv_shape());
  set_pool_attrs(n, a);
  const TensorId mask =
      c.aux(n.name + ":mask",
            n.pool && !a.pool_tiles() ? c.p.tensor(y).numel() : (c.p.tensor(z).numel() + 7) / 8,
            DType::U8);
  std::vector<TensorId> in{x,
                           c.compute_weight(n.name + ".weight", pass.master),
                           c.param_in(n.bn_name + ".weight", pass.master),
                           c.param_in(n.bn_name + ".bias", pass.master),
                           rm,
                           rv};
  // The bias is folded into the running mean (ops.def).
  if (n.bias) in.push_back(c.param_in(n.name + ".bias", pass.master));
  std::vector<TensorId> out{z, y, saved, mask};
  f.saved[n.id] = {saved, mask, z};
  if (n.pool && a.pool_tiles() && c.p.options.pool_pooled_sums) {
    // z where the pool took it and the ReLU's bit there, for the backward's sums (ops.def).
    const TensorId zp = c.feature(n.name + ":zp" + pass.tag, n.shape);
    const TensorId mp = c.aux(n.name + ":mp", (c.p.tensor(y).numel() + 7) / 8, DType::U8);
    out.insert(out.end(), {zp, mp});
    f.saved[n.id].insert(f.saved[n.id].end(), {zp, mp});
  }
  pass.nodes.push_back(make_node(n.pool ? OpKind::cbr_pool_fwd : OpKind::cbr_fwd, in, out, a,
                                 n.name + (n.pool ? " cbr+" + n.pool_name + " fwd" : " cbr fwd")));
  f.out[n.id] = y;
}

void cbr_backward(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                  std::vector<Node>& nodes) {
  const TensorId dy = c.total_grad(n, b, nodes);
  const bool amp = c.p.options.amp;
  Attrs a = window_attrs(n);
  a.eps = n.eps;
  a.first_layer = !c.needs_grad(n, 0);
  const auto& saved = f.saved.at(n.id);
  std::vector<TensorId> outs{
      c.needs_grad(n, 0) ? c.new_grad(n, 0, b) : kNoTensor,
      c.param_in(n.name + ".weight", amp ? Region::grads_f16 : Region::grads_f32),
      c.param_in(n.bn_name + ".weight", Region::grads_f32),
      c.param_in(n.bn_name + ".bias", Region::grads_f32),
      c.feature(n.name + ":dz", n.conv_shape())};
  if (n.bias) outs.push_back(c.param_in(n.name + ".bias", Region::grads_f32));
  set_pool_attrs(n, a);  // dy is then the pooled map's gradient (ops.def's cbr_pool_bwd)
  std::vector<TensorId> in{f.out.at(n.inputs[0]),
                           c.compute_weight(n.name + ".weight"),
                           saved[2],
                           dy,
                           saved[1],
                           c.param_in(n.bn_name + ".weight", Region::params_f32),
                           saved[0]};
  if (saved.size() > 3) in.insert(in.end(), {saved[3], saved[4]});  // zp, mp
  nodes.push_back(make_node(n.pool ? OpKind::cbr_pool_bwd : OpKind::cbr_bwd, in, outs, a,
                            n.name + (n.pool ? " cbr+" + n.pool_name + " bwd" : " cbr bwd")));
}

void bn_add_relu_params(Context& c, const PlanNode& n, std::vector<ParamSpec>& specs) {
  c.bn_params(specs, n.bn_name, c.in_shape(n)[2]);
  if (!n.res_bn_name.empty()) c.bn_params(specs, n.res_bn_name, c.in_shape(n, 1)[2]);
}

// A folded residual BatchNorm (PlanNode::res_bn_name) in evaluation: its inference pass, whose
// output is bn_relu_infer's residual.
TensorId residual_bn_infer(Context& c, const PlanNode& n, TensorId z, Pass& pass) {
  const auto& [rm, rv] = c.running(n.res_bn_name, pass.master);
  Attrs a;
  a.eps = n.res_eps;
  const TensorId r = c.feature(n.res_bn_name + ":y" + pass.tag, c.in_shape(n, 1));
  pass.nodes.push_back(make_node(OpKind::bn_fwd_infer,
                                 {z, c.param_in(n.res_bn_name + ".weight", pass.master),
                                  c.param_in(n.res_bn_name + ".bias", pass.master), rm, rv},
                                 {r}, a, n.res_bn_name + " infer"));
  return r;
}

void bn_add_relu_forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
  const TensorId x = f.out.at(n.inputs[0]);
  const TensorId residual = f.out.at(n.inputs[1]);
  const bool res_bn = !n.res_bn_name.empty();
  if (!pass.train) {
    bn_relu_infer(c, n, x, res_bn ? residual_bn_infer(c, n, residual, pass) : residual, f, pass);
    return;
  }
  const TensorId y = c.feature(n.name + ":y" + pass.tag, n.shape);
  const Attrs a = bn_attrs(n);
  const auto& [rm, rv] = c.running(n.bn_name);
  const TensorId gamma = c.param_in(n.bn_name + ".weight", pass.master);
  const TensorId beta = c.param_in(n.bn_name + ".bias", pass.master);
  const TensorId saved = c.tensor(n.bn_name + ":saved", Region::bn_saved, Shape{2, n.shape[2]},
                                  DType::F32, Layout::Flat);
  const TensorId mask = c.aux(n.name + ":mask", (c.p.tensor(y).numel() + 7) / 8, DType::U8);
  std::vector<TensorId> in{x, gamma, beta, rm, rv, residual};
  std::vector<TensorId> out{y, saved, mask};
  Attrs at = a;
  if (res_bn) {
    // The shortcut's BatchNorm, applied to the residual on the fly (ops.def).
    const auto& [rm2, rv2] = c.running(n.res_bn_name);
    in.insert(in.end(), {c.param_in(n.res_bn_name + ".weight", pass.master),
                         c.param_in(n.res_bn_name + ".bias", pass.master), rm2, rv2});
    out.push_back(c.tensor(n.res_bn_name + ":saved", Region::bn_saved,
                           Shape{2, c.in_shape(n, 1)[2]}, DType::F32, Layout::Flat));
    at.eps2 = n.res_eps;
    at.bn_momentum2 = n.res_momentum;
  }
  pass.nodes.push_back(
      make_node(OpKind::bn_add_relu_fwd, in, out, at,
                n.bn_name + (res_bn ? " + " + n.res_bn_name : "") + " bn+add+relu fwd"));
  f.saved[n.id] = {saved, mask};
  if (res_bn) f.saved[n.id].push_back(out[3]);
  f.out[n.id] = y;
}

void bn_add_relu_backward(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                          std::vector<Node>& nodes) {
  // The block's output feeds two layers: the fused backward sums the two gradient
  // contributions itself (ops.def's dy2), no add node.
  TensorId dy2 = kNoTensor;
  if (c.p.options.fuse_grad_sum && b.parts[n.id].size() == 2) {
    dy2 = b.parts[n.id].back();
    b.parts[n.id].pop_back();
  }
  const TensorId dy = c.total_grad(n, b, nodes);
  Attrs a;
  a.eps = n.eps;
  const auto& saved = f.saved.at(n.id);
  const TensorId dx =
      c.needs_grad(n, 0) ? c.new_grad(n, 0, b) : c.feature(n.name + ":dx_unused", c.in_shape(n, 0));
  // With the shortcut's BatchNorm folded in, dresidual is the gradient at that BatchNorm's
  // output, whose backward follows.
  const bool res_bn = !n.res_bn_name.empty();
  const TensorId dres = res_bn               ? c.feature(n.res_bn_name + ":dy", c.in_shape(n, 1))
                        : c.needs_grad(n, 1) ? c.new_grad(n, 1, b)
                                             : c.feature(n.name + ":dres_unused", c.in_shape(n, 1));
  std::vector<TensorId> ins{f.out.at(n.inputs[0]), dy, saved[1],
                            c.param_in(n.bn_name + ".weight", Region::params_f32), saved[0]};
  if (dy2 != kNoTensor) ins.push_back(dy2);
  nodes.push_back(make_node(OpKind::bn_add_relu_bwd, ins,
                            {dx, dres, c.param_in(n.bn_name + ".weight", Region::grads_f32),
                             c.param_in(n.bn_name + ".bias", Region::grads_f32)},
                            a, n.bn_name + " bn+add+relu bwd"));
  if (!res_bn) return;
  Attrs a2;
  a2.eps = n.res_eps;
  const TensorId dz = c.needs_grad(n, 1)
                          ? c.new_grad(n, 1, b)
                          : c.feature(n.res_bn_name + ":dx_unused", c.in_shape(n, 1));
  nodes.push_back(make_node(OpKind::bn_bwd,
                            {f.out.at(n.inputs[1]), dres,
                             c.param_in(n.res_bn_name + ".weight", Region::params_f32), saved[2]},
                            {dz, c.param_in(n.res_bn_name + ".weight", Region::grads_f32),
                             c.param_in(n.res_bn_name + ".bias", Region::grads_f32)},
                            a2, n.res_bn_name + " bwd"));
}

}  // namespace

const LayerLowering lower_cbr{cbr_params, cbr_forward, cbr_backward};
const LayerLowering lower_bn_add_relu{bn_add_relu_params, bn_add_relu_forward,
                                      bn_add_relu_backward};

}  // namespace kiln::lower
