// How compile-time engine timing (cuda/conv_engines.cpp) reads each run of a cuDNN engine, as a
// rule in plain C++ so that the CPU-only tests check it. A candidate's first run may include
// loading its kernel: on the H100 first runs of 13-57 ms were seen for engines of 0.6-2 ms, and
// a 56.8 ms load once counted as the stem's fastest engine's time, so that ResNet-50's stem ran
// a 1.5 ms engine instead of a 0.6 ms one (bench/RESULTS.md, twenty-second session). Such a
// first run is now run again, and the repeat decides.
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace kiln {

// A warm-up run longer than this counts as the first measurement: FP32 VGG's slowest engines
// take seconds a run, and warming them up as well would double that.
inline constexpr float kSlowRunMs = 50.0f;
// A first run may include loading the kernel: it gives up only past this...
inline constexpr float kLoadSuspectMs = 20.0f;
// ...and one past the give-up time or past kSlowRunMs, but within this, is run again first.
inline constexpr float kLoadMs = 250.0f;

// What to do with run `r` (0-based; the first `untimed` are warm-ups) that took `ms`.
struct RunJudgement {
  bool again = false;                  // run it once more and judge that run in its place
  bool record = false;                 // the run is a measurement: keep its time
  bool counts_as_first_timed = false;  // a warm-up that long is the first timed run
  bool give_up = false;                // stop timing this engine (after recording, if recorded)
};
// `ran_again`: the first run was already repeated once.
RunJudgement judge_run(int r, int untimed, bool ran_again, float ms, float give_up_ms);

// Times one engine: `run` executes it once and returns the run's milliseconds, or a negative
// number when it failed. `untimed` warm-ups then `timed` timed runs, each read by judge_run;
// their times are appended to `times`. False when the engine failed or was given up on, with
// the reason in `dropped`.
bool time_candidate(const std::function<float()>& run, int untimed, int timed, float give_up_ms,
                    std::vector<float>& times, std::string& dropped);

}  // namespace kiln
