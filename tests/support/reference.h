// Float64 reference implementations of kiln's ops, for backend tests (CPU and CUDA alike).
// Plain, obviously-correct loops over std::vector<double>, in kiln's layouts: features NHWC,
// convolution weights KRSC ([K, R, S, C]), fc weights [O, K], row-major everything. They
// define the semantics the kernels must match (SPEC Q2), including the conventions that
// PyTorch leaves open: max-pool ties, top-k ties, the dropout hash, the optimizers' step
// counter. Also: finite differences and the comparison helpers the tolerances use.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "backend/formulas.h"

namespace kiln::ref {

using Vec = std::vector<double>;

inline Vec to_double(const std::vector<float>& v) {
  return Vec(v.begin(), v.end());
}
inline std::vector<float> to_float(const Vec& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = static_cast<float>(v[i]);
  return f;
}
inline Vec abs_of(const Vec& v) {
  Vec a(v.size());
  for (size_t i = 0; i < v.size(); ++i) a[i] = std::fabs(v[i]);
  return a;
}
inline double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// ---- comparison ------------------------------------------------------------------------

// Largest |got - want| / max(mag, floor) over the elements, where mag[i] is the magnitude
// the rounding error of element i scales with: for a sum of products, sum |terms| (the
// classic bound |fl(sum) - sum| <= gamma_n sum |terms|); for a value computed by a few
// operations, |want|. The floor only guards exact zeros.
inline double max_scaled_error(const std::vector<float>& got, const Vec& want, const Vec& mag,
                               double floor = 1e-30) {
  double worst = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]) / std::max(mag[i], floor);
    if (std::isnan(e)) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, e);
  }
  return worst;
}
// Relative error against |want| with a floor (values below the floor compare absolutely).
inline double max_rel_error(const std::vector<float>& got, const Vec& want, double floor) {
  return max_scaled_error(got, want, abs_of(want), floor);
}
inline double max_rel_error(const Vec& got, const Vec& want, double floor) {
  double worst = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    worst = std::max(worst, std::fabs(got[i] - want[i]) / std::max(std::fabs(want[i]), floor));
  }
  return worst;
}

// Central differences of a scalar function f at x: df/dx[i] = (f(x+h e_i) - f(x-h e_i)) / 2h.
// In double with h ~ 1e-5 the truncation error is O(h^2 f''') ~ 1e-10 and the rounding error
// O(eps |f| / h) ~ 1e-11 for |f| ~ 1: agreement to ~1e-8 relative is expected.
inline Vec numeric_grad(const std::function<double(const Vec&)>& f, Vec x, double h = 1e-5) {
  Vec g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

// ---- convolution ---------------------------------------------------------------------

struct ConvShape {
  int64_t n = 1, h = 1, w = 1, c = 1;  // input NHWC
  int64_t k = 1, r = 1, s = 1;         // weights KRSC
  int64_t sh = 1, sw = 1, ph = 0, pw = 0;
  int64_t p() const { return (h + 2 * ph - r) / sh + 1; }
  int64_t q() const { return (w + 2 * pw - s) / sw + 1; }
  int64_t x_size() const { return n * h * w * c; }
  int64_t w_size() const { return k * r * s * c; }
  int64_t y_size() const { return n * p() * q() * k; }
};

// Visits every (input, weight, output) index triple of the convolution.
template <typename F>
void conv_for_each(const ConvShape& cs, F f) {
  for (int64_t b = 0; b < cs.n; ++b)
    for (int64_t oh = 0; oh < cs.p(); ++oh)
      for (int64_t ow = 0; ow < cs.q(); ++ow)
        for (int64_t ko = 0; ko < cs.k; ++ko)
          for (int64_t i = 0; i < cs.r; ++i)
            for (int64_t j = 0; j < cs.s; ++j) {
              const int64_t ih = oh * cs.sh - cs.ph + i, iw = ow * cs.sw - cs.pw + j;
              if (ih < 0 || ih >= cs.h || iw < 0 || iw >= cs.w) continue;
              for (int64_t ci = 0; ci < cs.c; ++ci) {
                f(((b * cs.h + ih) * cs.w + iw) * cs.c + ci,
                  ((ko * cs.r + i) * cs.s + j) * cs.c + ci,
                  ((b * cs.p() + oh) * cs.q() + ow) * cs.k + ko);
              }
            }
}

// y = conv(x, w) + b (b may be empty).
inline Vec conv_fwd(const Vec& x, const Vec& w, const Vec& b, const ConvShape& cs) {
  Vec y(static_cast<size_t>(cs.y_size()), 0.0);
  conv_for_each(cs, [&](int64_t xi, int64_t wi, int64_t yi) { y[yi] += x[xi] * w[wi]; });
  if (!b.empty()) {
    for (size_t i = 0; i < y.size(); ++i) y[i] += b[i % static_cast<size_t>(cs.k)];
  }
  return y;
}
inline Vec conv_bwd_data(const Vec& dy, const Vec& w, const ConvShape& cs) {
  Vec dx(static_cast<size_t>(cs.x_size()), 0.0);
  conv_for_each(cs, [&](int64_t xi, int64_t wi, int64_t yi) { dx[xi] += dy[yi] * w[wi]; });
  return dx;
}
inline Vec conv_bwd_weight(const Vec& x, const Vec& dy, const ConvShape& cs) {
  Vec dw(static_cast<size_t>(cs.w_size()), 0.0);
  conv_for_each(cs, [&](int64_t xi, int64_t wi, int64_t yi) { dw[wi] += x[xi] * dy[yi]; });
  return dw;
}
inline Vec conv_bwd_bias(const Vec& dy, const ConvShape& cs) {
  Vec db(static_cast<size_t>(cs.k), 0.0);
  for (size_t i = 0; i < dy.size(); ++i) db[i % static_cast<size_t>(cs.k)] += dy[i];
  return db;
}

// ---- batch normalisation (per channel over N*H*W; x is [count, C]) ----------------------

struct BnForward {
  Vec y, mean, var, invstd;  // var is the biased batch variance; invstd = 1/sqrt(var + eps)
};
inline BnForward bn_fwd_train(const Vec& x, const Vec& gamma, const Vec& beta, int64_t c,
                              double eps) {
  const int64_t count = static_cast<int64_t>(x.size()) / c;
  BnForward r;
  r.mean.assign(static_cast<size_t>(c), 0.0);
  r.var.assign(static_cast<size_t>(c), 0.0);
  r.invstd.resize(static_cast<size_t>(c));
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < c; ++j) r.mean[j] += x[i * c + j] / count;
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < c; ++j)
      r.var[j] += (x[i * c + j] - r.mean[j]) * (x[i * c + j] - r.mean[j]) / count;
  for (int64_t j = 0; j < c; ++j) r.invstd[j] = 1.0 / std::sqrt(r.var[j] + eps);
  r.y.resize(x.size());
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < c; ++j)
      r.y[i * c + j] = gamma[j] * (x[i * c + j] - r.mean[j]) * r.invstd[j] + beta[j];
  return r;
}
inline Vec bn_fwd_infer(const Vec& x, const Vec& gamma, const Vec& beta, const Vec& rmean,
                        const Vec& rvar, int64_t c, double eps) {
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t j = i % static_cast<size_t>(c);
    y[i] = gamma[j] * (x[i] - rmean[j]) / std::sqrt(rvar[j] + eps) + beta[j];
  }
  return y;
}
// PyTorch's running statistics: running = (1 - m) running + m batch, with the unbiased
// variance count/(count-1) var (factor 1 when count == 1).
inline void bn_running_update(Vec& rmean, Vec& rvar, const Vec& mean, const Vec& var, int64_t count,
                              double m) {
  const double unbias =
      count > 1 ? static_cast<double>(count) / static_cast<double>(count - 1) : 1.0;
  for (size_t j = 0; j < rmean.size(); ++j) {
    rmean[j] = (1 - m) * rmean[j] + m * mean[j];
    rvar[j] = (1 - m) * rvar[j] + m * unbias * var[j];
  }
}
struct BnBackward {
  Vec dx, dgamma, dbeta;
};
// Training-mode backward through the batch statistics:
// dx = gamma invstd / n (n dy - sum dy - xhat sum(dy xhat)).
inline BnBackward bn_bwd(const Vec& x, const Vec& dy, const Vec& gamma, const Vec& mean,
                         const Vec& invstd, int64_t c) {
  const int64_t count = static_cast<int64_t>(x.size()) / c;
  BnBackward r;
  r.dgamma.assign(static_cast<size_t>(c), 0.0);
  r.dbeta.assign(static_cast<size_t>(c), 0.0);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < c; ++j) {
      const double xhat = (x[i * c + j] - mean[j]) * invstd[j];
      r.dbeta[j] += dy[i * c + j];
      r.dgamma[j] += dy[i * c + j] * xhat;
    }
  r.dx.resize(x.size());
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < c; ++j) {
      const double xhat = (x[i * c + j] - mean[j]) * invstd[j];
      r.dx[i * c + j] =
          gamma[j] * invstd[j] / count * (count * dy[i * c + j] - r.dbeta[j] - xhat * r.dgamma[j]);
    }
  return r;
}

// ---- pooling -----------------------------------------------------------------------------

struct PoolShape {
  int64_t n = 1, h = 1, w = 1, c = 1;
  int64_t kh = 2, kw = 2, sh = 2, sw = 2, ph = 0, pw = 0;
  int64_t p() const { return (h + 2 * ph - kh) / sh + 1; }
  int64_t q() const { return (w + 2 * pw - kw) / sw + 1; }
  int64_t x_size() const { return n * h * w * c; }
  int64_t y_size() const { return n * p() * q() * c; }
};

// Max pooling; argmax = ih * W + iw in the input plane. Ties: the first in window order
// (rows, then columns); NaN wins (PyTorch's `val > max || isnan(val)`).
inline Vec maxpool_fwd(const Vec& x, const PoolShape& ps, std::vector<int32_t>* argmax) {
  Vec y(static_cast<size_t>(ps.y_size()));
  if (argmax) argmax->assign(y.size(), 0);
  for (int64_t b = 0; b < ps.n; ++b)
    for (int64_t oh = 0; oh < ps.p(); ++oh)
      for (int64_t ow = 0; ow < ps.q(); ++ow)
        for (int64_t ch = 0; ch < ps.c; ++ch) {
          double best = -std::numeric_limits<double>::infinity();
          int64_t at = -1;
          for (int64_t i = 0; i < ps.kh; ++i)
            for (int64_t j = 0; j < ps.kw; ++j) {
              const int64_t ih = oh * ps.sh - ps.ph + i, iw = ow * ps.sw - ps.pw + j;
              if (ih < 0 || ih >= ps.h || iw < 0 || iw >= ps.w) continue;
              const double v = x[((b * ps.h + ih) * ps.w + iw) * ps.c + ch];
              if (at < 0) at = ih * ps.w + iw;
              if (v > best || std::isnan(v)) {
                best = v;
                at = ih * ps.w + iw;
              }
            }
          const int64_t o = ((b * ps.p() + oh) * ps.q() + ow) * ps.c + ch;
          y[o] = best;
          if (argmax) (*argmax)[o] = static_cast<int32_t>(at);
        }
  return y;
}
inline Vec maxpool_bwd(const Vec& dy, const std::vector<int32_t>& argmax, const PoolShape& ps) {
  Vec dx(static_cast<size_t>(ps.x_size()), 0.0);
  const int64_t plane_out = ps.p() * ps.q();
  for (int64_t b = 0; b < ps.n; ++b)
    for (int64_t o = 0; o < plane_out; ++o)
      for (int64_t ch = 0; ch < ps.c; ++ch) {
        const int64_t i = (b * plane_out + o) * ps.c + ch;
        dx[(b * ps.h * ps.w + argmax[i]) * ps.c + ch] += dy[i];
      }
  return dx;
}
// Average pooling, PyTorch's divisor: with count_include_pad the window clipped to the
// padded input (always kh*kw under the floor rule), else the valid elements only.
template <typename F>
void avgpool_for_each(const PoolShape& ps, bool include_pad, F f) {
  for (int64_t b = 0; b < ps.n; ++b)
    for (int64_t oh = 0; oh < ps.p(); ++oh)
      for (int64_t ow = 0; ow < ps.q(); ++ow) {
        const int64_t h0 = oh * ps.sh - ps.ph, w0 = ow * ps.sw - ps.pw;
        const int64_t h1 = std::min(h0 + ps.kh, ps.h + ps.ph),
                      w1 = std::min(w0 + ps.kw, ps.w + ps.pw);
        const int64_t hs = std::max<int64_t>(h0, 0), ws = std::max<int64_t>(w0, 0);
        const int64_t he = std::min(h1, ps.h), we = std::min(w1, ps.w);
        const double div = include_pad ? static_cast<double>((h1 - h0) * (w1 - w0))
                                       : static_cast<double>((he - hs) * (we - ws));
        for (int64_t ch = 0; ch < ps.c; ++ch)
          for (int64_t ih = hs; ih < he; ++ih)
            for (int64_t iw = ws; iw < we; ++iw)
              f(((b * ps.h + ih) * ps.w + iw) * ps.c + ch,
                ((b * ps.p() + oh) * ps.q() + ow) * ps.c + ch, div);
      }
}
inline Vec avgpool_fwd(const Vec& x, const PoolShape& ps, bool include_pad) {
  Vec y(static_cast<size_t>(ps.y_size()), 0.0);
  avgpool_for_each(ps, include_pad,
                   [&](int64_t xi, int64_t yi, double div) { y[yi] += x[xi] / div; });
  return y;
}
inline Vec avgpool_bwd(const Vec& dy, const PoolShape& ps, bool include_pad) {
  Vec dx(static_cast<size_t>(ps.x_size()), 0.0);
  avgpool_for_each(ps, include_pad,
                   [&](int64_t xi, int64_t yi, double div) { dx[xi] += dy[yi] / div; });
  return dx;
}
// Global average pooling: x [N, HW, C] -> y [N, C].
inline Vec gap_fwd(const Vec& x, int64_t n, int64_t hw, int64_t c) {
  Vec y(static_cast<size_t>(n * c), 0.0);
  for (int64_t b = 0; b < n; ++b)
    for (int64_t i = 0; i < hw; ++i)
      for (int64_t j = 0; j < c; ++j) y[b * c + j] += x[(b * hw + i) * c + j] / hw;
  return y;
}
inline Vec gap_bwd(const Vec& dy, int64_t n, int64_t hw, int64_t c) {
  Vec dx(static_cast<size_t>(n * hw * c));
  for (int64_t b = 0; b < n; ++b)
    for (int64_t i = 0; i < hw; ++i)
      for (int64_t j = 0; j < c; ++j) dx[(b * hw + i) * c + j] = dy[b * c + j] / hw;
  return dx;
}

// ---- fully connected: x [N, K], w [O, K], y [N, O] ----------------------------------------

inline Vec fc_fwd(const Vec& x, const Vec& w, const Vec& b, int64_t n, int64_t k, int64_t o) {
  Vec y(static_cast<size_t>(n * o), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < o; ++j) {
      double s = b.empty() ? 0.0 : b[j];
      for (int64_t l = 0; l < k; ++l) s += x[i * k + l] * w[j * k + l];
      y[i * o + j] = s;
    }
  return y;
}
inline Vec fc_bwd_data(const Vec& dy, const Vec& w, int64_t n, int64_t k, int64_t o) {
  Vec dx(static_cast<size_t>(n * k), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < o; ++j)
      for (int64_t l = 0; l < k; ++l) dx[i * k + l] += dy[i * o + j] * w[j * k + l];
  return dx;
}
inline Vec fc_bwd_weight(const Vec& x, const Vec& dy, int64_t n, int64_t k, int64_t o) {
  Vec dw(static_cast<size_t>(o * k), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < o; ++j)
      for (int64_t l = 0; l < k; ++l) dw[j * k + l] += dy[i * o + j] * x[i * k + l];
  return dw;
}
inline Vec fc_bwd_bias(const Vec& dy, int64_t n, int64_t o) {
  Vec db(static_cast<size_t>(o), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < o; ++j) db[j] += dy[i * o + j];
  return db;
}

// ---- elementwise ------------------------------------------------------------------------

// NaN propagates (PyTorch's clamp_min); -0 gives +0.
inline Vec relu_fwd(const Vec& x) {
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = !(x[i] <= 0) ? x[i] : 0.0;
  return y;
}
// From the output: the gradient passes where y > 0.
inline Vec relu_bwd(const Vec& y, const Vec& dy) {
  Vec dx(y.size());
  for (size_t i = 0; i < y.size(); ++i) dx[i] = y[i] > 0 ? dy[i] : 0.0;
  return dx;
}

// Dropout's counter-based mask: the one both backends compute (backend/formulas.h), keyed by
// (seed, step) at counter index + 1.
inline bool dropout_keep(uint64_t seed, int64_t step, uint64_t index, float p) {
  return formula::dropout_keep(formula::dropout_key(seed, static_cast<uint32_t>(step)), index, p);
}

// ---- loss --------------------------------------------------------------------------------

struct SoftmaxCe {
  double loss = 0;  // mean over the batch, unscaled
  int top1 = 0, top5 = 0;
  Vec dlogits;  // (softmax - onehot) * scale / N
};
// Top-k rule: rank = #{j : z_j > z_y} + #{j < y : z_j == z_y} (a stable descending sort;
// argmax's first maximum); hit at k when rank < k.
inline SoftmaxCe softmax_ce(const Vec& z, const std::vector<int32_t>& labels, int64_t n, int64_t k,
                            double scale) {
  SoftmaxCe r;
  r.dlogits.resize(static_cast<size_t>(n * k));
  for (int64_t b = 0; b < n; ++b) {
    const double* row = z.data() + b * k;
    const int32_t y = labels[static_cast<size_t>(b)];
    const double mx = *std::max_element(row, row + k);
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(row[j] - mx);
    r.loss += (mx + std::log(sum) - row[y]) / n;
    int64_t rank = 0;
    for (int64_t j = 0; j < k; ++j) rank += (row[j] > row[y]) || (row[j] == row[y] && j < y);
    r.top1 += rank < 1;
    r.top5 += rank < 5;
    for (int64_t j = 0; j < k; ++j)
      r.dlogits[b * k + j] = (std::exp(row[j] - mx) / sum - (j == y)) * scale / n;
  }
  return r;
}

// torch.nn.CrossEntropyLoss(label_smoothing=e) on mixed one-hot targets, in its own form:
// t_n = lambda onehot(y_n) + (1 - lambda) onehot(y_{n-1 mod N}) (torchvision's labels.roll(1)),
// smoothed to (1 - e) t_n + e / K; loss = mean_n -sum_j target_nj log softmax(z_n)_j, gradient
// (softmax - target) * scale / N. Top-k counts the dominant label (lambda >= 0.5 ? y_n :
// y_{n-1}), as timm.
inline SoftmaxCe softmax_ce_mixed(const Vec& z, const std::vector<int32_t>& labels, int64_t n,
                                  int64_t k, double scale, double lambda, double eps) {
  SoftmaxCe r;
  r.dlogits.resize(static_cast<size_t>(n * k));
  for (int64_t b = 0; b < n; ++b) {
    const double* row = z.data() + b * k;
    const int32_t ya = labels[static_cast<size_t>(b)],
                  yb = labels[static_cast<size_t>((b + n - 1) % n)];
    const double mx = *std::max_element(row, row + k);
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(row[j] - mx);
    for (int64_t j = 0; j < k; ++j) {
      const double t = (j == ya ? lambda : 0.0) + (j == yb ? 1.0 - lambda : 0.0);
      const double target = (1.0 - eps) * t + eps / static_cast<double>(k);
      const double logp = row[j] - mx - std::log(sum);
      r.loss -= target * logp / static_cast<double>(n);
      r.dlogits[static_cast<size_t>(b * k + j)] =
          (std::exp(logp) - target) * scale / static_cast<double>(n);
    }
    const int32_t y = lambda >= 0.5 ? ya : yb;
    int64_t rank = 0;
    for (int64_t j = 0; j < k; ++j) rank += (row[j] > row[y]) || (row[j] == row[y] && j < y);
    r.top1 += rank < 1;
    r.top5 += rank < 5;
  }
  return r;
}

// mix_batch: sample s's partner is s - 1 (mod N); kind 1 (mixup) lambda x_s + (1 - lambda)
// x_partner, kind 2 (cutmix) the partner's pixels inside rows [y0, y1) x columns [x0, x1).
struct MixBox {
  int kind = 0;
  double lambda = 1;
  int64_t y0 = 0, y1 = 0, x0 = 0, x1 = 0;
};
inline Vec mix_batch(const Vec& x, int64_t n, int64_t h, int64_t w, int64_t c, const MixBox& m) {
  Vec y(x.size());
  const int64_t per = h * w * c;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t p = (s + n - 1) % n;
    for (int64_t i = 0; i < h; ++i)
      for (int64_t j = 0; j < w; ++j)
        for (int64_t ch = 0; ch < c; ++ch) {
          const int64_t at = (i * w + j) * c + ch;
          const double self = x[static_cast<size_t>(s * per + at)],
                       other = x[static_cast<size_t>(p * per + at)];
          const bool boxed = m.kind == 2 && i >= m.y0 && i < m.y1 && j >= m.x0 && j < m.x1;
          y[static_cast<size_t>(s * per + at)] = m.kind == 1
                                                     ? m.lambda * self + (1.0 - m.lambda) * other
                                                 : boxed ? other
                                                         : self;
        }
  }
  return y;
}

// ---- optimizers (PyTorch's formulas; g is the scaled gradient, scale the loss scale) -------
// In float64 and PyTorch's textbook form on purpose: they check backend/formulas.h's FP32
// updates (within FP32 rounding) rather than repeat them.

inline void sgd(Vec& w, const Vec& g, Vec& m, double lr, double scale, double momentum, double wd,
                bool nesterov) {
  for (size_t i = 0; i < w.size(); ++i) {
    const double gi = g[i] / scale + wd * w[i];
    m[i] = momentum * m[i] + gi;
    const double u = nesterov ? gi + momentum * m[i] : m[i];
    w[i] -= lr * u;
  }
}
// t = the step scalar + 1 (updates applied before this one, plus this one).
inline void adamw(Vec& w, const Vec& g, Vec& m, Vec& v, double lr, double scale, double t,
                  double b1, double b2, double eps, double wd) {
  for (size_t i = 0; i < w.size(); ++i) {
    const double gi = g[i] / scale;
    w[i] *= 1 - lr * wd;
    m[i] = b1 * m[i] + (1 - b1) * gi;
    v[i] = b2 * v[i] + (1 - b2) * gi * gi;
    const double mhat = m[i] / (1 - std::pow(b1, t)), vhat = v[i] / (1 - std::pow(b2, t));
    w[i] -= lr * mhat / (std::sqrt(vhat) + eps);
  }
}
// One parameter: trust = eta ||w|| / (||g'|| + wd ||w||) (1 when a norm is 0).
inline void lars(Vec& w, const Vec& g, Vec& m, double lr, double scale, double momentum, double wd,
                 double eta, bool nesterov) {
  double wn = 0, gn = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    wn += w[i] * w[i];
    gn += (g[i] / scale) * (g[i] / scale);
  }
  wn = std::sqrt(wn);
  gn = std::sqrt(gn);
  const double trust = wn > 0 && gn > 0 ? eta * wn / (gn + wd * wn) : 1.0;
  for (size_t i = 0; i < w.size(); ++i) {
    const double d = trust * (g[i] / scale + wd * w[i]);
    m[i] = momentum * m[i] + d;
    w[i] -= lr * (nesterov ? d + momentum * m[i] : m[i]);
  }
}
inline void ema(Vec& e, const Vec& w, double decay) {
  for (size_t i = 0; i < e.size(); ++i) e[i] = decay * e[i] + (1 - decay) * w[i];
}
struct LossScaleState {
  double scale = 8192;
  int64_t good_steps = 0;
};
// SPEC S8's update, the one both backends compute (backend/formulas.h).
inline void loss_scale_update(LossScaleState& s, bool overflow, int64_t growth_interval) {
  const formula::LossScale next = formula::loss_scale_next(
      {s.scale, static_cast<double>(s.good_steps)}, overflow, growth_interval);
  s.scale = next.scale;
  s.good_steps = static_cast<int64_t>(next.good_steps);
}

// ---- half-precision rounding, by value (independent of kiln's bit-twiddling) --------------

// The value of round-to-nearest-even of x in a binary format with `mant` fraction bits,
// minimum normal exponent `emin` and largest finite value `max_finite` (Inf beyond the
// rounding boundary max_finite + ulp/2, as IEEE says). NaN in, NaN out.
inline double round_binary(double x, int mant, int emin, double max_finite) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  const double ax = std::fabs(x);
  int e = std::ilogb(ax);
  e = std::max(e, emin);
  const double quantum = std::ldexp(1.0, e - mant);
  const double r = std::nearbyint(ax / quantum) * quantum;  // default mode: ties to even
  const double top_ulp = std::ldexp(1.0, std::ilogb(max_finite) - mant);
  const double out = ax >= max_finite + top_ulp / 2 ? std::numeric_limits<double>::infinity()
                                                    : std::min(r, max_finite);
  return std::copysign(out, x);
}
inline double round_to_half(double x) {
  return round_binary(x, 10, -14, 65504.0);
}
inline double round_to_bf16(double x) {
  return round_binary(x, 7, -126, 0x1.FEp127);
}

}  // namespace kiln::ref
