// SiLU and hardswish inside a whole compiled step on the CPU: every parameter's gradient equals
// the central finite difference of the evaluated loss, so the lowering feeds each backward the
// forward's input (the op sweep checks the kernels alone).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kiln/blueprint/blueprint.h"
#include "kiln/core/rng.h"
#include "kiln/task/engine.h"

namespace kiln {
namespace {

TEST(ActivationGrad, SiluAndHardswishGradientsMatchFiniteDifferences) {
  const BluePrint bp{"act",
                     {6, 6, 2},
                     3,
                     seq(conv(4, 3, 1, 1, /*bias=*/true), silu(), conv(4, 3, 1, 1, /*bias=*/true),
                         hardswish(), flatten(), fc(3))};
  EngineOptions o;
  o.device = "cpu";
  o.compile.batch = 4;
  o.compile.momentum = 0.0f;
  o.compile.weight_decay = 0.0f;
  Engine e(bp, o);
  e.lock_memory();
  e.compile(3);

  Rng rng(11);
  std::vector<float> images(4 * 6 * 6 * 2);
  for (float& x : images) x = static_cast<float>(2.0 * rng.normal());  // past hardswish's kinks
  const std::vector<int32_t> labels{0, 2, 1, 2};
  e.train_step(images.data(), labels.data(), /*lr=*/0.0f);  // gradients; the weights stay

  auto loss = [&] {
    return static_cast<double>(e.eval_batch(images.data(), labels.data(), 4).loss);
  };
  int checked = 0;
  for (const ParamDesc& d : e.program().params) {
    const std::vector<float> grad = e.read_param(d.name, Region::grads_f32);
    std::vector<float> w = e.read_param(d.name);
    const size_t stride = std::max<size_t>(1, w.size() / 5);
    for (size_t i = 0; i < w.size(); i += stride) {
      // FP32 losses of ~1 change by ~1e-4 over 2 eps: the difference is good to ~1e-3 of it.
      const float eps = 1e-2f, w0 = w[i];
      w[i] = w0 + eps;
      e.write_param(d.name, w);
      const double up = loss();
      w[i] = w0 - eps;
      e.write_param(d.name, w);
      const double down = loss();
      w[i] = w0;
      e.write_param(d.name, w);
      const double fd = (up - down) / (2.0 * eps);
      EXPECT_NEAR(grad[i], fd, 2e-3 + 2e-2 * std::fabs(fd)) << d.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GE(checked, 24);  // six parameters, about five elements each
}

}  // namespace
}  // namespace kiln
