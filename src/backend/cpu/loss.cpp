// Softmax cross-entropy on the CPU, one loop over the batch:
//   loss     = mean_n (logsumexp(z_n) - z_n[label_n])    (unscaled; max-subtracted, sums in double)
//   dlogits  = (softmax(z_n) - onehot(label_n)) * loss_scale / N   (when the output is present:
//              the loss scale is folded into the loss backward)
//   correct  = {top-1 hits, top-5 hits} over the batch (i32[2]).
// Label smoothing e (attrs.label_smoothing) and the row's terms: backend/formulas.h.
// A label < 0 marks padding (the last partial batch of an evaluation): its row counts in
// neither loss, hits nor gradient, and N above is the number V of valid rows.
// With the mix input (mixup / cutmix, training): row n's target mixes its label with row
// n - 1's (mod N) by the step's lambda (formula::ce_row_loss_mixed), and the hits count the
// dominant label. A mix of kind 0 (an unmixed step) runs the plain rows.
// Ranking (formula::ranks_before, as the CUDA kernel): the order of a stable descending sort,
// where argmax picks the first maximum (torch.argmax's documented rule). A row with any NaN
// or infinite logit is a miss at every k: NaN compares false, so ranking alone would count a
// row of NaNs as a hit, and a diverged model would report 100%.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_util.h"
#include "backend/formulas.h"

namespace kiln::cpu {

// "logits, labels (i32), loss_scale, [mix] -> loss (f32), correct (i32 2: top1, top5), [dlogits]"
KernelPtr make_softmax_ce(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId z = need_in(n, 0, "logits"), labels = need_in(n, 1, "labels"), scale = in_at(n, 2);
  const TensorId mix = in_at(n, 3);
  const TensorId loss = need_out(n, 0, "loss"), correct = need_out(n, 1, "correct"),
                 dz = out_at(n, 2);
  expect_dtype(ctx, n, z, DType::F32, "logits");
  expect_rank(ctx, n, z, 2, "logits [N, classes]");
  expect_dtype(ctx, n, labels, DType::I32, "labels");
  const int64_t N = ctx.tensor(z).shape[0], K = ctx.tensor(z).shape[1];
  KILN_CHECK(N > 0 && K > 0, Shape, "softmax_ce node '", n.label, "': logits ",
             ctx.tensor(z).shape.str(), " are empty");
  expect_numel(ctx, n, labels, N, "labels [N]");
  expect_scalar(ctx, n, scale, "loss_scale");
  expect_dtype(ctx, n, loss, DType::F32, "loss");
  expect_dtype(ctx, n, correct, DType::I32, "correct");
  expect_numel(ctx, n, correct, 2, "correct (top-1, top-5)");
  if (dz != kNoTensor) {
    expect_dtype(ctx, n, dz, DType::F32, "dlogits");
    expect_numel(ctx, n, dz, N * K, "dlogits");
  }
  if (mix != kNoTensor) {
    expect_dtype(ctx, n, mix, DType::F32, "mix");
    expect_numel(ctx, n, mix, 8, "mix (mix_batch's step parameters)");
  }
  const float* mixp = mix != kNoTensor ? ctx.ptr<float>(mix) : nullptr;
  const float* zp = ctx.ptr<float>(z);
  const int32_t* lp = ctx.ptr<int32_t>(labels);
  float* lossp = ctx.ptr<float>(loss);
  int32_t* cp = ctx.ptr<int32_t>(correct);
  float* dzp = dz != kNoTensor ? ctx.ptr<float>(dz) : nullptr;
  const std::string label = n.label;
  const double eps = n.attrs.label_smoothing;
  KILN_CHECK(eps >= 0.0 && eps < 1.0, InvalidArgument, "softmax_ce node '", label,
             "': label smoothing ", eps, " is outside [0, 1)");
  const formula::SmoothedTarget target = formula::smoothed_target(eps, K);
  return make_loop([=, e = std::vector<double>(static_cast<size_t>(K))](Context& c) mutable {
    int64_t valid = 0;
    for (int64_t b = 0; b < N; ++b) valid += lp[b] >= 0;
    const double grad_scale =
        read_scalar(c, scale, 1.0) / static_cast<double>(std::max<int64_t>(valid, 1));
    const formula::MixStep m =
        mixp ? formula::mix_step(mixp) : formula::MixStep{0, 1.0f, 0.0f, 0, 0, 0, 0};
    KILN_CHECK(m.kind == 0 || (m.lambda >= 0.0f && m.lambda <= 1.0f), InvalidArgument,
               "softmax_ce node '", label, "': the mix's lambda ", m.lambda, " is outside [0, 1]");
    const double lambda = m.kind != 0 ? static_cast<double>(m.lambda) : 1.0;
    double total = 0.0;
    int32_t top1 = 0, top5 = 0;
    for (int64_t b = 0; b < N; ++b) {
      const float* row = zp + b * K;
      const int32_t y = lp[b];
      if (y < 0) {
        if (dzp) std::fill(dzp + b * K, dzp + (b + 1) * K, 0.0f);
        continue;
      }
      KILN_CHECK(y < K, Data, "softmax_ce node '", label, "': label ", y, " of sample ", b,
                 " is outside [0, ", K, "); check the dataset's class count against the model's");
      float mx = row[0];
      bool finite = std::isfinite(row[0]);
      for (int64_t j = 1; j < K; ++j) {
        mx = std::max(mx, row[j]);
        finite = finite && std::isfinite(row[j]);
      }
      double sum = 0.0, zsum = 0.0;
      for (int64_t j = 0; j < K; ++j) {
        e[static_cast<size_t>(j)] = std::exp(static_cast<double>(row[j]) - mx);
        sum += e[static_cast<size_t>(j)];
        zsum += row[j];
      }
      const double lse = static_cast<double>(mx) + std::log(sum);
      const float zy = row[y];
      // The partner's label (rows are full in training; a padded partner leaves the row pure).
      int32_t yb = m.kind != 0 ? lp[(b + N - 1) % N] : y;
      if (yb < 0) yb = y;
      KILN_CHECK(yb < K, Data, "softmax_ce node '", label, "': label ", yb, " of sample ",
                 (b + N - 1) % N, " is outside [0, ", K,
                 "); check the dataset's class count against the model's");
      const bool mixed = m.kind != 0;
      total += mixed ? formula::ce_row_loss_mixed(lse, zy, row[yb], lambda, zsum, target)
                     : formula::ce_row_loss(lse, zy, zsum, target);
      const int32_t yd = lambda >= 0.5 ? y : yb;  // the dominant label, as timm counts accuracy
      int64_t rank = 0;
      for (int64_t j = 0; j < K; ++j) rank += formula::ranks_before(row[j], j, row[yd], yd);
      top1 += finite && rank < 1;
      top5 += finite && rank < 5;
      if (dzp) {
        float* d = dzp + b * K;
        const double inv = 1.0 / sum;
        for (int64_t j = 0; j < K; ++j) {
          const double ej = e[static_cast<size_t>(j)];
          d[j] = mixed ? formula::ce_grad_mixed(ej, inv, formula::mixed_weight(j, y, yb, lambda),
                                                target, grad_scale)
                       : formula::ce_grad(ej, inv, j == y, target, grad_scale);
        }
      }
    }
    *lossp = static_cast<float>(total / static_cast<double>(std::max<int64_t>(valid, 1)));
    cp[0] = top1;
    cp[1] = top5;
  });
}

}  // namespace kiln::cpu
