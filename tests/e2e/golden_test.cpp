// One training step of the `cnn` model against PyTorch (SPEC Q2): the same weights and batch
// (tests/data/golden_cnn.safetensors, written by tests/golden/make_cnn_golden.py in float64)
// give the same loss, every parameter gradient, and the same weights and running statistics
// after one SGD step (Nesterov momentum, weight decay on conv/fc weights only).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kiln/blueprint/zoo.h"
#include "kiln/io/safetensors.h"
#include "kiln/task/checkpoint.h"
#include "kiln/task/engine.h"
#include "support/torch_golden.h"

namespace kiln {
namespace {

std::vector<float> floats(const StTensor& t) {
  std::vector<float> v(t.data.size() / 4);
  std::memcpy(v.data(), t.data.data(), t.data.size());
  return v;
}

// Largest error relative to the tensor's own scale (its largest magnitude): a gradient's
// small entries come from sums of cancelling terms whose rounding is set by the large ones.
double scaled_error(const std::vector<float>& got, const std::vector<float>& want) {
  double scale = 1e-12, worst = 0;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::fabs(w)));
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
  return worst / scale;
}

TEST(GoldenPyTorch, CnnStepMatchesPyTorch) {
  const std::string path = std::string(KILN_SOURCE_DIR) + "/tests/data/golden_cnn.safetensors";
  const StFile g = read_safetensors(path);
  EngineOptions o;
  o.device = "cpu";
  o.compile.batch = 8;
  o.compile.momentum = 0.9f;
  o.compile.nesterov = true;
  o.compile.weight_decay = 5e-4f;
  Engine e(make_model("cnn"), o);
  e.lock_memory();
  e.compile();
  import_weights(e, path);  // torchvision names and layouts → kiln's
  const std::vector<float> images = floats(g.tensors.at("input.nhwc"));
  std::vector<int32_t> labels(8);
  std::memcpy(labels.data(), g.tensors.at("labels").data.data(), 32);
  const StepStats s = e.train_step(images.data(), labels.data(), 0.1f);

  // FP32 against a float64 reference: the loss is one log-sum-exp over 10 logits each a
  // 3136-term dot product; 1e-5 relative is ~100 float32 ulps of headroom.
  const float want_loss = floats(g.tensors.at("loss"))[0];
  EXPECT_NEAR(s.loss, want_loss, 1e-5 * std::fabs(want_loss));

  const Program& p = e.program();
  for (const ParamDesc& d : p.params) {
    const std::vector<float> grad = to_torch_layout(d, e.read_param(d.name, Region::grads_f32));
    // Gradients pass through four BatchNorm backward passes (each a reduction over 8*28*28
    // or 8*14*14 values in FP32): 1e-4 of the tensor's scale.
    EXPECT_LT(scaled_error(grad, floats(g.tensors.at("grad." + d.name))), 1e-4)
        << "gradient of " << d.name;
    const std::vector<float> after = to_torch_layout(d, e.read_param(d.name));
    // The update is lr * (g + wd*w) with Nesterov: weights change by ~1e-2 of their scale,
    // so a 1e-4 gradient error moves them by ~1e-6 of theirs.
    EXPECT_LT(scaled_error(after, floats(g.tensors.at("after." + d.name))), 1e-5)
        << "weights of " << d.name;
  }
  for (const BufferDesc& b : p.buffers) {
    // Running statistics after one step: momentum 0.1 of the batch mean / unbiased variance.
    EXPECT_LT(scaled_error(e.read_param(b.name), floats(g.tensors.at("after." + b.name))), 1e-5)
        << b.name;
  }
}

// tests/golden/torch_step.py, the script that makes the test-time references below, rebuilds
// the committed cnn golden from its own weights and batch: the same model, loss, SGD and
// weight-decay conventions as make_cnn_golden.py. The committed file was computed from
// float64 weights and stored as float32, the script starts from those float32 values, so
// the two differ by float32 rounding of the inputs (~1e-7 of each tensor's scale): 1e-6.
TEST(GoldenPyTorch, TorchStepScriptReproducesTheCnnGolden) {
  KILN_REQUIRE_TORCH(python);
  const std::string golden = std::string(KILN_SOURCE_DIR) + "/tests/data/golden_cnn.safetensors";
  test::golden_detail::TempDir dir("cnn_script");
  const std::string out = dir.file("torch.safetensors");
  const std::string cmd = "'" + python + "' '" + KILN_SOURCE_DIR +
                          "/tests/golden/torch_step.py' cnn '" + golden + "' '" + out +
                          "' --lr 0.1 --momentum 0.9 --nesterov --weight-decay 5e-4";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const StFile want = read_safetensors(golden), got = read_safetensors(out);
  int compared = 0;
  for (const auto& [name, t] : want.tensors) {
    if (name != "loss" && name.rfind("grad.", 0) != 0 && name.rfind("after.", 0) != 0) continue;
    ASSERT_TRUE(got.tensors.count(name)) << "torch_step.py did not write " << name;
    EXPECT_LT(scaled_error(floats(got.tensors.at(name)), floats(t)), 1e-6) << name;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(got.tensors.size()))
      << "torch_step.py wrote tensors the golden lacks";
}

// ResNet-18 and VGG11-BN (the 32x32 forms) against PyTorch, with references made at test time
// (support/torch_golden.h): kiln's initial weights (BatchNorm parameters, running statistics
// and biases randomised) and one learnable batch go through a safetensors file to
// tests/golden/torch_step.py, which takes one SGD step in float64 (Nesterov, momentum 0.9,
// weight decay 5e-4 on conv/fc weights, lr 0.1), following kiln's ReLU and max-pool choices
// where the two fall within rounding of a kink. Batch 4 keeps each test to seconds on two
// cores; BatchNorm still averages 4*4*4 = 64 values per channel in ResNet's last stage.
//
// Tolerances, FP32 against float64 (GoldenStep's defaults):
//  - loss 1e-5 relative: one log-sum-exp over 10 logits (as the cnn golden).
//  - gradients 1e-4 of each tensor's scale (a bias's: at least its layer's weight gradient's).
//    A gradient reaches the stem through 10 to 20 BatchNorm backward passes, each two FP32
//    reductions over N*H*W values whose terms cancel (the means of dy and of dy*x_hat are
//    subtracted back); measured: 2e-6 to 1.1e-5 (five seeds). 1e-4 leaves room for other orders
//    (oneDNN's blocking, thread counts), while a wrong term is off by far more: normalising
//    by the unbiased variance moves x_hat by 1/(2*(N*H*W-1)) = 8e-3 at ResNet's last stage
//    (4*4*4 values), a gamma or a 1/N left out by O(1).
//  - weights after the step: 1e-6 of scale (FP32 rounding of the new weight, on both sides)
//    plus the gradient's 1e-4 carried through the update (times lr * (1 + momentum) and the
//    gradient's scale; the update is 1e-3 to 1 of a tensor's scale here). A weight decay
//    missed or applied to a BatchNorm parameter or bias shows as lr * (1 + momentum) * wd =
//    1e-4 of the weight, a Nesterov term missed as half the update.
//  - running statistics 1e-5 of scale: 0.9 * old + 0.1 * batch statistic (measured 4e-7).
//    A biased variance is off by 1/(N*H*W-1) of it, 1.6e-2 at ResNet's last stage.
//  - kinks: kiln may decide a ReLU or a max-pool differently from float64 only within 1e-4
//    of that tensor's scale (the forward's FP32 rounding is ~1e-6 of it).
TEST(GoldenPyTorch, ResNet18SmallStepMatchesPyTorch) {
  KILN_REQUIRE_TORCH(python);
  test::GoldenStep g;
  g.model = "resnet18_small";
  test::run_golden_step(python, g);
}

// ResNet-50's bottleneck blocks (1x1, 3x3 with the stride, 1x1 to four times the width; a 1x1
// downsample) with the same stem: 53 BatchNorm layers where ResNet-18 has 20, its branches'
// last BatchNorm started small (resnet50_small_step says why). ~20 s on two cores, most of it
// PyTorch's float64 step.
TEST(GoldenPyTorch, ResNet50SmallStepMatchesPyTorch) {
  KILN_REQUIRE_TORCH(python);
  test::run_golden_step(python, test::resnet50_small_step("cpu"));
}

TEST(GoldenPyTorch, Vgg11BnSmallStepMatchesPyTorch) {
  KILN_REQUIRE_TORCH(python);
  test::GoldenStep g;
  g.model = "vgg11_bn_small";
  test::run_golden_step(python, g);
}

}  // namespace
}  // namespace kiln
