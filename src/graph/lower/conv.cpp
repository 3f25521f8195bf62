// Convolution: forward, and the weight and data gradients (the data gradient only where the
// input takes one).
#include "graph/lower/lower.h"

namespace kiln::lower {

namespace {

void conv_params(Context& c, const PlanNode& n, std::vector<ParamSpec>& specs) {
  const int64_t ch = c.in_shape(n)[2];
  specs.push_back({n.name + ".weight", ParamKind::ConvWeight, Shape{n.out, n.k, n.k, ch},
                   Shape{n.out, ch, n.k, n.k}});
  if (n.bias) {
    specs.push_back({n.name + ".bias", ParamKind::Bias, Shape{n.out}, Shape{n.out}});
  }
}

void conv_forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
  const TensorId y = c.feature(n.name + ":y" + pass.tag, n.shape);
  std::vector<TensorId> in{f.out.at(n.inputs[0]),
                           c.compute_weight(n.name + ".weight", pass.master)};
  if (n.bias) in.push_back(c.param_in(n.name + ".bias", pass.master));
  pass.nodes.push_back(make_node(OpKind::conv_fwd, in, {y}, window_attrs(n), n.name + " fwd"));
  f.out[n.id] = y;
}

void conv_backward(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                   std::vector<Node>& nodes) {
  const TensorId dy = c.total_grad(n, b, nodes);
  const Region wgrad = c.p.options.amp ? Region::grads_f16 : Region::grads_f32;
  std::vector<TensorId> outs{c.param_in(n.name + ".weight", wgrad)};
  if (n.bias) outs.push_back(c.param_in(n.name + ".bias", Region::grads_f32));
  nodes.push_back(make_node(OpKind::conv_bwd_weight, {f.out.at(n.inputs[0]), dy}, outs,
                            window_attrs(n), n.name + " bwd weight"));
  if (c.needs_grad(n, 0)) {
    nodes.push_back(make_node(OpKind::conv_bwd_data, {dy, c.compute_weight(n.name + ".weight")},
                              {c.new_grad(n, 0, b)}, window_attrs(n), n.name + " bwd data"));
  }
}

}  // namespace

const LayerLowering lower_conv{conv_params, conv_forward, conv_backward};

}  // namespace kiln::lower
