// The trainer's divergence rule (task/divergence_watch.h), fed step statistics directly: the CPU
// backend has no AMP, so this is where the loss-scale-floor stop is tested.
#include "task/divergence_watch.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace kiln {
namespace {

StepStats applied(float loss) {
  StepStats s;
  s.loss = loss;
  s.loss_scale = 65536;
  return s;
}
StepStats overflowed(float scale) {
  StepStats s;
  s.loss = std::numeric_limits<float>::infinity();  // what an overflowed step reports
  s.overflow = true;
  s.loss_scale = scale;
  return s;
}

TEST(DivergenceWatch, FiniteAppliedStepsGoOn) {
  DivergenceWatch w;
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(w.observe(applied(2.3f - 0.001f * i)), "");
}

TEST(DivergenceWatch, NonFiniteLossOfAnAppliedStepStops) {
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    DivergenceWatch w;
    EXPECT_EQ(w.observe(applied(1.0f)), "");
    const std::string why = w.observe(applied(bad));
    EXPECT_NE(why.find("the training loss is"), std::string::npos) << why;
  }
}

TEST(DivergenceWatch, OverflowsAboveTheFloorAreAmpsNormalBackOff) {
  DivergenceWatch w;
  // The scale halves on each overflow from 65536 down to 2: 15 overflows, none at the floor.
  for (float scale = 65536; scale >= 2; scale /= 2)
    EXPECT_EQ(w.observe(overflowed(scale)), "") << scale;
  // Thousands of overflows above the floor never stop the run either.
  for (int i = 0; i < 5000; ++i) EXPECT_EQ(w.observe(overflowed(2.0f)), "");
}

TEST(DivergenceWatch, ScaleStuckAtItsFloorStopsAfterFiftyOverflowsInARow) {
  DivergenceWatch w;
  for (int64_t i = 1; i < DivergenceWatch::kMaxFloorOverflows; ++i) {
    ASSERT_EQ(w.observe(overflowed(1.0f)), "") << "stopped after " << i;
  }
  const std::string why = w.observe(overflowed(1.0f));
  EXPECT_NE(why.find("floor of 1 for 50 overflowing steps in a row"), std::string::npos) << why;
}

TEST(DivergenceWatch, AnAppliedStepOrAHigherScaleResetsTheFloorCount) {
  for (const StepStats reset : {applied(1.5f), overflowed(2.0f)}) {
    DivergenceWatch w;
    for (int64_t i = 1; i < DivergenceWatch::kMaxFloorOverflows; ++i)
      ASSERT_EQ(w.observe(overflowed(1.0f)), "");
    EXPECT_EQ(w.observe(reset), "");
    for (int64_t i = 1; i < DivergenceWatch::kMaxFloorOverflows; ++i) {
      ASSERT_EQ(w.observe(overflowed(1.0f)), "") << "the count was not reset: stopped after " << i;
    }
    EXPECT_NE(w.observe(overflowed(1.0f)), "");
  }
}

}  // namespace
}  // namespace kiln
