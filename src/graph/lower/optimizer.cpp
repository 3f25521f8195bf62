// The optimizer phase of the training step: one fused region op per parameter range (SGD with
// momentum, AdamW), or LARS per weight, each skipping its update when the step overflowed.
#include "graph/lower/lower.h"

namespace kiln::lower {

Phase optimizer_phase(Context& c, Range decay, Range no_decay) {
  const CompileOptions& o = c.p.options;
  Phase ph{PhaseKind::optimizer, "optimizer", 1, {}};
  Attrs base;
  base.momentum = o.momentum;
  base.nesterov = o.nesterov;
  base.beta1 = o.beta1;
  base.beta2 = o.beta2;
  base.adam_eps = o.adam_eps;
  base.lars_eta = o.lars_eta;
  const ProgramIO& io = c.p.io;
  // The decayed weights are those with an AMP compute copy: their update writes it too.
  const bool cast = o.amp && o.fuse_weight_cast;
  // An update's outputs, then the compute copy where it writes one (none: the program of old).
  auto outs = [](std::vector<TensorId> out, TensorId w16) {
    if (w16 != kNoTensor) out.push_back(w16);
    return out;
  };
  auto emit = [&](Range r, float wd, const std::string& what, bool copy) {
    if (r.empty()) return;
    Attrs a = base;
    a.weight_decay = wd;
    const TensorId w = c.range_tensor(Region::params_f32, r, what);
    const TensorId g = c.range_tensor(Region::grads_f32, r, what);
    const TensorId w16 = cast && copy ? c.range_tensor(Region::params_f16, r, what) : kNoTensor;
    if (o.optimizer != "adamw") {  // sgd, or LARS's plain SGD over the ranges it does not adapt
      const TensorId m =
          c.has_region(Region::moment1) ? c.range_tensor(Region::moment1, r, what) : kNoTensor;
      ph.nodes.push_back(make_node(OpKind::sgd,
                                   {w, g, m, io.lr, io.loss_scale, io.overflow, io.clip_coef},
                                   outs({w, m}, w16), a, "sgd " + what));
    } else {
      const TensorId m = c.range_tensor(Region::moment1, r, what);
      const TensorId v = c.range_tensor(Region::moment2, r, what);
      ph.nodes.push_back(make_node(
          OpKind::adamw,
          {w, g, m, v, io.lr, io.loss_scale, io.overflow, io.optimizer_steps, io.clip_coef},
          outs({w, m, v}, w16), a, "adamw " + what));
    }
  };
  if (o.optimizer == "lars") {
    // LARS's trust ratio is per parameter: one node per conv/fc weight. BatchNorm
    // parameters and biases are not adapted (as in the MLPerf ResNet recipe): plain
    // momentum SGD over their range, without weight decay.
    for (const ParamDesc& d : c.p.params) {
      if (!d.decay) continue;
      Attrs a = base;
      a.weight_decay = o.weight_decay;
      const TensorId w = d.tensor[static_cast<size_t>(Region::params_f32)];
      const TensorId g = d.tensor[static_cast<size_t>(Region::grads_f32)];
      const TensorId m = d.tensor[static_cast<size_t>(Region::moment1)];
      const TensorId w16 =
          cast && d.compute_copy ? d.tensor[static_cast<size_t>(Region::params_f16)] : kNoTensor;
      ph.nodes.push_back(make_node(OpKind::lars,
                                   {w, g, m, io.lr, io.loss_scale, io.overflow, io.clip_coef},
                                   outs({w, m}, w16), a, "lars " + d.name));
    }
    emit(no_decay, 0.0f, "no_decay", false);
  } else {
    emit(decay, o.weight_decay, "decay", true);
    emit(no_decay, 0.0f, "no_decay", false);
  }
  // After every adamw node has read it: AdamW's t counts applied updates only, as PyTorch's
  // state['step'] under GradScaler, which skips optimizer.step() on overflow.
  if (o.optimizer == "adamw") {
    ph.nodes.push_back(make_node(OpKind::step_count, {io.overflow, io.optimizer_steps},
                                 {io.optimizer_steps}, {}, "optimizer steps"));
  }
  return ph;
}

}  // namespace kiln::lower
