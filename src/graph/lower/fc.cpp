// Fully connected layer: forward, and the weight and data gradients.
#include "graph/lower/lower.h"

namespace kiln::lower {

namespace {

void fc_params(Context& c, const PlanNode& n, std::vector<ParamSpec>& specs) {
  const int64_t k = c.in_shape(n)[0];
  ParamSpec w{n.name + ".weight", ParamKind::FcWeight, Shape{n.out, k}, Shape{n.out, k}};
  // After a flattened NHWC map: torchvision's weight reads the map as C,H,W (ParamDesc).
  const PlanNode& src = c.input(n);
  if (src.op == PlanOp::Flatten) {
    const Shape& s = c.in_shape(src);
    if (s[0] * s[1] > 1) w.chw = {s[2], s[0], s[1]};
  }
  specs.push_back(w);
  if (n.bias) {
    specs.push_back({n.name + ".bias", ParamKind::Bias, Shape{n.out}, Shape{n.out}});
  }
}

void fc_forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
  const TensorId y = c.feature(n.name + ":y" + pass.tag, n.shape);
  std::vector<TensorId> in{f.out.at(n.inputs[0]),
                           c.compute_weight(n.name + ".weight", pass.master)};
  if (n.bias) in.push_back(c.param_in(n.name + ".bias", pass.master));
  pass.nodes.push_back(make_node(OpKind::fc_fwd, in, {y}, {}, n.name + " fwd"));
  f.out[n.id] = y;
}

void fc_backward(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                 std::vector<Node>& nodes) {
  const TensorId dy = c.total_grad(n, b, nodes);
  std::vector<TensorId> outs{c.param_in(n.name + ".weight", Region::grads_f32)};
  if (n.bias) outs.push_back(c.param_in(n.name + ".bias", Region::grads_f32));
  nodes.push_back(make_node(OpKind::fc_bwd_weight, {f.out.at(n.inputs[0]), dy}, outs, {},
                            n.name + " bwd weight"));
  if (c.needs_grad(n, 0)) {
    nodes.push_back(make_node(OpKind::fc_bwd_data, {dy, c.compute_weight(n.name + ".weight")},
                              {c.new_grad(n, 0, b)}, {}, n.name + " bwd data"));
  }
}

}  // namespace

const LayerLowering lower_fc{fc_params, fc_forward, fc_backward};

}  // namespace kiln::lower
