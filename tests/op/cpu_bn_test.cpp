// CPU batch normalisation (oneDNN + the saved/running-statistics loops): running statistics over
// two steps and finite-difference checks. Each op against the float64 reference (saved and
// running statistics, inference, backward) is the sweep's rows (tests/sweep/op_sweep_test.cpp).
#include <gtest/gtest.h>

#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

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
