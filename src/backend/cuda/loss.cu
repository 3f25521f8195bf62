// Softmax cross-entropy fused with top-1 / top-5 counting and the loss backward (the loss
// scale folded in), the GPU twin of src/backend/cpu/loss.cpp: one block per row computes the row's
// max, sum of exponentials (in double, as the CPU), loss term, the label's rank and, when
// asked, dlogits = (softmax - onehot) * loss_scale / V; a one-block pass sums the rows in a
// fixed order (deterministic). Ranking: classes with a larger logit, plus equal logits with
// a smaller index (a stable descending sort; argmax takes the first maximum). A row with a
// NaN or infinite logit is a miss (as the CPU): NaN compares false and would rank first.
// Label smoothing e and the row's terms: backend/formulas.h, as the CPU. With the mix input
// (mixup / cutmix), row n's target mixes its label with row n - 1's (mod N) by the step's
// lambda, read on the device, and the hits count the dominant label, as the CPU.
// A label < 0 marks padding (ops.def): its row counts in neither loss, hits nor gradient,
// and V is the number of valid rows. A label >= classes cannot be reported from the device,
// so it poisons the step instead: its loss term and dlogits row are NaN, which the overflow
// check (AMP) and the loss printed by the trainer both show.
#include <cub/block/block_reduce.cuh>

#include "backend/cuda/device_util.cuh"
#include "backend/formulas.h"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;
using FloatReduce = cub::BlockReduce<float, kThreads>;
using DoubleReduce = cub::BlockReduce<double, kThreads>;
using IntReduce = cub::BlockReduce<int, kThreads>;

struct RowOut {
  double loss;
  int valid, top1, top5;
};

template <typename T>
__global__ void softmax_ce_rows(const T* z, const int32_t* labels, int64_t N, int64_t K,
                                DevScalar scale, T* dz, RowOut* rows, double eps,
                                const float* mix) {
  __shared__ union {
    typename FloatReduce::TempStorage f;
    typename DoubleReduce::TempStorage d;
    typename IntReduce::TempStorage i;
  } tmp;
  __shared__ float s_max;
  __shared__ double s_sum, s_zsum;
  __shared__ int s_valid, s_rank, s_bad;
  const int64_t b = blockIdx.x;
  const T* row = z + b * K;
  const int32_t y = labels[b];
  const formula::MixStep m =
      mix ? formula::mix_step(mix) : formula::MixStep{0, 1.0f, 0.0f, 0, 0, 0, 0};
  const bool mixed = m.kind != 0;
  const double lambda = mixed ? static_cast<double>(m.lambda) : 1.0;
  int32_t yb = mixed ? labels[(b + N - 1) % N] : y;  // the partner's label
  if (yb < 0) yb = y;
  const int32_t yd = lambda >= 0.5 ? y : yb;  // the dominant label, as timm counts accuracy

  // V, the number of valid rows: every block counts the labels (N is small).
  int v = 0;
  for (int64_t j = threadIdx.x; j < N; j += kThreads) v += labels[j] >= 0;
  v = IntReduce(tmp.i).Sum(v);
  if (threadIdx.x == 0) s_valid = v;
  __syncthreads();

  if (y < 0) {  // padding: no loss, no hits, zero gradient
    if (dz) {
      for (int64_t j = threadIdx.x; j < K; j += kThreads) dz[b * K + j] = from_f<T>(0.0f);
    }
    if (threadIdx.x == 0) rows[b] = RowOut{0.0, 0, 0, 0};
    return;
  }
  if (y >= K || yb >= K) {
    if (dz) {
      for (int64_t j = threadIdx.x; j < K; j += kThreads) dz[b * K + j] = from_f<T>(NAN);
    }
    if (threadIdx.x == 0) rows[b] = RowOut{static_cast<double>(NAN), 1, 0, 0};
    return;
  }

  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < K; j += kThreads) mx = fmaxf(mx, to_f(row[j]));
  // The CPU takes std::max from row[0] on, which skips NaN unless row[0] is NaN; a NaN in
  // the row makes the loss NaN either way.
  mx = FloatReduce(tmp.f).Reduce(mx, [](float a, float b2) { return fmaxf(a, b2); });
  if (threadIdx.x == 0) s_max = mx;
  __syncthreads();
  mx = s_max;

  const float zy = to_f(row[y]), zb = to_f(row[yb]), zd = to_f(row[yd]);
  double sum = 0.0, zsum = 0.0;
  int rank = 0, bad = 0;
  for (int64_t j = threadIdx.x; j < K; j += kThreads) {
    const float zj = to_f(row[j]);
    sum += exp(static_cast<double>(zj) - static_cast<double>(mx));
    zsum += static_cast<double>(zj);
    rank += formula::ranks_before(zj, j, zd, yd);
    bad += !isfinite(zj);
  }
  sum = DoubleReduce(tmp.d).Sum(sum);
  if (threadIdx.x == 0) s_sum = sum;
  __syncthreads();
  zsum = DoubleReduce(tmp.d).Sum(zsum);
  if (threadIdx.x == 0) s_zsum = zsum;
  __syncthreads();
  rank = IntReduce(tmp.i).Sum(rank);
  if (threadIdx.x == 0) s_rank = rank;
  __syncthreads();
  bad = IntReduce(tmp.i).Sum(bad);
  if (threadIdx.x == 0) s_bad = bad;
  __syncthreads();
  sum = s_sum;

  const formula::SmoothedTarget target = formula::smoothed_target(eps, K);
  if (dz) {
    const double grad_scale = load_scalar(scale, 1.0) / static_cast<double>(s_valid);
    const double inv = 1.0 / sum;
    for (int64_t j = threadIdx.x; j < K; j += kThreads) {
      const double e = exp(static_cast<double>(to_f(row[j])) - static_cast<double>(mx));
      dz[b * K + j] =
          from_f<T>(mixed ? formula::ce_grad_mixed(e, inv, formula::mixed_weight(j, y, yb, lambda),
                                                   target, grad_scale)
                          : formula::ce_grad(e, inv, j == y, target, grad_scale));
    }
  }
  if (threadIdx.x == 0) {
    const double lse = static_cast<double>(mx) + log(sum);
    const bool ok = s_bad == 0;
    const double loss = mixed ? formula::ce_row_loss_mixed(lse, zy, zb, lambda, s_zsum, target)
                              : formula::ce_row_loss(lse, zy, s_zsum, target);
    rows[b] = RowOut{loss, 1, ok && s_rank < 1, ok && s_rank < 5};
  }
}

__global__ void softmax_ce_finish(const RowOut* rows, int64_t N, float* loss, int32_t* correct) {
  __shared__ union {
    typename DoubleReduce::TempStorage d;
    typename IntReduce::TempStorage i;
  } tmp;
  double total = 0.0;
  int valid = 0, top1 = 0, top5 = 0;
  for (int64_t b = threadIdx.x; b < N; b += kThreads) {
    total += rows[b].loss;
    valid += rows[b].valid;
    top1 += rows[b].top1;
    top5 += rows[b].top5;
  }
  total = DoubleReduce(tmp.d).Sum(total);
  __syncthreads();
  valid = IntReduce(tmp.i).Sum(valid);
  __syncthreads();
  top1 = IntReduce(tmp.i).Sum(top1);
  __syncthreads();
  top5 = IntReduce(tmp.i).Sum(top5);
  if (threadIdx.x == 0) {
    *loss = valid > 0 ? static_cast<float>(total / static_cast<double>(valid)) : 0.0f;
    correct[0] = top1;
    correct[1] = top5;
  }
}

}  // namespace

// "logits, labels (i32), loss_scale, [mix] -> loss (f32), correct (i32 2: top1, top5), [dlogits]"
KernelPtr make_softmax_ce(const Node& n, Context& ctx, int stream) {
  reject_accumulate(ctx, n);
  const TensorId z = need_in(n, 0, "logits"), labels = need_in(n, 1, "labels"), scale = in_at(n, 2);
  const TensorId mix = in_at(n, 3);
  if (mix != kNoTensor) {
    expect_dtype(ctx, n, mix, DType::F32, "mix");
    expect_numel(ctx, n, mix, 8, "mix (mix_batch's step parameters)");
  }
  const float* mixp = mix != kNoTensor ? ctx.ptr<float>(mix) : nullptr;
  const TensorId loss = need_out(n, 0, "loss"), correct = need_out(n, 1, "correct"),
                 dz = out_at(n, 2);
  const DType dt = expect_float(ctx, n, z, "logits");
  expect_rank(ctx, n, z, 2, "logits [N, classes]");
  expect_dtype(ctx, n, labels, DType::I32, "labels");
  const int64_t N = ctx.tensor(z).shape[0], K = ctx.tensor(z).shape[1];
  KILN_CHECK(N > 0 && K > 0, Shape, "softmax_ce node '", n.label, "': logits ",
             ctx.tensor(z).shape.str(), " are empty");
  expect_numel(ctx, n, labels, N, "labels [N]");
  const DevScalar sc = dev_scalar(ctx, n, scale, "loss_scale");
  expect_dtype(ctx, n, loss, DType::F32, "loss");
  expect_dtype(ctx, n, correct, DType::I32, "correct");
  expect_numel(ctx, n, correct, 2, "correct (top-1, top-5)");
  if (dz != kNoTensor) {
    expect_same_dtype(ctx, n, z, dz);
    expect_numel(ctx, n, dz, N * K, "dlogits");
  }
  ctx.need_workspace(stream, sizeof(RowOut) * static_cast<size_t>(N));
  const void* zp = ctx.ptr(z);
  const int32_t* lp = ctx.ptr<int32_t>(labels);
  float* lossp = ctx.ptr<float>(loss);
  int32_t* cp = ctx.ptr<int32_t>(correct);
  void* dzp = ctx.ptr(dz);
  const double eps = n.attrs.label_smoothing;
  KILN_CHECK(eps >= 0.0 && eps < 1.0, InvalidArgument, "softmax_ce node '", n.label,
             "': label smoothing ", eps, " is outside [0, 1)");
  KernelPtr k;
  KILN_DISPATCH_FLOAT(dt, T, {
    k = make_fn(stream, [=](Context& c, cudaStream_t s) {
      auto* rows = static_cast<RowOut*>(c.streams[static_cast<size_t>(stream)].workspace);
      softmax_ce_rows<T><<<static_cast<unsigned>(N), kThreads, 0, s>>>(
          static_cast<const T*>(zp), lp, N, K, sc, static_cast<T*>(dzp), rows, eps, mixp);
      KILN_LAUNCH_CHECK("softmax_ce rows");
      softmax_ce_finish<<<1, kThreads, 0, s>>>(rows, N, lossp, cp);
      KILN_LAUNCH_CHECK("softmax_ce finish");
    });
  });
  return k;
}

}  // namespace kiln::cuda
