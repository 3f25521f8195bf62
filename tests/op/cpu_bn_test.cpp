// CPU batch normalisation (oneDNN + the saved/running-statistics loops) against the float64
// reference: training forward with the saved mean/invstd and PyTorch's running-statistics
// update (unbiased variance), inference forward, backward; finite-difference checks.
#include <gtest/gtest.h>

#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

struct BnCase {
  const char* name;
  Shape shape;  // [N, H, W, C] or [N, C]
  float momentum;
  float lo = 1.0f, hi = 5.0f;  // x ~ U(lo, hi): mean 3, spread 2 unless said
};

const BnCase kCases[] = {
    {"n2_5x3_c3", {2, 5, 3, 3}, 0.1f},
    {"batch1_7x7_c17", {1, 7, 7, 17}, 0.1f},
    {"n4_2x2_c8", {4, 2, 2, 8}, 0.3f},
    {"n8_1x1_c1", {8, 1, 1, 1}, 0.1f},
    {"rank2_n6_c17", {6, 17}, 0.1f},
    {"count1_c3", {1, 1, 1, 3}, 0.1f},
    // variance ~ eps (8e-6 vs 1e-5): the invstd -> variance conversion of the backward matters
    // most here, and the centring cancels ~7 of FP32's 24 bits (|x| / std ~ 170).
    {"variance_near_eps_c8", {2, 4, 4, 8}, 0.1f, 0.99f, 1.01f},
};

struct BnProgram {
  OpHarness h;
  int64_t c = 0, count = 0;
  TensorId x, gamma, beta, rm, rv, y, saved, dy, dx, dgamma, dbeta, y_inf;
  // fwd_only: just the training forward (finite differences need nothing else).
  BnProgram(const Shape& s, float momentum, bool fwd_only = false, float eps = 1e-5f) {
    c = s[s.rank() - 1];
    count = s.numel() / c;
    x = h.tensor("x", s);
    y = h.tensor("y", s);
    dy = h.tensor("dy", s);
    dx = h.tensor("dx", s);
    y_inf = h.tensor("y_inf", s);
    gamma = h.tensor("gamma", {c}, Region::params_f32);
    beta = h.tensor("beta", {c}, Region::params_f32);
    dgamma = h.tensor("dgamma", {c}, Region::grads_f32);
    dbeta = h.tensor("dbeta", {c}, Region::grads_f32);
    rm = h.tensor("running_mean", {c}, Region::bn_running);
    rv = h.tensor("running_var", {c}, Region::bn_running);
    saved = h.tensor("saved", {2, c}, Region::bn_saved);
    Attrs a;
    a.eps = eps;
    a.bn_momentum = momentum;
    // Inference first (it reads the running statistics before the training forward updates them).
    if (!fwd_only) h.node(OpKind::bn_fwd_infer, {x, gamma, beta, rm, rv}, {y_inf}, a);
    h.node(OpKind::bn_fwd_train, {x, gamma, beta, rm, rv}, {y, saved}, a);
    if (!fwd_only) h.node(OpKind::bn_bwd, {x, dy, gamma, saved}, {dx, dgamma, dbeta}, a);
    compile_cpu(h);
  }
};

class CpuOpBn : public ::testing::TestWithParam<BnCase> {};

TEST_P(CpuOpBn, TrainInferBackwardAndRunningStatsMatchFloat64Reference) {
  const BnCase& bc = GetParam();
  BnProgram p(bc.shape, bc.momentum);
  const int64_t c = p.c, count = p.count;
  const double eps = 1e-5;
  // x with a mean of 3 and spread 2 per element: the centring cancels, as in real layers.
  const auto x = rand_vec(count * c, 31, bc.lo, bc.hi), dy = rand_vec(count * c, 32);
  const auto gamma = rand_vec(c, 33, 0.5f, 1.5f), beta = rand_vec(c, 34);
  const auto rm = rand_vec(c, 35), rv = rand_vec(c, 36, 0.5f, 1.5f);
  p.h.write(p.x, x);
  p.h.write(p.dy, dy);
  p.h.write(p.gamma, gamma);
  p.h.write(p.beta, beta);
  p.h.write(p.rm, rm);
  p.h.write(p.rv, rv);
  p.h.run();

  const ref::Vec X = ref::to_double(x), DY = ref::to_double(dy), G = ref::to_double(gamma),
                 B = ref::to_double(beta);
  ref::Vec RM = ref::to_double(rm), RV = ref::to_double(rv);
  const ref::BnForward f = ref::bn_fwd_train(X, G, B, c, eps);

  // Magnitudes for the error bounds. x - mean cancels: its FP32 error scales with |x| + |mean|,
  // not |x - mean|, so y's error scales with |gamma| (|x| + |mean|) invstd + |beta|.
  ref::Vec mag_y(X.size()), mag_y_inf(X.size()), mag_dx(X.size());
  ref::Vec sum_abs_dy(static_cast<size_t>(c), 0.0), sum_abs_dy_x(static_cast<size_t>(c), 0.0);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < c; ++j) {
      const size_t k = static_cast<size_t>(i * c + j);
      const double xa =
          (std::fabs(X[k]) + std::fabs(f.mean[j])) * f.invstd[j];  // bound on |xhat|'s error scale
      mag_y[k] = std::fabs(G[j]) * xa + std::fabs(B[j]);
      mag_y_inf[k] =
          std::fabs(G[j]) * (std::fabs(X[k]) + std::fabs(RM[j])) / std::sqrt(RV[j] + eps) +
          std::fabs(B[j]);
      sum_abs_dy[j] += std::fabs(DY[k]);
      sum_abs_dy_x[j] += std::fabs(DY[k]) * xa;
    }
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < c; ++j) {
      const size_t k = static_cast<size_t>(i * c + j);
      const double xa = (std::fabs(X[k]) + std::fabs(f.mean[j])) * f.invstd[j];
      mag_dx[k] = std::fabs(G[j]) * f.invstd[j] / count *
                  (count * std::fabs(DY[k]) + sum_abs_dy[j] + xa * sum_abs_dy_x[j]);
    }

  // Inference: y = gamma (x - rm) / sqrt(rv + eps) + beta, a few operations per element: 1e-5
  // (SPEC Q2) against a magnitude that includes the cancelling x - rm.
  KILN_EXPECT_SCALED(p.h.read(p.y_inf), ref::bn_fwd_infer(X, G, B, RM, RV, c, eps), mag_y_inf,
                     kFp32Tol, "bn_fwd_infer y");

  // Training forward. The batch statistics are sums over N*H*W (<= 49 here), the output a
  // few operations on them: 1e-5 of the magnitudes above.
  KILN_EXPECT_SCALED(p.h.read(p.y), f.y, mag_y, kFp32Tol, "bn_fwd_train y");
  const std::vector<float> saved = p.h.read(p.saved);
  const std::vector<float> mean(saved.begin(), saved.begin() + c),
      invstd(saved.begin() + c, saved.end());
  ref::Vec mag_mean(static_cast<size_t>(c), 0.0);
  for (size_t k = 0; k < X.size(); ++k)
    mag_mean[k % static_cast<size_t>(c)] += std::fabs(X[k]) / count;
  KILN_EXPECT_SCALED(mean, f.mean, mag_mean, kFp32Tol, "saved mean");
  // invstd = 1/sqrt(var + eps). oneDNN computes the variance in two passes (mean, then the
  // mean of squared centred values): x - mean is exact when the two are within a factor of 2
  // (Sterbenz), and an error d in the mean changes the variance only by d^2, so var carries
  // a few ulp regardless of |mean| / std, and invstd half of that: 1e-5 relative. With
  // count = 1 the variance is 0 and invstd = 1/sqrt(eps).
  KILN_EXPECT_REL(invstd, f.invstd, 1e-30, kFp32Tol, "saved invstd");

  // Running statistics (PyTorch's convention, unbiased variance): a handful of operations on
  // the batch statistics, whose errors are bounded above: 1e-5 relative.
  ref::bn_running_update(RM, RV, f.mean, f.var, count, bc.momentum);
  ref::Vec mag_rm(static_cast<size_t>(c));
  for (int64_t j = 0; j < c; ++j)
    mag_rm[j] = (1 - bc.momentum) * std::fabs(rm[j]) + bc.momentum * mag_mean[j];
  KILN_EXPECT_SCALED(p.h.read(p.rm), RM, mag_rm, kFp32Tol, "running_mean");
  KILN_EXPECT_REL(p.h.read(p.rv), RV, 1e-30, kFp32Tol, "running_var");

  // Backward, from the kernel's own saved statistics (converted back to a variance for
  // oneDNN: ~2 ulp, see cpu/bn.cpp). dgamma and dbeta are sums over N*H*W; dx combines them:
  // errors scale with the sums of absolute values (mag_dx), 1e-5 of it.
  const ref::BnBackward bw = ref::bn_bwd(X, DY, G, f.mean, f.invstd, c);
  KILN_EXPECT_SCALED(p.h.read(p.dx), bw.dx, mag_dx, kFp32Tol, "bn_bwd dx");
  KILN_EXPECT_SCALED(p.h.read(p.dgamma), bw.dgamma, sum_abs_dy_x, kFp32Tol, "bn_bwd dgamma");
  KILN_EXPECT_SCALED(p.h.read(p.dbeta), bw.dbeta, sum_abs_dy, kFp32Tol, "bn_bwd dbeta");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuOpBn, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// Two training steps compound the running statistics as PyTorch does; the saved statistics
// are overwritten each step.
TEST(CpuOpBnRunning, TwoStepsCompoundTheMomentumUpdate) {
  BnProgram p({3, 2, 2, 4}, 0.1f);
  const int64_t c = 4, count = 12;
  const auto gamma = rand_vec(c, 41, 0.5f, 1.5f), beta = rand_vec(c, 42);
  p.h.write(p.gamma, gamma);
  p.h.write(p.beta, beta);
  p.h.write(p.rm, std::vector<float>(c, 0.0f));  // PyTorch's initial running statistics
  p.h.write(p.rv, std::vector<float>(c, 1.0f));
  p.h.write(p.dy, rand_vec(count * c, 43));
  ref::Vec RM(c, 0.0), RV(c, 1.0);
  for (int step = 0; step < 2; ++step) {
    const auto x = rand_vec(count * c, 44 + step, -2.0f, 3.0f);
    p.h.write(p.x, x);
    p.h.run();
    const ref::BnForward f =
        ref::bn_fwd_train(ref::to_double(x), ref::to_double(gamma), ref::to_double(beta), c, 1e-5);
    ref::bn_running_update(RM, RV, f.mean, f.var, count, 0.1);
    // Values of order 0.1 to 1 after a few FP32 operations: 1e-5 relative, absolute below 1e-2
    // (a running mean near 0 is an absolute quantity).
    KILN_EXPECT_REL(p.h.read(p.rm), RM, 1e-2, kFp32Tol,
                    "running_mean step " + std::to_string(step));
    KILN_EXPECT_REL(p.h.read(p.rv), RV, 1e-2, kFp32Tol, "running_var step " + std::to_string(step));
  }
}

// The reference backward is the gradient of the reference training forward (through the
// batch statistics): L = sum(y * r), central differences in double with h = 1e-5. BN is
// smooth; truncation O(h^2 f''') ~ 1e-10 and rounding O(1e-16 |L| / h) ~ 1e-10 against
// gradients of order 0.1..1: 1e-7 relative (floor 1e-3).
TEST(CpuOpBnGrad, ReferenceBackwardIsTheGradientOfTheForward) {
  const int64_t c = 3, count = 10;
  const ref::Vec x = ref::to_double(rand_vec(count * c, 51, -1.0f, 2.0f)),
                 r = ref::to_double(rand_vec(count * c, 52));
  const ref::Vec g = ref::to_double(rand_vec(c, 53, 0.5f, 1.5f)),
                 b = ref::to_double(rand_vec(c, 54));
  auto loss_x = [&](const ref::Vec& v) {
    return ref::dot(ref::bn_fwd_train(v, g, b, c, 1e-5).y, r);
  };
  auto loss_g = [&](const ref::Vec& v) {
    return ref::dot(ref::bn_fwd_train(x, v, b, c, 1e-5).y, r);
  };
  auto loss_b = [&](const ref::Vec& v) {
    return ref::dot(ref::bn_fwd_train(x, g, v, c, 1e-5).y, r);
  };
  const ref::BnForward f = ref::bn_fwd_train(x, g, b, c, 1e-5);
  const ref::BnBackward bw = ref::bn_bwd(x, r, g, f.mean, f.invstd, c);
  KILN_EXPECT_REL(ref::numeric_grad(loss_x, x), bw.dx, 1e-3, 1e-7, "fd dx");
  KILN_EXPECT_REL(ref::numeric_grad(loss_g, g), bw.dgamma, 1e-3, 1e-7, "fd dgamma");
  KILN_EXPECT_REL(ref::numeric_grad(loss_b, b), bw.dbeta, 1e-3, 1e-7, "fd dbeta");
}

// The kernel's dx against finite differences of the kernel's FP32 training forward,
// L = sum(y * r) in double. Step h = 1e-2 on x of spread ~1: truncation h^2 |f'''| / 6 ~ 1e-5;
// rounding of y (~1e-7 |y|, 24 terms) gives ~1e-6 / 2h = 5e-5 absolute. Gradients are of
// order 0.1..1: 1e-3 absolute (below 1) / relative (above).
TEST(CpuOpBnGrad, KernelBackwardMatchesFiniteDifferencesOfKernelForward) {
  const int64_t c = 2, count = 12;
  auto x = rand_vec(count * c, 61, -1.0f, 2.0f);
  const auto r = rand_vec(count * c, 62), gamma = rand_vec(c, 63, 0.5f, 1.5f),
             beta = rand_vec(c, 64);
  BnProgram full({3, 2, 2, c}, 0.1f);
  full.h.write(full.gamma, gamma);
  full.h.write(full.beta, beta);
  full.h.write(full.x, x);
  full.h.write(full.dy, r);
  full.h.run();
  const ref::Vec dx = ref::to_double(full.h.read(full.dx));
  BnProgram p({3, 2, 2, c}, 0.1f, /*fwd_only=*/true);
  p.h.write(p.gamma, gamma);
  p.h.write(p.beta, beta);
  auto loss = [&](const std::vector<float>& xv) {
    p.h.write(p.x, xv);
    p.h.run();
    return ref::dot(ref::to_double(p.h.read(p.y)), ref::to_double(r));
  };
  ref::Vec fd(x.size());
  const float h = 1e-2f;
  for (size_t i = 0; i < x.size(); ++i) {
    const float x0 = x[i];
    x[i] = x0 + h;
    const double lp = loss(x);
    x[i] = x0 - h;
    const double lm = loss(x);
    x[i] = x0;
    fd[i] = (lp - lm) / (static_cast<double>(x0 + h) - static_cast<double>(x0 - h));
  }
  KILN_EXPECT_REL(dx, fd, 1.0, 1e-3, "kernel dx vs fd");
}

}  // namespace
}  // namespace kiln::test
