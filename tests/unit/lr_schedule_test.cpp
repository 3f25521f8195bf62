// The learning-rate schedules against PyTorch's schedulers' closed forms at chosen steps (the
// expected values were computed from the formula in each comment; no PyTorch runs here), and
// the flags a schedule does not read are refused.
#include "kiln/algo/lr_schedule.h"

#include <gtest/gtest.h>

#include <string>

#include "kiln/core/error.h"

namespace kiln {
namespace {

// 10 steps an epoch, 10 epochs: epoch e starts at step 10 e.
constexpr int64_t kSpe = 10, kTotal = 100;

// lr_at computes in double and returns a float: FP32's 2^-24 relative rounding, with room.
void expect_lr(const LrSchedule& s, int64_t step, double want) {
  const float got = lr_at(s, step, kTotal, kSpe);
  EXPECT_NEAR(got, want, 1e-6 * want + 1e-12) << s.kind << " at step " << step;
}

LrSchedule sched(const std::string& kind) {
  LrSchedule s;
  s.kind = kind;
  s.base_lr = 0.1f;
  return s;
}

std::string refusal(const LrSchedule& s, int64_t epochs = 10) {
  try {
    check_schedule(s, epochs);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << s.kind << " was accepted";
  return "";
}

TEST(LrSchedule, Constant) {
  const LrSchedule s = sched("constant");
  for (int64_t t : {0, 37, 99}) expect_lr(s, t, 0.1);
}

// Warm-up (torchvision's LinearLR per step): base * (start + (1 - start) * t / W), W = 20 steps.
TEST(LrSchedule, ConstantWithWarmup) {
  LrSchedule s = sched("constant");
  s.warmup_epochs = 2;
  s.warmup_start = 0.01f;
  expect_lr(s, 0, 0.1 * 0.01);
  expect_lr(s, 10, 0.1 * (0.01 + 0.99 * 0.5));
  expect_lr(s, 20, 0.1);
  expect_lr(s, 99, 0.1);
}

// StepLR: base * gamma^floor(epoch / step_size), epoch = t / 10.
TEST(LrSchedule, Step) {
  LrSchedule s = sched("step");
  s.step_size = 3;
  s.gamma = 0.5f;
  expect_lr(s, 0, 0.1);
  expect_lr(s, 29, 0.1);
  expect_lr(s, 30, 0.05);
  expect_lr(s, 65, 0.025);
  expect_lr(s, 99, 0.0125);
}

// With warm-up, the decays still fall at the epochs counted from the run's start (as timm's
// StepLRScheduler; torchvision's reference counts them from the warm-up's end).
TEST(LrSchedule, StepWithWarmup) {
  LrSchedule s = sched("step");
  s.step_size = 3;
  s.gamma = 0.5f;
  s.warmup_epochs = 1;
  expect_lr(s, 5, 0.1 * 0.5);  // warmup_start 0: base * t / 10
  expect_lr(s, 10, 0.1);
  expect_lr(s, 30, 0.05);
}

// MultiStepLR: base * gamma^(milestones passed), a milestone passed when epoch >= it.
TEST(LrSchedule, Multistep) {
  LrSchedule s = sched("multistep");
  s.milestones = {2, 5};
  s.gamma = 0.1f;
  expect_lr(s, 19, 0.1);
  expect_lr(s, 20, 0.01);
  expect_lr(s, 49, 0.01);
  expect_lr(s, 50, 0.001);
  expect_lr(s, 99, 0.001);
  s.warmup_epochs = 1;
  expect_lr(s, 2, 0.1 * 0.2);
  expect_lr(s, 20, 0.01);
}

// CosineAnnealingLR per step: min + (base - min) * (1 + cos(pi * t / T)) / 2, T = 100.
TEST(LrSchedule, Cosine) {
  LrSchedule s = sched("cosine");
  s.min_lr = 0.001f;
  expect_lr(s, 0, 0.1);
  expect_lr(s, 25, 0.0855017856687341);
  expect_lr(s, 50, 0.0505);
  expect_lr(s, 99, 0.0010244252618962857);
}

// With W = 20 warm-up steps the cosine spans the rest: t' = t - 20, T = 80 (torchvision's
// reference: LinearLR then CosineAnnealingLR(T_max = epochs - warmup)).
TEST(LrSchedule, CosineWithWarmup) {
  LrSchedule s = sched("cosine");
  s.min_lr = 0.001f;
  s.warmup_epochs = 2;
  expect_lr(s, 0, 0.0);
  expect_lr(s, 10, 0.05);
  expect_lr(s, 20, 0.1);
  expect_lr(s, 40, 0.0855017856687341);
  expect_lr(s, 60, 0.0505);
  expect_lr(s, 99, 0.0010381627060842165);
}

// PolynomialLR: base * (1 - t / T)^power.
TEST(LrSchedule, Poly) {
  LrSchedule s = sched("poly");
  s.power = 2;
  expect_lr(s, 0, 0.1);
  expect_lr(s, 50, 0.025);
  expect_lr(s, 90, 0.001);
}

// OneCycleLR(max_lr 0.1, total_steps 100, pct_start 0.3, div 25, final_div 1e4, cos): rises
// from 0.004 to 0.1 at step 29 (= 0.3 * 100 - 1), then falls to 4e-7 at step 99; inside a
// phase lr = end + (start - end) / 2 * (1 + cos(pi * pct)).
TEST(LrSchedule, Onecycle) {
  const LrSchedule s = sched("onecycle");
  expect_lr(s, 0, 0.004);
  expect_lr(s, 14, 0.04940133238789996);  // pct 14 / 29
  expect_lr(s, 29, 0.1);
  expect_lr(s, 64, 0.0500002);  // pct (64 - 29) / 70 = 0.5
  expect_lr(s, 99, 4e-7);
}

// --warmup-epochs 2 of 10 is the rising phase: OneCycleLR with pct_start 0.2 (peak at step 19).
TEST(LrSchedule, OnecycleWarmupIsItsRisingPhase) {
  LrSchedule s = sched("onecycle");
  s.warmup_epochs = 2;
  expect_lr(s, 0, 0.004);
  expect_lr(s, 10, 0.055963808582671956);  // pct 10 / 19
  expect_lr(s, 19, 0.1);
  expect_lr(s, 59, 0.0500002);  // pct (59 - 19) / 80
  expect_lr(s, 99, 4e-7);
}

TEST(LrSchedule, OnecycleWarmupMustEndBeforeTheRun) {
  LrSchedule s = sched("onecycle");
  s.warmup_epochs = 10;
  const std::string e = refusal(s, 10);
  EXPECT_NE(e.find("--warmup-epochs 10"), std::string::npos) << e;
  EXPECT_NE(e.find("--epochs 10"), std::string::npos) << e;
  s.warmup_epochs = 9.5;
  EXPECT_NO_THROW(check_schedule(s, 10));
}

TEST(LrSchedule, MilestonesOnlyWithMultistep) {
  for (const char* kind : {"constant", "step", "cosine", "poly", "onecycle"}) {
    LrSchedule s = sched(kind);
    s.milestones = {30, 60};
    const std::string e = refusal(s);
    EXPECT_NE(e.find("--milestones applies only to --sched multistep"), std::string::npos) << e;
    EXPECT_NE(e.find("add --sched multistep or drop --milestones"), std::string::npos) << e;
  }
  LrSchedule m = sched("multistep");
  EXPECT_NE(refusal(m).find("--sched multistep needs --milestones"), std::string::npos);
  m.milestones = {3, -1};
  EXPECT_NE(refusal(m).find("got -1"), std::string::npos);
  m.milestones = {3, 6};
  EXPECT_NO_THROW(check_schedule(m, 10));
}

}  // namespace
}  // namespace kiln
