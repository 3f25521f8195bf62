// Program: what the Compiler hands the Executor. Tensors (placed by the MemoryPlan),
// parameters and buffers with their torchvision names, and the phases of the training
// step and of evaluation, each a list of nodes (op + tensors + attributes).
#pragma once
#include <array>
#include <string>
#include <vector>

#include "kiln/graph/memory_plan.h"
#include "kiln/graph/op.h"
#include "kiln/graph/tensor.h"

namespace kiln {

struct Node {
  OpKind op = OpKind::copy;
  std::vector<TensorId> in;
  std::vector<TensorId> out;
  Attrs attrs;
  std::string label;  // the layer it comes from and the pass, e.g. "layer1.0.conv1 fwd"
  int stream = 0;     // compute stream within the phase (0 = the phase's own stream)
};

// The named phases of a training step (ARCHITECTURE.md, "Phases"), in schedule order.
#define KILN_PHASES(X)                                                               \
  X(transfer, "copy the staged batch (A or B) into the step's input")                \
  X(zero_grad, "zero the gradients that are accumulated rather than written")        \
  X(forward_first, "the first layer's forward")                                      \
  X(forward_backward, "deep forward, loss, deep backward")                           \
  X(backward_first, "the first layer's backward (no input gradient)")                \
  X(grad_cast, "FP16 convolution weight gradients to FP32, one range op")            \
  X(communicate, "gradient all-reduce buckets")                                      \
  X(check_scale, "NaN/Inf check of the gradients (with clipping)")                   \
  X(bn_stats, "BatchNorm statistics synchronisation")                                \
  X(optimizer, "the fused optimizer over whole regions, then the loss-scale update") \
  X(ema, "EMA of the weights and BatchNorm buffers")                                 \
  X(weight_cast, "FP32 master weights to the FP16 compute copy, one range op")       \
  X(eval_forward, "evaluation forward and loss/accuracy")                            \
  X(init, "after weights are loaded: compute copies and EMA start")

enum class PhaseKind : uint8_t {
#define KILN_PHASE_ENUM(name, doc) name,
  KILN_PHASES(KILN_PHASE_ENUM)
#undef KILN_PHASE_ENUM
};
const char* phase_name(PhaseKind k);
const char* phase_doc(PhaseKind k);

struct Phase {
  PhaseKind kind = PhaseKind::forward_backward;
  std::string name;  // phase_name, plus "_a"/"_b" for the two transfer slots
  int stream = 0;    // 0 compute, 1 update, 2 transfer (see Schedule)
  std::vector<Node> nodes;
};

enum class ParamKind : uint8_t { ConvWeight, FcWeight, BnWeight, BnBias, Bias };
const char* param_kind_name(ParamKind k);

struct ParamDesc {
  std::string name;  // torchvision's: "layer1.0.conv1.weight"
  ParamKind kind = ParamKind::ConvWeight;
  Shape shape;                // kiln's layout: conv KRSC, fc [out, in]
  Shape torch_shape;          // torchvision's: conv OIHW (K, C, R, S), fc [out, in]
  bool decay = true;          // weight decay applies (not to BatchNorm or biases)
  bool compute_copy = false;  // has an FP16 compute copy under AMP (conv and fc weights)
  int64_t slot = 0;           // first element of the slot, the same in every parameter region
  int64_t slot_elems = 0;     // slot length in elements: a multiple of 128 (256 bytes in FP16)
  // An fc layer after flattening an NHWC map reads its input as H,W,C while torchvision
  // reads C,H,W: import/export permutes the weight's columns. {C,H,W}, or zeros.
  std::array<int64_t, 3> fc_input_chw{0, 0, 0};
  // The parameter's tensor in each parameter region (kNoTensor where the region is absent).
  std::array<TensorId, kRegionCount> tensor{};
};

struct BufferDesc {
  std::string name;  // "bn1.running_mean", "bn1.running_var"
  TensorId tensor = kNoTensor;
  // Its EMA (with EMA on), at the same offset of ema_bn_running as `tensor` in bn_running, so
  // one range op averages every buffer as timm's model EMA averages the whole state_dict.
  TensorId ema = kNoTensor;
};

// Tensors that the executor, the trainer and the tests address by role.
struct ProgramIO {
  TensorId input = kNoTensor;                                   // [N,H,W,C] in the feature dtype
  TensorId labels = kNoTensor;                                  // [N] i32
  std::array<TensorId, 2> staged_images{kNoTensor, kNoTensor};  // F32 NHWC in input_a / input_b
  std::array<TensorId, 2> staged_labels{kNoTensor, kNoTensor};
  TensorId logits = kNoTensor;
  TensorId loss = kNoTensor;     // f32 scalar: mean cross-entropy of the batch, unscaled
  TensorId correct = kNoTensor;  // i32[2]: top-1 and top-5 hits in the batch
  TensorId loss_scale = kNoTensor, overflow = kNoTensor, good_steps = kNoTensor;
  TensorId lr = kNoTensor, step = kNoTensor;
  // i32: optimizer steps applied (skipped AMP steps not counted; AdamW's bias correction).
  TensorId optimizer_steps = kNoTensor;
  TensorId clip_coef = kNoTensor;  // f32: grad_norm's factor (when clip_grad_norm > 0)
  // f32[8]: the step's mixup / cutmix (kiln/data/mixup.h's mix_params), written before each
  // step like lr (when CompileOptions::mix).
  TensorId mix = kNoTensor;
};

struct CompileOptions {
  int64_t batch = 32;
  bool amp = false;
  DType amp_dtype = DType::F16;
  // FP32 convolutions and matmuls may use TF32 tensor cores (GPU; --tf32 or KILN_TF32=1).
  // Off by default: FP32 means FP32. PyTorch's cuDNN convolutions allow TF32 by default.
  bool tf32 = false;
  bool memory_reuse = true;  // the Engine sets it from Switches::memory_reuse
  // A BN+add+ReLU backward's dresidual is live from the data gradient before it
  // (memory_plan.cpp); the Engine sets it from Switches::dresidual_from_dgrad.
  bool dresidual_from_dgrad = true;
  // A fused BN+add+ReLU backward whose output gradient has two contributions takes both
  // (bn_add_relu_bwd's dy2) instead of an add node summing them first; set by the Engine
  // from the backend's caps and KILN_FUSE_GRAD_SUM.
  bool fuse_grad_sum = false;
  // cbr_pool_fwd over windows that tile z also writes zp and mp (ops.def); the Engine sets it
  // from Switches::pool_pooled_sums.
  bool pool_pooled_sums = false;
  // Under AMP the optimizer nodes write the compute copy of the weights they update (ops.def's
  // [w16]) and no weight_cast phase follows; the Engine sets it from Switches::fuse_weight_cast.
  bool fuse_weight_cast = false;
  bool ema = false;
  float ema_decay = 0.9999f;
  // Optimizer: "sgd", "adamw", "lars".
  std::string optimizer = "sgd";
  float momentum = 0.9f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  float beta1 = 0.9f, beta2 = 0.999f, adam_eps = 1e-8f, lars_eta = 0.001f;
  // AMP's dynamic loss scale: its start, and how it grows and backs off.
  float initial_loss_scale = 8192.0f;
  int64_t loss_scale_growth_interval = 2000;  // 0 = the scale only falls, as in the source
  float clip_grad = 0.0f;                     // |unscaled gradient| cap; 0 = off
  float clip_grad_norm = 0.0f;                // global L2 norm cap of the gradients; 0 = off
  float label_smoothing = 0.0f;               // softmax-CE target smoothing in [0, 1)
  // The training step mixes its batch (mix_batch in the transfer) and the loss its labels by
  // the step's io.mix (mixup / cutmix); false: neither node nor tensor exists.
  bool mix = false;
  uint64_t dropout_seed = 0;
  // Data parallel: processes that train this program together, each on `batch`
  // samples (see data_parallel.h); 1 = no communication at all.
  int world = 1;
  bool sync_bn = true;  // BatchNorm statistics over the global batch (SyncBN) when world > 1
  // Evaluation only (Engine::eval_variant: evaluation at another input size): the program has
  // the eval / eval_ema schedules and its weight regions, and no training step, gradients,
  // optimizer moments, input slot B or weight initialisation (its init only fills scalars).
  bool eval_only = false;
};

struct Program {
  CompileOptions options;
  std::string model;
  std::vector<DTensor> tensors;
  std::vector<ParamDesc> params;
  std::vector<BufferDesc> buffers;
  MemoryPlan memory;
  ProgramIO io;
  DType feature_dtype = DType::F32;
  int64_t param_elems = 0;   // length of every parameter region, in elements
  int64_t buffer_elems = 0;  // length of bn_running (and ema_bn_running), in elements
  int64_t num_classes = 0;
  std::vector<Phase> train;     // transfer_a, transfer_b, then the step's phases
  std::vector<Phase> eval;      // eval_forward over the model's weights
  std::vector<Phase> eval_ema;  // eval_forward over the EMA weights (when EMA is on)
  std::vector<Phase> init;      // run once after weights are written

  const DTensor& tensor(TensorId id) const { return tensors.at(static_cast<size_t>(id)); }
  const ParamDesc* find_param(const std::string& name) const;
  // Root tensor of a view chain (the one that owns the bytes).
  const DTensor& storage(TensorId id) const;
};

// Checks every tensor of every node: placed, 256-byte aligned, inside its region, the
// dtype its region allows (FP16 only under AMP and vice versa), and views inside their
// base. Throws kiln::Error(Memory) naming the node and the tensor.
void validate_program(const Program& program);

// Human-readable listing for `kiln program MODEL`.
std::string describe_program(const Program& program, bool with_tensors);

}  // namespace kiln
