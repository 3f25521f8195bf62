// Layers that emit no node: the input (the driver places the step's input tensor), the
// identity (dropped by the planner; it has no backward) and flatten, a view both ways.
#include "graph/lower/lower.h"

namespace kiln::lower {

namespace {

void input_forward(Context&, const PlanNode&, Forward&, Pass&) {}

void identity_forward(Context&, const PlanNode& n, Forward& f, Pass&) {
  f.out[n.id] = f.out.at(n.inputs[0]);
}

void flatten_forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
  f.out[n.id] = c.view(f.out.at(n.inputs[0]), n.name + ":y" + pass.tag,
                       Shape{c.p.options.batch, n.shape[0]}, Layout::NC);
}

void flatten_backward(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                      std::vector<Node>& nodes) {
  const TensorId dy = c.total_grad(n, b, nodes);
  if (!c.needs_grad(n, 0)) return;
  const PlanNode& src = c.input(n);
  std::vector<int64_t> d{c.p.options.batch};
  d.insert(d.end(), src.shape.dims.begin(), src.shape.dims.end());
  b.parts[src.id].push_back(c.view(dy, n.name + ":dx", Shape(d), Layout::NHWC));
}

}  // namespace

const LayerLowering lower_input{nullptr, input_forward, nullptr};
const LayerLowering lower_identity{nullptr, identity_forward, nullptr};
const LayerLowering lower_flatten{nullptr, flatten_forward, flatten_backward};

}  // namespace kiln::lower
