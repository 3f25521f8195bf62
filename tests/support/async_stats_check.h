// Engine::train_step_async against train_step (tests/e2e on the CPU, tests/gpu on CUDA): two
// engines with the same seed train the same batches, one reading its statistics at every step,
// the other one step late through Backend::read_later. The late statistics must be the same
// numbers, step for step (nothing arrives on the first call; pending_stats() gives the last),
// and the weights after the steps the same bits: reading late changes when the host looks,
// never what the device computes.
#pragma once
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "kiln/blueprint/zoo.h"
#include "kiln/core/error.h"
#include "kiln/task/engine.h"
#include "support/learnable_batch.h"

namespace kiln::test {

inline void async_stats_equal_sync(const std::string& model, const EngineOptions& o, int steps) {
  const BluePrint bp = make_model(model);
  const LearnableBatch b = learnable_batch(bp, o.compile.batch, 9);
  Engine sync(bp, o), late(bp, o);
  for (Engine* e : {&sync, &late}) {
    e->lock_memory();
    e->compile(5);
  }
  std::vector<StepStats> want;
  std::vector<std::optional<StepStats>> got;
  for (int i = 0; i < steps; ++i) {
    const float lr = 0.05f / static_cast<float>(i + 1);
    want.push_back(sync.train_step(b.images.data(), b.labels.data(), lr));
    got.push_back(late.train_step_async(b.images.data(), b.labels.data(), lr));
  }
  got.push_back(late.pending_stats());
  EXPECT_FALSE(got[0].has_value()) << "the first step has no step before it";
  EXPECT_FALSE(late.pending_stats().has_value()) << "pending_stats() hands each step over once";
  for (int i = 0; i < steps; ++i) {
    const std::optional<StepStats>& s = got[static_cast<size_t>(i + 1)];
    ASSERT_TRUE(s.has_value()) << "step " << i;
    EXPECT_EQ(s->loss, want[static_cast<size_t>(i)].loss) << "step " << i;
    EXPECT_EQ(s->top1, want[static_cast<size_t>(i)].top1) << "step " << i;
    EXPECT_EQ(s->top5, want[static_cast<size_t>(i)].top5) << "step " << i;
    EXPECT_EQ(s->overflow, want[static_cast<size_t>(i)].overflow) << "step " << i;
    EXPECT_EQ(s->loss_scale, want[static_cast<size_t>(i)].loss_scale) << "step " << i;
  }
  for (const ParamDesc& d : sync.program().params) {
    EXPECT_EQ(sync.read_param(d.name), late.read_param(d.name)) << d.name;
  }
}

// Misuse of the late reads is a clear error: a ticket collected twice, one never issued, a
// tensor too large to read late.
inline void late_read_misuse_is_an_error(Engine& e) {
  Backend& be = e.backend();
  const Program& p = e.program();
  const uint64_t t = be.read_later(p.tensor(p.io.loss));
  float loss = 0.0f;
  be.collect(t, &loss);
  EXPECT_THROW(be.collect(t, &loss), Error);
  EXPECT_THROW(be.collect(t + 1000, &loss), Error);
  const DTensor& big = p.tensor(p.io.staged_images[0]);
  ASSERT_GT(big.bytes(), Backend::kLateReadBytes);
  EXPECT_THROW(be.read_later(big), Error);
}

}  // namespace kiln::test
