// The SM90 CUTLASS GEMM's eligibility rule (src/backend/sm90_conv_rule.h), which decides per
// CBR layer whether KILN_CUTLASS runs its convolution on the GEMM, and the switch that turns
// the path on (auto by default: where the device, the build and the precision allow): all
// without a GPU.
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

TEST(Sm90ConvRule, SwitchIsAutoUnlessAskedAndParsesAsAuto) {
  EXPECT_EQ(parse(nullptr).cutlass, Auto::automatic)
      << "auto by default: +3.15% on ResNet-50 AMP on the H200, golden steps pass with it on";
  EXPECT_EQ(parse("auto").cutlass, Auto::automatic);
  EXPECT_EQ(parse("1").cutlass, Auto::on);
  EXPECT_EQ(parse("on").cutlass, Auto::on);
  EXPECT_EQ(parse("0").cutlass, Auto::off);
  EXPECT_EQ(parse("off").cutlass, Auto::off);
  try {
    parse("maybe");
    ADD_FAILURE() << "KILN_CUTLASS=maybe was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("KILN_CUTLASS"), std::string::npos) << e.what();
  }
}

// auto tries the GEMM only where it can run: kernels built, compute capability 9.0, FP16
// features; 1 tries it everywhere (each layer logs why it falls back), 0 nowhere.
TEST(Sm90ConvRule, AutoTriesTheGemmOnlyWhereItCanRun) {
  const DType f16 = DType::F16, f32 = DType::F32;
  EXPECT_TRUE(sm90_conv_gemm_tried(Auto::automatic, true, 9, 0, f16));
  EXPECT_FALSE(sm90_conv_gemm_tried(Auto::automatic, false, 9, 0, f16)) << "not built";
  EXPECT_FALSE(sm90_conv_gemm_tried(Auto::automatic, true, 8, 0, f16)) << "an A100";
  EXPECT_FALSE(sm90_conv_gemm_tried(Auto::automatic, true, 10, 0, f16)) << "a B200";
  EXPECT_FALSE(sm90_conv_gemm_tried(Auto::automatic, true, 9, 1, f16)) << "sm_90a runs on 9.0";
  EXPECT_FALSE(sm90_conv_gemm_tried(Auto::automatic, true, 9, 0, f32)) << "FP32 program";
  EXPECT_FALSE(sm90_conv_gemm_tried(Auto::automatic, true, 9, 0, DType::BF16));
  for (const bool built : {false, true}) {
    for (const DType d : {f16, f32}) {
      EXPECT_TRUE(sm90_conv_gemm_tried(Auto::on, built, 8, 6, d));
      EXPECT_FALSE(sm90_conv_gemm_tried(Auto::off, built, 9, 0, d));
    }
  }
}

}  // namespace
}  // namespace kiln
