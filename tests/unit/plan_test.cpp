// ArchPlan: shape inference, its errors, and each pass.
#include <gtest/gtest.h>

#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/plan/arch_plan.h"

namespace kiln {
namespace {

const PlanNode& node_of(const ArchPlan& p, int id) {
  for (const PlanNode& n : p.nodes)
    if (n.id == id) return n;
  ADD_FAILURE() << "no node " << id;
  return p.nodes.front();
}

BluePrint tiny(Layer root, InputSpec in = {8, 8, 3}, int classes = 4) {
  return BluePrint{"tiny", in, classes, root};
}

template <typename F>
std::string error_of(F f, ErrorKind kind) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(Plan, ShapesFollowTheLayers) {
  const ArchPlan p =
      make_plan(tiny(seq(conv(16, 3, 2, 1), bn2d(), relu(), maxpool(2, 2), gap(), fc(4))));
  std::vector<Shape> shapes;
  for (const PlanNode* n : p.live()) shapes.push_back(n->shape);
  ASSERT_EQ(shapes.size(), 8u);  // input, conv, bn, relu, pool, gap, fc, loss
  EXPECT_EQ(shapes[1], (Shape{4, 4, 16}));
  EXPECT_EQ(shapes[4], (Shape{2, 2, 16}));
  EXPECT_EQ(shapes[5], (Shape{16}));
  EXPECT_EQ(shapes[6], (Shape{4}));
}

TEST(Plan, KernelLargerThanInputNamesTheLayer) {
  const std::string msg = error_of(
      [] {
        make_plan(tiny(seq(conv(8, 3).named("stem"), gap(), fc(4)), {2, 2, 3}));
      },
      ErrorKind::Shape);
  EXPECT_NE(msg.find("'stem'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("larger than the padded input"), std::string::npos) << msg;
}

TEST(Plan, ZeroChannelsIsAnError) {
  error_of([] { make_plan(tiny(seq(conv(0, 3, 1, 1), gap(), fc(4)))); }, ErrorKind::Shape);
  error_of(
      [] {
        make_plan(tiny(seq(conv(8, 3, 1, 1), gap(), fc(4)), {8, 8, 0}));
      },
      ErrorKind::Shape);
}

TEST(Plan, FcNeedsAFlatInput) {
  const std::string msg = error_of(
      [] { make_plan(tiny(seq(conv(8, 3, 1, 1), fc(4).named("head")))); }, ErrorKind::Shape);
  EXPECT_NE(msg.find("flatten"), std::string::npos);
}

TEST(Plan, TheModelMustEndInOneLogitPerClass) {
  const std::string msg = error_of([] { make_plan(tiny(seq(gap(), fc(5)))); }, ErrorKind::Shape);
  EXPECT_NE(msg.find("fc(4)"), std::string::npos) << msg;
}

TEST(Plan, ResidualShapesMustAgree) {
  const std::string msg = error_of(
      [] { make_plan(tiny(seq(residual(seq(conv(8, 3, 2, 1)), identity()), gap(), fc(4)))); },
      ErrorKind::Shape);
  EXPECT_NE(msg.find("downsample"), std::string::npos);
}

TEST(Plan, DropIdentitiesRemovesNoOps) {
  const ArchPlan p =
      make_plan(tiny(seq(conv(8, 3, 1, 1), identity(), dropout(0.0f), gap(), flatten(), fc(4))));
  for (const PlanNode* n : p.live()) {
    EXPECT_NE(n->op, PlanOp::Identity);
    EXPECT_NE(n->op, PlanOp::Dropout);
    EXPECT_NE(n->op, PlanOp::Flatten);  // flatten of an already flat [C] is a no-op
  }
  // The fc now reads the gap directly.
  const auto live = p.live();
  EXPECT_EQ(live[live.size() - 2]->op, PlanOp::FC);
  EXPECT_EQ(p.nodes[static_cast<size_t>(live[live.size() - 2]->inputs[0])].op,
            PlanOp::GlobalAvgPool);
}

TEST(Plan, AdaptivePoolIsIdentityAtSevenBySeven) {
  const ArchPlan p = make_plan(make_model("vgg16_bn"));
  for (const PlanNode* n : p.live()) EXPECT_NE(n->name, "avgpool");
}

TEST(Plan, FirstLayerComputesNoInputGradient) {
  const ArchPlan p = make_plan(make_model("resnet18"));
  int firsts = 0;
  for (const PlanNode* n : p.live()) {
    if (n->first_layer) {
      ++firsts;
      EXPECT_EQ(n->name, "conv1");
    }
  }
  EXPECT_EQ(firsts, 1);
  EXPECT_FALSE(p.nodes[0].requires_grad);  // the input
}

TEST(Plan, MergePassesRunOnlyWhenTheBackendFuses) {
  PlanOptions off;
  off.amp = true;
  const ArchPlan a = make_plan(make_model("resnet50"), off);
  for (const PlanNode* n : a.live()) EXPECT_NE(n->op, PlanOp::CBR);
  PlanOptions on = off;
  on.backend_fuses_cbr = on.backend_fuses_bn_add_relu = true;
  const ArchPlan b = make_plan(make_model("resnet50"), on);
  int cbr = 0, bar = 0;
  for (const PlanNode* n : b.live()) {
    cbr += n->op == PlanOp::CBR;
    bar += n->op == PlanOp::BnAddReLU;
    if (n->name == "conv1")
      EXPECT_EQ(n->op, PlanOp::CBR) << "the 7x7 stem with 3 input channels fuses too";
  }
  // ResNet-50: the stem and 16 blocks x 2 inner Conv+BN+ReLU; every block's tail is BN+add+ReLU.
  EXPECT_EQ(cbr, 33);
  EXPECT_EQ(bar, 16);
  EXPECT_EQ(count_parameters(a), count_parameters(b));
  PlanOptions nofuse = on;
  nofuse.fusion = false;
  const ArchPlan unfused = make_plan(make_model("resnet50"), nofuse);
  for (const PlanNode* n : unfused.live()) EXPECT_NE(n->op, PlanOp::CBR);
}

// The fallback: a Conv+BN+ReLU whose output channels are not a multiple of 8 stays unfused,
// and the plan's notes say which layer and why; its neighbour with 16 fuses.
TEST(Plan, CbrWithOddOutputChannelsStaysUnfused) {
  PlanOptions on;
  on.amp = true;
  on.backend_fuses_cbr = on.backend_fuses_bn_add_relu = true;
  const ArchPlan p = make_plan(
      tiny(seq(conv(5, 3, 1, 1), bn2d(), relu(), conv(16, 3, 1, 1), bn2d(), relu(), gap(), fc(4))),
      on);
  int cbr = 0, conv_left = 0;
  for (const PlanNode* n : p.live()) {
    cbr += n->op == PlanOp::CBR;
    conv_left += n->op == PlanOp::Conv;
  }
  EXPECT_EQ(cbr, 1);
  EXPECT_EQ(conv_left, 1);
  bool noted = false;
  for (const std::string& note : p.notes) {
    noted = noted || (note.find("unfused") != std::string::npos &&
                      note.find("5 output channels") != std::string::npos);
  }
  EXPECT_TRUE(noted) << "the notes name the layer and the reason";
}

// merge_cbr_pool: a max-pool whose windows tile a CBR's output folds into it (the pooled
// shape becomes the CBR's output, conv_shape() the convolution's); an overlapping pool, one
// that does not tile the map, and one after a plain conv stay; the pass is off without the
// backend's fused form or with fusion off.
TEST(Plan, MaxPoolThatTilesACbrFoldsIntoIt) {
  PlanOptions on;
  on.amp = true;
  on.backend_fuses_cbr = on.backend_fuses_cbr_pool = on.backend_fuses_bn_add_relu = true;
  const Layer model = seq(conv(16, 3, 1, 1), bn2d(), relu(), maxpool(2, 2),  // folds: 16x16 -> 8x8
                          conv(16, 3, 1, 1), bn2d(), relu(), maxpool(3, 2, 1),  // overlaps: stays
                          conv(8, 3, 1, 1), bn2d(), relu(), maxpool(3, 3, 1),   // padded: stays
                          conv(8, 1, 1, 0), maxpool(2, 2),                      // no CBR: stays
                          gap(), fc(4));
  const ArchPlan p = make_plan(tiny(model, {16, 16, 3}), on);
  int pooled = 0, pools_left = 0;
  for (const PlanNode* n : p.live()) {
    pools_left += n->op == PlanOp::MaxPool;
    if (n->op == PlanOp::CBR && n->pool) {
      ++pooled;
      EXPECT_EQ(n->pool, 2);
      EXPECT_EQ(n->shape, (Shape{8, 8, 16}));
      EXPECT_EQ(n->conv_shape(), (Shape{16, 16, 16}));
    }
  }
  EXPECT_EQ(pooled, 1);
  EXPECT_EQ(pools_left, 3);
  bool noted = false;
  for (const std::string& note : p.notes)
    noted = noted || note.find("do not tile") != std::string::npos;
  EXPECT_TRUE(noted) << "the notes say which pool stays apart and why";
  EXPECT_NE(describe_plan(p).find("(max-pool 2x2)"), std::string::npos);
  for (auto off : {&PlanOptions::backend_fuses_cbr_pool, &PlanOptions::fusion}) {
    PlanOptions o = on;
    o.*off = false;
    const ArchPlan apart = make_plan(tiny(model, {16, 16, 3}), o);
    for (const PlanNode* n : apart.live()) EXPECT_EQ(n->pool, 0);
  }
  // VGG16-BN: each of its five blocks ends in a CBR and a 2x2 / 2 pool.
  int vgg = 0;
  const ArchPlan vgg16 = make_plan(make_model("vgg16_bn"), on);
  for (const PlanNode* n : vgg16.live()) vgg += n->pool != 0;
  EXPECT_EQ(vgg, 5);
}

// merge_cbr_pool with backend_fuses_overlapping_pool: overlapping and padded pools after a CBR
// fold in too, keeping their stride and padding, the convolution's shape in pool_in (it cannot
// be had back from the pooled one); a pool after a plain conv still stays; ResNet-50's stem
// pool folds, and is the only one. Without the option the same model keeps them (the test
// above).
TEST(Plan, OverlappingMaxPoolFoldsWhereTheBackendHasTheForm) {
  PlanOptions on;
  on.amp = true;
  on.backend_fuses_cbr = on.backend_fuses_cbr_pool = on.backend_fuses_bn_add_relu = true;
  on.backend_fuses_overlapping_pool = true;
  const Layer model = seq(conv(16, 3, 1, 1), bn2d(), relu(), maxpool(2, 2),     // tiles: 16 -> 8
                          conv(16, 3, 1, 1), bn2d(), relu(), maxpool(3, 2, 1),  // 8 -> 4
                          conv(8, 3, 1, 1), bn2d(), relu(), maxpool(3, 3, 1),   // 4 -> 2
                          conv(8, 1, 1, 0), maxpool(2, 2),                      // no CBR: stays
                          gap(), fc(4));
  const ArchPlan p = make_plan(tiny(model, {16, 16, 3}), on);
  std::vector<const PlanNode*> pooled;
  int pools_left = 0;
  for (const PlanNode* n : p.live()) {
    pools_left += n->op == PlanOp::MaxPool;
    if (n->op == PlanOp::CBR && n->pool) pooled.push_back(n);
  }
  ASSERT_EQ(pooled.size(), 3u);
  EXPECT_EQ(pools_left, 1);
  EXPECT_EQ(pooled[0]->pool_stride, 2);
  EXPECT_EQ(pooled[0]->pool_pad, 0);
  EXPECT_EQ(pooled[1]->pool, 3);
  EXPECT_EQ(pooled[1]->pool_stride, 2);
  EXPECT_EQ(pooled[1]->pool_pad, 1);
  EXPECT_EQ(pooled[1]->shape, (Shape{4, 4, 16}));
  EXPECT_EQ(pooled[1]->conv_shape(), (Shape{8, 8, 16}));
  EXPECT_EQ(pooled[2]->pool_stride, 3);
  EXPECT_EQ(pooled[2]->shape, (Shape{2, 2, 8}));
  EXPECT_EQ(pooled[2]->conv_shape(), (Shape{4, 4, 8}));
  EXPECT_NE(describe_plan(p).find("(max-pool 3x3 s2 p1)"), std::string::npos);
  // A 2x2 / 2 pool whose map (5x5) it does not divide is neither form: it stays.
  const ArchPlan odd = make_plan(
      tiny(seq(conv(8, 3, 1, 1), bn2d(), relu(), maxpool(2, 2), gap(), fc(4)), {5, 5, 3}), on);
  for (const PlanNode* n : odd.live()) EXPECT_EQ(n->pool, 0) << n->name;
  int stems = 0;
  const ArchPlan r50 = make_plan(make_model("resnet50"), on);
  for (const PlanNode* n : r50.live()) {
    if (n->pool == 0) continue;
    ++stems;
    EXPECT_EQ(n->shape, (Shape{56, 56, 64})) << n->shape.str();
    EXPECT_EQ(n->conv_shape(), (Shape{112, 112, 64})) << n->conv_shape().str();
  }
  EXPECT_EQ(stems, 1);
}

// merge_bn_add_relu with backend_fuses_residual_bn: in ResNet-50 the four downsampling blocks'
// shortcut BatchNorms fold into their BN+add+ReLU (the residual input is then the shortcut's
// convolution), the twelve identity blocks keep theirs as they were; without the option none
// folds and the shortcut BatchNorms stay as nodes.
TEST(Plan, ShortcutBatchNormFoldsIntoBnAddRelu) {
  PlanOptions on;
  on.amp = true;
  on.backend_fuses_cbr = on.backend_fuses_cbr_pool = on.backend_fuses_bn_add_relu = true;
  on.backend_fuses_residual_bn = true;
  const ArchPlan p = make_plan(make_model("resnet50"), on);
  int folded = 0, bars = 0, bns = 0;
  for (const PlanNode* n : p.live()) {
    bns += n->op == PlanOp::BatchNorm;
    if (n->op != PlanOp::BnAddReLU) continue;
    ++bars;
    if (n->res_bn_name.empty()) continue;
    ++folded;
    EXPECT_NE(n->res_bn_name.find("downsample"), std::string::npos) << n->res_bn_name;
    EXPECT_EQ(node_of(p, n->inputs[1]).op, PlanOp::Conv) << n->name;
  }
  EXPECT_EQ(bars, 16);
  EXPECT_EQ(folded, 4);
  EXPECT_EQ(bns, 0);
  EXPECT_NE(describe_plan(p).find("(residual)"), std::string::npos);
  PlanOptions off = on;
  off.backend_fuses_residual_bn = false;
  const ArchPlan q = make_plan(make_model("resnet50"), off);
  int kept = 0;
  for (const PlanNode* n : q.live()) {
    kept += n->op == PlanOp::BatchNorm;
    if (n->op == PlanOp::BnAddReLU) EXPECT_TRUE(n->res_bn_name.empty());
  }
  EXPECT_EQ(kept, 4);
}

TEST(Plan, DescribeListsLayersAndPasses) {
  const std::string s = describe_plan(make_plan(make_model("resnet50")));
  EXPECT_NE(s.find("layer4.2.conv3"), std::string::npos);
  EXPECT_NE(s.find("25557032 parameters"), std::string::npos);
  EXPECT_NE(s.find("pass: mark_first_layer"), std::string::npos);
}

}  // namespace
}  // namespace kiln
