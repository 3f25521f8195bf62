// Recipe options of the training step on the CPU executor, through the compiled program:
// AdamW's bias correction counts only the steps it applied (a skipped step, as GradScaler's,
// leaves it), also across a checkpoint; --clip-grad-norm bounds the step's norm and is the
// unclipped step when the cap is above the norm; label smoothing changes the loss as
// torch's CrossEntropyLoss(label_smoothing) does.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kiln/blueprint/zoo.h"
#include "kiln/io/safetensors.h"
#include "kiln/task/checkpoint.h"
#include "kiln/task/engine.h"
#include "support/learnable_batch.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using Params = std::map<std::string, std::vector<float>>;

EngineOptions cpu_options(int64_t batch) {
  EngineOptions o;
  o.device = "cpu";
  o.compile.batch = batch;
  return o;
}

std::unique_ptr<Engine> compiled(const BluePrint& bp, const EngineOptions& o) {
  auto e = std::make_unique<Engine>(bp, o);
  e->lock_memory();
  e->compile(5);
  return e;
}

Params params(Engine& e) {
  Params r;
  for (const ParamDesc& d : e.program().params) r[d.name] = e.read_param(d.name);
  return r;
}

// A step whose gradients are not finite is skipped on the device (the CPU has no AMP, but
// --clip-grad's check flags NaN gradients as an AMP overflow does). Engine A takes such a
// step, then a good one; engine B, from the same weights, only the good one. PyTorch's
// GradScaler skips optimizer.step() on overflow, so AdamW's state['step'] is 1 at A's good
// step as at B's: the two must agree to the bit. Counting the skipped step (t = 2) moves
// A's first-moment correction by (1 - 0.9) / (1 - 0.9^2) - 1 = -47%, far from equal.
TEST(RecipeAdamw, SkippedStepDoesNotAdvanceTheBiasCorrection) {
  const BluePrint bp = make_model("mlp");
  EngineOptions o = cpu_options(8);
  o.compile.optimizer = "adamw";
  o.compile.weight_decay = 0.05f;
  o.compile.clip_grad = 1e30f;  // the finite check, without clipping anything
  const test::LearnableBatch good = test::learnable_batch(bp, 8, 21);
  std::vector<float> bad = good.images;
  for (float& x : bad) x = std::numeric_limits<float>::quiet_NaN();

  auto a = compiled(bp, o);
  const Params start = params(*a);
  const StepStats skipped = a->train_step(bad.data(), good.labels.data(), 1e-3f);
  ASSERT_TRUE(skipped.overflow) << "NaN gradients must skip the step";
  EXPECT_EQ(params(*a), start) << "a skipped step changes no weight";
  const std::string ck = testing::TempDir() + "/kiln_recipe_adamw_skip.safetensors";
  TrainState st;
  st.step = 1;
  save_checkpoint(*a, ck, st);
  const StFile f = read_safetensors(ck);
  ASSERT_TRUE(f.tensors.count("kiln.optimizer_steps"));
  int32_t applied = -1;
  std::memcpy(&applied, f.tensors.at("kiln.optimizer_steps").data.data(), sizeof(applied));
  EXPECT_EQ(applied, 0) << "one step taken, none applied";

  a->train_step(good.images.data(), good.labels.data(), 1e-3f);
  auto b = compiled(bp, o);
  b->train_step(good.images.data(), good.labels.data(), 1e-3f);
  const Params pa = params(*a), pb = params(*b);
  EXPECT_EQ(pa, pb) << "the good step after a skipped one is AdamW's first (t = 1)";
  EXPECT_NE(pb, start);

  // The count travels with the checkpoint: resumed after the skipped step, the good step is
  // still t = 1.
  auto c = compiled(bp, o);
  load_checkpoint(*c, ck);
  c->train_step(good.images.data(), good.labels.data(), 1e-3f);
  EXPECT_EQ(params(*c), pb);
  fs::remove(ck);
}

// --clip-grad-norm through the program (grad_norm in check_scale, its factor in the SGD
// pass). With momentum and weight decay off, the step is -lr * coef * g, so:
//  - a cap above the gradient's norm leaves the step the unclipped one, bit for bit;
//  - a cap below it makes the whole step's L2 norm lr * cap (torch.nn.utils.clip_grad_norm_);
//    FP32 updates of weights ~0.1 round at ~1e-8 each, against a step norm of 1e-3: 1e-3
//    relative is far above the rounding and far below any other outcome.
TEST(RecipeClipGradNorm, BoundsTheStepNormAndIsOffAboveTheNorm) {
  const BluePrint bp = make_model("mlp");
  const test::LearnableBatch batch = test::learnable_batch(bp, 16, 31);
  auto run = [&](float cap) {
    EngineOptions o = cpu_options(16);
    o.compile.momentum = 0.0f;
    o.compile.nesterov = false;
    o.compile.clip_grad_norm = cap;
    auto e = compiled(bp, o);
    const Params before = params(*e);
    e->train_step(batch.images.data(), batch.labels.data(), 0.1f);
    const Params after = params(*e);
    double moved = 0;
    for (const auto& [name, w] : after) {
      for (size_t i = 0; i < w.size(); ++i) {
        const double d = static_cast<double>(w[i]) - before.at(name)[i];
        moved += d * d;
      }
    }
    return std::make_pair(after, std::sqrt(moved));
  };
  const auto [plain_w, plain_norm] = run(0.0f);
  const double grad_norm = plain_norm / 0.1;
  ASSERT_GT(grad_norm, 0.1) << "the test needs a gradient norm to clip";
  const auto [above_w, above_norm] = run(static_cast<float>(grad_norm * 10));
  EXPECT_EQ(above_w, plain_w) << "a cap above the norm changes nothing";
  const float cap = static_cast<float>(grad_norm / 4);
  const auto [clipped_w, clipped_norm] = run(cap);
  EXPECT_NEAR(clipped_norm, 0.1 * cap, 1e-3 * 0.1 * cap);
}

// Label smoothing in the compiled loss: the program's loss on a batch against torch's
// formula from the program's own logits (the forward does not depend on e). One float64
// reference per row: -(1 - e) logp[y] - (e / K) sum logp; 1e-5 relative (FP32 logits).
TEST(RecipeLabelSmoothing, TheStepsLossIsTorchsSmoothedLoss) {
  const BluePrint bp = make_model("mlp");
  const test::LearnableBatch batch = test::learnable_batch(bp, 8, 41);
  EngineOptions o = cpu_options(8);
  o.compile.label_smoothing = 0.1f;
  o.switches.memory_reuse = false;  // the logits stay readable after the backward
  auto e = compiled(bp, o);
  const StepStats s = e->train_step(batch.images.data(), batch.labels.data(), 0.0f);
  const DTensor& lt = e->program().tensor(e->program().io.logits);
  std::vector<float> z(static_cast<size_t>(lt.numel()));
  e->backend().read(lt, z.data());
  const int64_t k = lt.shape[1];
  double want = 0;
  for (int64_t b = 0; b < 8; ++b) {
    const float* row = z.data() + b * k;
    double mx = row[0], sum = 0, logp_sum = 0;
    for (int64_t j = 1; j < k; ++j) mx = std::max(mx, static_cast<double>(row[j]));
    for (int64_t j = 0; j < k; ++j) sum += std::exp(row[j] - mx);
    for (int64_t j = 0; j < k; ++j) logp_sum += row[j] - mx - std::log(sum);
    const double logp_y = row[batch.labels[static_cast<size_t>(b)]] - mx - std::log(sum);
    want += (-(0.9 * logp_y) - 0.1 / static_cast<double>(k) * logp_sum) / 8.0;
  }
  EXPECT_NEAR(s.loss, want, 1e-5 * want);
}

}  // namespace
}  // namespace kiln
