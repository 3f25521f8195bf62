// KILN_CUTLASS_TIMED (src/backend/cuda/timed_form.cpp): with the four KILN_CUTLASS switches at
// auto, every layer an SM90 kernel can take is timed against cuDNN with kiln's pass while
// compiling and keeps the faster. Checked on ResNet-50's and VGG16-BN's training steps (224x224,
// batch 4, AMP):
//  - every layer the SM90 kernels take with all four switches on is timed, and each timed layer
//    ends on exactly one side (the SM90 counts plus the layers that kept cuDNN);
//  - a second compile in the same process finds every choice it timed (none timed again) and
//    makes the same ones;
//  - the steps agree with cuDNN's form within the noise of the form with every SM90 kernel on
//    and of cuDNN's autotuned engines alone (step_forms.h's bar), whichever mix the timing
//    chose. Of the other three forms only the timed one runs autotuned, non-deterministic
//    cuDNN engines (Winograd among them in FP16, as PyTorch's benchmark mode may): its first
//    H100 run put step 1's loss 1.5e-3 from cuDNN's form, where the every-SM90 form's was
//    6e-5, so the autotuned form says how much of that is cuDNN's engines.
// Needs a compute capability 9.0 GPU and a kiln built with the CUTLASS kernels; skips elsewhere.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "gpu/sm90_test_util.h"
#include "gpu/step_forms.h"

namespace kiln::test {
namespace {

int on_sm90(const CompileReport& r) {
  return r.cbr_cutlass + r.conv_cutlass + r.dgrad_cutlass;
}

void timed_steps_within_noise(const std::string& model) {
  enum Form { kCudnn, kEvery, kTimed, kAutotuned };
  const Auto a = Auto::automatic, off = Auto::off;
  std::vector<StepForm> forms = {
      {"cuDNN's form", "kiln", off, off},
      {"every SM90 kernel", "kiln", Auto::on, Auto::on, Auto::on, Auto::on},
      {"KILN_CUTLASS_TIMED", "kiln", a, a, a, a, false, true},
      {"cuDNN autotuned", "kiln", off, off}};
  forms[kAutotuned].autotuned = true;
  const std::vector<FormSteps> runs = three_steps(model, forms);
  const CompileReport &every = runs[kEvery].report, &timed = runs[kTimed].report;
  std::printf(
      "  %s: %d layers on the SM90 kernels with every switch on; timed %d, of which %d "
      "kept cuDNN (%d timed now)\n",
      model.c_str(), on_sm90(every), timed.sm90_timed, timed.sm90_timed_today,
      timed.sm90_timed_now);
  EXPECT_GT(on_sm90(every), 0);
  EXPECT_EQ(timed.sm90_timed, on_sm90(every)) << "every layer an SM90 kernel takes is timed";
  EXPECT_EQ(on_sm90(timed) + timed.sm90_timed_today, timed.sm90_timed)
      << "each timed layer on one side";
  EXPECT_EQ(runs[kCudnn].report.sm90_timed + every.sm90_timed + runs[kAutotuned].report.sm90_timed,
            0)
      << "switches off or set";
  expect_within_noise(runs, forms, {kCudnn, kTimed, kEvery, kAutotuned});

  // The same program compiled again in this process: every choice found, the same ones made.
  const std::vector<FormSteps> again = three_steps(model, {forms[kTimed]});
  const CompileReport& second = again[0].report;
  EXPECT_EQ(second.sm90_timed, timed.sm90_timed);
  EXPECT_EQ(second.sm90_timed_now, 0) << "each choice is remembered for the process";
  EXPECT_EQ(second.sm90_timed_today, timed.sm90_timed_today);
  EXPECT_EQ(second.cbr_cutlass, timed.cbr_cutlass);
  EXPECT_EQ(second.conv_cutlass, timed.conv_cutlass);
  EXPECT_EQ(second.dgrad_cutlass, timed.dgrad_cutlass);
}

TEST(GpuCutlassTimed, Resnet50EachLayerKeepsOneFormAndStepsAgree) {
  KILN_REQUIRE_SM90_CUTLASS();
  timed_steps_within_noise("resnet50");
}

TEST(GpuCutlassTimed, Vgg16BnEachLayerKeepsOneFormAndStepsAgree) {
  KILN_REQUIRE_SM90_CUTLASS();
  timed_steps_within_noise("vgg16_bn");
}

}  // namespace
}  // namespace kiln::test
