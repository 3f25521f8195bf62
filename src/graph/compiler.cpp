// The Compiler: reads the plan once, forward, and writes the Program - parameter slots, the
// phases of the training step, the optimizer, evaluation and initialisation - with each plan
// node lowered by its layer's lowering and the optimizer phase by its own (graph/lower/).
// Layout of the parameter regions: same-kind parameters contiguous, kinds in the order conv
// weights, fc weights, BatchNorm weights, BatchNorm biases, biases - so that "decayed"
// (conv+fc weights), "has an FP16 compute copy" (conv+fc weights) and "gradient written in
// FP16" (conv weights) are each one contiguous range that a single region op covers.
#include "kiln/graph/compiler.h"

#include <algorithm>

#include "graph/lower/lower.h"
#include "kiln/core/error.h"
#include "kiln/graph/data_parallel.h"

namespace kiln {

namespace {

using lower::make_node;
using lower::Range;

constexpr int64_t kSlotAlign = 128;  // elements: 256 bytes in FP16, 512 in FP32

class Compiler {
 public:
  Compiler(const ArchPlan& plan, const CompileOptions& o) : plan_(plan), c_(plan, p_) {
    KILN_CHECK(o.batch > 0, InvalidArgument, "batch size must be > 0, got ", o.batch);
    KILN_CHECK(o.optimizer == "sgd" || o.optimizer == "adamw" || o.optimizer == "lars",
               InvalidArgument, "unknown optimizer '", o.optimizer, "'; use sgd, adamw or lars");
    KILN_CHECK(!o.amp || o.amp_dtype == DType::F16 || o.amp_dtype == DType::BF16, InvalidArgument,
               "AMP dtype must be f16 or bf16");
    p_.options = o;
    p_.model = plan.model;
    p_.num_classes = plan.num_classes;
    p_.feature_dtype = o.amp ? o.amp_dtype : DType::F32;
  }

  Program run() {
    make_params();
    make_scalars_and_inputs();
    if (!p_.options.eval_only) build_train();
    build_eval(p_.eval, /*ema=*/false);
    if (p_.options.ema) build_eval(p_.eval_ema, /*ema=*/true);
    build_init();
    return std::move(p_);
  }

 private:
  // ---- parameters ---------------------------------------------------------------------
  void make_params() {
    std::vector<lower::ParamSpec> specs;
    for (const PlanNode* n : plan_.live()) {
      if (auto params = lower::lowering(n->op).params) params(c_, *n, specs);
    }
    // Kind order, stable within a kind (model order).
    std::stable_sort(
        specs.begin(), specs.end(),
        [](const lower::ParamSpec& a, const lower::ParamSpec& b) { return a.kind < b.kind; });
    int64_t cursor = 0;
    for (const lower::ParamSpec& s : specs) {
      ParamDesc d;
      d.name = s.name;
      d.kind = s.kind;
      d.shape = s.shape;
      d.torch_shape = s.torch_shape;
      d.decay = s.kind == ParamKind::ConvWeight || s.kind == ParamKind::FcWeight;
      d.compute_copy = d.decay;
      d.fc_input_chw = s.chw;
      d.slot = cursor;
      d.slot_elems = align_up(s.shape.numel(), kSlotAlign);
      d.tensor.fill(kNoTensor);
      cursor += d.slot_elems;
      const Range r{d.slot, d.slot + d.slot_elems};
      auto extend = [&](Range& range) { range = range.empty() ? r : Range{range.begin, r.end}; };
      if (d.kind == ParamKind::ConvWeight) extend(conv_range_);
      extend(d.decay ? decay_range_ : no_decay_range_);
      p_.params.push_back(d);
    }
    p_.param_elems = cursor;
    KILN_CHECK(cursor > 0, Model, "model '", plan_.model, "' has no parameters to train");
    // One tensor per parameter in each region that exists.
    for (ParamDesc& d : p_.params) {
      const Layout layout = d.kind == ParamKind::ConvWeight ? Layout::KRSC
                            : d.kind == ParamKind::FcWeight ? Layout::OI
                                                            : Layout::Flat;
      for (int r = 0; r < kRegionCount; ++r) {
        const Region region = static_cast<Region>(r);
        if (!c_.has_region(region)) continue;
        const DType dt = c_.region_dtype(region);
        d.tensor[static_cast<size_t>(r)] =
            c_.tensor(d.name + ":" + region_name(region), region, d.shape, dt, layout,
                      d.slot * static_cast<int64_t>(dtype_size(dt)));
      }
    }
    c_.index_params();
  }

  // The whole of bn_running or ema_bn_running, alignment gaps included (they hold zeros).
  TensorId buffer_range(Region r) {
    return c_.tensor(std::string(region_name(r)) + "[all]", r, Shape{p_.buffer_elems}, DType::F32,
                     Layout::Flat, 0);
  }

  // ---- scalars and inputs -------------------------------------------------------------
  void make_scalars_and_inputs() {
    ProgramIO& io = p_.io;
    auto scalar = [&](const char* name, int64_t n, DType dt) {
      return c_.tensor(name, Region::scalars, Shape{n}, dt, Layout::Flat);
    };
    io.loss = scalar("loss", 1, DType::F32);
    io.correct = scalar("correct", 2, DType::I32);
    io.loss_scale = scalar("loss_scale", 1, DType::F32);
    io.overflow = scalar("overflow", 1, DType::I32);
    io.good_steps = scalar("good_steps", 1, DType::I32);
    io.lr = scalar("lr", 1, DType::F32);
    io.step = scalar("step", 1, DType::I32);
    io.optimizer_steps = scalar("optimizer_steps", 1, DType::I32);
    if (p_.options.clip_grad_norm > 0) io.clip_coef = scalar("clip_coef", 1, DType::F32);
    if (p_.options.mix) io.mix = scalar("mix", 8, DType::F32);
    const Shape& in = plan_.input;
    const int64_t n = p_.options.batch;
    // Evaluation stages into slot A only (Engine::eval_batch).
    const size_t slots = p_.options.eval_only ? 1 : 2;
    for (size_t s = 0; s < slots; ++s) {
      const Region r = s == 0 ? Region::input_a : Region::input_b;
      const std::string tag = s == 0 ? "a" : "b";
      io.staged_images[s] = c_.tensor("staged_images_" + tag, r, Shape{n, in[0], in[1], in[2]},
                                      DType::F32, Layout::NHWC);
      io.staged_labels[s] =
          c_.tensor("staged_labels_" + tag, r, Shape{n}, DType::I32, Layout::Flat);
    }
  }

  // Copy of a staged slot into the step's input and labels (a cast under AMP); with `mix`, the
  // mixup / cutmix of the batch instead, which also copies or casts it.
  std::vector<Node> transfer_nodes(int slot, TensorId input, TensorId labels, bool mix) {
    std::vector<Node> v;
    if (mix) {
      v.push_back(make_node(OpKind::mix_batch,
                            {p_.io.staged_images[static_cast<size_t>(slot)], p_.io.mix}, {input},
                            {}, "input mix"));
      v.push_back(make_node(OpKind::copy, {p_.io.staged_labels[static_cast<size_t>(slot)]},
                            {labels}, {}, "labels"));
      return v;
    }
    auto flat = [&](TensorId t) {
      const DTensor d = p_.tensor(t);
      return c_.view(t, d.name + ":flat", Shape{d.numel()}, Layout::Flat);
    };
    const TensorId img_flat = flat(p_.io.staged_images[static_cast<size_t>(slot)]);
    const TensorId in_flat = flat(input);
    v.push_back(make_node(p_.options.amp ? OpKind::cast : OpKind::copy, {img_flat}, {in_flat}, {},
                          "input"));
    v.push_back(make_node(OpKind::copy, {p_.io.staged_labels[static_cast<size_t>(slot)]}, {labels},
                          {}, "labels"));
    return v;
  }

  // ---- lowering -----------------------------------------------------------------------
  void backward(const PlanNode& n, const lower::Forward& f, lower::Backward& b,
                std::vector<Node>& nodes) {
    if (!n.requires_grad) return;  // the input, and layers with no parameter upstream
    const auto backward = lower::lowering(n.op).backward;
    KILN_CHECK(backward != nullptr, Internal, "no backward for plan op ", plan_op_name(n.op));
    backward(c_, n, f, b, nodes);
  }

  // ---- the training step ----------------------------------------------------------------
  void build_train() {
    const CompileOptions& o = p_.options;
    const TensorId input = c_.feature("input", plan_.input);
    c_.labels = c_.tensor("labels", Region::aux, Shape{o.batch}, DType::I32, Layout::Flat);
    p_.io.input = input;
    p_.io.labels = c_.labels;
    for (int s = 0; s < 2; ++s) {
      p_.train.push_back(Phase{PhaseKind::transfer, s == 0 ? "transfer_a" : "transfer_b", 2,
                               transfer_nodes(s, input, c_.labels, o.mix)});
    }

    lower::Forward f;
    f.out[0] = input;
    Phase first_fwd{PhaseKind::forward_first, "forward_first", 0, {}};
    Phase deep{PhaseKind::forward_backward, "forward_backward", 0, {}};
    Phase first_bwd{PhaseKind::backward_first, "backward_first", 0, {}};
    lower::Pass first_pass{first_fwd.nodes, true, Region::params_f32, ""};
    lower::Pass deep_pass{deep.nodes, true, Region::params_f32, ""};
    const auto live = plan_.live();
    for (const PlanNode* n : live) {
      lower::lowering(n->op).forward(c_, *n, f, n->first_layer ? first_pass : deep_pass);
    }
    lower::Backward b;
    for (auto it = live.rbegin(); it != live.rend(); ++it) {
      backward(**it, f, b, (*it)->first_layer ? first_bwd.nodes : deep.nodes);
    }
    for (Phase* ph : {&first_fwd, &deep, &first_bwd}) {
      if (!ph->nodes.empty()) p_.train.push_back(std::move(*ph));
    }

    // FP16 convolution weight gradients → FP32 (FC and BN gradients are written in FP32).
    if (o.amp && !conv_range_.empty()) {
      Phase ph{PhaseKind::grad_cast, "grad_cast", 0, {}};
      ph.nodes.push_back(make_node(
          OpKind::cast, {c_.range_tensor(Region::grads_f16, conv_range_, "conv")},
          {c_.range_tensor(Region::grads_f32, conv_range_, "conv")}, {}, "conv weight grads"));
      p_.train.push_back(std::move(ph));
    }
    const Range all{0, p_.param_elems};
    if (o.amp || o.clip_grad > 0 || o.clip_grad_norm > 0) {
      Phase ph{PhaseKind::check_scale, "check_scale", 1, {}};
      const TensorId g = c_.range_tensor(Region::grads_f32, all, "all");
      if (o.amp || o.clip_grad > 0) {
        Attrs a;
        a.clip = o.clip_grad;
        ph.nodes.push_back(
            make_node(OpKind::check_clip, {g, p_.io.loss_scale}, {p_.io.overflow, g}, a, "grads"));
      }
      if (o.clip_grad_norm > 0) {  // after the per-element clip, as a script calling both would
        Attrs a;
        a.max_norm = o.clip_grad_norm;
        ph.nodes.push_back(
            make_node(OpKind::grad_norm, {g, p_.io.loss_scale}, {p_.io.clip_coef}, a, "grad norm"));
      }
      p_.train.push_back(std::move(ph));
    }
    p_.train.push_back(lower::optimizer_phase(c_, decay_range_, no_decay_range_));
    // The loss scale changes only after the optimizer has unscaled this step's gradients with
    // the scale they were made with (as GradScaler.update() follows step()): a growth step
    // must not apply half an update.
    if (o.amp) {
      Attrs s;
      s.growth_interval = o.loss_scale_growth_interval;
      p_.train.back().nodes.push_back(
          make_node(OpKind::loss_scale_update, {p_.io.overflow, p_.io.loss_scale, p_.io.good_steps},
                    {p_.io.loss_scale, p_.io.good_steps}, s, "loss scale"));
    }
    if (o.ema) {
      Phase ph{PhaseKind::ema, "ema", 1, {}};
      Attrs a;
      a.ema_decay = o.ema_decay;
      ph.nodes.push_back(
          make_node(OpKind::ema, {c_.range_tensor(Region::params_f32, all, "all"), p_.io.overflow},
                    {c_.range_tensor(Region::ema_f32, all, "all")}, a, "ema"));
      // The BatchNorm running statistics too, with the same decay (timm's ModelEmaV2/V3 average
      // every state_dict entry), so that the EMA weights are evaluated with statistics of their
      // own; num_batches_tracked, an integer, is copied as V3 does (checkpoint.cpp).
      if (p_.buffer_elems > 0) {
        ph.nodes.push_back(make_node(OpKind::ema,
                                     {buffer_range(Region::bn_running), p_.io.overflow},
                                     {buffer_range(Region::ema_bn_running)}, a, "ema bn buffers"));
      }
      if (o.amp && !decay_range_.empty()) {
        ph.nodes.push_back(compute_copy(Region::ema_f32, Region::ema_f16, "ema compute copy"));
      }
      p_.train.push_back(std::move(ph));
    }
    if (o.amp && !decay_range_.empty() && !o.fuse_weight_cast) {  // else the optimizer casts
      Phase ph{PhaseKind::weight_cast, "weight_cast", 1, {}};
      ph.nodes.push_back(compute_copy(Region::params_f32, Region::params_f16, "compute weights"));
      p_.train.push_back(std::move(ph));
    }
  }

  // The cast of the conv and fc weights (the decayed range) to their FP16 compute copy.
  Node compute_copy(Region from, Region to, const std::string& label) {
    return make_node(OpKind::cast, {c_.range_tensor(from, decay_range_, "compute")},
                     {c_.range_tensor(to, decay_range_, "compute")}, {}, label);
  }

  // ---- evaluation and initialisation -----------------------------------------------------
  void build_eval(std::vector<Phase>& out, bool ema) {
    Phase ph{PhaseKind::eval_forward, ema ? "eval_ema_forward" : "eval_forward", 0, {}};
    const TensorId input = c_.feature(ema ? "eval_ema_input" : "eval_input", plan_.input);
    const TensorId train_labels = c_.labels;
    c_.labels = c_.tensor(ema ? "eval_ema_labels" : "eval_labels", Region::aux,
                          Shape{p_.options.batch}, DType::I32, Layout::Flat);
    ph.nodes = transfer_nodes(0, input, c_.labels, false);  // evaluation is unmixed
    lower::Forward f;
    f.out[0] = input;
    lower::Pass pass{ph.nodes, false, ema ? Region::ema_f32 : Region::params_f32,
                     ema ? ":eval_ema" : ":eval"};
    for (const PlanNode* n : plan_.live()) lower::lowering(n->op).forward(c_, *n, f, pass);
    c_.labels = train_labels;
    out.push_back(std::move(ph));
  }

  void build_init() {
    const CompileOptions& o = p_.options;
    Phase ph{PhaseKind::init, "init", 0, {}};
    Attrs scale;
    scale.value = o.amp ? o.initial_loss_scale : 1.0f;
    ph.nodes.push_back(make_node(OpKind::fill, {}, {p_.io.loss_scale}, scale, "loss scale"));
    ph.nodes.push_back(make_node(OpKind::fill, {}, {p_.io.overflow}, {}, "overflow flag"));
    ph.nodes.push_back(make_node(OpKind::fill, {}, {p_.io.good_steps}, {}, "good steps"));
    ph.nodes.push_back(make_node(OpKind::fill, {}, {p_.io.optimizer_steps}, {}, "optimizer steps"));
    // An evaluation variant's weight regions are its training engine's (Engine::eval_variant),
    // which keeps the compute copies and the EMA: writing them here would restart that EMA.
    if (o.eval_only) {
      p_.init.push_back(std::move(ph));
      return;
    }
    const Range all{0, p_.param_elems};
    if (o.amp && !decay_range_.empty()) {
      ph.nodes.push_back(compute_copy(Region::params_f32, Region::params_f16, "compute weights"));
    }
    if (o.ema) {
      ph.nodes.push_back(make_node(OpKind::copy, {c_.range_tensor(Region::params_f32, all, "all")},
                                   {c_.range_tensor(Region::ema_f32, all, "all")}, {},
                                   "ema start"));
      if (p_.buffer_elems > 0) {
        ph.nodes.push_back(make_node(OpKind::copy, {buffer_range(Region::bn_running)},
                                     {buffer_range(Region::ema_bn_running)}, {}, "ema bn start"));
      }
      if (o.amp && !decay_range_.empty()) {
        ph.nodes.push_back(compute_copy(Region::ema_f32, Region::ema_f16, "ema compute copy"));
      }
    }
    p_.init.push_back(std::move(ph));
  }

  const ArchPlan& plan_;
  Program p_;
  lower::Context c_;
  Range conv_range_, decay_range_, no_decay_range_;
};

}  // namespace

Program lower_program(const ArchPlan& plan, const CompileOptions& options) {
  Program p = Compiler(plan, options).run();
  // Nothing when options.world == 1. An evaluation-only program keeps its training engine's
  // world (the same plan, so the same weight layout) but has no step to communicate in: its
  // evaluation sums are reduced by the trainer as any evaluation's.
  if (!options.eval_only) add_data_parallel(p);
  return p;
}

}  // namespace kiln
