// Element formulas that the CPU kernels, the CUDA kernels and the tests' reference must agree
// on to the bit: dropout's keep decision, the loss-scale update, BatchNorm's statistics,
// softmax cross-entropy's row terms, and the optimizers' and the EMA's per-element updates.
// Each is written once, for host and device (KILN_HD).
//
// FP32 arithmetic goes through mul / add / sub / div / sqrt: on the device the IEEE intrinsics,
// which nvcc may not contract into FMAs; on the host plain operators (the host build targets
// no FMA instructions). Both backends thus round every operation on its own, alike.
#pragma once
#include <cmath>
#include <cstdint>

#include "backend/host_device.h"

namespace kiln::formula {

KILN_HD inline float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KILN_HD inline float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KILN_HD inline float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
KILN_HD inline float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
KILN_HD inline float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// ---- dropout -------------------------------------------------------------------------------
// The mask is a pure function of (attrs.seed, the step scalar, the element index), so every
// backend drops the same elements with no RNG state to carry, checkpoint or replay:
//   k = fmix(seed ^ fmix(uint64(uint32(step)) + golden)),  h = fmix(k + (index + 1) * golden)
//   u = float(h >> 40) * 2^-24 (exact: 24 bits, in [0, 1)),  keep = !(u < p)
// with SplitMix64's output function fmix.
inline constexpr uint64_t kDropoutGolden = 0x9E3779B97F4A7C15ull;

KILN_HD inline uint64_t dropout_fmix(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z;
}
// The key of one step's mask: computed once per launch, not per element.
KILN_HD inline uint64_t dropout_key(uint64_t seed, uint32_t step) {
  return dropout_fmix(seed ^ dropout_fmix(static_cast<uint64_t>(step) + kDropoutGolden));
}
KILN_HD inline bool dropout_keep(uint64_t key, uint64_t index, float p) {
  const uint64_t h = dropout_fmix(key + (index + 1) * kDropoutGolden);
  const float u = static_cast<float>(h >> 40) * 0x1p-24f;
  return !(u < p);
}

// ---- loss scale ------------------------------------------------------------------
// Overflow: scale = max(scale / 2, 1), good_steps = 0; else good_steps + 1, and when
// growth_interval > 0 and good_steps reaches it, scale *= 2 and good_steps = 0. The scale never
// grows past 2^127 (the largest FP32 power of two): an Inf scale could not come back by
// halving. In double, the scalars' common type.
struct LossScale {
  double scale, good_steps;
};
KILN_HD inline LossScale loss_scale_next(LossScale s, bool overflow, int64_t growth_interval) {
  if (overflow) {
    const double half = s.scale / 2.0;
    return {half < 1.0 ? 1.0 : half, 0.0};
  }
  s.good_steps += 1.0;
  if (growth_interval > 0 && s.good_steps >= static_cast<double>(growth_interval)) {
    if (s.scale * 2.0 <= 0x1p127) s.scale *= 2.0;
    s.good_steps = 0.0;
  }
  return s;
}

// ---- BatchNorm statistics, one channel (double, rounded once to FP32) ----------------------
KILN_HD inline float bn_invstd(float var, double eps) {
  return static_cast<float>(1.0 / ::sqrt(static_cast<double>(var) + eps));
}
// PyTorch's running statistics: running = (1 - m) running + m batch, with the batch variance
// unbiased by n / (n - 1) (1 for n = 1).
KILN_HD inline double bn_unbias(double n) {
  return n > 1.0 ? n / (n - 1.0) : 1.0;
}
KILN_HD inline float running_mean_update(float running, double m, double batch_mean) {
  return static_cast<float>((1.0 - m) * running + m * batch_mean);
}
KILN_HD inline float running_var_update(float running, double m, double unbias, float var) {
  return static_cast<float>((1.0 - m) * running + m * unbias * var);
}
// Synchronised BatchNorm: the global batch's (mean, var) of channel c from every rank's
// (mean, var), all = [world][2][C] (equal counts per rank).
struct MeanVar {
  double mean, var;
};
KILN_HD inline MeanVar combine_rank_stats(const float* all, int world, int64_t C, int64_t c) {
  double mean = 0.0;
  for (int r = 0; r < world; ++r) mean += all[(2 * r) * C + c];
  mean /= world;
  double var = 0.0;
  for (int r = 0; r < world; ++r) {
    const double d = all[(2 * r) * C + c] - mean;
    var += all[(2 * r + 1) * C + c] + d * d;
  }
  var /= world;
  return {mean, var};
}

// ---- softmax cross-entropy, one row -------------------------------------------------------
// Label smoothing e (torch's CrossEntropyLoss(label_smoothing=e)): the target is
// (1-e) onehot + e/K, so the row's loss is lse - (1-e) z_y - (e/K) sum_j z_j and its gradient
// softmax - (1-e) onehot - e/K; e = 0 is the plain form, bit for bit. In double.
struct SmoothedTarget {
  double eps, hit, spread;  // e, 1 - e, e / K
};
KILN_HD inline SmoothedTarget smoothed_target(double eps, int64_t classes) {
  return {eps, 1.0 - eps, eps / static_cast<double>(classes)};
}
// lse = max + log(sum_j exp(z_j - max)); zsum = sum_j z_j.
KILN_HD inline double ce_row_loss(double lse, float zy, double zsum, const SmoothedTarget& t) {
  return lse - (t.eps > 0.0 ? t.hit * static_cast<double>(zy) + t.spread * zsum
                            : static_cast<double>(zy));
}
// One dlogits element from e_j = exp(z_j - max), 1 / sum and grad_scale = loss_scale / V.
KILN_HD inline float ce_grad(double e, double inv_sum, bool is_label, const SmoothedTarget& t,
                             double grad_scale) {
  const double p = e * inv_sum - (is_label ? t.hit : 0.0) - t.spread;
  return static_cast<float>(p * grad_scale);
}
// Mixed targets (mixup / cutmix): lambda onehot(a) + (1-lambda) onehot(b), smoothed, is
// (1-e) (lambda onehot(a) + (1-lambda) onehot(b)) + e/K, so the row's loss is
// lse - (1-e) (lambda z_a + (1-lambda) z_b) - (e/K) sum_j z_j = lambda CE_e(a) + (1-lambda)
// CE_e(b), and its gradient softmax - (1-e) w_j - e/K with w_j = lambda [j = a] +
// (1-lambda) [j = b]. lambda = 1 gives the unmixed terms above, bit for bit.
KILN_HD inline double ce_row_loss_mixed(double lse, float za, float zb, double lambda, double zsum,
                                        const SmoothedTarget& t) {
  const double zt = lambda * static_cast<double>(za) + (1.0 - lambda) * static_cast<double>(zb);
  return lse - (t.eps > 0.0 ? t.hit * zt + t.spread * zsum : zt);
}
KILN_HD inline double mixed_weight(int64_t j, int64_t a, int64_t b, double lambda) {
  return (j == a ? lambda : 0.0) + (j == b ? 1.0 - lambda : 0.0);
}
KILN_HD inline float ce_grad_mixed(double e, double inv_sum, double weight, const SmoothedTarget& t,
                                   double grad_scale) {
  const double p = e * inv_sum - t.hit * weight - t.spread;
  return static_cast<float>(p * grad_scale);
}

// ---- mix_batch (mixup / cutmix of the staged batch, kiln/data/mixup.h) --------------------
struct MixStep {
  int kind;            // 0 none, 1 mixup, 2 cutmix
  float lambda, rest;  // lambda, 1 - lambda
  int64_t y0, y1, x0, x1;
};
KILN_HD inline MixStep mix_step(const float* p) {
  return {static_cast<int>(p[0]),
          p[1],
          p[2],
          static_cast<int64_t>(p[3]),
          static_cast<int64_t>(p[4]),
          static_cast<int64_t>(p[5]),
          static_cast<int64_t>(p[6])};
}
// Pixel (h, w) of sample n from its own value and its partner's: torchvision's
// batch.mul_(lambda).add_(rolled.mul(1 - lambda)) in FP32, or the partner's inside the box.
KILN_HD inline float mix_value(float self, float partner, int64_t h, int64_t w, const MixStep& m) {
  if (m.kind == 1) return add(mul(m.lambda, self), mul(m.rest, partner));
  if (m.kind == 2 && h >= m.y0 && h < m.y1 && w >= m.x0 && w < m.x1) return partner;
  return self;
}

// Whether class j ranks before the label y: a larger logit, or an equal one at a smaller
// index (a stable descending sort; argmax picks the first maximum). A hit at k: rank < k.
KILN_HD inline bool ranks_before(float zj, int64_t j, float zy, int64_t y) {
  return (zj > zy) || (zj == zy && j < y);
}

// ---- optimizers (PyTorch's formulas, operation for operation, in FP32) --------------------

// The factor that undoes the loss scale (exact: scales are powers of two), times the
// gradient average (1/world after a summing all-reduce, exact for a power-of-two world) and
// grad_norm's clip factor: (g * inv) * coef == g * (inv * coef) while inv is a power of two.
KILN_HD inline float inv_loss_scale(float scale, float average, float clip_coef) {
  return mul(mul(div(1.0f, scale), average), clip_coef);
}

// A weight and its moment after one update.
struct WeightMoment {
  float w, m;
};

// torch.optim.SGD (dampening 0): g' = g * inv + wd * w;  m = momentum * m + g';
// u = nesterov ? g' + momentum * m : m;  w -= lr * u. Without a moment buffer (momentum 0),
// u = g' and the returned m is unused.
struct SgdParams {
  float lr, inv_scale, momentum, weight_decay;
  bool nesterov;
};
KILN_HD inline WeightMoment sgd_update(float w, float g, const float* m, const SgdParams& p) {
  const float gi = add(mul(g, p.inv_scale), mul(p.weight_decay, w));
  if (!m) return {sub(w, mul(p.lr, gi)), 0.0f};
  const float mi = add(mul(p.momentum, *m), gi);
  const float u = p.nesterov ? add(gi, mul(p.momentum, mi)) : mi;
  return {sub(w, mul(p.lr, u)), mi};
}

// torch.optim.AdamW: w *= 1 - lr * wd (decoupled decay);  m += (1 - b1) (g' - m) (PyTorch's
// lerp);  v = b2 v + (1 - b2) g'^2;  w -= step_size * m / (sqrt(v) / bc2_sqrt + eps), with
// the bias corrections of update t in double, as PyTorch computes them in Python floats.
struct AdamwParams {
  float inv_scale, step_size, bc2_sqrt, decay, beta2, b1c, b2c, eps;
};
KILN_HD inline AdamwParams adamw_params(float lr, float inv_scale, double t, float beta1,
                                        float beta2, float eps, float weight_decay) {
  AdamwParams p;
  p.inv_scale = inv_scale;
  p.step_size =
      static_cast<float>(static_cast<double>(lr) / (1.0 - ::pow(static_cast<double>(beta1), t)));
  p.bc2_sqrt = static_cast<float>(::sqrt(1.0 - ::pow(static_cast<double>(beta2), t)));
  p.decay = sub(1.0f, mul(lr, weight_decay));
  p.beta2 = beta2;
  p.b1c = sub(1.0f, beta1);
  p.b2c = sub(1.0f, beta2);
  p.eps = eps;
  return p;
}
struct AdamwElement {
  float w, m, v;
};
KILN_HD inline AdamwElement adamw_update(float w, float g, float m, float v, const AdamwParams& p) {
  const float gi = mul(g, p.inv_scale);
  const float wi = mul(w, p.decay);
  const float mi = add(m, mul(p.b1c, sub(gi, m)));
  const float vi = add(mul(p.beta2, v), mul(mul(p.b2c, gi), gi));
  const float denom = add(div(sqrt(vi), p.bc2_sqrt), p.eps);
  return {sub(wi, mul(p.step_size, div(mi, denom))), mi, vi};
}

// LARS (You et al. 2017), as torchvision's / Lightning's wrapper around SGD, for one
// parameter: trust = eta ||w|| / (||g'|| + wd ||w||) (1 when either norm is 0), norms in
// double; d = trust (g' + wd w);  m = momentum m + d;  u = nesterov ? d + momentum m : m;
// w -= lr u.
KILN_HD inline float lars_trust(double w_norm, double g_norm, float eta, float weight_decay) {
  return static_cast<float>(w_norm > 0.0 && g_norm > 0.0
                                ? static_cast<double>(eta) * w_norm /
                                      (g_norm + static_cast<double>(weight_decay) * w_norm)
                                : 1.0);
}
struct LarsParams {
  float lr, inv_scale, trust, momentum, weight_decay;
  bool nesterov;
};
KILN_HD inline WeightMoment lars_update(float w, float g, float m, const LarsParams& p) {
  const float d = mul(p.trust, add(mul(g, p.inv_scale), mul(p.weight_decay, w)));
  const float mi = add(mul(p.momentum, m), d);
  const float u = p.nesterov ? add(d, mul(p.momentum, mi)) : mi;
  return {sub(w, mul(p.lr, u)), mi};
}

// torch.nn.utils.clip_grad_norm_ (norm_type 2): coef = min(1, max_norm / (norm + 1e-6)) from
// the sum of the unscaled gradient's squares; a NaN norm gives a NaN coef, as torch.clamp.
KILN_HD inline double clip_coef(double sum_sq, double max_norm) {
  const double k = max_norm / (::sqrt(sum_sq) + 1e-6);
  return k > 1.0 ? 1.0 : k;
}

// The weights' exponential moving average: ema = d * ema + (1 - d) * w.
KILN_HD inline float ema_update(float ema, float w, float decay, float one_minus_decay) {
  return add(mul(decay, ema), mul(one_minus_decay, w));
}

// SiLU and hardswish with their derivatives, in FP32 as PyTorch's kernels compute them:
// silu = x / (1 + exp(-x)), d/dx = s * (1 + x * (1 - s)) with s = sigmoid(x); hardswish =
// x * min(max(x + 3, 0), 6) / 6, d/dx = 0 below -3, x / 3 + 1/2 up to 3, 1 above. exp differs
// between the host's and the device's libm by an ulp or two, so these agree closely, not bitwise.
KILN_HD inline float sigmoid(float x) {
  return div(1.0f, add(1.0f, expf(-x)));
}
KILN_HD inline float silu(float x) {
  return div(x, add(1.0f, expf(-x)));
}
KILN_HD inline float silu_grad(float x, float dy) {
  const float s = sigmoid(x);
  return mul(mul(dy, s), add(1.0f, mul(x, sub(1.0f, s))));
}
KILN_HD inline float hardswish(float x) {
  return div(mul(x, fminf(fmaxf(add(x, 3.0f), 0.0f), 6.0f)), 6.0f);
}
KILN_HD inline float hardswish_grad(float x, float dy) {
  return x < -3.0f ? 0.0f : x <= 3.0f ? mul(dy, add(div(x, 3.0f), 0.5f)) : dy;
}

}  // namespace kiln::formula
