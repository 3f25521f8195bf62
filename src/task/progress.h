// Progress display for the Trainer: a bar redrawn in place on a terminal, plain lines
// (every ~10% of an epoch) when stdout is a file or a pipe, or nothing.
#pragma once
#include <cstdint>
#include <string>

#include "kiln/io/metrics.h"

namespace kiln {

class Progress {
 public:
  explicit Progress(const std::string& mode);
  // loss: the running mean so far, NaN before the first step's statistics have arrived.
  void update(int64_t epoch, int64_t epochs, int64_t step, int64_t steps, double loss,
              double images_per_second, float lr, double elapsed_seconds);
  // The loader's own rate and the share of the epoch the step waited for it, shown beside the
  // step's images/s from the next update on.
  void set_input(double loader_images_per_second, double wait_fraction);
  void finish();
  void line(int64_t epoch, int64_t epochs, double seconds, const MetricsRow& row);

 private:
  bool bar_ = false, plain_ = false;
  int64_t last_decile_ = -1;
  bool drawn_ = false;
  double loader_ips_ = 0, wait_fraction_ = 0;
};

}  // namespace kiln
