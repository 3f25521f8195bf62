// The EMA model's own BatchNorm statistics on the CPU (issue 18): they follow the EMA
// recurrence over the live statistics, evaluation of the EMA uses them, checkpoints keep them
// (older checkpoints without them still load), and kiln eval --ema / export --ema use them.
// The CUDA counterpart of the recurrence is gpu/gpu_ema_bn_test.cpp.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "kiln/blueprint/zoo.h"
#include "kiln/io/safetensors.h"
#include "kiln/task/checkpoint.h"
#include "kiln/task/trainer.h"
#include "support/cli_run.h"
#include "support/ema_bn_check.h"
#include "support/learnable_batch.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

std::string fresh_dir(const std::string& name) {
  const std::string d = testing::TempDir() + "/kiln_ema_bn_" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

EngineOptions cpu_options(bool ema, float decay = 0.5f) {
  EngineOptions o;
  o.device = "cpu";
  o.compile.batch = 8;
  o.compile.ema = ema;
  o.compile.ema_decay = decay;
  return o;
}

// An engine with EMA on after `steps` steps on changing batches: its EMA statistics differ
// from the live ones (decay 0.5 keeps them apart by a few steps' movement).
std::unique_ptr<Engine> trained(int steps) {
  auto e = std::make_unique<Engine>(make_model("cnn"), cpu_options(true));
  e->lock_memory();
  e->compile(7);
  const BluePrint bp = make_model("cnn");
  for (int s = 0; s < steps; ++s) {
    const test::LearnableBatch b = test::learnable_batch(bp, 8, 40 + static_cast<uint64_t>(s));
    e->train_step(b.images.data(), b.labels.data(), 0.05f);
  }
  return e;
}

TEST(EmaBn, RecurrenceMatchesFloat64Reference) {
  test::check_ema_bn_recurrence("cpu", false, "cnn", 0.9f, 6);
  test::check_ema_bn_recurrence("cpu", false, "resnet18_small", 0.5f, 3);
}

// No BatchNorm, no buffers: the EMA phase has no buffer node and nothing breaks.
TEST(EmaBn, ModelWithoutBatchNorm) {
  Engine e(make_model("mlp"), cpu_options(true));
  e.lock_memory();
  EXPECT_TRUE(e.program().buffers.empty());
  e.compile(1);
  const test::LearnableBatch b = test::learnable_batch(make_model("mlp"), 8, 1);
  e.train_step(b.images.data(), b.labels.data(), 0.05f);
  EXPECT_NO_THROW(e.eval_batch(b.images.data(), b.labels.data(), 8, true));
}

// eval_batch(ema) equals a plain engine holding the EMA weights and the EMA statistics, and
// differs from one holding the EMA weights with the live statistics (what kiln did before).
TEST(EmaBn, EmaEvaluationUsesTheEmaStatistics) {
  auto a = trained(5);
  const test::LearnableBatch probe = test::learnable_batch(make_model("cnn"), 8, 999);
  const StepStats ema = a->eval_batch(probe.images.data(), probe.labels.data(), 8, true);

  auto plain = [&](const StFile& sd) {
    Engine b(make_model("cnn"), cpu_options(false));
    b.lock_memory();
    b.compile(1);
    import_state_dict(b, sd, "test");
    return b.eval_batch(probe.images.data(), probe.labels.data(), 8, false);
  };
  const StFile ema_sd = export_state_dict(*a, true);
  // The same kernels over the same values on the CPU: bit-identical.
  EXPECT_EQ(plain(ema_sd).loss, ema.loss);
  StFile live_stats = ema_sd;
  const StFile live_sd = export_state_dict(*a, false);
  for (const BufferDesc& buf : a->program().buffers)
    live_stats.tensors[buf.name] = live_sd.tensors.at(buf.name);
  EXPECT_NE(plain(live_stats).loss, ema.loss) << "the EMA's own statistics made no difference";
}

TEST(EmaBn, CheckpointRoundTripAndOlderCheckpoints) {
  const std::string dir = fresh_dir("checkpoint");
  auto a = trained(4);
  save_checkpoint(*a, dir + "/ck.safetensors", TrainState{});
  const StFile f = read_safetensors(dir + "/ck.safetensors");
  for (const BufferDesc& buf : a->program().buffers)
    ASSERT_TRUE(f.tensors.count("ema." + buf.name)) << buf.name;

  Engine b(make_model("cnn"), cpu_options(true));
  b.lock_memory();
  b.compile(99);
  load_checkpoint(b, dir + "/ck.safetensors");
  for (const BufferDesc& buf : a->program().buffers) {
    EXPECT_EQ(b.read_param(buf.name, Region::ema_bn_running),
              a->read_param(buf.name, Region::ema_bn_running))
        << buf.name;
    EXPECT_EQ(b.read_param(buf.name), a->read_param(buf.name)) << buf.name;
  }

  // A checkpoint written before the EMA had statistics of its own: it loads, the EMA weights
  // are the file's and the EMA statistics start at the file's live ones.
  StFile old = f;
  for (const BufferDesc& buf : a->program().buffers) old.tensors.erase("ema." + buf.name);
  write_safetensors(dir + "/old.safetensors", old);
  Engine c(make_model("cnn"), cpu_options(true));
  c.lock_memory();
  c.compile(98);
  load_checkpoint(c, dir + "/old.safetensors");
  for (const BufferDesc& buf : a->program().buffers) {
    EXPECT_EQ(c.read_param(buf.name, Region::ema_bn_running), a->read_param(buf.name)) << buf.name;
  }
  for (const ParamDesc& d : a->program().params) {
    EXPECT_EQ(c.read_param(d.name, Region::ema_f32), a->read_param(d.name, Region::ema_f32))
        << d.name;
  }

  // Half of them missing is damage, not an older format.
  StFile damaged = f;
  damaged.tensors.erase("ema." + a->program().buffers.front().name);
  write_safetensors(dir + "/damaged.safetensors", damaged);
  Engine d(make_model("cnn"), cpu_options(true));
  d.lock_memory();
  d.compile(97);
  EXPECT_THROW(load_checkpoint(d, dir + "/damaged.safetensors"), Error);
}

// The command line: a run with --ema, then export --ema writes the EMA weights and statistics
// (the checkpoint's ema.* tensors under torchvision's names), and eval --ema reports the
// run's EMA top-1, as does plain eval of the exported file.
TEST(EmaBn, CliExportAndEvalUseTheEmaModel) {
  const std::string dir = fresh_dir("cli");
  TrainConfig c;
  c.model = "cnn";
  c.data = "synthetic";
  c.synthetic_size = 64;
  c.batch_size = 16;
  c.epochs = 2;
  c.lr.base_lr = 0.05f;
  c.workers = 1;
  c.device = "cpu";
  c.progress = "none";
  c.ema = true;
  c.ema_decay = 0.6f;
  c.output = dir + "/run";
  const TrainSummary s = train(c);
  ASSERT_GE(s.ema_top1, 0.0);
  const std::string ck = dir + "/run/last.safetensors";
  const StFile f = read_safetensors(ck);

  const std::string model = " --model cnn --device cpu";
  auto r = test::run_kiln("export --model cnn --ema --checkpoint " + ck + " --output " + dir +
                          "/ema.safetensors");
  ASSERT_EQ(r.code, 0) << r.out;
  const StFile e = read_safetensors(dir + "/ema.safetensors");
  bool differs = false;
  for (const auto& [name, t] : e.tensors) {
    if (name.find("num_batches_tracked") != std::string::npos) {
      EXPECT_EQ(t.data, f.tensors.at(name).data) << name << " is copied, as timm's ModelEmaV3 does";
      continue;
    }
    ASSERT_TRUE(f.tensors.count("ema." + name)) << name;
    EXPECT_EQ(t.data, f.tensors.at("ema." + name).data) << name;
    if (t.data != f.tensors.at(name).data && name.find("running_") != std::string::npos)
      differs = true;
  }
  EXPECT_TRUE(differs) << "the exported EMA statistics equal the live ones";
  r = test::run_kiln("export --model cnn --checkpoint " + ck + " --output " + dir +
                     "/live.safetensors");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const auto& [name, t] : read_safetensors(dir + "/live.safetensors").tensors) {
    EXPECT_EQ(t.data, f.tensors.at(name).data) << name;
  }

  const std::string data =
      " --data synthetic --synthetic-size 64 --batch-size 16 --workers 1 --progress none";
  char want[64];
  std::snprintf(want, sizeof want, "test top-1 %.2f%%", s.ema_top1);
  r = test::run_kiln("eval" + model + data + " --ema --weights " + ck);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(want), std::string::npos) << "want '" << want << "'\n" << r.out;
  r = test::run_kiln("eval" + model + data + " --weights " + dir + "/ema.safetensors");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(want), std::string::npos) << "want '" << want << "'\n" << r.out;

  // Exported weights have no EMA of their own: --ema on them is refused, naming the fix.
  r = test::run_kiln("eval" + model + data + " --ema --weights " + dir + "/ema.safetensors");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("has no EMA weights"), std::string::npos) << r.out;
  r = test::run_kiln("export --model cnn --ema --checkpoint " + dir +
                     "/live.safetensors --output " + dir + "/x.safetensors");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("has no EMA weights"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir + "/x.safetensors"));
}

}  // namespace
}  // namespace kiln
