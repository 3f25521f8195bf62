// A batch a network can learn, for the whole-step tests: each class adds its own fixed
// pattern (unit normal) to the noise (normal, 0.5), so logits differ by class, the loss falls
// when the step trains, and the gradient is not one class's alone. Sample i has class
// (i * label_step) % classes. Deterministic in `seed`: the patterns draw first, then each
// sample's noise in order.
#pragma once
#include <cstdint>
#include <vector>

#include "kiln/blueprint/blueprint.h"
#include "kiln/core/rng.h"

namespace kiln::test {

struct LearnableBatch {
  std::vector<float> images;  // NHWC
  std::vector<int32_t> labels;
};

inline LearnableBatch learnable_batch(const BluePrint& bp, int64_t n, uint64_t seed,
                                      int64_t label_step = 1) {
  const int64_t per = int64_t{bp.input.height} * bp.input.width * bp.input.channels;
  Rng rng(seed);
  std::vector<float> pattern(static_cast<size_t>(bp.num_classes * per));
  for (float& x : pattern) x = static_cast<float>(rng.normal());
  LearnableBatch b;
  b.images.resize(static_cast<size_t>(n * per));
  b.labels.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const auto c = static_cast<int32_t>((i * label_step) % bp.num_classes);
    b.labels[static_cast<size_t>(i)] = c;
    for (int64_t j = 0; j < per; ++j) {
      b.images[static_cast<size_t>(i * per + j)] =
          pattern[static_cast<size_t>(c * per + j)] + 0.5f * static_cast<float>(rng.normal());
    }
  }
  return b;
}

}  // namespace kiln::test
