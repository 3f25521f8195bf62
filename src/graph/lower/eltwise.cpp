// Element-wise layers: those of layers.def's pointwise rows (ReLU), dropout (its mask saved
// for the backward; the identity in evaluation) and the residual add.
#include "graph/lower/lower.h"

namespace kiln::lower {

namespace {

// An element-wise layer of layers.def (a pointwise row): <name>_fwd writes y from x, and
// <name>_bwd the input's gradient from dy and x, or y where the derivative reads the output.
template <OpKind kFwd, OpKind kBwd, bool kBwdReadsY>
struct Pointwise {
  static void forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
    const TensorId y = c.feature(n.name + ":y" + pass.tag, n.shape);
    pass.nodes.push_back(make_node(kFwd, {f.out.at(n.inputs[0])}, {y}, {}, n.name + " fwd"));
    f.out[n.id] = y;
  }
  static void backward(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                       std::vector<Node>& nodes) {
    const TensorId dy = c.total_grad(n, b, nodes);
    if (!c.needs_grad(n, 0)) return;
    const TensorId read = f.out.at(kBwdReadsY ? n.id : n.inputs[0]);
    nodes.push_back(make_node(kBwd, {read, dy}, {c.new_grad(n, 0, b)}, {}, n.name + " bwd"));
  }
};

template <OpKind kFwd, OpKind kBwd, bool kBwdReadsY>
constexpr LayerLowering pointwise_lowering() {
  using P = Pointwise<kFwd, kBwd, kBwdReadsY>;
  return {nullptr, P::forward, P::backward};
}

void dropout_forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
  const TensorId x = f.out.at(n.inputs[0]);
  if (!pass.train) {
    f.out[n.id] = x;
    return;
  }
  const TensorId y = c.feature(n.name + ":y" + pass.tag, n.shape);
  const DTensor yt = c.p.tensor(y);
  const TensorId mask = c.tensor(n.name + ":mask", Region::aux, yt.shape, DType::U8, yt.layout);
  Attrs a;
  a.p = n.p;
  // One stream of masks per layer: the run's seed mixed with the layer's id.
  a.seed = c.p.options.dropout_seed ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(n.id + 1));
  pass.nodes.push_back(
      make_node(OpKind::dropout_fwd, {x, c.p.io.step}, {y, mask}, a, n.name + " fwd"));
  f.saved[n.id] = {mask};
  f.out[n.id] = y;
}

void dropout_backward(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                      std::vector<Node>& nodes) {
  const TensorId dy = c.total_grad(n, b, nodes);
  if (!c.needs_grad(n, 0)) return;
  Attrs a;
  a.p = n.p;
  nodes.push_back(make_node(OpKind::dropout_bwd, {dy, f.saved.at(n.id)[0]}, {c.new_grad(n, 0, b)},
                            a, n.name + " bwd"));
}

void add_forward(Context& c, const PlanNode& n, Forward& f, Pass& pass) {
  const TensorId y = c.feature(n.name + ":y" + pass.tag, n.shape);
  pass.nodes.push_back(make_node(OpKind::add, {f.out.at(n.inputs[0]), f.out.at(n.inputs[1])}, {y},
                                 {}, n.name + " fwd"));
  f.out[n.id] = y;
}

// The gradient of a sum reaches both operands unchanged: views, no copy.
void add_backward(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                  std::vector<Node>& nodes) {
  const TensorId dy = c.total_grad(n, b, nodes);
  for (size_t i = 0; i < 2; ++i) {
    if (!c.needs_grad(n, i)) continue;
    const DTensor g = c.p.tensor(dy);
    b.parts[c.input(n, i).id].push_back(
        c.view(dy, n.name + ":d" + std::to_string(i), g.shape, g.layout));
  }
}

}  // namespace

// The element-wise layers' lowerings, lower_relu, ..., from layers.def.
#define KILN_LAYER(e, name, role, params, window, pointwise) \
  KILN_POINTWISE_##pointwise(                                \
      const LayerLowering lower_##name =                     \
          pointwise_lowering<OpKind::name##_fwd, OpKind::name##_bwd, #pointwise[0] == 'y'>();)
#include "kiln/blueprint/layers.def"
#undef KILN_LAYER

const LayerLowering lower_dropout{nullptr, dropout_forward, dropout_backward};
const LayerLowering lower_add{nullptr, add_forward, add_backward};

}  // namespace kiln::lower
