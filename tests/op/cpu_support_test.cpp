// What the CPU backend runs: every op of ops.def in FP32, the fused ones included (compositions
// of the unfused kernels; a malformed fused node is an error naming it, never a silent no-op);
// and attrs.accumulate is honoured only where a kernel implements it.
#include <gtest/gtest.h>

#include "backend/cpu/cpu_kernel.h"
#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

TEST(CpuOpSupport, EveryOpIsSupportedInFp32Only) {
  auto backend = make_backend("cpu");
  for (int i = 0; i < kOpCount; ++i) {
    const auto op = static_cast<OpKind>(i);
    EXPECT_TRUE(cpu::cpu_supports(op)) << op_name(op);
    EXPECT_TRUE(backend->supports(op, DType::F32)) << op_name(op);
    EXPECT_FALSE(backend->supports(op, DType::F16))
        << op_name(op) << ": the CPU backend is FP32 only";
  }
  const BackendCaps caps = backend->caps();
  EXPECT_TRUE(caps.fused_cbr && caps.fused_bn_add_relu && caps.fused_fp32);
}

// A fused node with the wrong tensors is an error naming the node, never a silent no-op.
TEST(CpuOpSupport, AMalformedFusedNodeIsRejectedNamingIt) {
  for (OpKind op : {OpKind::cbr_fwd, OpKind::cbr_bwd, OpKind::bn_add_relu_fwd,
                    OpKind::bn_add_relu_bwd, OpKind::bn_relu_infer}) {
    OpHarness h;
    const TensorId x = h.tensor("x", {1, 2, 2, 8});
    h.node(op, {x}, {x}).label = "layer1.0 fused";
    try {
      compile_cpu(h);
      FAIL() << op_name(op) << " compiled with one tensor";
    } catch (const Error& e) {
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
