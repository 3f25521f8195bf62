// The SM90 CUTLASS GEMM's eligibility rule (src/backend/sm90_conv_rule.h), which decides per
// CBR layer whether KILN_CUTLASS=1 runs its convolution on the GEMM, and the switch that turns
// the path on: both without a GPU.
#include "backend/sm90_conv_rule.h"

#include <gtest/gtest.h>

#include <string>

#include "kiln/core/error.h"
#include "kiln/core/switches.h"

namespace kiln {
namespace {

// ResNet-50's first bottleneck conv1 at batch 256, AMP, on an H200, built with the kernels.
Sm90ConvQuery eligible() {
  Sm90ConvQuery q;
  q.g.x = {256, 56, 56, 64};
  q.g.y = {256, 56, 56, 256};
  q.g.k = 256, q.g.r = 1, q.g.s = 1;
  q.x = q.w = q.z = DType::F16;
  q.cc_major = 9, q.cc_minor = 0;
  q.built = true;
  return q;
}

TEST(Sm90ConvRule, TakesAOneByOneStrideOneFp16Convolution) {
  EXPECT_EQ(sm90_conv_refusal(eligible()), "");
  Sm90ConvQuery q = eligible();
  // One row, and the smallest channel counts TMA's 16-byte rows allow.
  q.g.x = {1, 1, 1, 8};
  q.g.y = {1, 1, 1, 8};
  q.g.k = 8;
  EXPECT_EQ(sm90_conv_refusal(q), "");
}

TEST(Sm90ConvRule, RefusesEachIneligibleLayerWithItsReason) {
  auto refusal = [](auto change) {
    Sm90ConvQuery q = eligible();
    change(q);
    return sm90_conv_refusal(q);
  };
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.built = false; }).find("not built"),
            std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.cc_major = 8; }).find("this one is 8.0"),
            std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.cc_minor = 1; }).find("9.1"), std::string::npos)
      << "sm_90a code runs on compute capability 9.0 only";
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.cc_major = 10; }).find("10.0"), std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.r = q.g.s = 3; }).find("3x3"), std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.sh = q.g.sw = 2; }).find("stride 2x2"),
            std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.ph = 1; }).find("padding 1x0"), std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.x = q.w = q.z = DType::F32; }).find("FP16"),
            std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.z = DType::BF16; }).find("FP16"), std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.x.c = 3; }).find("3 -> 256"), std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.k = 12; }).find("64 -> 12"), std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.x.n = int64_t{1} << 20; }).find("32 bits"),
            std::string::npos);
}

Switches parse(const char* value) {
  return Switches::parse(
      [&](const char* name) -> const char* {
        return std::string(name) == "KILN_CUTLASS" ? value : nullptr;
      },
      Switches{});
}

TEST(Sm90ConvRule, SwitchIsOffUnlessAskedAndParsesAsABool) {
  EXPECT_FALSE(parse(nullptr).cutlass) << "off by default until it has run inside kiln's steps";
  EXPECT_TRUE(parse("1").cutlass);
  EXPECT_TRUE(parse("on").cutlass);
  EXPECT_FALSE(parse("0").cutlass);
  EXPECT_FALSE(parse("off").cutlass);
  try {
    parse("maybe");
    ADD_FAILURE() << "KILN_CUTLASS=maybe was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("KILN_CUTLASS"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln
