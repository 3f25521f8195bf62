// Learning-rate schedules. The rate is computed on the host per step and written
// to a device scalar, so a schedule never forces a CUDA Graph re-capture.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kiln {

struct LrSchedule {
  // constant, step, multistep, cosine, poly, onecycle
  std::string kind = "cosine";
  float base_lr = 0.1f;
  float min_lr = 0.0f;              // cosine floor
  float gamma = 0.1f;               // step / multistep factor
  int64_t step_size = 30;           // step: epochs between decays
  std::vector<int64_t> milestones;  // multistep: epochs
  float power = 1.0f;               // poly
  double warmup_epochs = 0;         // linear warm-up from warmup_start * base_lr; onecycle: the
                                    // rising phase (pct_start = warmup_epochs / epochs)
  float warmup_start = 0.0f;
  // onecycle (PyTorch's OneCycleLR defaults): rise for pct_start of the run from
  // base/div_factor, cosine down to base/(div_factor*final_div_factor).
  float pct_start = 0.3f, div_factor = 25.0f, final_div_factor = 1e4f;
};

// Rate for `step` (0-based) of a run of `total_steps`, `steps_per_epoch` steps an epoch.
float lr_at(const LrSchedule& s, int64_t step, int64_t total_steps, int64_t steps_per_epoch);

// Validates a schedule (unknown kind, negative values, a flag its kind does not read) with an
// error naming the flag; the second form also checks it against the run's length.
void check_schedule(const LrSchedule& s);
void check_schedule(const LrSchedule& s, int64_t epochs);

}  // namespace kiln
