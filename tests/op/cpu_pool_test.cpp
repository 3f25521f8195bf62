// CPU pooling against the float64 reference: max pooling (loop, explicit i32 argmax) with
// ties and NaN, average pooling (oneDNN) with and without counting the padding, global
// average pooling; forward and backward, finite differences of the reference.
#include <gtest/gtest.h>

#include <limits>

#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

struct PoolCase {
  const char* name;
  ref::PoolShape s;  // {n, h, w, c, kh, kw, sh, sw, ph, pw}
};

const PoolCase kCases[] = {
    {"2x2_s2_8x8_c3", {2, 8, 8, 3, 2, 2, 2, 2, 0, 0}},
    {"2x2_s2_odd_7x9_c1", {1, 7, 9, 1, 2, 2, 2, 2, 0, 0}},
    {"3x3_s2_p1_resnet_9x11_c17", {2, 9, 11, 17, 3, 3, 2, 2, 1, 1}},
    {"3x3_s2_p1_resnet_8x8_c8", {3, 8, 8, 8, 3, 3, 2, 2, 1, 1}},
    {"3x3_s1_p1_5x6_c3", {1, 5, 6, 3, 3, 3, 1, 1, 1, 1}},
    {"3x2_s1x2_p1x0_rect_c8", {2, 6, 7, 8, 3, 2, 1, 2, 1, 0}},
};

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

class CpuOpPool : public ::testing::TestWithParam<PoolCase> {};

// Max pooling picks and moves values without arithmetic, so the forward and the argmax are
// exact; the backward sums at most ceil(k/s)^2 <= 4 (3x3/s2) or 9 (3x3/s1) gradients per
// input element: 1e-6 of the sum of their absolute values (a few ulp).
TEST_P(CpuOpPool, MaxPoolForwardArgmaxBackwardMatchReference) {
  const ref::PoolShape& s = GetParam().s;
  OpHarness h;
  const TensorId x = h.tensor("x", {s.n, s.h, s.w, s.c});
  const TensorId y = h.tensor("y", {s.n, s.p(), s.q(), s.c});
  const TensorId am = h.tensor("argmax", {s.n, s.p(), s.q(), s.c}, Region::aux, DType::I32);
  const TensorId y2 = h.tensor("y_no_argmax", {s.n, s.p(), s.q(), s.c});
  const TensorId dy = h.tensor("dy", {s.n, s.p(), s.q(), s.c});
  const TensorId dx = h.tensor("dx", {s.n, s.h, s.w, s.c});
  const Attrs a = pool_attrs(s);
  h.node(OpKind::maxpool_fwd, {x}, {y, am}, a);
  h.node(OpKind::maxpool_fwd, {x}, {y2}, a);  // evaluation: no argmax
  h.node(OpKind::maxpool_bwd, {dy, am}, {dx}, a);
  compile_cpu(h);
  const auto xv = rand_vec(s.x_size(), 71), dyv = rand_vec(s.y_size(), 72);
  h.write(x, xv);
  h.write(dy, dyv);
  h.run();
  std::vector<int32_t> ref_am;
  const ref::Vec want = ref::maxpool_fwd(ref::to_double(xv), s, &ref_am);
  EXPECT_EQ(ref::to_double(h.read(y)), want);
  EXPECT_EQ(ref::to_double(h.read(y2)), want);
  EXPECT_EQ(h.read_i32(am), ref_am);
  const ref::Vec DY = ref::to_double(dyv);
  KILN_EXPECT_SCALED(h.read(dx), ref::maxpool_bwd(DY, ref_am, s),
                     ref::maxpool_bwd(ref::abs_of(DY), ref_am, s), 1e-6, "maxpool_bwd dx");
}

// Average pooling: each output is a sum of <= 9 terms divided by the window size; error
// 1e-5 (SPEC Q2) of the same pooling over |x|, for both divisor conventions.
TEST_P(CpuOpPool, AvgPoolForwardBackwardMatchReference) {
  const ref::PoolShape& s = GetParam().s;
  for (bool include_pad : {true, false}) {
    SCOPED_TRACE(include_pad ? "count_include_pad" : "exclude padding");
    OpHarness h;
    const TensorId x = h.tensor("x", {s.n, s.h, s.w, s.c});
    const TensorId y = h.tensor("y", {s.n, s.p(), s.q(), s.c});
    const TensorId dy = h.tensor("dy", {s.n, s.p(), s.q(), s.c});
    const TensorId dx = h.tensor("dx", {s.n, s.h, s.w, s.c});
    const Attrs a = pool_attrs(s, include_pad);
    h.node(OpKind::avgpool_fwd, {x}, {y}, a);
    h.node(OpKind::avgpool_bwd, {dy}, {dx}, a);
    compile_cpu(h);
    const auto xv = rand_vec(s.x_size(), 73), dyv = rand_vec(s.y_size(), 74);
    h.write(x, xv);
    h.write(dy, dyv);
    h.run();
    const ref::Vec X = ref::to_double(xv), DY = ref::to_double(dyv);
    KILN_EXPECT_SCALED(h.read(y), ref::avgpool_fwd(X, s, include_pad),
                       ref::avgpool_fwd(ref::abs_of(X), s, include_pad), kFp32Tol, "avgpool_fwd y");
    KILN_EXPECT_SCALED(h.read(dx), ref::avgpool_bwd(DY, s, include_pad),
                       ref::avgpool_bwd(ref::abs_of(DY), s, include_pad), kFp32Tol,
                       "avgpool_bwd dx");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuOpPool, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

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

// Global average pooling: a mean over H*W terms (summed in double by the kernel); the
// backward spreads dy / (H W). 1e-5 of the mean of |x| (SPEC Q2).
TEST(CpuOpGap, ForwardBackwardMatchReference) {
  for (const Shape& sh : {Shape{2, 7, 7, 17}, Shape{1, 1, 1, 3}, Shape{3, 5, 3, 8}}) {
    SCOPED_TRACE(sh.str());
    const int64_t n = sh[0], hw = sh[1] * sh[2], c = sh[3];
    OpHarness h;
    const TensorId x = h.tensor("x", sh), y = h.tensor("y", {n, c});
    const TensorId dy = h.tensor("dy", {n, c}), dx = h.tensor("dx", sh);
    h.node(OpKind::gap_fwd, {x}, {y});
    h.node(OpKind::gap_bwd, {dy}, {dx});
    compile_cpu(h);
    const auto xv = rand_vec(n * hw * c, 75), dyv = rand_vec(n * c, 76);
    h.write(x, xv);
    h.write(dy, dyv);
    h.run();
    const ref::Vec X = ref::to_double(xv), DY = ref::to_double(dyv);
    KILN_EXPECT_SCALED(h.read(y), ref::gap_fwd(X, n, hw, c), ref::gap_fwd(ref::abs_of(X), n, hw, c),
                       kFp32Tol, "gap_fwd y");
    KILN_EXPECT_SCALED(h.read(dx), ref::gap_bwd(DY, n, hw, c),
                       ref::gap_bwd(ref::abs_of(DY), n, hw, c), kFp32Tol, "gap_bwd dx");
  }
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
