// `kiln train` / `kiln eval` against damaged datasets and careless flags (issue 15): each case
// builds its dataset in a scratch folder, runs the CLI, and checks the exit status, the key
// words of the message and which files are left in the output folder (SPEC Q1: one clear
// error, a non-zero exit, no partial output). Runs are tiny (mlp, 32 images of 28x28, batch 8)
// so that the table stays a few seconds on CI's two cores.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kiln/data/image_codec.h"
#include "kiln/io/safetensors.h"
#include "support/cli_run.h"

namespace {

namespace fs = std::filesystem;

using Result = kiln::test::CliResult;
Result kiln(const std::string& args) {
  return kiln::test::run_kiln(args);
}

using kiln::test::idx_file;
using kiln::test::write_bytes;

// An MNIST-style split: n images of h x w (bytes varying with the index), labels i % 10.
void idx_split(const fs::path& dir, const std::string& prefix, uint32_t n, uint32_t h, uint32_t w) {
  std::vector<uint8_t> px(static_cast<size_t>(n) * h * w), labels(n);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 37 + i / 97) & 0xff);
  for (uint32_t i = 0; i < n; ++i) labels[i] = static_cast<uint8_t>(i % 10);
  write_bytes(dir / (prefix + "-images-idx3-ubyte"), idx_file({n, h, w}, px));
  write_bytes(dir / (prefix + "-labels-idx1-ubyte"), idx_file({n}, labels));
}

void mnist(const fs::path& dir) {
  idx_split(dir, "train", 32, 28, 28);
  idx_split(dir, "t10k", 16, 28, 28);
}

void set_label(const fs::path& file, size_t index, uint8_t label) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(8 + index));  // IDX1 header: magic + one dimension
  f.put(static_cast<char>(label));
}

void png(const fs::path& path, int64_t side) {
  kiln::Image im;
  im.height = im.width = side;
  im.channels = 3;
  im.pixels.resize(static_cast<size_t>(side * side * 3));
  for (size_t i = 0; i < im.pixels.size(); ++i) im.pixels[i] = static_cast<uint8_t>(i * 7);
  write_bytes(path, kiln::encode_png(im));
}

// root/<split>/<class>/k.png, four 16x16 images per class.
void folder(const fs::path& root, const std::string& split,
            const std::vector<std::string>& classes) {
  for (const std::string& c : classes) {
    for (int k = 0; k < 4; ++k) png(root / split / c / (std::to_string(k) + ".png"), 16);
  }
}

// The output folder's entries, sorted, as one string ("" when it does not exist).
std::string listing(const fs::path& out) {
  if (!fs::exists(out)) return "";
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(out)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : " ") + n;
  return s;
}

const std::string kTiny =
    " --model mlp --data mnist --batch-size 8 --workers 1 --progress none --device cpu";

struct Case {
  const char* name;
  std::function<void(const fs::path& data)> make;  // builds the dataset under `data`
  std::string args;                                // DATA and OUT are replaced by the folders
  int code;                                        // 0, or 2 (a kiln::Error)
  std::vector<std::string> words;                  // each must appear in the output
  std::string files;                               // the output folder's listing afterwards
};

std::string fill(std::string s, const fs::path& data, const fs::path& out) {
  for (const auto& [key, value] :
       {std::pair<std::string, std::string>{"DATA", data.string()}, {"OUT", out.string()}}) {
    for (size_t at; (at = s.find(key)) != std::string::npos;) s.replace(at, key.size(), value);
  }
  return s;
}

const std::string kDone =
    "best.safetensors last.safetensors metrics.csv metrics.jsonl summary.json";

const Case kCases[] = {
    // Heap overflow: the test split's buffer was sized for the training shape.
    {"test_split_56x56",
     [](const fs::path& d) { idx_split(d, "train", 32, 28, 28), idx_split(d, "t10k", 16, 56, 56); },
     "train" + kTiny + " --data-dir DATA --output OUT",
     2,
     {"test split", "56x56x1", "28x28x1", "t10k-images"},
     ""},
    {"test_split_14x56_same_bytes",
     [](const fs::path& d) { idx_split(d, "train", 32, 28, 28), idx_split(d, "t10k", 16, 14, 56); },
     "train" + kTiny + " --data-dir DATA --output OUT",
     2,
     {"test split", "14x56x1", "28x28x1"},
     ""},
    // Labels decide the class set: MNIST has ten.
    {"train_label_200",
     [](const fs::path& d) { mnist(d), set_label(d / "train-labels-idx1-ubyte", 5, 200); },
     "train" + kTiny + " --data-dir DATA --output OUT",
     2,
     {"train-labels-idx1-ubyte", "label 200", "index 5", "0..9"},
     ""},
    {"test_label_200",
     [](const fs::path& d) { mnist(d), set_label(d / "t10k-labels-idx1-ubyte", 3, 200); },
     "train" + kTiny + " --data-dir DATA --output OUT",
     2,
     {"t10k-labels-idx1-ubyte", "label 200", "index 3"},
     ""},
    {"num_classes_below_the_datasets",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --num-classes 5",
     2,
     {"--num-classes 5", "10 classes"},
     ""},
    // Image folders: the training split's class folders are the class list.
    {"folder_val_missing_a_class",
     [](const fs::path& d) {
       folder(d, "train", {"ant", "bee", "cat"}), folder(d, "val", {"ant", "cat"});
     },
     "train --model resnet18_small --data folder --data-dir DATA --image-size 16 --batch-size 4 "
     "--workers 1 --progress none "
     "--device cpu --output OUT",
     2,
     {"/val", "missing 'bee'", "extra none"},
     ""},
    {"folder_val_extra_class",
     [](const fs::path& d) {
       folder(d, "train", {"ant", "bee"}), folder(d, "val", {"ant", "bee", "dog"});
     },
     "train --model resnet18_small --data folder --data-dir DATA --image-size 16 --batch-size 4 "
     "--workers 1 --progress none "
     "--device cpu --output OUT",
     2,
     {"/val", "extra 'dog'"},
     ""},
    {"folder_symlink_loop",
     [](const fs::path& d) {
       folder(d, "train", {"ant", "bee"}), folder(d, "val", {"ant", "bee"});
       fs::create_directory_symlink(".", d / "train" / "bee" / "loop");
     },
     "train --model resnet18_small --data folder --data-dir DATA --image-size 16 --batch-size 4 "
     "--workers 1 --progress none "
     "--device cpu --output OUT",
     2,
     {"cannot list image folder", "/train", "loop"},
     ""},
    // Divergence: a NaN loss stops the run; nothing NaN is saved.
    {"lr_1e6_diverges",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --sched constant --lr 1e6 --epochs 3",
     2,
     {"diverged", "epoch 1", "No checkpoint was written", "--lr"},
     ""},
    {"weight_decay_inf",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --weight-decay inf",
     2,
     {"--weight-decay", "finite"},
     ""},
    // Metrics columns are known before the first row.
    {"eval_every_2",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --epochs 3 --eval-every 2 --ema",
     0,
     {"done: 3 epochs"},
     kDone},
    // Things that are not what they claim to be.
    {"workers_100000",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --workers 100000",
     2,
     {"--workers 100000", "give at most"},
     ""},
    {"directory_as_idx_file",
     [](const fs::path& d) {
       mnist(d), fs::remove(d / "train-images-idx3-ubyte"),
           fs::create_directory(d / "train-images-idx3-ubyte");
     },
     "train" + kTiny + " --data-dir DATA --output OUT",
     2,
     {"train-images-idx3-ubyte", "is a directory"},
     ""},
    {"directory_as_cifar_batch",
     [](const fs::path& d) {
       for (int i = 1; i <= 5; ++i)
         fs::create_directories(d / ("data_batch_" + std::to_string(i) + ".bin"));
       fs::create_directories(d / "test_batch.bin");
     },
     "train --model resnet18 --data cifar10 --data-dir DATA --workers 1 --progress none --device "
     "cpu --output OUT",
     2,
     {"data_batch_1.bin", "is a directory"},
     ""},
    {"image_size_100000",
     mnist,
     "train --model resnet18 --data synthetic --image-size 100000 --output OUT",
     2,
     {"--image-size", "100000"},
     ""},
    {"image_size_on_idx",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --image-size 64",
     2,
     {"--image-size 64", "no effect", "28x28x1"},
     ""},
    // A pixel limit, counted as a skipped (corrupt) image: 16x16 = 256 pixels > 200.
    {"max_image_pixels",
     [](const fs::path& d) {
       folder(d, "train", {"ant", "bee"}), folder(d, "val", {"ant", "bee"});
       png(d / "train" / "ant" / "small.png",
           8);  // 64 pixels: the good file that replaces the others
       png(d / "val" / "ant" / "small.png", 8);
     },
     "train --model resnet18_small --data folder --data-dir DATA --image-size 16 --batch-size 4 "
     "--workers 1 --progress none "
     "--device cpu --epochs 1 --max-steps 1 --max-image-pixels 200 --output OUT",
     0,
     {"skipping corrupt image", "--max-image-pixels", "16x16 pixels"},
     kDone},
    // Accepted and ignored before: refused now.
    {"num_classes_negative",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --num-classes -1",
     2,
     {"--num-classes"},
     ""},
    {"max_steps_negative",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --max-steps -1",
     2,
     {"--max-steps"},
     ""},
    {"clip_grad_negative",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --clip-grad -1",
     2,
     {"--clip-grad"},
     ""},
    {"clip_grad_norm_negative",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --clip-grad-norm -1",
     2,
     {"--clip-grad-norm must be a finite number >= 0"},
     ""},
    {"clip_grad_norm_nan",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --clip-grad-norm nan",
     2,
     {"--clip-grad-norm must be a finite number >= 0"},
     ""},
    {"label_smoothing_one",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --label-smoothing 1",
     2,
     {"--label-smoothing must be in [0, 1)"},
     ""},
    {"val_resize_size_negative",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --val-resize-size -1",
     2,
     {"--val-resize-size must be in 0..8192"},
     ""},
    // torchvision's crop-size flags: the training crop is the model's input, and evaluation runs
    // the same compiled input size.
    {"train_crop_size_and_image_size_disagree",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --train-crop-size 28 --image-size 32",
     2,
     {"--train-crop-size 28 and --image-size 32 name the same thing"},
     ""},
    // IDX images are evaluated as they are: there is no crop for the flag to set.
    {"val_crop_size_on_idx_data",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --val-crop-size 24",
     2,
     {"--val-crop-size 24 has no effect on mnist data", "drop --val-crop-size"},
     ""},
    // The CNN flattens into its fc layer: at 32x32 that layer has another width, so the trained
    // weights cannot evaluate there. Refused before the first step, naming both sizes and fixes.
    {"val_crop_size_for_a_size_dependent_model",
     [](const fs::path&) {},
     "train --model cnn --data synthetic --synthetic-size 16 --batch-size 8 --workers 1 "
     "--progress none --device cpu --epochs 1 --output OUT --val-crop-size 32",
     2,
     {"--val-crop-size 32: model 'cnn' trains at 28x28 and cannot evaluate at 32x32",
      "'fc.weight' is [10, 3136] at 28x28", "leave --val-crop-size out (or give 28)",
      "globally pooled model"},
     ""},
    // torchvision's FixRes recipe in small: train at 16, evaluate at 20 after a resize to 24.
    {"val_crop_size_other_than_the_training_crop",
     [](const fs::path& d) {
       folder(d, "train", {"a", "b"}), folder(d, "val", {"a", "b"});
     },
     "train --model resnet18_small --data folder --data-dir DATA --train-crop-size 16 "
     "--val-crop-size 20 --val-resize-size 24 --batch-size 2 --workers 1 --progress none "
     "--device cpu --epochs 1 --output OUT",
     0,
     {"evaluation at 20x20 (training at 16x16)", "done: 1 epochs"},
     kDone},
    {"train_and_val_crop_size_as_torchvision_gives_them",
     [](const fs::path& d) {
       folder(d, "train", {"a", "b"}), folder(d, "val", {"a", "b"});
     },
     "train --model resnet18_small --data folder --data-dir DATA --train-crop-size 16 "
     "--val-crop-size 16 --val-resize-size 20 --random-resized-crop --batch-size 2 --workers 1 "
     "--progress none --device cpu --epochs 1 --output OUT",
     0,
     {"done: 1 epochs"},
     kDone},
    {"label_smoothing_negative",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --label-smoothing -0.1",
     2,
     {"--label-smoothing must be in [0, 1)"},
     ""},
    {"mixup_alpha_negative",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --mixup-alpha -0.2",
     2,
     {"--mixup-alpha must be a finite number >= 0"},
     ""},
    {"cutmix_alpha_negative_timm_name",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --cutmix -1",
     2,
     {"--cutmix-alpha must be a finite number >= 0"},
     ""},
    {"mixup_prob_above_one",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --mixup-prob 1.5",
     2,
     {"--mixup-prob must be in [0, 1]"},
     ""},
    {"mixup_switch_prob_negative",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --mixup-switch-prob -0.5",
     2,
     {"--mixup-switch-prob must be in [0, 1]"},
     ""},
    {"keep_last_negative",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --keep-last -1",
     2,
     {"--keep-last must be in 0..1000000"},
     ""},
    {"deterministic_not_a_switch_value",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --deterministic=maybe",
     2,
     {"--deterministic is a switch"},
     ""},
    {"seed_negative",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --seed -1",
     2,
     {"--seed"},
     ""},
    {"epochs_overflow",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --epochs 99999999999999999999",
     2,
     {"--epochs", "out of range"},
     ""},
    {"epochs_huge",
     mnist,
     "train" + kTiny + " --data-dir DATA --output OUT --epochs 9000000000000",
     2,
     {"--epochs must be in 1..1000000"},
     ""},
    {"resume_with_init_from",
     mnist,
     "train" + kTiny +
         " --data-dir DATA --output OUT --resume DATA/a.safetensors --init-from DATA/b.safetensors",
     2,
     {"--resume", "--init-from", "give one"},
     ""},
    // Said once that it has no effect; -b as --help advertises.
    {"tf32_on_cpu_and_short_b",
     mnist,
     "train --model mlp --data mnist -b 8 --workers 1 --progress none --device cpu --tf32 --epochs "
     "1 --data-dir DATA "
     "--output OUT",
     0,
     {"--tf32 has no effect on the CPU", "done: 1 epochs, 4 steps"},
     kDone},
    {"one_class_folder",
     [](const fs::path& d) { folder(d, "train", {"only"}), folder(d, "val", {"only"}); },
     "train --model resnet18_small --data folder --data-dir DATA --image-size 16 --batch-size 2 "
     "--workers 1 --progress none "
     "--device cpu --epochs 1 --output OUT",
     0,
     {"has one class"},
     kDone},
    {"folder_with_a_one_channel_model",
     [](const fs::path& d) {
       folder(d, "train", {"ant", "bee"}), folder(d, "val", {"ant", "bee"});
     },
     "train --model cnn --data folder --data-dir DATA --image-size 16 --batch-size 4 --progress "
     "none --device cpu "
     "--output OUT",
     2,
     {"model 'cnn' takes 1-channel images", "--model resnet18_small"},
     ""},
    // kiln eval refuses the flags it does not use, instead of ignoring them.
    // (--ema is eval's own since eval --ema evaluates the EMA model; --ema-decay stays training's.)
    {"eval_refuses_training_flags",
     mnist,
     "eval" + kTiny + " --data-dir DATA --weights DATA/w.safetensors --ema-decay 0.99",
     2,
     {"unknown flag --ema-decay for 'kiln eval'", "--weights"},
     ""},
    {"eval_refuses_output",
     mnist,
     "eval" + kTiny + " --data-dir DATA --weights DATA/w.safetensors --output OUT",
     2,
     {"unknown flag --output"},
     ""},
};

class CliHostile : public ::testing::TestWithParam<Case> {};

TEST_P(CliHostile, OneClearErrorOrACorrectRun) {
  const Case& c = GetParam();
  const fs::path root = fs::path(testing::TempDir()) / ("kiln_hostile_" + std::string(c.name));
  fs::remove_all(root);
  const fs::path data = root / "data", out = root / "out";
  fs::create_directories(data);
  c.make(data);
  const Result r = kiln(fill(c.args, data, out));
  EXPECT_EQ(r.code, c.code) << r.out;
  for (const std::string& w : c.words)
    EXPECT_NE(r.out.find(w), std::string::npos) << "no '" << w << "' in:\n" << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("std::bad_alloc"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("filesystem error"), std::string::npos) << r.out;
  EXPECT_EQ(listing(out), c.files) << r.out;
  fs::remove_all(root);
}

INSTANTIATE_TEST_SUITE_P(Issue15, CliHostile, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// A diverging resumed run keeps the last good checkpoint byte for byte and names it.
TEST(CliHostileDivergence, LastGoodCheckpointIsKept) {
  const fs::path root = fs::path(testing::TempDir()) / "kiln_hostile_diverge_resume";
  fs::remove_all(root);
  const fs::path data = root / "data", out = root / "out";
  mnist(data);
  const std::string base = "train" + kTiny + " --data-dir " + data.string() + " --output " +
                           out.string() + " --sched constant --epochs 3";
  const Result good = kiln(base + " --lr 0.01 --stop-after-epochs 1");
  ASSERT_EQ(good.code, 0) << good.out;
  const std::string ckpt = (out / "last.safetensors").string();
  const kiln::StFile before = kiln::read_safetensors(ckpt);
  const Result bad = kiln(base + " --lr 1e6 --resume-override --resume " +
                          ckpt);  // a new --lr on resume needs the override
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("diverged in epoch 2"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("The last good checkpoint is '" + ckpt + "' (after epoch 1)"),
            std::string::npos)
      << bad.out;
  const kiln::StFile after = kiln::read_safetensors(ckpt);
  ASSERT_EQ(before.tensors.size(), after.tensors.size());
  for (const auto& [name, t] : before.tensors)
    EXPECT_EQ(t.data, after.tensors.at(name).data) << name;
  fs::remove_all(root);
}

// kiln eval reads only the test split: it evaluates where there is no training split, and a
// test split of another shape than the weights were trained for is refused by the weights'
// shapes, naming the checkpoint, instead of being written past a buffer.
TEST(CliHostileEval, ReadsOnlyTheTestSplit) {
  const fs::path root = fs::path(testing::TempDir()) / "kiln_hostile_eval_split";
  fs::remove_all(root);
  const fs::path data = root / "data", out = root / "out";
  mnist(data);
  const std::string dir = " --data-dir " + data.string();
  const Result good = kiln("train" + kTiny + dir + " --output " + out.string() + " --epochs 1");
  ASSERT_EQ(good.code, 0) << good.out;
  const std::string weights = " --weights " + (out / "last.safetensors").string();
  fs::remove(data / "train-images-idx3-ubyte");
  fs::remove(data / "train-labels-idx1-ubyte");
  const Result only_test = kiln("eval" + kTiny + dir + weights);
  EXPECT_EQ(only_test.code, 0) << only_test.out;
  EXPECT_NE(only_test.out.find("test top-1"), std::string::npos) << only_test.out;
  idx_split(data, "t10k", 16, 56, 56);
  const Result wide = kiln("eval" + kTiny + dir + weights);
  EXPECT_EQ(wide.code, 2) << wide.out;
  EXPECT_NE(wide.out.find("last.safetensors"), std::string::npos) << wide.out;
  EXPECT_NE(wide.out.find("has shape"), std::string::npos) << wide.out;
  fs::remove_all(root);
}

// `kiln eval` of weights that are NaN: every prediction is wrong, not 100% right.
TEST(CliHostileDivergence, EvalOfNanWeightsIsNotAccurate) {
  const fs::path root = fs::path(testing::TempDir()) / "kiln_hostile_nan_eval";
  fs::remove_all(root);
  const fs::path data = root / "data", out = root / "out";
  mnist(data);
  const Result good = kiln("train" + kTiny + " --data-dir " + data.string() + " --output " +
                           out.string() + " --epochs 1");
  ASSERT_EQ(good.code, 0) << good.out;
  kiln::StFile f = kiln::read_safetensors((out / "last.safetensors").string());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  int poisoned = 0;
  for (auto& [name, t] : f.tensors) {
    if (t.dtype != kiln::DType::F32 || name.find("weight") == std::string::npos) continue;
    auto* p = reinterpret_cast<float*>(t.data.data());
    for (size_t i = 0; i < t.data.size() / sizeof(float); ++i) p[i] = nan;
    ++poisoned;
  }
  ASSERT_GT(poisoned, 0) << "the checkpoint holds no F32 weight to poison";
  const std::string nan_ckpt = (root / "nan.safetensors").string();
  kiln::write_safetensors(nan_ckpt, f);
  const Result r = kiln("eval" + kTiny + " --data-dir " + data.string() + " --weights " + nan_ckpt);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("test top-1 0.00%, top-5 0.00%"), std::string::npos) << r.out;
  fs::remove_all(root);
}

}  // namespace
