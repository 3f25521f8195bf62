// The loss head: softmax cross-entropy with top-1/top-5 hits. In training the same node writes
// the logits' gradient, where the backward starts.
#include "graph/lower/lower.h"

namespace kiln::lower {

namespace {

void softmax_ce_forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
  const TensorId x = f.out.at(n.inputs[0]);
  std::vector<TensorId> outs{c.p.io.loss, c.p.io.correct};
  if (pass.train) {
    const TensorId dlogits = c.feature("loss:dlogits", c.in_shape(n));
    outs.push_back(dlogits);
    f.saved[n.id] = {dlogits};
  }
  Attrs a;
  a.label_smoothing = c.p.options.label_smoothing;  // evaluation too, as torchvision's criterion
  std::vector<TensorId> ins{x, c.labels, c.p.io.loss_scale};
  if (pass.train && c.p.io.mix != kNoTensor)
    ins.push_back(c.p.io.mix);  // mixed labels; eval is unmixed
  pass.nodes.push_back(
      make_node(OpKind::softmax_ce, ins, outs, a, pass.train ? "loss fwd+bwd" : "loss eval"));
  if (pass.train) c.p.io.logits = x;
}

void softmax_ce_backward(Context&, const PlanNode& n, const Forward& f, Backward& b,
                         std::vector<Node>&) {
  b.parts[n.inputs[0]].push_back(f.saved.at(n.id)[0]);
}

}  // namespace

const LayerLowering lower_softmax_ce{nullptr, softmax_ce_forward, softmax_ce_backward};

}  // namespace kiln::lower
