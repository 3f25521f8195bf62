// Mixup and cutmix through the compiled training step on the CPU executor (the mix_batch node
// in the transfer, the loss's label pair) and through the trainer: the step's input is the
// mixed batch, its loss torch's on the mixed target, a whole-image cutmix is the plain step on
// the rolled batch, the draws do not depend on the loader's workers and survive a resume, and
// Fashion-MNIST trains with both on.
#include "kiln/data/mixup.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/io/safetensors.h"
#include "kiln/task/engine.h"
#include "kiln/task/trainer.h"
#include "support/learnable_batch.h"
#include "support/metrics_csv.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

std::unique_ptr<Engine> compiled(const BluePrint& bp, int64_t batch, bool mix) {
  EngineOptions o;
  o.device = "cpu";
  o.compile.batch = batch;
  o.compile.mix = mix;
  o.switches.memory_reuse = false;  // the input and logits stay readable after the step
  auto e = std::make_unique<Engine>(bp, o);
  e->lock_memory();
  e->compile(5);
  return e;
}

std::vector<float> read(Engine& e, TensorId id) {
  const DTensor& t = e.program().tensor(id);
  std::vector<float> v(static_cast<size_t>(t.numel()));
  e.backend().read(t, v.data());
  return v;
}

// Sample s's partner is s - 1 (mod n): torchvision's roll(1).
size_t partner(size_t s, size_t n) {
  return (s + n - 1) % n;
}

// The step's input is the batch mixed as torchvision's RandomMixup (lambda x + (1 - lambda)
// x.roll(1), FP32: within 2 ulp of the double value) or RandomCutmix (the partner's pixels in
// the box, exactly), and its loss is CrossEntropyLoss on lambda onehot(y) + (1 - lambda)
// onehot(y.roll(1)) over the step's own logits (1e-5: FP32 logits, double sums).
TEST(Mixup, TheStepTrainsOnTheMixedBatchAndTargets) {
  const BluePrint bp = make_model("cnn");
  const int64_t n = 6, h = bp.input.height, w = bp.input.width, c = bp.input.channels,
                per = h * w * c;
  const test::LearnableBatch batch = test::learnable_batch(bp, n, 61);
  MixDraw mixup;
  mixup.kind = MixKind::mixup;
  mixup.lambda = 0.3;
  MixDraw cutmix;
  cutmix.kind = MixKind::cutmix;
  cutmix.y0 = 3, cutmix.y1 = 17, cutmix.x0 = 0, cutmix.x1 = 9;
  cutmix.lambda = 1.0 - 14.0 * 9.0 / static_cast<double>(h * w);
  for (const MixDraw& d : {mixup, cutmix}) {
    SCOPED_TRACE(d.kind == MixKind::mixup ? "mixup" : "cutmix");
    auto e = compiled(bp, n, true);
    e->set_mix(d);
    const StepStats s = e->train_step(batch.images.data(), batch.labels.data(), 0.0f);
    const std::vector<float> in = read(*e, e->program().io.input);
    const float lam = static_cast<float>(d.lambda), rest = static_cast<float>(1.0 - d.lambda);
    for (size_t sm = 0; sm < static_cast<size_t>(n); ++sm) {
      for (int64_t i = 0; i < per; ++i) {
        const float self = batch.images[sm * per + i];
        const float other = batch.images[partner(sm, n) * per + i];
        const int64_t row = i / (w * c), col = (i / c) % w;
        const float got = in[sm * per + i];
        if (d.kind == MixKind::mixup) {
          const double want = d.lambda * self + (1 - d.lambda) * other;
          ASSERT_NEAR(got, lam * self + rest * other, 2e-7 * (std::fabs(self) + std::fabs(other)));
          ASSERT_NEAR(got, want, 1e-6 * (std::fabs(self) + std::fabs(other)));
        } else {
          const bool boxed = row >= d.y0 && row < d.y1 && col >= d.x0 && col < d.x1;
          ASSERT_EQ(got, boxed ? other : self) << "sample " << sm << " pixel " << i;
        }
      }
    }
    const std::vector<float> z = read(*e, e->program().io.logits);
    const int64_t k = static_cast<int64_t>(z.size()) / n;
    double want = 0;
    for (size_t b = 0; b < static_cast<size_t>(n); ++b) {
      const float* r = z.data() + b * k;
      double mx = r[0], sum = 0;
      for (int64_t j = 1; j < k; ++j) mx = std::max(mx, static_cast<double>(r[j]));
      for (int64_t j = 0; j < k; ++j) sum += std::exp(r[j] - mx);
      auto ce = [&](int32_t y) { return mx + std::log(sum) - r[y]; };
      const double lambda = static_cast<float>(d.lambda);
      want += (lambda * ce(batch.labels[b]) + (1 - lambda) * ce(batch.labels[partner(b, n)])) / n;
    }
    EXPECT_NEAR(s.loss, want, 1e-5 * want);
  }
}

// A cutmix box over the whole image (lambda 0) is the plain step on the rolled batch: the
// input is each partner's image, the target each partner's label, so the weights after the
// step must equal, bit for bit. A step without set_mix() is unmixed.
TEST(Mixup, WholeImageCutmixIsThePlainStepOnTheRolledBatch) {
  const BluePrint bp = make_model("cnn");
  const int64_t n = 8, per = int64_t{bp.input.height} * bp.input.width * bp.input.channels;
  const test::LearnableBatch batch = test::learnable_batch(bp, n, 62);
  test::LearnableBatch rolled = batch;
  for (size_t s = 0; s < static_cast<size_t>(n); ++s) {
    const size_t p = partner(s, n);
    rolled.labels[s] = batch.labels[p];
    std::copy(batch.images.begin() + static_cast<int64_t>(p) * per,
              batch.images.begin() + static_cast<int64_t>(p + 1) * per,
              rolled.images.begin() + static_cast<int64_t>(s) * per);
  }
  auto mixed = compiled(bp, n, true);
  auto plain = compiled(bp, n, false);
  MixDraw whole;
  whole.kind = MixKind::cutmix;
  whole.lambda = 0.0;
  whole.y1 = bp.input.height, whole.x1 = bp.input.width;
  mixed->set_mix(whole);
  const StepStats a = mixed->train_step(batch.images.data(), batch.labels.data(), 0.05f);
  const StepStats b = plain->train_step(rolled.images.data(), rolled.labels.data(), 0.05f);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.top1, b.top1);
  // The next step has no set_mix(): unmixed, as the plain engine's on the same batch.
  const StepStats a2 = mixed->train_step(batch.images.data(), batch.labels.data(), 0.05f);
  const StepStats b2 = plain->train_step(batch.images.data(), batch.labels.data(), 0.05f);
  EXPECT_EQ(a2.loss, b2.loss);
  for (const ParamDesc& d : mixed->program().params) {
    EXPECT_EQ(mixed->read_param(d.name), plain->read_param(d.name)) << d.name;
  }
}

TEST(Mixup, SetMixIsCheckedAgainstTheProgram) {
  const BluePrint bp = make_model("mlp");
  auto plain = compiled(bp, 4, false);
  MixDraw d;
  d.kind = MixKind::mixup;
  d.lambda = 0.5;
  EXPECT_THROW(plain->set_mix(d), Error);
  auto mixed = compiled(bp, 4, true);
  MixDraw outside;
  outside.kind = MixKind::cutmix;
  outside.lambda = 0.5;
  outside.y1 = bp.input.height + 1;
  EXPECT_THROW(mixed->set_mix(outside), Error);
}

TrainConfig small_run(const std::string& out, int epochs, int workers) {
  TrainConfig c;
  c.model = "cnn";
  c.data = "synthetic";
  c.synthetic_size = 96;
  c.batch_size = 16;
  c.epochs = epochs;
  c.lr.kind = "cosine";
  c.lr.base_lr = 0.05f;
  c.workers = workers;
  c.device = "cpu";
  c.progress = "none";
  c.output = out;
  c.mix.mixup_alpha = 0.2;
  c.mix.cutmix_alpha = 1.0;
  return c;
}

std::string fresh_dir(const std::string& name) {
  const std::string d = testing::TempDir() + "/kiln_mixup_" + name;
  fs::remove_all(d);
  return d;
}

void expect_same_weights(const std::string& a_dir, const std::string& b_dir, bool same) {
  const StFile a = read_safetensors(a_dir + "/last.safetensors");
  const StFile b = read_safetensors(b_dir + "/last.safetensors");
  bool all_equal = a.tensors.size() == b.tensors.size();
  for (const auto& [name, t] : a.tensors) {
    const bool eq = b.tensors.count(name) && t.data == b.tensors.at(name).data;
    if (same) EXPECT_TRUE(eq) << name << " differs";
    all_equal = all_equal && eq;
  }
  if (!same) EXPECT_FALSE(all_equal) << "mixing changed nothing";
}

// The draws follow (seed, epoch, step) only: one loader worker or three train the same
// weights, bit for bit; without mixing the weights differ (the mix is really applied).
TEST(Mixup, SameSeedSameRunForAnyWorkerCount) {
  const std::string one = fresh_dir("w1"), three = fresh_dir("w3"), off = fresh_dir("off");
  train(small_run(one, 2, 1));
  train(small_run(three, 2, 3));
  expect_same_weights(one, three, true);
  TrainConfig plain = small_run(off, 2, 1);
  plain.mix = MixOptions{};
  train(plain);
  expect_same_weights(one, off, false);
}

// S25 with mixing: stop after 1 of 2 epochs, resume, and the weights equal the straight run's.
TEST(Mixup, ResumeEqualsAnUninterruptedRun) {
  const std::string straight = fresh_dir("straight"), split = fresh_dir("split");
  train(small_run(straight, 2, 2));
  TrainConfig first = small_run(split, 2, 2);
  first.stop_after_epochs = 1;
  train(first);
  TrainConfig resumed = small_run(split, 2, 2);
  resumed.resume = split + "/last.safetensors";
  train(resumed);
  expect_same_weights(straight, split, true);
}

// Real data with torchvision's recipe values (mixup 0.2, cutmix 1.0, RandomChoice 0.5) and
// label smoothing 0.1: two epochs of 40 steps of the default CNN. The mixed training loss
// falls from the first epoch to the second and the (unmixed) test top-1 is above chance (10%
// of 10,000 images: 15% is far outside its noise). Cutmix's pasted boxes slow the first steps
// much more than mixup's blend, so this short run stays well below the plain run's accuracy.
TEST(Mixup, FashionMnistTrainsWithMixupAndCutmix) {
  if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP()
        << "Fashion-MNIST is not installed (scripts/setup.sh installs dataset-fashion-mnist)";
  }
  const std::string out = fresh_dir("fmnist");
  TrainConfig c;
  c.model = "cnn";
  c.data = "fashion-mnist";
  c.epochs = 2;
  c.batch_size = 64;
  c.max_steps_per_epoch = 40;
  c.lr.kind = "onecycle";
  c.lr.base_lr = 0.1f;
  c.device = "cpu";
  c.progress = "none";
  c.output = out;
  c.label_smoothing = 0.1f;
  c.mix.mixup_alpha = 0.2;
  c.mix.cutmix_alpha = 1.0;
  const TrainSummary s = train(c);
  const auto r = test::metrics_rows(out + "/metrics.csv");
  ASSERT_EQ(r.size(), 2u);
  const double loss1 = std::stod(r[0].at("train_loss")), loss2 = std::stod(r[1].at("train_loss"));
  EXPECT_TRUE(std::isfinite(loss1) && std::isfinite(loss2));
  EXPECT_LT(loss2, loss1) << "the mixed training loss does not fall";
  EXPECT_GT(s.final_top1, 15.0) << "after 80 mixed steps; chance is 10%";
  const double train_top1 = std::stod(r[1].at("train_top1"));  // against the dominant labels
  EXPECT_TRUE(train_top1 >= 0 && train_top1 <= 100) << train_top1;
}

}  // namespace
}  // namespace kiln
