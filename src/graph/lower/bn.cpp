// BatchNorm: batch statistics in training (saved for the backward), running statistics in
// evaluation.
#include "graph/lower/lower.h"

namespace kiln::lower {

namespace {

void bn_params(Context& c, const PlanNode& n, std::vector<ParamSpec>& specs) {
  c.bn_params(specs, n.name, c.in_shape(n)[2]);
}

void bn_forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
  const TensorId y = c.feature(n.name + ":y" + pass.tag, n.shape);
  Attrs a = window_attrs(n);
  a.eps = n.eps;
  a.bn_momentum = n.momentum;
  const auto& [rm, rv] = c.running(n.name, pass.master);
  const TensorId x = f.out.at(n.inputs[0]);
  const TensorId gamma = c.param_in(n.name + ".weight", pass.master);
  const TensorId beta = c.param_in(n.name + ".bias", pass.master);
  if (!pass.train) {
    pass.nodes.push_back(
        make_node(OpKind::bn_fwd_infer, {x, gamma, beta, rm, rv}, {y}, a, n.name + " infer"));
  } else {
    const TensorId saved = c.tensor(n.name + ":saved", Region::bn_saved, Shape{2, n.shape[2]},
                                    DType::F32, Layout::Flat);
    pass.nodes.push_back(
        make_node(OpKind::bn_fwd_train, {x, gamma, beta, rm, rv}, {y, saved}, a, n.name + " fwd"));
    f.saved[n.id] = {saved};
  }
  f.out[n.id] = y;
}

void bn_backward(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                 std::vector<Node>& nodes) {
  const TensorId dy = c.total_grad(n, b, nodes);
  Attrs a;
  a.eps = n.eps;
  const TensorId dx =
      c.needs_grad(n, 0) ? c.new_grad(n, 0, b) : c.feature(n.name + ":dx_unused", c.in_shape(n));
  nodes.push_back(
      make_node(OpKind::bn_bwd,
                {f.out.at(n.inputs[0]), dy, c.param_in(n.name + ".weight", Region::params_f32),
                 f.saved.at(n.id)[0]},
                {dx, c.param_in(n.name + ".weight", Region::grads_f32),
                 c.param_in(n.name + ".bias", Region::grads_f32)},
                a, n.name + " bwd"));
}

}  // namespace

const LayerLowering lower_bn2d{bn_params, bn_forward, bn_backward};

}  // namespace kiln::lower
