// The uint8 input path end to end on the CPU: the backend's uint8 staging equals the float
// staging of the same normalisation, `kiln train --decode cpu` on a JPEG folder trains as the
// float path does, bad files are skipped and counted (never a crash), folder mistakes are one
// clear error, and `kiln bench --input-only` times the pipeline alone.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kiln/blueprint/zoo.h"
#include "kiln/data/image_codec.h"
#include "kiln/task/engine.h"
#include "kiln/task/trainer.h"
#include "support/cli_run.h"
#include "unit/data_test_util.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using data_test::write_file;

using Result = kiln::test::CliResult;
Result kiln_cli(const std::string& args) {
  return kiln::test::run_kiln(args);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string fresh_dir(const std::string& name) {
  const std::string d = testing::TempDir() + "/kiln_input_" + name;
  fs::remove_all(d);
  return d;
}

Image pattern(int64_t h, int64_t w, int64_t c, int seed) {
  return data_test::smooth_pattern(h, w, c, seed);
}

// A PNG header declaring 200000 x 200000 pixels (4e10: a decompression bomb), valid CRC.
std::vector<uint8_t> png_bomb() {
  std::vector<uint8_t> b = encode_png(pattern(2, 2, 3, 0));
  const uint32_t side = 200000;
  for (int i = 0; i < 4; ++i) b[16 + i] = b[20 + i] = static_cast<uint8_t>(side >> (24 - 8 * i));
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 12; i < 29; ++i) {
    crc ^= b[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  crc ^= 0xFFFFFFFFu;
  for (int i = 0; i < 4; ++i) b[29 + i] = static_cast<uint8_t>(crc >> (24 - 8 * i));
  return b;
}

// root/{train,test}/c{0,1}/*.jpg of sizes that a 16x16 centre crop (resnet18_small at
// --image-size 16, small to keep CPU steps fast) takes from an 18-pixel resize without DCT
// scaling (shrinking by less than 8/7).
void write_good_folder(const std::string& root, int per_class_train, int per_class_test) {
  const int64_t sizes[][2] = {{20, 19}, {19, 22}, {20, 20}};
  for (int c = 0; c < 2; ++c) {
    for (int i = 0; i < per_class_train + per_class_test; ++i) {
      const auto& s = sizes[i % 3];
      const std::string split = i < per_class_train ? "train" : "test";
      write_file(root + "/" + split + "/c" + std::to_string(c) + "/g" + std::to_string(i) + ".jpg",
                 encode_jpeg(pattern(s[0], s[1], 3, 5 * c + i), 92));
    }
  }
}

// The CPU backend normalises uint8 input in its staging pass: the same floats as staging
// normalize_u8's output (the host reference) through the float path.
TEST(InputPath, CpuStageBatchU8EqualsStageBatchOfNormalizedFloats) {
  EngineOptions eo;
  eo.device = "cpu";
  eo.compile.batch = 2;
  Engine engine(make_model("cnn", {}), eo);
  engine.lock_memory();
  engine.compile(0);
  const Program& p = engine.program();
  const DTensor& a = p.tensor(p.io.staged_images[0]);
  const DTensor& b = p.tensor(p.io.staged_images[1]);
  std::vector<uint8_t> px(static_cast<size_t>(a.numel()));
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 37 + 11) % 256);
  const InputNormalization norm{{0.2860f}, {0.3530f}};
  std::vector<float> ref(px.size());
  normalize_u8(px.data(), a.numel(), norm, ref.data());
  const int32_t labels[2] = {3, 7};
  engine.backend().stage_batch_u8(0, px.data(), labels, norm);
  engine.backend().stage_batch(1, ref.data(), labels);
  EXPECT_EQ(read_floats(engine.backend(), a), read_floats(engine.backend(), b));
  EXPECT_FLOAT_EQ(ref[0], (11 / 255.0f - 0.2860f) / 0.3530f);
}

// normalize_u8 has loops for 1 and 3 channels laid out for SIMD, 16 pixels at a time: bit for
// bit the per-value formula (the GPU kernel's reference), across block edges and tails, as
// the generic loop computes it for other channel counts.
TEST(InputPath, NormalizeU8IsThePerValueFormula) {
  const std::vector<float> mean = {0.485f, 0.456f, 0.406f, 0.5f},
                           std = {0.229f, 0.224f, 0.225f, 0.25f};
  for (size_t c = 1; c <= 4; ++c) {
    const InputNormalization norm{{mean.begin(), mean.begin() + c}, {std.begin(), std.begin() + c}};
    for (int64_t pixels : {1, 15, 16, 17, 100}) {
      std::vector<uint8_t> px(static_cast<size_t>(pixels) * c);
      for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 37 + 11) % 256);
      std::vector<float> got(px.size());
      normalize_u8(px.data(), pixels, norm, got.data());
      for (size_t i = 0; i < px.size(); ++i) {
        const size_t k = i % c;
        const float want =
            static_cast<float>(px[i]) * (1.0f / (255.0f * std[k])) - mean[k] / std[k];
        ASSERT_EQ(got[i], want) << c << " channels, " << pixels << " pixels, value " << i;
      }
    }
  }
}

TrainConfig folder_run(const std::string& data, const std::string& out) {
  TrainConfig c;
  c.model = "resnet18_small";
  c.image_size = 16;
  c.data = "folder";
  c.data_dir = data;
  c.batch_size = 4;
  c.epochs = 2;
  c.lr.kind = "constant";
  c.lr.base_lr = 0.02f;
  c.workers = 2;
  c.device = "cpu";
  c.progress = "none";
  c.output = out;
  return c;
}

// uint8 on the host and normalised in the staging pass against float32 pixels: the inputs
// differ by rounding to the nearest level (half a level: 0.5 / 255 / 0.229 = 0.009 after
// normalisation) and, at a few pixels of the crop's edge columns, by the cropped decode's
// chroma upsampling (a few levels). With a learning rate of 1e-4 the weights barely move, so
// the losses differ by what the inputs do: 6e-4 measured at 32x32; 3e-3 allowed.
TEST(InputPath, TrainDecodeCpuGivesTheFloatPathsLosses) {
  const std::string data = fresh_dir("same_data");
  write_good_folder(data, 4, 2);
  TrainConfig c = folder_run(data, fresh_dir("same_u8"));
  c.epochs = 1;
  c.lr.base_lr = 1e-4f;
  c.decode = DecodeWhere::cpu;
  const TrainSummary u8 = train(c);
  c.input_u8 = false;
  c.output = fresh_dir("same_f32");
  const TrainSummary f32 = train(c);
  EXPECT_EQ(u8.input, "uint8");
  EXPECT_EQ(f32.input, "float32");
  EXPECT_EQ(u8.steps, 2);
  EXPECT_NEAR(u8.final_loss, f32.final_loss, 3e-3);
  EXPECT_GE(u8.loader_images_per_second, 0.0);
  EXPECT_GE(u8.input_wait_fraction, 0.0);
  EXPECT_LE(u8.input_wait_fraction, 1.0);
  // The final evaluation is timed: its images over its wall time.
  EXPECT_GT(u8.eval_images_per_second, 0.0);
  EXPECT_TRUE(std::isfinite(u8.eval_images_per_second));
}

TEST(InputPath, BadFilesAreSkippedOnceAndCounted) {
  const std::string data = fresh_dir("bad_data");
  write_good_folder(data, 7, 1);
  const std::vector<uint8_t> good = encode_jpeg(pattern(20, 20, 3, 1), 90);
  std::vector<uint8_t> truncated(good.begin(), good.begin() + static_cast<long>(good.size() / 2));
  std::vector<uint8_t> corrupt = {0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x10, 'J',
                                  'F',  'I',  'F',  0,    7,    7,    7};
  write_file(data + "/train/c0/bad_corrupt.jpg", corrupt);
  write_file(data + "/train/c0/bad_truncated.jpg", truncated);
  write_file(data + "/train/c0/bad_empty.jpg", {});
  write_file(data + "/train/c1/bad_text.jpg",
             {'n', 'o', 't', ' ', 'a', 'n', ' ', 'i', 'm', 'a', 'g', 'e'});
  write_file(data + "/train/c1/bad_bomb.png", png_bomb());
  write_file(data + "/train/c1/ok_cmyk.jpg", encode_jpeg(pattern(20, 19, 4, 2), 90));
  write_file(data + "/train/c1/ok_progressive.jpg",
             encode_jpeg(pattern(19, 20, 3, 3), 90, {.progressive = true}));
  // 14 good + 5 bad + CMYK + progressive = 21 files; batch 3 visits every one of them.
  // The uint8 path (--decode auto is the host's on the CPU) and the float32 one.
  for (const bool u8 : {true, false}) {
    const std::string out = fresh_dir(std::string("bad_out_") + (u8 ? "u8" : "f32"));
    const Result r = kiln_cli(
        "train --model resnet18_small --image-size 16 --data folder --data-dir " + data +
        " --epochs 1 --batch-size 3 --device cpu --progress none --workers 2 --decode auto " +
        (u8 ? "" : "--no-input-u8 ") + "--output " + out);
    ASSERT_EQ(r.code, 0) << r.out;
    for (const char* bad : {"bad_corrupt.jpg", "bad_truncated.jpg", "bad_empty.jpg", "bad_text.jpg",
                            "bad_bomb.png"}) {
      const size_t at = r.out.find(bad);
      EXPECT_NE(at, std::string::npos) << bad << " not named:\n" << r.out;
      EXPECT_EQ(r.out.find(bad, at + 1), std::string::npos) << bad << " warned twice:\n" << r.out;
    }
    EXPECT_EQ(r.out.find("ok_cmyk"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("ok_progressive"), std::string::npos) << r.out;
    EXPECT_NE(
        r.out.find(
            u8 ? "input: decoded on the host by 2 workers, uint8 to the device"
               : "input: decoded and transformed on the host by 2 workers, float32 to the device"),
        std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("-bound: the step waited for the loader"), std::string::npos) << r.out;
    const std::string summary = read_text(out + "/summary.json");
    EXPECT_NE(summary.find("\"skipped_images\":5"), std::string::npos) << summary;
    EXPECT_NE(summary.find(u8 ? "\"input\":\"uint8\"" : "\"input\":\"float32\""), std::string::npos)
        << summary;
    EXPECT_NE(summary.find("\"loader_images_per_second\":"), std::string::npos) << summary;
    EXPECT_NE(summary.find("\"input_wait_fraction\":"), std::string::npos) << summary;
    EXPECT_NE(summary.find("\"eval_images_per_second\":"), std::string::npos) << summary;
  }
}

TEST(InputPath, FolderMistakesAreOneClearError) {
  const std::string data = fresh_dir("mistakes");
  write_good_folder(data, 2, 1);
  const std::string common = " --model resnet18_small --image-size 16 --data folder --data-dir " +
                             data + " --epochs 1 --device cpu --progress none --output " +
                             fresh_dir("mistakes_out");
  // Fewer training images (4) than one batch.
  const Result small = kiln_cli("train --batch-size 8" + common);
  EXPECT_NE(small.code, 0);
  EXPECT_NE(small.out.find(data + "/train"), std::string::npos) << small.out;
  EXPECT_NE(small.out.find("fewer than one batch of 8"), std::string::npos) << small.out;
  // A class folder with no image.
  fs::create_directories(data + "/train/empty_class");
  const Result empty = kiln_cli("train --batch-size 2" + common);
  EXPECT_NE(empty.code, 0);
  EXPECT_NE(empty.out.find(data + "/train/empty_class"), std::string::npos) << empty.out;
  fs::remove_all(data + "/train/empty_class");
  // The CPU backend decodes no JPEG: --decode gpu says so and names the fix.
  const Result gpu = kiln_cli("train --batch-size 2 --decode gpu" + common);
  EXPECT_NE(gpu.code, 0);
  EXPECT_NE(gpu.out.find("no JPEG decoder"), std::string::npos) << gpu.out;
  EXPECT_NE(gpu.out.find("--decode cpu"), std::string::npos) << gpu.out;
  const Result bad = kiln_cli("train --batch-size 2 --decode fpga" + common);
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("--decode fpga is not one of auto, gpu, cpu"), std::string::npos)
      << bad.out;
}

TEST(InputPath, BenchTimesTheInputPipelineAlone) {
  const std::string data = fresh_dir("bench");
  write_good_folder(data, 6, 1);
  const Result r = kiln_cli("bench --input-only --data folder --data-dir " + data +
                            " --model resnet18_small --image-size 16 --device cpu --batch 4 "
                            "--steps 2 --warmup 1 --repeats 1 --workers 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("{\"bench\":\"kiln-input\",\"model\":\"resnet18_small\",\"batch\":4,\"amp\":"
                       "false,\"decode\":\"cpu\","
                       "\"workers\":2,\"images_per_second\":"),
            std::string::npos)
      << r.out;
  const Result steps = kiln_cli("bench --data folder --data-dir " + data +
                                " --model resnet18_small --image-size 16 --device cpu --batch 4 "
                                "--steps 2 --warmup 1 --repeats 1 --workers 1");
  ASSERT_EQ(steps.code, 0) << steps.out;
  EXPECT_NE(steps.out.find("{\"bench\":\"kiln-folder\""), std::string::npos) << steps.out;
  EXPECT_NE(steps.out.find("\"first_loss\":"), std::string::npos) << steps.out;
  const Result gpu =
      kiln_cli("bench --input-only --data folder --data-dir " + data +
               " --model resnet18_small --image-size 16 --device cpu --batch 4 --decode gpu");
  EXPECT_NE(gpu.code, 0);
  EXPECT_NE(gpu.out.find("--decode cpu"), std::string::npos) << gpu.out;
}

}  // namespace
}  // namespace kiln
