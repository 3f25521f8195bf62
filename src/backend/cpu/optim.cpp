// Fused optimizers and the EMA on the CPU, over whole ranges of the parameter regions.
// Every one reads the learning rate, loss scale and overflow flag from
// their device scalars at run time (so a schedule changes lr without a recompile), undoes
// the loss scale itself (g' = g * (1/scale): no separate unscale pass), and does
// nothing at all when overflow != 0 (an overflowed step changes no weight, moment
// or EMA). Absent loss_scale / overflow tensors read as 1 / 0 (FP32 without loss scaling);
// an optional clip_coef (grad_norm's factor, --clip-grad-norm) multiplies the unscale.
// The element formulas are both backends' (backend/formulas.h): PyTorch's, in FP32.
#include <cmath>

#include "backend/cpu/cpu_util.h"
#include "backend/formulas.h"

namespace kiln::cpu {

namespace {

// Checks an f32 region tensor of the node's length.
float* region_f32(Context& ctx, const Node& n, TensorId id, int64_t count, const char* role) {
  expect_dtype(ctx, n, id, DType::F32, role);
  expect_numel(ctx, n, id, count, role);
  return ctx.ptr<float>(id);
}

// Reads the three scalars every optimizer uses; false when the step must be skipped.
struct StepScalars {
  float lr = 0, inv_scale = 1;
};
// `average` is attrs.grad_average (1/world after a summing all-reduce, else 1): folded into
// the unscale factor, so averaging over the ranks costs no pass of its own.
bool step_scalars(const Context& c, TensorId lr, TensorId scale, TensorId overflow, float average,
                  TensorId clip_coef, StepScalars* s) {
  if (read_scalar(c, overflow, 0.0) != 0.0) return false;
  s->lr = static_cast<float>(read_scalar(c, lr, 0.0));
  s->inv_scale = formula::inv_loss_scale(static_cast<float>(read_scalar(c, scale, 1.0)), average,
                                         static_cast<float>(read_scalar(c, clip_coef, 1.0)));
  return true;
}

// An optimizer's [w16] output (ops.def): w's FP16 or BF16 compute copy, absent or of w's count.
struct ComputeCopy {
  uint16_t* p = nullptr;
  bool bf16 = false;
  void put(int64_t i, float w) const {
    if (p) p[i] = bf16 ? float_to_bf16(w) : float_to_half(w);
  }
};
ComputeCopy compute_copy(Context& ctx, const Node& n, size_t index, int64_t count) {
  const TensorId id = out_at(n, index);
  if (id == kNoTensor) return {};
  return {ctx.ptr<uint16_t>(id), expect_compute_copy(ctx, n, id, count) == DType::BF16};
}

}  // namespace

// "w, g, m, lr, loss_scale, overflow -> w, m, [w16]" -- torch.optim.SGD (dampening 0):
//   g' = g / scale + wd * w;  m = momentum * m + g';  u = nesterov ? g' + momentum * m : m;
//   w -= lr * u.
// PyTorch sets m = g' on the first step; kiln's m starts at 0, and momentum * 0 + g' = g'.
// With momentum 0, m may be absent.
KernelPtr make_sgd(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId w = need_in(n, 0, "w"), g = need_in(n, 1, "g"), m = in_at(n, 2),
                 lr = need_in(n, 3, "lr"), scale = in_at(n, 4), overflow = in_at(n, 5),
                 coef = in_at(n, 6);
  const int64_t count = ctx.tensor(w).numel();
  const Attrs& a = n.attrs;
  KILN_CHECK(m != kNoTensor || a.momentum == 0.0f, InvalidArgument, "sgd node '", n.label,
             "': momentum ", a.momentum, " needs the moment tensor (input 2)");
  float* wp = region_f32(ctx, n, w, count, "w");
  const float* gp = region_f32(ctx, n, g, count, "g");
  float* mp = m != kNoTensor ? region_f32(ctx, n, m, count, "m") : nullptr;
  float* wo = region_f32(ctx, n, out_or(n, 0, w), count, "w (out)");
  float* mo = m != kNoTensor ? region_f32(ctx, n, out_or(n, 1, m), count, "m (out)") : nullptr;
  const ComputeCopy w16 = compute_copy(ctx, n, 2, count);
  for (TensorId id : {lr, scale, overflow, coef}) expect_scalar(ctx, n, id, "scalar");
  const float mom = a.momentum, wd = a.weight_decay;
  const bool nesterov = a.nesterov;
  return make_loop([=](Context& c) {
    StepScalars s;
    if (!step_scalars(c, lr, scale, overflow, a.grad_average, coef, &s)) return;
    const formula::SgdParams p{s.lr, s.inv_scale, mom, wd, nesterov};
    for (int64_t i = 0; i < count; ++i) {
      const formula::WeightMoment r = formula::sgd_update(wp[i], gp[i], mp ? &mp[i] : nullptr, p);
      if (mp) mo[i] = r.m;
      wo[i] = r.w;
      w16.put(i, r.w);
    }
  });
}

// "w, g, m, v, lr, loss_scale, overflow, step -> w, m, v, [w16]" -- torch.optim.AdamW:
//   w *= 1 - lr * wd  (decoupled decay);  m += (1 - b1) (g' - m)  (PyTorch's lerp);
//   v = b2 v + (1 - b2) g'^2;  t = step + 1;
//   w -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
// The step scalar holds the number of updates applied before this one (0 on the first
// step), so t counts this update as PyTorch's state['step'] does after its increment. The
// compiler passes the step_count node's counter, which skipped (overflowed) steps leave alone.
KernelPtr make_adamw(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId w = need_in(n, 0, "w"), g = need_in(n, 1, "g"), m = need_in(n, 2, "m"),
                 v = need_in(n, 3, "v"), lr = need_in(n, 4, "lr"), scale = in_at(n, 5),
                 overflow = in_at(n, 6), step = need_in(n, 7, "step"), coef = in_at(n, 8);
  const int64_t count = ctx.tensor(w).numel();
  float* wp = region_f32(ctx, n, w, count, "w");
  const float* gp = region_f32(ctx, n, g, count, "g");
  float* mp = region_f32(ctx, n, m, count, "m");
  float* vp = region_f32(ctx, n, v, count, "v");
  float* wo = region_f32(ctx, n, out_or(n, 0, w), count, "w (out)");
  float* mo = region_f32(ctx, n, out_or(n, 1, m), count, "m (out)");
  float* vo = region_f32(ctx, n, out_or(n, 2, v), count, "v (out)");
  const ComputeCopy w16 = compute_copy(ctx, n, 3, count);
  for (TensorId id : {lr, scale, overflow, step, coef}) expect_scalar(ctx, n, id, "scalar");
  const Attrs a = n.attrs;
  return make_loop([=](Context& c) {
    StepScalars s;
    if (!step_scalars(c, lr, scale, overflow, a.grad_average, coef, &s)) return;
    const double t = read_scalar(c, step, 0.0) + 1.0;
    const formula::AdamwParams p =
        formula::adamw_params(s.lr, s.inv_scale, t, a.beta1, a.beta2, a.adam_eps, a.weight_decay);
    for (int64_t i = 0; i < count; ++i) {
      const formula::AdamwElement r = formula::adamw_update(wp[i], gp[i], mp[i], vp[i], p);
      mo[i] = r.m;
      vo[i] = r.v;
      wo[i] = r.w;
      w16.put(i, r.w);
    }
  });
}

// "w, g, m, lr, loss_scale, overflow -> w, m, [w16]" -- LARS (You et al. 2017), in the form of
// torchvision's / Lightning's LARS wrapper around SGD:
//   g' = g / scale;  trust = eta ||w|| / (||g'|| + wd ||w||)  (1 when either norm is 0);
//   d = trust (g' + wd w);  m = momentum m + d;  u = nesterov ? d + momentum m : m;
//   w -= lr u.
// The trust ratio is per parameter, and Attrs has no segment list: the node's whole range is
// one parameter. The compiler therefore emits one lars node per parameter (parameters
// excluded from adaptation -- BN and biases -- go to an sgd node instead). Norms are summed
// in double; the kernel makes two passes (norms, then the update).
KernelPtr make_lars(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId w = need_in(n, 0, "w"), g = need_in(n, 1, "g"), m = need_in(n, 2, "m"),
                 lr = need_in(n, 3, "lr"), scale = in_at(n, 4), overflow = in_at(n, 5),
                 coef = in_at(n, 6);
  const int64_t count = ctx.tensor(w).numel();
  float* wp = region_f32(ctx, n, w, count, "w");
  const float* gp = region_f32(ctx, n, g, count, "g");
  float* mp = region_f32(ctx, n, m, count, "m");
  float* wo = region_f32(ctx, n, out_or(n, 0, w), count, "w (out)");
  float* mo = region_f32(ctx, n, out_or(n, 1, m), count, "m (out)");
  const ComputeCopy w16 = compute_copy(ctx, n, 2, count);
  for (TensorId id : {lr, scale, overflow, coef}) expect_scalar(ctx, n, id, "scalar");
  const Attrs a = n.attrs;
  return make_loop([=](Context& c) {
    StepScalars s;
    if (!step_scalars(c, lr, scale, overflow, a.grad_average, coef, &s)) return;
    double ww = 0.0, gg = 0.0;
    for (int64_t i = 0; i < count; ++i) {
      const double gi = static_cast<double>(gp[i]) * s.inv_scale;
      ww += static_cast<double>(wp[i]) * wp[i];
      gg += gi * gi;
    }
    const float trust =
        formula::lars_trust(std::sqrt(ww), std::sqrt(gg), a.lars_eta, a.weight_decay);
    const formula::LarsParams p{s.lr, s.inv_scale, trust, a.momentum, a.weight_decay, a.nesterov};
    for (int64_t i = 0; i < count; ++i) {
      const formula::WeightMoment r = formula::lars_update(wp[i], gp[i], mp[i], p);
      mo[i] = r.m;
      wo[i] = r.w;
      w16.put(i, r.w);
    }
  });
}

// "overflow, count -> count": +1 unless the step was skipped.
KernelPtr make_step_count(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId overflow = in_at(n, 0), count = need_in(n, 1, "count");
  const TensorId out = out_or(n, 0, count);
  expect_scalar(ctx, n, overflow, "overflow");
  expect_dtype(ctx, n, count, DType::I32, "count");
  expect_dtype(ctx, n, out, DType::I32, "count (out)");
  return make_loop([=](Context& c) {
    const double k = read_scalar(c, count, 0.0);
    write_scalar(c, out, read_scalar(c, overflow, 0.0) != 0.0 ? k : k + 1.0);
  });
}

// "g, loss_scale -> clip_coef" -- torch.nn.utils.clip_grad_norm_ (norm_type 2) over the
// whole gradient region: norm = ||g * average / scale||, coef = min(1, max / (norm + 1e-6)).
// Squares summed in double (torch sums in FP32; the norm's rounding is far below 1e-6
// relative); a NaN norm gives a NaN coef as in torch, which an AMP step skips anyway.
KernelPtr make_grad_norm(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId g = need_in(n, 0, "g"), scale = in_at(n, 1), coef = need_out(n, 0, "clip_coef");
  const int64_t count = ctx.tensor(g).numel();
  const float* gp = region_f32(ctx, n, g, count, "g");
  expect_scalar(ctx, n, scale, "loss_scale");
  expect_dtype(ctx, n, coef, DType::F32, "clip_coef");
  const double max_norm = n.attrs.max_norm, average = n.attrs.grad_average;
  KILN_CHECK(max_norm > 0.0, InvalidArgument, "grad_norm node '", n.label,
             "': max_norm must be > 0, is ", max_norm);
  return make_loop([=](Context& c) {
    const double inv = average / read_scalar(c, scale, 1.0);
    double ss = 0.0;
    for (int64_t i = 0; i < count; ++i) {
      const double gi = static_cast<double>(gp[i]) * inv;
      ss += gi * gi;
    }
    write_scalar(c, coef, formula::clip_coef(ss, max_norm));
  });
}

// "w, overflow -> ema": ema = d * ema + (1 - d) * w, d = attrs.ema_decay; skipped on overflow.
KernelPtr make_ema(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId w = need_in(n, 0, "w"), overflow = in_at(n, 1), e = need_out(n, 0, "ema");
  const int64_t count = ctx.tensor(w).numel();
  const float* wp = region_f32(ctx, n, w, count, "w");
  float* ep = region_f32(ctx, n, e, count, "ema");
  expect_scalar(ctx, n, overflow, "overflow");
  const float d = n.attrs.ema_decay, one_minus_d = 1.0f - n.attrs.ema_decay;
  return make_loop([=](Context& c) {
    if (read_scalar(c, overflow, 0.0) != 0.0) return;
    for (int64_t i = 0; i < count; ++i) ep[i] = formula::ema_update(ep[i], wp[i], d, one_minus_d);
  });
}

}  // namespace kiln::cpu
