// CPU fully connected layers (oneDNN inner product): finite differences of the reference. The
// kernels against it, a flattened input included, are the sweep's rows (tests/sweep/).
#include <gtest/gtest.h>

#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

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
