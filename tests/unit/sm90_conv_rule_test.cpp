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

// The implicit-GEMM convolution (KILN_CUTLASS_CONV): VGG16's 3x3 layers, ResNet-50's strided
// conv2 and the padded stem are eligible; what TMA's im2col or the epilogue cannot take is
// refused with its reason.
Sm90ConvQuery vgg_layer() {
  Sm90ConvQuery q = eligible();
  q.g.x = {256, 56, 56, 128};
  q.g.y = {256, 56, 56, 256};
  q.g.k = 256, q.g.r = q.g.s = 3, q.g.ph = q.g.pw = 1;
  return q;
}

TEST(Sm90ConvRule, ImplicitConvolutionTakesThreeByThreeAndStridedLayers) {
  EXPECT_FALSE(sm90_gemm_shape(vgg_layer().g));
  EXPECT_TRUE(sm90_gemm_shape(eligible().g));
  EXPECT_EQ(sm90_implicit_conv_refusal(vgg_layer()), "");
  Sm90ConvQuery s2 = vgg_layer();  // ResNet-50's first conv2 of stage 2
  s2.g.sh = s2.g.sw = 2;
  s2.g.y = {256, 28, 28, 256};
  EXPECT_EQ(sm90_implicit_conv_refusal(s2), "");
  Sm90ConvQuery stem = vgg_layer();  // 7x7 stride 2 padding 3, 3 channels padded to 8
  stem.g.x = {256, 224, 224, 8};
  stem.g.y = {256, 112, 112, 64};
  stem.g.k = 64, stem.g.r = stem.g.s = 7, stem.g.sh = stem.g.sw = 2, stem.g.ph = stem.g.pw = 3;
  EXPECT_EQ(sm90_implicit_conv_refusal(stem), "");
  EXPECT_EQ(sm90_implicit_conv_refusal(eligible()), "") << "it can run a 1x1 too";
}

TEST(Sm90ConvRule, ImplicitConvolutionRefusesWithItsReason) {
  auto refusal = [](auto change) {
    Sm90ConvQuery q = vgg_layer();
    change(q);
    return sm90_implicit_conv_refusal(q);
  };
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.built = false; }).find("not built"),
            std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.cc_major = 8; }).find("this one is 8.0"),
            std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.x = q.w = q.z = DType::F32; }).find("FP16"),
            std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.x.c = 3; }).find("3 -> 256"), std::string::npos)
      << "the unpadded first layer";
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.k = 12; }).find("128 -> 12"), std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.r = 300; }).find("300x3"), std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.pw = 200; }).find("padding 1x200"),
            std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.x.n = q.g.y.n = int64_t{1} << 20; }).find("32 bits"),
            std::string::npos);
}

// KILN_CUTLASS_CONV: auto stays off until the probe's figures say otherwise
// (kCutlassConvByDefault); 1 follows KILN_CUTLASS (it runs inside that path), 0 never.
TEST(Sm90ConvRule, ImplicitConvolutionSwitch) {
  const Switches none = Switches::parse([](const char*) -> const char* { return nullptr; }, {});
  EXPECT_EQ(none.cutlass_conv, Auto::automatic);
  const Switches on = Switches::parse(
      [](const char* name) -> const char* {
        return std::string(name) == "KILN_CUTLASS_CONV" ? "1" : nullptr;
      },
      Switches{});
  EXPECT_EQ(on.cutlass_conv, Auto::on);
  EXPECT_EQ(sm90_implicit_conv_tried(Auto::automatic, true), kCutlassConvByDefault);
  EXPECT_TRUE(sm90_implicit_conv_tried(Auto::on, true));
  EXPECT_FALSE(sm90_implicit_conv_tried(Auto::on, false)) << "KILN_CUTLASS off or not tried";
  EXPECT_FALSE(sm90_implicit_conv_tried(Auto::off, true));
}

// The implicit-GEMM data gradient (KILN_CUTLASS_CONV_DGRAD): q.g.x is dx's map, q.g.y dy's.
// VGG16's 3x3 layers and ResNet-50's unstrided conv2 keep their size and are eligible; a 5x5
// padded by 2 too; strided layers (dx's pixels are not dy's) and padding that changes the size
// are refused, each with its reason.
TEST(Sm90ConvRule, ImplicitDataGradientTakesStrideOneLayersThatKeepTheirSize) {
  EXPECT_EQ(sm90_implicit_dgrad_refusal(vgg_layer()), "");
  Sm90ConvQuery five = vgg_layer();
  five.g.r = five.g.s = 5, five.g.ph = five.g.pw = 2;
  EXPECT_EQ(sm90_implicit_dgrad_refusal(five), "");
  Sm90ConvQuery wide = vgg_layer();  // 1x3 padded 0x1
  wide.g.r = 1, wide.g.ph = 0;
  EXPECT_EQ(sm90_implicit_dgrad_refusal(wide), "");
  EXPECT_EQ(sm90_implicit_dgrad_refusal(eligible()), "") << "a 1x1 too (the GEMM takes it)";
}

TEST(Sm90ConvRule, ImplicitDataGradientRefusesWithItsReason) {
  auto refusal = [](auto change) {
    Sm90ConvQuery q = vgg_layer();
    change(q);
    return sm90_implicit_dgrad_refusal(q);
  };
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.built = false; }).find("not built"),
            std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.cc_major = 8; }).find("this one is 8.0"),
            std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) {
              q.g.sh = q.g.sw = 2;
              q.g.y = {256, 28, 28, 256};
            }).find("stride 2x2"),
            std::string::npos)
      << "ResNet-50's strided conv2";
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.ph = q.g.pw = 0; }).find("padding 0x0"),
            std::string::npos)
      << "a valid 3x3 shrinks the map";
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.pw = 2; }).find("padding 1x2"), std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.r = q.g.s = 4; }).find("4x4"), std::string::npos)
      << "an even filter cannot keep the size";
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.x = q.w = q.z = DType::F32; }).find("FP16"),
            std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.x.c = 3; }).find("3 -> 256"), std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.r = 301, q.g.ph = 150; }).find("301x3"),
            std::string::npos);
  EXPECT_NE(refusal([](Sm90ConvQuery& q) { q.g.x.n = q.g.y.n = int64_t{1} << 20; }).find("32 bits"),
            std::string::npos);
}

// KILN_CUTLASS_CONV_DGRAD: auto as kCutlassConvDgradByDefault says; 1 follows
// KILN_CUTLASS_DGRAD (it runs inside that path), 0 never.
TEST(Sm90ConvRule, ImplicitDataGradientSwitch) {
  const Switches none = Switches::parse([](const char*) -> const char* { return nullptr; }, {});
  EXPECT_EQ(none.cutlass_conv_dgrad, Auto::automatic);
  const Switches on = Switches::parse(
      [](const char* name) -> const char* {
        return std::string(name) == "KILN_CUTLASS_CONV_DGRAD" ? "1" : nullptr;
      },
      Switches{});
  EXPECT_EQ(on.cutlass_conv_dgrad, Auto::on);
  EXPECT_EQ(on.cutlass_conv, Auto::automatic) << "the forward's switch is its own";
  EXPECT_EQ(sm90_implicit_dgrad_tried(Auto::automatic, true), kCutlassConvDgradByDefault);
  EXPECT_TRUE(sm90_implicit_dgrad_tried(Auto::on, true));
  EXPECT_FALSE(sm90_implicit_dgrad_tried(Auto::on, false)) << "KILN_CUTLASS_DGRAD off";
  EXPECT_FALSE(sm90_implicit_dgrad_tried(Auto::off, true));
}

// KILN_CUTLASS_TIMED: a switch left at auto tries its family wherever the family it builds on is
// tried, and chooses per layer by timing; one set to 0 or 1 is obeyed; off, or under
// KILN_DETERMINISTIC, the fixed defaults decide as without it.
TEST(Sm90ConvRule, TimedChoiceTriesEveryAutoFamilyAndObeysTheOthers) {
  const Switches none = Switches::parse([](const char*) -> const char* { return nullptr; }, {});
  EXPECT_TRUE(none.cutlass_timed) << "on since the H200 run of 30b349f (bench/RESULTS.md)";
  const Auto a = Auto::automatic;
  auto forms = [](Sm90Switches sw, DType features = DType::F16, int cc = 9) {
    return sm90_forms(sw, true, cc, 0, features);
  };
  const Sm90Forms fixed = forms({a, a, a, a, false, false});
  EXPECT_TRUE(fixed.gemm);
  EXPECT_EQ(fixed.dgrad, kCutlassDgradByDefault);
  EXPECT_EQ(fixed.conv, kCutlassConvByDefault);
  EXPECT_EQ(fixed.conv_dgrad, kCutlassDgradByDefault && kCutlassConvDgradByDefault);
  EXPECT_FALSE(fixed.gemm_timed || fixed.dgrad_timed || fixed.conv_timed || fixed.conv_dgrad_timed);

  const Sm90Forms timed = forms({a, a, a, a, true, false});
  EXPECT_TRUE(timed.gemm && timed.dgrad && timed.conv && timed.conv_dgrad);
  EXPECT_TRUE(timed.gemm_timed && timed.dgrad_timed && timed.conv_timed && timed.conv_dgrad_timed);

  const Sm90Forms det = forms({a, a, a, a, true, true});
  EXPECT_FALSE(det.gemm_timed || det.dgrad_timed || det.conv_timed || det.conv_dgrad_timed)
      << "a timed choice may differ between processes, and with it the bits";
  EXPECT_EQ(det.conv, fixed.conv);

  // Where the GEMM is not tried at all (FP32, another GPU), nothing is, timed or not.
  for (const Sm90Forms& f : {forms({a, a, a, a, true, false}, DType::F32),
                             forms({a, a, a, a, true, false}, DType::F16, 8)}) {
    EXPECT_FALSE(f.gemm || f.dgrad || f.conv || f.conv_dgrad);
    EXPECT_FALSE(f.gemm_timed || f.dgrad_timed || f.conv_timed || f.conv_dgrad_timed);
  }

  // Switches set by hand: 1 always (not timed), 0 never; the others still timed.
  const Sm90Forms mixed = forms({Auto::on, a, Auto::off, Auto::on, true, false});
  EXPECT_TRUE(mixed.gemm);
  EXPECT_FALSE(mixed.gemm_timed);
  EXPECT_TRUE(mixed.dgrad && mixed.dgrad_timed);
  EXPECT_FALSE(mixed.conv || mixed.conv_timed);
  EXPECT_TRUE(mixed.conv_dgrad);
  EXPECT_FALSE(mixed.conv_dgrad_timed);
  const Sm90Forms no_dgrad = forms({a, Auto::off, a, a, true, false});
  EXPECT_FALSE(no_dgrad.dgrad || no_dgrad.conv_dgrad) << "the implicit form runs inside it";
  EXPECT_TRUE(no_dgrad.conv_timed);
}

}  // namespace
}  // namespace kiln
