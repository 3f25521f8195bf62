// A model's training step (ResNet-50's, VGG16-BN's) in several forms (switch settings), held to
// one another: what GpuCutlassStep (gpu_cutlass_cbr_test.cpp) and GpuCutlassDgradStep
// (gpu_cutlass_dgrad_step_test.cpp) share. Single gradients of an untrained network on 4 images
// are not stable under rounding (the first H200 run: up to 0.74 of a tensor's scale in step 1,
// with the loss equal to 1e-4: BatchNorm over a few hundred values a channel, and sums such as
// dbeta that cancel), so the bar for a form under test is the noise of another accepted form.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "kiln/blueprint/zoo.h"
#include "kiln/task/engine.h"
#include "support/engine_state.h"
#include "support/learnable_batch.h"

namespace kiln::test {

// One form: a name for the messages and the switches that differ between the forms.
struct StepForm {
  const char* name;
  const char* cbr_form;                 // KILN_CBR_FORM
  Auto cutlass;                         // KILN_CUTLASS
  Auto cutlass_dgrad;                   // KILN_CUTLASS_DGRAD
  Auto cutlass_conv = Auto::off;        // KILN_CUTLASS_CONV
  Auto cutlass_conv_dgrad = Auto::off;  // KILN_CUTLASS_CONV_DGRAD
  bool bn_fused_finalize = false;       // KILN_BN_FUSED_FINALIZE
  // KILN_CUTLASS_TIMED, which runs only without KILN_DETERMINISTIC: this form alone takes
  // cuDNN's autotuned engines and the SM90 kernels' atomic sums (its noise is larger); nothing
  // timed is kept on disk (KILN_AUTOTUNE_CACHE=0), only in the process.
  bool cutlass_timed = false;
  bool dresidual_from_dgrad = true;  // KILN_DRESIDUAL_FROM_DGRAD
  // KILN_DETERMINISTIC off without the timed choice: cuDNN's autotuned engines alone (also
  // nothing kept on disk), the noise that the timed form's cuDNN layers carry.
  bool autotuned = false;
  bool fuse_residual_bn = false;  // KILN_FUSE_RESIDUAL_BN
  // KILN_PAD_CHANNELS: off by default here, so that the first layer (3 channels) keeps cuDNN in
  // every form and the layer counts below stay those of the 3x3 and 1x1 layers (GpuCutlassConvCbr
  // holds the padded first layer on the SM90 convolution to today's form).
  Auto pad_channels = Auto::off;
  bool sums_clear_kernel = false;  // KILN_SUMS_CLEAR_KERNEL
  // KILN_FIRST_LAYER_CONV: off here for the same reason (GpuFirstLayerStep turns it on).
  Auto first_layer_conv = Auto::off;
  Auto first_layer_wgrad = Auto::off;    // KILN_FIRST_LAYER_WGRAD
  Auto first_layer_bn_fold = Auto::off;  // KILN_FIRST_LAYER_BN_FOLD
  bool pool_pooled_sums = false;         // KILN_POOL_POOLED_SUMS
  bool conv_dgrad_wide_tile = false;     // KILN_CONV_DGRAD_WIDE_TILE
  bool conv_dgrad_pingpong = false;      // KILN_CONV_DGRAD_PINGPONG
};

using NamedTensors = std::map<std::string, std::vector<float>>;

// What three steps of one form leave.
struct FormSteps {
  CompileReport report;
  std::vector<float> losses;  // each step's
  NamedTensors first;         // step 1's gradients
  NamedTensors last;          // the weights, buffers and gradients after step 3
};

// Every parameter's gradient (FP32, or FP16 where that is what the program keeps), by name.
inline void read_grads(Engine& e, NamedTensors& r) {
  for (const ParamDesc& d : e.program().params) {
    for (const Region g : {Region::grads_f32, Region::grads_f16}) {
      if (d.tensor[static_cast<size_t>(g)] == kNoTensor) continue;
      r["grad " + d.name] = e.read_param(d.name, g);
      break;
    }
  }
}

// A zoo model (224x224, batch 4, AMP, deterministic engines) trained three steps on the same
// batch in each form, with memory reuse as kiln runs it.
inline std::vector<FormSteps> three_steps(const std::string& model,
                                          const std::vector<StepForm>& forms) {
  const BluePrint bp = make_model(model);
  const LearnableBatch b = learnable_batch(bp, 4, 9);
  std::vector<FormSteps> runs;
  for (const StepForm& f : forms) {
    EngineOptions o;
    o.device = "cuda";
    o.compile.batch = 4;
    o.compile.amp = true;
    o.compile.momentum = 0.9f;
    // The default scale (8192) overflows at initialisation on 4 images, and a skipped step's
    // gradients are not the step's: with scale 1 each of the three steps is taken.
    o.compile.initial_loss_scale = 1.0f;
    o.switches.deterministic = !(f.cutlass_timed || f.autotuned);
    o.switches.cutlass_timed = f.cutlass_timed;
    if (f.cutlass_timed || f.autotuned) o.switches.autotune_cache = "0";
    o.switches.cbr_form = f.cbr_form;
    o.switches.cutlass = f.cutlass;
    o.switches.cutlass_dgrad = f.cutlass_dgrad;
    o.switches.cutlass_conv = f.cutlass_conv;
    o.switches.cutlass_conv_dgrad = f.cutlass_conv_dgrad;
    o.switches.bn_fused_finalize = f.bn_fused_finalize;
    o.switches.dresidual_from_dgrad = f.dresidual_from_dgrad;
    o.switches.fuse_residual_bn = f.fuse_residual_bn;
    o.switches.pad_channels = f.pad_channels;
    o.switches.sums_clear_kernel = f.sums_clear_kernel;
    o.switches.first_layer_conv = f.first_layer_conv;
    o.switches.first_layer_wgrad = f.first_layer_wgrad;
    o.switches.first_layer_bn_fold = f.first_layer_bn_fold;
    o.switches.pool_pooled_sums = f.pool_pooled_sums;
    o.switches.conv_dgrad_wide_tile = f.conv_dgrad_wide_tile;
    o.switches.conv_dgrad_pingpong = f.conv_dgrad_pingpong;
    Engine e(bp, o);
    e.lock_memory();
    e.compile(5);
    FormSteps r;
    r.report = e.backend().compile_report();
    for (int s = 0; s < 3; ++s) {
      const StepStats st = e.train_step(b.images.data(), b.labels.data(), 0.05f);
      EXPECT_FALSE(st.overflow) << "form " << f.name << ", step " << s + 1;
      r.losses.push_back(st.loss);
      if (s == 0) read_grads(e, r.first);
    }
    r.last = params_and_buffers(e);
    read_grads(e, r.last);
    runs.push_back(std::move(r));
  }
  return runs;
}

// Which of the runs is which: `tested` is held to `base` within 4x `noise`'s distance from base
// (and `noise2`'s, where given: the larger of the two).
struct FormRoles {
  size_t base, tested, noise;
  size_t noise2 = kNoForm;
  static constexpr size_t kNoForm = static_cast<size_t>(-1);
};

// The bar: for every gradient of step 1 and every tensor after step 3, the tested form's
// distance from the base form is at most 4x the noise forms' distance from it plus AMP's 1e-2
// (SPEC Q2), the tensors read back are mostly nonzero, and step 1's loss agrees within 1e-3
// (the same weights and batch) or, where a noise form's own step-1 loss is further off than
// that, within 4x its distance (step 1's loss is the forward alone: only the forward's engines
// differ). Prints the worst of each and the losses.
inline void expect_within_noise(const std::vector<FormSteps>& runs,
                                const std::vector<StepForm>& forms, FormRoles role) {
  const FormSteps &base = runs[role.base], &tested = runs[role.tested], &noise = runs[role.noise];
  const bool two = role.noise2 != FormRoles::kNoForm;
  const FormSteps& noise2 = runs[two ? role.noise2 : role.noise];
  const char* tested_name = forms[role.tested].name;
  const std::string noise_name = std::string(forms[role.noise].name) +
                                 (two ? std::string(" / ") + forms[role.noise2].name : "");
  auto loss_distance = [&](const FormSteps& r) {
    return rel_error({r.losses[0]}, {base.losses[0]}, kSumFloor);
  };
  const double loss_noise = std::max(loss_distance(noise), loss_distance(noise2));
  EXPECT_LE(loss_distance(tested), std::max(1e-3, 4 * loss_noise))
      << "step 1's loss (" << noise_name << ": " << loss_noise << ")";
  for (const FormSteps* r : {&noise, &noise2, &tested}) {
    ASSERT_EQ(r->first.size(), base.first.size());
    ASSERT_EQ(r->last.size(), base.last.size());
  }
  // Each tensor: the tested and the noise form's distances from the base form.
  auto compare = [&](NamedTensors FormSteps::*which, const char* when) {
    double worst_tested = 0, worst_noise = 0;
    std::string worst_name;
    size_t nonzero = 0;
    for (const auto& [name, want] : base.*which) {
      const double got = rel_error((tested.*which).at(name), want, kSumFloor);
      const double floor = std::max(rel_error((noise.*which).at(name), want, kSumFloor),
                                    rel_error((noise2.*which).at(name), want, kSumFloor));
      EXPECT_LE(got, 4 * floor + kGpuAmpTol)
          << when << ": " << name << " (" << noise_name << " " << floor << ")";
      nonzero += std::any_of(want.begin(), want.end(), [](float v) { return v != 0.0f; });
      if (got > worst_tested) worst_tested = got, worst_name = name;
      worst_noise = std::max(worst_noise, floor);
    }
    EXPECT_GT(nonzero, (base.*which).size() / 2)
        << when << ": the tensors read back are mostly zero";
    std::printf("  %s: %zu tensors; %s worst %.3g of its scale (%s), %s worst %.3g\n", when,
                (base.*which).size(), tested_name, worst_tested, worst_name.c_str(),
                noise_name.c_str(), worst_noise);
  };
  compare(&FormSteps::first, "step 1's gradients");
  compare(&FormSteps::last, "after 3 steps (weights, buffers, gradients)");
  std::printf("  losses");
  for (size_t i = 0; i < forms.size(); ++i) std::printf("%s %s", i ? " /" : "", forms[i].name);
  std::printf(":");
  for (size_t i = 0; i < runs.size(); ++i) {
    std::printf("%s", i ? " /" : "");
    for (const float loss : runs[i].losses) std::printf(" %.6f", loss);
  }
  std::printf("\n");
}

}  // namespace kiln::test
