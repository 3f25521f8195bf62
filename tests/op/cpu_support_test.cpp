// What the CPU backend runs: every layer and region op of ops.def, no fused op (those are
// CUDA-only; asking for one is an Unsupported error naming the node, never a silent no-op);
// and attrs.accumulate is honoured only where a kernel implements it.
#include <gtest/gtest.h>

#include "backend/cpu/cpu_kernel.h"
#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

TEST(CpuOpSupport, EveryUnfusedOpIsSupportedAndNoFusedOp) {
  auto backend = make_backend("cpu");
  for (int i = 0; i < kOpCount; ++i) {
    const auto op = static_cast<OpKind>(i);
    const bool fused = op_category(op) == OpCategory::Fused;
    EXPECT_EQ(cpu::cpu_supports(op), !fused) << op_name(op);
    EXPECT_EQ(backend->supports(op, DType::F32), !fused) << op_name(op);
    EXPECT_FALSE(backend->supports(op, DType::F16))
        << op_name(op) << ": the CPU backend is FP32 only";
  }
}

TEST(CpuOpSupport, FusedOpsAreRejectedWithAnUnsupportedError) {
  for (OpKind op :
       {OpKind::cbr_fwd, OpKind::cbr_bwd, OpKind::bn_add_relu_fwd, OpKind::bn_add_relu_bwd}) {
    OpHarness h;
    const TensorId x = h.tensor("x", {1, 2, 2, 8});
    h.node(op, {x}, {x}).label = "layer1.0 fused";
    try {
      compile_cpu(h);
      FAIL() << op_name(op) << " compiled on the CPU";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find("layer1.0 fused"), std::string::npos) << e.what();
    }
  }
}

// Only add and check_clip accumulate; an accumulating relu would otherwise overwrite the
// sum it was asked to add to. The compiler gets an error instead of a wrong gradient.
TEST(CpuOpSupport, AccumulateOnANonAccumulatingOpIsRejected) {
  OpHarness h;
  const TensorId x = h.tensor("x", {4, 4}), y = h.tensor("y", {4, 4});
  Attrs a;
  a.accumulate = true;
  h.node(OpKind::relu_fwd, {x}, {y}, a);
  try {
    compile_cpu(h);
    FAIL() << "expected Unsupported";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Unsupported);
  }
}

// A missing required tensor is an InvalidArgument naming the op's signature.
TEST(CpuOpSupport, MissingInputIsAClearError) {
  OpHarness h;
  const TensorId x = h.tensor("x", {2, 3, 3, 4}), y = h.tensor("y", {2, 3, 3, 4});
  h.node(OpKind::bn_fwd_infer, {x}, {y}).label = "bn1";
  try {
    compile_cpu(h);
    FAIL() << "expected InvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("bn1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("gamma"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln::test
