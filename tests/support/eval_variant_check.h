// Evaluation through an evaluation variant (Engine::eval_variant: the model compiled at another
// input size, evaluation only, over its training engine's weight regions) against the plain
// reference: a fresh engine compiled at that size, with every weight region of the training
// engine (master weights, FP16 compute copies, BatchNorm statistics, their EMA copies) written
// in. Shared by the CPU test (e2e/eval_variant_test.cpp, exact) and the CUDA one
// (gpu/gpu_eval_variant_test.cpp, within a tolerance).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>

#include "kiln/blueprint/zoo.h"
#include "kiln/data/image_codec.h"
#include "kiln/task/engine.h"
#include "support/learnable_batch.h"
#include "unit/data_test_util.h"

namespace kiln::test {

inline BluePrint model_at(const std::string& model, int size) {
  ZooOptions zo;
  zo.image_size = size;
  return make_model(model, zo);
}

inline EngineOptions variant_test_options(const std::string& device, bool amp) {
  EngineOptions o;
  o.device = device;
  o.compile.batch = 4;
  o.compile.amp = amp;
  o.compile.ema = true;
  o.compile.ema_decay = 0.5f;  // the EMA stays a few steps' movement away from the live weights
  return o;
}

// Every region of every parameter and buffer that `to` has, read from `from`: values that are
// exact in the region's dtype, so the copy is exact.
inline void copy_weight_regions(Engine& from, Engine& to) {
  for (const ParamDesc& d : to.program().params) {
    for (Region r : {Region::params_f32, Region::params_f16, Region::ema_f32, Region::ema_f16}) {
      if (d.tensor[static_cast<size_t>(r)] != kNoTensor)
        to.write_param(d.name, from.read_param(d.name, r), r);
    }
  }
  for (const BufferDesc& b : to.program().buffers) {
    to.write_param(b.name, from.read_param(b.name));
    to.write_param(b.name, from.read_param(b.name, Region::ema_bn_running), Region::ema_bn_running);
  }
}

// Trains `model` at `train_size` for a few steps, evaluates a batch of `val_size` through the
// variant and through the fresh reference (live and EMA weights, whole and partial batch),
// trains one more step and compares again (the variant sees the new weights with no refresh).
// `tol` 0: equal bit for bit; else the losses within tol x (1 + |loss|) and the hits unchecked.
inline void check_variant_equals_fresh_engine(const std::string& device, bool amp,
                                              const std::string& model, int train_size,
                                              int val_size, double tol) {
  const BluePrint train_bp = model_at(model, train_size), val_bp = model_at(model, val_size);
  const EngineOptions o = variant_test_options(device, amp);
  Engine owner(train_bp, o);
  owner.lock_memory();
  owner.compile(7);
  auto step = [&](uint64_t seed) {
    const LearnableBatch b = learnable_batch(train_bp, 4, seed);
    owner.train_step(b.images.data(), b.labels.data(), 0.05f);
  };
  for (uint64_t s = 0; s < 3; ++s) step(40 + s);
  std::unique_ptr<Engine> variant = owner.eval_variant(val_bp);
  const LearnableBatch probe = learnable_batch(val_bp, 4, 999);

  float before[2] = {0, 0};
  for (int round = 0; round < 2; ++round) {
    Engine fresh(val_bp, o);
    fresh.lock_memory();
    fresh.compile(1);
    copy_weight_regions(owner, fresh);
    for (int ema = 0; ema < 2; ++ema) {
      for (int64_t valid : {4, 3}) {
        SCOPED_TRACE("round " + std::to_string(round) + (ema ? " EMA" : " live") + ", " +
                     std::to_string(valid) + " valid");
        const StepStats v =
            variant->eval_batch(probe.images.data(), probe.labels.data(), valid, ema != 0);
        const StepStats f =
            fresh.eval_batch(probe.images.data(), probe.labels.data(), valid, ema != 0);
        ASSERT_TRUE(std::isfinite(v.loss));
        if (tol == 0) {
          EXPECT_EQ(v.loss, f.loss);
          EXPECT_EQ(v.top1, f.top1);
          EXPECT_EQ(v.top5, f.top5);
        } else {
          EXPECT_NEAR(v.loss, f.loss, tol * (1.0 + std::fabs(f.loss)));
        }
        if (valid == 4) {
          if (round == 0) before[ema] = v.loss;
          // The step in between moved the weights (and their EMA): a variant that had copied
          // them once would still give the first round's loss.
          if (round == 1) EXPECT_NE(v.loss, before[ema]);
        }
      }
    }
    // The EMA pass reads other weights and statistics than the live one.
    EXPECT_NE(before[0], before[1]);
    step(50);
  }
}

// root/{train,test}/c{0,1}/*.jpg of assorted sizes around the crops the tests use (16 to 20,
// after a resize to 24): four training and two test images a class.
inline void write_jpeg_folder(const std::string& root) {
  const int64_t sizes[][2] = {{26, 24}, {24, 29}, {28, 28}};
  for (int c = 0; c < 2; ++c) {
    for (int i = 0; i < 6; ++i) {
      const auto& s = sizes[i % 3];
      const std::string split = i < 4 ? "train" : "test";
      data_test::write_file(
          root + "/" + split + "/c" + std::to_string(c) + "/g" + std::to_string(i) + ".jpg",
          encode_jpeg(data_test::smooth_pattern(s[0], s[1], 3, 5 * c + i), 92));
    }
  }
}

}  // namespace kiln::test
