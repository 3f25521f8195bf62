#include "backend/engine_timing_rule.h"

#include "kiln/core/log.h"

namespace kiln {

RunJudgement judge_run(int r, int untimed, bool ran_again, float ms, float give_up_ms) {
  RunJudgement j;
  const bool warm_up = r < untimed;
  if (warm_up && r == 0 && !ran_again && ms <= kLoadMs &&
      (ms > kSlowRunMs || (ms > give_up_ms && ms > kLoadSuspectMs))) {
    j.again = true;
    return j;
  }
  if (!warm_up) {
    j.record = true;
  } else if (ms > kSlowRunMs) {
    j.record = j.counts_as_first_timed = true;
  }
  // A warm-up gives up only past kLoadSuspectMs (it may include loading the kernel).
  j.give_up = ms > give_up_ms && (j.record || ms > kLoadSuspectMs);
  return j;
}

bool time_candidate(const std::function<float()>& run, int untimed, int timed, float give_up_ms,
                    std::vector<float>& times, std::string& dropped) {
  bool ran_again = false;
  for (int r = 0; r < untimed + timed; ++r) {
    const float ms = run();
    if (ms < 0.0f) {
      dropped = "it failed to run";
      return false;
    }
    const RunJudgement j = judge_run(r, untimed, ran_again, ms, give_up_ms);
    if (j.again) {
      log_debug("  first run ", ms, " ms: run again (it may have been loading the kernel)");
      ran_again = true;
      --r;
      continue;
    }
    if (j.record) times.push_back(ms);
    if (j.counts_as_first_timed) r = untimed;  // the loop goes on with the remaining timed - 1
    if (j.give_up) {
      dropped = "a run took " + std::to_string(ms) + " ms, past " + std::to_string(give_up_ms);
      return false;
    }
  }
  return true;
}

}  // namespace kiln
