// Data-parallel ops on the CPU: the collectives through kiln::dist (MPI,
// blocking, in place), and SyncBN's split of BatchNorm into loops. The statistics follow the
// CPU and CUDA bn kernels' convention exactly — saved = [mean; invstd], invstd = 1/sqrt(var +
// eps) from the FP32-rounded variance, running statistics with the unbiased variance — but
// over the global batch: every rank holds `count` rows, so the global mean is the mean of the
// ranks' means and the global variance the mean of (var_r + (mean_r - mean)^2) (the parallel
// variance formula for equal counts, in double; PyTorch's batch_norm_gather_stats_with_counts).
// Per-channel sums are taken in double. Loops over channels are split in blocks across the
// OpenMP pool, so a sum does not depend on the thread count.
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_util.h"
#include "backend/formulas.h"
#include "kiln/process_group/process_group.h"

namespace kiln::cpu {

namespace {

constexpr int64_t kChannelBlock = 16;  // one cache line of f32 per row

// Rows (N*H*W) and channels of an NHWC (or [N, C]) f32 tensor.
struct Geom {
  int64_t rows = 0, c = 0;
};

Geom geom_of(const Context& ctx, const Node& n, TensorId x,
             std::initializer_list<TensorId> same_shape,
             std::initializer_list<TensorId> per_channel) {
  const Nhwc s = nhwc_of(ctx, n, x, "x");
  expect_dtype(ctx, n, x, DType::F32, "x");
  for (TensorId id : same_shape) {
    expect_dtype(ctx, n, id, DType::F32, "feature");
    expect_numel(ctx, n, id, s.numel(), "feature (the shape of x)");
  }
  expect_per_channel(ctx, n, per_channel, s.c);
  return {s.n * s.h * s.w, s.c};
}

// For every channel c: (sa[c], sb[c]) = sum over rows of f(row, c) -> (a, b), in double.
template <typename F>
void channel_sums(int64_t rows, int64_t C, double* sa, double* sb, F f) {
  const int64_t blocks = (C + kChannelBlock - 1) / kChannelBlock;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kChannelBlock, c1 = std::min(C, c0 + kChannelBlock);
    double a[kChannelBlock] = {}, b[kChannelBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = c0; c < c1; ++c) f(r * C + c, c, a[c - c0], b[c - c0]);
    }
    for (int64_t c = c0; c < c1; ++c) {
      sa[c] = a[c - c0];
      sb[c] = b[c - c0];
    }
  }
}

}  // namespace

// "x -> x (in place, f32 or i32): the sum over the ranks, or the max with attrs.reduce_max"
KernelPtr make_allreduce(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x");
  const TensorId y = out_at(n, 0) != kNoTensor ? out_at(n, 0) : x;
  const DTensor &tx = ctx.tensor(x), &ty = ctx.tensor(y);
  KILN_CHECK(ctx.ptr<uint8_t>(x) == ctx.ptr<uint8_t>(y) && tx.numel() == ty.numel() &&
                 tx.dtype == ty.dtype,
             InvalidArgument, "allreduce node '", n.label, "' works in place; '", tx.name,
             "' and '", ty.name, "' are different tensors");
  KILN_CHECK(tx.dtype == DType::F32 || tx.dtype == DType::I32, Unsupported, "allreduce node '",
             n.label, "': '", tx.name, "' is ", dtype_name(tx.dtype), "; it reduces f32 or i32");
  expect_world(n);
  void* p = ctx.ptr<uint8_t>(x);
  const int64_t count = tx.numel();
  const DType dtype = tx.dtype;
  const dist::Reduce op = n.attrs.reduce_max ? dist::Reduce::max : dist::Reduce::sum;
  return make_loop(
      [=, what = n.label](Context&) { dist::allreduce(p, count, dtype, op, what.c_str()); });
}

// "x -> y = [x of rank 0, ..., x of rank world-1] (f32)"
KernelPtr make_allgather(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), y = need_out(n, 0, "y");
  expect_dtype(ctx, n, x, DType::F32, "x");
  expect_dtype(ctx, n, y, DType::F32, "y");
  expect_world(n);
  const int64_t count = ctx.tensor(x).numel();
  expect_numel(ctx, n, y, count * n.attrs.world, "y (world x the size of x)");
  const float* xp = ctx.ptr<float>(x);
  float* yp = ctx.ptr<float>(y);
  return make_loop(
      [=, what = n.label](Context&) { dist::allgather(xp, yp, count, DType::F32, what.c_str()); });
}

// "x -> stats (f32 2xC: this rank's batch mean and biased variance)"
KernelPtr make_bn_stats(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), stats = need_out(n, 0, "stats");
  const Geom g = geom_of(ctx, n, x, {}, {});
  expect_dtype(ctx, n, stats, DType::F32, "stats");
  expect_numel(ctx, n, stats, 2 * g.c, "stats (2 x C)");
  const float* xp = ctx.ptr<float>(x);
  float* sp = ctx.ptr<float>(stats);
  std::vector<double> s(static_cast<size_t>(g.c)), ss(static_cast<size_t>(g.c));
  return make_loop([=](Context&) mutable {
    channel_sums(g.rows, g.c, s.data(), ss.data(), [xp](int64_t i, int64_t, double& a, double& b) {
      const double v = xp[i];
      a += v;
      b += v * v;
    });
    const double rows = static_cast<double>(g.rows);
    for (int64_t c = 0; c < g.c; ++c) {
      const double mean = s[static_cast<size_t>(c)] / rows;
      sp[c] = static_cast<float>(mean);
      sp[g.c + c] =
          static_cast<float>(std::max(ss[static_cast<size_t>(c)] / rows - mean * mean, 0.0));
    }
  });
}

// "x, gamma, beta, running_mean, running_var, stats_all -> y, saved"
KernelPtr make_bn_fwd_sync(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), gamma = need_in(n, 1, "gamma"),
                 beta = need_in(n, 2, "beta"), rm = need_in(n, 3, "running_mean"),
                 rv = need_in(n, 4, "running_var"), all = need_in(n, 5, "stats_all");
  const TensorId y = need_out(n, 0, "y"), saved = need_out(n, 1, "saved");
  const Geom g = geom_of(ctx, n, x, {y}, {gamma, beta, rm, rv});
  const int world = n.attrs.world;
  KILN_CHECK(world >= 1, InvalidArgument, "bn_fwd_sync node '", n.label, "': world must be >= 1");
  expect_dtype(ctx, n, saved, DType::F32, "saved");
  expect_numel(ctx, n, saved, 2 * g.c, "saved (2 x C)");
  expect_dtype(ctx, n, all, DType::F32, "stats_all");
  expect_numel(ctx, n, all, int64_t{world} * 2 * g.c, "stats_all (world x 2 x C)");
  KILN_CHECK(n.attrs.eps > 0.0f, InvalidArgument, "bn_fwd_sync node '", n.label,
             "': eps must be > 0");
  const float* xp = ctx.ptr<float>(x);
  float* yp = ctx.ptr<float>(y);
  const float *gp = ctx.ptr<float>(gamma), *bp = ctx.ptr<float>(beta), *ap = ctx.ptr<float>(all);
  float *sp = ctx.ptr<float>(saved), *rmp = ctx.ptr<float>(rm), *rvp = ctx.ptr<float>(rv);
  const double eps = n.attrs.eps, m = n.attrs.bn_momentum;
  const double total = static_cast<double>(g.rows) * world;
  std::vector<float> scale(static_cast<size_t>(g.c)), shift(static_cast<size_t>(g.c));
  return make_loop([=](Context&) mutable {
    const int64_t C = g.c;
    for (int64_t c = 0; c < C; ++c) {
      const formula::MeanVar mv = formula::combine_rank_stats(ap, world, C, c);
      const auto mean_f = static_cast<float>(mv.mean), var_f = static_cast<float>(mv.var);
      const float invstd = formula::bn_invstd(var_f, eps);
      sp[c] = mean_f;
      sp[C + c] = invstd;
      const double unbias = formula::bn_unbias(total);
      rmp[c] = formula::running_mean_update(rmp[c], m, mean_f);
      rvp[c] = formula::running_var_update(rvp[c], m, unbias, var_f);
      scale[static_cast<size_t>(c)] = gp[c] * invstd;
      shift[static_cast<size_t>(c)] = mean_f;
    }
    const float* k = scale.data();
    const float* mu = shift.data();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < g.rows; ++r) {
      const float* xr = xp + r * C;
      float* yr = yp + r * C;
      for (int64_t c = 0; c < C; ++c) yr[c] = (xr[c] - mu[c]) * k[c] + bp[c];
    }
  });
}

// "x, dy, saved -> dgamma, dbeta, sums (f32 2xC: [sum dy, sum dy*xhat])"
KernelPtr make_bn_bwd_reduce(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), saved = need_in(n, 2, "saved");
  const TensorId dgamma = need_out(n, 0, "dgamma"), dbeta = need_out(n, 1, "dbeta"),
                 sums = need_out(n, 2, "sums");
  const Geom g = geom_of(ctx, n, x, {dy}, {dgamma, dbeta});
  expect_dtype(ctx, n, saved, DType::F32, "saved");
  expect_numel(ctx, n, saved, 2 * g.c, "saved (2 x C)");
  expect_dtype(ctx, n, sums, DType::F32, "sums");
  expect_numel(ctx, n, sums, 2 * g.c, "sums (2 x C)");
  const float *xp = ctx.ptr<float>(x), *dyp = ctx.ptr<float>(dy), *sp = ctx.ptr<float>(saved);
  float *dgp = ctx.ptr<float>(dgamma), *dbp = ctx.ptr<float>(dbeta), *sump = ctx.ptr<float>(sums);
  std::vector<double> s(static_cast<size_t>(g.c)), sx(static_cast<size_t>(g.c));
  return make_loop([=](Context&) mutable {
    const int64_t C = g.c;
    channel_sums(g.rows, C, s.data(), sx.data(), [=](int64_t i, int64_t c, double& a, double& b) {
      const double d = dyp[i];
      a += d;
      b += d * (static_cast<double>(xp[i]) - sp[c]);
    });
    for (int64_t c = 0; c < C; ++c) {
      const auto db = static_cast<float>(s[static_cast<size_t>(c)]);
      const auto dg = static_cast<float>(sx[static_cast<size_t>(c)] * sp[C + c]);
      dbp[c] = db;
      dgp[c] = dg;
      sump[c] = db;
      sump[C + c] = dg;
    }
  });
}

// "x, dy, gamma, saved, sums -> dx"
KernelPtr make_bn_bwd_sync(const Node& n, Context& ctx) {
  reject_accumulate(ctx, n);
  const TensorId x = need_in(n, 0, "x"), dy = need_in(n, 1, "dy"), gamma = need_in(n, 2, "gamma"),
                 saved = need_in(n, 3, "saved"), sums = need_in(n, 4, "sums");
  const TensorId dx = need_out(n, 0, "dx");
  const Geom g = geom_of(ctx, n, x, {dy, dx}, {gamma});
  KILN_CHECK(n.attrs.world >= 1, InvalidArgument, "bn_bwd_sync node '", n.label,
             "': world must be >= 1");
  for (TensorId id : {saved, sums}) {
    expect_dtype(ctx, n, id, DType::F32, "saved / sums");
    expect_numel(ctx, n, id, 2 * g.c, "saved / sums (2 x C)");
  }
  const float *xp = ctx.ptr<float>(x), *dyp = ctx.ptr<float>(dy), *gp = ctx.ptr<float>(gamma),
              *sp = ctx.ptr<float>(saved), *sump = ctx.ptr<float>(sums);
  float* dxp = ctx.ptr<float>(dx);
  const double total = static_cast<double>(g.rows) * n.attrs.world;
  // dx = k1 (dy - mdy - (x - mean) k3): k1 = gamma invstd, mdy = sum dy / N,
  // k3 = invstd * (sum dy xhat) / N, as the CUDA bn backward's coefficients.
  std::vector<float> k1(static_cast<size_t>(g.c)), mdy(static_cast<size_t>(g.c)),
      k3(static_cast<size_t>(g.c));
  return make_loop([=](Context&) mutable {
    const int64_t C = g.c;
    for (int64_t c = 0; c < C; ++c) {
      const double invstd = sp[C + c];
      k1[static_cast<size_t>(c)] = static_cast<float>(gp[c] * invstd);
      mdy[static_cast<size_t>(c)] = static_cast<float>(sump[c] / total);
      k3[static_cast<size_t>(c)] = static_cast<float>(sump[C + c] * invstd / total);
    }
    const float *a = k1.data(), *b = mdy.data(), *d = k3.data();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < g.rows; ++r) {
      const float *xr = xp + r * C, *dyr = dyp + r * C;
      float* dxr = dxp + r * C;
      for (int64_t c = 0; c < C; ++c) dxr[c] = a[c] * (dyr[c] - b[c] - (xr[c] - sp[c]) * d[c]);
    }
  });
}

}  // namespace kiln::cpu
