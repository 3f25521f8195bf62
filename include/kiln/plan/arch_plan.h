// ArchPlan: the BluePrint flattened into a DAG of layers with inferred shapes, then
// rewritten by passes: drop identities, append the softmax-cross-entropy head,
// mark the first layer, and — on a backend that has them, under AMP — merge Conv→BN→ReLU
// into CBR, a max-pool that tiles its output into that CBR, and BN→add→ReLU of residual
// blocks. `kiln plan MODEL` prints it.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "kiln/blueprint/blueprint.h"
#include "kiln/core/shape.h"

namespace kiln {

// The plan's ops (layers.def's rows with role Both or Plan): the DSL's layers, the input and
// loss head, and the fused forms the merge passes make (CBR: Conv → BatchNorm → ReLU
// [→ MaxPool]; BnAddReLU: BatchNorm → add → ReLU).
enum class PlanOp {
#define KILN_LAYER(e, name, role, params, window, pointwise) KILN_IN_PLAN_##role(e, )
#include "kiln/blueprint/layers.def"
#undef KILN_LAYER
};
inline constexpr int kPlanOpCount = 0
#define KILN_LAYER(e, name, role, params, window, pointwise) KILN_IN_PLAN_##role(+1)
#include "kiln/blueprint/layers.def"
#undef KILN_LAYER
    ;
const char* plan_op_name(PlanOp op);
bool plan_op_has_params(PlanOp op);  // owns trainable parameters (layers.def's params column)
bool plan_op_has_window(PlanOp op);  // has a kernel, stride and padding

struct PlanNode {
  int id = 0;
  PlanOp op = PlanOp::Identity;
  std::string name;         // path: "layer1.0.conv1"; fused nodes keep each part's name below
  std::vector<int> inputs;  // node ids
  Shape shape;              // output without the batch: {H, W, C} or {F}
  int out = 0, k = 1, stride = 1, pad = 0;
  bool bias = false;
  float eps = 1e-5f, momentum = 0.1f, p = 0.0f;
  bool first_layer = false;   // consumes the input: its backward computes no input gradient
  bool requires_grad = true;  // some parameter lies upstream: a gradient must reach it
  // For merged nodes: the BatchNorm's name (the conv's is `name`).
  std::string bn_name;
  // A CBR with a max-pool merged into it (merge_cbr_pool): the pool's window, stride and
  // padding, and its name; `shape` is then the pooled output, conv_shape() the convolution's
  // (pool_in).
  int pool = 0, pool_stride = 0, pool_pad = 0;
  std::string pool_name;
  Shape pool_in;
  Shape conv_shape() const { return pool ? pool_in : shape; }
  // A BN+add+ReLU whose residual is a BatchNorm's output that feeds it alone (a downsampling
  // block's shortcut, merge_bn_add_relu with backend_fuses_residual_bn): that BatchNorm's name
  // and settings; inputs[1] is then its input.
  std::string res_bn_name;
  float res_eps = 1e-5f, res_momentum = 0.1f;
  bool removed = false;  // dropped by a pass (kept so ids stay stable)
};

struct PlanOptions {
  bool fusion = true;  // KILN_FUSION=0 turns the merge passes off
  bool amp = false;
  bool backend_fuses_cbr = false;
  bool backend_fuses_cbr_pool = false;  // and KILN_FUSE_POOL is not 0
  // Also pools whose windows overlap or are padded (ResNet's stem pool), and
  // KILN_FUSE_OVERLAPPING_POOL is on.
  bool backend_fuses_overlapping_pool = false;
  // BN+add+ReLU also takes its residual's BatchNorm (a downsampling shortcut's), applied on the
  // fly (ops.def's bn_add_relu_fwd with gamma2...), and KILN_FUSE_RESIDUAL_BN is on.
  bool backend_fuses_residual_bn = false;
  bool backend_fuses_bn_add_relu = false;
  bool backend_fuses_fp32 = false;  // merge in FP32 too (the CPU's fused kernels); else AMP only
};

struct ArchPlan {
  std::string model;
  Shape input;  // {H, W, C}
  int num_classes = 0;
  std::vector<PlanNode> nodes;     // topological order; removed nodes stay with removed = true
  std::vector<std::string> notes;  // what each pass did (printed by `kiln plan`)

  std::vector<const PlanNode*> live() const;
  std::vector<int> consumers(int id) const;
};

// Builds the plan and runs every pass. Throws kiln::Error(Shape or Model) naming the layer.
ArchPlan make_plan(const BluePrint& blueprint, const PlanOptions& options = {});

// One pass: a name and a function that rewrites the plan (tested one by one).
struct PlanPass {
  std::string name;
  std::function<void(ArchPlan&, const PlanOptions&)> run;
};
std::vector<PlanPass> default_passes();

// Number of trainable parameters (torchvision's sum of numel over parameters()).
int64_t count_parameters(const ArchPlan& plan);

std::string describe_plan(const ArchPlan& plan);

}  // namespace kiln
