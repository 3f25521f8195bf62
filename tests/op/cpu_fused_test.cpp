// The CPU's fused ops (cpu/fused.cpp) against their unfused chains, bit for bit
// (tests/support/fused_checks.h says how): CBR over 5 shapes (with the first-layer form and
// an odd mask tail), CBR with a max-pool folded in over 5, BN+add+ReLU over 3 (with one gradient and with two), and CBR with a
// convolution bias.
#include <gtest/gtest.h>

#include "op/cpu_op_test_util.h"
#include "support/fused_checks.h"

namespace kiln::test {
namespace {

using fused::CbrCase;

class CpuFusedCbr : public ::testing::TestWithParam<CbrCase> {};

TEST_P(CpuFusedCbr, EqualsConvBnReluBitForBit) {
  fused::cbr_equals_chain(GetParam(), false, "cpu");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuFusedCbr,
    ::testing::Values(CbrCase{"n2_9x9_c8_k16_3x3", 2, 9, 9, 8, 16, 3, 1, 1, false},
                      CbrCase{"n3_8x7_c16_k8_3x3_s2", 3, 8, 7, 16, 8, 3, 2, 1, false},
                      CbrCase{"n2_6x6_c8_k24_1x1", 2, 6, 6, 8, 24, 1, 1, 0, false},
                      CbrCase{"n1_5x5_c3_k8_first_layer", 1, 5, 5, 3, 8, 3, 1, 1, true},
                      CbrCase{"n4_3x3_c8_k5_odd_mask", 4, 3, 3, 8, 5, 1, 1, 0, false}),
    [](const auto& info) { return std::string(info.param.name); });

// CBR with a max-pool folded in (cbr_pool_*): 2x2 and 3x3 windows, a 1x1 convolution, the
// first-layer form, and 5 channels (mask bytes that straddle pixels).
struct PoolCase {
  CbrCase cbr;
  int pool;
};

class CpuFusedCbrPool : public ::testing::TestWithParam<PoolCase> {};

TEST_P(CpuFusedCbrPool, EqualsConvBnReluMaxPoolBitForBit) {
  fused::cbr_pool_equals_chain(GetParam().cbr, GetParam().pool, false, "cpu");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuFusedCbrPool,
    ::testing::Values(PoolCase{{"n2_8x8_c8_k16_3x3_pool2", 2, 8, 8, 8, 16, 3, 1, 1, false}, 2},
                      PoolCase{{"n3_6x4_c16_k8_1x1_pool2", 3, 6, 4, 16, 8, 1, 1, 0, false}, 2},
                      PoolCase{{"n1_9x9_c8_k8_3x3_pool3", 1, 9, 9, 8, 8, 3, 1, 1, false}, 3},
                      PoolCase{{"n2_8x8_c3_k8_first_layer_pool2", 2, 8, 8, 3, 8, 3, 1, 1, true}, 2},
                      PoolCase{{"n2_4x4_c8_k5_odd_mask_pool2", 2, 4, 4, 8, 5, 1, 1, 0, false}, 2}),
    [](const auto& info) { return std::string(info.param.cbr.name); });

struct BarCase {
  const char* name;
  Shape shape;
};

class CpuFusedBnAddRelu : public ::testing::TestWithParam<BarCase> {};

TEST_P(CpuFusedBnAddRelu, EqualsBnAddReluBitForBit) {
  fused::bn_add_relu_equals_chain(GetParam().shape, false, "cpu");
}

// With the gradient-sum add folded in (dy2): the chain's add, ReLU and BN backward.
TEST_P(CpuFusedBnAddRelu, TwoGradientsEqualAddThenChainBitForBit) {
  fused::bn_add_relu_equals_chain(GetParam().shape, false, "cpu", true);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuFusedBnAddRelu,
                         ::testing::Values(BarCase{"n2_7x7_c16", {2, 7, 7, 16}},
                                           BarCase{"n1_3x5_c8", {1, 3, 5, 8}},
                                           BarCase{"n4_2x2_c3_odd_mask", {4, 2, 2, 3}}),
                         [](const auto& info) { return std::string(info.param.name); });

// The evaluation form: bn_relu_infer against bn_fwd_infer, [add,] relu_fwd.
TEST_P(CpuFusedBnAddRelu, InferenceEqualsChainBitForBit) {
  for (const bool residual : {false, true}) {
    SCOPED_TRACE(residual ? "with residual" : "without residual");
    fused::bn_relu_infer_equals_chain(GetParam().shape, false, "cpu", residual);
  }
}

// The CPU adds momentum * b to the running mean in float, as the test forms it: exact.
TEST(CpuFusedCbrBias, BiasMovesOnlyTheRunningMean) {
  fused::cbr_bias_moves_only_the_running_mean(false, "cpu", 0.0);
}

}  // namespace
}  // namespace kiln::test
