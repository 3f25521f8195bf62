// OpKind and the attributes a node carries. The enum, names and categories come from the
// X-macro in ops.def, so the list exists once.
#pragma once
#include <cstdint>
#include <string>

namespace kiln {

enum class OpCategory : uint8_t { Layer, Region, Fused };

enum class OpKind : uint16_t {
#define KILN_OP(name, category, doc) name,
#include "kiln/graph/ops.def"
#undef KILN_OP
};

inline constexpr int kOpCount = 0
#define KILN_OP(name, category, doc) +1
#include "kiln/graph/ops.def"
#undef KILN_OP
    ;

const char* op_name(OpKind op);
OpCategory op_category(OpKind op);
const char* op_signature(OpKind op);  // the "inputs -> outputs" text of ops.def

// Attributes of a node; each op reads the fields its comment names. One flat struct keeps
// nodes copyable and printable; the fields are grouped by the ops that use them.
struct Attrs {
  // conv_*, maxpool_*, avgpool_*: kernel, stride, padding.
  int kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0;
  bool count_include_pad = true;  // avgpool (PyTorch's default)
  // bn_*: epsilon and running-statistics momentum (PyTorch convention: new = (1-m)*old + m*batch).
  float eps = 1e-5f;
  float bn_momentum = 0.1f;
  // bn_add_relu_fwd with the residual's BatchNorm (gamma2 ...): that BatchNorm's.
  float eps2 = 1e-5f;
  float bn_momentum2 = 0.1f;
  // dropout_*: drop probability; seed mixes with the step counter and element index.
  float p = 0.0f;
  uint64_t seed = 0;
  // fill: the value.
  float value = 0.0f;
  // check_clip: clamp |g| of the *unscaled* gradient to clip (0 = off).
  float clip = 0.0f;
  // grad_norm: the global L2 norm's cap (torch.nn.utils.clip_grad_norm_'s max_norm).
  float max_norm = 0.0f;
  // softmax_ce: label smoothing epsilon in [0, 1).
  float label_smoothing = 0.0f;
  // loss_scale_update: double after this many clean steps (0 = never grow); floor 1.
  int64_t growth_interval = 0;
  // sgd / lars / adamw / ema hyperparameters that do not change during a run (the learning
  // rate does and is a device scalar, so captured graphs never need re-capture).
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  float beta1 = 0.9f, beta2 = 0.999f, adam_eps = 1e-8f;
  float lars_eta = 0.001f;
  float ema_decay = 0.9999f;
  // Whether the op accumulates into its output (y += ...) rather than overwriting it.
  bool accumulate = false;
  // cbr_bwd, cbr_pool_bwd: the first layer computes no input gradient.
  bool first_layer = false;
  // cbr_pool_*: the merged max-pool's window, stride and padding (ops.def). pool_stride 0 means
  // the window (a pool whose windows tile the map, VGG's 2x2 / 2).
  int pool = 0, pool_stride = 0, pool_pad = 0;
  int pool_step() const { return pool_stride ? pool_stride : pool; }
  // Whether the merged pool's windows tile the map (window = stride, no padding): the mask is
  // then one bit per element of z, else one byte per pooled element (ops.def).
  bool pool_tiles() const { return pool_step() == pool && pool_pad == 0; }
  // Data parallel. allreduce: max instead of sum (the overflow flag). allreduce,
  // allgather, bn_*: the ranks the node was compiled for.
  bool reduce_max = false;
  int world = 1;
  // sgd / adamw / lars / grad_norm: factor on the unscaled gradient, 1/world when the gradients
  // were summed over the ranks (folded into the 1/loss_scale multiply; 1 = no change).
  float grad_average = 1.0f;
};

}  // namespace kiln
