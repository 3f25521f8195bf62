// CPU dropout: determinism and statistics of the counter-based mask. ReLU, add and the mask's
// exactness against the shared hash are the sweep's rows (tests/sweep/op_sweep_test.cpp).
#include <gtest/gtest.h>

#include <cmath>

#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

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
