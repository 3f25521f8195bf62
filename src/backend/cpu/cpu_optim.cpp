// Fused optimizers and the EMA on the CPU, over whole ranges of the parameter regions
// (SPEC S21, S22). Every one reads the learning rate, loss scale and overflow flag from
// their device scalars at run time (so a schedule changes lr without a recompile), undoes
// the loss scale itself (g' = g * (1/scale), SPEC S8: no separate unscale pass), and does
// nothing at all when overflow != 0 (SPEC S9: an overflowed step changes no weight, moment
// or EMA). Absent loss_scale / overflow tensors read as 1 / 0 (FP32 without loss scaling);
// an optional clip_coef (grad_norm's factor, --clip-grad-norm) multiplies the unscale.
// The formulas follow PyTorch's (torch.optim.SGD, AdamW) operation for operation, in FP32.
#include <cmath>

#include "backend/cpu/cpu_util.h"

namespace kiln::cpu {

namespace {

// Checks an f32 region tensor of the node's length.
float* region_f32(Context& ctx, const Node& n, TensorId id, int64_t count, const char* role) {
  expect_dtype(ctx, n, id, DType::F32, role);
  expect_numel(ctx, n, id, count, role);
  return ctx.ptr<float>(id);
}

TensorId out_or(const Node& n, size_t i, TensorId fallback) {
  const TensorId id = out_at(n, i);
  return id != kNoTensor ? id : fallback;
}

// Reads the three scalars every optimizer uses; false when the step must be skipped.
struct StepScalars {
  float lr = 0, inv_scale = 1;
};
// `average` is attrs.grad_average (1/world after a summing all-reduce, else 1): folded into
// the unscale factor, so averaging over the ranks costs no pass of its own.
bool step_scalars(const Context& c, TensorId lr, TensorId scale, TensorId overflow,
                  float average, TensorId clip_coef, StepScalars* s) {
  if (read_scalar(c, overflow, 0.0) != 0.0) return false;
  s->lr = static_cast<float>(read_scalar(c, lr, 0.0));
  s->inv_scale =
      1.0f / static_cast<float>(read_scalar(c, scale, 1.0));  // exact: scales are powers of two
  s->inv_scale *= average;  // exact for average 1 (one process) and for a power-of-two world
  // (g * inv) * coef == g * (inv * coef) while inv is a power of two: torch's clip order.
  s->inv_scale *= static_cast<float>(read_scalar(c, clip_coef, 1.0));
  return true;
}

}  // namespace

// "w, g, m, lr, loss_scale, overflow -> w, m" -- torch.optim.SGD (dampening 0):
//   g' = g / scale + wd * w;  m = momentum * m + g';  u = nesterov ? g' + momentum * m : m;
//   w -= lr * u.
// PyTorch sets m = g' on the first step; kiln's m starts at 0, and momentum * 0 + g' = g'.
// With momentum 0, m may be absent.
KernelPtr make_sgd(const Node& n, Context& ctx) {
  reject_accumulate(n);
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
  for (TensorId id : {lr, scale, overflow, coef}) expect_scalar(ctx, n, id, "scalar");
  const float mom = a.momentum, wd = a.weight_decay;
  const bool nesterov = a.nesterov;
  return make_loop([=](Context& c) {
    StepScalars s;
    if (!step_scalars(c, lr, scale, overflow, a.grad_average, coef, &s)) return;
    for (int64_t i = 0; i < count; ++i) {
      const float gi = gp[i] * s.inv_scale + wd * wp[i];
      float u = gi;
      if (mp) {
        const float mi = mom * mp[i] + gi;
        mo[i] = mi;
        u = nesterov ? gi + mom * mi : mi;
      }
      wo[i] = wp[i] - s.lr * u;
    }
  });
}

// "w, g, m, v, lr, loss_scale, overflow, step -> w, m, v" -- torch.optim.AdamW:
//   w *= 1 - lr * wd  (decoupled decay);  m += (1 - b1) (g' - m)  (PyTorch's lerp);
//   v = b2 v + (1 - b2) g'^2;  t = step + 1;
//   w -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
// The step scalar holds the number of updates applied before this one (0 on the first
// step), so t counts this update as PyTorch's state['step'] does after its increment. The
// compiler passes the step_count node's counter, which skipped (overflowed) steps leave alone.
KernelPtr make_adamw(const Node& n, Context& ctx) {
  reject_accumulate(n);
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
  for (TensorId id : {lr, scale, overflow, step, coef}) expect_scalar(ctx, n, id, "scalar");
  const Attrs a = n.attrs;
  return make_loop([=](Context& c) {
    StepScalars s;
    if (!step_scalars(c, lr, scale, overflow, a.grad_average, coef, &s)) return;
    const double t = read_scalar(c, step, 0.0) + 1.0;
    // Bias corrections in double, as PyTorch computes them in Python floats.
    const auto step_size =
        static_cast<float>(s.lr / (1.0 - std::pow(static_cast<double>(a.beta1), t)));
    const auto bc2_sqrt =
        static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(a.beta2), t)));
    const float decay = 1.0f - s.lr * a.weight_decay;
    const float b1c = 1.0f - a.beta1, b2c = 1.0f - a.beta2;
    for (int64_t i = 0; i < count; ++i) {
      const float gi = gp[i] * s.inv_scale;
      const float wi = wp[i] * decay;
      const float mi = mp[i] + b1c * (gi - mp[i]);
      const float vi = a.beta2 * vp[i] + b2c * gi * gi;
      const float denom = std::sqrt(vi) / bc2_sqrt + a.adam_eps;
      mo[i] = mi;
      vo[i] = vi;
      wo[i] = wi - step_size * (mi / denom);
    }
  });
}

// "w, g, m, lr, loss_scale, overflow -> w, m" -- LARS (You et al. 2017), in the form of
// torchvision's / Lightning's LARS wrapper around SGD:
//   g' = g / scale;  trust = eta ||w|| / (||g'|| + wd ||w||)  (1 when either norm is 0);
//   d = trust (g' + wd w);  m = momentum m + d;  u = nesterov ? d + momentum m : m;
//   w -= lr u.
// The trust ratio is per parameter, and Attrs has no segment list: the node's whole range is
// one parameter. The compiler therefore emits one lars node per parameter (parameters
// excluded from adaptation -- BN and biases -- go to an sgd node instead). Norms are summed
// in double; the kernel makes two passes (norms, then the update).
KernelPtr make_lars(const Node& n, Context& ctx) {
  reject_accumulate(n);
  const TensorId w = need_in(n, 0, "w"), g = need_in(n, 1, "g"), m = need_in(n, 2, "m"),
                 lr = need_in(n, 3, "lr"), scale = in_at(n, 4), overflow = in_at(n, 5),
                 coef = in_at(n, 6);
  const int64_t count = ctx.tensor(w).numel();
  float* wp = region_f32(ctx, n, w, count, "w");
  const float* gp = region_f32(ctx, n, g, count, "g");
  float* mp = region_f32(ctx, n, m, count, "m");
  float* wo = region_f32(ctx, n, out_or(n, 0, w), count, "w (out)");
  float* mo = region_f32(ctx, n, out_or(n, 1, m), count, "m (out)");
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
    const double wn = std::sqrt(ww), gn = std::sqrt(gg);
    const auto trust = static_cast<float>(
        wn > 0.0 && gn > 0.0 ? a.lars_eta * wn / (gn + a.weight_decay * wn) : 1.0);
    for (int64_t i = 0; i < count; ++i) {
      const float d = trust * (gp[i] * s.inv_scale + a.weight_decay * wp[i]);
      const float mi = a.momentum * mp[i] + d;
      mo[i] = mi;
      const float u = a.nesterov ? d + a.momentum * mi : mi;
      wo[i] = wp[i] - s.lr * u;
    }
  });
}

// "overflow, count -> count": +1 unless the step was skipped.
KernelPtr make_step_count(const Node& n, Context& ctx) {
  reject_accumulate(n);
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
  reject_accumulate(n);
  const TensorId g = need_in(n, 0, "g"), scale = in_at(n, 1), coef = need_out(n, 0, "clip_coef");
  const int64_t count = ctx.tensor(g).numel();
  const float* gp = region_f32(ctx, n, g, count, "g");
  expect_scalar(ctx, n, scale, "loss_scale");
  expect_dtype(ctx, n, coef, DType::F32, "clip_coef");
  const double max_norm = n.attrs.max_norm, average = n.attrs.grad_average;
  KILN_CHECK(max_norm > 0.0, InvalidArgument, "grad_norm node '", n.label, "': max_norm must be > 0, is ", max_norm);
  return make_loop([=](Context& c) {
    const double inv = average / read_scalar(c, scale, 1.0);
    double ss = 0.0;
    for (int64_t i = 0; i < count; ++i) {
      const double gi = static_cast<double>(gp[i]) * inv;
      ss += gi * gi;
    }
    const double k = max_norm / (std::sqrt(ss) + 1e-6);
    write_scalar(c, coef, k > 1.0 ? 1.0 : k);  // NaN stays NaN, as torch.clamp
  });
}

// "w, overflow -> ema": ema = d * ema + (1 - d) * w, d = attrs.ema_decay; skipped on overflow.
KernelPtr make_ema(const Node& n, Context& ctx) {
  reject_accumulate(n);
  const TensorId w = need_in(n, 0, "w"), overflow = in_at(n, 1), e = need_out(n, 0, "ema");
  const int64_t count = ctx.tensor(w).numel();
  const float* wp = region_f32(ctx, n, w, count, "w");
  float* ep = region_f32(ctx, n, e, count, "ema");
  expect_scalar(ctx, n, overflow, "overflow");
  const float d = n.attrs.ema_decay, one_minus_d = 1.0f - n.attrs.ema_decay;
  return make_loop([=](Context& c) {
    if (read_scalar(c, overflow, 0.0) != 0.0) return;
    for (int64_t i = 0; i < count; ++i) ep[i] = d * ep[i] + one_minus_d * wp[i];
  });
}

}  // namespace kiln::cpu
