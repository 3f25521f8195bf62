// CPU pooling: max pooling's ties and NaN, finite differences of the reference. The kernels
// against the float64 reference (max with its argmax, average with both divisors, global
// average) are the sweep's rows (tests/sweep/op_sweep_test.cpp).
#include <gtest/gtest.h>

#include <limits>

#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

Attrs pool_attrs(const ref::PoolShape& s, bool include_pad = true) {
  Attrs a;
  a.kh = static_cast<int>(s.kh);
  a.kw = static_cast<int>(s.kw);
  a.sh = static_cast<int>(s.sh);
  a.sw = static_cast<int>(s.sw);
  a.ph = static_cast<int>(s.ph);
  a.pw = static_cast<int>(s.pw);
  a.count_include_pad = include_pad;
  return a;
}

// Ties go to the first element in window order (rows, then columns); a NaN wins (PyTorch's
// rule), so it reaches the output and the overflow check. Padding is never chosen.
TEST(CpuOpPoolMax, TiesPickTheFirstElementAndNanPropagates) {
  const ref::PoolShape s{1, 4, 4, 2, 3, 3, 2, 2, 1, 1};  // ResNet's 3x3/s2/p1 -> 2x2
  OpHarness h;
  const TensorId x = h.tensor("x", {1, 4, 4, 2});
  const TensorId y = h.tensor("y", {1, 2, 2, 2});
  const TensorId am = h.tensor("argmax", {1, 2, 2, 2}, Region::aux, DType::I32);
  h.node(OpKind::maxpool_fwd, {x}, {y, am}, pool_attrs(s));
  compile_cpu(h);
  // Channel 0: all equal. Channel 1: equal except a NaN at (2, 3).
  std::vector<float> xv(32, -3.0f);
  xv[(2 * 4 + 3) * 2 + 1] = std::numeric_limits<float>::quiet_NaN();
  h.write(x, xv);
  h.run();
  const auto yv = h.read(y);
  const auto amv = h.read_i32(am);
  // Windows (rows x cols): (0,0): [0,1]x[0,1] -> first (0,0) = 0; (0,1): [0,1]x[1,3] -> (0,1) = 1;
  // (1,0): [1,3]x[0,1] -> (1,0) = 4; (1,1): [1,3]x[1,3] -> (1,1) = 5.
  const int32_t first[4] = {0, 1, 4, 5};
  for (int o = 0; o < 4; ++o) {
    EXPECT_EQ(yv[o * 2], -3.0f);
    EXPECT_EQ(amv[o * 2], first[o]) << "output " << o;
  }
  EXPECT_EQ(amv[1 * 2 + 1], 1);  // window (0,1) does not contain row 2
  EXPECT_TRUE(std::isnan(yv[3 * 2 + 1]));
  EXPECT_EQ(amv[3 * 2 + 1], 2 * 4 + 3);
}

// The reference backward of max, average and global average pooling is the gradient of the
// forward: L = sum(y * r), central differences in double. Average pooling is linear: a large
// step (h = 1e-2) leaves only rounding, ~1e-16 |L| / h ~ 1e-13: 1e-8 relative (floor 1e-3).
// Max pooling is linear while no window changes its maximum: h = 1e-5 is far below the gaps
// between random inputs (~1e-2 for 9 values), and the rounding is ~1e-16 |L| / h ~ 1e-10,
// i.e. 1e-7 at the 1e-3 floor: 1e-6.
TEST(CpuOpPoolGrad, ReferenceBackwardIsTheGradientOfTheForward) {
  const ref::PoolShape s{1, 5, 6, 2, 3, 3, 2, 2, 1, 1};
  const ref::Vec x = ref::to_double(rand_vec(s.x_size(), 77)),
                 r = ref::to_double(rand_vec(s.y_size(), 78));
  std::vector<int32_t> am;
  ref::maxpool_fwd(x, s, &am);
  auto max_loss = [&](const ref::Vec& v) { return ref::dot(ref::maxpool_fwd(v, s, nullptr), r); };
  KILN_EXPECT_REL(ref::numeric_grad(max_loss, x, 1e-5), ref::maxpool_bwd(r, am, s), 1e-3, 1e-6,
                  "fd maxpool dx");
  for (bool include_pad : {true, false}) {
    auto avg_loss = [&](const ref::Vec& v) {
      return ref::dot(ref::avgpool_fwd(v, s, include_pad), r);
    };
    KILN_EXPECT_REL(ref::numeric_grad(avg_loss, x, 1e-2), ref::avgpool_bwd(r, s, include_pad), 1e-3,
                    1e-8, "fd avgpool dx");
  }
  const ref::Vec rg = ref::to_double(rand_vec(2, 79));
  auto gap_loss = [&](const ref::Vec& v) { return ref::dot(ref::gap_fwd(v, 1, 30, 2), rg); };
  KILN_EXPECT_REL(ref::numeric_grad(gap_loss, x, 1e-2), ref::gap_bwd(rg, 1, 30, 2), 1e-3, 1e-8,
                  "fd gap dx");
}

}  // namespace
}  // namespace kiln::test
