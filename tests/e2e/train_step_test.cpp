// Whole training steps on the CPU executor: the loss falls on a fixed learnable batch, the
// lifecycle refuses steps out of order, evaluation ignores padding, and every optimisation
// switch (memory reuse, fusion) gives the same numbers off and on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/core/rng.h"
#include "kiln/graph/op.h"
#include "kiln/task/engine.h"
#include "support/async_stats_check.h"
#include "support/engine_state.h"
#include "support/learnable_batch.h"

namespace kiln {
namespace {

using Batch = test::LearnableBatch;
using test::folded_grad_sum_count;
using test::fused_node_count;
using test::learnable_batch;
using test::params_and_buffers;
using test::pooled_cbr_count;
using test::pooled_picks_count;

EngineOptions cpu_options(int64_t batch) {
  EngineOptions o;
  o.device = "cpu";
  o.compile.batch = batch;
  o.compile.momentum = 0.9f;
  o.compile.weight_decay = 5e-4f;
  return o;
}

void loss_falls(const std::string& model, int64_t batch, float lr) {
  const BluePrint bp = make_model(model);
  Engine e(bp, cpu_options(batch));
  e.lock_memory();
  e.compile(3);
  const Batch b = learnable_batch(bp, batch, 11);
  std::vector<float> losses;
  for (int step = 0; step < 20; ++step) {
    const StepStats s = e.train_step(b.images.data(), b.labels.data(), lr);
    ASSERT_TRUE(std::isfinite(s.loss)) << model << " step " << step;
    losses.push_back(s.loss);
  }
  // From about ln(10) = 2.3 at the start; a network that learns the batch ends far lower.
  EXPECT_GT(losses.front(), 1.5f) << model;
  EXPECT_LT(losses.back(), 0.25f * losses.front())
      << model << ": loss " << losses.front() << " -> " << losses.back();
  const StepStats ev = e.eval_batch(b.images.data(), b.labels.data(), batch);
  // Evaluation uses the running statistics, which after 20 steps at momentum 0.1 hold only
  // 1 - 0.9^20 = 88% of the batch statistics: well above chance (1/10), not yet perfect.
  EXPECT_GE(ev.top1, batch / 4) << model
                                << ": eval mode should be well above chance on the trained batch";
}

TEST(TrainStep, LossFallsResNet18Small) {
  loss_falls("resnet18_small", 10, 0.02f);
}
TEST(TrainStep, LossFallsVgg11BnSmall) {
  loss_falls("vgg11_bn_small", 10, 0.02f);
}
TEST(TrainStep, LossFallsCnn) {
  loss_falls("cnn", 20, 0.05f);
}
TEST(TrainStep, LossFallsMlp) {
  loss_falls("mlp", 20, 0.05f);
}

TEST(Lifecycle, StepsOutOfOrderAreClearErrors) {
  Engine e(make_model("cnn"), cpu_options(4));
  EXPECT_EQ(e.state(), Lifecycle::PLANNING);
  std::vector<float> img(4 * 28 * 28);
  std::vector<int32_t> lab(4);
  try {
    e.train_step(img.data(), lab.data(), 0.1f);
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::State);
    EXPECT_NE(std::string(err.what()).find("lock_memory()"), std::string::npos) << err.what();
  }
  EXPECT_THROW(e.compile(), Error);
  EXPECT_THROW(e.program(), Error);
  e.lock_memory();
  EXPECT_EQ(e.state(), Lifecycle::MEMORY_LOCKED);
  EXPECT_THROW(e.lock_memory(), Error);
  e.compile();
  EXPECT_EQ(e.state(), Lifecycle::COMPILED);
  EXPECT_THROW(e.compile(), Error);
  EXPECT_NO_THROW(e.train_step(img.data(), lab.data(), 0.1f));
}

TEST(Lifecycle, AmpOnTheCpuIsRefused) {
  EngineOptions o = cpu_options(4);
  o.compile.amp = true;
  try {
    Engine e(make_model("cnn"), o);
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::Unsupported);
  }
}

// A batch in CUDA memory (InputView::device) on the CPU backend: one Unsupported error that
// names the fix, before anything runs; and an InputView that sets two forms is refused.
TEST(Lifecycle, DeviceBatchOnTheCpuIsOneClearError) {
  Engine e(make_model("cnn"), cpu_options(4));
  e.lock_memory();
  e.compile(1);
  std::vector<int32_t> lab(4);
  DeviceBatch d;
  d.images = reinterpret_cast<const void*>(uintptr_t{0x1000});  // never read
  d.labels = lab.data();
  InputView in;
  in.device = &d;
  for (const bool eval : {false, true}) {
    try {
      if (eval)
        e.eval_batch(in, 4);
      else
        e.train_step_async(in, 0.1f);
      FAIL() << "a device batch was accepted by the CPU backend";
    } catch (const Error& err) {
      EXPECT_EQ(err.kind(), ErrorKind::Unsupported);
      EXPECT_NE(std::string(err.what()).find("cpu backend reads host memory only"),
                std::string::npos)
          << err.what();
      EXPECT_NE(std::string(err.what()).find("pass a CPU tensor"), std::string::npos) << err.what();
    }
  }
  EXPECT_EQ(e.steps_done(), 0);
  std::vector<float> img(4 * 28 * 28);
  in.f32 = img.data();
  EXPECT_THROW(e.train_step_async(in, 0.1f), Error);
}

TEST(Eval, PaddingOfAPartialBatchIsNotCounted) {
  const BluePrint bp = make_model("cnn");
  Engine e(bp, cpu_options(8));
  e.lock_memory();
  e.compile(1);
  const Batch b = learnable_batch(bp, 8, 5);
  const StepStats full = e.eval_batch(b.images.data(), b.labels.data(), 8);
  EXPECT_LE(full.top1, 8);
  EXPECT_EQ(full.top5 >= full.top1, true);
  // The first 3 samples alone: hits can only come from them, and the loss is their mean.
  const StepStats part = e.eval_batch(b.images.data(), b.labels.data(), 3);
  EXPECT_LE(part.top1, 3);
  EXPECT_LE(part.top5, 3);
  EXPECT_TRUE(std::isfinite(part.loss));
}

// The same two steps with memory reuse off and on give bit-identical weights: reuse changes
// where tensors live, never what is computed.
TEST(Switches, MemoryReuseOffAndOnAgree) {
  const BluePrint bp = make_model("resnet18_small");
  const Batch b = learnable_batch(bp, 4, 9);
  std::vector<std::vector<float>> results;
  for (bool reuse : {false, true}) {
    EngineOptions o = cpu_options(4);
    o.compile.memory_reuse = reuse;
    Engine e(bp, o);
    e.lock_memory();
    e.compile(5);
    for (int i = 0; i < 2; ++i) e.train_step(b.images.data(), b.labels.data(), 0.05f);
    results.push_back(e.read_param("layer1.0.conv1.weight"));
    std::vector<float> fc = e.read_param("fc.weight");
    results.back().insert(results.back().end(), fc.begin(), fc.end());
  }
  EXPECT_EQ(results[0], results[1]);
}

// Compiles (seed 5), trains three steps on the batch and evaluates it once: every parameter
// and buffer by name (fusion reorders declarations), the losses ("loss") and the evaluation's
// loss, top-1 and top-5 ("eval"). `inspect` sees the compiled engine first.
template <typename Inspect>
std::map<std::string, std::vector<float>> three_steps_then_eval(const BluePrint& bp, const Batch& b,
                                                                const EngineOptions& o,
                                                                Inspect inspect) {
  Engine e(bp, o);
  e.lock_memory();
  e.compile(5);
  inspect(e);
  std::vector<float> losses;
  for (int i = 0; i < 3; ++i)
    losses.push_back(e.train_step(b.images.data(), b.labels.data(), 0.05f).loss);
  std::map<std::string, std::vector<float>> r = params_and_buffers(e);
  r["loss"] = losses;
  // A fused program evaluates its fused nodes in their inference form (bn_relu_infer).
  const StepStats ev = e.eval_batch(b.images.data(), b.labels.data(), b.labels.size());
  r["eval"] = {ev.loss, static_cast<float>(ev.top1), static_cast<float>(ev.top5)};
  return r;
}

// Fusion on and off (issue 5's passes, the CPU's fused kernels in FP32, opted into with
// Switches::fuse_fp32): the programs differ
// - CBR and BN+add+ReLU nodes, a bit mask instead of the ReLU output, no BN-output map - and
// three steps give the same losses, every weight and BN running statistic bit for bit, since
// the fused kernels are compositions of the unfused ones. VGG's convolutions carry biases,
// which the fused CBR folds away (ops.def: BN's statistics are taken without the bias, which
// moves only the running mean, and its gradient is exactly 0 where the unfused chain sums
// rounding noise), so there the two agree to rounding: within 1e-5 of each tensor's scale.
// An evaluation batch after the steps (the fused nodes' inference form, bn_relu_infer, against
// the unfused chain) gives the same loss and hits likewise. Also checks the plan did fuse.
TEST(Switches, FusionOffAndOnAgree) {
  for (const std::string model : {"resnet18_small", "vgg11_bn_small", "cnn"}) {
    const bool exact = model != "vgg11_bn_small";
    const BluePrint bp = make_model(model);
    const Batch b = learnable_batch(bp, 4, 9);
    // By name: fusion changes the order in which BN parameters and buffers are declared.
    std::vector<std::map<std::string, std::vector<float>>> results(2);
    std::vector<int> fused_nodes;
    for (bool fusion : {false, true}) {
      EngineOptions o = cpu_options(4);
      o.switches.fusion = fusion;
      o.switches.fuse_fp32 = Auto::on;
      results[fusion ? 1 : 0] = three_steps_then_eval(
          bp, b, o, [&](const Engine& e) { fused_nodes.push_back(fused_node_count(e)); });
    }
    EXPECT_EQ(fused_nodes[0], 0) << model;
    EXPECT_GT(fused_nodes[1], 0) << model << ": the CPU backend fuses in FP32";
    ASSERT_EQ(results[0].size(), results[1].size()) << model;
    for (const auto& [name, want] : results[0]) {
      ASSERT_TRUE(results[1].count(name)) << model << ": " << name;
      const std::vector<float>& got = results[1].at(name);
      ASSERT_EQ(got.size(), want.size()) << name;
      if (exact) {
        size_t differ = 0;
        for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
        EXPECT_EQ(differ, 0u) << model << ": " << name << ": " << differ << " of " << got.size()
                              << " values differ";
      } else if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0 &&
                 std::all_of(want.begin(), want.end(),
                             [](float v) { return std::fabs(v) <= 1e-6f; })) {
        // A convolution bias in front of BN (zero-initialised): its gradient is rounding noise
        // (exactly 0 in the fused CBR), so both runs hold noise-sized values, compared absolutely.
        for (float v : got)
          EXPECT_LE(std::fabs(v), 1e-6f) << model << ": " << name << " (a bias BN cancels)";
      } else {
        double scale = 0.0, worst = 0.0;
        for (float v : want) scale = std::max(scale, std::fabs(static_cast<double>(v)));
        for (size_t i = 0; i < got.size(); ++i)
          worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
        EXPECT_LE(worst, 1e-5 * std::max(scale, 1e-30))
            << model << ": " << name << " (scale " << scale << ")";
      }
    }
  }
}

// Switches::fuse_fp32 (KILN_FUSE_FP32) on asks for fusion in FP32 (the switch the GPU A/B of
// FP32 fusion uses); off, or left to the CPU backend (auto), an FP32 program is not fused.
TEST(Switches, FuseFp32Switch) {
  const BluePrint bp = make_model("cnn");
  for (const Auto fuse : {Auto::off, Auto::automatic, Auto::on}) {
    EngineOptions o = cpu_options(4);
    o.switches.fuse_fp32 = fuse;
    Engine e(bp, o);
    e.lock_memory();
    if (fuse == Auto::on) {
      EXPECT_EQ(fused_node_count(e), 8) << "the cnn's four Conv+BN+ReLU, forward and backward";
    } else {
      EXPECT_EQ(fused_node_count(e), 0);
    }
  }
}

// The gradient-sum fusion (bn_add_relu_bwd's dy2, KILN_FUSE_GRAD_SUM) off and on, fusion on:
// the folded program has no add node before 7 of resnet18_small's 8 BN+add+ReLU backwards,
// and three steps give the same losses, weights, running statistics and evaluation bit for
// bit (the folded pass sums dy + dy2 as the add node did).
TEST(Switches, GradientSumFoldingOffAndOnAgree) {
  const BluePrint bp = make_model("resnet18_small");
  const Batch b = learnable_batch(bp, 4, 9);
  std::vector<std::map<std::string, std::vector<float>>> results(2);
  std::vector<int> folded;
  for (const bool fold : {false, true}) {
    EngineOptions o = cpu_options(4);
    o.switches.fuse_grad_sum = fold;
    o.switches.fuse_fp32 = Auto::on;
    results[fold ? 1 : 0] = three_steps_then_eval(
        bp, b, o, [&](const Engine& e) { folded.push_back(folded_grad_sum_count(e)); });
  }
  EXPECT_EQ(folded[0], 0);
  EXPECT_EQ(folded[1], 7);
  EXPECT_EQ(results[0], results[1]);
}

// A pool switch off and on, fusion on in FP32: three steps and an evaluation of the cnn (two
// 2x2 pools) and vgg11_bn_small (five), `count` nodes it touches (none off, a forward and a
// backward a pool on), and the same losses, weights and running statistics bit for bit.
template <typename Set, typename Count>
void pool_switch_agrees(Set set, Count count) {
  for (const auto& [model, pools] :
       {std::pair{std::string("cnn"), 2}, std::pair{std::string("vgg11_bn_small"), 5}}) {
    const BluePrint bp = make_model(model);
    const Batch b = learnable_batch(bp, 4, 9);
    std::vector<std::map<std::string, std::vector<float>>> results(2);
    std::vector<int> counts;
    for (const bool on : {false, true}) {
      EngineOptions o = cpu_options(4);
      set(o.switches, on);
      o.switches.fuse_fp32 = Auto::on;
      results[on ? 1 : 0] =
          three_steps_then_eval(bp, b, o, [&](const Engine& e) { counts.push_back(count(e)); });
    }
    EXPECT_EQ(counts[0], 0) << model;
    EXPECT_EQ(counts[1], 2 * pools) << model;
    EXPECT_EQ(results[0], results[1]) << model;
  }
}

// The max-pool folded into CBR (cbr_pool_*, KILN_FUSE_POOL): the folded kernels are the
// unfused pool's and ReLU's arithmetic.
TEST(Switches, PoolFoldingOffAndOnAgree) {
  pool_switch_agrees([](Switches& sw, bool on) { sw.fuse_pool = on; }, pooled_cbr_count);
}

// The pooled picks (KILN_POOL_POOLED_SUMS) with the pools folded: the pooled CBRs write zp and
// mp and their backwards read them; the CPU checks them and takes its sums from dz, so nothing
// else changes.
TEST(Switches, PoolPooledSumsOffAndOnAgree) {
  pool_switch_agrees([](Switches& sw, bool on) { sw.pool_pooled_sums = on; }, pooled_picks_count);
}

// ResNet's stem - a 7x7 / 2 CBR, then a 3x3 / 2 max-pool with padding 1, whose windows overlap -
// folded into the CBR (KILN_FUSE_OVERLAPPING_POOL, the byte-per-pooled-element mask of ops.def)
// and kept apart: on odd and even maps (17x17 and 32x32 inputs: 9x9 and 16x16 before the pool,
// whose windows cover 1, 2 or 4 elements' gradients and clip at the edges), three steps and an
// evaluation give the same losses, weights and running statistics bit for bit, and only the
// folded program has the pooled CBR nodes (forward and backward).
TEST(Switches, OverlappingPoolFoldingOffAndOnAgree) {
  for (const int size : {17, 32}) {
    const Layer main = seq(conv(16, 3, 1, 1), bn2d(), relu(), conv(16, 3, 1, 1), bn2d());
    const BluePrint bp{
        "stem",
        {size, size, 3},
        5,
        seq(conv(16, 7, 2, 3).named("conv1"), bn2d(), relu(), maxpool(3, 2, 1).named("maxpool"),
            residual(main), relu(), gap(), fc(5))};
    const Batch b = learnable_batch(bp, 4, 9);
    std::vector<std::map<std::string, std::vector<float>>> results(2);
    std::vector<int> pooled;
    for (const bool fold : {false, true}) {
      EngineOptions o = cpu_options(4);
      o.switches.fuse_overlapping_pool = fold;
      o.switches.fuse_fp32 = Auto::on;
      results[fold ? 1 : 0] = three_steps_then_eval(
          bp, b, o, [&](const Engine& e) { pooled.push_back(pooled_cbr_count(e)); });
    }
    EXPECT_EQ(pooled[0], 0) << size;
    EXPECT_EQ(pooled[1], 2) << size;
    EXPECT_EQ(results[0], results[1]) << size;
  }
}

// A downsampling block's shortcut BatchNorm folded into the block's BN+add+ReLU
// (KILN_FUSE_RESIDUAL_BN: applied on the fly, its output never written) and kept apart: in
// ResNet-18 (small) and ResNet-50 (small) three steps and an evaluation give the same losses,
// weights and running statistics bit for bit, and only the folded program's BN+add+ReLU
// forwards take the shortcut's BatchNorm (three and four downsampling blocks).
TEST(Switches, ResidualBnFoldingOffAndOnAgree) {
  for (const auto& [model, blocks] :
       {std::pair{std::string("resnet18_small"), 3}, std::pair{std::string("resnet50_small"), 4}}) {
    const BluePrint bp = make_model(model);
    const Batch b = learnable_batch(bp, 2, 9);
    std::vector<std::map<std::string, std::vector<float>>> results(2);
    std::vector<int> folded;
    for (const bool fold : {false, true}) {
      EngineOptions o = cpu_options(2);
      o.switches.fuse_residual_bn = fold;
      o.switches.fuse_fp32 = Auto::on;
      results[fold ? 1 : 0] = three_steps_then_eval(bp, b, o, [&](const Engine& e) {
        int n = 0;
        for (const Phase& ph : e.program().train) {
          for (const Node& node : ph.nodes)
            n += node.op == OpKind::bn_add_relu_fwd && node.in.size() > 6;
        }
        folded.push_back(n);
      });
    }
    EXPECT_EQ(folded[0], 0) << model;
    EXPECT_EQ(folded[1], blocks) << model;
    EXPECT_EQ(results[0], results[1]) << model;
  }
}

// The trainer's late statistics (Engine::train_step_async, Backend::read_later): the same
// numbers one step late, the same weights (tests/support/async_stats_check.h).
TEST(Engine, AsyncStatsEqualSyncOneStepLate) {
  test::async_stats_equal_sync("cnn", cpu_options(8), 4);
  Engine e(make_model("cnn"), cpu_options(8));
  e.lock_memory();
  e.compile(1);
  test::late_read_misuse_is_an_error(e);
}

// train_step_on_staged (kiln bench --stage once): steps on the batches already staged in
// slots A and B give the bits that staging the same batches again gives; before a slot holds a
// training batch (or after evaluation took slot A) it is a clear State error.
TEST(Engine, StepOnTheStagedBatchEqualsStagingItAgain) {
  const BluePrint bp = make_model("cnn");
  const Batch b = learnable_batch(bp, 8, 4);
  std::vector<std::vector<float>> w;
  for (const bool reuse : {false, true}) {
    Engine e(bp, cpu_options(8));
    e.lock_memory();
    e.compile(3);
    if (reuse) EXPECT_THROW(e.train_step_on_staged(0.05f), Error);
    for (int i = 0; i < 5; ++i) {
      if (reuse && i >= 2) {
        e.train_step_on_staged(0.05f);
      } else {
        e.train_step(b.images.data(), b.labels.data(), 0.05f);
      }
    }
    w.push_back(e.read_param("block1.conv.weight"));
    if (reuse) {
      e.eval_batch(b.images.data(), b.labels.data(), 8);
      e.train_step_on_staged(0.05f);  // slot B (step 6)
      try {
        e.train_step_on_staged(0.05f);  // slot A: evaluation took it
        ADD_FAILURE() << "a step on slot A after evaluation";
      } catch (const Error& err) {
        EXPECT_EQ(err.kind(), ErrorKind::State);
      }
    }
  }
  EXPECT_EQ(w[0], w[1]);
}

TEST(Engine, DeterministicForAFixedSeed) {
  const BluePrint bp = make_model("cnn");
  const Batch b = learnable_batch(bp, 8, 4);
  std::vector<std::vector<float>> w;
  for (int run = 0; run < 2; ++run) {
    Engine e(bp, cpu_options(8));
    e.lock_memory();
    e.compile(42);
    for (int i = 0; i < 3; ++i) e.train_step(b.images.data(), b.labels.data(), 0.05f);
    w.push_back(e.read_param("block1.conv.weight"));
  }
  EXPECT_EQ(w[0], w[1]);
}

}  // namespace
}  // namespace kiln
