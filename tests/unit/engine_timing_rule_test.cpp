// Compile-time engine timing's reading of each run (src/backend/engine_timing_rule.h), driven by
// scripted run times: a first run that may be the kernel loading is repeated and the repeat
// decides; slow engines still cost one run; a failing or slow engine is dropped with its reason.
#include "backend/engine_timing_rule.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kiln {
namespace {

// Times an engine whose runs take `script` in turn (the last repeats); how many runs it took.
struct Scripted {
  std::vector<float> script;
  size_t runs = 0;
  std::vector<float> times;
  std::string dropped;
  bool ok = false;
};
Scripted time_scripted(std::vector<float> script, int untimed, int timed, float give_up_ms) {
  Scripted s;
  s.script = std::move(script);
  auto run = [&s]() { return s.script[std::min(s.runs++, s.script.size() - 1)]; };
  s.ok = time_candidate(run, untimed, timed, give_up_ms, s.times, s.dropped);
  return s;
}

constexpr float kNoBest = 1e30f;  // the first candidate: nothing to give up against

// The H100's case: the stem's fastest engine (0.62 ms a run) took 56.8 ms on its first run.
// It used to count as a 56.8 ms measurement; the repeat shows the engine's time.
TEST(EngineTimingRule, ALoadingFirstRunIsRepeatedAndTheRepeatDecides) {
  const Scripted s = time_scripted({56.8f, 0.62f}, 1, 3, kNoBest);
  EXPECT_TRUE(s.ok);
  EXPECT_EQ(s.times, (std::vector<float>{0.62f, 0.62f, 0.62f}));
  EXPECT_EQ(s.runs, 5u) << "the first run, its repeat, then three timed runs";
}

// A later candidate (best so far 0.6 ms, give up past 1.2) whose first run took 29 ms loading:
// it used to be dropped; its repeat is a warm-up and its timed runs are judged as usual.
TEST(EngineTimingRule, ALaterCandidateIsNotDroppedForItsLoading) {
  const Scripted fast = time_scripted({29.0f, 0.5f}, 1, 1, 1.2f);
  EXPECT_TRUE(fast.ok) << fast.dropped;
  EXPECT_EQ(fast.times, (std::vector<float>{0.5f}));
  const Scripted slow = time_scripted({29.0f, 1.8f}, 1, 1, 1.2f);
  EXPECT_FALSE(slow.ok);
  EXPECT_EQ(slow.times, (std::vector<float>{1.8f})) << "the timed run is kept, then given up";
  EXPECT_NE(slow.dropped.find("past"), std::string::npos) << slow.dropped;
}

// A first run under kLoadSuspectMs is an ordinary warm-up, even past the give-up time: it is not
// repeated and not held against the engine.
TEST(EngineTimingRule, AShortFirstRunIsAnOrdinaryWarmUp) {
  const Scripted s = time_scripted({15.0f, 0.5f}, 1, 2, 1.2f);
  EXPECT_TRUE(s.ok);
  EXPECT_EQ(s.times, (std::vector<float>{0.5f, 0.5f}));
  EXPECT_EQ(s.runs, 3u);
}

// Engines that really are slow: a first run past kLoadMs counts as the first measurement (FP32
// VGG's engines of seconds a run are not warmed up twice); one whose repeat is still past
// kSlowRunMs likewise; both are given up on past the give-up time.
TEST(EngineTimingRule, ReallySlowEnginesCostNoExtraRuns) {
  const Scripted seconds = time_scripted({700.0f}, 1, 3, kNoBest);
  EXPECT_TRUE(seconds.ok);
  EXPECT_EQ(seconds.times, (std::vector<float>{700.0f, 700.0f, 700.0f}));
  EXPECT_EQ(seconds.runs, 3u) << "the long warm-up is the first of the three timed runs";
  const Scripted cut = time_scripted({700.0f}, 1, 3, 10.0f);
  EXPECT_FALSE(cut.ok);
  EXPECT_EQ(cut.runs, 1u);
  const Scripted slow = time_scripted({80.0f, 75.0f}, 1, 3, kNoBest);
  EXPECT_TRUE(slow.ok);
  EXPECT_EQ(slow.times, (std::vector<float>{75.0f, 75.0f, 75.0f}));
  EXPECT_EQ(slow.runs, 4u) << "the first run, its repeat (the first measurement), two more";
}

// The first run is repeated once at most, and timed runs never are.
TEST(EngineTimingRule, OnlyTheFirstRunIsRepeatedAndOnce) {
  const Scripted twice = time_scripted({60.0f, 60.0f, 0.5f}, 1, 2, 1.2f);
  EXPECT_FALSE(twice.ok) << "the repeat still at 60 ms counts, and is past the give-up time";
  EXPECT_EQ(twice.runs, 2u);
  EXPECT_EQ(twice.times, (std::vector<float>{60.0f}));
  // Round 2 of time_engines: no warm-up, a generous give-up; a long run is a measurement.
  const Scripted timed_only = time_scripted({60.0f, 0.5f}, 0, 2, kNoBest);
  EXPECT_TRUE(timed_only.ok);
  EXPECT_EQ(timed_only.times, (std::vector<float>{60.0f, 0.5f}));
  EXPECT_EQ(judge_run(1, 2, false, 60.0f, kNoBest).again, false) << "a second warm-up";
}

TEST(EngineTimingRule, AFailedRunDropsTheEngine) {
  const Scripted s = time_scripted({0.5f, -1.0f}, 1, 3, kNoBest);
  EXPECT_FALSE(s.ok);
  EXPECT_EQ(s.dropped, "it failed to run");
  EXPECT_EQ(s.runs, 2u);
}

}  // namespace
}  // namespace kiln
