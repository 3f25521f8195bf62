// CPU elementwise layer ops: ReLU (oneDNN), add (with accumulation and aliasing), dropout
// (counter-based mask: exactness against the shared hash, determinism, statistics).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

// ReLU selects values, no arithmetic: forward and backward are exact. Zeros (+0 and -0)
// give y = 0 and no gradient, as PyTorch's threshold_backward on the output. A NaN input
// stays NaN in the forward (PyTorch's clamp_min; oneDNN's relu would give 0).
TEST(CpuOpRelu, ForwardBackwardExact) {
  for (const Shape& s : {Shape{2, 3, 5, 17}, Shape{1, 1}, Shape{7, 3}}) {
    SCOPED_TRACE(s.str());
    OpHarness h;
    const TensorId x = h.tensor("x", s), y = h.tensor("y", s), dy = h.tensor("dy", s),
                   dx = h.tensor("dx", s);
    h.node(OpKind::relu_fwd, {x}, {y});
    h.node(OpKind::relu_bwd, {y, dy}, {dx});
    compile_cpu(h);
    auto xv = rand_vec(s.numel(), 91);
    xv[0] = 0.0f;
    if (xv.size() > 1) xv[1] = -0.0f;
    const auto dyv = rand_vec(s.numel(), 92);
    h.write(x, xv);
    h.write(dy, dyv);
    h.run();
    const ref::Vec Y = ref::relu_fwd(ref::to_double(xv));
    EXPECT_EQ(ref::to_double(h.read(y)), Y);
    EXPECT_EQ(ref::to_double(h.read(dx)), ref::relu_bwd(Y, ref::to_double(dyv)));
    xv.back() = std::numeric_limits<float>::quiet_NaN();
    h.write(x, xv);
    h.run();
    EXPECT_TRUE(std::isnan(h.read(y).back())) << "ReLU must propagate NaN";
  }
}

// FP32 addition is correctly rounded, so the kernel must equal the same FP32 expression bit
// for bit: y = a + b, y += a + b (accumulate, evaluated as y + (a + b)), y = a, y += a.
TEST(CpuOpAdd, OverwriteAccumulateAndAliasingExact) {
  const Shape s{3, 4, 5, 2};
  const int64_t n = s.numel();
  OpHarness h;
  const TensorId a = h.tensor("a", s), b = h.tensor("b", s);
  const TensorId y1 = h.tensor("y1", s), y2 = h.tensor("y2", s), y3 = h.tensor("y3", s),
                 y4 = h.tensor("y4", s);
  const TensorId inplace = h.tensor("inplace", s);
  Attrs acc;
  acc.accumulate = true;
  h.node(OpKind::add, {a, b}, {y1});
  h.node(OpKind::add, {a, b}, {y2}, acc);
  h.node(OpKind::add, {a}, {y3});
  h.node(OpKind::add, {a, kNoTensor}, {y4}, acc);
  h.node(OpKind::add, {inplace, b}, {inplace});  // residual sum written over its input
  compile_cpu(h);
  const auto av = rand_vec(n, 93), bv = rand_vec(n, 94), y2v = rand_vec(n, 95),
             y4v = rand_vec(n, 96), iv = rand_vec(n, 97);
  h.write(a, av);
  h.write(b, bv);
  h.write(y2, y2v);
  h.write(y4, y4v);
  h.write(inplace, iv);
  h.run();
  std::vector<float> e1(n), e2(n), e4(n), ei(n);
  for (int64_t i = 0; i < n; ++i) {
    e1[i] = av[i] + bv[i];
    e2[i] = y2v[i] + (av[i] + bv[i]);
    e4[i] = y4v[i] + av[i];
    ei[i] = iv[i] + bv[i];
  }
  EXPECT_EQ(h.read(y1), e1);
  EXPECT_EQ(h.read(y2), e2);
  EXPECT_EQ(h.read(y3), av);
  EXPECT_EQ(h.read(y4), e4);
  EXPECT_EQ(h.read(inplace), ei);
}

struct DropoutProgram {
  OpHarness h;
  TensorId x, step, y, mask, dy, dx;
  DropoutProgram(int64_t n, float p, uint64_t seed) {
    x = h.tensor("x", {n});
    y = h.tensor("y", {n});
    dy = h.tensor("dy", {n});
    dx = h.tensor("dx", {n});
    mask = h.tensor("mask", {n}, Region::aux, DType::U8);
    step = h.tensor("step", {1}, Region::scalars, DType::I32);
    Attrs a;
    a.p = p;
    a.seed = seed;
    h.node(OpKind::dropout_fwd, {x, step}, {y, mask}, a);
    h.node(OpKind::dropout_bwd, {dy, mask}, {dx}, a);
    compile_cpu(h);
  }
  void run_step(int32_t s) {
    h.write_i32(step, {s});
    h.run();
  }
};

// The mask is the shared counter-based hash (ref::dropout_keep) bit for bit, so the CUDA
// kernel, computing the same function, draws the same mask; y and dx are x and dy times the
// FP32 scale 1/(1-p) where kept, exactly.
TEST(CpuOpDropout, MaskIsTheSharedHashAndScalingIsExact) {
  const int64_t n = 4099;
  const float p = 0.3f;
  const uint64_t seed = 1234;
  DropoutProgram d(n, p, seed);
  const auto xv = rand_vec(n, 101), dyv = rand_vec(n, 102);
  d.h.write(d.x, xv);
  d.h.write(d.dy, dyv);
  d.run_step(7);
  const auto mask = d.h.read_u8(d.mask);
  const auto yv = d.h.read(d.y), dxv = d.h.read(d.dx);
  const float scale = 1.0f / (1.0f - p);
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = ref::dropout_keep(seed, 7, static_cast<uint64_t>(i), p);
    ASSERT_EQ(mask[i], keep ? 1 : 0) << "element " << i;
    ASSERT_EQ(yv[i], keep ? xv[i] * scale : 0.0f) << "element " << i;
    ASSERT_EQ(dxv[i], keep ? dyv[i] * scale : 0.0f) << "element " << i;
  }
}

// The same (seed, step) gives the same mask; another step or seed gives a fresh one, as
// uncorrelated as independent draws: the fraction kept in both is (1-p)^2 within 5 sigma.
TEST(CpuOpDropout, DeterministicPerStepAndSeedAndUncorrelatedAcross) {
  const int64_t n = 1 << 16;
  const float p = 0.5f;
  DropoutProgram a(n, p, 99), b(n, p, 100);
  a.h.write(a.x, std::vector<float>(n, 1.0f));
  b.h.write(b.x, std::vector<float>(n, 1.0f));
  a.run_step(3);
  const auto m3 = a.h.read_u8(a.mask);
  a.run_step(3);
  EXPECT_EQ(a.h.read_u8(a.mask), m3) << "same seed and step must give the same mask";
  a.run_step(4);
  const auto m4 = a.h.read_u8(a.mask);
  b.run_step(3);
  const auto other_seed = b.h.read_u8(b.mask);
  auto both = [&](const std::vector<uint8_t>& u, const std::vector<uint8_t>& v) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; ++i) c += u[i] && v[i];
    return static_cast<double>(c) / n;
  };
  const double q = (1 - p) * (1 - p), sigma = std::sqrt(q * (1 - q) / n);
  EXPECT_NE(m4, m3);
  EXPECT_NEAR(both(m3, m4), q, 5 * sigma) << "masks of consecutive steps are correlated";
  EXPECT_NEAR(both(m3, other_seed), q, 5 * sigma) << "masks of two seeds are correlated";
}

// Statistics: the kept fraction is 1-p within 5 binomial sigma (a false alarm ~1 in 3.5
// million), the output mean is the input mean (1 here) within 5 sigma of the scaled
// Bernoulli, and neighbouring elements are independent (pairs kept together ~ (1-p)^2).
// p = 0 keeps everything and p = 1 drops everything, with no NaN from 0 * Inf.
TEST(CpuOpDropout, KeepFractionAndMeanMatchTheProbability) {
  const int64_t n = 1 << 17;
  for (float p : {0.1f, 0.5f, 0.9f}) {
    SCOPED_TRACE(p);
    DropoutProgram d(n, p, 5);
    d.h.write(d.x, std::vector<float>(n, 1.0f));
    d.run_step(0);
    const auto mask = d.h.read_u8(d.mask);
    const auto yv = d.h.read(d.y);
    double kept = 0, mean = 0, pairs = 0;
    for (int64_t i = 0; i < n; ++i) {
      kept += mask[i];
      mean += yv[i];
      if (i % 2 == 1) pairs += mask[i] && mask[i - 1];
    }
    kept /= n;
    mean /= n;
    pairs /= n / 2;
    const double q = 1.0 - p;
    EXPECT_NEAR(kept, q, 5 * std::sqrt(q * p / n));
    EXPECT_NEAR(mean, 1.0, 5 * std::sqrt(p / q / n));  // Var(mask/q) = p/q
    EXPECT_NEAR(pairs, q * q, 5 * std::sqrt(q * q * (1 - q * q) / (n / 2)));
  }
  for (float p : {0.0f, 1.0f}) {
    DropoutProgram d(64, p, 5);
    const auto xv = rand_vec(64, 103);
    d.h.write(d.x, xv);
    d.h.write(d.dy, xv);
    d.run_step(1);
    EXPECT_EQ(d.h.read(d.y), p == 0.0f ? xv : std::vector<float>(64, 0.0f));
    EXPECT_EQ(d.h.read(d.dx), p == 0.0f ? xv : std::vector<float>(64, 0.0f));
  }
}

}  // namespace
}  // namespace kiln::test
