// Run files: YAML and JSON become the same ordered (flag, value) pairs; everything that is
// not a flat mapping of scalars or scalar lists is one Error(Config) naming the file and line.
#include <gtest/gtest.h>

#include "kiln/core/error.h"
#include "kiln/io/run_file.h"
#include "unit/io_test_util.h"

namespace kiln {
namespace {

using Pairs = RunOptions;

// Parses `text`, expects Error(Config), and checks the message names the file and holds each
// of `pieces`.
void expect_config_error(const std::string& text, std::initializer_list<const char*> pieces) {
  try {
    const auto opts = parse_run_file(text, "cfg/run.yaml");
    ADD_FAILURE() << "accepted:\n" << text;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("run file 'cfg/run.yaml'"), std::string::npos) << msg;
    for (const char* p : pieces)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

TEST(IoRunFile, ParsesYamlInFileOrder) {
  const std::string yaml =
      "# ResNet-50 on ImageNet\n"
      "model: resnet50\n"
      "batch_size: 256        # underscores become dashes\n"
      "lr: 0.1\n"
      "weight-decay: 1e-4     # kept as written, not reformatted\n"
      "amp: true\n"
      "milestones: [30, 60, 80]\n"
      "data: \"/data/imagenet, v2\"\n"
      "output: 'runs/r50'\n"
      "--seed: 42\n"
      "mean:\n"
      "  - 0.485\n"
      "  - 0.456\n"
      "  - 0.406\n"
      "label_smoothing: .1\n";
  const Pairs expected = {
      {"model", "resnet50"},          {"batch-size", "256"},    {"lr", "0.1"},
      {"weight-decay", "1e-4"},       {"amp", "true"},          {"milestones", "30,60,80"},
      {"data", "/data/imagenet, v2"}, {"output", "runs/r50"},   {"seed", "42"},
      {"mean", "0.485,0.456,0.406"},  {"label-smoothing", ".1"}};
  EXPECT_EQ(parse_run_file(yaml, "r.yaml"), expected);
}

TEST(IoRunFile, ParsesJsonToTheSamePairs) {
  const std::string json = R"({
    "model": "resnet50",
    "batch_size": 256,
    "lr": 0.1,
    "weight-decay": 1e-4,
    "amp": true,
    "milestones": [30, 60, 80],
    "schedule": []
  })";
  const Pairs expected = {
      {"model", "resnet50"}, {"batch-size", "256"},      {"lr", "0.1"},   {"weight-decay", "1e-4"},
      {"amp", "true"},       {"milestones", "30,60,80"}, {"schedule", ""}};
  EXPECT_EQ(parse_run_file(json, "r.json"), expected);
}

TEST(IoRunFile, EmptyFileMeansNoOptions) {
  EXPECT_TRUE(parse_run_file("", "e.yaml").empty());
  EXPECT_TRUE(parse_run_file("# only a comment\n\n", "e.yaml").empty());
  EXPECT_TRUE(parse_run_file("{}", "e.json").empty());
}

TEST(IoRunFile, RejectsNestedMappingWithLine) {
  expect_config_error("model: resnet50\nepochs: 90\noptimizer:\n  name: sgd\n  momentum: 0.9\n",
                      {"line 3", "option 'optimizer' is a nested mapping", "--optimizer VALUE"});
  expect_config_error("{\n  \"lr\": 0.1,\n  \"sched\": {\"kind\": \"cosine\"}\n}",
                      {"line 3", "option 'sched' is a nested mapping"});
  expect_config_error("milestones: [30, {a: 1}]\n",
                      {"line 1", "option 'milestones' is a nested mapping"});
}

TEST(IoRunFile, RejectsOtherShapes) {
  expect_config_error("milestones: [[30, 60], [90]]\n", {"line 1", "a list inside a list"});
  expect_config_error("tags: ['a,b', c]\n", {"list item 'a,b'", "contains a comma"});
  expect_config_error("epochs: 90\nresume:\n",
                      {"line 2", "option 'resume' has no value", "'resume: true'"});
  expect_config_error("resume: ~\n", {"option 'resume' has no value"});
  expect_config_error("- lr\n- 0.1\n", {"line 1", "the top level is a list", "option: value"});
  expect_config_error("just words\n", {"the top level is a scalar"});
  expect_config_error("lr: 0.1\n---\nlr: 0.2\n", {"more than one YAML document"});
  expect_config_error("batch size: 3\n",
                      {"line 1", "'batch size' is not an option name", "batch-size: 256"});
  expect_config_error("? [a, b]\n: 1\n", {"an option name is a list"});
}

TEST(IoRunFile, RejectsTheSameOptionTwice) {
  expect_config_error("lr: 0.1\nbatch_size: 64\nepochs: 3\nbatch-size: 128\n",
                      {"line 4", "option 'batch-size' is given again (first on line 2"});
}

TEST(IoRunFile, SyntaxErrorsNameTheLine) {
  expect_config_error("model: resnet50\nmilestones: [30, 60\nlr: 0.1\n",
                      {"not valid YAML or JSON", "line "});
  expect_config_error("a: b: c\n", {"line 1", "not valid YAML or JSON (column 5)"});
  expect_config_error("{\"lr\": 0.1,\n \"epochs\" 90}\n", {"line 2", "not valid YAML or JSON"});
  expect_config_error("epochs: 90\n  bad: indent\n", {"line 2", "not valid YAML or JSON"});
  expect_config_error("lr: 0.1\n]\n", {"line 2", "not valid YAML or JSON"});
  expect_config_error("x: *nowhere\n", {"not valid YAML or JSON"});
}

TEST(IoRunFile, StrayTokensAreErrorsNotHangs) {
  // yaml-cpp 0.7's LoadAll loops forever on these and Load reads them as an empty file (found
  // by the fuzzer); each must be a prompt syntax error instead.
  expect_config_error(",", {"line 1", "(column 1): unexpected ','"});
  expect_config_error(",# comment", {"unexpected ','"});
  expect_config_error("]\n", {"line 1", "not valid YAML or JSON"});
  expect_config_error("lr: 0.1\n...\n,\n", {"line 3", "unexpected ','"});
  expect_config_error("[1]\n]\n", {"not valid YAML or JSON"});
}

TEST(IoRunFile, ReadsAFileAndNamesAMissingOne) {
  test::ScratchDir dir;
  const std::string path = dir.file("run.yaml");
  test::spit(path, "epochs: 2\nlr: [0.1, 0.01]\n");
  EXPECT_EQ(read_run_file(path), (Pairs{{"epochs", "2"}, {"lr", "0.1,0.01"}}));
  test::spit(path, "epochs: 2\nopt:\n  lr: 1\n");
  try {
    read_run_file(path);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config);
    EXPECT_NE(std::string(e.what()).find("run file '" + path +
                                         "', line 2: option 'opt' is a nested mapping"),
              std::string::npos)
        << e.what();
  }
  try {
    read_run_file(dir.file("missing.yaml"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Config);
    EXPECT_NE(std::string(e.what()).find(dir.file("missing.yaml")), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln
