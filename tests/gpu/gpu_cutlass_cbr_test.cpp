// The CBR forward on kiln's SM90 CUTLASS GEMM (KILN_CUTLASS=1, src/backend/cuda/cutlass_conv.cpp)
// against the CBR forward as it is without it (cuDNN's convolution, kiln's statistics pass,
// BatchNorm and ReLU: tests/gpu/gpu_fused_test.cpp holds that form bit for bit to the unfused
// chain), on ResNet-50's 1x1 shapes and odd sizes; the statistics against a float64 reference;
// a bottleneck's conv3 (conv_fwd, then bn_add_relu_fwd) likewise; 3x3 and strided layers on the
// implicit-GEMM convolution (KILN_CUTLASS_CONV=1) likewise; layers the GEMM cannot take keep
// their form; and ResNet-50's and VGG16-BN's training steps with the switches on against off.
// Every case needs a compute capability 9.0 GPU and a kiln built with the CUTLASS kernels, and
// skips cleanly elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "gpu/sm90_test_util.h"
#include "gpu/step_forms.h"
#include "support/fused_checks.h"

#ifdef KILN_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kiln::test {
namespace {

using fused::CbrCase;

struct CbrForward : fused::CbrForwardOut {
  CompileReport report;
};

// One cbr_fwd (or cbr_pool_fwd with pool windows) node on the given switches, AMP unless fp32.
CbrForward run_cbr_forward(const CbrCase& t, int pool, const Switches& sw, bool amp = true) {
  OpHarness h(amp);
  fused::CbrForwardOut out = fused::run_cbr_forward(fused::Maker{h, amp}, t, pool, "cuda", sw);
  return {std::move(out), h.backend().compile_report()};
}

// KILN_CUTLASS on or off; `conv`: KILN_CUTLASS_CONV too (the implicit-GEMM convolution). On, a
// first layer's 3 channels are padded to 8 for the SM90 kernels (KILN_PAD_CHANNELS=1).
Switches cutlass_switches(bool on, bool deterministic, bool conv = false) {
  Switches sw = Switches::from_environment();
  sw.cutlass = on ? Auto::on : Auto::off;
  sw.pad_channels = on ? Auto::on : Auto::off;
  sw.cutlass_conv = conv ? Auto::on : Auto::off;
  sw.cbr_form = "kiln";
  sw.deterministic = deterministic;
  return sw;
}

// BatchNorm's batch mean and inverse std of z's channels (z [rows][k] as the GPU stored it, so
// the reference sums exactly the values the epilogue summed), in float64.
void expect_saved_near_float64(const std::vector<float>& z, int64_t k,
                               const std::vector<float>& saved, float eps) {
  const auto rows = static_cast<int64_t>(z.size()) / k;
  std::vector<double> sum(static_cast<size_t>(k)), sq(static_cast<size_t>(k));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const double v = z[static_cast<size_t>(r * k + c)];
      sum[static_cast<size_t>(c)] += v;
      sq[static_cast<size_t>(c)] += v * v;
    }
  }
  double worst_mean = 0, worst_invstd = 0;
  for (int64_t c = 0; c < k; ++c) {
    const double mean = sum[static_cast<size_t>(c)] / rows;
    const double var = std::max(sq[static_cast<size_t>(c)] / rows - mean * mean, 0.0);
    const double invstd = 1.0 / std::sqrt(var + eps);
    // The mean relative to z's RMS (it may cancel to ~0; its error scales with the terms).
    worst_mean = std::max(worst_mean, std::fabs(saved[static_cast<size_t>(c)] - mean) /
                                          std::sqrt(mean * mean + var + 1e-30));
    worst_invstd =
        std::max(worst_invstd, std::fabs(saved[static_cast<size_t>(k + c)] - invstd) / invstd);
  }
  // FP32 sums (per-thread registers, then across the CTA and the grid) of up to ~1e6 FP16
  // values: relative error well under 1e-4 (stage 1 measured 5e-7).
  EXPECT_LE(worst_mean, 1e-4) << "saved mean against float64, relative to z's RMS";
  EXPECT_LE(worst_invstd, 1e-4) << "saved inverse std against float64";
}

size_t differing_mask_bits(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b,
                           size_t bits) {
  size_t differ = 0;
  for (size_t i = 0; i < bits; ++i) differ += (((a[i / 8] ^ b[i / 8]) >> (i % 8)) & 1u) != 0;
  return differ;
}

// The GEMM's form (cut) against kiln's (cuDNN's convolution, kiln's statistics pass) on the
// same inputs, k output channels; the statistics against float64.
void expect_agrees_to_rounding(const CbrForward& cut, const CbrForward& kiln, int64_t k) {
  // cuDNN's and CUTLASS's FP32 sums of the same FP16 products may round to neighbouring FP16
  // values: one FP16 ulp, at most 2^-10 of the largest |z|.
  EXPECT_LE(rel_error(cut.z, kiln.z, kSumFloor), 2e-3) << "z";
  expect_saved_near_float64(cut.z, k, cut.saved, fused::conv_bn_attrs(1, 1, 0).eps);
  // The running statistics move by a tenth of the batch's: FP32 sums against kiln's double
  // ones over z's that agree to an FP16 ulp.
  EXPECT_LE(rel_error(cut.rm, kiln.rm, kSumFloor), 1e-4) << "running mean";
  EXPECT_LE(rel_error(cut.rv, kiln.rv, kSumFloor), 1e-4) << "running variance";
  // y carries z's ulp through BatchNorm and rounds to FP16 again from statistics that differ in
  // their last FP32 bits: two FP16 ulps of y's scale; the mask (and the pool's choice) may flip
  // where BatchNorm's output sits within rounding of 0 or of its window's maximum.
  EXPECT_LE(rel_error(cut.y, kiln.y, kSumFloor), 4e-3) << "y";
  const size_t bits = cut.z.size();
  EXPECT_LE(differing_mask_bits(cut.mask, kiln.mask, bits), 5 * bits / 1000 + 2)
      << "mask bits that differ";
}

struct CutlassCase {
  CbrCase cbr;
  int pool;
};

// The layer on the CUTLASS path (conv: on the implicit-GEMM convolution, KILN_CUTLASS_CONV=1)
// against kiln's form, with FP32 atomics and in the deterministic form (per-CTA partials), the
// latter twice for the same bits.
void expect_cutlass_form_agrees(const CbrCase& t, int pool, const CbrForward& kiln, bool conv) {
  for (const bool deterministic : {false, true}) {
    SCOPED_TRACE(deterministic ? "deterministic: per-CTA partials" : "FP32 atomics");
    const CbrForward cut = run_cbr_forward(t, pool, cutlass_switches(true, deterministic, conv));
    ASSERT_EQ(cut.report.cbr_cutlass, 1) << "the layer did not take the CUTLASS path (the log "
                                            "says why); was kiln built with KILN_CUTLASS_KERNELS?";
    EXPECT_EQ(cut.report.cbr_cutlass_fallbacks, 0);
    EXPECT_EQ(cut.report.cbr_cutlass_conv, conv ? 1 : 0) << "on the implicit-GEMM convolution";
    expect_agrees_to_rounding(cut, kiln, t.k);
    if (deterministic) {
      const CbrForward again = run_cbr_forward(t, pool, cutlass_switches(true, true, conv));
      EXPECT_EQ(again.z, cut.z) << "deterministic z";
      EXPECT_EQ(again.saved, cut.saved) << "deterministic statistics (fixed-order partials)";
      EXPECT_EQ(again.y, cut.y) << "deterministic y";
      // BatchNorm's finalize inside the apply pass (KILN_BN_FUSED_FINALIZE=1) and as a launch of
      // its own compute the same expressions from the same sums: the same bits.
      Switches inside_sw = cutlass_switches(true, true, conv), apart_sw = inside_sw;
      inside_sw.bn_fused_finalize = true;
      apart_sw.bn_fused_finalize = false;
      const CbrForward inside = run_cbr_forward(t, pool, inside_sw);
      const CbrForward apart = run_cbr_forward(t, pool, apart_sw);
      EXPECT_EQ(inside.saved, apart.saved) << "statistics, finalize inside the apply pass";
      EXPECT_EQ(inside.rm, apart.rm) << "running mean, finalize inside the apply pass";
      EXPECT_EQ(inside.rv, apart.rv) << "running variance, finalize inside the apply pass";
      EXPECT_EQ(inside.y, apart.y) << "y, finalize inside the apply pass";
      EXPECT_EQ(inside.mask, apart.mask) << "mask, finalize inside the apply pass";
    }
  }
}

class GpuCutlassCbr : public ::testing::TestWithParam<CutlassCase> {};

TEST_P(GpuCutlassCbr, AgreesWithKilnsFormToRounding) {
  KILN_REQUIRE_SM90_CUTLASS();
  const CbrCase& t = GetParam().cbr;
  const int pool = GetParam().pool;
  const CbrForward kiln = run_cbr_forward(t, pool, cutlass_switches(false, true));
  EXPECT_EQ(kiln.report.cbr_cutlass + kiln.report.cbr_cutlass_fallbacks, 0) << "switch off";
  expect_cutlass_form_agrees(t, pool, kiln, false);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuCutlassCbr,
    ::testing::Values(
        // ResNet-50's 1x1 stride-1 layers (the bottlenecks' conv1), at small batches.
        CutlassCase{{"r50_56x56_c64_k64", 2, 56, 56, 64, 64, 1, 1, 0, false}, 0},
        CutlassCase{{"r50_56x56_c256_k64", 2, 56, 56, 256, 64, 1, 1, 0, false}, 0},
        CutlassCase{{"r50_56x56_c64_k256", 2, 56, 56, 64, 256, 1, 1, 0, false}, 0},
        CutlassCase{{"r50_56x56_c256_k128", 2, 56, 56, 256, 128, 1, 1, 0, false}, 0},
        CutlassCase{{"r50_28x28_c512_k128", 2, 28, 28, 512, 128, 1, 1, 0, false}, 0},
        CutlassCase{{"r50_28x28_c128_k512", 2, 28, 28, 128, 512, 1, 1, 0, false}, 0},
        CutlassCase{{"r50_14x14_c1024_k256", 4, 14, 14, 1024, 256, 1, 1, 0, false}, 0},
        CutlassCase{{"r50_14x14_c256_k1024", 4, 14, 14, 256, 1024, 1, 1, 0, false}, 0},
        CutlassCase{{"r50_7x7_c2048_k512", 8, 7, 7, 2048, 512, 1, 1, 0, false}, 0},
        CutlassCase{{"r50_7x7_c512_k2048", 8, 7, 7, 512, 2048, 1, 1, 0, false}, 0},
        // Odd sizes: rows fewer than one tile and not a multiple of it, channels under the
        // 64-wide K step, column counts that end in a part of a tile.
        CutlassCase{{"n3_5x7_c8_k16", 3, 5, 7, 8, 16, 1, 1, 0, false}, 0},
        CutlassCase{{"n1_3x3_c24_k40", 1, 3, 3, 24, 40, 1, 1, 0, false}, 0},
        CutlassCase{{"n2_9x11_c72_k136", 2, 9, 11, 72, 136, 1, 1, 0, false}, 0},
        CutlassCase{{"n5_13x13_c16_k264", 5, 13, 13, 16, 264, 1, 1, 0, false}, 0},
        // cbr_pool_fwd shares the convolution (fused.cpp's cbr_forward).
        CutlassCase{{"n3_6x4_c16_k8_pool2", 3, 6, 4, 16, 8, 1, 1, 0, false}, 2},
        CutlassCase{{"n2_28x28_c64_k256_pool2", 2, 28, 28, 64, 256, 1, 1, 0, false}, 2}),
    [](const auto& info) { return std::string(info.param.cbr.name); });

// The CBR forward whose convolution is not the GEMM's 1x1 (VGG's and ResNet-50's 3x3 layers, a
// strided one, odd sizes) on the implicit-GEMM convolution (KILN_CUTLASS_CONV=1), against the
// same layer with the switches off, as above.
class GpuCutlassConvCbr : public ::testing::TestWithParam<CutlassCase> {};

TEST_P(GpuCutlassConvCbr, AgreesWithKilnsFormToRounding) {
  KILN_REQUIRE_SM90_CUTLASS();
  const CbrCase& t = GetParam().cbr;
  const int pool = GetParam().pool;
  const CbrForward kiln = run_cbr_forward(t, pool, cutlass_switches(false, true));
  const CbrForward gemm_only = run_cbr_forward(t, pool, cutlass_switches(true, true));
  EXPECT_EQ(gemm_only.report.cbr_cutlass, 0) << "KILN_CUTLASS_CONV off: the layer keeps cuDNN";
  expect_cutlass_form_agrees(t, pool, kiln, true);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuCutlassConvCbr,
    ::testing::Values(
        // VGG16's 3x3 layers (with their 2x2 max-pool where VGG has one) and ResNet-50's conv2.
        CutlassCase{{"vgg_28x28_c64_k64", 2, 28, 28, 64, 64, 3, 1, 1, false}, 0},
        CutlassCase{{"vgg_28x28_c64_k128_pool2", 2, 28, 28, 64, 128, 3, 1, 1, false}, 2},
        CutlassCase{{"vgg_14x14_c256_k512", 2, 14, 14, 256, 512, 3, 1, 1, false}, 0},
        CutlassCase{{"r50_conv2_14x14_c128_s2", 2, 14, 14, 128, 128, 3, 2, 1, false}, 0},
        CutlassCase{{"r50_conv2_7x7_c512", 4, 7, 7, 512, 512, 3, 1, 1, false}, 0},
        // Odd sizes: rows and channels ending inside a tile; a 5x5 filter with padding 2.
        CutlassCase{{"n3_9x11_c24_k136", 3, 9, 11, 24, 136, 3, 1, 1, false}, 0},
        CutlassCase{{"n2_10x6_c16_k40_5x5", 2, 10, 6, 16, 40, 5, 1, 2, false}, 0},
        // First layers of 3 channels, run on copies padded to 8 (KILN_PAD_CHANNELS=1 here):
        // VGG16's (3x3) and ResNet-50's stem (7x7 / 2, padding 3), scaled down.
        CutlassCase{{"vgg_first_20x18_c3_k64", 2, 20, 18, 3, 64, 3, 1, 1, true}, 0},
        CutlassCase{{"r50_stem_30x32_c3_k64_7x7s2", 2, 30, 32, 3, 64, 7, 2, 3, true}, 0}),
    [](const auto& info) { return std::string(info.param.cbr.name); });

// A bottleneck's conv3: a conv_fwd node whose output the next bn_add_relu_fwd normalises (a
// separate node, not a CBR) takes the GEMM with the switch on, and that BatchNorm reads its sums
// (make_conv_fwd_summed_for_bn); compared with the switch off as the CBR forward is above.
CbrForward run_conv_bn_add_relu(const CbrCase& t, const Switches& sw) {
  const Shape xs{t.n, t.h, t.w, t.c}, zs{t.n, t.h, t.w, t.k}, ws{t.k, 1, 1, t.c};
  OpHarness h(true);
  const fused::Maker m{h, true};
  const TensorId x = m.feature("x", xs), w = m.weight("w", ws), res = m.feature("residual", zs);
  const fused::BnForward bn = fused::bn_forward_tensors(m, t.k);
  const TensorId z = m.feature("z", zs), y = m.feature("y", zs);
  const TensorId mask = h.tensor("mask", {(zs.numel() + 7) / 8}, Region::aux, DType::U8);
  const Attrs a = fused::conv_bn_attrs(1, 1, 0);
  h.node(OpKind::conv_fwd, {x, w}, {z}, a);
  h.node(OpKind::bn_add_relu_fwd, {z, bn.gamma, bn.beta, bn.rm, bn.rv, res}, {y, bn.saved, mask},
         a);
  h.compile(make_backend("cuda", sw));
  h.write(x, random_values(static_cast<size_t>(xs.numel()), 11));
  h.write(w, random_values(static_cast<size_t>(ws.numel()), 12, -0.5f, 0.5f));
  h.write(res, random_values(static_cast<size_t>(zs.numel()), 13));
  fused::write_bn_forward(h, bn, t.k, 14);
  h.run();
  return {fused::read_cbr_forward(h, z, y, bn, mask), h.backend().compile_report()};
}

// A downsampling shortcut's convolution (1x1, stride t.st) whose output a later bn_add_relu_fwd
// takes as its residual with the shortcut's BatchNorm folded in (KILN_FUSE_RESIDUAL_BN): with the
// switch on it takes the SM90 kernel and that folded BatchNorm reads its sums instead of its own
// statistics pass. What is read back: the shortcut's z, y, and the shortcut BatchNorm's saved and
// running statistics (in CbrForward's saved, rm, rv).
CbrForward run_shortcut_conv_bn_add_relu(const CbrCase& t, const Switches& sw) {
  const int64_t p = (t.h - 1) / t.st + 1, q = (t.w - 1) / t.st + 1;
  const Shape xs{t.n, t.h, t.w, t.c}, zs{t.n, p, q, t.k}, ws{t.k, 1, 1, t.c};
  OpHarness h(true);
  const fused::Maker m{h, true};
  const TensorId x = m.feature("x", xs), w = m.weight("w", ws), main = m.feature("main_z", zs);
  const fused::BnForward bn = fused::bn_forward_tensors(m, t.k);
  const TensorId gamma2 = m.channels("gamma2", t.k, Region::params_f32),
                 beta2 = m.channels("beta2", t.k, Region::params_f32),
                 rm2 = m.channels("rm2", t.k, Region::bn_running),
                 rv2 = m.channels("rv2", t.k, Region::bn_running),
                 saved2 = h.tensor("saved2", {2, t.k}, Region::bn_saved);
  const TensorId z = m.feature("z", zs), y = m.feature("y", zs);
  const TensorId mask = h.tensor("mask", {(zs.numel() + 7) / 8}, Region::aux, DType::U8);
  const Attrs a = fused::conv_bn_attrs(1, static_cast<int>(t.st), 0);
  h.node(OpKind::conv_fwd, {x, w}, {z}, a);
  h.node(OpKind::bn_add_relu_fwd,
         {main, bn.gamma, bn.beta, bn.rm, bn.rv, z, gamma2, beta2, rm2, rv2},
         {y, bn.saved, mask, saved2}, a);
  h.compile(make_backend("cuda", sw));
  h.write(x, random_values(static_cast<size_t>(xs.numel()), 21));
  h.write(w, random_values(static_cast<size_t>(ws.numel()), 22, -0.5f, 0.5f));
  h.write(main, random_values(static_cast<size_t>(zs.numel()), 23));
  fused::write_bn_forward(h, bn, t.k, 24);
  const auto k = static_cast<size_t>(t.k);
  h.write(gamma2, random_values(k, 30, 0.5f, 1.5f));
  h.write(beta2, random_values(k, 31, -0.3f, 0.3f));
  h.write(rm2, random_values(k, 32));
  h.write(rv2, random_values(k, 33, 0.5f, 1.5f));
  h.run();
  const fused::BnForward shortcut{gamma2, beta2, rm2, rv2, saved2};
  return {fused::read_cbr_forward(h, z, y, shortcut, mask), h.backend().compile_report()};
}

class GpuCutlassShortcutConv : public ::testing::TestWithParam<CbrCase> {};

TEST_P(GpuCutlassShortcutConv, AgreesWithKilnsFormToRounding) {
  KILN_REQUIRE_SM90_CUTLASS();
  const CbrCase& t = GetParam();
  const CbrForward kiln = run_shortcut_conv_bn_add_relu(t, cutlass_switches(false, true));
  EXPECT_EQ(kiln.report.conv_cutlass + kiln.report.conv_cutlass_fallbacks, 0) << "switch off";
  for (const bool deterministic : {false, true}) {
    SCOPED_TRACE(deterministic ? "deterministic: per-CTA partials" : "FP32 atomics");
    // The strided ones on the implicit-GEMM convolution (KILN_CUTLASS_CONV).
    const CbrForward cut =
        run_shortcut_conv_bn_add_relu(t, cutlass_switches(true, deterministic, t.st != 1));
    ASSERT_EQ(cut.report.conv_cutlass, 1) << "the shortcut did not take the CUTLASS path";
    expect_agrees_to_rounding(cut, kiln, t.k);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuCutlassShortcutConv,
    ::testing::Values(
        // ResNet-50's four shortcuts (layer1's stride 1, then stride 2), then an odd size.
        CbrCase{"r50_layer1_56x56_c64_k256", 2, 56, 56, 64, 256, 1, 1, 0, false},
        CbrCase{"r50_layer2_56x56_c256_k512_s2", 2, 56, 56, 256, 512, 1, 2, 0, false},
        CbrCase{"r50_layer4_14x14_c1024_k2048_s2", 2, 14, 14, 1024, 2048, 1, 2, 0, false},
        CbrCase{"n3_9x7_c24_k40_s2", 3, 9, 7, 24, 40, 1, 2, 0, false}),
    [](const auto& info) { return std::string(info.param.name); });

class GpuCutlassConvBnAddRelu : public ::testing::TestWithParam<CbrCase> {};

TEST_P(GpuCutlassConvBnAddRelu, AgreesWithKilnsFormToRounding) {
  KILN_REQUIRE_SM90_CUTLASS();
  const CbrCase& t = GetParam();
  const CbrForward kiln = run_conv_bn_add_relu(t, cutlass_switches(false, true));
  EXPECT_EQ(kiln.report.conv_cutlass + kiln.report.conv_cutlass_fallbacks, 0) << "switch off";
  for (const bool deterministic : {false, true}) {
    SCOPED_TRACE(deterministic ? "deterministic: per-CTA partials" : "FP32 atomics");
    const CbrForward cut = run_conv_bn_add_relu(t, cutlass_switches(true, deterministic));
    ASSERT_EQ(cut.report.conv_cutlass, 1) << "the convolution did not take the CUTLASS path";
    EXPECT_EQ(cut.report.cbr_cutlass + cut.report.cbr_cutlass_fallbacks, 0) << "no CBR here";
    expect_agrees_to_rounding(cut, kiln, t.k);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuCutlassConvBnAddRelu,
                         ::testing::Values(
                             // ResNet-50's bottleneck conv3 layers, then odd sizes.
                             CbrCase{"r50_56x56_c64_k256", 2, 56, 56, 64, 256, 1, 1, 0, false},
                             CbrCase{"r50_28x28_c128_k512", 2, 28, 28, 128, 512, 1, 1, 0, false},
                             CbrCase{"r50_14x14_c256_k1024", 4, 14, 14, 256, 1024, 1, 1, 0, false},
                             CbrCase{"r50_7x7_c512_k2048", 8, 7, 7, 512, 2048, 1, 1, 0, false},
                             CbrCase{"n3_5x7_c8_k16", 3, 5, 7, 8, 16, 1, 1, 0, false},
                             CbrCase{"n2_9x11_c72_k136", 2, 9, 11, 72, 136, 1, 1, 0, false}),
                         [](const auto& info) { return std::string(info.param.name); });

// Layers the GEMM cannot take (a 3x3 kernel, a stride, FP32) keep their form with the switch
// on, counted as fallbacks, with the switch-off program's bits (deterministic engines, so both
// pick the same cuDNN engine). Runs on any GPU: off SM90 even eligible layers fall back.
TEST(GpuCutlassCbrFallback, IneligibleLayersKeepTheirForm) {
  KILN_REQUIRE_GPU();
  struct Case {
    CbrCase cbr;
    bool amp;
  };
  for (const Case& c : {Case{{"n2_9x9_c8_k16_3x3", 2, 9, 9, 8, 16, 3, 1, 1, false}, true},
                        Case{{"n2_8x8_c16_k32_1x1_s2", 2, 8, 8, 16, 32, 1, 2, 0, false}, true},
                        Case{{"n2_6x6_c8_k24_1x1_fp32", 2, 6, 6, 8, 24, 1, 1, 0, false}, false}}) {
    SCOPED_TRACE(c.cbr.name);
    const CbrForward off = run_cbr_forward(c.cbr, 0, cutlass_switches(false, true), c.amp);
    const CbrForward on = run_cbr_forward(c.cbr, 0, cutlass_switches(true, true), c.amp);
    EXPECT_EQ(on.report.cbr_cutlass, 0);
    EXPECT_EQ(on.report.cbr_cutlass_fallbacks, 1);
    EXPECT_EQ(on.z, off.z);
    EXPECT_EQ(on.y, off.y);
    EXPECT_EQ(on.saved, off.saved);
    EXPECT_EQ(on.mask, off.mask);
  }
}

// ResNet-50 (224x224, batch 4, AMP) trained three steps in three forms, deterministic engines
// on all (step_forms.h): today's (kiln's statistics pass), cuDNN's conv+genstats
// (KILN_CBR_FORM=genstats, an accepted form whose per-channel sums are FP32 too) and
// KILN_CUTLASS, whose 16 bottleneck conv1 (CBR) and conv3 (before BN+add+ReLU) layers take the
// GEMM. The bar is genstats' noise: for every gradient of step 1 and every tensor after step 3,
// KILN_CUTLASS's distance from today's form is at most 4x genstats' distance plus AMP's 1e-2
// (SPEC Q2); step 1's loss within 1e-3 (the same weights and batch).
TEST(GpuCutlassStep, Resnet50StepsAgreeSwitchOffAndOn) {
  KILN_REQUIRE_SM90_CUTLASS();
  enum Form { kToday, kGenstats, kCutlass };
  // The forward's GEMM alone: the data gradient has its own step test
  // (gpu_cutlass_dgrad_step_test.cpp), against this form.
  const std::vector<StepForm> forms = {{"today", "kiln", Auto::off, Auto::off},
                                       {"genstats", "genstats", Auto::off, Auto::off},
                                       {"KILN_CUTLASS", "kiln", Auto::on, Auto::off}};
  const std::vector<FormSteps> runs = three_steps("resnet50", forms);
  const CompileReport &today = runs[kToday].report, &cut = runs[kCutlass].report;
  EXPECT_EQ(today.cbr_cutlass + today.cbr_cutlass_fallbacks, 0);
  EXPECT_GT(runs[kGenstats].report.cbr_genstats, 0) << "genstats took no layer: no noise floor";
  EXPECT_EQ(cut.cbr_cutlass, 16) << "ResNet-50's bottleneck conv1 layers";
  EXPECT_GT(cut.cbr_cutlass_fallbacks, 0) << "the stem and 3x3 layers keep cuDNN";
  EXPECT_EQ(cut.conv_cutlass, 16) << "ResNet-50's bottleneck conv3 layers";
  EXPECT_EQ(cut.conv_cutlass_fallbacks, 0);
  expect_within_noise(runs, forms, {kToday, kCutlass, kGenstats});
}

// The shortcut BatchNorms folded into BN+add+ReLU (KILN_FUSE_RESIDUAL_BN) where the block's conv3
// is on the SM90 GEMM, whose sums replace that BatchNorm's statistics pass, and layer1's shortcut
// convolution (1x1 stride 1) too, whose sums replace the folded shortcut BatchNorm's (the
// strided shortcuts keep cuDNN and the fused forward's own statistics pass, KILN_CUTLASS_CONV
// being off): held to today's form within the noise of KILN_CUTLASS without the fold.
TEST(GpuCutlassStep, Resnet50ResidualBnFoldedOnTheGemmAgrees) {
  KILN_REQUIRE_SM90_CUTLASS();
  enum Form { kToday, kCutlass, kFolded };
  std::vector<StepForm> forms = {
      {"today", "kiln", Auto::off, Auto::off},
      {"KILN_CUTLASS", "kiln", Auto::on, Auto::off},
      {"KILN_CUTLASS + KILN_FUSE_RESIDUAL_BN", "kiln", Auto::on, Auto::off}};
  forms[kFolded].fuse_residual_bn = true;
  const std::vector<FormSteps> runs = three_steps("resnet50", forms);
  EXPECT_EQ(runs[kFolded].report.conv_cutlass, 17) << "the 16 conv3 layers and layer1's shortcut";
  EXPECT_EQ(runs[kFolded].report.conv_cutlass_fallbacks, 3) << "the strided shortcuts";
  EXPECT_EQ(runs[kCutlass].report.conv_cutlass, 16) << "without the fold, conv3 alone";
  expect_within_noise(runs, forms, {kToday, kFolded, kCutlass});
}

// Three steps of `model` with KILN_CUTLASS_CONV on as well (the implicit-GEMM convolution for
// its 3x3 layers), held to today's form by genstats' noise as above; returns that form's report.
CompileReport implicit_convolution_steps_within_noise(const std::string& model) {
  enum Form { kToday, kGenstats, kConv };
  const std::vector<StepForm> forms = {
      {"today", "kiln", Auto::off, Auto::off},
      {"genstats", "genstats", Auto::off, Auto::off},
      {"KILN_CUTLASS_CONV", "kiln", Auto::on, Auto::off, Auto::on}};
  const std::vector<FormSteps> runs = three_steps(model, forms);
  EXPECT_GT(runs[kGenstats].report.cbr_genstats, 0) << "genstats took no layer: no noise floor";
  expect_within_noise(runs, forms, {kToday, kConv, kGenstats});
  return runs[kConv].report;
}

// ResNet-50's 16 conv2 layers (3x3, four of them strided) take the implicit-GEMM convolution,
// the stem (3 channels) keeps cuDNN.
TEST(GpuCutlassStep, Resnet50StepsAgreeImplicitConvolutionOffAndOn) {
  KILN_REQUIRE_SM90_CUTLASS();
  const CompileReport conv = implicit_convolution_steps_within_noise("resnet50");
  EXPECT_EQ(conv.cbr_cutlass_conv, 16) << "ResNet-50's bottleneck conv2 layers";
  EXPECT_EQ(conv.cbr_cutlass, 32) << "conv1 on the GEMM, conv2 on the implicit-GEMM convolution";
  EXPECT_EQ(conv.conv_cutlass, 16) << "conv3 on the GEMM";
}

// VGG16-BN: its 3x3 CBRs (with their folded max-pools) but the first (3 channels) on the
// implicit-GEMM convolution; VGG has no 1x1 layer for the GEMM.
TEST(GpuCutlassStep, Vgg16BnStepsAgreeImplicitConvolutionOffAndOn) {
  KILN_REQUIRE_SM90_CUTLASS();
  const CompileReport conv = implicit_convolution_steps_within_noise("vgg16_bn");
  EXPECT_EQ(conv.cbr_cutlass_conv, 12) << "VGG16-BN's 3x3 layers but the first";
  EXPECT_EQ(conv.cbr_cutlass, conv.cbr_cutlass_conv) << "no 1x1 layer";
}

}  // namespace
}  // namespace kiln::test
