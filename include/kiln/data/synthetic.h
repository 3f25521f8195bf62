// Synthetic data for benchmarks (SPEC Q3 measures on synthetic data): sample i is a pure
// function of (seed, i), so it needs no memory and any worker can make any sample.
#pragma once
#include <cstdint>
#include <string>

#include "kiln/data/dataset.h"

namespace kiln {

class SyntheticDataset : public Dataset {
 public:
  SyntheticDataset(int64_t samples, int64_t height, int64_t width, int64_t channels,
                   int64_t classes, uint64_t seed);

  int64_t size() const override { return samples_; }
  int64_t num_classes() const override { return classes_; }
  Sample sample(int64_t index) const override;
  std::string describe() const override;

 private:
  int64_t samples_, height_, width_, channels_, classes_;
  uint64_t seed_;
};

}  // namespace kiln
