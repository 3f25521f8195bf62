// The SM90 data gradient with BatchNorm-backward's sums wired into the training step
// (KILN_CUTLASS_DGRAD, src/backend/cuda/cutlass_dgrad.cpp), against the same programs with the
// switch off (cuDNN's data gradient, kiln's BatchNorm backward with its sums pass):
//  - one bottleneck's backward as four nodes: conv3's data gradient into conv2's CBR backward,
//    and conv1's CBR backward whose data gradient is the previous block's BN+add+ReLU second
//    gradient (dy2), with g written to that node's dresidual, or (where dresidual's bytes are
//    in use until then) to dx and copied; every gradient, in the atomic and the deterministic
//    form, and the deterministic form bit for bit repeatable;
//  - ResNet-50's training steps (224x224, batch 4, AMP, memory reuse as kiln runs), with the
//    layer counts the architecture gives (tests/unit/dgrad_bn_rule_test.cpp derives them).
// The golden step against PyTorch with the switch on and off is in gpu_golden_test.cpp. Every
// case needs a compute capability 9.0 GPU and a kiln built with the CUTLASS kernels, and skips
// cleanly elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "gpu/sm90_test_util.h"
#include "gpu/step_forms.h"
#include "support/fused_checks.h"

namespace kiln::test {
namespace {

struct BottleneckCase {
  const char* name;
  int64_t n, h, w, width;  // the block's map and its width w (conv1: 4w -> w, conv3: w -> 4w)
};

// What the four nodes leave, by name, and how the backend built them.
struct BottleneckResult {
  std::map<std::string, std::vector<float>> t;
  std::vector<uint8_t> mask1;  // conv1's ReLU mask (an input: the same bits in every run)
  CompileReport report;
};

// dx with the elements whose mask bit is clear set to 0 (ops.def's layout: bit i % 8 of byte
// i / 8): the gradient at a CBR's BatchNorm as its ReLU's backward passes it.
std::vector<float> masked(std::vector<float> dx, const std::vector<uint8_t>& mask) {
  for (size_t i = 0; i < dx.size(); ++i) {
    if (((mask[i / 8] >> (i % 8)) & 1u) == 0) dx[i] = 0.0f;
  }
  return dx;
}

Switches dgrad_switches(bool dgrad, bool deterministic, bool conv_dgrad = false) {
  Switches sw = Switches::from_environment();
  sw.cutlass = Auto::on;  // no forward here; the switch the data gradient's auto follows
  sw.cutlass_dgrad = dgrad ? Auto::on : Auto::off;
  sw.cutlass_conv_dgrad = conv_dgrad ? Auto::on : Auto::off;
  sw.deterministic = deterministic;
  return sw;
}

// The backward of a bottleneck and of the previous block's output, as the compiler lowers them
// (graph/lower/fused.cpp), on inputs drawn as a forward would leave them:
//   conv_bwd_data (conv3: dY3, w3 -> dy2c)         feeds cbr_bwd (conv2, 3x3) as its dy;
//   cbr_bwd (conv2: ... -> dx = dy1c, ...)          feeds cbr_bwd (conv1) as its dy (3x3: not
//                                                   eligible, a counted fallback);
//   cbr_bwd (conv1, 1x1: ... -> dx = dyx, ...)     feeds bn_add_relu_bwd as its dy2;
//   bn_add_relu_bwd (previous block: z0, dres_in, mask0, gamma0, saved0, dyx -> dx0, dres0, ...).
// alias_dresidual: dres0 shares x1's bytes (a view), as memory reuse places it (x1 is read by
// conv1's weight gradient, the producer's step), so g must go to dx and be copied.
BottleneckResult run_bottleneck(const BottleneckCase& t, const Switches& sw, bool alias_dresidual) {
  const int64_t w = t.width, c4 = 4 * w, m = t.n * t.h * t.w;
  const Shape narrow{t.n, t.h, t.w, w}, wide{t.n, t.h, t.w, c4};
  OpHarness h(true);
  const fused::Maker mk{h, true};
  // conv3's data gradient: dY3 [m][4w], w3 [4w][1][1][w].
  const TensorId dy3 = mk.feature("dY3", wide), w3 = mk.weight("w3", {c4, 1, 1, w});
  const TensorId dy2c = mk.feature("dy2c", narrow);
  // conv2's CBR (3x3) and conv1's (1x1), each with its BatchNorm's forward state.
  struct Cbr {
    TensorId x, w, z, mask, gamma, saved, dx, dw, dgamma, dbeta, dz;
  };
  auto cbr = [&](const std::string& p, const Shape& xs, const Shape& ws) {
    Cbr c;
    c.x = mk.feature(p + ".x", xs), c.w = mk.weight(p + ".w", ws),
    c.z = mk.feature(p + ".z", narrow);
    c.mask = h.tensor(p + ".mask", {(narrow.numel() + 7) / 8}, Region::aux, DType::U8);
    c.gamma = mk.channels(p + ".gamma", w, Region::params_f32);
    c.saved = h.tensor(p + ".saved", {2, w}, Region::bn_saved);
    c.dx = mk.feature(p + ".dx", xs), c.dw = mk.weight_grad(p + ".dw", ws);
    c.dgamma = mk.channels(p + ".dgamma", w, Region::grads_f32);
    c.dbeta = mk.channels(p + ".dbeta", w, Region::grads_f32);
    c.dz = mk.feature(p + ".dz", narrow);
    return c;
  };
  const Cbr c2 = cbr("conv2", narrow, {w, 3, 3, w}), c1 = cbr("conv1", wide, {w, 1, 1, c4});
  // The previous block's BN+add+ReLU: its z, mask, statistics; dres_in is the residual path's
  // gradient (this block's own dresidual in a real program), made before conv1's.
  const TensorId z0 = mk.feature("bn0.z", wide), dres_in = mk.feature("bn0.dy", wide);
  const TensorId mask0 = h.tensor("bn0.mask", {(wide.numel() + 7) / 8}, Region::aux, DType::U8);
  const TensorId gamma0 = mk.channels("bn0.gamma", c4, Region::params_f32);
  const TensorId saved0 = h.tensor("bn0.saved", {2, c4}, Region::bn_saved);
  const TensorId dx0 = mk.feature("bn0.dx", wide), dres0 = mk.feature("bn0.dresidual", wide);
  const TensorId dgamma0 = mk.channels("bn0.dgamma", c4, Region::grads_f32),
                 dbeta0 = mk.channels("bn0.dbeta", c4, Region::grads_f32);
  if (alias_dresidual) h.program().tensors[static_cast<size_t>(dres0)].view_of = c1.x;

  h.node(OpKind::conv_bwd_data, {dy3, w3}, {dy2c}, fused::conv_bn_attrs(1, 1, 0));
  h.node(OpKind::cbr_bwd, {c2.x, c2.w, c2.z, dy2c, c2.mask, c2.gamma, c2.saved},
         {c2.dx, c2.dw, c2.dgamma, c2.dbeta, c2.dz}, fused::conv_bn_attrs(3, 1, 1));
  h.node(OpKind::cbr_bwd, {c1.x, c1.w, c1.z, c2.dx, c1.mask, c1.gamma, c1.saved},
         {c1.dx, c1.dw, c1.dgamma, c1.dbeta, c1.dz}, fused::conv_bn_attrs(1, 1, 0));
  h.node(OpKind::bn_add_relu_bwd, {z0, dres_in, mask0, gamma0, saved0, c1.dx},
         {dx0, dres0, dgamma0, dbeta0}, fused::conv_bn_attrs(1, 1, 0));
  h.compile(make_backend("cuda", sw));

  // Inputs: maps in [-1, 1], z with a mean away from 0, masks of random bits, saved = [z's
  // batch mean; an inverse std], gammas near 1 (each tensor its own seed).
  uint64_t seed = 100;
  auto map = [&](TensorId id, float lo = -1.0f, float hi = 1.0f) {
    h.write(id, random_values(static_cast<size_t>(h.program().tensor(id).numel()), ++seed, lo, hi));
  };
  auto bn_state = [&](TensorId z, TensorId mask, TensorId gamma, TensorId saved, int64_t c) {
    std::vector<float> zv = round_f16(rand_floats(m * c, ++seed, -1.0f, 3.0f));
    h.write(z, zv);
    std::vector<uint8_t> bits;
    for (float b : rand_floats((m * c + 7) / 8, ++seed, 0.0f, 256.0f))
      bits.push_back(static_cast<uint8_t>(std::min(255.0f, b)));
    h.write_u8(mask, bits);
    h.write(gamma, random_values(static_cast<size_t>(c), ++seed, 0.5f, 1.5f));
    std::vector<float> s(static_cast<size_t>(2 * c));
    const std::vector<float> invstd = rand_floats(c, ++seed, 0.5f, 2.0f);
    for (int64_t ch = 0; ch < c; ++ch) {
      double sum = 0.0;
      for (int64_t r = 0; r < m; ++r) sum += zv[static_cast<size_t>(r * c + ch)];
      s[static_cast<size_t>(ch)] = static_cast<float>(sum / static_cast<double>(m));
      s[static_cast<size_t>(c + ch)] = invstd[static_cast<size_t>(ch)];
    }
    h.write(saved, s);
  };
  map(dy3);
  map(w3, -0.5f, 0.5f);
  for (const Cbr* c : {&c2, &c1}) {
    map(c->x);
    map(c->w, -0.5f, 0.5f);
    bn_state(c->z, c->mask, c->gamma, c->saved, w);
  }
  bn_state(z0, mask0, gamma0, saved0, c4);
  map(dres_in);
  h.run();

  BottleneckResult r;
  r.report = h.backend().compile_report();
  r.mask1 = h.read_u8(c1.mask);
  // conv1's dx is not read: with the switch on it holds g or nothing (g went to dresidual).
  for (const auto& [name, id] : std::map<std::string, TensorId>{{"conv2 dgamma", c2.dgamma},
                                                                {"conv2 dbeta", c2.dbeta},
                                                                {"conv2 dz", c2.dz},
                                                                {"conv2 dw", c2.dw},
                                                                {"conv2 dx", c2.dx},
                                                                {"conv1 dgamma", c1.dgamma},
                                                                {"conv1 dbeta", c1.dbeta},
                                                                {"conv1 dz", c1.dz},
                                                                {"conv1 dw", c1.dw},
                                                                {"bn0 dgamma", dgamma0},
                                                                {"bn0 dbeta", dbeta0},
                                                                {"bn0 dx", dx0},
                                                                {"bn0 dresidual", dres0}})
    r.t[name] = h.read(id);
  return r;
}

class GpuCutlassDgradWire : public ::testing::TestWithParam<BottleneckCase> {};

// With the switch on, conv3's and conv1's data gradients take the SM90 kernel (2) and conv2's
// (3x3) keeps cuDNN (1 fallback), or with KILN_CUTLASS_CONV_DGRAD on takes the implicit-GEMM
// data gradient (3, of them 1 implicit). The kernel's g may differ from cuDNN's FP16 dX (then g) by
// one FP16 rounding (2^-11 of |dX|) where their FP32 sums of the same products round to neighbours
// (gpu_cutlass_dgrad_test.cpp measures that bound), and its FP32 sums differ from the sums pass's
// double ones in their last bits; every tensor after it carries that through FP16 roundings of its
// own (dz, dx, the next data and weight gradients): the AMP bound, 1e-2 of each tensor's scale
// (SPEC Q2), far below a wrong mask, a missing dy2 or a channel's sums in the wrong place (O(1)).
TEST_P(GpuCutlassDgradWire, BottleneckBackwardAgreesSwitchOffAndOn) {
  KILN_REQUIRE_SM90_CUTLASS();
  const BottleneckCase& t = GetParam();
  for (const bool alias : {false, true}) {
    SCOPED_TRACE(alias ? "dresidual's bytes in use: g to dx, copied" : "g to dresidual");
    const BottleneckResult off = run_bottleneck(t, dgrad_switches(false, true), alias);
    EXPECT_EQ(off.report.dgrad_cutlass + off.report.dgrad_cutlass_fallbacks, 0) << "switch off";
    for (const auto& [deterministic, conv] : std::vector<std::pair<bool, bool>>{
             {false, false}, {true, false}, {false, true}, {true, true}}) {
      SCOPED_TRACE(deterministic ? "deterministic: per-CTA partials" : "FP32 atomics");
      SCOPED_TRACE(conv ? "conv2's on the implicit-GEMM data gradient" : "conv2's on cuDNN");
      const BottleneckResult on =
          run_bottleneck(t, dgrad_switches(true, deterministic, conv), alias);
      ASSERT_EQ(on.report.dgrad_cutlass, conv ? 3 : 2)
          << "conv3's and conv1's data gradients did not take the SM90 kernel (the log says why)";
      EXPECT_EQ(on.report.dgrad_cutlass_fallbacks, conv ? 0 : 1) << "conv2's (3x3) keeps cuDNN";
      EXPECT_EQ(on.report.dgrad_cutlass_conv, conv ? 1 : 0) << "conv2's (3x3) implicit GEMM";
      for (const auto& [name, off_value] : off.t) {
        // conv2's data gradient on the SM90 kernel writes conv1's CBR's g into its dx: cuDNN's dx
        // through conv1's ReLU mask (as conv3's into conv2's dy, which is not read back here).
        const std::vector<float> want =
            conv && name == "conv2 dx" ? masked(off_value, off.mask1) : off_value;
        const double err = rel_error(on.t.at(name), want, kSumFloor);
        EXPECT_LE(err, kGpuAmpTol) << name;
        if (print_op_errors()) std::printf("  %s: %.3g of its scale\n", name.c_str(), err);
      }
      if (deterministic) {
        const BottleneckResult again = run_bottleneck(t, dgrad_switches(true, true, conv), alias);
        for (const auto& [name, got] : on.t) EXPECT_EQ(again.t.at(name), got) << name;
        // The BatchNorm backward's finalize inside its dx pass (KILN_BN_FUSED_FINALIZE=1) and as
        // a launch of its own: the same expressions, the same bits.
        Switches inside_sw = dgrad_switches(true, true, conv), apart_sw = inside_sw;
        inside_sw.bn_fused_finalize = true;
        apart_sw.bn_fused_finalize = false;
        const BottleneckResult inside = run_bottleneck(t, inside_sw, alias);
        const BottleneckResult apart = run_bottleneck(t, apart_sw, alias);
        for (const auto& [name, got] : apart.t)
          EXPECT_EQ(inside.t.at(name), got) << name << ", finalize inside the dx pass";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuCutlassDgradWire,
    ::testing::Values(
        // ResNet-50's layer2 and layer4 blocks at small batches, and an odd one: rows under a
        // tile and not a multiple of it, 8 channels (conv3's data gradient on the 128x64 tile).
        BottleneckCase{"r50_28x28_w128", 2, 28, 28, 128},
        BottleneckCase{"r50_7x7_w512", 4, 7, 7, 512}, BottleneckCase{"n3_5x7_w8", 3, 5, 7, 8}),
    [](const auto& info) { return std::string(info.param.name); });

// ResNet-50 (224x224, batch 4, AMP) trained three steps, deterministic engines, in three forms
// (step_forms.h): cuDNN alone (KILN_CUTLASS=0), the forward's GEMM (KILN_CUTLASS=1,
// KILN_CUTLASS_DGRAD=0) and both (=1, =1). With the data gradient on, its 16 conv3 data
// gradients (into conv2's CBR) and 15 conv1 data gradients (into the previous block's
// BN+add+ReLU; layer1.0's input is the stem's) take the SM90 kernel; conv2's 16 (3x3) and the 3
// stride-2 downsamples of layer2-4 keep cuDNN (tests/unit/dgrad_bn_rule_test.cpp derives both
// numbers from the program). Memory reuse is on, as kiln runs: conv1's g goes to dresidual (the
// plan keeps it live from conv1's step), or with KILN_DRESIDUAL_FROM_DGRAD=0 to dx, copied by
// the BatchNorm backward (the rule's test shows both plans). As in GpuCutlassStep, the bar is the
// noise of another accepted form: each tensor's distance between the two CUTLASS forms at most
// 4x the distance between cuDNN's form and the forward's GEMM, plus AMP's 1e-2 (SPEC Q2); step
// 1's loss within 1e-3 (the same weights and batch).
TEST(GpuCutlassDgradStep, Resnet50StepsAgreeSwitchOffAndOn) {
  KILN_REQUIRE_SM90_CUTLASS();
  enum Form { kCudnn, kForward, kDgrad, kFinalize, kCopied };
  const std::vector<StepForm> forms = {
      {"cuDNN's form", "kiln", Auto::off, Auto::off},
      {"the forward's GEMM", "kiln", Auto::on, Auto::off},
      {"KILN_CUTLASS_DGRAD", "kiln", Auto::on, Auto::on},
      {"KILN_BN_FUSED_FINALIZE", "kiln", Auto::on, Auto::on, Auto::off, Auto::off, true},
      {"KILN_DRESIDUAL_FROM_DGRAD=0", "kiln", Auto::on, Auto::on, Auto::off, Auto::off, false,
       false, false}};
  const std::vector<FormSteps> runs = three_steps("resnet50", forms);
  const CompileReport &forward = runs[kForward].report, &dgrad = runs[kDgrad].report;
  EXPECT_EQ(forward.dgrad_cutlass + forward.dgrad_cutlass_fallbacks, 0);
  EXPECT_EQ(forward.conv_cutlass, 16) << "the forward's GEMM took the conv3 layers";
  EXPECT_EQ(dgrad.dgrad_cutlass, 31) << "16 conv3 and 15 conv1 data gradients";
  EXPECT_EQ(dgrad.dgrad_cutlass_fallbacks, 19) << "16 conv2 (3x3), 3 downsamples";
  EXPECT_EQ(dgrad.conv_cutlass, 16);
  expect_within_noise(runs, forms, {kForward, kDgrad, kCudnn});
  // The BatchNorms fed by the SM90 kernels' sums finalizing inside their apply and dx passes:
  // the same expressions on the same sums, held to the data gradient's form by the same bar.
  expect_within_noise(runs, forms, {kForward, kFinalize, kCudnn});
  EXPECT_EQ(runs[kFinalize].losses[0], runs[kDgrad].losses[0]) << "the forward's same bits";
  // g through dx and the BatchNorm backward's copy: the same arithmetic in other bytes.
  EXPECT_EQ(runs[kCopied].report.dgrad_cutlass, 31);
  expect_within_noise(runs, forms, {kForward, kCopied, kCudnn});
  EXPECT_EQ(runs[kCopied].losses[0], runs[kDgrad].losses[0]) << "the forward's same bits";
}

// The same with KILN_CUTLASS_CONV_DGRAD on as well: the stride-1 3x3 data gradients that feed a
// CBR backward take the implicit-GEMM data gradient, held to cuDNN's form by the noise of the
// 1x1 data gradient's form (the previous test's bar), deterministic engines and the partials
// form. ResNet-50: 13 of its 16 conv2 (the three strided ones keep cuDNN), so 31 + 13 on the
// SM90 kernels and 3 + 3 kept; VGG16-BN: the 8 3x3 layers whose dx feeds a CBR (not a max-pool),
// the second of each block and the third of blocks 3 to 5. VGG16-BN has no 1x1 layer, so its
// KILN_CUTLASS_DGRAD form is cuDNN's bit for bit (no noise at all, while its three steps at this
// learning rate blow up: losses 7.1, 11.6, 3,758 on the H200, where 1e-3 of difference in step 1
// grows to O(1) in the weights); its bar is genstats' noise instead, as the forward's test's.
CompileReport implicit_dgrad_steps_within_noise(const std::string& model) {
  enum Form { kCudnn, kDgrad, kConvDgrad, kGenstats };
  const std::vector<StepForm> forms = {
      {"cuDNN's form", "kiln", Auto::off, Auto::off},
      {"KILN_CUTLASS_DGRAD", "kiln", Auto::on, Auto::on},
      {"KILN_CUTLASS_CONV_DGRAD", "kiln", Auto::on, Auto::on, Auto::off, Auto::on},
      {"genstats", "genstats", Auto::off, Auto::off}};
  const std::vector<FormSteps> runs = three_steps(model, forms);
  EXPECT_EQ(runs[kDgrad].report.dgrad_cutlass_conv, 0) << "switch off";
  const bool has_gemm_layers = runs[kDgrad].report.dgrad_cutlass > 0;
  if (!has_gemm_layers) EXPECT_GT(runs[kGenstats].report.cbr_genstats, 0) << "no noise floor";
  expect_within_noise(runs, forms, {kCudnn, kConvDgrad, has_gemm_layers ? kDgrad : kGenstats});
  return runs[kConvDgrad].report;
}

TEST(GpuCutlassDgradStep, Resnet50StepsAgreeImplicitDataGradientOffAndOn) {
  KILN_REQUIRE_SM90_CUTLASS();
  const CompileReport r = implicit_dgrad_steps_within_noise("resnet50");
  EXPECT_EQ(r.dgrad_cutlass_conv, 13) << "the unstrided conv2 data gradients";
  EXPECT_EQ(r.dgrad_cutlass, 44) << "16 conv3, 15 conv1 and 13 conv2 data gradients";
  EXPECT_EQ(r.dgrad_cutlass_fallbacks, 6) << "3 strided conv2, 3 downsamples";
}

// KILN_SUMS_CLEAR_KERNEL: the four SM90 units (the forward's GEMM and implicit GEMM, both data
// gradients) clear the sums they add into with a kernel instead of a memset. Deterministic
// (per-CTA partials in a fixed order), the two clears give the same bits throughout; with FP32
// atomic sums (cuDNN autotuned, not deterministic), the kernel's form is held to cuDNN's form by
// the memset form's noise.
TEST(GpuCutlassDgradStep, Resnet50SumsClearedByKernelOrMemsetAlike) {
  KILN_REQUIRE_SM90_CUTLASS();
  enum Form { kCudnn, kMemset, kKernel, kAtomicMemset, kAtomicKernel };
  std::vector<StepForm> forms = {
      {"cuDNN's form", "kiln", Auto::off, Auto::off},
      {"SM90 kernels, memset", "kiln", Auto::on, Auto::on, Auto::on, Auto::on},
      {"SM90 kernels, KILN_SUMS_CLEAR_KERNEL", "kiln", Auto::on, Auto::on, Auto::on, Auto::on},
      {"atomic sums, memset", "kiln", Auto::on, Auto::on, Auto::on, Auto::on},
      {"atomic sums, KILN_SUMS_CLEAR_KERNEL", "kiln", Auto::on, Auto::on, Auto::on, Auto::on}};
  forms[kKernel].sums_clear_kernel = forms[kAtomicKernel].sums_clear_kernel = true;
  forms[kAtomicMemset].autotuned = forms[kAtomicKernel].autotuned = true;
  const std::vector<FormSteps> runs = three_steps("resnet50", forms);
  for (const Form f : {kMemset, kKernel}) {
    EXPECT_EQ(runs[f].report.conv_cutlass, 16) << forms[f].name;
    EXPECT_GT(runs[f].report.cbr_cutlass_conv, 0) << forms[f].name << ": the implicit GEMM";
    EXPECT_GT(runs[f].report.dgrad_cutlass_conv, 0) << forms[f].name << ": the implicit dgrad";
  }
  EXPECT_EQ(runs[kKernel].losses, runs[kMemset].losses);
  for (auto which : {&FormSteps::first, &FormSteps::last}) {
    const NamedTensors &a = runs[kKernel].*which, &b = runs[kMemset].*which;
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [name, values] : a) {
      const auto it = b.find(name);
      ASSERT_NE(it, b.end()) << name;
      EXPECT_EQ(values, it->second) << name << ": other bits with the sums cleared by a kernel";
    }
  }
  expect_within_noise(runs, forms, {kCudnn, kAtomicKernel, kAtomicMemset});
}

TEST(GpuCutlassDgradStep, Vgg16BnStepsAgreeImplicitDataGradientOffAndOn) {
  KILN_REQUIRE_SM90_CUTLASS();
  const CompileReport r = implicit_dgrad_steps_within_noise("vgg16_bn");
  EXPECT_EQ(r.dgrad_cutlass_conv, 8) << "the 3x3 data gradients that feed a CBR backward";
  EXPECT_EQ(r.dgrad_cutlass, 8) << "VGG has no 1x1 layer";
  EXPECT_EQ(r.dgrad_cutlass_fallbacks, 0);
}

// KILN_CONV_DGRAD_WIDE_TILE: VGG16-BN's 3x3 data gradients of 128 channels or more on the
// 256x128 unit. It has atomic sums only, so both SM90 forms run without KILN_DETERMINISTIC; the
// wide one is held to cuDNN's form by the 128-row form's noise (and genstats').
TEST(GpuCutlassDgradStep, Vgg16BnStepsAgreeWideDataGradientTile) {
  KILN_REQUIRE_SM90_CUTLASS();
  enum Form { kCudnn, kNarrow, kWide, kGenstats };
  std::vector<StepForm> forms = {
      {"cuDNN's form", "kiln", Auto::off, Auto::off},
      {"KILN_CUTLASS_CONV_DGRAD, 128-row tiles", "kiln", Auto::on, Auto::on, Auto::off, Auto::on},
      {"KILN_CONV_DGRAD_WIDE_TILE", "kiln", Auto::on, Auto::on, Auto::off, Auto::on},
      {"genstats", "genstats", Auto::off, Auto::off}};
  forms[kNarrow].autotuned = forms[kWide].autotuned = true;
  forms[kWide].conv_dgrad_wide_tile = true;
  const std::vector<FormSteps> runs = three_steps("vgg16_bn", forms);
  EXPECT_EQ(runs[kNarrow].report.dgrad_cutlass_conv, 8);
  EXPECT_EQ(runs[kNarrow].report.dgrad_cutlass_wide, 0) << "switch off";
  EXPECT_EQ(runs[kWide].report.dgrad_cutlass_conv, 8);
  EXPECT_EQ(runs[kWide].report.dgrad_cutlass_wide, 7) << "all but block 1's 64-channel layer";
  EXPECT_GT(runs[kGenstats].report.cbr_genstats, 0) << "no noise floor";
  expect_within_noise(runs, forms, {kCudnn, kWide, kNarrow, kGenstats});
}

// KILN_CONV_DGRAD_PINGPONG: VGG16-BN's 3x3 data gradients that feed a CBR on the ping-pong units
// (both widths), held to cuDNN's form as the wide tile is above.
TEST(GpuCutlassDgradStep, Vgg16BnStepsAgreePingpongDataGradient) {
  KILN_REQUIRE_SM90_CUTLASS();
  enum Form { kCudnn, kCooperative, kPingpong, kGenstats };
  std::vector<StepForm> forms = {
      {"cuDNN's form", "kiln", Auto::off, Auto::off},
      {"KILN_CUTLASS_CONV_DGRAD, cooperative", "kiln", Auto::on, Auto::on, Auto::off, Auto::on},
      {"KILN_CONV_DGRAD_PINGPONG", "kiln", Auto::on, Auto::on, Auto::off, Auto::on},
      {"genstats", "genstats", Auto::off, Auto::off}};
  forms[kCooperative].autotuned = forms[kPingpong].autotuned = true;
  forms[kPingpong].conv_dgrad_pingpong = true;
  const std::vector<FormSteps> runs = three_steps("vgg16_bn", forms);
  EXPECT_EQ(runs[kCooperative].report.dgrad_cutlass_pingpong, 0) << "switch off";
  EXPECT_EQ(runs[kPingpong].report.dgrad_cutlass_conv, 8);
  EXPECT_EQ(runs[kPingpong].report.dgrad_cutlass_pingpong, 8) << "both widths";
  EXPECT_GT(runs[kGenstats].report.cbr_genstats, 0) << "no noise floor";
  expect_within_noise(runs, forms, {kCudnn, kPingpong, kCooperative, kGenstats});
}

// VGG16-BN with the pooled picks (KILN_POOL_POOLED_SUMS): the first layer of blocks 2 to 5 feeds
// a pooled CBR's backward, whose sums the implicit-GEMM data gradient then takes from zp and mp
// (dgrad_bn_rule.h), writing g = mp ? dy : 0 for the dx pass to route: 8 + 4 layers, held to
// cuDNN's form (with the picks' own sums pass) by genstats' noise, as above.
TEST(GpuCutlassDgradStep, Vgg16BnStepsAgreePooledPicksIntoTheDataGradient) {
  KILN_REQUIRE_SM90_CUTLASS();
  enum Form { kCudnn, kConvDgrad, kGenstats };
  std::vector<StepForm> forms = {
      {"cuDNN's form, pooled picks", "kiln", Auto::off, Auto::off},
      {"KILN_CUTLASS_CONV_DGRAD, pooled picks", "kiln", Auto::on, Auto::on, Auto::off, Auto::on},
      {"genstats", "genstats", Auto::off, Auto::off}};
  forms[kCudnn].pool_pooled_sums = forms[kConvDgrad].pool_pooled_sums = true;
  const std::vector<FormSteps> runs = three_steps("vgg16_bn", forms);
  const CompileReport& r = runs[kConvDgrad].report;
  EXPECT_EQ(r.dgrad_cutlass_conv, 12) << "the 3x3 data gradients that feed a CBR or pooled CBR";
  EXPECT_EQ(r.dgrad_cutlass_fallbacks, 0);
  EXPECT_GT(runs[kGenstats].report.cbr_genstats, 0) << "no noise floor";
  expect_within_noise(runs, forms, {kCudnn, kConvDgrad, kGenstats});
}

}  // namespace
}  // namespace kiln::test
