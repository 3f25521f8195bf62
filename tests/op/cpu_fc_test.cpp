// CPU fully connected layers (oneDNN inner product) against the float64 reference: forward,
// backward data, backward weights and bias, including a flattened NHWC input; finite
// differences of the reference.
#include <gtest/gtest.h>

#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

struct FcCase {
  const char* name;
  Shape x;  // [N, K] or a flattened map [N, H, W, C]
  int64_t o;
  bool bias;
};

const FcCase kCases[] = {
    {"n1_k1_o1", {1, 1}, 1, true},
    {"n2_k17_o3", {2, 17}, 3, true},
    {"n5_k64_o10_nobias", {5, 64}, 10, false},
    {"n3_k37_o17", {3, 37}, 17, true},
    {"flattened_n2_2x2x3_o8", {2, 2, 2, 3}, 8, true},
    {"n8_k512_o100", {8, 512}, 100, true},
};

class CpuOpFc : public ::testing::TestWithParam<FcCase> {};

// Each output is a sum of K (forward), O (backward data) or N (backward weights) products:
// 1e-5 of the sum of their absolute values (kFp32Tol; K <= 512 here).
TEST_P(CpuOpFc, ForwardAndBackwardMatchFloat64Reference) {
  const FcCase& c = GetParam();
  const int64_t n = c.x[0], k = c.x.numel() / n, o = c.o;
  OpHarness h;
  const TensorId x = h.tensor("x", c.x), dx = h.tensor("dx", c.x);
  const TensorId w = h.tensor("w", {o, k}, Region::params_f32, DType::F32, Layout::OI);
  const TensorId dw = h.tensor("dw", {o, k}, Region::grads_f32, DType::F32, Layout::OI);
  const TensorId y = h.tensor("y", {n, o}), dy = h.tensor("dy", {n, o});
  TensorId b = kNoTensor, db = kNoTensor;
  if (c.bias) {
    b = h.tensor("b", {o}, Region::params_f32);
    db = h.tensor("db", {o}, Region::grads_f32);
  }
  h.node(OpKind::fc_fwd, c.bias ? std::vector<TensorId>{x, w, b} : std::vector<TensorId>{x, w},
         {y});
  h.node(OpKind::fc_bwd_data, {dy, w}, {dx});
  h.node(OpKind::fc_bwd_weight, {x, dy},
         c.bias ? std::vector<TensorId>{dw, db} : std::vector<TensorId>{dw});
  compile_cpu(h);
  const auto xv = rand_vec(n * k, 81), wv = rand_vec(o * k, 82), dyv = rand_vec(n * o, 83);
  const auto bv = c.bias ? rand_vec(o, 84) : std::vector<float>{};
  h.write(x, xv);
  h.write(w, wv);
  h.write(dy, dyv);
  if (c.bias) h.write(b, bv);
  h.run();
  const ref::Vec X = ref::to_double(xv), W = ref::to_double(wv), DY = ref::to_double(dyv),
                 B = ref::to_double(bv);
  const ref::Vec aX = ref::abs_of(X), aW = ref::abs_of(W), aDY = ref::abs_of(DY);
  KILN_EXPECT_SCALED(h.read(y), ref::fc_fwd(X, W, B, n, k, o),
                     ref::fc_fwd(aX, aW, ref::abs_of(B), n, k, o), kFp32Tol, "fc_fwd y");
  KILN_EXPECT_SCALED(h.read(dx), ref::fc_bwd_data(DY, W, n, k, o),
                     ref::fc_bwd_data(aDY, aW, n, k, o), kFp32Tol, "fc_bwd_data dx");
  KILN_EXPECT_SCALED(h.read(dw), ref::fc_bwd_weight(X, DY, n, k, o),
                     ref::fc_bwd_weight(aX, aDY, n, k, o), kFp32Tol, "fc_bwd_weight dw");
  if (c.bias) {
    KILN_EXPECT_SCALED(h.read(db), ref::fc_bwd_bias(DY, n, o), ref::fc_bwd_bias(aDY, n, o),
                       kFp32Tol, "fc_bwd_weight db");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuOpFc, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The reference backward is the gradient of the forward (L = sum(y * r)). The layer is
// linear: with h = 1e-2 the central difference has only rounding error ~1e-15 / h: 1e-8
// relative (floor 1e-3).
TEST(CpuOpFcGrad, ReferenceBackwardIsTheGradientOfTheForward) {
  const int64_t n = 3, k = 5, o = 4;
  const ref::Vec x = ref::to_double(rand_vec(n * k, 85)), w = ref::to_double(rand_vec(o * k, 86)),
                 b = ref::to_double(rand_vec(o, 87)), r = ref::to_double(rand_vec(n * o, 88));
  auto lx = [&](const ref::Vec& v) { return ref::dot(ref::fc_fwd(v, w, b, n, k, o), r); };
  auto lw = [&](const ref::Vec& v) { return ref::dot(ref::fc_fwd(x, v, b, n, k, o), r); };
  auto lb = [&](const ref::Vec& v) { return ref::dot(ref::fc_fwd(x, w, v, n, k, o), r); };
  KILN_EXPECT_REL(ref::numeric_grad(lx, x, 1e-2), ref::fc_bwd_data(r, w, n, k, o), 1e-3, 1e-8,
                  "fd dx");
  KILN_EXPECT_REL(ref::numeric_grad(lw, w, 1e-2), ref::fc_bwd_weight(x, r, n, k, o), 1e-3, 1e-8,
                  "fd dw");
  KILN_EXPECT_REL(ref::numeric_grad(lb, b, 1e-2), ref::fc_bwd_bias(r, n, o), 1e-3, 1e-8, "fd db");
}

}  // namespace
}  // namespace kiln::test
