// The kiln command line as a user meets it: the inspection commands print what they promise,
// and bad input (an unknown model, flag or dataset, a missing file, an impossible shape)
// gets one clear error and a non-zero exit, with no partial output left behind.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "support/cli_run.h"

namespace {

using Result = kiln::test::CliResult;
Result kiln(const std::string& args) {
  return kiln::test::run_kiln(args);
}
// kiln with KILN_* variables in its own environment (the edge reads them), not the test's.
Result kiln_with(const std::string& variables, const std::string& args) {
  return kiln::test::run_shell(variables + " " + KILN_CLI_PATH + " " + args);
}

TEST(Cli, PlanProgramAndMemoryOfResNet50) {
  const Result plan = kiln("plan resnet50");
  EXPECT_EQ(plan.code, 0) << plan.out;
  EXPECT_NE(plan.out.find("25557032 parameters"), std::string::npos);
  EXPECT_NE(plan.out.find("layer4.2.conv3"), std::string::npos);
  const Result program = kiln("program resnet50");
  EXPECT_EQ(program.code, 0) << program.out;
  EXPECT_NE(program.out.find("phase forward_backward"), std::string::npos);
  EXPECT_NE(program.out.find("phase optimizer"), std::string::npos);
  const Result memory = kiln("memory resnet50 --batch 256 --amp");
  EXPECT_EQ(memory.code, 0) << memory.out;
  EXPECT_NE(memory.out.find("params_f16"), std::string::npos);
  EXPECT_NE(memory.out.find("with reuse"), std::string::npos);
}

// kiln program shows the fusion the Engine would choose on that device: on the CPU none in
// FP32 unless KILN_FUSE_FP32=1 asks for it, as the Engine does.
TEST(Cli, ProgramShowsTheEnginesFusionChoice) {
  const Result plain = kiln("program cnn --device cpu --batch 8");
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_EQ(plain.out.find("cbr_fwd"), std::string::npos) << plain.out;
  EXPECT_NE(plain.out.find("relu_fwd"), std::string::npos) << plain.out;
  const Result fused = kiln_with("KILN_FUSE_FP32=1", "program cnn --device cpu --batch 8");
  ASSERT_EQ(fused.code, 0) << fused.out;
  EXPECT_NE(fused.out.find("cbr_fwd"), std::string::npos) << fused.out;
}

// kiln switches prints switches.def's table with the values in force; a flag given beats its
// variable (the table's rule); a malformed variable stops any command with one error naming
// the variable and what it accepts.
TEST(Cli, SwitchesTableAndItsRule) {
  const Result plain = kiln("switches");
  ASSERT_EQ(plain.code, 0) << plain.out;
  for (const char* v :
       {"KILN_LOG", "KILN_FUSION", "KILN_CUDA_GRAPHS", "KILN_NVJPEG_ROI", "KILN_DIST_TIMEOUT"})
    EXPECT_NE(plain.out.find(v), std::string::npos) << v << "\n" << plain.out;
  EXPECT_NE(plain.out.find("A flag given on the command line wins"), std::string::npos)
      << plain.out;
  auto row = [](const std::string& out, const std::string& variable) {
    const size_t at = out.find("  " + variable + " ");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  const Result off = kiln_with("KILN_FUSION=0 KILN_CBR_FORM=genstats", "switches");
  ASSERT_EQ(off.code, 0) << off.out;
  EXPECT_NE(row(off.out, "KILN_FUSION").find(" 0* "), std::string::npos) << off.out;
  EXPECT_NE(row(off.out, "KILN_CBR_FORM").find(" genstats* "), std::string::npos) << off.out;
  const Result flag = kiln_with("KILN_FUSION=0", "switches --fusion");
  ASSERT_EQ(flag.code, 0) << flag.out;
  EXPECT_NE(row(flag.out, "KILN_FUSION").find(" 1 "), std::string::npos) << "the flag wins\n"
                                                                         << flag.out;
  EXPECT_EQ(kiln("--help-switches").out, plain.out);
  // The rule reaches the program: --fusion over KILN_FUSION=0 fuses, KILN_FUSION=0 alone does not.
  const std::string program = "program cnn --device cpu --batch 8";
  EXPECT_EQ(kiln_with("KILN_FUSE_FP32=1 KILN_FUSION=0", program).out.find("cbr_fwd"),
            std::string::npos);
  EXPECT_NE(kiln_with("KILN_FUSE_FP32=1 KILN_FUSION=0", program + " --fusion").out.find("cbr_fwd"),
            std::string::npos);
  const Result bad = kiln_with("KILN_CBR_FORM=bogus", "plan cnn");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("KILN_CBR_FORM=bogus is not accepted; use one of kiln|genstats"),
            std::string::npos)
      << bad.out;
  // --deterministic is the flag of KILN_DETERMINISTIC, under the same rule.
  EXPECT_NE(
      row(kiln_with("KILN_DETERMINISTIC=1", "switches").out, "KILN_DETERMINISTIC").find(" 1* "),
      std::string::npos);
  const Result det = kiln_with("KILN_DETERMINISTIC=0", "switches --deterministic");
  EXPECT_NE(row(det.out, "KILN_DETERMINISTIC").find(" 1* "), std::string::npos) << "the flag wins\n"
                                                                                << det.out;
  const Result nondet = kiln_with("KILN_DETERMINISTIC=1", "switches --no-deterministic");
  EXPECT_NE(row(nondet.out, "KILN_DETERMINISTIC").find(" 0 "), std::string::npos) << nondet.out;
  const Result bad_bool = kiln_with("KILN_FUSION=maybe", "switches");
  EXPECT_NE(bad_bool.code, 0);
  EXPECT_NE(bad_bool.out.find("KILN_FUSION=maybe"), std::string::npos) << bad_bool.out;
}

TEST(Cli, HelpListsCommandsAndFlags) {
  const Result top = kiln("--help");
  EXPECT_EQ(top.code, 0);
  EXPECT_NE(top.out.find("train"), std::string::npos);
  const Result train = kiln("train --help");
  EXPECT_EQ(train.code, 0);
  EXPECT_NE(train.out.find("--batch-size"), std::string::npos);
  EXPECT_NE(train.out.find("--weight-decay"), std::string::npos);
}

TEST(Cli, UnknownModelIsOneClearError) {
  const Result r = kiln("plan resnet51");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("unknown model 'resnet51'"), std::string::npos) << r.out;
}

TEST(Cli, UnknownFlagNamesTheFlag) {
  const Result r = kiln("train --batchsize 64");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--batchsize"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--batch-size"), std::string::npos)
      << "the error should list the real flags";
}

TEST(Cli, UnknownCommand) {
  const Result r = kiln("trian");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("unknown command 'trian'"), std::string::npos) << r.out;
}

TEST(Cli, ImpossibleShapeNamesTheLayer) {
  // VGG's five 2x2 max-pools take 16 -> 1; the fifth has a 2x2 window over a 1x1 map.
  const Result r = kiln("plan vgg16_bn --image-size 16");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("shape error"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("layer '"), std::string::npos) << r.out;
}

TEST(Cli, BadFlagValues) {
  EXPECT_NE(kiln("memory cnn --batch abc").code, 0);
  const Result r = kiln("train --epochs 0 --output /tmp/kiln-cli-never");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--epochs"), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists("/tmp/kiln-cli-never"))
      << "nothing may be written for a bad run";
}

// kiln bench on the CPU, staging every step (a loader's way) and once (a batch resident on
// the device, PyTorch's reference's way): the same batch, so the same losses; the JSON line
// says which; a mode that does not exist is one clear error, and so is the CUDA profiler
// range on the CPU. The bench says what was fused, and the fused cnn (KILN_FUSE_FP32=1) gives
// the unfused losses.
TEST(Cli, BenchStagesEveryStepOrOnce) {
  const std::string common =
      "bench --model cnn --device cpu --batch 8 --steps 2 --warmup 3 --repeats 1";
  const Result every = kiln(common), once = kiln(common + " --stage once");
  ASSERT_EQ(every.code, 0) << every.out;
  ASSERT_EQ(once.code, 0) << once.out;
  EXPECT_NE(every.out.find("\"stage\":\"every-step\""), std::string::npos) << every.out;
  EXPECT_NE(once.out.find("\"stage\":\"once\""), std::string::npos) << once.out;
  auto losses = [](const std::string& out) {
    const size_t at = out.find("\"first_loss\"");
    return at == std::string::npos ? std::string() : out.substr(at, out.find(",\"world\"") - at);
  };
  EXPECT_FALSE(losses(every.out).empty()) << every.out;
  EXPECT_EQ(losses(every.out), losses(once.out));
  // The CPU fuses in FP32 only when asked: the bench says what was fused.
  EXPECT_NE(every.out.find("fused layers: 0 Conv+BN+ReLU (0 with their max-pool folded in"),
            std::string::npos)
      << every.out;
  {
    const Result fused = kiln_with("KILN_FUSE_FP32=1", common);
    ASSERT_EQ(fused.code, 0) << fused.out;
    EXPECT_NE(fused.out.find("fused layers: 4 Conv+BN+ReLU (2 with their max-pool folded in"),
              std::string::npos)
        << fused.out;
    EXPECT_EQ(losses(fused.out), losses(every.out))
        << "the fused kernels are the unfused ones' arithmetic";
  }
  const Result bad = kiln(common + " --stage twice");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("--stage twice"), std::string::npos) << bad.out;
  // --tf32 allows TF32 in FP32 convolutions and matmuls on a GPU; the CPU has none, so the
  // same losses, and the JSON line says it was asked for.
  const Result tf32 = kiln(common + " --tf32");
  ASSERT_EQ(tf32.code, 0) << tf32.out;
  EXPECT_EQ(losses(tf32.out), losses(every.out));
  EXPECT_NE(tf32.out.find("\"tf32\":true"), std::string::npos) << tf32.out;
  EXPECT_NE(every.out.find("\"tf32\":false"), std::string::npos) << every.out;
  const Result range = kiln(common + " --cuda-profiler-range");
  EXPECT_NE(range.code, 0) << "the profiler range is the CUDA backend's";
  EXPECT_NE(range.out.find("--cuda-profiler-range needs the CUDA backend"), std::string::npos)
      << range.out;
}

TEST(Cli, MissingDataPathSaysWhatWasExpected) {
  const std::string out = testing::TempDir() + "/cli_missing_data";
  const Result r = kiln("train --data mnist --data-dir /nonexistent/mnist --output " + out);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("/nonexistent/mnist"), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(out + "/last.safetensors"));
}

TEST(Cli, RunFileWithUnknownKeyIsRefused) {
  const std::string path = testing::TempDir() + "/bad_run.yaml";
  std::ofstream(path) << "model: cnn\nbatch_sise: 12\n";
  const Result r = kiln("train --config " + path);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("batch-sise"), std::string::npos) << r.out;
}

TEST(Cli, CorruptCheckpointIsRefused) {
  const std::string path = testing::TempDir() + "/corrupt.safetensors";
  std::ofstream(path, std::ios::binary) << "not a safetensors file at all";
  const std::string out = testing::TempDir() + "/cli_corrupt_export.safetensors";
  const Result r = kiln("export --model cnn --checkpoint " + path + " --output " + out);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("corrupt.safetensors"), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(out));
}

// --color-jitter (and its run-file key) reaches the training pipeline, which is then not one
// crop-and-resize: the run says its batches go to the device as float32.
TEST(Cli, ColorJitterFromTheCommandLineAndARunFile) {
  const std::string common =
      "train --model cnn --data synthetic --synthetic-size 32 --batch-size 16 --epochs 1 "
      "--device cpu --workers 1 --progress none --output ";
  const Result flag = kiln(common + testing::TempDir() + "/cli_jitter_flag --color-jitter 0.4");
  ASSERT_EQ(flag.code, 0) << flag.out;
  EXPECT_NE(flag.out.find("float32 to the device (the pipeline is not one crop-and-resize)"),
            std::string::npos)
      << flag.out;
  const std::string path = testing::TempDir() + "/jitter_run.yaml";
  std::ofstream(path) << "color_jitter: [0.4, 0.3, 0.2, 0.1]\n";
  const Result file = kiln(common + testing::TempDir() + "/cli_jitter_file --config " + path);
  ASSERT_EQ(file.code, 0) << file.out;
  EXPECT_NE(file.out.find("float32 to the device"), std::string::npos) << file.out;
  const Result plain = kiln(common + testing::TempDir() + "/cli_jitter_none");
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_NE(plain.out.find("uint8 to the device"), std::string::npos) << plain.out;
  const Result two = kiln(common + testing::TempDir() + "/cli_jitter_two --color-jitter 0.4,0.4");
  EXPECT_NE(two.code, 0);
  EXPECT_NE(two.out.find("--color-jitter '0.4,0.4' has 2 values"), std::string::npos) << two.out;
  const Result hue =
      kiln(common + testing::TempDir() + "/cli_jitter_hue --color-jitter 0.4,0.4,0.4,0.7");
  EXPECT_NE(hue.code, 0);
  EXPECT_NE(hue.out.find("hue in [0, 0.5]"), std::string::npos) << hue.out;
}

// The recipe flags from the command line and as run-file keys: --label-smoothing,
// --clip-grad-norm and --keep-last train, the summary's config records them, and --keep-last 1
// leaves the last epoch's checkpoint beside last and best; --deterministic is accepted.
TEST(Cli, RecipeFlagsFromTheCommandLineAndARunFile) {
  const std::string common =
      "train --model mlp --data synthetic --synthetic-size 32 --batch-size 16 --epochs 2 "
      "--device cpu --workers 1 --progress none --output ";
  auto check = [](const Result& r, const std::string& out) {
    ASSERT_EQ(r.code, 0) << r.out;
    std::stringstream summary;
    summary << std::ifstream(out + "/summary.json").rdbuf();
    EXPECT_NE(summary.str().find("\"clip_grad_norm\":1.5"), std::string::npos) << summary.str();
    EXPECT_NE(summary.str().find("\"label_smoothing\":0.25"), std::string::npos) << summary.str();
    EXPECT_TRUE(std::filesystem::exists(out + "/best.safetensors"));
    EXPECT_TRUE(std::filesystem::exists(out + "/epoch-2.safetensors"));
    EXPECT_FALSE(std::filesystem::exists(out + "/epoch-1.safetensors"));
  };
  const std::string flag_out = testing::TempDir() + "/cli_recipe_flags";
  std::filesystem::remove_all(flag_out);
  check(kiln(common + flag_out +
             " --label-smoothing 0.25 --clip-grad-norm 1.5 --keep-last 1 --deterministic"),
        flag_out);
  const std::string path = testing::TempDir() + "/recipe_run.yaml";
  std::ofstream(path)
      << "label_smoothing: 0.25\nclip_grad_norm: 1.5\nkeep_last: 1\ndeterministic: true\n";
  const std::string file_out = testing::TempDir() + "/cli_recipe_file";
  std::filesystem::remove_all(file_out);
  check(kiln(common + file_out + " --config " + path), file_out);
}

// Mixup and cutmix by torchvision's names, timm's (--mixup, --cutmix) and as run-file keys: the
// run trains and the summary's config records the values under the flags' own names.
TEST(Cli, MixupFlagsAliasesAndRunFileKeys) {
  const std::string common =
      "train --model mlp --data synthetic --synthetic-size 32 --batch-size 16 --epochs 1 "
      "--device cpu --workers 1 --progress none --output ";
  auto check = [](const Result& r, const std::string& out) {
    ASSERT_EQ(r.code, 0) << r.out;
    std::stringstream summary;
    summary << std::ifstream(out + "/summary.json").rdbuf();
    for (const char* want : {"\"mixup_alpha\":0.2", "\"cutmix_alpha\":1", "\"mixup_prob\":0.9",
                             "\"mixup_switch_prob\":0.3"}) {
      EXPECT_NE(summary.str().find(want), std::string::npos) << want << " in " << summary.str();
    }
  };
  const std::string tv = testing::TempDir() + "/cli_mix_torchvision";
  std::filesystem::remove_all(tv);
  check(kiln(common + tv +
             " --mixup-alpha 0.2 --cutmix-alpha 1 --mixup-prob 0.9 --mixup-switch-prob 0.3"),
        tv);
  const std::string timm = testing::TempDir() + "/cli_mix_timm";
  std::filesystem::remove_all(timm);
  check(kiln(common + timm + " --mixup 0.2 --cutmix=1 --mixup-prob 0.9 --mixup-switch-prob 0.3"),
        timm);
  const std::string path = testing::TempDir() + "/mix_run.yaml";
  std::ofstream(path) << "mixup_alpha: 0.2\ncutmix: 1\nmixup_prob: 0.9\nmixup_switch_prob: 0.3\n";
  const std::string file_out = testing::TempDir() + "/cli_mix_file";
  std::filesystem::remove_all(file_out);
  check(kiln(common + file_out + " --config " + path), file_out);
  const Result help = kiln("train --help");
  EXPECT_NE(help.out.find("(also --mixup)"), std::string::npos) << help.out;
}

}  // namespace
