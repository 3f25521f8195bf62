// The zoo against torchvision: every parameter and buffer name and shape of each ImageNet
// model equals torchvision 0.14's state_dict (fixtures in tests/data, written by
// torchvision itself), and the parameter counts match.
#include "kiln/blueprint/zoo.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "kiln/core/error.h"
#include "kiln/graph/compiler.h"
#include "kiln/plan/arch_plan.h"

namespace kiln {
namespace {

std::map<std::string, std::vector<int64_t>> read_fixture(const std::string& model,
                                                         int64_t* params) {
  std::ifstream in(std::string(KILN_SOURCE_DIR) + "/tests/data/torchvision_" + model +
                   "_state_dict.txt");
  EXPECT_TRUE(in.good()) << model;
  std::map<std::string, std::vector<int64_t>> out;
  std::string line;
  std::getline(in, line);
  *params = std::stoll(line.substr(line.rfind(' ') + 1));
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string name;
    ls >> name;
    std::vector<int64_t> shape;
    int64_t d;
    while (ls >> d) shape.push_back(d);
    out[name] = shape;
  }
  return out;
}

class ZooTorchvision : public ::testing::TestWithParam<std::string> {};

TEST_P(ZooTorchvision, NamesShapesAndCountMatchTorchvision) {
  const std::string model = GetParam();
  int64_t expected_params = 0;
  const auto expected = read_fixture(model, &expected_params);
  const ArchPlan plan = make_plan(make_model(model));
  EXPECT_EQ(count_parameters(plan), expected_params);
  CompileOptions o;
  o.batch = 2;
  const Program p = lower_program(plan, o);
  std::map<std::string, std::vector<int64_t>> got;
  int64_t total = 0;
  for (const ParamDesc& d : p.params) {
    got[d.name] = d.torch_shape.dims;
    total += d.shape.numel();
  }
  std::set<std::string> bns;
  for (const BufferDesc& b : p.buffers) {
    got[b.name] = p.tensor(b.tensor).shape.dims;
    bns.insert(b.name.substr(0, b.name.rfind('.')));
  }
  for (const std::string& bn : bns) got[bn + ".num_batches_tracked"] = {};
  EXPECT_EQ(total, expected_params);
  for (const auto& [name, shape] : expected) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << model << " lacks torchvision's " << name;
    EXPECT_EQ(it->second, shape) << name;
  }
  EXPECT_EQ(got.size(), expected.size()) << "kiln has names torchvision does not";
}

INSTANTIATE_TEST_SUITE_P(Zoo, ZooTorchvision,
                         ::testing::Values("resnet18", "resnet34", "resnet50", "vgg11_bn",
                                           "vgg16_bn"));

TEST(Zoo, EveryModelPlansInBothForms) {
  for (const std::string& name : zoo_model_names()) {
    for (const std::string& form : {std::string("small"), std::string("imagenet")}) {
      ZooOptions o;
      o.form = form;
      if (form == "imagenet" && (name == "mlp" || name == "lenet" || name == "cnn"))
        o.image_size = 224;
      const BluePrint bp = make_model(name, o);
      const ArchPlan plan = make_plan(bp);
      EXPECT_GT(count_parameters(plan), 0) << name << " " << form;
      EXPECT_EQ(plan.nodes.back().op, PlanOp::SoftmaxCE) << name;
    }
  }
}

TEST(Zoo, SmallFormsTakeSmallInputs) {
  EXPECT_EQ(make_model("resnet18_small").input.height, 32);
  EXPECT_EQ(make_model("resnet18_small").input.channels, 3);
  EXPECT_EQ(make_model("cnn").input.height, 28);
  EXPECT_EQ(make_model("cnn").input.channels, 1);
  EXPECT_EQ(make_model("resnet50").input.height, 224);
  EXPECT_EQ(make_model("resnet50").num_classes, 1000);
  ZooOptions o;
  o.num_classes = 100;
  EXPECT_EQ(make_model("vgg16_bn_small", o).num_classes, 100);
}

TEST(Zoo, UnknownModelNamesTheZoo) {
  try {
    make_model("resnet51");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Model);
    EXPECT_NE(std::string(e.what()).find("resnet51"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("resnet50"), std::string::npos);
  }
}

}  // namespace
}  // namespace kiln
