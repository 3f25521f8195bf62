// Which step statistics end a run as diverged (the trainer's rule, apart so that it can be
// tested without AMP on the CPU). An overflowed AMP step changed nothing and halved the scale,
// so it is not a failure, unless the scale is at its floor of 1 and keeps overflowing: then the
// model itself has diverged. A non-finite loss from a step that was applied is a failure.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

#include "kiln/task/engine.h"

namespace kiln {

class DivergenceWatch {
 public:
  static constexpr int64_t kMaxFloorOverflows = 50;

  // Why the run must stop after this step, or "" to go on.
  std::string observe(const StepStats& s) {
    if (s.overflow) {
      floor_overflows_ = s.loss_scale <= 1.0f ? floor_overflows_ + 1 : 0;
      if (floor_overflows_ >= kMaxFloorOverflows) {
        return "AMP's loss scale sat at its floor of 1 for " + std::to_string(floor_overflows_) +
               " overflowing steps in a row";
      }
      return "";
    }
    floor_overflows_ = 0;
    if (!std::isfinite(s.loss)) return "the training loss is " + std::to_string(s.loss);
    return "";
  }

 private:
  int64_t floor_overflows_ = 0;
};

}  // namespace kiln
