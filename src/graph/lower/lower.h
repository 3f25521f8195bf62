// The lowering of plan nodes into Program nodes. Each plan op (layers.def) has one
// LayerLowering - its parameters, forward and backward side by side - in a file of this
// folder named for its family; the Compiler (compiler.cpp) drives them over the plan and
// builds the phases, the optimizer and the evaluation programs around them. Context is what
// every lowering shares: the Program being built and the helpers that add its tensors.
#pragma once
#include <array>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kiln/graph/program.h"
#include "kiln/plan/arch_plan.h"

namespace kiln::lower {

// A parameter a layer declares; the Compiler lays them out by kind (compiler.cpp).
struct ParamSpec {
  std::string name;
  ParamKind kind;
  Shape shape, torch_shape;
  std::array<int64_t, 3> chw{0, 0, 0};
};

// A range of elements of the parameter regions (parameters are laid out by kind).
struct Range {
  int64_t begin = 0, end = 0;  // elements
  bool empty() const { return end <= begin; }
};

// The tensors one forward pass produced, by plan node: what later layers and the backward read.
struct Forward {
  std::map<int, TensorId> out;                 // plan node → its output tensor
  std::map<int, std::vector<TensorId>> saved;  // what its backward needs (stats, masks, indices)
};

// Gradient contributions per plan node output, summed (add nodes) when the producer needs
// the total.
struct Backward {
  std::map<int, std::vector<TensorId>> parts;
};

// Where one forward pass writes: the training step (batch statistics, dropout, tensors saved
// for the backward) or evaluation, over the master weights or their EMA.
struct Pass {
  std::vector<Node>& nodes;
  bool train = true;
  Region master = Region::params_f32;  // params_f32 or ema_f32
  std::string tag;                     // "" in training, ":eval" / ":eval_ema"
};

class Context {
 public:
  Context(const ArchPlan& plan, Program& program) : plan(plan), p(program) {}

  const ArchPlan& plan;
  Program& p;
  TensorId labels = kNoTensor;  // the labels of the program being built (training or evaluation)

  // ---- tensors ----
  TensorId tensor(const std::string& name, Region region, Shape shape, DType dtype, Layout layout,
                  int64_t offset = -1);
  TensorId view(TensorId of, const std::string& name, Shape shape, Layout layout);
  // A feature map of the step: [N, H, W, C] or [N, F].
  TensorId feature(const std::string& name, const Shape& per_sample);
  TensorId aux(const std::string& name, int64_t elems, DType dtype);
  const PlanNode& input(const PlanNode& n, size_t i = 0) const {
    return plan.nodes[static_cast<size_t>(n.inputs[i])];
  }
  const Shape& in_shape(const PlanNode& n, size_t i = 0) const { return input(n, i).shape; }

  // ---- parameters ----
  // Which regions this program has (moments by optimizer, FP16 copies under AMP, EMA), in
  // which dtype, and a 1-D tensor over a range of one (for the region ops).
  bool has_region(Region r) const;
  DType region_dtype(Region r) const;
  TensorId range_tensor(Region r, Range range, const std::string& what);
  // A BatchNorm's weight and bias, and its running statistics (made at once, as buffers).
  void bn_params(std::vector<ParamSpec>& specs, const std::string& name, int64_t c);
  void index_params();  // after the Compiler has laid the parameters out
  const ParamDesc& param(const std::string& name) const;
  TensorId param_in(const std::string& name, Region r) const {
    return param(name).tensor[static_cast<size_t>(r)];
  }
  // The weight a layer computes with: the FP16 copy under AMP (conv, fc), else the master.
  TensorId compute_weight(const std::string& name, Region master = Region::params_f32) const;
  // A BatchNorm's running mean and variance: the EMA copies for a pass over the EMA weights.
  const std::pair<TensorId, TensorId>& running(const std::string& bn,
                                               Region master = Region::params_f32) const {
    return (master == Region::ema_f32 ? running_ema_ : running_).at(bn);
  }

  // ---- backward ----
  // The gradient at n's output: its contributions summed by add nodes (left as the only part).
  TensorId total_grad(const PlanNode& n, Backward& b, std::vector<Node>& nodes);
  // A new gradient tensor for n's input i, recorded as a contribution to that input.
  TensorId new_grad(const PlanNode& n, size_t i, Backward& b);
  bool needs_grad(const PlanNode& n, size_t i) const { return input(n, i).requires_grad; }

 private:
  std::map<std::string, size_t> param_index_;
  std::map<std::string, std::pair<TensorId, TensorId>> running_, running_ema_;
};

Node make_node(OpKind op, std::vector<TensorId> in, std::vector<TensorId> out, const Attrs& a,
               const std::string& label);
Attrs window_attrs(const PlanNode& n);  // kernel, stride, padding

// One plan op's lowering. params may be null (no parameters); backward runs only for nodes
// that take a gradient (requires_grad) and starts from Context::total_grad, except where a
// layer makes the gradient (the loss) or sums it itself (BN+add+ReLU's dy2).
struct LayerLowering {
  void (*params)(Context& c, const PlanNode& n, std::vector<ParamSpec>& specs);
  void (*forward)(Context& c, const PlanNode& n, Forward& f, Pass& pass);
  void (*backward)(Context& c, const PlanNode& n, const Forward& f, Backward& b,
                   std::vector<Node>& nodes);
};

// Every plan op's lowering, `lower_<name>` of layers.def, defined in this folder's files.
#define KILN_LAYER(e, name, role, params, window, pointwise) \
  KILN_IN_PLAN_##role(extern const LayerLowering lower_##name;)
#include "kiln/blueprint/layers.def"
#undef KILN_LAYER

const LayerLowering& lowering(PlanOp op);

// The training step's optimizer phase over the decayed (conv and fc weights) and the
// undecayed parameter ranges (optimizer.cpp).
Phase optimizer_phase(Context& c, Range decay, Range no_decay);

}  // namespace kiln::lower
