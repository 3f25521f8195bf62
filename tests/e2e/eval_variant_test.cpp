// Evaluation at its own crop size on the CPU (issue 18, SPEC S26): the evaluation variant equals
// a fresh engine compiled at the val size with the same weights (bit for bit: the same kernels
// over the same values), holds no gradient, optimizer or backward memory and shares the weight
// regions in place; size-dependent models are refused; a JPEG-folder run that trains at one crop
// and evaluates at another reports the evaluation that `kiln eval` gives at that crop.
// The CUDA counterpart is gpu/gpu_eval_variant_test.cpp.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "kiln/core/error.h"
#include "kiln/task/trainer.h"
#include "support/cli_run.h"
#include "support/eval_variant_check.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

TEST(EvalVariant, EqualsAFreshEngineAtTheValSize) {
  test::check_variant_equals_fresh_engine("cpu", false, "resnet18_small", 16, 24, 0.0);
}

// The training regions exist in the owner (so that their absence below says something) and
// none of them in the variant: no tensor, no bytes, no node touching one.
TEST(EvalVariant, HoldsNoTrainingStateAndSharesTheWeights) {
  const EngineOptions o = test::variant_test_options("cpu", false);
  Engine owner(test::model_at("resnet18_small", 16), o);
  owner.lock_memory();
  owner.compile(3);
  const BluePrint val_bp = test::model_at("resnet18_small", 24);
  auto variant = owner.eval_variant(val_bp);
  const Program& vp = variant->program();
  const Program& op = owner.program();
  EXPECT_TRUE(vp.options.eval_only);
  EXPECT_TRUE(vp.train.empty());
  EXPECT_FALSE(vp.eval.empty());
  EXPECT_FALSE(vp.eval_ema.empty());
  const Region training[] = {Region::grads_f32, Region::moment1, Region::bn_saved, Region::input_b};
  for (Region r : training) {
    SCOPED_TRACE(region_name(r));
    EXPECT_GT(op.memory.region_bytes[static_cast<size_t>(r)], 0);
    EXPECT_EQ(vp.memory.region_bytes[static_cast<size_t>(r)], 0);
    for (const DTensor& t : vp.tensors) EXPECT_NE(t.region, r) << t.name;
  }
  for (Region r : {Region::grads_f16, Region::moment2})
    EXPECT_EQ(vp.memory.region_bytes[static_cast<size_t>(r)], 0) << region_name(r);
  // The weight regions are the owner's memory; the activations are the variant's own.
  for (Region r :
       {Region::params_f32, Region::ema_f32, Region::bn_running, Region::ema_bn_running}) {
    EXPECT_NE(variant->backend().region_memory(r), nullptr) << region_name(r);
    EXPECT_EQ(variant->backend().region_memory(r), owner.backend().region_memory(r))
        << region_name(r);
  }
  EXPECT_NE(variant->backend().region_memory(Region::features),
            owner.backend().region_memory(Region::features));
  // Forward activations only: fewer bytes than a training program at the same size, whose
  // features hold the backward's saved tensors and gradients too.
  Engine fresh(val_bp, o);
  fresh.lock_memory();
  const auto features = static_cast<size_t>(Region::features);
  EXPECT_LT(vp.memory.region_bytes[features], fresh.program().memory.region_bytes[features]);
}

TEST(EvalVariant, RefusesSizeDependentModelsAndTraining) {
  EngineOptions o = test::variant_test_options("cpu", false);
  Engine cnn(test::model_at("cnn", 28), o);
  cnn.lock_memory();
  EXPECT_NE(cnn.eval_variant_mismatch(test::model_at("cnn", 32)).find("'fc.weight' is [10, 3136]"),
            std::string::npos);
  EXPECT_EQ(cnn.eval_variant_mismatch(test::model_at("cnn", 28)), "");
  cnn.compile(1);
  try {
    cnn.eval_variant(test::model_at("cnn", 32));
    ADD_FAILURE() << "a variant of the flattening CNN at another size was made";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("model 'cnn' cannot evaluate at 32x32 with the weights it has at 28x28"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("evaluate at 28x28"), std::string::npos) << m;
  }
  // Globally pooled models have the same weights at every size: the ResNets (global average
  // pool) and the ImageNet VGGs (adaptive average pool to 7x7).
  Engine resnet(test::model_at("resnet18_small", 32), o);
  resnet.lock_memory();
  EXPECT_EQ(resnet.eval_variant_mismatch(test::model_at("resnet18_small", 40)), "");
  // The VGGs' adaptive pool takes a final map that is a multiple of 7 (224, 448): no other size.
  Engine vgg(test::model_at("vgg11_bn", 224), o);
  vgg.lock_memory();
  EXPECT_EQ(vgg.eval_variant_mismatch(test::model_at("vgg11_bn", 448)), "");
  EXPECT_NE(vgg.eval_variant_mismatch(test::model_at("vgg11_bn", 256)).find("multiple of 7"),
            std::string::npos);
  // The small VGG flattens its last map into the classifier.
  Engine vgg_small(test::model_at("vgg11_bn_small", 32), o);
  vgg_small.lock_memory();
  EXPECT_NE(vgg_small.eval_variant_mismatch(test::model_at("vgg11_bn_small", 64)), "");

  resnet.compile(1);
  auto variant = resnet.eval_variant(test::model_at("resnet18_small", 40));
  EXPECT_TRUE(variant->is_eval_variant());
  const test::LearnableBatch b = test::learnable_batch(test::model_at("resnet18_small", 40), 4, 1);
  EXPECT_THROW(variant->train_step(b.images.data(), b.labels.data(), 0.1f), Error);
  const std::string w = resnet.program().params[0].name;
  EXPECT_THROW(variant->write_param(w, resnet.read_param(w)), Error);
  EXPECT_EQ(variant->read_param(w), resnet.read_param(w));  // the same bytes
  EXPECT_THROW(variant->eval_variant(test::model_at("resnet18_small", 48)), Error);
}

bool plan_fuses(const Engine& e) {
  for (const PlanNode* n : e.plan().live()) {
    if (n->op == PlanOp::CBR || n->op == PlanOp::BnAddReLU) return true;
  }
  return false;
}

// Data parallel with SyncBN leaves BatchNorm unfused, and a fused layer declares its parameters
// in another order than the unfused ones: the variant is planned as its owner (world and SyncBN
// kept), so its weights lie where the owner's do.
TEST(EvalVariant, PlannedAsItsOwnerUnderSyncBn) {
  for (const char* model : {"resnet18_small", "resnet50"}) {
    SCOPED_TRACE(model);
    EngineOptions o = test::variant_test_options("cpu", false);
    o.switches.fusion = true;
    o.switches.fuse_fp32 = Auto::on;
    Engine single(test::model_at(model, 64), o);
    EXPECT_TRUE(plan_fuses(single));  // the default variant would fuse
    o.compile.world = 2;
    o.compile.sync_bn = true;
    Engine owner(test::model_at(model, 64), o);
    EXPECT_FALSE(plan_fuses(owner));
    owner.lock_memory();
    EXPECT_EQ(owner.eval_variant_mismatch(test::model_at(model, 96)), "");
  }
}

std::string fresh_dir(const std::string& name) {
  const std::string d = testing::TempDir() + "/kiln_eval_variant_" + name;
  fs::remove_all(d);
  return d;
}

// torchvision's FixRes recipe in small: train at 16, evaluate at 20 after a resize to 24. The
// run's last evaluation (through the variant) equals `kiln eval` of its checkpoint compiled at
// 20 - live and EMA weights - and the summary names both sizes.
TEST(EvalVariant, FolderRunTrainsAtOneCropAndEvaluatesAtAnother) {
  const std::string data = fresh_dir("data");
  test::write_jpeg_folder(data);
  TrainConfig c;
  c.model = "resnet18_small";
  c.data = "folder";
  c.data_dir = data;
  c.image_size = 16;
  c.val_crop_size = 20;
  c.val_resize_size = 24;
  c.random_resized_crop = true;
  c.batch_size = 4;
  c.epochs = 2;
  c.lr.kind = "constant";
  c.lr.base_lr = 0.05f;
  c.ema = true;
  c.ema_decay = 0.5f;
  c.workers = 1;
  c.device = "cpu";
  c.progress = "none";
  c.output = fresh_dir("run");
  const TrainSummary s = train(c);
  EXPECT_EQ(s.epochs_run, 2);
  EXPECT_EQ(s.train_crop_size, 16);
  EXPECT_EQ(s.eval_crop_size, 20);
  std::ifstream f(c.output + "/summary.json");
  std::stringstream js;
  js << f.rdbuf();
  EXPECT_NE(js.str().find("\"train_crop_size\":16,\"eval_crop_size\":20"), std::string::npos)
      << js.str();

  TrainConfig e = c;
  e.init_from = c.output + "/last.safetensors";
  e.ema = false;
  const TrainSummary live = evaluate(e);
  EXPECT_EQ(live.eval_crop_size, 20);
  EXPECT_EQ(live.final_loss, s.final_loss);
  EXPECT_EQ(live.final_top1, s.final_top1);
  EXPECT_EQ(live.final_top5, s.final_top5);
  e.ema = true;
  EXPECT_EQ(evaluate(e).final_top1, s.ema_top1);
  // The same weights at the training crop give another loss: the run evaluated at 20.
  e.ema = false;
  e.val_crop_size = 16;
  EXPECT_NE(evaluate(e).final_loss, s.final_loss);
}

// `kiln memory --eval-only` prints the variant's plan: weights and forward activations, none of
// the training step's regions (which the plain plan of the same model has).
TEST(EvalVariant, KilnMemoryEvalOnly) {
  const auto full = test::run_kiln("memory resnet18_small --batch 8 --device cpu --image-size 40");
  const auto eval =
      test::run_kiln("memory resnet18_small --batch 8 --device cpu --image-size 40 --eval-only");
  ASSERT_EQ(full.code, 0) << full.out;
  ASSERT_EQ(eval.code, 0) << eval.out;
  for (const char* region : {"grads_f32", "moment1", "bn_saved", "input_b"}) {
    EXPECT_NE(full.out.find(region), std::string::npos) << region;
    EXPECT_EQ(eval.out.find(region), std::string::npos) << region << " in\n" << eval.out;
  }
  EXPECT_NE(eval.out.find("params_f32"), std::string::npos) << eval.out;
}

// kiln eval takes --val-crop-size (it compiles at that size) and prints what evaluate() gives.
TEST(EvalVariant, KilnEvalCompilesAtTheValCrop) {
  const std::string data = fresh_dir("cli_data");
  test::write_jpeg_folder(data);
  const std::string out = fresh_dir("cli_run");
  const std::string common = " --model resnet18_small --data folder --data-dir " + data +
                             " --batch-size 4 --workers 1 --progress none --device cpu";
  const auto trained = test::run_kiln("train" + common + " --image-size 16 --epochs 1 --output " +
                                      out + " --val-crop-size 20 --val-resize-size 24");
  ASSERT_EQ(trained.code, 0) << trained.out;
  const auto eval = test::run_kiln("eval" + common + " --weights " + out +
                                   "/last.safetensors --val-crop-size 20 --val-resize-size 24");
  ASSERT_EQ(eval.code, 0) << eval.out;
  TrainConfig c;
  c.model = "resnet18_small";
  c.data = "folder";
  c.data_dir = data;
  c.batch_size = 4;
  c.workers = 1;
  c.device = "cpu";
  c.progress = "none";
  c.val_crop_size = 20;
  c.val_resize_size = 24;
  c.init_from = out + "/last.safetensors";
  const TrainSummary s = evaluate(c);
  char line[128];
  std::snprintf(line, sizeof line, "test top-1 %.2f%%, top-5 %.2f%%, loss %.4f", s.final_top1,
                s.final_top5, s.final_loss);
  EXPECT_NE(eval.out.find(line), std::string::npos) << line << " not in\n" << eval.out;
}

}  // namespace
}  // namespace kiln
