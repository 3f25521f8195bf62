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
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
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
    EXPECT_LT(scaled_error(grad, floats(g.tensors.at("grad." + d.name))), 1e-4) << "gradient of " << d.name;
    const std::vector<float> after = to_torch_layout(d, e.read_param(d.name));
    // The update is lr * (g + wd*w) with Nesterov: weights change by ~1e-2 of their scale,
    // so a 1e-4 gradient error moves them by ~1e-6 of theirs.
    EXPECT_LT(scaled_error(after, floats(g.tensors.at("after." + d.name))), 1e-5) << "weights of " << d.name;
  }
  for (const BufferDesc& b : p.buffers) {
    // Running statistics after one step: momentum 0.1 of the batch mean / unbiased variance.
    EXPECT_LT(scaled_error(e.read_param(b.name), floats(g.tensors.at("after." + b.name))), 1e-5) << b.name;
  }
}

}  // namespace
}  // namespace kiln
