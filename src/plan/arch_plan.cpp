// Building the ArchPlan from a BluePrint: the tree walk and shape inference.
#include "kiln/plan/arch_plan.h"

#include <iterator>
#include <sstream>

#include "kiln/core/error.h"

namespace kiln {

namespace {
struct PlanOpInfo {
  const char* name;
  bool params, window;
};
constexpr PlanOpInfo kPlanOps[] = {
#define KILN_LAYER(e, name, role, params, window, pointwise) \
  KILN_IN_PLAN_##role({#name, params, window}, )
#include "kiln/blueprint/layers.def"
#undef KILN_LAYER
};
static_assert(std::size(kPlanOps) == kPlanOpCount, "layers.def and PlanOp disagree");
}  // namespace

const char* plan_op_name(PlanOp op) {
  const auto i = static_cast<size_t>(op);
  return i < std::size(kPlanOps) ? kPlanOps[i].name : "?";
}
bool plan_op_has_params(PlanOp op) {
  return kPlanOps[static_cast<size_t>(op)].params;
}
bool plan_op_has_window(PlanOp op) {
  return kPlanOps[static_cast<size_t>(op)].window;
}

std::vector<const PlanNode*> ArchPlan::live() const {
  std::vector<const PlanNode*> v;
  for (const PlanNode& n : nodes) {
    if (!n.removed) v.push_back(&n);
  }
  return v;
}

std::vector<int> ArchPlan::consumers(int id) const {
  std::vector<int> v;
  for (const PlanNode& n : nodes) {
    if (n.removed) continue;
    for (int i : n.inputs) {
      if (i == id) {
        v.push_back(n.id);
        break;
      }
    }
  }
  return v;
}

namespace {

std::string join(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  if (b.empty()) return a;
  return a + "." + b;
}

class Builder {
 public:
  explicit Builder(ArchPlan& plan) : plan_(plan) {}

  int add(PlanOp op, const std::string& name, std::vector<int> inputs, Shape shape) {
    PlanNode n;
    n.id = static_cast<int>(plan_.nodes.size());
    n.op = op;
    n.name = name;
    n.inputs = std::move(inputs);
    n.shape = std::move(shape);
    plan_.nodes.push_back(n);
    return n.id;
  }
  const Shape& shape(int id) const { return plan_.nodes[static_cast<size_t>(id)].shape; }

  std::string describe(const Layer& l, const std::string& path) const {
    std::ostringstream os;
    os << "layer '" << (path.empty() ? std::string("(root)") : path) << "' ("
       << layer_kind_name(l.kind);
    if (layer_kind_has_window(l.kind)) {
      os << " " << l.k << "x" << l.k << " stride " << l.stride << " pad " << l.pad;
    }
    os << ")";
    return os.str();
  }

  void need_map(const Layer& l, const std::string& path, int x) const {
    KILN_CHECK(shape(x).rank() == 3, Shape, describe(l, path),
               " needs a feature map [H, W, C] but gets ", shape(x).str(),
               "; it must come before flatten/fc/gap");
  }

  // Output size of a sliding window, with the error naming the layer.
  int64_t window(const Layer& l, const std::string& path, int64_t in, const char* axis) const {
    KILN_CHECK(l.k >= 1 && l.stride >= 1 && l.pad >= 0, Shape, describe(l, path),
               ": kernel and stride must be >= 1 and padding >= 0");
    KILN_CHECK(l.k <= in + 2 * l.pad, Shape, describe(l, path), ": kernel ", l.k,
               " is larger than the padded input ", axis, " ", in, " + 2*", l.pad,
               "; use a smaller kernel, more padding, or a larger input");
    return (in + 2 * l.pad - l.k) / l.stride + 1;
  }

  int build(const Layer& l, int x, const std::string& path) {
    switch (l.kind) {
      case LayerKind::Seq: {
        for (size_t i = 0; i < l.children.size(); ++i) {
          const Layer& c = l.children[i];
          const std::string seg =
              c.transparent ? "" : (c.name.empty() ? std::to_string(i) : c.name);
          x = build(c, x, join(path, seg));
        }
        return x;
      }
      case LayerKind::Residual: {
        KILN_CHECK(l.children.size() == 2, Model, describe(l, path),
                   " needs a main branch and a shortcut");
        const Layer& main = l.children[0];
        const Layer& sc = l.children[1];
        const int a = build(main, x, main.transparent ? path : join(path, main.name));
        const int b =
            sc.kind == LayerKind::Identity
                ? x
                : build(sc, x, sc.name.empty() || sc.transparent ? path : join(path, sc.name));
        KILN_CHECK(shape(a) == shape(b), Shape, describe(l, path), ": the main branch gives ",
                   shape(a).str(), " but the shortcut gives ", shape(b).str(),
                   "; give the shortcut a 1x1 conv with the same stride and channels (downsample)");
        const int sum = add(PlanOp::Add, join(path, "add"), {a, b}, shape(a));
        return add(PlanOp::ReLU, join(path, "relu_out"), {sum}, shape(a));
      }
      case LayerKind::Conv: {
        need_map(l, path, x);
        const Shape& s = shape(x);
        KILN_CHECK(s[2] > 0 && l.out > 0, Shape, describe(l, path),
                   ": channel counts must be > 0 (in ", s[2], ", out ", l.out, ")");
        const int64_t h = window(l, path, s[0], "height");
        const int64_t w = window(l, path, s[1], "width");
        const int id = add(PlanOp::Conv, path, {x}, Shape{h, w, l.out});
        auto& n = plan_.nodes[static_cast<size_t>(id)];
        n.out = l.out, n.k = l.k, n.stride = l.stride, n.pad = l.pad, n.bias = l.bias;
        return id;
      }
      case LayerKind::BatchNorm: {
        need_map(l, path, x);
        KILN_CHECK(l.eps > 0, Model, describe(l, path), ": eps must be > 0");
        const int id = add(PlanOp::BatchNorm, path, {x}, shape(x));
        auto& n = plan_.nodes[static_cast<size_t>(id)];
        n.eps = l.eps, n.momentum = l.momentum;
        return id;
      }
      // Element-wise layers (layers.def's pointwise rows): the same-named op, the same shape.
#define KILN_LAYER(e, name, role, params, window, pointwise) \
  KILN_POINTWISE_##pointwise(case LayerKind::e : return add(PlanOp::e, path, {x}, shape(x));)
#include "kiln/blueprint/layers.def"
#undef KILN_LAYER
      case LayerKind::MaxPool:
      case LayerKind::AvgPool: {
        need_map(l, path, x);
        const Shape& s = shape(x);
        KILN_CHECK(l.pad * 2 <= l.k, Shape, describe(l, path), ": padding ", l.pad,
                   " must be at most half the kernel (as in PyTorch)");
        const int64_t h = window(l, path, s[0], "height");
        const int64_t w = window(l, path, s[1], "width");
        const int id = add(l.kind == LayerKind::MaxPool ? PlanOp::MaxPool : PlanOp::AvgPool, path,
                           {x}, Shape{h, w, s[2]});
        auto& n = plan_.nodes[static_cast<size_t>(id)];
        n.k = l.k, n.stride = l.stride, n.pad = l.pad;
        return id;
      }
      case LayerKind::AdaptiveAvgPool: {
        need_map(l, path, x);
        const Shape& s = shape(x);
        KILN_CHECK(l.out > 0, Shape, describe(l, path), ": output size must be > 0");
        if (s[0] == l.out && s[1] == l.out) return add(PlanOp::Identity, path, {x}, s);
        KILN_CHECK(s[0] % l.out == 0 && s[1] == s[0], Shape, describe(l, path), ": cannot pool a ",
                   s[0], "x", s[1], " map to ", l.out, "x", l.out,
                   " with one window size; use an input size whose final map is a multiple of ",
                   l.out);
        const int id = add(PlanOp::AvgPool, path, {x}, Shape{l.out, l.out, s[2]});
        auto& n = plan_.nodes[static_cast<size_t>(id)];
        n.k = n.stride = static_cast<int>(s[0] / l.out);
        return id;
      }
      case LayerKind::GlobalAvgPool: {
        need_map(l, path, x);
        return add(PlanOp::GlobalAvgPool, path, {x}, Shape{shape(x)[2]});
      }
      case LayerKind::Flatten:
        return add(PlanOp::Flatten, path, {x}, Shape{shape(x).numel()});
      case LayerKind::FC: {
        KILN_CHECK(shape(x).rank() == 1, Shape, describe(l, path), " needs a flat input but gets ",
                   shape(x).str(), "; put flatten() or gap() before it");
        KILN_CHECK(l.out > 0 && shape(x)[0] > 0, Shape, describe(l, path),
                   ": feature counts must be > 0");
        const int id = add(PlanOp::FC, path, {x}, Shape{l.out});
        auto& n = plan_.nodes[static_cast<size_t>(id)];
        n.out = l.out, n.bias = l.bias;
        return id;
      }
      case LayerKind::Dropout: {
        KILN_CHECK(l.p >= 0 && l.p < 1, Model, describe(l, path), ": p must be in [0, 1), got ",
                   l.p);
        const int id = add(PlanOp::Dropout, path, {x}, shape(x));
        plan_.nodes[static_cast<size_t>(id)].p = l.p;
        return id;
      }
      case LayerKind::Identity:
        return add(PlanOp::Identity, path, {x}, shape(x));
    }
    KILN_FAIL(Model, describe(l, path), " is not a layer kiln can compile");
  }

 private:
  ArchPlan& plan_;
};

}  // namespace

ArchPlan make_plan(const BluePrint& bp, const PlanOptions& options) {
  KILN_CHECK(bp.input.height > 0 && bp.input.width > 0 && bp.input.channels > 0, Shape, "model '",
             bp.name, "': input ", bp.input.height, "x", bp.input.width, "x", bp.input.channels,
             " must have positive sizes");
  KILN_CHECK(bp.num_classes > 0, Model, "model '", bp.name, "': num_classes must be > 0");
  ArchPlan plan;
  plan.model = bp.name;
  plan.input = Shape{bp.input.height, bp.input.width, bp.input.channels};
  plan.num_classes = bp.num_classes;
  Builder b(plan);
  const int in = b.add(PlanOp::Input, "input", {}, plan.input);
  b.build(bp.root, in, "");
  for (const PlanPass& pass : default_passes()) pass.run(plan, options);
  return plan;
}

int64_t count_parameters(const ArchPlan& plan) {
  int64_t total = 0;
  for (const PlanNode* n : plan.live()) {
    const Shape& in = plan.nodes[static_cast<size_t>(n->inputs.empty() ? 0 : n->inputs[0])].shape;
    switch (n->op) {
      case PlanOp::Conv:
      case PlanOp::CBR:
        total += int64_t{n->out} * n->k * n->k * in[2] + (n->bias ? n->out : 0);
        if (n->op == PlanOp::CBR) total += 2 * n->out;
        break;
      case PlanOp::BatchNorm:
      case PlanOp::BnAddReLU:
        total += 2 * in[2];
        break;
      case PlanOp::FC:
        total += int64_t{n->out} * in[0] + (n->bias ? n->out : 0);
        break;
      default:
        break;
    }
  }
  return total;
}

std::string describe_plan(const ArchPlan& plan) {
  std::ostringstream os;
  os << "plan of " << plan.model << ": input " << plan.input.str() << ", " << plan.num_classes
     << " classes, " << count_parameters(plan) << " parameters\n";
  for (const PlanNode* n : plan.live()) {
    os << "  #" << n->id << " " << plan_op_name(n->op) << " " << n->name;
    if (!n->bn_name.empty()) os << " + " << n->bn_name;
    if (!n->res_bn_name.empty()) os << " + " << n->res_bn_name << " (residual)";
    if (n->pool) {
      os << " + " << n->pool_name << " (max-pool " << n->pool << "x" << n->pool;
      if (n->pool_stride != n->pool || n->pool_pad != 0)
        os << " s" << n->pool_stride << " p" << n->pool_pad;
      os << ")";
    }
    if (plan_op_has_window(n->op)) {
      os << " k" << n->k << " s" << n->stride << " p" << n->pad;
    }
    os << " <- (";
    for (size_t i = 0; i < n->inputs.size(); ++i) os << (i ? ", " : "") << "#" << n->inputs[i];
    os << ") -> " << n->shape.str();
    if (n->first_layer) os << " [first layer: no input gradient]";
    if (!n->requires_grad && n->op != PlanOp::Input) os << " [no gradient]";
    os << "\n";
  }
  for (const std::string& note : plan.notes) os << "  pass: " << note << "\n";
  return os.str();
}

}  // namespace kiln
