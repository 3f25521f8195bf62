// CPU convolution (oneDNN): finite-difference checks of the reference's gradients and of the
// kernel's, and shape errors. The kernels against the float64 reference over odd sizes,
// strides, padding and kernels are the sweep's rows (tests/sweep/op_sweep_test.cpp).
#include <gtest/gtest.h>

#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

Attrs conv_attrs(const ref::ConvShape& s) {
  Attrs a;
  a.kh = static_cast<int>(s.r);
  a.kw = static_cast<int>(s.s);
  a.sh = static_cast<int>(s.sh);
  a.sw = static_cast<int>(s.sw);
  a.ph = static_cast<int>(s.ph);
  a.pw = static_cast<int>(s.pw);
  return a;
}

struct ConvProgram {
  OpHarness h;
  TensorId x, w, b = kNoTensor, y, dy, dx, dw, db = kNoTensor;
  // fwd_only: just the forward node (finite differences need nothing else).
  ConvProgram(const ref::ConvShape& s, bool bias, bool fwd_only = false) {
    x = h.tensor("x", {s.n, s.h, s.w, s.c}, Region::features, DType::F32, Layout::NHWC);
    w = h.tensor("w", {s.k, s.r, s.s, s.c}, Region::params_f32, DType::F32, Layout::KRSC);
    y = h.tensor("y", {s.n, s.p(), s.q(), s.k}, Region::features, DType::F32, Layout::NHWC);
    dy = h.tensor("dy", {s.n, s.p(), s.q(), s.k}, Region::features, DType::F32, Layout::NHWC);
    dx = h.tensor("dx", {s.n, s.h, s.w, s.c}, Region::features, DType::F32, Layout::NHWC);
    dw = h.tensor("dw", {s.k, s.r, s.s, s.c}, Region::grads_f32, DType::F32, Layout::KRSC);
    if (bias) {
      b = h.tensor("b", {s.k}, Region::params_f32);
      db = h.tensor("db", {s.k}, Region::grads_f32);
    }
    const Attrs a = conv_attrs(s);
    h.node(OpKind::conv_fwd, bias ? std::vector<TensorId>{x, w, b} : std::vector<TensorId>{x, w},
           {y}, a);
    if (!fwd_only) {
      h.node(OpKind::conv_bwd_data, {dy, w}, {dx}, a);
      h.node(OpKind::conv_bwd_weight, {x, dy},
             bias ? std::vector<TensorId>{dw, db} : std::vector<TensorId>{dw}, a);
    }
    compile_cpu(h);
  }
};

// The reference's backward is the gradient of its forward: L = sum(y * r), checked by
// central differences in double. Convolution is linear, so with a large step (h = 1e-2) the
// quotient has no truncation error, only rounding (~1e-15 |L| / 2h ~ 1e-12): 1e-8 relative
// (floor 1e-3) is generous, and any wrong index would show as an error of order 1.
TEST(CpuOpConvGrad, ReferenceBackwardIsTheGradientOfTheForward) {
  const ref::ConvShape s{2, 5, 4, 3, 2, 3, 3, 2, 2, 1, 1};
  const ref::Vec x = ref::to_double(rand_vec(s.x_size(), 11)),
                 w = ref::to_double(rand_vec(s.w_size(), 12)),
                 b = ref::to_double(rand_vec(s.k, 13)),
                 r = ref::to_double(rand_vec(s.y_size(), 14));
  auto loss_x = [&](const ref::Vec& v) { return ref::dot(ref::conv_fwd(v, w, b, s), r); };
  auto loss_w = [&](const ref::Vec& v) { return ref::dot(ref::conv_fwd(x, v, b, s), r); };
  auto loss_b = [&](const ref::Vec& v) { return ref::dot(ref::conv_fwd(x, w, v, s), r); };
  KILN_EXPECT_REL(ref::numeric_grad(loss_x, x, 1e-2), ref::conv_bwd_data(r, w, s), 1e-3, 1e-8,
                  "fd dx");
  KILN_EXPECT_REL(ref::numeric_grad(loss_w, w, 1e-2), ref::conv_bwd_weight(x, r, s), 1e-3, 1e-8,
                  "fd dw");
  KILN_EXPECT_REL(ref::numeric_grad(loss_b, b, 1e-2), ref::conv_bwd_bias(r, s), 1e-3, 1e-8,
                  "fd db");
}

// The kernel's backward against finite differences of the kernel's own FP32 forward,
// L = sum(y * r) accumulated in double. conv is linear, so the only error is FP32 rounding
// of y: |dL| <= ~1e-7 * sum|y r| ~ 1e-7 * 10, divided by 2h = 0.2 -> ~5e-6 absolute, against
// gradients of order 1: a 1e-4 bound (absolute below 1, relative above) leaves room and
// still catches any misplaced index or missing term (errors of order 0.1 to 1).
TEST(CpuOpConvGrad, KernelBackwardMatchesFiniteDifferencesOfKernelForward) {
  const ref::ConvShape s{1, 4, 5, 2, 2, 3, 3, 2, 2, 1, 1};
  auto x = rand_vec(s.x_size(), 21), w = rand_vec(s.w_size(), 22), b = rand_vec(s.k, 23);
  const auto r = rand_vec(s.y_size(), 24);
  ConvProgram full(s, true);
  full.h.write(full.x, x);
  full.h.write(full.w, w);
  full.h.write(full.b, b);
  full.h.write(full.dy, r);
  full.h.run();
  const ref::Vec dx = ref::to_double(full.h.read(full.dx)),
                 dw = ref::to_double(full.h.read(full.dw));
  ConvProgram p(s, true, /*fwd_only=*/true);
  p.h.write(p.b, b);
  auto loss = [&](const std::vector<float>& xv, const std::vector<float>& wv) {
    p.h.write(p.x, xv);
    p.h.write(p.w, wv);
    p.h.run();
    return ref::dot(ref::to_double(p.h.read(p.y)), ref::to_double(r));
  };
  const float h = 0.1f;
  ref::Vec fd_x(x.size()), fd_w(w.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float x0 = x[i];
    x[i] = x0 + h;
    const double lp = loss(x, w);
    x[i] = x0 - h;
    const double lm = loss(x, w);
    x[i] = x0;
    fd_x[i] = (lp - lm) / (2.0 * h);
  }
  for (size_t i = 0; i < w.size(); ++i) {
    const float w0 = w[i];
    w[i] = w0 + h;
    const double lp = loss(x, w);
    w[i] = w0 - h;
    const double lm = loss(x, w);
    w[i] = w0;
    fd_w[i] = (lp - lm) / (2.0 * h);
  }
  KILN_EXPECT_REL(dx, fd_x, 1.0, 1e-4, "kernel dx vs fd");
  KILN_EXPECT_REL(dw, fd_w, 1.0, 1e-4, "kernel dw vs fd");
}

// Bad shapes are rejected at compile time with a message naming the node.
TEST(CpuOpConvErrors, MismatchedOutputShapeIsAShapeError) {
  OpHarness h;
  const TensorId x = h.tensor("x", {1, 8, 8, 3}),
                 w = h.tensor("w", {4, 3, 3, 3}, Region::params_f32);
  const TensorId y = h.tensor("y", {1, 7, 7, 4});  // a 3x3/s1/p1 conv gives 8x8
  Attrs a;
  a.kh = a.kw = 3;
  a.ph = a.pw = 1;
  h.node(OpKind::conv_fwd, {x, w}, {y}, a).label = "layer1.conv";
  try {
    compile_cpu(h);
    FAIL() << "expected a Shape error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Shape);
    EXPECT_NE(std::string(e.what()).find("layer1.conv"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln::test
