// Pooling: max-pool (its argmax saved for the backward in training), average pool and global
// average pool.
#include "graph/lower/lower.h"

namespace kiln::lower {

namespace {

void maxpool_forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
  const TensorId y = c.feature(n.name + ":y" + pass.tag, n.shape);
  std::vector<TensorId> outs{y};
  if (pass.train) {
    const TensorId idx =
        c.tensor(n.name + ":argmax", Region::aux, c.p.tensor(y).shape, DType::I32, Layout::NHWC);
    outs.push_back(idx);
    f.saved[n.id] = {idx};
  }
  pass.nodes.push_back(make_node(OpKind::maxpool_fwd, {f.out.at(n.inputs[0])}, outs,
                                 window_attrs(n), n.name + " fwd"));
  f.out[n.id] = y;
}

void maxpool_backward(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                      std::vector<Node>& nodes) {
  const TensorId dy = c.total_grad(n, b, nodes);
  if (!c.needs_grad(n, 0)) return;
  nodes.push_back(make_node(OpKind::maxpool_bwd, {dy, f.saved.at(n.id)[0]}, {c.new_grad(n, 0, b)},
                            window_attrs(n), n.name + " bwd"));
}

void avgpool_forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
  const TensorId y = c.feature(n.name + ":y" + pass.tag, n.shape);
  pass.nodes.push_back(make_node(OpKind::avgpool_fwd, {f.out.at(n.inputs[0])}, {y}, window_attrs(n),
                                 n.name + " fwd"));
  f.out[n.id] = y;
}

void avgpool_backward(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                      std::vector<Node>& nodes) {
  const TensorId dy = c.total_grad(n, b, nodes);
  if (!c.needs_grad(n, 0)) return;
  nodes.push_back(make_node(OpKind::avgpool_bwd, {dy}, {c.new_grad(n, 0, b)}, window_attrs(n),
                            n.name + " bwd"));
}

void gap_forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
  const TensorId y = c.feature(n.name + ":y" + pass.tag, n.shape);
  pass.nodes.push_back(
      make_node(OpKind::gap_fwd, {f.out.at(n.inputs[0])}, {y}, {}, n.name + " fwd"));
  f.out[n.id] = y;
}

void gap_backward(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                  std::vector<Node>& nodes) {
  const TensorId dy = c.total_grad(n, b, nodes);
  if (!c.needs_grad(n, 0)) return;
  nodes.push_back(make_node(OpKind::gap_bwd, {dy}, {c.new_grad(n, 0, b)}, {}, n.name + " bwd"));
}

}  // namespace

const LayerLowering lower_maxpool{nullptr, maxpool_forward, maxpool_backward};
const LayerLowering lower_avgpool{nullptr, avgpool_forward, avgpool_backward};
const LayerLowering lower_gap{nullptr, gap_forward, gap_backward};

}  // namespace kiln::lower
