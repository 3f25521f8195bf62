// The training task end to end on the CPU with synthetic data: metrics and checkpoints are
// written, a resumed run equals an uninterrupted one, and damaged checkpoints are refused.
#include "kiln/task/trainer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/data/transforms.h"
#include "kiln/io/json.h"
#include "kiln/io/safetensors.h"
#include "kiln/task/checkpoint.h"
#include "support/metrics_csv.h"
#include "task/progress.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

TrainConfig small_run(const std::string& out, int64_t epochs) {
  TrainConfig c;
  c.model = "cnn";
  c.data = "synthetic";
  c.synthetic_size = 96;
  c.batch_size = 16;
  c.epochs = epochs;
  c.lr.kind = "cosine";
  c.lr.base_lr = 0.05f;
  c.workers = 2;
  c.device = "cpu";
  c.progress = "none";
  c.ema = true;
  c.output = out;
  return c;
}

std::string fresh_dir(const std::string& name) {
  const std::string d = testing::TempDir() + "/kiln_trainer_" + name;
  fs::remove_all(d);
  return d;
}

int count_lines(const std::string& path) {
  std::ifstream in(path);
  int n = 0;
  std::string line;
  while (std::getline(in, line)) ++n;
  return n;
}

TEST(Trainer, WritesMetricsCheckpointAndSummary) {
  const std::string out = fresh_dir("outputs");
  const TrainSummary s = train(small_run(out, 2));
  EXPECT_EQ(s.epochs_run, 2);
  EXPECT_EQ(s.steps, 2 * (96 / 16));
  EXPECT_EQ(count_lines(out + "/metrics.csv"), 3);  // header + 2 epochs
  EXPECT_EQ(count_lines(out + "/metrics.jsonl"), 2);
  EXPECT_TRUE(fs::exists(out + "/last.safetensors"));
  EXPECT_TRUE(fs::exists(out + "/summary.json"));
  // Random pixels and labels teach nothing, so accuracy is not the check: what the run reports
  // is. The test split is 96 / 5 = 19 images, so top-1 is a whole number of them, top-5 holds
  // top-1, and the summary, the last metrics row and summary.json give the same numbers.
  const std::map<std::string, std::string> last = test::last_metrics_row(out + "/metrics.csv");
  for (const char* col :
       {"epoch", "step", "lr", "train_loss", "test_top1", "test_top5", "ema_test_top1"}) {
    ASSERT_TRUE(last.count(col)) << col << " missing from metrics.csv";
  }
  EXPECT_EQ(last.at("epoch"), "2");
  EXPECT_EQ(last.at("step"), "12");
  for (double top1 : {s.final_top1, s.ema_top1}) {
    const double hits = top1 * 19 / 100;
    EXPECT_NEAR(hits, std::round(hits), 1e-6) << top1 << "% is not a count of 19 images";
    EXPECT_GE(top1, 0.0);
    EXPECT_LE(top1, 100.0);
  }
  EXPECT_GE(s.final_top5, s.final_top1);
  // The CSV's 9 significant digits: 1e-6 relative.
  EXPECT_NEAR(std::stod(last.at("test_top1")), s.final_top1, 1e-6 * 100);
  EXPECT_NEAR(std::stod(last.at("test_top5")), s.final_top5, 1e-6 * 100);
  EXPECT_NEAR(std::stod(last.at("ema_test_top1")), s.ema_top1, 1e-6 * 100);
  EXPECT_TRUE(std::isfinite(std::stod(last.at("train_loss")))) << last.at("train_loss");
  // The row's lr is the schedule's at the epoch's last step (11 of 12).
  const TrainConfig c = small_run(out, 2);
  EXPECT_NEAR(std::stod(last.at("lr")), lr_at(c.lr, 11, 12, 6), 1e-6 * c.lr.base_lr);
  std::stringstream summary;
  summary << std::ifstream(out + "/summary.json").rdbuf();
  EXPECT_NE(summary.str().find("\"epochs\":2,\"steps\":12"), std::string::npos) << summary.str();
  EXPECT_NE(summary.str().find("{\"final_top1\":" + json_number(s.final_top1) + ","),
            std::string::npos)
      << summary.str();
  for (const auto& e : fs::directory_iterator(out)) {
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos)
        << "temporary file left: " << e.path();
  }
}

// best.safetensors is the checkpoint of the first epoch with the run's best test top-1 (its
// metadata says which epoch and which top-1, the metrics rows say which epoch that is);
// --keep-last 2 leaves epoch-3 and epoch-4 of 4 epochs, each equal to last.safetensors as it
// was after that epoch (epoch-4 is last itself); no temporary file stays. A resumed run keeps
// counting: two more epochs leave epoch-5 and epoch-6 only.
TEST(Trainer, KeepsBestAndTheLastKEpochCheckpoints) {
  const std::string out = fresh_dir("keep_last");
  TrainConfig c = small_run(out, 6);
  c.ema = false;
  c.keep_last = 2;
  c.stop_after_epochs = 4;
  const TrainSummary s = train(c);
  ASSERT_EQ(s.epochs_run, 4);
  for (int e = 1; e <= 4; ++e) {
    EXPECT_EQ(fs::exists(out + "/epoch-" + std::to_string(e) + ".safetensors"), e >= 3)
        << "epoch " << e;
  }
  auto bytes = [](const std::string& p) {
    std::stringstream b;
    b << std::ifstream(p, std::ios::binary).rdbuf();
    return b.str();
  };
  EXPECT_EQ(bytes(out + "/epoch-4.safetensors"), bytes(out + "/last.safetensors"));
  EXPECT_EQ(read_safetensors(out + "/epoch-3.safetensors").metadata.at("epoch"), "3");
  const auto rows = test::metrics_rows(out + "/metrics.csv");
  ASSERT_EQ(rows.size(), 4u);
  int best_epoch = 0;
  double best = -1;
  for (const auto& r : rows) {
    const double t = std::stod(r.at("test_top1"));
    if (t > best) {
      best = t;
      best_epoch = std::stoi(r.at("epoch"));
    }
  }
  ASSERT_TRUE(fs::exists(out + "/best.safetensors"));
  const StFile b = read_safetensors(out + "/best.safetensors");
  EXPECT_EQ(b.metadata.at("epoch"), std::to_string(best_epoch));
  EXPECT_NEAR(std::stod(b.metadata.at("best_top1")), best, 1e-6 * 100);
  c.resume = out + "/last.safetensors";
  c.stop_after_epochs = 0;
  train(c);
  for (int e = 1; e <= 6; ++e) {
    EXPECT_EQ(fs::exists(out + "/epoch-" + std::to_string(e) + ".safetensors"), e >= 5)
        << "epoch " << e;
  }
  for (const auto& e : fs::directory_iterator(out)) {
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos)
        << "temporary file left: " << e.path();
  }
}

// Without --keep-last no epoch-N file is written; best is.
TEST(Trainer, NoEpochCheckpointsWithoutKeepLast) {
  const std::string out = fresh_dir("no_keep_last");
  TrainConfig c = small_run(out, 2);
  c.ema = false;
  train(c);
  EXPECT_TRUE(fs::exists(out + "/best.safetensors"));
  for (const auto& e : fs::directory_iterator(out)) {
    EXPECT_NE(e.path().filename().string().rfind("epoch-", 0), 0u) << e.path();
  }
}

// --color-jitter joins the training pipeline after the crop and flip, before Normalize; the
// test split is not jittered, and the jittered pipeline leaves the uint8 path.
TEST(Trainer, ColorJitterJoinsTheTrainingPipeline) {
  TrainConfig c;
  c.data = "cifar10";
  c.crop_padding = 4;
  const Pipeline plain = input_pipeline(c, true, 32, 3);
  EXPECT_EQ(plain.describe().find("ColorJitter"), std::string::npos) << plain.describe();
  EXPECT_TRUE(plain.geometric());
  c.color_jitter = {0.4f, 0.3f, 0.2f, 0.1f};
  const Pipeline train_p = input_pipeline(c, true, 32, 3);
  const std::string d = train_p.describe();
  const size_t flip = d.find("RandomHorizontalFlip"),
               jitter = d.find(
                   "ColorJitter(brightness 0.4, contrast 0.3, "
                   "saturation 0.2, hue 0.1)"),
               norm = d.find("Normalize");
  ASSERT_NE(jitter, std::string::npos) << d;
  EXPECT_LT(d.find("RandomCrop"), flip) << d;
  EXPECT_LT(flip, jitter) << d;
  EXPECT_LT(jitter, norm) << d;
  EXPECT_FALSE(train_p.geometric());
  EXPECT_EQ(input_pipeline(c, false, 32, 3).describe().find("ColorJitter"), std::string::npos);
}

// Image folders' evaluation resizes the shorter side to 8/7 of the crop (256 for 224), or to
// --val-resize-size, then centre-crops; training's RandomResizedCrop does not change with it.
TEST(Trainer, ValResizeSizeSetsTheEvaluationResize) {
  TrainConfig c;
  c.data = "folder";
  c.random_resized_crop = true;
  EXPECT_NE(input_pipeline(c, false, 224, 3).describe().find("Resize(shorter side 256)"),
            std::string::npos)
      << input_pipeline(c, false, 224, 3).describe();
  c.val_resize_size = 288;
  const std::string val = input_pipeline(c, false, 224, 3).describe();
  EXPECT_NE(val.find("Resize(shorter side 288)"), std::string::npos) << val;
  EXPECT_LT(val.find("Resize"), val.find("CenterCrop")) << val;
  EXPECT_EQ(input_pipeline(c, true, 224, 3).describe().find("Resize(shorter side"),
            std::string::npos);
}

// Statistics arrive a step late, so the first progress line has no loss yet: it shows a dash,
// not a 0.0000 that reads as a measured loss; later lines show the running mean.
TEST(Trainer, ProgressShowsNoLossBeforeTheFirstStatistics) {
  Progress p("plain");
  testing::internal::CaptureStdout();
  p.update(1, 2, 1, 10, NAN, 100.0, 0.1f, 0.01);
  p.update(1, 2, 5, 10, 0.6931, 100.0, 0.1f, 0.05);
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("step 1/10 loss - "), std::string::npos) << out;
  EXPECT_NE(out.find("step 5/10 loss 0.6931 "), std::string::npos) << out;
  EXPECT_EQ(out.find("nan"), std::string::npos) << out;
}

// Real data: 80 steps of the default CNN on Fashion-MNIST (Debian's dataset-fashion-mnist)
// already classify most of the 10,000 test images; chance is 10%.
TEST(Trainer, LearnsFashionMnist) {
  if (!fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP()
        << "Fashion-MNIST is not installed (scripts/setup.sh installs dataset-fashion-mnist)";
  }
  const std::string out = fresh_dir("fmnist");
  TrainConfig c;
  c.model = "cnn";
  c.data = "fashion-mnist";
  c.epochs = 1;
  c.batch_size = 64;
  c.max_steps_per_epoch = 80;
  c.lr.kind = "onecycle";
  c.lr.base_lr = 0.1f;
  c.device = "cpu";
  c.progress = "none";
  c.output = out;
  const TrainSummary s = train(c);
  EXPECT_GT(s.final_top1, 70.0) << "after 80 steps";
  EXPECT_GT(s.final_top5, 95.0);
}

// S25: stop after 2 of 4 epochs, resume, and the weights, moments, EMA and statistics equal
// those of 4 straight epochs, bit for bit (the CPU path is deterministic for a fixed seed).
TEST(Trainer, ResumeEqualsAnUninterruptedRun) {
  const std::string straight = fresh_dir("straight");
  train(small_run(straight, 4));
  const std::string split = fresh_dir("split");
  TrainConfig first_half = small_run(split, 4);
  first_half.stop_after_epochs = 2;  // an interrupted 4-epoch run: the schedule spans 4 epochs
  EXPECT_EQ(train(first_half).epochs_run, 2);
  TrainConfig resumed = small_run(split, 4);
  resumed.resume = split + "/last.safetensors";
  const TrainSummary s = train(resumed);
  EXPECT_EQ(s.epochs_run, 2);
  const StFile a = read_safetensors(straight + "/last.safetensors");
  const StFile b = read_safetensors(split + "/last.safetensors");
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, t] : a.tensors) {
    ASSERT_TRUE(b.tensors.count(name)) << name;
    EXPECT_EQ(t.data, b.tensors.at(name).data) << name << " differs after resuming";
  }
  EXPECT_EQ(a.metadata.at("step"), b.metadata.at("step"));
  EXPECT_EQ(count_lines(split + "/metrics.csv"), 5);  // the resumed run appends
}

TEST(Checkpoint, RoundTripRestoresEveryTensor) {
  const std::string out = fresh_dir("roundtrip");
  fs::create_directories(out);
  EngineOptions o;
  o.device = "cpu";
  o.compile.batch = 4;
  o.compile.ema = true;
  Engine a(make_model("cnn"), o);
  a.lock_memory();
  a.compile(1);
  std::vector<float> img(4 * 28 * 28, 0.3f);
  std::vector<int32_t> lab{1, 2, 3, 4};
  a.train_step(img.data(), lab.data(), 0.1f);
  TrainState st;
  st.epoch = 3;
  st.step = 1;
  save_checkpoint(a, out + "/ck.safetensors", st);
  Engine b(make_model("cnn"), o);
  b.lock_memory();
  b.compile(99);
  const TrainState got = load_checkpoint(b, out + "/ck.safetensors");
  EXPECT_EQ(got.epoch, 3);
  EXPECT_EQ(got.step, 1);
  for (const ParamDesc& d : a.program().params) {
    EXPECT_EQ(a.read_param(d.name), b.read_param(d.name)) << d.name;
    EXPECT_EQ(a.read_param(d.name, Region::moment1), b.read_param(d.name, Region::moment1))
        << d.name;
    EXPECT_EQ(a.read_param(d.name, Region::ema_f32), b.read_param(d.name, Region::ema_f32))
        << d.name;
  }
  for (const BufferDesc& buf : a.program().buffers)
    EXPECT_EQ(a.read_param(buf.name), b.read_param(buf.name));
}

TEST(Checkpoint, DamagedOrForeignFilesAreRefused) {
  const std::string out = fresh_dir("damaged");
  fs::create_directories(out);
  EngineOptions o;
  o.device = "cpu";
  o.compile.batch = 2;
  Engine e(make_model("cnn"), o);
  e.lock_memory();
  e.compile(1);
  save_checkpoint(e, out + "/good.safetensors", TrainState{});
  // A damaged header: flip bytes inside the JSON.
  {
    std::fstream f(out + "/good.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    std::string bytes = ss.str();
    std::string bad = bytes;
    bad[12] = '}';
    bad[13] = '{';
    std::ofstream(out + "/bad_header.safetensors", std::ios::binary) << bad;
    std::ofstream(out + "/truncated.safetensors", std::ios::binary)
        << bytes.substr(0, bytes.size() / 2);
  }
  for (const std::string name : {"bad_header", "truncated"}) {
    try {
      load_checkpoint(e, out + "/" + name + ".safetensors");
      FAIL() << name;
    } catch (const Error& err) {
      EXPECT_EQ(err.kind(), ErrorKind::Checkpoint) << err.what();
      EXPECT_NE(std::string(err.what()).find(name), std::string::npos) << err.what();
    }
  }
  // A missing tensor.
  StFile f = read_safetensors(out + "/good.safetensors");
  f.tensors.erase("block3.bn.running_var");
  write_safetensors(out + "/missing.safetensors", f);
  try {
    load_checkpoint(e, out + "/missing.safetensors");
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::Checkpoint);
    EXPECT_NE(std::string(err.what()).find("block3.bn.running_var"), std::string::npos)
        << err.what();
  }
  // Another model's checkpoint.
  Engine other(make_model("lenet"), o);
  other.lock_memory();
  other.compile(1);
  try {
    load_checkpoint(other, out + "/good.safetensors");
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::Checkpoint);
    EXPECT_NE(std::string(err.what()).find("--model cnn"), std::string::npos) << err.what();
  }
}

TEST(Checkpoint, ExportHasTorchvisionNamesAndLayouts) {
  EngineOptions o;
  o.device = "cpu";
  o.compile.batch = 1;
  Engine e(make_model("resnet18"), o);
  e.lock_memory();
  e.compile(1);
  const StFile f = export_state_dict(e);
  EXPECT_EQ(f.tensors.size(), 122u);  // torchvision's resnet18 state_dict has 122 entries
  EXPECT_EQ(f.tensors.at("conv1.weight").shape, (std::vector<int64_t>{64, 3, 7, 7}));
  EXPECT_EQ(f.tensors.at("layer1.0.bn1.num_batches_tracked").dtype, DType::I64);
  // The layout round trip is exact.
  const ParamDesc* d = e.program().find_param("layer2.0.conv1.weight");
  const std::vector<float> w = e.read_param(d->name);
  EXPECT_EQ(from_torch_layout(*d, to_torch_layout(*d, w)), w);
}

}  // namespace
}  // namespace kiln
